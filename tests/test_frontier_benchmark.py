"""benchmarks/frontier.py: the Dash et al. (arXiv 2312.12705) rows and their scenarios.

    python -m pytest tests/test_frontier_benchmark.py
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hzpsim.scenario import scenario_from_mapping

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "frontier.py"
_spec = importlib.util.spec_from_file_location("frontier_benchmark", _PATH)
assert _spec and _spec.loader
frontier = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = frontier  # dataclasses look their module up
_spec.loader.exec_module(frontier)


def test_rows_are_the_abstracts_figures_and_carry_no_made_up_layout():
    assert [(r.model, r.measured_fraction_of_peak) for r in frontier.ROWS] == [
        ("GPT-22B", 0.3838), ("GPT-175B", 0.3614), ("GPT-1T", 0.3196)]
    assert all(r.layout is None and r.source == frontier.ABSTRACT for r in frontier.ROWS)
    assert frontier.PEAK_TFLOPS_PER_GCD == pytest.approx(191.5)


def test_table_prints_measured_and_no_prediction_without_a_layout():
    lines = frontier.table()
    assert len(lines) == 4
    assert "38.38%" in lines[1] and "73.5" in lines[1]  # 0.3838 x 191.5 TF
    assert all("not predicted: no layout" in line for line in lines[1:])


def test_a_row_with_a_layout_builds_an_nd_megatron_deepspeed_scenario_on_frontier():
    # a synthetic layout, NOT the paper's: it only exercises the path a retrieved table would take
    layout = frontier.Layout(num_layers=4, hidden_size=512, num_heads=8, seq_len=512, global_batch_size=16,
                             micro_batch_size=1, tp=2, pp=2, zero_stage=1, flash_attention=True)
    row = replace(frontier.ROWS[0], layout=layout, n_gcds=16)
    mapping = frontier.scenario_mapping(row, 16)
    assert mapping["strategy"]["implementation"] == "megatron-2021"  # the published rows' rule for Megatron-DeepSpeed
    scenario = scenario_from_mapping(mapping)
    assert scenario.cluster.preset == "frontier" and scenario.topology.num_devices == 16
    with pytest.raises(ValueError, match="no layout"):
        frontier.scenario_mapping(frontier.ROWS[0], 16)


def test_a_row_with_a_layout_and_gcd_count_is_simulated_and_scored():
    # synthetic (tiny model, 16 GCDs): checks the prediction path and the error column, not the paper
    layout = frontier.Layout(num_layers=4, hidden_size=512, num_heads=8, seq_len=512, global_batch_size=16,
                             micro_batch_size=1, tp=2, pp=2, zero_stage=1, flash_attention=True)
    row = replace(frontier.ROWS[0], layout=layout, n_gcds=16)
    report = frontier.predict(row)
    assert report is not None and 0 < report["mfu"] < 1
    line = frontier.table((row,))[1]
    assert f"{report['mfu']:.2%}" in line and f"{report['mfu'] / 0.3838 - 1:+.1%}" in line
