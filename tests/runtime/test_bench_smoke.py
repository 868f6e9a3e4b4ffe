"""benchmarks/bench_pipeline.py --quick runs under torchrun on 2 CPU ranks and writes its JSON
(a smoke run: speed itself is measured on GPUs, never asserted in tests); a second run appends to
it, its `main` called on the 2 gloo ranks of the shared test pool (what torchrun's ranks call after
starting Python and importing torch, zbpp and the script)."""

from __future__ import annotations

import importlib.util
import doctest
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_benchmark(name: str):
    """benchmarks/<name>.py as a module (registered, so that its dataclasses resolve their module)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def source_fingerprint() -> str:
    """benchmarks/provenance.py's fingerprint of this checkout's zbpp sources (what the JSON must carry)."""
    return _load_benchmark("provenance").source_fingerprint()


def run_bench_pipeline(argv: list[str]) -> int:
    """On a pool rank: bench_pipeline.py's `main`, its folder on sys.path as when run as a script."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    return _load_benchmark("bench_pipeline").main(argv)


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=0",
                           str(ROOT / "benchmarks" / "bench_pipeline.py"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_bench_pipeline_quick_under_torchrun(tmp_path, zbpp_workers):
    """The default model (its programs made for the program's default costs), then the MLP stack over two
    microbatch counts appended to the same JSON (its programs made from the measured costs, the
    default, and a message overhead fitted): every row timed, the ideal rows, the prediction on
    every zbpp row, a pick."""
    out = tmp_path / "bench.json"
    proc = _torchrun("--quick", "--program-comm", "default", "--out", str(out))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert zbpp_workers(2).run(run_bench_pipeline, [
        "--quick", "--model", "mlp-stack", "--microbatches", "2,4", "--zbpp", "zb-h1,zbv-auto", "--zbpp-torch-layers",
        "zb-h1", "--torch", "Schedule1F1B", "--steps", "2", "--ordered", "zb-v", "--fit-message-overhead", "--append",
        "--out", str(out)]) == [0, 0]
    doc = json.loads(out.read_text())
    # torch's V schedule before torch 2.13 cannot start over gloo: refused on both ranks, with the reason
    blocker = _load_benchmark("torch_pipelining").gloo_blocker
    refused = [r for r in doc["rows"] if r["impl"] == "torch" and blocker(r["schedule"], 2)]
    assert all("gloo" in r["error"] for r in refused), refused
    rows = [r for r in doc["rows"] if r not in refused]
    assert all("step_ms" in r for r in rows), [r for r in rows if "error" in r]
    assert [run["model"] for run in doc["meta"]["runs"]] == ["transformer", "mlp-stack"]
    assert [run["config"]["program_comm"] for run in doc["meta"]["runs"]] == ["default", "measured"]
    fit = [run["config"]["fit_message_overhead"] for run in doc["meta"]["runs"]]
    assert fit == [False, True]
    # the code that ran, independent of git (benchmarks/provenance.py)
    assert doc["meta"]["zbpp_sha256"] == source_fingerprint()
    cases = {(r["model"], r["m"]) for r in rows}
    assert cases == {("transformer", 4), ("mlp-stack", 2), ("mlp-stack", 4)}
    for model, m in cases:
        case = [r for r in rows if (r["model"], r["m"]) == (model, m)]
        assert {r["impl"] for r in case} == {"ideal", "zbpp", "torch", "pick"} | ({"ordered"} if model == "mlp-stack" else set())
        # one ideal per layers kind that runs, zbpp's and torch.nn's, first and again last
        ideals = [(r["schedule"], r["layers"]) for r in case if r["impl"] == "ideal"]
        assert ideals == [("ideal", "zbpp"), ("ideal", "torch"), ("ideal (end)", "zbpp"), ("ideal (end)", "torch")]
        assert [r["schedule"] for r in case[-2:]] == ["ideal (end)"] * 2  # the end rows close the case
        ideal = {k: (sum(r["step_ms"] for r in case if r["impl"] == "ideal" and r["layers"] == k) / 2)
                 for k in ("zbpp", "torch")}
        for r in case:
            assert r["pct_of_ideal"] == pytest.approx(100 * ideal[r["layers"]] / r["step_ms"])
        for r in case:
            if r["impl"] in ("zbpp", "pick"):
                assert r["predicted_ms"] > 0
                assert r["measured_over_predicted"] == pytest.approx(r["step_ms"] / r["predicted_ms"])
                # the lower bound holds for the simulated schedule with the same costs
                assert 0 < r["bound_ms"] <= r["predicted_ms"] * (1 + 1e-9)
                # the program's message timing can only add to simulate's (messages leave with their producer)
                assert r["bound_ms"] <= r["simulated_ms"] * (1 + 1e-9) <= r["predicted_ms"] * (1 + 1e-9) ** 2
                assert set(r["costs_ms"]) == {"f", "b", "w", "comm", "message_overhead"}
                assert len(r["costs_ms"]["f"]) == r["num_stages"]
                # the recorded step (task starts and ends) lies inside its recorded step's wall time
                assert len(r["recorded_step_ms"]) == 5  # --task-time-steps' default
                # the first recorded step exchanges shapes: its records are left out of the costs
                assert len(r["recorded_span_ms"]) == 4
                assert all(0 < span <= wall for span, wall in zip(r["recorded_span_ms"], r["recorded_step_ms"][1:]))
            if r["impl"] != "pick":
                assert len(r["step_ms_all"]) == (3 if model == "transformer" else 2)  # --quick's steps, then --steps 2
                # step_ms: the slowest rank's median step; step_ms_all: each step's slowest rank
                assert r["step_ms"] <= statistics.median(r["step_ms_all"]) * (1 + 1e-9)
        pick = next(r for r in case if r["impl"] == "pick")
        fits = [c for c in pick["pick_candidates"] if c["fits"]]
        assert pick["schedule"] == fits[0]["schedule"]
        assert fits[0]["simulated_ms"] == min(c["simulated_ms"] for c in fits)
    assert {(r["schedule"], r["layers"]) for r in rows if r["model"] == "mlp-stack" and r["impl"] == "zbpp"} == {
        ("zb-h1", "zbpp"), ("zbv-auto", "zbpp"), ("zb-h1", "torch")}
    # --ordered: zb-v's task order on each rank with no communication, one row per m (timed; its
    # step runs every task or the script asserts)
    assert sorted((r["m"], r["schedule"]) for r in rows if r["impl"] == "ordered") == [(2, "zb-v"), (4, "zb-v")]
    comm = {(c["run"], c["m"]): c["comm_ms"] for c in doc["meta"]["cases"]}  # one layers kind per case here
    for r in rows:  # --program-comm measured: the mlp run's programs got the ideal's costs cut to their stages
        if r["impl"] in ("zbpp", "pick"):
            program_costs = r["program_costs_ms"]
            if r["model"] == "transformer":
                assert program_costs is None  # the program's DEFAULT_COSTS
            else:
                assert program_costs["comm"] == pytest.approx(comm[(r["run"], r["m"])])
                assert len(program_costs["f"]) == r["num_stages"] and min(program_costs["f"]) > 0
    for case in doc["meta"]["cases"]:  # the overhead fitted on one row reaches every zbpp row's costs
        assert case["message_overhead_ms"] >= 0
        if not fit[case["run"]]:  # not asked for: none fitted, none charged
            assert case["message_overhead_ms"] == 0 and "overhead_fitted_on" not in case
            assert not any(r.get("overhead_fitted_here") for r in rows if r["run"] == case["run"])
            continue
        fitted = [r for r in rows if (r["run"], r["m"], r["layers"]) == (case["run"], case["m"], case["layers"])
                  and r.get("overhead_fitted_here")]
        assert [(r["impl"], r["schedule"]) for r in fitted] == [("zbpp", case["overhead_fitted_on"])]
        if case["message_overhead_ms"] > 0:  # the fit closes that row's gap (bisection to 1e-4)
            assert fitted[0]["measured_over_predicted"] == pytest.approx(1.0, abs=1e-3)
        else:  # it ran no slower than simulated without any overhead
            assert fitted[0]["measured_over_predicted"] <= 1.0
        for r in rows:
            if (r["run"], r["m"], r["layers"]) == (case["run"], case["m"], case["layers"]) and "costs_ms" in r:
                if r["impl"] in ("zbpp", "pick"):
                    assert r["costs_ms"]["message_overhead"] == pytest.approx(case["message_overhead_ms"])
    for case in doc["meta"]["cases"]:  # the headline figures, read off the case's rows
        summary = case["summary"]
        case_rows = [r for r in rows if (r["run"], r["m"], r["layers"]) == (case["run"], case["m"], case["layers"])]
        best = min((r for r in case_rows if r["impl"] == "zbpp"), key=lambda r: r["step_ms"])
        pick = next(r for r in case_rows if r["impl"] == "pick")
        assert summary["best_zbpp"]["schedule"] == best["schedule"]
        assert summary["pick"]["vs_best_zbpp"] == pytest.approx(best["step_ms"] / pick["step_ms"])
        fits = {c["schedule"] for c in pick["pick_candidates"] if c["fits"]}
        within = min((r for r in case_rows if r["impl"] == "zbpp" and r["layers"] == case["layers"]
                      and r["schedule"] in fits), key=lambda r: r["step_ms"], default=None)
        if within is None:
            assert "best_zbpp_within_limit" not in summary["pick"]
        else:
            assert summary["pick"]["best_zbpp_within_limit"] == within["schedule"]
            assert summary["pick"]["vs_best_zbpp_within_limit"] == pytest.approx(within["step_ms"] / pick["step_ms"])
        assert summary["best_zero_bubble"]["schedule"] != "1f1b"  # 1F1B has no W task


def _refusal(monkeypatch, capsys, *argv: str) -> tuple[object, str]:
    """bench_pipeline's argument check in this process (the script's first act, before torch.distributed):
    the exit code it leaves with and what it printed on stderr."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its sibling modules, as when run as a script
    with pytest.raises(SystemExit) as info:
        _load_benchmark("bench_pipeline").parse_args(list(argv))
    return info.value.code, capsys.readouterr().err


def test_bench_pipeline_refuses_fp8_on_cpu(monkeypatch, capsys):
    code, err = _refusal(monkeypatch, capsys, "--quick", "--layers-kind", "fp8")
    assert code == 2 and "--layers-kind fp8 needs CUDA GPUs" in err, err[-2000:]


def test_bench_modules_quick(tmp_path):
    """benchmarks/bench_modules.py --quick on the CPU: every case and cast path timed, JSON written."""
    out = tmp_path / "bench_modules.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_modules.py"), "--quick",
                           "--device", "cpu", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = json.loads(out.read_text())
    assert report["env"]["zbpp_sha256"] == source_fingerprint()
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



def test_gpu_telemetry_window_means_per_gpu(tmp_path):
    """benchmarks/gpu_telemetry.py: nvidia-smi's UTC rows averaged per GPU over a window, by hand:
    GPU 0 has two samples inside (1400 and 1500 MHz), GPU 1 one; rows outside the window or
    unreadable ([N/A], a line cut short) are left out."""
    telemetry = _load_benchmark("gpu_telemetry")
    log = tmp_path / "smi.csv"
    log.write_text("2026/11/30 19:00:00.000, 0, 1900, 300.0, 40\n"    # before the window
                   "2026/11/30 19:00:01.000, 0, 1400, 690.0, 60\n"
                   "2026/11/30 19:00:01.500, 1, 1600, 680.0, 55\n"
                   "2026/11/30 19:00:01.600, 1, [N/A], 680.0, 55\n"
                   "2026/11/30 19:00:02.000, 0, 1500, 700.0, 62\n"
                   "2026/11/30 19:00:05.000, 0, 1000, 100.0, 70\n"    # after it
                   "2026/11/30 19:00:02.5")
    t0 = 1796065200.5  # 2026-11-30 19:00:00.5 UTC
    with open(log, "a+") as fh:
        sampler = telemetry.Telemetry(process=None, log=fh)
        got = sampler.window(t0, t0 + 2.0)
    assert got == {"0": {"sm_mhz": 1450.0, "power_w": 695.0, "temp_c": 61.0, "samples": 2},
                   "1": {"sm_mhz": 1600.0, "power_w": 680.0, "temp_c": 55.0, "samples": 1}}


def test_bench_pipeline_refuses_telemetry_on_cpu(monkeypatch, capsys):
    code, err = _refusal(monkeypatch, capsys, "--quick", "--telemetry")
    assert code == 2 and "--telemetry samples NVIDIA GPUs" in err, err[-2000:]


@pytest.mark.parametrize("argv, message", [
    # each was taken, and every row then failed inside the model, naming no flag
    # (--hidden 30: "shape '[2, 16, 3, 4, 7]' is invalid for input of size 2880")
    (["--quick", "--hidden", "0"], "--hidden 0: need >= 1"),
    (["--quick", "--tokens", "-8"], "--tokens -8: need >= 1"),
    (["--quick", "--blocks-per-stage", "0"], "--blocks-per-stage 0: need >= 1"),
    (["--quick", "--hidden", "30"], "--hidden 30 is not a multiple of --heads 4"),  # --quick's 4 heads
])
def test_bench_pipeline_refuses_bad_sizes_by_name(monkeypatch, capsys, argv, message):
    code, err = _refusal(monkeypatch, capsys, *argv)
    assert code == 2 and message in err, err[-2000:]


@pytest.mark.parametrize("argv, message", [
    # the old spelling in rows would have been dropped for --tokens
    (["--tokens", "64", "--rows-per-microbatch", "2"], "give --tokens or --rows-per-microbatch, not both"),
    # the MLP stack has no sequences or heads: rows x the default --seq-len 2048 tokens, or nothing
    (["--model", "mlp-stack", "--rows-per-microbatch", "2"], "--rows-per-microbatch is for --model transformer"),
    (["--model", "mlp-stack", "--seq-len", "64"], "--seq-len is for --model transformer"),
    (["--model", "mlp-stack", "--heads", "8"], "--heads is for --model transformer"),
])
def test_bench_pipeline_refuses_options_it_would_ignore(monkeypatch, capsys, argv, message):
    code, err = _refusal(monkeypatch, capsys, *argv)
    assert code == 2 and message in err, err[-2000:]


def test_kernel_timeline_compare_by_kernel_name(tmp_path):
    """benchmarks/kernel_timeline.py --compare, by hand: a GEMM run twice at 100 and 110 us in the
    base and at 105 and 125 in the other trace (medians 105 and 115), an elementwise kernel only in
    the other, NCCL kernels left out of both totals."""
    timeline = _load_benchmark("kernel_timeline")

    def trace(path, kernels):
        events = [{"cat": "kernel", "name": name, "ts": 1000.0 * i, "dur": dur} for i, (name, dur) in enumerate(kernels)]
        path.write_text(json.dumps({"traceEvents": events + [{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9}]}))
        return str(path)

    base = trace(tmp_path / "a.json", [("gemm_x", 100.0), ("gemm_x", 110.0), ("ncclDevKernel_SendRecv", 50.0)])
    other = trace(tmp_path / "b.json", [("gemm_x", 105.0), ("gemm_x", 125.0), ("add_kernel", 20.0)])
    got = timeline.compare(base, other)
    assert got["compute_ms"] == [0.21, 0.25]
    assert abs(got["ratio"] - 0.25 / 0.21) < 1e-12
    assert got["kernels"] == [{"name": "gemm_x", "count": [2, 2], "median_us": [105.0, 115.0], "ratio": 115.0 / 105.0}]


def test_bench_pipeline_costs_are_the_median_of_the_recorded_steps(monkeypatch):
    """bench_pipeline.median_costs, by hand (its docstring too): a slow step in three moves no cost."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its sibling modules, as when run as a script
    bench = _load_benchmark("bench_pipeline")
    from zbpp.schedules import Costs

    steps = [Costs(f=[1.0, 2.0], b=[3.0, 3.0], w=[1.0, 1.0], comm=0.5),
             Costs(f=[1.1, 2.2], b=[3.3, 3.3], w=[1.1, 1.1], comm=0.5),  # a step run 10% long
             Costs(f=[1.0, 2.0], b=[3.0, 3.0], w=[1.0, 1.0], comm=0.5)]
    assert bench.median_costs(steps) == steps[0]
    finder = doctest.DocTestFinder()
    (test,) = finder.find(bench.median_costs, "median_costs", globs=vars(bench))
    assert doctest.DocTestRunner().run(test).failed == 0


def test_bench_scheduler_json_names_the_code(tmp_path, monkeypatch):
    """benchmarks/bench_scheduler.py --quick --only auto (seconds, CPU): its JSON carries the
    sources' hash like every benchmark's (its figures go to docs/results/)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    out = tmp_path / "scheduler.json"
    assert _load_benchmark("bench_scheduler").main(["--quick", "--only", "auto", "--repeat", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["zbpp_sha256"] == source_fingerprint() and "commit" in doc and "dirty" in doc
    assert doc["auto_vs_papers"]


def test_bench_planner_json_names_the_code(tmp_path, monkeypatch):
    """benchmarks/bench_planner.py --quick on one of its profiles (its JSON is behind docs/uneven.md):
    the sources' hash is in it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = _load_benchmark("bench_planner")
    everything = bench.profiles
    monkeypatch.setattr(bench, "profiles", lambda folder: {"llama3-8b": everything(folder)["llama3-8b"]})
    out = tmp_path / "planner.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["zbpp_sha256"] == source_fingerprint() and "commit" in doc and "dirty" in doc
    assert [r["model"] for r in doc["rows"]] == ["llama3-8b", "llama3-8b"]
