"""Random numbers under a pipeline that do not depend on the schedule.

Each F task runs its stage with the CPU generator and the pipeline device's generator seeded from
``microbatch_seed(base, step, stage, microbatch, replica)``, and the generators' states from before
the task are restored after it (`torch.random.fork_rng`): dropout masks and other draws of stage s
on microbatch j are the same whatever order the schedule runs the tasks in, and the caller's random
stream is untouched by a step. Activation checkpointing recomputes a forward under the state it saved
(torch's ``preserve_rng_state``), so the recompute draws what the F drew.

To reproduce a pipeline's step in one process, run stage s on microbatch j after
``torch.manual_seed(microbatch_seed(base, step, s, j, replica))``.

The draws follow the stage and the microbatch, not the layer or the row: another schedule or
placement of the same stages draws the same masks (a checkpoint resumed there too: `rng_step` and
the base seed come back), but another stage split, number of microbatches or of replicas draws
other ones.

>>> a = microbatch_seed(1234, 0, 1, 2)
>>> a == microbatch_seed(1234, 0, 1, 2), a != microbatch_seed(1234, 0, 2, 1), 0 <= a < 2**63
(True, True, True)
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["microbatch_seed", "seeded"]

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def microbatch_seed(base: int, step: int, stage: int, microbatch: int, replica: int = 0) -> int:
    """The seed of stage `stage`'s forward on `microbatch` in the `step`-th step (counted from 0 by
    each `Pipeline`: training and evaluation steps, not those that raised `PipelineError`) of
    data-parallel `replica`, from the base seed."""
    h = _mix(int(base) & _MASK)
    for v in (step, replica, stage, microbatch):
        h = _mix(h ^ (int(v) & _MASK))
    return h >> 1  # torch.manual_seed takes any 64-bit value; 63 bits keep it a non-negative int64


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run the body with the CPU generator and `device`'s generator seeded with `seed`; restore both
    generators' states afterwards."""
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[], device_type="cuda"):
            torch.default_generator.manual_seed(seed)
            yield
        return
    index = device.index if device.index is not None else getattr(torch, device.type).current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.default_generators[index].manual_seed(seed)
        else:  # other accelerators: their own seeding (all of their devices)
            getattr(torch, device.type).manual_seed_all(seed)
        yield
