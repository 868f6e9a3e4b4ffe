"""What every rank runs in the tests of a step retried after a failure (`test_retry_after_failure.py`).

A user's loop catches `PipelineError` and runs the same batch again. With dropout (0.3 in every stage
of `inputs_cases.Stage`, a tiny float64 LM) the retry must draw what the uninterrupted run's step
draws: the reference is `inputs_cases.seeded_reference`, one process seeding stage s of microbatch j
with ``microbatch_seed(base, step, s, j)`` (the documented derivation), `step` counting the steps
that succeeded (training and evaluation).

Tolerance: float64 ``rtol=1e-10, atol=1e-12`` (`inputs_cases.TOL`): the pipeline adds the
microbatches' gradients in the schedule's order, the reference in microbatch order (~1e-16
relative); one wrong dropout mask moves a loss or a gradient by percents.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from zbpp import Pipeline
from zbpp.runtime import PipelineError

from .cases import make_schedule
from .inputs_cases import TOL, V, Stage, check_grads, loss_fn, padded_batch, run_stages, seeded_reference

BASE = 2468


def _batch(m: int, seed: int) -> tuple[dict[str, Any], torch.Tensor]:
    inputs, y = padded_batch(3 * m + 1, seed=seed)
    return inputs, torch.randint(0, V, y.shape, generator=torch.Generator().manual_seed(seed + 1))


def _all_equal(value: int) -> list[int]:
    """`value` of every rank (gloo all-gather)."""
    out = [torch.zeros((), dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor(value, dtype=torch.int64))
    return [int(v) for v in out]


def retry_with_dropout(name: str, p: int, fail_rank: int, evaluate: bool) -> dict[str, Any]:
    """Step 0 fails on `fail_rank` (its first stage's forward of microbatch 1 raises), the loop retries
    the same batch: loss and gradients must be the uninterrupted run's step 0. With `evaluate`, an
    ``eval_step`` fails the same way then runs again, then a training step on another batch must be
    the uninterrupted run's step 2 (the evaluation was its step 1). Returns this rank's outcomes and
    ``rng_step`` after each call (every rank's, to compare)."""
    rank = dist.get_rank()
    sched = make_schedule(name, p, 2 * p)
    m, S = sched.num_microbatches, sched.num_stages
    mine = {s: Stage(s, S, pdrop=0.3) for s in sched.stages_on(rank)}
    armed = {"on": False}
    failing = sched.stages_on(fail_rank)[0]

    def bomb(module: Any, args: Any) -> None:
        from zbpp.modules import current_microbatch

        if armed["on"] and current_microbatch() == (failing, 1):
            raise RuntimeError("injected F failure")

    if rank == fail_rank:
        mine[failing].register_forward_pre_hook(bomb)
    pipe = Pipeline(mine, sched, loss_fn, seed=BASE)
    ref = [Stage(s, S, pdrop=0.3) for s in range(S)]
    outcome: dict[str, Any] = {"rank": rank, "results": [], "rng_steps": []}

    def attempt(call: Any, *args: Any, **kwargs: Any) -> Any:
        armed["on"] = True
        t0 = time.monotonic()
        try:
            call(*args, **kwargs)
            outcome["results"].append("success")
        except PipelineError:
            outcome["results"].append("PipelineError")
        finally:
            armed["on"] = False
        outcome["seconds"] = time.monotonic() - t0
        outcome["rng_steps"].append(_all_equal(pipe.rng_step))
        return call(*args, **kwargs)  # the retry

    inputs, y = _batch(m, 3)
    loss = attempt(pipe.step, inputs, target=y)
    want = seeded_reference(ref, inputs, y, m, BASE, 0, torch.device("cpu"))
    if pipe.holds_last_stage:
        torch.testing.assert_close(loss, want, msg=lambda s: f"rank {rank} retried step's loss: {s}", **TOL)
    check_grads(mine, ref, TOL, f"rank {rank} retried step")
    if evaluate:
        for st in [*mine.values(), *ref]:
            st.zero_grad(set_to_none=True)
        attempt(pipe.eval_step, inputs, target=y)
        inputs, y = _batch(m, 11)
        loss = pipe.step(inputs, target=y)
        want = seeded_reference(ref, inputs, y, m, BASE, 2, torch.device("cpu"))
        if pipe.holds_last_stage:
            torch.testing.assert_close(loss, want, msg=lambda s: f"rank {rank} step after eval: {s}", **TOL)
        check_grads(mine, ref, TOL, f"rank {rank} step after a retried eval_step")
    outcome["rng_steps"].append(_all_equal(pipe.rng_step))
    return outcome


def weight_fails_on_last_rank(name: str, p: int) -> dict[str, Any]:
    """``loss_weight`` returns, once, a one-element tensor that cannot be brought to the device (a
    meta tensor: it passes the type check, its copy raises). The rank holding the last stage raised
    it after the start agreement, out of the step, while its peers ran the step and waited for its
    messages until the pipeline's timeout (20 s here). Every rank must raise within seconds, count
    the random stream alike, and the retry must be the uninterrupted run's step (tokens weigh)."""
    rank = dist.get_rank()
    sched = make_schedule(name, p, 2 * p)
    m, S = sched.num_microbatches, sched.num_stages
    mine = {s: Stage(s, S) for s in sched.stages_on(rank)}
    armed = {"on": False}

    def tokens(y: torch.Tensor) -> torch.Tensor:
        n = (y != -100).sum()
        return torch.empty((), device="meta") if armed["on"] else n

    pipe = Pipeline(mine, sched, loss_fn, seed=BASE, loss_weight=tokens, timeout=20.0)
    ref = [Stage(s, S) for s in range(S)]
    inputs, y = _batch(m, 5)
    outcome: dict[str, Any] = {"rank": rank}
    armed["on"] = pipe.holds_last_stage
    t0 = time.monotonic()
    try:
        pipe.step(inputs, target=y)
        outcome["result"] = "success"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome.update(result=type(exc).__name__, message=str(exc))
    finally:
        armed["on"] = False
    outcome["seconds"] = time.monotonic() - t0
    outcome["rng_steps"] = _all_equal(pipe.rng_step)
    loss = pipe.step(inputs, target=y)
    # the reference: the token mean over the whole batch (one process, no dropout)
    want = loss_fn(run_stages(ref, inputs), y)
    want.backward()
    if pipe.holds_last_stage:
        torch.testing.assert_close(loss, want.detach(), msg=lambda s: f"rank {rank} retried loss: {s}", **TOL)
    check_grads(mine, ref, TOL, f"rank {rank} retry after a bad loss_weight")
    return outcome
