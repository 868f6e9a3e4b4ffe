"""The interpreter: run one rank's tasks of one step, in schedule order, for any schedule.

Tasks (docs/DESIGN.md):

- ``F(s, j)``: the stage's forward on microbatch ``j`` inside ``zbpp.modules.microbatch((s, j))``
  (and ``zbpp.modules.context.next_backward`` when the rank's next task is a backward), with
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

One step reads top to bottom (`StepExecutor.run`): for each task, issue the communication the program
puts before it (`zbpp.runtime.comm_queue`: sends of data already produced, receives of data needed
soon, each channel's in its order), then run the task, which waits only for its own inputs. Data
moves along the DAG: a message on each cross-rank edge, a hand-over in memory on each same-rank edge.

Each task is written once, as a body from its input tensors to its output tensors; the step's
runner (`zbpp.runtime.task_graphs`) runs the bodies: eagerly, or captured into CUDA graphs and
replayed. What a task reads comes in as arguments: the step's `StepInputs`, its `CommQueue`, its
runner; what it produces goes to the `StepResults`, the queue, or the next task on this rank.

Shapes: on the first step of a new input signature (``new_signature``) each activation message is
preceded by its `Spec` (structure, shapes, dtypes, non-tensor values), received when its consumer needs it;
later steps post receives from the cached specs, and the sender checks its output against them (a
difference raises `ShapeMismatchError` naming the stage, the microbatch and both specs). Gradient
messages have the shapes of the activations they answer; on a new signature each is preceded by
which of them its stage used (`_usage`), and the stage before leaves the unused ones out of its B.

Failures: an exception in a task (or in handing its data on) does not stop the step's
communication. The rank *drains*: it runs no more compute but still issues every remaining send
and receive of its program, in order, with placeholders of the right shapes in place of the data it
could not produce (on a ``new_signature`` step, a `POISON` spec with no data: its receiver drains too), and
still signals the stages' last B and W so that data-parallel reductions are issued as on the other
replicas. Every peer therefore completes the step's communication, the communicators stay
consistent, and the agreement at the end of the step (`zbpp.runtime.pipeline`) tells every rank
that the step failed and where. The step's `StepFailure` holds the first exception; nothing is
raised here. A KeyboardInterrupt or SystemExit drains too, in a task or outside one (issuing or
waiting for communication, a stage's boundary signal), and `Pipeline` re-raises it on its rank after
the agreement, so a peer never waits for the group's timeout.

Memory: an activation is released as soon as it is handed to its send (the output tensor keeps
only its autograd node, so B can still start from it: Megatron's trick); a sent buffer is dropped
when its send has completed; every per-microbatch object is dropped after its last use.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import nn

from .._compat import held_elsewhere
from ..modules.context import next_backward
from ..modules.context import microbatch as microbatch_key
from ..schedules.ir import Action, Kind
from ..schedules.program import RankProgram
from ._autograd_split import SavedBoxes
from .comm_queue import POISON, CommQueue, Drained, used_key
from .errors import PipelineError, ShapeMismatchError, describe_error
from .failure import StepFailure
from .task_times import TaskRecorder
from .task_graphs import EAGER, TaskRunner
from .tree import Spec, call, flatten, hidden_tensor_value, rebuild
from .wgrad import StageWgrad

__all__ = ["PipelineError", "ShapeMismatchError", "StepExecutor", "StepInputs", "StepResults", "StageBoundaries",
           "POISON"]


@dataclass(frozen=True)
class StepInputs:
    """What one step computes on, per microbatch (built by `zbpp.runtime.pipeline.Pipeline`).

    Args:
        inputs: the first stage's input (on the rank holding stage 0, else None).
        targets: the target (on the rank holding the last stage; None entries allowed).
        weights: the factor of its loss in the step's loss: a number, or a 0-dim device tensor
            (``loss_weight``'s w_j / W; where it is 0 the microbatch adds nothing, even a NaN loss of
            a microbatch with nothing to count).
        loss_weights: the factor of its loss in the returned loss when it differs from `weights`
            (data-parallel token weights: `weights` then weigh by the global total).
        rng_of: ``(stage, microbatch) ->`` the context its F task runs in for its random draws
            (`zbpp.runtime.rng.seeded`), or None (the global generators as they run).
    """

    inputs: list[Any] | None
    targets: list[Any] | None
    weights: list[Any]
    loss_weights: list[Any] | None = None
    rng_of: Callable[[int, int], Any] | None = None


@dataclass
class StepResults:
    """What one rank's step produced."""

    # keyed by microbatch: a schedule may run the last stage's forwards out of microbatch order
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  #: per microbatch, as loss_fn returned it
    outputs: dict[int, Any] = field(default_factory=dict)  #: forward only, without loss: the last stage's outputs
    weighted: dict[int, torch.Tensor] = field(default_factory=dict)  #: per microbatch, its weighted share of the step's loss

    def loss(self) -> torch.Tensor | None:
        """The step's loss (the weighted sum, in microbatch order), on the last stage's rank; None elsewhere."""
        return torch.stack([self.weighted[j] for j in sorted(self.weighted)]).sum() if self.weighted else None

    def microbatch_losses(self) -> list[torch.Tensor]:
        """Each microbatch's loss, in microbatch order (whatever order the schedule ran them in)."""
        return [self.losses[j] for j in sorted(self.losses)]


class StageBoundaries(Protocol):
    """Told when a stage's gradients are final (`zbpp.runtime.reductions.Reductions`)."""

    def stage_backward_done(self, stage: int) -> None:
        """The stage's last B (or BW) of the step ran (or, draining, would have)."""

    def stage_wgrad_done(self, stage: int) -> None:
        """The stage's last W (or BW) of the step ran (or, draining, would have)."""


@dataclass
class _Slot:
    """What one (stage, microbatch) keeps between its F and its B."""

    inputs: list[torch.Tensor]  # the stage's input leaves that require grad (their .grad goes back)
    roots: list[torch.Tensor]  # where B starts: the outputs that require grad, or the weighted loss
    saved: SavedBoxes | None = None  # split B: what the forward saved, boxed (input-only ones go after B)


_LEAF_IN_PLACE = "leaf Variable that requires grad is being used in an in-place operation"


def _call_stage(module: nn.Module, args: Any, stage: int) -> Any:
    """The stage's forward; torch's refusal of an in-place change to a received input says why."""
    try:
        return call(module, args)
    except RuntimeError as exc:
        if stage == 0 or _LEAF_IN_PLACE not in describe_error(exc):  # (whose str() may raise: its own error goes)
            raise
        raise RuntimeError(
            f"{describe_error(exc)}\nstage {stage} changed one of its inputs in place; a stage's inputs are the tensors "
            "received from the stage before, leaves whose gradient B sends back, and autograd refuses to "
            "change those in place: clone the input first (h = h.clone())") from exc


def _input_grad(x: torch.Tensor) -> torch.Tensor:
    """The gradient B sends back for the stage's input leaf `x`: zeros where the stage did not use
    it (no gradient reached it; the stage before then leaves that output out of its B: `_usage`)."""
    return x.grad if x.grad is not None else torch.zeros_like(x)


def _usage(comm: CommQueue, stage: int, microbatch: int, used: tuple[bool, ...] | None) -> tuple[bool, ...] | None:
    """Record (on a new signature) or check which inputs needing a gradient stage `stage` + 1 used
    on `microbatch` (`used`: None when its B ran as a replayed graph), and return the usage that
    B(`stage`, `microbatch`) reads. Within a signature the usage must stay as first learnt: an input
    that was unused then and is used now would lose its gradient, so it raises; one used then and
    unused now gets zeros back, with a warning (its parameters get zero .grad, not None)."""
    key = used_key(stage, microbatch)
    known = comm.specs.get(key)
    if used is None:
        return known
    if comm.new_signature or known is None:
        comm.specs[key] = used
        return used
    if any(u and not k for u, k in zip(used, known)):
        raise ShapeMismatchError(
            f"stage {stage + 1} used its input tensors needing a gradient as {list(used)} on microbatch {microbatch}, "
            f"but as {list(known)} on the first step of this input signature, and stage {stage} keeps the unused ones "
            "out of its backward: which inputs a stage uses must be determined by the step's input shapes (and the "
            "modules' train/requires_grad state)")
    if used != known:
        warnings.warn(
            f"stage {stage + 1} used its input tensors needing a gradient as {list(used)} on microbatch {microbatch}, "
            f"but as {list(known)} on the first step of this input signature: the ones it no longer uses get zeros "
            "back, so the parameters of the stage before that feed only them get zero .grad instead of None",
            stacklevel=3)
    return known


@dataclass
class StepExecutor:
    """Runs one step of one rank (see the module docstring). Built fresh for every step.

    Args:
        program: this rank's program (`zbpp.schedules.program.RankProgram`; forward-only for evaluation).
        num_stages: stages of the schedule.
        modules: this rank's stage modules.
        wgrad: per stage, its `StageWgrad`.
        loss_fn: ``loss_fn(output, target) -> scalar``, mean over the microbatch; None: evaluation
            returns the last stage's outputs.
        forward_only: evaluation: F tasks under ``no_grad``, outputs (or losses) kept on the last stage.
        split_wgrad: B tasks compute only input gradients and W every weight gradient
            (`zbpp.runtime._autograd_split`); BW tasks run the whole backward either way.
        free_sent_activations: release an activation's storage once it is handed to its send.
        recorder: task timing, or None.
    """

    program: RankProgram
    num_stages: int
    modules: dict[int, nn.Module]
    wgrad: dict[int, StageWgrad]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    forward_only: bool = False
    split_wgrad: bool = False
    free_sent_activations: bool = True
    recorder: TaskRecorder | None = None
    # -- what one task hands to the next on this rank ---------------------------------------------
    _slots: dict[tuple[int, int], _Slot] = field(default_factory=dict, init=False, repr=False)
    _handed: dict[Action, tuple[Spec | None, list[torch.Tensor]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        tasks = self.program.tasks
        self._split_keys = {(t.stage, t.microbatch) for t in tasks if t.kind is Kind.B} if self.split_wgrad else set()
        # F -> the key of the backward that is the rank's next task, where one is (for activation offload)
        self._next_backward = {(f.stage, f.microbatch): (b.stage, b.microbatch) for f, b in zip(tasks, tasks[1:])
                               if f.kind is Kind.F and b.kind in (Kind.B, Kind.BW)}

    # -- the step -----------------------------------------------------------------------------
    def run(self, data: StepInputs, comm: CommQueue, failure: StepFailure, runner: TaskRunner = EAGER,
            boundaries: StageBoundaries | None = None,
            before_gradients: Callable[[], None] | None = None) -> StepResults:
        """Run every task of this rank with the program's communication (`comm`), each through
        `runner`; tell `boundaries` where each stage's last B and W are; call `before_gradients`
        once, before the first task that is not an F (F reads no gradient; draining too). A failure
        is recorded in `failure` (then the results are incomplete), never raised."""
        results = StepResults()
        tasks = self.program.tasks
        for i, task in enumerate(tasks):
            _interruptible(failure, None, comm.issue, i)
            failure.current = task
            if before_gradients is not None and task.kind is not Kind.F:
                self._call(before_gradients, task, failure)
                before_gradients = None
            if not failure.draining:
                try:
                    self._run_task(task, data, comm, runner, results)
                except Drained:
                    pass  # a peer failed upstream: nothing to report here
                except Exception as exc:  # noqa: BLE001 - the step drains; the agreement reports it
                    failure.fail(exc, task)
                except (KeyboardInterrupt, SystemExit) as exc:
                    # leaving now would strand the peers in their receives until the group's timeout:
                    # drain like any failure; `Pipeline` re-raises it on this rank after the agreement
                    failure.fail(exc, task)
            else:
                _interruptible(failure, task, self._drain_task, task, comm)
            if failure.draining:  # nothing of the step will be computed: free its activations now
                self._slots.clear()
                self._handed.clear()
            self._signal(task, boundaries, failure)
            _interruptible(failure, None, comm.reap)
        failure.current = None
        if before_gradients is not None:  # a program of F tasks only
            self._call(before_gradients, None, failure)
        _interruptible(failure, None, comm.issue, len(tasks))
        while not _interruptible(failure, None, comm.complete):
            pass  # each call goes on where the interrupted one stopped
        self._slots.clear()
        self._handed.clear()
        return results

    @staticmethod
    def _call(fn: Callable[[], None], task: Action | None, failure: StepFailure) -> None:
        try:
            fn()
        except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - the step drains (see `run`)
            failure.fail(exc, task)

    def _run_task(self, task: Action, data: StepInputs, comm: CommQueue, runner: TaskRunner,
                  results: StepResults) -> None:
        if task.kind is Kind.F:
            self._forward(task, data, comm, runner, results)
        elif task.kind is Kind.W:
            started = self._start()
            runner.run(task, [], self._wgrad_body(task))
            self._stop(task, started)
        else:
            self._backward(task, comm, runner)

    def _start(self) -> Any:
        """A task's compute starts (after its inputs arrived: waiting is communication)."""
        return self.recorder.start() if self.recorder is not None else None

    def _stop(self, task: Action, started: Any) -> None:
        if self.recorder is not None:
            self.recorder.stop(str(task), started)

    def _drain_task(self, task: Action, comm: CommQueue) -> None:
        """Draining: no compute, but the task's receive still happens here (its shapes may be needed
        by a later send, and its sender is waiting)."""
        msg = self.program.recv_of.get(task)
        if msg is None:
            return
        try:
            comm.receive(msg)
        except Drained:
            pass

    # -- tasks --------------------------------------------------------------------------------
    def _forward(self, a: Action, data: StepInputs, comm: CommQueue, runner: TaskRunner, results: StepResults) -> None:
        """F(s, j): the stage's input (and on the last stage the target and the loss factor) in; the
        output leaves (or the loss) out, handed on to the next stage."""
        s, j = a.stage, a.microbatch
        last = s == self.num_stages - 1
        if s == 0:
            assert data.inputs is not None
            leaves, spec = flatten(data.inputs[j])
            wants_grad = None  # the batch's own tensors, as given
        else:
            spec, leaves = self._stage_input(a, comm)
            wants_grad = [m.requires_grad and not self.forward_only for m in spec.tensors]
        n = len(leaves)
        with_loss = last and self.loss_fn is not None
        extra: list[torch.Tensor] = []
        if with_loss:
            target_leaves, target_spec = flatten(data.targets[j] if data.targets is not None else None)
            factor = data.weights[j]
            extra = target_leaves + ([factor] if isinstance(factor, torch.Tensor) else [])

        def body(ins: list[torch.Tensor]) -> tuple[list[torch.Tensor], Spec | None]:
            xs = ins[:n] if wants_grad is None else [t.detach().requires_grad_(g) for t, g in zip(ins[:n], wants_grad)]
            grad_inputs = [] if wants_grad is None else [x for x in xs if x.requires_grad]
            saved = SavedBoxes() if grad_inputs and (s, j) in self._split_keys else None
            grad_mode = torch.no_grad() if self.forward_only else torch.enable_grad()
            with microbatch_key((s, j)), next_backward(self._next_backward.get((s, j))), grad_mode, \
                    saved if saved is not None else contextlib.nullcontext():
                out = _call_stage(self.modules[s], rebuild(spec, xs), s)
                if with_loss:
                    loss = self._loss(out, rebuild(target_spec, ins[n:n + len(target_leaves)]), s)
                    f = ins[-1] if isinstance(factor, torch.Tensor) else factor
                    outs, out_spec, roots = [loss], None, [_weigh(loss, f)]
                else:
                    outs, out_spec = flatten(out)
                    roots = [t for t in outs if t.requires_grad]
            del out, xs
            if not self.forward_only:
                self._slots[(s, j)] = _Slot(grad_inputs, roots, saved)
            return outs, out_spec

        started = self._start()
        # seeded around the body (and around a graph's capture and each replay: its draws start
        # from the generator's state at its replay, so they are the eager task's)
        with data.rng_of(s, j) if data.rng_of is not None else contextlib.nullcontext():
            outs, out_spec = runner.run(a, leaves + extra, body)
        del leaves
        self._stop(a, started)  # the task's compute only; handing the output on is communication
        if with_loss:
            loss = outs[0]
            results.losses[j] = loss.detach().clone()  # a copy: a replayed graph rewrites its output
            factor = data.weights[j] if data.loss_weights is None else data.loss_weights[j]
            results.weighted[j] = _weigh(loss, factor).detach()
        elif last:
            results.outputs[j] = rebuild(out_spec, outs)
        else:
            if not outs:
                raise TypeError(f"stage {s} returned {out_spec} for microbatch {j}: a stage that feeds another must "
                                "return a tensor, or a tuple/list/dict holding at least one")
            self._hand_forward(a, outs, out_spec, comm, release=not runner.static_outputs)

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

    def _stage_input(self, a: Action, comm: CommQueue) -> tuple[Spec, list[torch.Tensor]]:
        """F(s, j)'s input leaves for s > 0, handed over on this rank or received."""
        msg = self.program.recv_of.get(a)
        if msg is None:
            spec, leaves = self._handed.pop(self.program.handed_from[a])
            return spec, leaves
        leaves = comm.receive(msg)  # on a new signature, its spec arrives with it
        return comm.specs[(msg.src.stage, msg.src.microbatch)], leaves

    def _hand_forward(self, a: Action, leaves: list[torch.Tensor], spec: Spec, comm: CommQueue, *, release: bool) -> None:
        """F's output to the next stage: in memory on this rank, else to its send (checked against
        the signature's spec). `release`: free the storage of the outputs once sent."""
        s, j = a.stage, a.microbatch
        if comm.new_signature:  # checked once per input signature (a stage's output structure follows it)
            hidden = hidden_tensor_value(spec)
            if hidden is not None:
                raise TypeError(
                    f"stage {s} returned tensors inside a value of type {type(hidden).__name__} for microbatch {j}: "
                    "only tensors in tuples, lists and dicts go to the next stage as tensors (with their gradient "
                    "back); return them in a dict or tuple")
        msg = self.program.send_of.get(a)
        if msg is None:  # the next stage is on this rank: its inputs are fresh leaves
            self._handed[a] = (spec, [t.detach().requires_grad_(t.requires_grad and not self.forward_only)
                                      for t in leaves])
            return
        known = comm.specs.get((s, j))
        if comm.new_signature:
            comm.specs[(s, j)] = spec
        elif known != spec:
            raise ShapeMismatchError(
                f"stage {s} microbatch {j}: the output is {spec}, but on the first step of this input "
                f"signature it was {known} and stage {msg.dst.stage} (rank {msg.dst_rank}) expects that. A stage's "
                "output structure, shapes, dtypes, requires_grad and non-tensor values must be determined "
                "by the step's input shapes (and the modules' train/requires_grad state)"
            )
        comm.put(msg, spec if comm.new_signature else None, [t.detach().contiguous() for t in leaves])
        if release and self.free_sent_activations and not self.forward_only:
            for t in leaves:
                # Keep only the autograd node; the storage goes once the send completes. Not for
                # views and leaves (they share memory with others) nor an output that a node of
                # this F saved as its input (it reads the tensor itself, whose data this swaps).
                if t.requires_grad and t.grad_fn is not None and t._base is None and not held_elsewhere(t):
                    t.data = torch.empty((1,), dtype=t.dtype, device=t.device)

    def _backward(self, a: Action, comm: CommQueue, runner: TaskRunner) -> None:
        """B(s, j) or BW(s, j): the output gradients in, the input gradients out (handed on before
        the previous stage's B needs them); BW also runs W. Outputs that the next stage did not use
        stay out of the backward, as in one process (`_usage`)."""
        s, j = a.stage, a.microbatch
        grads: list[torch.Tensor] = []
        usage: tuple[bool, ...] | None = None
        if s < self.num_stages - 1:
            msg = self.program.recv_of.get(a)
            grads = list(self._handed.pop(self.program.handed_from[a])[1] if msg is None else comm.receive(msg))
            usage = comm.specs.get(used_key(s, j))
        used: list[tuple[bool, ...]] = []  # this B's inputs' usage (none when a replayed graph runs it)

        def body(ins: list[torch.Tensor]) -> tuple[list[torch.Tensor], None]:
            slot = self._slots.pop((s, j))
            gs: list[torch.Tensor | None] = list(ins) if ins else [None] * len(slot.roots)
            ins.clear()  # the output gradients go as soon as backward is done with them
            roots = slot.roots
            if isinstance(usage, tuple) and len(usage) == len(roots) and not all(usage):
                roots, gs = [r for r, u in zip(roots, usage) if u], [g for g, u in zip(gs, usage) if u]
            split = self.split_wgrad and a.kind is Kind.B
            if roots:
                self.wgrad[s].backward((s, j), roots, gs, slot.inputs, slot.saved, split=split)
            else:  # nothing of this stage was used after it: no gradient reaches it, as in one process
                self.wgrad[s].filed((s, j))
            slot.saved = None
            del gs, roots
            slot.roots.clear()
            used.append(tuple(x.grad is not None for x in slot.inputs))
            in_grads = [_input_grad(x) for x in slot.inputs]
            for x in slot.inputs:
                x.grad = None
            slot.inputs.clear()
            if a.kind is Kind.BW:
                self.wgrad[s].compute((s, j))
            return in_grads, None

        started = self._start()
        in_grads, _ = runner.run(a, grads, body)
        del grads
        self._stop(a, started)
        if s > 0:  # the previous stage waits for the input gradient
            told = _usage(comm, s - 1, j, used[0] if used else None)
            msg = self.program.send_of.get(a)
            if msg is None:
                self._handed[a] = (None, list(in_grads))
            else:
                comm.put(msg, told, [g.contiguous() for g in in_grads])

    def _wgrad_body(self, a: Action) -> Callable[[list[torch.Tensor]], tuple[list[torch.Tensor], None]]:
        """W(s, j): the rest of the stage's backward and its delayed-wgrad modules' (no tensor in or out)."""
        def body(_: list[torch.Tensor]) -> tuple[list[torch.Tensor], None]:
            self.wgrad[a.stage].compute((a.stage, a.microbatch))
            return [], None
        return body

    def _signal(self, a: Action, boundaries: StageBoundaries | None, failure: StepFailure) -> None:
        """At the program's known boundaries (the stage's last B / W ran or, draining, would have):
        the data-parallel reductions start."""
        if boundaries is None:
            return
        try:
            if a.kind in (Kind.B, Kind.BW) and self.program.last_backward.get(a.stage) == a:
                boundaries.stage_backward_done(a.stage)
            if a.kind in (Kind.W, Kind.BW) and self.program.last_wgrad.get(a.stage) == a:
                boundaries.stage_wgrad_done(a.stage)
        except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - an interrupt too: see `run`
            failure.fail(exc, a)
            # a reduction this rank did not launch leaves its replicas' (or tie's) collectives out of
            # step: the end agreement marks the job broken, so no peer waits for it to the timeout
            failure.comm_error = failure.comm_error or RuntimeError(
                f"the gradient reductions of stage {a.stage} failed after task {a}, so the collectives of its "
                f"replicas or tied copies are out of step: {describe_error(exc)}")
            self._slots.clear()
            self._handed.clear()


def _interruptible(failure: StepFailure, task: Action | None, fn: Callable[..., Any], *args: Any) -> bool:
    """``fn(*args)`` (communication, which records its own errors); a KeyboardInterrupt or SystemExit
    in it is recorded in `failure` instead of leaving the step, whose remaining sends and receives
    the peers wait for (the rank drains; `Pipeline` re-raises it after the end agreement). True
    when `fn` returned."""
    try:
        fn(*args)
    except (KeyboardInterrupt, SystemExit) as exc:
        failure.fail(exc, task)
        return False
    return True


def _weigh(loss: torch.Tensor, factor: Any) -> torch.Tensor:
    """``loss * factor``; a tensor factor of 0 gives 0 (and a zero gradient), whatever the loss."""
    if not isinstance(factor, torch.Tensor):
        return loss * factor
    return torch.where(factor != 0, loss * factor.to(loss.dtype), torch.zeros((), dtype=loss.dtype, device=loss.device))
