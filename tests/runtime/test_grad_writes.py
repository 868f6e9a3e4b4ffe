"""Task graphs let a step's first W write a fixed ``.grad`` buffer instead of adding to zeros.

Checked on CPUs with the stand-in graphs (each replay runs the bodies again through the same fixed
buffers), in float64, against the same steps run eagerly: which buffers W writes (a delayed layer's
GEMM weights and biases; not a norm's, nor a parameter autograd accumulates into first), that those
are not zeroed before a replay, and that earlier gradients survive the write (steps without
``zero_grad()``, ``no_sync()``, a failed step, ``keep_grads_on_failure`` either way).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from zbpp import Pipeline
from zbpp.modules import LayerNormMLP
from zbpp.runtime import PipelineError, task_graphs
from zbpp.runtime.task_graphs import StandInGraphs, TaskGraphs
from zbpp.schedules import build

D = 4
M = 3  # zb-h1 on one rank runs F, B, W per microbatch: W0 writes before microbatch 1 starts


class _Stage(nn.Module):
    """A delayed-wgrad MLP then a plain Linear; with `tie` the stage also reads the MLP's fc1 weight
    in plain ops (autograd accumulates that share in B, before the MLP's W)."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = LayerNormMLP(D, 2 * D, delay_wgrad_compute=True, params_dtype=torch.float64)
        self.out = nn.Linear(D, D, dtype=torch.float64)
        self.tie = tie

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp(x)
        if self.tie:  # fc1's weight is [2D, D]
            h = h + nn.functional.linear(h, self.mlp.fc1_weight)[:, :D]
        return self.out(h)


def _pipeline(graphs: bool, tie: bool = False, keep: bool = True, fail: list[bool] | None = None) -> Pipeline:
    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if fail is not None and fail[0] and len(calls) % M == 0:  # the step's last microbatch: after W0
            raise RuntimeError("the last microbatch fails")
        return nn.functional.mse_loss(out, target)

    calls: list[int] = []
    return Pipeline({0: _Stage(tie)}, build("zb-h1", num_ranks=1, num_microbatches=M), loss_fn=loss_fn,
                    cuda_graphs=StandInGraphs if graphs else False, keep_grads_on_failure=keep)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, D, dtype=torch.float64, generator=g), torch.randn(6, D, dtype=torch.float64, generator=g)


def _graphs(pipe: Pipeline) -> TaskGraphs:
    cache = pipe._graph_cache
    assert cache is not None and len(cache.graphs) == 1
    return next(iter(cache.graphs.values()))


def _grads(pipe: Pipeline) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in pipe.stage_modules[0].named_parameters()}


def _fresh_steps_equal(eager: Pipeline, graphed: Pipeline, steps: range, after_step=None) -> None:
    """Steps after zero_grad() on both: the graphed gradients equal eager's bit for bit."""
    for step in steps:
        for pipe in (eager, graphed):
            pipe.stage_modules[0].zero_grad(set_to_none=True)
            pipe.step(*_batch(step))
        mine, theirs = _grads(graphed), _grads(eager)
        assert all(torch.equal(mine[n], theirs[n]) for n in theirs), f"step {step}: gradients differ"
        if after_step is not None:
            after_step(step)


def test_w_writes_the_buffers_of_the_gradients_it_computes(monkeypatch) -> None:
    """After the capture the graphs know W writes the MLP's GEMM weights and biases; a replay zeroes
    only the other buffers (the norm's, the plain Linear's), and every step's gradients equal the
    eager step's bit for bit (the first W's GEMM writes what eager assigns)."""
    eager, graphed = _pipeline(False), _pipeline(True)
    zeroed: list[torch.Tensor] = []
    real_zero = task_graphs.foreach_zero_
    monkeypatch.setattr(task_graphs, "foreach_zero_", lambda ts: zeroed.extend(ts) or real_zero(ts))
    stage = graphed.stage_modules[0]
    written = {id(getattr(stage.mlp, n)) for n in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")}

    def after(step: int) -> None:
        if step == 1:  # the capture
            assert _graphs(graphed).grad_writes == {pid: 0 for pid in written}
            zeroed.clear()

    _fresh_steps_equal(eager, graphed, range(4), after)
    buffers = {id(t) for t in zeroed}
    for name, p in stage.named_parameters():
        assert (id(p.grad) in buffers) == (id(p) not in written), f"{name}: zeroed before a replay is wrong"


def test_a_parameter_autograd_accumulates_first_is_added_to() -> None:
    """fc1's weight, also read by plain ops (autograd adds their share in B, before W): W adds its
    share, never overwrites it."""
    eager, graphed = _pipeline(False, tie=True), _pipeline(True, tie=True)
    _fresh_steps_equal(eager, graphed, range(4))
    assert id(graphed.stage_modules[0].mlp.fc1_weight) not in _graphs(graphed).grad_writes
    assert id(graphed.stage_modules[0].mlp.fc2_weight) in _graphs(graphed).grad_writes


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "nokeep"])
@pytest.mark.parametrize("no_sync", [False, True], ids=["", "no_sync"])
def test_earlier_gradients_survive_a_writing_w(keep: bool, no_sync: bool) -> None:
    """Steps without zero_grad() (some inside no_sync(), one after .grad was replaced): the graphs'
    gradients equal eager's. Tolerance 1e-12 relative (float64): eager adds the step's gradient to
    the earlier one, or accumulates into it in place, the graphs add the earlier one back after W,
    the same sums in another order."""
    results: dict[bool, Any] = {}
    for graphs in (False, True):
        pipe = _pipeline(graphs, keep=keep)
        for step in range(5):
            if no_sync and step in (2, 3):
                with pipe.no_sync():
                    pipe.step(*_batch(step))
            else:
                pipe.step(*_batch(step))
            if step == 3:
                mlp = pipe.stage_modules[0].mlp
                mlp.fc2_weight.grad = mlp.fc2_weight.grad * 2  # a new tensor: copied into the buffer
        results[graphs] = _grads(pipe)
    assert _graphs(pipe).grad_writes, "the graphs write no buffer: nothing was tested"
    for name, want in results[False].items():
        torch.testing.assert_close(results[True][name], want, rtol=1e-12, atol=0, msg=name)


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "nokeep"])
def test_a_step_failing_after_a_write_restores_the_earlier_gradients(keep: bool) -> None:
    """A replayed step fails after W0 and W1 wrote their buffers: with keep_grads_on_failure the
    earlier gradients come back bit for bit, without it every gradient is cleared (zeros or None);
    the next step then equals eager's again."""
    fail = [False]
    pipe = _pipeline(True, keep=keep, fail=fail)
    for step in range(3):  # eager, capture, replay; no zero_grad: gradients accumulate
        pipe.step(*_batch(step))
    assert _graphs(pipe).grad_writes
    before = _grads(pipe)
    fail[0] = True
    with pytest.raises(PipelineError, match="the last microbatch fails"):
        pipe.step(*_batch(3))
    fail[0] = False
    after = _grads(pipe)
    for name, want in before.items():
        got = after[name]
        if keep:
            assert torch.equal(got, want), f"{name}: the earlier gradient was not restored"
        else:
            assert got is None or not got.any(), f"{name}: not cleared"
    pipe.stage_modules[0].zero_grad(set_to_none=True)
    pipe.step(*_batch(4))
    eager = _pipeline(False)
    eager.step(*_batch(4))
    mine, theirs = _grads(pipe), _grads(eager)
    # the same weights (SGD never ran) and batch: the replay's gradients are eager's, bit for bit
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs)


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "nokeep"])
def test_an_accumulating_replay_copies_each_written_gradient_once(monkeypatch, keep: bool) -> None:
    """A replayed step without zero_grad(): each buffer its W writes is copied once, for the
    add-back, and that copy is the one keep_grads_on_failure keeps for a rollback where it keeps one."""
    pipe = _pipeline(True, keep=keep)
    for step in range(3):  # eager, capture, replay
        pipe.step(*_batch(step))
    writes = _graphs(pipe).grad_writes
    buffers = {id(p.grad): name for name, p in pipe.stage_modules[0].named_parameters() if id(p) in writes}
    copied: list[str] = []
    real_clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone",
                        lambda t, *a, **k: copied.append(buffers.get(id(t), "")) or real_clone(t, *a, **k))
    pipe.step(*_batch(3))
    monkeypatch.undo()
    assert sorted(c for c in copied if c) == sorted(buffers.values())
