"""The FP8 recipe and the autocast region that activates it.

The active recipe is context state (a `contextvars.ContextVar`): each thread, and each asyncio
task, sees the recipe of its own innermost `fp8_autocast` block, and a block restores exactly what
it found when it ends. A layer reads it once per forward, on the caller's thread, and keeps it with
the saved tensors, so its backward (which on GPUs autograd runs on its own thread, where nothing
set by the caller is visible) uses the forward's recipe.
"""

from __future__ import annotations

import enum
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from ..context import bound

__all__ = ["Format", "DelayedScaling", "fp8_autocast", "active_recipe"]


class Format(enum.Enum):
    """Which float8 formats the forward tensors and the gradients use.

    >>> DelayedScaling(fp8_format=Format.HYBRID).bwd_dtype, DelayedScaling(fp8_format=Format.E4M3).bwd_dtype
    (torch.float8_e5m2, torch.float8_e4m3fn)
    """

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


_active: ContextVar[DelayedScaling | None] = ContextVar("zbpp_fp8_recipe", default=None)


def fp8_autocast(
    enabled: bool = True, *, fp8_recipe: DelayedScaling | None = None
) -> AbstractContextManager[DelayedScaling | None]:
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
    return bound(_active, recipe)


def active_recipe() -> DelayedScaling | None:
    """The recipe of the innermost `fp8_autocast` block, or None when FP8 is off."""
    return _active.get()
