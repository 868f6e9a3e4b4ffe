"""What a task allocates while it runs (its transient), and offload's shared host link and memory.

References: hand-worked peaks and steps; a brute-force replay here of each rank's task order that
tracks every microbatch's bytes one by one (no counts, no terms); plans re-simulated here.
"""

from __future__ import annotations

import math
import random

import pytest

from zbpp.schedules import Costs, Memory, build, simulate
from zbpp.schedules.ir import Kind
from zbpp.schedules.planner import evaluate, search
from zbpp.schedules.policies import memory_terms, rank_peak
from zbpp.schedules.profile import Layer, PolicyCost, Profile, transformer_profile

REL = 1e-9  # sums of a few byte counts and task times: rounding only


# -- the transient in the simulator ---------------------------------------------------------------
def test_a_b_transient_decides_the_peak_by_hand() -> None:
    # ZB-H1 on one rank, 2 microbatches: F0 B0 W0 F1 B1 W1. F keeps 4, B leaves 1 for W, and B
    # allocates 10 above what the rank holds when it starts: without it the peak is 4 (after F);
    # with it, 4 + 10 during B0
    sched = build("zb-h1", num_ranks=1, num_microbatches=2)
    assert simulate(sched, Costs(1, 1, 1), Memory(activation=4, wgrad=1)).peak_memory == [4.0]
    res = simulate(sched, Costs(1, 1, 1), Memory(activation=4, wgrad=1, transient_b=10))
    assert res.peak_memory == [14.0]
    assert [res.memory_after[a] for a in sched.orders[0]] == [4.0, 1.0, 0.0, 4.0, 1.0, 0.0]  # kept bytes unchanged


def test_a_stage_transient_runs_its_layers_backward_by_hand() -> None:
    # One stage: a block under full recompute (keeps 1, W needs 4, its B re-creates 7) then a head
    # (keeps 6, W needs 2, the loss's B allocates 5). B runs the head first: 0 + 5; then the block
    # on top of the head's change 2 - 6 = -4: -4 + 7 = 3. The stage's B transient is 5.
    block = Layer("block", 1, 1, 1, activation=8, wgrad=4, policies={"full": PolicyCost(1, 4, recompute=1, transient=7)})
    head = Layer("head", 1, 1, 1, activation=6, wgrad=2, transient=5)
    prof = Profile([block, head])
    assert prof.stage_costs([range(0, 2)], ["full"])[1].transient_b == (5.0,)
    # a head that frees less (W keeps 5 of its 6): the block's re-run decides, -1 + 7 = 6
    head5 = Layer("head", 1, 1, 1, activation=6, wgrad=5, transient=5)
    assert Profile([block, head5]).stage_costs([range(0, 2)], ["full"])[1].transient_b == (6.0,)
    # GPipe on one rank, 2 microbatches (F0 F1 BW0 BW1): before BW0 the rank holds 2 x (1 + 6) =
    # 14; BW0's B part peaks 5 above (19), then its W part holds 14 + (4 + 2) - 7 = 13
    o = evaluate(prof, 1, 2, [range(0, 2)], "gpipe", policies="full")
    assert o.peak == pytest.approx((19.0,), rel=REL)


def _brute_peaks(sched, act, wg, tf, tb, tw) -> list[float]:
    """Each rank's peak from its order, every microbatch's bytes tracked on its own."""
    peaks = []
    for order in sched.orders:
        held: dict[tuple[int, int], float] = {}  # (stage, microbatch) -> bytes on the device now
        top = 0.0
        for a in order:
            s, j = a.stage, a.microbatch
            now = sum(held.values())
            if a.kind is Kind.F:
                top = max(top, now + tf[s])
                held[(s, j)] = act[s]
            elif a.kind is Kind.B:
                top = max(top, now + tb[s])
                held[(s, j)] = wg[s]
            elif a.kind is Kind.W:
                top = max(top, now + tw[s])
                held[(s, j)] = 0.0
            else:  # BW: B, then W
                top = max(top, now + tb[s])
                held[(s, j)] = wg[s]
                top = max(top, sum(held.values()) + tw[s])
                held[(s, j)] = 0.0
            top = max(top, sum(held.values()))
        peaks.append(top)
    return peaks


@pytest.mark.parametrize("name, p, opts", [
    ("gpipe", 2, {}), ("1f1b", 3, {}), ("zb-h1", 2, {}), ("zb-h2", 2, {}), ("zb-v", 2, {}), ("v-min", 2, {}),
    ("dualpipe-v", 2, {}), ("zb-interleaved", 2, {"chunks": 3}), ("interleaved-1f1b", 2, {"chunks": 2}),
])
def test_simulated_peak_with_transients_equals_a_brute_force_replay(name: str, p: int, opts: dict) -> None:
    sched = build(name, num_ranks=p, num_microbatches=2 * p, **opts)
    n = sched.num_stages
    rng = random.Random(11)
    for _ in range(15):
        act = [rng.uniform(0, 4) for _ in range(n)]
        wg = [a * rng.uniform(0, 2) for a in act]  # B may add bytes (recompute) or free some
        tf, tb, tw = ([rng.choice([0.0, rng.uniform(0, 6)]) for _ in range(n)] for _ in range(3))
        memory = Memory(act, wg, transient_f=tf, transient_b=tb, transient_w=tw)
        want = _brute_peaks(sched, act, wg, tf, tb, tw)
        assert simulate(sched, Costs(1, 1, 1), memory).peak_memory == pytest.approx(want, rel=REL)
        # the planner's per-rank peak from the order's terms, without simulating
        for r, (mine, terms) in enumerate(memory_terms(sched)):
            got = rank_peak(terms, [act[s] for s in mine], [wg[s] for s in mine], [(tf[s], tb[s], tw[s]) for s in mine])
            assert got == pytest.approx(want[r], rel=REL)


def test_memory_checks_its_transients() -> None:
    with pytest.raises(ValueError, match=r"Memory.transient_b\[0\] must be a finite number >= 0"):
        Memory(1, 0, transient_b=[-1.0])
    with pytest.raises(ValueError, match="Memory.activation has 2 per-stage values but Memory.transient_b has 3"):
        Memory([1, 1], 0, transient_b=[1.0, 2.0, 3.0])


# -- the planner counts them ------------------------------------------------------------------------
def _resimulated_peak(prof: Profile, plan) -> list[float]:
    """Static + the simulated peak of the plan's split and policies, transients included."""
    sched = plan.schedule
    res = simulate(sched, *prof.stage_costs(plan.stages, plan.policies or None)[:2])
    static = [sum(prof.layers[i].static for s in sched.stages_on(r) for i in plan.stages[s]) for r in range(sched.num_ranks)]
    return [x + y for x, y in zip(static, res.peak_memory)]


def test_plans_stay_within_the_budget_once_transients_count() -> None:
    # a small Llama-like profile whose head's loss allocates 8 bytes per logit in B and whose
    # recomputed or reloaded blocks re-create their bytes: at budgets from loose to tight, every
    # plan (automatic schedules included, built with each rank's limit less its largest
    # transient) re-simulates within the budget, transients counted
    prof = transformer_profile(name="t", num_layers=6, hidden=512, ffn=1536, heads=8, vocab=32000, seq=2048)
    assert prof.layers[-1].transient == 8 * 2048 * 32000
    p, m = 2, 4
    free = search(prof, p, m, policies=["none"])
    checked, with_policy = 0, 0
    for frac in (1.0, 0.9, 0.8, 0.7, 0.6):
        budget = frac * max(free.peak)
        try:
            plan = search(prof, p, m, budget, schedules=["1f1b", "zb-h1", "zb-v", "zb-auto", "zbv-auto"])
        except ValueError as exc:
            assert "no schedule and split fits" in str(exc)
            continue
        assert max(_resimulated_peak(prof, plan)) <= budget * (1 + REL)
        assert list(plan.peak) == pytest.approx(_resimulated_peak(prof, plan), rel=REL)
        checked += 1
        with_policy += bool(plan.policies)
    assert checked >= 4 and with_policy >= 1


def test_the_planner_leaves_a_plan_whose_transient_breaks_the_budget() -> None:
    # one rank, ZB-H1, m = 2: F keeps 4, W keeps 1. Without a transient the peak is 4; with B's
    # transient of 10 it is 14: at a budget of 10 "none" no longer fits, and "full" (keeps 1,
    # re-creates 2 during B: 1 + 2 = 3) does
    block = Layer("block", 1, 1, 1, activation=4, wgrad=1, transient=10,
                  policies={"full": PolicyCost(1, 1, recompute=1, transient=2)})
    prof = Profile([block])
    assert evaluate(prof, 1, 2, [range(0, 1)], "zb-h1").peak == (14.0,)
    plan = search(prof, 1, 2, 10, schedules=["zb-h1"])
    assert plan.policies == ("full",) and plan.peak == (3.0,)


# -- offload: a shared host link and host memory -----------------------------------------------------
def _offload_profile(host_bytes_per_s: float) -> Profile:
    """One block: F 2, B 2, W 1; keeps 8 (W 4); selective keeps 3 and adds 0.5 to B; offload keeps
    nothing and copies 8 bytes each way."""
    return Profile([Layer("block", 2, 2, 1, activation=8, wgrad=4, policies={
        "selective": PolicyCost(3, 4, recompute=0.5),
        "offload": PolicyCost(0, 4, copy=8)})], host_bytes_per_s=host_bytes_per_s)


def test_a_shared_host_link_makes_offload_lose_to_selective_by_hand() -> None:
    # GPipe on one rank, 8 microbatches: F0..F7 (2 each, ends 16), then BW0..BW7 (3 each). The
    # shortest F-to-BW gap is microbatch 0's, 14 (F0 ends at 2, BW0 starts at 16).
    # selective: 16 + 8 x 3.5 = 44. offload over 8 B/s alone: a copy takes 1 each way, hidden
    # (2 < 14), the link busy 8 x 1 = 8 per direction: step 16 + 8 x 3 = 40, offload wins. Shared
    # by 6 ranks of a node (8/6 B/s each): 6 each way, still hidden by the gap (12 < 14), but the
    # link carries 8 x 6 = 48 per direction: the step is 48, selective wins.
    prof, stage = _offload_profile(8.0), [range(0, 1)]
    assert evaluate(prof, 1, 8, stage, "gpipe", policies="selective").step == pytest.approx(44, rel=REL)
    assert evaluate(prof, 1, 8, stage, "gpipe", policies="offload").step == pytest.approx(40, rel=REL)
    assert evaluate(prof, 1, 8, stage, "gpipe", policies="offload", ranks_per_node=6).step == pytest.approx(48, rel=REL)
    budget = 30  # none keeps 8 x 8 = 64: a policy is needed
    assert search(prof, 1, 8, budget, schedules=["gpipe"]).policies == ("offload",)
    shared = search(prof, 1, 8, budget, schedules=["gpipe"], ranks_per_node=6)
    assert shared.policies == ("selective",) and shared.step == pytest.approx(44, rel=REL)
    # a copy longer than its gap: 4 ranks share 2 B/s (16 each way per microbatch, 32 - 14 = 18
    # exposed on BW0's... every BW); the link, 8 x 16 = 128 per direction, is longer still
    two = _offload_profile(2.0)
    got = evaluate(two, 1, 8, stage, "gpipe", policies="offload", ranks_per_node=4)
    assert got.step == pytest.approx(max(16 + 8 * (3 + 18), 128), rel=REL)


def test_host_memory_forbids_offload() -> None:
    # GPipe on one rank, 8 microbatches, a fast link (offload's copies all hidden: step 40 against
    # selective's 44): all 8 microbatches' 8 bytes are on the host at once, 64 per rank. A node
    # of 2 ranks with 100 host bytes gives each 50: offload no longer fits and selective is chosen;
    # with 128 (64 each) offload fits again; without a host budget it is assumed to fit
    prof, budget = _offload_profile(1000.0), 30
    assert evaluate(prof, 1, 8, [range(0, 1)], "gpipe", policies="offload").host == (64.0,)
    assert search(prof, 1, 8, budget, schedules=["gpipe"], ranks_per_node=2).policies == ("offload",)
    tight = search(prof, 1, 8, budget, schedules=["gpipe"], ranks_per_node=2, host_memory=100)
    assert tight.policies == ("selective",)
    text = tight.explain()
    assert "offload 4e-09 GB +0 per B (over the host memory)" in text
    assert "shared by 2 rank(s) per node" in text and "host memory 1e-07 GB per node, 5e-08 GB per rank" in text
    roomy = search(prof, 1, 8, budget, schedules=["gpipe"], ranks_per_node=2, host_memory=128)
    assert roomy.policies == ("offload",) and roomy.host == (64.0,)
    o = evaluate(prof, 1, 8, [range(0, 1)], "gpipe", policies="offload", ranks_per_node=2, host_memory=100,
                 memory_budget=budget)
    assert not o.fits and o.host_excess == pytest.approx(14.0, rel=REL)
    # only offload would fit the device: the error names the host memory it lacks (64 - 50 bytes)
    with pytest.raises(ValueError, match="no schedule and split fits.* holds 0.000 GB more pinned host memory"):
        search(prof, 1, 8, budget, schedules=["gpipe"], policies=["none", "offload"], ranks_per_node=2, host_memory=100)


def test_bad_host_settings_are_named() -> None:
    prof = _offload_profile(8.0)
    with pytest.raises(ValueError, match="ranks_per_node must be an integer >= 1, got 0"):
        search(prof, 1, 2, 30, ranks_per_node=0)
    with pytest.raises(ValueError, match="host_memory must be a finite number >= 0"):
        search(prof, 1, 2, 30, host_memory=math.nan)


def test_cli_plan_takes_the_node_sharing_and_host_memory(tmp_path, capsys) -> None:
    from zbpp.cli import main

    path = tmp_path / "prof.json"
    _offload_profile(1000.0).save(path)
    args = ["plan", "--profile", str(path), "-p", "1", "-m", "8", "--budget-gb", "3e-8", "--schedules", "gpipe"]
    assert main(args) == 0
    assert "policies (per stage): offload" in capsys.readouterr().out
    assert main(args + ["--ranks-per-node", "2", "--host-memory-gb", "1e-7"]) == 0  # 50 bytes a rank, 64 needed
    out = capsys.readouterr().out
    assert "policies (per stage): selective" in out and "shared by 2 rank(s) per node" in out
    assert main(args + ["--ranks-per-node", "0"]) == 2
    assert "--ranks-per-node" in capsys.readouterr().err


@pytest.mark.parametrize("name, p, opts", [("zb-auto", 3, {}), ("zbv-auto", 2, {}), ("zbi-auto", 2, {"chunks": 2})])
def test_automatic_schedules_keep_their_limit_with_transients(name: str, p: int, opts: dict) -> None:
    # the builders plan on kept bytes; given transients, each rank plans within its limit less its
    # largest, so the peak simulated with the transients stays within the limit
    costs = Costs(f=1, b=1.5, w=1)
    n = p * (opts.get("chunks", 2) if name != "zb-auto" else 1)
    memory = Memory(activation=1, wgrad=0.5, transient_b=[0.75 if s % 2 else 0.25 for s in range(n)], transient_w=0.5)
    for limit in (3.0, 4.0, 6.0):
        sched = build(name, num_ranks=p, num_microbatches=2 * p, costs=costs, memory=memory, memory_limit=limit, **opts)
        assert max(simulate(sched, costs, memory).peak_memory) <= limit * (1 + REL)
    # above one microbatch's activations (1 a stage) but below them plus the rank's largest
    # transient (0.75): refused, naming that sum
    floor = 1.0 if name == "zb-auto" else 2.0
    with pytest.raises(ValueError, match=f"is infeasible; the smallest feasible limit is {floor + 0.75:g}"):
        build(name, num_ranks=p, num_microbatches=2 * p, costs=costs, memory=memory, memory_limit=floor + 0.6, **opts)


def test_cli_plan_refuses_host_settings_offload_never_uses(tmp_path, capsys) -> None:
    """--ranks-per-node and --host-memory-gb size offload's host link and memory. Where offload is not
    allowed (--policies without it, a profile without it) or never needed (no --budget-gb: every
    activation kept), they changed nothing and were silently ignored; now an error naming them."""
    from zbpp.cli import main

    path, plain = tmp_path / "prof.json", tmp_path / "plain.json"
    _offload_profile(1000.0).save(path)
    Profile([Layer("block", 2, 2, 1, activation=8, wgrad=4)]).save(plain)
    base = ["plan", "-p", "1", "-m", "8", "--schedules", "gpipe"]
    for extra, words in (
        (["--profile", str(path), "--budget-gb", "3e-8", "--policies", "none,selective", "--ranks-per-node", "2"],
         "--ranks-per-node set the host side of offload, which --policies none,selective does not offer"),
        (["--profile", str(plain), "--budget-gb", "1", "--host-memory-gb", "1", "--ranks-per-node", "1"],
         "--ranks-per-node, --host-memory-gb set the host side of offload, which the profile does not offer"),
        (["--profile", str(path), "--host-memory-gb", "1e-7"], "without --budget-gb no stage needs a policy"),
    ):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
    # where offload may be chosen they apply (test_cli_plan_takes_the_node_sharing_and_host_memory)
    assert main(base + ["--profile", str(path), "--budget-gb", "3e-8", "--policies", "selective,offload",
                        "--ranks-per-node", "2", "--host-memory-gb", "1e-7"]) == 0
    assert "policies (per stage): selective" in capsys.readouterr().out
