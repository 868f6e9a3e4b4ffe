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

import contextlib
from typing import Any, Iterator

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


class ScaledStage(nn.Module):
    """A float32 stage (Linear, tanh but on the last) for float16-style loss scaling: stage 0 takes
    inputs of ~1e4 through weights shrunk 1e4-fold, so its weight gradients are ~5000x the other
    stages' and overflow float32 at loss scales where theirs do not."""

    def __init__(self, s: int, n: int) -> None:
        super().__init__()
        torch.manual_seed(200 + s)
        self.lin, self.last = nn.Linear(H, H), s == n - 1
        if s == 0:
            with torch.no_grad():
                self.lin.weight.mul_(1e-4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y if self.last else torch.tanh(y)


def _scaled_lr(s: int) -> float:
    """Adam moves each element by ~lr: stage 0's weights are ~1e-5, the others' ~0.3."""
    return 1e-7 if s == 0 else 1e-3


def _scaled_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, H, generator=g) * 1e4, torch.randn(8, H, generator=g)


def _new_scaler() -> Any:
    # scale 2**122: stage 0's largest weight gradient (900 to 1800 over these steps) overflows float32
    # (3.4e38) by >= 14x, the other stages' (<= 0.4) stay 1e2 below; backed off 64x (2**116) nothing
    # overflows (2.4x below). Growing back after every step taken: steps alternate overflow / none.
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 122, growth_factor=64.0, backoff_factor=1 / 64,
                                growth_interval=1)


def check_grad_scaler(name: str, agree: bool, steps: int = 4) -> dict[str, Any]:
    """float16-style training under `torch.amp.GradScaler` (float32 model, loss scaled in loss_fn)
    against one process running the whole model on the whole batch with one scaler, which skips
    the steps where any gradient overflows. `agree`: `zbpp.runtime.unscale_` after each step; else
    each rank's ``scaler.unscale_`` alone (plain torch). Returns each step's scale after
    ``update()`` on this rank and in the reference; with `agree`, parameters are compared too, and
    the collectives each `unscale_` posted are counted.

    Tolerance: float32, the pipeline sums per-microbatch gradients where the reference does one GEMM
    (~1e-6 relative); Adam moves an element by ~lr per step taken, so rtol 1e-5 with atol lr/1000
    tells a skipped step from a taken one by 1000x."""
    rank = dist.get_rank()
    sched = make_schedule(name, dist.get_world_size(), 4)
    n = sched.num_stages
    scaler, ref_scaler = _new_scaler(), _new_scaler()
    stages = {s: ScaledStage(s, n) for s in sched.stages_on(rank)}
    pipe = Pipeline(stages, sched, lambda out, y: scaler.scale(F.mse_loss(out, y)))
    opt = torch.optim.Adam([{"params": m.parameters(), "lr": _scaled_lr(s)} for s, m in stages.items()])
    ref = [ScaledStage(s, n) for s in range(n)]
    ref_opt = torch.optim.Adam([{"params": m.parameters(), "lr": _scaled_lr(s)} for s, m in enumerate(ref)])
    if not agree:  # torch's unscale_ asserts a scale, which only scale() sets: the loss's rank alone had one
        scaler.scale(torch.ones(()))
    scales, ref_scales, collectives = [], [], []
    for step in range(steps):
        x, y = _scaled_batch(step)
        opt.zero_grad()
        pipe.step(x, target=y)
        if agree:
            from zbpp.runtime import unscale_

            with _counting_collectives() as count:
                unscale_(pipe, scaler, opt)
            collectives.append(count[0])
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        ref_opt.zero_grad()
        h = x
        for m in ref:
            h = m(h)
        ref_scaler.scale(F.mse_loss(h, y)).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_scales.append(ref_scaler.get_scale())
        for s, m in stages.items() if agree else ():
            for (key, p), q in zip(m.named_parameters(), ref[s].parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=_scaled_lr(s) / 1000,
                                           msg=lambda e: f"{name} step {step} stage {s} {key}: {e}")
    return {"scales": scales, "reference": ref_scales, "collectives": collectives}


@contextlib.contextmanager
def _counting_collectives() -> Iterator[list[int]]:
    """Count the torch.distributed collectives posted inside the block (``count[0]``)."""
    count = [0]
    names = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier", "reduce_scatter")
    saved = {n: getattr(dist, n) for n in names}

    def counted(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return fn(*args, **kwargs)
        return call

    for n, fn in saved.items():
        setattr(dist, n, counted(fn))
    try:
        yield count
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def grad_scaler_refusals() -> list[str]:
    """`unscale_` where the ranks cannot agree, on 2 ranks: scalers of other scales, one enabled and
    one disabled, and a rank whose optimizer already stepped (torch's error there). Returns this
    rank's errors; the Pipeline steps on after each (no rank was left in a collective)."""
    from zbpp.runtime import unscale_

    rank = dist.get_rank()
    sched = make_schedule("1f1b", 2, 2)
    stages = {rank: ScaledStage(rank, 2)}
    pipe = Pipeline(stages, sched, lambda out, y: F.mse_loss(out, y))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    got = []
    for scaler, stepped in [(torch.amp.GradScaler("cpu", init_scale=2.0 ** (16 - 6 * rank)), False),
                            (torch.amp.GradScaler("cpu", enabled=rank == 0), False),
                            (torch.amp.GradScaler("cpu"), rank == 0)]:
        opt.zero_grad()
        pipe.step(*_scaled_batch(0))
        if stepped:
            scaler.scale(torch.ones(()))
            scaler.step(opt)
        try:
            unscale_(pipe, scaler, opt)
            got.append("no error")
        except Exception as exc:  # noqa: BLE001 - the test compares them
            got.append(f"{type(exc).__name__}: {exc}")
    pipe.step(*_scaled_batch(1))
    return got
