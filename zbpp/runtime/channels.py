"""Point-to-point channels between the ranks of a pipeline, and the agreement group of a job.

A *channel* carries the messages from one pipeline rank to another (`zbpp.schedules.program`). Each
channel is its own two-rank process group, so each direction has its own communicator and, on
NCCL, its own stream: a receive waiting for its data never holds up a send the other way.

NCCL communicators are created eagerly, when the groups are built (``new_group(device_id=...)``):
created lazily, the first send or receive of a pair would be a blocking handshake of the two ranks
that the program's issue points do not account for.

Process groups must be created by every rank of the job in one order (``new_group`` is collective
over the default group), so `Channels` creates the channels of every pipeline of the job, and
groups are cached per process: `Pipeline` objects of the same ranks and backend share
them (ops never interleave: one step runs at a time).

Tensors travel one ``isend``/``irecv`` each (a message of several tensors is several operations in
leaf order on both ends; empty tensors are not sent). A picklable object (a `zbpp.runtime.tree.Spec`)
travels as two operations, its byte length then its bytes; receiving it blocks the caller.
"""

from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from .._compat import default_group_timeout
from .polling import poll
from .topology import Topology
from .tree import TensorMeta

__all__ = ["Channels", "agreement_group", "cached_group", "default_timeout"]

Channel = tuple[int, int]  # (sending pipeline rank, receiving pipeline rank)

# seconds `Channels.abort` waits for NCCL's abort before the caller goes on to raise (see there)
ABORT_WAIT_S = 2.0

_GROUPS: dict[tuple[Any, ...], Any] = {}  # (purpose, backend, global ranks) -> group


def default_timeout() -> timedelta:
    """The default process group's timeout (what ``init_process_group(timeout=...)`` set)."""
    return default_group_timeout() or timedelta(minutes=10)


def cached_group(purpose: str, ranks: Sequence[int], backend: str, timeout: timedelta) -> Any:
    """A cached process group of `ranks` (every rank of the default group must call this in the same
    order with the same arguments); None on ranks outside it."""
    key = (purpose, backend, tuple(ranks))
    if key in _GROUPS:
        return _GROUPS[key]
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())  # eager: no lazy handshake
    group = dist.new_group(sorted(ranks), **kwargs)
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        group = None
    _GROUPS[key] = group
    return group


def agreement_group(topology: Topology, timeout: timedelta) -> Any:
    """The gloo group of every rank of the job's pipelines (CPU tensors only: agreeing on a step never
    waits for a GPU); None without torch.distributed."""
    if not topology.distributed:
        return None
    return cached_group("agree", topology.world, "gloo", timeout)


class Channels:
    """The channels of this rank (see the module docstring).

    Args:
        topology: this rank's place in the job.
        channels: every channel of a pipeline, as ``(src, dst)`` pipeline ranks (`Program.channels`).
        device: where tensors live (CUDA: NCCL; CPU: gloo).
        timeout: the groups' timeout.
    """

    def __init__(self, topology: Topology, channels: Iterable[Channel], device: torch.device,
                 timeout: timedelta) -> None:
        self.device = device
        self.timeout = timeout
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.pipeline = topology.pipeline
        self._groups: dict[Channel, Any] = {}
        channels = sorted(set(channels))
        for line in topology.pipelines:  # every pipeline's, in one order: new_group is collective
            for src, dst in channels:
                group = cached_group("p2p", (line[src], line[dst]), self.backend, timeout)
                if line == topology.pipeline:
                    self._groups[(src, dst)] = group

    def _peer(self, channel: Channel, sending: bool) -> tuple[Any, int]:
        src, dst = channel
        return self._groups[channel], self.pipeline[dst if sending else src]

    def isend(self, tensors: Sequence[torch.Tensor], channel: Channel) -> list[Any]:
        """Start sending `tensors` (contiguous, on the device) on `channel`; one work per non-empty tensor."""
        group, peer = self._peer(channel, True)
        return [dist.isend(t, peer, group=group) for t in tensors if t.numel()]

    def irecv(self, metas: Sequence[TensorMeta], channel: Channel) -> tuple[list[torch.Tensor], list[Any]]:
        """Post receives on `channel` into new buffers shaped like `metas`."""
        group, peer = self._peer(channel, False)
        bufs = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
        return bufs, [dist.irecv(b, peer, group=group) for b in bufs if b.numel()]

    def send_object(self, obj: Any, channel: Channel) -> tuple[list[Any], list[torch.Tensor]]:
        """Start sending a picklable `obj`; returns the works and the buffers to keep until they finish."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        bufs = [size, data]
        return self.isend(bufs, channel), bufs

    def recv_object(self, channel: Channel) -> tuple[Any, BaseException | None]:
        """Receive an object sent by `send_object` (blocks until it has arrived, or raises
        `TimeoutError` after the channels' timeout: on NCCL a dead peer would otherwise block the
        host until the watchdog ends the process). Returns it and a KeyboardInterrupt or SystemExit
        that came while it waited, held until both its parts arrived: raised between them, it left
        the bytes to the channel's next receive (gloo aborted the process on the size mismatch)."""
        group, peer = self._peer(channel, False)
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        held = self._wait_holding(dist.irecv(size, peer, group=group), channel)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        held = self._wait_holding(dist.irecv(data, peer, group=group), channel) or held
        return pickle.loads(bytes(data.cpu().tolist())), held

    def _wait_holding(self, work: Any, channel: Channel) -> BaseException | None:
        """`_wait` for `work` to the end; a KeyboardInterrupt or SystemExit meanwhile is returned."""
        held: BaseException | None = None
        while True:
            try:
                if self.backend == "nccl" or not work.is_completed():  # a gloo work waited for twice blocks for good
                    self._wait(work, channel)
                return held
            except (KeyboardInterrupt, SystemExit) as exc:
                held = held or exc

    def _wait(self, work: Any, channel: Channel) -> None:
        if self.backend != "nccl":
            work.wait()  # gloo: a closed connection raises, a hung peer times out
            return
        deadline = time.monotonic() + 0.9 * self.timeout.total_seconds()  # before the watchdog's abort

        def check() -> None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"channel {channel}: no message from pipeline rank {channel[0]} within "
                                   f"{self.timeout.total_seconds():g} s (dead or hung?)")

        poll(work, check)
        work.wait()

    def abort(self, wait_s: float = ABORT_WAIT_S) -> None:
        """Abort the channels' NCCL communicators (a dead peer: kernels waiting for it end). Best effort;
        the channels are unusable afterwards.

        NCCL's abort can itself block while a kernel still waits for the dead peer (seen with torch
        2.11: it did not return before NCCL's watchdog ended the process), and the caller is about to raise the error that says the
        pipeline is unusable: that must not wait. So the abort runs on a daemon thread and this returns
        when it finished or after `wait_s` seconds, whichever comes first."""
        if self.backend != "nccl":
            return
        groups = list(self._groups.values())

        def abort_all() -> None:
            for group in groups:
                try:
                    group.abort()
                except Exception:  # noqa: BLE001 - already aborted, or not supported by this torch
                    pass

        worker = threading.Thread(target=abort_all, name="zbpp-nccl-abort", daemon=True)
        worker.start()
        worker.join(wait_s)
