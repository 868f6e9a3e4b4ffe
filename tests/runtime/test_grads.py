"""Gradients and optimizer inputs of multi-rank runs against one process running the whole model on
the whole batch per replica (grads_cases.py; tolerance there), on 4 gloo ranks (dp=2 x pp=2):

- a parameter frozen when the Pipeline is built and unfrozen later is averaged over the replicas;
- a synchronised step, a no_sync step, a synchronised step without zeroing: a tied weight's earlier
  sum counts once (also after the window's first step failed), ``fully_shard`` copies too.
"""

from __future__ import annotations

import pytest

from .grads_cases import check_fsdp_sync_no_sync_sync, check_sync_no_sync_sync, check_unfrozen_later


@pytest.mark.parametrize("kind", ["plain", "zbpp"])
@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_parameter_unfrozen_after_build_is_averaged(zbpp_workers, name, kind):
    zbpp_workers(4).run(check_unfrozen_later, name, 2, kind)


@pytest.mark.parametrize("world,pp,kind,fail", [(2, 2, "plain", False), (4, 2, "zbpp", True), (4, 4, "plain", False)])
def test_tied_sum_of_earlier_steps_counts_once_after_no_sync(zbpp_workers, world, pp, kind, fail):
    # 1f1b: the embedding and the head on different ranks (two copies of the tie)
    zbpp_workers(world).run(check_sync_no_sync_sync, "1f1b", pp, kind, fail)


@pytest.mark.parametrize("schedule,tie", [("1f1b", (3,)), ("zb-v", (2, 3))])
def test_sharded_tied_sum_of_earlier_steps_counts_once_after_no_sync(zbpp_workers, schedule, tie):
    # 1f1b: copies on two ranks; zb-v: also copies FSDP split on one rank (stages 0 and 3)
    assert zbpp_workers(4).run(check_fsdp_sync_no_sync_sync, schedule, *tie) == [[]] * 4
