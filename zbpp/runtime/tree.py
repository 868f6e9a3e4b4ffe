"""Stage inputs and outputs as trees: flatten, rebuild, split into microbatches, describe.

A stage's input or output is a tensor, a tuple/list, a dict or other mapping (Hugging Face's
``BatchEncoding``; it comes out a dict), nested freely, or any other value (passed along as is). `flatten` turns it into its tensor leaves plus a `Spec` that holds the
structure and every non-tensor value; `Spec` is small, picklable and comparable, so it is what
travels as a message's metadata and what is compared to detect a change of shape.

Calling convention of a stage: a tuple or list is unpacked as positional arguments, a dict as
keyword arguments, anything else is the one argument.

>>> import torch
>>> leaves, spec = flatten({"x": torch.zeros(2, 3), "n": 7})
>>> len(leaves), rebuild(spec, leaves)["n"]
(1, 7)
>>> [tuple(t.shape) for t in split(torch.arange(5), 2)]
[(3,), (2,)]

Values that every microbatch shares: a tensor leaf with one row while the batch has more (Hugging
Face's ``position_ids`` of shape ``[1, T]``), and anything wrapped in `Replicated`, go to every
microbatch whole; the batch's rows are those of the leaves that are split.

>>> parts = split({"ids": torch.zeros(4, 3), "pos": torch.arange(3)[None], "k": Replicated(torch.ones(2))}, 2)
>>> [(tuple(p["ids"].shape), tuple(p["pos"].shape), tuple(p["k"].shape)) for p in parts]
[((2, 3), (1, 3), (2,)), ((2, 3), (1, 3), (2,))]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["TensorMeta", "Spec", "Replicated", "flatten", "rebuild", "split", "split_batch", "batch_rows", "call",
           "describe"]


class Replicated:
    """Marks a value of a step's input or target that every microbatch gets whole (not split).

    Wrap any tensor, or a tuple/list/dict of them: ``pipe.step({"x": x, "table": Replicated(t)})``.
    The stage receives the value itself (unwrapped). Tensors with one row while the batch has more
    need no wrapper; use it for a shared value whose dim 0 is not 1 (or that is 0-dimensional).

    >>> import torch
    >>> [p[1].shape[0] for p in split((torch.zeros(4, 2), Replicated(torch.zeros(3))), 2)]
    [3, 3]
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        if isinstance(value, Replicated):
            value = value.value
        self.value = value

    def __repr__(self) -> str:
        return f"Replicated({describe(self.value)})"


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and requires_grad of one tensor leaf."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(tuple(t.shape), t.dtype, bool(t.requires_grad))

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"{dtype}{list(self.shape)}" + ("(grad)" if self.requires_grad else "")


# A spec node: ("T", i) the i-th tensor leaf; ("V", value) a non-tensor value;
# ("tuple" | "list", children); ("dict", ((key, child), ...)); ("namedtuple", (cls, children));
# ("rep", child): a `Replicated` value.
Node = tuple


@dataclass(frozen=True)
class Spec:
    """The structure of a tree, its non-tensor values, and the metadata of its tensor leaves."""

    node: Node
    tensors: tuple[TensorMeta, ...]

    def __str__(self) -> str:
        return _node_str(self.node, self.tensors)


def _node_str(node: Node, metas: tuple[TensorMeta, ...]) -> str:
    tag, body = node
    if tag == "T":
        return str(metas[body])
    if tag == "V":
        return repr(body)
    if tag == "dict":
        return "{" + ", ".join(f"{k!r}: {_node_str(c, metas)}" for k, c in body) + "}"
    if tag == "namedtuple":
        cls, kids = body
        return cls.__name__ + "(" + ", ".join(_node_str(c, metas) for c in kids) + ")"
    if tag == "rep":
        return f"Replicated({_node_str(body, metas)})"
    inner = ", ".join(_node_str(c, metas) for c in body)
    return f"({inner},)" if tag == "tuple" and len(body) == 1 else (f"({inner})" if tag == "tuple" else f"[{inner}]")


def _walk(o: Any, leaves: list[torch.Tensor]) -> Node:
    if isinstance(o, torch.Tensor):
        leaves.append(o)
        return ("T", len(leaves) - 1)
    if type(o) in (tuple, list):
        return (type(o).__name__, tuple(_walk(c, leaves) for c in o))
    if isinstance(o, tuple) and hasattr(o, "_fields"):  # a namedtuple: keep its type
        return ("namedtuple", (type(o), tuple(_walk(c, leaves) for c in o)))
    if isinstance(o, dict):
        return ("dict", tuple((k, _walk(v, leaves)) for k, v in o.items()))
    if isinstance(o, Replicated):
        return ("rep", _walk(o.value, leaves))
    if isinstance(o, Mapping):  # a tokenizer's BatchEncoding (a UserDict): its tensors are the batch's
        return ("dict", tuple((k, _walk(v, leaves)) for k, v in o.items()))
    return ("V", o)


def flatten(obj: Any) -> tuple[list[torch.Tensor], Spec]:
    """The tensor leaves of `obj` (depth first) and its `Spec`."""
    # Module-level recursion on purpose: a recursive closure refers to itself through its cell, a
    # reference cycle that would keep `leaves` (activations, gradients) alive until the next
    # garbage collection instead of freeing them when the step lets go.
    leaves: list[torch.Tensor] = []
    node = _walk(obj, leaves)
    return leaves, Spec(node, tuple(TensorMeta.of(t) for t in leaves))


def _build(node: Node, leaves: list[torch.Tensor], unwrap: bool = False) -> Any:
    tag, body = node
    if tag == "T":
        return leaves[body]
    if tag == "V":
        return body
    if tag == "dict":
        return {k: _build(c, leaves, unwrap) for k, c in body}
    if tag == "namedtuple":
        cls, kids = body
        return cls(*(_build(c, leaves, unwrap) for c in kids))
    if tag == "rep":
        inner = _build(body, leaves, unwrap)
        return inner if unwrap else Replicated(inner)
    children = [_build(c, leaves, unwrap) for c in body]
    return tuple(children) if tag == "tuple" else children


def _replicated_leaves(node: Node, out: set[int], inside: bool = False) -> set[int]:
    """Indices of the tensor leaves under a `Replicated` node."""
    tag, body = node
    if tag == "T":
        if inside:
            out.add(body)
    elif tag == "rep":
        _replicated_leaves(body, out, True)
    elif tag == "dict":
        for _, c in body:
            _replicated_leaves(c, out, inside)
    elif tag == "namedtuple":
        for c in body[1]:
            _replicated_leaves(c, out, inside)
    elif tag in ("tuple", "list"):
        for c in body:
            _replicated_leaves(c, out, inside)
    return out


def _holds_tensor(value: Any, depth: int = 3) -> bool:
    """Whether `value`, taken whole as a non-tensor value, holds a tensor within `depth` levels of
    containers, dataclass fields or instance attributes (a batch object the split cannot see into)."""
    if isinstance(value, torch.Tensor):
        return True
    if depth == 0 or isinstance(value, (str, bytes, int, float, complex, type, torch.dtype, torch.device)) or value is None:
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        items: Any = value
    elif dataclasses.is_dataclass(value):
        items = (getattr(value, f.name) for f in dataclasses.fields(value))
    elif callable(value):  # a function or module passed along: not a batch
        return False
    else:
        items = getattr(value, "__dict__", {}).values()
    return any(_holds_tensor(v, depth - 1) for v in items)


def hidden_tensor_value(spec: Spec) -> Any:
    """The first non-tensor value of `spec` outside `Replicated` that holds tensors (a dataclass with a
    tensor field: split whole, sent pickled, no gradient through it), else None.

    >>> class Box:
    ...     def __init__(self, t): self.t = t
    >>> type(hidden_tensor_value(flatten((torch.ones(1), Box(torch.ones(1))))[1])).__name__
    'Box'
    """
    return _tensors_in_values(spec.node)


def _tensors_in_values(node: Node) -> Any:
    """The first non-tensor value outside `Replicated` that holds tensors (see `_holds_tensor`), else None."""
    tag, body = node
    if tag == "V":
        return body if _holds_tensor(body) else None
    if tag in ("T", "rep"):  # a Replicated value is meant to go whole to every microbatch
        return None
    kids = [c for _, c in body] if tag == "dict" else body[1] if tag == "namedtuple" else body
    for c in kids:
        found = _tensors_in_values(c)
        if found is not None:
            return found
    return None


def rebuild(spec: Spec, leaves: list[torch.Tensor]) -> Any:
    """Inverse of `flatten`: the tree of `spec` with `leaves` in place of its tensors."""
    return _build(spec.node, leaves)


def split(obj: Any, parts: int, *, what: str = "input") -> list[Any]:
    """Split `obj` into `parts` microbatches along dim 0 (``torch.tensor_split``: sizes differ by at
    most one, the larger first).

    Every tensor leaf is split, except the shared ones, which every microbatch gets whole: those
    wrapped in `Replicated` (unwrapped in the microbatches) and those with one row while other leaves
    have more (a ``[1, T]`` ``position_ids``). Non-tensor values go to every microbatch.

    Raises `ValueError`, naming the leaf, for a 0-d tensor that is not `Replicated`, split leaves
    whose dim 0 differ (other than 1), no leaf to split, fewer rows than `parts`, or tensors held
    inside another value (a dataclass, an object's attributes) that is not `Replicated`: it would
    go whole to every microbatch.
    """
    return split_batch(obj, parts, what=what)[0]


def split_batch(obj: Any, parts: int, *, what: str = "input",
                device: torch.device | None = None) -> tuple[list[Any], int, Spec]:
    """`split` of `obj` (its tensors first moved to `device` when given), the batch's rows
    (`batch_rows`) and `obj`'s `Spec`, from one walk: a step's input is split before its first task."""
    leaves, spec = flatten(obj)
    if device is not None:
        leaves = [t.to(device) for t in leaves]
    rows, shared = _rows_and_shared(leaves, spec, parts, what, obj)
    pieces = [None if i in shared else torch.tensor_split(t, parts, dim=0) for i, t in enumerate(leaves)]
    microbatches = [_build(spec.node, [t if p is None else p[j] for t, p in zip(leaves, pieces)], True)
                    for j in range(parts)]
    return microbatches, rows, spec


def batch_rows(obj: Any, parts: int = 1, *, what: str = "input") -> int:
    """The batch's rows: dim 0 of the leaves that `split` splits (checked as `split` does)."""
    leaves, spec = flatten(obj)
    return _rows_and_shared(leaves, spec, parts, what, obj)[0]


def _rows_and_shared(leaves: list[torch.Tensor], spec: Spec, parts: int, what: str, obj: Any) -> tuple[int, set[int]]:
    hidden = hidden_tensor_value(spec)
    if hidden is not None:
        raise ValueError(
            f"the {what} holds tensors inside a value of type {type(hidden).__name__}, which would go whole to every "
            "microbatch (only tensors in tuples, lists and dicts are split into microbatches): pass them in a dict or tuple, "
            "or wrap the value in zbpp.runtime.Replicated if every microbatch shares it"
        )
    if not leaves:
        raise ValueError(f"the {what} has no tensor to split into {parts} microbatches: {describe(obj)}")
    shared = _replicated_leaves(spec.node, set())
    sizes: dict[int, int] = {}  # rows -> first leaf with that many
    for i, t in enumerate(leaves):
        if i in shared:
            continue
        if t.dim() == 0:
            raise ValueError(
                f"the {what}'s tensor leaf #{i} is 0-dimensional: nothing to split along dim 0 "
                "(wrap a value that every microbatch shares in zbpp.runtime.Replicated)"
            )
        sizes.setdefault(int(t.shape[0]), i)
    if not sizes:
        raise ValueError(
            f"every tensor of the {what} is Replicated ({describe(obj)}): no tensor gives the batch's rows to "
            f"split into {parts} microbatches"
        )
    many = sorted((i, n) for n, i in sizes.items() if n != 1)
    if len(many) > 1:
        (i0, r0), (i1, r1) = many[0], many[1]
        raise ValueError(
            f"the {what}'s tensor leaves have different sizes along dim 0 ({r0} at leaf #{i0} and {r1} at leaf #{i1}, "
            f"{describe(obj)}); every tensor is split into microbatches along dim 0, except those with one row "
            "and those wrapped in zbpp.runtime.Replicated, which every microbatch gets whole"
        )
    rows = many[0][1] if many else 1
    if many:  # one-row leaves beside a batch of more rows: shared
        shared |= {i for i, t in enumerate(leaves) if i not in shared and t.shape[0] == 1}
    if rows < parts:
        raise ValueError(
            f"the {what} has {rows} rows along dim 0, fewer than the {parts} microbatches of the schedule"
        )
    return rows, shared


def call(fn: Callable[..., Any], arg: Any) -> Any:
    """Call a stage: a tuple/list is unpacked, a dict passed as keywords, anything else as is."""
    if isinstance(arg, (tuple, list)):
        return fn(*arg)
    if isinstance(arg, dict):
        return fn(**arg)
    return fn(arg)


def describe(obj: Any) -> str:
    """A short human-readable form: shapes and dtypes instead of tensor values."""
    return str(flatten(obj)[1])
