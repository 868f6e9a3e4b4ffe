"""The communication plan of a schedule: which messages exist, and the one order they go in.

Pure Python (no torch). Every cross-rank data edge of the task DAG carries one *message*
(an activation from ``F(s, j)`` to ``F(s+1, j)``, or a gradient from ``B(s+1, j)`` to
``B(s, j)``); same-rank edges are handed over in memory (V schedules put stages 0 and 2p-1 on
rank 0: never a send to oneself).

NCCL has no tags: two ranks' operations on each other match in the order they are issued, and a
send may stall its stream until the peer posts the receive. So all messages get ONE global order,
and every rank issues its sends and receives in that order (its `RankPlan.ops`). The order is a
topological order of the schedule's DAG (data edges plus the rank chains): messages are sorted by
the simulated start of their producing task under unit costs (every task takes >= 1, so a
producer always starts strictly before anything that depends on it), ties broken by rank.

Why that cannot deadlock: a task's inputs come from producers that are earlier in the order, and
a rank's sends come after its own producing tasks, which run in its own order (a chain of the DAG).
Any wait (a receive waiting for its send, a task waiting for its receive, a send waiting for its
producer, an operation waiting for the one issued before it) points to something strictly earlier
in the one order, so nothing waits in a circle. This holds whether the backend gives each pair of
ranks its own queue (NCCL with per-pair communicators, gloo) or one queue per rank (NCCL with one
communicator for everything, as after eager initialisation).

>>> from zbpp.schedules import build
>>> plan = make_plan(build("1f1b", num_ranks=2, num_microbatches=2))
>>> [str(op) for op in plan.ranks[1].ops]
['recv F0.0->F1.0 from 0', 'recv F0.1->F1.1 from 0', 'send BW1.0->BW0.0 to 0', 'send BW1.1->BW0.1 to 0']
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..schedules.dag import data_dependencies, validate
from ..schedules.ir import Action, Kind, Schedule
from ..schedules.simulate import Costs, simulate

__all__ = ["Message", "CommOp", "RankPlan", "Plan", "make_plan", "fifo_wgrad_problem"]


@dataclass(frozen=True)
class Message:
    """One cross-rank data edge: `src`'s output is consumed by `dst` on another rank."""

    index: int  #: position in the global message order
    src: Action
    dst: Action
    src_rank: int
    dst_rank: int

    @property
    def is_gradient(self) -> bool:
        """True for a gradient going backward (B/BW -> B/BW), False for an activation (F -> F)."""
        return self.src.kind is not Kind.F

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}"


@dataclass(frozen=True)
class CommOp:
    """What one rank does for one message: send it (after `message.src`) or receive it."""

    send: bool
    message: Message

    @property
    def peer(self) -> int:
        m = self.message
        return m.dst_rank if self.send else m.src_rank

    def __str__(self) -> str:
        return f"send {self.message} to {self.peer}" if self.send else f"recv {self.message} from {self.peer}"


@dataclass(frozen=True)
class RankPlan:
    """What one rank runs in a step.

    Attributes:
        rank: the pipeline rank.
        tasks: its tasks, in schedule order.
        ops: its sends and receives, in the global message order (issue them in exactly this order).
        op_of: message index -> position in `ops`.
        recv_of: task -> the message it receives (tasks whose input comes from another rank).
        send_of: task -> the message it sends (tasks whose output goes to another rank).
        last_backward: stage -> its last B or BW in `tasks` (its ordinary weight grads are final after it).
        last_wgrad: stage -> its last W or BW in `tasks` (all its weight grads are final after it).
    """

    rank: int
    tasks: tuple[Action, ...]
    ops: tuple[CommOp, ...]
    op_of: dict[int, int] = field(repr=False)
    recv_of: dict[Action, Message] = field(repr=False)
    send_of: dict[Action, Message] = field(repr=False)
    last_backward: dict[int, Action] = field(repr=False)
    last_wgrad: dict[int, Action] = field(repr=False)


@dataclass(frozen=True)
class Plan:
    """The plan of every rank, and all messages in their global order."""

    schedule: Schedule
    messages: tuple[Message, ...]
    ranks: tuple[RankPlan, ...]


def make_plan(schedule: Schedule) -> Plan:
    """Validate `schedule` and derive its messages, their global order and each rank's plan.

    Raises `zbpp.schedules.ScheduleError` for an invalid or deadlocking schedule.
    """
    validate(schedule)
    sim = simulate(schedule, Costs(f=1, b=1, w=1, comm=0))
    present = {a for _, a in schedule.actions()}
    edges: list[tuple[Action, Action, int, int]] = []
    for dst_rank, dst in schedule.actions():
        for src in data_dependencies(dst, schedule.num_stages, present):
            src_rank = schedule.rank_of(src.stage)
            if src_rank != dst_rank:
                edges.append((src, dst, src_rank, dst_rank))
    # A topological order of the DAG with rank chains (see the module docstring). A producer has at
    # most one cross-rank consumer, so (start, rank) is a total order of the messages.
    edges.sort(key=lambda e: (sim.start[e[0]], e[2]))
    messages = tuple(Message(i, src, dst, sr, dr) for i, (src, dst, sr, dr) in enumerate(edges))

    ranks = []
    for r in range(schedule.num_ranks):
        ops = tuple(
            CommOp(send=m.src_rank == r, message=m) for m in messages if r in (m.src_rank, m.dst_rank)
        )
        last_b: dict[int, Action] = {}
        last_w: dict[int, Action] = {}
        for a in schedule.orders[r]:
            if a.kind in (Kind.B, Kind.BW):
                last_b[a.stage] = a
            if a.kind in (Kind.W, Kind.BW):
                last_w[a.stage] = a
        ranks.append(
            RankPlan(
                rank=r,
                tasks=schedule.orders[r],
                ops=ops,
                op_of={op.message.index: i for i, op in enumerate(ops)},
                recv_of={op.message.dst: op.message for op in ops if not op.send},
                send_of={op.message.src: op.message for op in ops if op.send},
                last_backward=last_b,
                last_wgrad=last_w,
            )
        )
    return Plan(schedule=schedule, messages=messages, ranks=tuple(ranks))


def fifo_wgrad_problem(schedule: Schedule, stage: int) -> str | None:
    """Why a FIFO wgrad store (Transformer Engine: ``backward_dw()`` takes the oldest) would compute
    the wrong microbatch's weight gradient on `stage` under `schedule`, or None when it is safe.

    Safe means: at each W (or the W half of a BW) of the stage, the oldest B not yet followed by its W
    is the same microbatch.

    >>> from zbpp.schedules import build
    >>> fifo_wgrad_problem(build("zb-h1", num_ranks=4, num_microbatches=8), 0) is None
    True
    """
    pending: list[int] = []
    for a in schedule.orders[schedule.rank_of(stage)]:
        if a.stage != stage:
            continue
        if a.kind in (Kind.B, Kind.BW):
            pending.append(a.microbatch)
        if a.kind in (Kind.W, Kind.BW):
            oldest = pending.pop(0) if pending else None
            if oldest != a.microbatch:
                return (
                    f"task {a} on rank {schedule.rank_of(stage)} computes the weight gradient of "
                    f"microbatch {a.microbatch}, but the oldest backward still waiting for its W is "
                    f"microbatch {oldest}: a FIFO wgrad store would use the wrong one"
                )
    return None
