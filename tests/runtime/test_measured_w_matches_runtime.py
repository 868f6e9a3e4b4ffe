"""`zbpp measure` (`zbpp.models.measure_profile`) measures a stage's B and W through the runtime's own
split: its B and W do the work of the B and W tasks `Pipeline` runs for the same stage, and the
memory it says W keeps is what the runtime keeps from B to W, on a first stage (whose input needs
no gradient: B computes nothing, W runs the whole backward), on a stage whose W comes from the
generic split of plain layers and on one of delayed-wgrad layers only (float64, one process).

References: the runtime, instrumented here (test-only): its tasks' FLOPs (`split_cases.TaskFlops`)
and, right after each B task, the bytes of the storages its stage's forward saved that are still
alive; and hand counts of the bytes.

Tolerances. Work in FLOPs (`torch.utils.flop_counter`, matmuls), not seconds, so that the test is
exact on a shared CPU: the measurement's timer is replaced by a FLOP counter. Both sides run the
same kernels, so the counts agree exactly; the assertion allows 10% (the issue's bound) for a
loss's scalar ops. Bytes: exact (both count the same storages; a missed or extra tensor is at
least ROWS x WIDTH x 8 bytes off).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import FlopCounterMode

from zbpp import Pipeline
from zbpp.models import measure_profile
from zbpp.models import profile as profile_module
from zbpp.modules import Linear as DelayedLinear
from zbpp.runtime import _autograd_split
from zbpp.runtime import executor as _executor
from zbpp.schedules import build

from .split_cases import TaskFlops

ROWS, WIDTH = 8, 16
F64 = 8
REL = 0.10  # FLOPs: exact in practice, 10% allowed (see the module docstring)
# A backward reading a released output (its storage shrunk, as a sent activation's) makes torch
# resize it, with this warning: the profile must release only what the runtime sends
pytestmark = pytest.mark.filterwarnings("error:An output with one or more elements was resized")


def _counting_timer(monkeypatch) -> None:
    """measure_profile's timer returns the FLOPs of what it times instead of seconds."""

    def count(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        with FlopCounterMode(display=False) as fc:
            value = fn()
        return value, float(fc.get_total_flops())

    monkeypatch.setattr(profile_module._Timer, "__call__", count)


class _RuntimeKept:
    """Per stage: bytes of the storages its forward saved (parameters and the batch left out)
    still alive right after its B task, in the runtime (wraps the executor and the split's boxes)."""

    def __init__(self, skip: list[torch.Tensor]) -> None:
        self.skip = {t.untyped_storage().data_ptr() for t in skip}
        self.saved: dict[int, dict[int, tuple[StorageWeakRef, int]]] = {}
        self.after_b: dict[int, int] = {}
        self._stage: int | None = None

    def _record(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if self._stage is not None and st.data_ptr() not in self.skip:
            self.saved.setdefault(self._stage, {}).setdefault(st.data_ptr(), (StorageWeakRef(st), st.nbytes()))

    @contextlib.contextmanager
    def installed(self, monkeypatch, stages: dict[int, nn.Module]):
        self.skip |= {t.untyped_storage().data_ptr() for m in stages.values() for t in [*m.parameters(), *m.buffers()]}
        box_init = _autograd_split._Box.__init__
        run_task = _executor.StepExecutor._run_task

        def box(b, t, state):  # a split B's forward: every saved tensor goes into a box
            self._record(t)
            box_init(b, t, state)

        def pack(t: torch.Tensor) -> torch.Tensor:  # a forward without boxes
            self._record(t)
            return t.detach()

        def run(ex, a, *args):
            if a.kind.value == "F":
                self._stage = a.stage
                try:
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        return run_task(ex, a, *args)
                finally:
                    self._stage = None
            run_task(ex, a, *args)
            if a.kind.value == "B":
                self.after_b[a.stage] = sum(n for ref, n in self.saved.get(a.stage, {}).values() if not ref.expired())

        monkeypatch.setattr(_autograd_split._Box, "__init__", box)
        monkeypatch.setattr(_executor.StepExecutor, "_run_task", run)
        yield self


def _first() -> nn.Module:
    """A first stage whose GELU saves its input: a tensor only B reads on a later stage."""
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)).double()


def _stage(kind: str) -> nn.Module:
    if kind == "plain":  # W from the runtime's generic split
        return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH)).double()
    return nn.Sequential(DelayedLinear(WIDTH, 2 * WIDTH, params_dtype=torch.float64, delay_wgrad_compute=True), nn.Tanh(),
                         DelayedLinear(2 * WIDTH, WIDTH, params_dtype=torch.float64, delay_wgrad_compute=True))


@pytest.mark.parametrize("kind", ["plain", "delayed"])
def test_measured_b_w_and_w_memory_are_the_runtimes(monkeypatch, kind: str) -> None:
    torch.manual_seed(0)
    first, stage = _first(), _stage(kind)
    x = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    y = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    loss = nn.functional.mse_loss

    with monkeypatch.context() as patched:
        _counting_timer(patched)
        measured = measure_profile(layers=[("first", first), ("stage", stage)], example_input=x, loss_fn=loss,
                                   target=y, steps=1, warmup=0).layers

    sched = build("zb-v", num_ranks=1, num_microbatches=1)  # F0 F1 B1 W1 B0 W0 on one rank
    stages = {0: first, 1: stage}
    pipe = Pipeline(stages, sched, loss_fn=loss)
    with TaskFlops().installed() as flops, _RuntimeKept([x, y]).installed(monkeypatch, stages) as kept:
        pipe.step(x, y)

    for s in (0, 1):
        assert flops.flops[(s, "W")] > 0
        assert measured[s].w == pytest.approx(flops.flops[(s, "W")], rel=REL), (s, measured[s].w, flops.flops)
        # B: the input's gradient only, as the runtime's B computes it (none on the first stage)
        assert measured[s].b == pytest.approx(flops.flops[(s, "B")], rel=REL), (s, measured[s].b, flops.flops)
        assert measured[s].wgrad == kept.after_b[s], (s, measured[s].wgrad, kept.after_b)
    # by hand. The first stage keeps for W all its forward saved (its B computed nothing): GELU's
    # input and output (the second Linear's input); the batch is the caller's, not counted
    assert measured[0].wgrad == measured[0].activation == 2 * ROWS * 2 * WIDTH * F64
    # The second: each Linear's input (the weight GEMMs' operand: the split's marks keep it, or the
    # delayed module's store); tanh's saved output serves B, but the second Linear keeps the same
    # storage: counted once
    assert measured[1].wgrad == (ROWS * WIDTH + ROWS * 2 * WIDTH) * F64
