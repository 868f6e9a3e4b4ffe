"""Data-parallel gradient reduction for the stages one pipeline rank holds.

Zero-bubble schedules finish weight gradients in W tasks, outside autograd and at different times
per stage, so a reducer driven by autograd hooks alone (DDP) misses them, and a W replayed from a
CUDA graph fires no hooks at all. `GradReducer` is told instead, by the runtime, when a stage's
gradients are final:

- ``stage_backward_done(s)`` after the stage's last B (or BW) of the step. The reducer asks each
  delayed-wgrad module of the stage ``get_backward_dw_params()`` (the parameters W still owes);
  every other parameter of the stage is final now (modules without the protocol get their weight
  gradients during B, and so does an FP8 bias), unless the runtime splits the stage's backward
  (`owe_all_to_wgrad`): then every parameter of the stage waits for its last W.
- ``stage_wgrad_done(s)`` after its last W (or BW): the reducer asks again and fires the reduce
  hooks of exactly those parameters. Delayed modules (the runtime's `is_delayed`) without
  ``get_backward_dw_params`` (Transformer Engine today, which offers
  ``register_wgrad_accumulation_and_reduce_hooks``) owe every parameter under them but those of
  delayed modules nested in them (`owed_params`: a wrapper's ``backward_dw`` may fill a plain
  child's gradients).

The answer is read every step, so a module whose list changes (zbpp modules drop their biases in
a step whose forwards all run in FP8) is handled; it must not change between a stage's last B and its last W. A
parameter owned by several stages of this rank (tied weights in a V placement) is final once every
owner has signalled. Final parameters fill buckets of a fixed layout (identical on all replicas,
which run the same schedule and signal in the same order); each full bucket is all-reduced
asynchronously over the data-parallel group while the pipeline goes on, and ``finish()`` waits for
all of them and proves that each parameter was reduced exactly once. When the readiness seen in a
step differs from the layout's (the first FP8 step), the next ``start_step`` rebuilds the layout so
that buckets again hold parameters that become final together.

Averaging is a pre-division by the number of replicas followed by a sum (gloo has no AVG). A
parameter whose ``.grad`` is None on a replica contributes zeros there, so every replica issues the
same collectives; it stays None only when it is None on every replica. Frozen parameters
(``requires_grad=False``) are left out; one unfrozen later joins at the next ``start_step``
(which rebuilds the buckets), and one frozen later stays in, reducing nothing. Which replicas had a
``.grad`` is host knowledge, so those presence counts travel on the host, over a gloo group
(`presence_group`), beside each bucket's reduction: applying a reduction never reads the device.
Without that group they travel in the bucket, which is read back (for a GPU bucket, a host sync).

``main_grad``: parameters of modules with ``fuse_wgrad_accumulation``, of Transformer Engine style
modules (whose ``backward_dw`` overwrites ``.grad``), those that already carry ``main_grad``, or all of
them with ``main_grad=True``, get a ``main_grad`` (fp32, or the parameter's dtype when wider) that
is a view into a bucket buffer, so those buckets are reduced in place. A post-accumulate-grad hook
moves any ``.grad`` of such a parameter into ``main_grad`` and clears it (Megatron's convention,
including ``grad_added_to_main_grad`` and ``zero_out_wgrad``): that is also what consumes the eager
FP8 bias gradient during B, which W then does not recreate. ``start_step`` zeroes the ``main_grad`` buffers (and may
replace them, see above: read ``p.main_grad`` after the step, do not keep it across steps), and
so does ``zero_main_grad``, which the runtime calls before the first ``no_sync`` step after a
synchronised one; ``.grad`` is left to the usual ``zero_grad``. Both point a ``main_grad`` that
another reducer took since (a second Pipeline over the same modules) back at this one's buffers.

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
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from .polling import wait_for
from .wgrad import is_delayed, owed_params

__all__ = ["GradReducer"]

_B = "B"  # signal: the stage's last B (or BW) ran
_W = "W"  # signal: the stage's last W (or BW) ran
_MiB = 1024 * 1024
_requires_grad = operator.attrgetter("requires_grad")


def _remove_handles(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


class _WeakHook:
    """A hook calling a reducer's method while the reducer lives (a no-op after): the parameters and
    modules it hooks outlive a dropped Pipeline, and must not keep its reducer and buckets alive."""

    __slots__ = ("_method",)

    def __init__(self, method: Callable[..., None]) -> None:
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args: Any) -> None:
        method = self._method()
        if method is not None:
            method(*args)


@dataclass(eq=False)
class _Entry:
    """One parameter: its owners, where it sits in its bucket, and this step's progress."""

    param: nn.Parameter
    name: str
    stages: tuple[int, ...]  # the stages of this rank that hold it
    uses_main_grad: bool
    layout: frozenset[tuple[int, str]] = frozenset()  # signals the bucket layout assumes
    seen: set[tuple[int, str]] = field(default_factory=set)  # signals that made it final this step
    observed: frozenset[tuple[int, str]] = frozenset()  # `seen` of the last complete step
    bucket: "_Bucket | None" = None
    main_view: torch.Tensor | None = None  # its main_grad: the view into its bucket's buffer
    offset: int = 0
    slot: int = 0  # index of its presence flag in a .grad bucket
    pending: set[int] = field(default_factory=set)  # owner stages that have not signalled yet
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
    work: Any = None
    present: torch.Tensor | None = None  # .grad buckets: per entry, how many replicas had a .grad (CPU)
    present_work: Any = None


class GradReducer:
    """Average the gradients of one pipeline rank's stages over the data-parallel replicas.

    Args:
        stage_modules: ``{stage index: module}`` for the stages this pipeline rank holds, already
            on their device.
        groups: a `ParallelGroups` (``dp`` and ``dp_group`` are used) or the pipeline's
            `Topology` (``dp_size`` and ``dp_group``), or None for no data
            parallelism (the exactly-once bookkeeping still runs).
        bucket_size_mb: largest bucket, in MiB of the reduced dtype; a larger parameter gets its own.
        main_grad: give every parameter a ``main_grad`` (see the module docstring for the
            parameters that get one anyway).
        exclude: ids of parameters to leave out, reduced elsewhere: the tied parameters, which
            `zbpp.runtime.tied` reduces (``{id(p) for p in tied_parameters.values()}``).
        presence_group: a gloo group of the same replicas as ``dp_group``, over which the
            presence counts of ``.grad`` buckets travel on the host (`Pipeline` builds one); None:
            they travel in the bucket (read back: a host sync for a GPU bucket).

    Per step the runtime calls `start_step`, then for every stage exactly once each
    `stage_backward_done` and (later) `stage_wgrad_done`, then `finish`; `abandon` instead of
    `finish` after a failed step.

    >>> import torch
    >>> r = GradReducer({0: torch.nn.Linear(2, 2)}, None, main_grad=True)
    >>> r.num_buckets, r.params()[0].main_grad.dtype
    (1, torch.float32)
    """

    def __init__(
        self,
        stage_modules: Mapping[int, nn.Module],
        groups: Any,
        *,
        bucket_size_mb: float = 25.0,
        main_grad: bool = False,
        exclude: set[int] | frozenset[int] = frozenset(),
        presence_group: Any = None,
    ) -> None:
        if not stage_modules:
            raise ValueError("GradReducer needs at least one stage module, got an empty mapping")
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb!r}")
        self._dp = int(getattr(groups, "dp_size", getattr(groups, "dp", 1))) if groups is not None else 1
        self._dp_group = getattr(groups, "dp_group", None) if groups is not None else None
        self._presence_group = presence_group
        self._cap_bytes = int(bucket_size_mb * _MiB)
        self._exclude = set(exclude)  # ids of parameters reduced elsewhere (tied parameters)
        self._stages = sorted(stage_modules)
        self._delayed: dict[int, list[nn.Module]] = {}
        self._stage_entries: dict[int, list[_Entry]] = {}
        self._entries: dict[int, _Entry] = {}  # id(param) -> entry
        self._owed_by_w_now: dict[int, list[_Entry]] = {}  # stage -> what its W owes this step
        self._hook_handles: list[Any] = []
        self._active = False
        self._in_step = False
        self._called: set[tuple[int, str]] = set()
        self._launched: list[_Bucket] = []
        self._split: set[int] = set()  # stages whose W computes every weight gradient
        #: called while waiting on the host for a reduction (it may raise): `Pipeline` passes its
        #: agreement's broken-job check, so a replica that never launches its part cannot hold this
        #: one until the group's timeout
        self.wait_check: Callable[[], None] | None = None
        self._modules = dict(stage_modules)
        self._all_main_grad = main_grad
        # every parameter it may have to reduce, and whether each trained at the last look: one
        # frozen when the reducer was built may train later (fine-tuning that unfreezes layers)
        self._candidates = [p for s in self._stages for p in stage_modules[s].parameters() if id(p) not in self._exclude]
        self._trainable = tuple(map(_requires_grad, self._candidates))
        self._classify(stage_modules, main_grad)
        self._buckets = self._make_buckets()
        self._main_ids: tuple[Any, frozenset[int]] = (None, frozenset())  # (buckets, `main_grad_param_ids`)
        self._install_hooks()
        # the hooks hold the reducer weakly: once its Pipeline is dropped it is freed (its buckets
        # too) and its hooks go, instead of moving the next Pipeline's .grad into its main_grad
        weakref.finalize(self, _remove_handles, self._hook_handles)
        self._active = True

    # -- construction -------------------------------------------------------------------------
    def _classify(self, stage_modules: Mapping[int, nn.Module], all_main_grad: bool,
                  keep: frozenset[int] | set[int] = frozenset()) -> None:
        """The entries of the trainable parameters (and of those in `keep`, ids of earlier
        entries: a parameter frozen since stays, its reductions of None change nothing)."""
        self._stage_entries, self._entries = {}, {}
        owners: dict[int, list[int]] = {}
        names: dict[int, str] = {}
        params: dict[int, nn.Parameter] = {}
        main: set[int] = set()
        for s in self._stages:
            root = stage_modules[s]
            if not isinstance(root, nn.Module):
                raise TypeError(f"stage {s}: expected an nn.Module, got {type(root).__name__}")
            # Every module with a W, nested ones too (W runs the outermost, whose backward_dw runs
            # theirs: their lists are merged, so nesting cannot count a parameter twice), whether
            # it delays now or not: what it owes is asked each step, so a switch is followed.
            self._delayed[s] = [m for m in root.modules() if callable(getattr(m, "backward_dw", None))]
            for m in root.modules():
                te_style = m in self._delayed[s] and not callable(getattr(m, "get_backward_dw_params", None))
                # Transformer Engine's backward_dw overwrites .grad, so its gradients accumulate elsewhere.
                if te_style or getattr(m, "fuse_wgrad_accumulation", False):
                    main.update(id(p) for p in m.parameters(recurse=False))
            # Reverse registration order: roughly the order in which backward finishes them.
            for n, p in reversed([(n, p) for n, p in root.named_parameters()
                                  if (p.requires_grad or id(p) in keep) and id(p) not in self._exclude]):
                params[id(p)] = p
                names.setdefault(id(p), f"stage {s} '{n}'")
                owners.setdefault(id(p), []).append(s)
                if all_main_grad or hasattr(p, "main_grad"):
                    main.add(id(p))
        for key, p in params.items():
            self._entries[key] = _Entry(p, names[key], tuple(owners[key]), key in main)
        for s in self._stages:
            self._stage_entries[s] = [e for e in self._entries.values() if s in e.stages]
            late = {id(e.param) for e in self._owed_by_w(s)}  # the first guess of the layout
            for e in self._stage_entries[s]:
                e.layout |= {(s, _W if id(e.param) in late else _B)}

    def owe_all_to_wgrad(self, stages: Iterable[int]) -> None:
        """Declare that the W of `stages` computes every weight gradient of those stages (the
        runtime's generic split, ``Pipeline(split_wgrad=True)``): their parameters are final only
        after the stage's last W. Call before the first step (the bucket layout is rebuilt)."""
        if self._in_step:
            raise RuntimeError("GradReducer.owe_all_to_wgrad() called inside a step; call it before the first step")
        self._split = set(stages) & set(self._stages)
        for s in self._split:
            for e in self._stage_entries[s]:
                e.layout = (e.layout - {(s, _B)}) | {(s, _W)}
        self._buckets = self._make_buckets()

    def _owed_by_w(self, stage: int) -> list[_Entry]:
        """The parameters the delayed modules of `stage` say their W produces, each once (all of the
        stage's under the generic split)."""
        if stage in self._split:
            return list(self._stage_entries[stage])
        out: dict[int, _Entry] = {}
        for m in self._delayed[stage]:
            out.update((id(e.param), e) for e in self._owed_by_module(stage, m))
        return list(out.values())

    def _owed_by_module(self, stage: int, module: nn.Module, strict: bool = True) -> list[_Entry]:
        """The entries of what `module`'s W produces; not `strict`: those it lists that are not
        the stage's entries are left out instead of refused."""
        getter = getattr(module, "get_backward_dw_params", None)
        if not callable(getter):  # Transformer Engine style: those under it (`owed_params`)
            if not is_delayed(module):
                return []
            own = [p for p in owed_params(module) if p.requires_grad and id(p) not in self._exclude]
            return [self._entries[id(p)] for p in own if strict or id(p) in self._entries]
        out = []
        for t in getter():
            if id(t) in self._exclude:  # reduced elsewhere (a tied parameter)
                continue
            e = self._entries.get(id(t))
            if (e is None or stage not in e.stages) and not strict:
                continue
            if e is None or stage not in e.stages:  # a wrong get_backward_dw_params: told at the stage's signals
                raise ValueError(
                    f"stage {stage}: {type(module).__name__}.get_backward_dw_params() returned a tensor of "
                    f"shape {tuple(t.shape)} that is not a trainable parameter of the stage module; "
                    "it must return the parameter objects themselves"
                )
            out.append(e)
        return out

    def _make_buckets(self) -> list[_Bucket]:
        """Group parameters that become final together, then cut the groups at the size cap."""
        groups: dict[tuple[Any, ...], list[_Entry]] = {}
        for e in self._entries.values():
            dtype = torch.promote_types(e.param.dtype, torch.float32) if e.uses_main_grad else e.param.dtype
            groups.setdefault((e.layout, e.uses_main_grad, dtype, e.param.device), []).append(e)
        buckets: list[_Bucket] = []
        for (_, uses_main, dtype, device), entries in groups.items():
            itemsize = torch.empty((), dtype=dtype).element_size()
            chunk: list[_Entry] = []
            size = 0
            for e in [*entries, None]:  # None flushes the last chunk
                n = 0 if e is None else e.param.numel()
                if chunk and (e is None or (size + n) * itemsize > self._cap_bytes):
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
                    e.main_view = b.buffer[e.offset : e.offset + e.param.numel()].view_as(e.param)
                    e.param.main_grad = e.main_view
        return buckets

    def _admit_unfrozen(self, keep_main_grad: bool) -> None:
        """Parameters that train now but did not when the entries were made (``requires_grad_(True)``
        after the reducer was built) join them: otherwise their gradients would stay each replica's
        own, silently. The layout and buffers are rebuilt; ``main_grad`` values are kept."""
        trainable = tuple(map(_requires_grad, self._candidates))
        if trainable == self._trainable:
            return
        self._trainable = trainable
        if all(id(p) in self._entries for p, t in zip(self._candidates, trainable) if t):
            return  # only freezing: a frozen entry stays (nothing to reduce, nothing wrong)
        old = self._entries
        kept = {key: e.param.main_grad.clone() for key, e in old.items() if keep_main_grad and e.uses_main_grad}
        self._classify(self._modules, self._all_main_grad, keep=frozenset(old))
        for key, e in self._entries.items():  # new ones: _classify's guess (split stages' included)
            if key in old:  # what earlier steps learnt about when it becomes final
                e.layout, e.observed = old[key].layout, old[key].observed
        self._buckets = self._make_buckets()
        for key, value in kept.items():
            self._entries[key].param.main_grad.copy_(value)
        for key, e in self._entries.items():
            if key not in old:
                self._hook_handles.append(e.param.register_post_accumulate_grad_hook(_WeakHook(self._after_accumulate)))

    def _install_hooks(self) -> None:
        for e in self._entries.values():
            self._hook_handles.append(e.param.register_post_accumulate_grad_hook(_WeakHook(self._after_accumulate)))
        for s, mods in self._delayed.items():
            for m in mods:
                register = getattr(m, "register_wgrad_accumulation_and_reduce_hooks", None)
                if callable(register):
                    handle = register(functools.partial(_WeakHook(self._after_module_wgrad), s, m))
                    if callable(getattr(handle, "remove", None)):
                        self._hook_handles.append(handle)

    def remove_hooks(self) -> None:
        """Detach from the parameters and modules (hooks that cannot be removed go inert; all do
        once the reducer is garbage-collected)."""
        _remove_handles(self._hook_handles)
        self._active = False

    def _reclaim_main_grad(self, keep: bool) -> None:
        """Point each ``main_grad`` back into this reducer's buckets where another gave it its own
        (a Pipeline built later over the same modules, an evaluation one say): this one reduces and
        zeroes its buckets, so gradients left in the other's would be neither averaged nor zeroed.
        `keep`: add what they hold to this one's (``no_sync`` steps' gradients on either side)."""
        for e in self._entries.values():
            if e.uses_main_grad and getattr(e.param, "main_grad", None) is not e.main_view:
                if keep and getattr(e.param, "main_grad", None) is not None:
                    e.main_view.add_(e.param.main_grad)
                e.param.main_grad = e.main_view

    # -- hooks --------------------------------------------------------------------------------
    @staticmethod
    def _grad_into_main_grad(e: _Entry) -> None:
        """Move ``.grad`` into ``main_grad`` unless the module already accumulated it there.

        Megatron's rule: a fused layer that added its gradient into ``main_grad`` sets
        ``grad_added_to_main_grad`` and hands autograd a placeholder, which is dropped; with
        ``zero_out_wgrad`` (a weight shared with an embedding) the placeholder is zeros and ``.grad``
        also holds the other uses' real gradient, so it is added.
        """
        p = e.param
        if p.grad is not None:
            if not getattr(p, "grad_added_to_main_grad", False) or getattr(p, "zero_out_wgrad", False):
                p.main_grad.add_(p.grad)
            p.grad = None

    def _check_not_final(self, e: _Entry, what: str) -> None:
        if self._in_step and e.ready:
            raise RuntimeError(
                f"{e.name}: {what} after the parameter was declared final for this step (by "
                f"{sorted(e.seen)}); its reduction already started. The runtime must call "
                "stage_backward_done / stage_wgrad_done only after the stage's last B / W."
            )

    def _after_accumulate(self, p: torch.Tensor) -> None:
        if not self._active:
            return
        e = self._entries[id(p)]
        self._check_not_final(e, "autograd accumulated a gradient")
        if e.uses_main_grad:
            self._grad_into_main_grad(e)

    def _after_module_wgrad(self, stage: int, module: nn.Module, *unused: Any) -> None:
        if not self._active:
            return
        # not strict: a reducer of a Pipeline built earlier over these layers, whose parameters were
        # replaced since, still hears their W; the new ones are not its own (its steps check the list)
        for e in self._owed_by_module(stage, module, strict=False):
            self._check_not_final(e, "backward_dw() ran")
            if e.uses_main_grad:
                self._grad_into_main_grad(e)  # Transformer Engine overwrites .grad at the next W: keep this one

    # -- the per-step protocol ----------------------------------------------------------------
    def start_step(self, keep_main_grad: bool = False) -> None:
        """Reset for a new step: zero ``main_grad`` buffers (unless `keep_main_grad`: they hold
        gradients accumulated without reduction, `Pipeline.no_sync`) and the counters."""
        self._drain()  # a failed step may have left reductions in flight: never apply them
        self._reclaim_main_grad(keep_main_grad)
        self._admit_unfrozen(keep_main_grad)
        if any(e.observed and e.observed != e.layout for e in self._entries.values()):
            kept = {id(e.param): e.param.main_grad.clone() for e in self._entries.values()
                    if keep_main_grad and e.uses_main_grad}
            for e in self._entries.values():
                e.layout = e.observed or e.layout
            self._buckets = self._make_buckets()
            for e in self._entries.values():
                if id(e.param) in kept:
                    e.param.main_grad.copy_(kept[id(e.param)])
        for b in self._buckets:
            b.waiting = len(b.entries)
            if b.uses_main_grad and not keep_main_grad:
                b.buffer.zero_()
        for e in self._entries.values():
            e.pending = set(e.stages)
            e.seen = set()
            e.ready = False
            e.reduced = 0
            if e.uses_main_grad and hasattr(e.param, "grad_added_to_main_grad"):
                e.param.grad_added_to_main_grad = False
        self._called.clear()
        self._owed_by_w_now.clear()
        self._in_step = True

    def stage_backward_done(self, stage: int) -> None:
        """The stage's last B (or BW) of the step ran: all but what its W still owes is final."""
        self._signal(stage, _B)
        late = self._owed_by_w(stage)
        self._owed_by_w_now[stage] = late
        owed = {id(e.param) for e in late}
        self._mark(stage, _B, [e for e in self._stage_entries[stage] if id(e.param) not in owed])

    def stage_wgrad_done(self, stage: int) -> None:
        """The stage's last W (or BW) of the step ran: fire the reduce hooks of what W produced."""
        self._signal(stage, _W)
        if (stage, _B) not in self._called:
            raise RuntimeError(
                f"stage_wgrad_done({stage}) before stage_backward_done({stage}): the last W of a stage "
                "always follows its last B; call stage_backward_done first (both after a BW)"
            )
        now = self._owed_by_w(stage)
        if {id(e.param) for e in now} != {id(e.param) for e in self._owed_by_w_now[stage]}:
            before = sorted(e.name for e in self._owed_by_w_now[stage])
            raise RuntimeError(
                f"get_backward_dw_params() of stage {stage} changed between its last B and its last W "
                f"(was {before}, now {sorted(e.name for e in now)}); it must describe the whole step"
            )
        self._mark(stage, _W, now)

    def finish(self) -> None:
        """Wait for every reduction, apply it, and check that each parameter was reduced once."""
        self._require_step("finish")
        self._drain(apply=True)
        self._in_step = False
        problems = []
        for s in self._stages:
            for phase, call in ((_B, "stage_backward_done"), (_W, "stage_wgrad_done")):
                if (s, phase) not in self._called:
                    problems.append(f"{call}({s}) was not called this step")
        for e in self._entries.values():
            if e.reduced != 1:
                waiting = f" (stages {sorted(e.pending)} never declared it final)" if e.pending else ""
                problems.append(f"{e.name} was reduced {e.reduced} times{waiting}")
        if problems:
            raise RuntimeError("gradient reduction is incomplete: " + "; ".join(problems))
        for e in self._entries.values():
            e.observed = frozenset(e.seen)

    def zero_main_grad(self) -> None:
        """Zero the ``main_grad`` buffers between steps: a ``no_sync`` window's first step (which calls
        no `start_step`) would otherwise add to the gradients of the last synchronised step."""
        if self._in_step:
            raise RuntimeError("GradReducer.zero_main_grad() called inside a step; call it between steps")
        self._reclaim_main_grad(keep=False)
        for b in self._buckets:
            if b.uses_main_grad:
                b.buffer.zero_()

    def abandon(self) -> None:
        """After a failed step: wait for reductions in flight, drop them, zero ``main_grad``."""
        self._drain()
        for b in self._buckets:
            if b.uses_main_grad:
                b.buffer.zero_()
        self._in_step = False

    # -- introspection ------------------------------------------------------------------------
    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def main_grad_param_ids(self) -> frozenset[int]:
        """ids of the parameters whose ``main_grad`` is a view into this reducer's buckets (zeroed by
        `start_step`); others' (tied parameters', left out) are their own, kept across steps."""
        if self._main_ids[0] is not self._buckets:  # asked every step: computed again only after a rebuild
            self._main_ids = (self._buckets, frozenset(id(e.param) for b in self._buckets if b.uses_main_grad
                                                       for e in b.entries))
        return self._main_ids[1]

    def params(self) -> list[nn.Parameter]:
        """The reduced parameters, each once."""
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

    def _mark(self, stage: int, phase: str, entries: list[_Entry]) -> None:
        full: list[_Bucket] = []
        for e in entries:
            e.pending.discard(stage)
            e.seen.add((stage, phase))
            if e.pending:
                continue  # another stage of this rank still holds it open
            e.ready = True
            if e.uses_main_grad:
                self._grad_into_main_grad(e)  # a W outside autograd (or a CUDA graph) may have left .grad
            e.bucket.waiting -= 1
            if e.bucket.waiting == 0:
                full.append(e.bucket)
        for b in sorted(full, key=lambda b: b.index):  # one order on every replica
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        for e in b.entries:
            e.reduced += 1
        self._launched.append(b)
        if self._dp == 1:
            return
        if not b.uses_main_grad:
            on_host = self._presence_group is not None
            if b.buffer is None:  # without a CPU group the presence counts follow the gradients
                b.buffer = torch.empty(b.numel + (0 if on_host else len(b.entries)), dtype=b.dtype, device=b.device)
            present = []
            for e in b.entries:
                view = b.buffer[e.offset : e.offset + e.param.numel()]
                g = e.param.grad
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g.reshape(-1))
                present.append(int(g is not None))
            b.present = torch.tensor(present, dtype=torch.int32)
            if on_host:
                b.present_work = dist.all_reduce(b.present, group=self._presence_group, async_op=True)
            else:
                b.buffer[b.numel :].copy_(b.present)
        b.buffer[: b.numel].div_(self._dp)  # presence counts in the buffer stay counts
        b.work = dist.all_reduce(b.buffer, op=dist.ReduceOp.SUM, group=self._dp_group, async_op=True)

    def _drain(self, apply: bool = False) -> None:
        """Wait for the launched reductions; with `apply`, copy the .grad buckets back."""
        for b in self._launched:
            if b.work is None:
                continue
            wait_for(b.work, self.wait_check, b.device)
            b.work = None
            if b.present_work is not None:
                wait_for(b.present_work, self.wait_check, torch.device("cpu"))
                b.present_work = None
            if not apply or b.uses_main_grad:
                continue  # main_grad buckets are reduced in place
            if self._presence_group is not None:
                present = b.present.tolist()  # a CPU tensor: no device sync
            else:
                present = b.buffer[b.numel :].tolist()
            for e in b.entries:
                if present[e.slot] == 0:
                    continue  # None on every replica: leave it None, as one process would
                view = b.buffer[e.offset : e.offset + e.param.numel()].view_as(e.param)
                if e.param.grad is None:
                    e.param.grad = view.clone()
                else:
                    e.param.grad.copy_(view)
        self._launched.clear()
