"""``Pipeline(cuda_graphs=True)``: graph-replayed steps against eager steps (`graph_cases`).

On a GPU (one process, one rank; two ranks over NCCL when 2 GPUs are there): bit for bit, in bf16
and FP8, into ``.grad`` and ``main_grad``, two input signatures alternating. On CPUs the graphs are
stand-ins that run each replay eagerly through the same static buffers: the bookkeeping
(capture order, static inputs and outputs, hand-over, fixed ``.grad`` buffers, signatures).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zbpp import Pipeline
from zbpp.runtime import GraphCaptureError, PipelineError, task_graphs
from zbpp.runtime.agreement import StartReport, graphs_win
from zbpp.runtime.task_graphs import StandInGraphs
from zbpp.schedules import build

from . import graph_cases

SCHEDULES = ["1f1b", "zb-h1", "zb-v"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stand_in_equals_eager_and_one_process(schedule: str) -> None:
    fails = graph_cases.compare(schedule, device="cpu", dtype=torch.float64)
    fails += graph_cases.whole_batch_reference(schedule)
    assert not fails, "\n".join(fails)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
@pytest.mark.parametrize("tied", [False, True], ids=["", "tied"])
def test_stand_in_on_two_gloo_ranks(zbpp_workers, schedule: str, tied: bool) -> None:
    per_rank = zbpp_workers(2).run(graph_cases.worker, schedule, "gloo", tied=tied)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)


@pytest.mark.timeout(300)
def test_stand_in_with_data_parallel_replicas(zbpp_workers) -> None:
    per_rank = zbpp_workers(2).run(graph_cases.worker, "zb-h1", "gloo", dp=2)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)


def _one_rank_stand_in(rows: int, outputs: int, seed: int):
    """A one-rank zb-h1 schedule of 2 microbatches, a float64 batch of 3 features (for CPU stand-in graphs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, dtype=torch.float64, generator=g)
    y = torch.randn(rows, outputs, dtype=torch.float64, generator=g)
    return build("zb-h1", num_ranks=1, num_microbatches=2), x, y


def test_stand_in_with_evaluation_and_no_sync() -> None:
    """Evaluation steps (eager) and no_sync steps between captured and replayed steps leave the
    training steps as eager ones (float64: the same sums, bit for bit)."""
    sched, x, y = _one_rank_stand_in(rows=8, outputs=2, seed=2)
    seen = {}
    for graphs in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 4, dtype=torch.float64), nn.Tanh(), nn.Linear(4, 2, dtype=torch.float64))
        pipe = Pipeline({0: m}, sched, loss_fn=nn.functional.mse_loss, cuda_graphs=StandInGraphs if graphs else False)
        out = []
        for i in range(5):
            m.zero_grad()
            if i % 2:
                with pipe.no_sync():
                    out.append(pipe.step(x, y))
            else:
                out.append(pipe.step(x, y))
            out.append(pipe.eval_step(x))
            out += [p.grad.clone() for p in m.parameters()]
        seen[graphs] = out
        assert pipe.graph_forms == (["graphs"] if graphs else [])  # one input signature
    assert all(torch.equal(a, b) for a, b in zip(seen[False], seen[True]))


def test_signatures_kept_are_bounded_and_recaptured() -> None:
    """At most MAX_GRAPHED_SIGNATURES signatures keep graphs (least recently used dropped); one
    that comes back after being dropped captures again; task records cover replayed tasks."""
    sched = build("zb-h1", num_ranks=1, num_microbatches=2)
    pipe = Pipeline({0: nn.Linear(3, 1, dtype=torch.float64)}, sched, loss_fn=nn.functional.mse_loss,
                    cuda_graphs=StandInGraphs, record_task_times=True)
    replays = graph_cases.replay_counter(pipe)
    kept = pipe._graph_cache.graphs
    limit = task_graphs.MAX_GRAPHED_SIGNATURES
    rows = [2 * (i + 1) for i in range(limit + 1)]
    for _ in range(2):  # each signature: eager, then captured
        for r in rows:
            pipe.step(torch.ones(r, 3, dtype=torch.float64), torch.zeros(r, 1, dtype=torch.float64))
    assert len(kept) == limit
    assert all(replays[id(g)] == 0 for g in kept.values())
    pipe.step(torch.ones(rows[-1], 3, dtype=torch.float64), torch.zeros(rows[-1], 1, dtype=torch.float64))
    assert [replays[id(g)] for g in kept.values()][-1] == 1  # kept: replayed
    pipe.step(torch.ones(rows[0], 3, dtype=torch.float64), torch.zeros(rows[0], 1, dtype=torch.float64))
    newest = list(kept.values())[-1]
    assert replays[id(newest)] == 0 and len(newest) == len(sched.orders[0])  # dropped earlier: captured again
    assert sorted(r["action"] for r in pipe.task_times()) == sorted(str(a) for a in sched.orders[0])


def test_refused_on_cpu_and_for_declared_stages() -> None:
    sched = build("1f1b", num_ranks=1, num_microbatches=2)
    with pytest.raises(ValueError, match="move the stages to a CUDA device or pass cuda_graphs=False"):
        Pipeline({0: nn.Linear(2, 2)}, sched, loss_fn=nn.functional.mse_loss, cuda_graphs=True)
    stage = nn.Sequential(nn.Linear(2, 2))
    stage[0].zbpp_cuda_graphs = False
    with pytest.raises(ValueError, match="stage 0: its submodule '0' sets zbpp_cuda_graphs = False"):
        Pipeline({0: stage}, sched, loss_fn=nn.functional.mse_loss, cuda_graphs=StandInGraphs)


def test_fixed_grad_buffers_keep_accumulation() -> None:
    """Without zero_grad between steps the gradients add up, as in eager mode; a replaced .grad is
    copied into the fixed buffer."""
    sched, x, y = _one_rank_stand_in(rows=4, outputs=1, seed=1)
    grads = {}
    for graphs in (False, True):
        torch.manual_seed(0)
        m = nn.Linear(3, 1, dtype=torch.float64)
        pipe = Pipeline({0: m}, sched, loss_fn=nn.functional.mse_loss, cuda_graphs=StandInGraphs if graphs else False)
        for _ in range(3):
            pipe.step(x, y)
        m.weight.grad = m.weight.grad * 2  # a new tensor: copied into the buffer, not lost
        pipe.step(x, y)
        grads[graphs] = m.weight.grad.clone()
    # eager adds the step's gradient to the kept one at the end, graphs accumulate into the kept
    # buffer: the same sums in another order (float64 rounding)
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-12, atol=0)


def test_grad_buffers_attach_each_case() -> None:
    """`GradBuffers.attach`, case by case: one fixed buffer per parameter that keeps ``.grad``'s
    values (zeros where it was None, reported as zeroed), skipped for frozen parameters and those
    with ``main_grad``, and a new buffer when the parameter's dtype or shape changed."""
    buffers = task_graphs.GradBuffers()
    a, frozen, fused = (nn.Parameter(torch.ones(2, dtype=torch.float64)) for _ in range(3))
    b = nn.Parameter(torch.ones(3, dtype=torch.float64))
    frozen.requires_grad_(False)
    fused.main_grad = torch.zeros(2, dtype=torch.float64)
    b.grad = torch.full((3,), 4.0, dtype=torch.float64)
    params = [a, frozen, fused, b]
    assert buffers.attach(params) == {id(a)}  # a had no .grad: a zero buffer
    buf_a, buf_b = a.grad, b.grad
    assert buf_a.tolist() == [0.0, 0.0] and buf_b.tolist() == [4.0] * 3
    assert frozen.grad is None and fused.grad is None
    buf_a.add_(5.0)  # a step's accumulation stays: no zeroing while .grad is the buffer
    assert buffers.attach(params) == set() and a.grad is buf_a and a.grad.tolist() == [5.0, 5.0]
    a.grad, b.grad = None, torch.full((3,), 7.0, dtype=torch.float64)  # zero_grad(); a new tensor
    assert buffers.attach(params) == {id(a)}
    assert a.grad is buf_a and a.grad.tolist() == [5.0, 5.0]  # zeroed once the step's runner is known
    buffers.prepare(task_graphs.EAGER, {})
    assert a.grad is buf_a and a.grad.tolist() == [0.0, 0.0]
    assert b.grad is buf_b and b.grad.tolist() == [7.0] * 3
    a.grad = None
    a.data = torch.ones(2, dtype=torch.float32)  # a new dtype: the old buffer no longer fits
    b.data = torch.ones(4, dtype=torch.float64)  # a new shape
    b.grad = None
    assert buffers.attach(params) == {id(a), id(b)}
    buffers.prepare(task_graphs.EAGER, {})
    assert a.grad is not buf_a and a.grad.dtype == torch.float32 and a.grad.tolist() == [0.0, 0.0]
    assert b.grad is not buf_b and b.grad.tolist() == [0.0] * 4


def test_grad_buffers_attach_after_zero_grad() -> None:
    """The usual step (every ``.grad`` None, every buffer there) points each ``.grad`` at its own
    buffer again; a parameter whose dtype changed meanwhile still gets a new buffer, the others
    keep theirs."""
    buffers = task_graphs.GradBuffers()
    a, b = (nn.Parameter(torch.ones(2, dtype=torch.float64)) for _ in range(2))
    assert buffers.attach([a, b]) == {id(a), id(b)}
    buf_a, buf_b = a.grad, b.grad
    a.grad = b.grad = None
    assert buffers.attach([a, b]) == {id(a), id(b)} and a.grad is buf_a and b.grad is buf_b
    a.grad = b.grad = None
    b.data = torch.ones(2, dtype=torch.float32)  # found after a's .grad was pointed at buf_a
    assert buffers.attach([a, b]) == {id(a), id(b)}
    assert a.grad is buf_a and b.grad is not buf_b and b.grad.dtype == torch.float32


def test_external_addresses_name_data_grad_and_main_grad() -> None:
    """Per parameter its data's, ``.grad``'s and ``main_grad``'s addresses (0 where there is none),
    then each buffer's."""
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    assert task_graphs.external_addresses([a, b]) == ((a.data_ptr(), b.data_ptr()), (0, 0), (0, 0), ())
    b.grad, a.main_grad, c = torch.zeros(3), torch.zeros(2), torch.ones(4)
    assert task_graphs.external_addresses([a, b], buffers=[c]) == (
        (a.data_ptr(), b.data_ptr()), (0, b.grad.data_ptr()), (a.main_grad.data_ptr(), 0), (c.data_ptr(),))


def test_failed_steps_restore_the_fixed_grad_buffers(monkeypatch) -> None:
    """A failed step puts back what the fixed .grad buffers held: the earlier gradient, or zeros
    where .grad was None before the step (those are zeroed again, never copied: no clone is taken)."""
    sched, x, y = _one_rank_stand_in(rows=4, outputs=1, seed=3)
    failing = [False]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if failing[0]:
            raise RuntimeError("this step fails")
        return nn.functional.mse_loss(out, target)

    torch.manual_seed(0)
    m = nn.Linear(3, 1, dtype=torch.float64)
    pipe = Pipeline({0: m}, sched, loss_fn=loss_fn, cuda_graphs=StandInGraphs)
    pipe.step(x, y)
    one_step = m.weight.grad.clone()
    failing[0] = True
    with pytest.raises(PipelineError, match="this step fails"):
        pipe.step(x, y)
    assert torch.equal(m.weight.grad, one_step)  # the kept gradient, bit for bit
    m.zero_grad(set_to_none=True)
    clones = []
    real_clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: clones.append(t) or real_clone(t, *a, **k))
    with pytest.raises(PipelineError, match="this step fails"):
        pipe.step(x, y)
    monkeypatch.undo()
    copied = [t.shape for t in clones if any(t is p.grad for p in m.parameters())]
    assert not copied, f"gradients known to be zero were copied: {copied}"
    assert not m.weight.grad.any() and not m.bias.grad.any()
    failing[0] = False
    pipe.step(x, y)
    assert torch.equal(m.weight.grad, one_step)  # from zeros: one step's gradient again


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
def test_graphs_bit_identical_to_eager(schedule: str, precision: str, main_grad: bool) -> None:
    fails = graph_cases.compare(schedule, fp8=precision == "fp8", main_grad=main_grad)
    assert not fails, "\n".join(fails)


class _Syncs(nn.Module):
    """Synchronises with the host (cannot be captured) while `sync` is on."""

    sync = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum().item() > 0) if self.sync else x


@cuda
@pytest.mark.gpu
def test_capture_failure_names_the_task_and_leaves_the_pipeline_usable() -> None:
    sched = build("zb-h1", num_ranks=1, num_microbatches=2)
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 4, device="cuda"), _Syncs())
    reference = nn.Linear(4, 4, device="cuda")
    reference.load_state_dict(stage[0].state_dict())
    pipe = Pipeline({0: stage}, sched, loss_fn=nn.functional.mse_loss, cuda_graphs=True)
    x, y = torch.randn(4, 4, device="cuda"), torch.randn(4, 4, device="cuda")
    pipe.step(x, y)  # eager
    stage.zero_grad()
    with pytest.raises(PipelineError, match=r"task F0\.0 could not be captured into a CUDA graph") as failed:
        pipe.step(x, y)
    assert isinstance(failed.value.__cause__, GraphCaptureError)
    assert stage[0].weight.grad is None or not stage[0].weight.grad.any()  # the failed step left nothing
    stage[1].sync = False
    for _ in range(3):  # captures again, then replays
        stage.zero_grad()
        pipe.step(x, y)
    nn.functional.mse_loss(reference(x), y).backward()
    # the pipeline sums two microbatch gradients of half the batch each: float32 rounding
    torch.testing.assert_close(stage[0].weight.grad, reference.weight.grad, rtol=1e-5, atol=1e-6)
    assert [len(g) for g in pipe._graph_cache.graphs.values()] == [len(sched.orders[0])]


@pytest.mark.nccl
@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule, dp, main_grad, tied", [("zb-h1", 1, False, True), ("zb-v", 1, True, False),
                                                           ("zb-h1", 2, True, False)])
def test_graphs_on_two_nccl_ranks(zbpp_workers, schedule: str, dp: int, main_grad: bool, tied: bool) -> None:
    """Pipelines over 2 GPUs (sends and receives between the replays), or 2 data-parallel replicas
    of a one-rank pipeline (the reduction after each stage's last W, outside the graphs)."""
    per_rank = zbpp_workers(2, backend="nccl").run(graph_cases.worker, schedule, "nccl", dp=dp, fp8=True,
                                                   main_grad=main_grad, tied=tied)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)


# -- cuda_graphs="auto" (stand-ins on CPUs, timed by a fake clock: `graph_cases.TaskClock`) -------
# zb-h1 over M=4 microbatches: each rank runs 4 F and 12 tasks a step, so an eager step takes
# 4 * per_forward and a replayed one 4 * per_forward + 12 * per_replay on the fake clock.


@pytest.mark.parametrize("per_replay, graphs, issue_share", [
    (0.5, False, None), (-0.25, True, None), (-1 / 300, False, None), (1 / 300, True, 0.6)],
    ids=["eager-faster", "graphs-faster", "graphs-1%-faster", "host-paced-graphs-1%-slower"])
def test_auto_keeps_the_faster_form_and_equals_eager(per_replay: float, graphs: bool, issue_share: float | None) -> None:
    """One rank: eager 4 against replays 10 (eager kept, graphs dropped), 1 (graphs kept) or 3.96
    (1% faster, inside the 2% margin `GRAPHS_MARGIN`: eager kept). With a host clock: replays 4.04
    (1% slower) are kept where the host's issue took 0.6 of eager's step (a host half as fast
    would set eager's pace, `HOST_SPEED_SPREAD`; the rule's other sides: `test_graphs_win_...`).
    Two signatures alternate through their trials; every step's loss and gradients equal eager
    steps'."""
    fails = graph_cases.compare_auto("zb-h1", [(1.0, per_replay, graphs, issue_share)])
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("eager, graphs, issue, kept", [
    (100, 97, 0, True), (100, 99, 0, False), (100, 101, 60, True), (100, 101, 49, False), (100, 103, 60, False),
    (100, 101, 50, True)])
def test_graphs_win_by_the_margin_or_where_the_host_sets_eager_pace(eager: int, graphs: int, issue: int,
                                                                   kept: bool) -> None:
    """`graphs_win` by hand: replays 3% faster win, 1% faster do not (`GRAPHS_MARGIN`); where the
    host's issue of an eager step is at least half of it (a host half as fast would set its pace,
    `HOST_SPEED_SPREAD`), replays up to 2% slower win and 3% slower do not; at 0.49 of it, 1% slower
    do not. The slowest rank of each form counts: a second rank's faster figures change nothing."""
    slow = StartReport(False, 0, 0, -1, -1, trial=True, eager_us=eager, graphs_us=graphs, eager_issue_us=issue)
    fast = StartReport(False, 0, 0, -1, -1, trial=True, eager_us=eager // 2, graphs_us=graphs // 2)
    assert graphs_win([slow, fast]) is kept
    assert graphs_win([fast, slow]) is kept


@pytest.mark.timeout(300)
def test_auto_every_rank_takes_the_choice_of_the_slowest(zbpp_workers) -> None:
    """Two gloo ranks whose clocks disagree; each form's pace is its slowest rank's. Run 1: rank 0
    eager 8, replays 2; rank 1 eager 4, replays 5.5 (alone it would keep eager): 8 > 5.5, both
    keep graphs. Run 2: rank 0 eager 8, replays 11; rank 1 eager 4, replays 1 (alone: graphs):
    8 < 11, both run eagerly."""
    runs = [[(2.0, -0.5, True), (2.0, 0.25, False)], [(1.0, 0.125, True), (1.0, -0.25, False)]]
    per_rank = zbpp_workers(2).run(graph_cases.auto_worker, "zb-h1", runs)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)


def test_bad_cuda_graphs_values_are_refused_by_name() -> None:
    sched = build("1f1b", num_ranks=1, num_microbatches=2)
    with pytest.raises(ValueError, match="cuda_graphs='sometimes': pass False, True or \"auto\""):
        Pipeline({0: nn.Linear(2, 2)}, sched, loss_fn=nn.functional.mse_loss, cuda_graphs="sometimes")
    with pytest.raises(ValueError, match="move the stages to a CUDA device or pass cuda_graphs=False"):
        Pipeline({0: nn.Linear(2, 2)}, sched, loss_fn=nn.functional.mse_loss, cuda_graphs="auto")


def test_auto_trial_step_that_fails_is_run_again_and_not_timed() -> None:
    """A replay of the trial whose step fails (its loss raises, after turning the clock back: a
    time below zero, which would make "graphs" win were it counted) neither counts nor gives a
    time: the next step is that replay again, and eager (2 against 5 on the clock) is kept."""
    sched, x, y = _one_rank_stand_in(rows=4, outputs=1, seed=6)
    clock, forms = graph_cases.TaskClock(per_forward=1.0, per_replay=0.5), []
    fail = [False]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if fail[0]:
            clock.now -= 1000.0
            raise RuntimeError("this step fails")
        return nn.functional.mse_loss(out, target)

    pipe = Pipeline({0: nn.Linear(3, 1, dtype=torch.float64)}, sched, loss_fn=loss_fn, cuda_graphs=clock.graphs())
    clock.install(pipe, forms)
    for step in range(8):
        fail[0] = step == 3
        if fail[0]:
            with pytest.raises(PipelineError, match="this step fails"):
                pipe.step(x, y)
        else:
            pipe.step(x, y)
    assert forms == ["eager", "capture", "eager", "replay", "replay", "eager", "replay", "eager"]
    assert pipe.graph_forms == ["eager"] and not pipe._graph_cache.graphs


def test_auto_paces_eager_by_its_slowest_trial_step() -> None:
    """Eager steps whose time varies (the host's speed does): 2 forwards of 1 each, 3 more on the
    trial's second eager step; replays 2 + 4 tasks x 0.25 = 3. The first eager step (2) beats the
    replays, the second (5) does not: eager's pace is its slowest step, graphs are kept. With the
    slow step as fast as the first, eager (2) is kept."""
    for extra, graphs in ((3.0, True), (0.0, False)):
        sched, x, y = _one_rank_stand_in(rows=4, outputs=1, seed=6)
        clock, forms = graph_cases.TaskClock(per_forward=1.0, per_replay=0.25), []
        pipe = Pipeline({0: nn.Linear(3, 1, dtype=torch.float64)}, sched, loss_fn=nn.functional.mse_loss,
                        cuda_graphs=clock.graphs())
        clock.install(pipe, forms)
        slow = [0.0]
        pipe.stage_modules[0].register_forward_pre_hook(lambda *_: setattr(clock, "now", clock.now + slow[0]))
        for step in range(7):
            slow[0] = extra / 2 if step == 4 else 0.0  # the trial's second eager step: its 2 forwards
            pipe.step(x, y)
        assert forms[:6] == ["eager", "capture", "eager", "replay", "eager", "replay"]
        assert pipe.graph_forms == ["graphs" if graphs else "eager"], extra
        assert forms[6] == ("replay" if graphs else "eager")


@cuda
@pytest.mark.gpu
def test_auto_on_a_gpu_equals_eager_and_gives_the_pool_back_when_eager_wins() -> None:
    """Real CUDA graphs, bf16: the fake clock makes eager win (graphs and their memory pool given
    back) or graphs win; CUDA events (the default timer) make some choice for both signatures.
    Every step bit-identical to eager steps."""
    fails = graph_cases.compare_auto("zb-h1", [(1.0, 0.5, False), (1.0, -0.25, True), None], device="cuda")
    assert not fails, "\n".join(fails)
