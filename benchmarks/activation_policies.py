"""Bytes and re-run FLOPs of one Llama decoder layer under each activation policy (CPU is enough).

    python benchmarks/activation_policies.py [--hidden 512 --mlp 1408 --heads 8 --tokens 1024]

Prints a Markdown table (README "How to fit a model that does not fit"): MiB kept from F to B and
from B to W on the device, MiB copied to the host, and the re-run's matmul FLOPs as a share of F's
(`zbpp.models.recompute.measure_activation_policies`).
"""

from __future__ import annotations

import argparse

import torch
import transformers

from zbpp.models.hf import causal_lm_stages
from zbpp.models.recompute import measure_activation_policies
from zbpp.schedules import build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--mlp", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    a = ap.parse_args()
    cfg = transformers.LlamaConfig(hidden_size=a.hidden, intermediate_size=a.mlp, num_hidden_layers=1,
                                   num_attention_heads=a.heads, vocab_size=1000, max_position_embeddings=a.tokens)
    stages, _ = causal_lm_stages(cfg, build("1f1b", num_ranks=1, num_microbatches=1), 0, attn_implementation="eager")
    layer, seen = stages[0].model.layers[0], {}
    layer.register_forward_pre_hook(lambda m, args, kwargs: seen.update(a=args, k=kwargs), with_kwargs=True)
    stages[0](torch.randint(0, 1000, (1, a.tokens)))
    print("| policy | kept F->B | kept B->W | host | re-run |\n| --- | ---: | ---: | ---: | ---: |")
    for p, c in measure_activation_policies(layer, *seen["a"], **seen["k"]).items():
        print(f"| {p} | {c.kept_f_to_b / 2**20:.1f} | {c.kept_b_to_w / 2**20:.1f} | {c.host_bytes / 2**20:.1f} "
              f"| {c.recompute_flops / c.forward_flops:.0%} |")


if __name__ == "__main__":
    main()
