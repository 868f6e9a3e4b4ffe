"""What every rank runs in test_order_frozen_tied_and_failed_steps.py: runtime behaviours that
plausible one-line bugs used to slip past (see that file's docstring). Module-level functions, so the harness can ship them.

Every check compares with one process running the whole model on the whole batch, in float64:
``rtol=1e-10, atol=1e-12`` (the pipeline sums per-microbatch gradients where the reference does one
GEMM over the batch, ~1e-15 relative apart; a lost, doubled or mispaired microbatch, a missed or
doubled reduction, is >= 1/m or 1/dp relative off).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zbpp import Pipeline
from zbpp.modules import Linear as ZLinear
from zbpp.modules import current_microbatch
from zbpp.runtime import ParallelGroups, PipelineError
from zbpp.runtime.grad_reduce import GradReducer
from zbpp.schedules import Action, Kind, Schedule, validate
from zbpp.schedules.dag import data_consumers, data_dependencies
from zbpp.schedules.ir import from_orders

from .cases import make_schedule
from .feature_cases import V, H, make_wte
from .feature_cases import batch as lm_batch
from .feature_cases import loss_fn as lm_loss
from .models import make_batch, make_stage, reference_step
from .models import loss_fn as mse

TOL = {"rtol": 1e-10, "atol": 1e-12}


def close(what: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    assert (got is None) == (want is None), f"{what}: {'a tensor' if got is not None else None} vs reference {want}"
    if got is not None:
        assert torch.allclose(got, want, **TOL), f"{what}: largest difference {float((got - want).abs().max()):.3g}"


# -- schedules whose stages take their microbatches in different orders -----------------------
def reordered_schedule(placement: tuple[int, ...], m: int) -> Schedule:
    """A valid schedule on `placement` where odd stages run F and B in decreasing microbatch order
    and even stages in increasing order, so every stage takes its inputs in another order than the
    previous stage produced them (same-rank hand-overs of a V included). (s + j) % 3 == 0 runs BW,
    the rest B and W; W of stage s waits until all of its B ran, then goes in increasing order."""
    S = len(placement)
    tasks = []
    for s in range(S):
        for j in range(m):
            tasks += [Action(Kind.F, s, j)] + ([Action(Kind.BW, s, j)] if (s + j) % 3 == 0
                                               else [Action(Kind.B, s, j), Action(Kind.W, s, j)])
    present = set(tasks)

    def priority(t: Action) -> tuple:
        j = t.microbatch if t.stage % 2 == 0 else m - 1 - t.microbatch
        return ({Kind.F: 1, Kind.B: 0, Kind.BW: 0, Kind.W: 2}[t.kind], j, t.stage)

    waiting = {t: len(data_dependencies(t, S, present)) for t in tasks}
    ready = [t for t in tasks if waiting[t] == 0]
    order: list[Action] = []
    while ready:  # a topological order of the data DAG: B first, then F, then W; each by its priority
        ready.sort(key=priority)
        t = ready.pop(0)
        order.append(t)
        for c in data_consumers(t, S, present):
            waiting[c] -= 1
            if waiting[c] == 0:
                ready.append(c)
    orders = [[a for a in order if placement[a.stage] == r] for r in range(max(placement) + 1)]
    sched = validate(from_orders("reordered", placement, m, orders))
    for s in range(1, S):  # the point of the case: each stage's F order differs from its producer's
        mine = [a.microbatch for r in orders for a in r if a.stage == s and a.kind is Kind.F]
        prev = [a.microbatch for r in orders for a in r if a.stage == s - 1 and a.kind is Kind.F]
        assert mine != prev, (s, mine, prev)
    return sched


def hand_built_v_schedule() -> Schedule:
    """p=2, V placement (rank 0: stages 0 and 3, rank 1: stages 1 and 2), m=3, hand-written: stage 2
    takes its activations from stage 1 (same rank) in the order 2, 0, 1 and stage 1 its gradients
    from stage 2 (same rank) in the order 1, 2, 0, neither the order they were produced in."""
    r0 = ("F0.0 F0.1 F0.2 F3.2 B3.2 F3.0 BW3.0 F3.1 B3.1 W3.2 W3.1 "
          "B0.1 B0.2 BW0.0 W0.2 W0.1")
    r1 = ("F1.0 F1.1 F1.2 F2.2 F2.0 F2.1 B2.2 BW2.0 B2.1 "
          "B1.1 W2.1 B1.2 W2.2 BW1.0 W1.2 W1.1")
    orders = [[Action.parse(a) for a in r.split()] for r in (r0, r1)]
    return validate(from_orders("hand-v", (0, 1, 1, 0), 3, orders))


# -- frozen parameters, tied parameters owned by delayed-wgrad layers --------------------------
class SlowW(nn.Module):
    """A delayed-wgrad module without parameters whose W takes `seconds`: the stage's W then ends
    well after its last B, so a tied weight reduced before its W (a bug) is reduced without W's part
    whatever the timing of the other rank."""

    delay_wgrad_compute = True

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def backward_dw(self, key: Any = None) -> None:
        time.sleep(self.seconds)

    def get_backward_dw_params(self) -> list[nn.Parameter]:
        return []


class LMStage(nn.Module):
    """Stage `s` of `n` of a tiny language model: the embedding lookup (s == 0), a residual tanh
    layer (a zbpp delayed Linear, or torch's), and on the last stage an LM head that is a zbpp
    delayed-wgrad Linear (eager in the "plain" reference) whose weight IS the embedding `wte`
    (tied: W owes its gradient)."""

    def __init__(self, s: int, n: int, kind: str, wte: nn.Parameter | None, slow_w: float = 0.0) -> None:
        super().__init__()
        self.first, self.last = s == 0, s == n - 1
        if slow_w and self.last:
            self.slow = SlowW(slow_w)  # first in modules(): W sleeps before the head's W adds
        torch.manual_seed(100 + s)
        lin = nn.Linear(H, H, dtype=torch.float64)
        self.extra = nn.Linear(H, H, dtype=torch.float64)  # plain: frozen in some cases
        if kind == "zbpp" or (kind == "mixed" and s % 2 == 0):
            z = ZLinear(H, H, delay_wgrad_compute=True, params_dtype=torch.float64)
            z.load_state_dict(lin.state_dict())
            lin = z
        self.lin = lin
        if self.first:
            self.wte = wte
        if self.last:
            # the reference ("plain") runs it eagerly: one process, no W
            self.head = ZLinear(H, V, bias=False, delay_wgrad_compute=kind != "plain", params_dtype=torch.float64)
            self.head.weight = wte  # the same Parameter object as the embedding's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = F.embedding(x, self.wte)
        x = x + torch.tanh(self.lin(x)) + 0.5 * self.extra(x)
        return self.head(x) if self.last else x


def freeze(stage: nn.Module, s: int, pattern: str) -> None:
    """Freeze parameters of stage `s` (the same on the pipeline and the reference):
    'weight': the zbpp/torch layer's weight on even stages, its bias on odd ones, and the plain
    extra layer's weight; 'all-lin': every parameter of `lin` (a delayed layer owing nothing);
    'wte': the tied embedding/head weight."""
    if pattern == "weight":
        getattr(stage.lin, "weight" if s % 2 == 0 else "bias").requires_grad_(False)
        stage.extra.weight.requires_grad_(False)
    elif pattern == "all-lin":
        for p in stage.lin.parameters():
            p.requires_grad_(False)
    elif pattern == "wte":
        if hasattr(stage, "wte"):
            stage.wte.requires_grad_(False)
        if hasattr(stage, "head"):
            stage.head.weight.requires_grad_(False)
    elif pattern != "none":
        raise ValueError(pattern)


def _named(stages: dict[int, nn.Module]) -> dict[str, nn.Parameter]:
    return {f"{s}.{n}": p for s, st in stages.items() for n, p in st.named_parameters(remove_duplicate=False)}


def check_lm(name: str, pp: int, kind: str, frozen: str = "none", dp: int = 1, m: int | None = None,
             slow_w: float = 0.0, user_reducer: bool = False, alias: bool = False) -> dict[str, int]:
    """Two SGD steps of the tied LM through `Pipeline` (dp replicas of pp ranks; the head's weight
    is the tied embedding, computed by W) against one process per replica, averaged. Frozen
    parameters must stay without gradient and never be reduced. `user_reducer`: the caller's own
    `GradReducer` (``reducer=``), built leaving the tie out. `alias`: every holder passes its copy
    under a second name too. Returns the reducer's counts."""
    groups = ParallelGroups(pp=pp) if dp > 1 else None
    pp_rank = groups.pp_rank if groups else dist.get_rank()
    replica = groups.dp_rank if groups else 0
    sched = make_schedule(name, pp, m or 2 * pp)
    n = sched.num_stages
    mine = sched.stages_on(pp_rank)
    wte = make_wte(None if 0 in mine else 0.0) if (0 in mine or n - 1 in mine) else None
    stages = {s: LMStage(s, n, kind, wte if s in (0, n - 1) else None, slow_w) for s in mine}
    refs = []
    for _ in range(dp):
        w = make_wte()
        refs.append([LMStage(s, n, "plain", w if s in (0, n - 1) else None) for s in range(n)])
    for s, st in stages.items():
        freeze(st, s, frozen)
    for r in refs:
        for s in range(n):
            freeze(r[s], s, frozen)
    tied = ({"wte": wte, "alias": wte} if alias else {"wte": wte}) if wte is not None else None
    reducer = GradReducer(stages, groups, exclude={id(p) for p in (tied or {}).values()}) if user_reducer else None
    pipe = Pipeline(stages, sched, lm_loss, tied_parameters=tied, groups=groups, reducer=reducer)
    for st in stages.values():  # a frozen parameter is not listed as owed by W
        for mod in st.modules():
            getter = getattr(mod, "get_backward_dw_params", None)
            if callable(getter):
                assert all(q.requires_grad for q in getter()), f"{type(mod).__name__} lists a frozen parameter"
    case = f"{name} pp={pp} dp={dp} {kind} frozen={frozen} rank {dist.get_rank()}"
    for step in range(2):
        x, y = lm_batch(step, 2 * sched.num_microbatches + 1, replica)
        pipe.step(x, target=y)
        for d, ref in enumerate(refs):
            h: Any = lm_batch(step, 2 * sched.num_microbatches + 1, d)[0]
            for st in ref:
                h = st(h)
            lm_loss(h, lm_batch(step, 2 * sched.num_microbatches + 1, d)[1]).backward()
        want = {f"{s}.{k}": [dict(r[s].named_parameters(remove_duplicate=False))[k].grad for r in refs]
                for s in mine for k, _ in stages[s].named_parameters(remove_duplicate=False)}
        for key, p in _named(stages).items():
            gs = want[key]
            if not p.requires_grad:
                assert p.grad is None, f"{case} step {step}: frozen {key} got a gradient"
                continue
            close(f"{case} step {step} {key}", p.grad, sum(gs) / dp)
        with torch.no_grad():
            for q in pipe.parameters():
                if q.grad is not None:
                    q.sub_(0.5 * q.grad)
                    q.grad = None
            for qs in zip(*(list(nn.ModuleList(ref).parameters()) for ref in refs)):  # each once
                if qs[0].grad is not None:  # the replicas step with their average, as the pipeline's do
                    g = sum(q.grad for q in qs) / dp
                    for q in qs:
                        q.sub_(0.5 * g)
                        q.grad = None
    counts = pipe.reducer.reduce_counts() if pipe.reducer is not None else {}
    frozen_names = {f"stage {s} '{k}'" for s, st in stages.items() for k, q in st.named_parameters() if not q.requires_grad}
    assert not frozen_names & set(counts), f"{case}: frozen parameters reduced: {frozen_names & set(counts)}"
    assert all(v == 1 for v in counts.values()), f"{case}: {counts}"
    return counts


# -- failures ----------------------------------------------------------------------------------
class _Failing(nn.Module):
    """Wraps a stage: raises in the forward of microbatch `mb` when armed, after `delay` seconds."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.armed: tuple[int, float, str] | None = None

    def forward(self, *args: Any) -> Any:
        if self.armed is not None and current_microbatch()[1] == self.armed[0]:
            time.sleep(self.armed[1])
            raise RuntimeError(self.armed[2])
        return self.inner(*args)


def check_first_failure_named() -> str:
    """p=2 1f1b, m=4: rank 1 fails in F(1, 0) at once; rank 0 fails 0.5 s later in F(0, 2) (its
    inputs need nothing from rank 1). Every rank's error names rank 1's failure as the first."""
    rank = dist.get_rank()
    sched = make_schedule("1f1b", 2, 4)
    S = sched.num_stages
    stages = {s: _Failing(make_stage(s, S, "zbpp")) for s in sched.stages_on(rank)}
    pipe = Pipeline(stages, sched, mse)
    x, y = make_batch(0, 8)
    pipe.step(x, target=y)  # a good step first: shapes known
    st = stages[sched.stages_on(rank)[0]]
    st.armed = (0, 0.0, "rank one failed first") if rank == 1 else (2, 0.5, "rank zero failed later")
    try:
        pipe.step(x, target=y)
    except PipelineError as exc:
        msg = str(exc)
    else:
        raise AssertionError(f"rank {rank}: a failed step returned")
    finally:
        st.armed = None
    first = msg.split("Every rank")[0]
    assert "rank one failed first" in first and "rank zero failed later" not in first, f"rank {rank}: {msg}"
    assert "1 more rank(s) failed after it" in msg, msg
    return msg


def check_waiting_rank_sees_broken_job(report_dir: str) -> None:
    """dp=2 x pp=2 (ranks 0, 1: replica 0; 2, 3: replica 1), a step inside no_sync() (the replicas do
    not talk during it): replica 1 finishes and waits in the end agreement; 1 s later rank 0 dies in a
    forward. Rank 1 sees the broken channel and marks the job broken; the waiting ranks must raise
    within seconds (the agreement looks for the mark while it waits), not at the group's timeout."""
    groups = ParallelGroups(pp=2)
    rank = dist.get_rank()
    sched = make_schedule("1f1b", 2, 4)
    S = sched.num_stages
    dying = {"on": False}

    class Dying(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: Any) -> Any:
            if dying["on"] and rank == 0 and current_microbatch() == (0, 1):
                time.sleep(1.0)
                os._exit(3)
            return self.inner(*args)

    stages = {s: Dying(make_stage(s, S, "plain")) for s in sched.stages_on(groups.pp_rank)}
    pipe = Pipeline(stages, sched, mse, groups=groups)
    x, y = make_batch(groups.dp_rank, 8)
    pipe.step(x, target=y)
    dying["on"] = True
    t0 = time.monotonic()
    out: dict[str, Any] = {"rank": rank}
    try:
        with pipe.no_sync():
            pipe.step(x, target=y)
        out["result"] = "success"
    except PipelineError as exc:
        out.update(result="PipelineError", message=str(exc))
    out["seconds"] = time.monotonic() - t0
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)


def _fused_dp_pipeline(name: str, kind: str) -> tuple[Any, Any, dict, list, dict]:
    """dp=2 x pp=2 stages of `kind` whose zbpp Linears accumulate into main_grad, a plain reference
    per replica, and a Pipeline whose loss raises on the last microbatch while ``armed["on"]``."""
    groups = ParallelGroups(pp=2)
    sched = make_schedule(name, 2, 4)
    S = sched.num_stages
    stages = {s: make_stage(s, S, kind).double() for s in sched.stages_on(groups.pp_rank)}
    for st in stages.values():
        for mod in st.modules():
            if isinstance(mod, ZLinear):
                mod.fuse_wgrad_accumulation = True
    refs = [[make_stage(s, S, "plain").double() for s in range(S)] for _ in range(2)]
    armed = {"on": False}

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if armed["on"] and current_microbatch()[1] == sched.num_microbatches - 1:
            raise RuntimeError("injected loss failure")
        return mse(out, target)

    return groups, Pipeline(stages, sched, loss, groups=groups), stages, refs, armed


def check_failed_step_with_main_grad(name: str, kind: str = "zbpp") -> None:
    """dp=2 x pp=2, zbpp Linears with fuse_wgrad_accumulation (their weights' gradients live in
    main_grad, views into the reducer's buckets). Step 1 succeeds; step 2 fails on replica 0's last
    stage in the loss of its last microbatch (after W's have added into main_grad); step 3 runs
    inside no_sync(), step 4 outside: the gradients must be the replicas' average of the sum of
    steps 3 and 4, as one process per replica computes them (nothing of step 2 left behind).
    kind "fifo": Transformer-Engine-like Linears (FIFO W, main_grad from the reducer): the wgrads
    the failed step left pending must be dropped, not taken by the next step's W."""
    groups, pipe, stages, refs, armed = _fused_dp_pipeline(name, kind)
    with_main = [p for st in stages.values() for p in st.parameters() if hasattr(p, "main_grad")]
    assert with_main, "no parameter got a main_grad: the case tests nothing"

    def data(step: int, replica: int) -> Any:
        (x, ids, tag), y = make_batch(10 * step + replica, 12)
        return (x.double(), ids, tag), y.double()

    for step in range(4):
        inp, tgt = data(step, groups.dp_rank)
        armed["on"] = step == 1 and groups.dp_rank == 0 and pipe.holds_last_stage
        try:
            if step == 2:
                with pipe.no_sync():
                    pipe.step(inp, target=tgt)
            else:
                pipe.step(inp, target=tgt)
            assert step != 1, "the failed step returned"
        except PipelineError:
            assert step == 1
        armed["on"] = False
        if step < 2:  # steps 1 and 2 do not count: start afresh as a training loop would
            for st in stages.values():
                st.zero_grad(set_to_none=True)
            continue
        for d, ref in enumerate(refs):
            reference_step(ref, *data(step, d))
    for s, st in stages.items():
        for (n, p), (_, q0), (_, q1) in zip(st.named_parameters(), refs[0][s].named_parameters(),
                                            refs[1][s].named_parameters()):
            got = p.main_grad if hasattr(p, "main_grad") else p.grad
            close(f"{name} rank {dist.get_rank()} stage {s} {n}", got, (q0.grad + q1.grad) / 2)


def check_failed_step_after_no_sync(kind: str) -> None:
    """dp=2 x pp=2, zb-h1: step 1 inside no_sync() accumulates; step 2 (outside, so it would reduce
    what step 1 left in place) fails on replica 0's last stage: every gradient, ``.grad`` and
    ``main_grad``, must be step 1's own again (unreduced); step 3 then reduces steps 1 and 3 once."""
    groups, pipe, stages, refs, armed = _fused_dp_pipeline("zb-h1", kind)

    def data(step: int, replica: int) -> Any:
        (x, ids, tag), y = make_batch(10 * step + replica, 12)
        return (x.double(), ids, tag), y.double()

    def grads() -> list[tuple[str, torch.Tensor | None]]:
        return [(f"stage {s} {n}", p.main_grad if hasattr(p, "main_grad") else p.grad)
                for s, st in stages.items() for n, p in st.named_parameters()]

    me = groups.dp_rank
    with pipe.no_sync():
        pipe.step(*data(0, me)[:1], target=data(0, me)[1])
    for d, ref in enumerate(refs):
        reference_step(ref, *data(0, d))
    armed["on"] = me == 0 and pipe.holds_last_stage
    try:
        pipe.step(*data(1, me)[:1], target=data(1, me)[1])
        raise AssertionError("the failed step returned")
    except PipelineError:
        pass
    finally:
        armed["on"] = False
    mine = [q.grad for s in stages for q in refs[me][s].parameters()]
    for (what, got), want in zip(grads(), mine):
        close(f"{kind} rank {dist.get_rank()} after the failed step, {what}", got, want)
    pipe.step(*data(2, me)[:1], target=data(2, me)[1])
    for d, ref in enumerate(refs):
        reference_step(ref, *data(2, d))
    avg = [(a.grad + b.grad) / 2 for s in stages for a, b in zip(refs[0][s].parameters(), refs[1][s].parameters())]
    for (what, got), want in zip(grads(), avg):
        close(f"{kind} rank {dist.get_rank()} after the next step, {what}", got, want)


def check_nested_no_sync() -> None:
    """dp=2 pipelines of one rank: nested no_sync(): after the inner block ends, a step still inside
    the outer one must not reduce; the step after both reduces everything once."""
    groups = ParallelGroups(pp=1)
    sched = make_schedule("zb-h1", 1, 2)
    st = make_stage(0, 1, "zbpp").double()
    refs = [make_stage(0, 1, "plain").double() for _ in range(2)]
    pipe = Pipeline({0: st}, sched, mse, groups=groups)

    def data(step: int, replica: int) -> Any:
        (x, ids, tag), y = make_batch(10 * step + replica, 6)
        return (x.double(), ids, tag), y.double()

    with pipe.no_sync():
        with pipe.no_sync():
            pipe.step(*data(0, groups.dp_rank)[:1], target=data(0, groups.dp_rank)[1])
        pipe.step(*data(1, groups.dp_rank)[:1], target=data(1, groups.dp_rank)[1])
        for d, ref in enumerate(refs):
            for step in (0, 1):
                reference_step([ref], *data(step, d))
        for (n, p), (_, q) in zip(st.named_parameters(), refs[groups.dp_rank].named_parameters()):
            close(f"inside the outer no_sync, {n} (this replica's own)", p.grad, q.grad)
    pipe.step(*data(2, groups.dp_rank)[:1], target=data(2, groups.dp_rank)[1])
    for d, ref in enumerate(refs):
        reference_step([ref], *data(2, d))
    for (n, p), (_, q0), (_, q1) in zip(st.named_parameters(), refs[0].named_parameters(), refs[1].named_parameters()):
        close(f"after no_sync, {n} (the replicas' average)", p.grad, (q0.grad + q1.grad) / 2)


# -- empty tensors between stages ----------------------------------------------------------------
class EmptyOut(nn.Module):
    """Returns (h, an empty tensor needing grad, an empty int tensor, h2): every stage reads the
    empty ones' shapes (a skipped receive would misalign the tensors after them)."""

    def __init__(self, s: int, n: int) -> None:
        super().__init__()
        torch.manual_seed(50 + s)
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.last = s == n - 1

    def forward(self, h: torch.Tensor, e: torch.Tensor | None = None, k: torch.Tensor | None = None,
                h2: torch.Tensor | None = None) -> Any:
        if e is not None:
            assert e.shape == (h.shape[0], 0) and k.shape == (0,) and k.dtype == torch.int64, (e.shape, k.shape)
            h = h + h2 + e.sum()
        h = torch.tanh(self.lin(h))
        if self.last:
            return h
        return h, h[:, :0], torch.zeros(0, dtype=torch.int64), 0.5 * h


def check_empty_tensors(name: str, p: int) -> None:
    rank = dist.get_rank()
    sched = make_schedule(name, p, 2 * p)
    S = sched.num_stages
    stages = {s: EmptyOut(s, S) for s in sched.stages_on(rank)}
    ref = [EmptyOut(s, S) for s in range(S)]
    pipe = Pipeline(stages, sched, mse)
    for step in range(2):  # the first step sends the shapes ahead, the second posts from them
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * p, 4, generator=g, dtype=torch.float64), torch.randn(4 * p, 4, generator=g, dtype=torch.float64)
        loss = pipe.step(x, target=y)
        h: Any = x
        for st in ref:
            h = st(*h) if isinstance(h, tuple) else st(h)
        want = mse(h, y)
        want.backward()
        if pipe.holds_last_stage:
            close(f"{name} step {step} loss", loss, want.detach())
        for s, st in stages.items():
            for (n, a), (_, b) in zip(st.named_parameters(), ref[s].named_parameters()):
                close(f"{name} step {step} stage {s} {n}", a.grad, b.grad)



def check_reducer_with_the_tie() -> str:
    """dp=2 x pp=2 (1f1b), the tied LM, and ``reducer=`` a `GradReducer` built over every stage
    parameter, the tie included: both it and the pipeline's tie would reduce the tied weight, in
    flight together on one tensor (wrong, even different, copies' gradients). Returns the error
    `Pipeline` raised on this rank ('' if none)."""
    groups = ParallelGroups(pp=2)
    sched = make_schedule("1f1b", 2, 4)
    n = sched.num_stages
    wte = make_wte()
    stages = {s: LMStage(s, n, "plain", wte if s in (0, n - 1) else None) for s in sched.stages_on(groups.pp_rank)}
    try:
        Pipeline(stages, sched, lm_loss, tied_parameters={"wte": wte}, groups=groups,
                 reducer=GradReducer(stages, groups))
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return f"{type(exc).__name__}: {exc}"
    return ""


def check_tie_named_twice() -> str:
    """dp=2 replicas of a pp=2 1f1b tied LM (`check_lm`), every holder passing its copy as
    ``{"wte": w, "alias": w}``: each name is a tie of its own, so the two would all-reduce (and
    divide by the replicas) the one gradient twice, in flight together. Returns what `check_lm`
    raised on this rank ('' if its gradients equalled the reference's)."""
    try:
        check_lm("1f1b", 2, "plain", dp=2, alias=True)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return f"{type(exc).__name__}: {exc}"
    return ""


def check_frozen_on_one_replica() -> str:
    """2 replicas of a one-rank pipeline: replica 0 freezes the first layer's bias, replica 1 the
    second's (as many elements), so their reducers' buckets differ by slot and the all-reduce adds
    one replica's gradient of a layer into the other's of another (off by ~0.2, no error). Returns
    the error the step raised on this rank ('' if none)."""
    from zbpp.schedules import build

    groups = ParallelGroups(pp=1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), nn.Linear(4, 4, dtype=torch.float64))
    net[groups.dp_rank].bias.requires_grad_(False)
    pipe = Pipeline({0: net}, build("1f1b", num_ranks=1, num_microbatches=2), mse, groups=groups)
    try:
        pipe.step(torch.ones(4, 4, dtype=torch.float64), target=torch.zeros(4, 4, dtype=torch.float64))
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return f"{type(exc).__name__}: {exc}"
    return ""


class WrongWgradParams(nn.Module):
    """A delayed-wgrad layer whose ``get_backward_dw_params`` lists a copy of its weight, not the
    Parameter (the data-parallel reducer refuses it when it is built)."""

    delay_wgrad_compute = True

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, H, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def backward_dw(self, key: Any = None) -> None:
        pass

    def get_backward_dw_params(self) -> list[torch.Tensor]:
        return [self.weight.detach().clone()]


def check_wrong_on_one_rank(what: str) -> str:
    """Rank 1 passes wrong stage modules (``"stages"``: rank 0's stage 0 instead of its stage 1), a
    wrong tie (``"tie"``: a Parameter none of its stages holds), or a tie it froze alone
    (``"frozen-tie"``: rank 0's copy trains), or another schedule (``"schedule"``: 2 microbatches
    instead of 4); rank 0 is right. ``"wgrad-params"``: two data-parallel
    replicas of a one-rank pipeline, rank 1's stage holding a `WrongWgradParams` (refused when the
    data-parallel reducer is built, after the checks of the stage modules). Returns the error each
    rank raised from `Pipeline` ('' if none), its type, and how long it took."""
    if what == "wgrad-params":
        sched = make_schedule("1f1b", 1, 2)
        stage = nn.Sequential(LMStage(0, 1, "plain", make_wte()))
        if dist.get_rank() == 1:
            stage.append(WrongWgradParams())
        start = time.monotonic()
        try:
            Pipeline({0: stage}, sched, lm_loss, groups=ParallelGroups(pp=1))
        except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
            return f"{time.monotonic() - start:.1f}s {type(exc).__name__}: {exc}"
        return ""
    wrong = dist.get_rank() == 1
    sched = make_schedule("1f1b", 2, 2 if wrong and what == "schedule" else 4)
    n = sched.num_stages
    wte = make_wte()
    mine = sched.stages_on(0) if wrong and what == "stages" else sched.stages_on(dist.get_rank())
    stages = {s: LMStage(s, n, "plain", wte if s in (0, n - 1) else None) for s in mine}
    tied = {"wte": torch.nn.Parameter(torch.zeros(3)) if wrong and what == "tie" else wte}
    if wrong and what == "frozen-tie":
        wte.requires_grad_(False)
    start = time.monotonic()
    try:
        Pipeline(stages, sched, lm_loss, tied_parameters=tied)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return f"{time.monotonic() - start:.1f}s {type(exc).__name__}: {exc}"
    return ""


def check_ctrl_c_while_building() -> str:
    """2 ranks build the tied LM's pipeline; rank 0 comes a second late to the exchange of who holds
    which tie (`TiedParameters._exchange`), and rank 1, waiting there, gets a real SIGINT (Ctrl-C).
    Returns what building raised on this rank ("ok": nothing); then both ranks build it again and
    take a step, whose loss (on rank 1) must be one process's (equal up to `TOL`: float64)."""
    import signal
    import threading

    from zbpp.runtime.tied import TiedParameters

    rank = dist.get_rank()
    sched = make_schedule("1f1b", 2, 4)
    n = sched.num_stages

    def build() -> Pipeline:
        wte = make_wte()
        stages = {s: LMStage(s, n, "plain", wte if s in (0, n - 1) else None) for s in sched.stages_on(rank)}
        return Pipeline(stages, sched, lm_loss, tied_parameters={"wte": wte})

    real = TiedParameters.__dict__["_exchange"]

    def exchange(agreement: Any, held: Any) -> Any:
        if rank == 0:
            time.sleep(1.0)  # rank 1 waits for it in the exchange
        else:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        return real.__func__(agreement, held)

    TiedParameters._exchange = staticmethod(exchange)  # type: ignore[method-assign]
    try:
        build()
        got = "ok"
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the test reads the type and the message
        got = f"{type(exc).__name__}: {exc}"
    finally:
        TiedParameters._exchange = real  # type: ignore[method-assign]
    time.sleep(0.5)  # no SIGINT still on its way
    x, y = lm_batch(0, 8)
    loss = build().step(x, target=y)
    if loss is not None:
        h: Any = x
        for st in [LMStage(s, n, "plain", w) for w in [make_wte()] for s in range(n)]:
            h = st(h)
        torch.testing.assert_close(loss, lm_loss(h, y), **TOL)
    return got
