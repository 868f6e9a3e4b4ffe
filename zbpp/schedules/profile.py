"""Per-layer profiles of a model: what each layer costs in time and memory.

A `Profile` lists a model's layers in order (embedding first, head last for a language model),
each a `Layer` with its F, B and W time per microbatch, the activation memory F keeps until B,
the part of it B keeps until W (`wgrad`), and its static memory: parameter, gradient and
optimizer-state bytes, held for the whole step. A stage of consecutive layers costs their sums
(`Profile.stage_costs`), which is what the simulator and `zbpp.schedules.planner` work with.

A profile is given (numbers measured on a device by a runtime helper, or read with
`Profile.load`), or built from FLOP counts by `transformer_profile` at a stated throughput.

A layer's static bytes are all it holds, on a rank of its own. What several layers hold as one
(a tied embedding and LM head: one Parameter) is listed in `Profile.shared` (`Shared`: its
layers and the static bytes each counts for it), so that a stage or a rank holding several of
those layers (rank 0 of a V placement holds the first and the last) counts it once
(`Profile.stage_costs`, `Profile.static_per_rank`).

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

__all__ = ["POLICIES", "PolicyCost", "Layer", "Shared", "Profile", "transformer_profile"]

#: Per-layer activation policies, by the names the torch side (zbpp.models.recompute) uses.
POLICIES = ("none", "full", "selective", "offload")


@dataclass(frozen=True)
class PolicyCost:
    """What one layer costs under one activation policy, per microbatch.

    - `activation`: bytes on the device from the end of F to B (what F keeps, or, offloaded,
      what stays on the device once its copy to the host is done: nothing);
    - `wgrad`: bytes on the device from the end of B to W (the GEMM inputs and output gradients
      W needs; B re-creates them under recompute or brings them back under offload, so this may
      exceed `activation`: B then adds ``wgrad - activation``);
    - `recompute`: time added to B (the layer's forward for ``full``, its non-GEMM part for
      ``selective``);
    - `copy`: bytes copied to the host after F and back before B (``offload``), timed over the
      profile's `Profile.host_bytes_per_s` (see `zbpp.schedules.policies`);
    - `transient`: bytes the layer's B allocates above what the rank holds when it starts, at
      its highest (`Layer.transient` under this policy): the re-run forward's tensors under
      ``full`` and ``selective``, the reloaded ones under ``offload``.
    """

    activation: float
    wgrad: float
    recompute: float = 0.0
    copy: float = 0.0
    transient: float = 0.0

    def __post_init__(self) -> None:
        for key in ("activation", "wgrad", "recompute", "copy", "transient"):
            object.__setattr__(self, key, as_number(getattr(self, key), f"PolicyCost.{key}"))

    @classmethod
    def from_measured(cls, measured: Any, flops_per_s: float) -> "PolicyCost":
        """From what `zbpp.models.recompute.measure_activation_policies` reports for one policy
        (``kept_f_to_b``, ``kept_b_to_w``, ``host_bytes``, ``recompute_flops``, and ``b_transient``
        where it has one), the re-run timed at `flops_per_s` (matrix products only: an elementwise
        re-run counts 0).

        >>> from types import SimpleNamespace
        >>> got = SimpleNamespace(kept_f_to_b=2, kept_b_to_w=5, host_bytes=0, recompute_flops=3e12, b_transient=7)
        >>> PolicyCost.from_measured(got, flops_per_s=1e12)
        PolicyCost(activation=2.0, wgrad=5.0, recompute=3.0, copy=0.0, transient=7.0)
        """
        speed = as_number(flops_per_s, "flops_per_s", minimum=1.0)
        try:
            return cls(measured.kept_f_to_b, measured.kept_b_to_w, measured.recompute_flops / speed, measured.host_bytes,
                       getattr(measured, "b_transient", 0))
        except AttributeError as exc:
            raise ValueError(f"PolicyCost.from_measured: {measured!r} is not a measured activation cost: {exc}") from None


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
    #: the policies other than "none" this layer offers, by name (a mapping is stored as sorted pairs)
    policies: tuple[tuple[str, PolicyCost], ...] = ()
    #: bytes B allocates above what the rank holds when it starts, at its highest, freed by its
    #: end (a loss's float32 gradients; see `Profile.stage_costs`)
    transient: float = 0.0

    def __post_init__(self) -> None:
        for key in ("f", "b", "w", "activation", "wgrad", "static", "transient"):
            object.__setattr__(self, key, as_number(getattr(self, key), f"Layer {self.name!r}: {key}"))
        if self.wgrad > self.activation:
            raise ValueError(f"Layer {self.name!r}: need wgrad <= activation, got wgrad={self.wgrad!r} "
                             f"> activation={self.activation!r}")
        pairs = self.policies.items() if isinstance(self.policies, dict) else self.policies
        out = []
        for name, cost in pairs:
            if name not in POLICIES[1:]:
                raise ValueError(f"Layer {self.name!r}: unknown policy {name!r}; a layer may offer "
                                 f"{', '.join(POLICIES[1:])} (\"none\" is the layer's own numbers)")
            out.append((name, cost if isinstance(cost, PolicyCost) else PolicyCost(**cost)))
        object.__setattr__(self, "policies", tuple(sorted(out)))

    def offers(self) -> tuple[str, ...]:
        """The policies this layer can run under: "none" and those it lists."""
        return ("none",) + tuple(name for name, _ in self.policies)

    def cost(self, policy: str) -> PolicyCost:
        """What `policy` costs here; a layer that does not offer it (an embedding, say) runs as "none".

        >>> block = Layer("block", 2, 2, 1, activation=8, wgrad=4, policies={"full": PolicyCost(1, 4, recompute=2)})
        >>> block.cost("full"), block.cost("offload") == block.cost("none")
        (PolicyCost(activation=1.0, wgrad=4.0, recompute=2.0, copy=0.0, transient=0.0), True)
        """
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; the policies are {', '.join(POLICIES)}")
        return dict(self.policies).get(policy, PolicyCost(self.activation, self.wgrad, transient=self.transient))


@dataclass(frozen=True)
class Shared:
    """Static bytes that several layers each count in their `Layer.static` but that one rank holds
    once (a tied embedding and LM head: one Parameter where one rank holds both, as a V placement's
    rank 0 does; on two ranks, a copy each).

    `layers`: the indices of the layers that share it (at least two); `static`: the bytes each of
    them counts for it (its weight, gradient and optimizer state).

    >>> Shared("embed.weight", [3, 0], 96)
    Shared(name='embed.weight', layers=(0, 3), static=96.0)
    """

    name: str
    layers: tuple[int, ...]
    static: float

    def __post_init__(self) -> None:
        layers = tuple(sorted(as_int(i, f"Shared {self.name!r}: layer index", minimum=0) for i in self.layers))
        if len(set(layers)) != len(layers) or len(layers) < 2:
            raise ValueError(f"Shared {self.name!r}: needs two or more distinct layer indices, got {list(self.layers)!r}")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "static", as_number(self.static, f"Shared {self.name!r}: static"))

    def extra(self, held: Sequence[int] | range) -> float:
        """The bytes that summing the `Layer.static` of the layers `held` counts more than once for it."""
        k = sum(1 for i in self.layers if i in held)
        return (k - 1) * self.static if k > 1 else 0.0


@dataclass(frozen=True)
class Profile:
    """A model's layers in order, and the time one message between ranks takes (`comm`).

    `shared`: the static bytes layers share (`Shared`; a mapping per entry is read as its fields).
    """

    layers: tuple[Layer, ...]
    comm: float = 0.0
    name: str = ""
    notes: dict[str, Any] = field(default_factory=dict, compare=False)  #: how it was made (shapes, throughput)
    host_bytes_per_s: float = 0.0  #: host link bandwidth per direction, for "offload" copies (0: none)
    shared: tuple[Shared, ...] = ()  #: static bytes several layers count that a rank holds once

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ValueError("Profile: needs at least one layer")
        for layer in self.layers:
            if not isinstance(layer, Layer):
                raise ValueError(f"Profile: layers must be Layer objects, got {layer!r}")
        object.__setattr__(self, "comm", as_number(self.comm, "Profile.comm"))
        shared = tuple(x if isinstance(x, Shared) else Shared(**x) for x in self.shared)
        for x in shared:
            if x.layers[-1] >= len(self.layers):
                raise ValueError(f"Profile: shared {x.name!r} names layer {x.layers[-1]} of {len(self.layers)}")
            low = min(self.layers[i].static for i in x.layers)
            # each of its layers counts it in its own static bytes: more would make a rank's bytes negative
            if x.static > low * (1 + 1e-12):
                raise ValueError(f"Profile: shared {x.name!r} has static={x.static!r} bytes, more than layer "
                                 f"{min(x.layers, key=lambda i: self.layers[i].static)}'s own static={low!r}")
        object.__setattr__(self, "shared", shared)
        object.__setattr__(self, "host_bytes_per_s", as_number(self.host_bytes_per_s, "Profile.host_bytes_per_s"))
        copying = [x.name for x in self.layers if x.cost("offload").copy > 0 and "offload" in x.offers()]
        if copying and self.host_bytes_per_s <= 0:
            raise ValueError(f"Profile: layer {copying[0]!r} offers offload but the profile has no host link "
                             "bandwidth (Profile.host_bytes_per_s)")

    def offers(self) -> tuple[str, ...]:
        """Every policy some layer offers, in `POLICIES` order ("none" first)."""
        got = {q for layer in self.layers for q in layer.offers()}
        return tuple(q for q in POLICIES if q in got)

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

    def stage_costs(self, stages: Sequence[range], policies: Sequence[str] | None = None
                    ) -> tuple[Costs, Memory, list[float]]:
        """Per stage of the split: `Costs` (with `comm`), `Memory`, and the static bytes (what
        the stage's layers share, `shared`, counted once).

        `policies` gives each stage's activation policy (None: "none" everywhere), applied to
        every layer of the stage that offers it: B gains the layers' `PolicyCost.recompute`,
        memory is their kept bytes. Offload's copy time is not in B here: it depends on the
        schedule's gaps (`zbpp.schedules.policies.simulate_policies` adds what they do not hide).

        A stage's B transient (`Memory.transient_b`) runs its layers' B last to first: layer i's
        transient comes on top of what the layers after it changed (each ``wgrad - activation``),
        so it is the largest over i of that sum plus layer i's `PolicyCost.transient`. (A BW,
        which frees each layer's W bytes as it goes, is charged the same: at most what it holds.)

        >>> block = Layer("block", 2, 2, 1, activation=8, wgrad=4, policies={"full": PolicyCost(1, 4, recompute=2,
        ...               transient=7)})
        >>> costs, memory, _ = Profile([block, block]).stage_costs([range(0, 1), range(1, 2)], ["full", "none"])
        >>> costs.b, memory.activation, memory.wgrad, memory.transient_b
        ((4.0, 2.0), (1.0, 8.0), (4.0, 4.0), (7.0, 0.0))
        >>> Profile([block, block]).stage_costs([range(0, 2)], ["full"])[1].transient_b  # 4 - 1 kept by the last, + 7
        (10.0,)
        """
        self.check_split(stages)
        chosen = self._policies(stages, policies)
        f, b, w, static = ([sum(getattr(self.layers[i], k) for i in r) for r in stages] for k in ("f", "b", "w", "static"))
        static = [x - sum(sh.extra(r) for sh in self.shared) for x, r in zip(static, stages)]
        cost = [[self.layers[i].cost(q) for i in r] for r, q in zip(stages, chosen)]
        b = [x + sum(c.recompute for c in cs) for x, cs in zip(b, cost)]
        act = [sum(c.activation for c in cs) for cs in cost]
        wgrad = [sum(c.wgrad for c in cs) for cs in cost]
        # equal sums may differ in the last bit: a stage whose W keeps all F kept keeps no more
        wgrad = [a if a < x <= a * (1 + 1e-12) else x for x, a in zip(wgrad, act)]
        transient = []
        for cs in cost:
            top = run = 0.0
            for c in reversed(cs):  # B runs the stage's layers last to first
                top = max(top, run + c.transient)
                run += c.wgrad - c.activation
            transient.append(top)
        return (Costs(f=f, b=b, w=w, comm=self.comm), Memory(activation=act, wgrad=wgrad, transient_b=transient),
                static)

    def static_per_rank(self, stages: Sequence[range], placement: Sequence[int]) -> list[float]:
        """Per rank: the static bytes of the layers its stages hold (stage s on rank ``placement[s]``),
        what they share (`shared`) counted once per rank, however many of its stages hold it.

        >>> tied = Profile([Layer("embed", 0, 0, 0, static=8), Layer("block", 1, 1, 1, static=4),
        ...                 Layer("block", 1, 1, 1, static=4), Layer("head", 1, 1, 1, static=9)],
        ...                shared=[Shared("embed.weight", (0, 3), 8)])
        >>> tied.static_per_rank([range(0, 1), range(1, 2), range(2, 3), range(3, 4)], [0, 1, 1, 0])  # V
        [9.0, 8.0]
        >>> tied.static_per_rank([range(0, 2), range(2, 4)], [0, 1])  # a copy on each rank
        [12.0, 13.0]
        """
        self.check_split(stages)
        if len(placement) != len(stages):
            raise ValueError(f"a placement of {len(placement)} stages for a split of {len(stages)}; give a rank per stage")
        held: list[set[int]] = [set() for _ in range(max(placement) + 1)]
        for r, q in zip(stages, placement):
            held[q].update(r)
        return [float(sum(self.layers[i].static for i in mine)) - sum(sh.extra(mine) for sh in self.shared)
                for mine in held]

    def stage_copies(self, stages: Sequence[range], policies: Sequence[str] | None = None) -> list[float]:
        """Per stage: the time one microbatch's offload copy takes one way (bytes over `host_bytes_per_s`).

        >>> block = Layer("b", 1, 1, 1, activation=8, wgrad=4, policies={"offload": PolicyCost(0, 4, copy=8)})
        >>> Profile([block, block], host_bytes_per_s=4).stage_copies([range(0, 1), range(1, 2)], ["offload", "none"])
        [2.0, 0.0]
        """
        self.check_split(stages)
        copy = [sum(self.layers[i].cost(q).copy for i in r) for r, q in zip(stages, self._policies(stages, policies))]
        return [c / self.host_bytes_per_s if c else 0.0 for c in copy]

    def stage_host_bytes(self, stages: Sequence[range], policies: Sequence[str] | None = None) -> list[float]:
        """Per stage: the bytes one microbatch's offload copies to host memory (0 where nothing is offloaded).

        >>> block = Layer("b", 1, 1, 1, activation=8, wgrad=4, policies={"offload": PolicyCost(0, 4, copy=8)})
        >>> Profile([block, block], host_bytes_per_s=4).stage_host_bytes([range(0, 2)], ["offload"])
        [16.0]
        """
        self.check_split(stages)
        return [float(sum(self.layers[i].cost(q).copy for i in r)) for r, q in zip(stages, self._policies(stages, policies))]

    def _policies(self, stages: Sequence[range], policies: Sequence[str] | None) -> list[str]:
        if policies is None:
            return ["none"] * len(stages)
        chosen = list(policies)
        if len(chosen) != len(stages):
            raise ValueError(f"{len(chosen)} policies for {len(stages)} stages; give one per stage")
        for q in chosen:
            if q not in POLICIES:
                raise ValueError(f"unknown policy {q!r}; the policies are {', '.join(POLICIES)}")
        return chosen

    # -- files -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        layers = [{**asdict(x), "policies": {q: asdict(c) for q, c in x.policies}} for x in self.layers]
        out = {"name": self.name, "comm": self.comm, "host_bytes_per_s": self.host_bytes_per_s, "notes": self.notes,
               "layers": layers}
        if self.shared:  # left out where nothing is shared: such a file reads as before
            out["shared"] = [{"name": x.name, "layers": list(x.layers), "static": x.static} for x in self.shared]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Profile":
        """A profile from `to_dict`'s form. A file without ``"shared"`` (written before profiles
        listed what layers share) reads as sharing nothing: every layer's static bytes count in
        full wherever it is, so a tied weight counts twice on a rank holding both its layers."""
        try:
            layers = [Layer(**x) for x in data["layers"]]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"a profile needs 'layers': a list of {{name, f, b, w, activation, wgrad, static}}: {exc}") from None
        try:
            shared = [Shared(**x) for x in data.get("shared", [])]
        except TypeError as exc:
            raise ValueError(f"a profile's 'shared' is a list of {{name, layers, static}}: {exc}") from None
        return cls(layers, comm=data.get("comm", 0.0), name=data.get("name", ""), notes=data.get("notes", {}),
                   host_bytes_per_s=data.get("host_bytes_per_s", 0.0), shared=shared)

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
    host_bytes_per_s: float = 50e9,
    loss_bytes_per_logit: float = 8.0,
) -> Profile:
    """A decoder-only transformer's profile from FLOP counts: embedding, `num_layers` blocks, head.

    Per microbatch of ``T = micro_batch * seq`` tokens, on one of `tensor_parallel` ranks (FLOPs,
    activations and parameters divided among them):

    - a block with P weights (attention ``h(2h + 2 kv)``, MLP ``(3 if gated else 2) h ffn``):
      F = 2PT + 2 T s h FLOPs (causal attention), B = 2PT + 4 T s h, W = 2PT; it keeps
      ``2 T (n h + 2 h + 2 kv + g ffn)`` activation bytes in bf16 with flash attention (its
      ``5 a s^2 b`` scores never stored): each norm its input, and a gated block's RMSNorm also
      the normalised and the weighted tensors (n = 6; a LayerNorm block n = 4), attention its
      Q, K, V and output, the MLP ``g ffn`` (gated: gate, its activation, up and the down
      projection's input, g = 4; else the activation's input and output, g = 2); of which W needs
      the linears' inputs and output gradients, ``2 T (5h + 2 kv + k ffn)``. These are the bytes
      torch saves for a Hugging Face Llama layer (gated) under SDPA
      (tests/models/test_activation_policies.py checks them, the logsumexp and the norms'
      ``1 / rms`` aside);
    - a block's policies (`PolicyCost`; bf16, per rank of `tensor_parallel`, sequence-parallel):
      ``none`` keeps the bytes above; ``full`` keeps only the block's input, ``2 T h`` (Korthikanti
      et al.'s ``2 s b h``), and B recomputes the block's forward (B + F); ``selective``
      (`zbpp.models.recompute`) keeps the block's input and every weight GEMM's input and output up
      to the last one backward reads (QKV input ``h``, Q, K, V ``h + 2 kv``, the output projection's
      input and output ``2h``, the MLP's input ``h``, its ``k ffn`` up to the down projection's
      input), ``2 T (6 h + 2 kv + k ffn)``, and B recomputes the rest: attention (its FLOPs) and
      the elementwise work (writing the bytes not kept once at `hbm_bytes_per_s`); ``offload``
      keeps nothing on the device between F and B and copies the ``none`` bytes to the host and
      back over `host_bytes_per_s` (per direction; 50 GB/s: PCIe 5 x16). Every policy's W keeps
      the same bytes after B (B re-creates or reloads them). B's transient (`PolicyCost.transient`)
      is what it re-creates or reloads, the ``none`` bytes less those kept (a formula, not a
      measurement: the re-run's or reload's tensors alive at once, as ``none`` keeps them);
    - the embedding: a gather, timed as moving its ``2 T h`` output bytes at `hbm_bytes_per_s`;
    - the head (final norm, output projection, loss): 2 T h V FLOPs each for F, B and W; it keeps
      the fp32 logits and the bf16 input, ``T (4V + 2h)`` bytes, and for W ``2 T (h + V)``; its B
      allocates ``loss_bytes_per_logit * T V`` bytes above that while it runs (8: the float32
      gradients of the log-softmax's output and of the logits, alive at once; 0 for a fused or
      chunked loss).

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
    norms, mlp = (6 * h, 4 * ffn) if gated else (4 * h, 2 * ffn)
    act = 2 * T * (norms + 2 * h + 2 * kv + mlp) / t
    f_block = (2 * block_params * T + attention) / t / speed
    wgrad = min(act, 2 * T * (5 * h + 2 * kv + k * ffn) / t)
    kept = min(act, 2 * T * (6 * h + 2 * kv + k * ffn) / t)
    policies = {"full": PolicyCost(2 * T * h / t, wgrad, recompute=f_block, transient=act - 2 * T * h / t),
                "selective": PolicyCost(kept, wgrad, recompute=attention / t / speed + (act - kept) / hbm,
                                        transient=act - kept),
                "offload": PolicyCost(0.0, wgrad, copy=act, transient=act)}
    block = Layer("block", f=f_block, b=(2 * block_params * T + 2 * attention) / t / speed,
                  w=2 * block_params * T / t / speed, activation=act, wgrad=wgrad,
                  static=block_params / t * bytes_per_param, policies=policies)
    gather = 2 * T * h / hbm
    head_flops = 2 * T * h * V / t / speed
    layers = [Layer("embed", f=gather, b=gather, w=gather, static=V * h / t * bytes_per_param)]
    layers += [Layer(f"block.{i}", block.f, block.b, block.w, block.activation, block.wgrad, block.static, block.policies)
               for i in range(L)]
    layers.append(Layer("head", f=head_flops, b=head_flops, w=head_flops, activation=T * (4 * V + 2 * h) / t,
                        wgrad=2 * T * (h + V) / t, static=(V * h + h) / t * bytes_per_param,
                        transient=as_number(loss_bytes_per_logit, "loss_bytes_per_logit") * T * V / t))
    notes = {"num_layers": L, "hidden": h, "ffn": ffn, "heads": heads, "kv_heads": kv * heads // h, "vocab": V, "seq": s,
             "micro_batch": T // s, "gated": gated, "tensor_parallel": t, "flops_per_s": speed, "hbm_bytes_per_s": hbm,
             "link_bytes_per_s": link_bytes_per_s, "bytes_per_param": bytes_per_param, "host_bytes_per_s": host_bytes_per_s,
             "loss_bytes_per_logit": loss_bytes_per_logit}
    comm = 2 * T * h / t / as_number(link_bytes_per_s, "link_bytes_per_s", minimum=1.0)
    if not math.isfinite(comm):  # pragma: no cover - as_number refuses what would make it so
        raise ValueError("link_bytes_per_s gives an infinite message time")
    return Profile(tuple(layers), comm=comm, name=name, notes=notes,
                   host_bytes_per_s=as_number(host_bytes_per_s, "host_bytes_per_s", minimum=1.0))
