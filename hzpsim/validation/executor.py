"""``hzpsim validate executor``: run the real-torch executor and the simulator on the same scenario.

For each strategy the executor runs (``hzpsim.executor``, which never imports ``hzpsim.sim``)
this module builds the simulator's program for the same model, batch, layout and world size on
the ``local-cpu`` preset (optionally with a ``hzpsim calibrate machine`` profile) and compares:

- collective counts and bytes per kind for one step, summed over all ranks: the simulator's
  collective ops of its reported step, each counted once per participating rank (the graph is
  built with every rank expanded; a send counts on its sender);
- model-state bytes (params + grads + optimizer) summed over all ranks: the simulator's static
  memory of every rank;
- step time (simulated ``step_time_s`` vs the slowest rank's median), peak memory (the
  simulator's worst rank vs the executor's largest rank) and the loss against the
  single-process reference.

Run it::

    hzpsim validate executor --world 4 --json
    hzpsim validate executor --world 2 --strategies 'zero(stage=3),hsdp'
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any

import yaml

from hzpsim import strategies
from hzpsim.config import ScenarioError, from_mapping, to_mapping
from hzpsim.executor.spec import (
    IMPLEMENTATIONS,
    SIMULATOR_STRATEGIES,
    VALIDATION_STRATEGIES,
    fit_world,
)
from hzpsim.hardware.devices import for_gemms, gemm_sweep, with_measurements
from hzpsim.model.ops import COLLECTIVE, COLLECTIVE_KINDS
from hzpsim.scenario import Scenario, StrategyChoice, gemm_shapes, scenario_from_mapping

#: The validation scenario (also ``examples/executor-world4.yaml``): a small Llama-style model in
#: fp32 on the local CPU box; strategies for world size 4 (the CLI adapts the sizes to --world).
DEFAULT_SCENARIO: dict[str, Any] = {
    "name": "executor-validation",
    "model": {"name": "exec-small", "num_layers": 4, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2,
              "ffn_hidden_size": 352, "vocab_size": 512, "seq_len": 64, "dropout": False},
    "training": {"global_batch_size": 8, "micro_batch_size": 1, "precision": "fp32", "grad_dtype": "fp32",
                 "activation_recompute": "none"},
    "cluster": {"preset": "local-cpu"},
    "strategies": [dict(entry) for entry in VALIDATION_STRATEGIES],
}


def split_strategy_filters(text: str) -> list[str]:
    """``--strategies`` split at the commas outside parentheses:
    ``"zero(stage=2),nd(tp=2,pp=2),hsdp"`` -> ``["zero(stage=2)", "nd(tp=2,pp=2)", "hsdp"]``."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth <= 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def parse_strategy_filter(text: str) -> tuple[str, dict[str, Any]]:
    """One ``--strategies`` entry, ``NAME`` or ``NAME(FIELD=VALUE,...)`` as the run tables label
    a strategy (``zero(stage=2)``), as (name, {scenario key: typed value}). NAME is one of the
    simulator's strategies the executor runs; a field is one of the strategy's scenario keys.
    ScenarioError (exit 2) naming the bad value otherwise."""
    found = re.fullmatch(r"([A-Za-z_]\w*)(?:\((.*)\))?", text.strip(), re.S)
    if found is None:
        raise ScenarioError(f"--strategies: {text!r} is not NAME or NAME(FIELD=VALUE,...)")
    name, inner = found.group(1), found.group(2)
    if name not in SIMULATOR_STRATEGIES:
        raise ScenarioError(f"--strategies: unknown {name!r} (known: {', '.join(SIMULATOR_STRATEGIES)}; "
                            "a field filter is written name(field=value,...), e.g. zero(stage=2))")
    plugin = strategies.get(name)
    keys = list(to_mapping(plugin.Config()))
    raw: dict[str, Any] = {}
    for part in (inner or "").split(","):
        if not part.strip() and inner is not None and inner.strip():
            raise ScenarioError(f"--strategies: {text!r}: empty field")
        if not part.strip():
            continue
        key, sep, value = (x.strip() for x in part.partition("="))
        if not sep or key not in keys:
            raise ScenarioError(f"--strategies: {text!r}: {name} has no field {key!r} (fields: {', '.join(keys)})")
        raw[key] = yaml.safe_load(value) if value else ""
    typed = to_mapping(from_mapping(plugin.Config, raw, f"--strategies {name}"))
    return name, {key: typed[key] for key in raw}


def parse_strategy_filters(text: str) -> list[str]:
    """``--strategies``: the filters, each checked by :func:`parse_strategy_filter`."""
    filters = split_strategy_filters(text)
    for f in filters:
        parse_strategy_filter(f)
    return filters

_PROFILE_CLUSTER_KEYS = ("intra_node_bytes_per_s", "inter_node_bytes_per_s_per_device", "intra_node_latency_s",
                         "inter_node_latency_s", "intra_node_efficiency", "inter_node_efficiency")


def load_profile(path: str | None) -> dict[str, Any]:
    """A ``hzpsim calibrate machine`` profile ({device, cluster, measurements}), or {}: the one
    profile format (``hzpsim.calibration.profile``), whose ``device`` is the path of the device
    file the calibration wrote (relative to the profile) or, in profiles written before devices
    were files, a mapping of measured device fields."""
    if path is None:
        return {}
    from hzpsim.calibration.profile import load

    try:
        return load(path).machine()
    except ValueError as exc:
        raise ScenarioError(f"--profile {exc}") from None


def scenario_for_world(raw: dict[str, Any], world: int, profile: dict[str, Any], comm_delay_s: float = 0.0,
                       filters: Sequence[str] = ()) -> Scenario:
    """The simulator's scenario: ``raw`` on one local-cpu node of ``world`` devices, with the
    profile's fabric numbers and device (latency + the executor's artificial per-call delay).

    A profile that names a device file puts its path in ``cluster.device``: the scenario then
    reads the measured device (its GEMM sweep gives the model's GEMM rate at load), and
    ``hzpsim run`` on the scenario alone predicts what this command predicts. A profile with
    the old inline device fields is applied to ``cpu-local`` here instead."""
    data = copy.deepcopy(raw)
    cluster = dict(data.get("cluster") or {})
    cluster.update({"preset": cluster.get("preset", "local-cpu"), "gpus_per_node": world, "num_nodes": 1})
    for key in _PROFILE_CLUSTER_KEYS:
        if key in profile.get("cluster", {}):
            cluster[key] = float(profile["cluster"][key])
    device = profile.get("device")
    if isinstance(device, str):
        cluster["device"] = device
    data["cluster"] = cluster
    entries = data.get("strategies") or [data.get("strategy")]
    data.pop("strategy", None)
    data["strategies"] = [_executor_implementation(fit_world(dict(e), world))
                          for e in entries if _selected(dict(e), filters)]
    if not data["strategies"]:
        raise ScenarioError(f"--strategies {','.join(filters)}: no strategy of the scenario matches")
    scenario = scenario_from_mapping(data, source=str(raw.get("name", "<executor>")))
    topology = scenario.topology
    if isinstance(device, dict) and device:
        try:
            measured = with_measurements(topology.device, device)
        except ValueError as exc:
            raise ScenarioError(f"--profile {exc}") from None
        gemm = profile.get("measurements", {}).get("gemm")
        if gemm:
            measured = dataclasses.replace(measured, gemm_sweep=gemm_sweep(gemm))
        topology.device = for_gemms(measured, gemm_shapes(scenario.model, scenario.training.micro_batch_size))
    if comm_delay_s and topology.device.node_cpu_cores:
        # with a CPU pool a host op is CPU work, and a sleep is not: the delay joins each call's
        # wait instead (paid by the call, not by the thread that issues it)
        table = topology.device.collective_costs
        topology.device = dataclasses.replace(topology.device, collective_costs=tuple(
            (k, g, latency + comm_delay_s, b) for k, g, latency, b in table))
    elif comm_delay_s:
        # the executor sleeps in the thread that issues each collective: a per-call host cost
        call_s = topology.device.collective_call_s or 0.0
        topology.device = dataclasses.replace(topology.device, collective_call_s=call_s + comm_delay_s)
    return scenario


#: The implementation profile of what the executor runs for each strategy (the executor's table).
EXECUTOR_IMPLEMENTATIONS = IMPLEMENTATIONS


def _executor_implementation(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` with the implementation the executor runs (unless the scenario names one)."""
    if entry.get("name") in EXECUTOR_IMPLEMENTATIONS:
        entry.setdefault("implementation", EXECUTOR_IMPLEMENTATIONS[entry["name"]])
    return entry


def _selected(entry: dict[str, Any], filters: Sequence[str]) -> bool:
    """Whether the scenario entry ``entry`` matches one of ``filters`` (a field the entry does
    not set has the strategy's default)."""
    if not filters:
        return True
    for f in filters:
        name, fields = parse_strategy_filter(f)
        if entry.get("name") != name:
            continue
        given = {k: v for k, v in entry.items() if k != "name"}
        config = to_mapping(from_mapping(strategies.get(name).Config, given, "strategy"))
        if all(config[k] == v for k, v in fields.items()):
            return True
    return False


# ---------------------------------------------------------------------------------- simulator side


def predicted_collectives(scenario: Scenario, choice: StrategyChoice) -> dict[str, dict[str, int]]:
    """Counts and bytes per kind of the simulator's reported step, summed over all ranks."""
    plugin = strategies.get(choice.name)
    config = plugin.resolve(choice.config, scenario.topology) if hasattr(plugin, "resolve") else choice.config
    graph = plugin.build(config, scenario.model, scenario.training, scenario.topology, expand=True)
    step = scenario.training.num_steps - 1
    counts = dict.fromkeys(COLLECTIVE_KINDS, 0)
    sizes = dict.fromkeys(COLLECTIVE_KINDS, 0)
    for op in graph.ops:
        if op.kind != COLLECTIVE or op.step != step or op.collective not in counts:
            continue
        calls = len(op.ranks) * op.count
        counts[op.collective] += calls
        sizes[op.collective] += int(round(op.size_bytes * calls))
    states = 0.0
    for memory in graph.static_memory.values():
        states += sum(memory.get(k, 0.0) for k in ("params", "grads", "optimizer"))
    return {"counts": counts, "bytes": sizes, "model_state_bytes": {"total": int(round(states))}}


def predicted_report(scenario: Scenario, choice: StrategyChoice) -> dict[str, Any]:
    from hzpsim.run import run_choice

    return run_choice(scenario, choice)


# ---------------------------------------------------------------------------------- comparison


def compare(scenario: Scenario, world: int, *, num_steps: int = 6, comm_delay_s: float = 0.0,
            threads_per_rank: int = 1, timeout_s: float = 900.0, measure_memory: bool = True,
            calibration_sharing: float | None = None) -> list[dict[str, Any]]:
    """Run every strategy of ``scenario`` on the executor and the simulator; one row each.

    ``calibration_sharing``: the profile's sharing factor (``measurements.sharing_factor``).
    With it the executor measures the same factor right before and after each strategy's steps
    and the step is also predicted at that load (:func:`at_load`): on a machine shared with
    other jobs the cores a rank gets change between the calibration and the run."""
    from hzpsim.executor.runner import max_loss_diff, reference_losses, run_many
    from hzpsim.executor.spec import run_specs

    specs = run_specs(scenario, world, num_steps=num_steps, comm_delay_s=comm_delay_s,
                      threads_per_rank=threads_per_rank, measure_memory=measure_memory,
                      measure_sharing=calibration_sharing is not None)
    rows = []
    results = run_many(specs, timeout_s=timeout_s)
    calibrated = scenario.topology.device
    for spec, choice, measured in zip(specs, scenario.strategies, results):
        reference = reference_losses(spec)
        predicted = predicted_collectives(scenario, choice)
        report = predicted_report(scenario, choice)
        row_report = dict(report)
        run_sharing = getattr(measured, "sharing_factor", None)
        if calibration_sharing and run_sharing:
            scenario.topology.device = at_load(calibrated, run_sharing / calibration_sharing)
            try:
                row_report["step_time_s"] = predicted_report(scenario, choice)["step_time_s"]
            finally:
                scenario.topology.device = calibrated
        row = _row(scenario, choice, spec, measured, predicted, row_report, max_loss_diff(measured, reference))
        row.update(predicted_step_time_at_calibration_load_s=report["step_time_s"],
                   sharing_factor_calibration=calibration_sharing, sharing_factor_run=run_sharing)
        rows.append(row)
    return rows


def at_load(device, factor: float):
    """``device`` when the ranks get 1/``factor`` of the cores they had when it was calibrated
    (the ratio of the run's and the calibration's sharing factors). With a CPU pool that is a
    pool of 1/``factor`` the cores (every cost stays a CPU cost alone on a core); without one,
    every CPU cost takes ``factor`` times as long: on a CPU all of it is CPU work (kernels, host
    dispatch, the frameworks' Python, and gloo's copies, TCP loopback and wake-ups)."""
    return device.scaled_costs(factor)


def scenario_mapping(scenario: Scenario, resolved: dict[str, Any]) -> dict[str, Any]:
    """``scenario`` with the one strategy ``resolved`` as a scenario mapping ``hzpsim run``
    accepts: the resolved model, training and fabric, the device by name or by the path of its
    device file (re-read at load, as this command read it)."""
    mapping = {
        "model": dataclasses.asdict(scenario.model),
        "training": dataclasses.asdict(scenario.training),
        # the resolved fabric, as scenario keys; a device without a TDP resolves its power
        # limit to 0.0, which a scenario cannot state
        "cluster": {k: v for k, v in dataclasses.asdict(scenario.cluster).items()
                    if v is not None and k != "device_spec" and not (k == "device_power_limit_w" and not v)},
        "strategy": resolved,
    }
    mapping["model"]["moe"] = mapping["model"]["moe"] if scenario.model.moe else None
    return _plain(mapping)


def _row(scenario: Scenario, choice: StrategyChoice, spec, measured, predicted: dict[str, Any],
         report: dict[str, Any], loss_diff: float) -> dict[str, Any]:
    mapping = scenario_mapping(scenario, report["strategy_resolved"])
    row = {
        "strategy": spec.strategy,
        "label": spec.label,
        "world_size": spec.world_size,
        "measured_step_time_s": measured.step_time_s,
        "predicted_step_time_s": report["step_time_s"],
        "measured_comm_bytes": measured.comm_bytes,
        "predicted_comm_bytes": predicted["bytes"],
        "measured_collective_counts": measured.collective_counts,
        "predicted_collective_counts": predicted["counts"],
        "measured_model_state_bytes": measured.model_state_bytes,
        "predicted_model_state_bytes": predicted["model_state_bytes"]["total"],
        "measured_peak_memory_bytes": measured.peak_memory_bytes,
        "predicted_peak_memory_bytes": report["peak_memory_bytes"],
        "loss_max_abs_diff_vs_reference": loss_diff,
        "scenario": _plain(mapping),
        # the device simulated: its file (the scenario's cluster.device) and the rates it ran at
        "device": _plain({k: getattr(scenario.topology.device, k) for k in (
            "name", "path", "peak_fp32_flops_per_s", "memory_bytes_per_s")}),
        "measured_model_state_breakdown_bytes": measured.model_state_breakdown_bytes,
        "measured_other_collective_counts": measured.other_collective_counts,
        "counting_complete": measured.counting_complete,
        # CPU accounting of the measured steps (medians after warm-up): every rank's process CPU
        # summed, and the whole machine's busy CPU (the other ranks' and anything else running)
        "measured_cpu_s_per_step": _median_after_warmup(measured, "cpu_times_s", sum),
        "measured_machine_busy_s_per_step": _median_after_warmup(measured, "machine_busy_cpu_s", max),
        "peak_memory_method": measured.peak_memory_method,
        "losses": measured.losses,
    }
    row["differences"] = differences(row)
    return row


def _median_after_warmup(measured, key: str, combine) -> float | None:
    """Median over the measured steps of ``combine`` over ranks of each rank's per-step ``key``."""
    import statistics

    ranks = [r for r in getattr(measured, "ranks", []) if key in r]
    if not ranks:
        return None
    skip = measured.spec.warmup_steps
    steps = min(len(r[key]) for r in ranks)
    values = [combine(r[key][k] for r in ranks) for k in range(skip, steps)]
    return statistics.median(values) if values else None


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def differences(row: dict[str, Any]) -> list[str]:
    """Where executor and simulator disagree on counts, bytes or model states, in words."""
    out = []
    for key in ("collective_counts", "comm_bytes"):
        m, p = row[f"measured_{key}"], row[f"predicted_{key}"]
        for kind in COLLECTIVE_KINDS:
            if m[kind] != p[kind]:
                out.append(f"{key}.{kind}: measured {m[kind]}, predicted {p[kind]}")
    if row["measured_model_state_bytes"] != row["predicted_model_state_bytes"]:
        out.append(f"model_state_bytes: measured {row['measured_model_state_bytes']}, "
                   f"predicted {row['predicted_model_state_bytes']}")
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (f"{'strategy':<40} {'step s meas':>11} {'pred':>8} {'err':>6} {'pred@cal':>8} {'S cal/run':>9} "
              f"{'counts':>7} {'bytes':>6} {'states':>7} {'peak MiB meas':>13} {'pred':>7} {'loss diff':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        err = r["predicted_step_time_s"] / r["measured_step_time_s"] - 1 if r["measured_step_time_s"] else math.nan
        same = lambda key, r=r: "equal" if r[f"measured_{key}"] == r[f"predicted_{key}"] else "DIFF"  # noqa: E731
        lines.append(
            f"{r['label'][:40]:<40} {r['measured_step_time_s']:>11.4f} {r['predicted_step_time_s']:>8.4f} {err:>+6.0%} "
            f"{r.get('predicted_step_time_at_calibration_load_s', r['predicted_step_time_s']):>8.4f} "
            f"{_sharing(r):>9} {same('collective_counts'):>7} {same('comm_bytes'):>6} {same('model_state_bytes'):>7} "
            f"{r['measured_peak_memory_bytes'] / 2**20:>13.1f} {r['predicted_peak_memory_bytes'] / 2**20:>7.1f} "
            f"{r['loss_max_abs_diff_vs_reference']:>9.1e}")
        for d in r["differences"]:
            lines.append(f"    {d}")
    return "\n".join(lines)


def _sharing(row: dict[str, Any]) -> str:
    cal, run = row.get("sharing_factor_calibration"), row.get("sharing_factor_run")
    return f"{cal:.2f}/{run:.2f}" if cal and run else "-"
