"""Interleaved zero bubble: ZB-H1's W placement on Megatron's interleaved order, any stages per rank.

Rank r holds stages r, r+p, ..., r+(chunks-1)p. Forwards and input backwards (B) follow the
interleaved 1F1B order (a round of microbatches through one chunk, then the next chunk; backwards
through the chunks in reverse), with ZB-H1's warm-up: ``(chunks-1)*g + (p-1-r)`` forwards on rank r
(g: microbatches per round), one forward fewer per hop than interleaved 1F1B, since the W's fill
what the extra forwards would. Each W runs r backwards after its B on rank r (as in ZB-H1: every
rank then holds as many microbatches' wgrad memory as rank 0), so the W's of the later ranks fill
the bubbles that the first ranks' backwards leave. With ``chunks=1`` this is ZB-H1.

torch's `ScheduleInterleavedZeroBubble` (its ZB1P) follows the same rules where it applies (m a
multiple of its rounds); this one takes any m (rounds of at least p microbatches, as even as possible).

>>> from zbpp.schedules import build, simulate, Costs
>>> s = build("zb-interleaved", num_ranks=4, num_microbatches=8, chunks=2)
>>> s.num_stages, s.stages_on(1)
(8, [1, 5])
>>> simulate(s, Costs(1, 1, 1)).bubble_rate < simulate(build("interleaved-1f1b", num_ranks=4, num_microbatches=8), Costs(1, 1, 1)).bubble_rate
True
"""

from __future__ import annotations

from ..checks import as_int
from ..ir import Action, Kind, Schedule, from_orders, loop_placement
from .classic import _interleaved_items, _round_sizes


def _tasks(p: int, m: int, *, chunks: int = 2) -> int:
    return 3 * p * as_int(chunks, "zb-interleaved: chunks") * m  # F, B and W of every stage


def _stages(p: int, *, chunks: int = 2) -> int:
    return p * as_int(chunks, "zb-interleaved: chunks")


def zb_interleaved(num_ranks: int, num_microbatches: int, *, chunks: int = 2) -> Schedule:
    """Interleaved zero bubble (the module docstring): `chunks` stages per rank, backward split."""
    chunks = as_int(chunks, "zb-interleaved: chunks")
    p, m = num_ranks, num_microbatches
    fwd = _interleaved_items(p, m, chunks, backward=False)
    bwd = _interleaved_items(p, m, chunks, backward=True)
    total = len(fwd)
    orders = []
    for r in range(p):
        warmup = min((chunks - 1) * _round_sizes(p, m)[0] + p - 1 - r, total)
        order = [Action(Kind.F, c * p + r, j) for c, j in fwd[:warmup]]  # warm-up
        done_w = 0

        def backward(k: int) -> None:
            nonlocal done_w
            c, j = bwd[k]
            order.append(Action(Kind.B, c * p + r, j))
            if k - done_w >= r:  # the W of the backward r places back
                c, j = bwd[done_w]
                order.append(Action(Kind.W, c * p + r, j))
                done_w += 1

        for k in range(total - warmup):  # steady: F, B, W
            c, j = fwd[warmup + k]
            order.append(Action(Kind.F, c * p + r, j))
            backward(k)
        for k in range(total - warmup, total):  # cool-down: B, W
            backward(k)
        order += [Action(Kind.W, c * p + r, j) for c, j in bwd[done_w:]]  # the W's still pending
        orders.append(order)
    return from_orders("zb-interleaved", loop_placement(p, chunks), m, orders)


#: The schedules of this module, for the registry: name -> (generator, task count; see
#: `zbpp.schedules.registry.register`)
GENERATORS = {"zb-interleaved": (zb_interleaved, _tasks, _stages)}
