"""The microbatch key and the FP8 recipe are context state: each thread and each asyncio task
sees its own innermost block, and leaving a block restores what that block found, whatever other
threads or tasks entered or left meanwhile (a shared stack would hand one thread's key or recipe
to another, and pop the wrong entry when blocks end out of order)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from zbpp.modules import DelayedScaling, Linear, current_microbatch, fp8_autocast, microbatch
from zbpp.modules.fp8 import active_recipe

TIMEOUT = 30  # seconds: a wait that long means a step was never signalled


def _interleave(enter_a, enter_b, read):
    """Thread A enters its block, then thread B enters its own; A leaves first, then B.
    Returns what each saw at each step (read() inside and after the blocks)."""
    seen: dict[str, object] = {}
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def thread_a():
        with enter_a():
            a_in.set()
            assert b_in.wait(TIMEOUT)
            seen["a inside, b inside"] = read()
        seen["a after"] = read()
        a_out.set()

    def thread_b():
        assert a_in.wait(TIMEOUT)
        seen["b before"] = read()
        with enter_b():
            b_in.set()
            assert a_out.wait(TIMEOUT)
            seen["b inside, a gone"] = read()
        seen["b after"] = read()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    return seen


def test_microbatch_keys_of_two_threads_do_not_mix():
    seen = _interleave(lambda: microbatch("a"), lambda: microbatch("b"), current_microbatch)
    assert seen == {"b before": None, "a inside, b inside": "a", "a after": None,
                    "b inside, a gone": "b", "b after": None}
    assert current_microbatch() is None


def test_recipes_of_two_threads_do_not_mix():
    ra, rb = DelayedScaling(amax_history_len=2), DelayedScaling(amax_history_len=3)
    seen = _interleave(lambda: fp8_autocast(fp8_recipe=ra), lambda: fp8_autocast(fp8_recipe=rb),
                       active_recipe)
    assert seen == {"b before": None, "a inside, b inside": ra, "a after": None,
                    "b inside, a gone": rb, "b after": None}
    assert active_recipe() is None


def test_asyncio_tasks_see_their_own_key_and_recipe():
    async def task(key, length, log):
        with microbatch(key), fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=length)):
            for _ in range(3):
                await asyncio.sleep(0)  # let the other task run inside its own blocks
                log.append((key, current_microbatch(), active_recipe().amax_history_len))

    async def main():
        log: list = []
        await asyncio.gather(task("x", 5, log), task("y", 7, log))
        return log

    log = asyncio.run(main())
    assert sorted(log) == [("x", "x", 5)] * 3 + [("y", "y", 7)] * 3
    assert current_microbatch() is None and active_recipe() is None


def test_the_key_is_recorded_at_forward_time_not_read_in_backward():
    """A forward in a worker thread under microbatch(5); the backward, run from this thread
    outside any block, still files the wgrad under 5."""
    layer = Linear(4, 2, delay_wgrad_compute=True)
    out = {}

    def forward():
        with microbatch(5):
            out["y"] = layer(torch.ones(3, 4))

    worker = threading.Thread(target=forward)
    worker.start()
    worker.join(TIMEOUT)
    out["y"].sum().backward()
    assert layer.pending_wgrad_keys() == [5]


def test_an_unhashable_key_is_named_where_the_block_starts():
    """Keys file wgrad jobs in a dict: an unhashable one (a list) used to pass the block and the
    forward and fail inside the backward as a bare ``unhashable type: 'list'``. The block refuses
    it, naming it and what it takes; nothing was run."""
    with pytest.raises(TypeError, match=r"microbatch\(\[0, 1\]\): the key must be hashable"):
        with microbatch([0, 1]):
            pass
    assert current_microbatch() is None
    with microbatch((0, 1)):
        assert current_microbatch() == (0, 1)
