"""What every rank runs in test_grads.py: gradients and optimizer inputs of multi-rank runs (data
parallelism, V and interleaved placements, clipping, loss weights, no_sync, evaluation steps in
between) against one process running the whole model on the whole batch, per replica.

The model: a chain of float64 stages ``x + tanh(Linear(x))``. Tolerance: float64, ``rtol=1e-10,
atol=1e-12``: the pipeline sums per-microbatch gradients where the reference runs one batch; the
difference of summation order is ~1e-15 relative, so a logic error (a lost or doubled
contribution, a wrong weight) is orders of magnitude above the bound.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zbpp import Pipeline
from zbpp.modules import Linear as ZLinear
from zbpp.runtime import ParallelGroups, PipelineError

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


def _step_against_replicas(pipe: Pipeline, refs: list[list[nn.Module]], stages: dict[int, nn.Module], step: int,
                           rows: int, dp_rank: int, label: str) -> None:
    """One step of `pipe` on this replica's rows, checked against the replicas' whole-model
    references (`refs`, one per replica: their gradients averaged); every gradient reset after."""
    x, y = data(step, rows, dp_rank)
    pipe.step(x, target=y)
    for d, r in enumerate(refs):
        h, yd = data(step, rows, d)
        for b in r:
            h = b(h)
        mse(h, yd).backward()
    want = averaged_reference(refs, stages)
    for key, p in _named(stages).items():
        check_close(f"{label} rank {dist.get_rank()} {key}", p.grad, want[key])
    for q in [*pipe.parameters(), *(q for r in refs for b in r for q in b.parameters())]:
        q.grad = None


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
        _step_against_replicas(pipe, refs, stages, step, 2 * sched.num_microbatches + 1, groups.dp_rank,
                               f"{name} step {step}")


class _Lora(nn.Module):
    """`base` plus a rank-2 adapter (LoRA): new trainable Linears inside a stage."""

    def __init__(self, base: nn.Module, seed: int) -> None:
        super().__init__()
        self.base = base
        torch.manual_seed(seed)
        self.a = nn.Linear(H, 2, bias=False, dtype=torch.float64)
        self.b = nn.Linear(2, H, bias=False, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


def _refused(step: Any) -> str:
    """The message of the error `step()` raises ('' if none): every rank must raise."""
    try:
        step()
    except (ValueError, PipelineError) as exc:  # PipelineError: the ranks told of another rank's error
        return str(exc)
    return ""


def check_changed_after_build(name: str, kind: str) -> list[str]:
    """dp=2 x pp=2: the model changed after the Pipeline was built. A module removed (``extra``
    of every stage: its parameters get no gradient, as in one process) trains on; an adapter
    injected (`_Lora` around every ``lin``) and a parameter replaced (stage 1's ``lin.bias``) would
    keep each replica's own gradient: every rank refuses the step, naming the stage and the
    parameters; a new Pipeline over the changed stages then averages them, whatever the earlier
    Pipelines left on the modules. The messages, per rank."""
    groups = ParallelGroups(pp=2)
    dp = groups.dp
    sched = make_schedule(name, 2, 4)
    n = sched.num_stages
    stages = {s: Block(s, kind) for s in sched.stages_on(groups.pp_rank)}
    refs = [[Block(s) for s in range(n)] for _ in range(dp)]
    pipe = Pipeline(stages, sched, mse, groups=groups)

    def run(pipe: Pipeline, step: int) -> None:
        _step_against_replicas(pipe, refs, stages, step, 9, groups.dp_rank, f"{name} {kind} step {step}")

    for st in [*stages.values(), *(b for r in refs for b in r)]:
        st.extra = nn.Identity()
    run(pipe, 0)
    for st in [*stages.values(), *(b for r in refs for b in r)]:
        st.lin = _Lora(st.lin, 7)
    said = [_refused(lambda: run(pipe, 1))]
    pipe = Pipeline(stages, sched, mse, groups=groups)  # as the error says: the adapters are averaged too
    run(pipe, 1)
    if 1 in stages:  # the same values: the reference stays as it is
        stages[1].lin.base.bias = nn.Parameter(stages[1].lin.base.bias.detach().clone())
    said.append(_refused(lambda: run(pipe, 2)))
    pipe = Pipeline(stages, sched, mse, groups=groups)  # the earlier Pipelines' reducers must keep out of it
    run(pipe, 2)
    return said


def check_tie_replaced_after_build(name: str) -> str:
    """dp=2 x pp=2, feature_cases' LM whose embedding is tied to its head: both ends get a new
    Parameter after the Pipeline was built (as ``resize_token_embeddings`` does; the values halved,
    alike on every copy). The pipeline's tie holds the old copies: every rank refuses the step,
    naming the stage and ``'wte'``. A new Pipeline with the new copies as ``tied_parameters`` sums
    and averages their gradients as one process with one embedding does. The refusal's message."""
    from .feature_cases import avg_params, batch as lm_batch, build as lm_build, check_grads, loss_fn as lm_loss
    from .feature_cases import reference, run_reference

    groups = ParallelGroups(pp=2)
    sched = make_schedule(name, 2, 4)
    pipe, stages = lm_build(sched, groups.pp_rank, "plain", groups=groups)
    refs = [reference(sched.num_stages)[0] for _ in range(groups.dp)]
    held = [st for st in stages.values() if hasattr(st, "wte")]
    wte = nn.Parameter(held[0].wte.detach() * 0.5) if held else None
    for st in held:  # one Parameter for this rank's stages that hold the tie (a V placement: both ends)
        st.wte = wte
    for r in refs:
        r[0].wte = r[-1].wte = nn.Parameter(r[0].wte.detach() * 0.5)
    said = _refused(lambda: pipe.step(*lm_batch(0, 8, groups.dp_rank)))
    pipe = Pipeline(stages, sched, lm_loss, tied_parameters={"wte": wte} if wte is not None else None, groups=groups)
    pipe.step(*lm_batch(0, 8, groups.dp_rank))
    for d, r in enumerate(refs):
        run_reference(r, *lm_batch(0, 8, d))
    for d in range(1, groups.dp):  # the replicas' average
        for q, other in zip(avg_params(refs[0]), avg_params(refs[d])):
            q.grad = q.grad + other.grad
    for q in avg_params(refs[0]):
        q.grad = q.grad / groups.dp
    check_grads(stages, refs[0], what=f"{name} after the tie was replaced")
    return said


def check_tie_unfrozen_unalike(name: str) -> tuple[str, float]:
    """dp=2 x pp=2, feature_cases' LM with the embedding tied to the head, every copy frozen when the
    Pipeline is built; then only the head's copy (the last stage's) is unfrozen, as fine-tuning the
    "LM head" alone would. The copies are one parameter: every rank must refuse the step at its
    start, naming the tie and the ranks, within seconds (the trained copy's all-reduce would wait
    for the frozen ones until the group's timeout). Then unfrozen alike: the step trains. The
    refusal's message and the seconds it took."""
    import time

    from .feature_cases import Stage, batch as lm_batch, loss_fn as lm_loss, make_wte

    groups = ParallelGroups(pp=2)
    sched = make_schedule(name, 2, 4)
    n = sched.num_stages
    mine = sched.stages_on(groups.pp_rank)
    wte = make_wte() if 0 in mine or n - 1 in mine else None
    if wte is not None:
        wte.requires_grad_(False)
    stages = {s: Stage(s, n, "plain", wte if s in (0, n - 1) else None) for s in mine}
    pipe = Pipeline(stages, sched, lm_loss, tied_parameters={"wte": wte} if wte is not None else None, groups=groups,
                    timeout=20)  # a hang in the tie's all-reduce ends in 20 s
    if wte is not None and n - 1 in mine and 0 not in mine:
        wte.requires_grad_(True)
    start = time.monotonic()
    said = _refused(lambda: pipe.step(*lm_batch(0, 8, groups.dp_rank)))
    took = time.monotonic() - start
    if wte is not None:
        wte.requires_grad_(True)
    pipe.step(*lm_batch(0, 8, groups.dp_rank))
    return said, took


N_TIES = 63  # one more than the 62 ties whose flags fit one int64 word of the start agreement


class _ManyTies(nn.Module):
    """A `Block` whose input is shifted by `N_TIES` tied vectors (``ties[i]`` weighted ``i + 1``)."""

    def __init__(self, s: int, ties: nn.ParameterList) -> None:
        super().__init__()
        self.block, self.ties = Block(s), ties

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x + sum((i + 1) * t for i, t in enumerate(self.ties)))


def _many_ties() -> nn.ParameterList:
    g = torch.Generator().manual_seed(7)  # the same values on every rank and in the references
    return nn.ParameterList(nn.Parameter(0.1 * torch.randn(H, generator=g, dtype=torch.float64)) for _ in range(N_TIES))


def check_tie_past_the_first_word_unfrozen_unalike() -> tuple[str, float]:
    """dp=2 x pp=2, 1f1b: both stages use `N_TIES` tied vectors, all frozen when the Pipeline is
    built; then the last one (bit 62 of the flags: past the first int64 word) is unfrozen on the
    last stage's copies only. Every rank must refuse the step at its start, naming it, within
    seconds (the trained copies' all-reduce would wait for the frozen ones until the group's
    timeout). Then unfrozen alike: each copy's gradient is the whole model's, averaged over the
    replicas. The refusal's message and the seconds it took."""
    import time

    groups = ParallelGroups(pp=2)
    sched = make_schedule("1f1b", 2, 4)
    ties = _many_ties()
    stages = {groups.pp_rank: _ManyTies(groups.pp_rank, ties)}
    names = [f"t{i:02d}" for i in range(N_TIES)]  # sorted as the Pipeline sorts them: ties[i] is bit i
    for t in ties:
        t.requires_grad_(False)
    pipe = Pipeline(stages, sched, mse, tied_parameters=dict(zip(names, ties)), groups=groups,
                    timeout=10)  # a hang in the tie's all-reduce ends in 10 s
    if groups.pp_rank == 1:
        ties[-1].requires_grad_(True)
    start = time.monotonic()
    said = _refused(lambda: pipe.step(*data(0, 9, groups.dp_rank)))
    took = time.monotonic() - start
    for t in ties:
        t.requires_grad_(True)
    refs = [[_ManyTies(s, shared) for s in range(2)] for shared in (_many_ties() for _ in range(groups.dp))]
    _step_against_replicas(pipe, refs, stages, 1, 9, groups.dp_rank, "63 ties")
    return said, took


def check_clip(name: str, pp: int, kind: str, norm_type: float, max_norm: float, given: str = "none") -> float:
    """dp replicas of the tied LM of feature_cases (the embedding tied to the head): the norm that
    `clip_grad_norm_` returns and the clipped gradients against one process's model holding the
    replicas' averaged gradients (the tied weight once), clipped by torch. `given`: the groups
    passed to `clip_grad_norm_`: ``"none"`` (the pipeline's), ``"groups"`` (the `ParallelGroups`
    the pipeline got), ``"mesh"`` (the pipeline got a DeviceMesh, and so does the clip), ``"params"``
    (no groups, the pipeline's parameters alone, as a generator: its groups are found from them; then
    the same with one parameter of no Pipeline beside them is refused, on every rank)."""
    import math

    from zbpp.runtime import clip_grad_norm_

    from . import feature_cases as fc

    groups: Any = ParallelGroups(pp=pp)
    dp, pp_rank, dp_rank = groups.dp, groups.pp_rank, groups.dp_rank
    if given == "mesh":
        groups = groups.mesh
    sched = make_schedule(name, pp, 2 * pp)
    pipe, stages = fc.build(sched, pp_rank, kind, groups=groups)
    refs = [fc.reference(sched.num_stages)[0] for _ in range(dp)]
    rows = 2 * sched.num_microbatches + 1
    pipe.step(*fc.batch(0, rows, dp_rank))
    for d, r in enumerate(refs):
        fc.run_reference(r, *fc.batch(0, rows, d))
    avg = fc.avg_params(refs[0])
    for q, *others in zip(avg, *(fc.avg_params(r) for r in refs[1:])):
        q.grad = (q.grad + sum(o.grad for o in others)) / dp
    norm_type = math.inf if norm_type < 0 else norm_type
    want = torch.nn.utils.clip_grad_norm_(avg, max_norm, norm_type=norm_type)
    if given == "params":
        stray = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
        stray.grad = torch.ones(1, dtype=torch.float64)
        try:
            clip_grad_norm_([*pipe.parameters(), stray], max_norm, norm_type=norm_type)
        except ValueError as exc:
            assert "belong to one Pipeline and the others not" in str(exc), exc
        else:
            raise AssertionError("a parameter of no Pipeline beside a Pipeline's was not refused")
        # pipeline rank 1 passes nothing (a stage without parameters): still the pipeline's group, as the
        # groups given say; max_norm so large that nothing is scaled
        part = [] if pp_rank == 1 else list(pipe.parameters())
        # a dropped Pipeline on groups of its own, alive only through a reference cycle until a collection:
        # the empty share collects before it looks, and the list of what it found must not keep it alive
        dropped, _ = fc.build(sched, pp_rank, kind, groups=ParallelGroups(pp=pp))
        dropped.cycle = dropped
        del dropped
        check_close("a share given alone, one rank's empty", clip_grad_norm_(iter(part), 1e30, norm_type=norm_type),
                    clip_grad_norm_(part, 1e30, groups, norm_type=norm_type))
        # a second live Pipeline on groups of its own (the same ranks): the empty share took the newest,
        # its peers `pipe`, and the ranks waited in all-reduces of different groups until the timeout
        other, _ = fc.build(sched, pp_rank, kind, groups=ParallelGroups(pp=pp))
        try:
            clip_grad_norm_(part, 1e30, norm_type=norm_type)
        except (ValueError, PipelineError) as exc:
            assert type(exc) is (ValueError if pp_rank == 1 else PipelineError), exc
            assert "live Pipelines of this process sum over different process groups" in str(exc), exc
        else:
            raise AssertionError("an empty share beside Pipelines on different groups was not refused")
        del other
        got = clip_grad_norm_(pipe.parameters(), max_norm, norm_type=norm_type)
    else:
        got = clip_grad_norm_(pipe, max_norm, None if given == "none" else groups, norm_type=norm_type)
    what = f"{name} pp={pp} dp={dp} {kind} norm_type={norm_type} rank {dist.get_rank()}"
    check_close(f"{what}: norm", got, want)
    fc.check_grads(stages, refs[0], what=what)
    return float(want)


def check_clip_refused_on_one_rank(name: str, pp: int) -> tuple[str, str, float, bool, float]:
    """pp ranks, no replicas; after a step, rank 1 attaches a main_grad (Megatron's float32
    accumulation) to its stage's ``lin.weight``, whose gradient the step left in .grad, so
    `clip_grad_norm_` refuses it there. The other ranks waited in the norm's all-reduce until the
    group's timeout. Returns what the call raised here and how long it took, whether every gradient
    is as before (nothing clipped), and the norm of a second call once the main_grad is dropped
    (every rank takes part again: the same norm everywhere)."""
    import time

    from zbpp.runtime import clip_grad_norm_

    sched = make_schedule(name, pp, 2 * pp)
    stages = {s: Block(s) for s in sched.stages_on(dist.get_rank())}
    pipe = Pipeline(stages, sched, mse)
    pipe.step(*data(0, 2 * sched.num_microbatches, 0))
    before = [p.grad.clone() for p in pipe.parameters()]
    if dist.get_rank() == 1:
        stages[1].lin.weight.main_grad = torch.zeros_like(stages[1].lin.weight)
    t0 = time.monotonic()
    try:
        clip_grad_norm_(pipe, 1e-3)
        raised = "nothing"
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        raised = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    untouched = all(torch.equal(b, p.grad) for b, p in zip(before, pipe.parameters()))
    for p in pipe.parameters():
        p.__dict__.pop("main_grad", None)
    return raised.split(":")[0], raised, seconds, untouched, float(clip_grad_norm_(pipe, 1e-3))


def token_batch(step: int, rows: int, replica: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels of the tied LM of feature_cases, with ignored (-100) labels: replica 1's
    first microbatch has none to count at step 0, and its whole batch none at step 1."""
    from . import feature_cases as fc

    x, y = fc.batch(step, rows, replica)
    g = torch.Generator().manual_seed(77 + 10 * replica + step)
    y = torch.where(torch.rand(rows, generator=g) < 0.3, torch.full_like(y, -100), y)
    if replica == 1 and step == 0:
        y[: torch.tensor_split(torch.arange(rows), m)[0].numel()] = -100
    if replica == 1 and step == 1:
        y[:] = -100
    return x, y


def check_token_weights(name: str, pp: int, kind: str, no_sync: bool, m: int = 0) -> list[float] | None:
    """``loss_weight`` = the count of labels that are not -100, dp replicas of the tied LM, a batch
    not divisible by the microbatches: each step's gradient is the token mean over every replica's
    tokens (one process on the replicas' concatenated batch), the tied weight included; with
    `no_sync`, two steps inside ``no_sync()`` then one outside sum those three token means."""
    from . import feature_cases as fc

    groups = ParallelGroups(pp=pp)
    dp = groups.dp
    sched = make_schedule(name, pp, m or 2 * pp)
    m = sched.num_microbatches
    n = sched.num_stages
    mine = sched.stages_on(groups.pp_rank)
    wte = fc.make_wte() if (0 in mine or n - 1 in mine) else None
    stages = {s: fc.Stage(s, n, kind, wte if s in (0, n - 1) else None) for s in mine}
    pipe = Pipeline(stages, sched, fc.loss_fn, groups=groups, tied_parameters={"wte": wte} if wte is not None else None,
                    loss_weight=lambda y: (y != -100).sum())
    ref, _ = fc.reference(n)
    rows = 2 * m + 1
    losses = []
    for step in range(3):
        x, y = token_batch(step, rows, groups.dp_rank, m)
        if no_sync and step < 2:
            with pipe.no_sync():
                loss = pipe.step(x, target=y)
        else:
            loss = pipe.step(x, target=y)
        everyone = [token_batch(step, rows, d, m) for d in range(dp)]
        fc.run_reference(ref, torch.cat([b[0] for b in everyone]), torch.cat([b[1] for b in everyone]))
        what = f"{name} pp={pp} dp={dp} {kind} no_sync={no_sync} step {step} rank {dist.get_rank()}"
        if pipe.holds_last_stage:  # each replica's own token mean (0 without any token)
            with torch.no_grad():
                own = fc.run_reference(ref, x, y, backward=False) if (y != -100).any() else torch.zeros((), dtype=torch.float64)
            check_close(f"{what}: loss", loss, own)
            losses.append(float(loss))
        if no_sync and step < 2:
            continue
        fc.check_grads(stages, ref, what=what)
        for q in [*pipe.parameters(), *fc.avg_params(ref)]:
            q.grad = None
    return losses or None


def check_eval_between(name: str, pp: int, kind: str, no_sync: bool = False, main_grad: bool = False) -> None:
    """Three training steps without zeroing, two evaluation steps after the first, dp replicas of
    the tied LM: the evaluations give the reference's outputs and loss and leave nothing behind (a
    pending W, a gradient), the training steps accumulate the replicas' averaged batch-mean
    gradients as if the evaluations never ran. `no_sync`: the first two training steps inside
    ``no_sync()``; `main_grad`: a ``GradReducer(main_grad=True)``, whose synchronised steps start
    ``main_grad`` from zeros, so only with `no_sync` do all three steps accumulate there."""
    from . import feature_cases as fc

    assert no_sync or not main_grad, "main_grad accumulates over a no_sync window only"

    groups = ParallelGroups(pp=pp)
    dp = groups.dp
    sched = make_schedule(name, pp, 2 * pp)
    m = sched.num_microbatches
    if main_grad:
        from zbpp.runtime.grad_reduce import GradReducer

        mine = sched.stages_on(groups.pp_rank)
        wte = fc.make_wte() if (0 in mine or sched.num_stages - 1 in mine) else None
        stages = {s: fc.Stage(s, sched.num_stages, kind, wte if s in (0, sched.num_stages - 1) else None) for s in mine}
        reducer = GradReducer(stages, groups, main_grad=True, exclude={id(wte)} if wte is not None else set())
        pipe = Pipeline(stages, sched, fc.loss_fn, groups=groups, reducer=reducer,
                        tied_parameters={"wte": wte} if wte is not None else None)
    else:
        pipe, stages = fc.build(sched, groups.pp_rank, kind, groups=groups)
    refs = [fc.reference(sched.num_stages)[0] for _ in range(dp)]
    rows = 2 * m + 1
    for step in range(4):
        x, y = fc.batch(step, rows, groups.dp_rank)
        if step == 1:
            out = pipe.eval_step(x)
            loss = pipe.eval_step(x, target=y)
            with torch.no_grad():
                h: Any = x
                for st in refs[groups.dp_rank]:
                    h = st(h)
            if pipe.holds_last_stage:
                check_close("eval output", out, h)
                check_close("eval loss", loss, fc.loss_fn(h, y))
            continue
        with pipe.no_sync() if no_sync and step < 3 else contextlib.nullcontext():
            pipe.step(x, target=y)
        for d, r in enumerate(refs):
            fc.run_reference(r, *fc.batch(step, rows, d))
    avg = fc.avg_params(refs[0])
    for q, *others in zip(avg, *(fc.avg_params(r) for r in refs[1:])):
        q.grad = (q.grad + sum(o.grad for o in others)) / dp
    if main_grad:
        for q in pipe.parameters():
            if getattr(q, "main_grad", None) is not None:
                q.grad = q.main_grad
    fc.check_grads(stages, refs[0], what=f"{name} pp={pp} dp={dp} {kind} eval between")


class _FailOnce:
    """A loss that raises once, when armed (a failed step on the last stage's rank)."""

    def __init__(self, loss: Any) -> None:
        self.loss, self.armed = loss, False

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            raise RuntimeError("injected failure")
        return self.loss(out, y)


def _check_replica_average(stages: Any, refs: list[Any], what: str) -> None:
    """The stages' gradients against the average of the replicas' references (one process each)."""
    from . import feature_cases as fc

    avg = fc.avg_params(refs[0])
    for q, *others in zip(avg, *(fc.avg_params(r) for r in refs[1:])):
        q.grad = (q.grad + sum(o.grad for o in others)) / len(refs)
    fc.check_grads(stages, refs[0], what=what)


def _fail_once(name: str, pipe: Any, failing: Any, stages: Any, batch: tuple,
               within: Callable[[], Any] = contextlib.nullcontext) -> None:
    """A step of `batch` (inside `within()`) whose loss raises once (`failing`, a `_FailOnce`):
    every stage gradient is as before it."""
    before = {k: p.grad.clone() for k, p in _named(stages).items()}
    failing.armed = True
    try:
        with within():
            pipe.step(*batch)
    except PipelineError:
        pass
    else:
        raise AssertionError("the injected failure did not fail the step")
    for k, p in _named(stages).items():
        check_close(f"{name} rank {dist.get_rank()} {k} after a failed step", p.grad, before[k])


def check_sync_no_sync_sync(name: str, pp: int, kind: str, fail: bool = False, graphs: bool = False) -> None:
    """Without zeroing between steps: a synchronised step, a step inside ``no_sync()``, a
    synchronised step. The gradients are the sum of the three steps' (replica-averaged) gradients,
    the tied weight's too: the first step's sum, already in every copy, must not be counted again
    by the third step's reduction of what no_sync accumulated. `fail`: the window's first step
    fails once first (its loss raises on the last stage's rank): every gradient is as before it."""
    from . import feature_cases as fc

    world = dist.get_world_size()
    groups = ParallelGroups(pp=pp)
    dp = world // pp
    sched = make_schedule(name, pp, 2 * pp)
    if graphs:  # task graphs' fixed .grad buffers (their CPU stand-in), from the second step on
        from zbpp.runtime.task_graphs import StandInGraphs

        mine = sched.stages_on(groups.pp_rank)
        n = sched.num_stages
        wte = fc.make_wte() if (0 in mine or n - 1 in mine) else None
        stages = {s: fc.Stage(s, n, kind, wte if s in (0, n - 1) else None) for s in mine}
        pipe = Pipeline(stages, sched, fc.loss_fn, tied_parameters={"wte": wte} if wte is not None else None,
                        groups=groups, cuda_graphs=StandInGraphs)
    else:
        pipe, stages = fc.build(sched, groups.pp_rank, kind, groups=groups)
    failing = pipe.loss_fn = _FailOnce(pipe.loss_fn)
    refs = [fc.reference(sched.num_stages)[0] for _ in range(dp)]
    rows = 2 * sched.num_microbatches + 1
    for step in range(3):
        if step == 1 and fail:
            _fail_once(name, pipe, failing, stages, fc.batch(step, rows, groups.dp_rank), pipe.no_sync)
        with pipe.no_sync() if step == 1 else contextlib.nullcontext():
            pipe.step(*fc.batch(step, rows, groups.dp_rank))
        for d, r in enumerate(refs):
            fc.run_reference(r, *fc.batch(step, rows, d))
    _check_replica_average(stages, refs, f"{name} pp={pp} dp={dp} {kind} sync, no_sync, sync")


def check_steps_accumulate(name: str, pp: int, kind: str, keep: bool = False, graphs: bool = False,
                           fail: bool = False) -> None:
    """Three synchronised steps without zeroing between them: the gradients are the sum of the three
    steps' (replica-averaged) gradients. The tied weight's were 1, 3 and 7 times one step's: with
    ``keep_grads_on_failure=False`` (`keep`) nothing set its earlier gradient aside, and under task
    graphs (`graphs`: their fixed ``.grad`` buffers, the CPU stand-in) it stayed in the buffer, with
    or without `keep`; each step's sum over its two copies counted the earlier steps' once per copy.
    `fail` (with `keep`): the second step fails once first (its loss raises on the last stage's
    rank): every gradient is as before it."""
    from zbpp.runtime.task_graphs import StandInGraphs

    from . import feature_cases as fc

    world = dist.get_world_size()
    groups = ParallelGroups(pp=pp)
    dp = world // pp
    sched = make_schedule(name, pp, 2 * pp)
    pipe, stages = fc.build(sched, groups.pp_rank, kind, groups=groups, keep_grads_on_failure=keep,
                            cuda_graphs=StandInGraphs if graphs else False)
    failing = pipe.loss_fn = _FailOnce(pipe.loss_fn)
    refs = [fc.reference(sched.num_stages)[0] for _ in range(dp)]
    rows = 2 * sched.num_microbatches + 1
    for step in range(3):  # graphs: eager, captured, replayed
        if step == 1 and fail:
            _fail_once(name, pipe, failing, stages, fc.batch(step, rows, groups.dp_rank))
        pipe.step(*fc.batch(step, rows, groups.dp_rank))
        for d, r in enumerate(refs):
            fc.run_reference(r, *fc.batch(step, rows, d))
    _check_replica_average(stages, refs, f"{name} pp={pp} dp={dp} {kind} three steps, keep={keep} graphs={graphs} "
                                         f"fail={fail}")


def tied_linear_steps_under_graphs(fused: bool, keep: bool) -> float:
    """pp=2 under zb-h1, task graphs (the CPU stand-in): each stage a delayed-wgrad zbpp Linear (no
    bias) and a tanh, the two weights one tied parameter. Its W writes the fixed ``.grad`` buffer
    instead of adding to it (the earlier steps' gradient added back after the stage's last W), or
    with `fused` adds to the ``main_grad`` the user attached. Three steps without zeroing (eager,
    captured, replayed). Returns the largest difference of the tied gradient from three times one
    process's (the plain model, the weight used twice, on the same rows)."""
    from zbpp.runtime.task_graphs import StandInGraphs
    from zbpp.schedules import build

    def stage(zbpp: bool = True) -> nn.Module:
        torch.manual_seed(100)  # the same weight on both stages: one tied parameter
        lin = nn.Linear(H, H, bias=False, dtype=torch.float64)
        if zbpp:
            layer = ZLinear(H, H, bias=False, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused,
                            params_dtype=torch.float64)
            layer.load_state_dict(lin.state_dict())
            lin = layer
        return nn.Sequential(lin, nn.Tanh())

    groups = ParallelGroups(pp=2)
    sched = build("zb-h1", num_ranks=2, num_microbatches=4)
    mine = {s: stage() for s in sched.stages_on(groups.pp_rank)}
    weight = next(iter(mine.values()))[0].weight
    if fused:
        weight.main_grad = torch.zeros_like(weight)
    pipe = Pipeline(mine, sched, mse, groups=groups, tied_parameters={"w": weight}, cuda_graphs=StandInGraphs,
                    keep_grads_on_failure=keep)
    x, y = data(0, 8, 0)
    ref = stage(zbpp=False)
    mse(ref(ref(x)), y).backward()
    for _ in range(3):
        pipe.step(x, target=y)
    got = weight.main_grad if fused else weight.grad
    return float((got - 3 * ref[0].weight.grad).abs().max())


def check_fsdp_sync_no_sync_sync(schedule: str, *tie: int) -> list[str]:
    """`check_sync_no_sync_sync` with ``fully_shard`` stages (fsdp_cases' model, dp=2 x pp=2) and a
    weight tied to ``layers.0.weight``: the sum of the three steps' gradients."""
    from . import fsdp_cases as fs

    pipe = fs.fsdp_pipeline(schedule, "plain", 2, 2, tie=tie)
    dp_rank = pipe.topology.dp_rank
    _, ref_grads = fs.reference_run("plain", 1, "cpu", 3, None, tie)
    named = {n: p for m in pipe.stage_modules.values() for n, p in m.named_parameters()}
    for step in range(3):
        x, y = fs.batch(step, "cpu")
        with pipe.no_sync() if step == 1 else contextlib.nullcontext():
            pipe.step(fs.my_rows(dp_rank, 2, x), target=fs.my_rows(dp_rank, 2, y))
    got = {n: fs.full(p.grad) for n, p in named.items() if p.grad is not None}
    return fs.compare(f"{schedule} tie={tie}", got, ref_grads[0])


class SometimesBlock(Block):
    """`Block` whose ``extra`` branch runs only on rows marked by a first column above 50 (replica
    1's data): on replica 0 it gets no gradient at all."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + torch.tanh(self.lin(x))
        if bool(x[:, 0].max() > 50):
            out = out + 0.5 * torch.tanh(self.extra(x)) * 1e-2
        return out


def check_unused_on_one_replica(name: str, pp: int, kind: str, no_sync: bool) -> None:
    """A branch that only replica 1's data takes: its parameters' gradients are replica 1's over
    the replicas (the mean with replica 0's nothing), None nowhere; with `no_sync` two steps inside
    then one outside."""
    groups = ParallelGroups(pp=pp)
    dp = groups.dp
    sched = make_schedule(name, pp, 2 * pp)
    n = sched.num_stages
    stages = {s: SometimesBlock(s, kind) for s in sched.stages_on(groups.pp_rank)}
    refs = [[SometimesBlock(s) for s in range(n)] for _ in range(dp)]
    pipe = Pipeline(stages, sched, mse, groups=groups)
    rows = 2 * sched.num_microbatches + 1

    def batch(step: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = data(step, rows, d)
        x[:, 0] += 100.0 * d  # replica 1: every microbatch takes the branch, at every stage
        return x, y

    for step in range(3):
        with pipe.no_sync() if no_sync and step < 2 else contextlib.nullcontext():
            pipe.step(*batch(step, groups.dp_rank))
        for d, r in enumerate(refs):
            h, y = batch(step, d)
            for b in r:
                h = b(h)
            mse(h, y).backward()
        if no_sync and step < 2:
            continue
        want = averaged_reference(refs, stages)
        for key, p in _named(stages).items():
            check_close(f"{name} {kind} step {step} rank {dist.get_rank()} {key}", p.grad, want[key])
        for q in [*pipe.parameters(), *(q for r in refs for b in r for q in b.parameters())]:
            q.grad = None
