"""Simulator speed: Llama-2-70B ZeRO-3 on 64, 1,024 and 16,384 H100s (issue: engine + ZeRO).

    python benchmarks/bench_engine.py            # prints one line per size

Weak scaling: 4 micro-batches of 1 sequence per device per step, so every size simulates the
same per-device program; thanks to symmetry the simulated work should not grow with devices.
Targets: 16,384 devices under 5 s on the 2-core CI machine and at most 3x the 64-device time.
"""

from __future__ import annotations

import sys
import time

from hzpsim.cli import run_choice
from hzpsim.scenario import scenario_from_mapping

SIZES = (64, 1024, 16384)


def bench(num_devices: int, strategy: dict, model: str = "llama2-70b", per_device_batch: int = 4) -> dict:
    scenario = scenario_from_mapping(
        {
            "model": model,
            "training": {"global_batch_size": per_device_batch * num_devices, "activation_recompute": "full"},
            "cluster": {"preset": "dgx-h100", "num_nodes": num_devices // 8},
            "strategy": strategy,
        }
    )
    start = time.perf_counter()
    report = run_choice(scenario, scenario.strategies[0])
    wall = time.perf_counter() - start
    return {"devices": num_devices, "wall_s": wall, "sim_wall_s": report["sim_wall_s"],
            "events": report["num_events"], "step_time_s": report["step_time_s"], "mfu": report["mfu"]}


def main() -> int:
    strategy = {"name": "zero", "stage": 3}
    rows = [bench(n, strategy) for n in SIZES]
    print(f"{'devices':>8} {'wall s':>8} {'engine s':>9} {'events':>8} {'events/s':>10} {'step s':>8} {'MFU':>6}")
    for r in rows:
        print(f"{r['devices']:>8} {r['wall_s']:>8.2f} {r['sim_wall_s']:>9.2f} {r['events']:>8} "
              f"{r['events'] / r['sim_wall_s']:>10,.0f} {r['step_time_s']:>8.2f} {r['mfu']:>6.1%}")
    ratio = rows[-1]["wall_s"] / rows[0]["wall_s"]
    print(f"16,384 / 64 wall-time ratio: {ratio:.2f} (target <= 3); 16,384 wall {rows[-1]['wall_s']:.2f} s (target < 5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
