"""Regenerate the figures in docs/figures/ (shown in the README).

    python scripts/make_figures.py            # a few minutes on 2 cores (the GPT-3 search most of it)
    python scripts/make_figures.py --only search

Every figure comes from the package functions a notebook would call (hzpsim.search,
hzpsim.frames, hzpsim.plots); nothing here models anything.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402

from hzpsim import frames, plots  # noqa: E402
from hzpsim import search as S  # noqa: E402
from hzpsim.run import run_choice  # noqa: E402
from hzpsim.scenario import scenario_from_mapping  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "docs" / "figures"

# Llama-3-8B on 4 DGX A100 nodes: small enough to search in well under a minute.
BASE = {"model": "llama3-8b", "training": {"global_batch_size": 256},
        "cluster": {"preset": "dgx-a100", "num_nodes": 4}}


# The search showcase: GPT-3 175B on 1,024 A100, global batch 2,048 (benchmarks/bench_search.py).
GPT3 = {"model": "gpt3-175b", "training": {"global_batch_size": 2048},
        "cluster": {"preset": "dgx-a100", "num_nodes": 128}, "strategy": {"name": "zero", "stage": 3}}


def figure_search() -> list[dict]:
    scenario = scenario_from_mapping(GPT3)
    runner = S.make_runner(None, None)
    try:
        result = S.search(scenario, top=5, runner=runner)
    finally:
        runner.close()
    plots.save(plots.search_landscape(result), str(OUT / "search-landscape.png"))
    best = [r.report for f in result.families if (r := result.best_of(f)) is not None and r.report]
    plots.save(plots.comparison(best), str(OUT / "best-per-family.png"))
    return best


def figure_step() -> None:
    scenario = scenario_from_mapping({**BASE, "training": {"global_batch_size": 64, "activation_recompute": "selective"},
                                      "cluster": {"preset": "dgx-a100", "num_nodes": 2},
                                      "strategy": {"name": "nd", "tp": 2, "pp": 4, "sequence_parallel": True,
                                                   "zero_stage": 1}})
    report, trace = frames.simulate(scenario)
    plots.save(plots.run_figure([report], [trace]), str(OUT / "nd-step.png"))
    scenario = scenario_from_mapping({**BASE, "training": {"global_batch_size": 64},
                                      "cluster": {"preset": "hzp-npu", "num_nodes": 2},
                                      "strategy": {"name": "asynchzp"}})
    report, trace = frames.simulate(scenario)
    plots.save(plots.run_figure([report], [trace]), str(OUT / "asynchzp-step.png"))


def figure_bandwidth() -> None:
    """Where each family wins as the inter-node bandwidth per device shrinks."""
    rows = []
    strategies = [{"name": "zero", "stage": 3}, {"name": "nd", "tp": 8, "pp": 2, "sequence_parallel": True,
                                                  "zero_stage": 1},
                  {"name": "asynchzp", "adaptive": True}]
    for gbps in (3.125, 6.25, 12.5, 25, 50, 100):
        scenario = scenario_from_mapping({**BASE, "training": {"global_batch_size": 256, "activation_recompute": "full"},
                                          "cluster": {"preset": "dgx-a100", "num_nodes": 4,
                                                      "inter_node_bytes_per_s_per_device": gbps * 1e9},
                                          "strategies": strategies})
        for choice in scenario.strategies:
            report = run_choice(scenario, choice)
            rows.append({"inter_node_gb_per_s": gbps, "label": choice.name,
                         **frames.reports_frame([report]).iloc[0].drop("label").to_dict()})
    fig = plots.scaling(pd.DataFrame(rows), "inter_node_gb_per_s")
    ax = fig.axes[0]
    ax.set_xlabel("inter-node bandwidth per device (GB/s, one direction)")
    ax.set_title("Llama-3-8B, 32 A100, global batch 256: ZeRO-3 vs ND (TP8 PP2) vs AsyncHZP (adaptive)", fontsize=9)
    plots.save(fig, str(OUT / "bandwidth-sweep.png"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=("search", "step", "bandwidth"))
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "search"):
        figure_search()
    if args.only in (None, "step"):
        figure_step()
    if args.only in (None, "bandwidth"):
        figure_bandwidth()
    print(f"figures written to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
