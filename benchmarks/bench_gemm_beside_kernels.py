"""GEMM time alone and beside resident one-CTA kernels, by cuBLAS SM carveout and BLAS library.

A posted NCCL kernel holds SMs while it waits or copies. A large cuBLAS GEMM is one persistent
wave sized to every SM, so beside a resident kernel one of its CTAs waits for the others. This
measures that effect with a stand-in for the NCCL kernel, ``torch.cuda._sleep`` (one CTA spinning
for a given number of cycles, on its own stream), and what torch's experimental SM carveout
(``torch._C._set_sm_carveout_experimental``) does about it under each BLAS library
(``torch.backends.cuda.preferred_blas_library``). The shapes are the mlp stack's of
benchmarks/bench_pipeline.py (4096 tokens, hidden 4096, ffn 16384, bfloat16).

Prints one row per (library, carveout, GEMM): ms per GEMM alone and beside 1 and 2 sleeping
kernels, and writes JSON with ``--out``. CUDA only::

    PYTHONPATH=$PWD python3 benchmarks/bench_gemm_beside_kernels.py --out $OUT/gemm_beside_kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import code_identity  # noqa: E402

SLEEP_CYCLES = 120_000_000  # ~60-80 ms of one resident CTA: longer than the timed GEMMs
TIMED = 20  # GEMMs per measurement, after 3 untimed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--carveouts", default="none,1,2,4,8", help="SM carveouts to time (comma separated)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm_beside_kernels needs a CUDA GPU")
    carveouts = [None if v == "none" else int(v) for v in args.carveouts.split(",")]
    torch.manual_seed(0)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(4096, 16384, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(16384, device="cuda", dtype=torch.bfloat16)
    gemms = {"fc1 x@W^T": lambda: x @ w.t(), "fc1+bias addmm": lambda: torch.nn.functional.linear(x, w, bias),
             "fc2 g@W": lambda: g @ w, "wgrad g^T@x": lambda: g.t() @ x}
    streams = [torch.cuda.Stream() for _ in range(2)]

    def ms_per_gemm(fn, sleepers: int) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        for k in range(sleepers):
            with torch.cuda.stream(streams[k]):
                torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(TIMED):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / TIMED

    rows = []
    library_before = torch.backends.cuda.preferred_blas_library()
    print(f"{'library':9} {'carveout':>8}  {'gemm':16} {'alone ms':>9} {'beside 1':>9} {'beside 2':>9}")
    try:
        for library in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(library)
            for carveout in carveouts:
                torch._C._set_sm_carveout_experimental(carveout)
                for name, fn in gemms.items():
                    row = {"library": library, "carveout": carveout, "gemm": name,
                           **{f"ms_beside_{k}": ms_per_gemm(fn, k) for k in (0, 1, 2)}}
                    rows.append(row)
                    print(f"{library:9} {str(carveout):>8}  {name:16} {row['ms_beside_0']:9.4f} "
                          f"{row['ms_beside_1']:9.4f} {row['ms_beside_2']:9.4f}", flush=True)
    finally:
        torch._C._set_sm_carveout_experimental(None)
        torch.backends.cuda.preferred_blas_library(library_before)
    if args.out:
        env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), **code_identity()}
        with open(args.out, "w") as fh:
            json.dump({"env": env, "rows": rows}, fh, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
