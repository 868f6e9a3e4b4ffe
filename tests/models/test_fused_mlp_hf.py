"""Gated MLPs of Hugging Face models fused in FP8 (`fuse_gated_mlps`, which `fast_stage(fp8=...)`
applies): which families' MLPs are of the form, and a pipeline step with them against the model in
float64 without FP8.

The fused layer's arithmetic is checked bit for bit in tests/modules/test_gated_mlp.py; here the
whole step (zb-h1, 2 microbatches, each MLP's three weight gradients computed in W from the jobs
B filed), after two steps that calibrate the delayed scales (no optimizer step between: the same
weights), must come within FP8's error of the float64 step: the loss within 2%, every gradient of
an MLP weight within 20% (relative norm: e5m2 gradients carry 2 mantissa bits, up to 12.5% off
each, e4m3 inputs 6.25%; on these tiny models Llama's MLP gradients come 8.5-11% off, fused or
unfused alike), and differ from it (FP8 ran).
"""

from __future__ import annotations

import pytest
import torch

from zbpp import Pipeline
from zbpp.models.fast import fast_stage
from zbpp.schedules import build

from .families import FAMILIES, one_rank_stages, padded_batch

pytest.importorskip("transformers")

#: families whose gated MLPs (dense layers' and shared experts'; gate and up packed in Phi-3's and
#: GLM's) are fused; the others' MLPs are not of the form: no gate (GPT-2, Arcee), a norm inside
#: (BitNet), biases (dense ERNIE 4.5's), other names (LFM2's w1, w2, w3); MoE experts never are
FUSED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2", "cohere", "granite",
         "smollm3", "helium", "qwen2_moe", "deepseek_v3", "stablelm", "olmo3", "ministral", "ministral3", "diffllama",
         "exaone4", "granite_swa", "hunyuan_v1_dense", "seed_oss", "cohere2", "vaultgemma", "cwm", "hyperclovax",
         "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "dots1", "exaone_moe", "glm4_moe", "hunyuan_v1_moe",
         "solar_open", "ernie4_5_moe", "afmoe", "deepseek_v2", "glm4_moe_lite", "minicpm3", "youtu", "doge",
         "llama4_text", "phi3", "glm", "glm4"}


def _stage(name: str, fp8: bool):
    sched = build("zb-h1", num_ranks=1, num_microbatches=2)
    stages, kwargs = one_rank_stages(name, sched)
    if fp8:
        fast_stage(stages[0], compile=False, fp8=True)
    return Pipeline(stages, sched, **kwargs), stages[0]


@pytest.mark.parametrize("name", FAMILIES)
def test_which_families_mlps_are_fused(name):
    _, stage = _stage(name, True)
    fused = [n for n, m in stage.named_modules() if type(m).__name__.endswith("FusedFp8")]
    assert bool(fused) == (name in FUSED), fused


@pytest.mark.parametrize("name", ["llama", "gemma", "qwen2_moe", "deepseek_v3", "phi3"])
def test_a_step_with_fused_mlps_is_within_fp8_error_of_float64(name):
    ids, mask, labels = padded_batch(4)
    batch = {"input_ids": ids, "attention_mask": mask}
    (pipe, stage), (ref_pipe, ref) = _stage(name, True), _stage(name, False)
    for _ in range(2):  # calibration: the first casts use the initial scale 1, far too small for gradients
        pipe.step(batch, target=labels)
        stage.zero_grad(set_to_none=True)
    loss, want = pipe.step(batch, target=labels), ref_pipe.step(batch, target=labels)
    assert abs(loss.item() - want.item()) <= 0.02 * abs(want.item())
    grads = dict(ref.named_parameters())
    mlp_weights = [n for n, m in stage.named_modules() if type(m).__name__.endswith("FusedFp8")]
    assert mlp_weights
    for n, p in stage.named_parameters():
        if any(n.startswith(f + ".") for f in mlp_weights):
            g, w = p.grad, grads[n].grad
            err = ((g - w).norm() / w.norm()).item()
            assert 0 < err < 0.2, (n, err)


def test_a_residual_dropout_in_the_mlp_is_never_fused_away():
    # SeedOss's MLP ends in a dropout (residual_dropout, 0.1 by default); from_pretrained hands the
    # model over in eval mode, where the dropout does nothing: fused there, its training steps
    # would silently run without it
    transformers = pytest.importorskip("transformers")
    from zbpp.modules import fuse_gated_mlps

    cfg = transformers.AutoConfig.for_model("seed_oss", vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=8, residual_dropout=0.1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert fuse_gated_mlps(model) == []
    assert not model.training
    model.config.residual_dropout = 0.0  # the same model without the dropout is of the form
    for layer in model.model.layers:
        layer.mlp.residual_dropout = 0.0
    assert fuse_gated_mlps(model) == ["model.layers.0.mlp", "model.layers.1.mlp"]
