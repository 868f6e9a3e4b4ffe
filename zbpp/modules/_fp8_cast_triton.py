"""FP8 kernels in Triton for Hopper: a one-pass cast-transpose-amax and the delayed-scaling update.

`zbpp.modules.fp8` imports this module when it casts a CUDA tensor. It imports without Triton
too (CPU-only installs); `unsupported(device)` then says why the kernels cannot run.

``cast_transpose_amax`` reads x [M, N] once, tile by tile (128 x 128), and writes

- ``data``   = ``fp8(clamp(float32(x) * scale, -fp8_max, fp8_max))``, [M, N] row-major,
- ``data_t`` = the same bytes transposed, [N, M] row-major (the tile is transposed on chip, so
  both stores are coalesced), and
- ``amax``   = ``max |x|`` (a per-tile maximum, then one integer atomic max per tile),

with the bits of the eager torch ops (``fp8._cast_eager``):

- the product is an IEEE float32 multiply (inline PTX ``mul.rn.f32``: subnormals kept whatever
  fast-math defaults a plain ``*`` gets), the clamp two compares (a NaN stays NaN, as in
  ``torch.clamp``), then one round-to-nearest-even conversion: on sm_90 Triton lowers float32 ->
  e4m3/e5m2 with ``rtne`` to a single ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32``. Before sm_90 it goes
  through float16 rounded toward zero first (two roundings), so the kernels need sm_90.
- NaN inputs give NaN bytes; torch keeps the NaN's sign bit there (0x7F or 0xFF), ``cvt`` writes
  0x7F: the only place the bits may differ, and the value is NaN either way.
- the amax is taken over the float32 bit patterns with the sign bit cleared, as int32: for
  non-negative floats integer order is float order and a NaN's bits lie above +inf's, so a NaN
  propagates (as in ``torch.aminmax``) and an integer ``atomic_max`` suffices (zero-initialised:
  the bits of +0.0).

``update_scale`` is ``ScalingMeta.update`` in one single-program kernel: push the amax into the
history (newest first), ``ref`` = max of the history or its newest entry, ``new = rcp(ref) *
factor`` (``factor = fp8_max * 2**-margin``; ``rcp.rn.f32``: IEEE, where ``tl.math.div_rn`` goes
through libdevice linked flush-to-zero and ``/`` is the approximate ``div.full``), and keep the old
scale unless ``ref > 0`` and ``ref`` and ``new`` are finite (and, for "max", no entry is NaN).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no kernels, `unsupported` says so
    triton = None
    tl = None

__all__ = ["unsupported", "cast_transpose_amax", "update_scale", "INPUT_DTYPES", "FP8_DTYPES"]

# 16-bit inputs only. With float32 inputs on an H200 (Triton 3.6) the transposed store came out
# wrong for whole 128x128 tiles (ragged tiles and 16-bit inputs were bit-exact), so float32 takes
# the next path (torch.compile, then eager); FP8 training feeds this cast 16-bit tensors anyway.
INPUT_DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# 128 x 128 tiles: rows of 256 B of bf16 in, 128 B of FP8 out both ways; 8 warps keep 64 elements
# per thread. Few enough tiles (4096 for 8192^2) that the one atomic per tile costs nothing.
BLOCK_M = 128
BLOCK_N = 128
NUM_WARPS = 8
MAX_HISTORY = 1 << 16  # the update kernel holds the whole history in one program

if triton is not None:

    @triton.jit
    def _mul_rn(a, b):
        # IEEE float32 product: PTX mul.rn.f32 without .ftz, operands as 32-bit registers.
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;",
            "=r,r,r",
            [a.to(tl.int32, bitcast=True), b.to(tl.int32, bitcast=True)],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        ).to(tl.float32, bitcast=True)

    @triton.jit
    def _rcp_rn(a):
        # IEEE float32 reciprocal (correctly rounded, subnormals kept), as torch.reciprocal.
        return tl.inline_asm_elementwise(
            "rcp.rn.f32 $0, $1;",
            "=r,r",
            [a.to(tl.int32, bitcast=True)],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        ).to(tl.float32, bitcast=True)

    @triton.jit
    def _cast_transpose_amax_kernel(
        x_ptr,
        scale_ptr,
        data_ptr,  # uint8 view of the FP8 output [M, N]
        data_t_ptr,  # uint8 view of the FP8 output [N, M] (unused without TRANSPOSE)
        amax_bits_ptr,  # int32 scalar, zero on entry
        M,
        N,
        stride_m,
        stride_n,
        fp8_max,
        E5M2: tl.constexpr,
        TRANSPOSE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BLOCK_N)
        rows = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        r64 = rows.to(tl.int64)  # offsets in int64: M * N may pass 2**31
        c64 = cols.to(tl.int64)
        inside = (rows[:, None] < M) & (cols[None, :] < N)
        x_at = x_ptr + r64[:, None] * stride_m + c64[None, :] * stride_n
        x = tl.load(x_at, mask=inside, other=0.0)
        xf = x.to(tl.float32)
        y = _mul_rn(xf, tl.load(scale_ptr))
        y = tl.where(y > fp8_max, fp8_max, y)  # compares are false for NaN: it passes through
        y = tl.where(y < -fp8_max, -fp8_max, y)
        if E5M2:
            q = y.to(tl.float8e5, fp_downcast_rounding="rtne")
        else:
            q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        q = q.to(tl.uint8, bitcast=True)
        tl.store(data_ptr + r64[:, None] * N + c64[None, :], q, mask=inside)
        if TRANSPOSE:
            inside_t = (cols[:, None] < N) & (rows[None, :] < M)
            tl.store(data_t_ptr + c64[:, None] * M + r64[None, :], tl.trans(q), mask=inside_t)
        mag = xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |x| as bits; masked lanes are +0
        tl.atomic_max(amax_bits_ptr, tl.max(tl.max(mag, axis=1), axis=0))

    @triton.jit
    def _update_scale_kernel(
        history_ptr,
        amax_ptr,
        scale_ptr,
        L,
        factor,
        MOST_RECENT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.arange(0, BLOCK)
        valid = i < L
        amax = tl.load(amax_ptr + i * 0)  # the same value in every lane
        older = tl.load(history_ptr + i - 1, mask=valid & (i > 0), other=0.0)
        history = tl.where(i == 0, amax, older)
        tl.debug_barrier()  # every lane has read the old history before any lane overwrites it
        tl.store(history_ptr + i, history, mask=valid)
        if MOST_RECENT:
            ref = amax
            no_nan = ref == ref
        else:
            # + zeros: the scalar maximum as a block, so the inline PTX below runs on a block
            ref = tl.max(tl.where(valid, history, float("-inf")), axis=0) + tl.zeros(
                [BLOCK], dtype=tl.float32
            )
            no_nan = tl.max(tl.where(valid & (history != history), 1, 0), axis=0) == 0
        new = _mul_rn(_rcp_rn(ref), factor)
        usable = no_nan & (ref > 0) & (tl.abs(ref) < float("inf")) & (tl.abs(new) < float("inf"))
        old = tl.load(scale_ptr + i * 0)
        tl.store(scale_ptr + i * 0, tl.where(usable, new, old), mask=i == 0)


@functools.lru_cache(maxsize=None)
def _capability_problem(index: int) -> str | None:
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (9, 0):
        return (
            f"cuda:{index} has compute capability {major}.{minor}; the Triton FP8 kernels need 9.0 "
            "(before it Triton converts float32 to FP8 through float16: two roundings)"
        )
    return None


def unsupported(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device`, or None when they can.

    >>> unsupported(torch.device("cpu"))
    'cpu is not a CUDA device'
    """
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    if triton is None:
        return "Triton is not installed"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability_problem(index)


def _on(device: torch.device):
    # Triton launches on the current device; switch only when x lives elsewhere.
    if device.index is None or device.index == torch.cuda.current_device():
        return _NoSwitch()
    return torch.cuda.device(device)


class _NoSwitch:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def cast_transpose_amax(
    x: torch.Tensor, scale: torch.Tensor, fp8_max: float, dtype: torch.dtype, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(data, data_t, amax)`` as ``fp8._cast_eager`` returns them, in one pass over `x`.

    `x`: CUDA, one of `INPUT_DTYPES`, not empty, any strides; 2-D when `transpose` (other ranks
    are cast as [-1, last dim]). `scale`: 0-d float32 on x's device, read in the kernel (no host
    sync). `dtype`: one of `FP8_DTYPES`. ``data`` has x's shape and is contiguous; ``amax`` is a
    0-d float32 tensor.
    """
    shape = x.shape
    if transpose and x.dim() != 2:
        raise ValueError(
            f"cast_transpose_amax: transpose needs a 2-D tensor, got shape {tuple(shape)}"
        )
    x2 = x if x.dim() == 2 else x.reshape(-1, shape[-1]) if x.dim() else x.reshape(1, 1)
    m, n = x2.shape
    data = torch.empty((m, n), dtype=dtype, device=x.device)
    data_t = torch.empty((n, m), dtype=dtype, device=x.device) if transpose else None
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
    with _on(x.device):
        _cast_transpose_amax_kernel[grid](
            x2,
            scale,
            data.view(torch.uint8),
            (data_t if data_t is not None else data).view(torch.uint8),
            amax_bits,
            m,
            n,
            x2.stride(0),
            x2.stride(1),
            float(fp8_max),
            E5M2=dtype == torch.float8_e5m2,
            TRANSPOSE=transpose,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            num_warps=NUM_WARPS,
        )
    return data.view(shape), data_t, amax_bits.view(torch.float32)


def update_scale(
    history: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    *,
    factor: float,
    most_recent: bool,
) -> None:
    """``ScalingMeta.update`` in one kernel, in place on `history` (float32 [L]) and `scale`.

    `amax`: one float32 element on the same CUDA device. ``scale = rcp(ref) * factor`` where
    usable, with ``factor = fp8_max * 2**-margin``; see the module docstring.
    """
    length = history.numel()
    if not 1 <= length <= MAX_HISTORY:
        raise ValueError(f"update_scale: history length {length}; need 1..{MAX_HISTORY}")
    block = max(16, triton.next_power_of_2(length))
    with _on(history.device):
        _update_scale_kernel[(1,)](
            history,
            amax,
            scale,
            length,
            float(factor),
            MOST_RECENT=most_recent,
            BLOCK=block,
            num_warps=1 if block <= 1024 else 4,
        )
