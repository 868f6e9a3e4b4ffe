"""The failure record of one rank's step: what went wrong first, where, and whether the rank drains.

A task that raises, a send or receive that breaks, or a peer's POISON makes the rank *drain*
(`zbpp.runtime.executor`): it computes nothing more but still issues every send and receive of its
program. The record is written by the executor and the communication queue, and read by the end
agreement (`zbpp.runtime.pipeline`).

>>> record = StepFailure()
>>> record.fail(ValueError("bad"), None); record.draining, type(record.error).__name__
(True, 'ValueError')
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from typing import Sequence

from ..schedules.ir import Action
from .errors import describe_error

__all__ = ["StepFailure", "tasks_around"]


@dataclass
class StepFailure:
    """What went wrong on this rank during one step (nothing, while `error` is None)."""

    error: BaseException | None = None  #: the first exception of this rank
    task: Action | None = None  #: where it happened (None: outside a task)
    at: float = 0.0  #: when (time.time())
    upstream: bool = False  #: a peer's POISON made this rank drain
    comm_error: BaseException | None = None  #: communication broke (a dead peer): the pipeline is unusable
    current: Action | None = None  #: the task running now (named when communication fails)

    @property
    def draining(self) -> bool:
        """No more compute this step: this rank failed, or a peer did upstream."""
        return self.error is not None or self.upstream

    def fail(self, exc: BaseException, task: Action | None) -> None:
        """Record `exc` (only the first one counts)."""
        if self.error is None:
            self.error, self.task, self.at = exc, task, time.time()

    def report(self, tasks: Sequence[Action], where: str, schedule: str, rank: int) -> str | None:
        """What this rank tells the others about its failure (None: it did not fail): `where` it
        runs, the task and the error, then, on a line of its own, its schedule around the task."""
        if self.error is None:
            return None
        task = f"task {self.task}" if self.task is not None else "outside any task"
        text = f"{where}, {task} of schedule {schedule!r}: {describe_error(self.error)}"
        if self.task in tasks:
            text += "\n" + tasks_around(tasks, tasks.index(self.task), rank)
        return text


def tasks_around(tasks: Sequence[Action], index: int, rank: int, context: int = 4) -> str:
    """One rank's schedule around its task `index`, that task marked (as torch.distributed.pipelining
    marks the failing action in its schedule grid).

    >>> from zbpp.schedules import build
    >>> print(tasks_around(build("zb-h1", num_ranks=2, num_microbatches=4).orders[1], 4, rank=1))
    pipeline rank 1, tasks 1-9 of 12:  F1.0 B1.0 F1.1 B1.1 [W1.0] F1.2 B1.2 W1.1 F1.3 ...
    """
    lo, hi = max(0, index - context), min(len(tasks), index + context + 1)
    shown = [f"[{a}]" if i == index else str(a) for i, a in enumerate(tasks[lo:hi], start=lo)]
    return (f"pipeline rank {rank}, tasks {lo + 1}-{hi} of {len(tasks)}:  "
            + ("... " if lo > 0 else "") + " ".join(shown) + (" ..." if hi < len(tasks) else ""))
