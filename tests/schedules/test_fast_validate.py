"""`validate` decides validity with the task-set check and one replay of the rank orders, and
builds the networkx graph only to name a cycle. This pins it to the definition of DESIGN.md
(valid = every (stage, mb) has one F and either one BW or one B and one W, each once and on its
stage's rank, and the DAG + rank chains is acyclic), written out here independently, on random,
often deadlocking, reorderings."""

from __future__ import annotations

from collections import Counter

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from zbpp.schedules import Action, Kind, ScheduleError, available, build, task_graph, validate
from zbpp.schedules.ir import Schedule

NAMES = [n for n in ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipe-v") if n in available()]


def _complete_by_design(sched: Schedule) -> bool:
    counts = Counter(sched.actions())  # (rank, action): a task on a wrong rank is not counted below
    if any(c > 1 for c in counts.values()) or any(sched.rank_of(a.stage) != r for r, a in counts):
        return False
    for s in range(sched.num_stages):
        r = sched.rank_of(s)
        for j in range(sched.num_microbatches):
            has = {k: (r, Action(k, s, j)) in counts for k in Kind}
            if not has[Kind.F] or not (has[Kind.BW] != (has[Kind.B] and has[Kind.W])):
                return False
            if has[Kind.BW] and (has[Kind.B] or has[Kind.W]):
                return False
    return True


def _valid_by_graph(sched: Schedule) -> bool:
    return _complete_by_design(sched) and nx.is_directed_acyclic_graph(task_graph(sched))


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    p=st.integers(1, 4),
    m=st.integers(1, 5),
    data=st.data(),
)
def test_validate_agrees_with_the_graph(name, p, m, data):
    sched = build(name, num_ranks=p, num_microbatches=m)
    orders = [list(o) for o in sched.orders]
    mutation = data.draw(st.sampled_from(["none", "swap", "shuffle", "drop", "duplicate", "move"]))
    r = data.draw(st.integers(0, p - 1))
    o = orders[r]
    if mutation == "swap" and len(o) > 1:
        i = data.draw(st.integers(0, len(o) - 2))
        o[i], o[i + 1] = o[i + 1], o[i]
    elif mutation == "shuffle":
        orders[r] = data.draw(st.permutations(o))
    elif mutation == "drop" and o:
        o.pop(data.draw(st.integers(0, len(o) - 1)))
    elif mutation == "duplicate" and o:
        o.append(o[data.draw(st.integers(0, len(o) - 1))])
    elif mutation == "move" and o and p > 1:  # a task onto another rank's order
        orders[(r + 1) % p].append(o.pop(data.draw(st.integers(0, len(o) - 1))))
    mutated = Schedule(sched.num_ranks, sched.num_stages, sched.num_microbatches, sched.placement, tuple(map(tuple, orders)),
                       overlap_pairs=sched.overlap_pairs if mutation == "none" else ())
    if _valid_by_graph(mutated):
        assert validate(mutated) is mutated
    else:
        try:
            validate(mutated)
        except ScheduleError:
            pass
        else:
            raise AssertionError("validate accepted an invalid schedule")
