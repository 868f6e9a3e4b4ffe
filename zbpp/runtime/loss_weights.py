"""The factor of each microbatch's loss in a step's loss (``Pipeline(loss_weight=...)``).

By default microbatch j weighs rows_j / rows (`row_factors`). With ``loss_weight`` it weighs
w_j / W, W the sum of the w_j (`weight_factors`), kept on the device (no host synchronisation). For
a loss averaged over tokens, w_j is the count of tokens it averages over: the step then gives the
token mean over the whole batch. Weights must be non-negative and finite: a number or a CPU tensor
that is not raises `ValueError` naming its microbatch; one on an accelerator (reading it would wait
for the device) makes the step's loss and gradients NaN rather than plausibly wrong (weights of mixed
signs would reweigh the microbatches silently). A microbatch of weight
0 adds nothing (its loss may be NaN, a mean over no token: it is left out, and its backward gets a
zero gradient); if every weight is 0 the step's loss and gradients are 0. With data-parallel
replicas a training step's W is the total over every replica (one all-reduce of a scalar per
step): the gradient is the token mean over every replica's data, and each replica returns its own
batch's weighted loss. Without ``loss_weight`` each replica weighs its own rows and the replicas'
gradients are averaged (DDP's convention): replicas given unequal rows weigh alike; pass
``loss_weight=lambda y: y.shape[0]`` for the mean over every replica's rows.

>>> row_factors(5, 2)
[0.6, 0.4]

A token-mean loss over a right-padded batch, with a shared ``[1, T]`` tensor:

>>> from zbpp import Pipeline
>>> from zbpp.schedules import build
>>> from zbpp.runtime import Replicated
>>> class Tagger(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.emb = torch.nn.Embedding(5, 5, dtype=torch.float64)
...     def forward(self, ids, pos, scale):
...         return self.emb(ids + pos) * scale
>>> def ce(logits, y):
...     return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())  # ignore_index=-100
>>> model = Tagger()
>>> pipe = Pipeline({0: model}, build("1f1b", num_ranks=1, num_microbatches=2), loss_fn=ce,
...                 loss_weight=lambda y: (y != -100).sum())
>>> ids, pos = torch.tensor([[1, 2, 0], [3, 0, 0]]), torch.tensor([[0, 1, 2]])
>>> y = torch.tensor([[2, 3, -100], [1, -100, -100]])
>>> loss = pipe.step((ids, pos, Replicated(torch.tensor(2.0))), target=y)
>>> bool(torch.allclose(loss, ce(model(ids, pos, 2.0), y)))  # the mean over the 3 tokens
True
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

__all__ = ["row_factors", "checked_weights", "weight_factors"]


def row_factors(rows: int, m: int) -> list[float]:
    """rows_j / rows for `torch.tensor_split`'s sizes of `rows` into `m` microbatches."""
    return [(rows // m + (1 if j < rows % m else 0)) / rows for j in range(m)]


def checked_weights(loss_weight: Callable[[Any], Any], targets: list[Any], device: torch.device) -> torch.Tensor:
    """``loss_weight`` of each microbatch's target, checked (a number or a one-element tensor) and
    stacked on `device`: called before the start agreement, so that a value that cannot be brought
    there raises on every rank rather than on this one alone after its peers went into the step."""
    out = []
    for j, t in enumerate(targets):
        w = loss_weight(t)
        ok = (isinstance(w, torch.Tensor) and w.numel() == 1) or (isinstance(w, (int, float)) and not isinstance(w, bool))
        if not ok:
            got = f"a tensor of shape {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
            raise TypeError(f"loss_weight must return a number or a one-element tensor, got {got} for microbatch {j}")
        if not isinstance(w, torch.Tensor) or w.device.type == "cpu":  # read for free: no device to wait for
            v = float(w)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"loss_weight must return a non-negative finite weight, got {v!r} for microbatch {j}")
        out.append(w)
    dtype = torch.float64 if device.type in ("cpu", "cuda") else torch.float32
    try:
        return torch.stack([w.detach().reshape(()).to(device, dtype) if isinstance(w, torch.Tensor)
                            else torch.full((), float(w), dtype=dtype, device=device) for w in out])
    except Exception as exc:  # noqa: BLE001 - the user's value, named
        raise ValueError(f"loss_weight returned weights that cannot be put on {device} as {dtype}: {exc}") from exc


def weight_factors(ws: torch.Tensor, dp_size: int = 1, dp_group: Any = None,
                   wait: Callable[[Any], None] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """The factors w_j / W of the microbatches' losses (0 where w_j is 0) from `checked_weights`'
    device tensor (no host synchronisation), and None; with ``dp_size > 1`` W is the total over
    every replica (an all-reduce over `dp_group`, waited for by `wait`, else plainly) and the
    factors are scaled by `dp_size`, which the gradient averaging divides out; then also this
    replica's own factors, for the returned loss. A negative or non-finite weight (one on an
    accelerator: `checked_weights` refused the others) makes every factor NaN, on the device."""
    nonzero = ws != 0
    bad = ((ws < 0) | ~torch.isfinite(ws)).any()

    def factors(total: torch.Tensor, scale: float = 1.0) -> list[torch.Tensor]:
        good = torch.where(nonzero, ws * scale / total, torch.zeros_like(ws))
        return list(torch.where(bad, torch.full_like(ws, math.nan), good).unbind())

    local = factors(ws.sum())
    if dp_size == 1:
        return local, None
    import torch.distributed as dist

    total = ws.sum()
    work = dist.all_reduce(total, group=dp_group, async_op=True)
    (wait or (lambda w: w.wait()))(work)
    return factors(total, float(dp_size)), local
