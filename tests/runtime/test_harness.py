"""zbpp.testing: results in rank order, every rank's failure reported, hangs and deaths stopped."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from zbpp.testing import DistributedTestError, Workers, distributed, run_distributed


def rank_and_world() -> tuple[int, int, str]:
    return dist.get_rank(), dist.get_world_size(), os.environ["RANK"]


def raise_on_rank_one_else_wait() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    t = torch.zeros(1)
    dist.recv(t, 1)  # waits for a message rank 1 will never send


def env_var(name: str) -> str | None:
    return os.environ.get(name)


def sleep_forever_in_here() -> None:
    time.sleep(600)


def _refuse_to_unpickle() -> None:
    raise RuntimeError("cannot rebuild this argument on a rank")


class UnpicklableOnRanks:
    """Pickles in the parent; unpickling it (on a rank) raises."""

    def __reduce__(self):
        return (_refuse_to_unpickle, ())


def return_then_die_on_rank_one() -> int:
    """Returns on every rank; rank 1 then dies (exit code 7) while idle, 0.1 s later."""
    if dist.get_rank() == 1:
        threading.Thread(target=lambda: (time.sleep(0.1), os._exit(7)), daemon=True).start()
    return 0


def die_on_rank_one() -> int:
    if dist.get_rank() == 1:
        os._exit(3)
    return 0


@distributed(world_size=2)
def test_decorated_body_runs_on_every_rank():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0


def test_results_come_back_in_rank_order():
    assert run_distributed(rank_and_world, 3) == [(0, 3, "0"), (1, 3, "1"), (2, 3, "2")]


def test_a_failing_rank_and_its_waiting_peer_are_both_reported(zbpp_workers):
    workers = zbpp_workers(2, grace=1.0)
    with pytest.raises(DistributedTestError) as info:
        workers.run(raise_on_rank_one_else_wait)
    text = str(info.value)
    assert "ValueError: boom on purpose" in info.value.failures[1]
    assert "after another rank failed" in info.value.failures[0]
    assert "raise_on_rank_one_else_wait" in info.value.failures[0]  # its stack shows where it waits
    assert "2 of 2 ranks failed" in text
    assert not workers.running
    assert workers.run(rank_and_world)[1][:2] == (1, 2)  # the pool restarts on demand


def test_a_hung_run_is_stopped_with_stacks(zbpp_workers):
    workers = zbpp_workers(2, grace=1.0)
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        workers.run(sleep_forever_in_here, timeout=2)
    assert time.monotonic() - t0 < 30
    assert all("no result within the timeout of 2 s" in f for f in info.value.failures.values())
    assert "sleep_forever_in_here" in info.value.failures[0]
    # the closing summary names why and where it waited (it used to show the dump's outermost
    # frame, the fork server's '<string>' line)
    summary = str(info.value).split("failed first")[-1]
    assert "no result within the timeout of 2 s" in summary and "in sleep_forever_in_here" in summary
    assert "<string>" not in summary


def test_a_run_without_a_time_limit_or_with_a_long_one(zbpp_workers):
    """``timeout=math.inf`` (or over about 24 days) went to one wait for the ranks' replies, which the
    OS refuses: OverflowError ("timeout is too large") before any result. An infinite pool timeout
    needs a finite process group timeout, said by name (it overflowed the store's timedelta)."""
    import math

    workers = zbpp_workers(2)
    for limit in (math.inf, 1e7):
        assert workers.run(rank_and_world, timeout=limit) == [(0, 2, "0"), (1, 2, "1")]
    with pytest.raises(ValueError, match="pg_timeout must be a finite number of seconds"):
        Workers(2, timeout=math.inf)


def test_a_dead_rank_is_reported_with_its_exit_code(zbpp_workers):
    with pytest.raises(DistributedTestError, match="exited with code 3"):
        zbpp_workers(2, grace=1.0).run(die_on_rank_one)


def test_an_argument_a_rank_cannot_unpickle_is_reported_with_its_traceback(zbpp_workers):
    """The job reaches the ranks but cannot be rebuilt there: each rank reports why (it used to die
    as it read the job, reported only as 'exited with code 1', its traceback lost)."""
    workers = zbpp_workers(2, grace=1.0)
    with pytest.raises(DistributedTestError) as info:
        workers.run(rank_and_world, UnpicklableOnRanks())
    assert set(info.value.failures) == {0, 1}
    for report in info.value.failures.values():
        assert "RuntimeError: cannot rebuild this argument on a rank" in report and "_refuse_to_unpickle" in report
    assert "cannot rebuild this argument" in info.value.first_error


def test_a_lambda_or_local_function_is_refused_by_name(zbpp_workers):
    """The ranks import functions by name: a lambda or a local function used to fail deep in
    pickling (AttributeError: Can't pickle local object) or, decorated, on every rank as
    "'function' object has no attribute '<locals>'"."""
    workers = zbpp_workers(2, grace=1.0)

    def body() -> int:
        return 1

    for fn in (lambda: 1, body):
        with pytest.raises(TypeError, match=r"Workers.run: .*(<lambda>|body) is a lambda .*module level"):
            workers.run(fn)
    with pytest.raises(TypeError, match=r"@distributed: .*<locals>.body .*module level"):
        distributed(world_size=2)(body)


def test_fixture_pools_with_env_are_told_apart_by_it(zbpp_workers):
    """`env` (a dict) is one of Workers' options: the fixture keys its pools by it (a dict in the key
    used to raise TypeError: unhashable type), and pools with different env values are different."""
    assert zbpp_workers(2, env={"ZBPP_TEST_VALUE": "a"}).run(env_var, "ZBPP_TEST_VALUE") == ["a", "a"]
    assert zbpp_workers(2, env={"ZBPP_TEST_VALUE": "b"}).run(env_var, "ZBPP_TEST_VALUE") == ["b", "b"]
    assert zbpp_workers(2, env={"ZBPP_TEST_VALUE": "a"}).run(env_var, "ZBPP_TEST_VALUE") == ["a", "a"]


def test_a_non_string_env_value_is_refused_by_name(zbpp_workers):
    """Every rank used to die setting it, reported only as 'exited with code 1 without reporting'."""
    with pytest.raises(TypeError, match=r"env must map str to str; got 'ZBPP_TEST_VALUE': 1"):
        zbpp_workers(2, env={"ZBPP_TEST_VALUE": 1})


def test_a_rank_that_died_between_runs_is_reported_and_the_pool_restarts(zbpp_workers):
    """Rank 1 dies after its run returned (a thread it left behind exits): the next run reports rank
    1's exit code as a DistributedTestError, instead of a bare BrokenPipeError from sending it the job
    (raised by every later run too, the pool never restarting), and the run after that succeeds."""
    workers = zbpp_workers(2, grace=1.0)
    assert workers.run(return_then_die_on_rank_one) == [0, 0]
    time.sleep(2.0)  # rank 1 exits 0.1 s after returning; 2 s leaves it ample time on a busy machine
    with pytest.raises(DistributedTestError) as info:
        workers.run(rank_and_world)
    assert list(info.value.failures) == [1]
    assert "exited with code 7" in info.value.failures[1] and "before this run" in info.value.failures[1]
    assert [r[:2] for r in workers.run(rank_and_world)] == [(0, 2), (1, 2)]  # restarted


class _StoreNobodyReaches:
    """The parent's rendezvous store, advertising a port where nothing listens: the ranks retry
    connecting until their process-group timeout, so the pool's start hangs that long."""

    def __init__(self, *args, **kwargs) -> None:
        import socket

        self._store = _REAL_STORE(*args, **kwargs)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]


_REAL_STORE = dist.TCPStore


def test_a_run_timeout_bounds_the_pool_restart(monkeypatch):
    """`run(timeout=3)` on a pool that must (re)start, whose start hangs: the run ends within its
    timeout (plus the stacks' second and the kill), reporting the start, where it used to wait for
    start's own limit (180 s; here the ranks give up connecting after their 60 s pg_timeout and a
    retry)."""
    workers = Workers(2, pg_timeout=60, timeout=300, grace=1.0)
    monkeypatch.setattr(dist, "TCPStore", _StoreNobodyReaches)
    t0 = time.monotonic()
    try:
        with pytest.raises(DistributedTestError) as info:
            workers.run(rank_and_world, timeout=3)
    finally:
        workers.close()
    # 3 s, then 1 s for the stacks and a few for the kill on a loaded machine; well under the 60 s
    assert time.monotonic() - t0 < 30
    assert "starting the process group" in str(info.value)
    assert all("no result within the timeout of 3 s" in f for f in info.value.failures.values())


def test_the_pytest_plugin_loads_once_whichever_way_it_is_asked_for(tmp_path):
    """pytest registers an entry point's module under the entry point's name and a module named to
    `-p` or in `pytest_plugins` under its own: one module under two names stops pytest before any
    test ("Plugin already registered under a different name"). Installed as pyproject.toml
    declares it (a dist-info on PYTHONPATH, ahead of the venv's own install), the plugin must load
    with `-p zbpp.testing.plugin` and a conftest naming it, and by its entry point name with
    autoloading off; each run sees the fixture and the plugin's option."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    import zbpp

    source = Path(zbpp.__file__).resolve().parents[1]
    section = next(s for s in (source / "pyproject.toml").read_text().split("\n[")
                   if s.startswith("project.entry-points.pytest11]"))
    value = re.search(r'^zbpp = "([^"]+)"', section, re.M).group(1)
    dist_info = tmp_path / "site" / "zbpp_under_test-0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: zbpp-under-test\nVersion: 0\n")
    (dist_info / "entry_points.txt").write_text(f"[pytest11]\nzbpp = {value}\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text('pytest_plugins = ["zbpp.testing.plugin"]\n')
    (tests / "test_it.py").write_text(
        "def test_fixture_and_option(zbpp_workers, pytestconfig):\n"
        "    assert callable(zbpp_workers) and pytestconfig.getoption('--zbpp-timeout') == 300.0\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), str(source), env.get("PYTHONPATH", "")])
    runs = {
        "-p zbpp.testing.plugin, autoloaded": (["-p", "zbpp.testing.plugin"], {}),
        "-p zbpp, autoloading off": (["-p", "zbpp"], {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}),
    }
    # the venv's other autoloaded plugins are blocked: importing hypothesis alone takes seconds
    quiet = ["-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:anyio", "-p", "no:timeout"]
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "pytest", *quiet, *args, str(tests)],
                               cwd=tmp_path, env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
        for name, (args, extra) in runs.items()
    }
    for name, proc in procs.items():
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0 and "1 passed" in out, f"{name}:\n{out[:1500]}"
