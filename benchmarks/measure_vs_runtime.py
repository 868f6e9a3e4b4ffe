"""`zbpp measure`'s task times against the runtime's records of the same stage, on one GPU: a HF
Llama (4 layers, bf16; hidden 2048 and seq 2048 by default) profiled layer by layer with
`measure_profile`, and
run as a one-rank zb-v `Pipeline(record_task_times=True)` of 4 microbatches, whose stage 1 holds
layers 2-3, the norm and the head; F, B and W of those layers summed against the median of stage
1's F, B and W records, with the generic B/W split and with delayed-wgrad layers (`delay_wgrad`).
A record is a task's span on the GPU's stream: where the host issues a task more slowly than the
GPU runs it (small layers), the span holds the GPU's waits for the host, which `measure_profile`'s
kernel time leaves out; a larger stage (``--hidden 4096 --seq 4096``) keeps the GPU ahead.

    PYTHONPATH=$PWD python3 benchmarks/measure_vs_runtime.py --out measure_vs_runtime.json
    PYTHONPATH=$PWD python3 benchmarks/measure_vs_runtime.py --hidden 4096 --seq 4096 --out measure_vs_runtime_h4096.json
"""
import argparse
import json
import statistics

import torch
import transformers

from provenance import code_identity  # benchmarks/provenance.py, beside this script

from zbpp import Pipeline
from zbpp.models import measure_profile
from zbpp.models.hf import causal_lm_stages
from zbpp.modules import delay_wgrad
from zbpp.schedules import build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=2048, help="tokens per microbatch (one sequence)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu: float32, the host's wall clock (runs of a few seconds at --hidden 128 --seq 64)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    device, dtype = args.device, torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    heads = args.hidden // 128
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
                                   num_hidden_layers=4, num_attention_heads=heads, num_key_value_heads=heads,
                                   max_position_embeddings=args.seq)
    SEQ, M = args.seq, 4
    out = {}
    for delayed in (False, True):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).to(device)
        if delayed:
            delay_wgrad(model)
        ids = torch.randint(0, 32000, (1, SEQ), device=device)
        prof = measure_profile(model, ids, steps=5, warmup=2)
        sched = build("zb-v", num_ranks=1, num_microbatches=M)  # two stages on the rank: stage 1's B is real
        stages, kw = causal_lm_stages(cfg, sched, 0, device=device, dtype=dtype, attn_implementation="sdpa",
                                      state_dict=model.state_dict())
        held = {n.rsplit(".", 1)[0] if n.rsplit(".", 1)[-1] in ("weight", "bias") else n
                for n, _ in stages[1].named_parameters()}
        mine = [l for l in prof.layers
                if any(h == part or h.startswith(part + ".") for part in l.name.split("+") for h in held)]
        print("stage 1 layers:", [l.name for l in mine])
        measured = {k: sum(getattr(l, k) for l in mine) for k in ("f", "b", "w")}
        if delayed:
            for s in stages.values():
                delay_wgrad(s)
        pipe = Pipeline(stages, sched, record_task_times=True, **kw)
        batch = torch.randint(0, 32000, (M, SEQ), device=device)
        runtime = {"f": [], "b": [], "w": []}
        for step in range(6):
            pipe.step({"input_ids": batch}, target=batch)
            if step >= 2:
                for r in pipe.task_times():
                    k = r["action"][0].lower()
                    if k in runtime and r["action"][1:].startswith("1."):
                        runtime[k].append(r["end"] - r["start"])
        rt = {k: statistics.median(v) for k, v in runtime.items() if v}
        name = "delayed" if delayed else "generic"
        out[name] = {"measure_ms": {k: v * 1e3 for k, v in measured.items()}, "runtime_ms": {k: v * 1e3 for k, v in rt.items()},
                     "w_ratio": measured["w"] / rt["w"]}
        print(name, json.dumps(out[name]))
        del pipe, stages, model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({**code_identity(), **out}, fh, indent=1)


if __name__ == "__main__":
    main()
