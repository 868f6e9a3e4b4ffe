"""Fault tolerance of examples/train_hf.py: a rank SIGKILLed mid-step under ``torchrun
--max-restarts=1`` (2 gloo CPU ranks, a tiny float64 GPT-2 whose embedding and LM head are tied
across the ranks) is restarted with its peer, resumes by itself from the last checkpoint of
``--checkpoint-dir`` and ends with exactly the parameters and optimizer state of a run that was
never killed (`torch.equal`: the same layout recomputes the same operations in the same order).
The run never killed is the example's `train` on 2 gloo ranks of the shared test pool (one thread
each, as torchrun's ranks under ``OMP_NUM_THREADS=1``; no dropout, so no random stream to match)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .loader import train_example

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY, KILL_STEP, MICROBATCHES = 4, 2, 2, 2  # killed in step 3, after the checkpoint of step 2
ARGS = ["--model", "gpt2", "--schedule", "zb-h1", "--hidden", "16", "--heads", "2", "--layers", "2",
        "--seq-len", "8", "--rows-per-microbatch", "1", "--microbatches", str(MICROBATCHES), "--steps", str(STEPS),
        "--data", "synthetic", "--dtype", "float64", "--backend", "gloo", "--timeout", "60",
        "--checkpoint-every", str(EVERY)]


def _torchrun(script: Path, checkpoints: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """`script` under torchrun, its output to `log` (a file: a pipe nobody reads meanwhile could fill)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           str(script), *ARGS, "--checkpoint-dir", str(checkpoints)]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def _state(checkpoint: Path, into: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, into)
    return torch.load(into, weights_only=False)


@pytest.mark.timeout(600)
def test_sigkilled_rank_restarts_and_ends_where_the_uninterrupted_run_ends(tmp_path: Path, zbpp_workers) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", ZBPP_KILL_RANK="1", ZBPP_KILL_STEP=str(KILL_STEP),
               ZBPP_MICROBATCHES=str(MICROBATCHES))
    killed = _torchrun(Path(__file__).with_name("kill_once.py"), tmp_path / "killed", env, tmp_path / "killed.log")
    try:  # the run never killed, meanwhile
        clean = zbpp_workers(2).run(train_example, "train_hf", [*ARGS, "--checkpoint-dir", str(tmp_path / "clean")])
    finally:
        killed.wait(timeout=500)
    out_killed = (tmp_path / "killed.log").read_text()
    out_clean = "".join(r["stdout"] for r in clean)
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
