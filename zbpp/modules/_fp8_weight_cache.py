"""One weight's FP8 cast, kept across the microbatches of an optimizer step.

Between two optimizer steps every microbatch casts the same weight values again: a third of an
FP8 layer's cast traffic per microbatch (x, W and dy are each cast once). Transformer Engine's
``is_first_microbatch`` forward argument avoids that, and zbpp's layers take it with the same
meaning:

- ``None`` (default): cast the weight on every call and keep nothing;
- ``True``: cast it (stepping the weight's amax history as any cast does) and keep the cast;
- ``False``: reuse the kept cast, without stepping the history, while it still belongs to the
  weight: the same tensor with the same storage and version counter, no optimizer step since, the
  same scaling slot, and a transpose where this call needs one. Otherwise cast afresh and keep
  that.

In-place updates (``weight.add_``, ``copy_``, ``load_state_dict``) bump the version counter, so a
stale cast is never used after them. torch.optim's fused optimizers (``fused=True``) do not bump
it, so any ``torch.optim`` step also drops every kept cast (a process-wide step count, from
``register_optimizer_step_post_hook``). Writes through ``weight.data`` and updates by other means
change neither, which is why, as with Transformer Engine, the first microbatch after every
optimizer step must pass ``True``.

A ``copy.deepcopy`` (or ``torch.save``/``torch.load``) of a layer keeps its own copy of a kept
cast, tied to its own copy of the weight: the copy then reuses it exactly where the original would.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .fp8 import DelayedScaling, Quantized, ScalingMeta, quantize

__all__ = ["Fp8WeightCache", "check_first_microbatch", "optimizer_steps", "outside_inference_mode",
           "step_first_microbatch"]


def check_first_microbatch(owner: str, value: object) -> bool | None:
    """`value` when it is None, True or False; a TypeError naming `owner` otherwise."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(
            f"{owner}: is_first_microbatch={value!r}; pass True on the first microbatch after an "
            "optimizer step, False on the others, or None to cast the weights on every call"
        )
    return value


def step_first_microbatch(key: object) -> bool | None:
    """``is_first_microbatch`` read from a `Pipeline` microbatch key ``(stage, j)``: True for the
    step's first microbatch (j == 0), False for the others; None (cast on every call) for any other
    key. Every schedule runs a stage's F tasks in microbatch order, so j == 0 casts first.

    >>> step_first_microbatch((1, 0)), step_first_microbatch((1, 3)), step_first_microbatch("a")
    (True, False, None)
    """
    if isinstance(key, tuple) and len(key) == 2 and type(key[1]) is int:
        return key[1] == 0
    return None


# torch.optim steps so far, in this process. Fused optimizers write the parameters without
# bumping their version counters: a kept cast made before a step must not outlive it. Counted
# after the step, so a cast made while a step runs (another thread) is dropped too.
_optimizer_steps = 0


def _count_optimizer_step(optimizer: object, args: object, kwargs: object) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def optimizer_steps() -> int:
    """How many ``torch.optim`` steps this process has run: a kept weight cast is stale once
    this changes."""
    return _optimizer_steps


def outside_inference_mode(kept: bool = True) -> AbstractContextManager[object]:
    """A block whose tensors are no inference tensors when `kept` (they outlive the call): a cast
    made in an evaluation under ``torch.inference_mode`` and kept for later microbatches would be
    one, which a training forward cannot save for its backward. Grad mode stays off in it."""
    if not kept or not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


@dataclass(frozen=True)
class _Kept:
    weight: torch.Tensor
    data_ptr: int
    version: int
    optimizer_steps: int
    slot: ScalingMeta
    cast: Quantized

    def current(self) -> bool:
        """Whether the kept weight still holds the values that were cast."""
        weight = self.weight
        return (self.data_ptr == weight.data_ptr() and self.version == weight._version
                and self.optimizer_steps == _optimizer_steps)

    def belongs_to(self, weight: torch.Tensor, slot: ScalingMeta, transpose: bool) -> bool:
        return (
            self.weight is weight
            and self.current()
            and self.slot is slot
            and self.cast.data.device == weight.device
            and (self.cast.data_t is not None or not transpose)
        )


class Fp8WeightCache:
    """The kept FP8 cast of one GEMM weight (see the module docstring for the rules).

    >>> import torch
    >>> from zbpp.modules.fp8 import DelayedScaling, ScalingMeta
    >>> w, recipe = torch.ones(16, 16), DelayedScaling()
    >>> slot = ScalingMeta(torch.float8_e4m3fn, history_len=4)
    >>> cache = Fp8WeightCache()
    >>> first = cache.cast(w, slot, recipe, transpose=True, first_microbatch=True)
    >>> cache.cast(w, slot, recipe, transpose=True, first_microbatch=False) is first
    True
    >>> with torch.no_grad():
    ...     _ = w.mul_(2)  # as an optimizer step would: the kept cast is stale now
    >>> cache.cast(w, slot, recipe, transpose=True, first_microbatch=False) is first
    False
    """

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: _Kept | None = None

    # copy.deepcopy and torch.load rebuild the weight at another address with a fresh version
    # counter: record the copy's, so that the copy reuses its cast exactly where the original
    # reuses its own (recasting would step the weight slot, and then copy and original differ).
    def __getstate__(self) -> dict:
        kept = self._kept
        if kept is None or not kept.current():
            return {}  # nothing, or nothing the original would reuse
        return {"weight": kept.weight, "optimizer_steps": kept.optimizer_steps,
                "slot": kept.slot, "cast": kept.cast}

    def __setstate__(self, state: dict) -> None:
        self._kept = None
        if state:
            weight = state["weight"]
            self._kept = _Kept(weight, weight.data_ptr(), weight._version, state["optimizer_steps"],
                               state["slot"], state["cast"])

    def clear(self) -> None:
        """Forget the kept cast (and free its memory)."""
        self._kept = None

    @property
    def kept(self) -> bool:
        """Whether a cast is kept."""
        return self._kept is not None

    def cast(
        self,
        weight: torch.Tensor,
        slot: ScalingMeta,
        recipe: DelayedScaling,
        *,
        transpose: bool,
        first_microbatch: bool | None,
    ) -> Quantized:
        """The weight's FP8 cast for this call: the kept one or a fresh `quantize`."""
        if first_microbatch is None:
            self._kept = None
            return quantize(weight, slot, recipe, transpose=transpose)
        kept = self._kept
        if not first_microbatch and kept is not None and kept.belongs_to(weight, slot, transpose):
            return kept.cast
        with outside_inference_mode():
            cast = quantize(weight, slot, recipe, transpose=transpose)
        self._kept = _Kept(weight, weight.data_ptr(), weight._version, _optimizer_steps, slot,
                           cast)
        return cast
