"""Choices made above the engine: adaptive group sizes, and running a scenario's strategies.

A strategy that can pick its own layout (AsyncHZP's ``adaptive: true``) offers candidates
(``candidates(config, model, training, topology)``); the planner simulates each, keeps those
whose peak memory leaves the stated reserve free, and picks the fastest (ties: smaller param
group, then larger optimizer group, as docs/strategies.md §1.4 suggests). Strategies never
simulate anything themselves.
"""

from __future__ import annotations

import math
from typing import Any

from hzpsim import strategies
from hzpsim.calibration import intervals
from hzpsim.config import to_mapping
from hzpsim.model.goodput import cluster_power, goodput, whole_run
from hzpsim.model.ops import OpGraph
from hzpsim.report import build_report
from hzpsim.scenario import Scenario, StrategyChoice
from hzpsim.sim.engine import Trace, simulate


def simulate_choice(scenario: Scenario, choice: StrategyChoice, expand: bool = False,
                    traces: list[Trace] | None = None) -> dict[str, Any]:
    """Build, simulate and report one fully specified strategy (the Trace is appended to
    ``traces`` when given, e.g. for a Chrome trace)."""
    topology = scenario.topology
    plugin = strategies.get(choice.name)
    graph = plugin.build(choice.config, scenario.model, scenario.training, topology, expand=expand)
    return report_of(scenario, choice, graph, traces)


def report_of(scenario: Scenario, choice: StrategyChoice, graph: OpGraph, traces: list[Trace] | None) -> dict[str, Any]:
    """Simulate a built graph of ``choice`` and report it (the Trace appended to ``traces``
    when given)."""
    trace = simulate(graph, scenario.topology)
    if traces is not None:
        traces.append(trace)
    report = build_report(trace, scenario.model, scenario.training, choice.resolved())
    report["training_resolved"] = training_resolved(scenario, choice)
    report.update(prediction_interval(scenario, report))
    report.update(plan_of(scenario, graph, report))
    return report


def training_resolved(scenario: Scenario, choice: StrategyChoice) -> dict[str, Any]:
    """The scenario's ``training`` as the strategy's implementation profile runs it (its kernel
    defaults applied: ``Implementation.training_for``, selective recompute's modules spelled
    out), every field."""
    training = strategies.training_as_simulated(choice.config, scenario.training, scenario.topology.device)
    return to_mapping(training.resolved_recompute())


def prediction_interval(scenario: Scenario, report: dict[str, Any]) -> dict[str, Any]:
    """The run's 80 % interval from the active profile's held-out errors in its regime
    (``calibration.intervals``): ``step_time_interval_s``, ``tokens_per_s_interval`` and
    ``interval_basis`` (each None when the profile records no held-out errors)."""
    resolved = report["strategy_resolved"]
    regimes = strategies.regimes(resolved["name"], str(resolved.get("implementation") or ""),
                                 scenario.model.moe is not None, int(resolved.get("cp") or 1), scenario.model.seq_len)
    found = intervals.interval(regimes, report["calibrated_device"], report["tokens_per_s"], report["step_time_s"])
    return found or {"step_time_interval_s": None, "tokens_per_s_interval": None, "interval_basis": None}


def plan_of(scenario: Scenario, graph: OpGraph, report: dict[str, Any]) -> dict[str, Any]:
    """The whole run around the step (``model/goodput.py``): ``goodput`` when failures or
    checkpoints are set (each rank saves the model states it holds: its parameters and
    optimizer states, the most any device holds), ``time_to_train_s``, ``device_hours``, ``cost``
    and ``energy_kwh`` when ``training.total_tokens`` is set, and ``average_power_w`` (the
    cluster's draw while training: ``goodput.cluster_power``)."""
    training, n = scenario.training, report["num_devices"]
    plan: dict[str, Any] = {"goodput": None}
    fraction = 1.0
    if training.failures is not None or training.checkpoint is not None:
        states = max(memory.get("params", 0.0) + memory.get("optimizer", 0.0)
                     for memory in graph.static_memory.values())
        plan["goodput"] = goodput(report["step_time_s"], n, states, training.failures, training.checkpoint)
        fraction = plan["goodput"]["fraction"]
    spec, device = scenario.topology.spec, scenario.topology.device
    power = cluster_power(n, spec.num_nodes, device.tdp_w, spec.device_power_limit_w,
                          report["stream_utilization"].get("compute", 0.0), spec.node_overhead_w, spec.pue)
    plan.update(whole_run(report["tokens_per_s"], n, training.total_tokens, fraction,
                          spec.price_per_device_hour, power))
    return plan


def effective_step_s(report: dict[str, Any]) -> float:
    """The step time a run sees on the wall: the step over the goodput fraction (the step
    itself without failures and checkpoints; infinite when the run never trains)."""
    g = report.get("goodput")
    if not g:
        return report["step_time_s"]
    return report["step_time_s"] / g["fraction"] if g["fraction"] > 0 else math.inf


def resolve(scenario: Scenario, name: str, config: Any) -> StrategyChoice:
    """The choice as simulated: the plugin's ``resolve`` fills its defaults in, and what its
    implementation profile decides is written in (``strategies.as_simulated``)."""
    plugin = strategies.get(name)
    if hasattr(plugin, "resolve"):
        config = plugin.resolve(config, scenario.topology)
    return StrategyChoice(name, strategies.as_simulated(config))


def choose(scenario: Scenario, choice: StrategyChoice, expand: bool = False,
           traces: list[Trace] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Simulate ``choice``; when it is adaptive, first simulate its candidates and keep the best.

    Returns the report and the decision table (empty when nothing was chosen); the chosen
    run's Trace is appended to ``traces`` when given."""
    plugin = strategies.get(choice.name)
    config = choice.config
    if not (getattr(config, "adaptive", False) and hasattr(plugin, "candidates")):
        return simulate_choice(scenario, resolve(scenario, choice.name, config), expand, traces), []
    reserve = getattr(config, "memory_reserve_fraction", 0.0)
    budget = scenario.topology.device.memory_bytes * (1 - reserve)
    rows: list[dict[str, Any]] = []
    for candidate in plugin.candidates(config, scenario.model, scenario.training, scenario.topology):
        resolved = resolve(scenario, choice.name, candidate)
        row: dict[str, Any] = {"config": resolved.resolved()}
        try:
            plugin.check(candidate, scenario.model, scenario.training, scenario.topology)
        except ValueError as exc:
            rows.append({**row, "rejected": str(exc)})
            continue
        graph = plugin.build(candidate, scenario.model, scenario.training, scenario.topology, expand=expand)
        states = max(sum(memory.values()) for memory in graph.static_memory.values())
        if states > budget:  # resident states alone do not fit: no need to simulate
            rows.append({**row, "rejected": f"resident states {states / 2**30:.1f} GiB exceed the budget",
                         "graph": graph, "states": states, "choice": resolved})
            continue
        kept: list[Trace] = []
        report = report_of(scenario, resolved, graph, kept if traces is not None else None)
        fits = report["fits_in_memory"] and report["peak_memory_bytes"] + report["device_overhead_bytes"] <= budget
        rows.append({**row, "report": report, "fits": fits, "trace": kept})
    runnable = [r for r in rows if "report" in r]
    if not runnable:  # nothing fits: simulate the candidate with the smallest resident states
        least = min((r for r in rows if "graph" in r), key=lambda r: r["states"])
        kept = []
        least["report"] = report_of(scenario, least["choice"], least["graph"], kept if traces is not None else None)
        least["fits"], least["trace"] = False, kept
        runnable = [least]
    for r in rows:
        r.pop("graph", None)
        r.pop("choice", None)
    fitting = [r for r in runnable if r["fits"]]

    def rank(r: dict[str, Any]) -> tuple:
        c = r["config"]
        return (r["report"]["step_time_s"], c.get("param_group_size", 0), -c.get("optim_group_size", 0))

    best = min(fitting, key=rank) if fitting else min(runnable, key=lambda r: r["report"]["peak_memory_bytes"])
    best["chosen"] = True
    if traces is not None:
        traces += best.pop("trace")
    for r in rows:
        r.pop("trace", None)
    report = dict(best["report"])
    report["strategy_resolved"] = {**best["config"], "adaptive": True}
    return report, rows


def run_choice(scenario: Scenario, choice: StrategyChoice, expand: bool = False) -> dict[str, Any]:
    """The DESIGN §5 report of one strategy of a scenario (adaptive choices resolved)."""
    return choose(scenario, choice, expand)[0]


def format_decisions(rows: list[dict[str, Any]], memory_budget_bytes: float) -> str:
    """The ``--explain`` table of an adaptive choice."""
    lines = [f"{'param|grad|optim':>18} {'step s':>9} {'peak GiB':>9} {'fits':>5}  note",
             f"{'':>18} {'':>9} {'budget':>9} {memory_budget_bytes / 2**30:>5.1f}"]
    for r in rows:
        c = r["config"]
        sizes = f"{c.get('param_group_size')}|{c.get('grad_group_size')}|{c.get('optim_group_size')}"
        if "report" not in r:
            lines.append(f"{sizes:>18} {'-':>9} {'-':>9} {'-':>5}  rejected: {r['rejected']}")
            continue
        rep = r["report"]
        note = "<- chosen" if r.get("chosen") else ""
        lines.append(f"{sizes:>18} {rep['step_time_s']:>9.3f} {rep['peak_memory_bytes'] / 2**30:>9.1f} "
                     f"{'yes' if r['fits'] else 'no':>5}  {note}")
    return "\n".join(lines)
