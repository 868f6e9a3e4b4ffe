"""What every rank runs in the runtime tests (module-level functions, so the harness can ship them).

Each check builds this rank's stages and a full single-process reference from the same seeds,
runs `Pipeline.step`, and compares with the reference: the loss (on the rank holding the last
stage), every parameter's gradient, and, after two SGD steps, every parameter.

Tolerance: float32, ``rtol=1e-5, atol=1e-6`` on CPU. The pipeline sums per-microbatch gradients
(each scaled by rows_j / rows) where the reference does one whole-batch GEMM, so the two differ
only by float32 rounding of a different summation order (a few ulp, ~1e-7 relative per add). Any
logic error (a lost or doubled microbatch, a wrong weight, a wrong pairing of microbatches) moves
gradients by far more (>= 1/m relative). On CUDA the GEMM kernels differ with the batch size,
so the bound there is ``rtol=1e-4, atol=1e-5``.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterator

import torch
import torch.distributed as dist

from zbpp import Pipeline
from zbpp.schedules import Costs, Schedule, build, options_of, simulate
from zbpp.schedules.program import make_program

from .models import H, loss_fn, make_batch, make_stage, reference_step

LR, MOMENTUM = 0.1, 0.9


def tolerance(device: torch.device) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-5} if device.type == "cuda" else {"rtol": 1e-5, "atol": 1e-6}


def device_for_rank() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_schedule(name: str, p: int, m: int) -> Schedule:
    opts = {"chunks": 2} if "chunks" in options_of(name) else {}
    return build(name, num_ranks=p, num_microbatches=m, **opts)


def _close(what: str, got: torch.Tensor | None, want: torch.Tensor | None, tol: dict[str, float]) -> float:
    if got is None or want is None:
        assert got is None and want is None, f"{what}: got {got is not None and 'a tensor'} vs reference {want is not None and 'a tensor'}"
        return 0.0
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}", **tol)
    return float((got - want).abs().max())


def _grads_close(what: str, mine: dict[int, torch.nn.Module], ref: list[torch.nn.Module], tol: dict[str, float]) -> None:
    """Every parameter's .grad of this rank's stages against the same stage of the reference."""
    for s, st in mine.items():
        for (pn, a), (_, b) in zip(st.named_parameters(), ref[s].named_parameters()):
            _close(f"{what} stage {s} grad {pn}", a.grad, b.grad, tol)


def run_case(sched: Schedule, rows: int, kind: str, *, steps: int = 2, pipe_kwargs: dict | None = None) -> float:
    """Train `steps` SGD steps through the pipeline and through the reference; compare. Returns the
    largest absolute difference seen (gradients, losses, parameters)."""
    rank = dist.get_rank()
    device = device_for_rank()
    tol = tolerance(device)
    S = sched.num_stages
    mine = {s: make_stage(s, S, kind, device) for s in sched.stages_on(rank)}
    ref = [make_stage(s, S, "plain", device) for s in range(S)]
    pipe = Pipeline(mine, sched, loss_fn, **(pipe_kwargs or {}))
    opt = torch.optim.SGD(list(pipe.parameters()), lr=LR, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD([p for st in ref for p in st.parameters()], lr=LR, momentum=MOMENTUM)
    worst = 0.0
    case = f"{sched.name} p={sched.num_ranks} m={sched.num_microbatches} rows={rows} kind={kind} rank={rank}"
    for step in range(steps):
        inputs, target = make_batch(step, rows, device)
        loss = pipe.step(inputs, target=target)
        ref_loss = reference_step(ref, inputs, target)
        if pipe.holds_last_stage:
            worst = max(worst, _close(f"{case} step {step} loss", loss, ref_loss, tol))
        else:
            assert loss is None, f"{case}: step() returned {loss} on a rank without the last stage"
        for s, st in mine.items():
            for (name, p), (_, q) in zip(st.named_parameters(), ref[s].named_parameters()):
                worst = max(worst, _close(f"{case} step {step} stage {s} grad {name}", p.grad, q.grad, tol))
            for mod in st.modules():  # nothing of the step may stay pending
                keys = getattr(mod, "pending_wgrad_keys", None)
                assert keys is None or keys() == [], f"{case}: {type(mod).__name__} still has wgrads pending: {keys()}"
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for s, st in mine.items():
        for (name, p), (_, q) in zip(st.named_parameters(), ref[s].named_parameters()):
            worst = max(worst, _close(f"{case} after {steps} steps stage {s} param {name}", p.detach(), q.detach(), tol))
    return worst


def check_schedule(name: str, p: int, kinds: list[str], cases: list[tuple[int, int]], *, steps: int = 2) -> float:
    """`run_case` (`steps` steps) for every (m, rows) in `cases` and every model kind; the largest
    difference."""
    worst = 0.0
    for m, rows in cases:
        sched = make_schedule(name, p, m)
        for kind in kinds:
            worst = max(worst, run_case(sched, rows, kind, steps=steps))
    return worst


# schedules whose slow-link program (`slow_link_case`) posts receives early, per number of ranks: at
# p = 2, zb-h1's program has none (its W tasks fill every wait), so it would test nothing new there
SLOW_LINK_NAMES = {2: ["1f1b", "zb-v", "dualpipe-v"], 4: ["1f1b", "zb-h1", "zb-v", "dualpipe-v"]}


def slow_link_case(name: str, p: int) -> tuple[Schedule, Costs]:
    """A schedule and costs for a slow link (a message takes 2.5 tasks) under which the program posts
    some receives before their data exists, so that the transfer starts with the send; raises
    AssertionError when it posts none (the case would test nothing new)."""
    sched = make_schedule(name, p, 2 * p + 1)
    costs = Costs(1.0, 1.0, 1.0, comm=2.5)
    program, sim = make_program(sched, costs=costs), simulate(sched, costs)
    early = [op for rp in program.ranks for i, ops in enumerate(rp.issue) for op in ops
             if not op.send and 0 < i < rp.tasks.index(op.message.dst)
             and sim.end[rp.tasks[i - 1]] < sim.end[op.message.src]]
    assert early, f"{name} at p={p}: no receive posted before its data; the case tests nothing new"
    return sched, costs


def check_slow_link_program(name: str, p: int) -> float:
    """`slow_link_case`'s step equals the reference (the order of operations is the program's, on
    every backend)."""
    sched, costs = slow_link_case(name, p)
    return max(run_case(sched, rows, "zbpp", pipe_kwargs={"costs": costs}) for rows in (2 * (2 * p + 1), 5 * p + 2))


def standard_cases(p: int) -> list[tuple[int, int]]:
    """(m, rows): m = p, 2p+1, 4p with 2 rows per microbatch, and one uneven split (m = 2p+1)."""
    return [(p, 2 * p), (2 * p + 1, 2 * (2 * p + 1)), (4 * p, 8 * p), (2 * p + 1, 5 * p + 2)]


@contextlib.contextmanager
def collector_sees_new_objects_only() -> Iterator[None]:
    """For a check that runs the cycle collector: what was alive before it goes out of the
    collector's sight (`gc.freeze`) until the check ends. A pool's rank lives on for many tests and
    has imported much (transformers, earlier cases): each `gc.collect()` then costs what the check
    made, not all of that, and finds and counts (`gc.get_objects`) the same objects of the check."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def check_many_steps(name: str, p: int) -> dict[str, Any]:
    """One Pipeline, several steps and input shapes (new, new, then cached again), each checked
    against the reference; the number of live tensors must not grow once every shape was seen."""
    with collector_sees_new_objects_only():
        return _many_steps(name, p)


def _many_steps(name: str, p: int) -> dict[str, Any]:
    rank = dist.get_rank()
    device = device_for_rank()
    tol = tolerance(device)
    sched = make_schedule(name, p, 2 * p)
    S = sched.num_stages
    mine = {s: make_stage(s, S, "mixed", device) for s in sched.stages_on(rank)}
    ref = [make_stage(s, S, "plain", device) for s in range(S)]
    pipe = Pipeline(mine, sched, loss_fn)
    counts = []
    batches = [(4 * p, "double"), (6 * p + 1, "double"), (4 * p, "single"), (4 * p, "double"), (6 * p + 1, "double"), (4 * p, "double")]
    for step, (rows, tag) in enumerate(batches):
        inputs, target = make_batch(step, rows, device, tag=tag)
        loss = pipe.step(inputs, target=target)
        ref_loss = reference_step(ref, inputs, target)
        if pipe.holds_last_stage:
            _close(f"{name} step {step} loss", loss, ref_loss, tol)
        _grads_close(f"{name} step {step} rows {rows}", mine, ref, tol)
        for st in mine.values():
            st.zero_grad(set_to_none=True)
        for st in ref:
            st.zero_grad(set_to_none=True)
        del inputs, target, loss, ref_loss
        # On CUDA the pipeline keeps a send's tensors until the send completes, reaped at the
        # next step: how many are still listed depends on timing, so they are not counted.
        in_flight = sum(len(kept) for _, kept in pipe._in_flight)
        counts.append(live_tensors() - in_flight)
    # Steps 3.. repeat shapes already seen: a leak would grow the count.
    assert counts[3:] == [counts[2]] * 3, f"{name}: live tensors per step {counts} (rank {rank})"
    assert pipe.__dict__.keys() >= {"schedule"}  # smoke: the object is intact
    return {"counts": counts, "signatures": len(pipe._specs)}


def check_task_times(name: str, p: int) -> Any:
    """record_task_times=True: rank 0 gets every rank's records, one per task, in each rank's schedule order."""
    rank = dist.get_rank()
    device = device_for_rank()
    sched = make_schedule(name, p, 2 * p)
    mine = {s: make_stage(s, sched.num_stages, "zbpp", device) for s in sched.stages_on(rank)}
    pipe = Pipeline(mine, sched, loss_fn, record_task_times=True)
    for step in range(2):
        inputs, target = make_batch(step, 4 * p, device)
        pipe.step(inputs, target=target)
    recs = pipe.task_times()
    if rank != 0:
        assert recs is None, f"rank {rank} got records"
        return None
    for r in range(p):
        mine_r = sorted((x for x in recs if x["rank"] == r), key=lambda x: x["start"])
        assert [x["action"] for x in mine_r] == [str(a) for a in sched.orders[r]], f"rank {r} records out of schedule order"
        for x in mine_r:
            assert 0 <= x["start"] <= x["end"], x
        for a, b in zip(mine_r, mine_r[1:]):
            assert a["end"] <= b["start"] + 1e-9, (a, b)
    return recs


def check_bad_input(name: str, p: int) -> str:
    """Too few rows for the microbatches: every rank raises before computing; then a good step works."""
    from zbpp.runtime import PipelineError

    rank = dist.get_rank()
    sched = make_schedule(name, p, 2 * p)
    mine = {s: make_stage(s, sched.num_stages, "plain") for s in sched.stages_on(rank)}
    pipe = Pipeline(mine, sched, loss_fn)
    inputs, _ = make_batch(0, 2 * p - 1, tag="double")
    _, target = make_batch(0, 2 * p)  # only the input is bad
    try:
        pipe.step(inputs, target=target)
    except ValueError as exc:
        assert pipe.holds_first_stage, f"rank {rank} raised the input's own error: {exc}"
        assert "fewer than the" in str(exc) and str(2 * p - 1) in str(exc), str(exc)
        caught = "ValueError"
    except PipelineError as exc:
        assert not pipe.holds_first_stage and "rejected" in str(exc), str(exc)
        caught = "PipelineError"
    else:
        raise AssertionError(f"rank {rank}: a batch of {2 * p - 1} rows for {2 * p} microbatches was accepted")
    assert all(q.grad is None for q in pipe.parameters()), "grads were touched by a rejected step"
    # The pipeline is still usable.
    ref = [make_stage(s, sched.num_stages, "plain") for s in range(sched.num_stages)]
    inputs, target = make_batch(1, 4 * p)
    pipe.step(inputs, target=target)
    reference_step(ref, inputs, target)
    _grads_close("after a rejected step:", mine, ref, tolerance(torch.device("cpu")))
    return caught


def check_release(name: str, p: int, free: bool) -> list[tuple[int, int]]:
    """Outputs of a stage are released once sent (only their autograd node stays), unless turned off;
    the gradients are right either way. Returns (stage, numel) of each captured output."""
    rank = dist.get_rank()
    sched = make_schedule(name, p, p)
    S = sched.num_stages
    mine = {s: make_stage(s, S, "zbpp") for s in sched.stages_on(rank)}
    captured: list[tuple[int, torch.Tensor]] = []
    for s, st in mine.items():
        st.register_forward_hook(lambda mod, args, out, s=s: captured.append((s, out[0] if isinstance(out, (tuple, list)) else out["h"] if isinstance(out, dict) else out)))
    ref = [make_stage(s, S, "plain") for s in range(S)]
    pipe = Pipeline(mine, sched, loss_fn, free_sent_activations=free)
    inputs, target = make_batch(0, 4 * p)
    pipe.step(inputs, target=target)
    reference_step(ref, inputs, target)
    _grads_close(f"free={free}:", mine, ref, tolerance(torch.device("cpu")))
    sent_stages = {a.stage for a in pipe._program.ranks[pipe.pp_rank].send_of if a.kind.value == "F"}
    out = []
    for s, t in captured:
        if s in sent_stages:
            if mine[s].stage % 3 == 1 and free:
                # A dict stage's h is saved by its own h * sigmoid(h): released only where the saved
                # value is an alias (split W); otherwise its B would read the swapped data (the
                # gradients above would be wrong).
                continue
            assert (t.numel() == 1) == free, f"stage {s}: sent output has {t.numel()} elements (free={free})"
        out.append((s, t.numel()))
    return out


def check_fifo(name: str, p: int) -> str:
    """FIFO (Transformer-Engine-like) delayed modules: accepted and correct when the schedule keeps
    each stage's W in B order, refused with a clear error otherwise."""
    from zbpp.schedules.program import fifo_wgrad_problem

    sched = make_schedule(name, p, 2 * p + 1)
    unsafe = [s for s in range(sched.num_stages) if fifo_wgrad_problem(sched, s)]
    rank = dist.get_rank()
    if any(sched.rank_of(s) == rank for s in unsafe):
        mine = {s: make_stage(s, sched.num_stages, "fifo") for s in sched.stages_on(rank)}
        try:
            Pipeline(mine, sched, loss_fn)
        except ValueError as exc:
            assert "FIFO" in str(exc) or "oldest" in str(exc), str(exc)
            return "refused"
        raise AssertionError(f"{name}: FIFO modules accepted on stages {unsafe}")
    if unsafe:
        return "refused elsewhere"  # this rank's stages are fine, but another rank refuses: skip the run
    run_case(sched, 5 * p + 2, "fifo")
    return "ran"


def check_groups(pp: int) -> dict[str, int]:
    from zbpp import ParallelGroups

    g = ParallelGroups(pp=pp)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert (g.pp, g.dp, g.pp_rank, g.dp_rank) == (pp, world // pp, rank % pp, rank // pp)
    assert g.pp_peer(g.pp_rank) == rank and g.dp_peer(g.dp_rank) == rank
    assert dist.get_world_size(g.pp_group) == pp and dist.get_world_size(g.dp_group) == world // pp
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=g.pp_group)
    assert t.item() == sum(g.pp_peer(r) for r in range(pp))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=g.dp_group)
    assert t.item() == sum(g.dp_peer(d) for d in range(g.dp))
    return {"pp_rank": g.pp_rank, "dp_rank": g.dp_rank}


def check_bad_groups(pp: int) -> str:
    from zbpp import ParallelGroups

    try:
        ParallelGroups(pp=pp)
    except ValueError as exc:
        assert "not divisible" in str(exc), str(exc)
        return str(exc)
    raise AssertionError(f"ParallelGroups(pp={pp}) accepted world size {dist.get_world_size()}")


def check_data_parallel(name: str, pp: int) -> float:
    """dp x pp: each replica steps on its half of the batch; the averaged gradients equal the
    single-process whole-batch gradients (the reducer is another module's; this checks the hooks)."""
    from zbpp import ParallelGroups

    g = ParallelGroups(pp=pp)
    device = device_for_rank()
    tol = tolerance(device)
    sched = make_schedule(name, pp, 2 * pp)
    S = sched.num_stages
    mine = {s: make_stage(s, S, "mixed", device) for s in sched.stages_on(g.pp_rank)}
    ref = [make_stage(s, S, "plain", device) for s in range(S)]
    pipe = Pipeline(mine, sched, loss_fn, groups=g)
    rows = 4 * pp * g.dp
    (x, ids, tag), y = make_batch(0, rows, device)
    part = slice(g.dp_rank * rows // g.dp, (g.dp_rank + 1) * rows // g.dp)
    pipe.step((x[part], ids[part], tag), target=y[part])
    reference_step(ref, (x, ids, tag), y)
    worst = 0.0
    for s, st in mine.items():
        for (pn, a), (_, b) in zip(st.named_parameters(), ref[s].named_parameters()):
            got = getattr(a, "main_grad", None)
            worst = max(worst, _close(f"dp stage {s} grad {pn}", a.grad if got is None else got, b.grad, tol))
    return worst


class _Failing(torch.nn.Module):
    """Wraps a stage; raises on its `fail_at`-th forward, or trims its output when `trim` is set."""

    def __init__(self, inner: torch.nn.Module, fail_at: int = -1) -> None:
        super().__init__()
        self.inner, self.fail_at, self.calls, self.trim = inner, fail_at, 0, False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        out = self.inner(*args, **kwargs)
        if self.trim:  # a data-dependent shape the input signature cannot predict
            out = (out[0][:-1],) + tuple(x[:-1] if isinstance(x, torch.Tensor) else x for x in out[1:])
        return out


def fail_in_stage() -> dict[str, Any]:
    """2 ranks, ZB-H1: stage 1 raises in its third forward (F1.2). Rank 1 must raise naming the task
    and discard its gradients; rank 0 must get an error (the process group's timeout), not hang."""
    import time

    from zbpp.runtime import PipelineError

    rank = dist.get_rank()
    sched = make_schedule("zb-h1", 2, 4)
    stage = _Failing(make_stage(rank, 2, "zbpp"), fail_at=3 if rank == 1 else -1)
    pipe = Pipeline({rank: stage}, sched, loss_fn)
    inputs, target = make_batch(0, 8)
    t0 = time.monotonic()
    try:
        pipe.step(inputs, target=target)
    except PipelineError as exc:
        pending = [k for m in stage.modules() if hasattr(m, "pending_wgrad_keys") for k in m.pending_wgrad_keys()]
        return {"error": str(exc), "seconds": time.monotonic() - t0, "grads": [p.grad is not None for p in pipe.parameters()],
                "pending": pending}
    raise AssertionError(f"rank {rank}: the step did not fail")


def mismatch_after_first_step() -> dict[str, Any]:
    """Step 1 fixes the activation shapes of this input signature; in step 2 stage 0's output
    shrinks (data-dependent): rank 0 raises ShapeMismatchError naming stage, microbatch and both
    shapes; rank 1 fails on the timeout."""
    import time

    from zbpp.runtime import PipelineError

    rank = dist.get_rank()
    sched = make_schedule("1f1b", 2, 2)
    stage = _Failing(make_stage(rank, 2, "plain"))
    pipe = Pipeline({rank: stage}, sched, loss_fn)
    inputs, target = make_batch(0, 4)
    pipe.step(inputs, target=target)
    stage.trim = rank == 0
    t0 = time.monotonic()
    try:
        pipe.step(inputs, target=target)
    except PipelineError as exc:
        return {"type": type(exc).__name__, "error": str(exc), "seconds": time.monotonic() - t0}
    raise AssertionError(f"rank {rank}: the step did not fail")


def check_cuda_memory(name: str, p: int, steps: int = 9) -> list[int]:
    """On CUDA: once a shape was seen, the memory allocated after each step does not grow (no
    activation, buffer or wgrad closure outlives its step).

    The allocator's count moves from step to step without a leak: a send's buffer stays referenced
    until the runtime sees its work complete, which may be in the next step, so after a step zero,
    one or two activations may still be held (on 2 x H200 zb-v alternated between two counts one
    activation apart, and once held two at the end of a late step). So the check is on the floor,
    in units of one microbatch's activation: rows are chosen so that one activation (rows/m x H
    float32) is 64 KiB, and the least allocated after the last three steps must not pass the least
    after steps 1-3 by one activation. One leaked activation per step raises the floor by 320 KiB
    over those five steps, less the at most two activations that in-flight noise can hide.
    """
    rank = dist.get_rank()
    device = device_for_rank()
    m = 2 * p
    rows = m * (64 * 1024 // (H * 4))  # one microbatch's activation: 64 KiB
    sched = make_schedule(name, p, m)
    mine = {s: make_stage(s, sched.num_stages, "zbpp", device) for s in sched.stages_on(rank)}
    pipe = Pipeline(mine, sched, loss_fn)
    after = []
    for step in range(steps):
        inputs, target = make_batch(step, rows, device)
        pipe.step(inputs, target=target)
        for q in pipe.parameters():
            q.grad = None
        del inputs, target
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    growth = min(after[-3:]) - min(after[1:4])
    assert growth < 64 * 1024, f"{name}: allocated bytes after each step {after} (floor grew {growth} bytes)"
    return after


def fail_in_last_task_then_recover() -> list[str]:
    """2 ranks, ZB-H1, m=4: rank 1's last task (W1.3) fails after all messages went through, so
    rank 0 finishes its step. Both pipelines must then agree to send shapes ahead again (rank 1
    forgot them) and the next step must be right."""
    from zbpp.runtime import PipelineError

    rank = dist.get_rank()
    sched = make_schedule("zb-h1", 2, 4)
    assert str(sched.orders[1][-1]) == "W1.3"
    stage = make_stage(rank, 2, "zbpp")
    events = []
    if rank == 1:
        lin = stage.lin2
        real = lin.backward_dw
        calls = {"n": 0}

        def flaky(key=None):
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("injected W failure")
            return real(key)

        lin.backward_dw = flaky
    pipe = Pipeline({rank: stage}, sched, loss_fn)
    inputs, target = make_batch(0, 8)
    try:
        pipe.step(inputs, target=target)
        events.append("step ok")
    except PipelineError as exc:
        assert "task W1.3" in str(exc), str(exc)
        events.append("step failed")
    dist.barrier()
    for q in pipe.parameters():
        q.grad = None
    ref = [make_stage(s, 2, "plain") for s in range(2)]
    inputs, target = make_batch(1, 8)
    pipe.step(inputs, target=target)  # same shapes as before: would hang or fail without the resync
    reference_step(ref, inputs, target)
    _grads_close(f"rank {rank} after recovery:", {rank: stage}, ref, tolerance(torch.device("cpu")))
    events.append("recovered")
    return events


def check_no_cyclic_garbage(name: str, p: int) -> list[int]:
    """After a step, no tensor of the step waits for Python's cycle collector: everything the step
    held is freed by reference counting when the step lets go (a reference cycle would keep
    activations alive until the next collection; on the GPU that showed as memory that came and
    went between steps)."""
    with collector_sees_new_objects_only():
        return _cyclic_garbage_per_step(name, p)


def _cyclic_garbage_per_step(name: str, p: int) -> list[int]:
    rank = dist.get_rank()
    sched = make_schedule(name, p, 2 * p)
    mine = {s: make_stage(s, sched.num_stages, "mixed") for s in sched.stages_on(rank)}
    pipe = Pipeline(mine, sched, loss_fn)
    found = []
    gc.collect()
    gc.disable()
    try:
        for step in range(2):
            inputs, target = make_batch(step, 4 * p)
            pipe.step(inputs, target=target)
            del inputs, target
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            found.append(sum(isinstance(o, torch.Tensor) for o in gc.garbage))
            gc.garbage.clear()
            gc.set_debug(0)
    finally:
        gc.enable()
    assert found == [0, 0], f"{name}: tensors found only by the cycle collector after each step: {found}"
    return found
