"""The exact solver (`zbpp.schedules.exact`) as the reference optimum on small cases: the lower
bound <= the optimum <= the automatic schedules, and those within 1% of it.

References: a case worked out by hand (below), the simulator (the solver's schedule is simulated
and its memory checked), and `zbpp.schedules.bounds` (the bound must not exceed the optimum).
"""

from __future__ import annotations

import pytest

pytest.importorskip("scipy", reason="the exact solver needs scipy (pip install 'zbpp[exact]')")

from zbpp.schedules import Costs, Memory, build, simulate, validate  # noqa: E402
from zbpp.schedules.bounds import lower_bound  # noqa: E402
from zbpp.schedules.exact import optimal_schedule  # noqa: E402
from zbpp.schedules.ir import loop_placement, v_placement  # noqa: E402

REL = 1e-6  # HiGHS solves to a relative gap of 1e-9; times are sums of a few dozen costs


def test_hand_worked_case() -> None:
    """p = 2, m = 2, F = B = W = 1, no comm; W frees the whole activation (wgrad = activation) and
    each rank may hold one: rank 0 must run F0 B0 W0 F1 B1 W1 in that order. B0 waits for F0, F0
    on rank 1, B0 on rank 1: it runs at [3, 4], W0 [4, 5], F1 [5, 6], B1 (after F1 and B1 of rank
    1) at [8, 9], W1 [9, 10]: makespan 10. The bound, which lets B free memory without the W
    (it ignores what W keeps), gets 9."""
    placement, costs, memory = loop_placement(2), Costs(1, 1, 1), Memory(1, 1)
    opt = optimal_schedule(placement, 2, costs, memory, memory_limit=1)
    assert opt.proven and opt.makespan == pytest.approx(10.0, rel=REL)
    assert lower_bound(placement, 2, costs, memory, memory_limit=1).makespan == pytest.approx(9.0, rel=REL)
    res = simulate(validate(opt.schedule), costs, memory)
    assert res.makespan == pytest.approx(10.0, rel=REL) and max(res.peak_memory) <= 1.0


# (name, p, m, costs, memory, per-rank limit): one stage per rank and V shapes, limits from the
# smallest feasible up to twice 1F1B's, uneven stages, comm.
CASES = [
    ("zb-auto", 3, 6, Costs(1, 1.5, 0.7, 0.1), Memory(1, 0.4), 3),
    ("zb-auto", 4, 6, Costs(1, 1.5, 0.7, 0.1), Memory(1, 0.4), 4),
    ("zb-auto", 4, 8, Costs(1, 1.5, 0.7, 0.1), Memory(1, 0.4), 4),
    ("zb-auto", 4, 6, Costs(1.3, 1, 0.5, 0.2), Memory(1, 0.5), 6),
    ("zb-auto", 3, 6, Costs([1, 1.4, 0.8], [1.2, 1, 1.5], [0.5, 1, 0.7], 0.1), Memory(1, 0.3), 4.5),
    ("zb-auto", 5, 5, Costs(1, 1.2, 0.6, 0.05), Memory(1, 0.4), 5),
    ("zbv-auto", 2, 2, Costs(1, 1.2, 0.8, 0.1), Memory(1, 0.4), 4),
    ("zbv-auto", 2, 3, Costs(1, 1, 1), Memory(1, 1), 4),
    ("zbv-auto", 3, 2, Costs(1, 1.2, 0.8, 0.1), Memory(1, 0.4), 6),
    ("zbv-auto", 3, 3, Costs(1.02, 1.31, 1.01, 0.18), Memory(1, 0.51), 2),
    ("zbv-auto", 2, 3, Costs(1.73, 0.53, 0.22, 0.04), Memory(1, 0.75), 3),
    ("zbv-auto", 3, 3, Costs(0.87, 0.65, 0.99, 0.24), Memory(1, 0.18), 3),
]
# Cases where the search stays further from the optimum (tight memory: one or one and a half
# microbatches per rank), with the gap it has today: a regression guard, not a goal.
KNOWN_GAPS = [
    ("zb-auto", 3, 5, Costs(1.35, 1.89, 0.8, 0.08), Memory(1, 0.81), 2, 0.025),
    ("zbv-auto", 2, 3, Costs(1, 1.2, 0.8, 0.1), Memory(1, 0.4), 3, 0.04),
]


def _check(name: str, p: int, m: int, costs: Costs, memory: Memory, limit: float) -> tuple[float, float]:
    placement = loop_placement(p) if name == "zb-auto" else v_placement(p)
    opt = optimal_schedule(placement, m, costs, memory, memory_limit=limit, time_limit=60)
    assert opt.proven
    exact = simulate(validate(opt.schedule), costs, memory)
    assert exact.makespan == pytest.approx(opt.makespan, rel=REL)
    assert max(exact.peak_memory) <= limit * (1 + REL)
    heuristic = simulate(build(name, num_ranks=p, num_microbatches=m, costs=costs, memory=memory, memory_limit=limit),
                         costs, memory)
    bound = lower_bound(placement, m, costs, memory, limit)
    assert bound.makespan <= opt.makespan * (1 + REL)
    assert opt.makespan <= heuristic.makespan * (1 + REL)
    return heuristic.makespan, opt.makespan


@pytest.mark.parametrize("name, p, m, costs, memory, limit", CASES)
def test_bound_exact_heuristic_within_one_percent(name, p, m, costs, memory, limit) -> None:
    heuristic, exact = _check(name, p, m, costs, memory, limit)
    assert heuristic <= exact * 1.01


@pytest.mark.parametrize("name, p, m, costs, memory, limit, gap", KNOWN_GAPS)
def test_known_gaps_at_tight_memory(name, p, m, costs, memory, limit, gap) -> None:
    heuristic, exact = _check(name, p, m, costs, memory, limit)
    assert heuristic <= exact * (1 + gap)


def test_time_limit_returns_the_best_found_unproven() -> None:
    """Too little time to prove anything: the start schedule (or better) comes back, with a lower
    bound no higher than its makespan."""
    placement, costs, memory = v_placement(3), Costs(1, 1.2, 0.8, 0.1), Memory(1, 0.4)
    start = build("zbv-auto", num_ranks=3, num_microbatches=6, costs=costs, memory=memory, memory_limit=6)
    opt = optimal_schedule(placement, 6, costs, memory, memory_limit=6, start=start, time_limit=0.05)
    assert opt.makespan <= simulate(start, costs, memory).makespan * (1 + REL)
    assert opt.lower <= opt.makespan * (1 + REL)
    assert opt.proven or opt.lower < opt.makespan


@pytest.mark.parametrize("limit, shown", [(-1, "-1"), (0, "0"), (float("nan"), "nan"), (True, "True"), ("60", "'60'")])
def test_bad_time_limit_is_refused_naming_it(limit, shown) -> None:
    # HiGHS only warns of a negative limit and runs without one: refused before anything runs
    with pytest.raises(ValueError, match=rf"optimal_schedule: time_limit must be a number of seconds > 0 .*got {shown}$"):
        optimal_schedule(v_placement(2), 2, time_limit=limit)


def _every_order(stage: int, m: int):
    """Every order of one stage's F, B and W tasks with F(j) before B(j) before W(j)."""
    import itertools

    from zbpp.schedules import Action, Kind

    tasks = [Action(k, stage, j) for j in range(m) for k in (Kind.F, Kind.B, Kind.W)]
    for perm in itertools.permutations(tasks):
        pos = {a: i for i, a in enumerate(perm)}
        if all(pos[Action(Kind.F, stage, j)] < pos[Action(Kind.B, stage, j)] < pos[Action(Kind.W, stage, j)]
               for j in range(m)):
            yield perm


def _brute_force_optimum(m: int, costs: Costs, memory: Memory, limit: float) -> float | None:
    """The least makespan over every pair of rank orders of p = 2 (one stage each) whose simulated
    peak is within `limit` (None: none is)."""
    from zbpp.schedules import ScheduleError
    from zbpp.schedules.ir import from_orders

    best = None
    ranks = [list(_every_order(s, m)) for s in (0, 1)]
    for a in ranks[0]:
        for b in ranks[1]:
            try:
                res = simulate(from_orders("x", loop_placement(2), m, [a, b]), costs, memory)
            except ScheduleError:
                continue
            if max(res.peak_memory) <= limit * (1 + REL) and (best is None or res.makespan < best):
                best = res.makespan
    return best


@pytest.mark.parametrize("memory, limit", [
    (Memory(activation=1, wgrad=2), 3),  # B raises the memory: wgrad re-created (recompute, offload)
    (Memory(activation=1, wgrad=0.5, transient_b=2), 3),  # B's transient rises above what it starts with
])
def test_limit_counts_what_b_adds_and_transients(memory, limit) -> None:
    """The solver's schedule must be within the limit as `simulate` counts the peak, and as fast
    as the best of every pair of rank orders (p = 2, m = 2) that is: the model constrained memory
    only after an F, so it returned (as proven optimal) a schedule over the limit, faster than any
    that fits."""
    costs = Costs(1, 1, 1)
    opt = optimal_schedule(loop_placement(2), 2, costs, memory, memory_limit=limit)
    res = simulate(validate(opt.schedule), costs, memory)
    assert max(res.peak_memory) <= limit * (1 + REL), res.peak_memory
    assert opt.proven and opt.makespan == pytest.approx(_brute_force_optimum(2, costs, memory, limit), rel=REL)


def test_limit_no_order_fits_names_it() -> None:
    """B's transient of 2 on top of F's activation of 1 peaks at 3 in every order: a limit of 2
    must be refused, not answered with a schedule over it."""
    memory = Memory(activation=1, wgrad=0.5, transient_b=2)
    assert _brute_force_optimum(2, Costs(1, 1, 1), memory, 2) is None
    with pytest.raises(ValueError, match="memory_limit=2"):
        optimal_schedule(loop_placement(2), 2, Costs(1, 1, 1), memory, memory_limit=2)


def _brute_force_any_placement(placement, m: int, costs: Costs, memory: Memory, limits) -> float | None:
    """The least makespan over every combination of rank orders whose simulated peaks are within
    `limits` (None: none is). A rank's order keeps what the data edges imply between its own tasks
    (of a microbatch: F's up the stages, B's after every F and down the stages, W after its B);
    the simulator refuses the combinations that deadlock."""
    import itertools

    from zbpp.schedules import Action, Kind, ScheduleError
    from zbpp.schedules.ir import from_orders

    def after(a, b) -> bool:  # must b run before a (same microbatch)?
        if a.microbatch != b.microbatch:
            return False
        if a.kind is Kind.F:
            return b.kind is Kind.F and b.stage < a.stage
        if a.kind is Kind.B:
            return b.kind is Kind.F or (b.kind is Kind.B and b.stage > a.stage)
        return b == Action(Kind.B, a.stage, a.microbatch)

    def orders_of(rank):
        tasks = [Action(k, s, j) for s in range(len(placement)) if placement[s] == rank for j in range(m)
                 for k in (Kind.F, Kind.B, Kind.W)]
        for perm in itertools.permutations(tasks):
            if not any(after(perm[i], b) for i in range(len(perm)) for b in perm[i + 1:]):
                yield perm

    best = None
    for combo in itertools.product(*(list(orders_of(r)) for r in range(max(placement) + 1))):
        try:
            res = simulate(from_orders("x", placement, m, combo), costs, memory)
        except ScheduleError:
            continue
        if all(x <= y * (1 + REL) for x, y in zip(res.peak_memory, limits)) and (best is None or res.makespan < best):
            best = res.makespan
    return best


def test_a_limit_that_needs_a_w_to_wait_is_solved() -> None:
    """Interleaved, p = 2, two stages per rank, a W's transient on a rank of two stages: one
    microbatch at a time with each W right after its B peaks at [6, 3]; a W that waits for the B
    below it gets rank 0 to 4.5. The solver started from the former, and refused [4.5, 3] (and 4.5)
    as "no schedule within it", though the brute force finds some. A limit given as a Fraction was
    taken for a list (TypeError: 'Fraction' object is not iterable)."""
    from fractions import Fraction

    placement, costs = loop_placement(2, 2), Costs(1, 1, 1)
    memory = Memory(activation=[2, 0, 0, 1], wgrad=[2, 1, 2, 0.5], transient_f=[1, 0, 1, 3],
                    transient_b=[0.5, 3, 2, 0], transient_w=[0.5, 0, 2, 0.5])
    for limit in ([4.5, 3], 4.5, Fraction(9, 2)):
        limits = limit if isinstance(limit, list) else [float(limit)] * 2
        best = _brute_force_any_placement(placement, 1, costs, memory, limits)
        assert best is not None
        opt = optimal_schedule(placement, 1, costs, memory, memory_limit=limit)
        res = simulate(validate(opt.schedule), costs, memory)
        assert all(x <= y * (1 + REL) for x, y in zip(res.peak_memory, limits)), (limit, res.peak_memory)
        assert opt.proven and opt.makespan == pytest.approx(best, rel=REL), limit
