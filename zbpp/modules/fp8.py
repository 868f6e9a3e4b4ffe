"""FP8 the Transformer Engine way: a recipe, an autocast region, delayed scaling and FP8 GEMMs.

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

Casts run through one of three paths, chosen by the environment variable ``ZBPP_FP8_CAST``
(``triton``, ``compile`` or ``eager``; default ``triton``) and tried in that order from the chosen
one: ``triton`` is one fused Triton kernel (``_fp8_cast_triton``: cast, transpose and amax in one
pass over the tensor, the scale update in the tile that finishes last, and for a bias gradient the
column sums; histories over 4096 entries update in a second kernel; CUDA sm_90+ with Triton),
``compile`` is the eager ops through ``torch.compile`` (CUDA), ``eager`` the torch ops below (every
device; the reference the others equal bit for bit). A path that fails is switched off with one
warning and the next one takes over; ``cast_path_counts()`` says which path ran how often. The
layers' casts of a norm's, an activation's and an activation gradient's outputs are fused with
those operations on the triton path (``_fused``; ``ZBPP_FP8_FUSE=0`` keeps them apart).

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

import enum
import os
import threading
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

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
]


class Format(enum.Enum):
    """Which float8 formats the forward tensors and the gradients use."""

    E4M3 = "E4M3"  # everything e4m3
    HYBRID = "HYBRID"  # forward e4m3, gradients e5m2 (more range, less precision)


_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class DelayedScaling:
    """The FP8 recipe: per-tensor scales derived from the amax history of earlier casts.

    >>> DelayedScaling(margin=0, amax_history_len=16, amax_compute_algo="max").bwd_dtype
    torch.float8_e5m2
    """

    margin: float = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    # The forward GEMM accumulates in the tensor cores' fast, reduced-precision mode (about 14
    # bits on Hopper) and the gradient GEMMs promote to float32 (Transformer Engine's defaults:
    # gradients sum over many more terms). False: float32 promotion in the forward too.
    fprop_fast_accumulation: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.fp8_format, Format):
            try:
                object.__setattr__(self, "fp8_format", Format(str(self.fp8_format).upper()))
            except ValueError:
                raise ValueError(
                    f"DelayedScaling: fp8_format={self.fp8_format!r}; use Format.HYBRID or "
                    "Format.E4M3"
                ) from None
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(
                f"DelayedScaling: amax_history_len={self.amax_history_len!r}; need an int >= 1"
            )
        if self.amax_compute_algo not in _ALGOS:
            raise ValueError(
                f"DelayedScaling: amax_compute_algo={self.amax_compute_algo!r}; use one of {_ALGOS}"
            )
        if not self.margin >= 0:
            raise ValueError(f"DelayedScaling: margin={self.margin!r}; need a number >= 0")
        if not isinstance(self.fprop_fast_accumulation, bool):
            raise ValueError(
                "DelayedScaling: fprop_fast_accumulation="
                f"{self.fprop_fast_accumulation!r}; need True or False"
            )

    @property
    def fwd_dtype(self) -> torch.dtype:
        """Float8 dtype of inputs and weights."""
        return torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        """Float8 dtype of gradients."""
        return torch.float8_e5m2 if self.fp8_format is Format.HYBRID else torch.float8_e4m3fn


_recipes: list[DelayedScaling | None] = []


@contextmanager
def fp8_autocast(
    enabled: bool = True, *, fp8_recipe: DelayedScaling | None = None
) -> Iterator[DelayedScaling | None]:
    """Run the zbpp modules' forwards inside this block in FP8 (their backwards follow suit).

    The recipe is read at forward time and kept with the saved tensors, so the backward, wherever
    and whenever it runs, uses the forward's recipe. Blocks nest; ``enabled=False`` turns FP8 off
    inside an enabled block.

    >>> with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(amax_history_len=16)):
    ...     active_recipe().amax_history_len
    16
    >>> active_recipe() is None
    True
    >>> with fp8_autocast(fp8_recipe="hybrid"):
    ...     pass
    Traceback (most recent call last):
    TypeError: fp8_autocast: fp8_recipe='hybrid' (a str); pass a zbpp.modules.DelayedScaling ...
    """
    if fp8_recipe is not None and not isinstance(fp8_recipe, DelayedScaling):
        raise TypeError(
            f"fp8_autocast: fp8_recipe={fp8_recipe!r} (a {type(fp8_recipe).__name__}); pass a "
            "zbpp.modules.DelayedScaling (e.g. DelayedScaling(fp8_format=Format.HYBRID)) or None "
            "for the default recipe"
        )
    if not isinstance(enabled, bool):
        raise TypeError(
            f"fp8_autocast: enabled={enabled!r} (a {type(enabled).__name__}); pass True or False"
        )
    recipe = (fp8_recipe if fp8_recipe is not None else DelayedScaling()) if enabled else None
    _recipes.append(recipe)
    try:
        yield recipe
    finally:
        _recipes.pop()


def active_recipe() -> DelayedScaling | None:
    """The recipe of the innermost `fp8_autocast` block, or None when FP8 is off."""
    return _recipes[-1] if _recipes else None


class ScalingMeta:
    """Delayed-scaling state of one FP8 tensor slot: amax history (newest first) and scale."""

    def __init__(
        self, dtype: torch.dtype, *, history_len: int, device: torch.device | str | None = None
    ) -> None:
        self.dtype = dtype
        self.fp8_max = torch.finfo(dtype).max
        self.amax_history = torch.zeros(history_len, dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self._workspace: torch.Tensor | None = None  # the fused Triton cast's, made on first use

    def _fit(self, recipe: DelayedScaling) -> None:
        length = recipe.amax_history_len
        if self.amax_history.numel() != length:  # the recipe changed: keep the newest entries
            old = self.amax_history[:length]
            self.amax_history = torch.zeros(length, dtype=torch.float32, device=old.device)
            self.amax_history[: old.numel()] = old

    def _rule(self, recipe: DelayedScaling) -> tuple[float, bool]:
        # (factor, most_recent): scale = rcp(amax) * factor, amax = history[0] or max(history)
        return self.fp8_max * 2.0 ** -recipe.margin, recipe.amax_compute_algo == "most_recent"

    def _fused_workspace(self) -> torch.Tensor:
        # int32 [amax bits, tiles done], zero between casts (the fused kernel leaves it so)
        device = self.amax_history.device
        if self._workspace is None or self._workspace.device != device:
            self._workspace = torch.zeros(2, dtype=torch.int32, device=device)
        return self._workspace

    def update(self, amax: torch.Tensor, recipe: DelayedScaling) -> None:
        """Push `amax` into the history and recompute the scale (no host sync).

        ``scale = reciprocal(ref) * (fp8_max * 2**-margin)`` in float32, the same on every device
        and path; on CUDA one Triton kernel does it all where the Triton cast path is on.
        """
        self._fit(recipe)
        factor, most_recent = self._rule(recipe)
        if _update_with_triton(self, amax, factor, most_recent):
            return
        _count_cast("update_eager")
        history = torch.roll(self.amax_history, 1)
        history[0] = amax
        self.amax_history.copy_(history)
        ref = history[0] if most_recent else history.max()
        new = ref.reciprocal() * factor
        usable = (ref > 0) & torch.isfinite(ref) & torch.isfinite(new)
        self.scale.copy_(torch.where(usable, new, self.scale))


@dataclass(frozen=True)
class Quantized:
    """An FP8 tensor: ``value = data.float() * scale_inv`` (scale_inv: float32, 0-d).

    ``data_t``, when present, is the same values transposed and row-major (made in the cast, the
    way Transformer Engine's cast-transpose does, because FP8 GEMMs on Hopper take row-major
    operands only).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    data_t: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def t(self) -> Quantized:
        """The transpose, row-major (what `fp8_gemm_nt` wants)."""
        data_t = self.data.t().contiguous() if self.data_t is None else self.data_t
        return Quantized(data_t, self.scale_inv, self.data)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented values (exact in float32: an FP8 value times a float32 scale)."""
        return (self.data.to(torch.float32) * self.scale_inv).to(dtype)


def _cast_eager(
    x: torch.Tensor, scale: torch.Tensor, fp8_max: float, dtype: torch.dtype, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    # The product is formed in float32 so the value is rounded once, by the FP8 cast.
    data = (x.to(torch.float32) * scale).clamp_(-fp8_max, fp8_max).to(dtype)
    data_t = data.t().contiguous() if transpose else None
    if x.numel() == 0:
        return data, data_t, torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x)
    return data, data_t, torch.maximum(hi, -lo).to(torch.float32)


# -- which implementation casts --------------------------------------------------------------

CAST_PATHS = ("triton", "compile", "eager")
CAST_ENV = "ZBPP_FP8_CAST"
# Paths that failed once ("triton", "compile", or "update" for the Triton scale update), with
# the failure: they are not tried again in this process (one warning each).
_failed: dict[str, str] = {}
_told_unavailable: set[str] = set()
_compiled_cast: Callable | None = None


def _on_cuda(x: torch.Tensor) -> bool:
    # The fast paths are CUDA-only; one predicate so the dispatch can be tested without a GPU.
    return x.is_cuda


def _requested_paths() -> tuple[str, ...]:
    """The cast paths to try, best first: the one ``ZBPP_FP8_CAST`` names and those after it."""
    choice = os.environ.get(CAST_ENV, "").strip().lower() or CAST_PATHS[0]
    if choice not in CAST_PATHS:
        raise ValueError(
            f"zbpp FP8: {CAST_ENV}={choice!r}; use one of {', '.join(CAST_PATHS)} "
            "(or leave it unset for the fastest available)"
        )
    return CAST_PATHS[CAST_PATHS.index(choice) :]


def _fail(path: str, err: Exception) -> None:
    _failed[path] = f"{type(err).__name__}: {err}"
    what = "Triton scale update" if path == "update" else f"{path} cast"
    warnings.warn(
        f"zbpp FP8: the {what} failed ({_failed[path]}); using the next path from now on "
        "(cast_path_counts() says which ran)"
    )


def _triton_kernels(device: torch.device):
    """The Triton kernel module when its kernels can run on `device`, else None."""
    from . import _fp8_cast_triton as kernels  # imports without Triton too

    problem = kernels.unsupported(device)
    if problem is None:
        return kernels
    # Not a failure (the next path takes over): tell only whoever asked for triton by name.
    explicit = os.environ.get(CAST_ENV, "").strip().lower() == "triton"
    if explicit and problem not in _told_unavailable:
        _told_unavailable.add(problem)
        warnings.warn(f"zbpp FP8: {CAST_ENV}=triton, but {problem}; using the next path")
    return None


def _cast_triton(
    x: torch.Tensor, scale: torch.Tensor, fp8_max: float, dtype: torch.dtype, transpose: bool
):
    """The fused kernel's result, or None when this input or device does not suit it."""
    kernels = _triton_kernels(x.device)
    if kernels is None or not _suits_kernel(kernels, x, scale, dtype, transpose):
        return None
    return kernels.cast_transpose_amax(x, scale, fp8_max, dtype, transpose)


def _suits_kernel(kernels, x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, two_d: bool):
    return (
        x.dtype in kernels.INPUT_DTYPES
        and dtype in kernels.FP8_DTYPES
        and x.numel() > 0
        and (x.dim() == 2 or not two_d)
        and scale.dtype == torch.float32
        and scale.numel() == 1
        and scale.device == x.device
    )


def _cast_compiled(
    x: torch.Tensor, scale: torch.Tensor, fp8_max: float, dtype: torch.dtype, transpose: bool
):
    global _compiled_cast
    if _compiled_cast is None:
        _compiled_cast = torch.compile(_cast_eager, dynamic=True)
    return _compiled_cast(x, scale, fp8_max, dtype, transpose)


_FAST_CASTS = {"triton": _cast_triton, "compile": _cast_compiled}


def _cast(
    x: torch.Tensor, scale: torch.Tensor, fp8_max: float, dtype: torch.dtype, transpose: bool
):
    """`_cast_eager`'s result through the best path that works (see the module docstring)."""
    if _on_cuda(x):
        for path in _requested_paths():
            if path == "eager":
                break
            if path in _failed:
                continue
            try:
                out = _FAST_CASTS[path](x, scale, fp8_max, dtype, transpose)
            except Exception as err:  # noqa: BLE001 - any failure: the next path is correct too
                _fail(path, err)
                continue
            if out is not None:
                _count_cast(path)
                return out
    _count_cast("eager")
    return _cast_eager(x, scale, fp8_max, dtype, transpose)


def _update_with_triton(meta: ScalingMeta, amax: torch.Tensor, factor: float, most_recent: bool):
    """Run `meta`'s update in the Triton kernel when it suits; False leaves it to the caller."""
    history, scale = meta.amax_history, meta.scale
    if not _on_cuda(history) or "update" in _failed or "triton" not in _requested_paths():
        return False
    kernels = _triton_kernels(history.device)
    if kernels is None or not (
        amax.device == history.device
        and amax.dtype == torch.float32
        and amax.numel() == 1
        and scale.device == history.device
        and history.is_contiguous()
        and history.numel() <= kernels.MAX_HISTORY
    ):
        return False
    try:
        kernels.update_scale(history, scale, amax, factor=factor, most_recent=most_recent)
    except Exception as err:  # noqa: BLE001 - the eager update is correct too
        _fail("update", err)
        return False
    _count_cast("update_triton")
    return True


_counts_lock = threading.Lock()  # guards the GEMM and the cast path counters
_cast_counts: Counter[str] = Counter()
_CAST_COUNT_KEYS = (*CAST_PATHS, "update_triton", "update_eager")


def _count_cast(key: str) -> None:
    with _counts_lock:
        _cast_counts[key] += 1


def cast_path_counts() -> dict[str, int]:
    """How many FP8 casts ran through each path, and how many scale updates ran where.

    Keys: ``"triton"``, ``"compile"``, ``"eager"`` (casts) and ``"update_triton"``,
    ``"update_eager"`` (``ScalingMeta.update``).

    >>> import torch
    >>> reset_cast_path_counts()
    >>> _ = quantize(torch.ones(2, 2), ScalingMeta(torch.float8_e4m3fn, history_len=1),
    ...              DelayedScaling(amax_history_len=1))
    >>> cast_path_counts()
    {'triton': 0, 'compile': 0, 'eager': 1, 'update_triton': 0, 'update_eager': 1}
    """
    with _counts_lock:
        return {key: _cast_counts[key] for key in _CAST_COUNT_KEYS}


def reset_cast_path_counts() -> None:
    """Set every `cast_path_counts` entry to zero."""
    with _counts_lock:
        _cast_counts.clear()


def quantize(
    x: torch.Tensor, meta: ScalingMeta, recipe: DelayedScaling, *, transpose: bool = False
) -> Quantized:
    """Cast `x` to ``meta.dtype`` with the slot's current scale, then step the slot's history.

    With `transpose` (2-D `x` only) the result also carries its transpose (``data_t``).

    >>> import torch
    >>> meta = ScalingMeta(torch.float8_e4m3fn, history_len=2)
    >>> quantize(torch.tensor([1000.0]), meta, DelayedScaling()).dequantize().item()  # clamped
    448.0
    """
    return _quantize(x.detach(), meta, recipe, transpose, column_sum=False)[0]


def quantize_and_column_sum(
    x: torch.Tensor, meta: ScalingMeta, recipe: DelayedScaling, *, transpose: bool = False
) -> tuple[Quantized, torch.Tensor]:
    """`quantize` of a 2-D `x`, and ``x.sum(0)`` in x's dtype (a bias gradient, from the
    unquantised values) from the same pass over `x` where the fused Triton kernel runs.

    The fused sum adds float32 partial sums of row tiles: as accurate as ``x.sum(0)`` but not
    bit-identical to it; the other paths return ``x.sum(0)`` itself.

    >>> import torch
    >>> meta = ScalingMeta(torch.float8_e5m2, history_len=2)
    >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> q, s = quantize_and_column_sum(x, meta, DelayedScaling())
    >>> s.tolist(), q.dequantize().tolist()
    ([4.0, 6.0], [[1.0, 2.0], [3.0, 4.0]])
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_and_column_sum: x must be 2-D, got shape {tuple(x.shape)}")
    q, sums = _quantize(x.detach(), meta, recipe, transpose, column_sum=True)
    return q, sums if sums is not None else x.detach().sum(0)


def _quantize(
    x: torch.Tensor, meta: ScalingMeta, recipe: DelayedScaling, transpose: bool, column_sum: bool
) -> tuple[Quantized, torch.Tensor | None]:
    meta._fit(recipe)
    fused = _quantize_fused(x, meta, recipe, transpose, column_sum)
    if fused is not None:
        return fused
    scale_inv = meta.scale.reciprocal()  # the scale used for this cast, before the update
    data, data_t, amax = _cast(x, meta.scale, meta.fp8_max, meta.dtype, transpose)
    meta.update(amax, recipe)
    return Quantized(data, scale_inv, data_t), None


def _quantize_fused(
    x: torch.Tensor, meta: ScalingMeta, recipe: DelayedScaling, transpose: bool, column_sum: bool
) -> tuple[Quantized, torch.Tensor | None] | None:
    """Cast and update in one Triton kernel (``cast_transpose_update``), or None when that path
    is off, failed before, or does not suit this input or slot."""
    if not _on_cuda(x) or "triton" in _failed or "update" in _failed:
        return None
    if _requested_paths()[0] != "triton":
        return None
    kernels = _triton_kernels(x.device)
    history = meta.amax_history
    if kernels is None or not (
        _suits_kernel(kernels, x, meta.scale, meta.dtype, transpose or column_sum)
        and history.device == x.device
        and history.is_contiguous()
        and history.numel() <= kernels.MAX_FUSED_HISTORY
    ):
        return None
    factor, most_recent = meta._rule(recipe)
    try:
        data, data_t, scale_inv, sums = kernels.cast_transpose_update(
            x,
            meta.scale,
            history,
            meta._fused_workspace(),
            meta.fp8_max,
            meta.dtype,
            transpose,
            factor=factor,
            most_recent=most_recent,
            column_sums=column_sum,
        )
    except Exception as err:  # noqa: BLE001 - the unfused paths are correct too
        _fail("triton", err)
        return None
    _count_cast("triton")
    _count_cast("update_triton")
    total = sums.sum(0).to(x.dtype) if sums is not None else None
    return Quantized(data, scale_inv, data_t), total


_counts: Counter[str] = Counter()
_refused: set[str] = set()  # device types whose _scaled_mm raised: go straight to the fallback


def gemm_path_counts() -> dict[str, int]:
    """How many FP8 GEMMs ran through ``"scaled_mm"`` and through ``"dequantized"`` so far."""
    with _counts_lock:
        return {"scaled_mm": _counts["scaled_mm"], "dequantized": _counts["dequantized"]}


def reset_gemm_path_counts() -> None:
    """Set both `gemm_path_counts` to zero."""
    with _counts_lock:
        _counts.clear()


def _count(path: str) -> None:
    with _counts_lock:
        _counts[path] += 1


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
    multiplies the dequantised operands in float32.

    >>> import torch
    >>> one = Quantized(torch.ones(2, 3).to(torch.float8_e4m3fn), torch.tensor(0.5))
    >>> fp8_gemm_nt(one, one, out_dtype=torch.float32).tolist()
    [[0.75, 0.75], [0.75, 0.75]]
    """
    (m, k), (n, k2) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"fp8_gemm_nt: inner dimensions differ: a is {m}x{k}, b is {n}x{k2}")
    device = a.data.device.type
    aligned = m % 16 == 0 and k % 16 == 0 and n % 16 == 0
    if use_scaled_mm and aligned and device not in _refused:
        # _scaled_mm fuses the bias only for 16-bit outputs of the same dtype; add it after else.
        fuse_bias = bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32
        try:
            out = torch._scaled_mm(
                a.data,
                b.data.t(),  # column-major [K, N], as cuBLASLt wants the second operand
                scale_a=a.scale_inv,
                scale_b=b.scale_inv,
                bias=bias if fuse_bias else None,
                out_dtype=out_dtype,
                use_fast_accum=fast_accumulation,
            )
        except (RuntimeError, NotImplementedError) as err:
            _refused.add(device)
            warnings.warn(
                f"zbpp FP8: torch._scaled_mm refused on {device} ({err}); "
                "using dequantised float32 GEMMs there"
            )
        else:
            _count("scaled_mm")
            if bias is not None and not fuse_bias:
                out = out + bias.to(out_dtype)
            return out
    _count("dequantized")
    out = a.dequantize() @ b.dequantize().t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)
