"""The interpreter: run one rank's tasks of one step, in schedule order, for any schedule.

Tasks (DESIGN.md):

- ``F(s, j)``: the stage's forward on microbatch ``j`` inside ``zbpp.modules.microbatch((s, j))``; on the
  last stage also the loss, weighted by the microbatch's share of the batch (its rows / all rows),
  so that the summed backward is that of the batch-mean loss.
- ``B(s, j)``: autograd backward of the stage's outputs for ``j`` (delayed-wgrad modules only file
  their weight gradient; plain modules accumulate theirs now); the gradient of the stage's inputs
  goes to ``B(s-1, j)``.
- ``W(s, j)``: ``backward_dw`` on every delayed-wgrad module of the stage (see `zbpp.runtime.wgrad`).
- ``BW(s, j)``: B then W.

Data moves along the DAG: a message on each cross-rank edge, a hand-over in memory on each
same-rank edge. Communication follows the rank's `RankPlan.ops` strictly in order (see
`zbpp.runtime.plan` for why that is deadlock-free on NCCL): after every task the executor issues
every operation it can from the front of that list: a receive as soon as its buffer shape is known
(so receives are posted ahead and overlap compute), a send as soon as its producing task has run.
A task waits only for its own inputs.

Shapes: on the first step of a new input signature each activation message is preceded by its
`Spec` (structure, shapes, dtypes, non-tensor values); the receiver blocks on it only when the
order requires (never ahead of time, which could deadlock). Later steps of the same signature post
receives from the cached specs, and the sender checks its output against them: a difference raises
`ShapeMismatchError` naming the stage, the microbatch and both specs. Gradient messages need no
metadata: they have the shapes of the activations they answer.

Memory: an activation is released as soon as it is sent (the output tensor keeps only its autograd
node, so B can still start from it: Megatron's trick); a sent buffer is dropped when its send has
completed; every per-microbatch object is dropped after its last use, and nothing outlives the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..modules.context import microbatch as microbatch_key
from ..schedules.ir import Action, Kind
from .plan import CommOp, Message, RankPlan
from .profiling import TaskRecorder
from .tree import Spec, TensorMeta, call, flatten, rebuild
from .wgrad import run_wgrad

__all__ = ["PipelineError", "ShapeMismatchError", "StepExecutor"]


class PipelineError(RuntimeError):
    """A pipeline step failed; the message names the rank and the task, the cause is chained."""


class ShapeMismatchError(PipelineError):
    """A stage's output differs from what the receiving rank was told for this input signature."""


try:  # the autograd engine entry point that takes gradients of a shape other than the tensor's
    from torch.autograd.graph import _engine_run_backward as _engine_backward  # torch >= 2.3
except ImportError:  # pragma: no cover - older torch
    from torch.autograd import Variable

    def _engine_backward(*args: Any, **kwargs: Any) -> Any:
        return Variable._execution_engine.run_backward(*args, **kwargs)


def run_backward(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Backpropagate ``grads`` from ``roots`` (accumulating into leaves' ``.grad``).

    Calls the engine directly because a sent activation's storage may have been released (its
    ``.data`` shrunk): the engine checks gradients against the autograd node's recorded input shape,
    not against the tensor's current data.
    """
    pairs = [(t, g) for t, g in zip(roots, grads) if t.requires_grad]
    if not pairs:
        return
    ts = tuple(t for t, _ in pairs)
    gs = tuple(torch.ones_like(t) if g is None else g for t, g in pairs)
    _engine_backward(ts, gs, False, False, (), allow_unreachable=True, accumulate_grad=True)


@dataclass
class _Slot:
    """What one (stage, microbatch) keeps between its F and its B."""

    inputs: list[torch.Tensor]  # the stage's input leaves that require grad (their .grad goes back)
    roots: list[torch.Tensor]  # where B starts: the outputs that require grad, or the weighted loss


@dataclass
class StepExecutor:
    """Runs one step of one rank (see the module docstring). Built fresh for every step.

    Args:
        plan: this rank's plan.
        num_stages: stages of the schedule.
        modules: this rank's stage modules.
        delayed, keyed: per stage, its delayed-wgrad modules and whether each takes a microbatch key.
        loss_fn: ``loss_fn(output, target) -> scalar``, mean over the microbatch.
        transport: the point-to-point transport (None when the pipeline has one rank).
        specs: the activation specs of this step's signature, ``(stage, microbatch) -> Spec``;
            filled here when `sync` (the signature's first step), read otherwise.
        sync: the specs are not known yet: send them ahead of each activation.
        inputs: per microbatch, the first stage's input (on the rank holding stage 0).
        targets: per microbatch, the target (on the rank holding the last stage; None entries allowed).
        weights: per microbatch, its share of the batch.
        recorder: task timing, or None.
        on_backward_done, on_wgrad_done: called with the stage after its last B/BW and W/BW.
        free_sent_activations: release an activation's storage once it is sent.
    """

    plan: RankPlan
    num_stages: int
    modules: dict[int, nn.Module]
    delayed: dict[int, list[nn.Module]]
    keyed: dict[int, list[bool]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    transport: Any
    specs: dict[tuple[int, int], Spec]
    sync: bool
    inputs: list[Any] | None
    targets: list[Any] | None
    weights: list[float]
    recorder: TaskRecorder | None = None
    on_backward_done: Callable[[int], None] | None = None
    on_wgrad_done: Callable[[int], None] | None = None
    free_sent_activations: bool = True
    # -- per-step state (not arguments) ----------------------------------------------------------
    _head: int = field(default=0, init=False, repr=False)  # next position in plan.ops to issue
    _ready: dict[int, tuple[Spec | None, list[torch.Tensor]]] = field(default_factory=dict, init=False, repr=False)
    _inbox: dict[int, tuple[list[torch.Tensor], list[Any]]] = field(default_factory=dict, init=False, repr=False)
    _sending: list[tuple[list[Any], list[torch.Tensor]]] = field(default_factory=list, init=False, repr=False)
    _local_fwd: dict[tuple[int, int], tuple[Spec, list[torch.Tensor]]] = field(default_factory=dict, init=False, repr=False)
    _local_bwd: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict, init=False, repr=False)
    _slots: dict[tuple[int, int], _Slot] = field(default_factory=dict, init=False, repr=False)
    _losses: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)
    current: Action | None = field(default=None, init=False)  #: the task running (named in errors)

    # -- the step -----------------------------------------------------------------------------
    def run(self) -> torch.Tensor | None:
        """Run every task of this rank; return the weighted loss sum on the last stage's rank."""
        if self.recorder is not None:
            self.recorder.begin_step()
        self._advance()
        for action in self.plan.tasks:
            self.current = action
            if action.kind is Kind.F:
                self._forward(action)
            else:
                if action.kind in (Kind.B, Kind.BW):
                    self._backward(action)
                else:
                    self._wgrad(action)
                self._signal(action)
            self._reap()
        self.current = None
        if self._head != len(self.plan.ops):  # pragma: no cover - a bug in the plan
            raise PipelineError(f"rank {self.plan.rank}: {len(self.plan.ops) - self._head} operations never issued")
        for works, _ in self._sending:
            for w in works:
                w.wait()
        self._sending.clear()
        leftovers = [n for n, v in (("activations", self._slots), ("receives", self._inbox),
                                    ("forward hand-overs", self._local_fwd),
                                    ("backward hand-overs", self._local_bwd), ("sends", self._ready)) if v]
        if leftovers:  # pragma: no cover - a bug in the plan
            raise PipelineError(f"rank {self.plan.rank}: step ended with {', '.join(leftovers)} left over")
        if not self._losses:
            return None
        total = torch.stack(self._losses).sum()
        self._losses.clear()
        return total

    # -- tasks --------------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        s, j = a.stage, a.microbatch
        last = s == self.num_stages - 1
        arg, grad_inputs = self._forward_input(a)
        started = self.recorder.start() if self.recorder is not None else None
        with microbatch_key((s, j)), torch.enable_grad():
            out = call(self.modules[s], arg)
            if last:
                target = self.targets[j] if self.targets is not None else None
                loss = self.loss_fn(out, target)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    got = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"a tensor of shape {tuple(loss.shape)}"
                    raise ValueError(f"loss_fn must return a scalar tensor (the microbatch mean), got {got}")
                weighted = loss.reshape(()) * self.weights[j]
                self._losses.append(weighted.detach())
                roots = [weighted]
        del arg
        if self.recorder is not None:  # the task's compute only; handing the output on is communication
            self.recorder.stop(str(a), started)
        if not last:
            leaves, spec = flatten(out)
            del out
            roots = [t for t in leaves if t.requires_grad]
            self._hand_forward(a, leaves, spec, roots)
        self._slots[(s, j)] = _Slot(grad_inputs, roots)

    def _forward_input(self, a: Action) -> tuple[Any, list[torch.Tensor]]:
        s, j = a.stage, a.microbatch
        if s == 0:
            assert self.inputs is not None
            return self.inputs[j], []
        msg = self.plan.recv_of.get(a)
        if msg is None:
            spec, leaves = self._local_fwd.pop((s, j))
        else:
            leaves = self._receive(msg)
            spec = self.specs[(s - 1, j)]
            for t, m in zip(leaves, spec.tensors):
                if m.requires_grad:
                    t.requires_grad_()
        return rebuild(spec, leaves), [t for t in leaves if t.requires_grad]

    def _hand_forward(self, a: Action, leaves: list[torch.Tensor], spec: Spec, roots: list[torch.Tensor]) -> None:
        s, j = a.stage, a.microbatch
        msg = self.plan.send_of.get(a)
        if msg is None:  # the next stage is on this rank: its inputs are fresh leaves
            self._local_fwd[(s + 1, j)] = (spec, [t.detach().requires_grad_(t.requires_grad) for t in leaves])
            return
        known = self.specs.get((s, j))
        if self.sync:
            self.specs[(s, j)] = spec
        elif known != spec:
            raise ShapeMismatchError(
                f"stage {s} microbatch {j}: the output is {spec}, but on the first step of this input "
                f"signature it was {known} and stage {s + 1} (rank {msg.dst_rank}) expects that. A stage's "
                "output structure, shapes, dtypes, requires_grad and non-tensor values must be determined "
                "by the step's input shapes (and the modules' train/requires_grad state)"
            )
        payload = [t.detach().contiguous() for t in leaves]
        self._ready[msg.index] = (spec if self.sync else None, payload)
        self._advance(upto=self.plan.op_of[msg.index])
        if self.free_sent_activations:
            for t in roots:
                # Keep only the autograd node: what backward saved is held by the graph itself; the
                # storage goes once the send completes. Views and leaves share memory with others.
                if t.grad_fn is not None and t._base is None:
                    t.data = torch.empty((1,), dtype=t.dtype, device=t.device)

    def _backward(self, a: Action) -> None:
        s, j = a.stage, a.microbatch
        slot = self._slots.pop((s, j))
        if s == self.num_stages - 1:
            grads: list[torch.Tensor | None] = [None] * len(slot.roots)
        else:
            msg = self.plan.recv_of.get(a)
            grads = list(self._local_bwd.pop((s, j)) if msg is None else self._receive(msg))
        started = self.recorder.start() if self.recorder is not None else None
        run_backward(slot.roots, grads)
        del grads
        slot.roots.clear()
        in_grads = []
        for x in slot.inputs:
            g = x.grad
            in_grads.append(torch.zeros_like(x) if g is None else g)
            x.grad = None
        slot.inputs.clear()
        if self.recorder is not None and a.kind is Kind.B:
            self.recorder.stop(str(a), started)
        if s > 0:  # send the input gradient before W (BW): the previous stage waits for it
            msg = self.plan.send_of.get(a)
            if msg is None:
                self._local_bwd[(s - 1, j)] = in_grads
            else:
                self._ready[msg.index] = (None, [g.contiguous() for g in in_grads])
                del in_grads
                self._advance(upto=self.plan.op_of[msg.index])
        if a.kind is Kind.BW:
            run_wgrad(self.delayed[s], self.keyed[s], (s, j))
            if self.recorder is not None:
                self.recorder.stop(str(a), started)

    def _wgrad(self, a: Action) -> None:
        started = self.recorder.start() if self.recorder is not None else None
        run_wgrad(self.delayed[a.stage], self.keyed[a.stage], (a.stage, a.microbatch))
        if self.recorder is not None:
            self.recorder.stop(str(a), started)

    def _signal(self, a: Action) -> None:
        if a.kind in (Kind.B, Kind.BW) and self.plan.last_backward.get(a.stage) == a and self.on_backward_done:
            self.on_backward_done(a.stage)
        if a.kind in (Kind.W, Kind.BW) and self.plan.last_wgrad.get(a.stage) == a and self.on_wgrad_done:
            self.on_wgrad_done(a.stage)

    # -- communication ------------------------------------------------------------------------
    def _metas(self, msg: Message) -> list[TensorMeta] | None:
        """The tensors of `msg`, or None while its spec is still to come in-band."""
        j = msg.src.microbatch
        if msg.is_gradient:  # answers the activation of (dst stage, j), whose spec this rank sent
            spec = self.specs[(msg.dst.stage, j)]
            return [TensorMeta(m.shape, m.dtype, False) for m in spec.tensors if m.requires_grad]
        spec = self.specs.get((msg.src.stage, j))
        return None if spec is None else list(spec.tensors)

    def _advance(self, upto: int = -1) -> None:
        """Issue operations from the front of the plan's order while possible; those at positions
        <= `upto` must be issued now (receiving an in-band spec, which blocks, if needed)."""
        ops = self.plan.ops
        while self._head < len(ops):
            op: CommOp = ops[self._head]
            msg = op.message
            if op.send:
                ready = self._ready.pop(msg.index, None)
                if ready is None:
                    if self._head <= upto:  # pragma: no cover - the plan guarantees it
                        raise PipelineError(f"rank {self.plan.rank}: {op} is due but its task has not run")
                    return
                spec, tensors = ready
                works: list[Any] = []
                keep: list[torch.Tensor] = list(tensors)
                if spec is not None:
                    w, bufs = self.transport.send_object(spec, op.peer)
                    works += w
                    keep += bufs
                works += self.transport.isend(tensors, op.peer)
                if works:
                    self._sending.append((works, keep))
            else:
                metas = self._metas(msg)
                if metas is None:
                    if self._head > upto:
                        return  # its spec comes in-band: receive it only when the order requires
                    spec = self.transport.recv_object(op.peer)
                    self.specs[(msg.src.stage, msg.src.microbatch)] = spec
                    metas = list(spec.tensors)
                self._inbox[msg.index] = self.transport.irecv(metas, op.peer) if metas else ([], [])
            self._head += 1

    def _receive(self, msg: Message) -> list[torch.Tensor]:
        """The tensors of `msg`, once arrived (on CUDA: the compute stream waits for them)."""
        self._advance(upto=self.plan.op_of[msg.index])
        bufs, works = self._inbox.pop(msg.index)
        for w in works:
            w.wait()
        return bufs

    def _reap(self) -> None:
        """Drop the buffers of completed sends."""
        if not self._sending:
            return
        still = []
        for works, keep in self._sending:
            if all(w.is_completed() for w in works):
                for w in works:
                    w.wait()
            else:
                still.append((works, keep))
        self._sending = still

    def abandon(self) -> None:
        """Forget everything of a failed step (pending operations are not waited for)."""
        self._slots.clear()
        self._inbox.clear()
        self._ready.clear()
        self._local_fwd.clear()
        self._local_bwd.clear()
        self._sending.clear()
        self._losses.clear()
