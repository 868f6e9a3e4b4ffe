"""Bad numbers given to the schedule core are refused with a ValueError that names them; good
numbers of any numeric type (numpy integers and floats, Fraction) are accepted and give the same
results as Python ints and floats.

numpy is used here only to make the inputs; the schedule core must not import it (checked in a
fresh interpreter below).
"""

from __future__ import annotations

import subprocess
import sys
import time
from fractions import Fraction

import numpy as np
import pytest

from zbpp.schedules import Action, Costs, Kind, Memory, Schedule, available, build, simulate
from zbpp.schedules.registry import DEFAULT_MAX_TASKS, max_tasks, options_of, task_count

NAN, INF = float("nan"), float("inf")


# -- Costs and Memory ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(f=NAN), "Costs.f must be a finite number >= 0, got nan"),
        (dict(b=INF), "Costs.b must be a finite number >= 0, got inf"),
        (dict(w=-INF), "Costs.w must be a finite number >= 0, got -inf"),
        (dict(w=-1), "Costs.w must be a finite number >= 0, got -1"),
        (dict(f=[1, 2, NAN]), r"Costs.f\[2\] must be a finite number >= 0, got nan"),
        (dict(b=(0.5, INF)), r"Costs.b\[1\] must be a finite number >= 0, got inf"),
        (dict(comm=NAN), "Costs.comm must be a finite number >= 0, got nan"),
        (dict(comm=INF), "Costs.comm must be a finite number >= 0, got inf"),
        (dict(comm=[0.5, 0.5]), r"Costs.comm must be a finite number >= 0 \(one time for every message\), got \[0.5, 0.5\]"),
        (dict(f=True), "Costs.f must be a finite number >= 0, got True"),
        (dict(f="1"), "Costs.f must be a finite number >= 0 or a sequence of them .*got '1'"),
        (dict(f=[]), "Costs.f is empty"),
        (dict(f=[1, None]), r"Costs.f\[1\] must be a finite number >= 0, got None"),
        (dict(f=np.float64("nan")), "Costs.f must be a finite number >= 0, got nan"),
        (dict(comm=np.float32("inf")), "Costs.comm must be a finite number >= 0, got inf"),
        (dict(f=np.array([1.0, np.nan])), r"Costs.f\[1\] must be a finite number >= 0, got nan"),
        (dict(f=10**400), "Costs.f must be a finite number >= 0, got 1000000"),  # too large for a float
        (dict(f=1 + 2j), r"Costs.f must be a finite number >= 0 or a sequence of them .*got \(1\+2j\)"),
    ],
)
def test_bad_costs_are_refused_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Costs(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(activation=NAN), "Memory.activation must be a finite number >= 0, got nan"),
        (dict(wgrad=INF), "Memory.wgrad must be a finite number >= 0, got inf"),
        (dict(activation=[1, -INF]), r"Memory.activation\[1\] must be a finite number >= 0, got -inf"),
        (dict(activation=1, wgrad=False), "Memory.wgrad must be a finite number >= 0, got False"),
        (dict(activation=[1, 2], wgrad=[1]), "Memory.activation has 2 per-stage values but Memory.wgrad has 1"),
        (dict(activation=np.float64("nan")), "Memory.activation must be a finite number >= 0, got nan"),
    ],
)
def test_bad_memory_is_refused_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Memory(**kwargs)


def test_bad_task_record_is_refused_naming_the_record() -> None:
    records = [{"action": "F0.0", "start": 0.0, "end": NAN}, {"action": "BW0.0", "start": 1.0, "end": 2.0}]
    with pytest.raises(ValueError, match=r"task record .*'F0.0'.*'start' and 'end' must be finite numbers"):
        Costs.from_task_times(records, 1)


@pytest.mark.parametrize("num_stages, shown", [(0, "0"), (2.5, "2.5"), ("1", "'1'"), (True, "True")])
def test_bad_num_stages_of_task_times_is_refused_naming_it(num_stages: object, shown: str) -> None:
    """num_stages=0 blamed the first record ("stage 0 outside 0..-1"), 2.5 and '1' ended in a
    TypeError from range(), and True read as 1 stage; each must be named as the bad argument."""
    records = [{"action": "F0.0", "start": 0.0, "end": 1.0}, {"action": "BW0.0", "start": 1.0, "end": 3.0}]
    with pytest.raises(ValueError, match=rf"Costs.from_task_times: num_stages must be an integer >= 1, got {shown}"):
        Costs.from_task_times(records, num_stages)
    assert Costs.from_task_times(records, 1) == Costs(f=[1], b=[1], w=[1])  # by hand: BW split half and half

def test_numbers_of_any_numeric_type_are_accepted_and_give_the_same_result() -> None:
    """np.float32/np.int64/Fraction inputs simulate exactly as the equal Python floats do."""
    sched = build("zb-h1", num_ranks=4, num_microbatches=8)
    want = simulate(sched, Costs(f=1.0, b=[1.0, 2.0, 1.0, 0.5], w=0.5, comm=0.25), Memory(1.0, 1 / 3))
    got = simulate(
        sched,
        Costs(f=np.int64(1), b=np.array([1, 2, 1, 0.5]), w=Fraction(1, 2), comm=np.float32(0.25)),
        Memory(activation=np.float32(1), wgrad=Fraction(1, 3)),
    )
    assert (got.spans, got.peak_memory, got.makespan) == (want.spans, want.peak_memory, want.makespan)
    assert Memory(wgrad=Fraction(1, 3)).wgrad == 1 / 3
    assert Costs(f=np.float32(2)).f == 2.0 and type(Costs(f=np.float32(2)).f) is float


# -- sizes and options -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_ranks=4.0, num_microbatches=8), "num_ranks must be an integer >= 1, got 4.0"),
        (dict(num_ranks=True, num_microbatches=8), "num_ranks must be an integer >= 1, got True"),
        (dict(num_ranks=4, num_microbatches=np.float64(8)), "num_microbatches must be an integer >= 1, got 8.0"),
        (dict(num_ranks=np.int64(-2), num_microbatches=8), "num_ranks must be an integer >= 1, got"),
        (dict(num_ranks="4", num_microbatches=8), "num_ranks must be an integer >= 1, got '4'"),
    ],
)
def test_bad_sizes_are_refused_naming_the_argument(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build("zb-h1", **kwargs)


@pytest.mark.parametrize("chunks", [2.5, True, np.float64(2), "2", 0])
def test_bad_chunks_are_refused_naming_the_option(chunks: object) -> None:
    with pytest.raises(ValueError, match=r"interleaved-1f1b: chunks must be an integer >= 1, got"):
        build("interleaved-1f1b", num_ranks=4, num_microbatches=8, chunks=chunks)


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-h2", "zb-v", "dualpipe-v", "zb-auto"])
def test_numpy_integers_build_the_same_schedule_as_ints(name: str) -> None:
    opts = {"chunks": np.int32(3)} if "chunks" in options_of(name) else {}
    got = build(name, num_ranks=np.int64(3), num_microbatches=np.uint8(5), **opts)
    want = build(name, num_ranks=3, num_microbatches=5, **({"chunks": 3} if opts else {}))
    assert got == want
    assert type(got.num_ranks) is int and type(got.num_microbatches) is int


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Schedule(2.0, 2, 1, (0, 1), ((), ())), "Schedule.num_ranks must be an integer >= 1, got 2.0"),
        (lambda: Schedule(2, 2, 0, (0, 1), ((), ())), "Schedule.num_microbatches must be an integer >= 1, got 0"),
        (lambda: Schedule(2, 2, 1, (0, 1.0), ((), ())), r"Schedule.placement\[1\] must be an integer >= 0, got 1.0"),
        (lambda: Action(Kind.F, 1.5, 0), "Action.stage must be an integer >= 0, got 1.5"),
        (lambda: Action(Kind.F, 0, -1 + 0 * np.int64(0)), "Action.microbatch must be an integer >= 0, got"),
        (lambda: Action("X", 0, 0), "Action.kind must be one of F, B, W, BW, got 'X'"),
    ],
)
def test_bad_schedule_fields_are_refused_naming_the_field(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_numpy_integers_in_actions_become_ints() -> None:
    a = Action(Kind.B, np.int64(2), np.int16(5))
    assert a == Action(Kind.B, 2, 5) and type(a.stage) is int and str(a) == "B2.5"


# -- memory_limit of the automatic schedules -------------------------------------------------------
@pytest.mark.parametrize("name", ["zb-auto", "zbv-auto"])
@pytest.mark.parametrize("limit, shown", [(NAN, "nan"), (-INF, "-inf"), (-1.0, "-1.0"), (True, "True"), ("8", "'8'")])
def test_bad_memory_limit_is_refused_naming_it(name: str, limit: object, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"{name}: memory_limit .*must be a finite number >= 0, got {shown}"):
        build(name, num_ranks=2, num_microbatches=4, memory_limit=limit)


@pytest.mark.parametrize("name", ["zb-auto", "zbv-auto", "zbi-auto"])
@pytest.mark.parametrize("key, value, shown", [("costs", "x", r"'x' \(str\)"), ("memory", 3, r"3 \(int\)"),
                                               ("costs", Memory(), r"Memory\(.*\) \(Memory\)")])
def test_costs_or_memory_of_another_type_is_refused_naming_it(name: str, key: str, value: object, shown: str) -> None:
    kind = "Costs" if key == "costs" else "Memory"
    with pytest.raises(TypeError, match=rf"{name}: {key} must be a zbpp.schedules.{kind} \(or None.*got {shown}"):
        build(name, num_ranks=2, num_microbatches=4, **{key: value})


def test_memory_limit_of_any_real_type_holds() -> None:
    memory = Memory(activation=1, wgrad=Fraction(1, 3))
    for limit in (np.float32(3), Fraction(7, 2), np.int64(3)):
        sched = build("zb-auto", num_ranks=4, num_microbatches=8, memory=memory, memory_limit=limit)
        assert max(simulate(sched, Costs(), memory).peak_memory) <= float(limit) + 1e-9


def test_sums_that_overflow_a_float_are_refused_not_returned_as_inf_or_nan() -> None:
    """1e308 is a finite cost, but IEEE doubles end at about 1.8e308: four of them in a row are
    inf. Such sums gave a makespan of inf and a bubble rate of nan, a peak of inf, and the
    automatic schedules stalled (RuntimeError) or reported a deadlock."""
    assert 4 * 1e308 == INF  # rank 3's first forward ends after four of them
    sched = build("1f1b", num_ranks=4, num_microbatches=4)
    with pytest.raises(ValueError, match="simulate: the step's times overflow a float"):
        simulate(sched, Costs(f=1e308))
    with pytest.raises(ValueError, match="simulate: rank 0's memory overflows a float"):
        simulate(sched, Costs(), Memory(activation=1e308))  # 1F1B's rank 0 holds 4 at once
    for name, key in (("zb-auto", "f"), ("zbv-auto", "comm"), ("zbi-auto", "f")):
        with pytest.raises(ValueError, match=f"{name}: the costs are too large"):
            build(name, num_ranks=4, num_microbatches=4, costs=Costs(**{key: 1e308}))
    # below the limit nothing is refused: with f far above b + w, 1F1B's makespan is (m + p - 1) f
    # (b, w of 1 vanish in the rounding of 7e307, hence the tolerance of a few ulps)
    assert simulate(sched, Costs(f=1e307)).makespan == pytest.approx(7e307, rel=1e-12)


# -- the size limit --------------------------------------------------------------------------------
def test_a_huge_schedule_is_refused_at_once_with_its_size_and_the_limit() -> None:
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as info:
        build("zb-v", num_ranks=10**9, num_microbatches=8)
    assert time.perf_counter() - t0 < 1.0  # refused before anything is generated
    text = str(info.value)
    assert "zb-v with num_ranks=1000000000, num_microbatches=8" in text
    assert "11,999,999,994,000,000,000 tasks" in text  # 6 p (2p-1): ZB-V is built for 2p-1 microbatches
    assert f"limit of {DEFAULT_MAX_TASKS:,}" in text and "ZBPP_MAX_TASKS" in text


def test_zbpp_max_tasks_moves_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented way to change the limit works both ways, at the exact task count."""
    tasks = build("zb-h1", num_ranks=4, num_microbatches=8).num_tasks  # 96
    monkeypatch.setenv("ZBPP_MAX_TASKS", str(tasks))
    assert build("zb-h1", num_ranks=4, num_microbatches=8).num_tasks == tasks
    monkeypatch.setenv("ZBPP_MAX_TASKS", str(tasks - 1))
    with pytest.raises(ValueError, match=f"would create up to 96 tasks, more than the limit of 95"):
        build("zb-h1", num_ranks=4, num_microbatches=8)
    monkeypatch.setenv("ZBPP_MAX_TASKS", str(10**12))
    assert max_tasks() == 10**12


@pytest.mark.parametrize("value", ["lots", "0", "1.5"])
def test_a_bad_zbpp_max_tasks_is_named(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("ZBPP_MAX_TASKS", value)
    with pytest.raises(ValueError, match=f"environment variable ZBPP_MAX_TASKS must be an integer >= 1, got '{value}'"):
        build("1f1b", num_ranks=2, num_microbatches=2)


@pytest.mark.parametrize("name", available())
def test_task_count_bounds_what_is_built_and_is_exact_without_cut_down(name: str) -> None:
    """task_count is an upper bound of the tasks built; exact when the generator builds exactly
    the asked-for microbatches (m >= 2p), except where it is a bound by design: zb-auto is counted
    with two stages per rank (the default count), and DualPipeV runs some backwards as one BW."""
    for p, m in [(1, 1), (3, 2), (3, 7), (4, 9)]:
        built = build(name, num_ranks=p, num_microbatches=m).num_tasks
        bound = task_count(name, p, m)
        assert built <= bound, (p, m)
        if m >= 2 * p and name not in ("zb-auto", "dualpipe-v"):
            assert built == bound, (p, m, built, bound)


@pytest.mark.parametrize("name", available())
def test_realistic_sizes_are_under_the_limit(name: str) -> None:
    """512 ranks x 4096 microbatches (and ZB-V's 2p-1 at m=8) stay below the default limit."""
    opts = {"chunks": 2} if "chunks" in options_of(name) else {}
    assert task_count(name, 512, 4096, **opts) <= DEFAULT_MAX_TASKS
    assert task_count(name, 512, 8, **opts) <= DEFAULT_MAX_TASKS


def test_the_schedule_core_imports_neither_numpy_nor_torch() -> None:
    code = (
        "import sys; from zbpp.schedules import build, simulate, Costs, Memory; import zbpp.cli; "
        "simulate(build('zbv-auto', num_ranks=2, num_microbatches=3), Costs(1, 2, 1, 0.5), Memory(1, 0.5)); "
        "print(sorted(m for m in ('numpy', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _simulate_with(key: str, value: object) -> None:
    simulate(build("zb-h1", num_ranks=2, num_microbatches=2), **{key: value})


def _lower_bound_with(key: str, value: object) -> None:
    from zbpp.schedules.bounds import lower_bound

    lower_bound((0, 1), 2, **{key: value})


def _program_with(key: str, value: object) -> None:
    from zbpp.schedules.program import make_program

    make_program(build("zb-h1", num_ranks=2, num_microbatches=2), **{key: value})


@pytest.mark.parametrize("where, call, key, value, shown", [
    ("simulate", _simulate_with, "costs", Memory(1, 0.5), r"Memory\(.*\) \(Memory\)"),  # Memory in costs' place
    ("simulate", _simulate_with, "memory", Costs(), r"Costs\(.*\) \(Costs\)"),
    ("simulate", _simulate_with, "costs", {"f": 1}, r"\{'f': 1\} \(dict\)"),
    ("lower_bound", _lower_bound_with, "costs", Memory(), r"Memory\(.*\) \(Memory\)"),
    ("lower_bound", _lower_bound_with, "memory", 3, r"3 \(int\)"),
    ("make_program", _program_with, "costs", Memory(), r"Memory\(.*\) \(Memory\)"),
])
def test_simulate_bound_and_program_refuse_another_type_naming_it(where, call, key, value, shown) -> None:
    """The automatic schedules named a wrong type; simulate, lower_bound and make_program ended in
    an AttributeError ('Memory' object has no attribute 'charged') that named neither the call nor
    the argument. simulate(sched, Memory(...)), Memory in costs' place, is an easy slip."""
    kind = "Costs" if key == "costs" else "Memory"
    with pytest.raises(TypeError, match=rf"{where}: {key} must be a zbpp.schedules.{kind} \(or None.*got {shown}"):
        call(key, value)


def test_simulate_and_render_ascii_refuse_what_is_not_their_input() -> None:
    from zbpp.viz.ascii import render_ascii

    with pytest.raises(TypeError, match=r"simulate: schedule must be a zbpp.schedules.Schedule .*got 'zb-h1' \(str\)"):
        simulate("zb-h1")
    with pytest.raises(TypeError, match=r"render_ascii needs a SimResult .*got Schedule"):
        render_ascii(build("zb-h1", num_ranks=2, num_microbatches=2))


def test_zbv_auto_counts_the_seeds_it_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """zbv-auto tries ZB-V and DualPipeV as seeds, built for at least 2p-1 and 2p microbatches and
    then cut down to m. It was counted as 6pm tasks, so with m = 1 the limit let through a search
    that built some 2p times more (at p = 2000, m = 1 a 48-million-task ZB-V behind a count of
    12,000). By hand, p = 20, m = 1: its ZB-V seed has 6 * 20 * 39 = 4680 tasks (checked below on
    the generator itself) and DualPipeV's count is 6 * 20 * 40 = 4800, so at a limit of 4679 the
    build must be refused before anything is built; it used to go ahead (count 120)."""
    from zbpp.schedules.generators.vshape import _zbv_rank

    assert sum(len(_zbv_rank(20, 39, r)) for r in range(20)) == 6 * 20 * 39  # the seed as built
    monkeypatch.setenv("ZBPP_MAX_TASKS", str(6 * 20 * 39 - 1))
    with pytest.raises(ValueError, match="zbv-auto with num_ranks=20, num_microbatches=1 would create up to 4,800 tasks"):
        build("zbv-auto", num_ranks=20, num_microbatches=1)
    assert task_count("zbv-auto", 4, 100) == 6 * 4 * 100  # m >= 2p: the seeds build m microbatches


# -- from_torch_csv's placement and num_microbatches -----------------------------------------------
@pytest.mark.parametrize("key, value, message", [
    # int() truncated 0.9 to rank 0: the file loaded with stage 0 on rank 0, said nowhere
    ("placement", [0.9, 1], r"from_torch_csv: placement\[0\] must be an integer >= 0, got 0.9"),
    ("placement", [0, "1"], r"from_torch_csv: placement\[1\] must be an integer >= 0, got '1'"),
    ("placement", [0, True], r"from_torch_csv: placement\[1\] must be an integer >= 0, got True"),
    # a TypeError from comparing a str with an int, naming neither the argument nor its value
    ("num_microbatches", "3", r"from_torch_csv: num_microbatches must be an integer >= 1, got '3'"),
    ("num_microbatches", 2.5, r"from_torch_csv: num_microbatches must be an integer >= 1, got 2.5"),
])
def test_from_torch_csv_refuses_a_placement_or_count_that_is_no_integer(tmp_path, key, value, message) -> None:
    from zbpp.schedules import from_torch_csv, to_torch_csv

    path = tmp_path / "zbh1.csv"
    to_torch_csv(build("zb-h1", num_ranks=2, num_microbatches=2), path)
    with pytest.raises(ValueError, match=message):
        from_torch_csv(path, **{key: value})
    # the same integers, as numpy's, are taken: the schedule written, read back
    back = from_torch_csv(path, placement=[np.int64(0), np.int32(1)], num_microbatches=np.int64(2))
    assert back.orders == build("zb-h1", num_ranks=2, num_microbatches=2).orders and back.placement == (0, 1)
