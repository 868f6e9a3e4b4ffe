"""The automatic schedules are total: on every valid input they build a schedule within each
rank's memory limit, never a stall or a traceback; and a limit per rank is honoured rank by rank.

References: `zbpp.schedules.simulate` (per-rank peak memory of the result), `validate` (every
task present, dependencies respected), and `bounds.lower_bound` with per-rank limits.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbpp.schedules import Costs, Memory, build, simulate, validate
from zbpp.schedules.bounds import lower_bound
from zbpp.schedules.generators.auto_heuristic import Policy, Problem, list_schedule
from zbpp.schedules.ir import loop_placement, v_placement

REL = 1e-9  # sums of a few small integers' floats: rounding only

_POLICIES = (Policy(), Policy(b_first=False, always_fill=True), Policy(reserve_one=False), Policy(inflight=1),
             Policy(f_may_delay_b=False, deep_first=False))


def _placement(rng: random.Random) -> tuple[int, ...]:
    p = rng.randint(1, 3)
    kind = rng.randrange(3)
    return loop_placement(p) if kind == 0 else v_placement(p) if kind == 1 else loop_placement(p, rng.randint(2, 4))


def _rank_floors(placement, act) -> list[float]:
    out = [0.0] * (max(placement) + 1)
    for s, r in enumerate(placement):
        out[r] += act[s]
    return out


def _random_problem(rng: random.Random) -> Problem:
    """Integer costs and memory 1-3 per stage (ties everywhere), each rank's limit from its
    smallest feasible one (all its stages' activations of one microbatch) up to 4x that."""
    placement = _placement(rng)
    n = len(placement)
    act = [rng.randint(1, 3) for _ in range(n)]
    memory = Memory(act, [rng.randint(0, a) for a in act])
    costs = Costs(*([rng.randint(1, 3) for _ in range(n)] for _ in range(3)), comm=rng.choice((0, 0, 0.5)))
    limits = [floor + rng.randint(0, 3 * int(floor)) for floor in _rank_floors(placement, act)]
    return Problem.make(placement, rng.randint(1, 6), costs, memory, limits)


def test_list_scheduler_finishes_every_random_tiny_instance_within_each_ranks_limit() -> None:
    # 137 of 3,000 such inputs stalled before (a middle stage of three per rank filled the room
    # kept for the oldest microbatch's last stage); 600 instances x 5 policies take about a second
    rng = random.Random(41)
    for _ in range(600):
        prob = _random_problem(rng)
        nm = prob.num_stages * prob.num_microbatches
        for policy in _POLICIES:
            orders = list_schedule(prob, policy)
            assert sorted(t for o in orders for t in o) == list(range(3 * nm)), (prob, policy)
            delta = prob.memory_deltas
            for r, order in enumerate(orders):
                mem = peak = 0.0
                for t in order:
                    mem += delta[t]
                    peak = max(peak, mem)
                assert peak <= prob.limits[r] * (1 + REL), (prob, policy, r)


def test_zbi_auto_with_three_stages_per_rank_builds_the_reported_case() -> None:
    f = [1, 3, 1, 3, 1, 2]
    costs, memory = Costs(f=f, b=f, w=f), Memory(1, 0)
    sched = validate(build("zbi-auto", num_ranks=2, num_microbatches=4, chunks=3, costs=costs, memory=memory))
    res = simulate(sched, costs, memory)
    assert max(res.peak_memory) <= 2 * 3  # the default limit: p times a rank's three stages' activations
    # each rank's busy time (4 microbatches x its stages' F+B+W) is the least a step can take
    assert res.makespan >= max(4 * 3 * (f[0] + f[2] + f[4]), 4 * 3 * (f[1] + f[3] + f[5]))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(name=st.sampled_from(["zb-auto", "zbv-auto", "zbi-auto"]), p=st.integers(1, 3), m=st.integers(1, 5),
       chunks=st.integers(2, 3), seed=st.integers(0, 2**16), per_rank=st.booleans())
def test_every_auto_builder_is_total_on_tiny_inputs(name, p, m, chunks, seed, per_rank) -> None:
    rng = random.Random(seed)
    placement = {"zb-auto": loop_placement(p), "zbv-auto": v_placement(p), "zbi-auto": loop_placement(p, chunks)}[name]
    n = len(placement)
    act = [rng.randint(1, 3) for _ in range(n)]
    memory = Memory(act, [rng.randint(0, a) for a in act])
    costs = Costs(*([rng.randint(1, 3) for _ in range(n)] for _ in range(3)), comm=rng.choice((0, 0.5)))
    floors = _rank_floors(placement, act)
    if per_rank:
        limit = [x + rng.randint(0, 3 * int(x)) for x in floors]
    else:
        limit = rng.choice([None, max(floors), max(floors) + rng.randint(0, 3 * int(max(floors)))])
    opts = {"chunks": chunks} if name == "zbi-auto" else {}
    sched = validate(build(name, num_ranks=p, num_microbatches=m, costs=costs, memory=memory, memory_limit=limit, **opts))
    res = simulate(sched, costs, memory)
    limits = [p * max(floors)] * p if limit is None else limit if per_rank else [limit] * p
    assert all(x <= y * (1 + REL) for x, y in zip(res.peak_memory, limits))


def test_a_limit_per_rank_lets_each_rank_use_its_own_room() -> None:
    # 1F1B's warm-up holds p - r microbatches on rank r: limits 4, 3, 2, 1 (the room beside ranks'
    # different static memory) are what it needs, so zb-auto can pipeline; the smallest, 1, for
    # every rank lets rank 0 start a microbatch only after the W of the one before (B keeps 0.5):
    # F down 4 ranks, B back up, W on rank 0, per microbatch
    p, m = 4, 8
    costs, memory = Costs(1, 1, 1), Memory(1, 0.5)
    limits = [4.0, 3.0, 2.0, 1.0]
    per_rank = simulate(build("zb-auto", num_ranks=p, num_microbatches=m, costs=costs, memory=memory,
                              memory_limit=limits), costs, memory)
    assert all(x <= y * (1 + REL) for x, y in zip(per_rank.peak_memory, limits))
    assert per_rank.peak_memory[0] > 1  # rank 0 used room it would not have had under one limit for all
    tight = simulate(build("zb-auto", num_ranks=p, num_microbatches=m, costs=costs, memory=memory, memory_limit=1),
                     costs, memory)
    assert tight.makespan == pytest.approx(m * (2 * p + 1), rel=REL)
    bound = lower_bound(loop_placement(p), m, costs, memory, limits)
    assert bound.makespan <= per_rank.makespan * (1 + REL)
    assert per_rank.makespan <= (m + p - 1) * 3 * (1 + REL)  # 1F1B's step on these costs fits these limits


def test_a_limit_per_rank_below_a_ranks_need_names_the_rank() -> None:
    with pytest.raises(ValueError, match=r"memory_limit\[1\]=0.5 is infeasible; rank 1 needs at least 1"):
        build("zb-auto", num_ranks=2, num_microbatches=2, memory=Memory(1, 0), memory_limit=[2, 0.5])
    with pytest.raises(ValueError, match="3 values for 2 ranks"):
        build("zb-auto", num_ranks=2, num_microbatches=2, memory=Memory(1, 0), memory_limit=[2, 2, 2])


@pytest.mark.parametrize("name, placement_of", [("zb-auto", loop_placement), ("zbv-auto", v_placement),
                                                ("zbi-auto", lambda p: loop_placement(p, 2))])
def test_an_infinite_limit_on_a_rank_is_no_limit_there(name, placement_of) -> None:
    """`lower_bound` reads inf in a per-rank limit as no limit on that rank; the automatic schedules
    refused it ("must be a finite number >= 0, got inf"). Reference: the same search with each inf
    replaced by a finite limit that no schedule reaches (every microbatch of every stage of the
    rank held at once, doubled), which must give the very same orders."""
    p, m = 4, 8
    placement = placement_of(p)
    costs, memory = Costs(f=[(1, 2, 1.5)[s % 3] for s in range(len(placement))], b=1, w=1), Memory(1, 0.5)
    never = [2.0 * m * placement.count(r) for r in range(p)]  # one activation per microbatch and stage
    limits = [float("inf"), 3.0, 3.0, float("inf")]
    finite = [n if x == float("inf") else x for x, n in zip(limits, never)]
    got = build(name, num_ranks=p, num_microbatches=m, costs=costs, memory=memory, memory_limit=limits)
    ref = build(name, num_ranks=p, num_microbatches=m, costs=costs, memory=memory, memory_limit=finite)
    assert got.orders == ref.orders
    res = simulate(got, costs, memory)
    assert all(x <= y * (1 + REL) for x, y in zip(res.peak_memory, limits))
    assert lower_bound(placement, m, costs, memory, limits).makespan <= res.makespan * (1 + REL)
    # one inf for every rank: no limit anywhere, as a limit that no rank reaches
    everywhere = build(name, num_ranks=p, num_microbatches=m, costs=costs, memory=memory, memory_limit=float("inf"))
    assert everywhere.orders == build(name, num_ranks=p, num_microbatches=m, costs=costs, memory=memory,
                                      memory_limit=max(never)).orders
