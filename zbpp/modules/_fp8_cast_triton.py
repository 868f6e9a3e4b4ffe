"""FP8 kernels in Triton for Hopper: a one-pass cast-transpose-amax and the delayed-scaling update.

`zbpp.modules.fp8` imports this module when it casts a CUDA tensor. It imports without Triton
too (CPU-only installs); `unsupported(device)` then says why the kernels cannot run.

``cast_transpose_amax`` reads x [M, N] once, tile by tile (128 x 64), and writes

- ``data``   = ``fp8(clamp(float32(x) * scale, -fp8_max, fp8_max))``, [M, N] row-major,
- ``data_t`` = the same bytes transposed, [N, M] row-major (the tile is transposed on chip, so
  both stores are coalesced), and
- ``amax``   = ``max |x|`` (a per-tile maximum, then one relaxed integer atomic max per tile),

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

``cast_transpose_update`` is the whole delayed-scaling cast (``fp8.quantize``) in one launch: the
cast above, then the tile that finishes last (an atomic count of finished tiles) runs the update
on the slot and writes the reciprocal of the scale the cast used. Optionally the tiles also write
their column sums of x (a bias gradient, summed from the unquantised values in the same pass).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from ._triton_launch import direct

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no kernels, `unsupported` says so
    triton = None
    tl = None

__all__ = [
    "unsupported",
    "cast_transpose_amax",
    "cast_transpose_update",
    "update_scale",
    "INPUT_DTYPES",
    "FP8_DTYPES",
]

# 16-bit inputs only: with float32 inputs Triton 3.6 stored wrong transposed tiles on Hopper, so
# float32 takes the next path (torch.compile, then eager); FP8 training casts 16-bit tensors.
INPUT_DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# 128 x 64 tiles, 4 warps (64 elements per thread): the fastest tile shape of a sweep on Hopper,
# one tile per program (docs/benchmarks.md, "Constants").
BLOCK_M = 128
BLOCK_N = 64
NUM_WARPS = 4
MAX_HISTORY = 1 << 16  # the update kernel holds the whole history in one program
MAX_FUSED_HISTORY = 1 << 12  # ... and so does the cast's last tile, with the cast's few warps


# Launch sizes in plain integers: Triton's cdiv and next_power_of_2 are jit functions, whose call
# from the host costs microseconds per launch (several per cast).
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints.

    >>> cdiv(257, 128), cdiv(256, 128)
    (3, 2)
    """
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 at least `n` (0 for 0), as ``triton.next_power_of_2``.

    >>> [next_power_of_2(n) for n in (0, 1, 3, 4, 1025)]
    [0, 1, 4, 4, 2048]
    """
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, read when a kernel
    module is imported: that is when ``triton.jit`` picks the interpreter)."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


if triton is not None:
    # Under the interpreter (numpy on CPU tensors) the PTX helpers below cannot run and Triton's own
    # conversions to bfloat16 and FP8 truncate; the kernels then take the bit-level software
    # versions in the helpers, which the interpreter tests compare with torch's casts. On a GPU
    # this constant is False and those branches are not compiled at all.
    INTERPRETED = tl.constexpr(_interpreting())

    # tl.sum / tl.max for these 32-bit types, spelled as tl.reduce over the standard library's
    # combine functions: the interpreter can run only jit functions decorated while it was on (the
    # standard library's were decorated when Triton was first imported), and it recognises these
    # combine functions by identity and reduces with numpy without calling them. (Local ones
    # stand in should a Triton version name them otherwise: correct, only slower interpreted.)
    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _maximum(a, b):
        return tl.maximum(a, b)

    _SUM_COMBINE = getattr(tl.standard, "_sum_combine", _add)
    _MAX_COMBINE = getattr(tl.standard, "_elementwise_max", _maximum)

    @triton.jit
    def tile_sum(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _SUM_COMBINE)

    @triton.jit
    def _max(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _MAX_COMBINE)

    @triton.jit
    def ptx_f32(ASM: tl.constexpr, a):
        # float32 -> float32 through the one PTX instruction `ASM` ("op $0, $1;"), its operands as
        # 32-bit registers (compiled code only: the interpreter cannot run PTX)
        return tl.inline_asm_elementwise(
            ASM, "=r,r", [a.to(tl.int32, bitcast=True)], dtype=tl.int32, is_pure=True, pack=1,
        ).to(tl.float32, bitcast=True)

    @triton.jit
    def _ptx_f32_2(ASM: tl.constexpr, a, b):
        # the two-operand form of `ptx_f32` ("op $0, $1, $2;")
        return tl.inline_asm_elementwise(
            ASM, "=r,r,r", [a.to(tl.int32, bitcast=True), b.to(tl.int32, bitcast=True)],
            dtype=tl.int32, is_pure=True, pack=1,
        ).to(tl.float32, bitcast=True)

    @triton.jit
    def mul_rn(a, b):
        # IEEE float32 product: PTX mul.rn.f32 without .ftz (numpy's float32 product under the
        # interpreter, IEEE too). Also keeps the product out of any FMA.
        if INTERPRETED:
            return a * b
        else:
            return _ptx_f32_2("mul.rn.f32 $0, $1, $2;", a, b)

    @triton.jit
    def rcp_rn(a):
        # IEEE float32 reciprocal (correctly rounded, subnormals kept), as torch.reciprocal.
        if INTERPRETED:
            return 1.0 / a
        else:
            return ptx_f32("rcp.rn.f32 $0, $1;", a)

    @triton.jit
    def div_rn(a, b):
        # IEEE float32 quotient (``/`` in Triton is the approximate div.full.f32).
        if INTERPRETED:
            return a / b
        else:
            return _ptx_f32_2("div.rn.f32 $0, $1, $2;", a, b)

    @triton.jit
    def round_bf16(v):
        """float32 -> the nearest bfloat16 (ties to even), returned as float32: the rounding
        torch applies when an op on bfloat16 tensors writes its float32 result."""
        if INTERPRETED:
            bits = v.to(tl.int32, bitcast=True)
            mag = bits & 0x7FFFFFFF
            up = (mag + 0x7FFF + ((mag >> 16) & 1)) & -65536  # -65536: the mask 0xFFFF0000
            r = up.to(tl.float32, bitcast=True)
            r = tl.where(bits < 0, -r, r)
            return tl.where(v != v, v, r)
        else:
            return v.to(tl.bfloat16).to(tl.float32)

    @triton.jit
    def _fp8_bits(y, E5M2: tl.constexpr):
        """The FP8 byte (uint8) of float32 `y`: round to nearest even, saturating to the format's
        largest finite (interpreted: `y` already clamped to it); NaN gives 0x7F. On sm_90 one
        cvt.rn.satfinite per pair of values."""
        if INTERPRETED:
            # SHIFT = 23 - mantissa bits; OFFSET = (127 - bias) << mantissa bits; the smallest
            # normal 2^(1 - bias); UNIT = 1 / the subnormal spacing 2^(1 - bias - mantissa bits)
            if E5M2:
                SHIFT, OFFSET, SMALLEST, UNIT = 21, 448, 6.103515625e-05, 65536.0
            else:
                SHIFT, OFFSET, SMALLEST, UNIT = 20, 960, 0.015625, 512.0
            a = tl.abs(y)
            mag = a.to(tl.int32, bitcast=True)
            # normal results: round the float32 mantissa (a carry bumps the exponent)
            r = mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)
            normal = (r >> SHIFT) - OFFSET
            # subnormal results: whole units of the spacing; the scaling is exact and adding 2^23
            # rounds to an even integer
            units = tl.where(a < SMALLEST, a, 0.0) * UNIT
            sub = ((units + 8388608.0) - 8388608.0).to(tl.int32)
            code = tl.where(a < SMALLEST, sub, normal)
            code = tl.where(y.to(tl.int32, bitcast=True) < 0, code | 0x80, code)
            code = tl.where(y != y, 0x7F, code)
            return code.to(tl.uint8)
        else:
            if E5M2:
                q = y.to(tl.float8e5, fp_downcast_rounding="rtne")
            else:
                q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
            return q.to(tl.uint8, bitcast=True)

    @triton.jit
    def _push_and_rescale(
        history_ptr,
        scale_ptr,
        scale_inv_ptr,
        amax,  # [BLOCK] float32, the same value in every lane
        L,
        factor,
        MOST_RECENT: tl.constexpr,
        WRITE_SCALE_INV: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # ScalingMeta.update: push amax into the history (newest first) and rescale.
        i = tl.arange(0, BLOCK)
        valid = i < L
        older = tl.load(history_ptr + i - 1, mask=valid & (i > 0), other=0.0)
        history = tl.where(i == 0, amax, older)
        tl.debug_barrier()  # every lane has read the old history before any lane overwrites it
        tl.store(history_ptr + i, history, mask=valid)
        if MOST_RECENT:
            ref = amax
            no_nan = ref == ref
        else:
            # + zeros: the scalar maximum as a block, so the inline PTX below runs on a block
            ref = _max(tl.where(valid, history, float("-inf")), 0) + tl.full(
                [BLOCK], 0.0, tl.float32
            )
            no_nan = _max(tl.where(valid & (history != history), 1, 0), 0) == 0
        new = mul_rn(rcp_rn(ref), factor)
        usable = no_nan & (ref > 0) & (tl.abs(ref) < float("inf")) & (tl.abs(new) < float("inf"))
        old = tl.load(scale_ptr + i * 0)
        if WRITE_SCALE_INV:  # the reciprocal of the scale this cast used, as torch.reciprocal
            tl.store(scale_inv_ptr + i * 0, rcp_rn(old), mask=i == 0)
        tl.store(scale_ptr + i * 0, tl.where(usable, new, old), mask=i == 0)

    @triton.jit
    def cast_store_tile(
        xf,  # float32 [BM, BN]: the values to cast; lanes outside the tile must hold zeros
        row_ok,  # [BM] bool: rows inside the tensor
        col_ok,  # [BN] bool: columns inside the tensor
        r64,  # [BM] int64: the tile's rows in the output
        c64,  # [BN] int64: the tile's columns in the output
        scale,  # float32 scalar: the slot's scale
        fp8_max,
        data_ptr,  # uint8 [M, ld] row-major
        data_t_ptr,  # uint8 [ld, ld_t] row-major (TRANSPOSE only)
        ld,
        ld_t,
        sums_at,  # pointer to this row tile's float32 column sums, at column 0 (COLUMN_SUMS only)
        E5M2: tl.constexpr,
        TRANSPOSE: tl.constexpr,
        COLUMN_SUMS: tl.constexpr,
    ):
        """Cast one tile to FP8 and store it (and its transpose, and its column sums); return the
        tile's max |x| as int32 bits (see `finish_cast`)."""
        y = mul_rn(xf, scale)
        if INTERPRETED:  # the software rounding below needs the clamp done
            y = tl.where(y > fp8_max, fp8_max, y)  # compares are false for NaN: it passes
            y = tl.where(y < -fp8_max, -fp8_max, y)
        # compiled, the conversion saturates by itself (cvt.rn.satfinite clamps to the format's
        # largest finite, fp8_max, and keeps NaN): the two selects would cost instructions in
        # kernels bound by instruction issue
        q = _fp8_bits(y, E5M2)
        inside = row_ok[:, None] & col_ok[None, :]
        tl.store(data_ptr + r64[:, None] * ld + c64[None, :], q, mask=inside)
        if TRANSPOSE:
            inside_t = col_ok[:, None] & row_ok[None, :]
            tl.store(data_t_ptr + c64[:, None] * ld_t + r64[None, :], tl.trans(q), mask=inside_t)
        mag = xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |x| as bits; masked lanes are +0
        if COLUMN_SUMS:  # this row tile's share of x.sum(0); masked lanes hold zeros
            # (placed after the stores and |x|: faster there)
            tl.store(sums_at + c64, tile_sum(xf, 0), mask=col_ok)
        return _max(_max(mag, 1), 0)

    @triton.jit
    def finish_cast(
        amax_bits_ptr,  # int32; UPDATE: int32[2] (amax bits, tiles done), zero between casts
        tile_bits,  # int32 scalar from cast_store_tile (the max over the program's tiles)
        history_ptr,
        scale_ptr,
        scale_inv_ptr,
        history_len,
        factor,
        UPDATE: tl.constexpr,
        MOST_RECENT: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """Merge a program's amax into the cast's; with UPDATE the last program updates the slot."""
        # Relaxed: nothing waits on this atomic, and an acquire-release one would fence every tile
        # on its own stores; the count below is what orders it before the update.
        tl.atomic_max(amax_bits_ptr, tile_bits, sem="relaxed")
        if UPDATE:
            # The last tile to finish updates the slot. The count is acquire-release: each tile's
            # amax (Triton issues a scalar atomic from one thread, the same one for both) and
            # its reads of the scale happen before its count, so the last tile sees every amax
            # and may overwrite the scale; it also zeroes the workspace for the next cast.
            done = tl.atomic_add(amax_bits_ptr + 1, 1)
            if done == tl.num_programs(0) - 1:
                bits = tl.atomic_xchg(amax_bits_ptr, 0)
                tl.atomic_xchg(amax_bits_ptr + 1, 0)
                # broadcast as integers: the bits (a NaN's payload too) pass unchanged
                amax = (tl.full([BLOCK_H], 0, tl.int32) + bits).to(tl.float32, bitcast=True)
                _push_and_rescale(
                    history_ptr,
                    scale_ptr,
                    scale_inv_ptr,
                    amax,
                    history_len,
                    factor,
                    MOST_RECENT=MOST_RECENT,
                    WRITE_SCALE_INV=True,
                    BLOCK=BLOCK_H,
                )

    @direct
    @triton.jit
    def _cast_transpose_amax_kernel(
        x_ptr,
        scale_ptr,
        data_ptr,  # uint8 view of the FP8 output [M, N]
        data_t_ptr,  # uint8 view of the FP8 output [N, M] (unused without TRANSPOSE)
        column_sums_ptr,  # float32 [row tiles, N] (unused without COLUMN_SUMS)
        amax_bits_ptr,  # int32; UPDATE: int32[2] (amax bits, tiles done), zero between casts
        history_ptr,  # the slot's amax history (UPDATE only)
        scale_inv_ptr,  # float32 scalar out (UPDATE only)
        M,
        N,
        stride_m,
        stride_n,
        fp8_max,
        history_len,
        factor,
        E5M2: tl.constexpr,
        TRANSPOSE: tl.constexpr,
        COLUMN_SUMS: tl.constexpr,
        UPDATE: tl.constexpr,
        MOST_RECENT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tiles_n = (N + BLOCK_N - 1) // BLOCK_N
        rows = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        r64 = rows.to(tl.int64)  # offsets in int64: M * N may pass 2**31
        c64 = cols.to(tl.int64)
        row_ok = rows < M
        col_ok = cols < N
        x_at = x_ptr + r64[:, None] * stride_m + c64[None, :] * stride_n
        x = tl.load(x_at, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        sums_at = column_sums_ptr + (pid // tiles_n).to(tl.int64) * N
        bits = cast_store_tile(
            x.to(tl.float32), row_ok, col_ok, r64, c64, tl.load(scale_ptr), fp8_max,
            data_ptr, data_t_ptr, N, M, sums_at,
            E5M2=E5M2, TRANSPOSE=TRANSPOSE, COLUMN_SUMS=COLUMN_SUMS,
        )
        finish_cast(
            amax_bits_ptr, bits, history_ptr, scale_ptr, scale_inv_ptr, history_len, factor,
            UPDATE=UPDATE, MOST_RECENT=MOST_RECENT, BLOCK_H=BLOCK_H,
        )

    @direct
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
        amax = tl.load(amax_ptr + tl.arange(0, BLOCK) * 0)  # the same value in every lane
        _push_and_rescale(
            history_ptr,
            scale_ptr,
            scale_ptr,  # unused: no scale_inv here
            amax,
            L,
            factor,
            MOST_RECENT=MOST_RECENT,
            WRITE_SCALE_INV=False,
            BLOCK=BLOCK,
        )


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


_HERE = contextlib.nullcontext()  # reusable: one for every launch on the current device


def on_device(device: torch.device):
    # Triton launches on the current device; switch only when x lives elsewhere.
    if device.index is None or device.index == torch.cuda.current_device():
        return _HERE
    return torch.cuda.device(device)


def _launch(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_max: float,
    dtype: torch.dtype,
    transpose: bool,
    column_sums: bool,
    amax_bits: torch.Tensor,
    update: tuple[torch.Tensor, torch.Tensor, float, bool] | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    # One cast kernel; `update` = (history, scale_inv out, factor, most_recent) or None.
    shape, dim = x.shape, x.dim()
    if (transpose or column_sums) and dim != 2:
        raise ValueError(
            f"FP8 cast: transpose and column sums need a 2-D tensor, got shape {tuple(shape)}"
        )
    x2 = x if dim == 2 else x.reshape(-1, shape[-1]) if dim else x.reshape(1, 1)
    m, n = x2.shape
    data = torch.empty((m, n), dtype=dtype, device=x.device)
    data_t = torch.empty((n, m), dtype=dtype, device=x.device) if transpose else None
    row_tiles = cdiv(m, BLOCK_M)
    sums = None
    if column_sums:
        sums = torch.empty((row_tiles, n), dtype=torch.float32, device=x.device)
    history, scale_inv, factor, most_recent = update or (amax_bits, amax_bits, 0.0, False)
    block_h = max(16, next_power_of_2(history.numel())) if update else 16
    with on_device(x.device):
        _cast_transpose_amax_kernel[(row_tiles * cdiv(n, BLOCK_N),)](
            x2,
            scale,
            data.view(torch.uint8),
            (data_t if data_t is not None else data).view(torch.uint8),
            sums if sums is not None else scale,
            amax_bits,
            history,
            scale_inv,
            m,
            n,
            x2.stride(0),
            x2.stride(1),
            float(fp8_max),
            history.numel(),
            float(factor),
            E5M2=dtype == torch.float8_e5m2,
            TRANSPOSE=transpose,
            COLUMN_SUMS=column_sums,
            UPDATE=update is not None,
            MOST_RECENT=most_recent,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_H=block_h,
            num_warps=NUM_WARPS,
        )
    return (data if x2 is x else data.view(shape)), data_t, sums


def cast_transpose_amax(
    x: torch.Tensor, scale: torch.Tensor, fp8_max: float, dtype: torch.dtype, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(data, data_t, amax)`` as ``fp8._cast_eager`` returns them, in one pass over `x`.

    `x`: CUDA, one of `INPUT_DTYPES`, not empty, any strides; 2-D when `transpose` (other ranks
    are cast as [-1, last dim]). `scale`: 0-d float32 on x's device, read in the kernel (no host
    sync). `dtype`: one of `FP8_DTYPES`. ``data`` has x's shape and is contiguous; ``amax`` is a
    0-d float32 tensor.
    """
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    data, data_t, _ = _launch(x, scale, fp8_max, dtype, transpose, False, amax_bits, None)
    return data, data_t, amax_bits.view(torch.float32)


def cast_transpose_update(
    x: torch.Tensor,
    scale: torch.Tensor,
    history: torch.Tensor,
    workspace: torch.Tensor,
    fp8_max: float,
    dtype: torch.dtype,
    transpose: bool,
    *,
    factor: float,
    most_recent: bool,
    column_sums: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """A whole delayed-scaling cast in one kernel: ``(data, data_t, scale_inv, column_sums)``.

    Casts like `cast_transpose_amax`, then (in the last tile to finish) pushes the amax into
    `history` and rescales `scale` in place as `update_scale` does, and returns ``scale_inv`` =
    the reciprocal of the scale the cast used. One launch instead of four (reciprocal, zeroing
    the amax, cast, update): at small sizes the casts are bound by launches on the host.

    `workspace`: int32 [2] on x's device, zero, left zero (the slot's: one cast at a time per
    slot). `history`: float32, contiguous, at most `MAX_FUSED_HISTORY` long. `column_sums` (2-D
    `x`): also a float32 [ceil(M / BLOCK_M), N] of per-row-tile sums of `x`, whose ``sum(0)`` is
    ``x.sum(0)`` (summed in another order: not bit-identical to torch's).
    """
    if not 1 <= history.numel() <= MAX_FUSED_HISTORY:
        raise ValueError(
            f"cast_transpose_update: history length {history.numel()}; need 1..{MAX_FUSED_HISTORY}"
        )
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    update = (history, scale_inv, factor, most_recent)
    data, data_t, sums = _launch(
        x, scale, fp8_max, dtype, transpose, column_sums, workspace, update
    )
    return data, data_t, scale_inv, sums


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
    block = max(16, next_power_of_2(length))
    with on_device(history.device):
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
