"""`zbpp demo`: train a small transformer on CPU ranks with a zero-bubble schedule, and check it.

The command spawns ``--ranks`` gloo processes itself (no torchrun needed). Each builds its stages
of a small causal transformer (`make_stage`; zbpp's delayed-wgrad layers when `zbpp.modules` is
there, plain torch otherwise), trains ``--steps`` Adam steps with a `Pipeline`, and trains the same
model in one process on the same batches; the report prints the loss per step, the bubble rate
of the schedule with the task times measured on the last step (simulated: on CPU processes that
share cores, wall-clock idle time says more about the cores than about the schedule; the measured
one is printed too when every rank has a core of its own) next to its ideal with equal task times, and the
largest parameter difference from the single process. If ranks fail, every rank's report goes to a file and the command ends with the
error of the rank that failed first, in a few lines (exit code 1).

The model pieces are public so that ``examples/train.py`` and ``benchmarks/bench_pipeline.py``
use the same model:

>>> import torch
>>> stages = [make_stage(s, 2, ModelConfig(), delayed=False) for s in range(2)]
>>> tokens, target = make_batch(ModelConfig(), rows=2, step=0)
>>> out = stages[1](stages[0](tokens))
>>> tuple(out.shape) == (2, ModelConfig().seq_len, ModelConfig().vocab)
True
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelConfig", "make_stage", "make_batch", "lm_loss", "run_demo", "report_failure"]


@dataclass(frozen=True)
class ModelConfig:
    """A small causal language model: `vocab` tokens, `hidden` width, `heads` attention heads,
    `blocks_per_stage` transformer blocks in each pipeline stage, sequences of `seq_len`."""

    vocab: int = 64
    hidden: int = 32
    heads: int = 4
    seq_len: int = 16
    blocks_per_stage: int = 1


def _block(cfg: ModelConfig, delayed: bool, use_zbpp: bool) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        """Pre-norm causal self-attention and MLP, each residual."""

        def __init__(self) -> None:
            super().__init__()
            h = cfg.hidden
            if use_zbpp:
                from zbpp.modules import LayerNormLinear, LayerNormMLP, Linear

                self.qkv = LayerNormLinear(h, 3 * h, delay_wgrad_compute=delayed)
                self.proj = Linear(h, h, delay_wgrad_compute=delayed)
                self.mlp = LayerNormMLP(h, 4 * h, delay_wgrad_compute=delayed)
            else:
                self.qkv = nn.Sequential(nn.LayerNorm(h), nn.Linear(h, 3 * h))
                self.proj = nn.Linear(h, h)
                self.mlp = nn.Sequential(nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, h = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, cfg.heads, h // cfg.heads).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, h))
            return x + self.mlp(x)

    return Block()


def make_stage(stage: int, num_stages: int, cfg: ModelConfig, *, delayed: bool = True, seed: int = 0,
               layers: str = "auto") -> Any:
    """Stage `stage` of `num_stages`: token and position embeddings first, then
    `cfg.blocks_per_stage` blocks, then (last stage) a norm and the vocabulary head.

    `layers`: "zbpp" (zbpp.modules, weight gradients delayed to W when `delayed`), "torch" (torch.nn;
    W is empty); "auto" is "zbpp". The values depend only on (seed, stage,
    num_stages, cfg), not on `delayed`."""
    import torch
    from torch import nn

    if layers not in ("auto", "zbpp", "torch"):
        raise ValueError(f"layers must be 'auto', 'zbpp' or 'torch', got {layers!r}")
    use_zbpp = layers in ("auto", "zbpp")

    torch.manual_seed(seed * 1009 + stage)

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.last = stage == 0, stage == num_stages - 1
            if self.first:
                self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
                self.pos = nn.Parameter(0.02 * torch.randn(cfg.seq_len, cfg.hidden))
            self.blocks = nn.ModuleList(_block(cfg, delayed, use_zbpp) for _ in range(cfg.blocks_per_stage))
            if self.last:
                self.norm = nn.LayerNorm(cfg.hidden)
                self.head = nn.Linear(cfg.hidden, cfg.vocab)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.first:
                x = self.tok(x) + self.pos[: x.shape[1]]
            for blk in self.blocks:
                x = blk(x)
            if self.last:
                x = self.head(self.norm(x))
            return x

    return Stage()


def make_batch(cfg: ModelConfig, *, rows: int, step: int, seed: int = 0, device: Any = "cpu") -> tuple[Any, Any]:
    """Token sequences and their next tokens. The data follow a rule (each token is the previous
    one plus a per-sequence stride), so the loss goes down quickly."""
    import torch

    g = torch.Generator().manual_seed(seed * 7919 + step)
    start = torch.randint(0, cfg.vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    seq = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def lm_loss(logits: Any, target: Any) -> Any:
    """Mean next-token cross entropy."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# -- the demo ---------------------------------------------------------------------------------------
ROWS_PER_MICROBATCH = 4
# each rank is a process of its own holding the whole batch twice (pipeline and one-process check):
# a mistyped --ranks or --microbatches would fork that many processes or exhaust the memory
MAX_RANKS = 64
MAX_MICROBATCHES = 4096
LR = 3e-3
TOLERANCE = 1e-4  # fp32 Adam after a few steps: summation-order noise is ~1e-6


def _rank_main(name: str, m: int, steps: int, seed: int) -> dict[str, Any]:
    """What every spawned rank runs: pipeline training, the same training in one process, compare."""
    import torch
    import torch.distributed as dist

    from zbpp import Pipeline
    from zbpp.schedules import build

    rank, p = dist.get_rank(), dist.get_world_size()
    cfg = ModelConfig()
    sched = build(name, num_ranks=p, num_microbatches=m)
    S = sched.num_stages
    mine = {s: make_stage(s, S, cfg, seed=seed) for s in sched.stages_on(rank)}
    pipe = Pipeline(mine, sched, lm_loss, record_task_times=True)
    opt = torch.optim.Adam(list(pipe.parameters()), lr=LR)
    ref = [make_stage(s, S, cfg, delayed=False, seed=seed) for s in range(S)]
    ref_opt = torch.optim.Adam([q for st in ref for q in st.parameters()], lr=LR)
    losses, ref_losses, step_times = [], [], []
    for step in range(steps):
        tokens, target = make_batch(cfg, rows=ROWS_PER_MICROBATCH * m, step=step, seed=seed)
        t0 = time.perf_counter()
        loss = pipe.step(tokens, target=target)
        opt.step()
        opt.zero_grad()
        step_times.append(time.perf_counter() - t0)
        losses.append(None if loss is None else float(loss))
        x = tokens
        for st in ref:
            x = st(x)
        ref_loss = lm_loss(x, target)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(ref_loss.detach()))
    diff = _worst([0.0] + [float((a.detach() - b.detach()).abs().max())  # a NaN kept: max(0.0, nan) is 0.0
                           for s, st in mine.items() for a, b in zip(st.parameters(), ref[s].parameters())])
    records = pipe.task_times()
    params = sum(q.numel() for q in pipe.parameters())
    return {"rank": rank, "losses": losses, "ref_losses": ref_losses, "diff": diff, "records": records,
            "params": params, "step_times": step_times, "stages": sorted(mine)}


def report_failure(err: Any, ranks: int) -> str:
    """Write every rank's report of a failed run (a `DistributedTestError`) to a file and print, on
    stderr, where it is and then, last, the first failing rank's error in a few lines. Returns the
    file's path."""
    with tempfile.NamedTemporaryFile("w", prefix="zbpp-demo-failure-", suffix=".txt", delete=False) as fh:
        fh.write(str(err) + "\n")
    print(f"zbpp demo: {len(err.failures)} of {ranks} ranks failed; every rank's report is in {fh.name}",
          file=sys.stderr)
    print(f"zbpp demo: error: rank {err.first_rank} failed first:\n{err.first_error}", file=sys.stderr)
    return fh.name


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo described in the module docstring; 0 when the check passes."""
    import os

    from zbpp.runtime.task_times import measured_bubble_rate
    from zbpp.schedules import Costs, available, build, simulate
    from zbpp.testing import DistributedTestError, run_distributed

    name = args.schedule
    if name not in available():
        raise ValueError(f"unknown schedule {name!r}; available: {', '.join(available())}")
    p, m, steps = args.ranks, args.microbatches, args.steps
    if p < 1 or m < 1 or steps < 1:
        raise ValueError(f"--ranks, --microbatches and --steps must be >= 1 (got {p}, {m}, {steps})")
    for flag, value, bound in (("--ranks", p, MAX_RANKS), ("--microbatches", m, MAX_MICROBATCHES)):
        if value > bound:
            raise ValueError(f"{flag} must be <= {bound}, got {value}: the demo spawns one CPU process per rank, "
                             "each holding the whole batch")
    sched = build(name, num_ranks=p, num_microbatches=m)
    ideal = simulate(sched).bubble_rate
    layers = "zbpp delayed-wgrad layers"
    print(f"zbpp demo: {name} on {p} CPU ranks (gloo), {sched.num_stages} stages, {m} microbatches "
          f"of {ROWS_PER_MICROBATCH} sequences, {steps} Adam steps; a small causal transformer of {layers}")
    t0 = time.perf_counter()
    try:
        # no limit on the whole run (its length grows with --steps, --ranks, --microbatches): a rank
        # that waits for its peers over the process group's timeout raises, which ends the run
        results = run_distributed(_rank_main, p, args=(name, m, steps, args.seed), backend="gloo",
                                  timeout=math.inf, pg_timeout=120)
    except DistributedTestError as err:
        report_failure(err, p)
        return 1
    wall = time.perf_counter() - t0
    last = next(r for r in results if r["losses"][0] is not None)
    print(f"{'step':>4}  {'pipeline loss':>13}  {'one-process loss':>16}")
    for i, (a, b) in enumerate(zip(last["losses"], last["ref_losses"]), 1):
        print(f"{i:>4}  {a:>13.5f}  {b:>16.5f}")
    records = results[0]["records"] or []
    params = sum(r["params"] for r in results)
    step_ms = 1e3 * sum(r["step_times"][-1] for r in results) / len(results)
    print(f"parameters {params:,}   last step {step_ms:.1f} ms   total {wall:.1f} s (spawning included)")
    costs = Costs.from_task_times(records, sched.num_stages)
    task_ms = ", ".join(f"{k} {1e3 * sum(getattr(costs, k.lower())) / sched.num_stages:.2f} ms" for k in "FBW")
    print(f"bubble rate: {simulate(sched, costs).bubble_rate:.3f} with the task times measured on the last step "
          f"(simulated; mean {task_ms}); {ideal:.3f} with equal F, B, W times (the schedule's ideal)")
    if (os.cpu_count() or 1) >= p:  # idle time on the wall clock means something only with a core per rank
        print(f"  measured on the wall clock: {measured_bubble_rate(records):.3f} (send/receive waits included)")
    ok, line = _check(results)
    print(line)
    return 0 if ok else 1


def _worst(values: Any) -> float:
    """The largest of `values`, NaN if any is (``max`` keeps whichever comes first)."""
    values = list(values)
    return math.nan if any(v != v for v in values) else max(values)


def _check(results: list[dict[str, Any]]) -> tuple[bool, str]:
    """Whether the pipeline's parameters after the steps and its reported losses (the last stage
    rank's) are the one-process run's within `TOLERANCE`, and the report line saying so."""
    diff = _worst(r["diff"] for r in results)
    last = next(r for r in results if r["losses"][0] is not None)
    loss_diff = _worst(abs(a - b) for a, b in zip(last["losses"], last["ref_losses"]))
    ok = all(x <= TOLERANCE for x in (diff, loss_diff))  # False for a NaN
    return ok, (f"check against one process running the whole model: max |param difference| = {diff:.2e}, "
                f"max |loss difference| = {loss_diff:.2e} (tolerance {TOLERANCE:g}): {'OK' if ok else 'MISMATCH'}")
