"""The errors a pipeline step raises on every rank (`zbpp.runtime.agreement` says how)."""

from __future__ import annotations

__all__ = ["GraphCaptureError", "PipelineError", "ShapeMismatchError"]


class PipelineError(RuntimeError):
    """A pipeline step failed; the message names the rank and the task, the cause is chained. Also
    raised by a collective call (building a `Pipeline`, a checkpoint) on the ranks where another
    rank's part failed, naming that rank and its error."""


class ShapeMismatchError(PipelineError):
    """A stage's output differs from what the receiving rank was told for this input signature."""


class GraphCaptureError(RuntimeError):
    """A task could not be captured into a CUDA graph (``Pipeline(cuda_graphs=True)``, see
    `zbpp.runtime.task_graphs`); the step's `PipelineError` chains it as its cause."""


def describe_error(exc: BaseException) -> str:
    """``"Type: message"`` for the other ranks, even when ``str(exc)`` itself raises: a rank that
    raised here would leave the exchange its peers wait in.

    >>> class Bad(Exception):
    ...     def __str__(self): raise ValueError("oops")
    >>> describe_error(Bad())
    'Bad: (its str() raised ValueError)'
    """
    try:
        text = str(exc)
    except Exception as inner:  # noqa: BLE001
        text = f"(its str() raised {type(inner).__name__})"
    return f"{type(exc).__name__}: {text}"
