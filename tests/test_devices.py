"""Devices as data: the built-in device files, a user's device file named by path, its checks,
and the machine profile whose device file reproduces ``validate executor``'s prediction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hzpsim.cli import main
from hzpsim.hardware.devices import (
    BUILTIN_DIR,
    DEVICES,
    builtin_names,
    get_device,
    load_device,
    write_device,
)

ROOT = Path(__file__).resolve().parents[1]


def _run_json(capsys, *overrides: str) -> dict:
    argv = ["run", "--json", "--set", "strategies=[{name: zero, stage: 3}]"]
    for o in overrides:
        argv += ["--set", o]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    return out[0] if isinstance(out, list) else out


def test_every_builtin_device_is_a_file_that_reads_back_equal(tmp_path):
    assert builtin_names() == sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml")) and len(DEVICES) >= 8
    for name, device in DEVICES.items():
        assert device.name == name and device.source and device.efficiency.source
        copy = write_device(device, tmp_path / f"{name}.yaml")
        again = load_device(copy)
        assert again.to_file() == device.to_file(), name


def test_a_device_file_by_path_with_doubled_peaks_computes_faster(tmp_path, capsys):
    data = yaml.safe_load((BUILTIN_DIR / "h100-sxm.yaml").read_text())
    data["peak_flops_per_s"] = {k: (2 * v if v else v) for k, v in data["peak_flops_per_s"].items()}
    data["name"] = "h100-doubled"
    path = tmp_path / "h100-doubled.yaml"
    path.write_text(yaml.safe_dump(data))
    base = _run_json(capsys, "cluster.device=h100-sxm")
    fast = _run_json(capsys, f"cluster.device={path}")
    def compute(r):
        return sum(v for k, v in r["time_breakdown_s"].items() if k.startswith("compute."))

    assert compute(fast) < 0.75 * compute(base)
    assert fast["step_time_s"] < base["step_time_s"]


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(memory_bytes_per_s=-3.35e12), "memory_bytes_per_s"),
    (lambda d: d["peak_flops_per_s"].update(bf16="fast"), "peak_flops_per_s.bf16"),
    (lambda d: d.pop("memory_bytes"), "memory_bytes"),
    (lambda d: d["efficiency"].update(gemm=1.5), "efficiency.gemm"),
    (lambda d: d.update(warp_drive=1), "warp_drive"),
])
def test_a_bad_device_file_exits_2_naming_the_field(tmp_path, capsys, edit, field):
    data = yaml.safe_load((BUILTIN_DIR / "h100-sxm.yaml").read_text())
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["run", "--set", f"cluster.device={path}"]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err, err


def test_an_unknown_device_or_missing_file_exits_2(tmp_path, capsys):
    assert main(["run", "--set", "cluster.device=b9000"]) == 2
    assert "b9000" in capsys.readouterr().err
    assert main(["run", "--set", f"cluster.device={tmp_path / 'nope.yaml'}"]) == 2
    assert "no such device file" in capsys.readouterr().err


def test_the_validate_executor_scenario_names_the_device_file_and_run_reproduces_it(tmp_path, capsys):
    """A machine profile names its device file; the row's scenario names it too, and ``hzpsim
    run`` on that scenario alone predicts what validate executor predicted at calibration load."""
    import dataclasses

    from hzpsim.calibration.profile import machine_document
    from hzpsim.run import run_choice
    from hzpsim.validation.executor import (
        DEFAULT_SCENARIO,
        load_profile,
        scenario_for_world,
        scenario_mapping,
    )

    device = dataclasses.replace(
        get_device("cpu-local"), name="my-box", kernel_launch_s=2e-5, collective_call_s=1e-4,
        framework_host_s=(("fsdp2", "call_s", 1e-3),),
        collective_costs=(("all_gather", 4, 1e-4, 1e-9), ("reduce_scatter", 4, 1e-4, 1e-9), ("all_reduce", 4, 2e-4, 2e-9)),
        gemm_sweep=((64.0, 128.0, 128.0, 2e10, 2e10), (1024.0, 512.0, 512.0, 8e10, 8e10)))
    write_device(device, tmp_path / "my-box.yaml")
    profile_path = tmp_path / "profile.yaml"
    profile_path.write_text(yaml.safe_dump(machine_document("my-box.yaml", {"intra_node_latency_s": 3e-5}, {}, "test")))
    scenario = scenario_for_world(DEFAULT_SCENARIO, 4, load_profile(str(profile_path)), filters=["zero(stage=3)"])
    assert scenario.topology.device.path == str((tmp_path / "my-box.yaml").resolve())
    # the sweep's rate for this model's small GEMMs, not the file's peak
    assert 1.99e10 <= scenario.topology.device.peak_fp32_flops_per_s <= 8e10
    report = run_choice(scenario, scenario.strategies[0])
    mapping = scenario_mapping(scenario, report["strategy_resolved"])
    assert mapping["cluster"]["device"] == str((tmp_path / "my-box.yaml").resolve())
    alone = tmp_path / "row.yaml"
    alone.write_text(yaml.safe_dump(mapping))
    assert main(["run", str(alone), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    out = out[0] if isinstance(out, list) else out
    assert out["step_time_s"] == report["step_time_s"]
