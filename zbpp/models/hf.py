"""Hugging Face decoder-only causal LMs as pipeline stages, every family that fits one template.

The template: a ``*ForCausalLM`` whose base model (``model.<base_model_prefix>``) embeds the tokens,
runs ``config.num_hidden_layers`` decoder layers from one ``ModuleList`` (``model.layers``,
``transformer.h``, ``model.decoder.layers``, ...), applies a final norm, and whose LM head
(``get_output_embeddings()``) turns the result into logits. `SUPPORTED` lists the ``model_type``\\s
the tests run (every one exact against HF's model on 2 ranks under zb-h1 and zb-v); another model
that fits the template is built the same way, with a warning naming its type (untested against HF),
one that does not is refused naming what did not fit.

How a stage computes its part: it runs **the model's own forward** (HF's code, not a copy), with
the decoder layer list swapped, during the call, for one of the model's full length in which the
layers this stage does not hold are stand-ins. So everything the forward does around the layers is
HF's: the masks of each layer type (``config.layer_types`` read with the global layer index), rotary
or learned positions, alibi, embedding scales (Gemma, Granite), the embedding LayerNorm (Bloom),
and on the last stage the LM head with the ``*ForCausalLM`` forward's logit scales and softcaps
(Gemma 2/3, Cohere, Granite). A later stage passes zeros as ``inputs_embeds``; the modules it does
not hold that the forward calls before the layers (GPT-2's position embedding, Bloom's embedding
LayerNorm, ...) are stand-ins that return them, and the stand-in of the layer before its first one
returns the received hidden states instead (a model whose layers take such a module's output some
other way than through the hidden states is refused: they would compute with the zeros). Its
output is its last layer's output, taken by a hook (a non-last stage calls the base model, the last
one the ``*ForCausalLM``). Layers that the forward skips on tokens alone (Mllama's cross-attention
layers) are passed by: "before" and "last" count the layers it calls. Placement is
`zbpp.models.fqns_per_stage`, decided by a forward on the ``meta`` device (which stage uses what).

Stages pass ``{"hidden_states", "attention_mask", "position_ids"}`` along (and ``"router_logits"``,
below); the last stage returns the logits. The step's input is ``input_ids`` or ``{"input_ids":
..., "attention_mask": ..., "position_ids": ...}`` (the last two optional, as in HF), the target is
HF's ``labels`` (-100 ignored). The loss (`CausalLMLoss`) is HF's, weighted by predicted tokens.

Masks are decided from what is given, never from values read on the host: HF's forward looks at an
``attention_mask`` (all ones?) or ``position_ids`` (packed sequences?) on the host to skip building a
mask, which waits for the GPU once per microbatch and decides differently while a CUDA graph is
captured (HF then always builds the mask), so a task graph would replay other kernels than the eager
step ran. In a stage, a given ``attention_mask`` or ``position_ids`` is always applied as a built
mask, and with neither the attention is causal by SDPA's ``is_causal`` (flash kernels): pass no
``attention_mask`` for batches without padding. Packed rows (``position_ids`` restarting within a
row, no ``attention_mask``) get HF's packed-sequence mask, as HF's forward with ``use_cache=False``
builds it (with its default cache HF skips the packing and attends across the sequences).

Mixture-of-experts (Mixtral, Qwen2-MoE, OLMoE, ...): when the config asks for the router auxiliary
loss (``output_router_logits=True``), every stage appends its layers' router logits to a
``"router_logits"`` tensor ``[layers so far, tokens, experts]`` that travels with the hidden states
(carried, not summed per stage: the balancing loss multiplies means over all layers, so it does not
split by stage; the tensor is small, layers x tokens x experts), and the last stage returns
``{"logits", "router_logits", "attention_mask"}`` with it token-major, ``[tokens, layers, experts]``
(HF's per-layer tensors stacked along dim 1), so that `Pipeline.eval_step` concatenates the
microbatches' along dim 0 into the whole batch's. Microbatch j's loss is then HF's: ``CE_j +
router_aux_loss_coef * load_balancing_loss_func(router logits of all layers for microbatch j,
num_experts, num_experts_per_tok, attention_mask_j)`` (the model's own function), and the step's
loss and gradient are those of ``sum_j w_j * loss_j / sum_j w_j`` with w_j the predicted tokens of
microbatch j. The balancing loss is not linear in the batch, so this equals HF on the
whole batch only for one microbatch; it is HF's loss applied per microbatch, as gradient
accumulation with HF gives it. DeepSeek-V3 has no auxiliary loss in HF (bias-based balancing).

>>> import torch, transformers
>>> from zbpp import Pipeline
>>> from zbpp.schedules import build
>>> config = transformers.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
...                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> sched = build("1f1b", num_ranks=1, num_microbatches=2)
>>> stages, kwargs = causal_lm_stages(config, sched, pp_rank=0)
>>> pipe = Pipeline(stages, sched, **kwargs)
>>> ids = torch.randint(0, 32, (4, 8))
>>> loss = pipe.step({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, target=ids)
>>> bool(loss > 0)
True
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .._compat import never_compiled
from ..schedules.ir import Schedule
from .hf_weights import save_pretrained
from .stages import Balance, _device, _ForwardFailed, _Uninitialised, fqns_per_stage, pipeline_stages

__all__ = ["causal_lm_stages", "save_pretrained", "CausalLMLoss", "RouterAuxLoss", "SUPPORTED", "check_template",
           "small_config"]

#: the ``config.model_type``\ s the tests run on 2 ranks under zb-h1 and zb-v against HF's model
#: (tests/models/test_hf_families.py); any other model that fits the template is built too, with a warning
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "olmo",
             "olmo2", "gpt_neox", "opt", "falcon", "bloom", "starcoder2", "gpt_bigcode", "cohere", "granite", "glm",
             "smollm3", "helium", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3",
             "stablelm", "nemotron", "persimmon", "olmo3", "ministral", "ministral3", "glm4", "arcee", "bitnet",
             "diffllama", "ernie4_5", "exaone4", "granite_swa", "hunyuan_v1_dense", "seed_oss", "cohere2", "vaultgemma",
             "nanochat", "cwm", "jais2", "hyperclovax", "lfm2", "qwen3_5_text", "biogpt",
             "qwen3_moe", "granitemoe", "granitemoeshared", "phimoe", "flex_olmo", "gpt_oss", "minimax", "mellum",
             "qwen3_next", "qwen3_5_moe_text", "cohere2_moe", "dots1", "exaone_moe", "glm4_moe", "hunyuan_v1_moe",
             "solar_open", "ernie4_5_moe", "afmoe", "llama4_text", "deepseek_v2", "glm4_moe_lite", "minicpm3", "youtu",
             "gptj", "codegen", "gpt_neo", "mpt", "doge")


@dataclass(frozen=True)
class RouterAuxLoss:
    """A mixture-of-experts model's router auxiliary loss as its ``*ForCausalLM`` forward adds it:
    ``coef * fn(router_logits_per_layer, num_experts, top_k, attention_mask)``."""

    fn: Callable[..., torch.Tensor]
    num_experts: int
    top_k: int
    coef: float

    def __call__(self, router_logits: torch.Tensor | None, attention_mask: torch.Tensor | None) -> torch.Tensor | float:
        if router_logits is None:  # no layer routed
            return 0.0
        # the last stage's router logits are token-major, [tokens, layers, experts]: one tensor per layer
        return self.coef * self.fn(tuple(router_logits.unbind(1)), self.num_experts, self.top_k, attention_mask)


class CausalLMLoss:
    """HF's causal-LM loss: the logits at position t predict ``labels[:, t + 1]``, labels equal to
    `ignore_index` (padding, prompts) are left out, and the loss is the mean over the tokens left
    (in float32 at least). ``weight(labels)`` is that count, for ``Pipeline(..., loss_weight=)``:
    the step's loss is then the mean over all of the batch's predicted tokens, as HF's on the whole
    batch. A microbatch without a predicted token has loss 0 and weight 0. With `router_aux` the
    output is ``{"logits", "router_logits", "attention_mask"}`` and the router auxiliary loss of the
    microbatch is added (the module docstring states the semantics).

    >>> loss = CausalLMLoss()
    >>> labels = torch.tensor([[1, 2, -100]])
    >>> int(loss.weight(labels))   # predicts 2 from 1; -100 and the last position predict nothing
    1
    """

    def __init__(self, ignore_index: int = -100, router_aux: RouterAuxLoss | None = None) -> None:
        self.ignore_index = int(ignore_index)
        self.router_aux = router_aux

    def _shifted(self, labels: torch.Tensor) -> torch.Tensor:
        if not isinstance(labels, torch.Tensor) or labels.dim() < 1:
            raise TypeError(f"the target must be HF's labels, a [batch, seq] tensor of token ids, got {labels!r:.80}")
        return F.pad(labels, (0, 1), value=self.ignore_index)[..., 1:]

    def __call__(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = output["logits"] if isinstance(output, Mapping) else output
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        target = self._shifted(labels).reshape(-1).to(logits.device)
        if logits.shape[:-1].numel() != target.numel():
            raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, ignore_index=self.ignore_index,
                                reduction="sum")
        loss = total / (target != self.ignore_index).sum().clamp(min=1)
        if self.router_aux is not None:
            if not isinstance(output, Mapping) or "router_logits" not in output:
                raise ValueError("this loss adds the router auxiliary loss: the output must be the last stage's "
                                 "{'logits', 'router_logits', 'attention_mask'}")
            loss = loss + self.router_aux(output["router_logits"], output.get("attention_mask"))
        return loss

    def weight(self, labels: torch.Tensor) -> torch.Tensor:
        """The number of tokens the loss of these labels averages over (a 0-dim tensor)."""
        return (self._shifted(labels) != self.ignore_index).sum()


def causal_lm_stages(
    model_or_config: Any,
    schedule: Schedule,
    pp_rank: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = None,
    experts_implementation: str | None = None,
    module_fqns_per_stage: Sequence[Sequence[str]] | None = None,
    balance: Balance = "params",
    state_dict: Mapping[str, torch.Tensor] | None = None,
    seed: int = 0,
    ignore_index: int = -100,
    fast: bool = False,
    fp8: Any = False,
) -> tuple[dict[int, nn.Module], dict[str, Any]]:
    """This rank's stages of a HF causal LM, and the `Pipeline` keyword arguments that go with them.

    Args:
        model_or_config: a local HF directory (``config.json`` and ``*.safetensors``, sharded or
            not, as ``save_pretrained`` writes it): built from its config, this rank's stages read
            their own tensors only (`zbpp.models.hf_weights`); dtype default: the checkpoint's.
            Under torch.distributed every rank of the default process group calls it (it ends in
            an agreement: a read failing on one rank raises on every rank, naming it and the file).
            Or a ``PretrainedConfig`` of a decoder-only causal LM: the model is built on the
            ``meta`` device and only this rank's stages get weights (random, by the model's own
            init, or `state_dict`); or a ``*ForCausalLM`` model (best on ``meta``). It must fit the
            template of the module docstring (`check_template` says what does not).
        schedule, pp_rank: the schedule and this rank's pipeline rank.
        device: where the stages live (default as `pipeline_stages`).
        dtype: parameter dtype when building from a config (default, or ``"auto"``: the config's,
            else float32), as a ``torch.dtype`` or its name.
        attn_implementation: "eager", "sdpa", ... when building from a config or a directory.
        experts_implementation: a mixture of experts' expert layers, "eager" (a loop over the
            experts: any dtype, float64 included), "grouped_mm" (HF's default: 16- and 32-bit
            floats), ... when building from a config or a directory (HF does not save it in
            ``config.json``).
        module_fqns_per_stage, balance, state_dict, seed: as `pipeline_stages`; the blocks are the
            model's decoder layers. A stage holds a contiguous run of them. The default placement
            gives every stage at least one (so the model needs as many layers as the schedule has
            stages); with `module_fqns_per_stage` the first stage may hold none (the embeddings
            alone) and the last none (the final norm and LM head alone), a middle stage must hold one.
        ignore_index: the label value the loss ignores.
        fast, fp8: ``fast=True`` gives every stage its fastest correct form and adds the runtime's
            keywords for it (`zbpp.models.fast.fast_hf_stages`: delayed weight gradients, compiled
            decoder layers, task graphs on CUDA where measured faster); ``fp8=True`` or a
            `DelayedScaling` adds FP8.

    Returns ``(stages, kwargs)``: ``Pipeline(stages, schedule, **kwargs)`` with ``loss_fn``,
    ``tied_parameters`` and ``loss_weight`` (tokens per microbatch).
    Each stage is the model's own ``*ForCausalLM`` class with the modules it does not hold set to
    None, so its ``state_dict`` keys are HF's.
    """
    if fast is not True and fast is not False:  # checked before the model is built (a falsy 0 would skip it)
        raise TypeError(f"causal_lm_stages: fast={fast!r}; pass True or False")
    if device is not None:
        _device(device, "causal_lm_stages")  # a meta device refused before any weights are read
    args = (schedule, pp_rank, device, dtype, attn_implementation, experts_implementation, module_fqns_per_stage,
            balance, state_dict, seed, ignore_index, fast, fp8)
    if isinstance(model_or_config, (str, os.PathLike)):  # a local HF directory: read this rank's tensors only
        return _read_on_every_rank(model_or_config, lambda: _stages(model_or_config, *args))
    return _stages(model_or_config, *args)


def _stages(model_or_config: Any, schedule: Schedule, pp_rank: int, device: torch.device | str | None,
            dtype: torch.dtype | None, attn_implementation: str | None, experts_implementation: str | None,
            module_fqns_per_stage: Sequence[Sequence[str]] | None, balance: Balance,
            state_dict: Mapping[str, torch.Tensor] | None, seed: int, ignore_index: int, fast: bool, fp8: Any
            ) -> tuple[dict[int, nn.Module], dict[str, Any]]:
    """`causal_lm_stages` once the directory, if any, is known to every rank's agreement."""
    from .hf_weights import _dtype_arg, _keep_in_float32

    dtype = _dtype_arg(dtype)  # a bad one named here, not deep in HF's from_config
    directory = isinstance(model_or_config, (str, os.PathLike))
    if directory:
        model_or_config, state_dict, dtype = _pretrained(model_or_config, state_dict, device, dtype)
    model = _model(model_or_config, dtype, attn_implementation, experts_implementation)
    if directory:  # as from_pretrained builds it: weights its family keeps in float32 stay unrounded
        _keep_in_float32(model, dtype)
    template = check_template(model)
    _warn_unless_supported(model)
    fqns = module_fqns_per_stage
    if fqns is None:
        with _loop_experts(model):
            try:
                fqns = fqns_per_stage(model, schedule.num_stages, blocks=template.blocks, balance=balance)
            except _ForwardFailed as exc:  # module_fqns_per_stage= would not help: the checks run such a forward too
                raise _meta_forward_failed(model, "to place the modules beside the decoder layers", exc.__cause__
                                           ) from exc.__cause__
            except ValueError as exc:  # placement by use: say which model, and this function's way out
                raise ValueError(f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', None)!r}): "
                                 f"{exc}. Pass causal_lm_stages(..., module_fqns_per_stage=) with those modules "
                                 "placed, or build the stages with zbpp.models.pipeline_stages") from exc
    else:  # modules without parameters (rotary embeddings, dropout) go to every stage, as fqns_per_stage does:
        # every stage runs HF's whole forward, so one listed on some stages only is still called on the others
        free = _parameter_free(model, template.blocks)
        fqns = [list(names) + [f for f in free if f not in names] for names in fqns]
    _check_layer_order(fqns, template)
    tuple_out = _check_layers(model, template, fqns)
    try:
        stages, tied = pipeline_stages(model, schedule, pp_rank, module_fqns_per_stage=fqns, device=device,
                                       state_dict=state_dict, seed=seed)
    except _Uninitialised as exc:  # worded for this function's arguments: it takes no init=
        if exc.transient:  # Falcon-H1's mup_vector: computed in a constructor, saved nowhere
            raise ValueError(f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', None)!r}): "
                             f"non-persistent buffers {exc.names} of modules {exc.classes} hold no values: HF's "
                             "model computes them in its constructors, which zbpp skips (it builds the model on the "
                             "meta device), and no state_dict or checkpoint holds them; build its stages with "
                             "zbpp.models.pipeline_stages and init= (README, 'Bring your model')") from exc
        raise ValueError(f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', None)!r}): "
                         f"HF's _init_weights leaves modules {exc.classes} without values (HF's own model gets them "
                         "from their constructors, which zbpp skips: it builds the model on the meta device); pass "
                         "state_dict= (the weights of HF's model, e.g. AutoModelForCausalLM.from_config(config)"
                         ".state_dict()) or a directory saved by save_pretrained") from exc
    last = schedule.num_stages - 1
    modules = {s: _as_stage(m, model, template, first=s == 0, last=s == last, tuple_out=tuple_out)
               for s, m in stages.items()}
    loss = CausalLMLoss(ignore_index, template.router_aux)
    kwargs: dict[str, Any] = {"loss_fn": loss, "tied_parameters": tied, "loss_weight": loss.weight}
    if fast or fp8 is not False:
        from .fast import fast_hf_stages

        kwargs.update(fast_hf_stages(modules, fast=fast, fp8=fp8, loss_fn=loss))
    return modules, kwargs


def _warn_unless_supported(model: nn.Module) -> None:
    """One warning naming a model type outside `SUPPORTED`: it fits the template, but no test has run
    it against HF (a family can fit and still compute differently, as BERT's bidirectional layers did)."""
    kind = getattr(model.config, "model_type", None)
    if kind not in SUPPORTED:
        warnings.warn(f"zbpp.models.hf: model_type {kind!r} ({type(model).__name__}) is not among the families zbpp "
                      "tests against HF (zbpp.models.hf.SUPPORTED): it fits the template, but compare a step with "
                      "HF's own model before relying on it", stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The ``stacklevel`` for a warning from the caller of this function that points at the first
    frame outside the zbpp package (the user's call), however many zbpp frames lie between (a directory
    is built through the agreement of `_read_on_every_rank`, a config directly)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1  # level 1: the function that warns (one frame up from here)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _read_on_every_rank(path: Any, build: Callable[[], Any]) -> Any:
    """`build()`, which reads this rank's tensors of the directory `path`, followed by an agreement of
    every rank of the default process group (each builds its stages from the directory): a rank whose
    read failed (an I/O error on its shards only) raises its own error and every other rank a
    `PipelineError` naming it, at once, rather than waiting for it in the `Pipeline` until the
    process group's timeout. Without torch.distributed, `build()` alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return build()
    from ..runtime.agreement import Agreement, agree_on_problems
    from ..runtime.channels import cached_group, default_timeout

    world = list(range(dist.get_world_size()))
    # a group of its own: the Pipeline's agreement group may be made with another timeout (cached by ranks)
    agreement = Agreement(cached_group("read", world, "gloo", default_timeout()))
    problem: BaseException | None = None
    built = None
    try:
        built = build()
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
        problem = exc
    agree_on_problems(agreement, problem, world, f"causal_lm_stages could not read {os.fspath(path)!r} on every rank")
    return built


def _check_layer_order(fqns: Sequence[Sequence[str]], template: Template) -> None:
    """Stage s's decoder layers all come after stage s-1's: a stage runs its layers where the model's
    forward reaches them, so layers listed out of order would run reordered, silently."""
    prefix = template.blocks + "."
    before: tuple[int, int] | None = None  # (stage, its last layer)
    for s, names in enumerate(fqns):
        layers = sorted({int(f[len(prefix):].split(".")[0]) for f in names if f.startswith(prefix)})
        if not layers:
            continue
        if before is not None and layers[0] <= before[1]:
            raise ValueError(f"module_fqns_per_stage[{s}] holds {prefix}{layers[0]}, which the model runs before "
                             f"{prefix}{before[1]} of stage {before[0]}: stages hold the decoder layers in model order")
        before = (s, layers[-1])


def _pretrained(path: Any, state_dict: Any, device: Any, dtype: torch.dtype | None) -> tuple[Any, Any, torch.dtype]:
    from .hf_weights import pretrained
    from .stages import _device

    if state_dict is not None:
        raise ValueError("give the weights as a directory or as state_dict=, not both")
    return pretrained(path, device=_device(device), dtype=dtype)


def _model(model_or_config: Any, dtype: torch.dtype | None, attn_implementation: str | None,
           experts_implementation: str | None = None) -> nn.Module:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the [hf] extra
        raise ImportError("zbpp.models.hf needs Hugging Face transformers: pip install 'zbpp[hf]'") from exc
    if isinstance(model_or_config, transformers.PretrainedConfig):
        kw: dict[str, Any] = {}
        if attn_implementation is not None:
            kw["attn_implementation"] = attn_implementation
        if experts_implementation is not None:
            kw["experts_implementation"] = experts_implementation
        if dtype is not None:
            kw["dtype"] = dtype
        kind = getattr(model_or_config, "model_type", None)
        try:
            with torch.device("meta"):
                return transformers.AutoModelForCausalLM.from_config(model_or_config, **kw)
        except Exception as exc:
            if isinstance(exc, ValueError) and "Unrecognized configuration class" in str(exc):
                raise ValueError(f"model_type {kind!r} has no *ForCausalLM in transformers: zbpp.models.hf builds "
                                 "decoder-only causal LMs") from None
            # raised deep inside the family's own code (a KeyError, an attribute its sub-config lacks): say which
            raise ValueError(f"transformers could not build the *ForCausalLM of model_type {kind!r} from this config "
                             f"({type(exc).__name__}: {exc}); a config that HF's own from_config builds is needed "
                             "(small_config sets shared sizes only: pass the family's own settings as overrides)"
                             ) from exc
    if isinstance(model_or_config, nn.Module) and hasattr(model_or_config, "config"):
        if dtype is not None or attn_implementation is not None or experts_implementation is not None:
            raise ValueError("dtype, attn_implementation and experts_implementation apply when building from a config "
                             "or a directory; a model you built keeps its own")
        return model_or_config
    raise TypeError(f"expected a transformers PretrainedConfig or *ForCausalLM model, got {type(model_or_config).__name__}")


# -- the template ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Template:
    """Where a causal LM keeps what the stages need: its base model's FQN, its decoder layers'
    FQN and count, and its router auxiliary loss (None when the config does not ask for it)."""

    base: str
    blocks: str
    num_layers: int
    router_aux: RouterAuxLoss | None


def check_template(model: nn.Module) -> Template:
    """How `model` (a ``*ForCausalLM``) fits the template of this module, or a ``ValueError``
    naming what does not fit.

    >>> import transformers
    >>> cfg = transformers.GPT2Config(n_embd=8, n_layer=2, n_head=2, vocab_size=16)
    >>> with torch.device("meta"):
    ...     check_template(transformers.GPT2LMHeadModel(cfg)).blocks
    'transformer.h'
    """
    name = f"{type(model).__name__} (model_type {getattr(getattr(model, 'config', None), 'model_type', None)!r})"
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} does not fit zbpp.models.hf's template: it is not a decoder-only causal LM")
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module) or base is model:
        # a prefix kept for another checkpoint layout (Llama 4's "language_model", the name inside
        # its multimodal model) while the class holds its base model as HF's causal LMs do
        held = getattr(model, "model", None)
        if isinstance(held, nn.Module) and held is not model and hasattr(held, "config"):
            prefix, base = "model", held
    if not isinstance(base, nn.Module) or base is model:
        raise ValueError(f"{name} does not fit zbpp.models.hf's template: no base model under base_model_prefix "
                         f"{prefix!r} (the template is *ForCausalLM = base model + LM head)")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Module):
        raise ValueError(f"{name} does not fit zbpp.models.hf's template: it has no LM head (get_output_embeddings())")
    params = inspect.signature(type(model).forward).parameters
    if "inputs_embeds" not in params or "inputs_embeds" not in inspect.signature(type(base).forward).parameters:
        raise ValueError(f"{name} does not fit zbpp.models.hf's template: its forward takes no inputs_embeds, which "
                         "a later stage passes in place of the tokens")
    if getattr(config, "attention_type", None) == "block_sparse":  # BigBird's: its forward swaps attention modules
        raise ValueError(f"{name} does not fit zbpp.models.hf's template: its block-sparse attention "
                         "(config.attention_type='block_sparse') attends both ways, and its forward replaces the "
                         "layers' attention modules by the sequence length (full attention below "
                         "(5 + 2 num_random_blocks) block_size tokens), which stages built once cannot follow; "
                         "build it with config.attention_type='original_full' (and is_decoder=True for causal "
                         "attention)")
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} does not fit zbpp.models.hf's template: config.num_hidden_layers is {n!r}")
    lists = [f for f, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n and f]
    outer = [f for f in lists if not any(f.startswith(g + ".") for g in lists)]
    if len(outer) != 1:
        raise ValueError(f"{name} does not fit zbpp.models.hf's template: its base model must hold its "
                         f"{n} decoder layers in one ModuleList, found {outer or 'none'}")
    if getattr(config, "is_decoder", None) is False and _layers_read_is_decoder(base.get_submodule(outer[0])):
        # BERT-style: HF builds the *ForCausalLM with bidirectional attention and only warns
        raise ValueError(f"{name} attends both ways unless config.is_decoder=True (its layers are causal only then; "
                         "HF only warns): a causal-LM step would see the tokens it predicts; set "
                         "config.is_decoder=True")
    return Template(prefix, f"{prefix}.{outer[0]}", n, _router_aux(model, name, params))


def _layers_read_is_decoder(layers: nn.Module) -> bool:
    """Whether the decoder layers pick their attention by ``config.is_decoder``: the BERT family's layers
    (and their self-attention) keep it as an attribute ``is_decoder``, causal only when True. Read from
    the built modules, not the source (absent from installs of compiled files only); a family that has
    the flag on its config but whose layers are always causal (GPT-NeoX's) keeps no such attribute."""
    return any(isinstance(vars(m).get("is_decoder"), bool) for m in layers.modules())


def _router_aux(model: nn.Module, name: str, params: Mapping[str, Any]) -> RouterAuxLoss | None:
    if "output_router_logits" not in params or not getattr(model.config, "output_router_logits", False):
        return None
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    missing = [a for a in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef") if not hasattr(model, a)]
    if fn is None or missing:
        raise ValueError(f"{name} asks for the router auxiliary loss (output_router_logits=True) but does not fit "
                         f"HF's MoE template: {'no load_balancing_loss_func in its module; ' if fn is None else ''}"
                         f"{'missing attributes ' + str(missing) if missing else ''}")
    return RouterAuxLoss(fn, int(model.num_experts), int(model.num_experts_per_tok), float(model.router_aux_loss_coef))


def _parameter_free(model: nn.Module, blocks: str) -> list[str]:
    from .stages import _outside

    return _outside(model, blocks)[2]


# -- a stage ---------------------------------------------------------------------------------------
@dataclass
class _Call:
    """The state of one stage call that the stand-ins read and write."""

    inject: torch.Tensor | None  # the received hidden states (None on the first stage)
    placeholder: torch.Tensor | None  # zeros in place of the embeddings a later stage does not compute
    before_layers: bool = True  # the forward has not reached the stage's first layer yet
    produced: torch.Tensor | None = None  # the input of the layer after the stage's last one


@dataclass
class _StageSpec:
    """Which part of the model a pruned stage holds, and what its forward needs to run it."""

    template: Template
    first: bool
    last: bool
    hf_forward: Callable[..., Any]
    lo: int  # the stage computes the layers lo..hi-1 (none when lo == hi)
    hi: int
    tuple_out: _LayerOutput  # what the model's decoder layers return: the tensor, or (hidden, ...) of a length
    # the last layer before lo that the forward calls (its stand-in returns the received hidden states; None:
    # the first one called at lo or after takes them), and the last of the stage's own that it calls (its
    # output is the stage's; None: the stage passes on what it received). They differ from lo - 1 and hi - 1
    # where the forward skips layers (Mllama's cross-attention layers, on tokens alone)
    feed: int | None
    take: int | None
    routes: bool  # some held layer records router logits that the router auxiliary loss takes
    absent: list[tuple[str, str]] = field(default_factory=list)  # (parent FQN, child name) not held
    skips: list[nn.Module] = field(default_factory=list)  # a stand-in per layer position
    standins: list[nn.Module] = field(default_factory=list)  # an `_Absent` per entry of `absent`


class _Skip(nn.Module):
    """The decoder layer at position `index` where this stage does not hold it: it passes its
    input on, in the layers' output form; the one just before the stage's layers returns the
    received hidden states instead. It carries the layer's `_KIND_ATTRIBUTES`, which the model's
    forward may read to pick each layer's mask; reading any other attribute raises."""

    def __init__(self, stage: nn.Module, index: int, layer: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_stage", stage)  # not a submodule
        self._index = index
        for name in _KIND_ATTRIBUTES:
            value = getattr(layer, name, None)
            if isinstance(value, str):
                object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        stage, index = self.__dict__.get("_stage"), self.__dict__.get("_index")
        spec = stage.__dict__.get("_zbpp_stage_spec") if stage is not None else None
        if spec is None:  # asked while being built (hasattr probes): a plain AttributeError
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        model = type(stage).__name__.removesuffix("Stage")
        # a model that reads more of its layers than their kind (Inkling 2's block boundaries, which pick the
        # states it carries beside the hidden states) does not fit: say so instead of a bare AttributeError
        raise AttributeError(
            f"{model}'s forward reads .{name} of {spec.template.blocks}.{index}, a decoder layer this stage does "
            f"not hold (a stand-in knows only {list(_KIND_ATTRIBUTES)}): the model's layer loop depends on more "
            "than each layer's kind, which does not fit zbpp.models.hf's template (a stage receives only the hidden "
            "states); use zbpp.models.pipeline_stages with your own stage forward")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        stage = self._stage
        spec, call = stage._zbpp_stage_spec, stage._zbpp_call
        hidden = args[0] if args else kwargs["hidden_states"]
        if self._index == spec.feed and call.inject is not None:
            hidden, call.before_layers = call.inject, False
        # as long as a layer's tuple, for a loop that unpacks it (RWKV's hidden, state, attentions): the
        # rest None, as a layer returns them in training (a tensor passed on to the next layer is refused)
        n, kind = spec.tuple_out.length, spec.tuple_out.kind
        return kind([hidden, *[None] * (n - 1)]) if n else hidden


#: a decoder layer's attributes that say which mask and position embeddings the model's forward gives it
#: (Nemotron-H's ``block_type``): a stand-in carries them, nothing else of the layer
_KIND_ATTRIBUTES = ("attention_type", "block_type", "layer_type")


class _Absent(nn.Module):
    """The module `fqn` of the model, which this stage does not hold: before the stage's layers (a
    later stage's embedding side) it returns the placeholder embeddings, after them (a norm on a stage
    whose output is its last layer's) its input. Called after the layers on the last stage, whose
    output it would change, it raises: that stage must hold it."""

    def __init__(self, stage: nn.Module, fqn: str) -> None:
        super().__init__()
        object.__setattr__(self, "_stage", stage)
        self.fqn = fqn

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        stage = self.__dict__["_stage"]
        model = type(stage).__name__.removesuffix("Stage")
        held_not = [f"{p}.{n}" if p else n for p, n in stage._zbpp_stage_spec.absent]
        # a model whose forward reads a weight outside the decoder layers on every stage (Gemma 3n's
        # and Gemma 4's per-layer embeddings) does not fit: say so instead of HF's bare AttributeError
        raise AttributeError(
            f"{model}'s forward reads .{name} of a module this stage does not hold (one of {held_not}): the "
            "model feeds its decoder layers from outside them, which does not fit zbpp.models.hf's template (a "
            "stage receives only the hidden states); use zbpp.models.pipeline_stages with your own stage forward")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        call = self._stage._zbpp_call
        if call.before_layers:
            if call.placeholder is None:
                raise RuntimeError(f"the model's forward called {self.fqn}, which its first stage does not hold, "
                                   "before the decoder layers")
            return call.placeholder
        if self._stage._zbpp_stage_spec.last:  # its output is the logits': skipping it would be silently wrong
            raise ValueError(f"the last stage does not hold {self.fqn}, which the model's forward calls after the "
                             "decoder layers: list it in the last stage's module_fqns_per_stage")
        return args[0] if args else next(iter(kwargs.values()))


def _hidden(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class _CausalLMStage:
    """Mixed into the model's own class (``LlamaForCausalLM`` -> ``LlamaForCausalLMStage``): the
    stage's forward drives the class's forward (module docstring)."""

    _zbpp_stage_spec: _StageSpec
    _zbpp_call: _Call | None

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None,
                router_logits: torch.Tensor | None = None) -> Any:
        spec = self._zbpp_stage_spec
        if spec.first and input_ids is None:
            raise ValueError("the first stage takes input_ids: pipe.step(ids) or pipe.step({'input_ids': ids, ...})")
        if not spec.first and hidden_states is None:
            raise ValueError("a later stage takes the previous stage's hidden_states")
        kw: dict[str, Any] = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": False}
        # a stage whose layers route nothing does not ask: a last stage's HF forward would compute
        # its auxiliary loss over no router logits at all (an IndexError in HF)
        routes = spec.routes
        if spec.template.router_aux is not None:
            kw["output_router_logits"] = routes
        if spec.first:
            kw["input_ids"] = input_ids
        else:
            kw["inputs_embeds"] = torch.zeros_like(hidden_states)
        call = _Call(None if spec.first else hidden_states, kw.get("inputs_embeds"))
        with self._zbpp_standins(call), _masks_from_presence(position_ids is not None):
            if spec.last:
                out = spec.hf_forward(self, **kw)
            else:
                out = self.get_submodule(spec.template.base)(**kw)  # type: ignore[attr-defined]
        if routes:
            router_logits = _append(router_logits, out.router_logits)
        if spec.last:
            if spec.template.router_aux is None:
                return out.logits
            # token-major: eval_step concatenates the microbatches' outputs along dim 0 (layer-major, it
            # stacked the layers of each microbatch and failed on microbatches of unequal rows)
            token_major = router_logits.transpose(0, 1) if router_logits is not None else None
            return {"logits": out.logits, "router_logits": token_major, "attention_mask": attention_mask}
        result = {"hidden_states": call.produced, "attention_mask": attention_mask, "position_ids": position_ids}
        if spec.template.router_aux is not None:
            result["router_logits"] = router_logits
        return result

    @contextlib.contextmanager
    def _zbpp_standins(self, call: _Call) -> Iterator[None]:
        """During the call: the layer list at its full length (stand-ins where not held), the
        modules not held as stand-ins, and hooks that put the received hidden states in and take
        the stage's result out. The hooks are host-side bookkeeping, `never_compiled`: a compiled
        decoder layer (the fast form) calls them eagerly, and dynamo would trace a frame of each."""
        spec = self._zbpp_stage_spec
        object.__setattr__(self, "_zbpp_call", call)
        container: nn.Module = self.get_submodule(spec.template.blocks)  # type: ignore[attr-defined]
        held = container._modules
        full = OrderedDict((str(i), held.get(str(i), spec.skips[i])) for i in range(spec.template.num_layers))
        hooks = []
        if spec.feed is None and (call.inject is not None or spec.take is None):
            def enter(module: nn.Module, args: tuple, kwargs: dict) -> Any:
                call.before_layers = False
                if call.inject is not None and args:
                    args = (call.inject, *args[1:])
                elif call.inject is not None:
                    kwargs = {**kwargs, "hidden_states": call.inject}
                if spec.take is None:
                    call.produced = args[0] if args else kwargs["hidden_states"]
                return args, kwargs

            first = min(i for i in range(spec.template.num_layers) if i not in spec.tuple_out.skipped)
            hooks.append(full[str(first)].register_forward_pre_hook(never_compiled(enter), with_kwargs=True))
        elif spec.feed is None:
            call.before_layers = False
        elif spec.take is None:  # the stage's layers are all skipped: it passes on what it received
            call.produced = call.inject
        if spec.take is not None and not spec.last:
            def leave(module: nn.Module, args: tuple, output: Any) -> None:
                call.produced = _hidden(output)

            hooks.append(full[str(spec.take)].register_forward_hook(never_compiled(leave)))
        parents = [(self.get_submodule(p) if p else self, n) for p, n in spec.absent]  # type: ignore[attr-defined]
        container._modules = full  # type: ignore[assignment]
        for (parent, n), standin in zip(parents, spec.standins):
            parent._modules[n] = standin
        try:
            yield
        finally:
            container._modules = held
            for parent, n in parents:
                parent._modules[n] = None
            for h in hooks:
                h.remove()
            object.__setattr__(self, "_zbpp_call", None)


def _tracing_or_a_tensor(tensor: Any = None) -> bool:
    """HF's ``is_tracing`` for its mask decisions in a stage: a tensor counts as traced (its values
    are not read on the host), no tensor only under dynamo or jit (not under CUDA stream capture)."""
    return tensor is not None or torch.compiler.is_compiling() or torch.jit.is_tracing()


@contextlib.contextmanager
def _masks_from_presence(positions_given: bool) -> Iterator[None]:
    """During a stage's call, HF's masks are decided from which inputs are given (module docstring).
    Without the user's ``position_ids`` the forward numbers the tokens itself, so nothing is packed."""
    masking = sys.modules.get("transformers.masking_utils")
    names = ("is_tracing", "find_packed_sequence_indices")
    if masking is None or not all(hasattr(masking, n) for n in names):
        yield
        return
    hf = {n: getattr(masking, n) for n in names}
    masking.is_tracing = _tracing_or_a_tensor
    if not positions_given:
        masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        for n, fn in hf.items():
            setattr(masking, n, fn)


def _append(carried: torch.Tensor | None, produced: Sequence[torch.Tensor] | None) -> torch.Tensor | None:
    """The router logits so far, ``[layers, tokens, experts]``, with this stage's layers' appended."""
    parts = [] if carried is None else [carried]
    if produced:
        parts.append(torch.stack(list(produced)))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _Unfit(ValueError):
    """A check's refusal raised in a hook of `_probe_forward` (passed on as it is)."""


_PROBE_TOKENS = (1, 2)  # [batch, seq] of the meta-device probe forward


class _LayerOutput(NamedTuple):
    """What the model's decoder layers return: the hidden states (`length` 0), or a tuple or a list
    (OpenAI GPT's) of `length` starting with them, which the model's layer loop indexes; and the
    layers that its forward on tokens alone never calls (`skipped`)."""

    length: int
    kind: type = tuple
    skipped: tuple[int, ...] = ()


def _check_layers(model: nn.Module, template: Template, fqns: Sequence[Sequence[str]]) -> _LayerOutput:
    """The checks of `_standin_hooks` and `_output_hooks` in one forward on the ``meta`` device (each
    costs a forward of the whole model on the host otherwise); what the decoder layers return."""
    handles = _standin_hooks(model, template, fqns)
    more, finish = _output_hooks(model, template, fqns)
    _probe_forward(model, handles + more, grad=bool(handles))  # autograd records it for the stand-ins' marks
    return finish()


def _layers_return_tuple(model: nn.Module, template: Template,
                         fqns: Sequence[Sequence[str]] | None = None) -> _LayerOutput:
    """What the model's decoder layers return, by `_output_hooks`' checks in their own forward."""
    handles, finish = _output_hooks(model, template, fqns)
    _probe_forward(model, handles, grad=False)
    return finish()


def _output_hooks(model: nn.Module, template: Template, fqns: Sequence[Sequence[str]] | None
                  ) -> tuple[list[Any], Callable[[], _LayerOutput]]:
    """Hooks for a forward on the ``meta`` device (refusing a layer it calls twice), and what to call
    after it: what the model's decoder layers return (a tensor, or a tuple or list of some length). In
    that forward no layer may take anything an earlier one returned beside the hidden
    states (GLM-5's and Hunyuan-V4's top-k indices) where a stage of `fqns` (any, if None) holds one
    and not the other: a stage receives only the hidden states, so a later stage's layers would get a
    stand-in's output instead. With several stages the hidden states must be one vector per token, as
    the embeddings are (a later stage passes zeros of the received ones' shape as ``inputs_embeds``).
    Every layer is looked at: a model's later layers may differ from its first ones (a kind of layer
    every k-th)."""
    layers = list(model.get_submodule(template.blocks)._modules.values())
    prefix = template.blocks + "."
    stage_of = {int(f[len(prefix):].split(".")[0]): s for s, names in enumerate(fqns or ()) for f in names
                if f.startswith(prefix)}
    seen: list[Any] = []  # layer i's output, kept alive: `extra` is keyed by its tensors' ids
    ran: set[int] = set()  # the layers the forward called (Mllama's skips its cross-attention layers)
    extra: dict[int, int] = {}  # id of a tensor a layer returned beside the hidden states -> that layer
    wide: list[tuple[int, ...]] = []  # shapes of hidden states that are not one vector per token

    def out(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if index in ran:  # the forward runs on after the last layer to see this
                raise _Unfit(f"{type(model).__name__} does not fit zbpp.models.hf's template: its forward calls "
                             f"{template.blocks}.{index} more than once (layers run in a loop, as Dory's recurrent "
                             "layers), where a stage runs each of its layers once, in order; use "
                             "zbpp.models.pipeline_stages with your own stage forward")
            seen.append(output)
            ran.add(index)
            for o in output[1:] if isinstance(output, (tuple, list)) else ():
                if isinstance(o, torch.Tensor):
                    extra.setdefault(id(o), index)
        return hook

    def taken_in(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            given = [(f"argument {i}", a) for i, a in enumerate(args[1:], 1)]
            given += [(repr(k), a) for k, a in kwargs.items() if k != "hidden_states"]
            hidden = args[0] if args else kwargs.get("hidden_states")
            if isinstance(hidden, torch.Tensor) and hidden.shape[:-1] != _PROBE_TOKENS:
                wide.append(tuple(hidden.shape))
            taken = [(what, extra[id(a)]) for what, a in given if id(a) in extra
                     and (fqns is None or stage_of.get(extra[id(a)]) != stage_of.get(index))]
            if taken:
                what, source = taken[0]
                raise _Unfit(f"{type(model).__name__} does not fit zbpp.models.hf's template: its forward passes "
                             f"{template.blocks}.{index} {what} from what {template.blocks}.{source} returned beside "
                             "the hidden states (state carried from layer to layer), which a later stage does not "
                             "receive; use zbpp.models.pipeline_stages with your own stage forward")
        return hook

    def finish() -> _LayerOutput:
        if not seen:
            raise ValueError(f"{type(model).__name__} does not fit zbpp.models.hf's template: its forward never "
                             f"called {template.blocks}.0")
        skipped = tuple(i for i in range(len(layers)) if i not in ran)
        if wide and (fqns is None or len(fqns) > 1):  # a later stage passes zeros of the received shape as inputs_embeds
            raise ValueError(f"{type(model).__name__} does not fit zbpp.models.hf's template: its decoder layers take "
                             f"hidden states of shape {wide[0]} for {_PROBE_TOKENS} tokens, not one vector per token as "
                             "its embeddings give (a residual stream of several streams, DeepSeek-V4's "
                             "hyper-connections), which a later stage cannot pass its forward as inputs_embeds; use "
                             "zbpp.models.pipeline_stages with your own stage forward")
        if not isinstance(seen[0], (tuple, list)):
            return _LayerOutput(0, skipped=skipped)
        return _LayerOutput(len(seen[0]), list if isinstance(seen[0], list) else tuple, skipped)

    handles = [layer.register_forward_hook(out(i)) for i, layer in enumerate(layers)]
    handles += [layer.register_forward_pre_hook(taken_in(i), with_kwargs=True) for i, layer in enumerate(layers)]
    return handles, finish


def _standin_hooks(model: nn.Module, template: Template, fqns: Sequence[Sequence[str]]) -> list[Any]:
    """Hooks for a forward on the ``meta`` device that autograd records (none where there is nothing
    to check), refusing a model whose forward feeds a decoder layer, other than through its hidden
    states, from a module called before the layers that a stage holding layers does not hold: there
    that module is a stand-in returning zeros (`_Absent`), and only the hidden states are replaced by the
    received ones, so the layer would silently compute with zeros (a projection of the embeddings
    passed to every layer, say): each such module's output gets a zero-valued leaf added, and the
    other inputs of every layer are searched in the autograd graph for it (every rank decides alike)."""
    prefix = template.blocks + "."
    with_layers = [set(names) for names in fqns if any(n.startswith(prefix) for n in names)]
    watched = sorted({f for names in fqns for f in names if f != template.blocks and not f.startswith(prefix)
                      and any(f not in held for held in with_layers)})
    if not watched:  # every stage with layers holds every module beside them (one stage, say)
        return []
    layers = list(model.get_submodule(template.blocks)._modules.values())
    marks: dict[int, str] = {}  # id of a leaf added to a watched module's output -> that module
    keep: list[torch.Tensor] = []  # the leaves, alive while their ids are looked up
    state = {"before": True}  # no layer called yet: a watched module's output is a stand-in's on a later stage

    def mark(fqn: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if not state["before"]:
                return None

            def marked(t: Any) -> Any:
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    return t
                leaf = torch.zeros((), dtype=t.dtype, device=t.device, requires_grad=True)
                marks[id(leaf)] = fqn
                keep.append(leaf)
                return t + leaf
            return tuple(marked(o) for o in output) if isinstance(output, tuple) else marked(output)
        return hook

    def reached(t: Any) -> str | None:
        """The watched module whose output `t` is computed from, or None."""
        todo, seen = [getattr(t, "grad_fn", None)], set()
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            leaf = getattr(fn, "variable", None)
            if leaf is not None and id(leaf) in marks:
                return marks[id(leaf)]
            todo.extend(f for f, _ in fn.next_functions)
        return None

    def check(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            state["before"] = False
            # the hidden states (first, or by name) are what the stage replaces with the received ones
            given = [(f"argument {i}", a) for i, a in enumerate(args[1:], 1)]
            given += [(repr(k), a) for k, a in kwargs.items() if k != "hidden_states"]
            for what, a in given:
                for t in (a if isinstance(a, (tuple, list)) else (a,)):
                    fqn = reached(t) if isinstance(t, torch.Tensor) else None
                    if fqn is not None:
                        stages = [s for s, names in enumerate(fqns) if fqn not in names
                                  and any(n.startswith(prefix) for n in names)]
                        raise _Unfit(
                            f"{type(model).__name__} does not fit zbpp.models.hf's template: its forward passes "
                            f"{template.blocks}.{index} {what} computed from {fqn}, which stage(s) {stages} do not "
                            "hold (a later stage receives only the hidden states, so its layers would compute with "
                            f"zeros in place of {fqn}'s output); use zbpp.models.pipeline_stages with your own stage "
                            "forward")
        return hook

    modules = dict(model.named_modules())  # a name that is no module is left to pipeline_stages to refuse
    handles = [modules[f].register_forward_hook(mark(f)) for f in watched if f in modules]
    handles += [layer.register_forward_pre_hook(check(i), with_kwargs=True) for i, layer in enumerate(layers)]
    return handles


def _probe_forward(model: nn.Module, handles: Sequence[Any], *, grad: bool) -> None:
    """One forward of `model` on two tokens (`_PROBE_TOKENS`), its values on the meta device (the checks
    run in `handles`' hooks, removed after); autograd records it if `grad`."""
    from .stages import _meta_values, _state_kept

    ids = torch.zeros(_PROBE_TOKENS, dtype=torch.long, device=next(iter(model.parameters())).device)
    try:
        with torch.set_grad_enabled(grad), _meta_values(), _loop_experts(model), _state_kept(model):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except _Unfit:  # a check's own refusal, already worded
        raise
    except Exception as exc:  # HF's own code failing on the meta device, deep in the model: say which and why
        raise _meta_forward_failed(model, "to check how the model's forward feeds its decoder layers", exc) from exc
    finally:
        for h in handles:
            h.remove()


def _meta_forward_failed(model: nn.Module, what: str, exc: BaseException | None) -> ValueError:
    """The refusal of a model whose forward fails on the meta device, which placing the stages and checking
    them both need: HF's error shortened to its first line (some run to a paragraph and a URL)."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    cause = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    cause = cause if len(cause) <= 160 else cause[:160] + " [...]"
    return ValueError(
        f"{type(model).__name__} (model_type {kind!r}): zbpp.models.hf needs a forward of a few tokens on the meta "
        f"device (no values) {what}, which failed: {type(exc).__name__}: {cause}. A forward whose "
        "shapes depend on values (routing that counts tokens per expert on the host, as JetMoE's) does not fit "
        "zbpp.models.hf's template, with or without module_fqns_per_stage=; build its stages with "
        "zbpp.models.pipeline_stages and a stage forward of your own (README, 'Bring your model')")


@contextlib.contextmanager
def _loop_experts(model: nn.Module) -> Iterator[None]:
    """HF's mixture-of-experts layers as a loop over experts for a forward on the ``meta`` device
    (the grouped matmul's meta kernel takes only 16-bit floats)."""
    config = model.config
    was = getattr(config, "_experts_implementation", None)
    if was in (None, "eager"):
        yield
        return
    config._experts_implementation = "eager"
    try:
        yield
    finally:
        config._experts_implementation = was


_STAGE_CLASSES: dict[type, type] = {}


def _records_router_logits(model: nn.Module, layer: nn.Module) -> bool:
    """Whether HF records router logits inside `layer`: a submodule matches one of the model's
    ``_can_record_outputs["router_logits"]`` recorders (by class, or by the name suffix a string
    gives, as HF matches them). True where the model does not say: asking is then HF's way."""
    recorders = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if recorders is None:
        return True
    classes: list[type] = []
    suffixes: list[str] = []
    for rec in recorders if isinstance(recorders, (list, tuple)) else [recorders]:
        target = rec if isinstance(rec, (type, str)) else getattr(rec, "target_class", None)
        suffix = rec if isinstance(rec, str) else getattr(rec, "class_name", None)
        if isinstance(target, type):
            classes.append(target)
        elif suffix is None:  # a recorder of a form not known here: keep HF's way
            return True
        if isinstance(suffix, str):
            suffixes.append(suffix)
    return any(isinstance(m, tuple(classes)) or any(name.endswith(s) for s in suffixes)
               for name, m in layer.named_modules())


def _as_stage(pruned: nn.Module, model: nn.Module, template: Template, *, first: bool, last: bool,
              tuple_out: _LayerOutput | None = None) -> nn.Module:
    """`pruned` (the model with what the stage does not hold set to None) as a stage: its class
    becomes a subclass of the model's own with `_CausalLMStage`'s forward."""
    cls = type(pruned)
    parent_fqn, _, leaf = template.blocks.rpartition(".")
    parent = pruned.get_submodule(parent_fqn)
    if parent._modules.get(leaf) is None:  # no layer held: an empty list, filled with stand-ins in a call
        parent._modules[leaf] = type(model.get_submodule(template.blocks))()
    held = sorted(int(n) for n in parent._modules[leaf]._modules)
    routes = template.router_aux is not None and any(
        _records_router_logits(model, layer) for layer in parent._modules[leaf]._modules.values())
    n = template.num_layers
    if held:
        lo, hi = held[0], held[-1] + 1
        if held != list(range(lo, hi)):
            raise ValueError(f"a stage holds the decoder layers {held} of {template.blocks}: they must be contiguous")
    elif first or last:  # only the embeddings, or only the final norm and LM head
        lo = hi = 0 if first else n
    else:
        raise ValueError(f"a middle stage holds no decoder layer of {template.blocks}")
    absent = []
    for fqn, original in model.named_modules():
        parent, _, child = fqn.rpartition(".")
        if not fqn or fqn.startswith(template.blocks + "."):
            continue
        try:
            holder = pruned.get_submodule(parent) if parent else pruned
        except AttributeError:
            continue
        if not isinstance(holder, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) and \
                child in holder._modules and holder._modules[child] is None:
            absent.append((parent, child))
    if cls not in _STAGE_CLASSES:
        _STAGE_CLASSES[cls] = type(f"{cls.__name__}Stage", (_CausalLMStage, cls), {"__module__": __name__})
    pruned.__class__ = _STAGE_CLASSES[cls]
    if tuple_out is None:
        tuple_out = _layers_return_tuple(model, template)
    called = [i for i in range(n) if i not in tuple_out.skipped]
    feed = max((i for i in called if i < lo), default=None)
    take = max((i for i in called if lo <= i < hi), default=None)
    spec = _StageSpec(template, first, last, cls.forward, lo, hi, tuple_out, feed, take, routes, absent)
    layers = model.get_submodule(template.blocks)
    spec.skips = [_Skip(pruned, i, layers[i]) for i in range(n)]
    spec.standins = [_Absent(pruned, f"{p}.{c}" if p else c) for p, c in absent]
    object.__setattr__(pruned, "_zbpp_stage_spec", spec)
    object.__setattr__(pruned, "_zbpp_call", None)
    return pruned


def small_config(model_type: str, *, vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4,
                 num_heads: int = 4, num_kv_heads: int | None = None, max_positions: int = 512,
                 **overrides: Any) -> Any:
    """A small config of any ``model_type`` for trials (random weights, nothing downloaded): the
    sizes given, heads of ``hidden_size // num_heads``, an MLP 4x wide, mixture-of-experts with 4
    experts (2 per token) of width `hidden_size`, token ids 0 for pad/bos/eos; the family's other
    settings at HF's defaults; a multimodal config's text, vision and audio sub-configs get these sizes
    (the causal LM is its text model). `overrides` are set last (a config attribute each, on the text
    sub-config where only it has the attribute).

    >>> cfg = small_config("gemma2", hidden_size=32, num_layers=2)
    >>> cfg.model_type, cfg.head_dim, cfg.num_hidden_layers
    ('gemma2', 8, 2)
    """
    import transformers

    head = hidden_size // num_heads
    wanted: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": 4 * hidden_size,
        "ffn_dim": 4 * hidden_size, "n_inner": 4 * hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads or num_heads, "head_dim": head,
        "max_position_embeddings": max_positions, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0,
        # mixture of experts (Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3, ...)
        "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": hidden_size, "shared_expert_intermediate_size": hidden_size, "n_group": 1,
        "topk_group": 1, "first_k_dense_replace": min(1, num_layers - 1), "n_shared_experts": 1,
        # DeepSeek's low-rank attention
        "q_lora_rank": hidden_size // 2, "kv_lora_rank": hidden_size // 2, "qk_rope_head_dim": head,
        "qk_nope_head_dim": head, "v_head_dim": head,
        # linear-attention layers (Qwen3-Next, Qwen3.5): HF's defaults are the full model's heads (1.7e6
        # parameters at hidden 32)
        "linear_num_key_heads": num_heads, "linear_num_value_heads": num_heads, "linear_key_head_dim": head,
        "linear_value_head_dim": head,
        # GPT-J's and CodeGen's rotary share of a head; GPT-Neo's attention kind per layer
        "rotary_dim": head,
        "attention_types": ([[["global", "local"], num_layers // 2]] if num_layers % 2 == 0
                            else [[["global"], num_layers]]),
    }
    try:
        default = transformers.AutoConfig.for_model(model_type)
        kw = {k: v for k, v in wanted.items() if _settable(default, k)}
        kw.update(_family_sizes(default, hidden_size, head, num_heads))
        # a multimodal config's sizes are its sub-configs' (the causal LM is built from its text config):
        # given as dicts of the shrunk sizes, the rest the sub-config class's defaults
        for name in _SUB_CONFIGS:
            sub = getattr(default, name, None)
            if name in (getattr(type(default), "sub_configs", None) or {}) and sub is not None:
                sizes = wanted if name == "text_config" else {
                    **{k: wanted[k] for k in _SUB_SIZES}, **{k: hidden_size for k in _SUB_OUTPUTS}}
                kw[name] = {k: v for k, v in sizes.items() if _settable(sub, k)}
                if name == "text_config":
                    kw[name].update(_family_sizes(sub, hidden_size, head, num_heads))
        config = transformers.AutoConfig.for_model(model_type, **kw)
    except Exception as exc:  # transformers' own validators, deep in the family's config class: name the type
        raise ValueError(f"small_config({model_type!r}): transformers refuses the config ({type(exc).__name__}: "
                         f"{exc}); the family needs settings of its own beside the shared sizes: build its config "
                         "class directly (transformers.AutoConfig.for_model) and pass it to causal_lm_stages") from exc
    text = config.get_text_config() if "text_config" in (getattr(type(config), "sub_configs", None) or {}) else config
    for k, v in overrides.items():  # on the text config where only it has the attribute (dropout, is_decoder)
        setattr(text if text is not config and _settable(text, k) and not _settable(config, k) else config, k, v)
    return config


#: the sub-configs of a multimodal config that `small_config` shrinks; a vision or audio one's widths (its
#: layer count stays: some key per-layer settings by layer index) and its adapter's, to the text model
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config")
_SUB_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "moe_intermediate_size")
_SUB_OUTPUTS = ("out_hidden_size", "adapter_out_dim", "text_hidden_size", "adapter_in_dim", "adapter_input_size")


def _family_sizes(config: Any, hidden_size: int, head: int, num_heads: int) -> dict[str, Any]:
    """Sizes of a family that `wanted` cannot set: per-layer sizes its default config will not read
    globally and constructor-only keywords (dots.3-note's sliding-window layers, ``swa_*``); left at
    HF's values, each attention layer keeps the full-size model's heads and ranks."""
    if getattr(config, "model_type", None) != "dots3_note_text":
        return {}
    mla = {"num_attention_heads": num_heads, "num_key_value_heads": num_heads, "q_lora_rank": hidden_size // 2,
           "kv_lora_rank": hidden_size // 2, "qk_nope_head_dim": head, "qk_rope_head_dim": head, "v_head_dim": head}
    # a sliding-window layer's head is its nope and rope parts (the config checks it)
    return {**mla, **{f"swa_{k}": v for k, v in mla.items()}, "swa_head_dim": 2 * head, "index_n_heads": num_heads,
            "index_head_dim": head, "shared_experts_intermediate_size": hidden_size}


def _settable(config: Any, key: str) -> bool:
    """Whether `small_config` sets `key` on the family's config: an attribute of its defaults, not a
    property; one the config refuses to read globally (a per-layer size of Gemma 4's) is left alone."""
    try:
        return hasattr(config, key) and not isinstance(getattr(type(config), key, None), property)
    except Exception:  # noqa: BLE001 - transformers' per-layer guard raises its own error type
        return False
