"""The dp x pp cases, run on each of the 4 gloo ranks (see test_dp_gloo.py).

A case is ``[small-buckets/]SCHEDULE/MODEL``: `zbpp.Pipeline` (with its own reducer) or, with the
prefix, the minimal executor driving a reducer with ~400-byte buckets. Every case trains two steps
on its half of the batch per replica and compares, parameter by parameter, with one process running
the whole plain model on the whole batch (`reference_grads`); it also checks that each parameter
was reduced once per step (the reducer's counter, and one all-reduce per bucket counted on the dp
group), that wgrad hooks fired once per W (none when W is replayed "from a graph"), that a consumed
eager bias gradient does not reappear in ``.grad``, and the global grad norm (2 and inf) against the
single-process norm.
Tolerance: rtol=1e-10, atol=1e-12. Everything is float64; the only differences are the order of
summation (per-microbatch accumulation, the replica average) and a pre-division by dp=2, which is
exact, so ~1e-15 relative is expected and 1e-10 leaves room without hiding a missing or doubled
contribution (that is a factor of 2 somewhere).
"""

from __future__ import annotations

import contextlib
import gc
import math
import traceback
import weakref
from typing import Any

import torch
import torch.distributed as dist

from zbpp.runtime import Pipeline
from zbpp.runtime.clip import clip_grad_norm_
from zbpp.runtime.grad_reduce import GradReducer
from zbpp.schedules import available, build

from .doubles import KeyedLinear
from .harness import (
    FP8_KINDS,
    H,
    KINDS,
    MB,
    Fp8Block,
    batch,
    dtype_of,
    execute,
    grad_of,
    loss_fn,
    make_groups,
    make_stage,
    reference_grads,
    ReplicaReference,
)

PP = 2
M = 4  # microbatches per replica and step
SCHEDULES = ["1f1b", "zb-h1", "zb-h2", "zb-v", "zb-auto", "zbv-auto"]
MODEL_KINDS = [k for k in KINDS if k != "zbpp-fp8-last"]
# FP8 in the last microbatch only: an earlier microbatch's W (after the stage's last B) still owes
# the bias gradient that the last forward computed in B (driven by the executor: Pipeline's split
# stages owe every gradient to W anyway)
MIXED_FP8 = ["small-buckets/zb-h1/zbpp-fp8-last", "small-buckets/zb-v/zbpp-fp8-last"]
RTOL, ATOL = 1e-10, 1e-12
# FP8 (float32 model): against the replica-by-replica reference, which runs the same FP8 GEMMs on
# the same tensors in the same order (bit-identical on CPU today); the margin allows a few float32
# ulps should a GEMM backend block differently, far below a missing or doubled contribution.
FP8_RTOL, FP8_ATOL = 1e-5, 1e-7
BUCKET_MB = 400 / 2**20  # ~400 bytes: several buckets per stage, one weight (512 bytes) alone


SMALL_BUCKETS = "small-buckets/"


def case_names() -> list[str]:
    small = ["1f1b/plain", "zb-h1/te", "zb-v/zbpp-fused", "zbv-auto/eager-bias", "zb-h2/zbpp-fp8"]
    return ([f"{s}/{k}" for s in SCHEDULES for k in MODEL_KINDS] + MIXED_FP8 + [SMALL_BUCKETS + c for c in small]
            + ["presence", "presence-host", "clip-inf-nan", "clip-frozen-rank", "batchnorm-buffers", "batchnorm-buffers-added-later",
               "dropped-pipeline", "second-pipeline"])


def _close(a: torch.Tensor | None, b: torch.Tensor | None, rtol: float = RTOL, atol: float = ATOL) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.allclose(a.cpu(), b.cpu().to(a.dtype), rtol=rtol, atol=atol)


class _CountAllReduce:
    """Counts all-reduces issued on `group` (wraps torch.distributed.all_reduce for one case)."""

    def __init__(self, group: Any) -> None:
        self.group, self.calls, self._orig = group, 0, dist.all_reduce

    def __enter__(self) -> "_CountAllReduce":
        def counting(tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
            if kw.get("group") is self.group:
                self.calls += 1
            return self._orig(tensor, *args, **kw)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self._orig


def _build(name: str, pp: int) -> Any:
    if name not in available():
        return f"skip: schedule {name!r} is not registered (available: {', '.join(available())})"
    try:
        return build(name, num_ranks=pp, num_microbatches=M)
    except (TypeError, ValueError) as exc:  # e.g. an auto schedule that needs options
        return f"skip: build({name!r}, num_ranks={pp}, num_microbatches={M}) failed: {exc}"


def _count_wgrad_hooks(modules: dict[int, torch.nn.Module]) -> list[list[int]]:
    """Register a counting wgrad hook on every module that offers the hook; one counter each."""
    counters = []
    for st in modules.values():
        for m in st.modules():
            register = getattr(m, "register_wgrad_accumulation_and_reduce_hooks", None)
            if callable(register):
                box = [0]
                register(lambda box=box: box.__setitem__(0, box[0] + 1))
                counters.append(box)
    return counters


def _consumed_biases(modules: dict[int, torch.nn.Module]) -> list[torch.Tensor]:
    """Biases whose eager (FP8-style) gradient a hook moves into main_grad during B."""
    out = []
    for st in modules.values():
        for m in st.modules():
            if getattr(m, "fuse_wgrad_accumulation", False) and getattr(m, "bias", None) is not None:
                if isinstance(m, KeyedLinear) and m.eager_bias or isinstance(st, Fp8Block):
                    out.append(m.bias)
    return out


def run_case(sched_name: str, kind: str, groups: Any, device: str, small_buckets: bool) -> list[str]:
    sched = _build(sched_name, groups.pp)
    if isinstance(sched, str):
        return [sched]
    fails: list[str] = []
    built = {s: make_stage(s, kind, device) for s in sched.stages_on(groups.pp_rank)}
    modules = {s: mod for s, (mod, _) in built.items()}
    names = {s: ref_names for s, (_, ref_names) in built.items()}
    if small_buckets:
        reducer = GradReducer(modules, groups, bucket_size_mb=BUCKET_MB)

        def run(x: torch.Tensor, y: torch.Tensor) -> None:
            execute(sched, modules, groups, reducer, x, y)

    else:
        # Pipeline builds a reducer by itself only for dp > 1: pass one so dp=1 runs it too
        reducer = GradReducer(modules, groups)
        pipe = Pipeline(modules, sched, loss_fn, groups=groups, device=device, reducer=reducer)

        def run(x: torch.Tensor, y: torch.Tensor) -> None:
            pipe.step(x, target=y)
    counters = _count_wgrad_hooks(modules)
    fp8 = kind in FP8_KINDS
    fp8_model = ReplicaReference(sched.num_stages, kind, groups.dp, device) if fp8 else None
    for step in range(2):
        for st in modules.values():
            st.zero_grad(set_to_none=True)
        hooks_before = [c[0] for c in counters]
        x, y = batch(step, groups.dp * M * MB, device)
        half = x.shape[0] // groups.dp
        mine = slice(groups.dp_rank * half, (groups.dp_rank + 1) * half)
        with _CountAllReduce(groups.dp_group) as counter:
            run(x[mine].to(dtype_of(kind)), y[mine].to(dtype_of(kind)))
        ref, _ = reference_grads(sched.num_stages, x, y)
        if fp8:
            fp8_ref = fp8_model.grads(x, y, M)
        where = f"step {step}"
        for s, st in modules.items():
            for n, p in st.named_parameters():
                got, want = grad_of(p), ref[s][names[s][n]]
                if fp8:
                    want = fp8_ref[s][n]
                    if n.endswith("spare"):
                        want = None  # unused: its gradient stays None (the hand-attached main_grad is 0)
                    if not _close(got, want, rtol=FP8_RTOL, atol=FP8_ATOL):
                        fails.append(f"{where}: stage {s} {n}: gradient differs from the replica-by-replica reference")
                elif not _close(got, want):
                    fails.append(f"{where}: stage {s} {n}: gradient differs from the whole-batch reference")
        counts = reducer.reduce_counts()
        if sorted(set(counts.values())) != [1]:
            fails.append(f"{where}: reduce counts not all 1: {counts}")
        if counter.calls != reducer.num_buckets * (groups.dp > 1):
            fails.append(f"{where}: {counter.calls} all-reduces on the dp group for {reducer.num_buckets} buckets")
        calls = [c[0] - b for c, b in zip(counters, hooks_before)]
        expected = 0 if kind == "graph-replay" else M  # one W per microbatch; none seen in a graph
        if any(c != expected for c in calls):
            fails.append(f"{where}: wgrad hooks fired {calls} times per module, expected {expected} each")
        for bias in _consumed_biases(modules):
            if bias.grad is not None:
                fails.append(f"{where}: a consumed eager bias gradient reappeared in .grad")
    if kind in ("eager-bias", "zbpp-fp8") and not _consumed_biases(modules):
        fails.append("the case has no consumed-bias layer: the test is not testing it")
    if fp8:
        reducer.remove_hooks()
        return fails
    # Global norm, on the last step's gradients (reference: the whole model's gradients).
    ref_all = [g for stage in ref for g in stage.values() if g is not None]
    ref_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in ref_all))
    total = clip_grad_norm_(modules, 0.5 * ref_norm, groups)
    if not math.isclose(float(total), ref_norm, rel_tol=RTOL):
        fails.append(f"global 2-norm {float(total)} != single-process {ref_norm}")
    coef = 0.5 * ref_norm / (ref_norm + 1e-6)
    for s, st in modules.items():
        for n, p in st.named_parameters():
            want = ref[s][names[s][n]]
            want = None if want is None else want * coef
            if not _close(grad_of(p), want):
                fails.append(f"after clipping: stage {s} {n} is not the reference gradient times {coef}")
    ref_inf = max(float(g.abs().max()) for g in ref_all) * coef
    total_inf = clip_grad_norm_(modules, 1e9, groups, norm_type=math.inf)
    if not math.isclose(float(total_inf), ref_inf, rel_tol=RTOL):
        fails.append(f"global inf-norm {float(total_inf)} != single-process {ref_inf}")
    reducer.remove_hooks()
    return fails


def run_presence(groups: Any, device: str, on_host: bool = False) -> list[str]:
    """A gradient present on one replica only is averaged with zeros; one absent everywhere stays None.

    `on_host`: the presence counts travel over a gloo group of the replicas, as under `Pipeline`;
    then applying the reductions must not read the device (on CUDA, torch's sync debug mode
    raises on any synchronising call inside `finish`)."""
    mod = torch.nn.Module()
    mod.some = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64, device=device))
    mod.none = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64, device=device))
    mod.both = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64, device=device))
    presence = None
    if on_host:  # new_group is collective over the world: every rank builds every replica line
        lines = [dist.new_group([d * groups.pp + r for d in range(groups.dp)], backend="gloo") for r in range(groups.pp)]
        presence = lines[groups.pp_rank]
    reducer = GradReducer({groups.pp_rank: mod}, groups, presence_group=presence)
    reducer.start_step()
    base = torch.arange(4, dtype=torch.float64, device=device) + 1
    if groups.dp_rank == 0:
        mod.some.grad = base.clone()
    mod.both.grad = base * (groups.dp_rank + 1)
    reducer.stage_backward_done(groups.pp_rank)
    reducer.stage_wgrad_done(groups.pp_rank)
    if on_host and device.startswith("cuda"):
        torch.cuda.set_sync_debug_mode("error")
    try:
        reducer.finish()
    finally:
        if device.startswith("cuda"):
            torch.cuda.set_sync_debug_mode("default")
    fails = []
    if on_host and any(b.buffer.numel() != b.numel for b in reducer._buckets if not b.uses_main_grad):
        fails.append("the presence counts travelled in the gradient bucket, not on the host")
    if not _close(mod.some.grad, base / groups.dp):
        fails.append(f"grad on replica 0 only: got {mod.some.grad}, expected {base / groups.dp}")
    if mod.none.grad is not None:
        fails.append("a gradient None on every replica became a tensor")
    want = base * sum(range(1, groups.dp + 1)) / groups.dp
    if not _close(mod.both.grad, want):
        fails.append(f"grad on both replicas: got {mod.both.grad}, expected {want}")
    return fails


def _clip_params(groups: Any, grads: list[list[float] | None], device: str) -> list[torch.nn.Parameter]:
    """One float64 parameter per pipeline rank, with gradient ``grads[pp_rank]`` (None: frozen)."""
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64, device=device), requires_grad=g is not None)
        if g is not None:
            p.grad = torch.tensor(g, dtype=torch.float64, device=device)
        out.append(p)
    return out


def run_clip_inf_nan(groups: Any, device: str) -> list[str]:
    """The inf-norm of gradients with a NaN on the last pipeline rank only is NaN on every rank, as
    torch's clip over all of them in one process says (gloo's MAX drops a NaN that is not the first
    rank's), and error_if_nonfinite raises on every rank."""
    grads = [[3.0, -4.0]] * (groups.pp - 1) + [[float("nan"), 1.0]]
    want = float(torch.nn.utils.clip_grad_norm_(_clip_params(groups, grads, "cpu"), 1.0, norm_type=math.inf))
    mine = _clip_params(groups, grads, device)[groups.pp_rank]
    got = float(clip_grad_norm_([mine], 1.0, groups, norm_type=math.inf))
    fails = [] if math.isnan(got) == math.isnan(want) else [f"inf-norm {got}, torch in one process: {want}"]
    try:
        clip_grad_norm_([mine], 1.0, groups, norm_type=math.inf, error_if_nonfinite=True)
        fails.append("error_if_nonfinite=True did not raise on a NaN inf-norm")
    except RuntimeError:
        pass
    return fails


def run_clip_frozen_rank(groups: Any, device: str) -> list[str]:
    """Pipeline rank 0 holds only a frozen float64 parameter (no gradient), the others trainable
    float64 ones: the norm and the clipped gradients are torch's over the trainable ones in one
    process (the ranks' all-reduce once paired a float32 zero with float64 sums: gloo aborted)."""
    grads = [None] + [[3.0, 4.0 * r] for r in range(1, groups.pp)]
    ref = _clip_params(groups, grads, "cpu")
    want = float(torch.nn.utils.clip_grad_norm_(ref, 1.0))
    mine = _clip_params(groups, grads, device)[groups.pp_rank]
    got = float(clip_grad_norm_([mine], 1.0, groups))
    fails = [] if math.isclose(got, want, rel_tol=RTOL) else [f"2-norm {got}, torch in one process: {want}"]
    if not _close(mine.grad, ref[groups.pp_rank].grad):
        fails.append(f"clipped gradient {mine.grad}, torch in one process: {ref[groups.pp_rank].grad}")
    return fails


def _bn_stage(stage: int, device: str, affine: bool = True) -> torch.nn.Module:
    torch.manual_seed(77 + stage)
    mod = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.BatchNorm1d(H, affine=affine)).double().to(device)
    mod.register_buffer("constant", torch.zeros(2, dtype=torch.float64, device=device), persistent=False)
    return mod


def run_batchnorm_buffers(groups: Any, device: str, late: bool = False) -> list[str]:
    """BatchNorm's running statistics (persistent buffers, moved by every training forward) end each
    step as replica 0's on every replica, as under DDP (broadcast_buffers): reference, replica 0's
    microbatches run in order through one process's model (the same float64 ops on the same data:
    1e-12 leaves room for nothing but rounding). A non-persistent buffer stays each replica's own.
    Replica 1's statistics were its own data's, and drifted from replica 0's step by step.
    `late`: the BatchNorm (affine=False: no parameter) is added to the stages after the Pipeline was
    built, when they had no persistent buffer (then nothing was ever synchronised)."""
    sched = build("zb-h1", num_ranks=groups.pp, num_microbatches=M)
    mine = {s: _bn_stage(s, device, affine=not late) for s in sched.stages_on(groups.pp_rank)}
    norms = {s: mod[1] for s, mod in mine.items()}
    for mod in mine.values():
        mod.constant.fill_(groups.dp_rank)
        if late:
            del mod[1]
    pipe = Pipeline(mine, sched, loss_fn, groups=groups, device=device)
    for s, mod in mine.items():
        if late:
            mod.append(norms[s])
    ref = [_bn_stage(s, device, affine=not late) for s in range(sched.num_stages)]
    fails = []
    for step in range(2):
        x, y = batch(step, groups.dp * M * MB, device)
        half = x.shape[0] // groups.dp
        pipe.step(x[groups.dp_rank * half:(groups.dp_rank + 1) * half], target=y[groups.dp_rank * half:(groups.dp_rank + 1) * half])
        with torch.no_grad():
            for xb in x[:half].chunk(M):  # replica 0's rows, microbatch by microbatch
                for st in ref:
                    xb = st(xb)
        for s, mod in mine.items():
            for (n, b), want in zip(mod[1].named_buffers(), ref[s][1].buffers()):
                if not _close(b, want, rtol=1e-12, atol=1e-12):
                    fails.append(f"step {step}: stage {s} {n} {b.tolist()}, replica 0's in one process: {want.tolist()}")
            if mod.constant.tolist() != [float(groups.dp_rank)] * 2:
                fails.append(f"step {step}: stage {s}: the non-persistent buffer was overwritten: {mod.constant.tolist()}")
    return fails


def run_dropped_pipeline(groups: Any, device: str) -> list[str]:
    """A dropped Pipeline is freed with its reducer: the hooks that reducer put on the parameters
    and on the delayed layers (which outlive it) held it, and its buckets, for as long as the model
    lived. And they went on: a parameter with a ``main_grad`` had every later ``.grad`` moved into the
    dropped buffer, so a plain backward afterwards left ``.grad`` None. Reference for that backward:
    the same stage built afresh (same seed, same values: the step changed no parameter) in one
    process, the same float64 ops on the same rows: exact."""
    sched = build("zb-h1", num_ranks=groups.pp, num_microbatches=M)
    x, y = batch(0, M * MB, device)
    models, alive = {}, {}
    for kind in ("plain", "te"):  # "te": delayed layers with register_wgrad_accumulation_and_reduce_hooks
        models[kind] = {s: make_stage(s, kind, device)[0] for s in sched.stages_on(groups.pp_rank)}
        for mod in models[kind].values():
            for p in mod.parameters():
                p.main_grad = torch.zeros_like(p)  # the reducer then keeps every gradient in its buckets
        pipe = Pipeline(models[kind], sched, loss_fn, groups=groups, device=device)
        pipe.step(x, target=y)
        alive[kind] = weakref.ref(pipe), weakref.ref(pipe.reducer)
        del pipe
    gc.collect()  # a Pipeline holds reference cycles
    fails = [f"{kind}: the dropped Pipeline or its reducer is still alive"
             for kind, refs in alive.items() if any(ref() is not None for ref in refs)]
    for s, mod in models["plain"].items():
        ref = make_stage(s, "plain", device)[0]
        for m in (mod, ref):
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
        for (n, p), want in zip(mod.named_parameters(), ref.parameters()):
            if not _close(p.grad, want.grad, rtol=0, atol=0):
                fails.append(f"stage {s} {n}.grad after the Pipeline was dropped: {p.grad}, one process: {want.grad}")
    return fails


def run_second_pipeline(groups: Any, device: str) -> list[str]:
    """Two Pipelines over the same modules, both alive (one for training, one for evaluation, built
    second), every parameter with a ``main_grad``: the second took every ``main_grad`` for its
    buckets, so the first's steps reduced and zeroed its own buffers while the gradients went into
    the second's, each replica's own, summed over the steps. Now each ``main_grad`` after a step of
    the first is the whole batch's gradient in one process (`reference_grads`; RTOL/ATOL above), and
    after a ``no_sync`` window with a third Pipeline built inside it, the sum of its three batches'."""
    sched = build("zb-h1", num_ranks=groups.pp, num_microbatches=M)
    mine = {s: make_stage(s, "plain", device)[0] for s in sched.stages_on(groups.pp_rank)}
    for mod in mine.values():
        for p in mod.parameters():
            p.main_grad = torch.zeros_like(p)  # the reducer keeps every gradient in its buckets
    pipe = Pipeline(mine, sched, loss_fn, groups=groups, device=device)
    evaluation = Pipeline(mine, build("1f1b", num_ranks=groups.pp, num_microbatches=2), loss_fn, groups=groups, device=device)
    fails = []
    for step in range(2):
        x, y = batch(step, groups.dp * M * MB, device)
        half = x.shape[0] // groups.dp
        evaluation.eval_step(x[:half])
        pipe.step(x[groups.dp_rank * half:(groups.dp_rank + 1) * half], target=y[groups.dp_rank * half:(groups.dp_rank + 1) * half])
        ref, _ = reference_grads(sched.num_stages, x, y)
        for s, mod in mine.items():
            for n, p in mod.named_parameters():
                want = ref[s][n] if ref[s][n] is not None else torch.zeros_like(p)  # unused: main_grad stays zeros
                if not _close(p.main_grad, want):
                    fails.append(f"step {step}: stage {s} {n}.main_grad differs from the whole-batch gradient")
    total: list[dict[str, torch.Tensor]] = [{} for _ in range(sched.num_stages)]
    for step in (2, 3, 4):  # 2 and 3 inside no_sync, a third Pipeline built between them; 4 reduces all
        x, y = batch(step, groups.dp * M * MB, device)
        half = x.shape[0] // groups.dp
        with pipe.no_sync() if step < 4 else contextlib.nullcontext():
            pipe.step(x[groups.dp_rank * half:(groups.dp_rank + 1) * half], target=y[groups.dp_rank * half:(groups.dp_rank + 1) * half])
        if step == 2:
            third = Pipeline(mine, sched, loss_fn, groups=groups, device=device)
        for s, grads in enumerate(reference_grads(sched.num_stages, x, y)[0]):
            for n, g in grads.items():
                total[s][n] = total[s].get(n, 0) + (g if g is not None else 0)
    for s, mod in mine.items():
        for n, p in mod.named_parameters():
            want = total[s][n] if isinstance(total[s][n], torch.Tensor) else torch.zeros_like(p)
            if not _close(p.main_grad, want):
                fails.append(f"no_sync: stage {s} {n}.main_grad differs from the sum of the whole batches' gradients")
    del third
    return fails


def worker(names: list[str], pp: int = PP) -> dict[str, list[str]]:
    """Entry point on each rank: run every case, return {case: failures (or one 'skip: ...')}.

    A case that raises (on any rank) leaves the process group in an unknown state (peers wait for
    messages that will not come), so the remaining cases are reported as not run.
    """
    groups = make_groups(pp)
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    out: dict[str, list[str]] = {}
    for i, name in enumerate(names):
        raised = 0
        try:
            if name in ("presence", "presence-host"):
                out[name] = run_presence(groups, device, on_host=name == "presence-host")
            elif name == "clip-inf-nan":
                out[name] = run_clip_inf_nan(groups, device)
            elif name == "clip-frozen-rank":
                out[name] = run_clip_frozen_rank(groups, device)
            elif name.startswith("batchnorm-buffers"):
                out[name] = run_batchnorm_buffers(groups, device, late=name.endswith("added-later"))
            elif name == "dropped-pipeline":
                out[name] = run_dropped_pipeline(groups, device)
            elif name == "second-pipeline":
                out[name] = run_second_pipeline(groups, device)
            else:
                small = name.startswith(SMALL_BUCKETS)
                sched, kind = name.removeprefix(SMALL_BUCKETS).split("/")
                out[name] = run_case(sched, kind, groups, device, small)
        except Exception:
            out[name] = [traceback.format_exc()]
            raised = 1
        try:
            flag = torch.tensor([raised], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # did any rank raise?
            raised = int(flag)
        except Exception:
            out[name] = out.get(name, []) + ["the ranks fell out of step:\n" + traceback.format_exc()]
            raised = 1
        if raised:
            if not out[name]:
                out[name] = ["another rank raised in this case (see its report)"]
            for rest in names[i + 1 :]:
                out[rest] = [f"not run: case {name!r} raised, the process group may be out of step"]
            break
    return out
