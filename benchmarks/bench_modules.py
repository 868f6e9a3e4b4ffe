"""zbpp.modules speed: FP8 against bf16, and the cost of delaying the weight gradient.

A stack of ``--layers`` zbpp ``Linear(hidden, hidden)`` layers (bf16 parameters, bias on) runs one
training step per measurement, ``--tokens`` rows of input that requires grad (as in a pipeline
stage, so every layer also computes its input gradient) and a fixed random output gradient
(``--grad randn``; ``--grad ones`` feeds the gradient of ``mean()``, whose rows are all alike in
every layer: see ``output_gradient`` for why that flatters bf16 on a power-capped GPU):

- ``bf16 eager``        forward + backward (weight gradients inside the backward)
- ``fp8 eager``         the same inside ``fp8_autocast`` (HYBRID, delayed scaling; the weights are
                        cast afresh every step, as they are after every optimizer step; the default
                        recipe: fast accumulation in the forward GEMM, float32 in the gradients)
- ``fp8 f32-acc eager`` the same with ``fprop_fast_accumulation=False`` (float32 everywhere)
- ``fp8 weights kept``  ``fp8 eager`` as the second to last microbatch between two optimizer
                        steps run it: ``is_first_microbatch=False``, the weights' FP8 casts kept
                        from the first microbatch, so only x and dy are cast
- ``bf16 delayed B+W``  forward, backward with ``delay_wgrad_compute=True`` (B), then
                        ``backward_dw()`` of every layer (W)
- ``fp8 delayed B+W``   the same in FP8

Each step is timed with CUDA events (``time.perf_counter`` on CPU) from an idle GPU; the cases are
interleaved over ``--rounds`` rounds and the median is reported, with TFLOP/s (6 T h^2 per layer)
and two ratios: FP8 speedup (bf16 eager / fp8 eager; target >= 1.6 at hidden 8192) and delay
overhead (delayed B+W / eager - 1; target within 3%), each also from the sustained rates.

``sustained ms`` is the rate of a training loop that never waits: about ``--sustain`` seconds of
steps back to back per case and round (an event after every 5 steps, one synchronisation at the
end; the median batch of the second half). It differs from the single step where the GPU runs
into its power limit: an H200 draws its 700 W cap within milliseconds of back-to-back GEMMs and
lowers its clocks, by how much depends on the data. The FP8 GEMM path counts say whether
``torch._scaled_mm`` ran; the ``cast`` column says which FP8 cast path ran in each case (``triton``,
``compile`` or ``eager``: ``ZBPP_FP8_CAST`` chooses, see ``zbpp.modules.fp8``).

The ``host ms`` column is the host's time to issue one step (measured behind a sleeping GPU): while
it stays well under the step time, the GPU, not Python, sets the pace.

A second table times one FP8 cast of a ``--tokens`` x ``--hidden`` bf16 tensor with its transpose
(``quantize(..., transpose=True)``: cast, transpose, amax and scale update) through each cast path:
the GPU's time per cast (20 casts enqueued behind a sleeping GPU, so the host's launch rate is not
what is timed), the bandwidth it reaches (2 bytes read, 2 written per element), the same cast with
the column sums the backward takes the bias gradient from (``quantize_and_column_sum``), the host's
time to issue one cast, and the path that really ran.

On the GPU machine (one H200)::

    PYTHONPATH=$PWD python3 benchmarks/bench_modules.py --out $OUT/bench_modules.json

CPU smoke run (small sizes, seconds)::

    python benchmarks/bench_modules.py --quick --out /tmp/bench_modules.json

``--suite blocks``: a stack of ``--blocks`` pre-norm residual MLP blocks, ``x + mlp(x)`` with
``mlp = fc2(gelu(fc1(LayerNorm(x))))`` (hidden ``--hidden``, ffn ``--ffn``, bf16 parameters),
trained on ``--microbatches`` microbatches of ``--tokens`` rows per step, each microbatch's
forward then full backward (input gradients too, as in a pipeline stage; gradients accumulate
over the step; no pipeline, no optimizer), in these variants:

- ``torch.nn``              nn.LayerNorm, nn.Linear, F.gelu (tanh), nn.Linear: the reference
- ``zbpp bf16``             zbpp ``LayerNormMLP``, weight gradients in the backward
- ``zbpp bf16 delayed``     the same with ``delay_wgrad_compute=True``: B, then ``backward_dw``
                            of every block (W) after each microbatch's B
- ``zbpp fp8``, ``zbpp fp8 delayed``  the same inside ``fp8_autocast`` (HYBRID, delayed scaling,
                            the default recipe), ``is_first_microbatch`` True on the first
                            microbatch and False on the others (the weights' casts kept)
- ``zbpp fp8 unfused``      ``zbpp fp8`` with ``ZBPP_FP8_FUSE=0``: norm, GELU and its gradient
                            written in bf16 and cast separately (what the fusions save)

A step is timed with CUDA events from an idle GPU (median over ``--iters`` steps in each of
``--rounds`` interleaved rounds). ``host ms/mb`` is the host's time to issue one microbatch
(forward, backward, W) behind a sleeping GPU: when it approaches the GPU's time per microbatch,
Python sets the pace (the launch-bound regime of small blocks). One step of each variant is then
profiled (torch.profiler) and its GPU kernels are summed by kind: GEMMs, casts (the FP8 cast and
scale-update kernels), norm (LayerNorm kernels and the fused norm+cast ones), activation (GELU,
its gradient, and the fused activation+cast ones), other (residual adds, bias sums, copies).

Targets (issue 16, H200): hidden 4096, ffn 16384, 4096 tokens, 16 blocks, 8 microbatches:
``zbpp bf16`` / ``zbpp fp8`` >= 1.65; hidden 1024, ffn 4096, 2048 tokens, 32 blocks:
``zbpp bf16 delayed`` within 10% of ``torch.nn``::

    PYTHONPATH=$PWD python3 benchmarks/bench_modules.py --suite blocks --hidden 4096 \
        --ffn 16384 --tokens 4096 --blocks 16 --out $OUT/bench_modules_blocks_4096.json
    PYTHONPATH=$PWD python3 benchmarks/bench_modules.py --suite blocks --hidden 1024 \
        --ffn 4096 --tokens 2048 --blocks 32 --out $OUT/bench_modules_blocks_1024.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from zbpp.modules import DelayedScaling, LayerNormMLP, Linear, microbatch  # noqa: E402
from zbpp.modules import fp8_autocast  # noqa: E402
from zbpp.modules import _fused  # noqa: E402
from zbpp.modules import fp8 as fp8mod  # noqa: E402
from zbpp.modules.fp8 import ScalingMeta, quantize, quantize_and_column_sum  # noqa: E402

from provenance import code_identity, write_report  # noqa: E402 - benchmarks/provenance.py, beside this script
from quick import apply_quick  # noqa: E402

CASES = (
    "bf16 eager",
    "fp8 eager",
    "fp8 f32-acc eager",
    "fp8 weights kept",
    "bf16 delayed B+W",
    "fp8 delayed B+W",
)


BLOCK_VARIANTS = (
    "torch.nn",
    "zbpp bf16",
    "zbpp bf16 delayed",
    "zbpp bf16 pipeline",
    "zbpp bf16 task graphs",
    "zbpp bf16 one graph",
    "zbpp bf16 auto graphs",
    "torch.nn task graphs",
    "zbpp fp8",
    "zbpp fp8 delayed",
    "zbpp fp8 unfused",
)


def run_env(cuda: bool) -> dict:
    """Where a run happened: torch, the device, Python, the UTC time, the code and the zbpp
    environment variables that change which kernels run (every suite's JSON)."""
    return {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "python": platform.python_version(),
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **code_identity(),
        "zbpp_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("ZBPP_")},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", choices=("linear", "blocks", "pipeline"),
                    default="linear",
                    help="linear: the Linear stack and the casts; blocks: residual MLP blocks; "
                    "pipeline: the blocks split over the ranks of --schedule (torchrun)")
    ap.add_argument("--schedule", default="zb-v", help="pipeline: the zbpp schedule")
    ap.add_argument("--hidden", type=int, default=None, help="default 8192 (linear), 4096")
    ap.add_argument("--tokens", type=int, default=None,
                    help="rows per step (linear, default 8192) or per microbatch (blocks, 4096)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=None, help="blocks: ffn width (default 4 x hidden)")
    ap.add_argument("--blocks", type=int, default=16, help="blocks: how many")
    ap.add_argument("--microbatches", type=int, default=8, help="blocks: microbatches per step")
    ap.add_argument("--variants", default=",".join(BLOCK_VARIANTS),
                    help="blocks: which variants (comma separated)")
    ap.add_argument("--no-kernel-profile", action="store_true", help="blocks: skip the kernel breakdown")
    ap.add_argument("--iters", type=int, default=None,
                    help="timed steps per case and round (default 10; blocks 5)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps per case and round (default 3; blocks 2)")
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (linear), 2 (blocks)")
    ap.add_argument(
        "--sustain", type=float, default=1.0,
        help="seconds of back-to-back steps per case and round for the sustained rate (0: skip)",
    )
    ap.add_argument(
        "--grad", choices=("randn", "ones"), default="randn",
        help="the output gradient fed to the last layer (see output_gradient)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true",
                    help="tiny CPU-sized smoke run; options given explicitly keep their values")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    blocks = args.suite != "linear"
    defaults = dict(hidden=4096 if blocks else 8192, tokens=4096 if blocks else 8192,
                    iters=5 if blocks else 10, warmup=2 if blocks else 3, rounds=2 if blocks else 3)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    # small sizes: torch's CPU FP8 GEMM can be very slow
    apply_quick(ap, args, argv, hidden=64, tokens=64, layers=2, iters=3, warmup=1, rounds=2, sustain=0.1,
                **(dict(microbatches=2, blocks=4 if args.suite == "pipeline" else 3) if blocks else {}))
    if args.ffn is None:
        args.ffn = 4 * args.hidden
    unknown = set(args.variants.split(",")) - set(BLOCK_VARIANTS)
    if unknown:
        ap.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(BLOCK_VARIANTS)}")
    return args


def make_stack(args: argparse.Namespace, *, delay: bool) -> list[Linear]:
    torch.manual_seed(0)
    return [
        Linear(
            args.hidden,
            args.hidden,
            delay_wgrad_compute=delay,
            params_dtype=torch.bfloat16,
            device=args.device,
        )
        for _ in range(args.layers)
    ]


def output_gradient(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The fixed gradient every step feeds the last layer (no loss kernel in the timing).

    ``randn``: normal values, scaled as the gradient of a mean; full rank, like a real loss
    gradient. ``ones``: the gradient of ``mean()`` itself, the same in every element; then every
    layer's output gradient has identical rows (rank one), and a power-capped GPU runs GEMMs on
    such operands at higher clocks than on real data, bf16 ones far more than FP8 ones.
    """
    if kind == "ones":
        return torch.ones_like(x) / x.numel()
    gen = torch.Generator(device=x.device).manual_seed(1)
    return torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype) / x.numel()


def make_step(
    stack: list[Linear],
    x: torch.Tensor,
    grad: torch.Tensor,
    *,
    fp8: bool,
    fast_fprop: bool = True,
    first_microbatch: bool | None = None,
) -> Callable[[], None]:
    recipe = DelayedScaling(amax_history_len=16, fprop_fast_accumulation=fast_fprop)
    delayed = stack[0].delay_wgrad_compute

    def step() -> None:
        h = x
        with fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            for layer in stack:
                h = layer(h, is_first_microbatch=first_microbatch)
        h.backward(grad)
        if delayed:
            for layer in reversed(stack):  # W in the order a pipeline stage would run it
                layer.backward_dw()

    return step


# Long enough for the host to enqueue a whole step or 20 casts behind it (cycles at <= 2 GHz).
GPU_HEAD_START_CYCLES = 40_000_000


class Timer:
    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def __call__(self, fn: Callable[[], None], *, gpu_only: bool = False) -> float:
        """Milliseconds of one call of `fn`, from an idle GPU: what one step costs.

        `gpu_only`: the GPU's time alone. The GPU first sleeps (~20 ms) while the host enqueues
        all of `fn`, so host latency between launches is not timed (a loop of small kernels is
        otherwise timed at the host's launch rate).
        """
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if gpu_only:
                torch.cuda._sleep(GPU_HEAD_START_CYCLES)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)

    def host(self, fn: Callable[[], None]) -> float:
        """Milliseconds the host spends issuing `fn` (on CUDA behind a sleeping GPU, so that no
        call waits for the GPU)."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(GPU_HEAD_START_CYCLES)
        t = time.perf_counter()
        fn()
        ms = 1e3 * (time.perf_counter() - t)
        if self.cuda:
            torch.cuda.synchronize()
        return ms

    def sustained(self, fn: Callable[[], None], calls: int, batch: int = 5) -> float:
        """Milliseconds per call of `fn` over `calls` calls back to back, never waiting for the
        GPU in between: the median over batches of `batch` calls in the second half (the first
        half lets the clocks settle). On CUDA an event is recorded after every batch and the
        host synchronises once, at the end."""
        batches = max(2, -(-calls // batch))
        if not self.cuda:
            per_call = []
            for _ in range(batches):
                t = time.perf_counter()
                for _ in range(batch):
                    fn()
                per_call.append(1e3 * (time.perf_counter() - t) / batch)
        else:
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(batches + 1)]
            marks[0].record()
            for mark in marks[1:]:
                for _ in range(batch):
                    fn()
                mark.record()
            marks[-1].synchronize()
            per_call = [a.elapsed_time(b) / batch for a, b in zip(marks, marks[1:])]
        return statistics.median(per_call[len(per_call) // 2 :])


def run(args: argparse.Namespace) -> dict:
    x = torch.randn(args.tokens, args.hidden, device=args.device, dtype=torch.bfloat16)
    x.requires_grad_(True)
    stacks = {False: make_stack(args, delay=False), True: make_stack(args, delay=True)}
    grad = output_gradient(x, args.grad)
    steps = {
        case: make_step(
            stacks["delayed" in case],
            x,
            grad,
            fp8=case.startswith("fp8"),
            fast_fprop="f32" not in case,
            first_microbatch=False if "kept" in case else None,  # the first step casts and keeps
        )
        for case in CASES
    }
    timer = Timer(args.device)
    times: dict[str, list[float]] = {case: [] for case in CASES}
    host: dict[str, list[float]] = {case: [] for case in CASES}
    sustained: dict[str, list[float]] = {case: [] for case in CASES}
    cast_paths: dict[str, Counter[str]] = {case: Counter() for case in CASES}
    fp8mod.reset_gemm_path_counts()

    def clear() -> None:
        x.grad = None
        for stack in stacks.values():
            for layer in stack:
                layer.zero_grad(set_to_none=True)

    for _ in range(args.rounds):
        for case, step in steps.items():
            before = fp8mod.cast_path_counts()
            for i in range(args.warmup + args.iters):
                clear()
                ms = timer(step)
                if i >= args.warmup:
                    times[case].append(ms)
            clear()
            host[case].append(timer.host(step))
            if args.sustain > 0:

                def cleared_step(step: Callable[[], None] = step) -> None:
                    clear()
                    step()

                calls = round(1e3 * args.sustain / statistics.median(times[case][-args.iters :]))
                sustained[case].append(timer.sustained(cleared_step, calls))
            after = fp8mod.cast_path_counts()
            for path in fp8mod.CAST_PATHS:
                cast_paths[case][path] += after[path] - before[path]
    flop = 6 * args.tokens * args.hidden**2 * args.layers
    results = []
    for case in CASES:
        med = statistics.median(times[case])
        results.append(
            {
                "case": case,
                "median_ms": med,
                "min_ms": min(times[case]),
                "max_ms": max(times[case]),
                "tflops": flop / med / 1e9,
                "host_ms": statistics.median(host[case]),
                "sustained_ms": statistics.median(sustained[case]) if sustained[case] else None,
                "sustained_samples_ms": [round(t, 4) for t in sustained[case]],
                "samples": len(times[case]),
                "samples_ms": [round(t, 4) for t in times[case]],  # in the order they ran
                "cast": "+".join(p for p in fp8mod.CAST_PATHS if cast_paths[case][p]) or "-",
            }
        )
    by = {r["case"]: r["median_ms"] for r in results}
    held = {r["case"]: r["sustained_ms"] for r in results}
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
        "ratios": {
            "fp8_speedup": by["bf16 eager"] / by["fp8 eager"],
            "fp8_f32_acc_speedup": by["bf16 eager"] / by["fp8 f32-acc eager"],
            "fp8_speedup_sustained": (
                held["bf16 eager"] / held["fp8 eager"] if held["fp8 eager"] else None
            ),
            "fp8_weights_kept_speedup": by["bf16 eager"] / by["fp8 weights kept"],
            "fp8_weights_kept_speedup_sustained": (
                held["bf16 eager"] / held["fp8 weights kept"] if held["fp8 weights kept"] else None
            ),
            "delay_overhead_bf16": by["bf16 delayed B+W"] / by["bf16 eager"] - 1,
            "delay_overhead_fp8": by["fp8 delayed B+W"] / by["fp8 eager"] - 1,
            # single steps from an idle GPU vary by a few percent with its power state; the
            # sustained rates are the steadier comparison
            "delay_overhead_bf16_sustained": (
                held["bf16 delayed B+W"] / held["bf16 eager"] - 1 if held["bf16 eager"] else None
            ),
            "delay_overhead_fp8_sustained": (
                held["fp8 delayed B+W"] / held["fp8 eager"] - 1 if held["fp8 eager"] else None
            ),
        },
        "fp8_gemm_paths": fp8mod.gemm_path_counts(),
        "fp8_cast_paths": fp8mod.cast_path_counts(),
        "casts": time_casts(args, timer),
        "env": run_env(args.device.startswith("cuda")),
    }


CASTS_PER_SAMPLE = 20


def time_casts(args: argparse.Namespace, timer: Timer) -> list[dict]:
    """One FP8 cast (+ transpose, amax, scale update) of a tokens x hidden bf16 tensor per path."""
    x = torch.randn(args.tokens, args.hidden, device=args.device, dtype=torch.bfloat16)
    recipe = DelayedScaling(amax_history_len=16)
    moved = x.numel() * (x.element_size() + 2)  # read x; write data and data_t (1 byte each)
    saved = os.environ.get(fp8mod.CAST_ENV)
    rows = []
    try:
        for path in fp8mod.CAST_PATHS:
            os.environ[fp8mod.CAST_ENV] = path
            meta = ScalingMeta(recipe.fwd_dtype, history_len=16, device=args.device)
            before = fp8mod.cast_path_counts()
            samples, with_sums, host = [], [], []

            def casts() -> None:
                for _ in range(CASTS_PER_SAMPLE):
                    quantize(x, meta, recipe, transpose=True)

            def casts_and_sums() -> None:  # as the backward casts dy, with the bias gradient
                for _ in range(CASTS_PER_SAMPLE):
                    quantize_and_column_sum(x, meta, recipe, transpose=True)

            for i in range(args.warmup + args.iters):
                ms = timer(casts, gpu_only=True) / CASTS_PER_SAMPLE
                ms_sums = timer(casts_and_sums, gpu_only=True) / CASTS_PER_SAMPLE
                if i >= args.warmup:
                    samples.append(ms)
                    with_sums.append(ms_sums)
                    host.append(timer.host(casts) / CASTS_PER_SAMPLE)
            after = fp8mod.cast_path_counts()
            ran = [p for p in (*fp8mod.CAST_PATHS, "update_triton", "update_eager")
                   if after[p] > before[p]]
            med = statistics.median(samples)
            rows.append({"path": path, "ran": "+".join(ran), "median_us": 1e3 * med,
                         "gbps": moved / (med * 1e-3) / 1e9,
                         "with_column_sums_us": 1e3 * statistics.median(with_sums),
                         "host_us": 1e3 * statistics.median(host)})
    finally:
        if saved is None:
            os.environ.pop(fp8mod.CAST_ENV, None)
        else:
            os.environ[fp8mod.CAST_ENV] = saved
    return rows


def print_table(report: dict) -> None:
    cfg = report["config"]
    print(
        f"Linear stack: {cfg['layers']} x Linear({cfg['hidden']}, {cfg['hidden']}), "
        f"{cfg['tokens']} tokens, bf16 params, output gradient {cfg['grad']}, "
        f"on {report['env']['device']}"
    )
    print(
        f"{'case':<18} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'TFLOP/s':>9} "
        f"{'host ms':>8} {'sustained ms':>13}  cast"
    )
    for r in report["results"]:
        print(
            f"{r['case']:<18} {r['median_ms']:>10.3f} {r['min_ms']:>9.3f} {r['max_ms']:>9.3f} "
            f"{r['tflops']:>9.1f} {r['host_ms']:>8.2f} "
            f"{r['sustained_ms'] if r['sustained_ms'] is not None else float('nan'):>13.3f}"
            f"  {r['cast']}"
        )
    q = report["ratios"]
    print(
        f"FP8 speedup (bf16 eager / fp8 eager): {q['fp8_speedup']:.2f}x  (target >= 1.6x); "
        f"with float32 accumulation in the forward too: {q['fp8_f32_acc_speedup']:.2f}x"
    )
    if q["fp8_speedup_sustained"] is not None:
        print(f"FP8 speedup, sustained (steps back to back): {q['fp8_speedup_sustained']:.2f}x")
    kept = q["fp8_weights_kept_speedup_sustained"]
    print(
        f"FP8 speedup of a later microbatch (weights' casts kept): "
        f"{q['fp8_weights_kept_speedup']:.2f}x"
        + (f", sustained {kept:.2f}x" if kept is not None else "")
    )
    print(
        f"delay overhead (delayed B+W / eager - 1): bf16 {100 * q['delay_overhead_bf16']:+.1f}%, "
        f"fp8 {100 * q['delay_overhead_fp8']:+.1f}%  (target within 3%)"
    )
    if q["delay_overhead_fp8_sustained"] is not None:
        print(
            f"delay overhead, sustained: bf16 {100 * q['delay_overhead_bf16_sustained']:+.1f}%, "
            f"fp8 {100 * q['delay_overhead_fp8_sustained']:+.1f}%"
        )
    print(f"FP8 GEMM paths: {report['fp8_gemm_paths']}")
    print(f"FP8 cast paths: {report['fp8_cast_paths']}")
    print(
        f"one FP8 cast of {cfg['tokens']} x {cfg['hidden']} bf16 (+ transpose, amax, update):"
    )
    print(
        f"  {'ZBPP_FP8_CAST':<14} {'device us':>10} {'GB/s':>8} {'+ sums us':>10} "
        f"{'host us':>8}  ran"
    )
    for c in report["casts"]:
        print(
            f"  {c['path']:<14} {c['median_us']:>10.1f} {c['gbps']:>8.1f} "
            f"{c['with_column_sums_us']:>10.1f} {c['host_us']:>8.1f}  {c['ran']}"
        )


# -- block stacks --------------------------------------------------------------------------------


class TorchMLP(nn.Module):
    """The torch.nn reference of LayerNormMLP(activation="gelu"): the same computation."""

    def __init__(self, hidden: int, ffn: int, **kw) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden, **kw)
        self.fc1 = nn.Linear(hidden, ffn, **kw)
        self.fc2 = nn.Linear(ffn, hidden, **kw)

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


class Residual(nn.Module):
    """``x + mlp(x)``: a pre-norm block."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        return x + self.mlp(x, is_first_microbatch=is_first_microbatch)


def make_blocks(args: argparse.Namespace, variant: str) -> list[Residual]:
    torch.manual_seed(0)
    kw = dict(device=args.device)
    if variant.startswith("torch.nn"):
        return [Residual(TorchMLP(args.hidden, args.ffn, dtype=torch.bfloat16, **kw))
                for _ in range(args.blocks)]
    delayed = any(word in variant for word in ("delayed", "pipeline", "graph"))
    return [Residual(LayerNormMLP(args.hidden, args.ffn, params_dtype=torch.bfloat16,
                                  delay_wgrad_compute=delayed, **kw))
            for _ in range(args.blocks)]


def make_block_step(
    blocks: list[Residual], xs: list[torch.Tensor], grad: torch.Tensor, variant: str
) -> Callable[[], None]:
    """One training step: every microbatch's forward and backward (and W when delayed); the
    ``pipeline`` and ``task graphs`` variants run it as a one-rank zb-h1 `Pipeline` (F, B, W per
    microbatch; ``task graphs``: with ``cuda_graphs=True``, ``auto graphs``: ``"auto"``), with the
    loss ``sum(out * grad)``; ``one graph`` captures the whole step (the same loss) as one CUDA graph."""
    if "pipeline" in variant or "task graphs" in variant or "auto graphs" in variant:
        graphs = "auto" if "auto graphs" in variant else "task graphs" in variant
        return make_pipeline_step(blocks, xs, grad, cuda_graphs=graphs)
    if "one graph" in variant:  # the pipeline's step: its loss included
        return make_one_graph_step(make_block_step(blocks, xs, grad, "zbpp bf16 delayed with loss"), blocks, xs)
    fp8 = "fp8" in variant
    delayed = "delayed" in variant
    recipe = DelayedScaling(amax_history_len=16)
    losses: dict[int, torch.Tensor] = {}  # each microbatch's loss, kept as the pipeline keeps it

    def microbatch_step(j: int, x: torch.Tensor) -> None:
        with microbatch(j), fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            h = x
            for block in blocks:
                h = block(h, is_first_microbatch=(j == 0) if fp8 else None)
        if "with loss" in variant:  # as the pipeline variants: their loss, kept, weighted by the microbatch's share
            loss = (h * grad).sum()
            losses[j] = loss.detach().clone()
            (loss * (1 / len(xs))).backward()
        else:
            h.backward(grad)
        if delayed:
            for block in reversed(blocks):  # W in the order a pipeline stage runs it
                block.mlp.backward_dw(j)

    def step() -> None:
        for j, x in enumerate(xs):
            microbatch_step(j, x)

    step.microbatch = microbatch_step  # type: ignore[attr-defined]
    return step


def make_one_graph_step(eager: Callable[[], None], blocks: list[Residual], xs: list[torch.Tensor]) -> Callable[[], None]:
    """The limit of the task graphs: the same F, B, W of every microbatch captured as ONE CUDA graph
    (no host work per task at all; no pipeline could run it, as nothing else may happen in between)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up as torch.cuda.graph asks: kernels chosen, grads allocated
        for _ in range(2):
            eager()
    torch.cuda.current_stream().wait_stream(side)
    for x in xs:  # gradients allocated during the capture live in the graph's pool, not freed by a clear
        x.grad = None
    for block in blocks:
        block.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eager()

    def step() -> None:
        graph.replay()

    step.microbatch = lambda j, x: step()  # type: ignore[attr-defined]
    step.per_call = 1  # type: ignore[attr-defined]  # one call is a whole step
    return step


def make_pipeline_step(blocks: list[Residual], xs: list[torch.Tensor], grad: torch.Tensor,
                       cuda_graphs: bool | str) -> Callable[[], None]:
    from zbpp import Pipeline
    from zbpp.schedules import build

    sched = build("zb-h1", num_ranks=1, num_microbatches=len(xs))
    pipe = Pipeline({0: nn.Sequential(*blocks)}, sched, loss_fn=lambda out, g: (out * g).sum(),
                    cuda_graphs=cuda_graphs, seed=False)
    batch = torch.cat([x.detach() for x in xs])
    target = grad.repeat(len(xs), 1)

    first_peaks: list[float] = []  # GiB allocated at most in the first two steps (eager, then capture)

    def step() -> None:
        if len(first_peaks) < 2 and batch.is_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            pipe.step(batch, target)
            torch.cuda.synchronize()
            first_peaks.append(torch.cuda.max_memory_allocated() / 2**30)
            return
        pipe.step(batch, target)

    step.first_peaks = first_peaks  # type: ignore[attr-defined]
    step.microbatch = lambda j, x: step()  # type: ignore[attr-defined]
    step.per_call = len(xs)  # type: ignore[attr-defined]  # one call is a whole step
    return step


_FUSED_KERNELS = {"_norm_stats_kernel": "norm", "_norm_cast_kernel": "norm",
                  "_act_cast_kernel": "activation", "_dact_cast_kernel": "activation",
                  "_cast_transpose_amax_kernel": "cast", "_update_scale_kernel": "cast"}
_GEMM_WORDS = ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "scaled_mm", "splitk")


def kernel_kind(name: str) -> str:
    """GEMMs, casts, norm, activation or other, from a GPU kernel's name."""
    for kernel, kind in _FUSED_KERNELS.items():
        if kernel in name:
            return kind
    low = name.lower()
    if any(word in low for word in _GEMM_WORDS):
        return "gemm"
    if "norm" in low or "gammabeta" in low:
        return "norm"
    if "gelu" in low:
        return "activation"
    if "float8" in low or "fp8" in low or "e4m3" in low or "e5m2" in low:
        return "cast"
    return "other"


KINDS = ("gemm", "cast", "norm", "activation", "other")


def kernel_breakdown(step: Callable[[], None], clear: Callable[[], None]) -> dict:
    """GPU milliseconds of one profiled step by kernel kind, and the largest 'other' kernels."""
    from torch.profiler import ProfilerActivity, profile

    clear()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_kind = {kind: 0.0 for kind in KINDS}
    counts = {kind: 0 for kind in KINDS}
    others: list[tuple[float, str]] = []
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = evt.self_device_time_total / 1e3
        kind = kernel_kind(evt.key)
        by_kind[kind] += ms
        counts[kind] += evt.count
        if kind == "other":
            others.append((ms, evt.key))
    total = sum(by_kind.values())
    return {
        "ms": {k: round(v, 3) for k, v in by_kind.items()},
        "share": {k: round(v / total, 4) if total else 0.0 for k, v in by_kind.items()},
        "kernels": counts,
        "total_ms": round(total, 3),
        "largest_other": [{"ms": round(ms, 3), "kernel": name[:120]}
                          for ms, name in sorted(others, reverse=True)[:5]],
    }


# A sleeping GPU while the host issues one microbatch (at most ~1000 kernels queue unblocked).
HOST_SLEEP_CYCLES = 200_000_000


def run_blocks(args: argparse.Namespace) -> dict:
    cuda = args.device.startswith("cuda")
    variants = [v for v in BLOCK_VARIANTS if v in args.variants.split(",")
                and (cuda or "graph" not in v)]
    gen = torch.Generator(device=args.device).manual_seed(1)
    xs = [torch.randn(args.tokens, args.hidden, generator=gen, device=args.device,
                      dtype=torch.bfloat16).requires_grad_(True)
          for _ in range(args.microbatches)]
    grad = torch.randn(args.tokens, args.hidden, generator=gen, device=args.device,
                       dtype=torch.bfloat16) / (args.tokens * args.hidden)
    stacks = {v: make_blocks(args, v) for v in variants}
    steps = {v: make_block_step(stacks[v], xs, grad, v) for v in variants}
    timer = Timer(args.device)
    times: dict[str, list[float]] = {v: [] for v in variants}
    host: dict[str, list[float]] = {v: [] for v in variants}
    fused: dict[str, dict[str, int]] = {}
    peak: dict[str, float] = {}  # GiB allocated at most during one step (parameters included)
    saved_fuse = os.environ.get(_fused.FUSE_ENV)

    def clear(variant: str) -> None:
        for x in xs:
            x.grad = None
        for block in stacks[variant]:
            block.zero_grad(set_to_none=True)

    def use(variant: str) -> None:
        os.environ[_fused.FUSE_ENV] = "0" if "unfused" in variant else "1"

    try:
        for _ in range(args.rounds):
            for v in variants:
                use(v)
                _fused.reset_fused_path_counts()
                for i in range(args.warmup + args.iters):
                    clear(v)
                    ms = timer(steps[v])
                    if i >= args.warmup:
                        times[v].append(ms)
                fused[v] = _fused.fused_path_counts()
                clear(v)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda._sleep(HOST_SLEEP_CYCLES)
                t = time.perf_counter()
                steps[v].microbatch(0, xs[0])
                if not hasattr(steps[v], "per_call"):  # a whole step overfills the launch queue: not host time
                    host[v].append(1e3 * (time.perf_counter() - t))
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    clear(v)
                    steps[v]()
                    torch.cuda.synchronize()
                    peak[v] = max(peak.get(v, 0.0), torch.cuda.max_memory_allocated() / 2**30)
        breakdown = {}
        if cuda and not args.no_kernel_profile:
            for v in variants:
                use(v)
                try:
                    breakdown[v] = kernel_breakdown(steps[v], lambda v=v: clear(v))
                except Exception as err:  # noqa: BLE001 - the timings stand without it
                    breakdown[v] = {"error": f"{type(err).__name__}: {err}"}
    finally:
        if saved_fuse is None:
            os.environ.pop(_fused.FUSE_ENV, None)
        else:
            os.environ[_fused.FUSE_ENV] = saved_fuse
    flop = 6 * 2 * args.tokens * args.hidden * args.ffn * args.blocks * args.microbatches
    results = []
    for v in variants:
        med = statistics.median(times[v])
        results.append({
            "variant": v, "median_ms": med, "min_ms": min(times[v]), "max_ms": max(times[v]),
            "tflops": flop / med / 1e9, "host_ms_per_microbatch": statistics.median(host[v]) if host[v] else None,
            "gpu_ms_per_microbatch": med / args.microbatches,
            "samples_ms": [round(t, 3) for t in times[v]], "fused_paths": fused[v],
            "breakdown": breakdown.get(v), "peak_gib": peak.get(v),
            "first_steps_peak_gib": getattr(steps[v], "first_peaks", None),
        })
    by = {r["variant"]: r["median_ms"] for r in results}

    def ratio(a: str, b: str) -> float | None:
        return by[a] / by[b] if a in by and b in by else None

    return {
        "suite": "blocks",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
        "ratios": {
            "fp8_speedup": ratio("zbpp bf16", "zbpp fp8"),
            "fp8_speedup_delayed": ratio("zbpp bf16 delayed", "zbpp fp8 delayed"),
            "fusion_speedup": ratio("zbpp fp8 unfused", "zbpp fp8"),
            "zbpp_bf16_over_torch_nn": ratio("zbpp bf16", "torch.nn"),
            "zbpp_bf16_delayed_over_torch_nn": ratio("zbpp bf16 delayed", "torch.nn"),
            "zbpp_bf16_pipeline_over_torch_nn": ratio("zbpp bf16 pipeline", "torch.nn"),
            "torch_nn_over_zbpp_task_graphs": ratio("torch.nn", "zbpp bf16 task graphs"),
            "torch_nn_over_torch_nn_task_graphs": ratio("torch.nn", "torch.nn task graphs"),
            "task_graphs_over_one_graph": ratio("zbpp bf16 task graphs", "zbpp bf16 one graph"),
        },
        "fp8_gemm_paths": fp8mod.gemm_path_counts(),
        "fp8_cast_paths": fp8mod.cast_path_counts(),
        "env": run_env(cuda),
    }


def print_blocks(report: dict) -> None:
    cfg = report["config"]
    print(
        f"{cfg['blocks']} blocks x + LayerNormMLP(x): hidden {cfg['hidden']}, ffn {cfg['ffn']}, "
        f"{cfg['microbatches']} microbatches of {cfg['tokens']} tokens, forward + backward, "
        f"on {report['env']['device']}"
    )
    print(f"{'variant':<22} {'step ms':>9} {'min':>9} {'max':>9} {'TFLOP/s':>8} "
          f"{'GPU ms/mb':>10} {'host ms/mb':>11}  " + " ".join(f"{k:>10}" for k in KINDS))
    for r in report["results"]:
        parts = (r["breakdown"] or {}).get("ms", {})
        host = r["host_ms_per_microbatch"]
        print(f"{r['variant']:<22} {r['median_ms']:>9.2f} {r['min_ms']:>9.2f} {r['max_ms']:>9.2f} "
              f"{r['tflops']:>8.1f} {r['gpu_ms_per_microbatch']:>10.3f} "
              f"{host if host is not None else float('nan'):>11.3f}  "
              + " ".join(f"{parts.get(k, float('nan')):>10.2f}" for k in KINDS))
    q = report["ratios"]

    def show(name: str, value: float | None, note: str = "") -> None:
        if value is not None:
            print(f"{name}: {value:.3f}{note}")

    show("FP8 speedup (zbpp bf16 / zbpp fp8)", q["fp8_speedup"],
         "  (target >= 1.65 at hidden 4096)")
    show("FP8 speedup, delayed wgrad", q["fp8_speedup_delayed"])
    show("fusion speedup (fp8 unfused / fp8)", q["fusion_speedup"])
    show("zbpp bf16 delayed / torch.nn", q["zbpp_bf16_delayed_over_torch_nn"],
         "  (target <= 1.05 at hidden 1024)")
    show("zbpp bf16 pipeline / torch.nn", q.get("zbpp_bf16_pipeline_over_torch_nn"))
    show("torch.nn / zbpp bf16 task graphs", q.get("torch_nn_over_zbpp_task_graphs"),
         "  (target >= 1.3 at hidden 1024)")
    show("torch.nn / torch.nn task graphs", q.get("torch_nn_over_torch_nn_task_graphs"))
    show("zbpp bf16 / torch.nn", q["zbpp_bf16_over_torch_nn"])
    print(f"FP8 GEMM paths: {report['fp8_gemm_paths']}")
    print(f"FP8 cast paths: {report['fp8_cast_paths']}")


# -- the block stack under a pipeline schedule (torchrun) --------------------------------------


class PipelineStage(nn.Module):
    """A pipeline stage of residual LayerNormMLP blocks; in FP8 its forward runs inside
    fp8_autocast and keeps the weights' casts after the step's first microbatch (the runtime
    runs F inside ``microbatch((stage, j))``)."""

    def __init__(self, blocks: list[Residual], fp8: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.fp8 = fp8
        self.recipe = DelayedScaling(amax_history_len=16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from zbpp.modules import current_microbatch

        key = current_microbatch()
        first = (key is not None and key[1] == 0) if self.fp8 else None
        with fp8_autocast(enabled=self.fp8, fp8_recipe=self.recipe):
            for block in self.blocks:
                x = block(x, is_first_microbatch=first)
        return x


PIPELINE_VARIANTS = ("zbpp bf16 delayed", "zbpp fp8 delayed")


def run_pipeline(args: argparse.Namespace) -> dict | None:
    """Step time of the block stack under `args.schedule` on every rank (torchrun); rank 0
    returns the report."""
    import torch.distributed as dist

    from zbpp import Pipeline
    from zbpp.runtime import init_distributed
    from zbpp.schedules import build

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    args.device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    sched = build(args.schedule, num_ranks=world, num_microbatches=args.microbatches)
    if args.blocks % sched.num_stages:
        raise SystemExit(f"--blocks {args.blocks} must split evenly over {sched.num_stages} stages")
    per_stage = args.blocks // sched.num_stages
    gen = torch.Generator(device=args.device).manual_seed(1)  # the same batch on every rank
    rows = args.microbatches * args.tokens
    x = torch.randn(rows, args.hidden, generator=gen, device=args.device, dtype=torch.bfloat16)
    y = torch.randn(rows, args.hidden, generator=gen, device=args.device, dtype=torch.bfloat16)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out.float() * target.float()).mean()  # a fixed full-rank output gradient

    times: dict[str, list[float]] = {}
    for variant in PIPELINE_VARIANTS:
        stages = {}
        for s in sched.stages_on(rank):
            torch.manual_seed(1000 + s)
            blocks = [Residual(LayerNormMLP(args.hidden, args.ffn, params_dtype=torch.bfloat16,
                                            delay_wgrad_compute=True, device=args.device))
                      for _ in range(per_stage)]
            stages[s] = PipelineStage(blocks, fp8="fp8" in variant)
        pipe = Pipeline(stages, sched, loss_fn=loss_fn)
        times[variant] = []
        for i in range(args.warmup + args.iters):
            for m in stages.values():
                m.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t = time.perf_counter()
            pipe.step(x, target=y)
            if cuda:
                torch.cuda.synchronize()
            took = torch.tensor([time.perf_counter() - t], dtype=torch.float64,
                                device=args.device if backend_is_nccl() else "cpu")
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if i >= args.warmup:
                times[variant].append(1e3 * took.item())
        del pipe, stages
        if cuda:
            torch.cuda.empty_cache()
    if rank != 0:
        return None
    med = {v: statistics.median(t) for v, t in times.items()}
    return {
        "suite": "pipeline",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ranks": world,
        "results": [{"variant": v, "median_ms": med[v], "min_ms": min(times[v]),
                     "max_ms": max(times[v]), "samples_ms": [round(t, 3) for t in times[v]]}
                    for v in PIPELINE_VARIANTS],
        "ratios": {"fp8_speedup": med["zbpp bf16 delayed"] / med["zbpp fp8 delayed"]},
        "fused_paths": _fused.fused_path_counts(),
        "fp8_cast_paths": fp8mod.cast_path_counts(),
        "env": run_env(cuda),
    }


def backend_is_nccl() -> bool:
    import torch.distributed as dist

    return dist.get_backend() == "nccl"


def print_pipeline(report: dict) -> None:
    cfg = report["config"]
    print(
        f"{cfg['schedule']} on {report['ranks']} ranks: {cfg['blocks']} blocks x + "
        f"LayerNormMLP(x), hidden {cfg['hidden']}, ffn {cfg['ffn']}, {cfg['microbatches']} "
        f"microbatches of {cfg['tokens']} tokens, on {report['env']['device']}"
    )
    for r in report["results"]:
        print(f"{r['variant']:<18} step {r['median_ms']:9.2f} ms (min {r['min_ms']:.2f}, "
              f"max {r['max_ms']:.2f})")
    print(f"FP8 speedup of the step: {report['ratios']['fp8_speedup']:.3f}  (target >= 1.6)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.suite == "pipeline":
        from zbpp.runtime import shutdown_and_exit

        report = run_pipeline(args)
        if report is not None:
            print_pipeline(report)
            write_report(report, args.out)
        shutdown_and_exit(0)
    if args.suite == "blocks":
        report = run_blocks(args)
        print_blocks(report)
    else:
        report = run(args)
        print_table(report)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
