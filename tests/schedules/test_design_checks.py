"""DESIGN.md's numeric checks and the zero-bubble paper's bubble formulas.

References: DESIGN.md ("Checks any implementation must meet") and Qi et al., "Zero Bubble Pipeline
Parallelism" (ICLR 2024), section 3: bubble (p-1)(F+B+W) for 1F1B, (p-1)(F+B-W) for ZB-H1,
(p-1)(F+B-2W) for ZB-H2, and (p-1)(F+B+2C-2W) for ZB-H2 with communication time C.
Times are sums of a few floats, so 1e-9 absolute tolerance is exact up to rounding.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbpp.schedules import Costs, Memory, build, simulate, validate

UNIT = Costs(f=1, b=1, w=1, comm=0)


@pytest.mark.parametrize(
    "p, m, expected",
    [(4, 8, {"1f1b": 33, "zb-h1": 27, "zb-h2": 24}), (8, 24, {"1f1b": 93, "zb-h1": 79, "zb-h2": 72})],
)
def test_unit_cost_longest_span(p: int, m: int, expected: dict[str, int]) -> None:
    for name, span in expected.items():
        res = simulate(validate(build(name, num_ranks=p, num_microbatches=m)), UNIT)
        assert res.cost == pytest.approx(span, abs=1e-9), name


@pytest.mark.parametrize(
    "name, peaks",
    [
        ("1f1b", [4, 3, 2, 1]),
        ("zb-h1", [4, 10 / 3, 8 / 3, 2]),
        ("zb-h2", [7, 17 / 3, 13 / 3, 3]),
    ],
)
def test_peak_memory_p4_m12(name: str, peaks: list[float]) -> None:
    res = simulate(build(name, num_ranks=4, num_microbatches=12), UNIT, Memory(activation=1, wgrad=1 / 3))
    assert res.peak_memory == pytest.approx(peaks, abs=1e-9)


def _bubble(name: str, p: int, m: int, costs: Costs) -> float:
    """Absolute bubble of the busiest rank: longest span minus its work."""
    res = simulate(build(name, num_ranks=p, num_microbatches=m), costs)
    return res.cost - res.busy


costs_strategy = st.tuples(
    st.floats(0.5, 3.0), st.floats(0.5, 3.0), st.floats(0.05, 1.0)
).map(lambda t: (t[0], t[1], min(t[2], t[0], t[1])))  # the formulas assume W <= F and W <= B


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 8), extra=st.integers(0, 24), fbw=costs_strategy)
def test_bubble_formulas_without_comm(p: int, extra: int, fbw: tuple[float, float, float]) -> None:
    f, b, w = fbw
    costs = Costs(f=f, b=b, w=w)
    assert _bubble("1f1b", p, p + extra, costs) == pytest.approx((p - 1) * (f + b + w), abs=1e-9)
    assert _bubble("zb-h1", p, p + extra, costs) == pytest.approx((p - 1) * (f + b - w), abs=1e-9)
    # ZB-H2 needs its 2(p-1)+1 warm-up forwards: m >= 2p - 1
    m = 2 * p - 1 + extra
    assert _bubble("zb-h2", p, m, costs) == pytest.approx((p - 1) * (f + b - 2 * w), abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 8), extra=st.integers(0, 24), fbw=costs_strategy, c_frac=st.floats(0.0, 0.5))
def test_zb_h2_bubble_with_comm(p: int, extra: int, fbw: tuple[float, float, float], c_frac: float) -> None:
    f, b, w = fbw
    comm = c_frac * w  # the paper's regime: communication cheaper than a W
    bubble = _bubble("zb-h2", p, 2 * p - 1 + extra, Costs(f=f, b=b, w=w, comm=comm))
    assert bubble == pytest.approx((p - 1) * (f + b + 2 * comm - 2 * w), abs=1e-9)


def test_zb_h2_unit_costs_has_zero_bubble() -> None:
    res = simulate(build("zb-h2", num_ranks=8, num_microbatches=24), UNIT)
    assert res.bubble_rate == pytest.approx(0.0, abs=1e-12)
    # 1F1B's bubble rate for the same case, by the formula: (p-1)*3 / (m*3 + (p-1)*3)
    res_1f1b = simulate(build("1f1b", num_ranks=8, num_microbatches=24), UNIT)
    assert res_1f1b.bubble_rate == pytest.approx(7 / (24 + 7), abs=1e-12)
