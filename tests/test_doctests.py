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


# Exported names whose own docstring has no runnable example yet (most are shown in their module's
# docstring; ParallelGroups, init_distributed and shutdown_and_exit need a process group). Shrink
# this set as examples are added; a new export must come with one.
WITHOUT_OWN_EXAMPLE = {
    "zbpp.ParallelGroups", "zbpp.runtime.ParallelGroups", "zbpp.runtime.init_distributed",
    "zbpp.runtime.shutdown_and_exit", "zbpp.runtime.PipelineError", "zbpp.runtime.ShapeMismatchError",
    "zbpp.runtime.GraphCaptureError", "zbpp.runtime.measured_bubble_rate", "zbpp.runtime.microbatch_seed",
    "zbpp.schedules.Action", "zbpp.schedules.Kind", "zbpp.schedules.ScheduleError", "zbpp.schedules.SimResult",
    "zbpp.schedules.register", "zbpp.modules.fuse_gated_mlps", "zbpp.modules.supports_keys",
    "zbpp.viz.plot", "zbpp.viz.render_ascii", "zbpp.viz.write_trace",
    "zbpp.testing.Workers", "zbpp.testing.DistributedTestError", "zbpp.testing.distributed",
    "zbpp.testing.gpus_available",
    "zbpp.models.PipelineStages", "zbpp.models.balanced_partition", "zbpp.models.fqns_per_stage",
    "zbpp.models.pipeline_stages", "zbpp.models.measure_profile",
}


def test_exported_names_have_their_own_example() -> None:
    """Every class and function in zbpp's and its subpackages' ``__all__`` shows a runnable example
    (``>>>``) in its own docstring, but for the listed exceptions."""
    lacking = set()
    for package in ["zbpp", "zbpp.schedules", "zbpp.runtime", "zbpp.modules", "zbpp.viz", "zbpp.testing",
                    "zbpp.models"]:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj) and ">>>" not in (obj.__doc__ or ""):
                lacking.add(f"{package}.{name}")
    assert lacking <= WITHOUT_OWN_EXAMPLE, f"exported without an example: {sorted(lacking - WITHOUT_OWN_EXAMPLE)}"
    assert not WITHOUT_OWN_EXAMPLE - lacking, f"have examples now, drop them from the list: {sorted(WITHOUT_OWN_EXAMPLE - lacking)}"
