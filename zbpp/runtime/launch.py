"""Initialise torch.distributed for a pipeline, from torchrun's environment, with a timeout.

The process-group timeout is what turns a dead or stuck peer into an error instead of a hang (gloo:
the receive fails; NCCL: the watchdog aborts), so it is an explicit argument here.

    # torchrun --nproc-per-node=2 train.py
    from zbpp.runtime import init_distributed
    backend = init_distributed(timeout=120)      # "nccl" with one GPU per process, else "gloo"
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["init_distributed", "default_backend", "shutdown_and_exit"]


def default_backend() -> str:
    """"nccl" when every local process can have its own CUDA device, else "gloo"."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def init_distributed(backend: str | None = None, *, timeout: float = 600.0) -> str:
    """Initialise the default process group from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` (torchrun sets them); on NCCL also select the GPU ``LOCAL_RANK``.

    Args:
        backend: "nccl", "gloo" or None for `default_backend`.
        timeout: seconds an operation may wait for a peer before it fails.

    Returns the backend. Does nothing but return it if the group is already initialised.
    """
    if dist.is_initialized():
        return dist.get_backend()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(
                f"init_distributed: environment variable {var} is not set; launch with torchrun "
                "(e.g. torchrun --nproc-per-node=2 script.py)"
            )
    backend = backend or default_backend()
    device = None
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if local_rank >= gpus:  # else torch.cuda.set_device's "no NVIDIA driver" or "invalid device ordinal"
            raise RuntimeError(f"init_distributed: backend nccl gives each process its own CUDA GPU, but this "
                               f"process has LOCAL_RANK {local_rank} and the machine {gpus} GPU(s): launch at most "
                               f"{gpus} processes per node, or use backend gloo" if gpus else
                               "init_distributed: backend nccl needs CUDA GPUs, and this machine has none: use "
                               "backend gloo (CPU)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    # device_id binds the group to this rank's GPU: without it NCCL guesses the device from the
    # global rank and warns that this can hang (wrong where LOCAL_RANK differs, on several nodes).
    # It makes the communicator eager and shared, which the program's one order of operations allows.
    span = timedelta(seconds=timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(backend, timeout=span, device_id=device)
        return backend
    # torchrun restarted the job: its store still holds the previous attempt's keys (gloo would
    # connect to a dead peer's address), so each attempt rendezvous under its own prefix
    store, rank, world = next(dist.rendezvous("env://", timeout=span))
    dist.init_process_group(backend, store=dist.PrefixStore(f"zbpp/attempt-{restart}", store), rank=rank,
                            world_size=world, timeout=span, device_id=device)
    return backend


def shutdown_and_exit(exit_code: int = 0) -> None:
    """End a torchrun worker: barrier, ``destroy_process_group``, flush, then ``os._exit(exit_code)``.

    The barrier keeps a rank from closing connections a peer still uses. Leaving through
    ``os._exit`` skips the interpreter's finalisation, where, with gloo on torch 2.14, a process can
    abort *after* a clean ``destroy_process_group`` (a C++ thread of the c10d store is still joinable
    at static destruction), so torchrun would report a rank that had finished as failed. Call it last, from the script's main::

        if __name__ == "__main__":
            shutdown_and_exit(main())
    """
    import sys

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
