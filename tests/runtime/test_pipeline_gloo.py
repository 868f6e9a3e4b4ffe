"""The runtime on 4 gloo CPU ranks against one process running the whole model on the whole batch.

One pool of 4 ranks serves the whole module (``zbpp_workers``); each test ships a case function
from `tests.runtime.cases` to all ranks. Tolerances are stated in `tests.runtime.cases`.
"""

from __future__ import annotations

import pytest

from zbpp.schedules import available

from .cases import (
    SLOW_LINK_NAMES,
    check_bad_groups,
    check_bad_input,
    check_data_parallel,
    check_fifo,
    check_groups,
    check_many_steps,
    check_no_cyclic_garbage,
    check_task_times,
    check_release,
    check_schedule,
    check_slow_link_program,
    slow_link_case,
    standard_cases,
)

P = 4


KINDS = ["plain", "zbpp", "mixed"]


@pytest.mark.parametrize("name", SLOW_LINK_NAMES[P])
def test_slow_link_program_matches_single_process(zbpp_workers, name):
    """Receives posted before their data exists (a program for a link slower than a task)."""
    worst = zbpp_workers(P).run(check_slow_link_program, name, P)
    assert max(worst) < 1e-3  # checked per tensor inside (rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p", sorted(SLOW_LINK_NAMES))
def test_slow_link_cases_post_receives_early(p):
    """Every schedule the slow-link tests run (here and on NCCL, p = 2) posts a receive before its
    data exists: otherwise its distributed case would fail on its own guard, or test nothing new."""
    for name in SLOW_LINK_NAMES[p]:
        slow_link_case(name, p)


@pytest.mark.parametrize("name", available())
def test_schedule_matches_single_process(zbpp_workers, name):
    """Every registered schedule, m in {p, 2p+1, 4p}: loss, every gradient and the parameters after
    two SGD steps equal the reference. Plain, zbpp and mixed models on m = p; the mixed one (both
    kinds of W) on the others (how rows split does not depend on the kind). m = 2p+1 runs with
    uneven rows only: the same task order as with even ones, and even rows run at m = p and 4p."""
    worst = zbpp_workers(P).run(_schedule_cases, name)
    assert max(worst) < 1e-3  # the real bound is checked per tensor inside (rtol=1e-5, atol=1e-6)


def _schedule_cases(name: str) -> float:
    every_kind = standard_cases(P)[:1]
    mixed_only = standard_cases(P)[2:]  # (4p, even), (2p+1, uneven)
    return max(check_schedule(name, P, KINDS, every_kind), check_schedule(name, P, ["mixed"], mixed_only))


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_many_steps_new_shapes_and_no_leaks(zbpp_workers, name):
    results = zbpp_workers(P).run(check_many_steps, name, P)
    assert all(r["signatures"] == 3 for r in results)


def test_task_times_gathered_on_rank_zero(zbpp_workers):
    recs = zbpp_workers(P).run(check_task_times, "zb-h1", P)
    assert recs[1:] == [None] * (P - 1)
    assert {r["rank"] for r in recs[0]} == set(range(P))


def test_rejected_input_raises_on_every_rank_and_pipeline_survives(zbpp_workers):
    caught = zbpp_workers(P).run(check_bad_input, "zb-h1", P)
    assert caught == ["ValueError"] + ["PipelineError"] * (P - 1)


@pytest.mark.parametrize("free", [True, False])
def test_sent_activations_are_released(zbpp_workers, free):
    zbpp_workers(P).run(check_release, "zb-h1", P, free)


@pytest.mark.parametrize("name", available())
def test_fifo_wgrad_modules(zbpp_workers, name):
    """Transformer-Engine-like modules (no microbatch keys): right where W keeps B order, else refused."""
    outcome = zbpp_workers(P).run(check_fifo, name, P)
    assert set(outcome) in ({"ran"}, {"refused", "refused elsewhere"}, {"refused"}), outcome


def test_parallel_groups_layout(zbpp_workers):
    workers = zbpp_workers(P)
    got = workers.run(check_groups, 2)
    assert got == [{"pp_rank": r % 2, "dp_rank": r // 2} for r in range(P)]
    msgs = workers.run(check_bad_groups, 3)
    assert "world size 4 is not divisible by pp=3" in msgs[0]


@pytest.mark.parametrize("name", ["zb-h1", "zb-v"])
def test_data_parallel_two_by_two(zbpp_workers, name):
    zbpp_workers(P).run(check_data_parallel, name, 2)


@pytest.mark.parametrize("name", ["zb-h1", "zb-v", "dualpipe-v"])
def test_step_leaves_no_cyclic_garbage(zbpp_workers, name):
    zbpp_workers(P).run(check_no_cyclic_garbage, name, P)
