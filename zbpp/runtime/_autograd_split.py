"""Split one stage's autograd backward into B (input gradients) and W (weight gradients).

`backward_input` walks the graph from the stage's outputs once per microbatch and sorts its nodes:

- the *input side*: nodes with a path to a stage input that requires grad (or to a parameter that
  must get its gradient in B, see below). B runs the engine with ``inputs=`` those tensors, so each
  node computes only its outputs towards the input side (addmm: the gradient of ``mat1``, not of
  the weight);
- the *frontier*: input-side nodes with an edge off the input side (towards a weight). A pre-hook
  keeps each one's incoming gradient during B;
- the *weight side*: everything below those edges, and the outputs' nodes that reach no input
  (the whole graph on the first stage).

`HeldWgrad.run` (W) calls each frontier node again on its kept gradient, inside a tiny engine call
that asks for exactly the frontier's off-side children: a node computes only the outputs whose
next node the running graph task needs, so W computes no input gradient again. One engine call
then runs the weight side from those outputs, accumulating into ``.grad`` as a plain backward would
(hooks fire). Its graph never reaches the input side, so W's cost does not grow with depth.

A custom autograd Function on the input side computes all its outputs in B (zbpp's delayed layers
file their weight gradient there, an eager FP8 bias gets its gradient): the leaves below its
off-side edges become B's targets. Reentrant ``torch.utils.checkpoint`` refuses an engine call
limited by ``inputs``: a graph holding one runs its whole backward in B. Post-hooks registered on
a frontier node (``Node.register_hook``) see only its B call.

Memory: B keeps the graph. `SavedBoxes` (around the forward) boxes every tensor autograd saves;
after B it frees the boxes that only non-frontier input-side nodes unpacked (W never runs those
nodes: attention probabilities, activation inputs), so what stays until W is what W reads.

Its private torch call (the autograd engine entry point) goes through `zbpp._compat`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Sequence

import torch

from .._compat import CHECKPOINT_SAVE_INPUTS, engine_run_backward

try:  # non-reentrant checkpoint: the W calls of one microbatch share one recomputation
    from torch.utils.checkpoint import GraphExecGroup as _RecomputeOnce  # recent torch
except ImportError:  # pragma: no cover - older torch: W's two engine calls may recompute twice
    _RecomputeOnce = contextlib.nullcontext  # type: ignore[assignment,misc]

from torch.autograd.function import BackwardCFunction as _PyNode
from torch.autograd.graph import GradientEdge
from torch.utils.checkpoint import CheckpointFunction as _ReentrantCheckpoint

__all__ = ["HeldWgrad", "SavedBoxes", "backward_input"]

_KEEP, _B_ONLY = 1, 2
_in_frontier = threading.local()  # set while a frontier node runs in B (on the thread running it)


class _Box:
    __slots__ = ("t", "mark")

    def __init__(self, t: torch.Tensor) -> None:
        self.t: torch.Tensor | None = t
        self.mark = 0


class SavedBoxes:
    """The tensors autograd saves during one F, each in a box, so that B can free those only
    input-side nodes used (W will not run them). Use as a context manager around the forward."""

    __slots__ = ("boxes", "_hooks")

    def __init__(self) -> None:
        self.boxes: list[_Box] = []
        self._hooks: Any = None

    def __enter__(self) -> "SavedBoxes":
        boxes = self.boxes

        def pack(t: torch.Tensor) -> _Box:
            # An alias: a stage output whose storage is released once sent (``t.data = ...``) must
            # stay whole for a node that saved it.
            b = _Box(t.detach())
            if _saved_by_checkpoint():
                b.mark = _KEEP  # a checkpointed region's input: W's recomputation reads it again
            boxes.append(b)
            return b

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)

    def free_input_only(self) -> None:
        """After B: drop what only nodes B ran and W will not run unpacked."""
        for b in self.boxes:
            if b.mark == _B_ONLY:
                b.t = None
        self.boxes = []


def _saved_by_checkpoint() -> bool:
    # called from pack: non-reentrant checkpoint saves its inputs from save_inputs (through a
    # comprehension's own frame before Python 3.12)
    f = sys._getframe(2)
    return f is not None and (f.f_code is CHECKPOINT_SAVE_INPUTS
                              or (f.f_back is not None and f.f_back.f_code is CHECKPOINT_SAVE_INPUTS))


def _unpack(b: _Box) -> torch.Tensor:
    if b.t is None:
        raise RuntimeError("zbpp split backward: a saved tensor freed after B was needed again (a bug)")
    if getattr(_in_frontier, "on", False):
        b.mark = _KEEP
    elif b.mark == 0:
        b.mark = _B_ONLY
    return b.t

_ACC: type | None = None  # torch's AccumulateGrad node type, found on first use


def _acc_type() -> type:
    global _ACC
    if _ACC is None:
        p = torch.zeros(1, requires_grad=True)
        _ACC = type(p.view_as(p).grad_fn.next_functions[0][0])
    return _ACC


class HeldWgrad:
    """What B(s, j) leaves for W(s, j): the frontier nodes with their kept gradients, and the outputs
    that do not depend on an input."""

    __slots__ = ("frontier", "roots", "grads")

    def __init__(self, frontier: list[tuple[Any, tuple, list[tuple[int, Any, int]]]],
                 roots: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.frontier = frontier  # (node, its incoming gradients, its off-side edges (index, child, input_nr))
        self.roots, self.grads = roots, grads

    def run(self) -> None:
        """Compute the weight gradients (once: everything is dropped as it runs)."""
        frontier, roots, grads = self.frontier, self.roots, self.grads
        self.frontier, self.roots, self.grads = [], [], []
        with _RecomputeOnce():
            if frontier:
                _apply_off_side(frontier, roots, grads)
            del frontier
            if roots:
                engine_run_backward(roots, grads)


def _apply_off_side(frontier: list[tuple[Any, tuple, list[tuple[int, Any, int]]]], roots: list[Any],
                    grads: list[torch.Tensor]) -> None:
    """Re-run each frontier node on its kept gradient, computing only its off-side outputs, and add
    them to `roots`/`grads` as gradient edges.

    A node computes the outputs whose next node the running graph task needs; calling it by hand
    inside a tiny engine call that asks for exactly the off-side children (captured, never run)
    makes it skip its input-side outputs.
    """
    edges = tuple(GradientEdge(child, nr) for _, _, side in frontier for _, child, nr in side)
    z = torch.zeros((), requires_grad=True)
    trigger = z.view_as(z)

    def apply(_: Any) -> None:
        for node, got, side in frontier:
            out = node(*got)
            for i, child, nr in side:
                if out[i] is not None:
                    roots.append(GradientEdge(child, nr))
                    grads.append(out[i])

    handle = trigger.grad_fn.register_prehook(apply)
    try:
        engine_run_backward((trigger,), (torch.zeros(()),), inputs=(z, *edges), accumulate_grad=False)
    finally:
        handle.remove()


def run_backward(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Backpropagate ``grads`` from ``roots`` (accumulating into leaves' ``.grad``).

    Calls the engine directly because a sent activation's storage may have been released (its
    ``.data`` shrunk): the engine checks gradients against the autograd node's recorded input shape,
    not against the tensor's current data.
    """
    pairs = [(t, g) for t, g in zip(roots, grads) if t.requires_grad]
    if not pairs:
        return
    ts = tuple(t for t, _ in pairs)
    gs = tuple(torch.ones_like(t) if g is None else g for t, g in pairs)
    engine_run_backward(ts, gs)


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], hint: dict[int, torch.Tensor] | None = None,
                   saved: SavedBoxes | None = None) -> HeldWgrad | None:
    """B: accumulate the gradient of `inputs` (the stage's input leaves) and return what W needs.

    `roots`/`grads` as for `run_backward`; `hint`: the parameters an earlier microbatch of the stage had to
    compute in B (read and updated: the graph is then sorted once, not twice); `saved`: the boxes
    of the stage's forward, whose input-only tensors are freed after B. Returns None when W has
    nothing to do.
    """
    pairs = [(t, torch.ones_like(t) if g is None else g) for t, g in zip(roots, grads) if t.requires_grad]
    if not pairs:
        return None
    if any(t.grad_fn is None for t, _ in pairs):  # an input handed on as it is: no graph to split
        run_backward([t for t, _ in pairs], [g for _, g in pairs])
        return None
    if not inputs and not hint:  # the first stage: B has nothing to compute, W the whole backward
        return HeldWgrad([], [t for t, _ in pairs], [g for _, g in pairs])
    graph = _Graph([t.grad_fn for t, _ in pairs])
    if graph.reentrant:  # its checkpoint refuses an engine call limited by `inputs`
        run_backward([t for t, _ in pairs], [g for _, g in pairs])
        return None
    extra: dict[int, torch.Tensor] = dict(hint or {})  # parameters W cannot produce: B accumulates them
    b_ids = {id(x) for x in inputs} | extra.keys()
    while True:
        plan = graph.plan(b_ids)
        if not plan.to_b:
            break
        extra.update(plan.to_b)
        b_ids.update(plan.to_b)  # and the graph is sorted again around the new targets
    if hint is not None:
        hint.update(extra)
    on_b = plan.input_side
    b_roots = [(t, g) for t, g in pairs if id(t.grad_fn) in on_b]
    kept: dict[int, tuple[torch.Tensor | None, ...]] = {}
    targets = tuple(inputs) + tuple(extra.values())
    if b_roots and targets:
        handles = [node.register_prehook(_keeper(kept, id(node))) for node, _ in plan.frontier]
        if saved is not None:
            handles += [node.register_hook(_left) for node, _ in plan.frontier]
        try:
            engine_run_backward([t for t, _ in b_roots], [g for _, g in b_roots], retain_graph=True,
                                inputs=targets)
        finally:
            _in_frontier.on = False
            for h in handles:
                h.remove()
        if saved is not None:
            saved.free_input_only()
    frontier = [(node, kept[id(node)], side) for node, side in plan.frontier if id(node) in kept]
    w_roots = [(t, g) for t, g in pairs if id(t.grad_fn) not in on_b and id(t.grad_fn) in plan.reaches_w]
    if not frontier and not w_roots:
        return None
    return HeldWgrad(frontier, [t for t, _ in w_roots], [g for _, g in w_roots])


def _keeper(kept: dict[int, Any], key: int) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        kept[key] = grad_outputs
        _in_frontier.on = True  # what it unpacks now, W unpacks again
    return hook


def _left(grad_inputs: Any, grad_outputs: Any) -> None:
    _in_frontier.on = False


class _Plan:
    """One sorting of the graph (see the module docstring); ids are of nodes unless said otherwise."""

    __slots__ = ("input_side", "reaches_w", "frontier", "to_b")

    def __init__(self) -> None:
        self.input_side: set[int] = set()  # nodes with a path to a B target
        self.reaches_w: set[int] = set()  # nodes with a path to a leaf that is not a B target
        self.frontier: list[tuple[Any, list[tuple[int, Any, int]]]] = []  # (node, off-side edges)
        self.to_b: dict[int, torch.Tensor] = {}  # id(leaf) -> leaf that must get its gradient in B


class _Graph:
    """The nodes reachable from the roots, children before parents, with their edges."""

    __slots__ = ("post", "roots", "reentrant")

    def __init__(self, roots: list[Any]) -> None:
        self.roots = roots
        post: list[tuple[Any, tuple]] = []  # keeps every node alive, so ids stay unique
        seen: set[int] = set()
        pynodes: list[Any] = []
        for r in roots:
            if id(r) in seen:
                continue
            seen.add(id(r))
            nf = r.next_functions
            stack = [(r, nf, iter(nf))]
            while stack:
                node, nf, it = stack[-1]
                for c, _ in it:
                    if c is not None and id(c) not in seen:
                        seen.add(id(c))
                        cnf = c.next_functions
                        stack.append((c, cnf, iter(cnf)))
                        break
                else:
                    stack.pop()
                    post.append((node, nf))
                    if isinstance(node, _PyNode):
                        pynodes.append(node)
        self.post = post
        self.reentrant = any(getattr(n, "_forward_cls", None) is _ReentrantCheckpoint for n in pynodes)

    def plan(self, b_ids: set[int]) -> _Plan:
        """Sort the graph for the B targets `b_ids` (ids of leaf tensors)."""
        acc = _acc_type()
        p = _Plan()
        on_b, to_w = p.input_side, p.reaches_w
        for node, nf in self.post:
            if type(node) is acc:
                (on_b if id(node.variable) in b_ids else to_w).add(id(node))
                continue
            for c, _ in nf:
                if c is not None:
                    if id(c) in on_b:
                        on_b.add(id(node))
                    if id(c) in to_w:
                        to_w.add(id(node))
        custom: list[Any] = []  # off-side children of custom Functions on the input side
        for node, nf in self.post:
            if id(node) not in on_b:
                continue
            side = [(i, c, nr) for i, (c, nr) in enumerate(nf) if c is not None and id(c) not in on_b and id(c) in to_w]
            if not side:
                continue
            if isinstance(node, _PyNode):
                # A custom Function computes all its outputs in B (a delayed module's weight gets
                # None there, its eager bias a gradient): the leaves it feeds are B's targets.
                custom.extend(c for _, c, _ in side)
            else:
                p.frontier.append((node, side))
        seen: set[int] = set()
        while custom:
            node = custom.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if type(node) is acc:
                p.to_b[id(node.variable)] = node.variable
                continue
            custom.extend(c for c, _ in node.next_functions if c is not None and id(c) in to_w)
        return p
