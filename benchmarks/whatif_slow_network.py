"""What-if: which data-parallel scheme wins on a cluster with little bandwidth between nodes?

    python benchmarks/whatif_slow_network.py          # about a minute on 2 cores

128 A100s (16 DGX A100 nodes) whose nodes each share one 100 Gb/s line (1.5625e9 B/s per
GPU), a Llama-style 1.3B model and Llama-2-7B, global batch 512 x 2,048 / 4,096 tokens:
ZeRO-3, AsyncHZP, CO2 (local SGD, docs/co2.md) and DDP with gradient compression
(docs/compression.md). Throughput per token of data: CO2 and lossy compression change what a
step learns, which hzpsim does not model.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from hzpsim.run import run_choice
from hzpsim.scenario import scenario_from_mapping
from hzpsim.strategies import label

MODELS: dict[str, Any] = {
    # docs/compression-whatif.yaml's hand-picked 1.3B shape
    "llama-1.3b": {"name": "llama-1.3b", "num_layers": 24, "hidden_size": 2048, "num_heads": 16,
                   "ffn_hidden_size": 5504, "vocab_size": 32000, "seq_len": 2048, "dropout": False},
    "llama2-7b": "llama2-7b",
}
STRATEGIES = [
    {"name": "ddp"},
    {"name": "zero", "stage": 3},
    {"name": "asynchzp"},
    {"name": "co2"},
    {"name": "co2", "outer_period": 12},
    {"name": "co2", "zero_stage": 2},
    {"name": "zero", "stage": 2},
    {"name": "zero", "stage": 2, "grad_compression": {"method": "powersgd", "ratio": 0.01}},
    {"name": "ddp", "grad_compression": {"method": "quantize", "ratio": 0.25}},
    {"name": "ddp", "grad_compression": {"method": "powersgd", "ratio": 0.01}},
    {"name": "ddp", "grad_compression": {"method": "topk", "ratio": 0.001}},
]


def main() -> int:
    start = time.perf_counter()
    for name, model in MODELS.items():
        print(f"\n## {name}, 128 A100, 100 Gb/s per node\n")
        print("| strategy | step s | tokens/s | MFU | exposed comm s | peak GiB | fits | inter-node GB/GPU/step |")
        print("|---|---|---|---|---|---|---|---|")
        for strategy in STRATEGIES:
            sc = scenario_from_mapping({
                "model": model, "training": {"global_batch_size": 512, "micro_batch_size": 4 if name != "llama2-7b" else 1},
                "cluster": {"preset": "dgx-a100", "num_nodes": 16, "inter_node_bytes_per_s_per_device": 1.5625e9},
                "strategy": strategy,
            })
            r = run_choice(sc, sc.strategies[0])
            print(f"| {label(r['strategy_resolved'])} | {r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                  f"{r['exposed_comm_s']:.3f} | {r['peak_memory_bytes'] / 2**30:.1f} | {'yes' if r['fits_in_memory'] else 'no'} | "
                  f"{r['comm_bytes_per_device']['inter_node'] / 1e9:.2f} |")
    print(f"\n(took {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
