"""Copies of a tied weight that drift apart are found (`Pipeline.check_ties`) and never saved.

The tie keeps its copies equal through their gradients only; an optimizer that treats them
differently (weight decay chosen by name: the embedding's copy excluded, the LM head's decayed)
made them drift, silently, and `save_checkpoint` saved both diverged copies (`ties_cases`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .ties_cases import WEIGHT_DECAY, drift_case, reference_step
from .weights_cases import LR

transformers = pytest.importorskip("transformers")
ATOL = 1e-12  # float64; the pipeline sums the microbatches' gradients where the reference takes the whole batch


def test_copies_decayed_differently_raise_on_every_rank_before_any_write(tmp_path: Path, zbpp_workers) -> None:
    """Weight decay chosen by name: the LM head's copy is decayed, the embedding's is not. After one
    step the copies differ by lr * weight_decay * w (AdamW decays before its update, which both copies
    share): save_checkpoint used to write both copies as if fine. Now it, check_ties and
    save_pretrained raise on both ranks the same error, naming the tie, the ranks and stages, the
    largest difference and the cause, and nothing is written."""
    per_rank = zbpp_workers(2, pg_timeout=60).run(drift_case, str(tmp_path), "by name")
    # by hand: |decayed - not decayed| = lr * wd * |w before the step|, largest where |w| is
    largest = LR * WEIGHT_DECAY * per_rank[0]["before"].abs().max().item()
    for r in per_rank:
        for call in ("save_checkpoint", "check_ties", "save_pretrained"):
            text = r[call].split(" ", 1)[1]
            assert text.startswith("RuntimeError: tied parameter 'model.embed_tokens.weight' differs between its "
                                   f"copies by up to {largest:.3g}: held by global rank 0 stage 0 "
                                   "('model.embed_tokens.weight'), global rank 1 stage 1 ('lm_head.weight')"), text
            assert "weight decay chosen by name" in text and "id(p) in" in text, text
            assert text == per_rank[0]["check_ties"].split(" ", 1)[1]  # the same error on every rank
            assert float(r[call].split("s ", 1)[0]) < 10, r[call]
        assert r["files"] == [], r["files"]  # save_checkpoint wrote nothing
    assert not (tmp_path / "hf").exists()  # nor save_pretrained


def test_copies_treated_alike_pass_and_save_the_one_process_model(tmp_path: Path, zbpp_workers) -> None:
    """The tied weight left out of decay on both ranks (as HF's one-process model leaves it out: its
    only name is the embedding's): the copies stay equal, every call passes, and the saved model
    equals one process doing the same step on HF's model."""
    per_rank = zbpp_workers(2, pg_timeout=60).run(drift_case, str(tmp_path), "alike")
    for r in per_rank:
        assert all(r[c].endswith(" ok") for c in ("save_checkpoint", "check_ties", "save_pretrained")), r
        assert ".metadata" in r["files"], r["files"]
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    want = reference_step()
    for name, p in want.named_parameters():
        torch.testing.assert_close(got.get_parameter(name), p.detach(), rtol=0, atol=ATOL, msg=name)
