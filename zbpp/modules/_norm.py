"""The normalisation in front of `LayerNormLinear` and `LayerNormMLP` (plain autograd)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._init import new_param

__all__ = ["NORMALIZATIONS", "make_norm_params", "normalize"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


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


def normalize(
    x: torch.Tensor,
    normalization: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """LayerNorm or RMSNorm over the last dimension; its gradients come with the backward (B)."""
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
