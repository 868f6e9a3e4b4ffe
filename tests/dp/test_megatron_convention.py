"""GradReducer with parameters that follow the Megatron / Transformer Engine ``main_grad`` convention.

An eager layer with gradient-accumulation fusion (Megatron's ``gradient_accumulation_fusion``,
TE's ``fuse_wgrad_accumulation``) adds its weight gradient straight into ``weight.main_grad`` during
backward; when the parameter carries ``grad_added_to_main_grad`` (Megatron's DDP creates it) the
layer sets it and hands autograd a placeholder gradient: ``torch.empty`` (garbage, which the
reduction must drop, never add) or, when the parameter has ``zero_out_wgrad`` (Megatron sets it on
a weight shared with an embedding), zeros, so that the hook adds ``.grad``: it then holds the
other uses' real gradient. Without the attribute the layer hands autograd None.

The reference is plain autograd on the same float64 weights; the only difference is the order of
accumulation over microbatches (and the exact halving of the replica average), so rtol=1e-12.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zbpp.runtime.grad_reduce import GradReducer

RTOL = 1e-12
GARBAGE = float("nan")  # stands for torch.empty's uninitialised placeholder: added anywhere, it shows


class _FusedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, module: "FusedLinear"):
        ctx.save_for_backward(x)
        ctx.module = module
        out = x @ weight.t()
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        (x,) = ctx.saved_tensors
        weight = ctx.module.weight
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        weight.main_grad.add_(g2.t() @ x2)  # the fused wgrad GEMM accumulates into main_grad
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            if getattr(weight, "zero_out_wgrad", False):
                placeholder = torch.zeros_like(weight)
            else:
                placeholder = torch.full_like(weight, GARBAGE)
        else:
            placeholder = None
        bias_grad = g2.sum(0) if ctx.module.bias is not None else None
        return g @ weight.detach(), placeholder, bias_grad, None


class FusedLinear(nn.Module):
    """An eager (not delayed) Linear with Megatron's gradient-accumulation fusion. `weight` may be
    shared with another module (a tied embedding)."""

    def __init__(self, n_in: int, n_out: int, *, bias: bool = True, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight if weight is not None else nn.Parameter(torch.randn(n_out, n_in, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(n_out, dtype=torch.float64)) if bias else None
        self.fuse_wgrad_accumulation = True  # TE's flag: the reducer gives these parameters a main_grad
        self.fused = True  # False: plain autograd (the weight gradient arrives through .grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return F.linear(x, self.weight, self.bias)
        return _FusedLinearFn.apply(x, self.weight, self.bias, self)


def _megatron_init(*modules: nn.Module) -> None:
    """What Megatron's DDP does to every parameter: the flag the fused layers look for."""
    for mod in modules:
        for p in mod.parameters():
            p.grad_added_to_main_grad = False


def _microbatches(n: int, rows: int = 3, width: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, width, generator=g, dtype=torch.float64) for _ in range(n)]


def _plain_copy(layer: FusedLinear) -> nn.Linear:
    ref = nn.Linear(layer.weight.shape[1], layer.weight.shape[0], bias=layer.bias is not None).double()
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
        if layer.bias is not None:
            ref.bias.copy_(layer.bias)
    return ref


def _one_stage_step(reducer: GradReducer, layer: nn.Module, xs: list[torch.Tensor]) -> None:
    reducer.start_step()
    for x in xs:  # the B of each microbatch (eager: weight gradients during B, nothing for W)
        layer(x).pow(2).sum().backward()
    reducer.stage_backward_done(0)
    reducer.stage_wgrad_done(0)
    reducer.finish()


@pytest.mark.parametrize("flag", [True, False], ids=["grad_added_to_main_grad", "no-flag"])
def test_fused_eager_layer_placeholder_is_dropped_never_added(flag: bool) -> None:
    torch.manual_seed(0)
    layer = FusedLinear(4, 3)
    if flag:
        _megatron_init(layer)
    ref = _plain_copy(layer)
    reducer = GradReducer({0: layer}, None)
    assert layer.weight.main_grad.dtype == torch.float64
    for step in range(2):  # the second step proves start_step zeroes main_grad and resets the flag
        xs = _microbatches(3, seed=step)
        _one_stage_step(reducer, layer, xs)
        ref.zero_grad(set_to_none=True)
        for x in xs:
            ref(x).pow(2).sum().backward()
        torch.testing.assert_close(layer.weight.main_grad, ref.weight.grad, rtol=RTOL, atol=0)
        torch.testing.assert_close(layer.bias.main_grad, ref.bias.grad, rtol=RTOL, atol=0)
        assert layer.weight.grad is None and layer.bias.grad is None  # moved or dropped, never left
        if flag:
            assert layer.weight.grad_added_to_main_grad and not layer.bias.grad_added_to_main_grad
    assert set(reducer.reduce_counts().values()) == {1}


def test_the_flag_is_reset_every_step() -> None:
    """A step with the fused path sets grad_added_to_main_grad; the next step computes the weight
    gradient through plain autograd (fusion switched off), which must be added, not dropped."""
    torch.manual_seed(0)
    layer = FusedLinear(4, 3)
    _megatron_init(layer)
    ref = _plain_copy(layer)
    reducer = GradReducer({0: layer}, None)
    _one_stage_step(reducer, layer, _microbatches(2, seed=0))
    assert layer.weight.grad_added_to_main_grad
    layer.fused = False
    xs = _microbatches(2, seed=1)
    _one_stage_step(reducer, layer, xs)
    for x in xs:
        ref(x).pow(2).sum().backward()
    torch.testing.assert_close(layer.weight.main_grad, ref.weight.grad, rtol=RTOL, atol=0)


class _Embed(nn.Module):
    """Stage 0 of a V rank: token embedding with the weight the head (stage 3) shares."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


@pytest.mark.parametrize("same_backward", [False, True], ids=["stage-by-stage", "one-backward"])
def test_tied_weight_with_zero_out_wgrad_keeps_the_embedding_gradient(same_backward: bool) -> None:
    """V placement: stages 0 (embedding) and 3 (fused head) of one rank share a weight with
    ``zero_out_wgrad``. The head adds its gradient into main_grad and returns zeros; the
    embedding's gradient arrives through ``.grad`` and must be added although the flag is set."""
    torch.manual_seed(0)
    vocab, hidden = 5, 4
    shared = nn.Parameter(torch.randn(vocab, hidden, dtype=torch.float64))
    shared.zero_out_wgrad = True  # Megatron: a weight shared by embedding and output layer
    embed, head = _Embed(shared), FusedLinear(hidden, vocab, bias=False, weight=shared)
    _megatron_init(embed, head)
    reducer = GradReducer({0: embed, 3: head}, None)
    ref_weight = nn.Parameter(shared.detach().clone())
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (3,), generator=g) for _ in range(2)]
    reducer.start_step()
    for ids in batches:
        if same_backward:  # both uses in one autograd graph: autograd sums zeros + the embedding's grad
            head(torch.tanh(embed(ids))).pow(2).sum().backward()
        else:  # as the runtime runs them: B of stage 3, then B of stage 0 from the gradient it sent
            h = torch.tanh(embed(ids))
            h_in = h.detach().requires_grad_()
            head(h_in).pow(2).sum().backward()
            h.backward(h_in.grad)
        ref_out = F.embedding(ids, ref_weight)
        (torch.tanh(ref_out) @ ref_weight.t()).pow(2).sum().backward()
    for stage in (3, 0):
        reducer.stage_backward_done(stage)
        reducer.stage_wgrad_done(stage)
    reducer.finish()
    assert reducer.reduce_counts() == {"stage 0 'weight'": 1}
    torch.testing.assert_close(shared.main_grad, ref_weight.grad, rtol=RTOL, atol=0)
    assert shared.grad is None


def replicas_with_fused_layers() -> list[float]:
    """dp=2 (one pipeline stage per replica): each replica runs its half of the microbatches through
    fused layers; after `finish` every main_grad is the whole batch's mean gradient."""
    import torch.distributed as dist

    from zbpp.runtime import ParallelGroups

    groups = ParallelGroups(pp=1)
    torch.manual_seed(0)  # the same weights on both replicas
    model = nn.Sequential(FusedLinear(4, 4), nn.Tanh(), FusedLinear(4, 2))
    _megatron_init(model)
    ref = nn.Sequential(_plain_copy(model[0]), nn.Tanh(), _plain_copy(model[2]))
    reducer = GradReducer({0: model}, groups, bucket_size_mb=40 / 2**20)  # a few buckets
    worst = []
    for step in range(2):
        xs = _microbatches(4, seed=10 + step)
        mine = xs[groups.dp_rank * 2 : groups.dp_rank * 2 + 2]
        reducer.start_step()
        for x in mine:
            model(x).pow(2).sum().backward()
        reducer.stage_backward_done(0)
        reducer.stage_wgrad_done(0)
        reducer.finish()
        ref.zero_grad(set_to_none=True)
        for x in xs:
            (ref(x).pow(2).sum() / groups.dp).backward()  # the replica average of per-replica sums
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.main_grad, q.grad, rtol=RTOL, atol=0, msg=lambda m: f"{name}: {m}")
            assert p.grad is None, name
            worst.append(float((p.main_grad - q.grad).abs().max()))
    assert dist.get_world_size() == 2
    return worst


def test_data_parallel_reduction_of_fused_layers_main_grad(zbpp_workers) -> None:
    worst = zbpp_workers(2).run(replicas_with_fused_layers)
    assert max(max(w) for w in worst) < 1e-9  # the real bound is rtol=1e-12 per tensor, inside
