"""Validation errors name what is wrong: the missing or duplicated task, or the deadlock cycle."""

from __future__ import annotations

import pytest

from zbpp.schedules import Action, Schedule, ScheduleError, build, simulate, validate
from zbpp.schedules.ir import loop_placement


def _sched(orders: list[list[str]], num_stages: int = 2, m: int = 1) -> Schedule:
    return Schedule(
        num_ranks=len(orders),
        num_stages=num_stages,
        num_microbatches=m,
        placement=loop_placement(len(orders)),
        orders=tuple(tuple(Action.parse(t) for t in o) for o in orders),
    )


def test_deadlock_is_reported_with_its_cycle() -> None:
    # rank 0 waits for the gradient of microbatch 1 before sending microbatch 1's forward.
    sched = _sched(
        [["F0.0", "B0.1", "F0.1", "B0.0", "W0.0", "W0.1"], ["F1.0", "F1.1", "B1.1", "B1.0", "W1.0", "W1.1"]],
        m=2,
    )
    with pytest.raises(ScheduleError) as err:
        validate(sched)
    msg = str(err.value)
    assert "deadlock" in msg
    # the cycle: B0.1 waits for B1.1, which waits for F1.1, which waits for F0.1, which rank 0 runs after B0.1
    for task in ("B0.1@rank0", "F0.1@rank0", "F1.1@rank1", "B1.1@rank1"):
        assert task in msg
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(sched)


def test_missing_task_is_named() -> None:
    sched = _sched([["F0.0", "B0.0"], ["F1.0", "B1.0", "W1.0"]])
    with pytest.raises(ScheduleError, match=r"task W0\.0 is missing"):
        validate(sched)
    with pytest.raises(ScheduleError, match=r"task W0\.0 is missing"):
        simulate(sched)


def test_duplicated_task_is_named() -> None:
    sched = _sched([["F0.0", "F0.0", "BW0.0"], ["F1.0", "BW1.0"]])
    with pytest.raises(ScheduleError, match=r"task F0\.0 appears 2 times"):
        validate(sched)


def test_task_on_wrong_rank_is_named() -> None:
    sched = _sched([["F0.0", "BW0.0", "F1.0"], ["BW1.0"]])
    with pytest.raises(ScheduleError, match=r"task F1\.0 is on rank 0 but stage 1 is placed on rank 1"):
        validate(sched)


def test_b_and_bw_together_is_named() -> None:
    sched = _sched([["F0.0", "B0.0", "BW0.0"], ["F1.0", "BW1.0"]])
    with pytest.raises(ScheduleError, match=r"B0\.0 duplicates the work of BW0\.0"):
        validate(sched)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="zb-h9", num_ranks=4, num_microbatches=8), "unknown schedule 'zb-h9'; available: gpipe"),
        (dict(name="1f1b", num_ranks=0, num_microbatches=8), "num_ranks must be an integer >= 1"),
        (dict(name="1f1b", num_ranks=4, num_microbatches=0), "num_microbatches must be an integer >= 1"),
        (dict(name="1f1b", num_ranks=4, num_microbatches=8, chunks=2), "does not take option"),
        (dict(name="interleaved-1f1b", num_ranks=4, num_microbatches=8, chunk=2), "it takes: chunks=2"),
        (dict(name="interleaved-1f1b", num_ranks=4, num_microbatches=8, chunks=0), "chunks must be an integer >= 1"),
    ],
)
def test_bad_arguments_say_what_is_allowed(kwargs: dict, message: str) -> None:
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build(name, **kwargs)


def test_an_order_of_strings_is_refused_naming_it() -> None:
    """Tasks written as strings ('F0.0') instead of Actions used to end in an AttributeError
    ('str' object has no attribute 'stage') from validate and simulate alike."""
    sched = Schedule(num_ranks=1, num_stages=1, num_microbatches=1, placement=(0,), orders=(("F0.0", "BW0.0"),))
    for check in (validate, simulate):
        with pytest.raises(ScheduleError, match=r"rank 0's order holds 'F0\.0' \(str\), not an Action"):
            check(sched)


# Hand-worked one-rank, two-stage (V, p=1) schedules of two microbatches; the first rank order is
# valid. DualPipe's pairs are an F and a backward of other microbatches, adjacent: (F0.1, B1.0).
_V_ORDER = ["F0.0", "F1.0", "F0.1", "B1.0", "W1.0", "B0.0", "W0.0", "F1.1", "B1.1", "W1.1", "B0.1", "W0.1"]


@pytest.mark.parametrize("pair, message", [
    (("F0.1", "W1.0"), r"overlap pair \(F0\.1, W1\.0\): W1\.0 must come right after F0\.1 in rank 0's order"),
    (("B1.0", "F0.1"), r"F0\.1 must come right after B1\.0"),  # the wrong way round: F0.1 runs first
    (("F0.1", "F0.1"), r"overlap pair \(F0\.1, F0\.1\) names one task twice"),
    (("B1.0", "W1.0"), r"overlap pair \(B1\.0, W1\.0\): W1\.0 consumes the output of B1\.0"),
    (("F0.0", "F1.0"), r"F1\.0 consumes the output of F0\.0"),
    (("x", "y"), r"overlap_pairs\[0\] must be two Actions, got \('x', 'y'\)"),
])
def test_overlap_pairs_that_cannot_run_at_once_are_refused(pair: tuple[str, str], message: str) -> None:
    """A pair is two tasks a runtime may run at once (Schedule's docstring: adjacent on one rank):
    not two tasks apart in the order (torch's CSV would silently write them as two cells), not
    one task twice, not a task and the one consuming its output. These used to validate."""
    pairs = ((Action.parse(pair[0]), Action.parse(pair[1])),) if pair[0] != "x" else (pair,)
    sched = Schedule(num_ranks=1, num_stages=2, num_microbatches=2, placement=(0, 0),
                     orders=(tuple(Action.parse(t) for t in _V_ORDER),), overlap_pairs=pairs)
    with pytest.raises(ScheduleError, match=message):
        validate(sched)


def test_a_task_in_two_overlap_pairs_is_refused() -> None:
    order = tuple(Action.parse(t) for t in _V_ORDER)
    ok = Schedule(num_ranks=1, num_stages=2, num_microbatches=2, placement=(0, 0), orders=(order,),
                  overlap_pairs=((Action.parse("F0.1"), Action.parse("B1.0")),))
    assert validate(ok) is ok  # the reference: a DualPipe-like pair validates
    chained = Schedule(num_ranks=1, num_stages=2, num_microbatches=2, placement=(0, 0), orders=(order,),
                       overlap_pairs=((Action.parse("F1.0"), Action.parse("F0.1")),
                                      (Action.parse("F0.1"), Action.parse("B1.0"))))
    with pytest.raises(ScheduleError, match=r"task F0\.1 is in two overlap pairs \(overlap_pairs\[1\] is the second\)"):
        validate(chained)


@pytest.mark.parametrize("body, message", [
    ("rank0: F0.0 BW0.0\nrank1: F1.0 BW1.0", r"task F0\.1 is missing \(rank 0\)"),
    ("rank0: F0.0 B0.0\nrank1: F1.0 BW1.0", r"task W0\.0 is missing \(rank 0\)"),
    ("rank0: F0.0 BW0.0\nrank1: F1.0 BW1.0 F0.1", r"task F0\.1 is on rank 1 but stage 0 is placed on rank 0"),
])
def test_a_header_of_huge_counts_names_the_missing_task(body: str, message: str) -> None:
    """A text (or torch CSV) header may claim 10**12 microbatches that its lines do not hold.
    validate and simulate built a table of 4 * stages * microbatches entries first and ended in
    a bare MemoryError; they must name, by hand, the first missing or misplaced task instead."""
    sched = Schedule.from_text(f"ranks=2 stages=2 microbatches={10**12}\nplacement=0,1\n{body}\n")
    for check in (validate, simulate):
        with pytest.raises(ScheduleError, match=message):
            check(sched)
