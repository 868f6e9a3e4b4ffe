"""Gradients of earlier steps kept apart from one step's own, so that a failed step can be undone.

`Pipeline(keep_grads_on_failure=True)` (the default): at a step's start ``.grad`` is set aside (the
tensor itself: no copy) and the step accumulates into fresh ``.grad`` tensors; at its end the kept
tensors get the step's gradients added and go back. A step that must reduce what ``no_sync``
steps accumulated together with its own accumulates in place instead, and keeps a copy (none of a
tensor known to hold zeros, such as a fixed buffer that replaced a None ``.grad``: zeros come back). A
``main_grad`` that no data-parallel reducer zeroes at the step's start (a tied parameter's too) is
copied and, unless the step reduces what ``no_sync`` steps accumulated, zeroed: the step's own
gradient fills it (a tied parameter's sum over its copies must not count the earlier steps once per
copy), and the copy is added back at the end. A tied parameter's ``.grad`` left in place (a fixed buffer
of task graphs, whose address a graph bakes in) is copied and zeroed for the same reason, and its copy
added back at the end. After a failure every kept tensor goes back as it was and the step's
gradients are dropped; a ``main_grad`` copy goes into the parameter's ``main_grad`` of that moment
(a reducer may have replaced the buffer).

With ``keep=False`` nothing is kept (no memory, no copies) but the tied parameters' gradients,
set aside as above (their sum over the copies counts the earlier steps once), and a failure sets
``.grad`` to None and zeroes ``main_grad``.

>>> import torch
>>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.ones(2)
>>> aside = GradientsAside([p], keep=True, in_place=False, copy_main_grad=True)
>>> p.grad is None
True
>>> p.grad = torch.full((2,), 5.0)        # the step's own gradient
>>> aside.take_back(); p.grad.tolist()    # success: earlier + the step's
[6.0, 6.0]
>>> aside = GradientsAside([p], keep=True, in_place=False, copy_main_grad=True)
>>> p.grad = torch.full((2,), 7.0)
>>> aside.discard_step(); p.grad.tolist() # failure: earlier only
[6.0, 6.0]
"""

from __future__ import annotations

import itertools
import operator
from typing import AbstractSet, Iterable

import torch
from torch import nn

from .._compat import foreach_zero_

__all__ = ["GradientsAside"]

_grad = operator.attrgetter("grad")


class GradientsAside:
    """Set the gradients of `params` aside for one step (see the module docstring).

    Args:
        params: the parameters whose gradients the step accumulates into.
        keep: keep earlier gradients across a failure at all (``keep_grads_on_failure``).
        in_place: leave ``.grad`` in place and keep a copy (the step reduces what ``no_sync``
            steps accumulated together with its own).
        copy_main_grad: copy ``main_grad`` (no reducer zeroes it at the step's start).
        reducer_owns: ids of parameters whose ``main_grad`` a data-parallel reducer owns (a view into
            its buckets); the others' (tied parameters', left out of it, or without one) are their own.
        reducer_zeroes: the reducer zeroes those it owns at this step's start: they are not copied.
        main_grad_aside: zero the copied ``main_grad`` that the reducer does not own, so that the
            step's gradient fills it alone, and add the copy back in `take_back` (False: the step
            reduces what ``no_sync`` steps accumulated there together with its own).
        zeroed: ids of parameters whose ``.grad`` is known to hold zeros (`in_place` keeps no copy
            of those: a failure zeroes them again).
        tied: ids of the tied parameters, set aside even without `keep` (their sum over the copies
            must count the earlier steps' gradient once); a failure still clears them then.
        tied_in_place: with `in_place` (task graphs' fixed buffers), copy and zero the tied
            parameters' ``.grad`` so that the step's gradient fills it alone, and add the copy back
            in `take_back` (False: the step reduces what ``no_sync`` steps accumulated there).
    """

    def __init__(self, params: Iterable[nn.Parameter], *, keep: bool, in_place: bool, copy_main_grad: bool,
                 zeroed: AbstractSet[int] = frozenset(), reducer_owns: AbstractSet[int] = frozenset(),
                 reducer_zeroes: bool = False, main_grad_aside: bool = False, tied: AbstractSet[int] = frozenset(),
                 tied_in_place: bool = False) -> None:
        self._params = list(params)
        self._keep = keep
        self._in_place = in_place
        self._aside: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (kept tensor, its values)
        self._zeros: list[torch.Tensor] = []  # kept tensors whose values were zeros
        self._main_copies: list[tuple[nn.Parameter, torch.Tensor]] = []  # (param, its main_grad's values)
        self._main_aside: list[tuple[nn.Parameter, torch.Tensor]] = []  # of `_main_copies`, zeroed: added back
        self._grad_aside: list[tuple[nn.Parameter, torch.Tensor]] = []  # tied .grad left in place, zeroed: added back
        # without `keep`, the tied parameters' only (`tied`): a sum over the copies of what each holds
        # must hold this step's gradient alone, else it counts the earlier steps' once per copy
        held_params = self._params if keep else [p for p in self._params if id(p) in tied]
        if not held_params or (not keep and in_place and not tied_in_place):  # the no_sync window's sums are laid down
            return
        # loops in C where they can: this runs before every step's first kernel. Every copy first,
        # then what changes a gradient: a copy that fails (out of memory) leaves them all as they were
        grads = list(map(_grad, held_params))
        aside = list(zip(held_params, grads))
        held = [(p, g) for p, g in aside if g is not None] if in_place else []
        zeros = [g for p, g in held if id(p) in zeroed]
        copies = [(g, g.clone()) for p, g in held if id(p) not in zeroed] if len(zeros) < len(held) else []
        main_copies: list[tuple[nn.Parameter, torch.Tensor]] = []
        if copy_main_grad:
            mains = [getattr(p, "main_grad", None) for p in held_params]
            if any(map(operator.is_not, mains, itertools.repeat(None))):  # by identity: == on tensors is slow
                # by parameter: the reducer's start_step may rebuild its buckets, a new main_grad
                main_copies = [(p, m.clone()) for p, m in zip(held_params, mains) if isinstance(m, torch.Tensor)
                               and not (reducer_zeroes and id(p) in reducer_owns)]
        self._aside, self._zeros, self._copies, self._main_copies = aside, zeros, copies, main_copies
        if in_place:  # p.grad stays; on failure it becomes this tensor again, with these values
            if tied_in_place:  # the copies of earlier gradients (none of zeros) double as what comes back
                copy_of = {id(g): c for g, c in self._copies}
                self._grad_aside = [(p, copy_of[id(g)]) for p, g in held if id(p) in tied and id(p) not in zeroed]
                if self._grad_aside:
                    foreach_zero_([p.grad for p, _ in self._grad_aside])
        else:
            for p in held_params:
                p.grad = None
        if main_grad_aside:  # set aside as .grad is: added back by take_back
            self._main_aside = [(p, c) for p, c in self._main_copies if id(p) not in reducer_owns]
            if self._main_aside:
                foreach_zero_([p.main_grad for p, _ in self._main_aside])

    def copies(self) -> dict[int, torch.Tensor]:
        """The copies kept of gradients left in place, by the id of the gradient tensor (read them only:
        a failed step restores from them)."""
        return {id(kept): copy for kept, copy in self._copies}

    def emptied(self) -> set[int]:
        """ids of the parameters whose ``.grad``, left in place, was zeroed for the step (`tied_in_place`):
        `take_back` adds their earlier gradients back, after the step's reductions."""
        return {id(p) for p, _ in self._grad_aside}

    def take_back(self) -> None:
        """The step succeeded: add its gradients to the kept ones and put those back. Called again
        after an interrupt, it goes on where it stopped (each parameter's gradient taken once)."""
        while self._aside:
            p, g = self._aside[-1]
            if self._in_place:
                # the step started from the kept values: a .grad it replaced (``p.grad = p.grad + g`` in a
                # backward_dw) or moved into main_grad (the reducer) already holds them; adding them again
                # would count the no_sync steps twice, putting them back would leave a stale .grad
                if g is not None and p.grad is not None and p.grad is not g:
                    g.copy_(p.grad)  # the same values in the tensor the caller knew
                    p.grad = g
            elif g is not None and g is not p.grad:  # else nothing set aside
                # the kept tensor goes back first: a Ctrl-C in the addition is raised once it
                # returned (CPython looks for signals after a call), and the call run again skips it
                own, p.grad = p.grad, g
                if own is not None:
                    g.add_(own)
            self._aside.pop()
        while self._main_aside:  # dropped before the addition, by no call: an interrupt is raised only after it
            p, copy = self._main_aside[-1]
            del self._main_aside[-1]
            p.main_grad.add_(copy)
        while self._grad_aside:  # dropped before the addition, by no call: an interrupt is raised only after it
            p, copy = self._grad_aside[-1]
            del self._grad_aside[-1]
            p.grad.add_(copy)
        self._copies, self._zeros, self._main_copies = [], [], []

    def discard_step(self) -> None:
        """The step failed: drop its gradients and restore the kept ones (or clear them all)."""
        if self._keep:
            for p, g in self._aside:
                p.grad = g
            for kept, copy in self._copies:
                kept.copy_(copy)
            for p, copy in self._main_copies:
                p.main_grad.copy_(copy)
            if self._zeros:
                foreach_zero_(self._zeros)
        else:
            for p in self._params:
                p.grad = None
                main = getattr(p, "main_grad", None)
                if isinstance(main, torch.Tensor):
                    main.zero_()
        self._aside, self._copies, self._zeros, self._main_copies, self._main_aside = [], [], [], [], []
        self._grad_aside = []
