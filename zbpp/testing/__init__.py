"""zbpp.testing: run a test function on N ranks (gloo on CPU, NCCL on GPUs).

See `zbpp.testing.distributed` for the three ways in (a reusable `Workers` pool, `run_distributed`,
the `distributed` decorator) and `zbpp.testing.plugin` for the pytest fixture ``zbpp_workers``,
which pytest loads automatically once zbpp is installed.

Importing this package does not import torch; the ranks do.
"""

from .distributed import DistributedTestError, Workers, distributed, gpus_available, run_distributed

__all__ = ["Workers", "DistributedTestError", "run_distributed", "distributed", "gpus_available"]
