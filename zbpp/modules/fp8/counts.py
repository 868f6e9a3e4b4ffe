"""Tallies of which implementation ran (cast paths, GEMM paths, fused casts): diagnostics.

They are process-wide on purpose, as the choices they record are: the device, the installed
Triton and the environment variables that pick a path belong to the process, not to a thread or a
module. Autograd's backward thread counts too, hence the lock.

>>> counts = PathCounts(("fast", "slow"))
>>> counts.add("fast"); counts.add("slow", "fast")
>>> counts.snapshot()
{'fast': 2, 'slow': 1}
>>> counts.reset(); counts.snapshot()
{'fast': 0, 'slow': 0}
"""

from __future__ import annotations

import threading
from typing import Iterable

__all__ = ["PathCounts", "FUSED_COUNTS", "fused_path_counts", "reset_fused_path_counts"]


class PathCounts:
    """A thread-safe count per key; `snapshot` reports the declared keys, in their order."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(keys)
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, *keys: str) -> None:
        """Count one run of each key."""
        with self._lock:  # a plain loop, not Counter.update: every FP8 cast counts here, twice
            counts = self._counts
            for key in keys:
                counts[key] = counts.get(key, 0) + 1

    def snapshot(self) -> dict[str, int]:
        """``{key: count}`` for every declared key (zeros included)."""
        with self._lock:
            return {key: self._counts.get(key, 0) for key in self._keys}

    def reset(self) -> None:
        """Set every count to zero."""
        with self._lock:
            self._counts.clear()


#: The layers' fused norm / activation / activation-gradient casts (`zbpp.modules._fused`).
FUSED_COUNTS = PathCounts(f"{kind}_{path}" for kind in ("norm", "act", "dact") for path in ("triton", "eager"))


def fused_path_counts() -> dict[str, int]:
    """How many norm / activation / activation-gradient casts ran fused (``*_triton``) and
    through the torch reference (``*_eager``) so far.

    >>> sorted(fused_path_counts())[:2]
    ['act_eager', 'act_triton']
    """
    return FUSED_COUNTS.snapshot()


def reset_fused_path_counts() -> None:
    """Set every `fused_path_counts` entry to zero."""
    FUSED_COUNTS.reset()
