"""Graph building, validation and report speed on GPT-3 175B / 1,024 A100 search candidates.

    python benchmarks/bench_build.py [--repeat N] [--profile]

For each candidate: CPU seconds (``time.process_time``, which a busy machine does not inflate)
of the strategy's ``build``, of ``OpGraph.validate``, of the engine (construction, whose
validation is included, and run) and of ``build_report``; the minimum of N runs. The search
(benchmarks/bench_search.py) spends these per simulated candidate. ``--profile`` prints a
cProfile of build + validate + report (the engine excluded) instead.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

from hzpsim import search as S
from hzpsim.report import build_report
from hzpsim.scenario import scenario_from_mapping
from hzpsim.sim.engine import Engine

SCENARIO = {
    "model": "gpt3-175b",
    "training": {"global_batch_size": 2048},
    "cluster": {"preset": "dgx-a100", "num_nodes": 128},
    "strategy": {"name": "zero", "stage": 3},
}

# (strategy fields, micro-batch size, activation recompute)
CANDIDATES = (
    ({"name": "nd", "tp": 4, "pp": 8, "vpp": 4, "zero_stage": 1, "sequence_parallel": True}, 1, "none"),
    ({"name": "nd", "tp": 2, "pp": 16, "vpp": 4, "zero_stage": 2, "sequence_parallel": True}, 1, "none"),
    ({"name": "nd", "tp": 8, "pp": 16, "vpp": 1, "zero_stage": 0, "sequence_parallel": False}, 1, "full"),
    ({"name": "nd", "tp": 8, "pp": 8, "vpp": 2, "zero_stage": 3, "sequence_parallel": True}, 1, "full"),
    ({"name": "zero", "stage": 3}, 1, "full"),
)


def candidate(fields: dict, micro_batch_size: int, recompute: str) -> S.Candidate:
    name = fields["name"]
    rest = {k: v for k, v in fields.items() if k != "name"}
    if name == "nd":
        rest = {"cp": 1, "ep": 1, **rest}
    return S.Candidate(name, tuple(sorted(rest.items())), micro_batch_size, recompute)


def phases(scenario, c: S.Candidate) -> dict[str, float]:
    """CPU seconds of each phase of one evaluation, and the graph's op count."""
    sc = S.variant(scenario, c)
    choice = sc.strategies[0]
    plugin = S.plugin_of(choice.name)
    out: dict[str, float] = {}
    t = time.process_time()
    graph = plugin.build(choice.config, sc.model, sc.training, sc.topology)
    out["build_s"] = time.process_time() - t
    t = time.process_time()
    graph.validate()
    out["validate_s"] = time.process_time() - t
    t = time.process_time()
    engine = Engine(graph, sc.topology)
    out["engine_init_s"] = time.process_time() - t
    t = time.process_time()
    trace = engine.run()
    out["engine_run_s"] = time.process_time() - t
    t = time.process_time()
    build_report(trace, sc.model, sc.training, choice.resolved())
    out["report_s"] = time.process_time() - t
    out["ops"] = len(graph.ops)
    return out


def profile(scenario, cands: list[S.Candidate]) -> None:
    prof = cProfile.Profile()
    for c in cands:
        sc = S.variant(scenario, c)
        choice = sc.strategies[0]
        plugin = S.plugin_of(choice.name)
        prof.enable()
        graph = plugin.build(choice.config, sc.model, sc.training, sc.topology)
        graph.validate()
        prof.disable()
        trace = Engine(graph, sc.topology).run()
        prof.enable()
        build_report(trace, sc.model, sc.training, choice.resolved())
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    scenario = scenario_from_mapping(SCENARIO)
    cands = [candidate(*spec) for spec in CANDIDATES]
    if args.profile:
        profile(scenario, cands)
        return 0
    keys = ("build_s", "validate_s", "engine_init_s", "engine_run_s", "report_s")
    print(f"{'candidate':<44} {'ops':>8} " + " ".join(f"{k:>13}" for k in keys) + "   (CPU s, min of runs)")
    totals = dict.fromkeys(keys, 0.0)
    for c in cands:
        runs = [phases(scenario, c) for _ in range(args.repeat)]
        best = {k: min(r[k] for r in runs) for k in keys}
        for k in keys:
            totals[k] += best[k]
        print(f"{c.label():<44} {runs[0]['ops']:>8,} " + " ".join(f"{best[k]:>13.3f}" for k in keys), flush=True)
    print(f"{'total':<44} {'':>8} " + " ".join(f"{totals[k]:>13.3f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
