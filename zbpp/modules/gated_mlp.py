"""`fuse_gated_mlps`: a model's gated MLPs, ``down(act(gate(x)) * up(x))``, as one FP8 layer each.

Swapped into zbpp `Linear`s (`delay_wgrad`), a Hugging Face gated MLP (Llama's, Qwen's, Mistral's,
Gemma's ...) runs in FP8 as three GEMM layers with the model's own activation and product between
them: three autograd nodes and the activation's, separate casts of gate's and up's outputs'
gradients, and the activation's output written in 16 bits and read again to be cast. A fused MLP
runs, inside `fp8_autocast`, as `LayerNormMLP` runs without its norm:

- gate and up are one GEMM over their weights stacked ``[gate; up]``, cast to FP8 with one scaling
  slot (gate's weight slot: one amax over both, as a packed fc1's) and kept for the step's later
  microbatches as any weight cast (`Linear`'s ``is_first_microbatch`` rules, read from gate);
- the activation and the product are fused with the cast of down's input (`_fused.act_quantize`),
  and in the backward the activation's gradient with the cast of the stacked gradient
  (`_fused.dact_quantize`): one autograd node for the whole MLP;
- the weight gradients stay three jobs, each filed in its own `Linear`'s store under that layer's
  key (``backward_dw`` of each computes its own), from the same FP8 operands as the layers' own.

Outside `fp8_autocast`, and whenever the three layers are not delayed-wgrad zbpp `Linear`s without
biases, the model's own forward runs. `fuse_gated_mlps` fuses a module only after checking, on its
own weights, that its forward computes exactly ``down(act(gate(x)) * up(x))`` with an activation
zbpp fuses (SiLU: ``swiglu``; GELU, tanh approximation: ``geglu``); the module object, its class's
methods and its parameters stay (its class becomes a subclass with this forward).

>>> import torch
>>> from torch import nn
>>> class MLP(nn.Module):  # the form of Hugging Face's LlamaMLP
...     def __init__(self):
...         super().__init__()
...         self.gate_proj, self.up_proj = nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=False)
...         self.down_proj, self.act_fn = nn.Linear(32, 16, bias=False), nn.SiLU()
...     def forward(self, x):
...         return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
>>> model = nn.Sequential(MLP(), MLP())
>>> fuse_gated_mlps(model)
['0', '1']
>>> type(model[0]).__name__, isinstance(model[0], MLP)
('MLPFusedFp8', True)
"""

from __future__ import annotations

from typing import Any, Hashable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ._activations import ACTIVATIONS, Activation
from ._fused import act_quantize, dact_quantize
from ._layer_function import GemmCall, _Job, _quantize_grad, _WgradPart
from ._shared_input import cast_input
from .base import _outside_graph, _tracing
from .fp8 import DelayedScaling, Quantized, ScalingMeta, active_recipe, fp8_gemm_nt, quantize
from .linear import Linear
from .wgrad_store import WgradStore

__all__ = ["fuse_gated_mlps"]

_NAMES = ("gate_proj", "up_proj", "down_proj")
_ACT_NAMES = ("act_fn", "activation_fn")  # Llama 4 names it the latter
_CACHE = "gate_up_proj"  # the stacked weights' cast, among gate's kept casts (freed with them)


def fuse_gated_mlps(model: nn.Module) -> list[str]:
    """Make each gated MLP of `model` run as one FP8 layer inside `fp8_autocast` (see the module
    docstring), in place; return the fully qualified names of those it fused.

    A candidate has ``gate_proj``, ``up_proj`` and ``down_proj`` linear layers (``nn.Linear`` or zbpp
    `Linear`, no biases, gate and up of one shape) and an ``act_fn`` (or ``activation_fn``); it is fused when its forward,
    run once on its own weights without gradients, equals ``down(act(gate(x)) * up(x))`` bit for bit
    and its ``act_fn`` is SiLU or tanh-approximated GELU. Modules with weights on the meta device are
    left alone. Call it before or after `delay_wgrad`; the fused path runs once the three layers are
    delayed-wgrad zbpp `Linear`s (`zbpp.models.fast.fast_stage` with ``fp8`` does both).
    """
    fused = []
    for name, module in model.named_modules():
        if isinstance(module, _FusedGatedMlp):
            fused.append(name)
            continue
        act = _fusable(module)
        if act is None:
            continue
        cls = type(module)
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"{cls.__name__}FusedFp8", (_FusedGatedMlp, cls), {"__module__": cls.__module__})
        module.__class__ = _CLASSES[cls]
        object.__setattr__(module, "_zbpp_activation", act)
        fused.append(name)
    return fused


_CLASSES: dict[type, type] = {}


def _fusable(module: nn.Module) -> Activation | None:
    """The activation to fuse `module` with, or None when it is not a gated MLP of the form."""
    parts = [getattr(module, n, None) for n in _NAMES]
    act_fn = next((getattr(module, n) for n in _ACT_NAMES if getattr(module, n, None) is not None), None)
    if any(p is None for p in parts) or act_fn is None:
        return None
    gate, up, down = parts
    if not all(isinstance(m, nn.Linear) for m in (gate, up, down)):
        return None
    if any(m.bias is not None for m in (gate, up, down)) or gate.weight.shape != up.weight.shape:
        return None
    if down.weight.shape[1] != gate.weight.shape[0] or not callable(act_fn):
        return None
    weights = [gate.weight, up.weight, down.weight]
    if any(w.is_meta for w in weights) or len({(w.dtype, w.device) for w in weights}) != 1:
        return None
    w = gate.weight
    # the probe: values spread over the activation's curved part, no random numbers drawn
    x = torch.linspace(-3, 3, 2 * w.shape[1], dtype=w.dtype, device=w.device).reshape(2, -1)
    with torch.no_grad():
        t = torch.linspace(-6, 6, 257, dtype=torch.float32, device=w.device)
        found = None
        for name, reference in (("swiglu", F.silu), ("geglu", lambda v: F.gelu(v, approximate="tanh"))):
            if torch.allclose(act_fn(t), reference(t), rtol=1e-6, atol=1e-6):
                found = name
        if found is None:
            return None
        try:
            theirs = type(module).forward(module, x)
        except Exception:  # noqa: BLE001 - a forward that takes more than x is not of the form
            return None
        ours = down(act_fn(gate(x)) * up(x))
    if not isinstance(theirs, torch.Tensor) or not torch.equal(theirs, ours):
        return None
    return ACTIVATIONS[found]


class _StackedCast:
    """The FP8 cast of ``[gate; up]``, kept across a step's microbatches by `Fp8WeightCache`'s
    rules: None casts and keeps nothing, True casts and keeps, False reuses the kept cast while
    both weights are the very tensors at the same storage and version, and the slot the same."""

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        # (gate, up, slot, their storage and versions, the cast): the tensors held, so that their
        # identity cannot pass to others
        self._kept: tuple[torch.Tensor, torch.Tensor, ScalingMeta, tuple[int, ...], Quantized] | None = None

    def clear(self) -> None:
        self._kept = None

    @property
    def kept(self) -> bool:
        return self._kept is not None

    def cast(self, gate: torch.Tensor, up: torch.Tensor, slot: ScalingMeta, recipe: DelayedScaling,
             first_microbatch: bool | None) -> Quantized:
        kept, state = self._kept, (gate.data_ptr(), up.data_ptr(), gate._version, up._version)
        if first_microbatch is False and kept is not None and kept[0] is gate and kept[1] is up \
                and kept[2] is slot and kept[3] == state:
            return kept[4]
        with torch.no_grad():
            cast = quantize(torch.cat([gate, up]), slot, recipe, transpose=True)
        self._kept = (gate, up, slot, state, cast) if first_microbatch is not None else None
        return cast


class _Plan(NamedTuple):
    # what one fused call needs besides x, read on the forward's thread
    gate: GemmCall
    up: GemmCall
    down: GemmCall
    w1: Quantized  # the cast of [gate; up]
    act: Activation
    recipe: DelayedScaling
    stores: tuple[WgradStore, WgradStore, WgradStore]
    keys: tuple[Hashable, Hashable, Hashable]


class _GatedMlpFunction(torch.autograd.Function):
    """`_LayerFunction`'s FP8 path without a norm, fc1 = [gate; up], its weight gradient split."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: _Plan) -> torch.Tensor:  # type: ignore[override]
        recipe, gate, down = plan.recipe, plan.gate, plan.down
        need_w1 = gate.weight.requires_grad or plan.up.weight.requires_grad
        need_w2 = down.weight.requires_grad
        xq = cast_input(x, gate.fp8.input, recipe, need_w1, gate.weight)
        h = fp8_gemm_nt(xq, plan.w1, out_dtype=x.dtype, fast_accumulation=recipe.fprop_fast_accumulation)
        a = act_quantize(h, plan.act, down.fp8.input, recipe, transpose=need_w2)
        w2 = down.fp8.weight_cache.cast(down.weight, down.fp8.weight, recipe, transpose=True,
                                        first_microbatch=down.fp8.first_microbatch)
        y = fp8_gemm_nt(a, w2, out_dtype=x.dtype, fast_accumulation=recipe.fprop_fast_accumulation)
        ctx.plan = plan
        ctx.save_for_backward(xq.data_t, xq.scale_inv, plan.w1.data_t, plan.w1.scale_inv, h, a.data_t,
                              a.scale_inv, w2.data_t, w2.scale_inv)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        plan: _Plan = ctx.plan
        x_t, x_sinv, w1_t, w1_sinv, h, a_t, a_sinv, w2_t, w2_sinv = ctx.saved_tensors
        gate, up, down = plan.gate, plan.up, plan.down
        if not dy.is_contiguous():
            dy = dy.contiguous()
        need_w2 = down.weight.requires_grad
        need_w1 = gate.weight.requires_grad or up.weight.requires_grad
        dy_q, _ = _quantize_grad(dy, down.fp8, need_w2, False)
        da = fp8_gemm_nt(dy_q, Quantized(w2_t, w2_sinv), out_dtype=dy.dtype)
        g1, _ = dact_quantize(da, h, plan.act, gate.fp8.grad_output, plan.recipe, transpose=need_w1,
                              column_sum=False)
        dx = fp8_gemm_nt(g1, Quantized(w1_t, w1_sinv), out_dtype=dy.dtype) if ctx.needs_input_grad[0] else None
        x_q = Quantized(x_t, x_sinv)
        rows = h.shape[1] // 2  # g1^T's first rows are gate's, the others up's
        operands = {
            0: (Quantized(g1.data_t[:rows], g1.scale_inv), x_q) if gate.weight.requires_grad else None,
            1: (Quantized(g1.data_t[rows:], g1.scale_inv), x_q) if up.weight.requires_grad else None,
            2: (Quantized(dy_q.data_t, dy_q.scale_inv), Quantized(a_t, a_sinv)) if need_w2 else None,
        }
        for i, call in enumerate((gate, up, down)):
            if operands[i] is not None:
                plan.stores[i].put(plan.keys[i], _Job([_WgradPart(call, operands[i], None)], True))
        return dx, None


class _FusedGatedMlp(nn.Module):
    """Mixed into a gated MLP's own class by `fuse_gated_mlps`."""

    _zbpp_activation: Activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if _tracing():  # under torch.compile: out of the graph, so that W stays deferred
            return _outside_graph(_FusedGatedMlp.forward, self, x)
        recipe = active_recipe()
        layers = (self.gate_proj, self.up_proj, self.down_proj)
        if recipe is None or not all(type(m) is Linear and m._delay and m.bias is None for m in layers) \
                or x.dtype != self.gate_proj.weight.dtype:
            return super().forward(x)
        gate, up, down = layers
        calls = [m._begin_forward() for m in layers]
        g_call = gate._gemm_call(0, calls[0], gate.weight, None)
        d_call = down._gemm_call(0, calls[2], down.weight, None)
        u_call = up._plain_call(0, up.weight, None)  # no slots: its casts are gate's
        cache = gate._fp8_weight_casts.get(_CACHE)
        if cache is None:
            cache = gate._fp8_weight_casts[_CACHE] = _StackedCast()  # type: ignore[assignment]
        w1 = cache.cast(gate.weight, up.weight, g_call.fp8.weight, recipe, g_call.fp8.first_microbatch)
        plan = _Plan(g_call, u_call, d_call, w1, self._zbpp_activation, recipe,
                     (gate._wgrad_store, up._wgrad_store, down._wgrad_store), tuple(c.key for c in calls))
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y = _GatedMlpFunction.apply(x2, plan)
        return y if x2 is x else y.view(*x.shape[:-1], y.shape[-1])
