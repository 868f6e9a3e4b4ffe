"""The microbatch key context: which microbatch a forward belongs to.

The runtime runs each F inside ``with zbpp.modules.microbatch(key):``. A delayed-wgrad module reads
`current_microbatch()` at forward time and records it in its autograd context, so that its backward
(which on GPUs runs on autograd's own thread, where nothing set by the caller is visible) files the
wgrad closure under that key; ``backward_dw(key)`` then computes that one.

The key is context state (a `contextvars.ContextVar`): each thread and each asyncio task sees its
own innermost block, and a block puts back exactly what it found when it ends.

>>> with microbatch(3):
...     current_microbatch()
3
>>> current_microbatch() is None
True
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Hashable, Iterator

__all__ = ["microbatch", "current_microbatch"]

_key: ContextVar[Hashable | None] = ContextVar("zbpp_microbatch", default=None)


@contextmanager
def microbatch(key: Hashable) -> Iterator[Hashable]:
    """Tag the forwards run inside this block with `key` (any hashable, e.g. an int)."""
    token = _key.set(key)
    try:
        yield key
    finally:
        _key.reset(token)


def current_microbatch() -> Hashable | None:
    """The innermost active key, or None outside any `microbatch` block."""
    return _key.get()
