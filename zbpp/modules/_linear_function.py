"""The one GEMM of every zbpp layer, ``y = x W^T + b``, with its backward split into B and W.

Backward (B) computes the input gradient ``dx = dy W``. The weight gradient ``dW = dy^T x`` (and,
outside FP8, the bias gradient ``db = sum(dy)``) is a *job*: run at once when the layer is eager,
filed in the layer's wgrad store under the forward's microbatch key when it is delayed. Both cases
run the same job code on the same tensors, so delayed and eager gradients are bit-identical.

In FP8 the forward casts x and W to e4m3, the backward casts dy to e5m2 (HYBRID) and computes
``db`` eagerly from the high-precision dy (in the same pass as that cast where the fused Triton
kernel runs, as Transformer Engine does), so the deferred job yields no bias gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, NamedTuple

import torch
import torch.nn.functional as F

from .fp8 import (
    DelayedScaling,
    Quantized,
    ScalingMeta,
    fp8_gemm_nt,
    quantize,
    quantize_and_column_sum,
)
from ._fp8_weight_cache import Fp8WeightCache
from .wgrad_store import WgradStore

__all__ = ["GradOut", "Fp8Slots", "GemmCall", "linear"]


class GradOut(NamedTuple):
    """One gradient a wgrad job produced (``grad`` None: nothing for that parameter)."""

    name: str  # e.g. "LayerNormMLP.fc1_weight", for error messages
    param: torch.nn.Parameter
    grad: torch.Tensor | None
    to_main_grad: bool  # add into param.main_grad instead of param.grad


WgradJob = Callable[[], list[GradOut]]


@dataclass(frozen=True)
class Fp8Slots:
    """The recipe and the three scaling slots of one GEMM, as the forward saw them, and where
    the weight's cast may be kept between microbatches (``is_first_microbatch``)."""

    recipe: DelayedScaling
    input: ScalingMeta
    weight: ScalingMeta
    grad_output: ScalingMeta
    weight_cache: Fp8WeightCache
    first_microbatch: bool | None


@dataclass(frozen=True)
class GemmCall:
    """Everything one call needs besides its tensors; captured at forward time, kept in the ctx."""

    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None
    weight_name: str
    bias_name: str
    store: WgradStore | None  # None: eager wgrad
    key: Hashable  # the forward's microbatch key (read on the forward's thread)
    fuse_wgrad_accumulation: bool
    fp8: Fp8Slots | None


def add_to_main_grad(name: str, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """``param.main_grad += grad``, with an error that says what to attach when it is missing."""
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
    main_grad.add_(grad)


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        call: GemmCall,
    ) -> torch.Tensor:
        ctx.call = call
        if call.fp8 is None:
            ctx.save_for_backward(x, weight)
            return F.linear(x, weight, bias)
        s = call.fp8
        need_dx, need_dw = ctx.needs_input_grad[:2]
        # The backward needs x^T (wgrad) and W^T (dgrad), row-major: cast and transpose at once,
        # and keep only those.
        xq = quantize(x, s.input, s.recipe, transpose=need_dw)
        wq = s.weight_cache.cast(
            weight, s.weight, s.recipe, transpose=need_dx, first_microbatch=s.first_microbatch
        )
        ctx.save_for_backward(xq.data_t, xq.scale_inv, wq.data_t, wq.scale_inv)
        return fp8_gemm_nt(
            xq, wq, out_dtype=x.dtype, bias=bias, fast_accumulation=s.recipe.fprop_fast_accumulation
        )

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        call: GemmCall = ctx.call
        dy = dy.contiguous()
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx = db = None
        if call.fp8 is None:
            x, w = ctx.saved_tensors
            if need_dx:
                dx = dy.mm(w)

            def job() -> list[GradOut]:
                out = []
                if need_dw:
                    dw = dy.t().mm(x)
                    fused = call.fuse_wgrad_accumulation
                    out.append(GradOut(call.weight_name, call.weight, dw, fused))
                if need_db:
                    out.append(GradOut(call.bias_name, call.bias, dy.sum(0), False))
                return out

        else:
            s = call.fp8
            x_t, x_sinv, w_t, w_sinv = ctx.saved_tensors
            if need_db:  # eagerly, from the high-precision dy, in the cast's pass over dy
                dyq, db = quantize_and_column_sum(dy, s.grad_output, s.recipe, transpose=need_dw)
            else:
                dyq = quantize(dy, s.grad_output, s.recipe, transpose=need_dw)
            if need_dx:
                dx = fp8_gemm_nt(dyq, Quantized(w_t, w_sinv), out_dtype=dy.dtype)
            wgrad_dtype = torch.float32 if call.fuse_wgrad_accumulation else call.weight.dtype
            # the job keeps only dy^T (not dy) until W
            dy_t = Quantized(dyq.data_t, dyq.scale_inv) if need_dw else None
            del dyq

            def job() -> list[GradOut]:
                if not need_dw:
                    return []
                dw = fp8_gemm_nt(dy_t, Quantized(x_t, x_sinv), out_dtype=wgrad_dtype)
                out = [GradOut(call.weight_name, call.weight, dw, call.fuse_wgrad_accumulation)]
                if call.bias is not None:
                    out.append(GradOut(call.bias_name, call.bias, None, False))
                return out

        if not (need_dw or (need_db and call.fp8 is None)):
            return dx, None, db, None
        if call.store is not None:
            call.store.put(call.key, job)
            return dx, None, db, None
        dw = None
        for name, param, grad, to_main in job():
            if grad is None:
                continue
            if param is call.bias:
                db = grad
            elif to_main:
                add_to_main_grad(name, param, grad)
                dw = _dummy_wgrad(param)
            else:
                dw = grad
        return dx, dw, db, None


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


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, call: GemmCall
) -> torch.Tensor:
    """``x W^T + b`` over the last dimension of `x` (any leading shape)."""
    if x.dtype != weight.dtype:
        raise TypeError(
            f"{call.weight_name}: input dtype {x.dtype} differs from the parameters' "
            f"{weight.dtype}; cast the input or build the module with params_dtype={x.dtype}"
        )
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{call.weight_name}: input has {x.shape[-1]} features in its last dimension, the "
            f"weight expects {weight.shape[1]}"
        )
    lead = x.shape[:-1]
    y = _LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, call)
    return y.reshape(*lead, weight.shape[0])
