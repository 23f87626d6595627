"""Golden-file regression: key predictions of reference scenarios may not move unnoticed.

Regenerate (only for an intended, explained change) with
    HZPSIM_UPDATE_GOLDENS=1 python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from hzpsim.cli import run_choice
from hzpsim.scenario import load_scenario, scenario_from_mapping

HERE = Path(__file__).parent / "golden"
SCENARIOS = yaml.safe_load((HERE / "scenarios.yaml").read_text())
EXPECTED_FILE = HERE / "expected.json"
KEYS = ("step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes", "exposed_comm_s", "comm_bytes_per_device")


def key_outputs(name: str) -> list[dict]:
    spec = SCENARIOS[name]
    scenario = load_scenario(None) if spec.get("default") else scenario_from_mapping(spec)
    out = []
    for choice in scenario.strategies:
        report = run_choice(scenario, choice)
        out.append({"strategy": report["strategy_resolved"], **{k: report[k] for k in KEYS}})
    return out


def _close(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, float | int) and not isinstance(a, bool):
        return a == pytest.approx(b, rel=1e-9, abs=1e-12)
    return a == b


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden(name):
    got = key_outputs(name)
    if os.environ.get("HZPSIM_UPDATE_GOLDENS"):
        expected = json.loads(EXPECTED_FILE.read_text()) if EXPECTED_FILE.exists() else {}
        expected[name] = got
        EXPECTED_FILE.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
        return
    expected = json.loads(EXPECTED_FILE.read_text())
    assert name in expected, f"no golden for {name}: run with HZPSIM_UPDATE_GOLDENS=1"
    assert len(got) == len(expected[name])
    for g, e in zip(got, expected[name], strict=True):
        assert _close(g, e), f"{name} {g['strategy']}: {json.dumps(g)} != golden {json.dumps(e)}"


def test_every_golden_scenario_is_listed():
    expected = json.loads(EXPECTED_FILE.read_text())
    assert set(expected) == set(SCENARIOS)
