"""Schedule-core behaviours pinned against a hand-worked value, an exact optimum or the documented
definition:

- the lower bound under a memory limit that is not a whole number of activations;
- the measured busy time when one task's interval lies inside another's;
- the measured bubble rate, whose ``busy`` is the busiest rank's (docs/DESIGN.md);
- ``from_torch_csv(placement="v")``: down the ranks, then back up.
"""

from __future__ import annotations

import pytest

from zbpp.schedules import Costs, Memory, build, simulate, validate
from zbpp.schedules.bounds import lower_bound
from zbpp.schedules.ir import loop_placement, v_placement
from zbpp.schedules.measured import measured_bubble_rate, measured_result
from zbpp.schedules.torch_csv import from_torch_csv, to_torch_csv

UNIT = Costs(1, 1, 1)


@pytest.mark.parametrize("placement,m", [(loop_placement(4), 6), (loop_placement(2), 6), (v_placement(2), 6)])
def test_a_fractional_memory_limit_rounds_down(placement, m):
    # Memory(1, 0): every rank's memory is a whole number of activations, so a limit of 2.5 admits
    # exactly the schedules that a limit of 2 admits: the bound must be the same. The cases are
    # chosen where a limit of 3 admits more (a smaller bound), so rounding 2.5 up would show.
    mem = Memory(activation=1, wgrad=0)
    at2, at25, at3 = (lower_bound(placement, m, UNIT, mem, memory_limit=L) for L in (2, 2.5, 3))
    assert (at25.cost, at25.makespan) == (at2.cost, at2.makespan)
    assert (at3.cost, at3.makespan) < (at2.cost, at2.makespan)


def test_the_fractional_limit_bound_is_below_the_exact_optimum():
    pytest.importorskip("scipy")
    from zbpp.schedules.exact import optimal_schedule

    placement, m, mem = loop_placement(2), 3, Memory(activation=1, wgrad=0)
    best = optimal_schedule(placement, m, UNIT, mem, memory_limit=1.5, time_limit=60)
    lb = lower_bound(placement, m, UNIT, mem, memory_limit=1.5)
    # at 1.5 a rank holds one activation at a time, as at 1: the same bound, below the proven optimum
    assert best.proven
    assert lb.makespan <= best.makespan + 1e-9
    assert lb.makespan == lower_bound(placement, m, UNIT, mem, memory_limit=1).makespan


def test_busy_time_counts_a_nested_task_once():
    # one rank: F0.0 over [0, 4] with B0.0 inside it over [1, 2] (an overlapped pair), W0.0 [5, 6]:
    # busy = |[0, 4] u [5, 6]| = 5, span 6, bubble (6 - 5) / 6
    recs = [{"rank": 0, "action": "F0.0", "start": 0.0, "end": 4.0},
            {"rank": 0, "action": "B0.0", "start": 1.0, "end": 2.0},
            {"rank": 0, "action": "W0.0", "start": 5.0, "end": 6.0}]
    res = measured_result(recs)
    assert res.busy_per_rank == [5.0]
    assert measured_bubble_rate(recs) == pytest.approx(1 / 6, abs=1e-12)


def test_measured_bubble_rate_uses_the_busiest_rank():
    # rank 0 computes 3 of its span of 6, rank 1 computes 5 of 6: cost 6, busy 5 (the busiest),
    # bubble rate (6 - 5) / 6 (the least busy rank would give 3/6); full backwards (BW): a whole step
    recs = [{"rank": 0, "action": "F0.0", "start": 0.0, "end": 1.0},
            {"rank": 0, "action": "BW0.0", "start": 4.0, "end": 6.0},
            {"rank": 1, "action": "F1.0", "start": 1.0, "end": 3.0},
            {"rank": 1, "action": "BW1.0", "start": 3.0, "end": 6.0}]
    assert measured_bubble_rate(recs) == pytest.approx(1 / 6, abs=1e-12)
    assert measured_result(recs).bubble_rate == pytest.approx(1 / 6, abs=1e-12)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_from_torch_csv_v_placement_goes_down_then_up(tmp_path, p):
    sched = build("zb-v", num_ranks=p, num_microbatches=2 * p)
    path = tmp_path / "v.csv"
    to_torch_csv(sched, path)
    got = from_torch_csv(path, placement="v")
    # stage s on rank s going down, then stage p + i on rank p - 1 - i coming back (docs/DESIGN.md)
    assert got.placement == tuple(range(p)) + tuple(reversed(range(p))) == sched.placement
    assert got.orders == sched.orders
    validate(got)


@pytest.mark.parametrize("field", ["start", "end"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_measured_record_with_a_non_finite_time_is_refused(field, bad):
    """Rank 0 computes 1 of a 2-long span (bubble rate 0.5). A record whose time is NaN passed
    every check (NaN < x is False) and turned the answer into 0.0 (min/max skip a NaN depending on
    order); an infinite one into nan. A broken timer must be named, as `Costs.from_task_times`
    names it."""
    good = [{"rank": 0, "action": "F0.0", "start": 0.0, "end": 1.0},
            {"rank": 1, "action": "F1.0", "start": 1.0, "end": 2.0},
            {"rank": 0, "action": "BW0.0", "start": 3.0, "end": 4.0}]
    assert measured_bubble_rate(good) == pytest.approx(0.5)
    broken = [dict(r) for r in good]
    broken[0][field] = bad
    for fn in (measured_bubble_rate, measured_result):
        with pytest.raises(ValueError, match=f"'{field}': {bad}"):
            fn(broken)


def test_records_of_part_of_a_step_are_refused_naming_the_missing_task():
    """Records of ZB-H1 (p=2, m=2) made from its simulation: whole, they give the simulated bubble
    rate 1/7 (the reference: rank 0 spans 7 and each rank computes 6). Without rank 0's last W (a
    step cut short) rank 0 spans 6, so the bubble rate came out 0 (by hand: cost 6, rank 1 busy 6).
    measured_result and measured_summary, which read the schedule off the records, must name the
    missing task instead (measured_bubble_rate takes part of a step, as documented)."""
    from zbpp.schedules.measured import measured_summary

    res = simulate(build("zb-h1", num_ranks=2, num_microbatches=2), Costs(1, 1, 1))
    recs = [{"rank": r, "action": str(a), "start": res.start[a], "end": res.end[a]} for r, a in res.schedule.actions()]
    assert measured_result(recs).bubble_rate == pytest.approx(res.bubble_rate, abs=1e-12) == pytest.approx(1 / 7)
    cut = [x for x in recs if x["action"] != "W0.1"]
    for read in (measured_result, measured_summary):
        with pytest.raises(ValueError, match=r"not one whole step: task W0\.1 is missing \(rank 0\)"):
            read(cut)
    assert measured_bubble_rate(cut) == 0.0  # part of a step: what that part shows


def test_measured_result_names_an_argument_of_another_type():
    """measured_result(records, memory=Costs(...)) ended in "'Costs' object has no attribute
    'deltas'", and a schedule name in the schedule's place in "'str' object has no attribute
    'actions'"; both must name the argument."""
    recs = [{"rank": 0, "action": "F0.0", "start": 0.0, "end": 1.0}, {"rank": 0, "action": "BW0.0", "start": 1.0, "end": 3.0}]
    assert measured_result(recs, memory=Memory(2)).peak_memory == [2.0]  # the reference: F holds 2
    with pytest.raises(TypeError, match=r"measured_result: memory must be a zbpp.schedules.Memory .*\(Costs\)"):
        measured_result(recs, memory=Costs())
    with pytest.raises(TypeError, match=r"measured_result: schedule must be a zbpp.schedules.Schedule or None, got str"):
        measured_result(recs, "1f1b")
