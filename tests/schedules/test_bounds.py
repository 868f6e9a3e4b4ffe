"""`zbpp.schedules.bounds.lower_bound`: a bound every schedule meets, and tight where the papers
say the optimum is known.

References: the simulator (every schedule of every generator, at its own peak memory, must cost
at least the bound), DESIGN.md's unit-cost checks (ZB-H2 has no bubble at twice 1F1B's memory;
ZB-H1's 27 for p = 4, m = 8), and the zero-bubble paper's ZB-2p result for its 1.5B profile
(Table 4: 0.0433), which this bound shows to be optimal. The exact optimum of small cases is
checked against the bound in test_exact.py.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbpp.schedules import Costs, Memory, available, build, simulate
from zbpp.schedules.bounds import lower_bound
from zbpp.schedules.ir import loop_placement, v_placement

REL = 1e-9  # sums of a few hundred float costs: rounding only


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(set(available()) - {"gpipe"})),
    p=st.integers(1, 6),
    m=st.integers(1, 14),
    seed=st.integers(0, 2**16),
)
def test_every_schedule_meets_the_bound(name: str, p: int, m: int, seed: int) -> None:
    """Uneven random stages, comm, and the schedule's own peak memory as the limit."""
    rng = random.Random(seed)
    opts = {"chunks": rng.randint(1, 3)} if name == "interleaved-1f1b" else {}
    sched = build(name, num_ranks=p, num_microbatches=m, **opts)
    n = sched.num_stages
    costs = Costs(
        [rng.uniform(0.2, 3) for _ in range(n)],
        [rng.uniform(0.2, 3) for _ in range(n)],
        [rng.uniform(0.0, 2) for _ in range(n)],
        rng.uniform(0, 0.5),
    )
    act = [rng.uniform(0.5, 2) for _ in range(n)]
    memory = Memory(act, [a * rng.uniform(0, 1) for a in act])
    res = simulate(sched, costs, memory)
    lb = lower_bound(sched.placement, m, costs, memory, max(res.peak_memory))
    assert lb.busy == pytest.approx(res.busy, rel=REL)
    assert lb.cost <= res.cost * (1 + REL)
    assert lb.makespan <= res.makespan * (1 + REL)
    assert lb.bubble_rate <= res.bubble_rate + REL


def test_unit_costs_design_checks() -> None:
    """ZB-H1 (p = 4, m = 8: 27) is optimal at 1F1B's memory; at twice that, no bubble is possible
    and ZB-H2 reaches it (DESIGN.md)."""
    unit, memory = Costs(1, 1, 1), Memory(1, 1 / 3)
    at_1p = lower_bound(loop_placement(4), 8, unit, memory, memory_limit=4)
    assert (at_1p.cost, at_1p.busy) == (27.0, 24.0)
    assert simulate(build("zb-h1", num_ranks=4, num_microbatches=8), unit).cost == 27.0
    at_2p = lower_bound(loop_placement(4), 8, unit, memory, memory_limit=8)
    assert at_2p.cost == at_2p.busy == 24.0 and at_2p.bubble_rate == 0.0
    # the makespan also counts the last rank's late start: (p - 1) F before its first task
    assert at_2p.makespan == 3 + 24.0


def test_zb_2p_of_the_paper_is_optimal() -> None:
    """The zero-bubble paper's 1.5B model (its Table 9 profile: p = 8, m = 24, times in ms; memory
    M_B = 34h + 5as per microbatch, M_W = 32h of it kept until W) at 2p M_B: its ZB-2p bubble rate
    0.0433 (Table 4) is the bound. Worked out by hand: rank 0 ends no sooner than rank p-1's first
    F, (p-1)(F+C), plus rank p-1's m F's and m B's, plus the last B's way back to rank 0,
    (p-1)(B+C), plus rank 0's last W."""
    f, b, w, c = 18.522, 18.086, 9.337, 0.601
    h, a = 2304, 24
    memory = Memory(activation=34 * h + 5 * a * 1024, wgrad=32 * h)
    p, m = 8, 24
    lb = lower_bound(loop_placement(p), m, Costs(f, b, w, c), memory, 2 * p * memory.activation)
    assert lb.cost == pytest.approx((p - 1) * (f + c) + m * (f + b) + (p - 1) * (b + c) + w, rel=REL)
    assert lb.bubble_rate == pytest.approx(0.0433, abs=5e-5)


def test_memory_limit_tightens_the_bound() -> None:
    """Less memory, fewer microbatches in flight: the bound never drops as the limit shrinks."""
    costs, memory = Costs(1, 1.2, 0.8, 0.1), Memory(1, 0.4)
    for placement in (loop_placement(4), v_placement(4)):
        floor = 1.0 if len(placement) == 4 else 2.0
        costs_seen = [lower_bound(placement, 12, costs, memory, floor * k).cost for k in (1, 1.5, 2, 3, 4, 8)]
        assert costs_seen == sorted(costs_seen, reverse=True)
        assert costs_seen[0] > costs_seen[-1]  # one microbatch at a time is slower than many


def test_infeasible_limit_is_refused() -> None:
    with pytest.raises(ValueError, match=r"memory_limit=1.5 is infeasible; the smallest feasible limit is 2\b"):
        lower_bound(v_placement(3), 6, Costs(), Memory(activation=1), memory_limit=1.5)


def test_nan_limit_is_refused_not_read_as_no_limit() -> None:
    """At a limit of 1 (Memory(1, 1), p = 2, m = 2) the bound is 9 (tests/schedules/test_exact.py
    works it by hand); a NaN limit compared false everywhere and gave the unlimited bound, 7, as
    if a bound at the limit: a silently wrong figure. It must be named instead, as must a
    placement with a rank that holds no stage and a microbatch count that is no integer."""
    costs, memory = Costs(1, 1, 1), Memory(1, 1)
    assert lower_bound(loop_placement(2), 2, costs, memory, memory_limit=1).makespan == pytest.approx(9.0)
    assert lower_bound(loop_placement(2), 2, costs, memory, memory_limit=None).makespan == pytest.approx(7.0)
    for limit, what in ((float("nan"), "memory_limit"), ([1.0, float("nan")], r"memory_limit\[1\]")):
        with pytest.raises(ValueError, match=f"{what} must be a number"):
            lower_bound(loop_placement(2), 2, costs, memory, memory_limit=limit)
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] without a stage"):
        lower_bound([0, 2], 2, costs, memory)
    with pytest.raises(ValueError, match="num_microbatches must be an integer >= 1, got 1.5"):
        lower_bound(loop_placement(2), 1.5, costs, memory)


def test_a_limit_below_what_a_b_adds_is_refused_with_the_true_floor():
    # wgrad 2 > activation 1: B of a rank's upper V stage holds 1 (the stage below) + 2, so a limit
    # of 2.5 is infeasible (zbv-auto refuses it too) though it holds both activations (2)
    from zbpp.schedules.ir import v_placement

    with pytest.raises(ValueError, match="smallest feasible limit is 3 "):
        lower_bound(v_placement(2), 4, memory=Memory(activation=1, wgrad=2), memory_limit=2.5)
    assert lower_bound(v_placement(2), 4, memory=Memory(activation=1, wgrad=2), memory_limit=3).makespan > 0


# -- least_peaks against every order of one microbatch --------------------------------------------
def _orders_of_rank(placement, rank):
    """Every order of `rank`'s tasks for one microbatch: F up the rank's stages and B down them
    are a chain (each waits for the one before it), each W anywhere after its B."""
    from zbpp.schedules.ir import Action, Kind

    stages = [s for s, r in enumerate(placement) if r == rank]
    chain = [Action(Kind.F, s, 0) for s in stages] + [Action(Kind.B, s, 0) for s in reversed(stages)]

    def extend(done, i, pending):
        if i == len(chain) and not pending:
            yield done
        if i < len(chain):
            a = chain[i]
            yield from extend(done + [a], i + 1, pending + ([Action(Kind.W, a.stage, 0)] if a.kind is Kind.B else []))
        for w in pending:
            yield from extend(done + [w], i, [x for x in pending if x != w])

    return list(extend([], 0, []))


def _least_peak_by_brute_force(placement, memory, rank):
    """The least peak of `rank` over every one-microbatch schedule, as `simulate` counts memory.
    One microbatch is enough: a schedule's tasks of any one microbatch are such a schedule, and the
    others' memory (>= 0 at every point) only adds to its peaks, so repeating the best one
    microbatch at a time reaches the least peak of any m."""
    from zbpp.schedules.ir import from_orders

    p = max(placement) + 1
    others = [_orders_of_rank(placement, r)[0] for r in range(p)]
    return min(simulate(from_orders("brute", placement, 1, [o if r != rank else mine for r, o in enumerate(others)]),
                        memory=memory).peak_memory[rank]
               for mine in _orders_of_rank(placement, rank))


@pytest.mark.parametrize("placement", [[0, 1], [0, 0], [0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 0]])
@pytest.mark.parametrize("memory", [Memory(1, 0.5), Memory(1, 2, transient_b=1), Memory(1, 1, transient_w=10),
                                    Memory(2, 1, transient_f=1, transient_w=3), Memory(1, 0.5, transient_w=0.25),
                                    Memory(1, [0, 1, 0.5, 0], transient_w=[0, 5, 2, 1]),
                                    Memory([2, 1, 3, 1], [0.5, 3, 1, 0], transient_b=[1, 0, 2, 0],
                                           transient_w=[4, 1, 0.5, 2])])
def test_least_peaks_is_the_least_peak_of_any_order(placement, memory):
    """least_peaks is exact, and least_peak_orders reaches it. It was a lower bound only where a
    W's transient shares a rank with other stages (a W may wait for the B's below it, which lowers
    what it runs on), so limits in between were refused or named wrongly as the smallest feasible.
    Reference: every one-microbatch order of the rank, simulated."""
    from zbpp.schedules.bounds import least_peak_orders, least_peaks
    from zbpp.schedules.ir import from_orders

    memory = Memory(*(x[: len(placement)] if isinstance(x, tuple) else x for x in  # per-stage values: cut
                      (memory.activation, memory.wgrad, memory.transient_f, memory.transient_b, memory.transient_w)))
    peaks, orders = least_peaks(placement, memory), least_peak_orders(placement, memory)
    reached = simulate(from_orders("least", placement, 1, orders), memory=memory).peak_memory
    for r in range(max(placement) + 1):
        brute = _least_peak_by_brute_force(placement, memory, r)
        # sums of a few small binary fractions: exact in floats
        assert peaks[r] == brute == reached[r], (r, peaks, brute, reached)


def test_least_peaks_lets_a_w_wait_for_the_b_below_it():
    # by hand: stages 0 and 1 on one rank, activation 1, wgrad [0, 1], W1's transient 5. W1 right
    # after B1 runs on stage 0's activation and its own wgrad: 1 + 1 + 5 = 7; after B0 (which
    # keeps no wgrad) on 0 + 1 + 5 = 6. With wgrad 1 on both stages, either W runs beside the
    # other stage's 1: 12 for transient 10, not the 11 the bound used to give
    from zbpp.schedules.bounds import least_peaks
    from zbpp.schedules.generators.auto import smallest_feasible_limit

    memory = Memory(activation=1, wgrad=[0, 1], transient_w=[0, 5])
    assert _least_peak_by_brute_force([0, 0], memory, 0) == 6
    assert least_peaks([0, 0], memory) == [6.0]
    memory = Memory(activation=1, wgrad=1, transient_w=10)
    assert _least_peak_by_brute_force([0, 0], memory, 0) == 12
    assert least_peaks([0, 0], memory) == [12.0]
    assert smallest_feasible_limit([0, 0], memory) == 12


def test_infeasible_limit_names_the_least_peak_where_a_w_transient_shares_a_rank():
    # the case above: 11.5 is infeasible (every order peaks at 12); the message named 11, a limit
    # no schedule meets, as "the smallest feasible limit"
    memory = Memory(activation=1, wgrad=1, transient_w=10)
    with pytest.raises(ValueError, match=r"memory_limit=11.5 is infeasible; the smallest feasible limit is 12 "):
        lower_bound([0, 0], 2, memory=memory, memory_limit=11.5)
    for name in ("zbv-auto", "zbi-auto"):
        with pytest.raises(ValueError, match=r"memory_limit=11.5 is infeasible; the smallest feasible limit is 12 "):
            build(name, num_ranks=1, num_microbatches=2, memory=memory, memory_limit=11.5)
    assert lower_bound([0, 0], 2, memory=memory, memory_limit=12).makespan > 0


def test_one_limit_of_any_real_type_is_named_as_one():
    """One number that is a Real but no int or float (a Fraction; numpy's float32) was named as
    if one per rank, "memory_limit[0]=1.5 is infeasible; the smallest feasible limit is 2": rank
    0's own floor, not the largest. V p = 2 with stage 1's activation 3: rank 0 (stages 0 and 3)
    needs 2, rank 1 (stages 1 and 2) 4, so no single limit under 4 is feasible."""
    from fractions import Fraction

    memory = Memory(activation=[1, 3, 1, 1])
    assert [_least_peak_by_brute_force(v_placement(2), memory, r) for r in (0, 1)] == [2, 4]
    for limit in (1.5, Fraction(3, 2)):
        with pytest.raises(ValueError, match=r"^memory_limit=1.5 is infeasible; the smallest feasible limit is 4 "):
            lower_bound(v_placement(2), 4, memory=memory, memory_limit=limit)
    with pytest.raises(ValueError, match=r"^memory_limit\[0\]=1.5 is infeasible; the smallest feasible limit is 2 "):
        lower_bound(v_placement(2), 4, memory=memory, memory_limit=[1.5, 4])
