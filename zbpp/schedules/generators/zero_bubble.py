"""Handcrafted zero-bubble schedules ZB-H1 and ZB-H2 (Qi et al., ICLR 2024), one stage per rank.

Both are 1F1B with the backward split into B and W:

- ZB-H1 keeps 1F1B's p-1-r warm-up forwards (so 1F1B's peak memory) and runs W(j) on rank r
  right after B(j + r): the W's that 1F1B's last rank needs no delay for fill the bubbles of the
  earlier ranks. Bubble (p-1)(F+B-W).
- ZB-H2 warms up with 2(p-1-r) forwards (2(p-1-r)+1 before the first B), filling the warm-up bubble
  too, and delays W by 2r. Bubble (p-1)(F+B+2C-2W) with communication C, zero for F=B=W, C=0.

In both, the W delay of rank r is rank 0's warm-up minus rank r's: every rank then holds the same
number of microbatches' worth of memory-producing work in flight as rank 0.
"""

from __future__ import annotations

from ..ir import Action, Kind, Schedule, from_orders, loop_placement


def _tasks(p: int, m: int) -> int:
    return 3 * p * m  # F, B and W of one stage per rank


def _split_1f1b(name: str, p: int, m: int, warmup_of) -> Schedule:
    orders = []
    for r in range(p):
        warmup = min(warmup_of(r), m)
        lag = warmup_of(0) - warmup_of(r)
        order: list[Action] = [Action(Kind.F, r, j) for j in range(warmup)]  # warm-up
        w_next = 0

        def backward(j: int) -> None:
            nonlocal w_next
            order.append(Action(Kind.B, r, j))
            if j - w_next >= lag:  # W(j - lag) right after B(j)
                order.append(Action(Kind.W, r, w_next))
                w_next += 1

        for j in range(warmup, m):  # steady: F, B, W
            order.append(Action(Kind.F, r, j))
            backward(j - warmup)
        for j in range(m - warmup, m):  # cool-down: B, W
            backward(j)
        order += [Action(Kind.W, r, j) for j in range(w_next, m)]  # the W's still pending
        orders.append(order)
    return from_orders(name, loop_placement(p), m, orders)


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's memory, bubble (p-1)(F+B-W)."""
    p = num_ranks
    return _split_1f1b("zb-h1", p, num_microbatches, lambda r: p - 1 - r)


def zb_h2(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H2: about twice 1F1B's memory, bubble (p-1)(F+B-2W), zero for F=B=W."""
    p = num_ranks
    return _split_1f1b("zb-h2", p, num_microbatches, lambda r: 2 * (p - 1 - r))


#: The schedules of this module, for the registry: name -> (generator, task count; see
#: `zbpp.schedules.registry.register`)
GENERATORS = {"zb-h1": (zb_h1, _tasks), "zb-h2": (zb_h2, _tasks)}
