"""The program of a schedule: each rank's tasks in order, which messages exist, the channel each
takes, and the task boundary at which each rank issues each send and receive.

Pure Python (no torch): the runtime executes a program, the trace viewer draws its messages, the tests
check it against a model of NCCL.

Messages. Every cross-rank data edge of the task DAG carries one message: an activation from
``F(s, j)`` to ``F(s+1, j)``, or a gradient from the backward of stage s+1 to that of stage s.
Same-rank edges are handed over in memory (V schedules put stages 0 and 2p-1 on rank 0: never a
send to oneself).

Channels. A message from rank a to rank b travels on channel ``(a, b)``: one per ordered pair of
ranks that exchange messages, so traffic in one direction never queues behind traffic in the other
(the runtime gives each channel its own communicator, hence its own NCCL stream). NCCL has no
tags: on a channel, sends and receives match in the order they are issued, so both ends issue a
channel's messages in one order, the order in which the receiving rank consumes them.

Issue points. A rank runs its tasks in schedule order and issues ``issue[i]`` just before task i
(``issue[len(tasks)]`` after the last). On a GPU a posted receive or send launches an NCCL kernel
that occupies streaming multiprocessors, spinning, until its peer arrives, and slows the GEMMs
beside it; so operations are issued shortly before they are needed rather than as early as
possible, and the two ends of a message are issued at about the same time:

- a receive at the last task boundary that the simulated timeline (from `costs`) reaches early
  enough for the transfer to arrive before its consumer starts (right before the consumer when the
  rank waits for it anyway, one task earlier when the rank is busy up to the consumer, earlier
  still when the costs' `comm`, the time a message takes on the link, is longer), but not at a
  boundary reached before the data is produced, where it would only spin: when the producer finishes just as the consumer could start (1F1B's steady
  state), the receive is posted right before the consumer. On a slow link that costs a transfer:
  NCCL starts moving a message only once both ends are posted, so a receive posted at the first
  boundary after the data exists delivers it a whole transfer later. Where that would make the
  message late by more than `LATE_TOLERANCE` of its consumer and by more than the spin would cost
  (`SPIN_SLOWDOWN` of the time the rank computes while it spins: idle, it slows nothing), the
  receive is posted at the last boundary before the data exists;
- a send after its producing task, at the last task boundary that the simulated timeline (from
  `costs`) places no later than its receive; and never before an earlier send of its channel.

Why it cannot deadlock. Give each boundary the simulated time at which the rank reaches it (the
end of the task before it) and read every wait as pointing from a later to an earlier time: a task
waits for its received messages, whose sends are issued at boundaries no later than the receive's
or, for a receive posted before its data exists, right after the producer, which ends before the
consuming task starts (and no receive is issued after that start); a send waits for its producing
task, which ends before the boundary; an operation on a channel waits for the earlier ones, whose ends are issued
no later. All simulated costs are positive, so every chain of waits descends strictly in time
and ends. This holds for NCCL (per-channel queues) and gloo alike; `tests/schedules/test_program.py`
replays every built-in schedule on a model of NCCL's strictest matching.

>>> from zbpp.schedules import build
>>> program = make_program(build("1f1b", num_ranks=2, num_microbatches=2))
>>> [str(a) for a in program.ranks[1].tasks]
['F1.0', 'BW1.0', 'F1.1', 'BW1.1']
>>> [[str(op) for op in ops] for ops in program.ranks[1].issue]  # before each task, then after the last
[['recv F0.0->F1.0 from 0'], ['recv F0.1->F1.1 from 0'], ['send BW1.0->BW0.0 to 0'], [], ['send BW1.1->BW0.1 to 0']]
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from .dag import validate
from .ir import Action, Kind, Schedule
from .simulate import Costs, check_costs_memory, simulate
from .replay import replay
from .tasks import TaskIds, input_of

__all__ = ["Message", "CommOp", "RankProgram", "Program", "make_program", "program_makespan", "fifo_wgrad_problem", "DEFAULT_COSTS"]

Channel = tuple[int, int]  # (sending rank, receiving rank)

#: The program's times when none are given: unit tasks and a fast link (a message takes a hundredth of
#: a task), so a receive is posted one task ahead when its rank is busy up to the consumer and just
#: before it when the rank waits anyway. ``Costs(comm=0)`` posts every receive just before its consumer.
DEFAULT_COSTS = Costs(f=1.0, b=1.0, w=1.0, comm=0.01)

#: How much slower a GEMM runs beside a spinning NCCL kernel (docs/benchmarks.md, "Constants"):
#: posting a receive before its data exists costs the rank about this share of the time it computes
#: while the receive spins (none while it waits idle).
SPIN_SLOWDOWN = 0.27
#: A receive is posted before its data exists only when waiting for the next boundary would make
#: the message later than this share of its consumer's time: never on a fast link (where a message
#: takes a small share of a task), so programs for fast links do not depend on `SPIN_SLOWDOWN`.
LATE_TOLERANCE = 0.05


@dataclass(frozen=True)
class Message:
    """One cross-rank data edge: `src`'s output is consumed by `dst` on another rank."""

    index: int  #: position in `Program.messages`
    src: Action
    dst: Action
    src_rank: int
    dst_rank: int

    @property
    def channel(self) -> Channel:
        return (self.src_rank, self.dst_rank)

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
class RankProgram:
    """What one rank runs in a step.

    Attributes:
        rank: the pipeline rank.
        tasks: its tasks, in schedule order.
        issue: ``len(tasks) + 1`` tuples: the operations to issue before task i (the last entry:
            after the last task), each channel's in its order.
        recv_of: task -> the message it receives (tasks whose input comes from another rank).
        send_of: task -> the message it sends (tasks whose output goes to another rank).
        last_backward: stage -> its last B or BW in `tasks` (its ordinary weight grads are final after it).
        last_wgrad: stage -> its last W or BW in `tasks` (all its weight grads are final after it).
        handed_from: task -> the task of another stage *on this rank* whose output it consumes
            (an activation or a gradient handed over in memory, `zbpp.schedules.tasks`' rule).
    """

    rank: int
    tasks: tuple[Action, ...]
    issue: tuple[tuple[CommOp, ...], ...]
    recv_of: Mapping[Action, Message] = field(repr=False)
    send_of: Mapping[Action, Message] = field(repr=False)
    last_backward: Mapping[int, Action] = field(repr=False)
    last_wgrad: Mapping[int, Action] = field(repr=False)
    handed_from: Mapping[Action, Action] = field(repr=False, default_factory=dict)

    @property
    def ops(self) -> tuple[CommOp, ...]:
        """All operations of the rank in the order it issues them."""
        return tuple(op for ops in self.issue for op in ops)


@dataclass(frozen=True)
class Program:
    """The program of every rank.

    Attributes:
        schedule: the schedule it was made for.
        messages: every message, ordered by channel and, within a channel, in the channel's order.
        channels: the ordered rank pairs that carry messages, sorted.
        ranks: one `RankProgram` per rank.
        forward_only: a program of the F tasks alone (evaluation), without B, W or gradients.
    """

    schedule: Schedule
    messages: tuple[Message, ...]
    channels: tuple[Channel, ...]
    ranks: tuple[RankProgram, ...]
    forward_only: bool = False


def make_program(
    schedule: Schedule,
    *,
    costs: Costs | None = None,
    forward_only: bool = False,
) -> Program:
    """Validate `schedule` and derive its messages, channels and each rank's issue points.

    Args:
        schedule: any valid schedule.
        costs: the times that place sends and receives (default `DEFAULT_COSTS`); pass measured
            costs (`Costs.from_task_times`, with `comm`) when they differ much, or when the link is
            slow, so that receives are posted early enough to arrive in time.
        forward_only: the F tasks alone (evaluation: no backward, no gradients).

    Raises `zbpp.schedules.ScheduleError` for an invalid or deadlocking schedule.
    """
    check_costs_memory("make_program", costs, None)
    validate(schedule)
    costs = _positive((costs or DEFAULT_COSTS).charged(schedule.placement))
    if forward_only:
        orders = [tuple(a for a in order if a.kind is Kind.F) for order in schedule.orders]
        start, end = _forward_timeline(schedule, orders, costs)
    else:
        orders = list(schedule.orders)
        sim = simulate(schedule, costs)
        start, end = sim.start, sim.end
    position = {a: i for order in orders for i, a in enumerate(order)}
    present = {a for order in orders for a in order}

    transfer = costs.comm  # a receive is posted this long (in simulated time) before its consumer starts

    def reached(rank: int, boundary: int) -> float:
        """Simulated time at which `rank` reaches the boundary before task `boundary`."""
        return end[orders[rank][boundary - 1]] if boundary > 0 else 0.0

    # Every cross-rank data edge, with the boundary at which its receive is issued.
    edges = []
    handed: list[dict[Action, Action]] = [{} for _ in orders]
    for dst_rank, order in enumerate(orders):
        for k, dst in enumerate(order):
            src = input_of(dst, schedule.num_stages, None if forward_only else present)
            if src is None or src not in present or src.stage == dst.stage:
                continue  # no input from another stage
            if schedule.rank_of(src.stage) == dst_rank:
                handed[dst_rank][dst] = src  # handed over in memory
                continue
            need = start[dst] - transfer  # the receive must be posted by then
            at = k
            while at > 0 and reached(dst_rank, at) > need:
                at -= 1
            # ... but not before the data exists, where it would only spin; unless waiting for the
            # next boundary delays the message (on a slow link the transfer starts only once both
            # ends are posted) by more than the spin would cost the tasks beside it
            while at < k and reached(dst_rank, at) < end[src]:
                late = max(reached(dst_rank, at + 1), end[src]) + transfer - start[dst]
                spin = _computing(order[at:k], start, end, reached(dst_rank, at), end[src])
                if late > LATE_TOLERANCE * (end[dst] - start[dst]) and late > SPIN_SLOWDOWN * spin:
                    break
                at += 1
            edges.append((src, dst, schedule.rank_of(src.stage), dst_rank, at))
    # One order per channel, the consumer's; messages indexed channel by channel.
    edges.sort(key=lambda e: (e[2], e[3], position[e[1]]))
    messages = tuple(Message(i, src, dst, sr, dr) for i, (src, dst, sr, dr, _) in enumerate(edges))
    recv_at: dict[int, int] = {}
    latest: dict[Channel, int] = {}
    for msg, e in zip(messages, edges):  # a channel's receives are issued in its order
        recv_at[msg.index] = latest[msg.channel] = max(e[4], latest.get(msg.channel, 0))

    # Sends: the last boundary after the producer reached no later than the receive's, never
    # before the channel's previous send.
    send_at: dict[int, int] = {}
    previous: dict[Channel, int] = {}
    for msg in messages:
        a = msg.src_rank
        earliest = position[msg.src] + 1
        deadline = reached(msg.dst_rank, recv_at[msg.index])
        at = earliest
        while at < len(orders[a]) and reached(a, at + 1) <= deadline:
            at += 1
        at = max(at, previous.get(msg.channel, 0))
        previous[msg.channel] = at
        send_at[msg.index] = at

    ranks = []
    for r, order in enumerate(orders):
        issue: list[list[CommOp]] = [[] for _ in range(len(order) + 1)]
        for msg in messages:  # channel order within each channel
            if msg.src_rank == r:
                issue[send_at[msg.index]].append(CommOp(True, msg))
            if msg.dst_rank == r:
                issue[recv_at[msg.index]].append(CommOp(False, msg))
        for ops in issue:  # sends first at a boundary: the data is ready, the peer may be waiting
            ops.sort(key=lambda op: not op.send)
        last_b: dict[int, Action] = {}
        last_w: dict[int, Action] = {}
        for a in order:
            if a.kind in (Kind.B, Kind.BW):
                last_b[a.stage] = a
            if a.kind in (Kind.W, Kind.BW):
                last_w[a.stage] = a
        ranks.append(
            RankProgram(
                rank=r,
                tasks=tuple(order),
                issue=tuple(tuple(ops) for ops in issue),
                recv_of={m.dst: m for m in messages if m.dst_rank == r},
                send_of={m.src: m for m in messages if m.src_rank == r},
                last_backward=last_b,
                last_wgrad=last_w,
                handed_from=handed[r],
            )
        )
    channels = tuple(sorted({m.channel for m in messages}))
    return Program(schedule, messages, channels, tuple(ranks), forward_only)


def program_makespan(program: Program, costs: Costs) -> float:
    """The step that `program` takes under `costs` when messages move as NCCL moves them.

    `simulate` lets a message leave when its producer ends. Here it leaves only once its send and
    its receive have both been issued (at their boundaries: a rank reaches boundary i when its
    task i-1 ends) and the channel's previous message has arrived (a channel is one NCCL stream),
    then takes ``costs.comm``; a task starts when its rank is free and its input is there. With
    receives posted late for the link (a program made for a faster one), this is what the runtime
    loses that `simulate` does not see (docs/benchmarks.md, "A slow link"). It is never below
    `simulate`'s makespan, as no message leaves earlier than there. A program made for these
    costs often matches it (the ZB-H1 case below), but not always: a channel moves one message
    at a time where `simulate` lets messages overlap, so where a rank sends to another more often
    than every `comm` (GPipe's warm-up on a slow link) they queue; and a receive may be posted up
    to `LATE_TOLERANCE` of its consumer late.

    >>> from zbpp.schedules import build, simulate
    >>> sched = build("zb-h1", num_ranks=2, num_microbatches=4)
    >>> slow = Costs(1, 1, 1, comm=0.6)
    >>> program_makespan(make_program(sched, costs=slow), slow) == simulate(sched, slow).makespan
    True
    >>> program_makespan(make_program(sched), slow) > simulate(sched, slow).makespan  # planned for a fast link
    True
    >>> gpipe, slower = build("gpipe", num_ranks=3, num_microbatches=5), Costs(1, 1, 1, comm=5)
    >>> program_makespan(make_program(gpipe, costs=slower), slower), simulate(gpipe, slower).makespan  # queued
    (69.0, 41.0)
    """
    schedule = program.schedule
    costs = costs.charged(schedule.placement)
    f, b, w = costs.per_stage(schedule.num_stages)
    ids = TaskIds(schedule.num_stages, schedule.num_microbatches)
    orders = [[ids.of(a) for a in rp.tasks] for rp in program.ranks]
    present = bytearray(ids.size)
    for order in orders:
        for t in order:
            present[t] = 1
    # tables for `replay`: a task on its own rank waits for its input there (handed over in memory)
    inputs = ids.inputs(present)
    durations = ids.per_task([f, b, w, [x + y for x, y in zip(b, w)]])
    lags = [0.0] * ids.size

    def reached(rank: int, boundary: int) -> int:
        """The task whose end is the boundary (-1: the start of the step)."""
        return ids.of(program.ranks[rank].tasks[boundary - 1]) if boundary else -1

    issued_at: dict[tuple[int, bool], tuple[int, int]] = {}  # (message, send?) -> (rank, boundary)
    for rp in program.ranks:
        for i, ops in enumerate(rp.issue):
            for op in ops:
                issued_at[(op.message.index, op.send)] = (rp.rank, i)
    # A message is three tasks in a row of its channel (one NCCL stream, so after the channel's
    # previous message): waiting for its producer, then for its send and its receive to be issued;
    # the last takes `comm`, and the consumer waits for it.
    channels: dict[tuple[int, int], list[int]] = {}
    for msg in program.messages:
        first = len(inputs)
        inputs += [ids.of(msg.src), reached(*issued_at[(msg.index, True)]), reached(*issued_at[(msg.index, False)])]
        durations += [0.0, 0.0, costs.comm]
        lags += [0.0, 0.0, 0.0]
        channels.setdefault(msg.channel, []).extend(range(first, first + 3))
        inputs[ids.of(msg.dst)] = first + 2
    end = [-1.0] * len(inputs)
    if not replay(orders + list(channels.values()), inputs, durations, lags, [0.0] * len(inputs), end):
        # make_program's programs always finish; a hand-edited one may not
        raise ValueError("program_makespan: the program stalls (a task waits for a message that is never sent)")
    return max((end[t] for order in orders for t in order), default=0.0)


def _computing(tasks: Sequence[Action], start: Mapping[Action, float], end: Mapping[Action, float], t0: float,
               t1: float) -> float:
    """How long `tasks` compute within [t0, t1]: the time a receive spinning then slows (a GEMM
    beside a spinning kernel); while the rank waits idle the spin slows nothing."""
    return sum(max(0.0, min(end[a], t1) - max(start[a], t0)) for a in tasks)


def _positive(costs: Costs) -> Costs:
    """`costs` with every task time raised to a small positive floor (the program's argument needs it)."""
    f, b, w = (v if isinstance(v, tuple) else (v,) for v in (costs.f, costs.b, costs.w))
    floor = 1e-6 * max(1.0, *f, *b, *w)
    if min(*f, *b, *w) >= floor:
        return costs

    def lift(v: float | tuple[float, ...]) -> float | tuple[float, ...]:
        return tuple(max(x, floor) for x in v) if isinstance(v, tuple) else max(float(v), floor)

    return replace(costs, f=lift(costs.f), b=lift(costs.b), w=lift(costs.w))


def _forward_timeline(schedule: Schedule, orders: list[tuple[Action, ...]], costs: Costs) -> tuple[dict, dict]:
    """Start and end of each F task when the ranks run only their F tasks (evaluation)."""
    f, _, _ = costs.per_stage(schedule.num_stages)
    ids = TaskIds(schedule.num_stages, schedule.num_microbatches)
    encoded = [[ids.of(a) for a in order] for order in orders]
    start, end = [0.0] * ids.nm, [-1.0] * ids.nm
    replay(encoded, ids.inputs(), ids.per_task([f]), ids.lags(schedule.placement, costs.comm), start, end)
    return ({a: start[t] for order, row in zip(orders, encoded) for a, t in zip(order, row)},
            {a: end[t] for order, row in zip(orders, encoded) for a, t in zip(order, row)})


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
