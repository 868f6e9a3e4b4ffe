"""What task graphs leave of a step's host work: a block stack's zbpp step with task graphs against
the same step captured as one CUDA graph (the limit: no host work at all), on one GPU.

The stack and the step are bench_modules' (``--suite blocks``: ``x + LayerNormMLP(x)`` blocks, a
one-rank zb-h1 `Pipeline` of F, B and W per microbatch; ``one graph`` replays F, B and W (and the loss) of every
microbatch from one graph). Each variant is timed two ways: from an idle GPU (CUDA events around
one step, the median of 10 per round: what the step's host work before its first kernel costs) and
sustained (10 steps back to back, each after ``zero_grad()``, nothing waited for in between; the
median round), the variants alternating in ``--rounds`` rounds.
``--trace DIR`` also writes a torch.profiler trace (host and GPU, gzipped chrome JSON) of two
task-graph steps, where the GPU's idle gaps and the host work during them can be read (Perfetto
opens it).

    PYTHONPATH=$PWD python3 benchmarks/task_graph_gaps.py --out task_graph_gaps.json --trace $OUT
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import bench_modules as bm  # noqa: E402 - benchmarks/, beside this script
from provenance import write_report  # noqa: E402

VARIANTS = ("zbpp bf16 task graphs", "zbpp bf16 one graph")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2048, help="rows per microbatch")
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both variants, alternating")
    ap.add_argument("--trace", type=Path, default=None, help="write a trace of two task-graph steps here")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (task graphs and the one-graph limit are CUDA graphs)")
    args.device = "cuda"
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(args.tokens, args.hidden, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
          for _ in range(args.microbatches)]
    grad = torch.randn(args.tokens, args.hidden, generator=gen, device="cuda", dtype=torch.bfloat16) / xs[0].numel()
    cases = {}
    for variant in VARIANTS:  # both built first: their steps then alternate, round by round
        blocks = bm.make_blocks(args, variant)
        step = bm.make_block_step(blocks, xs, grad, variant)
        cases[variant] = (step, _clearer(xs, blocks))
        for _ in range(6):  # warm-up: the task graphs are captured on the second step
            cases[variant][1]()
            step()
        torch.cuda.synchronize()
    idle: dict[str, list[float]] = {v: [] for v in VARIANTS}
    sustained: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant, (step, clear) in cases.items():
            for _ in range(10):
                clear()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                end.synchronize()
                idle[variant].append(start.elapsed_time(end))
            clear()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                clear()  # host work only, as in training: zero_grad(), then the step
                step()
            end.record()
            end.synchronize()
            sustained[variant].append(start.elapsed_time(end) / 10)
    results = {v: {"from_idle_ms": statistics.median(idle[v]), "sustained_ms": statistics.median(sustained[v]),
                   "sustained_rounds_ms": sustained[v]} for v in VARIANTS}
    if args.trace is not None:
        write_trace(*cases[VARIANTS[0]], args.trace)
    graphs, limit = (results[v] for v in VARIANTS)
    ratios = {k: graphs[k] / limit[k] for k in ("from_idle_ms", "sustained_ms")}
    for v in VARIANTS:
        print(f"{v:24s} from idle {results[v]['from_idle_ms']:7.2f} ms   sustained {results[v]['sustained_ms']:7.2f} ms")
    print(f"task graphs / one graph: from idle {ratios['from_idle_ms']:.3f}x, sustained {ratios['sustained_ms']:.3f}x")
    write_report({"benchmark": "task_graph_gaps", "env": bm.run_env(True), "argv": sys.argv[1:],
                  "results": results, "task_graphs_over_one_graph": ratios}, args.out)


def _clearer(xs: list[torch.Tensor], blocks: list[torch.nn.Module]):
    def clear() -> None:  # as an optimizer's zero_grad: .grad set to None
        for x in xs:
            x.grad = None
        for b in blocks:
            b.zero_grad(set_to_none=True)
    return clear


def write_trace(step, clear, folder: Path) -> None:
    """A host and GPU trace of two steps, gzipped chrome JSON."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            clear()
            torch.cuda.synchronize()
            step()
            torch.cuda.synchronize()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "task_graph_gaps_trace.json"
    prof.export_chrome_trace(str(path))
    with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)


if __name__ == "__main__":
    main()
