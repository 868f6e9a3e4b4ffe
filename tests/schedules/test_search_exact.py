"""`planner.search` is exact on small cases: its pick equals the best of an exhaustive enumeration
of every split x every schedule, done here; every plan it returns re-simulates within the budget;
the bound it prints holds over every split; and the issue-41/42 cases.

Reference: each plan built here with `build` (an automatic schedule with each rank's activation
limit worked out here: the budget less the static bytes summed from that rank's layers) and
simulated with `simulate`; the best is the least bytes over the budget, then the shortest step,
then the lowest peak. Nothing here uses the search's own evaluation.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from zbpp.schedules import build, simulate
from zbpp.schedules.planner import SCHEDULES, _refine, evaluate, search
from zbpp.schedules.profile import Layer, PolicyCost, Profile, transformer_profile
from zbpp.schedules.registry import available

REL = 1e-9  # float sums of a few task times and byte counts: rounding only
GB = 1e9
AUTO = {"zb-auto", "zbv-auto", "zbi-auto"}
V = {"zb-v", "v-half", "v-min", "dualpipe-v", "zbv-auto"}


def _uneven(seed: int, num_layers: int) -> Profile:
    """A big embedding (static), blocks of slightly different cost, one heavy (MoE-like) block
    with four times the static memory, and a head with large activations (a big vocabulary)."""
    rng = random.Random(seed)
    layers = [Layer("embed", 0.01, 0.01, 0.01, static=rng.uniform(2, 4) * GB)]
    heavy = rng.randrange(1, num_layers - 1)
    for i in range(1, num_layers - 1):
        x = 3.0 if i == heavy else rng.uniform(0.8, 1.2)
        act = rng.uniform(0.3, 0.6) * GB * (2 if i == heavy else 1)
        layers.append(Layer(f"block.{i}", x, x * rng.uniform(1, 1.3), x * rng.uniform(0.6, 1), activation=act,
                            wgrad=act / 3, static=rng.uniform(0.5, 1) * GB * (4 if i == heavy else 1)))
    h = rng.uniform(1.5, 3)
    layers.append(Layer("head", h, h, h, activation=rng.uniform(2, 4) * GB, wgrad=GB, static=rng.uniform(2, 4) * GB))
    return Profile(layers, comm=0.02)


def _placement(name: str, p: int, k: int) -> list[int]:
    return list(range(p)) + list(reversed(range(p))) if name in V else [s % p for s in range(k * p)]


def _every_plan(prof: Profile, p: int, m: int, budget: float, names, fixed_cache: dict) -> list[tuple]:
    """(bytes over budget, step, peak, name, stages, per-rank peak) of every split x schedule."""
    L = len(prof)
    out = []
    for name in names:
        for k in [SCHEDULES[name]] if SCHEDULES[name] else [2, 3, 4]:
            if k * p > L:
                continue
            placement = _placement(name, p, k)
            for cuts in itertools.combinations(range(1, L), k * p - 1):
                ends = (0, *cuts, L)
                stages = tuple(range(a, b) for a, b in zip(ends, ends[1:]))
                costs, memory, _ = prof.stage_costs(stages)
                static = [sum(prof.layers[i].static for s in range(k * p) if placement[s] == r for i in stages[s])
                          for r in range(p)]
                opts = {"chunks": k} if name in {"interleaved-1f1b", "zb-interleaved", "zbi-auto"} else {}
                if name in AUTO:
                    act = [sum(prof.layers[i].activation for s in range(k * p) if placement[s] == r for i in stages[s])
                           for r in range(p)]
                    if math.isfinite(budget) and any(static[r] + act[r] > budget * (1 + REL) for r in range(p)):
                        continue  # not even one microbatch fits beside the static memory: cannot be built
                    limits = None if not math.isfinite(budget) else [budget - x for x in static]
                    sched = build(name, num_ranks=p, num_microbatches=m, costs=costs, memory=memory,
                                  memory_limit=limits, **opts)
                else:
                    key = (name, k)
                    if key not in fixed_cache:
                        fixed_cache[key] = build(name, num_ranks=p, num_microbatches=m, **opts)
                    sched = fixed_cache[key]
                res = simulate(sched, costs, memory)
                peak = [x + y for x, y in zip(static, res.peak_memory)]
                out.append((max(0.0, max(peak) - budget), res.makespan, max(peak), name, stages, peak))
    return out


def _resimulated_peak(prof: Profile, plan) -> list[float]:
    sched = plan.schedule
    res = simulate(sched, *prof.stage_costs(plan.stages, plan.policies or None)[:2])  # under the chosen policies
    static = [sum(prof.layers[i].static for s in sched.stages_on(r) for i in plan.stages[s]) for r in range(sched.num_ranks)]
    return [x + y for x, y in zip(static, res.peak_memory)]


def _check_against_enumeration(prof: Profile, p: int, m: int, budget: float, names, cache: dict) -> None:
    plans = _every_plan(prof, p, m, budget, names, cache)
    least = min(x[0] for x in plans)
    if least > 0:  # nothing fits: the search says so and names the closest plan's peak
        closest = min(x[2] for x in plans if x[0] == least)
        with pytest.raises(ValueError, match=f"no schedule and split fits.*peaks at {closest / GB:.3f} GB"):
            search(prof, p, m, budget, schedules=names)
        return
    best = min(x[1] for x in plans if x[0] == 0)
    plan = search(prof, p, m, None if not math.isfinite(budget) else budget, schedules=names)
    assert plan.step == pytest.approx(best, rel=REL), (budget, plan.explain())
    assert max(_resimulated_peak(prof, plan)) <= budget * (1 + REL)
    lowest = min(x[2] for x in plans if x[0] == 0 and x[1] <= best * (1 + REL))
    assert max(plan.peak) <= lowest * (1 + REL)  # ties in step go to the lower peak
    assert plan.searched.exact and plan.searched.bound_over_splits <= best * (1 + REL)
    # the heuristic search (no exhaustive placement) is no better, and its bound still holds for every split
    heuristic = search(prof, p, m, None if not math.isfinite(budget) else budget, schedules=names, max_splits=0)
    assert heuristic.step >= best * (1 - REL) and max(_resimulated_peak(prof, heuristic)) <= budget * (1 + REL)
    assert not heuristic.searched.exact and heuristic.searched.bound_over_splits <= best * (1 + REL)


def test_search_equals_every_split_under_every_schedule_on_a_small_uneven_profile() -> None:
    prof, p, m = _uneven(1, 8), 2, 4
    cache: dict = {}
    peaks = sorted(x[2] for x in _every_plan(prof, p, m, math.inf, [n for n in SCHEDULES if n not in AUTO], cache))
    # no budget; one that about a third of the fixed plans meet; one below every plan's peak
    for budget in (math.inf, peaks[len(peaks) // 3], 0.98 * peaks[0]):
        _check_against_enumeration(prof, p, m, budget, list(SCHEDULES), cache)


@pytest.mark.parametrize("seed, p, num_layers", [(2, 3, 9), (3, 4, 10), (4, 4, 12)])
def test_search_equals_every_split_under_one_stage_per_rank_schedules(seed: int, p: int, num_layers: int) -> None:
    # the one-stage-per-rank families with the automatic one: the enumeration stays small (C(L-1, p-1) splits)
    prof, m = _uneven(seed, num_layers), 2 * p
    names = ["gpipe", "1f1b", "zb-h1", "zb-h2", "zb-auto"]
    cache: dict = {}
    peaks = sorted(x[2] for x in _every_plan(prof, p, m, math.inf, names[:4], cache))
    for budget in (peaks[len(peaks) // 10], peaks[len(peaks) // 2], 0.98 * peaks[0]):
        _check_against_enumeration(prof, p, m, budget, names, cache)


def test_every_registered_schedule_is_searched() -> None:
    assert set(SCHEDULES) == set(available())


def _static_heavy_profile() -> Profile:
    """p = 2: the embedding alone takes 9 of a 10-byte budget; the head holds 4 static bytes, its
    stage 3-4 activation bytes per microbatch."""
    return Profile([Layer("embed", 0.1, 0.1, 0.1, static=9), Layer("block.0", 1, 1, 1, activation=1, static=0),
                    Layer("block.1", 1, 1, 1, activation=1, static=0),
                    Layer("head", 1, 1, 1, activation=2, wgrad=1, static=4)])


def test_an_automatic_schedule_gets_each_ranks_budget_less_its_own_static_memory() -> None:
    # Hand-worked: on layers 0 / 1-3, rank 1 holds 4 static bytes and 4 activation bytes per
    # microbatch (1 kept from B to W). Its limit is 10 - 4 = 6: one microbatch in flight, and W's
    # kept. Given the whole budget (10) it would keep two in flight (4 + 8 > 10 with anything
    # else); given the budget less the largest static memory (10 - 9 = 1) it could not be built.
    prof = _static_heavy_profile()
    plan = search(prof, 2, 4, 10, schedules=["zb-auto"])
    peak = _resimulated_peak(prof, plan)
    assert max(peak) <= 10 * (1 + REL) and list(plan.peak) == pytest.approx(peak, rel=REL)
    assert max(plan.result.peak_memory) > 10 - 9  # a rank used more than the largest rank's leftover
    one = evaluate(prof, 2, 4, (range(0, 1), range(1, 4)), "zb-auto", memory_budget=10)
    assert one.fits and one.peak[1] <= 10 * (1 + REL) and one.peak[1] - 4 > 10 - 9


def test_a_plan_over_the_budget_never_ranks_before_one_within_it() -> None:
    # unbounded, 1F1B on 2 / 2 is fastest but holds 2 microbatches on rank 0: 10 + 2 = 12 bytes;
    # at 11 bytes only slower plans fit, and the search returns one of them
    prof = Profile([Layer("embed", 1, 1, 1, activation=0.5, static=10), Layer("block", 1, 1, 1, activation=0.5),
                    Layer("block", 1, 1, 1, activation=1), Layer("head", 1, 1, 1, activation=1)])
    free = search(prof, 2, 4, None, schedules=["1f1b", "gpipe"])
    assert max(free.peak) > 11
    tight = search(prof, 2, 4, 11, schedules=["1f1b", "gpipe"])
    assert max(_resimulated_peak(prof, tight)) <= 11 and tight.step > free.step
    assert all(o.step >= tight.step * (1 - REL) for o in tight.options if o.fits)


def test_refinement_moves_layers_to_the_previous_stage_as_well_as_the_next() -> None:
    # four equal layers on 2 ranks under 1F1B: from 1 / 3 the best split, 2 / 2, needs a layer of
    # stage 1 moved back to stage 0; from 3 / 1, one of stage 0 moved on to stage 1
    prof = Profile([Layer(f"block.{i}", 1, 1, 1, activation=1) for i in range(4)])
    sched = build("1f1b", num_ranks=2, num_microbatches=4)
    even = evaluate(prof, 2, 4, (range(0, 2), range(2, 4)), "1f1b")
    assert even.step == pytest.approx((4 + 2 - 1) * 6, rel=REL)  # 1F1B: (m + p - 1) stage slots of F+B+W
    for start in ((range(0, 1), range(1, 4)), (range(0, 3), range(3, 4))):
        o = evaluate(prof, 2, 4, start, "1f1b")
        got = _refine(prof, "1f1b", 1, o, sched, math.inf, 2, 4)
        assert [len(r) for r in got.stages] == [2, 2] and got.step == pytest.approx(even.step, rel=REL)


def _llama_like_256k() -> Profile:
    """Nine Llama-3-8B-shaped blocks between an embedding and a head of a 256k vocabulary (the
    head's fp32 logits dominate its stage's activations). As the case was filed: a loss whose B
    allocates nothing beyond what F kept (a fused loss; an unfused one adds 8.4 GB to the head's B)."""
    return transformer_profile(name="256k", num_layers=9, hidden=4096, ffn=14336, heads=32, kv_heads=8,
                               vocab=256000, seq=4096, loss_bytes_per_logit=0)


@pytest.mark.parametrize("budget_gb", [12.25, 12.5])
def test_tight_budget_on_a_256k_vocabulary_finds_the_plan_that_fits_fast(budget_gb: float) -> None:
    # Before: "infeasible" at 12.25 GB and zb-auto on 1/5/4/1 at 2.52 s at 12.5 GB (one activation
    # limit for all ranks: the budget less the largest static memory, the head's). zb-auto on layer
    # groups 2/4/4/1 with each rank's own limit fits, at about 1.39 s.
    prof, p, m, budget = _llama_like_256k(), 4, 16, budget_gb * GB
    stages = (range(0, 2), range(2, 6), range(6, 10), range(10, 11))
    costs, memory, static_stage = prof.stage_costs(stages)
    sched = build("zb-auto", num_ranks=p, num_microbatches=m, costs=costs, memory=memory,
                  memory_limit=[budget - x for x in static_stage])
    res = simulate(sched, costs, memory)
    hand = [x + y for x, y in zip(static_stage, res.peak_memory)]
    assert max(hand) <= budget
    plan = search(prof, p, m, budget)
    assert max(_resimulated_peak(prof, plan)) <= budget * (1 + REL)
    assert plan.step <= res.makespan * (1 + REL) and plan.step < 1.5
    text = plan.explain()
    assert "exact: every split under every schedule searched" in text
    assert f"no schedule on any split within the budget beats step {plan.searched.bound_over_splits:.6g}" in text


def test_tensor_parallel_divides_block_time_memory_and_messages() -> None:
    # Hand-worked for hidden 64, ffn 256, 4 heads (kv 4), gated MLP, vocab 1000, seq 128, tp 2:
    # block weights P = 64 (2*64 + 2*64) + 3*64*256 = 65,536; T = 128 tokens; causal attention
    # 2 T s h = 2,097,152 FLOPs. Per rank (halved): F = (2 P T + 2,097,152) / 2 = 9,437,184 FLOPs,
    # B = (2 P T + 4,194,304) / 2 = 10,485,760, W = 2 P T / 2 = 8,388,608; activations
    # 2 T (8 h + 2 kv + 4 ffn) / 2 = 212,992 bytes; static 7.5 P / 2 = 245,760 bytes; head F = 2 T h V / 2 =
    # 8,192,000 FLOPs; a message 2 T h / 2 = 8,192 bytes over 50 GB/s.
    prof = transformer_profile(name="tp2", num_layers=2, hidden=64, ffn=256, heads=4, vocab=1000, seq=128,
                               tensor_parallel=2, flops_per_s=1e12, link_bytes_per_s=50e9)
    block, head = prof.layers[1], prof.layers[-1]
    assert (block.f, block.b, block.w) == pytest.approx((9_437_184e-12, 10_485_760e-12, 8_388_608e-12), rel=REL)
    assert block.activation == pytest.approx(212_992, rel=REL) and block.static == pytest.approx(245_760, rel=REL)
    assert head.f == pytest.approx(8_192_000e-12, rel=REL)
    assert prof.comm == pytest.approx(8_192 / 50e9, rel=REL)


def test_an_automatic_schedule_meets_a_budget_below_what_its_search_plans_on() -> None:
    """Full recompute keeps 1 per layer after F and re-creates 2 in B (wgrad > activation). On a V
    of 4 one-layer stages, rank 0 runs F0 F3 then B3 on top of both activations: one microbatch at a
    time peaks at 1 + 1 + 1 = 3, so a budget of 3 is feasible. The planner handed the builder each
    stage at max(1, 2) = 2 from F on and refused it ("no schedule and split fits ... 3")."""
    full = {"full": PolicyCost(1, 2, recompute=1)}
    prof = Profile([Layer(f"l{i}", 1, 1, 1, activation=4, wgrad=1, policies=full) for i in range(4)])
    plan = search(prof, 2, 4, 3.0, schedules=["zbv-auto"], policies=["full"])
    costs, memory, _ = prof.stage_costs(plan.stages, list(plan.policies))
    assert plan.policies == ("full",) * 4
    assert max(simulate(plan.schedule, costs, memory).peak_memory) <= 3.0 * (1 + REL)  # no static memory here
