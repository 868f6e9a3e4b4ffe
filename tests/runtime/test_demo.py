"""`zbpp demo` (the README's "run it" command) trains on 4 spawned CPU ranks and passes its check.

Through `zbpp.cli.main`, in this process: what ``python -m zbpp`` and the installed ``zbpp`` call
(`tests/schedules/test_cli.py` runs ``python -m zbpp`` itself, and CI runs ``zbpp demo``)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

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


def _demo_rank_with_a_nan_parameter_on_rank_one() -> dict[str, Any]:
    """The demo's rank on 2 ranks, one 1F1B step, after which rank 1's first parameter's gradient is
    NaN: the optimizer step that follows makes the parameter NaN while the step's loss stays finite."""
    from zbpp import Pipeline
    from zbpp.demo import _rank_main

    step = Pipeline.step

    def poisoned(pipe: Any, *args: Any, **kwargs: Any) -> Any:
        loss = step(pipe, *args, **kwargs)
        if torch.distributed.get_rank() == 1:
            next(iter(pipe.parameters())).grad.fill_(math.nan)
        return loss

    Pipeline.step = poisoned
    try:
        return _rank_main("1f1b", 2, 1, 0)
    finally:
        Pipeline.step = step


def test_a_nan_parameter_on_a_rank_fails_the_check(zbpp_workers) -> None:
    """Two ranks, one 1F1B step, rank 1's parameter NaN after it (its loss finite): the rank kept
    its largest parameter difference with max(0.0, nan), which is 0.0, and the check said OK."""
    from zbpp.demo import _check

    results = zbpp_workers(2).run(_demo_rank_with_a_nan_parameter_on_rank_one)
    assert math.isnan(results[1]["diff"]) and not math.isnan(results[0]["diff"]), [r["diff"] for r in results]
    ok, line = _check(results)
    assert not ok and line.endswith(": MISMATCH"), line


@pytest.mark.parametrize("flag, value", [("--ranks", 10_000), ("--microbatches", 1_000_000)])
def test_demo_refuses_ranks_or_microbatches_beyond_its_bound_before_spawning(monkeypatch, capsys, flag, value):
    """``--ranks 10000`` forked 10000 CPU processes (and ``--microbatches 10**6`` gave every rank a batch
    of 4 million sequences, twice): both are refused, naming the flag and its bound, before any process
    is spawned, through the command line and through `run_demo` alike. The spawn is a stub here."""
    import argparse

    import zbpp.testing

    def no_spawn(fn: Any, world_size: int, **kwargs: Any) -> Any:
        raise AssertionError(f"the demo spawned {world_size} ranks")

    monkeypatch.setattr(zbpp.testing, "run_distributed", no_spawn)
    code = main(["demo", "--schedule", "1f1b", flag, str(value)])
    err = capsys.readouterr().err
    assert code == 2 and f"argument {flag}: expected an integer in 1.." in err and f"got '{value}'" in err, err
    from zbpp.demo import MAX_MICROBATCHES, MAX_RANKS, run_demo

    bound = MAX_RANKS if flag == "--ranks" else MAX_MICROBATCHES
    assert f"1..{bound}," in err, err
    args = argparse.Namespace(schedule="1f1b", ranks=4, microbatches=8, steps=1, seed=0)
    setattr(args, flag[2:], value)
    with pytest.raises(ValueError, match=f"{flag} must be <= {bound}"):
        run_demo(args)


def test_demo_sets_no_limit_on_the_whole_run(monkeypatch):
    """The demo's ranks ran under a fixed 300 s limit on the whole run: a long ``--steps 1000`` on
    a machine of few cores was stopped as hung, though nothing was. Its length grows with the
    flags, so the run has no limit; a hang still ends it, through the process group's finite
    timeout. The spawn is a stub that records its arguments."""
    import zbpp.testing

    seen: dict[str, Any] = {}

    class Spawned(Exception):
        pass

    def record(fn: Any, world_size: int, **kwargs: Any) -> Any:
        seen.update(kwargs, world_size=world_size)
        raise Spawned

    monkeypatch.setattr(zbpp.testing, "run_distributed", record)
    with pytest.raises(Spawned):
        main(["demo", "--schedule", "1f1b", "--ranks", "2", "--steps", "1000"])
    assert seen["world_size"] == 2 and seen["timeout"] == math.inf, seen
    assert math.isfinite(seen["pg_timeout"]), seen
