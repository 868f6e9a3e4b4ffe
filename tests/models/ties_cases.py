"""Tied copies that drift apart (see test_hf_ties), run on every rank of 2 gloo ranks.

A tiny tied Llama in float64 under 1f1b: the embedding sits on rank 0 (stage 0), the LM head on
rank 1 (stage 1), each rank with its own copy of the tied weight. One AdamW step with weight decay:
chosen by name ("embed" excluded, a common recipe), the embedding's copy is not decayed and the
LM head's copy (named ``lm_head.weight``) is; chosen alike for both copies (the tied weight left
out of decay on every rank, as HF's one-process model, where only the embedding's name exists,
leaves it out), they stay equal. The reference is one process doing the same step on HF's model."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from .weights_cases import LR, M, batch

WEIGHT_DECAY = 0.1
VOCAB = 48


def hf_model() -> Any:
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(3)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="eager")


def adamw(named: list[tuple[str, torch.nn.Parameter]], no_decay: set[int]) -> torch.optim.AdamW:
    """AdamW with weight decay, except for the parameters in `no_decay` (ids)."""
    decay = [p for _, p in named if id(p) not in no_decay]
    rest = [p for _, p in named if id(p) in no_decay]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
                             lr=LR)


def by_name(named: list[tuple[str, torch.nn.Parameter]]) -> set[int]:
    """The recipe: no weight decay for parameters whose name contains "embed"."""
    return {id(p) for n, p in named if "embed" in n}


def reference_step() -> Any:
    """One process: HF's tied model (its weight named once, as the embedding: not decayed), one step."""
    from .weights_cases import loss_of

    model = hf_model()
    named = list(model.named_parameters())
    opt = adamw(named, by_name(named))
    ids = batch()
    loss_of(model(input_ids=ids).logits, ids).backward()
    opt.step()
    return model


def _outcome(call: Any) -> str:
    start = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return f"{time.monotonic() - start:.1f}s {type(exc).__name__}: {exc}"
    return f"{time.monotonic() - start:.1f}s ok"


def drift_case(tmp: str, recipe: str) -> dict[str, Any]:
    """One step with weight decay chosen ``"by name"`` or ``"alike"`` for the tied copies, then
    `save_checkpoint`, `Pipeline.check_ties` and `save_pretrained`. Returns each one's outcome, the
    files the checkpoint directory holds after save_checkpoint, and the tied weight before the step."""
    from zbpp import Pipeline
    from zbpp.models.hf import causal_lm_stages, save_pretrained
    from zbpp.runtime import save_checkpoint
    from zbpp.schedules import build

    rank = dist.get_rank()
    model = hf_model()
    before = model.get_input_embeddings().weight.detach().clone()
    sched = build("1f1b", num_ranks=2, num_microbatches=M)
    stages, kwargs = causal_lm_stages(model.config, sched, rank, device="cpu", dtype=torch.float64,
                                      attn_implementation="eager", state_dict=model.state_dict())
    pipe = Pipeline(stages, sched, **kwargs)
    named = [(n, p) for m in stages.values() for n, p in m.named_parameters()]
    tied = {id(p) for p in kwargs["tied_parameters"].values()}
    opt = adamw(named, by_name(named) if recipe == "by name" else by_name(named) | tied)
    ids = batch()
    pipe.step(ids, target=ids)
    opt.step()
    ckpt = os.path.join(tmp, "ckpt")
    out = {"save_checkpoint": _outcome(lambda: save_checkpoint(pipe, ckpt, opt))}
    dist.barrier()
    out["files"] = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
    out["check_ties"] = _outcome(lambda: pipe.check_ties())
    out["save_pretrained"] = _outcome(lambda: save_pretrained(pipe, os.path.join(tmp, "hf")))
    out["before"] = before
    return out
