"""Chrome / Perfetto traces of planned and measured pipeline steps, and measured summaries.

`write_trace` writes one JSON file (open it at https://ui.perfetto.dev or chrome://tracing) that
holds the simulated plan, the measured run, or both side by side:

- the plan: one process per rank (``plan · rank r``), a ``compute`` track with every task and a
  ``comm`` track with every message (a send on the producing rank, its receive on the consuming
  rank, joined by a flow arrow), following DESIGN.md's rule that only cross-rank data edges carry
  a message;
- the measurement: one process per rank (``measured · rank r``) with every recorded task, and
  flow arrows along the same cross-rank edges.

Measured records are what ``Pipeline(..., profile=True)`` gathers on pipeline rank 0: dicts
``{"rank": int, "action": "F0.3", "start": float, "end": float}`` with times in seconds from the
start of the step. `measured_result` turns them into a `SimResult` (so they plot and print like a
plan), `measured_summary` reports their bubble rate and mean task times, and
``Costs.from_profile`` turns them into costs to re-plan with.

>>> import json, os, tempfile
>>> from zbpp.schedules import build, simulate
>>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
>>> write_trace(path, plan=simulate(build("1f1b", num_ranks=2, num_microbatches=2)))
>>> events = json.load(open(path))["traceEvents"]
>>> sum(e["ph"] == "X" and e["cat"] == "plan" for e in events)  # one per task
8
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Sequence

from ..schedules.dag import data_consumers
from ..schedules.ir import Action, Kind, Schedule
from ..schedules.simulate import Memory, SimResult

__all__ = ["write_trace", "read_trace", "measured_result", "measured_summary"]

Record = Mapping[str, Any]
_COMPUTE_TID, _COMM_TID = 0, 1


# -- measured records ------------------------------------------------------------------------
def _parse_records(records: Iterable[Record]) -> list[tuple[int, Action, float, float]]:
    out = []
    for rec in records:
        try:
            rank, action = int(rec["rank"]), Action.parse(str(rec["action"]))
            start, end = float(rec["start"]), float(rec["end"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"measured record {dict(rec)!r}: need 'rank', 'action' (e.g. 'F0.3'), 'start' and 'end': {exc}"
            ) from None
        if end < start:
            raise ValueError(f"measured record {dict(rec)!r}: ends before it starts")
        out.append((rank, action, start, end))
    if not out:
        raise ValueError("no measured records")
    return out


def _schedule_from_records(parsed: Sequence[tuple[int, Action, float, float]]) -> Schedule:
    """The schedule the records ran: each rank's tasks in start order; placement from the ranks."""
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
    for rank, a, _s, _e in sorted(parsed, key=lambda x: (x[2], x[3])):
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
    the schedule is read off the records. `busy_per_rank` is the time a rank computes (tasks that
    overlap count once), so `bubble_rate` is DESIGN.md's definition applied to the measurement.
    Memory follows `memory` (default ``Memory()``) in the measured order of each rank's tasks.

    >>> recs = [{"rank": 0, "action": "F0.0", "start": 0.0, "end": 1.0},
    ...         {"rank": 1, "action": "F1.0", "start": 1.5, "end": 2.5},
    ...         {"rank": 1, "action": "BW1.0", "start": 2.5, "end": 4.5},
    ...         {"rank": 0, "action": "BW0.0", "start": 5.0, "end": 7.0}]
    >>> res = measured_result(recs)
    >>> res.spans, res.busy_per_rank, round(res.bubble_rate, 4)
    ([7.0, 3.0], [3.0, 3.0], 0.5714)
    """
    parsed = _parse_records(records)
    if schedule is None:
        schedule = _schedule_from_records(parsed)
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
    """Measured bubble rate (DESIGN.md's definition) and mean task times per stage.

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


# -- traces ------------------------------------------------------------------------------------
def _meta(pid: int, name: str, sort: int, threads: Sequence[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort}},
    ]
    for tid, tname in enumerate(threads):
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": tname}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return out


def _task_event(a: Action, rank: int, pid: int, start: float, end: float, unit_us: float, cat: str, chunk: int) -> dict[str, Any]:
    return {
        "name": str(a),
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": _COMPUTE_TID,
        "ts": start * unit_us,
        "dur": (end - start) * unit_us,
        "args": {"rank": rank, "action": str(a), "kind": a.kind.value, "stage": a.stage, "microbatch": a.microbatch,
                 "chunk": chunk},
    }


def _messages(schedule: Schedule) -> list[tuple[Action, Action]]:
    """Every cross-rank data edge (producer, consumer): the messages of one step."""
    present = {a for _, a in schedule.actions()}
    out = []
    for _, a in schedule.actions():
        for c in data_consumers(a, schedule.num_stages, present):
            if c in present and schedule.rank_of(c.stage) != schedule.rank_of(a.stage):
                out.append((a, c))
    return out


def _chunks(schedule: Schedule) -> dict[int, int]:
    return {s: i for r in range(schedule.num_ranks) for i, s in enumerate(schedule.stages_on(r))}


def write_trace(
    path: str | os.PathLike[str],
    *,
    plan: SimResult | None = None,
    measured: Iterable[Record] | None = None,
    schedule: Schedule | None = None,
    plan_unit_s: float | None = None,
    comm: float = 0.0,
) -> None:
    """Write ONE Chrome/Perfetto trace JSON with the `plan`, the `measured` run, or both.

    `schedule` defaults to the plan's (or is read off the records); it tells which edges carry
    messages. Measured times are seconds. `plan_unit_s` is how many seconds one unit of the
    plan's costs stands for: by default 1 when `measured` is given (a plan from
    ``Costs.from_profile`` is in seconds) and 1e-3 otherwise (unit costs drawn as milliseconds).
    `comm` is the plan's message time (its ``Costs.comm``, in plan units): each message is drawn
    as a send on the producer's comm track and a receive on the consumer's, from the producer's
    end for `comm`, joined by a flow arrow. Measured tasks are joined along the same edges. The
    file also records the schedule (``otherData.zbpp_schedule``) so `read_trace` can load a
    measurement back for plotting.

    Typical use after a profiled step (on pipeline rank 0)::

        records = pipe.profile_records()
        costs = Costs.from_profile(records, sched.num_stages)
        write_trace("step.json", plan=simulate(sched, costs), measured=records)
    """
    if plan is None and measured is None:
        raise ValueError("write_trace needs plan= (a SimResult), measured= (profile records) or both")
    measured_res = None
    if measured is not None:
        measured_res = measured_result(measured, schedule if schedule is not None else (plan.schedule if plan else None))
    sched = schedule or (plan.schedule if plan is not None else measured_res.schedule)  # type: ignore[union-attr]
    p = sched.num_ranks
    chunk = _chunks(sched)
    messages = _messages(sched)
    events: list[dict[str, Any]] = []
    flow_id = 0

    if plan is not None:
        unit_us = 1e6 * (plan_unit_s if plan_unit_s is not None else (1.0 if measured is not None else 1e-3))
        for r in range(p):
            events += _meta(r, f"plan · rank {r}", r, ["compute", "comm"])
            for a in plan.schedule.orders[r]:
                events.append(_task_event(a, r, r, plan.start[a], plan.end[a], unit_us, "plan", chunk[a.stage]))
        for a, c in messages:
            src, dst = sched.rank_of(a.stage), sched.rank_of(c.stage)
            t = plan.end[a] * unit_us
            name = f"{a} -> {c}"
            common = {"cat": "comm", "ph": "X", "tid": _COMM_TID, "ts": t, "dur": float(comm) * unit_us,
                      "args": {"from": str(a), "to": str(c)}, "bind_id": flow_id}
            # Flow v2: the arrow is bound to these two slices themselves, not looked up by
            # timestamp, so it holds even when comm = 0 makes them zero-length.
            events.append({"name": f"send {name}", "pid": src, "flow_out": True, **common})
            events.append({"name": f"recv {name}", "pid": dst, "flow_in": True, **common})
            flow_id += 1

    if measured_res is not None:
        base = p if plan is not None else 0
        for r in range(p):
            events += _meta(base + r, f"measured · rank {r}", base + r, ["compute"])
            for a in measured_res.schedule.orders[r]:
                events.append(_task_event(a, r, base + r, measured_res.start[a], measured_res.end[a], 1e6, "measured",
                                          chunk[a.stage]))
        for a, c in messages:
            src, dst = sched.rank_of(a.stage), sched.rank_of(c.stage)
            # Flow v1 (a task can send one message and receive another, and a slice binds one v2
            # flow): each end binds to the slice enclosing its timestamp, so put it mid-task.
            for ph, task, pid in (("s", a, base + src), ("f", c, base + dst)):
                mid = (measured_res.start[task] + measured_res.end[task]) / 2 * 1e6
                events.append({"name": "message", "cat": "flow", "ph": ph, "id": flow_id, "pid": pid, "tid": _COMPUTE_TID,
                               "ts": mid, **({"bp": "e"} if ph == "f" else {})})
            flow_id += 1

    doc = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"generator": "zbpp", "zbpp_schedule": sched.to_text()},
    }
    with open(path, "w") as fh:
        json.dump(doc, fh)


def read_trace(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], Schedule | None]:
    """The measured records and the schedule stored in a trace written by `write_trace`.

    Raises `ValueError` if the file holds no measured tasks.
    """
    with open(path) as fh:
        doc = json.load(fh)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    records = [
        {"rank": e["args"]["rank"], "action": e["args"]["action"], "start": e["ts"] / 1e6, "end": (e["ts"] + e["dur"]) / 1e6}
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "measured"
    ]
    if not records:
        raise ValueError(f"{os.fspath(path)}: no measured tasks in this trace (write it with write_trace(measured=...))")
    text = doc.get("otherData", {}).get("zbpp_schedule") if isinstance(doc, dict) else None
    return records, (Schedule.from_text(text) if text else None)
