"""How fast the host runs right now: a fixed piece of host work, timed.

On a virtual machine the host's speed can change within seconds (this project's GPU machine: 2x
within a minute). A GPU-bound step (bf16 eager at 2048 tokens a microbatch, any task-graph replay)
does not notice; a host-bound one (FP8 eager, eager steps of small layers) follows it. The
benchmarks time this probe before their timed steps and report it beside the step times, so a
slow row can be told from a slow host.

>>> host_probe_ms() > 0
True
"""

from __future__ import annotations

import time

import torch

__all__ = ["host_probe_ms", "FAST_HOST_MS"]

#: What the probe took on the fastest hosts seen (H100 / H200 machines, torch 2.11).
FAST_HOST_MS = 8.0


def host_probe_ms() -> float:
    """Milliseconds a fixed piece of host work takes now: a Python loop and torch CPU dispatches
    (as a step's host side runs them)."""
    table: dict[int, int] = {}
    one = torch.ones(4)
    start = time.perf_counter()
    for i in range(100_000):
        table[i & 1023] = i
    for _ in range(1_000):
        one.add_(1)
    return (time.perf_counter() - start) * 1e3
