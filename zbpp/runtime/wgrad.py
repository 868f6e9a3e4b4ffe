"""W tasks: find a stage's delayed-wgrad modules and compute their weight gradients.

A module *defers* its weight gradient (DESIGN.md's protocol) when `zbpp.modules.is_delayed` says so:
zbpp layers with ``delay_wgrad_compute=True``, Transformer Engine layers whose wgrad store delays,
and any other module with a ``backward_dw()`` that does not say it is off. Every other module gets
its weight gradients during B, so its W is empty.

A module whose ``backward_dw`` takes an argument files its pending wgrads under the key recorded at
forward time (`zbpp.modules.microbatch`); the runtime's key is ``(stage, microbatch)``, so a module
shared by two stages of one rank (tied weights under a V placement) keeps their wgrads apart, and W
calls ``backward_dw((s, j))``. One whose ``backward_dw()`` takes none (Transformer Engine) is a
FIFO: W computes the *oldest* pending one, so it is accepted only under schedules that keep each
stage's W in B order (`zbpp.runtime.plan.fifo_wgrad_problem`).

>>> import torch
>>> delayed_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)))
[]
"""

from __future__ import annotations

from torch import nn

from ..modules import is_delayed, supports_keys

__all__ = ["is_delayed", "supports_keys", "delayed_modules", "run_wgrad", "discard_pending"]


def delayed_modules(stage: nn.Module) -> list[nn.Module]:
    """The outermost delayed-wgrad modules of `stage` (itself included), in ``modules()`` order.

    A delayed module's own ``backward_dw`` is responsible for any delayed module inside it, so W
    does not descend into one (that would compute those weight gradients twice).
    """
    found: list[nn.Module] = []
    seen: set[int] = set()
    todo = [stage]  # depth first, children in order (an explicit stack: no self-referencing closure)
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if is_delayed(m):
            found.append(m)
            continue
        todo.extend(reversed(list(m.children())))
    return found


def run_wgrad(modules: list[nn.Module], keyed: list[bool], key: tuple[int, int]) -> None:
    """W of one (stage, microbatch) `key`: ``backward_dw(key)`` on keyed modules, ``backward_dw()`` on FIFO ones."""
    for m, k in zip(modules, keyed):
        if k:
            m.backward_dw(key)
        else:
            m.backward_dw()


def discard_pending(modules: list[nn.Module]) -> None:
    """Drop the wgrad closures still pending in `modules` (after a failed step). Best effort: it
    clears the stores it can find (``wgrad_store`` / ``_wgrad_store`` / ``_store`` / ``_fifo``
    with ``clear()``, or a ``discard_wgrad()`` / ``clear_wgrad()`` method)."""
    for m in modules:
        for meth in ("discard_wgrad", "clear_wgrad", "clear_backward_dw"):
            fn = getattr(m, meth, None)
            if callable(fn):
                fn()
                break
        else:
            for attr in ("wgrad_store", "_wgrad_store", "_store", "_fifo"):
                store = getattr(m, attr, None)
                clear = getattr(store, "clear", None)
                if callable(clear):
                    clear()
