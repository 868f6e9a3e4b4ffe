"""What every rank runs in the split-wgrad tests: stock Hugging Face models cut into stages.

`hf_case` builds a tiny random ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` (float64, eager
attention, the same seed on every rank), cuts it into one block per stage (the first stage adds
the embeddings, the last the final norm and the LM head; GPT-2's LM head is tied to its
embedding), runs one `Pipeline.step` and compares with one process running HF's whole model on the
whole batch: the loss and every parameter's gradient.

Tolerance: float64, ``rtol=1e-9, atol=1e-12``. The pipeline sums per-microbatch gradients where the
reference does whole-batch GEMMs: the two differ by rounding of a different summation order
(~1e-16 relative per add over a few hundred adds); a lost, doubled or misplaced gradient moves
them by >= 1/m relative.

FLOPs (``count=True``): every B, W and BW task runs under ``torch.utils.flop_counter.FlopCounterMode``
(the executor's task methods wrapped here, test-only), and each stage's backward is measured alone
on inputs of a microbatch's shapes: ``full`` (every gradient) and ``dgrad`` (only the stage input's,
``torch.autograd.grad``). B must cost exactly ``dgrad`` (no weight-gradient FLOP), W the rest.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from zbpp import Pipeline
from zbpp.runtime import executor as _executor

from .cases import make_schedule

TOL = {"rtol": 1e-9, "atol": 1e-12}
H, T, V = 16, 8, 32  # hidden size, tokens per row, vocabulary


# -- models -------------------------------------------------------------------------------------
def hf_model(family: str, layers: int, seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = GPT2Config(vocab_size=V, n_positions=T, n_embd=H, n_layer=layers, n_head=2, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, attn_implementation="eager")
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=layers,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=T,
                          tie_word_embeddings=False, attn_implementation="eager")
        model = LlamaForCausalLM(cfg)
    return model.double()


def _causal(like: torch.Tensor) -> torch.Tensor:
    """HF's eager additive mask: 0 where a token may attend, the dtype's minimum elsewhere."""
    t = like.shape[1]
    return torch.full((t, t), torch.finfo(like.dtype).min, dtype=like.dtype, device=like.device).triu(1)[None, None]


class HFStage(nn.Module):
    """Blocks `first..last` of an HF model (the very same modules), plus the embeddings on the first
    stage and the final norm and LM head on the last; ``ckpt``: checkpoint every block."""

    def __init__(self, model: nn.Module, family: str, blocks: list[int], first: bool, last: bool,
                 ckpt: str | None = None) -> None:
        super().__init__()
        self.family, self.first, self.last, self.ckpt = family, first, last, ckpt
        base = model.transformer if family == "gpt2" else model.model
        layers = base.h if family == "gpt2" else base.layers
        self.blocks = nn.ModuleList([layers[i] for i in blocks])
        if first:
            self.embed = base.wte if family == "gpt2" else base.embed_tokens
            self.pos = base.wpe if family == "gpt2" else None
        if last:
            self.norm = base.ln_f if family == "gpt2" else base.norm
            self.head = model.lm_head
        self.rotary = base.rotary_emb if family != "gpt2" else None

    def _block(self, block: nn.Module, h: torch.Tensor, mask: torch.Tensor, pos: Any) -> torch.Tensor:
        if self.family == "gpt2":
            out = block(h, None, mask)
        else:
            out = block(h, attention_mask=mask, position_embeddings=pos)
        return out[0] if isinstance(out, tuple) else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        at = torch.arange(x.shape[1], device=x.device)[None]
        if self.first:
            h = self.embed(x)
            if self.pos is not None:
                h = h + self.pos(at)
        else:
            h = x
        mask = _causal(h)
        pos = self.rotary(h, at) if self.rotary is not None else None
        for b in self.blocks:
            if self.ckpt is None:
                h = self._block(b, h, mask, pos)
            else:
                h = checkpoint(lambda y, b=b: self._block(b, y, mask, pos), h, use_reentrant=self.ckpt == "reentrant")
        if self.last:
            h = self.head(self.norm(h))
        return h


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _mix_zbpp_layers(model: nn.Module, family: str) -> None:
    """Swap the MLP's first projection(s) of every block for zbpp's delayed-wgrad Linear, holding
    the same values (the reference keeps torch's)."""
    from zbpp.modules import Linear as ZLinear

    assert family == "llama"
    for layer in model.model.layers:
        for name in ("gate_proj", "up_proj"):
            old = getattr(layer.mlp, name)
            new = ZLinear(old.in_features, old.out_features, bias=False, delay_wgrad_compute=True,
                          params_dtype=torch.float64)
            with torch.no_grad():
                new.weight.copy_(old.weight)
            setattr(layer.mlp, name, new)


def _stage_blocks(s: int, num_stages: int, twice: bool) -> list[int]:
    """Block i on stage i; with `twice`, the middle stage runs its block two times (one Parameter
    used at two places of the input path)."""
    return [s, s] if twice and s == num_stages // 2 else [s]


def _reference_model(family: str, num_stages: int, twice: bool) -> tuple[nn.Module, dict[str, nn.Parameter]]:
    """HF's model (with `twice`, its middle block listed twice) and its parameters by their names
    in the model as built."""
    model = hf_model(family, num_stages)
    params = dict(model.named_parameters())
    if twice:  # HF's own loop runs the listed blocks: list the middle one twice
        layers = model.model.layers
        order = [i for s in range(num_stages) for i in _stage_blocks(s, num_stages, twice)]
        model.model.layers = nn.ModuleList([layers[i] for i in order])
        model.config.num_hidden_layers = len(order)
    return model, params


def make_batch(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (rows, T), generator=g), torch.randint(0, V, (rows, T), generator=g)


# -- FLOPs --------------------------------------------------------------------------------------
class TaskFlops:
    """Counts the FLOPs of each B, W and BW task of this rank, per stage (wraps the executor)."""

    def __init__(self) -> None:
        self.flops: dict[tuple[int, str], int] = {}
        self.count: dict[tuple[int, str], int] = {}

    @contextlib.contextmanager
    def installed(self):
        ex = _executor.StepExecutor
        orig = ex._run_task

        def run(exself, a, *args):
            if a.kind.value == "F":
                return orig(exself, a, *args)
            with FlopCounterMode(display=False) as fc:
                orig(exself, a, *args)
            key = (a.stage, a.kind.value)
            self.flops[key] = self.flops.get(key, 0) + fc.get_total_flops()
            self.count[key] = self.count.get(key, 0) + 1

        ex._run_task = run
        try:
            yield self
        finally:
            ex._run_task = orig


def stage_flops(stage: nn.Module, first: bool, last: bool, rows: int, weight: float) -> tuple[int, int]:
    """(full, dgrad): matmul FLOPs of one microbatch's backward of `stage` alone: every gradient,
    and only the stage input's (delayed-wgrad modules' W counted with the first)."""
    return _backward_flops(
        stage, last, weight,
        lambda: torch.randint(0, V, (rows, T)) if first else torch.randn(rows, T, H, dtype=torch.float64, requires_grad=True),
        lambda: torch.randint(0, V, (rows, T)))


def _backward_flops(stage: nn.Module, last: bool, weight: float, make_input: Any, make_target: Any) -> tuple[int, int]:
    from zbpp.runtime.wgrad import delayed_modules

    out = []
    for only_input in (False, True):
        x = make_input()
        y = stage(x)
        root = loss_fn(y, make_target()) * weight if last else y
        g = None if last else torch.randn_like(y)
        with FlopCounterMode(display=False) as fc:
            if only_input:
                if x.requires_grad:
                    torch.autograd.backward([root], None if g is None else [g], inputs=[x])
            else:
                torch.autograd.backward([root], None if g is None else [g])
                for d in delayed_modules(stage):
                    d.backward_dw()
        for d in delayed_modules(stage):
            d.discard_wgrad()
        out.append(fc.get_total_flops())
    stage.zero_grad(set_to_none=True)
    return out[0], out[1]


# -- the case -----------------------------------------------------------------------------------
def hf_case(family: str, name: str, p: int, *, ckpt: str | None = None, split: bool = True, count: bool = False,
            mix: bool = False, twice: bool = False, dp: int = 1, delay: bool = False) -> dict[str, Any]:
    """One step of `family` under schedule `name` on `p` pipeline ranks (x `dp` replicas): the worst
    relative gradient error, and (``count``) the per-stage FLOPs of B, W and BW tasks with the
    stage's `stage_flops`."""
    from zbpp import ParallelGroups

    groups = ParallelGroups(pp=p) if dp > 1 else None
    pp_rank, dp_rank = (groups.pp_rank, groups.dp_rank) if groups is not None else (dist.get_rank(), 0)
    m = 2 * p
    sched = make_schedule(name, p, m)
    S = sched.num_stages
    model = hf_model(family, S)
    if mix:
        _mix_zbpp_layers(model, family)
    if delay:  # every Linear (and GPT-2's Conv1D) defers its W itself: zbpp.modules.delay_wgrad
        from zbpp.modules import delay_wgrad

        delay_wgrad(model, transposed=True)
    mine = {s: HFStage(model, family, _stage_blocks(s, S, twice), s == 0, s == S - 1, ckpt)
            for s in sched.stages_on(pp_rank)}
    tied = {}
    if family == "gpt2" and (0 in mine or S - 1 in mine):
        tied = {"wte": model.transformer.wte.weight}
    pipe = Pipeline(mine, sched, loss_fn, groups=groups, tied_parameters=tied, split_wgrad=split)
    rows = m * dp
    ids, target = make_batch(rows)
    part = slice(dp_rank * rows // dp, (dp_rank + 1) * rows // dp)
    counter = TaskFlops()
    with counter.installed() if count else contextlib.nullcontext():
        loss = pipe.step(ids[part], target=target[part])
    held = sum(len(w.held) for w in pipe._wgrad.values())
    assert held == 0, f"W left {held} split backward(s) held after the step"

    ref, ref_grads = _reference_model(family, S, twice)
    ref_loss = loss_fn(ref(ids, use_cache=False).logits, target)
    ref_loss.backward()
    if loss is not None and dp == 1:
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    worst = 0.0
    names = {id(p_): n for n, p_ in model.named_parameters()}
    for s, st in mine.items():
        for p_ in st.parameters():
            n = names[id(p_)]
            want = ref_grads[n].grad
            got = getattr(p_, "main_grad", None)
            got = p_.grad if got is None else got
            assert got is not None, f"stage {s} {n}: no gradient"
            torch.testing.assert_close(got, want, msg=lambda msg, n=n, s=s: f"stage {s} grad {n}: {msg}", **TOL)
            worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp_min(1e-300)))
    result: dict[str, Any] = {"worst": worst}
    if count:
        per = {}
        for s, st in mine.items():
            kept = st.ckpt  # reentrant: torch refuses the reference's input-only backward; count without
            st.ckpt = None if kept == "reentrant" else kept
            full, dgrad = stage_flops(st, s == 0, s == S - 1, rows // m // dp, 1.0 / m)
            st.ckpt = kept
            with FlopCounterMode(display=False) as fc, torch.no_grad():
                first = s == 0
                st(torch.randint(0, V, (rows // m // dp, T)) if first
                   else torch.randn(rows // m // dp, T, H, dtype=torch.float64))
            per[s] = {"full": full, "dgrad": dgrad, "forward": fc.get_total_flops(),
                      **{k: (counter.count.get((s, k), 0), counter.flops.get((s, k), 0)) for k in ("B", "W", "BW")}}
        result["flops"] = per
    return result


class _RaiseOnce(nn.Module):
    """Wraps a stage: its `fail_at`-th forward raises (then never again)."""

    def __init__(self, inner: nn.Module, fail_at: int) -> None:
        super().__init__()
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        return self.inner(x)


def failed_step_case(family: str, name: str, p: int) -> dict[str, Any]:
    """The last stage raises in a late forward (after B tasks of other microbatches split their
    backward): every rank raises, nothing stays held for W, and the next step is exact."""
    from zbpp.runtime import PipelineError

    m = 2 * p
    sched = make_schedule(name, p, m)
    S = sched.num_stages
    model = hf_model(family, S)
    mine = {s: HFStage(model, family, [s], s == 0, s == S - 1) for s in sched.stages_on(dist.get_rank())}
    if S - 1 in mine:
        mine[S - 1] = _RaiseOnce(mine[S - 1], fail_at=m)
    pipe = Pipeline(mine, sched, loss_fn, tied_parameters={"wte": model.transformer.wte.weight}
                    if family == "gpt2" and (0 in mine or S - 1 in mine) else {})
    ids, target = make_batch(m)
    raised = False
    try:
        pipe.step(ids, target=target)
    except PipelineError:
        raised = True
    held = sum(len(w.held) for w in pipe._wgrad.values())
    grads_after_failure = [n for n, p_ in model.named_parameters() if p_.grad is not None]
    pipe.step(ids, target=target)
    ref = hf_model(family, S)
    loss_fn(ref(ids).logits, target).backward()
    ref_grads = dict(ref.named_parameters())
    names = {id(p_): n for n, p_ in model.named_parameters()}
    for s, st in mine.items():
        for p_ in st.parameters():
            n = names[id(p_)]
            torch.testing.assert_close(p_.grad, ref_grads[n].grad, msg=lambda msg, n=n: f"{n}: {msg}", **TOL)
    return {"raised": raised, "held": held, "grads_after_failure": grads_after_failure}


def cuda_case() -> dict[str, Any]:
    """One CUDA GPU, bf16: a Llama cut into the two stages zb-v places on one rank (the second
    stage's backward is split), against the same pipeline with ``split_wgrad=False``; and the
    FLOPs of B and W as in `hf_case`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zbpp.schedules import build

    def model() -> nn.Module:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          attn_implementation="eager")
        return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)

    sched = build("zb-v", num_ranks=1, num_microbatches=4)
    ids = torch.randint(0, 512, (8, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    target = torch.roll(ids, -1, dims=1)
    grads, flops = [], None
    for split in (True, False):
        mdl = model()
        stages = {s: HFStage(mdl, "llama", [s], s == 0, s == 1) for s in (0, 1)}
        pipe = Pipeline(stages, sched, loss_fn, split_wgrad=split)
        counter = TaskFlops()
        with counter.installed():
            pipe.step(ids, target=target)
        torch.cuda.synchronize()
        grads.append({n: p.grad.float() for n, p in mdl.named_parameters() if p.grad is not None})
        if split:
            assert sum(len(w.held) for w in pipe._wgrad.values()) == 0
            flops = {}
            for s, st in stages.items():
                full, dgrad = stage_flops_cuda(st, s == 0, s == 1, 2, 0.25)
                flops[s] = {"full": full, "dgrad": dgrad,
                            **{k: (counter.count.get((s, k), 0), counter.flops.get((s, k), 0)) for k in ("B", "W", "BW")}}
    return {"grads": grads, "flops": flops}


def stage_flops_cuda(stage: nn.Module, first: bool, last: bool, rows: int, weight: float) -> tuple[int, int]:
    """`stage_flops` for the bf16 CUDA stages of `cuda_case` (64 tokens, hidden 256, vocabulary 512)."""
    return _backward_flops(
        stage, last, weight,
        lambda: (torch.randint(0, 512, (rows, 64), device="cuda") if first
                 else torch.randn(rows, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)),
        lambda: torch.randint(0, 512, (rows, 64), device="cuda"))


class _Sigmoid(nn.Module):
    """Linear then sigmoid: sigmoid saves its own output, which is the stage's (sent) output."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.lin(x))


def sent_output_case() -> float:
    """zb-v on 2 ranks: stage 2 (rank 1) sends its output, which its last node saved, and the
    runtime releases the sent storage: the split's boxes must keep what that node saved. Returns
    the worst gradient difference against one process (float64)."""
    from zbpp.schedules import build

    torch.manual_seed(0)
    stages = [_Sigmoid(nn.Linear(8, 8 if s < 3 else 1).double()) for s in range(4)]
    sched = build("zb-v", num_ranks=2, num_microbatches=4)
    mine = {s: stages[s] for s in sched.stages_on(dist.get_rank())}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 8, generator=g, dtype=torch.float64)
    y = torch.randn(8, 1, generator=g, dtype=torch.float64)
    Pipeline(mine, sched, F.mse_loss).step(x, target=y)
    params = [p for m in mine.values() for p in m.parameters()]
    got = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    h = x
    for st in stages:
        h = st(h)
    F.mse_loss(h, y).backward()
    for a, p in zip(got, params):
        torch.testing.assert_close(a, p.grad, **TOL)
    return max(float((a - p.grad).abs().max()) for a, p in zip(got, params))
