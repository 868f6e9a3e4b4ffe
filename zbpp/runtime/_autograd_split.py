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

An output that is a leaf (an input handed on as it is, a Parameter) has no graph: its gradient is
the output's own, an input's accumulated in B, a parameter's in W.

The sorting depends only on the graph's structure (node types, edges, which leaves are B's
targets), which repeats for every microbatch of a stage: a `StageSplit` keeps it, and a later
microbatch whose walk finds the same structure reuses it.

`HeldWgrad.run` (W) calls each frontier node again on its kept gradient, inside a tiny engine call
that asks for exactly the frontier's off-side children: a node computes only the outputs whose
next node the running graph task needs, so W computes no input gradient again. One engine call
then runs the weight side from those outputs, accumulating into ``.grad`` as a plain backward would
(hooks fire). Its graph never reaches the input side, so W's cost does not grow with depth.

A custom autograd Function on the input side computes all its outputs in B (zbpp's delayed layers
file their weight gradient there, an eager FP8 bias gets its gradient): the leaves below its
off-side edges become B's targets. So does a region compiled by ``torch.compile``: its backward is
one such node (``CompiledFunctionBackward``) computing every gradient of the region at once, so the
weights inside it get their gradients in B (on the first stage, whose input needs none, all of it
runs in W); zbpp's layers run outside compiled graphs and keep their W. Reentrant
``torch.utils.checkpoint`` refuses an engine call limited by ``inputs``: a graph holding one runs
its whole backward in B. Post-hooks registered on a frontier node (``Node.register_hook``) see
only its B call.

Memory: B keeps the graph. `SavedBoxes` (around the forward) boxes every tensor autograd saves.
During B, a box unpacked by an input-side node that is not on the frontier is emptied at once (W
never runs that node: attention probabilities, activation inputs), as a plain backward frees what
a node saved once it ran; a custom Function's boxes (its backward may read them twice) go when B
ends. What stays until W is what the frontier and the weight side read.

Its private torch calls (the autograd engine entry point, the running node) go through
`zbpp._compat`.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Sequence

import torch

from .._compat import (HAS_CURRENT_AUTOGRAD_NODE, compiled_backward_retained, current_autograd_node,
                       engine_run_backward, is_compiled_node, saved_by_checkpoint)

try:  # non-reentrant checkpoint: the W calls of one microbatch share one recomputation
    from torch.utils.checkpoint import GraphExecGroup as _RecomputeOnce  # recent torch
except ImportError:  # pragma: no cover - older torch: W's two engine calls may recompute twice
    _RecomputeOnce = contextlib.nullcontext  # type: ignore[assignment,misc]

from torch.autograd.function import BackwardCFunction as _PyNode
from torch.autograd.graph import GradientEdge
from torch.utils.checkpoint import CheckpointFunction as _ReentrantCheckpoint

__all__ = ["HeldWgrad", "SavedBoxes", "StageSplit", "backward_input", "unpacked_for_b_only"]

_KEEP, _B_ONLY, _CKPT = 1, 2, 3  # a box's mark: read again in W / read in B only / never freed
_NODE_AWARE = HAS_CURRENT_AUTOGRAD_NODE  # without it, B and W free nothing early


class _BState:
    """What the boxes of one forward see of its B and W: the frontier's node ids while B runs (None
    otherwise), the gradients kept for W, and the frontier node W is calling (None otherwise)."""

    __slots__ = ("frontier", "kept", "calling")

    def __init__(self) -> None:
        self.frontier: set[int] | None = None
        self.kept: dict[int, tuple[torch.Tensor | None, ...]] = {}
        self.calling: Any = None

    def keep(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        """Pre-hook of every frontier node in B: W calls it again on these gradients."""
        self.kept[id(current_autograd_node())] = grad_outputs


class _Box:
    __slots__ = ("t", "mark", "state")

    def __init__(self, t: torch.Tensor, state: _BState) -> None:
        self.t: torch.Tensor | None = t
        self.mark = 0
        self.state = state


class SavedBoxes:
    """The tensors autograd saves during one F, each in a box, so that B can free those only
    input-side nodes used (W will not run them). Use as a context manager around the forward."""

    __slots__ = ("boxes", "state", "_hooks")

    def __init__(self) -> None:
        self.boxes: list[_Box] = []
        self.state = _BState()
        self._hooks: Any = None

    def __enter__(self) -> "SavedBoxes":
        boxes, state = self.boxes, self.state

        def pack(t: torch.Tensor) -> _Box:
            # An alias: a stage output whose storage is released once sent (``t.data = ...``) must
            # stay whole for a node that saved it.
            b = _Box(t.detach(), state)
            if _saved_by_checkpoint():
                b.mark = _CKPT  # a checkpointed region's input: W's recomputation reads it again
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
    # called from pack: the frame that called pack
    return saved_by_checkpoint(sys._getframe(2))


_ONCE: dict[type, bool] = {}  # node type -> whether its backward reads each saved tensor once


def _reads_once(t: type) -> bool:
    once = _ONCE.get(t)
    if once is None:
        # torch's generated nodes (``MmBackward0``) unpack each saved tensor once per call; a custom
        # Function's ``ctx.saved_tensors`` may be read any number of times
        once = _ONCE[t] = not issubclass(t, _PyNode) and t.__name__[-1:].isdigit()
    return once


#: the boxes' state of the B running now, module-wide: a CUDA backward's nodes run on the
#: engine's device thread, not the one that called it (the runtime runs one B at a time)
_running: _BState | None = None


def unpacked_for_b_only() -> bool:
    """Whether the saved tensor unpacked now is read by a node of the running B that W will not
    run, once (the rule the boxes follow): a saved-tensor hook of its own (an offloaded layer's)
    may let go of what it brought back for it once the node returns.

    >>> unpacked_for_b_only()  # no B running
    False
    """
    state = _running
    if state is None or state.frontier is None:
        return False
    node = current_autograd_node()
    return node is not None and id(node) not in state.frontier and _reads_once(type(node))


def _unpack(b: _Box) -> torch.Tensor:
    t = b.t
    if t is None:
        raise RuntimeError("zbpp split backward: a saved tensor freed after B was needed again (a bug)")
    mark = b.mark
    if mark == 0:
        frontier = b.state.frontier
        if frontier is not None:  # its B is running
            node = current_autograd_node()
            if id(node) in frontier:
                b.mark = _KEEP  # what a frontier node unpacks now, W unpacks again
            elif _reads_once(type(node)):
                b.t = None  # W never runs this node, and it reads this once: gone when it returns
            else:
                b.mark = _B_ONLY
    elif mark == _KEEP:
        calling = b.state.calling
        if calling is not None and _reads_once(type(calling)):
            b.t = None  # W calls each frontier node once
    return t


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

    __slots__ = ("frontier", "roots", "grads", "state")

    def __init__(self, frontier: list[tuple[Any, tuple, list[tuple[int, GradientEdge]]]],
                 roots: list[torch.Tensor], grads: list[torch.Tensor], state: _BState | None = None) -> None:
        self.frontier = frontier  # (node, its incoming gradients, its off-side edges (output index, edge))
        self.roots, self.grads = roots, grads
        self.state = state  # the boxes' of the forward, when it had some

    def run(self) -> None:
        """Compute the weight gradients (once: everything is dropped as it runs)."""
        frontier, roots, grads = self.frontier, self.roots, self.grads
        self.frontier, self.roots, self.grads = [], [], []
        with _RecomputeOnce():
            if frontier:
                _apply_off_side(frontier, roots, grads, self.state)
            del frontier
            if roots:
                engine_run_backward(roots, grads)


def _apply_off_side(frontier: list[Any], roots: list[Any], grads: list[torch.Tensor],
                    state: _BState | None) -> None:
    """Re-run each frontier node on its kept gradient, computing only its off-side outputs, and add
    them to `roots`/`grads` as gradient edges. Each node's kept gradients and saved tensors go once
    it ran (the entries of `frontier` are emptied).

    A node computes the outputs whose next node the running graph task needs; calling it by hand
    inside a tiny engine call that asks for exactly the off-side children (captured, never run)
    makes it skip its input-side outputs.
    """
    edges = tuple(e for _, _, side in frontier for _, e in side)
    z = torch.zeros((), requires_grad=True)
    trigger = z.view_as(z)

    def apply(_: Any) -> None:
        for j, (node, got, side) in enumerate(frontier):
            frontier[j] = None
            if state is not None:
                state.calling = node
            out = node(*got)
            del got
            for i, e in side:
                if out[i] is not None:
                    roots.append(e)
                    grads.append(out[i])

    handle = trigger.grad_fn.register_prehook(apply)
    try:
        engine_run_backward((trigger,), (torch.zeros(()),), inputs=(z, *edges), accumulate_grad=False)
    finally:
        handle.remove()
        if state is not None:
            state.calling = None


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


class StageSplit:
    """What the B of one stage learns for its later microbatches: the parameters B must compute
    (`extra`, see the module docstring) and the sortings of the graph structures seen so far."""

    __slots__ = ("extra", "_sortings")

    _MAX_SORTINGS = 8  # distinct structures kept (a stage's graph rarely has more than one)

    def __init__(self) -> None:
        self.extra: dict[int, torch.Tensor] = {}  # id(parameter) -> parameter
        self._sortings: list[tuple[tuple[int, ...], list[Any], _Sorting]] = []

    def _find(self, targets: tuple[int, ...], sig: list[Any]) -> _Sorting | None:
        for t, s, sorting in self._sortings:
            if t == targets and s == sig:
                return sorting
        return None

    def _add(self, targets: tuple[int, ...], sig: list[Any], sorting: _Sorting) -> None:
        if len(self._sortings) >= self._MAX_SORTINGS:
            self._sortings.pop(0)
        self._sortings.append((targets, sig, sorting))


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], hint: StageSplit | None = None,
                   saved: SavedBoxes | None = None) -> HeldWgrad | None:
    """B: accumulate the gradient of `inputs` (the stage's input leaves) and return what W needs.

    `roots`/`grads` as for `run_backward`; `hint`: what earlier microbatches of the stage learnt
    (read and updated); `saved`: the boxes of the stage's forward, whose input-only tensors are
    freed during B. Returns None when W has nothing to do.
    """
    global _running
    pairs = [(t, torch.ones_like(t) if g is None else g) for t, g in zip(roots, grads) if t.requires_grad]
    if not pairs:
        return None
    if hint is not None and hint.extra:
        # a parameter frozen since an earlier step learnt it has no gradient to compute (and the engine
        # refuses it as a target); its graph has no leaf for it, so a later thaw learns it again
        for k in [k for k, v in hint.extra.items() if not v.requires_grad]:
            del hint.extra[k]
    extra: dict[int, torch.Tensor] = dict(hint.extra) if hint is not None else {}
    b_ids = {id(x) for x in inputs} | extra.keys()
    # A leaf handed on as it is (an encoder's output passed through a decoder stage) has no graph: its
    # gradient is the root's own, an input's now, a parameter's in W; the rest of the graph still splits
    leaves = [(t, g) for t, g in pairs if t.grad_fn is None]
    w_leaves = [pr for pr in leaves if id(pr[0]) not in b_ids]
    if len(w_leaves) < len(leaves):
        run_backward([t for t, _ in leaves if id(t) in b_ids], [g for t, g in leaves if id(t) in b_ids])
    if leaves:
        pairs = [pr for pr in pairs if pr[0].grad_fn is not None]
    if not pairs or (not inputs and not extra):  # nothing else, or the first stage: W the whole backward
        pairs += w_leaves
        return HeldWgrad([], [t for t, _ in pairs], [g for _, g in pairs]) if pairs else None
    graph = _Walk([t.grad_fn for t, _ in pairs])
    targets = tuple(i for i in graph.accs if id(graph.nodes[i].variable) in b_ids)
    sorting = hint._find(targets, graph.sig) if hint is not None else None
    if sorting is None:
        sorting = _sort_for_targets(graph, b_ids)
        if hint is not None:
            hint._add(targets, graph.sig, sorting)
            final = tuple(i for i in graph.accs if i in sorting.b_targets)
            if final != targets:  # what the next microbatch finds, its hint holding this one's extras
                hint._add(final, graph.sig, sorting)
    if sorting.reentrant:  # its checkpoint refuses an engine call limited by `inputs`
        pairs += w_leaves
        run_backward([t for t, _ in pairs], [g for _, g in pairs])
        return None
    nodes = graph.nodes
    for i in sorting.to_b:
        v = nodes[i].variable
        extra[id(v)] = v
    if hint is not None:
        hint.extra.update(extra)
    b_roots = [pr for pr, on_b in zip(pairs, sorting.root_on_b) if on_b]
    state = saved.state if saved is not None else _BState()
    targets_t = tuple(inputs) + tuple(extra.values())
    front = [nodes[i] for i, _ in sorting.frontier]
    if b_roots and targets_t:
        for node in front:  # never removed: W calls the node by hand, which runs no hook
            node.register_prehook(state.keep if _NODE_AWARE else _keeper(state.kept, id(node)))
        if saved is not None and _NODE_AWARE:
            state.frontier = {id(n) for n in front}
            _running = state
        try:
            if sorting.compiled:  # a compiled node runs once, in B: its donated buffers are safe
                with compiled_backward_retained():
                    engine_run_backward([t for t, _ in b_roots], [g for _, g in b_roots], retain_graph=True,
                                        inputs=targets_t)
            else:
                engine_run_backward([t for t, _ in b_roots], [g for _, g in b_roots], retain_graph=True,
                                    inputs=targets_t)
        finally:
            state.frontier = None
            _running = None
        if saved is not None:
            saved.free_input_only()
    kept, state.kept = state.kept, {}
    frontier = [(node, kept[id(node)], [(k, GradientEdge(nodes[c], nr)) for k, c, nr in side])
                for node, (_, side) in zip(front, sorting.frontier) if id(node) in kept]
    w_roots = [pr for pr, on_b, to_w in zip(pairs, sorting.root_on_b, sorting.root_to_w) if not on_b and to_w]
    w_roots += w_leaves
    if not frontier and not w_roots:
        return None
    return HeldWgrad(frontier, [t for t, _ in w_roots], [g for _, g in w_roots],
                     state if saved is not None and _NODE_AWARE else None)


def _keeper(kept: dict[int, Any], key: int) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        kept[key] = grad_outputs
    return hook


class _Walk:
    """The nodes reachable from the roots (breadth first), and their structure as a flat list: per
    node its type, then per edge the child's position and input number (-1 for no edge), then -2.
    Two graphs with equal lists sort alike; `accs`: the positions of the leaves' nodes."""

    __slots__ = ("nodes", "sig", "accs", "roots")

    def __init__(self, roots: list[Any]) -> None:
        acc = _acc_type()
        nodes: list[Any] = []  # keeps every node alive
        index: dict[Any, int] = {}  # node -> position (nodes hash and compare by identity)
        for r in roots:
            if r not in index:
                index[r] = len(nodes)
                nodes.append(r)
        self.roots = [index[r] for r in roots]
        sig: list[Any] = []
        accs: list[int] = []
        add, n = sig.append, len(nodes)
        for pos, node in enumerate(nodes):  # grows while it runs
            t = type(node)
            add(t)
            if t is acc:
                accs.append(pos)
            else:
                for c, nr in node.next_functions:
                    if c is None:
                        add(-1)
                        continue
                    k = index.get(c)
                    if k is None:
                        k = index[c] = n
                        n += 1
                        nodes.append(c)
                    add(k)
                    add(nr)
            add(-2)
        self.nodes, self.sig, self.accs = nodes, sig, accs

    def edges(self) -> list[list[tuple[int, int] | None]]:
        """Per node, its edges as (child position, input number), None for no edge."""
        out: list[list[tuple[int, int] | None]] = []
        sig, i = self.sig, 0
        for _ in self.nodes:
            i += 1  # the type
            es: list[tuple[int, int] | None] = []
            while sig[i] != -2:
                if sig[i] == -1:
                    es.append(None)
                    i += 1
                else:
                    es.append((sig[i], sig[i + 1]))
                    i += 2
            i += 1
            out.append(es)
        return out


class _Sorting:
    """One sorting of a graph structure (see the module docstring), in node positions of `_Walk`."""

    __slots__ = ("frontier", "to_b", "b_targets", "root_on_b", "root_to_w", "reentrant", "compiled")

    def __init__(self) -> None:
        self.frontier: list[tuple[int, list[tuple[int, int, int]]]] = []  # (node, off-side edges (index, child, input_nr))
        self.to_b: list[int] = []  # leaves' nodes that must get their gradient in B, not being inputs or hinted
        self.b_targets: set[int] = set()  # every B target's leaf node
        self.root_on_b: list[bool] = []  # per root: on the input side
        self.root_to_w: list[bool] = []  # per root: reaches a leaf that is not a B target
        self.reentrant = False
        self.compiled = False  # holds a torch.compile'd region's node


def _sort_for_targets(graph: _Walk, b_ids: set[int]) -> _Sorting:
    """Sort `graph` for the B targets `b_ids` (ids of leaf tensors), adding to them the leaves a
    custom Function on the input side feeds until none is left (see the module docstring)."""
    nodes, edges = graph.nodes, graph.edges()
    post = _post_order(graph.roots, edges)
    targets = {i for i in graph.accs if id(nodes[i].variable) in b_ids}
    found: list[int] = []
    while True:
        p = _sort(graph, edges, post, targets)
        if not p.to_b:
            break
        found += p.to_b
        targets.update(p.to_b)  # and the graph is sorted again around the new targets
    p.to_b, p.b_targets = found, targets
    custom = [nodes[i] for i in post if isinstance(nodes[i], _PyNode)]
    p.reentrant = any(getattr(type(n), "_forward_cls", None) is _ReentrantCheckpoint for n in custom)
    p.compiled = any(is_compiled_node(n) for n in custom)
    return p


def _post_order(roots: list[int], edges: list[list[tuple[int, int] | None]]) -> list[int]:
    """Positions reachable from `roots`, children before parents (depth first, edges in order)."""
    seen: set[int] = set()
    post: list[int] = []
    for r in roots:
        if r in seen:
            continue
        seen.add(r)
        stack = [(r, iter(edges[r]))]
        while stack:
            node, it = stack[-1]
            for e in it:
                if e is not None and e[0] not in seen:
                    seen.add(e[0])
                    stack.append((e[0], iter(edges[e[0]])))
                    break
            else:
                stack.pop()
                post.append(node)
    return post


def _sort(graph: _Walk, edges: list[list[tuple[int, int] | None]], post: list[int], targets: set[int]) -> _Sorting:
    acc, nodes = _acc_type(), graph.nodes
    p = _Sorting()
    on_b: set[int] = set()  # nodes with a path to a B target
    to_w: set[int] = set()  # nodes with a path to a leaf that is not a B target
    for i in post:
        if type(nodes[i]) is acc:
            (on_b if i in targets else to_w).add(i)
            continue
        for e in edges[i]:
            if e is not None:
                if e[0] in on_b:
                    on_b.add(i)
                if e[0] in to_w:
                    to_w.add(i)
    custom: list[int] = []  # off-side children of custom Functions on the input side
    for i in post:
        if i not in on_b:
            continue
        side = [(k, e[0], e[1]) for k, e in enumerate(edges[i]) if e is not None and e[0] not in on_b and e[0] in to_w]
        if not side:
            continue
        if isinstance(nodes[i], _PyNode):
            # A custom Function computes all its outputs in B (a delayed module's weight gets
            # None there, its eager bias a gradient): the leaves it feeds are B's targets.
            custom.extend(c for _, c, _ in side)
        else:
            p.frontier.append((i, side))
    seen: set[int] = set()
    while custom:
        i = custom.pop()
        if i in seen:
            continue
        seen.add(i)
        if type(nodes[i]) is acc:
            p.to_b.append(i)
            continue
        custom.extend(e[0] for e in edges[i] if e is not None and e[0] in to_w)
    p.root_on_b = [r in on_b for r in graph.roots]
    p.root_to_w = [r in to_w for r in graph.roots]
    return p
