"""Fault tolerance of examples/train_hf.py: a rank SIGKILLed mid-step under ``torchrun
--max-restarts=1`` (2 gloo CPU ranks, a tiny float64 GPT-2 whose embedding and LM head are tied
across the ranks) is restarted with its peer, resumes by itself from the last checkpoint of
``--checkpoint-dir`` and ends with exactly the parameters and optimizer state of a run that was
never killed (`torch.equal`: the same layout recomputes the same operations in the same order)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY, KILL_STEP, MICROBATCHES = 4, 2, 2, 2  # killed in step 3, after the checkpoint of step 2
ARGS = ["--model", "gpt2", "--schedule", "zb-h1", "--hidden", "16", "--heads", "2", "--layers", "2",
        "--seq-len", "8", "--rows-per-microbatch", "1", "--microbatches", str(MICROBATCHES), "--steps", str(STEPS),
        "--data", "synthetic", "--dtype", "float64", "--backend", "gloo", "--timeout", "60",
        "--checkpoint-every", str(EVERY)]


def _torchrun(script: Path, checkpoints: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           str(script), *ARGS, "--checkpoint-dir", str(checkpoints)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def _state(checkpoint: Path, into: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, into)
    return torch.load(into, weights_only=False)


@pytest.mark.timeout(600)
def test_sigkilled_rank_restarts_and_ends_where_the_uninterrupted_run_ends(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", ZBPP_KILL_RANK="1", ZBPP_KILL_STEP=str(KILL_STEP),
               ZBPP_MICROBATCHES=str(MICROBATCHES))
    clean = _torchrun(ROOT / "examples" / "train_hf.py", tmp_path / "clean", env)  # both jobs at once
    killed = _torchrun(Path(__file__).with_name("kill_once.py"), tmp_path / "killed", env)
    out_clean, out_killed = clean.communicate(timeout=500)[0], killed.communicate(timeout=500)[0]
    assert clean.returncode == 0, out_clean[-3000:]
    assert killed.returncode == 0, out_killed[-3000:]
    assert "exitcode: -9" in out_killed, out_killed[-3000:]  # torchrun saw the rank die of SIGKILL
    assert f"resumed from {tmp_path / 'killed' / f'step-{KILL_STEP}'} (step {KILL_STEP})" in out_killed, out_killed[-3000:]
    assert "resumed" not in out_clean

    want = _state(tmp_path / "clean" / f"step-{STEPS}", tmp_path / "clean.pt")
    got = _state(tmp_path / "killed" / f"step-{STEPS}", tmp_path / "killed.pt")
    assert sorted(got["model"]) == sorted(want["model"])
    for name, t in want["model"].items():
        assert torch.equal(got["model"][name], t), name
    for name, entry in want["optimizer"]["state"].items():
        for key, t in entry.items():
            assert torch.equal(got["optimizer"]["state"][name][key], t), (name, key)
