"""Strategy plugins, found by name.

A strategy is one module in this package (or one registered under the ``hzpsim.strategies``
entry-point group by another package) that exposes:

- ``Config``: a frozen dataclass of the strategy's fields, each documented with unit and default;
- ``check(config, model, training, topology)``: raise ``ValueError("<field>: <problem>")`` for
  layouts that cannot run (group sizes that do not divide, batch that does not split, ...);
- ``build(config, model, training, topology, expand=False) -> OpGraph``;
- optionally ``label(resolved) -> str``: a short name for tables, from the resolved config
  (``compose_label`` does the usual ``name(field=value,...)``); without it, the name.
- optionally the attributes the rest of hzpsim asks a plugin for (order, colour, default runs,
  published-run mapping, ...), listed and read at the end of this module.

What ``hzpsim search`` asks of a plugin, all optional (docs/adding-a-strategy.md, "Search"):

- ``SEARCH_RANK: int``: where the search lists the strategy (lowest first; without it, after
  the ranked ones, by name);
- ``layouts(model, training, topology, space) -> list[dict]``: the strategy's points of the
  search space, each the strategy fields of one candidate (the search adds the training
  knobs); ``space`` is the search's ``Space``, read by attribute (``tp``, ``pp``, ``vpp``,
  ``cp``, ``ep``, ``zero_stage``, ``sequence_parallel``, ``group_sizes``). Without it: one
  layout, ``{}`` (the Config's defaults);
- ``search_check(config, model, training, topology)``: like ``check``, for layouts that can run
  but that the search skips (they count as invalid);
- ``bound(config, model, training, topology, cache) -> Bound``: lower bounds on the step time
  and peak memory the simulator reports for a layout that passed ``check``; ``cache`` is the
  scenario's :class:`BoundCache` (cost models and unit costs shared across candidates). A bound
  that is not below the simulation makes the search prune what it should not: test it
  (``tests/test_search.py``). Without it: ``Bound()`` (zero), so every layout is simulated;
- ``refine_bound(config, model, training, topology, cache) -> Bound``: a tighter, slower bound,
  computed only for the candidates the search is about to simulate;
- ``quick_bound(config, model, training, topology, cache) -> Bound``: a looser, faster one (at
  most ``bound``'s step time and memory), which the search computes for every candidate,
  computing ``bound`` only for those that come up (``search.bounding.LEVELS``).

Adding a strategy means adding a module; nothing here lists them. Modules whose name starts
with an underscore hold shared emitters and are not strategies.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any

from hzpsim.config import ScenarioError
from hzpsim.strategies._bounds import Bound, BoundCache

__all__ = ["Bound", "BoundCache", "available", "compose_label", "get", "label"]

_ENTRY_POINT_GROUP = "hzpsim.strategies"


def _external() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=_ENTRY_POINT_GROUP)}


def available() -> list[str]:
    """Names of every strategy that can be used in a scenario, sorted."""
    names = {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}
    names.update(_external())
    return sorted(names)


def get(name: str, path: str = "strategy.name") -> ModuleType:
    """The plugin module called ``name``; ScenarioError naming ``path`` if there is none."""
    if name in available():
        external = _external()
        module_name = external[name] if name in external else f"{__name__}.{name}"
        module = importlib.import_module(module_name)
        for attribute in ("Config", "check", "build"):
            if not hasattr(module, attribute):
                raise TypeError(f"strategy plugin {module_name} lacks {attribute}")  # plugin bug
        return module
    raise ScenarioError(f"{path}: unknown strategy '{name}' (known: {', '.join(available())})")


_TRIVIAL = {"tp": (0, 1), "pp": (0, 1), "cp": (0, 1), "ep": (0, 1), "vpp": (0, 1), "dp": (0, 1), "zero_stage": (0,),
            "inner_group_size": (1,)}


def compose_label(resolved: dict[str, Any], short: dict[str, str]) -> str:
    """``name(a=1,b=2,flags)``: the fields in ``short`` (key -> short name) whose values are not
    trivial (a degree of 1, ZeRO stage 0), then the flags ``sync``, ``sp``, ``adaptive``."""
    parts = []
    if resolved.get("param_group_size"):
        parts.append(f"{resolved['param_group_size']}|{resolved['grad_group_size']}|{resolved['optim_group_size']}")
    for key, name in short.items():
        value = resolved.get(key)
        if value is not None and value not in _TRIVIAL.get(key, ()):
            parts.append(f"{name}={value}")
    if resolved.get("async") is False:
        parts.append("sync")
    if resolved.get("sequence_parallel"):
        parts.append("sp")
    if resolved.get("adaptive"):
        parts.append("adaptive")
    return f"{resolved['name']}({','.join(parts)})" if parts else resolved["name"]


def as_simulated(config: Any) -> Any:
    """``config`` with what its implementation profile decides written in
    (``_implementations.Implementation``): a profile that forces the gradient-reduction overlap
    on or off (``grad_reduce_overlap``: Megatron 2021 reduces after the backward) sets
    ``overlap_grad_reduce``, and one that keeps fewer gathers in flight (``max_prefetch_depth``)
    caps ``prefetch_depth``; an unset ``moe_dispatcher`` is the profile's, an unset ``etp`` the
    profile's (``expert_tp_is_tp``: ``tp``, else 1), and an unset ``zero_stage`` the profile's
    (``distributed_optimizer``: 1, else 0). The simulation reads them through the profile already
    (``_sharded.Schedule.effective_*``), so this changes what ``strategy_resolved`` says, not
    what is simulated."""
    from hzpsim.strategies import _implementations

    name = getattr(config, "implementation", None)
    if not isinstance(name, str) or not dataclasses.is_dataclass(config) or isinstance(config, type):
        return config
    profile = _implementations.get(name)
    fields = {f.name for f in dataclasses.fields(config)}
    plugin_config: Any = config  # a plugin's Config: its fields are read by name
    changes: dict[str, Any] = {}
    if "overlap_grad_reduce" in fields and profile.grad_reduce_overlap is not None:
        changes["overlap_grad_reduce"] = profile.grad_reduce_overlap
    if "moe_dispatcher" in fields and not plugin_config.moe_dispatcher:
        changes["moe_dispatcher"] = profile.moe_dispatcher  # the MoE layers' dispatcher unless set
    if "moe_grouped_gemm" in fields and plugin_config.moe_grouped_gemm is None:
        changes["moe_grouped_gemm"] = profile.moe_grouped_gemm
    if "moe_permute_fusion" in fields and plugin_config.moe_permute_fusion is None:
        changes["moe_permute_fusion"] = profile.moe_permute_fusion
    if "etp" in fields and plugin_config.etp is None:  # nd: the framework's default (Megatron-Core: tp)
        changes["etp"] = profile.expert_tp(plugin_config.tp)
    if "zero_stage" in fields and plugin_config.zero_stage is None:  # nd: the framework's default
        changes["zero_stage"] = 1 if profile.distributed_optimizer else 0
    if "prefetch_depth" in fields:
        changes["prefetch_depth"] = min(plugin_config.prefetch_depth, profile.max_prefetch_depth)
    return dataclasses.replace(config, **changes) if changes else config


def training_as_simulated(config: Any, training: Any, device: Any) -> Any:
    """``training`` as ``config``'s implementation profile runs it on ``device`` (its kernel
    defaults: ``_implementations.Implementation.training_for``); unchanged for a config
    without a profile."""
    from hzpsim.strategies import _implementations

    name = getattr(config, "implementation", None)
    if not isinstance(name, str):
        return training
    return _implementations.get(name).training_for(training, device)


def label(resolved: dict[str, Any]) -> str:
    """A short name for tables of the strategy ``resolved`` (a report's ``strategy_resolved``)."""
    plugin = get(resolved["name"])
    return plugin.label(resolved) if hasattr(plugin, "label") else resolved["name"]


# ------------------------------------------------------------------ what the rest of hzpsim asks a plugin
#
# Besides Config, check and build, a plugin may declare (read through the functions below, so
# that code outside this package never spells a strategy's name; each has a default):
#
# - ``ORDER: int``: where it stands in lists (the default comparison, published families,
#   figure legends), low first (default 1000, then by name);
# - ``COLOR: str``: its colour in figures (default ``DEFAULT_COLOR``);
# - ``DEFAULT_RUNS: tuple[dict, ...]``: its entries (fields, name left out) in the comparison
#   of the built-in default scenario (llama2-70b on 8 DGX H100 nodes) (default none);
# - ``STAND_INS: tuple[dict, ...]``: layouts (fields, name left out) that may stand in for a
#   scenario's strategies while only its model, training and cluster matter (a search's base
#   scenario), simplest first (default none);
# - ``PUBLISHED_FAMILIES: dict[str, tuple[str, ...]]``: the published-run table's
#   ``strategy_family`` values the plugin maps (``hzpsim.validation.mapping``), each with the
#   layout columns such a row must give; with ``from_published(run: PublishedRun) ->
#   (scenario strategy mapping, notes)``, which raises ``ValueError("<column>: <problem>")``
#   for a row it cannot map (default none);
# - ``FRAMEWORK_IMPLEMENTATIONS: dict[str, str]``: framework keyword of a published run's
#   ``system`` column -> the implementation profile (``_implementations.py``) it runs this
#   strategy as, where that is not the framework's usual one (default none);
# - ``VALIDATION_REGIMES: dict[str, str]``: implementation-profile prefix -> the validation
#   regime (``hzpsim.validation.regimes.REGIMES``) of a published run of it, first match
#   (default none).

DEFAULT_ORDER = 1000
DEFAULT_COLOR = "#4c72b0"


@functools.lru_cache(maxsize=4)
def _modules(names: tuple[str, ...]) -> dict[str, ModuleType]:
    return {name: get(name) for name in names}


def plugins() -> dict[str, ModuleType]:
    """Every strategy's plugin module by name, sorted by name (imported once per set of names)."""
    return _modules(tuple(available()))


def declared(name: str, attribute: str, default: Any = None) -> Any:
    """The plugin ``name``'s ``attribute`` (see above); ``default`` when it declares none or
    when there is no strategy ``name``."""
    plugin = plugins().get(name)
    return default if plugin is None else getattr(plugin, attribute, default)


LONG_CONTEXT_TOKENS = 16384
"""Sequences from this length on are the ``long context`` regime."""


def regimes(name: str, implementation: str, moe: bool, cp: int, seq_len: int) -> tuple[str, ...]:
    """The validation regimes a run of strategy ``name`` falls in: the plugin's family regime
    for its implementation profile (``VALIDATION_REGIMES``, first matching prefix), ``MoE``
    for routed experts, ``long context`` with context parallelism or long sequences. Shared by
    ``validate published`` (which scores by regime) and the prediction interval of a run
    (drawn from the held-out errors of the same regime, ``calibration.intervals``)."""
    out: list[str] = []
    for prefix, regime in declared(name, "VALIDATION_REGIMES", {}).items():
        if implementation.startswith(prefix):
            out.append(regime)
            break
    if moe:
        out.append("MoE")
    if cp > 1 or seq_len >= LONG_CONTEXT_TOKENS:
        out.append("long context")
    return tuple(out)


def ordered() -> list[str]:
    """Every strategy's name, by ``ORDER`` then by name."""
    modules = plugins()
    return sorted(modules, key=lambda name: (getattr(modules[name], "ORDER", DEFAULT_ORDER), name))


def color(name: str, default: str = DEFAULT_COLOR) -> str:
    """The figure colour of the strategy ``name`` (``default`` for a plugin without one, or a
    name that is no strategy)."""
    return declared(name, "COLOR", default)


def _each(attribute: str, default: Any) -> list[tuple[str, Any]]:
    """(name, declared ``attribute``) of every strategy, by ``ORDER``."""
    modules = plugins()
    return [(name, getattr(modules[name], attribute, default)) for name in ordered()]


def default_runs() -> list[dict[str, Any]]:
    """The built-in default scenario's ``strategies:`` list: every plugin's ``DEFAULT_RUNS``."""
    return [{"name": name, **fields} for name, runs in _each("DEFAULT_RUNS", ()) for fields in runs]


def stand_ins() -> list[dict[str, Any]]:
    """Strategy mappings that may stand in for a scenario's strategies (``STAND_INS``), simplest
    first (fewest fields, then by ``ORDER``): try each until the scenario loads."""
    found = [{"name": name, **fields} for name, runs in _each("STAND_INS", ()) for fields in runs]
    return sorted(found, key=len)


@dataclass(frozen=True)
class PublishedRun:
    """A published training run's layout, as one row of a published-run table
    (``hzpsim/data/published_calibration.csv``) states it, for a plugin's ``from_published``."""

    family: str
    """The row's ``strategy_family`` (one of the plugin's ``PUBLISHED_FAMILIES``)."""
    system: str
    """The framework that ran it (the ``system`` column), lower case."""
    gpus_per_node: int
    """Devices per node of the mapped cluster."""
    tp: int
    """Tensor-parallel size (1 when not given; likewise pp, cp, ep)."""
    pp: int
    cp: int
    ep: int
    dp: int
    """Data-parallel size, given or n_gpus / (tp x pp x cp)."""
    zero_stage: int | None
    """The ``zero_stage`` column; None when not given."""
    sharding_group: int | None
    """Ranks of one sharding group (the ``sharding_group`` column); None when not a number."""
    sequence_parallel: bool
    """Sequence parallelism is on (stated, or the framework's default for tp > 1)."""
    column: Callable[[str], int | None]
    """Any other whole-number column of the row (None when blank)."""

    def mapped_by(self, name: str, **changes: Any) -> tuple[dict[str, Any], list[str]]:
        """This run (with ``changes``) as the plugin ``name`` maps it: a plugin hands a row over
        to another (FSDP composed with TP is ND)."""
        return get(name).from_published(dataclasses.replace(self, **changes))


def published_families() -> list[str]:
    """Every ``strategy_family`` of the published-run table some plugin maps, by ``ORDER``."""
    return [family for _, families in _each("PUBLISHED_FAMILIES", {}) for family in families]


def published_owner(family: str) -> tuple[ModuleType, tuple[str, ...]] | None:
    """The plugin that maps published rows of ``strategy_family`` ``family`` and the layout
    columns such a row must give; None when no plugin maps it."""
    for name, families in _each("PUBLISHED_FAMILIES", {}):
        if family in families:
            return plugins()[name], tuple(families[family])
    return None


def grad_compression_option(text: str) -> Any:
    """A ``--space grad_compression=`` value (``METHOD:RATIO[:PER_LAYER]``) checked and parsed
    (``_compression.parse_option``; ValueError naming the problem)."""
    from hzpsim.strategies import _compression

    return _compression.parse_option(text)
