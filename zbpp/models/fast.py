"""A stage's fastest correct form: `fast_stage` (the recipe) and `fast_pipeline_kwargs` (the runtime).

`fast_stage(stage, blocks=...)` changes a stage in place, keeping its module objects, parameter
objects and parameter names (checkpoints and optimizers are unaffected):

- every ``nn.Linear``, every transposed-weight linear layer (HF's ``Conv1D``) and every class of
  `linear_like` becomes a zbpp delayed-wgrad `Linear` (`zbpp.modules.delay_wgrad`): its weight
  gradient waits for W, computed by zbpp's own GEMM code outside any compiled graph. Other
  weights (a mixture of experts' grouped GEMMs, a router's) stay in the compiled regions, their
  gradients in B (in W on the first stage, see below) and their GEMMs out of FP8: `fast_stage`
  warns, naming them;
- the code between the GEMMs (norms, rotary embeddings, attention, activations, residual adds) is
  compiled by ``torch.compile``, block by block (`blocks`: the repeated blocks, one compilation
  shared by all of them; Hugging Face's output-recording hooks inside a block, a router's logits
  among them, run after it, eagerly, else each block recompiles) or, without `blocks`, the stage's
  forward as a whole. Each zbpp layer is a
  graph break (``zbpp.modules.base._outside_graph``), so a compiled region never swallows a
  weight GEMM and W stays non-empty; the regions' own weights (norm scales) get their gradients
  in B, in the region's one backward node, which computes the input's gradient too (on the first
  stage, whose input takes no gradient, B has nothing to compute and W runs the whole backward);
- W adds each weight gradient into ``.grad`` inside its GEMM (``accumulate_wgrad_in_gemm``:
  one pass over the gradient less per microbatch; rounded once, so not bit-identical to eager);
- ``fp8=True`` (or a `DelayedScaling` recipe) runs the stage's forward inside `fp8_autocast`, the
  swapped layers keep their weights' FP8 casts across a step's microbatches
  (``keep_fp8_weight_casts``: one cast per weight and step instead of one per microbatch), and
  each gated MLP (``down(act(gate(x)) * up(x))``, HF's Llama-style ones) runs as one FP8 layer:
  gate and up as one GEMM, the activation fused with the casts (`zbpp.modules.fuse_gated_mlps`).

`fast_pipeline_kwargs(device)` gives the `Pipeline` keywords that go with it: ``cuda_graphs="auto"``
on a CUDA device (each F, B and W task replayed from a CUDA graph where that measured faster: the
host's work between the many small kernels, and the compiled regions' guards, leave the step; a
compute-bound stage, where replays can be slower, keeps its eager steps; so do ``fully_shard``
stages, which graphs cannot capture), nothing on the CPU.
`zbpp.models.hf.causal_lm_stages(..., fast=True)` applies both to a Hugging Face model; ``fully_shard``
the stages after it (compiled layers under FSDP2, as torchtitan runs them).

>>> import torch
>>> from torch import nn
>>> from zbpp import Pipeline
>>> from zbpp.schedules import build
>>> torch.manual_seed(0) and None
>>> blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU()) for _ in range(2)])
>>> stage = fast_stage(blocks, blocks=list(blocks), backend="eager")
>>> type(blocks[0][1]).__name__, blocks[0][1].delay_wgrad_compute
('Linear', True)
>>> sched = build("zb-h1", num_ranks=1, num_microbatches=2)
>>> pipe = Pipeline({0: stage}, sched, lambda y, _: y.square().mean(), **fast_pipeline_kwargs("cpu"))
>>> loss = pipe.step(torch.randn(4, 8))
>>> blocks[1][1].weight.grad.shape
torch.Size([8, 8])
"""

from __future__ import annotations

import inspect
import warnings
from collections import Counter
from typing import Any, Sequence

import torch
from torch import nn

from .._compat import never_compiled
from ..modules import DelayedScaling, delay_wgrad, fp8_autocast, fuse_gated_mlps
from ..modules.base import DelayedWgradModule

__all__ = ["fast_stage", "fast_pipeline_kwargs", "fast_hf_stages", "Fp8Forward"]


class Fp8Forward:
    """Forward hooks that run a module's forward inside ``fp8_autocast(fp8_recipe=recipe)`` (hooks,
    not a wrapper module, so that parameter names stay as they were). `attach` installs them."""

    def __init__(self, recipe: DelayedScaling) -> None:
        self.recipe = recipe
        self._open: list[Any] = []  # the entered blocks, innermost last (a stage may re-enter itself)

    def attach(self, module: nn.Module) -> None:
        # eager even in a compiled stage: a context variable is set and reset, not traced
        module.register_forward_pre_hook(torch.compiler.disable(self._enter))
        module.register_forward_hook(torch.compiler.disable(self._exit), always_call=True)  # also when forward raises

    def _enter(self, module: nn.Module, args: Any) -> None:
        block = fp8_autocast(enabled=True, fp8_recipe=self.recipe)
        block.__enter__()
        self._open.append(block)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self._open.pop().__exit__(None, None, None)


def fast_stage(
    stage: nn.Module,
    *,
    blocks: Sequence[nn.Module] | None = None,
    fp8: bool | DelayedScaling = False,
    compile: bool = True,
    backend: str = "inductor",
    linear_like: Sequence[type] = (),
) -> nn.Module:
    """Give `stage` its fast form (see the module docstring), in place, and return it.

    Args:
        stage: a pipeline stage (any ``nn.Module``).
        blocks: modules inside `stage` to compile one by one (the repeated decoder layers, so one
            compilation serves them all), or the ModuleList, ModuleDict or Sequential holding them;
            None compiles the stage's forward as a whole.
        fp8: False (bf16 or whatever the parameters are), True (FP8 with the default
            `DelayedScaling`) or a `DelayedScaling` recipe.
        compile: False keeps everything eager (the delayed weight gradients and FP8 still apply).
        backend: ``torch.compile``'s backend ("inductor"; "aot_eager" or "eager" to debug).
        linear_like: ``nn.Linear`` subclasses whose forward computes ``x W^T + b``, converted too
            (`zbpp.modules.delay_wgrad`; `fast_hf_stages` passes Hugging Face's).

    A Hugging Face model inside `stage` whose ``config.use_cache`` is on (HF's default) runs without a
    KV cache unless a call passes ``use_cache=True``: a training step needs none, and each layer's
    cache entry would recompile its compiled block. HF's output-recording hooks (``output_router_logits``,
    ``output_attentions``) on modules inside `blocks` run after each compiled block, whether HF installed
    them before `fast_stage` or at a later forward; a warning names any such module whose hooks zbpp
    does not recognise (they would recompile each block).
    """
    if not isinstance(stage, nn.Module):
        raise TypeError(f"fast_stage: stage is a {type(stage).__name__}, not a torch.nn.Module")
    if fp8 is not True and fp8 is not False and not isinstance(fp8, DelayedScaling):
        raise TypeError(f"fast_stage: fp8={fp8!r}; pass True, False or a zbpp.modules.DelayedScaling")
    if isinstance(blocks, nn.ModuleDict):  # torchtitan holds its layers in one: its values are the blocks
        blocks = list(blocks.values())
    elif isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise TypeError(f"fast_stage: blocks is one {type(blocks).__name__}; pass a list of the stage's blocks "
                        "(or the ModuleList, ModuleDict or Sequential that holds them)")
    owned = {id(m) for m in stage.modules()}
    for block in blocks or ():
        if not isinstance(block, nn.Module) or id(block) not in owned:
            raise ValueError(f"fast_stage: every one of blocks must be a module inside the stage; "
                             f"{type(block).__name__} is not")
    _cache_off_unless_asked(stage)
    if fp8 is not False:
        fuse_gated_mlps(stage)
    delay_wgrad(stage, transposed=True, linear_like=linear_like)
    if compile or fp8 is not False:
        _warn_weights_left(stage, ([stage] if blocks is None else list(blocks)) if compile else [], fp8 is not False)
    for layer in stage.modules():
        if isinstance(layer, DelayedWgradModule):
            layer.accumulate_wgrad_in_gemm = True
            layer.keep_fp8_weight_casts = fp8 is not False
    if compile:
        if blocks is None:
            stage.compile(backend=backend)
        else:
            _mark_declared_recorders(stage)
            for block in blocks:
                _defer_output_recorders(block)
                block.register_forward_pre_hook(_defer_at_call)  # HF installs its hooks at a later forward
                block.compile(backend=backend)
    if fp8 is not False:
        Fp8Forward(DelayedScaling() if fp8 is True else fp8).attach(stage)
    return stage


def _cache_off_unless_asked(stage: nn.Module) -> None:
    """Run each outermost Hugging Face model inside `stage` (a ``config.use_cache`` and a forward taking
    ``use_cache``) with ``use_cache=False`` unless a call passes one: a training step needs no KV cache, and each
    decoder layer's own cache entry (its layer index) would make its compiled block recompile."""
    hooked: list[str] = []
    for path, module in stage.named_modules():
        if any(path.startswith(f"{p}.") or not p for p in hooked):  # the outer model passes use_cache on
            continue
        if not hasattr(getattr(module, "config", None), "use_cache"):
            continue
        forward = inspect.signature(module.forward).parameters
        if "use_cache" not in forward:
            continue
        names = [n for n, p in forward.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        at = names.index("use_cache") if "use_cache" in names else None
        module.register_forward_pre_hook(_cache_off_hook(at), with_kwargs=True)
        hooked.append(path)


def _cache_off_hook(at: int | None) -> Any:
    def cache_off(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if at is not None and len(args) > at:  # passed by position
            return None if args[at] is not None else ((*args[:at], False, *args[at + 1:]), kwargs)
        if kwargs.get("use_cache") is not None:  # the caller's choice (None: HF's config default)
            return None
        return args, {**kwargs, "use_cache": False}
    return cache_off


#: where Hugging Face's output-recording forward hooks come from (``output_router_logits`` and the like);
#: on a module its model declares recorded (`_mark_declared_recorders`), any of transformers' hooks counts
_RECORDER_MODULE = "transformers.utils.output_capturing"


def _mark_declared_recorders(stage: nn.Module) -> None:
    """Mark the modules inside `stage` whose outputs a Hugging Face model records: each model's
    ``_can_record_outputs`` names them (a class, a class name matched against the module's path, or an
    ``OutputRecorder`` of either, maybe limited to a ``layer_name``), and HF hooks exactly those at the
    model's first forward that records anything, then sets ``_output_capturing_hooks_installed``.
    Each gets ``_zbpp_recorded_by = (model, keys, path in stage)``; a model inside another
    dispatches its own declarations, as HF's ``recursively_install_hooks`` does."""

    def walk(module: nn.Module, name: str, path: str, owner: Any, tasks: list[tuple[str, Any]]) -> None:
        if hasattr(type(module), "_can_record_outputs"):  # a PreTrainedModel: its own declarations from here
            name = name if tasks else ""  # HF names modules from the model that installs (one declaring some)
            owner, tasks = module, _record_tasks(getattr(module, "_can_record_outputs", None))
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}", f"{path}.{child_name}" if path else child_name, owner, tasks)
        keys = [key for key, target, class_name, layer_name in tasks
                if (isinstance(target, type) and isinstance(module, target)
                    or isinstance(class_name, str) and name.endswith(class_name))
                and (layer_name is None or f".{layer_name.strip('.')}." in name + ".")]
        if keys:
            module._zbpp_recorded_by = (owner, tuple(keys), path or type(module).__name__)

    walk(stage, "", "", None, [])


def _record_tasks(declared: Any) -> list[tuple[str, Any, Any, Any]]:
    """``_can_record_outputs`` as (key, target class, class name, layer name) rows."""
    rows = []
    for key, specs in (declared or {}).items():
        for spec in specs if isinstance(specs, (list, tuple)) else [specs]:
            if isinstance(spec, str):
                rows.append((key, None, spec, None))
            elif isinstance(spec, type):
                rows.append((key, spec, None, None))
            else:  # an OutputRecorder
                rows.append((key, getattr(spec, "target_class", None), getattr(spec, "class_name", None),
                             getattr(spec, "layer_name", None)))
    return rows


def _is_recorder(hook: Any, declared: bool) -> bool:
    """Whether `hook` is one of HF's output recorders: a hook of transformers' recording module, or,
    on a module HF declares recorded, any hook of the transformers package (a moved module still counts)."""
    where = getattr(hook, "__module__", None)
    where = where if isinstance(where, str) else ""
    return where == _RECORDER_MODULE or declared and (where == "transformers" or where.startswith("transformers."))


def _defer_output_recorders(block: nn.Module) -> None:
    """Run Hugging Face's output-recording hooks of the modules inside `block` (a MoE router's, which
    ``output_router_logits`` turns on) after the compiled block returns, eagerly, in the order the
    modules ran. Traced inside the block, the hook appends to one list per forward, which grows by
    one each layer, and dynamo guards on its length: one recompilation per layer, and past the
    recompile limit (8) the remaining layers run eagerly. In the graph each such module now only
    appends its output to the block's own list, empty at every call (`_record_output`), and
    `_replay_recorded` hands it to the hooks. A module HF declares recorded gets `_record_output`
    before HF hooks it: dynamo does not guard on hooks added later, so a hook HF installs after the
    block's first trace would otherwise never run. Hooks found on an already deferred module join
    its deferred ones; `_defer_at_call` runs this again when HF installs its hooks."""
    recorded: list[tuple[nn.Module, Any, Any]] = block.__dict__.get("_zbpp_recorded", [])  # one list per block
    deferred = False
    for module in block.modules():
        if module is block:  # the block's own run eagerly
            continue
        declared = "_zbpp_recorded_by" in module.__dict__
        hooks = module._forward_hooks
        ids = [k for k, h in hooks.items() if h is not _record_output and k not in module._forward_hooks_with_kwargs
               and _is_recorder(h, declared)]
        if "_zbpp_deferred_hooks" in module.__dict__:  # by an enclosing block, or an earlier call
            module._zbpp_deferred_hooks.extend(hooks.pop(k) for k in ids)
            continue
        if not ids and not declared:
            continue
        module._zbpp_deferred_hooks = [hooks[k] for k in ids]
        module._zbpp_recorded = recorded
        if ids:
            hooks[ids[0]] = _record_output  # in the first one's place: it sees the output they saw
            for k in ids[1:]:
                del hooks[k]
        else:
            module.register_forward_hook(_record_output)
        deferred = True
    if deferred and "_zbpp_recorded" not in block.__dict__:  # the block's hooks, once
        block._zbpp_recorded = recorded
        block.register_forward_pre_hook(_forget_recorded)
        block.register_forward_hook(_replay_recorded)
    _warn_unrecognised_recorders(block)


def _warn_unrecognised_recorders(block: nn.Module) -> None:
    """Warn, naming them, of modules inside `block` that HF has hooked to record (its model's hooks
    are installed) but that hold no recognised recorder, only other forward hooks: those are traced
    inside the compiled block (a recompilation per layer), or, added after its first trace, not run.
    Once per model and module class: the other blocks hold the same."""
    found: dict[int, tuple[nn.Module, list[str]]] = {}
    for module in block.modules():
        by = module.__dict__.get("_zbpp_recorded_by")
        if module is block or by is None or module.__dict__.get("_zbpp_deferred_hooks"):
            continue
        owner, keys, path = by
        others = [h for h in module._forward_hooks.values() if h is not _record_output]
        told = owner.__dict__.setdefault("_zbpp_unrecognised", set())
        if not others or type(module) in told or not getattr(owner, "_output_capturing_hooks_installed", False):
            continue
        told.add(type(module))
        hooks = ", ".join(f"{getattr(h, '__module__', None)}.{getattr(h, '__qualname__', type(h).__name__)}"
                          for h in others)
        found.setdefault(id(owner), (owner, []))[1].append(
            f"{'/'.join(keys)} from {path} ({type(module).__name__}; its forward hooks: {hooks})")
    for owner, what in found.values():
        warnings.warn(f"fast_stage: {type(owner).__name__} records {'; '.join(what)}, but none of these hooks is a "
                      f"Hugging Face output recorder zbpp recognises (a hook of {_RECORDER_MODULE}, or of the "
                      "transformers package on a module the model declares recorded): they run inside the compiled "
                      "block, which then recompiles at each layer, or, added after its first trace, do not run "
                      "at all", stacklevel=2)


@never_compiled
def _defer_at_call(block: nn.Module, args: Any) -> None:
    """Defer the recorders found at the block's first call (HF installs its hooks at the model's first
    forward that records) and again once each model that records from inside it has installed them."""
    waiting = block.__dict__.get("_zbpp_waiting")
    if waiting is None or any(getattr(m, "_output_capturing_hooks_installed", False) for m in waiting):
        _defer_output_recorders(block)
        owners = {id(by[0]): by[0] for m in block.modules() if (by := m.__dict__.get("_zbpp_recorded_by"))}
        block._zbpp_waiting = [m for m in owners.values() if not getattr(m, "_output_capturing_hooks_installed", False)]


@never_compiled  # inlined in a traced block it is traced; called where a graph break left off, it runs eagerly
def _record_output(module: nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling() or module._zbpp_recorded:  # traced, or after a traced one: keep the order
        module._zbpp_recorded.append((module, args, output))
    else:  # eager (an activation policy's re-run, which no block hook follows): at once, holding nothing
        _run_deferred(module, args, output)


@never_compiled  # runs where the compiled block hands back to eager code: no frame of its own
def _forget_recorded(block: nn.Module, args: Any) -> None:
    block._zbpp_recorded.clear()  # what a call that raised left


@never_compiled
def _replay_recorded(block: nn.Module, args: Any, output: Any) -> None:
    recorded = list(block._zbpp_recorded)
    block._zbpp_recorded.clear()
    for module, module_args, module_output in recorded:
        _run_deferred(module, module_args, module_output)


def _run_deferred(module: nn.Module, args: Any, output: Any) -> None:
    for hook in module._zbpp_deferred_hooks:
        if hook(module, args, output) is not None:  # a recorder returns None; an output it replaced would be lost
            raise RuntimeError(f"fast_stage: the output-recording hook {hook.__qualname__} of a "
                               f"{type(module).__name__} replaced its output; it runs after the compiled block")


def _warn_weights_left(stage: nn.Module, compiled: list[nn.Module], fp8: bool) -> None:
    """Warn, naming them, of the modules whose weights (2-D or more, embeddings aside) are not zbpp
    layers': inside `compiled` regions their gradients come with B (a region's one backward node
    computes its input's gradient too), except on the first stage, where W runs the whole backward;
    in FP8 their GEMMs stay in high precision."""
    inside = {id(m) for region in compiled for m in region.modules()}
    left = Counter(type(m).__name__ for m in stage.modules()
                   if not isinstance(m, (DelayedWgradModule, nn.Embedding, nn.EmbeddingBag))
                   and any(p is not None and p.dim() >= 2 for p in m._parameters.values())
                   and (fp8 or id(m) in inside))
    if not left:
        return
    names = ", ".join(f"{name} x{n}" for name, n in sorted(left.items()))
    costs = (["inside a compiled region their weight gradients come with B, not W, where the stage's input takes a "
              "gradient (on the first stage, whose input takes none, W runs the whole backward, them included)"]
             if inside else []) + \
        (["their GEMMs do not run in FP8"] if fp8 else [])
    warnings.warn(f"fast_stage: {sum(left.values())} modules hold weights that are not zbpp layers ({names}): "
                  f"{'; '.join(costs)}. The step is right either way; zbpp.modules.delay_wgrad converts nn.Linear, "
                  "[in, out] linear layers (transposed=True) and nn.Linear subclasses (linear_like=)", stacklevel=3)


#: Hugging Face's nn.Linear subclasses whose forward is x W^T + b (by class name: the model's own
#: module need not be imported)
HF_LINEAR_LIKE = ("FalconLinear",)


def fast_pipeline_kwargs(device: torch.device | str | None) -> dict[str, Any]:
    """The `Pipeline` keywords of the fast form on `device`: ``{"cuda_graphs": "auto"}`` on CUDA
    (task graphs per input signature where its trial timed them faster than eager steps:
    `zbpp.runtime.task_graphs`), ``{}`` elsewhere (task graphs are CUDA graphs).

    >>> fast_pipeline_kwargs("cpu"), fast_pipeline_kwargs("cuda:0")
    ({}, {'cuda_graphs': 'auto'})
    """
    kind = torch.device(device).type if device is not None else "cpu"
    return {"cuda_graphs": "auto"} if kind == "cuda" else {}


def fast_hf_stages(stages: dict[int, nn.Module], *, fast: bool = True, fp8: bool | DelayedScaling = False,
                   loss_fn: Any = None, backend: str = "inductor") -> dict[str, Any]:
    """`fast_stage` on each stage of `zbpp.models.hf.causal_lm_stages` (the decoder layers it holds, e.g.
    ``model.layers`` or ``transformer.h``, compiled one by one), in place; returns `fast_pipeline_kwargs` for their
    device, with `loss_fn` compiled (the float32 upcast of the logits and the cross entropy fused:
    eager, they make several passes over a [tokens, vocab] float32 tensor) when given.
    ``causal_lm_stages(..., fast=True, fp8=...)`` calls it.

    >>> import transformers
    >>> from zbpp.models.hf import causal_lm_stages
    >>> from zbpp.schedules import build
    >>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...                                   num_attention_heads=2, num_key_value_heads=1)
    >>> stages, kwargs = causal_lm_stages(config, build("zb-h1", num_ranks=1, num_microbatches=2), 0,
    ...                                   device="cpu", fast=True)
    >>> type(stages[0].model.layers[0].mlp.up_proj).__name__, kwargs.get("cuda_graphs", False)
    ('Linear', False)
    """
    if fast is not True and fast is not False:  # else a truthy 1 or "yes" reads as the fp8 error below
        raise TypeError(f"fast={fast!r}; pass True or False")
    if fast is not True:
        raise ValueError(f"fp8={fp8!r} needs fast=True: FP8 applies to the fast form's zbpp layers")
    devices = set()
    for stage in stages.values():
        spec = getattr(stage, "_zbpp_stage_spec", None)  # set by causal_lm_stages: where the decoder layers are
        if spec is None:
            raise TypeError(f"fast_hf_stages: a {type(stage).__name__} is not a stage of "
                            "zbpp.models.hf.causal_lm_stages; use fast_stage for other stages")
        layers = stage.get_submodule(spec.template.blocks)  # only this stage's (maybe none: embeddings alone)
        like = {type(m) for m in stage.modules() if type(m).__name__ in HF_LINEAR_LIKE and isinstance(m, nn.Linear)}
        fast_stage(stage, blocks=list(layers), fp8=fp8, backend=backend, linear_like=tuple(like))
        devices.update(p.device for p in stage.parameters())
    if len(devices) > 1:
        raise ValueError(f"the stages' parameters are on several devices {sorted(map(str, devices))}; "
                         "the fast form's task graphs take one")
    kwargs = fast_pipeline_kwargs(devices.pop() if devices else None)
    if loss_fn is not None:
        plain = inspect.isfunction(loss_fn) or inspect.ismethod(loss_fn)  # else a callable object
        kwargs["loss_fn"] = torch.compile(loss_fn if plain else loss_fn.__call__, backend=backend)
    return kwargs
