"""Frozen parameters (``requires_grad=False``, e.g. a frozen base under LoRA) in zbpp's layers with
delayed wgrad: no gradient for them, no wgrad job or saved operand kept for them, and
`get_backward_dw_params` without them; the trainable ones get exactly the gradients of the same
layer run eagerly with every parameter trainable (the reference).

Tolerance: exact (``torch.equal``) without FP8: the delayed and the eager layer run the same GEMMs
on the same tensors, and freezing a parameter must not change any other gradient. In FP8 the
reference is the eager FP8 layer (same casts and GEMMs), also exact.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from zbpp.modules import (DelayedScaling, LayerNormLinear, LayerNormMLP, Linear, fp8_autocast,
                          microbatch)

D = 8  # features: a multiple of 8 keeps the FP8 GEMMs on their normal path

LAYERS = {
    "Linear": lambda **kw: Linear(D, D, **kw),
    "LayerNormLinear": lambda **kw: LayerNormLinear(D, D, **kw),
    "LayerNormMLP": lambda **kw: LayerNormMLP(D, 2 * D, **kw),
}
# per layer: which parameter names to freeze, by pattern
FREEZE = {
    "weight": lambda n: n.endswith("weight") and not n.startswith("layer_norm"),
    "bias": lambda n: n.endswith("bias") and not n.startswith("layer_norm"),
    "gemm": lambda n: not n.startswith("layer_norm"),
    "all": lambda n: True,
    "none": lambda n: False,
}


def _pair(layer: str, frozen: str) -> tuple[torch.nn.Module, torch.nn.Module, set[str]]:
    """(delayed layer with `frozen` parameters frozen, eager all-trainable reference, frozen names)."""
    torch.manual_seed(0)
    ref = LAYERS[layer]()
    with torch.no_grad():  # non-zero biases and norm parameters: every gradient path is exercised
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    mod = LAYERS[layer](delay_wgrad_compute=True)
    mod.load_state_dict(ref.state_dict())
    names = {n for n, _ in mod.named_parameters() if FREEZE[frozen](n)}
    for n, p in mod.named_parameters():
        p.requires_grad_(n not in names)
    return mod, ref, names


def _run(mod: torch.nn.Module, x: torch.Tensor, key: object, fp8: bool) -> torch.Tensor:
    with microbatch(key), fp8_autocast(enabled=fp8, fp8_recipe=DelayedScaling()):
        y = mod(x)
    return y


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("frozen", list(FREEZE))
@pytest.mark.parametrize("layer", list(LAYERS))
def test_frozen_parameters_get_no_gradient_and_no_job(layer: str, frozen: str, fp8: bool) -> None:
    mod, ref, names = _pair(layer, frozen)
    dw = {id(p) for p in mod.get_backward_dw_params()}
    params = dict(mod.named_parameters())
    assert not any(id(params[n]) in dw for n in names), f"{layer}: get_backward_dw_params lists a frozen parameter"
    # two microbatches, W taken in the other order than B: keyed W still finds each one's job
    xs = [torch.randn(4, D, generator=torch.Generator().manual_seed(j)) for j in range(2)]
    dxs = []
    for j, x in enumerate(xs):
        x = x.clone().requires_grad_()
        _run(mod, x, j, fp8).square().sum().backward()
        dxs.append(x.grad)
    owed = mod.get_backward_dw_params()
    assert mod.pending_wgrad_keys() == ([0, 1] if owed else []), \
        f"{layer} frozen={frozen}: pending {mod.pending_wgrad_keys()} with W owing {len(owed)} parameters"
    for j in (1, 0):
        mod.backward_dw(j)  # a no-op when nothing is owed
    assert mod.pending_wgrad_keys() == []
    for j, x in enumerate(xs):
        x = x.clone().requires_grad_()
        _run(ref, x, j, fp8).square().sum().backward()
        assert torch.equal(x.grad, dxs[j]), f"{layer} frozen={frozen}: input gradient of microbatch {j}"
    refs = dict(ref.named_parameters())
    for n, p in mod.named_parameters():
        if n in names:
            assert p.grad is None, f"{layer} frozen={frozen}: frozen {n} got a gradient"
        else:
            assert p.grad is not None and torch.equal(p.grad, refs[n].grad), f"{layer} frozen={frozen}: {n}"


@pytest.mark.parametrize("layer", list(LAYERS))
def test_a_frozen_weight_keeps_no_input_for_w(layer: str) -> None:
    """With every GEMM weight frozen (biases trainable), the pending W holds only output gradients:
    the layer's input is freed once B ran (with a trainable weight the job keeps it for dW)."""
    for frozen, kept in (("weight", False), ("bias", True)):
        mod, _, _ = _pair(layer, frozen)
        x = torch.randn(4, D, requires_grad=True)
        alive = weakref.ref(x)
        _run(mod, x, 0, False).sum().backward()
        del x
        gc.collect()
        if layer == "Linear":  # the input itself is fc1's dW operand
            assert (alive() is not None) == kept, f"{layer} frozen={frozen}: input kept={alive() is not None}"
        mod.backward_dw(0)
        if kept:
            assert alive() is None, f"{layer}: the input outlived its W"


def test_unfreezing_lists_the_parameter_again() -> None:
    mod, _, _ = _pair("Linear", "weight")
    assert [p is mod.bias for p in mod.get_backward_dw_params()] == [True]
    mod.weight.requires_grad_(True)
    assert [p is mod.weight for p in mod.get_backward_dw_params()] == [True, False]
    assert mod.weight.skip_backward_post_hook and mod.bias.skip_backward_post_hook


def test_wgrad_hooks_fire_only_where_w_computed() -> None:
    """The hooks of `register_wgrad_accumulation_and_reduce_hooks` run once per W that computed a
    gradient, and not at all for a layer whose deferred parameters are all frozen."""
    for frozen, calls in (("bias", 2), ("gemm", 0)):
        mod, _, _ = _pair("Linear", frozen)
        fired = []
        mod.register_wgrad_accumulation_and_reduce_hooks(lambda: fired.append(1))
        for j in range(2):
            _run(mod, torch.randn(3, D, requires_grad=True), j, False).sum().backward()
        mod.backward_dw(1)
        mod.backward_dw(0)
        assert len(fired) == calls, f"frozen={frozen}: {len(fired)} hook calls, expected {calls}"


def test_a_frozen_weight_saves_no_input_for_backward() -> None:
    """Between F and B a Linear with a frozen weight keeps nothing of its input (the input
    gradient needs only the weight); with a trainable weight it keeps the input for dW."""
    for frozen, saved in (("weight", 0), ("bias", 1)):
        mod, _, _ = _pair("Linear", frozen)
        x = torch.randn(3, D, requires_grad=True) * 2.0  # not a leaf: only what saves it keeps it
        kept = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept.append(t.data_ptr() == x.data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _run(mod, x, 0, False)
        assert sum(kept) == saved, f"frozen={frozen}: the input was saved {sum(kept)} times"


def test_mlp_with_frozen_norm_and_an_input_without_grad() -> None:
    """Nothing before fc1 needs a gradient (input and norm frozen): B still computes fc1's output
    gradient for W (fc1 and fc2 trainable), as the eager all-trainable layer does."""
    mod, ref, _ = _pair("LayerNormMLP", "none")
    for n, p in mod.named_parameters():
        p.requires_grad_(not n.startswith("layer_norm"))
    x = torch.randn(4, D)
    _run(mod, x, 0, False).square().sum().backward()
    mod.backward_dw(0)
    _run(ref, x, 0, False).square().sum().backward()
    refs = dict(ref.named_parameters())
    for n, p in mod.named_parameters():
        if n.startswith("layer_norm"):
            assert p.grad is None, n
        else:
            assert torch.equal(p.grad, refs[n].grad), n


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("frozen", ["weight", "bias", "gemm"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_a_parameter_frozen_between_forward_and_backward_gets_no_gradient(
        layer: str, frozen: str, fp8: bool) -> None:
    """Frozen after F, before B: autograd's AccumulateGrad skips a parameter that no longer
    requires grad when B reaches it, so the eager layer (the reference: autograd accumulates its
    gradients) leaves it without one, and W must not give it one either (an optimizer would
    move the frozen parameter). The others: exact, as in the test above."""
    mod, ref, _ = _pair(layer, "none")
    names = {n for n, _ in mod.named_parameters() if FREEZE[frozen](n)}
    x = torch.randn(16, D)
    ys = [_run(m, x.clone().requires_grad_(), 0, fp8) for m in (mod, ref)]
    for m in (mod, ref):
        for n, p in m.named_parameters():
            p.requires_grad_(n not in names)
    for y in ys:
        y.square().sum().backward()
    if mod.pending_wgrad_keys():
        mod.backward_dw(0)
    for (n, p), q in zip(mod.named_parameters(), ref.parameters()):
        if n in names:
            assert p.grad is None and q.grad is None, n
        else:
            assert torch.equal(p.grad, q.grad), n


@pytest.mark.parametrize("delay", [False, True], ids=["eager", "delayed"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_a_weight_frozen_between_forward_and_backward_leaves_main_grad_alone(layer: str, delay: bool) -> None:
    """With fuse_wgrad_accumulation the weight gradients go into ``main_grad``, past autograd's
    AccumulateGrad, which would skip a weight frozen since F: its main_grad must stay as it was
    (zeros), eager or delayed. Reference for the others: the same run with nothing frozen
    (exact: the same GEMMs on the same tensors)."""
    runs = []
    for freeze in (False, True):
        torch.manual_seed(0)
        mod = LAYERS[layer](delay_wgrad_compute=delay, fuse_wgrad_accumulation=True)
        weights = [(n, p) for n, p in mod.named_parameters() if p.dim() == 2]
        for _, p in weights:
            p.main_grad = torch.zeros_like(p)
        x = torch.randn(16, D, requires_grad=True)
        y = _run(mod, x, 0, False)
        if freeze:
            weights[0][1].requires_grad_(False)
        y.square().sum().backward()
        if mod.pending_wgrad_keys():
            mod.backward_dw(0)
        runs.append({n: p.main_grad for n, p in weights})
    frozen = next(iter(runs[1]))
    assert not runs[1][frozen].any(), frozen
    assert runs[0][frozen].any()  # it would have had one
    for n in list(runs[1])[1:]:
        assert torch.equal(runs[1][n], runs[0][n]), n
