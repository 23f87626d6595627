"""Time of a compute op on one device: its kernels as they run on the device's structure.

A compute op carries its kernels' shapes (``hzpsim.model.kernels``: GEMMs as M×N×K, attention as
heads × query × key × head dim with its kernel family), the bytes its memory-bound kernels
move through HBM, and a fixed host-side duration. Its time is the sum of

* **GEMMs** — tile and wave quantisation (NVIDIA, "Matrix Multiplication Background User's
  Guide"): a GEMM is cut into threadblock tiles of one of :data:`TILES`; the tiles run in
  waves of one tile per SM; a wave takes a tile's FLOPs at the SM's sustained rate (the
  dense peak / SMs × ``gemm_sm_efficiency`` × the power-capped clock fraction), slower for
  small tiles, which reuse less of each operand they load (:func:`tile_rate_fraction`), plus
  the tile's fixed prologue and epilogue (:data:`GEMM_TILE_OVERHEAD_K_HOPPER`). Like
  cuBLAS's heuristics, the fastest tiling and split-K factor is taken; never faster than
  moving its operands through HBM. Devices without an SM count keep one large-GEMM rate.
* **attention** — the kernel family's measured speed for the head dimension (the device file's ``efficiency.attention_rates``,
  FlashAttention-2/-3 papers), reduced at short sequences and by the causal mask's diagonal
  tiles, on the kernel's own FLOP count (the backward's 2.5x), × ``attention_kernel_fraction``;
* **memory-bound kernels** — bytes / (HBM bandwidth × ``elementwise_hbm_efficiency``).

Ops without shapes (FLOP totals only) run at the class's large-kernel rate. The fitted
constants come from the active calibration profile (``hzpsim.calibration``); every other
number here is cited in docs/hardware-constants.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from hzpsim.calibration import profile as calibration
from hzpsim.hardware.devices import Device, Efficiency
from hzpsim.model.kernels import Attention, Gemm, Shape
from hzpsim.model.ops import Op


def efficiency_for(device: Device) -> Efficiency:
    """The device's efficiencies (its file's priors), with the active calibration profile's
    fitted constants where the device file says they apply (``efficiency.fitted_constants``)."""
    base = device.efficiency
    if not base.fitted_constants:  # its rates are measurements (a CPU box, a calibrated machine)
        return base
    fit = calibration.active()
    group = base.gemm_constant
    gemm = fit[f"gemm_sm_efficiency.{group}"] if group else base.gemm
    fp8 = base.gemm_fp8 * gemm / base.gemm if base.gemm_fp8 is not None else None
    return replace(base, gemm=gemm, gemm_fp8=fp8, hbm=fit["elementwise_hbm_efficiency"],
                   attention_fraction=fit["attention_kernel_fraction"])


def calibrated_device(device: Device) -> bool:
    """Whether the device's own compute rate is calibrated (the run report's
    ``calibrated_device``): the active calibration profile fitted the GEMM constant its device
    file names (``efficiency.gemm_constant``, e.g. ``gemm_sm_efficiency.h100``, fitted on the
    published rows that run on that SM design), or, for a device whose rates are measurements
    (``fitted_constants: false``), ``hzpsim calibrate machine`` measured its GEMM sweep. False:
    its GEMM efficiency is the device file's prior (a device no calibration row runs on),
    even where the device-independent fitted constants (attention, HBM) apply to it."""
    e = device.efficiency
    if not e.fitted_constants:
        return bool(device.gemm_sweep)
    return e.gemm_constant is not None and f"gemm_sm_efficiency.{e.gemm_constant}" in calibration.active().fitted


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


#: A GEMM tile's fixed cost, in the K-depth whose main-loop time it equals: the pipeline
#: prologue that fills the shared-memory stages before the first MMA, and the epilogue that
#: converts the fp32 accumulators and writes the output tile (CUTLASS's multistage / warp-
#: specialised Sm80 / Sm90 mainloops and their epilogues). A tile of depth K takes (K + this) /
#: K of its MMA time, so short-K GEMMs (an MoE expert's weight gradient over a few hundred
#: tokens, a row-parallel linear over a narrow FFN shard) run well below the large-GEMM rate.
#: [MEA] Fitted to the 150-shape bf16 ``torch.matmul`` sweeps on an H100 (2026-11-26) and an
#: H200 (2026-11-27) (``benchmarks/compare_gpu_probe.py --fit-k-overhead``): the value on a
#: 32-step grid that makes predicted / measured most alike over all 300 shapes (spread of its
#: log 0.098 without it, 0.069 with it). Without it the ratio ran 0.62 at K = 512, 0.69 at 768,
#: 0.80 at 1,024 and 0.88 at 1,536 against 1.07 at K >= 4,096; each of the 14 shapes of
#: K <= 1,536 solved alone against that gives 146-490.
#: The device file carries it (``efficiency.gemm_tile_overhead_k``): the Hopper files (H100,
#: H200, H20) this value; devices where no sweep measured it, 0 (their priors are MAMF's
#: best-shape rates, which already include whatever it costs at that shape).
GEMM_TILE_OVERHEAD_K_HOPPER = 384.0

#: Fused attention speed per kernel family: the device file's ``efficiency.attention_rates``
#: (forward, long sequences, head dimension 64 and 128, fractions of the dense 16-bit peak),
#: each with its source there (FlashAttention-2/-3 papers).
#: Backward over forward speed of a fused attention kernel: FA2 on A100, 63 % / 73 % (Dao 2023).
ATTENTION_BACKWARD_RATIO = 0.63 / 0.73
#: Sequence length (keys) at which a flash kernel runs at half its long-sequence speed: FA2 on
#: H100, head dim 128, reaches 309 of 370 TFLOP/s at 512 keys (FA3 paper Fig. 5), s/(s + 100).
ATTENTION_HALF_SPEED_KEYS = 100.0
#: A causal kernel's speed (on the halved FLOP count) over the same kernel without the mask, as
#: s/(s + this): the diagonal tiles run whole and masked, and query blocks carry unequal work.
#: Measured on an H100 (torch 2.11 SDPA, FlashAttention-2 and cuDNN backends, head dim 128,
#: 2,048-16,384 tokens): the ratio is 0.76-0.99; each point solved for this constant gives
#: 180-1,040 keys, median 616 (docs/gpu-measurements.md, benchmarks/gpu_probe.py).
CAUSAL_EXTRA_KEYS = 616.0
#: Keys per tile of a flash kernel's key loop [INF: FlashAttention-2 and -3 use 64-176-key
#: blocks by head dimension and GPU]. A sliding window of w keys is a band: each block of
#: queries visits the ceil(w / block) + 1 key blocks the band crosses and masks the parts of the
#: first and last outside it, so it computes block·(ceil(w / block) + 1) scores per query for w
#: kept (half of them at w = 128, 97 % at w = 4,096). Not measured here.
WINDOW_KEY_BLOCK = 128.0
#: The family ``attention_kernel: auto`` means: FlashAttention-2, what PyTorch SDPA and most
#: stacks ran on A100 and H100 [SEC: PyTorch SDPA backend priority, flash first].
DEFAULT_ATTENTION_KERNEL = "flash2"


class ComputeModel:
    """Maps a compute op to seconds on one device type."""

    def __init__(self, device: Device, dtype: str, efficiency: Efficiency | None = None,
                 tile_overhead_k: float | None = None) -> None:
        self.device = device
        self.efficiency = efficiency or efficiency_for(device)
        self.tile_overhead_k = self.efficiency.gemm_tile_overhead_k if tile_overhead_k is None else tile_overhead_k
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
        self._attention = {k: (hd64, hd128) for k, hd64, hd128 in eff.attention_rates}
        self._gemm_s: dict[tuple[float, float, float, float, bool], float] = {}
        self._shapes_s: dict[tuple[Shape, ...], float] = {}

    def gemm_s(self, m: float, n: float, k: float, batch: float = 1.0, accumulate: bool = False) -> float:
        """Seconds of one M×N×K GEMM (or one batched kernel of ``batch`` of them, whose tiles
        share the waves): the best tiling and split-K over the device's SMs, never faster than
        its operands' HBM traffic (a rate-only device: FLOPs / large-GEMM rate). ``accumulate``:
        the output is added into fp32 (``kernels.Gemm.accumulate``), its M×N read and written
        at 4 bytes each."""
        key = (m, n, k, batch, accumulate)
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
                depth_s = 2.0 * tm * tn / (self._sm_rate * tile_rate_fraction(tm, tn))  # per unit of K
                for split in SPLIT_K:
                    if split > 1 and tiles * split > 2 * sms:
                        break
                    waves = math.ceil(tiles * split / sms)
                    # split-K partial sums: written and read back once per extra split (fp32)
                    reduce_s = (split - 1) * m * n * batch * 8 / self._hbm_bytes_per_s
                    # each split's tile runs K/split deep and pays the prologue and epilogue
                    best = min(best, waves * depth_s * (k / split + self.tile_overhead_k) + reduce_s)
            out_bytes = 8 if accumulate else self._operand_bytes
            memory_s = ((m * k + k * n) * self._operand_bytes + m * n * out_bytes) * batch / self._hbm_bytes_per_s
            seconds = max(best, memory_s)
        self._gemm_s[key] = seconds
        return seconds

    def attention_s(self, a: Attention) -> float:
        """Seconds of an attention kernel call (all ``calls``)."""
        rate = self._rate["attention_backward" if a.backward else "attention_forward"]
        if self._attention:
            kernel = DEFAULT_ATTENTION_KERNEL if a.kernel == "auto" else a.kernel
            if kernel not in self._attention:
                raise ValueError(f"attention_kernel: {kernel!r} does not run on {self.device.name}"
                                 f" (runs there: {', '.join(self._attention)})")
            hd64, hd128 = self._attention[kernel]
            d = min(max(a.head_dim, 64), 128)
            fraction = hd64 + (hd128 - hd64) * (d - 64) / 64
            if a.backward:
                fraction *= ATTENTION_BACKWARD_RATIO
            keys = a.keys
            fraction *= keys / (keys + ATTENTION_HALF_SPEED_KEYS)
            if a.window and a.window < a.seq_kv:  # the band's key blocks, both edges masked
                fraction *= keys / (WINDOW_KEY_BLOCK * (math.ceil(keys / WINDOW_KEY_BLOCK) + 1))
            elif a.causal:
                fraction *= keys / (keys + CAUSAL_EXTRA_KEYS)
            rate = self._attention_peak * fraction * self.efficiency.attention_fraction * self.device.sustained_clock_fraction
        return a.kernel_flops / rate

    def cheapest_row_keys(self, lo: float, hi: float) -> float:
        """The token-weighted mean document length in [lo, hi] at which a packed row of causal
        attention (``kernels.packed``: FLOPs in proportion to the length) takes the least time.
        With per-kernel rates the time goes as (L + half-speed keys)(L + causal extra keys) / L
        (:meth:`attention_s`), least at the geometric mean of the two constants; at a flat rate
        it goes as L."""
        if not self._attention:
            return lo
        return min(max(math.sqrt(ATTENTION_HALF_SPEED_KEYS * CAUSAL_EXTRA_KEYS), lo), hi)

    def shapes_s(self, shapes: tuple[Shape, ...]) -> float:
        seconds = self._shapes_s.get(shapes)
        if seconds is None:
            seconds = 0.0
            for s in shapes:
                if isinstance(s, Gemm):
                    seconds += s.calls * self.gemm_s(s.m, s.n, s.k, s.batch, s.accumulate)
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
                    out["gemm"] += s.calls * self.gemm_s(s.m, s.n, s.k, s.batch, s.accumulate)
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
