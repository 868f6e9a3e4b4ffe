"""Automatic schedules: `zb-auto` (one stage per rank) and `zbv-auto` (V placement).

Given per-stage costs (F, B, W and comm may all differ), a memory model and a per-rank memory
limit, the search runs in three steps, each keeping the best schedule so far (lowest cost, i.e.
longest rank span; then lowest sum of spans):

1. candidates: the zero-bubble paper's heuristic (`auto_heuristic.list_schedule`), searching its
   switches one at a time from two starts, and the handcrafted schedules of the same placement
   whose memory fits (ZB-H2, ZB-H1; ZB-V, and the F/B orders of 1F1B, DualPipeV, V-Half and
   V-Min), so the result is never worse than any of them that fits;
2. each candidate's F/B order with its W's placed anew where they fill idle time
   (`auto_heuristic.place_w`);
3. local search on the best (`local_search.improve`), with incremental re-simulation.

The memory limit holds by construction (admission in the heuristic, checks on every move) and
is checked again on the result. A limit below the smallest feasible one (a rank must hold all its
stages' activations of one microbatch at once) raises a `ValueError` that names it.

The search's work is counted in simulated tasks, not seconds, so the result is deterministic;
it is capped for large instances (p=32, m=256 on a V takes about a second).

>>> from zbpp.schedules import build, simulate, Costs, Memory
>>> costs, memory = Costs(f=1, b=1, w=1), Memory(activation=1, wgrad=1/3)
>>> s = build("zb-auto", num_ranks=4, num_microbatches=8, costs=costs, memory=memory, memory_limit=8)
>>> res = simulate(s, costs, memory)
>>> res.bubble_rate, max(res.peak_memory) <= 8
(0.0, True)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ..checks import as_number
from ..ir import Kind, Schedule, from_orders, loop_placement, v_placement
from ..registry import build, register
from ..simulate import Costs, Memory
from .auto_heuristic import Policy, Problem, list_schedule, place_w
from .local_search import Timeline, improve

__all__ = ["zb_auto", "zbv_auto", "smallest_feasible_limit"]

#: Local-search budget in re-simulated tasks: generous for small instances, a few passes over
#: the schedule for large ones.
_MIN_BUDGET = 150_000
_BUDGET_PER_TASK = 2
#: Above this many tasks only a few heuristic variants run (each is a full pass).
_MANY_TASKS = 20_000


def smallest_feasible_limit(placement: Sequence[int], memory: Memory) -> float:
    """The smallest per-rank memory limit that any schedule of `placement` can meet.

    Every rank holds the activations of all its stages for a microbatch at once (the F of its last
    stage runs before the B of its first); one microbatch at a time, each W right after its B,
    needs exactly that.

    >>> from zbpp.schedules.ir import v_placement
    >>> smallest_feasible_limit(v_placement(4), Memory(activation=1, wgrad=0.5))
    2.0
    """
    act, _ = memory.per_stage(len(placement))
    per_rank: dict[int, float] = {}
    for s, r in enumerate(placement):
        per_rank[r] = per_rank.get(r, 0.0) + act[s]
    return max(per_rank.values())


#: The heuristic's switches and their values (see `Policy`); V-only ones apply to two stages per rank.
_SWITCHES = {
    "b_first": (True, False),
    "f_may_delay_b": (True, False),
    "always_fill": (False, True),
    "inflight": (0, 1, 2),
}
_V_SWITCHES = {"deep_first": (True, False), "reserve_one": (True, False)}


def _heuristic(prob: Problem, *, few: bool) -> list[list[list[int]]]:
    """Schedules from the heuristic: a coordinate search over its switches.

    From the default policy and from 1F1B's warm-up (`inflight=1`), flip one switch at a time and
    keep a flip that lowers the score, until none does. Returns every schedule tried, best first.
    """
    if few:
        starts, switches = [Policy(), Policy(b_first=False)], {}
    else:
        starts = [Policy(), Policy(inflight=1)]
        switches = dict(_SWITCHES, **(_V_SWITCHES if len(prob.stages_of[0]) > 1 else {}))
    tried: dict[Policy, tuple[tuple[float, float, float], list[list[int]]]] = {}

    def score(policy: Policy) -> tuple[float, float, float]:
        if policy not in tried:
            orders = list_schedule(prob, policy)
            tried[policy] = (Timeline(prob, orders).score(), orders)
        return tried[policy][0]

    for policy in starts:
        best = score(policy)
        improved = True
        while improved:
            improved = False
            for name, values in switches.items():
                for value in values:
                    other = replace(policy, **{name: value})
                    if other != policy and score(other) < best:
                        policy, best, improved = other, score(other), True
    return [orders for _, orders in sorted(tried.values(), key=lambda x: x[0])]


def _peak(prob: Problem, orders: Sequence[Sequence[int]]) -> float:
    delta = prob.memory_deltas()
    peak = 0.0
    for order in orders:
        mem = 0.0
        for t in order:
            mem += delta[t]
            peak = max(peak, mem)
    return peak


def _skeleton(prob: Problem, schedule: Schedule) -> list[list[int]]:
    """`schedule`'s F/B order as ints, a full backward (BW) read as its B."""
    out = []
    for order in schedule.orders:
        out.append([prob.task(Kind.B if a.kind is Kind.BW else a.kind, a.stage, a.microbatch) for a in order if a.kind is not Kind.W])
    return out


def _search(
    name: str,
    placement: Sequence[int],
    m: int,
    costs: Costs | None,
    memory: Memory | None,
    memory_limit: float | None,
    seeds: Sequence[str],
) -> Schedule:
    costs = costs if costs is not None else Costs()
    memory = memory if memory is not None else Memory()
    p = max(placement) + 1
    floor = smallest_feasible_limit(placement, memory)
    if memory_limit is None:
        limit = p * floor  # 1F1B's (and ZB-V's) activation memory
    else:
        limit = as_number(memory_limit, f"{name}: memory_limit (per rank, in Memory's units)")
        if limit < floor * (1 - 1e-9):
            raise ValueError(
                f"{name}: memory_limit={limit:g} is infeasible; the smallest feasible limit is {floor:g} "
                f"(a rank holds all its stages' activations of one microbatch at once)"
            )
    prob = Problem.make(placement, m, costs, memory, limit)
    tasks = 3 * len(placement) * m
    few = tasks > _MANY_TASKS

    greedy = _heuristic(prob, few=few)
    candidates = list(greedy)
    skeletons = greedy[:1] if few else greedy[:4]
    for seed in seeds:  # from the most memory to the least
        sched = build(seed, num_ranks=p, num_microbatches=m)
        encoded = prob.encode(sched)
        fits = encoded is not None and _peak(prob, encoded) <= limit * (1 + 1e-9)
        if fits:
            candidates.append(encoded)
        skeletons.append(_skeleton(prob, sched))
        if few and fits:
            break  # on large instances, the first handcrafted schedule that fits is enough
    for skeleton in skeletons:
        for always in (False,) if few else (False, True):
            try:
                candidates.append(place_w(prob, skeleton, always=always))
            except ValueError:  # this F/B order needs more memory than the limit, whatever the W's
                pass

    scored = sorted(((Timeline(prob, c).score(), i) for i, c in enumerate(candidates)))
    best = candidates[scored[0][1]]
    best = improve(prob, best, budget=max(_MIN_BUDGET, _BUDGET_PER_TASK * tasks))
    if _peak(prob, best) > limit * (1 + 1e-9):  # pragma: no cover - every step keeps the limit
        raise RuntimeError(f"{name}: the search exceeded memory_limit={limit:g}; please report")
    return from_orders(name, placement, m, prob.decode(best))


_ZB_SEEDS = ("zb-h2", "zb-h1", "1f1b")
_ZBV_SEEDS = ("zb-v", "dualpipe-v", "v-half", "v-min")


@register("zb-auto")
def zb_auto(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs | None = None,
    memory: Memory | None = None,
    memory_limit: float | None = None,
) -> Schedule:
    """An automatic zero-bubble schedule, one stage per rank, for `costs` within `memory_limit`.

    `memory_limit` is per rank, in the units of `memory` (default: p times a stage's activation,
    1F1B's memory). Raises `ValueError` if the limit is below the smallest feasible one.

    >>> from zbpp.schedules import build, Costs, Memory
    >>> build("zb-auto", num_ranks=4, num_microbatches=8, memory=Memory(1, 0.5), memory_limit=0.5)
    Traceback (most recent call last):
    ValueError: zb-auto: memory_limit=0.5 is infeasible; the smallest feasible limit is 1 (a rank holds all its stages' activations of one microbatch at once)
    """
    return _search("zb-auto", loop_placement(num_ranks), num_microbatches, costs, memory, memory_limit, _ZB_SEEDS)


@register("zbv-auto")
def zbv_auto(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs | None = None,
    memory: Memory | None = None,
    memory_limit: float | None = None,
) -> Schedule:
    """An automatic V-shape schedule (2p stages; rank r holds r and 2p-1-r) within `memory_limit`.

    Costs and memory are per V stage; `memory_limit` is per rank (default: p times a rank's two
    stages' activations, ZB-V's and 1F1B's memory). Raises `ValueError` below the smallest
    feasible limit.

    >>> from zbpp.schedules import build, simulate, Costs, Memory
    >>> costs = Costs(f=1, b=1, w=2)  # W twice F: ZB-V's fixed W slots leave bubbles
    >>> res = simulate(build("zbv-auto", num_ranks=4, num_microbatches=12, costs=costs), costs)
    >>> res.bubble_rate < simulate(build("zb-v", num_ranks=4, num_microbatches=12), costs).bubble_rate
    True
    """
    return _search("zbv-auto", v_placement(num_ranks), num_microbatches, costs, memory, memory_limit, _ZBV_SEEDS)
