"""Load zbpp's pytest plugin (the ``zbpp_workers`` fixture) when pytest does not do it by itself:
an installed zbpp registers it as a ``pytest11`` entry point, but a checkout run in place
(``PYTHONPATH=$PWD``, as on the GPU machine) or ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` has none."""

from __future__ import annotations

import importlib.metadata
import os


def _autoloaded() -> bool:
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    try:
        # zbpp.testing._pytest11, or the plugin itself in an install made before that existed
        values = {"zbpp.testing._pytest11", "zbpp.testing.plugin"}
        return any(ep.value in values for ep in importlib.metadata.entry_points(group="pytest11"))
    except Exception:  # noqa: BLE001 - unreadable metadata: load it ourselves
        return False


if not _autoloaded():
    pytest_plugins = ["zbpp.testing.plugin"]
