"""The fused Triton FP8 kernels against their torch definitions: in Triton's interpreter (CPU,
every run) and compiled on an sm_90 GPU (``-m gpu``).

References: ``fp8.cast._cast_eager`` / ``fp8.quantize`` (the cast, checked in test_fp8.py against
hand-worked cases), ``_norm.norm_reference`` and ``_activations`` (the torch definitions the
kernels follow), and for the sigmoid-based activations float64 values (`activations64`). The
kernels compute each value with the definition's float32 operations, so:

- bit-exact (``torch.equal`` on the bytes, the statistics and the slot's history and scale):
  the plain cast, the ReLU-family activations and their gradients (only exact or correctly
  rounded operations), and the norms on rows whose sums are exact in float32 (any order gives
  the same sum);
- otherwise within one FP8 code: the norms' row sums run in another order, and the kernels'
  sigmoids use exp (the interpreter's numpy exp) where torch's float32 ops use tanh; the kernels'
  float32 values are within a few ulps of the exact ones, so after one bfloat16 rounding and the
  FP8 cast their codes are at most one from those of the float64 value rounded the same way
  (torch's own float32 GELU gradient is not: for x << 0 it loses all relative accuracy to
  cancellation in 1 + tanh, so it is not the reference there). Amaxes are then equal up to one
  bfloat16 rounding (relative 2^-8), column sums within the float32 summation bound.

Shapes are off the kernels' 64 x 64 tiles on purpose (ragged row and column tiles, one row, one
column, a GLU whose halves split a tile), and strided inputs are included: a wrong offset, mask or
half shows up as many codes off. Each test takes a few seconds at most in the interpreter. On the
GPU the same comparisons hold: the conversions are then PTX instructions (test_fp8_cast.py checks
them against torch), the products and quotients IEEE operations kept out of FMAs, the row sums in
the GPU's order and exp its approximate ex2, which the one-code allowance covers.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.modules import activations64 as a64
from tests.modules import fp8_bounds as fb
from tests.modules.fp8_compare import (
    E4M3,
    E5M2,
    assert_codes,
    assert_slot,
    quantize_ref,
    slot_args,
    slots,
)
from zbpp.modules._activations import ACTIVATIONS
from zbpp.modules._norm import norm_reference

EXACT = {"relu", "reglu", "srelu", "sreglu"}  # no transcendental operation


@pytest.fixture(params=[
    pytest.param("interpreter", marks=pytest.mark.interpreter),
    pytest.param("cuda", marks=pytest.mark.gpu),
])
def kernels(request):
    """``.fused`` (the kernel module) and ``.device`` (where its inputs live)."""
    if request.param == "interpreter":
        return SimpleNamespace(fused=request.getfixturevalue("interpreted_fused_kernels").fused,
                               device="cpu")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from zbpp.modules import _fp8_cast_triton, _fused_triton

    problem = _fp8_cast_triton.unsupported(torch.device("cuda"))
    if problem is not None:
        pytest.skip(f"the Triton FP8 kernels cannot run: {problem}")
    return SimpleNamespace(fused=_fused_triton, device="cuda")


def _on(kernels, *tensors):
    return [None if t is None else t.to(kernels.device) for t in tensors]


def _fast_slot(kernels, f8, scale):
    """The slot the kernel updates (on its device) and the eager reference's (on the CPU)."""
    fast, slow = slots(f8, scale)
    fast.amax_history = fast.amax_history.to(kernels.device)
    fast.scale = fast.scale.to(kernels.device)
    return fast, slow

# -- the norms ------------------------------------------------------------------------------------


def _norm_input(rows, cols, *, exact_sums, seed, stride=1):
    """bfloat16 rows; with `exact_sums`, multiples of 1/4 in +-pairs (each row's mean is 0 and
    every float32 partial sum of x and x^2 exact, whatever the order)."""
    g = torch.Generator().manual_seed(seed)
    if exact_sums:
        half = torch.randint(-12, 13, (rows, cols // 2), generator=g).float() / 4
        x = torch.cat([half, -half], 1)[:, torch.randperm(cols, generator=g)]
    else:
        x = torch.randn(rows, cols, generator=g) * 3 + 1
    x = x.bfloat16()
    if stride != 1:  # the same values in every other column of a wider tensor
        wide = torch.zeros(rows, cols * stride, dtype=torch.bfloat16)
        wide[:, ::stride] = x
        x = wide[:, ::stride]
    return x


NORM_CASES = {  # (rows, cols, exact sums, column stride)
    "exact-ragged": (130, 200, True, 1),
    "exact-one-row": (1, 64, True, 1),
    "random-ragged": (70, 130, False, 1),
    "random-strided": (33, 96, False, 2),
    "exact-long-rows": (3, 2500, True, 1),  # longer than one step of the statistics kernel
}


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("case", list(NORM_CASES))
def test_norm_cast_equals_norm_then_quantize(kernels, normalization, case):
    rows, cols, exact, stride = NORM_CASES[case]
    x = _norm_input(rows, cols, exact_sums=exact, seed=rows + cols, stride=stride)
    g = torch.Generator().manual_seed(5)
    weight = (1 + torch.randn(cols, generator=g) / 4).bfloat16()
    bias = (torch.randn(cols, generator=g) / 4).bfloat16() if normalization == "LayerNorm" else None
    fast, slow = _fast_slot(kernels, E4M3, 40.0)
    xd, wd, bd = _on(kernels, x, weight, bias)
    out = kernels.fused.norm_cast_update(
        xd, wd, bd, 1e-5, normalization == "RMSNorm", fast.scale, fast.amax_history,
        fast.fused_workspace(), fast.fp8_max, E4M3, True, **slot_args(fast))
    data, data_t, scale_inv, mean, rstd = (None if t is None else t.cpu() for t in out)
    y, mean_ref, rstd_ref = norm_reference(x, normalization, weight, bias, 1e-5)
    q, _ = quantize_ref(y, slow, transpose=True)
    assert_codes(data, q.data, exact=exact, what="data")
    assert_codes(data_t, q.data_t, exact=exact, what="data_t")
    assert torch.equal(scale_inv, q.scale_inv)
    assert_slot(fast, slow, exact=exact, what="slot")
    assert rstd.shape == (rows, 1) and rstd.dtype == torch.float32
    if normalization == "RMSNorm":
        assert mean is None and mean_ref is None
    if exact:
        assert torch.equal(rstd, rstd_ref) and (mean is None or torch.equal(mean, mean_ref))
    else:  # the sums in another order: a few float32 ulps
        torch.testing.assert_close(rstd, rstd_ref, rtol=2.0**-20, atol=0)
        if mean is not None:
            torch.testing.assert_close(mean, mean_ref, rtol=2.0**-20, atol=2.0**-20)


def test_norm_cast_without_transpose_and_in_e5m2(kernels):
    x = _norm_input(40, 72, exact_sums=True, seed=9)
    weight = torch.ones(72, dtype=torch.bfloat16)
    fast, slow = _fast_slot(kernels, E5M2, 500.0)
    data, data_t, _, _, _ = kernels.fused.norm_cast_update(
        *_on(kernels, x, weight), None, 1e-6, True, fast.scale, fast.amax_history,
        fast.fused_workspace(), fast.fp8_max, E5M2, False, **slot_args(fast))
    q, _ = quantize_ref(norm_reference(x, "RMSNorm", weight, None, 1e-6)[0], slow,
                         transpose=False)
    assert data_t is None
    assert_codes(data, q.data, exact=True, what="data")
    assert_slot(fast, slow, exact=True, what="slot")


# -- the activations and their gradients --------------------------------------------------------


ACT_SHAPES = [(130, 70), (1, 1), (64, 200)]


def _act_input(rows, width, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, width, generator=g) * 2.5
    h[0, 0] = 0.0  # ReLU's kink; a tie for bfloat16 rounding of squared ReLU below
    if width > 2:
        h[0, 1], h[0, 2] = -0.0, 1.0625  # 1.0625^2 = 1 + 2^-3 + 2^-8: halfway between bf16s
    return h.bfloat16()


@pytest.mark.parametrize("shape", ACT_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_act_cast_equals_activation_then_quantize(kernels, name, shape):
    act = ACTIVATIONS[name]
    rows, ffn = shape
    h = _act_input(rows, ffn * act.width, seed=rows * 31 + ffn)
    exact = name in EXACT
    for transpose in (True, False):
        fast, slow = _fast_slot(kernels, E4M3, 20.0)
        out = kernels.fused.act_cast_update(
            *_on(kernels, h), act.kernel_id, act.glu, fast.scale, fast.amax_history,
            fast.fused_workspace(), fast.fp8_max, E4M3, transpose, **slot_args(fast))
        data, data_t, scale_inv = (None if t is None else t.cpu() for t in out)
        want = act.forward(h) if exact else a64.forward(name, h).to(h.dtype)
        q, _ = quantize_ref(want, slow, transpose=transpose)
        assert data.shape == (rows, ffn)
        assert_codes(data, q.data, exact=exact, what=f"{name} data")
        if transpose:
            assert_codes(data_t, q.data_t, exact=exact, what=f"{name} data_t")
        else:
            assert data_t is None
        assert torch.equal(scale_inv, q.scale_inv)
        assert_slot(fast, slow, exact=exact, what=name)


@pytest.mark.parametrize("shape", ACT_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_dact_cast_equals_gradient_then_quantize(kernels, name, shape):
    act = ACTIVATIONS[name]
    rows, ffn = shape
    h = _act_input(rows, ffn * act.width, seed=rows * 17 + ffn)
    g = torch.Generator().manual_seed(rows + 3 * ffn)
    grad_wide = torch.randn(rows, ffn + 5, generator=g).bfloat16()
    grad = grad_wide[:, :ffn]  # a row stride other than the width
    exact = name in EXACT
    fast, slow = _fast_slot(kernels, E5M2, 2000.0)
    grad_d = grad_wide.to(kernels.device)[:, :ffn]
    out = kernels.fused.dact_cast_update(
        grad_d, *_on(kernels, h), act.kernel_id, act.glu, fast.scale, fast.amax_history,
        fast.fused_workspace(), fast.fp8_max, E5M2, True, True, **slot_args(fast))
    data, data_t, scale_inv, sums = (None if t is None else t.cpu() for t in out)
    dh = act.backward(grad, h) if exact else a64.backward(name, grad, h).to(h.dtype)
    q, total = quantize_ref(dh, slow, transpose=True, column_sum=True)
    assert data.shape == h.shape and data_t.shape == (h.shape[1], rows)
    assert_codes(data, q.data, exact=exact, what=f"{name} data")
    assert_codes(data_t, q.data_t, exact=exact, what=f"{name} data_t")
    assert torch.equal(scale_inv, q.scale_inv)
    assert_slot(fast, slow, exact=exact, what=name)
    # column sums, of the kernel's own bfloat16 values: any float32 summation order, plus (where
    # not exact) one bfloat16 ulp (2^-7 relative) per value that crossed a rounding boundary
    magnitude = dh.double().abs().sum(0)
    bound = (fb.gamma(rows) + (0.0 if exact else 2.0**-7)) * magnitude
    assert sums.shape == (-(-rows // kernels.fused.tile()[0]), h.shape[1])
    assert ((sums.sum(0).double() - dh.double().sum(0)).abs() <= bound).all()


def test_dact_cast_without_column_sums(kernels):
    act = ACTIVATIONS["sreglu"]
    h = _act_input(20, 2 * 40, seed=1)
    grad = torch.randn(20, 40).bfloat16()
    fast, slow = _fast_slot(kernels, E5M2, 1.0)
    data, data_t, _, sums = kernels.fused.dact_cast_update(
        *_on(kernels, grad, h), act.kernel_id, act.glu, fast.scale, fast.amax_history,
        fast.fused_workspace(), fast.fp8_max, E5M2, False, False, **slot_args(fast))
    q, _ = quantize_ref(act.backward(grad, h), slow, transpose=False)
    assert sums is None and data_t is None
    assert_codes(data, q.data, exact=True, what="data")


@pytest.mark.interpreter
def test_another_tile_shape_gives_the_same_bytes(interpreted_fused_kernels, monkeypatch):
    """ZBPP_FUSED_TILE (rows x columns x warps) changes only the tiling: still bit-exact."""
    fused = interpreted_fused_kernels.fused
    monkeypatch.setenv(fused.TILE_ENV, "32x128x4")
    assert fused.tile() == (32, 128, 4)
    act = ACTIVATIONS["sreglu"]
    h = _act_input(70, 2 * 150, seed=3)
    grad = torch.randn(70, 150).bfloat16()
    fast, slow = slots(E5M2, 100.0)
    data, data_t, _, sums = fused.dact_cast_update(
        grad, h, act.kernel_id, act.glu, fast.scale, fast.amax_history, fast.fused_workspace(),
        fast.fp8_max, E5M2, True, True, **slot_args(fast))
    q, _ = quantize_ref(act.backward(grad, h), slow, transpose=True, column_sum=True)
    assert_codes(data, q.data, exact=True, what="data")
    assert_codes(data_t, q.data_t, exact=True, what="data_t")
    assert sums.shape == (3, 300)  # 70 rows in 32-row tiles
    for bad in ("64x64", "64x48x4", "big"):
        monkeypatch.setenv(fused.TILE_ENV, bad)
        with pytest.raises(ValueError, match=f"ZBPP_FUSED_TILE={bad!r}; use rows x columns"):
            fused.tile()
