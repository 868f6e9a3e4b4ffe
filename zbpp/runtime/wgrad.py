"""W tasks: a stage's delayed-wgrad modules, each behind one adapter that the executor calls.

A module *defers* its weight gradient (the protocol of docs/DESIGN.md) when `zbpp.modules.is_delayed`
says so: zbpp layers with ``delay_wgrad_compute=True``, Transformer Engine layers whose wgrad store
delays, and any other module with a ``backward_dw()`` that does not say it is off. Every other
module gets its weight gradients during B, so its W is empty.

Two adapters:

- `KeyedWgrad`: ``backward_dw(key)`` names the microbatch. zbpp layers (and any ``backward_dw`` that
  takes an argument) file each pending wgrad under the key recorded at forward time
  (`zbpp.modules.microbatch`); the runtime's key is ``(stage, microbatch)``, so a module shared by two
  stages of one rank (tied weights under a V placement) keeps their wgrads apart. A zbpp layer
  that filed nothing under a key (not called in that microbatch) is left alone.
- `FifoWgrad`: ``backward_dw()`` computes the *oldest* pending wgrad (Transformer Engine). Accepted
  only under schedules that keep each stage's W in B order (`zbpp.schedules.program.fifo_wgrad_problem`).
  Such a module files one wgrad per call that its B reaches, so W calls it as often (a hook on
  each call's outputs counts).

After a failed step the pending wgrads must go. A keyed module with ``discard_wgrad()`` drops them;
otherwise the adapter computes them (``backward_dw`` as many times as they are pending, which only
the public protocol needs) and the runtime discards the step's gradients with the rest.

>>> import torch
>>> StageWgrad(torch.nn.Sequential(torch.nn.Linear(2, 2))).modules
[]
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Hashable

import torch
from torch import nn

from .._compat import disable_dynamo, modules_and_parameters
from ..modules import is_delayed, supports_keys
from ..modules.context import forward_key
from ..modules.wgrad_store import WgradStoreError
from ._autograd_split import SavedBoxes, StageSplit, backward_input, run_backward
from .tree import flatten

if TYPE_CHECKING:
    from ._autograd_split import HeldWgrad

__all__ = ["StageWgrad", "KeyedWgrad", "FifoWgrad", "SavedBoxes", "delayed_modules", "is_delayed", "supports_keys",
           "check_fifo_wgrad", "has_own_wgrad", "owed_params"]


class KeyedWgrad:
    """A module whose ``backward_dw(key)`` computes the wgrad filed under `key`."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def compute(self, key: Hashable) -> None:
        try:
            self.module.backward_dw(key)
        except WgradStoreError:
            # nothing filed under `key`: the module took no part in that microbatch's backward (not
            # called, as an MoE expert without tokens, or its output unused), so, as with autograd,
            # that microbatch adds nothing to its gradients
            pass

    def discard(self, keys: list[Hashable]) -> None:
        drop = getattr(self.module, "discard_wgrad", None)
        if callable(drop):
            drop()
            return
        _each(keys, self.module.backward_dw)


class _Calls(dict):
    """Calls of a module per microbatch key (a dict that a weak reference can name)."""


class _Reached:
    """A hook on the outputs of one call of a FIFO module: the first of them that B (or W's rest of
    the backward) reaches counts the call once under its forward's key, as its backward then files
    one wgrad. Counted at F, a call whose output the loss never reads (an auxiliary head, a branch
    some microbatches skip) would make W pop a wgrad that nobody filed."""

    __slots__ = ("_calls", "_key", "_done")

    def __init__(self, calls: weakref.ref[_Calls], key: Hashable) -> None:
        self._calls, self._key, self._done = calls, key, False

    def __call__(self, grad: torch.Tensor) -> None:
        counts = self._calls()
        if not self._done and counts is not None:
            self._done = True
            counts[self._key] = counts.get(self._key, 0) + 1


@disable_dynamo  # host-side bookkeeping: a compiled stage calls it as it is
def _count_call(calls: weakref.ref[_Calls], output: Any) -> None:
    # a call under grad mode files one wgrad when its B reaches an output (`_Reached`). forward_key()
    # first: a reentrant checkpoint's first run (no grad) records the key for its re-run in B, the
    # call that counts. Only outputs with a graph: a hook on a leaf (a Parameter returned) would stay
    key = forward_key()
    if key is None or not torch.is_grad_enabled():
        return
    outs = [t for t in flatten(output)[0] if t.grad_fn is not None]
    if outs:
        reached = _Reached(calls, key)
        for t in outs:
            t.register_hook(reached)


class _CallCounter:
    """A forward hook counting into one adapter's `_Calls`, held weakly: the hook outlives no
    adapter's use. A copy (``copy.deepcopy``, ``torch.save`` of the model) counts nothing."""

    __slots__ = ("_calls",)

    def __init__(self, calls: _Calls | None) -> None:
        self._calls = weakref.ref(calls) if calls is not None else None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._calls is not None and self._calls() is not None:
            _count_call(self._calls, output)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_CallCounter, (None,))


class FifoWgrad:
    """A module whose ``backward_dw()`` computes its oldest pending wgrad (Transformer Engine).

    It files one wgrad per call whose output B reaches, so W(key) runs ``backward_dw()`` once per
    such call of F(key) (none where F did not call it or the loss did not read the output): once per
    microbatch would leave a reused module's second wgrad queued for a later W, the next step's. The
    hook holds the counts weakly and goes with them."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._calls = _Calls()
        handle = module.register_forward_hook(_CallCounter(self._calls))
        weakref.finalize(self._calls, handle.remove)

    def compute(self, key: Hashable) -> None:
        while self._calls.get(key, 0):
            self._one(key)

    def discard(self, keys: list[Hashable]) -> None:
        _each([k for k in keys for _ in range(self._calls.get(k, 0))], self._one)
        self._calls.clear()  # a key whose F ran but not its B filed nothing: its count goes too

    def _one(self, key: Hashable) -> None:
        # the count drops only once a call returned: one that raised (before taking its wgrad, or an
        # interrupt in a rollback) leaves it and the rest counted for `discard`, run again
        self.module.backward_dw()
        left = self._calls[key] - 1
        if left:
            self._calls[key] = left
        else:
            del self._calls[key]


def _each(keys: list[Hashable], dw: Any) -> None:
    """``dw(key)`` for every key of a failed step, whatever one of them raises: a wgrad left queued
    would be computed by a later step's W in place of its own (FIFO). A call may raise after it took
    its wgrad (a data-parallel reducer's hook refuses a wgrad of a parameter it already reduced), or
    find none (the module failed mid-B, or in the W that raised)."""
    for key in keys:
        try:
            dw(key)
        except Exception:  # noqa: BLE001 - best effort: the step's gradients are dropped anyway
            pass


def owed_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters whose weight gradients `module`'s ``backward_dw`` computes.

    ``get_backward_dw_params()`` when it has one. Without it (Transformer Engine style), every
    parameter under it but those of nested delayed modules (which answer for themselves): a
    wrapper's ``backward_dw`` may fill a plain child's gradients, so the reducers must wait for it.

    >>> owed_params(torch.nn.Sequential(torch.nn.Linear(2, 2)))[0].shape  # (no backward_dw: a plain walk)
    torch.Size([2, 2])
    >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> b.weight = a.weight  # one Parameter in two children: owed once (a reducer fires it once)
    >>> len(owed_params(torch.nn.Sequential(a, b)))
    3
    """
    getter = getattr(module, "get_backward_dw_params", None)
    if callable(getter):
        return list(getter())
    out: list[nn.Parameter] = []
    seen: set[int] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.extend(p for p in m.parameters(recurse=False) if id(p) not in seen)  # a shared one once
        seen.update(id(p) for p in m.parameters(recurse=False))
        todo.extend(c for c in reversed(list(m.children())) if not is_delayed(c))
    return out


def delayed_modules(stage: nn.Module) -> list[nn.Module]:
    """The outermost delayed-wgrad modules of `stage` (itself included), in ``modules()`` order.

    A delayed module's own ``backward_dw`` is responsible for any delayed module inside it, so W
    does not descend into one (that would compute those weight gradients twice).
    """
    found: list[nn.Module] = []
    seen: set[int] = set()
    todo = [stage]  # depth first, children in order (an explicit stack: no self-referencing closure)
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if is_delayed(m):
            found.append(m)
            continue
        todo.extend(reversed(list(m.children())))
    return found


class StageWgrad:
    """The W of one stage: an adapter per outermost delayed-wgrad module, and what is pending.

    `compute(key)` is W(s, j) with ``key = (s, j)``; the B of a microbatch notes its key as pending
    (`filed`, before it runs) so that `discard` knows what a failed step left pending. `held` is the rest of the stage's autograd
    backward when B split it off (`zbpp.runtime._autograd_split`): W runs it before the modules'.
    """

    def __init__(self, stage: nn.Module) -> None:
        self.modules = delayed_modules(stage)
        self._walked: list[nn.Module] = []  # the stage's modules (``modules()``) when last checked
        self._types: list[type] = []  # ... their classes (`delay_wgrad` changes a layer's)
        self._switchable: list[nn.Module] = []  # ... those with a backward_dw that did not delay then
        self._remember(modules_and_parameters(stage)[0])
        self.adapters = [KeyedWgrad(m) if supports_keys(m) else FifoWgrad(m) for m in self.modules]
        self._pending: list[Hashable] = []
        self._held: dict[Hashable, HeldWgrad] = {}
        self.b_hint = StageSplit()  # what the stage's split B learnt (`_autograd_split.backward_input`)

    def check_delayed(self, index: int, stage: nn.Module, walked: list[nn.Module]) -> None:
        """Raise when a module of stage `index` (`walked`: its ``modules()``) defers its weight gradients
        but is not one of `modules`: made so after the `Pipeline` was built (`delay_wgrad`, a layer
        swapped in, ``delay_wgrad_compute`` turned on), its W would never run and its weights would
        silently miss the step's gradients. Cheap while nothing changed (list comparisons)."""
        types = list(map(type, walked))
        if walked == self._walked and types == self._types and not any(map(is_delayed, self._switchable)):
            return
        known = {id(m) for m in self.modules}
        names = {id(m): n for n, m in stage.named_modules()}
        late = [names.get(id(m), type(m).__name__) or "the stage itself"
                for m in delayed_modules(stage) if id(m) not in known]
        if late:
            raise ValueError(
                f"stage {index}: delayed-wgrad layers {', '.join(late)} (weight gradients left to W) were not "
                "so when the Pipeline was built (zbpp.modules.delay_wgrad, a layer swapped in or "
                "delay_wgrad_compute turned on afterwards): the Pipeline would never run their W. Convert "
                "the model first, then build the Pipeline (or build a new one after changing its layers)"
            )
        self._remember(walked, types)

    def delaying(self) -> tuple[bool, ...]:
        """Whether each of `modules` defers its weight gradients now (``delay_wgrad_compute`` may be
        turned off since): what the reducers' bucket order depends on, so the replicas compare it."""
        return tuple(map(is_delayed, self.modules))

    def not_delaying(self, index: int, stage: nn.Module) -> list[str]:
        """The names of `modules` that no longer defer their weight gradients (stage `index`)."""
        names = {id(m): n for n, m in stage.named_modules()}
        return [f"stage {index} {names.get(id(m)) or 'itself'!r} ({type(m).__name__})"
                for m, on in zip(self.modules, self.delaying()) if not on]

    def _remember(self, walked: list[nn.Module], types: list[type] | None = None) -> None:
        self._walked, self._types = walked, types if types is not None else list(map(type, walked))
        self._switchable = [m for m in walked if callable(getattr(m, "backward_dw", None)) and not is_delayed(m)]

    @property
    def held(self) -> list[Hashable]:
        """The microbatch keys whose split-off backward waits for its W."""
        return list(self._held)

    @property
    def fifo_modules(self) -> list[nn.Module]:
        """The modules without microbatch keys (their W takes the oldest pending wgrad)."""
        return [a.module for a in self.adapters if isinstance(a, FifoWgrad)]

    def wgrad_param_ids(self) -> set[int]:
        """ids of the parameters this stage's W computes: `owed_params` of each delayed module,
        nested ones too (an outer module's ``backward_dw`` runs theirs)."""
        return {id(p) for a in self.adapters for m in a.module.modules() if is_delayed(m) for p in owed_params(m)}

    def backward(self, key: Hashable, roots: list[Any], grads: list[Any], inputs: list[Any],
                 saved: SavedBoxes | None = None, *, split: bool) -> None:
        """B of microbatch `key` (BW's first half): from `roots` with `grads` into the gradients of
        `inputs`. With `split` only what the inputs' gradient needs, holding the rest for
        `compute(key)` (`saved`: the boxes of its forward, whose input-only tensors go now); else the
        whole backward (plain modules' weight gradients now, delayed modules' filed for `compute`)."""
        # pending before B runs: one that fails half-way may have filed some modules' wgrads (those
        # after the failure in backward order), which `discard` must take too (a FIFO module would
        # hand the next step's W this one's)
        self.filed(key)
        if split:
            held = backward_input(roots, grads, inputs, self.b_hint, saved)
            if held is not None:
                self._held[key] = held
        else:
            run_backward(roots, grads)

    def filed(self, key: Hashable, held: HeldWgrad | None = None) -> None:
        if held is not None:
            self._held[key] = held
        if self.adapters:
            self._pending.append(key)

    def compute(self, key: Hashable) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            held.run()
        for a in self.adapters:
            a.compute(key)
        # only now: a W that raised may have left its wgrad queued, which `discard` must take
        if key in self._pending:
            self._pending.remove(key)

    def discard(self) -> None:
        """Drop (or compute and let the caller discard) every wgrad still pending. The keys go only
        at the end: run again after an interrupt, it drops what is left."""
        self._held.clear()  # the graphs and gradients kept for W go with it
        for a in self.adapters:
            try:
                a.discard(list(self._pending))
            except Exception:  # noqa: BLE001 - a module that failed mid-B may hold fewer: best effort
                pass
        self._pending = []


def check_fifo_wgrad(wgrad: dict[int, StageWgrad], schedule: Any) -> None:
    """Raise, naming the stage and its modules, when a stage's `FifoWgrad` modules cannot follow
    `schedule` (its W tasks out of B order: `zbpp.schedules.program.fifo_wgrad_problem`)."""
    from ..schedules.program import fifo_wgrad_problem

    for s, w in wgrad.items():
        fifo = w.fifo_modules
        problem = fifo_wgrad_problem(schedule, s) if fifo else None
        if problem is not None:
            names = ", ".join(sorted({type(d).__name__ for d in fifo}))
            raise ValueError(
                f"stage {s} has delayed-wgrad modules without microbatch keys ({names}: backward_dw() takes "
                f"the oldest pending wgrad), which schedule {schedule.name or 'custom'!r} cannot use: {problem}. "
                "Use a schedule that keeps each stage's W in B order, or modules that take a microbatch key "
                "(zbpp.modules)"
            )


def has_own_wgrad(stage: nn.Module, wgrad: StageWgrad) -> bool:
    """The stage has a parameter that no delayed-wgrad module computes in W: only then is there
    anything for the generic split to move out of B (a walk of the graph per microbatch)."""
    delayed = {id(p) for m in wgrad.modules for p in m.parameters()}
    return any(id(p) not in delayed for p in stage.parameters())
