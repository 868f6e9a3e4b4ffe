"""Replaying rank orders: each rank runs its next task as soon as that task's input is done.

This is the one loop behind the validator (does every task run?), the simulator (when does each
run?), the program's timings and the automatic schedules' local search. Tasks are
integer ids (`zbpp.schedules.tasks.TaskIds`) and everything the loop reads is a table indexed by
id: each task's one input (-1: none), its duration and the lag from its input's end to its
arrival (`comm` on a message). A task starts when its rank is free and its input has arrived.

Every task has at most one input, so the orders plus the data edges are acyclic exactly when
this replay runs every task: the first unfinished task of a topological order is always the
next task of its rank, and its input is done.

>>> from zbpp.schedules.tasks import TaskIds
>>> from zbpp.schedules.ir import loop_placement
>>> ids = TaskIds(num_stages=2, num_microbatches=1)   # F0 F1 B0 B1 on ids 0 1 2 3
>>> orders = [[0, 2], [1, 3]]
>>> start, end = [0.0] * 4, [-1.0] * 4
>>> replay(orders, ids.inputs(), [1.0, 1.0, 2.0, 2.0], ids.lags(loop_placement(2), 0.5), start, end)
True
>>> end  # F0 ends at 1, F1 starts after the message (1.5), B1 at 2.5, B0 after its message at 5
[1.0, 2.5, 7.0, 4.5]
>>> replay([[2, 0], [1, 3]], ids.inputs(), [1.0] * 4, [0.0] * 4, [0.0] * 4, [-1.0] * 4)  # B0 before F0
False
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["replay"]


def replay(
    orders: Sequence[Sequence[int]],
    inputs: Sequence[int],
    durations: Sequence[float],
    lags: Sequence[float],
    start: list[float],
    end: list[float],
    cuts: Sequence[int] | None = None,
) -> bool:
    """Run the tasks of `orders` (one list of task ids per rank), filling `start` and `end`.

    A task is done when its `end` is >= 0. Rank r replays its order from position ``cuts[r]``
    (default 0): the tasks before it must be done (their times are kept, and the rank is free at
    the end of the last one) and those from it on must have a negative `end`. Returns False when
    some task never gets its input (the orders deadlock); the times of the tasks that ran are set.
    """
    p = len(orders)
    pos = [0] * p if cuts is None else list(cuts)
    free = [end[orders[r][c - 1]] if c else 0.0 for r, c in enumerate(pos)]
    remaining = sum(len(o) for o in orders) - sum(pos)
    ranks = range(p)
    while remaining:
        progressed = False
        for r in ranks:
            order = orders[r]
            i = i0 = pos[r]
            size = len(order)
            if i == size:
                continue
            t_free = free[r]
            while i < size:
                t = order[i]
                dep = inputs[t]
                if dep >= 0:
                    e = end[dep]
                    if e < 0:
                        break
                    e += lags[t]
                    if e > t_free:
                        t_free = e
                start[t] = t_free
                t_free += durations[t]
                end[t] = t_free
                i += 1
            if i != i0:
                remaining -= i - i0
                pos[r] = i
                free[r] = t_free
                progressed = True
        if not progressed:
            return False
    return True
