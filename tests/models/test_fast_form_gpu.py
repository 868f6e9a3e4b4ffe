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


def _train_sharded(shard: bool) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Three SGD steps of a tied Llama's fast form (inductor) under a one-rank zb-v (both stages, so the
    embedding and the LM head, on this GPU), each stage ``fully_shard``-ed over a mesh of this one rank
    when `shard`; the loss and every gradient (by stage and name) of each step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    config = _config()
    config.tie_word_embeddings = True
    sched = build("zb-v", num_ranks=1, num_microbatches=M)
    torch.manual_seed(3)
    stages, kwargs = causal_lm_stages(config, sched, 0, device="cuda", dtype=torch.bfloat16,
                                      attn_implementation="sdpa", fast=True)
    if shard:
        mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp", "pp"))
        for stage in stages.values():
            fully_shard(stage, mesh=mesh["dp"])
        kwargs["groups"] = mesh
    pipe = Pipeline(stages, sched, **kwargs)  # cuda_graphs="auto": eager steps for fully_shard stages
    assert pipe.cuda_graphs is not shard
    named = {f"{s}.{n}": p for s, m in stages.items() for n, p in m.named_parameters()}
    opt = torch.optim.SGD(list(pipe.parameters()), lr=1e-2)
    gen = torch.Generator().manual_seed(7)
    seen = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen).cuda()
        loss = float(pipe.step({"input_ids": ids}, target=ids))
        seen.append((loss, {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float()
                            for n, p in named.items()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return seen


def check_fast_form_under_one_rank_fsdp() -> str:
    """`_train_sharded` with and without FSDP agree (see the test); returns what differs ('' if nothing)."""
    plain, sharded = _train_sharded(False), _train_sharded(True)
    out = []
    for step, ((la, ga), (lb, gb)) in enumerate(zip(plain, sharded)):
        if abs(la - lb) > 2e-2 * abs(la):
            out.append(f"step {step}: loss {la} vs {lb}")
        scale = max(float(g.abs().max()) for g in ga.values())
        for name, g in ga.items():
            err = float((gb[name] - g).abs().max())
            if err > 2e-2 * scale:
                out.append(f"step {step}: {name} off by {err:.3g} (scale {scale:.3g})")
    return "\n".join(out)


def test_fast_form_under_fsdp_on_one_gpu(zbpp_workers) -> None:
    """The fast form (inductor, bf16) with each stage fully_shard-ed over a one-rank mesh trains as
    without FSDP: the tied embedding and LM head, one Parameter without FSDP and a sharded copy per
    stage with it (`note_parameters`), stay tied; ``cuda_graphs="auto"`` runs eager steps. bf16: the
    same products summed in another order (the tied copies' gradients added after W, the compiled
    layers' own choices), so each step's loss within 2% and each gradient within 2% of the largest;
    untied copies would miss the other use's gradient, far above."""
    (msg,) = zbpp_workers(1, backend="nccl").run(check_fast_form_under_one_rank_fsdp)
    assert not msg, msg
