"""Float64 references of LayerNormMLP's activations, written from their formulas (not from zbpp).

gelu (tanh approximation): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); quick gelu:
x sigmoid(1.702 x); relu: max(x, 0); squared relu: max(x, 0)^2; silu: x sigmoid(x). A gated
unit (geglu, qgeglu, reglu, sreglu, swiglu) splits its input into [gate, up] and gives
f(gate) * up. Derivatives by hand; `test_activations` checks them against autograd in float64.
"""

from __future__ import annotations

import math

import torch

BASE = {"gelu": "gelu", "geglu": "gelu", "qgelu": "qgelu", "qgeglu": "qgelu", "relu": "relu",
        "reglu": "relu", "srelu": "srelu", "sreglu": "srelu", "silu": "silu", "swiglu": "silu"}
GLU = {"geglu", "qgeglu", "reglu", "sreglu", "swiglu"}
_C = math.sqrt(2 / math.pi)


def f(base: str, x: torch.Tensor) -> torch.Tensor:
    """The elementwise function, float64."""
    x = x.double()
    if base == "gelu":
        return 0.5 * x * (1 + torch.tanh(_C * (x + 0.044715 * x**3)))
    if base == "qgelu":
        return x * torch.sigmoid(1.702 * x)
    if base == "relu":
        return x.clamp_min(0)
    if base == "srelu":
        return x.clamp_min(0) ** 2
    if base == "silu":
        return x * torch.sigmoid(x)
    raise KeyError(base)


def df(base: str, x: torch.Tensor) -> torch.Tensor:
    """Its derivative, float64 (relu: 0 at 0, as torch)."""
    x = x.double()
    if base == "gelu":
        t = torch.tanh(_C * (x + 0.044715 * x**3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _C * (1 + 3 * 0.044715 * x * x)
    if base == "qgelu":
        s = torch.sigmoid(1.702 * x)
        return s + 1.702 * x * s * (1 - s)
    if base == "relu":
        return (x > 0).double()
    if base == "srelu":
        return 2 * x.clamp_min(0)
    if base == "silu":
        s = torch.sigmoid(x)
        return s + x * s * (1 - s)
    raise KeyError(base)


def forward(name: str, h: torch.Tensor) -> torch.Tensor:
    """The activation of h (last dimension [gate, up] for a gated unit), float64."""
    if name in GLU:
        gate, up = h.double().chunk(2, dim=-1)
        return f(BASE[name], gate) * up
    return f(BASE[name], h)


def backward(name: str, da: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The gradient with respect to h given the gradient da of the activation, float64."""
    da = da.double()
    if name in GLU:
        gate, up = h.double().chunk(2, dim=-1)
        return torch.cat([da * up * df(BASE[name], gate), da * f(BASE[name], gate)], dim=-1)
    return da * df(BASE[name], h)
