"""Which task feeds which, and tasks as integers: the one definition both live in.

The data edges of docs/DESIGN.md ("The task graph"): every task consumes the output of at most
one other task of the same microbatch, its *input*:

====================  ==============================================================
task                  its input
====================  ==============================================================
``F(s, j)``           ``F(s-1, j)``; none on the first stage
``B(s, j)``           ``F(s, j)`` on the last stage, else the backward of ``(s+1, j)``
``W(s, j)``           ``B(s, j)``
``BW(s, j)``          as ``B(s, j)``
====================  ==============================================================

where "the backward of (s, j)" is ``B(s, j)`` where the schedule splits that backward and
``BW(s, j)`` where it does not. `input_block` states the rule; everything else here derives from
it: `input_of` and `data_dependencies` / `data_consumers` on `Action`s, `TaskIds.input` and the
table `TaskIds.inputs` on integers. Validation, the simulator, the program, the lower
bound, the exact solver, V-Half/V-Min's slot squeezing and the automatic schedules' heuristics
and searches take the rule from here.

Integers. With n stages and m microbatches, task ``(kind, stage, mb)`` is the integer
``kind * n*m + stage * m + mb``, kinds numbered F=0, B=1, W=2, BW=3 (`KINDS`): one block of n*m
ids per kind, stage-major, so a list indexed by task id (a *table*) replaces a dict keyed by
`Action` in hot loops. `TaskIds` converts both ways and builds the tables the loops index.

>>> from zbpp.schedules.ir import Action, Kind
>>> input_of(Action(Kind.B, 2, 5), num_stages=4)
Action(B3.5)
>>> ids = TaskIds(num_stages=4, num_microbatches=8)
>>> t = ids.of(Action(Kind.B, 2, 5))
>>> t, ids.action(ids.input(t))
(53, Action(B3.5))
"""

from __future__ import annotations

from collections import Counter
from typing import Collection, NamedTuple, Sequence, TypeVar

from .ir import Action, Kind, Schedule, ScheduleError

__all__ = ["KINDS", "kind_id", "input_block", "input_of", "data_dependencies", "data_consumers", "TaskIds", "Encoded"]

#: Task kinds in the order of their integer ids.
KINDS = (Kind.F, Kind.B, Kind.W, Kind.BW)
F, B, W, BW = range(4)
#: In `input_block`: B where the backward is split, else BW.
BACKWARD = -1

_T = TypeVar("_T")
_KIND_F, _KIND_B, _KIND_W, _KIND_BW = KINDS


def kind_id(kind: Kind) -> int:
    """The integer of `kind` (F=0, B=1, W=2, BW=3)."""
    # identity tests against module globals: Enum.__hash__ and Kind.F both run Python code, and
    # this runs once per task
    if kind is _KIND_F:
        return F
    if kind is _KIND_B:
        return B
    if kind is _KIND_W:
        return W
    if kind is _KIND_BW:
        return BW
    return KINDS.index(Kind(kind))


def input_block(kind: int, stage: int, num_stages: int) -> tuple[int, int] | None:
    """The rule: (kind, stage) of the input of every `kind` task of `stage` (the same microbatch),
    or None when it has none. The kind `BACKWARD` means B where that backward is split, else BW.

    >>> input_block(F, 0, 4), input_block(F, 2, 4), input_block(B, 3, 4), input_block(BW, 1, 4), input_block(W, 1, 4)
    (None, (0, 1), (0, 3), (-1, 2), (1, 1))
    """
    if kind == F:
        return (F, stage - 1) if stage > 0 else None
    if kind == W:
        return (B, stage)
    if stage == num_stages - 1:  # B or BW of the last stage: its own forward's output
        return (F, stage)
    return (BACKWARD, stage + 1)


def _backward_kind(present: Collection[Action] | None, stage: int, mb: int) -> int:
    """B if the backward of (stage, mb) is split in a schedule of tasks `present` (None: split), else BW."""
    return B if present is None or Action(Kind.B, stage, mb) in present else BW


def input_of(action: Action, num_stages: int, present: Collection[Action] | None = None) -> Action | None:
    """The task whose output `action` consumes, or None.

    `present` is the schedule's set of tasks, which tells B from BW; None means "every backward split".
    """
    blk = input_block(kind_id(action.kind), action.stage, num_stages)
    if blk is None:
        return None
    kind, stage = blk
    if kind == BACKWARD:
        kind = _backward_kind(present, stage, action.microbatch)
    return Action(KINDS[kind], stage, action.microbatch)


def data_dependencies(action: Action, num_stages: int, present: Collection[Action] | None = None) -> list[Action]:
    """The tasks whose outputs `action` consumes (its in-edges of the data DAG): `input_of` as a list."""
    dep = input_of(action, num_stages, present)
    return [] if dep is None else [dep]


def data_consumers(action: Action, num_stages: int, present: Collection[Action] | None = None) -> list[Action]:
    """The tasks that consume `action`'s output (its out-edges of the data DAG), stage by stage.

    Derived from `input_of`: the tasks of the neighbouring stages (the backward of each as
    `present` says) whose input is `action`.

    >>> from zbpp.schedules.ir import Action, Kind
    >>> [str(a) for a in data_consumers(Action(Kind.B, 2, 0), num_stages=4)]
    ['B1.0', 'W2.0']
    """
    s, j = action.stage, action.microbatch
    out = []
    for stage in (s - 1, s, s + 1):
        if not 0 <= stage < num_stages:
            continue
        for kind in (F, BACKWARD, W):
            if kind == BACKWARD:
                kind = _backward_kind(present, stage, j)
            candidate = Action(KINDS[kind], stage, j)
            if input_of(candidate, num_stages, present) == action:
                out.append(candidate)
    return out


class Encoded(NamedTuple):
    """A schedule's rank orders as task ids, and which ids it has (``present[t]`` is 1 or 0)."""

    orders: list[list[int]]
    present: bytearray


class TaskIds:
    """The integer ids of the tasks of `num_stages` stages and `num_microbatches` microbatches.

    >>> ids = TaskIds(num_stages=2, num_microbatches=3)
    >>> ids.id(Kind.W, 1, 2), str(ids.action(13))
    (17, 'W0.1')
    >>> ids.inputs()[:6]  # the F's: stage 0 has no input, F(1, j) consumes F(0, j)
    [-1, -1, -1, 0, 1, 2]
    """

    __slots__ = ("num_stages", "num_microbatches", "nm")

    def __init__(self, num_stages: int, num_microbatches: int) -> None:
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.nm = num_stages * num_microbatches  #: ids per kind

    @property
    def size(self) -> int:
        """The number of ids of all four kinds (the length of a table)."""
        return 4 * self.nm

    # -- conversions ------------------------------------------------------------------------------
    def id(self, kind: Kind | int, stage: int, microbatch: int) -> int:
        k = kind if isinstance(kind, int) else kind_id(kind)
        return k * self.nm + stage * self.num_microbatches + microbatch

    def of(self, action: Action) -> int:
        """The id of `action` (which must lie within the stages and microbatches)."""
        return kind_id(action.kind) * self.nm + action.stage * self.num_microbatches + action.microbatch

    def kind_of(self, task: int) -> int:
        return task // self.nm

    def stage_of(self, task: int) -> int:
        return task % self.nm // self.num_microbatches

    def action(self, task: int) -> Action:
        kind, rest = divmod(task, self.nm)
        stage, mb = divmod(rest, self.num_microbatches)
        return Action(KINDS[kind], stage, mb)

    def decode(self, orders: Sequence[Sequence[int]]) -> list[list[Action]]:
        """Rank orders of ids as rank orders of `Action`s."""
        action = self.action
        return [[action(t) for t in order] for order in orders]

    def encode(self, schedule: Schedule) -> Encoded:
        """`schedule`'s rank orders as ids, and which ids it has: the one check of a task set.

        Raises `ScheduleError` naming the first problem: a task outside the stages or
        microbatches, on another rank than its stage's, repeated, or a (stage, mb) without
        exactly one F and either one BW or one B and one W.

        >>> from zbpp.schedules import build
        >>> sched = build("1f1b", num_ranks=2, num_microbatches=2)
        >>> TaskIds(2, 2).encode(sched).orders  # rank 0: F0.0 F0.1 BW0.0 BW0.1
        [[0, 1, 12, 13], [2, 14, 3, 15]]
        >>> from dataclasses import replace
        >>> TaskIds(2, 2).encode(replace(sched, orders=(sched.orders[0][:-1], sched.orders[1])))
        Traceback (most recent call last):
        zbpp.schedules.ir.ScheduleError: the backward of stage 0 microbatch 1 is missing: no BW0.1, B0.1 or W0.1 (rank 0)
        """
        n, m, nm = self.num_stages, self.num_microbatches, self.nm
        if (schedule.num_stages, schedule.num_microbatches) != (n, m):
            raise ValueError(f"TaskIds for {n} stages and {m} microbatches cannot encode a schedule of "
                             f"{schedule.num_stages} and {schedule.num_microbatches}")
        placement = schedule.placement
        tasks = schedule.num_tasks
        if 2 * nm > tasks and nm > 4 * tasks + 4096:
            # too few tasks for every (stage, mb), and a table of those would dwarf them (a header
            # claiming 10**12 microbatches ended in a MemoryError): what is missing, found without it
            raise ScheduleError(_sparse_problem(schedule))
        present = bytearray(4 * nm)
        orders: list[list[int]] = []
        repeated = False
        for rank, order in enumerate(schedule.orders):
            # per stage: its first id if this rank holds it, else -1 (a task of it is misplaced)
            first = [s * m if r == rank else -1 for s, r in enumerate(placement)]
            ids: list[int] = []
            append = ids.append
            for a in order:  # this runs once per task: kind_id inlined, one lookup per check
                try:
                    s, j = a.stage, a.microbatch
                except AttributeError:  # e.g. the string 'F0.0': a clear error, not an AttributeError
                    raise ScheduleError(_not_an_action(a, rank)) from None
                b = first[s] if 0 <= s < n else -1
                if b < 0 or not 0 <= j < m:
                    raise ScheduleError(_misplaced(a, rank, schedule))
                k = a.kind
                t = (0 if k is _KIND_F else nm if k is _KIND_B else 2 * nm if k is _KIND_W else 3 * nm) + b + j
                if present[t]:
                    repeated = True
                present[t] = 1
                append(t)
            orders.append(ids)
        if repeated:
            counts = Counter(a for order in schedule.orders for a in order)
            a, c = next((a, c) for a, c in counts.items() if c > 1)
            raise ScheduleError(f"task {a} appears {c} times (rank {schedule.rank_of(a.stage)})")
        for sj in range(nm):
            has_b, has_w = present[nm + sj], present[2 * nm + sj]
            if not present[sj] or has_b != has_w or present[3 * nm + sj] == has_b:
                raise ScheduleError(_incomplete(present, sj, self, schedule))
        return Encoded(orders, present)

    # -- the rule on ids ----------------------------------------------------------------------------
    def input(self, task: int, present: bytearray | None = None) -> int:
        """The id of the task whose output `task` consumes, or -1.

        `present` (as `encode` returns it) tells B from BW; None means "every backward split".
        """
        m, nm = self.num_microbatches, self.nm
        kind, rest = divmod(task, nm)
        stage, mb = divmod(rest, m)
        blk = input_block(kind, stage, self.num_stages)
        if blk is None:
            return -1
        k, s = blk
        if k == BACKWARD:
            k = B if present is None or present[nm + s * m + mb] else BW
        return k * nm + s * m + mb

    def inputs(self, present: bytearray | None = None) -> list[int]:
        """The table of `input` over all ids (-1: no input), built a (kind, stage) block at a time."""
        n, m, nm = self.num_stages, self.num_microbatches, self.nm
        table: list[int] = []
        for kind in range(4):
            for stage in range(n):
                blk = input_block(kind, stage, n)
                if blk is None:
                    table += [-1] * m
                    continue
                k, s = blk
                if k == BACKWARD:
                    first_b = nm + s * m
                    split = m if present is None else present[first_b : first_b + m].count(1)
                    if 0 < split < m:  # some backwards of stage s split, some not
                        table += [first_b + j if present[first_b + j] else first_b + 2 * nm + j for j in range(m)]  # type: ignore[index]
                        continue
                    k = B if split else BW
                first = k * nm + s * m
                table += range(first, first + m)
        return table

    def feeds(self, present: bytearray | None = None) -> list[int]:
        """Per id, the F, B or BW task that consumes its output (-1: none): the next task of its
        microbatch's way down and back up the stages. (A B's other consumer is its own W.)

        `present` as for `inputs`; with None, only F and B tasks count (every backward split).
        """
        nm = self.nm
        table = [-1] * (4 * nm)
        inputs = self.inputs(present)
        for t in range(2 * nm) if present is None else (t for t in range(4 * nm) if present[t]):
            d = inputs[t]
            if d >= 0 and t // nm != W:
                table[d] = t
        return table

    def per_task(self, values: Sequence[Sequence[_T]]) -> list[_T]:
        """A table from ``values[kind][stage]`` (kinds in id order; fewer than four gives a shorter table)."""
        m = self.num_microbatches
        table: list[_T] = []
        for row in values:
            for v in row:
                table += [v] * m
        return table

    def lags(self, placement: Sequence[int], comm: float) -> list[float]:
        """Per id, the time from its input's end to its arrival: `comm` where the input comes from
        another rank (a message), 0.0 where it is handed over in memory or there is none.

        >>> TaskIds(4, 1).lags([0, 1, 1, 0], comm=0.5)[:4]  # the F's: stage 2's input is on its rank
        [0.0, 0.5, 0.0, 0.5]
        """
        n = self.num_stages
        per_kind = []
        for kind in range(4):
            row = []
            for stage in range(n):
                blk = input_block(kind, stage, n)
                row.append(comm if blk is not None and placement[blk[1]] != placement[stage] else 0.0)
            per_kind.append(row)
        return self.per_task(per_kind)


def _misplaced(a: Action, rank: int, schedule: Schedule) -> str:
    """Why task `a`, listed on `rank`, does not belong there."""
    n, m = schedule.num_stages, schedule.num_microbatches
    if not 0 <= a.stage < n:
        return f"task {a} on rank {rank}: stage {a.stage} outside 0..{n - 1}"
    if not 0 <= a.microbatch < m:
        return f"task {a} on rank {rank}: microbatch {a.microbatch} outside 0..{m - 1}"
    return f"task {a} is on rank {rank} but stage {a.stage} is placed on rank {schedule.rank_of(a.stage)}"


def _not_an_action(a: object, rank: int) -> str:
    return f"rank {rank}'s order holds {a!r} ({type(a).__name__}), not an Action; write e.g. Action.parse('F0.0')"


def _sparse_problem(schedule: Schedule) -> str:
    """`TaskIds.encode`'s first complaint about a schedule of fewer tasks than its (stage, mb)
    pairs need, found from its tasks alone: a misplaced task, else the first incomplete pair."""
    n, m = schedule.num_stages, schedule.num_microbatches
    kinds: dict[tuple[int, int], set[int]] = {}
    for rank, order in enumerate(schedule.orders):
        for a in order:
            if not isinstance(a, Action):
                return _not_an_action(a, rank)
            if not (0 <= a.stage < n and 0 <= a.microbatch < m) or schedule.placement[a.stage] != rank:
                return _misplaced(a, rank, schedule)
            kinds.setdefault((a.stage, a.microbatch), set()).add(kind_id(a.kind))
    for sj in range(n * m):  # an incomplete pair comes within the first tasks / 2 + 1
        got = kinds.get(divmod(sj, m), set())
        if F not in got or (B in got) != (W in got) or (BW in got) == (B in got):
            return _incomplete_pair(*divmod(sj, m), [k in got for k in range(4)], schedule)
    raise AssertionError("unreachable: fewer tasks than pairs")  # pragma: no cover


def _incomplete(present: bytearray, sj: int, ids: TaskIds, schedule: Schedule) -> str:
    """What is missing or extra among the tasks of (stage, mb) number `sj`."""
    nm = ids.nm
    stage, mb = divmod(sj, ids.num_microbatches)
    return _incomplete_pair(stage, mb, [present[k * nm + sj] for k in range(4)], schedule)


def _incomplete_pair(stage: int, mb: int, has: Sequence[int], schedule: Schedule) -> str:
    """What is missing or extra among the tasks of (`stage`, `mb`); `has`: whether each kind is there."""
    f, b, w, bw = (Action(k, stage, mb) for k in KINDS)
    has_f, has_b, has_w, has_bw = has
    where = f"rank {schedule.rank_of(f.stage)}"
    if not has_f:
        return f"task {f} is missing ({where})"
    if has_bw:
        return f"task {b if has_b else w} duplicates the work of {bw} ({where})"
    if not has_b and not has_w:
        return f"the backward of stage {f.stage} microbatch {f.microbatch} is missing: no {bw}, {b} or {w} ({where})"
    if not has_b:
        return f"task {b} is missing ({where}); {w} has no B to follow"
    return f"task {w} is missing ({where}); {b} is never followed by its weight gradient"
