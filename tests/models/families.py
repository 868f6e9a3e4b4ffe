"""Tiny configs of every decoder-only causal-LM family that the tests of `zbpp.models.hf` run: hidden
16, 4 layers, vocab 64, dropout and router noise off, each family's distinctive options on (sliding
windows shorter than the sequence, softcaps, logit and embedding scales, alibi, learned positions, a
tied or untied LM head, mixture-of-experts with the router auxiliary loss, linear-attention and
convolution layers beside attention ones). Built from each family's own Config class: nothing is
downloaded."""

from __future__ import annotations

from typing import Any, Callable

VOCAB, LAYERS = 64, 4
_LLAMA = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
_DENSE_MHA = {k: v for k, v in _LLAMA.items() if k != "num_key_value_heads"}  # families without grouped queries
_MHA4 = {**_LLAMA, "num_key_value_heads": 4}
_MLA = dict(q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
# float64 on the CPU: the default grouped-matmul experts take float32 and lower only
_MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1, experts_implementation="eager")


def _families() -> dict[str, Callable[[], Any]]:
    import transformers as t

    return {
        "llama": lambda: t.LlamaConfig(**_LLAMA, tie_word_embeddings=True),
        "mistral": lambda: t.MistralConfig(**_LLAMA, sliding_window=3),
        "qwen2": lambda: t.Qwen2Config(**_LLAMA, use_sliding_window=True, sliding_window=3, max_window_layers=2),
        "qwen3": lambda: t.Qwen3Config(**_LLAMA, head_dim=8, tie_word_embeddings=True),
        "gpt2": lambda: t.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=LAYERS, n_head=2, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "gemma": lambda: t.GemmaConfig(**_LLAMA, head_dim=8),
        "gemma2": lambda: t.Gemma2Config(**_LLAMA, head_dim=8, sliding_window=3, final_logit_softcapping=3.0,
                                         attn_logit_softcapping=5.0),
        "gemma3_text": lambda: t.Gemma3TextConfig(**_LLAMA, head_dim=8, sliding_window=3, sliding_window_pattern=2,
                                                  final_logit_softcapping=3.0),
        "phi": lambda: t.PhiConfig(**_LLAMA, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0),
        "phi3": lambda: t.Phi3Config(**_LLAMA, pad_token_id=0),
        "olmo": lambda: t.OlmoConfig(**_LLAMA, clip_qkv=8.0),
        "olmo2": lambda: t.Olmo2Config(**_LLAMA),
        "gpt_neox": lambda: t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=LAYERS,
                                            num_attention_heads=2, intermediate_size=32, max_position_embeddings=64,
                                            rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0),
        "opt": lambda: t.OPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=LAYERS, ffn_dim=32,
                                   num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=16,
                                   dropout=0.0, attention_dropout=0.0, pad_token_id=1),
        "falcon": lambda: t.FalconConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=LAYERS,
                                         num_attention_heads=2, alibi=True, hidden_dropout=0.0, attention_dropout=0.0,
                                         new_decoder_architecture=False, multi_query=True),
        "falcon_rotary": lambda: t.FalconConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=LAYERS,
                                                num_attention_heads=2, num_kv_heads=2, alibi=False,
                                                new_decoder_architecture=True, hidden_dropout=0.0,
                                                attention_dropout=0.0),
        "bloom": lambda: t.BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=LAYERS, n_head=2,
                                       hidden_dropout=0.0, attention_dropout=0.0),
        "starcoder2": lambda: t.Starcoder2Config(**_LLAMA, sliding_window=3, residual_dropout=0.0,
                                                 embedding_dropout=0.0),
        "gpt_bigcode": lambda: t.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=16, n_layer=LAYERS, n_head=2,
                                                  n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "cohere": lambda: t.CohereConfig(**_LLAMA, logit_scale=0.5),
        "granite": lambda: t.GraniteConfig(**_LLAMA, embedding_multiplier=3.0, logits_scaling=2.0,
                                           residual_multiplier=0.5, attention_multiplier=0.3),
        "glm": lambda: t.GlmConfig(**_LLAMA, head_dim=8, pad_token_id=0),
        "smollm3": lambda: t.SmolLM3Config(**_LLAMA, no_rope_layer_interval=2, pad_token_id=0),
        "helium": lambda: t.HeliumConfig(**_LLAMA, head_dim=4),
        "mixtral": lambda: t.MixtralConfig(**_LLAMA, num_local_experts=4, **_MOE),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(**_LLAMA, num_experts=4, moe_intermediate_size=16,
                                              shared_expert_intermediate_size=16, mlp_only_layers=[1], **_MOE),
        "olmoe": lambda: t.OlmoeConfig(**_LLAMA, num_experts=4, **_MOE),
        "deepseek_v3": lambda: t.DeepseekV3Config(**{**_LLAMA, "num_key_value_heads": 4}, moe_intermediate_size=16,
                                                  n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                                  n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=8,
                                                  kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                                  v_head_dim=4, experts_implementation="eager"),
        # built through AutoConfig by model_type (one spelling for every transformers version)
        "stablelm": lambda: _auto("stablelm", **_LLAMA, qk_layernorm=True, use_qkv_bias=True, hidden_dropout=0.0),
        "nemotron": lambda: _auto("nemotron", **_LLAMA, head_dim=4),
        "persimmon": lambda: _auto("persimmon", **_DENSE_MHA, qk_layernorm=True, hidden_dropout=0.0),
        "olmo3": lambda: _auto("olmo3", **_LLAMA, sliding_window=3),
        "ministral": lambda: _auto("ministral", **_LLAMA, head_dim=4, sliding_window=3),
        "ministral3": lambda: _auto("ministral3", **_LLAMA, head_dim=4, sliding_window=3),
        "glm4": lambda: _auto("glm4", **_LLAMA, head_dim=4, pad_token_id=0),
        "arcee": lambda: _auto("arcee", **_LLAMA),
        "bitnet": lambda: _auto("bitnet", **_LLAMA),
        "diffllama": lambda: _auto("diffllama", **_LLAMA, head_dim=4),
        "ernie4_5": lambda: _auto("ernie4_5", **_LLAMA, head_dim=4, use_bias=True),
        "exaone4": lambda: _auto("exaone4", **_LLAMA, sliding_window=3),
        "granite_swa": lambda: _auto("granite_swa", **_LLAMA, sliding_window=3, embedding_multiplier=3.0,
                                     logits_scaling=2.0, residual_multiplier=0.5, attention_multiplier=0.3),
        "hunyuan_v1_dense": lambda: _auto("hunyuan_v1_dense", **_LLAMA, head_dim=4),
        "seed_oss": lambda: _auto("seed_oss", **_LLAMA, head_dim=4, attention_bias=True, attention_dropout=0.0,
                                  residual_dropout=0.0),
        "cohere2": lambda: _auto("cohere2", **_LLAMA, sliding_window=3, logit_scale=0.5),
        "vaultgemma": lambda: _auto("vaultgemma", **_LLAMA, head_dim=8, sliding_window=3,
                                    final_logit_softcapping=3.0, attn_logit_softcapping=5.0),
        "nanochat": lambda: _auto("nanochat", **_LLAMA, final_logit_softcapping=3.0),
        "cwm": lambda: _auto("cwm", **_LLAMA, head_dim=4, sliding_window=3),
        "jais2": lambda: _auto("jais2", **_LLAMA, head_dim=4),
        "hyperclovax": lambda: _auto("hyperclovax", **_LLAMA, head_dim=4, embedding_multiplier=3.0,
                                     residual_multiplier=0.5, attention_multiplier=0.3, use_post_norm=True),
        "lfm2": lambda: _auto("lfm2", **_LLAMA, layer_types=["conv", "full_attention", "conv", "full_attention"]),
        "qwen3_5_text": lambda: _auto("qwen3_5_text", **_LLAMA, head_dim=4, linear_key_head_dim=4,
                                      linear_value_head_dim=4),
        "biogpt": lambda: _auto("biogpt", **_DENSE_MHA, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                activation_dropout=0.0, scale_embedding=True),
        # mixtures of experts, with the router auxiliary loss where the family has one
        "qwen3_moe": lambda: _auto("qwen3_moe", **_LLAMA, head_dim=4, num_experts=4, moe_intermediate_size=16, **_MOE),
        "granitemoe": lambda: _auto("granitemoe", **_LLAMA, num_local_experts=4, embedding_multiplier=3.0,
                                    residual_multiplier=0.5, attention_multiplier=0.3, **_MOE),
        "granitemoeshared": lambda: _auto("granitemoeshared", **_LLAMA, num_local_experts=4,
                                          shared_intermediate_size=16, **_MOE),
        "phimoe": lambda: _auto("phimoe", **_LLAMA, num_local_experts=4, sliding_window=3, router_jitter_noise=0.0,
                                input_jitter_noise=0.0, **_MOE),
        "flex_olmo": lambda: _auto("flex_olmo", **_LLAMA, num_experts=4, pad_token_id=0, **_MOE),
        "gpt_oss": lambda: _auto("gpt_oss", **_LLAMA, head_dim=4, num_local_experts=4, sliding_window=3, **_MOE),
        "minimax": lambda: _auto("minimax", **_LLAMA, head_dim=4, num_local_experts=4, router_jitter_noise=0.0, **_MOE),
        "mellum": lambda: _auto("mellum", **_LLAMA, head_dim=4, num_experts=4, moe_intermediate_size=16, **_MOE),
        "qwen3_next": lambda: _auto("qwen3_next", **_LLAMA, head_dim=4, linear_key_head_dim=4, linear_value_head_dim=4,
                                    num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                    **_MOE),
        "qwen3_5_moe_text": lambda: _auto("qwen3_5_moe_text", **_LLAMA, head_dim=4, linear_key_head_dim=4,
                                          linear_value_head_dim=4, num_experts=4, moe_intermediate_size=16,
                                          shared_expert_intermediate_size=16, **_MOE),
        "cohere2_moe": lambda: _auto("cohere2_moe", **_LLAMA, head_dim=4, sliding_window=3, num_experts=4,
                                     num_experts_per_tok=2, experts_implementation="eager"),
        "dots1": lambda: _auto("dots1", **_LLAMA, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16,
                               num_experts_per_tok=2, first_k_dense_replace=1, experts_implementation="eager"),
        "exaone_moe": lambda: _auto("exaone_moe", **_LLAMA, sliding_window=3, num_experts=4, moe_intermediate_size=16,
                                    num_experts_per_tok=2, experts_implementation="eager"),
        "glm4_moe": lambda: _auto("glm4_moe", **_LLAMA, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16,
                                  num_experts_per_tok=2, first_k_dense_replace=1, experts_implementation="eager"),
        "hunyuan_v1_moe": lambda: _auto("hunyuan_v1_moe", **_LLAMA, head_dim=4, num_experts=4, moe_topk=2,
                                        experts_implementation="eager"),
        "solar_open": lambda: _auto("solar_open", **_LLAMA, head_dim=4, n_routed_experts=4, n_shared_experts=1,
                                    moe_intermediate_size=16, num_experts_per_tok=2, experts_implementation="eager"),
        "ernie4_5_moe": lambda: _auto("ernie4_5_moe", **_LLAMA, moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
                                      moe_layer_start_index=1, **_MOE),
        "afmoe": lambda: _auto("afmoe", **_LLAMA, head_dim=4, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=16, num_dense_layers=1, num_shared_experts=1, sliding_window=3,
                               experts_implementation="eager"),
        "llama4_text": lambda: _auto("llama4_text", **_LLAMA, head_dim=4, num_local_experts=4, num_experts_per_tok=1,
                                     intermediate_size_mlp=32, interleave_moe_layer_step=2, attention_chunk_size=3,
                                     experts_implementation="eager"),
        # multi-head latent attention (DeepSeek-V2's), with and without experts
        "deepseek_v2": lambda: _auto("deepseek_v2", **_MHA4, moe_intermediate_size=16, n_routed_experts=4,
                                     n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                                     topk_group=1, experts_implementation="eager", **_MLA),
        "glm4_moe_lite": lambda: _auto("glm4_moe_lite", **_MHA4, moe_intermediate_size=16, n_routed_experts=4,
                                       n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                       experts_implementation="eager", **_MLA),
        "minicpm3": lambda: _auto("minicpm3", **_MHA4, **_MLA),
        "youtu": lambda: _auto("youtu", **_MHA4, **_MLA),
        # the GPT-2 lineage under other names
        "gptj": lambda: _auto("gptj", vocab_size=VOCAB, n_embd=16, n_layer=LAYERS, n_head=2, rotary_dim=4,
                              n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "codegen": lambda: _auto("codegen", vocab_size=VOCAB, n_embd=16, n_layer=LAYERS, n_head=4, rotary_dim=2,
                                 n_positions=64, n_ctx=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "gpt_neo": lambda: _auto("gpt_neo", vocab_size=VOCAB, hidden_size=16, num_layers=LAYERS, num_heads=2,
                                 attention_types=[[["global", "local"], 2]], window_size=3, max_position_embeddings=64,
                                 embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0),
        "mpt": lambda: _auto("mpt", vocab_size=VOCAB, d_model=16, n_layers=LAYERS, n_heads=2, max_seq_len=64,
                             resid_pdrop=0.0, emb_pdrop=0.0),
        "doge": lambda: _auto("doge", **_LLAMA, head_dim=4),
    }


def _auto(model_type: str, **kwargs: Any) -> Any:
    import transformers

    return transformers.AutoConfig.for_model(model_type, **kwargs)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "olmo",
            "olmo2", "gpt_neox", "opt", "falcon", "falcon_rotary", "bloom", "starcoder2", "gpt_bigcode", "cohere",
            "granite", "glm", "smollm3", "helium", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3",
            "stablelm", "nemotron", "persimmon", "olmo3", "ministral", "ministral3", "glm4", "arcee", "bitnet",
            "diffllama", "ernie4_5", "exaone4", "granite_swa", "hunyuan_v1_dense", "seed_oss", "cohere2", "vaultgemma",
            "nanochat", "cwm", "jais2", "hyperclovax", "lfm2", "qwen3_5_text", "biogpt", "qwen3_moe", "granitemoe",
            "granitemoeshared", "phimoe", "flex_olmo", "gpt_oss", "minimax", "mellum", "qwen3_next", "qwen3_5_moe_text",
            "cohere2_moe", "dots1", "exaone_moe", "glm4_moe", "hunyuan_v1_moe", "solar_open", "ernie4_5_moe", "afmoe",
            "llama4_text", "deepseek_v2", "glm4_moe_lite", "minicpm3", "youtu", "gptj", "codegen", "gpt_neo", "mpt",
            "doge"]


def family_config(name: str) -> Any:
    """The tiny config of a family (``falcon_rotary``: Falcon's rotary, new-architecture variant)."""
    return _families()[name]()


# -- what every rank runs ----------------------------------------------------------------------------
GRAD_RTOL = 1e-10  # of the largest reference gradient: float64, only the summation order differs
# Families that compute part of the model in float32 even in a float64 model: Gemma 1/2/3, VaultGemma
# and Helium their RMSNorms (x.float(), weight.float()), Cohere 1/2 (and its MoE) their LayerNorms,
# Qwen3.5 and Qwen3-Next their (gated) RMSNorms, DiffLlama its lambdas, GPT-J, CodeGen and GPT-Neo their attention
# scores, DeepSeek-V2/V3, dots1, EXAONE-MoE, GLM-4-MoE (and Lite), ERNIE-4.5-MoE, Hunyuan-MoE and
# Solar Open their routers (float32 gate weights). Their
# gradients there are sums over the batch's rows rounded in float32, which the pipeline sums per
# microbatch: they agree to float32 rounding (epsilon 1.2e-7 of the gradient, itself at most the
# largest one), the microbatching floor of one process too. Measured: up to 7e-9.
FLOAT32_RTOL = 1e-7
FLOAT32_FAMILIES = {"gemma", "gemma2", "gemma3_text", "helium", "cohere", "deepseek_v3", "vaultgemma", "cohere2",
                    "cohere2_moe", "qwen3_5_text", "qwen3_next", "diffllama", "dots1", "exaone_moe", "glm4_moe", "hunyuan_v1_moe",
                    "solar_open", "gptj", "codegen", "gpt_neo", "deepseek_v2", "glm4_moe_lite", "ernie4_5_moe"}
LOSS_RTOL = 1e-12  # the loss is float64 in the pipeline and in the reference (token_mean_loss)
ROWS_PER_MICROBATCH, SEQ = 2, 8


def one_rank_stages(name: str, schedule: Any, seed: int = 7) -> tuple[Any, Any]:
    """`causal_lm_stages` of a family's tiny config for rank 0 of `schedule`, float64 on the CPU,
    with the weights of HF's own model built from the config under `seed` (transformers 5.17
    initialises ERNIE-4.5-MoE's router only through ``from_config``). A fresh copy per call of
    what the first call for these arguments built (building takes tenths of a second a family,
    and several test modules build every family's)."""
    import copy

    import torch
    import transformers

    from zbpp.models.hf import causal_lm_stages

    key = (name, schedule.name, schedule.num_ranks, schedule.num_microbatches, seed)
    torch.manual_seed(seed)
    if key not in _ONE_RANK_BUILT:
        cfg = family_config(name)
        weights = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).state_dict()
        built = causal_lm_stages(cfg, schedule, 0, dtype=torch.float64, device="cpu", attn_implementation="eager",
                                 state_dict=weights)
        _ONE_RANK_BUILT[key] = built, torch.get_rng_state()
    built, rng = _ONE_RANK_BUILT[key]
    torch.set_rng_state(rng)  # the global generator as building left it, as on the first call
    return copy.deepcopy(built)  # stages and kwargs together: ties between them stay


_ONE_RANK_BUILT: dict[tuple, Any] = {}


def padded_batch(rows: int, seed: int = 5) -> tuple[Any, Any, Any]:
    """Right-padded rows of 6 to 8 tokens (a padded position is then at most 2 past the last real
    one, inside every tiny config's sliding window of 3: HF's own eager sliding mask gives a padded
    row no key at all further out, NaN in HF too), labels -100 on the padding and on a few prompt
    tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, SEQ), generator=g)
    lengths = torch.randint(SEQ - 2, SEQ + 1, (rows,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 1)
    labels = ids.masked_fill(mask == 0, -100)
    labels[::3, :2] = -100
    return ids, mask, labels


def _reference_loss(ref: Any, ids: Any, mask: Any, labels: Any, m: int, aux: bool) -> tuple[Any, Any]:
    """(loss, loss without the router auxiliary term) of HF's model in one process: the token mean
    over the whole batch; with the auxiliary loss, per microbatch as the pipeline weighs them:
    sum_j w_j (CE_j + coef * aux_j) / sum_j w_j, with HF's aux_loss of microbatch j's forward
    (load_balancing_loss_func over the router logits of all its layers) and w_j its predicted tokens."""
    import torch

    from .cases import token_mean_loss

    if not aux:
        loss = token_mean_loss(ref(input_ids=ids, attention_mask=mask).logits, labels)
        return loss, loss
    total = plain = 0.0
    weights = 0
    for i, a, y in zip(ids.tensor_split(m), mask.tensor_split(m), labels.tensor_split(m)):
        out = ref(input_ids=i, attention_mask=a, output_router_logits=True)
        w = int((y[:, 1:] != -100).sum())
        ce = token_mean_loss(out.logits, y)
        total = total + w * (ce + ref.router_aux_loss_coef * out.aux_loss)
        plain = plain + w * ce
        weights += w
    return total / weights, plain / weights


def family_step(family: str, name: str, count_flops: bool = False) -> dict[str, Any]:
    """One training step of `family` under schedule `name` on this rank (2 gloo ranks, 4
    microbatches of 2 padded rows), against HF's model in one process: every stage parameter's
    gradient and the loss."""
    import torch
    import torch.distributed as dist
    import transformers

    from zbpp import Pipeline
    from zbpp.models.hf import causal_lm_stages

    from .cases import make_schedule

    rank = dist.get_rank()
    m = 4
    sched = make_schedule(name, dist.get_world_size(), m)
    cfg = family_config(family)
    torch.manual_seed(1234)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64)
    stages, kwargs = causal_lm_stages(cfg, sched, rank, dtype=torch.float64, attn_implementation="eager",
                                      state_dict=ref.state_dict(), device="cpu")
    aux = kwargs["loss_fn"].router_aux is not None
    pipe = Pipeline(stages, sched, **kwargs)
    ids, mask, labels = padded_batch(ROWS_PER_MICROBATCH * m)
    counter = None
    if count_flops:
        from tests.runtime.split_cases import TaskFlops

        counter = TaskFlops()
        with counter.installed():
            loss = pipe.step({"input_ids": ids, "attention_mask": mask}, target=labels)
    else:
        loss = pipe.step({"input_ids": ids, "attention_mask": mask}, target=labels)

    ref_loss, ref_plain = _reference_loss(ref, ids, mask, labels, m, aux)
    ref_loss.backward()
    loss_err = None if loss is None else float((loss - ref_loss.detach()).abs() / ref_loss.detach().abs())
    scale = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
    worst, where = 0.0, ""
    for s, module in stages.items():
        for n, q in module.named_parameters():
            want = ref.get_parameter(n).grad
            if not ref.get_parameter(n).requires_grad:  # a frozen one (a router's balancing bias): none in both
                assert not q.requires_grad and q.grad is None and want is None, f"{family} {name}: {n}"
                continue
            assert q.grad is not None and want is not None, f"{family} {name} stage {s}: {n} got no gradient"
            err = float((q.grad - want).abs().max()) / scale
            if err > worst:
                worst, where = err, f"stage {s} {n}"
    out: dict[str, Any] = {
        "worst": worst, "where": where, "loss_err": loss_err, "aux": aux, "loss": None if loss is None else float(loss),
        "aux_share": float((ref_loss - ref_plain).detach() / ref_loss.detach()),
        "names": sorted({n for module in stages.values() for n, _ in module.named_parameters()}),
        "whole": sorted(n for n, _ in ref.named_parameters(remove_duplicate=False)),
    }
    if counter is not None:
        out["flops"] = {s: {k: counter.flops.get((s, k), 0) for k in ("B", "W", "BW")} for s in stages}
        out["full"] = {s: _stage_backward_flops(module, kwargs["loss_fn"], sched.num_stages, s, m)
                       for s, module in stages.items()}
    return out


def _stage_backward_flops(stage: Any, loss_fn: Any, num_stages: int, s: int, m: int) -> tuple[int, int]:
    """(every gradient, the stage inputs' only): FLOPs of one microbatch's backward of the stage
    alone, on a microbatch's shapes (with the router logits of the layers before it, every one
    routed, when the loss takes them)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    ids, mask, labels = (t[:ROWS_PER_MICROBATCH] for t in padded_batch(ROWS_PER_MICROBATCH * m))
    aux = loss_fn.router_aux
    out = []
    for only_input in (False, True):
        x: dict[str, Any] = {"attention_mask": mask}
        if s == 0:
            x["input_ids"] = ids
        else:
            x["hidden_states"] = torch.randn(*ids.shape, stage.config.hidden_size, dtype=torch.float64,
                                             requires_grad=True)
            if aux is not None:
                x["router_logits"] = torch.randn(stage._zbpp_stage_spec.lo, ids.numel(), aux.num_experts,
                                                 dtype=torch.float64, requires_grad=True)
        y = stage(**x)
        last = s == num_stages - 1
        roots = [loss_fn(y, labels)] if last else [y["hidden_states"]] + ([y["router_logits"]] if aux else [])
        grads = None if last else [torch.randn_like(r) for r in roots]
        inputs = [x[k] for k in ("hidden_states", "router_logits") if k in x]
        with FlopCounterMode(display=False) as fc:
            if not only_input:
                torch.autograd.backward(roots, grads)
            elif inputs:
                torch.autograd.backward(roots, grads, inputs=inputs)
        out.append(fc.get_total_flops())
    stage.zero_grad(set_to_none=True)
    return out[0], out[1]


def every_family_step(name: str, families: list[str], flops_of: list[str]) -> dict[str, Any]:
    """`family_step` for each family in turn (one spawn of workers for them all)."""
    return {f: family_step(f, name, f in flops_of) for f in families}
