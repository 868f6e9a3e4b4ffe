"""One rank of a training step under torch's `_PipelineScheduleRuntime`, driven by a zbpp CSV.

Run as ``python torch_runtime_worker.py RANK WORLD STORE OUTDIR NUM_MICROBATCHES CSV...``. For each
CSV, every rank builds the same seeded model (one stage per rank), keeps its own stage, loads the
CSV with torch's ``_load_csv`` (which validates it and lowers it with ``_add_send_recv``), runs
one step on gloo and saves its stage's parameter gradients (and, on the last rank, the losses) to
``OUTDIR/rank{RANK}-{k}.pt`` for the k-th CSV. One process pair serves every CSV: starting
torch dominates the cost.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

DIM = 8
BATCH = 8


def make_model(num_stages: int) -> list[nn.Module]:
    """The whole model as `num_stages` stages; same weights on every process (seeded)."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM)) for _ in range(num_stages)]


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)  # mean over the microbatch


def main() -> None:
    rank, world, store, outdir, m, *csv_paths = sys.argv[1:]
    rank, world, m = int(rank), int(world), int(m)
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for k, csv_path in enumerate(csv_paths):
            module = make_model(world)[rank]
            stage = PipelineStage(module, rank, world, torch.device("cpu"))
            sched = _PipelineScheduleRuntime([stage], n_microbatches=m, loss_fn=loss_fn)
            sched._load_csv(csv_path, format="compute_only")
            x, y = make_batch()
            losses: list[torch.Tensor] = []
            if rank == 0:
                sched.step(x)
            elif rank == world - 1:
                sched.step(target=y, losses=losses)
            else:
                sched.step()
            grads = {name: p.grad.clone() for name, p in module.named_parameters()}
            torch.save({"grads": grads, "losses": [loss.detach() for loss in losses]}, f"{outdir}/rank{rank}-{k}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
