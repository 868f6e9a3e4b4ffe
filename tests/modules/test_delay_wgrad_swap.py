"""zbpp.modules.delay_wgrad on Hugging Face models: the swap keeps the model as it was (parameter
objects, state_dict, optimizers, outputs) and moves the linear layers' weight gradients to W.

References: a deep copy of the model taken before the swap, run eagerly by stock torch/HF code.
Models are tiny and random (float64, eager attention, no download)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zbpp.modules import DelayedScaling, Linear, delay_wgrad, fp8_autocast, microbatch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def hf():
    """transformers (the tests that build HF models skip without it)."""
    return pytest.importorskip("transformers")


def gpt2(dtype=torch.float64, device="cpu"):
    transformers = hf()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=1)
    cfg._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(cfg).to(device=device, dtype=dtype)


def llama(dtype=torch.float64, device="cpu", **extra):
    transformers = hf()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=16,
                                   tie_word_embeddings=True, attn_implementation="eager", **extra)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype)


MODELS = {"gpt2": gpt2, "llama": llama}


def tokens(batch=2, seq=8, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (batch, seq), generator=g).to(device)


def converted(model):
    return [m for m in model.modules() if isinstance(m, Linear)]


def run_w(model, key):
    for m in converted(model):
        m.backward_dw(key)


def swap(name, model):
    return delay_wgrad(model, transposed=(name == "gpt2"))


@pytest.mark.parametrize("name", MODELS)
def test_swap_keeps_parameters_state_dict_and_outputs(name):
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    linear_like = [n for n, m in model.named_modules()
                   if type(m).__name__ in ("Linear", "Conv1D")]
    params_before = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)]
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = tokens()
    with torch.no_grad():
        out_before = model(ids).logits

    assert swap(name, model) is model
    # every Linear / Conv1D converted, nothing else
    assert sorted(n for n, m in model.named_modules() if isinstance(m, Linear)) == sorted(linear_like)
    assert all(m.delay_wgrad_compute for m in converted(model))
    # the very same Parameter objects under the same names; the tie kept
    after = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)]
    assert [n for n, _ in after] == [n for n, _ in params_before]
    assert all(p is q for (_, p), (_, q) in zip(after, params_before))
    assert model.lm_head.weight is model.get_input_embeddings().weight
    # the same state_dict: keys, order and values
    state = model.state_dict()
    assert list(state) == list(state_before)
    assert all(torch.equal(state[k], state_before[k]) for k in state)
    assert str(model.load_state_dict(ref.state_dict(), strict=True)) == "<All keys matched successfully>"
    # the same forward, bit for bit (float64; the same GEMMs on the same operands)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, out_before)
    # training flag, device and dtype kept
    assert all(m.training for m in converted(model))
    model.eval()
    assert not any(m.training for m in converted(model))


@pytest.mark.parametrize("name", MODELS)
def test_swapped_model_gradients_and_optimizer_match_eager(name):
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before the swap
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    swap(name, model)
    for step in range(2):
        ids = tokens(seed=step)
        ref(ids, labels=ids).loss.backward()
        with microbatch(("mb", step)):
            loss = model(ids, labels=ids).loss
        loss.backward()  # B: the converted layers' weight gradients are not there yet
        assert all(m.pending_wgrad_keys() == [("mb", step)] for m in converted(model))
        run_w(model, ("mb", step))  # W
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            # W computes dW = dY^T X with the same GEMM as autograd's linear backward; where
            # autograd computes (X^T dY)^T instead (bias-free linear, matmul path) the float64
            # sums may round differently in the last bit: 1e-12 relative is far below any bug
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=n)
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_w_is_deferred_per_key():
    """B of two microbatches, then their W in the other order: each key's W adds that
    microbatch's gradient (the keys are not mixed up)."""
    model, ref = llama(), None
    ref = copy.deepcopy(model)
    delay_wgrad(model)
    outs = {}
    for j in (0, 1):
        with microbatch(j):
            outs[j] = model(tokens(seed=j), labels=tokens(seed=j)).loss
    outs[1].backward(); outs[0].backward()
    lm = model.lm_head
    run_w(model, 1)
    ref(tokens(seed=1), labels=tokens(seed=1)).loss.backward()
    # the embedding (tied to lm_head) got both microbatches' B-side gradient already: compare a
    # weight only W produces
    q_ref = ref.model.layers[0].self_attn.q_proj.weight.grad.clone()
    torch.testing.assert_close(model.model.layers[0].self_attn.q_proj.weight.grad, q_ref,
                               rtol=1e-12, atol=1e-14)
    run_w(model, 0)
    ref(tokens(seed=0), labels=tokens(seed=0)).loss.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    assert lm.pending_wgrad_keys() == []


def test_module_filter_fn_and_fqn():
    model = llama()
    seen = []

    def only_mlp(module, fqn):
        seen.append((fqn, type(module).__name__))
        return ".mlp." in fqn

    delay_wgrad(model, only_mlp)
    names = {n for n, m in model.named_modules() if isinstance(m, Linear)}
    assert names == {f"model.layers.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("gate", "up", "down")}
    assert ("lm_head", "Linear") in seen and ("model.layers.0.self_attn.q_proj", "Linear") in seen
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    # idempotent: converted layers are not candidates again
    seen.clear()
    delay_wgrad(model)
    assert not any(".mlp." in fqn for fqn, _ in seen)


def test_transposed_layers_only_on_request():
    model = gpt2()
    delay_wgrad(model)
    assert type(model.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
    assert isinstance(model.lm_head, Linear)
    delay_wgrad(model, transposed=True)
    conv = model.transformer.h[0].attn.c_attn
    assert isinstance(conv, Linear) and conv.weight.shape == (32, 96)
    assert (conv.in_features, conv.out_features) == (32, 96)
    with microbatch(0):
        conv(torch.randn(3, 32, dtype=torch.float64)).sum().backward()
    conv.backward_dw(0)
    assert conv.weight.grad.shape == (32, 96)  # the gradient has the parameter's [in, out] shape


def test_root_module_and_hooks_are_kept():
    lin = nn.Linear(4, 3)
    calls = []
    lin.register_forward_hook(lambda m, i, o: calls.append("fwd"))
    lin.register_forward_pre_hook(lambda m, i: calls.append("pre"))
    handle = lin.register_full_backward_hook(lambda m, gi, go: calls.append("bwd"))
    assert delay_wgrad(lin) is lin and isinstance(lin, Linear)
    x = torch.randn(2, 4, requires_grad=True)
    lin(x).sum().backward()
    lin.backward_dw()
    assert calls == ["pre", "fwd", "bwd"]
    handle.remove()
    lin(x).sum().backward()
    lin.backward_dw()
    assert calls == ["pre", "fwd", "bwd", "pre", "fwd"]


def test_linear_subclasses_are_left_alone():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(Scaled(2, 2), nn.Linear(2, 2))
    delay_wgrad(model)
    assert type(model[0]) is Scaled and isinstance(model[1], Linear)


@pytest.mark.filterwarnings("ignore:.*weight_norm.* is deprecated:FutureWarning")
def test_linears_with_hook_computed_weights_are_left_alone():
    """torch.nn.utils.weight_norm and spectral_norm (hook forms) keep an nn.Linear whose
    ``weight`` is recomputed by a forward pre-hook from other parameters (weight_g and weight_v,
    weight_orig): W could not give those a gradient, so such layers stay as they are, and every
    gradient equals the same model's before the swap (float64, rtol 1e-12 as above)."""

    def model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
        torch.nn.utils.weight_norm(m[0])
        torch.nn.utils.spectral_norm(m[2])
        return m.double().eval()  # eval: spectral_norm's power iteration leaves u as it is

    ref, swapped = model(), model()
    delay_wgrad(swapped)
    assert [type(m) for m in swapped[::2]] == [nn.Linear, nn.Linear, Linear]
    x = torch.randn(5, 4, dtype=torch.float64)
    ref(x).square().sum().backward()
    with microbatch(0):
        swapped(x).square().sum().backward()
    run_w(swapped, 0)
    for (n, p), q in zip(ref.named_parameters(), swapped.parameters()):
        assert q.grad is not None, n
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-14, msg=n)


def test_linears_with_an_instance_forward_are_left_alone():
    """A layer whose ``forward`` was replaced on the instance (accelerate's hooks keep the bound
    ``nn.Linear.forward`` and call it from a wrapper set as ``module.forward``) never runs
    zbpp's forward: converted, its B computed the weight gradient through autograd and W found
    nothing filed. Such layers stay as they are; every gradient equals the model's before the
    swap (float64, rtol 1e-12 as above), and the other layers defer theirs."""

    def model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
        old = m[0].forward
        m[0].forward = lambda x: old(x)  # as accelerate.hooks.add_hook_to_module wraps it
        return m

    ref, swapped = model(), model()
    delay_wgrad(swapped)
    assert type(swapped[0]) is nn.Linear and isinstance(swapped[2], Linear)
    x = torch.randn(5, 4, dtype=torch.float64)
    ref(x).square().sum().backward()
    with microbatch(0):
        swapped(x).square().sum().backward()
    assert swapped[2].weight.grad is None  # deferred to W
    run_w(swapped, 0)
    for (n, p), q in zip(ref.named_parameters(), swapped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=0, msg=n)


def test_errors_name_the_converted_layer_by_its_path():
    """A converted layer's errors name it by its path in the model (there may be hundreds of
    Linears), a Conv1D too, not by zbpp's class; under torch.autocast (which zbpp's layers do not
    follow) the dtype error says so."""
    model = nn.Sequential()
    model.add_module("enc", nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    delay_wgrad(model)
    with pytest.raises(TypeError, match=r"^enc\.0\.weight: input dtype torch\.float64"):
        model(torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^enc\.1\.weight: input has 3 features"):
        model.enc[1](torch.randn(2, 3))
    with pytest.raises(TypeError, match=r"^enc\.0\.weight: torch\.autocast ran this layer in torch\.bfloat16"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"^enc\.1\.weight: .*torch\.autocast is on"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.enc[1](torch.randn(2, 4, dtype=torch.bfloat16))
    conv = gpt2()
    delay_wgrad(conv, transposed=True)
    with pytest.raises(ValueError, match=r"^transformer\.h\.0\.attn\.c_attn\.weight: input has 3"):
        conv.transformer.h[0].attn.c_attn(torch.randn(2, 3, dtype=torch.float64))


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="model is a str, not a torch.nn.Module"):
        delay_wgrad("model")
    with pytest.raises(TypeError, match="module_filter_fn=3 is not callable"):
        delay_wgrad(nn.Linear(2, 2), 3)
    with pytest.raises(TypeError, match="transposed='yes'"):
        delay_wgrad(nn.Linear(2, 2), transposed="yes")


def _fp8_pair(transposed: bool):
    """A converted layer and zbpp's own Linear holding the same values ([out, in])."""
    torch.manual_seed(0)
    if transposed:
        conv = hf().pytorch_utils.Conv1D(32, 48)  # nf=32 out, nx=48 in: weight [48, 32]
        nn.init.normal_(conv.bias)
        own = Linear(48, 32, delay_wgrad_compute=True)
        with torch.no_grad():
            own.weight.copy_(conv.weight.t()); own.bias.copy_(conv.bias)
        return delay_wgrad(conv, transposed=True), own
    lin = nn.Linear(48, 32)
    own = Linear(48, 32, delay_wgrad_compute=True)
    own.load_state_dict(lin.state_dict())
    return delay_wgrad(lin), own


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_fp8_autocast_runs_like_zbpp_linear(transposed):
    """Under fp8_autocast (on a CPU: FP8 casts, dequantised GEMMs) a converted layer computes what
    zbpp's own Linear with the same weights computes: the same casts of the same values."""
    swapped, own = _fp8_pair(transposed)
    x = torch.randn(16, 48)
    g = torch.randn(16, 32)
    outs = []
    for layer in (swapped, own):
        xi = x.clone().requires_grad_()
        with fp8_autocast(fp8_recipe=DelayedScaling()), microbatch(0):
            y = layer(xi)
        y.backward(g)
        layer.backward_dw(0)
        outs.append((y, xi.grad, layer.weight.grad, layer.bias.grad))
        assert layer.fp8_meta, "the FP8 path did not run"
    (y1, dx1, dw1, db1), (y2, dx2, dw2, db2) = outs
    assert torch.equal(y1, y2) and torch.equal(dx1, dx2) and torch.equal(db1, db2)
    # the transposed layout computes dW^T with the operands swapped: float32 sums in another
    # order, so equal to float32 rounding
    torch.testing.assert_close(dw1.t() if transposed else dw1, dw2, rtol=1e-6, atol=1e-6)
    assert dw1.shape == swapped.weight.shape


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", MODELS)
def test_gpu_bf16_and_fp8(name):
    """bf16 on CUDA: gradients equal the eager model's to bf16 rounding; FP8 (HYBRID): the loss
    within FP8's error of bf16's and every converted layer's W produced."""
    model = MODELS[name](torch.bfloat16, "cuda")
    ref = copy.deepcopy(model)
    swap(name, model)
    ids = tokens(batch=2, seq=16, device="cuda")
    ref(ids, labels=ids).loss.backward()
    with microbatch(0):
        loss = model(ids, labels=ids).loss
    loss.backward()
    run_w(model, 0)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        # bf16 GEMMs on the GPU may pick other kernels for dW^T vs dW: a few bf16 ulps
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3, msg=n)
    model.zero_grad()
    with fp8_autocast(fp8_recipe=DelayedScaling()), microbatch(1):
        fp8_loss = model(ids, labels=ids).loss
    fp8_loss.backward()
    run_w(model, 1)
    assert abs(fp8_loss.item() - loss.item()) < 0.1 * abs(loss.item())
    assert all(m.weight.grad is not None and torch.isfinite(m.weight.grad).all()
               for m in converted(model))


def test_converted_model_deep_copies():
    model = swap("gpt2", gpt2())
    twin = copy.deepcopy(model)
    ids = tokens()
    for m, key in ((model, 0), (twin, 0)):
        with microbatch(key):
            m(ids, labels=ids).loss.backward()
        run_w(m, key)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p is not q and torch.equal(p.grad, q.grad)
    assert all(p.skip_backward_post_hook for m in converted(twin) for p in m.get_backward_dw_params())


def test_linear_like_subclasses_are_converted_only_when_named():
    """An nn.Linear subclass is left alone unless `linear_like` names its class; then it computes
    what it computed (float64, rtol=1e-12: F.linear against matmul + bias, one rounding apart) and
    defers its weight gradient. Anything but an nn.Linear subclass there is refused by name."""

    class MatmulLinear(nn.Linear):  # as Hugging Face's FalconLinear
        def forward(self, x):
            return x @ self.weight.T + self.bias

    torch.manual_seed(0)
    model = nn.Sequential(MatmulLinear(4, 3, dtype=torch.float64), MatmulLinear(3, 2, dtype=torch.float64))
    x = torch.randn(5, 4, dtype=torch.float64)
    want = model(x)
    delay_wgrad(model, lambda module, fqn: fqn == "0")
    assert type(model[0]) is MatmulLinear
    delay_wgrad(model, linear_like=[MatmulLinear])
    assert type(model[0]).__name__ == type(model[1]).__name__ == "Linear"
    assert model[0].delay_wgrad_compute and model[1].delay_wgrad_compute
    torch.testing.assert_close(model(x), want, rtol=1e-12, atol=0)
    with pytest.raises(TypeError, match="linear_like holds <class 'torch.nn.modules.conv.Conv1d'>"):
        delay_wgrad(model, linear_like=(nn.Conv1d,))


def test_backward_dw_errors_name_the_swapped_layer_by_its_path():
    # among a model's many Linears, W's errors say which one (as its other errors do) and why
    # nothing may be pending: here the forward ran, its backward not yet
    from collections import OrderedDict

    from zbpp.modules.wgrad_store import WgradStoreError

    model = nn.Sequential(OrderedDict(up=nn.Linear(4, 8), act=nn.ReLU(), down=nn.Linear(8, 2)))
    delay_wgrad(model)
    with microbatch(0):
        loss = model(torch.randn(3, 4)).sum()
    with pytest.raises(WgradStoreError,
                       match=r"^down\.backward_dw\(\): nothing pending for microbatch key 0: .*its backward \(B\)"):
        model.down.backward_dw(0)
    loss.backward()
    with pytest.raises(WgradStoreError, match=r"^up\.backward_dw\(7\): no wgrad pending .* pending keys: \[0\]"):
        model.up.backward_dw(7)
    model.up.backward_dw(0)
    model.down.backward_dw(0)
