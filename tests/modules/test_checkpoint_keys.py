"""Activation checkpointing with delayed-wgrad layers: the re-run of a forward inside the backward
files its W under the original forward's microbatch key (reentrant and non-reentrant).

Reference: the same model, without checkpointing and with eager (not delayed) weight gradients,
in the same process on the same data."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zbpp.modules import LayerNormMLP, Linear, delay_wgrad, microbatch


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = Linear(16, 16, delay_wgrad_compute=True, params_dtype=torch.float64)
        self.mlp = LayerNormMLP(16, 32, delay_wgrad_compute=True, params_dtype=torch.float64)

    def forward(self, x):
        return x + self.mlp(torch.tanh(self.fc(x)))


class Stack(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.reentrant = reentrant

    def forward(self, x):
        for block in self.blocks:
            if self.reentrant is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


def _delayed(model):
    return [m for m in model.modules() if hasattr(m, "backward_dw") and m.delay_wgrad_compute]


def _eager_reference(model):
    """A copy of `model` without checkpointing whose layers compute their weight gradients eagerly."""
    ref = copy.deepcopy(model)
    ref.reentrant = None
    for m in _delayed(ref):
        m.delay_wgrad_compute = False
    return ref


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_zbpp_layers_file_w_under_the_forward_key(reentrant):
    torch.manual_seed(0)
    model = Stack(reentrant)
    ref = _eager_reference(model)
    xs = {k: torch.randn(4, 16, dtype=torch.float64, requires_grad=True) for k in [(0, 0), (0, 1)]}
    outs = {}
    for key, x in xs.items():  # two forwards, as a pipeline stage runs F(0), F(1) ...
        with microbatch(key):
            outs[key] = model(x)
    for key in [(0, 1), (0, 0)]:  # ... and B outside the block, in another order
        outs[key].square().sum().backward()
    for m in _delayed(model):
        assert sorted(m.pending_wgrad_keys()) == [(0, 0), (0, 1)]
    w_params = {id(p) for m in _delayed(model) for p in m.get_backward_dw_params()}
    for key in [(0, 0), (0, 1)]:
        for m in _delayed(model):
            m.backward_dw(key)
        ref_x = xs[key].detach().clone().requires_grad_()
        ref(ref_x).square().sum().backward()
        # the same GEMMs on the same (recomputed, bit-identical) operands: equal bit for bit;
        # after W of the first key, W's parameters hold that key's gradient only (the norms'
        # gradients, computed in B, hold both keys' until the end)
        for p, q in zip(model.parameters(), ref.parameters()):
            if id(p) in w_params or key == (0, 1):
                assert torch.equal(p.grad, q.grad)
        assert torch.equal(xs[key].grad, ref_x.grad)


# the inner checkpoints' first run is inside the outer one's no-grad run: torch warns, rightly
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_nested_reentrant_checkpoints():
    torch.manual_seed(0)
    inner = Stack(True)
    ref = copy.deepcopy(inner)
    ref.reentrant = None
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    with microbatch("k"):
        y = checkpoint(inner, x, use_reentrant=True)
    y.sum().backward()
    for m in _delayed(inner):
        m.backward_dw("k")
    ref(x.detach()).sum().backward()
    for m in _delayed(ref):
        m.backward_dw()
    for p, q in zip(inner.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_without_keys_checkpoint_still_files_in_fifo_order():
    torch.manual_seed(0)
    model = Stack(True)
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    model(x).sum().backward()  # no microbatch block: automatic keys, FIFO backward_dw()
    for m in _delayed(model):
        m.backward_dw()
        assert m.pending_wgrad_keys() == []


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_hf_llama_gradient_checkpointing_after_delay_wgrad(reentrant):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=16,
                                   attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).double()
    ref = copy.deepcopy(model)
    delay_wgrad(model)
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.25 (the older name warns)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with microbatch((0, 0)):
        loss = model(ids, labels=ids).loss
    loss.backward()
    for m in model.modules():
        if isinstance(m, Linear):
            m.backward_dw((0, 0))
    ref(ids, labels=ids).loss.backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        # see test_delay_wgrad_swap: dW^T against autograd's (X^T dY)^T, float64 last bits
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=n)


def test_reentrant_rerun_files_under_its_forward_key_inside_another_block():
    """A microbatch's B run by hand inside the next microbatch's ``microbatch()`` block (1F1B
    written out: F(1), then B(0)): the reentrant re-run of microbatch 0's forward must file its
    W under key 0, as it does on GPUs (where autograd's thread sees no block), not under the
    block's key 1 (where W(0) found nothing and W(1) took both). Reference: the same model
    without checkpointing, eager weight gradients (float64, bit for bit as above)."""
    torch.manual_seed(0)
    model = Stack(True)
    ref = _eager_reference(model)
    xs = [torch.randn(4, 16, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    with microbatch(0):
        y0 = model(xs[0])
    with microbatch(1):
        y1 = model(xs[1])
        y0.square().sum().backward()
        for m in _delayed(model):
            assert m.pending_wgrad_keys() == [0]
    y1.square().sum().backward()
    w_params = {id(p) for m in _delayed(model) for p in m.get_backward_dw_params()}
    for key in (0, 1):
        for m in _delayed(model):
            m.backward_dw(key)
        ref(xs[key].detach()).square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            if id(p) in w_params or key == 1:  # the norms' B-time gradients hold both keys'
                assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("backward_in_fp8", [False, True], ids=["backward-outside", "backward-inside"])
def test_fp8_layers_under_torch_checkpoint_are_refused_by_name(reentrant, backward_in_fp8):
    """torch's checkpoint re-runs an FP8 layer's forward in the backward: outside fp8_autocast
    (the gradients of a forward without FP8: reentrant silently, non-reentrant with torch's
    "different number of tensors") or, with the backward inside it, stepping the scaling slots
    again (casts unlike F's, other gradients, silently). Refused at F, naming the layer.
    Reference for the way out the error names: zbpp's "full" recompute policy gives the
    gradients of the same FP8 model without recompute; bit for bit (the same CPU operations on
    the same FP8 operands)."""
    from zbpp.models.recompute import apply_activation_policy
    from zbpp.modules import DelayedScaling, fp8_autocast

    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    plain = nn.Sequential(LayerNormMLP(32, 64, params_dtype=torch.bfloat16), nn.Tanh(),
                          Linear(32, 32, params_dtype=torch.bfloat16))
    checkpointed, recomputed = copy.deepcopy(plain), copy.deepcopy(plain)
    x = torch.randn(16, 32, dtype=torch.bfloat16)

    def step(model, run):
        xi = x.clone().requires_grad_()
        with fp8_autocast(fp8_recipe=recipe):
            y = run(model, xi)
            if backward_in_fp8:
                y.float().square().sum().backward()
        if not backward_in_fp8:
            y.float().square().sum().backward()
        return [xi.grad] + [p.grad for p in model.parameters()]

    with pytest.raises(RuntimeError, match=r"^LayerNormMLP: an FP8 forward .* torch\.utils\.checkpoint.*'full'"):
        step(checkpointed, lambda m, xi: checkpoint(m, xi, use_reentrant=reentrant))
    want = step(plain, lambda m, xi: m(xi))
    apply_activation_policy(recomputed, {"0": "full", "2": "full"})
    got = step(recomputed, lambda m, xi: m(xi))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
