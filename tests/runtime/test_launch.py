"""`init_distributed` with backend nccl where this process has no GPU of its own: torch.cuda.set_device
failed with "Found no NVIDIA driver on your system" (no GPU) or "invalid device ordinal" (more
processes per node than GPUs), neither of which says what to change. Now a RuntimeError names
LOCAL_RANK, the GPUs there are and the way out, before any process group is started."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zbpp.runtime import init_distributed


@pytest.mark.parametrize("gpus, local_rank, words", [
    (0, 0, "backend nccl needs CUDA GPUs, and this machine has none: use backend gloo"),
    (2, 3, "this process has LOCAL_RANK 3 and the machine 2 GPU(s): launch at most 2 processes per node"),
])
def test_nccl_without_a_gpu_for_this_process_is_named(gpus: int, local_rank: int, words: str, monkeypatch) -> None:
    assert not dist.is_initialized()
    for var, value in {"RANK": str(local_rank), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                       "LOCAL_RANK": str(local_rank)}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(RuntimeError, match="init_distributed: ") as err:
        init_distributed("nccl", timeout=5)
    assert words in str(err.value), err.value
    assert not dist.is_initialized()
