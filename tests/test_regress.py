"""``hzpsim regress``: goldens pass as recorded, fail when a cost constant moves, --update.

    python -m pytest tests/test_regress.py
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from hzpsim.calibration import profile as calibration
from hzpsim.cli import main

GOLDENS = Path(__file__).parent / "goldens.yaml"
TINY = {"model": "tiny-dense", "training": {"global_batch_size": 32},
        "cluster": {"preset": "dgx-h100", "num_nodes": 2}, "strategy": {"name": "zero", "stage": 3}}


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def write(tmp_path: Path, entries) -> Path:
    path = tmp_path / "goldens.yaml"
    path.write_text(yaml.safe_dump(entries, sort_keys=False))
    return path


@pytest.mark.slow
def test_project_goldens_hold(capsys):
    """The ~20 reference scenarios (every family, dense and MoE, several presets)."""
    rc, out, err = cli(capsys, "regress", str(GOLDENS))
    assert rc == 0, out + err
    assert "all within tolerance" in out
    entries = yaml.safe_load(GOLDENS.read_text())
    assert len(entries) >= 20 and all(e.get("expected") for e in entries)
    names = " ".join(str(e["scenario"]) + " ".join(e.get("set", [])) for e in entries)
    for family in ("nd", "zero", "hsdp", "mics", "zeropp", "megatron_fsdp", "asynchzp", "ddp", "tiny-moe", "mixtral"):
        assert family in names, family


def test_a_perturbed_cost_constant_fails_regress(capsys, monkeypatch):
    """5 % slower GEMMs on H100 (the calibrated constant) move the H100 goldens beyond 0.5 %:
    exit 1, the key named."""
    rc, _, _ = cli(capsys, "regress", str(GOLDENS), "--only", "llama2-7b-megatron-fsdp-h100")
    assert rc == 0
    fit = calibration.active()
    slower = dataclasses.replace(fit, constants={**fit.constants,
                                                 "gemm_sm_efficiency.h100": fit["gemm_sm_efficiency.h100"] * 0.95})
    with calibration.using(slower):
        rc, out, _ = cli(capsys, "regress", str(GOLDENS), "--only", "llama2-7b-megatron-fsdp-h100")
    assert rc == 1
    assert "MOVED" in out and "step_time_s" in out and "moved beyond tolerance" in out


def test_update_then_check_and_tolerance(tmp_path, capsys):
    path = write(tmp_path, [{"name": "tiny", "scenario": TINY}])
    rc, out, _ = cli(capsys, "regress", str(path))
    assert rc == 1 and "no expected values" in out
    rc, _, _ = cli(capsys, "regress", str(path), "--update")
    assert rc == 0
    entries = yaml.safe_load(path.read_text())
    expected = entries[0]["expected"]
    assert {"step_time_s", "peak_memory_bytes", "comm_bytes_per_device.inter_node"} <= set(expected)
    assert "sim_wall_s" not in expected and "num_events" not in expected
    assert cli(capsys, "regress", str(path))[0] == 0
    step = expected["step_time_s"]
    for factor, rc_expected in ((1.004, 0), (1.006, 1)):  # default tolerance 0.5 %
        entries[0]["expected"] = {"step_time_s": step * factor}
        write(tmp_path, entries)
        assert cli(capsys, "regress", str(path))[0] == rc_expected, factor
    entries[0]["tolerance"] = 0.01
    write(tmp_path, entries)
    assert cli(capsys, "regress", str(path))[0] == 0


def test_scenario_by_path_and_overrides(tmp_path, capsys):
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({k: v for k, v in TINY.items() if k != "strategy"}
                                                    | {"strategies": [{"name": "zero", "stage": 1}, "ddp"]}))
    path = write(tmp_path, [{"name": "by-path", "scenario": "s.yaml", "set": ["strategy.name=zero"]}])
    assert cli(capsys, "regress", str(path), "--update")[0] == 0
    assert cli(capsys, "regress", str(path))[0] == 0


@pytest.mark.parametrize("entries,needle", [
    ("not a list", "list"),
    ([{"scenario": TINY}], "name"),
    ([{"name": "a", "scenario": TINY}, {"name": "a", "scenario": TINY}], "twice"),
    ([{"name": "a", "scenario": TINY, "bogus": 1}], "bogus"),
    ([{"name": "a", "scenario": TINY, "tolerance": -1}], "tolerance"),
    ([{"name": "a", "scenario": 3}], "scenario"),
    ([{"name": "a", "scenario": {**TINY, "strategy": None, "strategies": ["ddp", "zero"]}}], "strategies"),
    ([{"name": "a", "scenario": "absent.yaml"}], "absent.yaml"),
])
def test_bad_goldens_exit_2_with_one_line(tmp_path, capsys, entries, needle):
    if isinstance(entries, list):
        entries = [{k: v for k, v in e.items()} for e in entries]
        for e in entries:
            if isinstance(e.get("scenario"), dict) and e["scenario"].get("strategy", 0) is None:
                e["scenario"] = {k: v for k, v in e["scenario"].items() if k != "strategy"}
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(entries))
    rc, out, err = cli(capsys, "regress", str(path))
    assert rc == 2, out + err
    assert err.startswith("hzpsim: error: ") and needle in err and err.count("\n") == 1


def test_missing_file_and_unknown_entry(tmp_path, capsys):
    rc, _, err = cli(capsys, "regress", str(tmp_path / "nope.yaml"))
    assert rc == 2 and "nope.yaml" in err
    rc, _, err = cli(capsys, "regress", str(GOLDENS), "--only", "no-such-entry")
    assert rc == 2 and "--only" in err
