"""Simulator speed for ND parallelism (issue: ND).

    python benchmarks/bench_nd.py

GPT-3 175B, TP8 PP16, full recompute, micro-batch 1:
- 1,024 A100 (DP8) with 192 micro-batches per step (global batch 1536, SC'21 Table 1 shape);
  target: under 2 s;
- 12,288 A100 (DP96) with a 6,144-sequence batch (64 micro-batches per pipeline);
  target: under 5 s.
Also an interleaved (vpp=3) run of the first case.
"""

from __future__ import annotations

import sys
import time

from hzpsim.cli import run_choice
from hzpsim.scenario import scenario_from_mapping


def bench(nodes: int, gbs: int, strategy: dict) -> dict:
    scenario = scenario_from_mapping({
        "model": "gpt3-175b",
        "training": {"global_batch_size": gbs, "activation_recompute": "full"},
        "cluster": {"preset": "dgx-a100", "num_nodes": nodes},
        "strategy": strategy,
    })
    start = time.perf_counter()
    report = run_choice(scenario, scenario.strategies[0])
    return {"devices": nodes * 8, "wall_s": time.perf_counter() - start, **report}


def main() -> int:
    cases = [
        ("1,024 A100 TP8 PP16 DP8, m=192", 128, 1536, {"name": "nd", "tp": 8, "pp": 16}),
        ("1,024 A100 TP8 PP16 DP8 vpp=3, m=192", 128, 1536, {"name": "nd", "tp": 8, "pp": 16, "vpp": 3}),
        ("12,288 A100 TP8 PP16 DP96, m=64", 1536, 6144, {"name": "nd", "tp": 8, "pp": 16}),
    ]
    print(f"{'case':<40} {'wall s':>7} {'events':>8} {'events/s':>9} {'step s':>7} {'MFU':>6} {'bubble':>7}")
    for label, nodes, gbs, strategy in cases:
        r = bench(nodes, gbs, strategy)
        print(f"{label:<40} {r['wall_s']:>7.2f} {r['num_events']:>8} {r['num_events'] / r['sim_wall_s']:>9,.0f} "
              f"{r['step_time_s']:>7.2f} {r['mfu']:>6.1%} {r['bubble_fraction']:>7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
