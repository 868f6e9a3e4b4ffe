"""Optimal contiguous partition of a model's repeated blocks over pipeline stages.

A stage's load is the sum of its blocks' costs, plus a fixed extra on the first stage (what comes
before the blocks: embeddings) and on the last (what comes after: final norm, LM head). The split
minimises the largest load, every stage holding at least one block, exactly, and among the splits
that do, the sum of the squared loads (the others as even as the largest allows; dynamic
programming over the prefix sums, O(stages x blocks^2)).

>>> balanced_partition([1, 1, 1, 1, 1, 1], 3)
[2, 2, 2]
>>> balanced_partition([1, 1, 1, 1, 1, 1], 3, first=2.0)  # the embedding weighs two blocks
[1, 3, 2]
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

__all__ = ["balanced_partition", "partition_loads"]


def partition_loads(costs: Sequence[float], sizes: Sequence[int], *, first: float = 0.0, last: float = 0.0) -> list[float]:
    """The load of each stage when stage s holds the next ``sizes[s]`` blocks.

    >>> partition_loads([3, 1, 1, 1], [1, 3], last=1.0)
    [3.0, 4.0]
    """
    if sum(sizes) != len(costs) or any(n < 0 for n in sizes):
        raise ValueError(f"sizes {list(sizes)} do not split {len(costs)} blocks")
    loads, at = [], 0
    for n in sizes:
        loads.append(float(sum(costs[at:at + n])))
        at += n
    loads[0] += first
    loads[-1] += last
    return loads


def balanced_partition(costs: Sequence[float], num_stages: int, *, first: float = 0.0, last: float = 0.0) -> list[int]:
    """How many consecutive blocks each of `num_stages` stages holds, minimising the largest stage
    load, then the sum of squared loads (see the module docstring); ties are broken the same way on
    every rank.

    Args:
        costs: one non-negative number per block (parameter count, measured time, ...).
        num_stages: stages to split into; at most ``len(costs)`` (every stage holds a block).
        first, last: the extra load of the first and the last stage.
    """
    n = len(costs)
    # any integer and real type (numpy's: a parameter count array), as the schedule core takes them
    if not isinstance(num_stages, numbers.Integral) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    num_stages = int(num_stages)
    if n < num_stages:
        raise ValueError(f"{n} blocks cannot fill {num_stages} stages: every stage holds at least one block")
    for name, c in [*((f"costs[{i}]", c) for i, c in enumerate(costs)), ("first", first), ("last", last)]:
        if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c) or c < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {c!r}")
    # the sums of squared loads below overflow a float past ~1e154: scaled by a power of 2 (exact)
    # so that every load is at most 1, the split unchanged
    top_cost = max(float(c) for c in (*costs, first, last))
    if top_cost > 2.0 ** 500:
        k = 2.0 ** -(math.frexp(top_cost)[1] + (n + 2).bit_length())
        costs, first, last = [float(c) * k for c in costs], float(first) * k, float(last) * k
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def load(s: int, i: int, j: int) -> float:  # stage s holding blocks i..j-1
        return prefix[j] - prefix[i] + (first if s == 0 else 0.0) + (last if s == num_stages - 1 else 0.0)

    # best[s][j]: the smallest largest load of stages 0..s holding blocks 0..j-1
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = load(0, 0, j)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(j - 1, s - 1, -1):
                v = max(best[s - 1][i], load(s, i, j))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    # Many splits may share that largest load (one heavy stage fixes it); among them, the loads as
    # even as possible: the least sum of squares with every stage within the largest load. Else the
    # blocks pile onto the earliest stages, which keep the most microbatches in flight (1F1B).
    top = best[num_stages - 1][n]
    even = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        if load(0, 0, j) <= top:
            even[0][j] = load(0, 0, j) ** 2
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(j - 1, s - 1, -1):
                x = load(s, i, j)
                if x <= top and even[s - 1][i] + x * x < even[s][j]:
                    even[s][j], cut[s][j] = even[s - 1][i] + x * x, i
    sizes, j = [], n
    for s in range(num_stages - 1, 0, -1):
        i = cut[s][j]
        sizes.append(j - i)
        j = i
    sizes.append(j)
    return sizes[::-1]
