"""W replayed from a CUDA graph: the ``wgrad_cuda_graph=True`` option of every zbpp layer.

In the launch-bound regime (small layers, many of them) a W task costs more in Python and kernel
launches than in GEMMs. With the option on, a layer's `backward_dw(key)` takes the jobs filed
under `key` (``_layer_function._Job``: the tensors each holds and the pure function
``job_outputs`` of them) and, the first time their *signature* is seen, copies their tensors into
static buffers the layer owns, warms the computation up on a side stream, and captures into one
``torch.cuda.CUDAGraph`` the GEMMs, the bias sums and the accumulation into ``main_grad``. Every
later W with that signature copies the job's tensors into the static buffers (one
``torch._foreach_copy_``) and replays the graph.

The signature is everything the captured graph bakes in: per job and GEMM the parameters (the
very objects) and where the weight gradient goes, the FP8 path, which tensors alias which, each
tensor's shape, strides, dtype and device, and the address, shape, strides and dtype of every
``main_grad`` the graph adds into (the data-parallel reducer may replace those buffers between
steps; a new address is a new signature, never a write into a freed buffer). The graph keeps
a reference to those ``main_grad`` tensors, so an address in a signature cannot be reused by
another tensor while the graph exists. A layer keeps at most `MAX_GRAPHS` graphs (least recently
used dropped first).

``.grad`` is not captured (autograd and ``zero_grad`` replace it): the graph leaves those
gradients in static output tensors, added into ``.grad`` after the replay (a copy when ``.grad``
is None), with the same operations as the eager W, so the result is bit-identical to it wherever
the GEMM library picks the same algorithm for the same shapes (it does: same handle settings and
workspace size on the capture stream). As eager, a bias gradient is written only where the job
produced one (in FP8 it was computed during B).

Hooks inside the graph never fire: in graph mode `backward_dw` does not call the hooks registered
with ``register_wgrad_accumulation_and_reduce_hooks`` (as with Transformer Engine's graphed W);
the runtime reduces the produced gradients exactly once anyway, by firing the grad-reduce hooks of
``get_backward_dw_params()`` after a stage's last W.

The capture uses ``capture_begin(capture_error_mode="thread_local")`` on a side stream that waits
for the current one, not the ``torch.cuda.graph`` context manager: that one synchronizes the whole
device first, which could wait on a pipeline peer's NCCL receive while the peer waits for this
rank. Python work inside the computation (e.g. the FP8 GEMM path counters) runs at capture only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import torch

from .._compat import foreach_copy_
from ._layer_function import GradOut, _Job, _WgradPart, main_grad_of
from .fp8 import Quantized

__all__ = ["WgradGraphs", "MAX_GRAPHS", "WARMUP_RUNS"]

MAX_GRAPHS = 8  # captured signatures kept per layer
WARMUP_RUNS = 2  # runs on the side stream before the capture (cuBLAS handles, workspaces)

Combine = Callable[[Sequence[Callable[[], list[GradOut]]]], list[GradOut]]


class _Captured(NamedTuple):
    graph: Any  # torch.cuda.CUDAGraph
    static: list[torch.Tensor]  # the static copies of the jobs' tensors, in flattening order
    grads: list[tuple[torch.nn.Parameter, torch.Tensor]]  # outputs for .grad, after each replay
    main_grads: tuple[torch.Tensor, ...]  # what the graph adds into (kept alive, see above)


def _flatten(jobs: Sequence[_Job]) -> tuple[list[torch.Tensor], tuple]:
    """The jobs' distinct tensors (each once, aliases shared) and their structure: per job its FP8
    flag and per part (weight id, bias id, fused, dW operands' nodes, db's node), where a node is
    a tensor's index or ``("q", data, scale_inv, data_t)`` for a `Quantized`."""
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}

    def node(t: Any) -> Any:
        if t is None:
            return None
        if isinstance(t, Quantized):
            return ("q", node(t.data), node(t.scale_inv), node(t.data_t))
        i = index.get(id(t))
        if i is None:
            i = index[id(t)] = len(tensors)
            tensors.append(t)
        return i

    structure = []
    for job in jobs:
        parts = []
        for call, operands, bias_grad_of in job.parts:
            ops = None if operands is None else (node(operands[0]), node(operands[1]))
            parts.append((id(call.weight), id(call.bias), call.weight.dtype,
                          call.fuse_wgrad_accumulation, ops, node(bias_grad_of)))
        structure.append((job.fp8, tuple(parts)))
    return tensors, tuple(structure)


def _rebuild(n: Any, static: list[torch.Tensor]) -> Any:
    if n is None:
        return None
    if isinstance(n, tuple):
        return Quantized(_rebuild(n[1], static), _rebuild(n[2], static), _rebuild(n[3], static))
    return static[n]


def _static_jobs(jobs: Sequence[_Job], structure: tuple, static: list[torch.Tensor]) -> list[_Job]:
    out = []
    for job, (fp8, parts) in zip(jobs, structure):
        rebuilt = []
        for part, (_, _, _, _, ops, bias_node) in zip(job.parts, parts):
            operands = None if ops is None else (_rebuild(ops[0], static), _rebuild(ops[1], static))
            rebuilt.append(_WgradPart(part.call, operands, _rebuild(bias_node, static)))
        out.append(_Job(rebuilt, fp8))
    return out


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    foreach_copy_(dst, src)


def require_cuda(owner: str, device: torch.device) -> None:
    """Raise the error that names the option when a graph-mode W meets a non-CUDA tensor."""
    if device.type != "cuda":
        raise RuntimeError(
            f"{owner}: wgrad_cuda_graph=True replays W from a CUDA graph, but the layer is on "
            f"{device}; move it to a CUDA device (.cuda()) or build it with wgrad_cuda_graph=False"
        )


def _record(body: Callable[[], list[tuple[torch.nn.Parameter, torch.Tensor]]],
            warmup: Callable[[], object], device: torch.device) -> tuple[Any, list]:
    """Capture `body` into a CUDA graph on a side stream after `WARMUP_RUNS` runs of `warmup`
    (the same computation without side effects); returns the graph and what `body` returned
    (tensors of the graph's pool, rewritten by every replay). Nothing runs until a replay."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):  # nothing lazy (handles, workspaces) may happen in capture
            warmup()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            out = body()
        except BaseException:
            try:
                graph.capture_end()
            except Exception:  # noqa: BLE001 - the capture is broken anyway: report the cause
                pass
            raise
        graph.capture_end()
    current.wait_stream(side)
    return graph, out


class WgradGraphs:
    """The captured W graphs of one layer, by signature (see the module docstring).

    `combine(jobs)` is the layer's own computation of the gradients of a key's jobs (the jobs'
    outputs, those of one parameter summed as eager W sums them); `run(jobs)` is the graph-mode
    W of those jobs.
    """

    def __init__(self, owner: str, combine: Combine, max_graphs: int = MAX_GRAPHS) -> None:
        self._owner = owner
        self._combine = combine
        self._max = max_graphs
        self._graphs: OrderedDict[Hashable, _Captured] = OrderedDict()
        self.captures = 0  # how many graphs were captured (for tests and reports)
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every captured graph and its static buffers."""
        self._graphs.clear()

    def run(self, jobs: Sequence[_Job]) -> None:
        """Graph-mode W of `jobs` (one key's): capture on a new signature, else copy and replay."""
        for job in jobs:
            if not isinstance(job, _Job):
                raise TypeError(f"{self._owner}: wgrad_cuda_graph=True needs zbpp wgrad jobs, got "
                                f"{type(job).__name__}")
        tensors, structure = _flatten(jobs)
        metas = []
        for t in tensors:
            require_cuda(self._owner, t.device)
            metas.append((t.shape, t.stride(), t.dtype, t.device))
        mains = {}  # id(param) -> main_grad, for the weights whose gradient the graph adds there
        for job in jobs:
            for call, operands, _ in job.parts:
                if operands is not None and call.fuse_wgrad_accumulation:
                    mains[id(call.weight)] = main_grad_of(call.weight_name, call.weight)
        key = (structure, tuple(metas),
               tuple((m.data_ptr(), m.shape, m.stride(), m.dtype) for m in mains.values()))
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(jobs, tensors, structure, mains)
            self._graphs[key] = entry
            while len(self._graphs) > self._max:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
            _copy(entry.static, tensors)
        entry.graph.replay()
        self.replays += 1
        for param, grad in entry.grads:  # outside the graph: .grad may be None or replaced
            if param.grad is None:
                param.grad = grad.clone()
            else:
                param.grad.add_(grad)

    def _capture(self, jobs: Sequence[_Job], tensors: list[torch.Tensor], structure: tuple,
                 mains: dict[int, torch.Tensor]) -> _Captured:
        # the same strides where the tensor is dense (the GEMMs then see the same layouts as
        # eager W), contiguous otherwise (an expanded input cannot be copied into its own layout)
        static = [torch.empty_like(t) for t in tensors]
        _copy(static, tensors)
        static_jobs = _static_jobs(jobs, structure, static)

        def warmup() -> list[GradOut]:
            return self._combine(static_jobs)

        def body() -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
            grads = []
            for _name, param, grad, to_main in self._combine(static_jobs):
                if to_main:
                    mains[id(param)].add_(grad)
                else:
                    grads.append((param, grad))
            return grads

        graph, grads = _record(body, warmup, tensors[0].device)
        self.captures += 1
        return _Captured(graph, static, grads, tuple(mains.values()))

    # a layer must survive copy.deepcopy and torch.save: graphs are not copied (a copy captures
    # its own at its first W)
    def __getstate__(self) -> dict:
        return {"_owner": self._owner, "_combine": self._combine, "_max": self._max}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["_owner"], state["_combine"], state["_max"])
