"""DualPipeV: validity, its phase table (DeepSeek's DualPipeV), overlapped pairs, and few bubbles.

References: the phase counts of DualPipeV (nF0 = 2(p-r-1), nF0F1 = r+1, nB1W1F1 = p-r-1,
main = m-2p+r+1 iterations of two pairs, nB1F1B0 = p-r-1, nB1B0 = r+1, nWB0 = p-r-1, nW = r+1)
and 1F1B's bubble formula (p-1)/(m+p-1) for the same model (a V stage is half a 1F1B stage, so
1F1B on p ranks runs the same work).
"""

from __future__ import annotations

import pytest

from zbpp.schedules import Costs, Kind, Memory, build, simulate, validate

SIZES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p + 1)]


@pytest.mark.parametrize("p,m", SIZES)
def test_valid_with_adjacent_forward_backward_pairs(p: int, m: int) -> None:
    sched = validate(build("dualpipe-v", num_ranks=p, num_microbatches=m))
    assert sched.num_stages == 2 * p
    assert sched.placement == tuple(list(range(p)) + list(reversed(range(p))))
    seen = set()
    for a, b in sched.overlap_pairs:
        rank = sched.rank_of(a.stage)
        order = sched.orders[rank]
        i = order.index(a)
        assert order[i + 1] == b, f"pair ({a}, {b}) is not adjacent on rank {rank}"
        # a forward of one chunk with the full backward of the other: no data edge between them
        assert a.kind is Kind.F and b.kind is Kind.BW and a.stage != b.stage
        assert sched.rank_of(b.stage) == rank and a not in seen and b not in seen
        seen |= {a, b}


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SIZES if m >= 2 * p])
def test_phase_counts_match_dualpipev(p: int, m: int) -> None:
    sched = build("dualpipe-v", num_ranks=p, num_microbatches=m)
    for r in range(p):
        pairs = [x for x in sched.overlap_pairs if sched.rank_of(x[0].stage) == r]
        # main: two pairs per iteration, except the last rank's first (run one after the other);
        # nB1F1B0: one pair each
        main = m - 2 * p + r + 1
        assert len(pairs) == 2 * main - (1 if r == p - 1 else 0) + (p - r - 1)
        # split backwards (zero-bubble W's): nB1W1F1 and nWB0, and half of nB1B0
        w_count = sum(a.kind is Kind.W for a in sched.orders[r])
        assert w_count == 2 * (p - r - 1) + (r + 1)
        # warm-up: nF0 then nF0F1 before the first backward (on the last rank, whose nB1W1F1 is
        # empty, the main step's first F0 as well)
        order = sched.orders[r]
        first_backward = next(i for i, a in enumerate(order) if a.kind is not Kind.F)
        assert first_backward == 2 * (p - r - 1) + 2 * (r + 1) + (1 if r == p - 1 else 0)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SIZES if m >= 2 * p])
def test_fewer_bubbles_than_1f1b(p: int, m: int) -> None:
    """Run sequentially (pairs not overlapped), unit costs: the bubble stays below 1F1B's."""
    res = simulate(build("dualpipe-v", num_ranks=p, num_microbatches=m), Costs(1, 1, 1), Memory(1, 1))
    assert res.busy == 6.0 * m
    one_f_one_b = (p - 1) / (m + p - 1)
    assert res.bubble_rate < one_f_one_b / 2, (res.bubble_rate, one_f_one_b)
    if m == 4 * p + 1:
        assert res.bubble_rate < 0.04


def test_small_m_still_runs() -> None:
    """m < 2p (DualPipeV's minimum): the 2p-microbatch order cut down to m, still complete."""
    for p in (2, 4, 8):
        for m in range(1, 2 * p):
            res = simulate(validate(build("dualpipe-v", num_ranks=p, num_microbatches=m)), Costs(1, 1, 1))
            assert res.busy == 6.0 * m
