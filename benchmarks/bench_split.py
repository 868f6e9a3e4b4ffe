"""Splitting a stage's backward into B and W: what it costs against a plain fused backward.

One pipeline stage of Hugging Face ``LlamaDecoderLayer`` s (built from a ``LlamaConfig``, random
weights, bf16, sdpa attention, causal), one microbatch of ``--tokens`` tokens whose input requires
grad (as in a middle stage), a fixed random output gradient. Rows, in one run:

- ``plain``      forward, then ``y.backward(g)`` (the weights' gradients inside the backward; W empty)
- ``zbpp split`` zbpp's generic split of the stage's autograd graph (``zbpp.runtime``'s
                 ``backward_input``: B the input gradient only, W the weights'); left out with a
                 message when this checkout's runtime has none
- ``delay_wgrad`` a copy of the stage after ``zbpp.modules.delay_wgrad``: F under ``microbatch``,
                 B ``y.backward(g)``, W ``backward_dw`` of every converted layer
- ``torch split`` ``torch.distributed.pipelining``'s ``stage_backward_input`` then
                 ``stage_backward_weight``

Columns: F, B, W, B+W and F+B+W in ms (CUDA events around each phase of one iteration, the median
of ``--iters`` iterations after ``--warmup``; ``time.perf_counter`` on a CPU), the peak memory of one
iteration (``max_memory_allocated``, reset before it) and that peak above what was allocated when
the iteration began, and each row's B+W, F+B+W and peak-above-start over the plain row's. The
gradients of the stage input and of every parameter are compared with the plain row's
(``max_rel_err``: the largest |a - b| / max|b| over those tensors). ``B host``/``W host``: the
host's ``perf_counter`` time of B and W (on a GPU: how long issuing them took; a phase whose host
time reaches its CUDA time is launch-bound).

Cases (``--case``): ``A`` hidden 2048, ffn 5632, 8 layers; ``B`` hidden 4096, ffn 11008, 4 layers;
4096 tokens (2 x 2048) each. On the GPU machine (one H200)::

    PYTHONPATH=$PWD python3 benchmarks/bench_split.py --out $OUT/bench_split.json

CPU smoke run (tiny float64 stage, seconds; correctness only)::

    python benchmarks/bench_split.py --smoke --out /tmp/bench_split.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from zbpp.modules import Linear, delay_wgrad, microbatch  # noqa: E402

from provenance import code_identity, write_report  # noqa: E402 - benchmarks/provenance.py, beside this script

ROWS = ("plain", "zbpp split", "delay_wgrad", "torch split")


@dataclass(frozen=True)
class Case:
    name: str
    hidden: int
    ffn: int
    layers: int
    batch: int
    seq: int
    heads: int


CASES = {
    "A": Case("A", 2048, 5632, 8, 2, 2048, 16),
    "B": Case("B", 4096, 11008, 4, 2, 2048, 32),
}
SMOKE = Case("smoke", 32, 48, 2, 2, 8, 4)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="A,B", help="comma-separated: A, B (default both)")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations per row")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny float64 stage on the CPU")
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.iters, args.warmup = min(args.iters, 3), 1
    return args


class Stage(nn.Module):
    """``layers`` HF Llama decoder layers with their rotary embedding: hidden states in and out."""

    def __init__(self, case: Case, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        cfg = LlamaConfig(hidden_size=case.hidden, intermediate_size=case.ffn,
                          num_hidden_layers=case.layers, num_attention_heads=case.heads,
                          num_key_value_heads=case.heads, max_position_embeddings=case.seq,
                          attn_implementation="sdpa")
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(case.layers))
        self.rotary = LlamaRotaryEmbedding(config=cfg)
        self.to(device=device, dtype=dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0).expand(h.shape[0], -1)
        emb = self.rotary(h, pos)
        for layer in self.layers:
            out = layer(h, position_embeddings=emb, position_ids=pos)
            h = out[0] if isinstance(out, tuple) else out
        return h


def generic_split() -> tuple[Callable, Callable, str] | tuple[None, None, str]:
    """zbpp's generic split, as the Pipeline runs it: ``boxes()`` (the context of the forward,
    whose saved tensors B frees when only B needed them) and ``split(y, g, x, boxes) -> w()``;
    or None and why not."""
    try:
        from zbpp.runtime import _autograd_split as generic
    except ImportError as err:
        return None, None, f"zbpp split: this checkout has no generic split ({err})"
    SavedBoxes, backward_input = generic.SavedBoxes, generic.backward_input
    hint = generic.StageSplit() if hasattr(generic, "StageSplit") else {}  # one per stage, as the Pipeline

    def split(y: torch.Tensor, g: torch.Tensor, x: torch.Tensor, saved: Any) -> Callable[[], None]:
        held = backward_input([y], [g], [x], hint, saved)
        return held.run if held is not None else (lambda: None)

    return SavedBoxes, split, ""


class Timer:
    """Milliseconds of phases, with CUDA events on a GPU and perf_counter on a CPU; `host_ms`: the
    host's own time between two marks (on a GPU, how long issuing the phase took)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e, time.perf_counter()
        return None, time.perf_counter()

    def ms(self, a, b) -> float:
        return a[0].elapsed_time(b[0]) if self.cuda else (b[1] - a[1]) * 1e3

    @staticmethod
    def host_ms(a, b) -> float:
        return (b[1] - a[1]) * 1e3


def make_rows(stage: Stage, delayed: Stage, boxes, split) -> dict[str, Callable]:
    """Per row: ``run(x, g, timer) -> (marks)``: F, then B, then W, with a mark between each."""
    converted = [m for m in delayed.modules() if isinstance(m, Linear)]

    def plain(x, g, t):
        m0 = t.mark(); y = stage(x); m1 = t.mark()
        y.backward(g); m2 = t.mark()
        return m0, m1, m2, t.mark()

    def zbpp_split(x, g, t):
        m0 = t.mark()
        with boxes() as saved:
            y = stage(x)
        m1 = t.mark()
        w = split(y, g, x, saved); del y, saved; m2 = t.mark()
        w(); return m0, m1, m2, t.mark()

    def delay(x, g, t):
        m0 = t.mark()
        with microbatch(0):
            y = delayed(x)
        m1 = t.mark()
        y.backward(g); del y; m2 = t.mark()
        for m in converted:
            m.backward_dw(0)
        return m0, m1, m2, t.mark()

    def torch_split(x, g, t):
        from torch.distributed.pipelining._backward import (stage_backward_input,
                                                            stage_backward_weight)
        m0 = t.mark(); y = stage(x); m1 = t.mark()
        _, groups = stage_backward_input([y], [g], [x], stage.parameters())
        del y; m2 = t.mark()
        stage_backward_weight(stage.parameters(), groups)
        return m0, m1, m2, t.mark()

    rows = {"plain": plain, "delay_wgrad": delay, "torch split": torch_split}
    if split is not None:
        rows["zbpp split"] = zbpp_split
    return {name: rows[name] for name in ROWS if name in rows}


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for p in module.parameters()]


def _rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    worst = 0.0
    for a, b in zip(got, ref):
        if a is None or b is None:
            if a is not b:
                return float("inf")
            continue
        scale = b.abs().max().item() or 1.0
        worst = max(worst, (a.float() - b.float()).abs().max().item() / scale)
    return worst


def run_case(case: Case, args: argparse.Namespace, cuda: bool) -> tuple[list[dict], list[str]]:
    device = "cuda" if cuda else "cpu"
    dtype = torch.float64 if args.smoke else torch.bfloat16
    torch.manual_seed(0)
    stage = Stage(case, dtype, device)
    delayed = delay_wgrad(copy.deepcopy(stage))
    boxes, split, why = generic_split()
    notes = [why] if why else []
    gen = torch.Generator(device=device).manual_seed(1)
    shape = (case.batch, case.seq, case.hidden)
    x0 = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    g = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    timer = Timer(cuda)
    rows = make_rows(stage, delayed, boxes, split)
    out, ref_grads = [], None
    for name, run in rows.items():
        module = delayed if name == "delay_wgrad" else stage

        def once(measure: bool):
            module.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_()
            if cuda:
                torch.cuda.synchronize()
            marks = run(x, g, timer)
            if cuda:
                torch.cuda.synchronize()
            return x, marks

        try:
            for _ in range(args.warmup):
                once(False)
            times = []
            for _ in range(args.iters):
                _, (m0, m1, m2, m3) = once(True)
                times.append((timer.ms(m0, m1), timer.ms(m1, m2), timer.ms(m2, m3),
                              timer.host_ms(m1, m2), timer.host_ms(m2, m3)))
            if cuda:
                module.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                start = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            x, _ = once(True)
            peak = torch.cuda.max_memory_allocated() if cuda else None
        except Exception as err:  # noqa: BLE001 - one row failing must not hide the others
            notes.append(f"{name}: failed: {type(err).__name__}: {err}")
            continue
        grads = _grads(module, x)
        if ref_grads is None:
            ref_grads = grads
        f, b, w, hb, hw = (statistics.median(t[i] for t in times) for i in range(5))
        out.append({
            "case": case.name, "row": name, "hidden": case.hidden, "ffn": case.ffn,
            "layers": case.layers, "tokens": case.batch * case.seq, "dtype": str(dtype),
            "F_ms": f, "B_ms": b, "W_ms": w, "BW_ms": b + w, "FBW_ms": f + b + w,
            "B_host_ms": hb, "W_host_ms": hw,
            "peak_gib": None if peak is None else peak / 2**30,
            "peak_above_start_gib": None if peak is None else (peak - start) / 2**30,
            "max_rel_err": _rel_err(grads, ref_grads),
        })
    plain = next((r for r in out if r["row"] == "plain"), None)
    for r in out:
        for key, col in (("BW_over_plain", "BW_ms"), ("FBW_over_plain", "FBW_ms"),
                         ("peak_over_plain", "peak_above_start_gib")):
            r[key] = (r[col] / plain[col]) if plain and r[col] is not None and plain[col] else None
    return out, notes


def print_table(report: dict) -> None:
    head = (f"{'case':6} {'row':12} {'F':>8} {'B':>8} {'W':>8} {'B+W':>8} {'F+B+W':>8} "
            f"{'peak GiB':>9} {'+start':>7} {'B+W/pl':>7} {'FBW/pl':>7} {'mem/pl':>7} {'rel err':>8} "
            f"{'B host':>7} {'W host':>7}")
    print(head)
    print("-" * len(head))

    def fmt(v, spec):
        return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))

    for r in report["rows"]:
        print(f"{r['case']:6} {r['row']:12} {r['F_ms']:8.2f} {r['B_ms']:8.2f} {r['W_ms']:8.2f} "
              f"{r['BW_ms']:8.2f} {r['FBW_ms']:8.2f} {fmt(r['peak_gib'], '9.2f')} "
              f"{fmt(r['peak_above_start_gib'], '7.2f')} {fmt(r['BW_over_plain'], '7.3f')} "
              f"{fmt(r['FBW_over_plain'], '7.3f')} {fmt(r['peak_over_plain'], '7.3f')} "
              f"{r['max_rel_err']:8.1e} {r['B_host_ms']:7.2f} {r['W_host_ms']:7.2f}")
    for note in report["meta"]["notes"]:
        print(note)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    cases = [SMOKE] if args.smoke else [CASES[c.strip()] for c in args.case.split(",")]
    rows, notes = [], []
    for case in cases:
        r, n = run_case(case, args, cuda)
        rows += r
        notes += [f"case {case.name}: {x}" for x in n]
    report = {
        "meta": {
            "benchmark": "bench_split",
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "python": platform.python_version(),
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **code_identity(),
            "zbpp_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("ZBPP_")},
            "config": {"iters": args.iters, "warmup": args.warmup, "smoke": args.smoke,
                       "cases": [c.__dict__ for c in cases]},
            "notes": notes,
        },
        "rows": rows,
    }
    print_table(report)
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
