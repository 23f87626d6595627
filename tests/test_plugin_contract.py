"""The strategy-plugin contract of docs/adding-a-strategy.md, checked on every built-in strategy:
a module docstring (its first line is the ``hzpsim list strategies`` summary), ``Config`` /
``check`` / ``build``, an optional ``label(resolved) -> str``, the optimizer contract the
report relies on (every simulated rank runs, in every step s, an op of category ``optimizer``
tagged ``step=s``; the latest one's end closes the step), and the optional search hooks
(``SEARCH_RANK``, ``layouts``, ``search_check``, ``quick_bound``, ``bound``, ``refine_bound``): what the built-in
ones return, and that a plugin without them is searched all the same."""

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
    except ScenarioError as exc:
        pytest.fail(f"{name}: its default layout must run a tiny model on one node ({exc})")
    choice = sc.strategies[0]
    graph = strategies.get(name).build(choice.config, sc.model, sc.training, sc.topology)
    steps = {rank: set() for rank in graph.weights}
    for op in graph.ops:
        if op.category == "optimizer":
            assert op.kind == "compute", f"{name}: {op.name} is not a compute op"
            for rank in op.ranks:
                steps[rank].add(op.step)
    # every step simulated, at least the scenario's (co2 simulates two of its outer periods)
    simulated = set(range(max(3, *(max(s, default=0) + 1 for s in steps.values()))))
    assert all(s == simulated for s in steps.values()), f"{name}: optimizer steps by rank {steps}"


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


TINY = {"model": "tiny-dense", "training": {"global_batch_size": 16},
        "cluster": {"preset": "dgx-h100", "num_nodes": 1}, "strategy": {"name": "ddp"}}
TINY_SPACE = ["tp=1,2", "pp=1,2", "vpp=1", "micro_batch_size=1,2,4", "activation_recompute=none,full",
              "outer_period=2"]


def _tiny_search_space():
    from hzpsim import search as S

    sc = scenario_from_mapping(TINY)
    space = S.default_space(sc)
    for text in TINY_SPACE:
        space = space.replace(text)
    return sc, space


@pytest.mark.parametrize("name", NAMES)
def test_search_hooks_return_what_the_search_expects(name):
    """``SEARCH_RANK`` an int; ``layouts`` a list of dicts of Config fields; ``quick_bound``,
    ``bound`` and ``refine_bound`` a ``strategies.Bound`` (for the layouts that pass ``check``),
    each at least the one before."""
    from hzpsim import search as S

    plugin = strategies.get(name)
    assert isinstance(getattr(plugin, "SEARCH_RANK", 0), int)
    sc, space = _tiny_search_space()
    fields = {f.name for f in dataclasses.fields(plugin.Config)}
    layouts = S.layouts_of(name, sc, space)
    assert isinstance(layouts, list) and layouts and all(isinstance(x, dict) and set(x) <= fields for x in layouts)
    bounder = S.Bounder(sc)
    valid = [c for c in S.enumerate_candidates(sc, [name], space) if S.check(sc, c) is None]
    assert valid, f"{name}: no layout of the tiny search space passes check"
    for candidate in valid[:4]:
        levels = [bounder.at(candidate, level) for level in range(len(bounder.hooks(candidate)))]
        b, refined = bounder(candidate), bounder(candidate, refine=True)
        assert all(isinstance(x, strategies.Bound) for x in [b, refined, *levels])
        assert 0 <= b.step_time_s <= refined.step_time_s and b.memory_bytes >= 0
        # each hook at least the one before it (bounding.LEVELS: the search tightens in that order)
        for looser, tighter in zip(levels, levels[1:]):
            assert looser.step_time_s <= tighter.step_time_s * (1 + 1e-12), (candidate.label(), looser, tighter)
            assert looser.memory_bytes <= tighter.memory_bytes * (1 + 1e-12), (candidate.label(), looser, tighter)


def _bare_plugin() -> types.ModuleType:
    """A third-party plugin with only what is required (Config, check, build; no label, no
    search hooks): DDP under another name."""
    ddp = strategies.get("ddp")

    @dataclasses.dataclass(frozen=True)
    class Config:
        pass

    plugin = types.ModuleType("bare")
    plugin.__doc__ = "DDP, without search hooks."
    plugin.Config = Config
    plugin.check = lambda config, model, training, topology: ddp.check(ddp.Config(), model, training, topology)
    plugin.build = lambda config, model, training, topology, expand=False: ddp.build(
        ddp.Config(), model, training, topology, expand)
    return plugin


def test_a_plugin_without_search_hooks_is_searched(monkeypatch):
    """The search's defaults: listed after the ranked strategies, one layout (its defaults),
    no bound (``Bound()``: never pruned, always simulated), and the same answers as DDP."""
    from hzpsim import search as S

    plugin = _bare_plugin()
    available, get = strategies.available, strategies.get
    monkeypatch.setattr(strategies, "available", lambda: [*available(), "bare"])
    monkeypatch.setattr(strategies, "get",
                        lambda name, path="strategy.name": plugin if name == "bare" else get(name, path))
    S.plugin_of.cache_clear()
    try:
        assert S.families()[-1] == "bare" and S.parse_families(None)[-1] == "bare"
        sc, space = _tiny_search_space()
        result = S.search(sc, top=3, space=space)
        text = S.format_search(result)
    finally:
        S.plugin_of.cache_clear()
    rows = [r for r in result.rows if r.candidate.name == "bare"]
    assert len(rows) == len(space.micro_batch_size) * len(space.activation_recompute)
    assert all(r.candidate.fields == () for r in rows)
    assert {r.status for r in rows} == {"simulated", "invalid"}  # micro-batch 4 does not split the batch
    assert all(r.bound == strategies.Bound() for r in rows if r.status == "simulated")
    ddp = {(r.candidate.micro_batch_size, r.candidate.activation_recompute): r.report
           for r in result.rows if r.candidate.name == "ddp" and r.report}
    same = [(r.report, ddp[(r.candidate.micro_batch_size, r.candidate.activation_recompute)]) for r in rows
            if r.report and (r.candidate.micro_batch_size, r.candidate.activation_recompute) in ddp]
    assert same and all(a["step_time_s"] == b["step_time_s"] for a, b in same)
    assert result.best_of("bare") is not None and "bare" in result.to_json()["best_per_family"]
    assert "\n  bare " in text
