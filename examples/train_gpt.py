"""Train a small GPT on the Python standard library's own source, with a zbpp pipeline schedule.

Every process runs this script under torchrun: NCCL on GPUs (one per process), gloo on CPUs. The
model is GPT-2 shaped: a token embedding whose weight is also the LM head (tied across the ranks
that hold the first and the last stage), position embeddings, pre-norm blocks of zbpp
`LayerNormLinear` (qkv) + `scaled_dot_product_attention` + `Linear` (projection) + `LayerNormMLP`,
a final LayerNorm and cross-entropy. The text is byte-level (character-level for the ASCII that
nearly all of it is) over the ``.py`` files at the top of ``sysconfig.get_paths()["stdlib"]``, in
sorted order: on every machine, no download. The last 10% is the validation split. Launch::

    # 2 GPUs, bf16 (float32 master weights), ZB-H1, 85M parameters, 32k tokens per step; the loss
    # curve, every step's figures and the last step's measured trace:
    torchrun --nproc-per-node=2 examples/train_gpt.py --schedule zb-h1 --steps 300 \\
        --loss-curve loss.png --json steps.json --trace trace.json

    # the same with the blocks' GEMMs in FP8 (delayed scaling; GPUs only):
    torchrun --nproc-per-node=2 examples/train_gpt.py --schedule zb-v --fp8

    # CPU ranks (gloo), a small model in float32, checked against one process on the first step:
    torchrun --nproc-per-node=2 examples/train_gpt.py --schedule zb-v --hidden 64 --heads 4 --layers 4 \\
        --seq-len 64 --rows-per-microbatch 4 --microbatches 4 --steps 60 --eval-every 20 --lr 3e-3 \\
        --warmup 10 --data-bytes 1000000 --check

The rank holding the last stage prints a line per step (loss, step time, tokens/s and, with
``--trace`` or ``--task-times``, the step's measured bubble rate), the validation loss from
`Pipeline.eval_step` every ``--eval-every`` steps (and before the first step), and a summary.
Every rank draws the same batch from a generator seeded by (seed, step); the ranks holding stage 0
use its input tokens, the one holding the last stage its targets.

``--json`` keeps every step's figures and the summary; ``python examples/train_gpt.py --replot
steps.json --loss-curve loss.png`` draws the curve from it later, elsewhere (no torchrun).

``--check`` compares the first step's loss and gradients (after the tied gradients are summed)
with one process running the whole model on the whole batch, and after the last step that every
copy of the tied embedding is still equal; the exit code is 1 on a mismatch, as it is when a step's
loss is not finite.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import math
import os
import statistics
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zbpp import Pipeline
from zbpp.modules import DelayedScaling, LayerNormLinear, LayerNormMLP, Linear, current_microbatch, fp8_autocast
from zbpp.runtime import init_distributed, measured_bubble_rate, shutdown_and_exit
from zbpp.schedules import available, build, options_of

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}

# --check: the largest gradient difference relative to the model's largest reference gradient, and
# the relative loss difference. The pipeline sums the microbatches' gradients where one process runs
# one GEMM over the whole batch, so only summation order differs: a few units of the dtype's
# rounding (float64 ~1e-16, float32 ~1e-7, after thousands of terms at most ~1e-13 and ~1e-5). A
# real fault (a microbatch lost or counted twice, half of the tied gradient missing, a wrong loss
# weight) moves a gradient by 1/m of its size or more. bf16 is refused: its rounding is as large as
# those faults (measured on CPU ranks with 8 microbatches: 5.7% of the largest gradient, most of it
# the reference's own embedding gradient, summed over the whole batch's tokens in bf16).
CHECK_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}


# -- data ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TextData:
    """The corpus as token ids (one byte each), split into training and validation text."""

    train: torch.Tensor  # int64 token ids
    val: torch.Tensor
    vocab: tuple[int, ...]  # the byte value of each token id
    files: int
    digest: str  # sha256 of the corpus bytes: every rank must read the same text

    def batch(self, split: str, rows: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows` windows of ``seq_len + 1`` tokens at offsets drawn by a generator seeded with `seed`:
        (inputs, next tokens), each [rows, seq_len]. The same seed gives the same batch on every rank."""
        text = self.train if split == "train" else self.val
        if len(text) <= seq_len + 1:
            raise ValueError(f"the {split} text has {len(text)} tokens, too few for --seq-len {seq_len}; raise --data-bytes")
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, len(text) - seq_len - 1, (rows, 1), generator=g)
        window = text[start + torch.arange(seq_len + 1)]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def stdlib_sources() -> list[Path]:
    """The ``.py`` files at the top of the Python standard library, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise RuntimeError(f"no .py files in the standard library directory {root}")
    return files


def load_text(max_bytes: int | None = None, val_fraction: float = 0.1) -> TextData:
    """The standard library's source (files in sorted order, at most `max_bytes` bytes) as token ids:
    the vocabulary is the byte values that occur, in increasing order; the last `val_fraction` of
    the text is the validation split."""
    buf = bytearray()
    files = 0
    for path in stdlib_sources():
        buf += path.read_bytes()
        files += 1
        if max_bytes is not None and len(buf) >= max_bytes:
            break
    data = bytes(buf[:max_bytes] if max_bytes is not None else buf)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    vocab = tuple(int(b) for b in torch.unique(raw))
    lookup = torch.zeros(256, dtype=torch.long)
    lookup[list(vocab)] = torch.arange(len(vocab))
    ids = lookup[raw]
    cut = int(len(ids) * (1 - val_fraction))
    return TextData(ids[:cut], ids[cut:], vocab, files, hashlib.sha256(data).hexdigest())


# -- model -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTConfig:
    vocab: int  # embedding rows (the corpus vocabulary, padded)
    hidden: int
    heads: int
    layers: int  # transformer blocks in the whole model, split over the stages
    seq_len: int


def blocks_of(stage: int, num_stages: int, layers: int) -> range:
    """The global indices of the blocks stage `stage` holds (an even split, larger stages last)."""
    return range(stage * layers // num_stages, (stage + 1) * layers // num_stages)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each residual, on zbpp's delayed-wgrad layers."""

    def __init__(self, cfg: GPTConfig, dtype: torch.dtype, delayed: bool) -> None:
        super().__init__()
        h, self.heads = cfg.hidden, cfg.heads
        std = 0.02
        out_std = std / math.sqrt(2 * cfg.layers)  # GPT-2: residual projections scaled by depth

        def init(w: torch.Tensor) -> None:
            nn.init.normal_(w, 0.0, std)

        def out_init(w: torch.Tensor) -> None:
            nn.init.normal_(w, 0.0, out_std)

        kw: dict[str, Any] = dict(delay_wgrad_compute=delayed, params_dtype=dtype)
        self.qkv = LayerNormLinear(h, 3 * h, init_method=init, **kw)
        self.proj = Linear(h, h, init_method=out_init, **kw)
        self.mlp = LayerNormMLP(h, 4 * h, init_method=init, output_layer_init_method=out_init, **kw)

    def forward(self, x: torch.Tensor, first: bool | None) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x, is_first_microbatch=first).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, h), is_first_microbatch=first)
        return x + self.mlp(x, is_first_microbatch=first)


class GPTStage(nn.Module):
    """Stage `stage` of `num_stages`: token + position embedding first, its blocks, then (last stage)
    the final norm and the LM head, whose weight is the token embedding `wte` (the same Parameter
    object when one rank holds both, as under V schedules).

    With `fp8` the blocks run inside ``fp8_autocast`` and keep their weights' FP8 casts from the
    step's microbatch 0 to its later microbatches (`is_first_microbatch`)."""

    def __init__(self, stage: int, num_stages: int, cfg: GPTConfig, *, wte: nn.Parameter | None, dtype: torch.dtype,
                 delayed: bool = True, fp8: bool = False, seed: int = 0) -> None:
        super().__init__()
        self.first, self.last = stage == 0, stage == num_stages - 1
        if (self.first or self.last) != (wte is not None):
            raise ValueError(f"stage {stage}: pass wte exactly to the first and the last stage")
        self.wte = wte
        if self.first:
            torch.manual_seed(seed * 1_000_003 + 1)
            self.wpe = nn.Parameter(torch.empty(cfg.seq_len, cfg.hidden, dtype=dtype).normal_(0.0, 0.01))
        blocks = []
        for i in blocks_of(stage, num_stages, cfg.layers):
            torch.manual_seed(seed * 1_000_003 + 2 + i)  # a block's values depend on its index, not on the split
            blocks.append(Block(cfg, dtype, delayed))
        self.blocks = nn.ModuleList(blocks)
        if self.last:
            self.norm = nn.LayerNorm(cfg.hidden, dtype=dtype)
        self.fp8 = fp8
        self.recipe = DelayedScaling() if fp8 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = F.embedding(x, self.wte) + self.wpe[: x.shape[1]]
        first = None
        if self.fp8:
            key = current_microbatch()  # (stage, j) under Pipeline; None in the one-process reference
            first = None if key is None else key[1] == 0
        with fp8_autocast(enabled=True, fp8_recipe=self.recipe) if self.fp8 else contextlib.nullcontext():
            for blk in self.blocks:
                x = blk(x, first)
        if self.last:
            x = F.linear(self.norm(x), self.wte)  # the LM head is the token embedding
        return x


def make_wte(cfg: GPTConfig, dtype: torch.dtype, seed: int) -> nn.Parameter:
    torch.manual_seed(seed * 1_000_003)
    return nn.Parameter(torch.empty(cfg.vocab, cfg.hidden, dtype=dtype).normal_(0.0, 0.02))


def build_stages(stages: list[int], num_stages: int, cfg: GPTConfig, *, dtype: torch.dtype, delayed: bool = True,
                 fp8: bool = False, seed: int = 0) -> dict[int, GPTStage]:
    """The stage modules `stages` of one rank (or of the whole model), on the CPU. One `wte` is made
    for all of them: the stages 0 and ``num_stages - 1`` among them share it. Parameter values depend
    only on (seed, cfg, dtype), never on the split into stages."""
    ends = {0, num_stages - 1}
    wte = make_wte(cfg, dtype, seed) if ends & set(stages) else None
    return {s: GPTStage(s, num_stages, cfg, wte=wte if s in ends else None, dtype=dtype, delayed=delayed, fp8=fp8,
                        seed=seed) for s in stages}


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (in float32 at least)."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# -- optimiser -------------------------------------------------------------------------------------
class AdamWMaster:
    """AdamW on float32 master copies of low-precision parameters (float32/64 ones are stepped in
    place): bf16 weights alone would lose every update smaller than 2^-8 of the weight (LayerNorm
    gains near 1 would never move). Matrices get `weight_decay`, vectors none."""

    def __init__(self, params: list[nn.Parameter], lr: float, weight_decay: float) -> None:
        self.params = params
        self.masters = [p if p.dtype in (torch.float32, torch.float64) else
                        nn.Parameter(p.detach().float().clone()) for p in params]
        decay = [m for m in self.masters if m.dim() >= 2]
        other = [m for m in self.masters if m.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW step at `lr` on the gradients times `grad_scale` (gradient clipping)."""
        for group in self.opt.param_groups:
            group["lr"] = lr
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float() * grad_scale
            elif p.grad is not None and grad_scale != 1.0:
                p.grad.mul_(grad_scale)
        self.opt.step()
        with torch.no_grad():  # an in-place copy: bumps the version, so kept FP8 weight casts go stale
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None


def warmup_cosine(step: int, peak: float, warmup: int, steps: int, floor: float) -> float:
    """The learning rate of step `step` (from 0) of `steps`: a linear warm-up whose last step (the
    `warmup`-th) is at `peak`, then a cosine decay that reaches `floor` x `peak` on the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    top = max(warmup - 1, 0)  # the step at the peak; the last step, steps - 1, at the floor
    frac = (step - top) / max(1, steps - 1 - top)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over ``--warmup`` steps, then cosine decay to ``--min-lr-ratio`` of ``--lr``."""
    return warmup_cosine(step, args.lr, args.warmup, args.steps, args.min_lr_ratio)


# -- command line ----------------------------------------------------------------------------------
def check_output_file(ap: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """Refuse an output file that cannot be written, while parsing: it is written after the last step."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        ap.error(f"{flag} {path}: that is a folder; give a file name")
    if not os.path.isdir(folder):
        ap.error(f"{flag} {path}: the folder {folder} does not exist")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", default="zb-h1", help=f"schedule name ({', '.join(available())})")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rows-per-microbatch", type=int, default=16, help="sequences per microbatch")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=12, help="transformer blocks in the whole model")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0, help="clip the gradient to this global norm (0: off)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="parameters and activations (default: bfloat16 on GPUs, float32 on CPUs and with --check); "
                         "bfloat16 keeps float32 master weights in the optimiser")
    ap.add_argument("--fp8", action="store_true", help="the blocks' GEMMs in FP8 (delayed scaling); needs GPUs")
    ap.add_argument("--data-bytes", type=int, default=None, help="use at most this many bytes of text (default: all)")
    ap.add_argument("--pad-vocab", type=int, default=64, help="round the vocabulary up to a multiple of this")
    ap.add_argument("--eval-every", type=int, default=50, help="validation loss every N steps (and before the first)")
    ap.add_argument("--eval-batches", type=int, default=4, help="validation batches, each as large as a step's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl with GPUs, else gloo")
    ap.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds")
    ap.add_argument("--task-times", action="store_true", help="measure every task (the bubble rate of each step)")
    ap.add_argument("--trace", default=None, metavar="PATH", help="write the last step's measured Perfetto trace (implies --task-times)")
    ap.add_argument("--loss-curve", default=None, metavar="PATH", help="write a PNG of the training and validation loss")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every step's figures as JSON")
    ap.add_argument("--check", action="store_true",
                    help="compare the first step's loss and gradients with one process running the whole model")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="train nothing: draw --loss-curve from the --json file of an earlier run")
    args = ap.parse_args(argv)
    if args.loss_curve is not None and importlib.util.find_spec("matplotlib") is None:
        ap.error("--loss-curve needs matplotlib (pip install matplotlib); or write --json now and draw the curve "
                 "elsewhere with --replot JSON --loss-curve PNG")
    if args.replot is not None:
        if args.loss_curve is None:
            ap.error("--replot JSON draws the loss curve: give --loss-curve PNG too")
        training = [f"--{name.replace('_', '-')}" for name in _given(ap, argv, args)
                    if name not in ("replot", "loss_curve")]
        if training:  # each would be silently ignored: --replot trains nothing
            ap.error(f"--replot JSON only draws --loss-curve from an earlier run and trains nothing: "
                     f"{', '.join(training)} apply to training; drop them")
        if not os.path.isfile(args.replot):
            ap.error(f"--replot {args.replot}: no such file (the --json of an earlier run)")
        check_output_file(ap, "--loss-curve", args.loss_curve)
        return args
    for name in ("microbatches", "rows_per_microbatch", "seq_len", "hidden", "heads", "layers", "steps",
                 "eval_every", "eval_batches", "pad_vocab"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.data_bytes is not None and args.data_bytes < 1:
        ap.error(f"--data-bytes must be >= 1, got {args.data_bytes}")
    if args.clip < 0:
        ap.error(f"--clip must be >= 0 (0 turns clipping off), got {args.clip}")
    if args.warmup < 0:  # lr_at would start the cosine decay part-way through
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    if not 0 <= args.min_lr_ratio <= 1:  # below 0 the last steps' learning rate is negative: training backwards
        ap.error(f"--min-lr-ratio must be in [0, 1] (the decay's floor, a fraction of --lr), got {args.min_lr_ratio}")
    if args.hidden % args.heads:
        ap.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.schedule not in available():
        ap.error(f"unknown --schedule {args.schedule!r}; available: {', '.join(available())}")
    if args.fp8 and args.check:
        ap.error("--check compares with one process running the whole batch, which FP8's delayed scaling (amax "
                 "over other microbatches) does not reproduce; check in bfloat16 or float32 without --fp8")
    backend = args.backend or _default_backend()
    if args.fp8 and backend != "nccl":
        ap.error("--fp8 needs CUDA GPUs (one per process, NCCL); this run would be on CPU ranks (gloo)")
    if args.fp8 and args.dtype not in (None, "bfloat16"):
        ap.error(f"--fp8 runs with bfloat16 parameters, not --dtype {args.dtype}")
    if args.check and args.dtype == "bfloat16":
        ap.error("--check needs --dtype float32 or float64: bf16 rounding is as large as the faults it looks for")
    args.backend = backend
    if args.dtype is None:
        args.dtype = "bfloat16" if backend == "nccl" and not args.check else "float32"
    for flag in ("--trace", "--json", "--loss-curve"):
        check_output_file(ap, flag, getattr(args, flag[2:].replace("-", "_")))
    args.task_times = args.task_times or args.trace is not None
    return args


def _given(ap: argparse.ArgumentParser, argv: list[str] | None, args: argparse.Namespace) -> list[str]:
    """The options the command line gave (typed, whatever their value): parsed again into a
    namespace holding a marker for each, which argparse then leaves where no option replaced it."""
    unset = object()
    probe = argparse.Namespace(**{name: unset for name in vars(args)})
    ap.parse_args(argv, namespace=probe)
    return [name for name, value in vars(probe).items() if value is not unset]


def _default_backend() -> str:
    from zbpp.runtime.launch import default_backend

    return default_backend()


# -- training --------------------------------------------------------------------------------------
class Run:
    """One rank's training run: the pipeline, the optimiser, the data, and what it reports."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        backend = init_distributed(args.backend, timeout=args.timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.dtype = DTYPES[args.dtype]
        opts = {"chunks": 2} if "chunks" in options_of(args.schedule) else {}
        self.sched = build(args.schedule, num_ranks=self.world, num_microbatches=args.microbatches, **opts)
        S = self.num_stages = self.sched.num_stages
        if args.layers < S:
            raise SystemExit(f"--layers {args.layers} is fewer than the {S} stages of {args.schedule} on {self.world} "
                             "ranks: every stage needs a block")
        self.data = load_text(args.data_bytes)
        self._same_text_everywhere()
        vocab = -(-len(self.data.vocab) // args.pad_vocab) * args.pad_vocab
        self.cfg = GPTConfig(vocab=vocab, hidden=args.hidden, heads=args.heads, layers=args.layers, seq_len=args.seq_len)
        self.reporter = self.sched.rank_of(S - 1)  # prints; holds the losses
        self.mine = {s: m.to(self.device) for s, m in build_stages(
            self.sched.stages_on(self.rank), S, self.cfg, dtype=self.dtype, fp8=args.fp8, seed=args.seed).items()}
        ends = [self.mine[s] for s in (0, S - 1) if s in self.mine]
        self.wte = ends[0].wte if ends else None
        tied = {"wte": self.wte} if self.wte is not None else {}
        self.pipe = Pipeline(self.mine, self.sched, lm_loss, tied_parameters=tied, record_task_times=args.task_times)
        self.opt = AdamWMaster(list(self.pipe.parameters()), args.lr, args.weight_decay)
        self.rows = args.rows_per_microbatch * args.microbatches
        self.history: list[dict[str, Any]] = []
        self.val_history: list[tuple[int, float]] = []
        self.records: list[dict[str, Any]] | None = None
        self.check: dict[str, Any] = {}
        self.figures: dict[str, Any] = {}

    @property
    def reporting(self) -> bool:
        return self.rank == self.reporter

    def say(self, text: str) -> None:
        if self.reporting:
            print(text, flush=True)

    def _same_text_everywhere(self) -> None:
        h = int(self.data.digest[:15], 16)
        t = torch.tensor([h, -h], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t[0]) != h or -int(t[1]) != h:
            raise SystemExit("the ranks read different text (different Python standard libraries?): run every rank "
                             "with the same Python, or on one machine")

    def _all_max(self, values: list[float]) -> list[float]:
        """Each value's maximum over the ranks, NaN where any rank's is NaN: gloo's MAX drops a NaN
        met as its second operand (from a rank other than 0, for a small tensor), which would pass --check."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        both = torch.cat([t, t.isnan().to(t.dtype)])  # a flag's MAX: any rank's NaN
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        return torch.where(both[len(t):] > 0, math.nan, both[:len(t)]).tolist()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # -- the parts of a run -------------------------------------------------------------------------
    def header(self) -> None:
        count = sum(p.numel() for p in self.pipe.parameters() if p is not self.wte or 0 in self.mine)
        t = torch.tensor([count], dtype=torch.int64, device=self.device)
        dist.all_reduce(t)  # the tied embedding counted once, on the rank holding stage 0
        a, d = self.args, self.data
        self.say(f"train_gpt: {self.sched.name} on {self.world} ranks ({'NCCL' if self.device.type == 'cuda' else 'gloo'}), "
                 f"{self.num_stages} stages, {a.layers} blocks, hidden {a.hidden}, {a.heads} heads, {int(t[0]) / 1e6:.2f}M "
                 f"parameters, {self.dtype}{' + FP8' if a.fp8 else ''}")
        self.say(f"data: {len(d.train) + len(d.val):,} bytes of the Python standard library ({d.files} files, "
                 f"{len(d.vocab)} distinct bytes, vocabulary padded to {self.cfg.vocab}); {len(d.val):,} for validation; "
                 f"{a.microbatches} microbatches x {a.rows_per_microbatch} x {a.seq_len} = "
                 f"{self.rows * a.seq_len:,} tokens per step")

    def evaluate(self, step: int) -> float | None:
        """The mean validation loss over ``--eval-batches`` fixed batches (on the reporting rank)."""
        total = 0.0
        for i in range(self.args.eval_batches):
            x, y = self.data.batch("val", self.rows, self.args.seq_len, seed=_val_seed(self.args.seed, i))
            loss = self.pipe.eval_step(x, target=y)
            if loss is not None:
                total += float(loss)
        if not self.reporting:
            return None
        val = total / self.args.eval_batches
        self.val_history.append((step, val))
        self.say(f"step {step:>5}/{self.args.steps} | val loss {val:.4f} ({self.args.eval_batches} batches)")
        return val

    def train_step(self, step: int) -> None:
        a = self.args
        x, y = self.data.batch("train", self.rows, a.seq_len, seed=_train_seed(a.seed, step))
        lr = lr_at(step, a)
        t0 = time.perf_counter()
        loss = self.pipe.step(x, target=y)
        self._sync()
        seconds = time.perf_counter() - t0
        if step == 0 and a.check:
            self.check_first_step(x, y, loss)
        t1 = time.perf_counter()
        norm = self.grad_norm() if a.clip > 0 else None
        self.opt.step(lr, grad_scale=min(1.0, a.clip / (norm + 1e-6)) if norm is not None else 1.0)
        self.opt.zero_grad()
        self._sync()
        seconds += time.perf_counter() - t1
        bubble = None
        if a.task_times:
            self.records = self.pipe.task_times()  # gathered on pipeline rank 0
            box = [None if self.records is None else measured_bubble_rate(self.records)]
            if self.reporter != 0:
                dist.broadcast_object_list(box, src=0)
            bubble = box[0]
        if self.reporting:
            assert loss is not None
            rec = {"step": step + 1, "loss": float(loss), "lr": lr, "grad_norm": norm, "ms": seconds * 1e3,
                   "tokens_per_s": self.rows * a.seq_len / seconds, "bubble": bubble}
            self.history.append(rec)
            gn = f" | grad norm {norm:6.3f}" if norm is not None else ""
            bub = f" | bubble {bubble:.3f}" if bubble is not None else ""
            self.say(f"step {step + 1:>5}/{a.steps} | loss {rec['loss']:.4f} | lr {lr:.2e}{gn} | {rec['ms']:8.1f} ms | "
                     f"{rec['tokens_per_s'] / 1e3:8.1f}k tok/s{bub}")

    def grad_norm(self) -> float:
        """The 2-norm of the whole model's gradient: every rank's sum of squares, the tied embedding
        counted once (on the rank holding stage 0), summed over the ranks; the same on every rank."""
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.pipe.parameters():
            if p.grad is not None and (p is not self.wte or 0 in self.mine):
                local += p.grad.double().square().sum()
        dist.all_reduce(local)
        return math.sqrt(float(local))

    def check_first_step(self, x: torch.Tensor, y: torch.Tensor, loss: torch.Tensor | None) -> None:
        """Compare this rank's gradients (and the loss) with one process running the whole model."""
        ref = {s: m.to(self.device) for s, m in build_stages(list(range(self.num_stages)), self.num_stages, self.cfg,
                                                             dtype=self.dtype, delayed=False, seed=self.args.seed).items()}
        out = x.to(self.device)
        for s in range(self.num_stages):
            out = ref[s](out)
        ref_loss = lm_loss(out, y.to(self.device))
        ref_value = float(ref_loss.detach())
        ref_loss.backward()
        scale = max(float(q.grad.abs().max()) for m in ref.values() for q in m.parameters()) or 1.0
        errs = [0.0]
        for s, st in self.mine.items():
            for (name, p), (_, q) in zip(st.named_parameters(), ref[s].named_parameters()):
                if p.grad is None:
                    raise AssertionError(f"--check: stage {s} parameter {name} has no gradient after the step")
                errs.append(float((p.grad.double() - q.grad.double()).abs().max()) / scale)
        grad_err = float(torch.tensor(errs, dtype=torch.float64).max())  # not Python's max: max(0.0, nan) is 0.0
        loss_err = abs(float(loss) - ref_value) / abs(ref_value) if loss is not None else 0.0
        grad_err, loss_err = self._all_max([grad_err, loss_err])
        tol = CHECK_TOLERANCE[self.dtype]
        ok = grad_err <= tol and loss_err <= tol
        self.check.update(first_loss_rel=loss_err, grad_rel=grad_err, ref_loss=ref_value, ok=ok)
        self.say(f"check, first step against one process: loss {ref_value:.6f}, relative loss difference "
                 f"{loss_err:.1e}, largest gradient difference {grad_err:.1e} of the model's largest gradient "
                 f"(tolerance {tol:g} for {self.dtype}): {'OK' if ok else 'MISMATCH'}")

    def check_tied_copies(self) -> None:
        """Every copy of the tied embedding holds the same values (max - min over the ranks)."""
        have = self.wte is not None
        shape = (self.cfg.vocab, self.cfg.hidden)
        w = self.wte.detach().double() if have else torch.full(shape, -math.inf, dtype=torch.float64, device=self.device)
        hi = w.clone()
        lo = w.clone() if have else torch.full(shape, math.inf, dtype=torch.float64, device=self.device)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        # gloo's MAX and MIN may drop a NaN (see _all_max): each rank says whether its copy has one
        (nan,) = self._all_max([math.nan if have and bool(w.isnan().any()) else 0.0])
        spread = float((hi - lo).max()) + nan
        ok = spread == 0.0
        self.check.update(tied_spread=spread, ok=self.check.get("ok", True) and ok)
        self.say(f"check, tied embedding after {self.args.steps} steps: largest difference between its copies "
                 f"{spread:.1e}: {'OK' if ok else 'MISMATCH'}")

    def summary(self, wall: float) -> None:
        if not self.reporting:
            return
        h = self.history
        timed = h[min(10, len(h) - 1):]  # leave out the first steps (shape exchange, allocator, kernels)
        ms = statistics.median(r["ms"] for r in timed)
        tail = [r["loss"] for r in h[-10:]]
        bubbles = [r["bubble"] for r in timed if r["bubble"] is not None]
        bub = f"; measured bubble median {statistics.median(bubbles):.3f}" if bubbles else ""
        val = f"; val loss {self.val_history[0][1]:.3f} -> {self.val_history[-1][1]:.3f}" if self.val_history else ""
        self.say(f"done: {len(h)} steps in {wall:.1f} s; step time median {ms:.1f} ms (steps {timed[0]['step']}-"
                 f"{h[-1]['step']}), {self.rows * self.args.seq_len / ms:.1f}k tokens/s; train loss {h[0]['loss']:.3f} -> "
                 f"{sum(tail) / len(tail):.3f} (mean of the last {len(tail)}){val}{bub}")
        self.figures = {"steps": len(h), "wall_s": wall, "step_ms_median": ms, "timed_steps": [timed[0]["step"], h[-1]["step"]],
                        "tokens_per_step": self.rows * self.args.seq_len, "tokens_per_s": self.rows * self.args.seq_len / ms * 1e3,
                        "bubble_median": statistics.median(bubbles) if bubbles else None}

    def write_outputs(self) -> None:
        a = self.args
        if a.trace is not None and self.records is not None:
            from zbpp.viz import write_trace

            write_trace(a.trace, measured=self.records, schedule=self.sched)
            print(f"measured trace of the last step: {a.trace} (open in ui.perfetto.dev)", flush=True)
        if not self.reporting:
            return
        title = (f"GPT ({a.layers} blocks, hidden {a.hidden}) on the Python stdlib, {self.sched.name} on {self.world} "
                 f"ranks, {a.dtype}{' + FP8' if a.fp8 else ''}")
        if a.json is not None:
            with open(a.json, "w") as fh:
                json.dump({"args": vars(a), "schedule": self.sched.name, "title": title, "summary": self.figures,
                           "steps": self.history, "val": self.val_history, "check": self.check}, fh, indent=1)
            self.say(f"figures of every step: {a.json}")
        if a.loss_curve is not None:
            plot_loss(a.loss_curve, self.history, self.val_history, title=title)
            self.say(f"loss curve: {a.loss_curve}")

    def result(self) -> dict[str, Any]:
        """What this rank did (for the tests)."""
        return {"rank": self.rank, "stages": sorted(self.mine), "history": self.history, "val": self.val_history,
                "check": self.check, "wte": None if self.wte is None else self.wte.detach().cpu().clone(),
                "wte_shared": len([m for m in self.mine.values() if m.wte is not None]) == 2
                and all(m.wte is self.wte for m in self.mine.values() if m.wte is not None)}


def _train_seed(seed: int, step: int) -> int:
    return seed * 1_000_003 + step


def _val_seed(seed: int, i: int) -> int:
    return seed * 1_000_003 + 500_000 + i  # apart from the training batches' seeds


def plot_loss(path: str, history: list[dict[str, Any]], val: list[tuple[int, float]], title: str) -> None:
    """Training loss per step and validation loss, as a PNG (matplotlib imported only here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], lw=1, label="train (per step)")
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", lw=1.5, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats per byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def train(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, train, report; return this rank's `Run.result` (``check["ok"]`` False on a
    ``--check`` mismatch) and ``"finite"``: whether every step's loss was. torch.distributed is
    initialised here unless it already is."""
    args = parse_args(argv)
    run = Run(args)
    t0 = time.perf_counter()
    run.header()
    run.evaluate(0)
    for step in range(args.steps):
        run.train_step(step)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            run.evaluate(step + 1)
    if args.check:
        run.check_tied_copies()
    run.summary(time.perf_counter() - t0)
    run.write_outputs()
    # the reporting rank holds the losses: every rank learns whether one was NaN or infinite
    (bad,) = run._all_max([float(not all(math.isfinite(r["loss"]) for r in run.history))])
    if bad:
        run.say("train_gpt: a step's loss is not finite (exit code 1)")
    return {**run.result(), "finite": not bad}


def replot(json_path: str, png_path: str) -> None:
    """Draw the loss curve of an earlier run from its ``--json`` file."""
    with open(json_path) as fh:
        run = json.load(fh)
    plot_loss(png_path, run["steps"], [tuple(v) for v in run["val"]], title=run["title"])
    print(f"loss curve: {png_path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        replot(args.replot, args.loss_curve)
        return 0
    res = train(argv)
    return 0 if res["check"].get("ok", True) and res["finite"] else 1


if __name__ == "__main__":
    shutdown_and_exit(main())  # barrier, destroy_process_group, then leave (see its docstring)
