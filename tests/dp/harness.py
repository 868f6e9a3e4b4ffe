"""Helpers for the data-parallel tests: spawn gloo ranks, stand-in groups, a minimal pipeline
executor, models and the single-process reference.

The executor follows issue 5's task semantics (F forward inside ``microbatch(key)``; B a full
autograd backward of the stage, delayed modules deferring their weight gradients; W ``backward_dw``
on each delayed module; BW both) and tells the reducer after each stage's last B and last W. It is
here so that the reducer is tested before the runtime's `Pipeline` exists; when `zbpp.Pipeline` is
importable the tests run through it instead (see `run_step`).
"""

from __future__ import annotations

import os
import pickle
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from zbpp.modules.context import microbatch
from zbpp.schedules import Schedule
from zbpp.schedules.ir import Kind

from .doubles import KeyedLinear, TELikeLinear

H = 8  # feature width of every stage
MB = 2  # samples per microbatch


# -- processes ----------------------------------------------------------------------------------
def _entry(rank: int, world: int, tmp: str, backend: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)  # 2 shared cores: do not oversubscribe
    out = os.path.join(tmp, f"rank{rank}.pkl")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout=timedelta(seconds=30)
        )
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException:  # report every rank's failure to the parent
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(out, "wb") as fh:
        pickle.dump(result, fh)


def spawn(fn: Callable[..., Any], world: int, tmp: str, *args: Any, backend: str = "gloo", timeout_s: float = 240) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on `world` fresh processes; return each rank's result.

    Raises with every failing rank's traceback, or when a rank does not finish within `timeout_s`.
    """
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, world, tmp, backend, fn, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()  # only the processes started here, by handle
        procs[r].join()
    results, errors = [], []
    for r in range(world):
        path = os.path.join(tmp, f"rank{r}.pkl")
        if not os.path.exists(path):
            errors.append(f"rank {r}: no result ({'timed out' if r in hung else 'exit code ' + str(procs[r].exitcode)})")
            continue
        with open(path, "rb") as fh:
            status, value = pickle.load(fh)
        if status == "error":
            errors.append(f"rank {r}:\n{value}")
        results.append(value)
    if errors:
        raise AssertionError("\n".join(errors))
    return results


# -- groups -------------------------------------------------------------------------------------
@dataclass
class StandInGroups:
    """The attributes of `ParallelGroups` the reducer and the executor use (global = dp_rank*pp + pp_rank)."""

    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    pp_group: Any
    dp_group: Any

    def pp_peer(self, pp_rank: int) -> int:
        return self.dp_rank * self.pp + pp_rank


def make_groups(pp: int) -> Any:
    """`zbpp.ParallelGroups(pp=pp)` when the runtime provides it, else the stand-in."""
    try:
        from zbpp.runtime.groups import ParallelGroups  # type: ignore[import-not-found]
    except ImportError:
        ParallelGroups = None
    if ParallelGroups is not None:
        return ParallelGroups(pp=pp)
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // pp
    pp_groups = [dist.new_group([d * pp + r for r in range(pp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * pp + r for d in range(dp)]) for r in range(pp)]
    return StandInGroups(pp, dp, rank % pp, rank // pp, pp_groups[rank // pp], dp_groups[rank % pp])


# -- models -------------------------------------------------------------------------------------
class PlainBlock(nn.Module):
    """LayerNorm -> Linear -> tanh -> Linear, plus a parameter no computation uses (its gradient is
    None on every replica and must stay None, as in one process)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, H)
        self.fc2 = nn.Linear(H, H)
        self.spare = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.norm(x))))


#: model kinds: how fc1 / fc2 are built (None keeps nn.Linear)
KINDS: dict[str, Callable[[], nn.Module] | None] = {
    "plain": None,
    "zbpp": lambda: KeyedLinear(H, H),
    "zbpp-fused": lambda: KeyedLinear(H, H, fuse_wgrad_accumulation=True),
    "fp8-bias": lambda: KeyedLinear(H, H, fp8=True, fuse_wgrad_accumulation=True),
    "graph-replay": lambda: KeyedLinear(H, H, fire_hooks=False),
    "te": lambda: TELikeLinear(H, H),
}


def make_stage(stage: int, kind: str, device: str = "cpu") -> nn.Module:
    """Stage `stage` of the model, float64, the same values for every kind (seeded per stage)."""
    torch.manual_seed(1234 + stage)
    block = PlainBlock().double()
    factory = KINDS[kind]
    if factory is not None:
        for name in ("fc1", "fc2"):
            plain = getattr(block, name)
            layer = factory().double()
            layer.load_state_dict(plain.state_dict())
            setattr(block, name, layer)
    return block.to(device)


def batch(step: int, num_samples: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99 + step)
    x = torch.randn(num_samples, H, generator=g, dtype=torch.float64)
    y = torch.randn(num_samples, H, generator=g, dtype=torch.float64)
    return x.to(device), y.to(device)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def reference_grads(num_stages: int, x: torch.Tensor, y: torch.Tensor) -> tuple[list[dict[str, torch.Tensor | None]], torch.Tensor]:
    """One process, whole plain model, whole batch: per stage {name: grad}, and the loss."""
    stages = [make_stage(s, "plain", str(x.device)) for s in range(num_stages)]
    out = x
    for st in stages:
        out = st(out)
    loss = loss_fn(out, y)
    loss.backward()
    grads = [{n: (None if p.grad is None else p.grad.detach().clone()) for n, p in st.named_parameters()} for st in stages]
    return grads, loss.detach()


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


def execute(sched: Schedule, modules: dict[int, nn.Module], groups: Any, reducer: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
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
