"""Tied parameters: one logical parameter of which several pipeline ranks hold a copy.

GPT's token embedding (stage 0) and its LM head (the last stage) share one weight; in a pipeline
they sit on different ranks, each with its own copy (Megatron's "embedding group"). Every rank that
holds a copy passes it to `Pipeline(..., tied_parameters={"wte": param})` under the same name; under
a V placement both uses may sit on one rank, as one Parameter shared by its two stage modules.

- At construction the copies are made equal to the copy of the lowest stage (of replica 0). They
  must agree on shape, dtype and ``requires_grad`` (freeze every copy or none), else every rank raises;
  ``requires_grad`` again at every training step's start (`training_flags`), where a copy frozen or
  unfrozen unalike since would leave the others waiting in the sum's all-reduce until the timeout.
- In each step, a copy's gradient is final once every stage of its rank that holds it is done with
  it: after the stage's last B, or its last W when a delayed-wgrad module of the stage computes it
  (`get_backward_dw_params`, or a module without that method that owns it). Then an asynchronous
  all-reduce over the group of every copy (all holders of all replicas) sums it, divided by the
  number of replicas: every copy ends up with the sum over its uses and the average over the
  replicas, exactly once (the data-parallel reducer leaves tied parameters out).
- ``Pipeline.no_sync()`` skips it; the next step outside reduces everything accumulated. A copy
  whose norm another copy counts (`counted_here`), ``fully_shard`` copies and FSDP's split copies
  of one rank included, lays down the sum it holds when a window begins (`lay_down_reduced`, a
  copy kept for a failed step): every copy holds that sum, so the sum of the copies after the
  window would count it once per copy; the counted copy brings it back.

The reduced tensor is ``main_grad`` when the parameter has one, else ``.grad`` (zeros when a copy
got no gradient this step, so every copy takes part).

``fully_shard`` stages (`zbpp.runtime.fsdp`): a tied copy is a DTensor sharded over the ``dp`` mesh
dimension, so replica k holds shard k of every copy, and FSDP already averages each copy's gradient
over the replicas when it reduce-scatters the stage after its last W. The tie then works shard by
shard: one group per pipeline (the holders of replica k), the copies made equal to the lowest stage's
within it, and after every holding stage of the rank has reduce-scattered (its last W, whatever its
modules are) the local shards of ``.grad`` are summed over the group, without a division. Under a V
placement a Parameter that two stages of one rank share becomes one sharded copy per stage when
each stage is sharded (FSDP keeps no link between them); `FsdpReducer.split_copies` finds them, and
the pipeline keeps them tied, named or not: their gradients are added after both stages'
reduce-scatter (then all-reduced with the other ranks' copies if there are any), and each copy gets
the sum. A ``tied_parameters`` entry may give the Parameter as it was before ``fully_shard`` (as
`zbpp.models.pipeline_stages` returns it) where `zbpp.runtime.fsdp.note_parameters` noted the
stages (`pipeline_stages` does): the pipeline takes its sharded copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import torch
from torch import nn

from .channels import cached_group
from .fsdp import copies_of
from .polling import wait_for
from .topology import Topology

__all__ = ["LocalTies", "TiedParameters", "check_reducer_leaves_ties", "drifted_ties_error", "local_ties"]


@dataclass(eq=False)
class _Tie:
    name: str | None  # None: copies found by FSDP on this rank alone, not named by the caller
    params: tuple[nn.Parameter, ...]  # this rank's copies, by stage (more than one: FSDP split them)
    stages: tuple[int, ...]  # the stages of this rank whose modules hold a copy
    group: Any  # the copies to sum with (None: this rank's only)
    counted_here: bool  # this rank holds the copy of the lowest stage in its pipeline (norms count it)
    sharded: bool = False  # fully_shard copies: local shards, summed without a division
    pending: set[int] = field(default_factory=set)  # holding stages not final yet this step
    work: Any = None

    @property
    def param(self) -> nn.Parameter:
        return self.params[0]


class LocalTies(NamedTuple):
    """This rank's side of the tied parameters, found without any collective (`local_ties`)."""

    named: dict[str, tuple[tuple[nn.Parameter, ...], tuple[int, ...]]]  # name -> (this rank's copies, their stages)
    unnamed: list[tuple[tuple[nn.Parameter, ...], tuple[int, ...]]]  # copies FSDP split on this rank alone


def local_ties(tied: Mapping[str, nn.Parameter], stage_modules: Mapping[int, nn.Module],
               split: Sequence[Sequence[nn.Parameter]] = ()) -> LocalTies:
    """Check `tied` (``{name: parameter}`` as this rank passed it) against this rank's stage modules
    and group the copies each name stands for; `split`: ``fully_shard`` stages' copies of one
    Parameter that several stages of this rank shared (`FsdpReducer.split_copies`). Raises on a
    wrong entry (the `Pipeline` tells the other ranks before any collective)."""
    if not isinstance(tied, Mapping):
        raise TypeError(f"tied_parameters must be a mapping {{name: parameter}}, got {type(tied).__name__}")
    unclaimed = [tuple(c) for c in split]

    def stages_of(params: Sequence[nn.Parameter]) -> tuple[int, ...]:
        return tuple(s for s, m in sorted(stage_modules.items()) if any(q is p for q in m.parameters() for p in params))

    named: dict[str, tuple[tuple[nn.Parameter, ...], tuple[int, ...]]] = {}
    claimed: dict[int, str] = {}  # id(copy) -> the name it was given under
    for name, p in tied.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"tied_parameters: names must be non-empty strings, got {name!r}")
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"tied_parameters[{name!r}] must be an nn.Parameter, got {type(p).__name__}")
        if not any(q is p for m in stage_modules.values() for q in m.parameters()):
            p = next(iter(copies_of(stage_modules, p)), p)  # held from before fully_shard: its copy now
        copies = next((c for c in unclaimed if any(q is p for q in c)), (p,))
        unclaimed = [c for c in unclaimed if c is not copies]
        stages = stages_of(copies)
        if not stages:
            raise ValueError(
                f"tied_parameters[{name!r}] is not a parameter of this rank's stage modules (stages "
                f"{sorted(stage_modules)}): pass the very Parameter object the stage uses"
            )
        other = next((claimed[id(q)] for q in copies if id(q) in claimed), None)
        if other is not None:  # each name is reduced on its own: one gradient would be reduced twice at once
            raise ValueError(
                f"tied_parameters[{other!r}] and tied_parameters[{name!r}] are one Parameter: each name is reduced "
                "on its own, so its gradient would be summed (and averaged over the replicas) twice; pass it once, "
                "under the one name every rank gives its copy"
            )
        claimed.update((id(q), name) for q in copies)
        named[name] = (copies, stages)
    return LocalTies(named, [(c, stages_of(c)) for c in unclaimed])


def check_reducer_leaves_ties(reducer: Any, local: LocalTies) -> None:
    """Raise if `reducer` (given as ``Pipeline(reducer=...)``) reduces a tied copy: the tie sums it
    itself, and two reductions in flight on one gradient give wrong, even unequal, copies. Only a
    reducer that lists its parameters (``params()``, as `GradReducer` does) can be checked."""
    listed = getattr(reducer, "params", None)
    if reducer is None or not callable(listed):
        return
    reduced = {id(p) for p in listed()}
    for name, (params, _) in sorted(local.named.items()):
        if any(id(p) in reduced for p in params):
            raise ValueError(
                f"reducer= reduces tied_parameters[{name!r}] (shape {tuple(params[0].shape)}), which the pipeline "
                "already sums over its copies and averages over the replicas: leave the tied parameters out of it, "
                "e.g. GradReducer(stages, groups, exclude={id(p) for p in tied_parameters.values()})"
            )


class TiedParameters:
    """The tied parameters of one rank (see the module docstring).

    Args:
        local: this rank's ties (`local_ties`; may be empty: every rank must build one).
        topology: this rank's place in the job.
        stage_rank: stage -> pipeline rank (the schedule's placement).
        agreement: the job's `Agreement` (to learn who holds what; None: one process). An interrupt
            while this rank exchanges is held there, for the caller's next agreement.
        device: where gradients live (CUDA: NCCL groups; CPU: gloo).
        timeout: the groups' timeout.
    """

    def __init__(self, local: LocalTies, topology: Topology, stage_rank: tuple[int, ...], agreement: Any,
                 device: torch.device, timeout: Any) -> None:
        self.topology = topology
        self.dp = topology.dp_size
        #: called while waiting on the host for a reduction (it may raise; `GradReducer.wait_check`)
        self.wait_check: Any = None
        mine = local.named
        held = {n: (tuple(ps[0].shape), str(ps[0].dtype), min(stages), _shard_of(ps[0]),
                    tuple(sorted({p.requires_grad for p in ps})))
                for n, (ps, stages) in mine.items()}
        everyone = self._exchange(agreement, held)
        self._ties: list[_Tie] = []
        self._laid: list[tuple[nn.Parameter, torch.Tensor]] = []  # `lay_down_reduced`'s copies
        #: every rank's tie names, sorted: the same on every rank (`training_flags`' bits)
        self.all_names: list[str] = sorted({n for h in everyone.values() for n in h})
        backend = "nccl" if device.type == "cuda" else "gloo"
        for name in sorted({n for h in everyone.values() for n in h}):
            holders = {g: h[name] for g, h in everyone.items() if name in h}
            kinds = {h[:2] for h in holders.values()}
            if len(kinds) > 1:
                raise ValueError(f"tied parameter {name!r} has different shapes or dtypes on its ranks: "
                                 f"{ {g: h[:2] for g, h in sorted(holders.items())} }")
            frozen, trains = (sorted(g for g, h in holders.items() if flag in h[4]) for flag in (False, True))
            if frozen and trains:  # a trained copy's all-reduce would wait for the frozen one's gradient
                raise ValueError(
                    f"tied parameter {name!r} is frozen (requires_grad=False) on global ranks {frozen} but trains on "
                    f"{trains}: freeze every copy or none (before building the Pipeline)"
                )
            sharded = {g for g, h in holders.items() if h[3] is not None}
            if sharded and len(sharded) < len(holders):
                raise ValueError(
                    f"tied parameter {name!r} is sharded by fully_shard on global ranks {sorted(sharded)} but not on "
                    f"{sorted(set(holders) - sharded)}: fully_shard every stage module that holds a copy"
                )
            ranks = sorted(holders)
            if sharded:  # replica k's copies hold shard k: one group per pipeline, created by every rank
                groups = [self._shard_group(name, [g for g in ranks if g in line], holders, backend, timeout)
                          for line in topology.pipelines]
                group = groups[topology.pipelines.index(topology.pipeline)]
            else:
                group = cached_group(f"tie:{name}", ranks, backend, timeout) if len(ranks) > 1 and topology.distributed else None
            if name not in mine:
                continue
            params, stages = mine[name]
            in_my_pipeline = [g for g in ranks if g in topology.pipeline]
            lowest = min(in_my_pipeline, key=lambda g: (holders[g][2], g))
            tie = _Tie(name, params, stages, group, lowest == topology.global_rank, bool(sharded))
            self._ties.append(tie)
            if group is not None:  # copies equal to the lowest stage's (of replica 0; sharded: of the pipeline)
                pool = in_my_pipeline if sharded else ranks
                src = min(pool, key=lambda g: (g not in topology.pipelines[0], holders[g][2], g))
                import torch.distributed as dist

                with torch.no_grad():
                    dist.broadcast(_local(tie.param.data), src, group=group)
            _equalise(tie)
        for copies, stages in local.unnamed:  # shared by stages of this rank only: no collective
            tie = _Tie(None, copies, stages, None, True, True)
            self._ties.append(tie)
            _equalise(tie)

    @staticmethod
    def _shard_group(name: str, ranks: list[int], holders: dict[int, Any], backend: str, timeout: Any) -> Any:
        """The group of one pipeline's holders of a sharded tie (every rank calls this for every
        pipeline); their shards must be the same part of the parameter."""
        shards = {holders[g][3] for g in ranks}
        if len(shards) > 1:
            raise ValueError(
                f"tied parameter {name!r}: the copies of one pipeline (global ranks {ranks}) hold different shards "
                f"{ {g: holders[g][3] for g in ranks} }: fully_shard every stage over the pipeline's dp mesh "
                "(fully_shard(stage, mesh=mesh['dp']) with groups=mesh)"
            )
        return cached_group(f"tie:{name}", ranks, backend, timeout) if len(ranks) > 1 else None

    @staticmethod
    def _exchange(agreement: Any, held: dict[str, Any]) -> dict[int, dict[str, Any]]:
        if agreement is None or agreement.group is None:
            return {0: held}
        import torch.distributed as dist

        return dict(agreement.gather_objects((dist.get_rank(), held)))  # see Agreement.gather_objects

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._ties if t.name is not None]

    def training_flags(self) -> tuple[int, int]:
        """Bit i for ``all_names[i]``, every one (the agreement sends as many int64 words as they
        need): the ties of which this rank holds a copy that trains now, and those of which it holds
        a frozen one. The start agreement refuses a tie whose copies differ (``requires_grad_``
        after the build): a frozen copy takes no part in the sum, whose all-reduce the trained ones
        would wait in until the group's timeout. Copies of this rank alone (unnamed) are left out."""
        trains = frozen = 0
        for t in self._ties:
            if t.name is None:
                continue
            i = self.all_names.index(t.name)
            for q in t.params:
                trains |= q.requires_grad << i
                frozen |= (not q.requires_grad) << i
        return trains, frozen

    def counted_here(self, p: nn.Parameter) -> bool:
        """False for a tied copy whose norm another rank of the pipeline, or another copy of this
        rank, counts (see `clip_grad_norm_`)."""
        return all(t.counted_here and p is t.param for t in self._ties if any(q is p for q in t.params))

    def param_ids(self) -> set[int]:
        """ids of this rank's tied parameters (the data-parallel reducer leaves them out)."""
        return {id(p) for t in self._ties for p in t.params}

    # -- a no_sync window ------------------------------------------------------------------------
    def lay_down_reduced(self) -> None:
        """Before the first step of a ``no_sync()`` window: zero the gradient (``main_grad`` or
        ``.grad``) of every copy that another copy counts, keeping a copy of it. Each holds the sum
        of earlier steps, as the counted copy does; the synchronised step after the window sums the
        copies, which would count it once per copy."""
        self._laid = []
        for t in self._ties:
            for q in t.params[1:] if t.counted_here else t.params:  # FSDP's split copies of this rank too
                main = getattr(q, "main_grad", None)
                g = main if isinstance(main, torch.Tensor) else q.grad
                if g is not None:
                    self._laid.append((q, _local(g).clone()))
                    _local(g).zero_()  # in place: a fixed .grad buffer (task graphs) stays the parameter's

    def take_up_reduced(self, restore: bool) -> None:
        """After the step that laid them down: drop the copies (it succeeded) or, with `restore`
        (it failed, its earlier gradients kept), put them back."""
        for p, value in self._laid if restore else ():
            main = getattr(p, "main_grad", None)
            g = main if isinstance(main, torch.Tensor) else p.grad
            if g is not None:
                _local(g).copy_(value)
            else:  # cleared meanwhile: the kept tensor itself
                p.grad = value
        self._laid = []

    # -- per step -------------------------------------------------------------------------------
    def start_step(self) -> None:
        for t in self._ties:
            t.pending = set(t.stages)
            t.work = None

    def stage_done(self, stage: int, owed_by_w: set[int] | None) -> None:
        """The stage's last B (``owed_by_w``: ids of the parameters its W still computes) or its last
        W (``owed_by_w`` None): launch the reduction of every copy now final. A sharded copy is final
        only after the stage's reduce-scatter, which follows its last W."""
        for t in self._ties:
            if stage not in t.pending or (owed_by_w is not None and (t.sharded or id(t.param) in owed_by_w)):
                continue
            t.pending.discard(stage)
            if not t.pending:
                self._launch(t)

    def _launch(self, t: _Tie) -> None:
        if not t.param.requires_grad:  # a frozen copy has no gradient to share
            return
        g = _local(_grad_of(t.param))
        for q in t.params[1:]:  # copies of this rank (FSDP split them): their sum, then the group's
            g.add_(_local(_grad_of(q)))
        if t.group is None:
            self._copy_out(t)
            return
        import torch.distributed as dist

        if self.dp > 1 and not t.sharded:
            g.div_(self.dp)
        t.work = dist.all_reduce(g, group=t.group, async_op=True)

    @staticmethod
    def _copy_out(t: _Tie) -> None:
        """Every copy of this rank gets the first one's reduced gradient."""
        for q in t.params[1:]:
            _local(_grad_of(q)).copy_(_local(_grad_of(t.param)))

    def finish(self) -> None:
        """Wait for the step's reductions (CUDA: the compute stream waits, the host does not)."""
        for t in self._ties:
            if t.pending:
                what = repr(t.name) if t.name is not None else "shared by stages " + str(list(t.stages))
                raise RuntimeError(f"tied parameter {what}: stages {sorted(t.pending)} never finished with it this step")
            if t.work is not None:
                wait_for(t.work, self.wait_check, t.param.device)
                t.work = None
                self._copy_out(t)

    def abandon(self) -> None:
        for t in self._ties:
            if t.work is not None:
                wait_for(t.work, self.wait_check, t.param.device)
                t.work = None

    # -- between steps: are the copies still equal? ----------------------------------------------
    def snapshot(self) -> list[tuple[_Tie, list[torch.Tensor]]]:
        """Each tie's copies on this rank as integer bit patterns (`_bits`): what `compare` sends.
        No collective: `Pipeline.check_ties` agrees that every rank got this far first."""
        return [(t, [_bits(_local(q.data)) for q in t.params]) for t in self._ties]

    def compare(self, snapshot: list[tuple[_Tie, list[torch.Tensor]]]) -> dict[str, float]:
        """The largest difference between the copies of every tie this rank holds (0.0: equal bit for
        bit; NaN: they differ where some copy is NaN), keyed by the tie's name (``"shared by stages
        [s, t]"`` for copies FSDP split on this rank alone). Collective over each tie's group, in the
        order every holder builds its ties (sorted by name), so holders of several ties never cross.

        Exact: the elementwise MAX of the copies' bit patterns and of their complements (whose MAX is
        the complement of the MIN) are equal only where every copy has the same bits. Only a tie
        whose copies differ pays two more all-reduces, of the values, for the largest difference."""
        out: dict[str, float] = {}
        for t, bits in snapshot:
            own = [_local(q.data) for q in t.params]
            diff = max((_largest_difference(own[0], q) for q, b in zip(own[1:], bits[1:]) if not torch.equal(b, bits[0])),
                       default=0.0)  # copies of this rank (FSDP split them)
            if t.group is not None:
                high, low = bits[0].clone(), torch.bitwise_not(bits[0])
                self._all_reduce_max(t, high, low)
                if not torch.equal(high, torch.bitwise_not(low)):  # every holder sees the same, and goes on alike
                    values = own[0].detach().reshape(-1).to(torch.float64)
                    high_v, low_v = values.clone(), values.neg()
                    self._all_reduce_max(t, high_v, low_v)
                    spread = _largest(high_v + low_v)  # max(copies) - min(copies), elementwise
                    diff = spread if diff != diff else diff if spread != spread else max(diff, spread)
            out[t.name if t.name is not None else f"shared by stages {list(t.stages)}"] = diff
        return out

    def _all_reduce_max(self, t: _Tie, *tensors: torch.Tensor) -> None:
        import torch.distributed as dist

        works = [dist.all_reduce(x, op=dist.ReduceOp.MAX, group=t.group, async_op=True) for x in tensors]
        for work in works:
            wait_for(work, self.wait_check, t.param.device)

    def copy_names(self, stage_modules: Mapping[int, nn.Module]) -> dict[str, dict[int, list[str]]]:
        """Tie name -> {stage: the copy's names in that stage module} on this rank (for messages)."""
        out: dict[str, dict[int, list[str]]] = {}
        for t in self._ties:
            key = t.name if t.name is not None else f"shared by stages {list(t.stages)}"
            out[key] = {s: [n for n, p in stage_modules[s].named_parameters(remove_duplicate=False)
                            if any(p is q for q in t.params)] for s in t.stages if s in stage_modules}
        return out


#: what one rank tells in `Pipeline.check_ties`: its global rank, {tie: largest difference of its
#: copies}, {tie: {stage: the copy's names}}
TieReport = tuple[int, dict[str, float], dict[str, dict[int, list[str]]]]


def drifted_ties_error(reports: Sequence[TieReport], loaded_from: str | None = None) -> RuntimeError | None:
    """The error every rank raises when some tie's copies differ (None: all equal), built from every
    rank's report, so it reads the same on every rank. `loaded_from`: the checkpoint just loaded,
    whose values under the copies' names differ (not copies that drifted in training)."""
    drifted = sorted({name for _, diffs, _ in reports for name, d in diffs.items() if d != 0.0})
    if not drifted:
        return None
    lines = []
    for name in drifted:
        diffs = [d for _, ds, _ in reports for n, d in ds.items() if n == name]
        largest = max((d for d in diffs if d == d), default=float("nan"))
        amount = (f"by up to {largest:.3g}" if largest == largest else "only where some copy is NaN or a zero's sign differs")
        holders = ", ".join(f"global rank {g} stage {s} ({' / '.join(map(repr, names))})"
                            for g, _, where in sorted(reports) for s, names in sorted(where.get(name, {}).items()))
        lines.append(f"tied parameter {name!r} differs between its copies {amount}: held by {holders}")
    if loaded_from is not None:
        return RuntimeError(
            "; ".join(lines) + f". The checkpoint {loaded_from!r} holds these values under the copies' names: saved "
            "from a model without this tie? The model and optimizer are loaded with the copies apart, which would "
            "train apart: load a checkpoint of the tied model")
    return RuntimeError(
        "; ".join(lines) + ". The copies of a tied parameter get the same gradient, so they stay equal only if every "
        "copy's optimizer treats it alike; most likely the copies are in parameter groups with different settings, e.g. "
        "weight decay chosen by name (a rule that excludes names containing 'embed' decays the LM head's copy, "
        "'lm_head.weight', and not the embedding's). Give every copy the same settings: choose its group by whether it is "
        "in tied_parameters (id(p) in {id(q) for q in tied_parameters.values()}) on every rank, then resume from a "
        "checkpoint saved before they drifted"
    )


def _grad_of(p: nn.Parameter) -> torch.Tensor:
    main = getattr(p, "main_grad", None)
    if isinstance(main, torch.Tensor):
        return main
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage), or the tensor itself."""
    if hasattr(t, "to_local") and hasattr(t, "device_mesh"):
        with torch.no_grad():
            return t.to_local()
    return t


def _shard_of(p: nn.Parameter) -> tuple | None:
    """Which part of a ``fully_shard`` parameter this rank holds: its coordinate on the mesh and the
    local shape (None for a plain tensor)."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or not hasattr(p, "to_local"):
        return None
    return (tuple(mesh.get_coordinate() or ()), tuple(_local(p.data).shape))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t`'s bit patterns as a flat integer tensor (a new tensor, to all-reduce in place):
    equal bits are equal values, NaN and the sign of zero included. int32 or int64: the types every
    backend reduces (NCCL has no int16)."""
    flat = t.detach().reshape(-1)
    size = flat.element_size()
    if size % 8 == 0:
        return flat.view(torch.int64).clone()
    if size % 4 == 0:
        return flat.view(torch.int32).clone()
    return flat.view(torch.int16 if size == 2 else torch.uint8).to(torch.int32)


def _largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest elementwise difference of two copies whose bits differ (`_largest`)."""
    return _largest((a.detach().to(torch.float64) - b.detach().to(torch.float64)).abs())


def _largest(diff: torch.Tensor) -> float:
    """The largest of differences between copies whose bits differ; NaN where none is a number > 0
    (the copies differ only in NaNs or in the sign of a zero)."""
    numbers = diff[~diff.isnan()]
    largest = numbers.max().item() if numbers.numel() else 0.0
    return largest if largest > 0 else float("nan")


def _equalise(t: _Tie) -> None:
    """This rank's copies equal to its first (FSDP split copies start equal; a broadcast wrote the first)."""
    with torch.no_grad():
        for q in t.params[1:]:
            _local(q.data).copy_(_local(t.param.data))
