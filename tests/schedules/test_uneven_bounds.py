"""The lower bound and the exact solver on uneven stages with a memory limit per rank (uneven
splits leave ranks different room beside their static memory).

Reference: every pair of rank orders of a tiny case enumerated here, simulated, kept if each rank's
peak fits its own limit; the best makespan among them is the optimum."""

from __future__ import annotations

import itertools

import pytest

from zbpp.schedules import Action, Costs, Kind, Memory, ScheduleError, simulate
from zbpp.schedules.bounds import lower_bound
from zbpp.schedules.ir import from_orders, loop_placement

pytest.importorskip("scipy")
from zbpp.schedules.exact import optimal_schedule  # noqa: E402

REL = 1e-9  # float sums of task times


def _interleavings(chains):
    """Every order of the tasks of `chains` that keeps each chain's order."""
    if not any(chains):
        yield []
        return
    for i, chain in enumerate(chains):
        if chain:
            rest = [c[1:] if k == i else c for k, c in enumerate(chains)]
            for tail in _interleavings(rest):
                yield [chain[0], *tail]


def _brute_force(costs, memory, limits, m=2):
    placement = loop_placement(2)
    per_rank = [list(_interleavings([[Action(k, r, j) for k in (Kind.F, Kind.B, Kind.W)] for j in range(m)]))
                for r in range(2)]
    best = None
    for orders in itertools.product(*per_rank):
        try:
            res = simulate(from_orders("x", placement, m, orders), costs, memory)
        except ScheduleError:
            continue
        if all(pk <= lim * (1 + REL) for pk, lim in zip(res.peak_memory, limits)):
            best = res.makespan if best is None else min(best, res.makespan)
    return best


# a light first stage and a heavy last one; W frees all (so a rank holding one microbatch's
# activation must run its W before the next F)
COSTS = Costs(f=(1.0, 2.0), b=(1.0, 2.5), w=(0.5, 1.5), comm=0.25)
MEMORY = Memory(activation=(1.0, 1.0), wgrad=(1.0, 1.0))


@pytest.mark.parametrize("limits", [(2.0, 1.0), (4.0, 1.0), (1.0, 2.0), (1.0, 4.0)])
def test_per_rank_limits_bound_and_exact_match_enumeration(limits):
    want = _brute_force(COSTS, MEMORY, limits)
    opt = optimal_schedule(loop_placement(2), 2, COSTS, MEMORY, list(limits), time_limit=60)
    assert opt.proven and opt.makespan == pytest.approx(want, rel=REL)
    res = simulate(opt.schedule, COSTS, MEMORY)
    assert all(pk <= lim * (1 + REL) for pk, lim in zip(res.peak_memory, limits))
    lb = lower_bound(loop_placement(2), 2, COSTS, MEMORY, list(limits))
    assert lb.makespan <= want * (1 + REL)


def test_per_rank_limit_is_between_the_scalar_ones():
    """One limit per rank allows more than the smallest for all and less than the largest for all."""
    tight = _brute_force(COSTS, MEMORY, (1.0, 1.0))
    mixed = _brute_force(COSTS, MEMORY, (2.0, 1.0))
    loose = _brute_force(COSTS, MEMORY, (2.0, 2.0))
    assert loose < mixed < tight
    assert lower_bound(loop_placement(2), 2, COSTS, MEMORY, [2.0, 1.0]).makespan <= mixed * (1 + REL)


def test_per_rank_limit_errors_name_the_rank():
    with pytest.raises(ValueError, match=r"memory_limit\[1\]=0.5 is infeasible; the smallest feasible limit is 1"):
        lower_bound(loop_placement(2), 2, COSTS, MEMORY, [1.0, 0.5])
    with pytest.raises(ValueError, match="one per rank"):
        lower_bound(loop_placement(2), 2, COSTS, MEMORY, [1.0, 5.0, 3.0])
