"""Host time of one FP8 cast launch: through Triton's ``JITFunction.run`` against through the compiled
kernel (`zbpp.modules._triton_launch`), beside a bare ``torch._scaled_mm`` and ``torch.mm`` call.

Each figure is the host time per call of 2000 calls issued back to back (a 256 x 1024 bfloat16
input: the GPU keeps up, so the host sets the pace), in rounds; the two launches' outputs are also
checked to be bit-identical. One GPU:

    PYTHONPATH=$PWD python3 benchmarks/triton_launch_host.py --out triton_launch_host.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _host_us(fn: Callable[[], Any], n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return host


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from zbpp.modules import _fp8_cast_triton as kernels

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or kernels.unsupported(torch.device("cuda")):
        ap.error("needs a CUDA GPU the Triton FP8 kernels run on")
    dev, e4m3 = torch.device("cuda"), torch.float8_e4m3fn
    x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
    scale, history = torch.ones((), device=dev), torch.zeros(16, device=dev)
    workspace = torch.zeros(2, dtype=torch.int32, device=dev)
    launcher = kernels._cast_transpose_amax_kernel

    def cast() -> Any:
        return kernels.cast_transpose_update(x, scale, history, workspace, 448.0, e4m3, True,
                                             factor=448.0, most_recent=False)

    def through(usable: bool) -> Callable[[], Any]:
        def run() -> Any:
            launcher._usable = usable
            return cast()
        return run

    a = torch.randn(256, 1024, device=dev).to(e4m3)
    b = torch.randn(1024, 1024, device=dev).to(e4m3).t()
    one = torch.ones((), device=dev)
    abf, bbf = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16), torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    rows: list[dict[str, float]] = []
    usable = launcher._usable
    try:
        for _ in range(args.rounds):
            saved = history.clone(), scale.clone()
            outs = []
            for way in (False, True):  # the same state for both: the cast steps the slot
                history.copy_(saved[0])
                scale.copy_(saved[1])
                outs.append(through(way)())
            same = all(torch.equal(p.view(torch.uint8) if p.dtype == e4m3 else p, q.view(torch.uint8) if q.dtype == e4m3 else q)
                       for p, q in zip(outs[0][:3], outs[1][:3]))
            row = {"jit_run_us": _host_us(through(False)), "compiled_kernel_us": _host_us(through(True)),
                   "scaled_mm_us": _host_us(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)),
                   "mm_us": _host_us(lambda: torch.mm(abf, bbf)), "bit_identical": same}
            rows.append(row)
            print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    finally:
        launcher._usable = usable
    out = {"rounds": rows}
    if args.out is not None:
        from bench_modules import run_env
        from provenance import write_report

        write_report({"benchmark": "triton_launch_host", "env": run_env(True), "argv": sys.argv[1:] if argv is None else argv,
                      **out}, args.out)
    return out


if __name__ == "__main__":
    main()
