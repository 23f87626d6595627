"""The strategy-plugin contract of docs/adding-a-strategy.md, checked on every built-in strategy:
a module docstring (its first line is the ``hzpsim list strategies`` summary), ``Config`` /
``check`` / ``build``, an optional ``label(resolved) -> str``, and the optimizer contract the
report relies on (every simulated rank runs, in every step s, an op of category ``optimizer``
tagged ``step=s``; the latest one's end closes the step)."""

from __future__ import annotations

import dataclasses
import types

import pytest

from hzpsim import strategies
from hzpsim.cli import main
from hzpsim.config import ScenarioError
from hzpsim.scenario import scenario_from_mapping

NAMES = strategies.available()


@pytest.mark.parametrize("name", NAMES)
def test_plugin_has_a_summary_config_check_and_build(name):
    plugin = strategies.get(name)
    assert (plugin.__doc__ or "").strip(), f"{name}: a strategy module needs a docstring (hzpsim list strategies)"
    assert dataclasses.is_dataclass(plugin.Config) and plugin.Config.__dataclass_params__.frozen
    assert callable(plugin.check) and callable(plugin.build)
    if hasattr(plugin, "label"):
        resolved = {"name": name, **{f.metadata.get("key", f.name): f.default
                                     for f in dataclasses.fields(plugin.Config)
                                     if f.default is not dataclasses.MISSING}}
        assert isinstance(plugin.label(resolved), str) and plugin.label(resolved).startswith(name)


@pytest.mark.parametrize("name", NAMES)
def test_every_rank_runs_an_optimizer_op_in_every_step(name):
    try:
        sc = scenario_from_mapping({"model": "tiny-dense", "training": {"global_batch_size": 16, "num_steps": 3},
                                    "cluster": {"preset": "dgx-h100", "num_nodes": 1},
                                    "strategy": {"name": name}})
    except ScenarioError as exc:  # a default layout that does not fit this tiny case
        pytest.skip(str(exc))
    choice = sc.strategies[0]
    graph = strategies.get(name).build(choice.config, sc.model, sc.training, sc.topology)
    steps = {rank: set() for rank in graph.weights}
    for op in graph.ops:
        if op.category == "optimizer":
            assert op.kind == "compute", f"{name}: {op.name} is not a compute op"
            for rank in op.ranks:
                steps[rank].add(op.step)
    assert all(s == {0, 1, 2} for s in steps.values()), f"{name}: optimizer steps by rank {steps}"


def test_list_strategies_survives_a_plugin_without_docstring(monkeypatch, capsys):
    @dataclasses.dataclass(frozen=True)
    class Config:
        size: int = 1

    plugin = types.ModuleType("nodoc")  # a third-party plugin that forgot its docstring
    plugin.Config, plugin.check, plugin.build = Config, lambda *a: None, lambda *a, **k: None
    monkeypatch.setattr(strategies, "available", lambda: ["nodoc"])
    monkeypatch.setattr(strategies, "get", lambda name, path="strategy.name": plugin)
    assert main(["list", "strategies"]) == 0, capsys.readouterr().err
    assert "nodoc" in capsys.readouterr().out
