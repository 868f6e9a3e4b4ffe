"""A step that failed, then the same batch again (a loop that catches `PipelineError` and retries):
the retry must be the uninterrupted run's step (dropout masks included), every rank counting the
steps of the random stream alike; see retry_cases.py for the reference and the tolerance."""

from __future__ import annotations

import pytest

from zbpp.testing import Workers

from .retry_cases import retry_with_dropout, weight_fails_on_last_rank

PG_TIMEOUT = 120.0
FAST = 10.0  # seconds every rank may take to raise (the pipeline times out after 20 s)


@pytest.fixture(scope="module")
def two():
    with Workers(2, pg_timeout=PG_TIMEOUT, timeout=60) as workers:
        yield workers


@pytest.mark.parametrize("evaluate", [False, True])
def test_a_retried_step_draws_the_uninterrupted_runs_dropout(two, evaluate):
    """A failed step advanced ``rng_step`` on every rank: the retry of the same batch drew the next
    step's dropout masks, so its loss and gradients were not the uninterrupted run's."""
    outcomes = two.run(retry_with_dropout, "1f1b", 2, 1, evaluate)
    for o in outcomes:
        assert set(o["results"]) == {"PipelineError"}, o
    for o in outcomes:  # every rank counts alike after each call
        for counts in o["rng_steps"]:
            assert len(set(counts)) == 1, o


def test_a_loss_weight_that_fails_after_the_start_agreement_raises_everywhere_fast(two):
    """The last rank's ``loss_weight`` gave a value that failed only when brought to the device,
    after the start agreement: that rank raised alone and its peer waited until the timeout."""
    outcomes = two.run(weight_fails_on_last_rank, "1f1b", 2)
    for o in outcomes:
        assert o["result"] != "success", o
        assert o["seconds"] < FAST, f"rank {o['rank']} took {o['seconds']:.1f} s to raise"
        assert "loss_weight" in o["message"] and "meta" in o["message"], o["message"]
        assert len(set(o["rng_steps"])) == 1, o
