"""Every decoder-only causal-LM family of `zbpp.models.hf` (tests/models/families.py: Llama, Mistral,
Qwen2/3, GPT-2, Gemma 1/2/3, Phi, Phi-3, OLMo 1/2, GPT-NeoX, OPT, Falcon with alibi and with
rotary, Bloom, Starcoder2, GPTBigCode, Cohere, Granite, GLM, SmolLM3, Helium, Mixtral, Qwen2-MoE,
OLMoE, DeepSeek-V3), one training step on 2 gloo ranks under zb-h1 and zb-v with a right-padded
batch and ignored labels: the loss and every parameter's gradient equal HF's model in one process
(families.py states the tolerances: float64, 1e-10 of the largest gradient; 1e-7 for the families
that compute norms or routers in float32). The MoE families run with the
auxiliary loss on, against a reference that applies it per microbatch. Under both schedules W
carries the weight gradients: B costs exactly the FLOPs of the stage's input gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from .families import FAMILIES, FLOAT32_FAMILIES, FLOAT32_RTOL, GRAD_RTOL, LOSS_RTOL, every_family_step  # noqa: E402

MOE_WITH_AUX = {"mixtral", "qwen2_moe", "olmoe"}
FLOPS_OF = ["llama", "mixtral"]


@pytest.mark.parametrize("name", ["zb-h1", "zb-v"])
def test_every_family_equals_hf_on_two_ranks(zbpp_workers, name):
    results = zbpp_workers(2).run(every_family_step, name, FAMILIES, FLOPS_OF)
    for family in FAMILIES:
        per_rank = [r[family] for r in results]
        # every parameter of the model is held by some stage, and the loss comes from one rank
        assert set().union(*(set(r["names"]) for r in per_rank)) == set(per_rank[0]["whole"]), family
        assert sum(r["loss"] is not None for r in per_rank) == 1, family
        assert all(r["loss_err"] <= LOSS_RTOL for r in per_rank if r["loss"] is not None), (family, per_rank)
        rtol = FLOAT32_RTOL if family in FLOAT32_FAMILIES else GRAD_RTOL
        for r in per_rank:
            assert r["worst"] <= rtol, f"{family} {name}: {r['where']} off by {r['worst']:.3g} of the largest gradient"
        assert per_rank[0]["aux"] == (family in MOE_WITH_AUX), family
        if family in MOE_WITH_AUX:  # the auxiliary term is a visible part of the loss checked
            assert per_rank[0]["aux_share"] > 1e-3, (family, per_rank[0]["aux_share"])
    for family in FLOPS_OF:
        for r in results:
            for s, f in r[family]["flops"].items():
                full, dgrad = r[family]["full"][s]
                assert f["BW"] == 0  # zb-h1 and zb-v split every backward into B and W
                # 4 microbatches: B computes the stage input's gradient and nothing more, W the rest
                assert f["B"] == 4 * dgrad and f["W"] == 4 * (full - dgrad), (family, name, s, f, full, dgrad)
                assert f["W"] > 0
    # the W share of the backward FLOPs of a stage of decoder layers (hidden 16, 8 tokens): every
    # weight GEMM's gradient (an input-gradient GEMM's twin), but attention's score and value
    # products have only input gradients: 45% for Llama, 47% for Mixtral (its router and experts)
    if name == "zb-v":  # stages 1 and 2 hold one decoder layer each
        middle = next(r["llama"]["flops"][1] for r in results if 1 in r["llama"]["flops"])
        assert 0.40 < middle["W"] / (middle["B"] + middle["W"]) < 0.5, middle


# -- placement by use (one process) ------------------------------------------------------------------
def _meta(family: str):
    import transformers

    from .families import family_config

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float64)


def test_opt_final_norm_registered_first_is_placed_last():
    from zbpp.models import fqns_per_stage

    model = _meta("opt")
    # OPT registers decoder.final_layer_norm before decoder.layers, and applies it after them
    names = [n for n, _ in model.model.decoder.named_children()]
    assert names.index("final_layer_norm") < names.index("layers")
    fqns = fqns_per_stage(model, 2, blocks="model.decoder.layers")
    assert "model.decoder.final_layer_norm" in fqns[1] and "model.decoder.final_layer_norm" not in fqns[0]
    assert {"model.decoder.embed_tokens", "model.decoder.embed_positions"} <= set(fqns[0])
    assert "lm_head" in fqns[1]


def test_fqns_per_stage_answer_is_accepted_back():
    from zbpp.models import fqns_per_stage, pipeline_stages
    from zbpp.schedules import build

    model = _meta("gpt_bigcode")  # transformer.bias: a buffer of the module that holds the blocks
    fqns = fqns_per_stage(model, 2, blocks="transformer.h")
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    tril = torch.tril(torch.ones(32, 32, dtype=torch.bool))
    for rank in range(2):
        stages, _ = pipeline_stages(model, sched, rank, module_fqns_per_stage=fqns)
        assert torch.equal(stages[rank].transformer.bias, tril)  # kept by every stage, by HF's init


class _SharedNorm(nn.Module):
    """A module with parameters used both before and after the blocks: no one stage can hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(4)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        x = self.norm(x)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def test_a_module_used_on_both_sides_or_never_raises():
    from zbpp.models import fqns_per_stage

    with torch.device("meta"):
        model = _SharedNorm()
    with pytest.raises(ValueError, match=r"cannot place \{'norm': \['after', 'before'\], 'unused': \[\]\}"):
        fqns_per_stage(model, 2, blocks="layers", example=torch.zeros(1, 4, device="meta"))
    # without an example (and not a Hugging Face model) registration order places them
    assert fqns_per_stage(model, 2, blocks="layers")[0] == ["norm", "layers.0"]


def test_a_middle_stage_without_a_decoder_layer_is_refused():
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    from .families import family_config

    sched = build("zb-v", num_ranks=2, num_microbatches=2)  # 4 stages
    fqns = [["model.embed_tokens", "model.layers.0", "model.layers.1"], [], ["model.layers.2", "model.layers.3"],
            ["model.norm", "lm_head"]]
    with pytest.raises(ValueError, match="a middle stage holds no decoder layer of model.layers"):
        causal_lm_stages(family_config("qwen3"), sched, 1, module_fqns_per_stage=fqns)


@pytest.mark.parametrize("family", ["gpt2", "falcon", "gemma2"])
def test_embeddings_alone_and_head_alone_as_stages(family):
    # the stages run one after the other in one process give HF's logits (float64, the same
    # operations: 1e-12), with the first stage only embedding and the last only norm and head
    import transformers

    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    from .families import LAYERS, family_config, padded_batch

    cfg = family_config(family)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64)
    blocks = {"gpt2": "transformer.h", "falcon": "transformer.h", "gemma2": "model.layers"}[family]
    layers = [f"{blocks}.{i}" for i in range(LAYERS)]
    embed = {"gpt2": ["transformer.wte", "transformer.wpe"], "falcon": ["transformer.word_embeddings"],
             "gemma2": ["model.embed_tokens"]}[family]
    head = {"gpt2": ["transformer.ln_f", "lm_head"], "falcon": ["transformer.ln_f", "lm_head"],
            "gemma2": ["model.norm", "lm_head"]}[family]
    fqns = [embed, layers[:2], layers[2:], head]
    sched = build("zb-v", num_ranks=2, num_microbatches=2)
    stages = {}
    for r in range(2):
        stages.update(causal_lm_stages(cfg, sched, r, dtype=torch.float64, attn_implementation="eager",
                                       state_dict=ref.state_dict(), module_fqns_per_stage=fqns, device="cpu")[0])
    ids, mask, _ = padded_batch(3)
    x = {"input_ids": ids, "attention_mask": mask}
    for s in range(4):
        x = stages[s](**x)
    torch.testing.assert_close(x, ref(input_ids=ids, attention_mask=mask).logits, rtol=1e-12, atol=1e-12)
