"""ASCII timelines (`zbpp show`): every task's label is drawn whole, whatever stage of its rank it is."""

from __future__ import annotations

import re

import pytest

from zbpp.schedules import Costs, build, simulate
from zbpp.schedules.measured import measured_result
from zbpp.viz.ascii import render_ascii


def test_third_stage_labels_get_room_by_hand() -> None:
    """One rank, three stages (zb-interleaved, chunks=3), one microbatch, unit costs. The third
    stage's labels carry a ' mark (F'0: 3 characters), so each unit task needs 3 characters,
    worked by hand from the module docstring's label rules: F0 f0 F'0 B'0 W'0 b0 w0 B0 W0."""
    res = simulate(build("zb-interleaved", num_ranks=1, num_microbatches=1, chunks=3))
    assert render_ascii(res, width=200) == (
        "time 0..9 (1 char = 0.3333)\n"
        "rank 0 |F0-f0-F'0B'0W'0b0-w0-B0-W0-|"
    )


@pytest.mark.parametrize("name, chunks", [("zb-interleaved", 3), ("interleaved-1f1b", 4)])
def test_every_task_label_whole(name: str, chunks: int) -> None:
    """Each rank's row holds one whole label (letter, stage marks, microbatch) per task of its order."""
    sched = build(name, num_ranks=2, num_microbatches=4, chunks=chunks)
    text = render_ascii(simulate(sched), width=10_000)
    for rank, order in enumerate(sched.orders):
        row = re.search(rf"^rank {rank} \|(.*)\|$", text, re.M).group(1)
        labels = re.findall(r"[FBWXfbwx]'*\d+", row)
        assert len(labels) == len(order), (rank, row)


def test_zero_length_tasks_drawn_by_hand() -> None:
    """zb-h1, one rank, two microbatches, Costs(f=1, b=1, w=0): the order is F0 B0 W0 F1 B1 W1 and
    both W take no time (W0 at t=2, W1 at t=4). Scale 2 chars per unit (labels are 2 wide), so the
    time axis has 8 characters; each W gets 2 characters inserted at its instant, 4 in all."""
    res = simulate(build("zb-h1", num_ranks=1, num_microbatches=2), Costs(f=1, b=1, w=0))
    assert render_ascii(res, width=200) == (
        "time 0..4 (1 char = 0.5; 4 chars added for tasks shorter than 1 char, e.g. of zero length)\n"
        "rank 0 |F0B0W0F1B1W1|"
    )


def test_zero_length_tasks_two_ranks_by_hand() -> None:
    """zb-h1, p=2, m=2, w=0, worked by hand. Rank 0: F0 [0,1) F1 [1,2) B0 [3,4) W0 @4 B1 [5,6) W1 @6;
    rank 1: F0 [1,2) B0 [2,3) F1 [3,4) B1 [4,5) W0 W1 @5. Inserted: 2 chars at t=4, 4 at t=5, 2 at
    t=6; a rank with no zero-length task at an instant shows those characters blank."""
    res = simulate(build("zb-h1", num_ranks=2, num_microbatches=2), Costs(f=1, b=1, w=0))
    assert render_ascii(res, width=200) == (
        "time 0..6 (1 char = 0.5; 8 chars added for tasks shorter than 1 char, e.g. of zero length)\n"
        "rank 0 |F0F1..B0W0..    B1W1|\n"
        "rank 1 |..F0B0F1  B1W0W1..  |"
    )


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-v", "zb-interleaved"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_every_task_drawn_when_some_take_no_time(name: str, scale: float | None) -> None:
    """W costs 0 (and at scale 0.3 every task is under a character wide): each rank's row still
    shows every task of the rank's order, in that order, the schedule itself being the reference."""
    opts = {"chunks": 2} if name == "zb-interleaved" else {}
    sched = build(name, num_ranks=2, num_microbatches=4, **opts)
    text = render_ascii(simulate(sched, Costs(f=1, b=1, w=0)), width=10_000, scale=scale)
    for rank, order in enumerate(sched.orders):
        row = re.search(rf"^rank {rank} \|(.*)\|$", text, re.M).group(1)
        letters = [x.upper() for x in re.findall(r"[FBWXfbwx]", row)]  # one per drawn task, in time order
        assert letters == ["X" if a.kind.name == "BW" else a.kind.name for a in order], (rank, row)


def test_a_near_zero_task_does_not_set_the_scale() -> None:
    """W of 1e-4 beside F and B of 1 (a measured record of microseconds beside milliseconds): the
    scale comes from F and B (2 chars per unit, as with W = 0), each W is drawn at its instant, and
    the row stays as wide as the w=0 case's instead of 1e4 times wider."""
    res = simulate(build("zb-h1", num_ranks=1, num_microbatches=2), Costs(f=1, b=1, w=1e-4))
    assert render_ascii(res, width=200) == (
        "time 0..4.0002 (1 char = 0.5; 4 chars added for tasks shorter than 1 char, e.g. of zero length)\n"
        "rank 0 |F0B0W0F1B1W1|"
    )


@pytest.mark.parametrize("scale", [0, -1, float("nan"), float("inf"), "2"])
def test_a_bad_scale_is_refused_naming_it(scale) -> None:
    """A scale (characters per time unit) must be a finite number > 0: 0 used to end in a
    ZeroDivisionError, -1 in an IndexError, nan and inf in conversion errors, none naming it."""
    res = simulate(build("1f1b", num_ranks=2, num_microbatches=2))
    with pytest.raises(ValueError, match=r"render_ascii scale must be a finite number > 0"):
        render_ascii(res, scale=scale)


@pytest.mark.parametrize("width", [0, -5, 2.5])
def test_a_bad_width_is_refused_naming_it(width) -> None:
    res = simulate(build("1f1b", num_ranks=2, num_microbatches=2))
    with pytest.raises(ValueError, match=r"render_ascii width must be an integer >= 1"):
        render_ascii(res, width=width)


def test_tasks_a_rank_ran_at_once_get_a_row_of_their_own_by_hand() -> None:
    """Measured, one rank: F0 [0,1), F1 [1,3), X0 [2,4) run beside F1 (an overlapped pair), X1
    [4,5). Worked by hand: the shortest task (1) gets 2 characters, so 10 in all; F0, F1 and X1 on
    the rank's row, X0 (it starts before F1 ends) on a "+" row under it. Where the rank runs X0 alone
    ([3,4)) its first row is blank, not idle; nothing is idle. X0 used to overwrite F1's tail on one
    row, and with less room a label shrank to its letter (F0FX0-)."""
    recs = [{"rank": 0, "action": a, "start": s, "end": e}
            for a, s, e in (("F0.0", 0, 1), ("F0.1", 1, 3), ("BW0.0", 2, 4), ("BW0.1", 4, 5))]
    assert render_ascii(measured_result(recs), width=200) == (
        "time 0..5 (1 char = 0.5)\n"
        "rank 0 |F0F1--  X1|\n"
        "     + |    X0--  |"
    )


def test_overlapped_rows_on_two_ranks_and_idle_by_hand() -> None:
    """Measured, worked by hand at 2 chars per unit (shortest task 1), 16 columns. Rank 0: F0 [0,2)
    with F1 [1,2) beside it (its "+" row), then idle until X0 [6,7), X1 [7,8). Rank 1: F0 [2,3)
    with F1 [2,4) beside it, X0 [4,5), X1 [5,6). '.' only where the rank runs nothing, in each of
    its rows; blank where another of its rows runs a task."""
    recs = [{"rank": r, "action": a, "start": s, "end": e} for r, a, s, e in (
        (0, "F0.0", 0, 2), (0, "F0.1", 1, 2), (1, "F1.0", 2, 3), (1, "F1.1", 2, 4),
        (1, "BW1.0", 4, 5), (1, "BW1.1", 5, 6), (0, "BW0.0", 6, 7), (0, "BW0.1", 7, 8))]
    assert render_ascii(measured_result(recs), width=200) == (
        "time 0..8 (1 char = 0.5)\n"
        "rank 0 |F0--........X0X1|\n"
        "     + |  F1........    |\n"
        "rank 1 |....F0  X0X1....|\n"
        "     + |....F1--    ....|"
    )


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v"])
@pytest.mark.parametrize("comm", [0.5, 1.5])
def test_tasks_starting_at_half_characters_keep_their_length(name: str, comm: float) -> None:
    """Unit costs and m = 12: labels such as F10 are 3 characters, so the scale is 3 per unit and
    a message of 0.5 or 1.5 puts tasks at x.5 characters. Every task must cover exactly 3 characters
    per unit of its cost (known from `Costs`, not from the picture), its label whole. round()'s
    half-to-even gave such tasks alternately 4 and 2 characters, cutting F10 to "F-"."""
    sched = build(name, num_ranks=2, num_microbatches=12)
    costs = Costs(f=1, b=1, w=1, comm=comm)
    text = render_ascii(simulate(sched, costs), width=10_000)
    length = {"F": 1, "B": 1, "W": 1, "BW": 2}  # cost units per task, from the Costs above
    for rank, order in enumerate(sched.orders):
        row = re.search(rf"^rank {rank} \|(.*)\|$", text, re.M).group(1)
        cells = re.findall(r"[FBWXfbwx]'*\d+-*", row)  # a label and its '-' fill: one task each
        labels = [re.match(r"[FBWXfbwx]'*\d+", c).group(0) for c in cells]
        assert [len(c) for c in cells] == [3 * length[a.kind.name] for a in order], (rank, row)
        assert [x.lstrip("FBWXfbwx'") for x in labels] == [str(a.microbatch) for a in order], (rank, row)


def test_tasks_of_very_different_lengths_keep_the_picture_bounded() -> None:
    """ZB-H1, p=2, m=2, F and B of 1e-5 beside W of 1 (a ratio of 1e5; 1e7 and more hung): the
    default scale gave the shortest task 2 characters, 2e5 per unit, so each row ran to about
    4e5 characters (zbpp show printed thousands of blocks). The time axis is now at most 100,000
    characters, the short tasks drawn at their instants as points (or, a character wide, as their
    kind letter), each rank's tasks still all shown, in order (the schedule is the reference)."""
    sched = build("zb-h1", num_ranks=2, num_microbatches=2)
    res = simulate(sched, Costs(f=1e-5, b=1e-5, w=1))
    text = render_ascii(res, width=1_000_000)
    for rank, order in enumerate(sched.orders):
        row = re.search(rf"^rank {rank} \|(.*)\|$", text, re.M).group(1)
        assert len(row) <= 100_000 + 2 * len(order), len(row)  # the axis, plus inserted point columns
        in_time_order = sorted(order, key=lambda a: (res.start[a], res.end[a]))
        assert re.findall(r"[FBWX]", row) == [a.kind.value for a in in_time_order], row[:40]


def _rows(text: str) -> dict[str, str]:
    """Each row's characters, its blocks joined (row name -> characters)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if "|" in line:
            name, body = line.split("|", 1)
            out[name] = out.get(name, "") + body.rstrip("|")
    return out


def _edges(text: str) -> list[int]:
    """The columns at which the blocks after the first begin."""
    widths = [len(line.split("|", 1)[1]) - 1 for line in text.splitlines() if line.startswith("rank 0 ")]
    return [sum(widths[:i]) for i in range(1, len(widths))]


@pytest.mark.parametrize("name,comm,width", [("zb-h1", 0.3, 50), ("1f1b", 0.3, 47), ("zb-v", 0.7, 61),
                                             ("zb-h2", 0.5, 44), ("interleaved-1f1b", 0.3, 53)])
def test_block_edges_cut_no_label_in_two(name: str, comm: float, width: int) -> None:
    """A message time puts tasks off the grid of the shortest one, and a block's edge used to cut
    a label in two (zb-h1, p=4, m=12, comm 0.3, width 50: ``...B1-W|`` then ``|1-F5``). Reference:
    the same picture drawn in one block. Wrapped, every column is the reference's, but for labels
    omitted whole (drawn as ``-``); a label kept lies within one block."""
    res = simulate(build(name, num_ranks=4, num_microbatches=12), Costs(1, 1, 1, comm=comm))
    whole = _rows(render_ascii(res, width=10**6))
    text = render_ascii(res, width=width)
    wrapped, edges = _rows(text), _edges(text)
    assert edges and wrapped.keys() == whole.keys()
    label = re.compile(r"[FBWXfbwx]'*\d+")
    for row, ref in whole.items():
        got = wrapped[row]
        assert len(got) == len(ref)
        omitted = [False] * len(ref)  # columns of labels the wrapped picture omitted
        for m in label.finditer(ref):
            if got[m.start():m.end()] == ref[m.start():m.end()]:
                assert not any(m.start() < e < m.end() for e in edges), (row, m.group(), text)
            else:
                assert set(got[m.start():m.end()]) == {"-"}, (row, m.group(), text)  # omitted whole
                omitted[m.start():m.end()] = [True] * (m.end() - m.start())
        assert all(g == r or o for g, r, o in zip(got, ref, omitted)), (row, text)
