"""pytest plugin entry point (registered as `zbpp` in pytest11)."""
