"""Small delayed-wgrad layers that follow DESIGN.md's protocol, for the reducer tests.

They stand in for `zbpp.modules` (written concurrently) and for real Transformer Engine (absent
here), so the reducer is tested against each behaviour it must handle:

- `KeyedLinear`: zbpp style. Wgrad closures filed under the microbatch key recorded at forward time,
  ``backward_dw(key)``, ``get_backward_dw_params()``, gradients accumulated into ``.grad`` or, with
  ``fuse_wgrad_accumulation``, into ``main_grad``. ``fp8=True`` mimics FP8: the bias gradient is
  computed eagerly during B and handed to autograd, and the deferred GEMM yields none.
  ``fire_hooks=False`` mimics a W replayed from a CUDA graph (hooks inside never fire).
- `TELikeLinear`: Transformer Engine as it is: FIFO store, no keys, no ``get_backward_dw_params``,
  ``backward_dw()`` *overwrites* ``weight.grad`` and backfills ``bias.grad`` only when it is None.

Each has the same parameter names as ``torch.nn.Linear`` (``weight``, ``bias``), so a test loads a
plain ``nn.Linear``'s state dict into it and uses the plain module as the independent reference.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable

import torch
from torch import nn

from zbpp.modules.context import current_microbatch

__all__ = ["KeyedLinear", "TELikeLinear"]


class _DeferredLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, module: Any, key: Any):
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.key, ctx.has_bias = module, key, bias is not None
        y = x @ weight.t()
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        module = ctx.module
        eager_bias = g.sum(0) if ctx.has_bias and module.eager_bias else None
        module._file(ctx.key, x.detach(), g.detach())
        return g @ weight, None, eager_bias, None, None


class _DelayedBase(nn.Module):
    eager_bias = False

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool = True, fuse_wgrad_accumulation: bool = False
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.wgrad_hooks: list[Callable[[], None]] = []
        self.hook_calls = 0
        for p in self.parameters():
            p.skip_backward_post_hook = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DeferredLinearFn.apply(x, self.weight, self.bias, self, current_microbatch())

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        self.wgrad_hooks.append(hook)

    def _run_hooks(self) -> None:
        self.hook_calls += 1
        for hook in self.wgrad_hooks:
            hook()

    def _wgrads(self, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        gb = g.sum(0) if self.bias is not None and not self.eager_bias else None
        return g.t() @ x, gb


class KeyedLinear(_DelayedBase):
    """zbpp-style delayed Linear (see the module docstring)."""

    def __init__(self, *args: Any, fp8: bool = False, fire_hooks: bool = True, **kw: Any):
        super().__init__(*args, **kw)
        self.eager_bias = fp8
        self.fire_hooks = fire_hooks
        self._store: "OrderedDict[Hashable, tuple[torch.Tensor, torch.Tensor]]" = OrderedDict()

    def _file(self, key: Hashable, x: torch.Tensor, g: torch.Tensor) -> None:
        if key in self._store:
            raise RuntimeError(f"microbatch {key!r} already has a pending wgrad")
        self._store[key] = (x, g)

    def backward_dw(self, key: Hashable | None = None) -> None:
        if not self._store:
            raise RuntimeError("backward_dw(): nothing pending")
        x, g = self._store.pop(key) if key is not None else self._store.popitem(last=False)[1]
        gw, gb = self._wgrads(x, g)
        if self.fuse_wgrad_accumulation:
            self.weight.main_grad.add_(gw)
        else:
            self.weight.grad = gw if self.weight.grad is None else self.weight.grad + gw
        if gb is not None:  # only when the deferred GEMM produced one (never in FP8)
            self.bias.grad = gb if self.bias.grad is None else self.bias.grad + gb
        if self.fire_hooks:
            self._run_hooks()

    def get_backward_dw_params(self) -> list[nn.Parameter]:
        return [self.weight] + ([self.bias] if self.bias is not None else [])


class TELikeLinear(_DelayedBase):
    """Transformer-Engine-like delayed Linear (see the module docstring)."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self._fifo: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _file(self, key: Hashable, x: torch.Tensor, g: torch.Tensor) -> None:
        self._fifo.append((x, g))

    def backward_dw(self) -> None:
        x, g = self._fifo.pop(0)
        gw, gb = self._wgrads(x, g)
        if self.fuse_wgrad_accumulation:
            self.weight.main_grad.add_(gw)
        else:
            self.weight.grad = gw  # TE overwrites: the reducer's hook must have moved the last one
        if gb is not None and self.bias.grad is None:
            self.bias.grad = gb
        self._run_hooks()
