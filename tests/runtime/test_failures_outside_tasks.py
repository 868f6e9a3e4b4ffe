"""An interrupt (KeyboardInterrupt, SystemExit) on one rank outside any task: while it sets
gradients aside, begins or finishes the reductions, signals a stage's last backward, waits for its
sends, or waits for the start or end agreement (there also an error of the store). Every rank
raises within seconds, whatever the process-group timeout (120 s; each run's own timeout, 60 s, is
below it: a hang fails the test instead of passing late); the interrupted rank gets its own
interrupt back, its peers a `PipelineError` naming it; the next step is right on every rank (or,
where the pipeline cannot know what a half-done reduction left, raises at once saying it is
unusable)."""

from __future__ import annotations

import pytest

from zbpp.testing import Workers

from .failure_cases import (buffer_sync_fails_once, clip_refused_on_one_rank, ctrl_c_in_the_loss_weights_all_reduce,
                            ctrl_c_while_a_new_shape_arrives, ctrl_c_while_gathering_task_times,
                            ctrl_c_while_told_the_failure, fifo_layers_fail_once, interrupted_outside_task,
                            loss_weight_interrupted, reducer_wait_interrupted, rollback_interrupted)

PG_TIMEOUT = 120.0
FAST = 10.0  # seconds every rank may take to raise
FAIL_RANK = 1


@pytest.fixture(scope="module")
def two():
    with Workers(2, pg_timeout=PG_TIMEOUT, timeout=60) as workers:
        yield workers


def _run(two, where: str, which: str) -> list[dict]:
    outcomes = two.run(interrupted_outside_task, "1f1b", 2, 4, FAIL_RANK, where, which)
    for o in outcomes:
        assert o["seconds"] < FAST, f"rank {o['rank']} took {o['seconds']:.1f} s to raise: {o}"
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("where,which", [
    ("set_aside", "KeyboardInterrupt"), ("begin", "KeyboardInterrupt"), ("begin", "SystemExit"),
    ("finish", "KeyboardInterrupt"), ("finish", "SystemExit"), ("send_wait", "KeyboardInterrupt"),
    ("start", "KeyboardInterrupt"), ("start", "SystemExit"), ("start", "RuntimeError"),
])
def test_the_step_drains_and_every_rank_raises(two, where, which):
    for o in _run(two, where, which):
        if o["rank"] == FAIL_RANK and which != "RuntimeError":
            assert o["result"] == which, o
        else:
            assert o["result"] == "PipelineError", o
            assert f"pipeline rank {FAIL_RANK}" in o["message"], o["message"]
            assert f"{which}: injected {where} {which}" in o["message"], o["message"]
            assert "usable" in o["message"] and "unusable" not in o["message"], o["message"]
        assert o["next"] == "success" and o.get("checked"), o  # gradients: the good step's and the next's


@pytest.mark.slow
def test_an_interrupt_in_a_stage_boundary_signal_leaves_the_pipeline_unusable():
    """The reductions' signal was cut short: whether its collectives were launched is unknown, so the
    pipeline says it is unusable (on every rank, at once) rather than pair collectives wrongly. Its
    own ranks: the job stays marked broken."""
    with Workers(2, pg_timeout=PG_TIMEOUT, timeout=60) as workers:
        outcomes = _run(workers, "stage_backward_done", "KeyboardInterrupt")
    for o in outcomes:
        want = "KeyboardInterrupt" if o["rank"] == FAIL_RANK else "PipelineError"
        assert o["result"] == want, o
        if o["rank"] != FAIL_RANK:
            assert "KeyboardInterrupt: injected stage_backward_done" in o["message"], o["message"]
        assert "unusable" in o["next"] and o["next_seconds"] < 1.0, o


@pytest.mark.slow
def test_an_interrupt_in_the_reducers_wait_drains_every_replica():
    """dp=2 x pp=2: the data-parallel reducer's wait for an all-reduce (GradReducer.finish) is
    interrupted on global rank 1; the other replica's rank, whose all-reduce completed, and the
    pipeline peers raise within seconds; the next step's gradients are the uninterrupted step's."""
    with Workers(4, pg_timeout=PG_TIMEOUT, timeout=60) as workers:
        outcomes = workers.run(reducer_wait_interrupted, "zb-h1", 2, 4, 1)
    for o in _interrupted_on_rank_one(outcomes, "global rank 1", "injected reducer wait interrupt"):
        assert "unusable" not in o["message"], o


@pytest.mark.slow
@pytest.mark.parametrize("where,which", [("end", "KeyboardInterrupt"), ("end", "RuntimeError"),
                                         ("commit", "KeyboardInterrupt")])
def test_after_the_end_agreement_the_step_counts(two, where, which):
    """The interrupt (or a store error) came while the rank waited for the end agreement: the
    outcome was being decided with the others, who succeed; the rank finishes the agreement, commits
    the step like them, then raises what it got. Or it came while the rank committed (after the
    first kept gradient took the step's): the commit left the other gradients with the step's only,
    the earlier ones lost. Now the commit completes, then the interrupt is raised."""
    for o in _run(two, where, which):
        assert o["result"] == (which if o["rank"] == FAIL_RANK else "success"), o
        assert o["next"] == "success" and o.get("checked"), o


@pytest.mark.slow
@pytest.mark.parametrize("which", ["KeyboardInterrupt", "SystemExit"])
def test_an_interrupt_in_loss_weight_raises_before_any_compute(two, which):
    """``loss_weight`` runs on the last stage's rank before the start agreement: an interrupt there
    left that rank's step at once and its peer waited in the agreement (then paired it with the
    interrupted rank's next step). It is told in the agreement like a rejected input."""
    for o in two.run(loss_weight_interrupted, "1f1b", 2, 4, which):
        assert o["seconds"] < FAST, f"rank {o['rank']} took {o['seconds']:.1f} s to raise: {o}"
        if o["rank"] == 1:
            assert o["result"] == which, o
        else:
            assert o["result"] == "PipelineError", o
            assert "global rank 1" in o["message"] and f"{which}: injected loss_weight interrupt" in o["message"], o


@pytest.mark.slow
def test_a_buffer_sync_failing_on_one_replica_raises_everywhere_in_that_step():
    """dp=2: copying replica 0's module buffers fails on replica 1. The sync ran after the end
    agreement, so replica 0 (which only sent) returned success for that step and raised only at its
    next call. Now both raise in that step, fast, naming the failure, and the next call says the
    pipeline is unusable (ranks of other pipeline positions, without buffers, raise alike: the
    failure travels in the end agreement). Own ranks: the job stays marked broken."""
    with Workers(2, pg_timeout=PG_TIMEOUT, timeout=60) as workers:
        outcomes = workers.run(buffer_sync_fails_once, "1f1b", 1, 4, FAIL_RANK)
    for o in outcomes:
        assert o["seconds"] < FAST, f"rank {o['rank']} took {o['seconds']:.1f} s to raise: {o}"
        assert o["result"] == "PipelineError", o
        assert "module buffers" in o["message"] and "injected buffer copy failure" in o["message"], o
        assert "unusable" in o["next"] and o["next_seconds"] < 1.0, o


@pytest.mark.slow
def test_an_interrupt_while_rolling_back_a_failed_step():
    """Rolling a failed step back runs inside the end agreement (between its two exchanges): an
    interrupt there left it, the peer waited for this rank's message until gloo aborted it on the
    next step's mismatched collective. Now the rollback ends (its interrupted part again), the
    agreement too, and the rank raises the interrupt; nothing of the step or its wgrads remains.
    Own ranks: before the fix a peer process dies."""
    with Workers(4, pg_timeout=PG_TIMEOUT, timeout=60) as workers:
        outcomes = workers.run(rollback_interrupted, "zb-h1", 4, 8, 1)
    _interrupted_on_rank_one(outcomes, "pipeline rank 1", "injected F failure")
    assert all(o["pending"] == [] for o in outcomes), outcomes


@pytest.mark.slow
def test_an_interrupt_while_rolling_back_transformer_engine_like_layers():
    """The rollback drops a FIFO layer's queued wgrads by computing them (`fifo_layers_fail_once`,
    dp=2 x pp=2): an interrupt in the first left the others queued, and the next step's W computed
    them in place of its own (wrong gradients, no error). Now that part of the rollback runs again."""
    with Workers(4, pg_timeout=PG_TIMEOUT, timeout=60) as workers:
        outcomes = workers.run(fifo_layers_fail_once, "zb-h2", 4, "F+interrupt", 1)
    for o in outcomes:
        assert o["result"] == ("KeyboardInterrupt" if o["rank"] == 1 else "PipelineError"), o
        assert o["queued"] == [0, 0], o


@pytest.mark.slow
def test_ctrl_c_while_the_failure_is_told(two):
    """A real Ctrl-C on rank 1 while it waits for the failed rank's message after the end agreement:
    all_gather_object raised the KeyboardInterrupt between its two collectives, leaving rank 0 in the
    second, which then paired with rank 1's next start agreement (rank 0 got an UnpicklingError, gloo
    aborted rank 1's process). Now the exchange completes; rank 1 gets its interrupt, rank 0 the
    failure, and the next step is right on both."""
    for o in two.run(ctrl_c_while_told_the_failure, "1f1b", 2, 4, FAIL_RANK):
        assert o["seconds"] < FAST, f"rank {o['rank']} took {o['seconds']:.1f} s to raise: {o}"
        if o["rank"] == FAIL_RANK:
            assert o["result"] == "KeyboardInterrupt", o
        else:
            assert o["result"] == "PipelineError" and "pipeline rank 0" in o["message"], o
            assert "injected F failure" in o["message"], o["message"]
        assert o["next"] == "success", o



@pytest.mark.slow
def test_ctrl_c_while_gathering_task_times(two):
    """A real Ctrl-C on rank 1 while it waits for rank 0 in task_times(): gather_object raised it
    between its two collectives and rank 0 waited for rank 1's records until the group's timeout.
    Now the exchange completes: rank 0 gets every task's record, rank 1 its interrupt."""
    from zbpp.schedules import build

    tasks = sum(len(order) for order in build("1f1b", num_ranks=2, num_microbatches=4).orders)
    for o in two.run(ctrl_c_while_gathering_task_times, "1f1b", 2, 4, FAIL_RANK):
        assert o["seconds"] < FAST, f"rank {o['rank']} took {o['seconds']:.1f} s: {o}"
        assert o["result"] == ("KeyboardInterrupt" if o["rank"] == FAIL_RANK else "success"), o
        assert o["records"] == (tasks if o["rank"] == 0 else None), o


@pytest.mark.slow
def test_ctrl_c_while_a_new_shape_arrives(two):
    """A real Ctrl-C on rank 1 while it waits for the spec of a new input signature's activation:
    raised between the spec's length and its bytes, it left the bytes to the channel's next receive
    and gloo aborted rank 1's process (rank 0: "this Pipeline is unusable"). Now the spec and its
    tensors are received; rank 1 gets its interrupt, rank 0 a PipelineError naming it, and the next
    step is right on both."""
    _assert_drained(two.run(ctrl_c_while_a_new_shape_arrives, "1f1b", 2, 4, FAIL_RANK), "pipeline rank 1")


@pytest.mark.slow
def test_ctrl_c_in_the_loss_weights_all_reduce(two):
    """dp=2 with loss_weight: a real Ctrl-C on rank 1 while it waits in the all-reduce of the loss
    weights, after the start agreement. It left the step once the all-reduce returned, and the other
    replica, gone into the step, waited for its gradients until the group's timeout. Now rank 1
    drains the step: it gets its interrupt, rank 0 a PipelineError naming it, and the next step is
    the uninterrupted one on both."""
    _assert_drained(two.run(ctrl_c_in_the_loss_weights_all_reduce, "1f1b", 4, FAIL_RANK), "global rank 1")


def _assert_drained(outcomes: list[dict], named: str) -> None:
    """A real Ctrl-C on FAIL_RANK, drained: fast on both ranks, the interrupt on it, on the other a
    PipelineError naming it (`named`) that keeps the pipeline usable, and the next step right on both."""
    for o in outcomes:
        assert o["seconds"] < FAST, f"rank {o['rank']} took {o['seconds']:.1f} s: {o}"
        if o["rank"] == FAIL_RANK:
            assert o["result"] == "KeyboardInterrupt", o
        else:
            assert o["result"] == "PipelineError" and named in o["message"], o
            assert "KeyboardInterrupt" in o["message"] and "unusable" not in o["message"], o["message"]
        assert o["next"] == "success", o


def _interrupted_on_rank_one(outcomes: list[dict], *named: str) -> list[dict]:
    """Every rank raised fast: rank 1 its KeyboardInterrupt, the others a PipelineError whose message
    holds each of `named`. Returns the others' outcomes."""
    for o in outcomes:
        assert o["seconds"] < FAST, f"rank {o['rank']} took {o['seconds']:.1f} s to raise: {o}"
        assert o["result"] == ("KeyboardInterrupt" if o["rank"] == 1 else "PipelineError"), o
        if o["rank"] != 1:
            assert all(words in o["message"] for words in named), o
    return [o for o in outcomes if o["rank"] != 1]


@pytest.mark.parametrize("by_groups", [False, True])
def test_clip_of_parameters_refused_on_one_rank_raises_everywhere_fast(two, by_groups):
    """clip_grad_norm_ given parameters, not a Pipeline, refused on one rank (a main_grad beside its
    .grad): that rank raised, the other waited in the norm's all-reduce until the group's timeout
    (120 s). This run's own timeout (20 s) is below it: a hang fails the test. Now the other raises
    a PipelineError naming the refusing rank and its error, and the next call is torch's clip."""
    outcomes = two.run(clip_refused_on_one_rank, FAIL_RANK, by_groups, timeout=20)
    for o in outcomes:
        assert o["seconds"] < FAST, f"rank {o['rank']} took {o['seconds']:.1f} s to raise: {o}"
        if o["rank"] == FAIL_RANK:
            assert o["result"] == "ValueError" and "main_grad" in o["message"], o
        else:
            assert o["result"] == "PipelineError", o
            assert f"global rank {FAIL_RANK}: ValueError" in o["message"] and "main_grad" in o["message"], o
        assert o["next"] == "success", o
