"""The private torch APIs zbpp calls, in one place (checked on torch 2.11 and 2.14), but FSDP's.

torch does not promise these names; when one moves, this file is the place to change, with one
exception: FSDP2's internals (its post-backward machinery, the only way to reduce-scatter outside
an autograd backward) stay in the underscored helpers of `zbpp.runtime.fsdp`. Each function says
what it wraps and why the public API does not do. The runtime and the modules both
import from here (it imports nothing of zbpp). Tensor attributes torch documents as internal but
stable (``._base``, ``._version``, ``.data``) are used in place.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Iterable, Iterator, Sequence

import torch

__all__ = [
    "engine_run_backward",
    "set_grad_enabled",
    "scaled_mm",
    "cuda_raw_stream",
    "foreach_copy_",
    "foreach_zero_",
    "default_store",
    "process_group_name",
    "default_group_timeout",
    "fsdp2",
    "current_autograd_node",
    "HAS_CURRENT_AUTOGRAD_NODE",
    "will_engine_execute",
    "saved_by_checkpoint",
    "is_compiled_node",
    "compiled_backward_retained",
    "disable_dynamo",
    "never_compiled",
    "uncompiled",
    "current_saved_tensors_hooks",
    "torch_dispatch_mode",
    "end_allocate_to_pool",
    "gpu_head_start",
    "modules_and_parameters",
    "outermost_module_call",
    "runs_hooks",
    "dcp_file_extents",
    "dcp_host_shard",
    "grad_scaler_found_inf",
    "scheduler_parts",
]


def engine_run_backward(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    retain_graph: bool = False,
    inputs: Sequence[Any] = (),
    accumulate_grad: bool = True,
) -> Any:
    """``torch.autograd.graph._engine_run_backward``, accumulating into ``.grad`` (of every leaf,
    or of `inputs` only when given).

    ``torch.autograd.backward`` checks each gradient against its tensor's current shape; the engine
    checks it against the autograd node's recorded input shape, which a sent activation keeps after
    its storage was released.
    """
    from torch.autograd.graph import _engine_run_backward

    return _engine_run_backward(tuple(roots), tuple(grads), retain_graph, False, tuple(inputs),
                                allow_unreachable=True, accumulate_grad=accumulate_grad)


#: ``torch._C._set_grad_enabled``: `torch.no_grad` without its per-call objects (hot paths; an alias,
#: not a wrapper, so that it costs no extra Python call).
set_grad_enabled = torch._C._set_grad_enabled


def scaled_mm(a: torch.Tensor, b: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``torch._scaled_mm`` (the FP8 GEMM; torch has no public one). Looked up at each call."""
    return torch._scaled_mm(a, b, **kwargs)


def cuda_raw_stream(device: int) -> int:
    """The current CUDA stream of `device` as its raw handle (``torch._C._cuda_getCurrentRawStream``,
    what Triton's own launches read): ``torch.cuda.current_stream().cuda_stream`` builds a Stream
    object first, a microsecond more per launch."""
    return torch._C._cuda_getCurrentRawStream(device)


def foreach_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``torch._foreach_copy_``: one launch for many copies (a CUDA graph's static inputs)."""
    torch._foreach_copy_(list(dst), list(src))


def foreach_zero_(tensors: Sequence[torch.Tensor]) -> None:
    """``torch._foreach_zero_``: one launch to zero many tensors (fixed gradient buffers)."""
    torch._foreach_zero_(list(tensors))


def default_store() -> Any:
    """The default process group's store (``distributed_c10d._get_default_store``)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def process_group_name(group: Any) -> str:
    """A process group's name, the same on every member (``distributed_c10d._get_process_group_name``)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_process_group_name(group)


def default_group_timeout() -> timedelta | None:
    """The default process group's timeout (what ``init_process_group(timeout=...)`` set), or None
    where this torch does not tell (``_get_default_group()._get_backend(device).options._timeout``)."""
    import torch.distributed as dist

    try:
        pg = dist.distributed_c10d._get_default_group()
    except Exception:  # noqa: BLE001 - not initialised, or the private API moved
        return None
    for device in ("cuda", "cpu"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - that device has no backend; try the next
            continue
    return None


def fsdp2() -> tuple[type, Any] | None:
    """``(FSDPModule, fully_shard)`` of FSDP2, or None where torch has none. torch < 2.6 kept them
    in ``torch.distributed._composable.fsdp``."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule, fully_shard
        except ImportError:
            return None
    return FSDPModule, fully_shard


#: ``torch._C._current_autograd_node``: the node whose backward is running on this thread (None
#: outside a backward, and on a torch without it).
current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)
#: Whether `current_autograd_node` names the node (False: that torch has none, it answers None).
HAS_CURRENT_AUTOGRAD_NODE = hasattr(torch._C, "_current_autograd_node")


def will_engine_execute(node: Any) -> bool:
    """``torch._C._will_engine_execute_node``: whether the backward running on this thread runs
    `node`: every node of its graph for a plain ``.backward()``, only those on a path to its
    ``inputs=`` otherwise (``torch.autograd.grad`` too). True where this torch cannot tell (no
    such call, or it refuses one, as under compiled autograd)."""
    probe = getattr(torch._C, "_will_engine_execute_node", None)
    if probe is None:
        return True
    try:
        return bool(probe(node))
    except RuntimeError:
        return True


def _checkpoint_save_inputs() -> Any:
    frame = getattr(__import__("torch.utils.checkpoint").utils.checkpoint, "_CheckpointFrame", None)
    save = getattr(frame, "save_inputs", None)
    return getattr(save, "__code__", None)


#: The code of non-reentrant ``torch.utils.checkpoint``'s ``_CheckpointFrame.save_inputs``, which
#: saves a region's inputs through the current saved-tensor hooks (None where torch has none).
_CHECKPOINT_SAVE_INPUTS = _checkpoint_save_inputs()


def _checkpoint_input_saver() -> tuple[Any, Any]:
    # torch without save_inputs (2.11) saves the region's inputs as ``_NoopSaveInputs``'s, packed
    # while ``Function.apply`` runs: (that code, that class), else (None, None)
    if _CHECKPOINT_SAVE_INPUTS is not None:
        return None, None
    saver = getattr(__import__("torch.utils.checkpoint").utils.checkpoint, "_NoopSaveInputs", None)
    code = getattr(getattr(torch.autograd.Function.apply, "__func__", None), "__code__", None)
    return (code, saver) if saver is not None and code is not None else (None, None)


_APPLY_CODE, _INPUT_SAVER = _checkpoint_input_saver()


def saved_by_checkpoint(caller: Any) -> bool:
    """Whether a saved-tensor pack hook called from frame `caller` is packing an input of a
    non-reentrant ``torch.utils.checkpoint`` region (which its recomputation reads again)."""
    if caller is None:
        return False
    code = caller.f_code
    if code is _APPLY_CODE:
        return caller.f_locals.get("cls") is _INPUT_SAVER
    # save_inputs packs through a comprehension's own frame before Python 3.12
    return code is _CHECKPOINT_SAVE_INPUTS or (caller.f_back is not None and caller.f_back.f_code is _CHECKPOINT_SAVE_INPUTS)


_top_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def in_nonreentrant_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are non-reentrant ``torch.utils.checkpoint``'s: a
    forward running now is a checkpointed region's (first run or recomputation). False on a torch
    that does not say which hooks are on top."""
    if _top_saved_tensors_hooks is None:
        return False
    hooks = _top_saved_tensors_hooks(False)
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


def is_compiled_node(node: Any) -> bool:
    """Whether an autograd node is the backward of a ``torch.compile``d region (AOTAutograd's
    ``CompiledFunctionBackward``: one node for the whole region)."""
    return type(node).__name__ == "CompiledFunctionBackward"


def _functorch_config() -> Any:
    try:
        from torch._functorch import config
    except ImportError:  # pragma: no cover - a torch without AOTAutograd
        return None
    return config if hasattr(config, "donated_buffer") else None


@contextlib.contextmanager
def compiled_backward_retained() -> Iterator[None]:
    """A block in which a compiled region's backward may run in an engine call that retains the
    graph (``retain_graph=True``) although it was compiled with donated buffers.

    AOTAutograd compiles a backward first run without retaining the graph so that it may reuse
    the memory of the region's saved intermediates (``torch._functorch.config.donated_buffer``),
    and from then on refuses any run that retains the graph, since a second run would read that
    memory. The split B retains the graph for the nodes W calls again, but runs a compiled node
    only once (all its gradients in B, never in W): the refusal guards a case that does not
    arise, so the option is off for the block (where this torch has none, nothing changes).
    """
    config = _functorch_config()  # imported already: a compiled region ran
    if config is None or not config.donated_buffer:
        yield
        return
    config.donated_buffer = False
    try:
        yield
    finally:
        config.donated_buffer = True


def disable_dynamo(fn: Any) -> Any:
    """`fn` with torch.compile (dynamo) off while it runs, and a graph break where a compiled
    region calls it: ``torch.compiler.disable``, but importing ``torch._dynamo`` (a second or so)
    on the first call rather than now (``torch._disable_dynamo``, torch's own lazy form; the
    public one where this torch has none)."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)


def never_compiled(fn: Any) -> Any:
    """`fn`, its code marked so that torch.compile (dynamo) never compiles a frame of it or of what
    it calls: entered from eager code while a compiled function runs (a graph break's eager part),
    it runs as in eager, with no frame traced, no guards checked and no recompilation. A traced
    caller that inlines `fn` still traces it. Costs nothing outside torch.compile (the function is
    not wrapped). ``torch._C._dynamo.eval_frame.set_code_exec_strategy`` with SKIP for the frame and
    its callees (``torch._dynamo.skip_code`` sets it for the frame alone, and imports dynamo);
    ``torch.compiler.disable`` would wrap every call. Where this torch has none, nothing changes."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:  # pragma: no cover - a torch without per-code strategies (before 2.6)
        return fn
    skip = _FrameAction.SKIP
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(skip, skip))
    return fn


def uncompiled(module: Any) -> Any:
    """The module that ``torch.compile(module)`` wrapped (its ``OptimizedModule`` adds an
    ``_orig_mod.`` prefix to every state_dict key); any other object as it is."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) and type(module).__name__ == "OptimizedModule" else module


def current_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The ``(pack, unpack)`` pair that a tensor saved for backward right now would go through
    (the innermost ``torch.autograd.graph.saved_tensors_hooks``), or None
    (``torch._C._autograd._top_saved_tensors_default_hooks``). Hooks that replace the current
    ones for a region call these to compose with them; torch offers no public way to read them."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def torch_dispatch_mode() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``, the base class of a ``__torch_dispatch__``
    mode (torch documents the protocol, not the module's name)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def end_allocate_to_pool(pool: Any) -> None:
    """Tell the CUDA caching allocator that a capture into `pool` on the current device is over when
    ``CUDAGraph.capture_end`` raised before doing so (an invalidated capture): else the allocator
    keeps routing allocations to the pool and asserts at the next pool's release."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        end(torch.cuda.current_device(), pool)


def gpu_head_start(cycles: int = 50_000_000) -> None:
    """Keep the current CUDA stream busy for `cycles` GPU clock cycles (``torch.cuda._sleep``, about
    25 ms on a 2 GHz GPU), so that the kernels the host issues next queue up behind it and run back
    to back, as in a running pipeline, instead of each waiting for its launch."""
    torch.cuda._sleep(cycles)


def modules_and_parameters(root: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.nn.Parameter]]:
    """``list(root.modules())`` and ``list(root.parameters())``, in the same orders, from one walk
    through ``_modules`` and ``_parameters``: a step reads both for every stage, and the public
    iterators build a name string for every module and parameter."""
    modules: list[torch.nn.Module] = []
    params: list[torch.nn.Parameter] = []
    seen_modules: set[int] = set()
    seen_params: set[int] = set()
    stack = [root]
    while stack:
        m = stack.pop()
        if id(m) in seen_modules:
            continue
        seen_modules.add(id(m))
        modules.append(m)
        for p in m._parameters.values():
            if p is not None and id(p) not in seen_params:
                seen_params.add(id(p))
                params.append(p)
        stack.extend(reversed([c for c in m._modules.values() if c is not None]))
    return modules, params


def runs_hooks(*modules: torch.nn.Module) -> bool:
    """Whether calling any of `modules` runs hooks besides its forward: its own forward (pre-)hooks
    or backward (pre-)hooks, or global module hooks (``nn.Module`` keeps both in private dicts; there
    is no public query). Code that computes modules' results without calling them asks this first."""
    nn_module = torch.nn.modules.module
    if (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
            or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in modules)


def held_elsewhere(t: torch.Tensor) -> bool:
    """Whether anything besides `t`'s own Python object holds its tensor (not just its storage): a
    view's base, or an autograd node that saved `t` as one of its inputs (``x * x`` saves ``x``
    itself, so swapping ``x.data`` changes what that node's backward reads). Torch without the
    private count: assume it is held."""
    use_count = getattr(t, "_use_count", None)
    return use_count is None or use_count() > 1


# torch.mm(..., out_dtype=) (the "dtype" overload of aten::mm) runs on CUDA only, in newer torch
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def mm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 16-bit operands as a float32 result, not rounded to 16 bits: on CUDA cuBLAS's
    float32 accumulator written out as is; elsewhere an exact upcast of the operands."""
    if a.is_cuda and _MM_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float().mm(b.float())


def module_buffers(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """The buffers `modules` hold themselves (not their children's: the caller lists those), read
    from ``nn.Module``'s private dict without the per-module generator of ``buffers()``."""
    return [b for m in modules for b in m._buffers.values() if b is not None]


def persistent_buffers(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """The buffers `modules` hold themselves that a ``state_dict`` saves (not those registered with
    ``persistent=False``), read from ``nn.Module``'s private dicts as `module_buffers` does."""
    return [b for m in modules for name, b in m._buffers.items()
            if b is not None and name not in m._non_persistent_buffers_set]


def dcp_file_extents(metadata: Any) -> dict[str, tuple[int, list[str]]]:
    """The files of a ``torch.distributed.checkpoint`` directory that its `metadata` (``FileSystemReader
    .read_metadata()``) points into: ``{relative path: (bytes its entries need, their names)}``, from
    ``metadata.storage_data``, whose values are the filesystem storage's private ``_StorageInfo``
    (relative_path, offset, length); {} where a storage keeps other records."""
    ends: dict[str, int] = {}
    names: dict[str, dict[str, None]] = {}  # in the metadata's order, each name once (a sharded entry has several chunks)
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        path, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if not isinstance(path, str) or not isinstance(offset, int) or not isinstance(length, int):
            return {}
        ends[path] = max(ends.get(path, 0), offset + length)
        names.setdefault(path, {})[getattr(index, "fqn", str(index))] = None
    return {path: (end, list(names[path])) for path, end in ends.items()}


def dcp_host_shard(value: Any, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """A new tensor in host memory (not pinned, of `dtype`, default the DTensor's: DCP casts) that
    DCP reads the local shard of the DTensor `value` into, or None where this torch cannot (it
    reads a shard into a DTensor only, on the DTensor's device). DCP's ``CheckpointableTensor`` protocol (recent: torch 2.14 has it): a plain
    tensor whose attributes say which chunk of the whole it is, taken from the DTensor's own
    ``__create_chunk_list__`` (what DCP reads into it); the isinstance check at the end refuses a
    protocol whose attributes are named otherwise."""
    try:
        from torch.distributed.checkpoint.protocol import CheckpointableTensor
    except ImportError:
        return None
    try:
        chunks = value.__create_chunk_list__()
    except Exception:  # noqa: BLE001 - a Partial placement, a local tensor of another kind: DCP's own reading
        return None
    local = value.to_local()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):  # e.g. a padded local tensor
        return None
    staged = torch.empty(tuple(local.shape), dtype=dtype or local.dtype, device="cpu")
    staged.global_shape = tuple(value.shape)
    staged.global_offsets = (tuple(chunks[0].offsets),)
    staged.local_offsets = ((0,) * staged.dim(),)
    staged.local_sizes = (tuple(local.shape),)
    return staged if isinstance(staged, CheckpointableTensor) else None


def outermost_module_call(frame: Any) -> torch.nn.Module | None:
    """The module of the outermost ``module(...)`` call on the stack above `frame` (a frame of
    torch's ``Module._call_impl``), None if none: which model's forward is running (a module's
    own methods, such as Lightning's ``training_step``, are no call)."""
    code, root = torch.nn.Module._call_impl.__code__, None
    while frame is not None:
        if frame.f_code is code:
            root = frame.f_locals.get("self")
        frame = frame.f_back
    return root


def grad_scaler_found_inf(scaler: Any, optimizer: Any, device: torch.device) -> dict[torch.device, torch.Tensor]:
    """``scaler.unscale_(optimizer)`` unless already done since the last ``update()``; returns the
    optimizer's found-inf flags by device (``scaler._per_optimizer_states``), which ``step`` and
    ``update`` read, so a caller may overwrite them in place. A scaler whose ``scale()`` never ran
    here (a pipeline rank without the loss) first gets its scale on `device` (torch inits it lazily in
    ``scale()``, and ``unscale_`` asserts it). GradScaler has no public way to read or set the flags."""
    from torch.amp.grad_scaler import OptState

    needed = ("_per_optimizer_states", "_scale", "_lazy_init_scale_growth_tracker")
    missing = [name for name in needed if not hasattr(scaler, name)]
    if missing:
        raise RuntimeError(f"zbpp.runtime.unscale_ reads torch.amp.GradScaler's {', '.join(missing)}, which this "
                           f"{type(scaler).__name__} (torch {torch.__version__}) lacks: found-inf flags cannot be "
                           "agreed over the pipeline; update zbpp._compat.grad_scaler_found_inf for it")
    if scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(device)
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is not OptState.UNSCALED:
        scaler.unscale_(optimizer)  # raises torch's error after step()
    return state["found_inf_per_device"]


def scheduler_parts(scheduler: Any) -> list[Any]:
    """The schedulers that a ``SequentialLR`` or ``ChainedScheduler`` runs, in order (torch keeps
    them in ``_schedulers``, and its ``load_state_dict`` loads the saved states into them by
    position, unchecked); none for any other scheduler."""
    parts = getattr(scheduler, "_schedulers", None)
    return list(parts) if isinstance(parts, (list, tuple)) else []
