"""The scenario every tests/test_scenario_*.py file starts from, and how they load it."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hzpsim.config import ScenarioError
from hzpsim.scenario import scenario_from_mapping

# A valid scenario that simulates in a few milliseconds: the base every test mutates.
BASE: dict[str, Any] = {
    "model": "tiny-dense",
    "training": {"global_batch_size": 8},
    "cluster": {"preset": "dgx-h100", "num_nodes": 1},
    "strategy": {"name": "zero", "stage": 3},
}


def base(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data.update(changes)
    return data


def load(data: Any, *overrides: str):
    return scenario_from_mapping(data, overrides)


def error_of(data: Any, *overrides: str) -> str:
    with pytest.raises(ScenarioError) as info:
        load(data, *overrides)
    return str(info.value)
