"""Two ranks: the NCCL checks (2 GPUs; skipped without them), and the same on gloo CPU ranks.

- dp=1 x pp=2: `zbpp.Pipeline` with the reducer enabled (no collective to issue; the readiness and
  exactly-once bookkeeping and the main_grad folding run) still matches the whole-batch reference.
- dp=2 x pp=1: two replicas of a one-rank pipeline: the asynchronous all-reduces (``.grad`` and
  ``main_grad`` buckets, tiny buckets included) give the whole-batch gradient.

The cases and tolerances are those of `cases.py` (float64, on the GPU too: rtol 1e-10, atol 1e-12).
"""

from __future__ import annotations

import pytest

from .cases import SMALL_BUCKETS, worker

KINDS = ["plain", "zbpp", "zbpp-fused", "te", "eager-bias"]
PP2 = [f"{s}/{k}" for s in ("1f1b", "zb-h1", "zb-v") for k in KINDS]
DP2 = [f"{s}/{k}" for s in ("1f1b", "zb-h1") for k in KINDS] + [SMALL_BUCKETS + "zb-h1/zbpp-fused", "presence", "presence-host"]
BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.nccl)]


def _check(per_rank: list[dict[str, list[str]]]) -> None:
    fails = [f"rank {r}: {case}: {f}" for r, res in enumerate(per_rank) for case, fs in res.items() for f in fs]
    real = [f for f in fails if ": skip:" not in f]
    assert not real, "\n".join(real)
    if len(fails) == sum(len(res) for res in per_rank):  # every case skipped
        pytest.skip("; ".join(sorted({f.split(": skip: ", 1)[1] for f in fails})))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pp2_dp1_with_reducer(zbpp_workers, backend: str) -> None:
    _check(zbpp_workers(2, backend=backend, pg_timeout=60).run(worker, PP2, 2))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dp2_pp1_async_allreduce(zbpp_workers, backend: str) -> None:
    _check(zbpp_workers(2, backend=backend, pg_timeout=60).run(worker, DP2, 1))
