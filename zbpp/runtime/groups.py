"""Pipeline and data-parallel process groups from the default world.

Rank layout (fixed, documented, relied on by `Pipeline` and `GradReducer`)::

    global rank = dp_rank * pp + pp_rank

so one pipeline is ``pp`` consecutive global ranks. Under torchrun with ``--nproc-per-node=G`` and
``pp <= G`` (``G % pp == 0``), every pipeline stays inside one node (its point-to-point traffic
uses NVLink) and the data-parallel all-reduces cross nodes. Example for world 8, ``pp=4``::

    pipeline (dp_rank) 0: global ranks 0 1 2 3      data-parallel group of pp_rank 0: 0 4
    pipeline (dp_rank) 1: global ranks 4 5 6 7      data-parallel group of pp_rank 3: 3 7

Every rank must construct `ParallelGroups` with the same ``pp`` (it calls ``new_group``, which is
collective over the default group). Example, under ``torchrun --nproc-per-node=4``::

    groups = ParallelGroups(pp=2)           # 2 replicas of a 2-rank pipeline
    groups.pp_rank, groups.dp_rank          # e.g. (1, 0) on global rank 1
    groups.pp_peer(0)                       # global rank of this pipeline's first rank
    pipe = Pipeline(stages, schedule, loss_fn, groups=groups)
"""

from __future__ import annotations

from typing import Any

__all__ = ["ParallelGroups"]


class ParallelGroups:
    """Split the default process group into pipelines of `pp` ranks and data-parallel replicas.

    Built on torch's ``DeviceMesh`` (``mesh``, dimensions ``("dp", "pp")``); `Pipeline` also
    takes such a mesh directly as ``groups=``.

    Attributes:
        mesh: the ``DeviceMesh`` of shape ``(dp, pp)``.
        pp: ranks per pipeline.
        dp: number of data-parallel replicas (``world_size // pp``).
        pp_rank: this rank's position in its pipeline (the ``rank`` of a `Schedule`).
        dp_rank: which replica (pipeline) this rank belongs to.
        pp_group: the process group of this rank's pipeline.
        dp_group: the process group of the ranks holding the same pipeline position in every replica
            (a group of one rank when ``dp == 1``).
        world_size, rank: of the default group.

    Raises `ValueError` when the world size is not a multiple of `pp`, naming both, and
    `RuntimeError` when torch.distributed is not initialized.
    """

    def __init__(self, pp: int) -> None:
        import torch.distributed as dist

        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            raise ValueError(f"ParallelGroups(pp=...) needs an integer >= 1, got {pp!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ParallelGroups needs torch.distributed to be initialized first "
                "(e.g. torch.distributed.init_process_group() under torchrun, or zbpp.runtime.init_distributed())"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % pp:
            raise ValueError(
                f"world size {world} is not divisible by pp={pp}: a data-parallel layout needs "
                f"world_size = pp * dp (choose pp among {[d for d in range(1, world + 1) if world % d == 0]})"
            )
        self.pp = pp
        self.dp = world // pp
        self.world_size = world
        self.rank = rank
        # torch's DeviceMesh lays ranks out row-major, so mesh[dp_rank][pp_rank] = dp_rank * pp + pp_rank:
        # the layout above. Building the mesh is collective over the default group.
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
        self.mesh = init_device_mesh(device_type, (self.dp, pp), mesh_dim_names=("dp", "pp"))
        self.pp_rank = self.mesh.get_local_rank("pp")
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.pp_group: Any = self.mesh.get_group("pp")
        self.dp_group: Any = self.mesh.get_group("dp")

    def pp_peer(self, pp_rank: int) -> int:
        """The global rank of position `pp_rank` in this rank's pipeline."""
        if not 0 <= pp_rank < self.pp:
            raise ValueError(f"pp_rank {pp_rank} outside 0..{self.pp - 1}")
        return self.dp_rank * self.pp + pp_rank

    def dp_peer(self, dp_rank: int) -> int:
        """The global rank of replica `dp_rank` at this rank's pipeline position."""
        if not 0 <= dp_rank < self.dp:
            raise ValueError(f"dp_rank {dp_rank} outside 0..{self.dp - 1}")
        return dp_rank * self.pp + self.pp_rank

    def __repr__(self) -> str:
        return (
            f"ParallelGroups(pp={self.pp}, dp={self.dp}, rank={self.rank}, "
            f"pp_rank={self.pp_rank}, dp_rank={self.dp_rank})"
        )
