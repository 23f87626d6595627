"""Devices as data: one YAML file per device, read into a :class:`Device`.

The built-in devices are the files in ``hzpsim/data/devices/`` (``hzpsim list devices``); a
scenario's ``cluster.device`` names one of them or gives the path of a device file of the same
format (``docs/hardware-constants.md``, "Device files"), and ``hzpsim calibrate machine`` writes
one measured on the user's machine. A file with a missing or nonsensical field is refused with
a ``ValueError`` naming the field. Every number carries its source. Tags follow ``docs/strategies.md``: [SRC] primary source
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

import functools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

PRECISIONS = ("bf16", "fp16", "fp8", "fp32")

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Achieved fraction of peak per kernel class on one device (priors, each with its source;
    the calibration profile replaces ``gemm``, ``hbm`` and the attention fraction on a device
    whose ``fitted_constants`` is true: ``hardware/compute.py`` ``efficiency_for``)."""

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
    fitted_constants: bool = True
    """The calibration profile's fitted constants apply (False: the rates are this machine's
    measurements, e.g. a device file written by ``hzpsim calibrate machine``)."""
    gemm_constant: str | None = None
    """Suffix of the fitted ``gemm_sm_efficiency.<suffix>`` constant shared by devices of one SM
    design (None: ``gemm`` stays the prior)."""
    gemm_tile_overhead_k: float = 0.0
    """A GEMM tile's fixed prologue and epilogue, as the K-depth of main loop it costs
    (``hardware/compute.py``, :data:`~hzpsim.hardware.compute.GEMM_TILE_OVERHEAD_K_HOPPER`);
    0 where it was not measured."""
    attention_rates: tuple[tuple[str, float, float], ...] = ()
    """Per fused attention kernel family, its forward speed as a fraction of the dense 16-bit
    peak at head dimension 64 and at 128 (long sequences); () = one rate for every kernel."""


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
    mx_formats: bool = False  # tensor cores run block-scaled MX formats (MXFP8: training.fp8_recipe mxfp8)
    efficiency: Efficiency = field(default_factory=lambda: Efficiency(
        gemm=1.0, attention_forward=1.0, attention_backward=1.0, hbm=1.0, source="peaks are measured rates",
        fitted_constants=False))
    path: str | None = None  # the device file it was read from (None: built in code)

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
    # instead of NCCL's model)
    collective_costs: tuple[tuple[str, int, float, float], ...] = ()
    # host costs of a framework's own Python, keyed by the implementation profile's
    # ``framework_host`` (strategies/_implementations.py): (framework, "call_s" | "op_s", seconds),
    # "call_s" per collective call, "op_s" per dispatched op instead of ``kernel_launch_s``
    framework_host_s: tuple[tuple[str, str, float], ...] = ()
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
    # the GEMM sweep measured on this device (`hzpsim calibrate machine`): (m, k, n, FLOP/s in
    # wall time while every rank works, FLOP/s of one rank alone on a core); a scenario on it
    # runs its GEMMs at the rate the sweep gives its shapes (:func:`effective_gemm_rate`)
    gemm_sweep: tuple[tuple[float, float, float, float, float], ...] = ()
    # device memory outside the training's tensors (the device file's ``memory`` section,
    # docs/memory.md): PyTorch's caching allocator (reserved >= allocated) or none (a CPU:
    # reserved = allocated); outside the allocator, the driver's context and each collective
    # communicator's own buffers; inside it, the GEMM library's workspace per compute stream
    caching_allocator: bool = False
    context_bytes: float = 0.0
    communicator_bytes: float = 0.0
    gemm_workspace_bytes: float = 0.0

    @property
    def memory_label_gb(self) -> float:
        """The memory size the vendor's name gives (e.g. 80 for "H100 80GB")."""
        return self.nominal_memory_gb if self.nominal_memory_gb is not None else self.memory_bytes / 1e9

    def framework_cost_s(self, framework: str, what: str) -> float | None:
        """The measured host cost ``what`` ("call_s" or "op_s") of ``framework``'s Python, or None."""
        for name, kind, seconds in self.framework_host_s:
            if name == framework and kind == what:
                return seconds
        return None

    def scaled_costs(self, factor: float) -> Device:
        """This device when every CPU cost takes ``factor`` times as long (rates / factor, host
        and collective seconds x factor); with a CPU pool, a pool of 1/``factor`` the cores."""
        if self.node_cpu_cores:
            return replace(self, node_cpu_cores=self.node_cpu_cores / factor)

        def times(value):
            return value * factor if value is not None else None

        def rate(value):
            return value / factor if value is not None else None

        return replace(
            self, peak_fp32_flops_per_s=rate(self.peak_fp32_flops_per_s),
            peak_bf16_flops_per_s=rate(self.peak_bf16_flops_per_s), peak_fp16_flops_per_s=rate(self.peak_fp16_flops_per_s),
            memory_bytes_per_s=rate(self.memory_bytes_per_s), kernel_launch_s=times(self.kernel_launch_s),
            collective_call_s=times(self.collective_call_s),
            framework_host_s=tuple((f, k, s * factor) for f, k, s in self.framework_host_s),
            collective_hop_delay_s=times(self.collective_hop_delay_s),
            collective_costs=tuple((k, g, lat * factor, per_byte * factor) for k, g, lat, per_byte in self.collective_costs))

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

    def to_file(self) -> dict[str, Any]:
        """This device as a device-file mapping (:func:`load_device` reads it back equal)."""
        e = self.efficiency
        doc: dict[str, Any] = {
            "name": self.name, "source": self.source,
            "peak_flops_per_s": {"bf16": self.peak_bf16_flops_per_s, "fp16": self.peak_fp16_flops_per_s,
                                 "fp8": self.peak_fp8_flops_per_s, "fp32": self.peak_fp32_flops_per_s},
            "memory_bytes": self.memory_bytes, "memory_bytes_per_s": self.memory_bytes_per_s,
            "nominal_memory_gb": self.nominal_memory_gb, "num_sms": self.num_sms, "tdp_w": self.tdp_w,
            "power_limit_w": self.power_limit_w,
            "default_cluster_preset": self.default_cluster_preset, "attention_kernels": list(self.attention_kernels),
            "mx_formats": self.mx_formats or None,
            "efficiency": {"gemm": e.gemm, "gemm_fp8": e.gemm_fp8, "attention_forward": e.attention_forward,
                           "attention_backward": e.attention_backward, "hbm": e.hbm,
                           "comm_overlap_slowdown": e.comm_overlap_slowdown, "attention_fraction": e.attention_fraction,
                           "fitted_constants": e.fitted_constants, "gemm_constant": e.gemm_constant, "source": e.source,
                           "gemm_tile_overhead_k": e.gemm_tile_overhead_k or None,
                           "attention_rates": {k: [a, b] for k, a, b in e.attention_rates}},
            "host": {"kernel_launch_s": self.kernel_launch_s, "collective_call_s": self.collective_call_s,
                     "synchronous": self.synchronous_host,
                     "communication_uses_compute_cores": self.communication_uses_compute_cores,
                     "frameworks": _frameworks_doc(self.framework_host_s),
                     "collective_hop_delay_s": self.collective_hop_delay_s, "node_cpu_cores": self.node_cpu_cores,
                     "collective_costs": [list(r) for r in self.collective_costs],
                     "collective_cpu_costs": [list(r) for r in self.collective_cpu_costs]},
            "gemm_sweep": [list(r) for r in self.gemm_sweep],
            "memory": {"caching_allocator": self.caching_allocator, "context_bytes": self.context_bytes or None,
                       "communicator_bytes": self.communicator_bytes or None,
                       "gemm_workspace_bytes": self.gemm_workspace_bytes or None},
        }
        return _plain(doc)


def _frameworks_doc(rows: tuple[tuple[str, str, float], ...]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for framework, kind, seconds in rows:
        out.setdefault(framework, {})[kind] = seconds
    return out


def _plain(value: Any) -> Any:
    """Drop None values and empty tables, so that a written file holds only what is known."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None and v != [] and v != {}}
    return value


# --- device files ---------------------------------------------------------------------------

#: The folder of the built-in device files, shipped in the package.
BUILTIN_DIR = Path(__file__).resolve().parent.parent / "data" / "devices"


class _Reader:
    """Typed reads of one device file's mapping; ValueError naming the file and the field."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a device file must be a mapping")
        self.data, self.where = data, where

    def section(self, key: str, required: bool = False) -> _Reader:
        value = self.data.get(key)
        if value is None and not required:
            value = {}
        if not isinstance(value, dict):
            raise ValueError(f"{self.where}: {key}: must be a mapping")
        return _Reader(value, f"{self.where}: {key}.")

    def _fail(self, key: str, what: str) -> ValueError:
        where = self.where if self.where.endswith(".") else self.where + ": "
        return ValueError(f"{where}{key}: {what}, got {self.data.get(key)!r}")

    def number(self, key: str, required: bool = False, low: float = 0.0, high: float = math.inf,
               strict: bool = True) -> float | None:
        v = self.data.get(key)
        if v is None:
            if required:
                raise self._fail(key, "missing (a number is required)")
            return None
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (v > low if strict else v >= low) and v <= high
        if not ok:
            bound = f"{'>' if strict else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
            raise self._fail(key, f"must be a finite number {bound}")
        return float(v)

    def text(self, key: str, required: bool = False) -> str | None:
        v = self.data.get(key)
        if v is None and not required:
            return None
        if not isinstance(v, str) or not v.strip():
            raise self._fail(key, "must be a non-empty string")
        return v

    def flag(self, key: str, default: bool) -> bool:
        v = self.data.get(key, default)
        if not isinstance(v, bool):
            raise self._fail(key, "must be true or false")
        return v

    def table(self, key: str, width: int) -> list[list[Any]]:
        v = self.data.get(key) or []
        if not isinstance(v, list) or any(not isinstance(r, list) or len(r) != width for r in v):
            raise self._fail(key, f"must be a list of rows of {width} values")
        return v


def _cost_table(reader: _Reader, key: str) -> tuple[tuple[str, int, float, float], ...]:
    rows = []
    for i, row in enumerate(reader.table(key, 4)):
        kind, group, a, b = row
        if (not isinstance(kind, str) or isinstance(group, bool) or not isinstance(group, int) or group < 1
                or any(isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x < 0 for x in (a, b))):
            raise ValueError(f"{reader.where}{key}[{i}]: must be [kind, group size >= 1, seconds >= 0, "
                             f"seconds per byte >= 0], got {row!r}")
        rows.append((kind, group, float(a), float(b)))
    return tuple(rows)


def device_from_mapping(data: Any, where: str) -> Device:
    """A :class:`Device` from a device file's mapping; ValueError naming ``where`` and the field."""
    r = _Reader(data, where)
    known = {"name", "source", "peak_flops_per_s", "memory_bytes", "memory_bytes_per_s", "nominal_memory_gb",
             "num_sms", "tdp_w", "power_limit_w", "default_cluster_preset", "attention_kernels", "efficiency",
             "host", "gemm_sweep", "memory", "mx_formats"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: {unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
    peaks = r.section("peak_flops_per_s", required=True)
    bf16 = peaks.number("bf16", required=True)
    sms = r.data.get("num_sms")
    if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int) or sms < 1):
        raise r._fail("num_sms", "must be a whole number >= 1")
    kernels = r.data.get("attention_kernels") or []
    if not isinstance(kernels, list) or not all(isinstance(k, str) for k in kernels):
        raise r._fail("attention_kernels", "must be a list of kernel family names")
    e = r.section("efficiency")
    rates_doc = e.data.get("attention_rates") or {}
    if not isinstance(rates_doc, dict):
        raise e._fail("attention_rates", "must map kernel families to [fraction at head dim 64, at 128]")
    rates = []
    for kernel, pair in rates_doc.items():
        if (not isinstance(pair, list) or len(pair) != 2
                or any(isinstance(x, bool) or not isinstance(x, int | float) or not 0 < x <= 1 for x in pair)):
            raise ValueError(f"{e.where}attention_rates.{kernel}: must be two fractions in (0, 1], got {pair!r}")
        rates.append((str(kernel), float(pair[0]), float(pair[1])))
    efficiency = Efficiency(
        gemm=e.number("gemm", high=1.0) or 1.0, attention_forward=e.number("attention_forward", high=1.0) or 1.0,
        attention_backward=e.number("attention_backward", high=1.0) or 1.0, hbm=e.number("hbm", high=1.0) or 1.0,
        source=e.text("source") or "priors not stated: the peaks are taken as reached",
        comm_overlap_slowdown=e.number("comm_overlap_slowdown", strict=False) or 0.0,
        gemm_fp8=e.number("gemm_fp8", high=1.0), attention_fraction=e.number("attention_fraction", high=2.0) or 1.0,
        fitted_constants=e.flag("fitted_constants", False), gemm_constant=e.text("gemm_constant"), attention_rates=tuple(rates),
        gemm_tile_overhead_k=e.number("gemm_tile_overhead_k", strict=False, high=1e5) or 0.0)
    h = r.section("host")
    frameworks = h.data.get("frameworks") or {}
    if not isinstance(frameworks, dict):
        raise h._fail("frameworks", "must map framework names to {call_s, op_s}")
    framework_host_s = []
    for framework, costs in sorted(frameworks.items()):
        fr = _Reader(costs, f"{h.where}frameworks.{framework}")
        for kind in sorted(costs):
            if kind not in ("call_s", "op_s"):
                raise ValueError(f"{fr.where}.{kind}: unknown host cost (known: call_s, op_s)")
            framework_host_s.append((str(framework), kind, fr.number(kind, required=True)))
    sweep = []
    for i, row in enumerate(r.table("gemm_sweep", 5)):
        if any(isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x <= 0 for x in row):
            raise ValueError(f"{where}: gemm_sweep[{i}]: must be [m, k, n, FLOP/s, FLOP/s alone], all > 0, got {row!r}")
        sweep.append(tuple(float(x) for x in row))
    path = where if where.endswith((".yaml", ".yml")) else None
    m = r.section("memory")
    unknown = sorted(set(m.data) - {"caching_allocator", "context_bytes", "communicator_bytes", "gemm_workspace_bytes"})
    if unknown:
        raise ValueError(f"{where}: memory.{unknown[0]}: unknown field (known: caching_allocator, "
                         "communicator_bytes, context_bytes, gemm_workspace_bytes)")
    memory = {k: m.number(k, strict=False) or 0.0 for k in ("context_bytes", "communicator_bytes", "gemm_workspace_bytes")}
    return Device(
        caching_allocator=m.flag("caching_allocator", False), **memory,
        name=r.text("name", required=True), source=r.text("source", required=True),  # type: ignore[arg-type]
        peak_bf16_flops_per_s=bf16, peak_fp16_flops_per_s=peaks.number("fp16") or bf16,  # type: ignore[arg-type]
        peak_fp8_flops_per_s=peaks.number("fp8"), peak_fp32_flops_per_s=peaks.number("fp32"),
        memory_bytes=r.number("memory_bytes", required=True),  # type: ignore[arg-type]
        memory_bytes_per_s=r.number("memory_bytes_per_s", required=True),  # type: ignore[arg-type]
        default_cluster_preset=r.text("default_cluster_preset", required=True),  # type: ignore[arg-type]
        nominal_memory_gb=r.number("nominal_memory_gb"), num_sms=sms, tdp_w=r.number("tdp_w"),
        power_limit_w=r.number("power_limit_w"), attention_kernels=tuple(kernels), efficiency=efficiency,
        mx_formats=r.flag("mx_formats", False),
        path=path,
        kernel_launch_s=h.number("kernel_launch_s"), collective_call_s=h.number("collective_call_s"),
        synchronous_host=h.flag("synchronous", False),
        communication_uses_compute_cores=h.flag("communication_uses_compute_cores", False),
        collective_costs=_cost_table(h, "collective_costs"), framework_host_s=tuple(framework_host_s),  # type: ignore[arg-type]
        collective_hop_delay_s=h.number("collective_hop_delay_s", strict=False),
        node_cpu_cores=h.number("node_cpu_cores"), collective_cpu_costs=_cost_table(h, "collective_cpu_costs"),
        gemm_sweep=tuple(sweep),  # type: ignore[arg-type]
    )


def is_device_path(text: str) -> bool:
    """``cluster.device`` names a file (a path ending in .yaml / .yml), not a built-in device."""
    return text.endswith((".yaml", ".yml"))


@functools.lru_cache(maxsize=256)
def _read(path: str, mtime_ns: int) -> Device:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: not a readable YAML device file ({exc})") from None
    return device_from_mapping(data, path)


def load_device(path: str | Path) -> Device:
    """The device in the file at ``path``; ValueError naming the file and the bad field."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"{path}: no such device file")
    resolved = str(p.resolve())
    return _read(resolved, p.stat().st_mtime_ns)


def device_dirs() -> list[Path]:
    """Folders searched for a device named in a scenario, highest priority first: the user's
    (``<user config>/devices``, where ``hzpsim calibrate machine`` writes) and the built-in one."""
    from hzpsim.presets import user_config_dir

    return [user_config_dir() / "devices", BUILTIN_DIR]


def builtin_names() -> list[str]:
    """Every device a scenario can name (the built-in files and the user's), sorted."""
    return sorted({p.stem for d in device_dirs() if d.is_dir() for p in d.glob("*.yaml")})


def device_file(name: str) -> Path:
    """The file that ``cluster.device: name`` reads (a path as given, or the first folder of
    :func:`device_dirs` holding ``<name>.yaml``); ValueError naming the known devices."""
    if is_device_path(name):
        return Path(name).expanduser()
    for folder in device_dirs():
        if (folder / f"{name}.yaml").is_file():
            return folder / f"{name}.yaml"
    raise ValueError(f"unknown device {name!r} (known: {', '.join(builtin_names())}; "
                     "or the path of a device file, *.yaml)")


def get_device(name: str) -> Device:
    """``name`` as a scenario's ``cluster.device`` states it: the path of a device file, or a
    device's name; ValueError naming the problem (an unknown name lists the known)."""
    return load_device(device_file(name))


def __getattr__(attribute: str) -> Any:
    """``DEVICES``: every built-in device by name, read from the folder when first asked for."""
    if attribute == "DEVICES":
        return {name: get_device(name) for name in builtin_names()}
    raise AttributeError(attribute)


def write_device(device: Device, path: str | Path, header: str = "") -> Path:
    """Write ``device`` as a device file (``header``: comment lines on top); returns the path."""
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    p.write_text(comment + yaml.safe_dump(device.to_file(), sort_keys=False, width=100, allow_unicode=True),
                 encoding="utf-8")
    return p


#: The flat fields of a machine profile's ``device`` mapping as ``hzpsim calibrate machine``
#: wrote it before devices were files (docs/executor-results/profile-world*.yaml): field ->
#: Device field, or (framework, host cost) for a framework's measured Python.
_MEASURED_FIELDS: dict[str, Any] = {
    "peak_bf16_flops_per_s": "peak_bf16_flops_per_s", "peak_fp16_flops_per_s": "peak_fp16_flops_per_s",
    "peak_fp32_flops_per_s": "peak_fp32_flops_per_s", "memory_bytes_per_s": "memory_bytes_per_s",
    "memory_bytes": "memory_bytes", "kernel_launch_s": "kernel_launch_s", "collective_call_s": "collective_call_s",
    "collective_hop_delay_s": "collective_hop_delay_s", "node_cpu_cores": "node_cpu_cores",
    "fsdp2_call_host_s": ("fsdp2", "call_s"), "dtensor_op_host_s": ("dtensor", "op_s"),
    "asynchzp_op_host_s": ("hzpsim-executor", "op_s"),
}


def with_measurements(device: Device, measured: dict[str, Any], where: str = "device") -> Device:
    """``device`` with a machine profile's flat measured fields (``_MEASURED_FIELDS``, the
    ``collective_costs`` / ``collective_cpu_costs`` tables) applied; ValueError naming a bad one."""
    reader = _Reader(measured, where)
    changes: dict[str, Any] = {}
    frameworks = dict(((f, k), s) for f, k, s in device.framework_host_s)
    for key, target in _MEASURED_FIELDS.items():
        value = reader.number(key, strict=key != "collective_hop_delay_s")
        if value is None:
            continue
        if isinstance(target, tuple):
            frameworks[target] = value
        else:
            changes[target] = value
    for key in ("collective_costs", "collective_cpu_costs"):
        if measured.get(key):
            changes[key] = _cost_table(reader, key)
    changes["framework_host_s"] = tuple((f, k, s) for (f, k), s in sorted(frameworks.items()))
    return replace(device, **changes)


def effective_gemm_rate(sweep: tuple[tuple[float, float, float, float, float], ...],
                        shapes: list[tuple[float, float, float]], alone: bool) -> float:
    """The FLOP/s a model's GEMMs ``shapes`` (m, k, n) get on a device measured by a GEMM sweep:
    total FLOPs over total seconds, each shape at the rate of the nearest measured shape (log
    distance); ``alone``: the rates of one rank alone on a core (a device with a CPU pool),
    else in wall time while every rank works."""
    column = 4 if alone else 3
    total_flops = total_s = 0.0
    for m, k, n in shapes:
        nearest = min(sweep, key=lambda r: sum(abs(math.log(a / b)) for a, b in zip((m, k, n), r[:3])))
        flops = 2.0 * m * k * n
        total_flops += flops
        total_s += flops / nearest[column]
    return total_flops / total_s


def gemm_sweep(rows: list[dict[str, Any]]) -> tuple[tuple[float, float, float, float, float], ...]:
    """A machine's measured GEMM sweep ({m, k, n, flops_per_s, cpu_flops_per_s}, as ``hzpsim
    calibrate machine`` records it) as the ``gemm_sweep`` field (the rate alone on a core is
    the wall rate where it was not measured)."""
    return tuple((float(r["m"]), float(r["k"]), float(r["n"]), float(r["flops_per_s"]),
                  float(r.get("cpu_flops_per_s", r["flops_per_s"]))) for r in rows)


def for_gemms(device: Device, shapes: list[tuple[float, float, float]]) -> Device:
    """``device`` running the GEMMs ``shapes`` (m, k, n): with a measured GEMM sweep, its peaks
    are the rate the sweep gives these shapes (small GEMMs on a CPU run far below a large one's
    rate; alone on a core with a CPU pool); without one, unchanged."""
    if not device.gemm_sweep or not shapes:
        return device
    rate = effective_gemm_rate(device.gemm_sweep, shapes, alone=device.node_cpu_cores is not None)
    return replace(device, peak_fp32_flops_per_s=rate, peak_bf16_flops_per_s=rate, peak_fp16_flops_per_s=rate)
