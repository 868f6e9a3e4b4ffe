"""pytest plugin (registered as ``zbpp`` in the ``pytest11`` entry points): distributed test pools.

Fixture ``zbpp_workers`` (module scope): ``zbpp_workers(world_size, backend="gloo", **options)``
returns a started `zbpp.testing.Workers` pool, one per (world size, backend, options) per test
module, closed when the module's tests are done. An NCCL pool on a machine without enough GPUs
skips the test, saying so. ::

    from mytests.cases import check_case        # a module-level function

    def test_schedules(zbpp_workers):
        workers = zbpp_workers(4)               # spawned once for the whole module
        for name in ("1f1b", "zb-h1"):
            workers.run(check_case, name)       # runs on all 4 ranks; raises with every rank's failure

Option ``--zbpp-timeout SECONDS`` (default 300) bounds each ``run``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("zbpp")
    group.addoption("--zbpp-timeout", type=float, default=300.0,
                    help="seconds a distributed zbpp test run may take before its ranks are stopped (default 300)")


@pytest.fixture(scope="module")
def zbpp_workers(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    from .distributed import Workers, gpus_available

    pools: dict[tuple, Workers] = {}
    timeout = request.config.getoption("--zbpp-timeout", default=300.0)

    def get(world_size: int = 2, backend: str = "gloo", **options: Any) -> Workers:
        key = (world_size, backend, tuple(sorted(options.items())))
        if key not in pools:
            if backend == "nccl" and not gpus_available(world_size):
                pytest.skip(f"needs {world_size} CUDA GPUs for NCCL (this machine has fewer or no CUDA)")
            options.setdefault("timeout", timeout)
            pools[key] = Workers(world_size, backend=backend, **options)
        return pools[key].start()

    yield get
    for pool in pools.values():
        pool.close()
