"""Multi-node launch: two torchrun agents on 127.0.0.1 (c10d rendezvous, 2 processes each) train
examples/train.py with ZB-H1 on gloo (2 pipeline ranks x 2 replicas) and agree with one process
(its ``--check``: parameters and printed losses)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_agents_on_loopback_train_and_match_one_process():
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    base = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=zbpp-loopback",
            "--max-restarts=0"]
    script = [str(ROOT / "examples" / "train.py"), "--schedule", "zb-h1", "--microbatches", "6", "--steps", "2",
              "--backend", "gloo", "--timeout", "60", "--check", "--dp", "2"]
    # Each agent writes to its own file, not a pipe: an unread pipe fills up (the workers' warnings),
    # blocks that agent's workers, and leaves the other agent waiting in torchrun's exit barrier.
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(2)]
    agents = [
        subprocess.Popen(base + [f"--rdzv-conf=is_host={int(i == 0)}"] + script, cwd=ROOT, env=env,
                         stdout=logs[i], stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    deadline = time.monotonic() + 240
    try:
        for a in agents:
            a.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # reported below, with both agents' output
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    report = "\n".join(f"--- agent {i} (exit {a.returncode}):\n{o[-4000:]}" for i, (a, o) in enumerate(zip(agents, outputs)))
    assert all(a.returncode == 0 for a in agents), report
    text = "".join(outputs)
    assert "pp=2 dp=2 backend=gloo" in text, report
    # the printed loss is the whole batch's (both replicas' shares), as are the parameters
    assert "check: max |param difference| vs one process" in text and "max |loss difference|" in text, report
    assert ": OK" in text, report
    assert text.count("loss") >= 2, report
