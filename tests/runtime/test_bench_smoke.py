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
