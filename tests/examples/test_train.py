"""examples/train.py's argument check: bad numbers are refused by name, before torch.distributed
starts (training itself runs under torchrun in tests/runtime/test_torchrun.py); and its --check
fails on every rank when any rank's figures are NaN."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch.distributed as dist

from zbpp import Pipeline

from .loader import load_example


@pytest.mark.parametrize("flag, value", [("--dp", "0"), ("--microbatches", "0"), ("--steps", "-1"),
                                         ("--rows-per-microbatch", "0"), ("--hidden", "0"), ("--seq-len", "0"),
                                         ("--blocks-per-stage", "0")])
def test_refuses_counts_below_one_by_name(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # --dp 0 used to end every rank in `world % 0` (ZeroDivisionError), naming no flag
    with pytest.raises(SystemExit) as info:
        load_example("train").parse_args([flag, value])
    assert info.value.code == 2
    assert f"{flag} must be >= 1, got {value}" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_clip_must_be_positive(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # --clip 0 clipped every gradient to norm 0: the model never moved, and --check (whose one
    # process clips alike) said OK; the other examples read 0 as "off"
    with pytest.raises(SystemExit):
        load_example("train").parse_args(["--clip", value])
    assert f"--clip must be > 0 (leave it out for no clipping), got {float(value)}" in capsys.readouterr().err


def test_an_unknown_schedule_is_refused_before_training(capsys: pytest.CaptureFixture[str]) -> None:
    # it was taken as given, and every rank failed in build() with a traceback once torch.distributed ran
    with pytest.raises(SystemExit) as info:
        load_example("train").parse_args(["--schedule", "zb-x"])
    assert info.value.code == 2
    assert "unknown --schedule 'zb-x'; available: gpipe, 1f1b" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["missing/t.json", "."])
def test_a_task_times_file_that_cannot_be_written_is_refused_before_training(
        where: str, tmp_path, monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--task-times-out is written after the last step: a folder that does not exist (or a folder
    given as the file) failed pipeline rank 0 with a traceback once every step had run."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        load_example("train").parse_args(["--task-times-out", where])
    assert exc.value.code == 2
    assert f"--task-times-out {where}: give a file in a folder that exists" in capsys.readouterr().err
    assert load_example("train").parse_args(["--task-times-out", "t.json"]).task_times_out == "t.json"


def test_hidden_must_split_over_the_heads(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_example("train").parse_args(["--hidden", "30"])  # 4 heads
    assert "--hidden 30 must be a multiple of the 4 attention heads" in capsys.readouterr().err


class _NaNOnRankOne(Pipeline):
    """The example's pipeline, but rank 1 (the last stage's) turns its step's loss or, after the
    step, its first parameter's gradient NaN (Adam then makes the parameter NaN)."""

    where = ""

    def step(self, *args: Any, **kwargs: Any) -> Any:
        loss = super().step(*args, **kwargs)
        if dist.get_rank() == 1 and self.where == "loss":
            loss = loss * math.nan
        if dist.get_rank() == 1 and self.where == "parameter":
            next(iter(self.parameters())).grad.fill_(math.nan)
        return loss


def _check_with_nan_on_rank_one(where: str) -> int:
    ex = load_example("train")
    _NaNOnRankOne.where = where
    ex.Pipeline = _NaNOnRankOne
    try:
        return ex.main(["--steps", "1", "--microbatches", "2", "--backend", "gloo", "--timeout", "60", "--check"])
    finally:
        ex.Pipeline = Pipeline


@pytest.mark.parametrize("where, status", [("", 0), ("loss", 1), ("parameter", 1)])
def test_check_fails_on_every_rank_for_a_nan_on_rank_one(zbpp_workers, where: str, status: int) -> None:
    """Two ranks, one step, --check. A NaN loss on rank 1 (the only rank with a loss) was dropped by
    Python's max(0.0, nan), and rank 1's NaN parameter by gloo's MAX (which keeps rank 0's 0.0): the
    check said OK (exit code 0). Both must be a mismatch (1) on both ranks; without a NaN, OK."""
    assert zbpp_workers(2).run(_check_with_nan_on_rank_one, where) == [status, status]
