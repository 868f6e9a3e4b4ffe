"""Pretrained weights in and out across 2 gloo ranks (what each rank runs; see test_hf_weights).

A tiny random HF model is saved by HF's own ``save_pretrained`` in small shards; every rank builds
its stages from the directory (`causal_lm_stages(dir)`), takes one AdamW step and the pipeline is
written back with `zbpp.models.hf.save_pretrained`. The reference is one process doing the same step
on HF's model (float64, the loss in float64 as `CausalLMLoss` computes it)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

ROWS, SEQ, VOCAB, M = 4, 8, 48, 2
LR = 1e-2


def config(kind: str) -> Any:
    import transformers

    if kind == "gpt2":  # embedding and LM head tied
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=4, n_head=2, n_positions=SEQ,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    if kind == "llama":  # a separate LM head
        return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    if kind == "qwen2":  # tied, with attention biases
        return transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    raise ValueError(kind)


def hf_model(kind: str) -> Any:
    import transformers

    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config(kind), dtype=torch.float64, attn_implementation="eager")
    return model


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(9))


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def reference_step(model: Any) -> Any:
    """One process: HF's model, the whole batch, one AdamW step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = batch()
    loss_of(model(input_ids=ids).logits, ids).backward()
    opt.step()
    return model


def pipeline_step(src: str, out: str, schedule: str) -> dict[str, Any]:
    """On every rank: stages from `src`, one step, written to `out`. Returns the checkpoint keys this
    rank read and the names its stages hold."""
    import torch.distributed as dist

    from zbpp import Pipeline
    from zbpp.models import hf_weights
    from zbpp.models.hf import causal_lm_stages, save_pretrained
    from zbpp.schedules import build

    read: list[str] = []
    original = hf_weights.SafetensorsWeights._read

    def logged(self: Any, key: str, *rest: Any) -> torch.Tensor:
        read.append(key)
        return original(self, key, *rest)

    sched = build(schedule, num_ranks=dist.get_world_size(), num_microbatches=M)
    hf_weights.SafetensorsWeights._read = logged
    try:
        stages, kwargs = causal_lm_stages(src, sched, dist.get_rank(), device="cpu", attn_implementation="eager")
    finally:
        hf_weights.SafetensorsWeights._read = original
    dtypes = {p.dtype for m in stages.values() for p in m.parameters()}
    pipe = Pipeline(stages, sched, **kwargs)
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=LR)
    ids = batch()
    pipe.step(ids, target=ids)
    opt.step()
    save_pretrained(pipe, out, max_shard_size="8KB")
    held = sorted({n for m in stages.values() for n in m.state_dict()})
    return {"read": sorted(read), "held": held, "dtypes": sorted(str(d) for d in dtypes)}


def failing_save_case(out: str, where: str) -> str:
    """On every rank: a llama pipeline (1f1b, 2 ranks) saved with `save_pretrained` in several
    files, one rank's part failing: ``"weights"``: rank 1's safetensors write (a full disk);
    ``"config"``: rank 0's config.json (the index and config writer; permission denied). Returns
    ``"<seconds>s <type>: <message>"`` of what it raised on this rank, or ``"<seconds>s ok"``."""
    import errno
    import time

    import safetensors.torch
    import torch.distributed as dist
    import transformers

    from zbpp import Pipeline
    from zbpp.models.hf import causal_lm_stages, save_pretrained
    from zbpp.schedules import build

    rank = dist.get_rank()
    sched = build("1f1b", num_ranks=2, num_microbatches=M)
    stages, kwargs = causal_lm_stages(config("llama"), sched, rank, device="cpu")
    pipe = Pipeline(stages, sched, **kwargs)

    def full_disk(*args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def denied(*args: Any, **kw: Any) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", f"{out}/config.json")

    owner, name, broken = ((safetensors.torch, "save_file", full_disk) if where == "weights"
                           else (transformers.PretrainedConfig, "save_pretrained", denied))
    original = getattr(owner, name)
    if rank == (1 if where == "weights" else 0):
        setattr(owner, name, broken)
    start = time.monotonic()
    try:
        save_pretrained(pipe, out, max_shard_size="8KB")
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return f"{time.monotonic() - start:.1f}s {type(exc).__name__}: {exc}"
    finally:
        setattr(owner, name, original)
    return f"{time.monotonic() - start:.1f}s ok"


def failing_read_case(src: str, broken: str) -> str:
    """On every rank: a 1f1b llama pipeline of 2 ranks built from the directory `src` and then its
    `Pipeline`; on rank 1 alone, reading a tensor's data from the file `broken` fails with an I/O
    error (its header reads: only the data is damaged, as a bad disk sector or a network file
    system that drops the read). Returns ``"<seconds>s <type>: <message>"`` of what this rank
    raised, or ``"<seconds>s ok"``."""
    import errno
    import time

    import safetensors
    import torch.distributed as dist

    from zbpp import Pipeline
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    rank = dist.get_rank()
    sched = build("1f1b", num_ranks=2, num_microbatches=M)
    original = safetensors.safe_open

    class Damaged:
        """safe_open of `broken` whose tensor data cannot be read."""

        def __init__(self, path: Any, *args: Any, **kw: Any) -> None:
            self._f = original(path, *args, **kw)
            self._broken = str(path).endswith(broken)

        def __enter__(self) -> "Damaged":
            self._f.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self._f.__exit__(*exc)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._f, name)

        def get_tensor(self, key: str) -> torch.Tensor:
            if self._broken:
                raise OSError(errno.EIO, "Input/output error")
            return self._f.get_tensor(key)

    if rank == 1:
        safetensors.safe_open = Damaged
    start = time.monotonic()
    try:
        stages, kwargs = causal_lm_stages(src, sched, rank, device="cpu")
        Pipeline(stages, sched, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return f"{time.monotonic() - start:.1f}s {type(exc).__name__}: {exc}"
    finally:
        safetensors.safe_open = original
    return f"{time.monotonic() - start:.1f}s ok"
