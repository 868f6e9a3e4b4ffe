"""pick_schedule: the fastest candidate whose simulated peak memory fits the limit.

References: a brute force that builds and simulates every registered schedule itself (costs of a
2p-stage split written out as halves), a hand-worked slow-link case (times below), the memory
limit checked on the simulation, and DESIGN.md's zero-bubble claim for ZB-V.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import pytest

from zbpp.schedules import Costs, Memory, available, build, options_of, pick_schedule, simulate
from zbpp.schedules.select import evaluate_candidates, scale_to_stages

REL = 1e-9  # sums of a few hundred float task times: rounding only


def _halves(values):
    """Per-stage values of a 2p-stage split: stage s is half of rank-stage s // 2."""
    return tuple(v / 2 for v in values for _ in range(2))


def _brute_force(p, m, f, b, w, comm, act, wgrad, limit):
    """(makespan, peak, name) of every registered schedule that fits, built and simulated here."""
    out = []
    for name in available():
        n = build(name, num_ranks=p, num_microbatches=1).num_stages
        assert n in (p, 2 * p), f"{name}: {n} stages; extend this test's scaling"
        if n == p:
            costs, memory = Costs(f, b, w, comm), Memory(act, wgrad)
        else:
            costs = Costs(_halves(f), _halves(b), _halves(w), comm)
            memory = Memory(_halves(act), _halves(wgrad))
        opts = {k: v for k, v in (("costs", costs), ("memory", memory), ("memory_limit", limit)) if k in options_of(name)}
        try:
            sched = build(name, num_ranks=p, num_microbatches=m, **opts)
        except ValueError:
            continue
        res = simulate(sched, costs, memory)
        if limit is None or max(res.peak_memory) <= limit * (1 + REL):
            out.append((res.makespan, max(res.peak_memory), name))
    return sorted(out)


def test_scale_to_stages_by_overlap():
    costs, memory = scale_to_stages(Costs(f=(2.0, 4.0), b=(1.0, 3.0), w=0.5, comm=7.0), Memory((1.0, 2.0), 0.5), 2, 4)
    assert costs.f == (1.0, 1.0, 2.0, 2.0) and costs.b == (0.5, 0.5, 1.5, 1.5) and costs.w == (0.25,) * 4
    assert costs.comm == 7.0  # one activation per message, whatever the split
    assert memory.activation == (0.5, 0.5, 1.0, 1.0) and memory.wgrad == (0.25,) * 4
    # three stages over two rank-stages: the middle one takes 1/3 of each half -> 1/3*3 + 1/3*6 = 3
    three, _ = scale_to_stages(Costs(f=(3.0, 6.0)), Memory(), 2, 3)
    assert three.f == pytest.approx((2.0, 3.0, 4.0), rel=REL)
    same, _ = scale_to_stages(Costs(f=(3.0, 6.0)), Memory(), 2, 2)
    assert same.f == (3.0, 6.0)


@pytest.mark.parametrize(
    "p, m, f, b, w, comm, wgrad_frac, limit",
    [
        (2, 4, (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), 0.0, 0.5, None),
        (2, 8, (1.0, 1.2), (1.1, 1.3), (0.9, 0.7), 0.05, 0.45, 2.0),
        (2, 6, (2.0, 1.0), (2.0, 1.5), (1.0, 1.0), 0.6, 0.5, 3.0),
        (3, 6, (1.0, 1.0, 1.4), (1.0, 1.2, 1.0), (0.5, 1.0, 0.6), 0.2, 1 / 3, 3.0),
        (2, 4, (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), 5.0, 0.5, 2.0),
    ],
)
def test_pick_is_the_fastest_that_fits(p, m, f, b, w, comm, wgrad_frac, limit):
    act = (1.0,) * p
    wgrad = tuple(a * wgrad_frac for a in act)
    want = _brute_force(p, m, f, b, w, comm, act, wgrad, limit)
    pick = pick_schedule(p, m, Costs(f, b, w, comm), memory=Memory(act, wgrad), memory_limit=limit)
    assert pick.result.makespan == pytest.approx(want[0][0], rel=REL)
    assert limit is None or max(pick.result.peak_memory) <= limit * (1 + REL)
    # the returned result is the candidate's own simulation
    n = pick.schedule.num_stages
    costs = Costs(f, b, w, comm) if n == p else Costs(_halves(f), _halves(b), _halves(w), comm)
    memory = Memory(act, wgrad) if n == p else Memory(_halves(act), _halves(wgrad))
    again = simulate(pick.schedule, costs, memory)
    assert again.makespan == pick.result.makespan and again.peak_memory == pick.result.peak_memory


def test_slow_link_picks_fewest_messages_on_the_critical_path():
    # p=2, m=4, F=B=W=1, comm=100. GPipe: rank 0's F end at 1..4 and reach rank 1 at 101..104;
    # rank 1 runs F 101-105 and four BW of 2 until 113; they reach rank 0 at 207..213, whose four
    # BW end at 215: one round trip (two messages) on the critical path. A V split has four
    # crossings per microbatch (0->1, 1->1 in memory, 1->0 forward, then back), so > 4 * comm.
    slow = Costs(f=1.0, b=1.0, w=1.0, comm=100.0)
    pick = pick_schedule(2, 4, slow, memory=Memory(1.0, 0.5), candidates=["gpipe", "1f1b", "zb-h1", "zb-v", "zbv-auto"])
    assert (pick.name, pick.result.makespan) == ("gpipe", 215.0)
    everything = evaluate_candidates(2, 4, slow, memory=Memory(1.0, 0.5))
    assert everything[0].schedule.num_stages == 2 and everything[0].result.makespan < 3 * 100
    assert all(c.result.makespan > 4 * 100 for c in everything if c.schedule is not None and c.schedule.num_stages == 4)


def test_memory_limit_binds():
    costs, memory = Costs(1.0, 1.0, 1.0), Memory(1.0, 1 / 3)
    free = pick_schedule(4, 8, costs, memory=memory)
    assert max(free.result.peak_memory) > 2  # without a limit the fastest needs more than 2
    tight = pick_schedule(4, 8, costs, memory=memory, memory_limit=2.0)
    assert max(tight.result.peak_memory) <= 2 * (1 + REL)
    want = _brute_force(4, 8, (1.0,) * 4, (1.0,) * 4, (1.0,) * 4, 0.0, (1.0,) * 4, (1 / 3,) * 4, 2.0)
    assert tight.result.makespan == pytest.approx(want[0][0], rel=REL)
    assert tight.result.makespan > free.result.makespan
    # DESIGN.md: ZB-V has zero bubble within 1F1B's memory (p rank-stage activations)
    # (zb-interleaved ties with it on the step at less memory on the later ranks, so it may be the pick)
    at_1f1b = pick_schedule(4, 8, costs, memory=memory, memory_limit=4.0)
    zbv = pick_schedule(4, 8, costs, memory=memory, memory_limit=4.0, candidates=["zb-v"])
    assert zbv.result.bubble_rate == pytest.approx(0.0, abs=REL) and max(zbv.result.peak_memory) <= 4
    assert at_1f1b.result.makespan <= zbv.result.makespan * (1 + REL) and max(at_1f1b.result.peak_memory) <= 4


def test_ties_go_to_lower_memory_then_given_order():
    # one rank: every schedule takes m * (F + B + W); GPipe holds all m activations, 1F1B one
    pick = pick_schedule(1, 4, Costs(1.0, 1.0, 1.0), memory=Memory(1.0, 0.0), candidates=["gpipe", "1f1b"])
    assert pick.name == "1f1b" and pick.result.makespan == 12.0
    slow = Costs(1.0, 1.0, 1.0, comm=100.0)  # zb-h1 and zb-auto: same makespan and peak here
    a = pick_schedule(2, 4, slow, memory=Memory(1.0, 0.5), memory_limit=2.0, candidates=["zb-auto", "zb-h1"])
    b = pick_schedule(2, 4, slow, memory=Memory(1.0, 0.5), memory_limit=2.0, candidates=["zb-h1", "zb-auto"])
    assert a.result.makespan == b.result.makespan
    assert (a.name, b.name) == ("zb-auto", "zb-h1")


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="costs must be a zbpp.schedules.Costs"):
        pick_schedule(2, 4, (1, 1, 1))
    with pytest.raises(ValueError, match=r"costs.f has 3 values.*num_ranks=2"):
        pick_schedule(2, 4, Costs(f=(1, 1, 1)))
    with pytest.raises(ValueError, match="memory_limit must be a finite number > 0"):
        pick_schedule(2, 4, Costs(), memory_limit=0)
    with pytest.raises(ValueError, match="unknown schedule.*'nope'"):
        pick_schedule(2, 4, Costs(), candidates=["1f1b", "nope"])
    # a rank holds at least one microbatch's activation (the auto schedules refuse 0.5); of the
    # fixed ones, 1F1B's rank 0 holds two (its warm-up), and nothing holds less on its fullest rank
    with pytest.raises(ValueError, match=r"memory_limit=0.5 fits no candidate.*smallest simulated peak is 2 "):
        pick_schedule(2, 4, Costs(), memory=Memory(1.0, 0.5), memory_limit=0.5)


def test_transients_count_against_the_limit():
    # p=2, m=4, unit tasks, Memory(1, 0.5, transient_b=10). ZB-H1's rank 0 runs F0.0 F0.1 B0.0:
    # it holds 2 when B0.0 starts, which then allocates 10 more: 12. Rank 1 runs F1.0 B1.0 F1.1
    # B1.1: 1 - 0.5 + 1 = 1.5 held when B1.1 starts: 11.5. Every candidate runs a B or BW (its
    # transient max(10, 0.5 - 1 + 0) = 10) above one activation: none fits a limit of 3.
    memory = Memory(1.0, 0.5, transient_b=10.0)
    got = pick_schedule(2, 4, Costs(1.0, 1.0, 1.0), memory=memory, candidates=["zb-h1"])
    assert got.result.peak_memory == [12.0, 11.5]
    assert got.result.peak_memory == simulate(got.schedule, Costs(1.0, 1.0, 1.0), memory).peak_memory
    with pytest.raises(ValueError, match="fits no candidate"):
        pick_schedule(2, 4, Costs(1.0, 1.0, 1.0), memory=memory, memory_limit=3.0)


def test_scale_to_stages_keeps_transients():
    # a transient is one task's peak, not a sum over layers: a finer stage keeps the largest of
    # the rank-stages it overlaps (exact for n = p; on the safe side of the limit for n > p)
    memory = Memory((1.0, 2.0), 0.5, transient_f=(0.0, 3.0), transient_b=(4.0, 0.0), transient_w=1.0)
    _, same = scale_to_stages(Costs(), memory, 2, 2)
    assert same.transients(2) == memory.transients(2)
    _, four = scale_to_stages(Costs(), memory, 2, 4)
    assert (four.transient_f, four.transient_b, four.transient_w) == ((0.0, 0.0, 3.0, 3.0), (4.0, 4.0, 0.0, 0.0), (1.0,) * 4)
    _, three = scale_to_stages(Costs(), memory, 2, 3)  # the middle stage overlaps both
    assert (three.transient_f, three.transient_b) == ((0.0, 3.0, 3.0), (4.0, 4.0, 0.0))


def test_an_infinite_limit_is_refused_and_any_real_number_is_taken():
    """memory_limit=inf passed the check, but every automatic candidate refuses a limit that is not
    finite, so they dropped out unsaid: p=3, m=5 and these costs picked zb-interleaved (37.5)
    where a limit of 1e6 picks zbi-auto (37.15). A Fraction was refused though the automatic
    schedules take any real number. Reference: the pick at a finite limit no schedule reaches."""
    costs = Costs(f=(0.6, 2.9, 1.7), b=(2.8, 2.6, 2.9), w=(1.1, 2.7, 0.7))
    with pytest.raises(ValueError, match=r"memory_limit must be a finite number > 0 .*got inf"):
        pick_schedule(3, 5, costs, memory=Memory(1, 0.5), memory_limit=math.inf)
    huge = pick_schedule(3, 5, costs, memory=Memory(1, 0.5), memory_limit=1e6)
    assert huge.name == "zbi-auto"  # the automatic schedules are among the candidates
    exact = pick_schedule(3, 5, costs, memory=Memory(1, 0.5), memory_limit=Fraction(9, 2))
    assert exact.name == pick_schedule(3, 5, costs, memory=Memory(1, 0.5), memory_limit=4.5).name


def test_stage_counts_are_counted_without_building(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_num_stages` (and `zbpp compare`) built every candidate at m=1 only to count its stages,
    which for the automatic ones runs their whole search. Reference: the stage count of the
    schedule each generator builds, for p = 1..4 and chunks 1..3 where it takes them; then the
    counts must come with every generator replaced by one that fails if called."""
    from zbpp.schedules import registry, select

    cases = [(name, p, {} if k is None else {"chunks": k}) for name in available() for p in range(1, 5)
             for k in ((1, 2, 3) if "chunks" in options_of(name) else (None,))]
    reference = [build(name, num_ranks=p, num_microbatches=1, **opts).num_stages for name, p, opts in cases]

    def forbidden(fn):
        @functools.wraps(fn)  # keeps the signature, hence its options
        def never(*args: object, **kwargs: object) -> None:
            raise AssertionError(f"{fn.__name__} ran to count stages")
        return never

    monkeypatch.setattr(registry, "_REGISTRY", {name: forbidden(fn) for name, fn in registry._REGISTRY.items()})
    defaults = [(name, p, n) for (name, p, opts), n in zip(cases, reference) if opts.get("chunks", 2) == 2]
    assert [select._num_stages(name, p) for name, p, _ in defaults] == [n for _, _, n in defaults]
    assert [registry.stage_count(name, p, **opts) for name, p, opts in cases] == reference
