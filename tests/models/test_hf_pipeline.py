"""Hugging Face GPT-2 and Llama cut by zbpp.models.hf, one training step on 2 and 4 gloo ranks
under 1f1b, zb-h1, zb-v, dualpipe-v and interleaved-1f1b: the loss and every parameter's gradient
equal one process running HF's model on the whole batch (cases.py states the tolerances), the tied
embedding found without being named, right-padded batches with ignored labels weighted by tokens,
and no rank materialising parameters of stages it does not hold."""

from __future__ import annotations

import pytest

from zbpp.testing import gpus_available

pytest.importorskip("transformers")

from .cases import check_hf_step, check_materialised_only_own_stages, has_loss_weight  # noqa: E402

SCHEDULES = ["1f1b", "zb-h1", "zb-v", "dualpipe-v", "interleaved-1f1b"]
V_PLACED = {"zb-v", "dualpipe-v"}


def _tie_holders(results: list[dict], name: str, p: int) -> list[int]:
    holders = [r for r, res in enumerate(results) if res["tied"]]
    if name in V_PLACED:
        assert holders == [0]  # stage 0 and the last stage both on rank 0: one Parameter
    else:
        assert holders == [0, p - 1], holders  # interleaved too: the last stage is on the last rank
    return holders


@pytest.mark.parametrize("name", SCHEDULES)
def test_gpt2_two_ranks(zbpp_workers, name):
    results = zbpp_workers(2).run(check_hf_step, "gpt2", name, 2)
    _tie_holders(results, name, 2)
    assert all(res["tied"] in ([], ["transformer.wte.weight"]) for res in results)
    # every parameter of the model is held by exactly one rank (the tied one by its holders)
    names = [n for res in results for n in res["names"]]
    assert "lm_head.weight" in names and "transformer.wte.weight" in names
    assert sum(res["loss"] is not None for res in results) == 1


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "interleaved-1f1b"])
def test_llama_four_ranks(zbpp_workers, name):
    results = zbpp_workers(4).run(check_hf_step, "llama", name, 4, False, 8)
    _tie_holders(results, name, 4)
    assert all(res["tied"] in ([], ["model.embed_tokens.weight"]) for res in results)


@pytest.mark.parametrize("kind,name,p", [("llama", "zb-h1", 2), ("gpt2", "zb-v", 2), ("llama", "dualpipe-v", 4)])
def test_right_padding_and_ignored_labels(zbpp_workers, kind, name, p):
    if not has_loss_weight():
        pytest.skip("needs Pipeline(..., loss_weight=) (token-weighted microbatches)")
    zbpp_workers(p).run(check_hf_step, kind, name, p, True, 2 * p)


@pytest.mark.parametrize("kind,name,p,layers", [("llama", "zb-v", 2, 4), ("gpt2", "1f1b", 4, 4)])
def test_no_rank_materialises_other_stages(zbpp_workers, kind, name, p, layers):
    results = zbpp_workers(p).run(check_materialised_only_own_stages, kind, name, p, layers)
    for r, res in enumerate(results):
        assert res["gained"] == res["held"], (r, res)  # nothing else came to life in the process
        assert res["held"] < res["whole"], (r, res)
    # the ranks hold the model between them: every parameter once, the tied one once per holder
    assert sum(res["held"] for res in results) >= results[0]["whole"]


@pytest.mark.nccl
@pytest.mark.skipif(not gpus_available(2), reason="needs 2 CUDA GPUs with NCCL")
@pytest.mark.parametrize("kind,name", [("llama", "zb-v"), ("gpt2", "1f1b"), ("llama", "interleaved-1f1b")])
def test_two_gpus(zbpp_workers, kind, name):
    # HF's sdpa attention on the GPUs; the reference is eager on the CPU (same maths, float64)
    results = zbpp_workers(2, backend="nccl").run(check_hf_step, kind, name, 2, has_loss_weight(), 4, "sdpa")
    _tie_holders(results, name, 2)
