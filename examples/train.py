"""Train a small causal transformer with a zbpp pipeline schedule under torchrun.

Every process runs this script; NCCL on GPUs (one per process), gloo on CPUs. Launch::

    # one node, 2 GPUs (NCCL), ZB-H1:
    torchrun --nproc-per-node=2 examples/train.py --schedule zb-h1 --microbatches 8 --steps 20

    # CPU only (gloo), 4 processes, ZB-V, checked against one process:
    torchrun --nproc-per-node=4 examples/train.py --schedule zb-v --check

    # small layers on 2 GPUs, every task replayed from a CUDA graph after the first step:
    torchrun --nproc-per-node=2 examples/train.py --schedule zb-v --cuda-graphs --check

    # 2 pipelines of 2 ranks (data parallel), gradients clipped to a global norm of 1:
    torchrun --nproc-per-node=4 examples/train.py --schedule zb-h1 --dp 2 --clip 1.0 --check

    # several nodes (c10d rendezvous; the same command on every node), 2 data-parallel replicas:
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 \\
        --rdzv-id=job1 examples/train.py --schedule zb-v --dp 2

    # two agents on one machine (what the tests run):
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29500 \\
        --rdzv-id=job1 examples/train.py --schedule zb-h1 --check     (twice, in two shells)

The pipeline has ``world_size / dp`` ranks (global rank = dp_rank * pp + pp_rank, see
`zbpp.ParallelGroups`). With ``--check`` every rank also trains the whole model in its own process
on the whole batch and the script fails (exit code 1) if any parameter differs by more than the
tolerance after the last step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist

from zbpp import ParallelGroups, Pipeline
from zbpp.demo import ModelConfig, lm_loss, make_batch, make_stage
from zbpp.runtime import init_distributed, measured_bubble_rate, shutdown_and_exit
from zbpp.runtime.clip import clip_grad_norm_
from zbpp.schedules import available, build, options_of

TOLERANCE = 1e-4  # fp32 Adam, a few steps: summation-order noise is ~1e-6 (TF32 is off by default)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", default="zb-h1", help=f"schedule name ({', '.join(available())})")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows-per-microbatch", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (the pipeline has world/dp ranks)")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--blocks-per-stage", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=None,
                    help="clip gradients to this global norm (whole pipeline); default: no clipping")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl with GPUs, else gloo")
    ap.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds")
    ap.add_argument("--check", action="store_true", help="compare with one process training the whole model")
    ap.add_argument("--task-times-out", default=None, help="write the last step's task records (JSON) here")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="replay the tasks from CUDA graphs after each input signature's first step (NCCL only)")
    args = ap.parse_args(argv)
    # Refused here, by name: otherwise --dp 0 ends every rank in `world % 0` and --steps 0 passes --check untrained.
    for name in ("microbatches", "steps", "rows_per_microbatch", "dp", "hidden", "seq_len", "blocks_per_stage"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.clip is not None and not args.clip > 0:  # clip_grad_norm_ to 0 zeroes every gradient: no training
        ap.error(f"--clip must be > 0 (leave it out for no clipping), got {args.clip}")
    if args.schedule not in available():  # else every rank fails with a traceback, after torch.distributed starts
        ap.error(f"unknown --schedule {args.schedule!r}; available: {', '.join(available())}")
    out = args.task_times_out  # written after the last step: a path that cannot be, refused now
    if out is not None and (os.path.isdir(out) or not os.path.isdir(os.path.dirname(os.path.abspath(out)))):
        ap.error(f"--task-times-out {out}: give a file in a folder that exists")
    heads = ModelConfig.heads
    if args.hidden % heads:
        ap.error(f"--hidden {args.hidden} must be a multiple of the {heads} attention heads")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = init_distributed(args.backend, timeout=args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    if world % args.dp:
        raise SystemExit(f"--dp {args.dp} does not divide the world size {world}")
    pp = world // args.dp
    groups = ParallelGroups(pp=pp) if args.dp > 1 else None
    pp_rank = groups.pp_rank if groups is not None else rank
    dp_rank = groups.dp_rank if groups is not None else 0
    opts = {"chunks": 2} if "chunks" in options_of(args.schedule) else {}
    sched = build(args.schedule, num_ranks=pp, num_microbatches=args.microbatches, **opts)
    cfg = ModelConfig(hidden=args.hidden, heads=ModelConfig.heads, seq_len=args.seq_len, blocks_per_stage=args.blocks_per_stage)
    S = sched.num_stages
    mine = {s: make_stage(s, S, cfg, seed=args.seed).to(device) for s in sched.stages_on(pp_rank)}
    if args.cuda_graphs and device.type != "cuda":
        raise SystemExit("--cuda-graphs needs GPUs (backend nccl)")
    pipe = Pipeline(mine, sched, lm_loss, groups=groups, record_task_times=args.task_times_out is not None,
                    cuda_graphs=args.cuda_graphs)
    opt = torch.optim.Adam(list(pipe.parameters()), lr=args.lr)
    ref = ref_opt = None
    if args.check:
        ref = [make_stage(s, S, cfg, delayed=False, seed=args.seed).to(device) for s in range(S)]
        ref_opt = torch.optim.Adam([q for st in ref for q in st.parameters()], lr=args.lr)
    rows = args.rows_per_microbatch * args.microbatches  # per replica
    if rank == 0:
        print(f"{sched.name}: pp={pp} dp={args.dp} backend={backend} stages={S} microbatches={args.microbatches} "
              f"rows/replica={rows}", flush=True)
    loss_diffs: list[float] = []  # --check: |step loss - one process's| on this rank
    for step in range(args.steps):
        tokens, target = make_batch(cfg, rows=rows * args.dp, step=step, seed=args.seed, device=device)
        part = slice(dp_rank * rows, (dp_rank + 1) * rows)
        t0 = time.perf_counter()
        loss = pipe.step(tokens[part], target=target[part])
        if loss is not None and groups is not None:  # the step's loss: the replicas' (equal) shares' mean
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=groups.dp_group)
            loss /= args.dp
        # The norm of the whole model: summed over the pipeline ranks, not again over the replicas
        # (they hold the same averaged gradients).
        norm = clip_grad_norm_(pipe, args.clip, groups) if args.clip is not None else None
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if loss is not None and dp_rank == 0:
            clipped = f"  grad norm {float(norm):.4f}" if norm is not None else ""
            print(f"step {step + 1:>3}  loss {float(loss):.5f}{clipped}  {dt * 1e3:8.1f} ms  (pipeline rank {pp_rank})",
                  flush=True)
        if ref is not None:
            x = tokens
            for st in ref:
                x = st(x)
            ref_loss = lm_loss(x, target)
            if loss is not None:  # the step's loss, as printed: the whole batch's
                loss_diffs.append(abs(float(loss) - float(ref_loss.detach())))
            ref_loss.backward()
            if args.clip is not None:
                torch.nn.utils.clip_grad_norm_([q for st in ref for q in st.parameters()], args.clip)
            ref_opt.step()
            ref_opt.zero_grad()
    if args.task_times_out:
        records = pipe.task_times()
        if records is not None and dp_rank == 0:
            with open(args.task_times_out, "w") as fh:
                json.dump({"schedule": sched.to_text(), "records": records}, fh)
            print(f"measured bubble rate {measured_bubble_rate(records):.3f}; records in {args.task_times_out}", flush=True)
    status = 0
    if ref is not None:
        diff = torch.zeros((), dtype=torch.float64, device=device)
        for s, st in mine.items():
            for a, b in zip(st.parameters(), ref[s].parameters()):
                diff = torch.maximum(diff, (a.detach() - b.detach()).abs().max().double())
        # a tensor's max, not Python's: max(0.0, nan) is 0.0, which would drop a NaN loss
        loss_diff = torch.tensor([0.0, *loss_diffs], dtype=torch.float64, device=device).max()
        diff, loss_diff = _all_max_keeping_nan(torch.stack([diff, loss_diff])).tolist()
        ok = diff <= TOLERANCE and loss_diff <= TOLERANCE  # False for a NaN
        if rank == 0:
            print(f"check: max |param difference| vs one process = {diff:.2e}, max |loss difference| = "
                  f"{loss_diff:.2e} (tolerance {TOLERANCE:g}): {'OK' if ok else 'MISMATCH'}", flush=True)
        status = 0 if ok else 1
    return status


def _all_max_keeping_nan(values: torch.Tensor) -> torch.Tensor:
    """`values`' elementwise maximum over the ranks, NaN where any rank's is NaN: gloo's MAX drops a
    NaN met as its second operand (from a rank other than 0, for a small tensor), which would pass the check."""
    n = len(values)
    both = torch.cat([values, values.isnan().to(values.dtype)])  # a flag's MAX: any rank's NaN
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return torch.where(both[n:] > 0, torch.full_like(values, math.nan), both[:n])


if __name__ == "__main__":
    shutdown_and_exit(main())  # barrier, destroy_process_group, then leave (see its docstring)
