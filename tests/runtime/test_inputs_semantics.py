"""Inputs and losses as Hugging Face passes them, on 2 and 4 gloo ranks (inputs_cases.py; tolerances
there): shared ``[1, T]`` tensors and `Replicated` values, a token-mean loss over a right-padded batch
(``loss_weight``, also across data-parallel replicas), and dropout that does not depend on the
schedule but differs between data-parallel replicas (replica_seed_cases.py). Single-process checks
of the splitting rules and the seed derivation come first; the last tests run on 2 GPUs with NCCL
(marked ``nccl``, skipped elsewhere)."""

from __future__ import annotations

import math

import pytest
import torch

from zbpp import Pipeline
from zbpp.runtime import Replicated, microbatch_seed
from zbpp.runtime.tree import batch_rows, split
from zbpp.schedules import build
from zbpp.testing import gpus_available

from .inputs_cases import (check_bad_losses_on_one_rank, check_dropout, check_rows_mismatch_on_one_replica, check_shared_inputs, check_token_mean,
                           check_token_mean_data_parallel, check_unused_stage_inputs, check_usage_changes_within_a_signature)
from .replica_seed_cases import BASE_SEED, check_dropout_across_replicas

SCHEDULES = ["1f1b", "zb-h1", "zb-v"]


def test_one_row_leaves_and_replicated_values_go_whole_to_every_microbatch():
    pos, table = torch.arange(4)[None], torch.randn(3, 2)
    x = {"ids": torch.arange(20).reshape(5, 4), "pos": pos, "t": Replicated(table), "n": 3}
    parts = split(x, 2)
    assert [p["ids"].shape[0] for p in parts] == [3, 2]
    for p in parts:
        assert p["pos"] is pos and p["t"] is table and p["n"] == 3
    assert batch_rows(x) == 5
    # a batch of one row: nothing to share, every leaf is split (into one microbatch)
    assert split((torch.zeros(1, 3), torch.zeros(1)), 1)[0][0].shape == (1, 3)
    # a 0-dimensional value is fine once Replicated
    assert split((torch.zeros(4), Replicated(torch.tensor(2.0))), 2)[1][1].item() == 2.0


@pytest.mark.parametrize("bad,msg", [
    ((torch.zeros(4, 2), torch.zeros(3), torch.zeros(1)), r"different sizes along dim 0 \(4 at leaf #0 and 3 at leaf #1"),
    ((torch.zeros(4), torch.tensor(1.0)), "0-dimensional.*Replicated"),
    (Replicated(torch.zeros(4)), "every tensor of the input is Replicated"),
    ((torch.zeros(1, 2), torch.zeros(1)), "1 rows along dim 0, fewer than the 3 microbatches"),
])
def test_split_errors_name_the_problem(bad, msg):
    with pytest.raises(ValueError, match=msg):
        split(bad, 3)


def test_target_rows_must_match_the_inputs():
    pipe = Pipeline({0: torch.nn.Linear(2, 1)}, build("1f1b", num_ranks=1, num_microbatches=2),
                    loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(ValueError, match="the target has 6 rows along dim 0 but the input has 8"):
        pipe.step((torch.ones(8, 2), torch.ones(1, 2)), target=torch.zeros(6, 1))


def test_loss_weight_must_give_a_scalar():
    pipe = Pipeline({0: torch.nn.Linear(2, 1)}, build("1f1b", num_ranks=1, num_microbatches=2),
                    loss_fn=torch.nn.functional.mse_loss, loss_weight=lambda y: y)
    with pytest.raises(TypeError, match=r"loss_weight must return a number or a one-element tensor.*\(2, 1\).*microbatch 0"):
        pipe.step(torch.ones(4, 2), target=torch.zeros(4, 1))


def test_all_weights_zero_gives_zero_loss_and_gradient():
    """Defined result: a batch with nothing to count adds nothing (not NaN)."""
    lin = torch.nn.Linear(2, 3, dtype=torch.float64)
    ce = lambda out, y: torch.nn.functional.cross_entropy(out, y, ignore_index=-100)  # noqa: E731
    pipe = Pipeline({0: lin}, build("zb-h1", num_ranks=1, num_microbatches=2), loss_fn=ce,
                    loss_weight=lambda y: (y != -100).sum())
    losses: list[torch.Tensor] = []
    loss = pipe.step(torch.ones(4, 2, dtype=torch.float64), target=torch.full((4,), -100), losses=losses)
    assert loss.item() == 0.0 and all(torch.isnan(v) for v in losses)
    assert torch.equal(lin.weight.grad, torch.zeros_like(lin.weight))


def test_microbatch_seeds_differ_by_every_coordinate():
    base = microbatch_seed(7, 3, 1, 2, 0)
    others = {microbatch_seed(8, 3, 1, 2, 0), microbatch_seed(7, 4, 1, 2, 0), microbatch_seed(7, 3, 2, 2, 0),
              microbatch_seed(7, 3, 1, 3, 0), microbatch_seed(7, 3, 1, 2, 1), microbatch_seed(7, 3, 2, 1, 0)}
    assert base not in others and len(others) == 6


def test_seeded_pipeline_leaves_the_callers_generator_alone_and_repeats():
    """One process, dropout: the same seed gives the same step; the caller's stream is untouched."""
    def run(seed):
        torch.manual_seed(0)
        mod = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5))
        pipe = Pipeline({0: mod}, build("1f1b", num_ranks=1, num_microbatches=2), loss_fn=lambda o, y: o.square().mean(),
                        seed=seed)
        torch.manual_seed(1)
        loss = pipe.step(torch.ones(4, 3))
        return loss, torch.rand(()), mod[0].weight.grad
    (a, ra, ga), (b, rb, gb), (c, _, _) = run(11), run(11), run(12)
    torch.manual_seed(1)
    assert torch.equal(a, b) and torch.equal(ga, gb) and ra == rb == torch.rand(())
    assert not torch.equal(a, c)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", SCHEDULES)
def test_shared_inputs_reach_every_microbatch(zbpp_workers, name, p):
    zbpp_workers(p).run(check_shared_inputs, name, p)


@pytest.mark.parametrize("empty_rows", [0, 3])
@pytest.mark.parametrize("name", SCHEDULES)
def test_token_mean_over_a_padded_batch_equals_one_process(zbpp_workers, name, empty_rows):
    counts = zbpp_workers(2).run(check_token_mean, name, 2, empty_rows)
    holder = [c for c in counts if c is not None]
    assert len(holder) == 1 and (empty_rows == 0 or holder[0][-1] == 0)


def test_token_mean_on_four_ranks(zbpp_workers):
    zbpp_workers(4).run(check_token_mean, "zb-h1", 4, 0)


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_token_mean_across_data_parallel_replicas(zbpp_workers, name):
    zbpp_workers(4).run(check_token_mean_data_parallel, name, 2)


def test_rows_mismatch_on_one_replica_raises_everywhere(zbpp_workers):
    assert zbpp_workers(4).run(check_rows_mismatch_on_one_replica, "zb-h1", 2, timeout=120) == ["ValueError"] * 4


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_dropout_does_not_depend_on_the_schedule(zbpp_workers, ckpt):
    """Each schedule equals the seeded per-microbatch reference exactly (inside the case); 1f1b
    and zb-h1 (the same two stages) give bit-identical losses and gradients; two steps of one
    pipeline draw different masks; a second pipeline with the same seed repeats the first."""
    workers = zbpp_workers(2)
    got = {name: workers.run(check_dropout, name, 2, seed=1234, ckpt=ckpt) for name in SCHEDULES}
    again = workers.run(check_dropout, "zb-h1", 2, seed=1234, ckpt=ckpt)
    for rank in range(2):
        a, b, c = got["1f1b"][rank], got["zb-h1"][rank], again[rank]
        for x, y in ((a, b), (b, c)):
            assert [None if v is None else v.item() for v in x["loss"]] == [None if v is None else v.item() for v in y["loss"]]
            for gx, gy in zip(x["grads"], y["grads"]):
                assert gx.keys() == gy.keys() and all(torch.equal(gx[k], gy[k]) for k in gx)
        assert any(not torch.equal(b["grads"][0][k], b["grads"][1][k]) for k in b["grads"][0])


def test_dropout_same_stages_same_result_whatever_the_placement(zbpp_workers):
    """The seeds depend on (step, stage, microbatch) only: zb-v's four stages on two ranks draw
    exactly what 1f1b's four stages on four ranks draw, so loss and gradients are bit-identical."""
    four = zbpp_workers(4).run(check_dropout, "1f1b", 4, seed=1234, microbatches=4)
    two = zbpp_workers(2).run(check_dropout, "zb-v", 2, seed=1234, microbatches=4)
    for step in range(2):
        merged = [{k: v for r in got for k, v in r["grads"][step].items()} for got in (four, two)]
        assert merged[0].keys() == merged[1].keys()
        assert all(torch.equal(merged[0][k], merged[1][k]) for k in merged[0]), f"step {step}"
        # the last stage: rank 3 under 1f1b, rank 0 under zb-v
        assert torch.equal(four[3]["loss"][step], two[0]["loss"][step])


def test_dropout_seed_agreed_from_rank_zero(zbpp_workers):
    """seed=None with ranks seeded differently: every rank uses global rank 0's initial seed."""
    zbpp_workers(2).run(check_dropout, "zb-v", 2, seed=None)


@pytest.mark.parametrize("seed", [BASE_SEED, None], ids=["seed-arg", "ranks-seeded-apart"])
def test_replicas_draw_their_own_dropout_masks(zbpp_workers, seed):
    """Two replicas of a one-rank zb-v pipeline (two stages) on the same batch: each equals one
    process drawing under its replica's seeds (`replica_seed_cases`), so their losses differ.
    ``seed=None`` with each rank seeding torch apart: both replicas derive from global rank 0's
    seed (one base for the job, so a checkpoint's one copy of it resumes every replica)."""
    losses = zbpp_workers(2).run(check_dropout_across_replicas, "zb-v", 1, seed)
    assert not any(math.isnan(v) for v in losses) and losses[0] != losses[1], losses


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.nccl
@pytest.mark.skipif(not gpus_available(2), reason="needs 2 CUDA GPUs with NCCL")
def test_dropout_on_nccl_follows_the_seeds(zbpp_workers, name, ckpt):
    """On CUDA the device generator is seeded per (stage, microbatch) and restored after each F."""
    zbpp_workers(2, backend="nccl").run(check_dropout, name, 2, seed=1234, ckpt=ckpt)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.nccl
@pytest.mark.skipif(not gpus_available(2), reason="needs 2 CUDA GPUs with NCCL")
def test_token_mean_on_nccl(zbpp_workers, name):
    zbpp_workers(2, backend="nccl").run(check_token_mean, name, 2, 3)


@pytest.mark.parametrize("name,use_h", [("1f1b", True), ("zb-h1", True), ("zb-v", True), ("zb-h1", False)])
def test_unused_stage_inputs_get_no_gradient_as_in_one_process(zbpp_workers, name, use_h):
    """A stage that ignores an input leaves the parameters feeding only it without .grad (None, not
    zeros), on both sides of a rank boundary and within one rank (zb-v's stages 1 -> 2); with
    ``use_h=False`` stage 1 ignores all of stage 0's float outputs, whose B then has nothing to do."""
    zbpp_workers(2).run(check_unused_stage_inputs, name, 2, use_h)


def test_a_stage_input_used_after_its_signature_learnt_it_unused_raises_everywhere(zbpp_workers):
    outs = zbpp_workers(2).run(check_usage_changes_within_a_signature, "zb-h1", 2, timeout=60)
    for rank, out in enumerate(outs):
        assert "stage 1 used its input tensors needing a gradient as [True, True] on microbatch 0, but as [True, False]" in out.get("raised", ""), (rank, out)
    assert any("as [True, False] on microbatch 0, but as [True, True]" in w for w in outs[1]["warnings"]), outs[1]
    assert outs[0]["side grad"] is not None and not outs[0]["side grad"].any()  # zeros, as warned


def test_bad_losses_on_one_rank_raises_everywhere_fast(zbpp_workers):
    """``losses`` of the wrong type on the last rank only: it raised before the start agreement and
    its peers waited in that agreement until the group's timeout. The run's timeout (60 s) is below
    the group's (the fixture's, 300 s by default): a hang fails the test."""
    outcomes = zbpp_workers(2).run(check_bad_losses_on_one_rank, "zb-h1", 2, timeout=60)
    assert outcomes[1]["result"] == "TypeError", outcomes[1]
    assert outcomes[0]["result"] == "PipelineError", outcomes[0]
    assert "global rank 1" in outcomes[0]["message"] and "losses must be a list" in outcomes[0]["message"], outcomes[0]
    assert all(o["seconds"] < 10 for o in outcomes), outcomes


def test_batch_statistics_are_each_microbatchs_as_under_gradient_accumulation():
    """A module that mixes the rows of a batch (BatchNorm in training) sees one microbatch at a time:
    loss, gradients and running statistics (moved once per microbatch, ``num_batches_tracked`` m
    times a step) equal one process running the microbatches in turn, each loss weighted 1/m
    (README), not one process on the whole batch. float64; rtol 1e-12: the same ops per
    microbatch, summed in the same order."""
    import copy

    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).double()  # noqa: E731
    stages, m = [make(), make()], 4
    turns, whole = copy.deepcopy(stages), copy.deepcopy(stages)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, dtype=torch.float64, generator=g), torch.randn(8, 3, dtype=torch.float64, generator=g)
    pipe = Pipeline(dict(enumerate(stages)), build("zb-v", num_ranks=1, num_microbatches=m),
                    loss_fn=torch.nn.functional.mse_loss)
    loss = pipe.step(x, target=y)
    want = sum(torch.nn.functional.mse_loss(turns[1](turns[0](xj)), yj) / m
               for xj, yj in zip(x.chunk(m), y.chunk(m)))
    want.backward()
    tol = {"rtol": 1e-12, "atol": 1e-14}
    torch.testing.assert_close(loss, want.detach(), **tol)
    for a, b in zip(stages, turns):
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda msg, n=n: f"{n}: {msg}")
        for (n, t), u in zip(a.named_buffers(), b.buffers()):
            torch.testing.assert_close(t, u, **tol, msg=lambda msg, n=n: f"{n}: {msg}")
        assert int(a[1].num_batches_tracked) == m
    # and that is not the whole batch's
    torch.nn.functional.mse_loss(whole[1](whole[0](x)), y).backward()
    assert not torch.allclose(stages[0][0].weight.grad, whole[0][0].weight.grad, rtol=1e-3)


def test_microbatch_losses_come_in_microbatch_order_whatever_the_schedule_runs():
    """A valid schedule may run the last stage's forwards out of microbatch order (here 2, 0, 1):
    ``losses=`` still lists microbatch 0's loss first (they came in the order the forwards ran),
    and the step's loss is the whole batch's. float64, one Linear: rtol=1e-12 covers summation order."""
    from zbpp.schedules.dag import validate
    from zbpp.schedules.ir import Action, Schedule

    order = tuple(map(Action.parse, ["F0.2", "BW0.2", "F0.0", "F0.1", "BW0.1", "BW0.0"]))
    sched = validate(Schedule(1, 1, 3, (0,), (order,)))
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1, dtype=torch.float64)
    pipe = Pipeline({0: lin}, sched, loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)
    losses: list[torch.Tensor] = []
    loss = pipe.step(x, target=y, losses=losses)
    with torch.no_grad():
        want = [torch.nn.functional.mse_loss(lin(a), b) for a, b in zip(torch.tensor_split(x, 3), torch.tensor_split(y, 3))]
        whole = torch.nn.functional.mse_loss(lin(x), y)
    assert len(losses) == 3
    for j, (got, exp) in enumerate(zip(losses, want)):
        torch.testing.assert_close(got, exp, rtol=1e-12, atol=0, msg=lambda s: f"microbatch {j}: {s}")
    torch.testing.assert_close(loss, whole, rtol=1e-12, atol=0)


def test_eval_step_stacks_zero_dim_outputs_one_per_microbatch():
    """The last stage returns its rows, a 0-dim per-microbatch statistic and a non-tensor value.
    The rows equal one process's forward of the whole batch; the statistic has no rows to
    concatenate, so it comes back stacked, one per microbatch (it was the first microbatch's alone,
    which is neither the batch's value nor the others'). float64: rtol=1e-12 covers GEMM order."""
    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2, dtype=torch.float64)

        def forward(self, x: torch.Tensor, flag: bool) -> dict:
            h = self.lin(x) * (2 if flag else 1)
            return {"h": h, "aux": h.square().mean(), "n": 7}

    torch.manual_seed(0)
    head = Head()
    pipe = Pipeline({0: head}, build("1f1b", num_ranks=1, num_microbatches=3), loss_fn=lambda o, y: o["h"].mean())
    x = torch.randn(7, 3, dtype=torch.float64)
    out = pipe.eval_step({"x": x, "flag": True})
    with torch.no_grad():
        whole = head(x, True)
        per_mb = torch.stack([head(part, True)["aux"] for part in torch.tensor_split(x, 3)])
    torch.testing.assert_close(out["h"], whole["h"], rtol=1e-12, atol=0)
    assert out["aux"].shape == (3,) and out["n"] == 7
    torch.testing.assert_close(out["aux"], per_mb, rtol=1e-12, atol=0)


@pytest.mark.parametrize("bad,shown", [(-1, "-1.0"), (float("nan"), "nan"), (torch.tensor(-2), "-2.0")])
def test_loss_weight_must_be_non_negative_and_finite(bad, shown):
    """Microbatch 1 weighs `bad`, microbatch 0 weighs 3: the factors were 3/(3+w) and w/(3+w), a
    plausible but wrong loss for w=-1 (1.5 and -0.5). A CPU value is refused by name; on an
    accelerator (not read: the device would be waited for) the factors become NaN."""
    from zbpp.runtime.loss_weights import weight_factors

    pipe = Pipeline({0: torch.nn.Linear(2, 1)}, build("1f1b", num_ranks=1, num_microbatches=2),
                    loss_fn=torch.nn.functional.mse_loss, loss_weight=lambda y: 3 if y[0, 0] == 0 else bad)
    with pytest.raises(ValueError, match=f"non-negative finite weight, got {shown} for microbatch 1"):
        pipe.step(torch.ones(4, 2), target=torch.tensor([[0.0], [0.0], [1.0], [1.0]]))
    assert all(q.grad is None for q in pipe.parameters()), "a rejected step touched a gradient"
    factors, _ = weight_factors(torch.tensor([3.0, float(bad)], dtype=torch.float64))
    assert all(torch.isnan(f) for f in factors), factors


def test_eval_step_returns_a_shared_one_row_output_once():
    """zb-v's two stages pass a shared ``[1, T]`` ``pos`` along (as HF's position_ids) and the last
    returns it beside its rows and a one-row statistic of each microbatch. The rows equal one
    process's forward of the whole batch, ``pos`` comes back ``[1, T]`` as there (it came back once
    per microbatch, ``[3, T]``), and the statistic, which differs between microbatches, one row per
    microbatch. float64: rtol=1e-12 covers GEMM order."""
    T = 4

    class First(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pemb = torch.nn.Embedding(T, T, dtype=torch.float64)

        def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple:
            return x + self.pemb(pos).sum(1), pos

    class Last(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(T, 2, dtype=torch.float64)

        def forward(self, h: torch.Tensor, pos: torch.Tensor) -> dict:
            y = self.lin(h)
            return {"y": y, "pos": pos, "stat": y.mean(0, keepdim=True)}

    torch.manual_seed(0)
    first, last = First(), Last()
    sched = build("zb-v", num_ranks=1, num_microbatches=3)
    pipe = Pipeline({0: first, 1: last}, sched, loss_fn=lambda o, y: o["y"].mean())
    x, pos = torch.randn(7, T, dtype=torch.float64), torch.arange(T)[None]
    out = pipe.eval_step((x, pos))
    with torch.no_grad():
        whole = last(*first(x, pos))
        stats = torch.cat([last(*first(part, pos))["stat"] for part in torch.tensor_split(x, 3)])
    torch.testing.assert_close(out["y"], whole["y"], rtol=1e-12, atol=0)
    assert torch.equal(out["pos"], whole["pos"]), out["pos"].shape
    torch.testing.assert_close(out["stat"], stats, rtol=1e-12, atol=0)


def test_a_mapping_that_is_no_dict_is_split_as_a_dict():
    """A tokenizer's ``BatchEncoding`` is a ``UserDict``, not a dict: it was taken for one opaque
    value and refused as holding no tensor. Split as a dict (the stage gets keywords), loss and
    gradients equal one process on the whole batch (float64: rtol=1e-12 covers summation order)."""
    from collections import UserDict

    torch.manual_seed(0)
    emb = torch.nn.Embedding(5, 3, dtype=torch.float64)

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = emb

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.emb(input_ids) * attention_mask[..., None]

    ids = torch.randint(0, 5, (5, 4), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(4)[None] < torch.tensor([4, 3, 4, 2, 1])[:, None]).long()
    pipe = Pipeline({0: Stage()}, build("zb-h1", num_ranks=1, num_microbatches=2), loss_fn=lambda o, y: o.square().mean())
    loss = pipe.step(UserDict({"input_ids": ids, "attention_mask": mask}))
    got, emb.weight.grad = emb.weight.grad, None
    want = (emb(ids) * mask[..., None]).square().mean()
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(got, emb.weight.grad, rtol=1e-12, atol=0)


def test_tensors_hidden_in_another_value_are_refused_unless_replicated():
    """A dataclass (or any object) holding the batch's tensors was taken for one opaque value: every
    microbatch got it whole, all the batch's rows, silently. It is refused, naming its type; wrapped
    in `Replicated` it is shared on purpose and goes whole, as before."""
    import dataclasses

    @dataclasses.dataclass
    class Extra:
        rows: torch.Tensor

    class Holder:
        def __init__(self) -> None:
            self.table = [torch.zeros(4, 2)]

    for hidden, name in ((Extra(torch.zeros(4, 7)), "Extra"), (Holder(), "Holder")):
        with pytest.raises(ValueError, match=f"the input holds tensors inside a value of type {name}, which would go whole"):
            split({"x": torch.zeros(4, 3), "extra": hidden}, 2)
    shared = Extra(torch.zeros(3))
    assert all(p["extra"] is shared for p in split({"x": torch.zeros(4, 3), "extra": Replicated(shared), "flag": True}, 2))


def test_eval_step_refuses_an_output_whose_rows_are_not_first():
    """The last stage returns its rows beside a per-layer stack ``[L, rows, H]`` (rows second). Put
    together along dim 0 this was ``[3 L, ...]`` with each microbatch's rows split across it: a
    tensor of plausible shape matching nothing of one process's ``[L, 7, H]``. The microbatches'
    rows (3, 2, 2) do not divide L = 4, so it is refused, naming the leaf; token-major leaves
    (``[rows * T, ...]``) still merge, equal to one process's (float64: rtol=1e-12, GEMM order)."""
    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2, dtype=torch.float64)

        def forward(self, x: torch.Tensor) -> tuple:
            h = self.lin(x)
            return h, h.repeat_interleave(2, dim=0), torch.stack([h] * 4)

    torch.manual_seed(0)
    head = Head()
    pipe = Pipeline({0: head}, build("1f1b", num_ranks=1, num_microbatches=3), loss_fn=lambda o, y: o[0].mean())
    x = torch.randn(7, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"output tensor 2 .*dim 0 per microbatch: \[4, 4, 4\]; rows per microbatch: \[3, 2, 2\]"):
        pipe.eval_step(x)

    class TokenMajor(Head):
        def forward(self, x: torch.Tensor) -> tuple:
            return super().forward(x)[:2]

    token_major = TokenMajor()
    token_major.load_state_dict(head.state_dict())
    pipe = Pipeline({0: token_major}, build("1f1b", num_ranks=1, num_microbatches=3), loss_fn=lambda o, y: o[0].mean())
    out = pipe.eval_step(x)
    with torch.no_grad():
        h = head.lin(x)
    torch.testing.assert_close(out[0], h, rtol=1e-12, atol=0)
    torch.testing.assert_close(out[1], h.repeat_interleave(2, dim=0), rtol=1e-12, atol=0)
