"""Pretrained weights in and out (`zbpp.models.hf_weights`): HF's ``save_pretrained`` of a tiny
random model in small shards -> `causal_lm_stages(dir)` on 2 gloo ranks -> one AdamW step ->
`zbpp.models.hf.save_pretrained` -> ``AutoModelForCausalLM.from_pretrained`` equals one process
doing the same step on HF's model. Float64; the pipeline sums the microbatches' gradients where the
reference takes the whole batch, so parameters agree to 1e-12 absolute (AdamW's first step moves
each by about lr = 1e-2, so a lost gradient or a wrong weight is far above). Each rank reads only
the tensors of its own stages."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from .weights_cases import config, failing_save_case, hf_model, pipeline_step, reference_step

transformers = pytest.importorskip("transformers")
ATOL = 1e-12  # see the module docstring
EMBEDDING = {"gpt2": "transformer.wte.weight", "qwen2": "model.embed_tokens.weight"}  # what a tied head reads
CASES = [("llama", "zb-v"), ("gpt2", "1f1b"), ("qwen2", "zb-v")]


@pytest.mark.parametrize("kind,schedule", CASES)
def test_pretrained_round_trip_equals_one_process_step(kind: str, schedule: str, tmp_path: Path, zbpp_workers) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    hf_model(kind).save_pretrained(src, max_shard_size="8KB")
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(shards) > 2, shards  # the reading side meets a sharded checkpoint with its index

    per_rank = zbpp_workers(2, pg_timeout=60).run(pipeline_step, str(src), str(out), schedule)
    saved_keys = set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])
    for r in per_rank:  # one read per tensor its stages hold, nothing else, in the checkpoint's dtype
        tie_source = {EMBEDDING[kind]} if set(r["held"]) - saved_keys else set()  # a tied head missing
        assert len(r["read"]) == len(r["held"]) and set(r["read"]) <= set(r["held"]) | tie_source, r
        assert r["dtypes"] == ["torch.float64"], r

    got, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    written = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert written == saved_keys  # a tied weight written once, as HF writes it
    want = reference_step(hf_model(kind))
    for name, p in want.named_parameters():
        torch.testing.assert_close(got.get_parameter(name), p.detach(), rtol=0, atol=ATOL, msg=name)
    assert got.config.tie_word_embeddings == config(kind).tie_word_embeddings


def _family_configs() -> dict[str, object]:
    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    return {
        "gemma": transformers.GemmaConfig(**small, head_dim=8),  # tied, scaled embeddings
        "mixtral": transformers.MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": transformers.Qwen2MoeConfig(**small, moe_intermediate_size=8, shared_expert_intermediate_size=8,
                                                 num_experts=4, num_experts_per_tok=2),
        # 12 experts: by name "experts.10" sorts before "experts.2"; the fused tensor must stack them by number
        "olmoe": transformers.OlmoeConfig(**small, num_experts=12, num_experts_per_tok=2),
    }


@pytest.mark.parametrize("kind", ["gemma", "mixtral", "qwen2_moe", "olmoe"])
def test_checkpoint_names_map_to_the_model_both_ways(kind: str, tmp_path: Path) -> None:
    """HF writes MoE experts one tensor each and the model fuses them (its conversion mapping), in
    expert order (OLMoE's 12: more than 10); a Gemma checkpoint has no LM head (tied). Reading by model name gives the model's own tensors, and
    `save_pretrained` of a one-rank Pipeline over the model writes what ``from_pretrained`` loads
    back exactly (no pipeline maths here: the names and conversions only)."""
    from zbpp import Pipeline
    from zbpp.models.hf import save_pretrained
    from zbpp.models.hf_weights import SafetensorsWeights
    from zbpp.schedules import build

    config = _family_configs()[kind]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    weights = SafetensorsWeights(tmp_path / "src", config)
    state = model.state_dict()
    assert sorted(weights) == sorted(state)
    for name, t in state.items():
        assert torch.equal(weights[name], t), name

    pipe = Pipeline({0: model}, build("1f1b", num_ranks=1, num_microbatches=1), loss_fn=lambda out, y: out)
    save_pretrained(pipe, tmp_path / "out", max_shard_size="20KB")
    written = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    original = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(written) == sorted(original)  # HF's checkpoint format: per-expert tensors, no tied head
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, t in state.items():
        assert torch.equal(back.state_dict()[name], t), name


def _float32_kept_model(kind: str) -> tuple[Any, torch.dtype]:
    """A tiny float32 model whose family keeps some weights in float32 under a 16-bit dtype, and that
    dtype; its weights random (not ones or zeros, which no rounding changes)."""
    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)
    if kind == "glm4_moe":  # router kept in float32 for float16 and bfloat16 (_keep_in_fp32_modules_strict)
        config, dtype = transformers.Glm4MoeConfig(**small, n_routed_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=8, first_k_dense_replace=1, n_group=1,
                                                   topk_group=1, n_shared_experts=1), torch.bfloat16
    else:  # GPT-OSS: its norms kept in float32 for float16 only (_keep_in_fp32_modules)
        config, dtype = transformers.GptOssConfig(**small, num_local_experts=4, num_experts_per_tok=2,
                                                  layer_types=["full_attention"] * 2), torch.float16
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)  # float32: the weights before any rounding
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn_like(t) * 1e-3)
    return model, dtype


@pytest.mark.parametrize("kind", ["glm4_moe", "gpt_oss"])
def test_weights_kept_in_float32_load_unrounded(kind: str, tmp_path: Path) -> None:
    """GLM-4-MoE keeps its router (``gate.weight``, ``e_score_correction_bias``) in float32 in a
    bfloat16 model (``_keep_in_fp32_modules_strict``), GPT-OSS its norms in a float16 one
    (``_keep_in_fp32_modules``): loaded from a float32 checkpoint in that 16-bit dtype,
    ``from_pretrained`` (the reference) keeps them in float32, unrounded. The stages held GPT-OSS's
    norms in float16, rounded; they must hold HF's tensors, dtype included, and write them back so.
    Exact: both only read and cast the same tensors."""
    from zbpp import Pipeline
    from zbpp.models.hf import causal_lm_stages, save_pretrained
    from zbpp.schedules import build

    model, dtype = _float32_kept_model(kind)
    model.save_pretrained(tmp_path / "src")

    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=dtype).state_dict()
    assert {t.dtype for t in want.values()} == {dtype, torch.float32}  # the case: some kept in float32
    sched = build("1f1b", num_ranks=1, num_microbatches=1)
    stages, kwargs = causal_lm_stages(tmp_path / "src", sched, 0, device="cpu", dtype=dtype)
    got = stages[0].state_dict()
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    save_pretrained(Pipeline(stages, sched, **kwargs), tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    for name, t in want.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_a_tied_head_present_with_its_own_values_is_untied_as_hf_does(tmp_path: Path) -> None:
    """A config that ties the LM head to the embedding, with a checkpoint that holds both tensors with
    different values: ``from_pretrained`` does not tie them (it warns) and each keeps its own. The
    stages must compute HF's logits, not put the embedding in the head. Float64, the same operations
    in the same order: 1e-12."""
    from safetensors.torch import load_file, save_file

    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config("qwen2"), dtype=torch.float64)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors  # HF writes a tied weight once
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert ref.lm_head.weight is not ref.model.embed_tokens.weight
    ids = torch.randint(0, 48, (2, 6))
    sched = build("1f1b", num_ranks=2, num_microbatches=1)
    stages: dict = {}
    with pytest.warns(UserWarning, match="lm_head.weight"):
        for r in range(2):
            stages.update(causal_lm_stages(tmp_path, sched, r, device="cpu", attn_implementation="eager")[0])
    torch.testing.assert_close(stages[1](**stages[0](input_ids=ids)), ref(input_ids=ids).logits, rtol=1e-12,
                               atol=1e-12)


def test_a_directory_saved_again_unsharded_reads_as_hf_reads_it(tmp_path: Path) -> None:
    """HF's save_pretrained into a directory that holds an earlier sharded save leaves its index
    beside the new ``model.safetensors``. ``from_pretrained`` reads ``model.safetensors`` first; so
    must the stages, or they train the earlier weights."""
    from zbpp.models.hf_weights import SafetensorsWeights

    cfg = config("llama")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path, max_shard_size="8KB")  # the earlier save, in shards
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.save_pretrained(tmp_path)  # the new one, one file
    assert (tmp_path / "model.safetensors.index.json").is_file() and (tmp_path / "model.safetensors").is_file()

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    weights = SafetensorsWeights(tmp_path, cfg)
    for name, t in model.state_dict().items():
        assert torch.equal(hf[name], t), name  # what HF reads: the new weights
        assert torch.equal(weights[name], t), name


def test_base_model_checkpoint_loads_into_the_lm(tmp_path: Path) -> None:
    """A checkpoint of the base model (GPT-2's original names: ``h.0...``, ``wte.weight``, no
    ``transformer.`` prefix and no head) maps onto the LM's names as ``from_pretrained`` maps it, the
    tied head reading the embedding."""
    from zbpp.models.hf_weights import SafetensorsWeights

    cfg = config("gpt2")
    torch.manual_seed(0)
    transformers.GPT2Model(cfg).save_pretrained(tmp_path)
    lm = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    weights = SafetensorsWeights(tmp_path, cfg)
    for name, t in lm.state_dict().items():
        assert torch.equal(weights[name], t), name


def test_a_directory_without_weights_is_named(tmp_path: Path) -> None:
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    sched = build("1f1b", num_ranks=1, num_microbatches=1)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        causal_lm_stages(tmp_path, sched, 0)
    config("llama").save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        causal_lm_stages(tmp_path, sched, 0)


def _llama_checkpoint_edited(path: Path, edit: Any) -> None:
    """HF's save of the tiny Llama with its tensors changed by ``edit(tensors)`` (in place)."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config("llama")).save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_a_checkpoint_tensor_the_model_has_no_place_for_is_refused(tmp_path: Path) -> None:
    """A tensor of the checkpoint that no parameter takes (a bias the config does not have, a layer
    past num_hidden_layers) was dropped without a word: the model trained without it. Refused on
    every rank, naming the keys ``from_pretrained`` reports unexpected (the reference); a key HF
    ignores on purpose (an old per-layer ``rotary_emb.inv_freq`` buffer) still loads."""
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    extra = {"model.layers.0.self_attn.q_proj.bias": torch.randn(16),
             "model.layers.9.mlp.up_proj.weight": torch.randn(32, 16)}
    ignored = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.randn(2)}
    _llama_checkpoint_edited(tmp_path / "bad", lambda t: t.update({**extra, **ignored}))
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bad", output_loading_info=True)
    assert info["unexpected_keys"] == set(extra)  # HF's own verdict: these two, not the ignored one
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    for rank in range(2):  # every rank refuses, whichever stages it holds: none waits for the other
        with pytest.raises(ValueError, match="no place for") as err:
            causal_lm_stages(tmp_path / "bad", sched, rank, device="cpu")
        assert all(k in str(err.value) for k in extra) and "inv_freq" not in str(err.value), err.value

    _llama_checkpoint_edited(tmp_path / "ok", lambda t: t.update(ignored))
    causal_lm_stages(tmp_path / "ok", sched, 0, device="cpu")


def test_a_multimodal_directory_builds_its_text_model(tmp_path: Path) -> None:
    """A multimodal checkpoint (Llama 4's: a vision tower and a projector beside the text model) was
    refused for the tensors the causal LM has no place for. It builds the text model now, as
    ``AutoModelForCausalLM.from_pretrained`` does, with a warning naming what stays unread: one
    step's loss equals HF's text model loaded from the directory (float64, the same weights and ops:
    rtol 1e-12), and what `save_pretrained` writes loads in HF to the same loss. A stray tensor among
    the text model's own names is still refused."""
    from safetensors.torch import load_file, save_file

    from zbpp import Pipeline
    from zbpp.models.hf import causal_lm_stages, save_pretrained, small_config
    from zbpp.schedules import build

    from .cases import token_mean_loss

    torch.manual_seed(0)
    transformers.Llama4ForConditionalGeneration(small_config("llama4", vocab_size=96, hidden_size=32, num_heads=4)
                                                ).to(torch.float64).save_pretrained(tmp_path / "mm")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mm", dtype=torch.float64)
    ids = torch.randint(1, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    want = token_mean_loss(hf(input_ids=ids).logits, ids)
    sched = build("1f1b", num_ranks=1, num_microbatches=2)
    with pytest.warns(UserWarning, match=r"multimodal Llama4Config.*\['multi_modal_projector', 'vision_model'\]"):
        stages, kwargs = causal_lm_stages(tmp_path / "mm", sched, 0)
    pipe = Pipeline(stages, sched, **kwargs)
    torch.testing.assert_close(pipe.step(ids, target=ids), want, rtol=1e-12, atol=0)
    save_pretrained(pipe, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64)
    torch.testing.assert_close(token_mean_loss(back(input_ids=ids).logits, ids), want, rtol=1e-12, atol=0)

    tensors = load_file(tmp_path / "mm" / "model.safetensors")
    tensors["language_model.model.layers.9.feed_forward.up_proj.weight"] = torch.randn(4, 4)
    save_file(tensors, tmp_path / "mm" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no place for.*layers.9"):
        causal_lm_stages(tmp_path / "mm", sched, 0)


def test_a_tensor_missing_from_the_checkpoint_is_refused_on_every_rank(tmp_path: Path) -> None:
    """The final norm missing from the checkpoint: only the last rank, which holds it, raised; the
    others went on into the Pipeline and waited for it until the process group's timeout. Every
    rank now refuses the checkpoint, naming the tensor."""
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    _llama_checkpoint_edited(tmp_path, lambda t: t.pop("model.norm.weight"))
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    for rank in range(2):
        with pytest.raises(ValueError, match=r"lacks .*model\.norm\.weight"):
            causal_lm_stages(tmp_path, sched, rank, device="cpu")


@pytest.mark.parametrize("first,then", [("2GB", "8KB"), ("8KB", "2GB"), ("4KB", "8KB")])
def test_saving_again_into_a_directory_leaves_only_the_new_weights(first: str, then: str, tmp_path: Path) -> None:
    """`save_pretrained` into a directory that holds an earlier save, now in another number of files
    (the job resumed at another pipeline degree): one earlier ``model.safetensors`` beside new
    shards was what ``from_pretrained`` read (it looks for the single file first), the earlier
    weights, silently. The directory holds the new save only; what HF and the stages read is the
    model's state now (the reference), exactly."""
    from zbpp import Pipeline
    from zbpp.models.hf import save_pretrained
    from zbpp.models.hf_weights import SafetensorsWeights
    from zbpp.schedules import build

    cfg = config("llama")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    pipe = Pipeline({0: model}, build("1f1b", num_ranks=1, num_microbatches=1), loss_fn=lambda out, y: out)
    save_pretrained(pipe, tmp_path, max_shard_size=first)
    before = sorted(p.name for p in tmp_path.iterdir())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_pretrained(pipe, tmp_path, max_shard_size=then)
    files = sorted(p.name for p in tmp_path.glob("model*"))
    assert files != sorted(p for p in before if p.startswith("model")), files  # another number of files
    if then == "2GB":
        assert files == ["model.safetensors"], files
    else:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert files == sorted({*index["weight_map"].values(), "model.safetensors.index.json"}), files

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    weights = SafetensorsWeights(tmp_path, cfg)
    for name, t in model.state_dict().items():
        assert torch.equal(hf[name], t), name
        assert torch.equal(weights[name], t), name


@pytest.mark.parametrize("where, failing, words", [
    ("weights", 1, "OSError: could not write '{out}/model-0000"),
    ("config", 0, "PermissionError: [Errno 13] Permission denied: '{out}/config.json'"),
])
def test_a_write_failing_on_one_rank_raises_on_every_rank(where: str, failing: int, words: str, tmp_path: Path,
                                                          zbpp_workers) -> None:
    """One rank cannot write its part (`failing_save_case`: rank 1's weight file on a full disk, or
    rank 0's config.json): it raised alone and the other rank waited in save_pretrained's gather of
    the files, or its barrier, for the process group's 60 s timeout. Now the failing rank raises its
    own error (naming the file) and the other a PipelineError naming the rank and the cause, within
    seconds. An earlier save's file there is kept (deleted only once the save is complete): a failed
    save leaves what could still be read, not weights without their index or config."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier save")  # this save writes shards
    outcomes = zbpp_workers(2, pg_timeout=60).run(failing_save_case, str(out), where)
    assert (out / "model.safetensors").read_bytes() == b"an earlier save"
    assert all(float(o.split("s ", 1)[0]) < 10 for o in outcomes), outcomes  # not the 60 s timeout
    own, other = outcomes[failing], outcomes[1 - failing]
    words = words.format(out=out)
    assert own.split(" ", 1)[1].startswith(words), own
    assert other.split(" ", 1)[1].startswith("PipelineError: save_pretrained could not "), other
    assert f"; global rank {failing}: {words}" in other, other
    cause = "No space left on device" if where == "weights" else "Permission denied"
    assert all(cause in o for o in outcomes), outcomes


def test_a_float64_moe_builds_from_a_directory_with_eager_experts(tmp_path: Path) -> None:
    """HF's default experts (grouped matmul) take no float64, and ``config.json`` does not keep
    ``experts_implementation``: a float64 Mixtral built from a directory failed in its first forward
    ("Expected mat_a to be Float32, BFloat16 or Float16"), with no way to ask for other experts.
    `causal_lm_stages(dir, experts_implementation="eager")` builds it; its logits are HF's model
    loaded from the directory the same way, to 1e-12 (float64; the same HF forward on the same batch,
    only the stage's bookkeeping around it)."""
    from zbpp import Pipeline
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_family_configs()["mixtral"], dtype=torch.float64)
    model.save_pretrained(tmp_path)
    sched = build("1f1b", num_ranks=1, num_microbatches=1)
    stages, kwargs = causal_lm_stages(tmp_path, sched, 0, dtype=torch.float64, attn_implementation="eager",
                                      experts_implementation="eager")
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    got = Pipeline(stages, sched, **kwargs).eval_step(ids)
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, attn_implementation="eager",
                                                             experts_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(got, want(input_ids=ids).logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("damage", ["missing", "cut short", "a key elsewhere"])
def test_a_damaged_shard_is_refused_on_every_rank(damage: str, tmp_path: Path) -> None:
    """A sharded checkpoint whose last shard is missing, cut short (a partial copy) or lacks a key
    its index places there: only the rank whose stages read that shard raised, and the other went
    on into the Pipeline and waited for it until the process group's timeout (checked on 2 gloo
    ranks: 40 s, the pg timeout). Every rank now refuses the directory, naming the file."""
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    src = tmp_path / "src"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config("llama")).save_pretrained(src, max_shard_size="8KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    last = index["weight_map"]["model.norm.weight"]  # held by the last stage only
    if damage == "missing":
        (src / last).unlink()
    elif damage == "cut short":
        data = (src / last).read_bytes()
        (src / last).write_bytes(data[:len(data) // 2])
    else:  # the index says the norm is in the first shard
        first = index["weight_map"]["model.embed_tokens.weight"]
        assert first != last
        index["weight_map"]["model.norm.weight"] = first
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
        last = first
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    for rank in range(2):  # rank 0 holds no tensor of the damaged shard: it raises all the same
        with pytest.raises((FileNotFoundError, ValueError), match=last) as err:
            causal_lm_stages(src, sched, rank, device="cpu")
        assert (damage == "a key elsewhere") == ("model.norm.weight" in str(err.value)), err.value


@pytest.mark.parametrize("shard", ["2GB", "8KB"])
def test_a_config_without_dtype_builds_in_the_weights_dtype_as_hf_does(shard: str, tmp_path: Path) -> None:
    """A bfloat16 checkpoint whose config.json names no dtype (written by another tool): zbpp built
    it in float32 while ``from_pretrained`` (dtype "auto": the first floating weight's) builds it in
    bfloat16, so the model trained in float32 and `save_pretrained` wrote float32 files, twice the
    size. The stages now hold HF's loaded tensors bit for bit, dtype included (the reference), and
    the round trip writes the checkpoint's own tensors back."""
    from safetensors.torch import load_file

    from zbpp import Pipeline
    from zbpp.models.hf import causal_lm_stages, save_pretrained
    from zbpp.schedules import build

    torch.manual_seed(0)
    src, out = tmp_path / "src", tmp_path / "out"
    transformers.AutoModelForCausalLM.from_config(config("llama"), dtype=torch.bfloat16).save_pretrained(
        src, max_shard_size=shard)
    saved = json.loads((src / "config.json").read_text())
    saved.pop("dtype", None)
    (src / "config.json").write_text(json.dumps(saved))
    want = transformers.AutoModelForCausalLM.from_pretrained(src).state_dict()
    assert {t.dtype for t in want.values()} == {torch.bfloat16}  # HF's own verdict
    sched = build("1f1b", num_ranks=1, num_microbatches=1)
    stages, kwargs = causal_lm_stages(src, sched, 0, device="cpu")
    got = stages[0].state_dict()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    save_pretrained(Pipeline(stages, sched, **kwargs), out)

    def files(d: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    before, after = files(src), files(out)
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name


def test_a_tensor_of_another_shape_is_refused_on_every_rank(tmp_path: Path) -> None:
    """A checkpoint whose final norm has another shape than the config's model (config.json of
    another size than the weights): only the last rank, which holds it, raised (copying it into its
    stage), and the other went on into the Pipeline and waited for it until the process group's
    timeout (30 s on 2 gloo ranks). HF's from_pretrained refuses it as mismatched (the reference);
    every rank now does, naming the tensor and both shapes."""
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    _llama_checkpoint_edited(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(17)}))
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # HF's own verdict
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    for rank in range(2):
        with pytest.raises(ValueError, match=r"another shape .*model\.norm\.weight \(17,\) in the checkpoint, "
                                             r"\(16,\) in the model"):
            causal_lm_stages(tmp_path, sched, rank, device="cpu")


def test_experts_that_do_not_fuse_are_refused_on_every_rank(tmp_path: Path) -> None:
    """A Mixtral checkpoint whose last layer holds one expert of another width (a config of another
    size than the weights): HF's converter fuses the experts into one tensor, and stacking them
    failed only on the last rank ("stack expects each tensor to be equal size"), while the other
    went on into the Pipeline and waited for it until the process group's timeout (30 s on 2 gloo
    ranks). Every rank now refuses it, naming the fused tensor and its checkpoint tensors."""
    from safetensors.torch import load_file, save_file

    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_family_configs()["mixtral"]).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    key = "model.layers.1.block_sparse_moe.experts.1.w1.weight"  # HF's checkpoint name of expert 1's gate
    tensors[key] = torch.randn(tensors[key].shape[0] + 1, tensors[key].shape[1])
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError):  # HF's own verdict: it cannot load them either
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    for rank in range(2):
        with pytest.raises(ValueError, match=r"another shape .*model\.layers\.1\.mlp\.experts\.gate_up_proj from "):
            causal_lm_stages(tmp_path, sched, rank, device="cpu")


@pytest.mark.parametrize("index", [{"metadata": {"total_size": 1}}, {"metadata": {}, "weight_map": ["a"]}, ["x"]])
@pytest.mark.parametrize("config_dtype", [True, False])
def test_an_index_without_a_weight_map_is_named(index: Any, config_dtype: bool, tmp_path: Path) -> None:
    """A model.safetensors.index.json without "weight_map" (or with one of another form, or not an
    object) failed with a bare KeyError: 'weight_map' (TypeError for the others), naming no file,
    whether or not config.json names the dtype (without it the index is read first to find it).
    Now a ValueError names the index file and what it lacks."""
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config("llama"))
    model.save_pretrained(tmp_path, max_shard_size="8KB")
    if not config_dtype:
        saved = json.loads((tmp_path / "config.json").read_text())
        saved.pop("dtype", None), saved.pop("torch_dtype", None)
        (tmp_path / "config.json").write_text(json.dumps(saved))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    sched = build("1f1b", num_ranks=1, num_microbatches=1)
    with pytest.raises(ValueError, match="model.safetensors.index.json") as err:
        causal_lm_stages(tmp_path, sched, 0, device="cpu")
    assert str(tmp_path) in str(err.value) and ("weight_map" in str(err.value) or "JSON list" in str(err.value))


def test_a_read_failing_on_one_rank_raises_on_every_rank(tmp_path: Path, zbpp_workers) -> None:
    """Rank 1 cannot read the data of the shard that holds the final norm (an I/O error after the
    headers read; `failing_read_case`): it raised alone in causal_lm_stages, and rank 0 went on into
    the Pipeline and waited for it there until the process group's 60 s timeout. Now the ranks agree
    once their stages are read: rank 1 raises its own error naming the file, rank 0 a PipelineError
    naming rank 1 and the file, within seconds."""
    from .weights_cases import failing_read_case

    src = tmp_path / "src"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config("llama")).save_pretrained(src, max_shard_size="8KB")
    broken = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    outcomes = zbpp_workers(2, pg_timeout=60).run(failing_read_case, str(src), broken)
    # rank 0 raised within seconds of rank 1's failure, not at the 60 s timeout (each started at the same time;
    # building the stages alone takes seconds on a loaded CPU, so the times are compared, not bounded)
    seconds = [float(o.split("s ", 1)[0]) for o in outcomes]
    assert seconds[0] < seconds[1] + 10, outcomes
    # the first tensor rank 1 reads from that shard (which one: the shard's order), then the file and the cause
    words = re.compile(rf"OSError: could not read '[\w.]+' from '{re.escape(str(src / broken))}': OSError: \[Errno 5\] "
                       "Input/output error")
    assert words.match(outcomes[1].split(" ", 1)[1]), outcomes
    assert outcomes[0].split(" ", 1)[1].startswith("PipelineError: causal_lm_stages could not read "), outcomes
    assert re.search("; global rank 1: " + words.pattern, outcomes[0]), outcomes


def test_max_shard_size_and_the_files_are_hf_saves(tmp_path: Path) -> None:
    """On one rank `save_pretrained` writes the files HF's own ``save_pretrained`` writes of the same
    model (the reference: which tensors each file holds, by name). zbpp read "8Kb" as kilobits (1000
    bytes, as transformers' ``convert_file_size_to_int``) where HF's save reads 8000 bytes
    (huggingface_hub's ``parse_size_to_int``, any case), and put the tensors after one larger than the
    limit in a new file where HF goes on filling the one before (2KB: 13 files against HF's 12). Bad
    sizes are refused, naming the value."""
    from zbpp import Pipeline
    from zbpp.models.hf import save_pretrained
    from zbpp.models.hf_weights import _bytes
    from zbpp.schedules import build

    def files(directory: Path) -> Any:
        index = directory / "model.safetensors.index.json"
        if not index.exists():
            return sorted(p.name for p in directory.glob("*.safetensors"))
        by_file: dict[str, list[str]] = {}
        for name, file in json.loads(index.read_text())["weight_map"].items():
            by_file.setdefault(file, []).append(name)
        return sorted((file, sorted(names)) for file, names in by_file.items())

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config("llama"))
    pipe = Pipeline({0: model}, build("1f1b", num_ranks=1, num_microbatches=1), loss_fn=lambda out, y: out)
    for size in ["8Kb", "2KB", 3000]:
        model.save_pretrained(tmp_path / f"hf{size}", max_shard_size=size)
        save_pretrained(pipe, tmp_path / f"zbpp{size}", max_shard_size=size)
        assert files(tmp_path / f"zbpp{size}") == files(tmp_path / f"hf{size}"), size
    assert len(files(tmp_path / "hf2KB")) > 2  # tensors over the limit among them
    assert _bytes("1.5GB") == 1_500_000_000 and _bytes(" 500 mb ") == 500_000_000 and _bytes("100B") == 100
    assert (_bytes("5GiB"), _bytes("3MiB"), _bytes("2kib"), _bytes("1TB"), _bytes("1e3MB")) == (
        5 * 2**30, 3 * 2**20, 2048, 10**12, 10**9)
    for bad in ["0MB", "0.0001KB", 0, -1, True, 2.5, "", "x", "-5MB", "GB", "nanMB", "infGB", "5PB"]:
        with pytest.raises(ValueError, match=re.escape(f"max_shard_size must be a positive number of bytes or a size "
                                                       f"like '500MB', got {bad!r}")):
            _bytes(bad)


def test_dtype_is_taken_as_from_pretrained_takes_it(tmp_path: Path) -> None:
    """``dtype="auto"`` (``from_pretrained``'s default, which the README compares the default to) failed
    with "module 'torch' has no attribute 'auto'" for a directory, and for a config blamed the config;
    a dtype's name and "auto" build what ``from_pretrained`` builds (the reference: its parameters'
    dtypes), and a dtype that is none is refused, naming it, whatever the source."""
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config("llama"), dtype=torch.bfloat16).save_pretrained(tmp_path)
    sched = build("1f1b", num_ranks=1, num_microbatches=1)
    for dtype in ["auto", "float64"]:
        want = {p.dtype for p in transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).parameters()}
        stages, _ = causal_lm_stages(tmp_path, sched, 0, device="cpu", dtype=dtype)
        assert {p.dtype for p in stages[0].parameters()} == want, dtype
    stages, _ = causal_lm_stages(config("llama"), sched, 0, device="cpu", dtype="auto")  # as from_config's default
    assert {p.dtype for p in stages[0].parameters()} == {torch.float32}
    for bad in ["float99", 3, torch.int64, "int64"]:
        for source in [tmp_path, config("llama")]:
            with pytest.raises(ValueError, match=re.escape(f"dtype must be a floating torch.dtype, its name "
                                                           f"(\"bfloat16\"), or None or \"auto\"") + f".*got {re.escape(repr(bad))}"):
                causal_lm_stages(source, sched, 0, device="cpu", dtype=bad)
