"""A failure on one rank during a step raises on every rank within seconds, whatever the process-group
timeout (120 s here), and no rank returns success from it; the state afterwards is the README's:
gradients of earlier steps intact, nothing pending, the next step right (see failure_cases.py).

Each site fails once, at the first and at the last microbatch, on 4 gloo ranks whose processes live
on; then dp=2 x pp=2 (the other replica raises too) and a rank that dies (the others raise at once
and the next step says the pipeline is unusable)."""

from __future__ import annotations

import json
import os
import re

import pytest

from zbpp.testing import DistributedTestError, Workers

from .failure_cases import (delay_off_on_one_replica, die_between_steps, tied_main_grad_failed_step, die_mid_step, eval_and_train_at_once, fail_once, fifo_layers_fail_once, interrupted_once,
                            no_sync_on_one_replica, prepare_fails_once, reduction_fails_once, user_hook_fails_once)

PG_TIMEOUT = 120.0
FAST = 10.0  # seconds every rank may take to raise


@pytest.fixture(scope="module")
def four():
    with Workers(4, pg_timeout=PG_TIMEOUT, timeout=300) as workers:
        yield workers


# (site, schedule, failing pipeline rank): W needs a split schedule; the loss fails on the last rank;
# a shape change or a None output must come from a stage that feeds another.
SITES = [("F", "zb-h1", 1), ("B", "zb-h1", 2), ("W", "zb-h1", 1), ("loss", "zb-h1", 3),
         ("shape", "zb-h1", 1), ("none", "zb-h1", 2), ("F", "zb-v", 2), ("B", "zb-v", 0)]


def _check(outcomes: list[dict], site: str, rank: int) -> None:
    for o in outcomes:
        assert o["result"] == "PipelineError", f"rank {o['rank']} returned {o['result']} from a failed step"
        assert o["seconds"] < FAST, f"rank {o['rank']} took {o['seconds']:.1f} s to raise"
        assert f"pipeline rank {rank}" in o["message"], o["message"]
        assert "kept" in o["message"] and "usable" in o["message"], o["message"]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("site,name,rank", SITES)
def test_a_failure_raises_on_every_rank_fast(four, site, name, rank, where):
    m = 8
    mb = 0 if where == "first" else m - 1
    outcomes = four.run(fail_once, name, 4, m, site, rank, mb)
    _check(outcomes, site, rank)
    detail = {"F": "injected F failure", "B": "injected B failure", "W": "injected W failure",
              "loss": "injected loss failure", "shape": "ShapeMismatchError", "none": "returned None"}[site]
    assert all(detail in o["message"] for o in outcomes), outcomes[0]["message"]
    assert all(f"microbatch {mb}" in o["message"] or f", {mb})" in o["message"] or f".{mb}" in o["message"]
               for o in outcomes), outcomes[0]["message"]
    # every rank shows the failing rank's schedule around the failing task, that task marked
    kind = site if site in ("F", "B", "W") else "F"  # the loss, a shape, a None output: in F
    if site == "B":  # the first stage's backward runs in W (split_wgrad): no earlier stage waits for it
        kind = "[BW]"
    around = re.compile(rf"^pipeline rank {rank}, tasks \d+-\d+ of \d+: .*\[{kind}\d+\.{mb}\]", re.M)
    assert all(around.search(o["message"]) for o in outcomes), outcomes[0]["message"]


@pytest.mark.slow
def test_the_other_replica_raises_too(four):
    outcomes = four.run(fail_once, "zb-h1", 2, 4, "B", 1, 3, dp=2)
    _check(outcomes, "B", 1)
    assert all("replica 0" in o["message"] for o in outcomes)


@pytest.mark.slow
def test_a_dead_rank_ends_the_others_at_once(tmp_path):
    """The next step and every later collective call given the Pipeline (clip_grad_norm_, task_times,
    checkpoints) raise at once that it is unusable: clip_grad_norm_ waited for the dead rank until the
    group's timeout (rank 3), the others raised gloo's error instead."""
    with Workers(4, pg_timeout=PG_TIMEOUT, timeout=120, grace=30) as workers:
        with pytest.raises(DistributedTestError) as info:
            workers.run(die_mid_step, "zb-h1", 4, 8, str(tmp_path))
    assert set(info.value.failures) == {1}, info.value.failures.keys()
    for r in (0, 2, 3):
        with open(os.path.join(tmp_path, f"rank{r}.json")) as fh:
            o = json.load(fh)
        assert o["result"] == "PipelineError" and "dead or hung" in o["message"], o
        assert o["seconds"] < FAST, o
        assert "unusable" in o["next"] and o["next_seconds"] < 1.0, o
        for what, (message, seconds) in o["later"].items():  # collectives that would wait for the dead rank
            assert "unusable" in message and seconds < 1.0, (r, what, message, seconds)


@pytest.mark.slow
@pytest.mark.parametrize("first,which", [("check_ties", "agreement of check_ties"),
                                         ("clip_grad_norm_", "all-reduce of clip_grad_norm_")])
def test_a_rank_dead_between_steps_ends_the_next_call_at_once(tmp_path, first, which):
    """Rank 1 dies between steps and the others call check_ties, or (fully_shard stages, dp=2 x pp=2)
    it dies inside clip_grad_norm_, at its shard's all-reduce: their collectives looked for no broken
    mark, so the ranks gloo did not pair with the dead one (rank 3) waited until the group's timeout,
    the others raised gloo's error. Now every rank raises at once that the pipeline is unusable,
    naming the call."""
    with Workers(4, pg_timeout=PG_TIMEOUT, timeout=60, grace=30) as workers:
        with pytest.raises(DistributedTestError) as info:
            workers.run(die_between_steps, "zb-h1", 4, 8, str(tmp_path), first)
    assert set(info.value.failures) == {1}, info.value.failures.keys()
    for r in (0, 2, 3):
        with open(os.path.join(tmp_path, f"rank{r}.json")) as fh:
            o = json.load(fh)
        for what in (first, "next"):
            message, seconds = o[what]
            assert message.startswith("PipelineError: this Pipeline is unusable") and seconds < FAST, (r, what, o)
        assert which in o[first][0], o


@pytest.mark.slow
@pytest.mark.parametrize("which", ["KeyboardInterrupt", "SystemExit"])
def test_an_interrupt_in_one_rank_stage_raises_everywhere_fast(which):
    """No Exception but a KeyboardInterrupt or SystemExit in a stage: it left the step at once on that
    rank, its peers waited in a receive until the group's timeout. The run's own timeout (60 s) is
    below the group's (120 s): a hang fails the test rather than passing late."""
    with Workers(4, pg_timeout=PG_TIMEOUT, timeout=60) as workers:
        outcomes = workers.run(interrupted_once, "zb-h1", 4, 8, 2, which)
    for o in outcomes:
        want = which if o["rank"] == 2 else "PipelineError"
        assert o["result"] == want, o
        assert o["seconds"] < FAST, f"rank {o['rank']} took {o['seconds']:.1f} s to raise"
        if o["rank"] != 2:
            assert "pipeline rank 2" in o["message"] and f"{which}: injected interrupt" in o["message"], o
            assert re.search(r"task F2\.1\b", o["message"]), o["message"]


@pytest.mark.slow
def test_a_failed_reduction_on_one_replica_raises_everywhere_fast():
    """A data-parallel reducer raising on one replica before its all-reduce: the other replica
    waited for that all-reduce until the group's timeout, and its pipeline peers in the end agreement
    with it. Run timeout (60 s) below the group's (120 s): a hang fails the test."""
    with Workers(4, pg_timeout=PG_TIMEOUT, timeout=60) as workers:
        outcomes = workers.run(reduction_fails_once, "zb-h1", 2, 4, 1)
    for o in outcomes:
        assert o["result"] == "PipelineError", o
        assert o["seconds"] < FAST, f"rank {o['rank']} took {o['seconds']:.1f} s to raise"
        assert "global rank 1" in o["message"] and "injected reduction failure" in o["message"], o["message"]
        assert "unusable" in o["next"] and o["next_seconds"] < 1.0, o


@pytest.mark.slow
def test_an_exception_that_cannot_be_printed_is_reported(four):
    """str() of the failing rank's exception raises: that rank raised that error out of the end
    agreement, skipping the exchange of messages its peers were in; its next step's collective then
    met theirs (gloo aborted the process on the size mismatch)."""
    outcomes = four.run(fail_once, "zb-h1", 4, 8, "unprintable", 1, 2)
    _check(outcomes, "unprintable", 1)
    assert all("Unprintable" in o["message"] and "F1.2" in o["message"] for o in outcomes), outcomes[0]["message"]


@pytest.mark.slow
@pytest.mark.parametrize("what", ["set_aside", "begin"])
def test_a_failure_before_the_first_task_raises_everywhere_fast(what):
    """Setting the earlier gradients aside (a copy: out of memory on a GPU) or beginning the
    reductions raised on one rank out of Pipeline.step, before its tasks: its peers waited in their
    receives until the group's timeout. Run timeout 60 s, below the group's 120 s."""
    with Workers(2, pg_timeout=PG_TIMEOUT, timeout=60) as workers:
        outcomes = workers.run(prepare_fails_once, "1f1b", 2, 4, 1, what)
    for o in outcomes:
        assert o["result"] == "PipelineError", o
        assert o["seconds"] < FAST, f"rank {o['rank']} took {o['seconds']:.1f} s to raise"
        assert "pipeline rank 1" in o["message"] and f"injected {what} failure" in o["message"], o["message"]


@pytest.mark.slow
def test_no_sync_on_one_replica_only_raises_before_computing():
    """The replica outside no_sync() waited for all-reduces the other skipped, until the group's
    timeout. Run timeout 60 s, below the group's 120 s."""
    with Workers(4, pg_timeout=PG_TIMEOUT, timeout=60) as workers:
        outcomes = workers.run(no_sync_on_one_replica, "1f1b", 2, 4)
    for o in outcomes:
        assert o["result"] == "ValueError", o
        assert o["seconds"] < FAST, o
        assert "no_sync()" in o["message"] and "global ranks [0, 1]" in o["message"], o["message"]


@pytest.mark.slow
@pytest.mark.parametrize("site,name,rank", [("F", "zb-h2", 1), ("W", "zb-h1", 1), ("W", "zb-h1", 0)])
def test_a_failed_step_leaves_no_wgrad_queued_in_fifo_layers(four, site, name, rank):
    """Transformer-Engine-like layers under data parallelism (`fifo_layers_fail_once`). The failed
    step's rollback computes their queued wgrads to drop them; the reducer's hook raised at the
    first (its parameter was already reduced), which skipped the others, and a W that raised before
    taking its wgrad was no longer counted as queued: the next step's W computed those stale wgrads
    in place of its own, and its gradients were wrong on both replicas, with no error."""
    outcomes = four.run(fifo_layers_fail_once, name, 4, site, rank)
    for o in outcomes:
        assert o["result"] == "PipelineError" and f"injected {site} failure" in o["message"], o
        assert o["queued"] == [0, 0], o


@pytest.mark.slow
def test_eval_step_on_one_rank_and_step_on_the_others_raises_before_computing():
    """Their programs differ (forward only, or forward and backward): the training ranks waited
    for gradients the evaluating rank never sends, until the group's timeout, and the pipeline was
    unusable after. Run timeout 60 s, below the group's 120 s."""
    with Workers(4, pg_timeout=PG_TIMEOUT, timeout=60) as workers:
        outcomes = workers.run(eval_and_train_at_once, "zb-h1", 4, 8, 2)
    for o in outcomes:
        assert o["result"] == "ValueError", o
        assert o["seconds"] < FAST, o
        assert "global ranks [2] call Pipeline.eval_step()" in o["message"], o["message"]
        assert "global ranks [0, 1, 3] Pipeline.step()" in o["message"], o["message"]


def test_delay_turned_off_on_one_replica_raises_before_computing(four):
    """Replica 1 turns delay_wgrad_compute off on stage 1's layer after the Pipeline was built (dp=2
    x pp=2, zb-v): its reducer launched that stage's bucket at B, replica 0's at W, and gloo paired
    unlike buckets: the step returned with wrong gradients on both replicas. Now every rank raises
    before computing, naming the layer, and a step after the flag is set back is the reference."""
    outcomes = four.run(delay_off_on_one_replica, 1, timeout=60)
    for o in outcomes:
        assert o["result"] == "ValueError", o
        assert o["seconds"] < FAST, o
        assert "global rank 3: stage 1 '0' (Linear)" in o["message"] and "global rank 1: none" in o["message"], o
        assert o["next"] == "success", o


def test_a_failed_step_leaves_a_tied_main_grad_as_it_was(four):
    """dp=2 x pp=2, a tied parameter of fused layers with the user's main_grad (the reducer leaves
    tied parameters out), accumulated over steps: after a failed step its main_grad held part of
    that step's gradient (the README promises the earlier steps' intact), and every step's sum over
    the two copies counted the earlier steps twice (after the good steps: 3x the gradient, not 2x).
    Reference: one process, the whole plain model on both replicas' rows. Tolerance 1e-12: float64,
    only the order of summation differs."""
    for o in four.run(tied_main_grad_failed_step, timeout=60):
        assert o["after_failure"] < 1e-12 and o["next"] < 1e-12, o


@pytest.mark.parametrize("which,task", [("grad", "W1.0"), ("backward", "B1.0")])
def test_a_users_hook_raising_in_b_or_w_raises_on_every_rank_fast(four, which, task):
    """A tensor hook on a weight (its gradient comes in W) or a module's full backward hook (it runs
    in B) raises on pipeline rank 1 in the first microbatch's task: every rank raises within seconds,
    naming the rank, the task and the hook's error, and the next step is the one-process
    reference's (failure_cases.user_hook_fails_once)."""
    for o in four.run(user_hook_fails_once, "zb-h1", 4, 8, 1, which, timeout=60):
        _check([o], which, 1)
        assert f"task {task}" in o["message"] and f"injected {which} hook failure" in o["message"], o["message"]
