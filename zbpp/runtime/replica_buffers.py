"""Module buffers kept equal across data-parallel replicas, as DDP's ``broadcast_buffers`` does.

A forward may change a module's buffers (BatchNorm's running statistics and batch counter). Each
replica changes its own from its own data, so the replicas would drift apart: evaluations would
depend on the replica, and a checkpoint (one copy) would resume every replica from replica 0's.
At the end of every step, before its end agreement (a failure then raises on every rank in that
step), `ReplicaBuffers.sync` broadcasts the persistent buffers (those a ``state_dict`` holds) of
this rank's stages from replica 0 to the others, one broadcast per dtype and device.
Non-persistent buffers (rotary frequencies, masks: derived constants by convention) are left alone. Buffer updates do not reliably move a tensor's version
counter (BatchNorm's kernel writes its running statistics without), so every step sends them all.
The buffers are looked up at every sync, so a module with buffers added to a stage after the
Pipeline was built (a ``BatchNorm1d(affine=False)``, which adds no parameter) is kept equal too.

>>> import torch
>>> ReplicaBuffers.of({0: torch.nn.BatchNorm1d(2)}, None, None) is None  # one replica: nothing to do
True
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from .._compat import foreach_copy_, persistent_buffers
from .polling import wait_for

__all__ = ["ReplicaBuffers"]


class ReplicaBuffers:
    """Broadcast the persistent buffers of one pipeline rank's stages from replica 0.

    Args:
        stage_modules: ``{stage: module}`` of this pipeline rank.
        topology: the pipeline's `Topology` (``dp_group``, ``pipelines``, ``pp_rank``).
        host_group: a gloo group of the same replicas, for buffers on the host when ``dp_group``
            is NCCL.
    """

    def __init__(self, stage_modules: Mapping[int, nn.Module], topology: Any, host_group: Any) -> None:
        self._modules = list(stage_modules.values())
        self._src = topology.pipelines[0][topology.pp_rank]  # global rank of replica 0 at this position
        self._group = topology.dp_group
        self._host_group = host_group
        #: called while waiting on the host (it may raise): `Pipeline` passes its agreement's check
        self.wait_check: Callable[[], None] | None = None

    @classmethod
    def of(cls, stage_modules: Mapping[int, nn.Module], topology: Any,
           timeout: timedelta | None) -> "ReplicaBuffers | None":
        """One for `topology`'s replicas, or None without data parallelism. Stages without
        persistent buffers get one too: a module with buffers may be added to them later."""
        if topology is None or topology.dp_size == 1:
            return None
        from .channels import cached_group

        # every rank builds every position's group, buffers or not (new_group is collective over
        # the world); `default_reducer` built them already where it ran
        host = [cached_group("dp-presence", [line[r] for line in topology.pipelines], "gloo", timeout)
                for r in range(topology.pp_size)][topology.pp_rank]
        return cls(stage_modules, topology, host)

    def sync(self, modules: Iterable[nn.Module] | None = None) -> None:
        """Give every replica replica 0's persistent buffers (at the end of a step, on every rank of
        the job: it is collective over each replica group; every replica of a pipeline position holds
        the same modules, so all send alike, nothing where none has buffers). Read afresh: a buffer
        may be replaced or added. `modules`: every module of this rank's stages, walked already
        (default: walk them)."""
        if modules is None:
            modules = [m for root in self._modules for m in root.modules()]
        buffers = list({id(b): b for b in persistent_buffers(modules)}.values())
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in buffers:
            groups.setdefault((b.dtype, b.device), []).append(b)
        sent = []
        for (dtype, device), bufs in groups.items():  # one order on every replica: the modules'
            flat = torch.cat([b.detach().reshape(-1) for b in bufs])
            wire = flat.view(torch.uint8) if dtype == torch.bool else flat  # gloo has no bool
            group = self._host_group if device.type == "cpu" else self._group
            sent.append((dist.broadcast(wire, src=self._src, group=group, async_op=True), flat, bufs, device))
        for work, flat, bufs, device in sent:
            wait_for(work, self.wait_check, device)
            if dist.get_rank() == self._src:
                continue  # replica 0 sent its own
            with torch.no_grad():
                foreach_copy_([b.detach() for b in bufs],
                              [part.view_as(b) for part, b in zip(flat.split([b.numel() for b in bufs]), bufs)])
