"""Scenario loading: presets, ``--set`` overrides, defaults and validation (DESIGN §5).

A scenario is ``model`` x ``training`` x ``cluster`` x ``strategy`` (or a ``strategies:`` list
for side-by-side comparison). ``model`` and ``cluster`` may be preset names or mappings that
start from a ``preset`` and override fields; ``model`` may also name a Hugging Face
``config.json`` (:mod:`hzpsim.model.hf_config`). Every error is a :class:`ScenarioError` whose
message names the key path; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hzpsim import strategies
from hzpsim.config import ScenarioError, from_mapping, to_mapping
from hzpsim.hardware.devices import for_gemms
from hzpsim.hardware.topology import ClusterSpec, ResolvedCluster, Topology
from hzpsim.model import Model
from hzpsim.model.checkpointing import check_modules
from hzpsim.model.hf_config import is_config_path, model_fields
from hzpsim.model.training import Training
from hzpsim.presets import listing_once, load_preset, read_yaml


@dataclass(frozen=True)
class StrategyChoice:
    """One strategy of a scenario: its plugin name and typed config."""

    name: str
    config: Any

    def resolved(self) -> dict[str, Any]:
        return {"name": self.name, **to_mapping(self.config)}


@dataclass(frozen=True)
class Scenario:
    model: Model
    training: Training
    cluster: ResolvedCluster  # the scenario's ClusterSpec with the preset applied
    strategies: tuple[StrategyChoice, ...]
    source: str = "<mapping>"

    @functools.cached_property
    def topology(self) -> Topology:
        """Built once per scenario (the planner asks for it for every candidate)."""
        topology = Topology(self.cluster)
        if topology.device.gemm_sweep:  # a measured machine: its rate for this model's GEMMs
            topology.device = for_gemms(topology.device, gemm_shapes(self.model, self.training.micro_batch_size))
        return topology


def gemm_shapes(model: Model, micro_batch_size: int) -> list[tuple[float, float, float]]:
    """(m, k, n) of every GEMM of one micro-batch's forward and backward on one rank without
    tensor parallelism: per weight (k_in x n_out) the forward (tokens, k, n), the input
    gradient (tokens, n, k) and the weight gradient (k, tokens, n)."""
    tokens = micro_batch_size * model.seq_len
    h, d = model.hidden_size, model.head_dim_resolved
    weights = [(h, model.num_heads * d), (h, model.kv_heads * d), (h, model.kv_heads * d), (model.num_heads * d, h)]
    ffn = model.ffn_hidden_size
    weights += [(h, ffn)] * (2 if model.mlp == "swiglu" else 1) + [(ffn, h)]
    shapes = [s for _ in range(model.num_layers) for k, n in weights
              for s in ((tokens, k, n), (tokens, n, k), (k, tokens, n))]
    k, n = h, model.vocab_size
    shapes += [(tokens, k, n), (tokens, n, k), (k, tokens, n)]
    return [(float(m), float(k), float(n)) for m, k, n in shapes]


DEFAULT_SCENARIO: dict[str, Any] = {
    "model": "llama2-70b",
    "training": {
        "global_batch_size": 1024,
        "micro_batch_size": 1,
        "activation_recompute": "full",
    },
    "cluster": {"preset": "dgx-h100", "num_nodes": 8},
    # every plugin's DEFAULT_RUNS, by ORDER: ZeRO 1/2/3, HSDP, ND (tp 8, pp 4), AsyncHZP (+ adaptive)
    "strategies": strategies.default_runs(),
}

_TOP_KEYS = ("name", "model", "training", "cluster", "strategy", "strategies")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=c`` -> (["a", "b"], parsed c). Values are YAML scalars or flow collections."""
    if "=" not in text:
        raise ScenarioError(f"--set {text!r}: expected KEY.PATH=VALUE")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in parts):
        raise ScenarioError(f"--set {text!r}: empty key path")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError, RecursionError):
        # not YAML (or e.g. a date-like "2020-13-45" PyYAML cannot construct): the raw string
        value = raw
    return parts, value


def _apply_override(data: dict[str, Any], parts: list[str], value: Any, text: str) -> None:
    if parts[0] == "strategy" and "strategies" in data:
        raise ScenarioError(
            f"--set {text}: the scenario has a 'strategies' list; use strategies.N.{'.'.join(parts[1:])} "
            "(or set strategy.name to run one strategy instead)"
        )
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ScenarioError(f"--set {text}: {where}: no list entry {part}")
            child = node[int(part)]
            if isinstance(child, str) and depth == 1 and parts[0] == "strategies":
                child = node[int(part)] = {"name": child}
            if not isinstance(child, dict):
                raise ScenarioError(f"--set {text}: {where} is not a mapping")
            node = child
            continue
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif isinstance(child, str) and depth == 0 and part in ("model", "cluster"):
            child = node[part] = {"preset": child}
        elif isinstance(child, str) and depth == 0 and part == "strategy":
            child = node[part] = {"name": child}
        elif not isinstance(child, dict | list):
            raise ScenarioError(f"--set {text}: {where} is {child!r}, not a mapping")
        node = child
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ScenarioError(f"--set {text}: no list entry {last}")
        node[int(last)] = value
    else:
        node[last] = value


def _model_preset(raw: Any) -> Any:
    """The preset name or config path a scenario's ``model`` starts from (None: none)."""
    if isinstance(raw, Mapping):
        return raw.get("preset")
    return raw


def _model_mapping(raw: Any, base_dir: Path | None = None) -> dict[str, Any]:
    """``model`` as Model fields: a preset name, the path of a Hugging Face config.json (or its
    folder; relative to ``base_dir``, the scenario file's folder, when given), or a mapping
    that may start from either with ``preset:``."""
    if raw is None:
        raise ScenarioError("model: required (a preset name, a config.json path or a mapping)")
    if isinstance(raw, str):
        raw = {"preset": raw}
    if not isinstance(raw, Mapping):
        raise ScenarioError(f"model: expected a preset name, a config.json path or a mapping, got {raw!r}")
    data = dict(raw)
    preset = data.pop("preset", None)
    if preset is not None:
        if not isinstance(preset, str):
            raise ScenarioError("model.preset: expected a preset name or a config.json path")
        if is_config_path(preset):
            path = Path(preset).expanduser()
            if base_dir is not None and not path.is_absolute():
                path = base_dir / path
            base = model_fields(path, "model")
        else:
            base = load_preset("workloads", preset, "model.preset")
        for block in ("moe", "mla"):  # a nested block given next to the preset overrides its fields
            if isinstance(base.get(block), dict) and isinstance(data.get(block), dict):
                data[block] = {**base[block], **data[block]}
        data = {**base, **data}
    return data


def _cluster_mapping(raw: Any) -> dict[str, Any]:
    """A preset name becomes ``{preset: name}``; fields left out come from the preset (or the
    device's usual fabric) when the scenario is loaded (ClusterSpec.resolved)."""
    if raw is None:
        raise ScenarioError("cluster: required (a preset name or a mapping)")
    if isinstance(raw, str):
        return {"preset": raw}
    if not isinstance(raw, Mapping):
        raise ScenarioError(f"cluster: expected a preset name or a mapping, got {raw!r}")
    return dict(raw)


def _strategy_choice(raw: Any, path: str) -> StrategyChoice:
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, Mapping):
        raise ScenarioError(f"{path}: expected a mapping with a 'name'")
    data = dict(raw)
    name = data.pop("name", None)
    if not isinstance(name, str):
        known = ", ".join(strategies.available())
        raise ScenarioError(f"{path}.name: required (one of: {known})")
    plugin = strategies.get(name, f"{path}.name")
    return StrategyChoice(name=name, config=from_mapping(plugin.Config, data, path))


def scenario_from_mapping(raw: Any, overrides: Sequence[str] = (), source: str = "<mapping>",
                          base_dir: Path | None = None) -> Scenario:
    """Build and validate a Scenario from a plain mapping plus ``--set`` overrides.

    ``base_dir``: the folder a relative ``model`` config path of ``raw`` is read from (the
    scenario file's; None: the working directory). A path given by an override is read from
    the working directory.

    Per load the preset folders are listed once, the cluster preset file is read once and
    ``ClusterSpec.validate`` runs twice (the scenario's ``cluster`` mapping and that preset).
    """
    with listing_once():
        return _scenario_from_mapping(raw, overrides, source, base_dir)


def _scenario_from_mapping(raw: Any, overrides: Sequence[str], source: str, base_dir: Path | None) -> Scenario:
    if not isinstance(raw, Mapping):
        raise ScenarioError(f"{source}: a scenario must be a mapping")
    data = copy.deepcopy(dict(raw))
    parsed = [(parse_override(text), text) for text in overrides]
    if "strategies" in data and any(parts == ["strategy", "name"] for (parts, _), _ in parsed):
        # naming one strategy on the command line replaces the scenario's list
        del data["strategies"]
    model_start = _model_preset(data.get("model"))
    for (parts, value), text in parsed:
        _apply_override(data, parts, value, text)
    if _model_preset(data.get("model")) != model_start:  # the command line named the model
        base_dir = None
    unknown = [k for k in data if k not in _TOP_KEYS]
    if unknown:
        raise ScenarioError(f"{unknown[0]}: unknown key (allowed: {', '.join(_TOP_KEYS)})")
    if "strategy" in data and "strategies" in data:
        raise ScenarioError("strategy: give either 'strategy' or 'strategies', not both")
    if data.get("name") is not None and not isinstance(data["name"], str):
        raise ScenarioError(f"name: expected a string, got {data['name']!r}")

    model = from_mapping(Model, _model_mapping(data.get("model"), base_dir), "model")
    raw_training = data.get("training")
    training = from_mapping(Training, {} if raw_training is None else raw_training, "training")
    cluster = from_mapping(ClusterSpec, _cluster_mapping(data.get("cluster")), "cluster")
    try:
        check_modules(model, training.recompute_modules)
    except ValueError as exc:
        raise ScenarioError(f"training.{exc}") from None
    if training.sequence_lengths != "fixed" and model.windowed:
        raise ScenarioError("training.sequence_lengths: packed documents with sliding-window attention "
                            "(model.sliding_window) are not modelled")

    if "strategies" in data:
        entries = data["strategies"]
        if not isinstance(entries, list) or not entries:
            raise ScenarioError("strategies: expected a non-empty list")
        choices = tuple(_strategy_choice(e, f"strategies[{i}]") for i, e in enumerate(entries))
    elif "strategy" in data:
        choices = (_strategy_choice(data["strategy"], "strategy"),)
    else:
        raise ScenarioError("strategy: required (or a 'strategies' list)")

    try:
        resolved = cluster.resolved()
    except ValueError as exc:
        raise ScenarioError(f"cluster.{exc}") from None
    scenario = Scenario(model, training, resolved, choices, source)
    topology = scenario.topology
    try:
        topology.device.peak_flops_per_s(training.precision)
    except ValueError as exc:
        raise ScenarioError(f"training.precision: {exc}") from None
    if training.fp8_recipe == "mxfp8" and not topology.device.mx_formats:
        raise ScenarioError(f"training.fp8_recipe: mxfp8 needs tensor cores that run MX formats (compute capability "
                            f"10.0+, e.g. b200, gb200); {topology.device.name} has none")
    kernels = topology.device.attention_kernels
    if training.fused_attention and training.attention_kernel != "auto" and kernels and training.attention_kernel not in kernels:
        raise ScenarioError(f"training.attention_kernel: {training.attention_kernel!r} does not run on "
                            f"{topology.device.name} (runs there: {', '.join(kernels)})")
    for i, choice in enumerate(choices):
        path = "strategy" if "strategy" in data else f"strategies[{i}]"
        try:
            strategies.get(choice.name).check(choice.config, model, training, topology)
        except ScenarioError:
            raise
        except ValueError as exc:
            raise ScenarioError(f"{path}.{exc}") from None
    return scenario


def load_scenario(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Scenario:
    """Load a scenario file (or the built-in default when ``path`` is None)."""
    if path is None:
        return scenario_from_mapping(DEFAULT_SCENARIO, overrides, source="<default>")
    file = Path(path)
    if not file.is_file():
        raise ScenarioError(f"{path}: no such scenario file")
    document = read_yaml(file)
    return scenario_from_mapping({} if document is None else document, overrides, source=str(path),
                                 base_dir=file.parent)
