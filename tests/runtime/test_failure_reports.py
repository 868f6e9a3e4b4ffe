"""A failure on several ranks ends with the first failing rank's error, short, in the harness's
`DistributedTestError` and in `zbpp demo` (whose full reports go to a file it names).

The failing functions below stand for what a pipeline does: one rank raises (the cause), the others
fail a moment later because of it, with long stacks that would bury the cause if it came first.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch.distributed as dist

from zbpp import demo
from zbpp.cli import main
from zbpp.testing import DistributedTestError
from zbpp.testing.distributed import short_error

CAUSE = "ValueError: rank 1's own failure, the cause"


def _deep(n: int) -> None:
    """A long stack, like the runtime's, before the consequential error."""
    if n == 0:
        raise RuntimeError("a peer failed, so this rank gave up (a consequence)\n" + "detail line\n" * 20)
    _deep(n - 1)


def _cause() -> None:
    try:
        {}["missing"]
    except KeyError as exc:
        raise ValueError("rank 1's own failure, the cause") from exc


def rank_one_causes_rank_zero_follows(*unused: object) -> None:
    if dist.get_rank() == 1:
        _cause()
    time.sleep(1.0)  # the consequence comes later
    _deep(40)


class _SlowToDescribe(Exception):
    """An exception whose report takes a while to write (as a huge one would)."""

    def __str__(self) -> str:
        time.sleep(2.0)
        return "rank 1 raised first, but its report is slow"


def rank_one_raises_first_but_reports_last() -> None:
    if dist.get_rank() == 1:
        raise _SlowToDescribe()
    time.sleep(0.5)
    raise RuntimeError("rank 0 raised second and reports first")


def rank_one_dies_rank_zero_hangs() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(600)


def _tail_after_marker(text: str) -> list[str]:
    lines = text.splitlines()
    marker = max(i for i, line in enumerate(lines) if line.startswith("=== rank "))
    return lines[marker:]


def test_the_first_failing_rank_comes_last_and_short(zbpp_workers) -> None:
    workers = zbpp_workers(2, grace=5.0)
    with pytest.raises(DistributedTestError) as info:
        workers.run(rank_one_causes_rank_zero_follows)
    err = info.value
    assert err.first_rank == 1
    text = str(err)
    assert text.index("--- rank 0:") < text.index("--- rank 1:")  # every full report, in rank order, first
    assert "a consequence" in err.failures[0] and len(err.failures[0].splitlines()) > 20  # long, buries the cause
    tail = _tail_after_marker(text)
    assert tail[0] == "=== rank 1 failed first (the other failures may follow from it):"
    assert len(tail) <= 6, "\n".join(tail)
    assert re.match(r'  File ".*test_failure_reports.py", line \d+, in _cause', tail[1]), tail
    assert tail[2].strip() == 'raise ValueError("rank 1\'s own failure, the cause") from exc'
    assert tail[3] == CAUSE
    assert tail[-1] == "(caused by: KeyError: 'missing')"
    assert err.first_error == "\n".join(tail[1:])


def test_first_is_who_raised_first_not_whose_report_arrived_first(zbpp_workers) -> None:
    with pytest.raises(DistributedTestError) as info:
        zbpp_workers(2, grace=10.0).run(rank_one_raises_first_but_reports_last)
    err = info.value
    assert err.first_rank == 1, str(err)
    assert _tail_after_marker(str(err))[-1].endswith("_SlowToDescribe: rank 1 raised first, but its report is slow")


def test_a_rank_that_died_comes_before_one_stopped_for_hanging(zbpp_workers) -> None:
    with pytest.raises(DistributedTestError) as info:
        zbpp_workers(2, grace=1.0).run(rank_one_dies_rank_zero_hangs)
    err = info.value
    assert err.first_rank == 1 and "after another rank failed" in err.failures[0]
    tail = _tail_after_marker(str(err))
    assert tail == ["=== rank 1 failed first (the other failures may follow from it):",
                    "process exited with code 3 without reporting"]


def test_short_error_of_a_long_message_and_of_a_hang() -> None:
    report = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\n    ^^^\nE: one\n' + "more\n" * 10
    assert short_error(report).splitlines() == ['  File "x.py", line 1, in f', "    g()", "E: one", "more", "more", "more",
                                                "... (7 more lines above)"]
    hang = "no result within the timeout of 2 s (f); its Python stacks:\n" + "stack line\n" * 50
    assert short_error(hang).splitlines()[0].startswith("no result within the timeout of 2 s")
    assert len(short_error(hang).splitlines()) == 5


def test_demo_failure_ends_with_the_first_rank_error_and_names_the_full_report(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The demo ships `demo._rank_main` to its ranks by name: this failing one goes instead.
    monkeypatch.setattr(demo, "_rank_main", rank_one_causes_rank_zero_follows)
    assert main(["demo", "--ranks", "2", "--microbatches", "2", "--steps", "1"]) == 1
    err = capsys.readouterr().err.rstrip().splitlines()
    path = re.search(r"every rank's report is in (\S+)", "\n".join(err))
    assert path, err
    try:
        full = open(path.group(1)).read()
        assert "--- rank 0:" in full and "--- rank 1:" in full and "a consequence" in full and CAUSE in full
    finally:
        os.unlink(path.group(1))
    start = err.index("zbpp demo: error: rank 1 failed first:")
    assert len(err) - start <= 6, err  # the last lines: rank 1's error, short
    assert err[start + 3] == CAUSE and err[-1] == "(caused by: KeyError: 'missing')"
    assert "a consequence" not in "\n".join(err)  # the long consequential stacks stay in the file
