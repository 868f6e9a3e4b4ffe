"""Build torch.distributed.pipelining schedules without a process group (tests and benchmarks).

torch's schedule classes read only ``group_size``, ``group_rank``, ``num_stages`` and ``submod``
from their stages while generating the order, so stand-ins carrying those attributes let us
construct the real classes and read their ``pipeline_order`` (compute actions for every rank) on
one process. Used by tests/interop and benchmarks/bench_scheduler.py.
"""

from __future__ import annotations

import types
from typing import Any, Callable

from torch.distributed.pipelining import schedules as S

__all__ = ["fake_stages", "torch_schedule", "compute_only", "flatten_overlaps", "stage_to_rank", "lower_and_simulate",
           "TORCH_CLASSES"]

#: name -> (class, stages per rank)
TORCH_CLASSES: dict[str, tuple[type, int]] = {
    "1F1B": (S.Schedule1F1B, 1),
    "Interleaved1F1B": (S.ScheduleInterleaved1F1B, 1),
    "Interleaved1F1B-2": (S.ScheduleInterleaved1F1B, 2),
    "InterleavedZeroBubble": (S.ScheduleInterleavedZeroBubble, 1),
    "InterleavedZeroBubble-2": (S.ScheduleInterleavedZeroBubble, 2),
    "ZBVZeroBubble": (S.ScheduleZBVZeroBubble, 2),
    "DualPipeV": (S.ScheduleDualPipeV, 2),
}


def fake_stages(num_ranks: int, stages_per_rank: int) -> list[Any]:
    """Stand-ins for rank 0's `PipelineStage`s: only what order generation reads."""
    n = num_ranks * stages_per_rank
    return [
        types.SimpleNamespace(group_size=num_ranks, group_rank=0, num_stages=n, submod=None, stage_index=i)
        for i in range(stages_per_rank)
    ]


def torch_schedule(name: str, num_ranks: int, num_microbatches: int) -> Any:
    """An instance of torch's schedule class `name` (a key of TORCH_CLASSES), order generated."""
    cls, per_rank = TORCH_CLASSES[name]
    stages = fake_stages(num_ranks, per_rank)
    if cls is S.Schedule1F1B:
        return cls(stages[0], num_microbatches, loss_fn=None)
    return cls(stages, num_microbatches, loss_fn=None)


def stage_to_rank(sched: Any) -> Callable[[int], int]:
    """torch's stage -> rank mapping of a schedule instance, as a function."""
    mapping = getattr(sched, "stage_index_to_group_rank", None)
    if mapping is None:  # single-stage schedules: stage s on rank s
        return lambda s: s
    return lambda s: mapping[s]


def compute_only(pipeline_order: dict[int, list[Any]]) -> dict[int, list[Any]]:
    """Drop idle steps (None) and non-compute actions (e.g. 1F1B's REDUCE_GRAD)."""
    return {r: [a for a in acts if a is not None and a.is_compute_op] for r, acts in pipeline_order.items()}


def flatten_overlaps(actions: dict[int, list[Any]]) -> dict[int, list[Any]]:
    """OVERLAP_F_B cells replaced by their sub-actions, in order.

    torch's `_simulate_comms_compute` looks up the rank of such a cell's own stage index (-1) and
    fails, even on torch's DualPipeV, so its simulator is given the flat form.
    """
    return {r: [s for a in acts for s in (a.sub_actions if a.sub_actions is not None else (a,))] for r, acts in actions.items()}


def lower_and_simulate(actions: dict[int, list[Any]], to_rank: Callable[[int], int], num_stages: int) -> dict[int, list[Any]]:
    """torch's own lowering (`_add_send_recv`) then its step simulator; raises if it deadlocks."""
    lowered = S._add_send_recv({r: list(a) for r, a in actions.items()}, stage_to_rank=to_rank, num_stages=num_stages)
    return S._simulate_comms_compute(lowered, to_rank, num_stages)
