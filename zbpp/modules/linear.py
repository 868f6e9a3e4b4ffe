"""`Linear`: ``y = x W^T + b`` with an optionally delayed weight gradient and FP8."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._layer_function import run_layer, run_linear
from ._shared_input import adopted_slot, cast_by, caller_of
from .base import DelayedWgradModule, _never_compiled, _outside_graph, _tracing

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .base import LayerOptions

__all__ = ["Linear"]


class Linear(DelayedWgradModule):
    """A linear layer, Transformer Engine style (parameters ``weight`` [out, in], ``bias`` [out]).

    With ``delay_wgrad_compute=True`` the backward computes only the input gradient; the weight
    and bias gradients wait for ``backward_dw()`` (see `DelayedWgradModule.backward_dw`, which
    also lists the other keywords every layer takes). Inside `fp8_autocast` the GEMMs run in FP8
    and the bias gradient is computed during the backward.

    >>> import torch
    >>> from zbpp.modules import Linear
    >>> torch.manual_seed(0) and None
    >>> eager, delayed = Linear(8, 4), Linear(8, 4, delay_wgrad_compute=True)
    >>> delayed.load_state_dict(eager.state_dict())
    <All keys matched successfully>
    >>> x = torch.randn(5, 8)
    >>> eager(x).square().sum().backward()
    >>> delayed(x).square().sum().backward(); delayed.backward_dw()
    >>> torch.equal(eager.weight.grad, delayed.weight.grad)
    True
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        **options: Unpack[LayerOptions],
    ) -> None:
        super().__init__(**options)
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self._add_gemm_params("weight", "bias", (out_features, in_features), bias=bias)
        self._built()

    @_never_compiled  # see _outside_graph
    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """``x W^T + b``. `is_first_microbatch` (FP8 only, as in Transformer Engine): True casts
        the weight and keeps the cast, False reuses the kept cast while the weight is unchanged
        (the same tensor at the same version), None (default) casts on every call."""
        if _tracing():  # under torch.compile: out of the graph, so that W stays deferred
            return _outside_graph(Linear.forward, self, x, is_first_microbatch)
        call = self._begin_forward(is_first_microbatch)
        weight, bias = self._forward_params()
        if call.recipe is None:
            gemm = self._plain_call(0, weight, bias)
            return run_linear(x, gemm, self._wgrad_store if self._delay else None, call.key)
        slot = self.fp8_meta.get("input")
        if slot is not None and slot.casts:  # only a fresh slot adopts, or is adopted
            return run_layer(x, self._layer_spec(call, self._gemm_call(0, call, weight, bias)))
        caller = caller_of(self)
        shared = adopted_slot(slot, x, call.recipe, weight.device, caller)
        if shared is not None:  # a sibling just cast x, its slot in this one's state: share it
            self.fp8_meta["input"] = shared
        with cast_by(caller):
            return run_layer(x, self._layer_spec(call, self._gemm_call(0, call, weight, bias)))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, {super().extra_repr()}"
        )
