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

from typing import Iterator

import networkx as nx

from .ir import Action, Schedule, ScheduleError
from .replay import replay
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

    >>> from zbpp.schedules import build
    >>> g = task_graph(build("zb-h1", num_ranks=2, num_microbatches=1), rank_chains=False)
    >>> sorted(f"{a}->{b}" for a, b, d in g.edges(data=True) if d["cross_rank"])  # messages
    ['B1.0->B0.0', 'F0.0->F1.0']
    >>> g.number_of_edges()  # and F->B on the last stage, B->W on each
    5
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


def _check_overlap_pairs(schedule: Schedule, orders: list[list[int]], present: bytearray) -> None:
    """Each overlap pair names two tasks of the schedule, the second right after the first on one
    rank (as documented, and as torch's CSV writes a pair), neither in another pair, the second
    not consuming the first's output (they could not run at once)."""
    if not schedule.overlap_pairs:
        return
    ids = TaskIds(schedule.num_stages, schedule.num_microbatches)
    n, m, placement = schedule.num_stages, schedule.num_microbatches, schedule.placement
    position = [0] * ids.size  # per task id: its index in its rank's order
    for order in orders:
        for i, t in enumerate(order):
            position[t] = i
    paired = bytearray(ids.size)
    for i, pair in enumerate(schedule.overlap_pairs):
        if len(pair) != 2 or not all(isinstance(x, Action) for x in pair):
            raise ScheduleError(f"overlap_pairs[{i}] must be two Actions, got {pair!r}")
        a, b = pair
        if not (0 <= a.stage < n and 0 <= b.stage < n and a.microbatch < m and b.microbatch < m
                and present[ids.of(a)] and present[ids.of(b)] and placement[a.stage] == placement[b.stage]):
            raise ScheduleError(f"overlap pair ({a}, {b}) must name two tasks of one rank")
        if a == b:
            raise ScheduleError(f"overlap pair ({a}, {b}) names one task twice")
        ta, tb = ids.of(a), ids.of(b)
        rank = placement[a.stage]
        order = orders[rank]
        if position[ta] + 1 >= len(order) or order[position[ta] + 1] != tb:
            raise ScheduleError(f"overlap pair ({a}, {b}): {b} must come right after {a} in rank {rank}'s order")
        if ids.input(tb, present) == ta:
            raise ScheduleError(f"overlap pair ({a}, {b}): {b} consumes the output of {a}, so they cannot run at once")
        for t, x in ((ta, a), (tb, b)):
            if paired[t]:
                raise ScheduleError(f"task {x} is in two overlap pairs (overlap_pairs[{i}] is the second)")
            paired[t] = 1


def describe_cycle(schedule: Schedule, cycle: list[Action]) -> str:
    parts = []
    for a in cycle:
        parts.append(f"{a}@rank{schedule.rank_of(a.stage)}")
    return " -> ".join(parts + [parts[0]])


def validate(schedule: Schedule) -> Schedule:
    """Raise `ScheduleError` unless `schedule` is complete, well placed and deadlock-free.

    Returns the schedule, so ``validate(build(...))`` chains.

    >>> from zbpp.schedules import build
    >>> validate(build("zb-h2", num_ranks=4, num_microbatches=8)).name
    'zb-h2'
    """
    ids = TaskIds(schedule.num_stages, schedule.num_microbatches)
    orders, present = ids.encode(schedule)
    _check_overlap_pairs(schedule, orders, present)
    zeros = [0.0] * ids.size  # no times: durations, lags and (so) every start are 0
    if replay(orders, ids.inputs(present), zeros, zeros, zeros, [-1.0] * ids.size):
        return schedule
    # A deadlock: the graph search names its cycle.
    edges = nx.find_cycle(task_graph(schedule))
    cycle = [u for u, _v in edges]
    raise ScheduleError(
        "deadlock: the schedule's rank orders and data dependencies form a cycle: "
        + describe_cycle(schedule, cycle)
        + " (each task waits for the one before it)"
    )
