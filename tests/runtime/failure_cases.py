"""What every rank runs in the failure tests: one rank fails once, at a chosen site and microbatch,
while its process lives on (the training loop catches the exception, as loops that skip a bad batch
do).

`fail_once` trains three steps on the test models (`models.py`, "zbpp" kind: every Linear defers its
weight gradient, so W is a real task) without zeroing gradients in between:

1. a good step, whose gradients stay accumulated;
2. the step that fails at ``site`` on stage ``stage`` for microbatch ``mb``;
3. a good step again.

It returns, per rank, how step 2 ended and how long it took, and checks itself, against the
single-process reference (`reference_step`), the state the README promises: after the failed step
every gradient is exactly the one of step 1 (the same values: nothing of step 2 added, nothing
lost), no wgrad is pending, and after step 3 the gradients are step 1's plus step 3's.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from zbpp import Pipeline
from zbpp.modules import current_microbatch
from zbpp.runtime import ParallelGroups, PipelineError
from zbpp.runtime.tree import flatten, rebuild

from .cases import device_for_rank, make_schedule, tolerance
from .models import loss_fn, make_batch, make_stage, reference_step

ARMED = {"site": None}  # set on the failing rank for the failing step only


class _Bomb(torch.autograd.Function):
    """Identity in the forward; raises in the backward of the armed microbatch."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, key: Any) -> torch.Tensor:
        ctx.key = key
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ARMED["site"] == ("B", ctx.key):
            raise RuntimeError(f"injected B failure at {ctx.key}")
        return g, None


class Unprintable(RuntimeError):
    """An exception whose ``str()`` itself raises (a message formatted with the wrong arguments)."""

    def __str__(self) -> str:
        raise ValueError("not enough arguments for format string")


class BeforeForward(torch.nn.Module):
    """Wraps a stage: `hook(current_microbatch())` runs before each forward (it may exit or raise).
    `name`: the stage's name in its parent (the checkpoint's keys: each stage's own where it is saved)."""

    def __init__(self, inner: torch.nn.Module, hook: Callable[[Any], None], name: str = "inner") -> None:
        super().__init__()
        self.add_module(name, inner)
        self.name, self.hook = name, hook

    @property
    def inner(self) -> torch.nn.Module:
        return self._modules[self.name]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.hook(current_microbatch())
        return self.inner(*args, **kwargs)


class Faulty(torch.nn.Module):
    """Wraps a stage and fails when `ARMED` names it: in its forward ("F"), in the backward of its
    output ("B"), in its delayed modules' W ("W"), with a shrunk output ("shape": a data-dependent
    shape the input signature cannot predict) or by returning None ("none")."""

    def __init__(self, inner: torch.nn.Module, stage: int) -> None:
        super().__init__()
        self.inner, self.stage = inner, stage
        for mod in inner.modules():
            if callable(getattr(mod, "backward_dw", None)) and mod is not inner:
                real = mod.backward_dw

                def armed_dw(key: Any = None, _real: Any = real) -> None:
                    if ARMED["site"] == ("W", key):
                        raise RuntimeError(f"injected W failure at {key}")
                    _real(key)

                mod.backward_dw = armed_dw

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        key = current_microbatch()
        if ARMED["site"] == ("F", key):
            raise RuntimeError(f"injected F failure at {key}")
        if ARMED["site"] == ("none", key):
            return None
        if ARMED["site"] == ("unprintable", key):
            raise Unprintable()
        out = self.inner(*args, **kwargs)
        leaves, spec = flatten(out)
        if ARMED["site"] == ("shape", key):
            leaves = [t[:-1] if t.dim() else t for t in leaves]
        leaves = [_Bomb.apply(t, key) if t.requires_grad else t for t in leaves]
        return rebuild(spec, leaves)


def timed_outcome(rank: int, call: Callable[[], Any], catch: tuple[type[BaseException], ...],
                  disarm: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """How `call()` (a step) ended on this rank, timed: ``{"rank", "result": "success" or the type
    name of what it raised among `catch`, "message", "seconds"}``; `disarm()` after it, whatever
    happened (an injected failure must not outlive its step in the pool's process)."""
    outcome: dict[str, Any] = {"rank": rank}
    t0 = time.monotonic()
    try:
        call()
        outcome["result"] = "success"
    except catch as exc:
        outcome.update(result=type(exc).__name__, message=str(exc))
    finally:
        disarm()
    outcome["seconds"] = time.monotonic() - t0
    return outcome


def after_a_good_step(name: str, p: int, m: int) -> tuple[Pipeline, dict[int, torch.nn.Module],
                                                              list[torch.nn.Module], Any, Any]:
    """This rank's pipeline of the test models ("zbpp" kind) under schedule `name`, after one good
    step on (x, y), and the one-process reference `ref` after the same: ``(pipe, mine, ref, x, y)``."""
    sched = make_schedule(name, p, m)
    S = sched.num_stages
    mine = {s: make_stage(s, S, "zbpp") for s in sched.stages_on(dist.get_rank())}
    ref = [make_stage(s, S, "plain") for s in range(S)]
    pipe = Pipeline(mine, sched, loss_fn)
    x, y = make_batch(0, 2 * m)
    pipe.step(x, target=y)
    reference_step(ref, x, y)
    return pipe, mine, ref, x, y


def next_step_matches_reference(pipe: Pipeline, mine: dict[int, torch.nn.Module], ref: list[torch.nn.Module],
                                x: Any, y: Any) -> None:
    """One more step on (x, y), and the same on the one-process reference `ref`: every gradient of
    this rank's stages `mine` must be the reference's (the pipeline is usable and kept nothing of a
    failed step)."""
    rank = dist.get_rank()
    pipe.step(x, target=y)
    reference_step(ref, x, y)
    for s, st in mine.items():
        for (n, a), (_, b) in zip(st.named_parameters(), ref[s].named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=lambda msg: f"rank {rank} stage {s} {n}: {msg}",
                                       **tolerance(torch.device("cpu")))


def _grads(stages: dict[int, torch.nn.Module]) -> dict[str, torch.Tensor | None]:
    return {f"{s}.{n}": (None if p.grad is None else p.grad.detach().clone())
            for s, st in stages.items() for n, p in st.named_parameters()}


def fail_once(name: str, p: int, m: int, site: str, fail_rank: int, mb: int, dp: int = 1,
              report_dir: str | None = None) -> dict[str, Any]:
    rank = dist.get_rank()
    device = device_for_rank()
    tol = tolerance(device)
    groups = ParallelGroups(pp=p) if dp > 1 else None
    pp_rank = groups.pp_rank if groups else rank
    sched = make_schedule(name, p, m)
    S = sched.num_stages
    failing_stage = sched.stages_on(fail_rank)[0] if site != "loss" else S - 1
    mine = {s: Faulty(make_stage(s, S, "zbpp", device), s) for s in sched.stages_on(pp_rank)}
    ref = [make_stage(s, S, "plain", device) for s in range(S)]
    losses = {"calls": 0}

    def counting_loss(out: Any, target: Any) -> torch.Tensor:
        if ARMED["site"] == ("loss", current_microbatch()):
            raise ValueError(f"injected loss failure at {current_microbatch()}")
        losses["calls"] += 1
        return loss_fn(out, target)

    pipe = Pipeline(mine, sched, counting_loss, groups=groups)
    replica = groups.dp_rank if groups else 0
    batches = [make_batch(10 * step + replica, 2 * m, device) for step in range(3)]

    pipe.step(*batches[0][:1], target=batches[0][1])  # step 1
    reference_step(ref, batches[0][0], batches[0][1])
    after_first = _grads(mine)

    i_fail = pp_rank == fail_rank and (groups is None or groups.dp_rank == 0)
    if i_fail:
        ARMED["site"] = (site, (failing_stage, mb))
    t0 = time.monotonic()
    outcome: dict[str, Any] = {"rank": rank}
    try:
        pipe.step(*batches[1][:1], target=batches[1][1])  # step 2
        outcome["result"] = "success"
    except PipelineError as exc:
        outcome.update(result="PipelineError", message=str(exc),
                       cause=type(exc.__cause__).__name__ if exc.__cause__ is not None else None)
    finally:
        ARMED["site"] = None
    outcome["seconds"] = time.monotonic() - t0
    if report_dir is not None:
        with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(outcome, fh)
    assert _same(_grads(mine), after_first), f"rank {rank}: a failed step changed the gradients of step 1"
    pending = [k for st in mine.values() for mod in st.modules() if hasattr(mod, "pending_wgrad_keys")
               for k in mod.pending_wgrad_keys()]
    assert pending == [], f"rank {rank}: wgrads still pending after the failed step: {pending}"

    pipe.step(*batches[2][:1], target=batches[2][1])  # step 3: the pipeline is usable
    reference_step(ref, batches[2][0], batches[2][1])
    for s, st in mine.items():
        if dp > 1:
            break  # each replica saw other data: the data-parallel tests check the averages
        for (n, a), (_, b) in zip(st.inner.named_parameters(), ref[s].named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=lambda msg: f"rank {rank} stage {s} {n}: {msg}", **tol)
    return outcome


def _same(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> bool:
    return a.keys() == b.keys() and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in
        ((a[k], b[k]) for k in a)
    )


def failing_then_next(pipe: Pipeline, x: Any, y: Any) -> dict[str, Any]:
    """Two steps on (x, y): the outcome of the first ("result": "success" or "PipelineError", with its
    "message") and of the next ("next": "success" or its error), each timed ("seconds", "next_seconds")."""
    outcome: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        pipe.step(x, target=y)
        outcome["result"] = "success"
    except PipelineError as exc:
        outcome.update(result="PipelineError", message=str(exc))
    outcome["seconds"] = time.monotonic() - t0
    t1 = time.monotonic()
    try:
        pipe.step(x, target=y)
        outcome["next"] = "success"
    except PipelineError as exc:
        outcome["next"] = str(exc)
    outcome["next_seconds"] = time.monotonic() - t1
    return outcome


def die_mid_step(name: str, p: int, m: int, report_dir: str) -> None:
    """After a good step (and a checkpoint of it), rank 1 exits (os._exit) in the forward of its
    second microbatch; the others must raise, and their next step must raise at once saying the
    pipeline is unusable, as must every later collective call given the Pipeline ("later": what
    each raised and how long it took): ``clip_grad_norm_``, ``task_times``, loading and saving a
    checkpoint (they waited for the dead rank until the group's timeout, or raised gloo's error)."""
    from zbpp.runtime import clip_grad_norm_, load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    sched = make_schedule(name, p, m)
    S = sched.num_stages
    dying = {"on": False}

    def die(key: Any) -> None:
        if dying["on"] and rank == 1 and key == (sched.stages_on(1)[0], 1):
            os._exit(3)

    # the test models' stages are named alike: a checkpoint needs each under its own name
    mine = {s: BeforeForward(make_stage(s, S, "zbpp", device_for_rank()), die, f"stage{s}")
            for s in sched.stages_on(rank)}
    pipe = Pipeline(mine, sched, loss_fn, record_task_times=True)
    inputs, target = make_batch(0, 2 * m, device_for_rank())
    pipe.step(inputs, target=target)
    checkpoint = os.path.join(report_dir, "good-step")
    save_checkpoint(pipe, checkpoint)
    dying["on"] = True
    outcome = {"rank": rank, **failing_then_next(pipe, inputs, target)}
    later = {"clip_grad_norm_": lambda: clip_grad_norm_(pipe, 1.0), "task_times": pipe.task_times,
             "load_checkpoint": lambda: load_checkpoint(pipe, checkpoint),
             "save_checkpoint": lambda: save_checkpoint(pipe, checkpoint + "-after")}
    outcome["later"] = {}
    for what, call in later.items():
        done = timed_outcome(rank, call, (Exception,))
        outcome["later"][what] = [done.get("message", done["result"]), done["seconds"]]
        with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as fh:  # what came so far, should one hang
            json.dump(outcome, fh)
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(outcome, fh)


def die_between_steps(name: str, p: int, m: int, report_dir: str, first: str = "check_ties") -> None:
    """After a good step, rank 1 exits (os._exit) before the next call; the others call `first`,
    ``check_ties`` (``save_checkpoint`` does) or ``clip_grad_norm_``, which must raise at once on
    every rank that the pipeline is unusable, and so must their next step (`first`, "next": message
    and seconds). For ``clip_grad_norm_`` the stages are ``fully_shard``-ed, dp=2 x pp=2, and rank 1
    calls it too and dies at its first all-reduce, its replicas' over the shard: rank 3, its
    replica, waited there plainly and raised gloo's error, leaving the pipeline usable to it."""
    from zbpp.runtime import clip_grad_norm_

    rank = dist.get_rank()
    if first == "clip_grad_norm_":
        from .fsdp_cases import batch, device_type, fsdp_pipeline, mesh, my_rows

        pipe = fsdp_pipeline(name, "plain", 2, 2)
        x, y = (my_rows(pipe.topology.dp_rank, 2, t) for t in batch(0))
    else:
        sched = make_schedule(name, p, m)
        mine = {s: make_stage(s, sched.num_stages, "zbpp") for s in sched.stages_on(rank)}
        pipe = Pipeline(mine, sched, loss_fn)
        x, y = make_batch(0, 2 * m)
    pipe.step(x, target=y)
    if rank == 1:
        if first != "clip_grad_norm_":
            os._exit(3)
        shard_group, all_reduce = mesh(device_type(), 2, 2).get_group("dp"), dist.all_reduce

        def dying(*args: Any, **kwargs: Any) -> Any:  # at the shard's all-reduce, after the call's agreement
            return os._exit(3) if kwargs.get("group") is shard_group else all_reduce(*args, **kwargs)

        dist.all_reduce = dying
    outcome: dict[str, Any] = {"rank": rank}
    calls = {"check_ties": pipe.check_ties, "clip_grad_norm_": lambda: clip_grad_norm_(pipe, 1.0)}
    for what, call in {first: calls[first], "next": lambda: pipe.step(x, target=y)}.items():
        done = timed_outcome(rank, call, (Exception,))
        outcome[what] = [f"{done['result']}: {done.get('message', '')}", done["seconds"]]
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(outcome, fh)


def interrupted_once(name: str, p: int, m: int, fail_rank: int, which: str) -> dict[str, Any]:
    """After a good step, `which` (KeyboardInterrupt or SystemExit: no Exception) is raised in
    `fail_rank`'s forward of microbatch 1, and that rank's loop catches it and goes on (as a loop
    that saves a checkpoint on Ctrl-C does). That rank gets its own exception back, every other a
    `PipelineError` naming it; the next step is right on every rank."""
    rank = dist.get_rank()
    sched = make_schedule(name, p, m)
    S = sched.num_stages
    exc_type = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[which]
    armed, interrupt = _failing_forward(1, lambda: exc_type("injected interrupt"))

    mine = {s: BeforeForward(make_stage(s, S, "zbpp"), interrupt) for s in sched.stages_on(rank)}
    ref = [make_stage(s, S, "plain") for s in range(S)]
    pipe = Pipeline(mine, sched, loss_fn)
    x, y = make_batch(0, 2 * m)
    pipe.step(x, target=y)
    armed["on"] = rank == fail_rank
    outcome = timed_outcome(rank, lambda: pipe.step(x, target=y), (PipelineError, KeyboardInterrupt, SystemExit),
                            disarm=lambda: armed.update(on=False))
    for st in mine.values():
        st.zero_grad(set_to_none=True)
    pipe.step(x, target=y)  # the pipeline is usable
    reference_step(ref, x, y)
    for s, st in mine.items():
        for (n, a), (_, b) in zip(st.inner.named_parameters(), ref[s].named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=lambda msg: f"rank {rank} stage {s} {n}: {msg}",
                                       **tolerance(torch.device("cpu")))
    return outcome


def replica_pipeline(name: str, p: int, m: int) -> tuple[Pipeline, ParallelGroups, Any, Any]:
    """A `p`-rank pipeline of zbpp stages per data-parallel replica, and this replica's batch."""
    groups = ParallelGroups(pp=p)
    sched = make_schedule(name, p, m)
    mine = {s: make_stage(s, sched.num_stages, "zbpp") for s in sched.stages_on(groups.pp_rank)}
    x, y = make_batch(groups.dp_rank, 2 * m)
    return Pipeline(mine, sched, loss_fn, groups=groups), groups, x, y


def reduction_fails_once(name: str, p: int, m: int, fail_rank: int) -> dict[str, Any]:
    """dp=2: after a good step, global rank `fail_rank`'s data-parallel reducer raises instead of
    launching its first bucket's all-reduce; its replica's peer has launched that all-reduce and
    waits for it. Every rank must raise within seconds, naming the failing rank and the cause (the
    replicas' collectives are out of step: the pipeline is unusable, its next step raises at once)."""
    rank = dist.get_rank()
    pipe, groups, x, y = replica_pipeline(name, p, m)
    pipe.step(x, target=y)
    if rank == fail_rank:
        def launch(bucket: Any) -> None:
            raise RuntimeError("injected reduction failure")
        pipe.reducer._launch = launch
    return {"rank": rank, **failing_then_next(pipe, x, y)}


def prepare_fails_once(name: str, p: int, m: int, fail_rank: int, what: str) -> dict[str, Any]:
    """After a good step, `fail_rank`'s `Reductions.<what>` (``set_aside``: the copy of the earlier
    gradients, where a GPU runs out of memory; ``begin``) raises once, before its first task. Every
    rank raises a PipelineError naming it, fast; the gradients of the good step stay; the next step
    is right."""
    rank = dist.get_rank()
    pipe, mine, ref, x, y = after_a_good_step(name, p, m)
    real = getattr(pipe._reductions, what)
    if rank == fail_rank:
        def failing(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"injected {what} failure")
        setattr(pipe._reductions, what, failing)
    outcome = timed_outcome(rank, lambda: pipe.step(x, target=y), (Exception,),  # the test asks for a PipelineError
                            disarm=lambda: setattr(pipe._reductions, what, real))
    pipe.step(x, target=y)  # the pipeline is usable, the first step's gradients kept
    reference_step(ref, x, y)
    for s, st in mine.items():
        for (n, a), (_, b) in zip(st.named_parameters(), ref[s].named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=lambda msg: f"rank {rank} stage {s} {n}: {msg}",
                                       **tolerance(torch.device("cpu")))
    return outcome


def no_sync_on_one_replica(name: str, p: int, m: int) -> dict[str, Any]:
    """dp=2: replica 0 steps inside ``no_sync()``, replica 1 outside (a loop that counts its
    accumulation steps per replica, wrongly). Replica 1 would launch all-reduces that replica 0
    skips: every rank must raise before computing, naming the ranks, and a good step follow."""
    import contextlib

    rank = dist.get_rank()
    pipe, groups, x, y = replica_pipeline(name, p, m)
    t0 = time.monotonic()
    outcome: dict[str, Any] = {"rank": rank}
    with pipe.no_sync() if groups.dp_rank == 0 else contextlib.nullcontext():
        try:
            pipe.step(x, target=y)
            outcome["result"] = "success"
        except ValueError as exc:
            outcome.update(result=type(exc).__name__, message=str(exc))
    outcome["seconds"] = time.monotonic() - t0
    assert all(q.grad is None for q in pipe.parameters()), f"rank {rank}: a refused step touched a gradient"
    pipe.step(x, target=y)
    return outcome


class _InterruptingWork:
    """A send's work whose first ``wait`` waits, then raises `exc` (an interrupt that lands while
    the rank waits for its sends at the end of a step, outside any task)."""

    def __init__(self, work: Any, exc: BaseException | None) -> None:
        self.work, self.exc = work, exc

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        self.work.wait()
        if self.exc is not None:
            exc, self.exc = self.exc, None
            raise exc


def _arm_outside_task(pipe: Pipeline, where: str, exc: BaseException) -> Callable[[], None]:
    """Make `pipe`'s next step raise `exc` once at `where`, outside any task; returns the disarm."""
    import zbpp.runtime.agreement as agreement

    if where in ("set_aside", "begin", "finish", "stage_backward_done"):
        real = getattr(pipe._reductions, where)

        def failing(*args: Any, **kwargs: Any) -> None:
            setattr(pipe._reductions, where, real)
            raise exc
        setattr(pipe._reductions, where, failing)
        return lambda: setattr(pipe._reductions, where, real)
    if where == "commit":  # as a Ctrl-C during the first addition of a kept gradient: raised once it returns
        from torch.overrides import TorchFunctionMode

        reductions, real_commit = pipe._reductions, pipe._reductions.commit

        class AfterFirstAdd(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                if getattr(func, "__name__", "") == "add_":
                    reductions.__dict__.pop("commit", None)
                    raise exc
                return out

        def commit() -> None:
            with AfterFirstAdd():
                real_commit()
        reductions.commit = commit
        return lambda: reductions.__dict__.pop("commit", None)
    if where == "send_wait":  # the sends waited for in CommQueue.complete
        channels = pipe._channels
        real_isend = channels.isend
        left = [exc]

        def isend(tensors: Any, channel: Any) -> list[Any]:
            return [_InterruptingWork(w, left.pop() if left else None) for w in real_isend(tensors, channel)]
        channels.isend = isend
        return lambda: setattr(channels, "isend", real_isend)
    # "start" / "end": the wait for the start / end agreement (its first poll after posting)
    real_poll, calls = agreement.poll, {"n": 0}
    nth = {"start": 1, "end": 2}[where]

    def poll(*args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == nth:
            raise exc
        real_poll(*args, **kwargs)
    agreement.poll = poll
    return lambda: setattr(agreement, "poll", real_poll)


def interrupted_outside_task(name: str, p: int, m: int, fail_rank: int, where: str, which: str) -> dict[str, Any]:
    """After a good step, `fail_rank` gets `which` (KeyboardInterrupt, SystemExit or RuntimeError) once
    outside any task, at `where` (`_arm_outside_task`); its loop catches it and goes on. Returns how
    that step ended on this rank (its type, message, seconds) and how the next one did; checks the
    gradients after a next step that ran against the single-process reference of the steps that
    count."""
    rank = dist.get_rank()
    pipe, mine, ref, x, y = after_a_good_step(name, p, m)
    exc = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit,
           "RuntimeError": RuntimeError}[which](f"injected {where} {which}")
    disarm = _arm_outside_task(pipe, where, exc) if rank == fail_rank else (lambda: None)
    # the test says which each rank must raise
    outcome = timed_outcome(rank, lambda: pipe.step(x, target=y), (BaseException,), disarm=disarm)
    t1 = time.monotonic()
    try:
        pipe.step(x, target=y)
        outcome["next"] = "success"
    except PipelineError as exc_:
        outcome["next"] = str(exc_)
        return outcome
    finally:
        outcome["next_seconds"] = time.monotonic() - t1
    # the steps the gradients hold: the good one, the next one, and the interrupted one only where
    # the interrupt came after the end agreement had decided that it succeeded
    counted = 3 if where in ("end", "commit") else 2
    for _ in range(counted - 1):
        reference_step(ref, x, y)
    for s, st in mine.items():
        for (n, a), (_, b) in zip(st.named_parameters(), ref[s].named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=lambda msg: f"rank {rank} stage {s} {n}: {msg}",
                                       **tolerance(torch.device("cpu")))
    outcome["checked"] = True
    return outcome


def fifo_layers_fail_once(name: str, m: int, site: str, fail_rank: int) -> dict[str, Any]:
    """dp=2 x pp=2 of Transformer-Engine-like stages (FIFO ``backward_dw()``, wgrad reduce hooks:
    tests/dp/doubles.py), under the default data-parallel reducer. After a good step, global rank
    `fail_rank` fails once: ``"F"``, in the forward of microbatch 2 (zb-h2 then holds two wgrads of
    the step queued); ``"W"``, its first layer's first ``backward_dw`` raises before taking its wgrad;
    ``"F+interrupt"``: as ``"F"``, and that first ``backward_dw`` (the failed step's rollback's)
    raises KeyboardInterrupt before taking its wgrad. Then, gradients zeroed, a good step: its gradients must be one process's on the whole batch (a
    wgrad the failed step left queued would be computed by the next step's W in place of its own).
    Returns how the failed step ended and how many wgrads each layer still queued after it."""
    from tests.dp.harness import batch, grad_of, make_stage as dp_stage, reference_grads
    from tests.dp.harness import loss_fn as dp_loss

    rank = dist.get_rank()
    groups = ParallelGroups(pp=2)
    sched = make_schedule(name, 2, m)
    armed, forward_fails = _failing_forward(2, lambda: RuntimeError("injected F failure"))
    mine = {s: BeforeForward(dp_stage(s, "te")[0], forward_fails) for s in sched.stages_on(groups.pp_rank)}
    fifo = [mod for st in mine.values() for mod in st.modules() if hasattr(mod, "_fifo")]
    pipe = Pipeline(mine, sched, dp_loss, groups=groups)
    x, y = batch(0, 4 * m)
    mine_x, mine_y = x.chunk(2)[groups.dp_rank], y.chunk(2)[groups.dp_rank]
    pipe.step(mine_x, target=mine_y)
    if rank == fail_rank and site in ("W", "F+interrupt"):
        def w_fails() -> None:
            del fifo[0].backward_dw  # once: the class's again
            if site == "W":
                raise RuntimeError("injected W failure")
            raise KeyboardInterrupt("injected rollback interrupt")
        fifo[0].backward_dw = w_fails
    armed["on"] = rank == fail_rank and site.startswith("F")
    outcome: dict[str, Any] = {"rank": rank}
    try:
        pipe.step(mine_x, target=mine_y)
        outcome["result"] = "success"
    except (PipelineError, KeyboardInterrupt) as exc:
        outcome.update(result=type(exc).__name__, message=str(exc))
    finally:
        armed["on"] = False
        fifo[0].__dict__.pop("backward_dw", None)
    outcome["queued"] = [len(mod._fifo) for mod in fifo]
    for st in mine.values():
        st.zero_grad(set_to_none=True)
    pipe.step(mine_x, target=mine_y)
    # the replicas' average of their halves' mean is the whole batch's mean (equal halves)
    ref, _ = reference_grads(sched.num_stages, x, y)
    for s, st in mine.items():
        for n, p in st.inner.named_parameters():
            # float64 throughout: only the summation order differs (tests/dp/cases.py's tolerance)
            torch.testing.assert_close(grad_of(p), ref[s][n], rtol=1e-10, atol=1e-12,
                                       msg=lambda msg: f"rank {rank} stage {s} {n}: {msg}")
    return outcome


def reducer_wait_interrupted(name: str, p: int, m: int, fail_rank: int) -> dict[str, Any]:
    """dp=2: after a good step, `fail_rank`'s data-parallel reducer is interrupted (KeyboardInterrupt)
    as it starts waiting for its first bucket's all-reduce, at the step's end (`GradReducer.finish`).
    Returns how that step ended on this rank; then, gradients zeroed, a step on the same batch must
    leave the gradients of the uninterrupted first step (no optimizer: the same parameters)."""
    import zbpp.runtime.grad_reduce as grad_reduce

    rank = dist.get_rank()
    pipe, groups, x, y = replica_pipeline(name, p, m)
    pipe.step(x, target=y)
    first = {n: q.grad.clone() for n, q in enumerate(pipe.parameters())}
    real = grad_reduce.wait_for
    if rank == fail_rank:
        def interrupted(*args: Any, **kwargs: Any) -> None:
            grad_reduce.wait_for = real
            raise KeyboardInterrupt("injected reducer wait interrupt")
        grad_reduce.wait_for = interrupted
    outcome = timed_outcome(rank, lambda: pipe.step(x, target=y), (PipelineError, KeyboardInterrupt),
                            disarm=lambda: setattr(grad_reduce, "wait_for", real))
    for q in pipe.parameters():
        q.grad = None
    pipe.step(x, target=y)
    for n, q in enumerate(pipe.parameters()):
        # the same computation as the first step's, in the same order: equal bits
        torch.testing.assert_close(q.grad, first[n], rtol=0, atol=0, msg=lambda msg: f"rank {rank} parameter {n}: {msg}")
    return outcome


def loss_weight_interrupted(name: str, p: int, m: int, which: str) -> dict[str, Any]:
    """After a good step, ``loss_weight`` (user code, called on the rank holding the last stage
    before the start agreement) raises `which` (KeyboardInterrupt or SystemExit) once; that rank's
    loop catches it and goes on. Returns how that step ended on this rank; then a step whose
    gradients must be one process's on the good step's and its batch (nothing of the interrupted
    step counted). ``loss_weight`` gives each microbatch its rows: the default weighting."""
    rank = dist.get_rank()
    sched = make_schedule(name, p, m)
    S = sched.num_stages
    exc_type = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[which]
    armed = {"on": False}

    def rows(target: torch.Tensor) -> int:
        if armed["on"]:
            armed["on"] = False
            raise exc_type("injected loss_weight interrupt")
        return target.shape[0]

    mine = {s: make_stage(s, S, "zbpp") for s in sched.stages_on(rank)}
    ref = [make_stage(s, S, "plain") for s in range(S)]
    pipe = Pipeline(mine, sched, loss_fn, loss_weight=rows)
    x, y = make_batch(0, 2 * m)
    pipe.step(x, target=y)
    reference_step(ref, x, y)
    armed["on"] = pipe.holds_last_stage
    outcome = timed_outcome(rank, lambda: pipe.step(x, target=y), (PipelineError, KeyboardInterrupt, SystemExit),
                            disarm=lambda: armed.update(on=False))
    next_step_matches_reference(pipe, mine, ref, x, y)
    return outcome


def eval_and_train_at_once(name: str, p: int, m: int, evaluating_rank: int) -> dict[str, Any]:
    """`evaluating_rank` calls ``eval_step`` while every other rank calls ``step`` (a loop whose
    evaluation interval is counted per rank, wrongly). Returns how that call ended on this rank;
    then every rank trains a step, whose gradients must be one process's on its batch."""
    rank = dist.get_rank()
    sched = make_schedule(name, p, m)
    S = sched.num_stages
    mine = {s: make_stage(s, S, "zbpp") for s in sched.stages_on(rank)}
    ref = [make_stage(s, S, "plain") for s in range(S)]
    pipe = Pipeline(mine, sched, loss_fn)
    x, y = make_batch(0, 2 * m)
    call = pipe.eval_step if rank == evaluating_rank else pipe.step
    outcome = timed_outcome(rank, lambda: call(x, target=y), (Exception,))  # the test says which
    assert all(q.grad is None for q in pipe.parameters()), f"rank {rank}: a refused step touched a gradient"
    next_step_matches_reference(pipe, mine, ref, x, y)
    return outcome


def rollback_interrupted(name: str, p: int, m: int, fail_rank: int) -> dict[str, Any]:
    """After a good step, `fail_rank` fails in the forward of microbatch ``m - 2`` (wgrads of its
    stage are then pending), and, as it rolls the failed step back, its first delayed layer's
    ``discard_wgrad`` is interrupted (KeyboardInterrupt, a second Ctrl-C) before dropping anything.
    Returns how that step ended on this rank; then a step whose gradients must be one process's on
    the good step's batch and its own (nothing of the failed step, no stale wgrad)."""
    rank = dist.get_rank()
    sched = make_schedule(name, p, m)
    S = sched.num_stages
    armed, forward_fails = _failing_forward(m - 2, lambda: RuntimeError("injected F failure"))

    mine = {s: BeforeForward(make_stage(s, S, "zbpp"), forward_fails) for s in sched.stages_on(rank)}
    ref = [make_stage(s, S, "plain") for s in range(S)]
    pipe = Pipeline(mine, sched, loss_fn)
    x, y = make_batch(0, 2 * m)
    pipe.step(x, target=y)
    reference_step(ref, x, y)
    layer = next(a.module for w in pipe._wgrad.values() for a in w.adapters)
    if rank == fail_rank:
        armed["on"] = True

        def interrupted() -> None:
            del layer.discard_wgrad  # once: the class's again
            raise KeyboardInterrupt("injected rollback interrupt")
        layer.discard_wgrad = interrupted
    outcome = timed_outcome(rank, lambda: pipe.step(x, target=y), (PipelineError, KeyboardInterrupt),
                            disarm=lambda: (armed.update(on=False), layer.__dict__.pop("discard_wgrad", None)))
    outcome["pending"] = [k for st in mine.values() for mod in st.modules() if hasattr(mod, "pending_wgrad_keys")
                          for k in mod.pending_wgrad_keys()]
    pipe.step(x, target=y)
    reference_step(ref, x, y)
    for s, st in mine.items():
        for (n, a), (_, b) in zip(st.inner.named_parameters(), ref[s].named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=lambda msg: f"rank {rank} stage {s} {n}: {msg}",
                                       **tolerance(torch.device("cpu")))
    return outcome


def ctrl_c_while_told_the_failure(name: str, p: int, m: int, fail_rank: int) -> dict[str, Any]:
    """After a good step, pipeline rank 0 fails in the forward of microbatch 1 and takes a second to
    roll the step back; meanwhile `fail_rank`, in the exchange of the failure's messages that follows
    the end agreement (`Agreement.gather_texts`), gets a real SIGINT (Ctrl-C), and its loop catches
    the KeyboardInterrupt and goes on. Returns how that step ended on this rank and how the next one
    did; checks the gradients after the next step against the single-process reference of the good
    step and the next one (the failed step counts nowhere)."""
    import signal
    import threading

    rank = dist.get_rank()
    pipe, mine, ref, x, y = after_a_good_step(name, p, m)
    agreement, real_texts, real_roll_back = pipe._agreement, pipe._agreement.gather_texts, pipe._roll_back
    patched: list[tuple[Any, str]] = []
    if rank == 0:
        stage = next(iter(mine.values()))
        real_forward = stage.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if current_microbatch()[1] == 1:
                raise RuntimeError("injected F failure")
            return real_forward(*args, **kwargs)

        def slow_roll_back(step: Any) -> None:
            time.sleep(1.0)  # the other rank waits in the exchange meanwhile
            real_roll_back(step)
        stage.forward, pipe._roll_back = forward, slow_roll_back
        patched += [(stage, "forward"), (pipe, "_roll_back")]
    if rank == fail_rank:
        def texts(text: str | None) -> list[str | None]:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # while it waits for rank 0
            return real_texts(text)
        agreement.gather_texts = texts
        patched.append((agreement, "gather_texts"))

    def disarm() -> None:
        time.sleep(0.5)  # no SIGINT still on its way into the next step
        for obj, attr in patched:
            obj.__dict__.pop(attr, None)

    outcome = timed_outcome(rank, lambda: pipe.step(x, target=y), (PipelineError, KeyboardInterrupt), disarm=disarm)
    next_step_matches_reference(pipe, mine, ref, x, y)
    outcome["next"] = "success"
    return outcome



def ctrl_c_while_gathering_task_times(name: str, p: int, m: int, fail_rank: int) -> dict[str, Any]:
    """After a good step with ``record_task_times=True``, every rank calls ``task_times()``; rank 0
    comes a second late, and `fail_rank`, waiting for it, gets a real SIGINT (Ctrl-C). Returns how
    the call ended on this rank ("result") and how many records rank 0 got ("records")."""
    import signal
    import threading

    rank = dist.get_rank()
    sched = make_schedule(name, p, m)
    mine = {s: make_stage(s, sched.num_stages, "zbpp") for s in sched.stages_on(rank)}
    pipe = Pipeline(mine, sched, loss_fn, record_task_times=True)
    x, y = make_batch(0, 2 * m)
    pipe.step(x, target=y)
    got: dict[str, Any] = {}
    if rank == 0:
        time.sleep(1.0)  # the others wait for it in the exchange
    if rank == fail_rank:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    outcome = timed_outcome(rank, lambda: got.update(records=pipe.task_times()), (Exception, KeyboardInterrupt),
                            disarm=lambda: time.sleep(0.5))  # no SIGINT still on its way
    outcome["records"] = len(got["records"]) if got.get("records") is not None else None
    return outcome


def ctrl_c_while_a_new_shape_arrives(name: str, p: int, m: int, fail_rank: int) -> dict[str, Any]:
    """After a good step, a step on a batch of another size (a new input signature: each activation's
    spec travels before its tensors, `Channels.recv_object`), where pipeline rank 0 takes a second over
    its first forward and `fail_rank`, waiting for that spec, gets a real SIGINT (Ctrl-C); its loop
    catches the KeyboardInterrupt and goes on. Returns how that step ended on this rank; then a step
    on the new batch, whose gradients must be one process's on the good step's batch and its own."""
    import signal
    import threading

    rank = dist.get_rank()
    pipe, mine, ref, _, _ = after_a_good_step(name, p, m)
    x, y = make_batch(1, 2 * m + 2)
    stage = next(iter(mine.values()))
    if rank == 0:
        real = stage.forward

        def slow(*args: Any, **kwargs: Any) -> Any:
            if current_microbatch()[1] == 0:
                time.sleep(1.0)  # the next rank waits for its output's spec meanwhile
            return real(*args, **kwargs)
        stage.forward = slow
    if rank == fail_rank:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()

    def disarm() -> None:
        time.sleep(0.5)  # no SIGINT still on its way into the next step
        stage.__dict__.pop("forward", None)

    outcome = timed_outcome(rank, lambda: pipe.step(x, target=y), (PipelineError, KeyboardInterrupt), disarm=disarm)
    next_step_matches_reference(pipe, mine, ref, x, y)
    outcome["next"] = "success"
    return outcome


def ctrl_c_in_the_loss_weights_all_reduce(name: str, m: int, fail_rank: int) -> dict[str, Any]:
    """dp=2 of one-rank pipelines with ``loss_weight``: after a good step, the replica other than
    `fail_rank` comes a second late to the data-parallel all-reduce of the loss weights
    (`weight_factors`, right after the start agreement), and `fail_rank`, waiting in it, gets a real
    SIGINT (Ctrl-C); its loop catches the KeyboardInterrupt and goes on. Returns how that step ended
    on this rank; then, gradients cleared, a step on the same batch must leave the gradients of the
    uninterrupted first step (no optimizer: the same parameters)."""
    import signal
    import threading

    import zbpp.runtime.pipeline as pipeline_module

    rank = dist.get_rank()
    groups = ParallelGroups(pp=1)
    sched = make_schedule(name, 1, m)
    mine = {s: make_stage(s, sched.num_stages, "zbpp") for s in sched.stages_on(0)}
    x, y = make_batch(groups.dp_rank, 2 * m)
    pipe = Pipeline(mine, sched, loss_fn, groups=groups, loss_weight=lambda t: t.shape[0])
    pipe.step(x, target=y)
    first = [q.grad.clone() for q in pipe.parameters()]
    real = pipeline_module.weight_factors

    def late(*args: Any, **kwargs: Any) -> Any:
        if rank == fail_rank:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # while it waits for the peer
        else:
            time.sleep(1.0)
        return real(*args, **kwargs)
    pipeline_module.weight_factors = late

    def disarm() -> None:
        time.sleep(0.5)  # no SIGINT still on its way into the next step
        pipeline_module.weight_factors = real

    outcome = timed_outcome(rank, lambda: pipe.step(x, target=y), (PipelineError, KeyboardInterrupt), disarm=disarm)
    for q in pipe.parameters():
        q.grad = None
    pipe.step(x, target=y)
    for n, q in enumerate(pipe.parameters()):
        # the same computation as the first step's, in the same order: equal bits
        torch.testing.assert_close(q.grad, first[n], rtol=0, atol=0, msg=lambda msg: f"rank {rank} parameter {n}: {msg}")
    outcome["next"] = "success"
    return outcome


def _failing_forward(microbatch: int, error: Callable[[], BaseException]) -> tuple[dict[str, bool], Callable[[Any], None]]:
    """A `BeforeForward` hook that raises `error()` in the forward of `microbatch` while
    ``armed["on"]``, and that switch (off)."""
    armed = {"on": False}

    def hook(key: Any) -> None:
        if armed["on"] and key[1] == microbatch:
            raise error()

    return armed, hook


def clip_refused_on_one_rank(fail_rank: int, by_groups: bool) -> dict[str, Any]:
    """`clip_grad_norm_` given this rank's parameter (no Pipeline; `by_groups`: with a
    ``ParallelGroups`` of one pipeline, else the whole world), refused on `fail_rank` (its parameter
    has a main_grad beside its .grad): how each rank's call ended, timed; then the same call without
    the main_grad on every rank, whose norm and clipped gradient ``"next"`` compares with torch's
    clip of every rank's parameter in one process (the group is left usable)."""
    from zbpp.runtime import clip_grad_norm_

    rank, world = dist.get_rank(), dist.get_world_size()
    groups = ParallelGroups(world) if by_groups else None

    def grads() -> list[torch.Tensor]:  # rank r holds [3, 4] * (r + 1): norms 5, 10, ...
        return [torch.tensor([3.0, 4.0], dtype=torch.float64) * (r + 1) for r in range(world)]

    mine = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    mine.grad = grads()[rank]
    if rank == fail_rank:
        mine.main_grad = torch.zeros_like(mine)
    outcome = timed_outcome(rank, lambda: clip_grad_norm_([mine], 1.0, groups), (ValueError, PipelineError))
    if rank == fail_rank:
        del mine.main_grad
    ref = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)) for _ in range(world)]
    for p, g in zip(ref, grads()):
        p.grad = g
    want = float(torch.nn.utils.clip_grad_norm_(ref, 1.0))
    mine.grad = grads()[rank]
    got = float(clip_grad_norm_([mine], 1.0, groups))
    # float64 sums of a few squares, in another order: 1e-12 leaves room for rounding only
    close = math.isclose(got, want, rel_tol=1e-12) and torch.allclose(mine.grad, ref[rank].grad, rtol=1e-12)
    outcome["next"] = "success" if close else f"norm {got}, grad {mine.grad}; torch in one process: {want}, {ref[rank].grad}"
    return outcome


def delay_off_on_one_replica(toggled_stage: int) -> dict[str, Any]:
    """dp=2 x pp=2 under zb-v, each stage a delayed-wgrad Linear and a tanh (float64; no split: W
    is the Linear's own). After a good step replica 1 turns ``delay_wgrad_compute`` off on stage
    `toggled_stage`'s Linear: that stage's gradients were then final at B on replica 1 and at W on
    replica 0, the reducers launched their buckets in another order and gloo paired unlike ones
    (the step "succeeded" with wrong gradients). How that step ended on this rank, timed; then the
    flag set back and one more step, whose gradients ``"next"`` compares with one process running
    the whole plain model on both replicas' rows."""
    from zbpp.modules import delay_wgrad
    from zbpp.schedules import build

    width = 8

    def stage(s: int, delayed: bool = True) -> torch.nn.Module:
        torch.manual_seed(100 + s)
        module = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()).double()
        return delay_wgrad(module) if delayed else module

    def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    rank = dist.get_rank()
    groups = ParallelGroups(pp=2)
    sched = build("zb-v", num_ranks=2, num_microbatches=4)
    mine = {s: stage(s) for s in sched.stages_on(groups.pp_rank)}
    pipe = Pipeline(mine, sched, mse, groups=groups)
    g = torch.Generator().manual_seed(5)
    x, y = (torch.randn(16, width, generator=g, dtype=torch.float64) for _ in range(2))
    rows = slice(8 * groups.dp_rank, 8 * groups.dp_rank + 8)
    pipe.step(x[rows], target=y[rows])
    toggled = mine[toggled_stage][0] if groups.dp_rank == 1 and toggled_stage in mine else None
    if toggled is not None:
        toggled.delay_wgrad_compute = False
    for q in pipe.parameters():
        q.grad = None
    outcome = timed_outcome(rank, lambda: pipe.step(x[rows], target=y[rows]), (Exception,))
    if toggled is not None:
        toggled.delay_wgrad_compute = True
    for q in pipe.parameters():
        q.grad = None
    pipe.step(x[rows], target=y[rows])
    ref = [stage(s, delayed=False) for s in range(sched.num_stages)]
    out = x
    for module in ref:
        out = module(out)
    mse(out, y).backward()  # the mean over both replicas' rows: what the replicas' average is
    # float64, another order of summation (microbatches, the replicas' average): 1e-12 is rounding only
    bad = [f"stage {s} {n}" for s in mine for (n, a), b in zip(mine[s].named_parameters(), ref[s].parameters())
           if a.grad is None or not torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-14)]
    outcome["next"] = f"gradients unlike the reference: {bad}" if bad else "success"
    return outcome


def tied_main_grad_failed_step() -> dict[str, Any]:
    """dp=2 x pp=2 under zb-h1: stages 0 and 1 each a fused delayed-wgrad Linear (no bias) and a tanh,
    their weights one tied parameter, whose ``main_grad`` the user attached (the reducer leaves tied
    parameters out, so that main_grad is the user's and accumulates across steps). A good step, a
    step that fails on global rank 1 at microbatch 3 (after W tasks added to main_grad), a good step.
    The failed step's partial gradient stayed in main_grad (the aside copied no main_grad once a
    reducer existed), and each good step's sum over the copies counted the earlier steps' sum once
    per copy (main_grad was not set aside as .grad is: 1, 3, 7 times the gradient). Returns the largest differences of main_grad from one process running the
    whole plain model (the weight used twice) on both replicas' rows: after the failed step (want the
    first step's) and after the last (want two steps')."""
    from zbpp.modules import Linear, current_microbatch
    from zbpp.schedules import build

    width = 8
    armed = [False]

    class Bomb(torch.nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            if armed[0] and current_microbatch() == (1, 3):
                raise RuntimeError("injected failure")
            return h

    def stage(fused: bool = True) -> torch.nn.Module:
        torch.manual_seed(100)  # the same weight on both stages: one tied parameter
        lin = torch.nn.Linear(width, width, bias=False)
        if fused:
            layer = Linear(width, width, bias=False, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
            layer.load_state_dict(lin.state_dict())
            lin = layer
        return torch.nn.Sequential(lin, torch.nn.Tanh(), Bomb()).double()

    def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    groups = ParallelGroups(pp=2)
    sched = build("zb-h1", num_ranks=2, num_microbatches=4)
    mine = {s: stage() for s in sched.stages_on(groups.pp_rank)}
    weight = next(iter(mine.values()))[0].weight
    weight.main_grad = torch.zeros_like(weight)
    pipe = Pipeline(mine, sched, mse, groups=groups, tied_parameters={"w": weight})
    g = torch.Generator().manual_seed(5)
    x, y = (torch.randn(16, width, generator=g, dtype=torch.float64) for _ in range(2))
    n = 16 // groups.dp  # this replica's rows
    rows = slice(n * groups.dp_rank, n * groups.dp_rank + n)
    ref = stage(fused=False)
    mse(ref(ref(x)), y).backward()  # the mean over both replicas' rows, the weight used twice
    want = ref[0].weight.grad
    pipe.step(x[rows], target=y[rows])
    armed[0] = dist.get_rank() == 1
    try:
        pipe.step(x[rows], target=y[rows])
    except PipelineError:
        pass
    finally:
        armed[0] = False
    after_failure = float((weight.main_grad - want).abs().max())
    pipe.step(x[rows], target=y[rows])
    return {"after_failure": after_failure, "next": float((weight.main_grad - 2 * want).abs().max())}


def buffer_sync_fails_once(name: str, p: int, m: int, fail_rank: int) -> dict[str, Any]:
    """dp=2: the last stage holds a persistent buffer (the others none); after a good step, the copy
    of replica 0's buffers into `fail_rank`'s raises once, after the broadcast completed. Returns how
    that step and the next ended on this rank (the job is broken then: run it in its own processes)."""
    import zbpp.runtime.replica_buffers as replica_buffers

    rank = dist.get_rank()
    pipe, groups, x, y = replica_pipeline(name, p, m)
    last = pipe.schedule.num_stages - 1
    if last in pipe.stage_modules:
        pipe.stage_modules[last].register_buffer("seen", torch.full((2,), float(groups.dp_rank)))
    pipe.step(x, target=y)
    real = replica_buffers.foreach_copy_
    if rank == fail_rank:
        def failing(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("injected buffer copy failure")
        replica_buffers.foreach_copy_ = failing
    try:
        return {"rank": rank, **failing_then_next(pipe, x, y)}
    finally:
        replica_buffers.foreach_copy_ = real


def user_hook_fails_once(name: str, p: int, m: int, fail_rank: int, which: str) -> dict[str, Any]:
    """After a good step, a hook of the user's on `fail_rank`'s stage raises at its first call of the
    next step: ``"grad"``, a tensor hook on the LayerNorm's weight (its gradient comes in W, from the
    split backward); ``"backward"``, a full backward hook on that LayerNorm (it runs in B). How that
    step ended on this rank, timed; then the next step must match the one-process reference."""
    rank = dist.get_rank()
    pipe, mine, ref, x, y = after_a_good_step(name, p, m)
    armed = {"on": rank == fail_rank}

    def bomb(*args: Any) -> None:
        if armed["on"]:
            raise RuntimeError(f"injected {which} hook failure")

    norm = next(iter(mine.values())).norm
    handle = norm.weight.register_hook(bomb) if which == "grad" else norm.register_full_backward_hook(bomb)
    try:
        outcome = timed_outcome(rank, lambda: pipe.step(x, target=y), (PipelineError,),
                                disarm=lambda: armed.update(on=False))
        next_step_matches_reference(pipe, mine, ref, x, y)
    finally:
        handle.remove()
    return outcome
