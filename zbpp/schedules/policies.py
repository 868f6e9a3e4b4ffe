"""Simulating a split under per-stage activation policies (none, full, selective, offload).

`Profile.stage_costs` folds a policy's recompute time into B and its kept bytes into `Memory`
(F keeps `PolicyCost.activation` until B, B keeps `PolicyCost.wgrad` until W, and B's
`PolicyCost.transient`, the re-run or reloaded tensors, counts while it runs). Offload's copies
run on a side stream, so what they cost depends on the schedule. The model, per stage s whose
layers offload ``c_s`` bytes per microbatch over a host link of bandwidth H per direction that
the `ranks_per_node` ranks of a node share (each of them copying at once: ``H / ranks_per_node``
each, the worst case; 1: a link of its own):

- a copy takes ``t_s = c_s * ranks_per_node / H`` each way: to the host after F(s, j) ends, back
  before B(s, j) starts, one after the other, so the gap between them hides ``2 t_s`` at most;
- the gap ``g_s`` is the shortest, over microbatches j, from the end of F(s, j) to the start of
  its backward (B or BW), in the same schedule (task order) simulated with every stage at "none";
- each B of the stage gains the part not hidden, ``max(0, 2 t_s - g_s)``, and the schedule is
  simulated again with it;
- a rank's copies share its part of the link, one after another: each direction carries ``m *
  sum of t_s`` over its stages per step (`PolicySim.link`), and the step is at least that
  (`PolicySim.step`: the simulated makespan or, where longer, the busiest rank's link time);
- host memory: rank r holds ``sum over its stages of A_s * c_s`` pinned bytes (A_s: microbatches
  of s past F and before B, `memory_terms`), at most `PolicySim.host` per step.

Measuring the gap on the "none" costs makes each stage's copy cost a fixed number for a
schedule and split, whatever the other stages choose, so `planner.search` can pick per stage
(it weighs the link time and the host bytes of a rank's stages together).

>>> from zbpp.schedules import build
>>> from zbpp.schedules.profile import Layer, PolicyCost, Profile
>>> block = Layer("b", 1, 1, 1, activation=4, wgrad=2, policies={"offload": PolicyCost(0, 2, copy=4)})
>>> prof = Profile([block, block], host_bytes_per_s=2)  # a copy: 2 time units each way
>>> got = simulate_policies(build("1f1b", num_ranks=2, num_microbatches=2), prof, [range(0, 1), range(1, 2)],
...                         ["offload", "none"])
>>> got.gaps[0], got.exposed, got.link, got.host  # stage 0's shortest F-to-B gap 3 hides 3 of the 4
(3.0, (1.0, 0.0), (4.0, 0.0), (8.0, 0.0))
>>> shared = simulate_policies(got.result.schedule, prof, [range(0, 1), range(1, 2)], ["offload", "none"],
...                            ranks_per_node=2)  # half the link: 4 each way, 8 - 3 exposed per BW
>>> shared.exposed, shared.link, shared.step
((5.0, 0.0), (8.0, 0.0), 18.0)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from .checks import as_int
from .ir import Kind, Schedule
from .profile import Profile
from .simulate import Costs, Memory, SimResult, simulate

__all__ = ["PolicySim", "simulate_policies", "policy_costs", "shortest_gaps", "memory_terms", "rank_peak",
           "link_and_host"]


@dataclass(frozen=True)
class PolicySim:
    """A schedule simulated under per-stage policies: what `simulate_policies` returns."""

    result: SimResult
    costs: Costs  #: B includes recompute and exposed copy time
    memory: Memory
    static: tuple[float, ...]  #: per stage
    gaps: tuple[float, ...]  #: per stage: shortest F-to-backward gap with every stage at "none"
    exposed: tuple[float, ...]  #: per stage: copy time added to each B
    link: tuple[float, ...] = ()  #: per rank: time its offload copies take its share of the host link, each way
    host: tuple[float, ...] = ()  #: per rank: the most pinned host bytes its offloaded activations hold

    @property
    def step(self) -> float:
        """The simulated makespan, or the busiest rank's link time where the copies take longer."""
        return max(self.result.makespan, max(self.link, default=0.0))


def shortest_gaps(result: SimResult) -> list[float]:
    """Per stage: the shortest time from the end of a microbatch's F to the start of its B (or BW)."""
    sched = result.schedule
    gaps = [float("inf")] * sched.num_stages
    for order in sched.orders:
        for a in order:
            if a.kind in (Kind.B, Kind.BW):
                f = type(a)(Kind.F, a.stage, a.microbatch)
                gaps[a.stage] = min(gaps[a.stage], result.start[a] - result.end[f])
    return [g if g != float("inf") else 0.0 for g in gaps]


def simulate_policies(schedule: Schedule, profile: Profile, stages: Sequence[range], policies: Sequence[str] | None,
                      base: SimResult | None = None, ranks_per_node: int = 1) -> PolicySim:
    """Simulate `schedule` on the split `stages` of `profile`, stage s under ``policies[s]``
    (None: all "none"), offload copies costed as the module docstring says over the profile's
    host link shared by `ranks_per_node` ranks. `base`: the schedule already simulated with
    every stage at "none" (computed if needed and not given)."""
    costs, memory, static, gaps, exposed = policy_costs(schedule, profile, stages, policies, base, ranks_per_node)
    link, host = link_and_host(schedule, profile, stages, policies, ranks_per_node)
    return PolicySim(simulate(schedule, costs, memory), costs, memory, tuple(static), tuple(gaps), tuple(exposed),
                     tuple(link), tuple(host))


def link_and_host(schedule: Schedule, profile: Profile, stages: Sequence[range], policies: Sequence[str] | None,
                  ranks_per_node: int = 1) -> tuple[list[float], list[float]]:
    """Per rank: the time its offload copies take its share of the host link each way over a step
    (m microbatches of each of its stages), and the most host bytes they hold at once."""
    share = as_int(ranks_per_node, "ranks_per_node")
    copies = profile.stage_copies(stages, policies)
    held = profile.stage_host_bytes(stages, policies)
    m = schedule.num_microbatches
    link, host = [], []
    for mine, terms in memory_terms(schedule):
        link.append(m * share * sum(copies[s] for s in mine))
        host.append(rank_peak(terms, [held[s] for s in mine], [0.0] * len(mine)) if any(held[s] for s in mine) else 0.0)
    return link, host


def policy_costs(schedule: Schedule, profile: Profile, stages: Sequence[range], policies: Sequence[str] | None,
                 base: SimResult | None = None, ranks_per_node: int = 1
                 ) -> tuple[Costs, Memory, list[float], list[float], list[float]]:
    """What `simulate_policies` simulates, without simulating it: the costs (B with recompute and
    exposed copy time), the memory, the static bytes, the gaps and the exposed copy time per
    stage. A stage's B and memory depend on its own policy only."""
    share = as_int(ranks_per_node, "ranks_per_node")
    costs, memory, static = profile.stage_costs(stages, policies)
    copies = [c * share for c in profile.stage_copies(stages, policies)]
    n = len(stages)
    gaps: list[float] = [0.0] * n
    exposed = [0.0] * n
    if any(copies):
        if base is None:
            base = simulate(schedule, *profile.stage_costs(stages)[:2])
        gaps = shortest_gaps(base)
        exposed = [max(0.0, 2 * c - g) if c else 0.0 for c, g in zip(copies, gaps)]
        if any(exposed):
            _, b, _ = costs.per_stage(n)
            costs = replace(costs, b=tuple(x + e for x, e in zip(b, exposed)))
    return costs, memory, static, gaps, exposed


def memory_terms(schedule: Schedule) -> list[tuple[tuple[int, ...], list[tuple[int, ...]]]]:
    """Per rank: its stages, and the ways its memory is made up after each of its tasks and,
    during each, before it plus its transient.

    After a task, rank r holds ``sum over its stages s of A_s * activation_s + W_s * wgrad_s``
    (A_s: microbatches of s past F and before their B or BW, W_s: past B and before W), whatever
    the costs: its order fixes the counts; during a task of stage s it holds the counts before it
    plus that task's transient. Each term is ``(A_1, W_1, ..., A_k, W_k, F_1, B_1, W_1, ...,
    F_k, B_k, W_k)`` over the rank's k stages: the counts, then which task's transient is added
    (at most one is 1; a BW counts as its B, then as its W once B's delta is done: `Memory`'s
    rule). A term another one is at least on every entry is left out (all bytes are >= 0), so
    `rank_peak` is the simulated peak of any per-stage memory.

    >>> from zbpp.schedules import build
    >>> memory_terms(build("gpipe", num_ranks=1, num_microbatches=2))  # F F BW BW: at most 2 in flight
    [((0,), [(1, 0, 1, 0, 0), (1, 1, 0, 0, 1), (2, 0, 0, 1, 0)])]
    """
    known = _TERMS.get(id(schedule))
    if known is not None and known[0] is schedule:  # the search asks once per split of a schedule
        return known[1]
    out = []
    for r, order in enumerate(schedule.orders):
        mine = tuple(schedule.stages_on(r))
        at = {s: i for i, s in enumerate(mine)}
        k = len(mine)
        counts = [0] * (2 * k)
        terms: set[tuple[int, ...]] = set()

        def during(counts: list[int], i: int, which: int) -> None:
            flags = [0] * (3 * k)
            flags[3 * i + which] = 1
            terms.add(tuple(counts) + tuple(flags))

        for a in order:
            i = 2 * at[a.stage]
            if a.kind is Kind.F:
                during(counts, at[a.stage], 0)
                counts[i] += 1
            elif a.kind is Kind.B:
                during(counts, at[a.stage], 1)
                counts[i] -= 1
                counts[i + 1] += 1
            elif a.kind is Kind.W:
                during(counts, at[a.stage], 2)
                counts[i + 1] -= 1
            else:  # BW: its B, then its W
                during(counts, at[a.stage], 1)
                counts[i] -= 1
                counts[i + 1] += 1
                during(counts, at[a.stage], 2)
                counts[i + 1] -= 1
            terms.add(tuple(counts) + (0,) * (3 * k))
        kept: list[tuple[int, ...]] = []  # the maximal terms: by falling sum, none is above a later one
        for t in sorted(terms, key=lambda t: (-sum(t), t)):
            if not any(all(x >= y for x, y in zip(o, t)) for o in kept):
                kept.append(t)
        out.append((mine, sorted(kept)))
    _TERMS[id(schedule)] = (schedule, out)
    while len(_TERMS) > 16:
        _TERMS.pop(next(iter(_TERMS)))
    return out


_TERMS: dict[int, tuple[Schedule, list]] = {}  # id -> (the schedule, kept alive so the id stays its own; its terms)


def rank_peak(terms: list[tuple[int, ...]], activation: Sequence[float], wgrad: Sequence[float],
              transient: Sequence[Sequence[float]] | None = None) -> float:
    """The peak of one rank from its `memory_terms`, given its stages' activation and wgrad bytes
    and (optional) each stage's F, B and W transients, ``[(f, b, w), ...]``."""
    k = len(activation)
    trans = [x for t in transient for x in t] if transient is not None else [0.0] * (3 * k)
    top = 0.0
    for t in terms:
        top = max(top, sum(t[2 * i] * a + t[2 * i + 1] * w for i, (a, w) in enumerate(zip(activation, wgrad)))
                  + sum(x * y for x, y in zip(t[2 * k:], trans)))
    return top
