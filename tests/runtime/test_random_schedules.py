"""The runtime runs any valid `Schedule`, not only the built-in ones.

Hypothesis makes random valid schedules: a placement (one stage per rank, interleaved with two
chunks, or the V), a number of microbatches below, at and above the number of ranks, for every
(stage, microbatch) either one BW or a B and a W (mixed within a stage), and a random topological
order of the task DAG (`zbpp.schedules.dag`), cut into one order per rank. Any valid schedule is one
of these (a valid schedule's graph is acyclic, so it has a topological order), and they run F's and
B's of a stage in microbatch orders no generator uses. Each runs on 2, 3 or 4 gloo ranks through
the public `Pipeline` API for two SGD steps and is compared with one process running the whole model
on the whole batch (tests/runtime/models.py: tuple/dict/list stage outputs, an int64 tensor and a
non-tensor value between stages; plain, zbpp delayed-wgrad or mixed Linears).

Everything is float64. Tolerance rtol=1e-10, atol=1e-12: the pipeline sums per-microbatch
gradients (each scaled by rows_j / rows) where the reference does one whole-batch GEMM, so they
differ only by rounding of a different summation order (~1e-16 relative per add, a few hundred
adds); a lost, doubled or mispaired microbatch moves a gradient by >= 1/m relative.

CI runs 2 derandomized examples with m <= p and 2 with m > p per world size (a fixed sequence,
stable across runs; each world size's ranks are spawned once); set
``ZBPP_HYPOTHESIS_PROFILE=thorough`` for 40 random ones of each.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zbpp import Pipeline
from zbpp.schedules import Action, Kind, Schedule, validate
from zbpp.schedules.dag import data_consumers, data_dependencies
from zbpp.schedules.ir import from_orders, loop_placement, v_placement

from .models import loss_fn, make_batch, make_stage, reference_step

TOL = {"rtol": 1e-10, "atol": 1e-12}
LR = 0.1

_PROFILES = {
    "ci": settings(max_examples=4, derandomize=True, deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]),
    "thorough": settings(max_examples=40, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]),
}
PROFILE = _PROFILES[os.environ.get("ZBPP_HYPOTHESIS_PROFILE", "ci")]


@st.composite
def random_schedules(draw: st.DrawFn, num_ranks: int, microbatches: tuple[int, int]) -> Schedule:
    """A random valid schedule on `num_ranks` ranks with `microbatches` (low, high) microbatches
    (see the module docstring)."""
    p = num_ranks
    shape = draw(st.sampled_from(["v", "one-stage", "interleaved"]))
    placement = {"one-stage": loop_placement(p), "interleaved": loop_placement(p, 2), "v": v_placement(p)}[shape]
    S = len(placement)
    m = draw(st.integers(*microbatches))
    tasks: list[Action] = []
    for s in range(S):
        for j in range(m):
            split = draw(st.booleans())
            tasks += [Action(Kind.F, s, j)] + ([Action(Kind.B, s, j), Action(Kind.W, s, j)] if split else [Action(Kind.BW, s, j)])
    present = set(tasks)
    waiting = {t: len(data_dependencies(t, S, present)) for t in tasks}
    ready = [t for t in tasks if waiting[t] == 0]
    order: list[Action] = []
    while ready:  # a random topological order of the data DAG: any ready task may run next
        t = ready.pop(draw(st.integers(0, len(ready) - 1)))
        order.append(t)
        for c in data_consumers(t, S, present):
            waiting[c] -= 1
            if waiting[c] == 0:
                ready.append(c)
    assert len(order) == len(tasks)
    orders = [[a for a in order if placement[a.stage] == r] for r in range(p)]
    return validate(from_orders(f"random-{shape}", placement, m, orders))


def _sgd(params: Any) -> None:
    """Plain SGD by hand: torch.optim imports torch._dynamo, ~10 s per rank on a slow machine."""
    with torch.no_grad():
        for q in params:
            if q.grad is not None:
                q.sub_(LR * q.grad)
                q.grad = None


def run_schedule_against_one_process(sched: Schedule, kind: str, rows: int) -> float:
    """On every rank: two SGD steps through `Pipeline` and through the whole model in one process;
    the loss, every gradient and every parameter must agree. Returns the largest difference."""
    rank = dist.get_rank()
    S = sched.num_stages
    mine = {s: make_stage(s, S, kind).double() for s in sched.stages_on(rank)}
    ref = [make_stage(s, S, "plain").double() for s in range(S)]
    pipe = Pipeline(mine, sched, loss_fn)
    case = f"{sched.name} p={sched.num_ranks} m={sched.num_microbatches} rows={rows} kind={kind} rank={rank}"
    worst = 0.0

    def close(what: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
        nonlocal worst
        assert (got is None) == (want is None), f"{case} {what}: {got} vs reference {want}"
        if got is not None:  # torch.allclose, not torch.testing: that imports DTensor and sympy (~5 s a rank)
            assert got.shape == want.shape and got.dtype == want.dtype, f"{case} {what}: {got.shape} vs {want.shape}"
            diff = float((got - want).abs().max()) if got.numel() else 0.0
            assert torch.allclose(got, want, **TOL), f"{case} {what}: largest difference {diff:.3g} ({TOL})"
            worst = max(worst, diff)

    for step in range(2):
        (x, ids, tag), y = make_batch(step, rows)
        inputs, target = (x.double(), ids, tag), y.double()
        loss = pipe.step(inputs, target=target)
        ref_loss = reference_step(ref, inputs, target)
        if pipe.holds_last_stage:
            close(f"step {step} loss", loss, ref_loss)
        else:
            assert loss is None, f"{case}: step() returned {loss} on a rank without the last stage"
        for s, st_ in mine.items():
            for (name, a), (_, b) in zip(st_.named_parameters(), ref[s].named_parameters()):
                close(f"step {step} stage {s} grad {name}", a.grad, b.grad)
        _sgd(pipe.parameters())
        _sgd(q for st_ in ref for q in st_.parameters())
    for s, st_ in mine.items():
        for (name, a), (_, b) in zip(st_.named_parameters(), ref[s].named_parameters()):
            close(f"after 2 steps stage {s} param {name}", a.detach(), b.detach())
    return worst


def _check(workers: Any, sched: Schedule, kind: str, extra_rows: int) -> None:
    rows = sched.num_microbatches + extra_rows  # uneven microbatches when extra_rows % m != 0
    worst = workers.run(run_schedule_against_one_process, sched, kind, rows)
    assert max(worst) < 1e-8  # the real bound is checked per tensor on the ranks


KINDS = st.sampled_from(["mixed", "zbpp", "plain"])
EXTRA_ROWS = st.integers(0, 5)


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_random_valid_schedules_match_one_process(zbpp_workers, num_ranks: int) -> None:
    p = num_ranks
    workers = zbpp_workers(p)

    @PROFILE
    @given(sched=random_schedules(p, (1, p)), kind=KINDS, extra_rows=EXTRA_ROWS)
    def few_microbatches(sched: Schedule, kind: str, extra_rows: int) -> None:
        _check(workers, sched, kind, extra_rows)

    @PROFILE
    @given(sched=random_schedules(p, (p + 1, 2 * p + 1)), kind=KINDS, extra_rows=EXTRA_ROWS)
    def many_microbatches(sched: Schedule, kind: str, extra_rows: int) -> None:
        _check(workers, sched, kind, extra_rows)

    try:
        few_microbatches()
        many_microbatches()
    finally:
        workers.close()  # three pools at once would crowd a small machine
