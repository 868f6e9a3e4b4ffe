"""The program: one message per cross-rank edge, one channel per direction, issue points
that cannot deadlock and that post each operation shortly before it is needed.

Deadlock-freedom is checked on a model of NCCL point-to-point at its strictest: each channel (an
ordered pair of ranks with its own communicator) is a queue on each end; operations leave a queue
only in order, and a send and its receive complete together, only when both are at the head of
their channel's queues. A rank issues the operations of boundary i (non-blocking), then runs task i,
which waits until every message it consumes has completed. The program must finish under this model
for every schedule, costs and option; programs that break the rules (a send issued after the task
that waits for its answer, or a channel's two ends in different orders) must not, which shows the
model can fail.
"""

from __future__ import annotations

import random

import pytest

from zbpp.schedules import Costs, available, build, options_of, simulate
from zbpp.schedules.dag import task_graph
from zbpp.schedules.ir import Action, Kind, Schedule, from_orders
from zbpp.schedules.program import DEFAULT_COSTS, CommOp, Program, fifo_wgrad_problem, make_program, program_makespan


def _build(name: str, p: int, m: int) -> Schedule:
    return build(name, num_ranks=p, num_microbatches=m, **({"chunks": 2} if "chunks" in options_of(name) else {}))


def _finishes(program: Program, issue: list[list[list[CommOp]]] | None = None) -> bool:
    """Run the per-channel NCCL model (module docstring); True when every task and operation completes."""
    issue = issue if issue is not None else [[list(ops) for ops in rp.issue] for rp in program.ranks]
    p = len(program.ranks)
    queues: dict[tuple[int, int, bool], list[int]] = {}  # (channel, sending end?) -> message indices issued
    heads: dict[tuple[int, int, bool], int] = {}
    done_msgs: set[int] = set()
    done_tasks: set[Action] = set()
    pos = [0] * p  # next boundary / task of each rank
    issued = [False] * p  # the boundary at pos[r] has been issued
    progress = True
    while progress:
        progress = False
        for r, rp in enumerate(program.ranks):
            while True:
                i = pos[r]
                if not issued[r]:
                    for op in issue[r][i]:
                        if op.send and op.message.src not in done_tasks:
                            return False  # a send of data not produced yet: the program is broken
                        queues.setdefault((*op.message.channel, op.send), []).append(op.message.index)
                    issued[r] = True
                    progress = True
                if i == len(rp.tasks):
                    break
                task = rp.tasks[i]
                msg = rp.recv_of.get(task)
                if msg is not None and msg.index not in done_msgs:
                    break
                done_tasks.add(task)
                pos[r] += 1
                issued[r] = False
                progress = True
        for channel in {key[:2] for key in queues}:  # rendezvous of the two heads of each channel
            s_key, r_key = (*channel, True), (*channel, False)
            while True:
                hs, hr = heads.get(s_key, 0), heads.get(r_key, 0)
                sq, rq = queues.get(s_key, []), queues.get(r_key, [])
                if hs >= len(sq) or hr >= len(rq) or sq[hs] != rq[hr]:
                    break
                done_msgs.add(sq[hs])
                heads[s_key], heads[r_key] = hs + 1, hr + 1
                progress = True
    return all(pos[r] == len(rp.tasks) and issued[r] for r, rp in enumerate(program.ranks)) and len(done_msgs) == len(program.messages)


def _random_costs(rng: random.Random, num_stages: int) -> Costs:
    def per_stage() -> tuple[float, ...]:
        return tuple(rng.uniform(0.2, 3.0) for _ in range(num_stages))

    return Costs(f=per_stage(), b=per_stage(), w=per_stage(), comm=rng.choice([0.0, 0.3, 2.5]))


CASES = [(name, p, m) for name in available() for p in (2, 3, 4) for m in (1, p, 2 * p + 1)]


@pytest.mark.parametrize("name,p,m", CASES)
def test_program_is_complete_and_deadlock_free(name, p, m):
    sched = _build(name, p, m)
    cross = {(u, v) for u, v, d in task_graph(sched, rank_chains=False).edges(data=True) if d["cross_rank"]}
    rng = random.Random(f"{name}{p}{m}")
    for costs in (None, _random_costs(rng, sched.num_stages)):
        program = make_program(sched, costs=costs)
        assert {(msg.src, msg.dst) for msg in program.messages} == cross  # one message per cross-rank edge
        assert all(msg.src_rank != msg.dst_rank for msg in program.messages)  # never a send to oneself
        for rp in program.ranks:
            assert sorted(op.message.index for op in rp.ops) == sorted(
                m.index for m in program.messages if rp.rank in (m.src_rank, m.dst_rank)
            )
        assert _finishes(program), f"{name} p={p} m={m} costs={costs} deadlocks"
        fwd = make_program(sched, costs=costs, forward_only=True)
        assert all(a.kind is Kind.F for rp in fwd.ranks for a in rp.tasks)
        assert {(m.src, m.dst) for m in fwd.messages} == {(u, v) for u, v in cross if u.kind is Kind.F}
        assert _finishes(fwd), f"{name} p={p} m={m} forward-only deadlocks"


def _random_schedule(rng: random.Random, p: int, m: int, v_shape: bool) -> Schedule:
    """A random valid schedule: list scheduling that picks any ready task of a random rank."""
    n = 2 * p if v_shape else p
    placement = [min(s, n - 1 - s) if v_shape else s for s in range(n)]
    split = {(s, j): rng.random() < 0.7 for s in range(n) for j in range(m)}
    kinds = {(s, j): ([Kind.F, Kind.B, Kind.W] if split[(s, j)] else [Kind.F, Kind.BW]) for s in range(n) for j in range(m)}
    done: set[Action] = set()
    orders: list[list[Action]] = [[] for _ in range(p)]
    todo = {Action(k, s, j) for (s, j), ks in kinds.items() for k in ks}

    def backward(s: int, j: int) -> Action:
        return Action(Kind.B if split[(s, j)] else Kind.BW, s, j)

    def ready(a: Action) -> bool:
        s, j = a.stage, a.microbatch
        if a.kind is Kind.F:
            return s == 0 or Action(Kind.F, s - 1, j) in done
        if a.kind is Kind.W:
            return Action(Kind.B, s, j) in done
        return (Action(Kind.F, s, j) in done) and (s == n - 1 or backward(s + 1, j) in done)

    while todo:
        cands = sorted((a for a in todo if ready(a)), key=str)
        a = rng.choice(cands)
        todo.discard(a)
        done.add(a)
        orders[placement[a.stage]].append(a)
    return from_orders("random", placement, m, orders)


@pytest.mark.parametrize("seed", range(40))
def test_random_schedules_and_costs_never_deadlock(seed):
    rng = random.Random(seed)
    p, m = rng.randint(2, 4), rng.randint(1, 6)
    sched = _random_schedule(rng, p, m, v_shape=bool(seed % 2))
    program = make_program(sched, costs=_random_costs(rng, sched.num_stages))
    assert _finishes(program)


def test_the_model_catches_broken_programs():
    sched = _build("1f1b", 2, 4)
    program = make_program(sched)
    # Every send of rank 1 moved after its last task: rank 0's BW0.0 waits for it, so F0.2 is
    # never sent, and rank 1's F1.2 waits forever.
    late = [[list(ops) for ops in rp.issue] for rp in program.ranks]
    sends = [op for ops in late[1] for op in ops if op.send]
    late[1] = [[op for op in ops if not op.send] for ops in late[1]]
    late[1][-1] += sends
    assert not _finishes(program, late)
    # Rank 0's first two sends on channel (0, 1) issued together in the wrong order: the two ends
    # of the channel disagree, so F0.1 is at the head of the sending end and F0.0 at the receiving one.
    swapped = [[list(ops) for ops in rp.issue] for rp in program.ranks]
    sends = [(i, op) for i, ops in enumerate(swapped[0]) for op in ops if op.send][:2]
    (_, first), (i2, second) = sends
    swapped[0] = [[op for op in ops if op not in (first, second)] for ops in swapped[0]]
    swapped[0][i2][:0] = [second, first]
    assert not _finishes(program, swapped)
    swapped[0][i2][:2] = [first, second]
    assert _finishes(program, swapped)  # the same boundary in the right order is fine


def test_receives_are_posted_shortly_before_they_are_needed():
    """1F1B, p=2, m=4, the default costs (unit tasks, a message takes 0.01). Rank 1 runs F1.0 BW1.0
    F1.1 BW1.1 F1.2 BW1.2 F1.3 BW1.3, starting at 1.01, 2.01, 4.01, 5.01, 7.03, 8.03, 10.03, 11.03;
    rank 0 finishes F0.1 at 2, F0.2 at 7.02 and F0.3 at 10.02. F1.1's activation exists before BW1.0
    starts, and rank 1 is busy up to F1.1: received one task ahead. F1.2 waits 0.02 for its
    activation: received right before it. F0.3 is produced after BW1.2 has started: a receive
    posted before BW1.2 would only spin, so it is posted right before F1.3. Rank 0 sends each
    activation at its last boundary not later than that receive."""
    program = make_program(_build("1f1b", 2, 4))
    r1 = program.ranks[1]
    where = {op.message.dst: r1.tasks[i] if i < len(r1.tasks) else None
             for i, ops in enumerate(r1.issue) for op in ops if not op.send}
    assert {str(k): str(v) for k, v in where.items()} == {
        "F1.0": "F1.0", "F1.1": "BW1.0", "F1.2": "F1.2", "F1.3": "F1.3"}
    r0 = program.ranks[0]
    sent_before = {str(op.message.src): str(r0.tasks[i]) for i, ops in enumerate(r0.issue) for op in ops if op.send}
    assert sent_before == {"F0.0": "F0.1", "F0.1": "BW0.0", "F0.2": "BW0.1", "F0.3": "BW0.2"}
    # With no link time every receive is posted just before its consumer.
    jit = make_program(_build("1f1b", 2, 4), costs=Costs(1, 1, 1, comm=0))
    assert all(str(op.message.dst) == str(jit.ranks[1].tasks[i]) for i, ops in enumerate(jit.ranks[1].issue)
               for op in ops if not op.send)
    # A slow link (comm of two tasks) moves receives earlier.
    slow = make_program(_build("1f1b", 2, 4), costs=Costs(1, 1, 1, comm=2.0))
    first = {str(op.message.dst): i for i, ops in enumerate(slow.ranks[1].issue) for op in ops if not op.send}
    assert first["F1.3"] < 6  # before BW1.1 (position 3) rather than BW1.2 (position 5)


def test_v_shape_hands_over_on_the_turning_rank():
    """ZB-V, p=2: stages 0,1,2,3 on ranks 0,1,1,0. Hand-worked: per microbatch the messages are
    F0->F1 (0->1), F2->F3 (1->0), B3->B2 (0->1) and B1->B0 (1->0); F1->F2 and B2->B1 stay on rank 1."""
    sched = _build("zb-v", 2, 3)
    assert sched.placement == (0, 1, 1, 0)
    program = make_program(sched)
    got = {(str(m.src)[:-2], str(m.dst)[:-2], m.src_rank, m.dst_rank) for m in program.messages}
    assert got == {("F0", "F1", 0, 1), ("F2", "F3", 1, 0), ("B3", "B2", 0, 1), ("B1", "B0", 1, 0)}
    assert len(program.messages) == 4 * 3
    assert program.channels == ((0, 1), (1, 0))


def test_fifo_wgrad_problem_names_the_task():
    sched = _build("zb-h1", 2, 2)
    assert all(fifo_wgrad_problem(sched, s) is None for s in range(2))
    r1 = [Action.parse(t) for t in "F1.0 B1.0 F1.1 B1.1 W1.1 W1.0".split()]
    swapped = Schedule(2, 2, 2, sched.placement, (sched.orders[0], tuple(r1)), name="swapped")
    msg = fifo_wgrad_problem(swapped, 1)
    assert msg is not None and "W1.1" in msg and "microbatch 0" in msg


# -- slow links: a transfer starts only once both ends are posted --------------------------------------


def _rendezvous_makespan(program: Program, costs: Costs) -> float:
    """The step under `program` when a message leaves only once its send and its receive are both
    issued (NCCL's rendezvous) and its channel's earlier messages have arrived, then takes
    `costs.comm`: the model the program's timing is for (an independent `program_makespan`).
    A rank reaches boundary i when its task i-1 ends; a task starts when its rank is free and its
    input (received, or handed over in memory) is there."""
    f, b, w = costs.per_stage(program.schedule.num_stages)
    length = {Kind.F: f, Kind.B: b, Kind.W: w}
    end: dict[Action, float] = {}
    at: dict[tuple[int, bool], tuple[int, int]] = {}  # (message, send?) -> (rank, boundary)
    for rp in program.ranks:
        for i, ops in enumerate(rp.issue):
            for op in ops:
                at[(op.message.index, op.send)] = (rp.rank, i)

    def reached(rank: int, i: int) -> float | None:
        return 0.0 if i == 0 else end.get(program.ranks[rank].tasks[i - 1])

    arrived: dict[int, float] = {}
    pos, free = [0] * len(program.ranks), [0.0] * len(program.ranks)
    while any(pos[r] < len(rp.tasks) for r, rp in enumerate(program.ranks)):
        moved = False
        for r, rp in enumerate(program.ranks):
            while pos[r] < len(rp.tasks):
                task, ready = rp.tasks[pos[r]], free[r]
                msg = rp.recv_of.get(task)
                if msg is not None:
                    times = [reached(*at[(msg.index, True)]), reached(*at[(msg.index, False)]), end.get(msg.src)]
                    # a channel is one stream: its earlier messages arrive first
                    times += [arrived.get(k) for k in range(msg.index) if program.messages[k].channel == msg.channel]
                    if None in times:
                        break
                    arrived[msg.index] = max(times) + costs.comm
                    ready = max(ready, arrived[msg.index])
                elif task in rp.handed_from:
                    if rp.handed_from[task] not in end:
                        break
                    ready = max(ready, end[rp.handed_from[task]])
                d = length[Kind.B][task.stage] + length[Kind.W][task.stage] if task.kind is Kind.BW \
                    else length[task.kind][task.stage]
                end[task] = free[r] = ready + d
                pos[r] += 1
                moved = True
        assert moved, "the rendezvous model stalled"
    return max(end.values())


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v"])
def test_fast_links_post_no_receive_before_its_data(name):
    # the rule that posts early only acts when a message is slow against a task: with the default
    # costs and a link at 1% of a task, every receive waits for its data (or sits right before its
    # consumer, where the rank waits for it anyway), as before
    for costs in (None, Costs(f=1.0, b=1.3, w=0.8, comm=0.01)):
        program = make_program(_build(name, 2, 8), costs=costs)
        sim = simulate(program.schedule, costs or DEFAULT_COSTS)
        for rp in program.ranks:
            for i, ops in enumerate(rp.issue):
                for op in ops:
                    if op.send or i == 0 or rp.tasks.index(op.message.dst) == i:
                        continue
                    assert sim.end[rp.tasks[i - 1]] >= sim.end[op.message.src] - 1e-12, (name, str(op))


@pytest.mark.parametrize("name", ["zb-h1", "zb-v"])
def test_slow_link_receives_posted_early_enough(name, monkeypatch):
    # a message takes 0.6 of a task, as 8.5 ms messages beside 13-15 ms tasks on NCCL sockets: with
    # receives allowed before their data, the rendezvous step equals the simulated one; made to
    # wait for the data (the fast-link rule), it is longer
    sched = _build(name, 2, 8)
    costs = Costs(f=1.0, b=1.05, w=1.05, comm=0.6)
    simulated = simulate(sched, costs).makespan
    program = make_program(sched, costs=costs)
    assert _finishes(program)
    assert _rendezvous_makespan(program, costs) == pytest.approx(simulated)
    from zbpp.schedules import program as plan_module

    monkeypatch.setattr(plan_module, "LATE_TOLERANCE", float("inf"))
    waiting = make_program(sched, costs=costs)
    assert _rendezvous_makespan(waiting, costs) > 1.02 * simulated


@pytest.mark.parametrize("name,p,m", [c for c in CASES if c[2] > 1][::3])
def test_program_makespan_is_the_rendezvous_model(name, p, m):
    sched = _build(name, p, m)
    rng = random.Random(f"rdv{name}{p}{m}")
    for program_costs in (None, _random_costs(rng, sched.num_stages)):
        program = make_program(sched, costs=program_costs)
        for run_costs in (program_costs or DEFAULT_COSTS, _random_costs(rng, sched.num_stages)):
            assert program_makespan(program, run_costs) == pytest.approx(_rendezvous_makespan(program, run_costs))
            # the runtime can only lose against messages that leave with their producer
            assert program_makespan(program, run_costs) >= simulate(sched, run_costs).makespan * (1 - 1e-9)


def test_a_receive_spinning_while_its_rank_idles_is_posted_before_its_data():
    """ZB-H2, p=3, m=2, a slow link (comm 5) and uneven stages, worked by hand from the simulated
    timeline: rank 0 runs F0.0 F0.1 by t=1, then idles until B0.0's gradient arrives at 27.5 (B0.0
    [27.5, 29], W0.0 [29, 30.5]); B1.1's gradient exists at 27.5 and B0.1 starts at 32.5. Posting
    its receive at t=1 spins while rank 0 computes nothing (0 of the GEMM time SPIN_SLOWDOWN
    charges); posting it after B0.0 (t=29) makes it 1.5 late. The spin was costed as its wall time
    (26.5 * 0.27 > 1.5), so the program took the late one: its step was 37.5 against the simulated
    35.5. Costed as the compute it slows (0), the receive goes before B0.0 and the step is 35.5."""
    sched = build("zb-h2", num_ranks=3, num_microbatches=2)
    costs = Costs(f=(0.5, 1.5, 3.0), b=(1.5, 0.5, 2.0), w=(1.5, 1.5, 3.0), comm=5.0)
    program = make_program(sched, costs=costs)
    rank0 = program.ranks[0]
    posted = next(i for i, ops in enumerate(rank0.issue) for op in ops if str(op) == "recv B1.1->B0.1 from 1")
    assert rank0.tasks[posted] == Action(Kind.B, 0, 0)  # right before B0.0, as rank 0 waits idle before it
    assert simulate(sched, costs).makespan == 35.5
    assert program_makespan(program, costs) == pytest.approx(35.5)
    assert _finishes(program)
