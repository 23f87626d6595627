"""The space searched: its knobs (:class:`Space`), its points (:class:`Candidate`) and the
scenario each point stands for.

The strategies are every plugin ``strategies.available()`` lists, in the order of their
``SEARCH_RANK``; each says which of its layouts to try (its ``layouts`` hook, one layout of
defaults without it), and every layout is tried with every micro-batch size and recompute mode.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hzpsim import strategies
from hzpsim.config import ScenarioError, from_mapping, to_mapping
from hzpsim.model.ops import GraphError
from hzpsim.model.training import Training
from hzpsim.scenario import Scenario, StrategyChoice

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Space:
    """The knobs searched: the strategies' layout knobs (each plugin's ``layouts`` reads those
    it has) times the training knobs (every combination, minus those a plugin's ``check``
    rejects)."""

    tp: tuple[int, ...] = (1, 2, 4, 8)
    pp: tuple[int, ...] = tuple(range(1, 17))
    vpp: tuple[int, ...] = (1, 2, 3, 4)
    cp: tuple[int, ...] = (1,)
    ep: tuple[int, ...] = (1,)
    etp: tuple[int, ...] = (1,)  # experts' tensor-parallel sizes (MoE models, with ep)
    zero_stage: tuple[int, ...] = (0, 1, 2, 3)
    sequence_parallel: tuple[bool, ...] = (False, True)
    micro_batch_size: tuple[int, ...] = (1, 2, 4)
    activation_recompute: tuple[str, ...] = RECOMPUTE
    group_sizes: tuple[int, ...] | None = None  # sharding group sizes; None = powers of two
    grad_compression: tuple[str, ...] = ()  # METHOD:RATIO[:adaptive] tried with ddp and zero 1/2; () = none
    outer_period: tuple[int, ...] = ()  # co2's inner steps per outer exchange; () = co2 not searched

    def replace(self, text: str) -> Space:
        """``KEY=V1,V2`` (``pp=1-16`` for a range), the ``--space`` syntax."""
        if "=" not in text:
            raise ScenarioError(f"--space {text!r}: expected KEY=V1,V2,... (keys: {', '.join(_space_keys())})")
        key, raw = (s.strip() for s in text.split("=", 1))
        if key not in _space_keys():
            raise ScenarioError(f"--space {key}: unknown key (keys: {', '.join(_space_keys())})")
        values: list[Any] = []
        for part in (p.strip() for p in raw.split(",")):
            if key == "activation_recompute":
                if part not in RECOMPUTE:
                    raise ScenarioError(f"--space {key}: {part!r} is not one of {', '.join(RECOMPUTE)}")
                values.append(part)
            elif key == "grad_compression":
                try:
                    strategies.grad_compression_option(part)
                except ValueError as exc:
                    raise ScenarioError(f"--space {key}: {exc}") from None
                values.append(part)
            elif key == "sequence_parallel":
                if part.lower() not in ("true", "false"):
                    raise ScenarioError(f"--space {key}: {part!r} is not true or false")
                values.append(part.lower() == "true")
            else:
                lo, _, hi = part.partition("-")
                try:
                    first, last = int(lo), int(hi or lo)
                except ValueError:
                    raise ScenarioError(f"--space {key}: {part!r} is not an integer or a range a-b") from None
                minimum = 0 if key == "zero_stage" else 1
                maximum = 3 if key == "zero_stage" else 1_000_000
                if first < minimum or last < first or last > maximum:
                    raise ScenarioError(f"--space {key}: {part!r} is out of range")
                values.extend(range(first, last + 1))
        if not values:
            raise ScenarioError(f"--space {key}: no values")
        order = str if key in ("activation_recompute", "grad_compression") else None
        return dataclasses.replace(self, **{key: tuple(sorted(set(values), key=order))})


def _space_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(Space)]


def default_space(scenario: Scenario) -> Space:
    """The space searched when nothing else is said: tensor parallelism inside a node, up to 16
    pipeline stages, context parallelism for long sequences, expert parallelism for MoE."""
    model, topology = scenario.model, scenario.topology
    tp = tuple(t for t in (1, 2, 4, 8) if t <= topology.devices_per_node)
    cp = (1, 2) if model.seq_len >= 8192 else (1,)
    ep: tuple[int, ...] = (1,)
    if model.moe is not None:
        ep = tuple(e for e in (1, 2, 4, 8, 16, 32, 64) if e <= model.moe.num_experts and model.moe.num_experts % e == 0)
    return Space(tp=tp, pp=tuple(range(1, min(16, model.num_layers) + 1)), cp=cp, ep=ep)


@dataclass(frozen=True)
class Candidate:
    """One point of the space: a strategy (name and fields) and the training knobs."""

    name: str
    fields: tuple[tuple[str, Any], ...]
    micro_batch_size: int
    activation_recompute: str

    @functools.cached_property
    def key(self) -> str:
        """Stable identity and tie-breaker."""
        return json.dumps([self.name, self.fields, self.micro_batch_size, self.activation_recompute], default=to_mapping)

    def strategy(self) -> dict[str, Any]:
        return {"name": self.name, **dict(self.fields)}

    def training(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "activation_recompute": self.activation_recompute}

    def label(self) -> str:
        # the plugin's label through plugin_of (strategies.label looks the plugin up again, which
        # scans the entry points: milliseconds, times tens of thousands of candidates in a figure)
        plugin = plugin_of(self.name)
        name = plugin.label(self.strategy()) if hasattr(plugin, "label") else self.name
        return f"{name} mb={self.micro_batch_size} rc={self.activation_recompute}"

    def overrides(self) -> list[str]:
        """``--set`` arguments that make ``hzpsim run`` simulate this candidate."""
        out = [f"strategy.name={self.name}"]
        for k, v in self.fields:  # a nested setting (a dataclass: grad_compression) key by key
            nested = to_mapping(v) if dataclasses.is_dataclass(v) else None
            out += ([f"strategy.{k}.{kk}={json.dumps(vv)}" for kk, vv in nested.items()] if nested is not None
                    else [f"strategy.{k}={json.dumps(v)}"])
        out += [f"training.micro_batch_size={self.micro_batch_size}",
                f"training.activation_recompute={self.activation_recompute}"]
        return out


@functools.cache
def plugin_of(name: str) -> Any:
    """``strategies.get`` once per name (it scans entry points on every call)."""
    return strategies.get(name)


def families() -> tuple[str, ...]:
    """Every strategy, in the order the search reports them: by the plugin's ``SEARCH_RANK``,
    then (those without one last) by name."""
    def order(name: str) -> tuple[float, str]:
        return (getattr(strategies.get(name), "SEARCH_RANK", math.inf), name)

    return tuple(sorted(strategies.available(), key=order))


def layouts_of(name: str, scenario: Scenario, space: Space) -> list[dict[str, Any]]:
    """Strategy fields of one strategy's candidates (training knobs excluded): its plugin's
    ``layouts``, or one layout of its defaults."""
    plugin = plugin_of(name)
    if not hasattr(plugin, "layouts"):
        return [{}]
    return plugin.layouts(scenario.model, scenario.training, scenario.topology, space)


def enumerate_candidates(scenario: Scenario, families: Sequence[str], space: Space) -> list[Candidate]:
    """Every candidate of ``families`` in ``space``, in a stable order."""
    out = []
    for name in families:
        for fields in layouts_of(name, scenario, space):
            for mbs in space.micro_batch_size:
                for rc in space.activation_recompute:
                    out.append(Candidate(name, tuple(sorted(fields.items())), mbs, rc))
    return out


def training_of(scenario: Scenario, candidate: Candidate) -> Training:
    """The scenario's training with the candidate's knobs (the scenario's ``recompute_modules``
    say what a selective candidate recomputes; other candidates drop them)."""
    modules = scenario.training.recompute_modules if candidate.activation_recompute == "selective" else None
    return dataclasses.replace(scenario.training, micro_batch_size=candidate.micro_batch_size,
                               activation_recompute=candidate.activation_recompute,  # type: ignore[arg-type]
                               recompute_modules=modules)


def variant(scenario: Scenario, candidate: Candidate) -> Scenario:
    """``scenario`` with the candidate's training knobs and the candidate as its one strategy."""
    training = training_of(scenario, candidate)
    out = dataclasses.replace(scenario, training=training, strategies=(choice_of(candidate),))
    out.__dict__["topology"] = scenario.topology  # share the built topology (a cached_property)
    return out


def choice_of(candidate: Candidate) -> StrategyChoice:
    return _choice(candidate.name, candidate.fields)


@functools.lru_cache(maxsize=65536)
def _choice(name: str, fields: tuple[tuple[str, Any], ...]) -> StrategyChoice:
    config_type = plugin_of(name).Config
    names = {f.name for f in dataclasses.fields(config_type)}
    if all(k in names for k, _ in fields):  # the search's own fields: typed already, no coercion needed
        config = config_type(**dict(fields))
        if hasattr(config, "validate"):
            config.validate()
        return StrategyChoice(name, config)
    return StrategyChoice(name, from_mapping(config_type, dict(fields), "strategy"))


def check(scenario: Scenario, candidate: Candidate) -> str | None:
    """Why the candidate cannot run (its plugin's ``check``) or is not searched (its
    ``search_check``), or None."""
    try:
        choice = choice_of(candidate)
        training = training_of(scenario, candidate)
        training.validate()
        plugin = plugin_of(candidate.name)
        plugin.check(choice.config, scenario.model, training, scenario.topology)
        search_check = getattr(plugin, "search_check", None)
        if search_check is not None:
            search_check(choice.config, scenario.model, training, scenario.topology)
    except (ValueError, GraphError) as exc:  # ScenarioError is a ValueError
        return str(exc)
    return None
