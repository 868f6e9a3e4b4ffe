"""zbpp.modules: Transformer Engine style layers whose weight gradient can wait (the W task).

``Linear``, ``LayerNormLinear`` and ``LayerNormMLP`` built with ``delay_wgrad_compute=True``
compute only input gradients in their backward (B) and keep a wgrad job per forward, filed under
the microbatch key the forward ran in (``with microbatch(key):``); ``backward_dw(key)`` (W)
computes it. Each call is one autograd node (``_layer_function``). ``LayerNormLinear`` and
``LayerNormMLP`` take ``normalization="LayerNorm"`` or ``"RMSNorm"``, and ``LayerNormMLP`` the
activations Transformer Engine names (gelu, qgelu, relu, srelu, silu and their gated units geglu,
qgeglu, reglu, sreglu, swiglu). Inside ``fp8_autocast`` their GEMMs run in FP8 with delayed
scaling, on Hopper with the norm, the activation and its gradient fused into the casts of their
outputs (``_fused``); their ``forward(x, is_first_microbatch=...)`` keeps the weights' FP8 casts
across the microbatches of an optimizer step, as Transformer Engine's does. `delay_wgrad` turns
the ``nn.Linear`` layers of any model (and, on request, HF's ``Conv1D``) into delayed-wgrad
`Linear` layers in place, keeping their Parameter objects; `fuse_gated_mlps` makes a model's gated
MLPs (``down(act(gate(x)) * up(x))``) run in FP8 as one layer each. This package imports neither
the runtime nor the schedules.

>>> import torch
>>> from zbpp.modules import Linear, microbatch, is_delayed, supports_keys
>>> layer = Linear(4, 4, delay_wgrad_compute=True)
>>> for j in range(2):
...     with microbatch(j):
...         layer(torch.randn(2, 4)).sum().backward()
>>> layer.pending_wgrad_keys(), is_delayed(layer), supports_keys(layer)
([0, 1], True, True)
>>> layer.backward_dw(1); layer.backward_dw(0); layer.pending_wgrad_keys()
[]
"""

from __future__ import annotations

from .base import is_delayed, supports_keys
from .context import current_microbatch, microbatch
from .fp8 import DelayedScaling, Format, fp8_autocast
from .gated_mlp import fuse_gated_mlps
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .swap import delay_wgrad

__all__ = [
    "Linear",
    "LayerNormLinear",
    "LayerNormMLP",
    "fp8_autocast",
    "DelayedScaling",
    "Format",
    "microbatch",
    "current_microbatch",
    "is_delayed",
    "supports_keys",
    "delay_wgrad",
    "fuse_gated_mlps",
]
