"""``hzpsim calibrate``: profiles, the fit, and the command's checks.

The fit must recover constants it did not see: "measurements" simulated with a known profile
are fitted from the priors, and the fitted constants must come back to the known ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hzpsim.calibration import profile as calibration
from hzpsim.calibration.constants import BY_NAME, CONSTANTS
from hzpsim.cli import main
from hzpsim.fitting import published as calibrate
from hzpsim.run import run_choice
from hzpsim.scenario import scenario_from_mapping


def _scenario(device: str, model: str, gbs: int, recompute: str = "none", seq: int = 2048) -> dict:
    preset = "dgx-a100" if device.startswith("a100") else "dgx-h100"
    return {"model": {"preset": model, "seq_len": seq},
            "training": {"global_batch_size": gbs, "micro_batch_size": 2, "activation_recompute": recompute},
            "cluster": {"preset": preset, "device": device, "num_nodes": 1},
            "strategy": {"name": "zero", "stage": 3}}


SCENARIOS = [
    _scenario("a100-80gb", "mpt-7b", 32), _scenario("a100-80gb", "llama3-8b", 16, "full"),
    _scenario("h100-sxm", "mpt-7b", 32), _scenario("h100-sxm", "llama3-8b", 16, "full", 8192),
]
TRUTH = {"gemm_sm_efficiency.a100": 0.80, "gemm_sm_efficiency.h100": 0.75, "attention_kernel_fraction": 0.85,
         "elementwise_hbm_efficiency": 0.70}


def _measure(truth: dict[str, float]) -> list[calibrate.Measurement]:
    out = []
    with calibration.using(calibration.Profile({**calibration.priors(), **truth})):
        for i, s in enumerate(SCENARIOS):
            sc = scenario_from_mapping(s)
            tps = run_choice(sc, sc.strategies[0])["tokens_per_s_per_device"]
            out.append(calibrate.Measurement(f"row{i}", f"S{i % 2}", s, tps))
    return out


@pytest.mark.slow
def test_fit_recovers_the_constants_that_made_the_measurements() -> None:
    fitted, _ = calibrate.calibrate(_measure(TRUTH), calibration.PRIORS, iterations=2)
    for name in ("gemm_sm_efficiency.a100", "gemm_sm_efficiency.h100"):
        assert fitted[name] == pytest.approx(TRUTH[name], rel=0.03), name
    # every row predicted within 1 % at the fitted constants
    assert fitted.report["surrogate_in_sample_median_abs_error"] < 0.01
    assert set(fitted.folds) == {"S0", "S1"}


def test_profile_round_trip_and_bad_files(tmp_path: Path) -> None:
    p = calibration.Profile({**calibration.priors(), "attention_kernel_fraction": 0.9},
                            {"S01": {"attention_kernel_fraction": 0.8}}, "test", {"num_rows": 3})
    path = tmp_path / "p.json"
    path.write_text(p.to_json())
    back = calibration.load(path)
    assert back["attention_kernel_fraction"] == 0.9
    assert back.for_fold("S01")["attention_kernel_fraction"] == 0.8
    assert back.for_fold("S99")["attention_kernel_fraction"] == 0.9
    for text, match in (("not json", "not a calibration profile"), ('{"format": "x"}', "format"),
                        (json.dumps({"format": calibration.FORMAT, "constants": {"nosuch": 1}}), "nosuch"),
                        (json.dumps({"format": calibration.FORMAT, "constants": {"attention_kernel_fraction": -1}}),
                         "positive"),
                        (json.dumps({"format": calibration.FORMAT, "constants": {"gemm_sm_efficiency.h100": 5.0}}),
                         "gemm_sm_efficiency.h100: 5.0 is outside its physical range 0.65-0.92"),
                        (json.dumps({"format": calibration.FORMAT, "constants": {},
                                     "folds": {"S1": {"elementwise_hbm_efficiency": 1.41}}}),
                         "folds.S1.elementwise_hbm_efficiency: 1.41 is outside")):
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            calibration.load(path)


def test_every_constant_has_a_range_around_its_prior() -> None:
    for c in CONSTANTS:
        assert c.low < c.prior < c.high, c.name
        assert c.source and c.meaning
    assert set(BY_NAME) == {c.name for c in CONSTANTS}


def test_shipped_profile_is_the_active_default_and_within_its_ranges_or_explained() -> None:
    shipped = calibration.load(calibration.DEFAULT_PATH)
    assert set(shipped.constants) == set(BY_NAME)
    report = shipped.report
    assert report["num_rows"] >= 129, "no published row that runs may drop out of the fit"
    outside = [n for n, r in report["ranges"].items() if not r["inside"]]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "hardware-constants.md").read_text()
    for name in outside:  # a constant out of range is a finding, written down
        assert f"`{name}` is outside" in doc, name


def test_calibrate_measured_rejects_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    cases = [
        ([], "non-empty list"),
        ([{"scenario": SCENARIOS[0]}], "tokens_per_s_per_device"),
        ([{"scenario": SCENARIOS[0], "tokens_per_s_per_device": -3}], "positive"),
        ([{"scenario": "missing.yaml", "tokens_per_s_per_device": 3}], "not a file"),
        ([{"scenario": SCENARIOS[0], "tokens_per_s_per_device": 3, "colour": 1}], "unknown key"),
        ([{"scenario": {**SCENARIOS[0], "training": {"global_batch_size": 0}}, "tokens_per_s_per_device": 3}],
         "global_batch_size"),
    ]
    for rows, match in cases:
        bad.write_text(yaml.safe_dump(rows))
        assert main(["calibrate", "measured", str(bad)]) == 2
        assert match in capsys.readouterr().err
    assert main(["calibrate", "measured", str(tmp_path / "nope.yaml")]) == 2
    assert main(["calibrate", "published", "--iterations", "0"]) == 2
    assert "--iterations" in capsys.readouterr().err
    assert main(["run", "--profile", str(bad)]) == 2
    assert "--profile" in capsys.readouterr().err
    fast = tmp_path / "fast.json"  # five times the datasheet's GEMM peak: refused, not simulated
    fast.write_text(json.dumps({"format": calibration.FORMAT, "constants": {"gemm_sm_efficiency.h100": 5.0}}))
    assert main(["run", "--profile", str(fast)]) == 2
    assert "gemm_sm_efficiency.h100: 5.0 is outside its physical range" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_measured_writes_a_profile_run_uses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A team's own runs (here: simulated with faster GEMMs, attention and pointwise kernels
    than the shipped fit, so that the two predictions differ) fitted from a YAML file; ``run
    --profile`` then predicts them."""
    measured = _measure({"gemm_sm_efficiency.a100": 0.90, "gemm_sm_efficiency.h100": 0.85})  # all faster than the shipped fit
    rows = [{"scenario": m.scenario, "tokens_per_s_per_device": m.measured_tokens_per_s_per_device, "source": m.source}
            for m in measured]
    src = tmp_path / "runs.yaml"
    src.write_text(yaml.safe_dump(rows))
    out = tmp_path / "fit.json"
    assert main(["calibrate", "measured", str(src), "--out", str(out), "--jobs", "1"]) == 0
    capsys.readouterr()
    sc = tmp_path / "s.yaml"
    sc.write_text(yaml.safe_dump(SCENARIOS[1]))
    assert main(["run", str(sc), "--profile", str(out), "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["tokens_per_s_per_device"]
    assert predicted == pytest.approx(measured[1].measured_tokens_per_s_per_device, rel=0.02)
    assert main(["run", str(sc), "--json"]) == 0  # the shipped fit predicts something else
    assert json.loads(capsys.readouterr().out)["tokens_per_s_per_device"] != pytest.approx(predicted, rel=0.02)


def test_constants_doc_table_is_the_shipped_profile() -> None:
    """docs/hardware-constants.md holds the shipped fit's table (regenerate: print
    hzpsim.fitting.published.constants_table(hzpsim.calibration.profile.load(DEFAULT_PATH)))."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "hardware-constants.md").read_text()
    block = doc.split("<!-- calibration:begin -->\n", 1)[1].split("<!-- calibration:end -->", 1)[0]
    assert block.strip() == calibrate.constants_table(calibration.load(calibration.DEFAULT_PATH)).strip()


def test_profile_means_one_thing_for_every_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--profile`` is one option with one file format for run, compare, search, validate
    published and validate executor; a profile carrying a machine (its device file, its fabric)
    sets the scenario's device and fabric for ``run`` too, and ``--set`` still wins."""
    import dataclasses

    import yaml

    from hzpsim.cli import make_parser
    from hzpsim.hardware.devices import get_device, write_device

    for argv in (["run"], ["compare"], ["search"], ["validate", "published"], ["validate", "executor"]):
        assert make_parser().parse_args([*argv, "--profile", "p.yaml"]).calibration_profile == "p.yaml", argv
    device = dataclasses.replace(get_device("h100-sxm"), name="h100-slow",
                                 peak_bf16_flops_per_s=get_device("h100-sxm").peak_bf16_flops_per_s / 2)
    write_device(device, tmp_path / "h100-slow.yaml")
    doc = calibration.machine_document("h100-slow.yaml", {"inter_node_bytes_per_s_per_device": 12.5e9}, {}, "test")
    (tmp_path / "machine.yaml").write_text(yaml.safe_dump(doc))
    base = ["run", "--json", "--set", "strategies=[{name: zero, stage: 3}]"]

    def step(*extra: str) -> dict:
        assert main([*base, *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        return out[0] if isinstance(out, list) else out

    plain = step()
    slow = step("--profile", str(tmp_path / "machine.yaml"))
    assert slow["step_time_s"] > plain["step_time_s"]
    assert slow["strategy_resolved"] == plain["strategy_resolved"]
    back = step("--profile", str(tmp_path / "machine.yaml"), "--set", "cluster.device=h100-sxm",
                "--set", "cluster.inter_node_bytes_per_s_per_device=50e9")
    assert back["step_time_s"] == plain["step_time_s"]  # the user's --set wins over the profile's machine


def test_a_command_profile_does_not_outlive_the_command(tmp_path: Path) -> None:
    """``--profile`` is active for its command only: later simulations in the same process
    (a notebook, the test suite) use the shipped fit again."""
    before = calibration.active()
    p = calibration.Profile({**calibration.priors(), "attention_kernel_fraction": 0.7})
    path = tmp_path / "p.json"
    path.write_text(p.to_json())
    sc = tmp_path / "s.yaml"
    sc.write_text(yaml.safe_dump(SCENARIOS[0]))
    assert main(["run", str(sc), "--profile", str(path), "--json"]) == 0
    assert calibration.active() is before


def _terms(measured_over_anchor: float, shares: dict[str, float], source: str = "S0") -> calibrate.Terms:
    """A row whose step is all compute (w_compute 1) at the priors, measured
    ``measured_over_anchor`` times as fast as predicted there."""
    m = calibrate.Measurement("row", source, {}, 100.0 * measured_over_anchor)
    return calibrate.Terms(m, calibration.priors(), 100.0, shares, "h100", w_compute=1.0, w_host=0.0)


def test_fit_stays_inside_the_declared_ranges_and_says_when_it_hits_one() -> None:
    """Rows that want memory-bound kernels faster than HBM allows (measured 1.6x the prior's
    speed on a step that is all memory traffic) get the range's upper end, marked at_bound; a
    reachable target is fitted exactly and is not at a bound."""
    high = BY_NAME["elementwise_hbm_efficiency"].high
    fit = calibrate.fit_constants([_terms(1.6, {"memory": 1.0}), _terms(1.6, {"memory": 1.0}, "S1")],
                                  calibration.priors())
    assert fit.constants["elementwise_hbm_efficiency"] == pytest.approx(high, rel=1e-9)
    report = calibrate.in_range_report(fit.constants)["elementwise_hbm_efficiency"]
    assert report["inside"] and report["at_bound"]
    prior = BY_NAME["gemm_sm_efficiency.h100"].prior
    fit = calibrate.fit_constants([_terms(0.9, {"gemm": 1.0})], calibration.priors())
    assert fit.constants["gemm_sm_efficiency.h100"] == pytest.approx(0.9 * prior, rel=1e-4)
    assert not calibrate.in_range_report(fit.constants)["gemm_sm_efficiency.h100"]["at_bound"]


def test_shipped_profile_records_the_held_out_errors_intervals_are_drawn_from() -> None:
    report = calibration.load(calibration.DEFAULT_PATH).report
    errors = report["cv_log_errors"]
    assert len(errors) == report["num_rows"]
    assert {"label", "source", "regimes", "log_error"} <= set(errors[0])
    assert sum("MoE" in e["regimes"] for e in errors) >= 15
    assert all(0 < v <= 1.5 for v in report["gemm_fit_over_prior"].values())
