"""The ``hzpsim`` command.

    hzpsim run                        # the built-in default scenario, every strategy side by side
    hzpsim run scenario.yaml --json   # one JSON object (DESIGN §5) per strategy
    hzpsim run --set model=llama3-8b --set cluster.num_nodes=2
    hzpsim compare scenario.yaml      # every entry of the scenario's `strategies:` list
    hzpsim list                       # devices, cluster presets, workloads, strategies
    hzpsim search scenario.yaml       # the best layout of every family (hzpsim.search)
    hzpsim regress goldens.yaml       # predictions against expected values (hzpsim.regress)

Exit codes: 0 ok; 2 invalid input (one line naming what and where); 3 simulator fault (the
engine stopped making progress: names the stuck op); 1 other internal error, or a prediction
that moved beyond its tolerance (``regress``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hzpsim import __version__, regress, search, strategies, validation
from hzpsim.cli import execute as executor_cli
from hzpsim.config import ScenarioError, key_of
from hzpsim.fitting import published as calibration_command
from hzpsim.hardware.devices import DEVICES
from hzpsim.model.ops import GraphError, SimulatorFault
from hzpsim.presets import list_presets
from hzpsim.report import chrome_trace, format_summary, to_json
from hzpsim.run import choose, format_decisions, run_choice
from hzpsim.scenario import Scenario, load_scenario

__all__ = ["main", "run_choice"]


def format_table(reports: Sequence[dict[str, Any]]) -> str:
    header = (
        f"{'strategy':<34} {'step s':>9} {'tokens/s':>11} {'TFLOP/s/dev':>11} {'MFU':>6} "
        f"{'peak GiB':>9} {'fits':>5} {'exposed s':>9} {'overlap':>7} {'inter-node GB':>13}"
    )
    lines = [header, "-" * len(header)]
    for r in reports:
        overlap = "-" if r["overlap_fraction"] is None else f"{r['overlap_fraction']:.0%}"
        lines.append(
            f"{strategies.label(r['strategy_resolved']):<34} {r['step_time_s']:>9.3f} {r['tokens_per_s']:>11,.0f} "
            f"{r['tflops_per_device']:>11.1f} {r['mfu']:>6.1%} {r['peak_memory_bytes'] / 2**30:>9.1f} "
            f"{'yes' if r['fits_in_memory'] else 'NO':>5} {r['exposed_comm_s']:>9.3f} {overlap:>7} "
            f"{r['comm_bytes_per_device']['inter_node'] / 1e9:>13.1f}"
        )
    return "\n".join(lines)


def format_breakdown(report: dict[str, Any]) -> str:
    """One line per place the critical rank's step goes (``time_breakdown_s``)."""
    step = report["step_time_s"]
    parts = [f"{key} {seconds:.2f} s ({seconds / step:.0%})"
             for key, seconds in sorted(report["time_breakdown_s"].items(), key=lambda kv: -kv[1])
             if seconds >= 0.001 * step]
    return "  where the step goes: " + ", ".join(parts)


def _cmd_run(args: argparse.Namespace, compare: bool) -> int:
    scenario = load_scenario(args.scenario, args.set or ())
    if compare and len(scenario.strategies) < 2 and not args.json:
        print("note: the scenario has one strategy; give a `strategies:` list to compare several", file=sys.stderr)
    if args.trace:
        if len(scenario.strategies) != 1:
            raise ScenarioError(f"--trace {args.trace}: needs a scenario with one strategy (set strategy.name)")
        check_writable(args.trace, "--trace")
    if args.plot:
        _check_plot_path(args.plot)
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
            if rows:
                print(format_decisions(rows, budget_of(choice)), file=out)
            print(file=out)
    if args.json:
        print(to_json(reports[0] if len(reports) == 1 and not compare else reports))
    else:
        print(format_summary(scenario))
        print()
        print(format_table(reports))
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


def check_writable(path: str, option: str) -> None:
    """ScenarioError naming ``option`` unless a file can be written at ``path`` (checked before
    any simulation, so that a bad path costs nothing)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ScenarioError(f"{option} {path}: is a directory, expected a file name")
    if not os.path.isdir(parent):
        raise ScenarioError(f"{option} {path}: folder {parent} does not exist")
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        raise ScenarioError(f"{option} {path}: not writable")


DEFAULT_NOTE = (
    "These are the built-in scenario's hand-picked layouts (each family at its usual settings, ND at\n"
    "Megatron's TP8 PP4), not the best of each family: `hzpsim search` finds those (it simulates\n"
    "dozens of layouts: minutes, not this quick default's seconds)."
)


def _positive_int(value: str | None, flag: str, default: int | None = None) -> int | None:
    """``--top 3`` -> 3; one-line ScenarioError for anything but a positive integer."""
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ScenarioError(f"{flag}: expected a positive integer, got {value!r}") from None
    if number < 1 or number > 10**9:
        raise ScenarioError(f"{flag}: expected a positive integer, got {value!r}")
    return number


def load_search_scenario(path: str | None, overrides: Sequence[str]) -> Scenario:
    """The scenario a search starts from: its model, training and cluster. Its strategies are
    ignored (the search supplies them), so a file need not have any, and one whose strategies do
    not fit this cluster still loads: a placeholder strategy stands in while it is validated."""
    from hzpsim.presets import read_yaml
    from hzpsim.scenario import DEFAULT_SCENARIO, scenario_from_mapping

    if path is None:
        document: Any = DEFAULT_SCENARIO
    else:
        if not os.path.isfile(path):
            raise ScenarioError(f"{path}: no such scenario file")
        document = read_yaml(Path(path)) or {}
    if not isinstance(document, dict):
        raise ScenarioError(f"{path}: a scenario must be a mapping")
    base = {k: v for k, v in document.items() if k not in ("strategy", "strategies")}
    kept = [o for o in overrides if not o.split("=", 1)[0].strip().startswith(("strategy.", "strategies."))]
    placeholders: list[Any] = [{"name": "ddp"}, {"name": "zero", "stage": 3}]
    placeholders += [{"name": "nd", "pp": p} for p in (2, 4, 8, 16, 32, 64)]
    first: ScenarioError | None = None
    for placeholder in placeholders:
        try:
            return scenario_from_mapping({**base, "strategy": placeholder}, kept, source=path or "<default>")
        except ScenarioError as exc:
            first = first or exc
            if str(exc).startswith(("model", "cluster", "--set", "name", "training.precision")):
                break
    assert first is not None
    raise first


def _cmd_search(args: argparse.Namespace) -> int:
    top = _positive_int(args.top, "--top", 5)
    max_evals = _positive_int(args.max_evals, "--max-evals")
    workers = _positive_int(args.workers, "--workers")
    families = search.parse_families(args.family)
    scenario = load_search_scenario(args.scenario, args.set or ())
    space = search.default_space(scenario)
    for text in args.space or ():
        space = space.replace(text)
    if args.plot:
        _check_plot_path(args.plot)
    runner = search.make_runner(args.dask, workers)
    try:
        result = search.search(scenario, families, top=top or 5, max_evals=max_evals, space=space, runner=runner,
                               progress=sys.stderr.isatty(), exhaustive=args.exhaustive)
    finally:
        runner.close()
    if args.plot:
        from hzpsim import plots

        plots.save(plots.search_landscape(result), args.plot)
    if args.json:
        print(to_json(result.to_json()))
    else:
        print(search.format_search(result, args.scenario))
    return 0


def _check_plot_path(path: str) -> None:
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".png", ".svg", ".pdf"):
        raise ScenarioError(f"--plot {path}: expected a .png, .svg or .pdf file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ScenarioError(f"--plot {path}: no such directory {folder}")


def _cmd_list(args: argparse.Namespace) -> int:
    what = args.what
    if what in (None, "devices"):
        print("devices:")
        for d in DEVICES.values():
            print(
                f"  {d.name:<11} {d.peak_bf16_flops_per_s / 1e12:7.1f} TFLOP/s bf16  "
                f"{d.memory_bytes / 1e9:6.1f} GB  {d.memory_bytes_per_s / 1e12:5.2f} TB/s  "
                f"(fabric: {d.default_cluster_preset})"
            )
    if what in (None, "presets", "topologies"):
        print("cluster presets: " + ", ".join(list_presets("topologies")))
    if what in (None, "workloads", "models"):
        print("workloads: " + ", ".join(list_presets("workloads")))
    if what is None:
        print("strategies: " + ", ".join(strategies.available()) + "  (hzpsim list strategies: their fields)")
    if what == "strategies":
        for name in strategies.available():
            plugin = strategies.get(name)
            summary = ((plugin.__doc__ or "").strip().splitlines() or ["(no module docstring)"])[0]
            print(f"{name}: {summary}")
            for f in dataclasses.fields(plugin.Config):
                default = f.default if f.default is not dataclasses.MISSING else "required"
                print(f"    {key_of(f)} = {json.dumps(default)}")
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hzpsim", description="Which parallelism strategy wins on your cluster, and why.")
    parser.add_argument("--version", action="version", version=f"hzpsim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("run", "simulate a scenario (default: the built-in one)"),
        ("compare", "simulate every entry of a scenario's strategies list side by side"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("scenario", nargs="?", help="scenario YAML file (omit for the built-in default)")
        p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a field, e.g. cluster.num_nodes=16")
        p.add_argument("--json", action="store_true", help="print the DESIGN §5 JSON contract")
        p.add_argument("--expand", action="store_true", help="simulate every device instead of one per equivalence class")
        p.add_argument("--explain", action="store_true",
                       help="print where each step goes and the decision table of adaptive choices")
        p.add_argument("--trace", metavar="FILE", help="write the reported step as a Chrome/Perfetto trace (one strategy)")
        p.add_argument("--plot", metavar="FILE", help="write a figure (PNG/SVG/PDF): the strategies compared; "
                       "with one strategy, its stream timeline and memory over the step")
        p.add_argument("--profile", dest="calibration_profile", metavar="FILE",
                       help="calibration profile JSON (default: the shipped fit)")
    p = sub.add_parser("search", help="search the whole strategy space for the best layout of each family")
    p.add_argument("scenario", nargs="?", help="scenario YAML file (omit for the built-in default)")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a field, e.g. cluster.num_nodes=16")
    p.add_argument("--family", action="append", metavar="NAME[,NAME]",
                   help="search only these strategies (repeatable; default: all of " + ", ".join(search.FAMILIES) + ")")
    p.add_argument("--top", default="5", metavar="N", help="how many of the best to list (default 5)")
    p.add_argument("--max-evals", metavar="N", help="simulate at most N candidates (the answer may then not be exact)")
    p.add_argument("--space", action="append", metavar="KEY=V1,V2",
                   help="restrict or widen a knob, e.g. tp=1,2,4,8 pp=1-16 micro_batch_size=1,2 "
                        "activation_recompute=full zero_stage=1")
    p.add_argument("--dask", metavar="ADDRESS", help="run the simulations on this Dask scheduler (tcp://host:8786)")
    p.add_argument("--workers", metavar="N", help="local worker processes (default: one per core; 1 = this process)")
    p.add_argument("--exhaustive", action="store_true", help="simulate every valid candidate (no pruning; slow)")
    p.add_argument("--profile", dest="calibration_profile", metavar="FILE",
                   help="calibration profile JSON (default: the shipped fit)")
    p.add_argument("--json", action="store_true", help="print one JSON document (docs/contract.md)")
    p.add_argument("--plot", metavar="FILE", help="write the search landscape (throughput vs memory) to FILE")
    p = sub.add_parser("regress", help="check predictions against a goldens file (exit 1 if one moved)")
    regress.add_arguments(p)
    p = sub.add_parser("validate", help="compare predictions with measured runs")
    what = p.add_subparsers(dest="target", required=True)
    published = what.add_parser("published", help="the published large runs in hzpsim/data/published_calibration.csv")
    validation.add_arguments(published)
    groups = executor_cli.register(sub, what)  # execute, calibrate machine, validate executor (needs torch)
    calibration_command.add_targets(groups["calibrate"])  # calibrate published, calibrate measured
    p = sub.add_parser("list", help="list devices, cluster presets, workloads and strategies")
    p.add_argument("what", nargs="?", choices=("devices", "presets", "topologies", "workloads", "models", "strategies"))
    return parser


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "list":
        return _cmd_list(args)
    if hasattr(args, "handler"):
        return int(args.handler(args))
    if args.command == "validate":
        return validation.run_from_args(args)
    if args.command == "search":
        return _cmd_search(args)
    if args.command == "regress":
        return regress.run_from_args(args)
    return _cmd_run(args, compare=args.command == "compare")


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        # --profile of run, compare, search and validate published (validate executor's
        # --profile is its machine profile, a different file); active for this command only
        with calibration_command.profile_option(getattr(args, "calibration_profile", None)):
            return _dispatch(args)
    except (ScenarioError, GraphError) as exc:
        print(f"hzpsim: error: {exc}", file=sys.stderr)
        return 2
    except SimulatorFault as exc:  # a valid scenario the engine could not finish: an hzpsim bug
        print(f"hzpsim: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `hzpsim run | head`: the reader left, nothing is wrong
        sys.stderr.close()
        return 0
    except Exception as exc:  # an hzpsim bug, not bad input
        if os.environ.get("HZPSIM_DEBUG"):
            raise
        print(f"hzpsim: internal error: {type(exc).__name__}: {exc} (set HZPSIM_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
