"""Choosing each stage's layers and the schedule together, within a per-rank memory budget.

`search` takes a per-layer `Profile`, p ranks, m microbatches and a memory budget in bytes per
rank that covers everything a rank holds: the static memory of its layers (parameters, gradients,
optimizer state; what its layers share, such as a tied embedding and head on a V's rank 0, once:
`Profile.static_per_rank`) plus the activations the schedule keeps in flight, as simulated. It tries every
registered schedule (`SCHEDULES`; GPipe too) on its placement: one stage per rank; interleaved
with 2, 3 or 4 stages per rank; V.

Exact where the splits are few. A placement with at most `max_splits` (`MAX_SPLITS`) splits of
the layers into consecutive stages has every split considered under every schedule, by branch and
bound: before anything is simulated each split gets two lower bounds that hold for every schedule
on it, on the step (per rank: the forwards of the stages above its first, which must run before
its first task, plus m times its F+B+W) and on the bytes over the budget (per rank: its static
memory plus one microbatch's activations of all its stages, which every schedule holds at once).
Candidates that may fit are simulated in order of their step bound until it passes the best step
that fits; if none fits, candidates in order of their bytes bound until it passes the least
excess found, which is the closest plan the error names. So on such cases the pick is the best
plan of every split x every schedule (tests/schedules/test_search_exact.py checks it against an
exhaustive enumeration).

Beyond, heuristic splits, each under every schedule of its placement (same branch and bound):

- ``count``: as many layers per stage as can be (the remainder to the first stages);
- ``blocks``: the layers between the first and the last split that way, the first layer (an
  embedding) joining stage 0 and the last (a head) the last stage;
- ``time``: the largest stage time F+B+W as small as can be (bisection on it);
- ``params``: the largest stage static memory as small as can be;
- ``ranks``: from ``time``, layers moved off the rank with the most work while that lowers it;
- ``refined``: from the best few of these, a layer at a time moved off the rank that bounds the
  simulated step (or exceeds the budget by the most) to the stage before it or after it, while
  the step (or the excess) falls, under the schedule itself (an automatic one: under a fixed
  proxy, then built on the result).

A candidate fits when static plus simulated activation memory stays within the budget on every
rank; an automatic schedule gets as each rank's activation limit the budget less that rank's own
static memory. Candidates rank by the bytes over the budget, then the simulated step (makespan),
then the peak. `Plan.searched` says how much was covered and what no schedule of these
placements beats on any split (`Searched.bound_over_splits`: the least step bound over every split
that may fit where all were bounded, else a bound over all splits that ignores memory);
`Plan.explain` prints it with what was chosen and why.

Activation policies (none, full, selective, offload; `zbpp.schedules.profile.PolicyCost`), where
the profile's layers offer them: each candidate gets one policy per stage (the stages a rank holds
under V and interleaved schedules each their own), for every layer of the stage that offers it
(`_choose_policies`: on a fixed schedule the best per-stage assignment, on an automatic one the
best of each policy everywhere and its fixed proxy's choice); offload's copies
are costed as `zbpp.schedules.policies` says. The bounds above hold under every policy (a policy
only adds time to B; the bytes bound takes each layer's least-keeping policy).

>>> from zbpp.schedules.profile import transformer_profile
>>> prof = transformer_profile(name="small", num_layers=8, hidden=1024, ffn=4096, heads=16, vocab=32000, seq=2048)
>>> plan = search(prof, num_ranks=4, num_microbatches=8, memory_budget=20e9)
>>> len(plan.stages) == plan.schedule.num_stages, all(x <= 20e9 for x in plan.peak)
(True, True)
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from .bounds import LowerBound, least_peaks, lower_bound
from .checks import as_int, as_number
from .ir import Schedule
from .policies import PolicySim, memory_terms, policy_costs, rank_peak, simulate_policies
from .profile import POLICIES, Profile
from .registry import build, max_tasks, task_count
from .simulate import Memory, SimResult, simulate

__all__ = ["Option", "Plan", "Searched", "search", "evaluate", "all_splits", "split_evenly", "split_balanced",
           "SCHEDULES", "MAX_SPLITS", "MAX_POLICY_COMBOS"]

#: The schedules `search` tries, and the stages per rank of each (None: 2, 3 and 4, interleaved).
SCHEDULES: dict[str, int | None] = {
    "gpipe": 1, "1f1b": 1, "zb-h1": 1, "zb-h2": 1, "zb-auto": 1,
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
#: A placement with at most this many splits has every split tried: every placement of p <= 4
#: ranks and up to 12 layers (the most: 462, p = 2 with 3 stages per rank or p = 3 with 2);
#: beyond, heuristic splits and their refinements.
MAX_SPLITS = 512
#: Each rank's combinations of its stages' policies that are not dominated (see `_choose_policies`):
#: their products are all simulated up to this many; beyond, each rank takes its combination
#: with the least added B time.
MAX_POLICY_COMBOS = 64
#: Between policies that give the same step: the one that changes the run least first.
_INTRUSION = {"none": 0, "selective": 1, "full": 2, "offload": 3}


@dataclass(frozen=True)
class _Host:
    """The host side of offload: how many ranks of a node share its host link, and the pinned
    host bytes each rank may hold (a node's host memory split evenly among its ranks)."""

    share: int = 1
    budget: float = math.inf


_NO_HOST = _Host()


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
    policies: tuple[str, ...] = ()  #: each stage's activation policy (empty: "none" everywhere)
    host: tuple[float, ...] = ()  #: per rank: the most pinned host bytes offloaded activations hold
    host_excess: float = 0.0  #: bytes the busiest rank's host memory goes over its share of the host budget

    @property
    def label(self) -> str:
        return f"{self.schedule} x{self.chunks}" if self.schedule in _INTERLEAVED else self.schedule

    def key(self, budget: float) -> tuple[float, float, float]:
        """Lower is better: the bytes over the budget (device and host), then the step, then the peak."""
        excess = max(0.0, max(self.peak, default=math.inf) - budget) + self.host_excess if self.peak else math.inf
        return (excess, self.step, max(self.peak, default=math.inf))


@dataclass(frozen=True)
class Searched:
    """How much of the space `search` covered, and what no plan beats."""

    exact: bool  #: every split of every placement was bounded, and simulated unless its bound ruled it out
    max_splits: int  #: the most splits of a placement that were all tried
    simulated: int  #: (schedule, split) pairs simulated
    candidates: int  #: (schedule, split) pairs considered, simulated or ruled out by a bound
    #: no schedule of the placements searched, on any split that may fit the budget, has a
    #: shorter step (memory aside beyond each rank's static memory and one microbatch's activations)
    bound_over_splits: float


@dataclass(frozen=True)
class Plan:
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
    searched: "Searched | None" = field(repr=False, default=None)  #: how far the search went
    policies: tuple[str, ...] = ()  #: each stage's activation policy (empty: "none" everywhere)
    allowed: tuple[str, ...] = ("none",)  #: the policies the search chose from
    #: per rank: the time its offload copies take its share of the host link, each way, per step
    link: tuple[float, ...] = ()
    host: tuple[float, ...] = ()  #: per rank: the most pinned host bytes its offloaded activations hold
    ranks_per_node: int = 1  #: ranks of a node sharing its host link and host memory
    host_memory: float = math.inf  #: pinned host bytes per node for offloaded activations

    @property
    def step(self) -> float:
        """The simulated makespan or, where a rank's offload copies take its link longer, that."""
        return max(self.result.makespan, max(self.link, default=0.0))

    def bound(self) -> LowerBound:
        """`zbpp.schedules.bounds.lower_bound` for this split and placement: what no schedule of it
        beats within the budget (each rank's limit: the budget less its static memory)."""
        costs, memory, _ = self.profile.stage_costs(self.stages, self.policies or None)
        limits = None if not math.isfinite(self.budget) else [self.budget - x for x in self.static]
        return lower_bound(self.schedule.placement, self.schedule.num_microbatches, costs, memory, limits)

    def names(self) -> list[list[str]]:
        """Each stage's layer names (the profile's), e.g. as module FQNs for a stage-splitting helper."""
        return [[self.profile.layers[i].name for i in r] for r in self.stages]

    def explain(self, top: int = 12) -> str:
        """What was chosen and why: the pick, how much the search covered, what no plan beats (on
        this split, and on any split), each rank's memory, then the best candidate of each schedule.

        >>> from zbpp.schedules.profile import Layer, Profile
        >>> prof = Profile([Layer("x", 1, 1, 1, activation=1, static=10)] * 4)
        >>> print(search(prof, 2, 4, 36, schedules=["1f1b", "gpipe"]).explain().splitlines()[1])
          why: the fitting candidate with the shortest step (ranked by bytes over the budget, then step, then peak)
        """
        s = self.schedule
        chunks = s.num_stages // s.num_ranks
        lines = [f"pick: {s.name}{' x' + str(chunks) if s.name in _INTERLEAVED else ''} with layers per stage "
                 f"{_sizes(self.stages)} ({self.split}): step {self.step:.6g}, bubble rate {self.result.bubble_rate:.4f}, "
                 f"peak {max(self.peak) / 1e9:.2f} GB"
                 + (f" of {self.budget / 1e9:.2f} GB" if math.isfinite(self.budget) else " (no budget)"),
                 "  why: the fitting candidate with the shortest step (ranked by bytes over the budget, then step, then peak)"]
        fitting = [o for o in self.options if o.fits]
        runner = next((o for o in fitting if (o.schedule, o.chunks, o.stages) != (s.name, chunks, self.stages)), None)
        if runner is not None:
            # a pick of step 0 (layers that take no time): a runner-up as fast is +0%, a slower one has no ratio
            vs = (f"{100 * (runner.step / self.step - 1):+.2f}%" if self.step > 0 else
                  "+0.00%" if runner.step == 0 else "slower")
            lines.append(f"  runner-up: {runner.label} with layers per stage {_sizes(runner.stages)}: step "
                         f"{runner.step:.6g} ({vs})")
        w = self.searched
        if w is not None:
            if w.exact:
                lines.append(f"  exact: every split under every schedule searched ({w.candidates} candidates, "
                             f"{w.simulated} simulated, the others ruled out by a lower bound): no other split x "
                             f"schedule fits with a shorter step"
                             + ("" if self.allowed == ("none",) else " (with per-stage policies: exact on the fixed "
                                "schedules; an automatic one tries each policy everywhere and its proxy's choice)"))
            else:
                lines.append(f"  not exhaustive (more than {w.max_splits} splits on a placement): {w.candidates} heuristic "
                             f"and refined splits x schedules, {w.simulated} simulated")
            lines.append(f"  no schedule on any split within the budget beats step {w.bound_over_splits:.6g} "
                         f"(the pick: +{_over(self.step, w.bound_over_splits):.2f}%)")
        lb = self.bound()
        lines.append(f"  no schedule of this split and placement within the budget beats step {lb.makespan:.6g} "
                     f"(the pick: +{_over(self.step, lb.makespan):.2f}%)")
        if self.allowed != ("none",):
            lines += self._explain_policies()
        for r in range(s.num_ranks):
            stages = [f"{st}:{self.profile.layers[self.stages[st][0]].name}..{self.profile.layers[self.stages[st][-1]].name}"
                      f" ({len(self.stages[st])})" for st in s.stages_on(r)]
            lines.append(f"  rank {r}: static {self.static[r] / 1e9:.2f} GB + activations "
                         f"{self.result.peak_memory[r] / 1e9:.2f} GB = {self.peak[r] / 1e9:.2f} GB; stages {', '.join(stages)}")
        lines.append(f"{'candidate':<22} {'layers per stage':<18} {'step':>12} {'vs pick':>8} {'peak GB':>9}  fits")
        seen = set()
        for o in self.options:
            if o.label in seen:
                continue
            seen.add(o.label)
            vs = f"{100 * (o.step / self.step - 1):+.1f}%" if math.isfinite(o.step) and self.step > 0 else "-"
            peak = f"{max(o.peak) / 1e9:9.2f}" if o.peak else f"{'-':>9}"
            why = "yes" if o.fits else (o.note or (f"no: over the budget by {(max(o.peak) - self.budget) / 1e9:.2f} GB"
                                                   if max(o.peak) > self.budget * (1 + _REL) else
                                                   f"no: over the host memory by {o.host_excess / 1e9:.2f} GB"))
            lines.append(f"{o.label:<22} {_sizes(o.stages):<18} {o.step:>12.6g} {vs:>8} {peak}  {why}")
            if len(seen) >= top:
                break
        return "\n".join(lines)


    def _explain_policies(self) -> list[str]:
        """Per stage: its policy and why: for each policy it could have had (the rank's other
        stages as chosen), the rank's peak and the time it adds to each of the stage's B."""
        s, n = self.schedule, self.schedule.num_stages
        chosen = list(self.policies or ["none"] * n)
        costs, memory, _ = self.profile.stage_costs(self.stages)
        base = simulate(s, costs, memory)
        plain_b = costs.per_stage(n)[1]
        extra, act, wg, trans, held = {}, {}, {}, {}, {}
        for q in self.allowed:
            c, mem, _, _, _ = policy_costs(s, self.profile, self.stages, [q] * n, base, self.ranks_per_node)
            extra[q] = [x - y for x, y in zip(c.per_stage(n)[1], plain_b)]
            act[q], wg[q] = mem.per_stage(n)
            trans[q] = [t[:3] for t in mem.transients(n)]
            held[q] = self.profile.stage_host_bytes(self.stages, [q] * n)
        host_budget = self.host_memory / self.ranks_per_node
        lines = [f"  policies (one per stage, for its layers that offer it; chosen from {', '.join(self.allowed)}):"
                 " the least added B time with every rank within the budget (peaks count each task's transient)"]
        for r, (mine, terms) in enumerate(memory_terms(s)):
            for st in mine:
                alts = []
                for o in self.allowed:
                    trial = [o if x == st else chosen[x] for x in mine]
                    peak = self.static[r] + rank_peak(terms, [act[q][x] for q, x in zip(trial, mine)],
                                                      [wg[q][x] for q, x in zip(trial, mine)],
                                                      [trans[q][x] for q, x in zip(trial, mine)])
                    over = "" if peak <= self.budget * (1 + 4 * _REL) else " (over)"
                    on_host = rank_peak(terms, [held[q][x] for q, x in zip(trial, mine)], [0.0] * len(mine))
                    over += "" if on_host <= host_budget * (1 + 4 * _REL) else " (over the host memory)"
                    alts.append(f"{o} {peak / 1e9:.4g} GB +{extra[o][st]:.4g} per B{over}")
                lines.append(f"    stage {st} (rank {r}): {chosen[st]}  [{'; '.join(alts)}]")
        if "offload" in self.allowed:
            link = self.profile.host_bytes_per_s
            host = (f"{self.host_memory / 1e9:.4g} GB per node, {self.host_memory / self.ranks_per_node / 1e9:.4g} GB "
                    f"per rank" if math.isfinite(self.host_memory) else "not limited (no host budget given: "
                    "assumed to hold every offloaded byte)")
            lines.append(f"  offload: host link {link / 1e9:.4g} GB/s each way shared by {self.ranks_per_node} rank(s) "
                         f"per node ({link / self.ranks_per_node / 1e9:.4g} GB/s each); host memory {host}")
            if any(self.link):
                lines.append("    per rank, copy time each way per step / most host GB: " + ", ".join(
                    f"r{r} {x:.4g} / {h / 1e9:.4g}" for r, (x, h) in enumerate(zip(self.link, self.host))))
        return lines


def _over(step: float, bound: float) -> float:
    """How far `step` is above `bound`, in percent."""
    return max(0.0, 100 * (step / bound - 1)) if bound > 0 else 0.0


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
    """Stage sizes with one layer moved from a stage of `rank` to the stage before it or the one
    after it (where another rank holds that one).

    >>> _moves_off([1, 3, 2], [0, 1, 2], 1)
    [[2, 2, 2], [1, 2, 3]]
    """
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


@functools.lru_cache(maxsize=32)
def _build_fixed(name: str, p: int, m: int, chunks: int) -> Schedule:
    """A fixed schedule, built once (its task order does not depend on the costs): a proxy's
    policy choice on each split of an automatic schedule reuses it, and its memory terms."""
    return _build(name, p, m, chunks)


def _per_rank(values: Sequence[float], placement: Sequence[int], p: int) -> list[float]:
    out = [0.0] * p
    for s, r in enumerate(placement):
        out[r] += values[s]
    return out


def _simulate_option(profile: Profile, name: str, chunks: int, split: str, stages: tuple[range, ...], budget: float,
                     sched: Schedule | None, p: int, m: int, allowed: tuple[str, ...] = ("none",),
                     given: Sequence[str] | None = None, host: _Host = _NO_HOST
                     ) -> tuple[Option, Schedule | None, PolicySim | None, list[float]]:
    """Build (unless `sched` is given) and simulate one candidate. With `given` per-stage policies,
    under those; else with only "none" allowed, under none; else the policies `_choose_policies` picks.
    Its step counts the offload copies' link time and its fit their host bytes (`host`)."""
    if given is None and allowed != ("none",):
        return _choose_policies(profile, name, chunks, split, stages, budget, sched, p, m, allowed, host)
    placement = _placement(p, chunks, name in _V)
    costs, memory, _ = profile.stage_costs(stages, given)
    static = profile.static_per_rank(stages, placement)
    try:
        if sched is None:
            sched = _build_within(name, p, m, chunks, costs, memory, static, budget)
        sim = simulate_policies(sched, profile, stages, given, ranks_per_node=host.share)
    except ValueError as exc:
        return Option(name, chunks, split, stages, math.inf, (), False, f"no: {exc}"), None, None, static
    peak = tuple(x + y for x, y in zip(static, sim.result.peak_memory))
    host_excess = max(0.0, max(sim.host, default=0.0) - host.budget)
    fits = max(peak) <= budget * (1 + _REL) and host_excess <= host.budget * _REL
    policies = tuple(given) if given is not None and any(q != "none" for q in given) else ()
    return (Option(name, chunks, split, stages, sim.step, peak, fits, policies=policies, host=sim.host,
                   host_excess=0.0 if fits else host_excess), sched, sim, static)


def _build_within(name: str, p: int, m: int, chunks: int, costs, memory: Memory, static: list[float],
                  budget: float) -> Schedule:
    """Build a schedule; an automatic one with each rank's limit the budget less its static memory
    (the builder counts each task's transient and what a B adds where wgrad > activation, and
    refuses, naming the rank, a limit below what one microbatch at a time needs)."""
    if name not in _AUTO:
        return _build(name, p, m, chunks)
    limit = [budget - x for x in static] if math.isfinite(budget) else None
    if limit is not None and min(limit) < 0:
        r = limit.index(min(limit))
        raise ValueError(f"rank {r}: static memory {static[r] / 1e9:.2f} GB exceeds the budget")
    return _build(name, p, m, chunks, costs, memory, limit)


def _choose_policies(profile: Profile, name: str, chunks: int, split: str, stages: tuple[range, ...], budget: float,
                     sched: Schedule | None, p: int, m: int, allowed: tuple[str, ...], host: _Host = _NO_HOST
                     ) -> tuple[Option, Schedule | None, PolicySim | None, list[float]]:
    """One policy per stage (for every layer of the stage that offers it), chosen for the
    candidate: the best of the per-rank combinations that are not dominated.

    A fixed schedule's task order does not depend on the costs, so a rank's memory depends only
    on its own stages' policies (`zbpp.schedules.policies.memory_terms`: exact, without
    simulating) and the step never falls when a B grows (each task starts at the latest end of
    what it waits for); a stage's added B time (recompute, and offload's exposed copy, a fixed
    number per stage: see `zbpp.schedules.policies`) depends on its own policy only, and so do
    the rank's offload link time (a floor under the step) and its pinned host bytes. Per rank the
    combinations of its stages' policies that fit (the device budget, transients counted, and
    the rank's share of the host memory) are kept unless another fitting one adds no more time
    to any of its B nor to its link time and less to one (or as much, less intrusively); where
    none fits, the one with the least excess. Every product of what is kept (at most `MAX_POLICY_COMBOS`) is
    simulated: on fixed schedules this is the best of every per-stage assignment. An automatic
    schedule's order follows its costs: it is built under each policy on every stage and under
    the choice of its fixed proxy, the best kept.
    """
    placement = _placement(p, chunks, name in _V)
    n = len(stages)
    if name in _AUTO:
        tries = [tuple([q] * n) for q in allowed]
        proxy = _choose_policies(profile, _PROXY[name], chunks, split, stages, budget, None, p, m, allowed, host)[0]
        if proxy.peak:
            tries.append(proxy.policies or tuple(["none"] * n))
        got = [_simulate_option(profile, name, chunks, split, stages, budget, None, p, m, given=t, host=host)
               for t in dict.fromkeys(tries)]
        return _least(got, budget)
    if sched is None:
        try:
            sched = _build_fixed(name, p, m, chunks)
        except ValueError as exc:
            static = profile.static_per_rank(stages, placement)
            return Option(name, chunks, split, stages, math.inf, (), False, f"no: {exc}"), None, None, static
    kept = _rank_choices(profile, sched, stages, budget, placement, p, allowed, host)
    combos = list(itertools.islice(itertools.product(*[c for c, _ in kept]), MAX_POLICY_COMBOS + 1))
    if len(combos) > MAX_POLICY_COMBOS:
        combos = [tuple(c[0] for c, _ in kept)]  # each rank's least added B time
    out = []
    for combo in combos:
        given = ["none"] * n
        for (_, mine), choice in zip(kept, combo):
            for st, q in zip(mine, choice):
                given[st] = q
        out.append(_simulate_option(profile, name, chunks, split, stages, budget, sched, p, m, given=given, host=host))
    return _least(out, budget)


def _rank_choices(profile: Profile, sched: Schedule, stages: tuple[range, ...], budget: float, placement: list[int],
                  p: int, allowed: tuple[str, ...], host: _Host = _NO_HOST
                  ) -> list[tuple[list[tuple[str, ...]], tuple[int, ...]]]:
    """Per rank: the combinations of its stages' policies worth simulating (see
    `_choose_policies`), the least added B time first, and its stages."""
    n = len(stages)
    costs, memory, _ = profile.stage_costs(stages)
    base = simulate(sched, costs, memory)
    static = profile.static_per_rank(stages, placement)
    base_b = costs.per_stage(n)[1]
    m = sched.num_microbatches
    # per policy and stage: bytes kept F->B and B->W, the F/B/W transients, the added B time,
    # the link time of its copies per step and the host bytes per microbatch
    act, wg, trans, extra, link, held = {}, {}, {}, {}, {}, {}
    for q in allowed:
        costs, memory, _, _, _ = policy_costs(sched, profile, stages, [q] * n, base, host.share)
        extra[q] = [x - y for x, y in zip(costs.per_stage(n)[1], base_b)]
        act[q], wg[q] = memory.per_stage(n)
        trans[q] = [t[:3] for t in memory.transients(n)]
        link[q] = [m * host.share * c for c in profile.stage_copies(stages, [q] * n)]
        held[q] = profile.stage_host_bytes(stages, [q] * n)

    def row(q: str, st: int) -> tuple[float, ...]:  # lower is better on every entry
        return (act[q][st], wg[q][st], *trans[q][st], extra[q][st], link[q][st], held[q][st], _INTRUSION[q])

    out = []
    for r, (mine, terms) in enumerate(memory_terms(sched)):
        k = len(mine)
        # per stage, the policies no other one matches or beats on bytes, transients, added time,
        # link time, host bytes and intrusion together (a rank's peak never falls with more bytes)
        options = [[q for q in allowed if not any(
            row(o, st) != row(q, st) and all(a <= b for a, b in zip(row(o, st), row(q, st))) for o in allowed)]
            for st in mine]
        # each term's bytes per stage and policy (device, then host), so a combination's peak is a max of sums
        vals = {(i, q): [t[2 * i] * act[q][st] + t[2 * i + 1] * wg[q][st]
                         + sum(x * y for x, y in zip(t[2 * k + 3 * i:2 * k + 3 * i + 3], trans[q][st])) for t in terms]
                for i, st in enumerate(mine) for q in options[i]}
        hvals = {(i, q): [t[2 * i] * held[q][st] for t in terms] for i, st in enumerate(mine) for q in options[i]}
        rows = []
        for combo in itertools.product(*options):
            peak = static[r] + max(0.0, max(map(sum, zip(*[vals[(i, q)] for i, q in enumerate(combo)])), default=0.0))
            on_host = max(0.0, max(map(sum, zip(*[hvals[(i, q)] for i, q in enumerate(combo)])), default=0.0))
            over = max(0.0, peak - budget) + max(0.0, on_host - host.budget)
            # the time it costs: each stage's added B time, then the rank's link time
            cost = [extra[q][st] for q, st in zip(combo, mine)] + [sum(link[q][st] for q, st in zip(combo, mine))]
            rows.append((combo, peak, cost, sum(_INTRUSION[q] for q in combo), over, on_host))
        # a little slack: these peaks are summed in another order than the simulator's
        fit = ([x for x in rows if x[1] <= budget * (1 + 4 * _REL) and x[5] <= host.budget * (1 + 4 * _REL)]
               or [min(rows, key=lambda x: x[4])])
        undominated = [x for x in fit if not any(
            all(a <= b for a, b in zip(o[2], x[2])) and (any(a < b for a, b in zip(o[2], x[2])) or o[3] < x[3])
            for o in fit if o is not x)]
        undominated.sort(key=lambda x: (sum(x[2][:-1]), x[2][-1], x[3], x[1]))
        out.append(([x[0] for x in undominated], tuple(mine)))
    return out


def _least(got: list, budget: float):
    """The best of `_simulate_option` results: least bytes over the budget, then shortest step;
    among steps equal within rounding, the fewest layers moved off "none" by the least intrusive
    policy (no copy or recompute the step does not need), then the lowest peak."""
    excess = min(g[0].key(budget)[0] for g in got)
    tied = [g for g in got if g[0].key(budget)[0] <= excess]
    step = min(g[0].step for g in tied)
    tied = [g for g in tied if g[0].step <= step * (1 + _REL)]

    return min(tied, key=lambda g: (sum(_INTRUSION[q] for q in g[0].policies), max(g[0].peak, default=math.inf)))


def evaluate(profile: Profile, num_ranks: int, num_microbatches: int, stages: Sequence[range], schedule: str, *,
             chunks: int | None = None, memory_budget: float | None = None,
             policies: str | Sequence[str] | None = None, ranks_per_node: int = 1,
             host_memory: float | None = None) -> Option:
    """Simulate `schedule` on the split `stages` of `profile`: its step and per-rank peak bytes.

    `chunks` is the stages per rank (interleaved schedules; V schedules have 2). The split must
    have as many stages as the schedule. An automatic schedule gets as each rank's activation
    limit the budget less that rank's static memory. `policies`: each stage's activation policy
    (one name: every stage's; None: "none"), simulated as `zbpp.schedules.policies` says, the host
    link and `host_memory` shared by `ranks_per_node` ranks as in `search`.

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
    given = None if policies is None else [policies] * len(stages) if isinstance(policies, str) else list(policies)
    if given is not None:
        profile.stage_costs(stages, given)  # checks the names and their count
    host = _host(ranks_per_node, host_memory)[0]
    return _simulate_option(profile, schedule, k, "given", stages, budget, None, p, m, given=given, host=host)[0]


def all_splits(num_layers: int, num_stages: int) -> Iterator[tuple[range, ...]]:
    """Every split of `num_layers` layers into `num_stages` consecutive non-empty stages.

    >>> [[len(r) for r in st] for st in all_splits(4, 2)]
    [[1, 3], [2, 2], [3, 1]]
    """
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        yield _ranges([b - a for a, b in zip((0, *cuts), (*cuts, num_layers))])


@dataclass(frozen=True)
class _Split:
    """What one split of one placement costs before any schedule is simulated: a lower bound on
    the step of every schedule on it, and on the bytes it goes over the budget."""

    stages: tuple[range, ...]
    step_bound: float  #: each rank: the forwards before its first task, then m times its F+B+W
    excess_bound: float  #: most over the budget of a rank's static memory + one microbatch's activations


def _split_bounds(profile: Profile, stages: tuple[range, ...], placement: Sequence[int], p: int, m: int,
                  budget: float, allowed: tuple[str, ...] = ("none",)) -> _Split:
    costs, memory, _ = profile.stage_costs(stages)
    f, b, w = costs.per_stage(len(stages))  # every policy adds time to B, never takes any away
    # the least a microbatch can keep: each layer under its policy that keeps the least
    act = [sum(min(profile.layers[i].cost(q).activation for q in allowed) for i in r) for r in stages]
    work = _per_rank([x + y + z for x, y, z in zip(f, b, w)], placement, p)
    need = [x + y for x, y in zip(profile.static_per_rank(stages, placement), _per_rank(act, placement, p))]
    first = [placement.index(r) for r in range(p)]  # no task of rank r starts before F of the stages above its first
    bound = max(sum(f[:first[r]]) + m * work[r] for r in range(p))
    return _Split(stages, bound, max(need) - budget)


def _bound_over_splits(profile: Profile, placement: Sequence[int], p: int, m: int) -> float:
    """A lower bound on every schedule's step of `placement` on *any* split of the layers (memory
    aside): one stage per rank, the least over splits of the largest bound of `_split_bounds`
    (a greedy fill of each stage is optimal for it); else the larger of the ranks' mean bound
    (rank r's first stage, stage r, follows at least the first r layers) and m times the work of
    the layers one rank must hold together (the largest; the first and the last on a V).

    >>> from zbpp.schedules.profile import Layer, Profile
    >>> prof = Profile([Layer("x", 1, 1, 1)] * 4)
    >>> round(_bound_over_splits(prof, [0, 1], 2, 2), 9)  # 2 / 2: rank 1 waits 2 forwards, then 2 x 6
    14.0
    >>> _bound_over_splits(prof, [0, 1, 1, 0], 2, 2)  # (a forward before rank 1 + 2 x 12) / 2
    12.5
    """
    f = [x.f for x in profile.layers]
    work = [x.f + x.b + x.w for x in profile.layers]
    n = len(placement)
    if n != p:
        heads = sum(sum(f[:r]) for r in range(p))
        together = work[0] + work[-1] if placement[0] == placement[-1] else max(work)
        return max((heads + m * sum(work)) / p, m * together)

    def fits(cap: float) -> bool:
        at, head = 0, 0.0
        for stage in range(p):
            load, start = 0.0, at
            last = len(work) - (p - 1 - stage)  # leave a layer for each later stage
            while at < last and head + m * (load + work[at]) <= cap:
                load += work[at]
                at += 1
            if at == start:
                return False
            head += sum(f[start:at])
        return at == len(work)

    lo, hi = 0.0, sum(f) + m * sum(work)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return lo


def _full_bound(profile: Profile, stages: tuple[range, ...], placement: Sequence[int], p: int, m: int,
                budget: float) -> float:
    """`bounds.lower_bound` of the split, each rank limited to the budget less its static memory;
    inf where a rank's limit is below what any schedule of the split holds (`least_peaks`)."""
    costs, memory, _ = profile.stage_costs(stages)
    limits = None if not math.isfinite(budget) else [budget - x for x in profile.static_per_rank(stages, placement)]
    if limits is not None and any(x < f * (1 - _REL) for x, f in zip(limits, least_peaks(placement, memory))):
        return math.inf  # no schedule of this split fits: lower_bound would refuse the limit
    return lower_bound(placement, m, costs, memory, limits).makespan


def _refine(profile: Profile, name: str, chunks: int, start: Option, sched: Schedule, budget: float, p: int, m: int,
            allowed: tuple[str, ...] = ("none",), host: _Host = _NO_HOST) -> Option:
    """Move one layer at a time off the rank over the budget by the most or, within it, the rank
    with the most work (whose work bounds the step), to the stage before or after, while the
    candidate's key (excess bytes, step, peak) falls: the best such move each time."""
    placement = _placement(p, chunks, name in _V)
    best = start
    for _ in range(_REFINE_STEPS):
        _, _, sim, _ = _simulate_option(profile, name, chunks, "refined", best.stages, budget, sched, p, m, allowed,
                                        host=host)
        if sim is None:
            break
        res = sim.result
        if max(best.peak) > budget:
            r = max(range(p), key=lambda q: best.peak[q])
        else:
            r = max(range(p), key=lambda q: res.busy_per_rank[q])
        improved = None
        for sizes in _moves_off([len(x) for x in best.stages], placement, r):
            o = _simulate_option(profile, name, chunks, "refined", _ranges(sizes), budget, sched, p, m, allowed,
                                 host=host)[0]
            if o.key(budget) < (improved or best).key(budget) and _clearly_better(o, best, budget):
                improved = o
        if improved is None:
            break
        best = improved
    return best


def _clearly_better(a: Option, b: Option, budget: float) -> bool:
    """`a` before `b` by more than rounding: less excess, a shorter step, or a lower peak."""
    ka, kb = a.key(budget), b.key(budget)
    for x, y in zip(ka, kb):
        if x < y - _REL * max(1.0, abs(y)):
            return True
        if x > y + _REL * max(1.0, abs(y)):
            return False
    return False


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
    max_splits: int = MAX_SPLITS,
    policies: Sequence[str] | None = None,
    ranks_per_node: int = 1,
    host_memory: float | None = None,
) -> Plan:
    """Choose each stage's layers and the schedule, minimising the simulated step within
    `memory_budget` bytes per rank (static memory included; None: no budget).

    `schedules` restricts the families tried (default: all of `SCHEDULES`). `splits` adds
    splits of your own: label -> a list of candidate splits (each as many ranges as the
    schedule's stages; those of another length are skipped). A placement with at most
    `max_splits` splits has every split tried (exact); beyond, the heuristic splits and their
    refinements. Raises `ValueError` when no candidate fits, naming the one that came closest.

    `policies` are the activation policies each stage may run its layers under (one per stage, for
    every layer that offers it; default: every one the profile's layers offer, `Profile.offers`);
    ``["none"]`` leaves every layer as it is, ``["full"]`` recomputes every layer that can. One
    that no layer offers (not measured) raises `ValueError`.

    Offload's copies share a node's host link and host memory: `ranks_per_node` ranks (each copying
    at once: the profile's `Profile.host_bytes_per_s` divided among them; default 1, a link of its
    own) and `host_memory` pinned bytes per node for offloaded activations (None: not limited,
    assumed enough); a plan fits only if each rank's offloaded bytes in flight stay within
    ``host_memory / ranks_per_node`` (`zbpp.schedules.policies`).
    """
    p = as_int(num_ranks, "num_ranks")
    host, host_memory_ = _host(ranks_per_node, host_memory)
    allowed = _allowed(profile, policies)
    m = as_int(num_microbatches, "num_microbatches")
    max_splits = as_int(max_splits, "max_splits", minimum=0)
    budget = math.inf if memory_budget is None else as_number(memory_budget, "memory_budget")
    if not math.isfinite(budget) and "none" in allowed:
        allowed = ("none",)  # a policy only adds time: without a budget nothing needs one
    names = list(schedules) if schedules is not None else list(SCHEDULES)
    if not names:  # else "too few layers for ... the schedules " (none named)
        raise ValueError(f"schedules is empty: give at least one of {', '.join(SCHEDULES)} (None: all)")
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
    # a schedule of more tasks than `build` allows cannot run, and its bounds alone would take as
    # much memory (at m = 1e9, the search stalled in them): listed as refused, never bounded
    limit = max_tasks()
    sizes = {(name, k): task_count(name, p, m, **({"chunks": k} if name in _INTERLEAVED else {})) for name, k in configs}
    refused = [Option(name, k, "-", (), math.inf, (), False,
                      f"no: {name} with num_ranks={p}, num_microbatches={m} would create up to {n:,} tasks, more than "
                      f"the limit of {limit:,}") for (name, k), n in sizes.items() if n > limit]
    if len(refused) == len(configs):
        (name, k), n = min(sizes.items(), key=lambda kv: kv[1])
        label = f"{name} x{k}" if name in _INTERLEAVED else name
        raise ValueError(f"num_ranks={p}, num_microbatches={m}: every schedule would create more tasks than the limit "
                         f"of {limit:,} (the fewest: {label}, {n:,}); give fewer microbatches or set the environment "
                         f"variable ZBPP_MAX_TASKS to allow more")
    configs = [c for c in configs if sizes[c] <= limit]

    def heuristic_splits(k: int, v: bool) -> dict[str, tuple[range, ...]]:
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
        return {label: out[label] for label in unique.values()}

    # every (schedule, stages per rank, split) to consider, with its bounds before simulation
    exact: dict[tuple[str, int], bool] = {}
    pending: list[tuple[str, int, str, _Split]] = []
    split_info: dict[tuple[int, bool], list[tuple[str, _Split]]] = {}
    for name, k in configs:
        v = name in _V
        if (k, v) not in split_info:
            placement = _placement(p, k, v)
            count = math.comb(L - 1, k * p - 1)
            chosen = (list(heuristic_splits(k, v).items()) if count > max_splits else
                      [("exhaustive", st) for st in all_splits(L, k * p)])
            split_info[(k, v)] = [(label, _split_bounds(profile, st, placement, p, m, budget, allowed)) for label, st in chosen]
        exact[(name, k)] = math.comb(L - 1, k * p - 1) <= max_splits
        pending += [(name, k, label, info) for label, info in split_info[(k, v)]]

    options: list[Option] = list(refused)
    built: dict[tuple[str, int], Schedule] = {}
    seen: set[tuple[str, int, tuple[range, ...]]] = set()

    def try_candidate(name: str, k: int, label: str, stages: tuple[range, ...]) -> Option:
        o, sched, _, _ = _simulate_option(profile, name, k, label, stages, budget, built.get((name, k)), p, m, allowed,
                                          host=host)
        if sched is not None and name not in _AUTO:
            built[(name, k)] = sched
        seen.add((name, k, stages))
        options.append(o)
        return o

    # branch and bound: candidates that may fit, by their step bound, until the bound passes the
    # best step that fits; then, if none fits, candidates by their excess bound, until that passes
    # the smallest excess found (the closest plan)
    def best_fit() -> float:
        return min((o.step for o in options if o.fits), default=math.inf)

    # (the fixed schedules first among equal bounds: they simulate in a fraction of an automatic
    # one's build, and a good step found early rules more out)
    may_fit = sorted((c for c in pending if c[3].excess_bound <= budget * _REL),
                     key=lambda c: (c[3].step_bound, c[0] in _AUTO))
    for name, k, label, info in may_fit:
        if info.step_bound > best_fit() * (1 + _REL):
            break
        if name in _AUTO and allowed == ("none",) and _full_bound(profile, info.stages, _placement(p, k, name in _V), p, m, budget) > best_fit() * (1 + _REL):
            continue  # the bound of every schedule on this split, memory included, rules it out before a build
        try_candidate(name, k, label, info.stages)
    if not any(o.fits for o in options):
        for name, k, label, info in sorted(pending, key=lambda c: c[3].excess_bound):
            closest = min((o.key(budget)[0] for o in options), default=math.inf)
            if info.excess_bound > closest * (1 + _REL) + budget * _REL:
                break
            if (name, k, info.stages) not in seen:
                try_candidate(name, k, label, info.stages)

    # beyond `max_splits`: refine the best few under their schedule (the automatic ones under a
    # fixed proxy, then built on the result)
    large = [(name, k) for name, k in configs if not exact[(name, k)]]
    if large:
        best_of: dict[tuple[str, int], Option] = {}
        for o in options:
            if (o.schedule, o.chunks) in large and o.peak and ((o.schedule, o.chunks) not in best_of
                                                              or o.key(budget) < best_of[(o.schedule, o.chunks)].key(budget)):
                best_of[(o.schedule, o.chunks)] = o
        for name, k in large:  # proxies are simulated on the heuristic splits even where pruned
            proxy = _PROXY.get(name)
            if proxy is not None and (proxy, k) not in best_of:
                for label, info in split_info[(k, name in _V)]:
                    o = _simulate_option(profile, proxy, k, label, info.stages, budget, built.get((proxy, k)), p, m, allowed,
                                         host=host)
                    if o[1] is not None:
                        built[(proxy, k)] = o[1]
                    if o[0].peak and ((proxy, k) not in best_of or o[0].key(budget) < best_of[(proxy, k)].key(budget)):
                        best_of[(proxy, k)] = o[0]
        ranked = sorted((o for key, o in best_of.items() if key[0] not in _AUTO), key=lambda o: o.key(budget))
        chosen = ranked[:3] + [o for o in ranked if any(a in names and _PROXY[a] == o.schedule for a in _AUTO)]
        refined: dict[tuple[str, int], Option] = {}
        for o in chosen:
            key = (o.schedule, o.chunks)
            if key in refined or key not in built:
                continue
            refined[key] = r = _refine(profile, o.schedule, o.chunks, o, built[key], budget, p, m, allowed, host)
            if key in large and (o.schedule, o.chunks, r.stages) not in seen:
                seen.add((o.schedule, o.chunks, r.stages))
                options.append(r)
        for name, k in large:
            if name in _AUTO and (_PROXY[name], k) in refined:
                stages = refined[(_PROXY[name], k)].stages
                if (name, k, stages) not in seen:
                    try_candidate(name, k, "refined", stages)

    options.sort(key=lambda o: o.key(budget))
    best = options[0]
    if not best.fits:
        where = f"{best.label} on layers per stage {_sizes(best.stages)} ({best.split})" if best.peak else best.label
        closest = f"{max(best.peak) / 1e9:.3f} GB" if best.peak else "none"
        host_note = (f" and holds {best.host_excess / 1e9:.3f} GB more pinned host memory than a rank's share of "
                     f"host_memory={host_memory_ / 1e9:.3f} GB" if best.host_excess > 0 else "")
        raise ValueError(f"no schedule and split fits memory_budget={budget / 1e9:.3f} GB per rank; the closest, {where}, "
                         f"peaks at {closest}{host_note}")
    sched = _build(best.schedule, p, m, best.chunks) if best.schedule not in _AUTO else None
    best, sched, sim, static = _simulate_option(profile, best.schedule, best.chunks, best.split, best.stages, budget, sched,
                                               p, m, allowed, host=host)
    assert sched is not None and sim is not None
    res = sim.result
    peak = tuple(x + y for x, y in zip(static, res.peak_memory))
    # what no schedule of these placements beats on any split that may fit
    over: list[float] = []
    for (k, v), infos in split_info.items():
        if math.comb(L - 1, k * p - 1) > max_splits:
            over.append(_bound_over_splits(profile, _placement(p, k, v), p, m))
        else:  # every split was bounded: those that may fit
            over += [i.step_bound for _, i in infos if i.excess_bound <= budget * _REL]
    searched = Searched(
        exact=all(exact.values()),
        max_splits=max_splits,
        simulated=len(seen),
        candidates=sum(len(split_info[(k, name in _V)]) for name, k in configs),
        bound_over_splits=min(over, default=math.inf),
    )
    return Plan(sched, best.stages, res, tuple(static), peak, budget, profile, tuple(options), best.split, searched,
                best.policies, allowed, sim.link, sim.host, host.share, host_memory_)


def _host(ranks_per_node: int, host_memory: float | None) -> tuple[_Host, float]:
    """The checked host-side settings, and the node's host memory (inf: not limited)."""
    share = as_int(ranks_per_node, "ranks_per_node")
    total = math.inf if host_memory is None else as_number(host_memory, "host_memory")
    return _Host(share, total / share), total


def _allowed(profile: Profile, policies: Sequence[str] | None) -> tuple[str, ...]:
    """The policies to choose from, in `POLICIES` order, each checked."""
    if policies is None:
        return profile.offers()
    if isinstance(policies, str):
        policies = [policies]
    for q in policies:
        if q not in POLICIES:
            raise ValueError(f"unknown policy {q!r}; the policies are {', '.join(POLICIES)}")
    if not policies:
        raise ValueError("policies: give at least one (e.g. ['none'])")
    # a policy no layer offers runs as "none" everywhere: the plan would name it, costed as "none"
    offered = profile.offers()
    unmeasured = [q for q in policies if q not in offered]
    if unmeasured:
        raise ValueError(f"policy {unmeasured[0]!r} is offered by no layer of the profile (it offers "
                         f"{', '.join(offered)}): measure it first (zbpp measure --policies, measure_profile(policies=))")
    return tuple(q for q in POLICIES if q in policies)


def _sizes(stages: Sequence[range]) -> str:
    return "/".join(str(len(r)) for r in stages)
