"""``--json`` output against docs/contract.md: every key printed is documented there with its
type, and every documented required key is printed.

    python -m pytest tests/test_contract.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hzpsim.cli import main

DOC = Path(__file__).resolve().parent.parent / "docs" / "contract.md"
TINY = ["--set", "model=tiny-dense", "--set", "cluster.num_nodes=2", "--set", "training.global_batch_size=32"]


def tables() -> dict[str, dict[str, str]]:
    """{section heading: {key: type}} from the markdown tables of docs/contract.md."""
    out: dict[str, dict[str, str]] = {}
    section = ""
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line[3:]
        match = re.match(r"\| `([a-z_]+)` \| ([^|]+) \|", line)
        if match:
            out.setdefault(section, {})[match.group(1)] = match.group(2).strip()
    return out


def type_ok(value, declared: str) -> bool:
    options = {
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "null": lambda v: v is None,
    }
    return any(options[t.strip()](value) for t in declared.replace(" or ", ",").split(","))


def run_json(capsys, *argv: str):
    capsys.readouterr()
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def assert_prediction(obj: dict, spec: dict[str, str], search: bool = False) -> None:
    optional = ({"training_resolved"} if not search else set()) | {"distinguishable_from_best"}
    undocumented = set(obj) - set(spec)
    assert not undocumented, f"keys printed but not in docs/contract.md: {undocumented}"
    missing = set(spec) - set(obj) - optional
    assert not missing, f"documented keys not printed: {missing}"
    for key, value in obj.items():
        assert type_ok(value, spec[key]), (key, value, spec[key])
    assert set(obj["memory_breakdown_bytes"]) == {"params", "grads", "optimizer", "activations", "temporaries", "buffers", "other"}
    assert set(obj["comm_bytes_per_device"]) == {"intra_node", "inter_node"}
    assert sum(obj["time_breakdown_s"].values()) == pytest.approx(obj["step_time_s"], rel=1e-6)


def test_the_doc_has_both_tables():
    t = tables()
    assert len(t) == 2
    prediction, search = t.values()
    assert "step_time_s" in prediction and "best_per_family" in search


@pytest.mark.parametrize("strategy", [["--set", "strategy.name=zero"],
                                      ["--set", "strategy.name=nd", "--set", "strategy.pp=2", "--set", "strategy.tp=2"]])
def test_run_json_matches_the_contract(capsys, strategy):
    spec = next(iter(tables().values()))
    assert_prediction(run_json(capsys, "run", *TINY, *strategy, "--json"), spec)


def test_search_json_matches_the_contract(capsys):
    prediction, search = tables().values()
    data = run_json(capsys, "search", *TINY, "--json", "--workers", "1", "--space", "pp=1,2", "--space", "tp=1,2",
                    "--space", "micro_batch_size=1", "--space", "vpp=1")
    assert set(data) == set(search)
    for key, value in data.items():
        assert type_ok(value, search[key]), (key, value)
    for entry in [data["best"], *data["top"], *(v for v in data["best_per_family"].values() if v)]:
        assert_prediction(entry, prediction, search=True)
    assert all("distinguishable_from_best" in entry for entry in data["top"])
    assert data["top"][0]["distinguishable_from_best"] is False  # the best itself
    assert data["num_pruned"] == data["num_pruned_memory"] + data["num_pruned_bound"]
    assert data["num_candidates"] == (data["num_simulated"] + data["num_pruned"] + data["num_invalid"]
                                      + data["num_skipped"])
