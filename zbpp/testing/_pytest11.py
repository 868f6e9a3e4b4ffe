"""What zbpp's ``pytest11`` entry point (named ``zbpp``) loads: `zbpp.testing.plugin`, by name.

pytest registers an entry point's module under the entry point's name, and a module named to
``-p`` or in ``pytest_plugins`` under the module's own name: one module under two names fails
("Plugin already registered under a different name"). The entry point points here instead, and
this module asks for the plugin by its module name, which pytest loads once whichever way it comes.
"""

pytest_plugins = ["zbpp.testing.plugin"]
