"""Whole tasks replayed from CUDA graphs: ``Pipeline(..., cuda_graphs=True)``.

Where layers are small the host, not the GPU, sets a step's pace. With ``cuda_graphs=True`` the
first step of each input signature runs eagerly (it learns the shapes and lets every lazy
initialisation happen outside a capture); the second captures each of the rank's F, B, W and BW
tasks into its own CUDA graph, in the schedule's order, and replays it at once; every later step
of that signature copies each task's inputs into the graph's static buffers and replays it.

- **Order and memory.** All graphs of a `Pipeline` share one memory pool and are captured in
  the order the schedule runs them, so what a task frees (B frees what F saved) is reused by the
  tasks captured after it, as in eager mode; replaying in the same order keeps that correct. A
  graph's static outputs (the activation sent to the next stage, the input gradient sent back,
  the loss) live as long as the graph.
- **What stays outside.** Sends and receives, the hand-over between stages of one rank, the
  data-parallel and tied-parameter reductions (fired by the runtime after a stage's last W, from
  ``get_backward_dw_params``: hooks inside a graph never fire) and the agreements.
- **Gradients.** A captured accumulation writes to a fixed address, so while graphs are on every
  trainable parameter without ``main_grad`` keeps one ``.grad`` tensor: a step starts by zeroing
  it when ``.grad`` is None (``zero_grad()``), or by copying a replaced ``.grad`` into it. Where the
  step's first contribution is a zbpp layer's W (its GEMM weights and biases), that W writes the
  buffer instead of adding to zeros, and replays skip its zeroing: two passes over the weights'
  gradients fewer. Earlier gradients kept without ``zero_grad()`` are added back after that
  stage's last W (from the copy kept for a rollback, else a copy made for it), a tied parameter's
  at the step's end (its buffer zeroed for the step: the sum over its copies counts them once); so
  are zeros written in place (``zero_grad(set_to_none=False)``): clear gradients with
  ``zero_grad()`` (torch's default, ``set_to_none=True``).
  ``main_grad`` buffers must keep their address; a new address (the data-parallel reducer
  rebuilding its buckets), a moved parameter or a new ``.grad`` buffer makes the step capture again.
- **Signatures.** A step's input signature: the structure, shapes, dtypes and non-tensor values of
  its input and of its target, and every rank's train/eval modes, requires_grad flags and
  ``torch.autocast`` or ``zbpp.modules.fp8_autocast`` around the step (a capture bakes them in). Graphs are kept for the last `MAX_GRAPHED_SIGNATURES` input signatures (least
  recently used dropped first); evaluation steps (`Pipeline.eval_step`) run eagerly.
- **Refused or not captured right.** CPU stages (``ValueError`` at construction), stages whose
  module sets ``zbpp_cuda_graphs = False``, fully_shard stages; a task that synchronises with the
  host (``.item()``, ``.cpu()``, a data-dependent shape) fails its capture with `GraphCaptureError`
  on every rank. Host-side decisions inside a stage (a Python branch on the step count, on a
  tensor's value) are taken once, at capture: declare such a stage with
  ``zbpp_cuda_graphs = False``.
- **Choosing by measurement** (``cuda_graphs="auto"``, `AutoGraphs`). Where the GPU, not the host,
  sets the pace, replays can be slower than eager steps (a compute-bound stage). For each input
  signature: step 1 eager, step 2 captures, then `TRIAL_STEPS` eager and `TRIAL_STEPS` replayed
  steps alternate, their tasks timed on the compute stream (CUDA events; a failed step, or a replay
  that had to capture again, gives no time). At the next step's start agreement every rank whose
  trial ended reports its slowest eager step (eager's pace follows the host's, which varies), the
  host's time issuing it, and its fastest replayed step (reading the events is the one host
  synchronisation of a signature's trial); the slowest rank of each form sets its pace. Graphs are
  kept if eager was not timed or the replays' pace beat eager's by `agreement.GRAPHS_MARGIN`; or,
  where the host's issue time is at least half the eager step's (a host at half the trial's speed
  would set eager's pace), if eager did not beat them by that margin (`agreement.graphs_win`). Every
  rank takes that decision, for that signature from then on (measured again if the pipeline
  forgets the signature); if eager wins, its graphs are dropped (their memory goes back to the
  graphs' pool, for later captures; the pool itself, once it holds no graph, to the allocator).
  Steady steps add nothing: no timing, no collective. The trial's eager steps run beside the
  graphs' memory: a stage that fits only one of them at a time should pass True or False.
- **Random draws.** Each F is captured and replayed under its microbatch's seed (`zbpp.runtime.rng`):
  a replay draws from the generator's state at its start, so dropout masks are the eager step's.

Captures use ``capture_begin(capture_error_mode="thread_local")`` on the pipeline's compute stream
(not the ``torch.cuda.graph`` context manager: it synchronises the whole device, which could wait
for a peer's receive while the peer waits for this rank).

Each task of `zbpp.runtime.executor` is written once, as a body from its input tensors to its
output tensors; a *runner* decides how the body runs, once per input signature: `EAGER` calls it,
`TaskGraphs` captures it on the signature's capture step and replays it after, and `StandInGraphs`
(for tests on CPUs) does the graphs' bookkeeping but runs every "replay" eagerly again, through the
same static buffers.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import operator
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Mapping, Protocol, Sequence

import torch

from .._compat import end_allocate_to_pool, foreach_copy_, foreach_zero_
from ..modules.context import writing_first_grads
from .errors import GraphCaptureError

__all__ = ["Body", "TaskRunner", "EAGER", "GradBuffers", "TaskGraphs", "StandInGraphs", "GraphCache", "AutoGraphs",
           "StepTimer", "EventTimer", "HostTimer", "graph_cache", "MAX_GRAPHED_SIGNATURES", "TRIAL_STEPS",
           "external_addresses", "refusal"]

MAX_GRAPHED_SIGNATURES = 4
#: ``cuda_graphs="auto"``: timed steps of each form (eager, replayed) per input signature before it chooses
TRIAL_STEPS = 2
_MAX_CHOSEN_SIGNATURES = 16  # choices remembered (at least the pipeline's cached signatures)

#: A task's body: its input tensors in (a list the body owns: it may empty it to free them early),
#: its output tensors and what else it learnt (an output's `Spec`) out. A runner may call it once
#: and reuse what it returned.
Body = Callable[[list[torch.Tensor]], tuple[list[torch.Tensor], Any]]


class TaskRunner(Protocol):
    """How every task of one step runs (chosen once per input signature)."""

    #: the outputs are buffers that every run rewrites (keep a copy of what must outlive the step;
    #: never release their storage)
    static_outputs: bool

    def run(self, key: Hashable, inputs: list[torch.Tensor], body: Body) -> tuple[list[torch.Tensor], Any]:
        """Run task `key`'s `body` on `inputs` (the list may be emptied); return its outputs and
        what else it returned."""
        ...


class _Eager:
    """Every task runs its body, now: ``run(key, inputs, body) == body(inputs)``."""

    static_outputs = False

    def run(self, key: Hashable, inputs: list[torch.Tensor], body: Body) -> tuple[list[torch.Tensor], Any]:
        return body(inputs)


EAGER: TaskRunner = _Eager()


@dataclass
class _Recorded:
    graph: Any  # torch.cuda.CUDAGraph, or None for the stand-in
    statics: list[torch.Tensor]  # where each replay reads the task's inputs
    outs: list[torch.Tensor]  # what each replay rewrites
    meta: Any  # what the body returned besides its outputs, at capture
    body: Body | None  # the stand-in re-runs it


class TaskGraphs:
    """The captured tasks of one input signature (see the module docstring): a `TaskRunner`.

    `run(key, inputs, body)` captures ``body(statics)`` the first time `key` is seen while
    `capturing`, then replays it: `inputs` are copied into the statics unless they already are
    them (the output of another of these graphs handed over in memory).
    """

    static_outputs = True
    #: where its stages may be: CUDA graphs need a CUDA device
    needs_cuda = True
    #: a replay runs the bodies again (the stand-in), instead of their recorded kernels
    replays_run_bodies = False

    def __init__(self, pool: Any, external: tuple = ()) -> None:
        self.pool = pool
        self.capturing = True  # the step that captures; later steps replay
        self._records: dict[Hashable, _Recorded] = {}
        self._stable: set[int] = set()  # data_ptr of every static output
        self.external = external  # the addresses the graphs bake in, outside their pool
        #: parameter id -> stage whose W overwrites its fixed ``.grad`` buffer (`GradBuffers`), once captured
        self.grad_writes: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._records)

    def run(self, key: Hashable, inputs: list[torch.Tensor], body: Body) -> tuple[list[torch.Tensor], Any]:
        rec = self._records.get(key)
        if rec is None:
            if not self.capturing:
                raise GraphCaptureError(f"task {key} was not captured on this signature's capture step")
            statics = [t if t.data_ptr() in self._stable else t.detach().clone() for t in inputs]
            rec = self._records[key] = self._record(key, statics, body)
            self._stable.update(o.data_ptr() for o in rec.outs)
            return rec.outs, rec.meta
        stale = [(s, t) for s, t in zip(rec.statics, inputs) if s.data_ptr() != t.data_ptr()]
        if stale:
            foreach_copy_([s for s, _ in stale], [t for _, t in stale])
        self._replay(rec)
        return rec.outs, rec.meta

    def _abandon(self, graph: Any) -> None:
        """End a capture that failed (`graph` None: it failed to begin): the allocator must stop
        routing allocations to the pool, else it asserts at the next pool's release."""
        if graph is not None:
            try:
                graph.capture_end()
                return
            except Exception:  # noqa: BLE001 - the capture is broken anyway: the caller reports its cause
                pass
        with contextlib.suppress(Exception):  # a capture that never began may have nothing to end
            end_allocate_to_pool(self.pool)

    def _replay(self, rec: _Recorded) -> None:
        rec.graph.replay()

    def _record(self, key: Hashable, statics: list[torch.Tensor], body: Body) -> _Recorded:
        """Capture `body` on `statics` into a CUDA graph and replay it once (this step's run)."""
        graph = torch.cuda.CUDAGraph()
        # A host synchronisation raises before it reaches the stream, so that the capture
        # ends cleanly instead of being invalidated by CUDA. The garbage collector waits: freeing
        # an unreachable graph (a dropped pipeline's) during a capture invalidates the capture.
        sync_mode, collecting = torch.cuda.get_sync_debug_mode(), gc.isenabled()
        gc.disable()
        try:
            torch.cuda.set_sync_debug_mode("error")
            began = False
            try:
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                began = True
                outs, meta = body(list(statics))
            except BaseException as exc:
                self._abandon(graph if began else None)
                raise GraphCaptureError(
                    f"task {key} could not be captured into a CUDA graph ({type(exc).__name__}: {exc}). Under "
                    "cuda_graphs=True a stage must not synchronise with the host (.item(), .cpu(), printing a "
                    "tensor, shapes that depend on values); pass cuda_graphs=False, or mark the stage module "
                    "with zbpp_cuda_graphs = False"
                ) from exc
            with warnings.catch_warnings():  # a task with no kernel (B of a first stage) is a valid empty graph
                warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                graph.capture_end()
        finally:
            torch.cuda.set_sync_debug_mode(sync_mode)
            if collecting:
                gc.enable()
        graph.replay()
        return _Recorded(graph, statics, [o.detach() for o in outs], meta, None)


class StandInGraphs(TaskGraphs):
    """`TaskGraphs` without CUDA, for tests: the same capture order, static inputs and outputs and
    hand-over, but each "replay" runs the body again eagerly and copies its outputs into the
    static ones. Tests pick it with ``Pipeline(..., cuda_graphs=StandInGraphs)``."""

    needs_cuda = False
    replays_run_bodies = True

    def _record(self, key: Hashable, statics: list[torch.Tensor], body: Body) -> _Recorded:
        outs, meta = body(list(statics))
        return _Recorded(None, statics, [o.detach() for o in outs], meta, body)

    def _replay(self, rec: _Recorded) -> None:
        assert rec.body is not None
        news, _ = rec.body(list(rec.statics))
        with torch.no_grad():
            for out, new in zip(rec.outs, news):
                out.copy_(new)


class StepTimer(Protocol):
    """Times a step's tasks for ``cuda_graphs="auto"`` (`EventTimer` on CUDA, `HostTimer` elsewhere)."""

    def mark(self) -> Any:
        """A point in time, taken where the current stream has got to."""
        ...

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from mark `start` to mark `end` (may wait for the device to reach `end`)."""
        ...


class EventTimer:
    """`StepTimer` of CUDA events recorded on the current stream: a step's time on the device,
    gaps where the host starved it included."""

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class HostTimer:
    """`StepTimer` of a host clock (`time.perf_counter`; tests pass their own).

    >>> ticks = iter([1.0, 3.5])
    >>> timer = HostTimer(lambda: next(ticks))
    >>> timer.seconds(timer.mark(), timer.mark())
    2.5
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock

    def mark(self) -> Any:
        return self.clock()

    def seconds(self, start: Any, end: Any) -> float:
        return float(end - start)


@dataclass(frozen=True)
class AutoGraphs:
    """``Pipeline(..., cuda_graphs="auto")`` is ``cuda_graphs=AutoGraphs()``: each input signature
    runs eagerly or from its graphs, whichever its trial measured faster (the module docstring).
    Tests on CPUs pass ``AutoGraphs(StandInGraphs, HostTimer(clock))``."""

    kind: type[TaskGraphs] = TaskGraphs
    timer: StepTimer | None = None  #: None: `EventTimer` for CUDA graphs, else `HostTimer`
    #: times the host's issue of a trial's eager steps; None: `time.perf_counter` where the default
    #: timer times the device (CUDA graphs), else none (the host is the device: nothing apart to time)
    host_clock: Callable[[], float] | None = None


def graph_cache(option: Any, modules: dict[int, torch.nn.Module], device: torch.device) -> GraphCache | None:
    """The `GraphCache` of ``Pipeline(..., cuda_graphs=option)``: None for False; always graphs for
    True (or a `TaskGraphs` class: tests); measured per signature for "auto" (or an `AutoGraphs`).

    >>> graph_cache(False, {}, torch.device("cpu")) is None
    True
    >>> graph_cache("sometimes", {}, torch.device("cpu"))
    Traceback (most recent call last):
    ...
    ValueError: cuda_graphs='sometimes': pass False, True or "auto"
    """
    if option is False:
        return None
    if option is True:
        return GraphCache(TaskGraphs, modules, device)
    if isinstance(option, str) and option == "auto":
        option = AutoGraphs()
    if isinstance(option, AutoGraphs):
        return GraphCache(option.kind, modules, device, choose=True, timer=option.timer, host_clock=option.host_clock)
    if isinstance(option, type) and issubclass(option, TaskGraphs):
        return GraphCache(option, modules, device)
    raise ValueError(f'cuda_graphs={option!r}: pass False, True or "auto"')


def refusal(modules: dict[int, torch.nn.Module], device: torch.device, kind: type[TaskGraphs] = TaskGraphs) -> str | None:
    """Why this rank's stages cannot run under ``cuda_graphs=True`` (None: they can)."""
    if device.type != "cuda" and kind.needs_cuda:
        return (f"cuda_graphs=True replays tasks from CUDA graphs, but the pipeline's device is {device}; "
                "move the stages to a CUDA device or pass cuda_graphs=False")
    for s, m in modules.items():
        for name, sub in m.named_modules():
            if getattr(sub, "zbpp_cuda_graphs", True) is False:
                where = f"its submodule {name!r}" if name else "the module"
                return (f"stage {s}: {where} sets zbpp_cuda_graphs = False (host-side decisions that a graph would "
                        "freeze); pass cuda_graphs=False")
    return None


class GradBuffers:
    """One fixed ``.grad`` tensor per trainable parameter without ``main_grad`` (see the module docstring).

    A step's first contribution to a buffer would add to zeros. Where it is a delayed-wgrad
    module's W (`zbpp.modules.context.claim_grad_write`) it writes the buffer instead, and the graphs
    remember which buffers their W write (`TaskGraphs.grad_writes`): those are not zeroed before a
    replay, and where they hold earlier gradients (no ``zero_grad()`` between steps) a copy of those
    is added back after the writing stage's last W, before its gradients are reduced (`add_back`),
    from the copy `GradientsAside` keeps for a rollback where it keeps one; a tied parameter's
    buffer is zeroed by the set-aside instead, which adds them back after the tie's sum (`emptied`).
    A step runs `attach`, `prepare` once its runner is known, `add_back` per stage, then `finish`;
    after ``zero_grad()`` it asks `cleared` before choosing its runner and runs `attach_cleared`
    and `prepare` just before its first task that is not an F (no F reads a gradient), so that an
    idle GPU starts on the first F sooner.
    """

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        self._fresh: list[tuple[int, torch.Tensor]] = []  # attached for a None .grad: zeros due
        self._earlier: list[tuple[int, torch.Tensor]] = []  # holding earlier gradients
        self._writes: _FirstWrites | None = None  # deciding the writes: a capture (or stand-in replay)
        self._known: dict[int, int] = {}  # this step's writes, as its graphs captured them
        self._add_backs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (buffer, earlier values)

    def attach(self, params: Sequence[torch.nn.Parameter]) -> set[int]:
        """Point every such parameter's ``.grad`` at its buffer, keeping what ``.grad`` held.
        Returns the ids of the parameters whose ``.grad`` was None: their buffers hold zeros once
        `prepare` ran (a W that writes its buffer then leaves no zeros to restore but its own values)."""
        zeroed = self._attach_cleared(params)
        if zeroed is not None:
            return zeroed
        fresh: list[tuple[int, torch.Tensor]] = []
        earlier: list[tuple[int, torch.Tensor]] = []
        zeroed: set[int] = set()
        buffers = self._buffers
        for p in params:
            if not p.requires_grad or isinstance(getattr(p, "main_grad", None), torch.Tensor):
                continue
            grad, buf = p.grad, buffers.get(id(p))
            if buf is not None and grad is None:  # the usual case, after zero_grad()
                try:
                    p.grad = buf  # checks the buffer's shape, dtype and device against p's
                except RuntimeError:  # p changed: a new buffer below
                    pass
                else:
                    fresh.append((id(p), buf))
                    zeroed.add(id(p))
                    continue
            if buf is None or buf.shape != p.shape or buf.dtype != p.dtype or buf.device != p.device:
                buf = buffers[id(p)] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                if grad is None:
                    zeroed.add(id(p))
                    p.grad = buf
                    continue
            if grad is not buf:  # a replaced .grad: its values into the buffer
                buf.copy_(grad)
            earlier.append((id(p), buf))  # the buffer holds earlier gradients
            p.grad = buf
        self._fresh, self._earlier = fresh, earlier
        return zeroed

    def cleared(self, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor] | None:
        """The buffers `attach` points the ``.grad`` of `params` at in the usual step, after
        ``zero_grad()``: every parameter trainable, without ``main_grad``, its ``.grad`` None and its
        buffer there (then `attach_cleared` attaches them). None where that is not so. Changes nothing;
        its loops run in C where they can (it runs before every replayed step's first task)."""
        bufs = list(map(self._buffers.get, map(id, params)))
        if (_no_none(bufs) and all(map(_requires_grad, params)) and _all_none(list(map(_grad, params)))
                and _all_none([getattr(p, "main_grad", None) for p in params])):  # a main_grad has no buffer
            return bufs
        return None

    def attach_cleared(self, params: Sequence[torch.nn.Parameter], bufs: Sequence[torch.Tensor]) -> set[int]:
        """`attach` of a step whose runner was chosen for `bufs`, the buffers `cleared` named, and
        whose first tasks may have run (F reads no gradient): raises when a parameter no longer fits its
        buffer (its shape, dtype or device changed while its storage stayed), forgetting every
        buffer, so that the next step makes new ones (and captures its graphs again)."""
        zeroed = self._point_at(params, bufs)
        if zeroed is None:
            self._buffers.clear()
            raise RuntimeError(
                "a parameter's .grad could not be pointed at its fixed buffer for CUDA graphs: its shape, dtype "
                "or device changed while its storage stayed, after the step's first tasks had replayed with it "
                "as it was. This step is rolled back; the next one captures its task graphs again"
            )
        return zeroed

    def _attach_cleared(self, params: Sequence[torch.nn.Parameter]) -> set[int] | None:
        """`attach` of the usual step (`cleared`); None, changing nothing, where that is not so."""
        bufs = self.cleared(params)
        return self._point_at(params, bufs) if bufs is not None else None

    def _point_at(self, params: Sequence[torch.nn.Parameter], bufs: Sequence[torch.Tensor]) -> set[int] | None:
        """Each ``.grad`` of `params` (all None) pointed at its buffer of `bufs`; None, changing
        nothing, where a parameter does not fit its buffer."""
        ids = list(map(id, params))
        try:
            for p, buf in zip(params, bufs):
                p.grad = buf  # checks the buffer's shape, dtype and device against p's
        except RuntimeError:  # a parameter changed: `attach` makes it a new buffer
            for p in params:
                p.grad = None  # as every one was
            return None
        self._fresh, self._earlier = list(zip(ids, bufs)), []
        return set(ids)

    def emptied(self, ids: set[int]) -> None:
        """After `attach`: the set-aside zeroed the buffers of these parameters (tied ones, whose sum
        over the copies must see the step's gradient alone) and adds their earlier gradients back
        itself, after that sum: `add_back` leaves them out."""
        if ids:
            self._earlier = [(pid, buf) for pid, buf in self._earlier if pid not in ids]

    def prepare(self, runner: TaskRunner, stage_params: Mapping[int, Sequence[torch.nn.Parameter]],
                kept: Mapping[int, torch.Tensor] | None = None) -> None:
        """Before the step's first task that may touch a gradient, its runner chosen: zero the fresh
        buffers no W writes, copy the earlier gradients a W overwrites (`kept`: copies already made of
        them, by the buffer's id, read instead), and, where the step's W decide the writes (a capture,
        a stand-in replay), start deciding (`stage_params`: this rank's parameters of each stage)."""
        graphs = runner if isinstance(runner, TaskGraphs) else None
        deciding = graphs is not None and (graphs.capturing or graphs.replays_run_bodies)
        known = graphs.grad_writes if graphs is not None and not graphs.capturing else {}
        self._known = known
        zero = [buf for pid, buf in self._fresh if pid not in known]
        if zero:
            foreach_zero_(zero)
        # a capture learns its writes as it goes: every earlier gradient may be overwritten
        capturing = graphs is not None and graphs.capturing
        kept = kept or {}
        self._add_backs = {pid: (buf, _copy_of(buf, kept)) for pid, buf in self._earlier if capturing or pid in known}
        self._fresh, self._earlier = [], []
        self._writes = _FirstWrites(self._buffers, stage_params) if deciding else None

    def deciding(self) -> Any:
        """The block in which the step's tasks run: W's writes decided there, where `prepare` said."""
        return writing_first_grads(self._writes) if self._writes is not None else contextlib.nullcontext()

    def add_back(self, stage: int) -> None:
        """After `stage`'s last W: add the earlier gradients back into the buffers its W wrote."""
        if not self._add_backs:
            return
        writes = self._writes.writes if self._writes is not None else self._known
        done = [pid for pid, (buf, _) in self._add_backs.items() if writes.get(pid) == stage]
        for pid in done:
            buf, earlier = self._add_backs.pop(pid)
            buf.add_(earlier)

    def finish(self, runner: TaskRunner) -> None:
        """The step's tasks ended: a capture keeps the writes its W made (a capture that failed is
        dropped with them)."""
        writes, self._writes, self._add_backs, self._known = self._writes, None, {}, {}
        if writes is not None:
            writes.remove_hooks()
            if isinstance(runner, TaskGraphs) and runner.capturing:
                runner.grad_writes = writes.writes


def _copy_of(buf: torch.Tensor, kept: Mapping[int, torch.Tensor]) -> torch.Tensor:
    copy = kept.get(id(buf))
    return copy if copy is not None else buf.clone()


class _FirstWrites:
    """`claim_grad_write` for one step: a contribution may overwrite a fixed buffer when it is the
    step's first to that parameter (autograd's accumulations count: hooks see them) and the
    parameter belongs to one stage of this rank (whose last W then adds back earlier gradients).
    Its hooks live while it decides (a capture, a stand-in replay): a replayed graph runs no Python."""

    def __init__(self, buffers: dict[int, torch.Tensor], stage_params: Mapping[int, Sequence[torch.nn.Parameter]]) -> None:
        self.buffers = buffers
        self.touched: set[int] = set()
        self.writes: dict[int, int] = {}  # parameter id -> stage
        self.stage_of: dict[int, int] = {}
        shared: set[int] = set()
        touched = self.touched
        self._hooks: list[Any] = []
        for stage, params in stage_params.items():
            for p in params:
                pid = id(p)
                if pid in self.stage_of and self.stage_of[pid] != stage:
                    shared.add(pid)
                elif pid in buffers and pid not in self.stage_of:
                    self._hooks.append(p.register_post_accumulate_grad_hook(lambda q: touched.add(id(q))))
                self.stage_of[pid] = stage
        for pid in shared:  # two stages of this rank: which one's last W comes after the write is not known here
            del self.stage_of[pid]

    def claim(self, param: torch.nn.Parameter) -> bool:
        pid = id(param)
        if pid in self.touched:
            return False
        self.touched.add(pid)
        stage = self.stage_of.get(pid)
        if stage is None or param.grad is not self.buffers.get(pid):
            return False
        self.writes[pid] = stage
        return True

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def external_addresses(params: Sequence[torch.nn.Parameter],
                       grads: Sequence[torch.Tensor | None] | None = None,
                       buffers: Sequence[torch.Tensor] = ()) -> tuple:
    """The addresses outside the pool that captured tasks read or write: each parameter's data,
    ``.grad`` (or the one of `grads`, by position, that the step will attach) and ``main_grad``,
    and each of the modules' `buffers` (one reassigned, as HF's dynamic RoPE does with
    ``inv_freq``, leaves a graph reading the old, maybe freed, tensor)."""
    # loops that run in C where they can: this runs before every replayed step's first task
    grads = list(map(_grad, params)) if grads is None else grads
    return (_addresses(params), _addresses(grads), _addresses([getattr(p, "main_grad", None) for p in params]),
            _addresses(buffers))


def _addresses(tensors: Sequence[Any]) -> tuple[int, ...]:
    """Each tensor's ``data_ptr()``; 0 for anything that is not a tensor (None)."""
    if _all_none(tensors):
        return (0,) * len(tensors)
    try:
        return tuple(map(_data_ptr, tensors))  # the usual case: every one a tensor
    except TypeError:
        return tuple(t.data_ptr() if isinstance(t, torch.Tensor) else 0 for t in tensors)


# None checks by identity in a C loop (``==`` on a tensor is slow)
def _all_none(values: Sequence[Any]) -> bool:
    return not any(map(operator.is_not, values, itertools.repeat(None)))


def _no_none(values: Sequence[Any]) -> bool:
    return not any(map(operator.is_, values, itertools.repeat(None)))


_data_ptr = torch.Tensor.data_ptr
_grad = operator.attrgetter("grad")
_requires_grad = operator.attrgetter("requires_grad")


@dataclass
class _Trial:
    """One input signature under ``cuda_graphs="auto"``: how far its trial got, its choice."""

    steps: int = 0  #: its training steps that succeeded (the first one eager, the second captured)
    marks: dict[str, list[tuple[Any, Any]]] = field(default_factory=lambda: {"eager": [], "graphs": []})
    issue_s: list[float] = field(default_factory=list)  #: the host's time issuing each timed eager step
    graphs: bool | None = None  #: the choice, once every rank agreed on it

    def form(self) -> str:
        """How its next step runs: "eager" or "graphs" (captured on step 2, then alternating)."""
        if self.graphs is not None:
            return "graphs" if self.graphs else "eager"
        slot = self.steps - 2
        return "eager" if 0 <= slot < 2 * TRIAL_STEPS and slot % 2 == 0 else "graphs"

    @property
    def timing(self) -> bool:
        return self.graphs is None and 2 <= self.steps < 2 + 2 * TRIAL_STEPS


@dataclass
class _TrialStep:
    """The training step under way of a signature under ``cuda_graphs="auto"``."""

    signature: Hashable
    form: str
    start: Any = None  # its tasks' start mark, when it is a timed trial step
    end: Any = None
    host_start: float | None = None  # the host's clock there (eager trial steps, with a host clock)
    host_end: float | None = None


class GraphCache:
    """The graphs of a `Pipeline`'s recent input signatures, their memory pool and side stream.

    Args:
        kind: `TaskGraphs` (CUDA) or `StandInGraphs` (tests, any device).
        modules: this rank's stage modules (checked: `refusal`).
        device: the pipeline's device.
        choose: per signature, eager steps or replays, whichever its trial measured faster
            (``cuda_graphs="auto"``); False: always replays.
        timer: what times the trial's steps; default `EventTimer` for CUDA graphs, else `HostTimer`.
        host_clock: what times the host's issue of the trial's eager steps; default
            `time.perf_counter` with the default timer of CUDA graphs, else none.
    """

    def __init__(self, kind: type[TaskGraphs], modules: dict[int, torch.nn.Module], device: torch.device, *,
                 choose: bool = False, timer: StepTimer | None = None,
                 host_clock: Callable[[], float] | None = None) -> None:
        why = refusal(modules, device, kind)
        if why is not None:
            raise ValueError(why)
        self.kind = kind
        self.graphs: OrderedDict[Hashable, TaskGraphs] = OrderedDict()
        self.grad_buffers = GradBuffers()
        cuda = kind.needs_cuda
        # A pool object, not a bare handle: it keeps the pool alive while no graph holds it (a
        # handle whose graphs were all freed cannot be captured into again)
        self._mem_pool = torch.cuda.MemPool() if cuda else None
        self._pool = self._mem_pool.id if self._mem_pool is not None else None
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._device = device
        self.choose = choose
        self.timer: StepTimer = timer if timer is not None else (EventTimer() if cuda else HostTimer())
        if host_clock is None and timer is None and cuda:  # the default timer times the device: the host apart
            host_clock = time.perf_counter
        self.host_clock = host_clock
        self._trials: OrderedDict[Hashable, _Trial] = OrderedDict()
        self._now: _TrialStep | None = None  # the training step under way (choose only)
        self._reported: Hashable | None = None  # the signature whose trial ended, until the ranks decide

    def runner(self, signature: Hashable, new_signature: bool, params: Sequence[torch.nn.Parameter],
               grads: Sequence[torch.Tensor] | None = None, buffers: Sequence[torch.Tensor] = ()) -> TaskRunner:
        """How a training step of `signature` runs: eagerly on its first step, else its graphs
        (captured again when an address they bake in moved; `grads`: the ``.grad`` tensors of
        `params` the step will attach, where they are not attached yet); with `choose`, the form its
        trial step or its choice says (a timed step's tasks start now: `tasks_done` ends them)."""
        if new_signature:
            self.graphs.pop(signature, None)
            if self.choose:
                self._trial(signature, fresh=True)
                self._now = _TrialStep(signature, "eager")
            return EAGER
        trial = self._trial(signature) if self.choose else None
        if trial is not None:
            self._now = _TrialStep(signature, trial.form())
            if self._now.form == "eager":
                if trial.timing:
                    self._now.start = self.timer.mark()
                    self._now.host_start = self.host_clock() if self.host_clock is not None else None
                return EAGER
        graphs = self._graphs(signature, params, grads, buffers)
        if self._now is not None and trial is not None and trial.timing and not graphs.capturing:
            self._now.start = self.timer.mark()  # a replay (a capture's time is no replay's)
        return graphs

    def _graphs(self, signature: Hashable, params: Sequence[torch.nn.Parameter],
                grads: Sequence[torch.Tensor] | None, buffers: Sequence[torch.Tensor]) -> TaskGraphs:
        external = external_addresses(params, grads, buffers)
        graphs = self.graphs.get(signature)
        if graphs is None or graphs.external != external:
            self.graphs.pop(signature, None)  # its graphs are freed (an address they bake in moved)
            if self.kind.needs_cuda and (self._mem_pool is None or not self.graphs):
                # A pool whose graphs were all freed cannot be captured into again (torch's host
                # allocator asserts on the pool's use count), and one given back when eager won is gone
                self._mem_pool = torch.cuda.MemPool()
                self._pool = self._mem_pool.id
            graphs = self.graphs[signature] = self.kind(self._pool, external)
        self.graphs.move_to_end(signature)
        while len(self.graphs) > MAX_GRAPHED_SIGNATURES:  # same signatures on every rank: same eviction
            self.graphs.popitem(last=False)
        return graphs

    def _trial(self, signature: Hashable, fresh: bool = False) -> _Trial:
        trial = None if fresh else self._trials.get(signature)
        if trial is None:  # a new signature; or one whose choice was dropped: measured again from its capture
            trial = self._trials[signature] = _Trial(steps=0 if fresh else 1)
        self._trials.move_to_end(signature)
        while len(self._trials) > _MAX_CHOSEN_SIGNATURES:  # same signatures on every rank: same eviction
            self._trials.popitem(last=False)
        return trial

    def tasks_done(self) -> None:
        """The step's tasks are all issued: the end of a timed trial step."""
        if self._now is not None and self._now.start is not None:
            self._now.end = self.timer.mark()
            if self._now.host_start is not None:
                self._now.host_end = self.host_clock()  # type: ignore[misc]

    def captured(self, runner: TaskRunner) -> None:
        """Every rank succeeded: graphs captured in this step replay from now on; a trial step
        counts (its time, when it was timed)."""
        if isinstance(runner, TaskGraphs):
            runner.capturing = False
        now, self._now = self._now, None
        trial = self._trials.get(now.signature) if now is not None else None
        if trial is None:
            return
        if now.end is not None:
            trial.marks[now.form].append((now.start, now.end))
        if now.host_start is not None and now.host_end is not None:
            trial.issue_s.append(now.host_end - now.host_start)
        trial.steps += 1
        if trial.graphs is None and trial.steps == 2 + 2 * TRIAL_STEPS:  # every rank of the pipeline: same step
            self._reported = now.signature

    def forget(self, signature: Hashable, runner: TaskRunner) -> None:
        """The step failed: a capture cut short is no graph; a trial step neither counts nor is timed."""
        self._now = None
        if isinstance(runner, TaskGraphs) and runner.capturing:
            self.graphs.pop(signature, None)

    def trial_report(self) -> tuple[bool, int, int, int]:
        """For the next start agreement: whether a signature's trial ended on this rank, its
        slowest eager and fastest replayed step and the host's longest issue of an eager step
        (microseconds, at least 1; 0: none was timed). Reading the marks waits for the last one: the
        one host synchronisation of a signature's trial."""
        trial = self._trials.get(self._reported) if self._reported is not None else None
        if trial is None:
            return False, 0, 0, 0
        # a device error raised here, before the agreement, would leave the other ranks waiting; it
        # shows again at this rank's next CUDA call, inside the step, where every rank hears of it
        # eager's pace is its slowest step: its later steps run at the host's speed of the moment,
        # which varies; a replay's does not, so its fastest step
        try:
            paces = [pick((self.timer.seconds(a, b) for a, b in trial.marks[form]), default=0.0)
                     for form, pick in (("eager", max), ("graphs", min))]
        except Exception:  # noqa: BLE001
            paces = [0.0, 0.0]
        eager_us, graphs_us, issue_us = (max(1, round(t * 1e6)) if t > 0 else 0
                                         for t in (*paces, max(trial.issue_s, default=0.0)))
        return True, eager_us, graphs_us, issue_us

    def settle(self, graphs: bool | None) -> None:
        """The ranks' decision on the trial reported at this start agreement (None: no rank
        reported one): it sticks for that signature; graphs that lost are dropped."""
        signature, self._reported = self._reported, None
        trial = self._trials.get(signature) if signature is not None else None
        if trial is None or graphs is None:
            return
        trial.graphs = graphs
        trial.marks = {"eager": [], "graphs": []}
        if not graphs:
            self.graphs.pop(signature, None)
            if not self.graphs:  # no graph left in the pool: give it back, so eager steps can use its memory
                self._mem_pool = self._pool = None

    def forms(self) -> list[str]:
        """Per remembered input signature (least recently used first), how its training steps run:
        ``"graphs"``, ``"eager"`` (``cuda_graphs="auto"`` chose it) or ``"trial"`` (still timing both)."""
        if not self.choose:
            return ["graphs"] * len(self.graphs)
        return ["trial" if t.graphs is None else "graphs" if t.graphs else "eager" for t in self._trials.values()]

    @contextlib.contextmanager
    def stream(self, in_flight: list[tuple[list[Any], list[torch.Tensor]]]) -> Iterator[None]:
        """A training step's stream: a side stream (no capture on the default one), which first
        waits for the caller's work and the sends of earlier steps (their buffers are static
        outputs that the step rewrites)."""
        stream = self._stream
        if stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self._device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            for works, _ in in_flight:
                for w in works:
                    w.wait()
            try:
                yield
            finally:
                caller.wait_stream(stream)
