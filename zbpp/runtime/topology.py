"""Who is who in a pipeline job: this rank's place, its pipeline's ranks, the data-parallel replicas.

`Pipeline` accepts three descriptions of the job and turns each into one `Topology`:

- ``groups=None``: the default process group is one pipeline (global rank = pipeline rank), or,
  without torch.distributed, a one-rank pipeline in this process;
- a `zbpp.runtime.ParallelGroups` (``global rank = dp_rank * pp + pp_rank``);
- a ``torch.distributed.device_mesh.DeviceMesh`` with a ``"pp"`` dimension and optionally a
  ``"dp"`` one, as ``init_device_mesh("cuda", (dp, pp), mesh_dim_names=("dp", "pp"))`` builds it.
  Any other dimension (tensor parallelism, say) makes more pipelines: every line of the mesh along
  ``"pp"`` is one, and every rank of the mesh must build its `Pipeline`.

`pipelines` lists every pipeline of the job, so that process groups that every rank must create
together (`new_group` is collective over the default group) are created in one order everywhere.

>>> topo = Topology.resolve(None, num_ranks=1)
>>> topo.pp_rank, topo.pp_size, topo.dp_size, topo.pipeline
(0, 1, 1, (0,))
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """This rank's place in the job (see the module docstring).

    Attributes:
        distributed: torch.distributed is initialised (False: a one-rank pipeline in this process).
        global_rank: this process's rank in the default group (0 without torch.distributed).
        pp_rank, pp_size: position in its pipeline and the pipeline's length (the schedule's ranks).
        dp_rank, dp_size: which data-parallel replica, and how many there are.
        pipeline: the global ranks of this rank's pipeline, by pipeline rank.
        pipelines: every pipeline of the job, each as its global ranks by pipeline rank, in one
            order known to every rank.
        pp_group: the process group of this rank's pipeline (None without torch.distributed).
        dp_group: the process group of this position's replicas (None when ``dp_size == 1``).
    """

    distributed: bool
    global_rank: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    pipeline: tuple[int, ...]
    pipelines: tuple[tuple[int, ...], ...]
    pp_group: Any = None
    dp_group: Any = None

    @property
    def world(self) -> tuple[int, ...]:
        """Every global rank of the job's pipelines, sorted."""
        return tuple(sorted(r for p in self.pipelines for r in p))

    def describe(self) -> str:
        """``"pipeline rank 1 (global rank 5, replica 1)"``, for error messages."""
        extra = f"global rank {self.global_rank}"
        if self.dp_size > 1:
            extra += f", replica {self.dp_rank}"
        return f"pipeline rank {self.pp_rank} ({extra})"

    def default_device(self, stage_modules: Any) -> Any:
        """Where activations live by default: the current CUDA device under NCCL, else the device
        of the stage modules' first parameter (or buffer), else the CPU."""
        import torch

        if self.distributed:
            import torch.distributed as dist

            if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
        for m in stage_modules.values():
            for t in list(m.parameters()) + list(m.buffers()):
                return t.device
        return torch.device("cpu")

    @classmethod
    def resolve(cls, groups: Any, num_ranks: int) -> "Topology":
        """The topology described by `groups` (None, a ParallelGroups or a DeviceMesh) for a
        schedule of `num_ranks` ranks; raises ValueError/TypeError/RuntimeError saying what to pass."""
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        if groups is None:
            return cls._default(num_ranks, distributed)
        if not distributed:
            raise RuntimeError("groups= needs torch.distributed to be initialised first (zbpp.runtime.init_distributed())")
        try:
            from torch.distributed.device_mesh import DeviceMesh
        except ImportError:  # pragma: no cover - torch without device_mesh
            DeviceMesh = ()  # type: ignore[assignment,misc]
        if isinstance(groups, DeviceMesh):
            topo = cls._from_mesh(groups)
        elif isinstance(getattr(groups, "mesh", None), DeviceMesh):  # ParallelGroups
            topo = cls._from_mesh(groups.mesh)
        elif all(hasattr(groups, a) for a in ("pp", "dp", "pp_rank", "dp_rank", "pp_group", "dp_group")):
            pp, dp = int(groups.pp), int(groups.dp)
            pipelines = tuple(tuple(d * pp + r for r in range(pp)) for d in range(dp))
            topo = cls(True, dist.get_rank(), int(groups.pp_rank), pp, int(groups.dp_rank), dp,
                       pipelines[int(groups.dp_rank)], pipelines, groups.pp_group, groups.dp_group if dp > 1 else None)
        else:
            raise TypeError(
                f"groups must be None, a zbpp.runtime.ParallelGroups or a DeviceMesh with a 'pp' dimension, "
                f"got {type(groups).__name__}"
            )
        if topo.pp_size != num_ranks:
            raise ValueError(f"the schedule has {num_ranks} ranks but the pipeline group has {topo.pp_size}")
        return topo

    @classmethod
    def _default(cls, num_ranks: int, distributed: bool) -> "Topology":
        import torch.distributed as dist

        if not distributed:
            if num_ranks != 1:
                raise RuntimeError(
                    f"the schedule has {num_ranks} ranks: initialize torch.distributed first "
                    "(run under torchrun and call zbpp.runtime.init_distributed(), or init_process_group)"
                )
            return cls(False, 0, 0, 1, 0, 1, (0,), ((0,),))
        world = dist.get_world_size()
        if world != num_ranks:
            raise ValueError(
                f"the schedule has {num_ranks} ranks but the default process group has {world}; "
                f"for data parallelism pass groups=ParallelGroups(pp={num_ranks}) or a DeviceMesh with a 'pp' dimension"
            )
        ranks = tuple(range(world))
        return cls(True, dist.get_rank(), dist.get_rank(), world, 0, 1, ranks, (ranks,), dist.group.WORLD, None)

    @classmethod
    def _from_mesh(cls, mesh: Any) -> "Topology":
        import torch.distributed as dist

        names = tuple(mesh.mesh_dim_names or ())
        if "pp" not in names:
            raise ValueError(
                f"the DeviceMesh passed as groups= needs a dimension named 'pp' (and optionally 'dp'); "
                f"its dimensions are {names or 'unnamed'}: build it with init_device_mesh(..., mesh_dim_names=('dp', 'pp'))"
            )
        grid = mesh.mesh.tolist()
        shape = tuple(mesh.mesh.shape)
        pp_dim = names.index("pp")
        dp_dim = names.index("dp") if "dp" in names else None
        pipelines = []
        for index in itertools.product(*(range(n) for i, n in enumerate(shape) if i != pp_dim)):
            line = []
            for k in range(shape[pp_dim]):
                full = list(index)
                full.insert(pp_dim, k)
                cell: Any = grid
                for i in full:
                    cell = cell[i]
                line.append(int(cell))
            pipelines.append(tuple(line))
        me = dist.get_rank()
        mine = next(p for p in pipelines if me in p)
        dp_size = shape[dp_dim] if dp_dim is not None else 1
        return cls(
            True, me, mine.index(me), shape[pp_dim],
            mesh.get_local_rank("dp") if dp_dim is not None else 0, dp_size,
            mine, tuple(pipelines), mesh.get_group("pp"),
            mesh.get_group("dp") if dp_dim is not None and dp_size > 1 else None,
        )
