"""The `zbpp` command: show, compare, and errors for bad input (exit 2, no traceback)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from zbpp.cli import main
from zbpp.schedules import available


def test_show_prints_timeline_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "zb-h1", "-p", "4", "-m", "8", "--width", "200"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(rows) == 4
    # rank 0 starts with its 4 warm-up forwards, as ZB-H1 (1F1B order) prescribes
    assert rows[0].split("|")[1].startswith("F0F1F2F3")
    assert re.search(r"bubble rate\s+0\.1111", out)  # (27 - 24) / 27
    assert "r0=4" in out and "r3=1" not in out


def test_compare_lists_every_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "-p", "8", "-m", "24"]) == 0
    out = capsys.readouterr().out
    for name in available():
        assert re.search(rf"^{re.escape(name)}\s", out, re.M), name
    assert re.search(r"^zb-h2\s+8\s+0\.0000", out, re.M)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["show", "nope", "-p", "4", "-m", "8"], "unknown schedule 'nope'"),
        (["show", "1f1b", "-p", "0", "-m", "8"], "argument -p/--ranks: expected an integer >= 1, got '0'"),
        (["show", "1f1b", "-p", "4", "-m", "8", "--chunks", "2"], "does not take --chunks"),
    ],
)
def test_bad_input_exits_2_with_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_python_dash_m_works() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "zbpp", "show", "1f1b", "-p", "2", "-m", "2"], capture_output=True, text=True, check=True
    ).stdout
    assert "rank 1" in out and "bubble rate" in out


def test_show_long_schedule_wraps_to_width(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "1f1b", "-p", "32", "-m", "64", "--width", "100"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    # an 80-column terminal: the legend (85 columns) and a block header noting the characters
    # added for W's of no time (92) ran past it
    assert main(["show", "zb-h1", "-p", "4", "-m", "8", "--w", "0", "--width", "80"]) == 0
    out = capsys.readouterr().out
    assert "chars added for tasks shorter than 1 char" in out and "X full backward" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_compare_applies_options_only_where_they_apply(capsys: pytest.CaptureFixture[str]) -> None:
    """--memory-limit and --chunks go to the schedules that take them; the others still run."""
    assert main(["compare", "-p", "4", "-m", "12", "--memory-limit", "6", "--chunks", "3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^1f1b\s+4\s+0\.2000", out, re.M)  # (p-1)*3 / (12*3 + 9)
    assert re.search(r"^interleaved-1f1b\s+12\s", out, re.M)  # 3 chunks on 4 ranks
    for line in out.splitlines():
        if line.startswith("zb-auto"):
            assert max(float(x) for x in line.split()[5:]) <= 6 + 1e-9  # the limit holds


def test_show_lower_bound_never_above_the_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    # wgrad above activation on stage 1: zb-auto's default limit counts max(activation, wgrad)
    # per stage, so the bound must be taken at that limit; a lower bound above the printed span
    # would claim the schedule beats every schedule within its own limit
    assert main(["show", "zb-auto", "-p", "2", "-m", "4", "--w", "2", "--wgrad", "0,2", "--width", "200"]) == 0
    out = capsys.readouterr().out
    span = float(re.search(r"longest rank span (\S+)", out).group(1))
    bound = float(re.search(r"longest span >= (\S+)", out).group(1))
    assert bound <= span


@pytest.mark.parametrize("cmd", [["show"], ["trace", "-o", "TRACE"]])
def test_wgrad_is_refused_for_a_schedule_without_a_separate_w(cmd: list[str], tmp_path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """--wgrad is memory B keeps until W: 1F1B runs BW (no W), so its peak memory was the same with
    or without it, the flag silently ignored; now refused, naming it. Where W is separate it applies."""
    cmd = [str(tmp_path / "t.json") if c == "TRACE" else c for c in cmd]
    assert main([*cmd, "1f1b", "-p", "2", "-m", "2", "--wgrad", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--wgrad" in err and "1f1b has no separate W" in err and len(err.strip().splitlines()) == 1, err
    assert main([*cmd, "1f1b", "-p", "2", "-m", "2"]) == 0  # without it, as before
    capsys.readouterr()
    # where W is separate it applies: zb-h1 on one rank, F0 B0 W0 F1 B1 W1 with activation 1, wgrad 2
    # kept from B to W: peak 2 (after B), where the default (1/3) peaks at 1 (after F)
    assert main(["show", "zb-h1", "-p", "1", "-m", "2", "--wgrad", "2"]) == 0
    assert "r0=2" in capsys.readouterr().out


def test_compare_marks_the_schedules_over_the_memory_limit(capsys: pytest.CaptureFixture[str]) -> None:
    """The fixed schedules ignore --memory-limit; those over it used to be listed unmarked, as if
    they fitted. Hand-worked peaks at p=4, m=8, activation 1, wgrad 1/3 (V and interleaved
    stages hold half as much): GPipe holds all 8 microbatches, ZB-H2 2p-1 = 7, interleaved 1F1B
    5.5 and DualPipeV 4.5 on rank 0, all above 4; 1F1B, ZB-H1, ZB-V and zb-interleaved peak at
    exactly p = 4, which fits; V-Half 3 and V-Min 2."""
    assert main(["compare", "-p", "4", "-m", "8", "--memory-limit", "4"]) == 0
    out = capsys.readouterr().out
    marked = {line.split()[0] for line in out.splitlines()
              if line.split() and line.split()[0] in available() and line.split()[4].endswith("*")}
    assert marked == {"gpipe", "zb-h2", "interleaved-1f1b", "dualpipe-v"}
    assert "* peak memory above --memory-limit=4" in out
    assert main(["compare", "-p", "4", "-m", "8"]) == 0  # without a limit nothing is over it
    assert "*" not in capsys.readouterr().out
