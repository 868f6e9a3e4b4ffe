"""Properties every registered schedule must have, over many (p, m, costs).

For each schedule: it validates; each rank runs exactly the tasks of its own stages; the simulated
times respect every data edge (plus `comm` on cross-rank edges) and each rank runs one task at a
time in its order; memory never goes negative and returns to zero after the step.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbpp.schedules import Action, Costs, Kind, Memory, available, build, options_of, simulate, validate
from zbpp.schedules.dag import data_dependencies
from zbpp.schedules.registry import stage_count

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


def _reference(sched, f, b, w, comm: float, overhead: float, act, wgrad, tf, tb, tw):
    """docs/DESIGN.md's model, recomputed by hand: each rank runs its order, a task as soon as its
    rank is free and its inputs have arrived (`comm` later across ranks); a message costs each
    end's F or B (BW) `overhead`; memory follows each order, a task's transient on top."""
    n, place = sched.num_stages, sched.placement
    msgs = [sum(1 for t in (s - 1, s + 1) if 0 <= t < n and place[t] != place[s]) for s in range(n)]
    back = {(a.stage, a.microbatch): a for _, a in sched.actions() if a.kind in (Kind.B, Kind.BW)}

    def inputs(a):
        s, j = a.stage, a.microbatch
        if a.kind is Kind.F:
            return [Action(Kind.F, s - 1, j)] if s else []
        if a.kind is Kind.W:
            return [back[(s, j)]]
        return [Action(Kind.F, s, j)] + ([back[(s + 1, j)]] if s + 1 < n else [])

    def duration(a):
        s = a.stage
        return {Kind.F: f[s] + overhead * msgs[s], Kind.B: b[s] + overhead * msgs[s], Kind.W: w[s],
                Kind.BW: b[s] + w[s] + overhead * msgs[s]}[a.kind]

    start, end, free, at = {}, {}, [0.0] * sched.num_ranks, [0] * sched.num_ranks
    moved = True
    while moved:  # sweep the ranks until none can run its next task
        moved = False
        for r, order in enumerate(sched.orders):
            while at[r] < len(order) and all(x in end for x in inputs(order[at[r]])):
                a = order[at[r]]
                start[a] = max([free[r]] + [end[x] + (comm if place[x.stage] != r else 0.0) for x in inputs(a)])
                end[a] = free[r] = start[a] + duration(a)
                at[r] += 1
                moved = True
    assert all(at[r] == len(o) for r, o in enumerate(sched.orders)), "the reference stalled: a deadlock"
    spans = [end[o[-1]] - start[o[0]] if o else 0.0 for o in sched.orders]
    busy = [sum(duration(a) for a in o) for o in sched.orders]
    peaks = []
    for order in sched.orders:
        held = top = 0.0
        for a in order:
            s = a.stage
            rise = {Kind.F: tf[s], Kind.B: tb[s], Kind.W: tw[s], Kind.BW: max(tb[s], wgrad[s] - act[s] + tw[s])}[a.kind]
            top = max(top, held + rise)
            held += {Kind.F: act[s], Kind.B: wgrad[s] - act[s], Kind.W: -wgrad[s], Kind.BW: -act[s]}[a.kind]
            top = max(top, held)
        peaks.append(top)
    cost = max(spans)
    return start, max(end.values()) - min(start.values()), spans, (cost - max(busy)) / cost if cost > 0 else 0.0, peaks


@pytest.mark.parametrize("name", available())
@settings(max_examples=8, deadline=None)
@given(p=st.integers(1, 4), m=st.integers(1, 7), chunks=st.integers(1, 3), data=st.data())
def test_simulate_agrees_with_a_recomputation_by_hand(name: str, p: int, m: int, chunks: int, data) -> None:
    """Every start time, the makespan, each span, the bubble rate and each rank's peak, under
    per-stage costs and memory (zeros included), comm, message overhead and transients. Times
    are sums of a few dozen costs of 3 decimals: equal to 1e-9."""
    opts = {"chunks": chunks} if "chunks" in options_of(name) else {}
    n = stage_count(name, p, **opts)

    def per_stage(hi: float) -> list[float]:
        return data.draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, hi]), min_size=n, max_size=n))

    f, b, w, act, wgrad = (per_stage(3.0) for _ in range(5))
    tf, tb, tw = (per_stage(0.75) for _ in range(3))
    comm, overhead = data.draw(st.sampled_from([0.0, 0.3])), data.draw(st.sampled_from([0.0, 0.2]))
    costs = Costs(f=f, b=b, w=w, comm=comm, message_overhead=overhead)
    memory = Memory(activation=act, wgrad=wgrad, transient_f=tf, transient_b=tb, transient_w=tw)
    if "costs" in options_of(name):
        opts.update(costs=costs, memory=memory)
    sched = build(name, num_ranks=p, num_microbatches=m, **opts)
    res = simulate(sched, costs, memory)
    start, makespan, spans, bubble, peaks = _reference(sched, f, b, w, comm, overhead, act, wgrad, tf, tb, tw)
    assert all(res.start[a] == pytest.approx(t, abs=1e-9) for a, t in start.items()), name
    assert res.makespan == pytest.approx(makespan, abs=1e-9)
    assert res.spans == pytest.approx(spans, abs=1e-9)
    assert res.bubble_rate == pytest.approx(bubble, abs=1e-9)
    assert res.peak_memory == pytest.approx(peaks, abs=1e-9)
