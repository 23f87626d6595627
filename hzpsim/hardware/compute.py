"""Time of a compute op on one device: its kernels as they run on the device's structure.

A compute op carries its kernels' shapes (``hzpsim.model.kernels``: GEMMs as M×N×K, attention as
heads × query × key × head dim with its kernel family), the bytes its memory-bound kernels
move through HBM, and a fixed host-side duration. Its time is the sum of

* **GEMMs** — tile and wave quantisation (NVIDIA, "Matrix Multiplication Background User's
  Guide"): a GEMM is cut into threadblock tiles of one of :data:`TILES`; the tiles run in
  waves of one tile per SM; a wave takes a tile's FLOPs at the SM's sustained rate (the
  dense peak / SMs × ``gemm_sm_efficiency`` × the power-capped clock fraction), slower for
  small tiles, which reuse less of each operand they load (:func:`tile_rate_fraction`). Like
  cuBLAS's heuristics, the fastest tiling and split-K factor is taken; never faster than
  moving its operands through HBM. Devices without an SM count keep one large-GEMM rate.
* **attention** — the kernel family's measured speed for the head dimension (:data:`ATTENTION`,
  FlashAttention-2/-3 papers), reduced at short sequences, × ``attention_kernel_fraction``;
* **memory-bound kernels** — bytes / (HBM bandwidth × ``elementwise_hbm_efficiency``).

Ops without shapes (FLOP totals only) run at the class's large-kernel rate. The fitted
constants come from the active calibration profile (``hzpsim.calibration``); every other
number here is cited in docs/hardware-constants.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from hzpsim.calibration import profile as calibration
from hzpsim.hardware.devices import Device
from hzpsim.model.kernels import Attention, Gemm, Shape
from hzpsim.model.ops import Op


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
    attention_fraction: float = 1.0
    """Fraction of the attention kernel's benchmark speed reached in training (calibrated)."""


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
    """The device's efficiencies, with the active calibration profile's fitted constants."""
    base = EFFICIENCY[device.name]
    if device.name == "cpu-local":  # its rates are this machine's measurements
        return base
    fit = calibration.active()
    group = DEVICE_GROUP.get(device.name)
    gemm = fit[f"gemm_sm_efficiency.{group}"] if group else base.gemm
    fp8 = base.gemm_fp8 * gemm / base.gemm if base.gemm_fp8 is not None else None
    return replace(base, gemm=gemm, gemm_fp8=fp8, hbm=fit["elementwise_hbm_efficiency"],
                   attention_fraction=fit["attention_kernel_fraction"])


#: Devices that share a fitted GEMM constant (same SM design).
DEVICE_GROUP = {"a100-40gb": "a100", "a100-80gb": "a100", "h100-sxm": "h100", "h200": "h100"}

#: Threadblock tiles (M×N) that cuBLAS/CUTLASS pick from for 16-bit tensor-core GEMMs on
#: Ampere and Hopper (CUTLASS's default Sm80/Sm90 tile configurations; NVIDIA's matmul guide
#: discusses 256×128 down to 64×64).
TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
#: Split-K factors cuBLAS uses when a GEMM has too few output tiles to fill the GPU.
SPLIT_K = (1, 2, 4, 8)
#: The largest tile is the one that sustains the large-GEMM rate: its operand intensity,
#: TM·TN/(TM+TN) = 85.3 FLOP per element loaded, matches an A100 SM's tensor peak over its
#: share of the L2 bandwidth (2,048 FLOP/clk ÷ (5,120 B/clk / 108 SMs / 2 B) = 86; NVIDIA A100
#: whitepaper: 5,120 B/clk L2 read bandwidth).
_FULL_RATE_INTENSITY = 256 * 128 / (256 + 128)


def tile_rate_fraction(tm: int, tn: int) -> float:
    """Rate of a TM×TN tile relative to the largest: smaller tiles load more per FLOP and wait
    on L2 in proportion [INF, the intensity argument above]."""
    return min(1.0, tm * tn / (tm + tn) / _FULL_RATE_INTENSITY)


#: Fused attention speed as a fraction of the device's dense 16-bit peak, long sequences,
#: forward, at head dimension (64, 128). H100: FlashAttention-3 paper (Shah et al. 2024,
#: arXiv 2407.08608) Fig. 5, non-causal forward, 16k tokens: FA2 322/370, FA3 497/648, cuDNN
#: 412/600, Triton 401/395 TFLOP/s of 989. A100: FlashAttention-2 paper (Dao 2023) §1: FA2 up
#: to 73 % forward, 63 % backward (head dim 128); head dim 64 by the H100 FA2 ratio 322/370;
#: FA2 is "1.3-2.5x faster than FlashAttention in Triton" (same paper, §4.1): Triton at FA2/1.8
#: (the geometric middle); cuDNN on A100 as FA2 [INF]; FA3 needs Hopper.
ATTENTION: dict[tuple[str, str], tuple[float, float]] = {
    ("a100", "flash2"): (0.73 * 322 / 370, 0.73),
    ("a100", "cudnn"): (0.73 * 322 / 370, 0.73),
    ("a100", "triton"): (0.73 * 322 / 370 / 1.8, 0.73 / 1.8),
    ("h100", "flash2"): (322 / 989.4, 370 / 989.4),
    ("h100", "flash3"): (497 / 989.4, 648 / 989.4),
    ("h100", "cudnn"): (412 / 989.4, 600 / 989.4),
    ("h100", "triton"): (401 / 989.4, 395 / 989.4),
}
#: Backward over forward speed of a fused attention kernel: FA2 on A100, 63 % / 73 % (Dao 2023).
ATTENTION_BACKWARD_RATIO = 0.63 / 0.73
#: Sequence length (keys) at which a flash kernel runs at half its long-sequence speed: FA2 on
#: H100, head dim 128, reaches 309 of 370 TFLOP/s at 512 keys (FA3 paper Fig. 5), s/(s + 100).
ATTENTION_HALF_SPEED_KEYS = 100.0
#: The family ``attention_kernel: auto`` means: FlashAttention-2, what PyTorch SDPA and most
#: stacks ran on A100 and H100 [SEC: PyTorch SDPA backend priority, flash first].
DEFAULT_ATTENTION_KERNEL = "flash2"


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
        self._attention_peak = device.peak_flops_per_s(attention_dtype)
        clock = device.sustained_clock_fraction
        self._rate: Mapping[str, float] = {
            "gemm": self.peak_flops_per_s * gemm_efficiency * clock,
            "attention_forward": self._attention_peak * eff.attention_forward * clock,
            "attention_backward": self._attention_peak * eff.attention_backward * clock,
        }
        self._hbm_bytes_per_s = device.memory_bytes_per_s * eff.hbm
        self._operand_bytes = 1 if dtype == "fp8" else (4 if dtype == "fp32" else 2)
        self._sm_rate = self._rate["gemm"] / device.num_sms if device.num_sms else 0.0
        self._group = DEVICE_GROUP.get(device.name)
        self._gemm_s: dict[tuple[float, float, float, float], float] = {}
        self._shapes_s: dict[tuple[Shape, ...], float] = {}

    def gemm_s(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        """Seconds of one M×N×K GEMM (or one batched kernel of ``batch`` of them, whose tiles
        share the waves): the best tiling and split-K over the device's SMs, never faster than
        its operands' HBM traffic (a rate-only device: FLOPs / large-GEMM rate)."""
        key = (m, n, k, batch)
        cached = self._gemm_s.get(key)
        if cached is not None:
            return cached
        flops = 2.0 * m * n * k * batch
        if not self._sm_rate or flops <= 0:
            seconds = flops / self._rate["gemm"]
        else:
            sms = self.device.num_sms or 1
            best = math.inf
            for tm, tn in TILES:
                tiles = math.ceil(m / tm) * math.ceil(n / tn) * math.ceil(batch)
                tile_s = 2.0 * tm * tn * k / (self._sm_rate * tile_rate_fraction(tm, tn))
                for split in SPLIT_K:
                    if split > 1 and tiles * split > 2 * sms:
                        break
                    waves = math.ceil(tiles * split / sms)
                    # split-K partial sums: written and read back once per extra split (fp32)
                    reduce_s = (split - 1) * m * n * batch * 8 / self._hbm_bytes_per_s
                    best = min(best, waves * tile_s / split + reduce_s)
            memory_s = (m * k + k * n + m * n) * batch * self._operand_bytes / self._hbm_bytes_per_s
            seconds = max(best, memory_s)
        self._gemm_s[key] = seconds
        return seconds

    def attention_s(self, a: Attention) -> float:
        """Seconds of an attention kernel call (all ``calls``)."""
        rate = self._rate["attention_backward" if a.backward else "attention_forward"]
        if self._group is not None:
            kernel = DEFAULT_ATTENTION_KERNEL if a.kernel == "auto" else a.kernel
            if (self._group, kernel) not in ATTENTION:
                raise ValueError(f"attention_kernel: {kernel!r} does not run on {self.device.name}"
                                 f" (runs there: {', '.join(k for g, k in ATTENTION if g == self._group)})")
            hd64, hd128 = ATTENTION[(self._group, kernel)]
            d = min(max(a.head_dim, 64), 128)
            fraction = hd64 + (hd128 - hd64) * (d - 64) / 64
            if a.backward:
                fraction *= ATTENTION_BACKWARD_RATIO
            fraction *= a.seq_kv / (a.seq_kv + ATTENTION_HALF_SPEED_KEYS)
            rate = self._attention_peak * fraction * self.efficiency.attention_fraction * self.device.sustained_clock_fraction
        return a.flops / rate

    def shapes_s(self, shapes: tuple[Shape, ...]) -> float:
        seconds = self._shapes_s.get(shapes)
        if seconds is None:
            seconds = 0.0
            for s in shapes:
                if isinstance(s, Gemm):
                    seconds += s.calls * self.gemm_s(s.m, s.n, s.k, s.batch)
                else:
                    seconds += self.attention_s(s)
            self._shapes_s[shapes] = seconds
        return seconds

    def components_s(self, op: Op) -> dict[str, float]:
        """The op's time by what sets it: ``gemm``, ``attention``, ``memory`` (HBM-bound
        kernels) and ``fixed`` (host work on the device stream)."""
        out = {"gemm": 0.0, "attention": 0.0, "memory": op.bytes_accessed / self._hbm_bytes_per_s, "fixed": op.duration_s}
        if op.shapes:
            for s in op.shapes:
                if isinstance(s, Gemm):
                    out["gemm"] += s.calls * self.gemm_s(s.m, s.n, s.k, s.batch)
                else:
                    out["attention"] += self.attention_s(s)
        else:
            for kind, flops in op.flops:
                out["gemm" if kind == "gemm" else "attention"] += flops / self._rate[kind]
        return out

    def duration_s(self, op: Op) -> float:
        seconds = op.duration_s + op.bytes_accessed / self._hbm_bytes_per_s
        if op.shapes:
            return seconds + self.shapes_s(op.shapes)
        for kind, flops in op.flops:
            seconds += flops / self._rate[kind]
        return seconds
