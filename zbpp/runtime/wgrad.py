"""W tasks: find a stage's delayed-wgrad modules and compute their weight gradients.

A module *defers* its weight gradient (DESIGN.md's protocol) when it has ``backward_dw()`` and does
not say it is off: ``need_backward_dw()`` (Transformer Engine) or ``delay_wgrad_compute`` (an
attribute or a method) is consulted when present; `zbpp.modules.is_delayed` too, once it exists.
Every other module gets its weight gradients during B, so its W is empty.

A module whose ``backward_dw`` takes an argument files its pending wgrads under the microbatch key
recorded at forward time (`zbpp.modules.microbatch`); W calls ``backward_dw(j)``. One whose
``backward_dw()`` takes none (Transformer Engine) is a FIFO: W computes the *oldest* pending one, so
it is accepted only under schedules that keep each stage's W in B order
(`zbpp.runtime.plan.fifo_wgrad_problem`).

>>> import torch
>>> delayed_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)))
[]
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

__all__ = ["is_delayed", "supports_keys", "delayed_modules", "run_wgrad", "discard_pending"]


def _zbpp_modules_attr(name: str) -> Any:
    try:  # zbpp.modules is optional to the runtime (and written concurrently)
        import zbpp.modules as zm
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        return None
    return getattr(zm, name, None)


def is_delayed(module: nn.Module) -> bool:
    """True when `module` defers its weight gradient to ``backward_dw()``."""
    if not callable(getattr(module, "backward_dw", None)):
        return False
    official = _zbpp_modules_attr("is_delayed")
    if callable(official) and official(module):
        return True
    need = getattr(module, "need_backward_dw", None)
    if callable(need):
        return bool(need())
    flag = getattr(module, "delay_wgrad_compute", None)
    if flag is None:
        return True  # protocol without a switch: backward_dw is the W (a no-op when nothing is deferred)
    return bool(flag() if callable(flag) else flag)


def supports_keys(module: nn.Module) -> bool:
    """True when ``module.backward_dw(key)`` computes the wgrad of one microbatch key."""
    official = _zbpp_modules_attr("supports_keys")
    if callable(official) and official(module):
        return True
    try:
        params = inspect.signature(module.backward_dw).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def delayed_modules(stage: nn.Module) -> list[nn.Module]:
    """The outermost delayed-wgrad modules of `stage` (itself included), in ``modules()`` order.

    A delayed module's own ``backward_dw`` is responsible for any delayed module inside it, so W
    does not descend into one (that would compute those weight gradients twice).
    """
    found: list[nn.Module] = []
    seen: set[int] = set()

    def walk(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if is_delayed(m):
            found.append(m)
            return
        for child in m.children():
            walk(child)

    walk(stage)
    return found


def run_wgrad(modules: list[nn.Module], keyed: list[bool], microbatch: int) -> None:
    """W of one stage and microbatch: ``backward_dw(microbatch)`` on keyed modules, ``backward_dw()`` on FIFO ones."""
    for m, k in zip(modules, keyed):
        if k:
            m.backward_dw(microbatch)
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
