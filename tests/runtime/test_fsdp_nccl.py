"""FSDP2 stages on two ranks: NCCL (2 GPUs; skipped without them) and the same on gloo CPU ranks.

- dp=1 x pp=2: each stage ``fully_shard``-ed over a one-rank dp mesh under the pipeline;
- dp=2 x pp=1: two FSDP replicas of a one-rank pipeline;
- a tied weight (``layers.0.weight`` is ``layers.3.weight``): across the two pipeline ranks at dp=1
  x pp=2, and across the two stages of one rank (zb-v) at dp=2 x pp=1.

The cases and tolerances are `fsdp_cases.fsdp_case`'s (float64 on the GPU too): gradients and
parameters after three AdamW steps equal one process on the whole batch.
"""

from __future__ import annotations

import pytest

from .fsdp_cases import fsdp_worker

BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.nccl)]


def _check(per_rank: list[dict[str, list[str]]]) -> None:
    fails = [f"rank {r}: {case}: {f}" for r, res in enumerate(per_rank) for case, fs in res.items() for f in fs]
    assert not fails, "\n".join(fails)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pp2_on_a_one_rank_dp_mesh(zbpp_workers, backend: str) -> None:
    _check(zbpp_workers(2, backend=backend, pg_timeout=60).run(fsdp_worker, ["1f1b/delayed", "zb-v/plain"], 1, 2))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dp2_pp1(zbpp_workers, backend: str) -> None:
    _check(zbpp_workers(2, backend=backend, pg_timeout=60).run(fsdp_worker, ["1f1b/plain", "zb-h1/delayed/accumulate"], 2, 1))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_weight(zbpp_workers, backend: str) -> None:
    workers = zbpp_workers(2, backend=backend, pg_timeout=60)
    _check(workers.run(fsdp_worker, ["1f1b/plain/tied"], 1, 2))
    _check(workers.run(fsdp_worker, ["zb-v/delayed/tied/clip"], 2, 1))
