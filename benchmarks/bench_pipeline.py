"""Step time of zbpp's schedules against the zero-bubble limit and torch.distributed.pipelining.

Run under torchrun, one process per GPU (NCCL)::

    torchrun --nproc-per-node=2 benchmarks/bench_pipeline.py --out bench.json
    torchrun --nproc-per-node=2 benchmarks/bench_pipeline.py --model mlp-stack --microbatches 4,8,16 \\
        --layers-kind zbpp,fp8 --out bench.json
    torchrun --nproc-per-node=2 benchmarks/bench_pipeline.py --model mlp-stack --socket --out socket.json
    torchrun --nproc-per-node=2 benchmarks/bench_pipeline.py --quick --out quick.json   # CPU gloo smoke run

Models (``--model``): ``transformer`` is `zbpp.demo`'s causal transformer (embeddings, pre-norm
attention + MLP blocks, head); ``mlp-stack`` is ``--layers`` pre-norm residual blocks
``x + LayerNormMLP(x)`` on ``--tokens`` x ``--hidden`` inputs with an MSE loss. The ``--layers``
blocks are split evenly over the stages of each schedule, so every row runs the same model.
Layers (``--layers-kind``, a list: each kind is a case of its own): ``zbpp`` (delayed-wgrad
modules: W is a real task), ``torch`` (torch.nn LayerNorm, Linear, GELU: W is empty) or ``fp8``
(the zbpp modules under `zbpp.modules.fp8_autocast`; GPUs only).

Each case (model, layers kind, microbatches m) times, in one run:

- ``ideal``: the zero-bubble limit. Each rank runs its stage of the one-stage-per-rank split (the
  same modules as 1F1B's) over all m microbatches, forward and full backward (F, B, W of one
  microbatch after the other; random inputs of the activation's shape where a previous stage
  would send them, random output gradients where the next would), with no pipeline and no
  communication. Its step time is the slowest rank's. A second ideal row with torch.nn layers is
  the reference of the torch.nn rows. Both run again at the end of the case (``ideal (end)``) and
  % ideal uses the mean of the two: before the first case every GPU runs ``--heat-soak`` seconds of
  GEMMs (default 30), because an H200 at its power cap clocks lower as it warms, and a cold ideal
  timed first ran its GEMMs 3-5% faster than the rows after it.
- zbpp's schedules (``--zbpp``) with the case's layers; ``--zbpp-torch-layers`` (1f1b, zb-h1, zb-v)
  also with torch.nn layers (like for like with torch); ``zb-auto`` / ``zbv-auto`` are built from
  the costs measured in this run (below).
- ``ordered`` (``--ordered``): each rank runs its tasks of a zbpp schedule in the schedule's order,
  back to back, with no communication (random inputs where another rank would send them, as the
  ideal): what the order alone costs against the ideal (memory in flight, caches, the allocator),
  apart from crossing GPUs and the schedule's fill and drain.
- torch.distributed.pipelining's schedules (``--torch``) with torch.nn layers.
- ``pick``: the schedule `zbpp.schedules.pick_schedule` selects from the costs measured in this
  run and ``--pick-memory-limit``; its time is that of the row running the same schedule (or its
  own, if no row does).

Per row: the median step time over ``--steps`` steps after ``--warmup`` (no optimizer: the
pipeline is what is measured; a step is as long as its slowest rank, after a device
synchronisation), % of ideal (100 x ideal / step), x best torch (fastest torch step / this step)
and the peak memory allocated during the timed steps (largest rank). zbpp rows add the measured
bubble rate and the simulator's prediction: after the warm-up, ``--task-time-steps`` steps (default
5) run on a second `Pipeline` over the same modules with ``record_task_times=True`` (the timed steps run
without recording: timing the recording Pipeline instead measured the same step, 188.05 against 187.99 ms),
``Costs.from_task_times`` turns each step's task times into per-stage F, B, W costs, and the row's
costs are their median over the recorded steps but the first (which exchanges activation shapes):
on the H200s at their power cap one step in three or four runs 5-10% long, in the recorded steps
as in the timed ones, and the costs of one step were off the timed median by as much. The message time
``comm`` is measured by a send/recv ping-pong of one activation between neighbouring ranks, and
the predicted step is ``zbpp.schedules.program.program_makespan(pipe.program, costs)``: the simulator's
timeline of the program the row's Pipeline ran, with each message leaving only once both its ends are
posted (NCCL's rendezvous; ``simulated_ms`` in the JSON is ``simulate``'s, where messages leave
with their producer: on a slow link with a program made for a fast one, the two differ by 9-19%).
Zbpp's programs are made for the measured link (``--program-comm``, default ``measured``: the ideal's
F, B, W and the measured message time), and no parameter is fitted: on 2 x H200 with the median
costs the prediction was within 1.7% of every zbpp row at m = 8 and 16 over NVLink (zb-v 1.6% and
1.0%), 2.2% (zb-v) to 4.4% (zb-h1) short at m = 4, and within 0.5% for the transformer's zb-v at
m = 8 (with the last step's costs, before: 1.6-3.4% over sockets, 4-9% too slow for V rows at m = 4). ``--fit-message-overhead`` adds a
``message_overhead`` (compute a rank loses per message it sends or receives) fitted on the
measured step of the ``--pick-costs-from`` row (``zbpp.schedules.fit_message_overhead``): that row
then matches by construction; it stood in for receives posted too late for a slow link, before
programs were made for the link, and over NVLink it over-predicts the V schedules, which send twice
the messages. ``--telemetry`` samples the GPUs with nvidia-smi (`gpu_telemetry.py`) and adds each
row's mean SM clock, power and temperature over its timed steps: at the power cap a GPU's clock is
what its other work leaves of the power budget.

The pick: costs per rank-stage from the recorded steps of ``--pick-costs-from`` (default zb-h1;
the ideal's task times when that row is absent), ``comm`` as above, and memory per rank-stage and
microbatch measured in the ideal's recorded step (activation: what F keeps; wgrad: what B leaves
for W), in units of the mean rank-stage activation; ``--pick-memory-limit`` is per rank in those
units (default p: 1F1B's activation memory) or in GiB of activations (``20GiB``; GPUs only).

``--socket`` makes NCCL use TCP sockets over the loopback interface instead of NVLink/PCIe
(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo, set before the
process group starts): a stand-in for a slower network link between the two GPUs of one host.

Prints one table per case on rank 0 and writes JSON (``--out``; ``--append`` adds this run's rows
to an existing file): ``{"meta": {..., "runs": [...], "cases": [...]}, "rows": [{"impl", "schedule",
"m", "layers", "step_ms", "pct_of_ideal", "predicted_ms", ...}]}``. A configuration that fails is
reported in its row and the run goes on (a failure during a step can still hang until the
process-group timeout, ``--timeout``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import statistics
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zbpp import Pipeline
from zbpp.demo import ModelConfig, lm_loss, make_batch, make_stage
from zbpp.modules import DelayedScaling, LayerNormMLP, current_microbatch, fp8_autocast, is_delayed, microbatch
from zbpp.runtime import init_distributed, measured_bubble_rate, shutdown_and_exit
from zbpp.schedules import Costs, Kind, Memory, Schedule, available, build, fit_message_overhead, options_of, simulate
from zbpp.schedules.bounds import lower_bound
from zbpp.schedules.program import make_program, program_makespan
from zbpp.schedules.select import evaluate_candidates, scale_to_stages

from gpu_telemetry import Telemetry  # benchmarks/gpu_telemetry.py (this script's folder is on sys.path)
from provenance import code_identity
from torch_pipelining import TorchPipeline, torch_num_stages, torch_stage_ids

ZBPP_DEFAULT = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "dualpipe-v",
                "zb-auto", "zbv-auto"]
ZBPP_TORCH_LAYERS = ["1f1b", "zb-h1", "zb-v"]
TORCH_DEFAULT = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
                 "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
LAYER_KINDS = ("zbpp", "torch", "fp8")
SOCKET_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}
PING_PONGS = 10  # timed round trips of the comm measurement (after 3 untimed)


# -- options ------------------------------------------------------------------------------------
def _program_comm(text: str) -> float | str:
    """--program-comm: 'measured', 'default', or a link time >= 0 in task units."""
    if text in ("measured", "default"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give 'measured', 'default' or a number >= 0 (task units)")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas (e.g. 4,8,16), got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1 separated by commas, got {text!r}")
    return values


def _kinds(text: str) -> list[str]:
    kinds = [x.strip() for x in text.split(",") if x.strip()]
    bad = [k for k in kinds if k not in LAYER_KINDS]
    if not kinds or bad:
        raise argparse.ArgumentTypeError(f"layers kinds are {', '.join(LAYER_KINDS)} (comma separated), got {text!r}")
    return kinds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="zbpp schedules against the zero-bubble limit and torch.distributed.pipelining "
                                 "(run under torchrun; see the module docstring)")
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps, gloo on CPU: a smoke run")
    ap.add_argument("--model", choices=["transformer", "mlp-stack"], default="transformer",
                    help="transformer: zbpp.demo's causal LM; mlp-stack: --layers blocks x + LayerNormMLP(x)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 4096)")
    ap.add_argument("--ffn", type=int, default=None,
                    help="MLP inner size (default 4 x hidden; the transformer's is 4 x hidden)")
    ap.add_argument("--layers", type=int, default=None,
                    help="blocks in the whole model, split evenly over each schedule's stages "
                    "(default: mlp-stack 16, transformer 2 per rank)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per microbatch (default 4096; transformer: rows of --seq-len tokens)")
    ap.add_argument("--microbatches", type=_int_list, default=None, help="microbatches per step, a list: 4,8,16 (default 8)")
    ap.add_argument("--layers-kind", type=_kinds, default=["zbpp"],
                    help="zbpp (delayed-wgrad modules), torch (torch.nn) or fp8 (zbpp modules under fp8_autocast; GPUs "
                    "only), a comma list: one case per kind (default zbpp)")
    ap.add_argument("--heads", type=int, default=None, help="transformer: attention heads (default 32)")
    ap.add_argument("--seq-len", type=int, default=None, help="transformer: sequence length (default 2048)")
    ap.add_argument("--blocks-per-stage", type=int, default=None,
                    help="older spelling of --layers: blocks per stage of a one-stage-per-rank schedule")
    ap.add_argument("--rows-per-microbatch", type=int, default=None,
                    help="transformer: older spelling of --tokens (in rows)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per row (default 20)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps per row before them (default 5); zbpp rows then run --task-time-steps "
                    "recorded steps on a second Pipeline, the ideal one, before the timed steps")
    ap.add_argument("--task-time-steps", type=int, default=5,
                    help="recorded steps per zbpp row (default 5, at least 2: the first step of a Pipeline exchanges "
                    "activation shapes); the costs are the median over the others")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default bf16 on GPU, fp32 on CPU")
    ap.add_argument("--zbpp", default=None, help="zbpp schedules (comma separated)")
    ap.add_argument("--torch", default=None, help="torch.distributed.pipelining schedules (comma separated)")
    ap.add_argument("--ordered", default="",
                    help="zbpp schedules whose task order each rank also runs alone, with no communication and no "
                         "waiting (rows 'ordered'; comma separated): the order's own cost against the ideal")
    ap.add_argument("--zbpp-torch-layers", default=",".join(ZBPP_TORCH_LAYERS),
                    help="zbpp schedules also run with torch.nn layers, like for like with torch (comma separated; "
                    "with --layers-kind zbpp)")
    ap.add_argument("--pick-costs-from", default="zb-h1",
                    help="one-stage-per-rank zbpp schedule whose recorded costs feed the pick and zb-auto/zbv-auto "
                    "('ideal': the ideal row's task times)")
    ap.add_argument("--pick-memory-limit", default=None,
                    help="per-rank activation memory the pick must fit: in mean rank-stage activations of one "
                    "microbatch (default: p, 1F1B's) or in GiB ('20GiB', GPUs only)")
    ap.add_argument("--program-comm", type=_program_comm, default="measured",
                    help="the times zbpp's program places sends and receives by: 'measured' (default): the ideal's "
                         "measured F/B/W and the measured message time (Pipeline(costs=...), what a slow link "
                         "needs); 'default': the program's DEFAULT_COSTS (unit tasks, a fast link); or a link time in "
                         "task units with unit tasks (0 posts each receive just before its consumer)")
    ap.add_argument("--kernel-profile", default=None, metavar="DIR", help="after each row's timed steps, profile one "
                    "more step (torch.profiler, GPUs) into DIR and add where its time went (kernel_timeline.py) to the row")
    ap.add_argument("--fit-message-overhead", action="store_true",
                    help="fit Costs.message_overhead (compute lost per message) on the pick-costs row's measured step "
                         "and add it to every prediction and to the pick (default: none; it stood in for receives posted "
                         "too late for a slow link, and over NVLink it over-predicts the V schedules)")
    ap.add_argument("--socket", action="store_true",
                    help="NCCL over TCP sockets on the loopback interface (sets NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 "
                    "NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo before init): a stand-in for a network link")
    ap.add_argument("--heat-soak", type=float, default=30.0,
                    help="seconds of back-to-back GEMMs on every GPU before the first case (0: none): a GPU at "
                         "its power cap clocks lower as it warms, so rows timed from a cold start run faster")
    ap.add_argument("--telemetry", action="store_true",
                    help="sample the GPUs of rank 0's host with nvidia-smi (SM clock, power, temperature) and add each "
                         "row's means over its timed steps to the row and the table")
    ap.add_argument("--timeout", type=float, default=600.0, help="process-group timeout in seconds")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--append", action="store_true", help="add this run's rows to the JSON already at --out")
    args = ap.parse_args(argv)
    # Refuse options that would be dropped, before the defaults fill them in: the row would
    # otherwise describe a model other than the one asked for.
    for flag in ("hidden", "ffn", "layers", "tokens", "heads", "seq_len", "blocks_per_stage", "rows_per_microbatch"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:  # else every rank fails deep in the model
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: need >= 1")
    if args.tokens is not None and args.rows_per_microbatch is not None:
        ap.error("give --tokens or --rows-per-microbatch, not both")
    if args.model == "mlp-stack":
        for flag in ("rows_per_microbatch", "seq_len", "heads"):
            if getattr(args, flag) is not None:
                ap.error(f"--{flag.replace('_', '-')} is for --model transformer; the MLP stack's microbatch is "
                         "--tokens rows")

    tiny = args.quick
    defaults = {"hidden": 32 if tiny else 4096, "heads": 4 if tiny else 32, "seq_len": 16 if tiny else 2048,
                "steps": 3 if tiny else 20, "warmup": 1 if tiny else 5, "microbatches": [4] if tiny else [8]}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.ffn is None:
        args.ffn = 4 * args.hidden
    if args.tokens is None:
        args.tokens = args.rows_per_microbatch * args.seq_len if args.rows_per_microbatch else (32 if tiny else 4096)
    if args.zbpp is None:
        args.zbpp = "1f1b,zb-h1,zb-v,zb-auto" if tiny else ",".join(ZBPP_DEFAULT)
    if args.torch is None:
        args.torch = "Schedule1F1B,ScheduleInterleavedZeroBubble,ScheduleZBVZeroBubble" if tiny else ",".join(TORCH_DEFAULT)
    if args.layers is not None and args.blocks_per_stage is not None:
        ap.error("give --layers or --blocks-per-stage, not both")
    if args.model == "transformer":
        if args.hidden % args.heads:  # else every rank fails splitting the attention heads
            ap.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
        if args.ffn != 4 * args.hidden:
            ap.error(f"--ffn {args.ffn}: the transformer's MLP is 4 x hidden ({4 * args.hidden}); "
                     "--ffn is for --model mlp-stack")
        if args.tokens % args.seq_len:
            ap.error(f"--tokens {args.tokens} is not a multiple of --seq-len {args.seq_len} (the transformer's microbatch "
                     "is whole sequences)")
    if args.warmup < 1:
        ap.error(f"--warmup {args.warmup}: need >= 1 (the first step of a Pipeline exchanges activation shapes)")
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: need >= 1")
    if args.task_time_steps < 2:
        ap.error(f"--task-time-steps {args.task_time_steps}: need >= 2 (the first step of a Pipeline exchanges shapes)")
    if "fp8" in args.layers_kind and (args.quick or not torch.cuda.is_available()):
        ap.error("--layers-kind fp8 needs CUDA GPUs (FP8 GEMMs on Hopper); this is a CPU run" +
                 (" (--quick runs gloo on CPU)" if args.quick else ""))
    if args.pick_memory_limit is not None:
        _, what = _parse_limit(args.pick_memory_limit, ap.error)
        if what == "GiB" and (args.quick or not torch.cuda.is_available()):
            ap.error(f"--pick-memory-limit {args.pick_memory_limit}: GiB needs the activation size measured on a GPU; "
                     "give it in rank-stage activations (e.g. 2)")
    if args.telemetry and (args.quick or not torch.cuda.is_available()):
        ap.error("--telemetry samples NVIDIA GPUs (nvidia-smi); this is a CPU run")
    if args.append and not args.out:
        ap.error("--append needs --out (the JSON file to add to)")
    return args


def _parse_limit(text: str, error: Callable[[str], Any]) -> tuple[float, str]:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*(GiB)?\s*", text, re.IGNORECASE)
    if match is None or float(match.group(1)) <= 0:
        error(f"--pick-memory-limit {text!r}: give a number > 0 (rank-stage activations) or a size like 20GiB")
    return float(match.group(1)), "GiB" if match.group(2) else "units"


# -- the models ---------------------------------------------------------------------------------
class ResidualMLP(nn.Module):
    """``x + mlp(x)``: LayerNormMLP (zbpp, fp8) or LayerNorm, Linear, GELU(tanh), Linear (torch)."""

    def __init__(self, hidden: int, ffn: int, kind: str, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.keep_fp8_casts = kind == "fp8"
        if kind == "torch":
            kw = {"dtype": dtype, "device": device}
            fc1, fc2 = nn.Linear(hidden, ffn, **kw), nn.Linear(ffn, hidden, **kw)
            for lin in (fc1, fc2):  # LayerNormMLP's initialisation, so the GEMMs see the same values
                nn.init.normal_(lin.weight, std=0.023)
                nn.init.zeros_(lin.bias)
            self.mlp: nn.Module = nn.Sequential(nn.LayerNorm(hidden, **kw), fc1, nn.GELU(approximate="tanh"), fc2)
        else:
            self.mlp = LayerNormMLP(hidden, ffn, delay_wgrad_compute=True, params_dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep_fp8_casts:
            # As the README shows: cast the FP8 weights on a stage's first microbatch, keep them after.
            key = current_microbatch()
            first = key[1] == 0 if isinstance(key, tuple) else None
            return x + self.mlp(x, is_first_microbatch=first)
        return x + self.mlp(x)


class MLPStage(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x


class FP8Stage(nn.Module):
    """Runs `inner` inside ``fp8_autocast`` (its backward follows the forward's recipe)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.recipe = DelayedScaling()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fp8_autocast(enabled=True, fp8_recipe=self.recipe):
            return self.inner(x)


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target.float())


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model of the benchmark, with the layers of one kind."""

    model: str
    kind: str
    hidden: int
    ffn: int
    layers: int
    tokens: int
    heads: int
    seq_len: int
    vocab: int = 256

    @property
    def loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return lm_loss if self.model == "transformer" else mse_loss

    @property
    def rows(self) -> int:
        """Rows of a microbatch along dim 0 (the dimension the pipelines split)."""
        return self.tokens // self.seq_len if self.model == "transformer" else self.tokens

    def with_kind(self, kind: str) -> "ModelSpec":
        return dataclasses.replace(self, kind=kind)

    def blocks_per_stage(self, num_stages: int) -> int:
        if self.layers % num_stages:
            raise ValueError(f"--layers {self.layers} does not split evenly over {num_stages} stages; "
                             f"use a multiple of {num_stages}")
        return self.layers // num_stages

    def stage(self, s: int, num_stages: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """Stage `s` of `num_stages`, built on `device` (the same values for the same (s, num_stages))."""
        per = self.blocks_per_stage(num_stages)
        torch.manual_seed(1009 * num_stages + s)
        if self.model == "transformer":
            cfg = ModelConfig(vocab=self.vocab, hidden=self.hidden, heads=self.heads, seq_len=self.seq_len,
                              blocks_per_stage=per)
            with torch.device(device):
                mod = make_stage(s, num_stages, cfg, layers="torch" if self.kind == "torch" else "zbpp", delayed=True)
            mod = mod.to(dtype=dtype)
        else:
            mod = MLPStage([ResidualMLP(self.hidden, self.ffn, self.kind, dtype, device) for _ in range(per)])
        return FP8Stage(mod) if self.kind == "fp8" else mod

    def batch(self, m: int, step: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole step's inputs and targets (m microbatches along dim 0)."""
        if self.model == "transformer":
            cfg = ModelConfig(vocab=self.vocab, hidden=self.hidden, heads=self.heads, seq_len=self.seq_len)
            return make_batch(cfg, rows=m * self.rows, step=step, device=device)
        g = torch.Generator(device=device).manual_seed(7919 + step)
        x = torch.randn(m * self.rows, self.hidden, generator=g, device=device, dtype=dtype)
        return x, torch.randn(m * self.rows, self.hidden, generator=g, device=device, dtype=dtype)

    def activation_shape(self) -> tuple[int, ...]:
        """Shape of one microbatch's activation between two stages."""
        if self.model == "transformer":
            return (self.rows, self.seq_len, self.hidden)
        return (self.rows, self.hidden)


# -- the benchmark ------------------------------------------------------------------------------
def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _fmt(x: Any, spec: str) -> str:
    return "" if x is None else format(x, spec)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        if args.socket:
            os.environ.update(SOCKET_ENV)
        backend = init_distributed("gloo" if args.quick else None, timeout=args.timeout)
        self.rank, self.p = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self._profiles = 0  # steps profiled with --kernel-profile
        self.backend = backend
        self.transport = backend + ("-socket" if args.socket and backend == "nccl" else "")
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if self.cuda else "fp32")]
        if args.layers is not None:
            layers = args.layers
        elif args.blocks_per_stage is not None:
            layers = args.blocks_per_stage * self.p
        elif args.model == "transformer":
            layers = 2 * self.p  # two blocks per stage of a one-stage-per-rank schedule
        else:
            layers = 4 if args.quick else 16
        self.spec = ModelSpec(args.model, args.layers_kind[0], args.hidden, args.ffn, layers, args.tokens, args.heads,
                              args.seq_len)
        self.zbpp_names = [n for n in args.zbpp.split(",") if n]
        self.torch_names = [n for n in args.torch.split(",") if n]
        self.zbpp_torch_names = [n for n in args.zbpp_torch_layers.split(",") if n]
        self.ordered_names = [n for n in args.ordered.split(",") if n]
        self._check_options()
        self.telemetry = Telemetry.start() if args.telemetry and self.rank == 0 else None

    def _check_options(self) -> None:
        """Refuse what cannot run before any GPU time: a --layers that some requested schedule
        cannot split evenly, a --pick-costs-from that is not one stage per rank."""
        src = self.args.pick_costs_from
        if src != "ideal":
            if src not in available():
                raise ValueError(f"--pick-costs-from {src!r}: not a zbpp schedule; give one of "
                                 f"{', '.join(available())} or 'ideal'")
            if build(src, num_ranks=self.p, num_microbatches=1).num_stages != self.p:
                raise ValueError(f"--pick-costs-from {src!r}: needs a schedule with one stage per rank (its costs are "
                                 "per rank-stage), e.g. zb-h1")
        for name in self.ordered_names:
            if name not in available() or "costs" in options_of(name):
                fixed = [n for n in available() if "costs" not in options_of(n)]
                raise ValueError(f"--ordered {name!r}: give zbpp schedules built without measured costs: "
                                 f"{', '.join(fixed)}")
        counts = {self.p}
        for name in self.zbpp_names + self.zbpp_torch_names + self.ordered_names:
            if name in available():
                counts.add(build(name, num_ranks=self.p, num_microbatches=1).num_stages)
        counts |= {torch_num_stages(n, self.p) for n in self.torch_names}
        for n in sorted(counts):
            self.spec.blocks_per_stage(n)

    # -- collectives --------------------------------------------------------------------------
    def bcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_max(self, value: float) -> float:
        return self.all_max_each([value])[0]

    def all_max_each(self, values: list[float]) -> list[float]:
        """Each value's maximum over the ranks (one all-reduce)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    # -- timing -------------------------------------------------------------------------------
    def time_steps(self, spec: ModelSpec, m: int, run_step: Callable[[torch.Tensor, torch.Tensor], None],
                   recorded_step: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                   task_time_steps: int = 1, after_recorded: Callable[[], None] | None = None) -> dict[str, Any]:
        """``--warmup`` untimed steps, then `task_time_steps` of `recorded_step` (when given), each
        timed on its own and followed by `after_recorded` (e.g. to collect its records), then
        ``--steps`` timed steps of `run_step`."""
        a = self.args
        n = a.warmup + (task_time_steps if recorded_step is not None else 0)
        recorded_s = []  # the recorded steps' own wall times: their costs describe steps this long
        for i in range(n):
            step = recorded_step if recorded_step is not None and i >= a.warmup else run_step
            x, y = spec.batch(m, i, self.device, self.dtype)
            if step is recorded_step:
                self.sync()
                t0 = time.perf_counter()
            step(x, y)
            if step is recorded_step:
                self.sync()
                recorded_s.append(time.perf_counter() - t0)
                if after_recorded is not None:
                    after_recorded()
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        started = time.time()
        for i in range(a.steps):
            x, y = spec.batch(m, n + i, self.device, self.dtype)
            self.sync()
            t0 = time.perf_counter()
            run_step(x, y)
            self.sync()
            times.append(time.perf_counter() - t0)
        step_s = self.all_max(statistics.median(times))  # a step takes as long as its slowest rank
        peak = self.all_max(torch.cuda.max_memory_allocated() / 2**30 if self.cuda else 0.0)
        out = {"step_ms": 1e3 * step_s, "tokens_per_s": m * spec.tokens / step_s, "peak_mem_gib": peak,
               # wall clock of the timed steps, to line a row up with GPU telemetry (clocks, power)
               # sampled beside the run, e.g. `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw -lms 100`
               "timed_unix_s": [started, time.time()],
               # every timed step, and the recorded steps (their costs describe steps this long)
               "step_ms_all": [1e3 * t for t in self.all_max_each(times)]}
        if recorded_s:
            out["recorded_step_ms"] = [1e3 * t for t in self.all_max_each(recorded_s)]
        if self.telemetry is not None:
            out["gpu"] = self.telemetry.window(*out["timed_unix_s"])
        if a.kernel_profile and self.cuda:
            out["kernels"] = self.kernel_profile(run_step, spec.batch(m, n + a.steps, self.device, self.dtype))
        return out

    def kernel_profile(self, run_step: Callable[[torch.Tensor, torch.Tensor], None],
                       batch: tuple[torch.Tensor, torch.Tensor]) -> list[dict[str, Any]]:
        """One more step under torch.profiler; every rank's `kernel_timeline.summarize` of it."""
        from kernel_timeline import summarize

        self._profiles += 1
        path = os.path.join(self.args.kernel_profile, f"step{self._profiles}-rank{self.rank}.json")
        os.makedirs(self.args.kernel_profile, exist_ok=True)
        self.sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run_step(*batch)
            self.sync()
        prof.export_chrome_trace(path)
        gathered: list[Any] = [None] * self.p
        dist.all_gather_object(gathered, summarize(path))
        return gathered

    def neighbour_pairs(self) -> Iterator[tuple[int, int]]:
        """For each pair of neighbouring ranks (r, r+1) in turn, after a barrier of all ranks:
        ``(r, peer)`` on the two ranks of the pair (the other ranks only join the barriers)."""
        for r in range(self.p - 1):
            dist.barrier()
            if self.rank in (r, r + 1):
                yield r, (r + 1 if self.rank == r else r)

    def measure_comm(self, spec: ModelSpec) -> float:
        """One-way time (s) of one activation message between neighbouring ranks: a ping-pong per
        pair (r, r+1), the slowest pair."""
        buf = torch.randn(spec.activation_shape(), device=self.device).to(self.dtype)
        back = torch.empty_like(buf)
        worst = 0.0
        for r, peer in self.neighbour_pairs():
            for i in range(3 + PING_PONGS):
                if i == 3:
                    self.sync()
                    t0 = time.perf_counter()
                if self.rank == r:
                    dist.isend(buf, peer).wait()
                    dist.irecv(back, peer).wait()
                else:
                    dist.irecv(back, peer).wait()
                    dist.isend(back, peer).wait()
            self.sync()
            worst = max(worst, (time.perf_counter() - t0) / (2 * PING_PONGS))
        return self.all_max(worst)

    # -- the ideal: no pipeline, no communication -----------------------------------------------
    def run_ideal(self, spec: ModelSpec, m: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The ideal row, and (on every rank) the ideal's per-rank-stage costs (s) and memory (bytes)."""
        r, p = self.rank, self.p
        stage = spec.stage(r, p, self.device, self.dtype)
        delayed = [mod for mod in stage.modules() if is_delayed(mod)]  # zbpp layers do not nest delayed modules
        first, last = r == 0, r == p - 1
        shape = spec.activation_shape()
        g = torch.Generator(device=self.device).manual_seed(31 + r)
        acts = [] if first else [self._stand_in(shape, g, gradient=False) for _ in range(m)]
        grads = [] if last else [self._stand_in(shape, g, gradient=True) for _ in range(m)]
        probe_mb = min(1, m - 1)  # microbatch 1: the parameters' .grad already exist then
        probe: dict[str, float] = {}
        records: list[dict[str, Any]] = []

        def clock() -> Any:
            if self.cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                return ev
            return time.perf_counter()

        def one_step(x: torch.Tensor, y: torch.Tensor, record: bool = False) -> None:
            xs = torch.tensor_split(x, m) if first else acts
            ys = torch.tensor_split(y, m) if last else [None] * m
            marks = []
            for j in range(m):
                mem0 = torch.cuda.memory_allocated() if record and self.cuda and j == probe_mb else None
                t0 = clock() if record else None
                with microbatch((r, j)):
                    out = stage(xs[j])
                    loss = spec.loss_fn(out, ys[j]) / m if last else None
                t1 = clock() if record else None
                if mem0 is not None:  # F keeps the saved tensors; a sent output is freed in a pipeline
                    sent = 0 if last else out.numel() * out.element_size()
                    probe["activation"] = torch.cuda.memory_allocated() - mem0 - sent
                if last:
                    loss.backward()
                else:
                    out.backward(grads[j])
                del out, loss
                if not first:
                    xs[j].grad = None  # the pipeline sends it away
                t2 = clock() if record else None
                if mem0 is not None:  # what B leaves for W
                    probe["wgrad"] = torch.cuda.memory_allocated() - mem0
                for mod in delayed:
                    mod.backward_dw((r, j))
                if record:
                    marks.append((j, t0, t1, t2, clock()))
            for q in stage.parameters():
                q.grad = None
            if record:
                self.sync()
                for j, t0, t1, t2, t3 in marks:
                    for kind, s, e in (("F", t0, t1), ("B", t1, t2), ("W", t2, t3)):
                        if self.cuda:
                            start, end = marks[0][1].elapsed_time(s) / 1e3, marks[0][1].elapsed_time(e) / 1e3
                        else:
                            start, end = s - marks[0][1], e - marks[0][1]
                        records.append({"rank": r, "action": f"{kind}{r}.{j}", "start": start, "end": end})

        row = self.time_steps(spec, m, one_step, recorded_step=lambda x, y: one_step(x, y, record=True))
        gathered: list[Any] = [None] * p
        dist.all_gather_object(gathered, (records, probe))
        all_records = [rec for recs, _ in gathered for rec in recs]
        costs = Costs.from_task_times(all_records, p)
        act = [pr.get("activation") for _, pr in gathered]
        wg = [pr.get("wgrad") for _, pr in gathered]
        info = {"costs": costs, "activation_bytes": act, "wgrad_bytes": wg}
        row["costs_ms"] = _costs_ms(costs)
        del stage, acts, grads, delayed
        return row, info

    def _stand_in(self, shape: tuple[int, ...], g: torch.Generator, *, gradient: bool) -> torch.Tensor:
        """What another rank would send, made up: a random activation (a leaf that requires grad) or
        output gradient, of a mean loss's size (random, not ones: a real loss gradient is full rank,
        and a GEMM's speed at the power cap depends on its data)."""
        t = torch.randn(shape, generator=g, device=self.device).to(self.dtype)
        return t / torch.Size(shape).numel() if gradient else t.requires_grad_()

    # -- a schedule's order with no communication -------------------------------------------------
    def run_ordered(self, spec: ModelSpec, sched: Schedule) -> dict[str, Any]:
        """Each rank runs its own tasks of `sched` in the schedule's order, back to back, with no
        communication: random activations and output gradients where another rank would send them
        (made before the timed steps, as the ideal's), outputs and input gradients handed over in
        memory between stages of one rank (as the runtime does). Its step against the ideal's is what
        the order alone costs (memory in flight, caches, the allocator), apart from crossing GPUs
        and from the schedule's fill and drain."""
        r, n, m = self.rank, sched.num_stages, sched.num_microbatches
        stages = {s: spec.stage(s, n, self.device, self.dtype) for s in sched.stages_on(r)}
        delayed = {s: [mod for mod in st.modules() if is_delayed(mod)] for s, st in stages.items()}
        # which inputs come from another rank and which are handed over in memory: the runtime's program
        rp = make_program(sched).ranks[r]
        hands_on = set(rp.handed_from.values())  # tasks whose output a task of this rank consumes
        shape = spec.activation_shape()
        g = torch.Generator(device=self.device).manual_seed(53 + r)
        # activations for F, output gradients for B
        received = {task: self._stand_in(shape, g, gradient=task.kind is not Kind.F)
                    for task in sorted(rp.recv_of, key=str)}

        def one_step(x: torch.Tensor, y: torch.Tensor) -> None:
            xs, ys = torch.tensor_split(x, m), torch.tensor_split(y, m)
            inputs: dict[tuple[int, int], Any] = {}
            outputs: dict[tuple[int, int], torch.Tensor] = {}
            handed_grad: dict[Any, torch.Tensor] = {}  # B task -> its input gradient, for a B of this rank
            for task in sched.orders[r]:
                s, j = task.stage, task.microbatch
                if task.kind is Kind.F:
                    if s == 0:
                        inp = xs[j]
                    elif task in received:
                        inp = received[task]
                    else:  # handed over in memory: a fresh leaf, as the runtime makes it
                        inp = outputs[(rp.handed_from[task].stage, j)].detach().requires_grad_()
                    inputs[(s, j)] = inp
                    with microbatch((s, j)):
                        out = stages[s](inp)
                        outputs[(s, j)] = spec.loss_fn(out, ys[j]) / m if s == n - 1 else out
                    continue
                if task.kind in (Kind.B, Kind.BW):
                    out = outputs.pop((s, j))
                    if s == n - 1:
                        out.backward()
                    else:
                        out.backward(received[task] if task in received else handed_grad.pop(rp.handed_from[task]))
                    inp = inputs.pop((s, j))
                    if task in hands_on:
                        handed_grad[task] = inp.grad
                    if s > 0:
                        inp.grad = None  # sent away or handed over
                if task.kind in (Kind.W, Kind.BW):
                    for mod in delayed[s]:
                        mod.backward_dw((s, j))
            assert not (inputs or outputs or handed_grad), "a task of the order did not run"
            for st in stages.values():
                for q in st.parameters():
                    q.grad = None

        out = self.time_steps(spec, m, one_step)
        del stages, received, delayed
        return out

    # -- zbpp -----------------------------------------------------------------------------------
    def run_zbpp(self, spec: ModelSpec, sched: Schedule, comm_s: float,
                 measured: Costs | None = None) -> tuple[dict[str, Any], Costs]:
        """A zbpp row, and (on every rank) the costs measured in its recorded step."""
        n = sched.num_stages
        mine = {s: spec.stage(s, n, self.device, self.dtype) for s in sched.stages_on(self.rank)}
        a = self.args
        program_costs = None
        if a.program_comm == "measured" and measured is not None:  # the ideal's rank-stages cut into this schedule's stages
            program_costs, _ = scale_to_stages(dataclasses.replace(measured, comm=comm_s), Memory(), self.p, n)
        elif a.program_comm not in ("default", "measured"):
            program_costs = Costs(1, 1, 1, comm=a.program_comm)
        pipe = Pipeline(mine, sched, spec.loss_fn, device=self.device, costs=program_costs)
        recorded = Pipeline(mine, sched, spec.loss_fn, device=self.device, record_task_times=True, costs=program_costs)
        params = list(pipe.parameters())

        def step(x: torch.Tensor, y: torch.Tensor, which: Pipeline = pipe) -> None:
            which.step(x, target=y)
            for q in params:
                q.grad = None

        steps_records: list[Any] = []  # each recorded step's records (on rank 0; None elsewhere)
        out = self.time_steps(spec, sched.num_microbatches, step, recorded_step=lambda x, y: step(x, y, recorded),
                              task_time_steps=a.task_time_steps,
                              after_recorded=lambda: steps_records.append(recorded.task_times()))
        costs = None
        if steps_records[-1] is not None:
            # the first step of a new Pipeline exchanges activation shapes (host waits that would
            # show as bubble): the costs are the median over the others (see the module docstring)
            kept = steps_records[1:]
            costs = median_costs([Costs.from_task_times(recs, n, comm=comm_s) for recs in kept])
            # each recorded step: first task start to last task end on the slowest rank
            spans = [1e3 * max(rec["end"] for rec in recs) for recs in kept]
            out.update({"measured_bubble": statistics.median(measured_bubble_rate(recs) for recs in kept),
                        "num_stages": n, "recorded_span_ms": spans})
        out["_program"] = pipe.program  # what `_predict` replays
        out["program_costs_ms"] = None if program_costs is None else _costs_ms(program_costs)  # None: DEFAULT_COSTS
        del pipe, recorded, mine, params
        return out, self.bcast(costs)

    # -- torch.distributed.pipelining -------------------------------------------------------------
    def run_torch(self, spec: ModelSpec, name: str, m: int) -> dict[str, Any]:
        n = torch_num_stages(name, self.p)
        modules = {s: spec.stage(s, n, self.device, self.dtype) for s in torch_stage_ids(name, self.rank, self.p)}
        pipe = TorchPipeline(name, modules, self.p, self.device, m, spec.loss_fn)
        params = pipe.parameters()

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            pipe.step(x, y)
            for q in params:
                q.grad = None

        out = self.time_steps(spec, m, step)
        del modules, pipe, params
        return out

    # -- one case: (model, layers kind, m) --------------------------------------------------------
    def run_case(self, kind: str, m: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        spec = self.spec.with_kind(kind)
        p, a = self.p, self.args
        torch_rows = kind in ("zbpp", "torch") and bool(self.torch_names)
        comm_s = self.measure_comm(spec)
        rows: list[dict[str, Any]] = []
        case: dict[str, Any] = {"model": spec.model, "layers": kind, "m": m, "comm_ms": 1e3 * comm_s}
        ideal_info: dict[str, dict[str, Any]] = {}
        costs_of: dict[str, Costs] = {}

        def record(row: dict[str, Any], job: Callable[[], Any]) -> Any:
            result = None
            try:
                result = job()
            except Exception as exc:  # noqa: BLE001 - one failing configuration must not end the run
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            dist.barrier()
            _free()
            rows.append(self._labelled(row, spec, m))
            if self.rank == 0:
                print(f"  done m={m:<3} {row['impl']:6} {row['schedule']:30} {row['layers']:5} "
                      f"{row.get('step_ms', row.get('error'))}", flush=True)
            return result

        # the ideal of each layers kind in the case, first and again last (see _ratios)
        ideal_kinds = [kind] + (["torch"] if torch_rows and kind != "torch" else [])

        def ideal_rows(schedule: str) -> None:
            for k in ideal_kinds:
                row = {"impl": "ideal", "schedule": schedule, "layers": k}

                def ideal_job(row: dict[str, Any] = row, k: str = k) -> None:
                    out, info = self.run_ideal(spec.with_kind(k), m)
                    row.update(out)
                    ideal_info.setdefault(k, info)

                record(row, ideal_job)

        ideal_rows("ideal")

        def zbpp_job(row: dict[str, Any], sched_fn: Callable[[], Schedule], k: str) -> None:
            sched = sched_fn()
            out, costs = self.run_zbpp(spec.with_kind(k), sched, comm_s, ideal_info.get(k, {}).get("costs"))
            row.update(out)
            row["_schedule"], row["_costs"] = sched, costs
            if k == kind:
                costs_of[row["schedule"]] = costs

        auto = [n for n in self.zbpp_names if n in available() and "costs" in options_of(n)]
        fixed = [n for n in self.zbpp_names if n not in auto]
        for name in fixed:
            row = {"impl": "zbpp", "schedule": name, "layers": kind}
            if name not in available():
                row["error"] = "not registered"
                rows.append(self._labelled(row, spec, m))
                continue
            opts = {"chunks": 2} if "chunks" in options_of(name) else {}
            record(row, lambda row=row, name=name, opts=opts: zbpp_job(
                row, lambda: build(name, num_ranks=p, num_microbatches=m, **opts), kind))

        for name in self.ordered_names:  # the same orders with no communication and no waiting
            row = {"impl": "ordered", "schedule": name, "layers": kind}
            opts = {"chunks": 2} if "chunks" in options_of(name) else {}
            record(row, lambda row=row, name=name, opts=opts: row.update(self.run_ordered(
                spec, build(name, num_ranks=p, num_microbatches=m, **opts))))

        # what the pick and the automatic schedules see: costs per rank-stage, comm, memory
        source = a.pick_costs_from if costs_of.get(a.pick_costs_from) is not None else "ideal"
        pick_costs = costs_of.get(source)
        if source == "ideal" and kind in ideal_info:
            c = ideal_info[kind]["costs"]
            pick_costs = Costs(c.f, c.b, c.w, comm_s)
        overhead_s = 0.0
        if pick_costs is not None and source != "ideal" and p > 1 and a.fit_message_overhead:  # p = 1: no messages
            measured = next(r for r in rows if r["impl"] == "zbpp" and r["layers"] == kind and r["schedule"] == source)
            overhead_s = fit_message_overhead(measured["_schedule"], pick_costs, measured["step_ms"] / 1e3,
                                              predict=lambda c, program=measured["_program"]: program_makespan(program, c))
            measured["overhead_fitted_here"] = True
            pick_costs = dataclasses.replace(pick_costs, message_overhead=overhead_s)
            case["overhead_fitted_on"] = source
        case["message_overhead_ms"] = 1e3 * overhead_s
        memory, limit, unit_bytes = self._pick_memory(ideal_info.get(kind))
        case.update({"pick_costs_from": source, "pick_costs_ms": None if pick_costs is None else _costs_ms(pick_costs),
                     "pick_memory": {"activation": list(_tuple(memory.activation)), "wgrad": list(_tuple(memory.wgrad)),
                                     "unit_gib": None if unit_bytes is None else unit_bytes / 2**30},
                     "pick_memory_limit": limit})

        for name in auto:
            row = {"impl": "zbpp", "schedule": name, "layers": kind}
            if pick_costs is None:
                row["error"] = "no measured costs (the ideal row failed)"
                rows.append(self._labelled(row, spec, m))
                continue

            def auto_sched(name: str = name) -> Schedule:
                cand = evaluate_candidates(p, m, pick_costs, memory=memory, memory_limit=limit, candidates=[name])[0]
                if cand.schedule is None:
                    raise ValueError(cand.error)
                return self.bcast(cand.schedule)  # rank 0's, so every rank runs the same orders

            record(row, lambda row=row, auto_sched=auto_sched: zbpp_job(row, auto_sched, kind))

        if kind == "zbpp":  # like for like with torch: the same zbpp schedules over torch.nn layers
            for name in [n for n in self.zbpp_torch_names if torch_rows]:
                row = {"impl": "zbpp", "schedule": name, "layers": "torch"}
                record(row, lambda row=row, name=name: zbpp_job(
                    row, lambda: build(name, num_ranks=p, num_microbatches=m), "torch"))
        if torch_rows:
            for name in self.torch_names:
                row = {"impl": "torch", "schedule": name, "layers": "torch"}
                record(row, lambda row=row, name=name: row.update(self.run_torch(spec.with_kind("torch"), name, m)))

        if pick_costs is not None:
            self._pick_row(rows, record, spec, m, pick_costs, memory, limit, kind, zbpp_job)
        ideal_rows("ideal (end)")
        for row in rows:
            _predict(row, overhead_s)
        self._ratios(rows)
        ideal_steps = [r["step_ms"] for r in rows if r["impl"] == "ideal" and r["layers"] == kind and "step_ms" in r]
        case["ideal_ms"] = statistics.mean(ideal_steps) if ideal_steps else None
        case["summary"] = _summary(rows, kind)
        for row in rows:
            row.pop("_schedule", None)
            row.pop("_costs", None)
            row.pop("_program", None)
        return rows, case

    def _pick_memory(self, info: dict[str, Any] | None) -> tuple[Memory, float, float | None]:
        """Memory per rank-stage in mean-activation units, the limit in them, and the unit in bytes."""
        p = self.p
        act = info["activation_bytes"] if info else [None] * p
        wg = info["wgrad_bytes"] if info else [None] * p
        if all(x is not None and x > 0 for x in act):
            unit = sum(act) / p
            memory = Memory(activation=tuple(x / unit for x in act),
                            wgrad=tuple(min(max(w or 0.0, 0.0), x) / unit for w, x in zip(wg, act)))
        else:  # not measurable here (CPU): the delayed-wgrad share of an MLP, about half
            unit, memory = None, Memory(activation=1.0, wgrad=0.5)
        text = self.args.pick_memory_limit
        if text is None:
            return memory, float(p), unit
        value, what = _parse_limit(text, _raise)
        if what == "units":
            return memory, value, unit
        if unit is None:  # the ideal row failed: nothing to convert with
            if self.rank == 0:
                print(f"  --pick-memory-limit {text}: no measured activation size (the ideal row failed); using {p}")
            return memory, float(p), unit
        return memory, value * 2**30 / unit, unit

    def _pick_row(self, rows: list[dict[str, Any]], record: Callable[..., Any], spec: ModelSpec, m: int,
                  costs: Costs, memory: Memory, limit: float, kind: str,
                  zbpp_job: Callable[..., None]) -> None:
        p = self.p
        ranked = evaluate_candidates(p, m, costs, memory=memory, memory_limit=limit)
        best = ranked[0]
        row: dict[str, Any] = {"impl": "pick", "schedule": best.name, "layers": kind, "pick_memory_limit": limit,
                               "pick_candidates": [{"schedule": c.name, "fits": c.fits,
                                                    "simulated_ms": None if c.result is None else 1e3 * c.result.makespan,
                                                    "simulated_peak": None if c.result is None
                                                    else max(c.result.peak_memory),
                                                    **({"error": c.error} if c.error else {})} for c in ranked]}
        if not best.fits:
            row["error"] = f"no candidate fits --pick-memory-limit {limit:g}"
            rows.append(self._labelled(row, spec, m))
            return
        assert best.schedule is not None and best.result is not None
        chosen = self.bcast(best.schedule)
        row["pick_simulated_ms"] = 1e3 * best.result.makespan
        same = next((r for r in rows if r["impl"] == "zbpp" and r["layers"] == kind and "step_ms" in r
                     and _same_orders(r.get("_schedule"), chosen)), None)
        if same is not None:  # the schedule already ran in this case: its measurement is the pick's
            row.update({k: v for k, v in same.items() if k not in ("impl", "schedule", "overhead_fitted_here")})
            row["same_as"] = same["schedule"]
            rows.append(self._labelled(row, spec, m))
            return
        record(row, lambda: zbpp_job(row, lambda: chosen, kind))

    def _labelled(self, row: dict[str, Any], spec: ModelSpec, m: int) -> dict[str, Any]:
        row.update({"m": m, "model": spec.model, "num_layers": spec.layers, "transport": self.transport})
        return row

    def _ratios(self, rows: list[dict[str, Any]]) -> None:
        # the mean of the case's first and last ideal step: rows run in between, and a GPU at its power
        # cap may still drift (it clocks lower as it warms; --heat-soak takes most of that out first)
        steps: dict[str, list[float]] = {}
        for r in rows:
            if r["impl"] == "ideal" and "step_ms" in r:
                steps.setdefault(r["layers"], []).append(r["step_ms"])
        ideal = {k: statistics.mean(v) for k, v in steps.items()}
        best_torch = min((r["step_ms"] for r in rows if r["impl"] == "torch" and "step_ms" in r), default=None)
        for r in rows:
            if "step_ms" not in r:
                continue
            if r["layers"] in ideal:
                r["pct_of_ideal"] = 100.0 * ideal[r["layers"]] / r["step_ms"]
            if best_torch is not None:
                r["ratio_vs_best_torch"] = best_torch / r["step_ms"]

    def heat_soak(self, seconds: float) -> None:
        """Back-to-back bf16 GEMMs for `seconds` on this rank's GPU, so that the first rows are not
        timed on a cold GPU. At its power cap an H200 sets its clock by the power it draws, which
        grows as it warms: one H200, 8 blocks on one rank, no communication, measured from a cold
        start: the ideal's GEMMs 3-5% faster than the same GEMMs in the rows timed after it."""
        if not self.cuda or seconds <= 0:
            return
        a = torch.randn(8192, 8192, device=self.device, dtype=torch.bfloat16)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(20):
                torch.mm(a, a)
            self.sync()
        dist.barrier()

    def run_all(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        rows, cases = [], []
        try:
            self.heat_soak(self.args.heat_soak)
            for kind in self.args.layers_kind:
                for m in self.args.microbatches:
                    case_rows, case = self.run_case(kind, m)
                    rows += case_rows
                    cases.append(case)
                    if self.rank == 0:
                        self.print_case(case, case_rows)
        finally:  # nvidia-smi would outlive a run that fails
            if self.telemetry is not None:
                self.telemetry.stop()
        return rows, cases

    def print_case(self, case: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        s = self.spec
        dev = torch.cuda.get_device_name() if self.cuda else "CPU"
        shape = f"hidden {s.hidden}, ffn {s.ffn}"
        if s.model == "transformer":
            shape += f", {s.heads} heads, seq {s.seq_len}"
        print(f"\n{s.model} ({case['layers']} layers), {s.layers} blocks, {shape}, {s.tokens} tokens x {case['m']} "
              f"microbatches, {self.dtype}, {self.p} ranks on {dev} ({self.transport}), torch {torch.__version__}")
        pc = case.get("pick_costs_ms")
        if pc:
            print(f"comm {case['comm_ms']:.3f} ms per message, overhead {case['message_overhead_ms']:.3f} ms of compute "
                  f"per message sent or received ({_fitted_on(case)}); pick costs from "
                  f"{case['pick_costs_from']} "
                  "(ms per rank-stage): "
                  f"F {_join(pc['f'])}  B {_join(pc['b'])}  W {_join(pc['w'])}; memory limit {case['pick_memory_limit']:g} "
                  f"rank-stage activations" + (f" (1 = {case['pick_memory']['unit_gib']:.2f} GiB)"
                                               if case['pick_memory']['unit_gib'] else ""))
        print(f"{'impl':<7} {'schedule':<30} {'layers':<6} {'step ms':>9} {'% ideal':>8} {'pred ms':>9} {'meas/pred':>9} "
              f"{'bound ms':>9} {'bubble':>7} {'x torch':>8} {'peak GiB':>9}" + ("  SM MHz per GPU" if self.telemetry else ""))
        for x in rows:
            if "error" in x:
                print(f"{x['impl']:<7} {x['schedule']:<30} {x['layers']:<6} failed: {x['error']}")
                continue
            print(f"{x['impl']:<7} {x['schedule']:<30} {x['layers']:<6} {x['step_ms']:>9.2f} "
                  f"{_fmt(x.get('pct_of_ideal'), '.1f'):>8} {_fmt(x.get('predicted_ms'), '.2f'):>9} "
                  f"{_fmt(x.get('measured_over_predicted'), '.3f'):>9} {_fmt(x.get('bound_ms'), '.2f'):>9} "
                  f"{_fmt(x.get('measured_bubble'), '.3f'):>7} "
                  f"{_fmt(x.get('ratio_vs_best_torch'), '.3f'):>8} {x['peak_mem_gib']:>9.2f}"
                  + ("  " + "/".join(f"{g['sm_mhz']:.0f}" for g in x["gpu"].values()) if x.get("gpu") else ""))
        for x in rows:
            for r, k in enumerate(x.get("kernels") or []):
                if k and k.get("kernels"):
                    print(f"  kernels {x['impl']} {x['schedule']} {x['layers']} rank {r}: span {k['span_ms']:.1f} busy "
                          f"{k['busy_ms']:.1f} idle {k['idle_ms']:.1f} ms; GEMMs {k['gemm_ms']:.1f} ms, "
                          f"{k['gemms_beside_nccl']}/{k['gemms']} beside NCCL (+{k['gemm_excess_ms']:.2f} ms); "
                          f"NCCL {k['nccl_ms']:.1f} ms ({k['nccl_beside_compute_ms']:.1f} beside compute)")
        _print_summary(case.get("summary", {}))
        print("% ideal = 100 x ideal step / step (same layers; the mean of the case's first and last ideal "
              "rows); pred ms = program_makespan(the row's program, the median of Costs.from_task_times(each recorded step "
              "but the first) + measured comm"
              + (" + fitted overhead" if self.args.fit_message_overhead else "")
              + "): simulate's step with each message leaving once both its ends are posted; "
              "bound ms = zbpp.schedules.bounds.lower_bound of the schedule's "
              "placement with those costs (no schedule beats it); x torch = fastest torch.distributed.pipelining "
              "step / step")


def _fitted_on(case: dict[str, Any]) -> str:
    source = case.get("overhead_fitted_on")
    return f"fitted on {source}'s step" if source else "not fitted"


def _predict(row: dict[str, Any], overhead_s: float) -> None:
    """A zbpp row's prediction: `program_makespan` of the program its Pipeline ran, with the costs of its
    own recorded steps (their median) and the case's message overhead (fitted on the pick-costs row's measured
    step); `simulate`'s step and the lower bound of its placement with the same costs."""
    sched, costs, program = row.get("_schedule"), row.get("_costs"), row.get("_program")
    if sched is None or costs is None or program is None or "step_ms" not in row:
        return
    costs = dataclasses.replace(costs, message_overhead=overhead_s)
    sim = simulate(sched, costs)
    row.update({"predicted_ms": 1e3 * program_makespan(program, costs), "simulated_ms": 1e3 * sim.makespan,
                "predicted_bubble": sim.bubble_rate, "costs_ms": _costs_ms(costs)})
    row["measured_over_predicted"] = row["step_ms"] / row["predicted_ms"]
    # what no schedule of this placement can beat with these task costs: how much of the gap to the
    # ideal is the tasks' own time in a pipeline, not the schedule or the runtime
    row["bound_ms"] = 1e3 * lower_bound(sched.placement, sched.num_microbatches, costs).makespan


def _summary(rows: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The case's headline figures (what issue 15 asks), from its rows."""
    ok = [r for r in rows if "step_ms" in r]
    mine = [r for r in ok if r["impl"] == "zbpp" and r["layers"] == kind]
    split_bw = [r for r in mine if r.get("_schedule") is not None
                and any(a.kind is Kind.W for order in r["_schedule"].orders for a in order)]
    out: dict[str, Any] = {}

    def fastest(xs: list[dict[str, Any]]) -> dict[str, Any] | None:
        return min(xs, key=lambda r: r["step_ms"], default=None)

    best_zb, best_zbpp = fastest(split_bw), fastest(mine)
    best_torch = fastest([r for r in ok if r["impl"] == "torch"])
    if best_zb is not None:
        out["best_zero_bubble"] = {"schedule": best_zb["schedule"], "pct_of_ideal": best_zb.get("pct_of_ideal")}
    if best_zbpp is not None:
        out["best_zbpp"] = {"schedule": best_zbpp["schedule"], "step_ms": best_zbpp["step_ms"],
                            "peak_mem_gib": best_zbpp["peak_mem_gib"]}
    if best_torch is not None and best_zbpp is not None:
        out["best_zbpp_vs_best_torch"] = best_torch["step_ms"] / best_zbpp["step_ms"]
        out["best_torch"] = {"schedule": best_torch["schedule"], "step_ms": best_torch["step_ms"]}
    zbv = next((r for r in ok if r["impl"] == "torch" and r["schedule"] == "ScheduleZBVZeroBubble"), None)
    if zbv is not None:
        out["torch_zbv_peak_mem_gib"] = zbv["peak_mem_gib"]
    ours = next((r for r in ok if r["impl"] == "zbpp" and r["schedule"] == "1f1b" and r["layers"] == "torch"), None)
    theirs = next((r for r in ok if r["impl"] == "torch" and r["schedule"] == "Schedule1F1B"), None)
    if ours is not None and theirs is not None:
        out["zbpp_1f1b_torch_layers_vs_torch_1f1b"] = theirs["step_ms"] / ours["step_ms"]
    pick = next((r for r in ok if r["impl"] == "pick"), None)
    if pick is not None and best_zbpp is not None:
        out["pick"] = {"schedule": pick["schedule"], "vs_best_zbpp": best_zbpp["step_ms"] / pick["step_ms"]}
        # the pick may only choose schedules that fit its memory limit: compare it with the best of those too
        fits = {c["schedule"]: c["fits"] for c in pick.get("pick_candidates", [])}
        within = fastest([r for r in mine if fits.get(r["schedule"])])
        if within is not None:
            out["pick"].update({"best_zbpp_within_limit": within["schedule"],
                                "vs_best_zbpp_within_limit": within["step_ms"] / pick["step_ms"]})
    # the row the overhead was fitted on matches by construction: the others are predictions
    off = [abs(r["measured_over_predicted"] - 1) for r in mine
           if "measured_over_predicted" in r and not r.get("overhead_fitted_here")]
    if off:
        out["max_abs_measured_over_predicted_minus_1"] = max(off)
    return out


def _print_summary(s: dict[str, Any]) -> None:
    parts = []
    if "best_zero_bubble" in s:
        z = s["best_zero_bubble"]
        parts.append(f"best zero-bubble {z['schedule']} at {_fmt(z['pct_of_ideal'], '.1f')}% of ideal")
    if "best_zbpp_vs_best_torch" in s:
        b = s["best_zbpp"]
        parts.append(f"best zbpp {b['schedule']} {s['best_zbpp_vs_best_torch']:.3f}x {s['best_torch']['schedule']} "
                     f"(peak {b['peak_mem_gib']:.2f} GiB" + (f", torch ZBV {s['torch_zbv_peak_mem_gib']:.2f})"
                                                             if "torch_zbv_peak_mem_gib" in s else ")"))
    if "zbpp_1f1b_torch_layers_vs_torch_1f1b" in s:
        parts.append(f"zbpp 1f1b on torch.nn layers {s['zbpp_1f1b_torch_layers_vs_torch_1f1b']:.3f}x torch's Schedule1F1B")
    if "pick" in s:
        k = s["pick"]
        parts.append(f"pick {k['schedule']} at {k['vs_best_zbpp']:.3f} of the best zbpp step"
                     + (f", {k['vs_best_zbpp_within_limit']:.3f} of the best within its memory limit "
                        f"({k['best_zbpp_within_limit']})" if "best_zbpp_within_limit" in k else ""))
    if "max_abs_measured_over_predicted_minus_1" in s:
        parts.append(f"measured within {100 * s['max_abs_measured_over_predicted_minus_1']:.1f}% of predicted")
    if parts:
        print("summary: " + "; ".join(parts))


def _raise(msg: str) -> None:
    raise ValueError(msg)


def _tuple(v: Any) -> tuple[float, ...]:
    return (float(v),) if isinstance(v, (int, float)) else tuple(float(x) for x in v)


def median_costs(samples: list[Costs]) -> Costs:
    """Each stage's F, B and W: the median over `samples` (costs of the same stages, one per step;
    a single number stands for every stage); comm and the message overhead from the first (they
    are not measured per step).

    >>> median_costs([Costs(f=[1, 2], b=3, w=1), Costs(f=[9, 2], b=3, w=2), Costs(f=[2, 2], b=4, w=3)])
    Costs(f=(2.0, 2.0), b=(3.0, 3.0), w=(2.0, 2.0), comm=0.0, message_overhead=0.0)
    """
    n = max(len(_tuple(getattr(c, kind))) for c in samples for kind in ("f", "b", "w"))
    # per kind, per stage: the samples' values
    f, b, w = ([statistics.median(stage) for stage in zip(*kind)] for kind in zip(*(c.per_stage(n) for c in samples)))
    return Costs(f=f, b=b, w=w, comm=samples[0].comm, message_overhead=samples[0].message_overhead)


def _costs_ms(c: Costs) -> dict[str, Any]:
    return {"f": [1e3 * x for x in _tuple(c.f)], "b": [1e3 * x for x in _tuple(c.b)], "w": [1e3 * x for x in _tuple(c.w)],
            "comm": 1e3 * c.comm, "message_overhead": 1e3 * c.message_overhead}


def _join(xs: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in xs)


def _same_orders(a: Schedule | None, b: Schedule) -> bool:
    return a is not None and a.placement == b.placement and a.orders == b.orders


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    rows, cases = bench.run_all()
    if bench.rank == 0 and args.out:
        run = {"device": torch.cuda.get_device_name() if bench.cuda else "CPU", "ranks": bench.p, "backend": bench.backend,
               "transport": bench.transport, "torch": torch.__version__, **code_identity(), "dtype": str(bench.dtype),
               "model": bench.spec.model, "num_layers": bench.spec.layers,
               "config": {k: v for k, v in vars(args).items() if k not in ("out", "append")}}
        doc: dict[str, Any] = {"meta": {"runs": [], "cases": []}, "rows": []}
        if args.append and os.path.exists(args.out):
            with open(args.out) as fh:
                doc = json.load(fh)
            if not isinstance(doc.get("meta", {}).get("runs"), list):
                raise ValueError(f"--append: {args.out} was not written by this version of bench_pipeline.py (no meta.runs)")
        index = len(doc["meta"]["runs"])
        doc["meta"].update({k: run[k] for k in ("device", "ranks", "torch", "commit", "zbpp_sha256")})
        doc["meta"]["runs"].append(run)
        doc["meta"]["cases"] += [dict(c, run=index) for c in cases]
        doc["rows"] += [dict(r, run=index) for r in rows]
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    shutdown_and_exit(main())  # barrier, destroy_process_group, then leave (see its docstring)
