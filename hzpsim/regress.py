"""``hzpsim regress GOLDENS``: predictions against expected values, for your own CI (the
command's options and exit code are :mod:`hzpsim.cli.regress`).

    hzpsim regress tests/goldens.yaml              # diff table; exit 1 if a prediction moved
    hzpsim regress my-goldens.yaml --update        # fill / rewrite every entry's expected values
    hzpsim regress my-goldens.yaml --only gpt3-nd  # one entry

A goldens file is a YAML list of entries::

    - name: llama3-8b-zero3                # unique
      scenario: scenarios/llama3-8b.yaml   # a path (relative to this file), a mapping, or "default"
      set: [strategy.name=zero]            # optional --set overrides
      tolerance: 0.005                     # optional relative tolerance (default 0.5 %)
      expected:                            # contract keys (docs/contract.md); dots reach into
        step_time_s: 1.234                 #   nested objects (comm_bytes_per_device.inter_node)
        peak_memory_bytes: 5.6e10

The scenario must name one strategy (after ``set``). ``--update`` writes every numeric key of
the contract (nested ones with dots; not ``sim_wall_s`` or ``num_events``, which measure the
simulator, not the prediction). Exit codes: 0 every prediction within its tolerance; 1 one
moved (or an entry has no expected values yet); 2 invalid goldens file.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hzpsim.config import ScenarioError
from hzpsim.presets import read_yaml
from hzpsim.scenario import Scenario, load_scenario, scenario_from_mapping

DEFAULT_TOLERANCE = 0.005
NOT_PREDICTIONS = ("sim_wall_s", "num_events")
NESTED = ("memory_breakdown_bytes", "comm_bytes_per_device")
_ENTRY_KEYS = ("name", "scenario", "set", "tolerance", "expected")


@dataclass
class Golden:
    name: str
    scenario: Any  # path string, mapping or "default"
    overrides: list[str] = field(default_factory=list)
    tolerance: float = DEFAULT_TOLERANCE
    expected: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    """One expected key of one entry."""

    name: str
    key: str
    expected: Any
    got: Any
    tolerance: float

    @property
    def change(self) -> float | None:
        """Relative change (got - expected) / |expected|; None when not numeric."""
        if not (_is_number(self.expected) and _is_number(self.got)):
            return None
        if self.expected == 0:
            return 0.0 if self.got == 0 else math.inf
        return (self.got - self.expected) / abs(self.expected)

    @property
    def ok(self) -> bool:
        change = self.change
        if change is None:
            return bool(self.expected == self.got)
        return abs(change) <= self.tolerance


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def load_goldens(path: str | Path) -> list[Golden]:
    """Parse and validate a goldens file (ScenarioError naming the entry otherwise)."""
    file = Path(path)
    if not file.is_file():
        raise ScenarioError(f"{path}: no such goldens file")
    data = read_yaml(file)
    if not isinstance(data, list) or not data:
        raise ScenarioError(f"{path}: expected a non-empty list of entries")
    out: list[Golden] = []
    seen: set[str] = set()
    for i, entry in enumerate(data):
        where = f"{path}[{i}]"
        if not isinstance(entry, dict):
            raise ScenarioError(f"{where}: expected a mapping with name, scenario, expected")
        unknown = [k for k in entry if k not in _ENTRY_KEYS]
        if unknown:
            raise ScenarioError(f"{where}.{unknown[0]}: unknown key (allowed: {', '.join(_ENTRY_KEYS)})")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ScenarioError(f"{where}.name: required (a string)")
        if name in seen:
            raise ScenarioError(f"{where}.name: {name!r} appears twice")
        seen.add(name)
        scenario = entry.get("scenario")
        if not isinstance(scenario, str | dict):
            raise ScenarioError(f"{where}.scenario: expected a path, a mapping or 'default'")
        overrides = entry.get("set") or []
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            raise ScenarioError(f"{where}.set: expected a list of KEY.PATH=VALUE strings")
        tolerance = entry.get("tolerance", DEFAULT_TOLERANCE)
        if not _is_number(tolerance) or not 0 <= tolerance < 1:
            raise ScenarioError(f"{where}.tolerance: expected a relative tolerance in [0, 1), got {tolerance!r}")
        expected = entry.get("expected") or {}
        if not isinstance(expected, dict):
            raise ScenarioError(f"{where}.expected: expected a mapping of contract keys to values")
        out.append(Golden(name, scenario, list(overrides), float(tolerance), dict(expected)))
    return out


def scenario_of(golden: Golden, base: Path) -> Scenario:
    try:
        if golden.scenario == "default":
            scenario = load_scenario(None, golden.overrides)
        elif isinstance(golden.scenario, str):
            scenario = load_scenario(base / golden.scenario, golden.overrides)
        else:
            scenario = scenario_from_mapping(golden.scenario, golden.overrides, source=golden.name)
    except ScenarioError as exc:
        raise ScenarioError(f"{golden.name}: {exc}") from None
    if len(scenario.strategies) != 1:
        raise ScenarioError(f"{golden.name}: the scenario has {len(scenario.strategies)} strategies; "
                            "name one (set: [strategy.name=...])")
    return scenario


def predict(golden: Golden, base: Path) -> dict[str, Any]:
    """The contract object of the entry's scenario."""
    from hzpsim.run import run_choice

    scenario = scenario_of(golden, base)
    return run_choice(scenario, scenario.strategies[0])


def flatten(report: dict[str, Any]) -> dict[str, Any]:
    """Every numeric prediction of a contract object, nested ones as ``outer.inner``."""
    out: dict[str, Any] = {}
    for key, value in sorted(report.items()):
        if key in NOT_PREDICTIONS:
            continue
        if key in NESTED and isinstance(value, dict):
            for inner, v in sorted(value.items()):
                if _is_number(v):
                    out[f"{key}.{inner}"] = v
        elif _is_number(value):
            out[key] = value
    return out


def lookup(report: dict[str, Any], key: str) -> Any:
    node: Any = report
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


class _Missing:
    def __repr__(self) -> str:
        return "missing"


_MISSING = _Missing()


def check(goldens: list[Golden], base: Path, update: bool = False,
          only: list[str] | None = None) -> tuple[list[Check], list[str], list[Golden]]:
    """(checks, entries without expected values, goldens as updated)."""
    if only:
        names = {g.name for g in goldens}
        for name in only:
            if name not in names:
                raise ScenarioError(f"--only {name}: no such entry (entries: {', '.join(sorted(names))})")
    checks: list[Check] = []
    empty: list[str] = []
    chosen = [g for g in goldens if not only or g.name in only]
    bar = None
    if sys.stderr.isatty() and len(chosen) > 3:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(chosen), desc="hzpsim regress", unit="entry", file=sys.stderr, leave=False)
        except ImportError:
            bar = None
    for golden in chosen:
        if bar is not None:
            bar.update(1)
        report = predict(golden, base)
        if update:
            golden.expected = flatten(report)
            continue
        if not golden.expected:
            empty.append(golden.name)
            continue
        for key, value in golden.expected.items():
            checks.append(Check(golden.name, key, value, lookup(report, key), golden.tolerance))
    if bar is not None:
        bar.close()
    return checks, empty, goldens


def format_diff(checks: list[Check], empty: list[str], verbose: bool = False) -> str:
    """One line per entry (worst change), then one per moved key."""
    lines = [f"{'entry':<34} {'key':<36} {'expected':>14} {'got':>14} {'change':>9} {'tol':>7}  status"]
    lines.append("-" * len(lines[0]))
    by_entry: dict[str, list[Check]] = {}
    for c in checks:
        by_entry.setdefault(c.name, []).append(c)
    for name, items in by_entry.items():
        moved = [c for c in items if not c.ok]
        shown = items if verbose else (moved or [max(items, key=lambda c: abs(c.change or 0.0))])
        for c in shown:
            change = c.change
            text = "-" if change is None else ("inf" if math.isinf(change) else f"{change:+.3%}")
            status = "ok" if c.ok else "MOVED"
            if not moved and not verbose:
                status = f"ok ({len(items)} keys)"
            lines.append(f"{name:<34} {c.key:<36} {_fmt(c.expected):>14} {_fmt(c.got):>14} {text:>9} "
                         f"{c.tolerance:>7.2%}  {status}")
    for name in empty:
        lines.append(f"{name:<34} {'(no expected values: run with --update)':<36}")
    moved_count = sum(not c.ok for c in checks)
    lines.append("")
    lines.append(f"{len(by_entry)} entries, {len(checks)} values checked: "
                 + (f"{moved_count} moved beyond tolerance" if moved_count else "all within tolerance")
                 + (f"; {len(empty)} without expected values" if empty else ""))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if _is_number(value):
        return f"{value:.6g}"
    return str(value)


def write_goldens(path: Path, goldens: list[Golden]) -> None:
    """Rewrite the file with the updated expected values (leading comment lines kept)."""
    text = path.read_text(encoding="utf-8")
    header = []
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            header.append(line)
        else:
            break
    entries = []
    for g in goldens:
        entry: dict[str, Any] = {"name": g.name, "scenario": g.scenario}
        if g.overrides:
            entry["set"] = g.overrides
        if g.tolerance != DEFAULT_TOLERANCE:
            entry["tolerance"] = g.tolerance
        entry["expected"] = g.expected
        entries.append(entry)
    body = yaml.safe_dump(entries, sort_keys=False, default_flow_style=False, width=110)
    path.write_text("\n".join(header) + ("\n" if header else "") + body, encoding="utf-8")
