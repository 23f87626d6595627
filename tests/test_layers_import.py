"""The import layers of docs/design.md, checked on every module of the package.

"Layers import downward only" (docs/design.md, "The flow"): each module of ``hzpsim/`` is
parsed with ``ast`` (no import is executed) and every ``import`` / ``from ... import`` in it,
at any depth (imports inside functions count too), is checked against ``LAYERS`` below:

- a module may import modules of its own layer or of a lower one, never of a higher one;
- the engine never imports a strategy (``sim`` may not import ``strategies``, although it
  sits above it);
- SimPy is imported only in ``sim/``, PyTorch only in ``executor/``, matplotlib only in
  ``plots``.

A module is named by its first component under ``hzpsim`` (``hzpsim.sim.engine`` is ``sim``,
``hzpsim.strategies._sharded`` is ``strategies``, the package ``hzpsim/__init__.py`` is
``__init__``). A module that is in no layer fails the test: add it to ``LAYERS``, in the layer
of the lowest module that imports it and above everything it imports.

Below the layers, the house rules of the package's structure: no import cycle anywhere inside
``hzpsim/`` (not even inside one package; no allowed exceptions), no module over 800 lines, at
most 8 modules directly under ``hzpsim/``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hzpsim"

# Lowest first. The order of docs/design.md ("`model`, `ops`, `training` < `cluster` <
# `strategies` < `sim` < `report` < `planner` < `cli`") plus the modules it does not name.
LAYERS: list[tuple[str, ...]] = [
    # foundations: the version, ScenarioError and typed mappings, preset files (YAML)
    # and the calibration profile in use (declared constants and their fitted values)
    ("__init__", "config", "presets", "calibration"),
    # the nouns: a model's architecture, its kernels, one rank's ops, the training settings
    ("model",),
    # the PyTorch executor: imports only the foundations and the model
    ("executor",),
    # devices, topology, placement and the cost functions the engine and the bounds share
    ("hardware",),
    ("strategies",),
    # a typed, validated scenario: asks the strategy plugins to check their layouts, never simulates
    ("scenario",),
    ("sim",),
    ("report",),
    ("run",),
    # tools built on the run: published-run and executor validation, fits that run the simulator,
    # the strategy search, regression runs, data frames of reports
    ("validation",),
    ("fitting",),
    ("search", "regress", "frames"),
    # front ends
    ("plots", "cli"),
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}

# Pairs the order allows but docs/design.md forbids: (importer, imported) -> why.
FORBIDDEN = {("sim", "strategies"): "the engine never imports a strategy (docs/design.md)"}

# Third-party packages confined to one layer: package -> the layer allowed to import it.
CONFINED = {"simpy": "sim", "torch": "executor", "matplotlib": "plots"}



def layer_of(module: str) -> str:
    """``hzpsim.sim.engine`` -> ``sim``; ``hzpsim`` -> ``__init__``."""
    parts = module.split(".")
    assert parts[0] == "hzpsim", module
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str, str]]:
    """(line, imported module, source text) of every import in ``tree``, relative ones resolved."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((node.lineno, alias.name, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x / from ..y import z
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = ", ".join(a.name for a in node.names)
            text = f"from {'.' * node.level}{node.module or ''} import {names}"
            if target == "hzpsim":  # from hzpsim import strategies: a submodule, or the package itself
                for alias in node.names:
                    sub = PACKAGE / alias.name
                    is_sub = sub.is_dir() or sub.with_suffix(".py").is_file() or alias.name in RANK
                    found.append((node.lineno, f"hzpsim.{alias.name}" if is_sub else "hzpsim", text))
            else:
                found.append((node.lineno, target, text))
    return found


def violations(path: Path, source: str | None = None) -> list[str]:
    """Every import of the module at ``path`` that breaks a rule, as 'file:line: text: why'."""
    source = path.read_text(encoding="utf-8") if source is None else source
    module = module_name(path)
    where = path.relative_to(REPO).as_posix()
    layer = layer_of(module)
    problems = []
    if layer not in RANK:
        return [f"{where}: module layer '{layer}' is in no layer of LAYERS in tests/test_layers_import.py: "
                "add it there (above everything it imports, below everything that imports it)"]
    for line, target, text in imported(ast.parse(source, filename=where), module, path.name == "__init__.py"):
        top = target.split(".")[0]
        if top in CONFINED and layer != CONFINED[top]:
            problems.append(f"{where}:{line}: {text}: {top} may be imported only in hzpsim/{CONFINED[top]}")
        if top != "hzpsim":
            continue
        other = layer_of(target)
        if other not in RANK:
            problems.append(f"{where}:{line}: {text}: '{other}' is in no layer of LAYERS in "
                            "tests/test_layers_import.py: add it there")
        elif RANK[other] > RANK[layer]:
            problems.append(f"{where}:{line}: {text}: upward import, '{layer}' (layer {RANK[layer]}) "
                            f"imports '{other}' (layer {RANK[other]})")
        elif (layer, other) in FORBIDDEN:
            problems.append(f"{where}:{line}: {text}: {FORBIDDEN[(layer, other)]}")
    return problems


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_package_has_modules():
    assert len(MODULES) > 20 and PACKAGE / "sim" / "engine.py" in MODULES


def test_every_module_imports_only_downward():
    problems = [p for path in MODULES for p in violations(path)]
    assert not problems, "imports that break the layers of docs/design.md:\n" + "\n".join(problems)


def test_the_layers_agree_with_design_md():
    """The order docs/design.md states is the order checked here (names it does not list are
    placed by this file alone)."""
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    found = re.search(r"Layers import downward only:(.*?)\.\s", text, re.S)
    assert found, "docs/design.md no longer states the layer order: update tests/test_layers_import.py"
    groups = [re.findall(r"`([\w/]+)`", group) for group in found.group(1).split("<")]
    assert all(groups) and len(groups) >= 5, groups
    for group in groups:
        for name in group:
            assert name.strip("/") in RANK, f"docs/design.md names '{name}', which LAYERS does not place"
        assert len({RANK[n.strip('/')] for n in group}) == 1, f"design.md puts {group} in one layer"
    ranks = [RANK[group[0].strip("/")] for group in groups]
    assert ranks == sorted(set(ranks)), f"design.md's order {groups} disagrees with LAYERS"


# ------------------------------------------------------------------ the check catches what it names

@pytest.mark.parametrize("file,source,expected", [
    ("model/ops.py", "from hzpsim.sim.engine import simulate", "upward import, 'model' (layer 1) imports 'sim'"),
    ("strategies/zero.py", "def f():\n    from hzpsim import run\n", "upward import, 'strategies'"),
    ("hardware/topology.py", "from ..report import to_json", "upward import, 'hardware' (layer 3) imports 'report'"),
    ("sim/engine.py", "from hzpsim.strategies import zero", "the engine never imports a strategy"),
    ("strategies/_sharded.py", "import simpy", "simpy may be imported only in hzpsim/sim"),
    ("report.py", "import matplotlib.pyplot as plt", "matplotlib may be imported only in hzpsim/plots"),
    ("run.py", "from torch import nn", "torch may be imported only in hzpsim/executor"),
    ("report.py", "from hzpsim.newthing import x", "'newthing' is in no layer"),
    ("newthing.py", "import os", "module layer 'newthing' is in no layer"),
])
def test_the_check_catches_each_kind_of_violation(file, source, expected):
    problems = violations(PACKAGE / file, source)
    assert len(problems) == 1 and expected in problems[0], problems
    assert problems[0].startswith(f"hzpsim/{file}:"), problems  # names the offending file


@pytest.mark.parametrize("file,source", [
    ("cli.py", "from hzpsim import __version__, strategies, validation"),
    ("report.py", "from hzpsim.sim.engine import Trace"),
    ("strategies/zero.py", "from hzpsim.strategies import _family"),
    ("sim/network.py", "import simpy"),
    ("strategies/__init__.py", "from . import _family\nfrom ..config import ScenarioError"),
])
def test_the_check_allows_downward_and_same_layer_imports(file, source):
    assert violations(PACKAGE / file, source) == []


# ------------------------------------------------------------------ the house rules of the redesign

def _module_graph() -> dict[str, set[str]]:
    """module -> the hzpsim modules it imports (the most specific module each import names:
    ``from hzpsim.strategies import _family`` is ``hzpsim.strategies._family``), lazy imports
    inside functions included; imports under ``if TYPE_CHECKING:`` (annotations only, never
    executed) left out."""
    names = {module_name(p): p for p in MODULES}
    graph: dict[str, set[str]] = {m: set() for m in names}
    for mod, path in names.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(sub) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
                       for stmt in node.body for sub in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in names else target for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[mod].update(t for t in targets if t in names and t != mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle of ``graph`` (one per strongly connected component of 2+ modules)."""
    import networkx as nx

    g = nx.DiGraph([(a, b) for a, targets in graph.items() for b in targets])
    return [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]


def test_no_import_cycle_inside_the_package():
    """No circle at all, not even inside a package (no allowed exceptions)."""
    found = cycles(_module_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_catches_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


MAX_LINES = 800
MAX_TOP_MODULES = 8


def test_no_module_over_800_lines_and_few_modules_at_the_top():
    long = [f"{p.relative_to(REPO)}: {n}" for p in MODULES
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines: {long}"
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules directly under hzpsim/: {top}"
