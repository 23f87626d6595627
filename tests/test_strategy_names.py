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
import functools
from pathlib import Path
from typing import Any

import pytest

from hzpsim import strategies
from hzpsim.validation.cells import RowSkipped, blank, cell_text, whole

PACKAGE = Path(__file__).resolve().parents[1] / "hzpsim"

# Files another change is taking the names out of, tolerated until it lands: file -> why.
KNOWN: dict[str, str] = {}


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
        "megatron_fsdp": "#937860", "asynchzp": "#da8bc3", "ddp": "#8c8c8c"}
    assert plots.published_family_colors() == {
        "nd": "#4c72b0", "fsdp": "#55a868", "zero3": "#dd8452", "zeropp": "#8172b2", "zero2": "#c44e52"}


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
    assert strategies.published_families() == ["fsdp", "zero2", "zero3", "nd", "zeropp"]
    assert [strategies.published_owner(f)[0].__name__.rsplit(".", 1)[1] for f in ("fsdp", "nd", "zeropp")] == [
        "zero", "nd", "zeropp"]
    assert strategies.published_owner("nd")[1] == ("tp", "pp")
    assert strategies.published_owner("ddp") is None


# ------------------------------------------------------------------ the replaced rules, as the oracle

def _old_map_implementation(row: dict[str, Any], strategy: str) -> tuple[str, list[str]]:
    from hzpsim.strategies import _implementations

    system = cell_text(row, "system").lower()
    ref = cell_text(row, "source_ref")
    if "deepspeed" in system and strategy in ("zero", "zeropp", "hsdp", "mics"):
        old = "2021" in ref or any(f"0.{v}." in system for v in range(6))
        impl = "deepspeed-2021" if old else "deepspeed"
    elif "torchtitan" in system:
        impl = "fsdp2" if strategy in ("zero", "hsdp") else "torchtitan"
    elif "fsdp" in system and strategy in ("zero", "hsdp") or "fairscale" in system and strategy in ("zero", "hsdp"):
        impl = "fsdp1"
    elif any(k in system for k in ("megatron-core", "nemo", "megatron-bridge")):
        impl = "megatron-core"
    elif "megatron" in system:
        impl = "megatron-2021" if strategy == "nd" else "deepspeed"
    else:
        impl = _implementations.DEFAULTS[strategy]
        return impl, [f"implementation: {impl} (the strategy's default; system {system!r} not recognised)"]
    return impl, []


def _old_map_strategy(row: dict[str, Any], n_gpus: int, gpus_per_node: int) -> tuple[dict[str, Any], list[str]]:
    from hzpsim.validation.mapping import _sequence_parallel

    family = cell_text(row, "strategy_family")
    notes: list[str] = []
    system = cell_text(row, "system").lower()
    tp, pp, cp, ep = (whole(row, c, 1) or 1 for c in ("tp", "pp", "cp", "ep"))
    if family == "nd" and (blank(row.get("tp")) or blank(row.get("pp"))):
        raise RowSkipped(f"{'tp' if blank(row.get('tp')) else 'pp'}: not given (parallel layout unknown)")
    dp = whole(row, "dp")
    if dp is None:
        if n_gpus % (tp * pp * cp):
            raise RowSkipped(f"dp: not given and n_gpus {n_gpus} not divisible by tp*pp*cp")
        dp = n_gpus // (tp * pp * cp)
        notes.append("dp blank -> n_gpus/(tp*pp*cp)")
    if tp * pp * cp * dp != n_gpus:
        raise RowSkipped(f"dp: tp*pp*cp*dp = {tp * pp * cp * dp} != n_gpus {n_gpus}")
    zs = whole(row, "zero_stage")
    if family in ("fsdp", "zero3", "zero2"):
        stage = 2 if family == "zero2" else (zs if zs in (2, 3) else 3)
        if tp > 1 or pp > 1 or cp > 1 or ep > 1:
            family = "nd"
            zs = stage
            notes.append(f"FSDP with tp/pp/cp > 1 -> nd with zero_stage {stage}")
        else:
            sg_text = cell_text(row, "sharding_group")
            sg = int(sg_text) if sg_text.isdigit() else None
            if sg is not None and sg < dp:
                if dp % sg:
                    raise RowSkipped(f"sharding_group: {sg} does not divide dp {dp}")
                return {"name": "hsdp", "shard_group_size": sg}, notes
            s: dict[str, Any] = {"name": "zero", "stage": stage}
            if "fsdp" in system and stage == 2:
                s["overlap_param_gather"] = True
            return s, notes
    if family == "zeropp":
        return {"name": "zeropp", "hpz_partition_size": gpus_per_node, "quantized_weights": True,
                "quantized_gradients": True}, notes
    if family != "nd":
        raise RowSkipped(f"strategy_family: unknown family {family!r}")
    if zs is None:
        zs = 1 if any(k in system for k in ("megatron-core", "nemo", "megatron-bridge")) else 0
        notes.append(f"zero_stage blank -> {zs} ({'distributed optimizer, NeMo/MCore default' if zs else 'plain DP'})")
    vpp = whole(row, "vpp", 1) or 1
    return {"name": "nd", "tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep, "vpp": vpp, "zero_stage": zs,
            "sequence_parallel": _sequence_parallel(row, tp)}, notes


def _old_regimes(name: str, impl: str) -> list[str]:
    if name == "nd":
        return ["Megatron ND"]
    if name == "hsdp":
        return ["HSDP"]
    if name in ("zero", "zeropp", "mics"):
        return ["DeepSpeed ZeRO" if impl.startswith("deepspeed") else "FSDP/ZeRO-3"]
    return []


def _outcome(fn, *args):
    try:
        return fn(*args)
    except RowSkipped as exc:
        return f"skipped: {exc}"


@functools.cache
def _rows() -> list[dict[str, Any]]:
    from hzpsim.validation import read_rows

    base = {"strategy_family": "fsdp", "system": "test", "n_gpus": 16.0, "tp": 1.0, "pp": 1.0, "dp": 16.0,
            "cp": 1.0, "ep": 1.0, "zero_stage": 3.0, "sharding_group": "16", "notes": ""}
    fabricated = [
        {}, {"sharding_group": "8"}, {"sharding_group": "6"}, {"strategy_family": "zero2", "system": "pytorch fsdp"},
        {"strategy_family": "zero3", "zero_stage": 2.0, "system": "fsdp"}, {"tp": 2.0, "dp": 8.0},
        {"tp": 2.0, "dp": 8.0, "vpp": 2.5}, {"strategy_family": "nd", "tp": None},
        {"strategy_family": "nd", "pp": None, "dp": None}, {"strategy_family": "nd", "tp": 2.0, "dp": 8.0, "vpp": 2.5},
        {"strategy_family": "nd", "tp": 4.0, "dp": 4.0, "zero_stage": None, "system": "nemo"},
        {"strategy_family": "nd", "tp": 4.0, "dp": 4.0, "zero_stage": 1.5},
        {"strategy_family": "zeropp", "sharding_group": "hpZ"}, {"strategy_family": "mics"},
        {"strategy_family": "nosuch", "dp": 5.0}, {"strategy_family": "nosuch"}, {"dp": None, "tp": 3.0},
    ]
    return read_rows() + [{**base, **f} for f in fabricated]


def test_the_plugins_map_published_rows_as_the_old_rules_did():
    from hzpsim.validation.mapping import map_strategy

    rows = _rows()
    for i, row in enumerate(rows):
        n = whole(row, "n_gpus") if not blank(row.get("n_gpus")) else None
        if n is None:
            continue
        gpn = whole(row, "gpus_per_node") or 8
        assert _outcome(map_strategy, row, n, gpn) == _outcome(_old_map_strategy, row, n, gpn), (i, row)
    assert _outcome(map_strategy, rows[-2], 16, 8) == "skipped: strategy_family: unknown family 'nosuch'"
    assert _outcome(map_strategy, rows[-3], 16, 8) == "skipped: dp: tp*pp*cp*dp = 5 != n_gpus 16"


SYSTEMS = ["Megatron-LM", "Megatron-DeepSpeed", "Megatron-Core", "NeMo", "Megatron-Bridge", "torchtitan",
           "PyTorch FSDP", "FairScale FSDP", "DeepSpeed ZeRO-3 v0.5.1", "DeepSpeed", "LLM-Foundry", "metaseq",
           "megatron-core fsdp", "torchtitan megatron", "something else", ""]


@pytest.mark.parametrize("strategy", sorted(set(strategies.available())))
def test_the_plugins_name_implementations_as_the_old_rules_did(strategy):
    from hzpsim.validation.mapping import map_implementation

    systems = SYSTEMS + sorted({cell_text(r, "system") for r in _rows()})
    for system in systems:
        for ref in ("", "blog 2021"):
            row = {"system": system, "source_ref": ref}
            assert map_implementation(row, strategy) == _old_map_implementation(row, strategy), (system, ref)


@pytest.mark.parametrize("strategy", sorted(set(strategies.available())))
def test_the_plugins_name_validation_regimes_as_the_old_rules_did(strategy):
    from hzpsim.model import Model
    from hzpsim.validation.regimes import regimes_of

    model = Model(2, 64, 4, 128, 256, 32)
    for impl in ("deepspeed", "deepspeed-2021", "fsdp1", "fsdp2", "megatron-core", "megatron-2021", "torchtitan", ""):
        mapping = {"strategy": {"name": strategy, "implementation": impl}}
        assert list(regimes_of(mapping, model)) == _old_regimes(strategy, impl), impl
