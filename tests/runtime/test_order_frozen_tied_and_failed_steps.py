"""Microbatch order across hand-overs, frozen and tied parameters, failed steps: each against one process
running the whole model on the whole batch (order_frozen_tied_cases.py; tolerance there), on 2 and 4 gloo ranks:

- stages that take their microbatches in another order than the stage before produced them, V
  placements included: a same-rank hand-over must pass microbatch j's activation and gradient;
- frozen parameters (``requires_grad=False``) in zbpp delayed-wgrad layers and plain layers, under
  every schedule with W tasks, with data parallelism and a tied weight: no gradient, never reduced;
- a tied weight owned by a delayed-wgrad layer (the LM head, a zbpp Linear, tied to the embedding):
  reduced only after the W that computes it, under every schedule with W tasks;
- two ranks failing at different times: the error names the first; a rank waiting in the end
  agreement while another rank dies raises within seconds;
- stage modules or a tie wrong on one rank: every rank raises when the pipeline is built;
- nested no_sync(); a failed step with data parallelism and main_grad, then the next steps;
- empty tensors in a stage's output sent across ranks.
"""

from __future__ import annotations

import json
import os

import pytest

from zbpp.schedules import Kind
from zbpp.schedules.ir import v_placement, loop_placement
from zbpp.testing import DistributedTestError, Workers

from .cases import make_schedule
from .order_frozen_tied_cases import (check_empty_tensors, check_failed_step_after_no_sync, check_failed_step_with_main_grad,
                        check_first_failure_named, check_frozen_on_one_replica, check_reducer_with_the_tie,
                        check_tie_named_twice,
                        check_wrong_on_one_rank,
                        check_ctrl_c_while_building, check_lm, check_nested_no_sync, check_waiting_rank_sees_broken_job,
                        hand_built_v_schedule, reordered_schedule)
from .test_random_schedules import run_schedule_against_one_process

# every built-in schedule with W tasks (the others run BW only)
W_SCHEDULES = [n for n in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min",
                           "dualpipe-v", "zb-auto", "zbv-auto")
               if any(a.kind is Kind.W for r in make_schedule(n, 2, 4).orders for a in r)]


def test_the_w_schedules_are_the_split_ones():
    assert set(W_SCHEDULES) >= {"zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "dualpipe-v"}, W_SCHEDULES


@pytest.mark.parametrize("kind", ["zbpp", "mixed"])
def test_hand_built_v_schedule_with_reordered_hand_overs(zbpp_workers, kind):
    zbpp_workers(2).run(run_schedule_against_one_process, hand_built_v_schedule(), kind, 7)


@pytest.mark.parametrize("p,shape", [(2, "v"), (4, "v"), (2, "interleaved"), (4, "one-stage")])
def test_generated_schedules_with_reordered_microbatches(zbpp_workers, p, shape):
    placement = {"v": v_placement(p), "interleaved": loop_placement(p, 2), "one-stage": loop_placement(p)}[shape]
    sched = reordered_schedule(placement, p + 1)
    zbpp_workers(p).run(run_schedule_against_one_process, sched, "mixed", 2 * (p + 1) + 1)


@pytest.mark.parametrize("name", W_SCHEDULES)
def test_tied_head_owned_by_a_delayed_layer(zbpp_workers, name):
    zbpp_workers(2).run(check_lm, name, 2, "zbpp", slow_w=0.05)


@pytest.mark.parametrize("name,frozen", [(n, "weight") for n in W_SCHEDULES]
                         + [(n, f) for n in ("zb-h1", "zb-v") for f in ("all-lin", "wte")])
def test_frozen_parameters(zbpp_workers, name, frozen):
    zbpp_workers(2).run(check_lm, name, 2, "mixed" if frozen == "weight" else "zbpp", frozen)


@pytest.mark.parametrize("name,frozen", [("zb-h1", "weight"), ("zb-h1", "wte"), ("zb-v", "all-lin")])
def test_frozen_parameters_with_data_parallelism(zbpp_workers, name, frozen):
    counts = zbpp_workers(4).run(check_lm, name, 2, "zbpp", frozen, 2)
    assert all(counts), "no parameter went through the data-parallel reducer: the case tests nothing"


def test_a_given_reducer_leaves_the_tie_to_the_pipeline(zbpp_workers):
    """``reducer=`` a GradReducer with tied_parameters and replicas: built with ``exclude`` (the
    tie's id) the gradients equal the reference's (check_lm); built over the tie too, both would
    all-reduce it at once (its gradient came out ~0.3 off, and different on the two copies), so
    every rank raises when the pipeline is built, naming the tie."""
    counts = zbpp_workers(4).run(check_lm, "zb-h1", 2, "zbpp", "none", 2, user_reducer=True)
    assert all(counts) and not any("wte" in k for c in counts for k in c), counts
    msgs = zbpp_workers(4).run(check_reducer_with_the_tie)
    assert all(m.startswith("ValueError: reducer= reduces tied_parameters['wte']") for m in msgs), msgs


def test_one_parameter_under_two_tie_names_raises(zbpp_workers):
    """tied_parameters={"wte": w, "alias": w} on every holder, dp=2 x pp=2: two ties of one Parameter
    reduced its gradient twice (0.81 off the one-process reference); every rank raises when the
    pipeline is built, naming both entries."""
    msgs = zbpp_workers(4).run(check_tie_named_twice)
    want = "ValueError: tied_parameters['wte'] and tied_parameters['alias'] are one Parameter"
    assert all(m.startswith(want) for m in msgs), msgs


def test_the_first_of_two_failures_is_named(zbpp_workers):
    msgs = zbpp_workers(2).run(check_first_failure_named)
    assert all("pipeline rank 1" in m.split("Every rank")[0] for m in msgs), msgs


def test_nested_no_sync_keeps_the_outer_state(zbpp_workers):
    zbpp_workers(2).run(check_nested_no_sync)


@pytest.mark.parametrize("kind", ["zbpp", "fifo"])
def test_failed_step_with_main_grad_then_good_steps(zbpp_workers, kind):
    zbpp_workers(4).run(check_failed_step_with_main_grad, "zb-h1", kind)


def test_failed_step_after_no_sync_restores_the_accumulated_gradients(zbpp_workers):
    zbpp_workers(4).run(check_failed_step_after_no_sync, "zbpp")


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_empty_tensors_between_stages(zbpp_workers, name):
    zbpp_workers(2).run(check_empty_tensors, name, 2)


@pytest.mark.slow
def test_a_rank_waiting_in_the_agreement_sees_a_broken_job(tmp_path):
    # the process group's timeout is 120 s: raising within 10 s proves the broken mark was seen
    with Workers(4, pg_timeout=120.0, timeout=120, grace=30) as workers:
        with pytest.raises(DistributedTestError) as info:
            workers.run(check_waiting_rank_sees_broken_job, str(tmp_path))
    assert set(info.value.failures) == {0}, info.value.failures.keys()
    for r in (1, 2, 3):
        with open(os.path.join(tmp_path, f"rank{r}.json")) as fh:
            o = json.load(fh)
        assert o["result"] == "PipelineError" and "dead or hung" in o["message"], o
        assert o["seconds"] < 10.0, o



@pytest.mark.parametrize("what, words", [
    ("stages", "pipeline rank 1 holds stages [1] of schedule '1f1b' but stage_modules has [0]"),
    ("tie", "tied_parameters['wte'] is not a parameter of this rank's stage modules (stages [1])"),
    ("wgrad-params", "stage 0: WrongWgradParams.get_backward_dw_params() returned a tensor of shape (2, 6) that is "
                     "not a trainable parameter of the stage module"),
])
def test_a_rank_built_wrong_raises_on_every_rank(zbpp_workers, what: str, words: str):
    """Stage modules or a tied_parameters entry wrong on one rank: its own ValueError, and on every
    other rank a PipelineError naming it, when the pipeline is built (not after the others wait out
    the process-group timeout). "wgrad-params": refused by the data-parallel reducer, built after the
    first agreement: the other rank built its Pipeline and waited in its first step until the
    timeout, then called the job dead without naming the cause."""
    right, wrong = zbpp_workers(2).run(check_wrong_on_one_rank, what)
    assert wrong.split(" ", 1)[1].startswith(f"ValueError: {words}"), wrong
    assert f"PipelineError: Pipeline could not be built on every rank; global rank 1: ValueError: {words}" in right, right
    assert all(float(msg.split("s ", 1)[0]) < 10 for msg in (right, wrong)), (right, wrong)


def test_ranks_with_different_schedules_raise_when_built(zbpp_workers):
    """Rank 1 builds its Pipeline with 2 microbatches, rank 0 with 4: each waited for messages the
    other never sends until the process group's timeout, then called the job dead. Now every rank
    raises when it is built, naming both schedules and their ranks."""
    msgs = zbpp_workers(2).run(check_wrong_on_one_rank, "schedule", timeout=60)
    want = ("ValueError: the ranks build their Pipeline with different schedules: global ranks [0]: '1f1b' (2 ranks, "
            "2 stages, 4 microbatches); global ranks [1]: '1f1b' (2 ranks, 2 stages, 2 microbatches)")
    assert all(f"s {want}" in m for m in msgs), msgs
    assert all(float(m.split("s ", 1)[0]) < 10 for m in msgs), msgs


def test_ctrl_c_while_building_is_raised_once_built(zbpp_workers):
    """A real Ctrl-C on rank 1 while it waited for rank 0 in the exchange of the ties' holders:
    all_gather_object raised it between its two collectives, and rank 0 waited in the second until the
    process group's timeout (the run's 60 s here). Now both ranks complete the construction, rank 1
    raises its interrupt after it, and the next Pipeline built on them steps right."""
    got = zbpp_workers(2).run(check_ctrl_c_while_building, timeout=60)
    assert got == ["ok", "KeyboardInterrupt: "], got


def test_a_tie_frozen_on_one_rank_only_raises_on_every_rank(zbpp_workers):
    """The tied weight frozen on rank 1 and trained on rank 0: rank 0 would all-reduce its copy's
    gradient and wait for a rank 1 that has none to give (the step hung until the process group's
    timeout, then called the job dead), and the copies could not stay equal anyway. Every rank
    raises when the pipeline is built, naming the tie and where it is frozen."""
    msgs = zbpp_workers(2).run(check_wrong_on_one_rank, "frozen-tie")
    want = "ValueError: tied parameter 'wte' is frozen (requires_grad=False) on global ranks [1] but trains on [0]"
    assert all(f"s {want}" in m for m in msgs), msgs
    assert all(float(m.split("s ", 1)[0]) < 10 for m in msgs), msgs


def test_replicas_frozen_differently_raise_before_any_compute(zbpp_workers):
    """Each replica froze another layer's bias: their gradients would be averaged slot by slot into
    the wrong parameters; the start agreement sees the replicas' module states differ and every
    rank raises, naming the pipeline rank and the replicas."""
    msgs = zbpp_workers(2).run(check_frozen_on_one_replica)
    want = ("ValueError: the data-parallel replicas of pipeline rank 0 hold their stages differently "
            "(global ranks [[0], [1]] differ in some parameter's requires_grad")
    assert all(m.startswith(want) for m in msgs), msgs
