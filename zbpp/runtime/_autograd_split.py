"""Split one stage's autograd backward into B (input gradients) and W (weight gradients).

`backward_input` walks the graph from the stage's outputs once per microbatch and sorts its nodes:

- the *input side*: nodes with a path to a stage input that requires grad (or to a parameter that
  must get its gradient in B, see below). B runs the engine with ``inputs=`` those tensors, so each
  node computes only the outputs on the input side (addmm: the gradient of ``mat1``, not of the
  weight);
- the *frontier*: input-side nodes with an edge leading off the input side towards a parameter
  that W owes. A pre-hook keeps each frontier node's incoming gradient during B;
- the *weight side*: everything below a frontier's off-side edges, and the outputs' nodes that do
  not reach an input at all (the whole graph on the first stage).

`HeldWgrad.run` (W) re-runs each frontier node from its kept gradient with ``inputs=`` the
parameters, then the weight side, accumulating into ``.grad`` as a plain backward would (hooks
fire). A frontier node re-run in W must compute only its weight outputs, which the engine does
only when none of its input-side edges leads to a parameter of the same engine call; frontier
nodes are therefore grouped by *level* (the number of frontier nodes above them on the input
side) and each level is one engine call, so W computes no input gradient again.

Parameters whose gradient W cannot produce that way get it in B: a parameter below frontier
nodes of two levels (used twice along the input path), and one below a custom autograd Function
on the input side (its backward computes every output at once and may have side effects:
reentrant checkpointing, zbpp's delayed-wgrad layers). Parameters of delayed-wgrad modules (the
`owned` ids) are left to their own W.

Every private torch call of the split is here.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

try:  # the autograd engine entry point that takes GradientEdge roots and tensors of released storage
    from torch.autograd.graph import _engine_run_backward as _engine_backward  # torch >= 2.3
except ImportError:  # pragma: no cover - older torch
    from torch.autograd import Variable

    def _engine_backward(*args: Any, **kwargs: Any) -> Any:
        return Variable._execution_engine.run_backward(*args, **kwargs)

try:  # non-reentrant checkpoint: the W calls of one microbatch share one recomputation
    from torch.utils.checkpoint import GraphExecGroup as _RecomputeOnce  # torch >= 2.10
except ImportError:  # pragma: no cover - older torch: each W call recomputes the regions it needs
    _RecomputeOnce = contextlib.nullcontext  # type: ignore[assignment,misc]

from torch.autograd.function import BackwardCFunction as _PyNode
from torch.utils.checkpoint import CheckpointFunction as _ReentrantCheckpoint
from torch.autograd.graph import GradientEdge

__all__ = ["HeldWgrad", "backward_input"]

_ACC: type | None = None  # torch's AccumulateGrad node type, found on first use


def _acc_type() -> type:
    global _ACC
    if _ACC is None:
        p = torch.zeros(1, requires_grad=True)
        _ACC = type(p.view_as(p).grad_fn.next_functions[0][0])
    return _ACC


class HeldWgrad:
    """What B(s, j) leaves for W(s, j): per level, the engine call's roots, gradients and parameters."""

    __slots__ = ("calls",)

    def __init__(self, calls: list[tuple[list[Any], list[torch.Tensor], list[torch.Tensor] | None]]) -> None:
        self.calls = calls  # (roots, their gradients, the leaves to accumulate: None for all), last first

    def run(self) -> None:
        """Compute the weight gradients (once: everything is dropped as it runs)."""
        calls, self.calls = self.calls, []
        with _RecomputeOnce():
            while calls:
                roots, grads, params = calls.pop()
                _engine_backward(tuple(roots), tuple(grads), False, False, tuple(params or ()),
                                 allow_unreachable=True, accumulate_grad=True)
                del roots, grads, params


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
    _engine_backward(ts, gs, False, False, (), allow_unreachable=True, accumulate_grad=True)


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], owned: set[int],
                   hint: dict[int, torch.Tensor] | None = None) -> HeldWgrad | None:
    """B: accumulate the gradient of `inputs` (the stage's input leaves) and return what W needs.

    `roots`/`grads` as for `run_backward`; `owned`: ids of the parameters that delayed-wgrad modules
    compute in their own W; `hint`: the parameters an earlier microbatch of the stage had to
    compute in B (read and updated: the graph is then sorted once, not twice). Returns None when W
    has nothing to do.
    """
    pairs = [(t, torch.ones_like(t) if g is None else g) for t, g in zip(roots, grads) if t.requires_grad]
    if not pairs:
        return None
    if any(t.grad_fn is None for t, _ in pairs):  # an input handed on as it is: no graph to split
        run_backward([t for t, _ in pairs], [g for _, g in pairs])
        return None
    if not inputs and not hint:  # the first stage: B has nothing to compute, W the whole backward
        return HeldWgrad([([t for t, _ in pairs], [g for _, g in pairs], None)])
    graph = _Graph([t.grad_fn for t, _ in pairs])
    if graph.reentrant:  # its checkpoint refuses an engine call limited by `inputs`
        run_backward([t for t, _ in pairs], [g for _, g in pairs])
        return None
    extra: dict[int, torch.Tensor] = dict(hint or {})  # parameters W cannot produce: B accumulates them
    b_ids = {id(x) for x in inputs} | extra.keys()
    while True:
        plan = graph.plan(b_ids, owned)
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
        handles = [node.register_prehook(_keeper(kept, id(node))) for node in plan.frontier]
        try:
            _engine_backward(tuple(t for t, _ in b_roots), tuple(g for _, g in b_roots), True, False, targets,
                             allow_unreachable=True, accumulate_grad=True)
        finally:
            for h in handles:
                h.remove()
    calls: dict[int, tuple[list[Any], list[torch.Tensor], list[torch.Tensor]]] = {}
    for node in plan.frontier:
        got = kept.get(id(node))
        if got is None:
            continue
        roots_l, grads_l, _ = calls.setdefault(plan.level[id(node)], ([], [], []))
        for k, g in enumerate(got):
            if g is not None:
                roots_l.append(GradientEdge(node, k))
                grads_l.append(g)
    for t, g in pairs:  # outputs that do not depend on an input (all of them on the first stage)
        if id(t.grad_fn) not in on_b and id(t.grad_fn) in plan.reaches_w:
            roots_l, grads_l, _ = calls.setdefault(0, ([], [], []))
            roots_l.append(t)
            grads_l.append(g)
    for lv, params in plan.w_params.items():
        if lv in calls:
            calls[lv][2].extend(params)
    todo = [calls[lv] for lv in sorted(calls, reverse=True) if calls[lv][0] and calls[lv][2]]
    return HeldWgrad(todo) if todo else None


def _keeper(kept: dict[int, Any], key: int) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        kept[key] = grad_outputs
    return hook


class _Plan:
    """One sorting of the graph (see the module docstring); ids are of nodes unless said otherwise."""

    __slots__ = ("input_side", "reaches_w", "frontier", "level", "w_params", "to_b")

    def __init__(self) -> None:
        self.input_side: set[int] = set()  # nodes with a path to a B target
        self.reaches_w: set[int] = set()  # nodes with a path to a parameter W computes
        self.frontier: list[Any] = []  # input-side nodes with an edge off it towards such a parameter
        self.level: dict[int, int] = {}  # input-side node -> frontier nodes above it on the longest path
        self.w_params: dict[int, list[torch.Tensor]] = {}  # level -> the parameters its W call computes
        self.to_b: dict[int, torch.Tensor] = {}  # id(parameter) -> parameter that must go to B instead


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

    def plan(self, b_ids: set[int], owned: set[int]) -> _Plan:
        """Sort the graph for B targets `b_ids` and W-excluded `owned` (ids of leaf tensors)."""
        acc = _acc_type()
        p = _Plan()
        on_b, to_w = p.input_side, p.reaches_w
        leaves: dict[int, torch.Tensor] = {}  # AccumulateGrad node id -> its tensor, for every leaf W reaches
        for node, nf in self.post:
            if type(node) is acc:
                v = node.variable
                if id(v) in b_ids:
                    on_b.add(id(node))
                else:  # owned ones too: W must run the nodes of delayed modules that lead to them
                    to_w.add(id(node))
                    leaves[id(node)] = v
                continue
            for c, _ in nf:
                if c is not None:
                    if id(c) in on_b:
                        on_b.add(id(node))
                    if id(c) in to_w:
                        to_w.add(id(node))
        level = p.level
        todo: list[tuple[Any, int, bool]] = []  # weight-side walk: (node, level, below a custom Function)
        for node, nf in reversed(self.post):  # parents before children
            nid = id(node)
            if nid not in on_b:
                continue
            lv = level.setdefault(nid, 0)
            side = [c for c, _ in nf if c is not None and id(c) not in on_b and id(c) in to_w]
            if side and isinstance(node, _PyNode):
                # A custom Function computes all its outputs in B: what it feeds off the input side
                # is B's too (a delayed module's weight gets None there; its eager bias a gradient).
                todo.extend((c, lv, True) for c in side)
            elif side:
                p.frontier.append(node)
                todo.extend((c, lv, False) for c in side)
                lv += 1
            for c, _ in nf:
                if c is not None and id(c) in on_b and level.get(id(c), -1) < lv:
                    level[id(c)] = lv
        for node in self.roots:
            if id(node) not in on_b and id(node) in to_w:
                todo.append((node, 0, False))
        reached: dict[int, set[int]] = {}  # leaf's node -> levels whose W call reaches it
        seen: set[tuple[int, int, bool]] = set()
        while todo:
            item = todo.pop()
            node, lv, custom = item
            if (id(node), lv, custom) in seen:
                continue
            seen.add((id(node), lv, custom))
            v = leaves.get(id(node))
            if v is not None:
                if custom:
                    p.to_b[id(v)] = v
                reached.setdefault(id(node), set()).add(lv)
                continue
            for c, _ in node.next_functions:
                if c is not None and id(c) in to_w:
                    todo.append((c, lv, custom))
        for nid, lvs in reached.items():
            if len(lvs) > 1:  # used by two levels: one W call would recompute input gradients
                p.to_b[id(leaves[nid])] = leaves[nid]
        if not p.to_b:
            for nid, lvs in reached.items():
                p.w_params.setdefault(next(iter(lvs)), []).append(leaves[nid])
        return p
