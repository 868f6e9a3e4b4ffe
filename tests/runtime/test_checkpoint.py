"""Checkpoints load into another layout: saved at pp=2 zb-v (2 gloo ranks, dp=1) after 2 AdamW
steps; loaded at pp=4 1f1b, at dp=2 x pp=2 with fully_shard stages under zb-h1 (4 ranks), and in
one process (`load_checkpoint` on the whole model, and DCP's one-file conversion read by
``nn.Module.load_state_dict``). The loaded parameters equal the one-process reference after 2
steps and 3 more steps equal its 5 steps (the optimizer state came back). Cases and tolerances:
`fsdp_cases`.
"""

from __future__ import annotations

import os
import pickle
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from zbpp.runtime import load_checkpoint

from .fsdp_cases import (RESUMED, SAVED_AFTER, Net, batch, colliding_names_case, compare, layerwise_lr,
                         layerwise_schedule, layerwise_scheduler_case, loss_fn, make_optimizer, one_rank_wrong_case,
                         reference_run, resume_case, save_case, scheduler_case, stage_of, whole_model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, zbpp_workers) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "zb-v-pp2"
    per_rank = zbpp_workers(2, pg_timeout=60).run(save_case, str(path))
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)
    return path


def _train(net: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """One process, the whole model: `steps` of the module's batches."""
    for step in steps:
        opt.zero_grad()
        x, y = batch(step)
        loss_fn(net(x), y).backward()
        opt.step()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["pp4-1f1b", "dp2-pp2-fsdp-zb-h1"])
def test_resume_at_another_layout(saved: Path, zbpp_workers, layout: str) -> None:
    per_rank = zbpp_workers(4, pg_timeout=60).run(resume_case, str(saved), layout)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("saved_at, resumed_at", [("fsdp-zb-v", "pp4-1f1b"), ("pp4-1f1b", "fsdp-zb-h1")])
def test_an_optimizer_unlike_adamw_resumes_at_another_layout(tmp_path: Path, zbpp_workers, saved_at: str,
                                                             resumed_at: str) -> None:
    """`StatefulSGD` keeps a Python int and str, None, a nested dict and a list of tensors per
    parameter, and a nested dict hyperparameter. Saved at dp=2 x pp=2 with fully_shard stages under
    zb-v and loaded at pp=4 under 1f1b (another schedule, placement and dp), and the other way: the
    nested dict and the list were saved (DCP flattens them into dotted names) but not asked for by
    the load, so the step after raised KeyError 'ema' (an optimizer that recreates a missing buffer
    would have restarted it without a word), and the nested hyperparameter stayed the new
    optimizer's. An empty dict (``seen={}``, one in a list, one in the hyperparameter) got no DCP
    entry: it was missing after the load (the list came back as a dict). Now they come back, and
    the resumed steps meet the uninterrupted one-process run (`optimizer_state_case`: rtol 1e-9,
    summation order only)."""
    from .fsdp_cases import optimizer_state_case

    per_rank = zbpp_workers(4, pg_timeout=60).run(optimizer_state_case, str(tmp_path / "c"), saved_at, resumed_at)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)


def test_factored_optimizer_state_into_fully_shard_stages_is_refused(tmp_path: Path, zbpp_workers) -> None:
    """torch's Adafactor keeps ``row_var`` / ``col_var`` of other shapes than the parameter's.
    Saved at pp=4 with plain stages and loaded into dp=2 x pp=2 fully_shard stages: the load made
    them plain tensors beside DTensor parameters, and the next step raised a RuntimeError of DTensor
    ("got mixed torch.Tensor and DTensor") that named no state (the checkpoint does not say how the
    optimizer would split them). Now the load refuses on every rank, naming the state, the
    parameter and both shapes, before reading any tensor (`optimizer_state_case`)."""
    from .fsdp_cases import optimizer_state_case

    path = str(tmp_path / "c")
    per_rank = zbpp_workers(4, pg_timeout=60).run(optimizer_state_case, path, "pp4-1f1b", "fsdp-zb-h1", "adafactor")
    words = (rf"ValueError: the checkpoint {re.escape(repr(path))} holds optimizer state '(row|col)_var' of "
             r"'layers\.\d\.weight' of shape \((4, 1|1, 4)\), not its parameter's \(4, 4\): such state \(factored")
    assert all(len(fs) == 1 and re.match(words, fs[0]) for fs in per_rank), per_rank


def test_plain_optimizer_state_of_fully_shard_parameters_is_refused_at_save(tmp_path: Path, zbpp_workers) -> None:
    """`LocalStateSGD` keeps a plain tensor from each replica's own shard of a fully_shard parameter
    (its rows' norms). Every replica saved its own under one key and DCP kept one replica's, so the
    other replica resumed with values it never had, without a word. Now the save refuses on every
    rank, naming the state, the parameter and the shapes, before writing (`optimizer_state_case`)."""
    from .fsdp_cases import optimizer_state_case

    per_rank = zbpp_workers(4, pg_timeout=60).run(optimizer_state_case, str(tmp_path / "c"), "fsdp-zb-h1",
                                                  "pp4-1f1b", "local-state")
    words = (r"ValueError: optimizer state 'row_norms' of 'layers\.\d\.weight' is a plain tensor of shape \(2,\) "
             r"beside a fully_shard parameter \(a DTensor of shape \(4, 4\)\)")
    assert all(len(fs) == 1 and re.match(words, fs[0]) for fs in per_rank), per_rank
    assert not (tmp_path / "c" / ".metadata").exists()  # nothing saved


def test_resume_in_one_process(saved: Path) -> None:
    net = whole_model(seed=123)
    opt = make_optimizer(net.parameters())
    load_checkpoint(net, saved, opt)
    ref, _ = reference_run("plain", SAVED_AFTER)
    fails = compare("loaded param", dict(net.named_parameters()), dict(ref.named_parameters()))
    for step in range(SAVED_AFTER, SAVED_AFTER + RESUMED):
        opt.zero_grad()
        x, y = batch(step)
        loss_fn(net(x), y).backward()
        opt.step()
    ref, _ = reference_run("plain", SAVED_AFTER + RESUMED)
    fails += compare("resumed param", dict(net.named_parameters()), dict(ref.named_parameters()))
    assert not fails, "\n".join(fails)


def test_one_file_for_load_state_dict(saved: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(saved, tmp_path / "model.pt")
    net = Net()
    net.load_state_dict(torch.load(tmp_path / "model.pt")["model"])
    ref, _ = reference_run("plain", SAVED_AFTER)
    fails = compare("param", dict(net.named_parameters()), dict(ref.named_parameters()))
    assert not fails, "\n".join(fails)


def test_errors_name_the_problem(tmp_path: Path) -> None:
    from zbpp.runtime import save_checkpoint

    net = whole_model()
    stranger = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no stage module of this rank holds"):
        save_checkpoint(net, tmp_path / "a", torch.optim.SGD(stranger.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="different tensors named 'layers.0.weight'"):
        save_checkpoint({0: whole_model(), 1: whole_model()}, tmp_path / "b")
    with pytest.raises(TypeError, match="expected a zbpp Pipeline"):
        save_checkpoint(3, tmp_path / "c")


@pytest.mark.parametrize("when, words", [
    ("save", "ValueError: the optimizer's param_groups[2] holds a parameter (shape (3,)) that no stage module"),
    ("load", "ValueError: the optimizer's param_groups[2] holds a parameter (shape (3,)) that no stage module"),
    ("apply", "ValueError: the optimizer's param_groups[0] holds 'layers.2.weight' and 'layers.2.bias', saved with "
              "different 'weight_decay'"),
])
def test_an_error_on_one_rank_raises_on_every_rank(tmp_path: Path, zbpp_workers, when: str, words: str) -> None:
    """save_checkpoint / load_checkpoint wrong on rank 1 only (`one_rank_wrong_case`): rank 1 raises
    its own error and rank 0 a PipelineError naming it, within seconds (rank 0 used to wait in DCP's
    collective for the process group's 60 s timeout, or, after the read, return as if all went well)."""
    wrong_on_0, wrong_on_1 = zbpp_workers(2, pg_timeout=60).run(one_rank_wrong_case, str(tmp_path / "c"), when)
    assert wrong_on_1.split(" ", 1)[1].startswith(words), wrong_on_1
    call = f"{'save' if when == 'save' else 'load'}_checkpoint could not run"  # "apply": before reading the tensors
    assert wrong_on_0.split(" ", 1)[1].startswith(f"PipelineError: {call} on every rank ("), wrong_on_0
    assert f"; global rank 1: {words}" in wrong_on_0, wrong_on_0
    assert all(float(m.split("s ", 1)[0]) < 10 for m in (wrong_on_0, wrong_on_1)), (wrong_on_0, wrong_on_1)


def test_ctrl_c_while_waiting_in_the_save(tmp_path: Path, zbpp_workers) -> None:
    """A real Ctrl-C on rank 1 while it waits for rank 0 in save_checkpoint's exchange: it left
    all_gather_object between its two collectives and rank 0 waited in the second, which then paired
    with DCP's (or the load's) collectives. Now the save completes on both ranks, then rank 1 gets its
    interrupt, and the checkpoint loads back the saved values (`ctrl_c_while_saving_case`)."""
    from .fsdp_cases import ctrl_c_while_saving_case

    on_0, on_1 = zbpp_workers(2, pg_timeout=60).run(ctrl_c_while_saving_case, str(tmp_path / "c"))
    assert (on_0, on_1) == ("ok", "KeyboardInterrupt: "), (on_0, on_1)


@pytest.mark.parametrize("when", ["save", "load"])
def test_an_interrupt_on_one_rank_raises_on_every_rank(tmp_path: Path, zbpp_workers, when: str) -> None:
    """A KeyboardInterrupt on rank 1 while it gathers its part (`interrupted_checkpoint_case`): it
    left at once and rank 0 waited in the agreement for the process group's 60 s timeout. Now rank 1
    gets its interrupt back and rank 0 a PipelineError naming it, within seconds."""
    from .fsdp_cases import interrupted_checkpoint_case

    on_0, on_1 = zbpp_workers(2, pg_timeout=60).run(interrupted_checkpoint_case, str(tmp_path / "c"), when)
    assert on_1.split(" ", 1)[1] == "KeyboardInterrupt: Ctrl-C on rank 1", on_1
    assert on_0.split(" ", 1)[1].startswith(f"PipelineError: {when}_checkpoint could not run on every rank ("), on_0
    assert "global rank 1: KeyboardInterrupt" in on_0, on_0
    assert all(float(m.split("s ", 1)[0]) < 10 for m in (on_0, on_1)), (on_0, on_1)


@pytest.mark.parametrize("how", ["future", "unreadable", "device-oom"])
def test_a_failed_load_changes_nothing_on_every_rank(tmp_path: Path, zbpp_workers, how: str) -> None:
    """`failed_load_case` on 2 ranks: a live stage and AdamW, a load that fails. ``"future"``: a
    checkpoint of format version 2 (a later zbpp's layout) loaded without a word (had its entries
    been renamed, it would have said "saved from another model?"); now every rank refuses, naming
    the version and the path, before reading any tensor. ``"unreadable"``: a data file damaged
    after the save (same size), so DCP's read fails part-way: DCP read in place, so rank 0's stage
    was loaded and rank 1's weights too (not its optimizer state), and every rank raised a
    ``CheckpointException`` (no ``Exception``) around tracebacks; now the model is read into new
    tensors first, nothing changes, and every rank raises a RuntimeError naming the failed rank and
    its cause. ``"device-oom"``: rank 1's move of its optimizer state onto the device runs out of
    memory at the second tensor: rank 1's first parameter had its old state dropped and got none
    (the next step would have restarted its moments), and rank 0 had loaded everything; now every
    tensor is made on the device before anything changes, and every rank raises, saying that
    nothing was loaded. Reference: the model's and the optimizer's state dicts from just before the
    load (``torch.equal``, dtypes too)."""
    from .fsdp_cases import failed_load_case

    path = str(tmp_path / "c")
    msgs = zbpp_workers(2, pg_timeout=60).run(failed_load_case, path, how)
    if how == "future":
        want = f"ValueError: the checkpoint {path!r} is of format version 2, this zbpp reads version 1 only"
        assert all(m.startswith(want) and m.endswith("nothing was loaded") for m in msgs), msgs
    elif how == "device-oom":
        oom = "OutOfMemoryError: simulated: out of memory moving optimizer state"
        assert msgs[1] == oom, msgs
        assert msgs[0] == f"PipelineError: load_checkpoint could not run on every rank (nothing was loaded); " \
                          f"global rank 1: {oom}", msgs
    else:
        want = f"RuntimeError: reading the checkpoint {path!r} failed on global rank 1: UnpicklingError: "
        assert all(m.startswith(want) and m.endswith("nothing was loaded (the model and optimizer are as before)")
                   for m in msgs), msgs


def test_the_staging_copy_is_in_host_memory(tmp_path: Path) -> None:
    """`load_checkpoint` reads the model into new tensors (a read failing part-way changes nothing)
    and copies them in once every rank read all. They were made like the stage's (``empty_like``):
    for a model on a GPU, one more copy of its state in GPU memory. Now they are in host memory
    wherever the model lives. A model on the meta device stands in for one on an accelerator (no
    GPU here): its staging tensors were on the meta device; now on the CPU, shaped and typed like
    the stage's. Then a CPU model loads through them: its tensors are the ones it had (in place: an
    optimizer holds them) and equal the saved ones (``torch.equal``: a copy, no arithmetic)."""
    from zbpp.runtime import checkpoint, save_checkpoint

    net = whole_model()
    save_checkpoint(net, tmp_path / "c")
    on_meta = whole_model(seed=3).to("meta")
    live = on_meta.state_dict()
    staged = checkpoint._state_to_load(on_meta, str(tmp_path / "c"), None, None).model_state
    assert staged.keys() == live.keys()
    for name, value in staged.items():
        assert value.device == torch.device("cpu"), (name, value.device)
        assert (value.shape, value.dtype) == (live[name].shape, live[name].dtype), name
    fresh = whole_model(seed=3)
    before = {name: value.data_ptr() for name, value in fresh.state_dict().items()}
    load_checkpoint(fresh, tmp_path / "c")
    for name, value in fresh.state_dict().items():
        assert value.data_ptr() == before[name] and torch.equal(value, net.state_dict()[name]), name


def test_a_sharded_stage_is_staged_in_host_memory(tmp_path: Path, zbpp_workers) -> None:
    """`host_staging_case` on 2 ranks: a ``fully_shard`` stage's new values and its optimizer's
    state were read into DTensors like its parameters (on their device: a GPU's memory, the
    optimizer's beside its live state); now into plain host tensors of the rank's shard (uneven: 3
    and 2 rows), copied into the shards after (into the live state DTensors in place). Reference:
    the saved tensors, ``torch.equal``."""
    from .fsdp_cases import host_staging_case

    per_rank = zbpp_workers(2, pg_timeout=60).run(host_staging_case, str(tmp_path / "c"))
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)


def _tensors(state: Any, path: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested optimizer state, by dotted path."""
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _tensors(value, f"{path}.{key}").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in _tensors(value, f"{path}[{i}]").items()}
    return {path: state} if isinstance(state, torch.Tensor) else {}


def test_the_optimizer_state_is_staged_in_host_memory(tmp_path: Path) -> None:
    """The optimizer's state was read into new tensors on its parameters' device (a GPU's memory:
    the whole state twice while a live optimizer's is there, as on a rollback mid-run); now into
    host memory, as the model's. A model on the meta device stands in for one on an accelerator
    (no GPU here): its AdamW moments and a state of another shape (``factored``, as Adafactor's)
    were staged on the meta device; now on the CPU, of the saved shapes and dtypes."""
    from zbpp.runtime import checkpoint, save_checkpoint

    net = whole_model()
    opt = make_optimizer(net.parameters())
    x, y = batch(0)
    loss_fn(net(x), y).backward()
    opt.step()
    opt.state[net.layers["0"].weight]["factored"] = [torch.arange(3, dtype=torch.float64)]
    save_checkpoint(net, tmp_path / "c", opt)
    on_meta = whole_model(seed=3).to("meta")
    staged = checkpoint._state_to_load(on_meta, str(tmp_path / "c"), make_optimizer(on_meta.parameters()),
                                       None).state["optimizer"]["state"]
    saved = {name: _tensors(opt.state[p]) for name, p in net.named_parameters()}
    assert staged.keys() == saved.keys()
    for name, entries in staged.items():
        got = _tensors(entries)
        assert got.keys() == saved[name].keys(), name
        for field, value in got.items():
            want = saved[name][field]
            assert (value.device, value.shape, value.dtype) == (torch.device("cpu"), want.shape, want.dtype), \
                (name, field)


@pytest.mark.parametrize("saved_fused", [True, False], ids=["fused-saved", "fused-loaded"])
def test_the_step_goes_where_the_loaded_group_keeps_it(tmp_path: Path, saved_fused: bool) -> None:
    """A fused AdamW keeps ``step`` on its parameter's device in float32, a plain one on the CPU.
    The checkpoint's ``fused`` wins over the new optimizer's, but ``step`` was placed by the new
    one's: saved fused and loaded into a plain AdamW, the group came back fused with ``step`` on
    the CPU (on a GPU, the next ``opt.step()`` raises: "state_steps is on cpu"), and the other way
    round ``step`` went onto the device of a plain group. A model on the meta device stands in for
    one on an accelerator (no GPU here). Reference: torch's own ``Optimizer.load_state_dict`` of
    the saved optimizer into a new one alike (the device and dtype of every state tensor)."""
    import warnings

    from zbpp.runtime import save_checkpoint

    net = whole_model()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, fused=saved_fused)
    x, y = batch(0)
    loss_fn(net(x), y).backward()
    opt.step()
    save_checkpoint(net, tmp_path / "c", opt)

    def placed(state: dict) -> dict[str, tuple[torch.device, torch.dtype]]:
        return {k: (v.device, v.dtype) for k, v in state.items()}

    on_meta, ref = whole_model(seed=3).to("meta"), whole_model(seed=3).to("meta")
    got_opt = torch.optim.AdamW(on_meta.parameters(), lr=1.0, fused=not saved_fused)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1.0, fused=not saved_fused)
    ref_opt.load_state_dict(opt.state_dict())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")  # the weights: no-ops
        load_checkpoint(on_meta, tmp_path / "c", got_opt)
    assert got_opt.param_groups[0]["fused"] == saved_fused
    for (name, p), q in zip(on_meta.named_parameters(), ref.parameters()):
        assert placed(got_opt.state[p]) == placed(ref_opt.state[q]), name


class _Gained(torch.nn.Module):
    """A float32 weight and a 0-dim gain (a parameter of no dims: its state is 0-dim too)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(3, 2, generator=g))
        self.gain = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T * self.gain


#: every torch.optim optimizer with per-parameter state, and the flags that move its ``step`` (where it has them)
_OPTIMIZERS = [("Adam", None), ("Adam", "capturable"), ("Adam", "fused"), ("AdamW", None), ("AdamW", "capturable"),
               ("AdamW", "fused"), ("NAdam", None), ("NAdam", "capturable"), ("RAdam", None), ("RAdam", "capturable"),
               ("ASGD", None), ("ASGD", "capturable"), ("Rprop", None), ("Rprop", "capturable"), ("Adagrad", None),
               ("Adagrad", "fused"), ("Adadelta", None), ("Adadelta", "capturable"), ("Adamax", None),
               ("Adamax", "capturable"), ("RMSprop", None), ("RMSprop", "capturable"), ("SGD", None), ("SGD", "fused")]


@pytest.mark.parametrize("kind, flag", _OPTIMIZERS, ids=[f"{k}-{f or 'plain'}" for k, f in _OPTIMIZERS])
def test_optimizer_state_goes_where_torch_puts_it(tmp_path: Path, kind: str, flag: str | None) -> None:
    """Every loaded optimizer state tensor on the device and in the dtype that torch's own
    ``Optimizer.load_state_dict`` gives the saved optimizer's state on that device. A 0-dim state
    beside a parameter that is not (ASGD's ``eta`` / ``mu``, NAdam's ``mu_product``) went to the CPU
    (torch: the parameter's device; on a GPU, ASGD's foreach step then mixes devices), and the
    ``step`` of a 0-dim parameter (``gain``) to its device (torch: where saved, the CPU, unless the
    group is fused or capturable). ASGD keeps ``step`` on its parameter's device whatever its flags
    (Rprop and the others on the CPU unless capturable or fused): saved from a GPU, torch's load
    keeps it there, zbpp put it on the CPU. A model on the meta device stands in for one on an
    accelerator (no GPU here), and the reference is torch's load of the saved state with each
    ``step`` a number, so that, as from a checkpoint, nothing says where it was: each optimizer then
    makes it where it keeps it on that device (its ``__setstate__``), as a run saved there had it
    (torch's load of the tensors themselves keeps ``step`` where saved). Capturable and fused
    groups cannot step on the CPU (all of them): the saved optimizer steps plainly and is then
    marked so. float32 parameters: in another dtype zbpp keeps a state's own dtype where it differs
    from its parameter's (as the uninterrupted run has it; see the float64 -> float32 test above),
    where torch casts it."""
    import warnings

    from zbpp.runtime import save_checkpoint

    def make(net: torch.nn.Module) -> torch.optim.Optimizer:
        cls = getattr(torch.optim, kind)
        return cls(net.parameters(), lr=0.05, momentum=0.9) if kind == "SGD" else cls(net.parameters(), lr=0.05)

    net = _Gained()
    opt = make(net)
    for step in range(2):
        opt.zero_grad()
        x = torch.randn(4, 2, generator=torch.Generator().manual_seed(step))
        net(x).square().mean().backward()
        opt.step()
    if flag is not None:
        opt.param_groups[0][flag] = True
    save_checkpoint(net, tmp_path / "c", opt)

    def placed(state: dict) -> dict[str, tuple[torch.device, torch.dtype]]:
        return {k: (v.device, v.dtype) for k, v in _tensors(state).items()}

    saved = opt.state_dict()
    for state in saved["state"].values():
        if "step" in state:
            state["step"] = float(state["step"])  # where it lived is not said
    on_meta, ref = _Gained().to("meta"), _Gained().to("meta")
    got_opt, ref_opt = make(on_meta), make(ref)
    ref_opt.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")  # the weights: no-ops
        load_checkpoint(on_meta, tmp_path / "c", got_opt)
    for (name, p), q in zip(on_meta.named_parameters(), ref.parameters()):
        assert placed(got_opt.state[p]) == placed(ref_opt.state[q]), name


def test_a_live_optimizer_state_is_loaded_in_place(tmp_path: Path) -> None:
    """Rolling a live AdamW back to a checkpoint: its state tensors were replaced by new ones (on a
    GPU, made while the old were alive). Now a live tensor of the loaded one's shape, dtype and
    device takes the value in place (the same tensor object after the load); one that does not
    match (``exp_avg`` of ``layers.0.weight`` turned float32) is replaced by one of the saved dtype,
    a live state the checkpoint lacks (``stale``) is dropped, and a live tensor held at two places
    (``exp_avg`` and ``exp_avg_sq`` of ``layers.1.weight`` one tensor) takes one value only.
    Reference: the state at the save (float64 copies), ``torch.equal`` (copies, no arithmetic)."""
    from zbpp.runtime import save_checkpoint

    net = whole_model()
    opt = make_optimizer(net.parameters())
    _train(net, opt, range(2))
    save_checkpoint(net, tmp_path / "c", opt)
    saved = {name: {k: v.clone() for k, v in opt.state[p].items()} for name, p in net.named_parameters()}
    _train(net, opt, range(10, 12))  # rolled back by the load
    w0, w1 = net.layers["0"].weight, net.layers["1"].weight
    opt.state[w0]["exp_avg"] = opt.state[w0]["exp_avg"].float()
    opt.state[w0]["stale"] = torch.ones(2)
    opt.state[w1]["exp_avg_sq"] = opt.state[w1]["exp_avg"]
    before = {name: dict(opt.state[p]) for name, p in net.named_parameters()}
    load_checkpoint(net, tmp_path / "c", opt)
    for name, p in net.named_parameters():
        state = opt.state[p]
        assert state.keys() == saved[name].keys(), name
        for field, value in state.items():
            assert value.dtype == saved[name][field].dtype and torch.equal(value, saved[name][field]), (name, field)
            replaced = (name, field) in {("layers.0.weight", "exp_avg"), ("layers.1.weight", "exp_avg_sq")}
            assert (value is before[name][field]) != replaced, (name, field)


def test_a_checkpoint_without_a_format_version_loads(tmp_path: Path) -> None:
    """Checkpoints saved before ``format.version`` was written have none: they are of the first
    layout and load (the reference: the saved model and optimizer, ``torch.equal``)."""
    import torch.distributed.checkpoint as dcp

    from zbpp.runtime import checkpoint

    net = whole_model()
    opt = make_optimizer(net.parameters())
    loss_fn(net(batch(0)[0]), batch(0)[1]).backward()
    opt.step()
    state = checkpoint._state_to_save(net, opt, None)
    state.pop("format", None)  # as the code before versions wrote it
    with checkpoint._one_process_quiet(alone=True):
        dcp.save(state, checkpoint_id=tmp_path / "old", no_dist=True)
    fresh = whole_model(seed=3)
    fresh_opt = make_optimizer(fresh.parameters())
    load_checkpoint(fresh, tmp_path / "old", fresh_opt)
    for name, p in net.named_parameters():
        assert torch.equal(fresh.get_parameter(name), p), name
        assert all(torch.equal(v, opt.state[p][k]) for k, v in fresh_opt.state[fresh.get_parameter(name)].items()), name


def test_an_unreadable_format_version_is_refused(tmp_path: Path) -> None:
    """The bytes of ``format.version`` damaged (the file's size kept): reading it raised DCP's
    ``CheckpointException``, which is no ``Exception``: on several ranks one that raised it would
    have left the agreement that follows, the others waiting there for the process group's timeout.
    Now it is a ValueError naming the path, and nothing was loaded (``torch.equal``)."""
    import torch.distributed.checkpoint as dcp

    from zbpp.runtime import save_checkpoint

    save_checkpoint(whole_model(), tmp_path / "ckpt")
    where = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().storage_data
    index = next(i for i in where if i.fqn == "format.version")
    with open(tmp_path / "ckpt" / where[index].relative_path, "r+b") as f:
        f.seek(where[index].offset)
        f.write(bytes(where[index].length))
    net = whole_model(seed=3)
    before = {n: t.clone() for n, t in net.state_dict().items()}
    with pytest.raises(ValueError, match=rf"the checkpoint {re.escape(repr(str(tmp_path / 'ckpt')))}: its format "
                                         r"version could not be read \(UnpicklingError: .*\); nothing was loaded"):
        load_checkpoint(net, tmp_path / "ckpt")
    assert [n for n, t in net.state_dict().items() if not torch.equal(t, before[n])] == []


@pytest.mark.parametrize("what, want", [
    ("lr_scheduler", "ValueError: lr_scheduler's state differs between global ranks 0 and 1: 'last_epoch' is 3 on 0, "
                     "4 on 1"),
    ("grad_scaler", "ValueError: grad_scaler's state differs between global ranks 0 and 1: 'scale' is 65536.0 on 0, "
                    "1024.0 on 1. A checkpoint keeps one grad_scaler state for every rank and layout: the ranks "
                    "skipped different steps"),
])
def test_kept_states_that_differ_between_ranks_are_refused(tmp_path: Path, zbpp_workers, what: str,
                                                             want: str) -> None:
    """`scheduler_case`: the ranks' schedulers stepped different times. The checkpoint keeps one
    scheduler state (DCP writes one rank's), so one rank would resume with the other's step; every
    rank refuses to save, naming the difference. So do GradScalers of different scales (ranks that
    skipped different steps)."""
    msgs = zbpp_workers(2, pg_timeout=60).run(scheduler_case, str(tmp_path / "c"), what)
    assert all(m.startswith(want) for m in msgs), msgs


def test_layerwise_lrs_saved_at_pp2_resume_at_pp2_and_in_one_process(tmp_path: Path, zbpp_workers) -> None:
    """`layerwise_scheduler_case`: one AdamW group per block at its layer-wise lr, a LambdaLR, 2 steps,
    saved at pp=2, where each rank's scheduler holds its own groups' base_lrs (the save was refused:
    the states differ). Resumed at pp=2 and in one process (the whole model, four groups), 2 steps
    more: every block's lr is the formula's, base x 0.8**4 (rel 1e-12: the same float operations)."""
    path = str(tmp_path / "c")
    got = {b: lr for lrs in zbpp_workers(2, pg_timeout=60).run(layerwise_scheduler_case, path) for b, lr in lrs.items()}
    assert sorted(got) == [0, 1, 2, 3]
    for b, lr in got.items():
        assert lr == pytest.approx(layerwise_lr(b) * 0.8 ** 4, rel=1e-12), (b, lr)
    whole = whole_model(seed=5)
    opt, sched = layerwise_schedule(whole)
    load_checkpoint(whole, path, opt, lr_scheduler=sched)
    assert sched.last_epoch == 2 and sched.base_lrs == [layerwise_lr(b) for b in range(4)]
    for _ in range(2):
        opt.step()
        sched.step()
    for b, (group, lr) in enumerate(zip(opt.param_groups, sched.get_last_lr())):
        assert lr == group["lr"] == pytest.approx(layerwise_lr(b) * 0.8 ** 4, rel=1e-12), (b, lr)
    with pytest.raises(ValueError, match=r"its 'lr_scheduler' entry was saved by ranks holding different param "
                                         r"groups .*give load_checkpoint the optimizer too; nothing was loaded"):
        load_checkpoint(whole, path, lr_scheduler=layerwise_schedule(whole_model())[1])
    with pytest.raises(ValueError, match=r"the given lr_scheduler is not over the given optimizer"):
        load_checkpoint(whole, path, layerwise_schedule(whole)[0], lr_scheduler=layerwise_schedule(whole)[1])


def test_compiled_stage_keeps_the_model_names(tmp_path: Path) -> None:
    """torch.compile(stage) prefixes its state_dict keys with ``_orig_mod.``; a checkpoint keeps the
    whole model's names, so a plain module loads it (backend "eager": no compilation needed here)."""
    from zbpp.runtime import save_checkpoint

    torch.manual_seed(0)
    net = Net()
    save_checkpoint({0: torch.compile(net, backend="eager")}, tmp_path / "ckpt")
    fresh = Net()
    load_checkpoint(fresh, tmp_path / "ckpt")
    for (name, a), (_, b) in zip(net.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name


def _trained_pipeline(stage: torch.nn.Module, steps: int, opt_args: dict, scheduler: bool = True):
    from zbpp import Pipeline
    from zbpp.schedules import build

    from .fsdp_cases import M

    pipe = Pipeline({0: stage}, build("1f1b", num_ranks=1, num_microbatches=M), loss_fn=loss_fn)
    opt = torch.optim.AdamW(list(pipe.parameters()), **opt_args)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step)
        pipe.step(x, target=y)
        opt.step()
        if sched is not None:
            sched.step()
    return pipe, opt, sched


SAVED_HYPER = {"lr": 0.05, "betas": (0.8, 0.9), "weight_decay": 0.1, "eps": 1e-7}


def test_checkpoint_hyperparameters_and_lr_scheduler_win_over_the_new_ones(tmp_path: Path) -> None:
    """`load_checkpoint` gives the optimizer the checkpoint's lr, betas, weight decay and eps (as
    ``Optimizer.load_state_dict`` does) and the LR scheduler its saved position, whatever the new
    ones were built with: 2 steps, save, a new optimizer and scheduler built otherwise, load, 3
    steps equal one process doing 5 steps with AdamW and StepLR halving lr each step (rtol 1e-9:
    the pipeline sums 4 microbatches' gradients where the reference takes the whole batch; a
    learning rate off by 2x or a scheduler restarted is ~1e-2 off)."""
    from zbpp.runtime import save_checkpoint

    pipe, opt, sched = _trained_pipeline(whole_model(), 2, SAVED_HYPER)
    save_checkpoint(pipe, tmp_path / "ckpt", opt, lr_scheduler=sched)

    pipe, opt, sched = _trained_pipeline(whole_model(seed=5), 0, {"lr": 1.0, "betas": (0.5, 0.6), "weight_decay": 0.0})
    load_checkpoint(pipe, tmp_path / "ckpt", opt, lr_scheduler=sched)
    want = dict(SAVED_HYPER, lr=SAVED_HYPER["lr"] * 0.25, initial_lr=SAVED_HYPER["lr"])  # halved twice
    for group in opt.param_groups:
        assert {k: group[k] for k in want} == want
    assert sched.last_epoch == 2 and sched.get_last_lr() == [want["lr"]]

    ref = whole_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **SAVED_HYPER)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for step in range(5):
        ref_opt.zero_grad()
        x, y = batch(step)
        loss_fn(ref(x), y).backward()
        ref_opt.step()
        ref_sched.step()
        if step >= 2:
            opt.zero_grad()
            pipe.step(x, target=y)
            opt.step()
            sched.step()
    fails = compare("resumed param", dict(pipe.stage_modules[0].named_parameters()), dict(ref.named_parameters()))
    assert not fails, "\n".join(fails)


def test_load_with_a_scheduler_needs_its_saved_state(tmp_path: Path) -> None:
    from zbpp.runtime import save_checkpoint

    pipe, opt, sched = _trained_pipeline(whole_model(), 0, SAVED_HYPER)
    save_checkpoint(pipe, tmp_path / "ckpt", opt)
    with pytest.raises(ValueError, match="holds no LR scheduler state"):
        load_checkpoint(pipe, tmp_path / "ckpt", opt, lr_scheduler=sched)


def test_compiled_pipeline_checkpoint_keys_are_the_model_names(tmp_path: Path) -> None:
    """A real `Pipeline` of a ``torch.compile``d stage (backend "eager": no compiler needed) trains a
    step and saves: the checkpoint's keys are the model's own (no ``_orig_mod.``), a plain module
    loads them, and its parameters equal the compiled stage's."""
    import torch.distributed.checkpoint as dcp

    from zbpp.runtime import save_checkpoint

    torch.manual_seed(0)
    net = Net()
    pipe, opt, _ = _trained_pipeline(torch.compile(net, backend="eager"), 1, SAVED_HYPER, scheduler=False)
    save_checkpoint(pipe, tmp_path / "ckpt", opt)
    keys = list(dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata)
    assert not [k for k in keys if "_orig_mod" in k], keys
    assert {k for k in keys if k.startswith("model.")} == {f"model.{n}" for n in net.state_dict()}
    fresh = Net()
    load_checkpoint(fresh, tmp_path / "ckpt")
    for name, p in net.named_parameters():
        assert torch.equal(fresh.get_parameter(name), p), name


def _grouped_adamw(net: torch.nn.Module, wd_of_biases: float | None, **kw) -> torch.optim.AdamW:
    """AdamW with the weights decayed (0.1) and the biases in a group of their own with weight decay
    `wd_of_biases`; None: one group for every parameter."""
    weights = [p for n, p in net.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in net.named_parameters() if n.endswith("bias")]
    if wd_of_biases is None:
        return torch.optim.AdamW(weights + biases, weight_decay=0.1, **kw)
    return torch.optim.AdamW([{"params": weights, "weight_decay": 0.1},
                              {"params": biases, "weight_decay": wd_of_biases}], **kw)


def test_each_parameter_group_gets_its_saved_hyperparameters(tmp_path: Path) -> None:
    """Saved with the biases in a group without weight decay: a new optimizer grouped alike gets
    each group's saved values (weights 0.1, biases 0.0); one grouped otherwise, a group whose
    parameters were saved with different values (here every parameter in one group), would get
    whichever parameter came last (0.0: no weight decay at all, silently), so it raises, naming
    the group, the key and two of its parameters, before the model or the optimizer changed."""
    from zbpp.runtime import save_checkpoint

    net = whole_model()
    opt = _grouped_adamw(net, 0.0, lr=0.05)
    loss_fn(net(batch(0)[0]), batch(0)[1]).backward()
    opt.step()
    save_checkpoint(net, tmp_path / "ckpt", opt)

    fresh = whole_model(seed=3)
    alike = _grouped_adamw(fresh, 0.5, lr=1.0)
    load_checkpoint(fresh, tmp_path / "ckpt", alike)
    assert [(g["weight_decay"], g["lr"]) for g in alike.param_groups] == [(0.1, 0.05), (0.0, 0.05)]

    fresh = whole_model(seed=3)
    before = {n: t.clone() for n, t in fresh.state_dict().items()}
    otherwise = _grouped_adamw(fresh, None, lr=1.0)
    with pytest.raises(ValueError, match=r"param_groups\[0\] holds 'layers\.0\.weight' and 'layers\.0\.bias', "
                                         r"saved with different 'weight_decay' \(0\.1 and 0\.0\)"):
        load_checkpoint(fresh, tmp_path / "ckpt", otherwise)
    # raised before the tensors were read: the model is as it was (it used to hold the checkpoint's)
    assert [n for n, t in fresh.state_dict().items() if not torch.equal(t, before[n])] == [] and not otherwise.state


def test_load_with_an_optimizer_needs_its_saved_state(tmp_path: Path) -> None:
    """A checkpoint saved without optimizer=, loaded with one: the optimizer would keep its fresh
    state and its own hyperparameters without a word (a resumed AdamW restarting its moments and
    step count); it raises, as a missing LR scheduler state does."""
    from zbpp.runtime import save_checkpoint

    pipe, opt, _ = _trained_pipeline(whole_model(), 1, SAVED_HYPER, scheduler=False)
    save_checkpoint(pipe, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="holds no optimizer state"):
        load_checkpoint(pipe, tmp_path / "ckpt", opt)


def test_a_live_optimizer_keeps_no_state_the_checkpoint_lacks(tmp_path: Path) -> None:
    """Rolling a live AdamW back to a checkpoint saved when only ``layers.3`` had had gradients (the
    other parameters had no state yet): the state they got after the save stayed, so their next
    steps used moments of rolled-back work instead of starting fresh. Reference: the uninterrupted
    run from the save, in the same process with the same operations, so bit for bit."""
    from zbpp.runtime import save_checkpoint

    def first_step(net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        for name, p in net.named_parameters():  # no gradient, so no AdamW state, but for layers.3
            p.requires_grad_(name.startswith("layers.3."))
        x, y = batch(0)
        loss_fn(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        for p in net.parameters():
            p.requires_grad_(True)

    ref = whole_model()
    ref_opt = make_optimizer(ref.parameters())
    first_step(ref, ref_opt)
    _train(ref, ref_opt, range(1, 3))

    net = whole_model()
    opt = make_optimizer(net.parameters())
    first_step(net, opt)
    save_checkpoint(net, tmp_path / "ckpt", opt)
    _train(net, opt, range(10, 12))  # rolled back by the load
    load_checkpoint(net, tmp_path / "ckpt", opt)
    assert sorted(n for n, p in net.named_parameters() if opt.state.get(p)) == ["layers.3.bias", "layers.3.weight"]
    _train(net, opt, range(1, 3))
    for name, p in ref.named_parameters():
        assert torch.equal(net.get_parameter(name), p), name


def test_optimizer_state_follows_its_parameter_into_another_dtype(tmp_path: Path) -> None:
    """Saved in float64, resumed in float32: DCP casts the parameters, but AdamW's moments came back
    float64 and the next ``opt.step()`` raised (lerp of a float64 moment by a float32 gradient).
    Reference: torch's own resume, ``Optimizer.load_state_dict`` into a float32 copy (it casts a
    parameter's floating state but ``step`` to the parameter's dtype), 2 more steps on float32
    batches: bit for bit (same casts, same operations). A state kept in another dtype than its
    parameter's (a float16 shadow in a float64 model, say: an optimizer's own choice) keeps it."""
    from zbpp.runtime import save_checkpoint

    def train(net: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, dtype: torch.dtype) -> None:
        for step in steps:
            opt.zero_grad()
            x, y = batch(step)
            loss_fn(net(x.to(dtype)), y.to(dtype)).backward()
            opt.step()

    net = whole_model()
    opt = make_optimizer(net.parameters())
    train(net, opt, range(2), torch.float64)
    opt.state[net.layers["0"].weight]["shadow"] = torch.ones(3, dtype=torch.float16)  # not its parameter's dtype
    save_checkpoint(net, tmp_path / "ckpt", opt)
    del opt.state[net.layers["0"].weight]["shadow"]  # torch's AdamW would cast it
    ref = whole_model().float()
    ref.load_state_dict(net.state_dict())
    ref_opt = make_optimizer(ref.parameters())
    ref_opt.load_state_dict(opt.state_dict())

    got = whole_model(seed=3).float()
    got_opt = make_optimizer(got.parameters())
    load_checkpoint(got, tmp_path / "ckpt", got_opt)
    state = got_opt.state[got.layers["0"].weight]
    assert {k: v.dtype for k, v in state.items()} == {"step": torch.float32, "exp_avg": torch.float32,
                                                      "exp_avg_sq": torch.float32, "shadow": torch.float16}
    del state["shadow"]
    train(ref, ref_opt, range(2, 4), torch.float32)
    train(got, got_opt, range(2, 4), torch.float32)
    for name, p in ref.named_parameters():
        assert torch.equal(got.get_parameter(name), p), name


@pytest.mark.parametrize("damage", ["cut short", "missing", "no .metadata"])
def test_an_incomplete_checkpoint_is_refused_before_anything_loads(saved: Path, tmp_path: Path, damage: str) -> None:
    """The 2-rank checkpoint with rank 1's data file cut in half (a copy interrupted) or missing (a
    directory not shared by the ranks that saved), or without ``.metadata`` (a save that did not
    finish: DCP writes it last). DCP read what the intact files held into the model, then raised an
    ``EOFError`` or ``FileNotFoundError`` that named no entry, the model half overwritten; now the
    error names the file and an entry of it, and neither the model nor the optimizer changed."""
    import shutil

    damaged = tmp_path / "ckpt"
    shutil.copytree(saved, damaged)
    last = sorted(damaged.glob("*.distcp"))[-1]  # rank 1's: read after rank 0's
    if damage == "cut short":
        os.truncate(last, last.stat().st_size // 2)
        words = rf"{last.name} holds \d+ bytes, its entries need \d+ \(it holds 'model\.layers\.\d\.\w+' and \d+ more"
    elif damage == "missing":
        last.unlink()
        words = rf"{last.name} is missing \(it holds 'model\.layers\.\d\.\w+' and \d+ more entries\)"
    else:
        (damaged / ".metadata").unlink()
        words = "it holds no .metadata"
    net = whole_model(seed=123)
    before = {n: t.clone() for n, t in net.state_dict().items()}
    opt = make_optimizer(net.parameters())
    with pytest.raises((ValueError, FileNotFoundError), match=words):
        load_checkpoint(net, damaged, opt)
    assert [n for n, t in net.state_dict().items() if not torch.equal(t, before[n])] == []
    assert not opt.state


def test_stages_holding_different_tensors_under_one_name_are_refused(tmp_path: Path, zbpp_workers) -> None:
    """Each rank's stage an ``nn.Sequential`` of its own: both hold a different ``0.weight`` (and an
    alike constant buffer); DCP kept one of them and the load gave both stages the same weights."""
    assert zbpp_workers(2, pg_timeout=60).run(colliding_names_case, str(tmp_path / "c")) == [[], []]


def test_a_failed_save_over_a_checkpoint_leaves_none(tmp_path: Path, zbpp_workers) -> None:
    """A save into a directory holding a checkpoint that fails part-way (`failed_overwrite_case`:
    rank 1's disk full after rank 0 wrote its file) left the first save's ``.metadata`` (DCP writes
    it last) over rank 0's new file and rank 1's old one: the load took rank 0's stage from the
    second save and rank 1's from the first, without a word. Now the earlier ``.metadata`` goes
    before any rank writes, so the load refuses on both ranks."""
    from .fsdp_cases import failed_overwrite_case

    msgs = zbpp_workers(2, pg_timeout=60).run(failed_overwrite_case, str(tmp_path / "c"))
    assert all(m.startswith(f"FileNotFoundError: no checkpoint at {str(tmp_path / 'c')!r}: it holds no .metadata")
               for m in msgs), msgs


def test_seeded_dropout_resumes_bit_for_bit_in_one_process(tmp_path: Path) -> None:
    """A seeded `Pipeline` (here built with another seed at resume: the checkpoint's wins) with
    dropout: 2 steps, save, a new Pipeline loads and takes 2 more; its losses and parameters are
    the uninterrupted run's bit for bit (the same masks and operations). Under ``seed=False`` the
    draws come from torch's global generators, which no checkpoint holds (documented there)."""
    from zbpp import Pipeline
    from zbpp.runtime import save_checkpoint
    from zbpp.schedules import build

    from .fsdp_cases import M

    def pipeline(seed: int) -> tuple[Pipeline, torch.optim.Optimizer]:
        torch.manual_seed(0)
        stage = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=torch.float64), torch.nn.Dropout(0.5),
                                    torch.nn.Linear(4, 4, dtype=torch.float64))
        pipe = Pipeline({0: stage}, build("1f1b", num_ranks=1, num_microbatches=M), loss_fn=loss_fn, seed=seed)
        return pipe, torch.optim.SGD(pipe.parameters(), lr=0.1)

    def train(pipe: Pipeline, opt: torch.optim.Optimizer, steps: range) -> list[float]:
        losses = []
        for step in steps:
            opt.zero_grad()
            x, y = batch(step)
            losses.append(float(pipe.step(x, target=y)))
            opt.step()
        return losses

    ref, ref_opt = pipeline(1234)
    train(ref, ref_opt, range(2))
    save_checkpoint(ref, tmp_path / "ckpt", ref_opt)
    want = train(ref, ref_opt, range(2, 4))
    pipe, opt = pipeline(999)
    load_checkpoint(pipe, tmp_path / "ckpt", opt)
    assert train(pipe, opt, range(2, 4)) == want
    for name, p in ref.stage_modules[0].named_parameters():
        assert torch.equal(pipe.stage_modules[0].get_parameter(name), p), name


def test_a_tensor_learning_rate_resumes(tmp_path: Path) -> None:
    """``Adam(lr=torch.tensor(...))`` (torch takes a tensor lr, for capturable and fused steps): the
    checkpoint keeps it as a tensor entry, which the load asked for as a Python value, and DCP
    refused ("expected BytesStorageMetadata"). Now it loads, into the group's own lr tensor (an LR
    scheduler updates that one in place), and the resumed run with StepLR is the uninterrupted
    run bit for bit (same process, same operations)."""
    from zbpp.runtime import save_checkpoint

    def run(seed: int, lr: float, steps: range, save: Path | None = None, load: Path | None = None) -> torch.nn.Module:
        net = whole_model(seed=seed)
        opt = torch.optim.Adam(net.parameters(), lr=torch.tensor(lr))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        lr_tensor = opt.param_groups[0]["lr"]
        if load is not None:
            load_checkpoint(net, load, opt, lr_scheduler=sched)
            # halved twice; rel 1e-6: the lr tensor is float32
            assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == pytest.approx(0.05 * 0.5 ** 2, rel=1e-6)
        for step in steps:
            opt.zero_grad()
            x, y = batch(step)
            loss_fn(net(x), y).backward()
            opt.step()
            sched.step()
            if save is not None and step == 1:
                save_checkpoint(net, save, opt, lr_scheduler=sched)
        return net

    ref = run(0, 0.05, range(4), save=tmp_path / "ckpt")
    got = run(7, 1.0, range(2, 4), load=tmp_path / "ckpt")
    for name, p in ref.named_parameters():
        assert torch.equal(got.get_parameter(name), p), name


def test_a_float16_run_resumes_with_its_grad_scaler(tmp_path: Path) -> None:
    """``torch.amp.GradScaler`` keeps the loss scale and a growth tracker: save_checkpoint did not
    save them, so a float16 run resumed from ``init_scale`` and skipped (and scaled) other steps
    than the uninterrupted run. ``grad_scaler=`` saves and loads them. A float32 model under CPU
    float16 autocast, ``init_scale=2**19``: its gradients overflow at some scales, so the scaler
    both backs off and grows (saved after step 2 with a tracker of 1). Reference: the uninterrupted
    run in the same process, same operations, so bit for bit (scales and parameters)."""
    from zbpp.runtime import save_checkpoint

    def run(seed: int, steps: range, save: Path | None = None, load: Path | None = None):
        net = whole_model(seed=seed).float()
        opt = torch.optim.AdamW(net.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 19, growth_interval=2)
        if load is not None:
            load_checkpoint(net, load, opt, grad_scaler=scaler)
        scales = []
        for step in steps:
            opt.zero_grad()
            x, y = batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(net(x.float()), y.float())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            if save is not None and step == 2:
                save_checkpoint(net, save, opt, grad_scaler=scaler)
        return net, scales

    ref, ref_scales = run(0, range(6), save=tmp_path / "ckpt")
    assert len(set(ref_scales)) > 1  # the scale moved: else the test would not see a lost one
    got, got_scales = run(7, range(3, 6), load=tmp_path / "ckpt")
    assert got_scales == ref_scales[3:]
    for name, p in ref.named_parameters():
        assert torch.equal(got.get_parameter(name), p), name

    # refused before anything loads: a disabled scaler's empty state, none saved
    save_checkpoint(whole_model().float(), tmp_path / "off", grad_scaler=torch.amp.GradScaler("cpu", enabled=False))
    save_checkpoint(whole_model().float(), tmp_path / "none")
    net = whole_model(seed=7).float()
    before = {n: t.clone() for n, t in net.state_dict().items()}
    with pytest.raises(ValueError, match="holds the state of a disabled GradScaler"):
        load_checkpoint(net, tmp_path / "off", grad_scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"holds no GradScaler state \(saved without grad_scaler=\)"):
        load_checkpoint(net, tmp_path / "none", grad_scaler=torch.amp.GradScaler("cpu"))
    assert [n for n, t in net.state_dict().items() if not torch.equal(t, before[n])] == []


def _unpickle_damaged(why: str) -> "_Damaged":
    if _Damaged.broken:
        raise pickle.UnpicklingError(why)
    return _Damaged()


class _Damaged:
    """Pickles; its unpickling raises once `broken` (after the save, which unpickles to compare the
    ranks' states): a damaged entry."""

    broken = False

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _unpickle_damaged, ("damaged on disk",)


class _Saves:
    """Anything with ``state_dict()``, as save_checkpoint takes for lr_scheduler= and grad_scaler=."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state


class _Trainer:
    """Holds a lock, so a scheduler built over its bound method cannot be deep-copied (a trial
    copy of it used to be skipped)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def lr_at(self, epoch: int) -> float:
        return 0.5 ** epoch


class _Warmup:
    """A callable lr_lambda: LambdaLR saves its ``__dict__`` and loads it back by position."""

    def __init__(self) -> None:
        self.steps = 3

    def __call__(self, epoch: int) -> float:
        return min(1.0, (epoch + 1) / self.steps)


def _save_without_kinds(net: torch.nn.Module, path: Path, opt: torch.optim.Optimizer, **kept: Any) -> None:
    """A checkpoint as saved before the schedulers' and scalers' classes were recorded."""
    import torch.distributed.checkpoint as dcp

    from zbpp.runtime import checkpoint

    state = checkpoint._state_to_save(net, opt, kept.get("lr_scheduler"), kept.get("grad_scaler"))
    for what in ("lr_scheduler", "grad_scaler"):
        state.get(what, {}).pop("kind", None)
        state.get(what, {}).pop("lineage", None)
    with checkpoint._one_process_quiet(alone=True):
        dcp.save(state, checkpoint_id=path, no_dist=True)


_KINDS = "torch.optim.lr_scheduler."
_STEP_KEYS = "lacks 'T_max', 'eta_min' and has 'step_size', 'gamma' besides"


@pytest.mark.parametrize("what, saved_as, given, words", [
    ("lr_scheduler", "damaged", "LambdaLR", "does not unpickle (UnpicklingError: damaged on disk)"),
    ("lr_scheduler", "StepLR", "LambdaLR",
     f"was saved from a {_KINDS}StepLR, the given lr_scheduler is a {_KINDS}LambdaLR"),
    ("lr_scheduler", "StepLR", "CosineAnnealingLR",
     f"was saved from a {_KINDS}StepLR, the given lr_scheduler is a {_KINDS}CosineAnnealingLR"),
    ("lr_scheduler", "old StepLR", "CosineAnnealingLR",
     f"{_STEP_KEYS}, unlike the given lr_scheduler's state_dict() ({_KINDS}CosineAnnealingLR)"),
    ("lr_scheduler", "StepLR", "uncopyable LambdaLR",
     f"was saved from a {_KINDS}StepLR, the given lr_scheduler is a {_KINDS}LambdaLR"),
    ("lr_scheduler", "LambdaLR of 2 groups", "uncopyable LambdaLR",
     "does not load into the given lr_scheduler (LambdaLR; IndexError: list index out of range)"),
    ("grad_scaler", "partial", "GradScaler",
     f"was saved from a {__name__}._Saves, the given grad_scaler is a torch.amp.grad_scaler.GradScaler"),
    ("grad_scaler", "old partial", "GradScaler",
     "lacks 'growth_factor', 'backoff_factor', 'growth_interval', '_growth_tracker', unlike the given "
     "grad_scaler's state_dict() (torch.amp.grad_scaler.GradScaler)")],
    ids=["damaged-scheduler", "scheduler-of-another-kind", "StepLR-for-CosineAnnealingLR",
         "StepLR-for-CosineAnnealingLR-saved-without-its-class", "another-kind-for-an-uncopyable-scheduler",
         "bad-state-for-an-uncopyable-scheduler", "scaler-state-of-another-class", "scaler-state-lacking-keys"])
def test_a_bad_scheduler_or_scaler_entry_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str,
                                                         saved_as: str, given: str, words: str) -> None:
    """The LR scheduler's and the GradScaler's states were unpickled and loaded last, after the model
    and the optimizer: an entry that does not unpickle, a StepLR's loaded into a LambdaLR, or a
    scaler state lacking a key left the model and optimizer loaded and the scheduler (or half the
    scaler: its scale) not. Now both are unpickled, checked and tried on copies before anything
    loads: the error names the entry, and the model, the optimizer, the scheduler and the scaler
    equal their state before the load (``torch.equal``, ``==``: nothing was to change).

    A StepLR's state for a CosineAnnealingLR loaded without a word (torch's load updates
    ``__dict__``): refused now, by the class recorded at save, or for a checkpoint saved without
    it by the keys the CosineAnnealingLR's own ``state_dict()`` has. A scheduler that cannot be
    deep-copied (over a bound method of an object holding a lock) skipped the trial, so a state
    that its load refuses (LambdaLR's callable lr_lambdas of 2 groups, for 1) raised only after the
    model and the optimizer were loaded; its trial now runs on a copy that shares the method."""
    from zbpp.runtime import save_checkpoint

    net = whole_model()
    opt = make_optimizer(net.parameters())
    _train(net, opt, range(1))
    two_groups = torch.optim.SGD([{"params": [net.layers["0"].weight]}, {"params": [net.layers["0"].bias]}], lr=0.1)
    saved = {"damaged": _Saves({"last_epoch": _Damaged()}), "partial": _Saves({"scale": 2.0 ** 10}),
             "StepLR": torch.optim.lr_scheduler.StepLR(opt, step_size=2),
             "LambdaLR of 2 groups": torch.optim.lr_scheduler.LambdaLR(two_groups, [_Warmup(), _Warmup()])}
    saved["old StepLR"], saved["old partial"] = saved["StepLR"], saved["partial"]
    if saved_as.startswith("old "):
        _save_without_kinds(net, tmp_path / "c", opt, **{what: saved[saved_as]})
    else:
        save_checkpoint(net, tmp_path / "c", opt, **{what: saved[saved_as]})
    monkeypatch.setattr(_Damaged, "broken", True)

    net = whole_model(seed=7)
    opt = make_optimizer(net.parameters())
    sched = {"LambdaLR": lambda: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5 ** epoch),
             "uncopyable LambdaLR": lambda: torch.optim.lr_scheduler.LambdaLR(opt, _Trainer().lr_at),
             "CosineAnnealingLR": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
             "GradScaler": lambda: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5 ** epoch)}[given]()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    scaler.scale(torch.ones(()))  # a live scale tensor, which a half load fills
    _train(net, opt, range(7, 8))
    sched.step()

    def snapshot() -> dict[str, Any]:
        return {"model": {k: v.clone() for k, v in net.state_dict().items()},
                "optimizer": {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in net.named_parameters()},
                "lr": [g["lr"] for g in opt.param_groups], "lr_scheduler": sched.state_dict(),
                "grad_scaler": scaler.state_dict()}

    before = snapshot()
    with pytest.raises(ValueError, match=re.escape(f"the checkpoint {str(tmp_path / 'c')!r}: its {what!r} entry {words}")):
        load_checkpoint(net, tmp_path / "c", opt, **{what: {"lr_scheduler": sched, "grad_scaler": scaler}[what]})
    after = snapshot()
    for name, value in before["model"].items():
        assert torch.equal(after["model"][name], value), name
    for name, state in before["optimizer"].items():
        assert after["optimizer"][name].keys() == state.keys(), name
        for field, value in state.items():
            assert torch.equal(after["optimizer"][name][field], value), (name, field)
    assert [after[k] == before[k] for k in ("lr", "lr_scheduler", "grad_scaler")] == [True] * 3, (before, after)


def _scheduler(kind: str, opt: torch.optim.Optimizer, swapped: bool = False) -> Any:
    """A scheduler of `kind` over `opt`; `swapped`: its parts in the other order (or another kind)."""
    s = torch.optim.lr_scheduler
    if kind in ("SequentialLR", "ChainedScheduler"):
        parts = [s.LinearLR(opt, start_factor=0.5, total_iters=2), s.ExponentialLR(opt, gamma=0.9)]
        parts = parts[::-1] if swapped else parts
        return s.SequentialLR(opt, parts, milestones=[2]) if kind == "SequentialLR" else s.ChainedScheduler(parts, opt)
    if kind == "uncopyable LambdaLR":
        return s.LambdaLR(opt, [_Warmup()] if swapped else _Trainer().lr_at)
    return s.CosineAnnealingLR(opt, T_max=4) if swapped else s.OneCycleLR(opt, max_lr=0.1, total_steps=8)


@pytest.mark.parametrize("kind", ["SequentialLR", "ChainedScheduler", "uncopyable LambdaLR", "OneCycleLR"])
def test_schedulers_resume_and_another_composition_is_refused(tmp_path: Path, kind: str) -> None:
    """SequentialLR, ChainedScheduler, LambdaLR (over a bound method of an object holding a lock:
    no deep copy) and OneCycleLR resume as the uninterrupted run (saved after 3 of 6 steps: the
    learning rates of the last 3 and the final ``state_dict()`` equal its own, ``==``: same
    operations in one process). A SequentialLR's or ChainedScheduler's state loaded into one of
    its parts in the other order without a word (torch loads them by position): refused now,
    naming both compositions, as another kind is (a OneCycleLR's state for a CosineAnnealingLR; a
    LambdaLR's over a function for one over a callable object, which its load fills from
    ``__dict__``, is checked by its trial and loads)."""
    from zbpp.runtime import save_checkpoint

    def run(steps: range, save: Path | None = None, load: Path | None = None, swapped: bool = False):
        torch.manual_seed(0)
        net = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1 if load is None else 1.0)
        sched = _scheduler(kind, opt, swapped)
        if load is not None:
            load_checkpoint(net, load, opt, lr_scheduler=sched)
        lrs = []
        for step in steps:
            opt.step()
            sched.step()
            lrs.append((opt.param_groups[0]["lr"], sched.get_last_lr()))
            if save is not None and step == 2:
                save_checkpoint(net, save, opt, lr_scheduler=sched)
        return lrs, sched.state_dict()

    ref_lrs, ref_state = run(range(6), save=tmp_path / "c")
    lrs, state = run(range(3, 6), load=tmp_path / "c")
    assert lrs == ref_lrs[3:]
    assert state == ref_state
    if kind == "uncopyable LambdaLR":
        run(range(0), load=tmp_path / "c", swapped=True)  # same kind, same keys: loads
        return
    want = {"SequentialLR": f"{_KINDS}SequentialLR({_KINDS}LinearLR, {_KINDS}ExponentialLR), the given lr_scheduler "
                            f"is a {_KINDS}SequentialLR({_KINDS}ExponentialLR, {_KINDS}LinearLR)",
            "ChainedScheduler": f"{_KINDS}ChainedScheduler({_KINDS}LinearLR, {_KINDS}ExponentialLR), the given "
                                f"lr_scheduler is a {_KINDS}ChainedScheduler({_KINDS}ExponentialLR, {_KINDS}LinearLR)",
            "OneCycleLR": f"{_KINDS}OneCycleLR, the given lr_scheduler is a {_KINDS}CosineAnnealingLR"}[kind]
    with pytest.raises(ValueError, match=re.escape(f"its 'lr_scheduler' entry was saved from a {want}")):
        run(range(0), load=tmp_path / "c", swapped=True)


def _lrs_after_resume(path: Path, make: Any, resume: Any = None, old: bool = False) -> tuple[list[Any], list[Any]]:
    """The learning rates of the last 3 of 6 steps of SGD under the scheduler ``make(opt)``, saved
    after 3 into `path` (as saved before classes were recorded, if `old`), and those of 3 steps
    resumed from `path` into ``resume(opt)`` (default `make`; ``load_checkpoint`` raises there if
    it refuses)."""
    from zbpp.runtime import save_checkpoint

    def run(steps: range, save: bool) -> list[Any]:
        torch.manual_seed(0)
        net = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1 if save else 1.0)
        sched = make(opt) if save else (resume or make)(opt)
        if not save:
            load_checkpoint(net, path, opt, lr_scheduler=sched)
        lrs = []
        for step in steps:
            opt.step()
            sched.step()
            lrs.append((opt.param_groups[0]["lr"], sched.get_last_lr()))
            if save and step == 2:
                (_save_without_kinds if old else save_checkpoint)(net, path, opt, lr_scheduler=sched)
        return lrs

    return run(range(6), True)[3:], run(range(3, 6), False)


def _parts(kind: str, opt: torch.optim.Optimizer, parts: list[Any]) -> Any:
    s = torch.optim.lr_scheduler
    if kind == "ChainedScheduler":
        return s.ChainedScheduler(parts, opt)
    return s.SequentialLR(opt, parts, milestones=list(range(2, 1 + len(parts))))  # one fewer than parts


@pytest.mark.parametrize("kind", ["SequentialLR", "ChainedScheduler"])
def test_a_composition_saved_before_kinds_were_recorded_is_checked_part_by_part(tmp_path: Path, kind: str) -> None:
    """A checkpoint saved before the schedulers' classes were recorded is checked by the keys of
    the saved state: only its top-level ones were, and a SequentialLR's or ChainedScheduler's are
    alike whatever its parts (``_schedulers``, a list that torch loads into the parts by position,
    unchecked). Its state loaded into one with its parts in the other order (a LinearLR's state into
    an ExponentialLR, which took it into its ``__dict__``), or with a third part (left fresh),
    without a word. Now each part's keys and their number are checked too, naming the part; the
    same composition still resumes as the uninterrupted run (the learning rates, ``==``: the same
    operations in one process)."""
    s = torch.optim.lr_scheduler

    def linear_exp(opt: torch.optim.Optimizer, order: int = 1, more: bool = False) -> Any:
        parts = [s.LinearLR(opt, start_factor=0.5, total_iters=2), s.ExponentialLR(opt, gamma=0.9)][::order]
        return _parts(kind, opt, parts + ([s.ExponentialLR(opt, gamma=0.5)] if more else []))

    want, got = _lrs_after_resume(tmp_path / "c", linear_exp, old=True)
    assert got == want
    given = f"unlike the given lr_scheduler's state_dict() ({_KINDS}{kind}({_KINDS}"
    with pytest.raises(ValueError, match=re.escape(
            "its 'lr_scheduler' entry at _schedulers[0] lacks 'gamma' and has 'start_factor', 'end_factor', "
            f"'total_iters' besides, {given}ExponentialLR, {_KINDS}LinearLR)): saved from another kind?")):
        _lrs_after_resume(tmp_path / "c", linear_exp, lambda opt: linear_exp(opt, order=-1), old=True)
    with pytest.raises(ValueError, match=re.escape(
            f"its 'lr_scheduler' entry holds 2 schedulers in _schedulers, not 3, {given}LinearLR, ")):
        _lrs_after_resume(tmp_path / "c", linear_exp, lambda opt: linear_exp(opt, more=True), old=True)


class _LoggedStepLR(torch.optim.lr_scheduler.StepLR):
    """A StepLR that adds a method, no state: its state_dict() is a StepLR's."""

    def lr_now(self) -> float:
        return self.get_last_lr()[0]


class _WarmStepLR(torch.optim.lr_scheduler.StepLR):
    """A StepLR with one more attribute, so one more entry in its state_dict()."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.warmup = 2
        super().__init__(*args, **kwargs)


class _LoggedScaler(torch.amp.GradScaler):
    """A GradScaler that adds a method, no state."""

    def scale_now(self) -> float:
        return self.get_scale()


def test_a_subclass_state_loads_into_its_base_where_none_is_left_out(tmp_path: Path) -> None:
    """The class of a scheduler (or scaler) recorded at save had to be the given one's: a subclass
    that adds nothing to the state (a method) did not load into its base class, nor the base
    class's state into it. Now a class derived from the other, either way (recorded at save with
    its bases: `_lineage`), loads where their state_dict() keys are the same (a SequentialLR's
    parts', too), and resumes as the uninterrupted run (learning rates ``==``; the scaler's
    state_dict() ``==`` the saved one); a subclass with one more attribute in its state is still
    refused either way (its value would be lost, or not restored), naming it, and nothing loads."""
    from zbpp.runtime import save_checkpoint

    s = torch.optim.lr_scheduler
    for saved, given in [(_LoggedStepLR, s.StepLR), (s.StepLR, _LoggedStepLR)]:
        want, got = _lrs_after_resume(tmp_path / "c", lambda opt: saved(opt, step_size=2, gamma=0.5),
                                      lambda opt: given(opt, step_size=2, gamma=0.5))
        assert got == want, (saved, given)
    for saved, given in [(_LoggedStepLR, s.StepLR), (s.StepLR, _LoggedStepLR)]:  # as a SequentialLR's part
        def sequential(opt: torch.optim.Optimizer, step_lr: type) -> Any:
            return _parts("SequentialLR", opt, [step_lr(opt, step_size=2, gamma=0.5), s.ExponentialLR(opt, gamma=0.9)])

        want, got = _lrs_after_resume(tmp_path / "c", lambda opt: sequential(opt, saved),
                                      lambda opt: sequential(opt, given))
        assert got == want, (saved, given)

    net = torch.nn.Linear(2, 1)
    scaler = _LoggedScaler("cpu", init_scale=2.0 ** 4, growth_interval=3)
    scaler.scale(torch.ones(()))
    scaler.update(2.0 ** 3)
    save_checkpoint(net, tmp_path / "scaler", grad_scaler=scaler)
    base = torch.amp.GradScaler("cpu")
    load_checkpoint(net, tmp_path / "scaler", grad_scaler=base)
    assert base.state_dict() == scaler.state_dict()

    for saved, given, words in [(_WarmStepLR, s.StepLR, "has 'warmup' besides"),
                                (s.StepLR, _WarmStepLR, "lacks 'warmup'")]:
        _lrs_after_resume(tmp_path / "c", lambda opt: saved(opt, step_size=2))
        opt = torch.optim.SGD(net.parameters(), lr=1.0)
        sched = given(opt, step_size=2)
        before = sched.state_dict()
        saved_kind, given_kind = (f"{c.__module__}.{c.__qualname__}" for c in (saved, given))
        with pytest.raises(ValueError, match=re.escape(
                f"its 'lr_scheduler' entry, saved from a {saved_kind}, {words}, unlike the given lr_scheduler's "
                f"state_dict() ({given_kind}, of a class related to it)")):
            load_checkpoint(net, tmp_path / "c", opt, lr_scheduler=sched)
        assert sched.state_dict() == before and opt.param_groups[0]["lr"] == 1.0


def test_an_untied_checkpoint_into_one_tied_parameter_is_refused(tmp_path: Path) -> None:
    """Two stages of one rank sharing a tied Parameter (a V placement's first and last stage) load
    it under both its names: from a checkpoint whose values there differ (saved from a model
    without the tie) the last name's won without a word, so the embedding's saved weight was lost
    (and a layout holding the tie as copies on two ranks took both: the layouts trained apart).
    Now the load refuses, naming both entries, and nothing changes (``torch.equal``); a checkpoint
    of the tied stages loads (their values, ``torch.equal``). Copies on several ranks: `resume_cases`."""
    from zbpp.runtime import save_checkpoint

    def tied_stages(seed: int) -> dict[int, torch.nn.Module]:
        torch.manual_seed(seed)
        first, last = torch.nn.Module(), torch.nn.Module()
        first.emb, last.head = torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False)
        last.head.weight = first.emb.weight
        return {0: first, 1: last}

    untied = torch.nn.Module()
    untied.emb, untied.head = torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False)
    save_checkpoint(untied, tmp_path / "untied")
    stages = tied_stages(1)
    before = stages[0].emb.weight.detach().clone()
    with pytest.raises(ValueError, match=re.escape(
            f"the checkpoint {str(tmp_path / 'untied')!r} holds different values under 'emb.weight' and 'head.weight', "
            "which are one tied parameter in this rank's stages: saved from a model without this tie?")):
        load_checkpoint(stages, tmp_path / "untied")
    assert torch.equal(stages[0].emb.weight, before)

    save_checkpoint(tied_stages(2), tmp_path / "tied")
    load_checkpoint(stages, tmp_path / "tied")
    assert torch.equal(stages[1].head.weight, tied_stages(2)[0].emb.weight)


def test_an_optimizer_over_named_parameters_resumes_at_another_layout(tmp_path: Path) -> None:
    """``AdamW(stage.named_parameters())`` keeps the group's ``param_names``, which the checkpoint
    saved as a hyperparameter of each parameter: saved as two stages with a group each (two ranks'
    optimizers) and loaded as one module with one group, the load refused ("saved with different
    'param_names'"); loaded as one stage, the group got the other layout's list. Now
    ``param_names`` stays the new optimizer's, and 2 more steps equal the uninterrupted run of
    the whole model (the same operations in one process: bit for bit)."""
    from zbpp.runtime import save_checkpoint

    def train(forward: Any, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            opt.zero_grad()
            x, y = batch(step)
            loss_fn(forward(x), y).backward()
            opt.step()

    stages = {s: stage_of(whole_model(), s, 2) for s in (0, 1)}
    opt = make_optimizer([{"params": list(m.named_parameters())} for m in stages.values()])
    train(lambda x: stages[1](stages[0](x)), opt, range(2))
    save_checkpoint(stages, tmp_path / "ckpt", opt)

    ref = whole_model()
    ref_opt = make_optimizer(ref.named_parameters())
    train(ref, ref_opt, range(4))
    net = whole_model(seed=4)
    net_opt = make_optimizer(net.named_parameters())
    load_checkpoint(net, tmp_path / "ckpt", net_opt)
    assert net_opt.param_groups[0]["param_names"] == [n for n, _ in net.named_parameters()]
    train(net, net_opt, range(2, 4))
    for name, p in ref.named_parameters():
        assert torch.equal(net.get_parameter(name), p), name

    save_checkpoint(ref, tmp_path / "whole", ref_opt)  # one group of every parameter
    half = stage_of(whole_model(seed=4), 1, 2)
    half_opt = make_optimizer(half.named_parameters())
    load_checkpoint(half, tmp_path / "whole", half_opt)
    assert half_opt.param_groups[0]["param_names"] == [n for n, _ in half.named_parameters()]


def _hf_groups(net: torch.nn.Module, grouping: str, resumed: bool = False) -> list[dict[str, Any]]:
    """Param groups as HF training scripts build them, over the blocks `net` holds: "decay": weights
    decayed at lr 0.1, biases not at lr 0.02; "layerwise": one group per block, lr 0.1 * 0.5 per
    block down from the last (layer-wise decay). `resumed`: as a resumed stage may build them, lr
    1.0 (the checkpoint's win) and in the other order; "layerwise" where `net` holds block 3, one
    group per block of the whole model (empty for the blocks it does not hold)."""
    named = list(net.named_parameters())
    if grouping == "decay":
        groups = [{"params": [p for n, p in named if n.endswith(end)], "lr": lr, "weight_decay": wd}
                  for end, lr, wd in (("weight", 0.1, 0.1), ("bias", 0.02, 0.0))]
    else:
        every = resumed and "3" in net.layers
        groups = [{"params": [p for n, p in named if n.startswith(f"layers.{i}.")], "lr": 0.1 * 0.5 ** (3 - i),
                   "weight_decay": 0.01} for i in range(4) if every or str(i) in net.layers]
    return [dict(g, lr=1.0) for g in groups[::-1]] if resumed else groups


@pytest.mark.parametrize("grouping", ["decay", "layerwise"])
def test_each_group_keeps_its_scheduled_lr_at_another_layout(tmp_path: Path, grouping: str) -> None:
    """AdamW over HF-style groups (`_hf_groups`) with a LambdaLR (HF's warmup and decay schedules
    are LambdaLRs: lr = base_lrs[i] * f(step)), saved from the whole model in one process after 2
    steps and resumed as the two stages of pp=2 (each with its own optimizer and scheduler, as its
    rank may build them, `_hf_groups`' `resumed`): the groups in the other order; "layerwise" on
    stage 0 with two groups, on stage 1 with four (two empty). The scheduler's ``base_lrs`` are
    kept by group position, so the biases went on with the weights' lr and the other way, and a
    block with another block's (silently), and stage 0's next ``scheduler.step()`` failed (four
    base_lrs for two groups). Now base_lrs and _last_lr come from the loaded
    groups: 2 more steps give every group the lr of the uninterrupted whole-model run and every
    parameter its value (rtol 1e-9: the same float64 operations; a swapped lr is 5x off)."""
    from zbpp.runtime import save_checkpoint

    def schedule(groups: list[dict[str, Any]]) -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.AdamW(groups)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.8 ** step)

    def train(forward: Any, opts: list[tuple[torch.optim.Optimizer, Any]], steps: range) -> None:
        for step in steps:
            for opt, _ in opts:
                opt.zero_grad()
            x, y = batch(step)
            loss_fn(forward(x), y).backward()
            for opt, sched in opts:
                opt.step()
                sched.step()

    ref = whole_model()
    ref_opt, ref_sched = schedule(_hf_groups(ref, grouping))
    train(ref, [(ref_opt, ref_sched)], range(2))
    save_checkpoint(ref, tmp_path / "ckpt", ref_opt, lr_scheduler=ref_sched)
    train(ref, [(ref_opt, ref_sched)], range(2, 4))

    stages = {s: stage_of(whole_model(seed=4), s, 2) for s in (0, 1)}
    opts = [schedule(_hf_groups(stages[s], grouping, resumed=True)) for s in (0, 1)]
    for s, (opt, sched) in zip((0, 1), opts):
        load_checkpoint({s: stages[s]}, tmp_path / "ckpt", opt, lr_scheduler=sched)
    train(lambda x: stages[1](stages[0](x)), opts, range(2, 4))
    lr_of = {id(p): g["lr"] for g in ref_opt.param_groups for p in g["params"]}
    names = {id(p): n for n, p in ref.named_parameters()}
    for s, (opt, sched) in zip((0, 1), opts):
        for group, last in zip(opt.param_groups, sched.get_last_lr()):
            for p in group["params"]:
                name = next(n for n, q in stages[s].named_parameters() if q is p)
                want = lr_of[id(ref.get_parameter(name))]
                assert group["lr"] == pytest.approx(want, rel=1e-12) and last == group["lr"], (name, group["lr"], want)
    got = {n: p for m in stages.values() for n, p in m.named_parameters()}
    fails = compare("resumed param", got, dict(ref.named_parameters()))
    assert not fails and len(got) == len(names), "\n".join(fails)


def test_per_group_lambdas_of_other_groups_are_refused(tmp_path: Path) -> None:
    """A LambdaLR whose groups have their own callable lr_lambdas (saved by position: their
    ``__dict__``), loaded into an optimizer of the same groups in the other order: the lambdas'
    states went to the other group without a word. They cannot be matched to the new groups, so
    the load raises, naming them, and nothing is loaded."""
    from zbpp.runtime import save_checkpoint

    def schedule(net: torch.nn.Module, reverse: bool) -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.AdamW(_hf_groups(net, "decay")[::-1] if reverse else _hf_groups(net, "decay"))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, [_Warmup(), _Warmup()])

    net = whole_model()
    opt, sched = schedule(net, False)
    sched.lr_lambdas[1].steps = 7  # the biases warm up longer
    save_checkpoint(net, tmp_path / "ckpt", opt, lr_scheduler=sched)
    fresh = whole_model(seed=3)
    before = {n: t.clone() for n, t in fresh.state_dict().items()}
    opt, sched = schedule(fresh, True)
    with pytest.raises(ValueError, match=r"its 'lr_scheduler' entry holds lr_lambdas \[\{'steps': 3\}, \{'steps': 7\}\], "
                                         r"one per param group by position, of groups other than this optimizer's "
                                         r"\(its base_lrs \[0\.1, 0\.02\], the groups' initial_lr as loaded "
                                         r"\[0\.02, 0\.1\]\)"):
        load_checkpoint(fresh, tmp_path / "ckpt", opt, lr_scheduler=sched)
    assert [n for n, t in fresh.state_dict().items() if not torch.equal(t, before[n])] == []
    assert [f.steps for f in sched.lr_lambdas] == [3, 3] and sched.base_lrs == [0.02, 0.1]


@pytest.mark.parametrize("min_lrs", [[1e-3, 1e-5], [1e-4, 1e-4]])
def test_plateau_min_lrs_follow_their_groups_or_are_refused(tmp_path: Path, min_lrs: list[float]) -> None:
    """ReduceLROnPlateau keeps no base_lrs, and its per-group ``min_lrs`` by position: loaded into the
    same groups in the other order (`_hf_groups` "decay"), the weights took the biases' floor and the
    other way, without a word. Its ``_last_lr`` against the loaded groups' lr shows the order: floors
    that differ between groups are refused, naming them, nothing loaded; equal ones load, each group
    keeping its own lr (torch's own load of the same state into the groups in the saved order is
    the reference)."""
    from zbpp.runtime import save_checkpoint

    def schedule(net: torch.nn.Module, reverse: bool) -> tuple[torch.optim.Optimizer, Any]:
        groups, floors = _hf_groups(net, "decay"), list(min_lrs)
        opt = torch.optim.SGD(groups[::-1] if reverse else groups)
        return opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt, min_lr=floors[::-1] if reverse else floors)

    net = whole_model()
    opt, sched = schedule(net, False)
    sched.step(1.0)
    save_checkpoint(net, tmp_path / "ckpt", opt, lr_scheduler=sched)
    fresh = whole_model(seed=3)
    before = {n: t.clone() for n, t in fresh.state_dict().items()}
    opt, sched = schedule(fresh, True)
    if min_lrs[0] != min_lrs[1]:
        with pytest.raises(ValueError, match=r"its 'lr_scheduler' entry holds min_lrs \[0\.001, 1e-05\], one per param "
                                             r"group by position, of groups other than this optimizer's \(its _last_lr "
                                             r"\[0\.1, 0\.02\], the groups' lr as loaded \[0\.02, 0\.1\]\)"):
            load_checkpoint(fresh, tmp_path / "ckpt", opt, lr_scheduler=sched)
        assert [n for n, t in fresh.state_dict().items() if not torch.equal(t, before[n])] == []
        assert sched.min_lrs == min_lrs[::-1]
        return
    load_checkpoint(fresh, tmp_path / "ckpt", opt, lr_scheduler=sched)
    assert sched.min_lrs == min_lrs and sched.get_last_lr() == [g["lr"] for g in opt.param_groups] == [0.02, 0.1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["fused", "capturable"])
def test_a_fused_or_capturable_adamw_resumes_on_the_gpu(tmp_path: Path, kind: str) -> None:
    """AdamW(fused=True) or (capturable=True) keeps ``step`` on the parameter's device; the load read
    it to the CPU, and the next step raised ("state_steps is on cpu, different from other tensors
    on cuda:0"; "If capturable=True, params and state_steps must be on supported devices"). Now it
    is on the parameter's device, float32 (as ``Optimizer.load_state_dict`` puts it), and 2 more
    steps equal the uninterrupted run's bit for bit (same GPU, same kernels)."""
    from zbpp.runtime import save_checkpoint

    def run(seed: int, steps: range, save: Path | None = None, load: Path | None = None) -> torch.nn.Module:
        net = whole_model(seed=seed).cuda()
        opt = torch.optim.AdamW(net.parameters(), lr=0.05, **{kind: True})
        if load is not None:
            load_checkpoint(net, load, opt)
            assert {(s["step"].device.type, s["step"].dtype) for s in opt.state.values()} == {("cuda", torch.float32)}
        for step in steps:
            opt.zero_grad()
            x, y = batch(step, "cuda")
            loss_fn(net(x), y).backward()
            opt.step()
            if save is not None and step == 1:
                save_checkpoint(net, save, opt)
        return net

    ref = run(0, range(4), save=tmp_path / "ckpt")
    got = run(7, range(2, 4), load=tmp_path / "ckpt")
    for name, p in ref.named_parameters():
        assert torch.equal(got.get_parameter(name), p), name


@pytest.mark.parametrize("other", ["more blocks", "wider"])
def test_a_checkpoint_of_another_model_is_refused_naming_the_entry(tmp_path: Path, other: str) -> None:
    """`Net` (4 blocks of width 4) saved, loaded into one of 5 blocks or of width 5: DCP's error was a
    ``CheckpointException``, no ``Exception`` (``except Exception`` let it by), around a traceback.
    Now a ValueError names the entry (and both shapes), and nothing was loaded."""
    from torch import nn

    from zbpp.runtime import save_checkpoint

    from . import fsdp_cases

    save_checkpoint(whole_model(), tmp_path / "ckpt")
    if other == "more blocks":
        net = Net(blocks=5)
        words = r"holds no 'layers\.4\.weight' \(nor 1 more entry of this rank's stages\)"
    else:
        net = whole_model()
        net.layers["2"] = nn.Linear(fsdp_cases.H, 5, dtype=torch.float64)
        words = r"holds 'layers\.2\.weight' of shape \(4, 4\), this rank's of shape \(5, 4\)"
    before = {n: t.clone() for n, t in net.state_dict().items()}
    with pytest.raises(ValueError, match=words):
        load_checkpoint(net, tmp_path / "ckpt")
    assert [n for n, t in net.state_dict().items() if not torch.equal(t, before[n])] == []
