"""Run a function on N ranks: rank processes with a process group (gloo on CPU, or NCCL).

Three ways in, from the most to the least reuse:

1. A pool, started once and given many functions (what a test module with many cases wants)::

       from zbpp.testing import Workers
       with Workers(4) as workers:                 # 4 gloo ranks, process group initialised
           results = workers.run(check_case, "zb-h1", 8)   # check_case(...) on every rank
           results = workers.run(check_case, "1f1b", 4)    # same processes, no new spawn

   In pytest, the plugin's ``zbpp_workers`` fixture hands out such pools (one per world size,
   backend and options, kept for the session)::

       def test_cases(zbpp_workers):
           zbpp_workers(4).run(check_case, "zb-h1", 8)

2. One call: ``run_distributed(check_case, 4, args=("zb-h1", 8))``.

3. A decorator for a test whose body runs on every rank::

       @distributed(world_size=2)
       def test_allreduce():
           t = torch.ones(1); dist.all_reduce(t); assert t.item() == 2

The function runs in every rank with ``torch.distributed`` initialised (``dist.get_rank()``,
``dist.get_world_size()``; ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` are set; on NCCL the current
CUDA device is ``rank % device_count``). It must be importable by name (defined at module level),
as must its arguments and return value (they are pickled). `run` returns every rank's return value,
in rank order.

Failures: if any rank raises, `run` raises `DistributedTestError` with every rank's traceback,
and ends its message with the error of the rank that failed first, in a few lines (the other ranks
usually fail because of it). A rank that raised usually leaves its peers waiting for it; they get
`grace` seconds to finish or fail, then their Python stacks are dumped (so you see where they
wait) and the pool is killed; a rank that dies (segfault, ``os._exit``) is reported with its exit
code; a run longer than `timeout` seconds is stopped the same way. A killed pool restarts on its
next `run`.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

_WAIT_SLICE = 3600.0  # seconds of one wait for the ranks' replies

__all__ = ["Workers", "DistributedTestError", "run_distributed", "distributed", "gpus_available", "short_error"]


class DistributedTestError(AssertionError):
    """Some rank failed; `failures` maps each failing rank to its report (traceback, stack or exit).

    `first_rank` is the rank that failed first (the earliest to raise or die; the others usually
    fail because of it) and `first_error` a few lines of its report: where it raised and what. The
    message lists every rank's full report and ends with those lines.
    """

    def __init__(self, message: str, failures: dict[int, str], first_rank: int | None = None,
                 first_error: str = "") -> None:
        super().__init__(message)
        self.failures = failures
        self.first_rank = first_rank if first_rank is not None else min(failures, default=None)
        self.first_error = first_error


def short_error(report: str, *, max_message_lines: int = 4, width: int = 300) -> str:
    r"""A few lines of a rank's report: the innermost frame and the exception, or the report's start.

    A chained exception adds the root cause's last line.

    >>> tb = ('Traceback (most recent call last):\n  File "a.py", line 3, in f\n    g()\n'
    ...       '  File "b.py", line 9, in g\n    raise ValueError("boom")\nValueError: boom\n')
    >>> print(short_error(tb))
      File "b.py", line 9, in g
        raise ValueError("boom")
    ValueError: boom

    A stuck rank's report (its stack dump lists the innermost frame first) gives why it was
    stopped and where it waited:

    >>> dump = ('no result within the timeout of 2 s (f); its Python stacks:\n'
    ...         'Current thread 0x1 (most recent call first):\n  File "a.py", line 3 in f\n  File "<string>", line 1 in <module>\n')
    >>> print(short_error(dump))
    no result within the timeout of 2 s (f); its Python stacks:
      File "a.py", line 3 in f
    """
    lines = [line[:width] + (" ..." if len(line) > width else "") for line in report.rstrip().splitlines()]
    current = next((i for i, line in enumerate(lines) if "(most recent call first)" in line), None)
    if current is not None:  # a stuck rank's stack dump: why it was stopped, then its innermost frame
        current = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), current)
        frame = next((line for line in lines[current + 1:] if line.startswith('  File "')), None)
        return "\n".join([lines[0]] + ([frame] if frame is not None and current > 0 else []))
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not frames:  # a death or a hang: its first lines say what happened
        head = lines[:max_message_lines]
        return "\n".join(head + ([f"... ({len(lines) - len(head)} more lines above)"] if len(lines) > len(head) else []))
    i = frames[-1]
    out = [lines[i]]
    rest = lines[i + 1:]
    if rest and rest[0].startswith("    ") and not set(rest[0].strip()) <= set("^~ "):
        out.append(rest[0])
        rest = rest[1:]
    message = [line for line in rest if not (line.strip() and set(line.strip()) <= set("^~"))]
    out += message[:max_message_lines]
    if len(message) > max_message_lines:
        out.append(f"... ({len(message) - max_message_lines} more lines above)")
    for separator in ("The above exception was the direct cause", "During handling of the above exception"):
        cut = next((j for j, line in enumerate(lines) if line.startswith(separator)), None)
        if cut is not None:
            cause = next((line for line in reversed(lines[:cut]) if line.strip()), "")
            out.append(f"(caused by: {cause.strip()})")
            break
    return "\n".join(out)


def gpus_available(n: int) -> bool:
    """True when NCCL can run `n` ranks here (at least `n` CUDA devices)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() >= n and dist.is_nccl_available()


@dataclass(frozen=True)
class _FunctionRef:
    """A function named by module and qualified name; resolves to the undecorated function."""

    module: str
    qualname: str

    def resolve(self) -> Callable[..., Any]:
        obj: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return getattr(obj, "__zbpp_body__", obj)


# heavy imports a rank of a test session makes (FSDP2 and DTensor, torch's pipelining, inductor,
# transformers' models, zbpp's runtime and the DCP its checkpoints use), preloaded into the fork
# server where the parent has imported the first of each (transformers imports its modelling code
# lazily, zbpp DCP)
_PRELOAD_IF_IMPORTED = (("torch.distributed.tensor",), ("torch.distributed.fsdp",), ("torch.distributed.pipelining",),
                        ("torch._inductor",), ("transformers", "transformers.modeling_utils"),
                        ("zbpp.runtime", "torch.distributed.checkpoint"), ("zbpp.models",))


def _process_context() -> Any:
    """Where ranks come from: a fork server that imported torch once (a rank starts in tens of
    milliseconds instead of importing torch for a second or two; `_PRELOAD_IF_IMPORTED` too where
    the parent imported them), or plain spawn where the
    platform has no fork server. Neither inherits the parent's threads or CUDA state."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # effective until the server starts. torch._dynamo always: every torch optimizer imports it
    # when built. The rest only where the parent imported them (a test session imports its
    # modules' imports at collection), as every rank would otherwise import them anew, seconds each
    extra = [name for names in _PRELOAD_IF_IMPORTED if names[0] in sys.modules for name in names]
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", *extra])
    return ctx


def _worker_main(rank: int, world: int, backend: str, port: int, conn: Any, dump_path: str,
                 pg_timeout: float, threads: int, env: dict[str, str], eager_init: bool) -> None:
    os.environ.clear()  # the parent's environment as of `start`, not the fork server's
    # Ctrl-C raises KeyboardInterrupt, as in a torchrun rank: a parent started in the background
    # (`cmd &`) ignores SIGINT, and the fork server and ranks would inherit that
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dump = open(dump_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=pg_timeout))
        extra = {"device_id": torch.device("cuda", torch.cuda.current_device())} if eager_init else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout), **extra)
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc(), time.time()))
        return
    while True:
        try:
            job = conn.recv()
        except EOFError:
            break
        except BaseException:  # noqa: BLE001 - the job's bytes were read whole; report and wait for the next
            # a function or argument that pickled in the parent but cannot be rebuilt here (a module
            # the rank cannot import, a failing __reduce__): escaping, it would kill the rank silently
            conn.send(("error", "the job could not be unpickled on this rank:\n" + traceback.format_exc(), time.time()))
            continue
        if job is None:
            break
        try:
            fn, args, kwargs = job
            if isinstance(fn, _FunctionRef):
                fn = fn.resolve()
            reply = ("ok", fn(*args, **kwargs))
            conn.send(reply)
        except BaseException:  # noqa: BLE001 - reported to the parent
            failed_at = time.time()  # before formatting, which may be slow: tells which rank failed first
            conn.send(("error", traceback.format_exc(), failed_at))
    try:
        dist.barrier()  # no rank tears its connections down while a peer still uses them
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    # Skip the interpreter's teardown (about a second of CPU per rank with torch loaded): nothing
    # is left to run but garbage collection; what the rank printed is flushed first.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _check_by_name(fn: Any, where: str) -> None:
    """Refuse a lambda or a function defined inside another: the ranks import functions by name."""
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"{where}: {fn.__module__}.{qualname} is a lambda or a function defined inside "
                        "another; the ranks import it by name: define it at module level")


class Workers:
    """A pool of `world_size` rank processes with an initialised process group.

    Args:
        world_size: ranks to spawn.
        backend: "gloo" (CPU) or "nccl" (needs `world_size` GPUs; see `gpus_available`).
        timeout: default seconds a `run` may take before it is stopped (``math.inf``: no limit).
        pg_timeout: the process group's timeout (seconds); default `timeout` (required with an
            infinite one).
        grace: seconds the other ranks get after one rank failed, before they are stopped.
        threads: torch threads per rank (default 1: ranks share the machine's cores).
        env: extra environment variables for the ranks.
        eager_init: NCCL only: pass ``device_id`` to ``init_process_group`` (one communicator,
            created up front and shared by all operations, instead of one per pair of ranks).
    """

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout: float = 300.0,
                 pg_timeout: float | None = None, grace: float = 5.0, threads: int = 1,
                 env: dict[str, str] | None = None, eager_init: bool = False) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not gpus_available(world_size):
            raise RuntimeError(f"NCCL with {world_size} ranks needs {world_size} CUDA GPUs")
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.pg_timeout = pg_timeout if pg_timeout is not None else timeout
        if not math.isfinite(self.pg_timeout):  # else the store's timedelta overflows in start()
            raise ValueError(f"pg_timeout must be a finite number of seconds, got {self.pg_timeout!r} "
                             "(give one with timeout=math.inf)")
        self.grace = grace
        self.threads = threads
        self.env = dict(env or {})
        # checked here: a rank setting a non-string value dies before it can report why
        bad = {k: v for k, v in self.env.items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad:
            raise TypeError(f"env must map str to str; got {', '.join(f'{k!r}: {v!r}' for k, v in bad.items())}")
        if eager_init and backend != "nccl":
            raise ValueError("eager_init applies to NCCL only")
        self.eager_init = eager_init
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._store: Any = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return bool(self._procs)

    def start(self, *, timeout: float = 180.0) -> "Workers":
        """Spawn the ranks and wait until their process group is up (done by `run` when needed)."""
        if self._procs:
            return self
        import torch.distributed as dist

        self._tmp = tempfile.TemporaryDirectory(prefix="zbpp-workers-")
        # The parent hosts the rendezvous store on a free port the OS picks: no port race.
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.pg_timeout))
        ctx = _process_context()
        env = {**os.environ, **self.env}
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, self.backend, self._store.port, child, self._dump_path(rank),
                      self.pg_timeout, self.threads, env, self.eager_init),
                name=f"zbpp-rank{rank}",
                daemon=True,
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        replies = self._collect("start", timeout)
        if any(kind != "ok" for kind, _, _ in replies.values()):
            self._fail("starting the process group", replies)
        return self

    def close(self) -> None:
        """Stop the ranks (politely, then by force)."""
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def __enter__(self) -> "Workers":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- running ------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order. `timeout`
        (default the pool's) bounds the whole call, a restart of the pool included."""
        _check_by_name(fn, "Workers.run")
        limit = timeout if timeout is not None else self.timeout
        deadline = time.monotonic() + limit
        self.start(timeout=limit)  # a pool stopped by a failure restarts here, within this run's time
        what = f"running {getattr(fn, '__qualname__', fn)!r}"
        # A rank that died while idle (a thread or handler a function left behind) would make the
        # send below raise a bare BrokenPipeError, on this run and every later one.
        dead = {r: p.exitcode for r, p in enumerate(self._procs) if not p.is_alive()}
        if dead:
            self._fail(what, {r: ("died", f"process exited with code {code} after its previous run returned, "
                                          "before this run (something a function left behind ended it)", time.time())
                              for r, code in dead.items()})
        for c in self._conns:
            try:
                c.send((fn, args, kwargs))
            except (BrokenPipeError, ConnectionResetError):  # it died just now: `_collect` reports its exit
                pass
        replies = self._collect(getattr(fn, "__name__", repr(fn)), limit, deadline=deadline)
        if any(kind != "ok" for kind, _, _ in replies.values()):
            self._fail(what, replies)
        return [replies[r][1] for r in range(self.world_size)]

    def _collect(self, what: str, timeout: float, *,
                 deadline: float | None = None) -> dict[int, tuple[str, Any, float]]:
        """Every rank's reply and when it failed (time.time()): ("ok", value, t) or ("error", text, t)
        / ("died", text, t) / ("stuck", text, t). They are waited for until `deadline` (monotonic;
        default `timeout` from now), `timeout` being what a stuck rank's report names."""
        replies: dict[int, tuple[str, Any, float]] = {}
        deadline = time.monotonic() + timeout if deadline is None else deadline
        first_failure: float | None = None
        while len(replies) < self.world_size:
            now = time.monotonic()
            limit = deadline if first_failure is None else min(deadline, first_failure + self.grace)
            if now >= limit:
                break
            waiting = {}
            for r in range(self.world_size):
                if r not in replies:
                    waiting[self._conns[r]] = r
                    waiting[self._procs[r].sentinel] = r
            # in slices: the OS refuses one wait longer than about 24 days (math.inf: no deadline)
            for obj in mpc.wait(list(waiting), timeout=min(limit - now, _WAIT_SLICE)):
                r = waiting[obj]
                if r in replies:
                    continue
                conn = self._conns[r]
                when = time.time()
                if conn.poll():
                    try:
                        kind, value, *sent = conn.recv()
                        when = sent[0] if sent else when
                    except (EOFError, OSError):
                        kind, value = "died", None
                    except Exception:  # noqa: BLE001 - e.g. a result that cannot be unpickled here
                        kind, value = "error", "the result could not be unpickled:\n" + traceback.format_exc()
                    if kind == "ready":
                        kind = "ok"
                else:
                    kind, value = "died", None
                if kind == "died":
                    self._procs[r].join(1)
                    value = f"process exited with code {self._procs[r].exitcode} without reporting"
                replies[r] = (kind, value, when)
                if kind != "ok" and first_failure is None:
                    first_failure = time.monotonic()
        missing = [r for r in range(self.world_size) if r not in replies]
        if missing:
            stacks = self._stacks(missing)
            why = (f"no result within {self.grace:g} s after another rank failed" if first_failure is not None
                   else f"no result within the timeout of {timeout:g} s")
            for r in missing:
                replies[r] = ("stuck", f"{why} ({what}); its Python stacks:\n{stacks.get(r, '(unavailable)')}",
                              time.time())
        return replies

    def _stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        for r in ranks:
            try:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            except (OSError, ProcessLookupError):
                pass
        time.sleep(1.0)
        out = {}
        for r in ranks:
            try:
                with open(self._dump_path(r)) as fh:
                    out[r] = fh.read()[-6000:] or "(empty)"
            except OSError:
                out[r] = "(unavailable)"
        return out

    def _fail(self, what: str, replies: dict[int, tuple[str, Any, float]]) -> None:
        """Raise `DistributedTestError`: every failing rank's report in rank order, then, last and
        short, the error of the rank that failed first: the earliest to raise (by its own clock,
        taken as it caught the exception) or to die; a rank stopped for hanging counts as failed
        when it was stopped, after all of those."""
        self._kill()  # a failed rank may leave its peers and the process group in any state
        failures = {r: str(value) for r, (kind, value, _) in sorted(replies.items()) if kind != "ok"}
        first = min(failures, key=lambda r: (replies[r][2], r))
        first_error = short_error(failures[first])
        lines = [f"{len(failures)} of {self.world_size} ranks failed {what} (backend {self.backend}):"]
        for r, report in failures.items():
            lines.append(f"--- rank {r}:\n{report.rstrip()}")
        others = " (the other failures may follow from it)" if len(failures) > 1 else ""
        lines.append(f"=== rank {first} failed first{others}:\n{first_error}")
        raise DistributedTestError("\n".join(lines), failures, first, first_error)

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []
        self._store = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _dump_path(self, rank: int) -> str:
        assert self._tmp is not None
        return os.path.join(self._tmp.name, f"stacks-rank{rank}.txt")


def run_distributed(fn: Callable[..., Any], world_size: int, *, args: tuple = (), kwargs: dict | None = None,
                    backend: str = "gloo", timeout: float = 300.0, **options: Any) -> list[Any]:
    """Spawn `world_size` ranks, run ``fn(*args, **kwargs)`` on each, stop them; results in rank order.

    `options` go to `Workers` (``pg_timeout``, ``grace``, ``threads``, ``env``, ``eager_init``).

    >>> import torch.distributed as dist
    >>> run_distributed(dist.get_rank, 2)  # any function importable by name
    [0, 1]
    """
    with Workers(world_size, backend=backend, timeout=timeout, **options) as workers:
        return workers.run(fn, *args, **(kwargs or {}))


def distributed(world_size: int = 2, *, backend: str = "gloo", timeout: float = 300.0, **options: Any) -> Callable:
    """Decorator: calling the function runs its body on `world_size` fresh ranks (see the module
    docstring) and returns None (a test's return value); use `run_distributed` for results. The
    function must be defined at module level; pytest fixtures it asks for are passed to every rank
    (they must pickle). For NCCL, combine with a skip when `gpus_available` is False."""

    def deco(fn: Callable[..., Any]) -> Callable[..., None]:
        _check_by_name(fn, "@distributed")
        ref = _FunctionRef(fn.__module__, fn.__qualname__)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            run_distributed(ref, world_size, args=args, kwargs=kwargs, backend=backend, timeout=timeout, **options)

        wrapper.__zbpp_body__ = fn  # type: ignore[attr-defined]
        return wrapper

    return deco
