"""A Hugging Face Llama cut into stage modules for torch.distributed.pipelining, by hand.

torch's ``PipelineStage`` wants a module per stage whose forward takes the previous stage's tensor
and returns the next one's. `LlamaStage` is that for a ``LlamaForCausalLM``: stage 0 embeds the
token ids, every stage runs its contiguous run of decoder layers (`layer_ranges`: as even as the
layer count allows, earlier stages one more), and the last stage applies the final norm and the
LM head (its output: the logits). The modules are copies of the given model's, so every stage
split of one model trains the same weights; `stage_fqns` names the same split for
``zbpp.models.hf.causal_lm_stages(module_fqns_per_stage=...)``, so zbpp's rows cut the model
where torch's do.

>>> import torch, transformers
>>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
...                                   num_attention_heads=2, num_key_value_heads=2)
>>> config._attn_implementation = "sdpa"
>>> model = transformers.LlamaForCausalLM(config).eval()
>>> ids = torch.randint(0, 32, (2, 5))
>>> layer_ranges(3, 2)
[range(0, 2), range(2, 3)]
>>> first, last = LlamaStage(model, 0, 2), LlamaStage(model, 1, 2)
>>> torch.allclose(last(first(ids)), model(ids).logits, atol=1e-6)
True
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Decoder layers of each of `num_stages` stages: contiguous, sizes differing by at most one."""
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} decoder layers cannot give each of {num_stages} stages one; "
                         "give more layers (--layers) or fewer stages")
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stage_fqns(num_layers: int, num_stages: int) -> list[list[str]]:
    """`layer_ranges`' split as module names of a ``LlamaForCausalLM`` (embeddings on stage 0, the
    final norm and LM head on the last), for ``causal_lm_stages(module_fqns_per_stage=...)``."""
    fqns = [[f"model.layers.{i}" for i in r] for r in layer_ranges(num_layers, num_stages)]
    fqns[0].insert(0, "model.embed_tokens")
    fqns[-1] += ["model.norm", "lm_head"]
    return fqns


class LlamaStage(nn.Module):
    """Stage `stage` of `num_stages` of a ``LlamaForCausalLM`` (copies of its modules): token ids
    or hidden states in, hidden states or logits out. The attention mask is HF's own causal mask
    (``create_causal_mask``, no padding): full rows only."""

    def __init__(self, model: nn.Module, stage: int, num_stages: int) -> None:
        super().__init__()
        base = model.model
        self.config = model.config
        self.first, self.last = stage == 0, stage == num_stages - 1
        held = layer_ranges(len(base.layers), num_stages)[stage]
        self.embed_tokens = copy.deepcopy(base.embed_tokens) if self.first else None
        self.layers = nn.ModuleList(copy.deepcopy(base.layers[i]) for i in held)
        self.rotary_emb = copy.deepcopy(base.rotary_emb)
        self.norm = copy.deepcopy(base.norm) if self.last else None
        self.lm_head = copy.deepcopy(model.lm_head) if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        hidden = self.embed_tokens(x) if self.first else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # positional: transformers after 5.17 renamed the fourth parameter (past_key_values -> cache)
        mask = create_causal_mask(self.config, hidden, None, None, positions)
        rotary = self.rotary_emb(hidden, position_ids=positions)
        for layer in self.layers:
            out = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
            hidden = out[0] if isinstance(out, tuple) else out  # older transformers return a tuple
        if self.last:
            return self.lm_head(self.norm(hidden))
        return hidden
