"""zbpp.runtime: run a `zbpp.schedules.Schedule` across ranks with torch.distributed.

- `Pipeline`: one interpreter for every schedule (`pipeline.py`, `executor.py`), communication on
  one channel per direction at the points the schedule's plan gives (`zbpp.schedules.plan`,
  `channels.py`), the step's agreements (`agreement.py`), W tasks (`wgrad.py`); `CommOptions`.
- `ParallelGroups`: pipeline x data-parallel process groups (`groups.py`).
- `clip_grad_norm_`: gradient clipping by the norm over the whole pipeline (`clip.py`); data
  parallelism: `grad_reduce.py`.
- `save_checkpoint` / `load_checkpoint`: DCP checkpoints keyed by the whole model's parameter
  names, loadable at any other layout (`checkpoint.py`); FSDP2 stages: `fsdp.py`.
- `init_distributed`: initialise torch.distributed from torchrun's environment with a timeout.
- `Replicated`: a value of a step's input or target that every microbatch gets whole (`tree.py`);
  `microbatch_seed`: the seed of each F task's random draws (`rng.py`).
"""

from __future__ import annotations

from .channels import CommOptions
from .checkpoint import load_checkpoint, save_checkpoint
from .clip import clip_grad_norm_
from .executor import PipelineError, ShapeMismatchError
from .groups import ParallelGroups
from .launch import init_distributed, shutdown_and_exit
from .pipeline import Pipeline
from .profiling import measured_bubble_rate
from .rng import microbatch_seed
from .tree import Replicated

__all__ = [
    "Pipeline",
    "ParallelGroups",
    "CommOptions",
    "PipelineError",
    "Replicated",
    "ShapeMismatchError",
    "clip_grad_norm_",
    "save_checkpoint",
    "load_checkpoint",
    "init_distributed",
    "measured_bubble_rate",
    "microbatch_seed",
    "shutdown_and_exit",
]
