"""A Hugging Face Llama on one GPU: HF eager and torch.compile against zbpp's eager and fast forms.

One rank, one stage holding the whole model (``causal_lm_stages`` from a ``LlamaConfig``, random
weights, the same in every row, bf16 parameters, SDPA attention), trained on ``--microbatches``
microbatches of ``--rows`` sequences of ``--seq-len`` tokens per step (forward + backward,
gradients accumulated, no optimizer). Variants:

- ``hf eager``       ``LlamaForCausalLM`` itself, ``model(ids, labels=ids).loss / m`` then
                     ``backward()`` per microbatch
- ``hf compile``     the same model under ``torch.compile(model)``
- ``zbpp eager``     a one-rank zb-h1 `Pipeline` of the stage (the generic B/W split)
- ``zbpp fast``      ``causal_lm_stages(..., fast=True)``: delayed-wgrad Linears, compiled decoder
                     layers, task graphs (``zbpp.models.fast``)
- ``zbpp fast nographs``  the same without task graphs (what they add)
- ``zbpp fp8 eager`` delayed-wgrad Linears in FP8 (``fast_stage(compile=False, fp8=True)``), no
                     task graphs: FP8's eager cost against ``zbpp eager``
- ``zbpp fast fp8``  ``causal_lm_stages(..., fast=True, fp8=True)``

Every variant is built (and compiled) first; after `SETTLE_S` seconds (inductor's compile workers
keep CPUs busy for seconds after a compile) they are interleaved over ``--rounds`` rounds (warm-up
steps, then ``--steps`` steps timed one by one with CUDA events); the table gives the median ms per
step, tokens/s, MFU (model FLOPs ``6 N T + 6 L s h T`` per step: N the matmul parameters of the
layers and the LM head, T tokens, causal attention counted half; over ``--peak-tflops``, the H200's
dense bf16 989 by default, also for FP8), the peak memory (what the variant holds between steps,
after ``zero_grad()`` as torch's optimizers call it: parameters, fixed gradient buffers and graph
pools; plus the most its step allocates beyond that, gradients included where they are made in the
step), each variant's speed against ``hf compile`` (> 1: faster) and the median `host_probe`
before its timed steps (how fast the host ran: host-bound rows follow it). ``--kernel-profile`` sums one
profiled step's GPU kernels by kind (gemm, attention, cast, norm, activation, other) for the
variants named, and the step's GPU idle time.

On one H200 (both of the issue's workloads in one run)::

    PYTHONPATH=$PWD python3 benchmarks/bench_hf.py --preset h2048,h4096 --out $OUT/bench_hf.json

CPU smoke run (tiny model, seconds; compile with ``--backend aot_eager``)::

    python benchmarks/bench_hf.py --quick --out /tmp/bench_hf.json

Pipeline ranks: under torchrun (``WORLD_SIZE`` > 1; NCCL on GPUs, gloo with ``--device cpu``) the
same model is trained split over the ranks, one variant per schedule and form (``PIPELINE_VARIANTS``):

- ``zbpp <schedule> eager``  zbpp's `Pipeline` of ``causal_lm_stages`` stages (``zb-h1``: one stage
                     per rank, ``zb-v``: two, V-placed)
- ``zbpp <schedule> fast``   the same stages in their fast form (``causal_lm_stages(..., fast=True)``;
                     with a ``--backend`` other than inductor, `zbpp.models.fast.fast_hf_stages`
                     with that backend); ``... fast fp8`` adds FP8 (GPUs with FP8 GEMMs)
- ``torch <Schedule>``       torch.distributed.pipelining's schedule (``Schedule1F1B``,
                     ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``,
                     ``ScheduleZBVZeroBubble``) over `hf_torch_stages.LlamaStage` modules, eager:
                     torch's zero-bubble schedules refuse compiled stages (pytorch#161904), so
                     torch's rows are compared with ``zbpp ... eager``, like for like
- ``hf eager`` / ``hf compile``  on rank 0 alone, the whole model (the one-GPU reference)

Every row trains the same model: each rank builds the whole ``LlamaForCausalLM`` (seed 0) and cuts
its stages from its weights, all schedules at the same decoder-layer boundaries
(`hf_torch_stages.layer_ranges`). A step takes as long as its slowest rank (each timed step
starts after a barrier; wall clock after a device synchronisation); MFU counts the GPUs a row
uses; the peak memory is per rank; ``first_loss`` is each row's loss on the first step (the same
batch for every row: the rows' losses agree up to rounding, FP8's larger). ``vs best torch`` is the fastest
torch row's step over the row's. Not yet run on GPUs (two-GPU machines were not lent)::

    torchrun --nproc-per-node=2 benchmarks/bench_hf.py --preset h2048 --out $OUT/bench_hf_pp2.json
    torchrun --nproc-per-node=2 benchmarks/bench_hf.py --quick --device cpu   # gloo smoke run
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench_modules import kernel_kind, run_env  # noqa: E402 - benchmarks/, beside this script
from hf_torch_stages import LlamaStage, stage_fqns  # noqa: E402
from host_probe import FAST_HOST_MS, host_probe_ms  # noqa: E402
from provenance import write_report  # noqa: E402
from quick import apply_quick  # noqa: E402
from torch_pipelining import TorchPipeline, torch_num_stages, torch_stage_ids  # noqa: E402

from zbpp.runtime.task_graphs import TRIAL_STEPS  # noqa: E402

# a variant's first steps: compile, capture the task graphs, and their trial under cuda_graphs="auto"
FIRST_WARMUP = 3 + 2 * TRIAL_STEPS

VARIANTS = ("hf eager", "hf compile", "zbpp eager", "zbpp fast", "zbpp fast nographs", "zbpp fp8 eager",
            "zbpp fast fp8")
REFERENCE = "hf compile"
PIPELINE_VARIANTS = ("hf eager", "hf compile", "zbpp zb-h1 eager", "zbpp zb-h1 fast", "zbpp zb-v eager",
                     "zbpp zb-v fast", "zbpp zb-v fast fp8", "torch Schedule1F1B", "torch ScheduleInterleaved1F1B",
                     "torch ScheduleInterleavedZeroBubble", "torch ScheduleZBVZeroBubble")
ZBPP_FORMS = ("eager", "fast", "fast fp8")
# hidden, layers, ffn, heads: the two workloads (Llama-style ffn widths)
PRESETS = {"h2048": (2048, 8, 5632, 16), "h4096": (4096, 4, 11008, 32)}
KINDS = ("gemm", "attention", "cast", "norm", "activation", "other")
START = time.perf_counter()
#: seconds between the last build and the first timed step (a compile's workers keep CPUs busy a while)
SETTLE_S = 10.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="h2048", help=f"comma-separated, of {sorted(PRESETS)} or 'custom'")
    ap.add_argument("--hidden", type=int, default=1024, help="custom: hidden size")
    ap.add_argument("--layers", type=int, default=4, help="custom: decoder layers")
    ap.add_argument("--ffn", type=int, default=None, help="custom: intermediate size (default 2.75 x hidden)")
    ap.add_argument("--heads", type=int, default=None, help="custom: attention heads (default hidden / 128)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=1, help="sequences per microbatch")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated (default: all; one rank {list(VARIANTS)}, pipeline ranks "
                    f"{list(PIPELINE_VARIANTS)}, where any zbpp schedule and torch schedule may be named)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    ap.add_argument("--warmup", type=int, default=2,
                    help=f"untimed steps per variant and round ({FIRST_WARMUP} more in the first)")
    ap.add_argument("--kernel-profile", default="hf compile,zbpp fast,zbpp fp8 eager,zbpp fast fp8",
                    help="variants whose one step is profiled by kernel kind ('' for none; one-rank mode only)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="seconds from the start after which a preset runs no further round (at least one)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the MFU's denominator")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true",
                    help="tiny CPU-sized smoke run; options given explicitly keep their values")
    ap.add_argument("--timeout", type=float, default=600.0, help="pipeline ranks: seconds a rank waits for a peer")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    # under torchrun (or in ranks whose process group is up): the pipeline mode
    args.world = int(os.environ.get("WORLD_SIZE", "1"))
    args.pipeline = args.world > 1
    # pipeline ranks: a layer per stage of the V schedules (2 per rank), m = 2 per rank
    apply_quick(ap, args, argv, preset="custom", hidden=32, layers=2 * args.world, ffn=64, heads=2, vocab=64,
                seq_len=16, rounds=2, steps=1, warmup=1, microbatches=2 * args.world, backend="aot_eager",
                kernel_profile="")
    if args.pipeline:
        args.kernel_profile = ""  # one rank's profile only (the one-rank mode)
    known = PIPELINE_VARIANTS if args.pipeline else VARIANTS
    variants = (args.variants or ",".join(known)).split(",")
    unknown = [v for v in variants if v not in known and not (args.pipeline and _pipeline_variant(v))]
    if unknown:
        ap.error(f"unknown --variants {unknown}; choose from {list(known)}")
    if not args.device.startswith("cuda"):  # task graphs and FP8 GEMMs need a GPU
        variants = [v for v in variants if "fp8" not in v and v != "zbpp fast"]
    elif not fp8_available():
        variants = [v for v in variants if "fp8" not in v]
    args.variant_list = variants
    presets = args.preset.split(",")
    for p in presets:
        if p != "custom" and p not in PRESETS:
            ap.error(f"unknown --preset {p!r}; choose from {sorted(PRESETS)} or custom")
    args.presets = presets
    return args


def _pipeline_variant(name: str) -> tuple[str, str, str] | None:
    """``(impl, schedule, form)`` of a pipeline variant's name (``"zbpp zb-v fast"``, ``"torch
    Schedule1F1B"``, ``"hf compile"``), None if it names none."""
    from zbpp.schedules import available

    impl, _, rest = name.partition(" ")
    if impl == "hf" and rest in ("eager", "compile"):
        return impl, "", rest
    if impl == "torch":
        import torch.distributed.pipelining as tpp

        return (impl, rest, "eager") if rest.startswith("Schedule") and hasattr(tpp, rest) else None
    schedule, _, form = rest.partition(" ")
    return (impl, schedule, form) if impl == "zbpp" and schedule in available() and form in ZBPP_FORMS else None


def graph_pools_free() -> int:
    """Bytes the CUDA graphs' private memory pools hold but no live tensor uses: what a replay
    writes into, which ``memory_allocated`` leaves out."""
    return sum(seg["total_size"] - seg["active_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0))


def fp8_available() -> bool:
    """A GPU with FP8 GEMMs (compute capability 8.9 or more) and ``torch._scaled_mm``."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and hasattr(torch, "_scaled_mm")


def make_config(args: argparse.Namespace, preset: str) -> Any:
    import transformers

    if preset == "custom":
        hidden, layers = args.hidden, args.layers
        ffn, heads = args.ffn or int(2.75 * hidden), args.heads or max(1, hidden // 128)
    else:
        hidden, layers, ffn, heads = PRESETS[preset]
    return transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=hidden, intermediate_size=ffn,
                                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                    max_position_embeddings=args.seq_len, tie_word_embeddings=False)


def model_flops(config: Any, tokens: int, seq: int) -> float:
    """FLOPs of one training step (see the module docstring)."""
    h, f, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    matmul_params = n * (2 * h * h + 2 * h * kv + 3 * h * f) + h * v
    return 6.0 * matmul_params * tokens + 6.0 * n * seq * h * tokens


class Variant:
    """One variant's model and its step (``step()``: one training step, returning the step's loss
    where this rank has it, else None; ``clear()``: drop grads), run by `ranks` processes (the
    others, in the pipeline mode, have a variant with no step and no modules)."""

    def __init__(self, name: str, step: Callable[[], Any], modules: list[torch.nn.Module], ranks: int = 1) -> None:
        self.name, self.step, self.modules, self.ranks = name, step, modules, ranks
        self.times: list[float] = []
        self.host_probes: list[float] = []  # `host_probe_ms` before each timed step
        self.resident = 0  # bytes held after warm-up (parameters, gradients, graph pools)
        self.transient = 0  # the most a step allocated beyond that
        self.first_loss: float | None = None  # the first step's loss, where this rank has it
        self.pipeline: Any = None  # a zbpp variant's Pipeline: which form cuda_graphs="auto" chose

    def clear(self) -> None:
        for m in self.modules:
            m.zero_grad()  # as torch optimizers do (set_to_none): task graphs re-attach zeroed buffers


def _dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.device.startswith("cuda") else torch.float32


def hf_model(config: Any, args: argparse.Namespace) -> Any:
    """The benchmark's ``LlamaForCausalLM``: random weights (seed 0: the same on every rank), SDPA
    attention, bf16 on GPUs and float32 on the CPU."""
    import transformers

    torch.manual_seed(0)
    cfg = copy.deepcopy(config)
    cfg._attn_implementation = "sdpa"
    with torch.device(args.device):
        return transformers.LlamaForCausalLM(cfg).to(_dtype(args))


def hf_variant(name: str, model: Any, args: argparse.Namespace, batch: dict[str, torch.Tensor]) -> Variant:
    """``hf eager`` or ``hf compile``: `model` on the whole batch, HF's own loss, one microbatch after the other."""
    m = args.microbatches
    run = torch.compile(model, backend=args.backend) if name == "hf compile" else model
    ids_mb, labels_mb = batch["input_ids"].chunk(m), batch["labels"].chunk(m)

    def hf_step() -> torch.Tensor:
        losses = []
        for x, y in zip(ids_mb, labels_mb):
            loss = run(input_ids=x, labels=y).loss / m
            loss.backward()
            losses.append(loss.detach())
        return torch.stack(losses).sum()

    return Variant(name, hf_step, [model])


def build_variant(name: str, config: Any, args: argparse.Namespace, batch: dict[str, torch.Tensor]) -> Variant:
    from zbpp import Pipeline
    from zbpp.models.fast import fast_stage
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    device, dtype = torch.device(args.device), _dtype(args)
    ids, labels, m = batch["input_ids"], batch["labels"], args.microbatches
    if name.startswith("hf"):
        return hf_variant(name, hf_model(config, args), args, batch)
    sched = build("zb-h1", num_ranks=1, num_microbatches=m)
    fast = name.startswith("zbpp fast")
    # the hf rows' weights (a model built and dropped here): every row trains the same model
    stages, kwargs = causal_lm_stages(config, sched, 0, device=device, dtype=dtype, attn_implementation="sdpa",
                                      state_dict=hf_model(config, args).state_dict(), fast=fast,
                                      fp8=name == "zbpp fast fp8")
    if name == "zbpp fp8 eager":
        fast_stage(stages[0], compile=False, fp8=True)
    if name == "zbpp fast nographs":
        kwargs.pop("cuda_graphs", None)
    if fast and "cuda_graphs" not in kwargs and name != "zbpp fast nographs" and device.type == "cuda":
        raise RuntimeError("causal_lm_stages(fast=True) on CUDA did not ask for task graphs")
    pipe = Pipeline(stages, sched, **kwargs)

    def zbpp_step() -> torch.Tensor | None:
        return pipe.step({"input_ids": ids}, target=labels)

    variant = Variant(name, zbpp_step, list(stages.values()))
    variant.pipeline = pipe
    return variant


def build_pipeline_variant(name: str, config: Any, args: argparse.Namespace, batch: dict[str, torch.Tensor],
                           source: Any) -> Variant:
    """A pipeline-mode variant (`_pipeline_variant` names them) on this rank, its stages cut from
    `source` (the whole model, `hf_model`) at `hf_torch_stages.layer_ranges`' boundaries."""
    import torch.distributed as dist

    from zbpp import Pipeline
    from zbpp.models.fast import fast_hf_stages
    from zbpp.models.hf import CausalLMLoss, causal_lm_stages
    from zbpp.schedules import build

    impl, schedule, form = _pipeline_variant(name) or (None, "", "")
    rank, p, m = dist.get_rank(), args.world, args.microbatches
    device, ids, labels = torch.device(args.device), batch["input_ids"], batch["labels"]
    if impl == "hf":  # the one-GPU reference: rank 0 alone
        if rank:
            return Variant(name, lambda: None, [], ranks=1)
        return hf_variant(name, source, args, batch)
    if impl == "torch":
        n = torch_num_stages(schedule, p)
        modules = {s: LlamaStage(source, s, n) for s in torch_stage_ids(schedule, rank, p)}
        pipe = TorchPipeline(schedule, modules, p, device, m, CausalLMLoss())

        def torch_step() -> torch.Tensor | None:
            losses = pipe.step(ids, labels)
            return None if losses is None else torch.stack(losses).detach().mean()  # equal tokens per microbatch

        return Variant(name, torch_step, list(modules.values()), ranks=p)
    sched = build(schedule, num_ranks=p, num_microbatches=m)
    fast, fp8 = form != "eager", form == "fast fp8"
    # the user's call, causal_lm_stages(..., fast=True), compiles with inductor; another --backend
    # (aot_eager in the CPU smoke run) goes through what it calls, fast_hf_stages, with that backend
    native = args.backend == "inductor"
    stages, kwargs = causal_lm_stages(config, sched, rank, device=device, dtype=_dtype(args),
                                      attn_implementation="sdpa",
                                      module_fqns_per_stage=stage_fqns(config.num_hidden_layers, sched.num_stages),
                                      state_dict=source.state_dict(), fast=fast and native, fp8=fp8 and native)
    if fast and not native:
        kwargs.update(fast_hf_stages(stages, fp8=fp8, loss_fn=kwargs["loss_fn"], backend=args.backend))
    if fast and "cuda_graphs" not in kwargs and device.type == "cuda":
        raise RuntimeError("the fast form on CUDA did not ask for task graphs")
    pipe = Pipeline(stages, sched, **kwargs)

    def zbpp_step() -> torch.Tensor | None:
        return pipe.step({"input_ids": ids}, target=labels)

    variant = Variant(name, zbpp_step, list(stages.values()), ranks=p)
    variant.pipeline = pipe
    return variant


class Ranks:
    """The processes a run spans: this one alone, or torchrun's (``WORLD_SIZE`` > 1: the pipeline
    mode; the process group is started here unless it is up already)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.size, self.rank, self.device = args.world, 0, torch.device(args.device)
        if self.size > 1:
            import torch.distributed as dist

            from zbpp.runtime import init_distributed

            backend = init_distributed("nccl" if args.device.startswith("cuda") else "gloo", timeout=args.timeout)
            self.rank = dist.get_rank()
            if backend == "nccl":  # this rank's GPU (init_distributed selected it)
                self.device = torch.device("cuda", torch.cuda.current_device())
                args.device = str(self.device)

    def barrier(self) -> None:
        if self.size > 1:
            torch.distributed.barrier()

    def max_each(self, values: list[float]) -> list[float]:
        """Each value's maximum over the ranks (the same count on every rank)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t.tolist()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(out, obj)
        return out

    def first_error(self, error: str | None) -> str | None:
        """The first rank's error, on every rank (None if none failed): a variant that failed on one
        rank is dropped on all of them, so that no rank waits for a peer that gave it up."""
        errors = self.gather(error)
        return next((f"rank {r}: {e}" if self.size > 1 else e for r, e in enumerate(errors) if e), None)


class Timer:
    """Milliseconds of a step: CUDA events on one GPU; the wall clock between device
    synchronisations on the CPU and in the pipeline mode (whose communication runs on other streams)."""

    def __init__(self, cuda: bool, wall: bool = False) -> None:
        self.cuda, self.wall = cuda, wall

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any]) -> float:
        """Milliseconds of one call, from an idle device."""
        self.sync()
        if self.wall or not self.cuda:
            t0 = time.perf_counter()
            fn()
            self.sync()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def _kind(name: str) -> str:
    low = name.lower()
    if any(w in low for w in ("flash", "fmha", "attention", "sdpa", "cudnn")):
        return "attention"
    kind = kernel_kind(name)
    if kind == "other" and ("rms" in low or "norm" in low):
        return "norm"
    if kind == "other" and ("silu" in low or "mul" in low and "triton" not in low):
        return "activation"
    return kind


def kernel_profile_step(v: Variant, timer: Timer) -> dict:
    """GPU milliseconds of one step by kernel kind, the step's wall time and GPU idle share."""
    from torch.profiler import ProfilerActivity, profile

    v.clear()
    timer.sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        v.step()
        timer.sync()
    wall = (time.perf_counter() - t0) * 1e3
    by_kind = {k: 0.0 for k in KINDS}
    top: list[tuple[float, str]] = []
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA or evt.self_device_time_total <= 0:
            continue
        ms = evt.self_device_time_total / 1e3
        by_kind[_kind(evt.key)] += ms
        top.append((ms, evt.key))
    busy = sum(by_kind.values())
    return {"ms": {k: round(x, 2) for k, x in by_kind.items()}, "gpu_busy_ms": round(busy, 2),
            "wall_ms_profiled": round(wall, 2),
            "top_kernels": [{"ms": round(ms, 2), "kernel": k[:100]} for ms, k in sorted(top, reverse=True)[:8]]}


def run_preset(args: argparse.Namespace, preset: str, ranks: Ranks) -> dict:
    cuda = args.device.startswith("cuda")
    config = make_config(args, preset)
    rows = args.rows * args.microbatches
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (rows, args.seq_len), generator=gen).to(args.device)
    batch = {"input_ids": ids, "labels": ids}
    tokens = rows * args.seq_len
    flops = model_flops(config, tokens, args.seq_len)
    timer = Timer(cuda, wall=args.pipeline)
    torch._dynamo.reset()
    if args.pipeline:  # every rank's stages are cut from this one model
        source = hf_model(config, args)

        def build(name: str) -> Variant:
            return build_pipeline_variant(name, config, args, batch, source)
    else:
        def build(name: str) -> Variant:
            return build_variant(name, config, args, batch)

    def say(text: str) -> None:
        if ranks.rank == 0:
            print(f"  [{preset}] {text}", flush=True)

    variants: dict[str, Variant] = {}
    failed: dict[str, str] = {}
    for name in args.variant_list:  # every variant built before any is timed: no compile beside a timed step
        gc.collect()  # an earlier preset's variants freed now, not while this one builds
        before = torch.cuda.memory_allocated() + graph_pools_free() if cuda else 0
        t0 = time.perf_counter()
        error = None
        try:
            v = build(name)
        except Exception as exc:  # noqa: BLE001 - one broken variant must not cost the others
            error = f"{type(exc).__name__}: {exc}"[:2000]
        error = ranks.first_error(error)
        if error is None:
            try:
                for i in range(FIRST_WARMUP):
                    v.clear()
                    loss = v.step()
                    if i == 0 and loss is not None:
                        v.first_loss = float(loss)
                timer.sync()
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {exc}"[:2000]
            error = ranks.first_error(error)
        if error is not None:
            failed[name] = error
            say(f"{name} FAILED: {error[:500]}")
            continue
        variants[name] = v
        say(f"{name}: built and warmed up in {time.perf_counter() - t0:.1f} s")
        if cuda:
            v.clear()  # as before each timed step: what the step's peak is measured above
            v.resident = torch.cuda.memory_allocated() + graph_pools_free() - before
    if not args.quick and any("compile" in name or "fast" in name for name in variants):
        time.sleep(SETTLE_S)  # no compile worker busy beside a timed step (the eager rows are host-bound)
    for r in range(args.rounds):
        late = bool(r) and args.deadline_s is not None and time.perf_counter() - START > args.deadline_s
        if ranks.max_each([float(late)])[0]:  # the ranks stop together
            say(f"deadline: {r} rounds")
            break
        for name, v in variants.items():
            for _ in range(args.warmup):
                v.clear()
                v.step()
            for _ in range(args.steps):
                v.clear()
                v.host_probes.append(host_probe_ms())  # how fast the host runs: host-bound rows follow it
                ranks.barrier()  # the ranks start each timed step together
                if cuda:
                    timer.sync()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                v.times.append(timer.time(v.step))
                if cuda:
                    v.transient = max(v.transient, torch.cuda.max_memory_allocated() - base)
    profiles = {}
    for name in [p for p in args.kernel_profile.split(",") if p in variants] if cuda else []:
        try:
            profiles[name] = kernel_profile_step(variants[name], timer)
        except Exception as exc:  # noqa: BLE001 - a profiler failure keeps the timings
            profiles[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    results = {}
    for name in [n for n in args.variant_list if n in variants]:  # the same names, in the same order, on every rank
        v = variants[name]
        times = ranks.max_each(v.times)  # a step lasts as long as its slowest rank
        probes = ranks.max_each(v.host_probes)
        peaks = ranks.gather(v.resident + v.transient)[:v.ranks]
        loss = next((x for x in ranks.gather(v.first_loss) if x is not None), None)
        ms = statistics.median(times)
        results[name] = {
            "ranks": v.ranks, "ms": round(ms, 2), "ms_min": round(min(times), 2), "ms_max": round(max(times), 2),
            "tokens_per_s": round(tokens / ms * 1e3),
            "mfu": round(flops / (ms * 1e-3) / (args.peak_tflops * 1e12 * v.ranks), 4),  # of the GPUs it uses
            "peak_gib": round(max(peaks) / 2**30, 2) if cuda else None,
            "peak_gib_per_rank": [round(b / 2**30, 2) for b in peaks] if cuda else None,
            "first_loss": loss, "times_ms": [round(t, 2) for t in times],
            "host_probe_ms": round(statistics.median(probes), 2),
            "host_probes_ms": [round(p, 2) for p in probes],
            "graph_forms": v.pipeline.graph_forms if v.pipeline is not None else None,  # this rank's
        }
        if name in profiles:
            results[name]["profile"] = profiles[name]
    ref = results[REFERENCE]["ms"] if REFERENCE in results else None
    torch_ms = {n: r["ms"] for n, r in results.items() if n.startswith("torch ")}
    best_torch = min(torch_ms, key=torch_ms.__getitem__) if torch_ms else None
    for r in results.values():
        r["speed_vs_hf_compile"] = round(ref / r["ms"], 3) if ref else None
        if args.pipeline:
            r["speed_vs_best_torch"] = round(torch_ms[best_torch] / r["ms"], 3) if best_torch else None
    return {"preset": preset, "config": {"hidden": config.hidden_size, "layers": config.num_hidden_layers,
                                         "ffn": config.intermediate_size, "heads": config.num_attention_heads,
                                         "vocab": config.vocab_size, "seq_len": args.seq_len, "rows": args.rows,
                                         "microbatches": args.microbatches},
            "ranks": ranks.size, "best_torch": best_torch,
            "tokens_per_step": tokens, "model_tflops_per_step": round(flops / 1e12, 3), "results": results,
            "failed": failed}


def print_table(run: dict) -> None:
    c = run["config"]
    print(f"\n{run['preset']}: hidden {c['hidden']}, {c['layers']} layers, ffn {c['ffn']}, seq {c['seq_len']}, "
          f"{c['microbatches']} microbatches x {c['rows']} rows"
          + (f", {run['ranks']} ranks" if run["ranks"] > 1 else ""))
    pipeline = run["ranks"] > 1
    width, peak_width = (46, 17) if pipeline else (28, 9)
    print(f"{'variant':<{width}} {'ms/step':>9} {'min-max':>15} {'tokens/s':>10} {'MFU':>6} "
          f"{'peak GiB' + (' per rank' if pipeline else ''):>{peak_width}} {'vs hf compile':>14}"
          + (f" {'vs best torch':>14}" if pipeline else "") + f" {'first loss':>11} {'host probe ms':>13}")
    for name, r in run["results"].items():
        vs = f"{r['speed_vs_hf_compile']:.3f}x" if r["speed_vs_hf_compile"] else "-"
        peaks = r["peak_gib_per_rank"] if pipeline else [r["peak_gib"]]
        peak = "/".join(f"{x:.2f}" for x in peaks) if r["peak_gib"] is not None else "-"
        label = name + (" (rank 0 alone)" if pipeline and r["ranks"] == 1 else "")
        label += f" [{'/'.join(r['graph_forms'])}]" if r.get("graph_forms") else ""
        line = (f"{label:<{width}} {r['ms']:>9.2f} {r['ms_min']:>7.1f}-{r['ms_max']:<7.1f} {r['tokens_per_s']:>10} "
                f"{r['mfu']:>6.1%} {peak:>{peak_width}} {vs:>14}")
        if pipeline:
            torch_vs = f"{r['speed_vs_best_torch']:.3f}x" if r["speed_vs_best_torch"] else "-"
            line += f" {torch_vs:>14}"
        loss = f"{r['first_loss']:.6f}" if r["first_loss"] is not None else "-"
        print(f"{line} {loss:>11} {r['host_probe_ms']:>13.1f}")
    if pipeline and run["best_torch"]:
        print(f"best torch: {run['best_torch']} "
              "(eager: its zero-bubble schedules refuse compiled stages, pytorch#161904)")
    for name, why in run["failed"].items():
        print(f"{name:<{width}} FAILED: {why[:300]}")
    print(f"host probe: a fixed piece of host work timed before each step (median; {FAST_HOST_MS:.0f} ms on a "
          "fast host): host-bound rows (eager steps of small microbatches, FP8 eager) slow down as it grows")
    for name, r in run["results"].items():
        p = r.get("profile")
        if p and "error" in p:
            print(f"  profile {name}: {p['error']}")
        elif p:
            kinds = " ".join(f"{k} {v:.1f}" for k, v in p["ms"].items())
            print(f"  profile {name}: GPU busy {p['gpu_busy_ms']:.1f} of {p['wall_ms_profiled']:.1f} ms: {kinds}")


def main(argv: list[str] | None = None) -> dict:
    """The run's report (on every rank; rank 0 prints the tables and writes ``--out``)."""
    args = parse_args(argv)
    ranks = Ranks(args)
    cuda = args.device.startswith("cuda")
    report = {"benchmark": "bench_hf", "env": run_env(cuda), "argv": sys.argv[1:] if argv is None else argv,
              "ranks": ranks.size, "variants": args.variant_list, "fp8_available": fp8_available(), "runs": []}
    for preset in args.presets:
        report["runs"].append(run_preset(args, preset, ranks))
        if ranks.rank == 0:
            print_table(report["runs"][-1])
            write_report(report, args.out)  # after each preset: a later failure keeps the earlier figures
    return report


if __name__ == "__main__":
    report = main()
    if report["ranks"] > 1:
        from zbpp.runtime import shutdown_and_exit

        shutdown_and_exit(0)  # torchrun's ranks leave together (gloo can abort at interpreter exit)
