"""benchmarks/bench_split.py --smoke runs on the CPU, writes its JSON, and every row's gradients
equal the plain backward's (a smoke run: speed is measured on GPUs, never asserted in tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
ROW_FIELDS = {"case", "row", "hidden", "ffn", "layers", "tokens", "dtype", "F_ms", "B_ms", "W_ms",
              "BW_ms", "FBW_ms", "B_host_ms", "W_host_ms", "peak_gib", "peak_above_start_gib", "max_rel_err",
              "BW_over_plain", "FBW_over_plain", "peak_over_plain"}


def test_bench_split_smoke(tmp_path):
    out = tmp_path / "split.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_split.py"), "--smoke",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    doc = json.loads(out.read_text())
    meta, rows = doc["meta"], doc["rows"]
    assert meta["benchmark"] == "bench_split" and meta["config"]["smoke"] is True
    assert {"torch", "device", "commit", "zbpp_sha256", "notes"} <= set(meta)
    names = [r["row"] for r in rows]
    # the generic split row runs where this checkout has zbpp's split, and says why not elsewhere
    has_split = (ROOT / "zbpp" / "runtime" / "_autograd_split.py").exists()
    expected = ["plain"] + (["zbpp split"] if has_split else []) + ["delay_wgrad", "torch split"]
    assert names == expected, meta["notes"]
    if not has_split:
        assert any("zbpp split" in n for n in meta["notes"])
    for r in rows:
        assert set(r) == ROW_FIELDS
        assert r["dtype"] == "torch.float64" and r["peak_gib"] is None
        assert r["BW_ms"] == pytest.approx(r["B_ms"] + r["W_ms"])
        assert r["FBW_ms"] == pytest.approx(r["F_ms"] + r["B_ms"] + r["W_ms"])
        # float64, the same gradients by the same GEMMs in other orders: round-off only
        assert r["max_rel_err"] <= 1e-12, r
    assert rows[0]["BW_over_plain"] == 1.0


def test_split_host_layers_smoke(tmp_path):
    """benchmarks/split_host.py --suite layers runs its three rows and writes them (times only)."""
    out = tmp_path / "layers.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "split_host.py"), "--suite",
                           "layers", "--blocks", "2", "--iters", "2", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    doc = json.loads(out.read_text())
    assert doc["meta"]["benchmark"] == "split_host layers"
    rows = {r["row"]: r for r in doc["layers"]}
    assert list(rows) == ["torch.nn", "zbpp eager", "zbpp delayed"]
    assert rows["torch.nn"]["over_torch_nn"] == 1.0
    for r in rows.values():
        assert r["FBW_us"] == pytest.approx(r["F_us"] + r["B_us"] + r["W_us"])
        assert min(r["F_us"], r["B_us"]) > 0
