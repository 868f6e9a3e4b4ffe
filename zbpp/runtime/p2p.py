"""Point-to-point transport between the ranks of one pipeline (NCCL or gloo).

Thin on purpose: the *order* of operations is decided by `zbpp.runtime.plan`; this module only
issues them. Tensors travel one ``isend``/``irecv`` each (a message of several tensor leaves is
several operations, in leaf order on both sides). Metadata (a picklable object, e.g. a
`zbpp.runtime.tree.Spec`) travels as two operations: its byte length, then its bytes; its receive
blocks the caller, which is why the executor only does it when the plan's order allows.

On NCCL every tensor must be on the rank's CUDA device; on gloo on the CPU.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .tree import TensorMeta

__all__ = ["Transport"]


class Transport:
    """Send and receive tensors and small objects to other pipeline ranks.

    Args:
        group: the pipeline's process group.
        global_rank_of: pipeline rank -> global rank (``ParallelGroups.pp_peer``).
        device: where received tensors are allocated.
    """

    def __init__(self, group: Any, global_rank_of: Callable[[int], int], device: torch.device) -> None:
        self.group = group
        self.global_rank_of = global_rank_of
        self.device = device

    def isend(self, tensors: Sequence[torch.Tensor], peer: int) -> list[Any]:
        """Start sending `tensors` (contiguous, on `device`) to pipeline rank `peer`; one work each."""
        dst = self.global_rank_of(peer)
        return [dist.isend(t, dst, group=self.group) for t in tensors]

    def irecv(self, metas: Sequence[TensorMeta], peer: int) -> tuple[list[torch.Tensor], list[Any]]:
        """Post receives from pipeline rank `peer` into new buffers shaped like `metas`."""
        src = self.global_rank_of(peer)
        bufs = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
        return bufs, [dist.irecv(b, src, group=self.group) for b in bufs]

    def send_object(self, obj: Any, peer: int) -> tuple[list[Any], list[torch.Tensor]]:
        """Start sending a picklable `obj`; returns the works and the buffers to keep until they finish."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        bufs = [size, data]
        return self.isend(bufs, peer), bufs

    def recv_object(self, peer: int) -> Any:
        """Receive an object sent by `send_object` (blocks until it has arrived)."""
        src = self.global_rank_of(peer)
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.irecv(size, src, group=self.group).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.irecv(data, src, group=self.group).wait()
        return pickle.loads(bytes(data.cpu().tolist()))  # no numpy: it is not a dependency
