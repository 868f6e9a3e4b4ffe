"""benchmarks/bench_hf.py --quick runs on the CPU and writes its JSON (a smoke run: speed itself is
measured on a GPU, never asserted in tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_hf_quick_writes_each_variants_figures(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "bench_hf.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_hf.py"), "--quick", "--device", "cpu",
                           "--variants", "hf eager,zbpp eager", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["env"]["zbpp_sha256"] and report["variants"] == ["hf eager", "zbpp eager"]
    (run,) = report["runs"]
    assert not run["failed"] and set(run["results"]) == {"hf eager", "zbpp eager"}
    for r in run["results"].values():
        assert r["ms"] > 0 and r["tokens_per_s"] > 0 and len(r["times_ms"]) == 2  # 2 rounds x 1 step
