"""eval_step, per-microbatch losses, gradient accumulation, no_sync, tied parameters across ranks and
a DeviceMesh, steps that leave no reference cycles, each against one process running the whole model on the whole batch in float64
(feature_cases.py; tolerance there), on 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest

from .feature_cases import (check_accumulation, check_data_parallel, check_eval_and_losses,
                            check_no_cyclic_garbage, check_tied_training)

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
