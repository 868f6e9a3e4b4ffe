"""The example scripts as modules (examples/ is not a package), and running one's `train` on a rank."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def load_example(script: str) -> Any:
    """examples/`script`.py, imported once per process."""
    name = f"zbpp_example_{script}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def train_example(script: str, argv: list[str]) -> dict[str, Any]:
    """Runs on every rank: the example's `train`, with what it printed under ``"stdout"``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = load_example(script).train(argv)
    result["stdout"] = out.getvalue()
    return result
