"""The zero-bubble paper's round-based heuristics: one stage per rank (Qi et al., ICLR 2024, section
3.1) and its V-shape counterpart, as seeds for `zb-auto` and `zbv-auto`.

Both build every rank's order in *rounds* rather than in time order: a round gives each rank at
most one forward and one input-gradient backward (B), and places weight-gradient tasks (W) in
front of them where they help. Every task is timed as it is placed (it starts when its rank is
free and its input has arrived), so the orders come with their simulated times. The paper's rules:

- warm-up: as many forwards as memory allows and as fit before the first B comes back (a binary
  switch decides whether a forward that would end just after that arrival still runs);
- steady state: one F and one B per round; a W runs in front of an F or B whose input has not
  arrived yet when it fits into that wait, when memory is full, and also when the wait does not
  fit a W but idling would make this rank's total idle time the largest of all ranks (a switch
  makes it run then too). That keeps the ranks' bubbles balanced: the cost is the longest span;
- a stage never runs more forwards than the one before it; when it is two or more ahead of the
  next stage, a switch lets it skip its forward if the next B would otherwise wait for it;
- cool-down: every W left, in order.

The V version (rank r holds stages r and 2p-1-r) follows the same ideas with two forwards and
two backwards per microbatch and rank: its warm-up sends microbatches down the V while a rank's
memory keeps room for those the ranks below still send up, and then evens out how far each rank
is ahead; each round gives every rank one B (the down stage's when its input is there, as it
frees the most memory and feeds the rank above) and one F (the up stage's first). A second pass
reruns the rounds with each rank's idle time from the first as extra allowance ("approved"
bubble), so ranks that idled little may take on more; it repeats while the longest idle shrinks.

Tasks are `Problem` ints; the functions return per-rank orders and the longest rank span.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from .auto_heuristic import Problem

__all__ = ["zb_rounds", "best_zb_rounds", "v_rounds", "best_v_rounds"]


class _CannotFit(ValueError):
    """This switch setting cannot meet the memory limit (memory full and no W left to free it,
    or a warm-up too deep for it)."""


def zb_rounds(
    prob: Problem, *, gap_before_first_b: bool, skip_f: bool, greedy_w: bool, mattered: set[str] | None = None
) -> tuple[list[list[int]], float]:
    """One stage per rank: the paper's heuristic with its three switches.

    `gap_before_first_b`: in the warm-up, stop adding forwards only once one would end after the
    first B's input arrives (else as soon as the rank reaches that time). `skip_f`: a stage two
    or more forwards ahead of the next may skip its forward in a round. `greedy_w`: run a W into
    any wait, even one that the rank's idle allowance covers.

    `mattered`, if given, receives the name of every switch that took a decision the other
    setting of it would not have (see `best_zb_rounds`).

    Raises `ValueError` if memory cannot be met this way (another switch setting may still work).
    """
    n, m = prob.num_stages, prob.num_microbatches
    if n != prob.num_ranks:
        raise ValueError("zb_rounds needs one stage per rank")
    nm = n * m
    f, b, w, act, wgrad, comm = prob.f, prob.b, prob.w, prob.act, prob.wgrad, prob.comm
    inputs, lags, durations, delta = prob.inputs, prob.lags, prob.durations, prob.memory_deltas
    limit = prob.admits
    end = [-1.0] * (3 * nm)  # -1: not placed yet
    free = [0.0] * n  # when each stage's rank is free
    mem = [0.0] * n
    idle = [0.0] * n  # idle time after the rank's first task
    worst = [0.0]  # max(idle): idle only grows, so the running max is exact
    nf, nb, nw = [0] * n, [0] * n, [0] * n
    orders: list[list[int]] = [[] for _ in range(n)]
    note = mattered.add if mattered is not None else _ignore

    def run(s: int, task: int) -> None:
        """Stage s's rank runs `task`: it starts when the rank is free and the task's input is there."""
        dur = durations[task]
        e = free[s] + dur
        d = inputs[task]
        if d >= 0:
            ready = end[d]
            if ready < 0:  # uneven stages can make the warm-up's counts outrun the stage before
                raise _CannotFit
            # the idle time is measured between end times (as the paper's implementation does
            # it, so that near-ties round alike and the decisions match it)
            later = ready + lags[task] + dur
            if later > e:
                if orders[s]:
                    idle[s] += later - e
                    if idle[s] > worst[0]:
                        worst[0] = idle[s]
                e = later
        free[s] = e
        end[task] = e
        mem[s] += delta[task]
        orders[s].append(task)

    def run_f(s: int) -> None:
        j = nf[s]
        nf[s] = j + 1
        run(s, s * m + j)

    def run_b(s: int) -> None:
        j = nb[s]
        nb[s] = j + 1
        run(s, nm + s * m + j)

    def run_w(s: int) -> None:
        j = nw[s]
        nw[s] = j + 1
        run(s, 2 * nm + s * m + j)

    def fill(s: int, x: int) -> None:
        """W's in front of task x, whose input comes from the stage before or after (see the
        module docstring)."""
        arrival = end[inputs[x]]
        if arrival < 0:
            raise _CannotFit
        arrival += lags[x]
        while nw[s] < nb[s] and free[s] + w[s] <= arrival:
            run_w(s)
        if nw[s] < nb[s] and free[s] < arrival:
            if arrival - free[s] > worst[0] - idle[s]:
                run_w(s)
            else:
                note("greedy_w")
                if greedy_w:
                    run_w(s)

    def skips(s: int) -> bool:
        """Whether stage s, two or more forwards ahead of the next, skips its forward this round."""
        # when the next stage's next B input leaves it: its F and B, then the message
        due = free[s + 1] + f[s + 1] + b[s + 1] + comm
        if free[s] >= due:
            return True
        # W's memory would force in front of this F
        t_w, used, k = 0.0, mem[s] + act[s], nw[s]
        while used > limit[s] and k < nb[s]:
            t_w += w[s]
            used -= wgrad[s]
            k += 1
        if free[s] + f[s] + t_w <= due:
            return False
        return due - free[s] <= worst[0] - idle[s]

    # -- warm-up: the first microbatch all the way down, then extra forwards per stage ----------
    for s in range(n):
        run_f(s)
    extra = [0] * n
    back = end[n * m - m] + b[n - 1]  # when B(last, 0) ends
    for s in range(n - 2, -1, -1):
        t, used, k = free[s], mem[s], 0
        arrival = back + comm
        while nf[s] + k < m and used + act[s] <= limit[s]:
            ends_late, starts_late = t + f[s] > arrival, t >= arrival
            if ends_late != starts_late:
                note("gap_before_first_b")
            if ends_late if gap_before_first_b else starts_late:
                break
            used += act[s]
            t += f[s]
            k += 1
        extra[s] = k
        back = max(t, arrival) + b[s]
    for s in range(1, n):  # a stage runs fewer than the one before it, where it can
        while extra[s] > 0 and extra[s] >= extra[s - 1] and nf[s] + extra[s] < m:
            extra[s] -= 1
    for s in range(n):
        for _ in range(extra[s]):
            run_f(s)
    for s in range(n - 1, -1, -1):
        run_b(s)

    # -- steady state: a round per microbatch ---------------------------------------------------
    for i in range(1, m):
        want = [0] * n
        for s in range(n):
            if nf[s] >= m:
                continue
            want[s] = 1
            if s + 1 < n and nf[s] >= nf[s + 1] + 2 and (skip_f or mattered is not None) and skips(s):
                note("skip_f")
                if skip_f:
                    want[s] = 0
        for s in range(n - 2, -1, -1):  # only where the next stage runs one too
            if want[s + 1] < want[s]:
                want[s] = want[s + 1]
        for s in range(n):
            if not want[s]:
                continue
            while mem[s] + act[s] > limit[s]:
                if nw[s] >= nb[s]:
                    raise _CannotFit
                run_w(s)
            if s > 0:
                fill(s, s * m + nf[s])
            run_f(s)
        for s in range(n - 1, -1, -1):
            if s + 1 < n:
                fill(s, nm + s * m + nb[s])
            if s == 0 and nf[0] == m:  # no forward left: every W before each remaining B
                while nw[s] < nb[s]:
                    run_w(s)
            run_b(s)

    # -- cool-down -------------------------------------------------------------------------------
    for s in range(n):
        if nf[s] < m:  # a stage starved of forwards by the one after it (uneven stages)
            raise _CannotFit
        while nw[s] < m:
            run_w(s)
    cost = max(free[s] - (end[s * m] - f[s]) for s in range(n))
    return orders, cost


def best_zb_rounds(prob: Problem) -> list[tuple[float, list[list[int]]]]:
    """Every switch setting of `zb_rounds` that meets the memory limit, as (cost, orders), best first.

    All eight settings count, as in the paper's implementation; one that differs from a setting
    already run only in switches that decided nothing there gives that run's result without
    running again (the same decisions, so the same schedule).
    """
    runs = _Runs(lambda approved, **switches: zb_rounds(prob, **switches))
    out = []
    for gap in (True, False):
        for skip in (True, False):
            for greedy in (True, False):
                result = runs({"gap_before_first_b": gap, "skip_f": skip, "greedy_w": greedy})
                if result is not None:
                    orders, cost = result
                    out.append((cost, orders))
    out.sort(key=lambda x: x[0])
    return out


def v_rounds(
    prob: Problem,
    *,
    fill_before_f: bool,
    fill_before_b: bool,
    approved: Sequence[float] | None = None,
    mattered: set[str] | None = None,
) -> tuple[list[list[int]], float, list[float]]:
    """V placement (rank r holds stages r and 2p-1-r): the round heuristic for one setting of its
    switches and idle allowances. Returns the orders, the longest span and each rank's idle time.

    `fill_before_f` / `fill_before_b`: when idling in front of a forward / an up-stage backward
    would make this rank's idle time the largest, run a W there even if it outlasts the wait (the
    down stage's B always does: it feeds the rank above). `approved`: idle time per rank that a
    previous pass needed; a rank may idle up to the largest of them minus its own before that
    counts as the largest. `mattered` as for `zb_rounds`.

    Raises `ValueError` if memory cannot be met this way.
    """
    p, n, m = prob.num_ranks, prob.num_stages, prob.num_microbatches
    if n != 2 * p or any(prob.placement[s] != min(s, n - 1 - s) for s in range(n)):
        raise ValueError("v_rounds needs the V placement")
    nm = n * m
    f, b, w, act, wgrad = prob.f, prob.b, prob.w, prob.act, prob.wgrad
    inputs, lags, ranks, durations, delta = prob.inputs, prob.lags, prob.ranks, prob.durations, prob.memory_deltas
    limit = prob.admits
    end = [-1.0] * (3 * nm)
    free = [0.0] * p
    mem = [0.0] * p
    idle = [0.0] * p
    worst = [0.0]  # max(idle)
    if approved is None:
        extra = [0.0] * p
    else:
        top = max(approved)
        extra = [top - a for a in approved]
    down = list(range(p))  # rank r's stages: r on the way down, 2p-1-r on the way up
    up = [n - 1 - r for r in range(p)]
    nf_d, nf_u, nb_u, nb_d = [0] * p, [0] * p, [0] * p, [0] * p
    pending: list[deque[int]] = [deque() for _ in range(p)]  # W's, in B order (stage * m + mb)
    orders: list[list[int]] = [[] for _ in range(p)]
    note = mattered.add if mattered is not None else _ignore
    switch = {"fill_before_f": fill_before_f, "fill_before_b": fill_before_b, "always": True}

    def run(r: int, t: int, fill: str | None) -> None:
        """Rank r runs F or B task t. It starts when the rank is free and its input is there (an
        input from the rank itself always is); the wait counts as idle time. Unless `fill` is
        None, W's first fill a wait for an input from another rank: those that end in time, and
        then one more when idling would make this rank's idle time the largest and the switch
        `fill` ("always": on) says so."""
        d = inputs[t]
        dur = durations[t]
        if d < 0:
            done = free[r] + dur
        else:
            e = end[d]
            if e < 0:  # the warm-up's counts do not suit this memory limit
                raise _CannotFit
            at = e + lags[t]
            if fill is not None and ranks[d] != r:
                queue = pending[r]
                while queue and free[r] + w[queue[0] // m] <= at:
                    run_w(r)
                if queue:
                    top = worst[0] if worst[0] >= extra[r] else extra[r]
                    if at - free[r] > top - idle[r]:
                        if fill != "always":
                            note(fill)
                        if switch[fill]:
                            run_w(r)
            done = free[r] + dur
            later = at + dur  # idle measured between end times, as in zb_rounds
            if later > done:
                idle[r] += later - done
                if idle[r] > worst[0]:
                    worst[0] = idle[r]
                done = later
        free[r] = end[t] = done
        mem[r] += delta[t]
        orders[r].append(t)

    def forward(r: int, s: int, count: list[int], fill: str | None = None) -> None:
        """Rank r runs the next F of its stage s (`count`: nf_d or nf_u, F's run per rank)."""
        j = count[r]
        if mem[r] + act[s] > limit[r]:
            raise _CannotFit
        count[r] = j + 1
        run(r, s * m + j, fill)

    def backward(r: int, s: int, count: list[int], fill: str) -> None:
        """Rank r runs the next B of its stage s (`count`: nb_d or nb_u) and queues its W."""
        j = count[r]
        count[r] = j + 1
        run(r, nm + s * m + j, fill)
        pending[r].append(s * m + j)

    def run_w(r: int) -> None:
        t = pending[r].popleft()
        s = t // m
        free[r] += w[s]
        end[2 * nm + t] = free[r]
        mem[r] -= wgrad[s]
        orders[r].append(2 * nm + t)

    # -- warm-up ---------------------------------------------------------------------------------
    for r in range(p):
        forward(r, down[r], nf_d)
    idle = [0.0] * p  # a rank's span starts with its first task: the wait for it is no idle time
    worst[0] = 0.0
    for r in range(p - 1, -1, -1):
        if r < p - 1:
            # more microbatches down while they end before the first one comes back up, keeping
            # room for the forwards of the r+1 ranks from here to rank 0 that are still to come
            first_up = up[r] * m
            back = end[inputs[first_up]] + lags[first_up]
            room = (r + 1) * (act[down[r]] + act[up[r]])
            while mem[r] + room <= limit[r] and free[r] + f[down[r]] <= back and nf_d[r] < m:
                for q in range(r + 1):
                    forward(q, down[q], nf_d)
        forward(r, up[r], nf_u)
    turn = 0  # evening out: ranks from the bottom up, stages in turn
    for r in range(1, p):
        while nf_d[r] + nf_u[r] < nf_d[r - 1] + nf_u[r - 1] or nf_u[r] <= nf_u[r - 1] < m:
            for q in range(p - 1, r - 1, -1):
                if turn == 0 and nf_d[q] < m:
                    forward(q, down[q], nf_d)
                elif turn == 1 and nf_u[q] < m:
                    forward(q, up[q], nf_u)
            turn = 1 - turn

    # -- steady state: every round, one B and one F per rank ---------------------------------------
    for _ in range(2 * m):
        ups, downs = [], []
        # (an input is there when its producer has run: d < 0 is none, end[d] >= 0 has run)
        for r in range(p):
            if nb_d[r] >= nb_u[r]:
                ups.append(r)
            elif nb_u[r] >= m or (d := inputs[nm + down[r] * m + nb_d[r]]) < 0 or end[d] >= 0:
                downs.append(r)
            else:
                ups.append(r)
        for r in reversed(downs):
            backward(r, down[r], nb_d, "always")
        for r in ups:
            backward(r, up[r], nb_u, "fill_before_b")
        for r in range(p):
            if nf_u[r] >= m:
                continue
            if nf_u[r] >= nf_d[r]:
                go_up = False
            elif (d := inputs[up[r] * m + nf_u[r]]) < 0 or end[d] >= 0:
                go_up = True
            elif nf_d[r] < m and ((d := inputs[down[r] * m + nf_d[r]]) < 0 or end[d] >= 0):
                go_up = False
            else:
                continue
            s = up[r] if go_up else down[r]
            while mem[r] + act[s] > limit[r]:
                if not pending[r]:
                    raise _CannotFit
                run_w(r)
            if go_up:
                forward(r, up[r], nf_u, "fill_before_f")
            else:
                forward(r, down[r], nf_d, "fill_before_f")

    # -- cool-down -------------------------------------------------------------------------------
    for r in range(p):
        while pending[r]:
            run_w(r)
    busy = [sum((f[s] + b[s] + w[s]) * m for s in (down[r], up[r])) for r in range(p)]
    cost = max(busy[r] + idle[r] for r in range(p))
    return orders, cost, list(idle)


def best_v_rounds(prob: Problem) -> list[tuple[float, list[list[int]]]]:
    """`v_rounds` for every switch setting, each followed by passes with approved idle while the
    longest idle shrinks; every schedule met, as (cost, orders), best first. A pass whose setting
    differs from one already run with the same approved idle only in switches that decided
    nothing there gives that run's result without running again (as in `best_zb_rounds`)."""
    runs = _Runs(lambda approved, **switches: v_rounds(prob, approved=approved, **switches))
    out = []
    for before_b in (True, False):
        for before_f in (True, False):
            approved = None
            prev = None
            while True:
                result = runs({"fill_before_f": before_f, "fill_before_b": before_b}, approved)
                if result is None:
                    break
                orders, cost, idle = result
                out.append((cost, orders))
                if prev is not None and max(idle) >= prev:
                    break
                prev = max(idle)
                approved = idle
    out.sort(key=lambda x: x[0])
    return out


def _ignore(name: str) -> None:
    pass


class _Runs:
    """Runs of a round heuristic under settings of its switches (and approved idle), each run once.

    A run records the switches that took a decision the other setting would not have taken. Any
    setting that differs from it only in other switches takes the same decisions all the way, so
    it gets that run's result (a copy of it) instead of running. None: the setting cannot meet the
    memory limit.
    """

    def __init__(self, run) -> None:
        self.run = run
        self.done: list[tuple[dict[str, bool], tuple[float, ...] | None, set[str], tuple | None]] = []

    def __call__(self, switches: dict[str, bool], approved: Sequence[float] | None = None) -> tuple | None:
        key = None if approved is None else tuple(approved)
        for settings, their_key, mattered, result in self.done:
            if their_key == key and all(settings[k] == v or k not in mattered for k, v in switches.items()):
                return None if result is None else ([list(o) for o in result[0]], *result[1:])
        mattered: set[str] = set()
        try:
            result = self.run(approved, mattered=mattered, **switches)
        except _CannotFit:
            result = None
        self.done.append((switches, key, mattered, result))
        return result
