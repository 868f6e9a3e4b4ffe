"""torch.distributed.pipelining's schedules over stage modules: which stages a rank holds, and a step.

The benchmarks compare zbpp's schedules with torch's on the same stage modules; this module is the
torch side they share (``bench_pipeline.py``, ``bench_hf.py``'s pipeline mode). A schedule of
`LAYOUT` places two stages per rank: ``"loop"`` (interleaved) gives rank r stages r and r + p,
``"v"`` stages r and 2p - 1 - r; any other schedule one stage per rank (stage r).

>>> torch_num_stages("Schedule1F1B", 2), torch_stage_ids("Schedule1F1B", 1, 2)
(2, [1])
>>> torch_stage_ids("ScheduleInterleavedZeroBubble", 0, 2), torch_stage_ids("ScheduleZBVZeroBubble", 0, 2)
([0, 2], [0, 3])
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

# torch schedules with more than one stage per rank, and how they place them
LAYOUT = {"ScheduleInterleaved1F1B": "loop", "ScheduleLoopedBFS": "loop", "ScheduleInterleavedZeroBubble": "loop",
          "ScheduleZBVZeroBubble": "v", "ScheduleDualPipeV": "v"}


def torch_num_stages(name: str, p: int) -> int:
    """The stages of torch schedule `name` on `p` ranks."""
    return p * (2 if name in LAYOUT else 1)


def torch_stage_ids(name: str, rank: int, p: int) -> list[int]:
    """The stages rank `rank` of `p` holds under torch schedule `name`, in the order torch takes them."""
    kind = LAYOUT.get(name)
    if kind is None:
        return [rank]
    return [rank, rank + p] if kind == "loop" else [rank, 2 * p - 1 - rank]


def gloo_blocker(name: str, p: int) -> str | None:
    """Why torch schedule `name` cannot run on `p` gloo ranks with this torch, or None.

    Before torch 2.13 a schedule's first step opens each stage's links with a send to the next
    stage's rank and back, even where that is the stage's own rank (a V schedule's two middle
    stages), which gloo refuses; the rank that raises leaves its peer waiting in its own sends.
    Every rank answers the same, so all of them refuse before any communication.

    >>> gloo_blocker("Schedule1F1B", 2) is None
    True
    """
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.13":
        return None
    ranks = [torch_stage_ids(name, r, p) for r in range(p)]
    if not any(s + 1 in held for held in ranks for s in held):
        return None
    return (f"torch {torch.__version__}'s {name} sends between two stages of one rank as it starts, which "
            "gloo cannot do (torch 2.13 and later skip it): use NCCL or a newer torch")


class TorchPipeline:
    """One rank's side of torch schedule `name` over `modules` (stage index -> module, the stages
    `torch_stage_ids` gives this rank), `m` microbatches, `loss_fn(output, target)` per microbatch
    (torch scales the gradients by 1/m: they are those of the microbatch losses' mean)."""

    def __init__(self, name: str, modules: dict[int, nn.Module], p: int, device: torch.device, m: int,
                 loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        import torch.distributed.pipelining as tpp

        if not hasattr(tpp, name):
            raise ValueError(f"torch.distributed.pipelining has no schedule {name!r}")
        if torch.distributed.get_backend() == "gloo" and (blocker := gloo_blocker(name, p)) is not None:
            raise RuntimeError(blocker)
        self.num_stages = n = torch_num_stages(name, p)
        rank = torch.distributed.get_rank()
        ids = torch_stage_ids(name, rank, p)
        if sorted(modules) != sorted(ids):
            raise ValueError(f"{name} places stages {ids} on rank {rank}, got modules of stages {sorted(modules)}")
        self.modules = [modules[s] for s in ids]
        stages = [tpp.PipelineStage(modules[s], s, n, device) for s in ids]
        self.schedule = getattr(tpp, name)(stages if name in LAYOUT else stages[0], m, loss_fn=loss_fn)
        self.has_first, self.has_last = 0 in ids, n - 1 in ids

    def parameters(self) -> list[nn.Parameter]:
        return [q for mod in self.modules for q in mod.parameters()]

    def step(self, inputs: Any, target: Any) -> list[torch.Tensor] | None:
        """One training step; on the rank holding the last stage, each microbatch's loss (else None)."""
        losses: list[torch.Tensor] = []
        if isinstance(inputs, torch.Tensor):  # torch before 2.13 checks a stage's input strides too
            inputs = inputs.contiguous()
        self.schedule.step(*((inputs,) if self.has_first else ()),
                           **({"target": target, "losses": losses} if self.has_last else {}))
        return losses if self.has_last else None
