"""Pipeline stages sharded with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Wrap each stage module with ``fully_shard(stage, mesh=mesh["dp"])`` (inner ``fully_shard`` calls on
its blocks are allowed) and hand the stages to `zbpp.Pipeline` with ``groups=mesh``; the pipeline
then drives FSDP through `FsdpReducer` instead of its all-reduce `GradReducer`:

Every rank (torchrun, 4 ranks: dp=2 x pp=2)::

    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "pp"))
    sched = build("zb-h1", num_ranks=2, num_microbatches=8)
    stages = {s: fully_shard(stage_module(s), mesh=mesh["dp"]) for s in sched.stages_on(mesh.get_local_rank("pp"))}
    pipe = Pipeline(stages, sched, loss_fn=loss_fn, groups=mesh)
    opt = torch.optim.AdamW(pipe.parameters())         # over the shards
    pipe.step(x, target=y); opt.step(); opt.zero_grad()

- *Unshard*: at the start of each step every stage of this rank is all-gathered, in the order of
  the stages' first F (asynchronously: FSDP's pre-forward waits for it), so a rank holding several
  stages (V placements) prefetches the next stage's parameters.
- *Reshard policy* (torchtitan's ``reshard_after_forward=False`` under pipelining): a stage's
  parameters stay unsharded from its first F to its last W (or BW) of the step. Resharding after
  every F would all-gather them again for every microbatch's B, and a W task, which runs outside
  autograd, needs the unsharded parameters that its forward saw.
- *Reduce*: during the step FSDP only accumulates the unsharded gradients
  (``set_requires_gradient_sync(False)``); right after a stage's last W (its last BW under classic
  schedules) the reducer reduce-scatters that stage's gradients once (one collective per
  ``fully_shard`` module of the stage), through FSDP's own post-backward, and reshards it. Before
  it the replicas agree, on the host, which parameters have a gradient: one that only some replicas'
  data reached (a branch, an expert) gets zeros on the others, so that their reduce-scatters match. The sharded ``.grad`` is then a DTensor averaged over the ``dp``
  mesh (HSDP meshes: reduce-scattered over the shard dimension, all-reduced over the replicate one).
- ``Pipeline.no_sync()``: steps inside keep accumulating the unsharded gradients and reshard only
  the parameters at the step's end; the next synchronised step reduce-scatters everything once.

Memory per rank (P parameters of this rank's stages, dp-way sharded, G their gradients):
outside a step P/dp parameters and G/dp gradients (plus the optimizer state of the shards); during
a step, from a stage's first F to its last W, also the full parameters and full gradients of that
stage (under no_sync until the synchronised step ends, the full gradients stay; with ``main_grad``, a
full buffer per such parameter too), and the usual activations of the schedule.

``main_grad``: the unsharded parameters of modules with ``fuse_wgrad_accumulation=True`` get a
``main_grad`` buffer (float32, or the parameter's dtype when wider) at the step's start; after the
stage's last W it is added into ``.grad`` (under a ``MixedPrecisionPolicy`` whose ``reduce_dtype``
differs from ``param_dtype``: into FSDP's accumulation in ``reduce_dtype``, unrounded) and dropped,
and FSDP reduce-scatters that: the result is the shard's ``.grad``, as for every other parameter.

Tied parameters (``tied_parameters=``, `zbpp.runtime.tied`): every copy is sharded like the rest of
its stage, so replica k holds shard k of each copy. After a holding stage's reduce-scatter (the
shards of ``.grad`` are then averaged over the replicas) the shards are summed over the copies of
the same replica, one group per pipeline. Under a V placement a Parameter that two stages of one
rank share becomes two sharded Parameters, one per ``fully_shard`` call (FSDP keeps no link between
them; one call over both stages, ``fully_shard([a, b])``, cannot run as two roots and is refused):
`FsdpReducer.split_copies` finds them by what `note_parameters` noted before ``fully_shard``
(`zbpp.models.pipeline_stages` and ``causal_lm_stages`` note it for you), else by the original
Parameter that FSDP records (torch 2.13 and later; an older FSDP records none: there zbpp warns and
each stage trains its own copy), and the pipeline keeps them tied, named in ``tied_parameters`` or
not: after both stages' reduce-scatters each gets their sum (the optimizer then updates both alike),
and gradient norms count it once.

Limits: after a failed step FSDP's per-step state is reset (``reset_iter_state``): the step's gradients and those that
no_sync steps accumulated unreduced are lost; gradients already reduce-scattered into ``.grad``
before it are kept.

Private FSDP calls (its post-backward machinery, the only way to reduce-scatter outside an
autograd backward, and the unsharded parameters it reduces) live in the underscored helpers of this
module alone; the torch pipelining runtime uses the same machinery.
"""

from __future__ import annotations

import re
import sys
import warnings
import weakref
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .._compat import fsdp2

__all__ = ["FsdpReducer", "copies_of", "holds_fsdp", "is_fsdp_module", "note_parameters", "sharded_forms"]


# where torch keeps FSDP2 (torch < 2.6: the second); see `zbpp._compat.fsdp2`
_FSDP2_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def _fsdp_module_class() -> type | None:
    if not any(name in sys.modules for name in _FSDP2_MODULES):
        # nothing can have been wrapped by fully_shard before it was imported; importing it here
        # would cost every Pipeline seconds of start-up (it pulls in DTensor)
        return None
    found = fsdp2()
    return None if found is None else found[0]


def _fully_shard() -> Any:
    found = fsdp2()
    if found is None:
        raise RuntimeError("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    return found[1]


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether `module` was wrapped by ``fully_shard``.

    >>> is_fsdp_module(torch.nn.Linear(2, 2))
    False
    """
    cls = _fsdp_module_class()
    return cls is not None and isinstance(module, cls)


def holds_fsdp(stage_modules: Mapping[int, nn.Module]) -> bool:
    """Whether any stage module is, or contains, a ``fully_shard`` module."""
    return any(is_fsdp_module(m) for stage in stage_modules.values() for m in stage.modules())


def _param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.9: one parameter group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _post_backward(root: nn.Module) -> None:
    """Run FSDP's post-backward on every parameter group under `root` (reduce-scatter, reshard)
    and its root callback (wait for the reductions, reset the backward state). The one place that
    uses FSDP internals."""
    state = _fully_shard().state(root)  # type: ignore[attr-defined]
    for sub in state._state_ctx.all_states:
        for group in _param_groups(sub):
            _to_reduce_dtype(group)
            group.post_backward()
    state._root_post_backward_final_callback()


def _to_reduce_dtype(group: Any) -> None:
    """Every gradient of `group` into FSDP's accumulation in its ``reduce_dtype``, as FSDP's hook after
    a backward that does not reduce leaves it. A gradient written after the last such hook (a W, a
    folded ``main_grad``) of a parameter that has no accumulation yet would otherwise be reduced in
    the parameter's dtype beside others in ``reduce_dtype``, which FSDP's reduce-scatter refuses."""
    for fp in group.fsdp_params:
        if hasattr(fp, "_unsharded_param"):
            _to_reduce_dtype_one(fp)


def _to_reduce_dtype_one(fp: Any) -> None:
    """One FSDP parameter's ``.grad`` into its ``reduce_dtype`` accumulation (`_to_reduce_dtype`)."""
    fp.accumulate_unsharded_grad_if_needed()
    fp.to_accumulated_grad_if_needed()


def _fsdp_params(root: nn.Module) -> list[Any]:
    """FSDP's records of the parameters that the ``fully_shard`` calls under `root` manage."""
    state = _fully_shard().state(root)  # type: ignore[attr-defined]
    return [fp for sub in state._state_ctx.all_states for group in _param_groups(sub) for fp in group.fsdp_params]


def _reset(root: nn.Module) -> None:
    """Forget a failed step: FSDP's own reset where it exists, else a reshard."""
    reset = getattr(root, "reset_iter_state", None)
    if callable(reset):
        reset()
    else:  # pragma: no cover - torch without reset_iter_state
        root.reshard()
    state = _fully_shard().state(root)  # type: ignore[attr-defined]
    for sub in state._state_ctx.all_states:
        for group in _param_groups(sub):
            for fp in group.fsdp_params:
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
                    unsharded.__dict__.pop("main_grad", None)
                if getattr(fp, "unsharded_accumulated_grad", None) is not None:
                    fp.unsharded_accumulated_grad = None


def _zero_where_a_replica_has_one(root: nn.Module, group: Any, check: Callable[[], None] | None) -> None:
    """Give a zero gradient to every unsharded parameter that requires one and has none here but has
    one on another replica of `group`: FSDP reduce-scatters only the parameters with a gradient, so
    replicas whose data took different branches (an expert that only some route tokens to) would
    reduce-scatter tensors of different sizes. One that no replica has stays None, as in one process.
    The flags travel over `group` (gloo, on the host), waited for with `check` (`wait_for`)."""
    import torch.distributed as dist

    from .polling import wait_for

    state = _fully_shard().state(root)  # type: ignore[attr-defined]
    params = [fp for sub in state._state_ctx.all_states for group_ in _param_groups(sub) for fp in group_.fsdp_params
              if getattr(fp, "_unsharded_param", None) is not None and fp._unsharded_param.requires_grad]
    here = [fp._unsharded_param.grad is not None or getattr(fp, "unsharded_accumulated_grad", None) is not None
            for fp in params]
    anywhere = torch.tensor(here, dtype=torch.int32)
    wait_for(dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=group, async_op=True), check, torch.device("cpu"))
    for fp, mine, theirs in zip(params, here, anywhere.tolist()):
        if theirs and not mine:
            fp._unsharded_param.grad = torch.zeros_like(fp._unsharded_param)


def _zero_missing_grads(root: nn.Module) -> None:
    """Give every unsharded parameter that requires a gradient and has none a zero one (a
    draining rank's reduce-scatter then has the shape of its replicas')."""
    state = _fully_shard().state(root)  # type: ignore[attr-defined]
    for sub in state._state_ctx.all_states:
        for group in _param_groups(sub):
            for fp in group.fsdp_params:
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is not None and unsharded.requires_grad and unsharded.grad is None:
                    unsharded.grad = torch.zeros_like(unsharded)


def _original_uids(root: nn.Module) -> list[tuple[Any, nn.Parameter]]:
    """``(id of the original Parameter, sharded parameter)`` for every parameter that fully_shard
    calls under `root` manage (none on a torch whose FSDP does not record the original)."""
    return [(uid, fp.sharded_param) for fp in _managed(root)
            if (uid := getattr(fp, "_orig_param_uid", None)) is not None]


def sharded_forms(root: nn.Module) -> dict[int, nn.Parameter]:
    """``{id of an unsharded parameter: its sharded parameter}`` for every parameter that fully_shard
    calls under `root` manage and have unsharded once: FSDP registers the unsharded one in the module
    while it is unsharded (between steps too, after a forward outside them)."""
    if _fsdp_module_class() is None:
        return {}
    return {id(unsharded): fp.sharded_param for fp in _managed(root)
            if (unsharded := getattr(fp, "_unsharded_param", None)) is not None}


def _managed(root: nn.Module) -> list[Any]:
    """FSDP's parameter records (``FSDPParam``) of every fully_shard call under `root`, each once."""
    states = {id(st): st for st in (_fully_shard().state(sub) for sub in root.modules() if is_fsdp_module(sub))}  # type: ignore[attr-defined]
    return [fp for state in states.values() for group in _param_groups(state) for fp in group.fsdp_params]


#: the module attribute `note_parameters` sets: ``{parameter fqn in the module: _Original}``
_NOTED = "_zbpp_original_parameters"


class _Original:
    """The Parameter that a stage module's parameter was before ``fully_shard`` (`note_parameters`):
    one object per Parameter, shared by every stage module and name that held it."""

    __slots__ = ("ref", "name")

    def __init__(self, param: nn.Parameter, name: str) -> None:
        self.ref = weakref.ref(param)  # weak: FSDP frees the unsharded original once nothing holds it
        self.name = name  # "stage 0: embed.weight", for messages

    def __repr__(self) -> str:
        return f"_Original({self.name!r})"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # a pickled or copied stage (torch.save(module), deepcopy) keeps which names were one
        # Parameter, not the link to it: a weak reference neither pickles nor means anything there
        return _Original._unlinked, (self.name,)

    @staticmethod
    def _unlinked(name: str) -> "_Original":
        out = _Original.__new__(_Original)
        out.ref, out.name = _no_parameter, name
        return out


def _no_parameter() -> None:
    return None


def note_parameters(stage_modules: Mapping[int, nn.Module]) -> None:
    """Note, before ``fully_shard``, which Parameter each parameter of this rank's stage modules
    is, so that the pipeline finds the sharded copies of a shared or tied one on any torch.

    ``fully_shard`` on each stage module turns a Parameter that two of them share (a V placement's
    embedding and LM head) into one sharded copy per stage, with no link between the copies (FSDP
    2.13 and later records the original's id, older ones nothing), and a Parameter held before it
    (``tied_parameters`` from `zbpp.models.pipeline_stages`) is no longer the stage's. Called with
    all of this rank's stage modules before any is sharded, this records on each module, by
    parameter name (which ``fully_shard`` keeps), a weak reference to the Parameter: the pipeline
    then keeps the copies of one Parameter tied (`FsdpReducer.split_copies`) and takes a
    ``tied_parameters`` entry held from before for its copies. `zbpp.models.pipeline_stages` (and
    so ``causal_lm_stages``) calls it on the stages it builds; a note stands for the Parameter a name
    held when noted, so after tying or untying a stage's weights yourself, call it again before
    ``fully_shard``. (A Parameter from before
    ``fully_shard`` keeps its whole unsharded tensor while anything holds it, such as the
    ``tied_parameters`` of those calls' results: drop them once the `Pipeline` is built.)

    >>> from torch import nn
    >>> a, b = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    >>> b.weight = a.weight  # tied
    >>> note_parameters({0: a, 3: b})
    >>> a._zbpp_original_parameters["weight"] is b._zbpp_original_parameters["weight"]
    True
    """
    if not isinstance(stage_modules, Mapping):
        raise TypeError(f"note_parameters takes {{stage: module}}, got {type(stage_modules).__name__}")
    originals: dict[int, _Original] = {}
    notes: dict[int, dict[str, _Original]] = {}
    for s, m in sorted(stage_modules.items()):
        if not isinstance(m, nn.Module):
            raise TypeError(f"note_parameters: stage {s} is a {type(m).__name__}, not an nn.Module")
        if any(is_fsdp_module(sub) for sub in m.modules()):
            raise ValueError(f"note_parameters: stage {s} is sharded already; call it before fully_shard, "
                             "while the stages still hold the Parameters they were built with")
        notes[s] = {fqn: originals.setdefault(id(p), _Original(p, f"stage {s}: {fqn}"))
                    for fqn, p in m.named_parameters(remove_duplicate=False)}
    for s, m in stage_modules.items():
        setattr(m, _NOTED, notes[s])


def _noted(root: nn.Module) -> list[tuple[_Original, nn.Parameter]] | None:
    """``(original, its copy now)`` for what `note_parameters` noted under `root` (the note may
    sit on a module inside it: a wrapped stage), or None where nothing was noted."""
    noted = [(sub, getattr(sub, _NOTED)) for sub in root.modules() if isinstance(getattr(sub, _NOTED, None), dict)]
    if not noted:
        return None
    return [(original, sub.get_parameter(fqn)) for sub, names in noted for fqn, original in names.items()]


def copies_of(stage_modules: Mapping[int, nn.Module], param: nn.Parameter) -> list[nn.Parameter]:
    """The parameters of `stage_modules` that `param` became (``fully_shard`` replaced it), as
    `note_parameters` noted them; empty where it noted none."""
    out: list[nn.Parameter] = []
    for m in stage_modules.values():
        for original, copy in _noted(m) or ():
            if original.ref() is param and not any(q is copy for q in out):
                out.append(copy)
    return out


def _shared(keyed: Mapping[int, list[tuple[Any, nn.Parameter]]]) -> dict[Any, list[tuple[int, nn.Parameter]]]:
    """``{key: [(stage, copy), ...]}`` from each stage's ``(key, copy)`` pairs, a copy once per key."""
    found: dict[Any, list[tuple[int, nn.Parameter]]] = {}
    for s, pairs in sorted(keyed.items()):
        for key, p in pairs:
            copies = found.setdefault(key, [])
            if not any(q is p for _, q in copies):  # a module may hold it under two names
                copies.append((s, p))
    return found


def _groups(found: Mapping[Any, list[tuple[int, nn.Parameter]]]) -> set[frozenset[int]]:
    """The copies that several stages hold, as sets of ids (whatever key found them)."""
    return {frozenset(id(p) for _, p in copies) for copies in found.values() if len({s for s, _ in copies}) > 1}


def _set_flags(root: nn.Module, sync: bool) -> None:
    root.set_requires_gradient_sync(sync)
    root.set_is_last_backward(sync)
    root.set_reshard_after_backward(sync)


class FsdpReducer:
    """Drive the FSDP2 stage modules of one pipeline rank (see the module docstring).

    `zbpp.Pipeline` builds it when a stage holds a ``fully_shard`` module; it implements the
    pipeline's reducer protocol (``start_step``, ``stage_backward_done``, ``stage_wgrad_done``,
    ``finish``, ``abandon``) plus ``begin_step`` / ``end_step`` that the pipeline calls around every
    step, synchronised or not. Each stage module is its own FSDP root and is reduce-scattered alone;
    a Parameter that two of them shared is one sharded copy per stage (`split_copies`), which
    `zbpp.runtime.tied.TiedParameters` keeps tied.

    Args:
        stage_modules: ``{stage: module}``; every module must itself be a ``fully_shard`` root.
        dp_size: the pipeline's data-parallel size; the FSDP mesh must have as many ranks.
        first_forward: this rank's stages in the order of their first F.
    """

    def __init__(self, stage_modules: Mapping[int, nn.Module], dp_size: int, first_forward: list[int]) -> None:
        if _fsdp_module_class() is None:
            raise RuntimeError("fully_shard stages need FSDP2 (torch.distributed.fsdp.FSDPModule)")
        for s, m in stage_modules.items():
            if not is_fsdp_module(m):
                raise ValueError(
                    f"stage {s} contains fully_shard modules but is not one itself: call "
                    "fully_shard(stage_module, mesh=mesh['dp']) on every stage module (after any inner calls)"
                )
            meshes = {p.device_mesh.size() for p in m.parameters() if hasattr(p, "device_mesh")}
            size = meshes.pop() if len(meshes) == 1 else dp_size
            if size != dp_size:
                raise ValueError(
                    f"stage {s} is sharded over {size} ranks but the pipeline has {dp_size} data-parallel "
                    "replicas: pass the pipeline's mesh (groups=mesh) and fully_shard(stage, mesh=mesh['dp'])"
                )
            m.set_reshard_after_forward(False, recurse=True)
            # the runtime never writes a stage's output in place, which FSDP warns about when it is a view
            warnings.filterwarnings("ignore", category=UserWarning,
                                    message=rf"FSDP2-wrapped module \({re.escape(type(m).__name__)}\) returned a view tensor")
        roots = [(s, _fully_shard().state(m)) for s, m in sorted(stage_modules.items())]  # type: ignore[attr-defined]
        shared = [(a, b) for i, (a, sa) in enumerate(roots) for b, sb in roots[i + 1:] if sa is sb]
        if shared:
            raise ValueError(
                f"stages {list(shared[0])} were sharded by one fully_shard call (fully_shard([...])), which FSDP "
                "cannot run as two roots: call fully_shard(stage_module, mesh=mesh['dp']) on each stage (a Parameter "
                "they share stays tied: see FsdpReducer.split_copies)"
            )
        self.stage_modules = dict(stage_modules)
        #: per stage, the modules that accumulate their weight gradients into ``main_grad``
        self.fused = {s: [sub for sub in m.modules() if getattr(sub, "fuse_wgrad_accumulation", False)]
                      for s, m in self.stage_modules.items()}
        self.order = [s for s in first_forward if s in self.stage_modules]
        self.reduced: dict[int, int] = {s: 0 for s in self.stage_modules}  #: reduce-scatters per stage, this step
        self._draining: Callable[[], bool] | None = None
        #: a gloo group of this rank's replicas (`zbpp.runtime.reductions.presence_group`; `Pipeline` sets it
        #: with replicas): over it they agree which parameters have a gradient before each reduce-scatter
        self.presence_group: Any = None
        #: called while waiting for that agreement (it may raise: the job is broken); `Pipeline` sets it
        self.wait_check: Callable[[], None] | None = None

    def split_copies(self) -> list[list[nn.Parameter]]:
        """The sharded parameters that one Parameter shared by several stages of this rank became,
        each list by stage: ``fully_shard`` on each stage module shards it once per stage, with no
        link between the copies but what `note_parameters` noted before, or else the original's id
        that FSDP records (`_original_uids`)."""
        noted = {s: _noted(m) for s, m in sorted(self.stage_modules.items())}
        missing = [s for s, n in noted.items() if n is None]
        if len(missing) not in (0, len(noted)):
            raise ValueError(
                f"stages {sorted(set(noted) - set(missing))} of this rank were noted by note_parameters but stages "
                f"{missing} were not: call it once with all of this rank's stage modules, before fully_shard"
            )
        recorded = _shared({s: _original_uids(m) for s, m in self.stage_modules.items()})  # empty before torch 2.13
        found = recorded if missing else _shared({s: noted[s] for s in self.stage_modules})
        if not missing and recorded and _groups(recorded) != _groups(found):  # a tie made or broken after the note
            raise ValueError(
                "the stages' Parameters changed between note_parameters and fully_shard (FSDP records other shared "
                "Parameters than were noted): call note_parameters(stages) again after tying or untying weights"
            )
        managed = sum(1 for m in self.stage_modules.values() for p in m.parameters() if hasattr(p, "device_mesh"))
        if missing and len(self.stage_modules) > 1 and managed and not found:
            warnings.warn(
                "this torch's FSDP does not record which Parameter a sharded one came from, so a Parameter that "
                f"stages {sorted(self.stage_modules)} of this rank shared before fully_shard cannot be kept tied "
                "(each stage trains its own copy): call zbpp.runtime.fsdp.note_parameters(stages) before "
                "fully_shard (pipeline_stages and causal_lm_stages do), or use torch 2.13 or later",
                stacklevel=2,
            )
        return [[p for _, p in copies] for copies in found.values() if len({s for s, _ in copies}) > 1]

    # -- around every step ---------------------------------------------------------------------
    def begin_step(self, draining: Callable[[], bool] | None = None) -> None:
        """Before any task: keep FSDP from reducing per microbatch, and all-gather every stage in
        the order of its first F. `draining` tells whether this rank's step failed and is only
        draining (its reduce-scatters then include a zero gradient for every parameter that got
        none, so that they match the other replicas')."""
        self._draining = draining
        for s in self.order:
            m = self.stage_modules[s]
            _set_flags(m, False)
            if not self.fused[s]:
                m.unshard(async_op=True)  # FSDP's pre-forward waits for it
                continue
            for sub in m.modules():  # the unsharded parameters get the main_grad buffers
                if is_fsdp_module(sub):
                    sub.unshard()
            for mod in self.fused[s]:
                for p in mod.parameters(recurse=False):
                    # a frozen one gets none: folded into .grad, its zeros would be reduced, and decayed by AdamW
                    if p.requires_grad and getattr(p, "main_grad", None) is None:  # kept across no_sync steps
                        p.main_grad = torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32),
                                                  device=p.device)

    def end_step(self) -> None:
        """After a step that did not reduce (no_sync, forward only): reshard the parameters; the
        unsharded gradients stay for the next synchronised step."""
        for m in self.stage_modules.values():
            for sub in m.modules():
                if is_fsdp_module(sub):
                    sub.reshard()

    # -- the reducer protocol ------------------------------------------------------------------
    def start_step(self, keep_main_grad: bool = False) -> None:
        self.reduced = {s: 0 for s in self.stage_modules}

    def stage_backward_done(self, stage: int) -> None:
        """Nothing to do: a stage's gradients are final only after its last W."""

    def stage_wgrad_done(self, stage: int) -> None:
        """Reduce-scatter `stage`'s gradients (once per step) and reshard it."""
        m = self.stage_modules[stage]
        _set_flags(m, True)
        drain = self._draining is not None and self._draining()
        try:
            self._fold_main_grads(stage)
            if drain:
                _zero_missing_grads(m)
            if self.presence_group is not None:
                _zero_where_a_replica_has_one(m, self.presence_group, self.wait_check)
            _post_backward(m)
        finally:
            _set_flags(m, False)
        self.reduced[stage] += 1

    def _fold_main_grads(self, stage: int) -> None:
        """Move the unsharded parameters' ``main_grad`` into what FSDP reduces: its accumulation in
        ``reduce_dtype`` under mixed precision (cast to a bf16 parameter's dtype first, the float32
        sum of the microbatches would lose its low bits before a float32 reduce), else ``.grad``."""
        owners = {id(fp._unsharded_param): fp for fp in _fsdp_params(self.stage_modules[stage])
                  if hasattr(fp, "_unsharded_param")}
        for mod in self.fused[stage]:
            for p in mod.parameters(recurse=False):
                main = p.__dict__.pop("main_grad", None)
                if main is None:
                    continue
                fp = owners.get(id(p))
                if fp is not None and fp.reduce_dtype not in (None, p.dtype):
                    _to_reduce_dtype_one(fp)  # a .grad of this step joins the accumulation first
                    acc = fp.unsharded_accumulated_grad
                    fp.unsharded_accumulated_grad = main.to(fp.reduce_dtype) if acc is None else acc.add_(main)
                    continue
                g = main.to(p.dtype)
                p.grad = g if p.grad is None else p.grad.add_(g)

    def finish(self) -> None:
        wrong = {s: n for s, n in self.reduced.items() if n != 1}
        if wrong:
            raise RuntimeError(f"FSDP stages reduce-scattered {wrong} times in the step (once each expected)")

    def abandon(self) -> None:
        """After a failed step: reset FSDP's per-step state and drop the step's unsharded gradients."""
        for m in self.stage_modules.values():
            try:
                _reset(m)
            finally:
                _set_flags(m, False)
