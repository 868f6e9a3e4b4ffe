"""The activations of `LayerNormMLP`, Transformer Engine's names: each one's value and gradient.

Five elementwise functions, each also as a gated linear unit (GLU): fc1 then yields ``[gate, up]``
(twice ``ffn_hidden_size`` columns) and the activation is ``f(gate) * up``.

=========  ======================================  =========
name       f(x)                                    GLU name
=========  ======================================  =========
``gelu``   ``x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))`` (tanh approximation)  ``geglu``
``qgelu``  ``x * sigmoid(1.702 x)`` (quick GELU)   ``qgeglu``
``relu``   ``max(x, 0)``                           ``reglu``
``srelu``  ``max(x, 0)^2`` (squared ReLU)          ``sreglu``
``silu``   ``x * sigmoid(x)``                      ``swiglu``
=========  ======================================  =========

Numerics (the definition the fused FP8 kernels in `_fused_triton` follow): everything is computed
in float32 (float64 for float64 tensors) from the layer's tensors and rounded once to their dtype;
a GLU's product and its two gradients (``d gate = f'(gate) (dy up)``, ``d up = dy f(gate)``) too.

>>> import torch
>>> act = ACTIVATIONS["swiglu"]
>>> h = torch.tensor([[1.0, -2.0, 3.0, 4.0]])       # gate [1, -2], up [3, 4]
>>> act.glu, act.forward(h)
(True, tensor([[ 2.1932, -0.9536]]))
>>> act.backward(torch.ones(1, 2), h).shape        # gradients of gate and up
torch.Size([1, 4])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["Activation", "ACTIVATIONS"]

Fn = Callable[[torch.Tensor], torch.Tensor]
GradFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (grad, x) -> grad * f'(x)

_QUICK = 1.702  # quick GELU's sigmoid slope


def _opmath(t: torch.Tensor) -> torch.Tensor:
    # float32, or float64 for float64 tensors
    return t if t.dtype == torch.float64 else t.float()


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward.default(grad, x, approximate="tanh")


def _qgelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(_QUICK * x)


def _qgelu_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(_QUICK * x)
    return grad * (s + _QUICK * x * s * (1 - s))


def _relu_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.threshold_backward.default(grad, x, 0)


def _srelu(x: torch.Tensor) -> torch.Tensor:
    r = F.relu(x)
    return r * r


def _srelu_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return grad * (2 * F.relu(x))


def _silu_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.silu_backward.default(grad, x)


# base name -> (float32 function, float32 grad * derivative, kernel id in _fused_triton, and
# whether torch's own op already computes in float32 and rounds once for 16-bit inputs)
_BASES: dict[str, tuple[Fn, GradFn, int, bool]] = {
    "gelu": (_gelu, _gelu_grad, 0, True),
    "qgelu": (_qgelu, _qgelu_grad, 1, False),
    "relu": (F.relu, _relu_grad, 2, True),
    "srelu": (_srelu, _srelu_grad, 3, False),
    "silu": (F.silu, _silu_grad, 4, True),
}
_GLU_NAMES = {"gelu": "geglu", "qgelu": "qgeglu", "relu": "reglu", "srelu": "sreglu",
              "silu": "swiglu"}


@dataclass(frozen=True)
class Activation:
    """One activation: `forward` ``h -> a`` and `backward` ``(da, h) -> dh`` in h's dtype."""

    name: str
    base: str  # the elementwise function f (the GLU's gate function)
    glu: bool  # h = [gate, up] and a = f(gate) * up
    kernel_id: int  # f's number in the fused Triton kernels

    def __post_init__(self) -> None:
        fn, grad_fn, _, native = _BASES[self.base]
        if native and not self.glu:  # torch's own op as it is: the methods would only wrap it
            object.__setattr__(self, "forward", fn)
            object.__setattr__(self, "backward", grad_fn)

    @property
    def width(self) -> int:
        """How many times ``ffn_hidden_size`` columns fc1 produces (2 for a GLU)."""
        return 2 if self.glu else 1

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The activation of `h` (last dimension ``width * ffn``), rounded once to h's dtype."""
        fn, _, _, native = _BASES[self.base]
        if not self.glu:
            return fn(h) if native else fn(_opmath(h)).to(h.dtype)
        gate, up = _opmath(h).chunk(2, dim=-1)
        return (fn(gate) * up).to(h.dtype)

    def backward(self, da: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The gradient with respect to `h` given the gradient `da` of the activation's output."""
        _, grad_fn, _, native = _BASES[self.base]
        if not self.glu:
            if native:
                return grad_fn(da, h)
            return grad_fn(_opmath(da), _opmath(h)).to(h.dtype)
        fn = _BASES[self.base][0]
        gate, up = _opmath(h).chunk(2, dim=-1)
        da32 = _opmath(da)
        d_gate = grad_fn(da32 * up, gate)
        d_up = da32 * fn(gate)
        return torch.cat([d_gate, d_up], dim=-1).to(h.dtype)


ACTIVATIONS: dict[str, Activation] = {}
for _base, (_, _, _kid, _) in _BASES.items():
    ACTIVATIONS[_base] = Activation(_base, _base, False, _kid)
    ACTIVATIONS[_GLU_NAMES[_base]] = Activation(_GLU_NAMES[_base], _base, True, _kid)
