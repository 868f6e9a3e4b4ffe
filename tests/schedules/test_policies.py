"""Activation policies (none, full, selective, offload) in the profile, the simulator and the search.

References: hand-worked step and peak per policy on one rank; an exhaustive enumeration here of
every split x every fixed schedule x every per-stage policy, each plan built with `build`, its
costs, memory and B transients summed here from the layers' `PolicyCost`, offload's exposed copy
time worked out here from the "none" simulation's F-to-B gaps over the host link's share, its
link time and its host bytes counted here along each rank's order (the model
zbpp.schedules.policies states).
"""

from __future__ import annotations

import functools
import itertools
import math
import random

import pytest

from zbpp.schedules import Costs, Memory, build, simulate
from zbpp.schedules.ir import Kind
from zbpp.schedules.planner import SCHEDULES, evaluate, search
from zbpp.schedules.profile import Layer, PolicyCost, Profile, transformer_profile

REL = 1e-9  # sums of a few task times and byte counts: rounding only
FIXED_ONE_STAGE = ["gpipe", "1f1b", "zb-h1", "zb-h2"]
FIXED_TWO = ["zb-v", "v-half", "v-min", "dualpipe-v"]

# one layer, times in seconds, bytes; the host link moves 4 bytes/s: an offload copy of 8 bytes
# takes 2 s each way
_BLOCK = Layer("block", f=2, b=2, w=1, activation=8, wgrad=4, policies={
    "full": PolicyCost(1, 4, recompute=2),
    "selective": PolicyCost(3, 4, recompute=0.5),
    "offload": PolicyCost(0, 4, copy=8)})
_ONE = Profile([_BLOCK], host_bytes_per_s=4)


@pytest.mark.parametrize("policy, step, peak", [
    # GPipe on one rank, 2 microbatches: F0 F1 BW0 BW1; BW = b + recompute (+ exposed copy) + w.
    # A BW's B part re-creates (or reloads) W's 4 bytes where F kept fewer: during BW0 the rank
    # holds both microbatches' kept bytes plus 4 - kept
    ("none", 2 + 2 + 3 + 3, 8 + 8),
    ("full", 2 + 2 + 5 + 5, 1 + 1 + (4 - 1)),
    ("selective", 2 + 2 + 3.5 + 3.5, 3 + 3 + (4 - 3)),
    # the shortest F-to-B gap is microbatch 0's, 2 s (F0 ends at 2, BW0 starts at 4): a copy out
    # and back takes 4 s, 2 s of it shows in each BW; nothing stays on the device between F and B
    ("offload", 2 + 2 + 5 + 5, 0 + 4),
])
def test_each_policy_costs_what_the_hand_worked_gpipe_run_says(policy: str, step: float, peak: float) -> None:
    o = evaluate(_ONE, 1, 2, [range(0, 1)], "gpipe", policies=policy)
    assert o.step == pytest.approx(step, rel=REL) and o.peak == pytest.approx((peak,), rel=REL)


@pytest.mark.parametrize("policy, peak", [("none", 8), ("full", 4), ("selective", 4), ("offload", 4)])
def test_after_b_w_keeps_its_inputs_under_every_policy(policy: str, peak: float) -> None:
    # ZB-H1 on one rank: F0 B0 W0 F1 B1 W1. F keeps the policy's bytes, B leaves W's 4 bytes (a
    # recomputed or reloaded layer's B adds 4 - kept), W frees them: the peak is max(kept, 4)
    o = evaluate(_ONE, 1, 2, [range(0, 1)], "zb-h1", policies=policy)
    assert o.peak == pytest.approx((peak,), rel=REL)


def test_memory_lets_b_add_what_w_keeps() -> None:
    res = simulate(build("zb-h1", num_ranks=1, num_microbatches=1), Costs(1, 1, 1), Memory(activation=1, wgrad=3))
    assert [res.memory_after[a] for a in res.schedule.orders[0]] == [1.0, 3.0, 0.0]


def test_transformer_profile_derives_the_policies_from_the_shapes() -> None:
    # hidden 64, ffn 256, 4 heads (kv 64), seq 128, micro-batch 1 (T = 128 tokens), bf16, tp 1, gated:
    # none keeps 2 T (6 h + 2 h + 2 kv + 4 ffn) = 256 * 1,664 = 425,984 bytes; full the input 2 T h =
    # 16,384; selective the input and the GEMMs' inputs and outputs, 2 T (6 h + 2 kv + 3 ffn) =
    # 256 * 1,280 = 327,680; full recomputes F; selective attention's 2 T s h FLOPs plus the bytes
    # not kept once at HBM speed
    prof = transformer_profile(name="t", num_layers=1, hidden=64, ffn=256, heads=4, vocab=100, seq=128,
                               flops_per_s=1e12, hbm_bytes_per_s=1e11, host_bytes_per_s=1e10)
    # B's transient: what it re-creates (none's bytes less those kept) or reloads (all of them);
    # the head's B: the loss's two float32 gradients of the logits, 8 T V = 8 * 128 * 100 bytes
    block = prof.layers[1]
    assert block.activation == 425_984
    assert block.cost("full") == PolicyCost(16_384, block.wgrad, recompute=block.f, transient=425_984 - 16_384)
    sel = block.cost("selective")
    assert sel.activation == 327_680 and sel.transient == 425_984 - 327_680
    assert sel.recompute == pytest.approx(2 * 128 * 128 * 64 / 1e12 + (425_984 - 327_680) / 1e11, rel=REL)
    assert block.cost("offload") == PolicyCost(0, block.wgrad, copy=425_984, transient=425_984)
    assert block.transient == 0 and prof.layers[-1].transient == 8 * 128 * 100
    assert prof.layers[0].offers() == ("none",) and block.offers() == ("none", "full", "offload", "selective")
    assert Profile.from_dict(prof.to_dict()) == prof


def test_bad_policies_are_named() -> None:
    with pytest.raises(ValueError, match="unknown policy 'checkpoint'"):
        Layer("x", 1, 1, 1, policies={"checkpoint": PolicyCost(0, 0)})
    with pytest.raises(ValueError, match="unknown policy 'ful'"):
        search(_ONE, 1, 2, policies=["ful"])
    with pytest.raises(ValueError, match="1 policies for 2 stages"):
        Profile([_BLOCK, _BLOCK], host_bytes_per_s=4).stage_costs([range(0, 1), range(1, 2)], ["full"])
    with pytest.raises(ValueError, match="no host link bandwidth"):
        Profile([_BLOCK])


# -- the search against an exhaustive enumeration ------------------------------------------------
def _profile(seed: int, num_layers: int) -> Profile:
    """An embedding (static only), blocks with random policy costs, a head with large activations."""
    rng = random.Random(seed)
    layers = [Layer("embed", 0.05, 0.05, 0.05, static=rng.uniform(1, 2))]
    for i in range(1, num_layers - 1):
        f = rng.uniform(0.8, 1.2)
        act = rng.uniform(2, 4)
        wg = act * rng.uniform(0.5, 1)
        # B's transient: what the re-run re-creates, what offload reloads
        layers.append(Layer(f"block.{i}", f, f * rng.uniform(1, 1.3), f * 0.7, activation=act, wgrad=wg,
                            static=rng.uniform(0.5, 1), policies={
                                "full": PolicyCost(act * 0.1, wg, recompute=f, transient=act * 0.9),
                                "selective": PolicyCost(act * 0.5, wg, recompute=f * 0.3, transient=act * 0.5),
                                "offload": PolicyCost(0, wg, copy=act, transient=act)}))
    layers.append(Layer("head", 1.5, 1.5, 1.5, activation=6, wgrad=2, static=2, transient=rng.uniform(1, 4)))
    return Profile(layers, comm=0.02, host_bytes_per_s=rng.uniform(1, 3))


@functools.lru_cache(maxsize=None)
def _built(name: str, p: int, m: int):
    return build(name, num_ranks=p, num_microbatches=m)


def _step_and_peak(prof: Profile, name: str, p: int, m: int, stages, policies, share: int = 1
                   ) -> tuple[float, list[float], list[float]]:
    """Step, per-rank peak (static included) and per-rank host bytes of one plan, every number
    summed here; the host link shared by `share` ranks."""
    sched = _built(name, p, m)
    n = len(stages)
    cost = [[prof.layers[i].cost(q) for i in r] for r, q in zip(stages, policies)]
    f = [sum(prof.layers[i].f for i in r) for r in stages]
    w = [sum(prof.layers[i].w for i in r) for r in stages]
    b0 = [sum(prof.layers[i].b for i in r) for r in stages]
    act0 = [sum(prof.layers[i].activation for i in r) for r in stages]
    wg0 = [min(a, sum(prof.layers[i].wgrad for i in r)) for a, r in zip(act0, stages)]
    b = [x + sum(c.recompute for c in cs) for x, cs in zip(b0, cost)]
    copies = [sum(c.copy for c in cs) * share / prof.host_bytes_per_s if prof.host_bytes_per_s else 0.0 for cs in cost]
    if any(copies):
        base = simulate(sched, Costs(f, b0, w, comm=prof.comm), Memory(act0, wg0))
        for s in range(n):
            if copies[s]:
                gap = min(base.start[a] - base.end[type(a)(Kind.F, s, a.microbatch)]
                          for order in sched.orders for a in order if a.stage == s and a.kind in (Kind.B, Kind.BW))
                b[s] += max(0.0, 2 * copies[s] - gap)
    act = [sum(c.activation for c in cs) for cs in cost]
    wg = [sum(c.wgrad for c in cs) for cs in cost]
    # a stage's B transient: layer i's on top of what the layers after it (their B ran first) changed
    tb = [max([0.0] + [cs[i].transient + sum(c.wgrad - c.activation for c in cs[i + 1:]) for i in range(len(cs))])
          for cs in cost]
    res = simulate(sched, Costs(f, b, w, comm=prof.comm), Memory(act, wg, transient_b=tb))
    static = [sum(prof.layers[i].static for s in sched.stages_on(r) for i in stages[s]) for r in range(p)]
    # each rank's copies one after another on its share of the link; its host bytes along its order
    link = [m * sum(copies[s] for s in sched.stages_on(r)) for r in range(p)]
    host = []
    for order in sched.orders:
        on_host, top = 0.0, 0.0
        for a in order:
            bytes_ = sum(c.copy for c in cost[a.stage])
            on_host += bytes_ if a.kind is Kind.F else -bytes_ if a.kind in (Kind.B, Kind.BW) else 0.0
            top = max(top, on_host)
        host.append(top)
    return max(res.makespan, max(link)), [x + y for x, y in zip(static, res.peak_memory)], host


def _every_plan(prof: Profile, p: int, m: int, names, share: int = 1) -> list[tuple[float, float, float]]:
    """(step, largest peak, largest host bytes) of every split x schedule x per-stage policy (each stage its own)."""
    L, out = len(prof), []
    for name in names:
        k = SCHEDULES[name]
        for cuts in itertools.combinations(range(1, L), k * p - 1):
            stages = [range(a, b) for a, b in zip((0, *cuts), (*cuts, L))]
            for per_stage in itertools.product(("none", "full", "selective", "offload"), repeat=k * p):
                step, peak, host = _step_and_peak(prof, name, p, m, stages, per_stage, share)
                out.append((step, max(peak), max(host)))
    return out


@pytest.mark.parametrize("seed, p, num_layers, names, share, host_share", [
    (0, 2, 6, FIXED_ONE_STAGE + FIXED_TWO, 1, None),
    (1, 3, 6, ["1f1b", "zb-h1"], 1, None),
    # a node of 3 ranks sharing the host link, and host memory that holds about half the plans' offloaded bytes
    (0, 2, 6, FIXED_ONE_STAGE + FIXED_TWO, 3, 0.5),
])
def test_search_with_policies_equals_every_split_schedule_and_per_stage_policy(seed, p, num_layers, names, share,
                                                                               host_share) -> None:
    prof, m = _profile(seed, num_layers), 2 * p
    plans = _every_plan(prof, p, m, names, share)
    host_memory = None
    if host_share is not None:
        offloading = sorted(h for _, _, h in plans if h > 0)
        host_memory = share * offloading[int(host_share * len(offloading))]
    per_rank_host = math.inf if host_memory is None else host_memory / share
    none_peak = search(prof, p, m, schedules=names, policies=["none"]).peak
    for budget in (math.inf, 0.8 * max(none_peak), 0.55 * max(none_peak), 0.3 * max(none_peak)):
        best = min((step for step, peak, host in plans
                    if peak <= budget * (1 + REL) and host <= per_rank_host * (1 + REL)), default=math.inf)
        kw = {"ranks_per_node": share, "host_memory": host_memory}
        if not math.isfinite(best):
            with pytest.raises(ValueError, match="no schedule and split fits"):
                search(prof, p, m, budget, schedules=names, **kw)
            continue
        plan = search(prof, p, m, None if math.isinf(budget) else budget, schedules=names, **kw)
        assert plan.step == pytest.approx(best, rel=REL)
        # the plan it returns, re-simulated here, is as fast and within the budget
        step, peak, host = _step_and_peak(prof, plan.schedule.name, p, m, plan.stages,
                                          plan.policies or ["none"] * len(plan.stages), share)
        assert step == pytest.approx(plan.step, rel=REL) and max(peak) <= budget * (1 + REL)
        assert max(host) <= per_rank_host * (1 + REL)


def test_a_rank_of_a_v_gives_each_of_its_stages_its_own_policy() -> None:
    # one rank holding both stages of a V (m = 4): two blocks alike in bytes, block 0 cheap to
    # recompute, block 1 dear; at a budget that fits one recomputed stage but not none everywhere,
    # recomputing block 0 alone beats both policies uniform on the rank (what a per-rank choice had)
    cheap = Layer("cheap", 1, 1, 1, activation=8, wgrad=2, policies={"full": PolicyCost(1, 2, recompute=0.5)})
    dear = Layer("dear", 1, 1, 1, activation=8, wgrad=2, policies={"full": PolicyCost(1, 2, recompute=3)})
    prof, p, m = Profile([cheap, dear]), 1, 4
    plans = {q: _step_and_peak(prof, "zb-v", p, m, [range(0, 1), range(1, 2)], q)[:2]
             for q in itertools.product(("none", "full"), repeat=2)}
    budget = max(plans[("full", "none")][1])
    assert max(plans[("none", "none")][1]) > budget  # a policy is needed ...
    assert plans[("full", "none")][0] < plans[("full", "full")][0]  # ... and one stage's is enough
    plan = search(prof, p, m, budget, schedules=["zb-v"])
    assert plan.policies == ("full", "none")
    assert plan.step == pytest.approx(min(step for step, peak in plans.values() if max(peak) <= budget), rel=REL)
    assert "stage 0 (rank 0): full" in plan.explain() and "stage 1 (rank 0): none" in plan.explain()


def test_automatic_schedules_with_policies_stay_within_the_budget() -> None:
    prof, p, m = _profile(3, 8), 2, 4
    none_peak = max(search(prof, p, m, policies=["none"]).peak)
    for budget in (0.7 * none_peak, 0.55 * none_peak):  # below 0.5 nothing fits (the heads' B transients)
        plan = search(prof, p, m, budget, schedules=["zb-auto", "zbv-auto"])
        res = simulate(plan.schedule, *prof.stage_costs(plan.stages, plan.policies or None)[:2])
        static = [sum(prof.layers[i].static for s in plan.schedule.stages_on(r) for i in plan.stages[s])
                  for r in range(p)]
        assert max(x + y for x, y in zip(static, res.peak_memory)) <= budget * (1 + REL)


def test_explain_names_each_stages_policy_and_the_alternatives() -> None:
    prof, p, m = _profile(0, 6), 2, 4
    budget = 0.7 * max(search(prof, p, m, schedules=["zb-v"], policies=["none"]).peak)
    plan = search(prof, p, m, budget, schedules=["zb-v"])
    text = plan.explain()
    assert "policies (one per stage" in text
    chosen = plan.policies or ("none",) * 4
    for st in range(4):
        assert f"stage {st} (rank {plan.schedule.rank_of(st)}): {chosen[st]}  [none " in text


def test_cli_plan_chooses_policies_and_prints_them(tmp_path, capsys) -> None:
    from zbpp.cli import main

    prof, p, m = _profile(0, 6), 2, 4
    path = tmp_path / "prof.json"
    prof.save(path)
    budget = 0.55 * max(search(prof, p, m, policies=["none"]).peak)
    plan = search(prof, p, m, budget)
    assert plan.policies  # this budget needs a policy somewhere
    args = ["plan", "--profile", str(path), "-p", str(p), "-m", str(m), "--budget-gb", repr(budget / 1e9)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "policies (per stage): " + ", ".join(plan.policies) in out and "policies (one per stage" in out
    assert main(args + ["--policies", "none"]) == 0  # no recompute: the layers as they are
    out = capsys.readouterr().out
    assert "policies (per stage)" not in out and "policies (one per stage" not in out
    assert main(args + ["--policies", "none,ful"]) == 2
    assert "--policies 'none,ful': 'ful' not known" in capsys.readouterr().err  # the flag and the name


@pytest.mark.parametrize("name, p", [("zb-auto", 3), ("zbv-auto", 2), ("zbi-auto", 2)])
def test_automatic_schedules_keep_their_limit_when_b_adds_what_w_keeps(name: str, p: int) -> None:
    # recompute-like memory: F keeps 0.25, B brings W's inputs back up to 1; the builders plan as
    # if F held 1 from the start, so the simulated peak under the true memory stays within the limit
    costs = Costs(f=1, b=1.5, w=1)
    memory = Memory(activation=0.25, wgrad=1)
    opts = {"chunks": 2} if name == "zbi-auto" else {}
    for limit in (2.0, 3.0, 5.0):
        sched = build(name, num_ranks=p, num_microbatches=2 * p, costs=costs, memory=memory, memory_limit=limit, **opts)
        assert max(simulate(sched, costs, memory).peak_memory) <= limit * (1 + REL)


@pytest.mark.parametrize("name, p", [(n, 2) for n in FIXED_ONE_STAGE + FIXED_TWO] + [("zb-interleaved", 2),
                                                                                   ("1f1b", 3)])
def test_rank_peaks_from_memory_terms_are_the_simulated_ones(name: str, p: int) -> None:
    # the per-stage choice reads each rank's peak from its order's counts; the simulator is the reference
    from zbpp.schedules.policies import memory_terms, rank_peak

    sched = build(name, num_ranks=p, num_microbatches=2 * p, **({"chunks": 3} if name == "zb-interleaved" else {}))
    rng = random.Random(7)
    for _ in range(20):
        act = [rng.uniform(0, 4) for _ in range(sched.num_stages)]
        wg = [a * rng.uniform(0, 2) for a in act]  # B may add bytes (recompute) or free some
        want = simulate(sched, Costs(1, 1, 1), Memory(act, wg)).peak_memory
        for r, (mine, terms) in enumerate(memory_terms(sched)):
            assert list(mine) == list(sched.stages_on(r))
            assert rank_peak(terms, [act[s] for s in mine], [wg[s] for s in mine]) == pytest.approx(want[r], rel=REL)
