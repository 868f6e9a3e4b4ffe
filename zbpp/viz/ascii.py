"""ASCII timelines: one row per rank, time on the x axis, wrapped to the terminal width.

Each task is drawn over the cells its simulated time covers, labelled with its kind and microbatch
(``F3``, ``B3``, ``W3``; ``BW`` as ``X3``). The stages of a rank are told apart by case: the rank's
first stage in upper case, its second in lower case (``f3``), a third again upper case with a
``'`` mark. Idle time is ``.``.

A task too short to cover one character (one of zero length, such as W under ``Costs(w=0)``, or a
measured record of ~0 s) still runs, so it is drawn too: at its instant, in characters added to the
time axis for it. Those characters stand for no time; other ranks show them blank (or as the ``-``
of a task running across that instant), and the block's header says how many were added.

Long timelines wrap into blocks. A block ends where no label crosses its edge, if there is
such a column in its last half; where there is none (ranks offset by a message time), a label
the edge would cut is omitted (its task drawn as ``-``): a label shows whole or not at all.

Tasks of one rank that run at once (measured records of DualPipe's overlapped pairs) are drawn on
rows of their own under the rank's, marked ``+`` (as a trace puts them on ``compute 2``): each row
holds tasks that do not overlap, each task is drawn whole, and ``.`` marks only time in which the
rank runs nothing.

>>> from zbpp.schedules import build, simulate
>>> print(render_ascii(simulate(build("1f1b", num_ranks=2, num_microbatches=2)), width=80))
time 0..9 (1 char = 0.5)
rank 0 |F0F1....X0--..X1--|
rank 1 |..F0X0--F1X1--....|
"""

from __future__ import annotations

import bisect
import math
import textwrap

from ..schedules.checks import as_int, as_positive
from ..schedules.ir import Kind
from ..schedules.simulate import SimResult
from ._lanes import lanes

__all__ = ["render_ascii", "legend"]

_LETTER = {Kind.F: "F", Kind.B: "B", Kind.W: "W", Kind.BW: "X"}
_MAX_CELLS = 100_000  # the longest time axis the default scale draws, in characters


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
    (at least 2 characters), so labels stay readable at any size and long runs wrap instead. Tasks
    under 1% of the median task's length (a measured record of microseconds beside milliseconds)
    do not set the scale: they are drawn as zero-length ones are. The default never makes the time
    axis longer than 100,000 characters; tasks it leaves under a character are drawn so too.
    """
    if not isinstance(result, SimResult):  # a Schedule has no times: it would fail as an AttributeError
        raise TypeError(f"render_ascii needs a SimResult (simulate(schedule, costs)), got {type(result).__name__}")
    width = as_int(width, "render_ascii width")
    if scale is not None:  # 0 would divide by zero, a negative one index rows backwards
        scale = as_positive(scale, "render_ascii scale")
    sched = result.schedule
    if not result.start:
        return "(empty schedule)"
    t0 = min(result.start.values())
    t1 = max(result.end.values())
    # each stage's position among its rank's stages: its label's case and ' marks
    chunk_of = {s: i for r in range(sched.num_ranks) for i, s in enumerate(sched.stages_on(r))}
    if scale is None:
        durations = sorted(e - result.start[a] for a, e in result.end.items() if e > result.start[a])
        # one near-zero task would otherwise widen the whole picture by orders of magnitude
        floor = durations[len(durations) // 2] / 100 if durations else 0.0
        shortest = min((d for d in durations if d >= floor), default=1.0)
        # measured with the ' marks: a third stage's F'0 needs 3 characters where F0 needs 2
        longest_label = max(len(_label(a.kind, chunk_of[a.stage], a.microbatch)) for a in result.start)
        scale = max(longest_label, 2) / shortest
        if t1 > t0:  # tasks of very different lengths (F 1e-6 beside W 1) would need millions of
            # characters a row: at most _MAX_CELLS, the shortest tasks then drawn as points are
            scale = min(scale, _MAX_CELLS / (t1 - t0))

    def base(t: float) -> int:  # the character at time t on the time axis, before any insertion
        # halves round up, always: round()'s half-to-even would give a task starting at x.5 a
        # character more or less than its length (a 3-wide label such as F10 cut to F-); the
        # 1e-9 keeps a float just under a half (7.4999999) with the halves
        return math.floor((t - t0) * scale + 0.5 + 1e-9)

    # Tasks that round to no character are drawn at their start instant in columns inserted there
    # (as wide as the widest such group on one rank), so the picture never drops a task it runs.
    # Each rank's tasks on rows ("lanes") where none overlaps another; one row unless tasks ran at once.
    rows_of: list[tuple[int, list]] = []  # (rank, the row's tasks in the rank's order)
    for rank in range(sched.num_ranks):
        order = sched.orders[rank]
        lane_of = lanes([(result.start[a], result.end[a]) for a in order])
        for lane in range(max(lane_of, default=0) + 1):
            rows_of.append((rank, [a for a, k in zip(order, lane_of) if k == lane]))
    points: dict[int, dict[float, list]] = {}  # row -> instant -> its point tasks, in order
    for i, (_, tasks) in enumerate(rows_of):
        for a in tasks:
            if base(result.end[a]) <= base(result.start[a]):
                points.setdefault(i, {}).setdefault(result.start[a], []).append(a)
    width_at: dict[float, int] = {}  # instant -> columns inserted there
    for groups in points.values():
        for t, tasks in groups.items():
            need = sum(len(_label(a.kind, chunk_of[a.stage], a.microbatch)) for a in tasks)
            width_at[t] = max(width_at.get(t, 0), need)
    instants = sorted(width_at)
    # base() is monotone in t, so instants sorted by time are also sorted by column
    before: dict[float, int] = {}
    acc = 0
    for t in instants:
        before[t] = acc
        acc += width_at[t]

    def added(t: float, *, inclusive: bool) -> int:  # columns inserted at instants < t (or <= t)
        i = bisect.bisect_right(instants, t) if inclusive else bisect.bisect_left(instants, t)
        return before[instants[i]] if i < len(instants) else acc

    base_cells = base(t1)
    total_cells = base_cells + acc if acc else max(1, base_cells)
    edge_time: list[float] = []  # time at the left edge of each column (and the right end)
    inserted: list[bool] = []  # whether a column was added for point tasks (stands for no time)
    i = 0
    for c in range(base_cells + 1):
        while i < len(instants) and base(instants[i]) <= c:  # inserted before base column c
            edge_time += [instants[i]] * width_at[instants[i]]
            inserted += [True] * width_at[instants[i]]
            i += 1
        edge_time.append(t0 + c / scale)
        inserted.append(False)
    edge_time[-1] = t1
    edge_time += [t1] * (total_cells + 1 - len(edge_time))  # the 1 cell of an all-zero, uninserted view
    inserted = (inserted + [False])[:total_cells]  # the last entry was the right end, not a column
    drawn: list[list[str | None]] = []  # per row: each column's character, None where no task of the row
    labels: list[tuple[int, int, int, str]] = []  # (row, first column, end column, drawn over) of each label
    for i, (rank, tasks) in enumerate(rows_of):
        row: list[str | None] = [None] * total_cells
        for a in tasks:
            if base(result.end[a]) <= base(result.start[a]):
                continue  # drawn below, in the columns inserted at its instant
            c0 = base(result.start[a]) + added(result.start[a], inclusive=True)
            c1 = base(result.end[a]) + added(result.end[a], inclusive=False)
            text = _label(a.kind, chunk_of[a.stage], a.microbatch)
            if len(text) > c1 - c0:  # too narrow: the kind letter alone
                text = text[0]
            cell = (text + "-" * (c1 - c0))[: c1 - c0]
            row[c0:c1] = list(cell)
            labels.append((i, c0, c0 + min(len(text), c1 - c0), "-"))
        for t, at_t in points.get(i, {}).items():
            c = base(t) + added(t, inclusive=False)
            for a in at_t:
                text = _label(a.kind, chunk_of[a.stage], a.microbatch)
                row[c:c + len(text)] = list(text)
                labels.append((i, c, c + len(text), " "))
                c += len(text)
        drawn.append(row)
    # idle ("."): a column none of the rank's rows covers, and not one added for point tasks
    busy: dict[int, list[bool]] = {}
    for (rank, _), row in zip(rows_of, drawn):
        cover = busy.setdefault(rank, [False] * total_cells)
        busy[rank] = [b or ch is not None for b, ch in zip(cover, row)]
    rows: list[list[str]] = []
    for (rank, _), row in zip(rows_of, drawn):
        rows.append([ch if ch is not None else (" " if ins or busy[rank][c] else ".")
                     for c, (ch, ins) in enumerate(zip(row, inserted))])
    name_w = len(f"rank {sched.num_ranks - 1}")
    names = [f"{f'rank {rank}':<{name_w}}" if i == 0 or rows_of[i - 1][0] != rank else f"{'+':>{name_w}}"
             for i, (rank, _) in enumerate(rows_of)]  # a rank's further rows: "+" under its name
    block = max(10, width - name_w - 3)
    # Break blocks on multiples of the shortest task's width: with uniform costs tasks start on
    # that grid, so no label is cut in two across blocks.
    grid = max(1, round(shortest_cells(result, scale)))
    if block >= 2 * grid:
        block -= block % grid
    breaks = _breaks(total_cells, block, labels, rows)
    out = []
    unit = 1 / scale
    for b0, b1 in zip(breaks, breaks[1:]):
        if b0:
            out.append("")  # a blank line between blocks keeps tall (p = 32) blocks apart
        extra = sum(inserted[b0:b1])
        note = f"; {extra} chars added for tasks shorter than 1 char, e.g. of zero length" if extra else ""
        # wrapped as the rows are: the note made it longer than an 80-column terminal
        out += textwrap.wrap(f"time {edge_time[b0]:.6g}..{edge_time[b1]:.6g} (1 char = {unit:.4g}{note})",
                             width=name_w + 3 + block, subsequent_indent="  ")
        for name, row in zip(names, rows):
            out.append(f"{name} |{''.join(row[b0:b1])}|")
    return "\n".join(out)


def _breaks(total: int, block: int, labels: list[tuple[int, int, int, str]], rows: list[list[str]]) -> list[int]:
    """Where the blocks of `total` columns begin (and the end), at most `block` wide each.

    Tasks off the grid of the shortest one (a message time shifts them) may have a label across
    a block's edge: the edge then moves left, by up to half a block, to where the fewest labels
    (none, if it can) cross it. A label it still cuts (rows offset by a message time can leave no
    column free) is omitted, drawn as its task's ``-`` (a point task's blank): every label shows
    whole or not at all."""
    cut = [0] * (total + 1)  # cut[c]: how many labels hold both column c - 1 and column c
    for _, c0, c1, _ in labels:
        for c in range(c0 + 1, c1):
            cut[c] += 1
    out = [0]
    while out[-1] < total:
        b0 = out[-1]
        b1 = min(b0 + block, total)
        # the rightmost of the edges that cut the fewest labels (min keeps the first of equals)
        edge = b1 if b1 == total else min(range(b1, b0 + max(1, block // 2) - 1, -1), key=lambda c: cut[c])
        if cut[edge]:
            for i, c0, c1, fill in labels:
                if c0 < edge < c1:
                    rows[i][c0:c1] = [fill] * (c1 - c0)
        out.append(edge)
    return out


def shortest_cells(result: SimResult, scale: float) -> float:
    """Width in characters of the shortest task (at least 1)."""
    durations = [e - result.start[a] for a, e in result.end.items() if e > result.start[a]]
    return max(1.0, min(durations) * scale) if durations else 1.0
