"""Hardware you may buy (issue 23): the B200, GB200, MI300X and H20 device files, their cluster
presets (dgx-b200, gb200-nvl72, mi300x-8, hgx-h20), and the run report's ``calibrated_device``."""

from __future__ import annotations

import json

import pytest

from hzpsim.calibration import profile as calibration
from hzpsim.cli import main
from hzpsim.hardware.collectives import CollectiveModel
from hzpsim.hardware.compute import calibrated_device
from hzpsim.hardware.devices import get_device
from hzpsim.hardware.topology import ClusterSpec, build_topology

MIB = 2**20


@pytest.mark.parametrize(
    "name, bf16_tf, fp8_tf, fp32_tf, memory_bytes, bw_tbs, sms, tdp_w, preset",
    [
        # DGX B200 datasheet: 72 PF fp8 sparse / 8 / 2, 64 TB/s / 8; stas00 table 2250 / 80; driver 182,631 MiB
        ("b200", 2250, 4500, 80, 182631 * MIB, 8.0, 148, 1000, "dgx-b200"),
        # GB200 NVL72: 720 PF fp8 sparse / 72 / 2; stas00 2500 / 80, 186 GB at 8 TB/s; nvidia-smi 189,471 MiB
        ("gb200", 2500, 5000, 80, 189471 * MIB, 8.0, 148, 1200, "gb200-nvl72"),
        # ROCm MI300 microarchitecture table: 1307.4 / 2614.9 / matrix fp32 163.4, 5.3 TB/s; 192 GiB, 304 CUs
        ("mi300x", 1307.4, 2614.9, 163.4, 192 * 2**30, 5.3, 304, 750, "mi300x-8"),
        # H20 spec sheet (secondhand): 148 TF, fp8 2x, fp32 44, 4.0 TB/s, 78 SMs; nvidia-smi 97,871 MiB
        ("h20", 148, 296, 44, 97871 * MIB, 4.0, 78, 400, "hgx-h20"),
    ],
)
def test_new_device_numbers_are_the_cited_ones(name, bf16_tf, fp8_tf, fp32_tf, memory_bytes, bw_tbs, sms, tdp_w, preset):
    d = get_device(name)
    assert d.peak_flops_per_s("bf16") == pytest.approx(bf16_tf * 1e12)
    assert d.peak_flops_per_s("fp16") == d.peak_flops_per_s("bf16")
    assert d.peak_flops_per_s("fp8") == pytest.approx(fp8_tf * 1e12)
    assert d.peak_flops_per_s("fp32") == pytest.approx(fp32_tf * 1e12)
    assert d.memory_bytes == memory_bytes
    assert d.memory_bytes_per_s == pytest.approx(bw_tbs * 1e12)
    assert (d.num_sms, d.tdp_w, d.default_cluster_preset) == (sms, tdp_w, preset)
    assert d.caching_allocator
    # priors, not fits: no gemm_sm_efficiency constant of their own
    assert d.efficiency.gemm_constant is None and d.efficiency.fitted_constants
    assert "uncalibrated" in d.efficiency.source


def test_gemm_workspace_follows_pytorchs_rule():
    # CublasHandlePool.cpp: 32 MiB for compute capability 9/10/12, 128 MiB for gfx94x on ROCm
    assert get_device("b200").gemm_workspace_bytes == get_device("gb200").gemm_workspace_bytes == 32 * MIB
    assert get_device("h20").gemm_workspace_bytes == get_device("h100-sxm").gemm_workspace_bytes
    assert get_device("mi300x").gemm_workspace_bytes == 128 * MIB
    assert get_device("mi300x").communicator_bytes == 0  # RCCL's own bytes not stated


def test_attention_kernels_are_what_runs_there():
    assert "flash3" not in get_device("b200").attention_kernels  # FA3 is Hopper-only
    assert set(get_device("mi300x").attention_kernels) == {"flash2", "triton"}  # ROCm: CK and Triton FA2
    assert "flash3" in get_device("h20").attention_kernels


@pytest.mark.parametrize("preset, device, per_node, island_bw, nic_bw", [
    ("dgx-b200", "b200", 8, 900e9, 50e9),
    ("gb200-nvl72", "gb200", 72, 900e9, 50e9),
    ("mi300x-8", "mi300x", 8, 448e9, 50e9),
    ("hgx-h20", "h20", 8, 450e9, 50e9),
])
def test_new_presets_build(preset, device, per_node, island_bw, nic_bw):
    t = build_topology(ClusterSpec(preset=preset, num_nodes=2))
    assert t.device.name == device
    assert t.devices_per_node == per_node and t.devices_per_island == per_node  # one NVLink / xGMI domain per node
    assert t.num_devices == 2 * per_node
    assert t.link("island").bytes_per_s == pytest.approx(island_bw)
    assert t.link("leaf").bytes_per_s == pytest.approx(nic_bw)


def test_nvl72_all_reduce_stays_in_one_nvlink_domain():
    """72 GPUs: one NVL72 rack keeps the whole all-reduce on NVLink; the same 72 GPUs as 9 DGX B200
    send part of it through their NICs and take longer."""
    rack = build_topology(ClusterSpec(preset="gb200-nvl72", num_nodes=1))
    dgx = build_topology(ClusterSpec(preset="dgx-b200", num_nodes=9))
    assert rack.num_devices == dgx.num_devices == 72
    size = 1e9
    on_rack = CollectiveModel(rack).plan("all_reduce", size, rack.span(range(72)))
    on_dgx = CollectiveModel(dgx).plan("all_reduce", size, dgx.span(range(72)))
    assert rack.span(range(72)).outermost_level == "island"
    assert set(on_rack.bytes_by_level) == {"island"}
    assert on_dgx.bytes_by_level.get("leaf", 0) > 0
    assert on_rack.isolated_time_s < on_dgx.isolated_time_s


def test_calibrated_device_comes_from_the_profile():
    assert not calibrated_device(get_device("b200"))
    assert not calibrated_device(get_device("mi300x"))
    assert calibrated_device(get_device("h100-sxm")) and calibrated_device(get_device("a100-80gb"))
    # the flag follows the fit, not the name: a profile that fitted nothing leaves H100 uncalibrated
    with calibration.using(calibration.PRIORS):
        assert not calibrated_device(get_device("h100-sxm"))


def _run(capsys, preset: str, batch: int) -> dict:
    argv = ["run", "--json", "--set", "model=llama3-8b", "--set", f"cluster.preset={preset}",
            "--set", "cluster.num_nodes=1", "--set", "strategies=[{name: zero, stage: 3}]",
            "--set", f"training.global_batch_size={batch}"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    return out[0] if isinstance(out, list) else out


@pytest.mark.parametrize("preset, batch, calibrated", [
    ("dgx-b200", 16, False), ("gb200-nvl72", 72, False), ("mi300x-8", 16, False), ("hgx-h20", 16, False),
    ("dgx-h100", 16, True),
])
def test_a_scenario_on_each_new_device_runs_end_to_end(capsys, preset, batch, calibrated):
    r = _run(capsys, preset, batch)
    assert r["calibrated_device"] is calibrated
    assert r["step_time_s"] > 0 and 0 < r["mfu"] < 1 and r["fits_in_memory"]
