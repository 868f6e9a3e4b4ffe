"""The `zbpp` command on bad input: exit code 2 (1 for a file it cannot read), and exactly one line
on stderr that names the bad argument, never a traceback. Also `zbpp --version`."""

from __future__ import annotations

import subprocess
import sys

import pytest

import zbpp
from zbpp import cli
from zbpp.cli import main


def _one_error_line(err: str, command: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"zbpp {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


SCHEDULE_ARGS = ["-p", "4", "-m", "8"]


@pytest.mark.parametrize(
    "argv, names",
    [
        (["compare", "-p", "0", "-m", "8"], "argument -p/--ranks: expected an integer >= 1, got '0'"),
        (["compare", "-p", "4", "-m", "-1"], "argument -m/--microbatches: expected an integer >= 1, got '-1'"),
        (["compare", "-p", "four", "-m", "8"], "argument -p/--ranks: expected an integer >= 1, got 'four'"),
        (["compare", *SCHEDULE_ARGS, "--chunks", "0"], "argument --chunks: expected an integer >= 1, got '0'"),
        (["compare", *SCHEDULE_ARGS, "--f", "nan"], "argument --f: expected a finite number >= 0"),
        (["compare", *SCHEDULE_ARGS, "--comm", "inf"], "argument --comm: expected a finite number >= 0, got 'inf'"),
        (["compare", *SCHEDULE_ARGS, "--memory-limit", "nan"], "argument --memory-limit: expected a finite number >= 0, got 'nan'"),
        (["compare", *SCHEDULE_ARGS, "--f", "1,2,3"], "no schedule accepts these arguments; gpipe: --f has 3 values, but "
                                                        "gpipe on 4 ranks has 4 stages: give one number, or 4 separated"),
        # one value per rank on a schedule of 2 stages per rank: named as Costs.f, not the flag typed
        (["show", "zb-v", *SCHEDULE_ARGS, "--f", "1,2,3,4"], "--f has 4 values, but zb-v on 4 ranks has 8 stages, 2 per "
                                                             "rank: give one number, or 8 separated by commas"),
        (["show", "zbi-auto", "-p", "2", "-m", "4", "--chunks", "3", "--w", "1,2"], "--w has 2 values, but zbi-auto on 2 "
                                                                                   "ranks has 6 stages, 3 per rank"),
        (["show", "interleaved-1f1b", "-p", "2", "-m", "4", "--activation", "1,2"], "--activation has 2 values, but "
                                                                                   "interleaved-1f1b on 2 ranks has 4"),
        (["trace", "v-half", "-p", "2", "-m", "4", "--wgrad", "1,2", "-o", "x.json"], "--wgrad has 2 values, but v-half on"),
        (["compare", "-p", "4"], "the following arguments are required: -m/--microbatches"),
        (["show", "zb-h1", *SCHEDULE_ARGS, "--comm", "nan"], "argument --comm: expected a finite number >= 0, got 'nan'"),
        (["show", "zb-h1", *SCHEDULE_ARGS, "--comm", "-0.5"], "argument --comm: expected a finite number >= 0, got '-0.5'"),
        (["show", "zb-h1", *SCHEDULE_ARGS, "--b", "1,inf,1,1"], "argument --b: expected a finite number >= 0"),
        # an empty field was dropped: '1,,2' read as [1, 2], each value then on the wrong stage
        (["show", "zb-h1", "-p", "2", "-m", "4", "--f", "1,,2"], "argument --f: expected a finite number >= 0, or such "
                                                                  "numbers separated by commas (one per stage), got '1,,2'"),
        (["show", "zb-h1", "-p", "2", "-m", "4", "--activation", "1,2,"], "argument --activation: expected a finite"),
        (["show", "zb-h1", *SCHEDULE_ARGS, "--w", "-1"], "argument --w: expected a finite number >= 0"),
        (["show", "zb-h1", *SCHEDULE_ARGS, "--activation", "inf"], "argument --activation: expected a finite number >= 0"),
        (["show", "zb-h1", *SCHEDULE_ARGS, "--wgrad", "nan"], "argument --wgrad: expected a finite number >= 0"),
        (["show", "zb-auto", *SCHEDULE_ARGS, "--memory-limit", "inf"], "argument --memory-limit: expected a finite number >= 0, got 'inf'"),
        (["show", "zb-h1", *SCHEDULE_ARGS, "--width", "0"], "argument --width: expected an integer >= 1, got '0'"),
        (["show", "zb-v", "-p", "1000000000", "-m", "8"], "would create up to 11,999,999,994,000,000,000 tasks, more than the limit"),
        # finite costs whose sums overflow a float: a nan in the timeline, a stalled search
        (["show", "1f1b", *SCHEDULE_ARGS, "--f", "1e308"], "simulate: the step's times overflow a float"),
        (["show", "zbv-auto", *SCHEDULE_ARGS, "--comm", "1e308"], "zbv-auto: the costs are too large"),
        # '' passed as the current folder and failed only when written, naming no flag
        (["trace", "zb-h1", *SCHEDULE_ARGS, "-o", ""], "-o '': give a file name"),
        (["measure", "--hf-config", "missing", "--seq", "8", "-o", ""], "-o '': give a file name"),
        (["plot", "zb-h1", *SCHEDULE_ARGS, "-o", "x.pdf"], "-o x.pdf: use a .svg or .png file name"),
        # GB times 1e9 overflowed to inf (or a bandwidth of 0 divided), named as the planner's argument
        (["plan", "--profile", "missing.json", "-p", "2", "-m", "4", "--budget-gb", "1e300"],
         "argument --budget-gb: expected a number >= 0 and at most 1e299 (GB), got '1e300'"),
        (["plan", "--profile", "missing.json", "-p", "2", "-m", "4", "--host-memory-gb", "1e300"],
         "argument --host-memory-gb: expected a number >= 0 and at most 1e299 (GB), got '1e300'"),
        (["measure", "--hf-config", "missing", "--seq", "8", "--host-gb-per-s", "1e300", "-o", "p.json"],
         "argument --host-gb-per-s: expected a number > 0 and at most 1e299 (GB/s), got '1e300'"),
        (["measure", "--hf-config", "missing", "--seq", "8", "--link-gb-per-s", "0", "-o", "p.json"],
         "argument --link-gb-per-s: expected a number > 0 and at most 1e299 (GB/s), got '0'"),
        (["demo", "--ranks", "0"], "argument --ranks: expected an integer in 1..64, got '0'"),
        (["demo", "--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
        (["demo", "--microbatches", "2.5"], "argument --microbatches: expected an integer in 1..4096, got '2.5'"),
        (["demo", "--seed", "-1"], "argument --seed: expected an integer in 0..4294967295, got '-1'"),
    ],
)
def test_bad_argument_exits_2_with_one_line_naming_it(argv: list[str], names: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert names in _one_error_line(captured.err, argv[0])
    assert captured.out == ""  # no partial table or timeline before the error


@pytest.mark.parametrize("command, suffix", [("plot", "svg"), ("trace", "json")])
def test_output_in_a_missing_folder_is_one_line_and_nothing_is_written(
    command: str, suffix: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "no-such-folder" / f"out.{suffix}"
    assert main([command, "zb-h1", *SCHEDULE_ARGS, "-o", str(target)]) == 2
    line = _one_error_line(capsys.readouterr().err, command)
    assert f"-o {target}: the folder {target.parent} does not exist" in line
    assert not target.parent.exists()


def test_an_output_name_it_cannot_write_is_refused_before_any_work(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A plot to .pdf or a trace to '' ran the whole (automatic) search before the name failed."""
    monkeypatch.setattr(cli, "build", lambda *a, **k: pytest.fail("built before -o was checked"))
    for command, output in (("plot", "step.pdf"), ("trace", "")):
        assert main([command, "zb-auto", *SCHEDULE_ARGS, "-o", output]) == 2
        _one_error_line(capsys.readouterr().err, command)


def test_output_that_is_a_folder_is_refused(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "zb-h1", *SCHEDULE_ARGS, "-o", str(tmp_path)]) == 2
    assert f"-o {tmp_path}: that is a folder" in _one_error_line(capsys.readouterr().err, "trace")


def test_a_missing_measured_trace_is_one_line_exit_1(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.json"
    assert main(["plot", "zb-h1", *SCHEDULE_ARGS, "-o", str(tmp_path / "x.svg"), "--measured", str(missing)]) == 1
    assert str(missing) in _one_error_line(capsys.readouterr().err, "plot")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"zbpp {zbpp.__version__}"


@pytest.mark.parametrize(
    "argv",
    [
        ["compare", "-p", "0", "-m", "8"],
        ["plot", "zb-h1", "-p", "2", "-m", "2", "-o", "/nonexistent-zbpp-folder/x.svg"],
        ["show", "zb-h1", "-p", "2", "-m", "2", "--comm", "nan"],
    ],
)
def test_the_installed_command_prints_one_line_and_fails(argv: list[str]) -> None:
    """Through `python -m zbpp` (what a user runs): the exit status reaches the shell."""
    out = subprocess.run([sys.executable, "-m", "zbpp", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    _one_error_line(out.stderr, argv[0])
    assert out.stdout == ""
