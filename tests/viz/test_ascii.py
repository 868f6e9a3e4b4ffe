"""ASCII timelines (`zbpp show`): every task's label is drawn whole, whatever stage of its rank it is."""

from __future__ import annotations

import re

import pytest

from zbpp.schedules import build, simulate
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
