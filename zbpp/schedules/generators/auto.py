"""Automatic schedules: `zb-auto` (one stage per rank), `zbv-auto` (V placement) and `zbi-auto`
(interleaved: `chunks` stages per rank).

Given per-stage costs (F, B, W and comm may all differ), a memory model and a per-rank memory
limit, the search keeps the best schedule of several constructions (lowest cost, i.e. longest
rank span; then makespan, sum of spans, sum of task ends):

1. the zero-bubble paper's round heuristic (`rounds`) under every setting of its switches, where
   it applies (one stage per rank; on a V, from ZB-V's memory up; not on interleaved placements):
   as good as the authors' own implementation of it, by construction;
2. the first handcrafted schedule of the placement that fits, from the most memory down (ZB-H2,
   ZB-H1, 1F1B; ZB-V, DualPipeV, V-Half, V-Min; zb-interleaved, interleaved 1F1B), so the result
   is never worse than it either;
3. an event-driven list scheduler (`auto_heuristic.list_schedule`), with a policy or two;
4. the F/B order of the best so far with its W's placed anew where they fill idle time
   (`auto_heuristic.place_w`);
5. local search on the best (`local_search.improve`), with incremental re-simulation; on tiny
   instances (the exact solver's sizes) an iterated local search that kicks it out of local
   optima.

The memory limit (one number, or one per rank; inf: none on that rank) holds by construction (admission in the
heuristics, checks on every move) and is checked again on the result. A limit below the smallest
feasible one (`smallest_feasible_limit`: a rank must hold all its stages' activations of one
microbatch at once, and what its B's and transients add: the least peak of any schedule) raises
a `ValueError` that names it. A
limit at or above it but below what the searches plan on (each stage at ``max(activation,
wgrad)`` from its F on, the rank's largest transient throughout) gets the best of the
handcrafted schedules and one microbatch at a time that fit it.

The search's work is counted in simulated tasks, not seconds, so the result is deterministic,
and it builds no slower than the authors' implementation of the paper's heuristic alone (step 1
runs a switch setting only where its result can differ from one already run): where the round
heuristic applies, step 3 runs only on V's of up to 1,500 tasks and step 5 on instances of up to
6,000 (beyond, on the papers' profiles, they never beat steps 1 and 2), step 4 not at all (the
heuristic places its W's as well); where it does not, all steps run. A schedule without bubble
ends the search at once. p = 32, m = 256 on a V builds in well under a second.
`zbpp.schedules.bounds` says how far any result can be from the best possible;
`zbpp.schedules.exact` finds that best for small cases.

>>> from zbpp.schedules import build, simulate, Costs, Memory
>>> costs, memory = Costs(f=1, b=1, w=1), Memory(activation=1, wgrad=1/3)
>>> s = build("zb-auto", num_ranks=4, num_microbatches=8, costs=costs, memory=memory, memory_limit=8)
>>> res = simulate(s, costs, memory)
>>> res.bubble_rate, max(res.peak_memory) <= 8
(0.0, True)
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Callable, Sequence

from ..bounds import least_peak_orders, least_peaks
from ..checks import as_int, as_number
from ..ir import Action, Kind, Schedule, from_orders, loop_placement, v_placement
from ..simulate import Costs, Memory, check_costs_memory, simulate
from .auto_heuristic import Policy, Problem, list_schedule, place_w
from .classic import interleaved_1f1b, one_f_one_b
from .interleaved_zb import zb_interleaved
from .dualpipe import _tasks as _dualpipe_tasks, dualpipe_v
from .local_search import TaskShape, improve, perturb_and_improve, score_of
from .rounds import best_v_rounds, best_zb_rounds
from .vshape import _v_tasks, _zbv_tasks as _zb_v_tasks, v_half, v_min, v_stages, zb_v
from .zero_bubble import zb_h1, zb_h2

__all__ = ["zb_auto", "zbv_auto", "zbi_auto", "smallest_feasible_limit", "default_memory_limit"]

#: Where the round heuristic applies, the local search runs up to this many tasks, and the list
#: scheduler beside it on V's up to `_TINY` (each is a pass or more over all tasks; beyond, they
#: have not paid off, and the search must stay about as fast as the paper's heuristic alone).
_SMALL = 6_000
_TINY = 1_500
#: Local-search budget in passes over the schedule (re-simulated tasks / tasks): small instances.
_SMALL_BUDGET = 2
#: Up to this many tasks an iterated local search runs instead, with this budget in passes.
_ILS_TASKS = 60
_ILS_BUDGET = 300


def smallest_feasible_limit(placement: Sequence[int], memory: Memory) -> float:
    """The least per-rank memory limit that some schedule of `placement` meets (`bounds.least_peaks`).

    A rank holds the activations of all its stages for a microbatch at once (the F of its last
    stage runs before the B of its first), and while a stage's B or W of that microbatch runs the
    rank still holds what its other stages keep of it: B's delta where wgrad > activation and each
    task's transient (`Memory`) come on top. One microbatch at a time, each W where it peaks least
    (`bounds.least_peak_orders`), needs exactly that.

    >>> from zbpp.schedules.ir import v_placement
    >>> smallest_feasible_limit(v_placement(4), Memory(activation=1, wgrad=0.5))
    2.0
    >>> smallest_feasible_limit(v_placement(4), Memory(activation=1, wgrad=2))  # B of the upper stage: 1 + 2
    3.0
    """
    return max(least_peaks(placement, memory))


def _one_at_a_time(placement: Sequence[int], m: int, memory: Memory) -> Schedule:
    """One microbatch at a time, each in the order of least peak: the least memory (`bounds.least_peak_orders`)."""
    orders = [[Action(a.kind, a.stage, j) for j in range(m) for a in order] for order in least_peak_orders(placement, memory)]
    return from_orders("one-at-a-time", placement, m, orders)


_WHY_FLOOR = ("the least peak of any schedule: a rank holds all its stages' activations of one microbatch at once, "
              "with what a B adds where wgrad > activation and each task's transient")


def _limit(value: object, what: str) -> float:
    """One rank's limit: a finite number >= 0, or inf for no limit (as `bounds.lower_bound` reads it)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and value == math.inf:
        return math.inf
    return as_number(value, what)


def _limits(name: str, memory_limit: float | Sequence[float], floors: Sequence[float]) -> list[float]:
    """Each rank's limit: `memory_limit` (one number, or one per rank; inf: none) checked against `floors`."""
    p = len(floors)
    what = f"{name}: memory_limit (per rank, in Memory's units; inf: no limit)"
    if isinstance(memory_limit, numbers.Real):
        limit = _limit(memory_limit, what)
        if limit < max(floors) * (1 - 1e-9):
            raise ValueError(
                f"{name}: memory_limit={limit:g} is infeasible; the smallest feasible limit is {max(floors):g} "
                f"({_WHY_FLOOR})"
            )
        return [limit] * p
    limits = [_limit(x, f"{what}[{r}]") for r, x in enumerate(memory_limit)]
    if len(limits) != p:
        raise ValueError(f"{name}: memory_limit has {len(limits)} values for {p} ranks; give one number or one per rank")
    for r, (limit, floor) in enumerate(zip(limits, floors)):
        if limit < floor * (1 - 1e-9):
            raise ValueError(
                f"{name}: memory_limit[{r}]={limit:g} is infeasible; rank {r} needs at least {floor:g} "
                f"({_WHY_FLOOR})"
            )
    return limits


def _planned(memory: Memory, num_stages: int) -> Memory:
    """The kept bytes the searches plan on: B re-creates what W keeps (recompute, offload), so
    each stage counts as if F held ``max(activation, wgrad)`` from the start, never below the
    true use, and a plan within a limit stays within it. (Transients are handled apart.)"""
    act, wgrad = memory.per_stage(num_stages)
    return Memory(activation=[max(a, w) for a, w in zip(act, wgrad)], wgrad=wgrad)


def default_memory_limit(placement: Sequence[int], memory: Memory) -> float:
    """The per-rank limit `zb-auto`, `zbv-auto` and `zbi-auto` use when given none: p times the
    most one microbatch needs on a rank, each stage counted at ``max(activation, wgrad)`` as the
    search plans it; where wgrad <= activation, 1F1B's (and ZB-V's) activation memory.

    >>> from zbpp.schedules.ir import loop_placement
    >>> default_memory_limit(loop_placement(4), Memory(activation=1, wgrad=0.5))
    4.0
    >>> default_memory_limit(loop_placement(2), Memory(activation=1, wgrad=[0, 2]))  # stage 1 plans at 2
    4.0
    """
    # the search's own default: a bound or report taken at any smaller limit would not hold for it
    return (max(placement) + 1) * smallest_feasible_limit(placement, _planned(memory, len(placement)))


#: List-scheduler policies (see `Policy`), the most useful first: on a V, the one that most often
#: beat the others on random profiles (ready F's before ready B's, W's into any wait).
_ZB_POLICIES = (Policy(),)
_V_POLICIES = (Policy(b_first=False, always_fill=True), Policy())


def _fits(prob: Problem, orders: Sequence[Sequence[int]]) -> bool:
    """Whether every rank's memory stays within its limit (with a relative 1e-9 for rounding)."""
    delta = prob.memory_deltas
    for order, limit in zip(orders, prob.limits):
        mem = 0.0
        for t in order:
            mem += delta[t]
            if mem > limit * (1 + 1e-9):
                return False
    return True


def _skeleton(prob: Problem, schedule: Schedule) -> list[list[int]]:
    """`schedule`'s F/B order as ints, a full backward (BW) read as its B."""
    out = []
    for order in schedule.orders:
        out.append([prob.ids.id(Kind.B if a.kind is Kind.BW else a.kind, a.stage, a.microbatch) for a in order if a.kind is not Kind.W])
    return out


def _split_bw(schedule: Schedule) -> Schedule:
    """`schedule` with each full backward (BW) as its B then its W: no later times (W takes its
    input from B on the same rank; the gradient leaves after B) and the same peak (a BW's
    transient is B's delta then W's)."""
    orders = [[x for a in order for x in ((Action(Kind.B, a.stage, a.microbatch), Action(Kind.W, a.stage, a.microbatch))
                                          if a.kind is Kind.BW else (a,))] for order in schedule.orders]
    return from_orders(schedule.name, schedule.placement, schedule.num_microbatches, orders)


def _search(
    name: str,
    placement: Sequence[int],
    m: int,
    costs: Costs | None,
    memory: Memory | None,
    memory_limit: float | Sequence[float] | None,
    seeds: Sequence[Callable[[int, int], Schedule]],
) -> Schedule:
    check_costs_memory(name, costs, memory)
    costs = (costs if costs is not None else Costs()).charged(placement)
    # every time of any schedule is at most all task times plus all message times: finite sums
    # keep the searches' arithmetic finite (inf - inf is nan, and nothing ever fits or ends)
    f, b, w = costs.per_stage(len(placement))
    total = m * (sum(f) + sum(b) + sum(w)) + 2 * m * len(placement) * costs.comm
    if not math.isfinite(total):
        raise ValueError(f"{name}: the costs are too large: the step's task and message times sum to {total}, "
                         "beyond a float; give them in a larger unit")
    memory = memory if memory is not None else Memory()
    true_memory = memory
    p = max(placement) + 1
    # a task's transient comes on top of the kept bytes the search plans on: each rank plans
    # within its limit less its stages' largest (a limit, not the default, is a peak to respect)
    top = [0.0] * p
    for s, t in enumerate(memory.transients(len(placement))):
        top[placement[s]] = max(top[placement[s]], *t[:3])  # F, B, W: these schedules run no BW
    memory = _planned(memory, len(placement))
    if memory_limit is None:  # one definition, so that reports and bounds use the limit kept here
        limits = [default_memory_limit(placement, memory)] * p
        peaks_within, true_memory = limits, true_memory.without_transients()  # the default ignores transients
    else:
        peaks_within = _limits(name, memory_limit, least_peaks(placement, true_memory))
        limits = [x - t for x, t in zip(peaks_within, top)]
    prob = Problem.make(placement, m, costs, memory, limits)
    shape = TaskShape(prob)
    planned_floors = least_peaks(placement, memory)  # no transients: each W right after its B
    if any(x < f * (1 - 1e-9) for x, f in zip(limits, planned_floors)):
        # feasible, but below what the searches plan on (each stage at max(activation, wgrad) and
        # the rank's largest transient throughout): the seeds and one at a time, as `simulate` counts
        return _tightest(name, prob, shape, seeds, costs, true_memory, peaks_within)
    tasks = 3 * len(placement) * m
    small = tasks <= _SMALL
    pool: list[tuple[tuple[float, ...], list[list[int]]]] = []

    def add(orders: list[list[int]]) -> None:
        pool.append((score_of(shape, orders), orders))

    # 1. the paper's round heuristic under every setting of its switches; the best (ties too)
    v_shape = tuple(placement) != loop_placement(p)  # several stages per rank (a V, or interleaved)
    if not v_shape:
        rounds = best_zb_rounds(prob)
    else:  # the round heuristic knows one stage per rank and the V
        rounds = best_v_rounds(prob) if tuple(placement) == v_placement(p) else []
    for cost, orders in rounds[:2]:
        if cost <= rounds[0][0] * (1 + 1e-9):
            add(orders)
    busy = max(sum((prob.f[s] + prob.b[s] + prob.w[s]) * m for s in st) for st in prob.stages_of)
    if pool:
        score, orders = min(pool, key=lambda x: x[0])
        if score[0] <= busy * (1 + 1e-12):  # no bubble: nothing can do better
            return from_orders(name, placement, m, prob.decode(orders))
    # 2. the first handcrafted schedule that fits, from the most memory down; if none fits, the
    #    F/B order of the first goes to step 4, which may fit it with earlier W's. Every seed
    #    within the limits as `simulate` counts them (each backward split; where wgrad >
    #    activation the planned memory overstates what a B that its W follows at once holds,
    #    1F1B's BW) is kept apart, the fastest of them: the searches need the planned model, but
    #    the result is never slower than a handcrafted schedule that fits (on large instances, and
    #    V's of m < 2p, one up to the first that fits: the rest would take longer to build than
    #    the search)
    skeletons = []
    built = []  # the seeds not in the pool
    for i, seed in enumerate(seeds):
        sched = seed(p, m)
        encoded = prob.encode(sched)
        if encoded is not None and _fits(prob, encoded):
            add(encoded)
            skeletons = []
            if small and (tuple(placement) != v_placement(p) or m >= 2 * p):  # (ZB-V and DualPipeV
                built += [later(p, m) for later in seeds[i + 1:]]  # are built for >= 2p microbatches)
            break
        built.append(sched)
        if not skeletons and not rounds:  # (step 4 runs only without the round heuristic)
            skeletons.append(_skeleton(prob, sched))
    fallback: tuple[tuple[float, ...], list[list[int]]] | None = None
    for sched in built:
        if all(x <= y * (1 + 1e-9) for x, y in zip(simulate(sched, costs, true_memory).peak_memory, peaks_within)):
            split = prob.encode(_split_bw(sched))
            if split is not None and (fallback is None or score_of(shape, split) < fallback[0]):
                fallback = (score_of(shape, split), split)
    # 3. the event-driven list scheduler: where the round heuristic cannot meet the limit (one
    #    policy on large instances), and beside it on tiny V's (where it pays off)
    policies = _V_POLICIES if v_shape else _ZB_POLICIES
    if not rounds:
        for policy in policies if small else policies[:1]:
            add(list_schedule(prob, policy))
    elif v_shape and tasks <= _TINY:
        add(list_schedule(prob, policies[0]))

    def done(orders: list[list[int]]) -> Schedule:
        if fallback is not None and fallback[0] < score_of(shape, orders):
            orders = fallback[1]
        return from_orders(name, placement, m, prob.decode(orders))

    best = min(pool, key=lambda x: x[0])[1]
    if rounds and not small:  # on large instances steps 4 and 5 have not beaten steps 1 and 2
        return done(best)
    # 4. W's placed anew in the F/B order of the best so far, where the round heuristic does not
    #    apply (where it does, its own W placement has always been as good)
    if not rounds:
        nm2 = 2 * len(placement) * m
        skeletons.insert(0, [[t for t in o if t < nm2] for o in best])
        for skeleton in skeletons:
            for always in (False, True) if small else (False,):
                try:
                    add(place_w(prob, skeleton, always=always))
                except ValueError:  # this F/B order needs more memory than the limit, whatever the W's
                    pass
    # 5. local search on the best
    best = min(pool, key=lambda x: x[0])[1]
    if tasks <= _ILS_TASKS:  # as small as the exact solver's cases: kicks out of local optima
        best = perturb_and_improve(prob, best, budget=_ILS_BUDGET * tasks, shape=shape)
    else:
        best = improve(prob, best, budget=(_SMALL_BUDGET if small else 1) * tasks, shape=shape)
    if not _fits(prob, best):  # pragma: no cover - every step keeps the limits
        raise RuntimeError(f"{name}: the search exceeded memory_limit={prob.limits}; please report")
    return done(best)


def _tightest(name: str, prob: Problem, shape: TaskShape, seeds: Sequence[Callable[[int, int], Schedule]],
              costs: Costs, memory: Memory, peaks_within: Sequence[float]) -> Schedule:
    """The best of the seeds and one microbatch at a time (each backward split) whose peaks, as
    `simulate` counts them, stay within `peaks_within`; a `ValueError` if none does."""
    p, m, placement = prob.num_ranks, prob.num_microbatches, prob.placement
    best: tuple[tuple[float, ...], list[list[int]]] | None = None
    one = _one_at_a_time(placement, m, memory)
    for sched in [_split_bw(seed(p, m)) for seed in seeds] + [one]:
        orders = prob.encode(sched)
        if orders is None or not all(x <= y * (1 + 1e-9) for x, y in zip(simulate(sched, costs, memory).peak_memory,
                                                                          peaks_within)):
            continue
        score = score_of(shape, orders)
        if best is None or score < best[0]:
            best = (score, orders)
    if best is None:  # pragma: no cover - one at a time peaks at `smallest_feasible_limit`, which `_limits` checked
        raise ValueError(f"{name}: no schedule found within memory_limit={list(peaks_within)}; one microbatch at a "
                         f"time peaks at {simulate(one, costs, memory).peak_memory}")
    return from_orders(name, placement, m, prob.decode(best[1]))


_ZB_SEEDS = (zb_h2, zb_h1, one_f_one_b)
_ZBV_SEEDS = (zb_v, dualpipe_v, v_half, v_min)


def zb_auto(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs | None = None,
    memory: Memory | None = None,
    memory_limit: float | Sequence[float] | None = None,
) -> Schedule:
    """An automatic zero-bubble schedule, one stage per rank, for `costs` within `memory_limit`.

    `memory_limit` is per rank, in the units of `memory`: one number, or one per rank (ranks
    whose other memory differs), a peak that counts each task's transient (`Memory`); inf: no limit
    on that rank; default (None) `default_memory_limit`: p times a stage's activation, 1F1B's
    memory, where wgrad <= activation.
    Raises `ValueError` if a rank's limit is below the smallest feasible one.

    >>> from zbpp.schedules import build, Costs, Memory
    >>> build("zb-auto", num_ranks=4, num_microbatches=8, memory=Memory(1, 0.5), memory_limit=0.5)
    Traceback (most recent call last):
    ValueError: zb-auto: memory_limit=0.5 is infeasible; the smallest feasible limit is 1 (the least peak of any schedule: a rank holds all its stages' activations of one microbatch at once, with what a B adds where wgrad > activation and each task's transient)
    """
    return _search("zb-auto", loop_placement(num_ranks), num_microbatches, costs, memory, memory_limit, _ZB_SEEDS)


def zbv_auto(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs | None = None,
    memory: Memory | None = None,
    memory_limit: float | Sequence[float] | None = None,
) -> Schedule:
    """An automatic V-shape schedule (2p stages; rank r holds r and 2p-1-r) within `memory_limit`.

    Costs and memory are per V stage; `memory_limit` is per rank (default `default_memory_limit`:
    p times a rank's two stages' activations, ZB-V's and 1F1B's memory, where wgrad <= activation).
    Raises `ValueError` below the smallest feasible limit.

    >>> from zbpp.schedules import build, simulate, Costs, Memory
    >>> costs = Costs(f=1, b=1, w=2)  # W twice F: ZB-V's fixed W slots leave bubbles
    >>> res = simulate(build("zbv-auto", num_ranks=4, num_microbatches=12, costs=costs), costs)
    >>> res.bubble_rate < simulate(build("zb-v", num_ranks=4, num_microbatches=12), costs).bubble_rate
    True
    """
    return _search("zbv-auto", v_placement(num_ranks), num_microbatches, costs, memory, memory_limit, _ZBV_SEEDS)


def zbi_auto(
    num_ranks: int,
    num_microbatches: int,
    *,
    chunks: int = 2,
    costs: Costs | None = None,
    memory: Memory | None = None,
    memory_limit: float | Sequence[float] | None = None,
) -> Schedule:
    """An automatic interleaved schedule (rank r holds stages r, r+p, ..., `chunks` of them)
    within `memory_limit`, never slower than `zb-interleaved` where that fits the limit.

    Costs and memory are per stage; `memory_limit` is per rank (default `default_memory_limit`:
    p times a rank's stages' activations, where wgrad <= activation). Raises `ValueError` below the
    smallest feasible limit.

    >>> from zbpp.schedules import build, simulate, Costs, Memory
    >>> costs, memory = Costs(1, 1, 1), Memory(1, 1 / 3)
    >>> fixed = simulate(build("zb-interleaved", num_ranks=4, num_microbatches=8), costs, memory)
    >>> auto = simulate(build("zbi-auto", num_ranks=4, num_microbatches=8, memory=memory, memory_limit=16), costs, memory)
    >>> fixed.bubble_rate > 0, auto.bubble_rate, max(auto.peak_memory) <= 16
    (True, 0.0, True)
    """
    k = as_int(chunks, "zbi-auto: chunks")
    seeds = (functools.partial(zb_interleaved, chunks=k), functools.partial(interleaved_1f1b, chunks=k))
    return _search("zbi-auto", loop_placement(num_ranks, k), num_microbatches, costs, memory, memory_limit, seeds)


def _zbi_tasks(p: int, m: int, *, chunks: int = 2, **_: object) -> int:
    return 3 * p * as_int(chunks, "zbi-auto: chunks") * m


def _zbi_stages(p: int, *, chunks: int = 2, **_: object) -> int:
    return p * as_int(chunks, "zbi-auto: chunks")


def _zbv_tasks(p: int, m: int, **_: object) -> int:
    """The most any of its seeds builds: ZB-V and DualPipeV are built for at least 2p-1 and 2p
    microbatches, then cut down to m (with m = 1 some 2p times the tasks the search returns)."""
    return max(_zb_v_tasks(p, m), _dualpipe_tasks(p, m), _v_tasks(p, m))


#: The schedules of this module, for the registry: name -> (generator, task count or None for
#: the registry's default[, stage count]; see `zbpp.schedules.registry.register`)
GENERATORS = {"zb-auto": (zb_auto, None), "zbv-auto": (zbv_auto, _zbv_tasks, v_stages),
              "zbi-auto": (zbi_auto, _zbi_tasks, _zbi_stages)}
