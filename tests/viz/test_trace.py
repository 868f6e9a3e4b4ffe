"""Perfetto traces of simulations and measurements; measured summaries; Costs.from_task_times.

References: hand-worked times (1F1B, p=2, m=2), message counts derived from the placement
(one stage per rank: 2(p-1) messages per microbatch; interleaved with c chunks: 2(cp-1)), and
the zero-bubble paper's ZB-H1 bubble (p-1)(F+B-W) on top of m(F+B+W) of work.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from zbpp.cli import main
from zbpp.schedules import Costs, Memory, available, build, simulate, validate
from zbpp.schedules.ir import Action
from zbpp.viz.trace import measured_result, measured_summary, read_trace, write_trace


def _records(res, *, scale: float = 1.0):
    """Synthetic task records: the simulated times, as a run recording its task times reports them."""
    sched = res.schedule
    return [
        {"rank": sched.rank_of(a.stage), "action": str(a), "start": res.start[a] * scale, "end": res.end[a] * scale}
        for a in res.start
    ]


def _load(path):
    with open(path) as fh:
        return json.load(fh)["traceEvents"]


def test_simulated_trace_hand_worked_1f1b(tmp_path):
    res = simulate(build("1f1b", num_ranks=2, num_microbatches=2), Costs(1, 1, 1))
    path = tmp_path / "t.json"
    write_trace(path, simulated=res)  # default: 1 cost unit = 1 ms = 1000 us
    ev = _load(path)
    tasks = {(e["pid"], e["name"]): (e["ts"], e["dur"]) for e in ev if e["ph"] == "X" and e["cat"] == "simulated"}
    assert tasks == {
        (0, "F0.0"): (0, 1000), (0, "F0.1"): (1000, 1000), (0, "BW0.0"): (4000, 2000), (0, "BW0.1"): (7000, 2000),
        (1, "F1.0"): (1000, 1000), (1, "BW1.0"): (2000, 2000), (1, "F1.1"): (4000, 1000), (1, "BW1.1"): (5000, 2000),
    }
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {(0, 0): "compute", (0, 1): "comm", (1, 0): "compute", (1, 1): "comm"}
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0: "simulated · rank 0", 1: "simulated · rank 1"}


@pytest.mark.parametrize("name,opts,per_mb", [
    ("zb-h1", {}, lambda p: 2 * (p - 1)),
    ("interleaved-1f1b", {"chunks": 2}, lambda p: 2 * (2 * p - 1)),
    ("zb-v", {}, lambda p: 2 * (2 * p - 2)),  # V: stages p-1 and p share the last rank
])
def test_simulated_trace_has_one_event_per_task_and_a_flow_per_message(tmp_path, name, opts, per_mb):
    if name not in available():
        pytest.skip(f"schedule {name!r} is not registered yet")
    p, m, comm = 4, 6, 0.25
    sched = build(name, num_ranks=p, num_microbatches=m, **opts)
    res = simulate(sched, Costs(1, 1, 1, comm=comm))
    path = tmp_path / "t.json"
    write_trace(path, simulated=res, comm=comm)
    ev = _load(path)
    per_pid = {}
    for e in ev:
        if e["ph"] == "X" and e["cat"] == "simulated":
            per_pid.setdefault(e["pid"], []).append(e["name"])
    assert {r: sorted(v) for r, v in per_pid.items()} == {r: sorted(map(str, sched.orders[r])) for r in range(p)}
    sends = [e for e in ev if e["ph"] == "X" and e["name"].startswith("send ")]
    recvs = [e for e in ev if e["ph"] == "X" and e["name"].startswith("recv ")]
    assert len(sends) == len(recvs) == per_mb(p) * m
    # on the comm tracks (tid 1, and 2, ... for messages in flight at once)
    assert all(e["tid"] >= 1 and e["dur"] == pytest.approx(comm * 1000) for e in sends + recvs)
    # flow arrows (trace format "flow v2"): each send slice starts one, its receive ends it
    outs = {e["bind_id"]: e for e in sends if e.get("flow_out")}
    ins = {e["bind_id"]: e for e in recvs if e.get("flow_in")}
    assert outs.keys() == ins.keys() and len(outs) == len(sends)
    for i, s in outs.items():
        f = ins[i]
        assert s["pid"] != f["pid"]  # a message crosses ranks
        assert s["args"] == f["args"]
    # each send starts where its producer ends; the consumer starts no earlier than arrival
    for e in sends:
        src, dst = (Action.parse(x) for x in (e["args"]["from"], e["args"]["to"]))
        assert e["ts"] == pytest.approx(res.end[src] * 1000)
        assert res.start[dst] >= res.end[src] + comm - 1e-12


def test_merged_trace_has_simulation_and_measurement_side_by_side(tmp_path):
    sched = build("zb-h1", num_ranks=4, num_microbatches=8)
    sim = simulate(sched, Costs(0.010, 0.010, 0.005))  # seconds
    measured = _records(simulate(sched, Costs(0.012, 0.011, 0.004)))
    path = tmp_path / "merged.json"
    write_trace(path, simulated=sim, measured=measured)
    ev = _load(path)
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {**{r: f"simulated · rank {r}" for r in range(4)}, **{4 + r: f"measured · rank {r}" for r in range(4)}}
    got = sorted((e["pid"] - 4, e["name"], round(e["ts"]), round(e["dur"])) for e in ev if e.get("cat") == "measured")
    want = sorted((r["rank"], r["action"], round(r["start"] * 1e6), round(r["end"] * 1e6 - r["start"] * 1e6)) for r in measured)
    assert got == want  # one event per task per rank, every rank in one file
    # measured flows (v1): one start and one end per message, each inside its task's slice
    slices = {(e["pid"], e["name"]): (e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "measured"}
    flows = [e for e in ev if e["ph"] in ("s", "f")]
    assert len(flows) == 2 * 2 * 3 * 8  # 2(p-1) messages per microbatch, two ends each
    for e in flows:
        assert any(lo < e["ts"] < hi for (pid, _), (lo, hi) in slices.items() if pid == e["pid"])
    sim_ev = [e for e in ev if e.get("cat") == "simulated"]
    assert len(sim_ev) == sched.num_tasks and max(e["ts"] + e["dur"] for e in sim_ev) == pytest.approx(sim.makespan * 1e6)
    records, stored = read_trace(path)
    assert stored.orders == sched.orders
    key = lambda r: (r["rank"], r["action"])  # noqa: E731
    for a, b in zip(sorted(records, key=key), sorted(measured, key=key)):
        assert key(a) == key(b)
        assert a["start"] == pytest.approx(b["start"], abs=1e-9) and a["end"] == pytest.approx(b["end"], abs=1e-9)


def test_read_trace_without_measurement_says_so(tmp_path):
    path = tmp_path / "simulated.json"
    write_trace(path, simulated=simulate(build("1f1b", num_ranks=2, num_microbatches=2)))
    with pytest.raises(ValueError, match="no measured tasks"):
        read_trace(path)
    with pytest.raises(ValueError, match="simulated=.*measured="):
        write_trace(path)


@pytest.mark.parametrize("p,m", [(2, 3), (4, 8), (8, 24)])
def test_measured_summary_bubble_matches_zb_h1_formula(p, m):
    f, b, w = 0.010, 0.012, 0.006  # seconds
    sched = build("zb-h1", num_ranks=p, num_microbatches=m)
    records = _records(simulate(sched, Costs(f, b, w)))
    s = measured_summary(records, sched)
    bubble = (p - 1) * (f + b - w)
    assert s["bubble_rate"] == pytest.approx(bubble / (m * (f + b + w) + bubble), rel=1e-9)
    assert s["mean_time"]["F"] == pytest.approx([f] * p)
    assert s["mean_time"]["B"] == pytest.approx([b] * p)
    assert s["mean_time"]["W"] == pytest.approx([w] * p)
    assert s["mean_time"]["BW"] == [None] * p
    assert s["num_tasks"] == 3 * p * m
    json.dumps(s)  # serialisable


def test_measured_busy_counts_overlapped_tasks_once():
    # an overlapped F&B pair (DualPipe): F1.0 and BW0.1 share [1, 2] on rank 0
    recs = [
        {"rank": 0, "action": "F0.0", "start": 0.0, "end": 1.0},
        {"rank": 0, "action": "F0.1", "start": 1.0, "end": 2.0},
        {"rank": 0, "action": "BW0.0", "start": 1.5, "end": 3.0},
        {"rank": 0, "action": "BW0.1", "start": 4.0, "end": 5.0},
    ]
    res = measured_result(recs)
    assert res.busy_per_rank == [4.0]  # [0, 3] and [4, 5]
    assert res.bubble_rate == pytest.approx(1 / 5)


def test_measured_memory_follows_measured_order():
    recs = [
        {"rank": 0, "action": "F0.0", "start": 0.0, "end": 1.0},
        {"rank": 0, "action": "F0.1", "start": 1.0, "end": 2.0},
        {"rank": 0, "action": "B0.0", "start": 2.0, "end": 3.0},
        {"rank": 0, "action": "B0.1", "start": 3.0, "end": 4.0},
        {"rank": 0, "action": "W0.0", "start": 4.0, "end": 5.0},
        {"rank": 0, "action": "W0.1", "start": 5.0, "end": 6.0},
    ]
    res = measured_result(recs, memory=Memory(activation=1, wgrad=0.5))
    assert res.peak_memory == [2.0]
    assert res.memory_after[Action.parse("B0.1")] == pytest.approx(1.0)  # two W's still pending


def test_measured_records_must_match_the_schedule():
    sched = build("1f1b", num_ranks=2, num_microbatches=1)
    good = _records(simulate(sched))
    with pytest.raises(ValueError, match="no measured record, e.g. BW1.0"):
        measured_result([r for r in good if r["action"] != "BW1.0"], sched)
    with pytest.raises(ValueError, match="ran on rank 0 but the schedule places it on rank 1"):
        measured_result([dict(r, rank=0) if r["action"] == "F1.0" else r for r in good], sched)
    with pytest.raises(ValueError, match="recorded twice"):
        measured_result(good + good[:1], sched)
    with pytest.raises(ValueError, match="F0.5 .*not a task"):
        measured_result(good + [{"rank": 0, "action": "F0.5", "start": 0, "end": 1}], sched)
    with pytest.raises(ValueError, match="need 'rank'"):
        measured_result([{"action": "F0.0", "start": 0, "end": 1}])


# -- Costs.from_task_times ------------------------------------------------------------------------
def test_from_task_times_recovers_per_stage_costs():
    f, b, w = (0.010, 0.011, 0.012, 0.013), (0.020, 0.018, 0.016, 0.014), (0.005, 0.006, 0.007, 0.008)
    sched = build("zb-h1", num_ranks=4, num_microbatches=8)
    truth = Costs(f, b, w, comm=0.001)
    records = _records(simulate(sched, truth))
    est = Costs.from_task_times(records, 4, comm=0.001)
    assert est.f == pytest.approx(f) and est.b == pytest.approx(b) and est.w == pytest.approx(w)
    assert simulate(sched, est).makespan == pytest.approx(simulate(sched, truth).makespan)
    if "zb-auto" in available():  # a schedule built from the measurement
        auto = build("zb-auto", num_ranks=4, num_microbatches=8, costs=est)
        assert simulate(auto, est).makespan <= simulate(sched, est).makespan * (1 + 1e-9)


def test_from_task_times_splits_full_backward_by_the_stated_rule():
    def rec(action, dur):
        return {"rank": 0, "action": action, "start": 0.0, "end": dur}

    # stage 0: own ratio (B:W = 2:1 measured), stage 1: only BW -> pooled ratio 2:1, 3 -> 2 + 1
    recs = [rec("F0.0", 1), rec("B0.0", 2), rec("W0.0", 1), rec("BW0.1", 6), rec("F1.0", 1), rec("BW1.0", 3)]
    c = Costs.from_task_times(recs, 2)
    assert c.b == pytest.approx((3.0, 2.0))  # stage 0: mean(2, 6*2/3)
    assert c.w == pytest.approx((1.5, 1.0))  # stage 0: mean(1, 6*1/3)
    # no split records anywhere: half and half
    c = Costs.from_task_times([rec("F0.0", 1), rec("BW0.0", 4)], 1)
    assert (c.b, c.w) == ((2.0,), (2.0,))


def test_from_task_times_errors_name_the_stage_or_record():
    with pytest.raises(ValueError, match="no F records for stage 1"):
        Costs.from_task_times([{"action": "F0.0", "start": 0, "end": 1}, {"action": "BW0.0", "start": 1, "end": 2}], 2)
    with pytest.raises(ValueError, match="stage 3 outside 0..1"):
        Costs.from_task_times([{"action": "F3.0", "start": 0, "end": 1}], 2)
    with pytest.raises(ValueError, match="ends before it starts"):
        Costs.from_task_times([{"action": "F0.0", "start": 2, "end": 1}], 1)


def test_cli_trace(tmp_path, capsys):
    out = tmp_path / "simulated.json"
    assert main(["trace", "zb-h1", "-p", "4", "-m", "8", "--comm", "0.5", "-o", str(out)]) == 0
    ev = _load(out)
    assert sum(e["ph"] == "X" and e["cat"] == "simulated" for e in ev) == 96
    assert sum(bool(e.get("flow_out")) for e in ev) == 2 * 3 * 8
    assert "wrote" in capsys.readouterr().out


def _partial_overlaps(events):
    """Slices of one track that overlap without nesting (Perfetto cannot draw them on one track)."""
    tracks: dict = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    bad = []
    for key, slices in tracks.items():
        open_: list = []
        for lo, hi, name in sorted(slices, key=lambda x: (x[0], -x[1])):
            while open_ and open_[-1][1] <= lo:
                open_.pop()
            if open_ and hi > open_[-1][1]:
                bad.append((key, open_[-1][2], name))
            open_.append((lo, hi, name))
    return bad


def test_messages_in_flight_at_once_get_a_comm_track_each(tmp_path):
    # Hand-worked GPipe, p=2, m=2, F=B=W=1, comm=2: F0.0 ends at 1 and F0.1 at 2, so rank 0 sends
    # [1, 3] and [2, 4] (ms) and rank 1 receives them then: two messages in flight at once per rank.
    res = simulate(build("gpipe", num_ranks=2, num_microbatches=2), Costs(1, 1, 1, comm=2))
    path = tmp_path / "t.json"
    write_trace(path, simulated=res, comm=2)
    ev = _load(path)
    sends = {e["name"]: (e["ts"], e["dur"], e["tid"]) for e in ev if e["name"].startswith("send F0")}
    assert {k: v[:2] for k, v in sends.items()} == {"send F0.0 -> F1.0": (1000, 2000), "send F0.1 -> F1.1": (2000, 2000)}
    assert sends["send F0.0 -> F1.0"][2] != sends["send F0.1 -> F1.1"][2]
    assert _partial_overlaps(ev) == []
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    for e in ev:
        if e.get("cat") == "comm":
            assert names[(e["pid"], e["tid"])].startswith("comm"), e


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "dualpipe-v"])
def test_no_track_holds_partly_overlapping_slices(tmp_path, name):
    if name not in available():
        pytest.skip(f"schedule {name!r} is not registered yet")
    sched = build(name, num_ranks=4, num_microbatches=8)
    for comm in (0.0, 0.5, 2.0, 5.0):
        res = simulate(sched, Costs(1, 1, 1, comm=comm))
        path = tmp_path / f"{comm}.json"
        write_trace(path, simulated=res, measured=_records(res), comm=comm, simulated_unit_s=1.0)
        assert _partial_overlaps(_load(path)) == [], comm


def test_overlapping_measured_tasks_get_a_compute_track_each(tmp_path):
    """Measured records of an overlapped F&B pair (DualPipe): on rank 0 F0.1 [1, 2] s and BW0.0
    [1.5, 3] s overlap without nesting, so Perfetto cannot draw them on one track. By hand: F0.0 and
    F0.1 and BW0.1 fit one track, BW0.0 needs a second; each flow end sits on its task's track."""
    recs = [
        {"rank": 0, "action": "F0.0", "start": 0.0, "end": 1.0},
        {"rank": 0, "action": "F0.1", "start": 1.0, "end": 2.0},
        {"rank": 0, "action": "BW0.0", "start": 1.5, "end": 3.0},
        {"rank": 0, "action": "BW0.1", "start": 4.0, "end": 5.0},
        {"rank": 1, "action": "F1.0", "start": 1.0, "end": 1.5},
        {"rank": 1, "action": "BW1.0", "start": 1.5, "end": 1.5},
        {"rank": 1, "action": "F1.1", "start": 2.0, "end": 2.5},
        {"rank": 1, "action": "BW1.1", "start": 2.5, "end": 4.0},
    ]
    path = tmp_path / "overlap.json"
    write_trace(path, measured=recs)
    ev = _load(path)
    assert _partial_overlaps(ev) == []
    tid = {e["name"]: (e["pid"], e["tid"]) for e in ev if e.get("cat") == "measured"}
    assert tid["F0.1"] != tid["BW0.0"] and tid["F0.0"] == tid["F0.1"] == tid["BW0.1"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[tid["F0.0"]] == "compute" and names[tid["BW0.0"]] == "compute 2"
    assert {names[tid[a]] for a in ("F1.0", "BW1.0", "F1.1", "BW1.1")} == {"compute"}
    slices = {(e["pid"], e["tid"], e["name"]): (e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "measured"}
    for e in (e for e in ev if e["ph"] in ("s", "f")):  # each flow end inside a slice of its own track
        assert any(lo <= e["ts"] <= hi for (pid, t, _), (lo, hi) in slices.items() if (pid, t) == (e["pid"], e["tid"])), e
    records, _ = read_trace(path)
    assert sorted(r["action"] for r in records) == sorted(r["action"] for r in recs)


def test_back_to_back_tasks_do_not_overlap_by_rounding(tmp_path):
    """1F1B, p=2, m=2, F=1.3, B=2, W=1 (BW=3), 1 unit = 1 ms, worked by hand: rank 1 runs F1.0
    [1300, 2600], BW1.0 [2600, 5600], F1.1 [5600, 6900], BW1.1 [6900, 9900] us, back to back. In
    floating point, F1.1's ts + dur came out above BW1.1's ts (by 1e-12 us): two slices partly
    overlapping on one track, which Perfetto cannot draw. On each track a slice must end no later
    than the next one starts, exactly; times match the hand-worked ones to half a step of the 1/1024 us
    grid they are written on."""
    res = simulate(build("1f1b", num_ranks=2, num_microbatches=2), Costs(1.3, 2, 1))
    path = tmp_path / "t.json"
    # the simulation in ms (1 unit = 1e-3 s), the same times "measured" in seconds
    write_trace(path, simulated=res, measured=_records(res, scale=1e-3), simulated_unit_s=1e-3)
    ev = _load(path)
    hand = {"F1.0": (1300, 2600), "BW1.0": (2600, 5600), "F1.1": (5600, 6900), "BW1.1": (6900, 9900)}
    for cat, pid in (("simulated", 1), ("measured", 3)):
        got = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == cat and e["pid"] == pid}
        assert got == {k: (pytest.approx(lo, abs=1 / 2048), pytest.approx(hi, abs=1 / 2048))
                       for k, (lo, hi) in hand.items()}, cat
    tracks: dict = {}
    for e in ev:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for key, slices in tracks.items():
        slices.sort()
        for (_, end, a), (start, _, b) in zip(slices, slices[1:]):
            assert end <= start, (key, a, b, end - start)


@pytest.mark.parametrize("kwargs, says", [
    ({"comm": -0.5}, "comm must be a finite number >= 0"),
    ({"comm": float("nan")}, "comm must be a finite number >= 0"),
    ({"simulated_unit_s": 0}, "simulated_unit_s must be a finite number > 0"),
    ({"simulated_unit_s": -1e-3}, "simulated_unit_s must be a finite number > 0"),
    ({"simulated_unit_s": float("inf")}, "simulated_unit_s must be a finite number > 0"),
])
def test_write_trace_refuses_a_bad_comm_or_unit(tmp_path, kwargs, says):
    """A negative comm used to write slices of negative duration, a unit of 0 every task at time 0
    (and inf NaN times), silently; each is refused, naming the argument, and nothing is written."""
    path = tmp_path / "t.json"
    with pytest.raises(ValueError, match=f"write_trace {says}"):
        write_trace(path, simulated=simulate(build("1f1b", num_ranks=2, num_microbatches=2)), **kwargs)
    assert not path.exists()


def test_tasks_at_one_instant_are_read_in_dependency_order():
    """Zero-length records at one instant (a coarse clock), written in reverse: the schedule read off
    them keeps each task after its inputs (worked by hand: F down the stages, B back up, then W),
    so it validates, and memory follows that order. Record order used to decide such ties."""
    # one rank holding stages 0 and 1, one microbatch, every task at t = 0
    order = ["F0.0", "F1.0", "B1.0", "B0.0", "W1.0", "W0.0"]
    recs = [{"rank": 0, "action": a, "start": 0.0, "end": 0.0} for a in reversed(order)]
    res = measured_result(recs, memory=Memory(activation=1, wgrad=0.5))
    assert [str(a) for a in res.schedule.orders[0]] == order
    validate(res.schedule)
    assert res.peak_memory == [2.0]  # both F's activations held before any B frees one
    # two ranks: rank 1's B1.0 and W1.0 at one instant, W recorded first
    recs = [{"rank": 0, "action": "F0.0", "start": 0.0, "end": 1.0},
            {"rank": 1, "action": "F1.0", "start": 1.0, "end": 2.0},
            {"rank": 1, "action": "W1.0", "start": 2.0, "end": 2.0},
            {"rank": 1, "action": "B1.0", "start": 2.0, "end": 2.0},
            {"rank": 0, "action": "B0.0", "start": 2.0, "end": 3.0},
            {"rank": 0, "action": "W0.0", "start": 3.0, "end": 4.0}]
    sched = measured_result(recs).schedule
    assert [str(a) for a in sched.orders[1]] == ["F1.0", "B1.0", "W1.0"]
    validate(sched)


@pytest.mark.parametrize("other", [("1f1b", 2, 4), ("zb-h1", 2, 2), ("1f1b", 3, 2)])
def test_write_trace_refuses_a_schedule_that_is_not_the_simulations(tmp_path, other):
    """simulated= holds times for its own schedule's tasks only: schedule= of another (more
    microbatches, other tasks, more ranks) used to end in a KeyError on the first task it lacks.
    It is refused, naming both, and nothing is written."""
    res = simulate(build("1f1b", num_ranks=2, num_microbatches=2))
    name, p, m = other
    path = tmp_path / "t.json"
    with pytest.raises(ValueError, match="write_trace: schedule= .* is not the schedule simulated= ran"):
        write_trace(path, simulated=res, schedule=build(name, num_ranks=p, num_microbatches=m))
    assert not path.exists()


def test_write_trace_takes_the_simulations_schedule_under_another_name(tmp_path):
    # the same placement, microbatches and orders drawn under another name: the very trace that
    # leaving schedule= out writes (the reference), but for the name stored with it
    res = simulate(build("1f1b", num_ranks=2, num_microbatches=2))
    renamed = dataclasses.replace(res.schedule, name="mine")
    write_trace(tmp_path / "a.json", simulated=res)
    write_trace(tmp_path / "b.json", simulated=res, schedule=renamed)
    assert _load(tmp_path / "a.json") == _load(tmp_path / "b.json")


def test_arguments_of_the_wrong_type_are_named(tmp_path):
    """schedule= given as a name or as text, or simulated= given the Schedule itself, failed as an
    AttributeError ('str' object has no attribute 'placement') that named no argument."""
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    res = simulate(sched, Costs(1, 1, 1))
    path = tmp_path / "t.json"
    for kwargs, key in ((dict(simulated=res, schedule="1f1b"), "schedule"),
                        (dict(simulated=res, schedule=sched.to_text()), "schedule"),
                        (dict(simulated=sched), "simulated"),
                        (dict(simulated=sched, measured=_records(res)), "simulated")):
        with pytest.raises(TypeError, match=rf"write_trace: {key}= must be a zbpp\.schedules\."):
            write_trace(path, **kwargs)
    assert not path.exists()  # nothing half-written
    write_trace(path, simulated=res, schedule=sched)  # the right types still pass
    assert path.exists()
