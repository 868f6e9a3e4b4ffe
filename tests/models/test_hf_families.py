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
