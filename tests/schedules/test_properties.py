"""Properties every registered schedule must have, over many (p, m, costs).

For each schedule: it validates; each rank runs exactly the tasks of its own stages; the simulated
times respect every data edge (plus `comm` on cross-rank edges) and each rank runs one task at a
time in its order; memory never goes negative and returns to zero after the step.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbpp.schedules import Costs, Kind, Memory, available, build, options_of, simulate, validate
from zbpp.schedules.dag import data_dependencies

EPS = 1e-9  # sums of a few hundred floats: rounding only


def _build(name: str, p: int, m: int, costs: Costs, memory: Memory):
    opts = {}
    takes = options_of(name)
    if "costs" in takes:
        opts["costs"] = costs
    if "memory" in takes:
        opts["memory"] = memory
    return build(name, num_ranks=p, num_microbatches=m, **opts)


def check_schedule(name: str, p: int, m: int, costs: Costs, memory: Memory) -> None:
    sched = validate(_build(name, p, m, costs, memory))
    assert sched.num_ranks == p and sched.num_microbatches == m
    # each rank holds exactly the tasks of its stages
    for rank in range(p):
        tasks = sched.orders[rank]
        stages = set(sched.stages_on(rank))
        assert {(a.stage, a.microbatch) for a in tasks if a.kind is Kind.F} == {
            (s, j) for s in stages for j in range(m)
        }, f"{name}: rank {rank} forwards"
        assert all(a.stage in stages for a in tasks)
    res = simulate(sched, costs, memory)
    present = {a for _, a in sched.actions()}
    for _, a in sched.actions():
        for dep in data_dependencies(a, sched.num_stages, present):
            gap = costs.comm if sched.rank_of(dep.stage) != sched.rank_of(a.stage) else 0.0
            assert res.start[a] >= res.end[dep] + gap - EPS, f"{name}: {a} starts before {dep} arrives"
    for rank, order in enumerate(sched.orders):
        for prev, nxt in zip(order, order[1:]):
            assert res.start[nxt] >= res.end[prev] - EPS, f"{name}: rank {rank} overlaps {prev} and {nxt}"
        mems = [res.memory_after[a] for a in order]
        assert min(mems, default=0.0) >= -EPS, f"{name}: rank {rank} memory goes negative"
        if mems:
            assert mems[-1] == pytest.approx(0.0, abs=1e-6), f"{name}: rank {rank} ends holding memory"


@pytest.mark.parametrize("name", available())
@settings(max_examples=25, deadline=None)
@given(
    p=st.integers(1, 6),
    m=st.integers(1, 14),
    f=st.floats(0.2, 3.0),
    b=st.floats(0.2, 3.0),
    w=st.floats(0.0, 2.0),
    comm=st.floats(0.0, 0.5),
)
def test_every_schedule_is_valid_and_simulates_consistently(
    name: str, p: int, m: int, f: float, b: float, w: float, comm: float
) -> None:
    check_schedule(name, p, m, Costs(f=f, b=b, w=w, comm=comm), Memory(activation=1.0, wgrad=0.4))


@pytest.mark.parametrize("name", available())
def test_degenerate_sizes(name: str) -> None:
    """m < p, m = 1 and p = 1 degrade to valid schedules rather than being refused."""
    for p, m in [(1, 1), (1, 5), (4, 1), (4, 2), (8, 3)]:
        check_schedule(name, p, m, Costs(), Memory(activation=1.0, wgrad=0.5))


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_interleaved_chunks_any_m(chunks: int) -> None:
    for p in range(1, 7):
        for m in range(1, 3 * p + 2):
            sched = validate(build("interleaved-1f1b", num_ranks=p, num_microbatches=m, chunks=chunks))
            assert sched.num_stages == p * chunks
            assert sched.stages_on(0) == [c * p for c in range(chunks)]
