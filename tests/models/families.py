"""Tiny configs of every decoder-only causal-LM family that the tests of `zbpp.models.hf` run: hidden
16, 4 layers, vocab 64, dropout off, each family's distinctive options on (sliding windows shorter
than the sequence, softcaps, logit and embedding scales, alibi, learned positions, a tied or untied
LM head, mixture-of-experts with the router auxiliary loss). Built from each family's own Config
class: nothing is downloaded."""

from __future__ import annotations

from typing import Any, Callable

VOCAB, LAYERS = 64, 4
_LLAMA = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
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
    }


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "olmo",
            "olmo2", "gpt_neox", "opt", "falcon", "falcon_rotary", "bloom", "starcoder2", "gpt_bigcode", "cohere",
            "granite", "glm", "smollm3", "helium", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3"]


def family_config(name: str) -> Any:
    """The tiny config of a family (``falcon_rotary``: Falcon's rotary, new-architecture variant)."""
    return _families()[name]()
