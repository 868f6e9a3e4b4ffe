"""Where an eager FP8 step's time goes against an eager bf16 one, on one GPU: a HF Llama (bench_hf's
presets: hidden 4096, 4 layers by default; ``--preset h2048``: hidden 2048, 8 layers; seq 2048) as
one zb-h1 stage of 8 microbatches, `fast_stage(compile=False)` with and without FP8.

The forms run in one process, alternating in rounds: bf16, FP8, ``fp8 unfused`` (the gated MLPs
left as three FP8 layers with the model's activation between them: `fuse_gated_mlps` off), ``fp8 jit
launch`` (the Triton kernels launched through ``JITFunction.run``, as before `zbpp.modules._triton_launch`),
and FP8 with parts of its host work taken out, to name what the host spends: ``fp8 -launch`` (the FP8 casts' Triton launch a no-op),
``fp8 -gemm`` (each FP8 GEMM call replaced by allocating its output), ``fp8 -both``. Those stubbed
steps compute wrong numbers; only their time means something: the host's, since such a step leaves
the GPU idle for long stretches. Per form: the step's wall time and the host's time to issue it
(until `Pipeline.step` returns), medians of the rounds; then, for bf16 and FP8, the GPU's kernel
time (torch.profiler) and the host's top functions (cProfile of one step). Writes JSON.

Before each step a fixed piece of host work (Python and torch's CPU dispatch, as a step's host side
runs them) is timed: the host probe. On a virtual machine the host's speed can change within
seconds, and a host-bound step (FP8 eager on small microbatches) follows it where a GPU-bound one
(bf16 eager) does not; the last line compares FP8 and bf16 in the round whose probe ran fastest.

    PYTHONPATH=$PWD python3 benchmarks/fp8_eager_host.py --out fp8_eager_host.json
    PYTHONPATH=$PWD python3 benchmarks/fp8_eager_host.py --preset h2048   # smaller GEMMs, twice the layers
    ZBPP_FP8_CAST=compile PYTHONPATH=$PWD python3 benchmarks/fp8_eager_host.py   # another cast path

``--quick`` runs a tiny model on the CPU (the plumbing only: CPUs cast and multiply FP8 eagerly);
``--quick --preset NAME`` runs that preset's sizes there instead (an option given explicitly wins).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hf import PRESETS  # noqa: E402 - benchmarks/, beside this script
from host_probe import host_probe_ms  # noqa: E402
from quick import given  # noqa: E402

FORMS = ("bf16", "fp8", "fp8 jit launch", "fp8 unfused", "fp8 -launch", "fp8 -gemm", "fp8 -both")


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid: Any):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _stubbed(form: str) -> Iterator[None]:
    """The FP8 host work `form` takes out (see the module docstring), put back on exit."""
    import zbpp.modules._fp8_cast_triton as kernels
    import zbpp.modules.fp8.gemm as gemm

    import zbpp.modules._fused_triton as fused
    from zbpp.modules._triton_launch import _Direct

    launch, scaled_mm = kernels._cast_transpose_amax_kernel, gemm.scaled_mm
    direct = [k for mod in (kernels, fused) for k in vars(mod).values() if isinstance(k, _Direct)]
    usable = [k._usable for k in direct]
    if form == "fp8 jit launch":
        for k in direct:
            k._usable = False
    if form in ("fp8 -launch", "fp8 -both"):
        kernels._cast_transpose_amax_kernel = _NoLaunch()
    if form in ("fp8 -gemm", "fp8 -both"):
        gemm.scaled_mm = lambda a, b, *, out_dtype, **kw: torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype,
                                                                       device=a.device)
    try:
        yield
    finally:
        kernels._cast_transpose_amax_kernel, gemm.scaled_mm = launch, scaled_mm
        for k, was in zip(direct, usable):
            k._usable = was


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the model's sizes resolved: ``device``, ``hidden``, ``layers``, ``ffn``,
    ``heads``, ``vocab``, ``seq``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="h4096", help="the model's size (bench_hf's)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of every form, alternating")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny model on the CPU (a smoke run); with --preset, that preset's sizes on the CPU")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.device, args.vocab, args.seq = torch.device("cpu"), 128, 16
        # an explicit --preset wins over --quick's tiny sizes, as every benchmark's options do (quick.py)
        if "preset" in given(ap, argv):
            args.hidden, args.layers, args.ffn, args.heads = PRESETS[args.preset]
        else:
            args.hidden, args.layers, args.ffn, args.heads = 64, 2, 128, 4
    else:
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU (or --quick)")
        args.hidden, args.layers, args.ffn, args.heads = PRESETS[args.preset]
        args.device, args.vocab, args.seq = torch.device("cuda"), 32000, 2048
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import transformers

    from zbpp import Pipeline
    from zbpp.models import fast
    from zbpp.models.fast import fast_stage
    from zbpp.models.hf import causal_lm_stages
    from zbpp.modules.fp8 import cast_path_counts, gemm_path_counts
    from zbpp.schedules import build

    args = parse_args(argv)
    device, hidden, ffn, layers, heads = args.device, args.hidden, args.ffn, args.layers, args.heads
    vocab, seq = args.vocab, args.seq
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                   max_position_embeddings=seq)
    m = 8
    ids = torch.randint(0, vocab, (m, seq), device=device)
    pipes = {}
    for precision in ("bf16", "fp8", "fp8 unfused"):
        sched = build("zb-h1", num_ranks=1, num_microbatches=m)
        torch.manual_seed(0)
        stages, kw = causal_lm_stages(cfg, sched, 0, device=device, dtype=torch.bfloat16, attn_implementation="sdpa")
        fuse = fast.fuse_gated_mlps
        if precision == "fp8 unfused":
            fast.fuse_gated_mlps = lambda stage: []
        try:
            fast_stage(stages[0], compile=False, fp8=precision != "bf16")
        finally:
            fast.fuse_gated_mlps = fuse
        pipes[precision] = Pipeline(stages, sched, **kw)

    def step(form: str) -> tuple[float, float, float]:
        _sync(device)
        probe = host_probe_ms()
        with _stubbed(form):
            start = time.perf_counter()
            pipes[form if form in pipes else "fp8"].step({"input_ids": ids}, target=ids)
            issued = time.perf_counter() - start
            _sync(device)  # inside: the stubs stay until the GPU has run what they changed
        return issued * 1e3, (time.perf_counter() - start) * 1e3, probe

    for form in FORMS:  # warm-up: every form's first step
        step(form)
    times: dict[str, list[tuple[float, float, float]]] = {f: [] for f in FORMS}
    for _ in range(args.rounds):
        for form in FORMS:
            times[form].append(step(form))
    out: dict[str, Any] = {"forms": {}}
    print(f"{'form':14s} {'issue ms':>9s} {'wall ms':>9s}  walls (host probe ms)")
    for form in FORMS:
        issue = statistics.median(t[0] for t in times[form])
        wall = statistics.median(t[1] for t in times[form])
        out["forms"][form] = {"issue_ms": issue, "wall_ms": wall, "rounds_ms": [t[1] for t in times[form]],
                              "host_probe_ms": [t[2] for t in times[form]]}
        print(f"{form:14s} {issue:9.1f} {wall:9.1f}  {' '.join(f'{t[1]:.0f} ({t[2]:.0f})' for t in times[form])}",
              flush=True)
    fastest = min(range(args.rounds), key=lambda r: times["fp8"][r][2])
    fp8_wall, bf16_wall = times["fp8"][fastest][1], times["bf16"][fastest][1]
    out["fastest_host_round"] = {"round": fastest, "host_probe_ms": times["fp8"][fastest][2],
                                 "fp8_wall_ms": fp8_wall, "bf16_wall_ms": bf16_wall}
    print(f"round {fastest} (the fastest host probe before FP8, {times['fp8'][fastest][2]:.1f} ms): "
          f"fp8 {fp8_wall:.1f} ms, bf16 {bf16_wall:.1f} ms, bf16 / fp8 {bf16_wall / fp8_wall:.3f}")
    for precision, pipe in pipes.items():
        activities = [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
        if activities:
            with torch.profiler.profile(activities=activities) as prof:
                pipe.step({"input_ids": ids}, target=ids)
                _sync(device)
            out["forms"][precision]["gpu_ms"] = sum(e.device_time_total for e in prof.key_averages()) / 1e3
            out["forms"][precision]["kernels"] = sum(e.count for e in prof.key_averages() if e.device_time_total > 0)
        profiler = cProfile.Profile()
        profiler.enable()
        pipe.step({"input_ids": ids}, target=ids)
        _sync(device)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(22)
        print(f"== {precision}: the host's top functions (cProfile of one step)")
        print("\n".join(text.getvalue().splitlines()[:40]), flush=True)
    out["cast_paths"], out["gemm_paths"] = cast_path_counts(), gemm_path_counts()
    print("cast paths", out["cast_paths"], "gemm paths", out["gemm_paths"])
    if args.out is not None:
        from bench_modules import run_env
        from provenance import write_report

        write_report({"benchmark": "fp8_eager_host", "env": run_env(device.type == "cuda"),
                      "argv": sys.argv[1:] if argv is None else argv, **out}, args.out)
    return out


if __name__ == "__main__":
    main()
