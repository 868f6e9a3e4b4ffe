"""The exact optimum for small cases: a mixed-integer program solved by HiGHS (`scipy.optimize.milp`).

Needs scipy >= 1.9 (``pip install "zbpp[exact]"``); zbpp imports it only when this module's
`optimal_schedule` runs. It is a reference for the tests and for studying small pipelines: the
time grows quickly with the number of tasks per rank (a few seconds for about 30, e.g. p = 3,
m = 4 with one stage per rank or p = 2, m = 3 on a V).

The model, for a placement, microbatch count, costs, memory model and per-rank limit:

- a start time S_x for every F, B and W task and the makespan C >= S_x + d_x for the last W of
  every stage; minimise C;
- S_x >= S_y + d_y (+ comm across ranks) along every edge of `zbpp.schedules.bounds`' task graph:
  the data edges, each (kind, stage) in microbatch order (no loss: see that module's docstring)
  and the memory edges it derives from the limit;
- for every two tasks x, y of one rank that the graph does not already order, a binary
  z_xy (x runs first) with S_y >= S_x + d_x - M (1 - z_xy) and S_x >= S_y + d_y - M z_xy;
- for every task of a rank that can raise its memory (an F; a B where wgrad > activation; any
  task with a transient), the larger of its change and its transient plus the change of every
  task of the rank that runs before it (ordered by the graph, or by z) stays within the limit:
  the simulator's peak, so the schedule found is within the limit as `simulate` counts it.

A rank's order is that of its start times; running each order as early as possible (what
`simulate` does) never ends later, so the optimum of this program is the least makespan of any
schedule. `zbpp.schedules.bounds.lower_bound` bounds C from below and a known schedule from above
(`start`), which keeps the big-M constants small and lets HiGHS prune early.

>>> from zbpp.schedules import Costs, Memory, build, simulate
>>> from zbpp.schedules.ir import loop_placement
>>> opt = optimal_schedule(loop_placement(2), 3, Costs(1, 1, 1), Memory(1, 1), memory_limit=2)
>>> opt.proven, opt.makespan, simulate(opt.schedule, Costs(1, 1, 1)).makespan
(True, 10.0, 10.0)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Sequence

from .bounds import _Graph, _per_rank, lower_bound
from .ir import Action, Kind, Schedule, from_orders
from .simulate import Costs, Memory, simulate

__all__ = ["Optimum", "optimal_schedule"]


@dataclass(frozen=True)
class Optimum:
    """What `optimal_schedule` found.

    Attributes:
        schedule: the best schedule found (split backward, each rank's order as HiGHS chose it).
        makespan: its simulated makespan.
        lower: no schedule has a makespan below this (== makespan when `proven`).
        proven: True if HiGHS proved `schedule` optimal within the time limit.
    """

    schedule: Schedule
    makespan: float
    lower: float
    proven: bool


def _closure(num: int, preds: list[list[tuple[int, float]]], order: list[int]) -> list[int]:
    """Per task, the set of its ancestors in the graph as a bitmask (Python int)."""
    anc = [0] * num
    for x in order:
        mask = 0
        for y, _ in preds[x]:
            mask |= anc[y] | (1 << y)
        anc[x] = mask
    return anc


def _seconds(time_limit: Any) -> float:
    """`time_limit` checked: HiGHS only warns of a negative one ("Invalid option value") and runs
    unbounded, which is not what was asked."""
    if isinstance(time_limit, Real) and not isinstance(time_limit, bool) and float(time_limit) > 0:
        return float(time_limit)
    raise ValueError(f"optimal_schedule: time_limit must be a number of seconds > 0 (math.inf: no limit), "
                     f"got {time_limit!r}")


def optimal_schedule(
    placement: Sequence[int],
    num_microbatches: int,
    costs: Costs | None = None,
    memory: Memory | None = None,
    memory_limit: float | Sequence[float] | None = None,
    *,
    start: Schedule | None = None,
    time_limit: float = 60.0,
) -> Optimum:
    """The schedule of least makespan for `placement` (see the module docstring for the model).

    `start`, a valid split-backward schedule within the limit, bounds the search from above (by
    default `zb-auto` or `zbv-auto` when the placement is theirs, else a one-microbatch-at-a-time
    schedule). `time_limit` is in seconds; when it runs out, the best schedule found comes back
    with `proven=False` and HiGHS's lower bound. Stages may differ in costs and memory, and
    `memory_limit` may be one number per rank (see `zbpp.schedules.bounds.lower_bound`). Raises
    `ImportError` without scipy.
    """
    limit_s = _seconds(time_limit)
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array
    except ImportError as exc:  # pragma: no cover - scipy is in the test extra
        raise ImportError('optimal_schedule needs scipy >= 1.9: pip install "zbpp[exact]"') from exc

    costs = (costs if costs is not None else Costs()).charged(placement)
    memory = memory if memory is not None else Memory()
    m, n = num_microbatches, len(placement)
    p = max(placement) + 1
    bound = lower_bound(placement, m, costs, memory, memory_limit)  # also checks the limit
    limits = _per_rank(memory_limit, max(placement) + 1)
    g = _Graph(placement, m, costs, memory, limits)
    nm, num = g.nm, 3 * g.nm
    dur, preds, rank_of = g.dur, g.preds, g.rank
    delta = g.ids.per_task(list(zip(*memory.deltas(n)))[:3])  # F, B, W
    transient = g.ids.per_task(list(zip(*memory.transients(n)))[:3])

    if start is None:
        start = _default_start(placement, m, costs, memory, memory_limit)
    ub = simulate(start, costs, memory).makespan
    head = g.heads_from(0)
    tail = g.tails()
    anc = _closure(num, preds, g.order)
    tasks_of: list[list[int]] = [[] for _ in range(p)]
    for x in range(num):
        tasks_of[rank_of[x]].append(x)

    # variables: S_0..S_{num-1}, C, then one binary per unordered pair of a rank
    pairs: list[tuple[int, int]] = []
    for xs in tasks_of:
        for i, x in enumerate(xs):
            for y in xs[i + 1 :]:
                if not (anc[y] >> x) & 1 and not (anc[x] >> y) & 1:
                    pairs.append((x, y))
    pair_index = {pq: num + 1 + k for k, pq in enumerate(pairs)}
    nvar = num + 1 + len(pairs)
    c_var = num
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(coefs: list[tuple[int, float]], low: float, high: float) -> None:
        r = len(lo)
        for col, v in coefs:
            rows.append(r)
            cols.append(col)
            vals.append(v)
        lo.append(low)
        hi.append(high)

    inf = np.inf
    for x in range(num):
        for y, wt in preds[x]:
            row([(x, 1.0), (y, -1.0)], wt, inf)
    for s in range(n):
        last_w = 2 * nm + s * m + m - 1
        row([(c_var, 1.0), (last_w, -1.0)], dur[last_w], inf)
    # Energy on one rank: a task's ancestors on its rank run before it, its descendants there
    # after it, one at a time.
    for xs in tasks_of:
        for x in xs:
            before = sum(dur[y] for y in xs if (anc[x] >> y) & 1)
            head[x] = max(head[x], before)  # F(s_r, 0) is an ancestor of the rank's tasks: it starts at >= 0
    latest = [ub - dur[x] - tail[x] for x in range(num)]
    for x in range(num):
        after = dur[x] + sum(dur[y] for y in tasks_of[rank_of[x]] if (anc[y] >> x) & 1)
        row([(c_var, 1.0), (x, -1.0)], after, inf)
        latest[x] = min(latest[x], ub - after)
    for (x, y), z in pair_index.items():
        # z = 1: y starts after x ends;  z = 0: x starts after y ends
        big_xy = max(0.0, latest[x] + dur[x] - head[y])
        big_yx = max(0.0, latest[y] + dur[y] - head[x])
        row([(y, 1.0), (x, -1.0), (z, -big_xy)], dur[x] - big_xy, inf)
        row([(x, 1.0), (y, -1.0), (z, big_yx)], dur[y], inf)
    if any(math.isfinite(x) for x in limits):
        for rank, xs in enumerate(tasks_of):
            if not math.isfinite(limits[rank]):
                continue
            for x in xs:
                # what x adds above the memory before it: not only an F's activation but a B's
                # wgrad - activation (wgrad > activation) and any task's transient
                rise = max(delta[x], transient[x])
                if rise <= 0.0:
                    continue  # the memory after x is no more than after the task before it
                constant = rise
                coefs: list[tuple[int, float]] = []
                for y in xs:
                    if y == x or delta[y] == 0.0:
                        continue
                    if (anc[x] >> y) & 1:
                        constant += delta[y]
                    elif (anc[y] >> x) & 1:
                        continue
                    elif (x, y) in pair_index:  # z = 1: x first, so y is not before x
                        constant += delta[y]
                        coefs.append((pair_index[(x, y)], -delta[y]))
                    else:
                        coefs.append((pair_index[(y, x)], delta[y]))
                row(coefs, -inf, limits[rank] - constant)

    a = coo_array((vals, (rows, cols)), shape=(len(lo), nvar)).tocsr()
    lower_b = np.array([head[x] for x in range(num)] + [bound.makespan] + [0.0] * len(pairs))
    upper_b = np.array([max(head[x], latest[x]) for x in range(num)] + [ub] + [1.0] * len(pairs))
    objective = np.zeros(nvar)
    objective[c_var] = 1.0
    integrality = np.zeros(nvar)
    integrality[num + 1 :] = 1
    def solve(presolve: bool):
        return milp(
            objective,
            integrality=integrality,
            bounds=Bounds(lower_b, upper_b),
            constraints=LinearConstraint(a, np.array(lo), np.array(hi)),
            options={"time_limit": limit_s, "mip_rel_gap": 1e-9, "presolve": presolve},
        )

    result = solve(True)
    if result.status == 4:  # HiGHS's presolve fails ("Solve error") on some of these models; without it they solve
        result = solve(False)
    if result.x is None and result.status == 2:  # nothing within the limit: refuse rather than return `start` over it
        peaks = simulate(start, costs, memory).peak_memory
        raise ValueError(f"memory_limit={memory_limit!r}: no schedule within it ends by {ub:g} (the makespan of the start "
                         f"schedule {start.name!r}, whose peaks are {peaks}); with {memory!r} a rank's peak counts its "
                         "tasks' transients and what a B adds where wgrad > activation")
    if result.x is None:  # nothing better than `start` found in time (or `start` is optimal)
        lower = max(bound.makespan, float(getattr(result, "mip_dual_bound", None) or bound.makespan))
        return Optimum(start, ub, min(lower, ub), proven=result.status == 0 or lower >= ub * (1 - 1e-9))
    sol = result.x

    def first(x: int, y: int) -> int:
        if abs(sol[x] - sol[y]) > 1e-6:
            return -1 if sol[x] < sol[y] else 1
        if (anc[y] >> x) & 1:
            return -1
        if (anc[x] >> y) & 1:
            return 1
        if (x, y) in pair_index:
            return -1 if sol[pair_index[(x, y)]] > 0.5 else 1
        return 1 if sol[pair_index[(y, x)]] > 0.5 else -1

    orders = g.ids.decode([sorted(xs, key=functools.cmp_to_key(first)) for xs in tasks_of])
    sched = from_orders("optimal", placement, m, orders)
    found = simulate(sched, costs, memory).makespan
    if found > ub:  # pragma: no cover - HiGHS returns a solution no worse than the bound it was given
        sched, found = start, ub
    proven = result.status == 0
    dual = getattr(result, "mip_dual_bound", None)
    lower = found if proven else max(bound.makespan, float(dual) if dual is not None else bound.makespan)
    return Optimum(sched, found, min(lower, found), proven)


def _default_start(placement: Sequence[int], m: int, costs: Costs, memory: Memory,
                   limit: float | Sequence[float] | None) -> Schedule:
    """A feasible upper bound: the automatic schedule of the placement, else one microbatch at a time
    in the order of least peak (within every limit `lower_bound` lets through)."""
    from .generators.auto import _one_at_a_time, zb_auto, zbv_auto
    from .ir import loop_placement, v_placement

    p = max(placement) + 1
    within = None if limit is None else _per_rank(limit, p)  # inf: no limit on that rank, as here
    try:
        if tuple(placement) == loop_placement(p):
            return zb_auto(p, m, costs=costs, memory=memory, memory_limit=within)
        if tuple(placement) == v_placement(p):
            return zbv_auto(p, m, costs=costs, memory=memory, memory_limit=within)
    except ValueError:  # a limit the searches refuse: one at a time meets every one lower_bound accepts
        pass
    return _one_at_a_time(placement, m, memory)
