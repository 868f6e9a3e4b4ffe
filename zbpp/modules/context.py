"""The microbatch key context: which microbatch a forward belongs to.

The runtime runs each F inside ``with zbpp.modules.microbatch(key):``. A delayed-wgrad module reads
`current_microbatch()` at forward time and records it in its autograd context, so that its backward
(which on GPUs runs on autograd's own thread, where nothing set by the caller is visible) files the
wgrad closure under that key; ``backward_dw(key)`` then computes that one.

The key is context state (a `contextvars.ContextVar`): each thread and each asyncio task sees its
own innermost block, and a block puts back exactly what it found when it ends.

Activation checkpointing re-runs a forward during the backward, outside the block it first ran
in: `forward_key` gives the layers the original forward's key there too (see its docstring).

>>> with microbatch(3):
...     current_microbatch()
3
>>> current_microbatch() is None
True
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
import sys
from typing import Any, Hashable, Iterator, Protocol, TypeVar

import torch
from torch.utils.checkpoint import CheckpointFunction

from .._compat import current_autograd_node, in_nonreentrant_checkpoint

__all__ = ["microbatch", "current_microbatch", "forward_key", "next_backward", "rank_next_backward",
           "writing_first_grads", "claim_grad_write"]

T = TypeVar("T")

_key: ContextVar[Hashable | None] = ContextVar("zbpp_microbatch", default=None)
_next_backward: ContextVar[Hashable | None] = ContextVar("zbpp_next_backward", default=None)
_grad_writes: ContextVar[Any] = ContextVar("zbpp_grad_writes", default=None)


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
    """Tag the forwards run inside this block with `key` (any hashable, e.g. an int).

    A delayed-wgrad layer files each backward's weight gradient under its forward's key, and
    ``backward_dw(key)`` computes that one:

    >>> import torch
    >>> from zbpp.modules import Linear
    >>> lin = Linear(4, 2, delay_wgrad_compute=True)
    >>> for key in (0, 1):
    ...     with microbatch(key):
    ...         y = lin(torch.ones(3, 4))
    ...     y.sum().backward()  # B: the input gradient; the weight's waits under `key`
    >>> lin.weight.grad is None
    True
    >>> lin.backward_dw(1); lin.weight.grad[0, 0].item()  # W of microbatch 1: 3 rows of ones
    3.0
    """
    try:
        hash(key)
    except TypeError:  # else it fails only in the backward, filing the wgrad job under it
        raise TypeError(
            f"microbatch({key!r}): the key must be hashable (an int, a str, a tuple of those), "
            f"not a {type(key).__name__}"
        ) from None
    return bound(_key, key)


def current_microbatch() -> Hashable | None:
    """The innermost active key, or None outside any `microbatch` block.

    >>> with microbatch(0), microbatch((1, 5)):
    ...     current_microbatch()
    (1, 5)
    >>> current_microbatch() is None
    True
    """
    return _key.get()


def next_backward(key: Hashable | None) -> AbstractContextManager[Hashable | None]:
    """Tell the forwards run inside this block that the rank's very next task is the backward of
    microbatch `key` (None: it is not a backward; the runtime knows from the schedule). Activation
    offload then starts bringing that backward's tensors back now, or, when `key` is the forward's
    own microbatch, keeps them on the device (no task could hide the copies out and back)."""
    return bound(_next_backward, key)


def rank_next_backward() -> Hashable | None:
    """Inside a forward: the key of the backward that is the rank's next task (`next_backward`), else None."""
    return _next_backward.get()


class FirstGradWrites(Protocol):
    """Decides, per contribution, whether a weight gradient may overwrite ``.grad`` (`claim_grad_write`)."""

    def claim(self, param: torch.nn.Parameter) -> bool:
        """True when nothing was added into ``param.grad`` yet this step and it may be overwritten."""
        ...


def writing_first_grads(writes: FirstGradWrites | None) -> AbstractContextManager[Any]:
    """A block in which `backward_dw` asks `writes` whether each weight gradient may overwrite
    ``.grad`` rather than be added to it (the runtime's task graphs: a fixed ``.grad`` buffer needs
    no zeroing when the step's first contribution writes it)."""
    return bound(_grad_writes, writes)


def claim_grad_write(param: torch.nn.Parameter) -> bool:
    """Whether the gradient about to go into ``param.grad`` (which exists) may overwrite it: only
    inside `writing_first_grads`, for the step's first contribution to `param`. A True answer is a
    promise to write: the caller must then set every element of ``param.grad``.

    >>> import torch
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> p.grad = torch.zeros(2)
    >>> claim_grad_write(p)  # outside writing_first_grads: add, as autograd does
    False
    """
    writes = _grad_writes.get()
    return writes is not None and writes.claim(param)


# the attribute that carries the key on a reentrant checkpoint's autograd node
_CKPT_KEY_ATTR = "_zbpp_microbatch_key"
_CKPT_FORWARD = CheckpointFunction.forward.__code__


def forward_key() -> Hashable | None:
    """The key a forward starting now belongs to: `current_microbatch`, or inside a re-run by
    activation checkpointing, the key of the forward that is re-run.

    Reentrant ``torch.utils.checkpoint`` (``use_reentrant=True``) runs the function without
    autograd in the forward and again, inside the backward of its node, to build the graph it
    differentiates; that backward runs outside the ``microbatch()`` block (on GPUs on autograd's
    own thread). So the first run records its key on the checkpoint's node (the autograd context
    of ``CheckpointFunction``, found on the call stack), and the re-run reads it back from the
    node autograd is running. Non-reentrant checkpointing needs nothing: the layers' nodes of
    the first run, which recorded their key, are the ones differentiated. A re-run takes its
    node's key even inside another ``microbatch()`` block (B run by hand inside the next F's).

    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> seen = []
    >>> def f(x):
    ...     seen.append((torch.is_grad_enabled(), forward_key()))
    ...     return x * 2
    >>> x = torch.ones(2, requires_grad=True)
    >>> with microbatch(7):
    ...     y = checkpoint(f, x, use_reentrant=True)
    >>> y.sum().backward()  # outside the block: the re-run still sees key 7
    >>> seen
    [(False, 7), (True, 7)]
    """
    # a re-run's key first: on CPUs autograd runs it on the caller's thread, which may be inside
    # another microbatch's block (B(0) run by hand inside F(1)'s)
    node = current_autograd_node()
    key = None if node is None else getattr(node, _CKPT_KEY_ATTR, None)
    if key is None:
        key = _key.get()
    if key is not None and not torch.is_grad_enabled():
        _tag_checkpoint(key)
    return key


def in_torch_checkpoint() -> bool:
    """Whether a forward starting now runs inside a ``torch.utils.checkpoint`` region (reentrant:
    its first run, under no_grad; non-reentrant: its hooks are the innermost), whose backward runs
    the forward again.

    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> seen = []
    >>> _ = checkpoint(lambda x: seen.append(in_torch_checkpoint()) or x * 2, torch.ones(1), use_reentrant=False)
    >>> seen, in_torch_checkpoint()
    ([True], False)
    """
    if in_nonreentrant_checkpoint():
        return True
    if torch.is_grad_enabled():  # a reentrant region's first run is under no_grad
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CKPT_FORWARD:
            return True
        frame = frame.f_back
    return False


def _tag_checkpoint(key: Hashable) -> None:
    # every reentrant checkpoint on the stack remembers `key` for its re-run (nested ones too: an
    # outer one re-runs the inner one's first run, which then finds the key on the outer node)
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _CKPT_FORWARD:
            ctx = frame.f_locals.get("ctx")
            if ctx is not None and getattr(ctx, _CKPT_KEY_ATTR, None) is None:
                setattr(ctx, _CKPT_KEY_ATTR, key)
        frame = frame.f_back
