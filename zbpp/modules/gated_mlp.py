"""`fuse_gated_mlps`: a model's gated MLPs, ``down(act(gate(x)) * up(x))``, as one FP8 layer each.

Swapped into zbpp `Linear`s (`delay_wgrad`), a Hugging Face gated MLP (Llama's, Qwen's, Mistral's,
Gemma's ...) runs in FP8 as three GEMM layers (two where gate and up are packed in one: Phi-3's)
with the model's own activation and product between them: an autograd node per layer and the
activation's, separate casts of gate's and up's output gradients, and the activation's output
written in 16 bits and read again to be cast. A fused MLP runs, inside `fp8_autocast`, as
`LayerNormMLP` runs without its norm:

- gate and up are one GEMM over their weights stacked ``[gate; up]``, cast to FP8 with one scaling
  slot (gate's weight slot: one amax over both, as a packed fc1's) and kept for the step's later
  microbatches as any weight cast (`Linear`'s ``is_first_microbatch`` rules, read from gate); a
  packed ``gate_up_proj`` is that GEMM already, and its own slots and kept cast serve;
- the activation and the product are fused with the cast of down's input (`_fused.act_quantize`),
  and in the backward the activation's gradient with the cast of the stacked gradient
  (`_fused.dact_quantize`): one autograd node for the whole MLP;
- the weight gradients stay one job per layer, each filed in its own `Linear`'s store under that
  layer's key (``backward_dw`` of each computes its own), from the same FP8 operands as the
  layers' own.

Outside `fp8_autocast`, whenever the layers are not delayed-wgrad zbpp `Linear`s without biases,
and while any of them or the activation module has a hook (its own or a global module hook: the
fused layer calls none of them), the model's own forward runs; a module with such hooks when
`fuse_gated_mlps` looks at it is not fused (its probe would fire them). `fuse_gated_mlps` fuses a module only after checking, on its
own weights, that its forward computes exactly ``down(act(gate(x)) * up(x))`` with an activation
zbpp fuses (SiLU: ``swiglu``; GELU, tanh approximation: ``geglu``), in training and in eval mode
(a dropout shows in one) and with gate's and up's outputs up to +-128 (a clamp shows there); the
module object, its class's methods and its parameters stay (its class becomes a subclass with this
forward).

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

import contextlib
from typing import Any, Hashable, Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .._compat import runs_hooks
from ._activations import ACTIVATIONS, Activation
from ._fp8_weight_cache import optimizer_steps, outside_inference_mode
from ._fused import act_quantize, dact_quantize
from ._layer_function import _WGRAD_PROBE, GemmCall, _Job, _quantize_grad, _WgradPart, files_wgrad
from ._layer_function import refuse_double_backward
from ._shared_input import cast_input
from .base import _never_compiled, _outside_graph, _tracing
from .fp8 import (DelayedScaling, Quantized, ScalingMeta, active_recipe, fp8_autocast, fp8_gemm_nt,
                  quantize)
from .linear import Linear
from .wgrad_store import WgradStore

__all__ = ["fuse_gated_mlps"]

_ACT_NAMES = ("act_fn", "activation_fn")  # Llama 4 and Phi-3 name it the latter
_CACHE = "gate_up_proj"  # the stacked weights' cast, among gate's kept casts (freed with them)


def fuse_gated_mlps(model: nn.Module) -> list[str]:
    """Make each gated MLP of `model` run as one FP8 layer inside `fp8_autocast` (see the module
    docstring), in place; return the fully qualified names of those it fused.

    A candidate has ``gate_proj`` and ``up_proj`` of one shape, or one ``gate_up_proj`` packing both
    (gate's rows first: Phi-3, GLM), a ``down_proj`` (``nn.Linear`` or zbpp `Linear`, no biases) and
    an ``act_fn`` (or ``activation_fn``); it is fused when its forward, run on its own weights
    without gradients (in both modes, at two scales; random states, modes and buffers restored),
    equals ``down(act(gate(x)) * up(x))`` bit for bit and the activation is SiLU or
    tanh-approximated GELU. Modules with weights on the meta device or all zero are left alone. Call it
    before or after `delay_wgrad`; the fused path runs once the layers are delayed-wgrad zbpp
    `Linear`s (`zbpp.models.fast.fast_stage` with ``fp8`` does both).
    """
    fused = []
    for name, module in model.named_modules():
        if isinstance(module, _FusedGatedMlp):
            fused.append(name)
            continue
        form = _fusable(module)
        if form is None:
            continue
        module.__class__ = _fused_class(type(module))
        object.__setattr__(module, "_zbpp_mlp_form", form)
        fused.append(name)
    return fused


_CLASSES: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    """The subclass of the gated MLP class `cls` that `fuse_gated_mlps` gives its modules (one per
    class, made at run time)."""
    fused = _CLASSES.get(cls)
    if fused is None:
        fused = _CLASSES[cls] = type(f"{cls.__name__}FusedFp8", (_FusedGatedMlp, cls),
                                     {"__module__": cls.__module__})
    return fused


def _new_fused(cls: type) -> nn.Module:
    # unpickling a fused MLP: an empty instance of `cls`'s fused subclass (its state follows)
    return object.__new__(_fused_class(cls))


_ACTIVATIONS = (("swiglu", F.silu), ("geglu", lambda v: F.gelu(v, approximate="tanh")))


class _Form(NamedTuple):
    fc1: tuple[str, ...]  # the attributes whose weights, stacked in this order, are fc1's
    act: Activation
    act_name: str  # the attribute holding the model's activation ...
    act_fn: Any  # ... and the object the probe checked (another one there: the model's forward runs)

    @property
    def act_modules(self) -> tuple[nn.Module, ...]:
        # act_fn where it is a module: its hooks, as the layers', turn the fused path off
        return _modules_of(self.act_fn)


def _modules_of(act_fn: Any) -> tuple[nn.Module, ...]:
    return (act_fn,) if isinstance(act_fn, nn.Module) else ()


def _is_linear(module: object) -> bool:
    # an nn.Linear, or the zbpp Linear delay_wgrad makes of one (not its [in, out] Conv1D form)
    return isinstance(module, nn.Linear) or type(module) is Linear


def _fusable(module: nn.Module) -> _Form | None:
    """How to fuse `module`, or None when it is not a gated MLP of the form."""
    act_name = next((n for n in _ACT_NAMES if getattr(module, n, None) is not None), "")
    act_fn = getattr(module, act_name, None)
    down = getattr(module, "down_proj", None)
    packed = getattr(module, "gate_up_proj", None) is not None
    names = ("gate_up_proj",) if packed else ("gate_proj", "up_proj")
    fc1 = [getattr(module, n, None) for n in names]
    layers = [*fc1, down]
    if act_fn is None or not callable(act_fn) or not all(_is_linear(m) for m in layers):
        return None
    if any(m.bias is not None for m in layers) or len({m.weight.shape for m in fc1}) != 1:
        return None
    rows = sum(m.weight.shape[0] for m in fc1)
    if rows % 2 or down.weight.shape[1] != rows // 2:
        return None
    weights = [m.weight for m in layers]
    if any(w.is_meta for w in weights) or len({(w.dtype, w.device) for w in weights}) != 1:
        return None
    if runs_hooks(*layers, *_modules_of(act_fn)):  # the probe would fire them, and the fused layer would not
        return None
    w = down.weight
    # the probe: values spread over the activation's curved part (no random numbers drawn)
    x = torch.linspace(-3, 3, 2 * fc1[0].weight.shape[1], dtype=w.dtype, device=w.device).reshape(2, -1)
    try:
        with _probing(module):
            t = torch.linspace(-_PROBE_RANGE, _PROBE_RANGE, 2049, dtype=torch.float32, device=w.device)
            found = next((name for name, reference in _ACTIVATIONS
                          if torch.allclose(act_fn(t), reference(t), rtol=1e-6, atol=1e-6)), None)
            if found is None:
                return None
            # ... and again with gate's and up's outputs reaching +-_PROBE_RANGE (a clamp inside the
            # forward shows there), each in training and in eval mode (a dropout shows in one)
            reach = torch.cat([m(x) for m in fc1], dim=-1).abs().max()
            if not 0 < reach < float("inf"):
                return None  # zero weights: nothing to tell the forward from the formula by
            probes = (x, x * (_PROBE_RANGE / reach).to(x.dtype))
            same = all(_computes_formula(module, fc1, down, act_fn, p, training)
                       for p in probes for training in (True, False))
    except Exception:  # noqa: BLE001 - a forward that takes more than x, or sharded weights: not fused
        return None
    if not same:
        return None
    return _Form(names, ACTIVATIONS[found], act_name, act_fn)


_PROBE_RANGE = 128.0  # beyond the clamps gated MLPs use (GPT-OSS's 7); products stay finite in float16


@contextlib.contextmanager
def _probing(module: nn.Module) -> Iterator[None]:
    """No gradients, and afterwards every random state, training flag and buffer as before (a
    dropout in the forward draws numbers, the probe sets the modes, a batch norm would count)."""
    modes = [(m, m.training) for m in module.modules()]
    buffers = [(b, b.clone()) for b in module.buffers()]
    devices = {p.device for p in module.parameters() if p.device.type != "cpu"}
    kinds = {d.type for d in devices}
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[]))  # the CPU generator
            for kind in kinds:
                stack.enter_context(torch.random.fork_rng(devices=[d for d in devices if d.type == kind],
                                                          device_type=kind))
            stack.enter_context(torch.no_grad())
            # zbpp Linears (fused after delay_wgrad) run outside FP8: their scaling state stays
            stack.enter_context(fp8_autocast(enabled=False))
            yield
    finally:
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)


def _computes_formula(module: nn.Module, fc1: list[nn.Module], down: nn.Module, act_fn: Any,
                      x: torch.Tensor, training: bool) -> bool:
    # the module's own forward on x against down(act(gate(x)) * up(x)), bit for bit, in one mode
    module.train(training)
    theirs = type(module).forward(module, x)
    h = torch.cat([m(x) for m in fc1], dim=-1)
    half = h.shape[-1] // 2
    ours = down(act_fn(h[:, :half]) * h[:, half:])
    return isinstance(theirs, torch.Tensor) and torch.equal(theirs, ours) and bool(ours.abs().max() > 0)


def _state(gate: torch.Tensor, up: torch.Tensor) -> tuple[int, ...]:
    # what a kept stacked cast must still find: the storages, versions and optimizer step count
    return (gate.data_ptr(), up.data_ptr(), gate._version, up._version, optimizer_steps())


class _StackedCast:
    """The FP8 cast of ``[gate; up]``, kept across a step's microbatches by `Fp8WeightCache`'s
    rules: None casts and keeps nothing, True casts and keeps, False reuses the kept cast while
    both weights are the very tensors at the same storage and version, no optimizer step ran
    since, and the slot is the same."""

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        # (gate, up, slot, their storage and versions, the cast): the tensors held, so that their
        # identity cannot pass to others
        self._kept: tuple[torch.Tensor, torch.Tensor, ScalingMeta, tuple[int, ...], Quantized] | None = None

    # a deep copy (or torch.load) holds the weights at other addresses with fresh versions: record
    # the copy's, so that it reuses its cast where the original reuses its own (`Fp8WeightCache`)
    def __getstate__(self) -> dict:
        kept = self._kept
        if kept is None or kept[3] != _state(kept[0], kept[1]):
            return {}  # nothing, or nothing the original would reuse
        gate, up, slot, state, cast = kept
        return {"gate": gate, "up": up, "slot": slot, "optimizer_steps": state[-1], "cast": cast}

    def __setstate__(self, state: dict) -> None:
        self._kept = None
        if state:
            gate, up = state["gate"], state["up"]
            own = (*_state(gate, up)[:-1], state["optimizer_steps"])
            self._kept = (gate, up, state["slot"], own, state["cast"])

    def clear(self) -> None:
        self._kept = None

    @property
    def kept(self) -> bool:
        return self._kept is not None

    def cast(self, gate: torch.Tensor, up: torch.Tensor, slot: ScalingMeta, recipe: DelayedScaling,
             first_microbatch: bool | None) -> Quantized:
        kept, state = self._kept, _state(gate, up)
        if first_microbatch is False and kept is not None and kept[0] is gate and kept[1] is up \
                and kept[2] is slot and kept[3] == state:
            return kept[4]
        with outside_inference_mode(first_microbatch is not None), torch.no_grad():
            cast = quantize(torch.cat([gate, up]), slot, recipe, transpose=True)
        self._kept = (gate, up, slot, state, cast) if first_microbatch is not None else None
        return cast


class _Plan(NamedTuple):
    # what one fused call needs besides x, read on the forward's thread
    fc1: tuple[GemmCall, ...]  # gate and up, or gate_up: their weights stacked are fc1's (the first
    #                            call carries the FP8 slots of fc1's input and output gradient)
    down: GemmCall
    w1: Quantized  # the cast of fc1's weight
    act: Activation
    recipe: DelayedScaling
    stores: tuple[WgradStore, ...]  # per layer (fc1's, then down's), where its wgrad job goes
    keys: tuple[Hashable, ...]  # ... under which key


class _GatedMlpFunction(torch.autograd.Function):
    """`_LayerFunction`'s FP8 path without a norm, fc1 = the stacked weights, its gradient split
    into one wgrad job per layer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: _Plan,  # type: ignore[override]
                *anchors: torch.Tensor) -> torch.Tensor:
        # anchors: `_WGRAD_PROBE` (`files_wgrad`) and trainable weights made inputs only so that
        # the node exists (their gradients come from W, never from here); see `_FusedGatedMlp.forward`
        ctx.anchors = len(anchors)
        recipe, first, down = plan.recipe, plan.fc1[0], plan.down
        # per layer (fc1's, then down): whether its weight gradient is wanted, read here, where the
        # transposes dW needs are made (autograd too lets only weights trainable at F and at B have one)
        ctx.wanted = wanted = tuple(c.weight.requires_grad for c in (*plan.fc1, down))
        xq = cast_input(x, first.fp8.input, recipe, any(wanted[:-1]), first.weight)
        h = fp8_gemm_nt(xq, plan.w1, out_dtype=x.dtype, fast_accumulation=recipe.fprop_fast_accumulation)
        a = act_quantize(h, plan.act, down.fp8.input, recipe, transpose=wanted[-1])
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
        if torch.is_grad_enabled():  # create_graph=True: W computes the weight gradients
            refuse_double_backward(plan.fc1[0].weight_name, delayed=True)
        x_t, x_sinv, w1_t, w1_sinv, h, a_t, a_sinv, w2_t, w2_sinv = ctx.saved_tensors
        first, down = plan.fc1[0], plan.down
        if not dy.is_contiguous():
            dy = dy.contiguous()
        # wanted at F and still trainable now (one frozen since F gets nothing, as in autograd)
        need = [w and c.weight.requires_grad for w, c in zip(ctx.wanted, (*plan.fc1, down))]
        need_w2 = need[-1]
        dy_q, _ = _quantize_grad(dy, down.fp8, need_w2, False)
        da = fp8_gemm_nt(dy_q, Quantized(w2_t, w2_sinv), out_dtype=dy.dtype)
        g1, _ = dact_quantize(da, h, plan.act, first.fp8.grad_output, plan.recipe,
                              transpose=any(need[:-1]), column_sum=False)
        dx = fp8_gemm_nt(g1, Quantized(w1_t, w1_sinv), out_dtype=dy.dtype) if ctx.needs_input_grad[0] else None
        x_q = Quantized(x_t, x_sinv)
        rows = h.shape[1] // len(plan.fc1)  # g1^T's rows, layer by layer, as fc1's weights stack
        parts = [_WgradPart(c, (Quantized(g1.data_t[i * rows:(i + 1) * rows], g1.scale_inv), x_q), None)
                 if need[i] else None for i, c in enumerate(plan.fc1)]
        parts.append(_WgradPart(down, (Quantized(dy_q.data_t, dy_q.scale_inv), Quantized(a_t, a_sinv)), None)
                     if need_w2 else None)
        files = files_wgrad()  # not in torch.autograd.grad (see `_layer_function._WGRAD_PROBE`)
        for part, store, key in zip(parts, plan.stores, plan.keys):
            if part is not None and files:
                store.put(key, _Job([part], True))
        return (dx, None) + (None,) * ctx.anchors


def _child(module: nn.Module, name: str) -> Any:
    """``getattr(module, name)``, a submodule read from ``_modules`` without nn.Module's
    ``__getattr__`` (where nn.Module's own attribute assignment keeps it)."""
    found = module._modules.get(name)
    return found if found is not None else getattr(module, name)


class _FusedGatedMlp(nn.Module):
    """Mixed into a gated MLP's own class by `fuse_gated_mlps`."""

    _zbpp_mlp_form: _Form

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle (torch.save of the model) finds classes by name, and the fused class is made at
        # run time: name the model's own class instead, whose fused subclass loading makes again
        reduced = super().__reduce_ex__(protocol)
        cls = type(self).__bases__[-1]
        if _CLASSES.get(cls) is not type(self) or not isinstance(reduced, tuple):
            return reduced  # a subclass of the fused class: the user's, found by name
        return (_new_fused, (cls,), *reduced[2:])

    @_never_compiled  # see _outside_graph
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if _tracing():  # under torch.compile: out of the graph, so that W stays deferred
            return _outside_graph(_FusedGatedMlp.forward, self, x)
        recipe = active_recipe()
        form = self._zbpp_mlp_form
        fc1 = [_child(self, n) for n in form.fc1]
        layers = (*fc1, _child(self, "down_proj"))
        if recipe is None or not all(type(m) is Linear and m._delay and m.bias is None for m in layers) \
                or x.dtype != fc1[0].weight.dtype or not x.dim() \
                or _child(self, form.act_name) is not form.act_fn \
                or runs_hooks(*layers, *form.act_modules):  # the fused layer calls none of them
            return super().forward(x)
        # each a zbpp Linear (checked above): its weight is the registered parameter
        weights = [m._parameters["weight"] for m in layers]
        calls = [m._begin_forward() for m in layers]
        first = fc1[0]
        c1 = first._gemm_call(0, calls[0], weights[0], None)
        # the others' casts are the first's (its slots): no slots of their own
        gemms = (c1, *(m._plain_call(0, w, None) for m, w in zip(fc1[1:], weights[1:])))
        down = layers[-1]._gemm_call(0, calls[-1], weights[-1], None)
        slots = c1.fp8
        if len(fc1) == 1:  # packed: its own weight, kept as any Linear's
            w1 = slots.weight_cache.cast(weights[0], slots.weight, recipe, transpose=True,
                                         first_microbatch=slots.first_microbatch)
        else:
            cache = first._fp8_weight_casts.get(_CACHE)
            if cache is None:
                cache = first._fp8_weight_casts[_CACHE] = _StackedCast()  # type: ignore[assignment]
            w1 = cache.cast(weights[0], weights[1], slots.weight, recipe, slots.first_microbatch)
        plan = _Plan(gemms, down, w1, form.act, recipe, tuple(m._wgrad_store for m in layers),
                     tuple(c.key for c in calls))
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        # An x that needs no gradient (a stage's first layer, one after frozen layers) would leave
        # the node out of the graph, and B, which files the wgrad jobs, would never run: the
        # trainable weights are then its inputs, as `_layer_function.run_layer` keeps them.
        anchors = () if x2.requires_grad else tuple(w for w in weights if w.requires_grad)
        if x2.requires_grad or anchors:  # a node: `files_wgrad` asks about the probe, its input
            anchors = (_WGRAD_PROBE, *anchors)
        y = _GatedMlpFunction.apply(x2, plan, *anchors)
        return y if x2 is x else y.view(*x.shape[:-1], y.shape[-1])
