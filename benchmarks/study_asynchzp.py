"""The AsyncHZP study (docs/asynchzp.md): the paper's cluster shape, 70B dense and an MoE model.

    python benchmarks/study_asynchzp.py            # about a minute on 2 cores

hzp-npu preset (16 cards per node as two 8-card full-mesh islands, 200 Gb/s RoCE per card,
~300 TFLOP/s, 64 GB), 1,024 cards, a 16M-token global batch (4,096 sequences of 4,096):
ZeRO-3, AsyncHZP (8|8|1024) and its synchronous variant, the best of a small grid of
Megatron ND layouts, and adaptive AsyncHZP; then 256 -> 1,024 weak scaling (16K tokens per
card per step) and the same comparison for two MoE models (Mixtral 8x7B, Qwen3-30B-A3B).
Every strategy runs hand-fused model code (``training.fused_kernels``).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from hzpsim.run import run_choice
from hzpsim.scenario import scenario_from_mapping
from hzpsim.strategies import label


def _label(resolved: dict[str, Any]) -> str:
    """The strategy's label as a Markdown table cell (AsyncHZP's ``p|g|o`` degrees escaped)."""
    return label(resolved).replace("|", "\\|")

# Document lengths for the variable-length weak scaling: the DCLM-Baseline subset's sequences
# per length bucket after dataset decomposition (Pouransari et al., NeurIPS 2024, arXiv
# 2405.13226; official repository apple/ml-dataset-decomposition, README "Step 4", commit
# 2c38656: 14,581,760 / 12,279,808 / 7,587,840 / 3,230,208 / 1,320,192 / 577,664 sequences of
# 256 ... 8,192 tokens). They are the pieces of DCLM's documents cut at powers of two, the
# closest published length histogram found (docs/sequence-lengths.md); mean 873 tokens.
DCLM_LENGTHS = [[256, 14_581_760], [512, 12_279_808], [1024, 7_587_840], [2048, 3_230_208],
                [4096, 1_320_192], [8192, 577_664]]


def run(model: Any, cards: int, strategy: dict, recompute: str = "full", seqs_per_card: int = 4,
        lengths: Any = "fixed") -> dict[str, Any]:
    sc = scenario_from_mapping({
        "model": model,
        # every strategy with the same hand-fused model code (the paper's stack, MindSpeed on
        # Ascend, fuses its pointwise kernels; Megatron's profiles fuse theirs by default): the
        # comparison is of the parallelism, not of eager vs fused kernels
        "training": {"global_batch_size": seqs_per_card * cards, "activation_recompute": recompute,
                     "fused_kernels": True, "sequence_lengths": lengths},
        "cluster": {"preset": "hzp-npu", "num_nodes": cards // 16},
        "strategy": strategy,
    })
    return run_choice(sc, sc.strategies[0])


def row(r: dict[str, Any]) -> str:
    b = r["memory_breakdown_bytes"]
    return (f"| {_label(r['strategy_resolved'])} | {r['tokens_per_s_per_device']:,.0f} | {r['mfu']:.1%} | "
            f"{r['peak_memory_bytes'] / 2**30:.1f} {'' if r['fits_in_memory'] else '(OOM)'} | "
            f"{r['exposed_comm_s']:.2f} / {r['step_time_s']:.2f} | {r['overlap_fraction'] or 0:.0%} | "
            f"{r['comm_bytes_per_device']['intra_node'] / 1e9:.0f} / {r['comm_bytes_per_device']['inter_node'] / 1e9:.0f} | "
            f"{(b['buffers'] + b['other']) / 2**30:.1f} |")


HEADER = ("| strategy | tokens/s/card | MFU | peak GiB | exposed / step s | overlap | intra / inter GB | buffers+other GiB |\n"
          "|---|---|---|---|---|---|---|---|")


def best_nd(model: str, cards: int, grid: list[dict]) -> dict[str, Any]:
    best = None
    for layout in grid:
        try:
            r = run(model, cards, {"name": "nd", "sequence_parallel": True, "zero_stage": 1, **layout})
        except ValueError:
            continue
        if r["fits_in_memory"] and (best is None or r["tokens_per_s"] > best["tokens_per_s"]):
            best = r
    assert best is not None
    return best


WEAK_SCALING = ({"name": "zero", "stage": 3}, {"name": "asynchzp"},
                {"name": "nd", "tp": 8, "pp": 4, "sequence_parallel": True, "zero_stage": 1})


def weak_scaling(dense: str) -> None:
    """256 -> 1,024 cards at 16K tokens per card per step, whole rows and then DCLM's document
    lengths packed with per-document masks, with and without length-aware balancing; then one
    16K-token row per card with long-tailed documents (lognormal, mean 4,096, sigma 1.5: a
    what-if, not a published distribution), where attention weighs more."""
    long_rows = {"preset": dense, "seq_len": 16384}
    for title, model, per_card, lengths in (
            ("", dense, 4, "fixed"),
            (", DCLM document lengths packed per document", dense, 4, {"lengths": DCLM_LENGTHS}),
            (", DCLM lengths, length-aware balancing", dense, 4,
             {"lengths": DCLM_LENGTHS, "balancing": "length_aware"}),
            (" as one 16K row, whole rows", long_rows, 1, "fixed"),
            (" as one 16K row, lognormal documents (mean 4,096, sigma 1.5; what-if)", long_rows, 1,
             {"distribution": "lognormal", "mean_tokens": 4096, "sigma": 1.5})):
        print(f"\n## weak scaling, {dense}, 16K tokens per card per step{title}\n")
        print("| strategy | 256 cards tokens/s/card | 1,024 cards tokens/s/card | linearity | 1,024: wait for longer documents s / step s |\n"
              "|---|---|---|---|---|")
        for strategy in WEAK_SCALING:
            small = run(model, 256, strategy, seqs_per_card=per_card, lengths=lengths)
            large = run(model, 1024, strategy, seqs_per_card=per_card, lengths=lengths)
            wait = large["time_breakdown_s"].get("wait.sequence_lengths", 0.0)
            print(f"| {_label(large['strategy_resolved'])} | {small['tokens_per_s_per_device']:,.0f} | "
                  f"{large['tokens_per_s_per_device']:,.0f} | "
                  f"{large['tokens_per_s_per_device'] / small['tokens_per_s_per_device']:.1%} | "
                  f"{wait:.2f} / {large['step_time_s']:.2f} |")


def main() -> int:
    start = time.perf_counter()
    dense = "llama2-70b"
    print(f"## {dense} on 1,024 hzp-npu cards, 16M tokens per step\n\n{HEADER}")
    for strategy in ({"name": "zero", "stage": 3},
                     {"name": "asynchzp", "param_group_size": 8, "grad_group_size": 8, "optim_group_size": 1024},
                     {"name": "asynchzp", "param_group_size": 8, "grad_group_size": 8, "optim_group_size": 1024,
                      "async": False},
                     {"name": "asynchzp", "adaptive": True}):
        print(row(run(dense, 1024, strategy)))
    grid = [{"tp": t, "pp": p, "vpp": v} for t in (4, 8) for p in (2, 4, 8) for v in (1, 2)]
    print(row(best_nd(dense, 1024, grid)))

    weak_scaling(dense)

    # MoE: Mixtral-8x7B (8 large experts, top-2) and a fine-grained MoE, Qwen3-30B-A3B (128 small
    # experts, top-8); EP exchanges by all-to-all (docs/moe.md), ND as NeMo runs it (megatron-bridge)
    for moe in ("mixtral-8x7b", "qwen3-30b-a3b"):
        print(f"\n## {moe} on 1,024 hzp-npu cards, 16M tokens per step\n\n{HEADER}")
        for strategy in ({"name": "zero", "stage": 3},
                         {"name": "asynchzp"},
                         {"name": "asynchzp", "ep": 8},
                         {"name": "asynchzp", "async": False, "ep": 8},
                         {"name": "asynchzp", "adaptive": True, "ep": 8}):
            print(row(run(moe, 1024, strategy)))
        grid = [{"tp": t, "pp": p, "ep": e, "implementation": "megatron-bridge"}
                for t in (1, 2, 4) for p in (1, 2, 4) for e in (4, 8)]
        print(row(best_nd(moe, 1024, grid)))
    print(f"\n(study took {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
