"""Where an eager FP8 step's time goes against an eager bf16 one, on one GPU: a HF Llama (hidden
4096, 4 layers, seq 2048) as one zb-h1 stage of 8 microbatches, `fast_stage(compile=False)` with
and without FP8. Prints, per form, the step's wall time, the host's time to issue it, the GPU's
kernel time (torch.profiler) and the host's top functions (cProfile of one step); writes JSON.

    PYTHONPATH=$PWD python3 benchmarks/fp8_eager_host.py --out fp8_eager_host.json
    ZBPP_FP8_CAST=compile PYTHONPATH=$PWD python3 benchmarks/fp8_eager_host.py --fp8-only   # another cast path
"""
import argparse
import cProfile
import io
import json
import pstats
import time

import torch
import transformers
from zbpp import Pipeline
from zbpp.models.fast import fast_stage
from zbpp.models.hf import causal_lm_stages
from zbpp.modules.fp8 import cast_path_counts, gemm_path_counts
from zbpp.schedules import build

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--fp8-only", action="store_true")
ap.add_argument("--out", default=None)
args = ap.parse_args()
cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=4,
                               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048)
M = 8
ids = torch.randint(0, 32000, (M, 2048), device="cuda")
out = {}
for fp8 in ((True,) if args.fp8_only else (False, True)):
    sched = build("zb-h1", num_ranks=1, num_microbatches=M)
    stages, kw = causal_lm_stages(cfg, sched, 0, device="cuda", dtype=torch.bfloat16, attn_implementation="sdpa")
    fast_stage(stages[0], compile=False, fp8=fp8)
    pipe = Pipeline(stages, sched, **kw)
    for _ in range(3):
        pipe.step({"input_ids": ids}, target=ids)
    torch.cuda.synchronize()
    walls, issues = [], []
    for _ in range(3):
        t = time.perf_counter(); pipe.step({"input_ids": ids}, target=ids); issues.append(time.perf_counter() - t)
        torch.cuda.synchronize(); walls.append(time.perf_counter() - t)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        pipe.step({"input_ids": ids}, target=ids); torch.cuda.synchronize()
    gpu = sum(e.device_time_total for e in prof.key_averages()) / 1e3
    kernels = sum(e.count for e in prof.key_averages() if e.device_time_total > 0)
    pr = cProfile.Profile(); pr.enable(); pipe.step({"input_ids": ids}, target=ids); torch.cuda.synchronize(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    name = "fp8" if fp8 else "bf16"
    out[name] = {"wall_ms": min(walls) * 1e3, "issue_ms": min(issues) * 1e3, "gpu_ms": gpu, "kernels": kernels}
    print(name, json.dumps(out[name]), flush=True)
    print("\n".join(s.getvalue().splitlines()[:40]), flush=True)
    del pipe, stages; torch.cuda.empty_cache()
print("cast paths", cast_path_counts(), "gemm paths", gemm_path_counts())
if args.out:
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
