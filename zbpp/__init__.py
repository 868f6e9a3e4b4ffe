"""zbpp: zero-bubble pipeline-parallel training for PyTorch.

The schedule core (`zbpp.schedules`) is pure Python; `Pipeline` and `ParallelGroups` import torch
when first used.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Pipeline", "ParallelGroups", "__version__"]


def __getattr__(name: str) -> Any:  # lazy: keep `import zbpp.schedules` free of torch
    if name == "Pipeline":
        from .runtime import Pipeline

        return Pipeline
    if name == "ParallelGroups":
        from .runtime import ParallelGroups

        return ParallelGroups
    raise AttributeError(f"module 'zbpp' has no attribute {name!r}")
