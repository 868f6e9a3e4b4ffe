"""Checks of `zbpp.runtime.pipeline.Pipeline`'s arguments: each error names the argument and what to pass.

>>> check_arguments(None, print, {}, None, None, None, None)
Traceback (most recent call last):
    ...
TypeError: schedule must be a zbpp.schedules.Schedule, got NoneType
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from ..schedules.ir import Schedule
from ..schedules.simulate import Costs

__all__ = ["check_arguments", "check_stage_modules"]


def check_arguments(schedule: Any, loss_fn: Any, stage_modules: Any, costs: Any, timeout: Any, loss_weight: Any,
                    seed: Any) -> None:
    """Raise `TypeError` / `ValueError` for an argument of the wrong kind."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a zbpp.schedules.Schedule, got {type(schedule).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(stage_modules, Mapping):
        raise TypeError(f"stage_modules must be a mapping {{stage: module}}, got {type(stage_modules).__name__}")
    if costs is not None and not isinstance(costs, Costs):
        raise TypeError(f"costs must be a zbpp.schedules.Costs, got {type(costs).__name__}")
    if timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if loss_weight is not None and not callable(loss_weight):
        raise TypeError(f"loss_weight must be callable (target of one microbatch -> weight), got {type(loss_weight).__name__}")
    if not (seed is None or isinstance(seed, (bool, int))):
        raise TypeError(f"seed must be None, an int or a bool, got {type(seed).__name__}")


def check_stage_modules(stage_modules: Mapping[int, Any], schedule: Schedule, rank: int) -> None:
    """The stages given are exactly those `schedule` places on pipeline rank `rank`, as modules."""
    mine, given = schedule.stages_on(rank), sorted(stage_modules)
    if given != mine:
        raise ValueError(
            f"pipeline rank {rank} holds stages {mine} of schedule {schedule.name or 'custom'!r} "
            f"but stage_modules has {given}; pass exactly {{s: module for s in schedule.stages_on({rank})}}"
        )
    for s, m in stage_modules.items():
        if not isinstance(m, nn.Module):
            raise TypeError(f"stage {s}: expected an nn.Module, got {type(m).__name__}")
