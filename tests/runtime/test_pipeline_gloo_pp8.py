"""Every schedule on 8 gloo CPU ranks (pp=8), against one process running the whole model.

The 4-rank suite (`test_pipeline_gloo.py`) covers every model kind and split, m = p included; this
one checks that nothing in the plan or the message order depends on having few ranks: m = 2p+1
with uneven rows (warm-up, steady state and cool-down all on 8 ranks, and a split whose last
microbatch is smaller), on the mixed model (a zbpp delayed and a plain Linear in each block: both
kinds of W in one run, half the work of running each kind alone), one step: the loss, every
gradient and the parameters after the SGD step. A second step reuses the first one's plan and
message order; what it adds (the cached input signature, the optimizer's momentum) does not depend
on the number of ranks and is checked at p = 4 (two steps per case there). Tolerances as in
`tests.runtime.cases` (fp32: rtol 1e-5, atol 1e-6, checked per tensor inside `run_case`).
"""

from __future__ import annotations

import pytest

from zbpp.schedules import available

from .cases import check_schedule

P = 8


@pytest.mark.slow
def test_every_schedule_at_pp8_matches_single_process(zbpp_workers) -> None:
    cases = [(2 * P + 1, 5 * P + 2)]
    worst = zbpp_workers(P).run(_all_schedules, cases)
    assert max(worst) < 1e-3


def _all_schedules(cases: list[tuple[int, int]]) -> float:
    return max(check_schedule(name, P, ["mixed"], cases, steps=1) for name in available())
