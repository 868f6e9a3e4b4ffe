"""Hugging Face pretrained weights in and out of a pipeline, one rank's share at a time.

In: `pretrained` reads a local directory as ``save_pretrained`` writes it (``config.json`` and one
``model.safetensors`` or shards with ``model.safetensors.index.json``) into the config and a lazy
mapping ``{name: tensor}`` (`SafetensorsWeights`) that reads a tensor from its file only when asked
for it, straight to the rank's device and dtype. `zbpp.models.hf.causal_lm_stages` gives it to
`pipeline_stages` as ``state_dict``, which asks for the names this rank's stages hold and nothing
else: no process builds or reads the whole model. The checkpoint's names are mapped to the model's
as ``from_pretrained`` maps them (HF's conversion mapping of the family: renames, the base-model
prefix of checkpoints saved without the head, per-expert tensors merged for fused MoE layers), a
tied LM head missing from the checkpoint takes the embedding's tensor, and one the checkpoint holds
with values of its own is untied (`pretrained`). A checkpoint tensor that no name takes (and the
family's HF model does not ignore on purpose) is refused, on every rank alike, as is a checkpoint
that lacks a tensor of the model or holds one in another shape (not only on the rank whose
stages hold it); a multimodal checkpoint's other models (a vision tower) are left unread, with a
warning, as ``AutoModelForCausalLM.from_pretrained`` builds its text model.

Host memory: a rank holds its own stages and one tensor in flight. Measured by
``benchmarks/bench_pretrained_load.py`` (a 439 MB float32 Llama, hidden 1024, 6 layers, vocabulary
16000, in 40 MB shards; stages of 1f1b on 2 ranks): a rank's peak RSS grows by 291 MB for its
220 MB share (0.66 of the model: the share plus the 65 MB embedding being read), where
``from_pretrained`` of the whole model grows by 445 MB.

Out: `save_pretrained` (collective over the job's ranks) writes the trained pipeline as a directory
that ``transformers.AutoModelForCausalLM.from_pretrained`` loads: ``config.json`` (the stages carry
the config) and safetensors shards with their index. Every pipeline rank of data-parallel replica 0
writes the shards of its own stages (no tensor crosses ranks; ``fully_shard`` stages are gathered
per tensor, which every replica joins), a tied weight once under the name HF keeps, in the
checkpoint format HF's own ``save_pretrained`` writes (its conversions reverted).

>>> import tempfile, torch, transformers
>>> from zbpp import Pipeline
>>> from zbpp.models.hf import causal_lm_stages, save_pretrained
>>> from zbpp.schedules import build
>>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
...                                   num_attention_heads=2, num_key_value_heads=1)
>>> model = transformers.AutoModelForCausalLM.from_config(config)
>>> sched = build("1f1b", num_ranks=1, num_microbatches=2)
>>> with tempfile.TemporaryDirectory() as src, tempfile.TemporaryDirectory() as out:
...     model.save_pretrained(src)
...     stages, kwargs = causal_lm_stages(src, sched, 0)       # reads this rank's tensors only
...     pipe = Pipeline(stages, sched, **kwargs)
...     save_pretrained(pipe, out)
...     back = transformers.AutoModelForCausalLM.from_pretrained(out)
>>> torch.equal(back.lm_head.weight, model.lm_head.weight)
True
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from ..runtime.agreement import collective_call

__all__ = ["SafetensorsWeights", "checkpoint_dtype", "pretrained", "save_pretrained"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


# -- in ------------------------------------------------------------------------------------------
def pretrained(path: str | os.PathLike, *, device: torch.device | str | None = None,
               dtype: torch.dtype | str | None = None) -> tuple[Any, "SafetensorsWeights", torch.dtype]:
    """The config of the HF directory `path`, its weights as a lazy mapping, and the dtype to build
    the model in: `dtype` (a floating ``torch.dtype`` or its name, as ``"bfloat16"``), else (None or
    ``"auto"``) the checkpoint's as ``from_pretrained`` with ``dtype="auto"`` finds it
    (``config.dtype``, else that of the weight files' first floating tensor). A config that ties the
    LM head to the embedding while the checkpoint holds both with different values comes back untied
    (``tie_word_embeddings=False``, with a warning), as ``from_pretrained`` loads it: each keeps its own tensor."""
    import transformers

    dtype = _dtype_arg(dtype)
    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{os.fspath(path)!r} is not a Hugging Face model directory: it has no config.json")
    config = transformers.AutoConfig.from_pretrained(root)
    if dtype is None:
        dtype = _saved_dtype(root, config)
    weights = SafetensorsWeights(root, config, device=device, dtype=dtype)
    differ = _ties_the_checkpoint_breaks(weights)
    if differ:
        warnings.warn(f"the config ties {differ}, but {os.fspath(path)!r} holds each of them with different values: "
                      "they are not tied, as from_pretrained loads them (set tie_word_embeddings=False in its "
                      "config.json to silence this)", stacklevel=2)
        config.tie_word_embeddings = False
        weights = SafetensorsWeights(root, config, device=device, dtype=dtype)
        if _ties_the_checkpoint_breaks(weights):  # tied by something other than the flag: one would be lost
            raise ValueError(f"{type(weights._model).__name__} ties {differ} whatever tie_word_embeddings says, but "
                             f"{os.fspath(path)!r} holds them with different values")
    if weights.missing:  # checked on every rank: else only the rank holding one raises, the others wait for it
        raise ValueError(f"{os.fspath(path)!r} lacks {len(weights.missing)} tensors of "
                         f"{type(weights._model).__name__} built from its config.json: {weights.missing[:8]}")
    if weights.mismatched:  # checked on every rank, as `missing`: HF's from_pretrained refuses them too
        raise ValueError(f"{os.fspath(path)!r} holds {len(weights.mismatched)} tensors of another shape than "
                         f"{type(weights._model).__name__} built from its config.json: {weights.mismatched[:8]}; "
                         "does config.json describe these weights?")
    others = _other_models(config, weights)
    if others:  # as AutoModelForCausalLM.from_pretrained builds the text model of a multimodal checkpoint
        warnings.warn(f"{os.fspath(path)!r} holds a multimodal {type(config).__name__}: the causal LM is its text "
                      f"model ({type(weights._model).__name__}); its {len(weights.unexpected)} tensors under "
                      f"{others} belong to its other models and are not read (save_pretrained writes the text "
                      "model alone)", stacklevel=2)
    elif weights.unexpected:  # from_pretrained drops them with a warning: the model would train without them
        raise ValueError(f"{os.fspath(path)!r} holds {len(weights.unexpected)} tensors that "
                         f"{type(weights._model).__name__} built from its config.json has no place for: "
                         f"{weights.unexpected[:8]}; the config does not describe these weights (fix config.json, or "
                         "remove the tensors from the checkpoint)")
    return config, weights, dtype


def _other_models(config: Any, weights: "SafetensorsWeights") -> list[str]:
    """The top-level names of a multimodal checkpoint's models other than its text model (Llama 4's
    ``vision_model``, ``multi_modal_projector``): those of `weights`' unexpected tensors, where
    `config` has a text config apart and no tensor the causal LM reads lies under them; else none
    (a stray tensor among the text model's own is refused)."""
    if not weights.unexpected or config.get_text_config() is config:
        return []
    read = {key.split(".")[0] for sources in weights._sources.values() for key, _ in sources}
    others = sorted({key.split(".")[0] for key in weights.unexpected})
    return [] if read.intersection(others) else others


def checkpoint_dtype(path: str | os.PathLike) -> torch.dtype:
    """The dtype of the HF directory `path`'s weights, as ``from_pretrained(dtype="auto")`` finds it
    and `pretrained` (so ``causal_lm_stages(path, ...)`` without ``dtype``) builds in: ``config.dtype``,
    else that of the weight files' first floating tensor."""
    import transformers

    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{os.fspath(path)!r} is not a Hugging Face model directory: it has no config.json")
    return _saved_dtype(root, transformers.AutoConfig.from_pretrained(root))


def _dtype_arg(dtype: Any) -> torch.dtype | None:
    """`dtype` as `pretrained` takes it, as ``from_pretrained`` does: None or "auto" (the checkpoint's), a
    floating ``torch.dtype`` or its name. Anything else is named here (HF's own error said "module 'torch' has
    no attribute 'auto'", or blamed the config)."""
    if dtype is None or dtype == "auto":
        return None
    found = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if isinstance(found, torch.dtype) and found.is_floating_point:
        return found
    raise ValueError(f"dtype must be a floating torch.dtype, its name (\"bfloat16\"), or None or \"auto\" (the "
                     f"default: a checkpoint's or config's), got {dtype!r}")


def _saved_dtype(root: Path, config: Any) -> torch.dtype:
    saved = getattr(config, "dtype", None)
    return saved if isinstance(saved, torch.dtype) else getattr(torch, saved) if isinstance(saved, str) \
        else _checkpoint_dtype(root)


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """The weights of a HF directory by the model's parameter names, each read from its safetensors
    file when asked for (``safe_open``, one tensor), onto `device`; a floating tensor in the dtype the
    model built in `dtype` gives it (`dtype`, or float32 where the family keeps a weight in float32,
    as a router in ``_keep_in_fp32_modules_strict``,
    or GPT-OSS's norms in float16, ``_keep_in_fp32_modules``); without `dtype`, in the checkpoint's.

    Keys are the names of the model built from `config`; a name asked for twice is read twice (the
    mapping keeps nothing). ``len`` and iteration list the names the checkpoint provides.
    ``unexpected``: the checkpoint keys that no name takes, less those the family's HF model
    ignores on purpose (``_keys_to_ignore_on_load_unexpected``, old ``inv_freq`` buffers);
    ``missing``: the model's names (parameters and persistent buffers) the checkpoint lacks;
    ``mismatched``: those it holds in another shape than the model's (each named with both shapes).
    """

    def __init__(self, root: str | os.PathLike, config: Any, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.root = Path(root)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype
        self._files, shapes = _tensor_files(self.root)  # checkpoint key -> file, and -> its shape
        self._sources, self._converters, self._model, unmatched = _model_names(config, list(self._files), dtype)
        self.unexpected = _not_ignored(self._model, unmatched)
        model_state = self._model.state_dict()
        self.missing = [n for n in model_state if n not in self._sources]
        self.mismatched = [m for n in self._sources if (m := self._mismatch(n, shapes, model_state[n])) is not None]
        # each name's dtype in the model built in `dtype`: a weight kept in float32 is not rounded on the way
        self._dtypes = {n: t.dtype for n, t in self._model.state_dict().items()} if dtype is not None else {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._sources:
            raise KeyError(name)
        dtype = self._dtypes.get(name)
        return self._build(name, lambda key: self._read(key, dtype))

    def _build(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """`name`'s tensor from its checkpoint tensors, each given by ``read(key)``."""
        sources = self._sources[name]
        pattern = self._converters.get(name)
        if pattern is None:
            return read(sources[0][0])
        # a converted weight (e.g. one fused tensor of every expert): HF's own converter builds it
        converter = copy.deepcopy(pattern)
        for key, source_pattern in sources:
            converter.add_tensor(name, key, source_pattern, read(key))
        out = converter.convert(name, model=self._model, config=self._model.config)
        value = out[name]
        return value[0] if isinstance(value, list) else value

    def _mismatch(self, name: str, shapes: Mapping[str, list[int]], want: torch.Tensor) -> str | None:
        """How the checkpoint's tensor for `name` does not fit the model's `want`, or None: built on the
        meta device from the headers' shapes (a converted weight by its converter), so every rank
        finds it without reading any data."""
        try:
            got = self._build(name, lambda key: torch.empty(shapes[key], dtype=want.dtype, device="meta")).shape
        except Exception as exc:  # noqa: BLE001 - e.g. experts of different shapes that do not stack
            keys = [key for key, _ in self._sources[name]]
            return f"{name} from {keys[:4]}{'...' if len(keys) > 4 else ''}: {type(exc).__name__}: {exc}"
        if tuple(got) == tuple(want.shape):
            return None
        return f"{name} {tuple(got)} in the checkpoint, {tuple(want.shape)} in the model"

    def _read(self, key: str, dtype: torch.dtype | None) -> torch.Tensor:
        from safetensors import safe_open

        file = self.root / self._files[key]
        try:
            with safe_open(file, framework="pt", device=str(self.device)) as f:
                t = f.get_tensor(key)
        except Exception as exc:  # an I/O error or damaged data: safetensors' error names no file
            raise OSError(f"could not read {key!r} from {os.fspath(file)!r}: {type(exc).__name__}: {exc}") from exc
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        return t

    def __contains__(self, name: object) -> bool:
        return name in self._sources

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)


def _ties_the_checkpoint_breaks(weights: SafetensorsWeights) -> list[str]:
    """The names of the first tie group whose members the checkpoint holds under keys of their own
    with different values (``from_pretrained`` leaves such a tie undone); reads those tensors."""
    for names in _tie_groups(weights._model):
        own = [n for n in names if n in weights._sources]
        if len({tuple(weights._sources[n]) for n in own}) < 2:  # one source: filled in for the others
            continue
        first = weights[own[0]]
        if any(not torch.equal(weights[n], first) for n in own[1:]):
            return own
    return []


def _tensor_files(root: Path) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Checkpoint key -> the safetensors file (relative to `root`) that holds it, and -> its shape. The single file
    first, as ``from_pretrained`` looks: beside it an index is one left by an earlier sharded save.
    Every file's header is read here, on every rank: a shard missing, cut short or lacking a key of
    the index fails every rank alike (read later, it failed only the ranks whose stages it feeds,
    and the others waited for them in the `Pipeline` until the process group's timeout)."""
    if (root / _SINGLE).is_file():
        shapes = _keys_of(root, _SINGLE)
        return {k: _SINGLE for k in shapes}, shapes
    if (root / _INDEX).is_file():
        files = _weight_map(root)
        shapes: dict[str, list[int]] = {}
        for fname in sorted(set(files.values())):
            if not (root / fname).is_file():
                raise FileNotFoundError(f"{os.fspath(root / fname)!r}, which {_INDEX} lists for "
                                        f"{sum(f == fname for f in files.values())} tensors, does not exist "
                                        "(an incomplete download or copy?)")
            held = _keys_of(root, fname)
            shapes.update(held)
            lacking = sorted(k for k, f in files.items() if f == fname and k not in held)
            if lacking:
                raise ValueError(f"{os.fspath(root / fname)!r} lacks {len(lacking)} tensors that {_INDEX} places in "
                                 f"it: {lacking[:8]}")
        return files, shapes
    found = sorted(p.name for p in root.iterdir())
    raise FileNotFoundError(f"{os.fspath(root)!r} holds neither {_SINGLE} nor {_INDEX} (found {found[:10]}): zbpp "
                            "reads safetensors checkpoints as save_pretrained writes them")


def _checkpoint_dtype(root: Path) -> torch.dtype:
    """The dtype ``from_pretrained(dtype="auto")`` builds in when ``config.json`` names none: the index's
    ``metadata.dtype``, else the first floating tensor's (no FP8 or FP4) in the first weight file, else float32."""
    from safetensors import safe_open
    from transformers.modeling_utils import str_to_torch_dtype

    if (root / _SINGLE).is_file():
        first = _SINGLE
    elif (root / _INDEX).is_file():
        index = _index(root)
        metadata = index.get("metadata")
        if isinstance(metadata, dict) and isinstance(metadata.get("dtype"), str):
            return getattr(torch, metadata["dtype"])
        first = sorted(set(_weight_map(root).values()))[0]
    else:
        return torch.float32  # no weights: `_tensor_files` says so, naming the directory
    _tensor_files(root)  # the files checked first: one cut short is named, not failed on here
    with safe_open(root / first, framework="pt") as f:
        for key in f.keys():
            found = str_to_torch_dtype.get(f.get_slice(key).get_dtype())
            if found is not None and found.is_floating_point and found.itemsize > 1:  # as HF: no FP8 or FP4
                return found
    return torch.float32


def _index(root: Path) -> dict[str, Any]:
    """The parsed ``model.safetensors.index.json`` of `root`; one that is not a JSON object is named."""
    file = root / _INDEX
    try:
        index = json.loads(file.read_text())
    except ValueError as exc:  # json's error names no file
        raise ValueError(f"{os.fspath(file)!r} is not valid JSON ({exc}): is the checkpoint complete?") from None
    if not isinstance(index, dict):
        raise ValueError(f"{os.fspath(file)!r} holds a JSON {type(index).__name__}, not the object of a "
                         "safetensors index ({\"metadata\": ..., \"weight_map\": {tensor: file}})")
    return index


def _weight_map(root: Path) -> dict[str, str]:
    """The index's ``weight_map`` ({tensor: file}); an index without one, or with one of another form, is named
    (else a bare KeyError 'weight_map' or a TypeError, naming no file)."""
    index = _index(root)
    files = index.get("weight_map")
    if not isinstance(files, dict) or not files or not all(isinstance(k, str) and isinstance(v, str)
                                                           for k, v in files.items()):
        what = "has no \"weight_map\"" if "weight_map" not in index else \
            f"has a \"weight_map\" that is not a non-empty {{tensor name: file name}} object ({str(files)[:80]})"
        raise ValueError(f"{os.fspath(root / _INDEX)!r} {what}: it does not say which file holds each tensor "
                         "(a damaged or hand-written index? save_pretrained writes one)")
    return dict(files)


def _keys_of(root: Path, fname: str) -> dict[str, list[int]]:
    """The tensor names and shapes in a safetensors file's header; a file cut short or not safetensors is named."""
    from safetensors import safe_open

    try:
        with safe_open(root / fname, framework="pt") as f:
            return {k: f.get_slice(k).get_shape() for k in f.keys()}
    except Exception as exc:  # safetensors' own error names no file: "incomplete metadata, file not fully covered"
        raise ValueError(f"{os.fspath(root / fname)!r} is not a readable safetensors file (cut short by an "
                         f"incomplete download or copy?): {type(exc).__name__}: {exc}") from exc


def _meta_model(config: Any, dtype: torch.dtype | None = None) -> nn.Module:
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, **({"dtype": dtype} if dtype is not None else {}))
    if dtype is not None:
        _keep_in_float32(model, dtype)
    return model


def _keep_in_float32(model: nn.Module, dtype: torch.dtype) -> None:
    """Turn to float32 the tensors of `model` (its state_dict's) that ``from_pretrained`` in `dtype` loads
    in float32: its class's ``_keep_in_fp32_modules`` in float16 (GPT-OSS's norms) and
    ``_keep_in_fp32_modules_strict`` in float16 and bfloat16. ``from_config`` builds them in `dtype`,
    so a model built from a directory would hold them rounded where HF's holds the checkpoint's."""
    from transformers.core_model_loading import build_glob_alternation

    plan = getattr(model, "_get_dtype_plan", None)
    plan = plan(dtype) if callable(plan) else {}
    if not plan:
        return
    pattern, group_to_glob, _ = build_glob_alternation(list(plan))
    for name, t in model.state_dict(keep_vars=True).items():
        found = pattern.search(name)  # as HF's loader matches them: anywhere in the name
        keep = plan[group_to_glob[found.lastgroup]] if found is not None else None
        if keep is None or not t.is_floating_point() or t.dtype == keep:
            continue
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        if isinstance(t, nn.Parameter):
            t.data = t.data.to(keep)  # the Parameter itself: ties and references to it stay
        else:
            module._buffers[attr] = t.to(keep)


def _model_names(config: Any, keys: list[str], dtype: torch.dtype | None = None
                 ) -> tuple[dict[str, list[tuple[str, str]]], dict[str, Any], nn.Module, dict[str, str]]:
    """Map checkpoint keys to the model's names as ``from_pretrained`` does: the family's renames,
    then at most one converter, then the base-model prefix added or removed. Returns ``{model name:
    [(checkpoint key, source pattern)]}``, ``{model name: converter}`` for converted weights, the
    meta model (built in `dtype`) and ``{checkpoint key: its renamed key}`` of the keys no name
    takes. A tied weight absent from the checkpoint gets its tie's source."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    model = _meta_model(config, dtype)
    wanted = {n: True for n in model.state_dict()}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    sources: dict[str, list[tuple[str, str]]] = {}
    converted: dict[str, Any] = {}
    unmatched: dict[str, str] = {}
    # in HF's order: a converter merges its sources as they come, so experts 0, 1, 2, ..., 10 (not 0, 1, 10, 2 as
    # the index and safetensors list them)
    for key in sorted(keys, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
        if name not in wanted and key in wanted:
            name, pattern = key, None
        if name not in wanted:  # a tensor the model has no place for: `SafetensorsWeights.unexpected`
            unmatched[key] = name
            continue
        sources.setdefault(name, []).append((key, pattern if pattern is not None else key))
        if pattern is not None:
            converted[name] = by_pattern[pattern]
    for names in _tie_groups(model):
        present = [n for n in names if n in sources]
        for n in names:
            if n not in sources and present:
                sources[n] = sources[present[0]]
                if present[0] in converted:
                    converted[n] = converted[present[0]]
    return sources, converted, model, unmatched


def _not_ignored(model: nn.Module, unmatched: Mapping[str, str]) -> list[str]:
    """The checkpoint keys of `unmatched` (``{key: renamed key}``) that ``from_pretrained`` reports
    unexpected: not those whose renamed key the model's class ignores on purpose (HF's own rules,
    applied as HF applies them, where this transformers has them)."""
    import types

    adjust = getattr(model, "_adjust_missing_and_unexpected_keys", None)
    if not unmatched or not callable(adjust):
        return sorted(unmatched)
    info = types.SimpleNamespace(missing_keys=set(), unexpected_keys=set(unmatched.values()))
    adjust(info)
    return sorted(k for k, renamed in unmatched.items() if renamed in info.unexpected_keys)


def _tie_groups(model: nn.Module) -> list[list[str]]:
    """Names that are one Parameter in `model` (its ties, as the config asks), in model order."""
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return [names for names in by_id.values() if len(names) > 1]


# -- out -----------------------------------------------------------------------------------------
@collective_call()  # an interrupt while this rank agreed comes once every rank is done
def save_pretrained(pipe: Any, path: str | os.PathLike, *, max_shard_size: int | str = "2GB") -> None:
    """Write the pipeline's model as a HF directory that ``from_pretrained`` loads (see the module
    docstring). Every rank of the job calls it together, between steps. A rank whose part fails
    (a full disk, a file it may not write) raises its own error and every other rank a
    `PipelineError` naming it, at once (`zbpp.runtime.agreement.agree_on_problems`).

    Args:
        pipe: a `zbpp.Pipeline` of stages from `zbpp.models.hf.causal_lm_stages` (they carry the
            model's config as ``.config``; ``state_dict()`` keys are the whole model's names).
        path: the directory to write (created; shared by the writing ranks). Tied copies are
            compared first (`Pipeline.check_ties`): copies that differ raise on every rank and
            nothing is written. The weight files
            of an earlier save there that this one does not rewrite are deleted.
        max_shard_size: the largest safetensors file, in bytes or as ``"500MB"`` (read as HF's
            ``save_pretrained`` reads it: units in any case, ``"500Mb"`` is 500 MB): each pipeline
            rank splits its stages into files of at most this size as HF splits a model (a tensor
            larger gets a file of its own); on one rank the files are HF's.
    """
    from .._compat import uncompiled
    from ..runtime.agreement import Agreement, agree_on_problems
    from ..runtime.channels import agreement_group, default_timeout

    pipe.check_ties()  # tied copies that drifted apart raise on every rank: HF's format keeps only one of them
    topology = pipe.topology
    # each phase ends in an agreement: a rank that failed alone (a full disk, a file it may not write) raises its
    # error, every other rank an error naming it, at once (not at the process group's timeout in a collective)
    agreement, world = Agreement(agreement_group(topology, default_timeout())), sorted(topology.world)

    def agree(problem: BaseException | None, failed: str, payload: Any = None) -> list[Any]:
        """Every rank of this pipeline's payload, in pipeline order (`agree_on_problems`)."""
        told = dict(zip(world, agree_on_problems(agreement, problem, world, f"save_pretrained {failed}", payload)))
        return [told[g] for g in topology.pipeline]

    try:
        problem = None
        mods = [uncompiled(m) for m in pipe.stage_modules.values()]
        config = next((getattr(m, "config", None) for m in mods if getattr(m, "config", None) is not None), None)
        if config is None:
            raise ValueError("save_pretrained needs stages that carry the model's config (.config), as "
                             "zbpp.models.hf.causal_lm_stages builds them")
        limit = _bytes(max_shard_size)
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
        problem = exc
    agree(problem, "could not start on every rank (nothing was written)")
    writes = topology.dp_rank == 0
    try:
        problem, plan = None, []
        state = _rank_state(mods, config)  # every replica gathers its fully_shard tensors together
        plan = _shards(state, limit) if writes else []
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
        problem = exc
    counts = [int(c) for c in agree(problem, "could not gather its tensors on every rank (nothing was written)",
                                    len(plan))]
    out = Path(path)
    total_files = sum(counts)
    first = sum(counts[:topology.pp_rank])
    index: dict[str, str] = {}
    try:
        problem = None
        if writes:
            out.mkdir(parents=True, exist_ok=True)
            single = total_files == 1
            for i, names in enumerate(plan):
                fname = _SINGLE if single else f"model-{first + i + 1:05d}-of-{total_files:05d}.safetensors"
                _write(out / fname, {n: state[n] for n in names})
                index.update({n: fname for n in names})
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
        problem = exc
    maps = agree(problem, f"could not write its weights on every rank ({os.fspath(path)!r} holds a partial save)",
                 (index, sum(state[n].numel() * state[n].element_size() for n in index)))
    try:
        problem = None
        if writes and topology.pp_rank == 0:
            weight_map = {k: v for m, _ in maps for k, v in m.items()}
            if total_files > 1:
                meta = {"metadata": {"total_size": sum(n for _, n in maps)}, "weight_map": dict(sorted(weight_map.items()))}
                (out / _INDEX).write_text(json.dumps(meta, indent=2) + "\n")
            saved = copy.deepcopy(config)
            floating = next((t.dtype for t in state.values() if t.is_floating_point()), None)
            if floating is not None:
                saved.dtype = floating
            saved.save_pretrained(out)
            # last: a save failing before it leaves the earlier save's files, not a directory lacking both
            _remove_earlier_save(out, set(weight_map.values()) | ({_INDEX} if total_files > 1 else set()))
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
        problem = exc
    # also every rank's wait for the others: none returns before the directory is complete
    agree(problem, f"could not finish on every rank (the weights are written; {os.fspath(path)!r} may lack its "
                   "index or config.json, or still hold weight files of an earlier save)")


def _write(file: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """One safetensors file; an error names the file (safetensors' names a temporary file, or none)."""
    from safetensors.torch import save_file

    try:
        save_file(dict(tensors), file, metadata={"format": "pt"})
    except Exception as exc:
        raise OSError(f"could not write {os.fspath(file)!r}: {type(exc).__name__}: {exc}") from exc


def _remove_earlier_save(out: Path, kept: set[str]) -> None:
    """Delete the weight files of an earlier save in `out` that this one (`kept`) did not write: a
    ``model.safetensors`` beside new shards is what ``from_pretrained`` reads first, an index or
    shards beside a new single file describe weights no longer there."""
    import re

    for f in out.iterdir():
        ours = f.name in (_SINGLE, _INDEX) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f.name)
        if ours and f.name not in kept and f.is_file():
            f.unlink()


def _rank_state(mods: list[nn.Module], config: Any) -> dict[str, torch.Tensor]:
    """This rank's tensors as HF's save_pretrained writes them: full (DTensors gathered), on the
    CPU, each once (a tie under the name HF keeps), converted back to the checkpoint format."""
    from transformers.core_model_loading import revert_weight_conversion

    model = _meta_model(config)
    dropped = {n for names in _tie_groups(model) for n in names[1:]}  # HF keeps the first (the embedding)
    state: dict[str, torch.Tensor] = {}
    for m in mods:
        for name, t in m.state_dict().items():
            if name in state or name in dropped:
                continue
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            state[name] = t.detach().to("cpu", copy=True).contiguous()
    return revert_weight_conversion(model, state)


def _shards(state: Mapping[str, torch.Tensor], limit: int) -> list[list[str]]:
    """The tensors' names split into files as HF's ``save_pretrained`` splits them (huggingface_hub's
    ``split_torch_state_dict_into_shards``): a tensor over `limit` gets a file of its own and the
    file being filled goes on after it, so one rank writes the files HF would."""
    out: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if n > limit:
            out.append([name])
            continue
        if size + n > limit:
            out.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        out.append(current)
    return out


def _bytes(size: int | str) -> int:
    """`size` in bytes, read as HF's ``save_pretrained`` reads its ``max_shard_size`` (huggingface_hub's
    ``parse_size_to_int``: "TB", "GB", "MB", "KB" in any case, decimal; "500Mb" is 500 MB, not the
    megabits of transformers' ``convert_file_size_to_int``, which save_pretrained does not use); also
    "GiB", "MiB", "KiB" and a bare "B". Under one byte ("0MB") is refused, as 0 is."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3,
                 "B": 1}
        text = size.strip()
        for unit, factor in units.items():
            if text.upper().endswith(unit):
                try:
                    n = int(float(text[:-len(unit)].strip()) * factor)
                except (ValueError, OverflowError):  # no number, or nan / inf
                    break
                if n >= 1:
                    return n
                break
    raise ValueError(f"max_shard_size must be a positive number of bytes or a size like '500MB', got {size!r}")
