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

    {"model": {name: tensor},                                  # every stage's state_dict()
     "optimizer": {"state": {name: {"exp_avg": ..., "step": ...}},
                   "param_groups": {name: {"lr": ..., "betas": ..., ...}}}}

The optimizer's state is keyed by parameter name too, so it follows its parameter to whichever
rank holds it next. One file for ``nn.Module.load_state_dict``::

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save("ckpt/step-100", "model.pt")
    model.load_state_dict(torch.load("model.pt")["model"])

Every rank of the job calls `save_checkpoint` / `load_checkpoint` together (collective over the
default process group, or `process_group`), between steps. In one process without
torch.distributed both work too.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from .._compat import uncompiled

__all__ = ["save_checkpoint", "load_checkpoint"]


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


def _param_names(mods: list[nn.Module]) -> dict[int, tuple[str, nn.Parameter]]:
    names: dict[int, tuple[str, nn.Parameter]] = {}
    for m in mods:
        for name, p in m.named_parameters():
            names.setdefault(id(p), (name, p))
    return names


def _optimizer_params(optimizer: torch.optim.Optimizer, names: dict[int, tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter, dict]]:
    out = []
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"the optimizer's param_groups[{index}] holds a parameter (shape {tuple(p.shape)}) that no stage "
                    "module of this rank holds: build the optimizer over this rank's stage parameters"
                )
            out.append((names[id(p)][0], p, group))
    return out


def _hyper(group: dict) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def save_checkpoint(model: Any, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                    *, process_group: Any = None) -> None:
    """Save this rank's share of the model (and optimizer) state into the DCP checkpoint `path`.

    Args:
        model: a `zbpp.Pipeline`, a mapping ``{stage: module}``, or an ``nn.Module``: the stages of
            this rank, whose ``state_dict()`` keys are the whole model's names.
        path: the checkpoint directory (shared by every rank).
        optimizer: an optimizer over this rank's stage parameters (plain or ``fully_shard`` ones).
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
    import torch.distributed.checkpoint as dcp

    mods = _stage_modules(model)
    state: dict[str, Any] = {"model": _model_state(mods)}
    if optimizer is not None:
        opt_state: dict[str, Any] = {}
        groups: dict[str, Any] = {}
        for name, p, group in _optimizer_params(optimizer, _param_names(mods)):
            if optimizer.state.get(p):
                opt_state[name] = dict(optimizer.state[p])
            groups[name] = _hyper(group)
        state["optimizer"] = {"state": opt_state, "param_groups": groups}
    with _one_process_quiet():
        dcp.save(state, checkpoint_id=os.fspath(path), process_group=process_group)


def load_checkpoint(model: Any, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                    *, process_group: Any = None) -> None:
    """Load the DCP checkpoint `path` (written by `save_checkpoint` at any layout) into this rank's
    stages, and into `optimizer` given one: its state and each parameter group's hyperparameters
    (``lr``, ...) come from the checkpoint's entries of the group's parameters.

    Arguments as `save_checkpoint`. A name that this rank's stages hold and the checkpoint lacks
    raises (DCP's error names it); the checkpoint may hold more (other ranks' stages).
    """
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    mods = _stage_modules(model)
    model_state = _model_state(mods)
    state: dict[str, Any] = {"model": model_state}
    wanted: list[tuple[str, nn.Parameter, dict]] = []
    if optimizer is not None:
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        wanted = _optimizer_params(optimizer, _param_names(mods))
        opt_state: dict[str, dict[str, Any]] = {}
        groups: dict[str, Any] = {}
        for name, p, group in wanted:
            entry = _optimizer_destination(meta, name, p)
            if entry:
                opt_state[name] = entry
            prefix = f"optimizer.param_groups.{name}."
            hyper = {k[len(prefix):]: None for k in meta if k.startswith(prefix) and "." not in k[len(prefix):]}
            if hyper:
                groups[name] = hyper
        state["optimizer"] = {"state": opt_state, "param_groups": groups}
    with _one_process_quiet():
        dcp.load(state, checkpoint_id=path, process_group=process_group)
    for m in mods:
        m.load_state_dict({k: model_state[k] for k in m.state_dict()})
    if optimizer is not None:
        loaded = state["optimizer"]
        for name, p, group in wanted:
            if name in loaded["state"]:
                optimizer.state[p] = dict(loaded["state"][name])
            for key, value in loaded["param_groups"].get(name, {}).items():
                group[key] = value


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """Without torch.distributed DCP works in this process and warns that it assumes so: it is meant."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _optimizer_destination(meta: Mapping[str, Any], name: str, param: nn.Parameter) -> dict[str, Any]:
    """Tensors to load the optimizer state of `param` into, shaped as the checkpoint says: like the
    parameter (sharded like it) when the saved tensor has its shape, else a plain tensor (on the
    CPU when 0-dim, as torch optimizers keep ``step``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"optimizer.state.{name}."
    out: dict[str, Any] = {}
    for key, md in meta.items():
        if not key.startswith(prefix) or "." in key[len(prefix):]:
            continue
        field = key[len(prefix):]
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            if tuple(md.size) == tuple(param.shape):
                out[field] = torch.zeros_like(param.detach(), dtype=dtype)
            elif len(md.size) == 0:
                out[field] = torch.zeros((), dtype=dtype)
            else:
                out[field] = torch.zeros(tuple(md.size), dtype=dtype, device=param.device)
        else:
            out[field] = None  # a saved Python value: DCP puts it here
    return out
