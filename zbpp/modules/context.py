"""The microbatch key context: which microbatch a forward belongs to.

The runtime runs each F inside ``with zbpp.modules.microbatch(key):``. A delayed-wgrad module reads
`current_microbatch()` at forward time and records it in its autograd context, so that its backward
(which on GPUs runs on autograd's own thread, where nothing set by the caller is visible) files the
wgrad closure under that key; ``backward_dw(key)`` then computes that one.

>>> with microbatch(3):
...     current_microbatch()
3
>>> current_microbatch() is None
True
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Hashable, Iterator

__all__ = ["microbatch", "current_microbatch"]

_stack: list[Hashable] = []


@contextmanager
def microbatch(key: Hashable) -> Iterator[Hashable]:
    """Tag the forwards run inside this block with `key` (any hashable, e.g. an int)."""
    _stack.append(key)
    try:
        yield key
    finally:
        _stack.pop()


def current_microbatch() -> Hashable | None:
    """The innermost active key, or None outside any `microbatch` block."""
    return _stack[-1] if _stack else None
