"""The two agreements of a step, among every rank of the job (every pipeline rank of every replica).

Both run on a gloo group over CPU tensors (`channels.agreement_group`): agreeing never waits for a
GPU, so a step whose input signature was seen before has no host-device synchronisation, and the
CPU can run ahead of the GPU across steps.

- At the start, every rank contributes a `StartReport`: whether its part of the input was
  rejected, a hash of its module state, and, from the ranks holding the first and the last stage,
  the input's hash and row count and the target's row count, and its base seed (the random
  streams of the F tasks derive from pipeline rank 0's: `zbpp.runtime.rng`). A rejected input, or a target whose
  rows differ from the input's, raises on every rank before any compute.
- At the end, every rank contributes an `EndReport`: whether it failed (and in which task, and
  when), drained because a peer failed, or saw its communication break. If any rank failed, every
  rank raises; the failing ranks' messages travel with the agreement, so every rank names the first
  failure (by wall-clock time: a rank computing on a drained peer's placeholders may fail after it).

A rank that died makes the agreement fail. gloo tells only the ranks that exchange data with it
directly (a closed connection, at once); the others would wait for the group's timeout. So a rank
that sees the agreement fail, or a send or receive fail during the step, marks the job *broken*
in the default store; every rank looks for that mark before an agreement and while it waits for
one: all of them raise within moments, and none enters a collective that others have left.

>>> Agreement(None).gather(EndReport(failed=False, drained=False, comm_broken=False, task=-1))[0].failed
False
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from typing import Any, TypeVar

import torch

from .._compat import default_store, process_group_name
from .polling import poll

__all__ = ["StartReport", "EndReport", "Agreement", "BrokenJob"]

R = TypeVar("R", "StartReport", "EndReport")

_POLL_STORE_S = 0.02  # how often a waiting rank looks for the broken mark


@dataclass(frozen=True)
class StartReport:
    """One rank's contribution to a step's start agreement (integers only)."""

    rejected: bool  #: its part of the input was refused (its error says why)
    state_hash: int  #: train/eval modes and requires_grad flags of its modules, and the step kind
    input_hash: int  #: the input's structure and shapes (rank holding stage 0; else 0)
    input_rows: int  #: rows of the input (rank holding stage 0; else -1)
    target_rows: int  #: rows of the target (rank holding the last stage, when given; else -1)
    seed: int = 0  #: its base seed of the microbatches' random streams (pipeline rank 0's is used)


@dataclass(frozen=True)
class EndReport:
    """One rank's contribution to a step's end agreement."""

    failed: bool  #: an exception on this rank (not a peer's POISON)
    drained: bool  #: it stopped computing because some rank failed
    comm_broken: bool  #: a send or receive failed (e.g. a dead peer): the pipeline is unusable
    task: int  #: index of the failed task in this rank's plan (-1: none, or outside any task)
    failed_at_us: int = 0  #: wall-clock time of the failure (us since the epoch): the first one is the cause


class BrokenJob(RuntimeError):
    """An agreement could not complete: a rank of the job is dead or hung."""


class Agreement:
    """Gathers every rank's report over the job's gloo group (None: a one-process pipeline)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._store: Any = None
        self._key = ""
        if group is not None:
            self._store = default_store()
            self._key = f"zbpp/{process_group_name(group)}/broken"

    def gather(self, mine: R) -> list[R]:
        """Every rank's report, in the group's rank order; raises `BrokenJob` when a rank is gone."""
        if self.group is None:
            return [mine]
        import torch.distributed as dist

        self.check()  # a collective some ranks already left would fail, or mismatch gloo's buffers
        t = torch.tensor([int(v) for v in astuple(mine)], dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        self._wait(dist.all_gather(out, t, group=self.group, async_op=True))
        kinds = [f.type for f in fields(type(mine))]
        return [type(mine)(*(bool(v) if k in ("bool", bool) else int(v) for v, k in zip(o.tolist(), kinds))) for o in out]

    def gather_texts(self, text: str | None) -> list[str | None]:
        """Every rank's `text` (only when some rank has one to tell: it pickles)."""
        if self.group is None:
            return [text]
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, text, group=self.group)
        return out

    def check(self) -> None:
        """Raise `BrokenJob` if some rank marked the job broken."""
        if self._store is not None and self._store.check([self._key]):
            raise BrokenJob(self._store.get(self._key).decode(errors="replace"))

    def mark_broken(self, why: str) -> None:
        """Tell every rank waiting for an agreement that it will not complete."""
        if self._store is not None:
            try:
                self._store.set(self._key, why)
            except Exception:  # noqa: BLE001 - the store's host may be the dead one
                pass

    def _wait(self, work: Any) -> None:
        poll(work, self.check, _POLL_STORE_S)
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - gloo: a closed connection or a timeout
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self.mark_broken(why)
            raise BrokenJob(why) from exc
