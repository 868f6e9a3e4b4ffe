"""FP8 the Transformer Engine way: a recipe, an autocast region, delayed scaling and FP8 GEMMs.

- `recipe`: `DelayedScaling` (the recipe), `Format`, and `fp8_autocast`, the region whose
  forwards run in FP8 (context state: per thread and per asyncio task);
- `cast`: the scaling slots (`ScalingMeta`), the FP8 tensor (`Quantized`), `quantize` and the
  choice between the Triton, compiled and eager cast paths;
- `gemm`: `fp8_gemm_nt`, through ``torch._scaled_mm`` or dequantised float32 operands;
- `counts`: the tallies behind `cast_path_counts`, `gemm_path_counts` and `fused_path_counts`.

Formats (``Format.HYBRID``, the default): tensors of the forward (inputs, weights) are cast to
float8 e4m3 (3 mantissa bits, max 448), gradients to float8 e5m2 (2 mantissa bits, max 57344);
``Format.E4M3`` uses e4m3 for both.

Delayed scaling: every FP8 tensor *slot* of a module (e.g. the input, the weight and the output
gradient of one GEMM) keeps an amax history (newest first) and a scale. A tensor is cast with the
slot's current scale as ``fp8(clamp(x * scale, -max, max))`` (clamped first: an out-of-range cast
gives NaN in some torch versions), then its amax is pushed into the history and the scale is
recomputed from the history, so each cast uses the amaxes of the slot's previous casts:

    scale = (fp8_max / amax) / 2**margin,  amax = max(history) ("max") or history[0] ("most_recent")

keeping the old scale when that amax is zero or not finite. One cast is one step of the history:
a module's forward steps its input and weight slots, its backward its gradient slot. A fresh slot
has scale 1 and an all-zero history.

Casts run through the Triton, compiled or eager path (``ZBPP_FP8_CAST``; see `cast`). The layers'
casts of a norm's, an activation's and an activation gradient's outputs are fused with those
operations on the triton path (``zbpp.modules._fused``; ``ZBPP_FP8_FUSE=0`` keeps them apart).

GEMMs: ``fp8_gemm_nt`` runs ``torch._scaled_mm`` when every dimension is a multiple of 16 (its
requirement on Hopper) and otherwise, or where ``_scaled_mm`` is refused, multiplies the
dequantised operands in float32. ``gemm_path_counts()`` says which path ran how often.

>>> import torch
>>> meta = ScalingMeta(torch.float8_e4m3fn, history_len=4)
>>> recipe = DelayedScaling(amax_history_len=4)
>>> q = quantize(torch.tensor([[1.0, -2.0]]), meta, recipe)   # cast with scale 1, then update
>>> q.dequantize().tolist(), meta.amax_history.tolist(), meta.scale.item()
([[1.0, -2.0]], [2.0, 0.0, 0.0, 0.0], 224.0)
"""

from __future__ import annotations

from .cast import (
    CAST_ENV,
    CAST_PATHS,
    Quantized,
    ScalingMeta,
    cast_path_counts,
    quantize,
    quantize_and_column_sum,
    reset_cast_path_counts,
)
from .counts import fused_path_counts, reset_fused_path_counts
from .gemm import fp8_gemm_nt, gemm_path_counts, reset_gemm_path_counts
from .recipe import DelayedScaling, Format, active_recipe, fp8_autocast

__all__ = [
    "Format",
    "DelayedScaling",
    "fp8_autocast",
    "active_recipe",
    "ScalingMeta",
    "Quantized",
    "quantize",
    "quantize_and_column_sum",
    "fp8_gemm_nt",
    "gemm_path_counts",
    "reset_gemm_path_counts",
    "cast_path_counts",
    "reset_cast_path_counts",
    "fused_path_counts",
    "reset_fused_path_counts",
]
