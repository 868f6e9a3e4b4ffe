"""Measured pipeline steps: task records of a real run read like a simulated plan.

A record is ``{"rank": int, "action": "F0.3", "start": float, "end": float}`` (seconds from the
start of the step, one instant for all ranks), as ``Pipeline(..., record_task_times=True)`` gathers them on pipeline rank 0.
`measured_result` turns a step's records into a `SimResult` (so they print, plot and trace like a
plan), `measured_summary` reports their bubble rate and mean task times, and
`measured_bubble_rate` is the bubble rate alone. This is the one definition of the measured bubble
rate: docs/DESIGN.md's ``(cost - busy) / cost`` with cost the longest span of one rank and busy the
largest time one rank computes, tasks that overlap (DualPipe's F&B pairs) counted once.

Pure Python, like the rest of `zbpp.schedules`.

>>> recs = [{"rank": 0, "action": "F0.0", "start": 0.0, "end": 1.0},
...         {"rank": 0, "action": "B0.0", "start": 3.0, "end": 4.0},
...         {"rank": 1, "action": "F1.0", "start": 1.0, "end": 3.0}]
>>> round(measured_bubble_rate(recs), 4)
0.5
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

from .dag import validate
from .ir import Action, Kind, Schedule, ScheduleError
from .simulate import Memory, SimResult, check_costs_memory

__all__ = ["measured_result", "measured_summary", "measured_bubble_rate"]

Record = Mapping[str, Any]


def _parse_records(records: Iterable[Record], allow_empty: bool = False) -> list[tuple[int, Action, float, float]]:
    out = []
    for rec in records:
        try:
            rank, action = int(rec["rank"]), Action.parse(str(rec["action"]))
            start, end = float(rec["start"]), float(rec["end"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"measured record {dict(rec)!r}: need 'rank', 'action' (e.g. 'F0.3'), 'start' and 'end': {exc}"
            ) from None
        # a NaN passes `end < start` and then skews the min/max of spans silently
        for what, value in (("start", start), ("end", end)):
            if not math.isfinite(value):
                raise ValueError(f"measured record {dict(rec)!r}: '{what}': {value} is not a finite time")
        if end < start:
            raise ValueError(f"measured record {dict(rec)!r}: ends before it starts")
        out.append((rank, action, start, end))
    if not out and not allow_empty:
        raise ValueError("no measured records")
    return out


def _dependency_key(a: Action) -> tuple[int, int]:
    """A task's place in the dependencies of its microbatch: F down the stages, then B (or BW) back
    up, then W. Tasks of one rank with the same start and end (zero-length ones at one instant, by
    the clock's resolution) are ordered by it: a task's inputs then always come first, where the
    records' order (W written before its B, say) may not."""
    return (0, a.stage) if a.kind is Kind.F else (1 if a.kind is not Kind.W else 2, -a.stage)


def _schedule_from_records(parsed: Sequence[tuple[int, Action, float, float]]) -> Schedule:
    """The schedule the records ran: each rank's tasks in start order (then end; ties of both by
    `_dependency_key`); placement from the ranks."""
    num_ranks = 1 + max(r for r, *_ in parsed)
    num_stages = 1 + max(a.stage for _, a, *_ in parsed)
    placement: dict[int, int] = {}
    for rank, a, *_ in parsed:
        if placement.setdefault(a.stage, rank) != rank:
            raise ValueError(f"measured task {a} ran on rank {rank} but stage {a.stage} also ran on rank {placement[a.stage]}")
    missing = [s for s in range(num_stages) if s not in placement]
    if missing:
        raise ValueError(f"no measured records for stage(s) {missing}; pass the schedule")
    orders: list[list[Action]] = [[] for _ in range(num_ranks)]
    # a task starts no earlier than its inputs end, so on one rank it sorts after them by
    # (start, end) unless both are one instant: there the dependency order decides
    for rank, a, _s, _e in sorted(parsed, key=lambda x: (x[2], x[3], _dependency_key(x[1]))):
        orders[rank].append(a)
    return Schedule(
        num_ranks=num_ranks,
        num_stages=num_stages,
        num_microbatches=1 + max(a.microbatch for _, a, *_ in parsed),
        placement=tuple(placement[s] for s in range(num_stages)),
        orders=tuple(tuple(o) for o in orders),
        name="measured",
    )


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total time covered: overlapped tasks (e.g. DualPipe's F&B pairs) count once."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s  # type: ignore[operator]
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s  # type: ignore[operator]
    return total


def measured_result(records: Iterable[Record], schedule: Schedule | None = None, memory: Memory | None = None) -> SimResult:
    """A `SimResult` holding measured times, so a measurement prints and plots like a plan.

    With `schedule`, the records must be exactly its tasks, each on the rank that holds its stage
    (a `ValueError` names the first task that is missing, extra, repeated or misplaced); without,
    the schedule is read off the records, which must then be a whole step (every task of every
    microbatch up to the largest recorded; a `ValueError` names the first missing one). `busy_per_rank` is the time a rank computes (tasks that
    overlap count once), so `bubble_rate` is docs/DESIGN.md's definition applied to the measurement.
    Memory follows `memory` (default ``Memory()``) in the measured order of each rank's tasks, its
    transients counted as `simulate` counts them.

    >>> recs = [{"rank": 0, "action": "F0.0", "start": 0.0, "end": 1.0},
    ...         {"rank": 1, "action": "F1.0", "start": 1.5, "end": 2.5},
    ...         {"rank": 1, "action": "BW1.0", "start": 2.5, "end": 4.5},
    ...         {"rank": 0, "action": "BW0.0", "start": 5.0, "end": 7.0}]
    >>> res = measured_result(recs)
    >>> res.spans, res.busy_per_rank, round(res.bubble_rate, 4)
    ([7.0, 3.0], [3.0, 3.0], 0.5714)
    """
    check_costs_memory("measured_result", None, memory)
    if schedule is not None and not isinstance(schedule, Schedule):
        raise TypeError(f"measured_result: schedule must be a zbpp.schedules.Schedule or None, got {type(schedule).__name__}")
    parsed = _parse_records(records)
    if schedule is None:
        schedule = _schedule_from_records(parsed)
        try:  # a whole step's records: a step cut short would give a span and bubble rate of part of it
            validate(schedule)
        except ScheduleError as exc:
            raise ValueError(f"the measured records are not one whole step: {exc} (measured_bubble_rate takes "
                             "part of a step)") from None
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    expected = {a: r for r, a in schedule.actions()}
    for rank, a, s, e in parsed:
        if a not in expected:
            raise ValueError(f"measured task {a} (rank {rank}) is not a task of schedule {schedule.name or '(unnamed)'}")
        if expected[a] != rank:
            raise ValueError(f"measured task {a} ran on rank {rank} but the schedule places it on rank {expected[a]}")
        if a in start:
            raise ValueError(f"measured task {a} is recorded twice")
        start[a], end[a] = s, e
    missing = [a for a in expected if a not in start]
    if missing:
        raise ValueError(
            f"{len(missing)} task(s) of the schedule have no measured record, e.g. {missing[0]} (rank {expected[missing[0]]})"
        )

    deltas = (memory or Memory()).deltas(schedule.num_stages)
    transients = (memory or Memory()).transients(schedule.num_stages)
    kind_index = {Kind.F: 0, Kind.B: 1, Kind.W: 2, Kind.BW: 3}
    spans, busy, peak = [], [], []
    mem_after: dict[Action, float] = {}
    for order in schedule.orders:
        if not order:
            spans.append(0.0)
            busy.append(0.0)
            peak.append(0.0)
            continue
        spans.append(max(end[a] for a in order) - min(start[a] for a in order))
        busy.append(_union_length([(start[a], end[a]) for a in order]))
        mem = top = 0.0
        for a in sorted(order, key=lambda a: (start[a], end[a])):  # memory in measured order
            top = max(top, mem + transients[a.stage][kind_index[a.kind]])
            mem += deltas[a.stage][kind_index[a.kind]]
            mem_after[a] = mem
            top = max(top, mem)
        peak.append(top)
    return SimResult(
        schedule=schedule,
        start=start,
        end=end,
        spans=spans,
        busy_per_rank=busy,
        makespan=max(end.values()) - min(start.values()),
        peak_memory=peak,
        memory_after=mem_after,
    )


def measured_summary(records: Iterable[Record], schedule: Schedule | None = None) -> dict[str, Any]:
    """Measured bubble rate (docs/DESIGN.md's definition) and mean task times per stage.

    Returns a JSON-serialisable dict: ``bubble_rate``, ``makespan``, ``spans``, ``busy_per_rank``
    (compute time per rank; overlapping tasks count once), ``bubble_per_rank``, ``num_tasks``, and
    ``mean_time`` = ``{"F": [...], "B": [...], "W": [...], "BW": [...]}``, one mean per stage
    (None where the stage has no task of that kind), in the records' time unit (seconds).

    >>> recs = [{"rank": 0, "action": "F0.0", "start": 0.0, "end": 1.0},
    ...         {"rank": 0, "action": "BW0.0", "start": 1.0, "end": 3.0}]
    >>> s = measured_summary(recs)
    >>> s["bubble_rate"], s["mean_time"]["BW"]
    (0.0, [2.0])
    """
    records = list(records)
    res = measured_result(records, schedule)
    sched = res.schedule
    sums = {k: [[0.0, 0] for _ in range(sched.num_stages)] for k in Kind}
    for a, s in res.start.items():
        acc = sums[a.kind][a.stage]
        acc[0] += res.end[a] - s
        acc[1] += 1
    return {
        "schedule": sched.name,
        "num_tasks": len(res.start),
        "bubble_rate": res.bubble_rate,
        "makespan": res.makespan,
        "spans": list(res.spans),
        "busy_per_rank": list(res.busy_per_rank),
        "bubble_per_rank": res.bubble_per_rank,
        "mean_time": {k.value: [t / n if n else None for t, n in sums[k]] for k in Kind},
    }


def measured_bubble_rate(records: Iterable[Record]) -> float:
    """The bubble rate of measured records (module docstring); 0.0 for no records. Unlike
    `measured_result`, the records need not be a whole schedule's."""
    spans: dict[int, list[float]] = {}
    tasks: dict[int, list[tuple[float, float]]] = {}
    for rank, _, s, e in _parse_records(records, allow_empty=True):
        lo_hi = spans.setdefault(rank, [s, e])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], s), max(lo_hi[1], e)
        tasks.setdefault(rank, []).append((s, e))
    if not spans:
        return 0.0
    cost = max(hi - lo for lo, hi in spans.values())
    busy = max(_union_length(t) for t in tasks.values())
    return (cost - busy) / cost if cost > 0 else 0.0
