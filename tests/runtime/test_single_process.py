"""The runtime in this process: one-rank schedules (every hand-over in memory, V shapes included),
the tree utilities, and the errors raised before anything runs."""

from __future__ import annotations

import warnings

import pytest
import torch

from zbpp import Pipeline
from zbpp.runtime import PipelineError, ShapeMismatchError
from zbpp.runtime.tree import call, describe, flatten, rebuild, split
from zbpp.schedules import Schedule, available, build
from zbpp.schedules.ir import Action

from .cases import make_schedule, tolerance
from .models import loss_fn, make_batch, make_stage, reference_step

CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", ["plain", "zbpp", "mixed"])
@pytest.mark.parametrize("name", available())
def test_one_rank_matches_reference(name, kind):
    sched = make_schedule(name, 1, 5)
    S = sched.num_stages
    mine = {s: make_stage(s, S, kind) for s in range(S)}
    ref = [make_stage(s, S, "plain") for s in range(S)]
    pipe = Pipeline(mine, sched, loss_fn)
    for step, rows in enumerate((11, 11, 7)):  # uneven split, the same again (cached), a new shape
        inputs, target = make_batch(step, rows)
        loss = pipe.step(inputs, target=target)
        want = reference_step(ref, inputs, target)
        torch.testing.assert_close(loss, want, **tolerance(CPU))
        for s in range(S):
            for (n, a), (_, b) in zip(mine[s].named_parameters(), ref[s].named_parameters()):
                torch.testing.assert_close(a.grad, b.grad, **tolerance(CPU), msg=lambda m: f"stage {s} {n}: {m}")
            mine[s].zero_grad()
            ref[s].zero_grad()


def test_fifo_modules_refused_when_w_leaves_b_order():
    order = [Action.parse(t) for t in "F0.0 B0.0 F0.1 B0.1 W0.1 W0.0".split()]
    sched = Schedule(1, 1, 2, (0,), (tuple(order),), name="w-swapped")
    with pytest.raises(ValueError, match="FIFO|oldest"):
        Pipeline({0: make_stage(0, 1, "fifo")}, sched, loss_fn)
    Pipeline({0: make_stage(0, 1, "zbpp")}, sched, loss_fn)  # keyed modules are fine


def test_wrong_stages_and_missing_distributed_are_explained():
    sched = build("zb-h1", num_ranks=1, num_microbatches=2)
    with pytest.raises(ValueError, match=r"holds stages \[0\].*has \[1\]"):
        Pipeline({1: make_stage(0, 1, "plain")}, sched, loss_fn)
    with pytest.raises(RuntimeError, match="initialize torch.distributed"):
        Pipeline({0: make_stage(0, 2, "plain")}, build("zb-h1", num_ranks=2, num_microbatches=2), loss_fn)


def test_loss_must_be_scalar():
    sched = build("1f1b", num_ranks=1, num_microbatches=2)
    pipe = Pipeline({0: make_stage(0, 1, "plain")}, sched, lambda out, y: (out - y) ** 2)
    inputs, target = make_batch(0, 4)
    with pytest.raises(Exception, match="scalar tensor"):
        pipe.step(inputs, target=target)
    assert all(p.grad is None for p in pipe.parameters())


class _Boom(torch.nn.Module):
    """A linear stage whose forward raises on its third call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(2, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("kaboom")
        return self.lin(x)


def test_stage_error_names_the_task_and_keeps_earlier_gradients():
    """A failed step discards only its own contribution: the gradient accumulated by an earlier step
    is exactly what it was, the same tensor, and the next step adds to it as autograd would."""
    sched = build("zb-h1", num_ranks=1, num_microbatches=4)
    mod = _Boom()
    earlier = torch.full((2, 2), 0.25)
    mod.lin.weight.grad = earlier  # from an earlier step (accumulation without zero_grad)
    pipe = Pipeline({0: mod}, sched, lambda o, y: o.sum())
    with pytest.raises(Exception, match=r"task F0\.2.*kaboom.*discarded") as info:
        pipe.step(torch.ones(8, 2))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert mod.lin.weight.grad is earlier and torch.equal(earlier, torch.full((2, 2), 0.25))
    assert mod.lin.bias.grad is None
    mod.calls = -100
    pipe.step(torch.ones(8, 2))  # usable again, and accumulates on top of the earlier gradient
    ref = torch.nn.Linear(2, 2)
    ref.load_state_dict(mod.lin.state_dict())
    (ref(torch.ones(8, 2)).sum() / 4).backward()  # the batch-mean of the 4 microbatch sums
    assert mod.lin.weight.grad is earlier
    torch.testing.assert_close(mod.lin.weight.grad, ref.weight.grad + 0.25, rtol=0, atol=1e-6)
    torch.testing.assert_close(mod.lin.bias.grad, ref.bias.grad, rtol=0, atol=1e-6)


def test_keep_grads_on_failure_off_drops_every_gradient():
    sched = build("zb-h1", num_ranks=1, num_microbatches=4)
    mod = _Boom()
    mod.lin.weight.grad = torch.ones(2, 2)
    pipe = Pipeline({0: mod}, sched, lambda o, y: o.sum(), keep_grads_on_failure=False)
    with pytest.raises(Exception, match=r"task F0\.2.*set to None"):
        pipe.step(torch.ones(8, 2))
    assert mod.lin.weight.grad is None and mod.lin.bias.grad is None


def test_tree_split_uneven_and_rebuild():
    x = {"a": torch.arange(10).reshape(5, 2), "b": (torch.zeros(5), "keep")}
    parts = split(x, 3)
    assert [p["a"].shape[0] for p in parts] == [2, 2, 1]
    assert all(p["b"][1] == "keep" for p in parts)
    leaves, spec = flatten(parts[0])
    again = rebuild(spec, leaves)
    assert torch.equal(again["a"], parts[0]["a"]) and again["b"][1] == "keep"
    assert describe(parts[2]) == "{'a': int64[1, 2], 'b': (float32[1], 'keep')}"
    assert call(lambda a, b: (a, b), {"a": 1, "b": 2}) == (1, 2)
    assert call(lambda a, b: a + b, (1, 2)) == 3


@pytest.mark.parametrize("bad,msg", [
    ((torch.zeros(4, 2), torch.zeros(3)), "different sizes along dim 0"),
    (torch.tensor(1.0), "0-dimensional"),
    (torch.zeros(2, 2), "fewer than the 3 microbatches"),
    ("text", "no tensor"),
])
def test_tree_split_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        split(bad, 3)


def test_shape_mismatch_error_type_is_exported():
    assert issubclass(ShapeMismatchError, RuntimeError)


def test_a_failed_step_restores_a_user_main_grad():
    """Megatron-style main_grad buffers that the user owns (no data-parallel reducer zeroes them):
    a failed step leaves exactly what earlier steps accumulated there; a good step adds to it."""
    from zbpp.modules import Linear as ZLinear

    sched = build("zb-h1", num_ranks=1, num_microbatches=4)
    torch.manual_seed(3)
    lin = ZLinear(2, 2, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    for p in lin.parameters():
        p.main_grad = torch.full_like(p, 0.5)  # accumulated by earlier steps
    mod = _Boom()
    mod.lin = lin
    pipe = Pipeline({0: mod}, sched, lambda o, y: o.sum())
    with pytest.raises(Exception, match=r"kaboom"):
        pipe.step(torch.ones(8, 2))
    assert all(torch.equal(p.main_grad, torch.full_like(p, 0.5)) for p in lin.parameters())
    mod.calls = -100
    pipe.step(torch.ones(8, 2))
    ref = torch.nn.Linear(2, 2)
    ref.load_state_dict(lin.state_dict())
    (ref(torch.ones(8, 2)).sum() / 4).backward()
    torch.testing.assert_close(lin.weight.main_grad, ref.weight.grad + 0.5, rtol=0, atol=1e-6)


def test_the_stage_walk_lists_what_torch_iterators_list():
    """`modules_and_parameters` (the step's walk: the start agreement's state hash, the gradients
    set aside) gives `modules()` and `parameters()` in their order: shared submodules and tied
    parameters once, None children and parameters skipped."""
    from torch import nn

    from zbpp._compat import modules_and_parameters

    shared = nn.Linear(2, 2)
    tied = nn.Linear(2, 2)
    tied.weight = shared.weight
    root = nn.Sequential(shared, nn.Sequential(nn.ReLU(), shared, tied), nn.ModuleDict({"a": nn.LayerNorm(2)}))
    root.register_module("gone", None)
    root[1][0].register_parameter("nothing", None)
    modules, params = modules_and_parameters(root)
    assert [id(m) for m in modules] == [id(m) for m in root.modules()]
    assert [id(p) for p in params] == [id(p) for p in root.parameters()]


class _TwoExperts(torch.nn.Module):
    """Each row goes to one of two Linear experts by the sign of its first feature; an expert with
    no rows in a microbatch is not called (as MoE code skips an expert without tokens)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4, dtype=torch.float64) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        route = (x[:, 0] > 0).long()
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]))
        return out


@pytest.mark.parametrize("name", ["zb-h1", "zb-v"])
def test_a_delayed_layer_not_called_in_a_microbatch_gets_that_microbatchs_nothing(name):
    """delay_wgrad experts, one of which microbatch 0 never calls: W asks it for a wgrad B never
    filed. Its gradient is then what plain autograd gives, the other microbatches' alone, not an
    error (float64; the same products summed in another order: 1e-12)."""
    from zbpp.modules import delay_wgrad

    sched = build(name, num_ranks=1, num_microbatches=2)
    x = torch.tensor([[1.0, 2, 3, 4], [2, 1, 0, 1], [-1, 0, 2, 1], [3, 1, 1, 1]], dtype=torch.float64)
    assert (x[:2, 0] > 0).all()  # microbatch 0: expert 1 only; microbatch 1: both
    y = torch.ones(4, 4, dtype=torch.float64)
    ref = torch.nn.Sequential(*(_TwoExperts() for _ in range(sched.num_stages)))
    mine = [delay_wgrad(_TwoExperts()) for _ in range(sched.num_stages)]
    pipe = Pipeline(dict(enumerate(mine)), sched, loss_fn)
    for _ in range(2):  # nothing of the first step lingers into the second (gradients accumulate)
        pipe.step(x, target=y)
        loss_fn(ref(x), y).backward()
    for s, stage in enumerate(mine):
        for (n, a), (_, b) in zip(stage.named_parameters(), ref[s].named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"stage {s} {n}: {m}")


def test_no_sync_after_a_synchronised_step_starts_main_grad_afresh():
    """main_grad given by the data-parallel reducer (zbpp Linears with fuse_wgrad_accumulation; one
    process, so the reducer is passed): a synchronised step, then an accumulation window (a step
    inside no_sync(), one outside). main_grad must hold the window's two batches' gradients, as one
    process running them on the plain model: the first step's (its optimizer step used them) is no
    more part of the window than a synchronised step's start keeps it.
    Tolerance: float64, the pipeline sums microbatch gradients where the reference has one GEMM
    (~1e-15 relative); a leftover step is a whole gradient off."""
    from zbpp.modules import Linear as ZLinear
    from zbpp.runtime.grad_reduce import GradReducer

    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 3).double()
    lin = ZLinear(4, 3, delay_wgrad_compute=True, fuse_wgrad_accumulation=True, params_dtype=torch.float64)
    lin.load_state_dict(plain.state_dict())
    mse = torch.nn.functional.mse_loss
    pipe = Pipeline({0: lin}, build("zb-h1", num_ranks=1, num_microbatches=2), mse,
                    reducer=GradReducer({0: lin}, None))
    data = [(torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)) for _ in range(3)]
    pipe.step(data[0][0], target=data[0][1])
    with pipe.no_sync():
        pipe.step(data[1][0], target=data[1][1])
    pipe.step(data[2][0], target=data[2][1])
    for x, y in data[1:]:
        mse(plain(x), y).backward()
    for n, p in lin.named_parameters():
        torch.testing.assert_close(p.main_grad, getattr(plain, n).grad, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{n}: {m}")


def test_a_failed_step_that_rebuilt_the_buckets_keeps_the_no_sync_main_grad():
    """The reducer rebuilds its buckets (new main_grad buffers) at the start of the step after one
    whose readiness differed from its layout (an FP8 layer's first step; here a layer that starts
    delaying its wgrad after the reducer was built). When that step follows a no_sync() step and
    fails, main_grad must hold the no_sync step's gradients again, and the retried step adds its
    own: as one process running the plain model on those two batches.
    Tolerance: float64, as in the test above."""
    from zbpp.modules import Linear as ZLinear
    from zbpp.runtime import PipelineError
    from zbpp.runtime.grad_reduce import GradReducer

    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 3).double()
    lin = ZLinear(4, 3, fuse_wgrad_accumulation=True, params_dtype=torch.float64)
    lin.load_state_dict(plain.state_dict())
    reducer = GradReducer({0: lin}, None)  # lays the buckets out for gradients final after B
    lin.delay_wgrad_compute = True  # from now on W makes them: the layout changes after a step
    armed = {"on": False}
    mse = torch.nn.functional.mse_loss

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if armed["on"]:
            raise RuntimeError("injected loss failure")
        return mse(out, y)

    pipe = Pipeline({0: lin}, build("zb-h1", num_ranks=1, num_microbatches=2), loss, reducer=reducer)
    data = [(torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)) for _ in range(4)]
    pipe.step(data[0][0], target=data[0][1])  # sees the new readiness
    with pipe.no_sync():
        pipe.step(data[1][0], target=data[1][1])
    armed["on"] = True
    with pytest.raises(PipelineError, match="injected loss failure"):
        pipe.step(data[2][0], target=data[2][1])  # rebuilds the buckets, then fails
    armed["on"] = False
    mse(plain(data[1][0]), data[1][1]).backward()
    for n, p in lin.named_parameters():
        torch.testing.assert_close(p.main_grad, getattr(plain, n).grad, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"after the failed step, {n}: {m}")
    pipe.step(data[3][0], target=data[3][1])
    mse(plain(data[3][0]), data[3][1]).backward()
    for n, p in lin.named_parameters():
        torch.testing.assert_close(p.main_grad, getattr(plain, n).grad, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"after the retried step, {n}: {m}")


class _TwoOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 3).double()

    def forward(self, x):
        return self.used(x), self.unused(x)


class _TakesFirst(torch.nn.Module):
    def __init__(self, in_place: bool = False):
        super().__init__()
        self.lin, self.in_place = torch.nn.Linear(3, 1).double(), in_place

    def forward(self, a, unused):  # a stage's tuple input comes as arguments
        if self.in_place:
            a += 1
        return self.lin(a)


def test_an_unused_stage_input_gives_no_gradient_as_in_one_process():
    # stage 1 ignores stage 0's second output: `unused` gets no .grad (None, as in one process, so
    # weight decay leaves it alone), not zeros, and no warning; the rest matches the reference
    torch.manual_seed(0)
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    stages = {0: _TwoOut(), 1: _TakesFirst()}
    pipe = Pipeline(stages, sched, lambda out, y: ((out - y) ** 2).mean())
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.step(x, target=y)
    ref = [_TwoOut(), _TakesFirst()]
    for a, b in zip(ref, stages.values()):
        a.load_state_dict(b.state_dict())
    sum(((ref[1](*ref[0](xs)) - ys) ** 2).mean() / 2 for xs, ys in zip(x.chunk(2), y.chunk(2))).backward()
    assert ref[0].unused.weight.grad is None  # the one-process reference
    assert stages[0].unused.weight.grad is None and stages[0].unused.bias.grad is None
    torch.testing.assert_close(stages[0].used.weight.grad, ref[0].used.weight.grad, rtol=1e-12, atol=0)  # float64


class _TwoOutFifo(torch.nn.Module):
    """`_TwoOut` whose unused branch is a FIFO delayed-wgrad Linear (Transformer Engine's protocol)."""

    def __init__(self):
        super().__init__()
        from .models import FifoLinear

        self.used, self.unused = torch.nn.Linear(3, 3).double(), FifoLinear(3, 3).double()
        torch.nn.init.normal_(self.unused.weight)
        torch.nn.init.zeros_(self.unused.bias)

    def forward(self, x):
        return self.used(x), self.unused(x)


@pytest.mark.parametrize("name", ["zb-v", "interleaved-1f1b"])
def test_an_unused_output_of_a_stage_with_fifo_wgrad_modules_gets_no_gradient(name):
    """A stage with a FIFO module (Transformer Engine's protocol) whose output the next stage does
    not read: its B ran anyway from zeros (W counted its calls at F, so it needed a wgrad queued for
    each), leaving zero .grad where one process leaves None, so AdamW decayed and moved weights that
    one process leaves alone. Now as in one process: None, no warning, the used branch equal to the
    reference (float64, the same products summed in another order: 1e-12)."""
    torch.manual_seed(0)
    stages = {0: _TwoOutFifo(), 1: _TakesFirst()}
    pipe = Pipeline(stages, make_schedule(name, 1, 2), lambda out, y: ((out - y) ** 2).mean())
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # the second step: no wgrad of the first left queued
            pipe.step(x, target=y)
    assert stages[0].unused.weight.grad is None and stages[0].unused.bias.grad is None
    assert stages[0].unused._fifo == []
    ref = [_TwoOut(), _TakesFirst()]
    ref[0].used.load_state_dict(stages[0].used.state_dict())
    ref[1].load_state_dict(stages[1].state_dict())
    for _ in range(2):
        sum(((ref[1](*ref[0](xs)) - ys) ** 2).mean() / 2 for xs, ys in zip(x.chunk(2), y.chunk(2))).backward()
    assert ref[0].unused.weight.grad is None  # the one-process reference
    torch.testing.assert_close(stages[0].used.weight.grad, ref[0].used.weight.grad, rtol=1e-12, atol=1e-12)


def test_an_in_place_change_of_a_received_input_says_to_clone_it():
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    pipe = Pipeline({0: _TwoOut(), 1: _TakesFirst(in_place=True)}, sched, lambda out, y: ((out - y) ** 2).mean())
    with pytest.raises(RuntimeError, match=r"stage 1 changed one of its inputs in place.*h = h.clone\(\)"):
        pipe.step(torch.randn(4, 3, dtype=torch.float64), target=torch.randn(4, 1, dtype=torch.float64))


class _Box:
    def __init__(self, t):
        self.t = t


class _BoxesOne(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 3).double()

    def forward(self, x):
        return self.a(x), _Box(self.b(x))


class _OpensBox(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1).double()

    def forward(self, h, box):
        return self.lin(h + box.t)


def test_a_stage_output_with_tensors_inside_another_value_is_refused():
    # the tensor in the box is no message tensor: across ranks it would go pickled with no gradient back
    # (`b` silently untrained); on one rank stage 1's B would run into stage 0's graph
    sched = build("zb-v", num_ranks=1, num_microbatches=2)
    pipe = Pipeline({0: _BoxesOne(), 1: _OpensBox()}, sched, lambda out, y: ((out - y) ** 2).mean())
    with pytest.raises(PipelineError, match=r"stage 0 returned tensors inside a value of type _Box .*dict or tuple"):
        pipe.step(torch.randn(4, 3, dtype=torch.float64), target=torch.randn(4, 1, dtype=torch.float64))


class _ToFloat32(torch.nn.Module):
    """Keeps the residual stream in float32 under autocast (as models that upcast theirs do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


def _autocast_stages() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), _ToFloat32()) for _ in range(2)]


def test_torch_autocast_around_a_step_with_delayed_linears():
    """``torch.autocast`` (CPU, bfloat16) around `Pipeline.step` (zb-v on one rank: W after B,
    one microbatch late). After `delay_wgrad` a Linear reading a float32 input (the batch, a stream
    kept in float32) ran in bfloat16 and the step failed in W with torch's error about a bfloat16
    gradient for a float32 tensor: now its F refuses it, naming the layer. Left as nn.Linear, the generic split runs
    under autocast and matches one process on the whole batch under the same autocast. Tolerance:
    each microbatch's weight gradient is rounded to bfloat16 (2^-8 relative) before the four are
    summed in float32, the reference's once: a few 4e-3 relative, so 2e-2 of each gradient's norm;
    a lost or doubled microbatch is 1/4 of it."""
    from zbpp.modules import delay_wgrad

    sched = build("zb-v", num_ranks=1, num_microbatches=4)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    delayed = _autocast_stages()
    delay_wgrad(torch.nn.ModuleList(delayed))
    pipe = Pipeline(dict(enumerate(delayed)), sched, torch.nn.functional.mse_loss)
    with autocast, pytest.raises(PipelineError, match=r"task F0\.0.*0\.weight: torch\.autocast ran this layer in "
                                                      r"torch\.bfloat16, its parameters are torch\.float32"):
        pipe.step(x, target=y)
    mine, ref = _autocast_stages(), _autocast_stages()
    pipe = Pipeline(dict(enumerate(mine)), sched, torch.nn.functional.mse_loss)
    with autocast:
        pipe.step(x, target=y)
        loss = torch.nn.functional.mse_loss(ref[1](ref[0](x)), y)
    loss.backward()
    for s in range(2):
        for (n, a), b in zip(mine[s].named_parameters(), ref[s].parameters()):
            assert a.grad.dtype == torch.float32
            err = ((a.grad - b.grad).norm() / b.grad.norm()).item()
            assert err < 2e-2, f"stage {s} {n}: {err}"


def _two_linears() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)).double()


@pytest.mark.parametrize("change", ["delay_wgrad", "swapped_in", "switched_on"])
def test_layers_made_delayed_after_the_pipeline_was_built_are_refused(change):
    """The Pipeline finds a stage's delayed-wgrad layers when it is built. One made delayed after
    (`delay_wgrad` after ``Pipeline(...)``, after a first step, a zbpp Linear swapped in, or one's
    ``delay_wgrad_compute`` turned on) filed its W jobs under the step's keys and nothing ran them:
    its weights silently missed the step's gradients (None, or the earlier steps' alone). Now the
    step refuses it, naming the layer, before computing anything; a layer left as it was still
    matches one process on the whole batch (float64: rtol 1e-12 covers the microbatches' other
    summation order)."""
    from zbpp.modules import Linear as ZLinear
    from zbpp.modules import delay_wgrad

    sched = build("zb-v", num_ranks=1, num_microbatches=4)
    stages = [_two_linears(), _two_linears()]
    ref = [_two_linears(), _two_linears()]
    if change == "switched_on":
        delay_wgrad(stages[1], lambda m, name: name == "0")
        stages[1][0].delay_wgrad_compute = False
    pipe = Pipeline(dict(enumerate(stages)), sched, torch.nn.functional.mse_loss)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)
    pipe.step(x, target=y)
    torch.nn.functional.mse_loss(ref[1](ref[0](x)), y).backward()
    if change == "delay_wgrad":
        delay_wgrad(stages[1])
        late = "0, 2"
    elif change == "swapped_in":
        swapped = ZLinear(4, 4, delay_wgrad_compute=True, params_dtype=torch.float64)
        swapped.load_state_dict(stages[1][2].state_dict())
        swapped.weight.grad, swapped.bias.grad = stages[1][2].weight.grad, stages[1][2].bias.grad
        stages[1][2] = swapped
        late = "2"
    else:
        stages[1][0].delay_wgrad_compute = True
        late = "0"
    before = [p.grad.clone() for p in stages[1].parameters()]
    with pytest.raises(ValueError, match=rf"^stage 1: delayed-wgrad layers {late} \(weight gradients left to W\) "
                                         r"were not so when the Pipeline was built"):
        pipe.step(x, target=y)
    assert all(torch.equal(p.grad, b) for p, b in zip(stages[1].parameters(), before))
    for s in range(2):
        for (n, a), b in zip(stages[s].named_parameters(), ref[s].parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=0, msg=lambda m: f"stage {s} {n}: {m}")
    pipe = Pipeline(dict(enumerate(stages)), sched, torch.nn.functional.mse_loss)  # built after: W runs them
    pipe.step(x, target=y)
    torch.nn.functional.mse_loss(ref[1](ref[0](x)), y).backward()
    for s in range(2):
        for (n, a), b in zip(stages[s].named_parameters(), ref[s].parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=0, msg=lambda m: f"stage {s} {n}: {m}")


class _Lora(torch.nn.Module):
    """A PEFT-style LoRA adapter on a frozen base Linear: ``base(x) + B(A(x)) * 0.5``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(n, n).requires_grad_(False)
        self.lora_A, self.lora_B = torch.nn.Linear(n, 2, bias=False), torch.nn.Linear(2, n, bias=False)
        torch.nn.init.normal_(self.lora_B.weight)  # PEFT starts it at zero: nothing would flow to A

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * 0.5


class _LoraBlock(torch.nn.Module):
    """LoRA on q and v, a shared projection called twice, and a Linear tied to it."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.v = _Lora(4), _Lora(4)
        self.shared, self.tied = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False)
        self.tied.weight = self.shared.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.q(x)) * self.v(x.transpose(-1, -2).transpose(-1, -2))  # a non-contiguous view
        return self.tied(torch.tanh(self.shared(self.shared(h))))


@pytest.mark.parametrize("delayed", [False, True], ids=["generic-split", "delay_wgrad"])
def test_lora_fine_tuning_with_w_late(delayed):
    """LoRA fine-tuning under zb-v on one rank (W after B, one microbatch late), 3-D batches, with
    the generic split or after `delay_wgrad`; two steps accumulated after ``zero_grad(set_to_none=
    False)``: the adapters and the shared and tied weights get one process's whole-batch gradients,
    the frozen bases none (float64: rtol 1e-12 covers the microbatches' summation order)."""
    from zbpp.modules import delay_wgrad

    def make() -> list[torch.nn.Module]:
        torch.manual_seed(0)
        return [_LoraBlock().double(), _LoraBlock().double()]

    stages, ref = make(), make()
    if delayed:
        delay_wgrad(torch.nn.ModuleList(stages))
    pipe = Pipeline(dict(enumerate(stages)), build("zb-v", num_ranks=1, num_microbatches=4),
                    torch.nn.functional.mse_loss)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        if step == 1:  # the first step's gradients become zeros in place; the next two add up
            for m in (*stages, *ref):
                m.zero_grad(set_to_none=False)
        x, y = (torch.randn(8, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
        pipe.step(x, target=y)
        torch.nn.functional.mse_loss(ref[1](ref[0](x)), y).backward()
    for s in range(2):
        for (n, a), b in zip(stages[s].named_parameters(), ref[s].parameters()):
            if "base" in n:
                assert a.grad is None and b.grad is None, f"stage {s} {n}"
            else:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-15, msg=lambda m: f"stage {s} {n}: {m}")


def test_a_b_that_fails_half_way_leaves_no_fifo_wgrad_to_the_next_step():
    """A B that raised half-way (in lin1's backward, after lin2, later in the forward, had filed its
    wgrad) left the key out of the pending ones: a FIFO module's (Transformer Engine's) job of the
    failed step stayed queued, and the next step's W of lin2 computed it in place of its own (stage
    0 lin2.bias off by 0.31), one job leaking further each time. Reference: the plain model on the
    whole batch in this process; the tolerance is the suite's float32 one (`cases.tolerance`)."""
    sched = make_schedule("1f1b", 1, 4)
    mine = {0: make_stage(0, 1, "fifo")}
    ref = [make_stage(0, 1, "plain")]
    pipe = Pipeline(mine, sched, loss_fn)
    seen = []

    def bomb(module, grad_output):  # raises in the second microbatch's B, once
        seen.append(1)
        if len(seen) == 2:
            raise RuntimeError("kaboom in B")

    handle = mine[0].lin1.register_full_backward_pre_hook(bomb)
    inputs, target = make_batch(0, 8)
    with pytest.raises(PipelineError, match="kaboom in B"):
        pipe.step(inputs, target=target)
    handle.remove()
    assert [len(m._fifo) for m in (mine[0].lin1, mine[0].lin2)] == [0, 0]
    inputs, target = make_batch(1, 8)
    loss = pipe.step(inputs, target=target)
    torch.testing.assert_close(loss, reference_step(ref, inputs, target), **tolerance(CPU))
    for (n, a), (_, b) in zip(mine[0].named_parameters(), ref[0].named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, **tolerance(CPU), msg=lambda m: f"{n}: {m}")


class _Twice(torch.nn.Module):
    """One layer applied twice per forward (weight sharing, as a looped block)."""

    def __init__(self, lin: torch.nn.Module) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def test_a_fifo_module_called_twice_per_microbatch_gets_both_wgrads_each_step():
    """A FIFO module (Transformer Engine's) called twice in one forward files two wgrads per
    microbatch; W ran backward_dw() once per microbatch, so half of them stayed queued for the next
    step's W (weight.grad off by 0.12 in the first step, 4 jobs leaking per step). Reference: the
    same model of torch.nn.Linear on the whole batch in this process; tolerance: the suite's float32
    one (`cases.tolerance`), a leaked or missing wgrad differs by O(0.1)."""
    from .models import FifoLinear

    torch.manual_seed(0)
    ref = _Twice(torch.nn.Linear(4, 4))
    fifo = FifoLinear(4, 4)
    fifo.load_state_dict(ref.lin.state_dict())
    mine = _Twice(fifo)
    pipe = Pipeline({0: mine}, make_schedule("1f1b", 1, 4), lambda o, y: (o - y).square().mean())
    for _ in range(2):
        x, y = torch.randn(8, 4), torch.randn(8, 4)
        mine.zero_grad()
        ref.zero_grad()
        pipe.step(x, target=y)
        (ref(x) - y).square().mean().backward()
        for (n, a), (_, b) in zip(mine.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, **tolerance(CPU), msg=lambda m: f"{n}: {m}")
        assert fifo._fifo == []


class _AuxHead(torch.nn.Module):
    """A trunk and an auxiliary head computed on every microbatch; the output adds the head only
    where the microbatch's `use` flags say so (data-dependent), else the head's output goes unread."""

    def __init__(self, trunk: torch.nn.Module, head: torch.nn.Module) -> None:
        super().__init__()
        self.trunk, self.head = trunk, head

    def forward(self, x: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
        h, aux = self.trunk(x), self.head(x)
        return h + aux if bool(use.all()) else h


@pytest.mark.parametrize("name", ["zb-h1", "1f1b"])
@pytest.mark.parametrize("pattern", [(False, True, True), (True, False, True), (False, False, False)])
def test_a_fifo_module_whose_output_some_microbatches_leave_unread(name, pattern):
    """A FIFO module (Transformer Engine's) called on every microbatch but read by the loss only on
    some files no wgrad in the others' B. The forward hook counted every call, so their W popped a
    wgrad nobody filed ("pop from empty list" in W0.0), or another microbatch's. Reference: the same
    model of torch.nn.Linear on the whole batch in this process, float64: the same products summed in
    another order (1e-12); a head never read gets no .grad, as in one process."""
    from .models import FifoLinear

    torch.manual_seed(0)
    ref = _AuxHead(torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 3).double())
    mine = _AuxHead(FifoLinear(3, 3).double(), FifoLinear(3, 3).double())
    mine.load_state_dict(ref.state_dict())
    m = len(pattern)
    pipe = Pipeline({0: mine}, make_schedule(name, 1, m), lambda o, y: (o - y).square().mean())
    use = torch.tensor([u for u in pattern for _ in range(2)])
    for _ in range(2):  # nothing of the first step lingers into the second (gradients accumulate)
        x, y = torch.randn(2 * m, 3, dtype=torch.float64), torch.randn(2 * m, 3, dtype=torch.float64)
        pipe.step((x, use), target=y)
        parts = zip(x.chunk(m), use.chunk(m), y.chunk(m))
        sum((ref(xs, us) - ys).square().mean() / m for xs, us, ys in parts).backward()
        assert mine.trunk._fifo == [] and mine.head._fifo == []
    for (n, a), (_, b) in zip(mine.named_parameters(), ref.named_parameters()):
        if b.grad is None:
            assert a.grad is None, n
        else:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=lambda msg: f"{n}: {msg}")


class _PreAndLayer(torch.nn.Module):
    """A plain Linear (so the layer's input needs a gradient), then ``layer``: tanh of a Linear."""

    def __init__(self, lin: torch.nn.Module) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(3, 3).double()
        self.layer = torch.nn.Sequential(lin, torch.nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.pre(x))


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_a_fifo_module_under_an_activation_policy_that_reruns_it(policy):
    """A FIFO module (Transformer Engine's) inside a layer given the "full" or "selective" policy
    (`zbpp.models.recompute`): the re-run in B counted a second call of the forward, for one wgrad
    filed, so W popped from an empty queue ("pop from empty list" in W0.0). Reference: the same
    model of torch.nn.Linear without a policy on the whole batch in this process, float64: the same
    products summed in another order (1e-12)."""
    from zbpp.models.recompute import apply_activation_policy

    from .models import FifoLinear

    torch.manual_seed(0)
    ref = _PreAndLayer(torch.nn.Linear(3, 3).double())
    mine = _PreAndLayer(FifoLinear(3, 3).double())
    mine.load_state_dict(ref.state_dict())
    apply_activation_policy(mine, {"layer": policy})
    pipe = Pipeline({0: mine}, make_schedule("zb-h1", 1, 2), lambda o, y: (o - y).square().mean())
    for _ in range(2):  # nothing of the first step lingers into the second (gradients accumulate)
        x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
        pipe.step(x, target=y)
        sum((ref(xs) - ys).square().mean() / 2 for xs, ys in zip(x.chunk(2), y.chunk(2))).backward()
        assert mine.layer[0]._fifo == []
    for (n, a), (_, b) in zip(mine.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=lambda msg: f"{n}: {msg}")


def test_unscale_in_one_process_and_its_refusals():
    """`zbpp.runtime.unscale_` on a one-process Pipeline: the loss scaled in loss_fn, the step and
    the scale as torch's ``scaler.step`` on the same model over the whole batch; an
    optimizer without gradients (a rank whose stages got none) still steps and updates, where
    torch's scaler asserts "No inf checks were recorded"; not a Pipeline, a parameter keeping its
    gradient in main_grad (which GradScaler neither unscales nor checks), or a scaler without the
    private fields it reads (another torch), is refused, naming it."""
    from types import SimpleNamespace

    from zbpp.runtime import unscale_

    def run(agree: bool) -> tuple[torch.nn.Module, float]:
        torch.manual_seed(0)
        model, scaler = torch.nn.Linear(4, 2), torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        pipe = Pipeline({0: model}, make_schedule("1f1b", 1, 2), lambda out, y: scaler.scale(torch.nn.functional.mse_loss(out, y)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(4, 4), torch.randn(4, 2)
        if agree:
            pipe.step(x, target=y)
            assert unscale_(pipe, scaler, opt) is False  # nothing overflowed
        else:
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        return model, scaler.get_scale()

    (got, got_scale), (want, want_scale) = run(True), run(False)
    assert got_scale == want_scale
    for a, b in zip(got.parameters(), want.parameters()):  # float32, 2 microbatches' gradients summed: ~1e-7
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    model = torch.nn.Linear(4, 2)
    pipe = Pipeline({0: model}, make_schedule("1f1b", 1, 2), torch.nn.functional.mse_loss)
    unused = torch.nn.Parameter(torch.ones(3))
    opt, scaler = torch.optim.SGD([unused], lr=0.1), torch.amp.GradScaler("cpu")
    with pytest.raises(AssertionError, match="No inf checks were recorded"):  # torch alone
        scaler.scale(torch.ones(()))
        scaler.unscale_(opt)
        scaler.step(opt)
    scaler.update(2.0)  # a new scale: update() without flags asserts too
    opt, scaler = torch.optim.SGD([unused], lr=0.1), torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    assert unscale_(pipe, scaler, opt) is False
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 8.0 and torch.equal(unused, torch.ones(3))
    with pytest.raises(TypeError, match="unscale_ takes a zbpp Pipeline .* got Linear"):
        unscale_(model, scaler, opt)
    model.weight.main_grad = torch.zeros_like(model.weight)  # GradScaler reads .grad only: refused, named
    with pytest.raises(ValueError, match=r"unscale_: stage 0 weight keeps its gradient in main_grad"):
        unscale_(pipe, torch.amp.GradScaler("cpu"), torch.optim.SGD(model.parameters(), lr=0.1))
    del model.weight.main_grad
    fake = SimpleNamespace(is_enabled=lambda: True)
    with pytest.raises(RuntimeError, match="reads torch.amp.GradScaler's _per_optimizer_states, _scale, "
                                           "_lazy_init_scale_growth_tracker, which this SimpleNamespace"):
        unscale_(pipe, fake, opt)


class _CloneFails(torch.Tensor):
    """A ``main_grad`` whose copy fails while `armed` (the memory for it ran out)."""

    armed = False

    def clone(self, *args, **kwargs):
        if _CloneFails.armed:
            raise torch.OutOfMemoryError("injected: no memory for the copy")
        return super().clone(*args, **kwargs)


def test_earlier_gradients_survive_a_copy_that_fails_before_the_first_task():
    # keep_grads_on_failure: the step copies a user's main_grad aside before any task; when that
    # copy fails, the earlier steps' .grad must come back, as one process keeps them (plain autograd
    # on the first batch alone; the file's float32 tolerance: microbatch sums in another order)
    lin, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ref.load_state_dict(lin.state_dict())
    lin.weight.main_grad = torch.zeros(2, 3).as_subclass(_CloneFails)
    pipe = Pipeline({0: lin}, build("1f1b", num_ranks=1, num_microbatches=2), loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), torch.zeros(4, 2)
    pipe.step(x, target=y)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    _CloneFails.armed = True
    try:
        with pytest.raises(PipelineError, match="no memory for the copy"):
            pipe.step(x, target=y)
    finally:
        _CloneFails.armed = False
    for (n, a), b in zip(lin.named_parameters(), ref.parameters()):
        assert a.grad is not None, f"{n}: the earlier steps' gradient was lost"
        torch.testing.assert_close(a.grad, b.grad, **tolerance(CPU), msg=n)
