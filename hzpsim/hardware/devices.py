"""Device catalog: peak dense FLOP/s per dtype, HBM capacity and bandwidth.

Every number carries its source. Tags follow ``docs/strategies.md``: [SRC] primary source
(vendor datasheet / official docs), [SEC] secondary source, [INF] our own inference.

Conventions (apply to every entry):

* All FLOP/s are **dense** (no 2:4 structured sparsity) tensor-core / matrix-core peaks.
* ``peak_fp8_flops_per_s = None`` means the device has no fp8 tensor cores; fp8 GEMMs then
  run at the bf16 rate (they are executed as bf16 GEMMs), see :meth:`Device.peak_flops_per_s`.
* ``peak_fp32_flops_per_s`` is the rate an *exact* fp32 GEMM gets by default in PyTorch:
  on NVIDIA this is the plain FP32 (non-TF32) rate, because ``torch.backends.cuda.matmul.
  allow_tf32`` defaults to False since PyTorch 1.12 and the executor's ``fp32`` mode is used for
  exact checks; on AMD CDNA2 it is the FP32 *matrix* (MFMA) rate, which rocBLAS uses for
  fp32 GEMMs and which is IEEE fp32 (not a reduced-precision format).
* ``memory_bytes`` is the capacity the CUDA driver reports where it is known (the "80 GB"
  parts are 80 GiB of HBM, of which the driver exposes ~79.2-79.7 GiB); otherwise the vendor's
  decimal figure (80 GB = 80e9 bytes), a slight underestimate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

PRECISIONS = ("bf16", "fp16", "fp8", "fp32")

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class Device:
    """One accelerator (or one GCD / one CPU "device")."""

    name: str
    peak_bf16_flops_per_s: float  # dense
    peak_fp16_flops_per_s: float  # dense
    peak_fp8_flops_per_s: float | None  # dense; None = no fp8 tensor cores (fp8 runs at bf16 rate)
    peak_fp32_flops_per_s: float | None  # rate of an exact fp32 GEMM by default (see module docstring); None = not published
    memory_bytes: float  # HBM (or RAM) capacity, bytes
    memory_bytes_per_s: float  # HBM (or RAM) bandwidth, bytes/s
    default_cluster_preset: str  # preset giving this device's usual node fabric
    source: str  # where the numbers come from
    nominal_memory_gb: float | None = None  # the capacity on the label ("80GB"); None = memory_bytes / 1e9
    num_sms: int | None = None  # streaming multiprocessors (CUs, AI cores) the GEMM tiles spread over;
    # None = no tile/wave model (the device's GEMM rate is its large-GEMM rate whatever the shape)
    tdp_w: float | None = None  # board power the peak clock is specified at
    power_limit_w: float | None = None  # power cap the device runs under; None = tdp_w
    attention_kernels: tuple[str, ...] = ()  # fused attention kernel families that run on it
    # (training.attention_kernel); () = not tracked (attention at one fused-kernel rate)

    @property
    def sustained_clock_fraction(self) -> float:
        """Clock a power-capped device sustains in compute-bound kernels, as a fraction of the
        clock it sustains at its TDP: dynamic power P ∝ C·V²·f with V rising roughly with f in
        the DVFS range, so P ∝ f³ and f ∝ P^(1/3) [INF, the CMOS power law; e.g. Hennessy &
        Patterson, Computer Architecture 6th ed. §1.5]. 1 without a cap."""
        if self.power_limit_w is None or self.tdp_w is None or self.power_limit_w >= self.tdp_w:
            return 1.0
        return (self.power_limit_w / self.tdp_w) ** (1 / 3)
    # host costs measured on this device (`hzpsim calibrate machine`); None = the implementation's prior
    kernel_launch_s: float | None = None  # host time per eager kernel (dispatch + launch)
    collective_call_s: float | None = None  # host time to issue one collective call
    synchronous_host: bool = False  # kernels run on the thread that launches them (a CPU): no run-ahead
    # collectives run on the cores that compute (gloo on a CPU: its copies and TCP loopback): a rank's
    # compute makes no progress while one of its collectives moves bytes (no free overlap)
    communication_uses_compute_cores: bool = False
    # measured by `hzpsim calibrate machine` only (None / () = not measured: nothing changes):
    # per collective kind and group size, (kind, group_size, latency_s, seconds_per_byte) of the
    # backend's own algorithms, timed inside a step-like loop (hardware/collectives.py uses them
    # instead of NCCL's model); the host cost of FSDP2's Python per parameter gather / gradient
    # reduce call and of DTensor's dispatch per ATen op (strategies/_implementations.py applies
    # them to the fsdp2 and dtensor profiles)
    collective_costs: tuple[tuple[str, int, float, float], ...] = ()
    fsdp2_call_host_s: float | None = None
    dtensor_op_host_s: float | None = None
    asynchzp_op_host_s: float | None = None  # hzpsim's AsyncHZP executor's Python per op (its hooks and threads)
    # what each hop of such a collective waits inside a step for its receiving thread to get a
    # core back from ranks that compute (measured: in-step minus back-to-back, per hop; not
    # charged on a device with a CPU pool, whose sharing of the cores it stood in for)
    collective_hop_delay_s: float | None = None
    # the CPU pool (`hzpsim calibrate machine`, unless --no-cpu-pool; None = none: every rank runs at its
    # own calibrated rate): the cores one node's ranks share, measured as the CPU seconds all
    # ranks spend per second of wall while every rank works (Σ 1 / sharing factor; fewer while
    # other jobs run). With it the device's compute and host costs are CPU seconds of one rank
    # alone on a core; a rank's compute and host ops need a core each and a collective its
    # wall time inside a step (``collective_costs``) at the share of a core ``collective_cpu_costs``
    # says; all progress at min(1, cores / demand on the node) (sim/engine.py)
    node_cpu_cores: float | None = None
    # per collective kind and group size, (kind, group_size, cpu_s, cpu_s_per_byte): the CPU
    # seconds each member's backend threads spend per call (gloo's copies, reductions and TCP
    # loopback), measured with the calls back to back; used only with the CPU pool
    collective_cpu_costs: tuple[tuple[str, int, float, float], ...] = ()

    @property
    def memory_label_gb(self) -> float:
        """The memory size the vendor's name gives (e.g. 80 for "H100 80GB")."""
        return self.nominal_memory_gb if self.nominal_memory_gb is not None else self.memory_bytes / 1e9

    def peak_flops_per_s(self, precision: str) -> float:
        """Dense peak FLOP/s for GEMMs in ``precision`` (bf16 | fp16 | fp8 | fp32).

        fp8 on a device without fp8 tensor cores returns the bf16 rate (fp8 GEMMs are run as
        bf16 GEMMs there).
        """
        if precision == "bf16":
            return self.peak_bf16_flops_per_s
        if precision == "fp16":
            return self.peak_fp16_flops_per_s
        if precision == "fp8":
            if self.peak_fp8_flops_per_s is None:
                return self.peak_bf16_flops_per_s
            return self.peak_fp8_flops_per_s
        if precision == "fp32":
            if self.peak_fp32_flops_per_s is None:
                raise ValueError(f"{self.name} has no published fp32 GEMM rate; use bf16 or fp16")
            return self.peak_fp32_flops_per_s
        raise ValueError(f"unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")


# --- the catalog --------------------------------------------------------------------------

_A100_SRC = (
    "[SRC] NVIDIA A100 Tensor Core GPU datasheet: BF16/FP16 tensor 312 TF dense (624 sparse), "
    "FP32 19.5 TF (TF32 156 TF dense, not used: see module docstring), no FP8; "
    "strategies.md §4 (312 TF, 2.039 TB/s for 80GB SXM4)."
)

DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device(
            name="a100-40gb",
            peak_bf16_flops_per_s=312 * TERA,
            peak_fp16_flops_per_s=312 * TERA,
            peak_fp8_flops_per_s=None,  # Ampere has no fp8 tensor cores
            peak_fp32_flops_per_s=19.5 * TERA,
            memory_bytes=40 * GIGA,  # 40 GB HBM2 [SRC datasheet]
            memory_bytes_per_s=1555 * GIGA,  # 1,555 GB/s [SRC datasheet, A100 40GB SXM]
            num_sms=108, tdp_w=400,
            attention_kernels=("flash2", "cudnn", "triton"),  # FlashAttention-3 needs Hopper (FA3 README)
            default_cluster_preset="dgx-a100",
            source=_A100_SRC + " 40GB SXM: 40 GB HBM2 at 1,555 GB/s [SRC datasheet].",
        ),
        Device(
            name="a100-80gb",
            peak_bf16_flops_per_s=312 * TERA,
            peak_fp16_flops_per_s=312 * TERA,
            peak_fp8_flops_per_s=None,
            peak_fp32_flops_per_s=19.5 * TERA,
            # torch.cuda.get_device_properties().total_memory of an A100-SXM4-80GB: 85,056,798,720 B
            # (79.2 GiB) [SEC: recorded in a public test fixture]
            memory_bytes=85_056_798_720,
            nominal_memory_gb=80,
            memory_bytes_per_s=2039 * GIGA,  # 2,039 GB/s [SRC datasheet; strategies.md §4]
            num_sms=108, tdp_w=400,
            attention_kernels=("flash2", "cudnn", "triton"),  # FlashAttention-3 needs Hopper (FA3 README)
            default_cluster_preset="dgx-a100",
            source=_A100_SRC + " 80GB SXM: 80 GB HBM2e at 2,039 GB/s.",
        ),
        Device(
            name="h100-sxm",
            peak_bf16_flops_per_s=989.4 * TERA,  # 1,979 sparse / 2 [SRC; strategies.md §4]
            peak_fp16_flops_per_s=989.4 * TERA,
            peak_fp8_flops_per_s=1978.9 * TERA,  # 3,958 sparse / 2 [SRC H100 datasheet]
            peak_fp32_flops_per_s=66.9 * TERA,  # FP32 67 TF [SRC datasheet] (TF32 494.7 dense)
            # nvidia-smi "81559MiB" total for an H100 80GB HBM3 = 85,521,612,800 B (79.65 GiB)
            # [SEC: many public nvidia-smi logs]
            memory_bytes=81559 * 2**20,
            nominal_memory_gb=80,
            memory_bytes_per_s=3.35 * TERA,  # 3.35 TB/s
            num_sms=132, tdp_w=700,
            attention_kernels=("flash2", "flash3", "cudnn", "triton"),
            default_cluster_preset="dgx-h100",
            source=(
                "[SRC] NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16/FP16 1,979 TF and FP8 "
                "3,958 TF *with sparsity* (dense = half), FP32 67 TF, 80 GB HBM3 at 3.35 TB/s; "
                "strategies.md §4 (989.4 TF dense, 3.35 TB/s)."
            ),
        ),
        Device(
            name="h200",
            peak_bf16_flops_per_s=989.4 * TERA,  # same GH100 die as H100 SXM [strategies.md §4]
            peak_fp16_flops_per_s=989.4 * TERA,
            peak_fp8_flops_per_s=1978.9 * TERA,
            peak_fp32_flops_per_s=66.9 * TERA,
            memory_bytes=141 * GIGA,  # 141 GB HBM3e
            memory_bytes_per_s=4.8 * TERA,  # 4.8 TB/s
            num_sms=132, tdp_w=700,
            attention_kernels=("flash2", "flash3", "cudnn", "triton"),
            default_cluster_preset="dgx-h200",
            source=(
                "[SRC] NVIDIA H200 datasheet (SXM): compute as H100 SXM (1,979 TF BF16 sparse = "
                "989 dense; the 1,979 figure sometimes listed as dense is the sparse one), "
                "141 GB HBM3e at 4.8 TB/s; strategies.md §4."
            ),
        ),
        Device(
            name="mi250x",  # ONE GCD (a MI250X package holds two; Frontier schedules per GCD)
            peak_bf16_flops_per_s=383 * TERA / 2,  # 383 TF per package [SRC AMD] -> 191.5/GCD
            peak_fp16_flops_per_s=383 * TERA / 2,
            peak_fp8_flops_per_s=None,  # CDNA2 has no fp8 matrix cores
            peak_fp32_flops_per_s=95.7 * TERA / 2,  # FP32 matrix 95.7 TF per package [SRC AMD]
            memory_bytes=64 * GIGA,  # 128 GB HBM2e per package, 64 per GCD
            memory_bytes_per_s=1.6 * TERA,  # 3.2 TB/s per package, 1.6 per GCD
            num_sms=110,  # compute units per GCD [SRC AMD CDNA2 whitepaper: 220 CUs per MI250X]
            default_cluster_preset="frontier",
            source=(
                "[SRC] AMD Instinct MI250X datasheet: 383 TF peak FP16/BF16 matrix, 95.7 TF FP32 "
                "matrix, 128 GB HBM2e at 3.2 TB/s per package (2 GCDs); per-GCD values are "
                "halves, per OLCF Frontier User Guide (64 GB, 1.6 TB/s per GCD); strategies.md §4."
            ),
        ),
        Device(
            name="v100",  # V100 SXM2 32GB
            # Volta has no bf16 tensor cores: bf16 GEMMs run on the CUDA cores at the fp32 rate
            # [INF: sm_70 has HMMA for fp16 only].
            peak_bf16_flops_per_s=15.7 * TERA,
            peak_fp16_flops_per_s=125 * TERA,  # tensor performance 125 TF [SRC datasheet]
            peak_fp8_flops_per_s=None,
            peak_fp32_flops_per_s=15.7 * TERA,  # single precision 15.7 TF [SRC datasheet]
            memory_bytes=32 * GIGA,  # 32 GB HBM2 (16 GB SKU exists)
            memory_bytes_per_s=900 * GIGA,  # 900 GB/s
            num_sms=80, tdp_w=300,
            default_cluster_preset="dgx2-v100",
            source=(
                "[SRC] NVIDIA Tesla V100 datasheet (SXM2): tensor 125 TF (fp16), FP32 15.7 TF, "
                "32 GB HBM2 at 900 GB/s; no bf16/fp8 tensor cores, bf16 at the FP32 rate [INF]."
            ),
        ),
        Device(
            name="npu-910b",
            peak_bf16_flops_per_s=300 * TERA,  # AsyncHZP paper's cluster figure (DESIGN §4/§5)
            peak_fp16_flops_per_s=300 * TERA,
            peak_fp8_flops_per_s=None,  # 910B has no fp8 cube support [SEC: gitee AI docs list FP16/BF16/INT8]
            # No published fp32 GEMM rate was found: fp32 scenarios on this device are refused.
            peak_fp32_flops_per_s=None,
            memory_bytes=64 * GIGA,  # 64 GB HBM2e [SEC: gitee AI docs; AsyncHZP reading note]
            memory_bytes_per_s=1.6 * TERA,  # ≈1.6 TB/s, unconfirmed [strategies.md §4]
            default_cluster_preset="hzp-npu",
            source=(
                "AsyncHZP (arXiv 2510.20111) cluster as reported secondhand: ~300 dense BF16 TF, "
                "64 GB (DESIGN §4) [SEC]; Ascend 910B class 280-376 TF [SEC strategies.md §4]; "
                "HBM bandwidth ≈1.6 TB/s unconfirmed [strategies.md §4]; no published fp32 GEMM rate."
            ),
        ),
        Device(
            name="cpu-local",  # ONE of the 2 worker processes of the local CPU box (1 core each)
            # Measured 2026-11-21 on this machine (Intel Xeon, 2 vCPUs, 24.7 GB RAM, numpy 2.4.6,
            # OpenBLAS 0.3.31), script: fp32 (n=2048)^3 matmul best of 10; np.copyto 256 MiB best
            # of 10 counting read+write bytes:
            #   OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1: 1.12e11 FLOP/s, 2.12e10 B/s
            #   OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2: 2.35e11 and 1.81e11 FLOP/s (two runs,
            #   noisy), 2.04e10-2.30e10 B/s
            # Per device we take the 1-core figures (2 processes share the 2 cores).
            # bf16/fp16: no native matmul units on this CPU -> set to the fp32 rate (an upper
            # bound; torch bf16 CPU GEMMs are usually slower; `hzpsim calibrate` refines it).
            peak_bf16_flops_per_s=1.12e11,
            peak_fp16_flops_per_s=1.12e11,
            peak_fp8_flops_per_s=None,
            peak_fp32_flops_per_s=1.12e11,
            memory_bytes=24731700 * 1024 / 2,  # MemTotal (/proc/meminfo) split between 2 procs
            memory_bytes_per_s=2.12e10,  # single-stream copy; both procs share the memory bus
            # Host costs until `hzpsim calibrate machine` measures them on the user's box:
            # kernel: a [1] torch.mul recorded by autograd, 4.0 us in one unloaded process
            # (torch 2.13.0, 1 thread, mean of 20,000 calls, 2026-11-23); call: issuing a 2-rank
            # gloo all_reduce(async_op=True), 1.5e-4 s with 4 processes on the 2 vCPUs
            # (docs/executor-results/profile-world4.yaml, measurements.call_issue_s).
            kernel_launch_s=4.0e-6,
            collective_call_s=1.5e-4,
            synchronous_host=True,  # eager CPU kernels run on the Python thread that dispatches them
            # gloo's all-gathers etc. are memcpy + TCP loopback on the same vCPUs (no DMA engine,
            # no NIC offload): torch/csrc/distributed/c10d/ProcessGroupGloo.cpp runs each call's
            # algorithm on a CPU worker thread of the calling process
            communication_uses_compute_cores=True,
            default_cluster_preset="local-cpu",
            source=(
                "measured 2026-11-21 on this box with /tmp/measure_cpu.py-style numpy script: "
                "`OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python measure_cpu.py` -> fp32 matmul "
                "(2048^3, best of 10) 1.12e11 FLOP/s, np.copyto 256 MiB (read+write, best of 10) "
                "2.12e10 B/s; with 2 threads 1.8-2.35e11 FLOP/s. RAM MemTotal 24,731,700 kB split "
                "over 2 processes. Placeholder until `hzpsim calibrate` re-measures."
            ),
        ),
    )
}


def get_device(name: str, overrides: tuple[tuple[str, Any], ...] = ()) -> Device:
    """Catalog lookup (pure: no files), with measured ``overrides`` (field, value) applied;
    ValueError naming the known devices if ``name`` is unknown."""
    try:
        device = DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r} (known: {', '.join(sorted(DEVICES))})") from None
    if not overrides:
        return device
    return replace(device, source=f"{device.source} Calibrated: {dict(overrides)}.", **dict(overrides))  # type: ignore[arg-type]


CALIBRATED_FIELDS = ("peak_bf16_flops_per_s", "peak_fp16_flops_per_s", "peak_fp32_flops_per_s",
                     "memory_bytes_per_s", "memory_bytes", "kernel_launch_s", "collective_call_s",
                     "fsdp2_call_host_s", "dtensor_op_host_s", "collective_hop_delay_s",
                     "asynchzp_op_host_s", "node_cpu_cores")
COLLECTIVE_TABLES = ("collective_costs", "collective_cpu_costs")  # per kind and group size (collective_cost_table)


def collective_cost_table(rows) -> tuple[tuple[str, int, float, float], ...]:
    """``collective_costs`` (or ``collective_cpu_costs``) of a calibration profile ([[kind,
    group size, seconds, seconds per byte], ...]) as the Device field; ValueError on a
    malformed row."""
    table = []
    for row in rows or ():
        kind, group, latency, per_byte = row
        table.append((str(kind), int(group), float(latency), float(per_byte)))
    return tuple(table)


def calibration_overrides(name: str) -> tuple[tuple[str, Any], ...]:
    """Measured rates of device ``name`` that ``hzpsim calibrate machine`` (without ``--out``)
    wrote to ``<user config>/devices/<name>.yaml``, as (field, value) pairs; () if none. Read
    once, at scenario load (``ClusterSpec.resolved``), never by a Topology."""
    from pathlib import Path

    import yaml

    from hzpsim.presets import user_config_dir

    path = Path(user_config_dir()) / "devices" / f"{name}.yaml"
    if not path.is_file():
        return ()
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    values: list[tuple[str, Any]] = [(k, float(v)) for k, v in sorted(data.items())
                                     if k in CALIBRATED_FIELDS and isinstance(v, int | float) and v > 0]
    for key in COLLECTIVE_TABLES:
        if data.get(key):
            values.append((key, collective_cost_table(data[key])))
    return tuple(values)
