"""A Hugging Face Llama on one GPU: HF eager and torch.compile against zbpp's eager and fast forms.

One rank, one stage holding the whole model (``causal_lm_stages`` from a ``LlamaConfig``, random
weights, bf16 parameters, SDPA attention), trained on ``--microbatches`` microbatches of ``--rows``
sequences of ``--seq-len`` tokens per step (forward + backward, gradients accumulated, no
optimizer). Variants:

- ``hf eager``       ``LlamaForCausalLM`` itself, ``model(ids, labels=ids).loss / m`` then
                     ``backward()`` per microbatch
- ``hf compile``     the same model under ``torch.compile(model)``
- ``zbpp eager``     a one-rank zb-h1 `Pipeline` of the stage (the generic B/W split)
- ``zbpp fast``      ``causal_lm_stages(..., fast=True)``: delayed-wgrad Linears, compiled decoder
                     layers, task graphs (``zbpp.models.fast``)
- ``zbpp fast nographs``  the same without task graphs (what they add)
- ``zbpp fp8 eager`` delayed-wgrad Linears in FP8 (``fast_stage(compile=False, fp8=True)``), no
                     task graphs: FP8's eager cost against ``zbpp eager``
- ``zbpp fast fp8``  ``causal_lm_stages(..., fast=True, fp8=True)``

Variants are interleaved over ``--rounds`` rounds (warm-up steps, then ``--steps`` steps timed
one by one with CUDA events); the table gives the median ms per step, tokens/s, MFU (model FLOPs
``6 N T + 6 L s h T`` per step: N the matmul parameters of the layers and the LM head, T tokens,
causal attention counted half; over ``--peak-tflops``, the H200's dense bf16 989 by default, also
for FP8), the peak memory (the variant's resident bytes after warm-up, parameters, gradients and
graph pools, plus the most its step allocates beyond them) and each variant's speed against
``hf compile`` (> 1: faster). ``--kernel-profile`` sums one profiled step's GPU kernels by kind (gemm,
attention, cast, norm, activation, other) for the variants named, and the step's GPU idle time.

On one H200 (both of the issue's workloads in one run)::

    PYTHONPATH=$PWD python3 benchmarks/bench_hf.py --preset h2048,h4096 --out $OUT/bench_hf.json

CPU smoke run (tiny model, seconds; compile with ``--backend aot_eager``)::

    python benchmarks/bench_hf.py --quick --out /tmp/bench_hf.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench_modules import kernel_kind, run_env  # noqa: E402 - benchmarks/, beside this script
from provenance import write_report  # noqa: E402

from zbpp.runtime.task_graphs import TRIAL_STEPS  # noqa: E402

# a variant's first steps: compile, capture the task graphs, and their trial under cuda_graphs="auto"
FIRST_WARMUP = 3 + 2 * TRIAL_STEPS

VARIANTS = ("hf eager", "hf compile", "zbpp eager", "zbpp fast", "zbpp fast nographs", "zbpp fp8 eager",
            "zbpp fast fp8")
REFERENCE = "hf compile"
# hidden, layers, ffn, heads: the two workloads (Llama-style ffn widths)
PRESETS = {"h2048": (2048, 8, 5632, 16), "h4096": (4096, 4, 11008, 32)}
KINDS = ("gemm", "attention", "cast", "norm", "activation", "other")
START = time.perf_counter()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="h2048", help=f"comma-separated, of {sorted(PRESETS)} or 'custom'")
    ap.add_argument("--hidden", type=int, default=1024, help="custom: hidden size")
    ap.add_argument("--layers", type=int, default=4, help="custom: decoder layers")
    ap.add_argument("--ffn", type=int, default=None, help="custom: intermediate size (default 2.75 x hidden)")
    ap.add_argument("--heads", type=int, default=None, help="custom: attention heads (default hidden / 128)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=1, help="sequences per microbatch")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    ap.add_argument("--warmup", type=int, default=2,
                    help=f"untimed steps per variant and round ({FIRST_WARMUP} more in the first)")
    ap.add_argument("--kernel-profile", default="hf compile,zbpp fast,zbpp fp8 eager,zbpp fast fp8",
                    help="variants whose one step is profiled by kernel kind ('' for none)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="seconds from the start after which a preset runs no further round (at least one)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the MFU's denominator")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny CPU-sized smoke run")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.hidden, args.layers, args.ffn, args.heads = "custom", 32, 2, 64, 2
        args.vocab, args.seq_len, args.microbatches, args.rounds, args.steps, args.warmup = 64, 16, 2, 2, 1, 1
        args.backend, args.kernel_profile = "aot_eager", ""
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown --variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    if not args.device.startswith("cuda"):  # task graphs and FP8 GEMMs need a GPU
        variants = [v for v in variants if "fp8" not in v and v != "zbpp fast"]
    elif not fp8_available():
        variants = [v for v in variants if "fp8" not in v]
    args.variant_list = variants
    presets = args.preset.split(",")
    for p in presets:
        if p != "custom" and p not in PRESETS:
            ap.error(f"unknown --preset {p!r}; choose from {sorted(PRESETS)} or custom")
    args.presets = presets
    return args


def fp8_available() -> bool:
    """A GPU with FP8 GEMMs (compute capability 8.9 or more) and ``torch._scaled_mm``."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and hasattr(torch, "_scaled_mm")


def make_config(args: argparse.Namespace, preset: str) -> Any:
    import transformers

    if preset == "custom":
        hidden, layers = args.hidden, args.layers
        ffn, heads = args.ffn or int(2.75 * hidden), args.heads or max(1, hidden // 128)
    else:
        hidden, layers, ffn, heads = PRESETS[preset]
    return transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=hidden, intermediate_size=ffn,
                                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                    max_position_embeddings=args.seq_len, tie_word_embeddings=False)


def model_flops(config: Any, tokens: int, seq: int) -> float:
    """FLOPs of one training step (see the module docstring)."""
    h, f, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    matmul_params = n * (2 * h * h + 2 * h * kv + 3 * h * f) + h * v
    return 6.0 * matmul_params * tokens + 6.0 * n * seq * h * tokens


class Variant:
    """One variant's model and its step (``step()``: one training step; ``clear()``: drop grads)."""

    def __init__(self, name: str, step: Callable[[], Any], modules: list[torch.nn.Module]) -> None:
        self.name, self.step, self.modules = name, step, modules
        self.times: list[float] = []
        self.resident = 0  # bytes held after warm-up (parameters, gradients, graph pools)
        self.transient = 0  # the most a step allocated beyond that

    def clear(self) -> None:
        for m in self.modules:
            m.zero_grad(set_to_none=False)  # kept .grad tensors: task graphs write into them


def build_variant(name: str, config: Any, args: argparse.Namespace, batch: dict[str, torch.Tensor]) -> Variant:
    import transformers

    from zbpp import Pipeline
    from zbpp.models.fast import fast_stage
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    device, dtype = torch.device(args.device), torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    ids, labels, m = batch["input_ids"], batch["labels"], args.microbatches
    if name.startswith("hf"):
        torch.manual_seed(0)
        cfg = copy.deepcopy(config)
        cfg._attn_implementation = "sdpa"
        with device:
            model = transformers.LlamaForCausalLM(cfg).to(dtype)
        run = torch.compile(model, backend=args.backend) if name == "hf compile" else model
        ids_mb, labels_mb = ids.chunk(m), labels.chunk(m)

        def hf_step() -> None:
            for x, y in zip(ids_mb, labels_mb):
                (run(input_ids=x, labels=y).loss / m).backward()

        return Variant(name, hf_step, [model])
    sched = build("zb-h1", num_ranks=1, num_microbatches=m)
    fast = name.startswith("zbpp fast")
    stages, kwargs = causal_lm_stages(config, sched, 0, device=device, dtype=dtype, attn_implementation="sdpa",
                                      fast=fast, fp8=name == "zbpp fast fp8")
    if name == "zbpp fp8 eager":
        fast_stage(stages[0], compile=False, fp8=True)
    if name == "zbpp fast nographs":
        kwargs.pop("cuda_graphs", None)
    if fast and "cuda_graphs" not in kwargs and name != "zbpp fast nographs" and device.type == "cuda":
        raise RuntimeError("causal_lm_stages(fast=True) on CUDA did not ask for task graphs")
    pipe = Pipeline(stages, sched, **kwargs)

    def zbpp_step() -> None:
        pipe.step({"input_ids": ids}, target=labels)

    return Variant(name, zbpp_step, list(stages.values()))


class Timer:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any]) -> float:
        """Milliseconds of one call, from an idle device."""
        self.sync()
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def _kind(name: str) -> str:
    low = name.lower()
    if any(w in low for w in ("flash", "fmha", "attention", "sdpa", "cudnn")):
        return "attention"
    kind = kernel_kind(name)
    if kind == "other" and ("rms" in low or "norm" in low):
        return "norm"
    if kind == "other" and ("silu" in low or "mul" in low and "triton" not in low):
        return "activation"
    return kind


def kernel_profile_step(v: Variant, timer: Timer) -> dict:
    """GPU milliseconds of one step by kernel kind, the step's wall time and GPU idle share."""
    from torch.profiler import ProfilerActivity, profile

    v.clear()
    timer.sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        v.step()
        timer.sync()
    wall = (time.perf_counter() - t0) * 1e3
    by_kind = {k: 0.0 for k in KINDS}
    top: list[tuple[float, str]] = []
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA or evt.self_device_time_total <= 0:
            continue
        ms = evt.self_device_time_total / 1e3
        by_kind[_kind(evt.key)] += ms
        top.append((ms, evt.key))
    busy = sum(by_kind.values())
    return {"ms": {k: round(x, 2) for k, x in by_kind.items()}, "gpu_busy_ms": round(busy, 2),
            "wall_ms_profiled": round(wall, 2),
            "top_kernels": [{"ms": round(ms, 2), "kernel": k[:100]} for ms, k in sorted(top, reverse=True)[:8]]}


def run_preset(args: argparse.Namespace, preset: str) -> dict:
    cuda = args.device.startswith("cuda")
    config = make_config(args, preset)
    rows = args.rows * args.microbatches
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (rows, args.seq_len), generator=gen).to(args.device)
    batch = {"input_ids": ids, "labels": ids}
    tokens = rows * args.seq_len
    flops = model_flops(config, tokens, args.seq_len)
    timer = Timer(cuda)
    torch._dynamo.reset()
    variants: dict[str, Variant] = {}
    failed: dict[str, str] = {}
    for r in range(args.rounds):
        if r and args.deadline_s is not None and time.perf_counter() - START > args.deadline_s:
            print(f"  [{preset}] deadline: {r} rounds", flush=True)
            break
        for name in args.variant_list:
            if name in failed:
                continue
            if name not in variants:
                before = torch.cuda.memory_allocated() if cuda else 0
                t0 = time.perf_counter()
                try:
                    v = build_variant(name, config, args, batch)
                    for _ in range(FIRST_WARMUP):
                        v.clear()
                        v.step()
                    timer.sync()
                except Exception as exc:  # noqa: BLE001 - one broken variant must not cost the others
                    failed[name] = f"{type(exc).__name__}: {exc}"[:2000]
                    print(f"  [{preset}] {name} FAILED: {failed[name][:500]}", flush=True)
                    continue
                variants[name] = v
                print(f"  [{preset}] {name}: built and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
                if cuda:
                    v.resident = torch.cuda.memory_allocated() - before
            v = variants[name]
            for _ in range(args.warmup):
                v.clear()
                v.step()
            for _ in range(args.steps):
                v.clear()
                if cuda:
                    timer.sync()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                v.times.append(timer.time(v.step))
                if cuda:
                    v.transient = max(v.transient, torch.cuda.max_memory_allocated() - base)
    profiles = {}
    for name in [p for p in args.kernel_profile.split(",") if p in variants] if cuda else []:
        try:
            profiles[name] = kernel_profile_step(variants[name], timer)
        except Exception as exc:  # noqa: BLE001 - a profiler failure keeps the timings
            profiles[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    results = {}
    ref = statistics.median(variants[REFERENCE].times) if REFERENCE in variants else None
    for name in [n for n in args.variant_list if n in variants]:
        v = variants[name]
        ms = statistics.median(v.times)
        results[name] = {
            "ms": round(ms, 2), "ms_min": round(min(v.times), 2), "ms_max": round(max(v.times), 2),
            "tokens_per_s": round(tokens / ms * 1e3), "mfu": round(flops / (ms * 1e-3) / (args.peak_tflops * 1e12), 4),
            "peak_gib": round((v.resident + v.transient) / 2**30, 2) if cuda else None,
            "speed_vs_hf_compile": round(ref / ms, 3) if ref else None,
            "times_ms": [round(t, 2) for t in v.times],
        }
        if name in profiles:
            results[name]["profile"] = profiles[name]
    return {"preset": preset, "config": {"hidden": config.hidden_size, "layers": config.num_hidden_layers,
                                         "ffn": config.intermediate_size, "heads": config.num_attention_heads,
                                         "vocab": config.vocab_size, "seq_len": args.seq_len, "rows": args.rows,
                                         "microbatches": args.microbatches},
            "tokens_per_step": tokens, "model_tflops_per_step": round(flops / 1e12, 3), "results": results,
            "failed": failed}


def print_table(run: dict) -> None:
    c = run["config"]
    print(f"\n{run['preset']}: hidden {c['hidden']}, {c['layers']} layers, ffn {c['ffn']}, seq {c['seq_len']}, "
          f"{c['microbatches']} microbatches x {c['rows']} rows")
    print(f"{'variant':<20} {'ms/step':>9} {'min-max':>15} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'vs hf compile':>14}")
    for name, r in run["results"].items():
        vs = f"{r['speed_vs_hf_compile']:.3f}x" if r["speed_vs_hf_compile"] else "-"
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        print(f"{name:<20} {r['ms']:>9.2f} {r['ms_min']:>7.1f}-{r['ms_max']:<7.1f} {r['tokens_per_s']:>10} "
              f"{r['mfu']:>6.1%} {peak:>9} {vs:>14}")
    for name, why in run["failed"].items():
        print(f"{name:<20} FAILED: {why[:300]}")
    for name, r in run["results"].items():
        p = r.get("profile")
        if p and "error" in p:
            print(f"  profile {name}: {p['error']}")
        elif p:
            kinds = " ".join(f"{k} {v:.1f}" for k, v in p["ms"].items())
            print(f"  profile {name}: GPU busy {p['gpu_busy_ms']:.1f} of {p['wall_ms_profiled']:.1f} ms: {kinds}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    report = {"benchmark": "bench_hf", "env": run_env(cuda), "argv": sys.argv[1:] if argv is None else argv,
              "variants": args.variant_list, "fp8_available": fp8_available(), "runs": []}
    for preset in args.presets:
        report["runs"].append(run_preset(args, preset))
        print_table(report["runs"][-1])
        write_report(report, args.out)  # after each preset: a later failure keeps the earlier figures
    return report


if __name__ == "__main__":
    main()
