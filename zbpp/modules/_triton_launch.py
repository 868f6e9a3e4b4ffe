"""Launch zbpp's Triton kernels with less host work than ``kernel[grid](...)``.

Each ``JITFunction.run`` binds every argument, specialises it (in Python for Triton 3.6) and
formats the whole specialisation into a string to find the compiled kernel: about 20 of the 40-60
microseconds a cast's launch costs on an H100's host (``.wt`` probe, docs/benchmarks.md "FP8
eager"), a few hundred times a step at small microbatches. `direct` wraps a ``triton.jit`` kernel
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

_I32 = (-(2**31), 2**31 - 1)


def _spec(args: tuple) -> tuple | None:
    # What Triton's specialize_impl reads of each positional argument; None: a kind not handled here.
    out: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or a is None:
            out.append(a)
        elif isinstance(a, int):
            out.append((a == 1, a % 16 == 0, _I32[0] <= a <= _I32[1], a >= 2**63))
        elif isinstance(a, float):
            out.append(float)
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
        self._usable = bool(self._names) and _hooks_unset() is not None
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
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is None or getattr(knobs.runtime, "interpret", False):
        return None
    runtime = knobs.runtime
    return _unset(runtime.launch_enter_hook) and _unset(runtime.launch_exit_hook)


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
