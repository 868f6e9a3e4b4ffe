"""A measured run end to end: 4 gloo ranks step with ``Pipeline(record_task_times=True)``, rank 0 gathers
every rank's task records, and `write_trace` puts the simulation (re-simulated from the measured costs)
and the measurement in ONE Perfetto trace. The reference is the schedule itself: every task of
every rank appears exactly once, on its rank's measured process.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="the runtime needs torch")
cases = pytest.importorskip("tests.runtime.cases", reason="the runtime test cases (issue 5) are not present")

from zbpp.schedules import Costs, available, build, simulate, validate  # noqa: E402
from zbpp.viz.trace import measured_summary, read_trace, write_trace  # noqa: E402

P = 4


def test_measured_trace_of_a_4_rank_gloo_run_holds_every_rank(zbpp_workers, tmp_path):
    _check_measured_trace(zbpp_workers(P), P, tmp_path)


@pytest.mark.nccl
def test_measured_trace_of_a_2_gpu_nccl_run_holds_every_rank(zbpp_workers, tmp_path):
    """The same on 2 GPUs (CUDA-event timings); the pool skips, saying why, without 2 GPUs."""
    _check_measured_trace(zbpp_workers(2, backend="nccl"), 2, tmp_path)


def _check_measured_trace(workers, p: int, tmp_path) -> None:
    records = workers.run(cases.check_task_times, "zb-h1", p)[0]  # rank 0 holds all ranks' records
    sched = cases.make_schedule("zb-h1", p, 2 * p)  # the schedule check_task_times ran
    costs = Costs.from_task_times(records, sched.num_stages)
    path = tmp_path / "run.json"
    write_trace(path, simulated=simulate(sched, costs), measured=records)

    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    measured = sorted((e["args"]["rank"], e["name"]) for e in events if e.get("cat") == "measured")
    assert measured == sorted((r, str(a)) for r, a in sched.actions())
    simulated = sorted((e["pid"], e["name"]) for e in events if e.get("cat") == "simulated")
    assert simulated == measured
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"{kind} · rank {r}" for kind in ("simulated", "measured") for r in range(p)}
    back, stored = read_trace(path)
    assert len(back) == sched.num_tasks and stored.orders == sched.orders

    summary = measured_summary(records, sched)
    assert 0.0 <= summary["bubble_rate"] < 1.0
    for kind in ("F", "B", "W"):
        assert all(t is not None and t > 0 for t in summary["mean_time"][kind]), kind
    if "zb-auto" in available():  # a schedule built from what was measured
        validate(build("zb-auto", num_ranks=p, num_microbatches=2 * p, costs=costs))
