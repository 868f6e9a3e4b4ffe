"""The generic B/W split's host cost and what B keeps for W, on the CPU.

A CPU proxy for the host side of ``bench_split``: a float32 stage of Hugging Face
``LlamaDecoderLayer`` s (sdpa attention, causal) small enough (default hidden 64, 8 layers, 8
tokens) that the kernels cost little next to the Python and autograd-engine work per node, which
is what a GPU waits on when a backward is launch-bound. Rows: ``plain`` (forward, ``backward``) and
``zbpp split`` (forward under ``SavedBoxes``, B ``backward_input`` with a `StageSplit` as the
Pipeline passes one, W ``HeldWgrad.run``). Times are the minimum over ``--iters`` iterations
(``time.perf_counter``; take ``OMP_NUM_THREADS=1``), with the split's B+W over the plain backward.

Memory (``--mem-hidden``, default 256 with 64 tokens, so that activations dominate): the peak of
one F+B+W above what was allocated before it and the bytes allocated between B and W (the CPU
allocator's reports under ``torch.profiler(profile_memory=True)``), and for the split the bytes
its boxes keep after B (one count per storage, parameters left out) next to what W strictly needs:
the tensors every frontier node saved (the inputs of the weight GEMMs) and its kept gradients.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/split_host.py --out /tmp/split_host.json

``--suite layers``: the host time per block of ``bench_modules --suite blocks``' residual MLP
stack (``x + mlp(x)``, float32, default hidden 64, ffn 256, 16 tokens, 16 blocks), each
microbatch's F inside ``microbatch((0, j))`` as the Pipeline runs it, in three rows: ``torch.nn``
(LayerNorm, Linear, GELU, Linear), ``zbpp eager`` (`LayerNormMLP`, weight gradients in the
backward) and ``zbpp delayed`` (``delay_wgrad_compute=True``: B files the weight gradients, W
runs them through the stage's `StageWgrad`, ``filed`` then ``compute``, as the executor does). Times
are µs of this thread's CPU time per block (``time.thread_time``: time the process waits for
a core does not count; the minimum over ``--iters`` steps of F, B and W each, the rows taking
turns), with each row's F+B+W over torch.nn's; ``--cprofile ROW`` prints that row's top functions under cProfile::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/split_host.py --suite layers
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from bench_split import Case, Stage  # noqa: E402
from provenance import code_identity, write_report  # noqa: E402

from zbpp.runtime import _autograd_split as split  # noqa: E402

LAYER_ROWS = ("torch.nn", "zbpp eager", "zbpp delayed")  # --suite layers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--mem-hidden", type=int, default=256)
    ap.add_argument("--mem-tokens", type=int, default=64)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--suite", choices=("split", "layers"), default="split",
                    help="split: the generic B/W split of Llama layers; layers: zbpp's layer calls")
    ap.add_argument("--blocks", type=int, default=16, help="layers: residual MLP blocks")
    ap.add_argument("--ffn", type=int, default=None, help="layers: ffn width (4 x hidden)")
    ap.add_argument("--cprofile", choices=LAYER_ROWS, default=None,
                    help="layers: print the cProfile top functions of this row")
    return ap.parse_args(argv)


def _stage(hidden: int, tokens: int, layers: int) -> tuple[Stage, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    case = Case("cpu", hidden, 2 * hidden, layers, 1, tokens, 4)
    stage = Stage(case, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(1)
    return stage, torch.randn(1, tokens, hidden, generator=gen), torch.randn(1, tokens, hidden, generator=gen)


def runners(stage: Stage, g: torch.Tensor) -> dict[str, Callable[[torch.Tensor, Any], tuple]]:
    """Per row: ``run(x, hook) -> (t0, t1, t2, t3)``: F, B, W; ``hook(phase)`` between phases."""
    hint = split.StageSplit() if hasattr(split, "StageSplit") else {}  # older checkouts: a dict

    def plain(x, hook):
        t0 = time.perf_counter()
        y = stage(x)
        t1 = time.perf_counter()
        hook("F")
        y.backward(g)
        t2 = time.perf_counter()
        hook("B")
        return t0, t1, t2, t2

    def zbpp_split(x, hook):
        t0 = time.perf_counter()
        with split.SavedBoxes() as saved:
            y = stage(x)
        t1 = time.perf_counter()
        hook("F", saved)
        held = split.backward_input([y], [g], [x], hint, saved)
        t2 = time.perf_counter()
        hook("B", None, held)
        del y, saved
        if held is not None:
            held.run()
        t3 = time.perf_counter()
        return t0, t1, t2, t3

    return {"plain": plain, "zbpp split": zbpp_split}


def host_times(args: argparse.Namespace) -> list[dict]:
    stage, x0, g = _stage(args.hidden, args.tokens, args.layers)
    rows = runners(stage, g)
    best: dict[str, list[float]] = {}
    for _ in range(3):  # alternate the rows so that a noisy moment hits both
        for name, run in rows.items():
            for i in range(args.iters + 3):
                stage.zero_grad(set_to_none=True)
                t0, t1, t2, t3 = run(x0.clone().requires_grad_(), lambda *a: None)
                if i >= 3:
                    got = [t1 - t0, t2 - t1, t3 - t2]
                    best[name] = [min(a, b) for a, b in zip(best.get(name, got), got)]
    plain_b = best["plain"][1]
    return [{"row": n, "F_ms": f * 1e3, "B_ms": b * 1e3, "W_ms": w * 1e3, "BW_ms": (b + w) * 1e3,
             "BW_over_plain": (b + w) / plain_b} for n, (f, b, w) in best.items()]


_MARK = 1234567  # bytes of the marker allocation (no tensor of the stage has this size)


def _storage_bytes(ts: list[torch.Tensor], skip: set[int]) -> int:
    seen: dict[int, int] = {}
    for t in ts:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def memory(args: argparse.Namespace) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    stage, x0, g = _stage(args.mem_hidden, args.mem_tokens, args.layers)
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    out = []
    for name, run in runners(stage, g).items():
        run(x0.clone().requires_grad_(), lambda *a: None)  # warm-up
        stage.zero_grad(set_to_none=True)
        kept: dict[str, Any] = {}
        every: list[Any] = []

        def hook(phase, saved=None, held=None):
            if saved is not None:
                every.extend(saved.boxes)
            if phase == "B" and every:
                torch.empty(_MARK, dtype=torch.uint8)  # finds the end of B among the allocations
                boxes = [b.t for b in every if b.t is not None]
                kept["box_bytes"] = _storage_bytes(boxes, params)
                front = held.frontier if held is not None else []
                need = [t for node, _, _ in front for t in _saved_tensors(node)]
                grads = [t for _, got, _ in front for t in got if t is not None]
                kept["frontier_saved_bytes"] = _storage_bytes(need, params)
                kept["kept_grad_bytes"] = _storage_bytes(grads, set())

        x = x0.clone().requires_grad_()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run(x, hook)
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]")
        live, peak, at_b = 0, 0, None
        for _, n in events:
            if n == _MARK and at_b is None:
                at_b = live
            live += n
            peak = max(peak, live)
        del x
        out.append({"row": name, "peak_above_start_bytes": peak,
                    "allocated_between_B_and_W_bytes": at_b, **kept})
    return out


def _saved_tensors(node: Any) -> list[torch.Tensor]:
    """Every tensor a (generated) autograd node saved, read through its ``_saved_*`` attributes."""
    out = []
    for name in dir(node):
        if name.startswith("_saved_"):
            v = getattr(node, name)
            out += [t for t in (v if isinstance(v, (tuple, list)) else [v]) if isinstance(t, torch.Tensor)]
    return out


def layer_steps(args: argparse.Namespace) -> dict[str, Callable[[int], tuple[float, float, float]]]:
    """Per row: ``step(j) -> (F, B, W)`` seconds of microbatch `j` through the block stack."""
    from bench_modules import Residual, TorchMLP

    from zbpp.modules import LayerNormMLP, microbatch
    from zbpp.runtime.wgrad import StageWgrad

    hidden, ffn = args.hidden, args.ffn or 4 * args.hidden
    clock = time.thread_time  # this thread's CPU time: on a CPU autograd runs the backward here
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(args.tokens, hidden, generator=gen)
    g = torch.randn(args.tokens, hidden, generator=gen)

    def stack(row: str) -> torch.nn.Sequential:
        torch.manual_seed(0)
        if row == "torch.nn":
            return torch.nn.Sequential(*[Residual(TorchMLP(hidden, ffn)) for _ in range(args.blocks)])
        return torch.nn.Sequential(*[
            Residual(LayerNormMLP(hidden, ffn, delay_wgrad_compute=row == "zbpp delayed"))
            for _ in range(args.blocks)])

    def runner(row: str) -> Callable[[int], tuple[float, float, float]]:
        model = stack(row)
        wgrad = StageWgrad(model)

        def step(j: int) -> tuple[float, float, float]:
            x = x0.clone().requires_grad_()
            key = (0, j)
            t0 = clock()
            with microbatch(key):
                y = model(x)
            t1 = clock()
            split.run_backward([y], [g])
            wgrad.filed(key)
            t2 = clock()
            wgrad.compute(key)
            t3 = clock()
            return t1 - t0, t2 - t1, t3 - t2

        return step

    return {row: runner(row) for row in LAYER_ROWS}


def layer_times(args: argparse.Namespace) -> list[dict]:
    steps = layer_steps(args)
    best: dict[str, list[float]] = {}
    for i in range(args.iters + 3):  # the rows take turns, so that a noisy moment hits each
        for name, step in steps.items():
            got = list(step(i))
            if i >= 3:
                best[name] = [min(a, b) for a, b in zip(best.get(name, got), got)]
    per_block = 1e6 / args.blocks
    ref = sum(best["torch.nn"])
    return [{"row": n, "F_us": f * per_block, "B_us": b * per_block, "W_us": w * per_block,
             "FBW_us": (f + b + w) * per_block, "over_torch_nn": (f + b + w) / ref}
            for n, (f, b, w) in best.items()]


def cprofile_layers(args: argparse.Namespace) -> None:
    import cProfile
    import pstats

    step = layer_steps(args)[args.cprofile]
    for i in range(5):
        step(i)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(args.iters):
        step(i)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def main_layers(args: argparse.Namespace) -> dict:
    if args.cprofile is not None:
        cprofile_layers(args)
    rows = layer_times(args)
    print(f"host per block, hidden {args.hidden}, ffn {args.ffn or 4 * args.hidden}, "
          f"{args.tokens} tokens, {args.blocks} blocks, float32 (min of {args.iters}, us)")
    print(f"{'row':14} {'F':>7} {'B':>7} {'W':>7} {'F+B+W':>7} {'/torch':>7}")
    for r in rows:
        print(f"{r['row']:14} {r['F_us']:7.1f} {r['B_us']:7.1f} {r['W_us']:7.1f} "
              f"{r['FBW_us']:7.1f} {r['over_torch_nn']:7.3f}")
    report = {"meta": {"benchmark": "split_host layers", "torch": torch.__version__, **code_identity(),
                       "config": vars(args) | {"out": str(args.out)}}, "layers": rows}
    write_report(report, args.out)
    return report


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.suite == "layers":
        return main_layers(args)
    host = host_times(args)
    mem = memory(args)
    print(f"host, hidden {args.hidden}, {args.tokens} tokens, {args.layers} layers (min of {args.iters}, ms)")
    print(f"{'row':12} {'F':>7} {'B':>7} {'W':>7} {'B+W':>7} {'B+W/pl':>7}")
    for r in host:
        print(f"{r['row']:12} {r['F_ms']:7.3f} {r['B_ms']:7.3f} {r['W_ms']:7.3f} {r['BW_ms']:7.3f} {r['BW_over_plain']:7.3f}")
    print(f"memory, hidden {args.mem_hidden}, {args.mem_tokens} tokens (MiB)")
    mib = lambda v: "-" if v is None else f"{v / 2**20:.3f}"  # noqa: E731
    for r in mem:
        extra = ""
        if "box_bytes" in r:
            extra = (f" boxes kept after B {mib(r['box_bytes'])}, of which W needs (frontier-saved) "
                     f"{mib(r['frontier_saved_bytes'])}; kept gradients {mib(r['kept_grad_bytes'])}")
        print(f"{r['row']:12} peak above start {mib(r['peak_above_start_bytes'])}, "
              f"between B and W {mib(r['allocated_between_B_and_W_bytes'])}{extra}")
    report = {"meta": {"benchmark": "split_host", "torch": torch.__version__, **code_identity(),
                       "config": vars(args) | {"out": str(args.out)}}, "host": host, "memory": mem}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
