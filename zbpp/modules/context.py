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

from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Hashable, Iterator, TypeVar

__all__ = ["microbatch", "current_microbatch"]

T = TypeVar("T")

_key: ContextVar[Hashable | None] = ContextVar("zbpp_microbatch", default=None)


@contextmanager
def bound(var: ContextVar[T], value: T) -> Iterator[T]:
    """A block in which `var` is `value`; leaving it restores what `var` was on entry (also the
    FP8 recipe's block, ``fp8.recipe.fp8_autocast``)."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def microbatch(key: Hashable) -> AbstractContextManager[Hashable]:
    """Tag the forwards run inside this block with `key` (any hashable, e.g. an int)."""
    return bound(_key, key)


def current_microbatch() -> Hashable | None:
    """The innermost active key, or None outside any `microbatch` block."""
    return _key.get()
