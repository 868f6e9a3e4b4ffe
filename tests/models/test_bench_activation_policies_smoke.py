"""benchmarks/bench_activation_policies.py --quick runs on the CPU in this process (a smoke run: speed
and measured memory need a GPU, never asserted in tests), and its simulated peaks are the measured
bytes per microbatch times the microbatches GPipe holds (a hand count of the one-rank schedule)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def test_bench_activation_policies_quick_predicts_gpipe_peaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_activation_policies as bench

    report = bench.main(["--quick", "--device", "cpu", "--offload-layers", "1", "--out", str(tmp_path / "p.json"),
                         "--trace-dir", str(tmp_path)])
    assert json.loads((tmp_path / "p.json").read_text())["run"]["results"].keys() == set(bench.POLICIES)
    run, m = report["run"], report["config"]["microbatches"]
    assert run["schedule"] == "gpipe" and report["in_flight"] == m  # one rank: only GPipe holds every F
    per, rest, layers = run["layer_costs"], run["rest_bytes"], report["config"]["layers"]
    kept = {p: per[p]["kept_f_to_b"] for p in bench.POLICIES}
    assert kept["full"] < kept["selective"] < kept["none"] and per["offload"]["host_bytes"] > 0
    # GPipe's peak: every microbatch's F done, nothing freed yet; offload on the first layer only
    expected = {p: m * (rest + layers * kept[p]) for p in ("none", "selective", "full")}
    expected["offload"] = m * (rest + kept["offload"] + (layers - 1) * kept["none"])
    for p, r in run["results"].items():
        assert r["ms"] > 0 and r["measured_gib"] is None  # no allocator statistics on the CPU
        assert r["predicted_bytes"] == pytest.approx(expected[p], rel=1e-12)  # float sums of integers
    trace = run["offload_trace"]
    assert [row["microbatch"] for row in trace["per_microbatch"]] == list(range(m))
    assert all(row["gap_ms"] >= 0 for row in trace["per_microbatch"])
    tasks = json.loads(Path(trace["tasks_trace"]).read_text())["traceEvents"]
    assert sum(e.get("cat") == "measured" for e in tasks) == 2 * m  # every F and BW of the step
    assert Path(trace["kernels_trace"]).stat().st_size > 0
