"""Strategy plugins, found by name.

A strategy is one module in this package (or one registered under the ``hzpsim.strategies``
entry-point group by another package) that exposes:

- ``Config``: a frozen dataclass of the strategy's fields, each documented with unit and default;
- ``check(config, model, training, topology)``: raise ``ValueError("<field>: <problem>")`` for
  layouts that cannot run (group sizes that do not divide, batch that does not split, ...);
- ``build(config, model, training, topology, expand=False) -> OpGraph``;
- optionally ``label(resolved) -> str``: a short name for tables, from the resolved config
  (``compose_label`` does the usual ``name(field=value,...)``); without it, the name.

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
  computed only for the candidates the search is about to simulate.

Adding a strategy means adding a module; nothing here lists them. Modules whose name starts
with an underscore hold shared emitters and are not strategies.
"""

from __future__ import annotations

import importlib
import pkgutil
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


_TRIVIAL = {"tp": (0, 1), "pp": (0, 1), "cp": (0, 1), "ep": (0, 1), "vpp": (0, 1), "dp": (0, 1), "zero_stage": (0,)}


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


def label(resolved: dict[str, Any]) -> str:
    """A short name for tables of the strategy ``resolved`` (a report's ``strategy_resolved``)."""
    plugin = get(resolved["name"])
    return plugin.label(resolved) if hasattr(plugin, "label") else resolved["name"]
