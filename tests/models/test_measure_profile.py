"""`zbpp.models.measure_profile`: per-layer memory against hand counts, static bytes against the
formula, the layers of a torchtitan-style model and of a tiny HF Llama, and what `search` makes of
the result. Times are only checked to be measured (positive where there is work): speed is never
asserted."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from zbpp.models import measure_causal_lm, measure_profile
from zbpp.schedules.planner import search

F64 = 8  # bytes of a float64


def _mlp(i: int, o: int) -> nn.Module:
    return nn.Sequential(nn.Linear(i, o), nn.Tanh()).double()


def test_activation_wgrad_static_by_hand():
    torch.manual_seed(0)
    a, b = _mlp(4, 6), _mlp(6, 5)
    x = torch.randn(3, 4, dtype=torch.float64)
    prof = measure_profile(layers=[("a", a), ("b", b)], example_input=x, steps=1, warmup=0,
                           optimizer_bytes_per_param=12)
    la, lb = prof.layers
    # Linear saves its input (the weight is a parameter: static, not counted; the first layer's
    # input needs no gradient: the caller's, not counted either), tanh its output.
    assert la.activation == 3 * 6 * F64
    assert lb.activation == (3 * 6 + 3 * 5) * F64
    # the first layer's B computes nothing: W runs its whole backward and keeps all F saved; the
    # second's split B frees tanh's output (it serves B only) and leaves W the Linear's input
    assert la.wgrad == la.activation and lb.wgrad == 3 * 6 * F64
    # static: weight + gradient (float64 each) + 12 optimizer bytes per parameter
    assert la.static == (4 * 6 + 6) * (2 * F64 + 12)
    assert lb.static == (6 * 5 + 5) * (2 * F64 + 12)
    assert la.b == 0.0  # the first layer's input needs no gradient
    assert la.f > 0 and la.w > 0 and lb.f > 0 and lb.b > 0 and lb.w > 0


def test_static_of_frozen_parameters_is_the_weight_alone():
    """A frozen parameter (``requires_grad=False``: frozen embeddings, adapters' base weights) gets no
    gradient and no optimizer state (AdamW keeps none for a parameter that never has a ``.grad``):
    its static bytes are ``numel * element_size`` only. Hand count, exact (byte counts)."""
    torch.manual_seed(0)
    a, frozen, b = nn.Linear(4, 6).double(), nn.Linear(6, 6).double(), nn.Linear(6, 5).double()
    half = nn.Linear(6, 6).double()  # weight frozen, bias trained
    frozen.requires_grad_(False)
    half.weight.requires_grad_(False)
    x = torch.randn(3, 4, dtype=torch.float64)
    prof = measure_profile(layers=[("a", a), ("frozen", frozen), ("half", half), ("b", b)], example_input=x,
                           steps=1, warmup=0, optimizer_bytes_per_param=12)
    la, lf, lh, lb = prof.layers
    assert lf.static == (6 * 6 + 6) * F64
    assert lh.static == 6 * 6 * F64 + 6 * (2 * F64 + 12)
    assert la.static == (4 * 6 + 6) * (2 * F64 + 12) and lb.static == (6 * 5 + 5) * (2 * F64 + 12)
    assert lf.w == 0.0  # nothing to compute in W


def _adamw_static_bytes(params: list[nn.Parameter], master: bool) -> int:
    """The reference for the default static bytes: weight + gradient + the state torch.optim.AdamW
    holds after one step, by tensor nbytes (with `master`, AdamW steps fp32 copies, as mixed precision
    does: the copies count too). Its per-tensor ``step`` counter (one scalar, not per element) is left
    out, as the profile's per-parameter bytes leave it out."""
    for p in params:
        p.grad = torch.ones_like(p)
    stepped = [nn.Parameter(p.detach().float().clone()) for p in params] if master else params
    for m, p in zip(stepped, params):
        m.grad = p.grad.to(m.dtype)
    opt = torch.optim.AdamW(stepped)
    opt.step()
    state = sum(t.nbytes for st in opt.state.values() for k, t in st.items() if k != "step")
    copies = sum(m.nbytes for m in stepped) if master else 0
    return sum(p.nbytes + p.grad.nbytes for p in params) + state + copies


@pytest.mark.parametrize("dtype, master", [(torch.float32, False), (torch.float64, False), (torch.bfloat16, True)])
def test_default_optimizer_bytes_are_adamw_state_for_the_dtype(dtype, master):
    """Without optimizer_bytes_per_param, static bytes are AdamW's real state for the parameters'
    dtype: float32/float64 weights stepped in place keep two moments of their dtype (8, 16 bytes);
    bfloat16 ones an fp32 master and two fp32 moments (12). A flat 12 charged float32 4 bytes per
    parameter that do not exist. Exact: byte counts against `_adamw_static_bytes`."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 6).to(dtype), nn.Linear(6, 5).to(dtype)
    prof = measure_profile(layers=[("a", a), ("b", b)], example_input=torch.randn(3, 4, dtype=dtype), steps=1,
                           warmup=0)
    assert [x.static for x in prof.layers] == [_adamw_static_bytes(list(m.parameters()), master) for m in (a, b)]


def test_wgrad_through_a_transposed_weight():
    # without a bias the weight reaches the GEMM's backward only through a transpose node, which
    # saves nothing: W still needs the GEMM's saved input (the first layer makes it need a gradient)
    lin = nn.Linear(6, 5, bias=False).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    prof = measure_profile(layers=[("pre", nn.Linear(6, 6).double()), ("l", lin)], example_input=x, steps=1, warmup=0)
    assert prof.layers[1].activation == prof.layers[1].wgrad == 4 * 6 * F64


def test_shared_storage_counted_once_and_parameter_free_layer():
    class Twice(nn.Module):  # saves the same tensor for two products: one storage
        def forward(self, x):
            return x * x + x.sin()

    x = torch.randn(5, 7, dtype=torch.float64)
    lin = nn.Linear(7, 7).double()
    prof = measure_profile(layers=[("lin", lin), ("twice", Twice())], example_input=x, steps=1, warmup=0)
    # mul saves x twice and sin saves x: all one storage, the layer's input
    assert prof.layers[1].activation == 5 * 7 * F64
    assert prof.layers[1].wgrad == 0 and prof.layers[1].static == 0 and prof.layers[1].w == 0


class _Net(nn.Module):
    """torchtitan's convention: forward runs the modules it holds and skips those set to None."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.layers = nn.ModuleList(_mlp(8, 8).float() for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 20, bias=False)

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h)
        if self.norm is not None:
            h = self.head(self.norm(h))
        return h


def test_model_layers_by_blocks():
    torch.manual_seed(0)
    net = _Net().double()
    ids = torch.randint(0, 20, (2, 5))
    prof = measure_profile(net, ids, blocks="layers", steps=1, warmup=0, optimizer_bytes_per_param=0)
    assert [x.name for x in prof.layers] == ["embed", "layers.0", "layers.1", "layers.2", "norm+head"]
    assert prof.layers[0].static == 20 * 8 * 2 * F64
    assert prof.layers[-1].static == (8 + 8 + 8 * 20) * 2 * F64
    # the same layer, given by hand, measures the same bytes
    by_hand = measure_profile(layers=[("embed", net.embed), ("l0", net.layers[0])], example_input=ids, steps=1, warmup=0)
    assert prof.layers[1].activation == by_hand.layers[1].activation == (2 * 5 * 8 * 2) * F64


def test_hf_llama_profile_is_searchable():
    model = _tiny_llama()
    ids = torch.randint(0, 48, (2, 8))
    prof = measure_profile(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, steps=1, warmup=0,
                           name="tiny-llama")
    names = [x.name for x in prof.layers]
    assert names == ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "model.norm+lm_head"]
    blocks = prof.layers[1:-1]
    block_params = sum(p.numel() for p in model.model.layers[0].parameters())
    per = 2 * F64 + 2 * F64  # weight and gradient; AdamW's two float64 moments (float64: no master copy)
    assert all(x.static == block_params * per for x in blocks)
    # the tied embedding counts in the first and the last layer, as on two ranks, and is listed as shared
    assert prof.layers[0].static == 48 * 16 * per
    assert prof.layers[-1].static == (48 * 16 + 16) * per
    assert [(x.name, x.layers, x.static) for x in prof.shared] == [("model.embed_tokens.weight", (0, 5), 48 * 16 * per)]
    assert all(x.f > 0 and x.b > 0 and x.w > 0 and 0 < x.wgrad < x.activation for x in blocks)
    assert prof.layers[0].b == 0 and prof.layers[-1].activation > 0
    plan = search(prof, num_ranks=2, num_microbatches=4)
    assert [r for st in plan.stages for r in st] == list(range(len(prof)))


@pytest.mark.parametrize("tied", [True, False])
def test_planned_static_bytes_are_the_parameters_each_rank_holds(tied):
    """What the planner counts as each rank's static bytes under a V placement (rank 0: embedding and
    head) and one stage per rank, against the unique Parameters `pipeline_stages` gives each rank's
    stages (a tied weight one Parameter on the rank holding both its layers, a copy on each of two)."""
    from zbpp.models import pipeline_stages
    from zbpp.schedules import build
    from zbpp.schedules.planner import evaluate

    model = _tiny_llama(2, tied=tied)
    prof = measure_profile(model, torch.randint(0, 48, (2, 8)), steps=1, warmup=0, optimizer_bytes_per_param=12)
    assert len(prof.shared) == tied
    layers = [["model.embed_tokens", "model.rotary_emb"], ["model.layers.0"], ["model.layers.1"], ["model.norm", "lm_head"]]
    for name, fqns in (("zb-v", layers), ("1f1b", [layers[0] + layers[1], layers[2] + layers[3]])):
        sched = build(name, num_ranks=2, num_microbatches=4)
        stages = (range(0, 1), range(1, 2), range(2, 3), range(3, 4)) if name == "zb-v" else (range(0, 2), range(2, 4))
        planned = evaluate(prof, 2, 4, stages, name).peak
        activations = evaluate(prof.__class__(prof.layers), 2, 4, stages, name).peak  # static counted in full
        for r in range(2):
            held = {id(p): p for m in pipeline_stages(model, sched, pp_rank=r, module_fqns_per_stage=fqns)[0].values()
                    for p in m.parameters()}
            actual = sum(p.numel() * (2 * p.element_size() + 12) for p in held.values())
            full = sum(prof.layers[i].static for s in sched.stages_on(r) for i in stages[s])
            # the peak is static + the simulated activations, which sharing does not change
            assert planned[r] - (activations[r] - full) == pytest.approx(actual, rel=1e-12), (name, r)


def _tiny_llama(layers: int = 4, tied: bool = True):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).double()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bytes_match_cpu():
    # saved tensors follow autograd's formulas, not the device: the same bytes on both (eager attention)
    model = _tiny_llama(2)
    ids = torch.randint(0, 48, (2, 8))
    cpu = measure_profile(model, ids, steps=1, warmup=0)
    gpu = measure_profile(model.cuda(), ids.cuda(), steps=3, warmup=1)
    assert gpu.notes["measured_on"].startswith("cuda")
    for a, b in zip(cpu.layers, gpu.layers):
        assert (a.name, a.activation, a.wgrad, a.static) == (b.name, b.activation, b.wgrad, b.static)
    assert all(x.f > 0 and x.w > 0 for x in gpu.layers)


def test_saved_profile_round_trips(tmp_path):
    x = torch.randn(2, 3, dtype=torch.float64)
    prof = measure_profile(layers=[("l", nn.Linear(3, 3).double())], example_input=x, steps=1, warmup=0)
    prof.save(tmp_path / "p.json")
    assert type(prof).load(tmp_path / "p.json") == prof
    tied = measure_profile(_tiny_llama(1), torch.randint(0, 48, (2, 8)), steps=1, warmup=0)
    tied.save(tmp_path / "tied.json")
    assert type(tied).load(tmp_path / "tied.json").shared == tied.shared and len(tied.shared) == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=0), "steps must be an int >= 1"),
    (dict(warmup=-1), "warmup must be an int >= 0"),
    (dict(optimizer_bytes_per_param=-1), "optimizer_bytes_per_param"),
    (dict(loss_fn=nn.functional.mse_loss), "loss_fn needs target"),
    (dict(blocks="layers"), "blocks applies to a model"),
    (dict(example_input=None), "needs example_input"),
    (dict(layers=[("l", 3)]), r"layers\[0\] must be a \(name, module\) pair"),
    (dict(layers=[]), "non-empty list"),
])
def test_bad_input(kwargs, match):
    args = dict(layers=[("l", nn.Linear(3, 3))], example_input=torch.randn(2, 3))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        measure_profile(**args)


def test_bad_model():
    with pytest.raises(ValueError, match="not both or neither"):
        measure_profile(nn.Linear(3, 3), torch.randn(2, 3), layers=[("l", nn.Linear(3, 3))])
    with pytest.raises(ValueError, match="names no submodule"):
        measure_profile(_Net(), torch.zeros(2, 3, dtype=torch.long), blocks="blocks")
    with torch.device("meta"):
        net = _Net()
    with pytest.raises(ValueError, match="meta device"):
        measure_profile(net, torch.zeros(2, 3, dtype=torch.long), blocks="layers")
    frozen = nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(ValueError, match="no output needs a gradient"):
        measure_profile(layers=[("frozen", frozen)], example_input=torch.randn(2, 3))


def test_measure_causal_lm_repeats_a_block():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=5, n_head=2, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    prof = measure_causal_lm(cfg, seq=8, micro_batch=2, measured_blocks=2, dtype=torch.float64, link_bytes_per_s=1e9,
                             steps=1, warmup=0)
    assert [x.name for x in prof.layers] == ["transformer.wte+transformer.wpe", *(f"transformer.h.{i}" for i in range(5)),
                                             "transformer.ln_f+lm_head"]
    assert len({(x.f, x.activation) for x in prof.layers[1:-1]}) == 1  # one measured block, repeated
    # GPT-2 ties wte and lm_head: shared by the first and the last layer of the repeated profile
    assert [(x.name, x.layers) for x in prof.shared] == [("transformer.wte.weight", (0, 6))]
    assert prof.shared[0].static == 40 * 16 * (2 * F64 + 2 * F64)  # AdamW's float64 moments by default
    assert prof.comm == 2 * 8 * 16 * F64 / 1e9  # the hidden states of a microbatch over 1 GB/s
    assert prof.notes["measured_blocks"] == 2 and cfg.n_layer == 5  # the caller's config is left as it was
    with pytest.raises(ValueError, match="measured_blocks=6 exceeds"):
        measure_causal_lm(cfg, seq=8, measured_blocks=6)
    with pytest.raises(ValueError, match="link_bytes_per_s must be > 0"):
        measure_causal_lm(cfg, seq=8, link_bytes_per_s=0)


def test_measure_causal_lm_repeats_each_kind_of_block():
    """A model whose blocks differ (DeepSeek-V3's first `first_k_dense_replace` blocks dense, the rest
    mixture-of-experts): with `measured_blocks`, each block of the config is stood for by a measured
    block of its own kind, and a kind the measured blocks lack is refused, naming the block and the
    count that covers it. Reference: the profile of the whole model, static bytes (exact: byte counts,
    independent of timing; a dense block repeated for a MoE one is off by the experts' bytes)."""
    pytest.importorskip("transformers")
    from zbpp.models.hf import small_config

    cfg = small_config("deepseek_v3", vocab_size=32, hidden_size=16, num_layers=4, num_heads=2)
    cfg.first_k_dense_replace = 1
    args = dict(seq=4, steps=1, warmup=0, dtype=torch.float32)  # float32: the grouped GEMMs' CPU kernel
    whole = measure_causal_lm(cfg, **args)
    part = measure_causal_lm(cfg, measured_blocks=2, **args)
    assert [x.name for x in part.layers] == [x.name for x in whole.layers]
    assert whole.layers[1].static != whole.layers[2].static  # dense, then MoE
    assert [x.static for x in part.layers] == [x.static for x in whole.layers]
    with pytest.raises(ValueError, match=r"model\.layers\.1 .*measured_blocks to at least 2"):
        measure_causal_lm(cfg, measured_blocks=1, **args)


def test_measure_causal_lm_takes_experts_implementation():
    """HF's default experts (grouped matmul) take no float64, and measure_causal_lm had no way to ask
    for others (its keywords went to measure_profile: a TypeError). With ``experts_implementation=
    "eager"`` a float64 mixture of experts is measured; its static bytes are each layer's parameter
    count x (weight + gradient + AdamW's two float64 moments) = 32 bytes (exact: byte counts)."""
    pytest.importorskip("transformers")
    from zbpp.models.hf import small_config

    cfg = small_config("mixtral", vocab_size=32, hidden_size=16, num_layers=2, num_heads=2)
    prof = measure_causal_lm(cfg, seq=4, steps=1, warmup=0, dtype=torch.float64, experts_implementation="eager")
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    assert [x.static for x in prof.layers[1:3]] == [block * 32.0] * 2


def test_cli_measure_then_plan(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from zbpp.cli import main

    cfg = transformers.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg.save_pretrained(tmp_path)
    out = tmp_path / "prof.json"
    assert main(["measure", "--hf-config", str(tmp_path), "--seq", "8", "--measured-blocks", "1", "--steps", "1",
                 "--warmup", "0", "--dtype", "float64", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "model.layers.3" in text and "host link:" in text
    prof = type(measure_profile(layers=[("l", nn.Linear(2, 2))], example_input=torch.randn(1, 2), steps=1)).load(out)
    # every policy measured on each block, the blocks only (the modules before and after them run as they are)
    assert [x.offers() for x in prof.layers] == [("none",), *[("none", "full", "offload", "selective")] * 4, ("none",)]
    assert prof.host_bytes_per_s > 0
    for q in ("full", "selective", "offload"):  # a row per block and policy, as saved
        assert any(line.split()[:1] == [q] for line in text.splitlines()), q
    assert main(["plan", "--profile", str(out), "-p", "2", "-m", "4"]) == 0
    assert "pick:" in capsys.readouterr().out
    # a budget below keeping everything: the planner reads the measured policies and picks some
    none = search(prof, 2, 4, policies=["none"])
    assert main(["plan", "--profile", str(out), "-p", "2", "-m", "4", "--budget-gb", repr(0.9 * max(none.peak) / 1e9)]) == 0
    assert "policies (one per stage" in capsys.readouterr().out
    assert main(["measure", "--hf-config", str(tmp_path), "--seq", "8", "--dtype", "nope", "-o", str(out)]) == 2
    assert "--dtype 'nope'" in capsys.readouterr().err


def test_cli_measure_charges_adamw_state_for_the_dtype(tmp_path, capsys):
    """``zbpp measure --dtype float32`` without --optimizer-bytes: a block's static bytes are its
    float32 weights and gradients and AdamW's two float32 moments (`_adamw_static_bytes`), not a
    master copy that float32 training does not keep; --optimizer-bytes still overrides. Exact."""
    transformers = pytest.importorskip("transformers")
    from zbpp.cli import main

    cfg = transformers.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg.save_pretrained(tmp_path)
    out = tmp_path / "prof.json"
    run = ["measure", "--hf-config", str(tmp_path), "--seq", "4", "--steps", "1", "--warmup", "0", "--policies",
           "none", "--dtype", "float32", "-o", str(out)]
    assert main(run) == 0
    load = type(measure_profile(layers=[("l", nn.Linear(2, 2))], example_input=torch.randn(1, 2), steps=1)).load
    block = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).model.layers[0]
    assert load(out).layers[1].static == _adamw_static_bytes(list(block.parameters()), master=False)
    assert main([*run, "--optimizer-bytes", "12"]) == 0
    assert load(out).layers[1].static == sum(p.numel() for p in block.parameters()) * (2 * 4 + 12)
    capsys.readouterr()


def test_a_host_link_without_offload_is_refused(tmp_path, capsys):
    """The host link is what offload's copies are timed over; without offload among the policies
    the given bandwidth was dropped without a word (the profile's host_bytes_per_s 0, not 5e9).
    Refused, naming both arguments; with offload it is the profile's."""
    x = torch.randn(3, 4, dtype=torch.float64)
    layers = [("pre", nn.Linear(4, 4).double()), ("blk", nn.Linear(4, 4).double())]
    with pytest.raises(ValueError, match=r"host_bytes_per_s=5000000000.0 is the host link of offload's copies; policies "
                                         r"\['full'\] do not measure offload"):
        measure_profile(layers=layers, example_input=x, steps=1, warmup=0, policies=["full"], host_bytes_per_s=5e9)
    prof = measure_profile(layers=layers, example_input=x, steps=1, warmup=0, policies=["offload"], host_bytes_per_s=5e9)
    assert prof.host_bytes_per_s == 5e9
    transformers = pytest.importorskip("transformers")
    from zbpp.cli import main

    transformers.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    assert main(["measure", "--hf-config", str(tmp_path), "--seq", "4", "--policies", "none,full", "--host-gb-per-s",
                 "5", "-o", str(tmp_path / "p.json")]) == 2
    assert "--host-gb-per-s is the host link of offload's copies, and --policies none,full does not measure offload" \
        in capsys.readouterr().err


@pytest.mark.parametrize("given", ["llama3.json", "configs"])
def test_a_config_path_that_does_not_exist_is_named_at_once(given: str, tmp_path, monkeypatch, capsys):
    """``--hf-config`` is a config.json or a folder holding one. A file name with a typo, or a folder
    without config.json, went to transformers' AutoConfig.from_pretrained, which took it for a Hub
    repo id: offline, it retried for about 35 s and said it could not connect to huggingface.co.
    Refused at once (well under the retries' first 4 s wait), naming the flag and the path."""
    pytest.importorskip("transformers")
    from zbpp.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    start = time.perf_counter()
    assert main(["measure", "--hf-config", given, "--seq", "4", "-o", "p.json"]) == 2
    assert time.perf_counter() - start < 4
    assert f"--hf-config {given}: no such file, nor a folder holding config.json" in capsys.readouterr().err


@pytest.mark.parametrize("device, words", [
    ("nope", "--device 'nope' is not a torch device"),
    ("cuda", "--device cuda: this machine has no cuda device"),
])
def test_a_device_that_cannot_be_used_is_named(device: str, words: str, tmp_path, capsys):
    """``--device nope``, or ``--device cuda`` on a machine without a GPU, ended in a RuntimeError
    traceback from torch's first allocation inside the measurement; the CLI promises one line
    naming the argument and exit code 2."""
    transformers = pytest.importorskip("transformers")
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from zbpp.cli import main

    transformers.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    assert main(["measure", "--hf-config", str(tmp_path), "--seq", "4", "--steps", "1", "--warmup", "0",
                 "--policies", "none", "--device", device, "-o", str(tmp_path / "p.json")]) == 2
    assert words in capsys.readouterr().err


def test_policy_costs_by_hand():
    """An MLP layer (Linear, GELU, Linear) after a first layer, float64, R rows of width W: none
    keeps its input (R W), GELU's input (3 R W) and output (3 R W), W of them the Linears' inputs
    (4 R W); full only the input, W's bytes unchanged; selective the GEMMs' inputs and outputs up
    to the last read, here all of none; offload nothing on the device from F to B, the 7 R W
    copied, and from B to W W's inputs (4 R W), which B brings back to the device for W.
    Recompute: B's measured time less its own, >= 0 (speed not asserted)."""
    R, W = 4, 8
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(W, 3 * W), nn.GELU(), nn.Linear(3 * W, W)).double()
    prof = measure_profile(layers=[("pre", nn.Linear(W, W).double()), ("mlp", mlp)],
                           example_input=torch.randn(R, W, dtype=torch.float64), steps=1, warmup=0,
                           policies=["full", "selective", "offload"], host_bytes_per_s=1e9)
    pre, layer = prof.layers
    assert pre.policies == () and prof.host_bytes_per_s == 1e9
    assert (layer.activation, layer.wgrad) == (7 * R * W * F64, 4 * R * W * F64)
    full, offload, selective = (layer.cost(q) for q in ("full", "offload", "selective"))
    assert (full.activation, full.wgrad, full.copy) == (R * W * F64, 4 * R * W * F64, 0)
    assert (selective.activation, selective.wgrad, selective.copy) == (7 * R * W * F64, 4 * R * W * F64, 0)
    assert (offload.activation, offload.wgrad, offload.copy, offload.recompute) == (0, 4 * R * W * F64, 7 * R * W * F64, 0)
    assert full.recompute >= 0 and selective.recompute >= 0
    with pytest.raises(ValueError, match="activation policy 'ful'"):
        measure_profile(layers=[("mlp", mlp)], example_input=torch.randn(R, W, dtype=torch.float64), policies=["ful"])


def test_a_frozen_embedding_is_profiled_and_its_output_is_the_next_layers_activation():
    """A frozen first layer (an embedding fine-tuning leaves alone) has no output that needs a
    gradient: the pipeline runs its F only (its B and W compute nothing) while the next stages
    train. measure_profile refused such a model ("no output needs a gradient"); and the next layer
    saves the embedding's output for its weight gradient, a per-microbatch activation the pipeline
    holds until W, which the profile left out as if the caller held it. Hand count, exact (bytes)."""
    torch.manual_seed(0)
    emb, up, down = nn.Embedding(10, 8).double(), nn.Linear(8, 8).double(), nn.Linear(8, 4).double()
    emb.requires_grad_(False)
    ids = torch.randint(0, 10, (4, 5))
    prof = measure_profile(layers=[("emb", emb), ("up", up), ("act", nn.Tanh()), ("down", down)],
                           example_input=ids, steps=1, warmup=0)
    le, lu, la, ld = prof.layers
    assert (le.b, le.w, le.activation, le.wgrad) == (0.0, 0.0, 0.0, 0.0)
    hidden = 4 * 5 * 8 * F64  # the embedding's output: up's saved input, read by its W only
    assert lu.activation == lu.wgrad == hidden and lu.b == 0.0 and lu.w > 0
    # the layers after it as without the frozen one: tanh keeps its output, down its input
    assert la.activation == hidden and la.wgrad == 0.0 and ld.activation == ld.wgrad == hidden


def test_measuring_then_training_is_training_without_measuring():
    """measure_profile runs each layer's forward several times: they drew dropout masks from the
    global generator (the step after it drew other masks), and under fp8_autocast moved the zbpp
    layers' FP8 amax histories and scales. Reference: the same steps of a copy that was not
    measured; bit for bit (the same CPU operations on the same values)."""
    import copy

    from zbpp.modules import DelayedScaling, fp8_autocast
    from zbpp.modules import Linear as ZLinear
    from zbpp.modules._scaling_state import scaling_states

    torch.manual_seed(0)
    net = nn.Sequential(ZLinear(16, 32), nn.Sequential(nn.Dropout(0.5), nn.GELU(), ZLinear(32, 16)))
    x = torch.randn(16, 16)

    def trained(measure: bool) -> tuple[list[torch.Tensor], dict]:
        model = copy.deepcopy(net)
        torch.manual_seed(1)
        with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
            if measure:
                measure_profile(layers=[("up", model[0]), ("down", model[1])], example_input=3 * x,
                                steps=1, warmup=0, policies=["full"])
            for _ in range(2):
                model(x).square().sum().backward()
        return [p.grad for p in model.parameters()], scaling_states(model)

    (grads, fp8), (ref_grads, ref_fp8) = trained(True), trained(False)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))
    assert fp8.keys() == ref_fp8.keys()
    for k in fp8:
        assert all(torch.equal(fp8[k][f], ref_fp8[k][f]) for f in ("amax_history", "scale", "casts")), k


def test_pending_wgrads_are_left_as_found():
    """Delayed-wgrad layers with W jobs pending when measure_profile is called (the user's forward
    and backward, one under a microbatch key, one without): the measurement's discard dropped them
    all, so the later backward_dw found nothing pending and the weights missed that gradient.
    Reference: an unmeasured copy given the same forwards, backwards and backward_dw calls; bit for
    bit (the same CPU operations on the same values)."""
    import copy

    from zbpp.modules import Linear as ZLinear
    from zbpp.modules import microbatch

    torch.manual_seed(0)
    net = nn.Sequential(ZLinear(8, 8, delay_wgrad_compute=True), nn.Tanh(),
                        ZLinear(8, 4, delay_wgrad_compute=True)).double()
    x = torch.randn(5, 8, dtype=torch.float64)

    def trained(measure: bool) -> tuple[list[list], list[torch.Tensor]]:
        model = copy.deepcopy(net)
        with microbatch(7):
            model(x).square().sum().backward()
        model(2 * x).square().sum().backward()  # filed under an automatic key
        if measure:
            measure_profile(layers=[("a", model[0]), ("b", model[1:])], example_input=x, steps=1, warmup=0)
        pending = [m.pending_wgrad_keys() for m in (model[0], model[2])]
        for m in (model[0], model[2]):
            for key in m.pending_wgrad_keys():
                m.backward_dw(key)
        return pending, [p.grad for p in model.parameters()]

    (pending, grads), (ref_pending, ref_grads) = trained(True), trained(False)
    assert pending == ref_pending, (pending, ref_pending)
    assert all(g is not None and torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


class _TEStore:
    """Transformer Engine's ``WeightGradStore`` as its layers use it: a FIFO ``queue.Queue`` in
    ``context`` of ``[tensors, func]`` pairs, ``pop`` running the oldest."""

    def __init__(self) -> None:
        import queue

        self.context = queue.Queue()

    def delay_wgrad_compute(self) -> bool:
        return True

    def put(self, tensor_list: list, func) -> None:
        self.context.put([tensor_list, func])

    def pop(self) -> None:
        if self.context.qsize() == 0:
            raise RuntimeError("Pop empty queue.")
        tensor_list, func = self.context.get()
        func(*tensor_list)


class _TELinear(nn.Module):
    """A delayed Linear as Transformer Engine builds one: B files its wgrad in ``wgrad_store``,
    ``backward_dw()`` (no key) computes the oldest."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in, dtype=torch.float64))
        self.wgrad_store = _TEStore()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TELinearFn.apply(x, self.weight, self)

    def backward_dw(self) -> None:
        self.wgrad_store.pop()


class _TELinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, module):
        ctx.save_for_backward(x, w)
        ctx.module = module
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        weight = ctx.module.weight

        def wgrad(g: torch.Tensor, x: torch.Tensor) -> None:
            with torch.no_grad():
                weight.grad = g.t() @ x if weight.grad is None else weight.grad + g.t() @ x

        ctx.module.wgrad_store.put([g, x], wgrad)
        return g @ w, None, None


def test_pending_transformer_engine_wgrads_are_left_as_found():
    """A Transformer-Engine-style layer (FIFO ``backward_dw()``, jobs in ``wgrad_store.context``)
    with a W pending when measure_profile is called: the measurement's W popped the user's job
    (its gradient then dropped with the measurement's .grad) and left its own, which the user's
    backward_dw computed instead: weight.grad came out the example input's gradient, not the
    user's batch's. Reference: an unmeasured twin (same weights) given the same calls; bit for bit
    (the same CPU operations on the same values), and plain autograd of x @ W^T in float64."""
    torch.manual_seed(0)
    x, example = torch.randn(5, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    weight = torch.randn(4, 8, dtype=torch.float64)

    def trained(measure: bool) -> torch.Tensor:
        layer = _TELinear(8, 4)
        with torch.no_grad():
            layer.weight.copy_(weight)
        layer(x.clone().requires_grad_()).square().sum().backward()  # B: one W pending
        if measure:
            measure_profile(layers=[("a", layer)], example_input=example, steps=1, warmup=0)
        assert layer.wgrad_store.context.qsize() == 1
        layer.backward_dw()
        assert layer.wgrad_store.context.qsize() == 0
        return layer.weight.grad

    got, ref = trained(True), trained(False)
    assert torch.equal(got, ref)
    w = weight.clone().requires_grad_()
    (x @ w.t()).square().sum().backward()
    torch.testing.assert_close(got, w.grad, rtol=1e-12, atol=1e-12)  # float64, one GEMM's rounding


def test_an_attention_whose_package_is_missing_is_one_line_naming_the_flag(tmp_path, capsys):
    """`zbpp measure --attn flash_attention_2` without flash-attn installed ended in HF's ImportError
    traceback; now one line naming --attn, exit 2, and no profile written."""
    import importlib.util

    transformers = pytest.importorskip("transformers")
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here: flash_attention_2 may work")
    from zbpp.cli import main

    transformers.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    out = tmp_path / "prof.json"
    assert main(["measure", "--hf-config", str(tmp_path), "--seq", "4", "--steps", "1", "--warmup", "0",
                 "--attn", "flash_attention_2", "-o", str(out)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("zbpp measure: error: --attn flash_attention_2: "), lines
    assert "FlashAttention2" in lines[0] and not out.exists()
