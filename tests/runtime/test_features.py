"""eval_step, per-microbatch losses, gradient accumulation, no_sync, tied parameters across ranks and
a DeviceMesh, steps that leave no reference cycles, each against one process running the whole model on the whole batch in float64
(feature_cases.py; tolerance there), on 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest

from .feature_cases import (check_accumulation, check_data_parallel, check_eval_and_losses, check_grad_scaler,
                            check_no_cyclic_garbage, check_tied_training, grad_scaler_refusals)

SCHEDULES = ["1f1b", "zb-h1", "zb-v", "dualpipe-v"]


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("kind", ["plain", "zbpp"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_tied_embedding_and_head(zbpp_workers, name, p, kind):
    names = zbpp_workers(p).run(check_tied_training, name, p, kind)
    holders = [r for r, ns in enumerate(names) if ns]
    assert holders == sorted({0, p - 1} if name not in ("zb-v", "dualpipe-v") else {0}), names


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("kind", ["plain", "zbpp"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_eval_step_and_microbatch_losses(zbpp_workers, name, p, kind):
    out = zbpp_workers(p).run(check_eval_and_losses, name, p, kind)
    assert sum(o is not None for o in out) == 1


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("kind", ["plain", "zbpp"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_steps_without_zeroing_accumulate(zbpp_workers, name, p, kind):
    zbpp_workers(p).run(check_accumulation, name, p, kind)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", SCHEDULES)
def test_steps_leave_no_reference_cycles(zbpp_workers, name, p):
    # zbpp's delayed-wgrad layers: the runtime's state and the layers' W queues (torch.nn layers run
    # the same runtime with less state)
    assert zbpp_workers(p).run(check_no_cyclic_garbage, name, p, "zbpp") == [0] * p


@pytest.mark.parametrize("mesh", [False, True], ids=["ParallelGroups", "DeviceMesh"])
@pytest.mark.parametrize("kind", ["plain", "zbpp"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_data_parallel_with_tied_weights(zbpp_workers, name, kind, mesh):
    counts = zbpp_workers(4).run(check_data_parallel, name, 2, kind, mesh=mesh)
    assert all(v == 1 for c in counts for v in c.values())
    assert not any("wte" in k for c in counts for k in c), "a tied weight went through the data-parallel reducer"


@pytest.mark.parametrize("name", SCHEDULES)
def test_no_sync_then_one_reduction(zbpp_workers, name):
    counts = zbpp_workers(4).run(check_data_parallel, name, 2, "zbpp", no_sync=True)
    assert all(v == 1 for c in counts for v in c.values())


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_grad_scaler_skips_the_same_steps_on_every_rank(zbpp_workers, name):
    """float16 training with torch.amp.GradScaler: each rank's optimizer sees only its stages'
    gradients, so ``scaler.step`` found infs in them alone and the ranks skipped different steps (a
    silent divergence). `zbpp.runtime.unscale_` agrees on the found-inf flags: every rank skips the
    steps that one process running the whole model skips (parameters compared in the case), with its
    scale. Steps 0 and 2 overflow on the rank of stage 0 only."""
    plain = zbpp_workers(2).run(check_grad_scaler, name, False)
    ref = plain[0]["reference"]
    assert ref == [2.0 ** 116, 2.0 ** 122, 2.0 ** 116, 2.0 ** 122]  # skip, take, skip, take: the case's premise
    # plain torch: the rank without stage 0's overflow takes step 0 and grows its scale
    assert plain[0]["scales"][0] != plain[1]["scales"][0], plain
    agreed = zbpp_workers(2).run(check_grad_scaler, name, True)
    assert [r["scales"] for r in agreed] == [ref, ref]
    # one all-reduce per call carries the failure flag with the found-inf flags (it took two: an agreement first)
    assert [r["collectives"] for r in agreed] == [[1] * 4] * 2, agreed


def test_grad_scaler_refusals_raise_on_every_rank(zbpp_workers):
    """Scalers that would not move alike raise a ValueError on every rank, naming what differs; a
    rank's own error (unscale_ after its scaler.step) raises there and a PipelineError naming it on
    the other rank, at once rather than after the other waited in the all-reduce."""
    got = zbpp_workers(2).run(grad_scaler_refusals)
    for errors in got:
        assert errors[0] == ("ValueError: unscale_: the ranks' GradScalers differ in 'scale' (from 1024.0 to 65536.0): "
                             "their scales would not move alike; build them alike, and load each with grad_scaler= "
                             "from one checkpoint")
        assert errors[1].startswith("ValueError: unscale_: the GradScaler is enabled on some ranks"), errors
    assert got[0][2] == "RuntimeError: unscale_() is being called after step().", got
    assert got[1][2].startswith("PipelineError: unscale_ could not run on every rank (nothing was changed); global rank 0: "
                                "RuntimeError: unscale_() is being called after step()"), got
