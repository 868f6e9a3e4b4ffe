"""``wgrad_cuda_graph=True``: W captured once into a CUDA graph and replayed (``_wgrad_graph``).

On the CPU (every run): the keyword is validated like the other constructor keywords, and a layer
whose tensors are on the CPU raises a clear error naming the option when W runs, leaving its
wgrad pending.

On a GPU (``-m gpu``): for Linear, LayerNormLinear and LayerNormMLP, bfloat16 and FP8, into
``.grad`` and into ``main_grad``, two steps of four microbatches with different inputs and output
gradients, W in another order than B: the graph layer's gradients equal the eager-W layer's bit
for bit (``torch.equal``: the graph runs the same kernels on copies of the same tensors; a graph
that replayed stale buffers gives the first microbatch's gradient four times and fails), it
captured once and replayed every other W, its wgrad hooks never fired (the eager layer's fired
once per W), and a grad-reduce hook fired after each step's last W through
``get_backward_dw_params()`` ran exactly once per parameter and saw the final gradients.

On 2 GPUs (``-m nccl``): two data-parallel replicas of a one-rank `zbpp.Pipeline` whose stage is
made of graph-W layers: the gradients equal those of the same run with the option off (bitwise,
float32: the same operations in the same order, see `dp_graph_worker`), the reducer reduced each
parameter exactly once per step, and no wgrad hook fired.
"""

from __future__ import annotations

import copy

import pytest
import torch

from zbpp.modules import (
    DelayedScaling,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    fp8_autocast,
    microbatch,
)
from zbpp.testing import gpus_available

HIDDEN, FFN, TOKENS = 64, 128, 96  # multiples of 16: FP8 runs torch._scaled_mm
MAKERS = {
    "Linear": lambda **kw: Linear(HIDDEN, HIDDEN, **kw),
    "LayerNormLinear": lambda **kw: LayerNormLinear(HIDDEN, HIDDEN, **kw),
    "LayerNormMLP": lambda **kw: LayerNormMLP(HIDDEN, FFN, **kw),
}


# -- CPU: the keyword -------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MAKERS))
def test_the_keyword_is_accepted_and_reported(name):
    layer = MAKERS[name](delay_wgrad_compute=True, wgrad_cuda_graph=True)
    assert layer.wgrad_cuda_graph and "wgrad_cuda_graph=True" in repr(layer)
    plain = MAKERS[name](delay_wgrad_compute=True)
    assert not plain.wgrad_cuda_graph and "wgrad_cuda_graph" not in repr(plain)
    assert plain._wgrad_graphs is None  # off: backward_dw's one attribute test, nothing else
    twin = copy.deepcopy(layer)  # graphs are not copied; the option is
    assert twin.wgrad_cuda_graph and len(twin._wgrad_graphs) == 0


@pytest.mark.parametrize("value", ["yes", 1, None])
@pytest.mark.parametrize("name", list(MAKERS))
def test_a_non_bool_is_a_type_error(name, value):
    with pytest.raises(TypeError) as caught:
        MAKERS[name](delay_wgrad_compute=True, wgrad_cuda_graph=value)
    assert str(caught.value).startswith(f"{name}: wgrad_cuda_graph={value!r} is not a bool")


@pytest.mark.parametrize("name", list(MAKERS))
def test_it_needs_delayed_wgrad(name):
    with pytest.raises(ValueError, match=f"{name}: wgrad_cuda_graph=True .*delay_wgrad_compute=True"):
        MAKERS[name](wgrad_cuda_graph=True)


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_cpu_device_is_refused_at_construction(name):
    with pytest.raises(ValueError, match=f"{name}: wgrad_cuda_graph=True .*device='cpu' is not a CUDA"):
        MAKERS[name](delay_wgrad_compute=True, wgrad_cuda_graph=True, device="cpu")


def test_the_unknown_keyword_message_names_it():
    with pytest.raises(TypeError, match="wgrad_cuda_graph"):
        Linear(2, 2, cuda_graph=True)


@pytest.mark.parametrize("name", list(MAKERS))
def test_w_on_the_cpu_raises_naming_the_option_and_keeps_the_wgrad(name):
    layer = MAKERS[name](delay_wgrad_compute=True, wgrad_cuda_graph=True)
    with microbatch(0):
        layer(torch.randn(4, HIDDEN)).sum().backward()
    with pytest.raises(RuntimeError, match=rf"{name}: wgrad_cuda_graph=True .* on cpu.*"
                                           "wgrad_cuda_graph=False"):
        layer.backward_dw(0)
    assert layer.pending_wgrad_keys() == [0]  # still pending: nothing was consumed
    layer.discard_wgrad()
    assert layer.pending_wgrad_keys() == []
    assert layer.wgrad_cuda_graph  # still on: W runs once the layer is on a GPU


# -- GPU: graph W equals eager W ----------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _fp8_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _recipe() -> DelayedScaling:
    return DelayedScaling(margin=0, amax_history_len=4, amax_compute_algo="max")


def _pair(name: str, fused: bool, device: str = "cuda") -> tuple[torch.nn.Module, torch.nn.Module]:
    kw = dict(delay_wgrad_compute=True, fuse_wgrad_accumulation=fused,
              params_dtype=torch.bfloat16, device=device if device != "cpu" else None)
    torch.manual_seed(0)
    eager = MAKERS[name](**kw)
    graph = MAKERS[name](wgrad_cuda_graph=True, **kw)
    graph.load_state_dict(eager.state_dict())
    return eager, graph


def _run_steps(layer, fp8: bool, steps: int, microbatches: int, calls: int = 1):
    device = layer.get_parameter(layer._gemm_names[0][1]).device
    """`steps` steps of `microbatches` B, then W in the order 2, 0, 3, 1, ...; after each step's
    last W, a "reduce" reads every parameter get_backward_dw_params() lists (once each, as the
    runtime's reducer does). Returns per step {param name: its gradient then}, per-param reduce
    counts per step, and the wgrad hook count per step."""
    names = {id(p): n for n, p in layer.named_parameters()}
    hook_calls = [0]
    layer.register_wgrad_accumulation_and_reduce_hooks(
        lambda: hook_calls.__setitem__(0, hook_calls[0] + 1))
    gen = torch.Generator(device=device).manual_seed(123)
    out_features = layer.fc2_weight.shape[0] if hasattr(layer, "fc2_weight") else HIDDEN
    seen, counts, hooks = [], [], []
    for p in layer.parameters():
        if layer.fuse_wgrad_accumulation and p.dim() == 2:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    order = [j for j in (2, 0, 3, 1) if j < microbatches] + list(range(4, microbatches))
    for _ in range(steps):
        layer.zero_grad(set_to_none=True)
        for p in layer.parameters():
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
        hook_calls[0] = 0
        for j in range(microbatches):
            x = torch.randn(TOKENS, HIDDEN, generator=gen, device=device).bfloat16()
            x.requires_grad_(True)
            dy = torch.randn(TOKENS, out_features, generator=gen, device=device).bfloat16()
            with microbatch(j), fp8_autocast(enabled=fp8, fp8_recipe=_recipe()):
                y = sum(layer(x) for _ in range(calls))
            y.backward(dy)
        for j in order:
            layer.backward_dw(j)
        count: dict[str, int] = {}
        grads = {}
        for p in layer.get_backward_dw_params():  # the runtime's reduce, after the last W
            count[names[id(p)]] = count.get(names[id(p)], 0) + 1
        for n, p in layer.named_parameters():
            g = p.main_grad if hasattr(p, "main_grad") else p.grad
            grads[n] = None if g is None else g.clone()
        seen.append(grads)
        counts.append(count)
        hooks.append(hook_calls[0])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return seen, counts, hooks


def _assert_bitwise(want: dict, got: dict, what: str) -> None:
    assert want.keys() == got.keys()
    for n in want:
        w, g = want[n], got[n]
        assert (w is None) == (g is None), f"{what} {n}: {w is None=} {g is None=}"
        if w is not None:
            assert torch.equal(w, g), (
                f"{what} {n}: graph W differs from eager W (max abs diff "
                f"{(w.float() - g.float()).abs().max().item():.3g})")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("accumulate", ["grad", "main_grad"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_gpu_graph_w_equals_eager_w(name, precision, accumulate):
    fp8 = precision == "fp8"
    if fp8 and not _fp8_ok():
        pytest.skip("FP8 GEMMs need compute capability 8.9 or newer")
    eager, graph = _pair(name, fused=accumulate == "main_grad")
    steps, m = 2, 4
    want, want_counts, want_hooks = _run_steps(eager, fp8, steps, m)
    got, got_counts, got_hooks = _run_steps(graph, fp8, steps, m)
    for s in range(steps):
        _assert_bitwise(want[s], got[s], f"step {s}")
    assert want_hooks == [m] * steps  # eager W calls its hooks once per W ...
    assert got_hooks == [0] * steps  # ... hooks inside the graph never fire
    dw_params = {n for n, p in graph.named_parameters()
                 if any(p is q for q in graph.get_backward_dw_params())}
    assert all(c == {n: 1 for n in dw_params} for c in got_counts), got_counts
    assert got_counts == want_counts
    if fp8:  # the bias gradients came from B: W neither lists nor writes them
        assert not any("bias" in n and "layer_norm" not in n for n in dw_params)
    graphs = graph._wgrad_graphs
    assert graphs.captures == 1 and graphs.replays == steps * m, (graphs.captures, graphs.replays)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("accumulate", ["grad", "main_grad"])
def test_gpu_graph_w_of_a_layer_called_twice_per_microbatch(accumulate):
    """Two jobs under one key (a reused weight): the graph sums them as eager W does."""
    eager, graph = _pair("Linear", fused=accumulate == "main_grad")
    want, _, _ = _run_steps(eager, False, 2, 3, calls=2)
    got, _, _ = _run_steps(graph, False, 2, 3, calls=2)
    for s in range(2):
        _assert_bitwise(want[s], got[s], f"step {s}")
    assert graph._wgrad_graphs.captures == 1


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_new_main_grad_buffer_captures_again():
    """The signature includes the main_grad address: a new main_grad buffer (the
    reducer may replace its buckets) is never written through a stale graph."""
    eager, graph = _pair("LayerNormMLP", fused=True)
    want, _, _ = _run_steps(eager, False, 1, 2)
    got, _, _ = _run_steps(graph, False, 1, 2)
    _assert_bitwise(want[0], got[0], "first buffers")
    for layer in (eager, graph):
        for p in layer.parameters():
            if hasattr(p, "main_grad"):
                p.main_grad = torch.zeros_like(p.main_grad)  # a new address
    want, _, _ = _run_steps(eager, False, 1, 2)
    got, _, _ = _run_steps(graph, False, 1, 2)
    _assert_bitwise(want[0], got[0], "new buffers")
    assert graph._wgrad_graphs.captures == 2


# -- CPU stand-in: the bookkeeping around the graph, with a recorder that re-runs the body ------
class _ReplayedBody:
    """A stand-in for a captured CUDA graph: `replay` re-runs the captured body (on the static
    buffers) and copies its results into the first run's output tensors, as a graph rewrites
    its pool tensors. It checks, on the CPU, everything but the capture itself: the signature,
    the static buffers refreshed before every replay, aliases, the .grad accumulation outside
    the graph and main_grad inside it, several jobs under one key, hooks not fired."""

    def __init__(self, body, outs) -> None:
        self.body, self.outs = body, outs

    def replay(self) -> None:
        for (_, kept), (_, fresh) in zip(self.outs, self.body()):
            kept.copy_(fresh)


@pytest.fixture
def stand_in_recorder(monkeypatch):
    from zbpp.modules import _wgrad_graph

    def record(body, warmup, device):
        outs = [(o.param, torch.empty_like(o.grad)) for o in warmup() if not o.to_main_grad]
        return _ReplayedBody(body, outs), outs

    monkeypatch.setattr(_wgrad_graph, "_record", record)
    monkeypatch.setattr(_wgrad_graph, "require_cuda", lambda owner, device: None)


@pytest.mark.parametrize("accumulate", ["grad", "main_grad"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_cpu_stand_in_graph_w_equals_eager_w(stand_in_recorder, name, precision, accumulate):
    fp8 = precision == "fp8"
    eager, graph = _pair(name, fused=accumulate == "main_grad", device="cpu")
    want, want_counts, want_hooks = _run_steps(eager, fp8, 2, 4)
    got, got_counts, got_hooks = _run_steps(graph, fp8, 2, 4)
    for s in range(2):
        _assert_bitwise(want[s], got[s], f"step {s}")
    assert (want_hooks, got_hooks) == ([4, 4], [0, 0]) and got_counts == want_counts
    assert set(v for c in got_counts for v in c.values()) == {1}
    assert (graph._wgrad_graphs.captures, graph._wgrad_graphs.replays) == (1, 8)


def test_cpu_stand_in_two_jobs_under_one_key(stand_in_recorder):
    for accumulate in ("grad", "main_grad"):
        eager, graph = _pair("Linear", fused=accumulate == "main_grad", device="cpu")
        want, _, _ = _run_steps(eager, False, 2, 3, calls=2)
        got, _, _ = _run_steps(graph, False, 2, 3, calls=2)
        for s in range(2):
            _assert_bitwise(want[s], got[s], f"{accumulate} step {s}")
        assert graph._wgrad_graphs.captures == 1


def test_cpu_stand_in_stale_buffers_would_fail(stand_in_recorder, monkeypatch):
    """The comparison catches a graph replayed on stale inputs (here: copies skipped)."""
    from zbpp.modules import _wgrad_graph

    eager, graph = _pair("LayerNormMLP", fused=False, device="cpu")
    want, _, _ = _run_steps(eager, False, 1, 3)
    monkeypatch.setattr(_wgrad_graph, "_copy", lambda dst, src: None)
    got, _, _ = _run_steps(graph, False, 1, 3)
    with pytest.raises(AssertionError, match="graph W differs from eager W"):
        _assert_bitwise(want[0], got[0], "stale")


def test_cpu_stand_in_new_main_grad_or_shape_captures_again(stand_in_recorder):
    eager, graph = _pair("LayerNormMLP", fused=True, device="cpu")
    for _ in range(2):
        want, _, _ = _run_steps(eager, False, 1, 2)
        got, _, _ = _run_steps(graph, False, 1, 2)  # attaches new main_grad tensors
        _assert_bitwise(want[0], got[0], "main_grad")
    assert graph._wgrad_graphs.captures == 2
    with microbatch(9):
        graph(torch.randn(8, HIDDEN).bfloat16()).sum().backward()
    graph.backward_dw(9)
    assert graph._wgrad_graphs.captures == 3 and len(graph._wgrad_graphs) == 3
    graph.clear_wgrad_graphs()
    assert len(graph._wgrad_graphs) == 0


# -- 2 GPUs: data-parallel Pipeline with graph-W stages -------------------------------------------
def _dp_stage(graph: bool, fused: bool, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(5)
    kw = dict(delay_wgrad_compute=True, fuse_wgrad_accumulation=fused,
              device=device if device.type == "cuda" else None,
              wgrad_cuda_graph=graph)
    return torch.nn.Sequential(LayerNormMLP(HIDDEN, FFN, **kw), Linear(HIDDEN, HIDDEN, **kw),
                               LayerNormLinear(HIDDEN, HIDDEN, **kw))


def _patch_stand_in() -> None:
    from zbpp.modules import _wgrad_graph

    def record(body, warmup, device):
        outs = [(o.param, torch.empty_like(o.grad)) for o in warmup() if not o.to_main_grad]
        return _ReplayedBody(body, outs), outs

    _wgrad_graph._record = record
    _wgrad_graph.require_cuda = lambda owner, device: None


def dp_graph_worker(fused: bool, stand_in: bool = False) -> list[str]:
    """dp=2 x pp=1 (float32): the same two steps with the option off and on; returns failures.
    `stand_in` (gloo, CPU): the graph is `_ReplayedBody` (the bookkeeping, not the capture).

    Bitwise equality holds because the only difference is where a bias gradient waits: eager W
    calls the reducer's hook, which (for main_grad parameters) adds each microbatch's bias
    gradient into a zeroed float32 main_grad; graph W adds them up in the float32 .grad, which
    the reducer adds into main_grad after the stage's last W: the same float32 additions."""
    import torch.distributed as dist

    from zbpp import ParallelGroups, Pipeline
    from zbpp.schedules import build

    rank = dist.get_rank()
    if stand_in:
        _patch_stand_in()
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    groups = ParallelGroups(pp=1)
    sched = build("zb-h1", num_ranks=1, num_microbatches=4)
    results = {}
    for graph in (False, True):
        stage = _dp_stage(graph, fused, device)
        hook_calls = [0]
        for m in stage:
            m.register_wgrad_accumulation_and_reduce_hooks(
                lambda: hook_calls.__setitem__(0, hook_calls[0] + 1))
        pipe = Pipeline({0: stage}, sched, torch.nn.functional.mse_loss, groups=groups,
                        device=device)
        grads, counts = [], []
        for step in range(2):
            stage.zero_grad(set_to_none=True)
            g = torch.Generator().manual_seed(100 * step + rank)  # each replica its own data
            x = torch.randn(32, HIDDEN, generator=g).to(device)
            y = torch.randn(32, HIDDEN, generator=g).to(device)
            pipe.step(x, target=y)
            counts.append(dict(pipe.reducer.reduce_counts()))
            grads.append({n: (p.main_grad if hasattr(p, "main_grad") else p.grad).clone()
                          for n, p in stage.named_parameters()})
        results[graph] = (grads, counts, hook_calls[0])
    fails = []
    (want, want_counts, want_hooks), (got, got_counts, got_hooks) = results[False], results[True]
    for step in range(2):
        for n in want[step]:
            if not torch.equal(want[step][n], got[step][n]):
                diff = (want[step][n] - got[step][n]).abs().max().item()
                fails.append(f"rank {rank} step {step} {n}: differs by {diff:.3g}")
        if set(got_counts[step].values()) != {1} or got_counts[step] != want_counts[step]:
            fails.append(f"rank {rank} step {step}: reduce counts {got_counts[step]}")
    if want_hooks != 2 * 4 * 3 or got_hooks != 0:
        fails.append(f"rank {rank}: wgrad hooks eager {want_hooks}, graph {got_hooks}")
    captures = [m._wgrad_graphs.captures for m in stage]
    if captures != [1, 1, 1]:
        fails.append(f"rank {rank}: captures {captures}")
    return fails


@pytest.mark.nccl
@pytest.mark.skipif(not gpus_available(2), reason="needs 2 CUDA GPUs with NCCL")
@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
def test_nccl_dp2_pipeline_with_graph_w(zbpp_workers, fused):
    fails = zbpp_workers(2, backend="nccl", pg_timeout=60).run(dp_graph_worker, fused)
    assert not [f for per_rank in fails for f in per_rank], fails


@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
def test_gloo_dp2_pipeline_with_the_stand_in_recorder(zbpp_workers, fused):
    """The same on 2 gloo CPU ranks with `_ReplayedBody` in place of the CUDA graph."""
    fails = zbpp_workers(2, backend="gloo", pg_timeout=60).run(dp_graph_worker, fused, True)
    assert not [f for per_rank in fails for f in per_rank], fails


def test_cpu_stand_in_an_expanded_input(stand_in_recorder):
    """An input with stride 0 (broadcast rows) is copied into a contiguous static buffer."""
    eager, graph = _pair("Linear", fused=False, device="cpu")
    rows = [torch.randn(1, HIDDEN).bfloat16() for _ in range(2)]
    for layer in (eager, graph):
        for j, row in enumerate(rows):
            with microbatch(j):
                layer(row.expand(TOKENS, HIDDEN)).float().square().sum().backward()
        layer.backward_dw(1)
        layer.backward_dw(0)
    assert torch.equal(graph.weight.grad, eager.weight.grad)
    assert torch.equal(graph.bias.grad, eager.bias.grad)
    assert graph._wgrad_graphs.captures == 1 and graph._wgrad_graphs.replays == 2
