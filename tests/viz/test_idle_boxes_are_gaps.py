"""The figure's idle boxes are the gaps in the union of a rank's task intervals: none inside a busy
span, even where overlapped tasks (DualPipe-V's F&B pairs, or measured records) nest."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("matplotlib", reason="figures need matplotlib (pip install zbpp[viz])")

from zbpp import viz  # noqa: E402
from zbpp.schedules import Costs, build, simulate  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"


def _idle_boxes(path) -> int:
    root = ET.parse(path).getroot()
    return sum(1 for g in root.iter(f"{SVG}g") if g.get("id") == "idle"
               for e in g.iter() if e.tag in (f"{SVG}path", f"{SVG}use"))


def _gaps(intervals: list[tuple[float, float]], t0: float, t1: float) -> int:
    """Gaps of [t0, t1] not covered by `intervals` (worked out here, independently of zbpp.viz)."""
    n, cur = 0, t0
    for s, e in sorted(intervals):
        n += s > cur + 1e-12
        cur = max(cur, e)
    return n + (t1 > cur + 1e-12)


def test_a_nested_task_leaves_no_idle_box_inside_a_busy_span(tmp_path):
    # one rank: F0.0 [0, 4] holds B0.0 [1, 2] inside it; W0.0 [3, 5] starts before F ends: busy
    # from 0 to 5 without a gap, so no idle box at all
    recs = [{"rank": 0, "action": "F0.0", "start": 0.0, "end": 4.0},
            {"rank": 0, "action": "B0.0", "start": 1.0, "end": 2.0},
            {"rank": 0, "action": "W0.0", "start": 3.0, "end": 5.0}]
    path = tmp_path / "n.svg"
    viz.plot(recs, path=path, time_unit="s")
    assert _idle_boxes(path) == 0


def test_dualpipe_v_idle_boxes_are_the_gaps(tmp_path):
    sched = build("dualpipe-v", num_ranks=4, num_microbatches=10)
    costs = Costs(f=1, b=2, w=1)
    res = simulate(sched, costs)
    path = tmp_path / "d.svg"
    viz.plot(res, path=path)
    t0 = min(res.start.values())
    t1 = max(res.end.values())
    want = sum(_gaps([(res.start[a], res.end[a]) for a in sched.orders[r]], t0, t1) for r in range(4))
    assert _idle_boxes(path) == want
