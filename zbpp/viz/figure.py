"""Figures of schedules in the style of the zero-bubble papers (SVG or PNG, with matplotlib).

One row per rank, time on the x axis; F, B, W and BW tasks in distinct colours, a rank's second
stage (V-shape / interleaved chunk) in a darker shade of the same colour (each further one in a
shade of its own), the microbatch id inside each box that is wide enough, idle time (the bubbles)
in grey, and a title with the bubble rate and the peak memory. In the SVG each task is one shape
inside a group ``tasks-{kind}-chunk{c}``. A task of (next to) no time, such as W under
``Costs(w=0)``, is drawn a few points wide around its instant.

matplotlib is imported only when drawing (``pip install zbpp[viz]``).

>>> import os, tempfile
>>> from zbpp.schedules import build, Costs
>>> path = os.path.join(tempfile.mkdtemp(), "zbh1.svg")
>>> fig = plot(build("zb-h1", num_ranks=4, num_microbatches=8), Costs(1, 1, 1), path)
>>> os.path.getsize(path) > 0
True
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping, Union

from ..schedules.ir import Kind, Schedule
from ..schedules.simulate import Costs, Memory, SimResult, simulate

__all__ = ["plot", "KIND_COLORS"]

#: Base colour of each kind (chunk 0). Blue forward, green dgrad, purple wgrad, orange full backward.
KIND_COLORS = {Kind.F: "#7FB2E5", Kind.B: "#7CCB9C", Kind.W: "#C3A3E6", Kind.BW: "#F3AE6B"}
_KIND_NAMES = {Kind.F: "F forward", Kind.B: "B input grad", Kind.W: "W weight grad", Kind.BW: "BW full backward"}
_IDLE = "#E6E6E6"
_POINT_PT = 3.0  # drawn width, in points, of a task of (next to) no time

Source = Union[SimResult, Schedule, Iterable[Mapping[str, Any]]]


def _require_matplotlib() -> Any:
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("zbpp.viz.plot needs matplotlib: pip install zbpp[viz]") from None
    return Figure


def _shade(color: str, chunk: int) -> tuple[float, float, float]:
    """Chunk 0: the base colour; odd chunks darker, further even chunks lighter, each chunk its own
    shade: a geometric step towards black or white, so no two chunks meet and none leaves 0..1."""
    r, g, b = (int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    if chunk == 0:
        return r, g, b
    if chunk % 2 == 1:  # 1, 3, 5, ...: 0.62, 0.50, 0.40, ... of the base
        k = 0.62 * 0.8 ** (chunk // 2)
        return r * k, g * k, b * k
    k = 1 - 0.55 * 0.75 ** (chunk // 2 - 1)  # 2, 4, 6, ...: 45%, 59%, 69%, ... of the way to white
    return r + (1 - r) * k, g + (1 - g) * k, b + (1 - b) * k


def _as_result(source: Source, costs: Costs | None, memory: Memory | None) -> tuple[SimResult, bool]:
    """(result, measured?) for any accepted source. `costs` and `memory` are refused where they
    would change nothing drawn: a result holds its times and memory, records their times."""
    if isinstance(source, SimResult):
        given = [n for n, v in (("costs", costs), ("memory", memory)) if v is not None]
        if given:
            raise ValueError(f"plot: {' and '.join(given)} given with a SimResult, which already holds its times "
                             "and memory; pass its Schedule to simulate with them, or simulate it yourself")
        return source, False
    if isinstance(source, Schedule):
        return simulate(source, costs, memory), False
    if costs is not None:
        raise ValueError("plot: costs given with measured records, whose times are measured; costs apply to a "
                         "Schedule (memory= applies to records too)")
    from .trace import measured_result

    return measured_result(list(source), memory=memory), True


def _idle_intervals(res: SimResult, rank: int, t0: float, t1: float) -> list[tuple[float, float]]:
    spans = sorted((res.start[a], res.end[a]) for a in res.schedule.orders[rank])
    out, cur = [], t0
    for s, e in spans:
        if s > cur:
            out.append((cur, s - cur))
        cur = max(cur, e)
    if t1 > cur:
        out.append((cur, t1 - cur))
    return out


def plot(
    source: Source,
    costs: Costs | None = None,
    path: str | os.PathLike[str] | None = None,
    *,
    memory: Memory | None = None,
    title: str | None = None,
    time_unit: str | None = None,
    labels: bool = True,
    dpi: int = 150,
) -> Any:
    """Draw a schedule and save it to `path` (``.svg`` or ``.png``); returns the matplotlib Figure.

    `source` is a `SimResult` (drawn as it is: `costs` and `memory` are refused), a `Schedule`
    (simulated with `costs` and `memory`), or measured records (``{"rank", "action", "start",
    "end"}`` dicts, see `zbpp.viz.trace`; their memory counted with `memory`, `costs` refused).
    `time_unit` names the time axis; ``"s"`` (the default for records) draws seconds as milliseconds.
    `labels` puts microbatch ids in the boxes wide enough to hold them.
    """
    Figure = _require_matplotlib()
    import matplotlib
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    res, measured = _as_result(source, costs, memory)
    if measured and time_unit is None:
        time_unit = "s"
    sched = res.schedule
    p = sched.num_ranks
    if not res.start:
        raise ValueError("nothing to plot: the schedule has no tasks")
    scale, axis_unit = (1e3, "ms") if time_unit == "s" else (1.0, time_unit or "")
    t0 = min(res.start.values())
    t1 = max(res.end.values())
    chunk_of = {s: i for r in range(p) for i, s in enumerate(sched.stages_on(r))}

    per_rank = max(len(o) for o in sched.orders)
    width_in = min(28.0, max(9.0, 2.5 + 0.22 * per_rank))
    row_in = 0.42 if p <= 8 else (0.3 if p <= 32 else 0.18)
    top_in, bottom_in, left_in, right_in = 0.45, 0.85, 0.8, 0.25  # title; x label + legend; rank names
    height_in = top_in + bottom_in + row_in * p
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    ax = fig.add_axes((left_in / width_in, bottom_in / height_in,
                       1 - (left_in + right_in) / width_in, 1 - (top_in + bottom_in) / height_in))
    x = lambda t: (t - t0) * scale  # noqa: E731

    # bubbles first, so tasks are drawn over them
    idle = []
    for r in range(p):
        idle += [[(x(s), r + 0.12), (x(s + d), r + 0.12), (x(s + d), r + 0.88), (x(s), r + 0.88)]
                 for s, d in _idle_intervals(res, r, t0, t1)]
    ax.add_collection(PolyCollection(idle, facecolors=_IDLE, edgecolors="none", gid="idle"))

    span = x(t1)
    ax_w_pt = width_in * 72 * ax.get_position().width
    pt_per_t = ax_w_pt / (span if span > 0 else 1.0)  # every task of no time: a nominal axis of 1
    # A task of (next to) no time, such as W under Costs(w=0), would be a box of no width: drawn
    # _POINT_PT points wide around its instant instead, so that every task shows in its colour.
    # "Next to no time" is the ASCII view's rule: under 1% of the median task's length.
    lengths = sorted(e - res.start[a] for a, e in res.end.items() if e > res.start[a])
    point_len = lengths[len(lengths) // 2] / 100 if lengths else math.inf
    half = _POINT_PT / pt_per_t / 2
    pad = 0.0  # room at the ends of the axis for point tasks there
    groups: dict[tuple[Kind, int], list] = {}
    for r, order in enumerate(sched.orders):
        for a in order:
            s, e = x(res.start[a]), x(res.end[a])
            if res.end[a] - res.start[a] < point_len and e - s < 2 * half:
                s, e = (s + e) / 2 - half, (s + e) / 2 + half
                pad = half
            box = [(s, r + 0.08), (e, r + 0.08), (e, r + 0.92), (s, r + 0.92)]
            groups.setdefault((a.kind, chunk_of[a.stage]), []).append(box)
    n_tasks = sched.num_tasks
    lw = 0.6 if n_tasks < 400 else (0.3 if n_tasks < 4000 else 0.0)
    for (kind, chunk), verts in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0].value)):
        ax.add_collection(
            PolyCollection(verts, facecolors=[_shade(KIND_COLORS[kind], chunk)], edgecolors="#30303080",
                           linewidths=lw, gid=f"tasks-{kind.value}-chunk{chunk}")
        )

    ax.set_xlim(-pad, span + pad if span > 0 else 1.0)  # never a zero-width axis (a matplotlib warning)
    ax.set_ylim(p, 0)
    ax.set_yticks([r + 0.5 for r in range(p)])
    ax.set_yticklabels([f"rank {r}" for r in range(p)], fontsize=9 if p <= 16 else 6)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel(f"time ({axis_unit})" if axis_unit else "time", fontsize=9, labelpad=2)

    if labels:
        # label a box when its microbatch id fits: box width in points vs. text width
        row_pt = height_in * 72 * ax.get_position().height / p
        fs = max(4.0, min(9.0, row_pt * 0.5))
        for r, order in enumerate(sched.orders):
            for a in order:
                text = str(a.microbatch)
                w_pt = (res.end[a] - res.start[a]) * scale * pt_per_t
                if w_pt >= 0.62 * fs * len(text) + 2:
                    dark = chunk_of[a.stage] % 2 == 1
                    ax.text(x((res.start[a] + res.end[a]) / 2), r + 0.5, text, ha="center", va="center",
                            fontsize=fs, color="white" if dark else "#1a1a1a", gid=f"label-{a}")

    peaks = res.peak_memory
    peak_text = f"peak memory {max(peaks):.4g}"
    if p <= 8:
        peak_text += " (" + ", ".join(f"{v:.3g}" for v in peaks) + ")"
    kind_word = "measured" if measured else (sched.name or "schedule")
    head = title or f"{kind_word}: p={p}, m={sched.num_microbatches}, stages={sched.num_stages}"
    ax.set_title(f"{head}    bubble rate {res.bubble_rate:.1%}    {peak_text}", fontsize=11, loc="left")

    present = sorted({k for k, _ in groups}, key=lambda k: list(Kind).index(k))
    handles = [Patch(facecolor=KIND_COLORS[k], edgecolor="#303030", label=_KIND_NAMES[k]) for k in present]
    if max(chunk_of.values()) > 0:
        handles.append(Patch(facecolor=_shade(KIND_COLORS[present[0]], 1), edgecolor="#303030", label="darker: rank's 2nd stage"))
    handles.append(Patch(facecolor=_IDLE, edgecolor="none", label="idle (bubble)"))
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=len(handles), fontsize=8, frameon=False)

    if path is not None:
        ext = os.path.splitext(os.fspath(path))[1].lower()
        if ext not in (".svg", ".png"):
            raise ValueError(f"plot: cannot write {os.fspath(path)!r}: use a .svg or .png file name")
        with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "zbpp"}):
            fig.savefig(path, dpi=dpi)
    return fig
