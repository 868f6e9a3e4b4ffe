"""FP8 casts with delayed scaling: the scaling slots, the FP8 tensor type, and which path casts.

Casts run through one of three paths, chosen by the environment variable ``ZBPP_FP8_CAST``
(``triton``, ``compile`` or ``eager``; default ``triton``) and tried in that order from the chosen
one: ``triton`` is one fused Triton kernel (``_fp8_cast_triton``: cast, transpose and amax in one
pass over the tensor, the scale update in the tile that finishes last, and for a bias gradient the
column sums; histories over 4096 entries update in a second kernel; CUDA sm_90+ with Triton),
``compile`` is the eager ops through ``torch.compile`` (CUDA), ``eager`` the torch ops below (every
device; the reference the others equal bit for bit). A path that fails is switched off with one
warning and the next one takes over; ``cast_path_counts()`` says which path ran how often.

>>> import torch
>>> meta = ScalingMeta(torch.float8_e4m3fn, history_len=4)
>>> q = quantize(torch.tensor([[1.0, -2.0]]), meta, DelayedScaling(amax_history_len=4))
>>> q.dequantize().tolist(), meta.amax_history.tolist(), meta.scale.item()
([[1.0, -2.0]], [2.0, 0.0, 0.0, 0.0], 224.0)
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .counts import PathCounts
from .recipe import DelayedScaling

__all__ = [
    "ScalingMeta",
    "Quantized",
    "quantize",
    "quantize_and_column_sum",
    "cast_path_counts",
    "reset_cast_path_counts",
    "CAST_PATHS",
    "CAST_ENV",
]


class ScalingMeta:
    """Delayed-scaling state of one FP8 tensor slot: amax history (newest first) and scale."""

    def __init__(
        self, dtype: torch.dtype, *, history_len: int, device: torch.device | str | None = None
    ) -> None:
        self.dtype = dtype
        self.fp8_max = torch.finfo(dtype).max
        # the state outlives the call that makes it: never inference tensors, which a first FP8
        # forward under torch.inference_mode would make and no later training forward could update
        with torch.inference_mode(False):
            self.amax_history = torch.zeros(history_len, dtype=torch.float32, device=device)
            self.scale = torch.ones((), dtype=torch.float32, device=device)
        self._workspace: torch.Tensor | None = None  # the fused Triton cast's, made on first use
        self.casts = 0  # how many casts stepped it (0: fresh)

    def fit(self, recipe: DelayedScaling) -> None:
        """Resize the history to the recipe's length, keeping the newest entries."""
        length = recipe.amax_history_len
        if self.amax_history.numel() != length:
            old = self.amax_history[:length]
            with torch.inference_mode(False):  # as in __init__
                self.amax_history = torch.zeros(length, dtype=torch.float32, device=old.device)
                self.amax_history[: old.numel()] = old

    def rule_args(self, recipe: DelayedScaling) -> dict:
        """The scale rule as the kernels take it: ``scale = rcp(amax) * factor`` with
        ``amax = history[0]`` (`most_recent`) or ``max(history)``."""
        return dict(factor=self.fp8_max * 2.0 ** -recipe.margin,
                    most_recent=recipe.amax_compute_algo == "most_recent")

    def fused_workspace(self) -> torch.Tensor:
        """int32 [amax bits, tiles done] for the one-launch kernels, zero between casts (the
        kernels leave it so); made on first use, on the slot's device."""
        device = self.amax_history.device
        if self._workspace is None or self._workspace.device != device:
            with torch.inference_mode(False):  # as in __init__
                self._workspace = torch.zeros(2, dtype=torch.int32, device=device)
        return self._workspace

    def update(self, amax: torch.Tensor, recipe: DelayedScaling) -> None:
        """Push `amax` into the history and recompute the scale (no host sync).

        ``scale = reciprocal(ref) * (fp8_max * 2**-margin)`` in float32, the same on every device
        and path; on CUDA one Triton kernel does it all where the Triton cast path is on.
        """
        self.fit(recipe)
        rule = self.rule_args(recipe)
        if _update_with_triton(self, amax, rule):
            return
        _counts.add("update_eager")
        history = torch.roll(self.amax_history, 1)
        history[0] = amax
        self.amax_history.copy_(history)
        ref = history[0] if rule["most_recent"] else history.max()
        new = ref.reciprocal() * rule["factor"]
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
# Paths that failed once ("triton", "compile", "update" for the Triton scale update, "fused" for
# `_fused`'s kernels), with the failure, and the reasons already told why Triton cannot run.
# Process-wide on purpose: a kernel or compiler that failed fails again for every later call in
# this process (same code, same device, same installation), and each is reported once.
_failed: dict[str, str] = {}
_told_unavailable: set[str] = set()
_problems: dict[torch.device, str | None] = {}  # `_triton_kernels`: why each device cannot run them
_UNKNOWN = object()
_PACKAGE = sys.modules[__package__.rpartition(".")[0]]  # zbpp.modules, which holds the kernels
_counts = PathCounts((*CAST_PATHS, "update_triton", "update_eager"))


def on_cuda(x: torch.Tensor) -> bool:
    # The fast paths are CUDA-only; one predicate so the dispatch can be tested without a GPU.
    return x.is_cuda


def _requested_paths() -> tuple[str, ...]:
    """The cast paths to try, best first: the one ``ZBPP_FP8_CAST`` names and those after it."""
    return _paths_from(os.environ.get(CAST_ENV, ""))


@functools.lru_cache(maxsize=None)  # read on every cast: parsed once per value (errors are not kept)
def _paths_from(value: str) -> tuple[str, ...]:
    choice = value.strip().lower() or CAST_PATHS[0]
    if choice not in CAST_PATHS:
        raise ValueError(
            f"zbpp FP8: {CAST_ENV}={choice!r}; use one of {', '.join(CAST_PATHS)} "
            "(or leave it unset for the fastest available)"
        )
    return CAST_PATHS[CAST_PATHS.index(choice) :]


def mark_failed(path: str, err: Exception) -> None:
    """Switch `path` off for the rest of the process, with one warning that says why."""
    _failed[path] = f"{type(err).__name__}: {err}"
    what = "Triton scale update" if path == "update" else f"{path} cast"
    warnings.warn(
        f"zbpp FP8: the {what} failed ({_failed[path]}); using the next path from now on "
        "(cast_path_counts() says which ran)"
    )


def _triton_kernels(device: torch.device):
    """The Triton kernel module when its kernels can run on `device`, else None."""
    # what `from .. import _fp8_cast_triton` finds, without the import machinery once imported
    kernels = getattr(_PACKAGE, "_fp8_cast_triton", None)
    if kernels is None:  # imported on the first CUDA cast (it imports without Triton too)
        from .. import _fp8_cast_triton as kernels

    # asked on every cast: a device's answer never changes within the process
    problem = _problems.get(device, _UNKNOWN)
    if problem is _UNKNOWN:
        problem = kernels.unsupported(device)
        if device.index is not None:  # else the current device answered
            _problems[device] = problem
    if problem is None:
        return kernels
    # Not a failure (the next path takes over): tell only whoever asked for triton by name.
    explicit = os.environ.get(CAST_ENV, "").strip().lower() == "triton"
    if explicit and problem not in _told_unavailable:
        _told_unavailable.add(problem)
        warnings.warn(f"zbpp FP8: {CAST_ENV}=triton, but {problem}; using the next path")
    return None


def one_launch_kernels(x: torch.Tensor, also: str | None = None):
    """The Triton kernel module when `x` may be cast, and its slot updated, in one launch: `x` on
    CUDA, the triton path chosen first, neither its cast, its update nor `also` failed before,
    and the kernels can run on x's device. Else None."""
    if not on_cuda(x) or (_failed and ("triton" in _failed or "update" in _failed or also in _failed)):
        return None
    if _requested_paths()[0] != "triton":
        return None
    return _triton_kernels(x.device)


def count_one_launch() -> None:
    """Count a cast that ran, with its update, in one Triton launch (plain or fused)."""
    _counts.add("triton", "update_triton")


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


@functools.cache
def _compiled_cast() -> Callable:
    # Compiled once per process (torch.compile's own cache handles the shapes and dtypes).
    return torch.compile(_cast_eager, dynamic=True)


def _cast_compiled(
    x: torch.Tensor, scale: torch.Tensor, fp8_max: float, dtype: torch.dtype, transpose: bool
):
    return _compiled_cast()(x, scale, fp8_max, dtype, transpose)


_FAST_CASTS = {"triton": _cast_triton, "compile": _cast_compiled}


def _cast(
    x: torch.Tensor, scale: torch.Tensor, fp8_max: float, dtype: torch.dtype, transpose: bool
):
    """`_cast_eager`'s result through the best path that works (see the module docstring)."""
    if on_cuda(x):
        for path in _requested_paths():
            if path == "eager":
                break
            if path in _failed:
                continue
            try:
                out = _FAST_CASTS[path](x, scale, fp8_max, dtype, transpose)
            except Exception as err:  # noqa: BLE001 - any failure: the next path is correct too
                mark_failed(path, err)
                continue
            if out is not None:
                _counts.add(path)
                return out
    _counts.add("eager")
    return _cast_eager(x, scale, fp8_max, dtype, transpose)


def _update_with_triton(meta: ScalingMeta, amax: torch.Tensor, rule: dict) -> bool:
    """Run `meta`'s update in the Triton kernel when it suits; False leaves it to the caller."""
    history, scale = meta.amax_history, meta.scale
    if not on_cuda(history) or "update" in _failed or "triton" not in _requested_paths():
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
        kernels.update_scale(history, scale, amax, **rule)
    except Exception as err:  # noqa: BLE001 - the eager update is correct too
        mark_failed("update", err)
        return False
    _counts.add("update_triton")
    return True


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
    return _counts.snapshot()


def reset_cast_path_counts() -> None:
    """Set every `cast_path_counts` entry to zero."""
    _counts.reset()


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
    meta.fit(recipe)
    meta.casts += 1
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
    kernels = one_launch_kernels(x)
    history = meta.amax_history
    if kernels is None or not (
        _suits_kernel(kernels, x, meta.scale, meta.dtype, transpose or column_sum)
        and history.device == x.device
        and history.is_contiguous()
        and history.numel() <= kernels.MAX_FUSED_HISTORY
    ):
        return None
    try:
        data, data_t, scale_inv, sums = kernels.cast_transpose_update(
            x,
            meta.scale,
            history,
            meta.fused_workspace(),
            meta.fp8_max,
            meta.dtype,
            transpose,
            column_sums=column_sum,
            **meta.rule_args(recipe),
        )
    except Exception as err:  # noqa: BLE001 - the unfused paths are correct too
        mark_failed("triton", err)
        return None
    count_one_launch()
    total = sums.sum(0).to(x.dtype) if sums is not None else None
    return Quantized(data, scale_inv, data_t), total
