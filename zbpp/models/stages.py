"""Cut a model into the stages of a pipeline schedule, holding on each rank only its own stages.

A stage is named by the modules it holds: a list of module FQNs per stage (torchtitan's
``module_fqns_per_model_part``), given or computed by `fqns_per_stage`, which balances the
model's repeated blocks (``model.layers``) over the stages, puts the modules a forward uses before
the blocks on the first stage and those it uses after them on the last (seen in one forward on the
``meta`` device; an ambiguous one raises), and parameter-free ones (rotary embeddings, dropout) on
every stage.

`pipeline_stages` builds this rank's stage modules from a model on the ``meta`` device (or a
factory that builds one): each stage module is the model itself with the modules it does not hold
removed (set to None; in a ``ModuleList``/``ModuleDict``/``Sequential`` left out, so the others
keep their names), so its ``state_dict`` keys are the model's own. Only the held modules are
materialised, on the rank's device, by the model's own initialisation (Hugging Face
``_init_weights`` of the sub-model holding each module, as HF applies it, else each module's
``reset_parameters``) under a seed per module name, or from a
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
from torch.overrides import TorchFunctionMode

from ..runtime.fsdp import note_parameters
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
                   balance: Balance = "params", example: Any = None) -> list[list[str]]:
    """The modules each of `num_stages` stages holds, as lists of module FQNs in model order.

    The children of `blocks` (a ``ModuleList``, ``ModuleDict`` or ``Sequential``) are split into
    contiguous runs, every stage holding at least one, so that the largest stage load is the
    smallest possible (`zbpp.models.partition.balanced_partition`). The other modules beside the
    path from the model to `blocks` are placed by use, seen in one forward of the model with
    `example` (on the ``meta`` device when the model is there: nothing is computed): a module
    with parameters used only before the first block goes to the first stage, one used only after
    the last block that the forward calls to the last stage; one used both before and after, or
    while the blocks run, or never, is ambiguous and raises (name its stage in
    ``module_fqns_per_stage``). A module without parameters goes to every stage. `example` is the
    forward's input (a tensor, a tuple of arguments or a dict of keyword arguments); for a Hugging
    Face model it defaults to a batch of two tokens. Without it, a model of one's own on the ``meta`` device with an ``nn.Embedding``
    beside the blocks is run on two token ids (``zeros(1, 2)``): a module it uses on both sides of the blocks or while they
    run raises (a tied output head reading the embedding's weight); the modules it does not use, and
    every module where that forward fails or the model embeds no tokens, are placed by registration
    order: before `blocks` on the first stage, after it on the last (pass `example` to place by use).
    Buffers held directly by a module on the path to `blocks` (GPTBigCode's ``transformer.bias``)
    are kept by every stage (`pipeline_stages`).

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
    guessed = example is None and getattr(model, "config", None) is None
    if example is None:
        example = _default_example(model) if not guessed else _guessed_ids(model, before + after)
    if example is not None:
        before, after = _placed_by_use(model, blocks_mod, before + after, example,
                                       fallback=(before, after) if guessed else None)
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


def _guessed_ids(model: nn.Module, watched: list[str]) -> torch.Tensor | None:
    """Two token ids, as the input of a model of one's own that embeds tokens (an ``nn.Embedding`` beside
    its blocks), else None: a forward on them finds a module used on both sides of the blocks (a tied
    output head reading the embedding's weight), which registration order would put on one stage. Only
    on the ``meta`` device: a model with values would compute, draw random numbers and move running
    statistics in a forward the user did not ask for."""
    tensors = [*model.parameters(), *model.buffers()]
    if not tensors or not all(t.is_meta for t in tensors):
        return None
    if not any(isinstance(m, nn.Embedding) for f in watched for m in model.get_submodule(f).modules()):
        return None
    return torch.zeros(1, 2, dtype=torch.long, device="meta")


def _default_example(model: nn.Module) -> Any:
    """Two tokens for a Hugging Face model (one with a ``config`` whose forward takes ``input_ids``)."""
    import inspect

    if getattr(model, "config", None) is None:
        return None
    try:
        takes_ids = "input_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if not takes_ids:
        return None
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}


class _Use(NamedTuple):
    phase: list[str]  # "before", "blocks" (from the first block's start to the last one's end), "after"; "between"
    # after a block's end: "blocks" if another block starts later, else "after" (a model's forward may skip
    # its last blocks, as Mllama's does its cross-attention layers without images)
    active: list[str]  # the watched modules running now, innermost last
    seen: dict[str, set[str]]  # module FQN -> the phases it was used in


#: what a tensor's value decides, answered for a meta tensor during the placement trace
_DATA_DEPENDENT: dict[Any, Callable[[torch.Tensor], Any]] = {
    torch.Tensor.item: lambda t: False if t.dtype == torch.bool else 0,
    torch.Tensor.__bool__: lambda t: False,
    torch.Tensor.__int__: lambda t: 0,
    torch.Tensor.__index__: lambda t: 0,
    torch.Tensor.__float__: lambda t: 0.0,
    torch.Tensor.tolist: lambda t: torch.zeros(t.shape, dtype=t.dtype).tolist(),
    torch.Tensor.nonzero: lambda t: torch.empty(0, t.dim(), dtype=torch.long, device="meta"),
    torch.nonzero: lambda t: torch.empty(0, t.dim(), dtype=torch.long, device="meta"),
}


#: what reads a tensor's metadata, not its values: no use of the module that holds it (Llama 4
#: embeds ``input_ids.to(self.embed_tokens.weight.device)``, a tied LM head's weight)
_METADATA = frozenset({"device", "dtype", "shape", "ndim", "layout", "requires_grad", "is_meta", "is_cuda", "size",
                       "dim", "is_floating_point", "is_complex", "element_size", "numel", "get_device"})


def _reads_metadata(func: Any) -> bool:
    name = getattr(func, "__name__", None)
    if name == "__get__":  # a property's getter: its descriptor names it
        name = getattr(getattr(func, "__self__", None), "__name__", None)
    return name in _METADATA


class _meta_values(TorchFunctionMode):
    """Answers what a meta tensor's value would decide (``.item()``, ``bool``, ``nonzero``) with a
    fixed value, so that a forward on the ``meta`` device runs through its branches."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _DATA_DEPENDENT and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return _DATA_DEPENDENT[func](args[0])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Every module's tensors as they were, after a trace forward: a forward may keep tensors on its
    module (HF's longrope rotary caches ``long_inv_freq``), which on the ``meta`` device the stages
    would copy and could never compute with. Other attributes stay as the forward left them: HF
    marks its output-recording hooks installed (``_output_capturing_hooks_installed``), and a
    forward without the mark would install them again, recording every router's logits twice."""
    saved = [(m, dict(m.__dict__), {t: dict(getattr(m, t)) for t in _TABLES}, set(m._non_persistent_buffers_set))
             for m in model.modules()]
    try:
        yield
    finally:
        for m, attrs, tables, non_persistent in saved:
            for k, v in list(m.__dict__.items()):
                if isinstance(v, torch.Tensor) or isinstance(attrs.get(k), torch.Tensor):
                    if k in attrs:
                        m.__dict__[k] = attrs[k]
                    else:
                        del m.__dict__[k]
            m.__dict__.update((k, v) for k, v in attrs.items() if isinstance(v, torch.Tensor) and k not in m.__dict__)
            for t, entries in tables.items():
                getattr(m, t).clear()
                getattr(m, t).update(entries)
            m._non_persistent_buffers_set.clear()
            m._non_persistent_buffers_set.update(non_persistent)


_TABLES = ("_parameters", "_buffers", "_modules")


def _placed_by_use(model: nn.Module, blocks_mod: nn.Module, watched: list[str], example: Any, *,
                   fallback: tuple[list[str], list[str]] | None = None) -> tuple[list[str], list[str]]:
    """Run `model` once on `example` and split the `watched` modules into those used only before
    the blocks and those used only after them; anything else raises. With a `fallback` (before, after)
    by registration order, the example was guessed (`_guessed_ids`): a forward that fails, or a module
    it never uses, keeps that order; a module used on both sides or while the blocks run still raises."""
    use = _Use(["before"], [], {f: set() for f in watched})
    pending: set[str] = set()  # the modules used since a block's end, in "between"

    def used(f: str) -> None:
        if use.phase[0] == "between":
            pending.add(f)
        else:
            use.seen[f].add(use.phase[0])

    owners: dict[int, list[str]] = {}
    for f in watched:
        for t in [*model.get_submodule(f).parameters(), *model.get_submodule(f).buffers()]:
            owners.setdefault(id(t), []).append(f)
    handles = []
    children = [m for m in blocks_mod._modules.values() if m is not None]
    depth = [0]  # blocks running now (one block may call another)

    def block_start(module: nn.Module, args: Any) -> None:
        for f in pending:
            use.seen[f].add("blocks")
        pending.clear()
        use.phase[0] = "blocks"
        depth[0] += 1

    def block_end(module: nn.Module, args: Any, out: Any) -> None:
        depth[0] -= 1
        if depth[0] == 0:
            use.phase[0] = "between"

    def enter(f: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            use.active.append(f)
            used(f)
        return hook

    def leave(f: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if use.active and use.active[-1] == f:
                use.active.pop()
        return hook

    class Tensors(_meta_values):
        """A watched module's tensor used by code outside its module (``F.linear(h, embed.weight)``)."""

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            for a in [] if _reads_metadata(func) else [*args, *(kwargs or {}).values()]:
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    fs = owners.get(id(t)) if isinstance(t, torch.Tensor) else None
                    if fs and not any(f in use.active for f in fs):
                        for f in fs:
                            used(f)
            return super().__torch_function__(func, types, args, kwargs)

    for m in children:
        handles += [m.register_forward_pre_hook(block_start), m.register_forward_hook(block_end)]
    for f in watched:
        for m in model.get_submodule(f).modules():
            handles += [m.register_forward_pre_hook(enter(f)), m.register_forward_hook(leave(f))]
    try:
        with torch.no_grad(), Tensors(), _state_kept(model):
            if isinstance(example, Mapping):
                model(**example)
            elif isinstance(example, tuple):
                model(*example)
            else:
                model(example)
    except Exception as exc:
        if fallback is not None:  # not a model of token ids after all: registration order, as before
            return fallback
        raise _ForwardFailed(f"placing the modules beside the blocks needs one forward of {type(model).__name__} on "
                             f"the example input, which failed ({type(exc).__name__}: {exc}); pass "
                             "module_fqns_per_stage, or an example= the forward takes") from exc
    finally:
        for h in handles:
            h.remove()
    for f in pending:  # used after the last block the forward called
        use.seen[f].add("after")
    if fallback is not None:  # a module the forward on the guessed ids does not use: where registration puts it
        for f in watched:
            use.seen[f] = use.seen[f] or {"before" if f in fallback[0] else "after"}
    before = [f for f in watched if use.seen[f] == {"before"}]
    after = [f for f in watched if use.seen[f] == {"after"}]
    unclear = {f: sorted(p) for f, p in use.seen.items() if f not in before and f not in after}
    if unclear:
        seen_in = ("; seen in a forward on two token ids, zeros of shape [1, 2], guessed without example=: pass "
                   "example= if the model takes another input") if fallback is not None else ""
        raise ValueError(f"cannot place {unclear} (module: the phases of the forward that use it; [] = never{seen_in}): "
                         "a module with parameters beside the blocks must be used only before the first block (first "
                         "stage) or only after the last one (last stage); name their stages in module_fqns_per_stage "
                         "(a weight that both ends use, a tied output head, is one Parameter registered in a module of "
                         "each)")
    order = _model_order(model)
    return sorted(before, key=order.index), sorted(after, key=order.index)


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
    _check_container_order(model, fqns)
    held = [f for names in fqns for f in names]
    orphans = [n for n in _state_names(model) if not any(n.startswith(f + ".") for f in held)]
    shared = [n for n in orphans if _on_path(n, held)]
    wide = [n for n in shared if n in dict(model.named_parameters(remove_duplicate=False))]
    if wide:
        raise ValueError(f"parameters {wide[:8]} belong directly to a module that holds modules of several stages, so no "
                         "one stage holds them: move them into a submodule and list it")
    orphans = [n for n in orphans if n not in shared]  # buffers of a module on the way: every stage below keeps them
    if orphans:
        raise ValueError(f"no stage holds {orphans[:8]}{' ...' if len(orphans) > 8 else ''}: every parameter and "
                         "buffer of the model must be in a module some stage lists")
    unlisted = _unlisted(model, held)
    if unlisted:
        raise ValueError(f"no stage lists {unlisted[:8]}{' ...' if len(unlisted) > 8 else ''} (modules without "
                         "parameters or buffers): a module no stage holds is None on every stage (its calls fail, or are "
                         "skipped where the forward tests for it); list it on the stages whose forward calls it (a "
                         "parameter-free module may be listed on several)")
    return fqns


def _unlisted(model: nn.Module, held: Sequence[str]) -> list[str]:
    """The outermost modules that no stage holds: neither listed, nor inside a listed module, nor on
    the way to one (those without state, which the orphan check cannot see)."""
    listed = set(held)
    on_path = {f.rsplit(".", i)[0] for f in held for i in range(1, f.count(".") + 1)}
    out: list[str] = []
    for name, _ in model.named_modules():
        if not name or name in on_path:
            continue
        parts = name.split(".")
        if any(".".join(parts[:i]) in listed for i in range(1, len(parts) + 1)):
            continue  # held by a stage
        if not any(name.startswith(o + ".") for o in out[-1:]):  # named_modules: a parent comes right before
            out.append(name)
    return out


def _check_container_order(model: nn.Module, fqns: list[list[str]]) -> None:
    """The children of a ``ModuleList``/``ModuleDict``/``Sequential`` that several stages hold run
    in the container's order, one stage after the other, and each once: a stage's forward iterates
    its part of the container in the container's order, whatever order the lists give. A child that
    a later stage holds must not come before one an earlier stage holds, and a child listed by two
    stages would run twice. Children without parameters or buffers count only in a ``Sequential``
    (elsewhere they are called by name, e.g. a rotary embedding on every stage); a child whose
    submodules are split between stages may be shared by the two stages that split it."""
    for cname, c in model.named_modules():
        if not isinstance(c, _CONTAINERS):
            continue
        prefix = cname + "." if cname else ""
        order = {name: i for i, name in enumerate(k for k, m in c._modules.items() if m is not None)}
        stateful = {name for name, m in c._modules.items() if m is not None
                    and (isinstance(c, nn.Sequential) or any(True for _ in [*m.parameters(), *m.buffers()]))}
        per_stage: list[tuple[int, dict[int, bool]]] = []  # (stage, {child index: listed itself})
        for s, names in enumerate(fqns):
            got: dict[int, bool] = {}
            for f in names:
                if not f.startswith(prefix) or (not prefix and not f):
                    continue
                child = f[len(prefix):].split(".")[0]
                if child in stateful:
                    got[order[child]] = got.get(order[child], False) or f == prefix + child
            if got:
                per_stage.append((s, got))
        for a, (s, got_s) in enumerate(per_stage):
            for t, got_t in per_stage[a + 1:]:
                late, early = max(got_s), min(got_t)
                twice = sorted(i for i in set(got_s) & set(got_t) if got_s[i] or got_t[i])
                if late > early or twice:
                    keys = list(order)
                    raise ValueError(
                        f"module_fqns_per_stage: stage {s} holds {prefix}{keys[late]} and stage {t} holds "
                        f"{prefix}{keys[early]} of {type(c).__name__} {cname or 'the model'!r}"
                        + (f" (both list {[prefix + keys[i] for i in twice]}, which would run twice)" if twice else "")
                        + ": the stages run one after the other and each iterates its children of the container in "
                        "its order, so a later stage must hold later children, each child once")


def _on_path(name: str, held: Sequence[str]) -> bool:
    """Whether tensor `name` belongs directly to a module that contains a held module."""
    owner = name.rpartition(".")[0]
    return any(f.startswith(owner + ".") if owner else True for f in held)


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
    example: Any = None,
) -> PipelineStages:
    """This rank's stage modules of `schedule` cut from `model`, and its tied parameters.

    Args:
        model: the whole model, best on the ``meta`` device (``with torch.device("meta"):``), or a
            function that builds it (called under ``torch.device("meta")``). A model with real
            weights works too: the held modules are copied, the model is left as it is.
        schedule: the `zbpp.schedules.Schedule`; this rank builds ``schedule.stages_on(pp_rank)``.
        pp_rank: this rank's pipeline rank.
        module_fqns_per_stage: one list of module FQNs per stage (every module must be in one, or
            inside one: a parameter-free module may be in several); a container's children in its
            order, each once. Default `fqns_per_stage` with `blocks`, `balance` and `example`. The
            buffers a module on the way to the listed ones holds itself are kept by every stage under it.
        device: where the stages live; default the current CUDA device under NCCL, else the CPU.
        init: ``init(module)`` initialises the parameters and buffers of one held module (and its
            submodules); default: Hugging Face's ``_init_weights`` on every submodule, that of the
            (sub-)model holding it as HF applies it, else each submodule's ``reset_parameters()``.
            Each held module is initialised under its own seed, drawn from `seed` and its FQN: values
            do not depend on the split or the rank. A weight that a later module of the rank shares
            keeps its first module's values (a tied LM head keeps the embedding's; the copies on other
            ranks are made equal by `Pipeline`).
        state_dict: the whole model's (or a superset of this rank's) state, loaded after `init`.

    The stage modules are the model with what the stage does not hold removed, so the model's
    ``forward`` must skip what is None and iterate over its blocks (torchtitan's convention), or
    the stage is wrapped (as `zbpp.models.hf` does). A stage's ``state_dict`` keys are the model's.
    A Parameter registered in modules of two stages comes back in ``tied_parameters`` under its
    first name, on every rank holding one of those stages. The stages are noted
    (`zbpp.runtime.fsdp.note_parameters`): after ``fully_shard`` on each, the pipeline still keeps
    such a Parameter tied, its sharded copies found from these ``tied_parameters`` or, where this
    rank's stages share it, by themselves. A model that declares tied weights
    (Hugging Face ``_tied_weights_keys`` with ``tie_word_embeddings``) which are separate
    Parameters gets a warning: the pipeline cannot see that tie.
    """
    dev = _device(device)  # first: a bad device is refused before the model is built or run
    model = _resolve(model)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a zbpp.schedules.Schedule, got {type(schedule).__name__}")
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < schedule.num_ranks:
        raise ValueError(f"pp_rank must be an int in [0, {schedule.num_ranks}), got {pp_rank!r}")
    S = schedule.num_stages
    fqns = module_fqns_per_stage
    if fqns is None:
        fqns = fqns_per_stage(model, S, blocks=blocks, balance=balance, example=example)
    fqns = _check_fqns(model, fqns, S)  # fqns_per_stage's own answer passes the same check
    _warn_hidden_ties(model)
    mine = schedule.stages_on(pp_rank)
    memo: dict[int, Any] = {}
    modules = {s: _prune(model, "", set(fqns[s]), memo) for s in mine}
    fresh = _materialise(modules.values(), dev)
    _initialise_path_buffers(modules, fqns, init, seed, dev, fresh)
    _initialise(modules, fqns, mine, init, seed, dev)
    if state_dict is not None:
        _load(model, modules, state_dict)
    _check_initialised(modules, fresh)
    note_parameters(modules)  # fully_shard replaces each Parameter: keep which one each copy was
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


def _device(device: torch.device | str | None, caller: str = "pipeline_stages") -> torch.device:
    if device is not None:
        device = torch.device(device)
        if device.type == "meta":  # else the init check failed on it deep inside, on a meta tensor's .item()
            raise ValueError(f"{caller}: device='meta' gives stages without values. The whole model already stays "
                             "on the meta device and only this rank's stages get values, on `device`: give the "
                             "device they train on (default: the current CUDA device under NCCL, else the CPU); "
                             "to shard them with FSDP2, call fully_shard on the built stages")
        return device
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
    from .recompute import _shallow_copied  # (imported here: zbpp.models need not load it)

    _shallow_copied(shell)  # an activation policy's forward: the shell's own, not the model's
    # its own buffers go with it (the stages below need them); its own parameters cannot (_check_fqns)
    shell._parameters = {}
    shell._buffers = {k: copy.deepcopy(v, memo) for k, v in module._buffers.items()}
    shell._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    shell._modules = OrderedDict()
    for name, child in module._modules.items():
        fqn = prefix + name
        if child is not None and any(h == fqn or h.startswith(fqn + ".") for h in held):
            shell._modules[name] = _prune(child, fqn + ".", held, memo)
        elif not isinstance(module, _CONTAINERS):
            shell._modules[name] = None
    return shell


def _materialise(stages: Any, device: torch.device) -> dict[int, tuple[int, int]]:
    """Every meta tensor of the stages becomes an uninitialised tensor on `device` (NaN where it has
    a floating dtype, so that what no initialisation touches is found), a real one is moved there;
    a tensor shared by several modules stays shared. Returns ``{id: (version, data_ptr)}`` of the new
    tensors: an integer or bool one (a mask, position ids) has no NaN, so one with both unchanged
    was never written (in place, or by ``.data =``)."""
    done: dict[int, torch.Tensor] = {}
    fresh: dict[int, tuple[int, int]] = {}
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
                            fresh[id(new)] = (new._version, new.data_ptr())
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


def _initialise(modules: dict[int, nn.Module], fqns: list[list[str]], mine: list[int],
                init: Callable[[nn.Module], None] | None, seed: int, device: torch.device) -> None:
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
                if init is not None:
                    init(m)
                else:
                    _default_init(modules[s], f)(m)
            with torch.no_grad():
                for t, value in kept:
                    t.copy_(value)
            ready.update(id(t) for t in tensors)


def _initialise_path_buffers(modules: dict[int, nn.Module], fqns: list[list[str]],
                             init: Callable[[nn.Module], None] | None, seed: int, device: torch.device,
                             fresh: dict[int, tuple[int, int]]) -> None:
    """The buffers that a module on the way to the held ones holds itself, made from the meta device:
    initialised by `init`, else Hugging Face's ``_init_weights`` or ``reset_parameters`` of that
    module alone (before the held modules, which keep their own initialisation)."""
    for s, root in modules.items():
        for name, m in root.named_modules():
            if name in fqns[s] or any(name.startswith(f + ".") for f in fqns[s]):
                continue
            if not any(id(b) in fresh for b in m._buffers.values() if b is not None):
                continue
            hf = _hf_owner_init(root, name)
            with _seeded(seed, name, device):
                if init is not None:
                    init(m)
                elif hf is not None:
                    hf(m)
                elif callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()


def _hf_owner_init(root: nn.Module, fqn: str) -> Callable[[nn.Module], None] | None:
    """The ``_init_weights`` of the innermost Hugging Face model in `root` on the way to `fqn` (itself
    included), bound to `root`'s copy, or None: HF initialises each module by the sub-model that
    holds it, and some read that sub-model (xLSTM's ``self.embeddings``, its module names)."""
    owner, mod = None, root
    parts = fqn.split(".") if fqn else []
    for i in range(len(parts) + 1):
        if callable(getattr(type(mod), "_init_weights", None)):
            owner = mod
        if i < len(parts):
            mod = mod._modules.get(parts[i])
            if mod is None:
                break
    return None if owner is None else owner._init_weights


def _hf_apply(module: nn.Module, fn: Callable[[nn.Module], None]) -> None:
    """`fn` on `module` and its submodules, children first, switching to a sub-model's own
    ``_init_weights`` below it (HF's ``smart_apply``)."""
    for child in module.children():
        own = child._init_weights if callable(getattr(type(child), "_init_weights", None)) else fn
        _hf_apply(child, own)
    fn(module)


def _default_init(root: nn.Module, fqn: str) -> Callable[[nn.Module], None]:
    """How the module `fqn` of the stage `root` is initialised without `init=`: Hugging Face's
    ``_init_weights`` as HF's own model applies it, else each submodule's ``reset_parameters``."""
    hf = _hf_owner_init(root, fqn)
    if hf is not None:  # the held module's own sub-model's init, children first as HF applies it
        return lambda m: _hf_apply(m, hf)

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


class _ForwardFailed(ValueError):
    """The placement's forward of the model raised (its cause): a caller that has no ``example=`` to
    offer words it for its own arguments (`zbpp.models.hf`)."""


class _Uninitialised(ValueError):
    """Tensors that the model's init left without values (`classes`: the modules holding them), which
    the caller may word for its own arguments (`zbpp.models.hf` takes no init=)."""

    def __init__(self, message: str, classes: list[str], names: list[str], transient: bool = False) -> None:
        super().__init__(message)
        self.classes = classes
        self.names = names  # the tensors, "fqn (stage s)", at most 8
        self.transient = transient  # non-persistent buffers: no state_dict fills them, only init= does


def _check_initialised(modules: dict[int, nn.Module], fresh: dict[int, tuple[int, int]]) -> None:
    bad, unsaved = [], []
    holders: set[str] = set()  # the classes of the modules holding `bad` ones
    kept: set[str] = set()  # ... and `unsaved` ones
    for s, m in modules.items():
        # a non-persistent buffer (torchtitan's freqs_cis) is in no state_dict: only init= can fill it
        transient = {f"{prefix}.{b}" if prefix else b for prefix, sub in m.named_modules()
                     for b in sub._non_persistent_buffers_set}
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            if id(t) not in fresh:
                continue
            if t.is_floating_point() or t.is_complex():
                empty = bool(torch.isnan(t).any())
            else:  # no NaN to find: written at all (init, load_state_dict), else uninitialised memory
                empty = t.numel() > 0 and (t._version, t.data_ptr()) == fresh[id(t)]
            if empty:
                (unsaved if name in transient else bad).append(f"{name} (stage {s})")
                (kept if name in transient else holders).add(type(m.get_submodule(name.rpartition(".")[0])).__name__)
    if unsaved:
        raise _Uninitialised(f"{unsaved[:8]} hold no values after initialisation: non-persistent buffers, which no "
                             "state_dict holds and the model's init does not fill; pass init= (a function that "
                             "initialises one module, e.g. calling the model's own init_weights where it computes "
                             "them)", sorted(kept), unsaved[:8], transient=True)
    if bad:
        # a module that sets its values in its constructor only (HF's Conv1D) has none from the meta device
        raise _Uninitialised(f"{bad[:8]} hold no values after initialisation: the model's init does not cover them "
                             f"(modules {sorted(holders)}; one built on the meta device keeps no value its constructor "
                             "set); pass init= (a function that initialises one module) or state_dict=", sorted(holders),
                             bad[:8])


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
