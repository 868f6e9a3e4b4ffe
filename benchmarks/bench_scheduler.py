"""Scheduler speed: zbpp (build + simulate) against torch.distributed.pipelining (generate + lower + simulate).

For each schedule pair and size, on one process and without a process group:

- zbpp:  ``build(name, ...)`` then ``simulate(...)`` (start/end of every task, bubble rate and
  memory per rank); ``validate(...)`` (counts, placement, deadlock check) is timed separately.
- torch: the schedule class's own order generation (``_calculate_single_rank_operations`` for
  every rank, plus ``_add_bubbles_to_actions`` for InterleavedZeroBubble; ``_get_pipeline_order``
  for Schedule1F1B), its lowering ``_add_send_recv`` and its step simulator
  ``_simulate_comms_compute`` (which computes neither times nor memory). DualPipeV's
  ``OVERLAP_F_B`` cells are flattened into their two sub-actions first: torch's simulator looks up
  the rank of the cell's own stage index (-1) and fails on them.

Pairs (zbpp / torch):

- 1f1b / ScheduleInterleaved1F1B with one stage per rank, which is 1F1B (torch 2.14's
  Schedule1F1B._get_pipeline_order is not used: its last rank's order starts at F1 and cannot
  be lowered);
- interleaved-1f1b / ScheduleInterleaved1F1B with two stages per rank;
- zb-h1 / ScheduleInterleavedZeroBubble with one stage per rank (its ZB1P is ZB-H1);
- zb-v / ScheduleZBVZeroBubble and dualpipe-v / ScheduleDualPipeV;
- zbv-auto (build alone) against torch generating its ZBV schedule at p=32, m=256 when
zbv-auto is registered. Each time is the best of --repeat runs.

A second table (``--only auto``) measures zb-auto and zbv-auto on the profiles of
tests/schedules/data/authors_heuristic.json: the zero-bubble paper's (p = 8..32, m = 3p..8p, its
ZB-1p / ZB-2p bubble rates; the arXiv version's ZB-V profiles) and random ones, each against the
paper's bubble rate, the paper authors' own heuristic (bubble rate and build time as recorded in
that file, which says how) and `zbpp.schedules.bounds.lower_bound`. The authors' times were
recorded on a shared 2-core CPU: compare ratios, not seconds, across machines.

A third table (``--only large``) times build and validate of every fixed schedule (no torch
counterpart needed: v-half and v-min too) at p = 64 and 128, m = 32, where work that grows as
p x tasks shows.

    python benchmarks/bench_scheduler.py                 # p in 4..32, m in 32..256, then auto
    python benchmarks/bench_scheduler.py --quick --out bench.json
    python benchmarks/bench_scheduler.py --only auto --out auto.json
    python benchmarks/bench_scheduler.py --only large
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.distributed.pipelining import schedules as S  # noqa: E402

from provenance import code_identity  # noqa: E402 - benchmarks/provenance.py, beside this script
from tests.interop.torch_orders import compute_only, flatten_overlaps, stage_to_rank, torch_schedule  # noqa: E402
from zbpp.schedules import Costs, Memory, available, build, simulate, validate  # noqa: E402

# (zbpp name, zbpp options, torch class key of tests/interop/torch_orders.TORCH_CLASSES)
PAIRS: list[tuple[str, dict[str, Any], str]] = [
    ("1f1b", {}, "Interleaved1F1B"),
    ("interleaved-1f1b", {"chunks": 2}, "Interleaved1F1B-2"),
    ("zb-h1", {}, "InterleavedZeroBubble"),
    ("zb-v", {}, "ZBVZeroBubble"),
    ("dualpipe-v", {}, "DualPipeV"),
]
COSTS = Costs(f=1.0, b=1.0, w=1.0, comm=0.0)
MEMORY = Memory(activation=1.0, wgrad=1 / 3)


def best_of(repeat: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Best wall time of `repeat` calls, with the garbage collector off while timing (as timeit)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        out = None
        gc.disable()
        try:
            t = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t)
        finally:
            gc.enable()
    return best, out


def torch_generate(inst: Any, p: int) -> dict[int, list]:
    """The class's own per-rank order generation, as its constructor runs it."""
    if isinstance(inst, S.Schedule1F1B):
        return compute_only(inst._get_pipeline_order())
    inst.pipeline_order = {r: inst._calculate_single_rank_operations(r) for r in range(p)}
    if isinstance(inst, S.ScheduleInterleavedZeroBubble):
        inst.pipeline_order = inst._add_bubbles_to_actions(inst.n_local_stages * p)
    # DualPipeV's OVERLAP_F_B cells become their two sub-actions: torch's simulator fails on them
    return flatten_overlaps(compute_only(inst.pipeline_order))


def bench_torch(torch_name: str, p: int, m: int, repeat: int) -> dict[str, float]:
    inst = torch_schedule(torch_name, p, m)  # constructed once, untimed: we re-run its parts
    to_rank = stage_to_rank(inst)
    n = inst._num_stages
    t_gen, order = best_of(repeat, lambda: torch_generate(inst, p))
    t_lower, lowered = best_of(repeat, lambda: S._add_send_recv(copy.copy({r: list(a) for r, a in order.items()}), to_rank, n))
    t_sim, _ = best_of(repeat, lambda: S._simulate_comms_compute(lowered, to_rank, n))
    t_val, _ = best_of(repeat, lambda: S._validate_schedule(order, p, n, m))
    return {"generate": t_gen, "lower": t_lower, "simulate": t_sim, "total": t_gen + t_lower + t_sim, "validate": t_val}


def bench_zbpp(name: str, opts: dict[str, Any], p: int, m: int, repeat: int) -> dict[str, Any]:
    t_build, sched = best_of(repeat, lambda: build(name, num_ranks=p, num_microbatches=m, **opts))
    t_sim, res = best_of(repeat, lambda: simulate(sched, COSTS, MEMORY))
    t_val, _ = best_of(repeat, lambda: validate(sched))
    return {"build": t_build, "simulate": t_sim, "total": t_build + t_sim, "validate": t_val,
            "tasks": sched.num_tasks, "bubble_rate": res.bubble_rate}


AUTHORS = ROOT / "tests" / "schedules" / "data" / "authors_heuristic.json"


def bench_auto(repeat: int, quick: bool) -> list[dict[str, Any]]:
    """zb-auto / zbv-auto against the paper, the authors' heuristic and the lower bound (see the docstring)."""
    from zbpp.schedules.bounds import lower_bound

    rows = json.loads(AUTHORS.read_text())["rows"]
    if quick:
        rows = [r for r in rows if r["p"] <= 8][:12]
    head = (f"{'schedule':<9} {'group':<12} {'p':>3} {'m':>4} {'mem':>5} | {'paper':>7} {'authors':>7} {'zbpp':>7} "
            f"{'bound':>7} | {'zbpp s':>7} {'auth. s':>7} {'ratio':>5}")
    print("\nautomatic schedules: bubble rates (paper, the authors' heuristic, zbpp, lower bound) and build times "
          f"(zbpp best of {repeat}; the authors' as recorded)")
    print(head)
    print("-" * len(head))
    out = []
    for r in rows:
        costs, memory = Costs(r["f"], r["b"], r["w"], r["comm"]), Memory(r["activation"], r["wgrad"])
        kw = dict(num_ranks=r["p"], num_microbatches=r["m"], costs=costs, memory=memory, memory_limit=r["memory_limit"])
        t, sched = best_of(repeat, lambda: build(r["schedule"], **kw))
        res = simulate(sched, costs, memory)
        lb = lower_bound(sched.placement, r["m"], costs, memory, r["memory_limit"])
        theirs = r["authors"]
        mem_x = r["memory_limit"] / (r["activation"] * r["p"] * (2 if r["schedule"] == "zbv-auto" else 1))
        row = {"schedule": r["schedule"], "group": r["group"], "p": r["p"], "m": r["m"], "memory_x": mem_x,
               "paper_bubble_rate": r.get("paper_bubble_rate"), "authors_bubble_rate": theirs["bubble_rate"],
               "bubble_rate": res.bubble_rate, "bound_bubble_rate": lb.bubble_rate, "cost": res.cost,
               "authors_cost": theirs["cost"], "build_s": t, "authors_build_s": theirs["build_s"],
               "peak_ok": max(res.peak_memory) <= r["memory_limit"] * (1 + 1e-9)}
        out.append(row)
        paper = f"{row['paper_bubble_rate']:.4f}" if row["paper_bubble_rate"] is not None else "-"
        print(f"{r['schedule']:<9} {r['group'][:12]:<12} {r['p']:>3} {r['m']:>4} {mem_x:>4.3g}x | {paper:>7} "
              f"{theirs['bubble_rate']:>7.4f} {res.bubble_rate:>7.4f} {lb.bubble_rate:>7.4f} | {t:>7.3f} "
              f"{theirs['build_s']:>7.3f} {t / theirs['build_s']:>5.2f}", flush=True)
    better = sum(o["cost"] < o["authors_cost"] * (1 - 1e-9) for o in out)
    worse = sum(o["cost"] > o["authors_cost"] * (1 + 1e-9) for o in out)
    ratios = sorted(o["build_s"] / o["authors_build_s"] for o in out)
    print(f"\nagainst the authors' heuristic: {better} shorter, {worse} longer, {len(out) - better - worse} equal; "
          f"build time ratio median {ratios[len(ratios) // 2]:.2f}, max {ratios[-1]:.2f}; "
          f"memory limit held in {sum(o['peak_ok'] for o in out)}/{len(out)}")
    return out


LARGE = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-interleaved", "zb-v", "v-half", "v-min", "dualpipe-v"]


def bench_large(repeat: int, quick: bool) -> list[dict[str, Any]]:
    """Build and validate times of the fixed schedules at many ranks (see the docstring)."""
    sizes = [(16, 32)] if quick else [(64, 32), (128, 32)]
    print(f"\nfixed schedules at many ranks: times in s, best of {repeat}")
    head = f"{'schedule':<16} {'p':>3} {'m':>4} {'tasks':>6} | {'build':>7} {'valid.':>7}"
    print(head)
    print("-" * len(head))
    out = []
    for name in (n for n in LARGE if n in set(available())):
        for p, m in sizes:
            t_build, sched = best_of(repeat, lambda: build(name, num_ranks=p, num_microbatches=m))
            t_val, _ = best_of(repeat, lambda: validate(sched))
            out.append({"schedule": name, "p": p, "m": m, "tasks": sched.num_tasks, "build": t_build, "validate": t_val})
            print(f"{name:<16} {p:>3} {m:>4} {sched.num_tasks:>6} | {t_build:>7.3f} {t_val:>7.3f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    ap.add_argument("--repeat", type=int, default=None, help="best of N runs (default 3)")
    ap.add_argument("--out", default=None, help="write the rows as JSON to this file")
    ap.add_argument("--only", choices=("all", "torch", "auto", "large"), default="all",
                    help="torch: the torch comparison only; auto: the automatic schedules' table only; "
                    "large: the fixed schedules at many ranks only")
    args = ap.parse_args(argv)
    repeat = args.repeat or 3
    gc.collect()
    gc.freeze()  # torch's many objects out of the collector's way: timings see only our garbage
    ps = [4, 8] if args.quick else [4, 8, 16, 32]
    ms = [16, 32] if args.quick else [32, 64, 128, 256]
    names = set(available())

    rows: list[dict[str, Any]] = []
    pairs = PAIRS if args.only in ("all", "torch") else []
    head = (f"{'zbpp':<16} {'torch':<22} {'p':>3} {'m':>4} {'tasks':>6} | {'build':>7} {'sim':>7} {'total':>7} "
            f"{'valid.':>7} | {'gen':>7} {'lower':>7} {'sim':>7} {'total':>7} {'valid.':>7} | {'speedup':>7}")
    if pairs:
        print(f"times in ms, best of {repeat} | speedup = torch total (gen + lower + sim) / zbpp total (build + sim); "
              "valid. (not in the totals) = zbpp validate / torch _validate_schedule")
        print(head)
        print("-" * len(head))
    for zname, opts, tname in pairs:
        if zname not in names:
            print(f"{zname:<16} (not registered in zbpp yet: skipped)")
            continue
        for p in ps:
            for m in ms:
                if tname == "DualPipeV" and m < 2 * p:
                    continue  # torch's DualPipeV needs m >= 2p
                z = bench_zbpp(zname, opts, p, m, repeat)
                t = bench_torch(tname, p, m, repeat)
                row = {"zbpp": zname, "torch": tname, "p": p, "m": m, "zbpp_times": z, "torch_times": t,
                       "speedup": t["total"] / z["total"]}
                rows.append(row)
                print(f"{zname:<16} {tname:<22} {p:>3} {m:>4} {z['tasks']:>6} | {z['build'] * 1e3:>7.2f} "
                      f"{z['simulate'] * 1e3:>7.2f} {z['total'] * 1e3:>7.2f} {z['validate'] * 1e3:>7.2f} | "
                      f"{t['generate'] * 1e3:>7.2f} {t['lower'] * 1e3:>7.2f} {t['simulate'] * 1e3:>7.2f} "
                      f"{t['total'] * 1e3:>7.2f} {t['validate'] * 1e3:>7.2f} | {row['speedup']:>6.1f}x", flush=True)

    auto = None
    if "zbv-auto" in names and args.only in ("all", "torch"):
        p, m = (8, 32) if args.quick else (32, 256)
        t_auto, sched = best_of(repeat, lambda: build("zbv-auto", num_ranks=p, num_microbatches=m, costs=COSTS, memory=MEMORY))
        inst = torch_schedule("ZBVZeroBubble", p, m)
        t_gen, _ = best_of(repeat, lambda: torch_generate(inst, p))
        t_ctor, _ = best_of(repeat, lambda: torch_schedule("ZBVZeroBubble", p, m))
        auto = {"p": p, "m": m, "zbv_auto_build": t_auto, "torch_zbv_generate": t_gen, "torch_zbv_construct": t_ctor,
                "bubble_rate": simulate(sched, COSTS, MEMORY).bubble_rate}
        print(f"\nzbv-auto build p={p} m={m}: {t_auto * 1e3:.1f} ms (bubble {auto['bubble_rate']:.4f})")
        print(f"  torch ScheduleZBVZeroBubble constructor (generate, validate, lower): {t_ctor * 1e3:.1f} ms "
              f"-> zbv-auto is {t_ctor / t_auto:.2f}x its speed")
        print(f"  torch order generation alone (_calculate_single_rank_operations): {t_gen * 1e3:.1f} ms "
              f"-> zbv-auto is {t_gen / t_auto:.2f}x its speed")
    elif args.only in ("all", "torch"):
        print("\nzbv-auto: not registered in zbpp yet (skipped)")

    if rows:
        worst = min(rows, key=lambda r: r["speedup"])
        print(f"\nslowest ratio: {worst['speedup']:.1f}x ({worst['zbpp']} p={worst['p']} m={worst['m']}); target >= 3x")
    auto_rows = bench_auto(repeat, args.quick) if args.only in ("all", "auto") else []
    large_rows = bench_large(repeat, args.quick) if args.only in ("all", "large") else []
    if args.out:
        doc = {
            "benchmark": "bench_scheduler",
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            **code_identity(),  # which zbpp built the schedules (the commit alone can be stale on a copy)
            "repeat": repeat,
            "rows": rows,
            "zbv_auto": auto,
            "auto_vs_papers": auto_rows,
            "large": large_rows,
        }
        Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
