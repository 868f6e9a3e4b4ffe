"""Pick the fastest schedule for measured costs within a memory limit.

`pick_schedule` builds every candidate schedule (the fixed ones and the automatic ones), simulates
each with the given costs and memory model, and returns the fastest (shortest `makespan`, the
step time) whose simulated peak memory fits `memory_limit` on every rank.

Costs and memory are given **per rank-stage**: for the one-stage-per-rank split of the model
(rank r holds the r-th of p equal contiguous parts), as ``Costs.from_task_times`` returns them for a
schedule such as ``zb-h1``. A candidate with more stages than ranks (interleaved, V) cuts the same
model into n smaller contiguous stages; stage s covers the model's part [s/n, (s+1)/n), so its F,
B and W times, its activation and its wgrad memory are those of the rank-stages it overlaps, in
proportion to the overlap. For n = k p that is the cost of rank-stage ``s // k`` divided by k:
a V stage (k = 2) costs half of the rank-stage it lies in. The message time ``comm`` is not
scaled (a message between two stages carries one activation, whatever the split). This assumes a
rank-stage's time is spread evenly over its layers: an embedding or a head makes the first or last
part heavier, which the scaling averages out.

>>> from zbpp.schedules import Costs, Memory
>>> names = ["gpipe", "1f1b", "zb-h1", "zb-v"]
>>> slow = Costs(f=1.0, b=1.0, w=1.0, comm=100.0)        # a very slow link
>>> pick = pick_schedule(2, 4, slow, memory=Memory(1, 0.5), candidates=names)
>>> pick.name, pick.result.makespan                        # one round trip of messages
('gpipe', 215.0)
>>> pick_schedule(2, 4, slow, memory=Memory(1, 0.5), memory_limit=2, candidates=names).name
'zb-h1'
>>> name, schedule, result = pick_schedule(4, 8, Costs(1, 1, 1), memory=Memory(1, 1/3), memory_limit=4,
...                                        candidates=names)
>>> name, result.bubble_rate, max(result.peak_memory)      # zero bubble within 1F1B's memory
('zb-v', 0.0, 4.0)
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Iterable, NamedTuple, Sequence

from .checks import as_positive
from .ir import Schedule
from .registry import available, build, options_of, stage_count
from .simulate import Costs, Memory, SimResult, simulate

__all__ = ["Candidate", "Pick", "evaluate_candidates", "pick_schedule", "scale_to_stages"]

_REL = 1e-9  # float sums of many task times: equal within rounding counts as a tie


class Candidate(NamedTuple):
    """One schedule that `evaluate_candidates` considered."""

    name: str
    schedule: Schedule | None  #: None when it cannot be built for these sizes (see `error`)
    result: SimResult | None  #: its simulation with the scaled costs and memory
    fits: bool  #: simulated peak memory within the limit on every rank (True without a limit)
    error: str | None = None  #: why it could not be built


class Pick(NamedTuple):
    """What `pick_schedule` returns: unpacks as ``name, schedule, result``."""

    name: str
    schedule: Schedule
    result: SimResult


def _per_rank_stage(value: float | Sequence[float], num_ranks: int, what: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * num_ranks
    values = [float(v) for v in value]
    if len(values) != num_ranks:
        raise ValueError(
            f"{what} has {len(values)} values; give one number, or one per rank-stage of the "
            f"one-stage-per-rank split (num_ranks={num_ranks})"
        )
    return values


def _split(per_rank: list[float], num_stages: int) -> list[float]:
    """Each of `num_stages` equal contiguous stages' share of the rank-stage values."""
    p, n = len(per_rank), num_stages
    out = []
    for s in range(n):
        lo, hi = Fraction(s, n), Fraction(s + 1, n)
        share = Fraction(0)
        for q in range(p):
            overlap = min(hi, Fraction(q + 1, p)) - max(lo, Fraction(q, p))
            if overlap > 0:
                share += overlap * p * Fraction(per_rank[q])  # overlap * p: the fraction of rank-stage q
        out.append(float(share))
    return out


def _largest_overlapped(per_rank: list[float], num_stages: int) -> list[float]:
    """Each of `num_stages` equal contiguous stages: the largest value of the rank-stages it overlaps."""
    p, n = len(per_rank), num_stages
    return [max(v for q, v in enumerate(per_rank) if Fraction(q, p) < Fraction(s + 1, n) and Fraction(s, n) < Fraction(q + 1, p))
            for s in range(n)]


def scale_to_stages(costs: Costs, memory: Memory, num_ranks: int, num_stages: int) -> tuple[Costs, Memory]:
    """Costs and memory per rank-stage, scaled to `num_stages` equal contiguous stages.

    Times, activation and wgrad are split in proportion to the overlap (module docstring). A task's
    transient (`Memory.transient_f`, ...) is a peak within one task, not a sum over layers: each
    stage keeps the largest of the rank-stages it overlaps (exact for ``num_stages == num_ranks``).

    >>> c, mem = scale_to_stages(Costs(f=(2, 4), b=2, w=1, comm=3.0), Memory(1, 0.5, transient_b=(3, 0)), 2, 4)
    >>> c.f, c.b, c.comm, mem.activation, mem.transient_b
    ((1.0, 1.0, 2.0, 2.0), (1.0, 1.0, 1.0, 1.0), 3.0, (0.5, 0.5, 0.5, 0.5), (3.0, 3.0, 0.0, 0.0))
    """
    def scaled(value: float | Sequence[float], what: str) -> tuple[float, ...]:
        return tuple(_split(_per_rank_stage(value, num_ranks, what), num_stages))

    def peaks(what: str) -> tuple[float, ...]:
        per_rank = _per_rank_stage(getattr(memory, what), num_ranks, f"memory.{what}")
        return tuple(_largest_overlapped(per_rank, num_stages))

    return (
        replace(costs, f=scaled(costs.f, "costs.f"), b=scaled(costs.b, "costs.b"), w=scaled(costs.w, "costs.w")),
        # the transients too: without them every candidate's peak, and so its fit, ignores them
        Memory(activation=scaled(memory.activation, "memory.activation"), wgrad=scaled(memory.wgrad, "memory.wgrad"),
               transient_f=peaks("transient_f"), transient_b=peaks("transient_b"), transient_w=peaks("transient_w")),
    )


def _num_stages(name: str, num_ranks: int) -> int:
    """How many stages schedule `name` cuts the model into on `num_ranks` ranks (m does not matter),
    counted without building it: an automatic one would run its whole search."""
    return stage_count(name, num_ranks)


def evaluate_candidates(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs,
    *,
    memory: Memory | None = None,
    memory_limit: float | None = None,
    candidates: Iterable[str] | None = None,
) -> list[Candidate]:
    """Build and simulate every candidate; fitting ones first, fastest first.

    Arguments as for `pick_schedule`. Order: those that fit `memory_limit` before those that do
    not and those that cannot be built; among them by simulated makespan, then by largest
    per-rank peak memory, then in the order of `candidates`.
    """
    if not isinstance(costs, Costs):
        raise TypeError(f"costs must be a zbpp.schedules.Costs (per rank-stage), got {type(costs).__name__}")
    memory = Memory() if memory is None else memory
    if not isinstance(memory, Memory):
        raise TypeError(f"memory must be a zbpp.schedules.Memory (per rank-stage) or None, got {type(memory).__name__}")
    if memory_limit is not None:
        # finite: None is no limit here; inf would lift the automatic candidates' default limit too
        try:
            memory_limit = as_positive(memory_limit, "memory_limit")
        except ValueError:
            raise ValueError(f"memory_limit must be a finite number > 0 (per rank, in the units of memory) or None "
                             f"(no limit), got {memory_limit!r}") from None
    if not isinstance(num_ranks, int) or isinstance(num_ranks, bool) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
    names = available() if candidates is None else list(candidates)
    if not names:
        raise ValueError("candidates is empty: give schedule names (see zbpp.schedules.available())")
    known = available()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"candidates: unknown schedule(s) {', '.join(map(repr, unknown))}; available: {', '.join(known)}")
    # Scaled once per stage count; this also checks the per-rank-stage lengths up front.
    scaled: dict[int, tuple[Costs, Memory]] = {num_ranks: scale_to_stages(costs, memory, num_ranks, num_ranks)}

    built: list[tuple[int, Candidate]] = []  # (position in candidates, outcome)
    failed: list[Candidate] = []
    for order, name in enumerate(names):
        try:
            n = _num_stages(name, num_ranks)
            if n not in scaled:
                scaled[n] = scale_to_stages(costs, memory, num_ranks, n)
            c, mem = scaled[n]
            opts = options_of(name)
            kwargs = {k: v for k, v in (("costs", c), ("memory", mem), ("memory_limit", memory_limit)) if k in opts}
            sched = build(name, num_ranks=num_ranks, num_microbatches=num_microbatches, **kwargs)
        except ValueError as exc:  # e.g. sizes the generator does not take, or an infeasible limit
            failed.append(Candidate(name, None, None, False, f"{type(exc).__name__}: {exc}"))
            continue
        res = simulate(sched, c, mem)
        fits = memory_limit is None or _peak(res) <= memory_limit * (1 + _REL)
        built.append((order, Candidate(name, sched, res, fits)))
    fitting = _rank([x for x in built if x[1].fits])
    too_big = _rank([x for x in built if not x[1].fits])
    return fitting + too_big + failed


def _peak(res: SimResult) -> float:
    return max(res.peak_memory) if res.peak_memory else 0.0


def _rank(items: list[tuple[int, Candidate]]) -> list[Candidate]:
    """Fastest first; makespans equal within rounding tie, and then lower peak memory, then the
    earlier candidate, goes first."""
    items = sorted(items, key=lambda x: x[1].result.makespan)  # type: ignore[union-attr]
    out: list[Candidate] = []
    i = 0
    while i < len(items):
        top = items[i][1].result.makespan  # type: ignore[union-attr]
        j = i + 1
        while j < len(items) and items[j][1].result.makespan <= top + _REL * max(1.0, abs(top)):  # type: ignore[union-attr]
            j += 1
        out += [c for _, c in sorted(items[i:j], key=lambda x: (_peak(x[1].result), x[0]))]  # type: ignore[arg-type]
        i = j
    return out


def pick_schedule(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs,
    *,
    memory: Memory | None = None,
    memory_limit: float | None = None,
    candidates: Iterable[str] | None = None,
) -> Pick:
    """The fastest schedule for `costs` whose simulated peak memory fits `memory_limit`.

    Args:
        num_ranks, num_microbatches: the pipeline's size.
        costs: F, B, W time per rank-stage (a number, or one per rank of the one-stage-per-rank
            split) and the message time ``comm``; scaled to each candidate's stages as the
            module docstring says.
        memory: activation and wgrad memory per rank-stage and microbatch (default ``Memory()``:
            activation 1, wgrad 0); scaled like the costs, its transients as `scale_to_stages` says.
        memory_limit: per rank, in the units of `memory`; None: no limit (the automatic
            schedules then use their default, 1F1B's memory).
        candidates: schedule names; default every registered one (`available()`). Options other
            than ``costs``, ``memory`` and ``memory_limit`` keep their defaults (interleaved-1f1b:
            chunks=2). A candidate that cannot be built for these sizes is skipped.

    Returns a `Pick` ``(name, schedule, result)``; `result` is the simulation in the candidate's
    own stages. Ties (equal makespan within rounding) go to the lower peak memory, then to the
    earlier candidate. Raises `ValueError` when no candidate fits, naming the smallest peak.
    `evaluate_candidates` returns every candidate's outcome.

    >>> from zbpp.schedules import Costs, Memory
    >>> pick = pick_schedule(4, 8, Costs(f=1, b=1, w=1), memory=Memory(activation=1, wgrad=1/3),
    ...                      memory_limit=4, candidates=["1f1b", "zb-h1", "zb-h2"])  # zb-h2 peaks above 4
    >>> pick.name, round(pick.result.bubble_rate, 4), max(pick.result.peak_memory)
    ('zb-h1', 0.1111, 4.0)
    """
    ranked = evaluate_candidates(
        num_ranks, num_microbatches, costs, memory=memory, memory_limit=memory_limit, candidates=candidates
    )
    best = ranked[0]
    if not best.fits:
        built = [c for c in ranked if c.result is not None]
        if not built:
            reasons = "; ".join(f"{c.name}: {c.error}" for c in ranked)
            raise ValueError(f"no candidate schedule can be built for num_ranks={num_ranks}, "
                             f"num_microbatches={num_microbatches}: {reasons}")
        low = min(built, key=lambda c: _peak(c.result))  # type: ignore[arg-type]
        raise ValueError(
            f"memory_limit={memory_limit:g} fits no candidate schedule; the smallest simulated peak is "
            f"{_peak(low.result):g} ({low.name}), in the units of memory"  # type: ignore[union-attr]
        )
    assert best.schedule is not None and best.result is not None
    return Pick(best.name, best.schedule, best.result)
