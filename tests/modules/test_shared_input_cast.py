"""`Linear`s that read the same tensor share one FP8 input cast (`zbpp.modules._shared_input`).

Reference: the same layers with sharing turned off (``adopted_slot`` patched to adopt nothing),
each casting the input with its own slot. A fresh slot adopted at the first forward holds what
each separate slot would have held, so every output, input gradient and weight gradient must be
bit-identical (rtol=atol=0), over several microbatches (each cast uses the amaxes of the earlier
ones), while the shared layers cast their input once per microbatch instead of once each.

CPU: the eager cast path and dequantised float32 GEMMs; the Triton path is the same arithmetic
(`test_fp8_cast.py` checks it bit for bit on a GPU).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zbpp.modules import DelayedScaling, Linear, fp8_autocast
from zbpp.modules import linear as linear_module
from zbpp.modules._shared_input import forget_last_cast
from zbpp.modules.fp8 import cast_path_counts, reset_cast_path_counts

RECIPE = DelayedScaling(amax_history_len=4)
WIDTH, ROWS, MICROBATCHES = 32, 48, 3


class Siblings(nn.Module):
    """q, k and v on one tensor and `other` on another, as in attention; `bump` writes the input
    in place between k and v (v then reads other values)."""

    def __init__(self, bump: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v, self.other = (Linear(WIDTH, WIDTH, delay_wgrad_compute=True) for _ in range(4))
        self.bump = bump

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x * 1.0  # a tensor of the graph, as a norm's output is
        out = self.q(h) + self.k(h.view(2, ROWS // 2, WIDTH)).reshape(ROWS, WIDTH)
        if self.bump:
            with torch.no_grad():
                h.mul_(2.0)
        return out + self.v(h) + self.other(y)


class _Caller(nn.Module):
    """Calls the given layers from its forward, as an attention calls its q, k and v (only
    `Linear`s of one model call share a cast)."""

    def forward(self, *calls: tuple[nn.Module, torch.Tensor]) -> list[torch.Tensor]:
        return [layer(x) for layer, x in calls]


def _run(model: Siblings, xs, ys, shared: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    with monkeypatch.context() as patch:
        if not shared:
            patch.setattr(linear_module, "adopted_slot", lambda *args: None)
        reset_cast_path_counts()
        outs = []
        for j, (x, y) in enumerate(zip(xs, ys)):
            with fp8_autocast(fp8_recipe=RECIPE):
                out = model(x, y)
            out.square().sum().backward()
            for layer in (model.q, model.k, model.v, model.other):
                layer.backward_dw()
            outs += [out.detach(), x.grad.clone(), y.grad.clone()]
        forget_last_cast()
        return outs, cast_path_counts()["eager"]


def _inputs():
    gen = torch.Generator().manual_seed(4)
    return ([torch.randn(ROWS, WIDTH, generator=gen).mul_(2.0 ** j).requires_grad_() for j in range(MICROBATCHES)],
            [torch.randn(ROWS, WIDTH, generator=gen).requires_grad_() for _ in range(MICROBATCHES)])


@pytest.mark.parametrize("bump", [False, True], ids=["same", "written between"])
def test_shared_input_cast_is_bit_identical_to_separate_casts(bump, monkeypatch):
    torch.manual_seed(0)
    model = Siblings(bump)
    separate = copy.deepcopy(model)
    outs, casts = _run(model, *_inputs(), shared=True, monkeypatch=monkeypatch)
    ref, ref_casts = _run(separate, *_inputs(), shared=False, monkeypatch=monkeypatch)
    for i, (a, b) in enumerate(zip(outs, ref)):
        assert torch.equal(a, b), i
    for (name, p), p_ref in zip(model.named_parameters(), separate.parameters()):
        assert torch.equal(p.grad, p_ref.grad), name
    slots = [model.q, model.k, model.v, model.other]
    input_slots = [m.fp8_meta["input"] for m in slots]
    assert input_slots[0] is input_slots[1]  # k's view of the same tensor shares q's cast
    assert input_slots[3] is not input_slots[0]
    # weights and output gradients: 4 casts each per microbatch; inputs 2 shared (q and k; v too
    # unless the tensor was written in between), against 4 separate
    saved = (1 if bump else 2) * MICROBATCHES
    assert (input_slots[2] is input_slots[0]) != bump
    assert ref_casts == 12 * MICROBATCHES and casts == ref_casts - saved


def test_a_slot_that_already_cast_adopts_nothing(monkeypatch):
    a, b, parent = Linear(WIDTH, WIDTH), Linear(WIDTH, WIDTH), _Caller()
    x = torch.randn(ROWS, WIDTH)
    with fp8_autocast(fp8_recipe=RECIPE):
        parent((b, torch.randn(ROWS, WIDTH)))  # b's slot has a history of its own now
        parent((a, x), (b, x))
    assert a.fp8_meta["input"] is not b.fp8_meta["input"]
    with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=8)):
        c, d = Linear(WIDTH, WIDTH), Linear(WIDTH, WIDTH)
        parent((c, x))
    with fp8_autocast(fp8_recipe=RECIPE):  # another recipe than the last cast's
        parent((d, x))
    assert c.fp8_meta["input"] is not d.fp8_meta["input"]
    forget_last_cast()


def test_a_linear_that_reads_the_same_tensor_again_casts_again(monkeypatch):
    """q, k, then q again on one tensor: k takes q's cast, q's second call casts (stepping the
    shared slot, as q's own would step): the outputs equal separate slots'."""
    torch.manual_seed(1)
    q, k = Linear(WIDTH, WIDTH), Linear(WIDTH, WIDTH)
    q_ref, k_ref = copy.deepcopy(q), copy.deepcopy(k)
    x, parent = torch.randn(ROWS, WIDTH), _Caller()
    with monkeypatch.context() as patch:
        with fp8_autocast(fp8_recipe=RECIPE):
            outs = parent((q, x), (k, x), (q, x))
        forget_last_cast()
        patch.setattr(linear_module, "adopted_slot", lambda *args: None)
        with fp8_autocast(fp8_recipe=RECIPE):
            refs = parent((q_ref, x), (k_ref, x), (q_ref, x))
    assert k.fp8_meta["input"] is q.fp8_meta["input"] and q.fp8_meta["input"].casts == 2
    for a, b in zip(outs, refs):
        assert torch.equal(a, b)
    assert not torch.equal(outs[0], outs[2])  # the second cast used the stepped scale


class _Heads(nn.Module):
    """Two heads on the model's input, as q and k on a norm's output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Linear(WIDTH, WIDTH), Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def test_another_model_reading_the_same_tensor_keeps_its_own_slot():
    """A student, then its teacher (a copy) on the same batch: the teacher's fresh `a` must not
    adopt the student's slot, or the student's steps the teacher skips (here on a batch 8 times
    larger) would move the teacher's scales. Reference: the teacher run alone on its own batches;
    bit for bit (the same CPU operations on the same values), outputs and FP8 state."""
    from zbpp.modules._scaling_state import scaling_states

    torch.manual_seed(2)
    student = _Heads()
    teacher, alone = copy.deepcopy(student), copy.deepcopy(student)
    gen = torch.Generator().manual_seed(5)
    x, x2, x3 = (torch.randn(ROWS, WIDTH, generator=gen).mul_(s) for s in (1.0, 8.0, 1.0))
    with fp8_autocast(fp8_recipe=RECIPE):
        student(x)
        outs = [teacher(x)]
        student(x2)  # a step the teacher skips
        outs.append(teacher(x3))
    forget_last_cast()
    with fp8_autocast(fp8_recipe=RECIPE):
        refs = [alone(x), alone(x3)]
    forget_last_cast()
    assert teacher.a.fp8_meta["input"] is not student.a.fp8_meta["input"]
    assert teacher.b.fp8_meta["input"] is teacher.a.fp8_meta["input"]  # its own heads still share
    for out, ref in zip(outs, refs):
        assert torch.equal(out, ref)
    state, ref_state = scaling_states(teacher), scaling_states(alone)
    assert state.keys() == ref_state.keys()
    for key, entry in state.items():
        assert entry.keys() == ref_state[key].keys(), key  # no "same_as" naming another model's slot
        for field, value in entry.items():
            ref = ref_state[key][field]
            assert value == ref if isinstance(value, str) else torch.equal(value, ref), (key, field)
