"""Shared test helpers."""

from __future__ import annotations

import dataclasses
import json

from hzpsim.run import run_choice


def without_variability(scenario):
    """The same scenario with ``cluster.variability`` and ``variability_persistent`` 0 (the
    deterministic model)."""
    return dataclasses.replace(scenario, cluster=dataclasses.replace(scenario.cluster, variability=0.0,
                                                                     variability_persistent=0.0))


def assert_symmetry_matches_expansion(scenario) -> None:
    """One simulated rank per equivalence class gives the same JSON as simulating every rank
    (but for the wall time and the event count: the expanded run does more work), with the
    variability off: with it on, the expanded run samples draws (tests/test_variability.py)."""
    scenario = without_variability(scenario)
    choice = scenario.strategies[0]
    sym = run_choice(scenario, choice)
    full = run_choice(scenario, choice, expand=True)
    for key in ("sim_wall_s", "num_events"):
        sym.pop(key)
        full.pop(key)
    assert json.dumps(sym, sort_keys=True) == json.dumps(full, sort_keys=True)


# Property-based tests explore new inputs on a developer's machine; in CI they replay a fixed,
# derandomized set so that a submission's result does not depend on luck.
import os  # noqa: E402

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
