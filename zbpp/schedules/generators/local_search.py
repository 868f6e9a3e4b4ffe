"""Local search over rank orders, with incremental re-simulation.

`Timeline` holds the simulated start and end of every task of a set of rank orders (the model of
`zbpp.schedules.simulate`). Moving one task within its rank's order cannot change any task that
started before the earlier of the two positions: such a task's inputs, and their inputs, all
started no later than it did, and none of them is in the moved stretch. So `Timeline.try_move`
keeps that prefix of every rank and re-simulates only the tasks that started at or after it; a
move near the end of the schedule costs only the tasks after it. A rejected move is undone from
a log of what was overwritten.

`improve` applies first-improvement moves, each aimed at one idle gap (the ranks with the
longest spans first):

- *fill*: a later task of the rank whose input is already there moves into the gap, before the
  task that waited (W's mostly, also F's and B's);
- *defer*: an earlier W moves into the gap, so the tasks between start sooner;
- *unblock*: following the waiting task's inputs back across ranks, the first task that waited
  for its own rank rather than for its input moves ahead of the tasks in front of it.

A move is kept when it lowers the cost (longest rank span), else the sum of the rank spans, else
the sum of task end times (so the schedule keeps compacting while the cost is flat), and keeps
every rank's memory within the limit. The search is deterministic and stops after a budget of
re-simulated tasks, so large instances stay fast.
"""

from __future__ import annotations

import random
from typing import Sequence

from ..replay import replay
from .auto_heuristic import Problem

__all__ = ["TaskShape", "Timeline", "improve", "perturb_and_improve", "score_of"]

EPS = 1e-9


class TaskShape:
    """What does not change while orders do: each task's duration, its one data input (-1: none)
    and the comm on that edge, its memory change and its rank. Build it once per `Problem` and
    pass it to every `Timeline` of that problem."""

    def __init__(self, prob: Problem) -> None:
        self.nm = prob.ids.nm
        self.dur, self.dep, self.lag, self.rank = prob.durations, prob.inputs, prob.lags, prob.ranks
        self.delta = prob.memory_deltas


class Timeline:
    """Start/end times and spans of per-rank task orders (tasks as `Problem` ints), kept up to date
    under single-task moves (`try_move`, then `accept` or `reject`).

    >>> from zbpp.schedules import Costs, Memory, build
    >>> from zbpp.schedules.generators.auto_heuristic import Problem
    >>> from zbpp.schedules.ir import v_placement
    >>> prob = Problem.make(v_placement(2), 3, Costs(1, 1, 1), Memory(1, 1), limit=4)
    >>> tl = Timeline(prob, prob.encode(build("zb-v", num_ranks=2, num_microbatches=3)))
    >>> tl.score()[0]  # the longest rank span: ZB-V has no bubble, 2 stages x 3 x (F+B+W)
    18.0
    """

    def __init__(self, prob: Problem, orders: Sequence[Sequence[int]], shape: "TaskShape | None" = None) -> None:
        self.prob = prob
        shape = shape if shape is not None else TaskShape(prob)
        p = prob.num_ranks
        self.nm = shape.nm
        size = 3 * shape.nm
        self.dur, self.dep, self.lag, self.delta, self.rank = shape.dur, shape.dep, shape.lag, shape.delta, shape.rank
        self.orders = [list(o) for o in orders]
        self.pos = [0] * size
        self.start = [0.0] * size
        self.end = [0.0] * size
        self.work = 0  # tasks simulated so far (the search budget counts these)
        self._log: list[tuple[int, float, float]] = []
        self._undo: tuple[int, int, int, list[float], float] | None = None
        self.total_end = 0.0
        for order in self.orders:
            for i, t in enumerate(order):
                self.pos[t] = i
        if not self._simulate([0] * p):
            raise ValueError("the orders deadlock")
        self._log.clear()
        self.total_end = sum(self.end[t] for o in self.orders for t in o)
        self.spans = [self._span(r) for r in range(p)]

    # -- simulation ----------------------------------------------------------------------------
    def _span(self, r: int) -> float:
        order = self.orders[r]
        return self.end[order[-1]] - self.start[order[0]] if order else 0.0

    def _simulate(self, cuts: list[int]) -> bool:
        """Re-simulate every rank from position cuts[r] on; False if that deadlocks."""
        orders, start, end, log = self.orders, self.start, self.end, self._log
        tails = [order[c:] for order, c in zip(orders, cuts)]
        old = 0.0
        for tail in tails:
            old += sum(map(end.__getitem__, tail))
            for t in tail:
                log.append((t, start[t], end[t]))
                end[t] = -1.0  # not run yet
            self.work += len(tail)
        if not replay(orders, self.dep, self.dur, self.lag, start, end, cuts):
            return False
        self.total_end += sum(sum(map(end.__getitem__, tail)) for tail in tails) - old
        return True

    def _cuts(self, r: int, lo: int, t0: float) -> list[int]:
        """Per rank, the first position whose task started at or after t0 (rank r: at most lo)."""
        cuts = []
        start = self.start
        for q, order in enumerate(self.orders):
            k = len(order)
            while k > 0 and start[order[k - 1]] >= t0 - EPS:
                k -= 1
            cuts.append(min(k, lo) if q == r else k)
        return cuts

    # -- moves ---------------------------------------------------------------------------------
    def memory_ok(self, r: int, i: int, k: int, limit: float) -> bool:
        """Would moving position i to position k on rank r keep its memory within `limit`?"""
        order, delta = self.orders[r], self.delta
        x = order[i]
        dx = delta[x]
        if k < i:  # x's change now happens before positions k..i-1
            if dx <= 0:
                return True
            mem = sum(delta[t] for t in order[:k]) + dx
            if mem > limit + EPS:
                return False
            for t in order[k:i]:
                mem += delta[t]
                if mem > limit + EPS:
                    return False
            return True
        if dx >= 0:
            return True
        mem = sum(delta[t] for t in order[:i])  # without x
        for t in order[i + 1 : k + 1]:
            mem += delta[t]
            if mem > limit + EPS:
                return False
        return True

    def try_move(self, r: int, i: int, k: int) -> bool:
        """Move rank r's task at position i to position k and re-simulate; False on deadlock.

        After True, call `accept` or `reject`; a deadlocked move is already undone.
        """
        order = self.orders[r]
        lo = min(i, k)
        t0 = self.start[order[lo]]
        x = order.pop(i)
        order.insert(k, x)
        self._log = []
        self._undo = (r, i, k, list(self.spans), self.total_end)
        if not self._simulate(self._cuts(r, lo, t0)):
            self.reject()
            return False
        self.spans = [self._span(q) for q in range(len(self.orders))]
        return True

    def accept(self) -> None:
        assert self._undo is not None, "no move to accept"
        r, i, k = self._undo[:3]
        order = self.orders[r]
        for q in range(min(i, k), max(i, k) + 1):
            self.pos[order[q]] = q
        self._undo = None
        self._log = []

    def reject(self) -> None:
        assert self._undo is not None, "no move to reject"
        r, i, k, spans, total_end = self._undo
        order = self.orders[r]
        order.insert(i, order.pop(k))
        start, end = self.start, self.end
        for t, s, e in reversed(self._log):
            start[t] = s
            end[t] = e
        self.spans = spans
        self.total_end = total_end
        self._undo = None
        self._log = []

    def score(self) -> tuple[float, float, float, float]:
        """(longest span, makespan, sum of spans, sum of task ends): lower is better, in that order."""
        orders, start, end = self.orders, self.start, self.end
        last = max((end[o[-1]] for o in orders if o), default=0.0)
        first = min((start[o[0]] for o in orders if o), default=0.0)
        return (max(self.spans), last - first, sum(self.spans), self.total_end)


def score_of(shape: TaskShape, orders: Sequence[Sequence[int]]) -> tuple[float, float, float, float]:
    """`Timeline(prob, orders).score()` without the bookkeeping for moves (one simulation pass).

    Raises `ValueError` if the orders deadlock.
    """
    size = 3 * shape.nm
    start, end = [0.0] * size, [-1.0] * size
    if not replay(orders, shape.dep, shape.dur, shape.lag, start, end):
        raise ValueError("the orders deadlock")
    busy = [o for o in orders if o]
    spans = [end[o[-1]] - start[o[0]] if o else 0.0 for o in orders]
    makespan = max(end[o[-1]] for o in busy) - min(start[o[0]] for o in busy) if busy else 0.0
    return (max(spans), makespan, sum(spans), sum(end[t] for o in orders for t in o))


def _better(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    for x, y in zip(a, b):
        tol = 1e-9 * max(1.0, abs(y))
        if x < y - tol:
            return True
        if x > y + tol:
            return False
    return False


def _candidates(tl: Timeline) -> list[tuple[int, int, int]]:
    """Moves (rank, from, to) worth trying, the most promising first."""
    prob, start, end, dep, lag, pos, rank_of = tl.prob, tl.start, tl.end, tl.dep, tl.lag, tl.pos, tl.rank
    nm2 = 2 * tl.nm
    moves: list[tuple[int, int, int]] = []
    ranks = sorted(range(prob.num_ranks), key=lambda q: -tl.spans[q])
    for r in ranks:
        order = tl.orders[r]
        for k in range(1, len(order)):
            y = order[k]
            gap_start = end[order[k - 1]]
            if start[y] <= gap_start + EPS:
                continue
            # fill: a later task of this rank that could start before y does
            found = 0
            for i in range(k + 1, len(order)):
                x = order[i]
                d = dep[x]
                if d >= 0:
                    if rank_of[d] == r and pos[d] >= k:
                        continue
                    if end[d] + lag[x] >= start[y] - EPS:
                        continue
                moves.append((r, i, k))
                found += 1
                if found >= 3 or x >= nm2:
                    break
            # defer: an earlier W moves into the gap, letting the tasks after it start sooner
            found = 0
            for i in range(k - 1, -1, -1):
                if order[i] >= nm2:
                    moves.append((r, i, k - 1))
                    found += 1
                    if found >= 2:
                        break
            # unblock: follow y's inputs back while each waited for its input; the first one
            # that waited for its own rank instead (its input was there earlier) moves ahead
            x = dep[y]
            while x >= 0:
                q, i = rank_of[x], pos[x]
                o = tl.orders[q]
                d = dep[x]
                arrival = end[d] + lag[x] if d >= 0 else 0.0
                if i > 0 and start[x] <= end[o[i - 1]] + EPS and arrival < start[x] - EPS:
                    for back in range(1, 4):
                        if i - back < 0 or (back > 1 and start[o[i - back + 1]] > end[o[i - back]] + EPS):
                            break
                        moves.append((q, i, i - back))
                    break
                x = d
    return moves


def improve(prob: Problem, orders: Sequence[Sequence[int]], *, budget: int, shape: TaskShape | None = None) -> list[list[int]]:
    """Lower the cost of `orders` by local moves; each rank's memory stays within its `prob.limits`.

    `budget` bounds the number of task re-simulations (the search's work).
    """
    tl = Timeline(prob, orders, shape)
    limits = prob.limits
    best = tl.score()
    while tl.work < budget:
        improved = False
        for r, i, k in _candidates(tl):
            if tl.work >= budget:
                break
            if not tl.memory_ok(r, i, k, limits[r]):
                continue
            if not tl.try_move(r, i, k):
                continue
            score = tl.score()
            if _better(score, best):
                tl.accept()
                best = score
                improved = True
                break
            tl.reject()
        if not improved:
            break
    return [list(o) for o in tl.orders]


def perturb_and_improve(
    prob: Problem, orders: Sequence[Sequence[int]], *, budget: int, shape: TaskShape | None = None, seed: int = 0
) -> list[list[int]]:
    """Iterated local search: kick the best orders with a few random memory-safe moves of nearby
    tasks, improve again, keep the result when it is no worse; until `budget` re-simulated tasks.

    `improve` stops in the first local optimum; on small instances with a tight memory limit the
    better schedules often lie a few moves away across worse ones (a microbatch admitted earlier
    on one rank and later on another). Deterministic for a given `seed`.
    """
    shape = shape if shape is not None else TaskShape(prob)
    rng = random.Random(seed)
    size = len(shape.dur)
    best = improve(prob, orders, budget=min(budget, 20 * size), shape=shape)
    best_score = score_of(shape, best)
    current, current_score = best, best_score
    spent = 0
    while spent < budget:
        tl = Timeline(prob, current, shape)
        for _ in range(rng.randint(1, 4)):
            r = rng.randrange(prob.num_ranks)
            order = tl.orders[r]
            if len(order) < 2:
                continue
            i = rng.randrange(len(order))
            k = min(len(order) - 1, max(0, i + rng.choice((-3, -2, -1, 1, 2, 3))))
            if k != i and tl.memory_ok(r, i, k, prob.limits[r]) and tl.try_move(r, i, k):
                tl.accept()
        step = 20 * size
        candidate = improve(prob, tl.orders, budget=step, shape=shape)
        spent += step + tl.work
        candidate_score = score_of(shape, candidate)
        if not _better(current_score, candidate_score):  # no worse than where it started
            current, current_score = candidate, candidate_score
            if _better(candidate_score, best_score):
                best, best_score = candidate, candidate_score
    return best
