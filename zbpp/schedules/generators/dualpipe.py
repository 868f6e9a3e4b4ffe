"""DualPipeV: DeepSeek's DualPipe folded onto a V (DeepSeek-V3 technical report; "cut-in-half" DualPipe).

Rank r holds stages r (its chunk 0) and 2p-1-r (chunk 1). In the steady state every forward is
paired with a full backward of the other chunk (an *overlapped F&B pair*), which a runtime can run
concurrently to hide one's communication behind the other's compute. Here a pair is two adjacent
tasks of one rank, forward first, listed in `Schedule.overlap_pairs`; running them one after the
other is correct. Backward is split into B and W (zero-bubble style) only where DualPipeV does it:
in the warm-up (nB1W1F1), in the second half of the nB1B0 phase, and in nWB0; the deferred W's
run first in, first out, as DualPipe's weight-gradient store does.

Phases per rank (counts for p ranks, m microbatches; DualPipeV needs m >= 2p, so smaller m use
the order for 2p microbatches with the extra ones dropped, which keeps the schedule valid):

======== ======================================= ==============
phase    tasks                                   times
======== ======================================= ==============
nF0      F0                                      2(p-r-1)
nF0F1    F0, F1                                  r+1
nB1W1F1  B1, W, F1                               p-r-1
main     (F0 & BW1), (F1 & BW0)                  m-2p+r+1
nB1F1B0  BW1, (F1 & BW0)                         p-r-1
nB1B0    B1, B0 (split from the middle on)       r+1
nWB0     W, B0                                   p-r-1
nW       W                                       r+1
======== ======================================= ==============

>>> from zbpp.schedules import build
>>> s = build("dualpipe-v", num_ranks=2, num_microbatches=4)
>>> [str(a) for a in s.orders[1]][:8]
['F1.0', 'F2.0', 'F1.1', 'F2.1', 'F1.2', 'BW2.0', 'F2.2', 'BW1.0']
>>> [(str(a), str(b)) for a, b in s.overlap_pairs if s.rank_of(a.stage) == 1]
[('F2.2', 'BW1.0'), ('F1.3', 'BW2.1'), ('F2.3', 'BW1.1')]
"""

from __future__ import annotations

from collections import deque

from ..ir import Action, Kind, Schedule, from_orders, v_placement
from .vshape import keep_microbatches, v_stages

__all__ = ["dualpipe_v"]


def _rank_order(p: int, n: int, r: int) -> tuple[list[Action], list[tuple[Action, Action]]]:
    chunk = (r, 2 * p - 1 - r)  # chunk index -> stage
    order: list[Action] = []
    pairs: list[tuple[Action, Action]] = []
    nf = [0, 0]  # next microbatch per chunk
    nb = [0, 0]
    deferred: deque[Action] = deque()  # B's whose W is still to run, oldest first

    def forward(c: int) -> Action:
        a = Action(Kind.F, chunk[c], nf[c])
        nf[c] += 1
        order.append(a)
        return a

    def backward(c: int, *, split: bool = False) -> Action:
        j = nb[c]
        nb[c] += 1
        if split:
            a = Action(Kind.B, chunk[c], j)
            deferred.append(a)
        else:
            a = Action(Kind.BW, chunk[c], j)
        order.append(a)
        return a

    def weight() -> None:
        b = deferred.popleft()
        order.append(Action(Kind.W, b.stage, b.microbatch))

    def overlapped(f_chunk: int, b_chunk: int) -> None:
        pairs.append((forward(f_chunk), backward(b_chunk)))

    for _ in range(2 * (p - r - 1)):  # nF0
        forward(0)
    for _ in range(r + 1):  # nF0F1
        forward(0)
        forward(1)
    for _ in range(p - r - 1):  # nB1W1F1
        backward(1, split=True)
        weight()
        forward(1)
    for i in range(n - 2 * p + r + 1):  # main: nF0B1F1B0
        if i == 0 and r == p - 1:
            # as in DualPipeV, the last rank runs its first F0 and B1 one after the other rather
            # than as a pair, which keeps the bubble smaller
            forward(0)
            backward(1)
        else:
            overlapped(0, 1)
        overlapped(1, 0)
    for _ in range(p - r - 1):  # nB1F1B0
        backward(1)
        overlapped(1, 0)
    steps = r + 1  # nB1B0: the second half of these backwards defers its W
    split = False
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            split = True
        backward(1, split=split)
        if i == steps // 2 and r % 2 == 0:
            split = True
        backward(0, split=split)
    for _ in range(p - r - 1):  # nWB0
        weight()
        backward(0, split=True)
    while deferred:  # nW
        weight()
    return order, pairs


def _tasks(p: int, m: int) -> int:
    return 6 * p * max(m, 2 * p)  # built for at least 2p microbatches, then cut down to m


def dualpipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV: V placement, overlapped forward/backward pairs in the steady state.

    Peak memory is about 1F1B's; the pairs are in `overlap_pairs` for a runtime to overlap.
    """
    p, m = num_ranks, num_microbatches
    n = max(m, 2 * p)
    orders, pairs = [], []
    for r in range(p):
        order, rank_pairs = _rank_order(p, n, r)
        orders.append(order)
        pairs += [(a, b) for a, b in rank_pairs if a.microbatch < m and b.microbatch < m]
    return from_orders("dualpipe-v", v_placement(p), m, keep_microbatches(orders, m), overlap_pairs=pairs)


#: The schedules of this module, for the registry: name -> (generator, task count; see
#: `zbpp.schedules.registry.register`)
GENERATORS = {"dualpipe-v": (dualpipe_v, _tasks, v_stages)}
