"""Per-layer profiles of a model: what each layer costs in time and memory.

A `Profile` lists a model's layers in order (embedding first, head last for a language model),
each a `Layer` with its F, B and W time per microbatch, the activation memory F keeps until B,
the part of it B keeps until W (`wgrad`), and its static memory: parameter, gradient and
optimizer-state bytes, held for the whole step. A stage of consecutive layers costs their sums
(`Profile.stage_costs`), which is what the simulator and `zbpp.schedules.partition` work with.

A profile is given (numbers measured on a device by a runtime helper, or read with
`Profile.load`), or built from FLOP counts by `transformer_profile` at a stated throughput.

>>> prof = Profile([Layer("embed", 0, 0, 0, static=8), Layer("block", 2, 2, 1, activation=3, wgrad=1, static=4),
...                 Layer("head", 1, 1, 1, activation=5, wgrad=2, static=8)], comm=0.5)
>>> costs, memory, static = prof.stage_costs([range(0, 2), range(2, 3)])
>>> costs.f, memory.activation, static
((2.0, 1.0), (3.0, 5.0), [12.0, 8.0])
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from .checks import as_int, as_number
from .simulate import Costs, Memory

__all__ = ["Layer", "Profile", "transformer_profile"]


@dataclass(frozen=True)
class Layer:
    """One layer: times per microbatch, memory per microbatch in flight, static memory.

    Times are in any one unit (seconds, say); memory in bytes. ``wgrad <= activation``.

    >>> Layer("block", f=1, b=1, w=0.5, activation=2, wgrad=3)
    Traceback (most recent call last):
    ValueError: Layer 'block': need wgrad <= activation, got wgrad=3.0 > activation=2.0
    """

    name: str
    f: float
    b: float
    w: float
    activation: float = 0.0  #: bytes F allocates and B frees (but `wgrad`)
    wgrad: float = 0.0  #: bytes B keeps until W
    static: float = 0.0  #: parameter + gradient + optimizer-state bytes

    def __post_init__(self) -> None:
        for key in ("f", "b", "w", "activation", "wgrad", "static"):
            object.__setattr__(self, key, as_number(getattr(self, key), f"Layer {self.name!r}: {key}"))
        if self.wgrad > self.activation:
            raise ValueError(f"Layer {self.name!r}: need wgrad <= activation, got wgrad={self.wgrad!r} "
                             f"> activation={self.activation!r}")


@dataclass(frozen=True)
class Profile:
    """A model's layers in order, and the time one message between ranks takes (`comm`)."""

    layers: tuple[Layer, ...]
    comm: float = 0.0
    name: str = ""
    notes: dict[str, Any] = field(default_factory=dict, compare=False)  #: how it was made (shapes, throughput)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ValueError("Profile: needs at least one layer")
        for layer in self.layers:
            if not isinstance(layer, Layer):
                raise ValueError(f"Profile: layers must be Layer objects, got {layer!r}")
        object.__setattr__(self, "comm", as_number(self.comm, "Profile.comm"))

    def __len__(self) -> int:
        return len(self.layers)

    def check_split(self, stages: Sequence[range]) -> None:
        """Raise `ValueError` unless `stages` cut the layers into consecutive, non-empty ranges."""
        at = 0
        for s, r in enumerate(stages):
            if not isinstance(r, range) or r.step != 1 or r.start != at or len(r) < 1:
                raise ValueError(f"stage {s}: {r!r} does not continue the split at layer {at} with at least one "
                                 f"layer (a split is consecutive ranges covering layers 0..{len(self) - 1})")
            at = r.stop
        if at != len(self):
            raise ValueError(f"the split covers layers 0..{at - 1} of 0..{len(self) - 1}")

    def stage_costs(self, stages: Sequence[range]) -> tuple[Costs, Memory, list[float]]:
        """Per stage of the split: `Costs` (with `comm`), `Memory`, and the static bytes."""
        self.check_split(stages)
        sums = [[sum(getattr(self.layers[i], k) for i in r) for r in stages]
                for k in ("f", "b", "w", "activation", "wgrad", "static")]
        f, b, w, act, wgrad, static = sums
        wgrad = [min(x, a) for x, a in zip(wgrad, act)]  # equal sums may differ in the last bit
        return Costs(f=f, b=b, w=w, comm=self.comm), Memory(activation=act, wgrad=wgrad), static

    # -- files -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "comm": self.comm, "notes": self.notes, "layers": [asdict(x) for x in self.layers]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Profile":
        try:
            layers = [Layer(**x) for x in data["layers"]]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"a profile needs 'layers': a list of {{name, f, b, w, activation, wgrad, static}}: {exc}") from None
        return cls(layers, comm=data.get("comm", 0.0), name=data.get("name", ""), notes=data.get("notes", {}))

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=1)
            fh.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Profile":
        """Read a profile written by `save` (JSON)."""
        with open(path) as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{os.fspath(path)}: not a JSON profile: {exc}") from None
        return cls.from_dict(data)


def transformer_profile(
    *,
    name: str,
    num_layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    kv_heads: int | None = None,
    vocab: int,
    seq: int,
    micro_batch: int = 1,
    gated: bool = True,
    tensor_parallel: int = 1,
    flops_per_s: float = 400e12,
    hbm_bytes_per_s: float = 3.35e12,
    link_bytes_per_s: float = 50e9,
    bytes_per_param: float = 7.5,
) -> Profile:
    """A decoder-only transformer's profile from FLOP counts: embedding, `num_layers` blocks, head.

    Per microbatch of ``T = micro_batch * seq`` tokens, on one of `tensor_parallel` ranks (FLOPs,
    activations and parameters divided among them):

    - a block with P weights (attention ``h(2h + 2 kv)``, MLP ``(3 if gated else 2) h ffn``):
      F = 2PT + 2 T s h FLOPs (causal attention), B = 2PT + 4 T s h, W = 2PT; it keeps
      ``T (18 h + 4 ffn)`` activation bytes in bf16 (34 T h for ffn = 4h, flash attention),
      of which W needs the linears' inputs and output gradients, ``2 T (5h + 2 kv + k ffn)``;
    - the embedding: a gather, timed as moving its ``2 T h`` output bytes at `hbm_bytes_per_s`;
    - the head (final norm, output projection, loss): 2 T h V FLOPs each for F, B and W; it keeps
      the fp32 logits and the bf16 input, ``T (4V + 2h)`` bytes, and for W ``2 T (h + V)``.

    Times are FLOPs / `flops_per_s` (400 TFLOP/s: an H100's 989 dense bf16 at 40% utilisation);
    a message is the ``2 T h`` activation bytes over `link_bytes_per_s`. Static memory is
    `bytes_per_param` per parameter: 7.5 is bf16 weights, fp32 gradients, and fp32 master weights
    and Adam moments sharded over 8 data-parallel ranks (2 + 4 + 12/8).

    >>> p = transformer_profile(name="tiny", num_layers=2, hidden=64, ffn=256, heads=4, vocab=1000, seq=128)
    >>> [x.name for x in p.layers], p.layers[1].f == p.layers[2].f
    (['embed', 'block.0', 'block.1', 'head'], True)
    """
    L = as_int(num_layers, "num_layers")
    h, ffn, heads, V = (as_int(v, k) for v, k in ((hidden, "hidden"), (ffn, "ffn"), (heads, "heads"), (vocab, "vocab")))
    kv = h * as_int(kv_heads if kv_heads is not None else heads, "kv_heads") // heads
    s, t = as_int(seq, "seq"), as_int(tensor_parallel, "tensor_parallel")
    T = as_int(micro_batch, "micro_batch") * s
    speed, hbm = as_number(flops_per_s, "flops_per_s", minimum=1.0), as_number(hbm_bytes_per_s, "hbm_bytes_per_s", minimum=1.0)
    k = 3 if gated else 2
    block_params = h * (2 * h + 2 * kv) + k * h * ffn
    attention = 2 * T * s * h  # causal: half of QK^T and AV
    act = T * (18 * h + 4 * ffn) / t
    block = Layer("block", f=(2 * block_params * T + attention) / t / speed, b=(2 * block_params * T + 2 * attention) / t / speed,
                  w=2 * block_params * T / t / speed, activation=act, wgrad=min(act, 2 * T * (5 * h + 2 * kv + k * ffn) / t),
                  static=block_params / t * bytes_per_param)
    gather = 2 * T * h / hbm
    head_flops = 2 * T * h * V / t / speed
    layers = [Layer("embed", f=gather, b=gather, w=gather, static=V * h / t * bytes_per_param)]
    layers += [Layer(f"block.{i}", block.f, block.b, block.w, block.activation, block.wgrad, block.static) for i in range(L)]
    layers.append(Layer("head", f=head_flops, b=head_flops, w=head_flops, activation=T * (4 * V + 2 * h) / t,
                        wgrad=2 * T * (h + V) / t, static=(V * h + h) / t * bytes_per_param))
    notes = {"num_layers": L, "hidden": h, "ffn": ffn, "heads": heads, "kv_heads": kv * heads // h, "vocab": V, "seq": s,
             "micro_batch": T // s, "gated": gated, "tensor_parallel": t, "flops_per_s": speed, "hbm_bytes_per_s": hbm,
             "link_bytes_per_s": link_bytes_per_s, "bytes_per_param": bytes_per_param}
    comm = 2 * T * h / t / as_number(link_bytes_per_s, "link_bytes_per_s", minimum=1.0)
    if not math.isfinite(comm):  # pragma: no cover - as_number refuses what would make it so
        raise ValueError("link_bytes_per_s gives an infinite message time")
    return Profile(tuple(layers), comm=comm, name=name, notes=notes)
