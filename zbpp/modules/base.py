"""The delayed-wgrad protocol shared by every zbpp layer (docs/DESIGN.md, Transformer Engine style).

A layer built with ``delay_wgrad_compute=True`` computes only input gradients in its backward (B)
and files its weight-gradient jobs under the forward's microbatch key; ``backward_dw(key)`` (W)
runs them, adds the results into ``.grad`` (or ``main_grad``) and calls the hooks registered with
``register_wgrad_accumulation_and_reduce_hooks``. `is_delayed` and `supports_keys` let a runtime
treat zbpp layers and real Transformer Engine layers (FIFO ``backward_dw()`` only) alike.
"""

from __future__ import annotations

import copy
import inspect
import operator

from collections import OrderedDict
from typing import Callable, Hashable, NamedTuple, TypedDict

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._compat import disable_dynamo as _disable_dynamo
from .._compat import never_compiled as _never_compiled
from .._compat import set_grad_enabled as _set_grad_enabled

from ._activations import Activation
from ._fp8_weight_cache import Fp8WeightCache, check_first_microbatch, step_first_microbatch
from ._init import InitMethod, add_gemm_params, check_params_dtype, default_init
from ._layer_function import Fp8Slots, GemmCall, GradOut, LayerSpec, _Job, accumulate_grad
from ._layer_function import add_to_main_grad
from ._norm import make_norm_params
from ._shared_input import forget_last_cast
from .context import current_microbatch, forward_key, in_torch_checkpoint
from .fp8 import DelayedScaling, ScalingMeta, active_recipe
from .wgrad_store import AutoKey, WgradStore

__all__ = ["DelayedWgradModule", "LayerOptions", "is_delayed", "supports_keys"]


#: True only while torch.compile (dynamo) traces: it folds the call to a constant, so a layer's
#: forward can step out of the graph there at the cost of one cheap call in eager.
_tracing = torch.compiler.is_compiling


@_disable_dynamo
def _outside_graph(forward: Callable[..., torch.Tensor], module: nn.Module, *args: object) -> torch.Tensor:
    """``forward(module, *args)``, run eagerly even inside a compiled region.

    A layer's forward calls this (itself) while dynamo traces it: the graph breaks here, and the
    layer runs as in eager, with dynamo off for everything it calls. Traced, its autograd Function
    would have its backward compiled into the region's one backward node, and the microbatch key
    it reads at forward time would be guarded as a constant (one recompilation per microbatch);
    outside, its B files the weight-gradient job under the right key and W runs it.

    The graph breaks at the caller's call of the layer, which then runs eagerly: the layer's
    forward is `_never_compiled`, else dynamo would compile it as a frame of its own (a guard check
    per call, and a recompilation per input shape or layer class) only to break again here.
    """
    return forward(module, *args)


def _slot_names_of(gemm_names: tuple[tuple[str, str, str], ...]) -> tuple[tuple[str, str, str], ...]:
    return tuple((p + "input", p + "weight", p + "grad_output") for p, _, _ in gemm_names)


class LayerOptions(TypedDict, total=False):
    """The constructor keywords every zbpp layer takes (`DelayedWgradModule` owns them)."""

    delay_wgrad_compute: bool
    fuse_wgrad_accumulation: bool
    params_dtype: torch.dtype | None
    device: torch.device | str | None
    init_method: InitMethod | None


class _ParamSettings(NamedTuple):
    # how the constructor builds the parameters; dropped once they are built
    dtype: torch.dtype | None
    device: torch.device | str | None
    init: InitMethod


class ForwardCall(NamedTuple):
    """What one forward of a layer reads once, on the caller's thread, for all its GEMMs."""

    key: Hashable  # the microbatch key its wgrad jobs are filed under
    recipe: DelayedScaling | None  # the FP8 recipe, None outside fp8_autocast
    first_microbatch: bool | None  # the forward's is_first_microbatch


class DelayedWgradModule(nn.Module):
    """Base of `Linear`, `LayerNormLinear` and `LayerNormMLP`: the delayed-wgrad protocol.

    The constructor keywords every layer takes (`LayerOptions`):

    - ``delay_wgrad_compute`` (False): the backward computes only the input gradient and leaves
      the weight gradients to `backward_dw`;
    - ``fuse_wgrad_accumulation`` (False): weight gradients are added into ``weight.main_grad``
      (a float32 tensor the caller attaches) instead of ``weight.grad``;
    - ``params_dtype`` (None: torch's default dtype) and ``device``: of the parameters;
    - ``init_method`` (None: normal with std 0.023, Transformer Engine's default): fills each
      GEMM weight (biases start at zero, norm weights at one);

    Under ``torch.compile`` each call of a layer is a graph break (`_outside_graph`): the layer
    runs eagerly, so a compiled model still leaves its W to `backward_dw`; the code around it
    compiles (``fullgraph=True`` refuses a graph holding a layer).

    ``copy.copy`` of a layer shares its parameters, FP8 state and hooks (as torch's shallow copies
    do) but files its weight-gradient jobs apart: each one's `backward_dw` runs its own forwards'.
    ``copy.deepcopy`` shares nothing and leaves the pending jobs with the original.

    Subclasses declare their GEMMs with `_gemm_names` (weight and bias attribute names per GEMM),
    build their parameters with `_add_gemm_params` and `_add_norm_params`, call `_built` at the
    end of their constructor, and describe each forward with `_layer_spec` (run by
    ``_layer_function.run_layer``).

    >>> from zbpp.modules import Linear
    >>> Linear(2, 2, delay_wgrad_compute=True, params_dtype=torch.float64).weight.dtype
    torch.float64
    >>> Linear(2, 2, delay_wgrad=True)
    Traceback (most recent call last):
    TypeError: Linear: unknown keyword argument 'delay_wgrad'; the layers take delay_wgrad_compute, ...
    """

    #: per GEMM: (FP8 slot prefix, weight attribute, bias attribute)
    _gemm_names: tuple[tuple[str, str, str], ...] = (("", "weight", "bias"),)
    #: per GEMM: the names of its input, weight and output-gradient FP8 slots (from `_gemm_names`)
    _slot_names: tuple[tuple[str, str, str], ...] = _slot_names_of(_gemm_names)
    #: the first GEMM's weight is stored [in, out] (HF's Conv1D; see `delay_wgrad`)
    _weight_transposed: bool = False
    #: the parameters a forward reads, in the order `_forward_params` returns them
    _forward_param_names: tuple[str, ...] = ("weight", "bias")
    #: a forward called without ``is_first_microbatch`` (a swapped layer inside a model that does not
    #: pass it) keeps its FP8 weight casts as if it were passed, reading the microbatch index from
    #: the `Pipeline`'s key ``(stage, j)``: True for j == 0, False after (`step_first_microbatch`)
    keep_fp8_weight_casts: bool = False
    #: `backward_dw` adds a bf16/float32 weight gradient into an existing ``.grad`` inside its GEMM
    #: (one pass over ``.grad`` less per microbatch; rounded once, so not bit-identical to autograd)
    accumulate_wgrad_in_gemm: bool = False

    def __init__(
        self,
        *,
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: InitMethod | None = None,
        **unknown: object,
    ) -> None:
        cls = type(self).__name__
        if unknown:
            names = ", ".join(repr(k) for k in unknown)
            plural = "s" if len(unknown) > 1 else ""
            raise TypeError(
                f"{cls}: unknown keyword argument{plural} {names}; the layers take "
                f"{', '.join(LayerOptions.__annotations__)} besides their own"
            )
        super().__init__()
        self._param_settings: _ParamSettings | None = _ParamSettings(
            check_params_dtype(cls, params_dtype), device, init_method or default_init
        )
        self._init_protocol(delay_wgrad_compute, fuse_wgrad_accumulation)

    def _init_protocol(self, delay_wgrad_compute: bool, fuse_wgrad_accumulation: bool) -> None:
        """The layer's own state besides its parameters (also set up on a module that
        `zbpp.modules.delay_wgrad` turns into a zbpp layer in place)."""
        cls = type(self).__name__
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self._delay = bool(delay_wgrad_compute)
        self._wgrad_store: WgradStore = WgradStore(owner=cls)
        self._wgrad_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()
        self._auto_keys = 0  # how many forwards ran outside any microbatch() block
        # False once every forward of the step ran in FP8: there the bias gradients are computed
        # during B. One forward outside FP8 in a step leaves its bias gradient to its W.
        self._bias_grad_deferred = True
        self._forwards_in_step = False  # a forward ran since the last release_step_caches()
        self.fp8_meta: dict[str, ScalingMeta] = {}
        self._fp8_weight_casts: dict[str, Fp8WeightCache] = {}  # per GEMM weight attribute
        # per GEMM: the parameter names errors and gradients carry (built once, not per call)
        self._gemm_labels = tuple((f"{cls}.{w}", f"{cls}.{b}") for _, w, b in self._gemm_names)
        # per GEMM: its last GemmCall outside FP8, reused while its parameters stay the same
        self._plain_calls: list[GemmCall | None] = [None] * len(self._gemm_names)
        # per (GEMM, is_first_microbatch): its last FP8 GemmCall, reused while it still holds
        # (`_fp8_call_holds`)
        self._fp8_calls: dict[tuple[int, bool | None], GemmCall] = {}

    # -- parameters -------------------------------------------------------------------------
    def _add_gemm_params(
        self,
        weight_name: str,
        bias_name: str,
        shape: tuple[int, int],
        *,
        bias: bool,
        init: InitMethod | None = None,
    ) -> None:
        """Register one GEMM's weight [out, in] (filled by `init`, else ``init_method``) and
        bias [out] (zeros; None without `bias`) with the constructor's dtype and device."""
        dtype, device, default = self._param_settings
        add_gemm_params(self, weight_name, bias_name, shape, bias=bias, init=init or default,
                        dtype=dtype, device=device)

    def _add_norm_params(self, size: int, normalization: str) -> None:
        """Register the norm's ``layer_norm_weight`` (and, for LayerNorm, ``layer_norm_bias``)."""
        dtype, device, _ = self._param_settings
        make_norm_params(self, size, normalization, dtype=dtype, device=device)

    def _built(self) -> None:
        """End of a subclass constructor: mark the deferred parameters, drop the settings."""
        self._param_settings = None
        self._sync_param_flags()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # one C-level lookup of all of them (two or more names: itemgetter then returns a tuple)
        cls._read_forward_params = operator.itemgetter(*cls._forward_param_names)
        cls._slot_names = _slot_names_of(cls._gemm_names)

    def _forward_params(self) -> tuple[nn.Parameter | None, ...]:
        """The parameters `_forward_param_names` names (the very objects, None where one is
        registered as None), read from ``_parameters`` without ``nn.Module.__getattr__``."""
        try:
            return self._read_forward_params(self._parameters)
        except KeyError:  # one moved behind a property (torch.nn.utils.parametrize) or a hook
            return tuple(getattr(self, name) for name in self._forward_param_names)

    def _check_deferred_leaves(
        self, index: int, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        """Raise when GEMM `index`'s `weight` or `bias` (None: not deferred), whose gradient W
        computes, is a tensor computed in the forward.

        W adds into ``.grad`` of the very tensor the forward read: for one computed from other
        tensors (a parametrization, weight_norm's hook, ``torch.func.functional_call`` given
        computed tensors) nothing reads it, and they get nothing. Checked where a `GemmCall` is
        built, i.e. whenever the tensors differ from the last forward's.
        """
        for p, label in zip((weight, bias), self._gemm_labels[index]):
            if p is not None and p.requires_grad and not p.is_leaf:
                raise TypeError(
                    f"{label} is computed in the forward (by {type(p.grad_fn).__name__}, e.g. "
                    "torch.nn.utils.parametrize, weight_norm or torch.func.functional_call given "
                    "computed tensors), not a Parameter: with delay_wgrad_compute=True its "
                    "gradient would never reach the tensors it is computed from. Use "
                    "delay_wgrad_compute=False for this layer (or leave it out of delay_wgrad "
                    "with module_filter_fn)"
                )

    def _gemm_weights(self) -> list[nn.Parameter]:
        return [getattr(self, w) for _, w, _ in self._gemm_names]

    def _gemm_biases(self) -> list[nn.Parameter]:
        return [b for _, _, name in self._gemm_names if (b := getattr(self, name)) is not None]

    def _sync_param_flags(self) -> None:
        # skip_backward_post_hook marks exactly the parameters whose gradient is final only after
        # backward_dw(), i.e. exactly get_backward_dw_params().
        deferred = {id(p) for p in self._deferred_params()}
        for p in self._gemm_weights() + self._gemm_biases():
            p.skip_backward_post_hook = id(p) in deferred

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        # a GEMM Parameter set later (``layer.weight = ...``, ``load_state_dict(assign=True)``) is
        # a new object: it gets the flag too
        super().register_parameter(name, param)
        if any(name in names[1:] for names in self._gemm_names):
            self._resync_param_flags()

    def _apply(self, fn: Callable[..., object], recurse: bool = True) -> DelayedWgradModule:
        # ``to_empty`` from meta and swapping conversions (``.to``, ``.double()`` ...) make new
        # Parameter objects, or swap their Python attributes away: flag them again
        module = super()._apply(fn, recurse)
        self._resync_param_flags()
        return module

    def _resync_param_flags(self) -> None:
        # `_sync_param_flags` once built (a constructor, `delay_wgrad`, syncs at its end) and
        # while the GEMM weights are registered Parameters (weight_norm's hook form removes them)
        if self.__dict__.get("_param_settings", False) is None and all(
            w in self._parameters for _, w, _ in self._gemm_names
        ):
            self._sync_param_flags()

    def __copy__(self) -> DelayedWgradModule:
        # copy.copy shares what torch's shallow copies share (parameters, FP8 state, hooks) but
        # not the pending W jobs: each module's backward_dw runs what its own forwards filed
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._wgrad_store = copy.copy(self._wgrad_store)  # empty, named alike (its __getstate__)
        return new

    def __setstate__(self, state: dict) -> None:
        # copy.deepcopy and torch.load rebuild parameters without their Python attributes
        super().__setstate__(state)
        self.__dict__.setdefault("_forwards_in_step", False)  # pickled by an older zbpp
        self.__dict__.setdefault("_fp8_calls", {})  # likewise
        self._sync_param_flags()

    @property
    def delay_wgrad_compute(self) -> bool:
        """Whether the backward leaves the weight gradients to `backward_dw`."""
        return self._delay

    @delay_wgrad_compute.setter
    def delay_wgrad_compute(self, value: bool) -> None:
        if not value and len(self._wgrad_store):
            raise RuntimeError(
                f"{type(self).__name__}: cannot turn delay_wgrad_compute off with wgrads pending "
                f"for keys {self._wgrad_store.keys()!r}; run backward_dw() for them first"
            )
        self._delay = bool(value)
        self._plain_calls = [None] * len(self._gemm_names)  # rebuilt, so checked for W
        self._fp8_calls = {}
        self._sync_param_flags()

    # -- forward side -------------------------------------------------------------------------
    def _begin_forward(self, is_first_microbatch: bool | None = None) -> ForwardCall:
        """The key, FP8 recipe and weight-cast reuse of the forward starting now."""
        first = is_first_microbatch
        if first is None and self.keep_fp8_weight_casts:
            first = step_first_microbatch(current_microbatch())
        if first is not None and first is not True and first is not False:
            check_first_microbatch(type(self).__name__, first)  # raises: names what is accepted
        recipe = active_recipe()
        if recipe is not None and in_torch_checkpoint():
            self._refuse_torch_checkpoint()
        if (recipe is None or first is None) and self._fp8_weight_casts:
            for cache in self._fp8_weight_casts.values():  # nothing to reuse later: free them
                cache.clear()
        if self._delay:
            # get_backward_dw_params() describes the whole step: the runtime reads it after the
            # stage's last B, when an earlier forward outside FP8 may still owe W its bias gradient
            deferred = recipe is None or (self._forwards_in_step and self._bias_grad_deferred)
            self._forwards_in_step = True
            if deferred != self._bias_grad_deferred:
                self._bias_grad_deferred = deferred
                self._sync_param_flags()
        if not self._delay:  # nothing is filed: the key only names the call
            return ForwardCall(current_microbatch(), recipe, first)
        key = forward_key()
        if key is None:
            key = AutoKey(self._auto_keys)
            self._auto_keys += 1
        return ForwardCall(key, recipe, first)

    def _refuse_torch_checkpoint(self) -> None:
        layer = self._gemm_labels[0][0].rsplit(".", 1)[0]  # the class, or a swapped layer's path
        raise RuntimeError(
            f"{layer}: an FP8 forward (inside fp8_autocast) runs inside torch.utils.checkpoint, "
            "whose backward runs it again: outside fp8_autocast (the gradients of a forward "
            "without FP8) or stepping the FP8 scaling state a second time (casts unlike the "
            "forward's), so the gradients would not be the forward's. Give the layer zbpp's "
            "recompute policy instead (zbpp.models.recompute.apply_activation_policy(model, "
            "{name: 'full'})), which re-runs it with the forward's casts, or checkpoint it "
            "outside fp8_autocast"
        )

    def _slot(self, name: str, dtype: torch.dtype, recipe: DelayedScaling) -> ScalingMeta:
        device = self._gemm_weights()[0].device
        meta = self.fp8_meta.get(name)
        if meta is None or meta.dtype != dtype:
            meta = ScalingMeta(dtype, history_len=recipe.amax_history_len, device=device)
            self.fp8_meta[name] = meta
        elif meta.scale.device != device:  # the module moved (e.g. .cuda()) after an FP8 step
            with torch.inference_mode(False):  # kept across calls: see ScalingMeta
                meta.scale = meta.scale.to(device)
                meta.amax_history = meta.amax_history.to(device)
        return meta

    def _gemm_call(
        self,
        index: int,
        call: ForwardCall,
        weight: torch.nn.Parameter,
        bias: torch.nn.Parameter | None,
    ) -> GemmCall:
        """GEMM `index` of this forward (`weight` and `bias`: its parameters, read once)."""
        recipe = call.recipe
        if recipe is None:
            return self._plain_call(index, weight, bias)
        key = (index, call.first_microbatch)
        cached = self._fp8_calls.get(key)
        if cached is not None and self._fp8_call_holds(cached, index, weight, bias, recipe):
            return cached
        if self._delay:  # in FP8 the biases are autograd inputs: their graph runs
            self._check_deferred_leaves(index, weight, None)
        _, weight_name, _ = self._gemm_names[index]
        cache = self._fp8_weight_casts.get(weight_name)
        if cache is None:
            cache = self._fp8_weight_casts[weight_name] = Fp8WeightCache()
        input_name, weight_slot_name, grad_name = self._slot_names[index]
        fp8 = Fp8Slots(
            recipe,
            self._slot(input_name, recipe.fwd_dtype, recipe),
            self._slot(weight_slot_name, recipe.fwd_dtype, recipe),
            self._slot(grad_name, recipe.bwd_dtype, recipe),
            cache,
            call.first_microbatch,
        )
        weight_label, bias_label = self._gemm_labels[index]
        gemm = GemmCall(weight, bias, weight_label, bias_label, self.fuse_wgrad_accumulation, fp8,
                        index == 0 and self._weight_transposed)
        self._fp8_calls[key] = gemm
        return gemm

    def _fp8_call_holds(
        self, gemm: GemmCall, index: int, weight: torch.nn.Parameter,
        bias: torch.nn.Parameter | None, recipe: DelayedScaling,
    ) -> bool:
        """Whether `_gemm_call` would build `gemm` again: the same parameters (so, as outside FP8,
        the same `_check_deferred_leaves` answer), recipe object, settings and slots, each slot
        still where `_slot` leaves it (not a freshly made one, not to be moved). (The weight
        caches are made once per weight and never replaced.)"""
        fp8 = gemm.fp8
        if (gemm.weight is not weight or gemm.bias is not bias or fp8.recipe is not recipe
                or gemm.fuse_wgrad_accumulation != self.fuse_wgrad_accumulation):
            return False
        meta = self.fp8_meta
        input_name, weight_slot_name, grad_name = self._slot_names[index]
        if (meta.get(input_name) is not fp8.input or meta.get(weight_slot_name) is not fp8.weight
                or meta.get(grad_name) is not fp8.grad_output):
            return False
        device = weight.device if index == 0 else self._gemm_weights()[0].device
        return (fp8.input.scale.device == device and fp8.weight.scale.device == device
                and fp8.grad_output.scale.device == device)

    def _plain_call(
        self, index: int, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None
    ) -> GemmCall:
        # outside FP8 a GemmCall changes only with the parameters or fuse_wgrad_accumulation
        call = self._plain_calls[index]
        fuse = self.fuse_wgrad_accumulation
        if (call is None or call.weight is not weight or call.bias is not bias
                or call.fuse_wgrad_accumulation != fuse):
            if self._delay:
                self._check_deferred_leaves(index, weight, bias)
            weight_label, bias_label = self._gemm_labels[index]
            call = GemmCall(weight, bias, weight_label, bias_label, fuse, None,
                            index == 0 and self._weight_transposed)
            self._plain_calls[index] = call
        return call

    def _layer_spec(
        self,
        call: ForwardCall,
        fc1: GemmCall,
        fc2: GemmCall | None = None,
        normalization: str | None = None,
        eps: float = 0.0,
        act: Activation | None = None,
    ) -> LayerSpec:
        store = self._wgrad_store if self._delay else None
        return LayerSpec(fc1, fc2, normalization, eps, act, store, call.key, call.recipe)

    def release_step_caches(self) -> None:
        """Free the FP8 weight casts kept for the step's later microbatches (``is_first_microbatch``)
        and the last input cast held for `Linear`s that share it.

        `zbpp.Pipeline` calls it after every step: the next step casts afresh anyway (the
        weights changed), and a step replayed from CUDA graphs reads the casts its graphs made,
        never these. It also ends the step that `get_backward_dw_params` describes. Call it yourself after a step's last microbatch when you drive the layer
        by hand, to give the casts' memory (two bytes per weight element) back before the
        optimizer step.

        >>> import torch
        >>> from zbpp.modules import DelayedScaling, Linear, fp8_autocast
        >>> layer = Linear(16, 16)
        >>> with fp8_autocast(fp8_recipe=DelayedScaling()):
        ...     _ = layer(torch.ones(16, 16), is_first_microbatch=True)
        >>> layer._fp8_weight_casts["weight"].kept, layer.release_step_caches()
        (True, None)
        >>> layer._fp8_weight_casts["weight"].kept
        False
        """
        for cache in self._fp8_weight_casts.values():
            cache.clear()
        self._forwards_in_step = False  # the next forward starts a step (`get_backward_dw_params`)
        forget_last_cast()  # an input cast held for Linears that share it (`_shared_input`)

    # -- the protocol -------------------------------------------------------------------------
    def backward_dw(self, key: Hashable | None = None) -> None:
        """Compute the pending weight gradients of microbatch `key` (the oldest when None).

        Runs every wgrad job filed under the key (two when the module ran twice in that forward),
        adds the weight gradients into ``.grad`` (accumulating) or, with
        ``fuse_wgrad_accumulation``, into ``main_grad``; adds a bias gradient only where the job
        produced one (in FP8 the bias gradient was already computed during B); then calls each
        hook registered with `register_wgrad_accumulation_and_reduce_hooks` once, without
        arguments. A no-op when the module does not delay and nothing is pending (a forward that
        ran while it delayed files its job at B even if ``delay_wgrad_compute`` was turned off
        since: that job is computed), or when every parameter it defers is frozen
        (``requires_grad=False``: B filed nothing); raises `WgradStoreError` when nothing (or
        nothing for `key`) is pending.

        >>> import torch
        >>> from zbpp.modules import Linear, microbatch
        >>> layer = Linear(4, 2, delay_wgrad_compute=True)
        >>> with microbatch(0):
        ...     layer(torch.ones(3, 4)).sum().backward()
        >>> layer.weight.grad is None, layer.pending_wgrad_keys()
        (True, [0])
        >>> layer.backward_dw(0)
        >>> layer.weight.grad.tolist()
        [[3.0, 3.0, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0]]
        """
        if not self._delay and not len(self._wgrad_store):
            return
        jobs = self._wgrad_store.take(key)
        if jobs is None:
            if self.get_backward_dw_params():  # something was owed: pop raises, naming what
                self._wgrad_store.pop(key)
            return
        grad_mode = torch.is_grad_enabled()
        _set_grad_enabled(False)  # torch.no_grad() without its per-call objects
        try:
            if len(jobs) == 1 and isinstance(jobs[0], _Job):  # one forward: no sums between jobs
                jobs[0].accumulate(self.accumulate_wgrad_in_gemm)
            else:  # several: summed per parameter first
                for name, param, grad, to_main in _summed_per_parameter(jobs):
                    if to_main:
                        add_to_main_grad(name, param, grad)
                    else:
                        accumulate_grad(param, grad)
        finally:
            _set_grad_enabled(grad_mode)
        if self._wgrad_hooks:
            for hook in list(self._wgrad_hooks.values()):
                hook()

    def pending_wgrad_keys(self) -> list[Hashable]:
        """Microbatch keys with a pending wgrad, in filing (B) order."""
        return self._wgrad_store.keys()

    def discard_wgrad(self) -> None:
        """Drop every pending wgrad job and the tensors it holds (e.g. after a failed step)."""
        self._wgrad_store.clear()

    def get_backward_dw_params(self) -> list[nn.Parameter]:
        """The parameters whose gradient `backward_dw` produces (the very objects).

        The GEMM weights, plus the GEMM biases unless every forward since the last
        `release_step_caches` (the step's, under `zbpp.Pipeline`) ran in FP8, which computes bias
        gradients during B; empty when the module does not delay. LayerNorm
        parameters are never listed: their small gradients are always computed during B; nor are
        frozen ones (``requires_grad=False``), which get no gradient at all.
        """
        return [p for p in self._deferred_params() if p.requires_grad]

    def _deferred_params(self) -> list[nn.Parameter]:
        # the GEMM parameters whose gradient W computes when they are trainable
        if not self._delay:
            return []
        return self._gemm_weights() + (self._gemm_biases() if self._bias_grad_deferred else [])

    def register_wgrad_accumulation_and_reduce_hooks(
        self, hook: Callable[[], None]
    ) -> RemovableHandle:
        """Call ``hook()`` (no arguments) at the end of every `backward_dw` that computed.

        A W replayed from a CUDA graph (``Pipeline(..., cuda_graphs=True)``) calls no hook: hooks
        inside a graph never fire, so the runtime reduces the parameters `get_backward_dw_params`
        lists after a stage's last W instead.
        """
        handle = RemovableHandle(self._wgrad_hooks)
        self._wgrad_hooks[handle.id] = hook
        return handle

    def extra_repr(self) -> str:
        return (
            f"delay_wgrad_compute={self._delay}, "
            f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}"
        )


def _summed_per_parameter(jobs: list[Callable[[], list[GradOut]]]) -> list[GradOut]:
    """The jobs' gradients, those of one parameter summed (in filing order) before they meet
    ``.grad``, as autograd's input buffer sums the contributions of a reused weight: the result
    then matches eager bit for bit. Gradients bound for ``main_grad`` are kept apart, in order:
    eager adds each call's into it in turn."""
    summed: dict[int, GradOut] = {}
    ordered: list[GradOut] = []
    for job in jobs:
        for out in job():
            if out.to_main_grad:
                ordered.append(out)
            elif id(out.param) in summed:
                prev = summed[id(out.param)]
                summed[id(out.param)] = prev._replace(grad=prev.grad + out.grad)
            else:
                summed[id(out.param)] = out
    return ordered + list(summed.values())


def is_delayed(module: nn.Module) -> bool:
    """True when `module` leaves its weight gradients to ``backward_dw()``.

    zbpp layers: their ``delay_wgrad_compute``. Other modules with a ``backward_dw()`` (Transformer
    Engine, user layers following the protocol): the first switch they offer of
    ``wgrad_store.delay_wgrad_compute()`` (Transformer Engine), ``need_backward_dw()`` and
    ``delay_wgrad_compute`` (attribute or method); a ``backward_dw`` with no switch is taken as
    delayed. Anything without ``backward_dw``: False.

    >>> from zbpp.modules import Linear
    >>> is_delayed(Linear(2, 2, delay_wgrad_compute=True)), is_delayed(Linear(2, 2))
    (True, False)
    """
    if isinstance(module, DelayedWgradModule):
        return module.delay_wgrad_compute
    if not callable(getattr(module, "backward_dw", None)):
        return False
    probe = getattr(getattr(module, "wgrad_store", None), "delay_wgrad_compute", None)
    if callable(probe):
        return bool(probe())
    need = getattr(module, "need_backward_dw", None)
    if callable(need):
        return bool(need())
    flag = getattr(module, "delay_wgrad_compute", None)
    if flag is None:
        return True
    return bool(flag() if callable(flag) else flag)


def supports_keys(module: nn.Module) -> bool:
    """True when ``module.backward_dw(key)`` may name a microbatch.

    zbpp layers do; so does any ``backward_dw`` taking a positional argument. Transformer Engine
    layers only pop their oldest wgrad (FIFO ``backward_dw()``): False.
    """
    if isinstance(module, DelayedWgradModule):
        return True
    fn = getattr(module, "backward_dw", None)
    if not callable(fn):
        return False
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                  inspect.Parameter.VAR_POSITIONAL)
    return any(p.kind in positional for p in params)
