"""`zbpp measure` (`zbpp.models.measure_profile`) measures a stage's B and W through the runtime's own
split: its W does the work of the W task `Pipeline` runs for the same stage, on a stage whose W
comes from the generic split of plain layers and on one of delayed-wgrad layers; the memory W
keeps is what the split's marks leave after B (checked by hand on the plain stage, float64).

The work is compared in FLOPs (`torch.utils.flop_counter`, matmuls), not seconds, so that the test
is exact on a shared CPU: the measurement's timer is replaced by a FLOP counter, the pipeline's W
task is counted by `split_cases.TaskFlops`. Tolerance 10% (the issue's bound): both sides run the
same kernels, so the counts should agree exactly; the bound leaves room for a loss's scalar ops.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from zbpp import Pipeline
from zbpp.models import measure_profile
from zbpp.models import profile as profile_module
from zbpp.modules import Linear as DelayedLinear
from zbpp.schedules import build

from .split_cases import TaskFlops

ROWS, WIDTH = 8, 16


def _counting_timer(monkeypatch) -> None:
    """measure_profile's timer returns the FLOPs of what it times instead of seconds."""

    def count(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        with FlopCounterMode(display=False) as fc:
            value = fn()
        return value, float(fc.get_total_flops())

    monkeypatch.setattr(profile_module._Timer, "__call__", count)


def _stage(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "plain":  # W from the runtime's generic split
        return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH)).double()
    return nn.Sequential(DelayedLinear(WIDTH, 2 * WIDTH, params_dtype=torch.float64, delay_wgrad_compute=True), nn.Tanh(),
                         DelayedLinear(2 * WIDTH, WIDTH, params_dtype=torch.float64, delay_wgrad_compute=True))


@pytest.mark.parametrize("kind", ["plain", "delayed"])
def test_measured_w_is_the_runtime_w(monkeypatch, kind: str) -> None:
    torch.manual_seed(1)
    pre, stage = nn.Linear(WIDTH, WIDTH).double(), _stage(kind)  # pre: the stage's input needs a gradient
    x = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    y = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    loss = nn.functional.mse_loss

    _counting_timer(monkeypatch)
    measured = measure_profile(layers=[("pre", pre), ("stage", stage)], example_input=x, loss_fn=loss, target=y,
                               steps=1, warmup=0).layers[1]

    sched = build("zb-v", num_ranks=1, num_microbatches=1)  # stage 0 (pre) and stage 1 on one rank
    pipe = Pipeline({0: pre, 1: stage}, sched, loss_fn=loss)
    with TaskFlops().installed() as flops:
        pipe.step(x, y)
    runtime_w = flops.flops[(1, "W")]

    assert runtime_w > 0
    assert measured.w == pytest.approx(runtime_w, rel=0.10), (measured.w, runtime_w)
    # and B: the input's gradient only, as the runtime's B computes it
    assert measured.b == pytest.approx(flops.flops[(1, "B")], rel=0.10), (measured.b, flops.flops[(1, "B")])
    if kind == "plain":
        # what W keeps, by the split's own marks: each Linear's input (the weight GEMMs' operand);
        # tanh's saved output serves B, but the second Linear keeps the same storage: counted once
        assert measured.wgrad == (ROWS * WIDTH + ROWS * 2 * WIDTH) * 8, measured.wgrad
