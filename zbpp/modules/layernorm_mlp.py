"""`LayerNormMLP`: norm, fc1, activation, fc2 as one module."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ._init import InitMethod, add_gemm_params, default_init
from ._linear_function import linear
from ._norm import make_norm_params, normalize
from .base import DelayedWgradModule

__all__ = ["LayerNormMLP", "ACTIVATIONS"]


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


#: name -> (function, how many times ffn_hidden_size fc1 produces)
ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
    "gelu": (lambda h: F.gelu(h, approximate="tanh"), 1),  # tanh approximation, as in TE
    "relu": (F.relu, 1),
    "silu": (F.silu, 1),
    "swiglu": (_swiglu, 2),  # fc1 yields [gate, up]; silu(gate) * up
}


class LayerNormMLP(DelayedWgradModule):
    """``fc2(act(fc1(norm(x))))`` with Transformer Engine's parameter names.

    Parameters: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only), ``fc1_weight``
    [ffn (x2 for swiglu), hidden], ``fc1_bias``, ``fc2_weight`` [hidden, ffn], ``fc2_bias``.
    ``activation``: "gelu" (tanh approximation, default), "relu", "silu" or "swiglu".

    With ``delay_wgrad_compute=True`` both GEMMs' weight (and bias) gradients wait for one
    ``backward_dw()``, which runs fc2's and fc1's jobs of that microbatch; the normalisation's
    gradients are computed during the backward (B).

    >>> import torch
    >>> from zbpp.modules import LayerNormMLP
    >>> mlp = LayerNormMLP(8, 32, delay_wgrad_compute=True)
    >>> mlp(torch.randn(2, 3, 8)).sum().backward(); mlp.backward_dw()
    >>> [p.grad is not None for p in mlp.get_backward_dw_params()]
    [True, True, True, True]
    """

    _gemm_names = (("fc1_", "fc1_weight", "fc1_bias"), ("fc2_", "fc2_weight", "fc2_bias"))

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        *,
        activation: str = "gelu",
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: InitMethod | None = None,
        output_layer_init_method: InitMethod | None = None,
    ) -> None:
        super().__init__(
            delay_wgrad_compute=delay_wgrad_compute,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        )
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"LayerNormMLP: activation={activation!r}; use one of {sorted(ACTIVATIONS)}"
            )
        self.hidden_size, self.ffn_hidden_size, self.use_bias = hidden_size, ffn_hidden_size, bias
        self.activation, self.normalization, self.eps = activation, normalization, eps
        width = ffn_hidden_size * ACTIVATIONS[activation][1]
        kw = dict(dtype=params_dtype, device=device)
        make_norm_params(self, hidden_size, normalization, **kw)
        init = init_method or default_init
        # Transformer Engine's order: fc1_weight, fc1_bias, fc2_weight, fc2_bias
        add_gemm_params(self, "fc1_weight", "fc1_bias", (width, hidden_size), bias=bias, init=init,
                        **kw)
        add_gemm_params(self, "fc2_weight", "fc2_bias", (hidden_size, ffn_hidden_size), bias=bias,
                        init=output_layer_init_method or init, **kw)
        self._sync_param_flags()

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """``fc2(act(fc1(norm(x))))``; `is_first_microbatch` as in `Linear.forward` (both
        weights)."""
        call = self._begin_forward(is_first_microbatch)
        h = normalize(x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        h = linear(h, self.fc1_weight, self.fc1_bias, self._gemm_call(0, call))
        h = ACTIVATIONS[self.activation][0](h)
        return linear(h, self.fc2_weight, self.fc2_bias, self._gemm_call(1, call))

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"activation={self.activation}, normalization={self.normalization}, "
            f"{super().extra_repr()}"
        )
