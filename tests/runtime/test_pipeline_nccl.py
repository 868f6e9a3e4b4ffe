"""The runtime on NCCL (2 GPUs, pp=2): every schedule against one process, with per-pair and with
eagerly created (shared) communicators; leaks, task times and torchrun. Skipped without 2 GPUs.

NCCL has no tags and may block a send until its receive is posted, so these tests are the real
check of the program's one order of operations (gloo hides ordering bugs). Tolerances: see
`tests.runtime.cases` (CUDA: rtol=1e-4, atol=1e-5).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zbpp.schedules import available
from zbpp.testing import gpus_available

from .cases import (
    SLOW_LINK_NAMES,
    check_cuda_memory,
    check_many_steps,
    check_task_times,
    check_schedule,
    check_slow_link_program,
    standard_cases,
)

pytestmark = [
    pytest.mark.nccl,
    pytest.mark.skipif(not gpus_available(2), reason="needs 2 CUDA GPUs with NCCL"),
]
P = 2
KINDS = ["plain", "zbpp", "mixed"]


@pytest.mark.parametrize("eager", [False, True], ids=["per-pair-comms", "shared-comm"])
@pytest.mark.parametrize("name", available())
def test_schedule_matches_single_process_on_nccl(zbpp_workers, name, eager):
    worst = zbpp_workers(P, backend="nccl", eager_init=eager).run(check_schedule, name, P, KINDS, standard_cases(P))
    assert max(worst) < 1e-2


@pytest.mark.parametrize("name", SLOW_LINK_NAMES[P])
def test_slow_link_program_on_nccl(zbpp_workers, name):
    """A program for a slow link posts receives before their data exists: NCCL must not deadlock on it
    and the step must equal one process."""
    worst = zbpp_workers(P, backend="nccl").run(check_slow_link_program, name, P)
    assert max(worst) < 1e-2


@pytest.mark.parametrize("name", ["zb-h1", "zb-v"])
def test_many_steps_and_no_leaks_on_nccl(zbpp_workers, name):
    workers = zbpp_workers(P, backend="nccl")
    workers.run(check_many_steps, name, P)
    workers.run(check_cuda_memory, name, P)


def test_task_times_with_cuda_events(zbpp_workers):
    recs = zbpp_workers(P, backend="nccl").run(check_task_times, "zb-v", P)
    assert {r["rank"] for r in recs[0]} == {0, 1}


def test_torchrun_example_on_two_gpus():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=0",
                          str(root / "examples" / "train.py"), "--schedule", "zb-v", "--steps", "3", "--check"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    assert "backend=nccl" in text and ": OK" in text, text[-6000:]
