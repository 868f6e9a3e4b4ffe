"""Whole FP8 layers through the fused kernels against the same layers through the unfused path,
and the dispatch between the two.

The fused path runs where the GPU path runs: in Triton's interpreter on the CPU (every run: the
module-level dispatch is pointed at the interpreted kernel modules, so every cast, update and
fusion of a forward and backward runs as Triton code) and compiled on an sm_90 GPU (``-m gpu``).
The reference is the same layer, same state, with ``ZBPP_FP8_FUSE=0`` (norm, activation and
gradient by torch, then the FP8 cast).

Tolerance: the kernel tests (test_fused_kernels.py) show both paths give the same FP8 operands
except one-code flips on at most 2% of the values, each changing one operand by at most one code
step (2^-3 relative in e4m3, 2^-2 in e5m2), so any output or gradient may differ by about
2^-2 sqrt(0.02) = 3.5% in relative Frobenius norm; we allow 5%. In practice the two agree bit for
bit or nearly (the bfloat16 rounding absorbs the kernels' few float32 ulps). A wrong fusion (the
GLU halves swapped, a tile offset off, a missing bias, the wrong scale) is off by O(1).
"""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch

import zbpp.modules as modules
from zbpp.modules import DelayedScaling, LayerNormLinear, LayerNormMLP, Linear, fp8_autocast
from zbpp.modules import _fused
from zbpp.modules import fp8 as fp8mod
from zbpp.modules.fp8 import cast as fp8cast

RECIPE = DelayedScaling(amax_history_len=4, margin=1)


@pytest.fixture(params=[
    pytest.param("interpreter", marks=pytest.mark.interpreter),
    pytest.param("cuda", marks=pytest.mark.gpu),
])
def triton_path(request, monkeypatch):
    """The device whose FP8 casts now run through the Triton kernels (interpreted on the CPU)."""
    monkeypatch.setattr(fp8cast, "_failed", {})
    monkeypatch.delenv(fp8mod.CAST_ENV, raising=False)
    monkeypatch.delenv(_fused.FUSE_ENV, raising=False)
    if request.param == "interpreter":
        kernels = request.getfixturevalue("interpreted_fused_kernels")
        monkeypatch.setattr(fp8cast, "on_cuda", lambda x: True)
        monkeypatch.setattr(fp8cast, "_triton_kernels", lambda device: kernels.cast)
        monkeypatch.setitem(sys.modules, "zbpp.modules._fused_triton", kernels.fused)
        monkeypatch.setattr(modules, "_fused_triton", kernels.fused, raising=False)
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from zbpp.modules import _fp8_cast_triton

    problem = _fp8_cast_triton.unsupported(torch.device("cuda"))
    if problem is not None:
        pytest.skip(f"the Triton FP8 kernels cannot run: {problem}")
    return "cuda"


LAYERS = {
    "gelu-LayerNorm": lambda **kw: LayerNormMLP(80, 96, **kw),
    "swiglu-RMSNorm": lambda **kw: LayerNormMLP(80, 96, activation="swiglu",
                                                normalization="RMSNorm", **kw),
    "srelu-nobias": lambda **kw: LayerNormMLP(80, 96, activation="srelu", bias=False, **kw),
    "qgeglu-LayerNorm": lambda **kw: LayerNormMLP(80, 48, activation="qgeglu", **kw),
    "LayerNormLinear": lambda **kw: LayerNormLinear(80, 112, **kw),
    "Linear": lambda **kw: Linear(80, 112, **kw),
}
TOKENS = 150  # two 64-row tiles and 22 rows; widths 80, 96, 112: ragged 64-column tiles


def _layer(name, device, *, delay=True):
    torch.manual_seed(0)
    layer = LAYERS[name](delay_wgrad_compute=delay, params_dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
        first = layer.fc1_weight if hasattr(layer, "fc1_weight") else layer.weight
        first.mul_(10)  # pre-activations of order 1
    return layer


def _steps(layer, x, dy, steps=3):
    """`steps` F + B (+ W) passes; the last pass's output and every gradient."""
    for _ in range(steps):
        layer.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        with fp8_autocast(fp8_recipe=RECIPE):
            y = layer(xg)
        y.backward(dy)
        layer.backward_dw()
    return {"output": y.detach(), "input grad": xg.grad,
            **{n: p.grad for n, p in layer.named_parameters()}}


def _data(layer, device):
    gen = torch.Generator().manual_seed(1)
    n_in = layer.weight.shape[1] if isinstance(layer, Linear) else 80
    n_out = 80 if isinstance(layer, LayerNormMLP) else 112
    x = torch.randn(TOKENS, n_in, generator=gen).bfloat16().to(device)
    dy = torch.randn(TOKENS, n_out, generator=gen).bfloat16().to(device)
    return x, dy


@pytest.mark.parametrize("name", list(LAYERS))
def test_fused_layer_equals_unfused_layer(triton_path, monkeypatch, name):
    layer = _layer(name, triton_path)
    x, dy = _data(layer, triton_path)
    _fused.reset_fused_path_counts()
    fused = _steps(copy.deepcopy(layer), x, dy)
    counts = _fused.fused_path_counts()
    has_norm, has_act = name != "Linear", isinstance(layer, LayerNormMLP)
    assert counts == {"norm_triton": 3 * has_norm, "norm_eager": 0, "act_triton": 3 * has_act,
                      "act_eager": 0, "dact_triton": 3 * has_act, "dact_eager": 0}
    monkeypatch.setenv(_fused.FUSE_ENV, "0")
    unfused = _steps(copy.deepcopy(layer), x, dy)
    assert _fused.fused_path_counts()["norm_eager"] == 3 * has_norm
    assert fused.keys() == unfused.keys()
    for what, want in unfused.items():
        got = fused[what]
        rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert rel <= 0.05, f"{name} {what}: relative difference {rel:.3g}"
    assert not fp8cast._failed


@pytest.mark.parametrize("name", ["swiglu-RMSNorm", "LayerNormLinear"])
def test_fused_path_delayed_equals_eager_bit_exact(triton_path, name):
    """Delayed and eager run the same fused kernels and GEMMs on the same tensors."""
    delayed, eager = _layer(name, triton_path), _layer(name, triton_path, delay=False)
    x, dy = _data(delayed, triton_path)
    got, want = _steps(delayed, x, dy, steps=2), _steps(eager, x, dy, steps=2)
    for what in want:
        assert torch.equal(got[what], want[what]), what


# -- the dispatch, everywhere --------------------------------------------------------------


def test_cpu_runs_the_definitions_and_counts_them(monkeypatch):
    monkeypatch.delenv(_fused.FUSE_ENV, raising=False)
    _fused.reset_fused_path_counts()
    layer = _layer("gelu-LayerNorm", "cpu")
    _steps(layer, *_data(layer, "cpu"), steps=1)
    assert _fused.fused_path_counts() == {"norm_triton": 0, "norm_eager": 1, "act_triton": 0,
                                          "act_eager": 1, "dact_triton": 0, "dact_eager": 1}


class _BrokenKernels:
    """Triton there, but every kernel fails to compile."""

    INPUT_DTYPES = (torch.bfloat16,)
    FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
    MAX_HISTORY = MAX_FUSED_HISTORY = 4096

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError(f"no {name}")

        return fail


def test_a_failing_fused_kernel_warns_once_and_the_definitions_take_over(monkeypatch):
    """As if on a GPU whose plain casts take the eager path and whose fused kernels all fail:
    one warning, then the definitions, with the eager path's results bit for bit."""
    monkeypatch.setattr(fp8cast, "_failed", {})
    monkeypatch.delenv(fp8mod.CAST_ENV, raising=False)
    monkeypatch.delenv(_fused.FUSE_ENV, raising=False)
    monkeypatch.setattr(fp8cast, "on_cuda", lambda x: True)
    monkeypatch.setattr(fp8cast, "_triton_kernels", lambda device: _BrokenKernels())
    monkeypatch.setattr(fp8cast, "_quantize_fused", lambda *args, **kwargs: None)
    monkeypatch.setattr(fp8cast, "_update_with_triton", lambda *args, **kwargs: False)
    monkeypatch.setattr(fp8cast, "_FAST_CASTS", {"triton": lambda *a: None,
                                                "compile": lambda *a: None})
    monkeypatch.setitem(sys.modules, "zbpp.modules._fused_triton", _BrokenKernels())
    monkeypatch.setattr(modules, "_fused_triton", _BrokenKernels(), raising=False)
    layer = _layer("gelu-LayerNorm", "cpu")
    x, dy = _data(layer, "cpu")
    _fused.reset_fused_path_counts()
    with pytest.warns(UserWarning) as caught:
        got = _steps(copy.deepcopy(layer), x, dy, steps=2)
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "the fused cast failed (RuntimeError: no norm_cast_update)" in said[0]
    assert "fused" in fp8cast._failed and _fused.fused_path_counts()["norm_eager"] == 2
    monkeypatch.setattr(fp8cast, "on_cuda", lambda x: False)
    want = _steps(copy.deepcopy(layer), x, dy, steps=2)
    for what in want:
        assert torch.equal(got[what], want[what]), what


def test_fusion_needs_bfloat16_and_can_be_switched_off(monkeypatch):
    """float32 layers, ZBPP_FP8_FUSE=0 and the compile/eager cast paths take the definitions."""
    monkeypatch.setattr(fp8cast, "_failed", {})
    monkeypatch.setattr(fp8cast, "on_cuda", lambda x: True)
    monkeypatch.setattr(fp8cast, "_triton_kernels", lambda device: object())
    meta = fp8mod.ScalingMeta(torch.float8_e4m3fn, history_len=4)
    bf16, fp32 = torch.ones(4, 4, dtype=torch.bfloat16), torch.ones(4, 4)
    monkeypatch.delenv(_fused.FUSE_ENV, raising=False)
    monkeypatch.delenv(fp8mod.CAST_ENV, raising=False)
    assert _fused._kernels(bf16, meta) is not None
    assert _fused._kernels(fp32, meta) is None
    assert _fused._kernels(bf16[:, ::2], meta) is None  # columns not contiguous
    monkeypatch.setenv(_fused.FUSE_ENV, "0")
    assert _fused._kernels(bf16, meta) is None
    monkeypatch.delenv(_fused.FUSE_ENV)
    for path in ("compile", "eager"):
        monkeypatch.setenv(fp8mod.CAST_ENV, path)
        assert _fused._kernels(bf16, meta) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setattr(fp8cast, "on_cuda", lambda x: False)
        assert _fused._kernels(bf16, meta) is None
