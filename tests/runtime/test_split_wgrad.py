"""The generic B/W split (`Pipeline(split_wgrad=True)`) on stock Hugging Face models, 2 and 4 gloo
ranks, against one process running HF's model on the whole batch (tolerances and FLOP accounting:
`tests.runtime.split_cases`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .split_cases import cuda_case, failed_step_case, hf_case, sent_output_case

W_SCHEDULES = ["zb-h1", "zb-v", "dualpipe-v"]


def _check_flops(results, *, exact: bool = True) -> None:
    """Under the split, B costs exactly the input-gradient backward and W (at least 95% of) the
    rest; a BW task costs the whole backward."""
    for r in results:
        for s, f in r["flops"].items():
            (nb, b), (nw, w), (nbw, bw) = f["B"], f["W"], f["BW"]
            wgrad = f["full"] - f["dgrad"]
            assert wgrad > 0, f"stage {s}: the model has no weight-gradient FLOPs to check"
            assert b == nb * f["dgrad"], f"stage {s}: B did {b} FLOPs, input gradients alone are {nb} x {f['dgrad']}"
            if exact:
                assert w == nw * wgrad, f"stage {s}: W did {w} FLOPs, weight gradients are {nw} x {wgrad}"
            else:
                assert w >= 0.95 * nw * wgrad, f"stage {s}: W did {w} FLOPs < 95% of {nw} x {wgrad}"
            assert bw == nbw * f["full"], f"stage {s}: BW did {bw}, the whole backward is {nbw} x {f['full']}"
            assert nb + nbw > 0


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("name,p", [("1f1b", 2), ("interleaved-1f1b", 2), ("zb-h1", 4), ("zb-v", 2),
                                    ("dualpipe-v", 4)])
def test_hf_model_matches_single_process(zbpp_workers, family, name, p):
    """Loss and every gradient equal HF's whole-batch ones; under W schedules B holds none of the
    weight-gradient FLOPs and W all of them."""
    results = zbpp_workers(p).run(hf_case, family, name, p, count=True)
    if name in W_SCHEDULES:
        _check_flops(results)
        assert all(f["W"][0] > 0 for r in results for f in r["flops"].values())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("name,p", [("1f1b", 4), ("interleaved-1f1b", 2), ("zb-h1", 2), ("zb-v", 2),
                                    ("dualpipe-v", 2)])
def test_delay_wgrad_model_matches_single_process(zbpp_workers, family, name, p):
    """After `delay_wgrad` (GPT-2's Conv1D too) the Linears defer W themselves and the split takes
    the rest: gradients equal HF's whole-batch ones, B does exactly the input gradients' FLOPs and
    W all of the weight gradients'."""
    results = zbpp_workers(p).run(hf_case, family, name, p, count=True, delay=True)
    if name in W_SCHEDULES:
        _check_flops(results)


@pytest.mark.parametrize("ckpt", ["nonreentrant", "reentrant"])
def test_checkpointed_blocks(zbpp_workers, ckpt):
    """torch.utils.checkpoint around every block: gradients exact. Non-reentrant: B still computes
    no weight gradient (its recomputation is a forward); reentrant: torch's checkpoint refuses a
    backward limited to the inputs, so such a stage runs its whole backward in B (documented)."""
    counted = ckpt == "nonreentrant"  # torch refuses the input-only reference backward under reentrant
    results = zbpp_workers(2).run(hf_case, "llama", "zb-v", 2, ckpt=ckpt, count=counted)
    if counted:
        _check_flops(results, exact=False)


def test_reentrant_checkpoint_with_delay_wgrad_keeps_w_apart(zbpp_workers):
    """Reentrant checkpointing runs a stage's backward in B, but after `delay_wgrad` every Linear
    defers its weight gradient itself (filed under the microbatch's key during the recomputation):
    W holds at least 95% of the weight-gradient FLOPs, and B no more than the input gradients plus
    the recomputed forward (the two add up to the whole backward plus that recomputation)."""
    for family in ("llama", "gpt2"):
        results = zbpp_workers(2).run(hf_case, family, "zb-v", 2, ckpt="reentrant", count=True, delay=True)
        for r in results:
            for s, f in r["flops"].items():
                (nb, b), (nw, w) = f["B"], f["W"]
                wgrad = f["full"] - f["dgrad"]
                assert wgrad > 0 and nw > 0, f"{family} stage {s}: {f}"
                assert w >= 0.95 * nw * wgrad, f"{family} stage {s}: W did {w} < 95% of {nw} x {wgrad}"
                assert b <= nb * (f["dgrad"] + f["forward"]), f"{family} stage {s}: B did {b}: {f}"


def test_stage_mixing_zbpp_and_plain_layers(zbpp_workers):
    results = zbpp_workers(2).run(hf_case, "llama", "zb-h1", 2, mix=True, count=True)
    _check_flops(results)


def test_parameter_used_twice(zbpp_workers):
    """A block run twice on one stage: its parameters get both uses' gradients, all in W."""
    _check_flops(zbpp_workers(4).run(hf_case, "llama", "zb-h1", 4, twice=True, count=True))


def test_split_off_keeps_w_empty(zbpp_workers):
    results = zbpp_workers(2).run(hf_case, "gpt2", "zb-h1", 2, split=False, count=True)
    for r in results:
        for s, f in r["flops"].items():
            assert f["W"][1] == 0 and f["B"][1] == f["B"][0] * f["full"], f"stage {s}: {f}"


def test_failed_step_drops_what_w_held(zbpp_workers):
    results = zbpp_workers(2).run(failed_step_case, "gpt2", "zb-h1", 2)
    assert all(r["raised"] for r in results)
    assert all(r["held"] == 0 for r in results)
    assert all(r["grads_after_failure"] == [] for r in results)


def test_data_parallel_reduces_after_last_w(zbpp_workers):
    """dp=2 x pp=2: averaged gradients equal the whole batch's (the reducer checks that no
    gradient is accumulated after its reduction started and that each is reduced once)."""
    zbpp_workers(4).run(hf_case, "gpt2", "zb-h1", 2, dp=2)


def test_sent_output_saved_by_its_own_node(zbpp_workers):
    """A stage's output that its last node saved (sigmoid) is sent and its storage released; the
    split still backpropagates through the saved value."""
    zbpp_workers(2).run(sent_output_case)


@pytest.mark.gpu
def test_split_on_cuda_bf16():
    """One GPU, bf16: the split's gradients equal the unsplit pipeline's (the same GEMMs, one
    bf16 rounding apart at most), B holds no weight-gradient FLOP and W all of them."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r = cuda_case()
    split, plain = r["grads"]
    assert split.keys() == plain.keys() and split
    for n in split:  # bf16: relative 1e-2 covers one rounding of the accumulated gradient
        torch.testing.assert_close(split[n], plain[n], rtol=1e-2, atol=1e-3, msg=lambda m, n=n: f"{n}: {m}")
    _check_flops([r])
    assert r["flops"][1]["B"][1] > 0 and r["flops"][1]["W"][1] > 0  # the second stage really was split


def test_b_frees_what_only_input_side_nodes_saved():
    """A tensor only an input-side node saved (sin's input) is freed after B; one W needs (the
    second Linear's input) is kept; gradients equal a plain backward's (float64, exact ops)."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    from zbpp.runtime._autograd_split import SavedBoxes, StageSplit, backward_input

    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(8, 8).double(), torch.nn.Linear(8, 8).double()
    seen = {}

    def run(split: bool):
        for p in (*l1.parameters(), *l2.parameters()):
            p.grad = None
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
        boxes = SavedBoxes()
        with boxes:
            a = l1(x)
            b = torch.sin(a)
            y = l2(b)
        seen["a"], seen["b"] = StorageWeakRef(a.untyped_storage()), StorageWeakRef(b.untyped_storage())
        del a, b
        g = torch.ones_like(y)
        if split:
            held = backward_input([y], [g], [x], StageSplit(), boxes)
            del y
            gc.collect()
            alive = (not seen["a"].expired(), not seen["b"].expired())
            held.run()
        else:
            y.backward(g)
            alive = None
        return alive, [x.grad] + [p.grad for p in (*l1.parameters(), *l2.parameters())]

    alive, got = run(True)
    _, want = run(False)
    assert alive == (False, True)
    for u, v in zip(got, want):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-14)


def test_b_and_w_free_saved_tensors_as_they_go():
    """B empties what a non-frontier node saved once that node ran, as a plain backward frees it
    (the second sin's input is gone at B's last GEMM); W empties what a frontier node saved once W
    called it (the first Linear's input is gone at W's last GEMM). Gradients equal a plain
    backward's (float64, the same ops)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    from zbpp.runtime._autograd_split import SavedBoxes, StageSplit, backward_input

    class GemmWatch(TorchDispatchMode):
        """At every matrix product: whether the watched storage is already freed."""

        def __init__(self, ref: StorageWeakRef) -> None:
            super().__init__()
            self.ref, self.seen = ref, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default:
                self.seen.append(self.ref.expired())
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(8, 8).double(), torch.nn.Linear(8, 8).double()

    def forward(x):
        b0 = torch.sin(x)
        a1 = l1(b0)  # the frontier node saves b0 (W reads it)
        y = l2(torch.sin(a1))  # sin saves a1 (only B reads it)
        return y, StorageWeakRef(b0.untyped_storage()), StorageWeakRef(a1.untyped_storage())

    def grads(x):
        return [x.grad] + [p.grad for p in (*l1.parameters(), *l2.parameters())]

    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    boxes = SavedBoxes()
    with boxes:
        y, b0, a1 = forward(x)
    with GemmWatch(a1) as in_b:
        held = backward_input([y], [torch.ones_like(y)], [x], StageSplit(), boxes)
    del y
    with GemmWatch(b0) as in_w:
        held.run()
    got = grads(x)
    assert in_b.seen[0] is False and in_b.seen[-1] is True, in_b.seen
    assert in_w.seen[0] is False and in_w.seen[-1] is True, in_w.seen

    for p in (*l1.parameters(), *l2.parameters()):
        p.grad = None
    x.grad = None
    y, _, _ = forward(x)
    y.backward(torch.ones_like(y))
    for u, v in zip(got, grads(x)):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-14)


def test_stage_split_reuses_a_sort_only_for_the_same_structure():
    """One StageSplit across microbatches whose graphs alternate between three structures (a
    data-dependent branch): every microbatch's gradients equal a plain backward's (float64, the
    same ops)."""
    from zbpp.runtime._autograd_split import SavedBoxes, StageSplit, backward_input

    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(8, 8).double(), torch.nn.Linear(8, 8).double()
    params = [*l1.parameters(), *l2.parameters()]

    def forward(x, kind):
        if kind == 0:
            return l2(torch.sin(l1(x)))
        if kind == 1:
            return l2(torch.sin(x)) + l1(x)  # the input's leaf at the same walk position as kind 0
        return l2(l1(x) * 2)

    hint = StageSplit()
    for j, kind in enumerate([0, 1, 0, 2, 1, 2, 0]):
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(j)).requires_grad_()
        for p in params:
            p.grad = None
        with SavedBoxes() as boxes:
            y = forward(x, kind)
        held = backward_input([y], [torch.ones_like(y)], [x], hint, boxes)
        del y, boxes
        held.run()
        got = [x.grad] + [p.grad for p in params]
        x.grad = None
        for p in params:
            p.grad = None
        forward(x, kind).backward(torch.ones(4, 8, dtype=torch.float64))
        for u, v in zip(got, [x.grad] + [p.grad for p in params]):
            torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-14, msg=lambda m, j=j: f"microbatch {j}: {m}")


class _Scale(torch.autograd.Function):
    """``x * w``: a custom Function, so the split computes w's gradient in B (learnt once per stage)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0) if ctx.needs_input_grad[1] else None


class _ScaledLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3, dtype=torch.float64)
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))

    def forward(self, x):
        return _Scale.apply(self.lin(x), self.w)


def test_parameter_b_computes_can_be_frozen_and_thawed_between_steps():
    """A parameter that a custom Function on the input side feeds gets its gradient in B, which the
    stage's split remembers; freezing it between steps (then training it again) leaves every step's
    loss and gradients those of one process on the whole batch (float64; tolerance of
    `split_cases.TOL`: the microbatches' gradients are summed in another order)."""
    import copy

    from zbpp import Pipeline
    from zbpp.schedules import build

    from .split_cases import TOL

    torch.manual_seed(0)
    stages = [_ScaledLinear(), _ScaledLinear()]
    ref = copy.deepcopy(stages)
    pipe = Pipeline(dict(enumerate(stages)), build("zb-v", num_ranks=1, num_microbatches=2),
                    loss_fn=torch.nn.functional.mse_loss)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, dtype=torch.float64, generator=g), torch.randn(4, 3, dtype=torch.float64, generator=g)
    for step, trained in enumerate((True, False, False, True)):
        for m in (*stages, *ref):
            m.w.requires_grad_(trained)
            m.zero_grad()
        loss = pipe.step(x, y)
        want = torch.nn.functional.mse_loss(ref[1](ref[0](x)), y)
        want.backward()
        torch.testing.assert_close(loss, want.detach(), **TOL, msg=lambda m: f"step {step} loss: {m}")
        for s, (mine, theirs) in enumerate(zip(stages, ref)):
            for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
                assert (p.grad is None) == (q.grad is None), f"step {step} stage {s} {name}: {p.grad} vs {q.grad}"
                if q.grad is not None:
                    torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"step {step} stage {s} {name}: {m}")


class _Tower(torch.nn.Module):
    """One stage of an encoder-decoder-like model written with raw parameters: the first embeds the
    tokens and hands on its learned position table (a Parameter, as it is) beside the hidden
    states; the others add the table, run a SwiGLU block and hand the table on as they received it;
    the last projects onto the vocabulary."""

    def __init__(self, first: bool, last: bool, width: int = 6, vocab: int = 11, tokens: int = 5) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7 + 2 * first + last)

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64) / shape[-1] ** 0.5)

        self.first, self.last = first, last
        if first:
            self.tok, self.pos = param(vocab, width), param(tokens, width)
        self.w1, self.w3, self.w2 = param(2 * width, width), param(2 * width, width), param(width, 2 * width)
        if last:
            self.head = param(vocab, width)

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None) -> Any:
        if self.first:
            x, pos = self.tok[x], self.pos
        h = x + pos
        x = x + torch.nn.functional.linear(torch.nn.functional.silu(h @ self.w1.t()) * (h @ self.w3.t()), self.w2)
        return x @ self.head.t() if self.last else (x, pos)


def test_an_input_or_parameter_handed_on_as_it_is_keeps_the_split():
    """A stage output that is a leaf (a received input handed on unchanged, or a Parameter) has no
    graph to split, but the rest of the stage's backward still does: every weight gradient of every
    stage accumulates in a W task, and loss and gradients equal one process running the whole model
    on the whole batch (float64; `split_cases.TOL`: the microbatches' gradients add up in another
    order)."""
    import copy

    from zbpp import Pipeline
    from zbpp.runtime import executor
    from zbpp.schedules import build

    from .split_cases import TOL

    sched = build("zb-interleaved", num_ranks=1, num_microbatches=2, chunks=3)
    stages = [_Tower(s == 0, s == 2) for s in range(3)]
    ref = copy.deepcopy(stages)
    running: list[str] = []  # the kind of the task running now
    kinds: dict[str, set[str]] = {}  # parameter -> kinds of the tasks its gradient accumulated in
    for s, st in enumerate(stages):
        for n, p in st.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _, n=f"{s}.{n}": kinds.setdefault(n, set()).add(running[-1]))
    orig = executor.StepExecutor._run_task

    def run_task(ex, a, *args):
        running.append(a.kind.value)
        try:
            return orig(ex, a, *args)
        finally:
            running.pop()

    g = torch.Generator().manual_seed(1)
    ids, target = torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g)

    def loss_fn(y, t):
        return torch.nn.functional.cross_entropy(y.reshape(-1, y.shape[-1]), t.reshape(-1))

    pipe = Pipeline(dict(enumerate(stages)), sched, loss_fn)
    executor.StepExecutor._run_task = run_task
    try:
        loss = pipe.step(ids, target=target)
    finally:
        executor.StepExecutor._run_task = orig
    x, pos = ref[0](ids)
    x, pos = ref[1](x, pos)
    want = loss_fn(ref[2](x, pos), target)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), **TOL)
    for s, (mine, theirs) in enumerate(zip(stages, ref)):
        for (n, p), q in zip(mine.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"stage {s} {n}: {m}")
    assert kinds and all(k == {"W"} for k in kinds.values()), kinds
