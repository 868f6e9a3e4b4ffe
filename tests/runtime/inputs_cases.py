"""What every rank runs in the tests of inputs and losses as Hugging Face passes them: shared
``[1, T]`` tensors and `Replicated` values, a token-mean loss over a right-padded batch
(``loss_weight``), and dropout under seeded per-(stage, microbatch) generators.

The model is a tiny float64 language model: stage 0 embeds ``ids`` and adds a positional embedding
of ``pos`` (shape ``[1, T]``, shared by every row) scaled by a `Replicated` vector; every stage adds
its own positional embedding of ``pos`` (which travels between stages as a ``[1, T]`` activation) and
a residual tanh layer with dropout; the last stage's head gives logits. The loss is a cross-entropy
with ``ignore_index=-100``.

Tolerance against one process on the whole batch: float64, ``rtol=1e-10, atol=1e-12``: the pipeline
sums per-microbatch gradients where the reference does one GEMM over the batch; in float64 the
difference of summation order is ~1e-15 relative, while any weighting or splitting error moves the
gradients by percents. Against the seeded per-microbatch reference (dropout), the arithmetic is the
same operations in the same order, so on the CPU the comparison is exact (``rtol=0, atol=0``); on
CUDA (NCCL runs) kernels may pick other reduction orders, so float64 ``rtol=1e-10, atol=1e-12``
there (a different dropout mask moves a gradient by O(1)).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zbpp import ParallelGroups, Pipeline
from zbpp.runtime import Replicated, microbatch_seed
from zbpp.runtime.errors import ShapeMismatchError
from zbpp.runtime.rng import seeded
from zbpp.schedules import Schedule

from .cases import _close, device_for_rank, make_schedule

V, H, T = 11, 6, 5
TOL = {"rtol": 1e-10, "atol": 1e-12}
EXACT = {"rtol": 0.0, "atol": 0.0}


class Stage(nn.Module):
    """Stage `s` of `n` (see the module docstring); `ckpt`: the layer under activation checkpointing."""

    def __init__(self, s: int, n: int, pdrop: float = 0.0, ckpt: bool = False) -> None:
        super().__init__()
        self.first, self.last, self.ckpt = s == 0, s == n - 1, ckpt
        torch.manual_seed(100 + s)
        if self.first:
            self.wte = nn.Embedding(V, H, dtype=torch.float64)
        self.pemb = nn.Embedding(T, H, dtype=torch.float64)
        self.lin = nn.Linear(H, H, dtype=torch.float64)
        self.drop = nn.Dropout(pdrop)
        if self.last:
            self.head = nn.Linear(H, V, dtype=torch.float64)

    def layer(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(torch.tanh(self.lin(h)))

    def forward(self, h: torch.Tensor, pos: torch.Tensor, scale: torch.Tensor | None = None) -> Any:
        assert pos.shape == (1, T), f"stage got pos of shape {tuple(pos.shape)}: a shared [1, T] tensor was split"
        if self.first:
            assert scale is not None and scale.shape == (H,), "the Replicated value did not arrive whole"
            h = self.wte(h) * scale
        h = h + self.pemb(pos)
        h = checkpoint(self.layer, h, use_reentrant=False) if self.ckpt else self.layer(h)
        return self.head(h) if self.last else (h, pos)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)


def tokens(y: torch.Tensor) -> torch.Tensor:
    return (y != -100).sum()


def padded_batch(rows: int, seed: int = 0, empty_rows: int = 0) -> tuple[dict[str, Any], torch.Tensor]:
    """Right-padded ids and labels: row i has its own length in 1..T (the last `empty_rows` rows
    have no token at all), padding labelled -100; ``pos`` is ``[1, T]``, ``scale`` `Replicated`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (rows, T), generator=g)
    y = torch.randint(0, V, (rows, T), generator=g)
    lengths = torch.randint(1, T + 1, (rows,), generator=g)
    if empty_rows:
        lengths[-empty_rows:] = 0
    pad = torch.arange(T)[None, :] >= lengths[:, None]
    ids[pad] = 0
    y[pad] = -100
    scale = torch.linspace(0.5, 1.5, H, dtype=torch.float64)
    return {"h": ids, "pos": torch.arange(T)[None, :], "scale": Replicated(scale)}, y


def to_device(batch: tuple[dict[str, Any], torch.Tensor], device: torch.device) -> tuple[dict[str, Any], torch.Tensor]:
    inputs, y = batch
    moved = {k: (Replicated(v.value.to(device)) if isinstance(v, Replicated) else v.to(device)) for k, v in inputs.items()}
    return moved, y.to(device)


def unwrap(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.value if isinstance(v, Replicated) else v) for k, v in inputs.items()}


def run_stages(stages: list[Stage], inputs: dict[str, Any]) -> torch.Tensor:
    out: Any = stages[0](**unwrap(inputs))
    for st in stages[1:]:
        out = st(*out)
    return out


def grads_of(stages: dict[int, Stage]) -> dict[str, torch.Tensor | None]:
    return {f"{s}.{n}": (p.grad.clone() if p.grad is not None else None)
            for s, st in stages.items() for n, p in st.named_parameters()}


def check_grads(mine: dict[int, Stage], ref: list[Stage], tol: dict[str, float], what: str) -> None:
    for s, st in mine.items():
        for (n, p), (_, q) in zip(st.named_parameters(), ref[s].named_parameters()):
            assert p.grad is not None and q.grad is not None, f"{what} {s}.{n}: no gradient"
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{what} stage {s} grad {n}: {m}", **tol)


def build(sched: Schedule, pp_rank: int, **kwargs: Any) -> tuple[Pipeline, dict[int, Stage]]:
    stage_kw = {k: kwargs.pop(k) for k in ("pdrop", "ckpt") if k in kwargs}
    stages = {s: Stage(s, sched.num_stages, **stage_kw).to(device_for_rank()) for s in sched.stages_on(pp_rank)}
    return Pipeline(stages, sched, loss_fn, **kwargs), stages


def check_shared_inputs(name: str, p: int) -> None:
    """[1, T] tensors and a Replicated vector reach every microbatch whole; loss and gradients equal
    one process on the whole batch (row weighting: every row has every token)."""
    sched = make_schedule(name, p, 2 * p)
    pipe, mine = build(sched, dist.get_rank())
    ref = [Stage(s, sched.num_stages) for s in range(sched.num_stages)]
    inputs, _ = padded_batch(4 * p + 1, seed=1)
    y = torch.randint(0, V, (4 * p + 1, T), generator=torch.Generator().manual_seed(2))
    loss = pipe.step(inputs, target=y)
    want = loss_fn(run_stages(ref, inputs), y)
    want.backward()
    if pipe.holds_last_stage:
        torch.testing.assert_close(loss, want.detach(), **TOL)
    check_grads(mine, ref, TOL, f"{name} p={p} shared inputs")


def check_token_mean(name: str, p: int, empty_rows: int = 0) -> list[float] | None:
    """A right-padded batch with a token-mean cross-entropy: loss, gradients and eval_step's loss
    equal one process's token mean over the whole batch; `losses=` keeps each microbatch's own
    mean (NaN for a microbatch without tokens, which the step's loss leaves out)."""
    m = 2 * p
    sched = make_schedule(name, p, m)
    pipe, mine = build(sched, dist.get_rank(), loss_weight=tokens)
    ref = [Stage(s, sched.num_stages).to(device_for_rank()) for s in range(sched.num_stages)]
    rows = 3 * m + 1
    inputs, y = to_device(padded_batch(rows, seed=3, empty_rows=empty_rows), device_for_rank())
    per_mb: list[torch.Tensor] = []
    loss = pipe.step(inputs, target=y, losses=per_mb)
    logits = run_stages(ref, inputs)
    want = loss_fn(logits, y)
    want.backward()
    what = f"{name} p={p} token mean"
    check_grads(mine, ref, TOL, what)
    evaluated = pipe.eval_step(inputs, target=y)
    if not pipe.holds_last_stage:
        assert loss is None and evaluated is None and per_mb == []
        return None
    counts = [int(tokens(t)) for t in torch.tensor_split(y, m)]
    assert len(set(counts)) > 1, f"the microbatches have the same token counts {counts}: the case tests nothing"
    torch.testing.assert_close(loss, want.detach(), **TOL)
    torch.testing.assert_close(evaluated, want.detach(), **TOL)
    expected = [loss_fn(lg, t) for lg, t in zip(torch.tensor_split(logits.detach(), m), torch.tensor_split(y, m))]
    assert len(per_mb) == m
    for got, exp in zip(per_mb, expected):
        torch.testing.assert_close(got, exp, equal_nan=True, **TOL)
    return counts


def check_token_mean_data_parallel(name: str, pp: int) -> None:
    """dp replicas with different padded batches: the gradient is the token mean over every
    replica's tokens (one process on the concatenated batch); each replica returns its own mean."""
    groups = ParallelGroups(pp=pp)
    dp = dist.get_world_size() // pp
    sched = make_schedule(name, pp, 2 * pp)
    pipe, mine = build(sched, groups.pp_rank, loss_weight=tokens, groups=groups)
    ref = [Stage(s, sched.num_stages) for s in range(sched.num_stages)]
    batches = [padded_batch(3 * pp + 2 * d, seed=20 + d) for d in range(dp)]
    counts = [int(tokens(y)) for _, y in batches]
    assert len(set(counts)) > 1, f"replicas with the same token counts {counts}: the case tests nothing"
    inputs, y = batches[groups.dp_rank]
    loss = pipe.step(inputs, target=y)
    whole = {k: (torch.cat([b[0][k] for b in batches]) if k == "h" else v) for k, v in inputs.items()}
    want = loss_fn(run_stages(ref, whole), torch.cat([b[1] for b in batches]))
    want.backward()
    check_grads(mine, ref, TOL, f"{name} pp={pp} dp={dp} token mean")
    if pipe.holds_last_stage:
        with torch.no_grad():
            own = loss_fn(run_stages(ref, inputs), y)
        torch.testing.assert_close(loss, own, **TOL)


def seeded_reference(stages: list[Stage], inputs: dict[str, Any], y: torch.Tensor, m: int, base: int,
                     step: int, device: torch.device) -> torch.Tensor:
    """One process, microbatch by microbatch: stage s of microbatch j runs after seeding with
    ``microbatch_seed(base, step, s, j)`` (the documented derivation); row-weighted losses."""
    rows = y.shape[0]
    total = torch.zeros((), dtype=torch.float64, device=device)
    xs = [dict(inputs, h=part) for part in torch.tensor_split(inputs["h"], m)]
    for j, (x, t) in enumerate(zip(xs, torch.tensor_split(y, m))):
        out: Any = unwrap(x)
        for s, st in enumerate(stages):
            with seeded(microbatch_seed(base, step, s, j), device):
                out = st(**out) if s == 0 else st(*out)
                if s == len(stages) - 1:
                    weighted = loss_fn(out, t) * (t.shape[0] / rows)
        weighted.backward()
        total = total + weighted.detach()
    return total


def check_dropout(name: str, p: int, *, seed: int | None, ckpt: bool = False,
                  microbatches: int | None = None) -> dict[str, Any]:
    """Dropout 0.3 (every stage; `ckpt`: under activation checkpointing): two steps on one input,
    each equal to the seeded per-microbatch reference with no tolerance; returns the loss (on the
    last stage's rank) and this rank's gradients of each step, for comparisons across schedules.
    `seed` None: every rank seeds torch differently and the base is global rank 0's."""
    rank = dist.get_rank()
    device = device_for_rank()
    tol = EXACT if device.type == "cpu" else TOL
    m = microbatches or 2 * p
    sched = make_schedule(name, p, m)
    mine = {s: Stage(s, sched.num_stages, pdrop=0.3, ckpt=ckpt).to(device) for s in sched.stages_on(rank)}
    if seed is None:
        torch.manual_seed(5000 + rank)  # ranks disagree: the pipeline must agree on rank 0's
    base = 5000 if seed is None else seed
    pipe = Pipeline(mine, sched, loss_fn, seed=seed)
    ref = [Stage(s, sched.num_stages, pdrop=0.3).to(device) for s in range(sched.num_stages)]
    inputs, y = padded_batch(3 * m + 1, seed=4)
    y = torch.randint(0, V, y.shape, generator=torch.Generator().manual_seed(9))
    inputs, y = to_device((inputs, y), device)
    outer = torch.get_rng_state()
    outer_device = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    results: dict[str, Any] = {"loss": [], "grads": []}
    for step in range(2):
        loss = pipe.step(inputs, target=y)
        want = seeded_reference(ref, inputs, y, m, base, step, device)
        what = f"{name} p={p} seed={seed} ckpt={ckpt} step {step}"
        if pipe.holds_last_stage:
            torch.testing.assert_close(loss, want, msg=lambda s: f"{what} loss: {s}", **tol)
        check_grads(mine, ref, tol, what)
        results["loss"].append(None if loss is None else loss.cpu())
        results["grads"].append({k: v.cpu() for k, v in grads_of(mine).items()})
        for st in [*mine.values(), *ref]:
            st.zero_grad(set_to_none=True)
    assert torch.equal(torch.get_rng_state(), outer), "a step changed the caller's CPU generator state"
    if outer_device is not None:
        assert torch.equal(torch.cuda.get_rng_state(device), outer_device), "a step changed the device generator"
    return results


def check_rows_mismatch_on_one_replica(name: str, pp: int) -> str:
    """One replica's target has other rows than its input: every rank of the job raises the
    ValueError naming it before computing (none waits for the others), then a good step works."""
    groups = ParallelGroups(pp=pp)
    sched = make_schedule(name, pp, 2 * pp)
    pipe, _ = build(sched, groups.pp_rank, loss_weight=tokens, groups=groups)
    inputs, y = padded_batch(4 * pp, seed=5)
    bad = y[:-1] if groups.dp_rank == 1 else y
    try:
        pipe.step(inputs, target=bad)
    except ValueError as exc:
        assert f"the target has {4 * pp - 1} rows along dim 0 but the input has {4 * pp}" in str(exc), str(exc)
        caught = "ValueError"
    else:
        raise AssertionError("a target of the wrong rows was accepted")
    assert all(q.grad is None for q in pipe.parameters()), "grads were touched by a rejected step"
    pipe.step(inputs, target=y)
    return caught


def check_bad_losses_on_one_rank(name: str, p: int) -> dict[str, Any]:
    """Only the last rank passes ``losses=`` (it alone appends to it), and passes a tuple: that rank
    raises its TypeError, every other a PipelineError naming it, fast, and a good step follows."""
    import time

    import torch.distributed as dist

    from zbpp.runtime import PipelineError

    sched = make_schedule(name, p, 2 * p)
    rank = dist.get_rank()
    pipe, _ = build(sched, rank)
    inputs, y = padded_batch(4 * p, seed=5)
    t0 = time.monotonic()
    try:
        pipe.step(inputs, target=y, losses=() if pipe.holds_last_stage else None)
    except (TypeError, PipelineError) as exc:
        out = {"rank": rank, "result": type(exc).__name__, "message": str(exc)}
    else:
        raise AssertionError(f"rank {rank}: a step with losses=() returned")
    out["seconds"] = time.monotonic() - t0
    pipe.step(inputs, target=y, losses=[] if pipe.holds_last_stage else None)
    return out


class Branches(nn.Module):
    """Stage `s`: a float64 MLP stage that returns ``{"h", "extra", "mask"}``: ``extra`` from its own
    linear layer, ``mask`` an integer tensor. It reads ``h`` and ``mask`` of the stage before and,
    with `use_extra`, ``extra`` too; with `use_h` False it reads neither float input (only ``mask``):
    nothing of the stage before gets a gradient."""

    def __init__(self, s: int, use_extra: bool = False, use_h: bool = True) -> None:
        super().__init__()
        torch.manual_seed(500 + s)
        self.first, self.use_extra, self.use_h = s == 0, use_extra, use_h
        self.main = nn.Linear(4, 4, dtype=torch.float64)
        self.side = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, h: torch.Tensor, extra: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> Any:
        if self.first:
            mask = (h > 0).long()
        else:
            h = (h if self.use_h else torch.zeros_like(h)) + (extra if self.use_extra else 0) + mask
        h = torch.tanh(self.main(h))
        return {"h": h, "extra": self.side(h), "mask": mask}


def branches_loss(out: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return ((out["h"] - y) ** 2).mean()


def check_unused_stage_inputs(name: str, p: int, use_h: bool) -> None:
    """Every stage ignores the stage before's ``extra`` (stage 1 also its ``h`` when not `use_h`):
    after two AdamW steps with weight decay, the gradients and the parameters equal one process
    running the stages on the microbatches in turn, where a parameter that feeds only ignored
    outputs gets None, never zeros (weight decay would move it). Float64 ``TOL``: summation order."""
    sched = make_schedule(name, p, 4)
    n = sched.num_stages
    make = lambda: [Branches(s, use_h=use_h or s != 1) for s in range(n)]  # noqa: E731
    ref, mods = make(), make()
    mine = {s: mods[s] for s in sched.stages_on(dist.get_rank())}
    pipe = Pipeline(mine, sched, branches_loss, seed=False)
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=0.1, weight_decay=0.5)
    ref_opt = torch.optim.AdamW([q for m in ref for q in m.parameters()], lr=0.1, weight_decay=0.5)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, dtype=torch.float64, generator=g), torch.randn(8, 4, dtype=torch.float64, generator=g)
        opt.zero_grad()
        ref_opt.zero_grad()
        pipe.step(x, target=y)
        for xs, ys in zip(x.chunk(4), y.chunk(4)):  # one process, gradient accumulation over the microbatches
            out = xs
            for m in ref:
                out = m(**out) if isinstance(out, dict) else m(out)
            (branches_loss(out, ys) / 4).backward()
        for s, m in mine.items():
            for (k, q), want in zip(m.named_parameters(), ref[s].parameters()):
                _close(f"{name} p={p} use_h={use_h} step {step} stage {s} grad {k}", q.grad, want.grad, TOL)
        opt.step()
        ref_opt.step()
    for s, m in mine.items():
        for (k, q), want in zip(m.named_parameters(), ref[s].parameters()):
            torch.testing.assert_close(q, want, msg=lambda e: f"stage {s} {k} after the steps: {e}", **TOL)


def check_usage_changes_within_a_signature(name: str, p: int) -> dict[str, Any]:
    """Stage 1 ignores ``extra`` on the first step of a signature, then uses it (a Python flag, not
    the input's shapes): stage 0 left ``extra`` out of its backward as learnt, so the second step
    raises on every rank, naming the stage, instead of losing that gradient. Then the flag goes
    back and a step of the same signature runs. The reverse (used first, then ignored) warns and
    sends zeros back: ``side`` gets zero .grad, not None."""
    from zbpp.runtime import PipelineError

    sched = make_schedule(name, p, 4)
    mods = {s: Branches(s) for s in sched.stages_on(dist.get_rank())}
    pipe = Pipeline(mods, sched, branches_loss)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe.step(x, target=y)
    out: dict[str, Any] = {}
    for m in mods.values():
        m.use_extra = True
    try:
        pipe.step(x, target=y)
    except (PipelineError, ShapeMismatchError) as exc:
        out["raised"] = str(exc)
    for m in mods.values():
        m.use_extra = False
    pipe.step(x, target=y)  # the pipeline goes on
    x2 = torch.randn(6, 4, dtype=torch.float64)  # a new signature: stage 1 uses extra when learnt...
    for m in mods.values():
        m.use_extra = True
    pipe.step(x2, target=y[:6])
    for m in mods.values():
        m.use_extra = False
        m.zero_grad(set_to_none=True)
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # ...and then ignores it
        warnings.simplefilter("always")
        pipe.step(x2, target=y[:6])
    out["warnings"] = [str(w.message) for w in caught]
    out["side grad"] = None if 0 not in mods else mods[0].side.weight.grad
    return out
