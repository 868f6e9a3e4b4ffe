"""Time zbpp's fused FP8 activation kernels against their unfused parts, per tile shape (one GPU).

The fused kernels (``zbpp.modules._fused_triton``) write an activation (or its gradient) straight
into FP8 with its transpose and amax. They pay off only when they beat the unfused pair: the
bfloat16 activation, then the plain cast-transpose (``_fp8_cast_triton.cast_transpose_update``).
This prints both per tile shape (``ZBPP_FUSED_TILE``, rows x columns x warps), with a bfloat16
copy of the same tensor as the memory-bandwidth floor, and writes JSON with ``--out``::

    python benchmarks/bench_fused_kernels.py --rows 4096 --cols 16384 \\
        --tiles 64x64x4,32x64x4,128x64x4 --out fused_kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable

import torch

from provenance import code_identity  # benchmarks/provenance.py, beside this script


def time_us(fn: Callable[[], object], iters: int) -> float:
    """Mean microseconds per call over `iters` back-to-back calls, after five warm-up calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1000.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096, help="tokens (default 4096)")
    ap.add_argument("--cols", type=int, default=16384, help="MLP inner size (default 16384)")
    ap.add_argument("--tiles", default="64x64x4,32x64x4,64x32x4,128x64x4",
                    help="ZBPP_FUSED_TILE values to time, comma separated")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fused_kernels: needs a CUDA GPU (the kernels are Triton on sm_90)")

    from zbpp.modules import _fp8_cast_triton as plain
    from zbpp.modules import _fused_triton as fused
    from zbpp.modules.fp8 import DelayedScaling
    from zbpp.modules.fp8.cast import ScalingMeta

    torch.manual_seed(0)
    h = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(h)
    recipe = DelayedScaling(amax_history_len=16)
    fwd = ScalingMeta(torch.float8_e4m3fn, history_len=16, device="cuda")
    bwd = ScalingMeta(torch.float8_e5m2, history_len=16, device="cuda")

    def cast(x: torch.Tensor, meta: ScalingMeta, sums: bool):
        return plain.cast_transpose_update(
            x, meta.scale, meta.amax_history, meta.fused_workspace(), meta.fp8_max, meta.dtype,
            True, column_sums=sums, **meta.rule_args(recipe))

    gelu = torch.nn.functional.gelu
    base = {
        "copy_bf16": time_us(lambda: h.clone(), args.iters),
        "gelu_bf16": time_us(lambda: gelu(h, approximate="tanh"), args.iters),
        "gelu_grad_bf16": time_us(
            lambda: torch.ops.aten.gelu_backward(grad, h, approximate="tanh"), args.iters),
        "cast_transpose": time_us(lambda: cast(h, fwd, False), args.iters),
        "cast_transpose_sums": time_us(lambda: cast(grad, bwd, True), args.iters),
    }
    unfused_act = base["gelu_bf16"] + base["cast_transpose"]
    unfused_dact = base["gelu_grad_bf16"] + base["cast_transpose_sums"]
    print(f"[{args.rows} x {args.cols}] bf16 copy {base['copy_bf16']:.1f} us; unfused: gelu + "
          f"cast {unfused_act:.1f} us, gelu grad + cast with sums {unfused_dact:.1f} us")
    print(f"{'tile':>10} {'act us':>8} {'x unfused':>9} {'dact us':>8} {'x unfused':>9}")
    tiles = {}
    for tile in [t for t in args.tiles.split(",") if t]:
        os.environ[fused.TILE_ENV] = tile
        act = time_us(lambda: fused.act_cast_update(
            h, 0, False, fwd.scale, fwd.amax_history, fwd.fused_workspace(), fwd.fp8_max,
            fwd.dtype, True, **fwd.rule_args(recipe)), args.iters)
        dact = time_us(lambda: fused.dact_cast_update(
            grad, h, 0, False, bwd.scale, bwd.amax_history, bwd.fused_workspace(), bwd.fp8_max,
            bwd.dtype, True, True, **bwd.rule_args(recipe)), args.iters)
        tiles[tile] = {"act_us": act, "dact_us": dact}
        print(f"{tile:>10} {act:8.1f} {unfused_act / act:9.2f} {dact:8.1f} {unfused_dact / dact:9.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, **code_identity(), "unfused_us": base, "fused_us": tiles}, f,
                      indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
