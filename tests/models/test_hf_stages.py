"""zbpp.models.hf's stages of Llama, Mistral, Qwen2, Qwen3 and GPT-2, run one after the other in one
process, give HF's own logits for the whole model (float64: the same operations in the same order,
so to 1e-12), with HF's causal and padding masks, sliding windows and rotary embeddings, under
eager and sdpa attention; `CausalLMLoss` is HF's loss (which HF computes in float32: rtol 1e-6)."""

from __future__ import annotations

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from zbpp.models.hf import CausalLMLoss, causal_lm_stages  # noqa: E402
from zbpp.schedules import build  # noqa: E402

from .cases import token_mean_loss  # noqa: E402

TOL = {"rtol": 1e-12, "atol": 1e-12}
COMMON = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def configs():
    # sliding windows shorter than the sequence; with right padding HF's own eager sliding mask leaves
    # padded rows without a key (NaN in HF too), so those models run unpadded
    return {
        "llama": (transformers.LlamaConfig(**COMMON, tie_word_embeddings=True), True),
        "mistral": (transformers.MistralConfig(**COMMON, sliding_window=3), False),
        "qwen2": (transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=3, max_window_layers=2),
                  False),
        "qwen3": (transformers.Qwen3Config(**COMMON, head_dim=8), True),
        "gpt2": (transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=4, n_head=2, n_positions=32, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0), True),
        # Phi-3's longrope: the rotary module caches its long frequencies on itself in its first
        # forward (the 10 tokens exceed the original 4 positions: the long factors apply)
        "phi3_longrope": (transformers.Phi3Config(**COMMON, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                                                  rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                                   "short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0],
                                                                   "original_max_position_embeddings": 4}), True),
    }


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gpt2", "phi3_longrope"])
def test_stages_in_a_row_are_hf_model(kind, attn):
    cfg, padded = configs()[kind]
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float64)
    ids = torch.randint(1, 40, (3, 10))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 7:] = 0
        mask[2, 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    sched = build("zb-v", num_ranks=2, num_microbatches=2)  # 4 stages, one block each
    stages: dict = {}
    for r in range(2):
        mine, kwargs = causal_lm_stages(cfg, sched, r, dtype=torch.float64, attn_implementation=attn,
                                        state_dict=ref.state_dict(), device="cpu")
        stages.update(mine)
    x = {"input_ids": ids, "attention_mask": mask}
    for s in range(4):
        x = stages[s](**x)
    torch.testing.assert_close(x, want.logits, **TOL)
    loss = kwargs["loss_fn"](x, labels)
    torch.testing.assert_close(loss, want.loss.double(), rtol=1e-6, atol=0)
    # gradients: float64, the same operations but for the tied copies' sum: 1e-10 of the largest
    loss.backward()
    token_mean_loss(want.logits, labels).backward()
    scale = max(float(q.grad.abs().max()) for q in ref.parameters())
    for s, stage in stages.items():
        for n, q in stage.named_parameters():
            err = float((q.grad - ref.get_parameter(n).grad).abs().max())
            assert err <= 1e-10 * scale, f"{kind} {attn} stage {s}: {n} off by {err:.3g} (scale {scale:.3g})"
    if kind == "gpt2" or cfg.tie_word_embeddings:
        assert stages[0].model.embed_tokens.weight is stages[3].lm_head.weight if kind != "gpt2" else \
            stages[0].transformer.wte.weight is stages[3].lm_head.weight


def test_explicit_fqns_and_position_ids():
    cfg, _ = configs()["llama"]
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64)
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    fqns = [["model.embed_tokens", "model.layers.0"],  # rotary embeddings added to every stage
            ["model.layers.1", "model.layers.2", "model.layers.3", "model.norm", "lm_head"]]
    stages = {}
    for r in range(2):
        mine, _ = causal_lm_stages(cfg, sched, r, dtype=torch.float64, attn_implementation="eager",
                                   state_dict=ref.state_dict(), module_fqns_per_stage=fqns, device="cpu")
        stages.update(mine)
    assert [n for n, _ in stages[1].model.layers.named_children()] == ["1", "2", "3"]
    ids = torch.randint(1, 40, (2, 6))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]])
    h = stages[1](**stages[0](input_ids=ids, position_ids=pos))
    torch.testing.assert_close(h, ref(input_ids=ids, position_ids=pos).logits, **TOL)


@pytest.mark.parametrize("listed_on", [0, 1])
def test_a_parameter_free_module_listed_on_one_stage_runs_on_every_stage(listed_on):
    """Every stage runs HF's whole forward, which calls the rotary embedding before the layers: a
    stage that did not hold it got the zero placeholder embeddings in place of (cos, sin) (a shape
    error naming neither the module nor the lists, or wrong logits where the shapes happen to fit).
    Listing it on one stage must work as leaving it out does. Reference: HF's logits, float64, same
    operations in the same order (`TOL`, 1e-12)."""
    cfg, _ = configs()["llama"]
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64)
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    fqns = [["model.embed_tokens", "model.layers.0"],
            ["model.layers.1", "model.layers.2", "model.layers.3", "model.norm", "lm_head"]]
    fqns[listed_on].append("model.rotary_emb")
    stages = {}
    for r in range(2):
        mine, _ = causal_lm_stages(cfg, sched, r, dtype=torch.float64, attn_implementation="eager",
                                   state_dict=ref.state_dict(), module_fqns_per_stage=fqns, device="cpu")
        stages.update(mine)
    ids = torch.randint(1, 40, (3, 6))
    h = stages[1](**stages[0](input_ids=ids))
    torch.testing.assert_close(h, ref(input_ids=ids).logits, **TOL)


_EMBED, _NORM, _HEAD = "model.embed_tokens", "model.norm", "lm_head"
_L = [f"model.layers.{i}" for i in range(4)]


@pytest.mark.parametrize("fqns,named", [
    # the final norm on the first stage: it must run after layer 3, which a later stage holds
    ([[_EMBED, _L[0], _L[1], _NORM], [_L[2], _L[3], _HEAD]], "model.norm"),
    # stage 2 holds layer 1, which must run before stage 1's layers 2 and 3
    ([[_EMBED, _L[0]], [_L[2], _L[3]], [_L[1], _NORM, _HEAD]], "model.layers.1"),
])
def test_explicit_fqns_out_of_model_order_are_refused(fqns, named):
    """Stages given in an order the model's forward cannot run in would compute another model (the
    norm skipped, the layers reordered: logits off HF's by ~0.05-0.3): refused, naming the module."""
    cfg = transformers.LlamaConfig(**COMMON, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64)
    sched = build("1f1b", num_ranks=len(fqns), num_microbatches=1)
    ids = torch.randint(1, 40, (2, 6))
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        stages = {}
        for r in range(len(fqns)):
            mine, _ = causal_lm_stages(cfg, sched, r, dtype=torch.float64, attn_implementation="eager",
                                       state_dict=ref.state_dict(), module_fqns_per_stage=fqns, device="cpu")
            stages.update(mine)
        x = {"input_ids": ids}
        for s in range(len(fqns)):
            x = stages[s](**x)


def test_loss_and_weight():
    loss = CausalLMLoss()
    logits = torch.randn(2, 4, 5, dtype=torch.float64)
    labels = torch.tensor([[1, 2, 3, -100], [-100, 4, -100, -100]])
    # predicted: (0 -> 2), (1 -> 3), (row 1: 0 -> 4)
    want = -(torch.log_softmax(logits[0, 0], -1)[2] + torch.log_softmax(logits[0, 1], -1)[3]
             + torch.log_softmax(logits[1, 0], -1)[4]) / 3
    torch.testing.assert_close(loss(logits, labels), want, rtol=1e-14, atol=0)
    assert int(loss.weight(labels)) == 3
    assert float(loss(logits, torch.full((2, 4), -100))) == 0.0 and int(loss.weight(torch.full((2, 4), -100))) == 0


def test_a_model_off_the_template_is_named():
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    cfg = transformers.BartConfig(vocab_size=40, d_model=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, encoder_attention_heads=2, decoder_attention_heads=2)
    with pytest.raises(ValueError, match=r"BartForCausalLM \(model_type 'bart'\) does not fit .* takes no inputs_embeds"):
        causal_lm_stages(cfg, sched, 0)
    with pytest.raises(ValueError, match="model_type 't5' has no \\*ForCausalLM"):
        causal_lm_stages(transformers.T5Config(d_model=16, num_layers=2, num_heads=2, d_ff=32), sched, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_stages_on_the_gpu(kind):
    # float64 on the GPU against HF on the CPU; HF's rotary embedding computes cos/sin in float32,
    # whose CPU and GPU results differ in the last bits, so the logits agree to ~1e-7, not 1e-15
    cfg, _ = configs()[kind]
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64)
    ids = torch.randint(1, 40, (3, 10))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    stages = {}
    for r in range(2):
        mine, _ = causal_lm_stages(cfg, sched, r, dtype=torch.float64, attn_implementation="sdpa",
                                   state_dict=ref.state_dict(), device="cuda")
        stages.update(mine)
    assert all(q.is_cuda for s in stages.values() for q in s.parameters())
    h = stages[1](**stages[0](input_ids=ids.cuda(), attention_mask=mask.cuda()))
    torch.testing.assert_close(h.cpu(), ref(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("given", ["nothing", "attention_mask", "position_ids"])
def test_layer_masks_do_not_change_under_stream_capture(given, monkeypatch):
    """A CUDA graph replays the kernels its eager step ran, so what the decoder layers get as mask
    must not depend on whether a stream is capturing (HF builds masks while capturing where it
    skips them eagerly). Capture is simulated by HF's own probe answering True; the rule is the
    module docstring's: a given attention_mask or position_ids gives a built mask, neither gives None."""
    cfg, _ = configs()["llama"]
    sched = build("1f1b", num_ranks=1, num_microbatches=1)
    torch.manual_seed(0)
    stages, _ = causal_lm_stages(cfg, sched, 0, dtype=torch.float64, attn_implementation="sdpa", device="cpu")
    stage = stages[0]
    seen: list[torch.Tensor | None] = []
    stage.model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True)
    ids = torch.randint(1, 40, (2, 6))
    inputs = {"input_ids": ids}
    if given == "attention_mask":
        inputs["attention_mask"] = torch.ones_like(ids)
    elif given == "position_ids":
        inputs["position_ids"] = torch.arange(6).expand(2, 6)
    eager = stage(**inputs)
    monkeypatch.setattr(transformers.utils.import_utils, "is_cuda_stream_capturing", lambda: True)
    captured = stage(**inputs)
    assert [m is None for m in seen] == [given == "nothing"] * 2
    if given != "nothing":
        assert torch.equal(seen[0], seen[1])
    torch.testing.assert_close(captured, eager, rtol=0, atol=0)


def test_which_stages_may_hold_no_decoder_layer():
    """As causal_lm_stages' docstring says: the default placement gives every stage a layer (3 layers
    do not fill 4 stages); listed by hand, the first stage may hold the embeddings alone and the
    last the final norm and LM head alone (run in a row they are HF's model, float64: 1e-12, as
    above), and a middle stage without a layer is refused."""
    cfg = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 3})
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64)
    ids = torch.randint(1, 40, (2, 6))
    with pytest.raises(ValueError, match="3 blocks cannot fill 4 stages"):
        causal_lm_stages(cfg, build("1f1b", num_ranks=4, num_microbatches=4), 0)
    layers = ["model.layers.0", "model.layers.1", "model.layers.2"]
    sched = build("1f1b", num_ranks=3, num_microbatches=3)
    fqns = [["model.embed_tokens"], layers, ["model.norm", "lm_head"]]
    stages: dict = {}
    for r in range(3):
        stages.update(causal_lm_stages(cfg, sched, r, dtype=torch.float64, attn_implementation="eager",
                                       state_dict=ref.state_dict(), module_fqns_per_stage=fqns, device="cpu")[0])
    x = {"input_ids": ids}
    for s in range(3):
        x = stages[s](**x)
    torch.testing.assert_close(x, ref(input_ids=ids).logits, **TOL)
    middle = [["model.embed_tokens", *layers], [], ["model.norm", "lm_head"]]
    with pytest.raises(ValueError, match="a middle stage holds no decoder layer"):
        causal_lm_stages(cfg, sched, 1, dtype=torch.float64, module_fqns_per_stage=middle, device="cpu")


def _llama_feeding_its_layers_beside_the_hidden_states(cfg, every: int = 1, carry_from: int | None = None):
    """A Llama whose base model passes every `every`-th decoder layer (layers every-1, 2*every-1, ...)
    a projection of the embeddings beside the hidden states (``extra=``, added to the layer's input):
    a module called before the layers whose output reaches them some other way than through the
    hidden states. With `carry_from`, instead, that layer also returns its input and the next one
    takes it as ``extra=`` (state carried from layer to layer)."""
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.models.llama import modeling_llama as ml

    class Layer(ml.LlamaDecoderLayer):
        def forward(self, hidden_states, extra=None, **kwargs):
            out = super().forward(hidden_states if extra is None else hidden_states + extra, **kwargs)
            return (out, hidden_states * 1) if self.self_attn.layer_idx == carry_from else out

    class Base(ml.LlamaModel):
        def __init__(self, config):
            super().__init__(config)
            self.extra = torch.nn.Linear(config.hidden_size, config.hidden_size)
            self.layers = torch.nn.ModuleList(Layer(config, i) for i in range(config.num_hidden_layers))

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
            if inputs_embeds is None:
                inputs_embeds = self.embed_tokens(input_ids)
            projected = self.extra(inputs_embeds)
            if position_ids is None:
                position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
            mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                      past_key_values=None, position_ids=position_ids)
            hidden = inputs_embeds
            rotary = self.rotary_emb(hidden, position_ids=position_ids)
            carried = None
            for i, layer in enumerate(self.layers):
                extra = carried if carry_from is not None else projected if (i + 1) % every == 0 else None
                hidden = layer(hidden, extra=extra, attention_mask=mask, position_ids=position_ids,
                               position_embeddings=rotary)
                hidden, carried = hidden if isinstance(hidden, tuple) else (hidden, None)
            return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))

    class ForCausalLM(ml.LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.model = Base(config)
            self.post_init()

    return ForCausalLM(cfg).double()


def test_a_module_feeding_the_layers_beside_the_hidden_states_is_refused():
    """A model that passes its layers a projection of the embeddings beside the hidden states: the
    second stage held no copy of that projection, its stand-in returned zeros, and the second stage's
    layers silently computed with zeros there (logits off HF's by 5e-2). Every stage of a split
    model is refused, naming the model, the layer input and the module; one stage holding the
    whole model (no stand-in) is HF's model (float64: 1e-12, as above)."""
    cfg, _ = configs()["llama"]
    torch.manual_seed(0)
    ref = _llama_feeding_its_layers_beside_the_hidden_states(cfg)
    ids = torch.randint(1, 40, (2, 6))
    one, _ = causal_lm_stages(ref, build("1f1b", num_ranks=1, num_microbatches=1), 0, state_dict=ref.state_dict(),
                              device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(one[0](input_ids=ids), ref(input_ids=ids).logits, **TOL)
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    for r in range(2):
        with pytest.raises(ValueError, match=r"ForCausalLM does not fit zbpp.models.hf's template: its forward passes "
                                             r"model.layers.0 'extra' computed from model.extra, which stage\(s\) \[1\]"):
            causal_lm_stages(ref, sched, r, state_dict=ref.state_dict(), device="cpu")


@pytest.mark.parametrize("carry_from", [None, 1])
def test_a_later_layer_fed_beside_the_hidden_states_is_refused(carry_from):
    """As above, but only a later layer is fed (layer 3 of 4: a shared block every 4th layer, as
    Zamba's; or layer 1 hands layer 2 a tensor beside the hidden states): the checks looked at
    layers 0 and 1 only, so the stages were built and the second stage's layer silently computed
    with zeros, or with nothing carried (logits off HF's by 2e-2 and 7e-2). Refused when the stages
    are built, naming the layer; one stage holding the whole model is HF's model (float64: 1e-12)."""
    cfg, _ = configs()["llama"]
    torch.manual_seed(0)
    ref = _llama_feeding_its_layers_beside_the_hidden_states(cfg, every=4, carry_from=carry_from)
    ids = torch.randint(1, 40, (2, 6))
    one, _ = causal_lm_stages(ref, build("1f1b", num_ranks=1, num_microbatches=1), 0, state_dict=ref.state_dict(),
                              device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(one[0](input_ids=ids), ref(input_ids=ids).logits, **TOL)
    sched = build("1f1b", num_ranks=2, num_microbatches=2)  # stage 1 holds layers 2 and 3
    words = (r"passes model.layers.3 'extra' computed from model.extra, which stage\(s\) \[1\]" if carry_from is None
             else r"passes model.layers.2 'extra' (from what model.layers.1 returned|computed from model.embed_tokens)")
    for r in range(2):
        with pytest.raises(ValueError, match=r"ForCausalLM does not fit zbpp.models.hf's template: its forward "
                                             + words):
            causal_lm_stages(ref, sched, r, state_dict=ref.state_dict(), device="cpu")


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt2"])
@pytest.mark.parametrize("one_row", [False, True])
def test_packed_rows_attend_within_each_sequence(kind, one_row):
    # position_ids restarting within a row and no attention_mask: packed sequences. The stages keep
    # each one to itself: their logits are those of every sequence run alone through HF's model
    # (brute force; float64, the same operations on fewer keys: 1e-12; SDPA, whose float64 softmax is
    # float64: HF's eager attention takes it in float32, summed in an order that depends on where
    # the masked keys sit, ~1e-8 apart on torch 2.14's CPU kernels), rotary, sliding-window and
    # learned positions alike, the positions per row or one row for all. HF's own call with its default
    # cache (use_cache=True) does not look for packing and attends across them: that differs (README).
    from zbpp import Pipeline

    cfg, _ = configs()[kind]
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float64)
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    stages, kwargs = causal_lm_stages(cfg, sched, 0, dtype=torch.float64, attn_implementation="sdpa",
                                      state_dict=ref.state_dict(), device="cpu")
    ids = torch.randint(1, 40, (4, 9), generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5]] * 4) if one_row else \
        torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 0, 1]] * 2)
    got = Pipeline(stages, sched, **kwargs).eval_step({"input_ids": ids, "position_ids": pos[:1] if one_row else pos})
    with torch.no_grad():
        alone = torch.cat([torch.cat([ref(input_ids=ids[r:r + 1, a:b]).logits
                                      for a, b in zip(starts, [*starts[1:], 9])], dim=1)
                           for r, starts in enumerate([i for i in range(9) if pos[r, i] == 0] for r in range(4))])
        across = ref(input_ids=ids, position_ids=pos).logits
    torch.testing.assert_close(got, alone, **TOL)
    assert not torch.allclose(across, alone, rtol=1e-6, atol=1e-6)  # HF's default call mixes the sequences


@pytest.mark.parametrize("model_type", ["llama", "xlstm"])
def test_stages_without_weights_get_hf_models_init(model_type):
    # the stages' own random init (no state_dict) draws each parameter as HF's whole model built from
    # the same config does: xLSTM's _init_weights reads its sub-model (self.embeddings, module names
    # relative to the backbone), which HF applies per sub-model. Parameters HF sets to constants (gates'
    # zero weights, -10 and linspace(3, 6) biases, norms' ones) are equal exactly; random ones by their
    # spread: the std of >= 256 draws is within ~5% of the true one (3 sigma), and the wrong inits differ
    # by 2x or more (0.02 against xLSTM's sqrt(2 / (5 hidden)) = 0.11), so 25%
    from zbpp.models.hf import small_config

    config = small_config(model_type, vocab_size=64, hidden_size=32, num_layers=2)
    refs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        refs.append(transformers.AutoModelForCausalLM.from_config(config))
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    got = {}
    for rank in range(2):
        stages, _ = causal_lm_stages(config, sched, rank, device="cpu")
        got.update({n: q.detach() for n, q in stages[rank].named_parameters()})
    assert got.keys() == dict(refs[0].named_parameters()).keys()
    for name, q in got.items():
        want, other = refs[0].get_parameter(name).detach(), refs[1].get_parameter(name).detach()
        if torch.equal(want, other):  # not random: the same values
            torch.testing.assert_close(q, want, rtol=0, atol=0, msg=lambda m: f"{model_type} {name}: {m}")
        else:
            assert q.numel() >= 256, name
            assert abs(float(q.std()) / float(want.std()) - 1) < 0.25, (name, float(q.std()), float(want.std()))


def test_openai_gpt_trains_as_hf_and_without_weights_is_refused_by_name():
    # OpenAI GPT's LM head is tied to the token embedding, whose dtype its forward reads before the layers
    # (param.is_floating_point(), a metadata read, not a use); its decoder layers return a list, which
    # its layer loop indexes. On a V's two stages in one process the step equals HF's model on the whole
    # batch: float64, the same operations on 2 microbatches instead of one batch, so the loss to 1e-12
    # and every gradient to 1e-10 of the largest (the summation order only)
    from zbpp import Pipeline
    from zbpp.models.hf import small_config

    config = small_config("openai-gpt", vocab_size=64, hidden_size=32, num_layers=2, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    stages, kwargs = causal_lm_stages(config, sched, 0, dtype=torch.float64, state_dict=ref.state_dict())
    ids = torch.randint(1, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    loss = Pipeline(stages, sched, **kwargs).step(ids, target=ids)
    want = token_mean_loss(ref(input_ids=ids).logits, ids)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
    scale = max(float(q.grad.abs().max()) for q in ref.parameters())
    grads = {n: q.grad for s in stages.values() for n, q in s.named_parameters()}
    assert grads.keys() == dict(ref.named_parameters(remove_duplicate=False)).keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, ref.get_parameter(n).grad, rtol=0, atol=1e-10 * scale, msg=n)
    # from the config alone: its Conv1D layers get their values in their constructor only (not on meta)
    with pytest.raises(ValueError, match=r"OpenAIGPTLMHeadModel \(model_type 'openai-gpt'\).*\['Conv1D'\].*state_dict="):
        causal_lm_stages(config, sched, 0)


def test_a_module_no_stage_can_hold_is_refused_naming_the_model():
    # a Llama whose forward also applies its final norm to the embeddings: used before and after the
    # layers, no one stage can hold it; the refusal names the model and what to pass
    config = transformers.LlamaConfig(**COMMON)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.model.layers[0].register_forward_pre_hook(lambda m, args: (model.model.norm(args[0]), *args[1:]))
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM \(model_type 'llama'\): cannot place \{'model.norm': "
                                         r"\['after', 'before'\]\}.*module_fqns_per_stage="):
        causal_lm_stages(model, sched, 0)


def test_building_stages_runs_two_meta_forwards_of_the_model():
    # CI time: placement is one forward of the whole model on the meta device, and the checks of how the
    # forward feeds the decoder layers (stand-ins, carried state, the layers' output form) share one more
    config = transformers.LlamaConfig(**COMMON)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append(1))
    causal_lm_stages(model, build("1f1b", num_ranks=2, num_microbatches=2), 0)
    assert len(calls) == 2


def test_block_sparse_big_bird_is_refused_by_name():
    # BigBird's forward replaces its layers' attention modules by the sequence length (block-sparse,
    # which attends both ways, or full): refused naming the family and the setting that fits
    from zbpp.models.hf import small_config

    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    config = small_config("big_bird", hidden_size=32, num_layers=2)
    with pytest.raises(ValueError, match=r"BigBirdForCausalLM \(model_type 'big_bird'\) does not fit .*"
                                         r"attention_type='block_sparse'.*attention_type='original_full'"):
        causal_lm_stages(config, sched, 0)
    config.attention_type = "original_full"
    config.is_decoder = True  # causal (bidirectional otherwise, refused: test_bert_style_models_...)
    causal_lm_stages(config, sched, 0)  # built: full attention fits the template


def test_small_config_and_builds_transformers_refuses_name_the_model_type():
    # transformers 5.25's own validators and constructors refuse some families' small sizes deep in
    # their code (a StrictDataclass error, a KeyError, an attribute a sub-config lacks): the error
    # names the model type; a per-layer size that the config will not read globally is left alone
    from zbpp.models.hf import small_config

    with pytest.raises(ValueError, match=r"small_config\('mamba2'\): transformers refuses the config"):
        small_config("mamba2", hidden_size=32, num_layers=2)
    config = small_config("gemma4_text", hidden_size=32, num_layers=2)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("gemma4_text", 32, 2)
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ValueError, match=r"could not build the \*ForCausalLM of model_type 'dbrx'.*AttributeError"):
        causal_lm_stages(small_config("dbrx", hidden_size=32, num_layers=2), sched, 0)


def _without_transformers_source(getsource):
    """`inspect.getsource` as on an install of transformers without its source files (compiled files
    only): OSError for its models' code (HF's own readers of it fall back), the rest as it is."""
    def no_source(obj, *args, **kwargs):
        name = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
        if str(name).startswith("transformers.models."):
            raise OSError("could not get source code")
        return getsource(obj, *args, **kwargs)
    return no_source


@pytest.mark.parametrize("model_type", ["bert", "roberta", "electra"])
def test_bert_style_models_are_causal_only_as_decoders(model_type, monkeypatch):
    # BERT-style *ForCausalLM classes attend both ways unless config.is_decoder=True (HF only warns):
    # they were built as they are, so a causal-LM step saw the tokens it predicts. Now refused by
    # name; with is_decoder=True a step on a V's two stages in one process equals HF's model on the
    # whole batch (float64, the same operations on 2 microbatches: the loss to 1e-12 of itself), and
    # that reference differs from the bidirectional one (by ~5e-5 at this init: future tokens leak in).
    # Refused without the classes' source (an install of .pyc files only: it was read to detect them)
    import inspect

    from zbpp import Pipeline
    from zbpp.models.hf import small_config

    monkeypatch.setattr(inspect, "getsource", _without_transformers_source(inspect.getsource))

    config = small_config(model_type, vocab_size=64, hidden_size=16, num_heads=2, num_layers=2, max_positions=64,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    with pytest.raises(ValueError, match=rf"\(model_type '{model_type}'\) attends both ways unless "
                                         r"config.is_decoder=True.*set config.is_decoder=True"):
        causal_lm_stages(config, sched, 0)
    ids = torch.randint(1, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    both_ways = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    config.is_decoder = True
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    stages, kwargs = causal_lm_stages(config, sched, 0, dtype=torch.float64, state_dict=ref.state_dict())
    loss = Pipeline(stages, sched, **kwargs).step(ids, target=ids)
    want = token_mean_loss(ref(input_ids=ids).logits, ids)
    with torch.no_grad():
        leaky = token_mean_loss(both_ways(input_ids=ids).logits, ids)
    assert abs(float(leaky) - float(want.detach())) > 1e-6, float(leaky)
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-12, atol=0)


def test_every_bert_style_family_is_refused_without_reading_source(monkeypatch):
    # the 16 causal-LM types of transformers 5.25 whose layers attend both ways unless
    # config.is_decoder=True (listed by hand from their modeling code); refused with no source at all
    # to read, and built with is_decoder=True (on the meta device: nothing computed)
    import inspect

    from zbpp.models.hf import check_template, small_config

    monkeypatch.setattr(inspect, "getsource", _without_transformers_source(inspect.getsource))
    for model_type in ["bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
                       "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer",
                       "xlm-roberta", "xlm-roberta-xl", "xmod"]:
        config = small_config(model_type, vocab_size=64, hidden_size=16, num_heads=2, num_layers=2,
                              attention_type="original_full")
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        with pytest.raises(ValueError, match=r"attends both ways unless config.is_decoder=True"):
            check_template(model)
        config.is_decoder = True
        with torch.device("meta"):
            check_template(transformers.AutoModelForCausalLM.from_config(config))


def test_a_model_type_zbpp_does_not_test_is_built_with_a_warning_naming_it(tmp_path):
    # a type outside SUPPORTED that fits the template was built without a word: now one warning names
    # it, pointing at the user's call (this file) whether built from a config or from a directory (whose
    # read goes through more of zbpp's frames: it pointed inside zbpp); a supported type (Llama) builds
    # without one
    import warnings

    from zbpp.models.hf import SUPPORTED, small_config

    sched = build("1f1b", num_ranks=1, num_microbatches=1)
    config = small_config("roberta", vocab_size=64, hidden_size=16, num_heads=2, num_layers=2, is_decoder=True)
    assert "roberta" not in SUPPORTED
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for source in (config, tmp_path, str(tmp_path)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = sys._getframe().f_lineno + 1
            causal_lm_stages(source, sched, 0)
        ours = [w for w in caught if "not among the families" in str(w.message)]
        assert len(ours) == 1, (source, [str(w.message) for w in caught])
        assert ours[0].category is UserWarning
        assert str(ours[0].message).startswith("zbpp.models.hf: model_type 'roberta' (RobertaForCausalLM) is not "
                                               "among the families zbpp tests against HF"), str(ours[0].message)
        assert (ours[0].filename, ours[0].lineno) == (__file__, line), \
            (source, ours[0].filename, ours[0].lineno)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        causal_lm_stages(transformers.LlamaConfig(**COMMON), sched, 0)
    assert not [w for w in seen if "not among the families" in str(w.message)]


def test_falcon_h1_buffers_no_state_dict_holds_are_refused_naming_the_model():
    # Falcon-H1's mixers compute mup_vector, a non-persistent buffer, in their constructors: built on the
    # meta device it has no values, and no state_dict fills it. The refusal named neither the model nor
    # a way out that causal_lm_stages takes ("pass init=", which it has no argument for)
    from zbpp.models.hf import small_config

    config = small_config("falcon_h1", vocab_size=64, hidden_size=16, num_heads=2, num_layers=1)
    sched = build("1f1b", num_ranks=1, num_microbatches=1)
    with pytest.warns(UserWarning, match="not among the families"), \
            pytest.raises(ValueError, match=r"FalconH1ForCausalLM \(model_type 'falcon_h1'\): non-persistent "
                                            r"buffers \['model\.layers\.0\.mamba\.mup_vector \(stage 0\)'.*"
                                            r"zbpp\.models\.pipeline_stages and init="):
        causal_lm_stages(config, sched, 0)


@pytest.mark.parametrize("model_type, text_type, bound", [
    ("llama4", "llama4_text", None), ("qwen3_5", "qwen3_5_text", None), ("qwen3_5_moe", "qwen3_5_moe_text", None),
    ("mllama", None, 1e5), ("dots3_note", "dots3_note_text", 1e5)])
def test_small_config_of_a_multimodal_type_shrinks_its_text_model(model_type, text_type, bound):
    # a multimodal config keeps its sizes in sub-configs, which small_config left at HF's defaults: the
    # causal LM (its text model) had 9.8e9 (Mllama) to 1.1e11 (Llama 4) parameters, and building a
    # stage ran out of memory. Counted on the meta device (nothing allocated): the causal LM now has
    # exactly the parameters of the text-only type's small config of the same sizes, and where given
    # under `bound`, twice the size of 2 Llama layers 32 wide (4.9e4): Mllama (whose text model has no
    # type of its own), dots.3-note (its attention's per-layer and sliding-window sizes were HF's: 1.9e7)
    from zbpp.models.hf import small_config

    def count(config):
        with torch.device("meta"):
            return sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())

    if model_type not in transformers.CONFIG_MAPPING:  # dots3_note came after transformers 5.17
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    config = small_config(model_type, hidden_size=32, num_layers=2, rms_norm_eps=1e-3)
    text = config.get_text_config()
    assert (text.hidden_size, text.num_hidden_layers, text.rms_norm_eps) == (32, 2, 1e-3)
    if text_type is not None:
        assert count(config) == count(small_config(text_type, hidden_size=32, num_layers=2))
    if bound is not None:
        assert count(config) < bound, count(config)


def test_small_config_shrinks_linear_attention_layers():
    # Qwen3-Next's and Qwen3.5's linear-attention layers kept HF's full-size heads (16 key heads and 32
    # value heads of 128): 1.7e6 parameters at hidden 32, 20x a Llama of the same sizes, in every test
    # that builds them. Counted on the meta device: now under twice the Llama's
    from zbpp.models.hf import small_config

    def count(config):
        with torch.device("meta"):
            return sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())

    llama = count(small_config("llama", vocab_size=96, hidden_size=32))
    for model_type in ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"]:
        config = small_config(model_type, vocab_size=96, hidden_size=32)
        assert "linear_attention" in config.layer_types
        assert count(config) < 2 * llama, (model_type, count(config), llama)


def test_stages_may_start_and_end_at_layers_a_text_only_forward_skips():
    # Mllama's text model skips its cross-attention layers (3 of 0..7) without images. A stage ending
    # at one was refused (its output was taken from that layer, which gives none), and the default
    # placement with 4 layers (the last one skipped) said the final norm and LM head ran "while the
    # blocks run". Now the default placements (one layer a stage, the last holding only layer 3 and
    # the head; 4 layers a stage, 3 ending the first), and a middle stage holding only layer 3 with a
    # stage holding none after it, give HF's whole model in float64: the stages' logits in a row (the
    # same operations: 1e-12), and a step on one rank its loss (1e-12) and gradients (the same loss,
    # summed over 2 microbatches: 1e-10 of the largest)
    from zbpp import Pipeline
    from zbpp.models.hf import small_config

    def fqns(*stages):
        return [[f"model.layers.{i}" if isinstance(i, int) else i for i in s] for s in stages]

    v, four = build("zb-v", num_ranks=1, num_microbatches=2), build("zb-interleaved", num_ranks=1, num_microbatches=2,
                                                                     chunks=4)
    placements = [(4, four, None, [[0], [1], [2], [3]]),
                  (8, v, None, [[0, 1, 2, 3], [4, 5, 6, 7]]),
                  (4, four, fqns(["model.embed_tokens", 0, 1], [2], [3], ["model.norm", "lm_head"]),
                   [[0, 1], [2], [3], []])]
    ids = torch.randint(1, 64, (4, 7), generator=torch.Generator().manual_seed(1))
    for layers, sched, placement, expected in placements:
        config = small_config("mllama", vocab_size=64, hidden_size=16, num_heads=2, num_layers=layers)
        assert 3 in config.get_text_config().cross_attention_layers
        torch.manual_seed(0)
        ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
        with pytest.warns(UserWarning, match="not among the families"):
            stages, kwargs = causal_lm_stages(config, sched, 0, dtype=torch.float64, state_dict=ref.state_dict(),
                                              module_fqns_per_stage=placement, balance="blocks")
        assert [[int(n) for n in stages[s].model.layers._modules] for s in range(len(stages))] == expected
        want = ref(input_ids=ids).logits
        with torch.no_grad():
            x = {"input_ids": ids}
            for s in range(len(stages)):
                x = stages[s](**x)
        torch.testing.assert_close(x, want, **TOL)
        loss = Pipeline(stages, sched, **kwargs).step(ids, target=ids)
        reference = token_mean_loss(want, ids)
        torch.testing.assert_close(loss.detach(), reference.detach(), **TOL)
        reference.backward()
        scale = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
        for stage in stages.values():
            for n, q in stage.named_parameters():
                if ref.get_parameter(n).grad is None:  # a cross-attention layer's: HF's is unused too
                    assert q.grad is None or not q.grad.any(), n
                    continue
                torch.testing.assert_close(q.grad, ref.get_parameter(n).grad, rtol=0, atol=1e-10 * scale, msg=n)


def test_a_model_that_runs_its_layers_in_a_loop_is_refused():
    # Dory runs its recurrent layers n_recurrent_loops times (the input section's output added back
    # before each loop). It was built, with the "not among the families" warning, and its stages'
    # logits were off HF's whole model (8e-3 in float64 at small_config's sizes: each stage ran its
    # layers once); now refused, naming the layer called again: 1 here (layers 0, 1, 2, 1, 2, 3), 0
    # with HF's default section sizes
    from zbpp.models.hf import small_config

    if "dory" not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no dory")
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    loops = dict(n_input_layers=1, n_recurrent_layers=2, n_output_layers=1, n_recurrent_loops=2)
    for overrides, layer in [(loops, 1), ({}, 0)]:
        config = small_config("dory", vocab_size=64, hidden_size=16, num_heads=2, num_layers=4, **overrides)
        with pytest.warns(UserWarning, match="not among the families"), \
                pytest.raises(ValueError, match=rf"DoryForCausalLM does not fit .*calls model\.layers\.{layer} more "
                                                r"than once .*zbpp\.models\.pipeline_stages"):
            causal_lm_stages(config, sched, 0)


def test_ranks_start_with_transformers_imported():
    # zbpp.testing's fork server imports transformers where the parent (this module) had: otherwise
    # every rank of every pool imports transformers' model code anew, seconds each on a busy CPU
    from zbpp.testing import Workers

    from .cases import modeling_utils_imported

    with Workers(1) as workers:  # a pool of its own: a shared one may have imported it in an earlier test
        assert workers.run(modeling_utils_imported) == [True]
