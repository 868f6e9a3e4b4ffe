"""Per-layer activation policies: what a layer keeps between its forward (F) and its backward.

`apply_activation_policy(module, {"model.layers.*": "selective"})` wraps the forward of every
submodule whose name matches a pattern (``fnmatch``) with one of:

- ``"none"``: autograd keeps what it saves (removes an earlier policy);
- ``"full"``: the layer keeps only its inputs; its forward runs again, once, at the first
  backward that reads a saved tensor, under the forward's random-generator and autocast state,
  microbatch key and zbpp FP8 recipe and scaling state (so that it casts as F did). An input changed
  in place (by the forward itself or after it) would feed the re-run other values: a ``RuntimeError``
  names the layer and the input. So does a tensor inside an input (containers and namedtuples as
  `zbpp.runtime.tree` walks them; dataclasses and other objects through their attributes) changed
  in place, or replaced on its object. Buffers its forward changed (a counter, running statistics) are
  copied at F and read by the re-run as F found them, then put back: they move once per forward
  (which buffers change is learnt at the layer's first forward, by value: one host synchronisation);
- ``"selective"``: the layer also keeps the input of every GEMM with a weight (``F.linear``,
  ``torch.addmm``/``mm``/``matmul`` with an ``nn.Parameter`` operand), what the weight gradient
  reads, and its output where the re-run reaches it. The re-run replays those GEMMs from the kept
  outputs and recomputes only the rest (norms, activations, the attention core); a GEMM whose
  output was changed in place since (OLMo's ``clip_qkv``) runs again;
- ``"offload"``: every tensor the layer saves, but its parameters, is copied to host memory after
  F (pinned, on a side stream, on CUDA; a copy on CPU) and back before its backward, on the side
  stream, the compute stream waiting on an event: no host synchronisation. A storage that several
  saved tensors share is copied once. When a layer's tensors come back, the copies of the layer
  that ran before it in the same microbatch (the runtime's ``zbpp.modules.microbatch`` key) start.
  Under `zbpp.Pipeline` the schedule says more (``zbpp.modules.context.next_backward``): in the
  forward right before a backward, an offloaded layer starts bringing back what that backward
  needs first (the first backward of a step does not wait for its copy), and a microbatch whose
  own backward comes right after its forward (the last stage under 1F1B) keeps its tensors on the
  device, as without a policy: no task could hide a copy out and back.

Composition with zbpp's B/W split (`zbpp.runtime._autograd_split`). torch's non-reentrant
``checkpoint`` recomputes once per backward engine call, so the split's B and its W each recompute a
checkpointed layer: twice per microbatch. Here the re-run belongs to the layer's forward, not to an
engine call: the first unpack (in B, or in W on a stage whose B computes nothing) re-runs it, the
inputs go, and a later unpack reads the tensors it produced. Those tensors are packed through the
saved-tensor hooks that were current at F (the runtime's boxes), so B frees what only B reads and
keeps what W reads (the GEMM inputs), as without a policy. zbpp's delayed-wgrad layers compose (their
W reads the tensors B handed to their store). A policy-wrapped layer runs eagerly inside a
``torch.compile``d stage (a graph break around it); inside a CUDA graph capture
(``Pipeline(cuda_graphs=True)``) a policy layer raises a ``RuntimeError`` that says so. Side effects of a
forward on buffers do not happen again in the re-run, nor do zbpp FP8 layers' amax histories' moves.

`measure_activation_policies` reports, per policy, the bytes one layer keeps from F to B and from
B to W, the host bytes offloaded and the re-run's FLOPs (CPU is enough: bytes and FLOPs do not
depend on the device).

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
>>> apply_activation_policy(net, {"0": "full", "2": "selective"})
{'0': 'full', '2': 'selective'}
>>> net(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
>>> net[0].weight.grad.shape
torch.Size([8, 4])
>>> activation_policies(net)
{'0': 'full', '2': 'selective'}
"""

from __future__ import annotations

import contextlib
import fnmatch
import queue
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import flop_registry

from .._compat import current_saved_tensors_hooks, disable_dynamo, torch_dispatch_mode
from ..modules._scaling_state import restore_scaling_states, scaling_states
from ..modules._shared_input import last_cast_kept
from ..modules.base import DelayedWgradModule
from ..modules.context import current_microbatch, microbatch, rank_next_backward
from ..modules.fp8 import DelayedScaling, ScalingMeta, active_recipe, fp8_autocast
from ..runtime._autograd_split import unpacked_for_b_only
from ..runtime.tree import Spec, flatten, rebuild

__all__ = ["POLICIES", "apply_activation_policy", "activation_policies", "ActivationCost",
           "measure_activation_policies"]

#: The policies `apply_activation_policy` knows.
POLICIES = ("none", "full", "selective", "offload")

_ATTR = "_zbpp_activation_policy"  # the policy a wrapped module runs under
_CHANGES = "_zbpp_changed_buffers"  # {(submodule, name)} of the buffers a wrapped module's forward changes


# -- applying ------------------------------------------------------------------------------------
def apply_activation_policy(module: nn.Module, policies: Mapping[str, str], *, strict: bool = True) -> dict[str, str]:
    """Give each submodule of `module` whose name matches a pattern of `policies` that policy.

    `policies` maps ``fnmatch`` patterns of ``module.named_modules()`` names (``"model.layers.*"``,
    ``"model.layers.1"``, ``""`` for `module` itself) to one of `POLICIES`. Every pattern must match
    a module (``strict=False``: or none, as a pipeline stage without decoder layers), a module may
    match patterns of one policy only, and a wrapped module may not contain another (a clear
    ``ValueError`` otherwise), a module shared under several names counting under each. Returns
    ``{name: policy}`` of the modules set now. Parameters and ``state_dict`` keys do not change; a policy wraps the module's forward (one set
    on the instance, as accelerate's hooks set, included) and ``"none"`` gives it back. A copy
    (``copy.deepcopy``, pickling, `zbpp.models.pipeline_stages` of a model with real weights) runs
    its own layers under the same policies; a forward set on the instance that is a closure over
    the original runs the original, as without a policy. A shallow ``copy.copy`` of a module under a
    policy (sharing its submodules) runs the original's forward, reading the original's attributes,
    until given its policies again: ``apply_activation_policy(c, activation_policies(c))``.

    >>> from torch import nn
    >>> stack = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    >>> apply_activation_policy(stack, {"[01]": "offload", "2": "none"})
    {'0': 'offload', '1': 'offload', '2': 'none'}
    >>> apply_activation_policy(stack, {"model.layers.*": "full"}, strict=False)
    {}
    """
    _check_module(module, "apply_activation_policy")
    if not isinstance(policies, Mapping):
        raise TypeError("apply_activation_policy: policies must map module name patterns to policies "
                        f"({{'model.layers.*': 'selective'}}), got {type(policies).__name__} {policies!r}")
    chosen: dict[str, str] = {}
    # per module, not per name: a module registered under several names (shared) is one module
    where: dict[int, tuple[str, str, str]] = {}  # id(module) -> (first name, pattern, policy)
    named = dict(module.named_modules(remove_duplicate=False))
    for pattern, policy in policies.items():
        if not isinstance(pattern, str):
            raise TypeError(f"activation policy pattern {pattern!r} for {policy!r}: a module name pattern must be a str")
        if policy not in POLICIES:
            raise ValueError(f"activation policy {policy!r} for {pattern!r}: choose one of {', '.join(POLICIES)}")
        hits = [n for n in named if fnmatch.fnmatchcase(n, pattern)]
        if not hits and strict:
            some = ", ".join(repr(n) for n in list(named)[:8])
            raise ValueError(f"activation policy pattern {pattern!r} matches no module of "
                             f"{type(module).__name__} (names such as {some})")
        for n in hits:
            first, by, other = where.setdefault(id(named[n]), (n, pattern, policy))
            if other != policy:
                also = f" (also named {first!r})" if first != n else ""
                raise ValueError(f"module {n!r}{also} matches {by!r} ({other}) and {pattern!r} ({policy}): "
                                 "give each module one policy")
            chosen[n] = policy
    now = {id(m): p for m in named.values() if (p := m.__dict__.get(_ATTR)) is not None}
    now.update((id(named[n]), p) for n, p in chosen.items())
    final = {n: now[id(m)] for n, m in named.items() if now.get(id(m), "none") != "none"}
    wrapped = sorted(final)
    for a in wrapped:
        for b in wrapped:
            if b != a and (a == "" or b.startswith(a + ".")):
                raise ValueError(f"activation policies may not nest: {b!r} ({final[b]}) is inside {a!r} ({final[a]})")
    for n, policy in chosen.items():
        _set(named[n], policy, n)
    return chosen


def activation_policies(module: nn.Module) -> dict[str, str]:
    """``{name: policy}`` of the submodules of `module` that run under a policy other than none."""
    return _current(dict(module.named_modules(remove_duplicate=False)))


def _check_module(m: Any, who: str) -> None:
    if not isinstance(m, nn.Module):
        raise TypeError(f"{who}: the module must be an nn.Module, got {type(m).__name__}")


def _current(named: Mapping[str, nn.Module]) -> dict[str, str]:
    return {n: m.__dict__[_ATTR] for n, m in named.items() if _ATTR in m.__dict__}


def _set(m: nn.Module, policy: str, name: str | None = None) -> None:
    now = m.__dict__.pop("forward", None)
    # a forward set on the instance (accelerate's hooks, a partial) is the layer's: wrapped, and kept
    own = now.inner if isinstance(now, _PolicyForward) else now
    m.__dict__.pop(_ATTR, None)
    m.__dict__.pop(_CHANGES, None)
    if policy == "none":
        if own is not None:
            m.forward = own  # type: ignore[method-assign]
        return
    label = f"{name!r} ({type(m).__name__})" if name else type(m).__name__
    m.forward = _PolicyForward(m, policy, label, own)  # type: ignore[method-assign]
    m.__dict__[_ATTR] = policy


class _PolicyForward:
    """A module's ``forward`` under a policy. An object holding its module as an attribute, not a
    closure: ``copy.deepcopy`` and pickling (`pipeline_stages` copies a real model's layers) give
    the copy one that runs the copy's own forward, not the original's."""

    def __init__(self, module: nn.Module, policy: str, label: str, inner: Callable[..., Any] | None = None) -> None:
        self.module, self.policy, self.label, self.inner = module, policy, label, inner

    @property
    def __wrapped__(self) -> Callable[..., Any]:  # the forward it runs (and inspect.signature's)
        if self.inner is not None:
            return self.inner
        return type(self.module).forward.__get__(self.module, type(self.module))

    @disable_dynamo  # a graph break in a compiled stage: the hooks need eager autograd
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mod, policy, label = self.module, self.policy, self.label
        fn = self.__wrapped__
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"activation policy {policy!r} of {label}: not supported inside a CUDA "
                               "graph capture (Pipeline(cuda_graphs=True)): its re-run or copies would not be captured; "
                               "give the layer the policy 'none' or run the pipeline without cuda_graphs")
        params = {p.untyped_storage().data_ptr() for p in mod.parameters()}
        if policy == "offload":
            return _offload_forward(fn, params, args, kwargs)
        return _Frame(fn, policy, params, args, kwargs, mod, label).forward()


def _shallow_copied(m: nn.Module) -> None:
    """`m`, a shallow copy of a module under a policy (its ``__dict__`` copied: `pipeline_stages`'s
    stage containers), runs its own forward under that policy, not the original's."""
    f = m.__dict__.get("forward")
    if isinstance(f, _PolicyForward) and f.module is not m:
        m.__dict__["forward"] = _PolicyForward(m, f.policy, f.label, f.inner)
        m.__dict__.pop(_CHANGES, None)  # the original's submodules: learnt again


# -- recompute (full, selective) ------------------------------------------------------------------
class _Saved:
    """One saved tensor of a recomputed layer: the outer hooks' packed value (filled at F when kept,
    by the re-run otherwise) and the outer unpack that reads it."""

    __slots__ = ("frame", "packed", "unpack", "__weakref__")

    def __init__(self, frame: "_Frame | None", unpack: Callable[[Any], torch.Tensor], packed: Any = None) -> None:
        self.frame, self.unpack, self.packed = frame, unpack, packed


class _Frame:
    """One forward of one recomputed layer: its inputs until the re-run, the GEMM outputs a
    selective re-run replays, and the saved tensors the re-run fills (held weakly: what autograd
    released needs no re-run)."""

    def __init__(self, fn: Callable[..., Any], policy: str, params: set[int], args: tuple, kwargs: dict,
                 module: nn.Module | None = None, label: str = "a layer") -> None:
        self.fn, self.policy, self.label = fn, policy, label
        hooks = current_saved_tensors_hooks()
        self.outer_pack, self.outer_unpack = hooks if hooks is not None else (_identity, _identity)
        leaves, self.template = flatten((args, kwargs))
        self.keep_ptrs = set(params)  # storages alive anyway, or kept (selective GEMM operands)
        self.keep_ptrs.update(t.untyped_storage().data_ptr() for t in leaves)
        self.requires_grad = [t.requires_grad for t in leaves]
        # the re-run reads the inputs as they are then: one changed in place would feed it other values
        self.versions = [t._version for t in leaves]
        # tensors inside other values (dataclasses, objects): re-run as they are, so checked as they are
        self.opaque = _opaque_tensors(self.template)
        # held here, not through the outer hooks: nothing but the re-run reads them, and they go with it
        self.inputs: list[torch.Tensor] | None = [_held(t.detach()) for t in leaves]
        self.slots: list[weakref.ref | None] = []  # per saved tensor outside recorded GEMMs
        self.gemm_outputs: list[Any] = []  # selective: (output, its version), in call order
        self.rng = _rng_state(leaves)
        self.autocast = _autocast_state()
        # zbpp's FP8 layers read their recipe, scales and weight-cast reuse (by microbatch key) at
        # forward time: the re-run, in B outside the stage's fp8_autocast, must cast as F did
        self.fp8: DelayedScaling | None = active_recipe()
        self.fp8_state = _Fp8State(module) if self.fp8 is not None and module is not None else None
        self.key = current_microbatch()
        self.leaves = leaves  # for the first run only
        # the layer's buffers as F found them: copies of those its forward changes (known after its
        # first forward, which copies all), for the re-run
        self.module = weakref.ref(module) if module is not None else None
        changes = module.__dict__.get(_CHANGES) if module is not None else None
        self.buffers = [(m, n, b, b._version, _held(b.clone()) if changes is None or (m, n) in changes else None)
                        for m in (module.modules() if module is not None else ())
                        for n, b in m._buffers.items() if b is not None]

    def forward(self) -> Any:
        args, kwargs = rebuild(self.template, self.leaves)
        self.leaves = []
        mode = _GemmRecorder(self) if self.policy == "selective" else contextlib.nullcontext()
        me = weakref.ref(self)  # autograd keeps a pack hook as long as the graph: not the frame

        def pack(t: torch.Tensor) -> Any:
            frame = me()
            assert frame is not None
            return frame._pack(t)

        leaves = flatten((args, kwargs))[0]
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack), mode:
            out = self.fn(*args, **kwargs)
        self._check_inputs(leaves, "during its forward")
        module = self.module() if self.module is not None else None
        if module is not None and _CHANGES not in module.__dict__:
            # changed during F (a counter, running statistics): the re-run reads them as F did; the
            # rest must not change before the re-run (checked there). By value too (a host sync, once
            # per layer): batch_norm's kernel moves its running statistics without a version bump
            self.buffers = [(m, n, b, v, None if m._buffers.get(n) is b and b._version == v and _same(b, copy) else copy)
                            for m, n, b, v, copy in self.buffers]
            module.__dict__[_CHANGES] = {(m, n) for m, n, _, _, copy in self.buffers if copy is not None}
        # the re-run stops at the last tensor it must produce: GEMMs after it are never replayed
        last = max((i for i, r in enumerate(self.slots) if r is not None), default=-1)
        self.gemm_outputs = [o for at, o in self.gemm_outputs if at <= last]
        if last < 0:
            self.inputs, self.buffers, self.opaque = None, [], []  # nothing to re-run
        return out

    def _pack(self, t: torch.Tensor) -> Any:
        if _GemmRecorder.depth > 0:  # inside a recorded GEMM: kept, the re-run replays its output
            return _Saved(None, self.outer_unpack, self.outer_pack(t))
        if t.untyped_storage().data_ptr() in self.keep_ptrs:
            self.slots.append(None)
            return _Saved(None, self.outer_unpack, self.outer_pack(t))
        s = _Saved(self, self.outer_unpack)
        self.slots.append(weakref.ref(s))
        return s

    def recompute(self) -> None:
        """Re-run the forward once, filling every saved tensor still referenced; drop the inputs."""
        packed, self.inputs = self.inputs, None
        if packed is None:
            raise RuntimeError("zbpp activation policy: a layer's forward was re-run twice (a bug)")
        self._check_inputs(packed, "after its forward")
        self.opaque = []
        buffers, self.buffers = self.buffers, []
        for m, n, b, v, copy in buffers:
            if copy is None and (m._buffers.get(n) is not b or b._version != v):
                raise RuntimeError(f"activation policy {self.policy!r} of {self.label}: its buffer {n!r} "
                                   f"({type(m).__name__}) changed after its forward; the re-run would read the "
                                   "changed values (wrong gradients). Give the layer the policy 'offload' or 'none'")
        leaves = [t.detach().requires_grad_(g) for t, g in zip(packed, self.requires_grad)]
        del packed
        args, kwargs = rebuild(self.template, leaves)
        slots, self.slots = self.slots, []
        live = sum(1 for r in slots if r is not None and r() is not None)
        if not live:  # autograd released every tensor the re-run would make
            self.gemm_outputs = []
            return
        seen = 0

        def pack(t: torch.Tensor) -> None:
            nonlocal seen, live
            if _GemmRecorder.depth > 0:
                return None
            i, seen = seen, seen + 1
            ref = slots[i] if i < len(slots) else None
            s = ref() if ref is not None else None
            if s is not None:
                s.packed, s.frame = self.outer_pack(t.detach()), None
                live -= 1
                if live == 0:  # the rest of the forward produces nothing backward reads (torch's early stop)
                    raise _StopRecompute
            return None

        mode = _GemmReplay(self) if self.policy == "selective" else contextlib.nullcontext()
        try:
            with _restored(self.rng, self.autocast), fp8_autocast(self.fp8 is not None, fp8_recipe=self.fp8), \
                    self.fp8_state or contextlib.nullcontext(), microbatch(self.key), _buffers_at_f(buffers), \
                    torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(pack, _no_unpack), mode:
                self.fn(*args, **kwargs)
        except _StopRecompute:
            return
        finally:
            self.gemm_outputs = []
        if seen != len(slots):
            raise RuntimeError(f"zbpp activation policy ({self.policy}): the re-run of a layer's forward saved {seen} "
                               f"tensors for backward where its first run saved {len(slots)}; its forward must do the "
                               "same operations given the same inputs and random state")


    def _check_inputs(self, leaves: Sequence[torch.Tensor], when: str) -> None:
        changed = next((_leaf_name(self.template, i) for i, (t, v) in enumerate(zip(leaves, self.versions))
                        if t._version != v), None)
        how = "changed in place"
        if changed is None and self.opaque:  # the same tensors, at the same versions, where they were
            now = {path: t for path, t, _ in _opaque_tensors(self.template)}
            changed = next((path for path, t, v in self.opaque if now.get(path) is not t or t._version != v), None)
            how = "changed in place or replaced"
        if changed is not None:
            raise RuntimeError(
                f"activation policy {self.policy!r} of {self.label}: its input {changed} was {how} {when}; the "
                "re-run would read the changed values (wrong gradients). Pass the layer a copy, or give it the "
                "policy 'offload' or 'none'")


class _Fp8State:
    """The delayed-scaling state (amax histories, scales) of a layer's zbpp FP8 slots as its F
    found it. The re-run casts with it inside the block, whose exit puts back the slots' state of
    now: the re-run casts as F did (not with the scales F moved) and moves no slot twice."""

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)
        self.at_f = {id(m): (m, m.amax_history.clone(), m.scale.clone(), m.casts) for m in self._slots(module)}
        self.now: list[tuple[ScalingMeta, torch.Tensor, torch.Tensor, int]] = []

    @staticmethod
    def _slots(module: nn.Module) -> list[ScalingMeta]:
        return [meta for m in module.modules() if isinstance(m, DelayedWgradModule) for meta in m.fp8_meta.values()]

    def __enter__(self) -> None:
        module = self.module()
        for meta in self._slots(module) if module is not None else []:
            self.now.append((meta, meta.amax_history, meta.scale, meta.casts))
            # a slot that F made (the layer's first FP8 forward) was fresh then
            _, history, scale, casts = self.at_f.get(id(meta), (meta, torch.zeros_like(meta.amax_history),
                                                                torch.ones_like(meta.scale), 0))
            meta.amax_history, meta.scale, meta.casts = history, scale, casts  # the re-run runs once

    def __exit__(self, *exc: Any) -> None:
        for meta, history, scale, casts in self.now:
            meta.amax_history, meta.scale, meta.casts = history, scale, casts
        self.now, self.at_f = [], {}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


@contextlib.contextmanager
def _buffers_at_f(buffers: Sequence[tuple[nn.Module, str, torch.Tensor, int, torch.Tensor | None]]) -> Iterator[None]:
    """The buffers F changed, as F found them, for the re-run; the buffers of now after it (running
    statistics move once per forward, not again in the re-run)."""
    now = [(m, n, m._buffers.get(n)) for m, n, _, _, copy in buffers if copy is not None]
    for m, n, _, _, copy in buffers:
        if copy is not None:
            m._buffers[n] = copy
    try:
        yield
    finally:
        for m, n, b in now:
            m._buffers[n] = b


class _StopRecompute(Exception):
    """Ends a re-run once every saved tensor still referenced is filled."""


def _unpack(s: _Saved) -> torch.Tensor:
    frame = s.frame
    if frame is not None:  # the first unpack of the layer's tensors in this microbatch
        frame.recompute()
    if s.packed is None:
        raise RuntimeError("zbpp activation policy: a saved tensor was not produced by the re-run (a bug)")
    return s.unpack(s.packed)


_observers: list[Callable[[torch.Tensor], None]] = []  # the measurement's: told of what a frame holds


def _held(t: torch.Tensor) -> torch.Tensor:
    for see in _observers:
        see(t)
    return t


def _no_unpack(_: Any) -> torch.Tensor:
    raise RuntimeError("zbpp activation policy: the graph of a re-run forward is not differentiated")


def _identity(t: Any) -> Any:
    return t


class _GemmRecorder(TorchFunctionMode):
    """Selective F: run each weight GEMM, keep its input and output storages (and the output)."""

    depth = 0  # > 0 while a recorded GEMM runs (its own saves are kept, never re-run)

    def __init__(self, frame: _Frame) -> None:
        super().__init__()
        self.frame = frame

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        x = _weight_gemm_input(func, args)
        if x is None:
            return func(*args, **kwargs)
        _GemmRecorder.depth += 1
        try:
            out = func(*args, **kwargs)
        finally:
            _GemmRecorder.depth -= 1
        self.frame.keep_ptrs.update((x.untyped_storage().data_ptr(), out.untyped_storage().data_ptr()))
        # with its version: a later in-place op (OLMo's clip_qkv clamp_) changes what is kept
        self.frame.gemm_outputs.append((len(self.frame.slots), (_held(out.detach()), out._version)))
        return out


class _GemmReplay(TorchFunctionMode):
    """Selective re-run: each weight GEMM returns the output its first run kept, or runs again
    where that output was changed in place after it."""

    def __init__(self, frame: _Frame) -> None:
        super().__init__()
        self.outputs = list(frame.gemm_outputs)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if _weight_gemm_input(func, args) is None:
            return func(*args, **(kwargs or {}))
        if not self.outputs:  # past the last kept output (the re-run normally stops before)
            return func(*args, **(kwargs or {}))
        out, version = self.outputs.pop(0)
        if out._version != version:  # changed in place after the GEMM: no longer its result
            _GemmRecorder.depth += 1  # its own saves are F's kept ones, as in F: not the re-run's to fill
            try:
                return func(*args, **(kwargs or {}))
            finally:
                _GemmRecorder.depth -= 1
        return out.detach().requires_grad_(torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args))


_GEMMS_XW = {torch.nn.functional.linear, torch.mm, torch.matmul, torch.Tensor.mm, torch.Tensor.matmul,
             torch.Tensor.__matmul__}


def _weight_gemm_input(func: Any, args: tuple) -> torch.Tensor | None:
    """The activation operand of a GEMM whose other operand is a weight (`nn.Parameter`), else None."""
    if func in _GEMMS_XW and len(args) >= 2:
        x, w = args[0], args[1]
    elif func in (torch.addmm, torch.Tensor.addmm) and len(args) >= 3:
        x, w = args[1], args[2]
    else:
        return None
    if isinstance(w, nn.Parameter) and isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter):
        return x
    return None


# -- offload ----------------------------------------------------------------------------------------
class _Offloaded:
    """One saved tensor of an offloaded layer: the host copy of its storage (shared by the layer's
    tensors on that storage, copied once) and where in it the tensor lies."""

    __slots__ = ("host", "device", "dtype", "size", "stride", "offset", "event", "group", "done", "__weakref__")

    def __init__(self, host: torch.Tensor, t: torch.Tensor, group: "_OffloadGroup") -> None:
        self.host, self.device, self.group = host, t.device, group
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        self.event: Any = None
        self.done = False  # read by a node of B that W will not run: never unpacked again
        group.items.append(weakref.ref(self))

    def _view(self, buffer: torch.Tensor) -> torch.Tensor:
        return torch.empty((0,), dtype=self.dtype, device=buffer.device).set_(
            buffer.untyped_storage(), self.offset, self.size, self.stride)

    def fetch(self) -> torch.Tensor:
        """Start the copy of its storage back (on the side stream, once per storage of the group);
        the tensor, valid on the compute stream once it waits on `event`."""
        if self.device.type != "cuda":
            return self._view(self.host)
        buffer, self.event = self.group.storage_back(self.host, self.device)
        return self._view(buffer)


class _OffloadGroup:
    """The offloaded tensors of one forward of one layer, their storages' host copies, and the
    group that ran before it."""

    last: "weakref.ref[_OffloadGroup] | None" = None  # the latest group's forward
    #: per microbatch key whose B has not begun, in forward order: its last offloaded layer (the
    #: first its B differentiates; nothing before it in that B would prefetch it)
    heads: "dict[Any, weakref.ref[_OffloadGroup]]" = {}

    def __init__(self) -> None:
        self.items: list[weakref.ref] = []
        # (device storage pointer, version) -> (the storage, weakly; its host copy), during F
        self.hosts: dict[tuple[int, int], tuple[StorageWeakRef, torch.Tensor]] = {}
        self.key = current_microbatch()  # the runtime's (stage, microbatch) of this F, or None
        prev = _OffloadGroup.last() if _OffloadGroup.last is not None else None
        # the layer before, in the same microbatch's forward: its B comes right after this one's
        self.prev = weakref.ref(prev) if prev is not None and prev.key == self.key else None
        self.fetched: dict[int, torch.Tensor] = {}
        # id(host copy) -> (its device buffer, the copy's event): a storage shared by several saved
        # tensors comes back once
        self.back: dict[int, tuple[torch.Tensor, Any]] = {}
        self.started = False
        _OffloadGroup.last = weakref.ref(self)
        _OffloadGroup.heads.pop(self.key, None)  # re-inserted last: forward order
        _OffloadGroup.heads[self.key] = weakref.ref(self)

    def unpacking(self) -> None:
        """One of its tensors is needed by B: prefetch what that B needs next (the layer before,
        or, on the microbatch's first layer, the next microbatch's first-needed layer, whose B
        usually follows: its copy then overlaps the tasks between the two B's)."""
        heads = _OffloadGroup.heads
        head = heads.get(self.key)
        if head is not None and head() is self:
            del heads[self.key]  # this microbatch's B has begun
        before = self.prev() if self.prev is not None else None
        if before is None:
            while heads and before is None:
                key = next(iter(heads))
                before = heads[key]()
                if before is None:
                    del heads[key]  # freed (an evaluation forward, a dropped step)
        if before is not None and before is not self:
            before.prefetch()

    def prefetch(self) -> None:
        if self.started:
            return
        self.started = True
        for ref in self.items:
            item = ref()
            if item is not None and item.device.type == "cuda":
                self.fetched[id(item)] = item.fetch()

    def done_with(self, item: _Offloaded) -> None:
        """`item` will not be unpacked again: once no other tensor of its storage will be, the
        device copy goes when its last reader lets go (B frees what only B reads, W keeps the rest)."""
        item.done = True
        host = item.host
        for ref in self.items:
            other = ref()
            if other is not None and other.host is host and not other.done:
                return
        self.back.pop(id(host), None)

    def bytes_for_w(self) -> int:
        """Bytes of the storages a tensor of which W may still unpack (brought back to the device
        in B, or in W itself), each once."""
        hosts = {}
        for ref in self.items:
            item = ref()
            if item is not None and not item.done:
                hosts[id(item.host)] = item.host.numel()
        return sum(hosts.values())

    def storage_back(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        """The device copy of `host` (started on the side stream the first time) and its event."""
        known = self.back.get(id(host))
        if known is not None:
            return known
        main, side = torch.cuda.current_stream(device), _side_stream(device)
        buffer = torch.empty(host.shape, dtype=torch.uint8, device=device)  # on the compute stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            buffer.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        buffer.record_stream(side)
        self.back[id(host)] = (buffer, event)
        return buffer, event


_offloaded_bytes = [0]  # every byte offload copied to the host so far (read by the measurement)


def _host_copy(t: torch.Tensor, group: _OffloadGroup) -> torch.Tensor:
    """The host copy (bytes) of `t`'s storage, made once per layer forward."""
    st = t.untyped_storage()
    key = (st.data_ptr(), t._version)  # changed in place since: a new copy
    known = group.hosts.get(key)
    if known is not None and not known[0].expired():  # else the memory now holds another storage
        return known[1]
    src = torch.empty((0,), dtype=torch.uint8, device=t.device).set_(st)
    _offloaded_bytes[0] += src.numel()
    if t.device.type != "cuda":
        host = src.clone()  # CPU: the mechanism, as a copy
    else:
        host = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
        main, side = torch.cuda.current_stream(t.device), _side_stream(t.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            host.copy_(src, non_blocking=True)
        src.record_stream(side)  # the device memory is reused only after the copy
    group.hosts[key] = (StorageWeakRef(st), host)
    return host


def _offload_forward(fn: Callable[..., Any], params: set[int], args: tuple, kwargs: dict) -> Any:
    upcoming = rank_next_backward()
    if upcoming is not None and upcoming == current_microbatch():
        return fn(*args, **kwargs)
    group = _OffloadGroup()
    head = _OffloadGroup.heads.get(upcoming) if upcoming is not None else None
    first = head() if head is not None else None
    if first is not None:
        first.prefetch()  # its copy back overlaps this forward

    def pack(t: torch.Tensor) -> Any:
        if t.untyped_storage().data_ptr() in params:
            return t  # a parameter stays where it is
        return _Offloaded(_host_copy(t, group), t, group)

    def unpack(x: Any) -> torch.Tensor:
        if not isinstance(x, _Offloaded):
            return x
        g = x.group
        g.unpacking()
        out = g.fetched.pop(id(x), None)
        if out is None:
            out = x.fetch()
        if x.event is not None:
            torch.cuda.current_stream(x.device).wait_event(x.event)
        if unpacked_for_b_only():
            g.done_with(x)
        return out

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return fn(*args, **kwargs)
    finally:
        group.hosts = {}


_SIDE: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    s = _SIDE.get(device)
    if s is None:
        s = _SIDE[device] = torch.cuda.Stream(device)
    return s


# -- measurement -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActivationCost:
    """What one layer's activations cost under one policy, for one input (bytes and FLOPs).

    ``kept_f_to_b``: bytes of the storages that the tensors saved for backward keep alive from the
    end of F to B (parameters and the layer's inputs that need no gradient, such as masks and
    rotary tables shared by every layer, not counted); ``kept_b_to_w``: of those, and of what a
    re-run in B produced, the bytes still kept after B for W (zbpp's split B: only what W reads);
    ``host_bytes``: bytes copied to host memory (offload); ``forward_flops``: F's FLOPs;
    ``recompute_flops``: the FLOPs B and W do beyond what they do without a policy (the re-run);
    ``b_transient``: the most bytes B holds at once above ``kept_f_to_b`` while it runs (the
    re-run's or reloaded saved tensors and every tensor B's ops make, counted by storage after each
    op while alive; the output gradient handed in not counted)."""

    policy: str
    kept_f_to_b: int
    kept_b_to_w: int
    host_bytes: int
    forward_flops: int
    recompute_flops: int
    b_transient: int = 0


def measure_activation_policies(layer: nn.Module, *args: Any, policies: Sequence[str] = POLICIES,
                                **kwargs: Any) -> dict[str, ActivationCost]:
    """Run ``layer(*args, **kwargs)`` once per policy with zbpp's B/W split and measure its costs.

    Floating-point tensors of `args` are the layer's differentiable inputs (B computes their
    gradient); `kwargs` (masks, rotary tables) are passed as they are. Bytes are counted with saved-tensor hooks
    (storages held by autograd, each once) and FLOPs with ``torch.utils.flop_counter`` (matrix
    products only: an elementwise re-run counts 0), so a CPU run gives the figures of any device. The
    layer's own policy, gradients, buffers, zbpp FP8 scaling state and the random generators are as
    found afterwards. ``none`` measures the layer as it runs, with the
    policies of layers inside it; other policies refuse such a layer (policies may not nest). The planner needs, per layer and policy, these bytes
    (F->B, B->W) for its memory model and ``recompute_flops`` (or the host copy time of
    ``host_bytes`` beyond the gap the schedule leaves) added to B's time.

    >>> import torch
    >>> from torch import nn
    >>> torch.manual_seed(0) and None
    >>> mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).double()
    >>> x = torch.randn(32, 64, dtype=torch.float64)
    >>> costs = measure_activation_policies(mlp, x)
    >>> [(p, c.kept_f_to_b, c.kept_b_to_w, c.host_bytes, c.recompute_flops) for p, c in costs.items()]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('none', 147456, 81920, 0, 0), ('full', 16384, 81920, 0, 1048576),
     ('selective', 147456, 81920, 0, 0), ('offload', 0, 81920, 147456, 0)]
    """
    from ..runtime._autograd_split import SavedBoxes, backward_input  # the runtime's own B/W split

    _check_module(layer, "measure_activation_policies")
    if isinstance(policies, str):
        raise TypeError(f"measure_activation_policies: policies must be a sequence of policy names ([{policies!r}]), "
                        f"got the str {policies!r}")
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"activation policy {p!r}: choose one of {', '.join(POLICIES)}")
    inside = {n: p for n, p in activation_policies(layer).items() if n}
    if inside and any(p != "none" for p in policies):
        held = ", ".join(f"{n!r} ({p})" for n, p in inside.items())
        raise ValueError(f"measure_activation_policies: {type(layer).__name__} holds {held}, and policies may not "
                         "nest: measure the inner layers, or give them the policy 'none' first")
    before = {k: layer.__dict__[k] for k in ("forward", _ATTR, _CHANGES) if k in layer.__dict__}
    out: dict[str, ActivationCost] = {}
    base: int | None = None
    try:
        with _left_as_found(layer, (args, kwargs)):
            for policy in ("none", *[p for p in policies if p != "none"]):
                _set(layer, policy)
                cost, bw = _measure_once(layer, policy, args, kwargs, SavedBoxes, backward_input)
                if base is None:
                    base = bw
                if policy in policies:
                    out[policy] = ActivationCost(policy, *cost[:4], bw - base, cost[4])
    finally:
        _set(layer, "none")
        layer.__dict__.pop("forward", None)
        layer.__dict__.update(before)  # as found: its own forward, its policy under its name
    return out


@contextlib.contextmanager
def _left_as_found(layer: nn.Module, inputs: Any = ()) -> Iterator[None]:
    """The layer's gradients (``.grad``; a fused layer's ``main_grad``), buffers, pending
    delayed-wgrad jobs, zbpp FP8 scaling state and the random generators (those of the devices of
    its tensors and of `inputs`) as they are now, after the block: the measurement's forwards and
    backwards are no training step's (the W jobs they file, holding their tensors, are dropped; a
    dropout's draws and the amaxes cast are not the training's)."""
    with _random_state_kept([*layer.parameters(), *layer.buffers(), *flatten(inputs)[0]]), \
            _fp8_state_kept(layer), _grads_buffers_kept(layer):
        yield


@contextlib.contextmanager
def _random_state_kept(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """The CPU generator and those of the accelerators `tensors` are on, restored after the block."""
    devices = {t.device for t in tensors if t.device.type != "cpu"}
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[], device_type="cuda"))  # the CPU generator
        for kind in {d.type for d in devices}:
            stack.enter_context(torch.random.fork_rng(devices=[d for d in devices if d.type == kind], device_type=kind))
        yield


@contextlib.contextmanager
def _fp8_state_kept(layer: nn.Module) -> Iterator[None]:
    """The FP8 slots of `layer`'s zbpp layers (amax histories, scales, which slots exist and which
    are shared) and the thread's last input cast as now, after the block; kept weight casts dropped."""
    if not any(isinstance(m, DelayedWgradModule) for m in layer.modules()):  # no FP8 slots (nor state_dict walk)
        with last_cast_kept():
            yield
        return
    states = {k: {**v, "amax_history": v["amax_history"].clone(), "scale": v["scale"].clone()}
              for k, v in scaling_states(layer).items()}
    with last_cast_kept():
        try:
            yield
        finally:
            restore_scaling_states(layer, states)


@contextlib.contextmanager
def _grads_buffers_kept(layer: nn.Module) -> Iterator[None]:
    """`_left_as_found`'s gradients, buffers and delayed-wgrad jobs, and which forwards the
    delayed-wgrad layers' step ran (in FP8 or not: what `get_backward_dw_params` lists)."""
    params = list(layer.parameters())
    # the caller's pending jobs set aside, not left in the stores: the measurement's W would run
    # them (a key it reuses) and its discard drop them all; back exactly, keys in order, at the end
    delayed = [(m, m._wgrad_store.set_aside(), m._auto_keys, m._forwards_in_step, m._bias_grad_deferred)
               for m in layer.modules() if isinstance(m, DelayedWgradModule)]
    # likewise Transformer Engine's FIFO queues: backward_dw() pops the oldest, the caller's
    fifo = _te_wgrad_stores(layer)
    for store, pending in fifo:
        store.context = type(pending)()
    grads = [(p, p.grad, getattr(p, "main_grad", None), getattr(p, "grad_added_to_main_grad", None)) for p in params]
    buffers = [(m, n, b, b.clone()) for m in layer.modules() for n, b in m._buffers.items() if b is not None]
    for p, _, main, _ in grads:
        p.grad = None
        if main is not None:
            p.main_grad = torch.zeros_like(main)
    try:
        yield
    finally:
        for p, grad, main, added in grads:
            p.grad = grad
            if main is not None:
                p.main_grad = main
            if added is not None:
                p.grad_added_to_main_grad = added
            elif hasattr(p, "grad_added_to_main_grad"):
                del p.grad_added_to_main_grad
        with torch.no_grad():
            for m, n, b, copy in buffers:
                m._buffers[n] = b
                b.copy_(copy)
        for store, pending in fifo:
            store.context = pending  # the measurement's own jobs go with the queue it filed them in
        for m, jobs, auto_keys, ran, deferred in delayed:
            m._wgrad_store.put_back(jobs)  # the measurement's own jobs (and their tensors) go
            m._auto_keys = auto_keys
            m._forwards_in_step = ran
            if m._bias_grad_deferred != deferred:
                m._bias_grad_deferred = deferred
                m._sync_param_flags()


def _te_wgrad_stores(layer: nn.Module) -> list[tuple[Any, queue.Queue]]:
    """(store, its queue) of each Transformer Engine ``WeightGradStore`` in `layer`: its pending
    wgrad jobs live in ``context``, a `queue.Queue` (None while the module does not delay)."""
    stores = {}
    for m in layer.modules():
        store = getattr(m, "wgrad_store", None)
        if not isinstance(m, DelayedWgradModule) and isinstance(getattr(store, "context", None), queue.Queue):
            stores[id(store)] = (store, store.context)  # one store may serve several modules
    return list(stores.values())


def _measure_once(layer: nn.Module, policy: str, args: tuple, kwargs: dict, boxes: Any,
                  backward_input: Any) -> tuple[tuple[int, int, int, int, int], int]:
    leaves, template = flatten((args, kwargs))
    n_args = len(flatten(args)[0])  # positional tensors first: the differentiable ones
    grad_leaves = [t.detach().requires_grad_() if i < n_args and t.is_floating_point() else t
                   for i, t in enumerate(leaves)]
    targets = [t for t in grad_leaves if t.requires_grad]
    free = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    free.update(t.untyped_storage().data_ptr() for t in grad_leaves if not t.requires_grad)
    seen: dict[int, tuple[StorageWeakRef, int]] = {}

    def alive() -> int:
        return sum(n for ref, n in seen.values() if not ref.expired())

    host0 = _offloaded_bytes[0]
    with boxes() as saved:
        outer_pack, outer_unpack = current_saved_tensors_hooks()

        def record(t: torch.Tensor) -> None:
            st = t.untyped_storage()
            if st.data_ptr() not in free:
                ref = StorageWeakRef(st)
                seen.setdefault(ref.cdata, (ref, st.nbytes()))

        def pack(t: torch.Tensor) -> Any:
            record(t)
            return outer_pack(t)

        # each differentiable input enters through a copy, so that only autograd keeps it
        a, k = rebuild(template, [t.clone() if t.requires_grad else t for t in grad_leaves])
        _observers.append(record)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack), _Flops() as fc:
                y = layer(*a, **k)
        finally:
            _observers.remove(record)
        del a, k
        forward_flops = fc.get_total_flops()
    # offload's group of this forward: what W will unpack comes back to the device in B (or W)
    group = _OffloadGroup.last() if policy == "offload" and _OffloadGroup.last is not None else None
    ys = flatten(y)[0]
    roots = [t for t in ys if t.requires_grad]
    del y, ys
    grads = [torch.ones_like(t) for t in roots]
    for t in roots:  # as the runtime does once an output is sent: only its autograd node stays
        if t.grad_fn is not None and t._base is None:
            t.data = torch.empty((1,), dtype=t.dtype, device=t.device)
    f_to_b = alive()
    with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack), _Flops() as fb:
        with _PeakBytes(seen) as peak:
            held = backward_input(roots, grads, targets, None, saved)
        del roots, grads, saved
        b_to_w = alive() + (group.bytes_for_w() if group is not None else 0)
        if held is not None:
            held.run()
    return (f_to_b, b_to_w, _offloaded_bytes[0] - host0, forward_flops, max(0, peak.top - f_to_b)), fb.get_total_flops()


class _PeakBytes(torch_dispatch_mode()):  # type: ignore[misc]
    """The most bytes alive at once while ops run under it: the storages in `tracked` (saved
    tensors, ``{key: (weak ref, bytes)}``, filled as they are saved, `key` naming a tensor's
    storage as they do) and those the ops return, each storage once, checked after every op (what
    an op frees inside itself is not seen; a result sharing an argument's storage, a view or an
    in-place op, is no new storage)."""

    def __init__(self, tracked: dict[Any, tuple[StorageWeakRef, int]],
                 key: Callable[[torch.Tensor], Any] = lambda t: StorageWeakRef(t.untyped_storage()).cdata) -> None:
        super().__init__()
        self.tracked, self.key = tracked, key
        self.made: dict[Any, tuple[StorageWeakRef, int]] = {}
        self.top = self._now()

    def _now(self) -> int:
        total = sum(n for ref, n in self.tracked.values() if not ref.expired())
        for k, (ref, n) in self.made.items():
            same = self.tracked.get(k)
            if not ref.expired() and (same is None or same[0].expired()):  # else counted as tracked
                total += n
        return total

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in _tensors_in([args, list((kwargs or {}).values())])}
        for t in _tensors_in(out):
            st = t.untyped_storage()
            if st.data_ptr() in given:  # a view or an in-place result: nothing new (a parameter's view, say)
                continue
            k = self.key(t)
            known = self.made.get(k)
            if known is None or known[0].expired():  # a freed storage's address may come back
                self.made[k] = (StorageWeakRef(st), st.nbytes())
        self.top = max(self.top, self._now())
        return out


def _tensors_in(out: Any) -> Iterator[torch.Tensor]:
    """The tensors an op returned (one, or a tuple or list of them, nested)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for x in out:
            yield from _tensors_in(x)


class _Flops(torch_dispatch_mode()):  # type: ignore[misc]
    """Counts FLOPs as ``torch.utils.flop_counter.FlopCounterMode`` does, without its module tracker
    (whose gradient hooks on a re-run's tensors would keep them alive and skew the byte counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.total += _counted(count, func, args, kwargs, out)
        return out

    def get_total_flops(self) -> int:
        return self.total


def _counted(count: Callable[..., int], func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """``count``'s FLOPs of one call. Older torch's attention counters refuse grouped-query
    key/value heads (fewer than the query's): those are counted as the kernel runs them, with the
    key/value heads repeated up to the query's ([batch, heads, seq, dim] layout of SDPA's ops)."""
    try:
        return count(*args, **kwargs, out_val=out)
    except AssertionError:
        if "_scaled_dot_product" not in str(func._overloadpacket):
            raise
        heads = max(a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4)
        wide = tuple(torch.empty((a.shape[0], heads, *a.shape[2:]), device="meta", dtype=a.dtype)
                     if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1] != heads else a for a in args)
        return count(*wide, **kwargs, out_val=out)


# -- helpers ----------------------------------------------------------------------------------------
def _input_nodes(template: Spec) -> Iterator[tuple[str, Any]]:
    """Where each value of a layer's ``(args, kwargs)`` lies (``argument 0[1].mask``, ``keyword
    'cache'``) and its `zbpp.runtime.tree` node: a tensor's ("T", i), any other value's ("V", value)."""
    def walk(node: Any, path: str) -> Iterator[tuple[str, Any]]:
        tag, body = node
        if tag in ("T", "V"):
            yield path, node
        elif tag == "dict":
            for k, child in body:
                yield from walk(child, f"{path}[{k!r}]")
        elif tag == "namedtuple":
            for field, child in zip(body[0]._fields, body[1]):
                yield from walk(child, f"{path}.{field}")
        elif tag == "rep":
            yield from walk(body, path)
        else:
            for n, child in enumerate(body):
                yield from walk(child, f"{path}[{n}]")

    args, kwargs = template.node[1]
    for n, child in enumerate(args[1]):
        yield from walk(child, f"argument {n}")
    for k, child in kwargs[1]:
        yield from walk(child, f"keyword {k!r}")


def _leaf_name(template: Spec, i: int) -> str:
    """Where tensor leaf `i` of a layer's ``(args, kwargs)`` lies: ``argument 0``, ``keyword 'mask'[1]``."""
    return next((path for path, node in _input_nodes(template) if node == ("T", i)), f"tensor {i}")


_NO_TENSORS = (str, bytes, int, float, complex, bool, type, nn.Module, types.ModuleType, types.FunctionType,
               types.BuiltinFunctionType, types.MethodType, torch.dtype, torch.device)


def _opaque_tensors(template: Spec) -> list[tuple[str, torch.Tensor, int]]:
    """The tensors held inside a layer's non-container inputs (dataclasses, objects: their
    attributes, and the containers those hold), with where and at which version: the re-run gets
    those values as they are then, so they must be as F found them. Modules are skipped (their
    parameters and buffers are the layer's own business)."""
    out: list[tuple[str, torch.Tensor, int]] = []
    seen: set[int] = set()
    for path, (tag, value) in _input_nodes(template):
        if tag == "V":
            _tensors_within(value, path, out, seen)
    return out


def _tensors_within(o: Any, path: str, out: list[tuple[str, torch.Tensor, int]], seen: set[int]) -> None:
    # a module-level function: a recursive closure would hold `out` in a reference cycle
    if isinstance(o, torch.Tensor):
        out.append((path, o, o._version))
        return
    if o is None or isinstance(o, _NO_TENSORS) or id(o) in seen:
        return
    seen.add(id(o))
    if isinstance(o, dict):
        items: Any = ((f"[{k!r}]", v) for k, v in o.items())
    elif isinstance(o, (list, tuple, set, frozenset)):
        items = ((f"[{n}]", v) for n, v in enumerate(o))
    else:
        attrs = dict(getattr(o, "__dict__", {}))
        for cls in type(o).__mro__:  # __slots__ attributes live outside __dict__
            for name in [cls.__dict__["__slots__"]] if isinstance(cls.__dict__.get("__slots__"), str) \
                    else cls.__dict__.get("__slots__", ()):
                if name not in ("__dict__", "__weakref__") and hasattr(o, name):
                    attrs.setdefault(name, getattr(o, name))
        items = ((f".{k}", v) for k, v in attrs.items())
    for sub, v in items:
        _tensors_within(v, path + sub, out, seen)


def _rng_state(leaves: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    cuda = sorted({t.device.index or 0 for t in leaves if t.device.type == "cuda"})
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in cuda}


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]


@contextlib.contextmanager
def _restored(rng: tuple[torch.Tensor, dict[int, torch.Tensor]], autocast: list[tuple[str, bool, torch.dtype]]) -> Iterator[None]:
    """The forward's random-generator states and autocast settings (the caller's come back after)."""
    cpu, cuda = rng
    with torch.random.fork_rng(devices=list(cuda), device_type="cuda"), contextlib.ExitStack() as stack:
        torch.set_rng_state(cpu)
        for d, state in cuda.items():
            torch.cuda.set_rng_state(state, d)
        for device, enabled, dtype in autocast:
            if enabled or torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield
