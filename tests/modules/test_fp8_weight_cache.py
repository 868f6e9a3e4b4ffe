"""``is_first_microbatch``: an FP8 weight cast kept across the microbatches of an optimizer step.

Reference: the same layer (a deep copy, same state) casting its weights on every call. Once the
weight's scale has settled (its second cast on, while the weight is unchanged, every cast of it
gives the same bytes with the same scale), reusing the kept cast must give bit-identical outputs
and gradients (rtol=atol=0) while casting the weights fewer times; after an in-place update of
the weight the kept cast must not be used.
"""

from __future__ import annotations

import copy

import pytest
import torch

from zbpp.modules import DelayedScaling, LayerNormLinear, LayerNormMLP, Linear, fp8_autocast
from zbpp.modules import fp8 as fp8mod

MAKERS = {  # every GEMM dimension a multiple of 16: _scaled_mm runs (CPU and Hopper)
    "Linear": lambda **kw: Linear(32, 48, **kw),
    "LayerNormLinear": lambda **kw: LayerNormLinear(32, 48, **kw),
    "LayerNormMLP": lambda **kw: LayerNormMLP(32, 64, **kw),
}
OUT = {"Linear": 48, "LayerNormLinear": 48, "LayerNormMLP": 32}
WEIGHT_SLOTS = {"Linear": ["weight"], "LayerNormLinear": ["weight"],
                "LayerNormMLP": ["fc1_weight", "fc2_weight"]}
TOKENS = 16
RECIPE = DelayedScaling(amax_history_len=8)

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ]),
]


def make(name, device, *, delay):
    torch.manual_seed(7)
    return MAKERS[name](delay_wgrad_compute=delay, params_dtype=torch.bfloat16, device=device)


def microbatches(n, device, name="Linear"):
    """`n` pairs (input, output gradient), the same for every call."""
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(TOKENS, 32, generator=gen).to(device, torch.bfloat16),
             torch.randn(TOKENS, OUT[name], generator=gen).to(device, torch.bfloat16))
            for _ in range(n)]


def run(module, batches, firsts):
    """Forward + backward (+ W) per microbatch, gradients accumulating as between two steps."""
    outs, dxs = [], []
    for (x, dy), first in zip(batches, firsts):
        x = x.clone().requires_grad_(True)
        with fp8_autocast(enabled=True, fp8_recipe=RECIPE):
            y = module(x, is_first_microbatch=first)
        y.backward(dy)
        if module.delay_wgrad_compute:
            module.backward_dw()
        outs.append(y.detach())
        dxs.append(x.grad)
    return outs, dxs


def weight_casts(module, name):
    """How many casts each weight slot's amax history has seen (non-zero entries: the weights'
    amaxes are never zero here)."""
    return [int((module.fp8_meta[w].amax_history != 0).sum()) for w in WEIGHT_SLOTS[name]]


def assert_same(a, b):
    assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("delay", [False, True], ids=["eager", "delayed"])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_reused_weight_cast_equals_casting_every_time(name, delay, device):
    cached = make(name, device, delay=delay)
    run(cached, microbatches(1, device, name), [None])  # the weights' scales settle after it
    cached.zero_grad(set_to_none=True)
    reference = copy.deepcopy(cached)
    batches = microbatches(4, device, name)

    fp8mod.reset_cast_path_counts()
    outs, dxs = run(cached, batches, [True, False, False, False])
    cached_casts = sum(fp8mod.cast_path_counts()[p] for p in fp8mod.CAST_PATHS)
    fp8mod.reset_cast_path_counts()
    ref_outs, ref_dxs = run(reference, batches, [None] * 4)
    ref_casts = sum(fp8mod.cast_path_counts()[p] for p in fp8mod.CAST_PATHS)

    assert_same(outs, ref_outs)
    assert_same(dxs, ref_dxs)
    for (pname, p), q in zip(cached.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), pname
    gemms = len(WEIGHT_SLOTS[name])
    assert ref_casts - cached_casts == 3 * gemms  # three microbatches reused each weight's cast
    # the weights' histories stepped once for the four microbatches (plus the warm-up cast)
    assert weight_casts(cached, name) == [2] * gemms
    assert weight_casts(reference, name) == [5] * gemms


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_update_makes_the_kept_cast_stale(device):
    cached = make("Linear", device, delay=False)
    run(cached, microbatches(1, device), [None])
    reference = copy.deepcopy(cached)
    first, second = microbatches(2, device)
    run(cached, [first], [True])
    run(reference, [first], [None])
    for module in (cached, reference):  # what an optimizer step does between two steps
        with torch.no_grad():
            module.weight.mul_(0.75)
    outs, dxs = run(cached, [second], [False])  # wrongly False: the kept cast must not be used
    ref_outs, ref_dxs = run(reference, [second], [None])
    assert_same(outs, ref_outs)
    assert_same(dxs, ref_dxs)
    assert weight_casts(cached, "Linear") == weight_casts(reference, "Linear") == [3]


def test_true_recasts_and_none_keeps_nothing():
    layer = make("Linear", "cpu", delay=False)
    batches = microbatches(3, "cpu")
    run(layer, batches, [True, True, False])
    assert weight_casts(layer, "Linear") == [2]  # True casts every time it is passed
    run(layer, batches[:1], [None])
    assert weight_casts(layer, "Linear") == [3]
    run(layer, batches[:1], [False])  # None dropped the kept cast: False has to cast again
    assert weight_casts(layer, "Linear") == [4]


def test_outside_fp8_the_flag_changes_nothing():
    layer = make("LayerNormMLP", "cpu", delay=False)
    x = microbatches(1, "cpu", "LayerNormMLP")[0][0]
    plain = layer(x)
    assert torch.equal(layer(x, is_first_microbatch=True), plain)
    assert torch.equal(layer(x, is_first_microbatch=False), plain)
    assert layer.fp8_meta == {}


@pytest.mark.parametrize("bad", [1, "yes", 0.0])
def test_is_first_microbatch_must_be_bool_or_none(bad):
    layer = make("Linear", "cpu", delay=False)
    with pytest.raises(TypeError, match=r"Linear: is_first_microbatch=.*True on the first"):
        layer(microbatches(1, "cpu")[0][0], is_first_microbatch=bad)


def _hand_cast(t, scale, dtype=torch.float8_e4m3fn):
    """The cast by its formula, dequantised in float64: fp8(clamp(fl32(t * s))) * fl32(1 / s)."""
    s = torch.tensor(scale, dtype=torch.float32)
    fmax = torch.finfo(dtype).max
    data = (t.detach().float() * s).clamp(-fmax, fmax).to(dtype)
    return data.double() * s.reciprocal().double()


@pytest.mark.parametrize("mode", ["fused", "foreach", "for-loop"])
def test_an_optimizer_step_makes_the_kept_cast_stale(mode):
    """torch.optim's fused optimizers update the weight in place without bumping its version
    counter (torch 2.14, CPU): the kept cast must be dropped after any optimizer step anyway.

    Reference: the forward after the step by hand, in float64, from the slots' scales (the cast
    formula, `_hand_cast`) and the updated weight. Tolerance: one bfloat16 rounding of the output
    (2^-8 relative to |x_q| |w_q|^T + |b|, twice the half-ulp) covers the float32 accumulation
    and the bias; the stale cast is off by the step (lr 1e-2 on weights of std 0.023: ~40%)."""
    layer = make("Linear", "cpu", delay=False)
    options = {"fused": dict(fused=True), "foreach": dict(foreach=True),
               "for-loop": dict(foreach=False)}[mode]
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, **options)
    recipe = DelayedScaling(amax_history_len=8, margin=1)  # margin: the new weight never clamps
    (x, dy), (x2, _) = microbatches(2, "cpu")
    with fp8_autocast(fp8_recipe=recipe):
        layer(x, is_first_microbatch=True).backward(dy)
    opt.step()
    s_x, s_w = (layer.fp8_meta[n].scale.item() for n in ("input", "weight"))
    with fp8_autocast(fp8_recipe=recipe):
        y = layer(x2, is_first_microbatch=False)  # wrongly False: the kept cast must not be used
    xq, wq = _hand_cast(x2, s_x), _hand_cast(layer.weight, s_w)
    bias = layer.bias.detach().double()
    want = xq @ wq.t() + bias
    bound = 2.0**-8 * (xq.abs() @ wq.abs().t() + bias.abs())
    err = (y.detach().double() - want).abs()
    assert (err <= bound).all(), f"off by up to {err.max().item():.3g} (bound {bound.max().item():.3g})"


@pytest.mark.parametrize("delay", [False, True], ids=["eager", "delayed"])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_deep_copy_reuses_its_own_copy_of_the_kept_cast(name, delay):
    """A deep copy taken between the first microbatch (True) and the others (False) computes what
    the original computes: it reuses its copy of the kept cast, as the original reuses its own.
    (The first cast is made with the fresh slot's scale 1, so a copy that cast again, with the
    stepped scale, gives other outputs.) Reference: the original, uninterrupted; bit for bit (the
    same CPU operations on the same values). Then the copy shares nothing mutable: an in-place
    update of its weights makes only its own kept casts stale."""
    layer = make(name, "cpu", delay=delay)
    batches = microbatches(3, "cpu", name)
    run(layer, batches[:1], [True])
    layer.zero_grad(set_to_none=True)  # the gradients compared are those of the calls after the copy
    twin = copy.deepcopy(layer)
    outs, dxs = run(layer, batches[1:], [False, False])
    twin_outs, twin_dxs = run(twin, batches[1:], [False, False])
    assert_same(twin_outs, outs)
    assert_same(twin_dxs, dxs)
    for (pname, p), q in zip(layer.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), pname
    gemms = len(WEIGHT_SLOTS[name])
    assert weight_casts(twin, name) == weight_casts(layer, name) == [1] * gemms
    with torch.no_grad():
        for w in WEIGHT_SLOTS[name]:
            getattr(twin, w).mul_(0.75)
    run(twin, batches[:1], [False])  # its weights changed: it casts again
    run(layer, batches[:1], [False])  # the original's weights did not: its kept casts hold
    assert weight_casts(twin, name) == [2] * gemms
    assert weight_casts(layer, name) == [1] * gemms
