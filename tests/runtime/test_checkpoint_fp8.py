"""FP8 delayed-scaling state through `save_checkpoint` / `load_checkpoint`.

Reference: the uninterrupted run in the same process. A model of zbpp layers trains two FP8 steps
(AdamW), is saved, and a freshly built copy loads the checkpoint; the next step of both must be
bit-identical (same ops, same inputs, same process: any difference is state that did not come
back). Without the scaling state the copy's first cast uses scale 1 and a fresh history, which
changes the quantized GEMMs and so every parameter after the step. A slot shared by two `Linear`s
that read one input (q and k) is shared again after loading.

The two-rank test: two data-parallel replicas (gloo) see different inputs, so their input slots
differ; each must get its own back (reference: the rank's own slots before saving).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from zbpp.modules import DelayedScaling, LayerNormMLP, Linear, fp8_autocast
from zbpp.runtime import load_checkpoint, save_checkpoint

RECIPE = DelayedScaling(amax_history_len=4)
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = Linear(32, 32)
        self.k = Linear(32, 32)
        self.mlp = LayerNormMLP(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.q(x) * self.k(x))


def _net(seed: int, device: str = "cpu") -> Net:
    torch.manual_seed(seed)
    return Net().to(device)


def _step(net: Net, opt: torch.optim.Optimizer, step: int, scale: float = 1.0) -> torch.Tensor:
    device = next(net.parameters()).device
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 + step)).to(device) * (4.0 ** step) * scale
    opt.zero_grad()
    with fp8_autocast(enabled=True, fp8_recipe=RECIPE):
        loss = net(x).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


def _slots(net: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {f"{name}.{slot}": (meta.amax_history.clone(), meta.scale.clone())
            for name, m in net.named_modules() if hasattr(m, "fp8_meta") for slot, meta in m.fp8_meta.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_resume_casts_with_the_saved_scales(tmp_path: Path, device: str) -> None:
    """On CUDA: the scaled_mm GEMMs and Triton casts, slots restored onto the GPU."""
    net = _net(0, device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(2):
        _step(net, opt, step)
    assert net.q.fp8_meta["input"] is net.k.fp8_meta["input"]  # the setup shares q and k's input slot
    save_checkpoint(net, tmp_path / "ckpt", opt)
    saved = _slots(net)

    copy = _net(1, device)
    copy_opt = torch.optim.AdamW(copy.parameters(), lr=1e-2)
    _step(copy, copy_opt, 5, scale=100.0)  # slots of another run, which loading must replace
    load_checkpoint(copy, tmp_path / "ckpt", copy_opt)
    loaded = _slots(copy)
    assert loaded.keys() == saved.keys()
    for key, (history, scale) in saved.items():
        assert loaded[key][0].device == history.device
        assert torch.equal(loaded[key][0], history) and torch.equal(loaded[key][1], scale), key
    assert copy.q.fp8_meta["input"] is copy.k.fp8_meta["input"]

    want, got = _step(net, opt, 2), _step(copy, copy_opt, 2)
    assert torch.equal(got, want)
    for (name, p), (_, q) in zip(net.named_parameters(), copy.named_parameters()):
        assert torch.equal(q, p), name


def test_a_checkpoint_without_fp8_state_leaves_the_layers_fresh(tmp_path: Path) -> None:
    """Saved before any FP8 step: the loaded model's next step equals a never-run copy's, even when
    the model loading it had FP8 state of its own."""
    net = _net(0)
    save_checkpoint(net, tmp_path / "ckpt")
    used = _net(1)
    _step(used, torch.optim.SGD(used.parameters(), lr=0.0), 0, scale=50.0)
    load_checkpoint(used, tmp_path / "ckpt")
    assert _slots(used) == {}
    fresh = _net(0)
    want = _step(fresh, torch.optim.SGD(fresh.parameters(), lr=1e-2), 0)
    assert torch.equal(_step(used, torch.optim.SGD(used.parameters(), lr=1e-2), 0), want)


def test_a_saved_format_that_is_not_fp8_is_refused(tmp_path: Path) -> None:
    from zbpp.modules._scaling_state import restore_scaling_states, scaling_states

    net = _net(0)
    _step(net, torch.optim.SGD(net.parameters(), lr=0.0), 0)
    states = scaling_states(net)
    states["q.weight"] = dict(states["q.weight"], format="float32")
    with pytest.raises(ValueError, match="FP8 slot 'q.weight': saved format 'float32' is not an FP8 dtype"):
        restore_scaling_states(_net(0), states)



@pytest.mark.parametrize("damage, words", [
    ("format", r"FP8 slot 'mlp\.fc2_weight': saved format 'float32' is not an FP8 dtype"),
    ("scale", r"FP8 slot 'mlp\.fc2_weight': saved scale holds 2 values, not one"),
    ("casts", r"FP8 slot 'mlp\.fc2_weight': saved without 'casts'"),
])
def test_a_damaged_fp8_entry_is_refused_before_anything_loads(tmp_path: Path, damage: str, words: str) -> None:
    """A checkpoint whose FP8 entry of ``mlp.fc2_weight`` is foreign (format float32), of another shape
    (scale of 2 values) or lacks a field (casts): the slots were checked after the model had been
    loaded, so the load raised (or, for the scale and casts, a RuntimeError / KeyError that named
    no entry) with the weights the checkpoint's and the optimizer and FP8 slots the old ones. Now
    it raises before anything is applied, naming the entry, and the model, the optimizer and the
    FP8 slots are as before (``torch.equal``: nothing may have been written)."""
    import torch.distributed.checkpoint as dcp

    from zbpp.runtime import checkpoint

    net = _net(0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    _step(net, opt, 0)
    state = checkpoint._state_to_save(net, opt, None)
    entry = state["fp8"]["replica0"]["mlp.fc2_weight"]
    if damage == "format":
        entry["format"] = "float32"
    elif damage == "scale":
        entry["scale"] = torch.ones(2)
    else:
        del entry["casts"]
    with checkpoint._one_process_quiet(alone=True):
        dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)

    fresh = _net(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    _step(fresh, fresh_opt, 5, scale=100.0)  # a live run: its weights, moments and slots differ from the saved
    model_before = {k: v.clone() for k, v in fresh.state_dict().items()}
    opt_before = {(p, k): v.clone() for p, s in fresh_opt.state.items() for k, v in s.items()}
    slots_before = _slots(fresh)
    with pytest.raises(ValueError, match=rf"the checkpoint .*, under 'fp8\.replica0': {words}; nothing was loaded"):
        load_checkpoint(fresh, tmp_path / "ckpt", fresh_opt)
    assert [k for k, v in fresh.state_dict().items() if not torch.equal(v, model_before[k])] == []
    assert {(p, k): v for p, s in fresh_opt.state.items() for k, v in s.items()}.keys() == opt_before.keys()
    assert all(torch.equal(fresh_opt.state[p][k], v) for (p, k), v in opt_before.items())
    assert fresh_opt.param_groups[0]["lr"] == 1.0
    slots = _slots(fresh)
    assert slots.keys() == slots_before.keys()
    assert all(torch.equal(a, b) for k in slots for a, b in zip(slots[k], slots_before[k]))

@pytest.mark.parametrize("damage", ["first holder missing", "same_as renamed"])
def test_a_shared_slot_naming_a_missing_one_is_refused(tmp_path: Path, damage: str) -> None:
    """q and k share their input slot; the checkpoint keeps it under ``q.input`` and ``k.input``
    with ``same_as: 'q.input'``. Where the slot it names is not there (its entry lost, or
    ``same_as`` naming another key), ``k.input`` loaded as a slot of its own and q's input slot
    stayed fresh (or took its own entry), unlike the saved run (reference: its slots, shared). Now
    the load raises, naming both entries, and the slots are as before (nothing loaded)."""
    import torch.distributed.checkpoint as dcp

    from zbpp.runtime import checkpoint

    net = _net(0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    _step(net, opt, 0)
    assert net.q.fp8_meta["input"] is net.k.fp8_meta["input"]  # the saved run shares them
    state = checkpoint._state_to_save(net, opt, None)
    slots = state["fp8"]["replica0"]
    assert slots["k.input"]["same_as"] == "q.input"  # the setup
    if damage == "first holder missing":
        del slots["q.input"]
        target = "q.input"
    else:
        slots["k.input"]["same_as"] = target = "q.inputs"
    with checkpoint._one_process_quiet(alone=True):
        dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)

    fresh = _net(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    _step(fresh, fresh_opt, 5, scale=100.0)
    before = _slots(fresh)
    words = f"FP8 slot 'k.input': saved as sharing the slot {target!r}, which is not saved for these layers"
    with pytest.raises(ValueError, match=rf"under 'fp8\.replica0': {re.escape(words)}"):
        load_checkpoint(fresh, tmp_path / "ckpt", fresh_opt)
    after = _slots(fresh)
    assert after.keys() == before.keys()
    assert all(torch.equal(a, b) for k in after for a, b in zip(after[k], before[k]))


class _Fp8Stage(nn.Module):
    """A one-stage pipeline's stage: `Net` in FP8."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = _net(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fp8_autocast(enabled=True, fp8_recipe=RECIPE):
            return self.net(x)


def _replica_case(path: str) -> dict[str, list]:
    """dp=2 x pp=1 (gloo): one step on this replica's own inputs, save; a fresh pipeline loads.
    Returns this rank's slots before saving and after loading (as lists, for the test process)."""
    import torch.distributed as dist

    from zbpp import ParallelGroups, Pipeline
    from zbpp.schedules import build

    def pipeline(seed: int) -> Pipeline:
        return Pipeline({0: _Fp8Stage(seed)}, build("1f1b", num_ranks=1, num_microbatches=2),
                        lambda out, y: (out - y).square().mean(), groups=ParallelGroups(pp=1))

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    pipe = pipeline(0)
    pipe.step(torch.randn(8, 32, generator=gen) * 10.0 ** rank, target=torch.zeros(8, 32))
    save_checkpoint(pipe, path)
    saved = _slots(pipe.stage_modules[0])
    fresh = pipeline(1)
    load_checkpoint(fresh, path)
    loaded = _slots(fresh.stage_modules[0])
    as_lists = lambda slots: {k: [h.tolist(), s.item()] for k, (h, s) in slots.items()}  # noqa: E731
    return {"saved": as_lists(saved), "loaded": as_lists(loaded)}


def test_each_replica_resumes_its_own_scaling_state(tmp_path: Path, zbpp_workers) -> None:
    per_rank = zbpp_workers(2, pg_timeout=60).run(_replica_case, str(tmp_path / "ckpt"))
    for rank, got in enumerate(per_rank):
        assert got["loaded"] == got["saved"], f"rank {rank}"
    # the replicas' inputs differ by 10x, so must their input slots (else the test proves nothing)
    assert per_rank[0]["saved"]["net.q.input"] != per_rank[1]["saved"]["net.q.input"]


@pytest.mark.parametrize("head_first", [False, True], ids=["embed-first", "head-first"])
def test_a_layer_whose_weight_is_tied_is_named_by_its_own_path(head_first: bool) -> None:
    """An LM head tied to the embedding: its weight has two state_dict names; its slots are the
    head's, not filed under the embedding's name (where another layout, a copy per rank, would not
    look for them), whichever module comes first."""
    from zbpp.modules._scaling_state import scaling_layers

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if head_first:
                self.head = Linear(32, 16)
            self.embed = nn.Embedding(16, 32)
            if not head_first:
                self.head = Linear(32, 16)
            self.head.weight = self.embed.weight

    assert list(scaling_layers(Tied())) == ["head"]
