"""`zbpp demo` (the README's "run it" command) trains on 4 spawned CPU ranks and passes its check.

Through `zbpp.cli.main`, in this process: what ``python -m zbpp`` and the installed ``zbpp`` call
(`tests/schedules/test_cli.py` runs ``python -m zbpp`` itself, and CI runs ``zbpp demo``)."""

from __future__ import annotations

import pytest

from zbpp.cli import main


@pytest.mark.slow
def test_zbpp_demo_runs_and_agrees_with_one_process(capsys):
    code = main(["demo", "--steps", "3"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 0, text
    assert "zbpp demo: zb-v on 4 CPU ranks" in text or "using 'zb-h1' instead" in text, text
    assert "with the task times measured on the last step (simulated" in text and "with equal F, B, W times (the schedule's ideal)" in text, text
    assert "check against one process" in text and ": OK" in text, text
    losses = [float(line.split()[1]) for line in text.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 3]
    assert len(losses) == 3 and losses[-1] < losses[0], text


def test_demo_rejects_an_unknown_schedule(capsys):
    code = main(["demo", "--schedule", "nope"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown schedule 'nope'" in err, err


@pytest.mark.parametrize("losses, diff, ok", [([2.0, 1.5], 0.0, True), ([2.0, 1.6], 0.0, False),
                                             ([2.0, float("nan")], 0.0, False), ([2.0, 1.5], float("nan"), False)])
def test_the_check_compares_the_reported_losses_too(losses: list[float], diff: float, ok: bool) -> None:
    """The check said OK from the parameters alone, so a wrongly reported loss passed it, and a NaN
    parameter difference on a rank after the first was dropped by ``max``. Hand-made results: rank
    0's parameters equal, one-process losses 2.0 and 1.5; a reported 1.6 (0.1 off, over the 1e-4
    tolerance), a NaN loss or rank 1's NaN difference is a MISMATCH."""
    from zbpp.demo import _check

    results = [{"diff": 0.0, "losses": [None, None], "ref_losses": []},
               {"diff": diff, "losses": losses, "ref_losses": [2.0, 1.5]}]
    got, line = _check(results)
    assert got is ok and line.endswith(": OK" if ok else ": MISMATCH"), line
    assert "max |loss difference|" in line, line

