"""``Pipeline(cuda_graphs=True)``: captured and replayed steps give what one process gives.

Each test runs a one-rank zb-h1 pipeline of 2 microbatches for a few steps of one input signature
(step 0 eager, step 1 captures every task, later steps replay) and checks, step by step, against
one process on the same batch:

- each F draws its dropout masks under its own microbatch's seed, at capture and at replay;
- the per-microbatch losses handed to the caller (``losses=``) and the step's loss keep their
  values after later replays (no alias of a graph's static output);
- a ``main_grad`` replaced between steps, or a parameter moved to a new tensor, makes the next
  step capture again: the gradient lands in the new buffer, the step reads the new values (a
  replay would use the old addresses). A probe module that keeps its inputs tells a capture (new
  static input buffers) from a replay, on CPUs and GPUs alike.

On the CPU the graphs are the test runner `StandInGraphs` (each "replay" runs the task again
through the same static buffers); on CUDA (marked ``gpu``) they are
real CUDA graphs. Float64 throughout.

Tolerance against one process: float64 ``rtol=1e-10, atol=1e-12``: the pipeline adds the
microbatches' weight gradients in another order than one process's backward (~1e-15 relative);
a wrong dropout mask or an overwritten loss moves values by percents.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from zbpp import Pipeline
from zbpp.modules import Linear
from zbpp.runtime import PipelineError, microbatch_seed
from zbpp.runtime.task_graphs import StandInGraphs

from .test_task_graphs import _one_rank_stand_in

TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}
F64 = torch.float64
SEED = 2024
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def _schedule_and_batch(device: str, rows: int, outputs: int,
                        seed: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The one-rank zb-h1 schedule of 2 microbatches and the float64 batch (3 features) of
    `_one_rank_stand_in`, on `device`."""
    sched, x, y = _one_rank_stand_in(rows=rows, outputs=outputs, seed=seed)
    return sched, x.to(device), y.to(device)


def _graphs(device: str) -> Any:
    """The `cuda_graphs=` runner: real CUDA graphs on a GPU, the stand-in test runner on the CPU."""
    return True if device == "cuda" else StandInGraphs


def _per_microbatch(x: torch.Tensor, y: torch.Tensor, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(torch.tensor_split(x, m), torch.tensor_split(y, m)))


def _one_process_with_seeds(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, step: int, m: int,
                            backward: bool = True) -> torch.Tensor:
    """One process, microbatch by microbatch, each forward after
    ``torch.manual_seed(microbatch_seed(SEED, step, 0, j))`` (the rng module's recipe); with
    `backward`, backward of each microbatch's MSE times its share of the rows. Returns the
    microbatches' losses."""
    devices = [x.device.index] if x.device.type == "cuda" else []
    losses = []
    for j, (xj, yj) in enumerate(_per_microbatch(x, y, m)):
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(microbatch_seed(SEED, step, 0, j))
            loss = nn.functional.mse_loss(model(xj), yj)
        if backward:
            (loss * (xj.shape[0] / x.shape[0])).backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def _assert_grads_equal(got: nn.Module, want: nn.Module, what: str) -> None:
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda s: f"{what}: {name}: {s}", **TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_each_graphed_forward_draws_under_its_own_microbatch_seed(device: str) -> None:
    """Dropout 0.5: at capture (step 1) and at each replay (steps 3, 4) every microbatch's masks
    are the ones its own seed gives, as in the eager step 0 and in one process; the evaluation
    step between them (eager) counts as step 2 of the seeds."""
    sched, x, y = _schedule_and_batch(device, rows=8, outputs=2, seed=3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16, dtype=F64), nn.Dropout(0.5), nn.Tanh(),
                          nn.Linear(16, 2, dtype=F64)).to(device)
    ref = copy.deepcopy(model)
    pipe = Pipeline({0: model}, sched, loss_fn=nn.functional.mse_loss, device=device, seed=SEED,
                    cuda_graphs=_graphs(device))
    for step in range(5):  # eager, capture, evaluation, replay, replay
        if step == 2:
            with torch.no_grad():
                want = _one_process_with_seeds(ref, x, y, step=step, m=sched.num_microbatches, backward=False)
            torch.testing.assert_close(pipe.eval_step(x, y), want.mean(), msg=lambda s: f"evaluation: {s}", **TOL)
            continue
        model.zero_grad()
        ref.zero_grad()
        per_mb: list[torch.Tensor] = []
        loss = pipe.step(x, y, losses=per_mb)
        want = _one_process_with_seeds(ref, x, y, step=step, m=sched.num_microbatches)
        what = f"step {step}"
        torch.testing.assert_close(torch.stack(per_mb), want, msg=lambda s: f"{what} microbatch losses: {s}", **TOL)
        torch.testing.assert_close(loss, want.mean(), msg=lambda s: f"{what} loss: {s}", **TOL)  # equal halves
        _assert_grads_equal(model, ref, what)


@pytest.mark.parametrize("device", DEVICES)
def test_losses_handed_out_keep_their_values_after_later_replays(device: str) -> None:
    """Four steps on batches of one shape and other values: the losses of every step (the
    ``losses=`` list and the returned loss), read after the last step, are still that step's."""
    sched, x, y = _schedule_and_batch(device, rows=6, outputs=1, seed=4)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4, dtype=F64), nn.Tanh(), nn.Linear(4, 1, dtype=F64)).to(device)
    ref = copy.deepcopy(model)
    pipe = Pipeline({0: model}, sched, loss_fn=nn.functional.mse_loss, device=device, cuda_graphs=_graphs(device))
    handed, want = [], []
    for step in range(4):  # eager, capture, replay, replay: each replay rewrites the static outputs
        xs = x + step
        per_mb: list[torch.Tensor] = []
        loss = pipe.step(xs, y, losses=per_mb)
        handed.append((loss, per_mb))
        with torch.no_grad():
            want.append(torch.stack([nn.functional.mse_loss(ref(a), b) for a, b in _per_microbatch(xs, y, 2)]))
    for step, ((loss, per_mb), w) in enumerate(zip(handed, want)):
        torch.testing.assert_close(torch.stack(per_mb), w, msg=lambda s: f"step {step} microbatch losses: {s}", **TOL)
        torch.testing.assert_close(loss, w.mean(), msg=lambda s: f"step {step} loss: {s}", **TOL)  # equal halves


class _InputProbe(nn.Module):
    """The identity (times a buffer of ones), keeping every tensor it is called with: kept alive,
    no two of the buffers it saw share an address, so a capture (new static input buffers) shows
    as new addresses."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []
        self.register_buffer("one", torch.ones((), dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x)
        return x * self.one

    def buffers_seen(self) -> int:
        return len({t.untyped_storage().data_ptr() for t in self.seen})


class _ProbedRun:
    """A one-rank graphed pipeline over ``probe -> fc1 -> tanh -> fc2`` beside its one-process
    reference: fc1's weight accumulates into ``main_grad`` (``fuse_wgrad_accumulation``), the
    other parameters into ``.grad``."""

    def __init__(self, device: str) -> None:
        sched, self.x, self.y = _schedule_and_batch(device, rows=4, outputs=2, seed=5)
        torch.manual_seed(0)
        self.fc1 = Linear(3, 4, params_dtype=F64, device=device, fuse_wgrad_accumulation=True)
        self.fc2 = nn.Linear(4, 2, dtype=F64, device=device)
        self.probe = _InputProbe()
        self.model = nn.Sequential(self.probe, self.fc1, nn.Tanh(), self.fc2)
        self.ref = nn.Sequential(nn.Linear(3, 4, dtype=F64), nn.Tanh(), nn.Linear(4, 2, dtype=F64)).to(device)
        self.ref[0].load_state_dict(self.fc1.state_dict())
        self.ref[2].load_state_dict(self.fc2.state_dict())
        self.fc1.weight.main_grad = torch.zeros_like(self.fc1.weight)
        self.pipe = Pipeline({0: self.model}, sched, loss_fn=nn.functional.mse_loss, device=device,
                             cuda_graphs=_graphs(device))

    def step(self, what: str) -> int:
        """One step from zero gradients, its loss and gradients checked against one process;
        returns how many input buffers the stage read that it had not read before."""
        self.model.zero_grad()
        self.ref.zero_grad()
        self.fc1.weight.main_grad.zero_()
        before = self.probe.buffers_seen()
        loss = self.pipe.step(self.x, self.y)
        want = nn.functional.mse_loss(self.ref(self.x), self.y)
        want.backward()
        torch.testing.assert_close(loss, want.detach(), msg=lambda s: f"{what} loss: {s}", **TOL)
        torch.testing.assert_close(self.fc1.weight.main_grad, self.ref[0].weight.grad,
                                   msg=lambda s: f"{what} main_grad: {s}", **TOL)
        pairs = (("fc1.bias", self.fc1.bias, self.ref[0].bias), ("fc2.weight", self.fc2.weight, self.ref[2].weight),
                 ("fc2.bias", self.fc2.bias, self.ref[2].bias))
        for name, got, ref in pairs:
            torch.testing.assert_close(got.grad, ref.grad, msg=lambda s: f"{what} {name}.grad: {s}", **TOL)
        return self.probe.buffers_seen() - before

    def capture_and_replay(self) -> None:
        assert self.step("eager step") > 0
        assert self.step("capture") > 0, "the capture step read no new static input buffers"
        assert self.step("replay") == 0, "a replay read new input buffers: it was not a replay"


@pytest.mark.parametrize("device", DEVICES)
def test_replaced_main_grad_is_captured_again_and_receives_the_gradient(device: str) -> None:
    """After a capture and a replay the caller puts a new ``main_grad`` in place (the old one
    kept alive, so the new one has another address): the next step reads new static input
    buffers (it captured again), the gradient equals one process's in the new buffer, the old
    buffer is untouched; the step after replays that capture, again into the new buffer."""
    run = _ProbedRun(device)
    run.capture_and_replay()
    replaced = run.fc1.weight.main_grad
    kept = replaced.clone()
    run.fc1.weight.main_grad = torch.zeros_like(run.fc1.weight)
    assert run.step("step after main_grad was replaced") > 0, "a replaced main_grad did not make the step capture again"
    assert torch.equal(replaced, kept), "the step wrote into the replaced main_grad"
    assert run.step("replay after the new capture") == 0
    assert torch.equal(replaced, kept), "the replay wrote into the replaced main_grad"


@pytest.mark.parametrize("device", DEVICES)
def test_moved_parameter_is_captured_again_and_read_from_its_new_place(device: str) -> None:
    """After a capture and a replay fc2's weight moves to a new tensor of other values (the old
    one kept alive): the next step captures again and computes with the new values (a replay
    would read the old tensor); the step after replays that capture."""
    run = _ProbedRun(device)
    run.capture_and_replay()
    old = run.fc2.weight.data
    with torch.no_grad():
        run.fc2.weight.data = old * 0.5
        run.ref[2].weight.mul_(0.5)
    assert run.step("step after the weight moved") > 0, "a moved parameter did not make the step capture again"
    assert run.step("replay after the new capture") == 0


@pytest.mark.parametrize("device", DEVICES)
def test_reassigned_buffer_is_captured_again(device: str) -> None:
    """After a capture and a replay a module's buffer is reassigned, a new tensor of the same
    values with the old one kept alive (HF's dynamic RoPE reassigns ``inv_freq`` so): a replay
    would read the old tensor, so the next step captures again; the step after replays that."""
    run = _ProbedRun(device)
    run.capture_and_replay()
    old = run.probe.one
    run.probe.one = old.clone()  # a registered buffer's name: nn.Module reassigns the buffer
    assert run.step("step after the buffer was reassigned") > 0, "a reassigned buffer did not make the step capture again"
    assert run.step("replay after the new capture") == 0


def test_gradients_are_attached_after_the_first_forward_of_a_step_after_zero_grad() -> None:
    """Task graphs point ``.grad`` at the fixed buffers after the step's first F (no F reads a
    gradient; an idle GPU starts on it sooner) when ``zero_grad()`` cleared them, before it when a
    step accumulates onto earlier gradients. Seen by a forward pre-hook (CPU stand-in graphs run
    every F's Python at replay too), with every step's gradients equal to one process's."""
    sched, x, y = _schedule_and_batch("cpu", rows=4, outputs=2, seed=6)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4, dtype=F64), nn.Tanh(), nn.Linear(4, 2, dtype=F64))
    ref = copy.deepcopy(model)
    seen: list[torch.Tensor | None] = []  # fc2.weight.grad at each F
    model.register_forward_pre_hook(lambda mod, args: seen.append(mod[2].weight.grad))
    pipe = Pipeline({0: model}, sched, loss_fn=nn.functional.mse_loss, cuda_graphs=StandInGraphs)
    for step, zero in enumerate((True, True, True, False, True)):  # eager, capture, replay, accumulate, replay
        if zero:
            model.zero_grad()
            ref.zero_grad()
        seen.clear()
        pipe.step(x, y)
        _one_process_with_seeds(ref, x, y, step=step, m=2)
        _assert_grads_equal(model, ref, f"step {step}")
        buffer = model[2].weight.grad
        if step == 0:  # no buffer yet: made and attached before the first F
            assert seen == [buffer, buffer]
        elif zero:
            assert seen[0] is None and seen[1] is buffer, f"step {step}: .grad at each F: {seen}"
        else:  # earlier gradients kept: attached (where they are) before any task
            assert seen == [buffer, buffer]


class _MeanScaled(nn.Module):
    """``x * mean(s)`` for a parameter ``s`` of 6 elements: its shape can change in place (a view
    of the same storage) without changing what the module computes."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, 6, dtype=F64).reshape(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s.mean()


@pytest.mark.parametrize("device", DEVICES)
def test_parameter_reshaped_in_place_fails_one_step_then_is_captured_again(device: str) -> None:
    """A parameter viewed in another shape over the same storage no longer fits its fixed
    ``.grad`` buffer, which the step finds only after its first F replayed: that step fails with
    an error that says so, rolled back (the gradients stay None); the next one makes new buffers,
    captures again and gives one process's gradients."""
    sched, x, y = _schedule_and_batch(device, rows=4, outputs=2, seed=7)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4, dtype=F64), _MeanScaled(), nn.Linear(4, 2, dtype=F64)).to(device)
    ref = copy.deepcopy(model)
    pipe = Pipeline({0: model}, sched, loss_fn=nn.functional.mse_loss, device=device, cuda_graphs=_graphs(device))
    for step in range(3):  # eager, capture, replay
        model.zero_grad()
        pipe.step(x, y)
    scale = model[1].s
    with torch.no_grad():
        scale.data = scale.data.view(3, 2)
    model.zero_grad()
    with pytest.raises(PipelineError, match="shape, dtype or device changed while its storage stayed"):
        pipe.step(x, y)
    assert all(p.grad is None for p in model.parameters()), "the failed step left gradients behind"
    for step in range(2):  # captures again, then replays
        model.zero_grad()
        ref.zero_grad()
        pipe.step(x, y)
        nn.functional.mse_loss(ref(x), y).backward()
        assert scale.grad.shape == (3, 2)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.reshape(q.shape), q.grad, msg=lambda s: f"{name}: {s}", **TOL)


def _scaled_mse(out: torch.Tensor, target: dict[str, Any]) -> torch.Tensor:
    """The microbatch's MSE times the target's ``scale``, a Python float (a loss's coefficient
    handed over with the labels)."""
    return nn.functional.mse_loss(out, target["y"]) * target["scale"]


def test_target_non_tensor_value_that_changes_makes_the_step_capture_again() -> None:
    """The target's non-tensor values are part of the input signature, as the input's are: a
    ``scale`` that changes after the capture (same shapes) gives the new step one process's loss
    and gradients on the whole batch (a replay would use the captured value): its first step is eager,
    the next captures again."""
    sched, x, y = _schedule_and_batch("cpu", rows=4, outputs=2, seed=8)
    torch.manual_seed(0)
    probe = _InputProbe()
    model = nn.Sequential(probe, nn.Linear(3, 4, dtype=F64), nn.Tanh(), nn.Linear(4, 2, dtype=F64))
    ref = copy.deepcopy(model)
    pipe = Pipeline({0: model}, sched, loss_fn=_scaled_mse, cuda_graphs=StandInGraphs)
    # eager, capture, replay; the new value: eager (a new signature), capture, replay
    for step, scale in enumerate((1.0, 1.0, 1.0, 3.0, 3.0, 3.0)):
        model.zero_grad()
        ref.zero_grad()
        before = probe.buffers_seen()
        loss = pipe.step(x, {"y": y, "scale": scale})
        read_new = probe.buffers_seen() - before
        want = _scaled_mse(ref(x), {"y": y, "scale": scale})  # the whole batch: equal halves
        want.backward()
        what = f"step {step} (scale={scale})"
        torch.testing.assert_close(loss, want.detach(), msg=lambda s: f"{what} loss: {s}", **TOL)
        _assert_grads_equal(model, ref, what)
        # a capture's static inputs are new buffers; an eager step reads views of x (seen on step 0)
        assert (read_new > 0) == (step in (0, 1, 4)), f"{what}: new input buffers read: {read_new}"


def test_autocast_turned_off_after_the_capture_gives_eager_float32_steps() -> None:
    """Two stages on one rank (zb-v), their hand-over a static output of the first one's F: steps
    under ``torch.autocast`` (bfloat16) capture the tasks, and later steps without it must not
    replay those (bfloat16 kernels, a bfloat16 hand-over): autocast is part of the signature, so
    they run as float32 steps of their own, equal to one process's on the whole batch. Float32:
    ``rtol=1e-5, atol=1e-6`` covers the microbatches' other summation order (~1e-7 relative); a
    bfloat16 rounding moves values by ~4e-3 relative."""
    import contextlib

    from zbpp.schedules import build

    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)]
    ref = copy.deepcopy(stages)
    pipe = Pipeline(dict(enumerate(stages)), build("zb-v", num_ranks=1, num_microbatches=2),
                    loss_fn=nn.functional.mse_loss, cuda_graphs=StandInGraphs)
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    for step, amp in enumerate((True, True, True, False, False, False)):  # each: eager, capture, replay
        for m in (*stages, *ref):
            m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext():
            loss = pipe.step(x, y)
        if amp:
            continue
        want = nn.functional.mse_loss(ref[1](ref[0](x)), y)
        want.backward()
        what = f"step {step} (autocast off)"
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6, msg=lambda s: f"{what} loss: {s}")
        for s, (mine, theirs) in enumerate(zip(stages, ref)):
            for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{what} stage {s} {name}: {m}")
