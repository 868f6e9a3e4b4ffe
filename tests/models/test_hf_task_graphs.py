"""Hugging Face Llama and GPT-2 stages (`zbpp.models.hf`) under ``Pipeline(cuda_graphs=True)`` on one
GPU: three steps with two batch shapes alternating equal the same pipeline's eager steps bit for bit
(the same kernels in the same order; GPT-2's dropout too: each F replays under its microbatch's seed)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

from zbpp import Pipeline  # noqa: E402
from zbpp.models.hf import causal_lm_stages  # noqa: E402
from zbpp.modules import delay_wgrad  # noqa: E402
from zbpp.schedules import build  # noqa: E402

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=128),
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=128, n_positions=64),
}


def _run(kind: str, schedule: str, graphs: bool, delayed: bool) -> list[torch.Tensor]:
    sched = build(schedule, num_ranks=1, num_microbatches=2)
    stages, kwargs = causal_lm_stages(CONFIGS[kind](), sched, 0, device="cuda", dtype=torch.bfloat16,
                                      attn_implementation="sdpa", seed=0)
    if delayed:
        for m in stages.values():
            delay_wgrad(m, transposed=kind == "gpt2")
    pipe = Pipeline(stages, sched, cuda_graphs=graphs, **kwargs)
    params = list(pipe.parameters())
    out: list[torch.Tensor] = []
    for step in range(5):
        rows, t = (4, 16) if step % 2 == 0 else (4, 24)
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 128, (rows, t), generator=g).cuda()
        for p in params:
            p.grad = None
        out.append(pipe.step({"input_ids": ids}, target=ids))
        out += [p.grad.clone() for p in params if p.grad is not None]
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind, schedule, delayed", [("llama", "zb-h1", False), ("llama", "zb-v", True),
                                                     ("gpt2", "zb-h1", True)])
def test_hf_stages_under_task_graphs(kind: str, schedule: str, delayed: bool) -> None:
    eager, graphed = _run(kind, schedule, False, delayed), _run(kind, schedule, True, delayed)
    assert len(eager) == len(graphed)
    bad = [i for i, (a, b) in enumerate(zip(eager, graphed)) if not torch.equal(a, b)]
    assert not bad, f"entries {bad} differ (0: first loss)"
