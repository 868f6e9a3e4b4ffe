"""Every runnable example in zbpp's docstrings runs and prints what it says (the API docs stay true)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import zbpp

# zbpp.__main__ runs the CLI when imported.
SKIP = {"zbpp.__main__"}
MODULES = sorted(
    m.name for m in pkgutil.walk_packages(zbpp.__path__, prefix="zbpp.") if m.name not in SKIP
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"


def test_public_entry_points_have_examples() -> None:
    """The modules users start from carry at least one runnable example each."""
    for name in ["zbpp.schedules", "zbpp.schedules.registry", "zbpp.schedules.simulate", "zbpp.schedules.dag",
                 "zbpp.schedules.ir", "zbpp.viz.ascii", "zbpp.modules", "zbpp.modules.context",
                 "zbpp.models", "zbpp.models.stages", "zbpp.models.hf"]:
        assert doctest.testmod(importlib.import_module(name)).attempted > 0, name
