"""Classic schedules: GPipe, 1F1B and Megatron's interleaved 1F1B. Backward is never split (BW)."""

from __future__ import annotations

from ..checks import as_int
from ..ir import Action, Kind, Schedule, from_orders, loop_placement


def _tasks(p: int, m: int) -> int:
    return 2 * p * m  # F and BW of one stage per rank


def _interleaved_tasks(p: int, m: int, *, chunks: int = 2) -> int:
    return 2 * p * as_int(chunks, "interleaved-1f1b: chunks") * m


def _interleaved_stages(p: int, *, chunks: int = 2) -> int:
    return p * as_int(chunks, "interleaved-1f1b: chunks")  # rank r holds r, r+p, ...


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (Huang et al., 2019). Peak memory: m activations."""
    p, m = num_ranks, num_microbatches
    orders = []
    for r in range(p):
        orders.append([Action(Kind.F, r, j) for j in range(m)] + [Action(Kind.BW, r, j) for j in range(m)])
    return from_orders("gpipe", loop_placement(p), m, orders)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): p-1-r warm-up forwards, then one forward one backward."""
    p, m = num_ranks, num_microbatches
    orders = []
    for r in range(p):
        order: list[Action] = []
        warmup = min(p - 1 - r, m)
        # warm-up
        order += [Action(Kind.F, r, j) for j in range(warmup)]
        # steady: F(j), BW(j - warmup)
        for j in range(warmup, m):
            order += [Action(Kind.F, r, j), Action(Kind.BW, r, j - warmup)]
        # cool-down
        order += [Action(Kind.BW, r, j) for j in range(m - warmup, m)]
        orders.append(order)
    return from_orders("1f1b", loop_placement(p), m, orders)


def _round_sizes(p: int, m: int) -> list[int]:
    """Split m microbatches into rounds of at least p (as even as possible; one round if m < p).

    Megatron needs p | m; rounds of p or more keep its warm-up count right for any m.
    """
    rounds = max(1, m // p)
    base, extra = divmod(m, rounds)
    return [base + 1 if i < extra else base for i in range(rounds)]


def _interleaved_items(p: int, m: int, chunks: int, backward: bool) -> list[tuple[int, int]]:
    """(chunk, microbatch) in Megatron's order: a round of microbatches, chunk by chunk.

    Backward visits the chunks in reverse.
    """
    items: list[tuple[int, int]] = []
    start = 0
    for size in _round_sizes(p, m):
        group = range(start, start + size)
        for c in range(chunks):
            chunk = chunks - 1 - c if backward else c
            items += [(chunk, j) for j in group]
        start += size
    return items


def interleaved_1f1b(num_ranks: int, num_microbatches: int, *, chunks: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: rank r holds stages r, r+p, ..., r+(chunks-1)p.

    Warm-up (p-1-r)*2 + (chunks-1)*g forwards (g: microbatches per round, p when p | m), then one forward one backward, then cool-down.
    `chunks=1` is plain 1F1B.
    """
    chunks = as_int(chunks, "interleaved-1f1b: chunks")
    p, m = num_ranks, num_microbatches
    if chunks == 1:
        sched = one_f_one_b(p, m)
        return from_orders("interleaved-1f1b", sched.placement, m, sched.orders)
    fwd = _interleaved_items(p, m, chunks, backward=False)
    bwd = _interleaved_items(p, m, chunks, backward=True)
    total = len(fwd)
    orders = []
    for r in range(p):
        def F(i: int) -> Action:
            c, j = fwd[i]
            return Action(Kind.F, c * p + r, j)

        def BW(i: int) -> Action:
            c, j = bwd[i]
            return Action(Kind.BW, c * p + r, j)

        warmup = min((p - 1 - r) * 2 + (chunks - 1) * _round_sizes(p, m)[0], total)
        order = [F(i) for i in range(warmup)]  # warm-up
        for k, i in enumerate(range(warmup, total)):  # steady
            order += [F(i), BW(k)]
        order += [BW(k) for k in range(total - warmup, total)]  # cool-down
        orders.append(order)
    return from_orders("interleaved-1f1b", loop_placement(p, chunks), m, orders)


#: The schedules of this module, for the registry: name -> (generator, task count; see
#: `zbpp.schedules.registry.register`)
GENERATORS = {
    "gpipe": (gpipe, _tasks),
    "1f1b": (one_f_one_b, _tasks),
    "interleaved-1f1b": (interleaved_1f1b, _interleaved_tasks, _interleaved_stages),
}
