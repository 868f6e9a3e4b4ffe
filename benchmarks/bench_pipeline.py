"""Step time of zbpp's pipeline schedules and torch.distributed.pipelining's, same model, same run.

Run under torchrun, one process per GPU (NCCL)::

    torchrun --nproc-per-node=2 benchmarks/bench_pipeline.py --out bench.json
    torchrun --nproc-per-node=2 benchmarks/bench_pipeline.py --quick --out quick.json   # CPU gloo smoke run

Every rank builds the same causal transformer (`zbpp.demo.make_stage`: embeddings, then
``--blocks-per-stage`` pre-norm attention+MLP blocks per stage, then the head) split into the stages
each schedule needs, and times ``--steps`` forward+backward steps after ``--warmup`` steps (no
optimizer: the pipeline is what is measured). zbpp schedules run with zbpp's delayed-wgrad layers
(W is a real task) and, for a like-for-like row, with torch.nn layers; torch's schedules run with
torch.nn layers (they split the backward themselves). A step's time is the slowest rank's, after
a device synchronisation; tokens/s = microbatches x rows x sequence length / step time; the ratio
is to the fastest torch.distributed.pipelining schedule. zbpp rows also give the measured bubble
rate of their last step (DESIGN.md's definition, from CUDA-event task times).

Prints a table on rank 0 and writes JSON (``--out``). A configuration that fails is reported in
its row and the run goes on (a failure during a step can still hang until the process-group
timeout, ``--timeout``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from zbpp import Pipeline
from zbpp.demo import ModelConfig, lm_loss, make_batch, make_stage
from zbpp.runtime import init_distributed, measured_bubble_rate, shutdown_and_exit
from zbpp.schedules import available, build, options_of

ZBPP_DEFAULT = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "dualpipe-v"]
ZBPP_TORCH_LAYERS = ["1f1b", "zb-h1", "zb-v"]
TORCH_DEFAULT = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
                 "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
TORCH_MULTI = {"ScheduleInterleaved1F1B": "loop", "ScheduleLoopedBFS": "loop", "ScheduleInterleavedZeroBubble": "loop",
               "ScheduleZBVZeroBubble": "v", "ScheduleDualPipeV": "v"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="zbpp vs torch.distributed.pipelining step time")
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps, gloo on CPU: a smoke run")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--blocks-per-stage", type=int, default=2, help="blocks per stage of a one-stage-per-rank schedule "
                    "(two-stage-per-rank schedules get half as many per stage, so the model is the same)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rows-per-microbatch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default bf16 on GPU, fp32 on CPU")
    ap.add_argument("--zbpp", default=",".join(ZBPP_DEFAULT), help="zbpp schedules (comma separated)")
    ap.add_argument("--torch", default=",".join(TORCH_DEFAULT), help="torch.distributed.pipelining schedules")
    ap.add_argument("--timeout", type=float, default=600.0, help="process-group timeout in seconds")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.heads, args.seq_len, args.blocks_per_stage = 32, 4, 16, 2
        args.microbatches, args.rows_per_microbatch, args.steps, args.warmup = 4, 2, 3, 1
        args.zbpp, args.torch = "1f1b,zb-h1,zb-v", "Schedule1F1B,ScheduleInterleavedZeroBubble,ScheduleZBVZeroBubble"
    return args


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        backend = init_distributed("gloo" if args.quick else None, timeout=args.timeout)
        self.rank, self.p = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.backend = backend
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if self.device.type == "cuda" else "fp32")]
        self.tokens_per_step = args.microbatches * args.rows_per_microbatch * args.seq_len

    def cfg(self, stages_per_rank: int) -> ModelConfig:
        a = self.args
        per_stage = max(1, a.blocks_per_stage // stages_per_rank)
        return ModelConfig(vocab=256, hidden=a.hidden, heads=a.heads, seq_len=a.seq_len, blocks_per_stage=per_stage)

    def stage(self, s: int, num_stages: int, cfg: ModelConfig, layers: str) -> torch.nn.Module:
        return make_stage(s, num_stages, cfg, layers=layers, delayed=True).to(device=self.device, dtype=self.dtype)

    def batch(self, cfg: ModelConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(cfg, rows=self.args.microbatches * self.args.rows_per_microbatch, step=step, device=self.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time_steps(self, cfg: ModelConfig, run_step: Callable[[torch.Tensor, torch.Tensor], None]) -> dict[str, float]:
        a = self.args
        for i in range(a.warmup):
            run_step(*self.batch(cfg, i))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(a.steps):
            x, y = self.batch(cfg, a.warmup + i)
            self.sync()
            t0 = time.perf_counter()
            run_step(x, y)
            self.sync()
            times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
        mem = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else 0.0],
                           dtype=torch.float64, device=self.device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        return {"step_ms": 1e3 * float(t), "tokens_per_s": self.tokens_per_step / float(t), "peak_mem_gib": float(mem)}

    # -- zbpp -----------------------------------------------------------------------------------
    def run_zbpp(self, name: str, layers: str) -> dict[str, Any]:
        a = self.args
        opts = {"chunks": 2} if "chunks" in options_of(name) else {}
        sched = build(name, num_ranks=self.p, num_microbatches=a.microbatches, **opts)
        cfg = self.cfg(sched.num_stages // self.p)
        mine = {s: self.stage(s, sched.num_stages, cfg, layers) for s in sched.stages_on(self.rank)}
        pipe = Pipeline(mine, sched, lm_loss, device=self.device, profile=True)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            pipe.step(x, target=y)
            for q in pipe.parameters():
                q.grad = None

        out = self.time_steps(cfg, step)
        recs = pipe.profile_records()
        out["measured_bubble"] = measured_bubble_rate(recs) if recs is not None else None
        return out

    # -- torch.distributed.pipelining -------------------------------------------------------------
    def run_torch(self, name: str) -> dict[str, Any]:
        import torch.distributed.pipelining as tpp

        a, p, r = self.args, self.p, self.rank
        kind = TORCH_MULTI.get(name)
        if kind is None:
            ids = [r]
        elif kind == "loop":
            ids = [r, r + p]
        else:
            ids = [r, 2 * p - 1 - r]
        S = p * (1 if kind is None else 2)
        cfg = self.cfg(S // p)
        stages = [tpp.PipelineStage(self.stage(s, S, cfg, "torch"), s, S, self.device) for s in ids]
        cls = getattr(tpp, name)
        schedule = cls(stages[0] if kind is None else stages, a.microbatches, loss_fn=lm_loss)
        has_first = 0 in ids
        has_last = S - 1 in ids

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            args = (x,) if has_first else ()
            kw: dict[str, Any] = {}
            if has_last:
                kw = {"target": y, "losses": []}
            schedule.step(*args, **kw)
            for st in stages:
                for q in st.submod.parameters():
                    q.grad = None

        return self.time_steps(cfg, step)

    def run_all(self) -> list[dict[str, Any]]:
        a = self.args
        rows: list[dict[str, Any]] = []
        jobs: list[tuple[str, str, str, Callable[[], dict[str, Any]]]] = []
        for name in filter(None, a.zbpp.split(",")):
            if name not in available():
                rows.append({"impl": "zbpp", "schedule": name, "layers": "-", "error": "not registered"})
                continue
            jobs.append(("zbpp", name, "zbpp", lambda n=name: self.run_zbpp(n, "zbpp")))
            if name in ZBPP_TORCH_LAYERS:
                jobs.append(("zbpp", name, "torch", lambda n=name: self.run_zbpp(n, "torch")))
        for name in filter(None, a.torch.split(",")):
            jobs.append(("torch", name, "torch", lambda n=name: self.run_torch(n)))
        for impl, name, layers, job in jobs:
            row: dict[str, Any] = {"impl": impl, "schedule": name, "layers": layers}
            try:
                row.update(job())
            except Exception as exc:  # noqa: BLE001 - one failing configuration must not end the run
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            dist.barrier()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            if self.rank == 0:
                print(f"  done {impl:5} {name:30} {layers:5} {row.get('step_ms', row.get('error'))}", flush=True)
        best = min((x["step_ms"] for x in rows if x["impl"] == "torch" and "step_ms" in x), default=None)
        for x in rows:
            if best is not None and "step_ms" in x:
                x["ratio_vs_best_torch"] = best / x["step_ms"]
        return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    rows = bench.run_all()
    if bench.rank == 0:
        dev = torch.cuda.get_device_name() if bench.device.type == "cuda" else "CPU"
        print(f"\npipeline of {bench.p} ranks on {dev} ({bench.backend}), {args.microbatches} microbatches x "
              f"{args.rows_per_microbatch} x {args.seq_len} tokens, hidden {args.hidden}, dtype {bench.dtype}, "
              f"torch {torch.__version__}")
        print(f"{'impl':<6} {'schedule':<30} {'layers':<6} {'step ms':>9} {'tokens/s':>11} {'x best torch':>12} "
              f"{'bubble':>7} {'peak GiB':>9}")
        for x in rows:
            if "error" in x:
                print(f"{x['impl']:<6} {x['schedule']:<30} {x['layers']:<6} failed: {x['error']}")
                continue
            bub = x.get("measured_bubble")
            print(f"{x['impl']:<6} {x['schedule']:<30} {x['layers']:<6} {x['step_ms']:>9.2f} {x['tokens_per_s']:>11.0f} "
                  f"{x.get('ratio_vs_best_torch', float('nan')):>12.3f} {'' if bub is None else f'{bub:.3f}':>7} "
                  f"{x['peak_mem_gib']:>9.2f}")
        print("x best torch = (fastest torch.distributed.pipelining step time) / (this step time); > 1 is faster")
        if args.out:
            meta = {"ranks": bench.p, "device": dev, "backend": bench.backend, "torch": torch.__version__,
                    "config": {k: v for k, v in vars(args).items() if k != "out"}}
            with open(args.out, "w") as fh:
                json.dump({"meta": meta, "rows": rows}, fh, indent=1)
            print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    shutdown_and_exit(main())  # barrier, destroy_process_group, then leave (see its docstring)
