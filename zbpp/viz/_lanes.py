"""Tracks for tasks of one rank that run at once (DualPipe's overlapped pairs, measured records)."""

from __future__ import annotations

from typing import Sequence

__all__ = ["lanes"]


def lanes(intervals: Sequence[tuple[float, float]]) -> list[int]:
    """Each interval's track (0, 1, ...), so that intervals on one track never overlap: taken in
    (start, end) order, each goes on the first track whose last interval ended by its start.

    >>> lanes([(0, 2), (1, 3), (2, 4), (3, 3)])
    [0, 1, 0, 1]
    """
    ends: list[float] = []  # per track, the end of its last interval
    out = [0] * len(intervals)
    for i in sorted(range(len(intervals)), key=lambda i: intervals[i]):
        start, end = intervals[i]
        lane = next((k for k, e in enumerate(ends) if e <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        ends[lane] = end
        out[i] = lane
    return out
