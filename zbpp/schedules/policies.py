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
schedule and split, whatever the other stages choose, so `planner.search` can pick per rank.

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

__all__ = ["PolicySim", "simulate_policies", "shortest_gaps"]


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
    return PolicySim(simulate(schedule, costs, memory), costs, memory, tuple(static), tuple(gaps), tuple(exposed))
