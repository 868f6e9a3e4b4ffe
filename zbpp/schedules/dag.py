"""The task DAG of docs/DESIGN.md and schedule validation.

Data edges, for every microbatch j::

    F(s,j) -> F(s+1,j)      F(last,j) -> B(last,j)      B(s+1,j) -> B(s,j)      B(s,j) -> W(s,j)

where a `BW` task stands in for B (and W) when the backward is not split. The rule itself lives in
`zbpp.schedules.tasks` (`data_dependencies` and `data_consumers` are re-exported from there). A
schedule adds one chain per rank (its task order). A schedule is valid when the graph has every
task exactly once on the rank holding its stage, and no cycle (a cycle is a deadlock).

>>> from zbpp.schedules import build
>>> from zbpp.schedules.dag import task_graph
>>> g = task_graph(build("zb-h1", num_ranks=2, num_microbatches=2))
>>> g.number_of_nodes()
12
"""

from __future__ import annotations

from collections import Counter
from typing import Iterator

import networkx as nx

from .ir import Action, Kind, Schedule, ScheduleError
from .tasks import TaskIds, data_consumers, data_dependencies, input_of

__all__ = ["data_dependencies", "data_consumers", "task_graph", "validate"]


def _data_edges(schedule: Schedule) -> Iterator[tuple[Action, Action]]:
    present = {a for _, a in schedule.actions()}
    for _, a in schedule.actions():
        dep = input_of(a, schedule.num_stages, present)
        if dep is not None:
            yield dep, a


def task_graph(schedule: Schedule, *, rank_chains: bool = True) -> nx.DiGraph:
    """The DAG of `schedule`'s tasks.

    Nodes are `Action`s with attribute ``rank``. Data edges carry ``kind="data"`` and
    ``cross_rank`` (True when they carry a message between ranks); with `rank_chains`, consecutive
    tasks of a rank are joined by ``kind="order"`` edges.
    """
    g = nx.DiGraph()
    for rank, a in schedule.actions():
        g.add_node(a, rank=rank)
    for src, dst in _data_edges(schedule):
        if src in g:
            cross = schedule.rank_of(src.stage) != schedule.rank_of(dst.stage)
            g.add_edge(src, dst, kind="data", cross_rank=cross)
    if rank_chains:
        for order in schedule.orders:
            for prev, nxt in zip(order, order[1:]):
                if not g.has_edge(prev, nxt):
                    g.add_edge(prev, nxt, kind="order", cross_rank=False)
    return g


def _check_tasks(schedule: Schedule) -> None:
    """Every (stage, mb) has one F and either one BW or one B and one W, on its own rank."""
    p, n, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    if p < 1 or n < 1 or m < 1:
        raise ScheduleError(f"need at least one rank, stage and microbatch (got p={p}, stages={n}, m={m})")
    counts: Counter[Action] = Counter()
    for rank, a in schedule.actions():
        if not 0 <= a.stage < n:
            raise ScheduleError(f"task {a} on rank {rank}: stage {a.stage} outside 0..{n - 1}")
        if not 0 <= a.microbatch < m:
            raise ScheduleError(f"task {a} on rank {rank}: microbatch {a.microbatch} outside 0..{m - 1}")
        if schedule.rank_of(a.stage) != rank:
            raise ScheduleError(
                f"task {a} is on rank {rank} but stage {a.stage} is placed on rank {schedule.rank_of(a.stage)}"
            )
        counts[a] += 1
    for a, c in counts.items():
        if c > 1:
            raise ScheduleError(f"task {a} appears {c} times (rank {schedule.rank_of(a.stage)})")
    for s in range(n):
        for j in range(m):
            f, b, w, bw = (Action(k, s, j) for k in (Kind.F, Kind.B, Kind.W, Kind.BW))
            where = f"rank {schedule.rank_of(s)}"
            if f not in counts:
                raise ScheduleError(f"task {f} is missing ({where})")
            if bw in counts:
                if b in counts or w in counts:
                    extra = b if b in counts else w
                    raise ScheduleError(f"task {extra} duplicates the work of {bw} ({where})")
            elif b not in counts and w not in counts:
                raise ScheduleError(f"the backward of stage {s} microbatch {j} is missing: no {bw}, {b} or {w} ({where})")
            elif b not in counts:
                raise ScheduleError(f"task {b} is missing ({where}); {w} has no B to follow")
            elif w not in counts:
                raise ScheduleError(f"task {w} is missing ({where}); {b} is never followed by its weight gradient")
    for a, b in schedule.overlap_pairs:
        ra, rb = schedule.rank_of(a.stage), schedule.rank_of(b.stage)
        if ra != rb or a not in counts or b not in counts:
            raise ScheduleError(f"overlap pair ({a}, {b}) must name two tasks of one rank")


def describe_cycle(schedule: Schedule, cycle: list[Action]) -> str:
    parts = []
    for a in cycle:
        parts.append(f"{a}@rank{schedule.rank_of(a.stage)}")
    return " -> ".join(parts + [parts[0]])


def _valid_fast(schedule: Schedule) -> bool:
    """True when `schedule` is valid, decided in one pass over integer task ids (no graph).

    Every task has at most one data input, so the DAG plus the rank chains is acyclic exactly
    when repeatedly running, on each rank, the next task whose input is done finishes every
    task (the first unfinished task of a topological order is always runnable). False means
    "invalid or not sure": the caller then builds the graph to name the problem.
    """
    n, m = schedule.num_stages, schedule.num_microbatches
    ids = TaskIds(n, m)
    encoded = ids.encode(schedule)
    if encoded is None:
        return False
    orders, present = encoded
    for pair in schedule.overlap_pairs:
        for a in pair:
            if not (0 <= a.stage < n and 0 <= a.microbatch < m and present[ids.of(a)]):
                return False
        if schedule.rank_of(pair[0].stage) != schedule.rank_of(pair[1].stage):
            return False
    inputs = ids.inputs(present)
    done = bytearray(ids.size)
    pos = [0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r, order in enumerate(orders):
            i, size = pos[r], len(order)
            while i < size:
                t = order[i]
                dep = inputs[t]
                if dep >= 0 and not done[dep]:
                    break
                done[t] = 1
                i += 1
            if i != pos[r]:
                remaining -= i - pos[r]
                pos[r] = i
                progressed = True
        if not progressed:
            return False
    return True


def validate(schedule: Schedule) -> Schedule:
    """Raise `ScheduleError` unless `schedule` is complete, well placed and deadlock-free.

    Returns the schedule, so ``validate(build(...))`` chains.

    >>> from zbpp.schedules import build
    >>> validate(build("zb-h2", num_ranks=4, num_microbatches=8)).name
    'zb-h2'
    """
    if _valid_fast(schedule):
        return schedule
    # Something is wrong: the graph search below finds it and names it.
    _check_tasks(schedule)
    g = task_graph(schedule)
    try:
        edges = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return schedule
    cycle = [u for u, _v in edges]
    raise ScheduleError(
        "deadlock: the schedule's rank orders and data dependencies form a cycle: "
        + describe_cycle(schedule, cycle)
        + " (each task waits for the one before it)"
    )
