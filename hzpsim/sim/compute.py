"""Time of a compute op: per kernel class, achieved fraction of the device's peak.

A compute op carries FLOPs by class (``gemm``, ``attention``) and the bytes its memory-bound
kernels (norms, activations, residual adds, optimizer updates) move through HBM. Its time is

    sum_c flops_c / (peak(dtype) x efficiency_c)  +  bytes_accessed / (HBM bytes/s x efficiency_hbm)

GEMMs and flash attention at training sizes are compute-bound and the memory-bound kernels run
as separate kernels, so their times add (a roofline per kernel class). Every efficiency is a
measured fraction from docs/hardware-constants.md; none is fitted to a training run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hzpsim.cluster.devices import Device
from hzpsim.ops import Op


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Achieved fraction of peak per kernel class on one device, with its source."""

    gemm: float
    """Large dense GEMM, fraction of the dense peak of the GEMM dtype (bf16/fp16)."""
    attention_forward: float
    """Flash-attention forward kernel (bf16), fraction of the dense peak."""
    attention_backward: float
    """Flash-attention backward kernel (bf16), fraction of the dense peak."""
    hbm: float
    """Streaming (memory-bound) kernels, fraction of the HBM bandwidth."""
    source: str
    """Where the fractions come from (docs/hardware-constants.md)."""
    comm_overlap_slowdown: float = 0.0
    """Compute runs 1/(1 + this) as fast while the rank communicates (SM contention)."""
    gemm_fp8: float | None = None
    """Large fp8 GEMM, fraction of the fp8 peak (None: no fp8 units)."""


# docs/hardware-constants.md §1 (GEMM: stas00/ml-engineering "Maximum Achievable Matmul FLOPS"),
# §2 (FlashAttention-2 paper on A100; on H100 the published runs use FA2-class kernels, which
# reach 335 TF/s forward+backward = 0.34 of peak per the FA2 blog / FA3 abstract), §4 (HBM:
# ~0.87-0.90), §6 (NCCL kernels slow overlapped compute by 18.9 % on average, Lee et al. 2025,
# arXiv 2507.03114).
_FA2_A100 = {"attention_forward": 0.73, "attention_backward": 0.63}  # Dao 2023 §1: up to 73 % fwd, 63 % bwd
_FA2_H100 = {"attention_forward": 0.34, "attention_backward": 0.34}  # FA2 on H100: 335 TF/s, "only 35 %"
_SM_CONTENTION = 0.189  # measured average compute slowdown while NCCL collectives overlap it
_A100_SOURCE = "MAMF A100 SXM 271/312 TF; FA2 paper; A100 memcopy 87 %"
EFFICIENCY: dict[str, Efficiency] = {
    "a100-40gb": Efficiency(gemm=0.869, **_FA2_A100, hbm=0.87, source=_A100_SOURCE,
                            comm_overlap_slowdown=_SM_CONTENTION),
    "a100-80gb": Efficiency(gemm=0.869, **_FA2_A100, hbm=0.87, source=_A100_SOURCE,
                            comm_overlap_slowdown=_SM_CONTENTION),
    "h100-sxm": Efficiency(gemm=0.803, **_FA2_H100, hbm=0.90,
                           source="MAMF H100 SXM 794/989 TF (fp8 1403/1979); FA2 on H100; FlashMLA H800 3000/3350 GB/s",
                           comm_overlap_slowdown=_SM_CONTENTION, gemm_fp8=0.709),
    "h200": Efficiency(gemm=0.803, **_FA2_H100, hbm=0.90,
                       source="MAMF: 'H200 is the same' as H100 (fp8 1453/1979); FA2 on H100",
                       comm_overlap_slowdown=_SM_CONTENTION, gemm_fp8=0.734),
    "mi250x": Efficiency(gemm=0.767, **_FA2_A100, hbm=0.87, source="MAMF MI250X GCD 147/191.5 TF; FA2-class kernels [INF]",
                         comm_overlap_slowdown=_SM_CONTENTION),
    "v100": Efficiency(gemm=0.85, attention_forward=0.60, attention_backward=0.50, hbm=0.87,
                       source="[INF] V100 PCIe ~90 % (forum); no flash kernels on V100",
                       comm_overlap_slowdown=_SM_CONTENTION),
    "npu-910b": Efficiency(gemm=0.80, attention_forward=0.60, attention_backward=0.50, hbm=0.87,
                           source="[INF] H100-class fractions; 910B peak not sourced",
                           comm_overlap_slowdown=_SM_CONTENTION),
    "cpu-local": Efficiency(gemm=1.0, attention_forward=1.0, attention_backward=1.0, hbm=1.0,
                            source="peaks are this machine's measured rates"),
}


def efficiency_for(device: Device) -> Efficiency:
    return EFFICIENCY[device.name]


class ComputeModel:
    """Maps a compute op to seconds on one device type."""

    def __init__(self, device: Device, dtype: str, efficiency: Efficiency | None = None) -> None:
        self.device = device
        self.efficiency = efficiency or efficiency_for(device)
        eff = self.efficiency
        # fp8 training runs the GEMMs in fp8 and everything else (attention) in bf16 (DESIGN §5)
        attention_dtype = "bf16" if dtype == "fp8" else dtype
        gemm_efficiency = eff.gemm
        if dtype == "fp8" and device.peak_fp8_flops_per_s is not None and eff.gemm_fp8 is not None:
            gemm_efficiency = eff.gemm_fp8
        self.peak_flops_per_s = device.peak_flops_per_s(dtype)
        attention_peak = device.peak_flops_per_s(attention_dtype)
        self._rate: Mapping[str, float] = {
            "gemm": self.peak_flops_per_s * gemm_efficiency,
            "attention_forward": attention_peak * eff.attention_forward,
            "attention_backward": attention_peak * eff.attention_backward,
        }
        self._hbm_bytes_per_s = device.memory_bytes_per_s * eff.hbm

    def duration_s(self, op: Op) -> float:
        seconds = op.duration_s + op.bytes_accessed / self._hbm_bytes_per_s
        for kind, flops in op.flops:
            seconds += flops / self._rate[kind]
        return seconds
