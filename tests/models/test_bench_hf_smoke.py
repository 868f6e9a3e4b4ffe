"""benchmarks/bench_hf.py --quick runs on the CPU and writes its JSON, on one rank and on 2 gloo
pipeline ranks (smoke runs: speed itself is measured on a GPU, never asserted in tests). Every row
trains the same model on the same batch, so the rows' first-step losses are a cross-check: zbpp's
and torch.distributed.pipelining's stages against HF's own model and loss on the whole batch."""

from __future__ import annotations

import doctest
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
# float32 on the CPU; the rows run the same ops on the same numbers in other groupings (microbatches,
# stages), so their losses differ by rounding only (they came out bit-identical): 1e-5 relative is
# ~100 float32 ulps, while a decoder layer left out moves the quick model's loss by 1.4e-3 relative
LOSS_RTOL = 1e-5


def _benchmark(name: str):
    """benchmarks/<name>.py as imported by the script itself (its folder on sys.path)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def test_bench_hf_quick_writes_each_variants_figures(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "bench_hf.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_hf.py"), "--quick", "--device", "cpu",
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
        assert len(r["host_probes_ms"]) == 2 and r["host_probe_ms"] == pytest.approx(
            sorted(r["host_probes_ms"])[0] / 2 + sorted(r["host_probes_ms"])[1] / 2, abs=0.01)  # the median
    assert "host probe" in proc.stdout
    losses = {name: r["first_loss"] for name, r in run["results"].items()}
    assert losses["zbpp eager"] == pytest.approx(losses["hf eager"], rel=LOSS_RTOL)


def run_bench_hf(argv: list[str]) -> dict:
    """On a pool rank: bench_hf.py's `main` (what each of torchrun's ranks runs)."""
    return _benchmark("bench_hf").main(argv)


# eager rows only: the fast form's compilation alone takes ~8 s here (`torchrun ... --quick` runs it)
PIPELINE_ROWS = ["hf eager", "zbpp zb-h1 eager", "zbpp zb-v eager", "torch Schedule1F1B", "torch ScheduleZBVZeroBubble"]


@pytest.mark.slow  # ~10 s on 2 busy cores
def test_bench_hf_pipeline_rows_on_two_ranks_agree_on_the_loss(tmp_path: Path, zbpp_workers) -> None:
    """The pipeline mode on 2 gloo ranks: zbpp's zb-h1 and zb-v and torch's 1F1B and ZBV over the
    hand-cut stages, beside HF on rank 0 alone."""
    pytest.importorskip("transformers")
    out = tmp_path / "bench_hf_pp2.json"
    reports = zbpp_workers(2).run(run_bench_hf, ["--quick", "--device", "cpu", "--variants", ",".join(PIPELINE_ROWS),
                                                 "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["ranks"] == 2 and report["variants"] == PIPELINE_ROWS
    (run,) = report["runs"]
    assert reports[0]["runs"] == reports[1]["runs"] == [run]  # every rank reports the gathered figures
    # torch's V schedule before torch 2.13 cannot start over gloo: refused on both ranks, with the reason
    blocked = {name for name in PIPELINE_ROWS
               if name.startswith("torch ") and _benchmark("torch_pipelining").gloo_blocker(name[6:], 2)}
    assert set(run["failed"]) == blocked and all("gloo" in run["failed"][name] for name in blocked)
    assert list(run["results"]) == [name for name in PIPELINE_ROWS if name not in blocked]
    assert run["config"]["layers"] == 4 and run["config"]["microbatches"] == 4  # a layer per stage of zb-v
    results = run["results"]
    for name, r in results.items():
        assert r["ranks"] == (1 if name == "hf eager" else 2)
        assert r["ms"] > 0 and r["tokens_per_s"] > 0 and len(r["times_ms"]) == 2  # 2 rounds x 1 step
        assert r["ms_min"] <= r["ms"] <= r["ms_max"]
        assert r["peak_gib"] is None  # the CPU has no allocator statistics
    assert run["best_torch"] in ("torch Schedule1F1B", "torch ScheduleZBVZeroBubble")
    best = results[run["best_torch"]]["ms"]
    for r in results.values():
        assert r["speed_vs_best_torch"] == pytest.approx(best / r["ms"], rel=1e-2)  # both rounded
    reference = results["hf eager"]["first_loss"]  # HF's own loss on the whole batch, one process
    for name in list(results)[1:]:
        assert results[name]["first_loss"] == pytest.approx(reference, rel=LOSS_RTOL), name


def test_hand_cut_llama_stages_and_torch_layouts_doctests() -> None:
    """benchmarks/hf_torch_stages.py (two stages' logits equal the whole model's) and
    torch_pipelining.py (which stages a rank holds): their examples hold."""
    pytest.importorskip("transformers")
    for name in ("hf_torch_stages", "torch_pipelining"):
        result = doctest.testmod(_benchmark(name))
        assert result.attempted and not result.failed, name


def test_fp8_eager_host_quick_times_every_form(tmp_path: Path) -> None:
    """benchmarks/fp8_eager_host.py --quick: every form (bf16, FP8, FP8 with its cast launches and
    GEMM calls stubbed) timed in each round and written, and the stubs put back afterwards."""
    pytest.importorskip("transformers")
    import zbpp.modules._fp8_cast_triton as kernels
    import zbpp.modules.fp8.gemm as gemm

    launch, scaled_mm = kernels._cast_transpose_amax_kernel, gemm.scaled_mm
    bench = _benchmark("fp8_eager_host")
    out = tmp_path / "fp8_eager_host.json"
    bench.main(["--quick", "--rounds", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    assert list(report["forms"]) == list(bench.FORMS) and report["env"]["device"] == "cpu"
    for form, figures in report["forms"].items():
        assert len(figures["rounds_ms"]) == 2 and 0 < figures["issue_ms"] <= figures["wall_ms"], form
        assert len(figures["host_probe_ms"]) == 2 and min(figures["host_probe_ms"]) > 0, form
    fastest = report["fastest_host_round"]
    assert fastest["host_probe_ms"] == min(report["forms"]["fp8"]["host_probe_ms"])
    assert fastest["fp8_wall_ms"] == report["forms"]["fp8"]["rounds_ms"][fastest["round"]]
    assert kernels._cast_transpose_amax_kernel is launch and gemm.scaled_mm is scaled_mm


def test_fp8_layer_host_times_the_triton_path_and_puts_the_stubs_back(tmp_path: Path) -> None:
    """benchmarks/fp8_layer_host.py on the CPU: every (phase, layer) of both forms timed and
    written, the FP8 casts taking the Triton path (the GPU's: what it means to time) with nothing
    launched, and the stubs and gates put back afterwards (numbers: never asserted)."""
    import zbpp.modules._fp8_cast_triton as kernels
    import zbpp.modules.fp8.cast as cast
    import zbpp.modules.fp8.gemm as gemm
    from zbpp.modules.fp8 import cast_path_counts, reset_cast_path_counts

    before = (kernels._cast_transpose_amax_kernel, gemm.scaled_mm, cast.on_cuda, dict(cast._problems))
    bench = _benchmark("fp8_layer_host")
    out = tmp_path / "fp8_layer_host.json"
    reset_cast_path_counts()
    built = []
    build = bench.build
    bench.build = lambda *a, **k: built.append(build(*a, **k)) or built[-1]
    try:
        medians = bench.main(["--steps", "1", "--microbatches", "2", "--blocks", "1", "--out", str(out)])
    finally:
        bench.build = build
    # as in a model's forward, k and v take q's input cast (one slot for the three): the F kv column
    # times that, not casts of their own
    block = built[0][0]
    assert block.k.fp8_meta["input"] is block.q.fp8_meta["input"] is block.v.fp8_meta["input"]
    counts = cast_path_counts()
    assert counts["triton"] > 0 and counts["eager"] == counts["update_eager"] == 0
    keys = {f"{p} {n}" for p in bench.PHASES for n in bench.LAYERS}
    assert json.loads(out.read_text())["us_per_call"] == medians and set(medians) == {"fp8", "bf16"}
    assert all(set(row) == keys and min(row.values()) > 0 for row in medians.values())
    assert (kernels._cast_transpose_amax_kernel, gemm.scaled_mm, cast.on_cuda, cast._problems) == before
