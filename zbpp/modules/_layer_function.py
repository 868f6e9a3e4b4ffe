"""The forward and the split backward of every zbpp layer: ``[norm ->] fc1 [-> act -> fc2]``.

`Linear` is fc1 alone (``y = x W^T + b``), `LayerNormLinear` the norm and fc1, `LayerNormMLP` all
of it. One autograd node per call (the launch-bound regime of small layers is paid in Python per
node), whose backward (B) computes the input gradient and the norm's parameter gradients; each
GEMM's weight gradient ``dW = dy^T x`` (and, outside FP8, its bias gradient ``sum(dy)``) is part of
one *job*, run at once when the layer is eager and filed in the layer's wgrad store under the
forward's microbatch key when it is delayed. Both run the same job on the same tensors, so delayed
and eager gradients are bit-identical.

FP8 (inside ``fp8_autocast``): the forward casts the GEMM inputs to e4m3 and the backward the
output gradients to e5m2 (HYBRID), each cast fused with the operation producing the tensor where
`_fused` can (the norm into fc1's input cast, the activation into fc2's, the activation's gradient
into fc1's output-gradient cast, with fc1's bias gradient from the same pass); the weights' casts
may be kept across microbatches (`_fp8_weight_cache`). The bias gradients are computed eagerly in
B, from the high-precision gradient, in the cast's pass over it, as Transformer Engine does, so
the deferred job yields no bias gradient. Each cast that the backward needs transposed (W^T for
the input gradient, x^T and dy^T for the weight gradient) is transposed in the same pass.
"""

from __future__ import annotations

from typing import Any, Hashable, NamedTuple

import torch
import torch.nn.functional as F

from torch.autograd.graph import get_gradient_edge

from .._compat import mm_float32, will_engine_execute
from ._activations import Activation
from ._fp8_weight_cache import Fp8WeightCache
from ._fused import act_quantize, dact_quantize, norm_quantize
from ._norm import norm_backward, norm_forward
from ._shared_input import cast_input
from .context import claim_grad_write
from .fp8 import DelayedScaling, Quantized, ScalingMeta, fp8_gemm_nt, quantize
from .fp8 import quantize_and_column_sum
from .wgrad_store import WgradStore

__all__ = ["GradOut", "Fp8Slots", "GemmCall", "LayerSpec", "run_layer", "run_linear",
           "add_to_main_grad", "accumulate_grad", "refuse_double_backward"]


class GradOut(NamedTuple):
    """One gradient a wgrad job produced."""

    name: str  # e.g. "LayerNormMLP.fc1_weight", for error messages
    param: torch.nn.Parameter
    grad: torch.Tensor
    to_main_grad: bool  # add into param.main_grad instead of param.grad


class Fp8Slots(NamedTuple):
    """The recipe and the three scaling slots of one GEMM, as the forward saw them, and where
    the weight's cast may be kept between microbatches (``is_first_microbatch``)."""

    recipe: DelayedScaling
    input: ScalingMeta
    weight: ScalingMeta
    grad_output: ScalingMeta
    weight_cache: Fp8WeightCache
    first_microbatch: bool | None


class GemmCall(NamedTuple):
    """One GEMM of a call: its parameters (the very objects), their names, where its weight
    gradient goes, its FP8 slots (None outside FP8), and the weight's layout: [out, in] as
    `nn.Linear` stores it, or with `transposed` [in, out] as HF's ``Conv1D`` does (``y = x W``;
    the weight gradient then has the [in, out] shape too)."""

    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None
    weight_name: str
    bias_name: str
    fuse_wgrad_accumulation: bool
    fp8: Fp8Slots | None
    transposed: bool = False


class LayerSpec(NamedTuple):
    """Everything one call needs besides its tensors; captured at forward time, kept in the ctx."""

    fc1: GemmCall
    fc2: GemmCall | None  # None: no activation and second GEMM
    normalization: str | None  # "LayerNorm", "RMSNorm" or None (no norm)
    eps: float
    act: Activation | None
    store: WgradStore | None  # None: eager wgrad
    key: Hashable  # the forward's microbatch key (read on the forward's thread)
    recipe: DelayedScaling | None  # None: no FP8


def main_grad_of(name: str, param: torch.nn.Parameter) -> torch.Tensor:
    """``param.main_grad``, with an error that says what to attach when it is missing or wrong."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            f"{name} has no `main_grad`, but its module has fuse_wgrad_accumulation=True: attach "
            f"one before the backward, e.g. `p.main_grad = torch.zeros_like(p, "
            "dtype=torch.float32)`, or build the module with fuse_wgrad_accumulation=False"
        )
    if main_grad.shape != param.shape:
        raise RuntimeError(
            f"{name}.main_grad has shape {tuple(main_grad.shape)}, the parameter "
            f"{tuple(param.shape)}"
        )
    return main_grad


def add_to_main_grad(name: str, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """``param.main_grad += grad``, with an error that says what to attach when it is missing."""
    main_grad_of(name, param).add_(grad)


def _quantize_grad(
    dy: torch.Tensor, slots: Fp8Slots, transpose: bool, column_sum: bool
) -> tuple[Quantized, torch.Tensor | None]:
    if column_sum:  # the bias gradient from the high-precision dy, in the cast's pass
        return quantize_and_column_sum(dy, slots.grad_output, slots.recipe, transpose=transpose)
    return quantize(dy, slots.grad_output, slots.recipe, transpose=transpose), None


class _WgradPart(NamedTuple):
    # one GEMM's share of the job: dW from (gradient, input) operands, db from a gradient
    call: GemmCall
    weight_operands: tuple[Any, Any] | None
    bias_grad_of: torch.Tensor | None


def _weight_grad(call: GemmCall, grad: Any, inp: Any, fp8: bool) -> torch.Tensor:
    # dW = dy^T x ([out, in]; x^T dy for the transposed layout), every job's and eager's GEMM
    if not fp8:
        a, b = (inp.t(), grad) if call.transposed else (grad.t(), inp)
        if call.fuse_wgrad_accumulation and a.dtype in (torch.bfloat16, torch.float16):
            return mm_float32(a, b)  # added to the float32 main_grad unrounded, as TE's GEMM does
        return a.mm(b)
    dtype = torch.float32 if call.fuse_wgrad_accumulation else call.weight.dtype
    return (fp8_gemm_nt(inp, grad, out_dtype=dtype) if call.transposed
            else fp8_gemm_nt(grad, inp, out_dtype=dtype))


def job_outputs(parts: list[_WgradPart], fp8: bool) -> list[GradOut]:
    """The gradients of a job's `parts`: a pure function of the tensors they hold."""
    out = []
    for call, operands, bias_grad_of in parts:
        if operands is not None:
            dw = _weight_grad(call, operands[0], operands[1], fp8)
            out.append(GradOut(call.weight_name, call.weight, dw, call.fuse_wgrad_accumulation))
        if bias_grad_of is not None:
            out.append(GradOut(call.bias_name, call.bias, bias_grad_of.sum(0), False))
    return out


def accumulate_grad(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad += grad`` as autograd accumulates (`grad` itself where there is none yet; copied
    into it where the runtime lets the step's first contribution overwrite it: `claim_grad_write`)."""
    acc = param.grad
    if acc is None:
        param.grad = grad
    elif claim_grad_write(param):
        acc.copy_(grad)
    else:
        acc.add_(grad)


class _Job:
    """A wgrad job: calling it computes ``job_outputs(parts, fp8)``; `parts` exposes the tensors
    it holds (per GEMM: the (gradient, input) operands of dW and the gradient of db).
    `versions`: (tensor, version counter at B) of operands the job does not own (the layer's
    input, the output gradient autograd handed over), checked when it runs: autograd's own check
    of saved tensors ends with B, and one written in place since would silently change dW."""

    __slots__ = ("parts", "fp8", "versions")

    def __init__(self, parts: list[_WgradPart], fp8: bool,
                 versions: tuple[tuple[torch.Tensor, int], ...] = ()) -> None:
        self.parts, self.fp8, self.versions = parts, fp8, versions

    def __call__(self) -> list[GradOut]:
        self._check_versions()
        return job_outputs(self.parts, self.fp8)

    def _check_versions(self) -> None:
        for t, version in self.versions:
            if t._version != version:
                raise RuntimeError(
                    f"{self.parts[0].call.weight_name}: a tensor its weight gradient is computed "
                    "from (the layer's input or its output gradient) was modified in place after "
                    f"the backward (B) and before backward_dw() (W) (version {version} at B, "
                    f"{t._version} now), so W would compute the gradient of other values; keep "
                    "both unchanged until W (e.g. give each microbatch its own input tensor "
                    "rather than copying it into one reused buffer)"
                )

    def accumulate(self, in_gemm: bool = False) -> None:
        """Add the job's gradients where `backward_dw` puts them: ``.grad``, or ``main_grad``
        for a fused weight (each computed as ``job_outputs`` does, added as soon as it is).
        `in_gemm`: outside FP8, add into an existing ``.grad`` of the GEMM's dtype inside the GEMM
        (``addmm`` into it: one pass over ``.grad`` instead of writing dW and adding it; the sum is
        rounded once, so it may differ from autograd's in the last bit)."""
        self._check_versions()
        fp8 = self.fp8
        for call, operands, bias_grad_of in self.parts:
            if operands is not None:
                acc = call.weight.grad
                fits = not fp8 and acc is not None and acc.dtype == operands[0].dtype
                if call.fuse_wgrad_accumulation:
                    add_to_main_grad(call.weight_name, call.weight, _weight_grad(call, *operands, fp8))
                elif fits and claim_grad_write(call.weight):  # written by the GEMM: the same values
                    grad, inp = operands
                    if call.transposed:
                        torch.mm(inp.t(), grad, out=acc)
                    else:
                        torch.mm(grad.t(), inp, out=acc)
                elif fits and in_gemm and not call.transposed:
                    # dW = dy^T x added by the GEMM (out=: aten.addmm, the op FLOP counters know)
                    torch.addmm(acc, operands[0].t(), operands[1], out=acc)
                else:
                    accumulate_grad(call.weight, _weight_grad(call, *operands, fp8))
            if bias_grad_of is not None:
                acc = call.bias.grad
                if acc is not None and acc.dtype == bias_grad_of.dtype and claim_grad_write(call.bias):
                    torch.sum(bias_grad_of, 0, out=acc)
                else:
                    accumulate_grad(call.bias, bias_grad_of.sum(0))


#: A leaf every delayed call takes as one more input, its gradient always None: a B files its
#: W job only where the running backward runs the probe's accumulation node, i.e. where it
#: accumulates into every leaf's ``.grad`` (a plain ``.backward()``) or lists the probe in its
#: ``inputs=`` (the runtime's split B, which finds it as any leaf a custom Function feeds). In
#: ``torch.autograd.grad`` (or a backward limited to other inputs) torch.nn.Linear's weight
#: gradient reaches no ``.grad``, so a filed job, added by the next W, must not either.
with torch.inference_mode(False):  # importable anywhere: a leaf autograd can record
    _WGRAD_PROBE = torch.zeros((), device="cpu", requires_grad=True)
_WGRAD_PROBE_NODE = get_gradient_edge(_WGRAD_PROBE).node  # held: every graph shares this node


def _probe_for(store: WgradStore | None, *params: torch.Tensor | None) -> torch.Tensor | None:
    # the probe for a delayed call whose node exists anyway (a trainable input): one frozen
    # throughout must keep an output that needs no gradient
    return _WGRAD_PROBE if store is not None and any(map(_trainable, params)) else None


def files_wgrad() -> bool:
    """Inside a delayed call's backward: whether it files its W job (see `_WGRAD_PROBE`)."""
    return will_engine_execute(_WGRAD_PROBE_NODE)


def refuse_double_backward(weight_name: str, delayed: bool) -> None:
    """Raise when a backward runs with ``create_graph=True`` (grad mode is on inside it only then).

    A delayed layer's B files its weight gradient for W, outside autograd: nothing could
    differentiate it, and W would add the first-order weight gradient into ``.grad``, which
    ``torch.autograd.grad`` must not touch. An eager fused backward (norm statistics, activation
    derivative, FP8 casts) is not built from differentiable ops: its second order would be wrong.
    """
    layer = weight_name.split(".")[0]
    if delayed:
        why = ("with delay_wgrad_compute=True its weight gradient is computed later by backward_dw() (W), "
               "outside autograd, so it cannot be differentiated, and W would add the first-order weight "
               "gradient into .grad. Build this layer with delay_wgrad_compute=False (or leave it out of "
               "delay_wgrad with module_filter_fn), or compute the penalty with torch.nn layers")
    else:
        why = ("its fused backward (norm statistics, activation derivative, FP8 casts) is not differentiable, "
               "so the second-order gradient would be wrong. Compute the penalty with torch.nn layers "
               "(zbpp's Linear outside FP8 with delay_wgrad_compute=False supports it)")
    raise RuntimeError(
        f"{layer} ({weight_name}): a backward with create_graph=True (double backward, e.g. "
        f"torch.autograd.grad(..., create_graph=True) for a gradient penalty) runs through this layer: {why}"
    )


def _matmul(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool):
    # y = x W^T + b, or x W + b for the transposed layout (the op HF's Conv1D runs)
    if not transposed:
        return F.linear(x, w, b)
    return x.mm(w) if b is None else torch.addmm(b, x, w)


class _LinearFunction(torch.autograd.Function):
    """`_LayerFunction` for one GEMM outside FP8 (`Linear`'s usual call): the same arithmetic,
    with only what this case needs between the GEMMs. `w` and `b` are the parameters where B
    computes their gradients, None where W does (`run_linear`); the GEMM reads `call`'s. `probe`:
    `_WGRAD_PROBE` for a delayed call (its B asks whether to file, `files_wgrad`), else None."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor | None,
        b: torch.Tensor | None,
        probe: torch.Tensor | None,
        call: GemmCall,
        store: WgradStore | None,
        key: Hashable,
    ) -> torch.Tensor:
        weight, bias = call.weight, call.bias
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if w is None:  # deferred: not inputs of this node, wanted when trainable
            need_w, need_b = weight.requires_grad, _trainable(bias)
        ctx.call_store_key = (call, store, key, need_w, need_b)
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        return _matmul(x, weight, bias, call.transposed)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        call, store, key, need_w, need_b = ctx.call_store_key
        if store is not None and torch.is_grad_enabled():  # create_graph=True: see the function
            refuse_double_backward(call.weight_name, delayed=True)
        if not dy.is_contiguous():
            dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dy.mm(w.t()) if call.transposed else dy.mm(w)
        if store is not None:
            # a parameter frozen since F gets nothing, as autograd's AccumulateGrad skips it in B
            need_w = need_w and call.weight.requires_grad
            need_b = need_b and call.bias.requires_grad
            if (need_w or need_b) and files_wgrad():
                part = _WgradPart(call, (dy, x) if need_w else None, dy if need_b else None)
                versions = ((dy, dy._version), (x, x._version)) if need_w else ((dy, dy._version),)
                store.put(key, _Job([part], False, versions))
            return dx, None, None, None, None, None, None
        if need_w or need_b:
            dw, db = _eager_wgrad(_WgradPart(call, (dy, x) if need_w else None,
                                             dy if need_b else None), False)
        return dx, dw, db, None, None, None, None


def _trainable(p: torch.Tensor | None) -> bool:
    return p is not None and p.requires_grad


def run_linear(
    x: torch.Tensor, call: GemmCall, store: WgradStore | None, key: Hashable
) -> torch.Tensor:
    """`run_layer` of a lone GEMM outside FP8 (`call.fp8` is None): ``x W^T + b``."""
    weight = call.weight
    if x.dtype != weight.dtype or not x.dim() or x.shape[-1] != weight.shape[call.transposed ^ 1]:
        _check_input(x, call)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if store is not None and x.requires_grad:
        # W computes both gradients: no edges to the parameters, whose accumulation nodes would
        # run for nothing in every B (kept where they are the node's only way into the graph)
        y = _LinearFunction.apply(x2, None, None, _WGRAD_PROBE, call, store, key)
    else:
        probe = _probe_for(store, weight, call.bias)
        y = _LinearFunction.apply(x2, weight, call.bias, probe, call, store, key)
    if y.dtype != x.dtype:
        _refuse_autocast(y, call)
    return y if x2 is x else y.view(*x.shape[:-1], y.shape[-1])


def _refuse_autocast(y: torch.Tensor, fc1: GemmCall) -> None:
    """Raise for an output `y` whose dtype is not the parameters': ``torch.autocast`` ran the GEMM.

    The input's dtype was the parameters' (`_check_input`), so this happens where the layer reads
    an input that autocast left alone (a norm's, the model's own): its B and W would then mix the
    autocast dtype with the parameters' (a dtype error in B or W, or a .grad of the wrong dtype).
    """
    raise TypeError(
        f"{fc1.weight_name}: torch.autocast ran this layer in {y.dtype}, its parameters are "
        f"{fc1.weight.dtype}: zbpp's layers do not follow torch.autocast (their backward and W "
        "would mix the two dtypes). Run them outside it, with parameters of the compute dtype "
        "(params_dtype=, or the model cast with .to()), or leave these layers nn.Linear "
        "(delay_wgrad's module_filter_fn): a Pipeline's split_wgrad still computes their weight "
        "gradients in W"
    )


def _check_input(x: torch.Tensor, fc1: GemmCall) -> None:
    """Raise the error that says how `x` does not fit `fc1`'s weight."""
    weight = fc1.weight
    features = weight.shape[0 if fc1.transposed else 1]
    if not x.is_floating_point():  # params_dtype takes floating-point dtypes only
        raise TypeError(
            f"{fc1.weight_name}: input dtype {x.dtype} is not a floating-point dtype; cast the "
            f"input to the parameters' {weight.dtype} (token ids go through an embedding first)"
        )
    if x.dtype != weight.dtype:
        # autocast casts an earlier op's output, but not zbpp's layers' parameters
        hint = (" (torch.autocast is on, which zbpp's layers do not follow: run them outside it, "
                "with parameters of the compute dtype)"
                if torch.is_autocast_enabled(x.device.type) else "")
        raise TypeError(
            f"{fc1.weight_name}: input dtype {x.dtype} differs from the parameters' "
            f"{weight.dtype}{hint}; cast the input or build the module with params_dtype={x.dtype}"
        )
    if not x.dim():
        raise ValueError(
            f"{fc1.weight_name}: input is a 0-d tensor; the layer takes [..., {features}], the "
            "features in the last dimension"
        )
    if x.shape[-1] != features:
        raise ValueError(
            f"{fc1.weight_name}: input has {x.shape[-1]} features in its last dimension, the "
            f"weight expects {features}"
        )


class _LayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        norm_w: torch.Tensor | None,
        norm_b: torch.Tensor | None,
        w1: torch.Tensor,
        b1: torch.Tensor | None,
        w2: torch.Tensor | None,
        b2: torch.Tensor | None,
        probe: torch.Tensor | None,
        spec: LayerSpec,
    ) -> torch.Tensor:
        ctx.spec = spec
        fc1, fc2 = spec.fc1, spec.fc2
        needs = ctx.needs_input_grad[:7]
        if w1 is None:  # deferred GEMM parameters are no inputs (`run_layer`): wanted if trainable
            w1, w2 = fc1.weight, fc2 and fc2.weight
            needs = (*needs[:3], w1.requires_grad, needs[4] or _trainable(fc1.bias),
                     _trainable(w2), needs[6] or (fc2 is not None and _trainable(fc2.bias)))
            b1, b2 = fc1.bias, fc2 and fc2.bias
        ctx.needs = needs
        need_x, need_nw, need_nb, need_w1, need_b1, need_w2, _ = needs
        need_dln = need_x or need_nw or need_nb  # the gradient at fc1's input
        need_dh = need_dln or need_w1 or need_b1  # ... at fc1's output (MLP)
        norm = spec.normalization
        recipe = spec.recipe
        mean = rstd = in1 = in1_sinv = w1_saved = w1_sinv = None
        h_saved = in2 = in2_sinv = w2_saved = w2_sinv = None
        if recipe is None:
            if norm is not None:
                ln, mean, rstd = norm_forward(x, norm, norm_w, norm_b, spec.eps)
            else:
                ln = x
            y = _matmul(ln, w1, b1, spec.fc1.transposed)
            in1 = ln if need_w1 else None
            w1_saved = w1 if need_dln else None
            if spec.act is not None:
                h = y
                a = spec.act.forward(h)
                y = F.linear(a, w2, b2)
                h_saved = h if need_dh else None
                in2 = a if need_w2 else None
                w2_saved = w2 if need_dh else None
        else:
            s1 = spec.fc1.fp8
            if norm is not None:
                ln_q, mean, rstd = norm_quantize(
                    x, norm, norm_w, norm_b, spec.eps, s1.input, recipe, transpose=need_w1
                )
            else:
                ln_q = cast_input(x, s1.input, recipe, need_w1, w1)  # q, k and v share theirs
            transposed = spec.fc1.transposed
            w1_q = s1.weight_cache.cast(
                w1, s1.weight, recipe, transpose=need_dln or transposed,
                first_microbatch=s1.first_microbatch,
            )
            w1_fwd = Quantized(w1_q.data_t, w1_q.scale_inv) if transposed else w1_q
            y = fp8_gemm_nt(ln_q, w1_fwd, out_dtype=x.dtype, bias=b1,
                            fast_accumulation=recipe.fprop_fast_accumulation)
            # the backward keeps only the transposes (x^T for dW, W^T for dx); a transposed
            # layout stores the [in, out] weight that dx = dy W^T takes as it is
            in1, in1_sinv = ln_q.data_t, ln_q.scale_inv
            w1_saved, w1_sinv = (w1_q.data if transposed else w1_q.data_t), w1_q.scale_inv
            if spec.act is not None:
                h = y
                s2 = spec.fc2.fp8
                a_q = act_quantize(h, spec.act, s2.input, recipe, transpose=need_w2)
                w2_q = s2.weight_cache.cast(
                    w2, s2.weight, recipe, transpose=need_dh, first_microbatch=s2.first_microbatch
                )
                y = fp8_gemm_nt(a_q, w2_q, out_dtype=x.dtype, bias=b2,
                                fast_accumulation=recipe.fprop_fast_accumulation)
                h_saved = h if need_dh else None
                in2, in2_sinv = a_q.data_t, a_q.scale_inv
                w2_saved, w2_sinv = w2_q.data_t, w2_q.scale_inv
        keep_norm = norm is not None and need_dln
        ctx.save_for_backward(
            x if keep_norm else None,
            mean if keep_norm else None,
            rstd if keep_norm else None,
            norm_w if keep_norm else None,
            norm_b if keep_norm else None,
            in1, in1_sinv, w1_saved, w1_sinv, h_saved, in2, in2_sinv, w2_saved, w2_sinv,
        )
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        spec: LayerSpec = ctx.spec
        if torch.is_grad_enabled():  # create_graph=True: see the function
            refuse_double_backward(spec.fc1.weight_name, delayed=spec.store is not None)
        (x, mean, rstd, norm_w, norm_b, in1, in1_sinv, w1, w1_sinv, h, in2, in2_sinv, w2,
         w2_sinv) = ctx.saved_tensors
        need_x, need_nw, need_nb, need_w1, need_b1, need_w2, need_b2 = ctx.needs
        need_dln = need_x or need_nw or need_nb
        need_dh = need_dln or need_w1 or need_b1
        if not dy.is_contiguous():
            dy = dy.contiguous()
        fp8 = spec.recipe is not None
        dx = d_nw = d_nb = db1 = db2 = None
        parts: list[_WgradPart] = []
        g1 = dy  # the gradient at fc1's output (a Quantized one in FP8)
        if spec.act is not None:
            if fp8:
                dy_q, db2 = _quantize_grad(dy, spec.fc2.fp8, need_w2, need_b2)
                if need_w2:
                    operands = (Quantized(dy_q.data_t, dy_q.scale_inv), Quantized(in2, in2_sinv))
                    parts.append(_WgradPart(spec.fc2, operands, None))
                if need_dh:
                    da = fp8_gemm_nt(dy_q, Quantized(w2, w2_sinv), out_dtype=dy.dtype)
                    g1, db1 = dact_quantize(da, h, spec.act, spec.fc1.fp8.grad_output,
                                            spec.recipe, transpose=need_w1, column_sum=need_b1)
            else:
                if need_w2 or need_b2:
                    parts.append(_WgradPart(spec.fc2, (dy, in2) if need_w2 else None,
                                            dy if need_b2 else None))
                if need_dh:
                    g1 = spec.act.backward(dy.mm(w2), h)
        elif fp8:
            g1, db1 = _quantize_grad(dy, spec.fc1.fp8, need_w1, need_b1)
        if fp8:
            if need_w1:
                operands = (Quantized(g1.data_t, g1.scale_inv), Quantized(in1, in1_sinv))
                parts.append(_WgradPart(spec.fc1, operands, None))
            if need_dln:
                dln = fp8_gemm_nt(g1, Quantized(w1, w1_sinv), out_dtype=dy.dtype)
        else:
            if need_w1 or need_b1:
                parts.append(_WgradPart(spec.fc1, (g1, in1) if need_w1 else None,
                                        g1 if need_b1 else None))
            if need_dln:
                dln = g1.mm(w1.t()) if spec.fc1.transposed else g1.mm(w1)
        if need_dln:
            if spec.normalization is not None:
                dx, d_nw, d_nb = norm_backward(dln, x, spec.normalization, mean, rstd, norm_w,
                                               norm_b, (need_x, need_nw, need_nb),
                                               stats_from_torch=not fp8)
            else:
                dx = dln
        if spec.store is not None:
            parts = _drop_frozen(parts) if files_wgrad() else []
        if not parts:
            return dx, d_nw, d_nb, None, db1, None, db2, None, None
        if spec.store is not None:
            # outside FP8 the jobs read dy itself (fc2's, fc1's without an activation) and,
            # without a norm, the layer's input; their other operands are this call's own
            versions: tuple[tuple[torch.Tensor, int], ...] = ()
            if not fp8:
                versions = ((dy, dy._version),)
                if spec.normalization is None and in1 is not None:
                    versions += ((in1, in1._version),)
            spec.store.put(spec.key, _Job(parts, fp8, versions))
            return dx, d_nw, d_nb, None, db1, None, db2, None, None
        # eager: the job's arithmetic, in its order (fc2's part first)
        dw1 = dw2 = None
        for part in parts:
            dw, db = _eager_wgrad(part, fp8)
            if part.call is spec.fc1:
                dw1, db1 = dw, db1 if db is None else db
            else:
                dw2, db2 = dw, db2 if db is None else db
        return dx, d_nw, d_nb, dw1, db1, dw2, db2, None, None


def _drop_frozen(parts: list[_WgradPart]) -> list[_WgradPart]:
    """`parts` without the gradients of parameters frozen since the forward: autograd's
    AccumulateGrad skips a parameter that no longer requires grad when B reaches it, and W, which
    stands in for it, does the same."""
    if all(_trainable(c.weight) and (b is None or _trainable(c.bias)) for c, _, b in parts):
        return parts  # the usual case: nothing changed since F
    kept = []
    for call, operands, bias_grad_of in parts:
        operands = operands if call.weight.requires_grad else None
        bias_grad_of = bias_grad_of if _trainable(call.bias) else None
        if operands is not None or bias_grad_of is not None:
            kept.append(_WgradPart(call, operands, bias_grad_of))
    return kept


def _eager_wgrad(part: _WgradPart, fp8: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A part's weight and bias gradients for autograd to accumulate (`_Job.accumulate`'s
    arithmetic); a fused weight's goes into ``main_grad``, autograd gets `_dummy_wgrad`'s."""
    call, operands, bias_grad_of = part
    dw = db = None
    # one frozen since F gets nothing (AccumulateGrad would drop it; main_grad is ours to spare)
    if operands is not None and call.weight.requires_grad:
        dw = _weight_grad(call, operands[0], operands[1], fp8)
        if call.fuse_wgrad_accumulation:
            add_to_main_grad(call.weight_name, call.weight, dw)
            dw = _dummy_wgrad(call.weight)
    if bias_grad_of is not None:
        db = bias_grad_of.sum(0)
    return dw, db


def _dummy_wgrad(param: torch.nn.Parameter) -> torch.Tensor | None:
    # Transformer Engine's convention with fused accumulation: a parameter that carries
    # `grad_added_to_main_grad` (Megatron-style reducers) is told so, and receives a placeholder
    # gradient so that its autograd hooks still fire; any other parameter receives none.
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    if getattr(param, "zero_out_wgrad", False):
        return torch.zeros_like(param)
    return torch.empty_like(param)


def run_layer(
    x: torch.Tensor,
    spec: LayerSpec,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The layer `spec` describes on `x` (any leading shape; features in the last dimension)."""
    fc1, fc2 = spec.fc1, spec.fc2
    weight = fc1.weight
    if x.dtype != weight.dtype or not x.dim() or x.shape[-1] != weight.shape[fc1.transposed ^ 1]:
        _check_input(x, fc1)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if spec.store is not None and (x.requires_grad or _trainable(norm_weight)
                                   or _trainable(norm_bias)):
        # W computes the GEMM weights' gradients (outside FP8 the biases' too): no edges to
        # them, whose accumulation nodes would run for nothing in every B (kept where they are
        # the node's only way into the graph)
        if spec.recipe is None:
            y = _LayerFunction.apply(x2, norm_weight, norm_bias, None, None, None, None,
                                     _WGRAD_PROBE, spec)
        else:
            y = _LayerFunction.apply(x2, norm_weight, norm_bias, None, fc1.bias, None,
                                     fc2 and fc2.bias, _WGRAD_PROBE, spec)
    else:
        probe = _probe_for(spec.store, weight, fc1.bias, fc2 and fc2.weight, fc2 and fc2.bias)
        y = _LayerFunction.apply(x2, norm_weight, norm_bias, weight, fc1.bias,
                                 fc2 and fc2.weight, fc2 and fc2.bias, probe, spec)
    if y.dtype != x.dtype:
        _refuse_autocast(y, fc1)
    return y if x2 is x else y.reshape(*x.shape[:-1], y.shape[-1])
