"""What every rank runs in the tests of the runtime's features beyond a training step: eval_step,
per-microbatch losses, gradient accumulation and no_sync, tied parameters, a DeviceMesh.

The model is a tiny float64 language model whose token embedding (stage 0) is tied to the LM head
(the last stage): ``logits = h @ wte.T``. Middle layers are plain or zbpp delayed-wgrad Linears.
The reference is one process running the whole model on the whole batch with ONE embedding
Parameter used by both ends, so its gradient is the sum of both uses.

Tolerance: float64, ``rtol=1e-10, atol=1e-12``: the pipeline sums per-microbatch gradients where the
reference does one GEMM over the batch; in float64 the difference of summation order is ~1e-15
relative, so any logic error (a lost use of the tied weight, a double reduction, a wrong
microbatch) is many orders of magnitude above the bound.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zbpp import Pipeline
from zbpp.modules import Linear as ZLinear
from zbpp.runtime import ParallelGroups, clip_grad_norm_
from zbpp.schedules import Schedule

from .cases import collector_sees_new_objects_only, make_schedule

V, H = 11, 6  # vocabulary, width
TOL = {"rtol": 1e-10, "atol": 1e-12}


class Stage(nn.Module):
    """Stage `s` of `n`: the embedding lookup (s == 0), a residual tanh layer, the tied head (last)."""

    def __init__(self, s: int, n: int, kind: str, wte: nn.Parameter | None) -> None:
        super().__init__()
        self.first, self.last = s == 0, s == n - 1
        torch.manual_seed(100 + s)
        lin = nn.Linear(H, H, dtype=torch.float64)
        if kind == "zbpp":
            z = ZLinear(H, H, delay_wgrad_compute=True, params_dtype=torch.float64)
            z.load_state_dict(lin.state_dict())
            lin = z
        self.lin = lin
        if self.first or self.last:
            assert wte is not None
            self.wte = wte  # the same Parameter object when one rank holds both ends

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = F.embedding(x, self.wte)
        x = x + torch.tanh(self.lin(x))
        return x @ self.wte.t() if self.last else x


def make_wte(value: float | None = None) -> nn.Parameter:
    torch.manual_seed(7)
    w = torch.randn(V, H, dtype=torch.float64)
    return nn.Parameter(torch.full_like(w, value) if value is not None else w)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target)


def batch(step: int, rows: int, replica: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randint(0, V, (rows,), generator=g), torch.randint(0, V, (rows,), generator=g)


def reference(n: int, kind: str = "plain") -> tuple[list[Stage], nn.Parameter]:
    wte = make_wte()
    return [Stage(s, n, kind, wte) for s in range(n)], wte


def run_reference(stages: list[Stage], x: torch.Tensor, y: torch.Tensor, backward: bool = True) -> torch.Tensor:
    h: Any = x
    for st in stages:
        h = st(h)
    loss = loss_fn(h, y)
    if backward:
        loss.backward()
    return loss.detach()


def build(sched: Schedule, pp_rank: int, kind: str, *, skew_copies: bool = True, groups: Any = None,
          keep_grads_on_failure: bool = True, cuda_graphs: Any = False) -> tuple[Pipeline, dict[int, Stage]]:
    """This rank's stages and Pipeline. Copies of the tied weight on ranks other than stage 0's start
    as zeros (`skew_copies`): construction must make them equal to stage 0's. `cuda_graphs`: e.g.
    `StandInGraphs` (task graphs' fixed ``.grad`` buffers on CPUs)."""
    n = sched.num_stages
    mine = sched.stages_on(pp_rank)
    wte = None
    if 0 in mine or n - 1 in mine:
        wte = make_wte(None if (0 in mine or not skew_copies) else 0.0)
    stages = {s: Stage(s, n, kind, wte if s in (0, n - 1) else None) for s in mine}
    tied = {"wte": wte} if wte is not None else None
    return Pipeline(stages, sched, loss_fn, tied_parameters=tied, groups=groups,
                    keep_grads_on_failure=keep_grads_on_failure, cuda_graphs=cuda_graphs), stages


def _named(stages: dict[int, Stage]) -> dict[str, nn.Parameter]:
    out: dict[str, nn.Parameter] = {}
    for s, st in stages.items():
        for name, p in st.named_parameters(remove_duplicate=False):
            out[f"{s}.{name}"] = p
    return out


def check_grads(stages: dict[int, Stage], ref: list[Stage], scale: float = 1.0, what: str = "") -> None:
    refs = {f"{s}.{n}": p for s in stages for n, p in ref[s].named_parameters(remove_duplicate=False)}
    for key, p in _named(stages).items():
        want = refs[key].grad
        torch.testing.assert_close(p.grad, want * scale, msg=lambda m: f"{what} {key}: {m}", **TOL)


def check_tied_training(name: str, p: int, kind: str, steps: int = 3) -> list[str]:
    """Tied weight: equal at construction, summed gradients after each step, equal copies after SGD."""
    rank = dist.get_rank()
    m = 2 * p
    sched = make_schedule(name, p, m)
    pipe, stages = build(sched, rank, kind)
    ref, _ = reference(sched.num_stages)
    ref_opt = torch.optim.SGD(avg_params(ref), lr=0.5)  # the shared weight once
    opt = torch.optim.SGD(list(pipe.parameters()), lr=0.5)
    for st_i, st in stages.items():
        if hasattr(st, "wte"):
            torch.testing.assert_close(st.wte.detach(), ref[st_i].wte.detach(), rtol=0, atol=0)
    for step in range(steps):
        x, y = batch(step, 2 * m + 1)
        loss = pipe.step(x, target=y)
        ref_loss = run_reference(ref, x, y)
        if pipe.holds_last_stage:
            torch.testing.assert_close(loss, ref_loss, **TOL)
        check_grads(stages, ref, what=f"{name} p={p} {kind} step {step}")
        # the norm over the whole model counts the tied weight once, as the one-process model does
        norm = clip_grad_norm_(pipe, 1e9)
        want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(q.grad) for q in avg_params(ref)]))
        torch.testing.assert_close(norm, want, **TOL)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for s, st in stages.items():
        for n_, q in st.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(q.detach(), dict(ref[s].named_parameters(remove_duplicate=False))[n_].detach(), **TOL)
    return pipe._tied.names


def check_eval_and_losses(name: str, p: int, kind: str) -> Any:
    """eval_step's outputs and loss, and step's per-microbatch losses, against one process."""
    rank = dist.get_rank()
    m = 2 * p
    sched = make_schedule(name, p, m)
    pipe, stages = build(sched, rank, kind, skew_copies=False)
    ref, _ = reference(sched.num_stages)
    x, y = batch(0, 2 * m + 1)
    out = pipe.eval_step(x)
    loss = pipe.eval_step(x, target=y)
    assert all(q.grad is None for q in pipe.parameters()), "eval_step touched a gradient"
    with torch.no_grad():
        ref_loss = run_reference(ref, x, y, backward=False)
        h: Any = x
        for st in ref:
            h = st(h)
    if pipe.holds_last_stage:
        torch.testing.assert_close(out, h, **TOL)
        torch.testing.assert_close(loss, ref_loss, **TOL)
    else:
        assert out is None and loss is None
    losses: list[torch.Tensor] = []
    pipe.step(x, target=y, losses=losses)
    if pipe.holds_last_stage:
        want = [loss_fn(part, t) for part, t in zip(torch.tensor_split(h, m), torch.tensor_split(y, m))]
        assert len(losses) == m
        for got, exp in zip(losses, want):
            torch.testing.assert_close(got, exp, **TOL)
        return [float(v) for v in losses]
    assert losses == []
    return None


def check_accumulation(name: str, p: int, kind: str) -> None:
    """k steps without zeroing accumulate the sum of the k batch-mean gradients (as autograd would)."""
    rank = dist.get_rank()
    sched = make_schedule(name, p, 2 * p)
    pipe, stages = build(sched, rank, kind, skew_copies=False)
    ref, _ = reference(sched.num_stages)
    for step in range(3):
        x, y = batch(step, 4 * p)
        pipe.step(x, target=y)
        run_reference(ref, x, y)  # .grad accumulates the same way
    check_grads(stages, ref, what=f"{name} accumulated")


def check_no_cyclic_garbage(name: str, p: int, kind: str) -> int:
    """Training and evaluation steps leave no reference cycles: every activation, gradient and
    message buffer is freed by reference counting as soon as its last user drops it, never by a
    later garbage collection (a step's memory is what the plan says, and a training loop may pause
    the collector without leaking). The collector is paused for three steps (two training, one
    evaluation); `gc.collect()` then finds nothing unreachable. (A cycle made once per step in the
    executor fails this with 3 objects.)"""
    with collector_sees_new_objects_only():
        return _cycles_of_three_steps(name, p, kind)


def _cycles_of_three_steps(name: str, p: int, kind: str) -> int:
    import gc

    rank = dist.get_rank()
    sched = make_schedule(name, p, 2 * p)
    pipe, _ = build(sched, rank, kind)
    x, y = batch(0, 4 * p)
    pipe.step(x, target=y)  # the first step sets up what later steps reuse
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for step in range(3):
            x, y = batch(step, 4 * p)
            pipe.step(x, target=y) if step != 1 else pipe.eval_step(x, target=y)
        found = gc.collect()
    finally:
        if was_enabled:
            gc.enable()
    assert found == 0, f"{name}/{kind} rank {rank}: {found} objects left in reference cycles by three steps"
    return found


def check_data_parallel(name: str, pp: int, kind: str, *, mesh: bool = False, no_sync: bool = False) -> dict[str, int]:
    """dp = world / pp replicas on different data, with the tied weight: gradients are the average
    over replicas of (the sum over steps of) each replica's batch-mean gradients. With `no_sync`,
    two steps inside no_sync() then one outside; with `mesh`, groups is a DeviceMesh."""
    world = dist.get_world_size()
    dp = world // pp
    if mesh:
        from torch.distributed.device_mesh import init_device_mesh

        groups: Any = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
        pp_rank, replica = groups.get_local_rank("pp"), groups.get_local_rank("dp")
    else:
        groups = ParallelGroups(pp=pp)
        pp_rank, replica = groups.pp_rank, groups.dp_rank
    sched = make_schedule(name, pp, 2 * pp)
    pipe, stages = build(sched, pp_rank, kind, groups=groups)
    refs = [reference(sched.num_stages)[0] for _ in range(dp)]
    steps = 3 if no_sync else 1
    for step in range(steps):
        x, y = batch(step, 4 * pp, replica)
        if no_sync and step < steps - 1:
            with pipe.no_sync():
                pipe.step(x, target=y)
        else:
            pipe.step(x, target=y)
        for d, r in enumerate(refs):
            run_reference(r, *batch(step, 4 * pp, d))
    # the average of the replicas' reference gradients
    avg = refs[0]
    for d in range(1, dp):
        for q, other in zip(avg_params(avg), avg_params(refs[d])):
            q.grad = q.grad + other.grad
    for q in avg_params(avg):
        q.grad = q.grad / dp
    check_grads(stages, avg, what=f"{name} dp={dp} {'mesh' if mesh else 'groups'} no_sync={no_sync}")
    counts = pipe.reducer.reduce_counts() if pipe.reducer is not None else {}
    return counts


def avg_params(stages: list[Stage]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for st in stages:
        for q in st.parameters():
            if id(q) not in seen:
                seen.add(id(q))
                out.append(q)
    return out
