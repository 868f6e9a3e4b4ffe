"""The FP8 GEMM: ``torch._scaled_mm`` where it runs, dequantised float32 operands elsewhere."""

from __future__ import annotations

import warnings

import torch

from ..._compat import scaled_mm
from .cast import Quantized
from .counts import PathCounts

__all__ = ["fp8_gemm_nt", "gemm_path_counts", "reset_gemm_path_counts"]

_counts = PathCounts(("scaled_mm", "dequantized"))
# Device types whose torch._scaled_mm raised once: they go straight to the fallback. Process-wide,
# as what it records is: whether this torch build and this device type offer the FP8 GEMM.
_refused: set[str] = set()


def gemm_path_counts() -> dict[str, int]:
    """How many FP8 GEMMs ran through ``"scaled_mm"`` and through ``"dequantized"`` so far."""
    return _counts.snapshot()


def reset_gemm_path_counts() -> None:
    """Set both `gemm_path_counts` to zero."""
    _counts.reset()


def fp8_gemm_nt(
    a: Quantized,
    b: Quantized,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    use_scaled_mm: bool = True,
    fast_accumulation: bool = False,
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` for row-major FP8 ``a`` [M, K] and ``b`` [N, K], in `out_dtype`.

    Runs ``torch._scaled_mm`` when `use_scaled_mm` and M, K, N are all multiples of 16, with
    partial sums promoted to float32 or, with `fast_accumulation`, kept in the tensor cores'
    reduced precision (faster on Hopper; CPUs accumulate in float32 either way); otherwise
    multiplies the dequantised operands in float32; ``torch.autocast`` changes neither.

    >>> import torch
    >>> one = Quantized(torch.ones(2, 3).to(torch.float8_e4m3fn), torch.tensor(0.5))
    >>> fp8_gemm_nt(one, one, out_dtype=torch.float32).tolist()
    [[0.75, 0.75], [0.75, 0.75]]
    """
    device = a.data.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        # the layers do not follow torch.autocast: it would run the float32 product (and CPU's
        # _scaled_mm, which computes through it) in its own dtype, another GEMM than outside it
        with torch.autocast(device, enabled=False):
            return fp8_gemm_nt(a, b, out_dtype=out_dtype, bias=bias, use_scaled_mm=use_scaled_mm,
                               fast_accumulation=fast_accumulation)
    a_data, b_data = a.data, b.data
    (m, k), (n, k2) = a_data.shape, b_data.shape
    if k != k2:
        raise ValueError(f"fp8_gemm_nt: inner dimensions differ: a is {m}x{k}, b is {n}x{k2}")
    aligned = m % 16 == 0 and k % 16 == 0 and n % 16 == 0
    if use_scaled_mm and aligned and (not _refused or a_data.device.type not in _refused):
        # _scaled_mm fuses the bias only for 16-bit outputs of the same dtype; add it after else.
        fuse_bias = bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32
        try:
            out = scaled_mm(
                a_data,
                b_data.t(),  # column-major [K, N], as cuBLASLt wants the second operand
                scale_a=a.scale_inv,
                scale_b=b.scale_inv,
                bias=bias if fuse_bias else None,
                out_dtype=out_dtype,
                use_fast_accum=fast_accumulation,
            )
        except (RuntimeError, NotImplementedError) as err:
            device = a_data.device.type
            _refused.add(device)
            warnings.warn(
                f"zbpp FP8: torch._scaled_mm refused on {device} ({err}); "
                "using dequantised float32 GEMMs there"
            )
        else:
            _counts.add("scaled_mm")
            if bias is not None and not fuse_bias:
                out = out + bias.to(out_dtype)
            return out
    _counts.add("dequantized")
    out = a.dequantize() @ b.dequantize().t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)
