"""Launch zbpp's Triton kernels with less host work than ``kernel[grid](...)``.

Each ``JITFunction.run`` binds every argument, specialises it and formats the whole
specialisation into a string to find the compiled kernel, at every launch: a large part of a
small cast's host time, a few hundred times a step at small microbatches
(``benchmarks/triton_launch_host.py`` measures both ways). `direct` wraps a ``triton.jit`` kernel
so that ``kernel[grid](*args, **constexprs)`` keeps its meaning but, after the first launch of a
specialisation, calls the compiled kernel's own launcher (``CompiledKernel.run``, what
``JITFunction.run`` ends with) straight away.

The compiled kernel is looked up by what Triton specialises on, computed here the way Triton
does: per tensor its dtype and whether its address is a multiple of 16; per int whether it is 1
(baked in), a multiple of 16, and its integer width; floats not at all; plus the device and the
keyword arguments (constexprs, ``num_warps``). This key is at least as fine as Triton's, so a
kernel is only reused for arguments Triton would have given it. The first launch of each key, any
launch while Triton's launch hooks are set (a profiler), under the interpreter, and everything
after a launch this way fails on a Triton whose kernels look otherwise, take ``JITFunction.run``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .._compat import cuda_raw_stream

__all__ = ["direct"]

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _spec(args: tuple) -> tuple | None:
    # What Triton's specialize_impl reads of each positional argument, flattened (a tensor gives
    # its dtype then its alignment; an int a code >= 2, never equal to a bool); None: a kind not
    # handled here. Exact types first: it runs at every launch, over every argument.
    out: list[Any] = []
    append = out.append
    for a in args:
        kind = type(a)
        if kind is int or (kind is not bool and isinstance(a, int)):
            append(2 + (a == 1) + 2 * (a % 16 == 0) + 4 * (_I32_MIN <= a <= _I32_MAX) + 8 * (a >= 2**63))
        elif kind is float or isinstance(a, float):
            append(float)
        elif kind is bool or a is None:
            append(a)
        elif isinstance(a, torch.Tensor):
            append(a.dtype)
            append(a.data_ptr() % 16 == 0)
        else:
            return None
    return tuple(out)


class _Direct:
    """A ``triton.jit`` kernel whose ``[grid](...)`` launches through the compiled kernel (see the
    module docstring)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        # names of the kernel's parameters, in order: the launcher takes every one (constexprs too)
        self._names = [p.name for p in getattr(fn, "params", ())]
        self._kernels: dict[tuple, tuple[Any, list[Any]]] = {}
        self._usable = bool(self._names) and _hooks_unset() is not None and not _interpreted()
        self.direct_launches = 0  #: launches that went through a compiled kernel directly (for tests)

    def __getitem__(self, grid: tuple) -> Callable[..., Any]:
        return functools.partial(self._launch, grid)

    def _launch(self, grid: tuple, *args: Any, **kwargs: Any) -> Any:
        if not (self._usable and _hooks_unset()):
            return self.fn[grid](*args, **kwargs)
        spec = _spec(args)
        device = torch.cuda.current_device()
        key = (device, spec, tuple(kwargs.items()))
        found = self._kernels.get(key) if spec is not None else None
        if found is None:
            kernel = self.fn[grid](*args, **kwargs)  # compiles if needed, and launches
            if spec is not None:
                self._remember(key, kernel, args, kwargs)
            return kernel
        kernel, constexprs = found
        g = tuple(grid) + (1, 1)
        try:
            kernel.run(g[0], g[1], g[2], cuda_raw_stream(device), kernel.function, kernel.packed_metadata,
                       None, None, None, *args, *constexprs)
        except (TypeError, AttributeError):  # a Triton whose launcher takes other arguments: launch as it does
            self._usable = False
            return self.fn[grid](*args, **kwargs)
        self.direct_launches += 1
        return kernel

    def _remember(self, key: tuple, kernel: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        # The launcher's arguments after `args`: the rest of the parameters (constexprs), in order.
        rest = self._names[len(args):]
        if not all(n in kwargs for n in rest) or not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
            self._usable = False
            return
        self._kernels[key] = (kernel, [kwargs[n] for n in rest])


def _hooks_unset() -> bool | None:
    """Whether Triton's launch hooks are unset (None: this Triton has no ``knobs`` to say)."""
    runtime = _runtime()
    if runtime is None:
        return None
    return _unset(runtime.launch_enter_hook) and _unset(runtime.launch_exit_hook)


@functools.lru_cache(maxsize=None)
def _runtime() -> Any:
    # triton.knobs.runtime (None on a Triton without knobs); looked up once, read at every launch
    import triton

    knobs = getattr(triton, "knobs", None)
    return None if knobs is None else knobs.runtime


def _interpreted() -> bool:
    # Triton decides at a kernel's decoration whether to interpret it; read once per kernel here
    # (the knob reads the environment at every access).
    runtime = _runtime()
    return bool(runtime is not None and getattr(runtime, "interpret", False))


def _unset(hook: Any) -> bool:
    # Newer Tritons keep each hook as a HookChain (never None) whose `calls` lists what was added.
    calls = getattr(hook, "calls", None)
    return hook is None or (isinstance(calls, list) and not calls)


def direct(fn: Any) -> Any:
    """`fn` (a ``triton.jit`` kernel) launched through its compiled kernels (see the module
    docstring); anything else as it is."""
    if fn is None or not hasattr(fn, "params"):
        return fn
    return _Direct(fn)
