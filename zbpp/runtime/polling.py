"""Waiting for an asynchronous work on the host without blocking inside torch.

A blocking ``work.wait()`` cannot be interrupted: on NCCL it waits for a dead peer until the
watchdog ends the process, and it cannot look for the mark a failing rank leaves in the store.
`poll` sleeps in short, growing pauses and runs a check between them, which may raise.

>>> class Done:
...     def is_completed(self): return True
>>> poll(Done(), lambda: None)
"""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["poll", "wait_for"]

_FIRST_PAUSE_S = 1e-4
_LONGEST_PAUSE_S = 0.005


def poll(work: Any, check: Callable[[], None], check_every_s: float = 0.0) -> None:
    """Return once ``work.is_completed()``; call `check` (which may raise) at most every
    `check_every_s` seconds while waiting. The caller still calls ``work.wait()`` for its errors."""
    last_check = time.monotonic()
    pause = _FIRST_PAUSE_S
    while not work.is_completed():
        time.sleep(pause)
        pause = min(2 * pause, _LONGEST_PAUSE_S)
        if time.monotonic() - last_check >= check_every_s:
            last_check = time.monotonic()
            check()


def wait_for(work: Any, check: Callable[[], None] | None, device: Any, check_every_s: float = 0.02) -> None:
    """``work.wait()``; first, for a collective on the host (`device` not CUDA, where ``wait`` only
    orders streams), `poll` with `check` (None: wait plainly)."""
    if check is not None and getattr(device, "type", "cpu") != "cuda":
        poll(work, check, check_every_s)
    work.wait()
