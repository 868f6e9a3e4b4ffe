"""Fused FP8 kernels in Triton: a normalisation, an activation or an activation's gradient, each
in the same pass as the delayed-scaling cast of its result.

Without fusion each of these writes a bfloat16 tensor that the FP8 cast then reads again; fused,
the value is formed in registers, rounded to bfloat16 there (so the FP8 bytes are those of casting
the unfused bfloat16 tensor) and cast by `_fp8_cast_triton`'s tile epilogue: FP8 data, its
transpose, the amax, optionally column sums (a bias gradient), and the slot's scale update in the
tile that finishes last. One launch per tensor, as ``cast_transpose_update``.

- ``norm_cast_update``: LayerNorm or RMSNorm of x [M, N], as `_norm.norm_reference` defines it
  (a small first kernel writes each row's float32 mean and rstd, which the backward also uses);
- ``act_cast_update``: an activation of h [M, F] (GLU: [M, 2F]) as `_activations` defines it;
- ``dact_cast_update``: the gradient of h from the gradient of the activation's output and h,
  with column sums (fc1's bias gradient).

Tiles are 64 x 128 (see `BLOCK_M`). Products and quotients that the torch
definition rounds separately are IEEE operations here too (``mul_rn``, ``div_rn``, ``sqrt_rn``),
so no FMA contraction changes them; the sigmoids' exponential and reciprocal (one approximate
MUFU instruction each, within 2 ulp, flushing results below 2^-126 to zero, which no FP8 cast of
these activations can see) and the order of the row sums are the only differences from the torch
definition on a GPU, a few float32 units in the last place before the bfloat16 rounding. Under
the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors) the kernels run with numpy's float32
arithmetic and software roundings; the tests compare them there with the torch definitions.
"""

from __future__ import annotations

import os

import torch

from ._fp8_cast_triton import INTERPRETED, MAX_FUSED_HISTORY, cdiv, next_power_of_2, on_device, tl, triton
from ._triton_launch import direct

__all__ = [
    "norm_cast_update",
    "act_cast_update",
    "dact_cast_update",
    "INPUT_DTYPES",
]

# bfloat16 only: the value is rounded to the input's dtype in the kernel (the interpreter's
# software rounding covers bfloat16), and FP8 training keeps its activations in bfloat16.
INPUT_DTYPES = (torch.bfloat16,)
# 64 x 128 tiles, 4 warps: 64 values per thread, enough to spread each row's loads over; these
# kernels are bound by instruction issue as much as by memory (docs/benchmarks.md, "Constants").
# ZBPP_FUSED_TILE (rows x columns x warps, e.g. 64x64x4) picks another tile.
BLOCK_M = 64
BLOCK_N = 128
NUM_WARPS = 4
TILE_ENV = "ZBPP_FUSED_TILE"
STATS_BLOCK = 2048  # columns per step of the row-statistics kernel
STATS_ELEMENTS = 4096  # rows x columns per step: short rows share a program

if triton is not None:
    # (tensor first in products with these: under the interpreter constexpr * tensor fails)
    _GELU_K = tl.constexpr(1.5957691216057308)  # 2 sqrt(2/pi): gelu's sigmoid of x (K + KC x^2)
    _GELU_KC = tl.constexpr(0.07135481627260025)  # 2 sqrt(2/pi) * 0.044715
    _QUICK = tl.constexpr(1.702)  # quick gelu's sigmoid slope
    _NEG_LOG2E = tl.constexpr(-1.4426950408889634)  # exp(-z) = 2^(z * -log2(e))

    from ._fp8_cast_triton import (
        cast_store_tile,
        div_rn,
        finish_cast,
        mul_rn,
        ptx_f32,
        rcp_rn,
        round_bf16,
        tile_sum,
    )

    @triton.jit
    def _exp2_fast(x):
        # 2^x in one MUFU.EX2 (ex2.approx.ftz: within 2 ulp, as Triton's exp; results below 2^-126
        # flush to zero instead of going through the denormal fix-up that ex2.approx.f32 costs in
        # this compute-bound kernel)
        if INTERPRETED:
            return tl.exp2(x)
        else:
            return ptx_f32("ex2.approx.ftz.f32 $0, $1;", x)

    @triton.jit
    def _rcp_fast(x):
        # 1 / x in one MUFU.RCP (rcp.approx.ftz: within 1 ulp; ``/`` is div.full.f32, which adds
        # range checks around the same approximation)
        if INTERPRETED:
            return 1.0 / x
        else:
            return ptx_f32("rcp.approx.ftz.f32 $0, $1;", x)

    @triton.jit
    def _sigmoid(z):
        # 1 / (1 + exp(-z)): exp(-z) = inf for z << 0 gives 0, exp(-z) = 0 for z >> 0 gives 1, a
        # NaN gives NaN, so no branch is needed (the forward's values only)
        return _rcp_fast(1.0 + _exp2_fast(z * _NEG_LOG2E))

    @triton.jit
    def _sigmoid_and_slope(z):
        # sigmoid(z) and sigmoid'(z) = sigmoid(z) sigmoid(-z) from t = exp(-|z|) <= 1: no overflow
        # and no cancellation for any z (a NaN z gives NaNs).
        t = _exp2_fast(tl.abs(z) * _NEG_LOG2E)
        r = _rcp_fast(1.0 + t)
        s = tl.where(z >= 0, r, t * r)
        return s, t * r * r

    @triton.jit
    def _act(x, ACT: tl.constexpr):
        """f(x) in float32 (ids as in `_activations`)."""
        if ACT == 0:  # gelu (tanh approximation) = x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))
            return x * _sigmoid(x * (x * x * _GELU_KC + _GELU_K))
        elif ACT == 1:  # quick gelu
            return x * _sigmoid(x * _QUICK)
        elif ACT == 2:  # relu, as torch: -0 and NaN pass through
            return tl.where(x < 0, 0.0, x)
        elif ACT == 3:  # squared relu
            r = tl.where(x < 0, 0.0, x)
            return mul_rn(r, r)
        else:  # silu
            return x * _sigmoid(x)

    @triton.jit
    def _act_grad(grad, x, ACT: tl.constexpr):
        """grad * f'(x) in float32."""
        if ACT == 0:
            z = x * (x * x * _GELU_KC + _GELU_K)
            s, ds = _sigmoid_and_slope(z)
            return grad * (s + x * ds * (x * x * (3.0 * _GELU_KC) + _GELU_K))
        elif ACT == 1:
            s, ds = _sigmoid_and_slope(x * _QUICK)
            return grad * (s + x * ds * _QUICK)
        elif ACT == 2:  # threshold_backward(grad, x, 0)
            return tl.where(x <= 0, 0.0, grad)
        elif ACT == 3:
            return mul_rn(grad, 2.0 * tl.where(x < 0, 0.0, x))
        else:
            s, ds = _sigmoid_and_slope(x)
            return grad * (s + x * ds)

    @triton.jit
    def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # this program's tile of an [M, N] grid: rows, columns (int32), their masks, and its
        # row-tile index
        pid = tl.program_id(0)
        tiles_n = (N + BLOCK_N - 1) // BLOCK_N
        row_tile = pid // tiles_n
        rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        return rows, cols, rows < M, cols < N, row_tile

    @direct
    @triton.jit
    def _norm_stats_kernel(
        x_ptr,
        mean_ptr,  # float32 [M] (LayerNorm only)
        rstd_ptr,  # float32 [M]
        M,
        N,
        n_float,  # N as a float32 (an int argument may arrive as a compile-time constant)
        stride_m,
        stride_n,
        eps,
        RMS: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # ROWS rows per program, two passes over them (the mean, then the centred squares; one
        # pass for RMSNorm), BLOCK columns at a time.
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        base = x_ptr + rows.to(tl.int64)[:, None] * stride_m
        acc = tl.full([ROWS, BLOCK], 0.0, tl.float32)
        mean = tl.full([ROWS], 0.0, tl.float32)
        if not RMS:
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inside = row_ok[:, None] & (cols < N)[None, :]
                acc += tl.load(base + cols.to(tl.int64)[None, :] * stride_n, mask=inside,
                               other=0.0).to(tl.float32)
            mean = div_rn(tile_sum(acc, 1), n_float)
            tl.store(mean_ptr + rows, mean, mask=row_ok)
            acc = tl.full([ROWS, BLOCK], 0.0, tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = row_ok[:, None] & (cols < N)[None, :]
            x = tl.load(base + cols.to(tl.int64)[None, :] * stride_n, mask=inside,
                        other=0.0).to(tl.float32)
            d = tl.where(inside, x - mean[:, None], 0.0)
            acc += mul_rn(d, d)
        var = div_rn(tile_sum(acc, 1), n_float)
        tl.store(rstd_ptr + rows, rcp_rn(tl.sqrt_rn(var + eps)), mask=row_ok)

    @direct
    @triton.jit
    def _norm_cast_kernel(
        x_ptr,
        mean_ptr,
        rstd_ptr,
        w_ptr,
        b_ptr,  # LayerNorm's bias (HAS_BIAS only)
        scale_ptr,
        data_ptr,
        data_t_ptr,
        amax_bits_ptr,
        history_ptr,
        scale_inv_ptr,
        M,
        N,
        stride_m,
        stride_n,
        fp8_max,
        history_len,
        factor,
        RMS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        E5M2: tl.constexpr,
        TRANSPOSE: tl.constexpr,
        MOST_RECENT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        rows, cols, row_ok, col_ok, _ = _tile(M, N, BLOCK_M, BLOCK_N)
        r64 = rows.to(tl.int64)
        c64 = cols.to(tl.int64)
        inside = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + r64[:, None] * stride_m + c64[None, :] * stride_n, mask=inside,
                    other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r64, mask=row_ok, other=0.0)
        w = tl.load(w_ptr + c64, mask=col_ok, other=0.0).to(tl.float32)
        if RMS:
            v = mul_rn(x, rstd[:, None])
        else:
            mean = tl.load(mean_ptr + r64, mask=row_ok, other=0.0)
            v = mul_rn(x - mean[:, None], rstd[:, None])
        y = mul_rn(v, w[None, :])
        if HAS_BIAS:
            y = y + tl.load(b_ptr + c64, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y = tl.where(inside, round_bf16(y), 0.0)
        bits = cast_store_tile(
            y, row_ok, col_ok, r64, c64, tl.load(scale_ptr), fp8_max,
            data_ptr, data_t_ptr, N, M, scale_ptr,
            E5M2=E5M2, TRANSPOSE=TRANSPOSE, COLUMN_SUMS=False,
        )
        finish_cast(
            amax_bits_ptr, bits, history_ptr, scale_ptr, scale_inv_ptr, history_len, factor,
            UPDATE=True, MOST_RECENT=MOST_RECENT, BLOCK_H=BLOCK_H,
        )

    @direct
    @triton.jit
    def _act_cast_kernel(
        h_ptr,  # [M, F] or, GLU, [M, 2F] = [gate, up]; unit column stride
        scale_ptr,
        data_ptr,  # uint8 [M, F]
        data_t_ptr,  # uint8 [F, M]
        amax_bits_ptr,
        history_ptr,
        scale_inv_ptr,
        M,
        F,
        stride_m,
        fp8_max,
        history_len,
        factor,
        ACT: tl.constexpr,
        GLU: tl.constexpr,
        E5M2: tl.constexpr,
        TRANSPOSE: tl.constexpr,
        MOST_RECENT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        rows, cols, row_ok, col_ok, _ = _tile(M, F, BLOCK_M, BLOCK_N)
        r64 = rows.to(tl.int64)
        c64 = cols.to(tl.int64)
        inside = row_ok[:, None] & col_ok[None, :]
        at = h_ptr + r64[:, None] * stride_m + c64[None, :]
        a = _act(tl.load(at, mask=inside, other=0.0).to(tl.float32), ACT)
        if GLU:
            a = mul_rn(a, tl.load(at + F, mask=inside, other=0.0).to(tl.float32))
        # masked lanes loaded 0 and every activation maps 0 to 0 (a GLU multiplies by 0): they
        # hold the zeros `cast_store_tile` needs without a select per value
        a = round_bf16(a)
        bits = cast_store_tile(
            a, row_ok, col_ok, r64, c64, tl.load(scale_ptr), fp8_max,
            data_ptr, data_t_ptr, F, M, scale_ptr,
            E5M2=E5M2, TRANSPOSE=TRANSPOSE, COLUMN_SUMS=False,
        )
        finish_cast(
            amax_bits_ptr, bits, history_ptr, scale_ptr, scale_inv_ptr, history_len, factor,
            UPDATE=True, MOST_RECENT=MOST_RECENT, BLOCK_H=BLOCK_H,
        )

    @direct
    @triton.jit
    def _dact_cast_kernel(
        grad_ptr,  # [M, F]: the gradient of the activation's output; unit column stride
        h_ptr,  # [M, F] or, GLU, [M, 2F]; unit column stride
        scale_ptr,
        data_ptr,  # uint8 [M, W], W = F (2F for GLU)
        data_t_ptr,  # uint8 [W, M]
        column_sums_ptr,  # float32 [row tiles, W] (COLUMN_SUMS only)
        amax_bits_ptr,
        history_ptr,
        scale_inv_ptr,
        M,
        F,
        stride_grad,
        stride_h,
        fp8_max,
        history_len,
        factor,
        ACT: tl.constexpr,
        GLU: tl.constexpr,
        E5M2: tl.constexpr,
        TRANSPOSE: tl.constexpr,
        COLUMN_SUMS: tl.constexpr,
        MOST_RECENT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        rows, cols, row_ok, col_ok, row_tile = _tile(M, F, BLOCK_M, BLOCK_N)
        r64 = rows.to(tl.int64)
        c64 = cols.to(tl.int64)
        inside = row_ok[:, None] & col_ok[None, :]
        grad = tl.load(grad_ptr + r64[:, None] * stride_grad + c64[None, :], mask=inside,
                       other=0.0).to(tl.float32)
        at = h_ptr + r64[:, None] * stride_h + c64[None, :]
        x = tl.load(at, mask=inside, other=0.0).to(tl.float32)
        width = 2 * F if GLU else F
        sums_at = column_sums_ptr + row_tile.to(tl.int64) * width
        scale = tl.load(scale_ptr)
        if GLU:
            up = tl.load(at + F, mask=inside, other=0.0).to(tl.float32)
            # masked lanes: grad = 0 there, so both are 0 (see _act_cast_kernel)
            d_gate = round_bf16(_act_grad(mul_rn(grad, up), x, ACT))
            d_up = round_bf16(mul_rn(grad, _act(x, ACT)))
            bits = cast_store_tile(
                d_gate, row_ok, col_ok, r64, c64, scale, fp8_max,
                data_ptr, data_t_ptr, width, M, sums_at,
                E5M2=E5M2, TRANSPOSE=TRANSPOSE, COLUMN_SUMS=COLUMN_SUMS,
            )
            bits = tl.maximum(bits, cast_store_tile(
                d_up, row_ok, col_ok, r64, c64 + F, scale, fp8_max,
                data_ptr, data_t_ptr, width, M, sums_at,
                E5M2=E5M2, TRANSPOSE=TRANSPOSE, COLUMN_SUMS=COLUMN_SUMS,
            ))
        else:
            dh = round_bf16(_act_grad(grad, x, ACT))  # 0 on masked lanes, where grad = 0
            bits = cast_store_tile(
                dh, row_ok, col_ok, r64, c64, scale, fp8_max,
                data_ptr, data_t_ptr, width, M, sums_at,
                E5M2=E5M2, TRANSPOSE=TRANSPOSE, COLUMN_SUMS=COLUMN_SUMS,
            )
        finish_cast(
            amax_bits_ptr, bits, history_ptr, scale_ptr, scale_inv_ptr, history_len, factor,
            UPDATE=True, MOST_RECENT=MOST_RECENT, BLOCK_H=BLOCK_H,
        )


def _float32(value: float) -> float:
    # a float argument is a float32 in the kernel; round it the way torch rounds a Python scalar
    # added to a float32 tensor (the interpreter would otherwise keep the double)
    return torch.tensor(value, dtype=torch.float32).item()


def _check_slot(history: torch.Tensor) -> int:
    if not 1 <= history.numel() <= MAX_FUSED_HISTORY:
        raise ValueError(
            f"fused FP8 cast: history length {history.numel()}; need 1..{MAX_FUSED_HISTORY}"
        )
    return max(16, next_power_of_2(history.numel()))


def _outputs(m: int, n: int, dtype: torch.dtype, transpose: bool, device: torch.device):
    data = torch.empty((m, n), dtype=dtype, device=device)
    data_t = torch.empty((n, m), dtype=dtype, device=device) if transpose else None
    return data, data_t, torch.empty((), dtype=torch.float32, device=device)


def tile() -> tuple[int, int, int]:
    """(rows, columns, warps) of the tiles: `BLOCK_M`, `BLOCK_N`, `NUM_WARPS` unless
    ``ZBPP_FUSED_TILE`` (e.g. ``64x32x4``, powers of two) says otherwise."""
    value = os.environ.get(TILE_ENV, "").strip()
    if not value:
        return BLOCK_M, BLOCK_N, NUM_WARPS
    try:
        m, n, w = (int(v) for v in value.lower().split("x"))
    except ValueError:
        m = n = w = 0
    if not all(v > 0 and v & (v - 1) == 0 for v in (m, n, w)):
        raise ValueError(f"{TILE_ENV}={value!r}; use rows x columns x warps, powers of two, "
                         "e.g. 64x64x4")
    return m, n, w


def _grid(m: int, n: int, bm: int, bn: int) -> tuple[int]:
    return (cdiv(m, bm) * cdiv(n, bn),)


def _u8(data: torch.Tensor, data_t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return data.view(torch.uint8), (data_t if data_t is not None else data).view(torch.uint8)


def norm_cast_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    scale: torch.Tensor,
    history: torch.Tensor,
    workspace: torch.Tensor,
    fp8_max: float,
    dtype: torch.dtype,
    transpose: bool,
    *,
    factor: float,
    most_recent: bool,
):
    """``(data, data_t, scale_inv, mean, rstd)``: the FP8 cast of ``norm(x)`` for 2-D `x`.

    ``mean`` (None for RMSNorm) and ``rstd`` are float32 [M, 1], as ``torch.native_layer_norm``
    returns them. The slot (`scale`, `history`, `workspace`) is updated as in
    ``_fp8_cast_triton.cast_transpose_update``.
    """
    block_h = _check_slot(history)
    m, n = x.shape
    rstd = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    mean = None if rms else torch.empty((m, 1), dtype=torch.float32, device=x.device)
    data, data_t, scale_inv = _outputs(m, n, dtype, transpose, x.device)
    u8, u8_t = _u8(data, data_t)
    bm, bn, warps = tile()
    block = min(STATS_BLOCK, next_power_of_2(n))
    rows = max(1, STATS_ELEMENTS // block)
    with on_device(x.device):
        _norm_stats_kernel[(cdiv(m, rows),)](
            x, mean if mean is not None else rstd, rstd, m, n, float(n), x.stride(0),
            x.stride(1), _float32(eps), RMS=rms, ROWS=rows, BLOCK=block, num_warps=4,
        )
        _norm_cast_kernel[_grid(m, n, bm, bn)](
            x, mean if mean is not None else rstd, rstd, weight,
            bias if bias is not None else weight, scale, u8, u8_t, workspace, history, scale_inv,
            m, n, x.stride(0), x.stride(1), float(fp8_max), history.numel(), float(factor),
            RMS=rms, HAS_BIAS=bias is not None, E5M2=dtype == torch.float8_e5m2,
            TRANSPOSE=transpose, MOST_RECENT=most_recent, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_H=block_h, num_warps=warps,
        )
    return data, data_t, scale_inv, mean, rstd


def act_cast_update(
    h: torch.Tensor,
    act_id: int,
    glu: bool,
    scale: torch.Tensor,
    history: torch.Tensor,
    workspace: torch.Tensor,
    fp8_max: float,
    dtype: torch.dtype,
    transpose: bool,
    *,
    factor: float,
    most_recent: bool,
):
    """``(data, data_t, scale_inv)``: the FP8 cast of the activation of 2-D `h` (unit column
    stride; a GLU's `h` is [gate, up], the result half as wide)."""
    block_h = _check_slot(history)
    m, width = h.shape
    f = width // 2 if glu else width
    data, data_t, scale_inv = _outputs(m, f, dtype, transpose, h.device)
    u8, u8_t = _u8(data, data_t)
    bm, bn, warps = tile()
    with on_device(h.device):
        _act_cast_kernel[_grid(m, f, bm, bn)](
            h, scale, u8, u8_t, workspace, history, scale_inv,
            m, f, h.stride(0), float(fp8_max), history.numel(), float(factor),
            ACT=act_id, GLU=glu, E5M2=dtype == torch.float8_e5m2, TRANSPOSE=transpose,
            MOST_RECENT=most_recent, BLOCK_M=bm, BLOCK_N=bn, BLOCK_H=block_h,
            num_warps=warps,
        )
    return data, data_t, scale_inv


def dact_cast_update(
    grad: torch.Tensor,
    h: torch.Tensor,
    act_id: int,
    glu: bool,
    scale: torch.Tensor,
    history: torch.Tensor,
    workspace: torch.Tensor,
    fp8_max: float,
    dtype: torch.dtype,
    transpose: bool,
    column_sums: bool,
    *,
    factor: float,
    most_recent: bool,
):
    """``(data, data_t, scale_inv, sums)``: the FP8 cast of the gradient of `h` given the
    gradient `grad` of the activation's output (both 2-D, unit column stride). `sums` (with
    `column_sums`): float32 [row tiles, width of h], whose ``sum(0)`` is the column sums of that
    gradient (summed in another order than torch's)."""
    block_h = _check_slot(history)
    m, f = grad.shape
    width = h.shape[1]
    data, data_t, scale_inv = _outputs(m, width, dtype, transpose, h.device)
    bm, bn, warps = tile()
    sums = None
    if column_sums:
        sums = torch.empty((cdiv(m, bm), width), dtype=torch.float32, device=h.device)
    u8, u8_t = _u8(data, data_t)
    with on_device(h.device):
        _dact_cast_kernel[_grid(m, f, bm, bn)](
            grad, h, scale, u8, u8_t, sums if sums is not None else scale, workspace, history,
            scale_inv, m, f, grad.stride(0), h.stride(0), float(fp8_max), history.numel(),
            float(factor), ACT=act_id, GLU=glu, E5M2=dtype == torch.float8_e5m2,
            TRANSPOSE=transpose, COLUMN_SUMS=column_sums, MOST_RECENT=most_recent,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_H=block_h, num_warps=warps,
        )
    return data, data_t, scale_inv, sums
