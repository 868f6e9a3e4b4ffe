"""Simulating a split under per-stage activation policies (none, full, selective, offload).

`Profile.stage_costs` folds a policy's recompute time into B and its kept bytes into `Memory`
(F keeps `PolicyCost.activation` until B, B keeps `PolicyCost.wgrad` until W). Offload's copies
run on a side stream, so what they cost depends on the schedule. The model, per stage s whose
layers offload ``c_s`` bytes per microbatch over a host link of bandwidth H per direction:

- a copy takes ``t_s = c_s / H`` each way: to the host after F(s, j) ends, back before B(s, j)
  starts, one after the other, so the gap between them hides ``2 t_s`` at most;
- the gap ``g_s`` is the shortest, over microbatches j, from the end of F(s, j) to the start of
  its backward (B or BW), in the same schedule (task order) simulated with every stage at "none";
- each B of the stage gains the part not hidden, ``max(0, 2 t_s - g_s)``, and the schedule is
  simulated again with it. Copies of different microbatches and stages overlap each other (a
  link that carries more than the step's length is not modelled).

Measuring the gap on the "none" costs makes each stage's copy cost a fixed number for a
schedule and split, whatever the other stages choose, so `planner.search` can pick per stage.

>>> from zbpp.schedules import build
>>> from zbpp.schedules.profile import Layer, PolicyCost, Profile
>>> block = Layer("b", 1, 1, 1, activation=4, wgrad=2, policies={"offload": PolicyCost(0, 2, copy=4)})
>>> prof = Profile([block, block], host_bytes_per_s=2)  # a copy: 2 time units each way
>>> got = simulate_policies(build("1f1b", num_ranks=2, num_microbatches=2), prof, [range(0, 1), range(1, 2)],
...                         ["offload", "none"])
>>> got.gaps[0], got.exposed  # stage 0's shortest F-to-B gap 3 hides 3 of the 4
(3.0, (1.0, 0.0))
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from .ir import Kind, Schedule
from .profile import Profile
from .simulate import Costs, Memory, SimResult, simulate

__all__ = ["PolicySim", "simulate_policies", "policy_costs", "shortest_gaps", "memory_terms", "rank_peak"]


@dataclass(frozen=True)
class PolicySim:
    """A schedule simulated under per-stage policies: what `simulate_policies` returns."""

    result: SimResult
    costs: Costs  #: B includes recompute and exposed copy time
    memory: Memory
    static: tuple[float, ...]  #: per stage
    gaps: tuple[float, ...]  #: per stage: shortest F-to-backward gap with every stage at "none"
    exposed: tuple[float, ...]  #: per stage: copy time added to each B


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
                      base: SimResult | None = None) -> PolicySim:
    """Simulate `schedule` on the split `stages` of `profile`, stage s under ``policies[s]``
    (None: all "none"), offload copies costed as the module docstring says. `base`: the schedule
    already simulated with every stage at "none" (computed if needed and not given)."""
    costs, memory, static, gaps, exposed = policy_costs(schedule, profile, stages, policies, base)
    return PolicySim(simulate(schedule, costs, memory), costs, memory, tuple(static), tuple(gaps), tuple(exposed))


def policy_costs(schedule: Schedule, profile: Profile, stages: Sequence[range], policies: Sequence[str] | None,
                 base: SimResult | None = None) -> tuple[Costs, Memory, list[float], list[float], list[float]]:
    """What `simulate_policies` simulates, without simulating it: the costs (B with recompute and
    exposed copy time), the memory, the static bytes, the gaps and the exposed copy time per
    stage. A stage's B and memory depend on its own policy only."""
    costs, memory, static = profile.stage_costs(stages, policies)
    copies = profile.stage_copies(stages, policies)
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
    """Per rank: its stages, and the ways its memory is made up after each of its tasks.

    After a task, rank r holds ``sum over its stages s of A_s * activation_s + W_s * wgrad_s``
    (A_s: microbatches of s past F and before their B or BW, W_s: past B and before W), whatever
    the costs: its order fixes the counts. Each term is ``(A_1, W_1, A_2, W_2, ...)`` over the
    rank's stages; a term another one is at least on every count is left out (activation and
    wgrad bytes are >= 0), so `rank_peak` is the simulated peak of any per-stage memory.

    >>> from zbpp.schedules import build
    >>> memory_terms(build("gpipe", num_ranks=1, num_microbatches=2))  # F F BW BW: at most 2 in flight
    [((0,), [(2, 0)])]
    """
    known = _TERMS.get(id(schedule))
    if known is not None and known[0] is schedule:  # the search asks once per split of a schedule
        return known[1]
    out = []
    for r, order in enumerate(schedule.orders):
        mine = tuple(schedule.stages_on(r))
        at = {s: i for i, s in enumerate(mine)}
        counts = [0] * (2 * len(mine))
        terms: set[tuple[int, ...]] = set()
        for a in order:
            i = 2 * at[a.stage]
            if a.kind is Kind.F:
                counts[i] += 1
            elif a.kind is Kind.B:
                counts[i] -= 1
                counts[i + 1] += 1
            elif a.kind is Kind.W:
                counts[i + 1] -= 1
            else:  # BW
                counts[i] -= 1
            terms.add(tuple(counts))
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


def rank_peak(terms: list[tuple[int, ...]], activation: Sequence[float], wgrad: Sequence[float]) -> float:
    """The peak of one rank from its `memory_terms`, given its stages' activation and wgrad bytes."""
    top = 0.0
    for t in terms:
        top = max(top, sum(t[2 * i] * a + t[2 * i + 1] * w for i, (a, w) in enumerate(zip(activation, wgrad))))
    return top
