"""Gradient-norm clipping over a whole pipeline.

Each pipeline rank holds different parameters, so the global norm is the sum of every rank's local
sum of squares (for the 2-norm), all-reduced over the *pipeline* group. Data-parallel replicas hold
the same, already averaged gradients after `Pipeline.step`, so they are not summed again: that would
count every parameter `dp` times.

The gradient of a parameter is its ``main_grad`` when it has one (see `GradReducer`), else ``.grad``;
one with both (``main_grad`` attached to a parameter whose gradient went to ``.grad``) is refused.
A ``fully_shard`` parameter's gradient is a DTensor shard: its share of the norm is summed over the
mesh dimensions it is sharded over, and each rank scales its own shard.

>>> import torch
>>> lin = torch.nn.Linear(2, 1, bias=False)
>>> lin.weight.grad = torch.tensor([[3.0, 4.0]])
>>> float(clip_grad_norm_(lin, 1.0))
5.0
>>> [round(v, 4) for v in lin.weight.grad.flatten().tolist()]
[0.6, 0.8]
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from .agreement import Agreement, agree_nothing_failed, collective_call

__all__ = ["clip_grad_norm_"]


def _parameters(source: Any) -> list[torch.Tensor]:
    """Unique parameters of a Pipeline / module (anything with ``parameters()``), a mapping of stage
    modules, or an iterable of tensors."""
    if isinstance(source, torch.Tensor):
        items: Iterable[Any] = [source]
    elif callable(getattr(source, "parameters", None)):
        items = source.parameters()
    elif isinstance(source, Mapping):
        items = (p for m in source.values() for p in m.parameters())
    else:
        items = source
    seen: set[int] = set()
    out = []
    for p in items:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"clip_grad_norm_: expected parameters, got a {type(p).__name__}")
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _grad(p: torch.Tensor) -> torch.Tensor | None:
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def _refuse_two_grads(params: list[torch.Tensor], source: Any) -> None:
    """A parameter with both ``main_grad`` and a real ``.grad`` (not Megatron's placeholder of a
    fused layer, ``grad_added_to_main_grad``): without replicas nothing moves ``.grad`` into
    ``main_grad``, so the norm of ``main_grad`` alone misses it, and which one the optimizer reads
    is unknown. A ValueError names it."""
    for i, p in enumerate(params):
        if getattr(p, "main_grad", None) is None or p.grad is None:
            continue
        if getattr(p, "grad_added_to_main_grad", False) and not getattr(p, "zero_out_wgrad", False):
            continue
        names = {id(q): n for n, q in _named(source)}
        raise ValueError(
            f"clip_grad_norm_: parameter {names.get(id(p), f'{i} of shape {tuple(p.shape)}')} has both a main_grad "
            "and a .grad (its gradient went to .grad, which nothing adds to main_grad without data-parallel "
            "replicas), so which one the optimizer reads is unknown. Add it yourself before clipping "
            "(p.main_grad.add_(p.grad); p.grad = None), or drop the main_grad")


def _named(source: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) pairs of a Pipeline's stages or a module, for errors ([] for a list)."""
    stages = getattr(source, "stage_modules", None)
    if isinstance(source, Mapping) or isinstance(stages, Mapping):
        return [(f"{n} of stage {s}", q) for s, m in (stages or source).items() for n, q in m.named_parameters()]
    if callable(getattr(source, "named_parameters", None)):
        return list(source.named_parameters())
    return []


def _pp_group(source: Any, groups: Any) -> tuple[Any, int]:
    """The group to sum over, and its size. Without groups: the source's, else the whole world."""
    given = groups is not None
    if groups is None:
        groups = getattr(source, "topology", None) or getattr(source, "groups", None)  # a Pipeline's, or any
    if groups is not None and hasattr(groups, "pp_group"):
        return groups.pp_group, int(getattr(groups, "pp_size", None) or groups.pp)  # a Topology or ParallelGroups
    names = tuple(getattr(groups, "mesh_dim_names", None) or ())
    if "pp" in names and callable(getattr(groups, "get_group", None)):  # a DeviceMesh, as Pipeline takes one
        return groups.get_group("pp"), int(groups.size(names.index("pp")))
    if given:  # the whole world would also sum over the replicas: each parameter counted dp times
        raise TypeError("clip_grad_norm_: groups must be a ParallelGroups, a Pipeline's topology or a DeviceMesh "
                        f"with a 'pp' dimension, got {type(groups).__name__}"
                        + (f" with dimensions {names}" if names else ""))
    if dist.is_available() and dist.is_initialized():
        return None, dist.get_world_size()
    return None, 1


def clip_grad_norm_(
    pipeline_or_params: Any,
    max_norm: float,
    groups: Any = None,
    *,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale this rank's gradients so that the norm over the whole pipeline is at most `max_norm`.

    Every rank of every pipeline must call it (it all-reduces over the pipeline group), after the
    step's gradients are final and averaged. Returns the total norm before clipping (a scalar
    tensor, fp64 where this rank has an fp64 gradient, else fp32; the same value on every rank),
    like `torch.nn.utils.clip_grad_norm_`.

    Args:
        pipeline_or_params: a `Pipeline` or module (anything with ``parameters()``), a mapping
            ``{stage: module}``, or an iterable of parameters: this rank's share of the model.
        max_norm: the largest allowed norm.
        groups: a `ParallelGroups` or a ``DeviceMesh`` with a ``"pp"`` dimension (what the
            `Pipeline` got); defaults to the pipeline's own (``Pipeline.topology``), also for
            parameters (or modules) given alone that all belong to a live `Pipeline` (some but not
            all: a ValueError; none given on this rank: the live ones' group, a ValueError where
            they were built on different groups); else the whole world is one pipeline (no data
            parallelism).
        norm_type: p of the p-norm, ``math.inf`` (or ``"inf"``, as torch takes it) for the max norm.
        error_if_nonfinite: raise if the total norm is NaN or infinite.
        foreach: taken for torch's signature and ignored: the result is the same either way.

    The ranks first agree that none refused the call: a rank's error (a ``main_grad`` beside the
    step's ``.grad``, say) raises there, and a `PipelineError` naming that rank and its error on
    every other, before any collective or clipping. Given a `Pipeline`, over its ranks, on the
    host (one gloo all-reduce of a flag); given anything else, over the group the norm is summed
    over (the whole world by default; one more all-reduce of a flag, on the GPU for an NCCL group,
    which the host then reads). There, a `groups` that is not one raises on its rank only, and a
    ``fully_shard`` gradient's other shard groups are not told: keep them alike on every rank.

    A `Pipeline`'s tied parameters (`tied_parameters=`) count once: on the rank of their lowest
    stage (the copy of its lowest stage where ``fully_shard`` split one Parameter of two stages),
    also where its parameters are given alone. Parameters of no Pipeline count on every rank that
    passes them.

    In one process (no process group) the norm is this process's, as torch's:

    >>> a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    >>> a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    >>> float(clip_grad_norm_([a, b], max_norm=1.0))  # the norm before clipping
    5.0
    >>> [round(g, 4) for g in a.grad.tolist() + b.grad.tolist()]
    [0.6, 0.0, 0.8]
    """
    host, params, found = _host_and_params(pipeline_or_params, groups)
    unusable = getattr(host, "_raise_if_unusable", None)
    if callable(unusable):  # a Pipeline that found its job broken: the all-reduce would wait for a dead rank
        unusable()
    # an interrupt while the ranks agree comes once the call is done: the peers would wait for this rank
    with collective_call():
        return _clip(pipeline_or_params, host, params, found, max_norm, groups, norm_type, error_if_nonfinite)


def _host_and_params(source: Any, groups: Any) -> tuple[Any, list[torch.Tensor] | None, BaseException | None]:
    """The Pipeline to clip by (`source` itself, or the live one holding the parameters given without
    `groups`, else `source`), the parameters, and an error to raise on every rank of the host."""
    try:
        params = _parameters(source)  # once: `source` may be a generator
    except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
        return source, None, exc
    if groups is not None or callable(getattr(source, "_agree_before_collectives", None)):
        return source, params, None
    owner, problem = _owning_pipeline(params)
    return (owner if owner is not None else source), params, problem


def _owning_pipeline(params: list[torch.Tensor], collected: bool = False) -> tuple[Any, BaseException | None]:
    """The live `Pipeline` of this process that holds every one of `params` (the newest of several
    alike; for no parameters, the newest live one, all of them on one pipeline group), or None where
    none holds any. Its replicas'
    gradients are copies, so its pipeline group, not the world, is what the norm is summed over.
    An error (with a Pipeline to tell it through) where only some of them are a Pipeline's, or where
    Pipelines of other ranks or ties hold them."""

    from .pipeline import _live_pipelines

    want = {id(p) for p in params}
    pipes = _live_pipelines(collected)
    if not want:  # this rank's share is empty (a stage without parameters): its peers' Pipeline, if any
        if len(pipes) > 1:  # a dropped one may linger in a reference cycle; the list would keep it through the collection
            del pipes
            pipes = _live_pipelines(collect=True)
        if len({(pipe.topology.pipeline, pipe.topology.world) for pipe in pipes}) > 1:
            return pipes[-1], ValueError(
                "clip_grad_norm_: no parameters given on this rank, and Pipelines of different ranks live in "
                "this process, so the group to sum the norm over is unknown; pass the Pipeline, or groups=")
        if len({id(pipe.topology.pp_group) for pipe in pipes}) > 1:  # its peers' all-reduce may be on either
            return pipes[-1], ValueError(
                "clip_grad_norm_: no parameters given on this rank, and the live Pipelines of this process sum "
                "over different process groups of the same ranks (each built with its own ParallelGroups or "
                "DeviceMesh), so which one its peers clip by is unknown; pass the Pipeline, or groups= (what "
                "the Pipeline got)")
        return (pipes[-1] if pipes else None), None
    holders = [(pipe, want & {id(q) for q in pipe.parameters()}) for pipe in pipes]
    holders = [(pipe, held) for pipe, held in holders if held]
    if not holders:
        return None, None
    full = [pipe for pipe, held in holders if held == want]
    if not full:
        most = max(holders, key=lambda h: len(h[1]))
        return most[0], ValueError(
            f"clip_grad_norm_: {len(most[1])} of the {len(want)} parameters given belong to one Pipeline and the "
            "others not, so neither its pipeline group nor the whole world is the group to sum the norm "
            "over; pass the Pipeline, or groups= (what the Pipeline got)")
    layouts = {(pipe.topology.pipeline, frozenset(pipe._tied.param_ids())) for pipe in full}
    if len(layouts) > 1 and not collected:  # a dropped one may linger in a reference cycle: look again,
        del pipes, holders, full  # holding none of them through the collection
        return _owning_pipeline(params, collected=True)
    if len(layouts) > 1:
        return full[-1], ValueError(
            "clip_grad_norm_: the parameters given belong to several Pipelines with different pipeline ranks "
            "or tied parameters; pass the Pipeline to clip by")
    return full[-1], None


def _clip(source: Any, host: Any, params: list[torch.Tensor] | None, found: BaseException | None, max_norm: float,
          groups: Any, norm_type: float | str, error_if_nonfinite: bool) -> torch.Tensor:
    """`clip_grad_norm_`'s work, inside its `collective_call`: the gradients of `params` (from
    `source`), over the ranks of `host` (a Pipeline, or `source`); `found`: an error to raise."""
    try:  # first: with the group known, a refusal below reaches its other ranks
        group, size = _pp_group(host, groups)
    except (Exception, KeyboardInterrupt, SystemExit):  # noqa: BLE001 - a Pipeline's ranks still agree on it
        group, size = None, 1
    try:
        if max_norm < 0 or math.isnan(max_norm):
            raise ValueError(f"max_norm must be >= 0, got {max_norm!r}")
        try:
            p_norm = float(norm_type)  # torch's clip takes "inf" (any float() string) too
        except (TypeError, ValueError):
            p_norm = math.nan
        if not p_norm > 0:
            raise ValueError(f"norm_type must be > 0 (or math.inf, 'inf'), got {norm_type!r}")
        norm_type = p_norm
        if found is not None:
            raise found
        assert params is not None
        _refuse_two_grads(params, source if _named(source) else host)
        group, size = _pp_group(host, groups)  # raises here what the first try held
        problem = None
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
        problem = exc
    agree = getattr(host, "_agree_before_collectives", None)
    if callable(agree):  # a Pipeline: a rank that refused here would leave the others waiting in the all-reduces
        agree(problem, "clip_grad_norm_")
    elif size > 1:  # likewise over the group the norm is summed over
        _agree_over(group, problem)
    elif problem is not None:
        raise problem
    tied = getattr(host, "_tied", None)
    counted = [p for p in params if tied is None or tied.counted_here(p)]
    grads = [g for g in map(_grad, params) if g is not None]
    norm_of = [g for g in map(_grad, counted) if g is not None]
    if grads:
        device = grads[0].device
        acc = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    else:  # this rank has no gradient but must still join the collective
        cuda = dist.is_initialized() and dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        acc = torch.float32
    inf = math.isinf(norm_type)
    # the sum of p-th powers in float64: float32 overflows once a norm passes ~1e19 (its square), and
    # an inf total would make the coefficient 0, zeroing every gradient
    wide = torch.float64 if device.type in ("cpu", "cuda") else acc
    local = torch.zeros((), dtype=wide, device=device)
    held: list[BaseException | None] = [None]
    wait = None
    if callable(getattr(host, "_wait_collective", None)):  # a Pipeline
        def wait(work: Any) -> None:  # a rank dead since the last step: every rank raises at once
            held[0] = held[0] or host._wait_collective(work, device, "all-reduce of clip_grad_norm_")
    shards: dict[tuple, list[torch.Tensor]] = {}  # fully_shard gradients, by the groups they are sharded over
    for g in norm_of:
        key = _shard_groups(g)
        if key is not None:
            shards.setdefault(key, []).append(g.to_local())
            continue
        if g.numel() == 0:  # adds nothing; vector_norm refuses the inf-norm of an empty tensor
            continue
        n = torch.linalg.vector_norm(g.to(acc), norm_type).to(device, wide)
        local = torch.maximum(local, n) if inf else local + n**norm_type
    for key, parts in shards.items():  # the same keys in the same order on every replica
        part = torch.zeros((), dtype=wide, device=parts[0].device)
        for g in parts:
            if g.numel() == 0:  # a replica's empty shard (a parameter of fewer rows than replicas)
                continue
            n = torch.linalg.vector_norm(g.to(acc), norm_type).to(wide)
            part = torch.maximum(part, n) if inf else part + n**norm_type
        for shard_group in key:  # a dead replica: the broken mark ends the wait, as the pipeline group's
            part = _all_reduce(part, inf, shard_group, wait)
        part = part.to(device, wide)
        local = torch.maximum(local, part) if inf else local + part
    if size > 1:
        local = _all_reduce(local, inf, group, wait)  # float64 from here on: one coefficient everywhere
    total = local if inf else local ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total {norm_type}-norm of the gradients is {float(total)}; "
            "pass error_if_nonfinite=False to clip anyway"
        )
    # torch's formula: scale by min(1, max_norm / (norm + 1e-6)), always, so there is no host sync.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        if _shard_groups(g) is not None:
            g = g.to_local()  # shares the DTensor's storage
        g.mul_(coef.to(device=g.device, dtype=g.dtype))
    if held[0] is not None:  # a Ctrl-C in the all-reduce: the peers completed it, every gradient is clipped
        raise held[0]
    return total.to(acc)


def _agree_over(group: Any, problem: BaseException | None) -> None:
    """Parameters given, not a Pipeline: the ranks of `group` (None: the whole world) tell whether
    one refused (`problem`) before any waits for it in the all-reduce; the refusing rank raises its
    error, the others a `PipelineError` naming it (`agree_nothing_failed`: one all-reduce of a flag)."""
    group = group if group is not None else dist.group.WORLD
    agree_nothing_failed(Agreement(group), problem, dist.get_process_group_ranks(group),
                         "clip_grad_norm_ could not run on every rank (nothing was changed)")


def _all_reduce(value: torch.Tensor, inf: bool, group: Any, wait: Any = None) -> torch.Tensor:
    """`value` summed (p-norms) or maxed (the inf-norm) over `group`, a NaN kept: gloo's MAX drops
    a NaN that is not on the group's first rank, which would hide another rank's NaN gradient.

    In float64 whatever `value`'s dtype: ranks may accumulate in different ones (one without any
    gradient uses float32 beside float64 gradients), and a collective of mismatched sizes aborts
    gloo (and is undefined on NCCL). `wait`: waits for the all-reduce's work (default: plainly)."""
    wait = wait or (lambda work: work.wait())
    value = value.to(torch.float64)
    if not inf:
        wait(dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group, async_op=True))
        return value
    both = torch.stack([value, torch.isnan(value).to(value.dtype)])  # the flag's MAX: any rank's NaN
    wait(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True))
    return torch.where(both[1] > 0, torch.full_like(both[0], math.nan), both[0])


def _shard_groups(g: torch.Tensor) -> tuple | None:
    """For a DTensor gradient (``fully_shard``): the process groups of the mesh dimensions it is
    sharded over (its norm is summed over them; replicated dimensions hold copies). None otherwise."""
    placements = getattr(g, "placements", None)
    mesh = getattr(g, "device_mesh", None)
    if placements is None or mesh is None:
        return None
    return tuple(mesh.get_group(i) for i, pl in enumerate(placements) if pl.is_shard())
