"""zbpp.testing: run a test function on N ranks (see `zbpp.testing.distributed`)."""
