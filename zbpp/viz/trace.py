"""Chrome / Perfetto traces of simulated and measured pipeline steps, and measured summaries.

`write_trace` writes one JSON file (open it at https://ui.perfetto.dev or chrome://tracing) that
holds the simulation, the measured run, or both side by side:

- the simulation: one process per rank (``simulated · rank r``), a ``compute`` track with every task and
  ``comm`` tracks with every message (a send on the producing rank, its receive on the consuming
  rank, joined by a flow arrow; messages in flight at once go on tracks ``comm 2``, ``comm 3``, ...
  so that no two slices of a track overlap): the messages of `zbpp.schedules.program` (only cross-rank data
  edges carry one);
- the measurement: one process per rank (``measured · rank r``) with every recorded task (tasks
  that ran at once, such as DualPipe's overlapped F&B pairs, on tracks ``compute 2``, ...), and
  flow arrows along the same cross-rank edges.

Measured records are what ``Pipeline(..., record_task_times=True)`` gathers on pipeline rank 0 (see
`zbpp.schedules.measured`, which `measured_result` and `measured_summary` come from);
``Costs.from_task_times`` turns them into costs to simulate with.

>>> import json, os, tempfile
>>> from zbpp.schedules import build, simulate
>>> path = os.path.join(tempfile.mkdtemp(), "simulated.json")
>>> write_trace(path, simulated=simulate(build("1f1b", num_ranks=2, num_microbatches=2)))
>>> events = json.load(open(path))["traceEvents"]
>>> sum(e["ph"] == "X" and e["cat"] == "simulated" for e in events)  # one per task
8
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Sequence

from ..schedules.checks import as_number, as_positive
from ..schedules.ir import Action, Schedule
from ..schedules.measured import measured_result, measured_summary
from ..schedules.program import make_program
from ..schedules.simulate import SimResult
from ._lanes import lanes

__all__ = ["write_trace", "read_trace", "measured_result", "measured_summary"]

Record = Mapping[str, Any]
_COMPUTE_TID, _COMM_TID = 0, 1
_GRID = 1024.0  # steps per microsecond of the times written: a power of 2, so they add up exactly


def _us(t: float) -> float:
    """Time `t` (already in microseconds) on a grid of 1/1024 us (under 1 ns). On it ts + dur is exact,
    so a task ending as the next one starts never overlaps it by a rounding error of the sum."""
    return round(t * _GRID) / _GRID


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
        "ts": _us(start * unit_us),
        "dur": _us(end * unit_us) - _us(start * unit_us),
        "args": {"rank": rank, "action": str(a), "kind": a.kind.value, "stage": a.stage, "microbatch": a.microbatch,
                 "chunk": chunk},
    }


def _lanes(slices: list[dict[str, Any]], first_tid: int) -> int:
    """Put each slice of one rank on a track (``tid`` from `first_tid` on) where it overlaps no
    other: slices on one track must nest, and two messages in flight at once (comm longer than the
    gap between them) or two measured tasks run at once only partly overlap. Returns how many
    tracks were used."""
    lane_of = lanes([(e["ts"], e["ts"] + e["dur"]) for e in slices])
    for e, lane in zip(slices, lane_of):
        e["tid"] = first_tid + lane
    return max(lane_of, default=-1) + 1


def _track_names(kind: str, lanes: int) -> list[str]:
    """``kind``, ``kind 2``, ``kind 3``, ... for `lanes` tracks (at least one)."""
    return [kind if i == 0 else f"{kind} {i + 1}" for i in range(max(lanes, 1))]


def _messages(schedule: Schedule) -> list[tuple[Action, Action]]:
    """The messages of one step (producer, consumer): the program's, as the runtime sends them."""
    return [(m.src, m.dst) for m in make_program(schedule).messages]


def _chunks(schedule: Schedule) -> dict[int, int]:
    return {s: i for r in range(schedule.num_ranks) for i, s in enumerate(schedule.stages_on(r))}


def _shape(schedule: Schedule) -> tuple:
    """What a trace draws of a schedule: its placement, microbatches and orders (not its name)."""
    return schedule.placement, schedule.num_microbatches, schedule.orders


def write_trace(
    path: str | os.PathLike[str],
    *,
    simulated: SimResult | None = None,
    measured: Iterable[Record] | None = None,
    schedule: Schedule | None = None,
    simulated_unit_s: float | None = None,
    comm: float = 0.0,
) -> None:
    """Write ONE Chrome/Perfetto trace JSON with the `simulated` step, the `measured` run, or both.

    `schedule` defaults to the simulation's (or is read off the records); it tells which edges carry
    messages. Given with `simulated`, it must be the simulation's own (the same placement,
    microbatches and orders; the name may differ): a `ValueError` says so otherwise. Measured times are seconds. `simulated_unit_s` is how many seconds one unit of the
    simulation's costs stands for: by default 1 when `measured` is given (a simulation with costs from
    ``Costs.from_task_times`` is in seconds) and 1e-3 otherwise (unit costs drawn as milliseconds).
    `comm` is the simulation's message time (its ``Costs.comm``, in its units): each message is drawn
    as a send on the producer's comm track and a receive on the consumer's, from the producer's
    end for `comm`, joined by a flow arrow. Measured tasks are joined along the same edges. Times
    are written in microseconds rounded to 1/1024 us, so back-to-back tasks meet exactly. The
    file also records the schedule (``otherData.zbpp_schedule``) so `read_trace` can load a
    measurement back for plotting.

    Typical use after a step that recorded its task times (on pipeline rank 0)::

        records = pipe.task_times()
        costs = Costs.from_task_times(records, sched.num_stages)
        write_trace("step.json", simulated=simulate(sched, costs), measured=records)
    """
    if simulated is None and measured is None:
        raise ValueError("write_trace needs simulated= (a SimResult), measured= (task records) or both")
    # a wrong type would fail further on as an AttributeError that names neither argument
    for key, value, kind, hint in (("simulated", simulated, SimResult, "simulate(schedule, costs)"),
                                   ("schedule", schedule, Schedule, "build(...)")):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"write_trace: {key}= must be a zbpp.schedules.{kind.__name__} ({hint}) or None, "
                            f"got {value!r:.60} ({type(value).__name__})")
    # a negative comm would draw slices of negative length, a unit of 0 put every task at time 0
    comm = as_number(comm, "write_trace comm")
    if simulated_unit_s is not None:
        simulated_unit_s = as_positive(simulated_unit_s, "write_trace simulated_unit_s")
    if simulated is not None and schedule is not None and _shape(schedule) != _shape(simulated.schedule):
        # the simulation has times only for its own tasks: another schedule's would be looked up in vain
        raise ValueError(
            f"write_trace: schedule= ({schedule.name or 'unnamed'}, {schedule.num_ranks} ranks, "
            f"{schedule.num_microbatches} microbatches) is not the schedule simulated= ran "
            f"({simulated.schedule.name or 'unnamed'}, {simulated.schedule.num_ranks} ranks, "
            f"{simulated.schedule.num_microbatches} microbatches); pass the simulation's, or leave schedule= out")
    measured_res = None
    if measured is not None:
        measured_res = measured_result(measured, schedule if schedule is not None else (simulated.schedule if simulated else None))
    sched = schedule or (simulated.schedule if simulated is not None else measured_res.schedule)  # type: ignore[union-attr]
    p = sched.num_ranks
    chunk = _chunks(sched)
    messages = _messages(sched)
    events: list[dict[str, Any]] = []
    flow_id = 0

    if simulated is not None:
        unit_us = 1e6 * (simulated_unit_s if simulated_unit_s is not None else (1.0 if measured is not None else 1e-3))
        comm_events: dict[int, list[dict[str, Any]]] = {r: [] for r in range(p)}
        for a, c in messages:
            src, dst = sched.rank_of(a.stage), sched.rank_of(c.stage)
            t = _us(simulated.end[a] * unit_us)
            name = f"{a} -> {c}"
            common = {"cat": "comm", "ph": "X", "ts": t, "dur": _us(float(comm) * unit_us),
                      "args": {"from": str(a), "to": str(c)}, "bind_id": flow_id}
            # Flow v2: the arrow is bound to these two slices themselves, not looked up by
            # timestamp, so it holds even when comm = 0 makes them zero-length.
            comm_events[src].append({"name": f"send {name}", "pid": src, "flow_out": True, **common})
            comm_events[dst].append({"name": f"recv {name}", "pid": dst, "flow_in": True, **common})
            flow_id += 1
        for r in range(p):
            lanes = _lanes(comm_events[r], _COMM_TID)  # messages in flight at once on this rank: one track each
            events += _meta(r, f"simulated · rank {r}", r, ["compute"] + _track_names("comm", lanes))
            for a in simulated.schedule.orders[r]:
                events.append(_task_event(a, r, r, simulated.start[a], simulated.end[a], unit_us, "simulated", chunk[a.stage]))
            events += comm_events[r]

    if measured_res is not None:
        base = p if simulated is not None else 0
        tid: dict[Action, int] = {}  # each measured task's track
        for r in range(p):
            tasks = [_task_event(a, r, base + r, measured_res.start[a], measured_res.end[a], 1e6, "measured",
                                 chunk[a.stage]) for a in measured_res.schedule.orders[r]]
            # tasks run at once (DualPipe's overlapped pairs) would partly overlap on one track
            lanes = _lanes(tasks, _COMPUTE_TID)
            events += _meta(base + r, f"measured · rank {r}", base + r, _track_names("compute", lanes))
            events += tasks
            tid.update((a, e["tid"]) for a, e in zip(measured_res.schedule.orders[r], tasks))
        for a, c in messages:
            src, dst = sched.rank_of(a.stage), sched.rank_of(c.stage)
            # Flow v1 (a task can send one message and receive another, and a slice binds one v2
            # flow): each end binds to the slice enclosing its timestamp, so put it mid-task.
            for ph, task, pid in (("s", a, base + src), ("f", c, base + dst)):
                mid = _us((measured_res.start[task] + measured_res.end[task]) / 2 * 1e6)
                events.append({"name": "message", "cat": "flow", "ph": ph, "id": flow_id, "pid": pid, "tid": tid[task],
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

    Raises `OSError` if the file cannot be read, and `ValueError` (its message starting with the path)
    if it is not such a trace: not JSON, no event list, a measured event without its fields, no
    measured tasks, or a stored schedule that does not parse.
    """
    where = os.fspath(path)
    with open(path) as fh:
        try:
            doc = json.load(fh)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{where}: not a JSON file ({exc})") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"{where}: not a trace (a JSON list of events, or an object with 'traceEvents')")
    records = []
    for i, e in enumerate(events):
        if not (isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") == "measured"):
            continue
        try:
            records.append({"rank": e["args"]["rank"], "action": e["args"]["action"],
                            "start": e["ts"] / 1e6, "end": (e["ts"] + e["dur"]) / 1e6})
        except (KeyError, TypeError) as exc:  # a hand-edited or foreign trace: say which event
            raise ValueError(f"{where}: measured event {i} lacks args.rank, args.action, ts or dur "
                             f"(or one is not a number): {type(exc).__name__} {exc}") from None
    if not records:
        raise ValueError(f"{where}: no measured tasks in this trace (write it with write_trace(measured=...))")
    other = doc.get("otherData") if isinstance(doc, dict) else None
    text = other.get("zbpp_schedule") if isinstance(other, dict) else None
    try:
        return records, (Schedule.from_text(text) if text else None)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}: its stored schedule (otherData.zbpp_schedule) does not parse: {exc}") from None
