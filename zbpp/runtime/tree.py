"""Stage inputs and outputs as trees: flatten, rebuild, split into microbatches, describe.

A stage's input or output is a tensor, a tuple/list, a dict (nested freely), or any other value
(passed along as is). `flatten` turns it into its tensor leaves plus a `Spec` that holds the
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["TensorMeta", "Spec", "flatten", "rebuild", "split", "call", "describe"]


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
# ("tuple" | "list", children); ("dict", ((key, child), ...)); ("namedtuple", (cls, children)).
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
    return ("V", o)


def flatten(obj: Any) -> tuple[list[torch.Tensor], Spec]:
    """The tensor leaves of `obj` (depth first) and its `Spec`."""
    # Module-level recursion on purpose: a recursive closure refers to itself through its cell, a
    # reference cycle that would keep `leaves` (activations, gradients) alive until the next
    # garbage collection instead of freeing them when the step lets go.
    leaves: list[torch.Tensor] = []
    node = _walk(obj, leaves)
    return leaves, Spec(node, tuple(TensorMeta.of(t) for t in leaves))


def _build(node: Node, leaves: list[torch.Tensor]) -> Any:
    tag, body = node
    if tag == "T":
        return leaves[body]
    if tag == "V":
        return body
    if tag == "dict":
        return {k: _build(c, leaves) for k, c in body}
    if tag == "namedtuple":
        cls, kids = body
        return cls(*(_build(c, leaves) for c in kids))
    children = [_build(c, leaves) for c in body]
    return tuple(children) if tag == "tuple" else children


def rebuild(spec: Spec, leaves: list[torch.Tensor]) -> Any:
    """Inverse of `flatten`: the tree of `spec` with `leaves` in place of its tensors."""
    return _build(spec.node, leaves)


def split(obj: Any, parts: int, *, what: str = "input") -> list[Any]:
    """Split every tensor of `obj` along dim 0 into `parts` microbatches (``torch.tensor_split``:
    sizes differ by at most one, the larger first). Non-tensor values go to every microbatch.

    Raises `ValueError`, naming the leaf, for a 0-d tensor, tensors whose dim 0 differ, or fewer rows
    than `parts`.
    """
    leaves, spec = flatten(obj)
    if not leaves:
        raise ValueError(f"the {what} has no tensor to split into {parts} microbatches: {describe(obj)}")
    rows = None
    for i, t in enumerate(leaves):
        if t.dim() == 0:
            raise ValueError(f"the {what}'s tensor leaf #{i} is 0-dimensional: nothing to split along dim 0")
        if rows is None:
            rows = t.shape[0]
        elif t.shape[0] != rows:
            raise ValueError(
                f"the {what}'s tensor leaves have different sizes along dim 0 ({rows} and {t.shape[0]} "
                f"at leaf #{i}, {describe(obj)}); every tensor is split into microbatches along dim 0"
            )
    assert rows is not None
    if rows < parts:
        raise ValueError(
            f"the {what} has {rows} rows along dim 0, fewer than the {parts} microbatches of the schedule"
        )
    pieces = [torch.tensor_split(t, parts, dim=0) for t in leaves]
    return [rebuild(spec, [p[j] for p in pieces]) for j in range(parts)]


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
