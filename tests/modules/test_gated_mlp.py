"""`fuse_gated_mlps`: a Hugging Face gated MLP run as one FP8 layer.

Reference: the layer function every zbpp MLP runs (`_layer_function.run_layer`, tested against
float64 in test_mlp_fp8), without a norm, with fc1 a Parameter holding ``[gate; up]`` stacked and
fc2 down's weight, eager. The fused MLP makes the same casts with slots in the same states and the
same GEMMs, so its output and every gradient are bit-identical to it, step after step while the
delayed scales move: on the CPU (the eager casts and torch._scaled_mm, 16-row multiples) and on a
Hopper GPU (the fused Triton kernels and cuBLASLt).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zbpp.modules import DelayedScaling, Linear, delay_wgrad, fp8_autocast, fuse_gated_mlps, microbatch
from zbpp.modules._activations import ACTIVATIONS
from zbpp.modules._fp8_weight_cache import Fp8WeightCache
from zbpp.modules._layer_function import Fp8Slots, GemmCall, LayerSpec, run_layer
from zbpp.modules.fp8 import ScalingMeta

HIDDEN, FFN, ROWS = 32, 64, 16
RECIPE = DelayedScaling(amax_history_len=4)


class GatedMLP(nn.Module):
    """Hugging Face's LlamaMLP, as transformers writes it (`act` chooses its activation, `swap`
    feeds the activation up's output instead of gate's: a different MLP of the same parts)."""

    def __init__(self, act: nn.Module, bias: bool = False, swap: bool = False, clamp: bool = False,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=bias)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=bias)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=bias)
        self.act_fn, self.swap = act, swap
        self.clamp, self.dropout = clamp, nn.Dropout(dropout)

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.swap:
            gate, up = up, gate
        if self.clamp:  # GPT-OSS's limit
            gate = gate.clamp(max=7.0)
        return self.dropout(self.down_proj(self.act_fn(gate) * up))  # SeedOss's residual dropout

    def fc1_weight(self) -> torch.Tensor:
        return torch.cat([self.gate_proj.weight, self.up_proj.weight])

    def fc1_grad(self) -> torch.Tensor:
        return torch.cat([self.gate_proj.weight.grad, self.up_proj.weight.grad])

    def fc1_layers(self) -> list[nn.Module]:
        return [self.gate_proj, self.up_proj]


class PackedMLP(nn.Module):
    """Hugging Face's Phi3MLP: gate and up packed in one layer (gate's rows first), `swap` taking
    the halves the other way round."""

    def __init__(self, act: nn.Module, bias: bool = False, swap: bool = False, clamp: bool = False,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(HIDDEN, 2 * FFN, bias=bias)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=bias)
        self.activation_fn, self.swap = act, swap
        self.clamp, self.dropout = clamp, nn.Dropout(dropout)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.swap:
            gate, up = up, gate
        if self.clamp:
            gate = gate.clamp(max=7.0)
        return self.dropout(self.down_proj(up * self.activation_fn(gate)))

    def fc1_weight(self) -> torch.Tensor:
        return self.gate_up_proj.weight

    def fc1_grad(self) -> torch.Tensor:
        return self.gate_up_proj.weight.grad

    def fc1_layers(self) -> list[nn.Module]:
        return [self.gate_up_proj]


FORMS = {"stacked": GatedMLP, "packed": PackedMLP}


def _slots(device) -> Fp8Slots:
    meta = [ScalingMeta(d, history_len=RECIPE.amax_history_len, device=device)
            for d in (RECIPE.fwd_dtype, RECIPE.fwd_dtype, RECIPE.bwd_dtype)]
    return Fp8Slots(RECIPE, *meta, Fp8WeightCache(), None)


class Reference:
    """The MLP as `run_layer` computes it: fc1 = [gate; up] in one Parameter, eager wgrad."""

    def __init__(self, mlp: GatedMLP | PackedMLP, act: str) -> None:
        self.w1 = nn.Parameter(mlp.fc1_weight().detach().clone())
        self.w2 = nn.Parameter(mlp.down_proj.weight.detach().clone())
        device = mlp.down_proj.weight.device
        self.slots = (_slots(device), _slots(device))
        self.act = ACTIVATIONS[act]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        fc1 = GemmCall(self.w1, None, "w1", "b1", False, self.slots[0])
        fc2 = GemmCall(self.w2, None, "w2", "b2", False, self.slots[1])
        return run_layer(x, LayerSpec(fc1, fc2, None, 0.0, self.act, None, None, RECIPE))


ACTS = [("swiglu", nn.SiLU()), ("geglu", nn.GELU(approximate="tanh"))]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("act, act_fn", ACTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_fused_mlp_equals_the_layer_function_on_stacked_weights(form, act, act_fn, dtype) -> None:
    _fused_equals_layer_function(FORMS[form], act, act_fn, dtype, "cpu")


@pytest.mark.parametrize("form", FORMS)
def test_fusing_after_delay_wgrad_equals_fusing_before(form) -> None:
    # fuse_gated_mlps takes zbpp Linears too ("call it before or after delay_wgrad"); called
    # inside fp8_autocast, its probe runs them outside FP8, leaving their scaling slots fresh:
    # bit-identical to the reference from the first step on
    _fused_equals_layer_function(FORMS[form], "swiglu", nn.SiLU(), torch.float32, "cpu",
                                 delay_first=True)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("act, act_fn", ACTS)
def test_gpu_fused_mlp_equals_the_layer_function_on_stacked_weights(form, act, act_fn) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from zbpp.modules import _fused

    _fused.reset_fused_path_counts()
    _fused_equals_layer_function(FORMS[form], act, act_fn, torch.bfloat16, "cuda")
    counts = _fused.fused_path_counts()
    assert counts["act_triton"] > 0 and counts["dact_triton"] > 0, counts  # the kernels ran


def _fused_equals_layer_function(kind, act, act_fn, dtype, device, delay_first=False) -> None:
    torch.manual_seed(0)
    mlp = kind(act_fn).to(device, dtype)
    ref = Reference(mlp, act)
    if delay_first:
        delay_wgrad(mlp)
        with fp8_autocast(fp8_recipe=RECIPE):
            assert fuse_gated_mlps(mlp) == [""]
    else:
        assert fuse_gated_mlps(mlp) == [""]
        delay_wgrad(mlp)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):  # the delayed scales move: each step casts with the last one's amaxes
        x = torch.randn(2, ROWS // 2, HIDDEN, generator=gen).to(device, dtype).requires_grad_()
        dy = torch.randn(2, ROWS // 2, HIDDEN, generator=gen).to(device, dtype)
        x_ref = x.detach().clone().requires_grad_()
        with fp8_autocast(fp8_recipe=RECIPE):
            with microbatch(step):
                y = mlp(x)
            y_ref = ref(x_ref)
        assert torch.equal(y, y_ref), step
        y.backward(dy)
        y_ref.backward(dy)
        assert torch.equal(x.grad, x_ref.grad), step
        for layer in (*mlp.fc1_layers(), mlp.down_proj):  # B filed each layer's own job
            assert layer.pending_wgrad_keys() == [step]
            layer.backward_dw(step)
        assert torch.equal(mlp.fc1_grad(), ref.w1.grad), step
        assert torch.equal(mlp.down_proj.weight.grad, ref.w2.grad), step
        for p in (*mlp.parameters(), ref.w1, ref.w2):
            p.grad = None
    # FP8 ran (not a 16-bit GEMM): close to the MLP in float64, not equal to it
    x = torch.randn(ROWS, HIDDEN, generator=gen)
    want = kind(act_fn).double()
    want.load_state_dict(mlp.state_dict())
    want = want(x.double())
    with fp8_autocast(fp8_recipe=RECIPE):
        got = mlp(x.to(device, dtype)).double().cpu()
    err = ((got - want).norm() / want.norm()).item()
    assert 1e-4 < err < 0.1, err


@pytest.mark.parametrize("case", ["outside fp8", "activation replaced"])
def test_a_fused_mlp_runs_the_models_own_forward_where_it_does_not_fuse(case) -> None:
    # outside FP8, or after its activation was replaced (the probe checked the old one)
    torch.manual_seed(0)
    mlp, plain = GatedMLP(nn.SiLU()), GatedMLP(nn.SiLU())
    plain.load_state_dict(mlp.state_dict())
    fuse_gated_mlps(mlp)
    delay_wgrad(mlp)
    if case == "activation replaced":
        mlp.act_fn = plain.act_fn = nn.ReLU()
    x = torch.randn(ROWS, HIDDEN)
    with fp8_autocast(enabled=case != "outside fp8", fp8_recipe=RECIPE):
        y = mlp(x)
    assert torch.equal(y, plain(x)) == (case == "outside fp8")  # FP8 Linears, not the fused layer
    if case == "activation replaced":  # the ReLU ran: within FP8's error of the model in float32
        # (0.05 + 20%: e4m3 through three GEMMs); the fused SiLU would be up to 0.2 off
        torch.testing.assert_close(y, plain(x), rtol=0.2, atol=0.05)
        return
    y.sum().backward()
    plain(x).sum().backward()
    for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        layer.backward_dw()
    for a, b in zip(mlp.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("hook", ["forward", "forward pre", "full backward", "global forward", "on the activation"])
def test_a_hook_on_a_layer_turns_the_fused_path_off(hook) -> None:
    # the fused layer calls neither gate, up nor down: with a hook on one, the model's own forward
    # runs (the hook fires), bit-identical to the same MLP never fused (the fused one casts gate and
    # up with one scale: it would differ)
    torch.manual_seed(0)
    mlp, unfused = GatedMLP(nn.SiLU()), GatedMLP(nn.SiLU())
    unfused.load_state_dict(mlp.state_dict())
    assert fuse_gated_mlps(mlp) == [""]
    delay_wgrad(mlp)
    delay_wgrad(unfused)
    calls = []
    seen = lambda *args: calls.append(hook)  # noqa: E731
    handle = {"forward": lambda: mlp.down_proj.register_forward_hook(seen),
              "forward pre": lambda: mlp.gate_proj.register_forward_pre_hook(seen),
              "full backward": lambda: mlp.up_proj.register_full_backward_hook(seen),
              "global forward": lambda: torch.nn.modules.module.register_module_forward_hook(
                  lambda m, *a: calls.append(hook) if m is mlp.down_proj else None),
              "on the activation": lambda: mlp.act_fn.register_forward_hook(seen)}[hook]()
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    try:
        with fp8_autocast(fp8_recipe=RECIPE):
            y, y_ref = mlp(x), unfused(x)
        y.sum().backward()
    finally:
        handle.remove()
    assert calls
    assert torch.equal(y, y_ref)


class _TakesMore(nn.Module):
    # an activation of another signature: the probe's call raises, which refuses the module
    def forward(self, x, scale):
        return torch.nn.functional.silu(x) * scale


class _ClampedSilu(nn.Module):
    # SiLU up to 10, then flat: equal to SiLU where most probes would look
    def forward(self, x):
        return torch.nn.functional.silu(x).clamp(max=10.0)


WHY_NOT = ["other order", "relu", "bias", "meta", "raises", "clamp", "clamped activation", "dropout",
           "dropout, eval mode", "zero weights", "dropout, zero down weights"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("why", WHY_NOT)
def test_only_mlps_of_the_form_are_fused(form, why) -> None:
    torch.manual_seed(0)
    act = {"relu": nn.ReLU(), "raises": _TakesMore(), "clamped activation": _ClampedSilu()}.get(why, nn.SiLU())
    mlp = FORMS[form](act, bias=why == "bias", swap=why == "other order", clamp=why == "clamp",
                      dropout=0.1 if why.startswith("dropout") else 0.0)
    if why == "meta":
        mlp = mlp.to("meta")
    if why == "dropout, eval mode":  # as from_pretrained returns a model: the dropout runs once training
        mlp.eval()
    # zero weights: nothing tells the forward from the formula (the dropout's zeros stay zeros)
    for layer in {"zero weights": mlp.fc1_layers(), "dropout, zero down weights": [mlp.down_proj]}.get(why, []):
        nn.init.zeros_(layer.weight)
    rng = torch.get_rng_state()
    assert fuse_gated_mlps(mlp) == []
    assert type(mlp) is FORMS[form]
    # the probe left the random state and the modes as they were
    assert torch.equal(torch.get_rng_state(), rng)
    assert mlp.training == mlp.dropout.training == (why != "dropout, eval mode")


class _NormedMLP(GatedMLP):
    # a batch norm before the MLP: not the formula, and in training mode the probe's calls would
    # move its running statistics
    def __init__(self) -> None:
        super().__init__(nn.SiLU())
        self.norm = nn.BatchNorm1d(HIDDEN)

    def forward(self, x):
        return super().forward(self.norm(x))


@pytest.mark.parametrize("case", ["fused", "dropout", "batch norm"])
@pytest.mark.parametrize("training", [True, False])
def test_the_probe_leaves_modes_random_state_and_buffers_as_they_were(case, training) -> None:
    # the probe runs the forward in both modes: a dropout draws numbers in one (and is refused)
    torch.manual_seed(0)
    mlp = _NormedMLP() if case == "batch norm" else GatedMLP(nn.SiLU(), dropout=0.1 if case == "dropout" else 0.0)
    mlp.train(training)
    rng, buffers = torch.get_rng_state(), [b.clone() for b in mlp.buffers()]
    assert fuse_gated_mlps(mlp) == ([""] if case == "fused" else [])
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(mlp.buffers(), buffers))
    assert all(m.training == training for m in mlp.modules())


def test_a_module_hooked_when_fusing_is_left_alone_and_its_hook_sees_nothing() -> None:
    mlp = GatedMLP(nn.SiLU())
    calls = []
    mlp.up_proj.register_forward_hook(lambda *args: calls.append(1))
    assert fuse_gated_mlps(mlp) == []
    assert calls == []  # no probe ran through it


def _fused_delayed_keeping_casts() -> GatedMLP:
    # a fused, delayed-wgrad MLP whose layers keep their FP8 weight casts across a step (seed 0)
    torch.manual_seed(0)
    mlp = GatedMLP(nn.SiLU())
    fuse_gated_mlps(mlp)
    delay_wgrad(mlp)
    for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        layer.keep_fp8_weight_casts = True
    return mlp


def test_a_fused_mlp_keeps_its_stacked_cast_for_the_steps_later_microbatches() -> None:
    # is_first_microbatch read from gate (True on microbatch 0, then False): one cast of [gate; up] a
    # step, reused while both weights stay the same tensors at the same version
    mlp = _fused_delayed_keeping_casts()
    slot_casts = []
    with fp8_autocast(fp8_recipe=RECIPE):
        for j in range(3):
            with microbatch((0, j)):
                mlp(torch.randn(ROWS, HIDDEN))
            slot_casts.append(mlp.gate_proj.fp8_meta["weight"].casts)
        assert slot_casts == [1, 1, 1]
        with torch.no_grad():
            mlp.up_proj.weight.mul_(2)  # an optimizer step: the kept cast is stale
        with microbatch((0, 1)):
            mlp(torch.randn(ROWS, HIDDEN))
        assert mlp.gate_proj.fp8_meta["weight"].casts == 2
    mlp.gate_proj.release_step_caches()
    assert not mlp.gate_proj._fp8_weight_casts["gate_up_proj"].kept


def test_a_deep_copy_of_a_fused_mlp_reuses_its_own_stacked_cast() -> None:
    """A deep copy taken after a step's first microbatch computes what the original computes: it
    reuses its copy of the kept [gate; up] cast (made with the fresh slot's scale 1: a copy that
    cast again, with the stepped scale, gives other outputs). Reference: the original,
    uninterrupted; bit for bit (the same CPU operations on the same values). The copy shares
    nothing mutable: an in-place update of its up weight makes only its own cast stale."""
    import copy

    mlp = _fused_delayed_keeping_casts()
    xs = [torch.randn(ROWS, HIDDEN) for _ in range(3)]
    with fp8_autocast(fp8_recipe=RECIPE), microbatch((0, 0)):
        mlp(xs[0])
    twin = copy.deepcopy(mlp)
    results = []
    for model in (mlp, twin):
        outs = []
        for j in (1, 2):
            with fp8_autocast(fp8_recipe=RECIPE), microbatch((0, j)):
                y = model(xs[j])
            y.square().sum().backward()
            for layer in (model.gate_proj, model.up_proj, model.down_proj):
                layer.backward_dw((0, j))
            outs.append(y.detach())
        results.append((outs, [p.grad for p in model.parameters()]))
    (outs, grads), (twin_outs, twin_grads) = results
    assert all(torch.equal(a, b) for a, b in zip(outs, twin_outs))
    assert all(torch.equal(a, b) for a, b in zip(grads, twin_grads))
    assert twin.gate_proj.fp8_meta["weight"].casts == mlp.gate_proj.fp8_meta["weight"].casts == 1
    with torch.no_grad():
        twin.up_proj.weight.mul_(2)
    for model in (mlp, twin):
        with fp8_autocast(fp8_recipe=RECIPE), microbatch((0, 1)), torch.no_grad():
            model(xs[1])
    assert (mlp.gate_proj.fp8_meta["weight"].casts, twin.gate_proj.fp8_meta["weight"].casts) == (1, 2)


@pytest.mark.parametrize("form", FORMS)
def test_a_fused_mlp_fed_an_input_without_grad_still_trains_its_weights(form) -> None:
    # The first layer of a stage, or one after frozen layers, reads an x that needs no gradient;
    # the loss still needs one through something else (here a trainable offset). The weights'
    # gradients must come as from the layer function (bit-identical; see the module docstring),
    # not be silently left out.
    torch.manual_seed(0)
    mlp = FORMS[form](nn.SiLU())
    reference = Reference(mlp, "swiglu")
    assert fuse_gated_mlps(mlp) == [""]
    delay_wgrad(mlp)
    offset = nn.Parameter(torch.ones(HIDDEN))
    x, dy = torch.randn(ROWS, HIDDEN), torch.randn(ROWS, HIDDEN)
    with fp8_autocast(fp8_recipe=RECIPE), microbatch(0):
        y = mlp(x)
    (y + offset).backward(dy)
    for layer in (*mlp.fc1_layers(), mlp.down_proj):
        layer.backward_dw(0)
    with fp8_autocast(fp8_recipe=RECIPE):
        want = reference(x)
    want.backward(dy)
    assert torch.equal(y, want)
    assert mlp.down_proj.weight.grad is not None and mlp.fc1_layers()[0].weight.grad is not None
    assert torch.equal(mlp.fc1_grad(), reference.w1.grad)
    assert torch.equal(mlp.down_proj.weight.grad, reference.w2.grad)


def test_a_fused_optimizer_step_makes_the_stacked_cast_stale() -> None:
    # torch.optim's fused=True steps write the weights without bumping their version counters:
    # the microbatch after the step (wrongly is_first_microbatch=False) must cast [gate; up] again
    torch.manual_seed(0)
    mlp = GatedMLP(nn.SiLU())
    fuse_gated_mlps(mlp)
    delay_wgrad(mlp)
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-2, fused=True)
    for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        layer.keep_fp8_weight_casts = True
    with fp8_autocast(fp8_recipe=RECIPE):
        with microbatch((0, 0)):
            mlp(torch.randn(ROWS, HIDDEN, requires_grad=True)).sum().backward()
        for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            layer.backward_dw()
        opt.step()
        with microbatch((0, 1)):
            mlp(torch.randn(ROWS, HIDDEN))
    assert mlp.gate_proj.fp8_meta["weight"].casts == 2
    assert mlp.down_proj.fp8_meta["weight"].casts == 2


def test_fast_stage_in_fp8_fuses_a_hugging_face_models_mlps() -> None:
    transformers = pytest.importorskip("transformers")
    from zbpp.models.fast import fast_stage

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                                      num_attention_heads=2)
    model = transformers.LlamaForCausalLM(config)
    fast_stage(model, compile=False, fp8=True)
    for layer in model.model.layers:
        assert type(layer.mlp).__name__ == "LlamaMLPFusedFp8"
        assert isinstance(layer.mlp.gate_proj, Linear)
    fast_stage(model := transformers.LlamaForCausalLM(config), compile=False)  # bf16: nothing fused
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"


@pytest.mark.parametrize("which", ["gate_proj", "down_proj"])
@pytest.mark.parametrize("frozen_at", ["F", "B"])
def test_a_weight_frozen_or_unfrozen_between_f_and_b_gets_what_autograd_gives(which, frozen_at) -> None:
    # Reference: the same MLP in float32 with torch.nn layers, where autograd gives a weight a
    # gradient only when it requires grad both at F (an edge to it) and at B (AccumulateGrad
    # skips a frozen one). The fused layer read requires_grad at B only: a weight unfrozen since
    # F got a job without the transposes its dW needs (or, for gate, a gradient autograd does not
    # give), and W failed on it. Values: within FP8's error, relative 0.25 (e4m3 inputs and e5m2
    # gradients through three GEMMs: about 0.1 measured on this seed, 0.25 leaves room)
    torch.manual_seed(0)
    mlp, ref = GatedMLP(nn.SiLU()), GatedMLP(nn.SiLU())
    ref.load_state_dict(mlp.state_dict())
    assert fuse_gated_mlps(mlp) == [""]
    delay_wgrad(mlp)
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    for m in (mlp, ref):
        getattr(m, which).weight.requires_grad_(frozen_at == "B")
    with fp8_autocast(fp8_recipe=RECIPE), microbatch(0):
        y = mlp(x)
    y_ref = ref(x)
    for m in (mlp, ref):
        getattr(m, which).weight.requires_grad_(frozen_at == "F")
    y.square().sum().backward()
    y_ref.square().sum().backward()
    for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        if layer.pending_wgrad_keys():
            layer.backward_dw(0)
    for (n, p), q in zip(mlp.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:
            err = ((p.grad - q.grad).norm() / q.grad.norm()).item()
            assert err < 0.25, (n, err)


@pytest.mark.parametrize("form", FORMS)
def test_a_fused_mlp_survives_torch_save_and_load(form) -> None:
    # torch.save pickles the model's classes by name, and the fused class is made at run time
    # (pickle failed on it). Reference: the model saved, run on the same input from the same
    # FP8 state: the loaded one runs the fused layer too, bit-identical to it
    import io

    torch.manual_seed(0)
    mlp = FORMS[form](nn.SiLU())
    assert fuse_gated_mlps(mlp) == [""]
    delay_wgrad(mlp)
    buffer = io.BytesIO()
    torch.save(mlp, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is type(mlp) and isinstance(loaded, FORMS[form])
    x = torch.randn(ROWS, HIDDEN)
    with fp8_autocast(fp8_recipe=RECIPE):
        ys = [m(x.clone().requires_grad_()) for m in (mlp, loaded)]
    assert type(ys[1].grad_fn).__name__ == "_GatedMlpFunctionBackward"
    assert torch.equal(ys[0], ys[1])


def test_a_fused_mlp_names_a_0d_input() -> None:
    # the fused layer leaves what it cannot take to the model's forward, whose layers name it
    mlp = GatedMLP(nn.SiLU())
    assert fuse_gated_mlps(mlp) == [""]
    delay_wgrad(mlp)
    with fp8_autocast(fp8_recipe=RECIPE), pytest.raises(ValueError, match="gate_proj.weight: input is a 0-d tensor"):
        mlp(torch.tensor(1.0))
