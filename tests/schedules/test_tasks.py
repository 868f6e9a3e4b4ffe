"""zbpp.schedules.tasks, the one definition of which task feeds which and of task ids.

The reference is DESIGN.md's edge list, written out here on its own: for every microbatch j,
F(s,j) -> F(s+1,j), F(last,j) -> B(last,j), B(s+1,j) -> B(s,j), B(s,j) -> W(s,j), a BW standing
for its B (and W) where the backward is not split. Every form the module offers (on Actions, on
ids, as tables for hot loops) must give exactly these edges.
"""

from __future__ import annotations

import random

import pytest

from zbpp.schedules import Costs, Memory, available, build
from zbpp.schedules.generators.auto_heuristic import Problem
from zbpp.schedules.ir import Action, Kind, loop_placement, v_placement
from zbpp.schedules.tasks import KINDS, TaskIds, data_consumers, data_dependencies, input_of

F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW


def design_edges(n: int, m: int, split: set[tuple[int, int]]) -> set[tuple[Action, Action]]:
    """DESIGN.md's data edges for n stages and m microbatches; (s, j) in `split` has B and W, else BW."""

    def backward(s: int, j: int) -> Action:
        return Action(B if (s, j) in split else BW, s, j)

    edges = set()
    for j in range(m):
        for s in range(n - 1):
            edges.add((Action(F, s, j), Action(F, s + 1, j)))
            edges.add((backward(s + 1, j), backward(s, j)))
        edges.add((Action(F, n - 1, j), backward(n - 1, j)))
        for s in range(n):
            if (s, j) in split:
                edges.add((Action(B, s, j), Action(W, s, j)))
    return edges


def tasks_of(n: int, m: int, split: set[tuple[int, int]]) -> list[Action]:
    out = []
    for s in range(n):
        for j in range(m):
            out.append(Action(F, s, j))
            out += [Action(B, s, j), Action(W, s, j)] if (s, j) in split else [Action(BW, s, j)]
    return out


CASES = [(1, 1), (1, 3), (2, 1), (3, 2), (4, 3), (6, 5)]


def random_split(n: int, m: int, mode: str, seed: int) -> set[tuple[int, int]]:
    """The (stage, mb) whose backward is split: all, none, or a random half (as DualPipeV mixes them)."""
    rng = random.Random(seed)
    return {(s, j) for s in range(n) for j in range(m) if mode == "all" or (mode == "mixed" and rng.random() < 0.5)}


SPLITS = [("all", 0), ("none", 0)] + [("mixed", seed) for seed in range(4)]


@pytest.mark.parametrize("n,m", CASES)
@pytest.mark.parametrize("mode,seed", SPLITS)
def test_actions_follow_the_design_edges(n: int, m: int, mode: str, seed: int) -> None:
    split = random_split(n, m, mode, seed)
    tasks = tasks_of(n, m, split)
    present = set(tasks)
    edges = design_edges(n, m, split)
    got = {(input_of(a, n, present), a) for a in tasks if input_of(a, n, present) is not None}
    assert got == edges
    for a in tasks:
        assert data_dependencies(a, n, present) == [src for src, dst in edges if dst == a]
        assert sorted(data_consumers(a, n, present)) == sorted(dst for src, dst in edges if src == a)


@pytest.mark.parametrize("n,m", CASES)
def test_without_a_task_set_every_backward_is_split(n: int, m: int) -> None:
    split = {(s, j) for s in range(n) for j in range(m)}
    edges = design_edges(n, m, split)
    for a in tasks_of(n, m, split):
        assert data_dependencies(a, n) == [src for src, dst in edges if dst == a]
        assert sorted(data_consumers(a, n)) == sorted(dst for src, dst in edges if src == a)


@pytest.mark.parametrize("n,m", CASES)
@pytest.mark.parametrize("mode,seed", SPLITS)
def test_ids_and_their_tables_follow_the_design_edges(n: int, m: int, mode: str, seed: int) -> None:
    """`TaskIds.input`, the table `inputs` that hot loops index and `feeds` give the same edges."""
    split = random_split(n, m, mode, seed)
    ids = TaskIds(n, m)
    present = bytearray(ids.size)
    for a in tasks_of(n, m, split):
        present[ids.of(a)] = 1
    edges = {(ids.of(src), ids.of(dst)) for src, dst in design_edges(n, m, split)}
    table = ids.inputs(present)
    assert len(table) == ids.size
    feeds = ids.feeds(present)
    for t in range(ids.size):
        assert table[t] == ids.input(t, present)
        if present[t]:
            want = [src for src, dst in edges if dst == t]
            assert [table[t]] == want if want else table[t] == -1
            onward = [dst for src, dst in edges if src == t and ids.kind_of(dst) != 2]
            assert feeds[t] == (onward[0] if onward else -1)
        else:
            assert feeds[t] == -1


def test_split_tables_without_a_task_set() -> None:
    ids = TaskIds(3, 2)
    split = {(s, j) for s in range(3) for j in range(2)}
    edges = {(ids.of(src), ids.of(dst)) for src, dst in design_edges(3, 2, split)}
    inputs = ids.inputs()
    assert {(inputs[t], t) for t in range(3 * ids.nm) if inputs[t] >= 0} == edges


def test_ids_are_dense_and_round_trip() -> None:
    ids = TaskIds(3, 4)
    seen = set()
    for kind in KINDS:
        for s in range(3):
            for j in range(4):
                a = Action(kind, s, j)
                t = ids.of(a)
                assert t == ids.id(kind, s, j) == ids.id(KINDS.index(kind), s, j)
                assert ids.action(t) == a and ids.kind_of(t) == KINDS.index(kind) and ids.stage_of(t) == s
                seen.add(t)
    assert seen == set(range(ids.size))


def test_lags_are_comm_exactly_on_messages() -> None:
    """A task's input arrives `comm` after it ends when producer and consumer are on different ranks."""
    for placement in (loop_placement(3), v_placement(3), loop_placement(2, 2)):
        n, m = len(placement), 2
        ids = TaskIds(n, m)
        split = {(s, j) for s in range(n) for j in range(m)}
        lags = ids.lags(placement, 0.25)
        for src, dst in design_edges(n, m, split):
            crosses = placement[src.stage] != placement[dst.stage]
            assert lags[ids.of(dst)] == (0.25 if crosses else 0.0)
        assert all(lags[ids.id(F, 0, j)] == 0.0 for j in range(m))  # no input at all


@pytest.mark.parametrize("name", [n for n in available() if not n.endswith("auto")])
def test_encode_reads_every_schedule_back(name: str) -> None:
    sched = build(name, num_ranks=3, num_microbatches=4)
    ids = TaskIds(sched.num_stages, sched.num_microbatches)
    encoded = ids.encode(sched)
    assert encoded is not None
    assert ids.decode(encoded.orders) == [list(o) for o in sched.orders]
    assert {t for t in range(ids.size) if encoded.present[t]} == {ids.of(a) for _, a in sched.actions()}


def test_the_search_problem_reads_its_tables_from_here() -> None:
    """zb-auto's searches index `Problem`'s tables: the split tables of TaskIds, cut to F, B and W."""
    prob = Problem.make(v_placement(3), 4, Costs(1, 2, 3, comm=0.5), Memory(1, 0.5), limit=10)
    ids = TaskIds(6, 4)
    assert prob.inputs == ids.inputs()[: 3 * ids.nm]
    assert prob.feeds == ids.feeds()[: 3 * ids.nm]
    assert prob.lags == ids.lags(v_placement(3), 0.5)[: 3 * ids.nm]
