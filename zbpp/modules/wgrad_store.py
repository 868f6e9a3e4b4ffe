"""The wgrad store: deferred weight-gradient jobs, filed under microbatch keys.

A delayed-wgrad module's backward (B) computes only the input gradient and files a *job* (a
closure over the saved inputs and the output gradient) under the key of the forward it belongs to;
``backward_dw(key)`` later takes the jobs of one key out and runs them (W). Several jobs may share
a key: a module called twice in one forward (a tied or reused weight) files one job per call.

The store is a keyed FIFO: keys come out in the order they were first filed unless a key is asked
for. It is thread-safe because on GPUs autograd runs the backward (which files) on its own thread
while the caller (who takes out) runs on the main one.

>>> store = WgradStore(owner="demo")
>>> store.put(1, "job-a"); store.put(0, "job-b"); store.put(1, "job-c")
>>> store.keys()
[1, 0]
>>> store.pop()
(1, ['job-a', 'job-c'])
>>> store.pop(0)
(0, ['job-b'])
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, Hashable, TypeVar

__all__ = ["AutoKey", "WgradStore", "WgradStoreError"]

Job = TypeVar("Job")


@dataclass(frozen=True)
class AutoKey:
    """The key of a forward that ran outside any ``microbatch()`` block (the n-th such forward).

    It can never equal a user's key, so plain FIFO use (``backward_dw()`` with no key) and keyed use
    do not mix up their jobs.
    """

    n: int

    def __repr__(self) -> str:
        return f"auto#{self.n}"


class WgradStoreError(RuntimeError):
    """``backward_dw`` was asked for a wgrad that is not pending."""


class WgradStore(Generic[Job]):
    """Pending wgrad jobs of one module, grouped by microbatch key, in filing order."""

    def __init__(self, *, owner: str = "module") -> None:
        self._owner = owner  # named in error messages
        self._jobs: OrderedDict[Hashable, list[Job]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, key: Hashable, job: Job) -> None:
        """File `job` under `key` (after the jobs already filed under it)."""
        with self._lock:
            self._jobs.setdefault(key, []).append(job)

    def pop(self, key: Hashable | None = None) -> tuple[Hashable, list[Job]]:
        """Take out all jobs of `key` (of the oldest key when None), in filing order."""
        with self._lock:
            if not self._jobs:
                what = "" if key is None else f" for microbatch key {key!r}"
                raise WgradStoreError(
                    f"{self._owner}.backward_dw(): nothing pending{what}: every wgrad filed since the "
                    "last backward_dw() has already been computed, and a forward files one only when "
                    "its backward (B) reaches this module (not yet run, or the output unused). "
                    "Without keys each forward call files its own (call backward_dw() once per call "
                    "of the module, after its backward); calls inside one "
                    "zbpp.modules.microbatch(key) block share one"
                )
            if key is None:
                key = next(iter(self._jobs))
            elif key not in self._jobs:
                raise WgradStoreError(
                    f"{self._owner}.backward_dw({key!r}): no wgrad pending for microbatch key "
                    f"{key!r}; pending keys: {list(self._jobs)!r}"
                )
            return key, self._jobs.pop(key)

    def take(self, key: Hashable | None = None) -> list[Job] | None:
        """`pop`'s jobs, or None (nothing taken) where `pop` would raise."""
        with self._lock:
            jobs = self._jobs
            if key is None:
                return jobs.popitem(last=False)[1] if jobs else None
            return jobs.pop(key, None)

    def keys(self) -> list[Hashable]:
        """Pending keys, oldest first."""
        with self._lock:
            return list(self._jobs)

    def clear(self) -> None:
        """Drop every pending job (and the tensors it holds)."""
        with self._lock:
            self._jobs.clear()

    def set_aside(self) -> OrderedDict[Hashable, list[Job]]:
        """Take every pending job out, keys in order, leaving the store empty (`put_back` restores
        them): work in between, a measurement say, neither runs nor drops them."""
        with self._lock:
            jobs, self._jobs = self._jobs, OrderedDict()
            return jobs

    def put_back(self, jobs: OrderedDict[Hashable, list[Job]]) -> None:
        """Make `jobs` (from `set_aside`) the pending ones again, exactly; what was filed since is dropped."""
        with self._lock:
            self._jobs = jobs

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    # A module holding a store must survive copy.deepcopy and torch.save: a lock cannot be copied,
    # and pending jobs (closures over one autograd graph) mean nothing in a copy.
    def __getstate__(self) -> dict:
        return {"_owner": self._owner}

    def __setstate__(self, state: dict) -> None:
        self.__init__(owner=state["_owner"])
