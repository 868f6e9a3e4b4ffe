"""Every reduction of one rank's gradients across a step, behind one object: `Reductions`.

A training step's gradients go through, in order:

- the *set-aside* (`zbpp.runtime.grad_aside`): gradients of earlier steps kept apart, so that a
  failed step can be undone (with CUDA graphs, after pointing ``.grad`` at its fixed buffers);
- the data-parallel reducer (`zbpp.runtime.grad_reduce.GradReducer`, FSDP's
  `zbpp.runtime.fsdp.FsdpReducer`, or the one given as ``Pipeline(reducer=...)``: any
  `GradientReducer`) and the tied parameters' sums (`zbpp.runtime.tied`), told when each stage's
  gradients are final. The executor tells them at the program's known boundaries
  (``RankProgram.last_backward`` / ``last_wgrad``), as `StageBoundaries`.

`Pipeline.step` drives one step: `set_aside`, `begin`, the tasks (which call
`stage_backward_done` / `stage_wgrad_done`), `finish`, then after the end agreement `commit` or
`rollback`. Inside ``no_sync()`` nothing is reduced (FSDP only reshards at the end) and the next
synchronised step reduces everything accumulated; an evaluation step only unshards and reshards
FSDP stages (`begin_eval`, `finish_eval`).

>>> import torch
>>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.ones(2)
>>> r = Reductions(reducer=None, fsdp=None, tied=None, owed_by_w=lambda s: set())
>>> r.set_aside([p], reducing=True); r.begin(lambda: False)
>>> p.grad = torch.full((2,), 2.0)  # the step's own gradient
>>> r.finish(); r.rollback(); p.grad.tolist()  # the step failed on some rank: earlier gradients only
[1.0, 1.0]
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
from torch import nn

from .grad_aside import GradientsAside
from .task_graphs import GradBuffers

__all__ = ["GradientReducer", "Reductions", "fsdp_reducer", "default_reducer", "presence_group"]


class GradientReducer(Protocol):
    """What a data-parallel reducer offers the pipeline (``Pipeline(reducer=...)``). Per step:
    `start_step`, then for every stage exactly once each `stage_backward_done` and (later)
    `stage_wgrad_done`, then `finish`; `abandon` instead of `finish` after a failed step.

    Optionally ``params()``, the parameters it reduces: `Pipeline` then refuses one that reduces a
    tied parameter (the pipeline sums those itself). Without it that cannot be checked: leave the
    tied parameters out yourself, or their gradients come out wrong without an error.

    Optionally ``zero_main_grad()``, called before the first step inside ``no_sync()`` after a
    synchronised step, when it zeroes ``main_grad`` at `start_step` (as `GradReducer` does): the
    window then starts from zeros as a synchronised step does."""

    def start_step(self, keep_main_grad: bool = False) -> None:
        """Before any task; `keep_main_grad`: ``main_grad`` holds unreduced no_sync steps."""

    def stage_backward_done(self, stage: int) -> None:
        """The stage's last B (or BW) of the step ran."""

    def stage_wgrad_done(self, stage: int) -> None:
        """The stage's last W (or BW) of the step ran."""

    def finish(self) -> None:
        """Wait for every reduction of the step and apply it."""

    def abandon(self) -> None:
        """After a failed step: drop what is in flight."""


class Reductions:
    """The reductions of one rank's gradients (see the module docstring).

    Args:
        reducer: the data-parallel reducer, or None (one replica); an `FsdpReducer` when `fsdp` is.
        fsdp: the `FsdpReducer` of ``fully_shard`` stages, or None.
        tied: the `TiedParameters` (or None: none).
        owed_by_w: ``stage ->`` ids of the parameters whose gradients only its W computes (their
            tied sums wait for the stage's last W).
        keep_grads_on_failure: gradients of earlier steps survive a failed step.
        fixed_grads: the fixed ``.grad`` buffers of CUDA graphs (`GradBuffers`), or None.
    """

    def __init__(self, *, reducer: GradientReducer | None, fsdp: Any,
                 tied: Any, owed_by_w: Callable[[int], set[int]], keep_grads_on_failure: bool = True,
                 fixed_grads: GradBuffers | None = None) -> None:
        self.reducer = reducer
        self.fsdp = fsdp
        self.tied = tied
        self._owed_by_w = owed_by_w
        self._keep = keep_grads_on_failure
        self.fixed_grads = fixed_grads
        self._mode = "eval"  # this step's: "sync", "no_sync" (inside Pipeline.no_sync) or "eval"
        self._aside: GradientsAside | None = None
        self._unreduced = False  # gradients hold steps accumulated inside no_sync()

    # -- a training step ------------------------------------------------------------------------
    def set_aside(self, params: Sequence[nn.Parameter], *, reducing: bool, later: bool = False) -> None:
        """Before a training step (on the caller's stream): keep the earlier gradients of `params`
        (this rank's, each once) apart. `reducing`: False inside ``no_sync()``. `later`: only
        take the step's mode now; `set_aside_cleared` sets the gradients aside before the step's first
        task that may touch one (the fixed buffers' `GradBuffers.cleared` case)."""
        self._mode = "sync" if reducing else "no_sync"
        self._aside = None
        if self._mode == "no_sync" and not self._unreduced and self.tied is not None:
            # a no_sync window begins: each tied copy holds the earlier steps' sum, which the next
            # synchronised step's sum over the copies would count once per copy (before the aside keeps it)
            self.tied.lay_down_reduced()
        if later:
            return
        zeroed: set[int] = set()
        if self.fixed_grads is not None:  # before the aside: it keeps what the fixed buffers hold
            zeroed = self.fixed_grads.attach(params)
        self._keep_aside(params, zeroed)

    def set_aside_cleared(self, params: Sequence[nn.Parameter], bufs: Sequence[torch.Tensor]) -> None:
        """`set_aside` of a step that said `later`, once its first tasks (no gradient read) ran, on
        the step's compute stream: ``.grad`` pointed at `bufs`, the fixed buffers that
        `GradBuffers.cleared` named (all zeros to come: nothing is copied)."""
        assert self.fixed_grads is not None
        self._keep_aside(params, self.fixed_grads.attach_cleared(params, bufs))

    def _keep_aside(self, params: Sequence[nn.Parameter], zeroed: set[int]) -> None:
        reducing = self._mode == "sync"
        accumulate = reducing and self._unreduced  # reduce the no_sync steps' gradients with this one's
        zeroing = reducing and self.reducer is not None and not self._unreduced  # its start_step zeroes main_grad
        # ... its own (`GradReducer.main_grad_param_ids`; None: a reducer that does not say): a tied
        # parameter's keeps the earlier steps', set aside so that its sum over the copies counts them once
        ids = getattr(self.reducer, "main_grad_param_ids", None)
        owned = ids() if callable(ids) else frozenset() if self.reducer is None else None
        self._aside = GradientsAside(params, keep=self._keep, in_place=accumulate or self.fixed_grads is not None,
                                     zeroed=zeroed, copy_main_grad=not zeroing or owned is not None,
                                     reducer_owns=owned or frozenset(), reducer_zeroes=zeroing,
                                     main_grad_aside=not accumulate and owned is not None,
                                     tied=self.tied.param_ids() if self.tied is not None else frozenset(),
                                     tied_in_place=self.fixed_grads is not None and not accumulate)
        if self.fixed_grads is not None:  # tied buffers zeroed: earlier gradients come back after the tie's sum
            self.fixed_grads.emptied(self._aside.emptied())

    def kept_copies(self) -> dict[int, torch.Tensor]:
        """The step's copies of gradients left in place (`GradientsAside.copies`; empty without them)."""
        return self._aside.copies() if self._aside is not None else {}

    def begin(self, draining: Callable[[], bool]) -> None:
        """Before the step's first task. `draining` tells whether this rank's step failed (FSDP
        then reduces zeros for what got no gradient, as the other replicas expect)."""
        if self.fsdp is not None:
            self.fsdp.begin_step(draining)
        if self._mode == "no_sync" and not self._unreduced and self.reducer is not None:
            # a no_sync window begins: main_grad still holds the last synchronised step's gradient
            zero = getattr(self.reducer, "zero_main_grad", None)
            if callable(zero):
                zero()
        if self._mode != "sync":
            return
        if self.reducer is not None:
            self.reducer.start_step(keep_main_grad=self._unreduced)  # no_sync steps' main_grad stays
        if self.tied is not None:
            self.tied.start_step()

    def stage_backward_done(self, stage: int) -> None:
        if self._mode != "sync":
            return
        if self.reducer is not None:
            self.reducer.stage_backward_done(stage)
        if self.tied is not None:
            self.tied.stage_done(stage, self._owed_by_w(stage))

    def stage_wgrad_done(self, stage: int) -> None:
        if self.fixed_grads is not None:  # first: the earlier gradients a W overwrote join this step's
            self.fixed_grads.add_back(stage)
        if self._mode != "sync":
            return
        if self.reducer is not None:
            self.reducer.stage_wgrad_done(stage)
        if self.tied is not None:
            self.tied.stage_done(stage, None)

    def finish(self) -> None:
        """After the last task, on a rank that did not fail: wait for the reductions (no_sync:
        FSDP only reshards; the unsharded gradients accumulate)."""
        if self._mode != "sync":
            if self.fsdp is not None:
                self.fsdp.end_step()
            return
        if self.reducer is not None:
            self.reducer.finish()
        if self.tied is not None:
            self.tied.finish()

    def commit(self) -> None:
        """Every rank succeeded: the step's gradients join the kept ones. Called again after an
        interrupt, it goes on where it stopped."""
        if self._aside is not None:
            self._aside.take_back()
        if self.tied is not None:
            self.tied.take_up_reduced(restore=False)
        self._unreduced = self._mode == "no_sync"
        self._aside = None

    def rollback(self) -> None:
        """Some rank failed: drop what is in flight and the step's gradients; restore the kept ones
        (or, without ``keep_grads_on_failure``, clear them all)."""
        for undo in self._undos():
            try:
                undo()
            except Exception:  # noqa: BLE001 - best effort: the step is lost anyway
                pass
        if self._aside is not None:
            self._aside.discard_step()
        if self.tied is not None:  # after the aside's: the sums laid down come back over it
            self.tied.take_up_reduced(restore=self._keep)
        self._aside = None

    def _undos(self) -> list[Callable[[], None]]:
        if self._mode != "sync":  # no_sync or evaluation: only FSDP's per-step state
            return [self.fsdp.abandon] if self.fsdp is not None else []
        return [r.abandon for r in (self.reducer, self.tied) if r is not None]

    # -- an evaluation step ---------------------------------------------------------------------
    def begin_eval(self) -> None:
        """Before an evaluation step: FSDP stages are unsharded (nothing is reduced)."""
        self._mode, self._aside = "eval", None
        if self.fsdp is not None:
            self.fsdp.begin_step()

    def finish_eval(self) -> None:
        if self.fsdp is not None:
            self.fsdp.end_step()


def fsdp_reducer(stage_modules: Mapping[int, nn.Module], topology: Any, first_forward: list[int],
                 reducer: Any) -> Any:
    """An `FsdpReducer` when a stage holds ``fully_shard`` modules (`zbpp.runtime.fsdp`), else None.
    `first_forward`: the stages in the order of their first F; `reducer`: the one the user gave
    (refused with FSDP)."""
    from .fsdp import FsdpReducer, holds_fsdp

    if not holds_fsdp(stage_modules):
        return None
    if reducer is not None:
        raise ValueError("reducer= cannot be combined with fully_shard stages: FSDP reduces their gradients")
    return FsdpReducer(stage_modules, topology.dp_size, first_forward)


def default_reducer(stage_modules: Mapping[int, nn.Module], topology: Any, tied: Any, timeout: timedelta) -> Any:
    """A `GradReducer` when there are data-parallel replicas (tied parameters left to `tied`), else None."""
    if topology.dp_size == 1:
        return None
    from .grad_reduce import GradReducer

    return GradReducer(stage_modules, topology, exclude=tied.param_ids(), presence_group=presence_group(topology, timeout))


def presence_group(topology: Any, timeout: timedelta) -> Any:
    """A gloo group of this rank's replicas, over which which parameters have a gradient travels on
    the host (a collective: every rank calls it, in the same order)."""
    from .channels import cached_group

    return [cached_group("dp-presence", [line[r] for line in topology.pipelines], "gloo", timeout)
            for r in range(topology.pp_size)][topology.pp_rank]
