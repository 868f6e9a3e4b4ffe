"""Checkpoints that load into another pipeline layout (torch.distributed.checkpoint).

A checkpoint is keyed by the *whole model's* parameter names, not by stage or rank: build each
stage module so that its ``state_dict()`` keys are the whole model's (delete the blocks a stage does
not hold from a copy of the whole model, or hold the blocks in a ``ModuleDict`` under their
original names). Every rank writes the entries of the stages it holds; DCP writes a tensor that
several ranks hold (data-parallel replicas) once and the shards of a ``fully_shard`` parameter as
shards. Loading reads, on every rank, exactly what its stages hold at the new layout: another
pipeline degree, schedule placement (V or not), data-parallel degree or FSDP sharding, or one
process.

Contents (a nested dict, as ``dcp_to_torch_save`` writes it back)::

    {"format": {"version": 1},                                 # the layout of these entries
     "model": {name: tensor},                                  # every stage's state_dict()
     "optimizer": {"state": {name: {"exp_avg": ..., "step": ...}},
                   "param_groups": {name: {"lr": ..., "betas": ..., ...}}},
     "lr_scheduler": {"state": <pickled state_dict>,            # given lr_scheduler=
                      "kind": "torch.optim.lr_scheduler.StepLR",   # its class (`_kind`)
                      "lineage": <pickled classes and bases>},     # of it and its parts (`_lineage`)
     "grad_scaler": {"state": <pickled state_dict>, "kind": ..., "lineage": ...},  # given grad_scaler=
     "rng": {"step": ..., "seed": ...},                         # a Pipeline's random stream
     "fp8": {"replica0": {"<layer>.<slot>": {"amax_history": ..., "scale": ..., ...}}}}
                                                               # zbpp layers' FP8 scaling state

An empty dict in the optimizer's state or hyperparameters is saved as the string
``"<zbpp.checkpoint: empty dict>"`` (DCP saves a dict's items, so none of an empty one) and loads as
``{}``. The optimizer's state is keyed by parameter name too, under every name a parameter has on the rank
(a tied Parameter shared by two stages: the embedding's and the LM head's), so it follows its
parameter to whichever rank holds it next, one Parameter or copies. `load_checkpoint` says what
comes back (the checkpoint's hyperparameters win). One file for ``nn.Module.load_state_dict``::

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save("ckpt/step-100", "model.pt")
    model.load_state_dict(torch.load("model.pt")["model"])

Every rank of the job calls `save_checkpoint` / `load_checkpoint` together (collective over the
default process group, or `process_group`), between steps. An error on one rank (an optimizer over
another rank's parameters, say) raises on every rank at once: that rank's own error, a
`PipelineError` naming it on the others. In one process without torch.distributed both work too.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import pickle
import warnings
from typing import Any, Iterator, Mapping, NamedTuple

import torch
from torch import nn

from .._compat import scheduler_parts, uncompiled
from ..modules._scaling_state import ScalingRestore, planned_scaling_states, scaling_states, scaling_layers
from .agreement import Agreement, agree_on_problems, collective_call

__all__ = ["save_checkpoint", "load_checkpoint"]

#: The layout of a checkpoint's entries, saved as ``format.version``: a load refuses any other, so a
#: later change of layout says so instead of misreading. Checkpoints saved before it was written have
#: none and are of this first layout.
_FORMAT_VERSION = 1


def _stage_modules(model: Any) -> list[nn.Module]:
    """The modules whose state the checkpoint holds: a Pipeline's stages, a ``{stage: module}``
    mapping's values, or one module."""
    stages = getattr(model, "stage_modules", None)
    if isinstance(stages, Mapping):
        return [uncompiled(m) for m in stages.values()]
    if isinstance(model, Mapping):
        mods = list(model.values())
    elif isinstance(model, nn.Module):
        mods = [model]
    else:
        raise TypeError(
            f"expected a zbpp Pipeline, a mapping {{stage: module}} or an nn.Module, got {type(model).__name__}"
        )
    for m in mods:
        if not isinstance(m, nn.Module):
            raise TypeError(f"expected nn.Module stages, got {type(m).__name__}")
    return [uncompiled(m) for m in mods]  # torch.compile(stage) keeps the stage's own names


def _model_state(mods: list[nn.Module]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in mods:
        for name, value in m.state_dict().items():
            if name in out and out[name] is not value and not _same(out[name], value):
                raise ValueError(
                    f"two stages of this rank hold different tensors named {name!r}: a checkpoint keys "
                    "entries by the whole model's names, so each name must be one tensor"
                )
            out[name] = value
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        local_a = a.to_local() if hasattr(a, "to_local") else a
        local_b = b.to_local() if hasattr(b, "to_local") else b
        return local_a.data_ptr() == local_b.data_ptr()  # one parameter seen through two stages
    return False


def _param_names(mods: list[nn.Module]) -> dict[int, list[str]]:
    """id(parameter) -> every name it has in this rank's stages (a tied Parameter that two stages
    of a V placement share has two: the embedding's and the LM head's)."""
    names: dict[int, list[str]] = {}
    for m in mods:
        for name, p in m.named_parameters(remove_duplicate=False):
            held = names.setdefault(id(p), [])
            if name not in held:
                held.append(name)
    return names


def _optimizer_params(optimizer: torch.optim.Optimizer, names: dict[int, list[str]]) -> list[tuple[list[str], nn.Parameter, dict]]:
    out = []
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"the optimizer's param_groups[{index}] holds a parameter (shape {tuple(p.shape)}) that no stage "
                    "module of this rank holds: build the optimizer over this rank's stage parameters"
                )
            out.append((names[id(p)], p, group))
    return out


_NOT_HYPER = ("params", "param_names")  # the group's parameters and their names: this layout's, not the saved one's


def _hyper(group: dict) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


@collective_call()  # an interrupt while this rank agreed comes once every rank is done
def save_checkpoint(model: Any, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                    *, lr_scheduler: Any = None, grad_scaler: Any = None, process_group: Any = None) -> None:
    """Save this rank's share of the model (and optimizer) state into the DCP checkpoint `path`.

    Args:
        model: a `zbpp.Pipeline`, a mapping ``{stage: module}``, or an ``nn.Module``: the stages of
            this rank, whose ``state_dict()`` keys are the whole model's names (ranks of different
            stages holding different tensors under one name raise a ValueError). A Pipeline's random
            stream (``rng_step`` and its base seed) is saved too, and the FP8 scaling state of its
            ``zbpp.modules`` layers (a Pipeline's: under its data-parallel replica). A Pipeline's
            tied copies are compared first (`Pipeline.check_ties`, where `process_group` is every
            rank of the job): copies that differ raise on every rank and nothing is written.
        path: the checkpoint directory (shared by every rank). A checkpoint there is replaced: its
            ``.metadata`` goes before any rank writes, so a save that fails part-way leaves no
            checkpoint rather than a mix of both (to keep the old one until the new is complete,
            save to a new directory and rename it, as ``examples/train_hf.py`` does).
        optimizer: an optimizer over this rank's stage parameters (plain or ``fully_shard`` ones).
            A parameter's state and hyperparameters are saved under each of its names (a tied
            Parameter that one rank's stages share: under the embedding's and the LM head's name).
        lr_scheduler: a ``torch.optim.lr_scheduler`` (anything with ``state_dict()``) over
            `optimizer`; built alike on every rank, so one copy is kept (ranks whose states
            differ, e.g. in ``last_epoch``, raise on every rank, naming the difference). Its
            per-group lists may differ where they are each rank's own groups' (``base_lrs`` their
            ``initial_lr``, ``_last_lr`` their ``lr``: layer-wise learning rates at pp > 1): a load
            then makes them from the groups it loads, and needs `optimizer`.
        grad_scaler: a ``torch.amp.GradScaler`` (float16 training): its scale and growth tracker,
            one copy for every rank, as `lr_scheduler`'s (ranks whose scales differ raise: they
            skipped different steps, so their stages' weights no longer belong to one run; call
            `zbpp.runtime.unscale_` before each ``scaler.step`` so that every rank skips alike).
        process_group: the ranks that save together; default: every rank of the default group.

    Example (one process; under torchrun every rank does the same with its stages)::

        >>> import tempfile, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_checkpoint(model, d)
        ...     copy = torch.nn.Linear(2, 1)
        ...     load_checkpoint(copy, d)
        >>> torch.equal(copy.weight, model.weight)
        True
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    _raise_if_unusable(model)
    check_ties = getattr(model, "check_ties", None)
    # a Pipeline: copies of a tie that drifted apart raise on every rank, before any write; a collective of
    # every rank of the job, so not where only some of them save (it would wait for the others)
    if callable(check_ties) and _every_rank(process_group):
        check_ties()
    agreement, ranks = _agreement(process_group)
    try:
        state, problem = _state_to_save(model, optimizer, lr_scheduler, grad_scaler), None
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
        state, problem = {}, exc
    # a rank that raised alone would leave the others in DCP's collective until the group's timeout
    kept = ("lr_scheduler", "grad_scaler")  # one copy kept for every rank: theirs must agree
    stages = _stage_key(model)
    try:
        own_groups = problem is None and _lists_of_own_groups(lr_scheduler, optimizer)
    except Exception:  # noqa: BLE001 - a scheduler state it cannot read: judged as any other by _one_kept_state
        own_groups = False
    told = agree_on_problems(agreement, problem, ranks, "save_checkpoint could not run on every rank (nothing "
                             "was saved)", payload=([state.get(k, {}).get("state") for k in kept], stages,
                                                    _name_hashes(state.get("model", {}), stages), own_groups))
    for i, what in enumerate(kept):
        blobs = [states[i] for states, _, _, _ in told]
        if _one_kept_state(what, blobs, ranks, all(own for _, _, _, own in told)):
            # the ranks' per-group lists are their own groups' (layer-wise lrs at pp > 1): one copy, the
            # same bytes on every rank, rebuilt from the loaded groups at any layout (`_kept_states_to_load`)
            state[what]["state"] = next(b for b in blobs if b is not None)
            state[what]["by_rank"] = True
    _one_tensor_per_name(agreement, ranks, state.get("model", {}), [(key, hashes) for _, key, hashes, _ in told])
    with _one_process_quiet():
        dcp.save(state, storage_writer=_writer(os.fspath(path)), process_group=process_group)


def _writer(path: str) -> Any:
    """DCP's file writer for `path`, which first deletes the ``.metadata`` of an earlier save there
    (on the coordinator, once every rank planned, before any writes): DCP overwrites the data files
    in place and writes ``.metadata`` last, so a save failing part-way would leave the old metadata
    over a mix of new and old files, which loads without a word."""
    import torch.distributed.checkpoint as dcp

    class _Writer(dcp.FileSystemWriter):
        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(path, ".metadata"))
            return super().prepare_global_plan(plans)

    return _Writer(path)


#: what a rank does when `_one_kept_state` finds its state unlike another rank's
_KEEP_ALIKE = {
    "lr_scheduler": "build the scheduler alike on every rank (optimizers with the same param groups and learning "
                    "rates), or leave lr_scheduler= out and save each rank's state_dict() yourself",
    "grad_scaler": "the ranks skipped different steps (each found infs in its own gradients only): call "
                   "zbpp.runtime.unscale_(pipe, scaler, optimizer) before scaler.step(optimizer), or leave "
                   "grad_scaler= out and save each rank's state_dict() yourself",
}


def _stage_key(model: Any) -> tuple | None:
    """The stages this rank saves (a Pipeline's or a mapping's keys); None for one module (its place
    in a pipeline is unknown)."""
    stages = getattr(model, "stage_modules", None)
    stages = stages if isinstance(stages, Mapping) else model if isinstance(model, Mapping) else None
    return None if stages is None else tuple(sorted(stages, key=str))


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _name_hashes(model_state: Mapping[str, Any], stages: tuple | None) -> list[int]:
    """What this rank tells of its model's names (8 bytes each): none where its stages are unknown."""
    return [] if stages is None else sorted(_name_hash(n) for n in model_state)


def _fingerprint(value: Any) -> tuple | None:
    """A plain tensor's dtype, shape and bytes, hashed (None: not compared, e.g. a ``fully_shard``
    shard, which differs between ranks by design)."""
    if not isinstance(value, torch.Tensor) or hasattr(value, "placements"):
        return None
    flat = value.detach().reshape(-1).contiguous().cpu()
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return str(value.dtype), tuple(value.shape), hashlib.blake2b(data, digest_size=16).hexdigest()


def _one_tensor_per_name(agreement: Agreement, ranks: list[int], model_state: Mapping[str, Any],
                         told: list[tuple[tuple | None, list[int]]]) -> None:
    """Raise, on every rank, where ranks holding different stages hold different tensors under one
    name: DCP keeps one entry per name (one of them), so a load would give both stages the same one.
    Stages whose modules are named from 0 each (``nn.Sequential`` stages) do that. Names that ranks of
    different stages share are compared only (a second exchange only then): a tie's copies, a
    constant buffer every stage holds, are one tensor."""
    holders: dict[int, set[tuple]] = {}
    for key, hashes in told:
        for h in hashes:
            holders.setdefault(h, set()).add(key)
    shared = {h for h, keys in holders.items() if len(keys) > 1}
    if not shared:
        return
    mine = {n: _fingerprint(v) for n, v in model_state.items() if _name_hash(n) in shared}
    theirs = agree_on_problems(agreement, None, ranks, "save_checkpoint could not compare the stages' names", mine)
    for name in sorted({n for fps in theirs for n in fps}):
        seen: dict[tuple, tuple[int, tuple]] = {}
        for g, (key, _), fps in zip(sorted(ranks), told, theirs):
            fp = fps.get(name)
            if fp is None:
                continue
            other = next(((h, k) for k, (h, f) in seen.items() if k != key and f != fp), None)
            if other is not None:
                raise ValueError(
                    f"global ranks {other[0]} (stages {list(other[1])}) and {g} (stages {list(key)}) hold different "
                    f"tensors named {name!r}: a checkpoint keys entries by the whole model's names and keeps one "
                    "entry per name, so a load would give both stages the same one. Name each stage's modules "
                    "as in the whole model (zbpp.models.hf.causal_lm_stages does); nothing was saved")
            seen.setdefault(key, (g, fp))


def _one_kept_state(what: str, states: list[bytes | None], ranks: list[int], own_groups: bool = False) -> bool:
    """Raise, on every rank, where two ranks' pickled states of `what` (``lr_scheduler`` or
    ``grad_scaler``; `states`, None: not given) differ: the checkpoint keeps one copy (DCP writes
    one rank's), which could not resume both. Except where `own_groups` (every rank's LR scheduler
    lists per param group are its optimizer's groups' own values: `_lists_of_own_groups`) and the
    states differ in those lists only: then True (a load makes them from its loaded groups)."""
    given = [(g, pickle.loads(blob)) for g, blob in zip(sorted(ranks), states) if blob is not None]
    first, theirs = given[0] if given else (None, {})
    if (what == "lr_scheduler" and own_groups and len(given) > 1
            and all(_same_value(_group_lists_out(theirs), _group_lists_out(state)) for _, state in given[1:])):
        return not all(_same_value(theirs, state) for _, state in given[1:])
    for g, state in given[1:]:
        keys = sorted(set(theirs) | set(state), key=lambda k: (str(k).startswith("_"), str(k)))  # public ones first
        differ = [k for k in keys if not _same_value(theirs.get(k), state.get(k))]
        if differ:
            key, also = differ[0], f" (also {', '.join(map(repr, differ[1:]))})" if differ[1:] else ""
            raise ValueError(
                f"{what}'s state differs between global ranks {first} and {g}: {key!r} is {theirs.get(key)!r} "
                f"on {first}, {state.get(key)!r} on {g}{also}. A checkpoint keeps one {what} state for every rank and "
                f"layout: {_KEEP_ALIKE[what]}"
            )
    return False


def _lists_of_own_groups(lr_scheduler: Any, optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether `lr_scheduler` (over `optimizer`, whose groups' hyperparameters the checkpoint keeps
    per parameter) holds per param group only what a load can make from its loaded groups: its
    ``base_lrs`` their ``initial_lr`` and its ``_last_lr`` their ``lr``, position by position, and
    any other per-group list (`_PER_GROUP`) one value throughout; the same in its parts."""
    if lr_scheduler is None or optimizer is None:
        return False
    groups = optimizer.param_groups

    def own(target: Any, state: Any) -> bool:
        if not isinstance(state, Mapping) or getattr(target, "optimizer", None) is not optimizer:
            return False
        for key, value in state.items():
            if key in _FROM_GROUPS:
                if not (isinstance(value, (list, tuple)) and len(value) == len(groups)
                        and all(_same_value(v, g.get(_FROM_GROUPS[key])) for v, g in zip(value, groups))):
                    return False
            elif key in _PER_GROUP and isinstance(value, (list, tuple)):
                if not (len(value) == len(groups) and all(_same_value(value[0], v) for v in value[1:])):
                    return False
        parts, saved_parts = scheduler_parts(target), state.get("_schedulers")
        return not parts or (isinstance(saved_parts, (list, tuple)) and len(saved_parts) == len(parts)
                             and all(own(t, sp) for t, sp in zip(parts, saved_parts)))

    return own(lr_scheduler, lr_scheduler.state_dict())


def _group_lists_out(state: Any) -> Any:
    """A scheduler `state` with its per-group lists (`_lists_of_own_groups`) reduced to what every
    rank must agree on: ``base_lrs`` and ``_last_lr`` to nothing, another per-group list to its one value."""
    if not isinstance(state, Mapping):
        return state
    out: dict[Any, Any] = {}
    for key, value in state.items():
        if key in _FROM_GROUPS:
            out[key] = "<per group>"
        elif key in _PER_GROUP and isinstance(value, (list, tuple)) and value:
            out[key] = ("<per group>", value[0])
        elif key == "_schedulers" and isinstance(value, (list, tuple)):
            out[key] = [_group_lists_out(v) for v in value]
        else:
            out[key] = value
    return out


def _state_to_save(model: Any, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any,
                   grad_scaler: Any = None) -> dict[str, Any]:
    """This rank's share of the checkpoint (no collective: `save_checkpoint` agrees on it first)."""
    mods = _stage_modules(model)
    state: dict[str, Any] = {"format": {"version": _FORMAT_VERSION}, "model": _model_state(mods)}
    if optimizer is not None:
        opt_state: dict[str, Any] = {}
        groups: dict[str, Any] = {}
        for names, p, group in _optimizer_params(optimizer, _param_names(mods)):
            if optimizer.state.get(p) and hasattr(p, "placements"):
                _refuse_plain_tensors(optimizer.state[p], names[0], p)
            for name in names:  # every name: the rank that holds it at the next layout finds it
                if optimizer.state.get(p):
                    opt_state[name] = _mark_empty_dicts(dict(optimizer.state[p]))
                groups[name] = _mark_empty_dicts(_hyper(group))
        state["optimizer"] = {"state": opt_state, "param_groups": groups}
    if lr_scheduler is not None:
        state["lr_scheduler"] = _kept_entry(lr_scheduler)
    if grad_scaler is not None:
        state["grad_scaler"] = _kept_entry(grad_scaler)
    rng = _rng_state(model)
    if rng is not None:
        state["rng"] = rng
    fp8: dict[str, Any] = {}
    for m in mods:
        fp8.update(scaling_states(m))
    if fp8:
        state["fp8"] = {f"replica{_replica(model)}": fp8}
    return state


#: saved in place of an empty dict in the optimizer's state or hyperparameters: DCP saves a dict's
#: items, none for an empty one, which a load then lacked (or, inside a list, turned the list into a dict)
_EMPTY_DICT = "<zbpp.checkpoint: empty dict>"


def _mark_empty_dicts(value: Any) -> Any:
    """`value` with every empty dict inside dicts, lists and tuples replaced by `_EMPTY_DICT`."""
    if isinstance(value, Mapping):
        return {k: _mark_empty_dicts(v) for k, v in value.items()} if value else _EMPTY_DICT
    if isinstance(value, list) or type(value) is tuple:
        return type(value)(_mark_empty_dicts(v) for v in value)
    return value


def _unmark_empty_dicts(value: Any) -> Any:
    """`_mark_empty_dicts` undone on what a load read."""
    if isinstance(value, str) and value == _EMPTY_DICT:
        return {}
    if isinstance(value, dict):
        return {k: _unmark_empty_dicts(v) for k, v in value.items()}
    if isinstance(value, list) or type(value) is tuple:
        return type(value)(_unmark_empty_dicts(v) for v in value)
    return value


def _refuse_plain_tensors(value: Any, name: str, param: nn.Parameter, field: str = "") -> None:
    """Raise on a plain (not DTensor) tensor of more than 0 dims in the optimizer state `value` of
    the ``fully_shard`` parameter `param`: each replica holds its own, DCP keeps one of them under
    the entry's one key, and a load cannot give every replica its own back."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            _refuse_plain_tensors(v, name, param, f"{field}.{k}" if field else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _refuse_plain_tensors(v, name, param, f"{field}[{i}]")
    elif isinstance(value, torch.Tensor) and value.dim() > 0 and not hasattr(value, "placements"):
        raise ValueError(
            f"optimizer state {field!r} of {name!r} is a plain tensor of shape {tuple(value.shape)} beside a fully_shard "
            f"parameter (a DTensor of shape {tuple(param.shape)}): every replica holds its own, the checkpoint could "
            "keep only one of them for all; keep such state as a DTensor sharded like its parameter (or 0-dim)")


@collective_call()  # an interrupt while this rank agreed comes once every rank is done
def load_checkpoint(model: Any, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                    *, lr_scheduler: Any = None, grad_scaler: Any = None, process_group: Any = None) -> None:
    """Load the DCP checkpoint `path` (written by `save_checkpoint` at any layout) into this rank's
    stages, and into `optimizer`, `lr_scheduler` and `grad_scaler` given them.

    What comes back (the run continues as if never stopped):

    - every parameter and buffer of this rank's stages, by name;
    - the optimizer's per-parameter state (``exp_avg``, ``step``, ...), by parameter name: a tied
      Parameter gets the state saved under any of its names, so copies on several ranks and one
      Parameter shared by a V placement's two stages convert into each other. A parameter saved
      without state (it had no gradient yet) has none after loading, as the saved optimizer had.
      Any state comes back (Python values, nested dicts and lists of tensors); a tensor of another
      shape than its parameter's (Adafactor's factored ones) comes back whole, and for a
      ``fully_shard`` parameter raises (the checkpoint does not say how it was split);
    - the optimizer's hyperparameters (``lr``, ``betas``, ``weight_decay``, ... every key of a
      parameter group but ``params`` and ``param_names``): the checkpoint's win over the new
      optimizer's, as with ``torch.optim.Optimizer.load_state_dict``. To change one on resume, set
      it after loading. A group whose parameters were saved with different values (grouped
      otherwise) raises;
    - `lr_scheduler`'s state (``last_epoch``, ``base_lrs``, ...) when given and saved: the next
      ``lr_scheduler.step()`` sets the learning rate the uninterrupted run would have. torch keeps
      per-group values by the group's position; where `optimizer` groups the parameters otherwise
      than the saved one did (another layout's stage holds some of the groups, or they come in
      another order), ``base_lrs`` and ``_last_lr`` are made from the loaded groups' ``initial_lr``
      and ``lr`` (a ReduceLROnPlateau, which has no ``base_lrs``, is matched by its ``_last_lr``),
      and another per-group list (callable ``lr_lambdas``' states, CyclicLR's ``max_lrs``,
      ReduceLROnPlateau's ``min_lrs``) whose values differ between groups raises;
    - `grad_scaler`'s state (its scale and growth tracker) when given and saved, so a float16 run
      skips the steps and scales the losses the uninterrupted run would;
    - a `Pipeline`'s random stream: its base seed and ``rng_step``, so dropout draws what the
      uninterrupted run draws (the new Pipeline's ``seed`` argument is overridden). Not under
      ``seed=False``: its draws come from torch's global generators, which are not saved;
    - the FP8 delayed-scaling state (amax histories, scales) of every ``zbpp.modules`` layer, so
      the next FP8 step casts with the scales the uninterrupted run would use. Each data-parallel
      replica of a Pipeline saves its own (their inputs differ); a replica the checkpoint lacks
      (resumed with more replicas) takes replica 0's. A layer without saved slots starts fresh.

    Arguments as `save_checkpoint`. A name that this rank's stages hold and the checkpoint lacks,
    or holds in another shape, raises a ValueError naming it before anything is loaded (the
    checkpoint may hold more: other ranks' stages). So does an `optimizer`, `lr_scheduler` or
    enabled `grad_scaler` given for a checkpoint saved without one (or with a disabled scaler),
    and a checkpoint of another format version than this zbpp writes (one without a version, saved
    before it was written, loads). A checkpoint without
    ``.metadata`` (a save that did not finish) or with a data file missing or cut short raises,
    naming the file and an entry of it, before anything is loaded; so does an FP8 entry that is not
    as `save_checkpoint` writes it (another format, a field missing), naming it, and an
    ``lr_scheduler`` or ``grad_scaler`` entry that does not unpickle, was saved from another kind
    (its class, recorded at save with the classes it derives from: a StepLR's state for a
    CosineAnnealingLR, which torch's own load would take unchecked; a subclass's state and its base
    class's load into each other only where their ``state_dict()`` keys are the same; for a
    checkpoint saved before classes were recorded, keys that the given one's ``state_dict()``
    lacks or has besides, or a SequentialLR's or ChainedScheduler's parts' do, or their number:
    kinds of the same keys, a LambdaLR's and a MultiplicativeLR's, load into each other unseen),
    or does not load into the given one (tried on a copy of it first, one that shares what cannot
    be copied, as a bound method's object). A checkpoint whose values under the names of one tied
    parameter differ (saved from a model without the tie) raises too: before anything loads where
    this rank's stages share it as one Parameter, and on every rank after loading (a `Pipeline`'s
    ``check_ties``, where `process_group` is every rank of the job) where its copies are apart.

    A read that fails part-way (an I/O error, a damaged file) raises a RuntimeError on every rank,
    naming the rank and the cause, and leaves the model, the optimizer and the rest as they were:
    DCP reads into new tensors, copied into the stages and the optimizer once every rank read all.
    That costs one more copy of this rank's model state (parameters and buffers, its shards under
    ``fully_shard``) and optimizer state in host memory while loading, wherever the model lives
    (on a GPU: none in GPU memory; not pinned, so the copies onto the GPU go at pageable speed),
    beside DCP's own read buffers; on a torch without DCP's ``CheckpointableTensor`` protocol the
    shards' copy is on their device. The optimizer's new tensors are made on the device before
    anything changes on any rank, so a move that fails there (out of memory) raises on every rank
    and loads nothing. A live state tensor of the loaded one's shape, dtype and device (and
    sharding) takes its value in place after, so a rollback into a live optimizer needs no second
    copy of its state on the device; a live one that does not match (another dtype, say) is
    replaced by a new one, both held until every rank made its own.

    In one process, a resumed optimizer keeps the saved ``lr`` and step count:

    >>> import tempfile, torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> with tempfile.TemporaryDirectory() as d:
    ...     save_checkpoint(model, d, opt)
    ...     copy = torch.nn.Linear(2, 1)
    ...     copy_opt = torch.optim.AdamW(copy.parameters(), lr=1.0)
    ...     load_checkpoint(copy, d, copy_opt)
    >>> torch.equal(copy.weight, model.weight), copy_opt.param_groups[0]["lr"]
    (True, 0.1)
    >>> int(copy_opt.state[copy.weight]["step"])
    1
    """
    _raise_if_unusable(model)
    path = os.fspath(path)
    agreement, ranks = _agreement(process_group)
    try:
        loading, problem = _state_to_load(model, path, optimizer, lr_scheduler, grad_scaler), None
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
        loading, problem = None, exc
    # a rank that raised alone would leave the others in DCP's collective until the group's timeout
    agree_on_problems(agreement, problem, ranks, "load_checkpoint could not run on every rank (nothing was loaded)")
    assert loading is not None  # else agree_on_problems raised
    first, rest = _split(loading.state)
    _read(first, path, process_group, ranks)  # every rank reads both parts (DCP's collectives), whatever it asks of each
    try:
        if optimizer is not None:
            _one_value_per_group(optimizer, loading.wanted, loading.state["optimizer"]["param_groups"])
        kept, problem = _kept_states_to_load(loading, lr_scheduler, grad_scaler, path, optimizer), None
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
        kept, problem = {}, exc
    agree_on_problems(agreement, problem, ranks, "load_checkpoint could not run on every rank (nothing was loaded)")
    _read(rest, path, process_group, ranks)
    try:  # the optimizer's new tensors on the device (out of memory, say) and the FP8 slots checked, before
        # any rank changes anything
        _one_value_per_tensor(loading, path)
        placing = _optimizer_to_place(loading, optimizer) if optimizer is not None else []
        scaling, problem = _scaling_to_restore(loading, path), None
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
        placing, scaling, problem = [], [], exc
    agree_on_problems(agreement, problem, ranks, "load_checkpoint could not run on every rank (nothing was loaded)")
    try:
        _apply_loaded(loading, model, optimizer, lr_scheduler, grad_scaler, placing, scaling, kept)
        problem = None
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
        problem = exc
    # else the other ranks would go on training from the checkpoint without the failed one
    agree_on_problems(agreement, problem, ranks,
                      "load_checkpoint could not finish on every rank (this rank's state is loaded, the failed rank's partly)")
    check_ties = getattr(model, "_check_ties", None)
    # a Pipeline's copies of a tie on several ranks (or FSDP's split copies) read their names' values: a checkpoint
    # holding different ones (of a model without the tie) would leave them apart; as in save_checkpoint, a
    # collective of every rank of the job
    if callable(check_ties) and _every_rank(process_group):
        check_ties(loaded_from=path)


def _every_rank(process_group: Any) -> bool:
    """Whether `process_group` (None: the default one) holds every rank of the job: a Pipeline's tie
    comparison is a collective of all of them."""
    import torch.distributed as dist

    if process_group is None or not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_world_size(process_group) == dist.get_world_size()


def _read(state: dict[str, Any], path: str, process_group: Any, ranks: list[int]) -> None:
    """DCP's read of checkpoint `path` into `state`, collective over `process_group` (global `ranks`).
    A read that fails on a rank (an I/O error part-way) raises on every rank (DCP gathers the
    failures) an error that names the ranks and the cause, and says that nothing was loaded: DCP's
    own, a ``CheckpointException``, is no ``Exception`` and wraps each rank's traceback."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _one_process_quiet():
            dcp.load(state, checkpoint_id=path, process_group=process_group)
    except CheckpointException as exc:
        failed = sorted(exc.failures)
        cause = exc.failures[failed[0]][0] if failed else exc
        on = ", ".join(str(ranks[r]) if r < len(ranks) else str(r) for r in failed)
        raise RuntimeError(f"reading the checkpoint {path!r} failed on global rank {on}: {type(cause).__name__}: "
                           f"{cause}; nothing was loaded (the model and optimizer are as before)") from exc


class _Loading(NamedTuple):
    """What this rank asks of the checkpoint (`_state_to_load`), for `_apply_loaded`."""

    mods: list[nn.Module]
    model_state: dict[str, Any]  #: new host tensors DCP reads the model's entries into (`_staging`), copied in after
    state: dict[str, Any]  #: the destinations DCP reads into
    wanted: list[tuple[str, nn.Parameter, dict]]  #: (saved name, parameter, its group) of the optimizer's parameters
    restore_rng: bool
    shared: list[list[str]]  #: the names of each tensor that this rank's stages hold under several (a tie)


def _state_to_load(model: Any, path: str, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any,
                   grad_scaler: Any = None) -> _Loading:
    """The destinations of this rank's share of checkpoint `path` (no collective: `load_checkpoint`
    agrees on them first)."""
    mods = _stage_modules(model)
    live = _model_state(mods)
    metadata = _complete_metadata(path)
    meta = metadata.state_dict_metadata
    paths = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    _check_format(path, meta)
    _check_model_entries(live, meta, path)
    # not into the stages' own tensors: a read failing part-way would leave the model half loaded
    model_state = {k: _staging(v) if isinstance(v, torch.Tensor) else v for k, v in live.items()}
    state: dict[str, Any] = {"model": model_state}
    wanted: list[tuple[str, nn.Parameter, dict]] = []
    if optimizer is not None:
        if not _saved(meta, "optimizer."):  # else the optimizer would silently keep its fresh state
            raise ValueError(f"the checkpoint {path!r} holds no optimizer state (saved without optimizer=)")
        opt_state: dict[str, dict[str, Any]] = {}
        groups: dict[str, Any] = {}
        for names, p, group in _optimizer_params(optimizer, _param_names(mods)):
            name = next((n for n in names if _saved(meta, f"optimizer.param_groups.{n}.")), names[0])
            wanted.append((name, p, group))
            entry = _optimizer_destination(meta, paths, name, p, path)
            if entry:
                opt_state[name] = entry
            hyper = _saved_under(meta, paths, ("optimizer", "param_groups", name),  # a tensor lr is a tensor
                                 lambda key, md: _placeholder(md))
            hyper = {k: v for k, v in hyper.items() if k not in _NOT_HYPER}
            if hyper:
                groups[name] = hyper
        state["optimizer"] = {"state": opt_state, "param_groups": groups}
    if lr_scheduler is not None:
        if "lr_scheduler.state" not in meta:
            raise ValueError(f"the checkpoint {path!r} holds no LR scheduler state (saved without lr_scheduler=)")
        state["lr_scheduler"] = _kept_destination(meta, "lr_scheduler")
    if grad_scaler is not None:
        if "grad_scaler.state" not in meta:
            raise ValueError(f"the checkpoint {path!r} holds no GradScaler state (saved without grad_scaler=)")
        state["grad_scaler"] = _kept_destination(meta, "grad_scaler")
    restore_rng = hasattr(model, "rng_step") and "rng.step" in meta
    if restore_rng:
        state["rng"] = {"step": None, "seed": None}
    replica, fp8 = _fp8_destinations(meta, mods, _replica(model))
    if fp8:
        state["fp8"] = {replica: fp8}
    return _Loading(mods, model_state, state, wanted, restore_rng, _shared_names(live))


def _shared_names(live: Mapping[str, Any]) -> list[list[str]]:
    """The names of each tensor of `live` (this rank's model state) held under several: a tied
    Parameter that two stages of a V placement share, say."""
    by_tensor: dict[tuple[Any, ...], list[str]] = {}
    for name, value in live.items():
        if not isinstance(value, torch.Tensor):
            continue
        local = value.to_local() if hasattr(value, "to_local") else value
        try:
            ptr = local.data_ptr()
        except RuntimeError:  # a tensor without storage
            continue
        if ptr:  # not an empty or meta tensor (every one at address 0, and nothing to load)
            key = (ptr, local.device, local.dtype, tuple(local.shape), tuple(local.stride()))
            by_tensor.setdefault(key, []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def _one_value_per_tensor(loading: _Loading, path: str) -> None:
    """Raise where the checkpoint `path` holds different values under two names of one tensor of
    this rank (`_Loading.shared`): the tensor takes one, and whichever loaded last would win unseen
    (saved from a model without this tie)."""
    for names in loading.shared:
        values = [loading.model_state[n] for n in names]
        local = [v.to_local() if hasattr(v, "to_local") else v for v in values]
        for name, value in zip(names[1:], local[1:]):
            if not _same_bits(local[0], value):
                raise ValueError(
                    f"the checkpoint {path!r} holds different values under {names[0]!r} and {name!r}, which are one "
                    "tied parameter in this rank's stages: saved from a model without this tie? nothing was loaded")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` hold the same bits (NaNs too), as `Pipeline.check_ties` compares tied copies."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _staging(value: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new tensor (of `dtype`, default `value`'s: DCP casts) that DCP reads the saved value of
    model entry `value` (or an optimizer state shaped like parameter `value`) into, copied into
    place once every rank read all (`_apply_loaded`): in host memory, not pinned, wherever `value`
    lives (DCP reads files through host memory anyway; a copy on an accelerator would take its memory,
    and page-locking the whole state costs about as much as the one copy it would speed up). A
    ``fully_shard`` DTensor's shard too, where this torch can read into a plain tensor (else a
    DTensor like it, on its device: `dcp_host_shard`)."""
    if hasattr(value, "placements"):
        from .._compat import dcp_host_shard

        staged = dcp_host_shard(value, dtype)
        return staged if staged is not None else torch.empty_like(value, dtype=dtype)
    return torch.empty(tuple(value.shape), dtype=dtype or value.dtype, device="cpu")


def _into_live(live: Any, staged: Any) -> Any:
    """What ``load_state_dict`` gets for an entry whose stage value is `live` and whose read value
    is `staged`: `staged`, but for a DTensor read into a plain host tensor (`_staging`), which is
    copied into the DTensor's shard here (``load_state_dict`` would mix a plain tensor with a
    DTensor) and `live` itself given (copied onto itself)."""
    if hasattr(live, "placements") and isinstance(staged, torch.Tensor) and not hasattr(staged, "placements"):
        with torch.no_grad():
            live.to_local().copy_(staged)
        return live
    return staged


def _complete_metadata(path: str) -> Any:
    """The metadata of checkpoint `path`, once every file it points into is there whole: else DCP
    fails part-way through reading, with this rank's tensors half overwritten and an error (an
    ``EOFError``) that names no entry. DCP writes ``.metadata`` last, so a save that did not finish
    has none; a file missing or short is a copy cut short, or a directory not shared by the ranks."""
    import torch.distributed.checkpoint as dcp

    from .._compat import dcp_file_extents

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"no checkpoint at {path!r}: it holds no .metadata (written last: a save that did "
                                "not finish, or not a checkpoint directory); nothing was loaded")
    metadata = dcp.FileSystemReader(path).read_metadata()
    for file, (need, names) in dcp_file_extents(metadata).items():
        full = os.path.join(path, file)
        size = os.path.getsize(full) if os.path.isfile(full) else None
        if size is None or size < need:
            first = next((n for n in names if n.startswith("model.")), names[0])  # a weight says most
            holds = f"{first!r}" + (f" and {len(names) - 1} more entries" if len(names) > 1 else "")
            what = "is missing" if size is None else f"holds {size} bytes, its entries need {need}"
            raise ValueError(f"the checkpoint {path!r} is incomplete: {file} {what} (it holds {holds}): a copy cut "
                             "short, or a directory not shared by every rank that saved; nothing was loaded")
    return metadata


def _check_format(path: str, meta: Mapping[str, Any]) -> None:
    """Raise, naming both, where checkpoint `path` is of another format version than this code
    reads, before any other check (a later layout may name its entries otherwise). This rank reads
    the one small entry alone (``no_dist``: no collective, as each rank may fail here)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if "format.version" not in meta:
        return  # saved before versions were written: the first layout
    state: dict[str, Any] = {"format": {"version": None}}
    try:
        with _one_process_quiet(alone=True):
            dcp.load(state, checkpoint_id=path, no_dist=True)
    except CheckpointException as exc:  # no Exception: load_checkpoint's agreement would let it by
        cause = next(iter(exc.failures.values()))[0] if exc.failures else exc
        raise ValueError(f"the checkpoint {path!r}: its format version could not be read ({type(cause).__name__}: "
                         f"{cause}); nothing was loaded") from exc
    version = state["format"]["version"]
    if version != _FORMAT_VERSION:
        raise ValueError(f"the checkpoint {path!r} is of format version {version!r}, this zbpp reads version "
                         f"{_FORMAT_VERSION} only (saved by another zbpp release?); nothing was loaded")


def _check_model_entries(model_state: Mapping[str, Any], meta: Mapping[str, Any], path: str) -> None:
    """Raise, naming it, for an entry of this rank's stages that checkpoint `path` lacks or holds in
    another shape (saved from another model): DCP's own error is a ``CheckpointException``, which
    ``except Exception`` lets by, around a traceback."""
    missing = [name for name in model_state if f"model.{name}" not in meta]
    if missing:
        more = f" (nor {len(missing) - 1} more entr{'y' if len(missing) == 2 else 'ies'} of this rank's stages)" \
            if len(missing) > 1 else ""
        raise ValueError(f"the checkpoint {path!r} holds no {missing[0]!r}{more}: saved from another model?")
    for name, value in model_state.items():
        saved = getattr(meta[f"model.{name}"], "size", None)
        if saved is not None and isinstance(value, torch.Tensor) and tuple(saved) != tuple(value.shape):
            raise ValueError(f"the checkpoint {path!r} holds {name!r} of shape {tuple(saved)}, this rank's of shape "
                             f"{tuple(value.shape)}: saved from another model?")


def _split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`state` as two reads: first the small entries (the optimizer's hyperparameters, the LR
    scheduler's, the GradScaler's and the random stream's state), checked before the second
    overwrites anything in place (the model's and the optimizer's tensors, the FP8 state). Both share `state`'s dicts, so
    DCP's reads fill it."""
    first = {k: state[k] for k in ("lr_scheduler", "grad_scaler", "rng") if k in state}
    rest = {k: v for k, v in state.items() if k not in first and k != "optimizer"}
    if "optimizer" in state:
        first["optimizer"] = {"param_groups": state["optimizer"]["param_groups"]}
        rest["optimizer"] = {"state": state["optimizer"]["state"]}
    return first, rest


class _Placing(NamedTuple):
    """One parameter's loaded optimizer state, made on its device (`_optimizer_to_place`), not yet
    in the optimizer."""

    name: str  #: the name its state and hyperparameters were read under
    param: nn.Parameter
    group: dict
    state: Any  #: its new state (live tensors where they take the value in place), None: saved without
    copies: list[tuple[torch.Tensor, torch.Tensor]]  #: (live tensor, value read) copied in place once applied


def _optimizer_to_place(loading: _Loading, optimizer: torch.optim.Optimizer) -> list[_Placing]:
    """Every loaded optimizer state tensor of this rank where it goes (`_placed`), changing neither
    the optimizer nor its tensors: a move onto the device that fails (out of memory) leaves both as
    they were, on every rank (`load_checkpoint` agrees on it before applying anything)."""
    loaded, hyper = loading.state["optimizer"]["state"], loading.state["optimizer"]["param_groups"]
    reused: set[int] = set()  # live state tensors copied into: each takes one value
    out = []
    for name, p, group in loading.wanted:
        # saved without state (it had no gradient yet): none, not the live optimizer's own, which would go on unseen
        staged = _unmark_empty_dicts(dict(loaded[name])) if name in loaded else None
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        if staged is not None:
            # the group as loaded (the checkpoint's fused or capturable wins) says where its step goes
            step = _step_home(optimizer, {**group, **_unmark_empty_dicts(dict(hyper.get(name, {})))}, p)
            keep = _reusable(staged, optimizer.state.get(p), p, step, reused)
            staged = _placed(staged, keep, p, step, copies)
        out.append(_Placing(name, p, group, staged, copies))
    return out


def _scaling_to_restore(loading: _Loading, path: str) -> list[ScalingRestore]:
    """The FP8 slots read for each stage, checked and made (`planned_scaling_states`), not yet
    given to its layers: a damaged or foreign one raises, naming its entry, before anything loads."""
    replica, fp8 = next(iter(loading.state.get("fp8", {}).items()), ("replica0", {}))
    try:  # every zbpp layer gets the saved slots, or none where none were saved
        return [planned_scaling_states(m, fp8) for m in loading.mods]
    except ValueError as exc:
        raise ValueError(f"the checkpoint {path!r}, under 'fp8.{replica}': {exc}; nothing was loaded") from exc


def _apply_loaded(loading: _Loading, model: Any, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any,
                  grad_scaler: Any, placing: list[_Placing], scaling: list[ScalingRestore],
                  kept: Mapping[str, Any]) -> None:
    """Put what DCP read (`loading.state`) into the stages, their FP8 slots (as `scaling` made
    them), `optimizer` (its state as `placing` made it), `lr_scheduler` and `grad_scaler` (their
    states as `_kept_states_to_load` unpickled them) and `model`'s random stream."""
    state = loading.state
    for m in loading.mods:  # a host tensor's copy onto the device is made entry by entry, none kept
        m.load_state_dict({k: _into_live(v, loading.model_state[k]) for k, v in m.state_dict().items()})
    for restore in scaling:
        restore.apply()
    if optimizer is not None:
        groups = state["optimizer"]["param_groups"]
        for name, p, group, new, copies in placing:
            with torch.no_grad():
                for live, value in copies:
                    live.copy_(value)
            optimizer.state.pop(p, None)  # the live tensors not taken into `new` go
            if new is not None:
                optimizer.state[p] = new
            for key, value in groups.get(name, {}).items():
                if _fits(group.get(key), value):
                    group[key].copy_(value)  # in place: an LR scheduler or a captured step holds this tensor
                else:
                    group[key] = _unmark_empty_dicts(value)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(kept["lr_scheduler"])
    if grad_scaler is not None:
        grad_scaler.load_state_dict(kept["grad_scaler"])
    if loading.restore_rng:
        model.rng_step = int(state["rng"]["step"])
        model._base_seed = int(state["rng"]["seed"])


#: optimizers that make ``step`` on the parameter's device whatever their flags (the others: on the CPU
#: unless fused or capturable); torch's load keeps it where saved, which a checkpoint does not say
_STEP_ON_THE_DEVICE = (torch.optim.ASGD,)


def _step_home(optimizer: torch.optim.Optimizer, group: Mapping[str, Any],
               param: nn.Parameter) -> tuple[torch.device, torch.dtype | None]:
    """Where `param`'s ``step`` goes, and its dtype (None: as saved), as `optimizer` keeps it on
    the parameter's device (so ``Optimizer.load_state_dict`` of a state saved there): a fused or
    capturable group's (`group` as loaded: the checkpoint's flags) on the parameter's device in
    float32 (its kernels read it there), an ASGD's there too (it makes it there), any other on the
    CPU (torch's optimizers make it there or read it as a number)."""
    if group.get("fused") or group.get("capturable"):
        return param.device, torch.float32
    if isinstance(optimizer, _STEP_ON_THE_DEVICE):
        return param.device, None
    return torch.device("cpu"), None


def _state_home(staged: torch.Tensor, path: tuple[Any, ...], param: nn.Parameter,
                step: tuple[torch.device, torch.dtype | None]) -> tuple[torch.device, bool, torch.dtype]:
    """Where the optimizer state tensor `staged` (read into host memory, or a DTensor where this
    torch could not) at `path` in `param`'s state goes: (device, sharded like `param`, dtype), as
    ``Optimizer.load_state_dict`` puts it. ``step`` where `step` says (`_step_home`); any other on
    the parameter's device (0-dim ones too: ASGD's ``eta``, NAdam's ``mu_product``), sharded like a
    ``fully_shard`` parameter where shaped like it."""
    if path == ("step",):
        return step[0], False, step[1] or staged.dtype
    return param.device, hasattr(param, "placements") and staged.dim() == param.dim(), staged.dtype


def _fits_in_place(live: Any, staged: torch.Tensor, home: tuple[torch.device, bool, torch.dtype],
                   param: nn.Parameter) -> bool:
    """The live optimizer state tensor `live` can take `staged`'s value in place: where `staged`
    goes (`home`, `_state_home`), of its shape and dtype (sharded like `param`, of the same local
    shape, for a ``fully_shard`` parameter's)."""
    device, sharded, dtype = home
    if not isinstance(live, torch.Tensor) or live.dtype != dtype or hasattr(live, "placements") != sharded:
        return False
    if sharded:
        local = staged.to_local() if hasattr(staged, "placements") else staged
        return (live.shape == param.shape and live.placements == param.placements
                and live.device_mesh == param.device_mesh and live.to_local().shape == local.shape)
    return live.shape == staged.shape and live.device == device


def _reusable(staged: Any, live: Any, param: nn.Parameter, step: tuple[torch.device, torch.dtype | None],
              reused: set[int]) -> dict[tuple[Any, ...], torch.Tensor]:
    """The tensors of `param`'s live optimizer state `live` that take the value read at the same
    path of `staged` in place (`_fits_in_place`), by path: kept rather than replaced, none made
    anew on the device, and one that a captured step or another holder reads stays current. A
    tensor already in `reused` (held twice) is not: it would take only the last of its values."""
    out: dict[tuple[Any, ...], torch.Tensor] = {}

    def walk(new: Any, old: Any, path: tuple[Any, ...]) -> None:
        if isinstance(new, Mapping):
            for key, value in new.items():
                walk(value, old.get(key) if isinstance(old, Mapping) else None, path + (key,))
        elif isinstance(new, (list, tuple)):
            for i, value in enumerate(new):
                walk(value, old[i] if isinstance(old, (list, tuple)) and i < len(old) else None, path + (i,))
        elif isinstance(new, torch.Tensor) and id(old) not in reused \
                and _fits_in_place(old, new, _state_home(new, path, param, step), param):
            reused.add(id(old))
            out[path] = old

    walk(staged, live, ())
    return out


def _placed(staged: Any, keep: Mapping[tuple[Any, ...], torch.Tensor], param: nn.Parameter,
            step: tuple[torch.device, torch.dtype | None], copies: list[tuple[torch.Tensor, torch.Tensor]],
            path: tuple[Any, ...] = ()) -> Any:
    """`param`'s optimizer state as read (`staged`, nested as saved), each tensor where it goes
    (`_state_home`): the live tensor `keep` holds at its path (its copy from the value read is
    added to `copies`, made when applied), else a new one (from host memory)."""
    if isinstance(staged, Mapping):
        return {k: _placed(v, keep, param, step, copies, path + (k,)) for k, v in staged.items()}
    if isinstance(staged, list) or type(staged) is tuple:
        return type(staged)(_placed(v, keep, param, step, copies, path + (i,)) for i, v in enumerate(staged))
    if not isinstance(staged, torch.Tensor):
        return staged
    device, sharded, dtype = _state_home(staged, path, param, step)
    live = keep.get(path)
    with torch.no_grad():
        if live is not None:
            copies.append((live.to_local() if sharded and not hasattr(staged, "placements") else live, staged))
            return live
        if hasattr(staged, "placements"):  # read on its device, sharded like its parameter
            return staged.to(dtype=dtype)
        if sharded:
            new = torch.empty_like(param.detach(), dtype=dtype)  # a DTensor sharded like the parameter
            new.to_local().copy_(staged)
            return new
        return staged.to(device=device, dtype=dtype)


def _kept_entry(target: Any) -> dict[str, Any]:
    """The ``lr_scheduler`` or ``grad_scaler`` entry of `target`: its pickled state, its class
    (`_kind`) and the classes it derives from (`_lineage`)."""
    return {"state": pickle.dumps(target.state_dict()), "kind": _kind(target),
            "lineage": pickle.dumps(_lineage(target))}


def _kept_destination(meta: Mapping[str, Any], what: str) -> dict[str, Any]:
    """What DCP reads the ``lr_scheduler`` or ``grad_scaler`` entry into: its pickled state, and
    its class and lineage where saved (checkpoints saved before they were recorded have none)."""
    return {"state": None, **{k: None for k in ("kind", "lineage", "by_rank") if f"{what}.{k}" in meta}}


def _kind(target: Any) -> str:
    """The class of `target` (an LR scheduler or a GradScaler), by module and qualified name, with
    those of a ``SequentialLR``'s or ``ChainedScheduler``'s schedulers in order: torch's own loads
    take another kind's state unchecked (``__dict__.update``). torch's same-named subclasses
    (``torch.cuda.amp.GradScaler`` of ``torch.amp.GradScaler``) count as their base: one state."""
    cls = type(target)
    while (cls.__module__.startswith("torch.") and cls.__bases__ and cls.__bases__[0].__qualname__ == cls.__qualname__
           and cls.__bases__[0].__module__.startswith("torch.")):
        cls = cls.__bases__[0]
    parts = scheduler_parts(target)
    inner = f"({', '.join(_kind(part) for part in parts)})" if parts else ""
    return f"{cls.__module__}.{cls.__qualname__}{inner}"


def _lineage(target: Any) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """The classes of `target` (an LR scheduler or a GradScaler) and those it derives from, by
    module and qualified name, its own first; with a ``SequentialLR``'s or ``ChainedScheduler``'s
    schedulers' lineages in order. A load takes a state of a class related to the given one's
    (`_related`) where nothing of either state is left out."""
    names = tuple(f"{c.__module__}.{c.__qualname__}" for c in type(target).__mro__ if c is not object)
    return names, tuple(_lineage(part) for part in scheduler_parts(target))


def _related(lineage: Any, target: Any) -> bool:
    """`target` is of a class that the saved `lineage` (`_lineage`) derives from, or one that
    derives from it, and so is each of its parts, position by position."""
    try:
        names, parts = lineage
        own = _lineage(target)[0]
        return ((names[0] in own or own[0] in names) and len(parts) == len(scheduler_parts(target))
                and all(_related(p, t) for p, t in zip(parts, scheduler_parts(target))))
    except (TypeError, ValueError, IndexError):  # not as `_lineage` writes it
        return False


def _state_mismatch(saved: Any, target: Any, path: str = "") -> str | None:
    """How the saved state `saved` differs from `target`'s own ``state_dict()`` in its keys, those
    of a ``SequentialLR``'s or ``ChainedScheduler``'s parts' states (``_schedulers``, which
    torch loads by position, unchecked) and their number; None where it does not. A phrase
    after "its entry"; `path`: where `saved` is in the entry (``_schedulers[1]``)."""
    own, at = target.state_dict(), f"at {path} " if path else ""
    if not (isinstance(saved, Mapping) and isinstance(own, Mapping)):
        return None
    lacks, besides = [repr(k) for k in own if k not in saved], [repr(k) for k in saved if k not in own]
    if lacks or besides:
        return f"{at}" + " and ".join(([f"lacks {', '.join(lacks)}"] if lacks else [])
                                      + ([f"has {', '.join(besides)} besides"] if besides else []))
    parts, saved_parts = scheduler_parts(target), saved.get("_schedulers")
    if not parts or not isinstance(saved_parts, (list, tuple)):
        return None
    if len(saved_parts) != len(parts):
        return f"{at}holds {len(saved_parts)} schedulers in _schedulers, not {len(parts)}"
    for i, (state, part) in enumerate(zip(saved_parts, parts)):
        found = _state_mismatch(state, part, f"{path + '.' if path else ''}_schedulers[{i}]")
        if found:
            return found
    return None


def _kept_states_to_load(loading: _Loading, lr_scheduler: Any, grad_scaler: Any, path: str,
                         optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """The saved states of `lr_scheduler` and `grad_scaler` (those given), unpickled, checked to be
    of their kind and tried on copies of them: a damaged entry (it does not unpickle) or one of
    another kind (a StepLR's for a CosineAnnealingLR, which torch's own load takes unchecked; a
    subclass's for its base class, or the other way, where either state has a key the other lacks)
    raises, naming the entry, before anything loads (their ``load_state_dict`` raised only after
    the model and the optimizer were loaded, and may change part of them first)."""
    out: dict[str, Any] = {}
    for what, target in (("lr_scheduler", lr_scheduler), ("grad_scaler", grad_scaler)):
        if target is None:
            continue
        try:
            state = pickle.loads(loading.state[what]["state"])
        except Exception as exc:  # noqa: BLE001 - whatever a damaged pickle raises
            raise ValueError(f"the checkpoint {path!r}: its {what!r} entry does not unpickle ({type(exc).__name__}: "
                             f"{exc}): damaged; nothing was loaded") from exc
        if what == "grad_scaler" and grad_scaler.is_enabled() and not state:
            raise ValueError(f"the checkpoint {path!r} holds the state of a disabled GradScaler (none to resume): "
                             "give load_checkpoint a disabled one, or none")
        saved_kind, kind = loading.state[what].get("kind"), _kind(target)
        related = saved_kind is not None and saved_kind != kind and _related(_lineage_of(loading, what), target)
        if saved_kind is not None and saved_kind != kind and not related:
            raise ValueError(f"the checkpoint {path!r}: its {what!r} entry was saved from a {saved_kind}, the given "
                             f"{what} is a {kind}: build the {what} as the saved run did; nothing was loaded")
        # a subclass's state in its base class or the other way round: only where neither leaves any of it out
        if related and (found := _state_mismatch(state, target)):
            raise ValueError(f"the checkpoint {path!r}: its {what!r} entry, saved from a {saved_kind}, {found}, unlike "
                             f"the given {what}'s state_dict() ({kind}, of a class related to it): a state would not "
                             f"come back whole; build the {what} as the saved run did; nothing was loaded")
        by_rank = what == "lr_scheduler" and loading.state[what].get("by_rank") is True
        if by_rank and optimizer is None:
            raise ValueError(f"the checkpoint {path!r}: its 'lr_scheduler' entry was saved by ranks holding different "
                             "param groups (one copy kept: each rank's per-group values come from its groups in the "
                             "saved optimizer state); give load_checkpoint the optimizer too; nothing was loaded")
        if by_rank and getattr(target, "optimizer", None) is not optimizer:  # else its lists would stay one rank's
            raise ValueError(f"the checkpoint {path!r}: its 'lr_scheduler' entry was saved by ranks holding different "
                             "param groups, and the given lr_scheduler is not over the given optimizer, whose groups "
                             "would complete it; nothing was loaded")
        if by_rank:  # saved by ranks of different groups: every per-group list from the groups this load leaves
            groups = _loaded_groups(optimizer, loading)
            loaded = [g.get("initial_lr") for g in groups]
            state = _rebased(state, target, optimizer, groups,
                             ("values saved by ranks of other groups", f"initial_lr as loaded {loaded!r}"), path)
        elif what == "lr_scheduler" and optimizer is not None:
            state = _regrouped(state, target, optimizer, _loaded_groups(optimizer, loading), path)
        shared: list[Any] = []
        trial = _trial_copy(target, shared)
        # saved before classes were recorded, or no copy to try it on: its keys say whether it is of this kind
        # (a disabled GradScaler has none and loads nothing, as torch's own load)
        if (saved_kind is None or trial is None) and not (what == "grad_scaler" and not grad_scaler.is_enabled()):
            found = _state_mismatch(state, target)
            if found:
                raise ValueError(f"the checkpoint {path!r}: its {what!r} entry {found}, unlike the given {what}'s "
                                 f"state_dict() ({kind}): saved from another kind? nothing was loaded")
        # what the trial copy shares gets its attributes back after (LambdaLR's load sets its lr_lambdas')
        attributes = [(d, dict(d)) for d in (getattr(x, "__dict__", None) for x in shared) if type(d) is dict]
        try:
            if trial is not None:
                trial.load_state_dict(copy.deepcopy(state))  # some pop from it (LambdaLR's lr_lambdas)
        except Exception as exc:  # noqa: BLE001 - whatever its load_state_dict raises
            raise ValueError(f"the checkpoint {path!r}: its {what!r} entry does not load into the given {what} "
                             f"({type(target).__name__}; {type(exc).__name__}: {exc}): saved from another kind? "
                             "nothing was loaded") from exc
        finally:
            for d, was in attributes:
                d.clear()
                d.update(was)
        out[what] = state
    return out


def _loaded_groups(optimizer: torch.optim.Optimizer, loading: _Loading) -> list[dict[str, Any]]:
    """Each of `optimizer`'s param groups as the load leaves it: its own values, under the
    checkpoint's hyperparameters of its parameters (one set per group: `_one_value_per_group`).
    ``initial_lr`` None where its parameters were saved without one (the saved optimizer had no LR
    scheduler: the saved one's groups are not these)."""
    saved = loading.state["optimizer"]["param_groups"]
    found: dict[int, Mapping[str, Any]] = {}
    for name, _, group in loading.wanted:
        found.setdefault(id(group), {})
        if saved.get(name):
            found[id(group)] = saved[name]
    out = []
    for g in optimizer.param_groups:
        loaded = _unmark_empty_dicts(dict(found.get(id(g), {})))
        unknown = id(g) in found and "initial_lr" not in loaded
        out.append({**g, **loaded, **({"initial_lr": None} if unknown else {})})
    return out


#: lists of torch's LR schedulers' states that hold one value per param group, by the group's position in the
#: optimizer (besides `_FROM_GROUPS`, which `_regrouped` makes from the loaded groups)
_PER_GROUP = ("lr_lambdas", "max_lrs", "base_momentums", "max_momentums", "min_lrs")
#: the per-group lists of a scheduler's state that are its groups' own values: list -> the group's key
_FROM_GROUPS = {"base_lrs": "initial_lr", "_last_lr": "lr"}


def _regrouped(state: Any, target: Any, optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]],
               path: str) -> Any:
    """The saved LR scheduler `state` for `target`, a scheduler over `optimizer`, whose param groups
    the load leaves as `groups` (`_loaded_groups`).

    torch keeps a scheduler's per-group values by the group's position (``base_lrs[i]`` is group i's),
    but at another layout a rank's groups are others: a stage holding some layers' groups of a
    layer-wise decay, or groups built in another order. Where the saved ``base_lrs`` are not
    `groups`' ``initial_lr`` position by position (torch's schedulers make them from it) but hold
    each of them (the same groups, placed otherwise; else they were set otherwise, and stay; an
    empty group counts in neither), the ``base_lrs`` and ``_last_lr`` (of it and its parts) are
    made from `groups`, as a scheduler built over the loaded optimizer would; the other per-group
    lists (`_PER_GROUP`) must hold one value for every group (then its position does not matter),
    else this raises: they cannot be matched to these groups."""
    saved, key, field = _saved_base_lrs(state, target), "base_lrs", "initial_lr"
    if saved is None and isinstance(state, Mapping) and isinstance(state.get("_last_lr"), (list, tuple)):
        # no base_lrs (ReduceLROnPlateau): its last lrs, which it set on the groups, against the loaded groups' lrs
        saved, key, field = list(state["_last_lr"]), "_last_lr", "lr"
    initial = [g.get(field) for g in groups]
    held = [bool(g.get("params")) for g in groups]  # an empty group's values matter to no parameter
    if saved is None or any(v is None for v in initial) or (len(saved) == len(initial) and all(
            _same_value(a, b) for a, b, h in zip(saved, initial, held) if h)):
        return state
    if not all(any(_same_value(a, b) for a in saved) for b, h in zip(initial, held) if h):
        return state  # base_lrs set otherwise than from these groups (by hand, or over another optimizer): as saved
    return _rebased(state, target, optimizer, groups, (f"{key} {saved!r}", f"{field} as loaded {initial!r}"), path)


def _saved_base_lrs(state: Any, target: Any) -> list[Any] | None:
    """The saved ``base_lrs`` of scheduler `target` (the first part's, for a ``SequentialLR`` or
    ``ChainedScheduler``); None where there are none."""
    if not isinstance(state, Mapping):
        return None
    if isinstance(state.get("base_lrs"), (list, tuple)):
        return list(state["base_lrs"])
    parts, saved_parts = scheduler_parts(target), state.get("_schedulers")
    if parts and isinstance(saved_parts, (list, tuple)) and saved_parts:
        return _saved_base_lrs(saved_parts[0], parts[0])
    return None


def _rebased(state: Any, target: Any, optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]],
             told: tuple[str, str], path: str, at: str = "") -> Any:
    """`_regrouped`'s state where the saved groups are not `groups` (`told`: the saved per-group
    values and `groups`' own, in words, for the error); `at`: where `state` is in the entry."""
    if not isinstance(state, Mapping) or getattr(target, "optimizer", None) is not optimizer:
        return state  # a scheduler over another optimizer: these groups are not its
    parts, out = scheduler_parts(target), dict(state)
    for key, value in state.items():
        if key in _FROM_GROUPS:
            out[key] = [g[_FROM_GROUPS[key]] for g in groups]
        elif key == "_schedulers" and parts and isinstance(value, (list, tuple)) and len(value) == len(parts):
            out[key] = type(value)(_rebased(s, t, optimizer, groups, told, path, f"{at}_schedulers[{i}].")
                                   for i, (s, t) in enumerate(zip(value, parts)))
        elif key in _PER_GROUP and isinstance(value, (list, tuple)) and value:
            if not all(_same_value(value[0], v) for v in value[1:]):
                raise ValueError(
                    f"the checkpoint {path!r}: its 'lr_scheduler' entry holds {at}{key} {value!r}, one per param group "
                    f"by position, of groups other than this optimizer's (its {told[0]}, the groups' "
                    f"{told[1]}): they cannot be matched to these groups; group the parameters "
                    "as the saved run did; nothing was loaded")
            out[key] = type(value)([value[0]] * len(groups))
    return out


def _lineage_of(loading: _Loading, what: str) -> Any:
    """The saved lineage (`_lineage`) of the ``lr_scheduler`` or ``grad_scaler`` entry; None where
    saved before lineages were recorded, or damaged (then only its own class loads it)."""
    blob = loading.state[what].get("lineage")
    try:
        return None if blob is None else pickle.loads(blob)
    except Exception:  # noqa: BLE001 - whatever a damaged pickle raises
        return None


def _trial_copy(target: Any, shared: list[Any]) -> Any:
    """A copy of `target` (an LR scheduler or a GradScaler) that a trial ``load_state_dict`` may
    change: deep, but sharing the optimizer a scheduler holds (and its parameters) and what cannot
    be copied (`_copy_around`: added to `shared`); None where not even that can be made."""
    optimizer = getattr(target, "optimizer", None)
    keep = {} if optimizer is None else {id(optimizer): optimizer}
    try:
        return _copy_around(target, keep, shared)
    except _Uncopyable:
        return None


class _Uncopyable(Exception):
    """A scheduler or scaler inside a trial copy cannot be copied even shallowly (`_copy_around`)."""


def _copy_around(value: Any, keep: Mapping[int, Any], shared: list[Any]) -> Any:
    """`value` deep-copied (sharing `keep`'s objects) where it can be; else a scheduler or a scaler
    (anything with ``load_state_dict``) attribute by attribute and a list, tuple or dict item by
    item, sharing whatever else fails (a bound method whose object holds a lock, a generator),
    which it adds to `shared`. Raises `_Uncopyable` where such a scheduler cannot be copied
    even shallowly (sharing it, a trial load would change it)."""
    try:
        return copy.deepcopy(value, dict(keep))  # a fresh memo each: a failed copy leaves half-made objects in one
    except Exception:  # noqa: BLE001 - something inside cannot be copied
        pass
    if type(value) in (list, tuple):
        return type(value)(_copy_around(v, keep, shared) for v in value)
    if type(value) is dict:
        return {k: _copy_around(v, keep, shared) for k, v in value.items()}
    if not (callable(getattr(value, "load_state_dict", None)) and hasattr(value, "__dict__")):
        shared.append(value)
        return value
    try:
        new = copy.copy(value)
    except Exception as exc:  # noqa: BLE001 - its own copy fails
        raise _Uncopyable(type(value).__name__) from exc
    for key, item in vars(value).items():
        vars(new)[key] = _copy_around(item, keep, shared)
    return new


def _fits(current: Any, value: Any) -> bool:
    """`value` can be copied into `current`: both tensors of one shape."""
    return isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor) and current.shape == value.shape


def _raise_if_unusable(model: Any) -> None:
    """A `Pipeline` that found its job broken (a dead rank) raises at once, on every rank alike: the
    checkpoint's collectives would wait for the dead rank until the group's timeout."""
    unusable = getattr(model, "_raise_if_unusable", None)
    if callable(unusable):
        unusable()


def _agreement(process_group: Any) -> tuple[Agreement, list[int]]:
    """The ranks that save or load together (DCP's group) and their global ranks, to agree that
    each one's own part went well; in one process without torch.distributed, this one alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return Agreement(None), [0]
    group = process_group if process_group is not None else dist.group.WORLD
    return Agreement(group), dist.get_process_group_ranks(group)


def _one_value_per_group(optimizer: torch.optim.Optimizer, wanted: list[tuple[str, nn.Parameter, dict]],
                         saved: Mapping[str, Mapping[str, Any]]) -> None:
    """Raise where two parameters of one of `optimizer`'s groups were saved with different values of
    a hyperparameter: the group can take only one, and whichever came last would win unseen (the
    optimizer is grouped otherwise than the saved one)."""
    index = {id(g): i for i, g in enumerate(optimizer.param_groups)}
    first: dict[int, tuple[str, Mapping[str, Any]]] = {}  # id(group) -> its first saved parameter, values
    for name, _, group in wanted:
        values = saved.get(name) or {}
        if not values:
            continue  # not in the saved optimizer: takes the group's values
        other, theirs = first.setdefault(id(group), (name, values))
        for key, value in values.items():
            if key in theirs and not _same_value(theirs[key], value):
                raise ValueError(
                    f"the optimizer's param_groups[{index[id(group)]}] holds {other!r} and {name!r}, saved with "
                    f"different {key!r} ({theirs[key]!r} and {value!r}): a group takes one value; group the "
                    "parameters as the saved optimizer did"
                )


def _same_value(a: Any, b: Any) -> bool:
    """A saved value equals another: tensors element by element; anything whose ``==`` does not
    give one truth value (a list of tensors, say) counts as different."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. containers of tensors
        return False


def _saved(meta: Mapping[str, Any], prefix: str) -> bool:
    return any(k.startswith(prefix) for k in meta)


def _replica(model: Any) -> int:
    """The data-parallel replica whose FP8 scaling state this rank saves and loads: each replica's
    differ (their inputs do); 0 for stages given without a Pipeline (one copy is saved)."""
    topology = getattr(model, "topology", None)
    return int(getattr(topology, "dp_rank", 0))


def _fp8_destinations(meta: Mapping[str, Any], mods: list[nn.Module], replica: int) -> tuple[str, dict[str, Any]]:
    """Where DCP reads the FP8 scaling state of this rank's zbpp layers: replica `replica`'s, or
    replica 0's when the checkpoint has none of that replica (saved with fewer replicas)."""
    name = f"replica{replica}"
    if not _saved(meta, f"fp8.{name}."):
        name = "replica0"
    prefix = f"fp8.{name}."
    paths = {path for m in mods for path in scaling_layers(m)}
    out: dict[str, dict[str, Any]] = {}
    for fqn, md in meta.items():
        if not fqn.startswith(prefix):
            continue
        key, field = fqn[len(prefix):].rsplit(".", 1)
        path = key.rsplit(".", 1)[0] if "." in key else ""
        if path not in paths:  # another rank's layer
            continue
        out.setdefault(key, {})[field] = _placeholder(md)
    return name, out


def _placeholder(md: Any, device: torch.device | None = None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """What DCP reads a saved entry into: a tensor of its size and dtype (on `device`, in `dtype`
    if given: DCP casts), or None for a saved Python value (DCP puts it there)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not isinstance(md, TensorStorageMetadata):
        return None
    return torch.zeros(tuple(md.size), dtype=dtype or md.properties.dtype, device=device)


def _rng_state(model: Any) -> dict[str, int] | None:
    """A Pipeline's random stream: the steps taken and the base seed, one for the whole job (its
    ranks agreed on global rank 0's when it was built), so the one copy saved is every rank's."""
    if not hasattr(model, "rng_step") or not hasattr(model, "_base_seed"):
        return None
    return {"step": int(model.rng_step), "seed": int(model._base_seed)}


@contextlib.contextmanager
def _one_process_quiet(alone: bool = False) -> Iterator[None]:
    """Without torch.distributed (or asked to read `alone`: ``no_dist``) DCP works in this process
    and warns that it assumes so: it is meant."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        if alone or not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _saved_under(meta: Mapping[str, Any], paths: Mapping[str, Any], prefix: tuple[str, ...],
                 leaf: Any) -> dict[str, Any]:
    """Where DCP reads every saved entry under `prefix` (a path into the saved state: one
    parameter's optimizer state or hyperparameters), nested as saved: DCP names the entries of a
    nested dict or list of tensors by dotted paths, which cannot tell a name's dots from nesting, so
    the save's own paths (`paths`: the metadata's ``planner_data``) say; without them, only the
    entries directly under `prefix`. ``leaf(key, md)``: the placeholder of an entry (`key`: its
    first key under `prefix`)."""
    dotted = ".".join(prefix) + "."
    out: dict[Any, Any] = {}
    for fqn, md in meta.items():
        if not fqn.startswith(dotted):
            continue
        path = tuple(paths.get(fqn, ()))
        if path[:len(prefix)] == prefix and len(path) > len(prefix):
            keys = path[len(prefix):]
        elif "." not in fqn[len(dotted):]:
            keys = (fqn[len(dotted):],)
        else:
            continue
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = leaf(keys[0], md)
    return _as_saved(out)


def _as_saved(node: Any) -> Any:
    """`_saved_under`'s dicts back into what was saved: one keyed 0, 1, ... (a list's items) a list."""
    if not isinstance(node, dict):
        return node
    node = {k: _as_saved(v) for k, v in node.items()}
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node


def _optimizer_destination(meta: Mapping[str, Any], paths: Mapping[str, Any], name: str,
                           param: nn.Parameter, path: str) -> dict[str, Any]:
    """Tensors to load the optimizer state of `param` into, shaped as the checkpoint `path` says,
    in host memory (`_staging`: a ``fully_shard`` parameter's shard when the saved tensor has its
    shape), put where they go once every rank read all (`_placed`); nested in dicts and lists as
    saved. A tensor of another shape, not 0-dim, for a ``fully_shard`` parameter raises.

    A floating state saved in its parameter's dtype takes the parameter's dtype now (resumed in
    another one: what ``Optimizer.load_state_dict`` does; else the step mixes dtypes and fails);
    ``step`` and a state kept in another dtype than its parameter's keep the saved one."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved_param = meta.get(f"model.{name}")
    saved_dtype = saved_param.properties.dtype if isinstance(saved_param, TensorStorageMetadata) else None

    def destination(field: str, md: Any) -> Any:
        dtype = md.properties.dtype if isinstance(md, TensorStorageMetadata) else None
        if dtype is not None and dtype == saved_dtype and field != "step" and param.is_floating_point():
            dtype = param.dtype
        if isinstance(md, TensorStorageMetadata) and tuple(md.size) == tuple(param.shape):
            return _staging(param.detach(), dtype)  # its shard under fully_shard
        if isinstance(md, TensorStorageMetadata) and len(md.size) > 0 and hasattr(param, "placements"):
            # a plain tensor would fail the next step (mixed with the DTensor parameter) and a guess of its
            # sharding could be wrong: the checkpoint keeps the whole tensor, not how the optimizer split it
            raise ValueError(f"the checkpoint {path!r} holds optimizer state {field!r} of {name!r} of shape "
                             f"{tuple(md.size)}, not its parameter's {tuple(param.shape)}: such state (factored, as "
                             "Adafactor's) cannot be loaded into a fully_shard parameter; load it into plain stages")
        return _placeholder(md, None, dtype)  # in host memory (put on the parameter's device after)

    return _saved_under(meta, paths, ("optimizer", "state", name), destination)
