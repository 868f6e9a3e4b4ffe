"""The simulator on a V placement with communication, against a timeline worked out by hand."""

from __future__ import annotations

import pytest

from zbpp.schedules import Costs, Memory, build, simulate


def test_zbv_p2_m2_with_comm_matches_the_hand_worked_timeline() -> None:
    """ZB-V, p=2, m=2, F=B=W=1, comm=0.5, Memory(activation=1, wgrad=0.5).

    Placement: rank 0 holds stages 0 and 3, rank 1 holds stages 1 and 2. The edges 0->1 and 2->3
    (forward) and 3->2 and 1->0 (backward) cross ranks and cost 0.5; 1->2 and 2->1 stay on rank 1
    and cost nothing. The orders (ZB-V's for 2p-1 = 3 microbatches cut down to 2):

        rank 0: F0.0 F0.1 F3.0 B3.0 W3.0 F3.1 B3.1 W3.1 B0.0 W0.0 B0.1 W0.1
        rank 1: F1.0 F2.0 F1.1 F2.1 B2.0 W2.0 B1.0 W1.0 B2.1 W2.1 B1.1 W1.1

    A task starts at max(its rank is free, its input arrived):

        F0.0 0              F0.1 1 (rank free)
        F1.0 1 + 0.5 = 1.5  F2.0 2.5 (F1.0 ends, same rank: no comm)
        F1.1 max(2 + 0.5, 3.5) = 3.5          F2.1 4.5
        F3.0 3.5 + 0.5 = 4 (rank 0 idle 2..4)  B3.0 5   W3.0 6
        F3.1 max(5.5 + 0.5, 7) = 7             B3.1 8   W3.1 9
        B2.0 6 + 0.5 = 6.5 (rank 1 idle 5.5..6.5)   W2.0 7.5
        B1.0 max(7.5, 8.5) = 8.5 (B2.0 ended 7.5, same rank)   W1.0 9.5
        B2.1 max(9 + 0.5, 10.5) = 10.5   W2.1 11.5   B1.1 12.5   W1.1 13.5
        B0.0 9.5 + 0.5 = 10   W0.0 11   B0.1 13.5 + 0.5 = 14 (rank 0 idle 12..14)   W0.1 15

    Spans: rank 0 0..16 = 16, rank 1 1.5..14.5 = 13; makespan 16; busy 12 on each rank, so the
    bubble rate is (16 - 12) / 16 = 0.25. Memory (F +1, B -0.5, W -0.5): rank 0 goes 1, 2, 3, 2.5,
    2, 3, ... (peak 3); rank 1 goes 1, 2, 3, 4, 3.5, ... (peak 4).
    """
    starts = {
        "F0.0": 0, "F0.1": 1, "F3.0": 4, "B3.0": 5, "W3.0": 6, "F3.1": 7, "B3.1": 8, "W3.1": 9,
        "B0.0": 10, "W0.0": 11, "B0.1": 14, "W0.1": 15,
        "F1.0": 1.5, "F2.0": 2.5, "F1.1": 3.5, "F2.1": 4.5, "B2.0": 6.5, "W2.0": 7.5, "B1.0": 8.5, "W1.0": 9.5,
        "B2.1": 10.5, "W2.1": 11.5, "B1.1": 12.5, "W1.1": 13.5,
    }
    sched = build("zb-v", num_ranks=2, num_microbatches=2)
    assert [[str(a) for a in o] for o in sched.orders] == [
        "F0.0 F0.1 F3.0 B3.0 W3.0 F3.1 B3.1 W3.1 B0.0 W0.0 B0.1 W0.1".split(),
        "F1.0 F2.0 F1.1 F2.1 B2.0 W2.0 B1.0 W1.0 B2.1 W2.1 B1.1 W1.1".split(),
    ]
    res = simulate(sched, Costs(f=1, b=1, w=1, comm=0.5), Memory(activation=1, wgrad=0.5))
    assert {str(a): t for a, t in res.start.items()} == pytest.approx(starts, abs=0)
    assert {str(a): t for a, t in res.end.items()} == pytest.approx({a: t + 1 for a, t in starts.items()}, abs=0)
    assert res.spans == [16, 13] and res.makespan == 16 and res.busy_per_rank == [12, 12]
    assert res.bubble_rate == 0.25
    assert res.peak_memory == [3, 4]


def test_zbv_p2_m2_with_a_message_in_flight_while_the_rank_frees_up() -> None:
    """The same schedule with comm=1: now B0.0's gradient is still in flight when rank 0 becomes free.

        F0.0 0   F0.1 1   F1.0 1 + 1 = 2   F2.0 3   F1.1 max(2 + 1, 4) = 4   F2.1 5
        F3.0 4 + 1 = 5   B3.0 6   W3.0 7   F3.1 max(6 + 1, 8) = 8   B3.1 9   W3.1 10
        B2.0 7 + 1 = 8   W2.0 9   B1.0 10   W1.0 11   B2.1 max(10 + 1, 12) = 12   W2.1 13   B1.1 14   W1.1 15
        B0.0 11 + 1 = 12 (rank 0 free at 11, the gradient sent at 11 arrives at 12)   W0.0 13
        B0.1 15 + 1 = 16   W0.1 17

    Spans 18 (rank 0, 0..18) and 14 (rank 1, 2..16); busy 12 each; bubble (18 - 12) / 18 = 1/3.
    """
    starts = {
        "F0.0": 0, "F0.1": 1, "F3.0": 5, "B3.0": 6, "W3.0": 7, "F3.1": 8, "B3.1": 9, "W3.1": 10,
        "B0.0": 12, "W0.0": 13, "B0.1": 16, "W0.1": 17,
        "F1.0": 2, "F2.0": 3, "F1.1": 4, "F2.1": 5, "B2.0": 8, "W2.0": 9, "B1.0": 10, "W1.0": 11,
        "B2.1": 12, "W2.1": 13, "B1.1": 14, "W1.1": 15,
    }
    res = simulate(build("zb-v", num_ranks=2, num_microbatches=2), Costs(f=1, b=1, w=1, comm=1))
    assert {str(a): t for a, t in res.start.items()} == starts
    assert res.spans == [18, 14] and res.makespan == 18 and res.bubble_rate == pytest.approx(1 / 3, abs=1e-15)
