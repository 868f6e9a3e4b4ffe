"""The zero-bubble paper's scheduling heuristic (Qi et al., ICLR 2024, section 3.1) as a list scheduler.

The automatic schedules (`zb-auto`, `zbv-auto`) start here. Ranks are simulated together, in time
order; whenever a rank is free it picks its next task from what has arrived:

1. a ready B (it is on the critical path back to rank 0, and frees memory);
2. otherwise a ready F, if the memory limit allows one more microbatch in flight: in the
   warm-up this runs "as many F as memory allows" before the first B comes back;
3. otherwise a W, if one is waiting and it ends before the next input can arrive (it fills the
   gap without delaying anything), or if memory is full (a W frees what its B kept);
4. otherwise the rank waits. W's left at the end run in the cool-down.

`Policy` switches flip the paper's choices: B or F first when both are ready, whether an F may
delay a B known to arrive before it ends, whether an idle rank runs a W that outlasts the gap, a
cap on the microbatches in flight (1F1B's or ZB-H2's warm-up instead of "as many as memory
allows"), and, on a V, which stage's F goes first and how much room later-stage F's keep. The
automatic schedules search over them (`zbpp.schedules.generators.auto`).

`place_w` is the same simulation with the F/B order given (e.g. a handcrafted schedule's): it
only decides where the W's go.

Admission keeps every memory limit at or above the smallest feasible one deadlock-free. A rank
with several stages (a V) keeps room for the later-stage forwards of the *oldest* microbatch it
has admitted that still needs them: it admits a new microbatch (the F of its first stage) only if
that room stays free afterwards, and runs a later-stage F only if it fits: in the room kept for it
when it is the oldest's, beside that room when it is a newer microbatch's (with three or more
stages on a rank, a middle stage's F's of newer microbatches would otherwise fill the room the
oldest needs for its last stage, and no B could ever come back). Later-stage forwards run in
microbatch order, so the room always goes to the oldest; the oldest unfinished microbatch of the
whole pipeline can therefore always proceed, and every microbatch after it once it is done (its
memory, once freed, is at least what the next needs of the room). (Room
for *every* admitted microbatch would also be safe, but halves a V's warm-up: ZB-V itself holds
2p-1 first-stage activations before its first second-stage F.)

Tasks are the integer ids of `zbpp.schedules.tasks` (kinds F, B, W: every backward is split), so
the hot loops stay in plain lists; which task feeds which comes from there too (`Problem.ids`).
"""

from __future__ import annotations

import heapq
import numbers
from collections import deque
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from ..ir import Action, Schedule, ScheduleError
from ..simulate import Costs, Memory
from ..tasks import BW, TaskIds

__all__ = ["Problem", "Policy", "list_schedule", "place_w"]

EPS = 1e-9


@dataclass(frozen=True)
class Problem:
    """One scheduling instance: placement, per-stage costs and memory, and each rank's limit."""

    num_ranks: int
    num_microbatches: int
    placement: tuple[int, ...]
    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    comm: float
    act: tuple[float, ...]
    wgrad: tuple[float, ...]
    limits: tuple[float, ...]  #: per rank

    @classmethod
    def make(cls, placement: Sequence[int], num_microbatches: int, costs: Costs, memory: Memory,
             limit: float | Sequence[float]) -> "Problem":
        """`limit`: one number for every rank, or one per rank."""
        n, p = len(placement), max(placement) + 1
        limits = [float(limit)] * p if isinstance(limit, numbers.Real) else [float(x) for x in limit]
        if len(limits) != p:
            raise ValueError(f"memory limit: {len(limits)} values for {p} ranks; give one number or one per rank")
        f, b, w = costs.per_stage(n)
        act, wgrad = memory.per_stage(n)
        return cls(
            num_ranks=max(placement) + 1,
            num_microbatches=num_microbatches,
            placement=tuple(placement),
            f=tuple(f),
            b=tuple(b),
            w=tuple(w),
            comm=float(costs.comm),
            act=tuple(act),
            wgrad=tuple(wgrad),
            limits=tuple(limits),
        )

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def stages_of(self) -> list[list[int]]:
        """Per rank, its stages in ascending order."""
        out: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for s, r in enumerate(self.placement):
            out[r].append(s)
        return out

    @property
    def limit(self) -> float:
        """The largest rank's limit (for messages; the searches use `limits`)."""
        return max(self.limits)

    @cached_property
    def admits(self) -> tuple[float, ...]:
        """Per rank, the memory it may reach: its limit with a relative 1e-9 to spare, so that
        rounding never refuses a task that fits exactly."""
        return tuple(x + EPS * max(1.0, abs(x)) for x in self.limits)

    @cached_property
    def ids(self) -> TaskIds:
        """The problem's task ids (it uses those of kinds F, B and W)."""
        return TaskIds(self.num_stages, self.num_microbatches)

    # -- tables indexed by task id (F, B and W): what the searches look up in their hot loops --------
    @cached_property
    def inputs(self) -> list[int]:
        """The task whose output each task consumes (-1: none): `TaskIds.inputs`, every backward split."""
        return self.ids.inputs()[: BW * self.ids.nm]

    @cached_property
    def feeds(self) -> list[int]:
        """The F or B task that consumes each task's output (-1: none): `TaskIds.feeds`."""
        return self.ids.feeds()[: BW * self.ids.nm]

    @cached_property
    def lags(self) -> list[float]:
        """`comm` where a task's input comes from another rank, else 0.0: `TaskIds.lags`."""
        return self.ids.lags(self.placement, self.comm)[: BW * self.ids.nm]

    @cached_property
    def durations(self) -> list[float]:
        return self.ids.per_task([self.f, self.b, self.w])

    @cached_property
    def ranks(self) -> list[int]:
        """The rank of each task."""
        return self.ids.per_task([self.placement] * BW)

    @cached_property
    def memory_deltas(self) -> list[float]:
        """Per task id (F, B, W), the memory it allocates (F) or frees (B, W: negative): `Memory.deltas`."""
        per_stage = Memory(self.act, self.wgrad).deltas(self.num_stages)
        return self.ids.per_task(list(zip(*per_stage))[:BW])

    def encode(self, schedule: Schedule) -> list[list[int]] | None:
        """`schedule`'s orders as task ids, or None if it has a BW (auto schedules split every
        backward) or is not a complete set of tasks."""
        try:
            encoded = self.ids.encode(schedule)
        except ScheduleError:
            return None
        return None if 1 in encoded.present[BW * self.ids.nm :] else encoded.orders

    def decode(self, orders: Sequence[Sequence[int]]) -> list[list[Action]]:
        return self.ids.decode(orders)


@dataclass(frozen=True)
class Policy:
    """The heuristic's switches (see the module docstring)."""

    b_first: bool = True  #: a ready B runs before a ready F
    #: run a ready F even if a known B (or a preferred stage's F input) arrives before it would end
    f_may_delay_b: bool = True
    always_fill: bool = False  #: an idle rank runs a waiting W even if the W outlasts the gap
    deep_first: bool = True  #: with two stages on a rank, the later stage's F goes first
    #: with two stages on a rank, admitting a microbatch keeps room for the later-stage F's of
    #: this many of the oldest admitted ones: 1, or (False) one more than the stages above the
    #: rank's later stage, which is how many later-stage F's can arrive before its first
    #: later-stage B comes back down (ZB-V's warm-up)
    reserve_one: bool = True
    #: cap on the microbatches in flight on a rank (F of its first stage done, B not yet), in
    #: units of the stages from there to the last over the rank's stage count: 1 is 1F1B's and
    #: ZB-H1's warm-up (p-r on rank r), 2 about ZB-H2's; 0 leaves only the memory limit
    inflight: int = 0


def _round_trips(prob: Problem) -> list[float]:
    """Per stage s: from the end of F(s, j) to the arrival of B(s, j)'s input, if nothing waits.

    The forward path to the last stage and the backward path back, with `comm` on every edge
    that crosses ranks: a lower bound, exact for the first microbatch of the warm-up.
    """
    n, placement, comm = prob.num_stages, prob.placement, prob.comm
    trips = [0.0] * n
    for s in range(n - 2, -1, -1):
        hop = comm if placement[s] != placement[s + 1] else 0.0
        trips[s] = trips[s + 1] + prob.f[s + 1] + prob.b[s + 1] + 2 * hop
    return trips


def _leads(prob: Problem) -> tuple[list[float], list[float]]:
    """Per stage, the soonest the input of its F / its B can arrive from a producer on another rank
    that has not started yet: the producer's duration plus `comm` (inf where the producer is on the
    same rank, which decides that itself, or there is none)."""
    n, m, nm = prob.num_stages, prob.num_microbatches, prob.ids.nm
    inputs, lags, ranks, durations = prob.inputs, prob.lags, prob.ranks, prob.durations
    inf = float("inf")

    def lead(x: int) -> float:
        d = inputs[x]
        return durations[d] + lags[x] if d >= 0 and ranks[d] != ranks[x] else inf

    return [lead(s * m) for s in range(n)], [lead(nm + s * m) for s in range(n)]


def list_schedule(prob: Problem, policy: Policy) -> list[list[int]]:
    """Per-rank task orders built by the heuristic; rank r's memory never exceeds `prob.limits[r]`.

    Start and end times inside equal what `simulate` computes for the returned orders: every
    task starts when its rank is free and its input has arrived. A rank decides at the time it
    becomes free, when an input arrives, and whenever a producer on another rank schedules one of
    its inputs (so it can revise a wait). Inputs not known yet are estimated: a B's from the end
    of its microbatch's F plus the round trip through the later stages, an F's as if its producer
    started now; both never earlier than the fastest producer could deliver.
    """
    p, n, m = prob.num_ranks, prob.num_stages, prob.num_microbatches
    nm = n * m
    f, b, w, act, wgrad = prob.f, prob.b, prob.w, prob.act, prob.wgrad
    feeds, lags, ranks = prob.feeds, prob.lags, prob.ranks
    limit = prob.admits
    inf = float("inf")
    stages_of = prob.stages_of
    pref = [sorted(st, reverse=policy.deep_first) for st in stages_of]
    first = [st[0] for st in stages_of]
    later = [st[1:] for st in stages_of]
    depth = [1 if policy.reserve_one or len(st) < 2 else n - st[-1] for st in stages_of]
    cap = [-(-policy.inflight * (n - st[0]) // len(st)) if policy.inflight else m for st in stages_of]
    b_done = [0] * n  # B's run, per stage
    trips = _round_trips(prob)
    f_lead, b_lead = _leads(prob)

    f_arrival = [inf] * nm  # when F(s, j)'s input is there (inf: not known yet)
    for j in range(m):
        f_arrival[j] = 0.0
    f_end = [0.0] * nm
    b_known = bytearray(nm)  # B(s, j)'s input time is known
    oldest_unknown = [0] * n  # per stage, the first microbatch whose B input is not known
    next_f = [0] * n
    b_ready: list[list[tuple[float, int, int]]] = [[] for _ in range(p)]  # heaps (arrival, stage, mb)
    w_waiting: list[deque[int]] = [deque() for _ in range(p)]  # stage * m + mb, in B order
    free = [0.0] * p
    mem = [0.0] * p
    left = [3 * m * len(st) for st in stages_of]
    orders: list[list[int]] = [[] for _ in range(p)]
    events = [(0.0, r) for r in range(p)]
    heapq.heapify(events)
    b_first, may_delay, always_fill = policy.b_first, policy.f_may_delay_b, policy.always_fill
    # (the loop below is the hot one: heapq's functions as locals, and min/max of two numbers
    # written out, as the builtins' calls cost more than the comparisons)
    heappush, heappop = heapq.heappush, heapq.heappop

    def b_input_known(s: int, j: int, at: float, q: int) -> None:
        heappush(b_ready[q], (at, s, j))
        b_known[s * m + j] = 1
        k = oldest_unknown[s]
        while k < m and b_known[s * m + k]:
            k += 1
        oldest_unknown[s] = k

    def hand_on(task: int, end: float, r: int, now: float) -> None:
        """`task`, ending at `end` on rank r, hands its output to the F or B that consumes it."""
        c = feeds[task]
        if c < 0:
            return
        q, at = ranks[c], end + lags[c]
        if c < nm:
            f_arrival[c] = at
        else:
            b_input_known(*divmod(c - nm, m), at, q)
        if q != r:
            heappush(events, (now, q))  # wake the consumer's rank: it may revise a wait

    while events:
        now, r = heappop(events)
        if not left[r] or now < free[r] - EPS:
            continue  # finished, or busy: an event at free[r] is queued
        if now < free[r]:
            now = free[r]
        heap = b_ready[r]
        b_now = heap[0][0] <= now + EPS if heap else False
        next_known = heap[0][0] if heap and not b_now else inf  # next input whose time is known
        next_b = next_known  # ... and the next B input, estimated if need be
        for s in stages_of[r]:
            j = oldest_unknown[s]
            if j < next_f[s]:
                est, lead = f_end[s * m + j] + trips[s], now + b_lead[s]
                if lead > est:
                    est = lead
                if est < next_b:
                    next_b = est
        next_f_in = inf
        f_stage = -1
        f_blocked = False
        preferred_at = inf  # known arrival of a preferred stage's F input that is not there yet
        for s in pref[r]:
            j = next_f[s]
            if j >= m:
                continue
            arrival = f_arrival[s * m + j]
            if arrival > now + EPS:
                if arrival < inf:
                    if arrival < next_known:
                        next_known = arrival
                    if arrival < preferred_at:
                        preferred_at = arrival
                est = arrival if arrival < inf else now + f_lead[s]
                if est < next_f_in:
                    next_f_in = est
                continue
            if s == first[r]:
                if j - b_done[s] >= cap[r]:
                    continue  # enough in flight: wait for a B
                # room for the later-stage F's of the oldest admitted microbatches (this one too)
                need = act[s]
                for x in later[r]:
                    need += act[x] * min(depth[r], j + 1 - next_f[x])
            else:  # a later stage: the oldest open microbatch's F uses the room kept for it; a
                # newer one's (a middle stage of three or more) must leave that room free
                need = act[s]
                oldest = min(next_f[x] for x in later[r])
                if j > oldest:
                    for x in later[r]:
                        if next_f[x] == oldest:
                            need += act[x]
            if mem[r] + need > limit[r]:
                f_blocked = True
                continue
            f_stage = s
            break

        kind = -1
        if b_now and (b_first or f_stage < 0):
            kind = 1
        elif f_stage >= 0:
            # unless a B, or the input of the F of a stage this rank prefers (on a V the later
            # stage: it is further along), is known to arrive before this F would end: then keep
            # the rank free for it (only a known arrival: an estimated one might depend on this F)
            arrives = heap[0][0] if heap and heap[0][0] < preferred_at else preferred_at
            if may_delay or b_now or arrives >= now + f[f_stage] - EPS:
                kind = 0
        if kind < 0 and w_waiting[r]:
            s_w = w_waiting[r][0] // m
            if f_blocked or always_fill or free[r] + w[s_w] <= (next_b if next_b <= next_f_in else next_f_in) + EPS:
                kind = 2
        if kind < 0:
            if next_known < inf:
                heappush(events, (next_known, r))
            continue  # otherwise a producer on another rank wakes this rank up

        if kind == 1:
            arrival, s, j = heappop(heap)
            start = free[r] if free[r] >= arrival else arrival
            end = start + b[s]
            mem[r] -= act[s] - wgrad[s]
            b_done[s] += 1
            w_waiting[r].append(s * m + j)
            task = nm + s * m + j
            hand_on(task, end, r, now)
        elif kind == 0:
            s = f_stage
            j = next_f[s]
            next_f[s] = j + 1
            start = free[r] if free[r] >= f_arrival[s * m + j] else f_arrival[s * m + j]
            end = start + f[s]
            f_end[s * m + j] = end
            mem[r] += act[s]
            task = s * m + j
            hand_on(task, end, r, now)
        else:
            sj = w_waiting[r].popleft()
            s = sj // m
            start = free[r]  # W's have no consumers, so filling the idle time before `now` is safe
            end = start + w[s]
            mem[r] -= wgrad[s]
            task = 2 * nm + sj
        orders[r].append(task)
        free[r] = end
        left[r] -= 1
        heappush(events, (end if end >= now else now, r))

    if any(left):  # pragma: no cover - admission makes this impossible
        stuck = [r for r in range(p) if left[r]]
        raise RuntimeError(f"list scheduler stalled on ranks {stuck} (limits {prob.limits}); please report")
    return orders


def place_w(prob: Problem, skeleton: Sequence[Sequence[int]], *, always: bool = False) -> list[list[int]]:
    """Keep the F and B order of `skeleton` (per rank; its W's are dropped) and place the W's anew.

    A W runs where its rank would otherwise wait and it ends before the next F or B can start
    (with `always`, in every wait), before an F that memory would not allow, and at the end.
    Fixed W slots (ZB-V's) delay an F or B whenever F, B and W take different times; W's placed
    this way delay one only when memory forces them (or with `always`). Raises `ValueError` if
    the F/B order needs more than `prob.limits` even with every W run as early as possible.
    """
    p, n, m = prob.num_ranks, prob.num_stages, prob.num_microbatches
    nm = n * m
    f, b, w, act, wgrad = prob.f, prob.b, prob.w, prob.act, prob.wgrad
    feeds, lags, ranks = prob.feeds, prob.lags, prob.ranks
    limit = prob.admits
    inf = float("inf")
    trips = _round_trips(prob)
    f_lead, b_lead = _leads(prob)
    seq = [[t for t in order if t < 2 * nm] for order in skeleton]
    nxt = [0] * p
    arrival = [inf] * (2 * nm)  # input arrival of each F and B (inf: not known yet)
    for j in range(m):
        arrival[j] = 0.0
    f_end = [0.0] * nm
    free = [0.0] * p
    mem = [0.0] * p
    w_waiting: list[deque[int]] = [deque() for _ in range(p)]
    left = [len(s) * 3 // 2 for s in seq]
    orders: list[list[int]] = [[] for _ in range(p)]
    events = [(0.0, r) for r in range(p)]
    heapq.heapify(events)
    while events:
        now, r = heapq.heappop(events)
        if not left[r] or now < free[r] - EPS:
            continue
        if now < free[r]:
            now = free[r]
        kind = 2  # no F or B left: the W's
        if nxt[r] < len(seq[r]):
            x = seq[r][nxt[r]]
            kind, rest = divmod(x, nm)
            s = rest // m
            at = arrival[x]
            if kind == 0 and mem[r] + act[s] > limit[r]:
                if not w_waiting[r]:
                    raise ValueError(f"the F/B order needs more memory than {prob.limits[r]} on rank {r}")
                kind = 2
            elif at > now + EPS:
                if not w_waiting[r]:
                    kind = -1
                else:
                    if at < inf:
                        horizon = at
                    elif kind == 0:
                        horizon = now + f_lead[s]
                    else:  # as in list_schedule: the round trip, or the fastest producer
                        horizon = max(now + b_lead[s], f_end[rest] + trips[s])
                    fits = free[r] + w[w_waiting[r][0] // m] <= horizon + EPS
                    kind = 2 if always or fits else -1
        if kind < 0:
            if arrival[x] < inf:
                heapq.heappush(events, (arrival[x], r))
            continue
        if kind == 2:
            sj = w_waiting[r].popleft()
            s = sj // m
            end = free[r] + w[s]  # W's have no consumers: filling idle time before `now` is safe
            mem[r] -= wgrad[s]
            task = 2 * nm + sj
        else:
            nxt[r] += 1
            start = max(free[r], arrival[x])
            task = x
            if kind == 0:
                end = start + f[s]
                f_end[rest] = end
                mem[r] += act[s]
            else:
                end = start + b[s]
                mem[r] -= act[s] - wgrad[s]
                w_waiting[r].append(rest)
            c = feeds[x]  # the output goes on to the F or B that consumes it
            if c >= 0:
                arrival[c] = end + lags[c]
                if ranks[c] != r:
                    heapq.heappush(events, (now, ranks[c]))
        orders[r].append(task)
        free[r] = end
        left[r] -= 1
        heapq.heappush(events, (max(end, now), r))
    if any(left):
        raise ValueError("the F/B order deadlocks")
    return orders
