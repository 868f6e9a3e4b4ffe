"""`LayerNormMLP`: norm, fc1, activation, fc2 as one module."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._activations import ACTIVATIONS
from ._init import InitMethod
from ._layer_function import run_layer
from .base import DelayedWgradModule, _never_compiled, _outside_graph, _tracing

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .base import LayerOptions

__all__ = ["LayerNormMLP", "ACTIVATIONS"]


class LayerNormMLP(DelayedWgradModule):
    """``fc2(act(fc1(norm(x))))`` with Transformer Engine's parameter names.

    Parameters: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only), ``fc1_weight``
    [ffn (x2 for the gated ones), hidden], ``fc1_bias``, ``fc2_weight`` [hidden, ffn],
    ``fc2_bias``. ``activation``, as Transformer Engine names them: "gelu" (tanh approximation,
    default), "qgelu", "relu", "srelu" (squared ReLU), "silu", and their gated linear units
    "geglu", "qgeglu", "reglu", "sreglu", "swiglu" (fc1 yields [gate, up]; ``act(gate) * up``);
    see `zbpp.modules._activations` for their numerics. ``normalization``: "LayerNorm" or
    "RMSNorm".

    With ``delay_wgrad_compute=True`` both GEMMs' weight (and bias) gradients wait for one
    ``backward_dw()``, which runs fc2's and fc1's jobs of that microbatch; the normalisation's
    gradients are computed during the backward (B). ``output_layer_init_method`` fills
    ``fc2_weight`` (default: ``init_method``); the keywords every layer takes: see
    `DelayedWgradModule`.

    >>> import torch
    >>> from zbpp.modules import LayerNormMLP
    >>> mlp = LayerNormMLP(8, 32, delay_wgrad_compute=True)
    >>> mlp(torch.randn(2, 3, 8)).sum().backward(); mlp.backward_dw()
    >>> [p.grad is not None for p in mlp.get_backward_dw_params()]
    [True, True, True, True]
    """

    _gemm_names = (("fc1_", "fc1_weight", "fc1_bias"), ("fc2_", "fc2_weight", "fc2_bias"))
    _forward_param_names = ("layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias",
                            "fc2_weight", "fc2_bias")

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        *,
        activation: str = "gelu",
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        output_layer_init_method: InitMethod | None = None,
        **options: Unpack[LayerOptions],
    ) -> None:
        super().__init__(**options)
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"LayerNormMLP: activation={activation!r}; use one of {sorted(ACTIVATIONS)}"
            )
        self._act = ACTIVATIONS[activation]
        self.hidden_size, self.ffn_hidden_size, self.use_bias = hidden_size, ffn_hidden_size, bias
        self.activation, self.normalization, self.eps = activation, normalization, eps
        width = ffn_hidden_size * self._act.width
        self._add_norm_params(hidden_size, normalization)
        # Transformer Engine's order: fc1_weight, fc1_bias, fc2_weight, fc2_bias
        self._add_gemm_params("fc1_weight", "fc1_bias", (width, hidden_size), bias=bias)
        self._add_gemm_params("fc2_weight", "fc2_bias", (hidden_size, ffn_hidden_size), bias=bias,
                              init=output_layer_init_method)
        self._built()

    @_never_compiled  # see _outside_graph
    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """``fc2(act(fc1(norm(x))))``; `is_first_microbatch` as in `Linear.forward` (both
        weights)."""
        if _tracing():  # under torch.compile: out of the graph, so that W stays deferred
            return _outside_graph(LayerNormMLP.forward, self, x, is_first_microbatch)
        call = self._begin_forward(is_first_microbatch)
        norm_w, norm_b, w1, b1, w2, b2 = self._forward_params()
        fc1 = self._gemm_call(0, call, w1, b1)
        fc2 = self._gemm_call(1, call, w2, b2)
        spec = self._layer_spec(call, fc1, fc2, self.normalization, self.eps, self._act)
        return run_layer(x, spec, norm_w, norm_b)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"activation={self.activation}, normalization={self.normalization}, "
            f"{super().extra_repr()}"
        )
