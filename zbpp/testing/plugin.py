"""pytest plugin: distributed test pools. An installed zbpp loads it by itself (its ``pytest11``
entry point ``zbpp``); ``-p zbpp.testing.plugin`` or ``pytest_plugins = ["zbpp.testing.plugin"]``
load it where zbpp is not installed (a checkout on ``PYTHONPATH``) or with autoloading off, and
are harmless beside the entry point. ``-p no:zbpp.testing.plugin`` turns it off.

Fixture ``zbpp_workers`` (session scope): ``zbpp_workers(world_size, backend="gloo", **options)``
returns a started `zbpp.testing.Workers` pool, one per (world size, backend, options) for the whole
session, so test modules asking for the same ranks share their processes (and what those have
imported). ``timeout`` and ``grace`` act in the parent only: pools differing only in them are one
pool, and each call sets them for the runs that follow it. Idle pools beyond ``--zbpp-keep-ranks``
ranks in all are closed, the least recently asked for first. An NCCL pool on a machine without
enough GPUs skips the test, saying so. ::

    from mytests.cases import check_case        # a module-level function

    def test_schedules(zbpp_workers):
        workers = zbpp_workers(4)               # started once, for every module that asks for 4
        for name in ("1f1b", "zb-h1"):
            workers.run(check_case, name)       # runs on all 4 ranks; raises with every rank's failure

A function shipped to a pool must leave no state behind that another test could trip on (the
ranks outlive the test). Options ``--zbpp-timeout SECONDS`` (default 300) bounds each ``run``;
``--zbpp-keep-ranks N`` (default 8) bounds the ranks kept alive between uses.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

#: options of `Workers` read by the parent only: they do not make a pool of their own
_PARENT_SIDE = ("timeout", "grace")
_GRACE = 5.0  # `Workers`' default


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("zbpp")
    group.addoption("--zbpp-timeout", type=float, default=300.0,
                    help="seconds a distributed zbpp test run may take before its ranks are stopped (default 300)")
    group.addoption("--zbpp-keep-ranks", type=int, default=8,
                    help="ranks of idle zbpp_workers pools kept alive for later tests (default 8)")


def _frozen(value: Any) -> Any:
    """`value` made hashable (a pool's key): dicts (``env``) as sorted item tuples, lists as tuples."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


@pytest.fixture(scope="session")
def zbpp_workers(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    from .distributed import Workers, gpus_available

    pools: dict[tuple, Workers] = {}  # in order of last use, the most recent last
    timeout = request.config.getoption("--zbpp-timeout", default=300.0)
    keep = request.config.getoption("--zbpp-keep-ranks", default=8)

    def get(world_size: int = 2, backend: str = "gloo", **options: Any) -> Workers:
        parent_side = {k: options.pop(k) for k in _PARENT_SIDE if k in options}
        key = (world_size, backend, _frozen(options))
        if key not in pools:
            if backend == "nccl" and not gpus_available(world_size):
                pytest.skip(f"needs {world_size} CUDA GPUs for NCCL (this machine has fewer or no CUDA)")
            # the process group's own timeout stays the default run timeout's, whatever this call's
            options.setdefault("pg_timeout", timeout)
            pools[key] = Workers(world_size, backend=backend, **options)
        pool = pools.pop(key)
        pools[key] = pool
        pool.timeout = parent_side.get("timeout", timeout)
        pool.grace = parent_side.get("grace", _GRACE)
        alive = world_size + sum(p.world_size for p in pools.values() if p.running and p is not pool)
        for other in list(pools.values()):
            if alive <= keep or other is pool:
                break
            if other.running:
                other.close()
                alive -= other.world_size
        return pool.start()

    yield get
    for pool in pools.values():
        pool.close()
