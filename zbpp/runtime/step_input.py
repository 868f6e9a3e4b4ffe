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
import operator
import pickle
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .._compat import modules_and_parameters
from ..modules.fp8 import DelayedScaling, active_recipe
from .fsdp import sharded_forms
from .loss_weights import checked_weights
from .tree import flatten, rebuild, split_batch

__all__ = ["BuiltParameters", "LocalBatch", "autocast_state", "local_batch", "merge", "module_state", "release_step_caches", "stable_hash", "stage_walks",
           "unique_parameters"]


@dataclass(frozen=True)
class LocalBatch:
    """This rank's part of a step's input (None / -1 / 0 where it holds no such part)."""

    inputs: list[Any] | None = None  #: the microbatches of the input (rank holding stage 0)
    targets: list[Any] | None = None  #: the microbatches of the target (rank holding the last stage; Nones without)
    raw_weights: torch.Tensor | None = None  #: ``loss_weight`` of each microbatch's target, on the device
    input_hash: int = 0  #: the input's structure, shapes and microbatch count
    input_rows: int = -1
    target_rows: int = -1
    target_hash: int = 0  #: the target's structure, shapes and non-tensor values (0: no target)


def local_batch(inputs: Any, target: Any, *, microbatches: int, device: torch.device, first: bool, last: bool,
                loss_weight: Callable[[Any], Any] | None = None, forward_only: bool = False, rank: int = 0) -> LocalBatch:
    """Check and split this rank's part of the step's input; raises on bad input (naming it)."""
    m = microbatches
    mbs = tgts = raw = None
    in_hash, n_in, n_tgt, tgt_hash = 0, -1, -1, 0
    if first:
        if inputs is None:
            raise ValueError(f"pipeline rank {rank} holds stage 0, so the step needs the inputs")
        mbs, n_in, spec = split_batch(inputs, m, what="input", device=device)
        in_hash = stable_hash((m, spec))
    if last and target is not None:
        tgts, n_tgt, tgt_spec = split_batch(target, m, what="target", device=device)
        tgt_hash = stable_hash((m, tgt_spec))
    elif last:
        tgts = [None] * m
    if last and loss_weight is not None and (target is not None or not forward_only):
        raw = checked_weights(loss_weight, tgts, device)
    return LocalBatch(mbs, tgts, raw, in_hash, n_in, n_tgt, tgt_hash)


Walks = Mapping[int, tuple[list[nn.Module], list[nn.Parameter]]]


def stage_walks(stage_modules: Mapping[int, nn.Module]) -> dict[int, tuple[list[nn.Module], list[nn.Parameter]]]:
    """Each stage's modules and parameters (``_compat.modules_and_parameters``): a step reads
    them once, for `module_state` and for its parameters."""
    return {s: modules_and_parameters(m) for s, m in stage_modules.items()}


def unique_parameters(walks: Walks) -> list[nn.Parameter]:
    """The parameters of `walks`, each once, in walk order."""
    if len(walks) == 1:  # one walk lists each parameter once already
        return list(next(iter(walks.values()))[1])
    return list({id(p): p for _, params in walks.values() for p in params}.values())


class BuiltParameters:
    """The parameters each stage held when the `Pipeline` was built: the data-parallel reducer's
    buckets, FSDP's shards, the tied copies and the split's lists were made for those objects, so a
    parameter added or replaced since (an adapter injected, ``module.weight = nn.Parameter(...)``,
    ``resize_token_embeddings``) would keep each replica's own gradient, or miss its tie's sum.
    `check` refuses one; a parameter removed since is fine (it gets no gradient, as in one process).

    >>> lin = nn.Linear(2, 2)
    >>> built = BuiltParameters(stage_walks({0: lin}))
    >>> lin.weight = nn.Parameter(torch.zeros(2, 2))
    >>> built.check({0: lin}, stage_walks({0: lin}))
    Traceback (most recent call last):
    ...
    ValueError: stage 0: parameter 'weight' is new since the Pipeline was built ...
    """

    def __init__(self, walks: Walks) -> None:
        self._now = {s: params for s, (_, params) in walks.items()}  # as last checked (compared by identity)
        # weak: a parameter removed since is freed with its module; its id may then be another's
        self._built = {s: {id(p): weakref.ref(p) for p in params} for s, (_, params) in walks.items()}

    def check(self, stage_modules: Mapping[int, nn.Module], walks: Walks) -> None:
        """Raise, naming the stage and the parameters, when a stage holds a parameter it did not hold
        at build. Microseconds while nothing changed (one identity comparison per parameter)."""
        for s, (_, params) in walks.items():
            now = self._now[s]
            if len(params) == len(now) and all(map(operator.is_, params, now)):
                continue
            built = self._built[s]

            def known(p: nn.Parameter | None) -> bool:
                return p is not None and (ref := built.get(id(p))) is not None and ref() is p

            new = {id(p) for p in params if not known(p)}
            if new:  # a fully_shard stage left unsharded (a forward outside the steps) holds its unsharded forms
                forms = sharded_forms(stage_modules[s])
                new = {i for i in new if not known(forms.get(i))}
            if new:
                names = [n for n, p in stage_modules[s].named_parameters() if id(p) in new]
                raise ValueError(
                    f"stage {s}: parameter{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))} "
                    f"{'are' if len(names) > 1 else 'is'} new since the Pipeline was built (added or replaced: an "
                    "adapter such as LoRA injected, module.weight = nn.Parameter(...), resize_token_embeddings). Its "
                    "data-parallel reduction, tied copies and FSDP shards were set up for the parameters the stage held "
                    "then, so a new one's gradient would not be averaged over the replicas nor summed with its tied "
                    "copies. Change the model first, then build the Pipeline (or build a new Pipeline now)"
                )
            self._now[s] = params  # only removed or reordered: nothing to reduce is missed


_training = operator.attrgetter("training")
_requires_grad = operator.attrgetter("requires_grad")


def module_state(walks: Walks) -> tuple:
    """What, besides the input, decides the shapes and requires_grad of the activations, from each
    stage's modules and parameters (``_compat.modules_and_parameters``)."""
    # map with attrgetter: the loops run in C, before every step's first kernel
    return tuple((s, tuple(map(_training, modules)), tuple(map(_requires_grad, params)))
                 for s, (modules, params) in walks.items())


def autocast_state(device: torch.device) -> tuple[bool, torch.dtype, DelayedScaling | None]:
    """Whether the caller runs the step under ``torch.autocast`` for `device`'s type, its dtype, and
    the recipe of a ``zbpp.modules.fp8_autocast`` around the step: they decide the activations'
    dtypes and the GEMMs' precision as the modules' state does (and a capture bakes them in)."""
    kind = device.type
    return torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), active_recipe()


def release_step_caches(walks: Walks) -> None:
    """Call ``release_step_caches()`` on each module of `walks` whose class has it (zbpp's layers:
    the FP8 casts they kept for the step's later microbatches), once the step's tasks ran."""
    for modules, _ in walks.values():
        for mod in modules:
            if getattr(type(mod), "release_step_caches", None) is not None:
                mod.release_step_caches()


def merge(outputs: list[Any], rows: int) -> Any:
    """The microbatches' outputs as one batch of `rows` rows: tensor leaves concatenated along dim 0,
    0-dim ones stacked (one value per microbatch: a microbatch's mean or sum is not the batch's, nor
    is the first microbatch's), non-tensor values from the first microbatch. A leaf of one row in
    every microbatch, equal in all, while some microbatch has more rows is shared (a ``[1, T]``
    ``position_ids`` passed along, as `zbpp.runtime.tree.split` shares it): it comes back once.
    A leaf is put together along dim 0, so dim 0 must hold the microbatch's rows, a whole number of
    entries per row (token-major, ``[rows * T, ...]``) or one entry per microbatch; any other leaf
    (``[L, rows, ...]``: rows not first) raises, naming it, where the microbatches' sizes show it
    (move rows to dim 0 in the last stage's output).

    >>> pos = torch.arange(3)[None]
    >>> out = merge([(torch.ones(2, 3), torch.tensor(1.0), pos), (torch.zeros(1, 3), torch.tensor(2.0), pos)], 3)
    >>> tuple(out[0].shape), out[1], tuple(out[2].shape)
    ((3, 3), tensor([1., 2.]), (1, 3))
    """
    leaves = [flatten(o) for o in outputs]
    spec = leaves[0][1]
    m = len(outputs)
    sizes = [rows // m + (j < rows % m) for j in range(m)]  # torch.tensor_split's, as the input's split
    several = rows > m  # some microbatch has more than one row
    merged = []
    for i, t in enumerate(leaves[0][0]):
        parts = [ls[i] for ls, _ in leaves]
        if t.dim() == 0:
            merged.append(torch.stack(parts))
        elif several and all(p.shape[0] == 1 for p in parts) and all(torch.equal(t, p) for p in parts[1:]):
            merged.append(t)
        else:
            _check_rows_first(i, [p.shape for p in parts], sizes)
            merged.append(torch.cat(parts, dim=0))
    return rebuild(spec, merged)


def _check_rows_first(leaf: int, shapes: list[torch.Size], sizes: list[int]) -> None:
    """Raise unless dim 0 of every microbatch's part holds one entry per microbatch or the same whole
    number of entries per row of that microbatch."""
    firsts = [s[0] for s in shapes]
    if all(f == 1 for f in firsts):
        return
    per_row = {f // n if n and f % n == 0 else -1 for f, n in zip(firsts, sizes)}
    if len(per_row) == 1 and -1 not in per_row:
        return
    raise ValueError(
        f"eval_step: output tensor {leaf} of the last stage does not hold the microbatch's rows along dim 0 "
        f"(dim 0 per microbatch: {firsts}; rows per microbatch: {sizes}), so its microbatches cannot be "
        "put back together as one batch; return it with the rows first (e.g. .movedim(1, 0) for [L, rows, ...])")


def stable_hash(obj: Any) -> int:
    """A 55-bit hash of a picklable object (the same on every rank)."""
    try:
        data = pickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"the step's input holds a non-tensor value that cannot be pickled: {exc}") from exc
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little") >> 1
