"""Rigorous elementwise error bounds for FP8 GEMMs, computed in float64 (used by test_fp8.py).

Casting: a value x cast with scale s to a float8 format with p mantissa bits is
``q = fp8(clamp(fl32(x*s)))``, dequantised as ``q * fl32(1/s)``. For a normal result the cast
rounds to nearest with relative error at most u = 2^-(p+1) (e4m3: 2^-4, e5m2: 2^-3); in the
subnormal range the absolute error is at most half the subnormal spacing (e4m3: 2^-10,
e5m2: 2^-17) in scaled units, i.e. that over s in real units. The float32 product and reciprocal
add at most 3 units of 2^-24 relative; we allow 2^-21. Hence, elementwise,

    |x_hat - x| <= (u + 2^-21) |x| + (eta / s) (1 + 2^-20)                             (1)

(clamping never triggers in the tests: the scales are calibrated on the same data, so |x s| is at
most fp8_max up to one float32 rounding, which (1) already covers).

GEMM: for C = A B with |A_hat - A| <= eA and |B_hat - B| <= eB elementwise,

    |C_hat - C| <= eA |B|~ + |A| eB + gamma_K |A|~ |B|~ ,  |.|~ = |.| + e.              (2)

with float32 accumulation gamma_K = K 2^-24 / (1 - K 2^-24) (Higham, Accuracy and Stability of
Numerical Algorithms, 2nd ed., eq. 3.4), then u_out (|C| + E) for rounding the result to the output
dtype (float32 2^-24, bfloat16 2^-8) and once more for adding a bias. Relative to |A||B|, (2) is
u_a + u_b + u_a u_b plus small terms: 12.9% for e4m3 x e4m3 (forward), 19.5% for e5m2 x e4m3
(gradients), before subnormal and rounding terms.
"""

from __future__ import annotations

import torch

U = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
HALF_SUBNORMAL = {torch.float8_e4m3fn: 2.0**-10, torch.float8_e5m2: 2.0**-17}
U_OUT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-53}


def cast_error(x: torch.Tensor, scale: float, dtype: torch.dtype, upstream=0.0) -> torch.Tensor:
    """Bound (1) on |cast(x_computed) - x_true| when |x_computed - x_true| <= upstream."""
    x = x.double().abs() + upstream
    return (U[dtype] + 2.0**-21) * x + HALF_SUBNORMAL[dtype] / scale * (1 + 2.0**-20) + upstream


def gamma(k: int, unit: float = 2.0**-24) -> float:
    return k * unit / (1 - k * unit)


def gemm_error(
    a: torch.Tensor,
    b: torch.Tensor,
    ea: torch.Tensor,
    eb: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    accumulation: float | None = None,
) -> torch.Tensor:
    """Bound (2) on |C_hat - (a @ b + bias)|, elementwise; `accumulation` overrides gamma_K."""
    a, b = a.double(), b.double()
    abs_a, abs_b = a.abs(), b.abs()
    acc = gamma(a.shape[-1]) if accumulation is None else accumulation
    err = ea @ (abs_b + eb) + abs_a @ eb + acc * (abs_a + ea) @ (abs_b + eb)
    c = a @ b
    err = err + U_OUT[out_dtype] * (c.abs() + err)
    if bias is not None:
        c = c + bias.double()
        err = err + U_OUT[out_dtype] * (c.abs() + err) + U_OUT[out_dtype] * bias.double().abs()
    return err
