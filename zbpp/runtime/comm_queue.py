"""The communication queue of one rank's step: the program's sends and receives, in order.

`CommQueue` is built for each step from this rank's `RankProgram`, the channels, the shapes of the
step's input signature (``specs``, still being learnt when ``new_signature``), the sends still in
flight from earlier steps and the step's `StepFailure` record, which it writes when communication
breaks and reads to know whether the rank drains.

Before each task the executor calls `issue`: sends of data already produced (handed in with `put`)
go out, receives join their channel's queue and are posted, in the channel's order, as soon as
their shapes are known. A task takes its input with `receive`. A draining rank sends placeholders
(`_placeholder`), so its peers complete the step's communication; `complete` ends the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..schedules.program import Message, RankProgram
from .errors import PipelineError, ShapeMismatchError
from .failure import StepFailure
from .tree import Spec, TensorMeta

__all__ = ["CommQueue", "Drained", "POISON", "Posted", "used_key"]


class _Poison:
    """Sent in place of a `Spec` by a draining rank: the activation does not exist, no data follows."""

    def __reduce__(self) -> str:
        return "POISON"  # unpickles to the module-level singleton

    def __repr__(self) -> str:
        return "POISON"


POISON = _Poison()


def used_key(stage: int, microbatch: int) -> tuple[int, int, str]:
    """The key in a signature's specs of which outputs of (`stage`, `microbatch`) needing a gradient
    the next stage used: a tuple of bools, sent in-band with the gradient on a new signature."""
    return (stage, microbatch, "used")


class Drained(Exception):
    """A consumer's input was POISON: the rank drains (raised inside a task, never out of `run`)."""


@dataclass
class Posted:
    """A receive: posted (buffers and works) or still waiting in its channel's queue."""

    message: Message
    bufs: list[torch.Tensor] | None = None
    works: list[Any] = field(default_factory=list)
    poisoned: bool = False


class CommQueue:
    """The sends and receives of one rank's step (see the module docstring).

    Args:
        program: this rank's program: at which task boundary each operation is issued.
        channels: the point-to-point channels (None when the pipeline has one rank).
        specs: the activation specs of this step's signature, ``(stage, microbatch) -> Spec``;
            filled here when `new_signature` (received in-band), read otherwise.
        new_signature: each activation message is preceded by its spec.
        in_flight: sends still in flight from earlier steps (CUDA), reaped as they complete; this
            step's join them at its end.
        failure: the step's failure record.
    """

    def __init__(self, program: RankProgram, channels: Any, specs: dict[tuple[int, int], Any], new_signature: bool,
                 in_flight: list[tuple[list[Any], list[torch.Tensor]]], failure: StepFailure) -> None:
        self.program, self.channels, self.specs, self.new_signature = program, channels, specs, new_signature
        self.in_flight, self.failure = in_flight, failure
        self._outbox: dict[int, tuple[Any, list[torch.Tensor]]] = {}  # produced, not yet sent
        self._queues: dict[tuple[int, int], list[Posted]] = {}  # receives due, per channel, in order
        self._received: dict[int, Posted] = {}  # posted receives, by message index
        self._sending: list[tuple[list[Any], list[torch.Tensor], tuple[int, int]]] = []
        self._dead: set[tuple[int, int]] = set()  # channels that broke

    def put(self, msg: Message, spec: Spec | None, tensors: list[torch.Tensor]) -> None:
        """The data of `msg` (and its spec on a new signature), sent when the program issues it."""
        self._outbox[msg.index] = (spec, tensors)

    def issue(self, boundary: int) -> None:
        """Issue the program's operations at `boundary`; never raises (a failure makes the rank drain)."""
        for op in self.program.issue[boundary]:
            if op.send:
                if op.message.channel not in self._dead:
                    try:
                        self._send(op.message)
                    except Exception as exc:  # noqa: BLE001
                        self._comm_failed(exc, op.message.channel)
                    except (KeyboardInterrupt, SystemExit) as exc:  # the rank drains; the other sends still go
                        self.failure.fail(exc, self.failure.current)
            else:
                self._queues.setdefault(op.message.channel, []).append(Posted(op.message))
        self._post_known_receives()

    def _comm_failed(self, exc: BaseException, channel: tuple[int, int] | None = None) -> None:
        """A send or receive raised: a ShapeMismatchError of this rank's output (the rank drains), or
        the channel broke (a dead peer: nothing more goes on it, and the pipeline is unusable)."""
        f = self.failure
        if isinstance(exc, ShapeMismatchError) or (channel is None and not f.draining):
            f.fail(exc, f.current)
            return
        if channel is not None:
            self._dead.add(channel)
        f.comm_error = f.comm_error or exc
        f.fail(exc, f.current)

    def _send(self, msg: Message) -> None:
        spec, tensors = self._outbox.pop(msg.index, (None, None))
        if tensors is None:  # draining: this rank did not produce it
            spec, tensors = self._placeholder(msg)
        works: list[Any] = []
        keep = list(tensors)
        if self.new_signature and not msg.is_gradient:
            if spec is POISON:  # its gradient message will be empty, on both ends
                self.specs[(msg.src.stage, msg.src.microbatch)] = POISON
            w, bufs = self.channels.send_object(spec, msg.channel)
            works += w
            keep += bufs
        elif self.new_signature and self.specs.get((msg.dst.stage, msg.src.microbatch)) is not POISON:
            # a gradient: which of the activation's outputs its consumer used (`used_key`)
            w, bufs = self.channels.send_object(spec, msg.channel)
            works += w
            keep += bufs
        if spec is not POISON:
            works += self.channels.isend(tensors, msg.channel)
        if works:
            self._sending.append((works, keep, msg.channel))

    def _placeholder(self, msg: Message) -> tuple[Any, list[torch.Tensor]]:
        """What a draining rank sends for a message it could not produce: tensors of the right
        shapes (their values are never used), or POISON when the shapes are unknown."""
        metas = self._metas(msg, sending=True)
        if metas is None:
            return POISON, []
        # a gradient's placeholder says every output was used: its zeros then flow back harmlessly
        spec = self.specs.get((msg.src.stage, msg.src.microbatch)) if not msg.is_gradient else (True,) * len(metas)
        # Zeros, not garbage: a peer that computes on them before it learns of the failure should
        # not fail too (an index out of range, say) and blur which rank failed first.
        return spec, [torch.zeros(m.shape, dtype=m.dtype, device=self.channels.device) for m in metas]

    def _metas(self, msg: Message, sending: bool = False) -> list[TensorMeta] | None:
        """The tensors of `msg`, or None while unknown (its spec is still to come in-band; a
        gradient's receiver waits for its usage too, on a new signature: `used_key`)."""
        j = msg.src.microbatch
        if msg.is_gradient:  # answers the activation of (dst stage, j), which both ends have seen
            spec = self.specs.get((msg.dst.stage, j))
            if spec is None or spec is POISON:  # unknown yet / the activation never existed
                return None if spec is None else []
            if self.new_signature and not sending and used_key(msg.dst.stage, j) not in self.specs:
                return None
            return [TensorMeta(m.shape, m.dtype, False) for m in spec.tensors if m.requires_grad]
        spec = self.specs.get((msg.src.stage, j))
        if spec is None or spec is POISON:
            return None
        return list(spec.tensors)

    def _post_known_receives(self) -> None:
        """Post each channel's due receives from its front, as long as their shapes are known."""
        for channel, queue in self._queues.items():
            while queue and channel not in self._dead:
                item = queue[0]
                metas = self._metas(item.message)
                if metas is None:
                    break
                try:
                    self._post(item, metas)
                except Exception as exc:  # noqa: BLE001
                    self._comm_failed(exc, channel)
                    break
                queue.pop(0)

    def _post(self, item: Posted, metas: list[TensorMeta]) -> None:
        item.bufs, item.works = self.channels.irecv(metas, item.message.channel)
        self._received[item.message.index] = item

    def receive(self, msg: Message) -> list[torch.Tensor]:
        """The tensors of `msg`, once arrived (on CUDA: the compute stream waits for them). Receives
        the spec first when it comes in-band (a new signature's step), which blocks until it has arrived."""
        item = self._received.pop(msg.index, None)
        if item is None:
            queue = self._queues[msg.channel]
            item = queue.pop(0)
            assert item.message.index == msg.index, "channel order broken (a bug in the program)"
            if msg.channel in self._dead:
                raise Drained()
            if not self.new_signature:  # pragma: no cover - its shapes are known: posted already
                raise PipelineError(f"rank {self.program.rank}: the receive of {msg} was never posted (a bug)")
            try:
                spec, interrupted = self.channels.recv_object(msg.channel)
            except Exception as exc:  # noqa: BLE001
                self._comm_failed(exc, msg.channel)
                raise Drained() from exc
            if msg.is_gradient and spec is POISON:  # a draining consumer that never saw the activation
                self.failure.upstream = True
                item.bufs, item.poisoned = [], True
            elif msg.is_gradient:  # which outputs the consumer used; the shapes are the activation's
                self.specs[used_key(msg.dst.stage, msg.src.microbatch)] = spec
                metas = self._metas(msg)
                assert metas is not None
                self._post(item, metas)
                self._received.pop(msg.index)
            else:
                self.specs[(msg.src.stage, msg.src.microbatch)] = spec
                if spec is POISON:
                    self.failure.upstream = True
                    item.bufs, item.poisoned = [], True
                else:
                    self._post(item, list(spec.tensors))
                    self._received.pop(msg.index)
            if interrupted is not None:  # the spec is known and its tensors posted: `complete` receives them
                if not item.poisoned:
                    self._received[msg.index] = item
                raise interrupted
        try:
            for w in item.works:
                w.wait()
        except Exception as exc:  # noqa: BLE001
            self._comm_failed(exc, msg.channel)
            raise Drained() from exc
        except (KeyboardInterrupt, SystemExit):
            self._received[msg.index] = item  # posted: `complete` still waits for it
            raise
        if item.poisoned:
            raise Drained()
        assert item.bufs is not None
        return item.bufs

    def reap(self) -> None:
        """Drop the buffers of completed sends (CUDA: an event query, never a wait)."""
        self.in_flight[:] = [(w, k) for w, k in self.in_flight if not all(x.is_completed() for x in w)]
        if self._sending:
            self._sending = [(w, k, c) for w, k, c in self._sending if not all(x.is_completed() for x in w)]

    def complete(self) -> None:
        """End of the step: every receive consumed (draining: waited for and dropped), every send
        handed over (gloo: waited for; CUDA: kept in `in_flight` until it completes, so the compute
        stream never waits for a peer). Called again after an interrupt, it goes on where it stopped."""
        for queue in self._queues.values():  # draining: receives never consumed
            while queue:
                try:
                    self.receive(queue[0].message)
                except Drained:
                    pass
        cuda = self.channels is not None and self.channels.device.type == "cuda"
        for item in self._received.values():
            try:
                if cuda:  # the compute stream waits for it
                    for w in item.works:
                        w.wait()
                else:
                    _wait_once(item.works)
            except Exception as exc:  # noqa: BLE001
                self._comm_failed(exc, item.message.channel)
        self._received.clear()
        if cuda:
            self.in_flight.extend((w, k) for w, k, _ in self._sending)
        else:
            for works, _, channel in self._sending:
                try:
                    _wait_once(works)
                except Exception as exc:  # noqa: BLE001 - a send to a dead peer
                    self._comm_failed(exc, channel)
        self._sending.clear()
        self._outbox.clear()


def _wait_once(works: list[Any]) -> None:
    """Wait for each of the gloo `works` that was not waited for yet: a gloo work says it completed
    only once waited for, and waiting for it again blocks for good (`CommQueue.complete` may run
    twice). Not for NCCL works: one that completed on the GPU would not order the streams."""
    for w in works:
        if not w.is_completed():
            w.wait()
