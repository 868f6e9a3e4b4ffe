"""Schedule registry: `build(name, num_ranks=, num_microbatches=, **options)` and `available()`.

A generator is a function ``gen(num_ranks, num_microbatches, *, option=default, ...) -> Schedule``
registered with `register`. Its keyword-only parameters are its options; anything else is refused
with a `ValueError` that lists what is allowed.

Size limit: `build` refuses, before generating anything, a schedule whose generator would create
more than `max_tasks()` tasks (default 2**24, about 16.8 million: a few GB of Python objects; every
schedule of up to a few hundred ranks and a few thousand microbatches is far below it). Set the
environment variable ``ZBPP_MAX_TASKS`` to raise or lower it.

>>> from zbpp.schedules import build, available
>>> "zb-h1" in available()
True
>>> build("interleaved-1f1b", num_ranks=2, num_microbatches=4, chunks=2).num_stages
4
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from .checks import DEFAULT_MAX_TASKS, MAX_TASKS_ENV, as_int, max_tasks  # noqa: F401 - also the registry's names
from .generators import BUILTIN
from .ir import Schedule

__all__ = ["register", "build", "available", "options_of", "max_tasks", "task_count", "stage_count"]

Generator = Callable[..., Schedule]
#: ``tasks(num_ranks, num_microbatches, **options) -> int``: how many tasks a generator creates
TaskCount = Callable[..., int]
#: ``stages(num_ranks, **options) -> int``: how many stages its schedules have (m does not matter)
StageCount = Callable[..., int]
_REGISTRY: dict[str, Generator] = {}
_TASK_COUNTS: dict[str, TaskCount] = {}
_STAGE_COUNTS: dict[str, StageCount] = {}

def _at_most_two_stages_per_rank(num_ranks: int, num_microbatches: int, **options: Any) -> int:
    return 3 * 2 * num_ranks * num_microbatches  # F, B and W of up to two stages per rank


def _one_stage_per_rank(num_ranks: int, **options: Any) -> int:
    return num_ranks


def register(name: str, *, tasks: TaskCount | None = None, stages: StageCount | None = None
             ) -> Callable[[Generator], Generator]:
    """Decorator: make `fn` buildable as `name`.

    `tasks(num_ranks, num_microbatches, **options)` says how many tasks the generator creates
    (including any it builds and then drops), so that `build` can refuse a schedule too large to
    build before it starts; the default assumes F, B and W of up to two stages per rank.
    `stages(num_ranks, **options)` says how many stages its schedules have (`stage_count`);
    the default is one per rank.
    """

    def deco(fn: Generator) -> Generator:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"schedule {name!r} is registered twice")
        _REGISTRY[name] = fn
        _TASK_COUNTS[name] = tasks or _at_most_two_stages_per_rank
        _STAGE_COUNTS[name] = stages or _one_stage_per_rank
        return fn

    return deco


def available() -> list[str]:
    """Names `build` accepts, in registration order.

    >>> available()[:4]
    ['gpipe', '1f1b', 'interleaved-1f1b', 'zb-h1']
    """
    return list(_REGISTRY)


def options_of(name: str) -> dict[str, Any]:
    """The options schedule `name` takes, with their defaults.

    >>> options_of("interleaved-1f1b"), options_of("zb-auto")
    ({'chunks': 2}, {'costs': None, 'memory': None, 'memory_limit': None})
    """
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


def task_count(name: str, num_ranks: int, num_microbatches: int, **options: Any) -> int:
    """How many tasks `build` would have generator `name` create (an upper bound), without building.

    It counts what the generator builds and then drops too (ZB-V is built for at least 2p-1
    microbatches). `build` compares it with `max_tasks()`.

    >>> task_count("zb-h1", 4, 8), task_count("zb-v", 4, 2)
    (96, 168)
    """
    _lookup(name)
    _check_options(name, options)
    return _TASK_COUNTS[name](as_int(num_ranks, "num_ranks"), as_int(num_microbatches, "num_microbatches"), **options)


def stage_count(name: str, num_ranks: int, **options: Any) -> int:
    """How many stages schedule `name` cuts the model into on `num_ranks` ranks, without building
    it (an automatic schedule would run its whole search). The microbatch count does not matter.

    >>> stage_count("zb-v", 4), stage_count("zbi-auto", 4, chunks=3), stage_count("zb-auto", 4)
    (8, 12, 4)
    """
    _lookup(name)
    _check_options(name, options)
    return _STAGE_COUNTS[name](as_int(num_ranks, "num_ranks"), **options)


def _check_options(name: str, options: dict[str, Any]) -> None:
    allowed = options_of(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        takes = ", ".join(f"{k}={v!r}" for k, v in allowed.items()) or "no options"
        raise ValueError(f"schedule {name!r} does not take option(s) {', '.join(unknown)}; it takes: {takes}")


def build(name: str, *, num_ranks: int, num_microbatches: int, **options: Any) -> Schedule:
    """Build schedule `name` for `num_ranks` ranks and `num_microbatches` microbatches.

    The sizes may be any integers (numpy's too). Raises `ValueError` for an unknown name, bad
    sizes, an option the schedule does not take, or a schedule of more tasks than `max_tasks()`
    (raise it with the environment variable ``ZBPP_MAX_TASKS``).

    >>> build("zb-v", num_ranks=10**9, num_microbatches=8)
    Traceback (most recent call last):
    ValueError: zb-v with num_ranks=1000000000, num_microbatches=8 would create up to 11,999,999,994,000,000,000 tasks, more than the limit of 16,777,216; set the environment variable ZBPP_MAX_TASKS to allow more
    """
    fn = _lookup(name)
    p = as_int(num_ranks, "num_ranks")
    m = as_int(num_microbatches, "num_microbatches")
    tasks, limit = task_count(name, p, m, **options), max_tasks()
    if tasks > limit:
        raise ValueError(
            f"{name} with num_ranks={p}, num_microbatches={m} would create up to {tasks:,} tasks, more than the "
            f"limit of {limit:,}; set the environment variable {MAX_TASKS_ENV} to allow more"
        )
    schedule = fn(p, m, **options)
    if not schedule.name:
        object.__setattr__(schedule, "name", name)
    return schedule


# The built-in schedules, as their modules declare them (they do not import this one).
for _name, (_generator, _tasks, *_stages) in BUILTIN.items():
    register(_name, tasks=_tasks, stages=_stages[0] if _stages else None)(_generator)
