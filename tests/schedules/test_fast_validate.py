"""`validate` decides validity in one integer pass and builds the networkx graph only to name a
problem. This pins the fast path to the graph definition of DESIGN.md (valid = complete task set
on the right ranks and an acyclic DAG + rank chains) on random, often deadlocking, reorderings.

(It lives with the viz tests because the speedup was made for the scheduler benchmark of this work
package; it tests zbpp.schedules.dag.)
"""

from __future__ import annotations

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from zbpp.schedules import ScheduleError, available, build, task_graph, validate
from zbpp.schedules.dag import _check_tasks, _valid_fast
from zbpp.schedules.ir import Schedule

NAMES = [n for n in ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipe-v") if n in available()]


def _valid_by_graph(sched: Schedule) -> bool:
    try:
        _check_tasks(sched)
    except ScheduleError:
        return False
    return nx.is_directed_acyclic_graph(task_graph(sched))


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    p=st.integers(1, 4),
    m=st.integers(1, 5),
    data=st.data(),
)
def test_fast_path_agrees_with_the_graph(name, p, m, data):
    sched = build(name, num_ranks=p, num_microbatches=m)
    orders = [list(o) for o in sched.orders]
    mutation = data.draw(st.sampled_from(["none", "swap", "shuffle", "drop", "duplicate"]))
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
    mutated = Schedule(sched.num_ranks, sched.num_stages, sched.num_microbatches, sched.placement, tuple(map(tuple, orders)),
                       overlap_pairs=sched.overlap_pairs if mutation == "none" else ())
    expected = _valid_by_graph(mutated)
    assert _valid_fast(mutated) == expected
    if expected:
        assert validate(mutated) is mutated
    else:
        try:
            validate(mutated)
        except ScheduleError:
            pass
        else:
            raise AssertionError("validate accepted an invalid schedule")
