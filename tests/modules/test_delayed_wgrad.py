"""The delayed-wgrad protocol of zbpp.modules (DESIGN.md), checked against eager autograd.

References: the same layer built with ``delay_wgrad_compute=False`` (whose gradients come from
autograd's own accumulation), and a float64 functional re-implementation of each layer. Delayed and
eager run the same GEMM code on the same tensors, so they must agree bit for bit (rtol=atol=0),
the way Transformer Engine tests ``delay_wgrad_compute``.
"""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zbpp.modules import (
    DelayedScaling,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    current_microbatch,
    fp8_autocast,
    is_delayed,
    microbatch,
    supports_keys,
)
from zbpp.modules.wgrad_store import AutoKey, WgradStoreError

HIDDEN, OUT = 16, 12

MAKERS = {
    "Linear": lambda **kw: Linear(HIDDEN, OUT, **kw),
    "LayerNormLinear": lambda **kw: LayerNormLinear(HIDDEN, OUT, **kw),
    "RMSNormLinear": lambda **kw: LayerNormLinear(HIDDEN, OUT, normalization="RMSNorm", **kw),
    "LayerNormMLP": lambda **kw: LayerNormMLP(HIDDEN, 24, **kw),
    "SwiGLU-MLP": lambda **kw: LayerNormMLP(
        HIDDEN, 24, activation="swiglu", normalization="RMSNorm", **kw
    ),
}


def out_features(module) -> int:
    return HIDDEN if isinstance(module, LayerNormMLP) else OUT


def make_pair(name, **kw):
    """An eager and a delayed layer from the same seed, with non-trivial 1-D parameters."""
    torch.manual_seed(1234)
    eager = MAKERS[name](delay_wgrad_compute=False, **kw)
    torch.manual_seed(1234)
    delayed = MAKERS[name](delay_wgrad_compute=True, **kw)
    init_equal = all(torch.equal(a, b) for a, b in zip(eager.parameters(), delayed.parameters()))
    with torch.no_grad():  # biases and norm weights away from their 0/1 init, the same in both
        for pe, pd in zip(eager.parameters(), delayed.parameters()):
            if pe.dim() == 1:
                pe.add_(0.1 * torch.randn_like(pe))
                pd.copy_(pe)
    return eager, delayed, init_equal


def gemm_weights(module):
    return [p for p in module.parameters() if p.dim() == 2]


def attach_main_grads(module):
    for p in gemm_weights(module):
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)


def grads_of(module):
    """name -> the gradient each parameter ended up with (plus main_grad where attached)."""
    out = {}
    for name, p in module.named_parameters():
        out[name] = p.grad
        if hasattr(p, "main_grad"):
            out[name + ".main_grad"] = p.main_grad
    return out


def assert_same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a is None=} but {b is None=}"
        return
    assert a.dtype == b.dtype, f"{what}: dtypes {a.dtype} vs {b.dtype}"
    diff = (a.double() - b.double()).abs().max().item()
    assert torch.equal(a, b), f"{what}: max diff {diff}"


def fp8_ctx(fp8: bool):
    return fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)) if fp8 else (
        contextlib.nullcontext()
    )


def run_pipeline_order(module, xs, *, fp8=False, w_order=None, cot_seed=11):
    """F of every microbatch, then their B, then (delayed) their W in `w_order`."""
    inputs = [x.clone().requires_grad_(True) for x in xs]
    outs = []
    for j, x in enumerate(inputs):
        with microbatch(j), fp8_ctx(fp8):
            outs.append(module(x))
    gen = torch.Generator().manual_seed(cot_seed)
    for y in outs:
        y.backward(torch.randn(y.shape, generator=gen).to(device=y.device, dtype=y.dtype))
    if module.delay_wgrad_compute:
        assert module.pending_wgrad_keys() == list(range(len(xs)))
        for j in w_order or range(len(xs)):
            module.backward_dw(j)
        assert module.pending_wgrad_keys() == []
    return outs, [x.grad for x in inputs]


@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_delayed_equals_eager_bit_exact(name, dtype, bias, fused, fp8):
    """3 microbatches: F, F, F, B, B, B, then W, W, W; outputs and all grads == eager exactly."""
    eager, delayed, init_equal = make_pair(
        name, bias=bias, fuse_wgrad_accumulation=fused, params_dtype=dtype
    )
    assert init_equal, "initialisation depends on delay_wgrad_compute"
    if fused:
        attach_main_grads(eager)
        attach_main_grads(delayed)
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(3, 5, HIDDEN, generator=gen).to(dtype) for _ in range(3)]
    ye, dxe = run_pipeline_order(eager, xs, fp8=fp8)
    yd, dxd = run_pipeline_order(delayed, xs, fp8=fp8)
    for j in range(3):
        assert_same(ye[j], yd[j], f"output {j}")
        assert_same(dxe[j], dxd[j], f"input grad {j}")
    ge, gd = grads_of(eager), grads_of(delayed)
    assert ge.keys() == gd.keys()
    for key in ge:
        assert_same(ge[key], gd[key], key)
    for p in gemm_weights(delayed):  # the weight gradients really arrived where they should
        got = p.main_grad if fused else p.grad
        assert got is not None and got.abs().sum() > 0
        if fused:
            assert p.grad is None


def test_w_order_need_not_follow_b_order():
    """Integer-valued data make every sum exact in float32, so any W order must equal eager."""
    eager, delayed, _ = make_pair("Linear")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in (eager, delayed):
            m.weight.copy_(torch.randint(-3, 4, m.weight.shape, generator=gen).float())
            gen.manual_seed(3)
    xs = [torch.randint(-3, 4, (4, HIDDEN), generator=gen).float() for _ in range(4)]

    def integer_cotangents(module, xs, order):
        inputs = [x.clone().requires_grad_(True) for x in xs]
        outs = []
        for j, x in enumerate(inputs):
            with microbatch(j):
                outs.append(module(x))
        g = torch.Generator().manual_seed(5)
        for y in outs:
            y.backward(torch.randint(-3, 4, y.shape, generator=g).float())
        for j in order:
            module.backward_dw(j)

    integer_cotangents(eager, xs, [])
    integer_cotangents(delayed, xs, [2, 0, 3, 1])
    assert torch.equal(eager.weight.grad, delayed.weight.grad)
    assert torch.equal(eager.bias.grad, delayed.bias.grad)
    assert eager.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["LayerNormMLP", "RMSNormLinear"])
def test_w_order_float64(name):
    """Out-of-order W in float64: equal to eager up to reassociation of 4 sums (rtol 1e-13)."""
    eager, delayed, _ = make_pair(name, params_dtype=torch.float64)
    xs = [torch.randn(2, 3, HIDDEN, dtype=torch.float64) for _ in range(4)]
    run_pipeline_order(eager, xs)
    run_pipeline_order(delayed, xs, w_order=[3, 1, 0, 2])
    for (n, pe), pd in zip(eager.named_parameters(), delayed.parameters()):
        torch.testing.assert_close(pd.grad, pe.grad, rtol=1e-13, atol=1e-15, msg=n)


@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP"])
def test_reused_module_gets_both_contributions(name, fused):
    """One module called twice per forward (tied weight), two microbatches: == eager exactly."""
    torch.manual_seed(0)
    make = {
        "Linear": lambda **kw: Linear(HIDDEN, HIDDEN, **kw),
        "LayerNormMLP": lambda **kw: LayerNormMLP(HIDDEN, 24, **kw),
    }[name]
    torch.manual_seed(0)
    eager = make(fuse_wgrad_accumulation=fused)
    torch.manual_seed(0)
    delayed = make(fuse_wgrad_accumulation=fused, delay_wgrad_compute=True)
    if fused:
        attach_main_grads(eager)
        attach_main_grads(delayed)
    xs = [torch.randn(4, HIDDEN) for _ in range(2)]
    for module in (eager, delayed):
        for j, x in enumerate(xs):
            with microbatch(j):
                y = module(torch.tanh(module(x)))
            y.square().sum().backward()
        if module.delay_wgrad_compute:
            assert module.pending_wgrad_keys() == [0, 1]
            module.backward_dw(0)
            module.backward_dw(1)
    ge, gd = grads_of(eager), grads_of(delayed)
    for key in ge:
        assert_same(ge[key], gd[key], key)
    # and both uses count: a single use gives a different weight gradient
    torch.manual_seed(0)
    single = make()
    single(xs[0]).square().sum().backward()
    w = gemm_weights(delayed)[0]
    assert not torch.allclose((w.main_grad if fused else w.grad), gemm_weights(single)[0].grad)


def _functional(kind, cfg, p, x):
    """Float64 re-implementation of a layer from its parameter dict `p`."""
    if kind == "Linear":
        return F.linear(x, p["weight"], p.get("bias"))
    if cfg["normalization"] == "LayerNorm":
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        h = (x - mu) / torch.sqrt(var + cfg["eps"]) * p["layer_norm_weight"] + p["layer_norm_bias"]
    else:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["eps"]) * p["layer_norm_weight"]
    if kind == "LayerNormLinear":
        return F.linear(h, p["weight"], p.get("bias"))
    h = F.linear(h, p["fc1_weight"], p.get("fc1_bias"))
    if cfg["activation"] == "gelu":
        h = 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)))
    else:  # swiglu
        gate, up = h.chunk(2, -1)
        h = gate * torch.sigmoid(gate) * up
    return F.linear(h, p["fc2_weight"], p.get("fc2_bias"))


@pytest.mark.parametrize("delay", [False, True], ids=["eager", "delayed"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_layers_match_float64_reference(name, delay):
    """Output, input grad and every parameter grad against a hand-written float64 model.

    Tolerance rtol 1e-9: both sides compute in float64 (the layer with params_dtype=float64), so
    only reordered roundings (~1e-16 relative) separate them, while a wrong transpose, a missing
    term or a gradient left in the store gives O(1) differences.
    """
    eager, delayed, _ = make_pair(name, params_dtype=torch.float64)
    module = delayed if delay else eager
    cfg = {a: getattr(module, a, None) for a in ("normalization", "eps", "activation")}
    x = torch.randn(4, 3, HIDDEN, dtype=torch.float64, requires_grad=True)
    r = torch.randn(4, 3, out_features(module), dtype=torch.float64)
    y = module(x)
    y.backward(r)
    module.backward_dw()
    params = {n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters()}
    xr = x.detach().clone().requires_grad_(True)
    kind = type(module).__name__
    y_ref = _functional(kind, cfg, params, xr)
    y_ref.backward(r)
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-9, atol=1e-12)
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.grad, params[n].grad, rtol=1e-9, atol=1e-12, msg=n)


# -- keys, threads, errors ---------------------------------------------------------------------


def test_key_is_recorded_at_forward_even_when_backward_runs_on_another_thread():
    layer = Linear(4, 4, delay_wgrad_compute=True)
    with microbatch("a"):
        ya = layer(torch.randn(2, 4))
    with microbatch("b"):
        yb = layer(torch.randn(2, 4))
    seen = []

    def backward_elsewhere():
        seen.append(current_microbatch())
        yb.sum().backward()
        ya.sum().backward()

    t = threading.Thread(target=backward_elsewhere)
    t.start()
    t.join()
    assert seen == [None]  # nothing was set on that thread's side...
    assert layer.pending_wgrad_keys() == ["b", "a"]  # ...yet the jobs carry the forwards' keys
    layer.backward_dw("a")
    assert layer.pending_wgrad_keys() == ["b"]


def test_forwards_outside_microbatch_get_fifo_auto_keys():
    torch.manual_seed(0)
    layer = Linear(4, 3, delay_wgrad_compute=True)
    ref = Linear(4, 3)
    ref.load_state_dict(layer.state_dict())
    xs = [torch.randn(2, 4) for _ in range(2)]
    for x in xs:
        layer(x).sum().backward()
    keys = layer.pending_wgrad_keys()
    assert len(keys) == 2 and all(isinstance(k, AutoKey) for k in keys) and keys[0] != keys[1]
    layer.backward_dw()  # oldest: the first forward's
    ref(xs[0]).sum().backward()
    assert torch.equal(layer.weight.grad, ref.weight.grad)
    assert layer.pending_wgrad_keys() == keys[1:]


def test_backward_dw_errors_say_what_is_wrong():
    layer = Linear(4, 4, delay_wgrad_compute=True)
    with pytest.raises(WgradStoreError, match="nothing pending"):
        layer.backward_dw()
    with microbatch(0):
        layer(torch.randn(2, 4)).sum().backward()
    with pytest.raises(WgradStoreError, match=r"backward_dw\(7\).*pending keys: \[0\]"):
        layer.backward_dw(7)
    with pytest.raises(RuntimeError, match="pending"):
        layer.delay_wgrad_compute = False
    layer.backward_dw(0)
    with pytest.raises(WgradStoreError, match="nothing pending for microbatch key 0"):
        layer.backward_dw(0)
    with microbatch(1):
        layer(torch.randn(2, 4)).sum().backward()
    layer.discard_wgrad()  # after a failed step: nothing left to compute
    assert layer.pending_wgrad_keys() == []


def test_without_delay_backward_dw_is_a_noop():
    layer = Linear(4, 4)
    calls = []
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(1))
    layer(torch.randn(2, 4)).sum().backward()
    grad = layer.weight.grad.clone()
    layer.backward_dw()
    layer.backward_dw(3)
    assert torch.equal(layer.weight.grad, grad) and calls == []
    assert layer.get_backward_dw_params() == [] and layer.pending_wgrad_keys() == []


@pytest.mark.parametrize("name", list(MAKERS))
def test_delay_turned_off_between_f_and_b_still_computes_w(name):
    """A forward run while the layer delays files its wgrad job at B, whatever the flag says
    then: turned off between F and B, ``backward_dw`` must still compute that job (it returned
    at once, and the weight gradients were silently lost). Reference: the same layer eager
    (float64, rtol 1e-12: the same products, summed by other GEMM calls)."""
    torch.manual_seed(0)
    eager, delayed, _ = make_pair(name, params_dtype=torch.float64)
    x = torch.randn(5, HIDDEN, dtype=torch.float64)
    with microbatch(0):
        y = delayed(x)
    delayed.delay_wgrad_compute = False
    y.square().sum().backward()
    assert delayed.pending_wgrad_keys() == [0]
    delayed.backward_dw(0)
    assert delayed.pending_wgrad_keys() == []
    eager(x).square().sum().backward()
    for (n, p), q in zip(eager.named_parameters(), delayed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=0, msg=n)
    delayed.backward_dw(0)  # nothing pending, not delayed: a no-op as before


def test_fused_accumulation_without_main_grad_is_a_clear_error():
    eager = Linear(4, 4, fuse_wgrad_accumulation=True)
    with pytest.raises(RuntimeError, match=r"Linear.weight has no `main_grad`"):
        eager(torch.randn(2, 4)).sum().backward()
    delayed = Linear(4, 4, fuse_wgrad_accumulation=True, delay_wgrad_compute=True)
    delayed(torch.randn(2, 4)).sum().backward()  # B needs no main_grad...
    with pytest.raises(RuntimeError, match=r"Linear.weight has no `main_grad`"):
        delayed.backward_dw()  # ...W does


def test_dtype_mismatch_names_both_dtypes():
    with pytest.raises(TypeError, match="bfloat16.*float32"):
        Linear(4, 4)(torch.randn(2, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("name", list(MAKERS))
def test_autocast_is_refused_where_it_would_change_the_layers_dtype(name):
    """Under ``torch.autocast`` a layer reading an input of its parameters' dtype (a norm's
    output, the model's input) had its GEMM run in bfloat16: its B failed on mixed dtypes, or its W
    wrote a bfloat16 gradient into a float32 ``.grad``. Refused in the forward, naming the layer.
    Parameters autocast leaves alone (float64, or already bfloat16) run as outside it: there the
    delayed layer's gradients equal the eager one's under the same autocast, bit for bit."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    for delay in (True, False):
        torch.manual_seed(0)
        layer = MAKERS[name](delay_wgrad_compute=delay)
        with autocast, pytest.raises(TypeError, match=r"\.(fc1_)?weight: torch\.autocast ran this layer in "
                                                      r"torch\.bfloat16, its parameters are torch\.float32"):
            layer(torch.randn(3, HIDDEN, requires_grad=True))
    for dtype in (torch.float64, torch.bfloat16):
        eager, delayed, _ = make_pair(name, params_dtype=dtype)
        x = torch.randn(3, HIDDEN, dtype=dtype)
        for layer in (eager, delayed):
            with autocast, microbatch(0):
                y = layer(x.clone().requires_grad_())
            assert y.dtype == dtype
            y.float().square().sum().backward()
        delayed.backward_dw(0)
        for (n, a), b in zip(eager.named_parameters(), delayed.parameters()):
            assert torch.equal(a.grad, b.grad), f"{dtype} {n}"


def _weight_normed(layer: nn.Module, how: str) -> nn.Module:
    if how == "parametrize":
        torch.nn.utils.parametrizations.weight_norm(layer)
    else:  # the older hook form: `weight` is recomputed by a forward pre-hook
        torch.nn.utils.weight_norm(layer)
    return layer


@pytest.mark.filterwarnings("ignore:.*weight_norm.* is deprecated:FutureWarning")
@pytest.mark.parametrize("how", ["parametrize", "hook"])
def test_computed_weight_is_refused_by_a_delayed_layer(how):
    """A weight computed in the forward (weight_norm as a parametrization or as its hook) is no
    leaf: W would write its gradient into that tensor's ``.grad``, which nothing reads, and the
    parameters it is computed from would get none. A delayed layer refuses it, naming it; an eager
    one lets autograd carry dW back to them, as nn.Linear does (float64, rtol 1e-12: the same
    products, summed by different GEMM calls); with those parameters frozen nothing is owed."""
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64)
    ref = nn.Linear(4, 3, dtype=torch.float64)
    layers = {}
    for delay in (False, True):
        layer = Linear(4, 3, delay_wgrad_compute=delay, params_dtype=torch.float64)
        layer.load_state_dict(ref.state_dict())
        layers[delay] = _weight_normed(layer, how)
    _weight_normed(ref, how)
    ref(x).square().sum().backward()
    layers[False](x).square().sum().backward()
    for (n, p), q in zip(ref.named_parameters(), layers[False].parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=0, msg=n)
    with pytest.raises(TypeError, match=r"Linear\.weight is computed in the forward"):
        with microbatch(0):
            layers[True](x)
    assert layers[True].pending_wgrad_keys() == []
    for n, p in layers[True].named_parameters():
        p.requires_grad_(n == "bias")
    with microbatch(1):
        layers[True](x).square().sum().backward()
    layers[True].backward_dw(1)
    torch.testing.assert_close(layers[True].bias.grad, ref.bias.grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_functional_call_with_computed_weights_is_refused_by_a_delayed_layer(name):
    """``torch.func.functional_call`` with tensors computed from others (here ``2 * base``) puts
    them in the layer's ``_parameters`` for the call: W would write their gradients into those
    non-leaf tensors' ``.grad``, which nothing reads, and ``base`` would silently get none. A
    delayed layer refuses them, naming the first; an eager one lets autograd carry them to
    ``base``, as a torch reference does (float64, rtol 1e-12: the same products summed by other
    GEMM calls). Leaf tensors given the same way get W's gradients, as autograd gives them."""
    torch.manual_seed(0)
    x = torch.randn(5, HIDDEN, dtype=torch.float64)
    make = {"Linear": lambda **kw: Linear(HIDDEN, OUT, **kw),
            "LayerNormLinear": lambda **kw: LayerNormLinear(HIDDEN, OUT, **kw),
            "LayerNormMLP": lambda **kw: LayerNormMLP(HIDDEN, 24, **kw)}[name]
    delayed = make(delay_wgrad_compute=True, params_dtype=torch.float64)
    eager = make(delay_wgrad_compute=False, params_dtype=torch.float64)
    base = {n: p.detach().clone().requires_grad_() for n, p in delayed.named_parameters()}
    with pytest.raises(TypeError, match=rf"{name}\.\w*weight is computed in the forward"):
        with microbatch(0):
            torch.func.functional_call(delayed, {n: 2 * b for n, b in base.items()}, (x,))
    assert delayed.pending_wgrad_keys() == []
    torch.func.functional_call(eager, {n: 2 * b for n, b in base.items()}, (x,)).square().sum().backward()
    ref_base = {n: b.detach().clone().requires_grad_() for n, b in base.items()}
    ref = make(delay_wgrad_compute=False, params_dtype=torch.float64)
    _functional_reference(ref, {n: 2 * b for n, b in ref_base.items()}, x).square().sum().backward()
    for n, b in base.items():
        torch.testing.assert_close(b.grad, ref_base[n].grad, rtol=1e-12, atol=0, msg=n)
    leaves = {n: (2 * b).detach().requires_grad_() for n, b in base.items()}
    with microbatch(1):
        torch.func.functional_call(delayed, leaves, (x,)).square().sum().backward()
    delayed.backward_dw(1)
    ref_leaves = {n: t.detach().clone().requires_grad_() for n, t in leaves.items()}
    _functional_reference(ref, ref_leaves, x).square().sum().backward()
    for n, t in leaves.items():
        torch.testing.assert_close(t.grad, ref_leaves[n].grad, rtol=1e-12, atol=0, msg=n)


def _functional_reference(layer: nn.Module, p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    # `layer`'s formula in torch ops on the tensors `p` (layer norm, tanh-GELU)
    if isinstance(layer, Linear):
        return F.linear(x, p["weight"], p["bias"])
    n = F.layer_norm(x, x.shape[-1:], p["layer_norm_weight"], p["layer_norm_bias"], layer.eps)
    if isinstance(layer, LayerNormLinear):
        return F.linear(n, p["weight"], p["bias"])
    h = F.gelu(F.linear(n, p["fc1_weight"], p["fc1_bias"]), approximate="tanh")
    return F.linear(h, p["fc2_weight"], p["fc2_bias"])


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("written", ["input", "output gradient"])
def test_a_tensor_written_between_b_and_w_is_refused(name, written):
    """W computes dW from the layer's input and the output gradient that B was handed (outside
    FP8, where they are the very tensors): one written in place between B and W (each
    microbatch copied into one reused input buffer, one output-gradient tensor reused) would
    silently give the gradient of the new values; autograd's own check of saved tensors ends
    with B. W refuses it, naming the weight. Left unchanged, W gives a torch reference's
    gradients: the same layer eager, forward and full backward in one go (float64, rtol 1e-12:
    the same products, summed by other GEMM calls)."""
    torch.manual_seed(0)
    eager, delayed, _ = make_pair(name, params_dtype=torch.float64)
    data = [torch.randn(5, HIDDEN, dtype=torch.float64) for _ in range(2)]
    grads = [torch.randn(5, out_features(delayed), dtype=torch.float64) for _ in range(2)]
    buf, gbuf = data[0].clone(), grads[0].clone()
    with microbatch(0):
        delayed(buf).backward(gbuf)
    (buf if written == "input" else gbuf).copy_(data[1] if written == "input" else grads[1])
    if written == "input" and not isinstance(delayed, Linear):  # W reads the norm's output, not x
        delayed.backward_dw(0)
        eager(data[0]).backward(grads[0])
    else:
        with pytest.raises(RuntimeError, match=r"\w*weight: a tensor its weight gradient is computed from"):
            delayed.backward_dw(0)
        for p in delayed.parameters():
            p.grad = None
        with microbatch(1):
            delayed(data[1]).backward(grads[1])
        delayed.backward_dw(1)
        eager(data[1]).backward(grads[1])
    for (n, p), q in zip(eager.named_parameters(), delayed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=0, msg=n)


def test_megatron_style_dummy_grad_with_fused_accumulation():
    """TE's convention: a weight with `grad_added_to_main_grad` is flagged and its hooks fire."""
    layer = Linear(4, 4, fuse_wgrad_accumulation=True)
    layer.weight.main_grad = torch.zeros(4, 4)
    layer.weight.grad_added_to_main_grad = False
    layer.weight.zero_out_wgrad = True
    fired = []
    layer.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    x = torch.randn(2, 4)
    layer(x).sum().backward()
    assert layer.weight.grad_added_to_main_grad and fired == [layer.weight]
    assert torch.equal(layer.weight.grad, torch.zeros(4, 4))
    torch.testing.assert_close(layer.weight.main_grad, x.sum(0).expand(4, 4), rtol=0, atol=1e-6)


# -- the parameters W produces, flags, hooks ----------------------------------------------------


@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_get_backward_dw_params_is_exactly_what_w_produces(name, bias, fp8):
    _, layer, _ = make_pair(name, bias=bias)
    names = {id(p): n for n, p in layer.named_parameters()}
    with fp8_ctx(fp8):
        y = layer(torch.randn(2, 3, HIDDEN))
    y.square().sum().backward()
    before = {n: None if p.grad is None else p.grad.clone() for n, p in layer.named_parameters()}
    layer.backward_dw()
    changed = {
        n
        for n, p in layer.named_parameters()
        if p.grad is not None and (before[n] is None or not torch.equal(before[n], p.grad))
    }
    listed = layer.get_backward_dw_params()
    own = dict(layer.named_parameters())
    assert all(any(p is q for q in own.values()) for p in listed), "not the very objects"
    assert {names[id(p)] for p in listed} == changed
    # the GEMM weights always; the biases only outside FP8 (there B computed them)
    expected = {n for n in own if n.endswith("weight") and "layer_norm" not in n}
    if bias and not fp8:
        expected |= {n for n in own if n.endswith("bias") and "layer_norm" not in n}
    assert changed == expected
    for n, p in own.items():
        assert getattr(p, "skip_backward_post_hook", False) == (n in expected), n


@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_b_runs_no_accumulation_for_what_w_computes(name, fp8):
    """B's autograd graph has no edge to a parameter W computes: autograd's accumulation (and
    with it the parameter's post-accumulate hook) runs in B only for the gradients B produces,
    and W still delivers the rest."""
    _, layer, _ = make_pair(name)
    fired = []
    for n, p in layer.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: fired.append(n))
    with fp8_ctx(fp8):
        y = layer(torch.randn(2, 3, HIDDEN, requires_grad=True))
    y.square().sum().backward()
    deferred = {id(p) for p in layer.get_backward_dw_params()}
    in_b = {n for n, p in layer.named_parameters() if id(p) not in deferred}
    assert sorted(fired) == sorted(in_b)
    assert all(p.grad is None for p in layer.get_backward_dw_params())
    layer.backward_dw()
    assert all(p.grad is not None for p in layer.get_backward_dw_params())
    assert sorted(fired) == sorted(in_b)  # W writes .grad itself


def test_skip_flags_follow_the_delay_setting():
    layer = LayerNormLinear(4, 4)
    assert not any(getattr(p, "skip_backward_post_hook", False) for p in layer.parameters())
    layer.delay_wgrad_compute = True
    flagged = [n for n, p in layer.named_parameters() if getattr(p, "skip_backward_post_hook", 0)]
    assert flagged == [
        "weight",
        "bias",
    ]
    assert layer.get_backward_dw_params()[0] is layer.weight


def _to_empty_from_meta(layer: nn.Module) -> None:
    layer.to_empty(device="cpu")


def _load_assigned(layer: nn.Module) -> None:
    layer.load_state_dict({k: v.clone() for k, v in layer.state_dict().items()}, assign=True)


def _set_new_weight(layer: nn.Module) -> None:
    name = next(n for n, p in layer.named_parameters() if p.dim() == 2)  # weight, fc1_weight
    setattr(layer, name, nn.Parameter(torch.zeros_like(getattr(layer, name))))


def _swapping_double(layer: nn.Module) -> None:
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        layer.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


@pytest.mark.parametrize("change", [_to_empty_from_meta, _load_assigned, _set_new_weight, _swapping_double])
@pytest.mark.parametrize("name", ["Linear", "SwiGLU-MLP"])
def test_skip_flags_follow_parameters_replaced_after_construction(name, change):
    # Reference: the documented invariant, skip_backward_post_hook marks exactly the parameters
    # get_backward_dw_params() lists (Megatron-style reducers read it to leave those to W). Each
    # change here puts new Parameter objects in the layer (or swaps their attributes away).
    with torch.device("meta" if change is _to_empty_from_meta else "cpu"):
        layer = MAKERS[name](delay_wgrad_compute=True)
    change(layer)
    listed = {id(p) for p in layer.get_backward_dw_params()}
    assert listed  # the weights, whatever the change
    flagged = {id(p) for p in layer.parameters() if getattr(p, "skip_backward_post_hook", False)}
    assert flagged == listed


def test_hooks_fire_once_per_backward_dw_without_arguments():
    mlp = LayerNormMLP(8, 16, delay_wgrad_compute=True)
    calls = []
    handle = mlp.register_wgrad_accumulation_and_reduce_hooks(lambda *a: calls.append(a))
    for j in range(3):
        with microbatch(j):
            y = mlp(mlp(torch.randn(2, 8)))  # two calls: four jobs under one key
        y.sum().backward()
    mlp.backward_dw(0)
    assert calls == [()]
    mlp.backward_dw(2)
    assert calls == [(), ()]
    handle.remove()
    mlp.backward_dw(1)
    assert calls == [(), ()]


def test_is_delayed_and_supports_keys_for_zbpp_te_and_plain_modules():
    class FakeTEStore:  # the part of Transformer Engine's WeightGradStore that is_delayed reads
        def __init__(self, delay):
            self._delay = delay

        def delay_wgrad_compute(self):
            return self._delay

    class FakeTELinear(nn.Module):
        def __init__(self, delay):
            super().__init__()
            self.wgrad_store = FakeTEStore(delay)

        def backward_dw(self):  # Transformer Engine's: FIFO, no key
            pass

    assert is_delayed(Linear(2, 2, delay_wgrad_compute=True)) and supports_keys(Linear(2, 2))
    assert not is_delayed(LayerNormMLP(2, 4))
    assert is_delayed(FakeTELinear(True)) and not is_delayed(FakeTELinear(False))
    assert not supports_keys(FakeTELinear(True))
    assert not is_delayed(nn.Linear(2, 2)) and not supports_keys(nn.Linear(2, 2))


def test_parameter_names_follow_transformer_engine():
    # names and registration order as in transformer_engine.pytorch.LayerNormMLP
    assert [n for n, _ in LayerNormMLP(4, 8).named_parameters()] == [
        "layer_norm_weight",
        "layer_norm_bias",
        "fc1_weight",
        "fc1_bias",
        "fc2_weight",
        "fc2_bias",
    ]
    assert [n for n, _ in LayerNormLinear(4, 8, normalization="RMSNorm").named_parameters()] == [
        "layer_norm_weight",
        "weight",
        "bias",
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP"])
def test_gpu_delayed_equals_eager_bf16(name):
    """On the GPU, where autograd runs B on its own thread and W runs on the caller's."""
    torch.manual_seed(0)
    eager = MAKERS[name](params_dtype=torch.bfloat16, device="cuda")
    torch.manual_seed(0)
    delayed = MAKERS[name](params_dtype=torch.bfloat16, device="cuda", delay_wgrad_compute=True)
    xs = [torch.randn(64, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    ye, dxe = run_pipeline_order(eager, xs)
    yd, dxd = run_pipeline_order(delayed, xs, w_order=[0, 1, 2])
    for j in range(3):
        assert_same(ye[j], yd[j], f"output {j}")
        assert_same(dxe[j], dxd[j], f"input grad {j}")
    for (n, pe), pd in zip(eager.named_parameters(), delayed.parameters()):
        assert_same(pe.grad, pd.grad, n)


def test_deepcopy_keeps_flags_and_drops_pending_work():
    layer = LayerNormMLP(8, 16, delay_wgrad_compute=True)
    with microbatch(0):
        layer(torch.randn(2, 8)).sum().backward()
    twin = copy.deepcopy(layer)
    assert twin.pending_wgrad_keys() == [] and layer.pending_wgrad_keys() == [0]
    assert [getattr(p, "skip_backward_post_hook", False) for p in twin.parameters()] == [
        getattr(p, "skip_backward_post_hook", False) for p in layer.parameters()
    ]
    with microbatch(5):
        twin(torch.randn(2, 8)).sum().backward()
    twin.backward_dw(5)
    layer.backward_dw(0)
    assert twin.fc1_weight.grad is not None


def test_shallow_copy_computes_its_own_pending_wgrads():
    """``copy.copy`` shares the parameters (as torch's shallow copies do) but each module's W runs
    only the jobs its own forwards filed: FIFO use, one backward_dw() per call of each module.
    Reference: float64 autograd of ``x @ W^T + b`` per call; the same float64 GEMMs, so to
    rounding (1e-12: the sums of two and three products differ in order only)."""
    torch.manual_seed(3)
    layer = Linear(4, 3, delay_wgrad_compute=True, params_dtype=torch.float64)
    alias = copy.copy(layer)
    assert alias.weight is layer.weight
    x1, x2 = torch.randn(2, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    layer(x1).square().sum().backward()
    alias(x2).square().sum().backward()
    assert layer.pending_wgrad_keys() == alias.pending_wgrad_keys() == [AutoKey(0)]

    def ref_grads(*xs):
        w, b = layer.weight.detach().clone().requires_grad_(), layer.bias.detach().clone().requires_grad_()
        sum(F.linear(x, w, b).square().sum() for x in xs).backward()
        return w.grad, b.grad

    layer.backward_dw()  # only the original's call
    for got, want in zip((layer.weight.grad, layer.bias.grad), ref_grads(x1)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    alias.backward_dw()  # the copy's call: it was not run by the original's W
    for got, want in zip((layer.weight.grad, layer.bias.grad), ref_grads(x1, x2)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert layer.pending_wgrad_keys() == alias.pending_wgrad_keys() == []


# -- main_grad accumulation against plain autograd -------------------------------------------


@pytest.mark.parametrize("delay", [False, True], ids=["eager", "delayed"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "RMSNormLinear", "LayerNormMLP",
                                  "SwiGLU-MLP"])
def test_main_grad_accumulates_over_microbatches_like_plain_autograd(name, bias, delay):
    """Four microbatches into main_grad (which already holds a value, as between two optimizer
    steps of a gradient-accumulating loop), W in reverse order when delayed: main_grad ends at
    its start plus the sum of the four weight gradients that plain autograd gives for the same
    float32 functions (`_functional`), .grad of the weights stays None, and biases and norm
    parameters sum their four gradients in .grad.

    Tolerance rtol 1e-5 (atol 1e-5 of the gradients' scale): both sides are float32 but order
    their sums differently (the GEMMs, four accumulations in another order); a gradient dropped,
    counted twice or sent to .grad instead differs by O(1).
    """
    _, layer, _ = make_pair(name, bias=bias)
    if not delay:
        layer.delay_wgrad_compute = False
    layer.fuse_wgrad_accumulation = True
    gen = torch.Generator().manual_seed(9)
    start = {}
    for n, p in layer.named_parameters():
        if p.dim() == 2:
            p.main_grad = torch.randn(p.shape, generator=gen)
            start[n] = p.main_grad.clone()
    params = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    cfg = {a: getattr(layer, a, None) for a in ("normalization", "eps", "activation")}
    kind = type(layer).__name__
    want = {n: torch.zeros_like(p) for n, p in params.items()}
    for j in range(4):
        x = torch.randn(5, HIDDEN, generator=gen)
        dy = torch.randn(5, out_features(layer), generator=gen)
        with microbatch(j):
            y = layer(x)
        y.backward(dy)
        y_ref = _functional(kind, cfg, params, x)
        grads = torch.autograd.grad(y_ref, list(params.values()), dy)
        for n, g in zip(params, grads):
            want[n] += g
    if delay:
        assert layer.pending_wgrad_keys() == [0, 1, 2, 3]
        for j in reversed(range(4)):
            layer.backward_dw(j)
    for n, p in layer.named_parameters():
        scale = want[n].abs().max().item()
        if n in start:
            assert p.grad is None, f"{n}: the weight gradient also went to .grad"
            torch.testing.assert_close(p.main_grad, start[n] + want[n], rtol=1e-5,
                                       atol=1e-5 * scale, msg=n)
        else:
            assert not hasattr(p, "main_grad")
            torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-5 * scale, msg=n)
    assert bias == any(n.endswith("bias") and "norm" not in n for n, _ in layer.named_parameters())


@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
@pytest.mark.parametrize("delay", [False, True], ids=["eager", "delayed"])
def test_bfloat16_weight_gradients_reach_main_grad_unrounded(delay, transposed):
    """With fuse_wgrad_accumulation the weight gradient goes into the float32 main_grad as the
    GEMM's float32 result (Transformer Engine's GEMM writes main_grad in float32; zbpp's FP8 path
    computes dW in float32 there too), not rounded to the bfloat16 parameters first.

    Reference: sum over four microbatches of dy^T x in float64 (the bfloat16 operands are exact
    there). Bound, elementwise: 2^-16 (|dy|^T |x|) summed, ~100x float32 accumulation over 32 rows
    plus four float32 additions; one bfloat16 rounding of dW per microbatch (2^-9 relative) is 2^7
    times over it.
    """
    torch.manual_seed(0)
    layer = Linear(64, 48, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True,
                   delay_wgrad_compute=delay)
    if transposed:  # HF's Conv1D layout, [in, out], as `delay_wgrad` converts it
        layer.weight = nn.Parameter(layer.weight.detach().t().contiguous())
        layer._weight_transposed = True
    layer.weight.main_grad = torch.zeros(layer.weight.shape)
    want = torch.zeros(48, 64, dtype=torch.float64)
    bound = torch.zeros(48, 64, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    for j in range(4):
        x = torch.randn(32, 64, generator=gen).bfloat16().requires_grad_(True)
        dy = torch.randn(32, 48, generator=gen).bfloat16()
        with microbatch(j):
            layer(x).backward(dy)
        want += dy.double().t() @ x.double()
        bound += 2.0**-16 * (dy.double().abs().t() @ x.double().abs())
    if delay:
        for j in range(4):
            layer.backward_dw(j)
    got = layer.weight.main_grad.double()
    if transposed:
        got = got.t()
    err = (got - want).abs()
    assert (err <= bound).all(), f"off by up to {(err / bound).max().item():.3g} times the bound"


def _penalised(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gradient penalty (WGAN-GP style): the output's square plus the square of its input gradient."""
    y = layer(x)
    (dx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    return y.pow(2).sum() + dx.pow(2).sum()


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("delay", [True, False])
def test_double_backward_is_refused_where_it_would_be_wrong(name, delay) -> None:
    """A gradient penalty through a delayed layer filed its first-order weight gradient for W (which
    added it into .grad, where torch.autograd.grad writes nothing) and could not differentiate W: a
    Linear(3, 2)'s weight gradient came out 0.98 where torch gives 1.06 (first entry). The fused backwards (norm
    statistics, activation derivative) are not differentiable either. Both now raise, filing
    nothing; only an eager Linear (plain GEMMs) takes a double backward."""
    layer = MAKERS[name](delay_wgrad_compute=delay, params_dtype=torch.float64)
    x = torch.randn(5, HIDDEN, dtype=torch.float64, requires_grad=True)
    if name == "Linear" and not delay:
        ref = nn.Linear(HIDDEN, OUT).double()
        ref.load_state_dict(layer.state_dict())
        _penalised(layer, x).backward()
        _penalised(ref, x).backward()
        for p, q in zip(layer.parameters(), ref.parameters()):
            # the same float64 ops in the same order: only summation order may differ
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
        return
    with microbatch(0), pytest.raises(RuntimeError, match=rf"{type(layer).__name__} .*create_graph=True"):
        _penalised(layer, x)
    assert layer.pending_wgrad_keys() == []
    assert all(p.grad is None for p in layer.parameters())


@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=x)"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_an_input_gradient_alone_leaves_weight_grads_alone(name, how) -> None:
    """``torch.autograd.grad(loss, x)`` (or ``loss.backward(inputs=[x])``) through a delayed layer
    filed its weight gradient for W: it stayed pending under the call's key, and a later
    ``backward_dw`` (``backward_dw()``, the oldest; a pipeline's W of that key) added it into
    ``.grad``, which torch leaves alone there (None for torch.nn.Linear). Now no job is filed: the
    input gradient is torch's, and a following step gets the float64 functional reference's
    gradients of its own batch only.

    Tolerance rtol 1e-9 (atol 1e-12): float64 on both sides, only reordered roundings differ; a
    leaked job adds an O(1) gradient.
    """
    layer = MAKERS[name](delay_wgrad_compute=True, params_dtype=torch.float64)
    cfg = {a: getattr(layer, a, None) for a in ("normalization", "eps", "activation")}
    kind = type(layer).__name__
    params = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    x = torch.randn(5, HIDDEN, dtype=torch.float64, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    with microbatch(0):
        loss = layer(x).square().sum()
    if how == "autograd.grad":
        (dx,) = torch.autograd.grad(loss, x)
    else:
        loss.backward(inputs=[x])
        dx = x.grad
    (want_dx,) = torch.autograd.grad(_functional(kind, cfg, params, xr).square().sum(), xr)
    torch.testing.assert_close(dx, want_dx, rtol=1e-9, atol=1e-12)
    assert layer.pending_wgrad_keys() == []
    assert all(p.grad is None for p in layer.parameters())
    # a real step after it: only its own gradients, as the reference's
    x2 = torch.randn(5, HIDDEN, dtype=torch.float64, requires_grad=True)
    with microbatch(1):
        layer(x2).square().sum().backward()
    layer.backward_dw(1)
    assert layer.pending_wgrad_keys() == []
    _functional(kind, cfg, params, x2.detach()).square().sum().backward()
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, params[n].grad, rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.parametrize("name", list(MAKERS))
def test_an_integer_or_0d_input_is_named_with_what_the_layer_takes(name):
    # an integer input was told to rebuild the layer with params_dtype=torch.int64 (which
    # params_dtype refuses), a 0-d one met an IndexError deep inside
    layer = MAKERS[name](delay_wgrad_compute=True)
    with pytest.raises(TypeError, match=r"input dtype torch.int64 is not a floating-point dtype; cast the input "
                                        r"to the parameters' torch.float32"):
        layer(torch.ones(2, HIDDEN, dtype=torch.int64))
    with pytest.raises(ValueError, match=rf"input is a 0-d tensor; the layer takes \[\.\.\., {HIDDEN}\]"):
        layer(torch.tensor(1.0))
