"""Data-parallel gradient reduction for the stages one pipeline rank holds.

Zero-bubble schedules finish weight gradients in W tasks, outside autograd and at different times
per stage, so a reducer driven by autograd hooks alone (DDP) misses them, and a W replayed from a
CUDA graph fires no hooks at all. `GradReducer` is told instead, by the runtime, when a stage's
gradients are final:

- ``stage_backward_done(s)`` after the stage's last B (or BW) of the step: every parameter of stage
  ``s`` that no delayed-wgrad module owns is final (modules without the protocol get their weight
  gradients during B);
- ``stage_wgrad_done(s)`` after its last W (or BW): the reducer asks each delayed-wgrad module of the
  stage ``get_backward_dw_params()`` and fires those parameters' reduce hooks. Modules that only
  offer ``register_wgrad_accumulation_and_reduce_hooks`` (Transformer Engine today) count with all
  their own parameters.

A parameter owned by several stages of this rank (tied weights in a V placement) is final once every
owner has signalled. Final parameters are packed into buckets (a fixed layout, identical on all
replicas because the replicas run the same schedule and signal in the same order), and each full
bucket is all-reduced asynchronously over the data-parallel group while the pipeline goes on;
``finish()`` waits for all of them and proves that each parameter was reduced exactly once.

Averaging is a pre-division by the number of replicas followed by a sum (gloo has no AVG). A
parameter whose ``.grad`` is None on a replica contributes zeros there, so every replica issues the
same collectives; it stays None only when it is None on every replica (a presence count travels in
the same buffer).

``main_grad``: parameters of modules with ``fuse_wgrad_accumulation``, of Transformer Engine style
modules (whose ``backward_dw`` overwrites ``.grad``), those that already carry ``main_grad``, or all of
them with ``main_grad=True``, get an fp32 (fp64 for fp64 parameters) ``main_grad`` that is a view into
a bucket buffer, so those buckets are reduced in place. A post-accumulate-grad hook moves any
``.grad`` of such a parameter into ``main_grad`` and clears it (Megatron's convention, including
``grad_added_to_main_grad``); that is also what consumes the eager FP8 bias gradient during B, which
W then must not recreate. ``start_step`` zeroes the ``main_grad`` buffers; ``.grad`` is left to the
usual ``zero_grad``.

Example, on one process (no data parallelism: nothing is communicated, the bookkeeping still runs):

>>> import torch
>>> stage = torch.nn.Linear(4, 2)
>>> reducer = GradReducer({0: stage}, None)
>>> reducer.start_step()
>>> stage(torch.ones(3, 4)).sum().backward()
>>> reducer.stage_backward_done(0)
>>> reducer.stage_wgrad_done(0)
>>> reducer.finish()
>>> sorted(reducer.reduce_counts().values())
[1, 1]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GradReducer"]

_B = "B"  # signal: the stage's last B (or BW) ran
_W = "W"  # signal: the stage's last W (or BW) ran
_MiB = 1024 * 1024


@dataclass(eq=False)
class _Entry:
    """One parameter: what must happen before it is final, and where it sits in its bucket."""

    param: nn.Parameter
    name: str
    signals: frozenset[tuple[int, str]]
    uses_main_grad: bool
    bucket: "_Bucket | None" = None
    offset: int = 0
    slot: int = 0  # index of its presence flag in a .grad bucket
    pending: set[tuple[int, str]] = field(default_factory=set)
    ready: bool = False
    reduced: int = 0


@dataclass(eq=False)
class _Bucket:
    index: int
    entries: list[_Entry]
    uses_main_grad: bool
    dtype: torch.dtype
    device: torch.device
    numel: int
    buffer: torch.Tensor | None = None
    waiting: int = 0
    launched: bool = False
    work: Any = None


def _is_delayed(module: nn.Module) -> bool:
    """A delayed-wgrad module: it has ``backward_dw`` and says which parameters W produces."""
    return callable(getattr(module, "backward_dw", None)) and (
        callable(getattr(module, "get_backward_dw_params", None))
        or callable(getattr(module, "register_wgrad_accumulation_and_reduce_hooks", None))
    )


class GradReducer:
    """Average the gradients of one pipeline rank's stages over the data-parallel replicas.

    Args:
        stage_modules: ``{stage index: module}`` for the stages this pipeline rank holds.
        groups: a `ParallelGroups` (``dp`` and ``dp_group`` are used), or None for no data
            parallelism (the exactly-once bookkeeping still runs).
        bucket_size_mb: largest bucket, in MiB of the reduced dtype; a larger parameter gets its own.
        main_grad: give every parameter an fp32 ``main_grad`` (see the module docstring for the
            parameters that get one anyway).

    Per step the runtime calls `start_step`, then for every stage exactly once each
    `stage_backward_done` and `stage_wgrad_done`, then `finish`.

    >>> import torch
    >>> r = GradReducer({0: torch.nn.Linear(2, 2)}, None, main_grad=True)
    >>> r.num_buckets, hasattr(r.params()[0], "main_grad")
    (1, True)
    """

    def __init__(
        self,
        stage_modules: Mapping[int, nn.Module],
        groups: Any,
        *,
        bucket_size_mb: float = 25.0,
        main_grad: bool = False,
    ) -> None:
        if not stage_modules:
            raise ValueError("GradReducer needs at least one stage module, got an empty mapping")
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb!r}")
        self._dp = int(getattr(groups, "dp", 1)) if groups is not None else 1
        self._dp_group = getattr(groups, "dp_group", None) if groups is not None else None
        self._stages = sorted(stage_modules)
        self._delayed: dict[int, list[nn.Module]] = {}
        self._entries: dict[int, _Entry] = {}  # id(param) -> entry, in bucket-layout order
        self._hook_handles: list[Any] = []
        self._active = False
        self._in_step = False
        self._called: set[tuple[int, str]] = set()
        self._launch_order: list[_Bucket] = []
        self._classify(stage_modules, main_grad)
        self._buckets = self._make_buckets(int(bucket_size_mb * _MiB))
        self._install_hooks()
        self._active = True

    # -- construction -------------------------------------------------------------------------
    def _classify(self, stage_modules: Mapping[int, nn.Module], all_main_grad: bool) -> None:
        signals: dict[int, set[tuple[int, str]]] = {}
        names: dict[int, str] = {}
        params: dict[int, nn.Parameter] = {}
        main: set[int] = set()
        for s in self._stages:
            root = stage_modules[s]
            if not isinstance(root, nn.Module):
                raise TypeError(f"stage {s}: expected an nn.Module, got {type(root).__name__}")
            named = [(n, p) for n, p in root.named_parameters() if p.requires_grad]
            known = {id(p) for _, p in named}
            delayed_mods = [m for m in root.modules() if _is_delayed(m)]
            self._delayed[s] = delayed_mods
            late: set[int] = set()
            for m in delayed_mods:
                for p in self._dw_params(m, s, known):
                    late.add(id(p))
                if not callable(getattr(m, "get_backward_dw_params", None)):
                    # Transformer Engine style: backward_dw overwrites .grad, so accumulate elsewhere.
                    main.update(id(p) for p in m.parameters(recurse=False))
            for m in root.modules():
                if getattr(m, "fuse_wgrad_accumulation", False):
                    main.update(id(p) for p in m.parameters(recurse=False))
            # Reverse registration order: roughly the order in which backward finishes them.
            for n, p in reversed(named):
                key = id(p)
                params[key] = p
                names.setdefault(key, f"stage {s} '{n}'")
                signals.setdefault(key, set()).add((s, _W if key in late else _B))
                if all_main_grad or hasattr(p, "main_grad"):
                    main.add(key)
        for key, p in params.items():
            self._entries[key] = _Entry(p, names[key], frozenset(signals[key]), key in main)

    @staticmethod
    def _dw_params(module: nn.Module, stage: int, known: set[int]) -> list[nn.Parameter]:
        getter = getattr(module, "get_backward_dw_params", None)
        if not callable(getter):
            return [p for p in module.parameters(recurse=False) if p.requires_grad]
        out = []
        for t in getter():
            if id(t) not in known:
                raise ValueError(
                    f"stage {stage}: {type(module).__name__}.get_backward_dw_params() returned a tensor "
                    f"of shape {tuple(t.shape)} that is not a trainable parameter of the stage module; "
                    "it must return the parameter objects themselves"
                )
            out.append(t)
        return out

    def _make_buckets(self, cap_bytes: int) -> list[_Bucket]:
        groups: dict[tuple[Any, ...], list[_Entry]] = {}
        for e in self._entries.values():
            dtype = torch.promote_types(e.param.dtype, torch.float32) if e.uses_main_grad else e.param.dtype
            key = (e.signals, e.uses_main_grad, dtype, e.param.device)
            groups.setdefault(key, []).append(e)
        buckets: list[_Bucket] = []
        for (_, uses_main, dtype, device), entries in groups.items():
            itemsize = torch.empty((), dtype=dtype).element_size()
            chunk: list[_Entry] = []
            size = 0
            for e in entries + [None]:  # None flushes the last chunk
                n = 0 if e is None else e.param.numel()
                if chunk and (e is None or (size + n) * itemsize > cap_bytes):
                    buckets.append(_Bucket(len(buckets), chunk, uses_main, dtype, device, size))
                    chunk, size = [], 0
                if e is not None:
                    e.offset, e.slot = size, len(chunk)
                    chunk.append(e)
                    size += n
        for b in buckets:
            for e in b.entries:
                e.bucket = b
            if b.uses_main_grad:
                b.buffer = torch.zeros(b.numel, dtype=b.dtype, device=b.device)
                for e in b.entries:
                    e.param.main_grad = b.buffer[e.offset : e.offset + e.param.numel()].view_as(e.param)
        return buckets

    def _install_hooks(self) -> None:
        for e in self._entries.values():
            self._hook_handles.append(e.param.register_post_accumulate_grad_hook(self._after_accumulate))
        for s, mods in self._delayed.items():
            for m in mods:
                register = getattr(m, "register_wgrad_accumulation_and_reduce_hooks", None)
                if callable(register):
                    entries = tuple(self._entries[id(p)] for p in self._dw_params(m, s, set(self._entries)))
                    register(functools.partial(self._after_module_wgrad, entries))

    def remove_hooks(self) -> None:
        """Detach from the parameters and modules (module wgrad hooks cannot be removed: they go inert)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()
        self._active = False

    # -- hooks --------------------------------------------------------------------------------
    def _fold(self, e: _Entry) -> None:
        """Move ``.grad`` into ``main_grad`` unless the module already accumulated it there."""
        p = e.param
        if p.grad is not None:
            if not getattr(p, "grad_added_to_main_grad", False):
                p.main_grad.add_(p.grad)
            p.grad = None

    def _check_not_final(self, e: _Entry, what: str) -> None:
        if self._in_step and e.ready:
            raise RuntimeError(
                f"{e.name}: {what} after the parameter was declared final for this step "
                f"(signals {sorted(e.signals)}); its reduction already started. The runtime must call "
                "stage_backward_done / stage_wgrad_done only after the stage's last B / W."
            )

    def _after_accumulate(self, p: torch.Tensor) -> None:
        if not self._active:
            return
        e = self._entries[id(p)]
        self._check_not_final(e, "autograd accumulated a gradient")
        if e.uses_main_grad:
            self._fold(e)

    def _after_module_wgrad(self, entries: tuple[_Entry, ...]) -> None:
        if not self._active:
            return
        for e in entries:
            self._check_not_final(e, "backward_dw() ran")
            if e.uses_main_grad:
                self._fold(e)

    # -- the per-step protocol ----------------------------------------------------------------
    def start_step(self) -> None:
        """Reset for a new step: zero ``main_grad`` buffers and the counters."""
        self._wait_all()  # a step that failed half-way may still have reductions in flight
        for b in self._buckets:
            b.waiting = len(b.entries)
            b.launched = False
            b.work = None
            if b.uses_main_grad:
                b.buffer.zero_()
        for e in self._entries.values():
            e.pending = set(e.signals)
            e.ready = False
            e.reduced = 0
            if e.uses_main_grad and hasattr(e.param, "grad_added_to_main_grad"):
                e.param.grad_added_to_main_grad = False
        self._called.clear()
        self._launch_order.clear()
        self._in_step = True

    def stage_backward_done(self, stage: int) -> None:
        """The stage's last B (or BW) of the step ran: its ordinary parameters are final."""
        self._signal(stage, _B)
        self._mark(stage, _B, [e for e in self._entries.values() if (stage, _B) in e.signals], "")

    def stage_wgrad_done(self, stage: int) -> None:
        """The stage's last W (or BW) of the step ran: fire the reduce hooks of what W produced."""
        self._signal(stage, _W)
        entries: list[_Entry] = []
        seen: set[int] = set()
        for m in self._delayed[stage]:
            for p in self._dw_params(m, stage, set(self._entries)):
                if id(p) not in seen:
                    seen.add(id(p))
                    entries.append(self._entries[id(p)])
        self._mark(stage, _W, entries, "get_backward_dw_params() of a delayed module")

    def finish(self) -> None:
        """Wait for every reduction and check that each parameter was reduced exactly once."""
        self._require_step("finish")
        self._wait_all()
        problems = []
        for s in self._stages:
            for phase, call in ((_B, "stage_backward_done"), (_W, "stage_wgrad_done")):
                if (s, phase) not in self._called:
                    problems.append(f"{call}({s}) was not called this step")
        for e in self._entries.values():
            if e.reduced != 1:
                waiting = f" (still waiting for {sorted(e.pending)})" if e.pending else ""
                problems.append(f"{e.name} was reduced {e.reduced} times{waiting}")
        self._in_step = False
        if problems:
            raise RuntimeError("gradient reduction is incomplete: " + "; ".join(problems))

    # -- introspection ------------------------------------------------------------------------
    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def params(self) -> list[nn.Parameter]:
        """The reduced parameters, each once, in bucket-layout order."""
        return [e.param for e in self._entries.values()]

    def reduce_counts(self) -> dict[str, int]:
        """How often each parameter (``"stage S 'name'"``) was reduced in the current/last step."""
        return {e.name: e.reduced for e in self._entries.values()}

    # -- internals ----------------------------------------------------------------------------
    def _require_step(self, what: str) -> None:
        if not self._in_step:
            raise RuntimeError(f"GradReducer.{what}() called outside a step: call start_step() first")

    def _signal(self, stage: int, phase: str) -> None:
        what = "stage_backward_done" if phase == _B else "stage_wgrad_done"
        self._require_step(what)
        if stage not in self._delayed:
            raise ValueError(f"{what}({stage}): stage {stage} is not on this rank; it holds {self._stages}")
        if (stage, phase) in self._called:
            raise RuntimeError(f"{what}({stage}) called twice in one step; call it once, after the last task")
        self._called.add((stage, phase))

    def _mark(self, stage: int, phase: str, entries: Iterable[_Entry], source: str) -> None:
        full: list[_Bucket] = []
        for e in entries:
            sig = (stage, phase)
            if sig not in e.signals:
                raise RuntimeError(
                    f"{source} of stage {stage} now names {e.name}, which was not a delayed parameter "
                    "when the reducer was built; the set of delayed parameters must not change"
                )
            e.pending.discard(sig)
            if not e.pending:
                e.ready = True
                if e.uses_main_grad:
                    self._fold(e)  # a W outside autograd (or a CUDA graph) may have left .grad
                b = e.bucket
                b.waiting -= 1
                if b.waiting == 0:
                    full.append(b)
        for b in sorted(full, key=lambda b: b.index):  # one order on every replica
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        for e in b.entries:
            e.reduced += 1
        b.launched = True
        self._launch_order.append(b)
        if self._dp == 1:
            return
        if not b.uses_main_grad:
            if b.buffer is None:
                b.buffer = torch.empty(b.numel + len(b.entries), dtype=b.dtype, device=b.device)
            present = []
            for e in b.entries:
                view = b.buffer[e.offset : e.offset + e.param.numel()]
                g = e.param.grad
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g.reshape(-1))
                present.append(0.0 if g is None else 1.0)
            b.buffer[b.numel :].copy_(torch.tensor(present, dtype=b.dtype))
        b.buffer[: b.numel].div_(self._dp)  # presence flags stay counts
        b.work = dist.all_reduce(b.buffer, op=dist.ReduceOp.SUM, group=self._dp_group, async_op=True)

    def _wait_all(self) -> None:
        for b in self._launch_order:
            if b.work is None:
                continue
            b.work.wait()
            b.work = None
            if b.uses_main_grad:
                continue  # reduced in place
            present = b.buffer[b.numel :].tolist()
            for e in b.entries:
                if present[e.slot] == 0:
                    continue  # None on every replica: leave it None, as one process would
                view = b.buffer[e.offset : e.offset + e.param.numel()].view_as(e.param)
                if e.param.grad is None:
                    e.param.grad = view.clone()
                else:
                    e.param.grad.copy_(view)
        self._launch_order.clear()
