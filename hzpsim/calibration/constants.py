"""The constants ``hzpsim calibrate`` fits, declared once: prior, plausible physical range,
unit and source. A profile (``profile.py``) assigns each a value; anything not declared here is
a cited constant that no fit touches.

The set is small and global on purpose (per device family, per framework-independent
mechanism): a factor per row or per source would be a lookup table, not a calibration.
``docs/hardware-constants.md`` lists each with its fitted value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Constant:
    name: str
    prior: float
    low: float
    high: float
    unit: str
    meaning: str
    source: str
    devices: tuple[str, ...] = ()
    """Catalog devices the constant applies to (empty: all)."""


CONSTANTS: tuple[Constant, ...] = (
    Constant(
        "gemm_sm_efficiency.a100", 0.880, 0.70, 0.95, "fraction",
        "fraction of an A100 SM's dense tensor peak a compute-bound GEMM tile sustains",
        "MAMF on A100 SXM: 271 of 312 TF (86.9 %) on its best shape 1024x10240x5120 "
        "(stas00/ml-engineering, 'Maximum Achievable Matmul FLOPS'), where the tile model loses "
        "1.2 % to wave quantisation (320 tiles on 108 SMs): 0.869/0.988; range: cuBLAS "
        "large-GEMM results 70-95 % of peak",
        ("a100-40gb", "a100-80gb"),
    ),
    Constant(
        "gemm_sm_efficiency.h100", 0.852, 0.65, 0.92, "fraction",
        "fraction of an H100/H200 SM's dense tensor peak a compute-bound GEMM tile sustains "
        "at the TDP (the power-limited clock included)",
        "MAMF on H100 SXM: 794 of 989 TF (80.3 %) on its best shape 2048x2048x13312 "
        "(stas00/ml-engineering), where the tile model loses 3 % to wave quantisation (128 "
        "tiles on 132 SMs) and 2.8 % to the tiles' prologue and epilogue (384 of K = 13,312: "
        "hardware/compute.py): 0.803/(0.970 x 0.972); range: 65-92 % (H100 GEMMs throttle below the "
        "1.83 GHz peak clock at 700 W; FA3 paper: optimised GEMMs reach 80-90 %)",
        ("h100-sxm", "h200"),
    ),
    Constant(
        "attention_kernel_fraction", 1.0, 0.6, 1.05, "fraction",
        "fraction of its standalone benchmark speed a fused attention kernel reaches inside "
        "a training step (every kernel family, every device)",
        "1 = the FlashAttention-2/-3 papers' benchmark speeds (the device files' efficiency.attention_rates), "
        "with the causal mask's and short sequences' losses and the backward's 2.5x work already counted "
        "(hardware/compute.py); on an H100 that reproduces torch SDPA's FA2 and cuDNN kernels within "
        "-12..+15 % forward and -14..+11 % backward (docs/gpu-measurements.md); below 1 when the step's other kernels slow it",
    ),
    Constant(
        "elementwise_hbm_efficiency", 0.87, 0.5, 0.95, "fraction",
        "fraction of the HBM bandwidth eager memory-bound kernels (norms, activations, "
        "residual adds, casts, the optimizer) reach",
        "A100 device-to-device copy ~87 % of 2.04 TB/s, FlashMLA 3000 of 3350 GB/s on H800 "
        "(docs/hardware-constants.md §4); eager PyTorch pointwise kernels reach 50-90 %; measured on "
        "an H100 (docs/gpu-measurements.md): copy 0.76, residual add 0.86, RMSNorm 0.53, fused AdamW "
        "0.75 of 3.35 TB/s",
    ),
)

BY_NAME = {c.name: c for c in CONSTANTS}


def priors() -> dict[str, float]:
    return {c.name: c.prior for c in CONSTANTS}
