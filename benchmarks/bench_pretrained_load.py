"""Host memory of a rank loading its share of a sharded pretrained checkpoint, against the model.

A random-weight Llama (default: hidden 1024, 6 layers, FFN 2816, vocabulary 16000, untied head,
float32: ~440 MB) is saved by HF's ``save_pretrained`` in 40 MB shards. Then, each in a fresh
process (no torch.distributed: building stages needs none):

- ``rank r``: ``causal_lm_stages(dir, 1f1b on 2 ranks, r)`` (`zbpp.models.hf_weights`);
- ``whole``: ``AutoModelForCausalLM.from_pretrained(dir)``, what a rank would do without it.

Each line gives the process's peak resident memory (VmHWM) minus its resident memory before
loading (after the imports and a model built on the meta device once; every weight read once
after loading, as training reads them), the bytes of the parameters it ends up holding, and the whole model's.

    python benchmarks/bench_pretrained_load.py [--hidden 1024 --layers 6 --vocab 16000 --shard 40MB]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(directory: str, what: str) -> dict[str, float]:
    """In this (fresh) process: load `what` ("whole" or a rank number) and report memory in MB."""
    import gc

    import torch
    import transformers

    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    with torch.device("meta"):  # the imports a model build does (~150 MB of code): not weights
        transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    gc.collect()
    before = _status("VmRSS")
    if what == "whole":
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        params = list(model.parameters())
    else:
        sched = build("1f1b", num_ranks=2, num_microbatches=2)
        stages, _ = causal_lm_stages(directory, sched, int(what), device="cpu", dtype=torch.float32)
        params = list({id(p): p for m in stages.values() for p in m.parameters()}.values())
    with torch.no_grad():  # read every weight, as training does: pages mapped but untouched are not resident
        for p in params:
            p.sum()
    held = sum(p.numel() * p.element_size() for p in params)
    return {"peak_growth_mb": (_status("VmHWM") - before) / 1e6, "held_mb": held / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--shard", default="40MB")
    ap.add_argument("--measure", nargs=2, metavar=("DIR", "WHAT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return

    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                                      tie_word_embeddings=False, dtype="float32")
    with tempfile.TemporaryDirectory() as directory:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        whole_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
        model.save_pretrained(directory, max_shard_size=args.shard)
        del model
        files = len(list(Path(directory).glob("*.safetensors")))
        print(f"Llama hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}: {whole_mb:.0f} MB float32 "
              f"in {files} shards of <= {args.shard}")
        for what in ("0", "1", "whole"):
            out = subprocess.run([sys.executable, __file__, "--measure", directory, what], check=True,
                                 capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            label = f"rank {what} of 2" if what != "whole" else "from_pretrained"
            print(f"{label:>16}: peak RSS +{r['peak_growth_mb']:6.0f} MB, holds {r['held_mb']:6.0f} MB "
                  f"({r['peak_growth_mb'] / whole_mb:.2f} of the model)")


if __name__ == "__main__":
    main()
