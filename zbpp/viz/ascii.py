"""ASCII timelines: one row per rank, time on the x axis, wrapped to the terminal width.

Each task is drawn over the cells its simulated time covers, labelled with its kind and microbatch
(``F3``, ``B3``, ``W3``; ``BW`` as ``X3``). The stages of a rank are told apart by case: the rank's
first stage in upper case, its second in lower case (``f3``), a third again upper case with a
``'`` mark. Idle time is ``.``.

>>> from zbpp.schedules import build, simulate
>>> print(render_ascii(simulate(build("1f1b", num_ranks=2, num_microbatches=2)), width=80))
time 0..9 (1 char = 0.5)
rank 0 |F0F1....X0--..X1--|
rank 1 |..F0X0--F1X1--....|
"""

from __future__ import annotations

from ..schedules.ir import Kind
from ..schedules.simulate import SimResult

__all__ = ["render_ascii", "legend"]

_LETTER = {Kind.F: "F", Kind.B: "B", Kind.W: "W", Kind.BW: "X"}


def _label(kind: Kind, chunk: int, mb: int) -> str:
    letter = _LETTER[kind]
    if chunk % 2 == 1:
        letter = letter.lower()
    mark = "'" * (chunk // 2)
    return f"{letter}{mark}{mb}"


def legend() -> str:
    return (
        "F forward  B input-grad (dgrad)  W weight-grad (wgrad)  X full backward (B+W)  . idle\n"
        "lower case: the rank's second stage (V / interleaved); ' marks a third or later stage"
    )


def render_ascii(result: SimResult, *, width: int = 120, scale: float | None = None) -> str:
    """Draw `result` as text, wrapped into blocks at most `width` characters wide.

    `scale` is characters per time unit; by default the shortest task gets room for its label
    (at least 2 characters), so labels stay readable at any size and long runs wrap instead.
    """
    sched = result.schedule
    if not result.start:
        return "(empty schedule)"
    t0 = min(result.start.values())
    t1 = max(result.end.values())
    # each stage's position among its rank's stages: its label's case and ' marks
    chunk_of = {s: i for r in range(sched.num_ranks) for i, s in enumerate(sched.stages_on(r))}
    if scale is None:
        durations = [e - result.start[a] for a, e in result.end.items() if e > result.start[a]]
        shortest = min(durations) if durations else 1.0
        # measured with the ' marks: a third stage's F'0 needs 3 characters where F0 needs 2
        longest_label = max(len(_label(a.kind, chunk_of[a.stage], a.microbatch)) for a in result.start)
        scale = max(longest_label, 2) / shortest
    total_cells = max(1, round((t1 - t0) * scale))
    rows: list[list[str]] = []
    for rank in range(sched.num_ranks):
        row = ["."] * total_cells
        for a in sched.orders[rank]:
            c0 = round((result.start[a] - t0) * scale)
            c1 = max(c0 + 1, round((result.end[a] - t0) * scale))
            text = _label(a.kind, chunk_of[a.stage], a.microbatch)
            if len(text) > c1 - c0:  # too narrow: the kind letter alone
                text = text[0]
            cell = (text + "-" * (c1 - c0))[: c1 - c0]
            row[c0:c1] = list(cell)
        rows.append(row)
    name_w = len(f"rank {sched.num_ranks - 1}")
    block = max(10, width - name_w - 3)
    # Break blocks on multiples of the shortest task's width: with uniform costs tasks start on
    # that grid, so no label is cut in two across blocks.
    grid = max(1, round(shortest_cells(result, scale)))
    if block >= 2 * grid:
        block -= block % grid
    out = []
    unit = 1 / scale
    for b0 in range(0, total_cells, block):
        b1 = min(b0 + block, total_cells)
        if b0:
            out.append("")  # a blank line between blocks keeps tall (p = 32) blocks apart
        out.append(f"time {t0 + b0 * unit:.6g}..{t0 + b1 * unit:.6g} (1 char = {unit:.4g})")
        for rank, row in enumerate(rows):
            out.append(f"{f'rank {rank}':<{name_w}} |{''.join(row[b0:b1])}|")
    return "\n".join(out)


def shortest_cells(result: SimResult, scale: float) -> float:
    """Width in characters of the shortest task (at least 1)."""
    durations = [e - result.start[a] for a, e in result.end.items() if e > result.start[a]]
    return max(1.0, min(durations) * scale) if durations else 1.0
