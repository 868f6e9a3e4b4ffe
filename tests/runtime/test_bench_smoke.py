"""benchmarks/bench_pipeline.py --quick runs under torchrun on 2 CPU ranks and writes its JSON
(a smoke run: speed itself is measured on GPUs, never asserted in tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_pipeline_quick_under_torchrun(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=0",
                           str(ROOT / "benchmarks" / "bench_pipeline.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"] for r in rows} == {"zbpp", "torch"}
    assert all("step_ms" in r for r in rows), [r for r in rows if "error" in r]


def test_bench_modules_quick(tmp_path):
    """benchmarks/bench_modules.py --quick on the CPU: every case and cast path timed, JSON written."""
    out = tmp_path / "bench_modules.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_modules.py"), "--quick",
                           "--device", "cpu", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = json.loads(out.read_text())
    results = {r["case"]: r for r in report["results"]}
    assert set(results) == {"bf16 eager", "fp8 eager", "fp8 f32-acc eager", "fp8 weights kept",
                            "bf16 delayed B+W", "fp8 delayed B+W"}
    assert all(r["median_ms"] > 0 and r["host_ms"] > 0 and r["sustained_ms"] > 0
               for r in results.values())
    assert {c["path"] for c in report["casts"]} == {"triton", "compile", "eager"}
    assert set(report["ratios"]) == {"fp8_speedup", "fp8_f32_acc_speedup", "fp8_speedup_sustained",
                                     "fp8_weights_kept_speedup",
                                     "fp8_weights_kept_speedup_sustained",
                                     "delay_overhead_bf16", "delay_overhead_fp8",
                                     "delay_overhead_bf16_sustained",
                                     "delay_overhead_fp8_sustained"}
    assert report["config"]["grad"] == "randn"
