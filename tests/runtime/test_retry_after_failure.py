"""A step that failed, then the same batch again (a loop that catches `PipelineError` and retries):
the retry must be the uninterrupted run's step (dropout masks included), every rank counting the
steps of the random stream alike; see retry_cases.py for the reference and the tolerance."""

from __future__ import annotations

import pytest

from zbpp.testing import Workers

from .retry_cases import retry_with_dropout

PG_TIMEOUT = 120.0


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
