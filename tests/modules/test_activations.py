"""LayerNormMLP's activations and norms (high precision) against float64 references written from
their formulas (`activations64`), and those references against autograd."""

from __future__ import annotations

import pytest
import torch

from tests.modules import activations64 as a64
from zbpp.modules import LayerNormMLP, microbatch
from zbpp.modules._activations import ACTIVATIONS

BASES = ["gelu", "qgelu", "relu", "srelu", "silu"]


@pytest.mark.parametrize("base", BASES)
def test_reference_derivatives_are_autograd_of_the_references(base):
    x = torch.linspace(-9, 9, 4001, dtype=torch.float64, requires_grad=True)
    x = x[x.abs() > 1e-9].detach().requires_grad_(True)  # relu has no derivative at 0
    (auto,) = torch.autograd.grad(a64.f(base, x).sum(), x)
    torch.testing.assert_close(a64.df(base, x), auto, rtol=1e-12, atol=1e-14)


def test_every_transformer_engine_name_is_offered():
    assert sorted(ACTIVATIONS) == sorted(a64.BASE)
    assert {n for n, a in ACTIVATIONS.items() if a.glu} == a64.GLU


def _inputs(name, dtype, rows=64, ffn=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = ffn * ACTIVATIONS[name].width
    h = (torch.randn(rows, width, generator=gen, dtype=torch.float64) * 3).to(dtype)
    h[0, :4] = torch.tensor([0.0, -0.0, 1e-3, -8.0])
    da = torch.randn(rows, ffn, generator=gen, dtype=torch.float64).to(dtype)
    return h, da


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_in_float64_is_its_formula(name):
    """float64 tensors: the same formula evaluated twice, rtol 1e-12 (reordered roundings) and
    atol 1e-13 (of |da| |up| ~ 1: torch's GELU gradient, 0.5 (1 + tanh) ..., cancels for h << 0
    where the value is ~1e-15)."""
    act = ACTIVATIONS[name]
    h, da = _inputs(name, torch.float64)
    torch.testing.assert_close(act.forward(h), a64.forward(name, h), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(act.backward(da, h), a64.backward(name, da, h), rtol=1e-12,
                               atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_is_float32_math_rounded_once(name, dtype):
    """bfloat16 and float32 tensors: within one rounding to the dtype (2^-8 or 2^-24 relative)
    of the float64 value of the same inputs, plus a float32 evaluation allowance of 2^-20 of
    the magnitudes (2^-20 |da| (1 + |h|)^3 for gradients: torch's float32 GELU gradient loses
    about |h|^3 ulps to cancellation in 1 + tanh for h << 0). Computing in bfloat16 (two
    roundings in a GLU, or a bfloat16 sigmoid) is off by up to 2^-7 and fails."""
    act = ACTIVATIONS[name]
    h, da = _inputs(name, dtype)
    u = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}[dtype]
    up = h.double().chunk(2, -1)[1].abs() if act.glu else torch.ones(())
    hh = h.double().chunk(2, -1)[0].abs() if act.glu else h.double().abs()
    want = a64.forward(name, h)
    bound = u * want.abs() + 2.0**-20 * (1 + hh) * (1 + up)
    assert ((act.forward(h).double() - want).abs() <= bound).all()
    want = a64.backward(name, da, h)
    if act.glu:
        hh, up = torch.cat([hh, hh], -1), torch.cat([up, up], -1)
        dd = torch.cat([da.double().abs()] * 2, -1)
    else:
        dd = da.double().abs()
    bound = u * want.abs() + 2.0**-20 * dd * (1 + hh) ** 3 * (1 + up)
    assert ((act.backward(da, h).double() - want).abs() <= bound).all()


def _mlp64(p, x, name, normalization, eps):
    """LayerNormMLP in float64 from its parameter dict `p`, written from the formulas."""
    if normalization == "LayerNorm":
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        h = (x - mu) / torch.sqrt(var + eps) * p["layer_norm_weight"] + p["layer_norm_bias"]
    else:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * p["layer_norm_weight"]
    h = h @ p["fc1_weight"].t() + p["fc1_bias"]
    return a64.forward(name, h) @ p["fc2_weight"].t() + p["fc2_bias"]


@pytest.mark.parametrize("delay", [False, True], ids=["eager", "delayed"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_layernorm_mlp_float64_matches_its_formula(name, normalization, delay):
    """Output, input gradient and every parameter gradient of a float64 LayerNormMLP against
    autograd through `_mlp64`, rtol 1e-9: both sides compute in float64, so only reordered
    roundings separate them, while a wrong formula, a wrong half of a GLU or a gradient left in
    the store gives O(1) differences."""
    torch.manual_seed(0)
    mlp = LayerNormMLP(16, 24, activation=name, normalization=normalization,
                       delay_wgrad_compute=delay, params_dtype=torch.float64)
    with torch.no_grad():
        for q in mlp.parameters():
            q.add_(0.2 * torch.randn_like(q)) if q.dim() == 1 else q.mul_(20)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, 5, 16, dtype=torch.float64)
    with microbatch("m"):
        y = mlp(x)
    y.backward(r)
    mlp.backward_dw("m")
    p = {n: q.detach().clone().requires_grad_(True) for n, q in mlp.named_parameters()}
    xr = x.detach().clone().requires_grad_(True)
    y_ref = _mlp64(p, xr, name, normalization, mlp.eps)
    y_ref.backward(r)
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-9, atol=1e-12)
    for n, q in mlp.named_parameters():
        torch.testing.assert_close(q.grad, p[n].grad, rtol=1e-9, atol=1e-12, msg=n)
