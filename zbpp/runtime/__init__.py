"""zbpp.runtime: run a `zbpp.schedules.Schedule` across ranks with torch.distributed.

- `Pipeline`: one interpreter for every schedule (`pipeline.py`, `executor.py`), communication on
  one channel per direction at the points the schedule's plan gives (`zbpp.schedules.plan`,
  `channels.py`), the step's agreements (`agreement.py`), W tasks (`wgrad.py`).
- `ParallelGroups`: pipeline x data-parallel process groups (`groups.py`).
- `clip_grad_norm_`: gradient clipping by the norm over the whole pipeline (`clip.py`); data
  parallelism: `grad_reduce.py`.
- `init_distributed`: initialise torch.distributed from torchrun's environment with a timeout.
"""

from __future__ import annotations

from .clip import clip_grad_norm_
from .executor import PipelineError, ShapeMismatchError
from .groups import ParallelGroups
from .launch import init_distributed, shutdown_and_exit
from .pipeline import Pipeline
from .profiling import measured_bubble_rate

__all__ = [
    "Pipeline",
    "ParallelGroups",
    "PipelineError",
    "ShapeMismatchError",
    "clip_grad_norm_",
    "init_distributed",
    "measured_bubble_rate",
    "shutdown_and_exit",
]
