"""Hugging Face decoder-only causal LMs as pipeline stages: Llama, Mistral, Qwen2, Qwen3 and GPT-2.

`causal_lm_stages` cuts a ``*ForCausalLM`` (built from its config on the ``meta`` device, random
weights, no download; or a model you built) into this rank's stages with `pipeline_stages`, and
returns the keyword arguments of `Pipeline` that go with them: the loss with HF's causal-LM
semantics (`CausalLMLoss`), each microbatch's weight (its count of predicted tokens) and the tied
parameters (GPT-2's embedding and LM head, or any model with ``tie_word_embeddings``).

A stage does what the model's ``forward`` does for its part: the first stage embeds the tokens
(and positions: GPT-2), every stage builds HF's causal and padding mask (sliding windows included)
for its layers with HF's own mask functions and, for the Llama family, the rotary embeddings, and
calls its decoder layers as the model does; the last stage applies the final norm and the LM head
and returns the logits. Stages pass ``{"hidden_states", "attention_mask", "position_ids"}`` along.
The step's input is ``input_ids`` or ``{"input_ids": ..., "attention_mask": ..., "position_ids":
...}`` (the last two optional, as in HF), the target is HF's ``labels`` (-100 ignored).

>>> import torch, transformers
>>> from zbpp import Pipeline
>>> from zbpp.schedules import build
>>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
...                                   num_attention_heads=2, num_key_value_heads=1)
>>> sched = build("1f1b", num_ranks=1, num_microbatches=2)
>>> stages, kwargs = causal_lm_stages(config, sched, pp_rank=0)
>>> pipe = Pipeline(stages, sched, **kwargs)
>>> ids = torch.randint(0, 32, (4, 8))
>>> loss = pipe.step({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, target=ids)
>>> bool(loss > 0)
True
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..schedules.ir import Schedule
from .hf_weights import save_pretrained
from .stages import Balance, pipeline_stages

__all__ = ["causal_lm_stages", "save_pretrained", "CausalLMLoss", "SUPPORTED"]

_LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED = (*_LLAMA_FAMILY, "gpt2")  # config.model_type values


class CausalLMLoss:
    """HF's causal-LM loss: the logits at position t predict ``labels[:, t + 1]``, labels equal to
    `ignore_index` (padding, prompts) are left out, and the loss is the mean over the tokens left
    (in float32 at least). ``weight(labels)`` is that count, for ``Pipeline(..., loss_weight=)``:
    the step's loss is then the mean over all of the batch's predicted tokens, as HF's on the whole
    batch. A microbatch without a predicted token has loss 0 and weight 0.

    >>> loss = CausalLMLoss()
    >>> labels = torch.tensor([[1, 2, -100]])
    >>> int(loss.weight(labels))   # predicts 2 from 1; -100 and the last position predict nothing
    1
    """

    def __init__(self, ignore_index: int = -100) -> None:
        self.ignore_index = int(ignore_index)

    def _shifted(self, labels: torch.Tensor) -> torch.Tensor:
        if not isinstance(labels, torch.Tensor) or labels.dim() < 1:
            raise TypeError(f"the target must be HF's labels, a [batch, seq] tensor of token ids, got {labels!r:.80}")
        return F.pad(labels, (0, 1), value=self.ignore_index)[..., 1:]

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        target = self._shifted(labels).reshape(-1).to(logits.device)
        if logits.shape[:-1].numel() != target.numel():
            raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, ignore_index=self.ignore_index,
                                reduction="sum")
        return total / (target != self.ignore_index).sum().clamp(min=1)

    def weight(self, labels: torch.Tensor) -> torch.Tensor:
        """The number of tokens the loss of these labels averages over (a 0-dim tensor)."""
        return (self._shifted(labels) != self.ignore_index).sum()


def causal_lm_stages(
    model_or_config: Any,
    schedule: Schedule,
    pp_rank: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
    module_fqns_per_stage: Sequence[Sequence[str]] | None = None,
    balance: Balance = "params",
    state_dict: Mapping[str, torch.Tensor] | None = None,
    seed: int = 0,
    ignore_index: int = -100,
) -> tuple[dict[int, nn.Module], dict[str, Any]]:
    """This rank's stages of a HF causal LM, and the `Pipeline` keyword arguments that go with them.

    Args:
        model_or_config: a local HF directory (``config.json`` and ``*.safetensors``, sharded or
            not, as ``save_pretrained`` writes it): built from its config, this rank's stages read
            their own tensors only (`zbpp.models.hf_weights`); dtype default: the checkpoint's.
            Or a ``PretrainedConfig`` of a supported model type (`SUPPORTED`): the model
            is built on the ``meta`` device and only this rank's stages get weights (random, by the
            model's own init, or `state_dict`); or a ``*ForCausalLM`` model (best on ``meta``).
        schedule, pp_rank: the schedule and this rank's pipeline rank.
        device: where the stages live (default as `pipeline_stages`).
        dtype: parameter dtype when building from a config (default: the config's, else float32).
        attn_implementation: "eager", "sdpa", ... when building from a config.
        module_fqns_per_stage, balance, state_dict, seed: as `pipeline_stages`; the blocks are
            ``model.layers`` (Llama family) or ``transformer.h`` (GPT-2).
        ignore_index: the label value the loss ignores.

    Returns ``(stages, kwargs)``: ``Pipeline(stages, schedule, **kwargs)`` with ``loss_fn``,
    ``tied_parameters`` and, when the runtime takes it, ``loss_weight`` (tokens per microbatch).
    """
    if isinstance(model_or_config, (str, os.PathLike)):  # a local HF directory: read this rank's tensors only
        model_or_config, state_dict, dtype = _pretrained(model_or_config, state_dict, device, dtype)
    model = _model(model_or_config, dtype, attn_implementation)
    kind = getattr(model.config, "model_type", None)
    if kind not in SUPPORTED:
        raise ValueError(f"{type(model).__name__} (model_type {kind!r}) is not supported: zbpp.models.hf builds "
                         f"decoder-only causal LMs of the types {list(SUPPORTED)}; cut other models with "
                         "zbpp.models.pipeline_stages and a stage forward of your own")
    gpt2 = kind == "gpt2"
    blocks = "transformer.h" if gpt2 else "model.layers"
    fqns = module_fqns_per_stage
    if fqns is not None and not gpt2:  # every stage computes its rotary embeddings
        fqns = [list(f) + ([] if "model.rotary_emb" in f else ["model.rotary_emb"]) for f in fqns]
    stages, tied = pipeline_stages(model, schedule, pp_rank, module_fqns_per_stage=fqns, blocks=blocks,
                                   balance=balance, device=device, state_dict=state_dict, seed=seed)
    last = schedule.num_stages - 1
    wrap = _GPT2Stage if gpt2 else _DecoderStage
    modules = {s: wrap(m, model.config, first=s == 0, last=s == last) for s, m in stages.items()}
    loss = CausalLMLoss(ignore_index)
    kwargs: dict[str, Any] = {"loss_fn": loss, "tied_parameters": tied}
    if _takes_loss_weight():
        kwargs["loss_weight"] = loss.weight
    return modules, kwargs


def _pretrained(path: Any, state_dict: Any, device: Any, dtype: torch.dtype | None) -> tuple[Any, Any, torch.dtype]:
    from .hf_weights import pretrained
    from .stages import _device

    if state_dict is not None:
        raise ValueError("give the weights as a directory or as state_dict=, not both")
    return pretrained(path, device=_device(device), dtype=dtype)


def _takes_loss_weight() -> bool:
    from ..runtime import Pipeline

    return "loss_weight" in inspect.signature(Pipeline).parameters


def _model(model_or_config: Any, dtype: torch.dtype | None, attn_implementation: str | None) -> nn.Module:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the [hf] extra
        raise ImportError("zbpp.models.hf needs Hugging Face transformers: pip install 'zbpp[hf]'") from exc
    if isinstance(model_or_config, transformers.PretrainedConfig):
        kw: dict[str, Any] = {}
        if attn_implementation is not None:
            kw["attn_implementation"] = attn_implementation
        if dtype is not None:
            kw["dtype"] = dtype
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(model_or_config, **kw)
    if isinstance(model_or_config, nn.Module) and hasattr(model_or_config, "config"):
        if dtype is not None or attn_implementation is not None:
            raise ValueError("dtype and attn_implementation apply when building from a config; a model you built "
                             "keeps its own")
        return model_or_config
    raise TypeError(f"expected a transformers PretrainedConfig or *ForCausalLM model, got {type(model_or_config).__name__}")


def _masks() -> tuple[Any, Any]:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    return create_causal_mask, create_sliding_window_causal_mask


class _Stage(nn.Module):
    """A stage: the pruned model's top-level modules under their own names, HF's glue in forward."""

    def __init__(self, pruned: nn.Module, config: Any, *, first: bool, last: bool) -> None:
        super().__init__()
        for name, child in pruned._modules.items():
            self._modules[name] = child
        self.config = config
        self.is_first, self.is_last = first, last

    def _mask(self, kind: str, hidden: torch.Tensor, attention_mask: Any, position_ids: torch.Tensor,
              cache: dict[str, Any]) -> Any:
        if kind not in cache:
            causal, sliding = _masks()
            fn = sliding if kind == "sliding_attention" else causal
            # positional: the cache argument is `past_key_values` in transformers 5.17, `cache` later
            cache[kind] = fn(self.config, hidden, attention_mask, None, position_ids=position_ids)
        return cache[kind]

    def _output(self, hidden: torch.Tensor, attention_mask: Any, position_ids: Any) -> Any:
        return {"hidden_states": hidden, "attention_mask": attention_mask, "position_ids": position_ids}

    @staticmethod
    def _positions(hidden: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        if position_ids is not None:
            return position_ids
        return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)

    def _check(self, input_ids: Any, hidden_states: Any) -> None:
        if self.is_first and input_ids is None:
            raise ValueError("the first stage takes input_ids: pipe.step(ids) or pipe.step({'input_ids': ids, ...})")
        if not self.is_first and hidden_states is None:
            raise ValueError("a later stage takes the previous stage's hidden_states")


class _DecoderStage(_Stage):
    """Llama family: ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``model.rotary_emb``,
    ``lm_head``."""

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None) -> Any:
        self._check(input_ids, hidden_states)
        inner = self.model
        hidden = inner.embed_tokens(input_ids) if self.is_first else hidden_states
        pos = self._positions(hidden, position_ids)
        rotary = inner.rotary_emb(hidden, pos)
        types = getattr(self.config, "layer_types", None)
        default = "sliding_attention" if getattr(self.config, "sliding_window", None) is not None else "full_attention"
        cache: dict[str, Any] = {}
        for name, layer in inner.layers._modules.items():
            kind = types[int(name)] if types else default
            out = layer(hidden, attention_mask=self._mask(kind, hidden, attention_mask, pos, cache), position_ids=pos,
                        position_embeddings=rotary)
            hidden = out[0] if isinstance(out, tuple) else out
        if self.is_last:
            return self.lm_head(inner.norm(hidden))
        return self._output(hidden, attention_mask, position_ids)


class _GPT2Stage(_Stage):
    """GPT-2: ``transformer.wte``, ``transformer.wpe``, ``transformer.drop``, ``transformer.h``,
    ``transformer.ln_f``, ``lm_head``."""

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None) -> Any:
        self._check(input_ids, hidden_states)
        inner = self.transformer
        if self.is_first:
            embeds = inner.wte(input_ids)
            pos = self._positions(embeds, position_ids)
            hidden = inner.drop(embeds + inner.wpe(pos))
        else:
            hidden = hidden_states
            pos = self._positions(hidden, position_ids)
        if attention_mask is not None and attention_mask.dim() < 4:
            attention_mask = attention_mask.view(hidden.shape[0], -1)
        mask = self._mask("full_attention", hidden, attention_mask, pos, {})
        for block in inner.h._modules.values():
            out = block(hidden, attention_mask=mask)
            hidden = out[0] if isinstance(out, tuple) else out
        if self.is_last:
            return self.lm_head(inner.ln_f(hidden))
        return self._output(hidden, attention_mask, position_ids)
