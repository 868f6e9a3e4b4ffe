"""Tied parameters: one logical parameter of which several pipeline ranks hold a copy.

GPT's token embedding (stage 0) and its LM head (the last stage) share one weight; in a pipeline
they sit on different ranks, each with its own copy (Megatron's "embedding group"). Every rank that
holds a copy passes it to `Pipeline(..., tied_parameters={"wte": param})` under the same name; under
a V placement both uses may sit on one rank, as one Parameter shared by its two stage modules.

- At construction the copies are made equal to the copy of the lowest stage (of replica 0).
- In each step, a copy's gradient is final once every stage of its rank that holds it is done with
  it: after the stage's last B, or its last W when a delayed-wgrad module of the stage computes it
  (`get_backward_dw_params`, or a module without that method that owns it). Then an asynchronous
  all-reduce over the group of every copy (all holders of all replicas) sums it, divided by the
  number of replicas: every copy ends up with the sum over its uses and the average over the
  replicas, exactly once (the data-parallel reducer leaves tied parameters out).
- ``Pipeline.no_sync()`` skips it; the next step outside reduces everything accumulated.

The reduced tensor is ``main_grad`` when the parameter has one, else ``.grad`` (zeros when a copy
got no gradient this step, so every copy takes part).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from .channels import cached_group
from .topology import Topology

__all__ = ["TiedParameters"]


@dataclass(eq=False)
class _Tie:
    name: str
    param: nn.Parameter
    stages: tuple[int, ...]  # the stages of this rank whose modules hold the parameter
    group: Any  # every copy of every replica (None: this rank holds the only copy)
    counted_here: bool  # this rank holds the copy of the lowest stage in its pipeline (norms count it)
    pending: set[int] = field(default_factory=set)  # holding stages not final yet this step
    work: Any = None


class TiedParameters:
    """The tied parameters of one rank (see the module docstring).

    Args:
        tied: ``{name: parameter}`` as this rank passed it (may be empty: every rank must build one).
        stage_modules: this rank's stage modules.
        topology: this rank's place in the job.
        stage_rank: stage -> pipeline rank (the schedule's placement).
        agreement: the job's gloo group (to learn who holds what).
        device: where gradients live (CUDA: NCCL groups; CPU: gloo).
        timeout: the groups' timeout.
    """

    def __init__(self, tied: Mapping[str, nn.Parameter], stage_modules: Mapping[int, nn.Module], topology: Topology,
                 stage_rank: tuple[int, ...], agreement: Any, device: torch.device, timeout: Any) -> None:
        if not isinstance(tied, Mapping):
            raise TypeError(f"tied_parameters must be a mapping {{name: parameter}}, got {type(tied).__name__}")
        self.topology = topology
        self.dp = topology.dp_size
        mine: dict[str, tuple[nn.Parameter, tuple[int, ...]]] = {}
        for name, p in tied.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"tied_parameters: names must be non-empty strings, got {name!r}")
            if not isinstance(p, nn.Parameter):
                raise TypeError(f"tied_parameters[{name!r}] must be an nn.Parameter, got {type(p).__name__}")
            stages = tuple(s for s, m in sorted(stage_modules.items()) if any(q is p for q in m.parameters()))
            if not stages:
                raise ValueError(
                    f"tied_parameters[{name!r}] is not a parameter of this rank's stage modules (stages "
                    f"{sorted(stage_modules)}): pass the very Parameter object the stage uses"
                )
            mine[name] = (p, stages)
        held = {n: (tuple(p.shape), str(p.dtype), min(stages)) for n, (p, stages) in mine.items()}
        everyone = self._exchange(agreement, held)
        self._ties: list[_Tie] = []
        backend = "nccl" if device.type == "cuda" else "gloo"
        for name in sorted({n for h in everyone.values() for n in h}):
            holders = {g: h[name] for g, h in everyone.items() if name in h}
            kinds = {(shape, dtype) for shape, dtype, _ in holders.values()}
            if len(kinds) > 1:
                raise ValueError(f"tied parameter {name!r} has different shapes or dtypes on its ranks: "
                                 f"{ {g: h[:2] for g, h in sorted(holders.items())} }")
            ranks = sorted(holders)
            group = cached_group(f"tie:{name}", ranks, backend, timeout) if len(ranks) > 1 and topology.distributed else None
            if name not in mine:
                continue
            p, stages = mine[name]
            in_my_pipeline = [g for g in ranks if g in topology.pipeline]
            lowest = min(in_my_pipeline, key=lambda g: (holders[g][2], g))
            tie = _Tie(name, p, stages, group, lowest == topology.global_rank)
            self._ties.append(tie)
            if group is not None:  # copies equal to the lowest stage's, of replica 0
                src = min(ranks, key=lambda g: (g not in topology.pipelines[0], holders[g][2], g))
                import torch.distributed as dist

                with torch.no_grad():
                    dist.broadcast(p.data, src, group=group)

    @staticmethod
    def _exchange(agreement: Any, held: dict[str, Any]) -> dict[int, dict[str, Any]]:
        if agreement is None:
            return {0: held}
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size(agreement)
        dist.all_gather_object(out, (dist.get_rank(), held), group=agreement)
        return {g: h for g, h in out}

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._ties]

    def counted_here(self, p: nn.Parameter) -> bool:
        """False for a tied copy whose norm another rank of the pipeline counts (see `clip_grad_norm_`)."""
        return all(t.counted_here for t in self._ties if t.param is p)

    def param_ids(self) -> set[int]:
        """ids of this rank's tied parameters (the data-parallel reducer leaves them out)."""
        return {id(t.param) for t in self._ties}

    # -- per step -------------------------------------------------------------------------------
    def start_step(self) -> None:
        for t in self._ties:
            t.pending = set(t.stages)
            t.work = None

    def stage_done(self, stage: int, owed_by_w: set[int] | None) -> None:
        """The stage's last B (``owed_by_w``: ids of the parameters its W still computes) or its last
        W (``owed_by_w`` None): launch the reduction of every copy now final."""
        for t in self._ties:
            if stage not in t.pending or (owed_by_w is not None and id(t.param) in owed_by_w):
                continue
            t.pending.discard(stage)
            if not t.pending:
                self._launch(t)

    def _launch(self, t: _Tie) -> None:
        if t.group is None or not t.param.requires_grad:  # a frozen copy has no gradient to share
            return
        import torch.distributed as dist

        g = _grad_of(t.param)
        if self.dp > 1:
            g.div_(self.dp)
        t.work = dist.all_reduce(g, group=t.group, async_op=True)

    def finish(self) -> None:
        """Wait for the step's reductions (CUDA: the compute stream waits, the host does not)."""
        for t in self._ties:
            if t.pending:
                raise RuntimeError(f"tied parameter {t.name!r}: stages {sorted(t.pending)} never finished with it this step")
            if t.work is not None:
                t.work.wait()
                t.work = None

    def abandon(self) -> None:
        for t in self._ties:
            if t.work is not None:
                t.work.wait()
                t.work = None


def _grad_of(p: nn.Parameter) -> torch.Tensor:
    main = getattr(p, "main_grad", None)
    if isinstance(main, torch.Tensor):
        return main
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad
