"""Measure a model's per-layer `Profile` on one device, for `zbpp.schedules.planner.search`.

`measure_profile` runs each layer of a model on its own, a few steps of each, and returns a
`zbpp.schedules.profile.Profile`: per layer the median time of F (its forward), B (the gradient
with respect to its input only) and W (the gradient with respect to its parameters only), in
seconds; the bytes of activations F keeps for backward and the part of them W needs; and the
static bytes of its parameters, gradients and optimizer state. Save it with ``Profile.save`` and
``zbpp plan --profile FILE -p P -m M --budget-gb G`` chooses the stages and the schedule.

The layers are the modules before the model's repeated blocks (one layer), each block, and the
modules after them (one layer), found as `zbpp.models.fqns_per_stage` finds them; a Hugging Face
causal LM (`zbpp.models.hf.SUPPORTED`) runs each layer with the stage forward of `zbpp.models.hf`,
so embeddings, rotary embeddings and masks are as in the pipeline. Or pass ``layers=[(name,
module), ...]``: layer 0 gets the example input, every later layer the output of the one before
(a tuple as ``module(*x)``, a dict as ``module(**x)``, as `Pipeline` calls stages).

The whole model must fit the device. For a larger one, measure the same configuration with a few
blocks and repeat a block's `Layer` (``Profile([first, *[block] * n, last])``).

>>> import torch
>>> from torch import nn
>>> torch.manual_seed(0) and None
>>> net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
>>> prof = measure_profile(layers=[("up", net[0]), ("act", net[1]), ("down", net[2])],
...                        example_input=torch.randn(32, 8, dtype=torch.float64), steps=2)
>>> [x.name for x in prof.layers], prof.layers[1].static, prof.layers[2].activation  # tanh: no weights
(['up', 'act', 'down'], 0.0, 4096.0)
>>> from zbpp.schedules.planner import search
>>> len(search(prof, num_ranks=1, num_microbatches=2).stages)
1
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .._compat import current_saved_tensors_hooks, gpu_head_start
from ..modules.context import microbatch
from ..runtime.wgrad import SavedBoxes, StageWgrad, has_own_wgrad
from ..schedules.profile import Layer, PolicyCost, Profile, Shared

__all__ = ["measure_profile", "measure_causal_lm", "measure_host_link", "ADAMW_BYTES_PER_PARAM", "adamw_bytes_per_param"]

#: AdamW optimizer state per parameter in mixed precision: fp32 master weight and two fp32 moments.
ADAMW_BYTES_PER_PARAM = 12.0


def adamw_bytes_per_param(dtype: torch.dtype) -> float:
    """AdamW's optimizer state per parameter of `dtype`: its two moments in that dtype for float32
    and wider (stepped in place, no master copy), else `ADAMW_BYTES_PER_PARAM` (an fp32 master
    weight and two fp32 moments: low-precision weights would lose the small updates)."""
    size = dtype.itemsize
    return 2.0 * size if size >= 4 else ADAMW_BYTES_PER_PARAM


def _static_bytes(p: torch.Tensor, opt: float | None) -> float:
    """A parameter's weight, gradient and optimizer state (`opt` per element; None: AdamW's for its
    dtype); a frozen one only its weight (no gradient, and AdamW keeps no state without one)."""
    if not p.requires_grad:
        return float(p.numel() * p.element_size())
    return p.numel() * (2 * p.element_size() + (adamw_bytes_per_param(p.dtype) if opt is None else opt))


def measure_profile(
    model: nn.Module | None = None,
    example_input: Any = None,
    *,
    layers: Sequence[tuple[str, nn.Module]] | None = None,
    blocks: str | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    steps: int = 3,
    warmup: int = 1,
    optimizer_bytes_per_param: float | None = None,
    comm: float = 0.0,
    name: str = "",
    policies: Sequence[str] = (),
    host_bytes_per_s: float | None = None,
) -> Profile:
    """A `Profile` of `model` (or of `layers`) measured on the device its parameters are on.

    Args:
        model: a model with real weights (not on ``meta``). Its layers: the modules registered
            before `blocks`, each child of `blocks`, the modules after (parameter-free ones, such as
            rotary embeddings, run with every layer). A model whose forward runs only the modules it
            holds, skipping those set to None (torchtitan's convention), or a Hugging Face causal LM.
        example_input: one microbatch as the first layer takes it (``input_ids`` for a HF model).
        layers: ``[(name, module), ...]`` in order, instead of `model`.
        blocks: the FQN of the repeated blocks (default ``model.layers``; GPT-2 ``transformer.h``).
        loss_fn, target: the last layer's output becomes ``loss_fn(output, target)`` (a HF model's
            default: `zbpp.models.hf.CausalLMLoss` with the input ids as labels); without them its
            backward starts from a random gradient of the output's shape.
        steps, warmup: timed steps (the median is kept) after `warmup` untimed ones.
        optimizer_bytes_per_param: optimizer state per parameter (default None: AdamW's for each
            parameter's dtype, `adamw_bytes_per_param`: 8 for float32 and 16 for float64, the two
            moments; 12 for bfloat16 and float16, an fp32 master weight and two fp32 moments).
        comm, name: the profile's message time (seconds) and name.
        policies: activation policies to measure besides ``"none"`` (``"full"``, ``"selective"``,
            ``"offload"``; see below). Empty: none (the layers offer no policy).
        host_bytes_per_s: the host link's bandwidth per direction for offload's copies (None:
            measured once, `measure_host_link`, when ``"offload"`` is asked for); given without
            ``"offload"`` in `policies`, a `ValueError` (nothing would use it).

    Per layer (times in seconds, on CUDA with CUDA events, else with ``time.perf_counter``):

    - f, b, w: the layer's F, B and W tasks as `zbpp.Pipeline` runs them under a zero-bubble
      schedule (one microbatch key per step, the same code: `zbpp.runtime.wgrad.StageWgrad`): B
      computes the gradient of the inputs that need one and only what it needs (the runtime's
      generic split; a first layer's B computes nothing), W every weight gradient (the rest of
      the split backward, then the delayed-wgrad modules' ``backward_dw``). The layers' ``.grad``
      (and ``main_grad``), buffers, pending delayed-wgrad jobs (zbpp's and Transformer Engine's
      ``wgrad_store`` queue: set aside while measuring, then back, in order), zbpp FP8 scaling
      state and the random generators are restored after measuring: training after it is
      training without it. Another module whose ``backward_dw()`` takes no key must have no W
      pending: the measurement's W would take the oldest.
    - activation: bytes of the tensors autograd saves in F (`torch.autograd.graph.saved_tensors_hooks`),
      one count per storage; parameters, buffers, the example input's tensors that need no gradient
      (token ids, masks) and the target left out (the caller holds them anyway); a later layer's
      input that needs none (a frozen embedding's output) counts. A layer's saved input is also
      the layer before's saved output, so summing layers counts such a tensor at each stage boundary.
      A layer none of whose outputs needs a gradient (frozen, its input needing none) has B and W 0,
      as in the pipeline; the last layer must have one.
    - wgrad: the part of them W keeps: the saved storages still alive once the runtime's B is done
      (each microbatch's input a fresh tensor, each output's storage dropped as the pipeline drops
      a sent one). Where the runtime splits the layer's backward, its marks
      (`zbpp.runtime._autograd_split`) free what only B reads; a delayed-wgrad module keeps what
      its ``backward_dw`` reads; a first layer's B computes nothing, so W keeps all F saved. The
      output gradients B hands to W are not counted.
    - transient: the most bytes the layer's B holds at once above ``activation`` while it runs
      (the loss's gradients on the last layer, B's own temporaries): every storage its ops make
      and every saved one, counted after each op while alive, on one more, untimed, step.
    - static: per parameter ``numel * (2 * element_size + optimizer_bytes_per_param)``: weight,
      gradient in its dtype, optimizer state; a frozen one (``requires_grad=False``) only its
      ``numel * element_size``. A parameter two layers share (a tied embedding and LM head) counts
      in each, as on two ranks, and is listed in the profile's ``shared``
      (`zbpp.schedules.profile.Shared`: its name, the layers holding it and its static bytes), so
      that a rank holding several of those layers (a V placement's rank 0) counts it once.
    - policies (`zbpp.schedules.profile.PolicyCost`, each of `policies`): on a model's blocks (the
      submodule each layer's name names, as `zbpp.models.recompute.apply_activation_policy` wraps
      it by name), or with `layers=` on every layer but the first (whose input needs no gradient),
      measured by `zbpp.models.recompute.measure_activation_policies` once per policy; the bytes kept F->B and B->W are the layer's own (activation, wgrad) moved
      by what the policy changes against "none", and so is B's transient (the re-run's or reloaded
      tensors; on a CPU the reload is the host copy itself, so offload's copied bytes are added);
      the time a recompute policy adds to B is its B
      timed as above less the layer's own (at least 0; noisy on a busy CPU); offload's copy is the
      bytes it moved, timed by the profile over `host_bytes_per_s` (its B time is not: the
      schedule's gaps hide part of the copy, `zbpp.schedules.policies`).

    The device's timings vary from run to run: take a few steps and compare plans, not digits.
    """
    steps_, warmup_ = _count(steps, "steps", 1), _count(warmup, "warmup", 0)
    opt = None if optimizer_bytes_per_param is None else float(optimizer_bytes_per_param)
    if opt is not None and not opt >= 0:
        raise ValueError(f"optimizer_bytes_per_param must be >= 0, got {optimizer_bytes_per_param!r}")
    if example_input is None:
        raise ValueError("measure_profile needs example_input: one microbatch as the first layer takes it")
    if (model is None) == (layers is None):
        raise ValueError("measure_profile takes a model or layers=[(name, module), ...], not both or neither")
    if layers is not None:
        if blocks is not None:
            raise ValueError("blocks applies to a model; layers= lists the layers themselves")
        named = _check_layers(layers)
    else:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        named, loss_fn, target = _model_layers(model, example_input, blocks, loss_fn, target)
    if loss_fn is not None and target is None:
        raise ValueError("loss_fn needs target: the last layer's output becomes loss_fn(output, target)")
    for lname, module in named:
        meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if meta:
            raise ValueError(f"layer {lname!r}: {meta[:4]} are on the meta device: measure_profile runs the layers, "
                             "so build the model with real weights on the device to measure")
    asked = _check_policies(policies)
    device = _device_of(named, example_input)
    if host_bytes_per_s is not None and "offload" not in asked:  # only offload's copies use it: else ignored
        raise ValueError(f"host_bytes_per_s={host_bytes_per_s!r} is the host link of offload's copies; "
                         f"policies {list(asked)} do not measure offload: add \"offload\" or drop host_bytes_per_s")
    link = 0.0
    if "offload" in asked:
        link = measure_host_link(device) if host_bytes_per_s is None else float(host_bytes_per_s)
        if not link > 0:
            raise ValueError(f"host_bytes_per_s must be > 0, got {host_bytes_per_s!r}")
    out: list[Layer] = []
    x = example_input
    held = {_key(t)[0] for t in [*_tensors(example_input), *_tensors(target),
                                 *(t for _, m in named if isinstance(m, nn.Module) for t in [*m.parameters(), *m.buffers()])]}
    from .recompute import _left_as_found

    # a measurement is no training step: gradients, buffers, FP8 scaling and random states as found after it
    measured = model if model is not None else nn.ModuleList(m for _, m in named if isinstance(m, nn.Module))
    with _left_as_found(measured, (example_input, target)):
        for i, (lname, module) in enumerate(named):
            last = i == len(named) - 1
            given = x
            x, layer = _measure(lname, module, x, first=i == 0, loss=(loss_fn, target) if last else None,
                                steps=steps_, warmup=warmup_, opt=opt, last=last, held=held)
            if asked and i > 0 and (layers is not None or _names_a_block(lname, module)):
                timed = {q: _timed_b(lname, module, given, q, loss=(loss_fn, target) if last else None,
                                     steps=steps_, warmup=warmup_, last=last, held=held)
                         for q in asked if q != "offload"}
                layer = replace(layer, policies=_policy_costs(lname, module, given, layer, asked, timed))
            out.append(layer)
    notes = {"measured_on": str(device), "steps": steps_, "warmup": warmup_,
             "optimizer_bytes_per_param": "AdamW's for each parameter's dtype" if opt is None else opt,
             "torch": torch.__version__}
    if link:
        how = "pinned copies" if device.type == "cuda" else "a copy in memory: offload's stand-in on CPU"
        notes["host_link"] = "given" if host_bytes_per_s is not None else f"measured ({how})"
    return Profile(tuple(out), comm=comm, name=name, notes=notes, host_bytes_per_s=link,
                   shared=_shared_parameters(named, opt, prefix=layers is not None))


def _shared_parameters(named: Sequence[tuple[str, Any]], opt: float | None, prefix: bool) -> list[Shared]:
    """Each Parameter registered in several layers, with its static bytes as `_measure` counts them:
    one Parameter where one rank holds those layers (`zbpp.models.pipeline_stages` keeps it so).
    Named as the first layer holding it names it (with `prefix`, after that layer's name)."""
    where: dict[int, tuple[str, nn.Parameter, list[int]]] = {}
    for i, (lname, module) in enumerate(named):
        if isinstance(module, nn.Module):
            for pname, p in module.named_parameters():
                got = where.setdefault(id(p), (f"{lname}.{pname}" if prefix else pname, p, []))
                if i not in got[2]:
                    got[2].append(i)
    return [Shared(n, tuple(at), _static_bytes(p, opt)) for n, p, at in where.values() if len(at) > 1]


def measure_host_link(device: torch.device | str, nbytes: int = 64 * 2**20, repeats: int = 3) -> float:
    """Bytes per second of a copy between `device` and host memory, per direction (the slower
    of device-to-pinned-host and back, the best of `repeats` each); on a CPU device, of a copy in
    memory (what offload does there).

    >>> measure_host_link("cpu", nbytes=2**20) > 0
    True
    """
    dev = torch.device(device)
    n, reps = _count(nbytes, "nbytes", 1), _count(repeats, "repeats", 1)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    if dev.type != "cuda":
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            src.clone()
            best = min(best, time.perf_counter() - t0)
        return n / best
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    timer = _Timer(dev)
    down = min(timer(lambda: host.copy_(src, non_blocking=True))[1] for _ in range(reps))
    up = min(timer(lambda: src.copy_(host, non_blocking=True))[1] for _ in range(reps))
    return n / max(down, up)


def _check_policies(policies: Sequence[str]) -> tuple[str, ...]:
    from .recompute import POLICIES

    if isinstance(policies, str):
        policies = [policies]
    for q in policies:
        if q not in POLICIES:
            raise ValueError(f"activation policy {q!r}: choose from {', '.join(POLICIES)}")
    return tuple(q for q in POLICIES[1:] if q in policies)


def _names_a_block(lname: str, module: Any) -> bool:
    """A model's layer that is one of its blocks (named by its FQN, as policies are applied by name)."""
    return isinstance(module, nn.Module) and lname in dict(module.named_modules())


def _policy_target(lname: str, module: Any) -> tuple[nn.Module, str]:
    """The submodule of a layer that a policy wraps (the one its name names, else the layer), and its name."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"layer {lname!r}: activation policies need an nn.Module")
    named = dict(module.named_modules())
    return (named[lname], lname) if lname in named else (module, "")


def _timed_b(lname: str, module: Any, x: Any, policy: str, **kwargs: Any) -> float:
    """The layer's B time (median, as `measure_profile` times it) with its policy target under `policy`."""
    from .recompute import activation_policies, apply_activation_policy

    _, where = _policy_target(lname, module)
    before = activation_policies(module).get(where, "none")
    apply_activation_policy(module, {where: policy})
    try:
        return _measure(lname, module, x, first=False, opt=0.0, **kwargs)[1].b
    finally:
        apply_activation_policy(module, {where: before})


def _policy_costs(lname: str, module: Any, x: Any, layer: Layer, asked: tuple[str, ...],
                  timed_b: dict[str, float]) -> dict[str, PolicyCost]:
    """`asked`'s costs of one layer (see `measure_profile`), measured on the submodule its name
    names; `timed_b`: B's time under each recompute policy."""
    from .recompute import measure_activation_policies

    target, _ = _policy_target(lname, module)
    seen: dict[str, Any] = {}
    hook = target.register_forward_pre_hook(lambda m, a, k: seen.update(a=a, k=k), with_kwargs=True)
    try:
        with torch.no_grad():  # only the arguments it is called with
            _call(module, _received(_leaves(x, False)))
    finally:
        hook.remove()
    if not seen:
        raise ValueError(f"layer {lname!r}: its submodule {lname!r} did not run in the layer's forward, so its "
                         "activation policies cannot be measured")
    got = measure_activation_policies(target, *seen["a"], policies=("none", *asked), **seen["k"])
    none = got["none"]
    # on a CPU, offload's "device" copy back is the host copy itself: its bytes come back all the same
    cpu = all(p.device.type != "cuda" for p in target.parameters())
    return {q: PolicyCost(activation=max(0.0, layer.activation + c.kept_f_to_b - none.kept_f_to_b),
                          wgrad=max(0.0, layer.wgrad + c.kept_b_to_w - none.kept_b_to_w),
                          recompute=max(0.0, timed_b.get(q, layer.b) - layer.b), copy=float(c.host_bytes),
                          transient=max(0.0, layer.transient + c.b_transient - none.b_transient)
                          + (float(c.host_bytes) if cpu and q == "offload" else 0.0))
            for q, c in got.items() if q != "none"}


def _count(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


def _check_layers(layers: Any) -> list[tuple[str, nn.Module]]:
    if isinstance(layers, (str, nn.Module)) or not isinstance(layers, Sequence) or not layers:
        raise ValueError("layers must be a non-empty list of (name, module) pairs")
    out = []
    for i, item in enumerate(layers):
        if (not isinstance(item, (tuple, list)) or len(item) != 2 or not isinstance(item[0], str)
                or not callable(item[1])):
            raise ValueError(f"layers[{i}] must be a (name, module) pair, got {item!r:.80}")
        out.append((item[0], item[1]))
    return out


def measure_causal_lm(
    config: Any,
    *,
    seq: int,
    micro_batch: int = 1,
    measured_blocks: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    attn_implementation: str | None = None,
    experts_implementation: str | None = None,
    link_bytes_per_s: float = 50e9,
    seed: int = 0,
    **kwargs: Any,
) -> Profile:
    """`measure_profile` of a Hugging Face causal LM built from `config` with random weights on
    `device`, on one microbatch of ``micro_batch x seq`` random tokens. `attn_implementation` and
    `experts_implementation` as `zbpp.models.hf.causal_lm_stages` takes them (a float64 mixture of
    experts needs ``experts_implementation="eager"``).

    With `measured_blocks`, the model is built with that many blocks only (for a model larger than
    the device) and the profile repeats the measured blocks to the config's count: each block of the
    config gets the measured block of median F+B+W among those of its kind (class, parameter shapes
    and ``layer_types`` entry: DeepSeek's dense first blocks apart from its MoE ones, sliding windows
    apart from full attention). A kind that none of the first `measured_blocks` blocks has is refused.
    A message between ranks is the ``micro_batch x seq x hidden`` hidden states at
    `link_bytes_per_s` (the profile's ``comm``). Other keyword arguments go to `measure_profile`.
    What the layers share (`Profile.shared`: a tied embedding and LM head) carries over where only
    the first and the last layer share it; one the measured blocks share is left out when they are
    repeated (they stand for other blocks), so each layer counts it in full.

    >>> import transformers
    >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=6,
    ...                                num_attention_heads=2, num_key_value_heads=1)
    >>> prof = measure_causal_lm(cfg, seq=8, measured_blocks=1, steps=1, warmup=0)
    >>> [x.name for x in prof.layers][:3], len(prof)
    (['model.embed_tokens', 'model.layers.0', 'model.layers.1'], 8)
    """
    import copy

    import transformers

    from .hf import SUPPORTED, check_template

    if not isinstance(config, transformers.PretrainedConfig):
        raise TypeError(f"config must be a transformers PretrainedConfig, got {type(config).__name__}")
    if config.model_type not in SUPPORTED:
        raise ValueError(f"model_type {config.model_type!r} is not supported; measure_causal_lm builds {list(SUPPORTED)}")
    T, mb = _count(seq, "seq", 1), _count(micro_batch, "micro_batch", 1)
    total = int(config.num_hidden_layers)
    n = total if measured_blocks is None else _count(measured_blocks, "measured_blocks", 1)
    if n > total:
        raise ValueError(f"measured_blocks={n} exceeds the config's {total} blocks")
    if not float(link_bytes_per_s) > 0:
        raise ValueError(f"link_bytes_per_s must be > 0, got {link_bytes_per_s!r}")
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = n
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:n]
    kw: dict[str, Any] = {}
    if dtype is not None:
        kw["dtype"] = dtype
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    if experts_implementation is not None:
        kw["experts_implementation"] = experts_implementation
    dev = torch.device(device)
    cuda = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        with dev:
            model = transformers.AutoModelForCausalLM.from_config(cfg, **kw)
        ids = torch.randint(0, int(cfg.vocab_size), (mb, T), device=dev)
    kinds: list[Any] = []  # per block of the config: what a measured block must match to stand for it
    if n < total:
        with torch.device("meta"):  # the whole model's blocks, for their kinds only: nothing allocated
            kinds = _block_kinds(transformers.AutoModelForCausalLM.from_config(config, **kw), config)
        have = _block_kinds(model, cfg)
        lacking = [i for i, k in enumerate(kinds) if k not in have]
        if lacking:
            i, need = lacking[0], max(kinds.index(k) for k in kinds) + 1
            what = kinds[i][0] + (f", {kinds[i][2]}" if kinds[i][2] is not None else "")
            raise ValueError(f"measured_blocks={n}: block {check_template(model).blocks}.{i} of the config's {total} "
                             f"({what}) is unlike each of the first {n}, so no measured block stands for it; raise "
                             f"measured_blocks to at least {need}")
    name = kwargs.pop("name", "") or getattr(config, "name_or_path", "") or str(config.model_type)
    prof = measure_profile(model, ids, name=name, **kwargs)
    bytes_per = next(model.parameters()).element_size()
    comm = mb * T * int(cfg.hidden_size) * bytes_per / float(link_bytes_per_s)
    first, blocks, last = prof.layers[:1], prof.layers[1:-1], prof.layers[-1:]
    if n < total:
        # per kind of block (dense or MoE, sliding or full attention): its measured block of median F+B+W
        have = _block_kinds(model, cfg)
        typical = {}
        for k in set(have):
            alike = sorted((x for x, h in zip(blocks, have) if h == k), key=lambda x: x.f + x.b + x.w)
            typical[k] = alike[(len(alike) - 1) // 2]
        prefix = blocks[0].name.rpartition(".")[0]
        blocks = tuple(replace(typical[k], name=f"{prefix}.{i}") for i, k in enumerate(kinds))
    shared = [Shared(x.name, [total + 1 if i == n + 1 else i for i in x.layers], x.static) for x in prof.shared
              if n == total or all(i in (0, n + 1) for i in x.layers)]
    notes = {**prof.notes, "seq": T, "micro_batch": mb, "measured_blocks": n, "num_layers": total,
             "dtype": str(next(model.parameters()).dtype), "link_bytes_per_s": float(link_bytes_per_s)}
    return Profile((*first, *blocks, *last), comm=comm, name=prof.name, notes=notes,
                   host_bytes_per_s=prof.host_bytes_per_s, shared=shared)


def _block_kinds(model: nn.Module, config: Any) -> list[tuple[Any, ...]]:
    """Per decoder block of a HF causal LM, its kind, which a measured block must share to stand for
    it: (class name, parameter names and shapes, ``config.layer_types`` entry or None)."""
    from .hf import check_template

    types = getattr(config, "layer_types", None)
    return [(type(b).__name__, tuple((k, tuple(p.shape)) for k, p in b.named_parameters()),
             types[i] if isinstance(types, list) and i < len(types) else None)
            for i, b in enumerate(model.get_submodule(check_template(model).blocks))]


# -- layers of a model -----------------------------------------------------------------------------
def _model_layers(model: nn.Module, example_input: Any, blocks: str | None, loss_fn: Any,
                  target: Any) -> tuple[list[tuple[str, nn.Module]], Any, Any]:
    from . import hf
    from .stages import _container, _model_order, _outside, _prune

    kind = getattr(getattr(model, "config", None), "model_type", None)
    is_hf = kind in hf.SUPPORTED
    template = hf.check_template(model) if is_hf else None
    if blocks is None:
        blocks = template.blocks if template is not None else "model.layers"
    container = _container(model, blocks)
    before, after, everywhere = _outside(model, blocks)
    order = {f: i for i, f in enumerate(_model_order(model))}
    before, after = sorted(before, key=order.__getitem__), sorted(after, key=order.__getitem__)
    block_fqns = [f"{blocks}.{n}" for n, m in container._modules.items() if m is not None]
    # the model's own tensors, so that the stages share them instead of copying
    shared: dict[int, Any] = {id(t): t for t in [*model.parameters(), *model.buffers()]}

    def stage(held: list[str], first: bool, last: bool) -> nn.Module:
        pruned = _prune(model, "", set(held) | set(everywhere), dict(shared))
        parent_fqn, _, leaf = blocks.rpartition(".")
        parent = pruned.get_submodule(parent_fqn) if parent_fqn else pruned
        if parent._modules.get(leaf) is None:  # no block held: an empty container, so forward loops over none
            parent._modules[leaf] = type(container)()
        if template is None:
            return pruned
        return hf._as_stage(pruned, model, template, first=first, last=last, tuple_out=tuple_out)

    tuple_out = hf._layers_return_tuple(model, template) if template is not None else None

    named: list[tuple[str, nn.Module]] = []
    if before:
        named.append(("+".join(before), stage(before, True, False)))
    named += [(f, stage([f], not before and i == 0, not after and i == len(block_fqns) - 1))
              for i, f in enumerate(block_fqns)]
    if after:
        named.append(("+".join(after), stage(after, False, True)))
    if is_hf and loss_fn is None:
        loss_fn = hf.CausalLMLoss()
        if target is None:
            ids = example_input.get("input_ids") if isinstance(example_input, dict) else example_input
            target = ids
    return named, loss_fn, target


# -- one layer -------------------------------------------------------------------------------------
def _call(module: Any, x: Any) -> Any:
    if isinstance(x, dict):
        return module(**x)
    if isinstance(x, (tuple, list)):
        return module(*x)
    return module(x)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)


def _leaves(x: Any, first: bool) -> Any:
    """`x` detached; tensors that carried a gradient (none for the first layer) become leaves that need one."""
    if isinstance(x, torch.Tensor):
        grad = x.requires_grad and not first
        return x.detach().requires_grad_(grad) if grad else x.detach()
    if isinstance(x, dict):
        return {k: _leaves(v, first) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_leaves(v, first) for v in x) if isinstance(x, tuple) else [_leaves(v, first) for v in x]
    return x


class _Timer:
    """A task's time as it runs among others in a pipeline. On CUDA: the GPU's time to run its
    kernels back to back, queued behind a head start while the host issues them (in a pipeline the
    host issues a task while the GPU runs the ones before). Timed from an idle GPU, or as the
    slower of that and the host's issue time, a task would also count its launches and this
    module's own work around them, which the runtime's records do not show."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            gpu_head_start()
            start.record()
            value = fn()
            end.record()
            end.synchronize()
            return value, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        value = fn()
        return value, time.perf_counter() - t0


def _device_of(named: Sequence[tuple[str, nn.Module]], x: Any) -> torch.device:
    for t in _tensors(x):
        return t.device
    for _, m in named:
        for p in m.parameters():
            return p.device
    return torch.device("cpu")


def _key(t: torch.Tensor) -> tuple[Any, int]:
    s = t.untyped_storage()
    return (t.device, s.data_ptr()), s.nbytes()


def _measure(lname: str, module: Any, x: Any, *, first: bool, loss: tuple[Any, Any] | None, steps: int,
             warmup: int, opt: float | None, last: bool = True, held: set[Any] | None = None) -> tuple[Any, Layer]:
    """One layer's `Layer` and its output for the next. A layer none of whose outputs needs a
    gradient (frozen, its input needing none: a frozen embedding) has nothing in B or W, as in the
    pipeline, whose later stages still train; the `last` layer must have one (else nothing trains).
    `held`: the storages the caller holds anyway (the example input, every layer's tensors)."""
    from .recompute import _PeakBytes

    x = _leaves(x, first)
    params = list({id(p): p for p in (module.parameters() if isinstance(module, nn.Module) else ())
                   if p.requires_grad}.values())
    static_ids = {_key(t)[0] for t in (module.parameters() if isinstance(module, nn.Module) else ())}
    static_ids |= {_key(t)[0] for t in (module.buffers() if isinstance(module, nn.Module) else ())}
    # what the caller holds anyway (token ids, masks, rotary tables) is no layer's activation; a later
    # layer's input that needs no gradient and is none of those (a frozen embedding's output) is one:
    # the pipeline receives it per microbatch and holds it while the graph saves it
    static_ids |= {_key(t)[0] for t in [*_tensors(x), *_tensors(loss[1] if loss else None)]
                   if not t.requires_grad and (first or held is None or _key(t)[0] in held)}
    timer = _Timer(_device_of([("", module)] if isinstance(module, nn.Module) else [], x))
    gen = torch.Generator().manual_seed(0)
    grads: list[torch.Tensor] | None = None
    stage = module if isinstance(module, nn.Module) else nn.Module()
    tasks = StageWgrad(stage)  # the runtime's B and W of this layer as a stage
    split = has_own_wgrad(stage, tasks)
    kept = _kept_gradients(stage)

    def forward(xs: Any, key: Any, saved: SavedBoxes | None, seen: dict[Any, Any] | None) -> tuple[Any, list[torch.Tensor]]:
        # `seen`: record the saved storages (the untimed probe step only: its hooks cost host time)
        record = _saved_storages(static_ids, seen) if seen is not None else contextlib.nullcontext()
        with microbatch(key), saved if saved is not None else contextlib.nullcontext(), record:
            out = _call(module, xs)
            if loss is not None and loss[0] is not None:
                return out, [loss[0](out, loss[1])]
            return out, [t for t in _tensors(out) if t.requires_grad]

    times: dict[str, list[float]] = {"f": [], "b": [], "w": []}
    nxt: Any = None
    activation = wgrad = transient = 0
    try:
        for step in range(warmup + steps + 1):  # the last, untimed: the memory (hooks and a dispatch mode slow it)
            probe = step == warmup + steps
            key = ("profile", step)
            xs = _received(x)  # a fresh input, as the runtime receives one per microbatch
            inputs = [t for t in _tensors(xs) if t.requires_grad]
            saved = SavedBoxes() if split and inputs else None  # as the runtime's F of a split B
            seen: dict[Any, Any] | None = {} if probe else None  # the forward's saved storages, held weakly
            (out, outs), f = timer(lambda: forward(xs, key, saved, seen))
            graph = bool(outs)  # a frozen layer's outputs (its input needing no gradient) have none
            if not graph and last:
                raise ValueError(f"layer {lname!r}: no output needs a gradient (no parameter or input on its path), "
                                 "so it cannot be profiled for backward")
            if grads is None:
                grads = [torch.ones_like(t) if t.dim() == 0
                         else torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) for t in outs]
            if probe:
                activation = _alive(seen)
            if step == warmup + steps - 1:
                nxt = _detached(out, copy=True)
            if loss is None or loss[0] is None:  # a last stage's output is not sent (and its loss may have saved it)
                _release(out)  # as the runtime does once an output is sent: only its autograd node stays
            del out, xs
            if probe:
                with _PeakBytes(seen, key=lambda t: _key(t)[0]) as peak:
                    tasks.backward(key, outs, list(grads), inputs, saved, split=split)
                transient = max(0, peak.top - activation)
                b = 0.0
            else:
                _, b = timer(lambda: tasks.backward(key, outs, list(grads), inputs, saved, split=split))
            if (split and not inputs) or not graph:
                b = 0.0  # a first layer's split B computes nothing (it only hands the graph to W)
            _drop_grads(inputs)  # (in a function: a loop variable here would keep an input alive)
            del inputs, outs, saved
            if probe:
                wgrad = _alive(seen)  # what W keeps: left by the split's marks (or a delayed module's store)
            _, w = timer(lambda: tasks.compute(key))
            if not params or not graph:
                w = 0.0  # no weight, or no graph (a frozen embedding): W computes nothing
            if warmup <= step < warmup + steps:
                for k, v in (("f", f), ("b", b), ("w", w)):
                    times[k].append(v)
    finally:
        tasks.discard()
        kept()
    static = sum(_static_bytes(p, opt) for p in
                 {id(p): p for p in (module.parameters() if isinstance(module, nn.Module) else ())}.values())
    layer = Layer(lname, *(statistics.median(times[k]) for k in ("f", "b", "w")), activation=float(activation),
                  wgrad=float(min(wgrad, activation)), static=float(static), transient=float(transient))
    return nxt, layer


@contextlib.contextmanager
def _saved_storages(skip: set[Any], refs: dict[Any, tuple[StorageWeakRef, int]]) -> Iterator[None]:
    """Around a forward: record in `refs` the storages of the tensors autograd saves (one entry per
    storage, those in `skip` left out), held weakly, so that `_alive` tells the bytes still held
    by someone: after F all of them, after B what W keeps. Composes with the hooks current at
    entry (a split's boxes)."""
    outer = current_saved_tensors_hooks()
    # no hooks: save an alias, as autograd does (an output's storage dropped later stays saved)
    outer_pack, outer_unpack = outer if outer is not None else (torch.Tensor.detach, _same)

    def pack(t: torch.Tensor) -> Any:
        key, nbytes = _key(t)
        if key not in skip and key not in refs:
            refs[key] = (StorageWeakRef(t.untyped_storage()), nbytes)
        return outer_pack(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack):
        yield


def _alive(refs: dict[Any, tuple[StorageWeakRef, int]]) -> int:
    return sum(n for ref, n in refs.values() if not ref.expired())


def _drop_grads(leaves: list[torch.Tensor]) -> None:
    for t in leaves:
        t.grad = None


def _same(t: Any) -> Any:
    return t


def _received(x: Any) -> Any:
    """`x` with each tensor that needs a gradient replaced by a new leaf holding a copy of it."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_() if x.requires_grad else x
    if isinstance(x, dict):
        return {k: _received(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_received(v) for v in x) if isinstance(x, tuple) else [_received(v) for v in x]
    return x


def _release(out: Any) -> None:
    """Drop the storage of each output with a gradient function, keeping the tensor (as
    `zbpp.Pipeline` does once it has sent it): what still holds that memory is autograd's."""
    for t in _tensors(out):
        if t.requires_grad and t.grad_fn is not None and t._base is None:
            t.data = torch.empty((1,), dtype=t.dtype, device=t.device)


def _kept_gradients(module: nn.Module) -> Callable[[], None]:
    """Set the module's ``.grad`` and ``main_grad`` aside; the returned function puts them back."""
    params = list(module.parameters())
    grads = [p.grad for p in params]
    mains = [(m, m.clone()) for p in params if isinstance(m := getattr(p, "main_grad", None), torch.Tensor)]

    def restore() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        for m, copy in mains:
            m.copy_(copy)

    return restore


def _detached(x: Any, copy: bool = False) -> Any:
    """The output for the next layer: tensors cut from this layer's graph (copies of those that
    need a gradient, with `copy`), their need of a gradient kept."""
    if isinstance(x, torch.Tensor):
        d = x.detach()
        return (d.clone() if copy and x.requires_grad else d).requires_grad_(x.requires_grad)
    if isinstance(x, dict):
        return {k: _detached(v, copy) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_detached(v, copy) for v in x)
    if isinstance(x, list):
        return [_detached(v, copy) for v in x]
    return x
