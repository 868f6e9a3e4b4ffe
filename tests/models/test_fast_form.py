"""The fast form of a stage (`zbpp.models.fast`): the same gradients as the eager form, its W intact,
its FP8 weight casts kept across a step's microbatches.

CPU, float64, one process. The model is a tiny random Llama (tied embedding and LM head) cut by
`causal_lm_stages` into the two stages of a one-rank zb-v schedule, so stage 1 is not the first
and its B computes an input gradient. The fast form compiles its decoder layers and its loss with
``backend="aot_eager"`` (the same graphs and autograd split as inductor, without a C++ build on
CI's CPUs); task graphs and FP8 GEMMs on a GPU: ``test_fast_form_gpu.py``.

Tolerance (gradients): within ``1e-10`` of the largest gradient, the bound `tests.models.cases`
states: the compiled regions may order float64 sums differently and W adds its weight gradients
inside the GEMM (``addmm``), each ~1e-16 relative; a lost, doubled or misplaced microbatch moves a
gradient by 1/m.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch._dynamo
from torch import nn

from zbpp import Pipeline
from zbpp.models.fast import fast_hf_stages, fast_stage
from zbpp.models.hf import causal_lm_stages
from zbpp.modules import DelayedScaling
from zbpp.modules import Linear as ZbLinear  # nn.Linear's name too
from zbpp.schedules import build

from tests.runtime.split_cases import TaskFlops

from .cases import GRAD_RTOL, SEQ, batch, config, make_schedule, reference_model

pytest.importorskip("transformers")

M, ROWS = 2, 4  # microbatches, rows per step


def _pipeline(fast: bool) -> tuple[Pipeline, dict[int, nn.Module]]:
    ref = reference_model("llama", 2)
    sched = make_schedule("zb-v", 1, M)
    stages, kwargs = causal_lm_stages(config("llama", 2), sched, 0, dtype=torch.float64, attn_implementation="eager",
                                      state_dict=ref.state_dict(), device="cpu")
    if fast:
        kwargs.update(fast_hf_stages(stages, loss_fn=kwargs["loss_fn"], backend="aot_eager"))
    return Pipeline(stages, sched, **kwargs), stages


def _grads(stages: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    return {f"{s}.{n}": p.grad.clone() for s, m in stages.items() for n, p in m.named_parameters()}


def test_fast_form_gradients_equal_eager_forms_and_w_keeps_every_weight_gemm() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ids, mask, labels = batch(ROWS, padded=True)
    inputs = {"input_ids": ids, "attention_mask": mask}
    eager_pipe, eager_stages = _pipeline(fast=False)
    fast_pipe, fast_stages = _pipeline(fast=True)
    eager_loss = eager_pipe.step(inputs, target=labels)
    with TaskFlops().installed() as flops:
        fast_loss = fast_pipe.step(inputs, target=labels)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    torch.testing.assert_close(fast_loss, eager_loss, rtol=1e-12, atol=0)
    want, got = _grads(eager_stages), _grads(fast_stages)
    assert want.keys() == got.keys()
    bound = GRAD_RTOL * max(g.abs().max() for g in want.values())
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=bound, msg=name)

    # W of stage 1 does every weight GEMM of its decoder layer and the LM head (2 x tokens x in x out
    # each, over the step's tokens) and nothing else; a compiled region that kept them would leave
    # them in B and W short
    stage = fast_stages[1]
    linears = [m for m in stage.modules() if hasattr(m, "backward_dw") and hasattr(m, "in_features")]
    assert len(linears) == 8  # q, k, v, o, gate, up, down, lm_head
    tokens = ROWS * SEQ
    assert flops.flops[(1, "W")] == sum(2 * tokens * m.in_features * m.out_features for m in linears)


def test_fast_stage_compiles_the_whole_stage_without_blocks_and_keeps_names() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.LayerNorm(8, dtype=torch.float64), nn.Linear(8, 8, dtype=torch.float64), nn.Tanh())
    stage = copy.deepcopy(eager)
    names = [n for n, _ in stage.named_parameters()]
    fast_stage(stage, backend="aot_eager")
    assert [n for n, _ in stage.named_parameters()] == names
    _assert_step_equals_eager(stage, eager, width=8)


def _assert_step_equals_eager(stage: nn.Module, eager: nn.Module, width: int) -> None:
    # one zb-h1 step of each on the same float64 batch: the compiled stage (aot_eager runs the same
    # ops) gives the eager one's loss and gradients to rounding (1e-12)
    sched = build("zb-h1", num_ranks=1, num_microbatches=2)
    x = torch.randn(4, width, dtype=torch.float64)
    losses = [Pipeline({0: m}, sched, lambda y, _: y.square().mean()).step(x) for m in (eager, stage)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    for (n, a), b in zip(stage.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-15, msg=n)


def test_fast_stage_rejects_foreign_blocks_and_bad_fp8() -> None:
    stage = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="inside the stage"):
        fast_stage(stage, blocks=[nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="fp8="):
        fast_stage(stage, fp8="e4m3")
    with pytest.raises(ValueError, match="needs fast=True"):
        fast_hf_stages({0: stage}, fast=False, fp8=True)


class _Titan(nn.Module):
    """torchtitan's layout: the blocks in a ModuleDict."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.LayerNorm(4, dtype=torch.float64),
                                                           nn.Linear(4, 4, dtype=torch.float64)) for i in range(2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = x + layer(x)
        return x


def test_fast_stage_takes_a_module_dict_of_blocks_and_names_a_lone_block() -> None:
    """``blocks=stage.layers`` of a torchtitan-style stage compiles each layer (iterating a ModuleDict
    gives its keys, which were refused as "str"); its loss and gradients equal the eager stage's
    (float64, aot_eager runs the same ops: 1e-12). One block alone is refused, naming its type."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _Titan()
    stage = copy.deepcopy(eager)
    fast_stage(stage, blocks=stage.layers, backend="aot_eager")
    for layer in stage.layers.values():  # each layer compiled (nn.Module.compile's wrapper), its Linear swapped
        assert layer._compiled_call_impl is not None and isinstance(layer[1], ZbLinear), layer
    _assert_step_equals_eager(stage, eager, width=4)
    with pytest.raises(TypeError, match="blocks is one _Titan"):
        fast_stage(_Titan(), blocks=_Titan())


class _Block(nn.Module):
    """A residual MLP block: its two GEMMs (different widths) cut it into three regions."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, dtype=torch.float64)
        self.fc1 = nn.Linear(width, 2 * width, dtype=torch.float64)
        self.fc2 = nn.Linear(2 * width, width, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def test_fast_stage_compiles_each_region_between_gemms_once() -> None:
    """Dynamo compiles a fast stage's blocks once for every block, microbatch and step: one frame
    and one graph per region between GEMMs (norm | gelu | residual add: 3), one graph break per
    zbpp layer of the block's code (2), no recompilation. A zbpp layer's own forward was compiled
    as a frame too, after its caller's graph break, only to break again (and recompile for the
    second layer's input width): 5 frames, 4 breaks. zb-v on one rank: stage 1 (the fast one) takes
    an input gradient, so its forwards run under the split backward's saved-tensor hooks. Its loss
    and gradients equal the eager stage's (float64, aot_eager runs the same ops: 1e-12)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    width, m = 8, 4
    eager = {0: nn.Linear(width, width, dtype=torch.float64), 1: nn.Sequential(_Block(width), _Block(width))}
    fast = copy.deepcopy(eager)
    fast_stage(fast[1], blocks=fast[1], backend="aot_eager")
    sched = build("zb-v", num_ranks=1, num_microbatches=m)
    pipes = [Pipeline(stages, sched, lambda y, _: y.square().mean()) for stages in (eager, fast)]
    for _ in range(2):
        x = torch.randn(2 * m, width, dtype=torch.float64)
        losses = [p.step(x) for p in pipes]
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    for s in (0, 1):
        for (n, a), b in zip(fast[s].named_parameters(), eager[s].parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-15, msg=f"{s}.{n}")
    counters = torch._dynamo.utils.counters
    assert (counters["frames"]["total"], counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())) \
        == (3, 3, 2), (dict(counters["frames"]), dict(counters["stats"]), dict(counters["graph_break"]))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_fast_hf_stages_compile_the_decoder_layers_each_stage_holds(kind: str) -> None:
    """The stages are the model's own class with what they do not hold set to None; the fast form
    finds their layers (``model.layers``, GPT-2's ``transformer.h``) and compiles each, nothing else."""
    sched = make_schedule("zb-v", 1, M)
    stages, _ = causal_lm_stages(config(kind, 3), sched, 0, dtype=torch.float64, device="cpu")
    fast_hf_stages(stages, backend="eager")
    blocks = "model.layers" if kind == "llama" else "transformer.h"
    held = {s: [n for n, _ in m.get_submodule(blocks).named_children()] for s, m in stages.items()}
    assert sorted(sum(held.values(), [])) == ["0", "1", "2"], held
    for s, m in stages.items():
        compiled = {n for n, sub in m.named_modules() if getattr(sub, "_compiled_call_impl", None) is not None}
        assert compiled == {f"{blocks}.{n}" for n in held[s]}, (s, compiled)


def test_fast_hf_stages_trace_no_frame_of_zbpp() -> None:
    """The stage hooks that take a stage's result from its last decoder layer run eagerly: the
    compiled layer calls them after its graph, and dynamo traced a frame of each (guards checked on
    every call). Over 2 steps x 4 microbatches of a one-rank zb-v (stage 0 hands its last layer's
    output on), dynamo traces the decoder layers' code and none of zbpp's (``backend="eager"``: the
    frames traced do not depend on the backend). The hooks' code is unchanged; the test of the
    gradients against the eager form is the first of this file."""
    import logging
    import os

    import zbpp

    torch._dynamo.reset()
    traced: list[str] = []

    class _Frames(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "start tracing" in record.getMessage():
                traced.append(record.getMessage())

    ids, mask, labels = batch(8, padded=True)
    sched = make_schedule("zb-v", 1, 4)
    stages, kwargs = causal_lm_stages(config("llama", 2), sched, 0, dtype=torch.float64, device="cpu",
                                      attn_implementation="eager")
    fast_hf_stages(stages, backend="eager")
    pipe = Pipeline(stages, sched, **kwargs)
    handler = _Frames()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(dynamo=logging.INFO)
    logger.addHandler(handler)
    try:
        for _ in range(2):
            pipe.step({"input_ids": ids, "attention_mask": mask}, target=labels)
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
    assert any("modeling_llama" in t for t in traced), traced  # the decoder layers were compiled
    own = os.path.dirname(zbpp.__file__)
    assert not [t for t in traced if own in t], traced


@pytest.mark.parametrize("fast", [1, 0, "yes", None])
def test_fast_that_is_not_a_bool_is_named(fast) -> None:
    """``fast=1`` or ``"yes"`` was refused as ``"fp8=False needs fast=True"``, naming the flag that was
    right, and a falsy ``0`` or None silently gave the eager form: both name `fast` now."""
    sched = make_schedule("1f1b", 1, M)
    with pytest.raises(TypeError, match=f"fast={fast!r}; pass True or False"):
        causal_lm_stages(config("llama", 2), sched, 0, dtype=torch.float64, device="cpu", fast=fast)
    with pytest.raises(TypeError, match=f"fast={fast!r}; pass True or False"):
        fast_hf_stages({0: nn.Linear(2, 2)}, fast=fast)


def test_fast_hf_stages_refuses_a_stage_not_from_causal_lm_stages() -> None:
    with pytest.raises(TypeError, match="not a stage of zbpp.models.hf.causal_lm_stages"):
        fast_hf_stages({0: nn.Sequential(nn.Linear(2, 2))})


WIDTH = 32  # 16 rows per microbatch: torch._scaled_mm runs on the CPU too


def _fp8_stage(keep: bool) -> nn.Module:
    torch.manual_seed(3)
    stage = fast_stage(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH)), compile=False,
                       fp8=DelayedScaling(amax_history_len=16))
    assert stage[0].keep_fp8_weight_casts  # what fp8 sets; the reference turns it off
    for layer in (stage[0], stage[2]):
        layer.keep_fp8_weight_casts = keep
    return stage


@pytest.mark.parametrize("name", ["zb-h1", "1f1b"])
def test_swapped_layers_cast_each_weight_once_per_step_with_the_same_result(name: str) -> None:
    """Reference: the same stage casting its weights on every microbatch. After a warm-up step (the
    weights' scales settle; no optimizer step, so the weights stay) every cast of a weight gives the
    same bytes: losses and gradients bit-identical, with one weight cast per step instead of M."""
    m = 4
    sched = build(name, num_ranks=1, num_microbatches=m)
    kept, every = _fp8_stage(True), _fp8_stage(False)
    pipes = [Pipeline({0: s}, sched, lambda y, _: y.square().mean()) for s in (kept, every)]
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        for layer in (kept[0], kept[2]):
            layer.keep_fp8_weight_casts = step > 0  # step 0 (warm-up) casts every microbatch in both
        x = torch.randn(16 * m, WIDTH, generator=gen)
        casts_before = [int((s[0].fp8_meta["weight"].amax_history != 0).sum()) if step else 0 for s in (kept, every)]
        losses = [p.step(x) for p in pipes]
        assert torch.equal(losses[0], losses[1]), step
        for (n, a), b in zip(kept.named_parameters(), every.parameters()):
            assert torch.equal(a.grad, b.grad), (step, n)
        kept.zero_grad(set_to_none=True)
        every.zero_grad(set_to_none=True)
        if step:  # the history has 16 slots: count the casts of this step
            casts = [int((s[0].fp8_meta["weight"].amax_history != 0).sum()) - c for s, c in zip((kept, every), casts_before)]
            assert casts == [1, m], casts


@pytest.mark.parametrize("family, left", [("gpt2", None), ("falcon", None),
                                          ("mixtral", "MixtralExperts x4, MixtralTopKRouter x4")])
def test_fast_form_converts_conv1d_and_linear_subclasses_and_names_what_it_leaves(family, left) -> None:
    """GPT-2's ``Conv1D`` ([in, out] weights) and Falcon's ``FalconLinear`` (an nn.Linear subclass
    computing x W^T + b) become zbpp layers, so W does their weight GEMMs; a mixture of experts'
    grouped GEMMs and routers stay, and `fast_stage` warns naming them. Against the eager form
    (generic split), float64: gradients within `GRAD_RTOL` of the largest, the bound above."""
    from tests.models.families import family_config, padded_batch

    from zbpp.modules import Linear

    torch._dynamo.reset()
    ids, mask, labels = padded_batch(ROWS)
    out = {}
    for fast in (False, True):
        sched = make_schedule("zb-h1", 1, M)
        torch.manual_seed(11)
        stages, kwargs = causal_lm_stages(family_config(family), sched, 0, dtype=torch.float64, device="cpu",
                                          attn_implementation="eager")
        if fast:
            with pytest.warns(UserWarning, match=f"not zbpp layers \\({left}\\)") if left else _no_fast_warning():
                kwargs.update(fast_hf_stages(stages, loss_fn=kwargs["loss_fn"], backend="aot_eager"))
            weights = [m for m in stages[0].modules() if getattr(m, "weight", None) is not None
                       and m.weight.dim() == 2 and not isinstance(m, nn.Embedding)]
            kept = [m for m in weights if not isinstance(m, Linear)]
            assert [type(m).__name__ for m in kept] == ([] if left is None else ["MixtralTopKRouter"] * 4)
        loss = Pipeline(stages, sched, **kwargs).step({"input_ids": ids, "attention_mask": mask}, target=labels)
        out[fast] = loss, _grads(stages)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-12, atol=0)
    want, got = out[False][1], out[True][1]
    assert want.keys() == got.keys()
    bound = GRAD_RTOL * max(g.abs().max() for g in want.values())
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=bound, msg=name)


def _no_fast_warning():
    import contextlib
    import warnings

    @contextlib.contextmanager
    def scope():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            yield
        assert not [w for w in seen if "fast_stage" in str(w.message)], [str(w.message) for w in seen]

    return scope()


@pytest.mark.slow
@pytest.mark.parametrize("kind, name", [("gpt2", "zb-v"), ("llama", "zb-h1")])
def test_fast_form_under_fsdp_equals_one_process(zbpp_workers, kind: str, name: str) -> None:
    """The fast form with every stage fully_shard-ed over 2 replicas (4 gloo ranks), two SGD steps,
    against HF's model on the whole batch: `cases.check_fast_form_under_fsdp`. GPT-2 under zb-v ties
    its embedding and LM head within rank 0, the Llama under zb-h1 across the ranks."""
    from .cases import check_fast_form_under_fsdp

    assert all(n > 0 for n in zbpp_workers(4).run(check_fast_form_under_fsdp, kind, name))


def test_fast_stage_warning_says_when_compiled_weights_get_their_gradients() -> None:
    # a weight fast_stage leaves inside a compiled block (here a plain matmul's) gets its gradient from the
    # region's one backward node: in B where the stage's input takes a gradient, in W on the first stage
    # (its input takes none: B has nothing to compute and W runs the whole backward). The warning says both.
    from zbpp.runtime._autograd_split import backward_input

    class Mix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x @ self.weight)

    stage = nn.Sequential(Mix())
    with pytest.warns(UserWarning, match=r"not zbpp layers \(Mix x1\): inside a compiled region their weight "
                                         r"gradients come with B, not W, where the stage's input takes a gradient "
                                         r"\(on the first stage, whose input takes none, W runs the whole backward"):
        fast_stage(stage, blocks=list(stage), backend="aot_eager")  # one backward node, as inductor's
    torch._dynamo.reset()
    for first in (False, True):
        stage.zero_grad(set_to_none=True)
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=not first)
        out = stage(x)
        held = backward_input([out], [torch.ones_like(out)], [] if first else [x])  # B
        assert (stage[0].weight.grad is None) == first, first
        if held is not None:
            held.run()  # W
        assert stage[0].weight.grad is not None



def _moe_fast_step(layers: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], nn.Module]:
    """One 2-microbatch step of a tiny Mixtral of `layers` MoE layers, router auxiliary loss on, all
    in one fast stage (``backend="eager"``: the frames traced do not depend on the backend; the
    experts as batched GEMMs, as on a GPU: without the eager loop's graph breaks, half the frames
    to trace), its loss, the stage's gradients and HF's model of the same weights."""
    import transformers

    from tests.models.families import family_config, padded_batch

    cfg = family_config("mixtral")
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64,
                                                        experts_implementation="batched_mm")
    sched = make_schedule("1f1b", 1, M)
    stages, kwargs = causal_lm_stages(cfg, sched, 0, dtype=torch.float64, attn_implementation="eager",
                                      experts_implementation="batched_mm", state_dict=ref.state_dict(), device="cpu")
    with pytest.warns(UserWarning, match="not zbpp layers"):  # the experts and routers, as above
        fast_hf_stages(stages, backend="eager")  # the loss eager: only the layers' frames are counted
    ids, mask, labels = padded_batch(ROWS)
    loss = Pipeline(stages, sched, **kwargs).step({"input_ids": ids, "attention_mask": mask}, target=labels)
    return loss, _grads(stages), ref


def test_fast_form_of_6_moe_layers_compiles_nothing_3_did_not_and_equals_hf() -> None:
    """HF records a router's logits by a forward hook that appends them to one list per forward.
    Traced inside each compiled decoder layer, dynamo guarded on that list's length, so every MoE
    layer recompiled its layer's code (a 6-layer stage traced 3 frames more than a 3-layer one of
    the same code) and past torch's recompile limit (8) the stage's remaining layers ran eagerly,
    with only a log line. The fast form runs the hook after the compiled layer: after a step of a
    3-layer stage, a step of a 6-layer one traces no frame. Its loss (router auxiliary term
    included) and every gradient equal HF's model in one process, per microbatch as the pipeline
    weighs them (`families._reference_loss`): float64, loss to 1e-12 and gradients within
    `GRAD_RTOL` of the largest (the summation order differs)."""
    from tests.models.families import _reference_loss, padded_batch

    loss, got, ref = _traces_nothing_more(lambda: _moe_fast_step(3), lambda: _moe_fast_step(6))
    ids, mask, labels = padded_batch(ROWS)
    want_loss, _ = _reference_loss(ref, ids, mask, labels, M, aux=True)
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-12, atol=0)
    want = {f"0.{n}": p.grad for n, p in ref.named_parameters()}
    assert want.keys() == got.keys()
    bound = GRAD_RTOL * max(g.abs().max() for g in want.values())
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=bound, msg=name)


def test_deferred_output_recorders_run_in_order_and_at_once_when_eager() -> None:
    """The deferral of HF's output-recording hooks on its own, with a stand-in recorder (a hook of
    transformers' recording module, appending to one list per forward as HF's does) on a router
    inside each of 4 compiled blocks: the list gets the routers' outputs in the order they ran,
    equal to an eager run's (the same ops: exact); the blocks' code is traced once (1 frame; it
    recompiled per block before); a router run eagerly outside its block's call (an activation
    policy's re-run calls the forward, not the block) records at once and leaves nothing held; and
    a recorder that replaces its output, which could no longer take effect, raises by name."""
    collected: list[torch.Tensor] = []

    def recorder(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        collected.append(output)

    recorder.__module__ = "transformers.utils.output_capturing"

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Tanh()
            self.router.register_forward_hook(recorder)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sin(self.router(x)) + x

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    stage = nn.Sequential(*[Block() for _ in range(4)])
    x = torch.randn(3, dtype=torch.float64)
    stage(x)
    want = list(collected)
    collected.clear()
    fast_stage(stage, blocks=stage, backend="eager")
    stage(x)
    assert len(collected) == 4 and all(torch.equal(a, b) for a, b in zip(collected, want))
    assert torch._dynamo.utils.counters["frames"]["total"] == 1, dict(torch._dynamo.utils.counters["frames"])
    collected.clear()
    stage[0].forward(x)  # eager, no block hook after it
    assert len(collected) == 1 and torch.equal(collected[0], want[0]) and stage[0]._zbpp_recorded == []
    stage[1].router._zbpp_deferred_hooks = [lambda m, a, o: o]
    with pytest.raises(RuntimeError, match="output-recording hook .* of a Tanh replaced its output"):
        stage(x)


def _raw_moe_fast_step(layers: int, late: bool = False) -> tuple[nn.Module, nn.Module, list[torch.Tensor]]:
    """HF's own tiny Mixtral of `layers` MoE layers, never run, and a copy given `fast_stage` with its
    decoder layers as blocks (``backend="eager"``, batched-GEMM experts as in `_moe_fast_step`), each
    after a forward and backward with the router auxiliary loss on the same padded batch; `late`: the
    copy's first forward records nothing (HF installs its hooks at the second, after the first trace)."""
    import transformers

    from tests.models.families import family_config, padded_batch

    cfg = family_config("mixtral")
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64,
                                                        experts_implementation="batched_mm")
    model = copy.deepcopy(ref)
    assert not getattr(model.model, "_output_capturing_hooks_installed", False)  # HF installs them at its first forward
    with pytest.warns(UserWarning, match="not zbpp layers"):
        fast_stage(model, blocks=model.model.layers, backend="eager")
    ids, mask, labels = padded_batch(ROWS)
    if late:
        model(input_ids=ids, attention_mask=mask, output_router_logits=False, use_cache=False)
        assert not getattr(model.model, "_output_capturing_hooks_installed", False)
    losses = []
    for m in (model, ref):
        out = m(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True, use_cache=False)
        out.loss.backward()
        losses.append(out.loss.detach())
    for layer in model.modules():
        if hasattr(layer, "backward_dw"):  # the zbpp layers' weight gradients: W, outside a pipeline by hand
            layer.backward_dw()
    return model, ref, losses


def test_fast_stage_of_an_hf_model_not_yet_run_compiles_nothing_more_for_more_moe_layers() -> None:
    """HF installs its output-recording hooks at a model's first forward, after `fast_stage`: they
    were not deferred and traced inside each layer (3 more frames for 6 layers than for 3, as in
    the test above). `fast_stage` defers them at a block's first call too. Loss (auxiliary term
    included) and gradients of the fast model equal HF's model (float64: gradients within
    `GRAD_RTOL` of the largest, loss to 1e-12; the fast model's GEMMs sum in another order)."""
    model, ref, (loss, want_loss) = _traces_nothing_more(lambda: _raw_moe_fast_step(3),
                                                         lambda: _raw_moe_fast_step(6))
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0)  # the same float64 ops in the forward
    bound = GRAD_RTOL * max(p.grad.abs().max() for p in ref.parameters())
    for (name, got), want in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=bound, msg=name)



def _traces_nothing_more(smaller: Callable[[], Any], larger: Callable[[], Any]) -> Any:
    """Run `smaller` from a fresh dynamo, then `larger` (the same with more layers), and return what
    `larger` returns: it must trace no frame (its layers reuse the code the first compiled)."""
    torch._dynamo.reset()
    smaller()
    torch._dynamo.utils.counters.clear()
    out = larger()
    counters = torch._dynamo.utils.counters
    assert counters["frames"]["total"] == 0, dict(counters["frames"])
    return out

def _moved_recorders(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Make HF's output-recording hooks look defined in module `where` (as after transformers moves
    them): each hook its installer registers gets that ``__module__``."""
    from transformers.utils import output_capturing

    install = output_capturing.install_output_capuring_hook

    def moved(module: nn.Module, *args: object, **kwargs: object) -> None:
        install(module, *args, **kwargs)
        next(reversed(module._forward_hooks.values())).__module__ = where

    monkeypatch.setattr(output_capturing, "install_output_capuring_hook", moved)


def test_fast_stage_defers_hf_recorders_installed_late_and_moved_within_transformers(monkeypatch) -> None:
    """HF's recorders found by what the model declares (``_can_record_outputs``: the routers, the
    attentions), not by the name of transformers' module (here moved to another one of the package):
    before, they were traced inside each layer (more frames for more layers). And a model whose first
    forward records nothing gets its hooks after the layers' first trace: dynamo does not guard on
    hooks added later, so the router logits were never recorded (HF's auxiliary loss then fails on
    an empty tuple). After 1 layer, 3 trace no frame; loss and gradients equal HF's model, as in
    `test_fast_stage_of_an_hf_model_not_yet_run_compiles_nothing_more_for_more_moe_layers`."""
    _moved_recorders(monkeypatch, "transformers.utils.recording")
    model, ref, (loss, want_loss) = _traces_nothing_more(lambda: _raw_moe_fast_step(1, late=True),
                                                         lambda: _raw_moe_fast_step(3, late=True))
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0)
    bound = GRAD_RTOL * max(p.grad.abs().max() for p in ref.parameters())
    for (name, got), want in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=bound, msg=name)


def test_fast_stage_names_a_declared_recorded_module_whose_hook_it_does_not_recognise(monkeypatch) -> None:
    """Recorders moved out of the transformers package are not recognised: traced in each layer, or
    not run at all. `fast_stage` says so, naming the model, the output, the module and the hook,
    instead of recompiling (or dropping router logits) in silence."""
    import transformers

    from tests.models.families import family_config, padded_batch

    _moved_recorders(monkeypatch, "hf_recording")
    cfg = family_config("mixtral")
    cfg.num_hidden_layers = 1
    torch._dynamo.reset()
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64,
                                                          experts_implementation="batched_mm")
    with pytest.warns(UserWarning, match="not zbpp layers"):
        fast_stage(model, blocks=model.model.layers, backend="eager")
    ids, mask, _ = padded_batch(ROWS)
    hook = r"its forward hooks: hf_recording\.install_output_capuring_hook\.<locals>\.output_capturing_hook\)"
    with pytest.warns(UserWarning, match=rf"MixtralModel records attentions from model\.layers\.0\.self_attn "
                                         rf"\(MixtralAttention; {hook}; router_logits from model\.layers\.0\.mlp\.gate "
                                         rf"\(MixtralTopKRouter; {hook}, but none of these hooks is a Hugging Face"):
        with torch.compiler.set_stance("force_eager"):  # the warning comes before the trace: none needed
            model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False)


def _raw_llama_fast_loss(layers: int, **call: object) -> tuple[nn.Module, object, object]:
    """HF's own tiny float64 Llama of `layers` layers (``config.use_cache`` on, HF's default) and a
    copy given `fast_stage` with its decoder layers as blocks (``backend="eager"``), each called on
    the same padded batch with labels and `call`, the fast copy's loss backpropagated."""
    import transformers

    from tests.models.families import family_config, padded_batch

    cfg = family_config("llama")
    cfg.num_hidden_layers = layers
    assert cfg.use_cache
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64)
    model = copy.deepcopy(ref)
    fast_stage(model, blocks=model.model.layers, backend="eager")
    ids, mask, labels = padded_batch(ROWS)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, **call)
    out.loss.backward()
    return model, out, ref(input_ids=ids, attention_mask=mask, labels=labels, **call)


def test_fast_stage_of_an_hf_model_runs_without_a_kv_cache_unless_asked() -> None:
    """HF's call with its default cache hands each decoder layer the cache and its index: every
    compiled layer recompiled (more frames for more layers). The fast form runs without a cache
    (training needs none): after 1 layer, 3 trace no frame; its loss equals HF's model, which
    builds a cache (float64, the same ops in the forward: 1e-12), and a call asking for a cache
    gets one (run eagerly: its layers would recompile)."""
    model, out, want = _traces_nothing_more(lambda: _raw_llama_fast_loss(1), lambda: _raw_llama_fast_loss(3))
    assert out.past_key_values is None and want.past_key_values is not None
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-12, atol=0)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        assert model(input_ids=want.logits.new_zeros(1, 3, dtype=torch.long), use_cache=True).past_key_values is not None
