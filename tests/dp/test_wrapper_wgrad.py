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


def no_sync_window_grads() -> list[tuple[str, bool, torch.Tensor, torch.Tensor]]:
    """On each of 2 replicas (pp=1): one step inside ``no_sync()``, then a synchronised one, through a
    `Pipeline`, with the wrapper's child's parameters in ``.grad`` and then in a ``main_grad`` attached
    beforehand (Megatron's convention). Returns (name, has .grad beside a main_grad, got, reference)."""
    from zbpp import Pipeline
    from zbpp.runtime import ParallelGroups
    from zbpp.schedules import build

    groups = ParallelGroups(pp=1)
    gen = torch.Generator().manual_seed(2)
    batches = [tuple(torch.randn(8, n, generator=gen, dtype=torch.float64) for n in (4, 2)) for _ in range(2)]
    rows = slice(4 * groups.dp_rank, 4 * groups.dp_rank + 4)
    out = []
    for attach in (False, True):
        wrapper, plain = _models()
        if attach:
            for p in wrapper.inner.parameters():
                p.main_grad = torch.zeros_like(p)
        pipe = Pipeline({0: wrapper}, build("zb-h1", num_ranks=1, num_microbatches=2),
                        loss_fn=torch.nn.functional.mse_loss, groups=groups)
        with pipe.no_sync():
            pipe.step(batches[0][0][rows], target=batches[0][1][rows])
        pipe.step(batches[1][0][rows], target=batches[1][1][rows])
        for x, y in batches:  # the whole batch of every replica, in one process
            torch.nn.functional.mse_loss(plain(x), y).backward()
        for (name, p), q in zip(wrapper.named_parameters(), plain.parameters()):
            main = getattr(p, "main_grad", None)
            got = main if main is not None else p.grad
            out.append((f"{name} attach={attach}", main is not None and p.grad is not None, got, q.grad))
    return out


def test_a_no_sync_window_with_a_wrapper_that_replaces_grad(zbpp_workers) -> None:
    # the wrapper's backward_dw accumulates with ``p.grad = p.grad + g`` (a new tensor): the step after
    # the window used to add the window's gradient once more into .grad, and to put a stale .grad back
    # beside a main_grad that already held it
    for rank in zbpp_workers(2).run(no_sync_window_grads):
        for name, both, got, want in rank:
            assert not both, f"{name}: a .grad left beside its main_grad"
            torch.testing.assert_close(got, want, rtol=RTOL, atol=0, msg=name)
