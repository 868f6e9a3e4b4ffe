"""Where a GPU step's time goes, from a torch.profiler Chrome trace of that step on one rank.

`summarize(path)` reads the trace's kernels and reports, for the compute kernels (every kernel that
is not NCCL's) and the NCCL kernels:

- ``span_ms``: first compute kernel start to last compute kernel end;
- ``busy_ms`` / ``idle_ms``: the union of compute kernel intervals, and what the span leaves idle
  (the rank waits: for a message, for the host, or the schedule's own bubble);
- ``gemm_ms``, ``gemms``: GEMM kernels (cuBLAS / CUTLASS names) and their total time;
- ``gemms_beside_nccl``: GEMMs that ran while an NCCL kernel was resident, and ``gemm_excess_ms``:
  how much longer they took than the median of the same kernel run alone (an NCCL kernel occupies
  SMs, spinning while it waits for its peer, and a GEMM beside it runs slower);
- ``nccl_ms``: the union of NCCL kernel intervals; ``nccl_beside_compute_ms``: the part of it
  during which compute kernels ran too.

`compare(base, other)` lines two traces of the same work up kernel by kernel (same name): the
median duration of each in both, and the total compute kernel time. A pipeline step against the
ideal step of the same rank says whether the pipeline's extra time is the same kernels running
slower (clock, power, memory) or kernels the ideal does not run.

Used by ``bench_pipeline.py --kernel-profile DIR``; runs on any trace::

    python benchmarks/kernel_timeline.py trace-rank0.json
    python benchmarks/kernel_timeline.py --compare ideal-rank0.json pipeline-rank0.json
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from typing import Any

__all__ = ["compare", "summarize"]

_GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|sm100_|Kernel2|scaled_mm", re.I)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _kernels(path: str) -> list[dict[str, Any]]:
    with open(path) as fh:
        trace = json.load(fh)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("cat") == "kernel" and "dur" in e]


def summarize(path: str) -> dict[str, Any]:
    """The summary (module docstring) of one Chrome trace file; times in ms."""
    kernels = _kernels(path)
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()]
    compute = [e for e in kernels if "nccl" not in e["name"].lower()]
    if not compute:
        return {"kernels": 0}
    nccl_u = _union(nccl)
    comp_u = _union([(e["ts"], e["ts"] + e["dur"]) for e in compute])
    span = comp_u[-1][1] - comp_u[0][0]
    gemms = [e for e in compute if _GEMM.search(e["name"])]

    def beside(e: dict[str, Any]) -> bool:
        a, b = e["ts"], e["ts"] + e["dur"]
        return any(x < b and a < y for x, y in nccl_u)

    alone: dict[str, list[float]] = {}
    for e in gemms:
        if not beside(e):
            alone.setdefault(e["name"], []).append(e["dur"])
    excess = 0.0
    crowded = 0
    for e in gemms:
        if beside(e):
            crowded += 1
            if e["name"] in alone:
                excess += max(0.0, e["dur"] - statistics.median(alone[e["name"]]))
    return {
        "kernels": len(kernels),
        "span_ms": span / 1e3,
        "busy_ms": _length(comp_u) / 1e3,
        "idle_ms": (span - _length(comp_u)) / 1e3,
        "gemms": len(gemms),
        "gemm_ms": sum(e["dur"] for e in gemms) / 1e3,
        "gemms_beside_nccl": crowded,
        "gemm_excess_ms": excess / 1e3,
        "nccl_kernels": len(nccl),
        "nccl_ms": _length(nccl_u) / 1e3,
        "nccl_beside_compute_ms": _overlap(nccl_u, comp_u) / 1e3,
    }


def compare(base: str, other: str, top: int = 8) -> dict[str, Any]:
    """Compute kernels (not NCCL's) of two traces, by name: ``compute_ms`` of each and their ratio,
    and for the `top` names with the most time in `base` their count and median duration (us) in
    both and ``ratio`` (other's median / base's). Names only in one trace count in the totals."""
    runs = []
    for path in (base, other):
        by: dict[str, list[float]] = {}
        for e in _kernels(path):
            if "nccl" not in e["name"].lower():
                by.setdefault(e["name"], []).append(e["dur"])
        runs.append(by)
    a, b = runs
    total_a, total_b = (sum(map(sum, r.values())) / 1e3 for r in runs)
    kernels = []
    for name in sorted(a, key=lambda k: -sum(a[k]))[:top]:
        row: dict[str, Any] = {"name": name[:80], "count": [len(a[name]), len(b.get(name, []))],
                               "median_us": [statistics.median(a[name]), None], "ratio": None}
        if name in b:
            row["median_us"][1] = statistics.median(b[name])
            row["ratio"] = row["median_us"][1] / row["median_us"][0]
        kernels.append(row)
    return {"compute_ms": [total_a, total_b], "ratio": total_b / total_a if total_a else None, "kernels": kernels}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"] and len(sys.argv) == 4:
        print(json.dumps(compare(sys.argv[2], sys.argv[3]), indent=1))
    else:
        for p in sys.argv[1:]:
            print(p, json.dumps(summarize(p), indent=1))
