"""FP8 casts fused with the operation that produces the tensor: norm, activation, its gradient.

Each function returns what the unfused reference computes: the operation in torch (`_norm`,
`_activations`), rounded to the input's dtype, then `fp8.quantize` (or
`fp8.quantize_and_column_sum`) of that tensor with the slot's scale, stepping its history. On an
sm_90 GPU with the Triton cast path on (``ZBPP_FP8_CAST`` unset or ``triton``), a bfloat16 input
runs one fused kernel of `_fused_triton` instead, which writes the FP8 bytes (and transpose, amax,
update) without the intermediate bfloat16 tensor; ``ZBPP_FP8_FUSE=0`` turns only the fusions off.
A fused kernel that fails is switched off with one warning (``fp8``'s rule) and the reference
takes over. `fused_path_counts` says which ran.

How close the paths are: the kernels compute each value with the reference's float32 operations
except the exponentials of the sigmoids and the order of the norm's row sums and of the column
sums, so the FP8 bytes agree except where those few float32 ulps move a value across a bfloat16
or FP8 rounding boundary: then they are one FP8 code apart (the tests check both).

>>> import torch
>>> from zbpp.modules.fp8 import DelayedScaling, ScalingMeta
>>> meta = ScalingMeta(torch.float8_e4m3fn, history_len=2)
>>> q = act_quantize(torch.tensor([[-1.0, 0.5, 2.0]]), ACTIVATIONS["relu"], meta,
...                  DelayedScaling(amax_history_len=2), transpose=True)
>>> q.dequantize().tolist(), meta.amax_history.tolist()
([[0.0, 0.5, 2.0]], [2.0, 0.0])
"""

from __future__ import annotations

import os
import sys

import torch

from ._activations import ACTIVATIONS, Activation
from ._norm import norm_reference
from .fp8 import cast
from .fp8.cast import DelayedScaling, Quantized, ScalingMeta, quantize, quantize_and_column_sum
from .fp8.counts import FUSED_COUNTS as _counts
from .fp8.counts import fused_path_counts, reset_fused_path_counts

__all__ = [
    "norm_quantize",
    "act_quantize",
    "dact_quantize",
    "fused_path_counts",
    "reset_fused_path_counts",
    "FUSE_ENV",
    "ACTIVATIONS",
]

FUSE_ENV = "ZBPP_FP8_FUSE"
_PACKAGE = sys.modules[__package__]  # zbpp.modules, whose attribute the kernel module becomes


def _kernels(x: torch.Tensor, meta: ScalingMeta):
    """`_fused_triton` when a fused kernel may cast `x` into `meta`'s slot, else None."""
    if not cast.on_cuda(x) or os.environ.get(FUSE_ENV, "1").strip() == "0":
        return None
    if cast.one_launch_kernels(x, also="fused") is None:
        return None
    # what `from . import _fused_triton` finds, without the import machinery once it is imported
    kernels = getattr(_PACKAGE, "_fused_triton", None)
    if kernels is None:
        from . import _fused_triton as kernels

    history = meta.amax_history
    suits = (
        x.dtype in kernels.INPUT_DTYPES
        and x.dim() == 2
        and x.numel() > 0
        and x.stride(1) == 1
        and meta.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        and meta.scale.device == x.device
        and history.device == x.device
        and history.is_contiguous()
        and history.numel() <= kernels.MAX_FUSED_HISTORY
    )
    return kernels if suits else None


def _ran_fused(kind: str) -> None:
    _counts.add(f"{kind}_triton")
    cast.count_one_launch()  # a fused cast is a Triton cast with its update


def norm_quantize(
    x: torch.Tensor,
    normalization: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    meta: ScalingMeta,
    recipe: DelayedScaling,
    *,
    transpose: bool,
) -> tuple[Quantized, torch.Tensor | None, torch.Tensor]:
    """``(quantize(norm(x)), mean, rstd)`` for 2-D `x` (``mean`` None for RMSNorm; both
    float32 [rows, 1]: what ``_norm.norm_backward`` takes)."""
    meta.fit(recipe)
    kernels = _kernels(x, meta)
    if kernels is not None and weight.dtype == x.dtype and weight.is_contiguous() and (
        bias is None or (bias.dtype == x.dtype and bias.is_contiguous())
    ):
        try:
            data, data_t, scale_inv, mean, rstd = kernels.norm_cast_update(
                x, weight.detach(), None if bias is None else bias.detach(), eps,
                normalization == "RMSNorm", meta.scale, meta.amax_history,
                meta.fused_workspace(), meta.fp8_max, meta.dtype, transpose,
                **meta.rule_args(recipe),
            )
        except Exception as err:  # noqa: BLE001 - the reference is correct too
            cast.mark_failed("fused", err)
        else:
            _ran_fused("norm")
            return Quantized(data, scale_inv, data_t), mean, rstd
    _counts.add("norm_eager")
    y, mean, rstd = norm_reference(x, normalization, weight.detach(),
                                   None if bias is None else bias.detach(), eps)
    return quantize(y, meta, recipe, transpose=transpose), mean, rstd


def act_quantize(
    h: torch.Tensor,
    act: Activation,
    meta: ScalingMeta,
    recipe: DelayedScaling,
    *,
    transpose: bool,
) -> Quantized:
    """``quantize(act.forward(h))`` for 2-D `h`."""
    meta.fit(recipe)
    kernels = _kernels(h, meta)
    if kernels is not None:
        try:
            data, data_t, scale_inv = kernels.act_cast_update(
                h, act.kernel_id, act.glu, meta.scale, meta.amax_history,
                meta.fused_workspace(), meta.fp8_max, meta.dtype, transpose,
                **meta.rule_args(recipe),
            )
        except Exception as err:  # noqa: BLE001 - the reference is correct too
            cast.mark_failed("fused", err)
        else:
            _ran_fused("act")
            return Quantized(data, scale_inv, data_t)
    _counts.add("act_eager")
    return quantize(act.forward(h), meta, recipe, transpose=transpose)


def dact_quantize(
    grad: torch.Tensor,
    h: torch.Tensor,
    act: Activation,
    meta: ScalingMeta,
    recipe: DelayedScaling,
    *,
    transpose: bool,
    column_sum: bool,
) -> tuple[Quantized, torch.Tensor | None]:
    """``(quantize(act.backward(grad, h)), its column sums or None)`` for 2-D `grad` and `h`:
    the column sums (a bias gradient, in h's dtype) as `fp8.quantize_and_column_sum` gives them."""
    meta.fit(recipe)
    kernels = _kernels(h, meta)
    if kernels is not None and grad.dtype == h.dtype and grad.stride(1) == 1:
        try:
            data, data_t, scale_inv, sums = kernels.dact_cast_update(
                grad, h, act.kernel_id, act.glu, meta.scale, meta.amax_history,
                meta.fused_workspace(), meta.fp8_max, meta.dtype, transpose, column_sum,
                **meta.rule_args(recipe),
            )
        except Exception as err:  # noqa: BLE001 - the reference is correct too
            cast.mark_failed("fused", err)
        else:
            _ran_fused("dact")
            total = sums.sum(0).to(h.dtype) if sums is not None else None
            return Quantized(data, scale_inv, data_t), total
    _counts.add("dact_eager")
    dh = act.backward(grad, h)
    if column_sum:
        return quantize_and_column_sum(dh, meta, recipe, transpose=transpose)
    return quantize(dh, meta, recipe, transpose=transpose), None
