"""The GPU probe runs on any machine (``--smoke``), and the comparison of the committed H100 and
H200 measurements with the model computes every table (docs/gpu-measurements.md)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

pytest.importorskip("torch")


def compare(*args: str) -> dict:
    done = subprocess.run([sys.executable, str(BENCH / "compare_gpu_probe.py"), *args, "--json"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_probe_smoke_writes_every_section(tmp_path):
    out = tmp_path / "probe.json"
    sections = "gemm,gemm_fp8,attention,grouped_gemm,moe_kernels,unpermute,memory_bound,launch"
    done = subprocess.run([sys.executable, str(BENCH / "gpu_probe.py"), "--smoke", "--out", str(out),
                           "--sections", sections], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    for section in sections.split(","):
        assert section in result, section
        assert not (isinstance(result[section], dict) and "traceback" in result[section]), result[section]
    assert result["launch"]["add_inplace_s"] > 0
    assert result["moe_kernels"][0]["permute_fwd_s"] > 0


def test_h200_comparison_uses_the_h200_and_stays_near_the_measurements():
    tables = compare("--h200")
    assert tables["device"] == "h200"
    ratios = [r["ratio"] for r in tables["gemm"]]
    assert 0.8 < statistics.median(ratios) < 1.3  # a breakage ceiling, not a fit target
    fp8 = [r["ratio"] for r in tables["gemm_fp8"]]
    assert fp8 and 0.8 < statistics.median(fp8) < 1.3
    assert len(tables["memory"]) == 4 and all(math.isfinite(r["predicted_reserved_bytes"]) for r in tables["memory"])
    assert {r["model"] for r in tables["moe_kernels"]} >= {"mixtral-8x7b", "deepseek-v3"}
    assert all(r["unpermute_eager_s"] > r["permute_fused_s"] for r in tables["moe_kernels"])
    assert [r["label"] for r in tables["executor"]] == ["zero(stage=3)", "zero(stage=2)"]
    assert all(0.5 < r["predicted_step_s"] / r["step_s"] < 2 for r in tables["executor"])


def test_h100_comparison_is_unchanged_in_kind():
    tables = compare()
    assert tables["device"] == "h100-sxm" and len(tables["gemm"]) == 150
    assert tables["gemm_fp8"] == [] and tables["executor"] == []


def test_the_hopper_tile_overhead_is_what_the_committed_sweeps_fit():
    """compute.GEMM_TILE_OVERHEAD_K_HOPPER (and the Hopper device files' value) is the fit of
    the committed H100 and H200 GEMM sweeps, and it narrows their predicted / measured spread."""
    from hzpsim.hardware.compute import GEMM_TILE_OVERHEAD_K_HOPPER
    from hzpsim.hardware.devices import get_device

    done = subprocess.run([sys.executable, str(BENCH / "compare_gpu_probe.py"), "--fit-k-overhead"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    fit = json.loads(done.stdout)
    assert fit["best_k"] == GEMM_TILE_OVERHEAD_K_HOPPER
    assert fit["spread_at_best"] < 0.8 * fit["spread_at_0"]
    for name in ("h100-sxm", "h200", "h20"):
        assert get_device(name).efficiency.gemm_tile_overhead_k == GEMM_TILE_OVERHEAD_K_HOPPER
