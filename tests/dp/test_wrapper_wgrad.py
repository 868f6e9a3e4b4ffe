"""A user's delayed-wgrad wrapper whose ``backward_dw`` computes a plain child's weight gradients.

Such a module (Transformer Engine style: ``backward_dw()``, no ``get_backward_dw_params``) owes its
W every parameter under it that no delayed module inside it answers for, not only its own: the
data-parallel reducer must reduce them after W. The reference is one process on the whole batch
with plain autograd (float64; rtol=1e-12: only the order of the sums differs).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zbpp.runtime.grad_reduce import GradReducer
from zbpp.runtime.wgrad import StageWgrad

from .doubles import TELikeLinear

RTOL = 1e-12  # float64; the replicas' average and the whole-batch sum differ only in summation order


class _DgradOnly(torch.autograd.Function):
    """``x @ w.T + b`` whose backward gives the input's gradient and files (x, g) for W."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, owner: "Wrapper"):
        ctx.save_for_backward(x, weight)
        ctx.owner = owner
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        ctx.owner.pending.append((x.detach(), g.detach()))
        return g @ weight, None, None, None


class Wrapper(nn.Module):
    """Holds no parameter itself: its child ``inner`` (a plain nn.Linear) has them, its W fills them.
    Its delayed child ``keyed`` (Transformer Engine style) answers for its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 3).double()
        self.keyed = TELikeLinear(3, 2).double()
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.keyed(_DgradOnly.apply(x, self.inner.weight, self.inner.bias, self))

    def backward_dw(self) -> None:
        x, g = self.pending.pop(0)
        for p, grad in ((self.inner.weight, g.t() @ x), (self.inner.bias, g.sum(0))):
            p.grad = grad if p.grad is None else p.grad + grad
        self.keyed.backward_dw()


def _models() -> tuple[Wrapper, nn.Sequential]:
    torch.manual_seed(0)
    wrapper = Wrapper()
    nn.init.normal_(wrapper.keyed.weight)
    plain = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).double()
    plain[0].load_state_dict(wrapper.inner.state_dict())
    plain[1].load_state_dict(wrapper.keyed.state_dict())
    return wrapper, plain


def owed_and_dp_grads() -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    """On each of 2 replicas: what W owes, then one ZB step (every B, then every W) on this replica's
    half of the batch; returns the names W owes and the reduced and reference gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapper, plain = _models()
    owed = StageWgrad(wrapper).wgrad_param_ids()
    names = sorted(n for n, p in wrapper.named_parameters() if id(p) in owed)
    reducer = GradReducer({0: wrapper}, SimpleNamespace(dp_size=world, dp_group=None))
    xs = torch.randn(world * 3, 2, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    reducer.start_step()
    for x in xs[rank::world]:
        wrapper(x).pow(2).sum().backward()
    reducer.stage_backward_done(0)
    for _ in xs[rank::world]:
        wrapper.backward_dw()
    reducer.stage_wgrad_done(0)
    reducer.finish()
    for x in xs:
        plain(x).pow(2).sum().backward()
    got = [p.main_grad if getattr(p, "main_grad", None) is not None else p.grad for p in wrapper.parameters()]
    return names, got, [p.grad / world for p in plain.parameters()]


def test_a_wrappers_w_owes_its_plain_childs_parameters(zbpp_workers) -> None:
    for names, got, want in zbpp_workers(2).run(owed_and_dp_grads):
        # inner's gradients used to be reduced at the last B, before W filled them: each replica
        # kept its own half's gradient instead of the average
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=RTOL, atol=0)
        assert names == ["inner.bias", "inner.weight", "keyed.bias", "keyed.weight"]
