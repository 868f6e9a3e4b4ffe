"""Launch a Triton kernel through the compiled kernel itself once its launch was seen.

``kernel[grid](*args)`` goes through ``JITFunction.run``, which derives the kernel's
specialisation from every argument again on each call: about 25 µs of host time on an H200's host,
half of an FP8 cast's launch, and an eager FP8 step launches ~500 casts. `launch` keeps, per
launch key, the compiled kernel that ``JITFunction.run`` chose the first time and calls it
directly afterwards (``CompiledKernel[grid]``: Triton's own runner, with its launch hooks).

The key holds every argument's exact value, but a tensor's, for which its dtype and address
modulo 256 stand: Triton specialises a kernel on argument values (ints equal to 1 or divisible by
16), dtypes and pointer alignment (16 bytes), all of which the key determines, so the kernel found
under a key is the one Triton would pick. ``ZBPP_TRITON_DIRECT=0`` turns the cache off; a direct
call that fails turns it off for the process, with one warning (the launch then goes through
``JITFunction.run``).

>>> launch_counts()["direct"] >= 0
True
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

__all__ = ["launch", "launch_counts", "DIRECT_ENV"]

DIRECT_ENV = "ZBPP_TRITON_DIRECT"
_MAX_KEYS = 4096  # distinct shapes x kernels in one process; past it the cache starts again
_runners: dict[tuple, Any] = {}
_names: dict[int, tuple[str, ...]] = {}  # id(kernel) -> its parameter names
_state = {"off": os.environ.get(DIRECT_ENV, "1").strip() == "0", "direct": 0, "jit": 0}


def launch_counts() -> dict[str, int]:
    """How many launches went straight to a compiled kernel (``"direct"``) and how many through
    ``JITFunction.run`` (``"jit"``) so far."""
    return {"direct": _state["direct"], "jit": _state["jit"]}


def _arg_key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 256)
    return (type(a), a)


def launch(kernel: Any, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any], num_warps: int) -> None:
    """``kernel[grid](*args, **constexprs, num_warps=num_warps)``, on the current CUDA device; `args`
    start with a tensor on it (CPU tensors, as Triton's interpreter takes, always go through
    ``JITFunction.run``)."""
    device = args[0].get_device()
    if _state["off"] or device < 0:
        _state["jit"] += 1
        kernel[grid](*args, **constexprs, num_warps=num_warps)
        return
    key = (id(kernel), grid, num_warps, device, tuple(constexprs.items()), tuple(map(_arg_key, args)))
    runner = _runners.get(key)
    if runner is not None:
        names = _names[id(kernel)]
        try:
            runner(*args, *(constexprs[n] for n in names[len(args):]))
        except Exception as err:  # noqa: BLE001 - the JIT launch below is correct too
            _state["off"] = True
            warnings.warn(f"zbpp: a direct Triton launch failed ({type(err).__name__}: {err}); "
                          "launching through JITFunction.run from now on")
        else:
            _state["direct"] += 1
            return
    _state["jit"] += 1
    compiled = kernel[grid](*args, **constexprs, num_warps=num_warps)
    if _state["off"] or not hasattr(compiled, "function") or not hasattr(compiled, "__getitem__"):
        return  # not a compiled kernel (an asynchronous compilation's future): no direct calls
    if len(_runners) >= _MAX_KEYS:
        _runners.clear()
    _names.setdefault(id(kernel), tuple(kernel.arg_names))
    _runners[key] = compiled[(*grid, 1, 1)[:3]]  # Triton's runner reads three grid dimensions
