"""Lower bounds on the makespan, the longest rank span and the bubble rate of any schedule.

For a placement, microbatch count, costs, memory model and per-rank memory limit, `lower_bound`
returns numbers that no schedule of that placement can beat, whatever its order of F, B and W
(split backward) tasks. They are what `zbpp show` / `zbpp compare` measure automatic schedules
against, and what the tests check the exact solver and the search against.

Why they are bounds
-------------------
*FIFO is no loss.* Microbatches are interchangeable: take any valid schedule and, for every stage
and kind (F, B or W), hand the k-th earliest of its tasks to microbatch k. Each rank still runs
tasks of the same (kind, stage) in the same slots at the same times, so spans, makespan and memory
(which depends only on the (kind, stage) of the tasks run so far) are unchanged. Every data edge
joins two such classes one to one (F(s-1) -> F(s), F(last) -> B(last), B(s+1) -> B(s),
B(s) -> W(s)) with the same lag for every microbatch; the original microbatches are a matching
whose pairs satisfy "starts at least `lag` after the other ends", so the sorted matching does too
(if some bijection pairs every x_i with a y >= x_i + lag, the k-th smallest y is >= the k-th
smallest x + lag). So it suffices to bound schedules that run each (kind, stage) in microbatch
order, and the bound then holds for all.

*The task graph it uses*, on FIFO schedules: the data edges (with `comm` across ranks); each
(kind, stage) in microbatch order; and a memory edge B(t, j) -> F(t, j + k_t). On a rank, a
microbatch in flight in stage t (F done, B not) is also in flight in every stage s <= t of that
rank (F(s, j) precedes F(t, j), B(s, j) follows B(t, j)), and every stage's memory is >= 0; so
after F(t, i), the rank holds at least A_t * (i + 1 - #B(t) done), A_t the activations of the
rank's stages up to t. Within a limit L, F(t, i) therefore waits for B(t, i - k_t),
k_t = floor(L / A_t).

*Heads and tails.* head(x) is the longest path from F(0, 0) (every task depends on it) to x's
start; tail(x) the longest path from x's end to the end of any task. Each rank runs its tasks one
at a time, so the rank's tasks, released at their heads and delivered after their tails, need at
least the optimum of that one-machine problem with preemption allowed, which Jackson's preemptive
rule (run the released task with the longest tail) computes exactly. The largest over ranks bounds
the makespan.

*Spans.* A rank's span starts no later than its first stage's F(s_r, 0); measured from that
start, each of its tasks x cannot start before the longest path from F(s_r, 0) to x. Released at
those relative heads, the rank's work ends no sooner than max_k (r_k + the work released at or
after r_k) after F(s_r, 0) starts; the largest over ranks bounds `cost` (the longest span), and
with it the bubble rate (cost - busy) / cost, since `busy` does not depend on the schedule.

>>> from zbpp.schedules import Costs, Memory, build, simulate
>>> from zbpp.schedules.ir import loop_placement
>>> lb = lower_bound(loop_placement(4), 8, Costs(1, 1, 1), Memory(1, 1 / 3), memory_limit=4)
>>> lb.cost, lb.busy   # at 1F1B's memory no schedule has a span below 27: ZB-H1 is optimal
(27.0, 24.0)
>>> simulate(build("zb-h1", num_ranks=4, num_microbatches=8), Costs(1, 1, 1)).cost
27.0
"""

from __future__ import annotations

import heapq
import math
import numbers
from dataclasses import dataclass
from typing import Sequence

from .checks import MAX_TASKS_ENV, as_int, max_tasks
from .ir import Action, Kind
from .simulate import Costs, Memory, check_costs_memory
from .tasks import TaskIds

__all__ = ["LowerBound", "least_peak_orders", "least_peaks", "lower_bound"]

_EPS = 1e-9


@dataclass(frozen=True)
class LowerBound:
    """What no schedule can beat. Times in the units of `Costs`.

    Attributes:
        makespan: end of the last task minus start of the first.
        cost: the longest rank span (`SimResult.cost`).
        busy: the busiest rank's total task time (the same for every schedule).
    """

    makespan: float
    cost: float
    busy: float

    @property
    def bubble_rate(self) -> float:
        """No schedule has a lower bubble rate (docs/DESIGN.md's (cost - busy) / cost)."""
        return (self.cost - self.busy) / self.cost if self.cost > 0 else 0.0


class _Graph:
    """The FIFO task graph of the module docstring, tasks as ints kind * n*m + stage * m + mb."""

    def __init__(self, placement: Sequence[int], m: int, costs: Costs, memory: Memory,
                 limit: float | Sequence[float]) -> None:
        n = len(placement)
        self.ids = ids = TaskIds(n, m)
        nm = ids.nm
        self.n, self.m, self.nm = n, m, nm
        f, b, w = costs.per_stage(n)
        act, _ = memory.per_stage(n)
        self.placement = list(placement)
        self.dur = ids.per_task([f, b, w])
        self.rank = ids.per_task([placement] * 3)  # per task (F, B, W)
        # memory edges: F(t, j) waits for B(t, j - k[t]); k[t] = m means no edge
        below = [0.0] * n  # A_t: activations of the rank's stages up to t
        held: dict[int, float] = {}
        for s, r in enumerate(placement):
            held[r] = held.get(r, 0.0) + act[s]
            below[s] = held[r]
        k = [m] * n
        limits = _per_rank(limit, max(placement) + 1)
        for s in range(n):
            if below[s] > 0 and math.isfinite(limits[placement[s]]):
                k[s] = max(1, min(m, int(math.floor(limits[placement[s]] / below[s] + _EPS))))
        # predecessors as (task, weight): x may start weight after that task starts
        preds: list[list[tuple[int, float]]] = [[] for _ in range(3 * nm)]
        dur = self.dur
        inputs, lags = ids.inputs(), ids.lags(placement, float(costs.comm))

        def data_edge(x: int) -> tuple[int, float]:  # x's input, which ends (and arrives) before x starts
            d = inputs[x]
            return d, dur[d] + lags[x]

        for s in range(n):
            for j in range(m):
                fj, bj, wj = s * m + j, nm + s * m + j, 2 * nm + s * m + j
                if inputs[fj] >= 0:
                    preds[fj].append(data_edge(fj))
                if j > 0:
                    for y in (fj, bj, wj):
                        preds[y].append((y - 1, dur[y - 1]))
                if j >= k[s]:
                    x = nm + s * m + j - k[s]
                    preds[fj].append((x, dur[x]))
                preds[bj].append(data_edge(bj))
                preds[wj].append(data_edge(wj))
        self.preds = preds
        # a topological order: microbatch by microbatch, F down the stages, B back up, then W
        order = []
        for j in range(m):
            order.extend(s * m + j for s in range(n))
            order.extend(nm + s * m + j for s in range(n - 1, -1, -1))
            order.extend(2 * nm + s * m + j for s in range(n))
        self.order = order

    def heads_from(self, source: int, rank: int | None = None) -> list[float]:
        """Longest path from `source`'s start to each task's start (-inf: not reachable).

        With `rank`, only what leads to that rank's tasks: W's of other ranks' stages lead nowhere
        but to each other, so they are skipped (left at -inf).
        """
        preds = self.preds
        ninf = -math.inf
        head = [ninf] * len(preds)
        head[source] = 0.0
        order = self.order
        ranks, nm2 = self.rank, 2 * self.nm
        for i in range(order.index(source) + 1, len(order)):  # nothing before the source is reachable
            x = order[i]
            if rank is not None and x >= nm2 and ranks[x] != rank:
                continue
            best = ninf
            for y, wt in preds[x]:
                h = head[y] + wt
                if h > best:
                    best = h
            head[x] = best
        return head

    def tails(self, rank: int | None = None) -> list[float]:
        """Longest path from each task's end to the end of the last task that depends on it; with
        `rank`, to the end of a task of that rank (-inf: no path there)."""
        num = len(self.preds)
        dur, preds = self.dur, self.preds
        if rank is None:
            tail = [0.0] * num
        else:
            tail = [0.0 if r == rank else -math.inf for r in self.rank]
        for x in reversed(self.order):
            if tail[x] == -math.inf:
                continue
            tx = dur[x] + tail[x]
            for y, wt in preds[x]:
                # x starts at least wt - dur[y] after y ends, then runs and has its own tail
                v = wt - dur[y] + tx
                if v > tail[y]:
                    tail[y] = v
        return tail


def _jackson_preemptive(release: list[float], dur: list[float], tail: list[float]) -> float:
    """Optimal max(end + tail) of one machine with release dates and preemption (Jackson's rule)."""
    idx = sorted(range(len(release)), key=release.__getitem__)
    heap: list[tuple[float, int, float]] = []  # (-tail, id, remaining)
    t = -math.inf
    best = -math.inf
    i, count = 0, len(idx)
    while i < count or heap:
        if not heap:
            t = max(t, release[idx[i]])
        while i < count and release[idx[i]] <= t + _EPS:
            x = idx[i]
            heapq.heappush(heap, (-tail[x], x, dur[x]))
            i += 1
        neg_tail, x, rem = heapq.heappop(heap)
        nxt = release[idx[i]] if i < count else math.inf
        run = min(rem, nxt - t)
        t += run
        rem -= run
        if rem > _EPS:
            heapq.heappush(heap, (neg_tail, x, rem))
        else:
            best = max(best, t - neg_tail)
    return best


def _released_work(release: list[float], dur: list[float]) -> float:
    """Least time for one machine to run every task from the earliest release on: max over k of
    r_k + the work released at or after r_k (preemptive; no schedule does better)."""
    pairs = sorted(zip(release, dur))
    best, suffix = 0.0, 0.0
    for r, d in reversed(pairs):
        suffix += d
        best = max(best, r + suffix)
    return best


def _per_rank(limit: float | Sequence[float] | None, num_ranks: int) -> list[float]:
    """A memory limit as one number per rank (inf: none); a sequence must have one per rank.

    A NaN is refused: every comparison with it is false, so it read as no limit at all.
    """
    if limit is None:
        return [math.inf] * num_ranks
    if isinstance(limit, numbers.Real):
        return [_limit_value(limit, "memory_limit")] * num_ranks
    limits = [_limit_value(x, f"memory_limit[{r}]") for r, x in enumerate(limit)]
    if len(limits) != num_ranks:
        raise ValueError(f"memory_limit has {len(limits)} values; give one number, or one per rank ({num_ranks})")
    return limits


def _limit_value(value: object, what: str) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value):
        return float(value)
    raise ValueError(f"{what} must be a number (per rank, in the units of memory; inf: no limit), got {value!r}")


def least_peaks(placement: Sequence[int], memory: Memory) -> list[float]:
    """Per rank, the least peak memory of any schedule of `placement`: the smallest feasible limit.

    A schedule's tasks of one microbatch hold, at every point, at least what they would hold run
    alone (the other microbatches' memory is >= 0), and the best order of one microbatch, repeated
    one microbatch at a time, reaches it. In that order F's run up the rank's stages and B's down
    them; only where each W goes is free (`least_peak_orders` gives it). Where no W of the rank has
    a transient it is the peak of each W right after its B.

    >>> from zbpp.schedules.ir import v_placement
    >>> least_peaks(v_placement(2), Memory(activation=1, wgrad=2))  # a rank's upper stage's B: 1 below + 2
    [3.0, 3.0]
    >>> least_peaks([0, 0], Memory(activation=1, wgrad=1, transient_w=10))  # the other stage holds 1 at either W
    [12.0]
    >>> least_peaks([0, 0], Memory(activation=1, wgrad=[0, 1], transient_w=5))  # W1 after B0: 0 + 1 + 5, not 1 + 1 + 5
    [6.0]
    """
    return [peak for peak, _ in _least_peak_orders(placement, memory)]


def least_peak_orders(placement: Sequence[int], memory: Memory) -> list[list[Action]]:
    """Per rank, an order of microbatch 0's tasks that peaks at `least_peaks`.

    >>> least_peak_orders([0, 0], Memory(activation=1, wgrad=[0, 1], transient_w=5))
    [[Action(F0.0), Action(F1.0), Action(B1.0), Action(B0.0), Action(W1.0), Action(W0.0)]]
    """
    return [order for _, order in _least_peak_orders(placement, memory)]


def _least_peak_orders(placement: Sequence[int], memory: Memory) -> list[tuple[float, list[Action]]]:
    n = len(placement)
    act, wgrad = memory.per_stage(n)
    trans = memory.transients(n)
    p = max(placement) + 1
    return [_least_peak_of_rank([s for s in range(n) if placement[s] == r], act, wgrad, trans) for r in range(p)]


def _least_peak_of_rank(stages: list[int], act: list[float], wgrad: list[float],
                        trans: list[tuple[float, float, float, float]]) -> tuple[float, list[Action]]:
    """The least peak of one microbatch on a rank of `stages` (ascending), and an order reaching it.

    Within a limit L, running any W that fits is never worse (it only lowers what later tasks run
    on), so "every W that fits, else the next B" meets L iff some order does. Start L at a lower
    bound; where that fails, no L below the smallest value it found over L behaves otherwise, so
    L rises to it: the first L met is the least peak, exactly (one of the values compared).
    """
    # a lower bound: the F's peaks (the same in every order), and each B and W on what it must find held
    held, floor = 0.0, 0.0
    for s in stages:
        floor = max(floor, held + trans[s][0], held + act[s] + trans[s][1], held + wgrad[s], wgrad[s] + trans[s][2])
        held += act[s]
    limit, top = floor, held
    while True:
        held, order, over = top, [Action(Kind.F, s, 0) for s in stages], math.inf
        pending: list[int] = []
        below = list(reversed(stages))  # the B's still to run, next first
        while True:
            ran = True
            while ran:  # every W that fits now (each one lowers what the others run on)
                ran = False
                for s in list(pending):
                    peak = held + trans[s][2]
                    if peak <= limit:
                        held -= wgrad[s]
                        pending.remove(s)
                        order.append(Action(Kind.W, s, 0))
                        ran = True
                    else:
                        over = min(over, peak)
            if not below:
                break
            s = below[0]
            peak = max(held + trans[s][1], held + wgrad[s] - act[s])
            if peak > limit:
                over = min(over, peak)
                break
            held += wgrad[s] - act[s]
            below.pop(0)
            pending.append(s)
            order.append(Action(Kind.B, s, 0))
        if not below and not pending:
            return limit, order
        limit = over


def lower_bound(
    placement: Sequence[int],
    num_microbatches: int,
    costs: Costs | None = None,
    memory: Memory | None = None,
    memory_limit: float | Sequence[float] | None = None,
) -> LowerBound:
    """Bounds that every split-backward schedule of `placement` meets (see the module docstring).

    Stages may differ in costs and memory (`Costs` and `Memory` per stage). `memory_limit` is per
    rank, in the units of `memory`: one number for every rank, one per rank (uneven stages leave
    ranks different room beside their static memory), or None (no limit). A schedule with full
    backward tasks (BW) is a split one whose W runs right after its B, so the bounds hold for it
    too. Raises `ValueError` below the smallest feasible limit (`least_peaks`: a rank must hold all
    its stages' activations of one microbatch at once), and past `build`'s limit on tasks
    (`zbpp.schedules.checks.max_tasks`; an F, B and W per stage and microbatch).

    >>> from zbpp.schedules.ir import loop_placement
    >>> h, a = 2304, 24  # the zero-bubble paper's 1.5B model, p = 8, m = 24, at ZB-2p's memory
    >>> memory = Memory(activation=34 * h + 5 * a * 1024, wgrad=32 * h)
    >>> lb = lower_bound(loop_placement(8), 24, Costs(18.522, 18.086, 9.337, 0.601), memory, 16 * memory.activation)
    >>> round(lb.bubble_rate, 4)  # the paper's ZB-2p reaches it (its Table 4: 0.0433)
    0.0433
    """
    check_costs_memory("lower_bound", costs, memory)
    placement = [as_int(r, f"placement[{s}]", minimum=0) for s, r in enumerate(placement)]
    m = as_int(num_microbatches, "num_microbatches")
    n = len(placement)
    if n < 1:
        raise ValueError(f"need at least one stage, got placement={placement}")
    # a few numbers per F, B and W task: past what `build` allows, memory runs out before an answer
    if 3 * n * m > max_tasks():
        raise ValueError(f"lower_bound: {n} stages and num_microbatches={m} make {3 * n * m:,} tasks, more than the "
                         f"limit of {max_tasks():,} that build keeps; set the environment variable {MAX_TASKS_ENV} "
                         "to allow more")
    p = max(placement) + 1
    idle = [r for r in range(p) if r not in placement]
    if idle:  # every rank's first stage is looked up below
        raise ValueError(f"placement={placement} leaves rank(s) {idle} without a stage; ranks are 0..{p - 1}")
    costs = (costs if costs is not None else Costs()).charged(placement)
    memory = memory if memory is not None else Memory()
    per_rank = least_peaks(placement, memory)
    limits = _per_rank(memory_limit, p)
    for r in range(p):
        if limits[r] < per_rank[r] * (1 - _EPS):
            one = isinstance(memory_limit, numbers.Real)  # as `_per_rank` reads it (a Fraction, a numpy float)
            where = "" if one else f"[{r}]"
            smallest = max(per_rank) if one else per_rank[r]
            raise ValueError(
                f"memory_limit{where}={limits[r]:g} is infeasible; the smallest feasible limit is {smallest:g} "
                f"(the least peak of any schedule: a rank holds all its stages' activations of one microbatch at once, with what a B adds where "
                f"wgrad > activation and each task's transient)"
            )
    g = _Graph(placement, m, costs, memory, limits)
    tasks_of: list[list[int]] = [[] for _ in range(p)]
    for x, r in enumerate(g.rank):
        tasks_of[r].append(x)
    busy = max(sum(g.dur[x] for x in xs) for xs in tasks_of)

    head = g.heads_from(0)  # F(0, 0)
    tail = g.tails()
    makespan = 0.0
    for xs in tasks_of:
        makespan = max(makespan, _jackson_preemptive([head[x] for x in xs], [g.dur[x] for x in xs], [tail[x] for x in xs]))
    # Rank 0's span starts with F(0, 0): measured from there, rank 0 ends no sooner than any rank's
    # tasks, released at their heads, can end and still reach a task of rank 0 (tails to rank 0).
    tail0 = g.tails(0)
    span0 = 0.0
    for xs in tasks_of:
        ys = [x for x in xs if tail0[x] != -math.inf]
        if ys:
            span0 = max(span0, _jackson_preemptive([head[x] for x in ys], [g.dur[x] for x in ys], [tail0[x] for x in ys]))

    # Spans, from the longest possible first: rel(x) <= head(x) - head(F(s_r, 0)) (a path through
    # F(s_r, 0) is one of those that head(x) maximises over), so a rank whose bound computed with
    # those values cannot exceed the best so far is skipped.
    firsts = [min(s for s in range(n) if placement[s] == r) for r in range(p)]
    ceilings = [_released_work([head[x] - head[firsts[r] * m] for x in xs], [g.dur[x] for x in xs]) for r, xs in enumerate(tasks_of)]
    cost = max(busy, span0)
    for r in sorted(range(p), key=lambda q: -ceilings[q]):
        if ceilings[r] <= cost:
            break
        xs = tasks_of[r]
        rel = head if firsts[r] == 0 else g.heads_from(firsts[r] * m, r)
        cost = max(cost, _released_work([rel[x] for x in xs], [g.dur[x] for x in xs]))
    return LowerBound(makespan=max(makespan, cost), cost=cost, busy=busy)
