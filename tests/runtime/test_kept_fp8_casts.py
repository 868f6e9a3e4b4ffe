"""A pipeline stage that keeps its FP8 weight casts across the step's microbatches, the way the
README shows (``is_first_microbatch=current_microbatch()[1] == 0``), in one process.

Reference: the same pipeline casting the weights on every microbatch. After a warm-up step that
settles the weights' scales (no optimizer step follows: the weights stay as they are), every later
cast of a weight gives the same bytes, so the kept casts must give bit-identical losses and
gradients (rtol=atol=0) with one weight cast per stage and step instead of one per microbatch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zbpp import Pipeline
from zbpp.modules import DelayedScaling, Linear, current_microbatch, fp8_autocast
from zbpp.schedules import build

WIDTH, ROWS, MICROBATCHES = 32, 64, 4  # 16 rows per microbatch: _scaled_mm runs
RECIPE = DelayedScaling(amax_history_len=16)


class Fp8Stage(nn.Module):
    def __init__(self, *, delay: bool, keep: bool | None) -> None:
        super().__init__()
        self.lin = Linear(WIDTH, WIDTH, delay_wgrad_compute=delay)
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = None if not self.keep else current_microbatch()[1] == 0
        with fp8_autocast(enabled=True, fp8_recipe=RECIPE):
            return self.lin(x, is_first_microbatch=first)


def weight_casts(stage: Fp8Stage) -> int:
    return int((stage.lin.fp8_meta["weight"].amax_history != 0).sum())


@pytest.mark.parametrize("name, delay", [("1f1b", False), ("zb-h1", True), ("zb-v", True)])
def test_kept_casts_match_casting_every_microbatch(name, delay):
    sched = build(name, num_ranks=1, num_microbatches=MICROBATCHES)
    torch.manual_seed(3)
    kept = {s: Fp8Stage(delay=delay, keep=False) for s in range(sched.num_stages)}
    every = copy.deepcopy(kept)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randn(ROWS, WIDTH, generator=gen) for _ in range(3)]
    pipes = {"kept": Pipeline(kept, sched, lambda out, _: out.square().mean()),
             "every": Pipeline(every, sched, lambda out, _: out.square().mean())}
    for step, x in enumerate(batches):
        for s in kept:
            kept[s].keep = step > 0  # step 0 (warm-up) casts every microbatch in both
        losses = {k: pipe.step(x) for k, pipe in pipes.items()}
        assert torch.equal(losses["kept"], losses["every"]), step
        for s in kept:
            # the step released its casts (the next one casts afresh): no weight-sized FP8 copy left
            assert not kept[s].lin._fp8_weight_casts["weight"].kept, (step, s)
            for (n, a), b in zip(kept[s].named_parameters(), every[s].parameters()):
                assert torch.equal(a.grad, b.grad), (step, s, n)
            kept[s].zero_grad(set_to_none=True)
            every[s].zero_grad(set_to_none=True)
    for s in kept:
        assert weight_casts(every[s]) == 3 * MICROBATCHES
        assert weight_casts(kept[s]) == MICROBATCHES + 2  # warm-up, then one per step


def test_eval_step_releases_the_kept_casts():
    sched = build("1f1b", num_ranks=1, num_microbatches=MICROBATCHES)
    stage = Fp8Stage(delay=False, keep=True)
    seen = []
    stage.lin.register_forward_hook(lambda *_: seen.append(stage.lin._fp8_weight_casts["weight"].kept))
    pipe = Pipeline({0: stage}, sched, lambda out, _: out.square().mean())
    pipe.eval_step(torch.randn(ROWS, WIDTH))
    assert seen == [True] * MICROBATCHES  # kept for the later microbatches while the step ran
    assert not stage.lin._fp8_weight_casts["weight"].kept
    assert weight_casts(stage) == 1


def test_a_failed_step_releases_the_kept_casts_too():
    from zbpp.runtime import PipelineError

    sched = build("zb-h1", num_ranks=1, num_microbatches=MICROBATCHES)
    stage = Fp8Stage(delay=True, keep=True)

    def loss_fn(out, _):
        if current_microbatch()[1] == MICROBATCHES - 1:  # after the first microbatch kept its cast
            raise RuntimeError("this loss fails")
        return out.square().mean()

    pipe = Pipeline({0: stage}, sched, loss_fn)
    with pytest.raises(PipelineError, match="this loss fails"):
        pipe.step(torch.randn(ROWS, WIDTH))
    assert not stage.lin._fp8_weight_casts["weight"].kept
