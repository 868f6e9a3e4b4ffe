"""Every decoder-only causal-LM family of `zbpp.models.hf` (tests/models/families.py: the 79 model
types of ``zbpp.models.hf.SUPPORTED``, Falcon both with alibi and with rotary), one training step on
2 gloo ranks under zb-h1 and zb-v with a right-padded batch and ignored labels: the loss and every
parameter's gradient equal HF's model in one process (families.py states the tolerances: float64,
1e-10 of the largest gradient; 1e-7 for the families that compute norms or routers in float32).
The MoE families with a router auxiliary loss run with it on, against a reference that applies it
per microbatch. Under both schedules W carries the weight gradients: B costs exactly the FLOPs of
the stage's input gradient.

zb-v runs every family; zb-h1 runs `ZB_H1_FAMILIES`, those whose placement under it differs in a
way zb-v does not exercise: zb-v puts the embedding and the LM head on rank 0 and one decoder layer
per stage, zb-h1 the embedding on rank 0 and the head on rank 1 (a tied embedding's gradient is
summed across ranks) and two layers per stage (a stage holds layers of different kinds: sliding and
full attention, linear-attention or convolution beside attention, dense beside MoE, NoPE beside
RoPE), with the loss and the router auxiliary loss on rank 1."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from zbpp.models.hf import SUPPORTED  # noqa: E402

from .families import FAMILIES, FLOAT32_FAMILIES, FLOAT32_RTOL, GRAD_RTOL, LOSS_RTOL, every_family_step  # noqa: E402

MOE_WITH_AUX = {"mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "granitemoe", "granitemoeshared", "phimoe", "flex_olmo",
                "gpt_oss", "minimax", "mellum", "qwen3_next", "qwen3_5_moe_text", "ernie4_5_moe"}
FLOPS_OF = ["llama", "mixtral"]
ZB_H1_FAMILIES = [
    # a tied embedding and LM head across the ranks: learned or scaled embeddings, alibi, MLA, the
    # final norm registered before the layers (OPT)
    "llama", "gpt2", "gemma", "opt", "falcon", "bloom", "mpt", "minicpm3",
    # a stage of two layers of different kinds (lfm2, ernie4_5_moe tied as well)
    "lfm2", "gemma3_text", "gpt_neo", "smollm3", "qwen3_next", "llama4_text", "deepseek_v3",
    # the router auxiliary loss summed on the other rank (qwen2_moe: a dense layer beside a MoE one)
    "mixtral", "qwen2_moe", "ernie4_5_moe"]


@pytest.mark.parametrize("name, families", [("zb-h1", ZB_H1_FAMILIES), ("zb-v", FAMILIES)], ids=["zb-h1", "zb-v"])
def test_every_family_equals_hf_on_two_ranks(zbpp_workers, name, families):
    assert set(FLOPS_OF) <= set(families) <= set(FAMILIES)
    results = zbpp_workers(2).run(every_family_step, name, families, FLOPS_OF)
    for family in families:
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
            assert per_rank[0]["aux_share"] > 1e-3 or not _hf_routes(family), (family, per_rank[0]["aux_share"])
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


def _hf_routes(family: str) -> bool:
    """Whether HF's own model returns router logits (so computes its auxiliary loss) for `family`:
    transformers 5.17's GraniteMoE (and shared) record none, their loss has no auxiliary term, and
    neither has the pipeline's (checked equal above)."""
    import transformers

    from .families import family_config

    model = transformers.AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float64)
    out = model(input_ids=torch.zeros(1, 4, dtype=torch.long), output_router_logits=True)
    return bool(out.router_logits)


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_small_config_of_every_supported_family_trains(model_type):
    # what examples/train_hf.py --model builds: `small_config`'s sizes, cut into a V's two stages on
    # one rank; one step's loss equals HF's model on the whole batch (float32, the experts' grouped
    # GEMMs included; the same weights and ops on 2 microbatches instead of one batch: rounding only,
    # measured up to 1.04e-7 relative, while a layer left out moves the loss by ~1e-3: 1e-5)
    import transformers

    from zbpp import Pipeline
    from zbpp.models.hf import causal_lm_stages, small_config
    from zbpp.schedules import build

    from .cases import token_mean_loss

    config = small_config(model_type, vocab_size=96, hidden_size=32, num_heads=4)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 4, 96)
    for key, value in config.to_dict().items():  # the comparison needs no randomness: dropout, router noise off
        if isinstance(value, float) and any(w in key for w in ("dropout", "pdrop", "jitter")):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    stages, kwargs = causal_lm_stages(config, sched, 0, dtype=torch.float32, attn_implementation="eager",
                                      state_dict=ref.state_dict())
    assert kwargs["loss_fn"].router_aux is None  # small configs leave the auxiliary loss off
    ids = torch.randint(1, 96, (4, 12), generator=torch.Generator().manual_seed(1))
    loss = Pipeline(stages, sched, **kwargs).step(ids, target=ids)
    want = token_mean_loss(ref(input_ids=ids).logits, ids)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)


def test_the_supported_list_is_the_tested_one():
    from zbpp.models.hf import SUPPORTED

    assert sorted(SUPPORTED) == sorted(f for f in FAMILIES if f != "falcon_rotary")


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


def test_a_tied_head_whose_device_the_forward_reads_first_is_placed_last():
    # Llama 4 embeds input_ids.to(self.embed_tokens.weight.device): with the LM head tied to the
    # embedding, the head's weight is read before the layers, but only its device, not its values
    import transformers

    from zbpp.models import fqns_per_stage

    from .families import family_config

    cfg = family_config("llama4_text")
    cfg.tie_word_embeddings = True
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    fqns = fqns_per_stage(model, 2, blocks="model.layers")
    assert "model.embed_tokens" in fqns[0] and "lm_head" in fqns[1] and "lm_head" not in fqns[0]


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


def test_layers_fed_from_outside_them_are_refused_by_name():
    # Gemma 4 feeds every decoder layer per-layer embeddings computed before the layers: a later
    # stage cannot compute them. Refused when the stages are built, naming the module (before, the
    # first step raised, at the forward's read of .weight of the module the stage does not hold)
    import transformers

    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    from .families import _LLAMA

    config = transformers.AutoConfig.for_model("gemma4_text", **_LLAMA, head_dim=4)
    assert config.hidden_size_per_layer_input  # the per-layer inputs are on by default
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    with pytest.raises(ValueError, match=r"Gemma4ForCausalLM does not fit zbpp.models.hf's template: its forward "
                                         r"passes model\.layers\.0 argument 1 computed from "
                                         r"model\.embed_tokens_per_layer, which stage\(s\) \[1\] do not hold"):
        causal_lm_stages(config, sched, 0)


def _tiny(model_type: str):
    """`small_config` of `model_type` at the families' sizes (hidden 16, 4 layers, vocabulary 64), dropout
    off; skipped where this transformers lacks the family."""
    import transformers

    from zbpp.models.hf import small_config

    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    cfg = small_config(model_type, vocab_size=64, hidden_size=16, num_heads=2, max_positions=64)
    for key, value in cfg.to_dict().items():
        if isinstance(value, float) and any(w in key for w in ("dropout", "pdrop", "jitter")):
            setattr(cfg, key, 0.0)
    return cfg


def test_layers_whose_kind_picks_their_mask_equal_hf():
    # Nemotron-H's forward picks each layer's mask by the layer's block_type (Mamba-2, attention,
    # MLP, MoE layers): it read it off the stand-ins of the layers a stage does not hold, which had
    # none (AttributeError on every stage). Two stages on one rank (zb-v), 2 microbatches of a
    # right-padded batch, against HF's model in one process on the whole batch: the logits of the
    # stages in a row exactly (float64, the same operations: 1e-12); the loss and every gradient to
    # float32 rounding (HF casts Nemotron-H's logits to float32, so the loss and the logits'
    # gradient are float32, summed per microbatch here: FLOAT32_RTOL of the largest gradient, and
    # 1e-6 of the loss; a layer given the wrong mask moves them by ~1e-3).
    import transformers

    from zbpp import Pipeline
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    from .cases import token_mean_loss
    from .families import padded_batch

    cfg = _tiny("nemotron_h")
    # Mamba-2 mixers of HF's default width (128 heads of 64, state 128) take a minute on the CPU: 4 heads of 8
    cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups, cfg.chunk_size = 4, 8, 8, 1, 8
    cfg.use_mamba_kernels = False
    assert len(set(cfg.layers_block_type)) == 4  # every kind of layer, on both stages
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64,
                                                        experts_implementation="eager")
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    stages, kw = causal_lm_stages(cfg, sched, 0, dtype=torch.float64, attn_implementation="eager",
                                  experts_implementation="eager", state_dict=ref.state_dict(), device="cpu")
    ids, mask, labels = padded_batch(4)
    with torch.no_grad():
        logits = stages[1](**stages[0](input_ids=ids[:2], attention_mask=mask[:2]))
        torch.testing.assert_close(logits, ref(input_ids=ids[:2], attention_mask=mask[:2]).logits, rtol=1e-12,
                                   atol=1e-12)
    loss = Pipeline(stages, sched, **kw).step({"input_ids": ids, "attention_mask": mask}, target=labels)
    want = token_mean_loss(ref(input_ids=ids, attention_mask=mask).logits, labels)
    _assert_loss_and_grads_equal(loss, want, ref, stages)


def _assert_loss_and_grads_equal(loss: torch.Tensor, want: torch.Tensor, ref: Any, stages: dict) -> None:
    """The Pipeline's loss and every stage parameter's gradient against HF's whole model (`want`,
    not yet backpropagated): float32-rounding tolerances (the recurrences of these families run in
    float32), gradients relative to the largest."""
    want.backward()
    torch.testing.assert_close(loss.double(), want.double(), rtol=1e-6, atol=0)
    scale = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
    for s, module in stages.items():
        for n, q in module.named_parameters():
            assert q.grad is not None, n
            err = float((q.grad - ref.get_parameter(n).grad).abs().max()) / scale
            assert err <= FLOAT32_RTOL, (s, n, err)


def test_a_layer_loop_that_reads_more_than_the_kind_is_refused_by_name():
    # Inkling 2 carries block states beside the hidden states, chosen by each layer's
    # is_block_boundary: a later stage cannot have them. They start from the embeddings, so the
    # stages are refused when built, naming the layer input and the module (the stand-ins, which
    # know only the layers' kind, named the attribute at the first step; before that: "'_Skip'
    # object has no attribute 'attention_type'", which names neither model nor layer).
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    cfg = _tiny("inkling2_text")
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    with pytest.raises(ValueError, match=r"Inkling2ForCausalLM does not fit zbpp.models.hf's template: its forward "
                                         r"passes model\.layers\.1 argument 1 computed from model\.embed_tokens, "
                                         r"which stage\(s\) \[1\] do not hold"):
        causal_lm_stages(cfg, sched, 0, experts_implementation="eager")


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "hy_v4"])
def test_layers_that_pass_state_to_the_next_are_refused_by_name(model_type):
    # GLM-5 (and Hunyuan-V4) pass each layer's top-k indices to the next layer (prev_topk_indices):
    # a later stage would get none from a stand-in. Refused when the stages are built, naming the
    # argument (was: "not enough values to unpack (expected 2, got 1)" at the first step).
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    cfg = _tiny(model_type)
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    # named where it crosses from stage 0 to stage 1 (where that is depends on the family's balance)
    with pytest.raises(ValueError, match=r"does not fit zbpp.models.hf's template: its forward passes model\.layers\.\d "
                                         r"'prev_topk_indices' from what model\.layers\.\d returned beside the hidden "
                                         r"states"):
        causal_lm_stages(cfg, sched, 0, experts_implementation="eager")


def test_a_middle_stage_without_a_decoder_layer_is_refused():
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    from .families import family_config

    sched = build("zb-v", num_ranks=2, num_microbatches=2)  # 4 stages
    fqns = [["model.embed_tokens", "model.layers.0", "model.layers.1"], [], ["model.layers.2", "model.layers.3"],
            ["model.norm", "lm_head"]]
    with pytest.raises(ValueError, match="a middle stage holds no decoder layer of model.layers"):
        causal_lm_stages(family_config("qwen3"), sched, 1, module_fqns_per_stage=fqns)


@pytest.mark.parametrize("family", ["gpt2", "falcon", "gemma2", "mixtral"])
def test_embeddings_alone_and_head_alone_as_stages(family):
    # the stages run one after the other in one process give HF's logits (float64, the same
    # operations: 1e-12), with the first stage only embedding and the last only norm and head;
    # Mixtral with its router auxiliary loss on: the router logits of every layer carried through
    import transformers

    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    from .families import LAYERS, family_config, padded_batch

    cfg = family_config(family)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64)
    blocks = {"gpt2": "transformer.h", "falcon": "transformer.h"}.get(family, "model.layers")
    layers = [f"{blocks}.{i}" for i in range(LAYERS)]
    embed = {"gpt2": ["transformer.wte", "transformer.wpe"], "falcon": ["transformer.word_embeddings"]}.get(
        family, ["model.embed_tokens"])
    head = {"gpt2": ["transformer.ln_f", "lm_head"], "falcon": ["transformer.ln_f", "lm_head"]}.get(
        family, ["model.norm", "lm_head"])
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
    want = ref(input_ids=ids, attention_mask=mask, output_router_logits=family == "mixtral")
    if family == "mixtral":
        torch.testing.assert_close(x["router_logits"], torch.stack(want.router_logits, 1), rtol=1e-12, atol=1e-12)
        x = x["logits"]
    torch.testing.assert_close(x, want.logits, rtol=1e-12, atol=1e-12)



def test_eval_step_of_a_mixture_of_experts_gives_the_whole_batchs_router_logits():
    # Mixtral with its router auxiliary loss on, two stages on one rank (zb-v), 3 rows in 2
    # microbatches of 2 and 1: eval_step's merged output equals HF's model on the whole batch
    # (float64, the same operations: 1e-12). The router logits were layer-major, so the merge
    # stacked each microbatch's layers (2 x 4 layers) and raised for microbatches of unequal rows.
    import transformers

    from zbpp import Pipeline
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    from .families import family_config, padded_batch

    cfg = family_config("mixtral")
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64)
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    stages, kw = causal_lm_stages(cfg, sched, 0, dtype=torch.float64, attn_implementation="eager",
                                  state_dict=ref.state_dict(), device="cpu")
    ids, mask, _ = padded_batch(3)
    out = Pipeline(stages, sched, **kw).eval_step({"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, output_router_logits=True)
    torch.testing.assert_close(out["logits"], want.logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["router_logits"], torch.stack(want.router_logits, 1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["attention_mask"], mask)

def test_a_last_stage_of_dense_layers_adds_the_router_loss_of_the_others():
    # Qwen2-MoE with its last decoder layer dense (mlp_only_layers) and the router auxiliary loss
    # on, cut so that the last stage holds that layer, the norm and the head: the stage must not
    # ask HF for router logits (HF's forward would compute its auxiliary loss over none and raise
    # IndexError) and pass on the others'. Against HF's model in one process on the whole batch
    # (float64, the same operations: 1e-12): router logits of the routing layers, logits, and the
    # loss with its auxiliary term (HF's aux_loss; its cross-entropy in float64, where HF's own is
    # float32).
    import transformers

    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    from .cases import token_mean_loss
    from .families import LAYERS, family_config, padded_batch

    cfg = family_config("qwen2_moe")
    cfg.mlp_only_layers = [LAYERS - 1]
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64)
    layers = [f"model.layers.{i}" for i in range(LAYERS)]
    fqns = [["model.embed_tokens", *layers[:-1]], [layers[-1], "model.norm", "lm_head"]]
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    stages, kw = {}, {}
    for r in range(2):
        built, kw = causal_lm_stages(cfg, sched, r, dtype=torch.float64, attn_implementation="eager",
                                     state_dict=ref.state_dict(), module_fqns_per_stage=fqns, device="cpu")
        stages.update(built)
    ids, mask, labels = padded_batch(3)
    out = stages[1](**stages[0](input_ids=ids, attention_mask=mask))
    want = ref(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    assert len(want.router_logits) == LAYERS - 1
    torch.testing.assert_close(out["router_logits"], torch.stack(want.router_logits, 1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["logits"], want.logits, rtol=1e-12, atol=1e-12)
    loss = kw["loss_fn"](out, labels)
    assert want.aux_loss > 1e-3 * want.loss  # the auxiliary term is there to be checked
    expected = token_mean_loss(want.logits, labels) + cfg.router_aux_loss_coef * want.aux_loss
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)


def test_layers_returning_a_longer_tuple_equal_hf():
    # RWKV's loop unpacks three values from each block, (hidden, state, attentions); the stand-ins of
    # the blocks a stage does not hold returned (hidden,): "not enough values to unpack (expected 3,
    # got 1)" at the first step. They now return as long a tuple, the rest None as the blocks return
    # them in training (state and attentions unasked for). Four one-block stages on one rank, a
    # training step of 2 microbatches against HF's model on the whole batch in one process: the
    # logits exactly (float64, the same operations: 1e-12), the loss and every gradient to float32
    # rounding (RWKV's WKV recurrence runs in float32 on the CPU, summed per microbatch here:
    # FLOAT32_RTOL of the largest gradient, 1e-6 of the loss).
    import transformers

    from zbpp import Pipeline
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    from .cases import token_mean_loss
    from .families import padded_batch

    cfg = _tiny("rwkv")
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
    sched = build("interleaved-1f1b", num_ranks=1, num_microbatches=2, chunks=4)
    stages, kw = causal_lm_stages(cfg, sched, 0, dtype=torch.float64, state_dict=ref.state_dict(), device="cpu")
    ids, _, labels = padded_batch(4)
    with torch.no_grad():
        x = {"input_ids": ids}
        for s in range(4):
            x = stages[s](**x)
        torch.testing.assert_close(x, ref(input_ids=ids).logits, rtol=1e-12, atol=1e-12)
    loss = Pipeline(stages, sched, **kw).step(ids, target=labels)
    want = token_mean_loss(ref(input_ids=ids).logits, labels)
    _assert_loss_and_grads_equal(loss, want, ref, stages)


def test_a_residual_stream_wider_than_the_embeddings_is_refused_by_name():
    # DeepSeek-V4's hyper-connections widen each token's hidden state to hc_mult streams before the
    # layers, [batch, seq, 4, hidden]: the stages were built, and the second stage's forward failed
    # at its first step in HF's code with "expand(torch.DoubleTensor{[2, 8, 1, 4, 16]}, size=[-1, -1,
    # 4, -1]): the number of sizes provided (4) must be greater or equal ...", naming neither the
    # model nor the cause. Refused when the stages are built, naming the model and the shape.
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    cfg = _tiny("deepseek_v4")
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    with pytest.raises(ValueError, match=r"DeepseekV4ForCausalLM does not fit zbpp.models.hf's template: its decoder "
                                         r"layers take hidden states of shape \(1, 2, 4, 16\) for \(1, 2\) tokens"):
        causal_lm_stages(cfg, sched, 0, experts_implementation="eager")


def test_a_forward_the_meta_device_cannot_run_is_refused_by_name():
    # JetMoE's experts count tokens per expert on the host: its forward fails on the meta device. With
    # module_fqns_per_stage given (as the placement's own refusal suggests), the checks' meta forward
    # raised HF's bare "RuntimeError: split_with_sizes expects split_sizes to sum exactly to 4 ...",
    # naming neither the model nor what to do. Now a ValueError naming the model, the failure and the
    # way out (the README section).
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    cfg = _tiny("jetmoe")
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    fqns = [["model.embed_tokens", "model.layers.0", "model.layers.1"], ["model.layers.2", "model.layers.3",
                                                                          "model.norm", "lm_head"]]
    with pytest.raises(ValueError, match=r"JetMoeForCausalLM \(model_type 'jetmoe'\): zbpp.models.hf needs a forward "
                                         r".* on the meta device .*to check how .*, which failed: RuntimeError: "
                                         r"split_with_sizes.*"
                                         r"README, 'Bring your model'"):
        causal_lm_stages(cfg, sched, 0, module_fqns_per_stage=fqns)


@pytest.mark.parametrize("model_type, cause", [
    ("jetmoe", "RuntimeError: split_with_sizes"),  # tokens per expert counted on the host
    ("xmod", "ValueError: Input language unknown"),  # a language id it reads, then torch.nonzero
    ("ergo", "NotImplementedError: aten::_unique2"),  # an operator without a meta kernel, in a paragraph and a URL
])
def test_a_placement_forward_the_meta_device_cannot_run_says_what_to_do(model_type, cause):
    # The default placement's meta forward failing gave HF's error whole (Ergo's runs to ~600 characters)
    # and two ways out of which neither works: "an example= the forward takes" (causal_lm_stages has no
    # example=) and "pass module_fqns_per_stage" (the checks' meta forward then fails the same way). Now
    # one short refusal naming the model, HF's first line, and the way that works.
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    cfg = _tiny(model_type)
    cfg.is_decoder = True  # XMOD is BERT-style: causal only so (refused before placement otherwise)
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    with pytest.raises(ValueError, match=rf"\(model_type '{model_type}'\): zbpp.models.hf needs a forward .* on the "
                                         rf"meta device .*to place the modules .*, which failed: {cause}.*with or "
                                         r"without module_fqns_per_stage=.*zbpp.models.pipeline_stages") as caught:
        causal_lm_stages(cfg, sched, 0, experts_implementation="eager")
    assert "example=" not in str(caught.value) and len(str(caught.value)) < 800, str(caught.value)


@pytest.mark.parametrize("family, overrides", [
    ("qwen3_moe", {"decoder_sparse_step": 3, "mlp_only_layers": []}),  # experts on layers 2 and 5 only
    ("gemma3_text", {"sliding_window_pattern": 4}),  # a full-attention layer every 4th
    ("llama4_text", {"interleave_moe_layer_step": 3, "no_rope_layer_interval": 4}),  # MoE every 3rd, NoPE every 4th
    ("deepseek_v3", {"first_k_dense_replace": 3}),  # dense layers 0-2, MoE after
])
def test_later_layers_that_differ_equal_hf(family, overrides):
    # Models whose later layers differ from layers 0 and 1 (the ones the meta-device checks looked at
    # before): 8 layers, one per stage, all on one rank; the stages in a row give HF's logits for the
    # whole model on the whole (right-padded) batch (float64, the same operations: 1e-12).
    import transformers

    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    from .families import family_config, padded_batch

    from .families import LAYERS

    # the 4-layer config's per-layer lists (layer_types, ...) left out: the 8-layer config derives its own
    kw = {k: v for k, v in family_config(family).to_dict().items()
          if k != "model_type" and not (isinstance(v, list) and len(v) == LAYERS)}
    cfg = transformers.AutoConfig.for_model(family, **{**kw, "num_hidden_layers": 8, **overrides})
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64, attn_implementation="eager",
                                                        experts_implementation="eager")
    # the overrides took: the layers past 1 are not all like layers 0 and 1 (their modules or attention kind)
    types = getattr(cfg, "layer_types", None) or [None] * 8
    kinds = [(tuple(type(m).__name__ for m in layer.modules()), types[i],
              getattr(getattr(layer, "self_attn", None), "use_rope", None)) for i, layer in enumerate(ref.model.layers)]
    assert set(kinds[2:]) - set(kinds[:2]), kinds
    sched = build("interleaved-1f1b", num_ranks=1, num_microbatches=2, chunks=8)
    stages, _ = causal_lm_stages(cfg, sched, 0, dtype=torch.float64, device="cpu", attn_implementation="eager",
                                 experts_implementation="eager", state_dict=ref.state_dict())
    ids, mask, _ = padded_batch(2)
    with torch.no_grad():
        x = {"input_ids": ids, "attention_mask": mask}
        for s in range(8):
            x = stages[s](**x)
        got = x["logits"] if isinstance(x, dict) else x
        torch.testing.assert_close(got, ref(input_ids=ids, attention_mask=mask).logits, rtol=1e-12, atol=1e-12)
