"""What every rank runs in test_grads.py: gradients and optimizer inputs of multi-rank runs (data
parallelism, V and interleaved placements, clipping, loss weights, no_sync, evaluation steps in
between) against one process running the whole model on the whole batch, per replica.

The model: a chain of float64 stages ``x + tanh(Linear(x))``. Tolerance: float64, ``rtol=1e-10,
atol=1e-12``: the pipeline sums per-microbatch gradients where the reference runs one batch; the
difference of summation order is ~1e-15 relative, so a logic error (a lost or doubled
contribution, a wrong weight) is orders of magnitude above the bound.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zbpp import Pipeline
from zbpp.modules import Linear as ZLinear
from zbpp.runtime import ParallelGroups

from .cases import make_schedule

H = 5
TOL = {"rtol": 1e-10, "atol": 1e-12}


class Block(nn.Module):
    """Stage `s`: torch.nn Linears (``kind="plain"``) or zbpp delayed-wgrad ones (``"zbpp"``), same values."""

    def __init__(self, s: int, kind: str = "plain") -> None:
        super().__init__()
        torch.manual_seed(100 + s)
        lin, extra = nn.Linear(H, H, dtype=torch.float64), nn.Linear(H, H, dtype=torch.float64)
        self.lin, self.extra = self._convert(lin, kind), self._convert(extra, kind)

    @staticmethod
    def _convert(lin: nn.Linear, kind: str) -> nn.Module:
        if kind == "zbpp":
            z = ZLinear(H, H, delay_wgrad_compute=True, params_dtype=torch.float64)
            z.load_state_dict(lin.state_dict())
            return z
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x)) + 0.5 * torch.tanh(self.extra(x))


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def data(step: int, rows: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(rows, H, generator=g, dtype=torch.float64), torch.randn(rows, H, generator=g, dtype=torch.float64)


def _named(stages: dict[int, nn.Module]) -> dict[str, nn.Parameter]:
    return {f"{s}.{n}": p for s, st in stages.items() for n, p in st.named_parameters()}


def averaged_reference(refs: list[list[nn.Module]], mine: dict[int, nn.Module]) -> dict[str, torch.Tensor | None]:
    """The average over replicas of the reference gradients of this rank's parameters (None where
    no replica has one)."""
    out: dict[str, torch.Tensor | None] = {}
    for s in mine:
        for n, _ in mine[s].named_parameters():
            gs = [dict(r[s].named_parameters())[n].grad for r in refs]
            present = [g for g in gs if g is not None]
            out[f"{s}.{n}"] = sum(present) / len(refs) if present else None
    return out


def check_close(what: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    if got is None or want is None:
        assert got is None and want is None, f"{what}: got {None if got is None else 'a tensor'}, want {None if want is None else 'a tensor'}"
        return
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}", **TOL)


def check_unfrozen_later(name: str, pp: int, kind: str) -> None:
    """A parameter frozen when the Pipeline is built and trained later (fine-tuning that unfreezes
    layers): with data parallelism its gradient must be averaged over the replicas."""
    groups = ParallelGroups(pp=pp)
    dp = groups.dp
    sched = make_schedule(name, pp, 2 * pp)
    n = sched.num_stages
    mine = sched.stages_on(groups.pp_rank)
    stages = {s: Block(s, kind) for s in mine}
    refs = [[Block(s) for s in range(n)] for _ in range(dp)]
    for st in [*stages.values(), *(b for r in refs for b in r)]:
        st.extra.weight.requires_grad_(False)
    pipe = Pipeline(stages, sched, mse, groups=groups)
    for step in range(2):
        if step == 1:
            for st in [*stages.values(), *(b for r in refs for b in r)]:
                st.extra.weight.requires_grad_(True)
        rows = 2 * sched.num_microbatches + 1
        x, y = data(step, rows, groups.dp_rank)
        pipe.step(x, target=y)
        for d, r in enumerate(refs):
            xd, yd = data(step, rows, d)
            h = xd
            for b in r:
                h = b(h)
            mse(h, yd).backward()
        want = averaged_reference(refs, stages)
        for key, p in _named(stages).items():
            check_close(f"{name} step {step} rank {dist.get_rank()} {key}", p.grad, want[key])
        for q in [*pipe.parameters(), *(q for r in refs for b in r for q in b.parameters())]:
            q.grad = None

