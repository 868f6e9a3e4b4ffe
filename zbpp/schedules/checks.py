"""Checks of the numbers users hand to the schedule core: sizes, costs, memory, limits.

Where an integer is wanted any `numbers.Integral` is accepted (numpy integers too) and where a
number is wanted any `numbers.Real` (`fractions.Fraction`, numpy floats); bools are refused in
both, and so are NaN and infinities. Every error is a `ValueError` that names the field, says
what is accepted and shows the value. Pure Python: no numpy, no torch.

>>> as_int(7, "num_ranks")
7
>>> from fractions import Fraction
>>> as_number(Fraction(1, 4), "Memory.wgrad")
0.25
>>> as_number(float("nan"), "Costs.comm")
Traceback (most recent call last):
ValueError: Costs.comm must be a finite number >= 0, got nan
>>> as_numbers([1, 2.5], "Costs.f")
(1.0, 2.5)
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

__all__ = ["as_int", "as_number", "as_positive", "as_numbers", "max_tasks"]


def as_int(value: Any, what: str, *, minimum: int = 1) -> int:
    """`value` as a Python int, if it is an integer (not a bool) >= `minimum`; else `ValueError`.

    >>> as_int(0, "chunks")
    Traceback (most recent call last):
    ValueError: chunks must be an integer >= 1, got 0
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)
        if number >= minimum:
            return number
    raise ValueError(f"{what} must be an integer >= {minimum}, got {_show(value)}")


def as_number(value: Any, what: str, *, minimum: float = 0.0) -> float:
    """`value` as a float, if it is a finite real number (not a bool) >= `minimum`; else `ValueError`.

    >>> as_number(True, "Costs.f")
    Traceback (most recent call last):
    ValueError: Costs.f must be a finite number >= 0, got True
    """
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            number = float(value)
        except (OverflowError, ValueError):  # e.g. an int too large for a float
            number = math.inf
        if math.isfinite(number) and number >= minimum:
            return number
    raise ValueError(f"{what} must be a finite number >= {minimum:g}, got {_show(value)}")


def as_positive(value: Any, what: str) -> float:
    """`value` as a float, if it is a finite real number (not a bool) > 0; else `ValueError`.

    >>> as_positive(0, "scale")
    Traceback (most recent call last):
    ValueError: scale must be a finite number > 0, got 0
    """
    try:
        number = as_number(value, what)
    except ValueError:
        number = 0.0
    if number > 0:
        return number
    raise ValueError(f"{what} must be a finite number > 0, got {_show(value)}")


def as_numbers(value: Any, what: str, *, minimum: float = 0.0) -> float | tuple[float, ...]:
    """A number (see `as_number`), or a non-empty sequence of them as a tuple (one per stage).

    The error names the bad element: ``Costs.f[2] must be a finite number >= 0, got nan``.

    >>> as_numbers([1, float("inf")], "Memory.activation")
    Traceback (most recent call last):
    ValueError: Memory.activation[1] must be a finite number >= 0, got inf
    >>> as_numbers("1", "Costs.b")
    Traceback (most recent call last):
    ValueError: Costs.b must be a finite number >= 0 or a sequence of them (one per stage), got '1'
    """
    if isinstance(value, numbers.Real) or isinstance(value, bool):
        return as_number(value, what, minimum=minimum)
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{what} must be a finite number >= {minimum:g} or a sequence of them (one per stage), "
                         f"got {_show(value)}")
    try:
        items = list(value)
    except TypeError:  # e.g. a 0-d array, iterable in name only
        raise ValueError(f"{what} must be a finite number >= {minimum:g} or a sequence of them (one per stage), "
                         f"got {_show(value)}") from None
    if not items:
        raise ValueError(f"{what} is empty: give a number, or one number per stage")
    return tuple(as_number(v, f"{what}[{i}]", minimum=minimum) for i, v in enumerate(items))


def _show(value: Any) -> str:
    """repr, cut short (a bad value may be a huge sequence), and plain for floats (nan, not np.float64(nan))."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)):
        try:
            return repr(float(value))
        except (OverflowError, ValueError):
            pass
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


DEFAULT_MAX_TASKS = 2**24
MAX_TASKS_ENV = "ZBPP_MAX_TASKS"


def max_tasks() -> int:
    """The most tasks `zbpp.schedules.build` lets a generator create: ``$ZBPP_MAX_TASKS`` if set, else 2**24.

    >>> max_tasks() >= 3 * 256 * 4096  # ZB-H1 with 256 ranks and 4096 microbatches builds
    True
    """
    text = os.environ.get(MAX_TASKS_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_TASKS
    try:
        return as_int(int(text), MAX_TASKS_ENV)
    except ValueError:
        raise ValueError(f"environment variable {MAX_TASKS_ENV} must be an integer >= 1, got {text!r}") from None
