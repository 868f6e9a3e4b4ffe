"""The interpreter: run one rank's tasks of one step, in schedule order, for any schedule.

Tasks (docs/DESIGN.md):

- ``F(s, j)``: the stage's forward on microbatch ``j`` inside ``zbpp.modules.microbatch((s, j))``, with
  the random generators seeded for ``(s, j)`` (`zbpp.runtime.rng`); on the last stage also the loss,
  weighted by the microbatch's share of the batch (its rows / all rows, or ``loss_weight``'s
  w_j / W), so that the summed backward is that of the batch's loss.
- ``B(s, j)``: autograd backward of the stage's outputs for ``j``; the gradient of the stage's
  inputs goes to ``B(s-1, j)``. Delayed-wgrad modules only file their weight gradient. With
  ``split_wgrad`` B computes only what the inputs' gradient needs and keeps what W needs
  (`zbpp.runtime._autograd_split`); without, plain modules accumulate their weight gradients now.
- ``W(s, j)``: the rest of the stage's backward (``split_wgrad``), then ``backward_dw`` on every
  delayed-wgrad module of the stage (`zbpp.runtime.wgrad`).
- ``BW(s, j)``: B then W.

One step reads top to bottom (`StepExecutor.run`): for each task, issue the communication the plan
puts before it (`zbpp.schedules.plan`: sends of data already produced, receives of data needed
soon, each channel's in its order), then run the task, which waits only for its own inputs. Data
moves along the DAG: a message on each cross-rank edge, a hand-over in memory on each same-rank edge.

Shapes: on the first step of a new input signature (``new_signature``) each activation message is
preceded by its `Spec` (structure, shapes, dtypes, non-tensor values), received when its consumer needs it;
later steps post receives from the cached specs, and the sender checks its output against them (a
difference raises `ShapeMismatchError` naming the stage, the microbatch and both specs). Gradient
messages need no metadata: they have the shapes of the activations they answer.

Failures: an exception in a task (or in handing its data on) does not stop the step's
communication. The rank *drains*: it runs no more compute but still issues every remaining send
and receive of its plan, in order, with placeholders of the right shapes in place of the data it
could not produce (on a ``new_signature`` step, a `POISON` spec with no data: its receiver drains too), and
still signals the stages' last B and W so that data-parallel reductions are issued as on the other
replicas. Every peer therefore completes the step's communication, the communicators stay
consistent, and the agreement at the end of the step (`zbpp.runtime.pipeline`) tells every rank
that the step failed and where. `failure` holds the first exception; nothing is raised here.

Memory: an activation is released as soon as it is handed to its send (the output tensor keeps
only its autograd node, so B can still start from it: Megatron's trick); a sent buffer is dropped
when its send has completed; every per-microbatch object is dropped after its last use.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..modules.context import microbatch as microbatch_key
from ..schedules.ir import Action, Kind
from ..schedules.plan import RankPlan
from .comm_queue import POISON, CommQueue, Drained, Posted
from .errors import PipelineError, ShapeMismatchError
from .profiling import TaskRecorder
from .task_graphs import TaskGraphs
from ._autograd_split import SavedBoxes, backward_input, run_backward
from .tree import Spec, call, flatten, rebuild
from .wgrad import StageWgrad

__all__ = ["PipelineError", "ShapeMismatchError", "StepExecutor", "POISON"]




@dataclass
class _Slot:
    """What one (stage, microbatch) keeps between its F and its B."""

    inputs: list[torch.Tensor]  # the stage's input leaves that require grad (their .grad goes back)
    roots: list[torch.Tensor]  # where B starts: the outputs that require grad, or the weighted loss
    saved: SavedBoxes | None = None  # split B: what the forward saved, boxed (input-only ones go after B)


@dataclass
class StepExecutor(CommQueue):
    """Runs one step of one rank (see the module docstring). Built fresh for every step.

    Args:
        plan: this rank's plan (`zbpp.schedules.plan.RankPlan`; forward-only for evaluation).
        num_stages: stages of the schedule.
        modules: this rank's stage modules.
        wgrad: per stage, its `StageWgrad`.
        loss_fn: ``loss_fn(output, target) -> scalar``, mean over the microbatch.
        channels: the point-to-point channels (None when the pipeline has one rank).
        specs: the activation specs of this step's signature, ``(stage, microbatch) -> Spec``;
            filled here when `new_signature` (the signature's first step), read otherwise.
        new_signature: the specs are not known yet: send them ahead of each activation.
        inputs: per microbatch, the first stage's input (on the rank holding stage 0).
        targets: per microbatch, the target (on the rank holding the last stage; None entries allowed).
        weights: per microbatch, the factor of its loss in the step's loss: a number, or a 0-dim
            device tensor (``loss_weight``'s w_j / W; where it is 0 the microbatch adds nothing, even
            a NaN loss of a microbatch with nothing to count).
        loss_weights: per microbatch, the factor of its loss in the returned loss when it differs
            from `weights` (data-parallel token weights: `weights` then weigh by the global total).
        rng_of: ``(stage, microbatch) ->`` the context its F task runs in for its random draws
            (`zbpp.runtime.rng.seeded`), or None (the global generators as they run).
        in_flight: sends still in flight from earlier steps (CUDA), reaped as they complete.
        recorder: task timing, or None.
        on_backward_done, on_wgrad_done: called with the stage after its last B/BW and W/BW.
        free_sent_activations: release an activation's storage once it is handed to its send.
        forward_only: evaluation: F tasks under ``no_grad``, outputs (or losses) kept on the last stage.
        split_wgrad: B tasks compute only input gradients and W every weight gradient
            (`zbpp.runtime._autograd_split`); BW tasks run the whole backward either way.
        graphs: the CUDA graphs of this step's signature (`zbpp.runtime.task_graphs`): each
            compute task is captured on its first run and replayed after; None: eager.
    """

    plan: RankPlan
    num_stages: int
    modules: dict[int, nn.Module]
    wgrad: dict[int, StageWgrad]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    channels: Any
    specs: dict[tuple[int, int], Any]
    new_signature: bool
    inputs: list[Any] | None
    targets: list[Any] | None
    weights: list[Any]
    loss_weights: list[Any] | None = None
    rng_of: Callable[[int, int], Any] | None = None
    in_flight: list[tuple[list[Any], list[torch.Tensor]]] = field(default_factory=list)
    recorder: TaskRecorder | None = None
    on_backward_done: Callable[[int], None] | None = None
    on_wgrad_done: Callable[[int], None] | None = None
    free_sent_activations: bool = True
    forward_only: bool = False
    split_wgrad: bool = False
    graphs: TaskGraphs | None = None
    # -- results ------------------------------------------------------------------------------
    losses: list[torch.Tensor] = field(default_factory=list, init=False)  #: per microbatch, as loss_fn returned it
    outputs: dict[int, Any] = field(default_factory=dict, init=False)  #: forward_only: last stage's outputs
    failure: BaseException | None = field(default=None, init=False)  #: the first exception of this rank
    failed_task: Action | None = field(default=None, init=False)  #: where it happened (None: outside a task)
    failed_at: float = field(default=0.0, init=False)  #: when (time.time())
    upstream_failed: bool = field(default=False, init=False)  #: a peer's POISON made this rank drain
    comm_error: BaseException | None = field(default=None, init=False)  #: communication broke while draining
    current: Action | None = field(default=None, init=False)  #: the task running (named in errors)
    # -- per-step state -----------------------------------------------------------------------
    _outbox: dict[int, tuple[Any, list[torch.Tensor]]] = field(default_factory=dict, init=False, repr=False)
    _queues: dict[tuple[int, int], list[Posted]] = field(default_factory=dict, init=False, repr=False)
    _received: dict[int, Posted] = field(default_factory=dict, init=False, repr=False)
    _sending: list[tuple[list[Any], list[torch.Tensor], tuple[int, int]]] = field(default_factory=list, init=False, repr=False)
    _handed: dict[Action, tuple[Spec | None, list[torch.Tensor]]] = field(default_factory=dict, init=False, repr=False)
    _slots: dict[tuple[int, int], _Slot] = field(default_factory=dict, init=False, repr=False)
    _weighted: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)
    _dead: set[tuple[int, int]] = field(default_factory=set, init=False, repr=False)  # channels that broke

    def __post_init__(self) -> None:
        self._split_keys = {(t.stage, t.microbatch) for t in self.plan.tasks if t.kind is Kind.B} if self.split_wgrad else set()

    @property
    def draining(self) -> bool:
        return self.failure is not None or self.upstream_failed

    # -- the step -----------------------------------------------------------------------------
    def run(self) -> torch.Tensor | None:
        """Run every task of this rank; return the weighted loss sum on the last stage's rank (None
        elsewhere, or after a failure: see `failure`)."""
        if self.recorder is not None:
            self.recorder.begin_step()
        tasks = self.plan.tasks
        for i, task in enumerate(tasks):
            self._issue(i)
            self.current = task
            if not self.draining:
                try:
                    self._run_task(task)
                except Drained:
                    pass  # a peer failed upstream: nothing to report here
                except Exception as exc:  # noqa: BLE001 - the step drains; the agreement reports it
                    self._fail(exc, task)
            else:
                self._drain_task(task)
            self._signal(task)
            self._reap()
        self.current = None
        self._issue(len(tasks))
        self._complete_communication()
        if self.draining or not self._weighted:
            return None
        return torch.stack(self._weighted).sum()

    def _run_task(self, task: Action) -> None:
        if self.graphs is not None:
            if task.kind is Kind.F:
                self._forward_graphed(task)
            elif task.kind is Kind.W:
                started = self.recorder.start() if self.recorder is not None else None
                self.graphs.run(task, [], lambda _: self._wgrad_body(task))
                if self.recorder is not None:
                    self.recorder.stop(str(task), started)
            else:
                self._backward_graphed(task)
            return
        if task.kind is Kind.F:
            self._forward(task)
        elif task.kind is Kind.W:
            self._wgrad(task)
        else:
            self._backward(task)

    def _drain_task(self, task: Action) -> None:
        """Draining: no compute, but the task's receive still happens here (its shapes may be needed
        by a later send, and its sender is waiting)."""
        msg = self.plan.recv_of.get(task)
        if msg is None:
            return
        try:
            self._receive(msg)
        except Drained:
            pass

    def _fail(self, exc: BaseException, task: Action | None) -> None:
        if self.failure is None:
            self.failure, self.failed_task, self.failed_at = exc, task, time.time()
        self._slots.clear()  # nothing of the step will be computed: free its activations now
        self._handed.clear()

    # -- tasks --------------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        s, j = a.stage, a.microbatch
        last = s == self.num_stages - 1
        arg, grad_inputs = self._forward_input(a)
        started = self.recorder.start() if self.recorder is not None else None
        grad_mode = torch.no_grad() if self.forward_only else torch.enable_grad()
        rng = self.rng_of(s, j) if self.rng_of is not None else contextlib.nullcontext()
        saved = SavedBoxes() if grad_inputs and (s, j) in self._split_keys else contextlib.nullcontext()
        with microbatch_key((s, j)), grad_mode, rng, saved:
            out = call(self.modules[s], arg)
            if last:
                target = self.targets[j] if self.targets is not None else None
                if self.forward_only and self.loss_fn is None:
                    self.outputs[j] = out
                    roots: list[torch.Tensor] = []
                else:
                    loss = self._loss(out, target, s)
                    self.losses.append(loss.detach())
                    weighted = _weigh(loss, self.weights[j])
                    shown = weighted if self.loss_weights is None else _weigh(loss, self.loss_weights[j])
                    self._weighted.append(shown.detach())
                    roots = [weighted]
        del arg
        if self.recorder is not None:  # the task's compute only; handing the output on is communication
            self.recorder.stop(str(a), started)
        if not last:
            leaves, spec = flatten(out)
            del out
            if not leaves:
                raise TypeError(
                    f"stage {s} returned {spec} for microbatch {j}: a stage that feeds another must return a "
                    "tensor, or a tuple/list/dict holding at least one"
                )
            roots = [t for t in leaves if t.requires_grad]
            self._hand_forward(a, leaves, spec, roots)
        if not self.forward_only:
            self._slots[(s, j)] = _Slot(grad_inputs, roots, saved)

    def _loss(self, out: Any, target: Any, stage: int) -> torch.Tensor:
        assert self.loss_fn is not None
        loss = self.loss_fn(out, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"a tensor of shape {tuple(loss.shape)}"
            raise ValueError(
                f"loss_fn must return a scalar tensor (the microbatch mean), got {got} for the output of the last "
                f"stage {stage} ({flatten(out)[1]})"
            )
        return loss.reshape(())

    def _forward_input(self, a: Action) -> tuple[Any, list[torch.Tensor]]:
        s, j = a.stage, a.microbatch
        if s == 0:
            assert self.inputs is not None
            return self.inputs[j], []
        spec, leaves, received = self._stage_input(a)
        if received and not self.forward_only:
            for t, m in zip(leaves, spec.tensors):
                if m.requires_grad:
                    t.requires_grad_()
        return rebuild(spec, leaves), [t for t in leaves if t.requires_grad]

    def _stage_input(self, a: Action) -> tuple[Spec, list[torch.Tensor], bool]:
        """F(s, j)'s input leaves for s > 0, handed over on this rank or received (then True)."""
        msg = self.plan.recv_of.get(a)
        if msg is None:
            spec, leaves = self._handed.pop(self.plan.handed_from[a])
            return spec, leaves, False
        leaves = self._receive(msg)  # on a new signature, its spec arrives with it
        return self.specs[(msg.src.stage, msg.src.microbatch)], leaves, True

    def _hand_forward(self, a: Action, leaves: list[torch.Tensor], spec: Spec, roots: list[torch.Tensor]) -> None:
        s, j = a.stage, a.microbatch
        msg = self.plan.send_of.get(a)
        if msg is None:  # the next stage is on this rank: its inputs are fresh leaves
            self._handed[a] = (spec, [t.detach().requires_grad_(t.requires_grad and not self.forward_only)
                                      for t in leaves])
            return
        known = self.specs.get((s, j))
        if self.new_signature:
            self.specs[(s, j)] = spec
        elif known != spec:
            raise ShapeMismatchError(
                f"stage {s} microbatch {j}: the output is {spec}, but on the first step of this input "
                f"signature it was {known} and stage {msg.dst.stage} (rank {msg.dst_rank}) expects that. A stage's "
                "output structure, shapes, dtypes, requires_grad and non-tensor values must be determined "
                "by the step's input shapes (and the modules' train/requires_grad state)"
            )
        self._outbox[msg.index] = (spec if self.new_signature else None, [t.detach().contiguous() for t in leaves])
        if self.free_sent_activations and not self.forward_only:
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
            grads = list(self._handed.pop(self.plan.handed_from[a])[1] if msg is None else self._receive(msg))
        started = self.recorder.start() if self.recorder is not None else None
        if self.split_wgrad and a.kind is Kind.B:
            w = self.wgrad[s]
            w.filed((s, j), backward_input(slot.roots, grads, slot.inputs, w.b_hint, slot.saved))
            slot.saved = None
        else:
            run_backward(slot.roots, grads)
            self.wgrad[s].filed((s, j))
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
        if s > 0:  # hand the input gradient on before W (BW): the previous stage waits for it
            msg = self.plan.send_of.get(a)
            if msg is None:
                self._handed[a] = (None, in_grads)
            else:
                self._outbox[msg.index] = (None, [g.contiguous() for g in in_grads])
        if a.kind is Kind.BW:
            self.wgrad[s].run((s, j))
            if self.recorder is not None:
                self.recorder.stop(str(a), started)

    def _wgrad(self, a: Action) -> None:
        started = self.recorder.start() if self.recorder is not None else None
        self.wgrad[a.stage].run((a.stage, a.microbatch))
        if self.recorder is not None:
            self.recorder.stop(str(a), started)

    # -- tasks replayed from CUDA graphs (`zbpp.runtime.task_graphs`) ----------------------------
    def _forward_graphed(self, a: Action) -> None:
        """F as a graph: the inputs (and on the last stage the target and the loss factor) are the
        graph's static inputs; the outputs (or the loss) its static outputs."""
        assert self.graphs is not None
        s, j = a.stage, a.microbatch
        last = s == self.num_stages - 1
        if s == 0:
            assert self.inputs is not None
            leaves, spec = flatten(self.inputs[j])
            wants_grad = [False] * len(leaves)
        else:
            spec, leaves, _ = self._stage_input(a)
            wants_grad = [m.requires_grad for m in spec.tensors]
        n = len(leaves)
        target_leaves: list[torch.Tensor] = []
        factor = self.weights[j] if last else None
        if last:
            target_leaves, target_spec = flatten(self.targets[j] if self.targets is not None else None)
        extra = target_leaves + ([factor] if isinstance(factor, torch.Tensor) else [])

        def body(statics: list[torch.Tensor]) -> list[torch.Tensor]:
            xs = [t.detach().requires_grad_(g) for t, g in zip(statics[:n], wants_grad)]
            grad_inputs = [x for x in xs if x.requires_grad]
            saved = SavedBoxes() if grad_inputs and (s, j) in self._split_keys else contextlib.nullcontext()
            with microbatch_key((s, j)), torch.enable_grad(), saved:
                out = call(self.modules[s], rebuild(spec, xs))
                if last:
                    loss = self._loss(out, rebuild(target_spec, statics[n:n + len(target_leaves)]), s)
                    f = statics[-1] if isinstance(factor, torch.Tensor) else factor
                    roots, outs = [_weigh(loss, f)], [loss]
                else:
                    outs, self.graphs.meta[a] = flatten(out)
                    roots = [t for t in outs if t.requires_grad]
            self._slots[(s, j)] = _Slot(grad_inputs, roots, saved)
            return outs

        started = self.recorder.start() if self.recorder is not None else None
        # seeded around the capture and each replay: a graph's draws start from the generator's
        # state at its replay, so they are the eager task's
        with self.rng_of(s, j) if self.rng_of is not None else contextlib.nullcontext():
            outs = self.graphs.run(a, leaves + extra, body)
        if self.recorder is not None:
            self.recorder.stop(str(a), started)
        if last:
            loss = outs[0]
            self.losses.append(loss.clone())
            shown = _weigh(loss, self.weights[j] if self.loss_weights is None else self.loss_weights[j])
            self._weighted.append(shown.detach())
            return
        out_spec = self.graphs.meta[a]
        if not outs:
            raise TypeError(f"stage {s} returned {out_spec} for microbatch {j}: a stage that feeds another must "
                            "return a tensor, or a tuple/list/dict holding at least one")
        self._hand_forward(a, outs, out_spec, [])

    def _backward_graphed(self, a: Action) -> None:
        """B or BW as a graph: the output gradients in, the input gradients out (BW: and the W)."""
        assert self.graphs is not None
        s, j = a.stage, a.microbatch
        grads: list[torch.Tensor] = []
        if s < self.num_stages - 1:
            msg = self.plan.recv_of.get(a)
            grads = list(self._handed.pop(self.plan.handed_from[a])[1] if msg is None else self._receive(msg))

        def body(statics: list[torch.Tensor]) -> list[torch.Tensor]:
            slot = self._slots.pop((s, j))
            gs: list[torch.Tensor | None] = list(statics) if statics else [None] * len(slot.roots)
            if self.split_wgrad and a.kind is Kind.B:
                w = self.wgrad[s]
                w.filed((s, j), backward_input(slot.roots, gs, slot.inputs, w.b_hint, slot.saved))
            else:
                run_backward(slot.roots, gs)
                self.wgrad[s].filed((s, j))
            in_grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in slot.inputs]
            for x in slot.inputs:
                x.grad = None
            if a.kind is Kind.BW:
                self.wgrad[s].run((s, j))
            return in_grads

        started = self.recorder.start() if self.recorder is not None else None
        in_grads = self.graphs.run(a, grads, body)
        if self.recorder is not None:
            self.recorder.stop(str(a), started)
        if s > 0:
            msg = self.plan.send_of.get(a)
            if msg is None:
                self._handed[a] = (None, list(in_grads))
            else:
                self._outbox[msg.index] = (None, list(in_grads))

    def _wgrad_body(self, a: Action) -> list[torch.Tensor]:
        self.wgrad[a.stage].run((a.stage, a.microbatch))
        return []

    def _signal(self, a: Action) -> None:
        """The stage's last B / W ran (or, draining, would have): data-parallel reductions start."""
        try:
            if a.kind in (Kind.B, Kind.BW) and self.plan.last_backward.get(a.stage) == a and self.on_backward_done:
                self.on_backward_done(a.stage)
            if a.kind in (Kind.W, Kind.BW) and self.plan.last_wgrad.get(a.stage) == a and self.on_wgrad_done:
                self.on_wgrad_done(a.stage)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, a)


def _weigh(loss: torch.Tensor, factor: Any) -> torch.Tensor:
    """``loss * factor``; a tensor factor of 0 gives 0 (and a zero gradient), whatever the loss."""
    if not isinstance(factor, torch.Tensor):
        return loss * factor
    return torch.where(factor != 0, loss * factor.to(loss.dtype), torch.zeros((), dtype=loss.dtype, device=loss.device))
