"""The fast form on a GPU (`zbpp.models.fast`): task graphs replay exactly what its eager steps
compute, in bf16 and in FP8 with the weights' casts kept across microbatches.

A small random Llama (`causal_lm_stages(..., fast=True)`, bf16, inductor) trains three steps
with an optimizer step between them, once with the task graphs that ``fast=True`` asks for and
once without (the same compiled layers run eagerly). Task graphs replay the very kernels of an
eager step on the same values, so losses and gradients must be bit-identical (rtol = atol = 0).
With FP8 this also pins the kept weight casts: each step's first microbatch re-casts the weights the
optimizer changed; a replay that reused a stale cast would differ from the eager step.
"""

from __future__ import annotations

import pytest
import torch

from zbpp import Pipeline
from zbpp.models.hf import causal_lm_stages
from zbpp.schedules import build

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
M, ROWS, SEQ, VOCAB = 4, 8, 128, 512


def _config():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                    tie_word_embeddings=False)


def _train(fp8: bool, graphs: bool) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    sched = build("zb-h1", num_ranks=1, num_microbatches=M)
    stages, kwargs = causal_lm_stages(_config(), sched, 0, device="cuda", dtype=torch.bfloat16,
                                      attn_implementation="sdpa", fast=True, fp8=fp8)
    assert kwargs.pop("cuda_graphs") == "auto"  # measured; this test forces each form
    pipe = Pipeline(stages, sched, cuda_graphs=graphs, **kwargs)
    params = list(stages[0].parameters())
    opt = torch.optim.SGD(params, lr=1e-2)
    gen = torch.Generator().manual_seed(7)
    seen = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen).cuda()
        loss = pipe.step({"input_ids": ids}, target=ids)
        seen.append((loss.detach().clone(), [p.grad.clone() for p in params]))
        opt.step()
        opt.zero_grad(set_to_none=False)
    return seen


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_task_graphs_of_the_fast_form_equal_its_eager_steps(fp8: bool) -> None:
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9+")
    eager, graphed = _train(fp8, graphs=False), _train(fp8, graphs=True)
    for step, ((la, ga), (lb, gb)) in enumerate(zip(eager, graphed)):
        assert torch.isfinite(la) and torch.equal(la, lb), (step, la, lb)
        for i, (a, b) in enumerate(zip(ga, gb)):
            assert torch.equal(a, b), (step, i)
