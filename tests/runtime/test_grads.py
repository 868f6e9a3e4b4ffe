"""Gradients and optimizer inputs of multi-rank runs against one process running the whole model on
the whole batch per replica (grads_cases.py; tolerance there), on 4 gloo ranks (dp=2 x pp=2):

- a parameter frozen when the Pipeline is built and unfrozen later is averaged over the replicas;
- a module removed after the Pipeline was built trains on; an adapter injected or a parameter
  replaced is refused on every rank, and a new Pipeline averages it;
- a tie whose copies were unfrozen unalike after the build is refused at the step's start;
- a synchronised step, a no_sync step, a synchronised step without zeroing: a tied weight's earlier
  sum counts once (also after the window's first step failed), ``fully_shard`` copies too;
- ``clip_grad_norm_(pipe, max_norm, groups)`` with the DeviceMesh the Pipeline got: the pipeline's
  norm, not the replicas' summed; groups it cannot read raise;

and combinations that no other test file runs, all on dp=2 x pp=2 with V and interleaved
placements: clipping with every norm type and a tie, token-weighted losses with ties, no_sync,
uneven microbatches, a microbatch and a replica without tokens; evaluation steps between training
steps (no_sync and main_grad too); a branch that only one replica's data takes.
"""

from __future__ import annotations

import pytest
import torch

from zbpp.runtime import clip_grad_norm_

from .grads_cases import (check_changed_after_build, check_clip, check_clip_refused_on_one_rank, check_eval_between,
                          check_fsdp_sync_no_sync_sync, check_steps_accumulate, check_sync_no_sync_sync,
                          check_tie_replaced_after_build, check_tie_past_the_first_word_unfrozen_unalike,
                          check_tie_unfrozen_unalike, check_token_weights, check_unfrozen_later,
                          check_unused_on_one_replica, tied_linear_steps_under_graphs)


@pytest.mark.parametrize("kind", ["plain", "zbpp"])
@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_parameter_unfrozen_after_build_is_averaged(zbpp_workers, name, kind):
    zbpp_workers(4).run(check_unfrozen_later, name, 2, kind)


@pytest.mark.parametrize("name,kind", [("1f1b", "plain"), ("zb-h1", "zbpp")])
def test_parameters_added_or_replaced_after_build_are_refused(zbpp_workers, name, kind):
    # a module removed trains on; an adapter injected, then a parameter replaced on stage 1's ranks:
    # every rank refuses, naming the stage and the parameters (the others are told); a new
    # Pipeline averages the adapters over the replicas
    said = zbpp_workers(4).run(check_changed_after_build, name, kind)
    for r, (lora, replaced) in enumerate(said):
        assert f"stage {r % 2}: parameters 'lin.a.weight', 'lin.b.weight' are new since the Pipeline was built" in lora, lora
        assert "stage 1: parameter 'lin.base.bias' is new since the Pipeline was built" in replaced, replaced
        assert "build a new Pipeline" in lora and "averaged over the replicas" in lora, lora


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_tied_parameter_replaced_after_build_is_refused(zbpp_workers, name):
    # 1f1b: the embedding and the head on two ranks; zb-v: both on rank 0 (one Parameter)
    said = zbpp_workers(4).run(check_tie_replaced_after_build, name)
    holds = {0: [0], 1: [1]} if name == "1f1b" else {0: [0, 3], 1: []}
    for r, msg in enumerate(said):
        stage = holds[r % 2][0] if holds[r % 2] else 0  # a rank without the tie is told of rank 0's
        assert f"stage {stage}: parameter 'wte' is new since the Pipeline was built" in msg, msg


def test_tied_copies_unfrozen_unalike_after_build_are_refused(zbpp_workers):
    # 1f1b: the embedding's copy on pipeline rank 0, the head's on 1; only the head's unfrozen.
    # Refused at the step's start on every rank (the trained copies' all-reduce would otherwise
    # wait for the frozen ones until the group's timeout: 20 s here, minutes by default)
    said = zbpp_workers(4).run(check_tie_unfrozen_unalike, "1f1b")
    for msg, took in said:
        assert "tied parameter 'wte' is frozen (requires_grad=False) on global ranks [0, 2] but trains on [1, 3]" in msg, msg
        assert took < 10, took


def test_tie_past_the_first_flag_word_unfrozen_unalike_is_refused(zbpp_workers):
    # 63 ties, the 63rd unfrozen on pipeline rank 1 only: its flag lies past the first int64 word of
    # the start agreement. Refused on every rank (it hung in the tie's all-reduce until the timeout),
    # then, unfrozen alike, every copy's gradient is one process's (tolerance: grads_cases.TOL)
    said = zbpp_workers(4).run(check_tie_past_the_first_word_unfrozen_unalike)
    for msg, took in said:
        assert "tied parameter 't62' is frozen (requires_grad=False) on global ranks [0, 2] but trains on [1, 3]" in msg, msg
        assert took < 5, took


@pytest.mark.parametrize("world,pp,kind,fail,graphs", [(2, 2, "plain", False, False), (4, 2, "zbpp", True, False),
                                                       (4, 4, "plain", False, False), (4, 2, "plain", True, True)])
def test_tied_sum_of_earlier_steps_counts_once_after_no_sync(zbpp_workers, world, pp, kind, fail, graphs):
    # 1f1b: the embedding and the head on different ranks (two copies of the tie); graphs: task
    # graphs' fixed .grad buffers (their CPU stand-in)
    zbpp_workers(world).run(check_sync_no_sync_sync, "1f1b", pp, kind, fail, graphs)


@pytest.mark.parametrize("world,pp,keep,graphs,fail", [(2, 2, False, False, False), (4, 2, False, False, False),
                                                       (2, 2, True, True, False), (4, 2, False, True, False),
                                                       (4, 2, True, True, True)])
def test_tied_sum_of_earlier_steps_counts_once_over_steps(zbpp_workers, world, pp, keep, graphs, fail):
    # the tied weight's gradient accumulated over synchronised steps (1f1b: the embedding's copy and
    # the head's on different ranks), with keep_grads_on_failure=False or under task graphs' fixed
    # .grad buffers (their CPU stand-in); fail: a synchronised step fails once in between, its
    # gradients dropped; tolerance: check_grads'
    zbpp_workers(world).run(check_steps_accumulate, "1f1b", pp, "plain", keep, graphs, fail)


@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("keep", [True, False], ids=["keep", "no_keep"])
def test_tied_linear_weight_over_steps_under_graphs(zbpp_workers, fused, keep):
    # a tied zbpp Linear weight under task graphs: its W writes the fixed .grad buffer (earlier steps
    # added back after it) or adds to main_grad. Tolerance 1e-12: float64, only the order of
    # summation differs from the one-process reference (a per-copy recount is ~the gradient's size)
    for diff in zbpp_workers(2).run(tied_linear_steps_under_graphs, fused, keep):
        assert diff < 1e-12, diff


@pytest.mark.parametrize("schedule,tie", [("1f1b", (3,)), ("zb-v", (2, 3))])
def test_sharded_tied_sum_of_earlier_steps_counts_once_after_no_sync(zbpp_workers, schedule, tie):
    # 1f1b: copies on two ranks; zb-v: also copies FSDP split on one rank (stages 0 and 3)
    assert zbpp_workers(4).run(check_fsdp_sync_no_sync_sync, schedule, *tie) == [[]] * 4


@pytest.mark.parametrize("name,kind,norm_type", [("zb-v", "plain", 2.0), ("1f1b", "zbpp", 1.0)])
def test_clip_with_the_device_mesh_the_pipeline_got(zbpp_workers, name, kind, norm_type):
    zbpp_workers(4).run(check_clip, name, 2, kind, norm_type, 0.1, "mesh")


def test_clip_of_a_pipelines_parameters_given_alone(zbpp_workers):
    # pp=2 x dp=2, the tied LM: parameters given without groups used to be summed over the whole
    # world, each counted once per replica; they now take their Pipeline's groups (and its tie once)
    zbpp_workers(4).run(check_clip, "1f1b", 2, "plain", 2.0, 0.1, "params")


def test_clip_refused_on_one_rank_raises_on_every_rank(zbpp_workers):
    """A main_grad beside .grad on rank 1 only (`check_clip_refused_on_one_rank`): rank 1 raises its
    ValueError, every other rank a PipelineError naming global rank 1 and the parameter, within
    seconds (the run's 60 s are far below the group's timeout), before any gradient is clipped."""
    out = zbpp_workers(4).run(check_clip_refused_on_one_rank, "1f1b", 4, timeout=60)
    refusal = "clip_grad_norm_: parameter lin.weight of stage 1 has both a main_grad and a .grad"
    for rank, (kind, message, seconds, untouched, _) in enumerate(out):
        assert kind == ("ValueError" if rank == 1 else "PipelineError"), (rank, message)
        assert refusal in message and (rank == 1 or "global rank 1: ValueError" in message), (rank, message)
        assert seconds < 5.0 and untouched, (rank, seconds, untouched)
    assert len({norm for *_, norm in out}) == 1, out  # the next call, on every rank alike


def test_clip_refuses_groups_it_cannot_read():
    lin = torch.nn.Linear(2, 1)
    lin.weight.grad = torch.ones(1, 2)
    with pytest.raises(TypeError, match=r"groups must be a ParallelGroups.*got object"):
        clip_grad_norm_(lin, 1.0, object())
    assert torch.equal(lin.weight.grad, torch.ones(1, 2))  # untouched


@pytest.mark.parametrize("norm_type", ["inf", "2", 1.0])
def test_clip_takes_what_torch_clip_takes(norm_type):
    # torch.nn.utils.clip_grad_norm_ takes norm_type="inf" (float() of it) and foreach=: the same
    # norm and clipped gradients, in one process (exact: the same float64 operations on 3 numbers)
    mine, theirs = torch.nn.Linear(2, 1, dtype=torch.float64), torch.nn.Linear(2, 1, dtype=torch.float64)
    for lin in (mine, theirs):
        lin.weight.grad, lin.bias.grad = torch.tensor([[3.0, -4.0]], dtype=torch.float64), torch.tensor([12.0], dtype=torch.float64)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0, norm_type=norm_type, foreach=True)
    got = clip_grad_norm_(mine, 1.0, norm_type=norm_type, foreach=True)
    assert float(got) == float(want)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine.parameters(), theirs.parameters()))


@pytest.mark.parametrize("norm_type", ["fro", 0.0, -2.0, float("nan"), None])
def test_clip_refuses_a_norm_type_that_is_no_p_norm(norm_type):
    lin = torch.nn.Linear(2, 1)
    lin.weight.grad = torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"norm_type must be > 0 \(or math.inf, 'inf'\), got"):
        clip_grad_norm_(lin, 1.0, norm_type=norm_type)
    assert torch.equal(lin.weight.grad, torch.ones(1, 2))  # untouched


@pytest.mark.parametrize("name,kind,norm_type,given", [("zb-v", "plain", 2.0, "none"), ("zb-interleaved", "zbpp", 1.0, "groups"),
                                                       ("dualpipe-v", "plain", -1, "none"), ("interleaved-1f1b", "zbpp", 3.0, "none")])
def test_clip_norm_types_with_replicas_and_a_tie(zbpp_workers, name, kind, norm_type, given):
    # norm_type -1: math.inf
    zbpp_workers(4).run(check_clip, name, 2, kind, norm_type, 0.1, given)


@pytest.mark.parametrize("name,kind,no_sync,m", [("zb-v", "zbpp", True, 3), ("interleaved-1f1b", "plain", False, 5),
                                                 ("zb-interleaved", "zbpp", True, 4)])
def test_token_weights_with_replicas_a_tie_and_no_sync(zbpp_workers, name, kind, no_sync, m):
    zbpp_workers(4).run(check_token_weights, name, 2, kind, no_sync, m)


@pytest.mark.parametrize("name,kind,no_sync,main_grad", [("zb-v", "zbpp", True, False), ("zb-interleaved", "plain", False, False),
                                                         ("1f1b", "plain", True, True)])
def test_evaluation_steps_between_training_steps(zbpp_workers, name, kind, no_sync, main_grad):
    zbpp_workers(4).run(check_eval_between, name, 2, kind, no_sync, main_grad)


@pytest.mark.parametrize("name,kind,no_sync", [("zb-v", "plain", False), ("zb-v", "zbpp", True), ("interleaved-1f1b", "zbpp", False)])
def test_branch_taken_by_one_replica_only(zbpp_workers, name, kind, no_sync):
    zbpp_workers(4).run(check_unused_on_one_replica, name, 2, kind, no_sync)
