"""What every rank runs in the tests of zbpp.models: tiny random Hugging Face causal LMs cut by
`zbpp.models.hf.causal_lm_stages` (and so by `zbpp.models.pipeline_stages`), trained one step under
a schedule, against one process running HF's model on the whole batch.

The reference is the HF model itself (``AutoModelForCausalLM.from_config``, float64, eager
attention), built with the same seed in every process; the stages load its ``state_dict`` (the
test of materialisation without it is `check_materialised_only_own_stages`). Two references:

- HF's own loss, ``model(input_ids, attention_mask=..., labels=...).loss``: HF computes it in float32
  (``ForCausalLMLoss`` casts the logits with ``.float()``), so the pipeline's float64 loss agrees to
  float32 rounding: ``rtol=1e-6`` (a wrong shift, a counted pad or a row-weighted mean move it by
  1e-2 or more).
- Gradients: backward of the same loss on HF's float64 logits in one process (cross entropy of the
  logits at t against ``labels[t + 1]``, ignore_index -100, mean over the tokens counted). The pipeline
  differs only in summation order (microbatches, tied copies summed across ranks), ~1e-16 relative
  per operation in float64: every parameter's gradient within ``1e-10`` of the model's largest
  gradient. A lost microbatch, an unsummed tied copy (0.4 relative in GPT-2) or a row-weighted loss
  (about 10% on a padded batch) is orders of magnitude above.
"""

from __future__ import annotations

import gc
import inspect
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zbpp import Pipeline
from zbpp.schedules import Schedule, build, options_of

GRAD_RTOL = 1e-10  # of the largest reference gradient; see the module docstring
HF_LOSS_RTOL = 1e-6  # HF's loss is float32; see the module docstring
VOCAB, SEQ = 48, 8


def modeling_utils_imported() -> bool:
    """Whether this rank has transformers' model code imported before anything here asked for it."""
    import sys

    return "transformers.modeling_utils" in sys.modules


def has_loss_weight() -> bool:
    return "loss_weight" in inspect.signature(Pipeline).parameters


def config(kind: str, layers: int) -> Any:
    import transformers

    if kind == "gpt2":  # ties its embedding and LM head by default
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=layers, n_head=2, n_positions=32,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    if kind == "llama":  # grouped-query attention, rotary embeddings, tied embedding
        return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True)
    raise ValueError(kind)


def reference_model(kind: str, layers: int, attn: str = "eager") -> nn.Module:
    import transformers

    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config(kind, layers), attn_implementation=attn,
                                                          dtype=torch.float64)
    return model


def make_schedule(name: str, p: int, m: int) -> Schedule:
    return build(name, num_ranks=p, num_microbatches=m, **({"chunks": 2} if "chunks" in options_of(name) else {}))


def batch(rows: int, padded: bool, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask and HF labels; `padded`: rows right-padded to random lengths
    (at least 2 tokens), their labels -100 past the end, and a few -100 inside (prompt tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        lengths = torch.randint(2, SEQ + 1, (rows,), generator=g)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    if padded:
        labels[::3, :2] = -100
    return ids, mask, labels


def token_mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The test's own statement of HF's causal-LM loss, in the logits' dtype."""
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)


def check_hf_step(kind: str, name: str, p: int, padded: bool = False, layers: int = 4,
                  attn: str = "eager") -> dict[str, Any]:
    """One training step of a HF model under `name` on `p` ranks (CPU under gloo, this rank's GPU
    under NCCL), against HF's model in one process on the CPU."""
    from zbpp.models.hf import causal_lm_stages

    rank = dist.get_rank()
    m = 2 * p
    sched = make_schedule(name, p, m)
    ref = reference_model(kind, layers)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    stages, kwargs = causal_lm_stages(config(kind, layers), sched, rank, dtype=torch.float64,
                                      attn_implementation=attn, state_dict=ref.state_dict(), device=device)
    if padded and "loss_weight" not in kwargs:
        raise AssertionError("causal_lm_stages did not pass loss_weight although Pipeline takes it")
    pipe = Pipeline(stages, sched, **kwargs)
    ids, mask, labels = batch(2 * m, padded)
    # padded: position_ids [1, T] shared by every row (and microbatch) as HF takes them, with gaps so
    # that rotary embeddings (relative) see them too
    pos = torch.tensor([[0, 1, 2, 4, 5, 7, 8, 11]]) if padded else None
    inputs: Any = {"input_ids": ids, "attention_mask": mask, "position_ids": pos} if padded else ids
    loss = pipe.step(inputs, target=labels)

    out = ref(input_ids=ids, attention_mask=mask if padded else None, position_ids=pos, labels=labels)
    ref_loss = token_mean_loss(out.logits, labels)
    ref_loss.backward()
    if pipe.holds_last_stage:
        torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=1e-12, atol=0)
        torch.testing.assert_close(loss.cpu(), out.loss.detach().double(), rtol=HF_LOSS_RTOL, atol=0)
    else:
        assert loss is None
    scale = max(float(q.grad.abs().max()) for q in ref.parameters())
    checked = 0
    for s, module in stages.items():
        for n, q in module.named_parameters():
            want = ref.get_parameter(n).grad
            assert q.grad is not None, f"{kind} {name} p={p} stage {s}: {n} got no gradient"
            err = float((q.grad.cpu() - want).abs().max())
            assert err <= GRAD_RTOL * scale, f"{kind} {name} p={p} stage {s}: {n} off by {err:.3g} (scale {scale:.3g})"
            checked += 1
    names = {n for module in stages.values() for n, _ in module.named_parameters()}
    return {"stages": sorted(stages), "tied": sorted(kwargs["tied_parameters"]), "checked": checked,
            "names": sorted(names), "loss": None if loss is None else float(loss)}


def _live_parameter_numel() -> int:
    """Elements of every live nn.Parameter of this process that is not on the meta device."""
    total = 0
    for o in gc.get_objects():
        if issubclass(type(o), nn.Parameter) and not o.is_meta:
            total += o.numel()
    return total


def check_materialised_only_own_stages(kind: str, name: str, p: int, layers: int) -> dict[str, int]:
    """Built from the config alone: this process gains exactly the parameters of its own stages."""
    from zbpp.models.hf import causal_lm_stages

    rank = dist.get_rank()
    sched = make_schedule(name, p, 2 * p)
    gc.collect()
    before = _live_parameter_numel()
    stages, kwargs = causal_lm_stages(config(kind, layers), sched, rank, dtype=torch.float64, device="cpu")
    gc.collect()
    gained = _live_parameter_numel() - before
    held = {id(q): q.numel() for module in stages.values() for q in module.parameters()}
    assert all(not q.is_meta for module in stages.values() for q in module.parameters())
    with torch.device("meta"):
        whole = sum(q.numel() for q in reference_model(kind, layers).parameters())
    pipe = Pipeline(stages, sched, **kwargs)  # the stages train: one step runs
    ids, _, labels = batch(2 * sched.num_microbatches, padded=False)
    pipe.step(ids, target=labels)
    return {"gained": gained, "held": sum(held.values()), "whole": whole}


def check_fast_form_under_fsdp(kind: str, name: str, steps: int = 2, lr: float = 0.5) -> int:
    """`steps` SGD steps of the fast form (compiled decoder layers, ``backend="aot_eager"``) with every
    stage ``fully_shard``-ed over 2 replicas of a 2-rank pipeline (4 ranks), each replica on half of
    the rows, against HF's model in one process on the whole batch: every gradient (gathered) within
    `GRAD_RTOL` of the largest, at every step (the second one after FSDP resharded and gathered the
    parameters again under the compiled layers). `causal_lm_stages`' tied_parameters are passed as
    they are; ``cuda_graphs="auto"`` runs eager steps. Returns how many gradients were checked."""
    from torch.distributed.fsdp import fully_shard

    from zbpp import ParallelGroups
    from zbpp.models.fast import fast_hf_stages
    from zbpp.models.hf import causal_lm_stages

    groups = ParallelGroups(pp=2)
    m = 4
    sched = make_schedule(name, 2, m)
    ref = reference_model(kind, 4)
    stages, kwargs = causal_lm_stages(config(kind, 4), sched, groups.pp_rank, dtype=torch.float64,
                                      attn_implementation="eager", state_dict=ref.state_dict(), device="cpu")
    kwargs.update(fast_hf_stages(stages, loss_fn=kwargs["loss_fn"], backend="aot_eager"))
    for stage in stages.values():
        fully_shard(stage, mesh=groups.mesh["dp"])
    kwargs["cuda_graphs"] = "auto"  # what fast_pipeline_kwargs gives on a GPU: eager steps for fully_shard stages
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pipe = Pipeline(stages, sched, groups=groups.mesh, **kwargs)
        ids, _, labels = batch(2 * 2 * m, padded=False, seed=5)
        half = slice(groups.dp_rank * 2 * m, (groups.dp_rank + 1) * 2 * m)
        pipe.step(ids[half], target=labels[half])  # the first step again below, from the same state
    views = [str(w.message) for w in seen if "returned a view tensor" in str(w.message)]
    assert not views, views  # the runtime writes no stage output in place: FSDP's warning is silenced
    for p in pipe.parameters():
        p.grad = None
    assert pipe.cuda_graphs is False
    opt = torch.optim.SGD(list(pipe.parameters()), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    checked = 0
    for step in range(steps):
        ids, _, labels = batch(2 * 2 * m, padded=False, seed=5 + step)
        half = slice(groups.dp_rank * 2 * m, (groups.dp_rank + 1) * 2 * m)
        pipe.step(ids[half], target=labels[half])
        token_mean_loss(ref(input_ids=ids).logits, labels).backward()
        scale = max(float(q.grad.abs().max()) for q in ref.parameters())
        for s, module in stages.items():
            for n, q in module.named_parameters():
                assert q.grad is not None, f"{kind} {name} step {step} stage {s}: {n} got no gradient"
                err = float((q.grad.full_tensor() - ref.get_parameter(n).grad).abs().max())
                assert err <= GRAD_RTOL * scale, f"{kind} {name} step {step} stage {s}: {n} off by {err:.3g} (scale {scale:.3g})"
                checked += 1
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    return checked
