"""FP8 on swapped Hugging Face layers: `Linear`s that read the same tensor (q, k and v; gate and
up) share one input cast, and the step is bit-identical to casting it once per `Linear`.

Reference: the same stage with sharing off (``adopted_slot`` patched to adopt nothing). Every
family's tiny random config in float64, one rank, zb-h1 over 2 microbatches, the FP8 form without
compilation (`fast_stage(stage, compile=False, fp8=True)`: the eager cast path and dequantised
GEMMs on CPUs), its gated MLPs left unfused (a fused MLP casts its input once itself). Sharing changes which slot casts, never a value: loss and gradients must be equal
bit for bit (rtol=atol=0), with fewer casts where a model feeds one tensor to several Linears.
"""

from __future__ import annotations

import pytest
import torch

from zbpp import Pipeline
from zbpp.models import fast as fast_module
from zbpp.models.fast import fast_stage
from zbpp.modules import linear as linear_module
from zbpp.modules.fp8 import cast_path_counts, reset_cast_path_counts
from zbpp.schedules import build

from .families import FAMILIES, one_rank_stages, padded_batch

pytest.importorskip("transformers")

# Families whose attention or MLP reads one tensor with several Linears (others pack q, k and v
# into one GEMM, or have no gate)
NOT_SHARING = {"gpt2", "gpt_neox", "falcon", "falcon_rotary", "bloom", "gpt_bigcode", "phi3", "persimmon", "codegen",
               "mpt"}
SHARING = set(FAMILIES) - NOT_SHARING


def _step(name: str, shared: bool, monkeypatch) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    sched = build("zb-h1", num_ranks=1, num_microbatches=2)
    stages, kwargs = one_rank_stages(name, sched)
    with monkeypatch.context() as patch:
        patch.setattr(fast_module, "fuse_gated_mlps", lambda stage: [])
        fast_stage(stages[0], compile=False, fp8=True)
    ids, mask, labels = padded_batch(4)
    with monkeypatch.context() as patch:
        if not shared:
            patch.setattr(linear_module, "adopted_slot", lambda *args: None)
        reset_cast_path_counts()
        loss = Pipeline(stages, sched, **kwargs).step({"input_ids": ids, "attention_mask": mask}, target=labels)
        casts = cast_path_counts()["eager"]
    grads = {n: p.grad for n, p in stages[0].named_parameters() if p.grad is not None}
    return loss, grads, casts


@pytest.mark.parametrize("name", FAMILIES)
def test_shared_input_casts_equal_separate_ones(name, monkeypatch):
    loss, grads, casts = _step(name, True, monkeypatch)
    ref_loss, ref_grads, ref_casts = _step(name, False, monkeypatch)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        assert torch.equal(g, ref_grads[n]), n
    assert (casts < ref_casts) == (name in SHARING), (casts, ref_casts)
