"""Strategy names live in the plugins: code outside ``hzpsim/strategies/`` and ``hzpsim/executor/``
asks a plugin (``ORDER``, ``COLOR``, ``DEFAULT_RUNS``, ``STAND_INS``, ``PUBLISHED_FAMILIES`` with
``from_published``, ``FRAMEWORK_IMPLEMENTATIONS``, ``VALIDATION_REGIMES``; read through
``hzpsim.strategies``) instead of spelling a name.

The rules the plugins took over from ``validation/mapping.py`` and ``validation/regimes.py`` are
checked against the code they replaced (kept below as the oracle), row by row on the packaged
published-run table and on fabricated rows.
"""

from __future__ import annotations

import ast
from pathlib import Path

from hzpsim import strategies

PACKAGE = Path(__file__).resolve().parents[1] / "hzpsim"

# Files another change is taking the names out of, tolerated until it lands: file -> why.
KNOWN: dict[str, str] = {
    # hzpsim import (issue 23): each importer maps a framework's config onto a strategy by name;
    # moving that mapping into plugin declarations is follow-up work
    "cli/imports/megatron.py": "Megatron launch -> nd",
    "cli/imports/torchtitan.py": "torchtitan layout -> zero / hsdp / ddp / nd",
    "cli/imports/deepspeed.py": "DeepSpeed zero_optimization -> zero / zeropp / mics / ddp",
}


def _names() -> set[str]:
    return set(strategies.available()) | {"zero2", "zero3"}


def literal_names(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant that is exactly a strategy name, docstrings left out."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # attribute docstrings
            docstrings.add(id(node.value))
    names = _names()
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
            and id(node) not in docstrings]


def test_no_strategy_name_is_spelled_outside_the_plugins_and_the_executor():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("strategies/", "executor/")) or rel in KNOWN:
            continue
        found += [f"hzpsim/{rel}:{line}: {text!r}" for line, text in literal_names(path.read_text(encoding="utf-8"))]
    assert not found, "ask the plugin (hzpsim/strategies/__init__.py) instead:\n" + "\n".join(found)


def test_the_check_sees_a_name_and_not_a_docstring():
    source = '"""nd and zero."""\nX = "hsdp"\n\ndef f():\n    """zero"""\n    return {"name": "zero3"}\n'
    assert literal_names(source) == [(2, "hsdp"), (6, "zero3")]


def test_every_shipped_plugin_declares_its_place_and_colour():
    shipped = [m for m in strategies.available() if (PACKAGE / "strategies" / f"{m}.py").is_file()]
    orders = [strategies.declared(n, "ORDER") for n in shipped]
    colors = [strategies.declared(n, "COLOR") for n in shipped]
    assert None not in orders and None not in colors
    assert len(set(orders)) == len(shipped) and len(set(colors)) == len(shipped)
    assert strategies.ordered()[:4] == ["zero", "hsdp", "nd", "asynchzp"]
    assert strategies.color("no-such-strategy", "#333333") == "#333333"


def test_figure_colours_are_what_they_were():
    from hzpsim import plots

    assert {n: strategies.color(n) for n in strategies.available()} == {
        "nd": "#4c72b0", "zero": "#dd8452", "hsdp": "#55a868", "mics": "#c44e52", "zeropp": "#8172b2",
        "megatron_fsdp": "#937860", "asynchzp": "#da8bc3", "ddp": "#8c8c8c", "co2": "#ccb974"}
    assert plots.published_family_colors() == {
        "fsdp": "#55a868", "zero3": "#dd8452", "zero2": "#c44e52", "hsdp": "#4c72b0", "nd": "#8172b2",
        "zeropp": "#937860"}


def test_the_default_comparison_is_what_it_was():
    """``hzpsim run`` without a scenario compares these, in this order (the plugins' DEFAULT_RUNS)."""
    from hzpsim.scenario import DEFAULT_SCENARIO

    assert DEFAULT_SCENARIO["strategies"] == [
        {"name": "zero", "stage": 1}, {"name": "zero", "stage": 2}, {"name": "zero", "stage": 3}, {"name": "hsdp"},
        {"name": "nd", "tp": 8, "pp": 4, "sequence_parallel": True, "zero_stage": 1},
        {"name": "asynchzp"}, {"name": "asynchzp", "adaptive": True}]


def test_stand_ins_simplest_first():
    assert strategies.stand_ins() == [{"name": "ddp"}, {"name": "zero", "stage": 3}] + [
        {"name": "nd", "pp": p} for p in (2, 4, 8, 16, 32, 64)]


def test_published_families_and_their_owners():
    assert strategies.published_families() == ["fsdp", "zero2", "zero3", "hsdp", "nd", "zeropp"]
    assert [strategies.published_owner(f)[0].__name__.rsplit(".", 1)[1] for f in ("fsdp", "nd", "zeropp")] == [
        "zero", "nd", "zeropp"]
    assert strategies.published_owner("nd")[1] == ("tp", "pp")
    assert strategies.published_owner("ddp") is None
