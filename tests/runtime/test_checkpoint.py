"""Checkpoints load into another layout: saved at pp=2 zb-v (2 gloo ranks, dp=1) after 2 AdamW
steps; loaded at pp=4 1f1b, at dp=2 x pp=2 with fully_shard stages under zb-h1 (4 ranks), and in
one process (`load_checkpoint` on the whole model, and DCP's one-file conversion read by
``nn.Module.load_state_dict``). The loaded parameters equal the one-process reference after 2
steps and 3 more steps equal its 5 steps (the optimizer state came back). Cases and tolerances:
`fsdp_cases`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zbpp.runtime import load_checkpoint

from .fsdp_cases import (RESUMED, SAVED_AFTER, Net, batch, compare, loss_fn, make_optimizer, reference_run,
                         resume_case, save_case, whole_model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, zbpp_workers) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "zb-v-pp2"
    per_rank = zbpp_workers(2, pg_timeout=60).run(save_case, str(path))
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)
    return path


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["pp4-1f1b", "dp2-pp2-fsdp-zb-h1"])
def test_resume_at_another_layout(saved: Path, zbpp_workers, layout: str) -> None:
    per_rank = zbpp_workers(4, pg_timeout=60).run(resume_case, str(saved), layout)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)


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
