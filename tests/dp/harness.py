"""Helpers for the data-parallel tests: models, the single-process references, and a minimal
pipeline executor.

The executor follows the runtime's task semantics (F forward inside ``microbatch(key)``; B a full
autograd backward of the stage, delayed modules deferring their weight gradients; W ``backward_dw``
on each delayed module; BW both) and tells a `GradReducer` after each stage's last B and last W.
`zbpp.Pipeline` builds its reducer itself with the default bucket size; the executor lets a test
drive a reducer with tiny buckets (several per stage) through the same schedules.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from zbpp.modules import DelayedScaling, LayerNormMLP, Linear, current_microbatch, fp8_autocast, microbatch
from zbpp.runtime import ParallelGroups
from zbpp.schedules import Schedule
from zbpp.schedules.ir import Kind

from .doubles import KeyedLinear, TELikeLinear

H = 8  # feature width of every stage
MB = 2  # samples per microbatch


def make_groups(pp: int) -> ParallelGroups:
    return ParallelGroups(pp=pp)


# -- models -------------------------------------------------------------------------------------
class PlainBlock(nn.Module):
    """LayerNorm -> Linear -> gelu (tanh approximation, as LayerNormMLP) -> Linear, plus a
    parameter no computation uses (its gradient is None on every replica and must stay None, as in
    one process)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, H)
        self.fc2 = nn.Linear(H, H)
        self.spare = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(self.norm(x)), approximate="tanh"))


class MLPBlock(nn.Module):
    """The same computation as one `zbpp.modules.LayerNormMLP`."""

    NAMES = {
        "mlp.layer_norm_weight": "norm.weight",
        "mlp.layer_norm_bias": "norm.bias",
        "mlp.fc1_weight": "fc1.weight",
        "mlp.fc1_bias": "fc1.bias",
        "mlp.fc2_weight": "fc2.weight",
        "mlp.fc2_bias": "fc2.bias",
        "spare": "spare",
    }

    def __init__(self, plain: PlainBlock) -> None:
        super().__init__()
        self.mlp = LayerNormMLP(H, H, delay_wgrad_compute=True, params_dtype=torch.float64)
        self.spare = nn.Parameter(torch.ones(3, dtype=torch.float64))
        ref = dict(plain.named_parameters())
        with torch.no_grad():
            for mine, theirs in self.NAMES.items():
                self.get_parameter(mine).copy_(ref[theirs])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class Fp8Block(PlainBlock):
    """PlainBlock whose zbpp layers run their forward (and so their backward) in FP8."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = DelayedScaling(margin=0, amax_history_len=16, amax_compute_algo="max")
        with fp8_autocast(enabled=True, fp8_recipe=recipe):
            return super().forward(x)


class Fp8LastBlock(PlainBlock):
    """PlainBlock whose zbpp layers run in FP8 only in the step's last microbatch (`FP8_MICROBATCH`):
    their bias gradients come from W in the others, from B in that one."""

    FP8_MICROBATCH = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = current_microbatch()  # (stage, j) under Pipeline, j in the references
        j = key[1] if isinstance(key, tuple) else key
        recipe = DelayedScaling(margin=0, amax_history_len=16, amax_compute_algo="max")
        with fp8_autocast(enabled=j == self.FP8_MICROBATCH, fp8_recipe=recipe):
            return super().forward(x)


def _zbpp_linear(**kw: Any) -> Callable[[], nn.Module]:
    return lambda: Linear(H, H, delay_wgrad_compute=True, params_dtype=torch.float64, **kw)


#: model kind -> how fc1 / fc2 are built (None keeps nn.Linear; "mlp": one LayerNormMLP)
KINDS: dict[str, Any] = {
    "plain": None,
    "zbpp": _zbpp_linear(),
    "zbpp-fused": _zbpp_linear(fuse_wgrad_accumulation=True),
    "zbpp-mlp": "mlp",
    "zbpp-fp8": _zbpp_linear(fuse_wgrad_accumulation=True),  # in Fp8Block, float32
    "zbpp-fp8-last": _zbpp_linear(),  # in Fp8LastBlock, float32
    "eager-bias": lambda: KeyedLinear(H, H, fp8=True, fuse_wgrad_accumulation=True),
    "graph-replay": lambda: KeyedLinear(H, H, fire_hooks=False),
    "te": lambda: TELikeLinear(H, H),
}
FP8_KINDS = {"zbpp-fp8", "zbpp-fp8-last"}
FP8_BLOCKS = {"zbpp-fp8": "Fp8Block", "zbpp-fp8-last": "Fp8LastBlock"}


def dtype_of(kind: str) -> torch.dtype:
    return torch.float32 if kind in FP8_KINDS else torch.float64


def make_stage(stage: int, kind: str, device: str = "cpu") -> tuple[nn.Module, dict[str, str]]:
    """Stage `stage` of the model (the same values for every kind, seeded per stage) and the map
    from its parameter names to those of the plain reference block."""
    torch.manual_seed(1234 + stage)
    block = PlainBlock().double()
    factory = KINDS[kind]
    if factory == "mlp":
        mod = MLPBlock(block)
        return mod.to(device), dict(MLPBlock.NAMES)
    if factory is not None:
        if kind in FP8_KINDS:
            fp8_block = globals()[FP8_BLOCKS[kind]]().double()
            fp8_block.load_state_dict(block.state_dict())
            block = fp8_block
        for name in ("fc1", "fc2"):
            plain = getattr(block, name)
            layer = factory().double()
            layer.load_state_dict(plain.state_dict())
            setattr(block, name, layer)
    block = block.to(device=device, dtype=dtype_of(kind))
    return block, {n: n for n, _ in block.named_parameters()}


def batch(step: int, num_samples: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 batch (cast it for a float32 model; the reference keeps float64)."""
    g = torch.Generator().manual_seed(99 + step)
    x = torch.randn(num_samples, H, generator=g, dtype=torch.float64)
    y = torch.randn(num_samples, H, generator=g, dtype=torch.float64)
    return x.to(device), y.to(device)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


Grads = dict[str, "torch.Tensor | None"]


def reference_grads(num_stages: int, x: torch.Tensor, y: torch.Tensor) -> tuple[list[Grads], torch.Tensor]:
    """One process, whole plain model, whole batch: per stage {name: grad}, and the loss."""
    stages = [make_stage(s, "plain", str(x.device))[0] for s in range(num_stages)]
    out = x
    for st in stages:
        out = st(out)
    loss = loss_fn(out, y)
    loss.backward()
    grads = [{n: None if p.grad is None else p.grad.clone() for n, p in st.named_parameters()} for st in stages]
    return grads, loss.detach()


class ReplicaReference:
    """FP8's reference: one process runs the whole model replica by replica.

    FP8 scales follow each layer's amax history, so replica r's layers (same initial values, kept
    across steps like the pipeline's) see r's microbatches in the pipeline's order (every schedule
    here runs a stage's F and B in microbatch order); the result is the replicas' average as the
    reducer forms it (each replica's gradient divided by dp, then summed). ``main_grad`` is
    attached by hand here.
    """

    def __init__(self, num_stages: int, kind: str, dp: int, device: str = "cpu") -> None:
        self.kind, self.dp = kind, dp
        self.replicas = [[make_stage(s, kind, device)[0] for s in range(num_stages)] for _ in range(dp)]

    def grads(self, x: torch.Tensor, y: torch.Tensor, m: int) -> list[dict[str, torch.Tensor]]:
        per_replica = []
        for stages, xr, yr in zip(self.replicas, x.chunk(self.dp), y.chunk(self.dp)):
            for st in stages:
                st.zero_grad(set_to_none=True)
                for p in st.parameters():
                    p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            losses = []
            for j, (xb, yb) in enumerate(zip(xr.chunk(m), yr.chunk(m))):
                out = xb.to(dtype_of(self.kind))
                with microbatch(j):
                    for st in stages:
                        out = st(out)
                losses.append(loss_fn(out, yb.to(out.dtype)) / m)
            for loss in losses:
                loss.backward()
            for j in range(m):
                for st in stages:
                    _wgrad(st, j)
            per_replica.append(
                [{n: p.main_grad + (0 if p.grad is None else p.grad) for n, p in st.named_parameters()} for st in stages]
            )
        return [
            {n: sum(rep[s][n] / self.dp for rep in per_replica) for n in per_replica[0][s]}
            for s in range(len(per_replica[0]))
        ]


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


# -- a minimal pipeline executor ------------------------------------------------------------------
def _delayed(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if callable(getattr(m, "backward_dw", None))]


def _wgrad(module: nn.Module, key: int) -> None:
    for m in _delayed(module):
        if callable(getattr(m, "get_backward_dw_params", None)):
            m.backward_dw(key)
        else:
            m.backward_dw()  # Transformer Engine: FIFO (the schedules keep W in B order per stage)


def execute(
    sched: Schedule, modules: dict[int, nn.Module], groups: Any, reducer: Any, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor | None:
    """Run one step of `sched` on this pipeline rank; return the batch-mean loss on the last stage."""
    m, last = sched.num_microbatches, sched.num_stages - 1
    xs, ys = x.chunk(m), y.chunk(m)
    me = groups.pp_rank
    order = sched.orders[me]
    left_b = {s: sum(a.stage == s and a.kind in (Kind.B, Kind.BW) for a in order) for s in modules}
    left_w = {s: sum(a.stage == s and a.kind in (Kind.W, Kind.BW) for a in order) for s in modules}
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    local: dict[tuple[int, str, int], torch.Tensor] = {}
    sends = []
    losses = []

    def tag(dst: int, direction: str, j: int) -> int:
        return (dst * 2 + (direction == "b")) * 1000 + j

    def deliver(dst: int, direction: str, j: int, t: torch.Tensor) -> None:
        if sched.rank_of(dst) == me:
            local[(dst, direction, j)] = t
        else:
            t = t.detach().contiguous()
            sends.append((dist.isend(t, groups.pp_peer(sched.rank_of(dst)), tag=tag(dst, direction, j)), t))

    def receive(src: int, dst: int, direction: str, j: int) -> torch.Tensor:
        if sched.rank_of(src) == me:
            return local.pop((dst, direction, j))
        buf = torch.empty(xs[j].shape, dtype=x.dtype, device=x.device)
        dist.recv(buf, groups.pp_peer(sched.rank_of(src)), tag=tag(dst, direction, j))
        return buf

    reducer.start_step()
    for a in order:
        s, j = a.stage, a.microbatch
        if a.kind is Kind.F:
            inp = xs[j] if s == 0 else receive(s - 1, s, "f", j).detach().requires_grad_()
            with microbatch(j):
                out = modules[s](inp)
            if s == last:
                out = loss_fn(out, ys[j]) / m
                losses.append(out.detach())
            else:
                deliver(s + 1, "f", j, out)
            saved[(s, j)] = (inp, out)
            continue
        if a.kind in (Kind.B, Kind.BW):
            inp, out = saved.pop((s, j))
            out.backward() if s == last else out.backward(receive(s + 1, s, "b", j))
            if s > 0:
                deliver(s - 1, "b", j, inp.grad)
        if a.kind in (Kind.W, Kind.BW):
            _wgrad(modules[s], j)
        if a.kind in (Kind.B, Kind.BW):
            left_b[s] -= 1
            if left_b[s] == 0:
                reducer.stage_backward_done(s)
        if a.kind in (Kind.W, Kind.BW):
            left_w[s] -= 1
            if left_w[s] == 0:
                reducer.stage_wgrad_done(s)
    for work, _ in sends:
        work.wait()
    reducer.finish()
    return torch.stack(losses).sum() if losses else None
