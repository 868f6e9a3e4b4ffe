"""Schedule registry: `build(name, num_ranks=, num_microbatches=, **options)` and `available()`.

A generator is a function ``gen(num_ranks, num_microbatches, *, option=default, ...) -> Schedule``
registered with `register`. Its keyword-only parameters are its options; anything else is refused
with a `ValueError` that lists what is allowed.

>>> from zbpp.schedules import build, available
>>> "zb-h1" in available()
True
>>> build("interleaved-1f1b", num_ranks=2, num_microbatches=4, chunks=2).num_stages
4
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from .ir import Schedule

__all__ = ["register", "build", "available", "options_of"]

Generator = Callable[..., Schedule]
_REGISTRY: dict[str, Generator] = {}


def register(name: str) -> Callable[[Generator], Generator]:
    """Decorator: make `fn` buildable as `name`."""

    def deco(fn: Generator) -> Generator:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"schedule {name!r} is registered twice")
        _REGISTRY[name] = fn
        return fn

    return deco


def _load_builtin() -> None:
    # Importing the generator modules registers them.
    from . import generators  # noqa: F401


def available() -> list[str]:
    """Names `build` accepts, in registration order."""
    _load_builtin()
    return list(_REGISTRY)


def options_of(name: str) -> dict[str, Any]:
    """The options schedule `name` takes, with their defaults."""
    _load_builtin()
    fn = _lookup(name)
    return {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def _lookup(name: str) -> Generator:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; available: {', '.join(_REGISTRY)}") from None


def build(name: str, *, num_ranks: int, num_microbatches: int, **options: Any) -> Schedule:
    """Build schedule `name` for `num_ranks` ranks and `num_microbatches` microbatches.

    Raises `ValueError` for an unknown name, bad sizes, or an option the schedule does not take.
    """
    _load_builtin()
    fn = _lookup(name)
    for what, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    allowed = options_of(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        takes = ", ".join(f"{k}={v!r}" for k, v in allowed.items()) or "no options"
        raise ValueError(f"schedule {name!r} does not take option(s) {', '.join(unknown)}; it takes: {takes}")
    schedule = fn(num_ranks, num_microbatches, **options)
    if not schedule.name:
        object.__setattr__(schedule, "name", name)
    return schedule
