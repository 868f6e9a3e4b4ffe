"""FP8 LayerNormMLP against float64, every activation and both norms, errors propagated through
the layer with the bounds of `fp8_bounds`; on the GPU with the fused kernels and without them.

A delayed FP8 LayerNormMLP is calibrated on the data (three passes, margin 1: delayed scaling's
headroom when an amax grows), then one more pass is compared elementwise with a float64 model of
the same parameters (`activations64` and the norms' formulas). The bound follows the data through
the layer, each step's error from the previous one's:

- norm: the float32 evaluation (an allowance of 1e-5 (|ln| + 1), checked against float64 on the
  same data), plus one rounding to the parameters' dtype;
- fc1's input cast, weight cast and GEMM: bound (2) of `fp8_bounds`;
- the activation f at pre-activation h with error E: by the mean value theorem
  |f(h + d) - f(h)| <= S(h, E) E, S = sup |f'| over [h - E, h + E] (|f'(h)| + E sup|f''| for the
  sigmoid-based ones, 1 for ReLU, 2 (relu(h) + E) for squared ReLU); a GLU f(gate) up adds the
  product rule; plus a float32 evaluation allowance (2^-19 of the magnitudes) and one rounding;
- fc2 as fc1; the output gradient's cast and the two gradient GEMMs by (2);
- the activation's gradient f'(h) da: |f'(h + d) - f'(h)| <= D(h, E) (E sup|f''|; for ReLU 1 where
  |h| <= E, else 0; 2E for squared ReLU), with a float32 allowance 2^-19 (|da| ...)(1 + |h|)^3
  (torch's float32 GELU gradient loses ~|h|^3 ulps for h << 0 to cancellation);
- bias gradients: the gradient's error summed, plus any float32 summation order (gamma_t) and the
  rounding of the sum.

Each checked quantity must also be inexact enough that FP8 visibly ran (``min_rel_err``).
"""

from __future__ import annotations

import pytest
import torch

from tests.modules import activations64 as a64
from tests.modules import fp8_bounds as fb
from zbpp.modules import DelayedScaling, LayerNormMLP, fp8_autocast
from zbpp.modules import _fused
from zbpp.modules import fp8 as fp8mod
from zbpp.modules.fp8 import cast as fp8cast
from zbpp.modules._activations import ACTIVATIONS
from zbpp.modules._norm import norm_reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F32_EVAL = 2.0**-19  # float32 evaluation of an elementwise function: a few ulps, generously


def _second_derivative_bound(base: str) -> float:
    """sup |f''| on a fine float64 grid (+1% for the grid); squared ReLU 2, ReLU 0 (its kink is
    handled apart)."""
    if base == "relu":
        return 0.0
    if base == "srelu":
        return 2.0
    h = torch.linspace(-12, 12, 240_001, dtype=torch.float64, requires_grad=True)
    (d1,) = torch.autograd.grad(a64.f(base, h).sum(), h, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), h)
    return 1.01 * d2.abs().max().item()


def _slope(base, h, e, l2):
    """sup |f'| over [h - e, h + e]."""
    if base == "relu":
        return torch.ones_like(h)
    if base == "srelu":
        return 2 * (h.clamp_min(0) + e)
    return a64.df(base, h).abs() + l2 * e


def _slope_change(base, h, e, l2):
    """sup |f'(t) - f'(h)| over |t - h| <= e."""
    if base == "relu":
        return (h.abs() <= e).double()
    return l2 * e


def _check(name, got, ref, bound, *, min_rel_err=None):
    err = (got.double().cpu() - ref).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{name}: error exceeds the derived bound by {worst:.3g}"
    if min_rel_err is not None:  # FP8 really ran (a high-precision GEMM would be far better)
        assert (err.max() / ref.abs().max()).item() > min_rel_err, f"{name}: suspiciously exact"


def _norm64(x, normalization, w, b, eps):
    if normalization == "LayerNorm":
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + eps) * w + b
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _activation_forward_bound(name, h1, e_h1, l2, u_dt):
    """(a, bound on |a_computed - a|) for the activation of h1 whose error is at most e_h1."""
    base = a64.BASE[name]
    if name not in a64.GLU:
        a = a64.f(base, h1)
        e = _slope(base, h1, e_h1, l2) * e_h1 + F32_EVAL * (a.abs() + h1.abs() + e_h1)
        return a, e + u_dt * (a.abs() + e)
    (g, u), (e_g, e_u) = h1.chunk(2, -1), e_h1.chunk(2, -1)
    fg = a64.f(base, g)
    e_fg = _slope(base, g, e_g, l2) * e_g
    a = fg * u
    e = (e_fg * (u.abs() + e_u) + fg.abs() * e_u
         + F32_EVAL * (fg.abs() + g.abs() + e_g) * (u.abs() + e_u))
    return a, e + u_dt * (a.abs() + e)


def _activation_backward_bound(name, h1, e_h1, da, e_da, l2, u_dt):
    """(dh1, bound) for the gradient of h1 given da (error e_da) at h1 (error e_h1)."""
    base = a64.BASE[name]
    if name not in a64.GLU:
        d1 = a64.df(base, h1)
        big = _slope_change(base, h1, e_h1, l2)
        dh = da * d1
        e = (e_da * (d1.abs() + big) + da.abs() * big
             + F32_EVAL * (da.abs() + e_da) * (1 + h1.abs() + e_h1) ** 3)
        return dh, e + u_dt * (dh.abs() + e)
    (g, u), (e_g, e_u) = h1.chunk(2, -1), e_h1.chunk(2, -1)
    fg, d1 = a64.f(base, g), a64.df(base, g)
    big = _slope_change(base, g, e_g, l2)
    e_fg = _slope(base, g, e_g, l2) * e_g
    f32 = F32_EVAL * (da.abs() + e_da) * (u.abs() + e_u + 1) * (1 + g.abs() + e_g) ** 3
    d_gate = da * u * d1
    e_gate = (e_da * (u.abs() + e_u) * (d1.abs() + big) + da.abs() * e_u * (d1.abs() + big)
              + da.abs() * u.abs() * big + f32)
    d_up = da * fg
    e_up = e_da * (fg.abs() + e_fg) + da.abs() * e_fg + f32
    dh, e = torch.cat([d_gate, d_up], -1), torch.cat([e_gate, e_up], -1)
    return dh, e + u_dt * (dh.abs() + e)


def mlp_fp8_case(*, activation="gelu", normalization="LayerNorm", dtype=torch.float32,
                 device="cpu", shape=(32, 32, 64), accumulation=None, fprop_accumulation=None):
    """One delayed FP8 LayerNormMLP pass against float64 (see the module docstring)."""
    t, hid, ffn = shape
    torch.manual_seed(1)
    mlp = LayerNormMLP(hid, ffn, delay_wgrad_compute=True, activation=activation,
                       normalization=normalization, params_dtype=dtype, device=device)
    with torch.no_grad():
        for p in (mlp.layer_norm_weight, mlp.layer_norm_bias, mlp.fc1_bias, mlp.fc2_bias):
            if p is not None:
                p.add_(0.3 * torch.randn_like(p))
        mlp.fc1_weight.mul_(10)  # pre-activations of order 1: the curved parts matter
    x = torch.randn(t, hid, device=device).to(dtype)
    r = torch.randn(t, hid, device=device).to(dtype)
    rec = DelayedScaling(amax_history_len=16, margin=1)
    for _ in range(3):
        with fp8_autocast(fp8_recipe=rec):
            mlp(x).backward(r)
        mlp.backward_dw()
    mlp.zero_grad(set_to_none=True)
    s = {name: meta.scale.item() for name, meta in mlp.fp8_meta.items()}
    with fp8_autocast(fp8_recipe=rec):
        y = mlp(x)
    y.backward(r)
    mlp.backward_dw()

    u_dt = fb.U_OUT[dtype]
    p = {n: q.detach().double().cpu() for n, q in mlp.named_parameters()}
    x64, r64 = x.double().cpu(), r.double().cpu()
    ln = _norm64(x64, normalization, p["layer_norm_weight"], p.get("layer_norm_bias"), mlp.eps)
    ln_dt = norm_reference(x.cpu(), normalization, mlp.layer_norm_weight.detach().cpu(),
                           None if mlp.layer_norm_bias is None else
                           mlp.layer_norm_bias.detach().cpu(), mlp.eps)[0].double()
    e_ln = 1e-5 * (ln.abs() + 1)  # the float32 evaluation: an allowance, checked here
    e_ln = e_ln + u_dt * (ln.abs() + e_ln)  # ... and the rounding to the parameters' dtype
    assert ((ln_dt - ln).abs() <= e_ln).all()
    l2 = _second_derivative_bound(a64.BASE[activation])
    w1t, w2t = p["fc1_weight"].t(), p["fc2_weight"].t()
    kw = dict(out_dtype=dtype, accumulation=accumulation)
    fprop = dict(kw, accumulation=fprop_accumulation or accumulation)

    e_a1 = fb.cast_error(ln, s["fc1_input"], E4M3, upstream=e_ln)
    e_w1 = fb.cast_error(w1t, s["fc1_weight"], E4M3)
    h1 = ln @ w1t + p["fc1_bias"]
    e_h1 = fb.gemm_error(ln, w1t, e_a1, e_w1, bias=p["fc1_bias"], **fprop)
    a, e_a = _activation_forward_bound(activation, h1, e_h1, l2, u_dt)
    e_a2 = fb.cast_error(a, s["fc2_input"], E4M3, upstream=e_a)
    e_w2 = fb.cast_error(w2t, s["fc2_weight"], E4M3)
    y64 = a @ w2t + p["fc2_bias"]
    _check("output", y, y64, fb.gemm_error(a, w2t, e_a2, e_w2, bias=p["fc2_bias"], **fprop),
           min_rel_err=1e-4)

    e_r = fb.cast_error(r64, s["fc2_grad_output"], E5M2)
    _check("fc2 weight grad", mlp.fc2_weight.grad, r64.t() @ a,
           fb.gemm_error(r64.t(), a, e_r.t(), e_a2, **kw), min_rel_err=1e-3)
    _check("fc2 bias grad", mlp.fc2_bias.grad, r64.sum(0),
           fb.gamma(t) * r64.abs().sum(0) + u_dt * (r64.sum(0).abs() + fb.gamma(t)
                                                    * r64.abs().sum(0)))
    d_a2 = r64 @ w2t.t()
    e_da2 = fb.gemm_error(r64, w2t.t(), e_r, e_w2.t(), **kw)
    dh1, e_dh1 = _activation_backward_bound(activation, h1, e_h1, d_a2, e_da2, l2, u_dt)
    e_g1 = fb.cast_error(dh1, s["fc1_grad_output"], E5M2, upstream=e_dh1)
    _check("fc1 weight grad", mlp.fc1_weight.grad, dh1.t() @ ln,
           fb.gemm_error(dh1.t(), ln, e_g1.t(), e_a1, **kw), min_rel_err=1e-3)
    e_sum = e_dh1.sum(0) + fb.gamma(t) * (dh1.abs() + e_dh1).sum(0)
    _check("fc1 bias grad", mlp.fc1_bias.grad, dh1.sum(0),
           e_sum + u_dt * (dh1.sum(0).abs() + e_sum))


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_layernorm_mlp_fp8_within_propagated_bound(activation, normalization):
    fp8mod.reset_gemm_path_counts()
    mlp_fp8_case(activation=activation, normalization=normalization)
    counts = fp8mod.gemm_path_counts()
    assert counts["scaled_mm"] == 4 * 6 and counts["dequantized"] == 0  # 4 passes x 6 GEMMs


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp_fp8_bfloat16_within_propagated_bound(activation):
    """bfloat16 parameters: every intermediate also rounded to bfloat16 (2^-8)."""
    mlp_fp8_case(activation=activation, dtype=torch.bfloat16, shape=(48, 32, 64))


# -- on the GPU machine: the fused kernels, and the same layer without them ---------------------


def _hopper_accumulation(k):
    # FP8 tensor cores keep about 14 bits inside a 128-deep block (DeepSeek-V3 report, 3.3.2),
    # and with use_fast_accum=False cuBLAS adds the blocks in float32
    return fb.gamma(128, 2.0**-14) + fb.gamma(k)


def _hopper_fast_accumulation(k):
    # use_fast_accum=True (the forward GEMM's default): about 14 bits, truncating, over all k
    return fb.gamma(k, 2.0**-13)


def _needs_triton_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from zbpp.modules import _fp8_cast_triton

    problem = _fp8_cast_triton.unsupported(torch.device("cuda"))
    if problem is not None:
        pytest.skip(f"the Triton FP8 kernels cannot run: {problem}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16-fused", "bf16-unfused", "fp32"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu", "srelu", "qgeglu"])
def test_gpu_layernorm_mlp_fp8_within_bound(monkeypatch, activation, normalization, mode):
    """On the GPU, shapes off the fused kernels' tiles (272 tokens: four 64-row tiles and 16
    rows; hidden 208 and ffn 336: ragged 64-column tiles): bfloat16 with the fused kernels and,
    as the reference path, without them (ZBPP_FP8_FUSE=0), both within the same float64 bound (so
    the fused path equals the unfused one within it), and float32 (never fused); the counts say
    which path ran."""
    _needs_triton_gpu()
    fused = mode == "bf16-fused"
    monkeypatch.setenv(_fused.FUSE_ENV, "1" if fused else "0")
    monkeypatch.setattr(fp8cast, "_failed", {})
    _fused.reset_fused_path_counts()
    fp8mod.reset_gemm_path_counts()
    t, hid, ffn = 272, 208, 336
    mlp_fp8_case(activation=activation, normalization=normalization,
                 dtype=torch.float32 if mode == "fp32" else torch.bfloat16,
                 device="cuda", shape=(t, hid, ffn),
                 accumulation=_hopper_accumulation(max(hid, ffn, t)),
                 fprop_accumulation=_hopper_fast_accumulation(max(hid, ffn)))
    counts = _fused.fused_path_counts()
    ran = "triton" if fused else "eager"
    assert counts[f"norm_{ran}"] == counts[f"act_{ran}"] == counts[f"dact_{ran}"] == 4
    assert sum(counts.values()) == 12 and not fp8cast._failed
    assert fp8mod.gemm_path_counts()["dequantized"] == 0
