"""zbpp.models.pipeline_stages on a torchtitan-style model in one process: the stages of every rank,
run one after the other, compute the whole model's output (float64, same values: exact up to
summation order, 1e-12); they keep the model's parameter names; a Parameter two stages share comes
back tied without being named, one object where one rank holds both stages; values do not depend
on the split; the model given is left on meta; bad input is named."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from zbpp.models import fqns_per_stage, pipeline_stages
from zbpp.schedules import build

TOL = {"rtol": 1e-12, "atol": 1e-12}


class Tiny(nn.Module):
    """torchtitan's convention: forward skips the modules a stage does not hold."""

    def __init__(self, layers: int = 4, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 6)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(layers))
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 20, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def tiny(**kw) -> Tiny:
    torch.manual_seed(0)
    return Tiny(**kw).double()


def all_stages(model, name, p, **kw):
    sched = build(name, num_ranks=p, num_microbatches=2 * p, **({"chunks": 2} if name == "interleaved-1f1b" else {}))
    out = {}
    tied = {}
    for r in range(p):
        stages, t = pipeline_stages(model, sched, r, blocks="layers", **kw)
        out.update(stages)
        tied[r] = t
    return sched, out, tied


@pytest.mark.parametrize("name,p", [("1f1b", 2), ("zb-v", 2), ("interleaved-1f1b", 2), ("1f1b", 4)])
def test_stages_in_a_row_are_the_model(name, p):
    ref = tiny(layers=8)
    with torch.device("meta"):
        meta = Tiny(layers=8).double()
    sched, stages, tied = all_stages(meta, name, p, state_dict=ref.state_dict())
    x = torch.randint(0, 20, (3, 5))
    h = x
    for s in range(sched.num_stages):
        h = stages[s](h)
    torch.testing.assert_close(h, ref(x), **TOL)
    # the stages' state_dicts hold the model's own names, between them all of them
    keys = [k for s in stages.values() for k in s.state_dict()]
    assert set(keys) == set(ref.state_dict())
    assert all(q.is_meta for q in meta.parameters())  # the model given is left as it was
    # the tie is found: named by its first name, on the ranks holding stage 0 and the last stage
    holders = {r for r, t in tied.items() if t}
    assert holders == {sched.rank_of(0), sched.rank_of(sched.num_stages - 1)}
    for r in holders:
        assert list(tied[r]) == ["embed.weight"]
    last = sched.num_stages - 1
    if sched.rank_of(0) == sched.rank_of(last):  # V: one Parameter in both stages
        assert stages[0].embed.weight is stages[last].head.weight is tied[0]["embed.weight"]
    else:
        assert stages[0].embed.weight is not stages[last].head.weight


def test_values_depend_on_seed_and_name_not_on_split():
    with torch.device("meta"):
        meta = Tiny(layers=8, tie=False)
    _, two, _ = all_stages(meta, "1f1b", 2, seed=3)
    _, four, _ = all_stages(meta, "zb-v", 2, seed=3)
    _, other, _ = all_stages(meta, "1f1b", 2, seed=4)
    a = {n: q for s in two.values() for n, q in s.named_parameters()}
    b = {n: q for s in four.values() for n, q in s.named_parameters()}
    c = {n: q for s in other.values() for n, q in s.named_parameters()}
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not any(torch.equal(a[n], c[n]) for n in a if n.endswith("weight") and not n.startswith("norm"))


def test_factory_and_default_init():
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    stages, tied = pipeline_stages(lambda: Tiny(), sched, 0, blocks="layers")
    assert sorted(stages) == [0] and list(tied) == ["embed.weight"]
    assert all(not q.is_meta and torch.isfinite(q).all() for q in stages[0].parameters())
    assert stages[0].head is None and stages[0].norm is None
    assert [n for n, _ in stages[0].layers.named_children()] == ["0", "1"]


def test_explicit_fqns():
    with torch.device("meta"):
        meta = Tiny(layers=3)
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    fqns = [["embed", "layers.0"], ["layers.1", "layers.2", "norm", "head"]]
    stages, tied = pipeline_stages(meta, sched, 1, module_fqns_per_stage=fqns)
    assert list(stages[1].state_dict()) == ["layers.1.weight", "layers.1.bias", "layers.2.weight", "layers.2.bias",
                                            "norm.weight", "norm.bias", "head.weight"]
    assert list(tied) == ["embed.weight"] and tied["embed.weight"] is stages[1].head.weight


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
        self.scale = nn.Module()
        self.scale.gain = nn.Parameter(torch.ones(2))  # no reset_parameters initialises it


def test_uninitialised_values_are_reported():
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ValueError, match=r"\['scale.gain \(stage 1\)'\] hold no values after initialisation"):
        pipeline_stages(Custom, sched, 1, blocks="layers")
    stages, _ = pipeline_stages(Custom, sched, 1, blocks="layers",
                                init=lambda m: [nn.init.ones_(q) for q in m.parameters()])
    assert torch.equal(stages[1].scale.gain, torch.ones(2))


class Rotary(nn.Module):
    # torchtitan's form: a non-persistent table its model's init_weights computes (no reset_parameters)
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
        self.register_buffer("freqs", torch.empty(2), persistent=False)


def test_an_unfilled_non_persistent_buffer_asks_for_init_not_a_state_dict():
    # a state_dict can never hold it: the error must not send the user there
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ValueError, match=r"\['freqs \(stage 0\)'\] .*non-persistent buffers, which no state_dict"):
        pipeline_stages(Rotary, sched, 0, blocks="layers", state_dict=Rotary().state_dict())
    fill = lambda m: m.freqs.fill_(2.0) if isinstance(m, Rotary) else m.reset_parameters()  # noqa: E731
    stages, _ = pipeline_stages(Rotary, sched, 0, blocks="layers", init=fill)
    assert torch.equal(stages[0].freqs, torch.full((2,), 2.0))


class Masked(nn.Module):
    # an own model's integer and bool buffers (a causal mask, position ids): no NaN marks them unfilled
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))
        self.register_buffer("causal", torch.ones(3, 3, dtype=torch.bool).triu(1), persistent=False)
        self.register_buffer("positions", torch.arange(3) * 5)


def test_unfilled_integer_and_bool_buffers_are_reported_not_left_as_garbage():
    # their meta values are lost; left as torch.empty made them, a stage would mask and index with
    # whatever the memory held
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ValueError, match=r"\['positions \(stage 0\)'\] hold no values after initialisation"):
        pipeline_stages(Masked, sched, 0, blocks="layers", init=lambda m: m.causal.fill_(True)
                        if isinstance(m, Masked) else m.reset_parameters())
    with pytest.raises(ValueError, match=r"\['causal \(stage 0\)'\] .*non-persistent buffers"):
        pipeline_stages(Masked, sched, 0, blocks="layers", state_dict=Masked().state_dict())
    want = Masked()

    def fill(m: nn.Module) -> None:
        if isinstance(m, Masked):
            m.causal.copy_(want.causal)
            m.positions.data = want.positions.clone()  # replaced, not written in place: filled too
        else:
            m.reset_parameters()

    stages, _ = pipeline_stages(Masked, sched, 0, blocks="layers", init=fill)
    assert torch.equal(stages[0].causal, want.causal) and torch.equal(stages[0].positions, want.positions)


def test_bad_input_is_named():
    with torch.device("meta"):
        meta = Tiny(layers=3)
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ValueError, match="has 1 lists but the schedule has 2 stages"):
        pipeline_stages(meta, sched, 0, module_fqns_per_stage=[["embed"]])
    with pytest.raises(ValueError, match=r"module_fqns_per_stage\[1\]: 'layers.7' names no submodule"):
        pipeline_stages(meta, sched, 0, module_fqns_per_stage=[["embed"], ["layers.7"]])
    with pytest.raises(ValueError, match=r"no stage holds \['layers.2.weight'"):
        pipeline_stages(meta, sched, 0, module_fqns_per_stage=[["embed", "layers.0"], ["layers.1", "norm", "head"]])
    with pytest.raises(ValueError, match="'layers.0' \\(with parameters\\) is listed for stages 0 and 1"):
        pipeline_stages(meta, sched, 0, module_fqns_per_stage=[["embed", "layers.0"],
                                                               ["layers.0", "layers.1", "layers.2", "norm", "head"]])
    with pytest.raises(ValueError, match="overlaps"):
        pipeline_stages(meta, sched, 0, module_fqns_per_stage=[["embed", "layers"], ["layers.1", "norm", "head"]])
    with pytest.raises(ValueError, match=r"pp_rank must be an int in \[0, 2\)"):
        pipeline_stages(meta, sched, 2, blocks="layers")
    with pytest.raises(ValueError, match="blocks='norm' is a LayerNorm"):
        fqns_per_stage(meta, 2, blocks="norm")
    with pytest.raises(ValueError, match=r"state_dict lacks \['head.weight', 'layers.2.bias'"):
        pipeline_stages(meta, sched, 1, blocks="layers", state_dict={"layers.1.weight": torch.zeros(6, 6)})


def test_a_declared_tie_the_pipeline_cannot_see_warns():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tied as declared: no warning, and the tie is found
        _, tied = pipeline_stages(model, sched, 1)
    assert list(tied) == ["model.embed_tokens.weight"]
    with torch.device("meta"):
        model.lm_head.weight = nn.Parameter(torch.empty(32, 8))  # untied behind the config's back
    with pytest.warns(UserWarning, match="declares 'lm_head.weight' tied to 'model.embed_tokens.weight', but they "
                                         "are two Parameters"):
        _, tied = pipeline_stages(model, sched, 1)
    assert tied == {}


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


class Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(3, 3), Scale(), nn.Linear(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_stages_must_hold_a_container_in_its_order_each_child_once():
    # a stage iterates its part of a container in the container's order: blocks listed out of order
    # across stages, or a parameter-free Sequential child on two stages (run twice), would compute
    # another function than the model (max error 5.9 and 1.2 before this was refused)
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    ref = tiny(layers=4)
    with torch.device("meta"):
        meta = Tiny(layers=4).double()
    x = torch.randint(0, 20, (3, 5))
    good = [["embed", "layers.1", "layers.0"], ["layers.2", "layers.3", "norm", "head"]]  # order in a stage: free
    stages = {}
    for r in range(2):
        stages.update(pipeline_stages(meta, sched, r, module_fqns_per_stage=good, state_dict=ref.state_dict()).modules)
    torch.testing.assert_close(stages[1](stages[0](x)), ref(x), **TOL)
    swapped = [["embed", "layers.2", "layers.3"], ["layers.0", "layers.1", "norm", "head"]]
    with pytest.raises(ValueError, match="stage 0 holds layers.3 and stage 1 holds layers.0 of ModuleList 'layers'"):
        pipeline_stages(meta, sched, 0, module_fqns_per_stage=swapped, state_dict=ref.state_dict())
    with torch.device("meta"):
        seq = Seq()
    twice = [["layers.0", "layers.1"], ["layers.1", "layers.2"]]
    with pytest.raises(ValueError, match=r"both list \['layers.1'\], which would run twice"):
        pipeline_stages(seq, sched, 0, module_fqns_per_stage=twice)
    stages, _ = pipeline_stages(seq, sched, 1, module_fqns_per_stage=[["layers.0", "layers.1"], ["layers.2"]])
    assert [n for n, _ in stages[1].layers.named_children()] == ["2"]


class Guarded(nn.Module):
    """A parameter-free final norm that torchtitan's convention skips where a stage lacks it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))
        self.norm = nn.LayerNorm(3, elementwise_affine=False)
        self.act = nn.Sequential(Scale())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        x = self.act(x) if self.act is not None else x
        return self.norm(x) if self.norm is not None else x


def test_a_module_without_state_that_no_stage_lists_is_refused():
    # no stage holds it, so it is None on every stage: the guarded forward skips it and the stages
    # computed another function than the model, without an error; listed, they are the model
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    torch.manual_seed(0)
    ref = Guarded().double()
    with torch.device("meta"):
        meta = Guarded().double()
    with pytest.raises(ValueError, match=r"no stage lists \['norm', 'act'\] \(modules without parameters"):
        pipeline_stages(meta, sched, 1, module_fqns_per_stage=[["layers.0"], ["layers.1"]])
    fqns = [["layers.0"], ["layers.1", "act", "norm"]]
    stages = {}
    for r in range(2):
        stages.update(pipeline_stages(meta, sched, r, module_fqns_per_stage=fqns, state_dict=ref.state_dict()).modules)
    x = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(stages[1](stages[0](x)), ref(x), **TOL)


@pytest.mark.parametrize("pattern", ["layers.*", ""])
def test_activation_policies_set_on_the_model_hold_in_its_stages(pattern):
    """A model with real weights given activation policies (on its blocks, or on the model itself),
    then cut: each stage runs its own modules under the policy. A held block is a deep copy, a stage
    a shallow copy of the model: both kept the given model's wrapped forward and ran its modules
    (measured: outputs off by 6.8 and 68). Gradients as the model's without a policy (TOL)."""
    from zbpp.models.recompute import activation_policies, apply_activation_policy

    ref = tiny(layers=4, tie=False)
    model = tiny(layers=4, tie=False)
    with torch.no_grad():  # values the stages do not load: a stage running the model's own shows
        for q in model.parameters():
            q.mul_(3)
    apply_activation_policy(model, {pattern: "full"})
    sched, stages, _ = all_stages(model, "1f1b", 2, state_dict=ref.state_dict())
    x = torch.randint(0, 20, (3, 5))
    h = x
    for s in range(sched.num_stages):
        h = stages[s](h)
    want = ref(x)
    torch.testing.assert_close(h, want, **TOL)
    h.square().sum().backward()
    want.square().sum().backward()
    for s in stages.values():
        for n, q in s.named_parameters():
            torch.testing.assert_close(q.grad, ref.get_parameter(n).grad, **TOL)
    assert all(q.grad is None for q in model.parameters())
    assert activation_policies(stages[1]) == ({"": "full"} if pattern == "" else {"layers.2": "full", "layers.3": "full"})


class _TiedOutput(nn.Module):
    """Its output head is the embedding's weight, read after the blocks (no head module of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 6)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h) @ self.embed.weight.T


class _SharedPositions(Tiny):
    """A learned position table that every block and the output use (beside the embedding)."""

    def __init__(self) -> None:
        super().__init__(tie=False)
        self.pos = nn.Embedding(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[-1], device=x.device)
        x = self.embed(x)
        for layer in self.layers:
            x = x + torch.tanh(layer(x + self.pos(positions)))
        return self.head(self.norm(x + self.pos(positions)))


@pytest.mark.parametrize("make,unclear", [(_TiedOutput, r"\{'embed': \['after', 'before'\]\}"),
                                          (_SharedPositions, r"\{'pos': \['after', 'before', 'blocks'\]\}")])
def test_a_module_used_beyond_the_first_stage_is_refused_at_build_without_example(make, unclear):
    # without example= (not a Hugging Face model) registration order put the module on the first stage
    # only, and the last stage's first forward failed on it (None); a forward on two token ids finds
    # the use and refuses when the stages are built, naming the module and example=
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ValueError, match=f"cannot place {unclear} .*guessed without example=.*pass example="):
        pipeline_stages(make, sched, 1, blocks="layers")
    # a model whose modules the ids' forward places as registration order does: built as before
    with torch.device("meta"):
        plain = Tiny()
    assert fqns_per_stage(plain, 2, blocks="layers") == [["embed", "layers.0", "layers.1"],
                                                         ["layers.2", "layers.3", "norm", "head"]]
    # a model with values is not run unasked (it would compute, draw and move running statistics):
    # registration order, and the random stream untouched
    real, state = make(), torch.random.get_rng_state()
    assert fqns_per_stage(real, 2, blocks="layers")[0][0] == "embed"
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_meta_device_is_refused_before_anything_is_built():
    # stages on the meta device hold no values: the init check failed deep inside, on a meta
    # tensor's .item(); now both builders name the argument, before building or reading anything
    transformers = pytest.importorskip("transformers")
    from zbpp.models.hf import causal_lm_stages

    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    built = []

    def model() -> nn.Module:
        built.append(1)
        return Tiny()

    for device in ("meta", torch.device("meta")):
        with pytest.raises(ValueError, match=r"^pipeline_stages: device='meta' gives stages without values"):
            pipeline_stages(model, sched, 0, device=device)
    assert not built
    config = transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      vocab_size=16)
    with pytest.raises(ValueError, match=r"^causal_lm_stages: device='meta' gives stages without values"):
        causal_lm_stages(config, sched, 0, device="meta")
    with pytest.raises(ValueError, match=r"^causal_lm_stages: device='meta'"):  # refused before the directory is read
        causal_lm_stages("/nonexistent/zbpp-dir", sched, 0, device="meta")
