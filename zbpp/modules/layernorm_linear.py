"""`LayerNormLinear`: a LayerNorm (or RMSNorm) followed by a `Linear`, as one module."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._layer_function import run_layer
from .base import DelayedWgradModule, _never_compiled, _outside_graph, _tracing

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .base import LayerOptions

__all__ = ["LayerNormLinear"]


class LayerNormLinear(DelayedWgradModule):
    """``Linear(norm(x))`` with Transformer Engine's parameter names.

    Parameters: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only; RMSNorm has none),
    ``weight`` [out, in], ``bias`` [out]. With ``delay_wgrad_compute=True`` only the GEMM's
    weight (and bias) gradients wait for ``backward_dw()``; the normalisation's small gradients
    are computed during the backward (B), so `get_backward_dw_params` never lists them. The
    keywords every layer takes: see `DelayedWgradModule`.

    >>> import torch
    >>> from zbpp.modules import LayerNormLinear
    >>> layer = LayerNormLinear(8, 4, normalization="RMSNorm", delay_wgrad_compute=True)
    >>> layer(torch.randn(3, 8)).sum().backward()
    >>> layer.layer_norm_weight.grad is not None, layer.weight.grad is None
    (True, True)
    >>> layer.backward_dw(); layer.weight.grad is not None
    True
    """

    _forward_param_names = ("layer_norm_weight", "layer_norm_bias", "weight", "bias")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        **options: Unpack[LayerOptions],
    ) -> None:
        super().__init__(**options)
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.normalization, self.eps = normalization, eps
        self._add_norm_params(in_features, normalization)
        self._add_gemm_params("weight", "bias", (out_features, in_features), bias=bias)
        self._built()

    @_never_compiled  # see _outside_graph
    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """``norm(x) W^T + b``; `is_first_microbatch` as in `Linear.forward`."""
        if _tracing():  # under torch.compile: out of the graph, so that W stays deferred
            return _outside_graph(LayerNormLinear.forward, self, x, is_first_microbatch)
        call = self._begin_forward(is_first_microbatch)
        norm_w, norm_b, weight, bias = self._forward_params()
        fc = self._gemm_call(0, call, weight, bias)
        spec = self._layer_spec(call, fc, normalization=self.normalization, eps=self.eps)
        return run_layer(x, spec, norm_w, norm_b)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, normalization={self.normalization}, {super().extra_repr()}"
        )
