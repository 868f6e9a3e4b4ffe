"""examples/train.py's argument check: bad numbers are refused by name, before torch.distributed
starts (training itself runs under torchrun in tests/runtime/test_torchrun.py)."""

from __future__ import annotations

import pytest

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


def test_hidden_must_split_over_the_heads(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_example("train").parse_args(["--hidden", "30"])  # 4 heads
    assert "--hidden 30 must be a multiple of the 4 attention heads" in capsys.readouterr().err
