"""`zbpp.schedules.planner.search`: layers and schedule chosen together within a per-rank
memory budget that counts static memory (parameters, gradients, optimizer state).

References: per-rank static memory summed by hand from the layers each rank holds, and the
simulator's activation peak (`simulate` is tested against DESIGN.md's figures elsewhere)."""

from __future__ import annotations

import pytest

from zbpp.schedules import simulate
from zbpp.schedules.planner import evaluate, search, split_balanced, split_evenly
from zbpp.schedules.profile import Layer, Profile, Shared, transformer_profile

# float sums of task times and bytes: equal within rounding
REL = 1e-9


def _embedding_head_profile() -> Profile:
    """Four equal blocks between an embedding and a head whose parameters dominate (a large vocabulary)."""
    blocks = [Layer(f"block.{i}", f=1, b=1, w=1, activation=1, wgrad=0.5, static=1) for i in range(4)]
    return Profile([Layer("embed", 0.01, 0.01, 0.01, static=10), *blocks,
                    Layer("head", 1, 1, 1, activation=1, wgrad=0.5, static=10)])


def test_v_placement_that_fits_by_activations_is_refused_for_embedding_and_head_on_rank_0():
    prof = _embedding_head_profile()
    p, m, budget = 2, 4, 19.5
    # every V split puts stage 0 (with the embedding) and stage 3 (with the head) on rank 0: at least
    # 10 + 10 static bytes there, whatever the activations
    for split in (split_evenly(6, 4), split_evenly(6, 4, first=1, last=1), split_balanced([1] * 6, 4)):
        o = evaluate(prof, p, m, split, "zb-v", memory_budget=budget)
        activations = simulate(_schedule("zb-v", p, m), *prof.stage_costs(split)[:2]).peak_memory
        assert max(activations) <= budget  # fits by activations alone ...
        static0 = sum(prof.layers[i].static for s in (0, 3) for i in split[s])
        assert static0 >= 20 and o.peak[0] == pytest.approx(static0 + activations[0], rel=REL)
        assert not o.fits  # ... but not with the parameters, gradients and optimizer state
    with pytest.raises(ValueError, match="no schedule and split fits memory_budget"):
        search(prof, p, m, budget, schedules=["zb-v", "v-half", "v-min", "dualpipe-v", "zbv-auto"])
    plan = search(prof, p, m, budget)
    sched = plan.schedule
    assert sched.rank_of(0) != sched.rank_of(sched.num_stages - 1)  # embedding and head on different ranks
    static = [sum(prof.layers[i].static for s in plan.schedule.stages_on(r) for i in plan.stages[s]) for r in range(p)]
    assert list(plan.static) == pytest.approx(static, rel=REL)
    res = simulate(plan.schedule, *prof.stage_costs(plan.stages)[:2])
    assert [s + a for s, a in zip(static, res.peak_memory)] == pytest.approx(list(plan.peak), rel=REL)
    assert max(plan.peak) <= budget
    # without a budget ZB-V is a candidate like any other: its activations fit, its whole peak does not
    v = search(prof, p, m, schedules=["zb-v"])
    assert max(v.result.peak_memory) <= budget < max(v.peak)


def _tied_profile() -> Profile:
    """`_embedding_head_profile` with the embedding tied to the head: 9 of each one's 10 static bytes
    are one weight (the head's other byte: its norm)."""
    return Profile(_embedding_head_profile().layers, shared=[Shared("embed.weight", (0, 5), 9)])


def test_tied_weight_counts_once_on_the_rank_holding_both_its_layers():
    """A V placement puts the embedding and the head on rank 0, where a tied weight is one Parameter:
    its static bytes count once there. Reference: hand sums of the unique bytes each rank holds."""
    tied, untied = _tied_profile(), _embedding_head_profile()
    p, m, budget = 2, 4, 19.5
    split = split_evenly(6, 4)  # layers 0-1 | 2-3 | 4 | 5; V: stages 0 and 3 on rank 0
    # rank 0: embed 10 + block 1 + head 10, less the 9 counted twice; rank 1: three blocks
    assert tied.static_per_rank(split, [0, 1, 1, 0]) == [12.0, 3.0]
    assert untied.static_per_rank(split, [0, 1, 1, 0]) == [21.0, 3.0]
    o = evaluate(tied, p, m, split, "zb-v", memory_budget=budget)
    activations = simulate(_schedule("zb-v", p, m), *tied.stage_costs(split)[:2]).peak_memory
    assert o.peak == pytest.approx((12 + activations[0], 3 + activations[1]), rel=REL)
    assert o.fits and not evaluate(untied, p, m, split, "zb-v", memory_budget=budget).fits
    plan = search(tied, p, m, budget, schedules=["zb-v"])  # refused when counted twice (the test above)
    held = [{i for s in plan.schedule.stages_on(r) for i in plan.stages[s]} for r in range(p)]
    assert list(plan.static) == pytest.approx([sum(tied.layers[i].static for i in h) - 9 * ({0, 5} <= h) for h in held])
    # one stage per rank: a copy on each of two ranks, as before
    for split in (split_evenly(6, 2), split_evenly(6, 2, first=1, last=1)):
        a, b = (evaluate(x, p, m, split, "1f1b", memory_budget=budget) for x in (tied, untied))
        assert a.peak == b.peak and a.step == b.step
    # one rank, one stage holding both: counted once in the stage's static bytes too
    assert tied.stage_costs([range(0, 6)])[2] == [10 + 4 + 10 - 9]
    assert tied.static_per_rank([range(0, 6)], [0]) == [15.0]


def test_shared_static_is_checked():
    layers = _embedding_head_profile().layers
    with pytest.raises(ValueError, match="names layer 6 of 6"):
        Profile(layers, shared=[Shared("w", (0, 6), 1)])
    with pytest.raises(ValueError, match="more than layer 1's own static=1.0"):
        Profile(layers, shared=[Shared("w", (0, 1), 2)])
    with pytest.raises(ValueError, match="two or more distinct layer indices"):
        Shared("w", (3, 3), 1)


def test_pick_is_the_fastest_candidate_that_fits_and_explains_itself():
    prof = transformer_profile(name="small", num_layers=12, hidden=1024, ffn=4096, heads=16, vocab=64000, seq=2048)
    p, m, budget = 4, 8, 12e9
    plan = search(prof, p, m, budget)
    fitting = [o for o in plan.options if o.fits]
    assert plan.step == pytest.approx(min(o.step for o in fitting), rel=REL)
    assert all(max(o.peak) <= budget * (1 + REL) for o in fitting)
    assert all(max(o.peak) > budget for o in plan.options if not o.fits and o.peak)
    # the split covers the layers in order, one range per stage; names follow the profile
    assert [r.start for r in plan.stages][0] == 0 and plan.stages[-1].stop == len(prof)
    assert sum(len(n) for n in plan.names()) == len(prof)
    # no uniform split with a fixed schedule does better (the search tries them all)
    for name in ("1f1b", "zb-h1", "zb-h2"):
        o = evaluate(prof, p, m, split_evenly(len(prof), p, first=1, last=1), name, memory_budget=budget)
        assert not o.fits or o.step >= plan.step * (1 - REL)
    text = plan.explain()
    assert text.startswith("pick: ") and "rank 0: static" in text and "candidate" in text
    assert f"GB of {budget / 1e9:.2f} GB" in text.splitlines()[0]
    # without a budget the pick's line says so (it printed "of inf GB")
    assert search(prof, p, m).explain().splitlines()[0].endswith("GB (no budget)")


def test_splits_are_consecutive_and_balanced():
    assert split_balanced([5, 1, 1, 1, 1, 1], 2) == (range(0, 1), range(1, 6))
    assert split_balanced([1] * 7, 3) == (range(0, 3), range(3, 6), range(6, 7))
    got = split_balanced([3, 1, 4, 1, 5, 9, 2, 6], 3)
    best = min(max(sum(w[a:b]) for a, b in ((0, i), (i, j), (j, 8))) for i in range(1, 7) for j in range(i + 1, 8)
               for w in ([3, 1, 4, 1, 5, 9, 2, 6],))
    assert max(sum([3, 1, 4, 1, 5, 9, 2, 6][r.start:r.stop]) for r in got) == best  # brute force over all splits
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        split_evenly(2, 3)


def test_bad_input_is_named():
    prof = _embedding_head_profile()
    with pytest.raises(ValueError, match="schedule 'zb-h9' is not one"):
        search(prof, 2, 4, schedules=["zb-h9"])
    with pytest.raises(ValueError, match="the split has 3"):
        evaluate(prof, 2, 4, split_evenly(6, 3), "1f1b")
    with pytest.raises(ValueError, match="does not continue the split"):
        prof.stage_costs([range(0, 2), range(3, 6)])
    with pytest.raises(ValueError, match="need wgrad <= activation"):
        Layer("x", 1, 1, 1, activation=1, wgrad=2)


def test_sizes_past_the_task_limit_are_refused_as_build_refuses_them(monkeypatch):
    """`build` refuses a schedule of more than ZBPP_MAX_TASKS tasks. The search bounded every
    candidate first, each bound as large as its schedule (at m = 1e9 it stalled there), and with
    none buildable said that none fitted memory_budget=inf; lower_bound ran at any size."""
    from zbpp.schedules import build
    from zbpp.schedules.bounds import lower_bound
    from zbpp.schedules.ir import loop_placement

    monkeypatch.setenv("ZBPP_MAX_TASKS", "100")
    prof = _embedding_head_profile()
    with pytest.raises(ValueError, match="would create up to 800 tasks"):  # the fewest: GPipe's F, BW
        build("gpipe", num_ranks=2, num_microbatches=200)
    with pytest.raises(ValueError, match=r"num_ranks=2, num_microbatches=200: every schedule would create more "
                                         r"tasks than the limit of 100 \(the fewest: gpipe, 800\)"):
        search(prof, 2, 200)
    with pytest.raises(ValueError, match="lower_bound: 2 stages and num_microbatches=200 make 1,200 tasks"):
        lower_bound(loop_placement(2), 200)
    # where some build, the others are listed as refused and the pick is among those that build
    monkeypatch.setenv("ZBPP_MAX_TASKS", "1000")
    plan = search(prof, 2, 200, schedules=["gpipe", "zb-h1", "zb-v"])
    assert plan.schedule.name == "gpipe"
    assert {o.schedule for o in plan.options if "more than the limit of 1,000" in o.note} == {"zb-h1", "zb-v"}


@pytest.mark.parametrize("policies", [["full"], ["none", "offload"]])
def test_a_policy_no_layer_offers_is_refused(policies):
    """A profile measured without policies offers "none" only. Asked for "full", the search costed
    every stage as "none" (a layer that does not offer a policy runs as none) and then named "full"
    as each stage's policy: its step and peak were not those of the recompute it told the user to
    apply. Refused instead, naming the policy and what the profile offers (beside "none" too:
    nothing was measured to choose it by)."""
    prof = _embedding_head_profile()
    assert prof.offers() == ("none",)
    missing = next(q for q in policies if q != "none")
    with pytest.raises(ValueError, match=rf"policy '{missing}' is offered by no layer of the profile \(it offers none\)"):
        search(prof, 2, 4, policies=policies)
    assert search(prof, 2, 4, policies=["none"]).policies == ()  # what it does offer is searched


def test_profile_round_trips_through_json(tmp_path):
    prof = transformer_profile(name="t", num_layers=3, hidden=256, ffn=1024, heads=4, vocab=5000, seq=512)
    path = tmp_path / "p.json"
    prof.save(path)
    assert Profile.load(path) == prof


def test_tied_profile_round_trips_and_old_files_share_nothing(tmp_path):
    import json

    tied, path = _tied_profile(), tmp_path / "tied.json"
    tied.save(path)
    data = json.loads(path.read_text())
    assert data["shared"] == [{"name": "embed.weight", "layers": [0, 5], "static": 9.0}]
    assert Profile.load(path) == tied and Profile.load(path).shared == tied.shared
    # a file written before "shared" existed: every layer counts its static bytes in full, as then
    del data["shared"]
    path.write_text(json.dumps(data))
    old = Profile.load(path)
    assert old.shared == () and old.static_per_rank(split_evenly(6, 4), [0, 1, 1, 0]) == [21.0, 3.0]
    assert "shared" not in _embedding_head_profile().to_dict()  # nothing shared: the file as before


def _schedule(name, p, m):
    from zbpp.schedules import build

    return build(name, num_ranks=p, num_microbatches=m)


def test_cli_plan_prints_the_pick_of_search(tmp_path, capsys):
    from zbpp.cli import main

    prof = _embedding_head_profile()
    path = tmp_path / "prof.json"
    prof.save(path)
    plan = search(prof, 2, 4, 19.5e9 / 1e9)  # the CLI takes GB; this profile's bytes are tiny numbers
    assert main(["plan", "--profile", str(path), "-p", "2", "-m", "4", "--budget-gb", str(19.5 / 1e9)]) == 0
    out = capsys.readouterr().out
    assert f"pick: {plan.schedule.name}" in out
    assert "stages (layer index ranges): " + ", ".join(f"{r.start}-{r.stop - 1}" for r in plan.stages) in out
    # what it chose and why: the ranking, the coverage, the bound over every split
    assert "why: the fitting candidate with the shortest step" in out and "exact: every split under every schedule" in out
    assert f"no schedule on any split within the budget beats step {plan.searched.bound_over_splits:.6g}" in out
    assert main(["plan", "--profile", str(path), "-p", "2", "-m", "4", "--max-splits", "0"]) == 0
    assert "not exhaustive (more than" in capsys.readouterr().out
    assert main(["plan", "--profile", str(path), "-p", "2", "-m", "4", "--budget-gb", "1e-9"]) == 2
    assert "no schedule and split fits" in capsys.readouterr().err
    assert main(["plan", "--profile", str(tmp_path / "missing.json"), "-p", "2", "-m", "4"]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_each_family_alone_gives_its_own_placement():
    prof = transformer_profile(name="small", num_layers=12, hidden=512, ffn=2048, heads=8, vocab=8000, seq=512)
    for name, stages in [("zb-h1", 2), ("zbi-auto", 4), ("zb-interleaved", None), ("zbv-auto", 4), ("dualpipe-v", 4)]:
        plan = search(prof, 2, 4, schedules=[name])
        assert plan.schedule.name == name
        assert stages is None or plan.schedule.num_stages == stages
        assert len(plan.stages) == plan.schedule.num_stages


@pytest.mark.parametrize("flag, value", [("--schedules", ","), ("--schedules", ""), ("--policies", ""),
                                         ("--policies", " , ")])
def test_cli_plan_refuses_a_list_that_names_nothing(tmp_path, capsys, flag, value):
    """`--schedules ,` ended in "6 layers are too few for 2 ranks with the schedules " (none named);
    `--schedules ''` and `--policies ''` read as not given and searched every family (policy)."""
    from zbpp.cli import main

    path = tmp_path / "prof.json"
    _embedding_head_profile().save(path)
    assert main(["plan", "--profile", str(path), "-p", "2", "-m", "4", flag, value]) == 2
    captured = capsys.readouterr()
    assert f"{flag} {value!r} names nothing" in captured.err and captured.out == ""
    with pytest.raises(ValueError, match="schedules is empty"):
        search(_embedding_head_profile(), 2, 4, schedules=[])


def test_layers_that_take_no_time_explain_without_dividing_by_zero(tmp_path, capsys):
    """Four layers of zero F, B and W time (and no memory): every schedule's step is 0, worked by
    hand, so the pick's step is 0 and its runner-up (as fast) is +0.00%. Dividing by the pick's step
    used to end explain(), and so `zbpp plan`, in a ZeroDivisionError traceback."""
    prof = Profile([Layer(f"x{i}", 0, 0, 0) for i in range(4)])
    plan = search(prof, 2, 3, None, schedules=["1f1b", "zb-h1"])
    assert plan.step == 0.0
    assert "step 0 (+0.00%)" in plan.explain().splitlines()[2]  # the runner-up line
    path = tmp_path / "zero.json"
    prof.save(path)
    from zbpp.cli import main

    assert main(["plan", "--profile", str(path), "-p", "2", "-m", "3"]) == 0
    assert "runner-up:" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value, known", [("--schedules", "zb-h1,nope", "zb-h1"), ("--policies", "full,nope", "full")])
def test_cli_plan_names_the_flag_of_an_unknown_name(tmp_path, capsys, flag, value, known):
    """`--schedules nope` ended in the planner's "schedule 'nope' is not one `search` knows", which
    names no flag; now the one line names the flag, the unknown name and the choices."""
    from zbpp.cli import main

    path = tmp_path / "prof.json"
    _embedding_head_profile().save(path)
    assert main(["plan", "--profile", str(path), "-p", "2", "-m", "4", flag, value]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"zbpp plan: error: {flag} {value!r}: 'nope' not known"), captured.err
    assert known in lines[0].split("the choices are ", 1)[1] and captured.out == ""
