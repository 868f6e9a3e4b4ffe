"""The balanced split of a model's blocks over stages is optimal: its largest stage load equals the
brute-force minimum over every contiguous split (exact for integer costs), with the first and last
stages' extra loads, and `fqns_per_stage` measures a stage by what `balance` says."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from zbpp.models import balanced_partition, fqns_per_stage, partition_loads


def brute_force(costs: list[int], stages: int, first: int, last: int) -> int:
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = (0, *cuts, len(costs))
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        worst = max(partition_loads(costs, sizes, first=first, last=last))
        best = worst if best is None else min(best, worst)
    return best


def test_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        s = rng.randint(1, n)
        costs = [rng.randint(0, 20) for _ in range(n)]
        first, last = rng.choice([0, 0, rng.randint(0, 40)]), rng.choice([0, 0, rng.randint(0, 40)])
        sizes = balanced_partition(costs, s, first=first, last=last)
        assert len(sizes) == s and sum(sizes) == n and min(sizes) >= 1, (costs, s, sizes)
        assert max(partition_loads(costs, sizes, first=first, last=last)) == brute_force(costs, s, first, last), \
            (costs, s, first, last, sizes)


def brute_force_even(costs: list[int], stages: int, first: int, last: int) -> int:
    """The least sum of squared stage loads among the splits whose largest load is the least."""
    best = brute_force(costs, stages, first, last)
    sums = []
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = (0, *cuts, len(costs))
        loads = partition_loads(costs, [b - a for a, b in zip(bounds, bounds[1:])], first=first, last=last)
        if max(loads) == best:
            sums.append(sum(x * x for x in loads))
    return min(sums)


def test_the_stages_below_the_largest_load_are_balanced_too():
    """Where one stage's load fixes the largest (a heavy embedding on the first stage), many splits
    share that largest load, and the split took the one that piles the other blocks onto the earliest
    stages: [1, 5, 1, 1] for 8 unit blocks after an embedding of 100, where [1, 3, 2, 2] runs as fast
    (the step is bound by the first stage either way) and, under 1F1B, the second stage keeps its
    activations for 3 microbatches in flight: 15 blocks' worth against 9. Among the splits of least
    largest load, the loads must be as even as possible: the least sum of squares, against brute
    force (exact: integer costs)."""
    assert sorted(balanced_partition([1] * 8, 4, first=100)[1:]) == [2, 2, 3]
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(1, 9)
        s = rng.randint(1, n)
        costs = [rng.randint(0, 20) for _ in range(n)]
        first, last = rng.choice([0, rng.randint(0, 80)]), rng.choice([0, rng.randint(0, 80)])
        loads = partition_loads(costs, balanced_partition(costs, s, first=first, last=last), first=first, last=last)
        assert max(loads) == brute_force(costs, s, first, last), (costs, s, first, last)
        assert sum(x * x for x in loads) == brute_force_even(costs, s, first, last), (costs, s, first, last, loads)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="3 blocks cannot fill 4 stages"):
        balanced_partition([1, 1, 1], 4)
    with pytest.raises(ValueError, match=r"costs\[1\] must be a finite number >= 0"):
        balanced_partition([1, -2, 1], 2)
    with pytest.raises(ValueError, match="num_stages must be a positive int"):
        balanced_partition([1, 1], 0)


def test_numpy_numbers_and_huge_costs_split_as_python_numbers():
    """A numpy array of parameter counts (np.int64, or float32) and a numpy num_stages were refused
    as not 'a finite number >= 0' / 'a positive int'; costs past ~1e154 overflowed the sum of
    squared loads (OverflowError). The reference: the same costs as Python ints, and, for huge
    ones, unit costs times a power of 2 (exact in floats: every load scales alike)."""
    import numpy as np

    costs = [4, 1, 1, 2, 1, 3, 1]
    want = balanced_partition(costs, 3, first=2)
    assert max(partition_loads(costs, want, first=2)) == brute_force(costs, 3, 2, 0)
    for given in (np.array(costs), np.array(costs, dtype=np.float32)):
        assert balanced_partition(given, np.int64(3), first=np.int64(2)) == want
    big = 2.0 ** 600  # its square overflows a float
    assert balanced_partition([c * big for c in costs], 3, first=2 * big) == want
    assert balanced_partition([1e308] * 4, 2) == [2, 2]  # the loads' sums overflow too


class Uneven(nn.Module):
    """Blocks of different widths: their parameter counts differ."""

    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, w), nn.Linear(w, 8)) for w in widths)
        self.norm = nn.LayerNorm(8)
        self.drop = nn.Dropout(0.0)  # parameter-free: every stage
        self.head = nn.Linear(8, 50)


def _stage_params(model: nn.Module, names: list[str]) -> int:
    return sum(q.numel() for f in names for q in model.get_submodule(f).parameters())


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_fqns_per_stage_balances_parameter_counts(stages):
    widths = [4, 40, 8, 8, 64, 4, 16]
    with torch.device("meta"):
        model = Uneven(widths)
    fqns = fqns_per_stage(model, stages, blocks="layers")
    assert fqns[0][:1] == ["embed"] and fqns[-1][-3:] == ["norm", "drop", "head"]
    assert all("drop" in f for f in fqns)
    assert [f for names in fqns for f in names if f.startswith("layers.")] == [f"layers.{i}" for i in range(len(widths))]
    loads = [_stage_params(model, names) for names in fqns]
    blocks = [_stage_params(model, [f"layers.{i}"]) for i in range(len(widths))]
    extra_first, extra_last = _stage_params(model, ["embed"]), _stage_params(model, ["norm", "head"])
    assert max(loads) == brute_force(blocks, stages, extra_first, extra_last)


def test_fqns_per_stage_by_given_costs():
    with torch.device("meta"):
        model = Uneven([4] * 6)
    # measured costs: block 0 is slow; the head as heavy as two blocks
    costs = {"layers.0": 5.0, **{f"layers.{i}": 1.0 for i in range(1, 6)}, "head": 2.0}
    fqns = fqns_per_stage(model, 2, blocks="layers", balance=costs)
    # [layers.0 | 1..5] loads 5, 5+2; [0, 1 | 2..5] loads 6, 4+2: the optimum
    assert [f for f in fqns[0] if f.startswith("layers")] == ["layers.0", "layers.1"]
    fqns = fqns_per_stage(model, 3, blocks="layers", balance=[1, 1, 1, 1, 1, 1])
    assert [[f for f in names if f.startswith("layers")] for names in fqns] == [["layers.0", "layers.1"],
                                                                                  ["layers.2", "layers.3"],
                                                                                  ["layers.4", "layers.5"]]
    with pytest.raises(ValueError, match="blocks without a cost: \\['layers.5'\\]"):
        fqns_per_stage(model, 2, blocks="layers", balance={f"layers.{i}": 1.0 for i in range(5)})
    with pytest.raises(ValueError, match="balance has 2 costs but the model has 6 blocks"):
        fqns_per_stage(model, 2, blocks="layers", balance=[1, 2])
    with pytest.raises(ValueError, match="blocks='model.layers' names no submodule of Uneven"):
        fqns_per_stage(model, 2)
