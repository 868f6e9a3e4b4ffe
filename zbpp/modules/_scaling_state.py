"""The FP8 delayed-scaling state of a model's zbpp layers, as plain values a checkpoint holds.

Each FP8 slot of a layer (a GEMM's input, weight or output gradient) keeps an amax history and the
scale its next cast uses. They are not parameters or buffers: ``state_dict()`` leaves them out (an
``_extra_state`` entry would break ``load_state_dict`` of every checkpoint saved without one, and
DCP's loading of one whose size changed), so `zbpp.runtime.save_checkpoint` saves them beside the
model. A run resumed without them would quantize its first step with scale 1 and forget the
history window: another run than the uninterrupted one.

Keys are ``"<layer name>.<slot>"`` with the layer named as the model's ``state_dict()`` names it.
A slot several `Linear`s share (q, k and v reading one input, `_shared_input`) is saved under
each, with ``same_as`` naming the first, so that loading shares it again.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch
from torch import nn

from .base import DelayedWgradModule
from .fp8 import ScalingMeta

__all__ = ["scaling_layers", "scaling_states", "restore_scaling_states", "planned_scaling_states", "ScalingRestore"]

def scaling_layers(module: nn.Module) -> dict[str, DelayedWgradModule]:
    """`module`'s zbpp layers by the name ``state_dict()`` gives them (wrappers such as torch's
    activation-checkpoint wrapper drop their part there, so checkpoints at any layout agree)."""
    names: dict[int, list[str]] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        names.setdefault(id(value), []).append(key)
    out: dict[str, DelayedWgradModule] = {}
    for path, layer in module.named_modules():
        if not isinstance(layer, DelayedWgradModule):
            continue
        attr = layer._gemm_names[0][1]
        owners = [k[: -len(attr) - 1] for k in names.get(id(getattr(layer, attr, None)), []) if k.endswith("." + attr)]
        # a tied weight has several names (the embedding's, the LM head's): the layer's is the one
        # closest to its own module path
        out[max(owners, key=lambda o: _common_tail(o, path)) if owners else path] = layer
    return out


def _common_tail(a: str, b: str) -> int:
    """How many trailing dotted components `a` and `b` share."""
    n = 0
    for x, y in zip(reversed(a.split(".")), reversed(b.split("."))):
        if x != y:
            break
        n += 1
    return n


def _key(path: str, slot: str) -> str:
    return f"{path}.{slot}" if path else slot


def scaling_states(module: nn.Module) -> dict[str, dict[str, Any]]:
    """``{"<layer>.<slot>": {"amax_history", "scale", "casts", "format"[, "same_as"]}}`` of every
    FP8 slot of `module`'s zbpp layers (the tensors themselves, not copies).

    >>> import torch
    >>> from zbpp.modules import DelayedScaling, Linear, fp8_autocast
    >>> net = torch.nn.Sequential(Linear(16, 16))
    >>> with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(amax_history_len=4)):
    ...     _ = net(torch.ones(16, 16))
    >>> state = scaling_states(net)
    >>> sorted(state), state["0.input"]["amax_history"].tolist(), state["0.input"]["format"]
    (['0.grad_output', '0.input', '0.weight'], [1.0, 0.0, 0.0, 0.0], 'float8_e4m3fn')
    """
    out: dict[str, dict[str, Any]] = {}
    first_key: dict[int, str] = {}
    for path, layer in scaling_layers(module).items():
        for slot, meta in layer.fp8_meta.items():
            key = _key(path, slot)
            entry = {"amax_history": meta.amax_history, "scale": meta.scale,
                     "casts": torch.tensor(meta.casts, dtype=torch.int64),
                     "format": str(meta.dtype).removeprefix("torch.")}
            if id(meta) in first_key:
                entry["same_as"] = first_key[id(meta)]
            else:
                first_key[id(meta)] = key
            out[key] = entry
    return out


def restore_scaling_states(module: nn.Module, states: Mapping[str, Mapping[str, Any]]) -> None:
    """Give `module`'s zbpp layers exactly the FP8 slots `states` holds for them (as
    `scaling_states` wrote them): a layer without saved slots starts fresh, as the saved model's
    did. Kept weight casts are dropped (the next forward casts with the restored scale). A slot
    that is not as `scaling_states` writes it raises, naming it, with nothing changed.

    >>> import torch
    >>> from zbpp.modules import DelayedScaling, Linear, fp8_autocast
    >>> a, b = Linear(16, 16), Linear(16, 16)
    >>> with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(amax_history_len=4)):
    ...     _ = a(torch.full((16, 16), 3.0))
    >>> restore_scaling_states(b, scaling_states(a))
    >>> b.fp8_meta["input"].amax_history.tolist(), round(b.fp8_meta["input"].scale.item(), 2)
    ([3.0, 0.0, 0.0, 0.0], 149.33)
    """
    planned_scaling_states(module, states).apply()


class ScalingRestore(NamedTuple):
    """`module`'s FP8 slots as `states` says (`planned_scaling_states`), not yet given to its layers."""

    layers: dict[str, DelayedWgradModule]
    slots: list[tuple[DelayedWgradModule, str, ScalingMeta]]  #: (layer, slot name, the slot it gets)
    writes: list[tuple[ScalingMeta, _Saved]]  #: slots that take a saved value when applied

    def apply(self) -> None:
        """Write the saved values and give every layer its slots (none fail: checked when planned)."""
        for meta, saved in self.writes:
            meta.amax_history.copy_(saved.history)
            meta.scale.copy_(saved.scale.reshape(()))
            meta.casts = saved.casts
        for layer in self.layers.values():
            layer.fp8_meta = {}
            for cache in layer._fp8_weight_casts.values():
                cache.clear()
        for layer, slot, meta in self.slots:
            layer.fp8_meta[slot] = meta


def planned_scaling_states(module: nn.Module, states: Mapping[str, Mapping[str, Any]]) -> ScalingRestore:
    """`restore_scaling_states` checked and made ready (new slots made on the layers' device),
    changing neither `module` nor its slots: a damaged or foreign slot raises here, naming it, so a
    checkpoint's load can refuse before anything of it is applied (a ``same_as`` naming a slot not
    saved for these layers too)."""
    layers = scaling_layers(module)
    wanted = []  # (layer, slot, key, entry) of every saved slot of these layers
    for path, layer in layers.items():
        prefix = f"{path}." if path else ""
        wanted += [(layer, key[len(prefix):], key, states[key]) for key in states
                   if key.startswith(prefix) and "." not in key[len(prefix):]]
    made: dict[str, ScalingMeta] = {}
    writes: list[tuple[ScalingMeta, _Saved]] = []
    reused: set[int] = set()  # existing slots written once each (one shared before may not be now)
    for layer, slot, key, entry in sorted(wanted, key=lambda w: "same_as" in w[3]):  # shared ones last
        target = entry.get("same_as")
        if target is not None and target not in made:  # else a slot of its own: the saved run shared it
            raise ValueError(f"FP8 slot {key!r}: saved as sharing the slot {target!r}, which is not saved for "
                             "these layers (a slot of their own would not be the saved run's shared one)")
        shared = made.get(target) if target is not None else None
        if shared is None:
            old = layer.fp8_meta.get(slot)
            saved = _saved(key, entry)
            shared = _slot(saved, layer._gemm_weights()[0].device, None if old is None or id(old) in reused else old)
            writes.append((shared, saved))
            reused.add(id(shared))
        made[key] = shared
    return ScalingRestore(layers, [(layer, slot, made[key]) for layer, slot, key, _ in wanted], writes)


class _Saved(NamedTuple):
    """One saved slot's values, checked (`_saved`)."""

    dtype: torch.dtype
    history: torch.Tensor
    scale: torch.Tensor
    casts: int


def _saved(key: str, entry: Mapping[str, Any]) -> _Saved:
    """The values of saved slot `key`, or a ValueError naming it where `entry` is not as
    `scaling_states` writes it (another format, a field missing, a tensor of another shape)."""
    missing = [f for f in ("format", "amax_history", "scale", "casts") if f not in entry]
    if missing:
        raise ValueError(f"FP8 slot {key!r}: saved without {', '.join(map(repr, missing))}")
    dtype = getattr(torch, str(entry["format"]), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize != 1:
        raise ValueError(f"FP8 slot {key!r}: saved format {entry['format']!r} is not an FP8 dtype")
    history, scale, casts = entry["amax_history"], entry["scale"], entry["casts"]
    if not isinstance(history, torch.Tensor) or history.dim() != 1 or history.numel() == 0:
        raise ValueError(f"FP8 slot {key!r}: saved amax_history is not a 1-dim tensor "
                         f"(shape {tuple(getattr(history, 'shape', ()))})")
    for field, value in (("scale", scale), ("casts", casts)):
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"FP8 slot {key!r}: saved {field} holds {value.numel()} values, not one")
    try:
        return _Saved(dtype, history, scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale)),
                      int(casts))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"FP8 slot {key!r}: saved scale {scale!r} or casts {casts!r} is not a number") from exc


def _slot(saved: _Saved, device: torch.device, old: ScalingMeta | None) -> ScalingMeta:
    """The slot that takes `saved`'s values when applied: `old` where it matches (its tensors keep
    their addresses, which CUDA graphs captured before the load read), else a new one."""
    fits = (old is not None and old.dtype == saved.dtype and old.amax_history.shape == saved.history.shape
            and old.amax_history.device == device and old.scale.device == device)
    return old if fits else ScalingMeta(saved.dtype, history_len=saved.history.numel(), device=device)
