"""Layers and schedule chosen together (`zbpp.schedules.planner.search`) against common practice.

Profiles from public model shapes, per-layer costs from FLOP counts at a stated throughput
(`zbpp.schedules.profile.transformer_profile`: 400 TFLOP/s per GPU, 50 GB/s per link, 7.5 bytes of
static memory per parameter; written to benchmarks/profiles/):

- llama3-8b: 32 layers, hidden 4096, FFN 14336 (SwiGLU), 32 heads / 8 KV heads, vocabulary 128256,
  sequence 8192, no tensor parallelism;
- llama3-70b: 80 layers, hidden 8192, FFN 28672, 64 / 8 heads, vocabulary 128256, sequence 8192,
  tensor parallelism 8;
- gpt-128k: 40 layers, hidden 5120, FFN 20480 (GELU), 40 heads, vocabulary 131072, sequence 4096.

For p = 4, 8, 16 and m = 2p, 4p, with a budget of 80 GB per rank (static and activation memory),
in the same simulator, the step time and the largest peak over the ranks of:

- joint: `search` (every family, its own splits, refined by simulation);
- uniform + best fixed: the blocks split evenly (embedding on the first stage, head on the last),
  the best fitting fixed schedule (1F1B, ZB-H1, ZB-H2, interleaved 1F1B / ZB with 2 stages per rank,
  ZB-V, V-Half, V-Min, DualPipeV);
- torchtitan's split (embedding and head each counted as one layer, layers spread evenly, the
  remainder to the first stages) with interleaved 1F1B, interleaved ZB (2 stages per rank; zbpp's
  zb-interleaved, whose orders equal torch's ScheduleInterleavedZeroBubble) and ZB-V;
- parameter-count balancing (the largest stage parameter count as small as can be) with 1F1B.

The gap to the bound is the joint pick's step over `zbpp.schedules.bounds.lower_bound` for its
split and placement, each rank limited to the budget less its static memory.

A cell is "OOM" when some rank exceeds the budget. The search time of each joint row is printed
(one process, one core).

    python benchmarks/bench_planner.py --out planner.json --markdown docs/uneven.md

With ``--policies``, the activation policies instead (none, full, selective, offload; one per
rank, chosen by `search` with the split and the schedule): Llama-3 8B and 70B at p = 8, 16,
m = 2p, 4p, budgets 80 and 40 GB, the planner's pick against full recompute on every block
(``policies=["full"]``, the split and schedule still searched) and against no recompute
(``["none"]``):

    python benchmarks/bench_planner.py --policies --out policies.json --markdown docs/uneven.md

``--ranks-per-node N`` shares each node's host link (the profile's 50 GB/s) among N ranks that
offload at once (`search`'s ``ranks_per_node``), written to the table marked ``bench_policies_shared``:

    python benchmarks/bench_planner.py --policies --ranks-per-node 8 --markdown docs/uneven.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provenance import code_identity  # noqa: E402 - benchmarks/provenance.py, beside this script
from zbpp.schedules.planner import evaluate, search, split_balanced, split_evenly  # noqa: E402
from zbpp.schedules.profile import Profile, transformer_profile  # noqa: E402

BUDGET = 80e9
MODELS = {
    "llama3-8b": dict(num_layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, seq=8192),
    "llama3-70b": dict(num_layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256, seq=8192,
                       tensor_parallel=8),
    "gpt-128k": dict(num_layers=40, hidden=5120, ffn=20480, heads=40, vocab=131072, seq=4096, gated=False),
}
FIXED = [("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("interleaved-1f1b", 2), ("zb-interleaved", 2),
         ("zb-v", 2), ("v-half", 2), ("v-min", 2), ("dualpipe-v", 2)]
TITAN = [("interleaved-1f1b", 2), ("zb-interleaved", 2), ("zb-v", 2)]


def profiles(folder: Path) -> dict[str, Profile]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, shape in MODELS.items():
        prof = transformer_profile(name=name, **shape)
        prof.save(folder / f"{name}.json")
        out[name] = prof
    return out


def _cell(o) -> dict:
    return {"schedule": o.label, "step": o.step, "peak": list(o.peak), "fits": o.fits}


def row(prof: Profile, p: int, m: int) -> dict:
    L = len(prof)
    t = time.perf_counter()
    plan = search(prof, p, m, BUDGET)
    seconds = time.perf_counter() - t
    out = {"model": prof.name, "p": p, "m": m, "search_s": seconds,
           "joint": {"schedule": plan.options[0].label, "split": plan.split, "step": plan.step,
                     "peak": list(plan.peak), "fits": True, "stages": [[r.start, r.stop] for r in plan.stages]}}
    t = time.perf_counter()
    lb = plan.bound()
    out["bound_s"] = time.perf_counter() - t
    out["joint"]["bound"] = lb.makespan
    out["joint"]["bound_over_splits"] = plan.searched.bound_over_splits
    out["joint"]["exact"] = plan.searched.exact
    uniform = [evaluate(prof, p, m, split_evenly(L, k * p, first=1, last=1), name, chunks=k, memory_budget=BUDGET)
               for name, k in FIXED]
    fitting = [o for o in uniform if o.fits]
    out["uniform"] = _cell(min(fitting, key=lambda o: o.step)) if fitting else {"schedule": "-", "fits": False}
    for name, k in TITAN:
        out[f"titan {name}"] = _cell(evaluate(prof, p, m, split_evenly(L, k * p), name, chunks=k, memory_budget=BUDGET))
    params = split_balanced([x.static for x in prof.layers], p)
    out["params 1f1b"] = _cell(evaluate(prof, p, m, params, "1f1b", memory_budget=BUDGET))
    return out


COLUMNS = ["joint", "uniform", "titan interleaved-1f1b", "titan zb-interleaved", "titan zb-v", "params 1f1b"]
HEADS = ["joint search", "uniform + best fixed", "titan + interleaved 1F1B", "titan + interleaved ZB", "titan + ZB-V",
         "param-balanced + 1F1B"]


def _fmt(cell: dict, best: float) -> str:
    if not cell.get("fits"):
        return "OOM" if cell.get("peak") else "-"
    return f"{cell['step']:.3f} ({100 * (cell['step'] / best - 1):+.1f}%) / {max(cell['peak']) / 1e9:.1f}"


def markdown(rows: list[dict]) -> str:
    lines = ["| model | p | m | " + " | ".join(HEADS) + " | joint pick | gap to bound | gap to bound over all splits | search s |",
             "|---|---:|---:|" + "---|" * len(HEADS) + "---|---:|---:|---:|"]
    for r in rows:
        best = r["joint"]["step"]
        cells = [_fmt(r[c], best) for c in COLUMNS]
        lines.append(f"| {r['model']} | {r['p']} | {r['m']} | " + " | ".join(cells)
                     + f" | {r['joint']['schedule']} ({r['joint']['split']}) | "
                     f"+{max(0.0, 100 * (best / r['joint']['bound'] - 1)):.2f}% | "
                     f"+{max(0.0, 100 * (best / r['joint']['bound_over_splits'] - 1)):.2f}%"
                     f"{' (exact)' if r['joint']['exact'] else ''} | {r['search_s']:.2f} |")
    return "\n".join(lines)


def _policy_summary(plan) -> str:
    """Each stage's policy in stage order, run-length coded: e.g. "offload x2, none x6"."""
    runs: list[list] = []
    for q in plan.policies or ("none",) * plan.schedule.num_stages:
        if runs and runs[-1][0] == q:
            runs[-1][1] += 1
        else:
            runs.append([q, 1])
    return ", ".join(f"{q} x{k}" if k > 1 else q for q, k in runs)


def policy_row(prof: Profile, p: int, m: int, budget: float, ranks_per_node: int = 1) -> dict:
    out: dict = {"model": prof.name, "p": p, "m": m, "budget": budget, "ranks_per_node": ranks_per_node}
    for key, allowed in (("planner", None), ("full", ["full"]), ("none", ["none"])):
        t = time.perf_counter()
        try:
            plan = search(prof, p, m, budget, policies=allowed, ranks_per_node=ranks_per_node)
        except ValueError as exc:
            out[key] = {"fits": False, "error": str(exc)}
            continue
        out[key] = {"fits": True, "schedule": plan.options[0].label, "step": plan.step, "peak": list(plan.peak),
                    "stages": [[r.start, r.stop] for r in plan.stages], "policies": list(plan.policies),
                    "per_stage": _policy_summary(plan), "search_s": time.perf_counter() - t}
        assert max(plan.peak) <= budget * (1 + 1e-9), (prof.name, p, m, key)
    return out


def policy_markdown(rows: list[dict]) -> str:
    lines = ["| model | p | m | budget GB | planner: schedule, policy per stage (stages 0..n-1) | planner step / peak | "
             "full recompute everywhere | no recompute | planner vs full | search s |",
             "|---|---:|---:|---:|---|---|---|---|---:|---:|"]
    for r in rows:
        pl, full, none = r["planner"], r["full"], r["none"]

        def cell(c: dict) -> str:
            return f"{c['step']:.3f} / {max(c['peak']) / 1e9:.1f} ({c['schedule']})" if c["fits"] else "does not fit"

        gain = f"{100 * (1 - pl['step'] / full['step']):.1f}% faster" if pl["fits"] and full["fits"] else "-"
        lines.append(f"| {r['model']} | {r['p']} | {r['m']} | {r['budget'] / 1e9:g} | "
                     f"{pl.get('schedule', '-')}: {pl.get('per_stage', '-')} | {cell(pl)} | {cell(full)} | {cell(none)} | "
                     f"{gain} | {pl.get('search_s', 0):.2f} |")
    return "\n".join(lines)


def _write_table(path: Path, marker: str, table: str) -> None:
    text = path.read_text()
    start, end = f"<!-- table: {marker} -->", "<!-- end table -->"
    if start not in text:
        raise SystemExit(f"{path}: no {start} marker to write the table between")
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    path.write_text(head + start + "\n" + table + "\n" + end + tail)


def main_policies(args: argparse.Namespace) -> int:
    profs = profiles(ROOT / "benchmarks" / "profiles")
    rows = []
    for name in ("llama3-8b", "llama3-70b"):
        for p in (8,) if args.quick else (8, 16):
            for m in (2 * p, 4 * p):
                for budget in (80e9, 40e9):
                    r = policy_row(profs[name], p, m, budget, args.ranks_per_node)
                    rows.append(r)
                    pl = r["planner"]
                    print(f"{name:<11} p={p:<2} m={m:<3} {budget / 1e9:g} GB  planner "
                          f"{pl.get('schedule', '-')} [{pl.get('per_stage', 'does not fit')}] "
                          f"{pl.get('step', float('nan')):.4f}  full {r['full'].get('step', float('nan')):.4f}  "
                          f"none {r['none'].get('step', float('nan')):.4f}", flush=True)
    table = policy_markdown(rows)
    print()
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "policies", **code_identity(), "rows": rows}, indent=1) + "\n")
    if args.markdown:
        _write_table(Path(args.markdown), "bench_policies" if args.ranks_per_node == 1 else "bench_policies_shared", table)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--markdown", default=None, help="write the table into this markdown file (between its markers)")
    ap.add_argument("--quick", action="store_true", help="p = 4 only (with --policies: p = 8 only)")
    ap.add_argument("--policies", action="store_true", help="the activation-policy table instead (see the docstring)")
    ap.add_argument("--ranks-per-node", type=int, default=1,
                    help="with --policies: ranks of a node sharing its host link (default 1: a link each)")
    args = ap.parse_args(argv)
    if args.policies:
        return main_policies(args)
    profs = profiles(ROOT / "benchmarks" / "profiles")
    rows = []
    for prof in profs.values():
        for p in (4,) if args.quick else (4, 8, 16):
            for m in (2 * p, 4 * p):
                r = row(prof, p, m)
                rows.append(r)
                worse = [c for c in COLUMNS[1:] if r[c].get("fits") and r[c]["step"] < r["joint"]["step"] * (1 - 1e-9)]
                print(f"{r['model']:<11} p={p:<2} m={m:<3} joint {r['joint']['schedule']:<20} step {r['joint']['step']:.4f} "
                      f"peak {max(r['joint']['peak']) / 1e9:5.1f} GB  search {r['search_s']:.2f} s"
                      + (f"  BEATEN BY {worse}" if worse else ""), flush=True)
    table = markdown(rows)
    print()
    print(table)
    print("\ncells: step time in seconds (vs the joint search) / largest peak over the ranks in GB; OOM: over 80 GB")
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "planner", "budget": BUDGET, **code_identity(), "rows": rows}, indent=1) + "\n")
    if args.markdown:
        _write_table(Path(args.markdown), "bench_planner", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
