"""Failures inside a step, on 2 gloo ranks with a 3-second process-group timeout (a dedicated pool
per test: a failed step leaves the process group in an unknown state)."""

from __future__ import annotations

import pytest

from zbpp.testing import Workers

from .cases import fail_in_last_task_then_recover, fail_in_stage, mismatch_after_first_step

PG_TIMEOUT = 3.0


@pytest.mark.slow
def test_exception_in_a_stage_names_the_task_and_peers_time_out():
    with Workers(2, pg_timeout=PG_TIMEOUT, timeout=120) as workers:
        r0, r1 = workers.run(fail_in_stage)
    assert "task F1.2" in r1["error"] and "injected failure" in r1["error"] and "discarded" in r1["error"]
    assert r1["grads"] == [False] * len(r1["grads"]) and r1["pending"] == []
    assert r0["seconds"] < 10 * PG_TIMEOUT, r0  # an error, not a hang
    assert "pipeline rank 0" in r0["error"]


@pytest.mark.slow
def test_shape_change_within_a_signature_is_reported():
    with Workers(2, pg_timeout=PG_TIMEOUT, timeout=120) as workers:
        r0, r1 = workers.run(mismatch_after_first_step)
    assert r0["type"] == "ShapeMismatchError"
    assert "stage 0 microbatch 0" in r0["error"], r0["error"]
    assert "float32[1, 8](grad)" in r0["error"] and "float32[2, 8](grad)" in r0["error"], r0["error"]
    assert r1["seconds"] < 10 * PG_TIMEOUT


def test_a_rank_failing_after_its_messages_recovers_on_the_next_step():
    with Workers(2, pg_timeout=30, timeout=120) as workers:
        assert workers.run(fail_in_last_task_then_recover) == [["step ok", "recovered"], ["step failed", "recovered"]]
