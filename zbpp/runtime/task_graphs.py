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
  it when ``.grad`` is None (``zero_grad()``), or by copying a replaced ``.grad`` into it.
  ``main_grad`` buffers must keep their address; a new address (the data-parallel reducer
  rebuilding its buckets), a moved parameter or a new ``.grad`` buffer makes the step capture again.
- **Signatures.** Graphs are kept for the last `MAX_GRAPHED_SIGNATURES` input signatures (least
  recently used dropped first); evaluation steps (`Pipeline.eval_step`) run eagerly.
- **Refused or not captured right.** CPU stages (``ValueError`` at construction), stages whose
  module sets ``zbpp_cuda_graphs = False``, fully_shard stages; a task that synchronises with the
  host (``.item()``, ``.cpu()``, a data-dependent shape) fails its capture with `GraphCaptureError`
  on every rank. Host-side decisions inside a stage (a Python branch on the step count, on a
  tensor's value) are taken once, at capture: declare such a stage with
  ``zbpp_cuda_graphs = False``.
- **Random draws.** Each F is captured and replayed under its microbatch's seed (`zbpp.runtime.rng`):
  a replay draws from the generator's state at its start, so dropout masks are the eager step's.

Captures use ``capture_begin(capture_error_mode="thread_local")`` on the pipeline's compute stream
(not the ``torch.cuda.graph`` context manager: it synchronises the whole device, which could wait
for a peer's receive while the peer waits for this rank).

`TaskGraphs` keeps the graphs of one signature; `stand_in=True` runs every "replay" eagerly again
(through the same static buffers), so the bookkeeping is tested on CPUs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from .._compat import foreach_copy_, foreach_zero_
from .errors import GraphCaptureError

__all__ = ["GradBuffers", "TaskGraphs", "MAX_GRAPHED_SIGNATURES", "external_addresses", "refusal"]

MAX_GRAPHED_SIGNATURES = 4
_CPU_STAND_IN = False  # tests: accept CPU stages and run TaskGraphs as stand-ins


@dataclass
class _Recorded:
    graph: Any  # torch.cuda.CUDAGraph, or None for the stand-in
    statics: list[torch.Tensor]  # where each replay reads the task's inputs
    outs: list[torch.Tensor]  # what each replay rewrites
    body: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None  # the stand-in re-runs it


class TaskGraphs:
    """The captured tasks of one input signature (see the module docstring).

    `run(key, inputs, body)` captures ``body(statics)`` the first time `key` is seen while
    `capturing`, then replays it: `inputs` are copied into the statics unless they already are
    them (the output of another of these graphs handed over in memory).
    """

    def __init__(self, pool: Any, *, stand_in: bool = False) -> None:
        self.pool = pool
        self.stand_in = stand_in
        self.capturing = True  # the step that captures; later steps replay
        self.replays = 0  # steps that replayed these graphs
        self._records: dict[Hashable, _Recorded] = {}
        self._stable: set[int] = set()  # data_ptr of every static output
        self.external: tuple = ()  # the addresses the graphs bake in, outside their pool
        self.meta: dict[Hashable, Any] = {}  # what the executor learnt at capture (output specs)

    def __len__(self) -> int:
        return len(self._records)

    def run(self, key: Hashable, inputs: Sequence[torch.Tensor],
            body: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> list[torch.Tensor]:
        rec = self._records.get(key)
        if rec is None:
            if not self.capturing:
                raise GraphCaptureError(f"task {key} was not captured on this signature's capture step")
            return self._capture(key, inputs, body)
        stale = [(s, t) for s, t in zip(rec.statics, inputs) if s.data_ptr() != t.data_ptr()]
        if stale:
            foreach_copy_([s for s, _ in stale], [t for _, t in stale])
        if rec.graph is not None:
            rec.graph.replay()
            return rec.outs
        assert rec.body is not None
        news = rec.body(rec.statics)
        with torch.no_grad():
            for out, new in zip(rec.outs, news):
                out.copy_(new)
        return rec.outs

    def _capture(self, key: Hashable, inputs: Sequence[torch.Tensor],
                 body: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> list[torch.Tensor]:
        statics = [t if t.data_ptr() in self._stable else t.detach().clone() for t in inputs]
        if self.stand_in:
            outs = [o.detach() for o in body(statics)]
            self._records[key] = _Recorded(None, statics, outs, body)
        else:
            graph = torch.cuda.CUDAGraph()
            # A host synchronisation raises before it reaches the stream, so that the capture
            # ends cleanly instead of being invalidated by CUDA.
            sync_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                outs = body(statics)
            except BaseException as exc:
                try:
                    graph.capture_end()
                except Exception:  # noqa: BLE001 - the capture is broken anyway: report the cause
                    pass
                raise GraphCaptureError(
                    f"task {key} could not be captured into a CUDA graph ({type(exc).__name__}: {exc}). Under "
                    "cuda_graphs=True a stage must not synchronise with the host (.item(), .cpu(), printing a "
                    "tensor, shapes that depend on values); pass cuda_graphs=False, or mark the stage module "
                    "with zbpp_cuda_graphs = False"
                ) from exc
            finally:
                torch.cuda.set_sync_debug_mode(sync_mode)
            with warnings.catch_warnings():  # a task with no kernel (B of a first stage) is a valid empty graph
                warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                graph.capture_end()
            graph.replay()
            outs = [o.detach() for o in outs]
            self._records[key] = _Recorded(graph, statics, outs, None)
        self._stable.update(o.data_ptr() for o in outs)
        return outs


def refusal(modules: dict[int, torch.nn.Module], device: torch.device) -> str | None:
    """Why this rank's stages cannot run under ``cuda_graphs=True`` (None: they can)."""
    if device.type != "cuda" and not _CPU_STAND_IN:
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
    """One fixed ``.grad`` tensor per trainable parameter without ``main_grad`` (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def attach(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Point every such parameter's ``.grad`` at its buffer, keeping what ``.grad`` held."""
        zero: list[torch.Tensor] = []
        for p in params:
            if not p.requires_grad or isinstance(getattr(p, "main_grad", None), torch.Tensor):
                continue
            buf = self._buffers.get(id(p))
            if buf is None or buf.shape != p.shape or buf.dtype != p.dtype or buf.device != p.device:
                buf = self._buffers[id(p)] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                if p.grad is not None:
                    buf.copy_(p.grad)
            elif p.grad is None:
                zero.append(buf)
            elif p.grad is not buf:
                buf.copy_(p.grad)
            p.grad = buf
        if zero:
            foreach_zero_(zero)


def external_addresses(params: Sequence[torch.nn.Parameter]) -> tuple:
    """The addresses outside the pool that captured tasks read or write: each parameter's data,
    ``.grad`` and ``main_grad``."""
    out = []
    for p in params:
        main = getattr(p, "main_grad", None)
        out.append((p.data_ptr(), p.grad.data_ptr() if p.grad is not None else 0,
                    main.data_ptr() if isinstance(main, torch.Tensor) else 0))
    return tuple(out)
