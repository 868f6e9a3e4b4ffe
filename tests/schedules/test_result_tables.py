"""`simulate` returns its per-task times and memory as read-only mappings (no per-task hashing).

Figures, traces and the ASCII view read them like dicts; these checks pin that behaviour against
a plain dict built from the same values, and the hand-worked 1F1B times (p=2, m=2, unit costs).
"""

from __future__ import annotations

import pickle

import pytest

from zbpp.schedules import Costs, build, simulate
from zbpp.schedules.ir import Action


def test_tables_read_like_dicts():
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    res = simulate(sched, Costs(1, 1, 1))
    want = {"F0.0": 0, "F0.1": 1, "BW0.0": 4, "BW0.1": 7, "F1.0": 1, "BW1.0": 2, "F1.1": 4, "BW1.1": 5}
    as_dict = dict(res.start)
    assert {str(a): v for a, v in as_dict.items()} == want
    assert list(res.start) == [a for order in sched.orders for a in order]  # rank by rank, in order
    assert len(res.start) == len(res.end) == len(res.memory_after) == 8
    assert res.start == as_dict and res.start.get(Action.parse("F0.0")) == 0
    assert Action.parse("B0.0") not in res.start and Action.parse("F5.0") not in res.start and "F0.0" not in res.start
    assert res.start.get(Action.parse("W0.0"), -1) == -1
    with pytest.raises(KeyError):
        res.end[Action.parse("W0.0")]
    assert sorted(res.end.values()) == sorted(as_dict[a] + (1 if a.kind.value == "F" else 2) for a in as_dict)
    assert dict(res.end.items()) == {a: res.end[a] for a in res.end}
    assert "F0.0" in repr(res.start)
    back = pickle.loads(pickle.dumps(res.start))
    assert dict(back) == as_dict
