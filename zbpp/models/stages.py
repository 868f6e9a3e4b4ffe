"""Cut a model into the stages of a pipeline schedule, holding on each rank only its own stages.

A stage is named by the modules it holds: a list of module FQNs per stage (torchtitan's
``module_fqns_per_model_part``), given or computed by `fqns_per_stage`, which balances the
model's repeated blocks (``model.layers``) over the stages with the modules before the blocks on
the first stage, those after on the last, and parameter-free ones (rotary embeddings, dropout)
on every stage.

`pipeline_stages` builds this rank's stage modules from a model on the ``meta`` device (or a
factory that builds one): each stage module is the model itself with the modules it does not hold
removed (set to None; in a ``ModuleList``/``ModuleDict``/``Sequential`` left out, so the others
keep their names), so its ``state_dict`` keys are the model's own. Only the held modules are
materialised, on the rank's device, by the model's own initialisation (Hugging Face
``_init_weights``, else each module's ``reset_parameters``) under a seed per module name, or from a
given ``state_dict``. A Parameter that modules of two stages share (a tied embedding and LM head)
is one logical parameter: it is returned in ``tied_parameters`` for
``Pipeline(..., tied_parameters=...)`` on every rank that holds a copy, and stays one Parameter
where one rank holds both stages (V placement).

>>> import torch
>>> from torch import nn
>>> from zbpp.schedules import build
>>> class Net(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.embed = nn.Embedding(10, 4)
...         self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
...         self.head = nn.Linear(4, 10, bias=False)
...         self.head.weight = self.embed.weight  # tied
>>> with torch.device("meta"):
...     net = Net()
>>> fqns_per_stage(net, 2, blocks="layers")
[['embed', 'layers.0', 'layers.1'], ['layers.2', 'layers.3', 'head']]
>>> sched = build("1f1b", num_ranks=2, num_microbatches=2)
>>> stages, tied = pipeline_stages(net, sched, pp_rank=1, blocks="layers")
>>> list(stages[1].state_dict())
['layers.2.weight', 'layers.2.bias', 'layers.3.weight', 'layers.3.bias', 'head.weight']
>>> list(tied), tied["embed.weight"] is stages[1].head.weight
(['embed.weight'], True)
"""

from __future__ import annotations

import contextlib
import copy
import warnings
import zlib
from collections import OrderedDict
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence, Union

import torch
from torch import nn

from ..schedules.ir import Schedule
from .partition import balanced_partition

__all__ = ["PipelineStages", "fqns_per_stage", "pipeline_stages", "Balance"]

Balance = Union[str, Sequence[float], Mapping[str, float]]
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class PipelineStages(NamedTuple):
    """This rank's stages: ``modules`` ``{stage: module}`` for ``Pipeline(modules, ...)`` and
    ``tied_parameters`` ``{name: Parameter}`` for ``Pipeline(..., tied_parameters=...)``."""

    modules: dict[int, nn.Module]
    tied_parameters: dict[str, nn.Parameter]


# -- which stage holds what ------------------------------------------------------------------------
def fqns_per_stage(model: nn.Module, num_stages: int, *, blocks: str = "model.layers",
                   balance: Balance = "params") -> list[list[str]]:
    """The modules each of `num_stages` stages holds, as lists of module FQNs in model order.

    The children of `blocks` (a ``ModuleList``, ``ModuleDict`` or ``Sequential``) are split into
    contiguous runs, every stage holding at least one, so that the largest stage load is the
    smallest possible (`zbpp.models.partition.balanced_partition`). The modules beside the path
    from the model to `blocks` go to the first stage when registered before it, to the last
    when after, and to every stage when they hold no parameter.

    `balance`:
      - ``"params"``: a stage's load is its parameter count (a tied parameter counted in each
        stage that uses it);
      - ``"blocks"``: each block counts 1, the other modules 0;
      - a sequence of one cost per block (e.g. measured forward+backward times), the others 0;
      - a mapping ``{fqn: cost}`` with every block's FQN and, optionally, the other modules'.
    """
    blocks_mod = _container(model, blocks)
    block_fqns = [f"{blocks}.{name}" for name, m in blocks_mod._modules.items() if m is not None]
    before, after, everywhere = _outside(model, blocks)
    costs, first, last = _costs(model, balance, block_fqns, before, after)
    sizes = balanced_partition(costs, num_stages, first=first, last=last)
    out: list[list[str]] = []
    at = 0
    for s, n in enumerate(sizes):
        held = set(block_fqns[at:at + n]) | set(everywhere)
        if s == 0:
            held |= set(before)
        if s == num_stages - 1:
            held |= set(after)
        out.append([f for f in _model_order(model) if f in held])
        at += n
    return out


def _container(model: nn.Module, blocks: str) -> nn.Module:
    try:
        mod = model.get_submodule(blocks)
    except AttributeError:
        raise ValueError(f"blocks={blocks!r} names no submodule of {type(model).__name__}; pass the FQN of its "
                         f"repeated blocks, one of {[n for n, m in model.named_modules() if isinstance(m, _CONTAINERS)]}") from None
    if not isinstance(mod, _CONTAINERS):
        raise ValueError(f"blocks={blocks!r} is a {type(mod).__name__}; it must be a ModuleList, ModuleDict or Sequential "
                         "of the model's repeated blocks")
    return mod


def _outside(model: nn.Module, blocks: str) -> tuple[list[str], list[str], list[str]]:
    """FQNs of the modules beside the path to `blocks`: before it, after it, parameter-free."""
    before: list[str] = []
    after: list[str] = []
    everywhere: list[str] = []
    mod, prefix = model, ""
    for part in blocks.split("."):
        seen = False
        for name, child in mod._modules.items():
            if name == part:
                seen = True
                continue
            if child is None:
                continue
            fqn = prefix + name
            if not any(True for _ in child.parameters()):
                everywhere.append(fqn)
            else:
                (after if seen else before).append(fqn)
        mod, prefix = mod._modules[part], prefix + part + "."
    return before, after, everywhere


def _model_order(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_modules(remove_duplicate=False) if n]


def _numel(modules: Sequence[nn.Module]) -> float:
    seen: dict[int, int] = {}
    for m in modules:
        for p in m.parameters():
            seen[id(p)] = p.numel()
    return float(sum(seen.values()))


def _costs(model: nn.Module, balance: Balance, block_fqns: list[str], before: list[str],
           after: list[str]) -> tuple[list[float], float, float]:
    get = model.get_submodule
    if isinstance(balance, str):
        if balance == "params":
            return ([_numel([get(f)]) for f in block_fqns], _numel([get(f) for f in before]),
                    _numel([get(f) for f in after]))
        if balance == "blocks":
            return [1.0] * len(block_fqns), 0.0, 0.0
        raise ValueError(f"balance={balance!r}: use 'params', 'blocks', one cost per block, or {{fqn: cost}}")
    if isinstance(balance, Mapping):
        unknown = sorted(set(balance) - set(block_fqns) - set(before) - set(after))
        missing = [f for f in block_fqns if f not in balance]
        if unknown or missing:
            raise ValueError(f"balance: costs for modules that are neither blocks nor beside them: {unknown}; "
                             f"blocks without a cost: {missing}")
        return ([float(balance[f]) for f in block_fqns], float(sum(balance.get(f, 0.0) for f in before)),
                float(sum(balance.get(f, 0.0) for f in after)))
    costs = list(balance)
    if len(costs) != len(block_fqns):
        raise ValueError(f"balance has {len(costs)} costs but the model has {len(block_fqns)} blocks")
    return [float(c) for c in costs], 0.0, 0.0


def _check_fqns(model: nn.Module, fqns: Sequence[Sequence[str]], num_stages: int) -> list[list[str]]:
    if isinstance(fqns, str) or not isinstance(fqns, Sequence) or any(isinstance(f, str) or not isinstance(f, Sequence) for f in fqns):
        raise TypeError("module_fqns_per_stage must be a list with one list of module FQNs per stage")
    fqns = [list(f) for f in fqns]
    if len(fqns) != num_stages:
        raise ValueError(f"module_fqns_per_stage has {len(fqns)} lists but the schedule has {num_stages} stages")
    owner: dict[str, int] = {}
    for s, names in enumerate(fqns):
        for f in names:
            try:
                mod = model.get_submodule(f)
            except AttributeError:
                raise ValueError(f"module_fqns_per_stage[{s}]: {f!r} names no submodule of {type(model).__name__}") from None
            if f in owner and owner[f] != s and any(True for _ in mod.parameters()):
                raise ValueError(f"module {f!r} (with parameters) is listed for stages {owner[f]} and {s}: a module "
                                 "belongs to one stage (a weight that two stages use is one Parameter registered in "
                                 "a module of each, and is then tied)")
            owner.setdefault(f, s)
    for s, names in enumerate(fqns):
        for f in names:
            nested = [g for g in names if g != f and g.startswith(f + ".")]
            if nested:
                raise ValueError(f"module_fqns_per_stage[{s}] lists {f!r} and modules inside it {nested}")
        others = [g for t, o in enumerate(fqns) if t != s for g in o]
        for f in names:
            inside = [g for g in others if f.startswith(g + ".") or g.startswith(f + ".")]
            if inside:
                raise ValueError(f"module {f!r} of stage {s} overlaps {inside} of another stage")
    held = [f for names in fqns for f in names]
    orphans = [n for n in _state_names(model) if not any(n.startswith(f + ".") for f in held)]
    if orphans:
        raise ValueError(f"no stage holds {orphans[:8]}{' ...' if len(orphans) > 8 else ''}: every parameter and "
                         "buffer of the model must be in a module some stage lists")
    return fqns


def _state_names(model: nn.Module) -> Iterator[str]:
    for n, _ in model.named_parameters(remove_duplicate=False):
        yield n
    for n, _ in model.named_buffers(remove_duplicate=False):
        yield n


# -- building a stage ------------------------------------------------------------------------------
def pipeline_stages(
    model: nn.Module | Callable[[], nn.Module],
    schedule: Schedule,
    pp_rank: int,
    *,
    module_fqns_per_stage: Sequence[Sequence[str]] | None = None,
    blocks: str = "model.layers",
    balance: Balance = "params",
    device: torch.device | str | None = None,
    init: Callable[[nn.Module], None] | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    seed: int = 0,
) -> PipelineStages:
    """This rank's stage modules of `schedule` cut from `model`, and its tied parameters.

    Args:
        model: the whole model, best on the ``meta`` device (``with torch.device("meta"):``), or a
            function that builds it (called under ``torch.device("meta")``). A model with real
            weights works too: the held modules are copied, the model is left as it is.
        schedule: the `zbpp.schedules.Schedule`; this rank builds ``schedule.stages_on(pp_rank)``.
        pp_rank: this rank's pipeline rank.
        module_fqns_per_stage: one list of module FQNs per stage (every parameter must be in one);
            default `fqns_per_stage` with `blocks` and `balance`.
        device: where the stages live; default the current CUDA device under NCCL, else the CPU.
        init: ``init(module)`` initialises the parameters and buffers of one held module (and its
            submodules); default: Hugging Face's ``model._init_weights`` on every submodule, else each
            submodule's ``reset_parameters()``. Each held module is initialised under its own seed,
            drawn from `seed` and its FQN: values do not depend on the split or the rank. A weight
            that a later module of the rank shares keeps its first module's values (a tied LM head
            keeps the embedding's; the copies on other ranks are made equal by `Pipeline`).
        state_dict: the whole model's (or a superset of this rank's) state, loaded after `init`.

    The stage modules are the model with what the stage does not hold removed, so the model's
    ``forward`` must skip what is None and iterate over its blocks (torchtitan's convention), or
    the stage is wrapped (as `zbpp.models.hf` does). A stage's ``state_dict`` keys are the model's.
    A Parameter registered in modules of two stages comes back in ``tied_parameters`` under its
    first name, on every rank holding one of those stages. A model that declares tied weights
    (Hugging Face ``_tied_weights_keys`` with ``tie_word_embeddings``) which are separate
    Parameters gets a warning: the pipeline cannot see that tie.
    """
    model = _resolve(model)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a zbpp.schedules.Schedule, got {type(schedule).__name__}")
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < schedule.num_ranks:
        raise ValueError(f"pp_rank must be an int in [0, {schedule.num_ranks}), got {pp_rank!r}")
    S = schedule.num_stages
    if module_fqns_per_stage is None:
        fqns = fqns_per_stage(model, S, blocks=blocks, balance=balance)
    else:
        fqns = _check_fqns(model, module_fqns_per_stage, S)
    _warn_hidden_ties(model)
    dev = _device(device)
    mine = schedule.stages_on(pp_rank)
    memo: dict[int, Any] = {}
    modules = {s: _prune(model, "", set(fqns[s]), memo) for s in mine}
    fresh = _materialise(modules.values(), dev)
    _initialise(model, modules, fqns, mine, init, seed, dev)
    if state_dict is not None:
        _load(model, modules, state_dict)
    _check_initialised(modules, fresh)
    return PipelineStages(modules, _tied(model, fqns, modules))


def _resolve(model: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    if isinstance(model, nn.Module):
        return model
    if not callable(model):
        raise TypeError(f"model must be an nn.Module or a function that builds one, got {type(model).__name__}")
    with torch.device("meta"):
        built = model()
    if not isinstance(built, nn.Module):
        raise TypeError(f"the model factory returned a {type(built).__name__}, not an nn.Module")
    return built


def _device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _prune(module: nn.Module, prefix: str, held: set[str], memo: dict[int, Any]) -> nn.Module:
    """`module` with only the `held` FQNs (relative to the model) under `prefix`: held modules are
    copies (one per rank: `memo` is shared by the rank's stages, so shared objects stay shared),
    the containers on the way are shallow copies with their own child tables."""
    if prefix.rstrip(".") in held:
        return copy.deepcopy(module, memo)
    shell = module.__class__.__new__(module.__class__)
    state = {k: (copy.copy(v) if isinstance(v, (dict, set)) else v) for k, v in module.__dict__.items()}
    shell.__dict__.update(state)
    shell._parameters, shell._buffers, shell._non_persistent_buffers_set = {}, {}, set()
    shell._modules = OrderedDict()
    for name, child in module._modules.items():
        fqn = prefix + name
        if child is not None and any(h == fqn or h.startswith(fqn + ".") for h in held):
            shell._modules[name] = _prune(child, fqn + ".", held, memo)
        elif not isinstance(module, _CONTAINERS):
            shell._modules[name] = None
    return shell


def _materialise(stages: Any, device: torch.device) -> dict[int, str]:
    """Every meta tensor of the stages becomes an uninitialised tensor on `device` (NaN where it has
    a floating dtype, so that what no initialisation touches is found), a real one is moved there;
    a tensor shared by several modules stays shared. Returns ``{id: kind}`` of the new tensors."""
    done: dict[int, torch.Tensor] = {}
    fresh: dict[int, str] = {}
    for root in stages:
        for m in root.modules():
            for table in (m._parameters, m._buffers):
                for k, t in table.items():
                    if t is None:
                        continue
                    if id(t) not in done:
                        new = _place(t, device)
                        done[id(t)] = new
                        if t.is_meta:
                            fresh[id(new)] = "new"
                    table[k] = done[id(t)]
    return fresh


def _place(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.is_meta:
        data = torch.empty_like(t, device=device)
        if data.is_floating_point() or data.is_complex():
            data.fill_(float("nan"))
    elif t.device != device:
        data = t.detach().to(device)
    else:
        return t
    if not isinstance(t, nn.Parameter):
        return data
    p = nn.Parameter(data, requires_grad=t.requires_grad)
    for k, v in t.__dict__.items():
        if k != "_is_hf_initialized":  # Hugging Face skips initialising tensors that carry it
            setattr(p, k, v)
    return p


def _initialise(model: nn.Module, modules: dict[int, nn.Module], fqns: list[list[str]], mine: list[int],
                init: Callable[[nn.Module], None] | None, seed: int, device: torch.device) -> None:
    fn = init if init is not None else _default_init(model)
    done: set[int] = set()
    ready: set[int] = set()  # tensors initialised already: a tied weight keeps its first module's init
    for s in sorted(mine):
        for f in fqns[s]:
            m = modules[s].get_submodule(f)
            if id(m) in done:
                continue
            done.add(id(m))
            tensors = [t for t in [*m.parameters(), *m.buffers()]]
            kept = [(t, t.detach().clone()) for t in tensors if id(t) in ready]
            with _seeded(seed, f, device):
                fn(m)
            with torch.no_grad():
                for t, value in kept:
                    t.copy_(value)
            ready.update(id(t) for t in tensors)


def _default_init(model: nn.Module) -> Callable[[nn.Module], None]:
    hf = getattr(model, "_init_weights", None)
    if callable(hf):  # Hugging Face: the model's own per-module init, children first as HF applies it
        return lambda m: m.apply(hf)

    def reset(m: nn.Module) -> None:
        for sub in _post_order(m):
            if callable(getattr(sub, "reset_parameters", None)):
                sub.reset_parameters()

    return reset


def _post_order(m: nn.Module) -> Iterator[nn.Module]:
    for child in m.children():
        yield from _post_order(child)
    yield m


@contextlib.contextmanager
def _seeded(seed: int, fqn: str, device: torch.device) -> Iterator[None]:
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed((int(seed) * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63))
        yield


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """name -> every name of the same Parameter in the whole model."""
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return {n: names for names in by_id.values() for n in names}


def _load(model: nn.Module, modules: dict[int, nn.Module], state_dict: Mapping[str, torch.Tensor]) -> None:
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping {{name: tensor}}, got {type(state_dict).__name__}")
    aliases = _aliases(model)
    missing: list[str] = []
    with torch.no_grad():
        for s, m in modules.items():
            for name, t in m.state_dict(keep_vars=True).items():
                src = next((a for a in aliases.get(name, [name]) if a in state_dict), None)
                if src is None:
                    missing.append(name)
                    continue
                value = state_dict[src]
                if tuple(value.shape) != tuple(t.shape):
                    raise ValueError(f"state_dict[{src!r}] has shape {tuple(value.shape)}, stage {s}'s {name!r} "
                                     f"{tuple(t.shape)}")
                t.copy_(value)
    if missing:
        raise ValueError(f"state_dict lacks {sorted(set(missing))[:8]} that this rank's stages hold")


def _check_initialised(modules: dict[int, nn.Module], fresh: dict[int, str]) -> None:
    bad = []
    for s, m in modules.items():
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            if id(t) in fresh and (t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any()):
                bad.append(f"{name} (stage {s})")
    if bad:
        raise ValueError(f"{bad[:8]} hold no values after initialisation: the model's init does not cover them; pass "
                         "init= (a function that initialises one module) or state_dict=")


def _tied(model: nn.Module, fqns: list[list[str]], modules: dict[int, nn.Module]) -> dict[str, nn.Parameter]:
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    tied: dict[str, nn.Parameter] = {}
    for names in by_id.values():
        stages = {s: n for n in names for s, held in enumerate(fqns) if any(n.startswith(f + ".") for f in held)}
        if len(stages) < 2:
            continue
        here = [(s, n) for s, n in sorted(stages.items()) if s in modules]
        if here:
            s, n = here[0]
            tied[names[0]] = modules[s].get_parameter(n)
    return tied


def _warn_hidden_ties(model: nn.Module) -> None:
    keys = getattr(model, "_tied_weights_keys", None)
    config = getattr(model, "config", None)
    if not keys or getattr(config, "tie_word_embeddings", True) is False:
        return
    pairs = list(keys.items()) if isinstance(keys, Mapping) else [(k, None) for k in keys]
    aliases = _aliases(model)
    for target, source in pairs:
        if not isinstance(target, str) or target not in aliases:
            continue
        if source is None:
            if len(aliases[target]) < 2:
                warnings.warn(f"{type(model).__name__} declares {target!r} tied, but it shares its Parameter with no other "
                              "module, so the pipeline trains it on its own: tie the weights in the model first (Hugging "
                              "Face: model.tie_weights())", stacklevel=3)
        elif isinstance(source, str) and source in aliases and source not in aliases[target]:
            warnings.warn(f"{type(model).__name__} declares {target!r} tied to {source!r}, but they are two Parameters, "
                          "so the pipeline trains them apart: tie them in the model first (Hugging Face: "
                          "model.tie_weights()) or set tie_word_embeddings=False", stacklevel=3)
