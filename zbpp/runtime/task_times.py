"""Task timing for `Pipeline(record_task_times=True)` (the measured bubble rate of records: `zbpp.schedules.measured`).

A record is ``{"rank": int, "action": "F0.3", "start": float, "end": float}``, times in seconds from
the start of the step, one instant shared by every rank of the pipeline (`TaskRecorder`). On CUDA the times come from CUDA events on the compute stream
(a task's start is when the stream reaches it, after waiting for its inputs); on the CPU from
``time.perf_counter`` taken after the task's inputs have arrived. When recording is off nothing is
recorded and nothing is allocated.

>>> recs = [{"rank": 0, "action": "F0.0", "start": 0.0, "end": 1.0},
...         {"rank": 0, "action": "B0.0", "start": 3.0, "end": 4.0},
...         {"rank": 1, "action": "F1.0", "start": 1.0, "end": 3.0}]
>>> round(measured_bubble_rate(recs), 4)
0.5
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .agreement import Agreement, agree_on_problems, collective_call

from ..schedules.measured import measured_bubble_rate  # re-exported: its one definition lives there

__all__ = ["TaskRecorder", "gather_records", "measured_bubble_rate"]


class TaskRecorder:
    """Collect (action, start, end) of the tasks of one rank in one step.

    `begin_step` marks the step's time 0. `Pipeline` calls it as the start agreement (a collective)
    returns, an instant that every rank of the pipeline shares: a rank that then takes longer to
    reach its first task (an FSDP all-gather, a device stream still busy) shows its tasks later,
    not shifted back onto its peers'. On CUDA a task's events run on the device; `records` maps
    them onto the host clock that time 0 was read on. `records` are those of the last step that
    `commit` kept (a step that succeeded): a failed step's partial records are never reported."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.cuda = device.type == "cuda"
        self._origin: Any = None
        self._host0 = 0.0  # time.perf_counter() at the step's time 0
        self._open: list[tuple[str, Any, Any]] = []
        self._kept: tuple[Any, float, list[tuple[str, Any, Any]]] | None = None  # the last committed step


    def begin_step(self) -> None:
        self._open = []
        self._host0 = time.perf_counter()
        self._origin = self._now()

    def _now(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def commit(self) -> None:
        """The step that `begin_step` began succeeded: its records are the ones to report."""
        if self._origin is not None:
            self._kept = (self._origin, self._host0, self._open)

    def start(self) -> Any:
        return self._now()

    def stop(self, action: str, started: Any) -> None:
        self._open.append((action, started, self._now()))

    def records(self) -> list[dict[str, Any]]:
        """The records of the last committed step, [] before one (synchronises the device on CUDA)."""
        if self._kept is None:
            return []
        origin, host0, tasks = self._kept
        out = []
        if self.cuda:
            torch.cuda.synchronize()
            # where the origin event ran on the host clock: an event recorded on an idle device
            # runs at once, so `now` ran when the host saw it done
            now = torch.cuda.Event(enable_timing=True)
            now.record()
            now.synchronize()
            shift = max(0.0, time.perf_counter() - origin.elapsed_time(now) / 1e3 - host0)
            for action, s, e in tasks:
                out.append(
                    {"rank": self.rank, "action": action,
                     "start": shift + origin.elapsed_time(s) / 1e3, "end": shift + origin.elapsed_time(e) / 1e3}
                )
        else:
            for action, s, e in tasks:
                out.append({"rank": self.rank, "action": action, "start": s - host0, "end": e - host0})
        return out


@collective_call()  # an interrupt while this rank waited comes once every rank took part
def gather_records(recorder: TaskRecorder, topology: Any) -> list[dict[str, Any]] | None:
    """The last successful step's records of every rank of the pipeline, on its rank 0 (None on the others).
    Collective over the pipeline group: exchanged as `agree_on_problems` does (``gather_object`` left its
    second collective to the peers when a Ctrl-C came in the first; a rank whose records raised left them
    all waiting)."""
    if topology.pp_size == 1:
        return recorder.records()
    try:
        mine, problem = recorder.records(), None  # resolved now, so that a step never waits for the device
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
        mine, problem = [], exc
    told = agree_on_problems(Agreement(topology.pp_group), problem, topology.pipeline,
                             "task_times could not run on every rank", payload=mine)
    if topology.pp_rank != 0:
        return None
    return [rec for recs in told for rec in recs]
