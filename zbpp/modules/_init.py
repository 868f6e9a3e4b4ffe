"""Parameter creation shared by the layers (the same whatever `delay_wgrad_compute` says)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["InitMethod", "default_init", "new_param", "add_gemm_params", "check_params_dtype"]

InitMethod = Callable[[torch.Tensor], object]


def default_init(weight: torch.Tensor) -> None:
    """Transformer Engine's default: normal with mean 0 and std 0.023."""
    nn.init.normal_(weight, mean=0.0, std=0.023)


def check_params_dtype(owner: str, value: object) -> torch.dtype | None:
    """`value` when it is None or a floating-point torch.dtype; a TypeError naming `owner`'s
    ``params_dtype`` and what it accepts otherwise.

    >>> check_params_dtype("Linear", torch.bfloat16)
    torch.bfloat16
    >>> check_params_dtype("Linear", "bf16")
    Traceback (most recent call last):
    TypeError: Linear: params_dtype='bf16' (a str); pass a floating-point torch.dtype ...
    """
    if value is None or (isinstance(value, torch.dtype) and value.is_floating_point):
        return value
    what = "a non-floating torch.dtype" if isinstance(value, torch.dtype) else (
        f"a {type(value).__name__}"
    )
    raise TypeError(
        f"{owner}: params_dtype={value!r} ({what}); pass a floating-point torch.dtype (e.g. "
        "torch.bfloat16, torch.float32) or None for torch's default dtype"
    )


def new_param(
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    init: InitMethod | float,
    name: str = "parameter",
) -> nn.Parameter:
    """A parameter of `shape` filled by `init` (a function that fills the tensor in place, as
    ``torch.nn.init``'s do, or a constant); `name` is what errors call it."""
    data = torch.empty(shape, dtype=dtype or torch.get_default_dtype(), device=device)
    with torch.no_grad():
        if callable(init):
            out = init(data)
            # a new tensor returned (not data, nor a view of it) means data was left as
            # torch.empty made it: uninitialised memory
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
                raise TypeError(
                    f"{name}: its init method {init!r} returned a new tensor instead of filling "
                    "the one it is given in place, which would stay uninitialised; fill it in "
                    "place (e.g. torch.nn.init.normal_(w, std=0.02), or w.copy_(...))"
                )
        else:
            data.fill_(init)
    return nn.Parameter(data)


def add_gemm_params(
    module: nn.Module,
    weight_name: str,
    bias_name: str,
    shape: tuple[int, int],
    *,
    bias: bool,
    init: InitMethod,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> None:
    """Register one GEMM's ``weight_name`` [out, in] (filled by `init`) and ``bias_name`` [out]
    (zeros; registered as None without `bias`) on `module`."""
    setattr(module, weight_name, new_param(shape, init=init, dtype=dtype, device=device,
                                           name=f"{type(module).__name__}.{weight_name}"))
    if bias:
        setattr(module, bias_name, new_param(shape[:1], init=0.0, dtype=dtype, device=device))
    else:
        module.register_parameter(bias_name, None)
