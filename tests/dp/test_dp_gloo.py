"""dp=2 x pp=2 on 4 gloo CPU ranks: every gradient equals one process on the whole batch.

The 4 ranks are spawned once for this module (`zbpp.testing`); they run every case of `cases.py`
(schedule x model kind, through `zbpp.Pipeline`, plus a few with tiny buckets) and report per case.
See `cases.py` for what each case checks and the tolerances.
"""

from __future__ import annotations

import pytest

from .cases import case_names, worker

WORLD = 4  # dp=2 x pp=2


@pytest.fixture(scope="module")
def results(zbpp_workers) -> dict[str, list[str]]:
    # pg_timeout: a case that fails on one rank leaves the others waiting; let them fail fast.
    per_rank = zbpp_workers(WORLD, pg_timeout=30).run(worker, case_names())
    merged: dict[str, list[str]] = {}
    for rank, res in enumerate(per_rank):
        for case, fails in res.items():
            merged.setdefault(case, [])
            merged[case] += [f if f.startswith("skip:") else f"rank {rank}: {f}" for f in fails]
    return merged


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", case_names())
def test_dp_pp_case(results: dict[str, list[str]], case: str) -> None:
    fails = results[case]
    if fails and all(f.startswith("skip:") for f in fails):
        pytest.skip(fails[0][len("skip: "):])
    assert not fails, "\n".join(fails)
