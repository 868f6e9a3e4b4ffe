"""Cases for ``Pipeline(cuda_graphs=True)``: the same training run with and without graphs.

The model is a stack of residual blocks, alternately zbpp's ``LayerNormMLP`` (delayed W) and a
plain ``nn.Sequential`` MLP (its W comes from the runtime's generic split), cut into the
schedule's stages. Each run does `STEPS` optimizer steps with two batch sizes alternating (two
input signatures: each is eager on its first step, captures on its second, replays after).

The reference of a graph run is the eager run of the same pipeline: the same kernels in the
same order, so losses and gradients must be equal bit for bit (no tolerance). On CPUs the
graphs are `TaskGraphs` stand-ins (each replay runs eagerly again through the static buffers),
which tests the bookkeeping only; there the eager run is also checked against one process on the
whole batch (float64: rtol 1e-9, rounding of sums taken in another order).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn

from zbpp import Pipeline
from zbpp.modules import DelayedScaling, LayerNormMLP, fp8_autocast
from zbpp.runtime.task_graphs import EAGER, TRIAL_STEPS, AutoGraphs, HostTimer, StandInGraphs, TaskGraphs
from zbpp.schedules import build

D = 32  # hidden width
STEPS = 7  # signature A on steps 0, 2, 4, 6 (eager, capture, replay, replay); B on 1, 3, 5
M = 4  # microbatches


class Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


class Stage(nn.Module):
    """Some blocks of the stack; in FP8 the forward runs inside ``fp8_autocast``."""

    def __init__(self, blocks: list[nn.Module], fp8: bool) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.fp8 = fp8
        self.recipe = DelayedScaling(amax_history_len=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fp8_autocast(enabled=self.fp8, fp8_recipe=self.recipe) if self.fp8 else contextlib.nullcontext():
            return self.blocks(x)


def make_blocks(num_blocks: int, dtype: torch.dtype, device: torch.device, main_grad: bool,
                delay: bool = True) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for i in range(num_blocks):
        if i % 2 == 0:
            inner: nn.Module = LayerNormMLP(D, 2 * D, params_dtype=dtype, device=device, delay_wgrad_compute=delay,
                                            fuse_wgrad_accumulation=main_grad)
            if main_grad:
                for p in inner.parameters():
                    p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
        else:
            inner = nn.Sequential(nn.LayerNorm(D, dtype=dtype, device=device), nn.Linear(D, 2 * D, dtype=dtype, device=device),
                                  nn.GELU(), nn.Linear(2 * D, D, dtype=dtype, device=device))
        out.append(Residual(inner))
    return out


def _batch(step: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = 32 if step % 2 == 0 else 48
    g = torch.Generator().manual_seed(step)
    x = torch.randn(rows, D, generator=g).to(device, dtype)
    return x, torch.randn(rows, D, generator=g).to(device, dtype)


def replay_counter(pipe: Pipeline) -> dict[int, int]:
    """Counts, per graphs object (by id), the steps that replayed it (counted as the pipeline picks
    each training step's runner: graphs that finished capturing)."""
    cache = pipe._graph_cache
    assert cache is not None
    counts: dict[int, int] = {}
    pick = cache.runner

    def counted(*args):
        runner = pick(*args)
        if isinstance(runner, TaskGraphs):
            counts[id(runner)] = counts.get(id(runner), 0) + (not runner.capturing)
        return runner

    cache.runner = counted
    return counts


def train(schedule: str, *, graphs: bool | type[TaskGraphs] | AutoGraphs, rank: int, world: int, device: torch.device,
          dtype: torch.dtype, fp8: bool = False, main_grad: bool = False, groups: Any = None, tied: bool = False,
          steps: int = STEPS, on_pipeline: Any = None) -> dict[str, Any]:
    """`steps` steps of SGD; returns the losses, every step's gradients and the graph counters.
    `tied`: the first plain block's fc1 weight is also the last block's (a tied parameter: its
    copies' gradients are summed outside the graphs). `on_pipeline(pipe)` is called once it is built."""
    sched = build(schedule, num_ranks=world, num_microbatches=M)
    per_stage = 2
    blocks = make_blocks(per_stage * sched.num_stages, dtype, device, main_grad)
    if tied:
        blocks[-1].inner[1].weight = blocks[1].inner[1].weight
    stages = {s: Stage(blocks[s * per_stage:(s + 1) * per_stage], fp8) for s in sched.stages_on(rank)}
    tie = blocks[1].inner[1].weight
    held = any(p is tie for m in stages.values() for p in m.parameters())
    pipe = Pipeline(stages, sched, loss_fn=nn.functional.mse_loss, device=device, cuda_graphs=graphs, groups=groups,
                    tied_parameters={"fc1": tie} if tied and held else None)
    replays = replay_counter(pipe) if graphs else {}
    if on_pipeline is not None:
        on_pipeline(pipe)
    params = list(pipe.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    losses, grads = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for p in params:
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
        x, y = _batch(step, dtype, device)
        loss = pipe.step(x, y)
        losses.append(None if loss is None else loss.clone())
        grads.append([(p.main_grad if hasattr(p, "main_grad") else p.grad).clone() for p in params])
        for p in params:
            if hasattr(p, "main_grad"):
                p.grad = p.main_grad.to(p.dtype)
        opt.step()
    graphed = pipe._graph_cache.graphs.values() if pipe._graph_cache is not None else []
    counts = [(len(g), replays.get(id(g), 0)) for g in graphed]
    forms = pipe.graph_forms
    return {"losses": losses, "grads": grads, "graphs": counts, "forms": forms}


def compare(schedule: str, *, rank: int = 0, world: int = 1, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
            fp8: bool = False, main_grad: bool = False, groups: Any = None, tied: bool = False) -> list[str]:
    """The graph run against the eager run, bit for bit; what differs, as lines (empty: equal)."""
    dev = torch.device(device)
    kw = dict(rank=rank, world=world, device=dev, dtype=dtype, fp8=fp8, main_grad=main_grad, groups=groups, tied=tied)
    graphs = StandInGraphs if dev.type == "cpu" else True  # on CPUs the tests pick the stand-in
    eager, graphed = train(schedule, graphs=False, **kw), train(schedule, graphs=graphs, **kw)
    fails = []
    counts = graphed["graphs"]  # (tasks captured, replay steps) per signature
    if len(counts) != 2 or any(n == 0 for n, _ in counts) or sorted(r for _, r in counts) != [1, 2]:
        fails.append(f"(tasks captured, replay steps) per signature: {counts}; expected 2 signatures replayed 1 and 2 times")
    return fails + differences(eager, graphed)


def differences(eager: dict[str, Any], graphed: dict[str, Any]) -> list[str]:
    """Where two `train` runs' losses or gradients differ by a bit, as lines (empty: equal)."""
    fails = []
    for step, (a, b) in enumerate(zip(eager["losses"], graphed["losses"], strict=True)):
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            fails.append(f"step {step}: loss {b} with graphs, {a} eager")
        for i, (ga, gb) in enumerate(zip(eager["grads"][step], graphed["grads"][step])):
            if not torch.equal(ga, gb):
                fails.append(f"step {step}: parameter {i}: max |difference| {(ga.float() - gb.float()).abs().max().item():.3g}")
    return fails


# -- cuda_graphs="auto" on CPUs: time that moves only when the tasks say so ----------------------

AUTO_STEPS = 16  # each signature: eager, capture, TRIAL_STEPS x (eager, replay) timed, then its choice twice


class TaskClock:
    """A fake clock for `HostTimer`: every forward of a stage moves it by `per_forward`, every
    replay of a task by `per_replay` more (negative: replays are faster than eager tasks).
    A rank's eager step then takes F * per_forward, a replayed one F * per_forward + T * per_replay
    (F forwards, T tasks). `issue_share`: the host's clock runs at that fraction of this one, so an
    eager step's issue takes that share of its time (None: no host clock, as on CPUs)."""

    def __init__(self, per_forward: float, per_replay: float, issue_share: float | None = None) -> None:
        self.now = 0.0
        self.per_forward, self.per_replay, self.issue_share = per_forward, per_replay, issue_share

    def __call__(self) -> float:
        return self.now

    def graphs(self, kind: type[TaskGraphs] = StandInGraphs) -> AutoGraphs:
        """``cuda_graphs=`` for a pipeline of `kind` graphs timed by this clock."""
        clock = self

        class Ticking(kind):  # type: ignore[misc, valid-type]
            def _replay(self, rec: Any) -> None:
                clock.now += clock.per_replay
                super()._replay(rec)

        share = self.issue_share
        return AutoGraphs(Ticking, HostTimer(self), host_clock=None if share is None else lambda: clock.now * share)

    def install(self, pipe: Pipeline, forms: list[str]) -> None:
        """Tick on every stage forward; append each training step's form to `forms` ("eager",
        "capture" or "replay")."""
        for m in pipe.stage_modules.values():
            m.register_forward_pre_hook(lambda *_: setattr(self, "now", self.now + self.per_forward))
        cache = pipe._graph_cache
        assert cache is not None
        pick = cache.runner

        def recorded(*args: Any) -> Any:
            runner = pick(*args)
            forms.append("eager" if runner is EAGER else "capture" if runner.capturing else "replay")
            return runner

        cache.runner = recorded


def auto_forms(graphs: bool | None) -> list[str]:
    """The forms of `AUTO_STEPS` steps of two signatures alternating, when the trial chooses `graphs`
    (None: the trial's steps only)."""
    one = ["eager", "capture"] + ["eager", "replay"] * TRIAL_STEPS
    if graphs is not None:
        one += ["replay" if graphs else "eager"] * (AUTO_STEPS // 2 - len(one))
    return [form for pair in zip(one, one) for form in pair]


def compare_auto(schedule: str, runs: list[tuple[float, float, bool] | tuple[float, float, bool, float] | None], *,
                 rank: int = 0, world: int = 1,
                 groups: Any = None, device: str = "cpu") -> list[str]:
    """For each run, `AUTO_STEPS` steps of ``cuda_graphs="auto"`` against eager steps, bit for bit;
    the forms it ran, those it chose (`Pipeline.graph_forms`) and the graphs (and, on CUDA, the
    memory pool) it kept. A run is
    (per_forward, per_replay, graphs expected[, issue_share]): timed by a `TaskClock`; or None: timed by CUDA
    events, any choice. CPU: float64 stand-ins; CUDA: bf16 CUDA graphs. What differs, as lines."""
    dev = torch.device(device)
    kw: dict[str, Any] = dict(rank=rank, world=world, device=dev, groups=groups, steps=AUTO_STEPS,
                              dtype=torch.float64 if dev.type == "cpu" else torch.bfloat16)
    kind = StandInGraphs if dev.type == "cpu" else TaskGraphs
    eager = train(schedule, graphs=False, **kw)
    fails = []
    for run in runs:
        clock, forms, pipes = TaskClock(run[0], run[1], *run[3:]) if run else TaskClock(0.0, 0.0), [], []

        def watch(pipe: Pipeline) -> None:
            clock.install(pipe, forms)
            pipes.append(pipe)

        auto = train(schedule, graphs=clock.graphs(kind) if run else "auto", on_pipeline=watch, **kw)
        what = f"per_forward, per_replay = {run[:2]}" if run else "timed by CUDA events"
        want = run[2] if run else None
        expected = auto_forms(want)
        if forms[:len(expected)] != expected:
            fails.append(f"{what}: forms {forms}, expected {expected}")
        chosen = "graphs" if want else "eager"
        if (run and auto["forms"] != [chosen, chosen]) or "trial" in auto["forms"] or len(auto["forms"]) != 2:
            fails.append(f"{what}: forms {auto['forms']} of the two signatures, expected {[chosen, chosen]}")
        if run and not want and (auto["graphs"] or pipes[0]._graph_cache._mem_pool is not None):
            fails.append(f"{what}: eager chosen, yet graphs {auto['graphs']} or their pool kept")
        fails += [f"{what}: {f}" for f in differences(eager, auto)]
    return fails


def whole_batch_reference(schedule: str) -> list[str]:
    """CPU float64: the eager pipeline's first-step gradients against one process on the whole batch."""
    dev, dtype = torch.device("cpu"), torch.float64
    sched = build(schedule, num_ranks=1, num_microbatches=M)
    blocks = make_blocks(2 * sched.num_stages, dtype, dev, False, delay=False)
    ref = copy.deepcopy(nn.Sequential(*blocks))
    x, y = _batch(0, dtype, dev)
    nn.functional.mse_loss(ref(x), y).backward()
    got = train(schedule, graphs=StandInGraphs, rank=0, world=1, device=dev, dtype=dtype)
    fails = []
    for i, (p, g) in enumerate(zip(ref.parameters(), got["grads"][0])):
        if not torch.allclose(g, p.grad, rtol=1e-9, atol=1e-12):
            fails.append(f"parameter {i}: max |difference| {(g - p.grad).abs().max().item():.3g} from one process")
    return fails


def worker(schedule: str, backend: str, dp: int = 1, **kw: Any) -> list[str]:
    """On every rank of the job: `dp` replicas of a pipeline over the rest (gloo: CPU stand-ins;
    nccl: GPUs). With replicas, the data-parallel reducer averages the gradients after each
    stage's last W, outside the graphs."""
    import torch.distributed as dist

    from zbpp import ParallelGroups

    world = dist.get_world_size()
    groups = ParallelGroups(pp=world // dp) if dp > 1 else None
    rank = groups.pp_rank if groups is not None else dist.get_rank()
    device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    dtype = torch.bfloat16 if backend == "nccl" else torch.float64
    return compare(schedule, rank=rank, world=world // dp, device=device, dtype=dtype, groups=groups, **kw)


def auto_worker(schedule: str, runs_by_rank: list[list[tuple[float, float, bool]]]) -> list[str]:
    """On each gloo rank of one pipeline: `compare_auto` with this rank's runs (its clock's costs)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    return compare_auto(schedule, runs_by_rank[rank], rank=rank, world=dist.get_world_size())
