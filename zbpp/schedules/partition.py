"""Choosing each stage's layers and the schedule together, within a per-rank memory budget.

`search` takes a per-layer `Profile`, p ranks, m microbatches and a memory budget in bytes per
rank that covers everything a rank holds: the static memory of its layers (parameters, gradients,
optimizer state) plus the activations the schedule keeps in flight, as simulated. It tries every
built-in schedule family on its placement (one stage per rank; interleaved with 2, 3 or 4 stages
per rank; V) and the automatic ones, each on several splits of the layers:

- ``count``: as many layers per stage as can be (the remainder to the first stages);
- ``blocks``: the layers between the first and the last split that way, the first layer (an
  embedding) joining stage 0 and the last (a head) the last stage;
- ``time``: the largest stage time F+B+W as small as can be (bisection on it);
- ``params``: the largest stage static memory as small as can be;
- ``ranks``: from ``time``, layers moved off the rank with the most work while that lowers it;
- ``refined``: from the best of these, layers moved off the rank that bounds the simulated step
  (or that exceeds the budget) while the step (or the excess) falls, under the schedule itself.

A candidate fits when static plus simulated activation memory stays within the budget on every
rank; the automatic schedules get as their activation limit the budget less the largest static
memory of a rank. `zbi-auto` runs with the stages per rank that suited `zb-interleaved` best, on
its two best splits and its refined one. The pick is the fitting candidate with the shortest simulated step (makespan),
then the lowest peak. `Layout.explain` says what was chosen and why the others were not.

>>> from zbpp.schedules.profile import transformer_profile
>>> prof = transformer_profile(name="small", num_layers=8, hidden=1024, ffn=4096, heads=16, vocab=32000, seq=2048)
>>> layout = search(prof, num_ranks=4, num_microbatches=8, memory_budget=20e9)
>>> len(layout.stages) == layout.schedule.num_stages, all(x <= 20e9 for x in layout.peak)
(True, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .bounds import LowerBound, lower_bound
from .checks import as_int, as_number
from .ir import Schedule
from .profile import Profile
from .registry import build
from .simulate import SimResult, simulate

__all__ = ["Option", "Layout", "search", "evaluate", "split_evenly", "split_balanced", "SCHEDULES"]

#: The schedules `search` tries, and the stages per rank of each (None: 2, 3 and 4, interleaved).
SCHEDULES: dict[str, int | None] = {
    "1f1b": 1, "zb-h1": 1, "zb-h2": 1, "zb-auto": 1,
    "interleaved-1f1b": None, "zb-interleaved": None, "zbi-auto": None,
    "zb-v": 2, "v-half": 2, "v-min": 2, "dualpipe-v": 2, "zbv-auto": 2,
}
_AUTO = ("zb-auto", "zbv-auto", "zbi-auto")
_INTERLEAVED = ("interleaved-1f1b", "zb-interleaved", "zbi-auto")
_V = ("zb-v", "v-half", "v-min", "dualpipe-v", "zbv-auto")
#: The fixed schedule whose simulated step refines the split for an automatic one.
_PROXY = {"zb-auto": "zb-h1", "zbv-auto": "zb-v", "zbi-auto": "zb-interleaved"}
_REL = 1e-9  # float sums of many task times: equal within rounding counts as a tie
_REFINE_STEPS = 24  # moves of one layer per refined candidate (each a few simulations)


@dataclass(frozen=True)
class Option:
    """One candidate `search` considered: a schedule on a split, simulated."""

    schedule: str
    chunks: int  #: stages per rank
    split: str  #: how the split was made (see the module docstring)
    stages: tuple[range, ...]  #: layer indices of each stage
    step: float  #: simulated makespan (inf when it could not be built)
    peak: tuple[float, ...]  #: per rank: static + simulated activation bytes
    fits: bool
    note: str = ""  #: why it could not be built, if so

    @property
    def label(self) -> str:
        return f"{self.schedule} x{self.chunks}" if self.schedule in _INTERLEAVED else self.schedule

    def key(self, budget: float) -> tuple[float, float, float]:
        """Lower is better: the bytes over the budget, then the step, then the peak."""
        excess = max(0.0, max(self.peak, default=math.inf) - budget) if self.peak else math.inf
        return (excess, self.step, max(self.peak, default=math.inf))


@dataclass(frozen=True)
class Layout:
    """What `search` chose: the schedule, each stage's layers, and the memory per rank."""

    schedule: Schedule
    stages: tuple[range, ...]  #: layer indices of each stage (stage s runs on ``schedule.rank_of(s)``)
    result: SimResult  #: the schedule simulated with the stages' costs and memory
    static: tuple[float, ...]  #: per rank: parameter + gradient + optimizer-state bytes
    peak: tuple[float, ...]  #: per rank: static + the simulated peak of activation bytes
    budget: float
    profile: Profile = field(repr=False)
    options: tuple[Option, ...] = field(repr=False, default=())  #: all candidates, best first
    split: str = ""

    @property
    def step(self) -> float:
        return self.result.makespan

    def bound(self) -> LowerBound:
        """`zbpp.schedules.bounds.lower_bound` for this split and placement: what no schedule of it
        beats within the budget (each rank's limit: the budget less its static memory)."""
        costs, memory, _ = self.profile.stage_costs(self.stages)
        limits = None if not math.isfinite(self.budget) else [self.budget - x for x in self.static]
        return lower_bound(self.schedule.placement, self.schedule.num_microbatches, costs, memory, limits)

    def names(self) -> list[list[str]]:
        """Each stage's layer names (the profile's), e.g. as module FQNs for a stage-splitting helper."""
        return [[self.profile.layers[i].name for i in r] for r in self.stages]

    def explain(self, top: int = 12) -> str:
        """The pick and its memory per rank, then the best candidate of each schedule, best first."""
        s = self.schedule
        lines = [f"pick: {s.name}{' x' + str(s.num_stages // s.num_ranks) if s.num_stages > 2 * s.num_ranks else ''}"
                 f" on the {self.split!r} split: step {self.step:.6g}, bubble rate {self.result.bubble_rate:.4f}, "
                 f"peak {max(self.peak) / 1e9:.2f} GB of {self.budget / 1e9:.2f} GB"]
        lb = self.bound()
        lines.append(f"  no schedule of this split and placement within the budget beats step {lb.makespan:.6g} "
                     f"(the pick: +{max(0.0, 100 * (self.step / lb.makespan - 1)):.2f}%)")
        for r in range(s.num_ranks):
            stages = [f"{st}:{self.profile.layers[self.stages[st][0]].name}..{self.profile.layers[self.stages[st][-1]].name}"
                      f" ({len(self.stages[st])})" for st in s.stages_on(r)]
            lines.append(f"  rank {r}: static {self.static[r] / 1e9:.2f} GB + activations "
                         f"{self.result.peak_memory[r] / 1e9:.2f} GB = {self.peak[r] / 1e9:.2f} GB; stages {', '.join(stages)}")
        lines.append(f"{'candidate':<22} {'split':<8} {'step':>12} {'vs pick':>8} {'peak GB':>9}  fits")
        seen = set()
        for o in self.options:
            if o.label in seen:
                continue
            seen.add(o.label)
            vs = f"{100 * (o.step / self.step - 1):+.1f}%" if math.isfinite(o.step) and self.step > 0 else "-"
            peak = f"{max(o.peak) / 1e9:9.2f}" if o.peak else f"{'-':>9}"
            why = "yes" if o.fits else (o.note or f"no: over the budget by {(max(o.peak) - self.budget) / 1e9:.2f} GB")
            lines.append(f"{o.label:<22} {o.split:<8} {o.step:>12.6g} {vs:>8} {peak}  {why}")
            if len(seen) >= top:
                break
        return "\n".join(lines)


# -- splits --------------------------------------------------------------------------------------
def split_evenly(num_layers: int, num_stages: int, *, first: int = 0, last: int = 0) -> tuple[range, ...]:
    """Consecutive ranges of ``num_layers`` layers, equal in count (the remainder to the first
    stages); the first `first` and last `last` layers are counted apart, joining the first and the
    last stage.

    >>> split_evenly(10, 4)
    (range(0, 3), range(3, 6), range(6, 8), range(8, 10))
    >>> split_evenly(10, 4, first=1, last=1)  # 8 blocks: 2 each, the ends join stages 0 and 3
    (range(0, 3), range(3, 5), range(5, 7), range(7, 10))
    """
    inner = num_layers - first - last
    if num_stages < 1 or inner < num_stages:
        raise ValueError(f"cannot split {inner} layers into {num_stages} stages of at least one")
    base, extra = divmod(inner, num_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    sizes[0] += first
    sizes[-1] += last
    return _ranges(sizes)


def split_balanced(weights: Sequence[float], num_stages: int) -> tuple[range, ...]:
    """Consecutive ranges whose largest sum of `weights` is as small as can be (each non-empty).

    >>> split_balanced([1, 1, 1, 1, 4], 2)
    (range(0, 4), range(4, 5))
    """
    n, L = num_stages, len(weights)
    if n < 1 or L < n:
        raise ValueError(f"cannot split {L} layers into {n} stages of at least one")

    def parts(cap: float) -> list[int] | None:
        """Greedy: each stage takes layers while its sum stays within `cap`; None if more than n."""
        sizes: list[int] = []
        acc = 0.0
        for x in weights:
            if x > cap:
                return None
            if sizes and acc + x <= cap:
                sizes[-1] += 1
                acc += x
            else:
                sizes.append(1)
                acc = x
        return _fill(sizes, n) if len(sizes) <= n else None

    lo, hi = max(weights), sum(weights)
    best = parts(hi)
    for _ in range(100):
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
        mid = (lo + hi) / 2
        got = parts(mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, mid
    if best is None:  # pragma: no cover - parts(sum) always succeeds
        raise AssertionError("split_balanced found no split")
    return _ranges(best)


def _fill(sizes: list[int], n: int) -> list[int] | None:
    """Fewer than n parts: split the largest until there are n (each keeps at least one layer)."""
    sizes = list(sizes)
    while len(sizes) < n:
        i = max(range(len(sizes)), key=lambda k: sizes[k])
        if sizes[i] < 2:
            return None
        half = sizes[i] // 2
        sizes[i:i + 1] = [sizes[i] - half, half]
    return sizes


def _ranges(sizes: Sequence[int]) -> tuple[range, ...]:
    out, at = [], 0
    for size in sizes:
        out.append(range(at, at + size))
        at += size
    return tuple(out)


def _placement(num_ranks: int, chunks: int, v: bool) -> list[int]:
    if v:
        return list(range(num_ranks)) + list(reversed(range(num_ranks)))
    return [s % num_ranks for s in range(num_ranks * chunks)]


def _moves_off(sizes: list[int], placement: Sequence[int], rank: int) -> list[list[int]]:
    """Stage sizes with one layer moved from a stage of `rank` to a neighbouring stage of another rank."""
    out = []
    for s in (s for s in range(len(sizes)) if placement[s] == rank and sizes[s] > 1):
        for t in (s - 1, s + 1):
            if 0 <= t < len(sizes) and placement[t] != rank:
                trial = list(sizes)
                trial[s] -= 1
                trial[t] += 1
                out.append(trial)
    return out


def _balance_ranks(stages: tuple[range, ...], weights: Sequence[float], placement: Sequence[int]) -> tuple[range, ...]:
    """Move single layers off the rank with the largest summed weight while that lowers it."""
    sizes = [len(r) for r in stages]
    p = max(placement) + 1
    prefix = [0.0]
    for x in weights:
        prefix.append(prefix[-1] + x)

    def loads(sz: list[int]) -> list[float]:
        out, at = [0.0] * p, 0
        for s, size in enumerate(sz):
            out[placement[s]] += prefix[at + size] - prefix[at]
            at += size
        return out

    current = loads(sizes)
    for _ in range(4 * len(weights)):
        worst = max(current)
        r = current.index(worst)
        best = None
        for trial in _moves_off(sizes, placement, r):
            got = loads(trial)
            if max(got) < worst * (1 - _REL) and (best is None or max(got) < max(best[1])):
                best = (trial, got)
        if best is None:
            break
        sizes, current = best
    return _ranges(sizes)


# -- evaluation ----------------------------------------------------------------------------------
def _build(name: str, p: int, m: int, chunks: int, costs=None, memory=None, limit=None) -> Schedule:
    opts: dict = {}
    if name in _INTERLEAVED:
        opts["chunks"] = chunks
    if name in _AUTO:
        opts.update(costs=costs, memory=memory, memory_limit=limit)
    return build(name, num_ranks=p, num_microbatches=m, **opts)


def _simulate_option(profile: Profile, name: str, chunks: int, split: str, stages: tuple[range, ...], budget: float,
                     sched: Schedule | None, p: int, m: int) -> tuple[Option, Schedule | None, SimResult | None, list[float]]:
    costs, memory, static_stage = profile.stage_costs(stages)
    placement = _placement(p, chunks, name in _V)
    static = [0.0] * p
    for s, r in enumerate(placement):
        static[r] += static_stage[s]
    try:
        if sched is None:
            limit = None
            if name in _AUTO and math.isfinite(budget):
                limit = budget - max(static)
                if limit <= 0:
                    raise ValueError(f"static memory alone ({max(static) / 1e9:.2f} GB on a rank) exceeds the budget")
            sched = _build(name, p, m, chunks, costs, memory, limit)
        res = simulate(sched, costs, memory)
    except ValueError as exc:
        return Option(name, chunks, split, stages, math.inf, (), False, f"no: {exc}"), None, None, static
    peak = tuple(x + y for x, y in zip(static, res.peak_memory))
    fits = max(peak) <= budget * (1 + _REL)
    return Option(name, chunks, split, stages, res.makespan, peak, fits), sched, res, static


def evaluate(profile: Profile, num_ranks: int, num_microbatches: int, stages: Sequence[range], schedule: str, *,
             chunks: int | None = None, memory_budget: float | None = None) -> Option:
    """Simulate `schedule` on the split `stages` of `profile`: its step and per-rank peak bytes.

    `chunks` is the stages per rank (interleaved schedules; V schedules have 2). The split must
    have as many stages as the schedule.

    >>> from zbpp.schedules.profile import Layer, Profile
    >>> prof = Profile([Layer("x", 1, 1, 1, activation=1, static=10)] * 4)
    >>> o = evaluate(prof, 2, 4, split_evenly(4, 2), "1f1b", memory_budget=30)
    >>> o.step, o.peak, o.fits
    (30.0, (24.0, 22.0), True)
    """
    p = as_int(num_ranks, "num_ranks")
    m = as_int(num_microbatches, "num_microbatches")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one `search` knows; it knows: {', '.join(SCHEDULES)}")
    k = 2 if schedule in _V else (as_int(chunks, "chunks") if chunks is not None else (SCHEDULES[schedule] or 2))
    stages = tuple(stages)
    if len(stages) != k * p:
        raise ValueError(f"{schedule} with {k} stage(s) per rank on {p} ranks has {k * p} stages; the split has {len(stages)}")
    budget = math.inf if memory_budget is None else as_number(memory_budget, "memory_budget")
    return _simulate_option(profile, schedule, k, "given", stages, budget, None, p, m)[0]


def _refine(profile: Profile, name: str, chunks: int, start: Option, sched: Schedule, budget: float, p: int, m: int,
            weights: Sequence[float]) -> Option:
    """Move one layer at a time off the rank that bounds the step (or exceeds the budget) while
    the candidate's key (excess bytes, step, peak) falls."""
    placement = _placement(p, chunks, name in _V)
    best = start
    for _ in range(_REFINE_STEPS):
        _, _, res, static = _simulate_option(profile, name, chunks, "refined", best.stages, budget, sched, p, m)
        if res is None:
            break
        if max(best.peak) > budget:
            r = max(range(p), key=lambda q: best.peak[q])
        else:  # the rank with the most work, whose work bounds the step
            r = max(range(p), key=lambda q: res.busy_per_rank[q])
        trials = [_ranges(trial) for trial in _moves_off([len(x) for x in best.stages], placement, r)]
        improved = None
        for stages in trials:
            o = _simulate_option(profile, name, chunks, "refined", stages, budget, sched, p, m)[0]
            if o.key(budget) < best.key(budget) and (improved is None or o.key(budget) < improved.key(budget)):
                if o.key(budget)[:2] != best.key(budget)[:2] or o.key(budget)[2] < best.key(budget)[2] * (1 - _REL):
                    improved = o
        if improved is None:
            break
        best = improved
    return best


def _best_chunks(best_of: dict[tuple[str, int], Option], name: str, budget: float) -> Option | None:
    """The best option of schedule `name` over its numbers of stages per rank."""
    mine = [o for (n, _), o in best_of.items() if n == name]
    return min(mine, key=lambda o: o.key(budget)) if mine else None


def search(
    profile: Profile,
    num_ranks: int,
    num_microbatches: int,
    memory_budget: float | None = None,
    *,
    schedules: Sequence[str] | None = None,
    splits: dict[str, Sequence[Sequence[range]]] | None = None,
) -> Layout:
    """Choose each stage's layers and the schedule, minimising the simulated step within
    `memory_budget` bytes per rank (static memory included; None: no budget).

    `schedules` restricts the families tried (default: all of `SCHEDULES`). `splits` adds
    splits of your own: label -> a list of candidate splits (each as many ranges as the
    schedule's stages; those of another length are skipped). Raises `ValueError` when no
    candidate fits, naming the one that came closest.
    """
    p = as_int(num_ranks, "num_ranks")
    m = as_int(num_microbatches, "num_microbatches")
    budget = math.inf if memory_budget is None else as_number(memory_budget, "memory_budget")
    names = list(schedules) if schedules is not None else list(SCHEDULES)
    for name in names:
        if name not in SCHEDULES:
            raise ValueError(f"schedule {name!r} is not one `search` knows; it knows: {', '.join(SCHEDULES)}")
    L = len(profile)
    work = [x.f + x.b + x.w for x in profile.layers]
    params = [x.static for x in profile.layers]
    configs = []
    for name in names:
        ks = [SCHEDULES[name]] if SCHEDULES[name] is not None else [2, 3, 4]
        configs += [(name, k) for k in ks if k * p <= L]
    if not configs:
        raise ValueError(f"{L} layers are too few for {p} ranks with the schedules {', '.join(names)}")

    split_cache: dict[tuple[int, bool], dict[str, tuple[range, ...]]] = {}

    def splits_for(k: int, v: bool) -> dict[str, tuple[range, ...]]:
        if (k, v) not in split_cache:
            n = k * p
            out: dict[str, tuple[range, ...]] = {"count": split_evenly(L, n)}
            if L - 2 >= n:
                out["blocks"] = split_evenly(L, n, first=1, last=1)
            out["time"] = split_balanced(work, n)
            out["params"] = split_balanced(params, n)
            out["ranks"] = _balance_ranks(out["time"], work, _placement(p, k, v))
            for label, given in (splits or {}).items():
                for i, st in enumerate(given):
                    st = tuple(st)
                    if len(st) == n:
                        profile.check_split(st)
                        out[label if len(given) == 1 else f"{label}{i}"] = st
            unique: dict[tuple, str] = {}
            for label, st in out.items():
                unique.setdefault(tuple((r.start, r.stop) for r in st), label)
            split_cache[(k, v)] = {label: out[label] for label in unique.values()}
        return split_cache[(k, v)]

    options: list[Option] = []
    built: dict[tuple[str, int], Schedule] = {}
    best_of: dict[tuple[str, int], Option] = {}
    for name, k in configs:
        if name in _AUTO:
            continue
        for label, stages in splits_for(k, name in _V).items():
            o, sched, _, _ = _simulate_option(profile, name, k, label, stages, budget, built.get((name, k)), p, m)
            if sched is not None:
                built[(name, k)] = sched
            options.append(o)
            if (name, k) not in best_of or o.key(budget) < best_of[(name, k)].key(budget):
                best_of[(name, k)] = o
    # refine the split under the best few fixed schedules (and the automatic ones' proxies)
    ranked = sorted(best_of.values(), key=lambda o: o.key(budget))
    chosen = ranked[:3] + [o for (name, k), o in best_of.items() if any(
        a in names and _PROXY[a] == name and (a not in _INTERLEAVED or o is _best_chunks(best_of, name, budget))
        for a in _AUTO)]
    refined: dict[tuple[str, int], Option] = {}
    for o in chosen:
        if (o.schedule, o.chunks) in refined or (o.schedule, o.chunks) not in built or not o.peak:
            continue
        r = _refine(profile, o.schedule, o.chunks, o, built[(o.schedule, o.chunks)], budget, p, m, work)
        refined[(o.schedule, o.chunks)] = r
        if r.stages != o.stages:
            options.append(r)
    # the automatic schedules (each a search of its own), on the splits above and their proxy's refined one
    for name, k in configs:
        if name not in _AUTO:
            continue
        if name in _INTERLEAVED:  # only as many stages per rank as its proxy did best with, on its best splits
            best = _best_chunks(best_of, _PROXY[name], budget)
            if (best.chunks if best is not None else 2) != k:
                continue
            mine = sorted((o for o in options if (o.schedule, o.chunks) == (_PROXY[name], k)), key=lambda o: o.key(budget))
            candidates = {o.split: o.stages for o in mine[:2]} if mine else dict(splits_for(k, False))
        else:
            candidates = dict(splits_for(k, name in _V))
        proxy = refined.get((_PROXY[name], k))
        if proxy is not None and proxy.stages not in candidates.values():
            candidates["refined"] = proxy.stages
        for label, stages in candidates.items():
            options.append(_simulate_option(profile, name, k, label, stages, budget, None, p, m)[0])

    options.sort(key=lambda o: o.key(budget))
    best = options[0]
    if not best.fits:
        where = f"{best.label} on the {best.split!r} split" if best.peak else best.label
        closest = f"{max(best.peak) / 1e9:.3f} GB" if best.peak else "none"
        raise ValueError(f"no schedule and split fits memory_budget={budget / 1e9:.3f} GB per rank; the closest, {where}, "
                         f"peaks at {closest}")
    sched = _build(best.schedule, p, m, best.chunks) if best.schedule not in _AUTO else None
    _, sched, res, static = _simulate_option(profile, best.schedule, best.chunks, best.split, best.stages, budget, sched, p, m)
    assert sched is not None and res is not None
    peak = tuple(x + y for x, y in zip(static, res.peak_memory))
    return Layout(sched, best.stages, res, tuple(static), peak, budget, profile, tuple(options), best.split)
