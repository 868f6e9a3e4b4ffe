"""`delay_wgrad`: turn a model's linear layers into zbpp's delayed-wgrad `Linear`, in place."""

from __future__ import annotations

from typing import Callable, Sequence

from torch import nn

from .base import DelayedWgradModule
from .linear import Linear
from .wgrad_store import WgradStore

__all__ = ["delay_wgrad"]

ModuleFilter = Callable[[nn.Module, str], bool]


def delay_wgrad(
    model: nn.Module,
    module_filter_fn: ModuleFilter | None = None,
    *,
    transposed: bool = False,
    linear_like: Sequence[type] = (),
) -> nn.Module:
    """Make every ``nn.Linear`` of `model` a zbpp `Linear` with ``delay_wgrad_compute=True``, in
    place, and return `model`.

    Each layer stays the very same module object and keeps the very same Parameter objects: only
    its class changes (to `Linear`) and the layer's delayed-wgrad state is added. So tied weights,
    optimizers built before, references held to the module or its parameters, ``state_dict`` (the
    same keys and values) and ``load_state_dict(strict=True)`` are as they were, and so are the
    ``training`` flag, the device and the dtype. Afterwards the layer's backward (B) computes only
    its input gradient and its weight and bias gradients wait for ``backward_dw()`` (W), filed
    under the forward's ``microbatch(key)``; inside `fp8_autocast` its GEMMs run in FP8.

    - `module_filter_fn(module, fqn) -> bool` (as torchao's ``quantize_`` takes it): called for
      each candidate with its fully qualified name in `model` ("" for `model` itself); only those
      for which it returns True are converted.
    - Candidates are the modules whose type is exactly ``nn.Linear`` (a subclass may compute
      something else in its forward and is left alone; so is a layer whose ``weight`` is recomputed
      from other parameters by a hook, as ``torch.nn.utils.weight_norm`` and ``spectral_norm``
      do: W could not give those parameters a gradient; nor is one whose ``forward`` was replaced
      on the instance, as accelerate's hooks do: zbpp's would never run) and, with
      `transposed=True`, the layers
      that store their weight as [in, out] and compute ``x W + b``, such as Hugging Face's
      ``Conv1D`` (GPT-2): recognised by an ``nf`` attribute (out features), a 2-D ``weight`` of
      shape [in, nf], a ``bias`` of shape [nf] or None, and no submodules. Their weight stays
      [in, out] and its gradient has that shape too.
    - `linear_like`: ``nn.Linear`` subclasses whose forward computes ``x W^T + b`` as
      ``nn.Linear``'s does (e.g. Hugging Face's ``FalconLinear``), converted as ``nn.Linear`` is;
      their forward is then zbpp's.
    - Hooks: forward and forward-pre hooks, module backward hooks and state-dict hooks registered
      on a converted module stay registered and keep firing (the module object is the same).
      Hooks on its weight and bias tensors (``Tensor.register_hook``,
      ``register_post_accumulate_grad_hook``) no longer see those gradients, which ``backward_dw``
      writes; use ``register_wgrad_accumulation_and_reduce_hooks`` on the layer instead.

    >>> import torch
    >>> from torch import nn
    >>> from zbpp.modules import Linear, delay_wgrad, microbatch
    >>> torch.manual_seed(0) and None
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> weight, opt = model[0].weight, torch.optim.SGD(model.parameters(), lr=0.1)
    >>> delay_wgrad(model, lambda module, fqn: fqn != "2") is model
    True
    >>> type(model[0]).__name__, type(model[2]).__name__, model[0].weight is weight
    ('Linear', 'Linear', True)
    >>> with microbatch(0):
    ...     loss = model(torch.randn(3, 4)).sum()
    >>> loss.backward()  # B: model[0]'s weight gradient waits
    >>> model[0].weight.grad is None, model[2].weight.grad is None
    (True, False)
    >>> model[0].backward_dw(0); model[0].weight.grad.shape  # W
    torch.Size([8, 4])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"delay_wgrad: model is a {type(model).__name__}, not a torch.nn.Module; pass the "
            "module whose linear layers should defer their weight gradients"
        )
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(
            f"delay_wgrad: module_filter_fn={module_filter_fn!r} is not callable; pass a "
            "function (module, fqn) -> bool, or None to convert every linear layer"
        )
    if transposed is not True and transposed is not False:
        raise TypeError(f"delay_wgrad: transposed={transposed!r}; pass True or False")
    linear_like = tuple(linear_like)
    for cls in linear_like:
        if not (isinstance(cls, type) and issubclass(cls, nn.Linear)):
            raise TypeError(f"delay_wgrad: linear_like holds {cls!r}; pass nn.Linear subclasses whose forward "
                            "computes x W^T + b")
    chosen = []
    for fqn, module in model.named_modules(remove_duplicate=True):
        layout = _layout(module, transposed, linear_like)
        if layout is None:
            continue
        if module_filter_fn is not None and not module_filter_fn(module, fqn):
            continue
        chosen.append((module, layout, fqn))
    for module, layout, fqn in chosen:  # decided first: the filter sees the modules as they were
        _convert(module, layout == "in_out", fqn)
    return model


def _layout(module: nn.Module, transposed: bool, linear_like: tuple[type, ...] = ()) -> str | None:
    """"out_in" for an ``nn.Linear`` (or one of `linear_like`), "in_out" for a transposed-weight
    linear layer (when `transposed`), None for anything else."""
    if "forward" in module.__dict__:  # replaced on the instance (accelerate's hooks): never ours
        return None
    if type(module) is nn.Linear or type(module) in linear_like:
        return "out_in" if _own_params(module) else None
    if not transposed or isinstance(module, DelayedWgradModule):
        return None
    nf = getattr(module, "nf", None)
    weight = module._parameters.get("weight")
    bias = module._parameters.get("bias")
    if (
        isinstance(nf, int)
        and _own_params(module)
        and weight.dim() == 2
        and weight.shape[1] == nf
        and (bias is None or tuple(bias.shape) == (nf,))
        and set(module._parameters) <= {"weight", "bias"}
        and not module._modules
    ):
        return "in_out"
    return None


def _own_params(module: nn.Module) -> bool:
    """Whether `module`'s ``weight`` (and ``bias``, if any) are its registered Parameters, not
    tensors recomputed from others by a hook (``torch.nn.utils.weight_norm``, ``spectral_norm``):
    W writes into ``.grad`` of what the forward reads, which such a tensor would swallow."""
    params = module._parameters
    return params.get("weight") is not None and ("bias" in params or getattr(module, "bias", None) is None)


def _convert(module: nn.Module, transposed: bool, fqn: str = "") -> None:
    """Give `module` (an nn.Linear or a transposed-weight linear layer) `Linear`'s class and state,
    keeping its object, parameters, hooks, buffers and flags; its errors name it by `fqn`, its
    path in the model (one of many alike), where it has one."""
    weight = module.weight
    bias = module._parameters.get("bias")
    in_features, out_features = weight.shape if transposed else weight.shape[::-1]
    module.__class__ = _TransposedLinear if transposed else Linear
    module.in_features, module.out_features = int(in_features), int(out_features)
    module.use_bias = bias is not None
    if "bias" not in module._parameters:
        module.register_parameter("bias", None)
    module._param_settings = None
    module._init_protocol(delay_wgrad_compute=True, fuse_wgrad_accumulation=False)
    if fqn:
        module._gemm_labels = ((f"{fqn}.weight", f"{fqn}.bias"),)
        module._wgrad_store = WgradStore(owner=fqn)  # backward_dw's errors name the layer too
    module._sync_param_flags()


class _TransposedLinear(Linear):
    """`Linear` whose weight is stored [in, out] (``y = x W + b``), as HF's ``Conv1D`` stores it;
    only `delay_wgrad` makes one (from such a layer, in place)."""

    _weight_transposed = True

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight_layout=[in, out]"

