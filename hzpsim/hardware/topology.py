"""Cluster specification (the scenario's ``cluster:`` mapping) and the topology built from it.

Hierarchy, innermost first (``LEVELS``)::

    device ─► island (NVSwitch / full mesh) ─► node (between islands of one node)
           ─► leaf (between nodes of one rail group / scalable unit) ─► spine (across leaves)

Every link is described per device and per direction: ``bytes_per_s`` is the line rate
available to one device for traffic crossing that level, ``efficiency`` the achieved fraction
(NCCL-tests bus bandwidth / line rate) and ``latency_s`` the α term per ring step.

Fabric defaults come from the presets, the YAML files in ``topologies/`` (found in a checkout
or an installed wheel by :mod:`hzpsim.presets`). A ``ClusterSpec`` field left ``None`` is
taken from ``spec.preset`` or, when no preset is named, from the device's usual fabric
(``Device.default_cluster_preset``), as DESIGN §5 asks.

Two types, one boundary: ``ClusterSpec`` is what the user wrote (``None`` = from the preset);
``ClusterSpec.resolved()`` reads the preset once, at scenario load, and returns a
``ResolvedCluster`` (every field concrete). ``Topology`` is built from a ``ResolvedCluster``
only and reads no files; ``build_topology`` does both steps for a ``ClusterSpec``.

Sources of the defaults (tags as in ``docs/strategies.md``):

* NVLink4 450 GB/s/dir, achieved ≈370 GB/s busbw → η = 370/450 ≈ 0.822
  [SRC NVIDIA/nccl-tests #212, strategies.md §3].
* NVLink3 300 GB/s/dir, 230–250 GB/s AR busbw (232.5 measured) → η = 0.80
  [SEC docs.alayanew.com; SRC NVIDIA/nccl-tests #175, strategies.md §3].
* IB NDR 400 Gb/s = 50 GB/s, 46–48 GB/s per NIC → η = 47/50 = 0.94 [SRC nccl-tests #290].
* IB HDR 200 Gb/s = 25 GB/s, DGX-A100 192 GB/s busbw over 8 NICs → η = 192/200 = 0.96
  [SRC NVIDIA/nccl #1576].
* 100 Gb/s NIC 12.2 GB/s → η = 0.976 [SRC NVIDIA/nccl-tests #29].
* α per ring step: NCCL's own tuning model (``src/graph/tuning.cc``, ``hwLat`` table, Ring /
  Simple protocol) uses 3.4 µs per NVLink hop and 14.0 µs per network hop [SRC NCCL source];
  strategies.md §3 gives 10–20 µs per inter-node step [INF] — consistent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .devices import Device, get_device

if TYPE_CHECKING:  # pragma: no cover
    import networkx as nx

LevelName = Literal["island", "node", "leaf", "spine"]
LEVELS: tuple[str, ...] = ("island", "node", "leaf", "spine")
#: Levels whose traffic leaves the node (the JSON report's ``inter_node`` bucket).
INTER_NODE_LEVELS: tuple[str, ...] = ("leaf", "spine")
#: Levels whose traffic stays inside a node (the JSON report's ``intra_node`` bucket).
INTRA_NODE_LEVELS: tuple[str, ...] = ("island", "node")

# NCCL src/graph/tuning.cc hwLat[NVLINK|NET][Ring][Simple], µs per ring step [SRC].
_NCCL_NVLINK_RING_STEP_S = 3.4e-6
_NCCL_NET_RING_STEP_S = 14.0e-6


_COUNT_FIELDS = ("num_nodes", "gpus_per_node", "islands_per_node", "nodes_per_leaf")

#: Default coefficient of variation of a rank's per-step noise: its time between two
#: synchronisations varies from one to the next (GC pauses, OS and Python jitter) [SRC: Lin et
#: al., "Understanding Stragglers in Large Model Training Using What-if Analysis", OSDI'25,
#: §4.3-4.4: over 3,079 jobs of >= 128 GPUs, "no obvious positive correlation between the
#: slowdown and job size"]. Derivation: noise of cv c makes a rendezvous wait c·E[max of N]
#: of the stretch, and E[max] grows from 2.6 (N = 128) to 3.9 (N = 10,000), so c = 0.03 would
#: add about 4 % more at 10,000 GPUs than at 128; a trend that size would show, 0.01 (1.3 %)
#: would not. 0.01, range 0.005-0.03 (docs/hardware-constants.md §7). Derived, NOT fitted
#: (``hzpsim calibrate`` fits only calibration/constants.py).
DEFAULT_VARIABILITY = 0.01
#: Default coefficient of variation of a device's persistent speed: some devices are slower
#: than their peers for the whole run (manufacturing spread, power management). [SRC: Sinha et
#: al., "Not All GPUs Are Created Equal", SC'22: 8 % performance variation across identical
#: GPUs of five clusters; Meta, PRISM, arXiv 2510.15596: up to 14 % GEMM performance variation
#: over 64,000 GPUs; MegaScale, NSDI'24 §5.1 / §6.3: hosts about 10 % slower, about 0.5 % of
#: them, were found and removed.] Derivation: read as the range of normal draws, 8 % over a
#: few thousand GPUs (about 6.5 sigma) is sigma = 1.2 %, 14 % over 64,000 (8.2 sigma) 1.7 %;
#: 0.012, range 0.005-0.03, for a cluster screened for outlier hosts as MegaScale's was
#: (docs/hardware-constants.md §7). Derived, NOT fitted.
DEFAULT_VARIABILITY_PERSISTENT = 0.012
_RATE_FIELDS = ("intra_node_bytes_per_s", "inter_island_bytes_per_s", "inter_node_bytes_per_s_per_device")
_EFFICIENCY_FIELDS = ("intra_node_efficiency", "inter_island_efficiency", "inter_node_efficiency")
_LATENCY_FIELDS = ("intra_node_latency_s", "inter_island_latency_s", "inter_node_latency_s")


@dataclass(frozen=True)
class Straggler:
    """One explicit straggler what-if of ``cluster.stragglers`` (exactly one of ``node`` and
    ``device``; at least one factor besides 1).

    * ``node`` — a node index (0 ≤ node < ``num_nodes``): every device of that node.
    * ``device`` — a global rank (0 ≤ device < devices; node-major, as in :class:`Topology`).
    * ``compute_slowdown`` — the device's kernels take this many times as long (ratio > 0;
      1 = as fast as the others, 1.5 = a device 1.5× slower: thermal throttling, a bad HBM
      stack, a noisy neighbour on the host).
    * ``link_bandwidth_factor`` — the device's NIC (every NIC of the node) moves this fraction of
      its bandwidth (ratio > 0; 1 = nominal, 0.5 = a link trained at half rate or congested).
      A collective whose group includes the device moves its inter-node bytes that much slower
      (a ring or tree is paced by its slowest link).

    Several entries naming the same device multiply (a slow device on a slow node).
    """

    node: int | None = None
    device: int | None = None
    compute_slowdown: float = 1.0
    link_bandwidth_factor: float = 1.0

    def validate(self) -> None:
        if (self.node is None) == (self.device is None):
            raise ValueError("node: give exactly one of 'node' and 'device'")
        for name in ("node", "device"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
                raise ValueError(f"{name}: must be an integer >= 0, got {v!r}")
        for name in ("compute_slowdown", "link_bandwidth_factor"):
            v = getattr(self, name)
            if not (_is_number(v) and v > 0 and math.isfinite(v)):
                raise ValueError(f"{name}: must be a finite factor > 0, got {v!r}")
        if self.compute_slowdown == 1 and self.link_bandwidth_factor == 1:
            raise ValueError("compute_slowdown: a straggler needs compute_slowdown or link_bandwidth_factor != 1")


@dataclass(frozen=True)
class ClusterSpec:
    """The ``cluster:`` mapping of a scenario. Every ``None`` means "from the preset".

    Fields (units; default):

    * ``preset`` — name of a preset in ``topologies/`` to start from;
      ``None`` → the device's usual fabric (``Device.default_cluster_preset``).
    * ``device`` — device catalog name (``hzpsim.hardware.devices.DEVICES``); ``None`` → preset's.
    * ``num_nodes`` — number of nodes (count; 1).
    * ``gpus_per_node`` — devices per node (count; ``None`` → preset's).
    * ``islands_per_node`` — scale-up islands per node (count; ``None`` → preset's, e.g. 1 for
      DGX, 2 for ``hzp-npu``). ``gpus_per_node`` must be divisible by it.
    * ``intra_node_bytes_per_s`` — per device, one direction, line rate inside an island
      (NVLink / HCCS mesh) (bytes/s; ``None`` → preset's).
    * ``inter_island_bytes_per_s`` — per device, one direction, line rate of the path between
      islands of one node (bytes/s; ``None`` → preset's; when the preset does not publish one:
      equal to ``intra_node_bytes_per_s`` for 1-island nodes, else conservatively the NIC path
      ``inter_node_bytes_per_s_per_device``).
    * ``inter_node_bytes_per_s_per_device`` — NIC line rate per device, one direction
      (bytes/s; ``None`` → preset's).
    * ``nodes_per_leaf`` — nodes under one leaf / rail group / scalable unit (count; ``None`` →
      preset's, e.g. 32 for a DGX H100 SuperPOD SU).
    * ``spine_oversubscription`` — leaf-uplink taper; spine bandwidth per device =
      NIC / this (ratio ≥ 1; ``None`` → preset's, 1.0 = non-blocking fat tree).
    * ``intra_node_efficiency``, ``inter_island_efficiency``, ``inter_node_efficiency`` —
      achieved fraction of line rate (0 < η ≤ 1; ``None`` → preset's).
    * ``intra_node_latency_s``, ``inter_island_latency_s``, ``inter_node_latency_s`` — α per
      ring step at that level (seconds, ≥ 0; ``None`` → preset's).
    * ``variability`` — coefficient of variation of a rank's per-step noise, its time between
      synchronisations drawn anew each time (0 ≤ cv < 1; ``None`` → the preset's, else
      ``DEFAULT_VARIABILITY``); a collective over N ranks waits for the slowest of N draws.
      0 switches it off.
    * ``variability_persistent`` — coefficient of variation of a device's persistent speed
      (0 ≤ cv < 1; ``None`` → the preset's, else ``DEFAULT_VARIABILITY_PERSISTENT``): the
      slowest of a group's devices is slow at every rendezvous, so its lateness grows with all
      the work since the step began. 0 switches it off.
    * ``variability_seed`` — seed of the draws under ``--expand`` (count ≥ 0; 0).
    * ``stragglers`` — explicit what-ifs (list of :class:`Straggler`; none): a slow device
      (``{device: 17, compute_slowdown: 1.5}``), a slow node (``{node: 3, compute_slowdown:
      1.2}``), a slow link (``{node: 5, link_bandwidth_factor: 0.5}``). Deterministic, on top
      of ``variability``; the strategies simulate the straggler's class explicitly.
    """

    preset: str | None = None
    device: str | None = None
    num_nodes: int = 1
    gpus_per_node: int | None = None
    islands_per_node: int | None = None
    intra_node_bytes_per_s: float | None = None
    inter_island_bytes_per_s: float | None = None
    inter_node_bytes_per_s_per_device: float | None = None
    nodes_per_leaf: int | None = None
    spine_oversubscription: float | None = None
    intra_node_efficiency: float | None = None
    inter_island_efficiency: float | None = None
    inter_node_efficiency: float | None = None
    intra_node_latency_s: float | None = None
    inter_island_latency_s: float | None = None
    inter_node_latency_s: float | None = None
    device_memory_bytes: float | None = None  # override of the device's memory capacity (bytes); None = the catalog's
    device_power_limit_w: float | None = None  # power cap of each device (W); None = its TDP
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (sim/allocator.py)
    min_memory_headroom_bytes: float = 0.0  # a layout fits only with at least this much device memory left
    variability: float | None = None  # cv of per-rank time between synchronisations; None = default
    variability_seed: int | None = None  # seed of the sampled draws under --expand; None = 0
    variability_persistent: float | None = None  # cv of a device's persistent speed; None = default
    stragglers: tuple[Straggler, ...] = ()  # explicit slow devices, nodes and links; none by default
    price_per_device_hour: float | None = None  # what one device costs per hour: the run's cost in the report
    node_overhead_w: float | None = None  # a node's power besides its accelerators at load (W); None = preset's, else 0
    pue: float | None = None  # the facility's power usage effectiveness (>= 1); None = 1 (IT energy only)

    def validate(self) -> None:
        """Check the fields that are set; raise ``ValueError("<field>: <problem>")``."""
        if self.preset is not None and self.preset not in preset_names():
            raise ValueError(
                f"preset: unknown preset {self.preset!r} (known: {', '.join(preset_names())})"
            )
        if self.device is not None:
            try:
                get_device(self.device)
            except ValueError as e:
                raise ValueError(f"device: {e}") from None
        for name in _COUNT_FIELDS:
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name}: must be an integer, got {v!r}")
            if v < 1:
                raise ValueError(f"{name}: must be >= 1, got {v}")
        for name in _RATE_FIELDS:
            v = getattr(self, name)
            if v is not None and not (_is_number(v) and v > 0 and math.isfinite(v)):
                raise ValueError(f"{name}: must be a positive finite number of bytes/s, got {v!r}")
        for name in _EFFICIENCY_FIELDS:
            v = getattr(self, name)
            if v is not None and not (_is_number(v) and 0 < v <= 1):
                raise ValueError(f"{name}: must be in (0, 1], got {v!r}")
        for name in _LATENCY_FIELDS:
            v = getattr(self, name)
            # beyond 1e9 s (32 years) per ring step the simulated clock's sums overflow to nan
            if v is not None and not (_is_number(v) and 0 <= v <= 1e9):
                raise ValueError(f"{name}: must be a number of seconds in [0, 1e9], got {v!r}")
        for name in ("variability", "variability_persistent"):
            v = getattr(self, name)
            if v is not None and not (_is_number(v) and 0 <= v < 1):
                raise ValueError(f"{name}: must be a coefficient of variation in [0, 1), got {v!r}")
        v = self.variability_seed
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
            raise ValueError(f"variability_seed: must be an integer >= 0, got {v!r}")
        v = self.device_memory_bytes
        if v is not None and not (_is_number(v) and v > 0 and math.isfinite(v)):
            raise ValueError(f"device_memory_bytes: must be a positive number of bytes, got {v!r}")
        v = self.device_power_limit_w
        if v is not None and not (_is_number(v) and v > 0 and math.isfinite(v)):
            raise ValueError(f"device_power_limit_w: must be a positive number of watts, got {v!r}")
        if not isinstance(self.expandable_segments, bool):
            raise ValueError(f"expandable_segments: must be true or false, got {self.expandable_segments!r}")
        v = self.min_memory_headroom_bytes
        if not (_is_number(v) and v >= 0 and math.isfinite(v)):
            raise ValueError(f"min_memory_headroom_bytes: must be a finite number of bytes >= 0, got {v!r}")
        v = self.price_per_device_hour
        if v is not None and not (_is_number(v) and v >= 0 and math.isfinite(v)):
            raise ValueError(f"price_per_device_hour: must be a finite price >= 0, got {v!r}")
        v = self.node_overhead_w
        if v is not None and not (_is_number(v) and v >= 0 and math.isfinite(v)):
            raise ValueError(f"node_overhead_w: must be a finite number of watts >= 0, got {v!r}")
        v = self.pue
        if v is not None and not (_is_number(v) and 1 <= v <= 10):
            raise ValueError(f"pue: must be a power usage effectiveness in [1, 10], got {v!r}")
        v = self.spine_oversubscription
        if v is not None and not (_is_number(v) and v >= 1 and math.isfinite(v)):
            raise ValueError(f"spine_oversubscription: must be a finite ratio >= 1, got {v!r}")
        _check_islands_divide(self.gpus_per_node, self.islands_per_node)
        for i, straggler in enumerate(self.stragglers):
            if not isinstance(straggler, Straggler):
                raise ValueError(f"stragglers[{i}]: expected a mapping, got {straggler!r}")
            try:
                straggler.validate()
            except ValueError as exc:
                raise ValueError(f"stragglers[{i}].{exc}") from None
            if straggler.node is not None and straggler.node >= self.num_nodes:
                raise ValueError(f"stragglers[{i}].node: {straggler.node} out of range [0, {self.num_nodes}) "
                                 f"(num_nodes = {self.num_nodes})")

    def resolved(self) -> ResolvedCluster:
        """Every ``None`` filled from the preset (or the device's usual fabric).

        The boundary between the scenario and the simulator: it reads the preset file (once) and
        checks the rules that only the merged values can break. ``self`` must already be valid
        (:func:`~hzpsim.config.from_mapping` validated it, or call :meth:`validate`); errors are
        ``ValueError("<field>: <problem>")``.
        """
        if self.preset is not None:
            base_name = self.preset
        elif self.device is not None:
            base_name = get_device(self.device).default_cluster_preset
        else:
            raise ValueError("device: required when no preset is given")
        if base_name not in preset_names():
            raise ValueError(
                f"device: default preset {base_name!r} of device {self.device!r} is not shipped"
            )
        base = preset_spec(base_name)
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in values.items():
            if v is None:
                values[k] = getattr(base, k)
        values["preset"] = base_name
        islands = values["islands_per_node"]
        # Inter-island path not published by the preset: 1 island → same as intra (unused);
        # several islands → conservatively the NIC path (DESIGN §5).
        fallback = "intra_node" if islands == 1 else "inter_node"
        if values["inter_island_bytes_per_s"] is None:
            values["inter_island_bytes_per_s"] = (
                values["intra_node_bytes_per_s"]
                if fallback == "intra_node"
                else values["inter_node_bytes_per_s_per_device"]
            )
        if values["inter_island_efficiency"] is None:
            values["inter_island_efficiency"] = values[f"{fallback}_efficiency"]
        if values["inter_island_latency_s"] is None:
            values["inter_island_latency_s"] = values[f"{fallback}_latency_s"]
        if values["variability"] is None:
            values["variability"] = DEFAULT_VARIABILITY
        if values["variability_seed"] is None:
            values["variability_seed"] = 0
        if values["variability_persistent"] is None:
            values["variability_persistent"] = DEFAULT_VARIABILITY_PERSISTENT
        # the device's file, read once here (the Topology reuses it)
        device = get_device(values["device"]) if values["device"] is not None else None
        if values["device_memory_bytes"] is None and device is not None:
            values["device_memory_bytes"] = device.memory_bytes
        if device is not None:
            outside = device.context_bytes + device.communicator_bytes + values["min_memory_headroom_bytes"]
            if values["device_memory_bytes"] <= outside:
                raise ValueError(
                    f"device_memory_bytes: {values['device_memory_bytes']:.4g} bytes leave nothing for the training: "
                    f"device {values['device']!r} needs {device.context_bytes + device.communicator_bytes:.4g} bytes "
                    "outside PyTorch's allocator for its context and one communicator"
                    + (f", plus min_memory_headroom_bytes {values['min_memory_headroom_bytes']:.4g}"
                       if values["min_memory_headroom_bytes"] else ""))
        if device is not None:
            tdp = device.tdp_w
            if values["device_power_limit_w"] is None:
                values["device_power_limit_w"] = tdp or 0.0
            elif tdp is None:
                raise ValueError(f"device_power_limit_w: device {values['device']!r} has no TDP in the "
                                 "catalog, so a power cap cannot be modelled")
        if values["node_overhead_w"] is None:  # no preset states the nodes' own power: none counted
            values["node_overhead_w"] = 0.0
        if values["pue"] is None:  # the IT energy alone
            values["pue"] = 1.0
        # each value comes from a validated mapping (this spec or the preset file); only the
        # cross-field rule can be broken by mixing the two
        _check_islands_divide(values["gpus_per_node"], values["islands_per_node"])
        missing = [k for k, v in values.items() if v is None and k not in _OPTIONAL_FIELDS]
        if missing:
            raise ValueError(f"{missing[0]}: not set and preset {base_name!r} has no default")
        devices = values["num_nodes"] * values["gpus_per_node"]
        for i, straggler in enumerate(values["stragglers"]):
            if straggler.device is not None and straggler.device >= devices:
                raise ValueError(f"stragglers[{i}].device: {straggler.device} out of range [0, {devices}) "
                                 f"({values['num_nodes']} nodes x {values['gpus_per_node']} devices)")
        typed: dict[str, Any] = {  # plain int / float, whatever numbers the spec was built with
            k: v if v is None or isinstance(v, (str, tuple, bool))
            else int(v) if k in (*_COUNT_FIELDS, "variability_seed") else float(v)
            for k, v in values.items()
        }
        return ResolvedCluster(**typed, device_spec=device)


_OPTIONAL_FIELDS = ("price_per_device_hour",)
"""Cluster fields that may stay unset after the preset is applied (None: not asked for)."""


def _check_islands_divide(gpus_per_node: int | None, islands_per_node: int | None) -> None:
    if gpus_per_node is not None and islands_per_node is not None and gpus_per_node % islands_per_node:
        raise ValueError(
            f"gpus_per_node: {gpus_per_node} is not divisible by islands_per_node={islands_per_node}"
        )


@dataclass(frozen=True)
class ResolvedCluster:
    """A cluster with every field concrete: what :class:`Topology` is built from.

    Produced once, at scenario load, by :meth:`ClusterSpec.resolved` (the preset and the
    fallbacks applied, the merged values checked). Field names and units are those of
    :class:`ClusterSpec`; nothing here is ``None`` and nothing here is re-validated.
    """

    preset: str
    """Name of the preset the cluster started from (the device's usual fabric if none was named)."""
    device: str
    """Device catalog name (``hzpsim.hardware.devices.DEVICES``)."""
    num_nodes: int
    """Number of nodes (count ≥ 1)."""
    gpus_per_node: int
    """Devices per node (count ≥ 1, a multiple of ``islands_per_node``)."""
    islands_per_node: int
    """Scale-up islands (NVSwitch domain / full mesh) per node (count ≥ 1)."""
    intra_node_bytes_per_s: float
    """Per device, one direction, line rate inside an island (bytes/s)."""
    inter_island_bytes_per_s: float
    """Per device, one direction, line rate between islands of one node (bytes/s)."""
    inter_node_bytes_per_s_per_device: float
    """NIC line rate per device, one direction (bytes/s)."""
    nodes_per_leaf: int
    """Nodes under one leaf switch / rail group / scalable unit (count ≥ 1)."""
    spine_oversubscription: float
    """Leaf-uplink taper: spine bandwidth per device = NIC / this (ratio ≥ 1)."""
    intra_node_efficiency: float
    """Achieved fraction of the island line rate (0 < η ≤ 1)."""
    inter_island_efficiency: float
    """Achieved fraction of the inter-island line rate (0 < η ≤ 1)."""
    inter_node_efficiency: float
    """Achieved fraction of the NIC line rate, leaf and spine (0 < η ≤ 1)."""
    intra_node_latency_s: float
    """α per ring step inside an island (seconds ≥ 0)."""
    inter_island_latency_s: float
    """α per ring step between islands of one node (seconds ≥ 0)."""
    inter_node_latency_s: float
    """α per ring step through the NIC, leaf and spine (seconds ≥ 0)."""
    device_memory_bytes: float
    """Memory capacity of one device (bytes; the catalog's unless overridden)."""
    device_power_limit_w: float
    """Power cap of each device (W; its TDP unless set; 0 = a device without a TDP): a cap
    below the TDP lowers the sustained compute clock."""
    expandable_segments: bool
    """The caching allocator grows one segment per stream instead of reserving new ones."""
    min_memory_headroom_bytes: float
    """Device memory that must stay free for a layout to count as fitting (bytes >= 0)."""
    variability: float
    """Coefficient of variation of a rank's time between synchronisations (0 = off)."""
    variability_seed: int
    """Seed of the sampled draws under ``--expand``."""
    variability_persistent: float = 0.0
    """Coefficient of variation of a device's persistent speed (0 = off)."""
    stragglers: tuple[Straggler, ...] = ()
    """Explicit slow devices, nodes and links (validated, in range)."""
    price_per_device_hour: float | None = None
    """What one device costs per hour (None: not given, no cost in the report)."""
    node_overhead_w: float = 0.0
    """A node's power besides its accelerators at load, W (0 where no preset states it)."""
    pue: float = 1.0
    """The facility's power usage effectiveness (1: the IT energy alone)."""
    device_spec: Device | None = None
    """The device ``device`` names, read from its file once, at load (None: read when built)."""


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


# --- presets ---------------------------------------------------------------------------------
# The presets are the YAML files in topologies/ (each a ClusterSpec mapping with its sources as
# comments); num_nodes is not part of a preset (ClusterSpec default: 1 node).


def preset_names() -> list[str]:
    """Names of the cluster presets (``topologies/*.yaml`` and the user config folder)."""
    from hzpsim.presets import list_presets

    return list_presets("topologies")


def preset_spec(name: str) -> ClusterSpec:
    """The ClusterSpec stored in preset ``name`` (ValueError naming the known ones)."""
    from hzpsim.config import from_mapping
    from hzpsim.presets import load_preset

    data = load_preset("topologies", name, "preset")
    return from_mapping(ClusterSpec, data, f"topologies/{name}.yaml")


# --- topology ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkLevel:
    """Per-device, one-direction link seen by traffic crossing one level."""

    name: str
    bytes_per_s: float  # line rate, bytes/s
    efficiency: float  # achieved fraction of line rate
    latency_s: float  # α per ring step, seconds

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.bytes_per_s * self.efficiency


@dataclass(frozen=True)
class GroupSpan:
    """Where a group of ranks sits on the topology (all counts are of distinct units)."""

    num_ranks: int
    max_ranks_per_island: int
    max_ranks_per_node: int
    num_islands: int
    num_nodes: int
    num_leaves: int
    outermost_level: str  # one of LEVELS, or "device" for a single rank
    #: levels the group's traffic crosses, innermost first: "island" if some island holds ≥2
    #: ranks, "node" if some node holds ranks in ≥2 islands, "leaf" if some leaf holds ranks
    #: in ≥2 nodes, "spine" if ranks are in ≥2 leaves.
    levels: tuple[str, ...] = ()


class Topology:
    """Arithmetic view of a cluster plus a lazily built NetworkX graph.

    Ranks are numbered node-major, then island, then device inside the island, so
    ``node = rank // devices_per_node`` and ``island = rank // devices_per_island``.
    """

    LEVELS = LEVELS

    def __init__(self, spec: ResolvedCluster):
        """Pure: arithmetic on ``spec`` only (no files; build from a ``ClusterSpec`` with
        :func:`build_topology`)."""
        if not isinstance(spec, ResolvedCluster):
            raise TypeError(
                f"Topology needs a ResolvedCluster, got {type(spec).__name__} "
                "(use build_topology(spec) or spec.resolved())"
            )
        self.spec: ResolvedCluster = spec
        self.device: Device = spec.device_spec if spec.device_spec is not None else get_device(spec.device)
        if spec.device_memory_bytes != self.device.memory_bytes:  # e.g. a 96 GB H100 variant
            self.device = replace(self.device, memory_bytes=spec.device_memory_bytes)
        if spec.device_power_limit_w and spec.device_power_limit_w != self.device.tdp_w:  # e.g. 500 W H100s
            self.device = replace(self.device, power_limit_w=spec.device_power_limit_w)
        self.num_nodes: int = spec.num_nodes
        self.devices_per_node: int = spec.gpus_per_node
        self.islands_per_node: int = spec.islands_per_node
        self.devices_per_island: int = self.devices_per_node // self.islands_per_node
        self.nodes_per_leaf: int = spec.nodes_per_leaf
        self.num_devices: int = self.num_nodes * self.devices_per_node
        self.num_islands: int = self.num_nodes * self.islands_per_node
        self.num_leaves: int = -(-self.num_nodes // self.nodes_per_leaf)
        s = spec
        nic = s.inter_node_bytes_per_s_per_device
        self._links: dict[str, LinkLevel] = {
            "island": LinkLevel(
                "island", s.intra_node_bytes_per_s, s.intra_node_efficiency, s.intra_node_latency_s
            ),
            "node": LinkLevel(
                "node", s.inter_island_bytes_per_s, s.inter_island_efficiency, s.inter_island_latency_s
            ),
            "leaf": LinkLevel("leaf", nic, s.inter_node_efficiency, s.inter_node_latency_s),
            "spine": LinkLevel(
                "spine", nic / s.spine_oversubscription, s.inter_node_efficiency, s.inter_node_latency_s
            ),
        }
        self._span_cache: dict[tuple[int, ...] | range, GroupSpan] = {}
        # explicit stragglers per device: (compute slowdown, NIC bandwidth factor); entries
        # naming the same device multiply
        self.stragglers: dict[int, tuple[float, float]] = {}
        for straggler in spec.stragglers:
            if straggler.node is not None:
                first = straggler.node * self.devices_per_node
                devices: Sequence[int] = range(first, first + self.devices_per_node)
            else:
                assert straggler.device is not None
                devices = (straggler.device,)
            for d in devices:
                compute, link = self.stragglers.get(d, (1.0, 1.0))
                self.stragglers[d] = (compute * straggler.compute_slowdown, link * straggler.link_bandwidth_factor)
        self._link_factors = {d: link for d, (_, link) in sorted(self.stragglers.items()) if link != 1.0}

    def compute_slowdown(self, rank: int) -> float:
        """How many times as long device ``rank``'s kernels take (1 unless a straggler)."""
        return self.stragglers.get(rank, (1.0, 1.0))[0]

    def link_bandwidth_factor(self, ranks: Sequence[int] | range) -> float:
        """Fraction of its inter-node bandwidth a collective over ``ranks`` achieves: that of
        its slowest member's NIC (a ring or tree moves at the pace of its slowest link)."""
        if not self._link_factors:
            return 1.0
        return min([f for d, f in self._link_factors.items() if d in ranks], default=1.0)

    def straggler_lanes(self, placement: Any, collapse: Sequence[str] = ("tp", "cp")) -> dict[int, float]:
        """The simulated rank of every straggler's class and its compute slowdown.

        A symmetric simulation stands one rank for many devices, so a straggler (slow compute or
        a slow link) must be simulated explicitly. Its model-parallel group (the ``collapse``
        dimensions of ``placement``, TP × CP) synchronises every layer, so the whole group runs
        at the pace of its slowest member: the class is simulated by the group's first member
        (``collapse`` coordinates 0), slowed by the largest slowdown in the group (1 for a link
        straggler alone). That rank shares its data-parallel groups with the other simulated
        ranks, so their collectives wait for it. ``placement`` is a
        :class:`~hzpsim.hardware.placement.Placement`.
        """
        members: dict[int, list[float]] = {}
        for device in sorted(self.stragglers):
            coord = placement.coord(device)
            lane = placement.rank(**{**coord, **{d: 0 for d in collapse if d in coord}})
            members.setdefault(lane, []).append(self.compute_slowdown(device))
        size = math.prod(placement.size(d) for d in collapse if d in placement.names)
        # members of the group not listed run at 1
        return {lane: max(f) if len(f) == size else max(1.0, *f) for lane, f in members.items()}

    def __repr__(self) -> str:
        return (
            f"Topology({self.spec.preset}: {self.num_nodes} nodes × {self.devices_per_node} "
            f"{self.device.name} in {self.islands_per_node} island(s), {self.num_leaves} leaves)"
        )

    # -- links and coordinates ----------------------------------------------------------------

    def link(self, level: str) -> LinkLevel:
        try:
            return self._links[level]
        except KeyError:
            raise ValueError(f"unknown level {level!r} (known: {', '.join(LEVELS)})") from None

    def _check_rank(self, rank: int) -> int:
        r = int(rank)
        if not 0 <= r < self.num_devices:
            raise ValueError(f"rank {rank} out of range [0, {self.num_devices})")
        return r

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(leaf, node, island) global indices of ``rank``."""
        r = self._check_rank(rank)
        node = r // self.devices_per_node
        return (node // self.nodes_per_leaf, node, r // self.devices_per_island)

    def level_between(self, a: int, b: int) -> str:
        """Innermost level containing both ranks ("device" if a == b)."""
        la, na, ia = self.coords(a)
        lb, nb, ib = self.coords(b)
        if int(a) == int(b):
            return "device"
        if ia == ib:
            return "island"
        if na == nb:
            return "node"
        if la == lb:
            return "leaf"
        return "spine"

    # -- spans ----------------------------------------------------------------------------------

    def span(self, ranks: Sequence[int] | range | np.ndarray) -> GroupSpan:
        """Arithmetic placement summary of a group (no graph traversal; cached per group)."""
        key = ranks if isinstance(ranks, (tuple, range)) else tuple(int(r) for r in ranks)
        hit = self._span_cache.get(key)
        if hit is not None:
            return hit
        if isinstance(key, range):
            arr = np.arange(key.start, key.stop, key.step, dtype=np.int64)
        else:
            arr = np.asarray(key, dtype=np.int64)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError("ranks: need a non-empty 1-D sequence of ranks")
        if arr.min() < 0 or arr.max() >= self.num_devices:
            raise ValueError(
                f"ranks: out of range [0, {self.num_devices}) (min {arr.min()}, max {arr.max()})"
            )
        arr = np.sort(arr)
        if arr.size > 1 and np.any(arr[1:] == arr[:-1]):
            raise ValueError("ranks: duplicate ranks in group")
        islands = arr // self.devices_per_island  # sorted, so run-lengths give counts
        nodes = arr // self.devices_per_node
        isl_ids, isl_counts = _runs(islands)
        node_ids, node_counts = _runs(nodes)
        leaf_ids = np.unique(node_ids // self.nodes_per_leaf)
        n_isl, n_node, n_leaf = len(isl_ids), len(node_ids), len(leaf_ids)
        levels: list[str] = []
        if isl_counts.max() > 1:
            levels.append("island")
        if n_isl > n_node:
            levels.append("node")
        if n_node > n_leaf:
            levels.append("leaf")
        if n_leaf > 1:
            levels.append("spine")
        out = GroupSpan(
            num_ranks=int(arr.size),
            max_ranks_per_island=int(isl_counts.max()),
            max_ranks_per_node=int(node_counts.max()),
            num_islands=int(n_isl),
            num_nodes=int(n_node),
            num_leaves=int(n_leaf),
            outermost_level=levels[-1] if levels else "device",
            levels=tuple(levels),
        )
        if len(self._span_cache) >= 65536:
            self._span_cache.clear()
        self._span_cache[key] = out
        return out

    # -- graph ----------------------------------------------------------------------------------

    @cached_property
    def graph(self) -> nx.Graph:
        """Tree graph: device ─ island switch ─ node ─ leaf ─ spine.

        Nodes: ranks (int, ``level="device"``), ``("island", i)``, ``("node", n)``,
        ``("leaf", l)`` and ``("spine", 0)`` (only when there are ≥2 leaves); attribute
        ``level``. Edges carry ``level`` (the level traffic on it crosses), ``bytes_per_s``
        (aggregate line rate of the edge = ``per_device_bytes_per_s`` × ``num_devices`` below
        it), ``per_device_bytes_per_s`` (= ``link(level).bytes_per_s``), ``efficiency`` and
        ``latency_s`` (= ``link(level)``'s). Edges: device–island ("island"),
        island–node ("node"), node–leaf ("leaf"), leaf–spine ("spine").
        """
        import networkx as nx

        g = nx.Graph()
        n_dev, dpi, dpn = self.num_devices, self.devices_per_island, self.devices_per_node
        g.add_nodes_from(range(n_dev), level="device")
        g.add_nodes_from((("island", i) for i in range(self.num_islands)), level="island")
        g.add_nodes_from((("node", n) for n in range(self.num_nodes)), level="node")
        g.add_nodes_from((("leaf", lf) for lf in range(self.num_leaves)), level="leaf")
        if self.num_leaves > 1:
            g.add_node(("spine", 0), level="spine")

        def attrs(level: str, below: int) -> dict[str, float | int | str]:
            lk = self._links[level]
            return {
                "level": level,
                "bytes_per_s": lk.bytes_per_s * below,
                "per_device_bytes_per_s": lk.bytes_per_s,
                "num_devices": below,
                "efficiency": lk.efficiency,
                "latency_s": lk.latency_s,
            }

        a = attrs("island", 1)
        g.add_edges_from((r, ("island", r // dpi), a) for r in range(n_dev))
        a = attrs("node", dpi)
        ipn = self.islands_per_node
        g.add_edges_from((("island", i), ("node", i // ipn), a) for i in range(self.num_islands))
        npl = self.nodes_per_leaf
        a = attrs("leaf", dpn)
        g.add_edges_from((("node", n), ("leaf", n // npl), a) for n in range(self.num_nodes))
        if self.num_leaves > 1:
            for lf in range(self.num_leaves):
                nodes_here = min(npl, self.num_nodes - lf * npl)
                g.add_edge(("leaf", lf), ("spine", 0), **attrs("spine", nodes_here * dpn))
        return g


def _runs(sorted_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values and their counts of a sorted 1-D array (O(n), no hashing)."""
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    counts = np.diff(np.r_[starts, sorted_ids.size])
    return sorted_ids[starts], counts


def build_topology(spec: ClusterSpec | ResolvedCluster) -> Topology:
    """The Topology of ``spec``; a ``ClusterSpec`` is validated and resolved against its preset
    first (the one step here that reads files), a ``ResolvedCluster`` is used as is."""
    if isinstance(spec, ClusterSpec):
        from hzpsim.presets import listing_once

        with listing_once():
            spec.validate()
            spec = spec.resolved()
    return Topology(spec)


def with_overrides(spec: ClusterSpec, **overrides: Any) -> ClusterSpec:
    """Convenience: ``dataclasses.replace`` that validates the result."""
    out = replace(spec, **overrides)
    out.validate()
    return out
