"""The communication plan: one message per cross-rank edge, and an order that cannot deadlock.

Deadlock-freedom is checked on a model of NCCL at its strictest: each rank has ONE communication
queue for all its peers (as with a shared communicator), operations leave a queue only in order,
and a send and its receive complete together, only when both are at the head of their queues; a
send can start only after the task that produces it has run, and a task only after its message has
arrived. The plan's order must finish under this model for every schedule; a naive order (each
rank receiving right before it needs a message) must not, which shows the model can fail.
"""

from __future__ import annotations

import pytest

from zbpp.schedules import available, build, options_of
from zbpp.schedules.dag import task_graph
from zbpp.schedules.ir import Action, Schedule
from zbpp.runtime.plan import CommOp, fifo_wgrad_problem, make_plan


def _build(name: str, p: int, m: int) -> Schedule:
    return build(name, num_ranks=p, num_microbatches=m, **({"chunks": 2} if "chunks" in options_of(name) else {}))


def _finishes(sched: Schedule, ops_of: list[list[CommOp]]) -> bool:
    """Run the strict NCCL model (see the module docstring); True when every task and op completes."""
    p = sched.num_ranks
    recv_of = {op.message.dst: op.message.index for r in range(p) for op in ops_of[r] if not op.send}
    done_tasks: set[Action] = set()
    done_msgs: set[int] = set()
    ti, oi = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):  # compute
            while ti[r] < len(sched.orders[r]):
                a = sched.orders[r][ti[r]]
                if a in recv_of and recv_of[a] not in done_msgs:
                    break
                done_tasks.add(a)
                ti[r] += 1
                progress = True
        for r in range(p):  # communication: rendezvous of the two queue heads
            if oi[r] >= len(ops_of[r]):
                continue
            op = ops_of[r][oi[r]]
            if not op.send:
                continue
            peer = op.peer
            if op.message.src not in done_tasks or oi[peer] >= len(ops_of[peer]):
                continue
            other = ops_of[peer][oi[peer]]
            if not other.send and other.message.index == op.message.index:
                oi[r] += 1
                oi[peer] += 1
                done_msgs.add(op.message.index)
                progress = True
    return all(ti[r] == len(sched.orders[r]) for r in range(p)) and all(oi[r] == len(ops_of[r]) for r in range(p))


CASES = [(name, p, m) for name in available() for p in (2, 3, 4) for m in (1, p, 2 * p + 1)]


@pytest.mark.parametrize("name,p,m", CASES)
def test_plan_is_complete_and_deadlock_free(name, p, m):
    sched = _build(name, p, m)
    plan = make_plan(sched)
    g = task_graph(sched, rank_chains=False)
    cross = {(u, v) for u, v, d in g.edges(data=True) if d["cross_rank"]}
    assert {(msg.src, msg.dst) for msg in plan.messages} == cross  # one message per cross-rank edge
    for msg in plan.messages:
        assert msg.src_rank != msg.dst_rank  # never a send to oneself (V schedules)
    for rp in plan.ranks:
        assert [op.message.index for op in rp.ops] == sorted(op.message.index for op in rp.ops)
    assert _finishes(sched, [list(rp.ops) for rp in plan.ranks]), f"{name} p={p} m={m} deadlocks"


def _naive_ops(sched: Schedule) -> list[list[CommOp]]:
    """Each rank: receive right before the task that needs it, send right after the task that makes it."""
    plan = make_plan(sched)
    out = []
    for rp in plan.ranks:
        ops = []
        for a in rp.tasks:
            if a in rp.recv_of:
                ops.append(CommOp(False, rp.recv_of[a]))
            if a in rp.send_of:
                ops.append(CommOp(True, rp.send_of[a]))
        out.append(ops)
    return out


def test_the_model_catches_a_naive_order():
    sched = _build("1f1b", 2, 2)
    assert not _finishes(sched, _naive_ops(sched))


def test_v_shape_hands_over_on_the_turning_rank():
    """ZB-V, p=2: stages 0,1,2,3 on ranks 0,1,1,0. Hand-worked: per microbatch the messages are
    F0->F1 (0->1), F2->F3 (1->0), B3->B2 (0->1) and B1->B0 (1->0); F1->F2 and B2->B1 stay on rank 1."""
    sched = _build("zb-v", 2, 3)
    assert sched.placement == (0, 1, 1, 0)
    plan = make_plan(sched)
    got = {(str(m.src)[:-2], str(m.dst)[:-2], m.src_rank, m.dst_rank) for m in plan.messages}
    assert got == {("F0", "F1", 0, 1), ("F2", "F3", 1, 0), ("B3", "B2", 0, 1), ("B1", "B0", 1, 0)}
    assert len(plan.messages) == 4 * 3


def test_fifo_wgrad_problem_names_the_task():
    sched = _build("zb-h1", 2, 2)
    assert all(fifo_wgrad_problem(sched, s) is None for s in range(2))
    r1 = [Action.parse(t) for t in "F1.0 B1.0 F1.1 B1.1 W1.1 W1.0".split()]
    swapped = Schedule(2, 2, 2, sched.placement, (sched.orders[0], tuple(r1)), name="swapped")
    msg = fifo_wgrad_problem(swapped, 1)
    assert msg is not None and "W1.1" in msg and "microbatch 0" in msg
