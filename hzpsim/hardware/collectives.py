"""Cost of one collective on its group's placement: NCCL's own model, level by level.

The rule, stated once (docs/design.md repeats it):

1. **Algorithm.** All-gather and reduce-scatter use a ring (NCCL's only algorithm for them on
   NVLink + InfiniBand clusters without NVLS/SHARP). All-reduce uses a ring or, when the group
   spans several nodes, NCCL's double binary tree, whichever NCCL's tuner estimates faster.
   All-to-all and send/recv are point-to-point.
2. **Protocol.** LL, LL128 or Simple, again the one NCCL's tuner estimates fastest for the size.
3. **Latency** follows ``src/graph/tuning.cc`` (docs/hardware-constants.md §3): a base latency
   per algorithm and protocol plus a per-step hardware latency, where ring steps that cross a
   node boundary pay the network latency and the rest the NVLink-class latency. The topology's
   ``link(level).latency_s`` is the ring/Simple step latency of that level; the other
   algorithms and protocols scale it by NCCL's own ratios.
4. **Bandwidth.** Each rank's bytes are split by the topology level they cross, for a ring laid
   out in rank order with NCCL's rail-striped channels: of the bytes a rank sends, the fraction
   1/g_island leaves its island, 1/g_node leaves its node (g = the group's ranks per island /
   node). Bytes on a level move at that level's achieved per-device bandwidth, derated by the
   protocol (LL 1/4, LL128 0.92, tree 0.92 x 0.85, as in NCCL's tuner); levels work in parallel
   and share links with every other transfer in flight (``network.py``).

A device measured by ``hzpsim calibrate machine`` (``Device.collective_costs``: a CPU with
gloo) replaces 1-3 with the backend's measured cost of each kind and group size: gloo's
algorithms differ by kind (``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``: its
``reduce_scatter_tensor`` is an all-reduce of the whole buffer followed by a copy of this
rank's chunk, ``all_gather_into_tensor`` a ring of ``gloo::allgather``, ``all_reduce`` gloo's
ring or bcube, ``all_to_all`` pairwise exchanges, send/recv one TCP message), and their copies
and TCP loopback run on the same cores as every rank's compute, so one latency + bandwidth pair
cannot fit them all. Without a CPU pool the table is the back-to-back sweep, which sees every
member inside the call; inside a step the others compute, and every hop (:func:`gloo_hops`)
waits for its receiving thread to get a core back (``Device.collective_hop_delay_s``,
measured by the same calibration: a woken thread runs once the running one used its slice,
``kernel/sched/fair.c``'s ``sysctl_sched_base_slice``, 0.75 ms x (1 + log2 of the CPUs) by
default, 1.5 ms on 2 CPUs). With a CPU pool the table already is each call's wall time inside
a step (the calibration's in-step loop, to the last member's release) and no hop delay is
added. The measured latency is paid first, then the bytes move at the level's bandwidth with
the demand scaled to the measured seconds per byte (the transfer still shares the link with
the rank's other transfers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from hzpsim.hardware.topology import INTER_NODE_LEVELS, GroupSpan, Topology

# NCCL src/graph/tuning.cc (commit b6475625, NCCL 2.19/2.20 era), which states them in µs:
# baseLat[algo][proto] and hwLat[link][algo][proto], protocols in order LL, LL128, Simple.
PROTOCOLS = ("LL", "LL128", "Simple")
_US = 1e-6
_BASE_LATENCY_S = {"ring": (6.6 * _US, 14.0 * _US, 8.4 * _US), "tree": (6.8 * _US, 14.0 * _US, 0.0)}
_HW_LATENCY_S = {
    ("nvlink", "ring"): (0.6 * _US, 1.9 * _US, 3.4 * _US),
    ("nvlink", "tree"): (0.6 * _US, 1.25 * _US, 28.0 * _US),
    ("net", "ring"): (2.7 * _US, 4.0 * _US, 14.0 * _US),
    ("net", "tree"): (5.0 * _US, 8.5 * _US, 28.0 * _US),
}
# NCCL's bandwidth derating per protocol (ring LL x1/4, LL128 x0.92; tree x0.92 then x0.85).
_RING_PROTOCOL_BW = (0.25, 0.92, 1.0)
_TREE_BW = 0.92 * 0.85
_TREE_PROTOCOL_BW = (1 / 3.8, 120 / 128, 1.0)


@dataclass(frozen=True)
class CollectivePlan:
    """How one rank experiences a collective: a fixed latency, then bandwidth-bound bytes."""

    algorithm: str
    protocol: str
    latency_s: float
    bytes_by_level: dict[str, float]  # bytes this rank sends across each level (reported)
    demand_by_level: dict[str, float]  # bytes / protocol efficiency: what occupies the link
    isolated_time_s: float  # latency + bandwidth time with no other traffic
    # CPU seconds each member's backend threads spend during the call (Device.collective_cpu_costs):
    # on a device with a CPU pool (Device.node_cpu_cores) the engine runs the call at the share
    # of a core cpu_s / isolated_time_s; 0 elsewhere
    cpu_s: float = 0.0

    def stretched(self, factor: float) -> CollectivePlan:
        """The same bytes, taking ``factor`` times as long (waiting for the slowest transfer;
        the CPU work stays what it is)."""
        return CollectivePlan(
            self.algorithm, self.protocol, self.latency_s * factor, dict(self.bytes_by_level),
            {k: v * factor for k, v in self.demand_by_level.items()}, self.isolated_time_s * factor, self.cpu_s,
        )

    def repeated(self, count: int) -> CollectivePlan:
        """The same collective issued ``count`` times back to back."""
        return CollectivePlan(
            self.algorithm, self.protocol, self.latency_s * count,
            {k: v * count for k, v in self.bytes_by_level.items()},
            {k: v * count for k, v in self.demand_by_level.items()},
            self.isolated_time_s * count, self.cpu_s * count,
        )


def _link_class(level: str) -> str:
    return "net" if level in INTER_NODE_LEVELS else "nvlink"


def _ring_split(volume: float, span: GroupSpan) -> dict[str, float]:
    """Split a ring's per-rank bytes by the level each hop crosses."""
    beyond_island = 1.0 / span.max_ranks_per_island if span.num_islands > 1 else 0.0
    beyond_node = 1.0 / span.max_ranks_per_node if span.num_nodes > 1 else 0.0
    beyond_leaf = span.num_leaves / span.num_ranks if span.num_leaves > 1 else 0.0
    split = {
        "island": volume * (1.0 - beyond_island),
        "node": volume * (beyond_island - beyond_node),
        "leaf": volume * beyond_node,
    }
    if beyond_leaf:
        split["spine"] = volume * beyond_leaf
    return {k: v for k, v in split.items() if v > 0}


def _outermost(span: GroupSpan) -> str:
    if span.num_leaves > 1:
        return "spine"
    if span.num_nodes > 1:
        return "leaf"
    if span.num_islands > 1:
        return "node"
    return "island"


def gloo_hops(kind: str, n: int) -> int:
    """Messages a rank of a gloo collective over ``n`` ranks waits for one after the other: its
    ring all-gather passes n-1 chunks (``gloo/allgather_ring.h``), its ring all-reduce reduces
    and then gathers (2(n-1), ``gloo/allreduce.cc``), ProcessGroupGloo runs a reduce-scatter as
    that all-reduce (the profiler shows ``gloo:all_reduce`` for FSDP2's reduce-scatters), an
    all-to-all receives from each of the n-1 peers, a send/recv is one message. Each hop is a
    wake-up of the receiving thread: inside a training step it waits for a core held by
    ranks that compute (``Device.collective_hop_delay_s``)."""
    if kind == "send_recv":
        return 1
    if n <= 1:
        return 0
    return 2 * (n - 1) if kind in ("all_reduce", "reduce_scatter") else n - 1


class CollectiveModel:
    """Plans collectives on one topology; plans are cached by (kind, size, group shape)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._plan = lru_cache(maxsize=None)(self._plan_uncached)

    def bandwidth(self, level: str) -> float:
        return self.topology.link(level).achieved_bytes_per_s

    def plan(self, kind: str, size_bytes: float, span: GroupSpan, pair_level: str | None = None) -> CollectivePlan:
        return self._plan(kind, float(size_bytes), span, pair_level)

    def on_slow_links(self, plan: CollectivePlan, factor: float) -> CollectivePlan:
        """``plan`` when the group's slowest NIC moves ``factor`` of its bandwidth (an explicit
        straggler link, ``cluster.stragglers``): a ring or tree is paced by its slowest link, so
        the bytes crossing nodes take 1/``factor`` as long. NCCL's tuner does not know the link
        is slow, so the algorithm and protocol stay those of the nominal plan."""
        demand = {lvl: b / factor if lvl in INTER_NODE_LEVELS else b for lvl, b in plan.demand_by_level.items()}
        bw_time = max((b / self.bandwidth(lvl) for lvl, b in demand.items()), default=0.0)
        return CollectivePlan(plan.algorithm, plan.protocol, plan.latency_s, dict(plan.bytes_by_level), demand,
                              plan.latency_s + bw_time, plan.cpu_s)

    # ------------------------------------------------------------------ internals

    def _step_latency_s(self, algo: str, proto: int, level: str) -> float:
        """NCCL's hwLat for this link class, algorithm and protocol, scaled so that a ring /
        Simple step costs the topology's per-step latency of the level (the presets use NCCL's
        own 3.4 us NVLink and 14 us network values, which reproduces NCCL's table exactly)."""
        table = _HW_LATENCY_S[(_link_class(level), algo)][proto]
        ring_simple = _HW_LATENCY_S[(_link_class(level), "ring")][2]
        return table / ring_simple * self.topology.link(level).latency_s

    def _ring_latency_s(self, span: GroupSpan, proto: int, passes: int) -> float:
        n = span.num_ranks
        steps = passes * (n - 1)
        inter_node = passes * (span.num_nodes - 1)
        inter_island = passes * (span.num_islands - span.num_nodes)
        intra = steps - inter_node - inter_island
        outer = "spine" if span.num_leaves > 1 else "leaf"
        return (
            _BASE_LATENCY_S["ring"][proto]
            + intra * self._step_latency_s("ring", proto, "island")
            + inter_island * self._step_latency_s("ring", proto, "node")
            + inter_node * self._step_latency_s("ring", proto, outer)
        )

    def _tree_latency_s(self, span: GroupSpan, proto: int) -> float:
        per_node = span.max_ranks_per_node
        outer = "spine" if span.num_leaves > 1 else "leaf"
        return _BASE_LATENCY_S["tree"][proto] + 2 * (
            (per_node - 1) * self._step_latency_s("tree", proto, "island")
            + math.log2(span.num_nodes) * self._step_latency_s("tree", proto, outer)
        )

    def _best(self, algorithm: str, options: list[tuple[int, float, dict[str, float], float]],
              bytes_by_level: dict[str, float]) -> CollectivePlan:
        best = None
        for proto, latency_s, demands, factor in options:
            scaled = {lvl: b / factor for lvl, b in demands.items()}
            bw_time = max((b / self.bandwidth(lvl) for lvl, b in scaled.items()), default=0.0)
            total = latency_s + bw_time
            if best is None or total < best.isolated_time_s:
                best = CollectivePlan(algorithm, PROTOCOLS[proto], latency_s, dict(bytes_by_level), scaled, total)
        assert best is not None
        return best

    def _measured(self, table: tuple[tuple[str, int, float, float], ...], kind: str,
                  group_size: int) -> tuple[float, float] | None:
        """(seconds, seconds per byte) that a calibration ``table`` of the device holds for
        ``kind`` at the nearest measured group size (log distance), or None."""
        rows = [r for r in table if r[0] == kind]
        if not rows:
            return None
        row = min(rows, key=lambda r: (abs(math.log(r[1] / max(group_size, 1))), -r[1]))
        return row[2], row[3]

    def _plan_uncached(self, kind: str, size: float, span: GroupSpan, pair_level: str | None) -> CollectivePlan:
        plan = self._nccl_plan(kind, size, span, pair_level)
        device = self.topology.device
        group_size = 2 if kind == "send_recv" else span.num_ranks
        measured = self._measured(device.collective_costs, kind, group_size)
        if measured is None or not plan.bytes_by_level:
            return plan
        latency_s, per_byte_s = measured
        cpu_s = 0.0
        if device.node_cpu_cores is None:  # the hop delay stands in for the cores' sharing
            latency_s += gloo_hops(kind, span.num_ranks) * (device.collective_hop_delay_s or 0.0)
        else:
            cpu = self._measured(device.collective_cpu_costs, kind, group_size)
            cpu_s = cpu[0] + cpu[1] * size if cpu else 0.0
        level = (pair_level or "island") if kind == "send_recv" else _outermost(span)
        seconds = per_byte_s * size
        return CollectivePlan("measured", "backend", latency_s, dict(plan.bytes_by_level),
                              {level: seconds * self.bandwidth(level)} if seconds > 0 else {},
                              latency_s + seconds, cpu_s)

    def _nccl_plan(self, kind: str, size: float, span: GroupSpan, pair_level: str | None) -> CollectivePlan:
        n = span.num_ranks
        if kind == "send_recv":
            level = pair_level or "island"
            latency_s = _BASE_LATENCY_S["ring"][2] + self._step_latency_s("ring", 2, level)
            demands = {level: size}
            return self._best("p2p", [(2, latency_s, demands, 1.0)], demands)
        if n <= 1 or size <= 0:
            return CollectivePlan("none", "none", 0.0, {}, {}, 0.0)
        if kind == "all_to_all":
            per_peer = size / n
            demands = {
                "island": per_peer * (span.max_ranks_per_island - 1),
                "node": per_peer * (span.max_ranks_per_node - span.max_ranks_per_island),
                "leaf": per_peer * (n - span.max_ranks_per_node),
            }
            if span.num_leaves > 1:
                demands["spine"] = per_peer * (n - n / span.num_leaves)
            demands = {k: v for k, v in demands.items() if v > 0}
            latency_s = _BASE_LATENCY_S["ring"][2] + self._step_latency_s("ring", 2, _outermost(span))
            return self._best("pairwise", [(2, latency_s, demands, 1.0)], demands)

        passes = 2 if kind == "all_reduce" else 1
        volume = passes * (n - 1) / n * size
        ring = _ring_split(volume, span)
        ring_plan = self._best(
            "ring",
            [(p, self._ring_latency_s(span, p, passes), ring, _RING_PROTOCOL_BW[p]) for p in range(3)],
            ring,
        )
        if kind != "all_reduce" or span.num_nodes == 1:
            return ring_plan
        # NCCL tree all-reduce: chain inside the node, double binary tree across nodes.
        per_node = span.max_ranks_per_node
        tree = {"leaf": 2 * size / per_node}
        if per_node > 1:
            tree["island"] = 2 * size
        if span.num_leaves > 1:
            tree["spine"] = 2 * size / per_node
        tree_plan = self._best(
            "tree",
            [(p, self._tree_latency_s(span, p), tree, _TREE_BW * _TREE_PROTOCOL_BW[p]) for p in range(3)],
            tree,
        )
        return tree_plan if tree_plan.isolated_time_s < ring_plan.isolated_time_s else ring_plan
