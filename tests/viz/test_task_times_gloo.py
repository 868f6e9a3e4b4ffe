"""`Pipeline(record_task_times=True)` on 2 gloo ranks, checked against the schedule itself.

On the CPU a task's start is taken after its inputs arrived, so on one timeline every consumer of a
message (``make_program(schedule).messages``) starts no earlier than its producer ended. A rank that
reaches its first task late (here: 0.3 s slept before it, as an FSDP all-gather or a busy device
stream would) must not move its tasks back onto its peers' timeline.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch", reason="the runtime needs torch")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from zbpp import Pipeline  # noqa: E402
from zbpp.schedules import build  # noqa: E402
from zbpp.schedules.program import make_program  # noqa: E402

P, M, DELAY, TASK = 2, 4, 0.3, 0.01


class _Stage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(TASK)  # tasks long enough that the gloo latency is noise
        return self.lin(x)


def _loss(out, y):
    return (out - y).square().mean()


def late_rank_records(name: str, late: int) -> list | None:
    rank = dist.get_rank()
    sched = build(name, num_ranks=P, num_microbatches=M)
    torch.manual_seed(0)
    pipe = Pipeline({s: _Stage() for s in sched.stages_on(rank)}, sched, _loss, record_task_times=True)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe.step(x, target=y)
    if rank == late:  # this rank reaches its first task DELAY after the start agreement
        begin = pipe._reductions.begin

        def slow(*args, **kwargs):
            time.sleep(DELAY)
            return begin(*args, **kwargs)

        pipe._reductions.begin = slow
    pipe.step(x, target=y)
    return pipe.task_times()


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
@pytest.mark.parametrize("late", [0, 1])
def test_a_late_rank_keeps_every_message_after_its_producer(zbpp_workers, name, late):
    records = zbpp_workers(P).run(late_rank_records, name, late)[0]
    sched = build(name, num_ranks=P, num_microbatches=M)
    at = {r["action"]: r for r in records}
    assert sorted(at) == sorted(str(a) for _, a in sched.actions())
    assert all(r["start"] >= 0 for r in records)
    for msg in make_program(sched).messages:
        src, dst = at[str(msg.src)], at[str(msg.dst)]
        assert dst["start"] >= src["end"] - 0.005, (f"{msg.dst} (rank {dst['rank']}) starts at {dst['start']:.4f} s, "
                                                    f"before its input {msg.src} (rank {src['rank']}) ended at {src['end']:.4f} s")
    # the late rank's first task starts DELAY after time 0
    first = min(r["start"] for r in records if r["rank"] == late)
    assert first >= DELAY - 0.005


class _Failing(_Stage):
    fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("injected failure")
        return super().forward(x)


def records_around_a_failed_step(name: str) -> tuple | None:
    """A good step, then a step that fails on rank 1's first forward: task_times() after each."""
    from zbpp.runtime import PipelineError

    rank = dist.get_rank()
    sched = build(name, num_ranks=P, num_microbatches=M)
    torch.manual_seed(0)
    stages = {s: _Failing() for s in sched.stages_on(rank)}
    pipe = Pipeline(stages, sched, _loss, record_task_times=True)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    before = pipe.task_times()
    pipe.step(x, target=y)
    good = pipe.task_times()
    for st in stages.values():
        st.fail = rank == 1
    try:
        pipe.step(x, target=y)
    except PipelineError:
        pass
    else:
        raise AssertionError(f"rank {rank}: the failing step returned")
    after = pipe.task_times()  # collective: every rank calls it
    return None if rank else (before, good, after)


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_a_failed_step_leaves_the_last_good_steps_records(zbpp_workers, name):
    before, good, after = zbpp_workers(P).run(records_around_a_failed_step, name)[0]
    sched = build(name, num_ranks=P, num_microbatches=M)
    assert before == []
    assert sorted(r["action"] for r in good) == sorted(str(a) for _, a in sched.actions())
    assert after == good  # not the failed step's partial records
