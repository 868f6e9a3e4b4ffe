"""Train a Hugging Face causal LM from its config (random weights, no download) with a zbpp schedule.

Every process runs this script under torchrun: NCCL on GPUs (one per process), gloo on CPUs. The
model is a ``LlamaForCausalLM`` (or ``--model <model_type>``, any of `zbpp.models.hf.SUPPORTED`: a
small config of that family, `zbpp.models.hf.small_config`) built on the ``meta`` device; each rank materialises only its own stages (`zbpp.models.hf.causal_lm_stages`), which
handle HF's masks, rotary embeddings and loss. The data is the Python standard library's source
as bytes (``--data stdlib``, the loader of ``train_gpt.py``) or counting sequences (``--data
synthetic``: each row ``a, a+b, a+2b, ...`` modulo the vocabulary); ``--ragged`` cuts every row to a
random length and right-pads it, with an ``attention_mask`` and labels -100 on the padding, as HF
batches are. Launch::

    # 2 CPU ranks (gloo), a small Llama, ZB-V:
    torchrun --nproc-per-node=2 examples/train_hf.py --schedule zb-v --steps 40

    # GPT-2 (tied embedding and LM head across ranks) with right-padded rows:
    torchrun --nproc-per-node=2 examples/train_hf.py --model gpt2 --ragged --steps 40

    # 2 GPUs (NCCL, bf16), a larger Llama in its fast form (compiled layers, task graphs):
    torchrun --nproc-per-node=2 examples/train_hf.py --hidden 512 --layers 8 --heads 8 --seq-len 256 \\
        --rows-per-microbatch 8 --microbatches 8 --steps 200 --fast

Data parallelism (``--dp``: replicas of the pipeline, each on its share of the batch) and FSDP2
(``--fsdp``: each stage sharded over the replicas)::

    # 4 ranks: 2 replicas of a 2-rank ZB-V pipeline, each stage fully_shard-ed over the replicas:
    torchrun --nproc-per-node=4 examples/train_hf.py --schedule zb-v --dp 2 --fsdp --steps 40

Pretrained weights and fault tolerance::

    # fine-tune a local HF directory (config.json + safetensors; each rank reads its own tensors, in
    # their dtype unless --dtype) and write the result as one that from_pretrained loads:
    torchrun --nproc-per-node=2 examples/train_hf.py --from path/to/hf_dir --steps 100 --save-pretrained out_dir

    # checkpoint every 50 steps; restarted after a rank dies, the job resumes from the newest:
    torchrun --nproc-per-node=2 --max-restarts=3 examples/train_hf.py --checkpoint-dir ckpt --checkpoint-every 50

The rank holding the last stage (of the first replica) prints a line per step (the loss: the
mean over every replica's tokens, learning rate, step time, tokens/s of all replicas) and a summary. Every rank draws
the same batch of ``--dp`` x ``--microbatches`` x ``--rows-per-microbatch`` rows from a generator
seeded by (seed, step); each replica trains on its consecutive share of the rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zbpp import ParallelGroups, Pipeline
from zbpp.models.hf import SUPPORTED, small_config
from zbpp.runtime import clip_grad_norm_, init_distributed, shutdown_and_exit
from zbpp.schedules import available, build, options_of

MODELS = SUPPORTED
SHAPE = {"model": "llama", "hidden": 64, "layers": 4, "heads": 4}  # the model built when not --from
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
LR_FLOOR = 0.1  # the cosine decay's end, a fraction of --lr
STDLIB_BYTES = 2_000_000  # --data stdlib reads this much text unless --data-bytes says otherwise


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=MODELS, default=None, help="default: llama (not with --from)")
    ap.add_argument("--schedule", default="zb-h1", help=f"schedule name ({', '.join(available())})")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--rows-per-microbatch", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=None, help=f"default: {SHAPE['hidden']}")
    ap.add_argument("--layers", type=int, default=None, help=f"decoder layers in the whole model (default: {SHAPE['layers']})")
    ap.add_argument("--heads", type=int, default=None, help=f"default: {SHAPE['heads']}")
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="key/value heads (families with grouped-query attention; default --heads)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    ap.add_argument("--warmup", type=int, default=5,
                    help="linear warm-up steps, then cosine decay to 10%% of --lr on the last step")
    ap.add_argument("--clip", type=float, default=1.0, help="clip the gradient to this global norm (0: off)")
    ap.add_argument("--data", choices=["stdlib", "synthetic"], default="stdlib")
    ap.add_argument("--data-bytes", type=int, default=None,
                    help=f"--data stdlib: bytes of text to read (default: {STDLIB_BYTES:,})")
    ap.add_argument("--ragged", action="store_true", help="rows of random lengths, right-padded (attention_mask, -100)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="default: with --from, its weights' dtype (config.json's, else the safetensors'); "
                         "else bfloat16 on GPUs, float32 on CPUs")
    ap.add_argument("--fast", action="store_true",
                    help="the stages' fast form: compiled layers, task graphs on GPUs where measured faster "
                         "(zbpp.models.fast)")
    ap.add_argument("--fp8", action="store_true", help="with --fast: FP8 GEMMs (Hopper or later)")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default=None,
                    help="HF attention implementation (default: HF's choice for the model, sdpa where it has it)")
    ap.add_argument("--experts", choices=["eager", "grouped_mm"], default=None,
                    help="a mixture of experts' expert layers (default: eager with --dtype float64, which HF's "
                         "grouped matmul does not take; else HF's choice); refused for a model without experts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (the ranks are dp x pipeline ranks)")
    ap.add_argument("--fsdp", action="store_true", help="with --dp: shard each stage over the replicas (FSDP2)")
    ap.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl with GPUs, else gloo")
    ap.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds")
    ap.add_argument("--from", dest="pretrained", default=None, metavar="DIR",
                    help="start from the pretrained weights of this local HF directory (config.json + safetensors)")
    ap.add_argument("--save-pretrained", default=None, metavar="DIR",
                    help="after training, write the model as a HF directory (from_pretrained loads it)")
    ap.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                    help="save checkpoints here; a run finding one here resumes from the latest")
    ap.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                    help="with --checkpoint-dir: save every N steps (and after the last)")
    args = ap.parse_args(argv)
    _check_args(ap, args)
    given = [f"--{n.replace('_', '-')}" for n in (*SHAPE, "kv_heads") if getattr(args, n) is not None]
    if args.pretrained is not None:  # the model is the directory's: a shape flag would be ignored
        if given:
            ap.error(f"--from {args.pretrained} takes the model from its config.json: drop {' '.join(given)}")
        if not (Path(args.pretrained) / "config.json").is_file():  # else HF takes it for a Hub repo id (network, retries)
            ap.error(f"--from {args.pretrained}: not a local Hugging Face model directory (it has no config.json)")
        return args
    for name, default in SHAPE.items():
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    _check_shape(ap, args)
    return args


def _check_shape(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The model-shape flags of a model built from a config (not --from)."""
    for name in ("hidden", "layers", "heads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.hidden % args.heads:
        ap.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.kv_heads is not None and (args.kv_heads < 1 or args.heads % args.kv_heads):
        ap.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if args.kv_heads is not None and args.model == "gpt2":
        ap.error("--kv-heads: gpt2 has no grouped-query attention")


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("microbatches", "rows_per_microbatch", "seq_len", "steps", "dp"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.clip >= 0:  # `clip if clip > 0 else inf` would quietly turn clipping off (nan too)
        ap.error(f"--clip must be >= 0 (0 turns clipping off), got {args.clip}")
    if not args.lr >= 0 or math.isinf(args.lr):  # else AdamW refuses it on every rank, after the model is built
        ap.error(f"--lr must be a finite number >= 0, got {args.lr}")
    if not 0 < args.timeout < math.inf:  # else the rendezvous fails at once (0, negative) or overflows (inf)
        ap.error(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    if args.warmup < 0:  # lr_at would start the cosine decay part-way through
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.seq_len < 4:
        ap.error(f"--seq-len must be >= 4, got {args.seq_len}")
    if args.data_bytes is not None and args.data != "stdlib":  # the counting rows read no text: it would be ignored
        ap.error(f"--data-bytes bounds the text of --data stdlib; --data {args.data} reads none: drop --data-bytes")
    if args.data_bytes is not None and args.data_bytes < 1:  # load_text would cut bytes off the end (a negative slice)
        ap.error(f"--data-bytes must be >= 1, got {args.data_bytes}")
    if args.data == "stdlib" and args.data_bytes is None:
        args.data_bytes = STDLIB_BYTES
    if args.experts == "grouped_mm" and args.dtype == "float64":  # else the first step fails deep in HF's experts
        ap.error("--experts grouped_mm takes 16- and 32-bit floats, not --dtype float64: use --experts eager")
    if args.fp8 and not args.fast:
        ap.error("--fp8 applies to the fast form: add --fast")
    if args.fsdp and args.dp < 2:
        ap.error("--fsdp shards each stage over the data-parallel replicas: add --dp 2 or more")
    if args.checkpoint_every < 0 or (args.checkpoint_every and not args.checkpoint_dir):
        ap.error("--checkpoint-every N needs N >= 0 and --checkpoint-dir")
    if args.schedule not in available():
        ap.error(f"unknown --schedule {args.schedule!r}; available: {', '.join(available())}")
    for flag, folder in (("--save-pretrained", args.save_pretrained), ("--checkpoint-dir", args.checkpoint_dir)):
        if folder is not None and Path(folder).exists() and not Path(folder).is_dir():  # found at the end, or first save
            ap.error(f"{flag} {folder}: that is a file; give a folder (created if it does not exist)")
    done, found = latest_checkpoint(args.checkpoint_dir)
    if done > args.steps:  # else it would train nothing, and --save-pretrained write the longer run's model
        ap.error(f"--checkpoint-dir {args.checkpoint_dir} holds {found.name}, past --steps {args.steps} (the run's "
                 f"total, counted from step 0): give --steps {done} or more, or another --checkpoint-dir")


# -- data ------------------------------------------------------------------------------------------
def _train_gpt() -> Any:
    """examples/train_gpt.py as a module: its standard-library text loader."""
    name = "zbpp_example_train_gpt"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("train_gpt.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class Batches:
    """The step's batch, the same on every rank: ``(input_ids, attention_mask, labels)``; the mask
    is None for full rows (then attention is causal without a built mask: `zbpp.models.hf`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows = args.rows_per_microbatch * args.microbatches * args.dp  # every replica's rows
        if args.data == "stdlib":
            self.text = _train_gpt().load_text(args.data_bytes)
            self.vocab = -(-len(self.text.vocab) // 64) * 64
        else:
            self.text, self.vocab = None, 64

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        a = self.args
        seed = a.seed * 1_000_003 + step
        if self.text is not None:
            ids, _ = self.text.batch("train", self.rows, a.seq_len, seed=seed)
        else:
            g = torch.Generator().manual_seed(seed)
            start = torch.randint(0, self.vocab, (self.rows, 1), generator=g)
            stride = torch.randint(1, 4, (self.rows, 1), generator=g)
            ids = (start + stride * torch.arange(a.seq_len)) % self.vocab
        if not a.ragged:
            return ids, None, ids
        g = torch.Generator().manual_seed(seed + 7)
        lengths = torch.randint(a.seq_len // 2, a.seq_len + 1, (self.rows, 1), generator=g)
        mask = (torch.arange(a.seq_len) < lengths).long()
        ids = ids.masked_fill(mask == 0, 0)
        return ids, mask, ids.masked_fill(mask == 0, -100)


# -- model -----------------------------------------------------------------------------------------
def make_config(args: argparse.Namespace, vocab: int) -> Any:
    import transformers

    if args.model == "gpt2":
        return transformers.GPT2Config(vocab_size=vocab, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                                       n_positions=args.seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=0, eos_token_id=0)
    if args.model not in ("llama", "mistral", "qwen2"):
        config = small_config(args.model, vocab_size=vocab, hidden_size=args.hidden, num_layers=args.layers,
                              num_heads=args.heads, num_kv_heads=args.kv_heads, max_positions=args.seq_len)
        if args.kv_heads is not None and getattr(config, "num_key_value_heads", None) != args.kv_heads:
            raise SystemExit(f"--kv-heads: {args.model} has no grouped-query attention")
        return config
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[args.model]
    return cls(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
               num_hidden_layers=args.layers, num_attention_heads=args.heads,
               num_key_value_heads=args.kv_heads or args.heads, max_position_embeddings=args.seq_len,
               tie_word_embeddings=False)


def model_source(args: argparse.Namespace, vocab: int) -> tuple[Any, Any]:
    """What `causal_lm_stages` builds from: the pretrained directory of --from (its vocabulary must
    cover the data's), else a config; and the causal LM's config (a multimodal directory's text config,
    which holds its sizes: Qwen3.5's, Llama 4's)."""
    if args.pretrained is None:
        config = make_config(args, vocab)
        _check_experts(args, config)
        return config, config
    import transformers

    full = transformers.AutoConfig.from_pretrained(args.pretrained)
    _check_experts(args, full)
    config = full.get_text_config()  # itself for a text-only model
    if getattr(config, "vocab_size", 0) < vocab:
        raise SystemExit(f"--from {args.pretrained}: its vocabulary ({getattr(config, 'vocab_size', None)}) is smaller "
                         f"than the data's ({vocab})")
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and args.seq_len > positions:  # else learned positions fail in the first F, by index
        raise SystemExit(f"--seq-len {args.seq_len} is longer than the {positions} positions of --from {args.pretrained} "
                         "(its max_position_embeddings)")
    return args.pretrained, config


def train_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    """--dtype; without it, a --from directory's own (as ``causal_lm_stages(dir)`` reads it: fine-tuning
    a bfloat16 checkpoint in float32 would double its memory), else bfloat16 on GPUs, float32 on CPUs."""
    if args.dtype is not None:
        return DTYPES[args.dtype]
    if args.pretrained is not None:
        from zbpp.models.hf_weights import checkpoint_dtype

        return checkpoint_dtype(args.pretrained)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _check_experts(args: argparse.Namespace, config: Any) -> None:
    """--experts picks a mixture of experts' expert layers: a model without them would ignore it (HF
    does), so it is refused, naming the flag and the model."""
    if args.experts is None:
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    # HF's own test of whether a model's experts implementation can be chosen (its MoE layers use it)
    if cls is not None and not cls._can_set_experts_implementation():
        what = f"--from {args.pretrained}" if args.pretrained else f"--model {args.model}"
        raise SystemExit(f"--experts {args.experts}: {what} ({cls.__name__}) has no mixture-of-experts layers; "
                         "drop --experts")


# -- checkpoints: <dir>/step-<n>, written whole or not at all ---------------------------------------
def latest_checkpoint(directory: str | None) -> tuple[int, Path | None]:
    """The step and path of the newest complete checkpoint in `directory` (0, None: none)."""
    if directory is None or not Path(directory).is_dir():
        return 0, None
    done = [(int(p.name[5:]), p) for p in Path(directory).glob("step-*") if p.name[5:].isdigit()]
    return max(done) if done else (0, None)


def agreed_checkpoint(directory: str | None, device: torch.device) -> tuple[int, Path | None]:
    """`latest_checkpoint`, the same on every rank: each rank looks in its own view of `directory`,
    and one that is not shared (a node-local disk) would resume the ranks from different steps."""
    done, found = latest_checkpoint(directory)
    seen = torch.tensor([done, -done], dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    newest, oldest = int(seen[0]), -int(seen[1])
    if newest != oldest:
        raise SystemExit(f"--checkpoint-dir {directory}: the ranks see different newest checkpoints (from step {oldest} "
                         f"to step {newest}; this rank step {done}): give a directory every rank shares")
    return done, found


def save_step(pipe: Any, opt: Any, directory: str, step: int) -> None:
    """Checkpoint after `step` steps: written under a temporary name, renamed once every rank is
    done, so a job killed while saving resumes from the previous one."""
    from zbpp.runtime import save_checkpoint

    final = Path(directory) / f"step-{step}"
    partial = Path(directory) / f".step-{step}.partial"
    save_checkpoint(pipe, partial, opt)
    dist.barrier()
    if dist.get_rank() == 0:
        partial.rename(final)
    dist.barrier()


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over ``--warmup`` steps to ``--lr``, then cosine decay to 10% of it on the last step."""
    return _train_gpt().warmup_cosine(step, args.lr, args.warmup, args.steps, LR_FLOOR)


def train(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, train, report; return this rank's figures. torch.distributed is initialised
    here unless it already is."""
    from zbpp.models.hf import causal_lm_stages

    args = parse_args(argv)
    backend = init_distributed(args.backend, timeout=args.timeout)
    world = dist.get_world_size()
    if world % args.dp:
        raise SystemExit(f"--dp {args.dp} does not divide the {world} ranks")
    groups = ParallelGroups(pp=world // args.dp)  # replicas of pp ranks each (groups.pp_rank, groups.dp_rank)
    pp, rank = groups.pp, groups.pp_rank
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    batches = Batches(args)
    source, config = model_source(args, batches.vocab)
    layers = config.num_hidden_layers
    sched = build(args.schedule, num_ranks=pp, num_microbatches=args.microbatches,
                  **({"chunks": 2} if "chunks" in options_of(args.schedule) else {}))
    if layers < sched.num_stages:
        what = f"--from {args.pretrained}: its {layers} layers are" if args.pretrained else f"--layers {layers} is"
        raise SystemExit(f"{what} fewer than the {sched.num_stages} stages of {args.schedule} on "
                         f"{pp} ranks: every stage needs a layer")

    # the pipeline: this rank's stages (only they get weights), HF's loss, the tied parameters
    dtype = train_dtype(args, device)
    if args.experts == "grouped_mm" and dtype == torch.float64:  # a --from float64 checkpoint; parse_args saw --dtype
        raise SystemExit(f"--experts grouped_mm takes 16- and 32-bit floats, not --from {args.pretrained}'s float64: "
                         "use --experts eager, or --dtype float32")
    experts = args.experts or ("eager" if dtype == torch.float64 else None)  # grouped_mm: no float64 kernel
    stages, kwargs = causal_lm_stages(source, sched, rank, device=device, dtype=dtype, attn_implementation=args.attn,
                                      experts_implementation=experts, seed=args.seed, fast=args.fast, fp8=args.fp8)
    tied = sorted(kwargs["tied_parameters"])
    # the fast form's task graphs are CUDA graphs: elsewhere it is compiled layers alone, and says so
    fast = "" if not args.fast else f", fast{' fp8' if args.fp8 else ''}" + \
        ("" if "cuda_graphs" in kwargs else f" (no task graphs on {device.type})")
    if args.fsdp:  # each stage one FSDP root over the replicas; the tied Parameters named in kwargs find their shards
        from torch.distributed.fsdp import fully_shard

        for stage in stages.values():
            fully_shard(stage, mesh=groups.mesh["dp"])
    pipe = Pipeline(stages, sched, groups=groups.mesh if args.fsdp else groups, **kwargs)
    tokens_of = kwargs["loss_weight"]  # the tokens a batch's loss averages over (not padding, -100)
    del kwargs  # it holds tied Parameters from before fully_shard, whole
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    first_step, found = agreed_checkpoint(args.checkpoint_dir, device)
    if found is not None:  # resume: weights, optimizer state and random stream; data and lr follow the step
        from zbpp.runtime import load_checkpoint

        load_checkpoint(pipe, found, opt)

    reporting = pipe.holds_last_stage and groups.dp_rank == 0
    say = (lambda text: print(text, flush=True)) if reporting else (lambda text: None)
    if found is not None:
        say(f"train_hf: resumed from {found} (step {first_step})")
    layout = f"{pp} ranks" if args.dp == 1 else f"{pp} ranks x {args.dp} replicas{' (FSDP)' if args.fsdp else ''}"
    model = f"{config.model_type} from {args.pretrained}" if args.pretrained else config.model_type
    say(f"train_hf: {model} ({layers} layers, hidden {config.hidden_size}), {args.schedule} on {layout} "
        f"({backend}), {sched.num_stages} stages; {args.microbatches} microbatches x {args.rows_per_microbatch} rows x "
        f"{args.seq_len} tokens{' per replica' if args.dp > 1 else ''}, data {args.data}{' ragged' if args.ragged else ''}, {dtype}"
        f"{fast}")
    history: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for step in range(first_step, args.steps):
        ids, mask, labels = batches(step)
        share = slice(groups.dp_rank * len(ids) // args.dp, (groups.dp_rank + 1) * len(ids) // args.dp)
        lr = lr_at(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        start = time.perf_counter()
        loss = pipe.step({"input_ids": ids[share]} if mask is None else {"input_ids": ids[share], "attention_mask": mask[share]},
                         target=labels[share])
        if loss is not None and args.dp > 1:
            # each replica's loss is the mean over its own tokens; the step's (whose gradient the
            # replicas share) weighs every token alike: with ragged rows, not the replicas' mean
            n = tokens_of(labels[share]).to(loss.device, torch.float64)
            both = torch.stack([loss.detach().to(torch.float64) * n, n])
            dist.all_reduce(both, group=groups.dp_group)
            loss = both[0] / both[1].clamp(min=1)
        norm = clip_grad_norm_(pipe, args.clip if args.clip > 0 else math.inf)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - start
        if reporting:
            tokens = ids.numel() if mask is None else int(mask.sum())
            history.append({"step": step + 1, "loss": float(loss), "grad_norm": float(norm), "lr": lr, "seconds": dt})
            say(f"step {step + 1:>5}/{args.steps} | loss {float(loss):.4f} | grad norm {float(norm):.3f} | "
                f"lr {lr:.2e} | {dt * 1e3:7.1f} ms | {tokens / dt:9.0f} tok/s")
        every = args.checkpoint_every
        if args.checkpoint_dir and ((every and (step + 1) % every == 0) or step + 1 == args.steps):
            save_step(pipe, opt, args.checkpoint_dir, step + 1)
    if args.save_pretrained:
        from zbpp.models.hf import save_pretrained

        save_pretrained(pipe, args.save_pretrained)  # every rank: each writes its own stages' tensors
        say(f"train_hf: wrote {args.save_pretrained}")
    if history:
        say(f"done: {args.steps - first_step} steps in {time.perf_counter() - t0:.1f} s, loss {history[0]['loss']:.4f} -> "
            f"{history[-1]['loss']:.4f}")
    # the reporting rank holds the losses: every rank learns whether one was NaN or infinite
    bad = torch.tensor([float(not all(math.isfinite(h["loss"]) for h in history))], device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        say("train_hf: a step's loss is not finite (exit code 1)")
    return {"rank": dist.get_rank(), "stages": sorted(stages), "history": history, "tied": tied,
            "finite": not bad.item()}


def main(argv: list[str] | None = None) -> int:
    """Train; the exit code is 1 on every rank when a step's loss is not finite."""
    return 0 if train(argv)["finite"] else 1


if __name__ == "__main__":
    shutdown_and_exit(main())  # barrier, destroy_process_group, then leave (see its docstring)
