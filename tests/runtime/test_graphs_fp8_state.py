"""Task graphs and FP8 state that changes between steps (one H100/H200; CUDA graphs need a GPU).

A replay runs no Python: what a capture baked in must still be what the step asks for.
- ``fp8_autocast`` around ``pipe.step`` is part of the step's signature, as ``torch.autocast``
  is: steps outside it after captured FP8 steps run in bf16 (reference: the same steps eagerly).
- `load_checkpoint` into a pipeline whose FP8 tasks are captured writes the saved scaling state
  into the slots the graphs read (reference: the uninterrupted run's next step, eagerly).

Both compare bit for bit: the graphed and the eager runs issue the same kernels on the same data
(`test_task_graphs.test_graphs_bit_identical_to_eager` is the general case).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from zbpp import Pipeline
from zbpp.modules import DelayedScaling, fp8_autocast
from zbpp.runtime import load_checkpoint, save_checkpoint
from zbpp.schedules import build

from .graph_cases import M, Stage, _batch, make_blocks, replay_counter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
RECIPE = DelayedScaling(amax_history_len=4)
CUDA = torch.device("cuda")


def _pipeline(graphs: bool, fp8_stage: bool) -> tuple[Pipeline, torch.optim.Optimizer]:
    stage = Stage(make_blocks(2, torch.bfloat16, CUDA, main_grad=False), fp8_stage)
    pipe = Pipeline({0: stage}, build("zb-h1", num_ranks=1, num_microbatches=M), nn.functional.mse_loss,
                    device=CUDA, cuda_graphs=graphs)
    return pipe, torch.optim.SGD(list(pipe.parameters()), lr=0.05)


def _step(pipe: Pipeline, opt: torch.optim.Optimizer, step: int, *, fp8: bool = False, scale: float = 1.0) -> torch.Tensor:
    x, y = _batch(2 * step, torch.bfloat16, CUDA)  # even steps of graph_cases: one row count, one signature
    opt.zero_grad()
    with fp8_autocast(enabled=fp8, fp8_recipe=RECIPE):
        loss = pipe.step(x * scale, y)
    opt.step()
    return loss.detach().clone()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_fp8_autocast_around_the_step_is_part_of_the_signature(graphs: bool) -> None:
    """Steps 0-1 inside fp8_autocast (captured on step 1), steps 2-4 outside: equal to eager."""
    ref_pipe, ref_opt = _pipeline(False, fp8_stage=False)
    pipe, opt = _pipeline(graphs, fp8_stage=False)
    for step in range(5):
        want = _step(ref_pipe, ref_opt, step, fp8=step < 2)
        got = _step(pipe, opt, step, fp8=step < 2)
        assert torch.equal(got, want), f"step {step}: loss {got.item()} vs eager {want.item()}"
    for (name, p), q in zip(ref_pipe.stage_modules[0].named_parameters(), pipe.parameters()):
        assert torch.equal(q, p), name


def test_load_checkpoint_into_captured_fp8_tasks(tmp_path: Path) -> None:
    """A: 3 steps (eager, capture, replay), saved, a 4th step. B: 3 steps of 10x larger inputs
    (other scaling state, captured), loads A's checkpoint: its next (replayed) step equals A's 4th."""
    a, a_opt = _pipeline(True, fp8_stage=True)
    for step in range(3):
        _step(a, a_opt, step)
    save_checkpoint(a, tmp_path / "ckpt", a_opt)
    want = _step(a, a_opt, 3)
    b, b_opt = _pipeline(True, fp8_stage=True)
    replays = replay_counter(b)
    for step in range(3):
        _step(b, b_opt, step, scale=10.0)
    load_checkpoint(b, tmp_path / "ckpt", b_opt)
    got = _step(b, b_opt, 3)
    assert sum(replays.values()) == 2  # steps 2 and 3 replayed (the load changed no signature)
    assert torch.equal(got, want), f"loss {got.item()} vs uninterrupted {want.item()}"
    for (name, p), q in zip(a.stage_modules[0].named_parameters(), b.parameters()):
        assert torch.equal(q, p), name
