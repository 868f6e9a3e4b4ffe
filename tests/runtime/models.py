"""Models for the runtime tests, and the single-process reference they are checked against.

Stage ``s`` of an ``S``-stage model is a small residual MLP block that exercises what the runtime
must carry between stages: tuple, dict and list outputs (by ``s % 3``), two float tensors needing
gradients (``h`` and, from dict stages, ``res``), an int64 tensor (``ids``, feeding an embedding in
every stage) and a non-tensor value (``tag``, which changes the computation). The last stage
returns one tensor for the loss.

Kinds, built from the same seeded values so every kind computes the same function:
- ``plain``: torch.nn only (weight gradients during B, W empty);
- ``zbpp``: every Linear is ``zbpp.modules.Linear(delay_wgrad_compute=True)`` (W is real, keyed);
- ``mixed``: the first Linear of each block is a zbpp delayed one, the second plain.
- ``fifo``: every Linear is `FifoLinear`, a Transformer-Engine-like delayed Linear without keys.

The reference (`reference_step`) runs the plain model on the whole batch in this process.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from zbpp.runtime.tree import call

H = 8  # feature width
VOCAB = 5  # ids are in 0..VOCAB-1


class FifoLinear(nn.Module):
    """A delayed-wgrad Linear with a FIFO store and no keys, like Transformer Engine's
    (``backward_dw()`` computes the oldest pending weight gradient and accumulates it)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.bias = nn.Parameter(torch.empty(n_out))
        self.delay_wgrad_compute = True
        self._fifo: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FifoFn.apply(x, self.weight, self.bias, self)

    def backward_dw(self) -> None:
        x, g = self._fifo.pop(0)
        with torch.no_grad():
            for p, gp in ((self.weight, g.t() @ x), (self.bias, g.sum(0))):
                p.grad = gp if p.grad is None else p.grad + gp


class _FifoFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, mod: FifoLinear) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.mod = mod
        return x @ w.t() + b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        ctx.mod._fifo.append((x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])))
        return g @ w, None, None, None


def _linear(kind: str, which: int) -> nn.Module:
    if kind == "plain" or (kind == "mixed" and which == 1):
        return nn.Linear(H, H)
    if kind == "fifo":
        return FifoLinear(H, H)
    from zbpp.modules import Linear

    return Linear(H, H, delay_wgrad_compute=True)


class Block(nn.Module):
    """Stage `stage` of `num_stages` (see the module docstring)."""

    def __init__(self, stage: int, num_stages: int, kind: str) -> None:
        super().__init__()
        self.stage, self.last = stage, stage == num_stages - 1
        self.norm = nn.LayerNorm(H)
        self.lin1 = _linear(kind, 0)
        self.lin2 = _linear(kind, 1)
        self.emb = nn.Embedding(VOCAB, H)

    def forward(self, h: torch.Tensor, ids: torch.Tensor, tag: str, res: torch.Tensor | None = None) -> Any:
        if res is not None:
            h = h + res
        scale = 2.0 if tag == "double" else 1.0
        h = h + self.lin2(torch.tanh(self.lin1(self.norm(h)))) + scale * self.emb(ids)
        if self.last:
            return h
        kind = self.stage % 3
        if kind == 0:
            return (h, ids, tag)
        if kind == 1:
            # h * sigmoid(h) saves h, an output that is also sent: its storage must outlive the send
            return {"h": h, "ids": ids, "tag": tag, "res": 0.5 * (h * torch.sigmoid(h))}
        return [h, ids, tag]


def make_stage(stage: int, num_stages: int, kind: str, device: Any = "cpu") -> nn.Module:
    """Stage `stage`, float32, with values that depend only on (stage, num_stages), not on `kind`."""
    torch.manual_seed(1000 + 17 * num_stages + stage)
    plain = Block(stage, num_stages, "plain")
    if kind != "plain":
        block = Block(stage, num_stages, kind)
        missing = block.load_state_dict(plain.state_dict(), strict=True)
        assert not missing.missing_keys and not missing.unexpected_keys
        plain = block
    return plain.to(device)


def make_batch(step: int, rows: int, device: Any = "cpu", tag: str = "double") -> tuple[Any, torch.Tensor]:
    """Inputs ``(x, ids, tag)`` and target for one step."""
    g = torch.Generator().manual_seed(7 + step)
    x = torch.randn(rows, H, generator=g)
    ids = torch.randint(0, VOCAB, (rows,), generator=g)
    y = torch.randn(rows, H, generator=g)
    return (x.to(device), ids.to(device), tag), y.to(device)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def reference_step(stages: list[nn.Module], inputs: Any, target: torch.Tensor,
                   loss: Callable[[Any, Any], torch.Tensor] = loss_fn) -> torch.Tensor:
    """One process, whole model, whole batch: forward, loss, backward. Returns the loss."""
    out = inputs
    for st in stages:
        out = call(st, out)
    value = loss(out, target)
    value.backward()
    return value.detach()
