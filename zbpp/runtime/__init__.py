"""zbpp.runtime: run a `zbpp.schedules.Schedule` across ranks with torch.distributed.

- `Pipeline`: the step (`pipeline.py`, its arguments checked in `arguments.py`, its input in
  `step_input.py`, the microbatches' loss factors in `loss_weights.py`), one interpreter for every
  schedule with each task written once (`executor.py`), run eagerly or replayed from CUDA graphs
  (`task_graphs.py`), its queue of sends and receives at the points the schedule's program gives
  (`comm_queue.py`, `zbpp.schedules.program`) on one channel per direction (`channels.py`), the
  step's failure record (`failure.py`) and agreements (`agreement.py`), every reduction of the
  gradients behind one object (`reductions.py`: gradients of earlier steps kept apart in
  `grad_aside.py`, data parallelism in `grad_reduce.py` or `fsdp.py`, tied parameters in
  `tied.py`), W tasks (`wgrad.py`); `PipelineError`, `ShapeMismatchError` and `GraphCaptureError`
  (`errors.py`).
- `ParallelGroups`: pipeline x data-parallel process groups (`groups.py`).
- `clip_grad_norm_`: gradient clipping by the norm over the whole pipeline (`clip.py`).
- `unscale_`: a float16 run's ``GradScaler.unscale_`` with found-inf flags agreed over the job (`amp.py`).
- `save_checkpoint` / `load_checkpoint`: DCP checkpoints keyed by the whole model's parameter
  names, loadable at any other layout (`checkpoint.py`); FSDP2 stages: `fsdp.py`.
- `init_distributed`: initialise torch.distributed from torchrun's environment with a timeout.
- `Replicated`: a value of a step's input or target that every microbatch gets whole (`tree.py`);
  `microbatch_seed`: the seed of each F task's random draws (`rng.py`).
"""

from __future__ import annotations

from .amp import unscale_
from .checkpoint import load_checkpoint, save_checkpoint
from .clip import clip_grad_norm_
from .errors import GraphCaptureError, PipelineError, ShapeMismatchError
from .groups import ParallelGroups
from .launch import init_distributed, shutdown_and_exit
from .pipeline import Pipeline
from .task_times import measured_bubble_rate
from .rng import microbatch_seed
from .tree import Replicated

__all__ = [
    "Pipeline",
    "ParallelGroups",
    "GraphCaptureError",
    "PipelineError",
    "Replicated",
    "ShapeMismatchError",
    "clip_grad_norm_",
    "unscale_",
    "save_checkpoint",
    "load_checkpoint",
    "init_distributed",
    "measured_bubble_rate",
    "microbatch_seed",
    "shutdown_and_exit",
]
