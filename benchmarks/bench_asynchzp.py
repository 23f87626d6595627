"""Simulator speed for AsyncHZP (issue: AsyncHZP).

    python benchmarks/bench_asynchzp.py

- one AsyncHZP (island | island | N) step shape on 16,384 hzp-npu cards, Llama-2-70B, 16K tokens
  per card per step; target under 5 s;
- the adaptive search over every topology-aligned divisor chain on 1,024 cards; target under 30 s.
"""

from __future__ import annotations

import sys
import time

from hzpsim.run import choose
from hzpsim.scenario import scenario_from_mapping


def scenario(cards: int, strategy: dict):
    return scenario_from_mapping({
        "model": "llama2-70b",
        "training": {"global_batch_size": 4 * cards, "activation_recompute": "full"},
        "cluster": {"preset": "hzp-npu", "num_nodes": cards // 16},
        "strategy": strategy,
    })


def main() -> int:
    sc = scenario(16384, {"name": "asynchzp"})
    start = time.perf_counter()
    report, _ = choose(sc, sc.strategies[0])
    wall = time.perf_counter() - start
    print(f"asynchzp 8|8|16384 on 16,384 cards: wall {wall:.2f} s (target < 5), "
          f"{report['num_events']} events, step {report['step_time_s']:.2f} s, MFU {report['mfu']:.1%}")
    sc = scenario(1024, {"name": "asynchzp", "adaptive": True})
    start = time.perf_counter()
    report, rows = choose(sc, sc.strategies[0])
    wall = time.perf_counter() - start
    chosen = report["strategy_resolved"]
    print(f"adaptive search on 1,024 cards: {len(rows)} candidates in {wall:.1f} s (target < 30); chose "
          f"{chosen['param_group_size']}|{chosen['grad_group_size']}|{chosen['optim_group_size']}, "
          f"step {report['step_time_s']:.2f} s, peak {report['peak_memory_bytes'] / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
