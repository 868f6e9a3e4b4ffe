"""The step on NCCL (2 GPUs): no host-device synchronisation once an input signature was seen, and
failures that reach both ranks within seconds (see failure_cases.py), a killed rank included.
Skipped without 2 GPUs."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from zbpp import Pipeline
from zbpp.testing import DistributedTestError, Workers, gpus_available

from .cases import make_schedule
from .failure_cases import die_mid_step, fail_once
from .models import loss_fn, make_batch, make_stage

pytestmark = [
    pytest.mark.nccl,
    pytest.mark.skipif(not gpus_available(2), reason="needs 2 CUDA GPUs with NCCL"),
]
FAST = 10.0


def steps_without_host_sync(name: str) -> int:
    """Two steps teach the pipeline the shapes; the third runs under set_sync_debug_mode("error"),
    which raises on any operation that makes the host wait for the device."""
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    sched = make_schedule(name, 2, 4)
    mine = {s: make_stage(s, sched.num_stages, "zbpp", device) for s in sched.stages_on(rank)}
    pipe = Pipeline(mine, sched, loss_fn)
    inputs, target = make_batch(0, 8, device)
    for _ in range(2):
        pipe.step(inputs, target=target)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = pipe.step(inputs, target=target)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return 0 if loss is None else 1


def eval_on_gpus(name: str) -> bool:
    """eval_step's outputs and loss on NCCL against one process (CUDA tolerance, cases.py)."""
    from zbpp.runtime.tree import call

    from .cases import tolerance

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    sched = make_schedule(name, 2, 4)
    mine = {s: make_stage(s, sched.num_stages, "zbpp", device) for s in sched.stages_on(rank)}
    ref = [make_stage(s, sched.num_stages, "plain", device) for s in range(sched.num_stages)]
    pipe = Pipeline(mine, sched, loss_fn)
    inputs, target = make_batch(0, 9, device)
    out = pipe.eval_step(inputs)
    loss = pipe.eval_step(inputs, target=target)
    assert all(q.grad is None for q in pipe.parameters())
    with torch.no_grad():
        h = inputs
        for st in ref:
            h = call(st, h)
        want_loss = loss_fn(h, target)
    if pipe.holds_last_stage:
        torch.testing.assert_close(out, h, **tolerance(device))
        torch.testing.assert_close(loss, want_loss, **tolerance(device))
        return True
    assert out is None and loss is None
    return False


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_eval_step_on_nccl(zbpp_workers, name):
    assert sorted(zbpp_workers(2, backend="nccl").run(eval_on_gpus, name)) == [False, True]


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "dualpipe-v"])
def test_a_seen_signature_step_never_waits_for_the_gpu(zbpp_workers, name):
    assert sorted(zbpp_workers(2, backend="nccl").run(steps_without_host_sync, name)) == [0, 1]


@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("site,name,rank", [("F", "zb-h1", 1), ("B", "zb-h1", 1), ("W", "zb-h1", 0),
                                            ("shape", "zb-v", 1), ("loss", "zb-v", 0)])
def test_a_failure_raises_on_both_gpus_fast(site, name, rank, where):
    m = 4
    with Workers(2, backend="nccl", pg_timeout=120, timeout=300) as workers:
        outcomes = workers.run(fail_once, name, 2, m, site, rank, 0 if where == "first" else m - 1)
    for o in outcomes:
        assert o["result"] == "PipelineError" and o["seconds"] < FAST, o
        assert f"pipeline rank {rank}" in o["message"] and "usable" in o["message"], o


def test_a_killed_rank_ends_the_other(tmp_path):
    with Workers(2, backend="nccl", pg_timeout=60, timeout=200, grace=90) as workers:
        with pytest.raises(DistributedTestError) as info:
            workers.run(die_mid_step, "zb-h1", 2, 4, str(tmp_path))
    # Rank 0 raised and wrote its report; NCCL's watchdog may end its process afterwards (its
    # communicators with the dead peer were aborted): the pipeline is unusable either way.
    assert 1 in info.value.failures, info.value.failures.keys()
    with open(os.path.join(tmp_path, "rank0.json")) as fh:
        o = json.load(fh)
    assert o["result"] == "PipelineError" and "dead or hung" in o["message"] and o["seconds"] < 60, o
    assert "unusable" in o["next"] and o["next_seconds"] < 1.0, o
