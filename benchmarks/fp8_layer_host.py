"""Host time per call of zbpp's FP8 layers, their device work stubbed: what the Python costs.

An eager FP8 step on small microbatches is bound by its host (docs/benchmarks.md, "FP8 eager"). This
times the host side alone, per layer call, for what an FP8 Llama stage runs per decoder layer and
microbatch (`fast_stage(fp8=True)`'s layers): q, k and v `Linear`s reading one input (one shared
cast), o, and one fused gated MLP (`fuse_gated_mlps`); then each call's backward (B: its autograd
node's backward called directly, without the engine) and its `backward_dw` (W), over a step of
several microbatches (the weight casts kept after the first). The device work is stubbed: the Triton
launches launch nothing and ``torch._scaled_mm`` allocates its output, so the numbers are the host's
own (zbpp's Python, torch's dispatch and allocations), with the launches' and GEMM calls' own host
cost left out (``fp8_eager_host.py`` measures those). On the CPU (default) the CUDA-only gates of the
Triton path are forced open, so the path timed is the GPU's; ``--device cuda`` runs it on a GPU's
tensors (CUDA allocations included). ``bf16``: the same layers outside FP8 (their GEMMs real, tiny).

Per form and (phase, layer): the median over the timed steps' calls, in microseconds. The stubbed
steps compute wrong numbers; only their time means something.

    PYTHONPATH=$PWD python3 benchmarks/fp8_layer_host.py
    PYTHONPATH=$PWD python3 benchmarks/fp8_layer_host.py --profile   # + cProfile's top functions (FP8)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

PHASES = ("F", "B", "W")
LAYERS = ("q", "kv", "o", "mlp")  # kv: the mean of k and v, which take q's cast of their input


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid: Any):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed(device: torch.device) -> Iterator[None]:
    """The Triton launches and ``_scaled_mm`` stubbed (and on the CPU the Triton path's CUDA gates
    open), all put back on exit."""
    import zbpp.modules._fp8_cast_triton as kernels
    import zbpp.modules._fused_triton as fused
    import zbpp.modules.fp8.cast as cast
    import zbpp.modules.fp8.gemm as gemm

    saved = [(kernels, "_cast_transpose_amax_kernel"), (gemm, "scaled_mm"), (cast, "on_cuda")]
    saved += [(fused, n) for n in ("_norm_stats_kernel", "_norm_cast_kernel", "_act_cast_kernel", "_dact_cast_kernel")]
    old = [(module, name, getattr(module, name)) for module, name in saved]
    had_problem = device in cast._problems
    problem = cast._problems.get(device)
    try:
        for module, name in saved:
            if name != "scaled_mm" and name != "on_cuda":
                setattr(module, name, _NoLaunch())
        gemm.scaled_mm = lambda a, b, *, out_dtype, **kw: torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype,
                                                                       device=a.device)
        if device.type == "cpu":
            cast.on_cuda = lambda x: True
            cast._problems[device] = None  # the kernels "can run" here: nothing launches
        yield
    finally:
        for module, name, value in old:
            setattr(module, name, value)
        if had_problem:
            cast._problems[device] = problem
        else:
            cast._problems.pop(device, None)


class _Mlp(nn.Module):
    # Hugging Face's LlamaMLP
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.down_proj, self.act_fn = nn.Linear(ffn, hidden, bias=False), nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    # a decoder layer's GEMM layers (attention and norms left out: not zbpp's FP8 layers)
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.mlp = _Mlp(hidden, ffn)

    def forward(self, x: torch.Tensor, xo: torch.Tensor, xm: torch.Tensor,
                times: dict[tuple[str, str], list[float]]) -> tuple:
        # the calls inside one module call, as a model's forward makes them: q, k and v share
        # one input cast only within one model's call (`zbpp.modules._shared_input`)
        clock = time.perf_counter
        t0 = clock(); yq = self.q(x); t1 = clock()
        yk = self.k(x); yv = self.v(x); t2 = clock()
        yo = self.o(xo); t3 = clock()
        ym = self.mlp(xm); t4 = clock()
        times[("F", "q")].append(t1 - t0)
        times[("F", "kv")].append((t2 - t1) / 2)
        times[("F", "o")].append(t3 - t2)
        times[("F", "mlp")].append(t4 - t3)
        return yq, (yk, yv), yo, ym


def build(fp8: bool, hidden: int, ffn: int, blocks: int, device: torch.device) -> nn.Sequential:
    """`blocks` decoder layers' GEMM layers in bfloat16, converted as `fast_stage` converts them."""
    from zbpp.modules import delay_wgrad, fuse_gated_mlps
    from zbpp.modules.base import DelayedWgradModule

    torch.manual_seed(0)
    model = nn.Sequential(*(_Block(hidden, ffn) for _ in range(blocks))).to(device, torch.bfloat16)
    if fp8:
        fuse_gated_mlps(model)
    delay_wgrad(model, transposed=True)
    for layer in model.modules():
        if isinstance(layer, DelayedWgradModule):
            layer.accumulate_wgrad_in_gemm = True
            layer.keep_fp8_weight_casts = fp8
    return model


def step(model: nn.Sequential, fp8: bool, inputs: list[tuple[torch.Tensor, ...]],
         times: dict[tuple[str, str], list[float]]) -> None:
    """One step: every microbatch's forwards, then their backwards (last first), then their Ws;
    each call's seconds appended to ``times[(phase, layer)]``."""
    from zbpp.modules import DelayedScaling, fp8_autocast, microbatch

    clock = time.perf_counter
    outs = []
    with fp8_autocast(enabled=fp8, fp8_recipe=DelayedScaling() if fp8 else None):
        for j, (x, xo, xm) in enumerate(inputs):
            with microbatch((0, j)):
                for block in model:
                    outs.append(block(x, xo, xm, times))
    dy = torch.ones_like(inputs[0][0])
    with torch.no_grad():  # as the engine runs a backward (create_graph=False)
        for yq, kv, yo, ym in reversed(outs):
            for name, ys in (("mlp", (ym,)), ("o", (yo,)), ("q", (yq,)), ("kv", kv)):
                for y in ys:
                    node = y.grad_fn
                    t0 = clock()
                    if fp8 or name != "mlp":
                        node.apply(dy)  # the layer's own node (no engine)
                    else:  # bf16: the model's own MLP forward, several nodes
                        torch.autograd.backward(y, dy)
                    times[("B", name)].append(clock() - t0)
    for j in reversed(range(len(inputs))):
        for block in model:
            for name, layers in (("mlp", (block.mlp.gate_proj, block.mlp.up_proj, block.mlp.down_proj)),
                                 ("o", (block.o,)), ("q", (block.q,)), ("kv", (block.k, block.v))):
                t0 = clock()
                for layer in layers:
                    layer.backward_dw((0, j))
                times[("W", name)].append((clock() - t0) / (1 if name == "mlp" else len(layers)))
    for layer in model.modules():
        if hasattr(layer, "release_step_caches"):
            layer.release_step_caches()
    for p in model.parameters():
        p.grad = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (the CUDA gates forced open) or cuda")
    ap.add_argument("--forms", default="fp8,bf16", help="comma-separated: fp8, bf16")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per form (after 3 untimed)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=4, help="decoder layers")
    ap.add_argument("--tokens", type=int, default=32, help="rows per microbatch (a multiple of 16)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="cProfile's top functions of the FP8 steps")
    ap.add_argument("--out", type=Path, default=None, help="write the medians as JSON")
    args = ap.parse_args(argv)
    args.device = torch.device(args.device)
    args.forms = args.forms.split(",")
    if any(f not in ("fp8", "bf16") for f in args.forms):
        ap.error(f"--forms {','.join(args.forms)}: use fp8 and/or bf16")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU")
    return args


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Time every form; return (and print, and with ``--out`` write) ``{form: {"F q": us, ...}}``."""
    from zbpp.modules.fp8 import cast_path_counts, fused_path_counts, gemm_path_counts

    args = parse_args(argv)
    torch.set_num_threads(1)  # the host's Python and dispatch, not an intra-op thread pool
    medians: dict[str, dict[str, float]] = {}
    with stubbed(args.device):
        for form in args.forms:
            fp8 = form == "fp8"
            model = build(fp8, args.hidden, args.ffn, args.blocks, args.device)
            inputs = [tuple(torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16, device=args.device,
                                        requires_grad=True) for _ in range(3)) for _ in range(args.microbatches)]
            times: dict[tuple[str, str], list[float]] = {(p, n): [] for p in PHASES for n in LAYERS}
            for _ in range(3):  # warm-up: slots, kept casts, caches
                step(model, fp8, inputs, times)
            times = {key: [] for key in times}
            profiler = cProfile.Profile() if fp8 and args.profile else None
            if profiler is not None:
                profiler.enable()
            for _ in range(args.steps):
                step(model, fp8, inputs, times)
            if profiler is not None:
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
                print("== fp8: the host's top functions (cProfile; its overhead inflates small calls)")
                print("\n".join(text.getvalue().splitlines()[:45]))
            medians[form] = {f"{p} {n}": statistics.median(times[(p, n)]) * 1e6 for p in PHASES for n in LAYERS}
    print(f"host us per call (median), device work stubbed, {args.device}:")
    print(f"{'':6s}" + "".join(f"{p + ' ' + n:>9s}" for p in PHASES for n in LAYERS))
    for form, row in medians.items():
        print(f"{form:6s}" + "".join(f"{row[f'{p} {n}']:9.1f}" for p in PHASES for n in LAYERS))
    print("cast paths", cast_path_counts(), "fused", fused_path_counts(), "gemm paths", gemm_path_counts())
    if args.out is not None:
        args.out.write_text(json.dumps({"argv": sys.argv[1:] if argv is None else argv,
                                        "device": str(args.device), "us_per_call": medians}, indent=1))
    return medians


if __name__ == "__main__":
    main()
