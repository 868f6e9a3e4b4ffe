"""This rank's part of a step's input: checked, on the device, split into microbatches.

`local_batch` is what a rank contributes to the start agreement (`zbpp.runtime.agreement`): the
rank holding stage 0 splits the input, the one holding the last stage the target (and computes
``loss_weight`` of each microbatch's target); their rows and the input's structure travel in the
agreement. `merge` puts an evaluation step's outputs back together.

>>> b = local_batch(torch.ones(4, 2), None, microbatches=2, device=torch.device("cpu"), first=True, last=False)
>>> [tuple(x.shape) for x in b.inputs], b.input_rows
([(2, 2), (2, 2)], 4)
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .._compat import modules_and_parameters
from .loss_weights import checked_weights
from .tree import batch_rows, flatten, rebuild, split

__all__ = ["LocalBatch", "local_batch", "merge", "module_state", "release_step_caches", "stable_hash", "stage_walks",
           "unique_parameters"]


@dataclass(frozen=True)
class LocalBatch:
    """This rank's part of a step's input (None / -1 / 0 where it holds no such part)."""

    inputs: list[Any] | None = None  #: the microbatches of the input (rank holding stage 0)
    targets: list[Any] | None = None  #: the microbatches of the target (rank holding the last stage; Nones without)
    raw_weights: list[Any] | None = None  #: ``loss_weight`` of each microbatch's target
    input_hash: int = 0  #: the input's structure, shapes and microbatch count
    input_rows: int = -1
    target_rows: int = -1


def local_batch(inputs: Any, target: Any, *, microbatches: int, device: torch.device, first: bool, last: bool,
                loss_weight: Callable[[Any], Any] | None = None, forward_only: bool = False, rank: int = 0) -> LocalBatch:
    """Check and split this rank's part of the step's input; raises on bad input (naming it)."""
    m = microbatches
    mbs = tgts = raw = None
    in_hash, n_in, n_tgt = 0, -1, -1
    if first:
        if inputs is None:
            raise ValueError(f"pipeline rank {rank} holds stage 0, so the step needs the inputs")
        inputs = _to_device(inputs, device, "input")
        mbs = split(inputs, m, what="input")
        n_in, in_hash = batch_rows(inputs, m, what="input"), stable_hash((m, flatten(inputs)[1]))
    if last and target is not None:
        target = _to_device(target, device, "target")
        tgts = split(target, m, what="target")
        n_tgt = batch_rows(target, m, what="target")
    elif last:
        tgts = [None] * m
    if last and loss_weight is not None and (target is not None or not forward_only):
        raw = checked_weights(loss_weight, tgts)
    return LocalBatch(mbs, tgts, raw, in_hash, n_in, n_tgt)


def _to_device(obj: Any, device: torch.device, what: str) -> Any:
    leaves, spec = flatten(obj)
    if not leaves:
        raise ValueError(f"the {what} holds no tensor ({spec}): the step splits its tensors into microbatches")
    return rebuild(spec, [t.to(device) for t in leaves])


Walks = Mapping[int, tuple[list[nn.Module], list[nn.Parameter]]]


def stage_walks(stage_modules: Mapping[int, nn.Module]) -> dict[int, tuple[list[nn.Module], list[nn.Parameter]]]:
    """Each stage's modules and parameters (``_compat.modules_and_parameters``): a step reads
    them once, for `module_state` and for its parameters."""
    return {s: modules_and_parameters(m) for s, m in stage_modules.items()}


def unique_parameters(walks: Walks) -> list[nn.Parameter]:
    """The parameters of `walks`, each once, in walk order."""
    return list({id(p): p for _, params in walks.values() for p in params}.values())


def module_state(walks: Walks) -> tuple:
    """What, besides the input, decides the shapes and requires_grad of the activations, from each
    stage's modules and parameters (``_compat.modules_and_parameters``)."""
    return tuple((s, tuple(mod.training for mod in modules), tuple(p.requires_grad for p in params))
                 for s, (modules, params) in walks.items())


def release_step_caches(walks: Walks) -> None:
    """Call ``release_step_caches()`` on each module of `walks` whose class has it (zbpp's layers:
    the FP8 casts they kept for the step's later microbatches), once the step's tasks ran."""
    for modules, _ in walks.values():
        for mod in modules:
            if getattr(type(mod), "release_step_caches", None) is not None:
                mod.release_step_caches()


def merge(outputs: list[Any]) -> Any:
    """The microbatches' outputs as one batch: tensor leaves concatenated along dim 0."""
    leaves = [flatten(o) for o in outputs]
    spec = leaves[0][1]
    merged = []
    for i, t in enumerate(leaves[0][0]):
        merged.append(torch.cat([ls[i] for ls, _ in leaves], dim=0) if t.dim() > 0 else t)
    return rebuild(spec, merged)


def stable_hash(obj: Any) -> int:
    """A 55-bit hash of a picklable object (the same on every rank)."""
    try:
        data = pickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"the step's input holds a non-tensor value that cannot be pickled: {exc}") from exc
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little") >> 1
