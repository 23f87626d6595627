"""Prediction intervals (``hzpsim.calibration.intervals``): drawn from held-out errors of the
run's regime, split-conformal, widened on a device no row calibrates, and reported by ``run``."""

from __future__ import annotations

import math

import pytest

from hzpsim import strategies
from hzpsim.calibration import intervals
from hzpsim.calibration import profile as calibration


def _profile(errors: list[tuple[str, tuple[str, ...], float]], ratios: dict[str, float] | None = None) -> calibration.Profile:
    report = {"cv_log_errors": [{"label": f"r{i}", "source": s, "regimes": list(r), "log_error": e}
                                for i, (s, r, e) in enumerate(errors)],
              "gemm_fit_over_prior": ratios or {}}
    return calibration.Profile(calibration.priors(), report=report)


def test_conformal_bounds_take_the_ranks_split_conformal_prescribes() -> None:
    errors = [float(i) for i in range(1, 20)]  # n = 19: ranks floor(20 * 0.1) = 2, ceil(20 * 0.9) = 18
    assert intervals.conformal_bounds(errors) == (2.0, 18.0)
    assert intervals.conformal_bounds([0.3]) == (0.3, 0.3)  # one row: its error both ways
    with pytest.raises(ValueError):
        intervals.conformal_bounds([])


def test_interval_comes_from_the_most_specific_regime_with_enough_rows() -> None:
    dense = [(f"S{i % 4}", ("Megatron ND",), 0.01 * (i - 10)) for i in range(20)]  # -0.10 .. +0.09
    moe = [(f"S{i % 3}", ("Megatron ND", "MoE"), 0.2 + 0.01 * i) for i in range(10)]  # predicted too fast
    prof = _profile(dense + moe)
    iv = intervals.interval(("Megatron ND", "MoE"), True, 1000.0, 2.0, prof)
    basis = iv["interval_basis"]
    assert basis["regime"] == "MoE" and basis["num_rows"] == 10 and basis["num_sources"] == 3
    low_err, high_err = intervals.conformal_bounds([e for _, _, e in moe])
    assert iv["tokens_per_s_interval"] == pytest.approx([1000 * math.exp(-high_err), 1000 * math.exp(-low_err)])
    assert iv["step_time_interval_s"] == pytest.approx([2.0 * math.exp(low_err), 2.0 * math.exp(high_err)])
    assert iv["tokens_per_s_interval"][1] < 1000  # the MoE rows were all predicted too fast
    dense_iv = intervals.interval(("Megatron ND",), True, 1000.0, 2.0, prof)
    # a dense run: the dense rows of its family only, not the MoE rows that are in it too
    assert dense_iv["interval_basis"]["regime"] == "Megatron ND" and dense_iv["interval_basis"]["num_rows"] == 20
    assert dense_iv["tokens_per_s_interval"][0] < 1000 < dense_iv["tokens_per_s_interval"][1]
    # too few rows of a regime: every dense row, and it says which regime was short
    assert intervals.interval(("HSDP",), True, 1000.0, 2.0, prof)["interval_basis"]["regime"] == "all dense runs (HSDP: 0 rows)"
    # no regime at all: extrapolated
    assert intervals.interval((), True, 1000.0, 2.0, prof)["interval_basis"]["regime"] == "extrapolated"
    # leaving a source out removes its rows (what validate published checks coverage with):
    # 6 MoE rows of S1 and S2 remain, too few, so every MoE row left
    held = intervals.interval(("Megatron ND", "MoE"), True, 1000.0, 2.0, prof, exclude_source="S0")
    assert held["interval_basis"]["regime"] == "all MoE runs (Megatron ND: 6 rows)"


def test_uncalibrated_device_widens_the_lower_end_by_the_priors_observed_optimism() -> None:
    prof = _profile([("S0", ("Megatron ND",), 0.0)] * 10, {"gemm_sm_efficiency.h100": 0.82, "gemm_sm_efficiency.a100": 0.9})
    calibrated = intervals.interval(("Megatron ND",), True, 1000.0, 1.0, prof)
    widened = intervals.interval(("Megatron ND",), False, 1000.0, 1.0, prof)
    assert calibrated["tokens_per_s_interval"] == pytest.approx([1000.0, 1000.0])
    assert widened["tokens_per_s_interval"] == pytest.approx([820.0, 1000.0])
    assert widened["step_time_interval_s"] == pytest.approx([1.0, 1 / 0.82])
    assert widened["interval_basis"]["uncalibrated_device_widening"] == 0.82
    assert calibrated["interval_basis"]["uncalibrated_device_widening"] is None


def test_no_recorded_errors_no_interval() -> None:
    assert intervals.interval(("Megatron ND",), True, 1.0, 1.0, calibration.Profile(calibration.priors())) is None


def test_regimes_of_a_run() -> None:
    assert strategies.regimes("nd", "megatron-core", False, 1, 4096) == ("Megatron ND",)
    assert strategies.regimes("zero", "deepspeed", True, 1, 4096) == ("DeepSpeed ZeRO", "MoE")
    assert strategies.regimes("zero", "fsdp2", False, 2, 4096) == ("FSDP/ZeRO-3", "long context")
    assert strategies.regimes("asynchzp", "reference", False, 1, 32768) == ("long context",)


def test_run_json_carries_the_interval_around_the_prediction(capsys) -> None:
    """The shipped profile's held-out errors give an FSDP run an interval from its regime's
    rows, with the prediction inside it."""
    import json

    from hzpsim.cli import main

    assert main(["run", "--json", "--set", "model.preset=llama3-8b", "--set", "cluster.num_nodes=1",
                 "--set", "training.global_batch_size=16", "--set", "training.micro_batch_size=2",
                 "--set", "strategy.name=zero", "--set", "strategy.stage=3",
                 "--set", "strategy.implementation=fsdp2"]) == 0
    report = json.loads(capsys.readouterr().out)
    low, high = report["step_time_interval_s"]
    assert low < report["step_time_s"] < high
    tlow, thigh = report["tokens_per_s_interval"]
    assert tlow < report["tokens_per_s"] < thigh
    basis = report["interval_basis"]
    assert basis["regime"] == "FSDP/ZeRO-3" and basis["num_rows"] >= 50 and basis["coverage"] == 0.8
    assert basis["uncalibrated_device_widening"] is None  # an H100: calibrated


def test_reports_frame_carries_the_interval() -> None:
    from hzpsim import frames

    reports = [{"strategy_resolved": {"name": "zero", "stage": 3}, "step_time_s": 2.0, "step_time_interval_s": [1.8, 2.5],
                "tokens_per_s": 1.0, "tokens_per_s_per_device": 1.0, "mfu": 0.4, "peak_memory_bytes": 2**30,
                "fits_in_memory": True, "exposed_comm_s": 0.1, "bubble_fraction": None,
                "comm_bytes_per_device": {"inter_node": 0.0}}]
    frame = frames.reports_frame(reports)
    assert (frame.at[0, "step_time_low_s"], frame.at[0, "step_time_high_s"]) == (1.8, 2.5)
    frame = frames.reports_frame([{**reports[0], "step_time_interval_s": None}])
    assert math.isnan(frame.at[0, "step_time_low_s"])


def test_the_pooled_interval_of_the_coverage_script_weighs_each_source_once() -> None:
    """``scripts/interval_coverage.py``'s alternative: the sources' averaged error distributions.
    A source of 95 rows at 0 and one of 5 rows at 1: pooled, the upper end is source two's error
    (each source half the mass); split conformal over the rows stays at source one's."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "interval_coverage.py"
    spec = importlib.util.spec_from_file_location("interval_coverage", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    errors, sources = [0.0] * 95 + [1.0] * 5, ["a"] * 95 + ["b"] * 5
    assert script.pooled(errors, sources) == (0.0, 1.0)
    assert script.shipped(errors, sources) == (0.0, 0.0)
    assert script.pooled_quantile(errors, sources, 0.5) == 0.0 and script.pooled_quantile(errors, sources, 0.51) == 1.0
    # the random-effects alternative: a new source's offset is drawn like the sources' offsets
    low, high = script.random_effects([0.0, 0.2, 1.0, 1.2], ["a", "a", "b", "b"])
    half = 3.078 * math.sqrt(0.49 + 0.02 + 0.25)  # t(1); between 0.5 - 0.01, within 0.02, the mean's 0.5 / 2
    assert low == pytest.approx(0.6 - half) and high == pytest.approx(0.6 + half)
