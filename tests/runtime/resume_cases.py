"""Checkpoint resume cases with a tied embedding, run on every rank of one 4-rank worker pool.

The model is a tiny float64 GPT-2 (`zbpp.models.hf.causal_lm_stages`: its token embedding and LM
head are one weight). Two layouts of the 4 ranks:

- ``V``: 2 data-parallel replicas of a zb-v pipeline of 2 ranks (rank 0 of each holds the first and
  the last stage: the embedding and the LM head are one Parameter there);
- ``V-fsdp``: the same with each stage ``fully_shard``-ed over the 2 replicas (the tie becomes one
  sharded copy per stage, kept tied by the pipeline);
- ``flat``: one 1f1b pipeline of 4 ranks (the embedding on rank 0, the LM head's copy on rank 3).

A run saves after `SAVED_AFTER` AdamW steps at one layout and resumes at the other, with another
initialisation and a fresh optimizer. The state that comes back equals the saved state exactly
(`torch.equal`: parameters, and every optimizer tensor and ``step`` of every name, the LM head's
copy included), read back as one file by DCP's own converter. The reference is one process running
HF's model on the whole batch: the parameters after all the steps agree with it to `RTOL`, not
bitwise, because a layout sums the same products in another order (microbatches, replicas, the tied
copies); a lost optimizer state moves them by ~1e-2. Same-layout resumes are bitwise
(`dropout_case`, and the torchrun restart test).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from zbpp import ParallelGroups, Pipeline
from zbpp.schedules import build

SAVED_AFTER, RESUMED = 2, 2
ROWS, SEQ, VOCAB, M = 8, 8, 32, 4
RTOL = 1e-9  # relative to the largest parameter: summation order only (float64); see the docstring
LAYOUTS = {"V": ("zb-v", 2), "V-fsdp": ("zb-v", 2), "flat": ("1f1b", 4), "looped": ("interleaved-1f1b", 2)}


def config(dropout: float = 0.0) -> Any:
    import transformers

    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=4, n_head=2, n_positions=SEQ,
                                   resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                   bos_token_id=0, eos_token_id=0)


def initial_state(seed: int) -> dict[str, torch.Tensor]:
    import transformers

    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config()).double().state_dict()


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(100 + step))


def make_optimizer(params: Any, lr: float = 0.02) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.1)


_GROUPS: dict[int, ParallelGroups] = {}


def pipeline(layout: str, state: dict[str, torch.Tensor], dropout: float = 0.0, seed: int | None = None,
             torch_seed: int | None = None) -> Pipeline:
    """`torch_seed`: every rank calls ``torch.manual_seed(torch_seed + global rank)`` just before
    building the Pipeline (with ``seed=None`` its ``torch.initial_seed()`` is the base seed)."""
    from zbpp.models.hf import causal_lm_stages

    name, pp = LAYOUTS[layout]
    if pp not in _GROUPS:  # new_group is collective: one per shape, built by every rank at once
        _GROUPS[pp] = ParallelGroups(pp=pp)
    groups = _GROUPS[pp]
    sched = build(name, num_ranks=pp, num_microbatches=M, **({"chunks": 2} if layout == "looped" else {}))
    stages, kwargs = causal_lm_stages(config(dropout), sched, groups.pp_rank, dtype=torch.float64, device="cpu",
                                      attn_implementation="eager", state_dict=state)
    if torch_seed is not None:
        torch.manual_seed(torch_seed + dist.get_rank())
    if layout.endswith("fsdp"):  # each stage sharded over the replicas: the tie becomes a sharded copy per stage
        from torch.distributed.fsdp import fully_shard

        for m in stages.values():
            fully_shard(m, mesh=groups.mesh["dp"])
        # kwargs' tied_parameters name the Parameters from before fully_shard: the pipeline finds their copies
        return Pipeline(stages, sched, groups=groups.mesh, seed=seed, **kwargs)
    return Pipeline(stages, sched, groups=groups, seed=seed, **kwargs)


def train(pipe: Pipeline, opt: torch.optim.Optimizer, steps: range) -> None:
    dp, dp_rank = pipe.topology.dp_size, pipe.topology.dp_rank
    for step in steps:
        ids = batch(step)
        rows = ids[dp_rank * ROWS // dp:(dp_rank + 1) * ROWS // dp]
        opt.zero_grad()
        pipe.step(rows, target=rows)
        opt.step()


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered (collective over its mesh), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def named_params(pipe: Pipeline) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()) for m in pipe.stage_modules.values() for n, p in m.named_parameters(remove_duplicate=False)}


@functools.cache  # every case compares with the same run: computed once per rank process
def reference(steps: int) -> dict[str, torch.Tensor]:
    """One process: HF's GPT-2, whole batch, the same AdamW (read-only: the cache hands it out again)."""
    import transformers

    model = transformers.GPT2LMHeadModel(config()).double()
    model.config._attn_implementation = "eager"
    model.load_state_dict(initial_state(0))
    opt = make_optimizer(model.parameters())
    for step in range(steps):
        ids = batch(step)
        opt.zero_grad()
        logits = model(input_ids=ids).logits  # the loss in float64 (HF's own casts to float32)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


def _compare(what: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    scale = max(float(t.abs().max()) for t in want.values())
    return [f"{what} {n}: off by {float((t - want[n]).abs().max()):.3g}" for n, t in got.items()
            if float((t - want[n]).abs().max()) > RTOL * scale]


def resume_case(path: str, saved_at: str, resumed_at: str) -> list[str]:
    """Train at `saved_at`, save, resume at `resumed_at`; see the module docstring."""
    from zbpp.runtime import load_checkpoint, save_checkpoint

    pipe = pipeline(saved_at, initial_state(0))
    opt = make_optimizer(list(pipe.parameters()))
    train(pipe, opt, range(SAVED_AFTER))
    save_checkpoint(pipe, path, opt)
    dist.barrier()

    pipe = pipeline(resumed_at, initial_state(7))
    opt = make_optimizer(list(pipe.parameters()), lr=1.0)  # the checkpoint's lr must win
    load_checkpoint(pipe, path, opt)
    fails = _exactly_saved(path, pipe, opt)
    train(pipe, opt, range(SAVED_AFTER, SAVED_AFTER + RESUMED))
    want = reference(SAVED_AFTER + RESUMED)
    fails += _compare(f"{saved_at}->{resumed_at} resumed", named_params(pipe), want)
    if resumed_at == "V-fsdp":  # HF weights out of sharded stages and 2 replicas: what from_pretrained reads
        fails += _pretrained_out(pipe, f"{path}-hf", want)
    return fails


def _pretrained_out(pipe: Pipeline, out: str, want: dict[str, torch.Tensor]) -> list[str]:
    import transformers

    from zbpp.models.hf import save_pretrained

    save_pretrained(pipe, out, max_shard_size="20KB")
    if dist.get_rank() != 0:
        return []
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    return _compare("save_pretrained", {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}, want)


def _exactly_saved(path: str, pipe: Pipeline, opt: torch.optim.Optimizer) -> list[str]:
    """Every parameter and optimizer entry of this rank equals the checkpoint's, under each name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    one = f"{path}.pt"
    if dist.get_rank() == 0:
        dcp_to_torch_save(path, one)
    dist.barrier()
    saved = torch.load(one, weights_only=False)
    fails = []
    for n, p in named_params(pipe).items():
        if not torch.equal(p, saved["model"][n]):
            fails.append(f"loaded {n} differs from the saved one")
        state = opt.state.get(pipe_param(pipe, n), {})
        want = saved["optimizer"]["state"].get(n)
        if want is None or set(state) != set(want):
            fails.append(f"{n}: optimizer state {sorted(state)}, saved {None if want is None else sorted(want)}")
            continue
        fails += [f"{n}: optimizer {k} differs from the saved one" for k in want if not torch.equal(full(state[k]), want[k])]
    if [g["lr"] for g in opt.param_groups] != [0.02] * len(opt.param_groups):
        fails.append(f"lr {[g['lr'] for g in opt.param_groups]}: not the checkpoint's 0.02")
    return fails


def pipe_param(pipe: Pipeline, name: str) -> torch.nn.Parameter:
    return next(m.get_parameter(name) for m in pipe.stage_modules.values() if name in dict(m.named_parameters(remove_duplicate=False)))


def dropout_case(path: str, per_rank_seeds: bool = False, resumed_at: str = "V") -> list[str]:
    """Dropout on, layout V: 2 steps, save, 2 more (the uninterrupted run); a new Pipeline with
    another seed loads the checkpoint and takes the same 2 steps: bit for bit the same parameters
    (its dropout masks are the uninterrupted run's only if ``rng_step`` and the seed came back).
    `per_rank_seeds`: ``seed=None`` and every rank seeds torch with its global rank, so the two
    replicas start from different ``torch.initial_seed()`` (the checkpoint holds one seed).
    `resumed_at` "looped": the same 4 stages, microbatches and replicas under interleaved 1F1B
    (stages 0 and 3 on different ranks: the tie becomes two copies): the same masks, so the
    parameters meet the uninterrupted run's to `RTOL` (summation order; another mask moves them by
    ~1e-2), not bitwise."""
    from zbpp.runtime import load_checkpoint, save_checkpoint

    seeds = ({"torch_seed": 300}, {"torch_seed": 400}) if per_rank_seeds else ({"seed": 11}, {"seed": 12})
    pipe = pipeline("V", initial_state(0), dropout=0.2, **seeds[0])
    opt = make_optimizer(list(pipe.parameters()))
    train(pipe, opt, range(SAVED_AFTER))
    save_checkpoint(pipe, path, opt)
    train(pipe, opt, range(SAVED_AFTER, SAVED_AFTER + RESUMED))
    want = {n: p.clone() for n, p in named_params(pipe).items()}

    again = pipeline(resumed_at, initial_state(7), dropout=0.2, **seeds[1])
    opt = make_optimizer(list(again.parameters()))
    load_checkpoint(again, path, opt)
    train(again, opt, range(SAVED_AFTER, SAVED_AFTER + RESUMED))
    if resumed_at != "V":  # another placement: this rank holds other stages, so every rank's parameters
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, want)  # the replicas' are equal (averaged gradients)
        want = {n: t for per in every for n, t in per.items()}
        return _compare(f"dropout V->{resumed_at} resumed", named_params(again), want)
    return [f"dropout resume: {n} differs by {float((p - want[n]).abs().max()):.3g}"
            for n, p in named_params(again).items() if not torch.equal(p, want[n])]


def untied_case(path: str) -> list[str]:
    """A checkpoint of GPT-2 without the tie (``tie_word_embeddings=False``: its LM head's weight is
    not the embedding's) loaded into the tied pipeline: the tie's copies took the values of their
    own names, so flat (a copy on rank 0, one on rank 3) and V-fsdp (FSDP's split copies of rank 0)
    held both, apart, and trained apart, while V (one Parameter under both names) kept the LM
    head's: the layouts trained differently without a word. Every rank must raise, saying the
    checkpoint's values differ (V's one Parameter: `test_checkpoint`, in one process)."""
    import transformers

    from zbpp.runtime import load_checkpoint, save_checkpoint

    cfg = config()
    cfg.tie_word_embeddings = False
    torch.manual_seed(3)
    save_checkpoint(transformers.GPT2LMHeadModel(cfg).double(), path)  # every rank the whole model: DCP writes it once
    fails = []
    for layout in ("flat", "V-fsdp"):
        pipe = pipeline(layout, initial_state(0))
        try:
            load_checkpoint(pipe, path)
        except Exception as exc:  # noqa: BLE001 - what it says is checked
            if "saved from a model without this tie?" not in str(exc):
                fails.append(f"untied->{layout}: {type(exc).__name__}: {exc}")
        else:
            fails.append(f"untied->{layout}: loaded without a word")
    return fails


def all_cases(root: str) -> dict[str, list[str]]:
    out = {}
    for case, run in [("V->flat", lambda: resume_case(f"{root}/v", "V", "flat")),
                      ("flat->V", lambda: resume_case(f"{root}/flat", "flat", "V")),
                      ("V-fsdp->flat", lambda: resume_case(f"{root}/v-fsdp", "V-fsdp", "flat")),
                      ("flat->V-fsdp", lambda: resume_case(f"{root}/flat2", "flat", "V-fsdp")),
                      ("dropout", lambda: dropout_case(f"{root}/dropout")),
                      ("dropout-rank-seeds", lambda: dropout_case(f"{root}/dropout-rank-seeds", per_rank_seeds=True)),
                      ("dropout-V->looped", lambda: dropout_case(f"{root}/dropout-looped", resumed_at="looped")),
                      ("untied", lambda: untied_case(f"{root}/untied"))]:
        try:
            out[case] = run()
        except Exception as exc:  # noqa: BLE001 - reported per case; the pool goes on
            import traceback

            out[case] = [f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}"]
    return out
