"""One FP8 cast of an input that several `Linear`s read (HF's q, k and v; gate and up).

Each GEMM has its own input slot, so three Linears fed the same tensor cast it three times, every
slot seeing the same amaxes in the same order: the same bytes three times, and on small
microbatches three launches of host time. Here a `Linear` whose slot is fresh (no cast yet), on
finding its input is the tensor whose cast the last forward made with a slot that was fresh too
(its only cast), under the same recipe, in the same call of the same model (the outermost
``module(...)`` call on the stack), *adopts* that slot: both held the same state, so from then
on one slot stands for both, as one slot stands for the fused q, k and v GEMM of a model that packs
them. A `Linear` whose input its shared slot has just cast, for another `Linear`, takes that cast
instead of casting again; any other call casts, stepping the slot. Where the `Linear`s sharing a
slot read the same tensors in the same order (q, k and v do, every forward), every output and
gradient is bit-identical to separate slots'. Another model's `Linear` reading the same tensor (a
teacher or EMA copy called after the student on the same batch) keeps its own slot: sharing
one would tie each model's FP8 state to the other's calls; so does a `Linear` called alone.
Models that one module's call runs together (a wrapper calling student and teacher) are one
model here. Where one later reads another tensor than the others, the slot's history holds the amaxes of both (a valid scale for each, as a packed GEMM's).

"The same tensor": contiguous, with the same address, size, last dimension, dtype, device and
version counter (an in-place write bumps it; a write through ``.data`` does not, as for the kept
weight casts, so do not write a layer's input that way between two Linears that read it), while
the last cast holds the tensor (its memory cannot serve another tensor meanwhile). A checkpoint
(`zbpp.runtime.save_checkpoint`) keeps which slots are shared (`_scaling_state`). The last cast is per thread; `forget_last_cast` drops it (`Pipeline` does
after every step, through ``release_step_caches``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator, NamedTuple

import torch
from torch import nn

from .._compat import outermost_module_call
from .fp8 import DelayedScaling, Quantized, ScalingMeta, quantize

__all__ = ["adopted_slot", "cast_input", "caller_of", "cast_by", "forget_last_cast", "last_cast_kept"]


class _LastCast(NamedTuple):
    source: torch.Tensor  # held, so that its memory cannot serve another tensor meanwhile
    key: tuple
    slot: ScalingMeta
    recipe: DelayedScaling
    result: Quantized
    takers: list[torch.Tensor]  # the weights of the GEMMs that read this cast (the caster's first)
    caller: nn.Module | None  # the model whose forward called the caster, when its slot was fresh


_last = threading.local()


def _key(x: torch.Tensor) -> tuple | None:
    # What identifies x's values as the held tensor's: None where no cast may be shared.
    if not x.is_contiguous() or x.dim() == 0 or x.is_inference():
        return None
    return (x.data_ptr(), x.numel(), x.shape[-1], x.dtype, x.device, x._version)


def _last_cast_of(x: torch.Tensor, recipe: DelayedScaling) -> _LastCast | None:
    last: _LastCast | None = getattr(_last, "cast", None)
    if last is None or (last.recipe is not recipe and last.recipe != recipe) \
            or last.source.data_ptr() != x.data_ptr():
        return None
    return last if last.key == _key(x) else None


def caller_of(layer: nn.Module) -> nn.Module | None:
    """The model whose forward calls `layer` now: the module of the outermost ``module(...)``
    call on the stack (`layer` itself when called alone; None when its forward is called
    directly). Only `Linear`s of one such call adopt each other's slots."""
    return outermost_module_call(sys._getframe(1))


@contextlib.contextmanager
def cast_by(caller: nn.Module | None) -> Iterator[None]:
    """Casts made in the block are `caller`'s GEMMs' (a fresh slot's first cast, which the next
    `Linear` of the same model call may adopt)."""
    _last.caller = caller
    try:
        yield
    finally:
        _last.caller = None


def adopted_slot(slot: ScalingMeta | None, x: torch.Tensor, recipe: DelayedScaling,
                 device: torch.device, caller: nn.Module | None) -> ScalingMeta | None:
    """The slot that just cast `x` when `slot` (this GEMM's input slot, None before its first
    FP8 forward) is fresh and may share it (see the module docstring), else None. `caller`: the
    model whose forward calls this GEMM's (`caller_of`)."""
    if slot is not None and slot.casts:
        return None
    last = _last_cast_of(x, recipe)
    if last is None or last.slot is slot or last.slot.casts != 1:
        return None
    if caller is None or last.caller is not caller:  # another model's GEMM
        return None
    shared = last.slot
    if shared.dtype != recipe.fwd_dtype or shared.amax_history.device != device:
        return None
    if shared.amax_history.numel() != recipe.amax_history_len:
        return None
    return shared


def cast_input(x: torch.Tensor, slot: ScalingMeta, recipe: DelayedScaling, transpose: bool,
               weight: torch.Tensor) -> Quantized:
    """``quantize(x, slot, recipe, transpose=transpose)`` for the GEMM of `weight`, or the cast
    `slot` has just made of `x` for another GEMM."""
    last = _last_cast_of(x, recipe)
    if last is not None and last.slot is slot and not any(w is weight for w in last.takers):
        last.takers.append(weight)
        q = last.result
        if transpose and q.data_t is None:  # transposed from the cast: the slot steps once per cast
            q = Quantized(q.data, q.scale_inv, q.data.t().contiguous())
        return q
    q = quantize(x, slot, recipe, transpose=transpose)
    key = _key(x)
    caller = getattr(_last, "caller", None)
    _last.cast = _LastCast(x, key, slot, recipe, q, [weight], caller) if key is not None else None
    return q


def forget_last_cast() -> None:
    """Drop this thread's last cast (and the tensors it holds)."""
    _last.cast = None


@contextlib.contextmanager
def last_cast_kept() -> Iterator[None]:
    """This thread's last cast as it is now, after the block (a measurement's casts are no
    step's: a Linear after it must not take or adopt what they made)."""
    last = getattr(_last, "cast", None)
    try:
        yield
    finally:
        _last.cast = last
