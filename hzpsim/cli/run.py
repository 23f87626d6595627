"""``hzpsim run`` and ``hzpsim compare``: simulate a scenario's strategies side by side.

    hzpsim run                        # the built-in default scenario, every strategy side by side
    hzpsim run scenario.yaml --json   # one JSON object (DESIGN §5) per strategy
    hzpsim run --set model=llama3-8b --set cluster.num_nodes=2
    hzpsim compare scenario.yaml      # every entry of the scenario's `strategies:` list

``run --json`` prints one object when the scenario has one strategy, ``compare --json`` always
a list.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from hzpsim import strategies
from hzpsim.cli.options import (
    add_profile,
    add_scenario,
    check_plot_path,
    check_writable,
    scenario_overrides,
)
from hzpsim.config import ScenarioError
from hzpsim.report import chrome_trace, format_summary, to_json
from hzpsim.run import choose, format_decisions
from hzpsim.scenario import load_scenario

DEFAULT_NOTE = (
    "These are the built-in scenario's hand-picked layouts (each family at its usual settings, ND at\n"
    "Megatron's TP8 PP4), not the best of each family: `hzpsim search` finds those (it simulates\n"
    "dozens of layouts: minutes, not this quick default's seconds)."
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``run`` and ``compare``."""
    for name, help_text, handler in (
        ("run", "simulate a scenario (default: the built-in one)", _cmd_run),
        ("compare", "simulate every entry of a scenario's strategies list side by side", _cmd_compare),
    ):
        p = sub.add_parser(name, help=help_text)
        add_scenario(p)
        p.add_argument("--json", action="store_true", help="print the DESIGN §5 JSON contract")
        p.add_argument("--expand", action="store_true", help="simulate every device instead of one per equivalence class")
        p.add_argument("--explain", action="store_true",
                       help="print where each step goes and the decision table of adaptive choices")
        p.add_argument("--trace", metavar="FILE", help="write the reported step as a Chrome/Perfetto trace (one strategy)")
        p.add_argument("--plot", metavar="FILE", help="write a figure (PNG/SVG/PDF): the strategies compared; "
                       "with one strategy, its stream timeline and memory over the step")
        add_profile(p)
        p.set_defaults(handler=handler)


def format_table(reports: Sequence[dict[str, Any]]) -> str:
    header = (
        f"{'strategy':<40} {'step s':>9} {'tokens/s':>11} {'TFLOP/s/dev':>11} {'MFU':>6} "
        f"{'peak GiB':>9} {'fits':>5} {'exposed s':>9} {'overlap':>7} {'inter-node GB':>13}"
    )
    lines = [header, "-" * len(header)]
    for r in reports:
        overlap = "-" if r["overlap_fraction"] is None else f"{r['overlap_fraction']:.0%}"
        lines.append(
            f"{strategies.label(r['strategy_resolved']):<40} {r['step_time_s']:>9.3f} {r['tokens_per_s']:>11,.0f} "
            f"{r['tflops_per_device']:>11.1f} {r['mfu']:>6.1%} {r['peak_memory_bytes'] / 2**30:>9.1f} "
            f"{'yes' if r['fits_in_memory'] else 'NO':>5} {r['exposed_comm_s']:>9.3f} {overlap:>7} "
            f"{r['comm_bytes_per_device']['inter_node'] / 1e9:>13.1f}"
        )
    return "\n".join(lines)


def format_whole_run(reports: Sequence[dict[str, Any]]) -> str:
    """One line per strategy for the whole run, where ``total_tokens``, failures or checkpoints
    are set: days to train, device-hours, energy, goodput and cost ("" when none is)."""
    lines = []
    for r in reports:
        g, days = r.get("goodput"), r.get("time_to_train_s")
        if g is None and days is None:
            continue
        parts = []
        if days is not None:
            parts.append(f"{days / 86400:,.1f} days to train, {r['device_hours']:,.0f} device-hours"
                         + (f", {r['energy_kwh'] / 1000:,.0f} MWh" if r.get("energy_kwh") is not None else ""))
        if g is not None:
            interval = g["checkpoint_interval_s"]
            parts.append(f"goodput {g['fraction']:.1%} ({g['expected_interruptions_per_day']:.2f} interruptions/day, "
                         + ("no checkpoints" if interval is None else f"a checkpoint every {interval / 60:,.0f} min")
                         + ")")
        if r.get("cost") is not None:
            parts.append(f"cost {r['cost']:,.0f}")
        lines.append(f"{strategies.label(r['strategy_resolved']):<40} " + "; ".join(parts))
    return "\n".join(lines)


def format_intervals(reports: Sequence[dict[str, Any]]) -> str:
    """One line per strategy: its 80 % prediction interval of the step time and tokens/s
    (``step_time_interval_s``; "" when the profile records no held-out errors)."""
    lines = []
    for r in reports:
        basis = r.get("interval_basis")
        if not basis:
            continue
        lo, hi = r["step_time_interval_s"]
        tlo, thi = r["tokens_per_s_interval"]
        widened = "; widened: no published run calibrates this device" if basis["uncalibrated_device_widening"] else ""
        lines.append(f"{strategies.label(r['strategy_resolved']):<40} {r['step_time_s']:.3f} s ({lo:.3f}-{hi:.3f}), "
                     f"{tlo:,.0f}-{thi:,.0f} tokens/s: {basis['coverage']:.0%} interval from the held-out errors of "
                     f"{basis['num_rows']} published runs ({basis['num_sources']} sources, {basis['regime']}{widened})")
    return "\n".join(lines)


def format_breakdown(report: dict[str, Any]) -> str:
    """One line per place the critical rank's step goes (``time_breakdown_s``)."""
    step = report["step_time_s"]
    parts = [f"{key} {seconds:.2f} s ({seconds / step:.0%})"
             for key, seconds in sorted(report["time_breakdown_s"].items(), key=lambda kv: -kv[1])
             if seconds >= 0.001 * step]
    return "  where the step goes: " + ", ".join(parts)


def format_memory(report: dict[str, Any]) -> str:
    """Where the memory goes at the peak: allocated by category, reserved, outside PyTorch, room left."""
    gib = 2**30
    parts = [f"{key} {size / gib:.1f}" for key, size in sorted(report["memory_breakdown_bytes"].items(), key=lambda kv: -kv[1])
             if size >= 0.001 * report["peak_memory_allocated_bytes"]]
    fits = "fits" if report["fits_in_memory"] else "does NOT fit"
    return (f"  memory at the peak (GiB): allocated {report['peak_memory_allocated_bytes'] / gib:.1f} = "
            + " + ".join(parts)
            + f"; reserved {report['peak_memory_reserved_bytes'] / gib:.1f} (caching allocator); outside PyTorch "
            f"{report['device_overhead_bytes'] / gib:.1f}; headroom {report['memory_headroom_bytes'] / gib:.1f} "
            f"of {report['memory_capacity_bytes'] / gib:.1f}: {fits}")


def _cmd_run(args: argparse.Namespace) -> int:
    return _simulate(args, compare=False)


def _cmd_compare(args: argparse.Namespace) -> int:
    return _simulate(args, compare=True)


def _simulate(args: argparse.Namespace, compare: bool) -> int:
    scenario = load_scenario(args.scenario, scenario_overrides(args))
    if compare and len(scenario.strategies) < 2 and not args.json:
        print("note: the scenario has one strategy; give a `strategies:` list to compare several", file=sys.stderr)
    if args.trace:
        if len(scenario.strategies) != 1:
            raise ScenarioError(f"--trace {args.trace}: needs a scenario with one strategy (set strategy.name)")
        check_writable(args.trace, "--trace")
    if args.plot:
        check_plot_path(args.plot)
    traces: list = []
    results = [choose(scenario, choice, expand=args.expand, traces=traces) for choice in scenario.strategies]
    reports = [report for report, _ in results]
    if args.plot:
        from hzpsim import plots

        plots.save(plots.run_figure(reports, traces), args.plot)
    if args.explain:
        out = sys.stderr if args.json else sys.stdout
        budget_of = lambda c: scenario.topology.device.memory_bytes * (1 - getattr(c.config, "memory_reserve_fraction", 0.0))  # noqa: E731
        for choice, (report, rows) in zip(scenario.strategies, results):
            print(f"{strategies.label(report['strategy_resolved'])}:", file=out)
            print(format_breakdown(report), file=out)
            print(format_memory(report), file=out)
            if rows:
                print(format_decisions(rows, budget_of(choice)), file=out)
            print(file=out)
    if args.json:
        print(to_json(reports[0] if len(reports) == 1 and not compare else reports))
    else:
        print(format_summary(scenario))
        print()
        print(format_table(reports))
        ranges = format_intervals(reports)
        if ranges:
            print()
            print(ranges)
        whole = format_whole_run(reports)
        if whole:
            print(whole)
        if scenario.source == "<default>":
            print()
            print(DEFAULT_NOTE)
    if args.trace:
        try:
            with open(args.trace, "w", encoding="utf-8") as handle:
                json.dump(chrome_trace(traces[0]), handle)
        except OSError as exc:
            raise ScenarioError(f"--trace {args.trace}: cannot write it ({exc.strerror})") from None
    return 0
