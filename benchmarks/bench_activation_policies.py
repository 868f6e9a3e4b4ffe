"""Activation policies on one GPU: step time and peak memory of a Llama stage, measured and simulated.

One rank holds one stage with the whole model (``causal_lm_stages`` from a random ``LlamaConfig``,
Llama-3-8B-like layers: hidden 4096, ffn 14336, 32 heads, 8 KV heads; ``--layers`` decoder
layers, bf16, SDPA attention) under the one-rank schedule that holds the most microbatches'
activations at once (the simulator picks it; GPipe: all ``--microbatches`` of them). The step
(``Pipeline.step``, eager, one sequence of ``--seq-len`` tokens per microbatch; 8192, else the
largest of 8192/4096/2048 that fits) runs with every decoder layer under each policy of
`zbpp.models.recompute` (none, selective, full; offload on the first ``--offload-layers`` layers:
by default as many as one microbatch's forward hides the copies of, see below), the policies
interleaved over ``--rounds`` rounds of warm-up and timed steps (CUDA events).

Table columns:

- ``ms/step``: median milliseconds of one step; ``vs none``: that over none's;
- ``measured GiB``: the step's peak of ``torch.cuda.max_memory_allocated()`` minus what was
  allocated when it began (parameters, gradients: the static bytes, printed above the table);
- ``predicted GiB``: the simulator's peak activation memory of the same schedule
  (`zbpp.schedules.policies.simulate_policies`) from measured bytes per microbatch: each decoder
  layer's kept F->B bytes under the policy (`measure_activation_policies` on layer 0's real input)
  and the rest of the stage (embedding, final norm, LM head, loss: the whole stage's kept bytes
  under none minus the layers'), and what a backward allocates while it runs on top of them
  (`zbpp.schedules.simulate.Memory`'s transients: each layer's measured ``b_transient`` under the
  policy, the re-run forward or the reloaded bytes and B's own gradients; the whole stage's under
  none for the rest: the loss's float32 gradients);
- ``pred/meas``: predicted over measured.

Offload: the copies of one microbatch go over the host link while the next microbatches' forwards
run, so the link keeps up where one microbatch's copy (host bytes / the measured pinned copy
bandwidth) takes no longer than its forward (the none step's mean F): ``--offload-layers auto``
offloads that many layers (at least one). One offload step is traced into ``--trace-dir``:
``offload_step.json`` (torch.profiler: kernels on the compute stream, the copies on the side
stream) and ``offload_tasks.json`` (zbpp's Perfetto trace of the step's F and backward tasks);
the script prints, per microbatch, its copy times beside its F->backward gap.

On one H200::

    PYTHONPATH=$PWD python3 benchmarks/bench_activation_policies.py --out $OUT/policies.json --trace-dir $OUT

The simulator's peaks again from a saved report, without a device (B's transients from the
formula where the report predates their measurement)::

    python benchmarks/bench_activation_policies.py --rederive docs/results/bench_activation_policies_H200.json

CPU smoke run (tiny float32 model, seconds; no memory figures, offload copies are host clones)::

    python benchmarks/bench_activation_policies.py --quick --out /tmp/policies.json --trace-dir /tmp
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench_hf import Timer  # noqa: E402 - benchmarks/, beside this script
from bench_modules import run_env  # noqa: E402
from provenance import write_report  # noqa: E402
from quick import apply_quick  # noqa: E402

POLICIES = ("none", "selective", "full", "offload")
SEQ_FALLBACK = (8192, 4096, 2048)
START = time.perf_counter()
GIB = 2**30


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {msg}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=8192, help="tried first; then the smaller of 8192/4096/2048 on OOM")
    ap.add_argument("--microbatches", type=int, default=8, help="one sequence each")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    ap.add_argument("--offload-layers", default="auto",
                    help="decoder layers offloaded (the first ones), or 'auto'; each pins about microbatches x its "
                         "host bytes (rounded up to powers of two by torch's pinned-memory cache)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per policy and round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per policy and round")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true",
                    help="tiny float32 smoke run (CPU-sized); options given explicitly keep their values")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--trace-dir", type=Path, help="write the offload step's traces here (default: a temporary folder)")
    ap.add_argument("--rederive", type=Path, metavar="REPORT",
                    help="no run: the simulator's peaks again from a saved report's measured bytes (see rederive)")
    ap.add_argument("--formula-transients", action="store_true",
                    help="with --rederive: B's transients from the formula even where the report measured them")
    args = ap.parse_args(argv)
    apply_quick(ap, args, argv, hidden=64, ffn=128, heads=4, kv_heads=2, layers=2, vocab=128,
                seq_len=64, microbatches=4, rounds=1, steps=1, warmup=1)
    args.policy_list = args.policies.split(",")
    unknown = set(args.policy_list) - set(POLICIES)
    if unknown:
        ap.error(f"unknown --policies {sorted(unknown)}; choose from {list(POLICIES)}")
    if "none" not in args.policy_list:
        ap.error("--policies must include none (the reference of 'vs none' and of the offload choice)")
    k = args.offload_layers
    if k != "auto" and not (k.isdigit() and 1 <= int(k) <= args.layers):
        ap.error(f"--offload-layers must be 'auto' or 1..{args.layers}, got {args.offload_layers!r}")
    return args


def most_in_flight(m: int) -> tuple[str, dict[str, float]]:
    """The one-rank schedule (one stage per rank) whose simulated peak holds the most microbatches'
    activations, and each candidate's count."""
    from zbpp.schedules import Memory, available, build, simulate

    held = {}
    for name in available():
        sched = build(name, num_ranks=1, num_microbatches=m)
        if len(sched.stages_on(0)) == 1:  # V and interleaved schedules hold two stages on one rank
            held[name] = simulate(sched, memory=Memory(activation=1, wgrad=0)).peak_memory[0]
    return max(held, key=held.__getitem__), held


class Bench:
    """The stage, its pipeline and the step's batch, and how to switch the layers' policy."""

    def __init__(self, args: argparse.Namespace, seq: int, schedule: str) -> None:
        import transformers

        from zbpp import Pipeline
        from zbpp.models.hf import causal_lm_stages
        from zbpp.schedules import build

        self.cuda = args.device.startswith("cuda")
        dtype = torch.bfloat16 if self.cuda else torch.float32
        config = transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=seq,
            tie_word_embeddings=False)
        self.sched = build(schedule, num_ranks=1, num_microbatches=args.microbatches)
        stages, kwargs = causal_lm_stages(config, self.sched, 0, device=args.device, dtype=dtype,
                                          attn_implementation="sdpa")
        self.stage = stages[0]
        self.loss_fn = kwargs["loss_fn"]
        self.pipe = Pipeline(stages, self.sched, record_task_times=True, **kwargs)
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, args.vocab, (args.microbatches, seq), generator=gen).to(args.device)
        self.layers = [n for n, _ in self.stage.named_modules() if n.rpartition(".")[0] == "model.layers"]
        self.timer = Timer(self.cuda)

    def set_policy(self, policy: str, offload_layers: int) -> None:
        """Every decoder layer under `policy`; offload only on the first `offload_layers`."""
        from zbpp.models.recompute import apply_activation_policy

        apply_activation_policy(self.stage, {n: policy if policy != "offload" or i < offload_layers else "none"
                                             for i, n in enumerate(self.layers)})

    def step(self) -> None:
        self.pipe.step({"input_ids": self.ids}, target=self.ids)

    def timed_step(self) -> tuple[float, int | None]:
        """Milliseconds of one step and its peak bytes beyond what was allocated before it."""
        self.stage.zero_grad(set_to_none=False)  # gradients stay allocated: static, like the parameters
        base = None
        if self.cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        ms = self.timer.time(self.step)
        return ms, (torch.cuda.max_memory_allocated() - base if base is not None else None)


class _WithLoss(nn.Module):
    """The stage and its loss, as the pipeline's F runs them on the last stage."""

    def __init__(self, stage: nn.Module, loss_fn: Any) -> None:
        super().__init__()
        self.stage, self.loss_fn = stage, loss_fn

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.stage(input_ids=ids), ids)


def measure_bytes(bench: Bench) -> tuple[dict[str, Any], int, int]:
    """Per policy, one decoder layer's `ActivationCost` on one microbatch; the bytes the rest of
    the stage keeps F->B (the whole stage's under none minus its layers'); and the whole stage's
    B transient under none (the loss's float32 gradients, mostly), taken as the rest's."""
    from zbpp.models.recompute import measure_activation_policies

    ids = bench.ids[:1]
    seen: dict[str, Any] = {}
    layer = bench.stage.get_submodule(bench.layers[0])
    hook = layer.register_forward_pre_hook(lambda m, a, k: seen.update(a=a, k=k), with_kwargs=True)
    with torch.no_grad():
        bench.stage(input_ids=ids)
    hook.remove()
    per_layer = measure_activation_policies(layer, *seen["a"], **seen["k"])
    whole = measure_activation_policies(_WithLoss(bench.stage, bench.loss_fn), ids, policies=("none",))["none"]
    rest = whole.kept_f_to_b - len(bench.layers) * per_layer["none"].kept_f_to_b
    if rest < 0:  # storages shared by layers counted once per layer: said, and the rest taken as 0
        log(f"WARNING: the stage keeps {whole.kept_f_to_b} bytes under none, less than its {len(bench.layers)} layers' "
            f"{per_layer['none'].kept_f_to_b} each; the rest of the stage is taken as 0")
    return per_layer, max(0, rest), whole.b_transient


def host_bandwidth(cuda: bool, nbytes: int = 256 * 2**20) -> float | None:
    """Bytes per second of a device-to-pinned-host copy (None on the CPU)."""
    if not cuda:
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    timer = Timer(True)
    ms = min(timer.time(lambda: dst.copy_(src, non_blocking=True)) for _ in range(3))
    return nbytes / (ms * 1e-3)


def predict(sched: Any, num_layers: int, costs: Any, per_layer: dict[str, Any], rest: int, rest_transient: float,
            policy: str, offload_layers: int, host_bps: float) -> Any:
    """`simulate_policies` of the bench's schedule on a one-stage profile of the measured bytes:
    the decoder layers (each offering `policy`, offload only the first `offload_layers`), then the
    rest of the stage (embedding, final norm, head, loss: its F runs last, its B first) with B's
    transient `rest_transient`. Each layer's B transient is the measured ``b_transient`` of its
    policy. Times: the none step's measured F and backward, shared evenly by the layers; recompute
    at the F's measured FLOP rate. The one-rank GPipe runs BW tasks: a BW's B part adds what W
    needs and frees it again."""
    from zbpp.schedules.policies import simulate_policies
    from zbpp.schedules.profile import Layer, PolicyCost, Profile

    n = num_layers
    f, b, w = (getattr(costs, k)[0] / n for k in ("f", "b", "w"))
    none = per_layer["none"]
    flops_per_s = max(1.0, none.forward_flops / f) if f > 0 else 1.0
    layers = []
    for i in range(n):
        offer = policy != "none" and (policy != "offload" or i < offload_layers)
        offers = {policy: PolicyCost.from_measured(per_layer[policy], flops_per_s)} if offer else {}
        layers.append(Layer(f"layer {i}", f, b, w, activation=none.kept_f_to_b, wgrad=none.kept_b_to_w,
                            policies=offers, transient=getattr(none, "b_transient", 0)))
    layers.append(Layer("embedding, norm, head, loss", 0, 0, 0, activation=rest, transient=rest_transient))
    return simulate_policies(sched, Profile(layers, host_bytes_per_s=host_bps), [range(n + 1)], [policy])


def trace_offload(bench: Bench, trace_dir: Path | None) -> dict:
    """One offload step under torch.profiler; its per-microbatch copy times beside the F->backward gaps."""
    from torch.profiler import ProfilerActivity, profile

    from zbpp.schedules import Kind
    from zbpp.viz import write_trace

    bench.stage.zero_grad(set_to_none=False)
    with profile(activities=[ProfilerActivity.CUDA if bench.cuda else ProfilerActivity.CPU]) as prof:
        bench.step()
        bench.timer.sync()
    records = bench.pipe.task_times()
    trace_dir = trace_dir or Path(tempfile.mkdtemp(prefix="bench_activation_policies-"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"kernels_trace": str(trace_dir / "offload_step.json"),
                           "tasks_trace": str(trace_dir / "offload_tasks.json")}
    prof.export_chrome_trace(out["kernels_trace"])
    write_trace(out["tasks_trace"], measured=records, schedule=bench.sched)
    events = json.loads(Path(out["kernels_trace"]).read_text())["traceEvents"]
    at = {r["action"]: r for r in records}
    order = bench.sched.orders[0]
    f_order = [a.microbatch for a in order if a.kind is Kind.F]
    b_order = [a.microbatch for a in order if a.kind in (Kind.B, Kind.BW)]
    back = {a.microbatch: str(a) for a in order if a.kind in (Kind.B, Kind.BW)}
    gaps = {j: (at[back[j]]["start"] - at[f"F0.{j}"]["end"]) * 1e3 for j in f_order}
    m = len(f_order)
    copies = {}  # direction -> per microbatch [ms, bytes]: the k-th group of equal size, in F (or backward) order
    for d, mbs in (("DtoH", f_order), ("HtoD", b_order)):
        # pinned copies of more than a scalar: .item() goes through pinned memory too
        ev = sorted((e for e in events if e.get("cat") == "gpu_memcpy" and d in e["name"] and "Pinned" in e["name"]
                     and e.get("args", {}).get("bytes", 1 << 20) > 64), key=lambda e: e["ts"])
        out[f"{d}_total"] = {"copies": len(ev), "ms": round(sum(e["dur"] for e in ev) / 1e3, 3)}
        if ev and len(ev) % m == 0:  # else the copies cannot be told apart by microbatch: totals only
            size = len(ev) // m
            groups = {j: ev[i * size:(i + 1) * size] for i, j in enumerate(mbs)}
            copies[d] = {j: [sum(e["dur"] for e in g) / 1e3, sum(e.get("args", {}).get("bytes", 0) for e in g)]
                         for j, g in groups.items()}
    out["per_microbatch"] = [{"microbatch": j, "gap_ms": round(gaps[j], 3),
                              **{f"{d}_ms": round(c[j][0], 3) for d, c in copies.items()},
                              **{f"{d}_bytes": c[j][1] for d, c in copies.items()}} for j in f_order]
    out["step_ms"] = round(max(r["end"] for r in records) * 1e3, 3)
    return out


def run_at(args: argparse.Namespace, seq: int, schedule: str) -> dict:
    from zbpp.schedules import Costs

    bench = Bench(args, seq, schedule)
    log(f"seq {seq}: built {len(bench.layers)} layers; probe step (none)")
    bench.set_policy("none", 0)
    for _ in range(2):  # the largest footprint first (an OOM falls back to a shorter sequence); timed warm
        bench.timed_step()
    costs = Costs.from_task_times(bench.pipe.task_times(), 1)
    static = torch.cuda.memory_allocated() if bench.cuda else None
    param_grad = 2 * sum(t.numel() * t.element_size() for t in bench.stage.parameters())
    per_layer, rest, rest_transient = measure_bytes(bench)
    log(f"measured bytes per microbatch: layer none {per_layer['none'].kept_f_to_b / GIB:.3f} GiB, "
        f"rest {rest / GIB:.3f} GiB")
    host_bps = host_bandwidth(bench.cuda)
    if args.offload_layers == "auto":
        one = per_layer["offload"].host_bytes / (host_bps or 1e10)  # nominal 10 GB/s on the CPU
        k = max(1, min(len(bench.layers), int(costs.f[0] / one)))
    else:
        k = int(args.offload_layers)
    if "offload" in args.policy_list:
        log(f"offload: {k} of {len(bench.layers)} layers ({args.offload_layers}); host link "
            f"{'%.1f GB/s' % (host_bps / 1e9) if host_bps else 'not measured on the CPU'}")
    times: dict[str, list[float]] = {p: [] for p in args.policy_list}
    peaks: dict[str, int | None] = {p: None for p in args.policy_list}
    for r in range(args.rounds):
        for p in args.policy_list:
            bench.set_policy(p, k)
            for _ in range(args.warmup):
                bench.timed_step()
            for _ in range(args.steps):
                ms, peak = bench.timed_step()
                times[p].append(ms)
                if peak is not None:
                    peaks[p] = max(peaks[p] or 0, peak)
            log(f"round {r + 1}/{args.rounds} {p}: {statistics.median(times[p]):.1f} ms/step")
    trace = None
    if "offload" in args.policy_list:
        bench.set_policy("offload", k)
        trace = trace_offload(bench, args.trace_dir)
        log(f"traced one offload step into {Path(trace['kernels_trace']).parent}")
    ref = statistics.median(times["none"])
    results = {}
    for p in args.policy_list:
        sim = predict(bench.sched, len(bench.layers), costs, per_layer, rest, rest_transient, p, k, host_bps or 1e10)
        pred, ms = sim.result.peak_memory[0], statistics.median(times[p])
        results[p] = {"ms": round(ms, 2), "vs_none": round(ms / ref, 3), "times_ms": [round(t, 2) for t in times[p]],
                      "measured_bytes": peaks[p], "predicted_bytes": pred,
                      "measured_gib": None if peaks[p] is None else round(peaks[p] / GIB, 3),
                      "predicted_gib": round(pred / GIB, 3),
                      "predicted_over_measured": round(pred / peaks[p], 3) if peaks[p] else None,
                      "simulated_ms": round(sim.result.cost * 1e3, 2)}
        if p == "offload":
            results[p] |= {"simulated_gap_ms": round(sim.gaps[0] * 1e3, 2),
                           "simulated_exposed_copy_ms": round(sim.exposed[0] * 1e3, 2)}
    return {"seq_len": seq, "schedule": schedule, "offload_layers": k, "static_gib": static and round(static / GIB, 3),
            "param_and_grad_gib": round(param_grad / GIB, 3),
            "host_gb_per_s": host_bps and round(host_bps / 1e9, 2), "rest_bytes": rest,
            "rest_b_transient": rest_transient,
            "layer_costs": {p: dataclasses.asdict(c) for p, c in per_layer.items()},
            "measured_costs_ms": {k_: round(getattr(costs, k_)[0] * 1e3, 3) for k_ in ("f", "b", "w")},
            "results": results, "offload_trace": trace}


def print_run(run: dict, m: int) -> None:
    print(f"\nseq {run['seq_len']}, {run['schedule']} on one rank, {m} microbatches in flight; static "
          f"{run['static_gib']} GiB (parameters and gradients {run['param_and_grad_gib']} GiB); "
          f"offload on {run['offload_layers']} layer(s)")
    print(f"{'policy':<10} {'ms/step':>9} {'vs none':>8} {'measured GiB':>13} {'predicted GiB':>14} {'pred/meas':>10}")
    for p, r in run["results"].items():
        meas = "-" if r["measured_gib"] is None else f"{r['measured_gib']:.3f}"
        ratio = "-" if r["predicted_over_measured"] is None else f"{r['predicted_over_measured']:.3f}"
        print(f"{p:<10} {r['ms']:>9.2f} {r['vs_none']:>8.3f} {meas:>13} {r['predicted_gib']:>14.3f} {ratio:>10}")
    trace = run["offload_trace"]
    if trace:
        print(f"offload step {trace['step_ms']:.1f} ms; per microbatch: F->backward gap, copies to the host and back")
        for row in trace["per_microbatch"]:
            cps = " ".join(f"{d} {row[d + '_ms']:.2f} ms ({row[d + '_bytes'] / GIB:.2f} GiB)"
                           for d in ("DtoH", "HtoD") if d + "_ms" in row)
            print(f"  mb {row['microbatch']}: gap {row['gap_ms']:.2f} ms  {cps or 'no device copies (CPU)'}")
        totals = {d: trace[d + "_total"] for d in ("DtoH", "HtoD")}
        print("  the step's copies to the host and back: "
              + ", ".join(f"{d} {t['copies']} copies, {t['ms']:.1f} ms" for d, t in totals.items()))


def rederive(path: Path, formula: bool = False) -> dict[str, dict[str, float]]:
    """The simulator's peak per policy from a saved report's measured bytes, beside its measured
    peak, without a device: the schedule, bytes, times and host link as the report holds them, B's
    transients measured where it has them (``b_transient``, ``rest_b_transient``), else from the
    formula: a policy's B holds what it re-creates or reloads, none's bytes less those it keeps;
    the loss's B two float32 logit-sized gradients, ``8 * seq * vocab`` bytes (`formula`: always)."""
    from types import SimpleNamespace

    from zbpp.schedules import Costs, build

    report = json.loads(Path(path).read_text())
    cfg, run = report["config"], report["run"]
    if formula:
        run.pop("rest_b_transient", None)
        for cost in run["layer_costs"].values():
            cost.pop("b_transient", None)
    none_kept = run["layer_costs"]["none"]["kept_f_to_b"]
    per_layer = {p: SimpleNamespace(**{"b_transient": max(0, none_kept - c["kept_f_to_b"]), **c})
                 for p, c in run["layer_costs"].items()}
    rest_transient = run.get("rest_b_transient", 8 * run["seq_len"] * cfg["vocab"])
    sched = build(run["schedule"], num_ranks=1, num_microbatches=cfg["microbatches"])
    costs = Costs(*([run["measured_costs_ms"][k] / 1e3] for k in ("f", "b", "w")))  # one stage
    how = "measured" if "rest_b_transient" in run else "formula"
    print(f"{path}: B transients from the {how}; layer: none {per_layer['none'].b_transient / GIB:.3f} GiB, "
          f"the rest of the stage {rest_transient / GIB:.3f} GiB")
    print(f"{'policy':<10} {'measured GiB':>13} {'predicted GiB':>14} {'pred/meas':>10}")
    out = {}
    for p, r in run["results"].items():
        sim = predict(sched, cfg["layers"], costs, per_layer, run["rest_bytes"], rest_transient, p,
                      run["offload_layers"], run["host_gb_per_s"] * 1e9)
        pred = sim.result.peak_memory[0]
        out[p] = {"measured_bytes": r["measured_bytes"], "predicted_bytes": pred,
                  "predicted_over_measured": round(pred / r["measured_bytes"], 3)}
        print(f"{p:<10} {r['measured_bytes'] / GIB:>13.3f} {pred / GIB:>14.3f} {pred / r['measured_bytes']:>10.3f}")
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.rederive is not None:
        return rederive(args.rederive, formula=args.formula_transients)
    cuda = args.device.startswith("cuda")
    schedule, held = most_in_flight(args.microbatches)
    log(f"one-rank schedules, microbatches held at the peak: {held}; using {schedule}")
    if not cuda:
        log("on the CPU: no allocator statistics (measured GiB '-'), offload copies are host clones (no side stream, "
            "no device copies in the trace), the host link is not measured (a nominal 10 GB/s chooses the offload)")
    report: dict[str, Any] = {"benchmark": "bench_activation_policies", "env": run_env(cuda),
                              "argv": sys.argv[1:] if argv is None else argv,
                              "config": {k: getattr(args, k) for k in ("hidden", "ffn", "heads", "kv_heads", "layers",
                                                                       "vocab", "microbatches", "rounds", "steps",
                                                                       "warmup")},
                              "in_flight": held[schedule]}
    for seq in [args.seq_len] + [s for s in SEQ_FALLBACK if s < args.seq_len]:
        try:
            report["run"] = run_at(args, seq, schedule)
            break
        except torch.OutOfMemoryError as exc:
            report.setdefault("out_of_memory", []).append({"seq_len": seq, "error": str(exc)[:300]})
        gc.collect()  # outside the handler: the exception's frames no longer hold the stage
        torch.cuda.empty_cache()
        log(f"seq {seq}: out of memory; trying a shorter sequence")
    else:
        write_report(report, args.out)
        raise SystemExit("out of memory at every sequence length tried")
    print_run(report["run"], args.microbatches)
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
