"""V-shape schedules: ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6),
V-Half and V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024).

All three use the V placement: rank r holds stages r and 2p-1-r, so a microbatch runs down the
ranks through the first stages and back up through the second. Memory is counted in V-stage
activations (a V stage holds half the layers of a 1F1B stage):

- ZB-V: 2p per rank, the same as 1F1B; zero bubble when F = B = W (for m >= 2p-1).
- V-Half: 2*floor((p+2)/2), about half of 1F1B.  V-Min: 2*floor((p+4)/3), about a third.

V-Half and V-Min are built the papers' way: every microbatch repeats one *building block* (when
each of its F and B tasks runs, in unit time slots) shifted by 6 slots, the time one microbatch
takes on a rank with F = B = W; W tasks fill the empty slots. A block's lifespans fix the memory.
Repeating it leaves idle slots in the warm-up and cool-down, which `squeeze_slots` removes by
moving tasks to earlier free slots without raising the peak memory.

>>> from zbpp.schedules import build, simulate, Costs, Memory
>>> res = simulate(build("zb-v", num_ranks=4, num_microbatches=8), Costs(1, 1, 1), Memory(1, 1))
>>> res.bubble_rate, res.peak_memory
(0.0, [8.0, 8.0, 8.0, 8.0])
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from ..ir import Action, Kind, Schedule, from_orders, v_placement
from ..tasks import input_of

__all__ = ["zb_v", "v_half", "v_min", "v_cap"]


def keep_microbatches(orders: Sequence[Sequence[Action]], m: int) -> list[list[Action]]:
    """Drop the tasks of microbatches >= m.

    Dropping tasks keeps a valid schedule valid: a rank chain that skips dropped tasks follows a
    path of the original graph, so any cycle after dropping would have been a cycle before. This is
    how the V schedules, whose steady state needs enough microbatches, serve any m >= 1.
    """
    return [[a for a in order if a.microbatch < m] for order in orders]


def _v_tasks(p: int, m: int) -> int:
    return 6 * p * m  # F, B and W of two stages per rank


def _zbv_tasks(p: int, m: int) -> int:
    return 6 * p * max(m, 2 * p - 1)  # built for at least 2p-1 microbatches, then cut down to m


def v_stages(p: int, **_: object) -> int:
    """Stages of a V placement on `p` ranks: two per rank (for the registry)."""
    return 2 * p


# -- ZB-V ----------------------------------------------------------------------------------------


def _zbv_rank(p: int, n: int, r: int) -> list[Action]:
    """ZB-V's order on rank r for n >= 2p-1 microbatches (the paper's figure, phase by phase)."""
    first, second = r, 2 * p - 1 - r
    order: list[Action] = []
    nf = {first: 0, second: 0}  # next microbatch to run F / B / W of, per stage
    nb = {first: 0, second: 0}
    nw = {first: 0, second: 0}

    def f(s: int) -> None:
        order.append(Action(Kind.F, s, nf[s]))
        nf[s] += 1

    def b(s: int) -> None:
        order.append(Action(Kind.B, s, nb[s]))
        nb[s] += 1

    def w(s: int) -> None:
        order.append(Action(Kind.W, s, nw[s]))
        nw[s] += 1

    # warm-up: fill the way down (2(p-r)-1 first-stage F), then the two stages take turns until
    # the first microbatch comes back up to this rank
    for _ in range(2 * (p - r) - 1):
        f(first)
    for _ in range(r):
        f(second)
        f(first)
    # the second stage's backward starts first: its B's come from the rank below
    for _ in range(p - r):
        f(second)
        b(second)
        w(second)
    # steady state: F, B, W of the first stage, then of the second
    while nf[second] < n:
        if nf[first] < n:
            f(first)
        b(first)
        w(first)
        f(second)
        b(second)
        w(second)
    # cool-down: remaining B's of both stages, W's where the B's leave room, then the rest
    for _ in range(r):
        b(first)
        b(second)
    for _ in range(p - r):
        b(first)
        w(first)
    while nw[second] < n:
        w(second)
    while nw[first] < n:
        w(first)
    return order


def zb_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V: 2p stages in a V; zero bubble with F = B = W and 1F1B's peak memory (2p V stages).

    For m < 2p-1 the order for 2p-1 microbatches is cut down to m (still valid, with bubbles).

    >>> from zbpp.schedules import build
    >>> [str(a) for a in build("zb-v", num_ranks=2, num_microbatches=3).orders[1][:6]]
    ['F1.0', 'F2.0', 'F1.1', 'F2.1', 'B2.0', 'W2.0']
    """
    p, m = num_ranks, num_microbatches
    n = max(m, 2 * p - 1)
    orders = keep_microbatches([_zbv_rank(p, n, r) for r in range(p)], m)
    return from_orders("zb-v", v_placement(p), m, orders)


# -- V-Half and V-Min: building blocks ----------------------------------------------------------

#: Slot of each task of microbatch 0 on rank r, as (F first stage, F second stage, B second stage,
#: B first stage); microbatch k runs 6k slots later. These are the papers' blocks: V-Min keeps
#: every F and B right behind its predecessor (offset 1), so each microbatch lives as briefly as
#: possible; V-Half spaces the first stages' F and B by 2, which lengthens lifespans to ~1/2 of
#: 1F1B's and in exchange leaves room to squeeze the warm-up and cool-down. When the offsets
#: would put two tasks of a rank in one slot modulo 6 (p % 3 == 0 for V-Min, p even for V-Half),
#: the backward half of the block starts a little later (`gap`).
def _v_min_block(p: int, r: int) -> tuple[int, int, int, int]:
    gap = 2 if p % 3 == 0 else 0
    return (r, 2 * p - 1 - r, 2 * p + gap + r, 4 * p + gap - 1 - r)


def _v_half_block(p: int, r: int) -> tuple[int, int, int, int]:
    gap = 3 if p % 2 == 0 else 0
    return (2 * r, 3 * p - 2 - r, 3 * p + gap + 2 * r - 1, 6 * p + gap - r - 2)


def v_cap(num_ranks: int, kind: str) -> int:
    """docs/DESIGN.md's peak memory of V-Half (`kind="half"`) or V-Min (`"min"`), in V-stage activations.

    >>> v_cap(8, "half"), v_cap(8, "min"), 2 * 8  # ZB-V / 1F1B for comparison
    (10, 8, 16)
    """
    p = num_ranks
    if kind == "half":
        return 2 * ((p + 2) // 2)
    if kind == "min":
        return 2 * ((p + 4) // 3)
    raise ValueError(f"kind must be 'half' or 'min', got {kind!r}")


_FB = dict[int, Action]  # slot -> F or B task of one rank


def _repeat_block(p: int, m: int, block: Callable[[int, int], tuple[int, ...]]) -> list[_FB]:
    slots: list[_FB] = []
    for r in range(p):
        first, second = r, 2 * p - 1 - r
        offsets = block(p, r)
        if len({o % 6 for o in offsets}) != 4:  # pragma: no cover - a bad block table
            raise AssertionError(f"building block puts two tasks of rank {r} in one slot (p={p})")
        kinds = ((Kind.F, first), (Kind.F, second), (Kind.B, second), (Kind.B, first))
        slots.append({o + 6 * k: Action(kind, s, k) for k in range(m) for o, (kind, s) in zip(offsets, kinds)})
    return slots


def _with_w(fb: _FB) -> tuple[list[Action], list[int], int]:
    """Fill empty slots with W's (first in, first out after their B's); W's left over go last.

    Returns the rank's order, the memory after each slot up to the last F/B (W frees what F took:
    Memory(activation=1, wgrad=1)), and the peak.
    """
    order: list[Action] = []
    mem_after: list[int] = []
    pending: deque[Action] = deque()
    mem = peak = 0
    last = max(fb, default=-1)
    for t in range(last + 1):
        a = fb.get(t)
        if a is not None:
            order.append(a)
            if a.kind is Kind.B:
                pending.append(a)
            else:
                mem += 1
                peak = max(peak, mem)
        elif pending:
            done = pending.popleft()
            order.append(Action(Kind.W, done.stage, done.microbatch))
            mem -= 1
        mem_after.append(mem)
    order += [Action(Kind.W, a.stage, a.microbatch) for a in pending]
    return order, mem_after, peak



def _advance(mem: int, waiting: int, task: Action | None) -> tuple[int, int]:
    """(memory, W's waiting) after one slot: an empty slot runs a waiting W (freeing its memory),
    a B leaves a W waiting, an F allocates."""
    if task is None:
        return (mem - 1, waiting - 1) if waiting else (mem, waiting)
    if task.kind is Kind.B:
        return mem, waiting + 1
    return mem + 1, waiting


#: Subtracted from `_Rank.before[t]` when slot t holds an F or B, so a search for a queue length
#: (a value >= 0) finds free slots only; range additions keep the mark.
_TAKEN = 1 << 40


class _Rank:
    """One rank's F/B slots and its memory walk (what `_with_w` gives), for `squeeze_slots`.

    `tasks[t]` is the F or B in slot t (None: free, a W runs there if one waits); `mem[t]` the
    memory after slot t; `before[t]` the W's waiting before slot t (minus `_TAKEN` if taken).
    """

    __slots__ = ("tasks", "mem", "before", "cap", "under_cap")

    def __init__(self, fb: _FB, cap: int) -> None:
        self.tasks: list[Action | None] = [fb.get(t) for t in range(max(fb, default=-1) + 1)]
        self.mem: list[int] = []
        self.before: list[int] = []
        mem = waiting = 0
        for a in self.tasks:
            self.before.append(waiting - (_TAKEN if a is not None else 0))
            mem, waiting = _advance(mem, waiting, a)
            self.mem.append(mem)
        self.cap = cap
        # every memory <= cap: then a stretch that lowers (or keeps) the memory needs no check. Moves
        # keep it true: they check every slot whose memory they change.
        self.under_cap = max(self.mem, default=0) <= cap

    def free_slot(self, lo: int, hi: int) -> int:
        """The first free slot in [lo, hi), or hi."""
        try:
            return self.tasks.index(None, lo, hi)
        except ValueError:
            return hi

    def _disagree(self, extra: int, lo: int, hi: int) -> int | None:
        """First free slot in [lo, hi) where a walk with `extra` more W's waiting than this one runs
        a W and this one does not (extra > 0: none waits here) or the other way round (extra < 0:
        1..-extra wait here); None if none."""
        if extra == 0:
            return None
        found = None
        for waiting in (0,) if extra > 0 else range(1, 1 - extra):
            try:
                found = hi = self.before.index(waiting, lo, hi)
            except ValueError:
                pass
        return found

    def try_move(self, a: Action, old: int, new: int) -> bool:
        """Move `a` from slot `old` to the free slot `new` < old if the memory stays <= cap from
        `new` until the walk meets the old one again (or to the end), as a slot-by-slot re-walk would.

        The new walk differs from the current one by `ahead`, the W's it has run more, and by `a`
        counted early in [new, old). That difference changes only in free slots where exactly one
        of the walks has a W to run, so the walk is a few stretches, each the current one plus a
        constant: found, checked and shifted with list searches, max and slices rather than a
        Python step per slot (a task moves O(p) slots: that would be p x tasks steps).
        """
        tasks, mem, before, cap = self.tasks, self.mem, self.before, self.cap
        f = 1 if a.kind is Kind.F else 0  # the extra F (or B) the new walk holds in [new, old)
        b = 1 - f
        ahead = -1 if before[new] > 0 else 0  # the current walk runs a W in slot `new`, now taken
        stretches: list[tuple[int, int, int, int]] = []  # (start, end, memory change, waiting change)
        start = new
        while True:  # slots new+1 .. old-1: free in both walks
            ev = self._disagree(b - ahead, start + 1, old)
            if ev is None:
                break
            stretches.append((start, ev, f - ahead, b - ahead))
            ahead += 1 if b - ahead > 0 else -1
            start = ev
        stretches.append((start, old, f - ahead, b - ahead))
        # slot old: the current walk runs `a`, the new one has it free and runs a W if one waits
        if before[old] + _TAKEN + b - ahead > 0:
            ahead += 1
        start = old
        while ahead:  # from old on the walks differ by `ahead` W's until they meet
            ev = self._disagree(-ahead, start + 1, len(tasks))
            if ev is None:
                break
            stretches.append((start, ev, -ahead, -ahead))
            ahead += 1 if ahead < 0 else -1
            start = ev
        if ahead:
            stretches.append((start, len(tasks), -ahead, -ahead))
        elif mem[start] > cap:  # the walks meet at `start`, which is checked too
            return False
        if any((dm > 0 or not self.under_cap) and e > s and max(mem[s:e]) + dm > cap for s, e, dm, _ in stretches):
            return False
        for s, e, dm, dw in stretches:
            if dm:
                mem[s:e] = [x + dm for x in mem[s:e]]
            if dw:
                before[s + 1 : e + 1] = [x + dw for x in before[s + 1 : e + 1]]
        tasks[old], tasks[new] = None, a
        before[old] += _TAKEN
        before[new] -= _TAKEN
        return True


def squeeze_slots(p: int, slots: list[_FB], cap: int) -> list[_FB]:
    """Move every F and B to the earliest free slot its inputs allow, keeping peak memory <= cap.

    Tasks are visited in slot order (so their inputs are placed already); the memory of a rank is
    what `_with_w` gives, W's filling the free slots. Moving a task only changes the memory from
    its new slot on, until the rank's state (memory, W's waiting) meets the old one again, so each
    try checks only that stretch (`_Rank.try_move`).
    """
    n = 2 * p
    rank_of = list(range(p)) + list(reversed(range(p)))
    slot_of = {a: t for fb in slots for t, a in fb.items()}
    ranks = [_Rank(fb, cap) for fb in slots]

    def deps_ready(a: Action) -> int:
        dep = input_of(a, n)
        ready = slot_of[dep] + 1 if dep is not None else 0
        # and after the previous microbatch's task of the same kind and stage (visited before it,
        # its slot final): each kind of a stage stays in microbatch order, and an F of the first
        # stage, which has no input, no longer tries every free slot back to 0 (quadratic in m)
        if a.microbatch > 0:
            ready = max(ready, slot_of[Action(a.kind, a.stage, a.microbatch - 1)] + 1)
        return ready

    for a in sorted(slot_of, key=lambda x: (slot_of[x], rank_of[x.stage])):
        rank, old = ranks[rank_of[a.stage]], slot_of[a]
        new = rank.free_slot(deps_ready(a), old)
        while new < old:
            if rank.try_move(a, old, new):
                slot_of[a] = new
                break
            new = rank.free_slot(new + 1, old)
    return [{t: a for t, a in enumerate(rank.tasks) if a is not None} for rank in ranks]


def _controllable(name: str, p: int, m: int, block: Callable[[int, int], tuple[int, ...]], kind: str) -> Schedule:
    slots = squeeze_slots(p, _repeat_block(p, m, block), v_cap(p, kind))
    return from_orders(name, v_placement(p), m, [_with_w(fb)[0] for fb in slots])


def v_half(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Half: a V schedule with about half of 1F1B's activation memory, 2*floor((p+2)/2) V stages.

    >>> from zbpp.schedules import build, simulate, Costs, Memory
    >>> res = simulate(build("v-half", num_ranks=4, num_microbatches=12), Costs(1, 1, 1), Memory(1, 1))
    >>> max(res.peak_memory), round(res.bubble_rate, 3)
    (6.0, 0.065)
    """
    return _controllable("v-half", num_ranks, num_microbatches, _v_half_block, "half")


def v_min(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Min: a V schedule with about a third of 1F1B's activation memory, 2*floor((p+4)/3) V stages.

    >>> from zbpp.schedules import build, simulate, Costs, Memory
    >>> max(simulate(build("v-min", num_ranks=8, num_microbatches=24), Costs(1, 1, 1), Memory(1, 1)).peak_memory)
    8.0
    """
    return _controllable("v-min", num_ranks, num_microbatches, _v_min_block, "min")


#: The schedules of this module, for the registry: name -> (generator, task count; see
#: `zbpp.schedules.registry.register`)
GENERATORS = {"zb-v": (zb_v, _zbv_tasks, v_stages), "v-half": (v_half, _v_tasks, v_stages),
              "v-min": (v_min, _v_tasks, v_stages)}
