"""Event simulator: when each task runs, and how much memory each rank holds.

The model is docs/DESIGN.md's: a task starts when its rank is free and all its inputs have arrived;
`comm` is added on every data edge that crosses ranks; memory per stage follows
F: +activation, B: -(activation - wgrad), W: -wgrad, BW: -activation, and a task's peak is the
memory before it plus its transient (`Memory`).

>>> from zbpp.schedules import build, simulate, Costs, Memory
>>> res = simulate(build("1f1b", num_ranks=4, num_microbatches=8), Costs(1, 1, 1))
>>> res.cost, round(res.bubble_rate, 4)
(33.0, 0.2727)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

from .checks import as_int, as_number, as_numbers
from .ir import Action, Schedule, ScheduleError
from .replay import replay
from .tasks import KINDS, TaskIds, kind_id

__all__ = ["Costs", "Memory", "SimResult", "simulate", "fit_message_overhead", "check_costs_memory"]

PerStage = Union[float, Sequence[float]]


def _per_stage(value: PerStage, num_stages: int, what: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * num_stages
    values = [float(v) for v in value]
    if len(values) != num_stages:
        raise ValueError(f"{what} has {len(values)} per-stage values but the schedule has {num_stages} stages")
    return values


@dataclass(frozen=True)
class Costs:
    """Time of F, B and W per stage (a number, or one number per stage); BW costs b + w.

    `comm` is the time a message takes on every edge that crosses ranks (never on same-rank edges).
    `message_overhead` is the compute time a rank loses for each message it sends or receives:
    a message's copies share the GPU with the task that runs beside them (large on NCCL over
    sockets; docs/benchmarks.md). `charged`
    folds it into the F and B (and BW) of the stages that exchange messages; `simulate`,
    `lower_bound`, the program and the automatic schedules use the charged costs, so a schedule that
    sends fewer messages wins where the overhead is large. Every value must be a finite real
    number >= 0 (a `ValueError` names the one that is not); they are stored as floats, per-stage
    values as tuples.

    >>> Costs(f=2, b=[1, 3], w=0.5)
    Costs(f=2.0, b=(1.0, 3.0), w=0.5, comm=0.0, message_overhead=0.0)
    >>> Costs(f=[1, float("nan")])
    Traceback (most recent call last):
    ValueError: Costs.f[1] must be a finite number >= 0, got nan
    """

    f: PerStage = 1.0
    b: PerStage = 1.0
    w: PerStage = 1.0
    comm: float = 0.0
    message_overhead: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f", "b", "w"):
            object.__setattr__(self, name, as_numbers(getattr(self, name), f"Costs.{name}"))
        for name in ("comm", "message_overhead"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real):
                raise ValueError(f"Costs.{name} must be a finite number >= 0 (one time for every message), got {value!r}")
            object.__setattr__(self, name, as_number(value, f"Costs.{name}"))

    def charged(self, placement: Sequence[int]) -> "Costs":
        """These costs with `message_overhead` added to every task that sends or receives a
        message under `placement` (the rank of each stage), and `message_overhead` then 0.

        A stage's F receives from the stage before it and sends to the one after it; its B (or BW)
        the other way round: each pays the overhead once per neighbour on another rank. W never
        communicates. Returns `self` when there is no overhead.

        >>> Costs(f=2, b=1, w=1, message_overhead=0.25).charged([0, 1, 1, 0])  # V: stages 0|1, 2|3 cross
        Costs(f=(2.25, 2.25, 2.25, 2.25), b=(1.25, 1.25, 1.25, 1.25), w=1.0, comm=0.0, message_overhead=0.0)
        >>> Costs(f=2, message_overhead=0.25).charged([0, 0, 1]).f  # stage 0 hands over in memory
        (2.0, 2.25, 2.25)
        """
        if self.message_overhead == 0:
            return self
        n = len(placement)
        f, b, _ = self.per_stage(n)

        def messages(s: int) -> int:
            return sum(1 for t in (s - 1, s + 1) if 0 <= t < n and placement[t] != placement[s])

        extra = [self.message_overhead * messages(s) for s in range(n)]
        return replace(self, f=tuple(x + e for x, e in zip(f, extra)), b=tuple(x + e for x, e in zip(b, extra)),
                       message_overhead=0.0)

    def per_stage(self, num_stages: int) -> tuple[list[float], list[float], list[float]]:
        return (
            _per_stage(self.f, num_stages, "Costs.f"),
            _per_stage(self.b, num_stages, "Costs.b"),
            _per_stage(self.w, num_stages, "Costs.w"),
        )

    @classmethod
    def from_task_times(
        cls, records: Iterable[Mapping[str, Any]], num_stages: int, *, comm: float = 0.0, message_overhead: float = 0.0
    ) -> "Costs":
        """Mean measured F, B and W time of each stage, from the task records of a run.

        `records` are dicts ``{"action": "F0.3", "start": s, "end": e, ...}`` (as
        ``Pipeline(record_task_times=True)`` returns; times in seconds, so the costs are too). A full
        backward (BW) record is split into B and W by this rule: in the ratio of the same
        stage's mean measured B and W; if that stage has no split records, in the ratio pooled
        over all stages that have them; with no split records at all, half and half (each linear
        layer's dgrad and wgrad are one GEMM of the same size). `comm` and `message_overhead` are
        passed through: records of a step hold each task's compute, not the link's time
        (measure `comm` apart; fit the overhead with `fit_message_overhead`).

        >>> recs = [{"action": "F0.0", "start": 0.0, "end": 1.0}, {"action": "BW0.0", "start": 1.0, "end": 4.0},
        ...         {"action": "F1.0", "start": 1.0, "end": 2.0}, {"action": "B1.0", "start": 2.0, "end": 3.0},
        ...         {"action": "W1.0", "start": 3.0, "end": 3.5}]
        >>> Costs.from_task_times(recs, 2)
        Costs(f=(1.0, 1.0), b=(2.0, 1.0), w=(1.0, 0.5), comm=0.0, message_overhead=0.0)
        """
        num_stages = as_int(num_stages, "Costs.from_task_times: num_stages")  # not 0..-1 in every record's error
        samples = [[[] for _ in KINDS] for _ in range(num_stages)]  # [stage][kind id] -> durations
        for rec in records:
            try:
                action = Action.parse(str(rec["action"]))
                dur = float(rec["end"]) - float(rec["start"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"task record {rec!r}: need 'action' (e.g. 'F0.3'), 'start' and 'end': {exc}") from None
            if not 0 <= action.stage < num_stages:
                raise ValueError(f"task record {rec!r}: stage {action.stage} outside 0..{num_stages - 1}")
            if not math.isfinite(dur):
                raise ValueError(f"task record {rec!r}: 'start' and 'end' must be finite numbers")
            if dur < 0:
                raise ValueError(f"task record {rec!r}: ends before it starts")
            samples[action.stage][kind_id(action.kind)].append(dur)

        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs)

        iF, iB, iW, iBW = (kind_id(k) for k in KINDS)
        split = [(mean(s[iB]), mean(s[iW])) for s in samples if s[iB] and s[iW]]
        pooled = sum(b for b, _ in split) / sum(b + w for b, w in split) if split and sum(b + w for b, w in split) > 0 else 0.5
        f_out, b_out, w_out = [], [], []
        for stage, s in enumerate(samples):
            if not s[iF]:
                raise ValueError(f"no F records for stage {stage}: cannot estimate its forward time")
            own = mean(s[iB]) / (mean(s[iB]) + mean(s[iW])) if s[iB] and s[iW] and mean(s[iB]) + mean(s[iW]) > 0 else None
            ratio = pooled if own is None else own
            bs = s[iB] + [x * ratio for x in s[iBW]]
            ws = s[iW] + [x * (1 - ratio) for x in s[iBW]]
            if not bs or not ws:
                missing = "B" if not bs else "W"
                raise ValueError(f"no {missing} or BW records for stage {stage}: cannot estimate its backward time")
            f_out.append(mean(s[iF]))
            b_out.append(mean(bs))
            w_out.append(mean(ws))
        return cls(f=tuple(f_out), b=tuple(b_out), w=tuple(w_out), comm=comm, message_overhead=message_overhead)


@dataclass(frozen=True)
class Memory:
    """Memory per stage and microbatch: F allocates `activation`; B keeps `wgrad` until W.

    Each is a finite real number >= 0, or one per stage; they are stored as floats and tuples.
    `wgrad` may exceed `activation` where B re-creates what W needs (activation recompute, or
    activations offloaded after F and brought back for B): B then adds ``wgrad - activation``.

    `transient_f`, `transient_b`, `transient_w`: what a task of the stage allocates while it runs
    above the memory held when it starts (a re-run forward in B, the loss's float32 gradients),
    freed by its end but for its delta. A rank's peak is the largest, over its tasks, of the
    memory after the task and the memory before it plus its transient; a BW's transient is its
    B's or, once B's delta is done, its W's: ``max(transient_b, wgrad - activation + transient_w)``.

    >>> from fractions import Fraction
    >>> Memory(activation=[1, 2], wgrad=Fraction(1, 2))
    Memory(activation=(1.0, 2.0), wgrad=0.5)
    >>> Memory(activation=1, wgrad=2).deltas(1)  # F, B, W, BW
    [(1.0, 1.0, -2.0, -1.0)]
    >>> Memory(activation=4, wgrad=1, transient_b=3, transient_w=5).transients(1)  # F, B, W, BW
    [(0.0, 3.0, 5.0, 3.0)]
    """

    activation: PerStage = 1.0
    wgrad: PerStage = 0.0
    transient_f: PerStage = 0.0
    transient_b: PerStage = 0.0
    transient_w: PerStage = 0.0

    def __post_init__(self) -> None:
        lengths = {}
        for name in ("activation", "wgrad", "transient_f", "transient_b", "transient_w"):
            value = as_numbers(getattr(self, name), f"Memory.{name}")
            object.__setattr__(self, name, value)
            if isinstance(value, tuple):
                lengths[name] = len(value)
        (first, n), *rest = list(lengths.items()) or [("", 0)]
        for name, k in rest:
            if k != n:
                raise ValueError(f"Memory.{first} has {n} per-stage values but Memory.{name} has {k}")

    def __repr__(self) -> str:  # the transients only where a task has one
        shown = [f"{k}={getattr(self, k)!r}" for k in ("activation", "wgrad", "transient_f", "transient_b", "transient_w")
                 if k in ("activation", "wgrad") or getattr(self, k) != 0.0]
        return f"Memory({', '.join(shown)})"

    def per_stage(self, num_stages: int) -> tuple[list[float], list[float]]:
        return (_per_stage(self.activation, num_stages, "Memory.activation"),
                _per_stage(self.wgrad, num_stages, "Memory.wgrad"))

    def deltas(self, num_stages: int) -> list[tuple[float, float, float, float]]:
        """Per stage, the memory change of F, B, W and BW."""
        act, wg = self.per_stage(num_stages)
        return [(a, w - a, -w, -a) for a, w in zip(act, wg)]

    def transients(self, num_stages: int) -> list[tuple[float, float, float, float]]:
        """Per stage, the transient of F, B, W and BW (above the memory held when the task starts)."""
        act, wg = self.per_stage(num_stages)
        tf, tb, tw = (_per_stage(getattr(self, k), num_stages, f"Memory.{k}")
                      for k in ("transient_f", "transient_b", "transient_w"))
        return [(f, b, w, max(b, g - a + w)) for a, g, f, b, w in zip(act, wg, tf, tb, tw)]

    def without_transients(self) -> "Memory":
        """The same kept bytes, no transient (what the automatic schedules' builders plan on)."""
        return Memory(activation=self.activation, wgrad=self.wgrad)


def check_costs_memory(where: str, costs: object, memory: object) -> None:
    """Raise `TypeError` naming `where` and the argument unless `costs` is a `Costs` and `memory` a
    `Memory` (None, the default, passes): a wrong type (Memory passed as costs, a dict) would
    otherwise fail deep inside as an AttributeError that names neither."""
    for key, value, kind in (("costs", costs, Costs), ("memory", memory, Memory)):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{where}: {key} must be a zbpp.schedules.{kind.__name__} (or None: the default), "
                            f"got {value!r:.60} ({type(value).__name__})")


def _check_finite(where: str, last_end: float, peaks: Sequence[float]) -> None:
    """Refuse a result whose sums overflowed a float: costs or memory near 1.8e308 add up to inf
    (and inf - inf to nan), which would otherwise pass for a makespan, bubble rate or peak."""
    if not math.isfinite(last_end):
        raise ValueError(f"{where}: the step's times overflow a float (the last task ends at {last_end}); the costs "
                         "are too large: give them in a larger unit")
    bad = [r for r, x in enumerate(peaks) if not math.isfinite(x)]
    if bad:
        raise ValueError(f"{where}: rank {bad[0]}'s memory overflows a float (peak {peaks[bad[0]]}); the memory "
                         "per stage is too large: give it in a larger unit")


@dataclass
class SimResult:
    """What `simulate` computes. Times are in the units of `Costs`; memory in those of `Memory`."""

    schedule: Schedule
    start: Mapping[Action, float]  #: per task (read like a dict)
    end: Mapping[Action, float]
    spans: list[float]  #: per rank: end of its last task minus start of its first
    busy_per_rank: list[float]  #: per rank: total task time
    makespan: float  #: end of the last task minus start of the first, over all ranks
    peak_memory: list[float]  #: per rank: the most held after a task or, during one, before it plus its transient
    memory_after: Mapping[Action, float] = field(repr=False, default_factory=dict)  #: rank memory after each task

    @property
    def cost(self) -> float:
        """The longest span of one rank."""
        return max(self.spans) if self.spans else 0.0

    @property
    def busy(self) -> float:
        """The largest total task time of one rank."""
        return max(self.busy_per_rank) if self.busy_per_rank else 0.0

    @property
    def bubble_rate(self) -> float:
        """(cost - busy) / cost: the idle fraction of the busiest rank's span."""
        c = self.cost
        return (c - self.busy) / c if c > 0 else 0.0

    @property
    def bubble_per_rank(self) -> list[float]:
        return [s - b for s, b in zip(self.spans, self.busy_per_rank)]

    def summary(self) -> str:
        peaks = ", ".join(f"{x:g}" for x in self.peak_memory)
        return (
            f"{self.schedule.name or 'schedule'}: ranks={self.schedule.num_ranks} "
            f"microbatches={self.schedule.num_microbatches} makespan={self.makespan:g} "
            f"bubble_rate={self.bubble_rate:.4f} peak_memory=[{peaks}]"
        )


class _TaskTable(Mapping[Action, float]):
    """Read-only ``Action -> float`` view of one of simulate's per-task arrays.

    Lookups compute the task's integer id instead of hashing the Action, so building a result
    costs nothing per task; it behaves like a dict for reading (``[a]``, ``in``, ``get``, ``items``).
    """

    __slots__ = ("_schedule", "_ids", "_values", "_present", "_task_ids")

    def __init__(self, schedule: Schedule, ids: list[list[int]], values: list, present: bytearray) -> None:
        self._schedule, self._ids, self._values, self._present = schedule, ids, values, present
        self._task_ids = TaskIds(schedule.num_stages, schedule.num_microbatches)

    def _index(self, action: object) -> int:
        if isinstance(action, Action):
            ids = self._task_ids
            if 0 <= action.stage < ids.num_stages and 0 <= action.microbatch < ids.num_microbatches:
                t = ids.of(action)
                if self._present[t]:
                    return t
        raise KeyError(action)

    def __getitem__(self, action: Action) -> float:
        return self._values[self._index(action)]

    def __contains__(self, action: object) -> bool:
        try:
            self._index(action)
        except KeyError:
            return False
        return True

    def __iter__(self):  # rank by rank, each rank in order (as the dict this replaces)
        for order in self._schedule.orders:
            yield from order

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._ids)

    def values(self) -> list[float]:  # type: ignore[override]
        vals = self._values
        return [vals[t] for ids in self._ids for t in ids]

    def items(self) -> list[tuple[Action, float]]:  # type: ignore[override]
        return list(zip(self, self.values()))

    def __repr__(self) -> str:
        return repr(dict(self.items()))


def simulate(schedule: Schedule, costs: Costs | None = None, memory: Memory | None = None) -> SimResult:
    """Simulate `schedule` under `costs` (default unit F=B=W=1) and `memory` (default activation 1).

    Raises `ScheduleError` (naming the cycle) if the schedule deadlocks, or naming a missing task;
    `ValueError` if costs or memory are so large that their sums overflow a float.
    Runs in O(tasks) integer work, without hashing a task; 50k tasks take a few tens of ms.

    >>> from zbpp.schedules import build
    >>> res = simulate(build("zb-h1", num_ranks=4, num_microbatches=8), Costs(f=1, b=1, w=1),
    ...                Memory(activation=1, wgrad=1/3))
    >>> res.spans, round(res.bubble_rate, 4), [round(m, 2) for m in res.peak_memory]
    ([27.0, 26.0, 25.0, 24.0], 0.1111, [4.0, 3.33, 2.67, 2.0])
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"simulate: schedule must be a zbpp.schedules.Schedule (e.g. build(...)), "
                        f"got {schedule!r:.60} ({type(schedule).__name__})")
    check_costs_memory("simulate", costs, memory)
    costs = (costs or Costs()).charged(schedule.placement)
    memory = memory or Memory()
    n, m = schedule.num_stages, schedule.num_microbatches
    f, b, w = costs.per_stage(n)
    deltas = memory.deltas(n)
    ids = TaskIds(n, m)
    orders, present = ids.encode(schedule)
    dur = ids.per_task([f, b, w, [bi + wi for bi, wi in zip(b, w)]])
    start = [0.0] * ids.size
    end = [-1.0] * ids.size
    if not replay(orders, ids.inputs(present), dur, ids.lags(schedule.placement, float(costs.comm)), start, end):
        from .dag import validate

        validate(schedule)  # names the cycle
        raise ScheduleError("simulation stalled although the schedule validates (please report)")

    # memory and work follow each rank's order, whatever the times; a task's transient rises
    # above what its rank held when it started
    delta = ids.per_task(list(zip(*deltas)))
    transient = ids.per_task(list(zip(*memory.transients(n))))
    mem_after = [0.0] * ids.size
    peak = []
    busy = []
    for order in orders:
        mem = top = work = 0.0
        for t in order:
            work += dur[t]
            if mem + transient[t] > top:
                top = mem + transient[t]
            mem += delta[t]
            mem_after[t] = mem
            if mem > top:
                top = mem
        peak.append(top)
        busy.append(work)

    spans = []
    first_start = float("inf")
    last_end = 0.0
    for order in orders:
        if not order:
            spans.append(0.0)
            continue
        s0 = start[order[0]]
        e1 = end[order[-1]]
        spans.append(e1 - s0)
        first_start = min(first_start, s0)
        last_end = max(last_end, e1)
    makespan = last_end - first_start if first_start != float("inf") else 0.0
    _check_finite("simulate", last_end, peak)
    return SimResult(
        schedule=schedule,
        start=_TaskTable(schedule, orders, start, present),
        end=_TaskTable(schedule, orders, end, present),
        spans=spans,
        busy_per_rank=busy,
        makespan=makespan,
        peak_memory=peak,
        memory_after=_TaskTable(schedule, orders, mem_after, present),
    )


def fit_message_overhead(
    schedule: Schedule,
    costs: Costs,
    makespan: float,
    *,
    rel_tol: float = 1e-4,
    predict: Callable[[Costs], float] | None = None,
) -> float:
    """The `Costs.message_overhead` under which `schedule` simulates to a measured `makespan`.

    A calibration: time one schedule, turn its task times into `costs` (``Costs.from_task_times``),
    and the overhead that closes the gap between its simulated and measured step is what
    the link took from compute per message; `simulate`, the pick and the automatic schedules can
    then predict the other schedules with it. Measuring it directly (GEMMs timed beside one
    message) misses most of it on NCCL over sockets. The makespan of a fixed schedule never falls when a
    task grows, so a bisection finds the smallest overhead that reaches `makespan` (to a
    relative `rel_tol`); 0 when the schedule already simulates at or above it. `costs`'s own
    overhead is ignored. `predict` maps costs to a predicted step (default: `simulate`'s makespan;
    ``lambda c: program_makespan(program, c)`` fits what a runtime program's message timing leaves over).
    Raises `ValueError` for a `makespan` that is not a finite number > 0, or for a schedule that
    sends no message (nothing to fit).

    >>> from zbpp.schedules import build
    >>> sched = build("1f1b", num_ranks=2, num_microbatches=4)
    >>> measured = simulate(sched, Costs(1, 1, 1, comm=0.5, message_overhead=0.2)).makespan
    >>> round(fit_message_overhead(sched, Costs(1, 1, 1, comm=0.5), measured), 3)
    0.2
    >>> fit_message_overhead(sched, Costs(1, 1, 1), 1.0)  # faster than simulated: no overhead
    0.0
    """
    if not isinstance(makespan, numbers.Real) or not math.isfinite(makespan) or makespan <= 0:
        raise ValueError(f"fit_message_overhead: makespan must be a finite number > 0 (the measured step), got {makespan!r}")
    if len(set(schedule.placement)) < 2:
        raise ValueError(
            f"fit_message_overhead: schedule {schedule.name!r} runs on one rank and sends no message; "
            "fit the overhead on a schedule whose stages span ranks"
        )
    costs = replace(costs, message_overhead=0.0)

    def step(overhead: float) -> float:
        charged = replace(costs, message_overhead=overhead)
        return simulate(schedule, charged).makespan if predict is None else predict(charged)

    if step(0.0) >= makespan:
        return 0.0
    lo, hi = 0.0, makespan
    for _ in range(64):  # under `simulate` one step is enough: a task that sends then takes `makespan` itself
        if step(hi) >= makespan:
            break
        lo, hi = hi, 2 * hi
    else:
        raise ValueError(f"fit_message_overhead: no overhead up to {hi:g} reaches the makespan {makespan!r}; "
                         "does `predict` use the costs' message_overhead?")
    for _ in range(200):  # halves [lo, hi] until it is within rel_tol of the overhead
        if hi - lo <= rel_tol * hi:
            break
        mid = (lo + hi) / 2
        if step(mid) < makespan:
            lo = mid
        else:
            hi = mid
    return hi
