"""Compiled stages (``torch.compile(stage)``, ``stage.compile()``) under zero-bubble schedules, on 2
gloo CPU ranks, float64, against one process running the eager model on the whole batch
(`tests.runtime.compiled_cases`: the model, the tolerance and the FLOP table).

What is split: zbpp's layers step out of the compiled graph, so their weight gradients still wait
for W (each W finds its microbatch's job pending, and W does exactly their weight-gradient FLOPs);
a compiled region's backward is one autograd node that computes all of its gradients in B. Neither
loses nor doubles a gradient, data-parallel and tied reductions included, and no microbatch key
makes the stage recompile.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from zbpp import Pipeline
from zbpp.modules import Linear, LayerNormMLP, microbatch
from zbpp.schedules import build

from .compiled_cases import F64, H, TOL, build_models, compiled_case

CASES = [f"{s}/{k}/{how}" for s in ("zb-h1", "zb-v") for k in ("zbpp", "torch")
         for how in ("torch.compile", "module.compile")]
CASES += ["zb-h1/zbpp/torch.compile/tied", "zb-h1/torch/torch.compile/tied", "zb-v/zbpp/module.compile/dp",
          "zb-v/zbpp/torch.compile/nosplit"]


@pytest.fixture(scope="module")
def results(zbpp_workers) -> dict[str, list[str]]:
    workers = zbpp_workers(2)
    return {c: [f"rank {r}: {f}" for r, fs in enumerate(workers.run(compiled_case, c)) for f in fs] for c in CASES}


@pytest.mark.parametrize("case", CASES)
def test_compiled_stage_matches_eager_whole_batch(results: dict[str, list[str]], case: str) -> None:
    assert not results[case], "\n".join(results[case])


@pytest.mark.slow
def test_inductor(zbpp_workers) -> None:
    """The default backend (C++ kernels on the CPU): the same gradients, zbpp layers' W deferred."""
    fails = [f"rank {r}: {f}" for r, fs in enumerate(zbpp_workers(2).run(compiled_case, "zb-h1/zbpp/inductor"))
             for f in fs]
    assert not fails, "\n".join(fails)


def test_compiled_layers_defer_w_without_recompiling() -> None:
    """One process: a compiled block of zbpp layers files one W per microbatch key (nothing in
    ``.grad`` after the backward) and compiles once for all keys; W's gradients equal eager's
    (bit for bit: the layers run the same eager code, the compiled tanh is the same aten op)."""
    torch._dynamo.reset()
    torch.manual_seed(0)

    def block() -> torch.nn.Module:
        return torch.nn.Sequential(Linear(4, 4, delay_wgrad_compute=True, params_dtype=torch.float64),
                                   torch.nn.Tanh(),
                                   LayerNormMLP(4, 8, delay_wgrad_compute=True, params_dtype=torch.float64))

    eager = block()
    model = block()
    model.load_state_dict(eager.state_dict())
    compiled = torch.compile(model, backend="aot_eager")
    xs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(5)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for j, x in enumerate(xs):
            for m in (compiled, eager):
                with microbatch(j):
                    m(x).square().sum().backward()
    for layer in (model[0], model[2]):
        assert layer.pending_wgrad_keys() == list(range(5))
        assert all(p.grad is None for p in layer.get_backward_dw_params())
    for j in range(5):
        for a, b in zip((model[0], model[2]), (eager[0], eager[2])):
            a.backward_dw(j)
            b.backward_dw(j)
    for (n, a), b in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_backward_compiled_before_the_pipeline() -> None:
    """A compiled stage whose backward first ran outside the pipeline (a warm-up), where AOTAutograd
    compiled it with donated buffers and would refuse the split B's graph-retaining engine call:
    the step runs, and its gradients equal the eager whole-batch reference (one process, zb-v on
    one rank: stage 1's input needs a gradient, so its B is split)."""
    torch._dynamo.reset()
    ref, stages = build_models("torch", 2, tied=False)
    compiled = {s: torch.compile(stages[s], backend="aot_eager") for s in (0, 1)}
    warm = torch.randn(4, H, **F64, requires_grad=True)
    compiled[1](warm).square().sum().backward()  # compiles the backward, not retaining the graph
    for st in stages:
        st.zero_grad(set_to_none=True)
    pipe = Pipeline(compiled, build("zb-v", num_ranks=1, num_microbatches=4), F.mse_loss)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, H, generator=g, **F64), torch.randn(8, H, generator=g, **F64)
    loss = pipe.step(x, target=y)
    want = F.mse_loss(ref(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), **TOL)
    for s in (0, 1):
        for (n, a), b in zip(stages[s].named_parameters(), ref[s].parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, **TOL, msg=lambda m: f"stage {s} {n}: {m}")
