"""``--quick`` in the benchmarks (benchmarks/quick.py): its smoke sizes fill in only the options the
command line left out; an option given explicitly keeps its value, even one equal to its default."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def benchmark(monkeypatch: pytest.MonkeyPatch):
    """benchmarks/<name>.py as the script imports it (its folder on sys.path), in one process."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # bench_hf: the one-rank mode
    return importlib.import_module


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--quick", action="store_true")
    return ap


@pytest.mark.parametrize("argv, want", [
    (["--quick"], {"quick"}),
    (["--rounds", "3"], {"rounds"}),  # the default's own value, given: still given
    (["--rounds=5", "--hidden", "8"], {"rounds", "hidden"}),
    (["--round", "5"], {"rounds"}),  # argparse's abbreviation of --rounds
    ([], set()),
])
def test_given_names_what_the_command_line_gives(benchmark, argv, want) -> None:
    quick = benchmark("quick")
    assert quick.given(_parser(), argv) == want


def test_apply_quick_fills_only_what_is_not_given(benchmark) -> None:
    quick = benchmark("quick")
    ap = _parser()
    argv = ["--quick", "--rounds", "3"]
    args = ap.parse_args(argv)
    assert quick.apply_quick(ap, args, argv, rounds=1, hidden=64) == {"hidden"}
    assert (args.rounds, args.hidden) == (3, 64)
    plain = ap.parse_args([])
    assert quick.apply_quick(ap, plain, [], rounds=1) == set() and plain.rounds == 3  # no --quick: no change
    with pytest.raises(ValueError, match="hiden"):  # a misspelt option would escape --quick unnoticed
        quick.apply_quick(ap, args, argv, hiden=64)


def test_bench_activation_policies_quick_keeps_explicit_options(benchmark) -> None:
    pytest.importorskip("transformers")
    bench = benchmark("bench_activation_policies")
    full = bench.parse_args([])
    args = bench.parse_args(["--quick", "--rounds", str(full.rounds), "--hidden", "96", "--steps", "4"])
    assert (args.rounds, args.hidden, args.steps) == (full.rounds, 96, 4)  # as given
    assert args.ffn < full.ffn and args.seq_len < full.seq_len  # not given: --quick's smaller sizes


def test_bench_hf_quick_keeps_explicit_options(benchmark) -> None:
    pytest.importorskip("transformers")
    bench = benchmark("bench_hf")
    full = bench.parse_args(["--device", "cpu"])
    args = bench.parse_args(["--quick", "--device", "cpu", "--rounds", "5", "--seq-len", "32",
                             "--backend", full.backend])
    assert (args.rounds, args.seq_len, args.backend) == (5, 32, full.backend)
    assert args.preset == "custom" and args.vocab < full.vocab


@pytest.mark.parametrize("suite", ["linear", "blocks"])
def test_bench_modules_quick_keeps_explicit_options(benchmark, suite: str) -> None:
    bench = benchmark("bench_modules")
    full = bench.parse_args(["--suite", suite])
    args = bench.parse_args(["--quick", "--suite", suite, "--rounds", "5", "--hidden", "128", "--sustain", "0.5",
                             "--blocks", str(full.blocks)])
    assert (args.rounds, args.hidden, args.sustain, args.blocks) == (5, 128, 0.5, full.blocks)
    assert args.tokens < full.tokens and args.sustain <= full.sustain


def test_fp8_eager_host_quick_keeps_explicit_preset(benchmark) -> None:
    bench = benchmark("fp8_eager_host")
    hidden, layers, ffn, heads = bench.PRESETS["h2048"]
    args = bench.parse_args(["--quick", "--preset", "h2048", "--rounds", "2"])
    assert (args.hidden, args.layers, args.ffn, args.heads, args.rounds) == (hidden, layers, ffn, heads, 2)
    assert args.device.type == "cpu"
    tiny = bench.parse_args(["--quick"])
    assert tiny.hidden < min(h for h, *_ in bench.PRESETS.values())
