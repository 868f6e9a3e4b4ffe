"""The normalisation in front of `LayerNormLinear` and `LayerNormMLP`: forward and backward.

Both kinds normalise over the last dimension (n features) of a 2-D input, in float32, and round
once to the input's dtype:

- ``LayerNorm``: ``y = (x - mean) * rstd * w + b``, ``rstd = 1 / sqrt(var + eps)`` (biased var);
- ``RMSNorm``: ``y = x * rstd * w``, ``rstd = 1 / sqrt(mean(x^2) + eps)`` (no mean, no bias).

`norm_forward` also returns the statistics the backward needs (``mean`` is None for RMSNorm).
LayerNorm runs torch's own kernels (``native_layer_norm`` and its backward). `norm_reference` is
the definition the fused FP8 norm-and-cast kernel follows operation by operation: each product and
quotient an IEEE float32 operation, the sums in float32.

>>> import torch
>>> x = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
>>> y, mean, rstd = norm_forward(x, "RMSNorm", torch.ones(4), None, 0.0)
>>> mean is None, round(rstd.item() ** -2, 4)             # mean(x^2) = 50 / 4
(True, 12.5)
>>> dx, dw, db = norm_backward(torch.ones(1, 4), x, "RMSNorm", None, rstd, torch.ones(4), None)
>>> dx.shape, dw.shape, db is None
(torch.Size([1, 4]), torch.Size([4]), True)
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ._init import new_param

__all__ = [
    "NORMALIZATIONS",
    "make_norm_params",
    "norm_forward",
    "norm_backward",
    "norm_reference",
]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")

# the overload itself: calling the packet resolves it in Python on every call
_layer_norm_backward = torch.ops.aten.native_layer_norm_backward.default


def make_norm_params(
    module: nn.Module,
    size: int,
    normalization: str,
    *,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> None:
    """Register ``layer_norm_weight`` (ones) and, for LayerNorm, ``layer_norm_bias`` (zeros)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            f"{type(module).__name__}: normalization={normalization!r}; use one of "
            f"{NORMALIZATIONS}"
        )
    module.layer_norm_weight = new_param((size,), init=1.0, dtype=dtype, device=device)
    if normalization == "LayerNorm":
        module.layer_norm_bias = new_param((size,), init=0.0, dtype=dtype, device=device)
    else:
        module.register_parameter("layer_norm_bias", None)


def norm_forward(
    x: torch.Tensor,
    normalization: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(y, mean, rstd)`` of 2-D `x` (``mean`` None for RMSNorm)."""
    if normalization == "LayerNorm":
        return torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return norm_reference(x, normalization, weight, bias, eps)


def norm_reference(
    x: torch.Tensor,
    normalization: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`norm_forward` in explicit float32 operations, in the fused kernel's order.

    Each product, quotient and square root is correctly rounded (the row statistics' quotients
    and roots go through float64, whose extra precision makes one float32 rounding of the exact
    value: torch's float32 sqrt on CPUs is not always correctly rounded); only the order of the
    float32 row sums is left open.
    """
    n = x.shape[-1]
    x32 = _opmath(x)
    w32 = _opmath(weight)
    if normalization == "LayerNorm":
        mean = _over(x32.sum(-1, keepdim=True), n)
        d = x32 - mean
        rstd = _rsqrt(_over((d * d).sum(-1, keepdim=True), n) + eps)
        y = (d * rstd) * w32
        if bias is not None:
            y = y + _opmath(bias)
        return y.to(x.dtype), mean, rstd
    rstd = _rsqrt(_over((x32 * x32).sum(-1, keepdim=True), n) + eps)
    return ((x32 * rstd) * w32).to(x.dtype), None, rstd


def _opmath(t: torch.Tensor) -> torch.Tensor:
    # the precision a norm computes in: float32, or float64 for float64 tensors
    return t if t.dtype == torch.float64 else t.float()


def _over(total: torch.Tensor, n: int) -> torch.Tensor:
    # total / n, correctly rounded in total's dtype
    return (total.double() / n).to(total.dtype)


def _rsqrt(v: torch.Tensor) -> torch.Tensor:
    # 1 / sqrt(v) as two correctly rounded operations in v's dtype
    return (1.0 / v.double().sqrt().to(v.dtype).double()).to(v.dtype)


@functools.lru_cache(maxsize=None)
def _layer_norm_stat_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    # The dtype of the statistics torch's LayerNorm kernels keep for `dtype` inputs on a device
    # (float32 on CUDA; the input's own dtype on CPUs), which its backward insists on.
    probe = torch.ones(1, 1, dtype=dtype, device=device_type)
    return torch.native_layer_norm(probe, (1,), None, None, 1e-5)[1].dtype


def norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    normalization: str,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    needs: tuple[bool, bool, bool] = (True, True, True),
    *,
    stats_from_torch: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dweight, dbias)`` from the output gradient `dy` and the forward's statistics
    (float32 [rows, 1], as `norm_forward` returns them); `needs` says which of the three to
    compute (the others are None, as is dbias for RMSNorm). `stats_from_torch`: LayerNorm's
    statistics come from `norm_forward` on this `x`, so they have the dtype torch's backward
    takes."""
    need_dx, need_dw, need_db = needs
    n = x.shape[-1]
    if normalization == "LayerNorm":
        mask = [need_dx, need_dw, need_db and bias is not None]
        if not stats_from_torch:
            stat = _layer_norm_stat_dtype(x.device.type, x.dtype)
            if mean.dtype != stat:
                mean, rstd = mean.to(stat), rstd.to(stat)
        return _layer_norm_backward(dy, x, (n,), mean, rstd, weight, bias, mask)
    x_hat = _opmath(x) * rstd
    dy32 = _opmath(dy)
    dx = dw = None
    if need_dx:
        g = dy32 * _opmath(weight)
        c = (g * x_hat).sum(-1, keepdim=True) / n
        dx = (rstd * (g - x_hat * c)).to(x.dtype)
    if need_dw:
        dw = (dy32 * x_hat).sum(0).to(weight.dtype)
    return dx, dw, None

