"""FP8 in zbpp.modules: recipe, delayed scaling, GEMM paths, numerics against float64.

Numerics are checked elementwise against float64 references with the bounds derived in
`fp8_bounds` (about 13% of |A||B| for a forward GEMM, 20% for a gradient GEMM, plus subnormal and
rounding terms); the scale update against hand-worked histories. The whole LayerNormMLP, every
activation, is in test_mlp_fp8.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.modules import fp8_bounds as fb
from zbpp.modules import DelayedScaling, Format, LayerNormMLP, Linear, fp8_autocast, microbatch
from zbpp.modules import fp8 as fp8mod
from zbpp.modules.fp8 import cast as fp8cast
from zbpp.modules.fp8 import gemm as fp8gemm
from zbpp.modules.fp8 import Quantized, ScalingMeta, fp8_gemm_nt, gemm_path_counts, quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# -- recipe and autocast ------------------------------------------------------------------------


def test_recipe_formats_and_validation():
    hybrid = DelayedScaling(margin=0, amax_history_len=16, amax_compute_algo="max")
    assert (hybrid.fwd_dtype, hybrid.bwd_dtype) == (E4M3, E5M2)
    e4m3 = DelayedScaling(fp8_format=Format.E4M3)
    assert (e4m3.fwd_dtype, e4m3.bwd_dtype) == (E4M3, E4M3)
    assert DelayedScaling(fp8_format="hybrid").fp8_format is Format.HYBRID
    with pytest.raises(ValueError, match="amax_compute_algo='mean'"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="amax_history_len=0"):
        DelayedScaling(amax_history_len=0)
    with pytest.raises(ValueError, match="margin=-1"):
        DelayedScaling(margin=-1)
    with pytest.raises(ValueError, match="fp8_format='E5M2'"):
        DelayedScaling(fp8_format="E5M2")
    with pytest.raises(ValueError, match="fprop_fast_accumulation='yes'"):
        DelayedScaling(fprop_fast_accumulation="yes")


def test_autocast_nests_and_disables():
    outer, inner = DelayedScaling(amax_history_len=3), DelayedScaling(amax_history_len=5)
    assert fp8mod.active_recipe() is None
    with fp8_autocast(fp8_recipe=outer):
        assert fp8mod.active_recipe() is outer
        with fp8_autocast(fp8_recipe=inner):
            assert fp8mod.active_recipe() is inner
        with fp8_autocast(enabled=False):
            assert fp8mod.active_recipe() is None
        assert fp8mod.active_recipe() is outer
    with fp8_autocast():
        assert fp8mod.active_recipe() == DelayedScaling()
    assert fp8mod.active_recipe() is None


@pytest.mark.parametrize("rows", [16, 10])  # torch._scaled_mm's shapes, and the dequantised product's
def test_fp8_layers_run_as_outside_torch_autocast(rows):
    """Under ``torch.autocast`` (bfloat16) a float32 FP8 layer returns float32, so it is not refused,
    but autocast ran its GEMMs in bfloat16 (the dequantised float32 product, and CPU's
    ``_scaled_mm``, which computes through it): outputs off by bfloat16 roundings, and LayerNormMLP's
    gradients with them (its backward reads fc1's output). Reference: the same layer outside
    torch.autocast; bit for bit (the same CPU operations on the same values)."""
    torch.manual_seed(0)
    x = torch.randn(rows, 32)
    got = []
    for autocast in (True, False):
        torch.manual_seed(1)
        layer = LayerNormMLP(32, 64)  # the same weights each time
        xx = x.clone().requires_grad_()
        with fp8_autocast(fp8_recipe=DelayedScaling()), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(xx)
        (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
        got.append([y, xx.grad, *(p.grad for p in layer.parameters())])
    assert all(a.dtype == b.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(*got, strict=True))


# -- delayed scaling ---------------------------------------------------------------------------


def _push(meta, amax, recipe):
    meta.update(torch.tensor(float(amax)), recipe)
    return meta.amax_history.tolist(), meta.scale.item()


def test_scale_follows_amax_history_hand_worked():
    """scale = 448 / max(history) / 2^margin, history newest first, length 3."""
    rec = DelayedScaling(amax_history_len=3, amax_compute_algo="max")
    meta = ScalingMeta(E4M3, history_len=3)
    assert (meta.amax_history.tolist(), meta.scale.item()) == ([0, 0, 0], 1.0)
    assert _push(meta, 2, rec) == ([2, 0, 0], 224.0)
    assert _push(meta, 4, rec) == ([4, 2, 0], 112.0)
    assert _push(meta, 1, rec) == ([1, 4, 2], 112.0)
    assert _push(meta, 1, rec) == ([1, 1, 4], 112.0)
    assert _push(meta, 1, rec) == ([1, 1, 1], 448.0)  # the 4 left the window
    assert _push(meta, 0, rec) == ([0, 1, 1], 448.0)
    recent = DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent")
    assert _push(meta, 8, recent) == ([8, 0, 1], 56.0)
    assert _push(meta, 2, recent) == ([2, 8, 0], 224.0)
    assert _push(meta, 0, recent) == ([0, 2, 8], 224.0)  # zero amax: keep the scale
    assert _push(meta, float("inf"), recent)[1] == 224.0  # non-finite amax: keep the scale
    margin = DelayedScaling(amax_history_len=3, margin=2)
    assert ScalingMeta(E5M2, history_len=3).fp8_max == 57344.0
    fresh = ScalingMeta(E5M2, history_len=3)
    assert _push(fresh, 7, margin) == ([7, 0, 0], 57344.0 / 7 / 4)


def test_history_length_change_keeps_newest():
    meta = ScalingMeta(E4M3, history_len=3)
    for a in (1, 2, 3):
        _push(meta, a, DelayedScaling(amax_history_len=3))
    assert _push(meta, 4, DelayedScaling(amax_history_len=2)) == ([4, 3], 112.0)
    assert _push(meta, 1, DelayedScaling(amax_history_len=4)) == ([1, 4, 3, 0], 112.0)


def test_quantize_uses_the_scale_before_its_own_update_and_clamps():
    rec = DelayedScaling(amax_history_len=2)
    meta = ScalingMeta(E4M3, history_len=2)
    x = torch.tensor([[0.3, -2.0, 1000.0]])
    q = quantize(x, meta, rec)  # scale 1: 1000 saturates to 448 (not NaN)
    assert q.scale_inv.item() == 1.0 and q.data.dtype == E4M3
    assert q.dequantize().tolist() == [[0.3125, -2.0, 448.0]]  # 0.3 rounds to 0.3125 in e4m3
    assert meta.scale.item() == pytest.approx(0.448)
    q2 = quantize(x, meta, rec)  # now 1000 * 0.448 = 448: exact, nothing saturates
    torch.testing.assert_close(q2.dequantize(), torch.tensor([[0.3013, -2.0089, 1000.0]]),
                               rtol=2.0**-4, atol=0)
    g = ScalingMeta(E5M2, history_len=1)
    assert quantize(torch.tensor([1e6, -1e6]), g, rec).dequantize().tolist() == [57344, -57344]


def test_linear_steps_its_three_slots():
    """Forward steps input and weight slots with the tensors' amaxes, backward the grad slot."""
    layer = Linear(24, 20, delay_wgrad_compute=True)  # odd sizes: the dequantised path
    rec = DelayedScaling(amax_history_len=4)
    x = torch.randn(10, 24)
    r = torch.randn(10, 20)
    with fp8_autocast(fp8_recipe=rec):
        y = layer(x)
    meta = layer.fp8_meta
    assert meta["input"].dtype == E4M3 and meta["grad_output"].dtype == E5M2
    assert meta["input"].amax_history.tolist() == [x.abs().max().item(), 0, 0, 0]
    assert meta["weight"].amax_history[0].item() == layer.weight.abs().max().item()
    assert meta["grad_output"].amax_history.tolist() == [0, 0, 0, 0]
    # the first forward used scale 1 (a fresh slot): the hand reference
    xq = x.to(E4M3).float()
    wq = layer.weight.detach().to(E4M3).float()
    assert torch.equal(y, (xq @ wq.t() + layer.bias).detach())
    y.backward(r)
    assert meta["grad_output"].amax_history[0].item() == r.abs().max().item()
    assert meta["grad_output"].scale.item() == pytest.approx(57344 / r.abs().max().item())
    s = 448 / x.abs().max().item()
    assert meta["input"].scale.item() == pytest.approx(s)
    with fp8_autocast(fp8_recipe=rec):  # the second forward uses the updated scale
        y2 = layer(x)
    xq2 = (x * s).clamp(-448, 448).to(E4M3).float() / s
    s_w = 448 / layer.weight.abs().max().item()
    wq2 = (layer.weight.detach() * s_w).to(E4M3).float() / s_w
    torch.testing.assert_close(y2.detach(), xq2 @ wq2.t() + layer.bias.detach(),
                               rtol=1e-5, atol=1e-6)  # scales rounded differently: a few ulps
    layer.backward_dw()


def _built_afresh(layer, index, call, weight, bias):
    """`_gemm_call`'s answer with nothing reused: the reference for the reused one."""
    kept = dict(layer._fp8_calls)
    layer._fp8_calls.clear()
    try:
        return layer._gemm_call(index, call, weight, bias)
    finally:
        layer._fp8_calls.update(kept)


def _same_call(a, b):
    # every field; the objects by identity (the parameters, the slots a forward steps, the cache)
    objects = lambda c: (c.weight, c.bias, c.fp8.recipe, c.fp8.input, c.fp8.weight,  # noqa: E731
                         c.fp8.grad_output, c.fp8.weight_cache)
    assert all(x is y for x, y in zip(objects(a), objects(b)))
    values = lambda c: (c.weight_name, c.bias_name, c.fuse_wgrad_accumulation, c.transposed,  # noqa: E731
                        c.fp8.first_microbatch)
    assert values(a) == values(b)


def test_reused_fp8_gemm_call_follows_every_change():
    """A forward's FP8 GemmCall is reused across calls, and is what building it afresh gives
    after each change it depends on: recipe, is_first_microbatch, fuse_wgrad_accumulation, a
    replaced weight, slots replaced (a restore, an adopted input slot) and a move of the module."""
    from zbpp.modules._scaling_state import restore_scaling_states, scaling_states
    from zbpp.modules.base import ForwardCall

    layer = Linear(16, 16, delay_wgrad_compute=True)
    hybrid, e4m3 = DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=4, fp8_format=Format.E4M3)

    def gemm(recipe, first=None):
        call = ForwardCall("k", recipe, first)
        got = layer._gemm_call(0, call, layer.weight, layer.bias)
        _same_call(got, _built_afresh(layer, 0, call, layer.weight, layer.bias))
        return got

    first = gemm(hybrid)
    assert gemm(hybrid) is first  # nothing changed: reused
    assert gemm(hybrid, True).fp8.first_microbatch is True and gemm(hybrid, False).fp8.first_microbatch is False
    assert gemm(hybrid) is first
    assert gemm(e4m3).fp8.grad_output.dtype == E4M3  # another recipe: another grad slot
    layer.fuse_wgrad_accumulation = True
    assert gemm(e4m3).fuse_wgrad_accumulation
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone())
    assert gemm(e4m3).weight is layer.weight
    with fp8_autocast(fp8_recipe=e4m3):
        layer(torch.randn(16, 16))
    restore_scaling_states(layer, scaling_states(layer))  # new slot objects for the same state
    assert gemm(e4m3).fp8.input is layer.fp8_meta["input"]
    for name in ("input", "weight", "grad_output"):  # one replaced (an adopted shared input slot)
        layer.fp8_meta[name] = ScalingMeta(E4M3, history_len=4)
        assert getattr(gemm(e4m3).fp8, name) is layer.fp8_meta[name]
    layer.to("meta")  # the slots follow the weight there (`_slot` moves them) ...
    assert gemm(e4m3).fp8.weight.scale.device.type == "meta"
    for name in ("input", "weight", "grad_output"):  # ... and after one is left behind
        slot = layer.fp8_meta[name]
        slot.scale = torch.ones(())
        layer._gemm_call(0, ForwardCall("k", e4m3, None), layer.weight, layer.bias)
        assert slot.scale.device.type == "meta"


def test_layer_pickled_without_reused_fp8_calls_runs_fp8():
    """A layer pickled by a zbpp without `_fp8_calls` (its state lacks it) loads and runs in FP8
    as a fresh one does: the same output on the same input."""
    import pickle

    layer = Linear(16, 16)
    state = layer.__dict__.copy()
    del state["_fp8_calls"]
    old = Linear.__new__(Linear)
    old.__setstate__(pickle.loads(pickle.dumps(state)))
    x = torch.randn(16, 16)
    with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
        assert torch.equal(old(x), layer(x))


# -- GEMM paths ---------------------------------------------------------------------------------


def _q(t, dtype, scale):
    return Quantized((t * scale).to(dtype), torch.tensor(1 / scale))


def test_scaled_mm_and_dequantised_paths_agree():
    """Same FP8 operands through both paths: equal up to float32 accumulation (gamma_K)."""
    a = _q(torch.randn(32, 64), E5M2, 4.0)
    b = _q(torch.randn(48, 64), E4M3, 8.0)
    bias = torch.randn(48)
    fp8mod.reset_gemm_path_counts()
    fast = fp8_gemm_nt(a, b, out_dtype=torch.float32, bias=bias)
    slow = fp8_gemm_nt(a, b, out_dtype=torch.float32, bias=bias, use_scaled_mm=False)
    assert gemm_path_counts() == {"scaled_mm": 1, "dequantized": 1}
    exact = a.dequantize().double() @ b.dequantize().double().t() + bias.double()
    budget = fb.gamma(64 + 4) * (a.dequantize().abs() @ b.dequantize().abs().t() + bias.abs())
    assert ((fast.double() - exact).abs() <= budget.double()).all()
    assert ((slow.double() - exact).abs() <= budget.double()).all()
    bias16 = bias.bfloat16()
    bf = fp8_gemm_nt(a, b, out_dtype=torch.bfloat16, bias=bias16)  # bias fused into _scaled_mm
    assert bf.dtype == torch.bfloat16
    exact = exact - bias.double() + bias16.double()
    # at most two bfloat16 roundings (u = 2^-8 each: GEMM result, bias sum) on top of float32
    bf_budget = 2.0**-7 * (exact.abs() + budget.double()) + budget.double()
    assert ((bf.double() - exact).abs() <= bf_budget).all()


def test_odd_dimensions_fall_back_and_refusal_falls_back(monkeypatch):
    a, b = _q(torch.randn(10, 24), E4M3, 1.0), _q(torch.randn(20, 24), E4M3, 1.0)
    fp8mod.reset_gemm_path_counts()
    out = fp8_gemm_nt(a, b, out_dtype=torch.float32)
    assert gemm_path_counts() == {"scaled_mm": 0, "dequantized": 1}
    torch.testing.assert_close(out, a.dequantize() @ b.dequantize().t(), rtol=0, atol=0)

    def refuse(*args, **kwargs):
        raise RuntimeError("scaled_mm unsupported here")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    monkeypatch.setattr(fp8gemm, "_refused", set())
    a16, b16 = _q(torch.randn(16, 32), E4M3, 1.0), _q(torch.randn(16, 32), E4M3, 1.0)
    with pytest.warns(UserWarning, match="refused on cpu"):
        out = fp8_gemm_nt(a16, b16, out_dtype=torch.float32)
    torch.testing.assert_close(out, a16.dequantize() @ b16.dequantize().t(), rtol=0, atol=0)
    fp8_gemm_nt(a16, b16, out_dtype=torch.float32)  # remembered: no second attempt or warning
    assert gemm_path_counts() == {"scaled_mm": 0, "dequantized": 3}
    with pytest.raises(ValueError, match="inner dimensions differ"):
        fp8_gemm_nt(a, a16, out_dtype=torch.float32)


# -- numerics against float64 -------------------------------------------------------------------


def _calibrated_scales(module):
    return {name: meta.scale.item() for name, meta in module.fp8_meta.items()}


def _check(name, got, ref, bound, *, min_rel_err=None):
    err = (got.double() - ref).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{name}: error exceeds the derived bound by {worst:.3g}"
    if min_rel_err is not None:  # FP8 really ran (a high-precision GEMM would be far better)
        assert (err.max() / ref.abs().max()).item() > min_rel_err, f"{name}: suspiciously exact"


def linear_fp8_case(*, dtype, shape, device="cpu", accumulation=None, fprop_accumulation=None):
    """Delayed FP8 Linear vs float64: output, input grad, weight grad, bias grad within bounds."""
    t, n_in, n_out = shape
    torch.manual_seed(0)
    layer = Linear(n_in, n_out, delay_wgrad_compute=True, params_dtype=dtype, device=device)
    with torch.no_grad():
        layer.bias.normal_()
    x = (3 * torch.randn(t, n_in, device=device)).to(dtype)
    r = torch.randn(t, n_out, device=device).to(dtype)
    rec = DelayedScaling(amax_history_len=16)
    for _ in range(2):  # calibrate the delayed scales on the same data
        with fp8_autocast(fp8_recipe=rec):
            layer(x).backward(r)
        layer.backward_dw()
    layer.zero_grad(set_to_none=True)
    s = _calibrated_scales(layer)
    fp8mod.reset_gemm_path_counts()
    xg = x.clone().requires_grad_(True)
    with microbatch("m"), fp8_autocast(fp8_recipe=rec):
        y = layer(xg)
    y.backward(r)
    layer.backward_dw("m")
    counts = gemm_path_counts()

    x64, r64 = x.double(), r.double()
    w64, b64 = layer.weight.detach().double(), layer.bias.detach().double()
    ex, ew = fb.cast_error(x64, s["input"], E4M3), fb.cast_error(w64, s["weight"], E4M3)
    er = fb.cast_error(r64, s["grad_output"], E5M2)
    kw = dict(out_dtype=dtype, accumulation=accumulation)
    fprop = dict(kw, accumulation=fprop_accumulation or accumulation)
    _check("output", y, x64 @ w64.t() + b64,
           fb.gemm_error(x64, w64.t(), ex, ew.t(), bias=b64, **fprop), min_rel_err=1e-3)
    _check("input grad", xg.grad, r64 @ w64, fb.gemm_error(r64, w64, er, ew, **kw),
           min_rel_err=1e-3)
    _check("weight grad", layer.weight.grad, r64.t() @ x64,
           fb.gemm_error(r64.t(), x64, er.t(), ex, **kw), min_rel_err=1e-3)
    db_bound = fb.gamma(t) * r64.abs().sum(0) + fb.U_OUT[dtype] * r64.sum(0).abs()
    _check("bias grad", layer.bias.grad, r64.sum(0), db_bound)
    return counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape,path", [((32, 64, 48), "scaled_mm"), ((10, 24, 20), "dequantized")],
    ids=["aligned", "odd"],
)
def test_linear_fp8_numerics_within_derived_bound(dtype, shape, path):
    counts = linear_fp8_case(dtype=dtype, shape=shape)
    assert counts[path] == 3 and sum(counts.values()) == 3  # fprop, dgrad, wgrad


@pytest.mark.parametrize("fast", [True, False])
def test_only_the_forward_gemm_uses_fast_accumulation(monkeypatch, fast):
    """Transformer Engine's split: fprop fast (if the recipe says so), dgrad and wgrad float32."""
    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(kwargs["use_fast_accum"])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    layer = Linear(32, 48, delay_wgrad_compute=True)
    x = torch.randn(16, 32, requires_grad=True)
    with fp8_autocast(fp8_recipe=DelayedScaling(fprop_fast_accumulation=fast)):
        y = layer(x)
    assert calls == [fast]
    y.sum().backward()
    assert calls == [fast, False]  # dgrad in B
    layer.backward_dw()
    assert calls == [fast, False, False]  # wgrad in W


# -- the consumed-bias case ---------------------------------------------------------------------


def _consume_into_main_grad(p):
    # A Megatron-style reducer: move the fresh gradient into main_grad and drop .grad.
    p.main_grad.add_(p.grad)
    p.grad = None


@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP"])
def test_fp8_bias_grad_consumed_during_b_is_not_backfilled(name):
    torch.manual_seed(0)
    layer = (Linear(32, 32, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
             if name == "Linear" else
             LayerNormMLP(32, 64, delay_wgrad_compute=True, fuse_wgrad_accumulation=True))
    biases = [q for n, q in layer.named_parameters() if n.endswith("bias") and "norm" not in n]
    for q in layer.parameters():
        q.main_grad = torch.zeros_like(q)
    for b in biases:
        b.register_post_accumulate_grad_hook(_consume_into_main_grad)
    x, r = torch.randn(16, 32), torch.randn(16, 32)
    with microbatch(0), fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
        y = layer(x)
    y.backward(r)
    assert all(b.grad is None for b in biases)  # the hooks took the eager bias grads
    assert torch.equal(biases[-1].main_grad, r.sum(0))  # the last GEMM's bias grad is sum(dy)
    kept = [b.main_grad.clone() for b in biases]
    assert not any(id(b) in map(id, layer.get_backward_dw_params()) for b in biases)

    layer.backward_dw(0)  # must not crash on the job's missing bias grad

    for b, before in zip(biases, kept):
        assert b.grad is None and torch.equal(b.main_grad, before)  # no double count
    for q in layer.parameters():
        for g in (q.grad, q.main_grad):
            assert g is None or torch.isfinite(g).all()
    weights = [q for q in layer.parameters() if q.dim() == 2]
    assert all(w.main_grad.abs().sum() > 0 and w.grad is None for w in weights)


# -- on the GPU machine -------------------------------------------------------------------------

# Hopper FP8 tensor cores keep about 14 bits while accumulating inside a 128-deep block (DeepSeek-V3
# technical report, section 3.3.2); with use_fast_accum=False cuBLAS adds the blocks in float32.
# Accumulation bound: gamma_128 at u = 2^-14 (= 2^-7) plus float32 gamma_K over the blocks.
def _hopper_accumulation(k):
    return fb.gamma(128, 2.0**-14) + fb.gamma(k)


def _hopper_fast_accumulation(k):
    # use_fast_accum=True: no float32 promotion. Hopper's FP8 tensor cores keep "around 14 bits"
    # of their partial sums (DeepSeek-V3 report, section 3.3.2: measured, not specified), and
    # they truncate: 2^-13 per addition, over all k terms.
    return fb.gamma(k, 2.0**-13)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fast", [True, False], ids=["fast-fprop", "float32-fprop"])
def test_gpu_linear_fp8_runs_scaled_mm_within_bound(fast):
    counts = linear_fp8_case(
        dtype=torch.bfloat16, shape=(256, 512, 384), device="cuda",
        accumulation=_hopper_accumulation(512),
        fprop_accumulation=_hopper_fast_accumulation(512) if fast else None,
    )
    assert counts == {"scaled_mm": 3, "dequantized": 0}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_compiled_cast_equals_eager_cast(dtype):
    """On CUDA the cast runs through torch.compile; it must give the eager cast's bits."""
    x = (100 * torch.randn(96, 80, device="cuda")).to(dtype)
    scale = torch.tensor(3.7, device="cuda")
    compiled = torch.compile(fp8cast._cast_eager, dynamic=True)  # raises if it cannot compile
    for f8 in (E4M3, E5M2):
        fmax = torch.finfo(f8).max
        want = fp8cast._cast_eager(x, scale, fmax, f8, True)
        got = compiled(x, scale, fmax, f8, True)
        for w, g in zip(want, got):
            assert torch.equal(w.float(), g.float())


@pytest.mark.parametrize("first", [None, True], ids=["cast each call", "cast kept"])
@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP", "gated MLP"])
def test_an_fp8_forward_under_inference_mode_then_training(name, first):
    """An evaluation under ``torch.inference_mode`` before training: the layer's first FP8
    forward made its scaling slots (and, with ``is_first_microbatch=True``, its kept weight cast)
    inference tensors, and the next training forward failed to update or save them. Reference:
    the same layer evaluated under ``torch.no_grad`` instead; bit-identical (the same casts in
    the same order, the slots in the same states)."""
    import copy

    from torch import nn

    from zbpp.modules import delay_wgrad, fuse_gated_mlps

    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(32, 64, bias=False), nn.Linear(32, 64, bias=False)
            self.down_proj, self.act_fn = nn.Linear(64, 32, bias=False), nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    torch.manual_seed(0)
    if name == "gated MLP":
        layer = Gated()
        assert fuse_gated_mlps(layer) == [""]
        delay_wgrad(layer)
        for m in (layer.gate_proj, layer.up_proj, layer.down_proj):  # is_first_microbatch from (stage, j)
            m.keep_fp8_weight_casts = first is not None
        run = lambda m, x, j: m(x)  # noqa: E731
    else:
        layer = (Linear(32, 32, delay_wgrad_compute=True) if name == "Linear"
                 else LayerNormMLP(32, 64, delay_wgrad_compute=True))
        run = lambda m, x, j: m(x, is_first_microbatch=None if first is None else j == 0)  # noqa: E731
    ref = copy.deepcopy(layer)
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(16, 32)
    outs = []
    for m, evaluation in ((layer, torch.inference_mode), (ref, torch.no_grad)):
        with evaluation(), fp8_autocast(fp8_recipe=recipe), microbatch((0, 0)):
            run(m, x, 0)
        xi = x.clone().requires_grad_()
        with fp8_autocast(fp8_recipe=recipe), microbatch((0, 1)):
            y = run(m, xi, 1)
        y.square().sum().backward()
        for w in [m] if name != "gated MLP" else [m.gate_proj, m.up_proj, m.down_proj]:
            w.backward_dw((0, 1))
        outs.append((y, xi.grad, [p.grad for p in m.parameters()]))
    (y, dx, grads), (y_ref, dx_ref, grads_ref) = outs
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
