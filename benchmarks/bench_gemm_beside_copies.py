"""GEMM time at the power cap while activations cross NVLink at a pipeline's pace, by transport.

Inside a pipeline on 2 x H200 every compute kernel of the MLP stack ran 3-4% slower than in the
ideal run and in the same task order run alone (`bench_pipeline.py --ordered`), though the NCCL
kernels were resident for only ~1% of the step: the slowdown is not GEMMs crowded by NCCL kernels.
This separates what the traffic itself costs. Both ranks run back-to-back GEMMs (the MLP stack's
fc1: 4096 x 4096 by 16384, bf16), long enough to sit at the power cap, and after every
``--gemms-per-message`` of them a side stream moves one ``--message-mib`` message each way (the
pipeline's pace is ~27: zb-v at m = 8 on 2 ranks sends 16 messages of 32 MiB each way in a
~360 ms step, one per ~22 ms), at each pace of ``--paces``:

- ``alone``: no traffic (both GPUs still busy, as in the ideal row);
- ``copy engine``: ``copy_`` into the other GPU's buffer mapped by CUDA IPC: no SM does the copy;
- ``nccl``: one NCCL send and one receive (``batch_isend_irecv``), as the runtime's messages;
- ``alone (end)``: no traffic again, to see the drift of the power-capped clock over the run.

With ``--telemetry`` each mode also gets its GPUs' mean SM clock and power (nvidia-smi): at the
power cap a slower GEMM at a lower clock and the same power is power spent on the traffic.

Each side-stream message waits on an event recorded after its GEMM, so the traffic never runs ahead
of the compute; both ranks post the same messages in the same order, so NCCL's pair up.

    torchrun --nproc-per-node=2 benchmarks/bench_gemm_beside_copies.py --out $OUT/gemm_beside_copies.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_telemetry import Telemetry  # noqa: E402
from provenance import code_identity  # noqa: E402



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gemms", type=int, default=480, help="timed GEMMs per measurement (~0.8 ms each)")
    ap.add_argument("--paces", default="8,27,108",
                    help="GEMMs between two messages each way, comma separated (27: ~22 ms, the pipeline's pace)")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per mode (the median is kept)")
    ap.add_argument("--message-mib", type=float, default=32.0, help="message size (default: one activation "
                    "of the mlp stack, 4096 tokens x 4096 bf16)")
    ap.add_argument("--heat-soak", type=float, default=20.0, help="seconds of GEMMs before the first mode")
    ap.add_argument("--telemetry", action="store_true", help="sample SM clock and power with nvidia-smi")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        raise SystemExit("bench_gemm_beside_copies needs 2 CUDA GPUs of one host, under torchrun --nproc-per-node=2")
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    if dist.get_world_size() != 2:
        raise SystemExit(f"bench_gemm_beside_copies runs on exactly 2 ranks, got {dist.get_world_size()}")
    peer = 1 - rank
    torch.manual_seed(rank)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    numel = int(args.message_mib * 2**20) // 2
    send = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    recv = torch.empty_like(send)
    inbox = torch.empty_like(send)  # what the peer copies into
    handles: list[Any] = [None, None]
    dist.all_gather_object(handles, reduce_tensor(inbox))
    rebuild, rebuild_args = handles[peer]
    peer_inbox = rebuild(*rebuild_args)  # the peer's inbox, mapped into this process
    side = torch.cuda.Stream()
    # warm both transports up (NCCL connects on its first send)
    dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)])[0].wait()
    peer_inbox.copy_(send)
    torch.cuda.synchronize()

    def measure(mode: str, pace: int) -> float:
        """ms per GEMM over --gemms back-to-back GEMMs with `mode`'s traffic beside them."""
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        works: list[Any] = []
        start.record()
        for i in range(args.gemms):
            torch.mm(x, w.t())
            if mode in ("copy engine", "nccl") and i % pace == 0:
                ready = torch.cuda.Event()
                ready.record()
                with torch.cuda.stream(side):
                    side.wait_event(ready)
                    if mode == "nccl":
                        works += dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer),
                                                         dist.P2POp(dist.irecv, recv, peer)])
                    else:
                        peer_inbox.copy_(send, non_blocking=True)
        end.record()
        end.synchronize()
        for work in works:
            work.wait()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / args.gemms

    # heat soak: a GPU at its power cap clocks lower as it warms
    deadline = time.perf_counter() + args.heat_soak
    while time.perf_counter() < deadline:
        for _ in range(50):
            torch.mm(x, w.t())
        torch.cuda.synchronize()

    paces = [int(v) for v in args.paces.split(",")]
    modes = [("alone", 0)] + [(kind, pace) for pace in paces for kind in ("nccl", "copy engine")] + [("alone (end)", 0)]
    telemetry = Telemetry.start() if args.telemetry and rank == 0 else None
    rows = []
    for mode, pace in modes:
        t0 = time.time()
        got = [measure(mode, pace) for _ in range(args.repeats)]
        row = {"mode": mode, "pace": pace, "ms_per_gemm": statistics.median(got), "all_ms_per_gemm": got}
        if telemetry is not None:
            row["gpu"] = telemetry.window(t0, time.time())
        print(f"rank {rank}: {row}", flush=True)  # each mode as it ends: a later mode that hangs loses nothing
        rows.append(row)
    if telemetry is not None:
        telemetry.stop()
    every: list[Any] = [None, None]
    dist.all_gather_object(every, rows)
    if rank == 0:
        print(f"GEMM 4096x4096 @ 4096x16384 bf16, {args.gemms} per measurement, median of {args.repeats}; "
              f"one {args.message_mib:g} MiB message each way per `pace` GEMMs; "
              f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        print(f"{'mode':<12} {'pace':>4} {'rank':>4} {'ms/GEMM':>8} {'vs alone':>9}  SM MHz / W per GPU")
        for r, mine in enumerate(every):
            alone = mine[0]["ms_per_gemm"]
            for row in mine:
                row["vs_alone"] = row["ms_per_gemm"] / alone - 1
                gpu = every[0][mine.index(row)].get("gpu", {})
                tele = "  ".join(f"{v['sm_mhz']:.0f}/{v['power_w']:.0f}" for _, v in sorted(gpu.items()))
                print(f"{row['mode']:<12} {row['pace']:>4} {r:>4} {row['ms_per_gemm']:>8.4f} "
                      f"{100 * row['vs_alone']:>8.2f}%  {tele}")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"config": vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           **code_identity(), "ranks": every}, fh, indent=1)
            print(f"wrote {args.out}")
    del peer_inbox
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
