"""Megatron-style ND parallelism: TP (+SP), PP (1F1B, interleaved), DP (+ZeRO), CP, EP.

Ranks are placed in Megatron's order (tp fastest, then cp, dp, pp), so TP groups sit inside a
node's NVLink domain. Each pipeline stage runs Megatron's schedule (``forward_backward_
pipelining_without_interleaving`` / ``..._with_interleaving``): warm-up forwards, steady
one-forward-one-backward, cool-down backwards. The pipeline bubble is not a formula: it
emerges from stages waiting for each other's activations and gradients, sent point to point.
Data parallelism over dp x cp uses the sharded hooks of the ZeRO family: ``zero_stage`` 0 =
all-reduce (DDP), 1 = distributed optimizer, 2 = + gradient sharding, 3 = FSDP + TP. Expert
parameters reduce over their own expert-data-parallel group (MoE parallel folding: ``ep`` may
span tp x cp x dp ranks). Run with::

    hzpsim run --set model=gpt3-175b --set cluster.preset=dgx-a100 --set cluster.num_nodes=128 \\
        --set strategy.name=nd --set strategy.tp=8 --set strategy.pp=16
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from hzpsim.hardware.topology import Topology
from hzpsim.model import Model
from hzpsim.model.ops import OpGraph
from hzpsim.model.training import Training
from hzpsim.strategies import (
    Bound,
    BoundCache,
    PublishedRun,
    _implementations,
    compose_label,
    training_as_simulated,
)
from hzpsim.strategies._lengths import attach_lengths
from hzpsim.strategies._model_parallel import UnitPass
from hzpsim.strategies._mp_units import MPUnit, merge_units, mp_units
from hzpsim.strategies._nd_layout import (  # noqa: F401 (the plugin's layout, re-exported)
    Layout,
    dims,
    layout,
    paired,
    pipeline_actions,
    schedule,
    sharding_sizes,
    stage_layers,
)
from hzpsim.strategies._sharded import Emitter, Ids, Schedule, Use, grad_norm


@dataclass(frozen=True)
class Config:
    tp: int = 1  # tensor-parallel size (inside a node)
    pp: int = 1  # pipeline stages
    dp: int | None = None  # data-parallel size; None = devices / (tp x pp x cp)
    cp: int = 1  # context-parallel size (sequence split, ring exchange of K/V)
    ep: int = 1  # expert-parallel size (MoE); may fold over tp x cp x dp ranks
    etp: int | None = None  # expert tensor-parallel size; None = the implementation's (megatron-core: tp; else 1)
    vpp: int = 1  # interleaved model chunks per pipeline rank (virtual pipeline)
    sequence_parallel: bool = False  # Megatron's --sequence-parallel
    zero_stage: Literal[0, 1, 2, 3] | None = None  # sharding over the data-parallel group (1 = distributed
    # optimizer); None = the implementation's default (megatron-bridge, NeMo's recipes: 1; else 0)
    tp_comm_overlap: float = 0.0  # fraction of TP communication hidden behind compute (0 = Megatron default)
    tp_comm_overlap_backward: bool = True  # the backward's TP transfers overlap too (TE's userbuffers);
    # false: forward only, as PyTorch's async TP (forward +29 %, end to end +8 %)
    moe_imbalance: float = 1.0  # busiest expert rank's routed tokens over the mean (>= 1)
    moe_capacity_factor: float | None = None  # tokens an expert accepts over the mean; None = dropless
    moe_pad_to_capacity: bool = False  # pad every expert's input to its capacity (--moe-pad-expert-input-to-capacity)
    moe_dispatcher: Literal["", "alltoall", "allgather", "deepep"] = ""  # "" = the implementation's
    moe_ep_overlap: bool = False  # --overlap-moe-expert-parallel-comm: dispatch / combine behind another micro-batch
    moe_grouped_gemm: bool | None = None  # local experts as one grouped GEMM per linear; None = the implementation's
    moe_permute_fusion: bool | None = None  # fused token permutation (--moe-permute-fusion); None = the implementation's
    first_stage_layers: int | None = None  # layers on the first pipeline stage (Megatron's uneven split)
    last_stage_layers: int | None = None  # layers on the last pipeline stage
    overlap_grad_reduce: bool = True  # bucketed gradient reduction overlaps the last backward
    overlap_param_gather: bool = True  # distributed optimizer's all-gather overlaps the next forward
    prefetch_depth: int = 1  # zero_stage 3: all-gathers in flight ahead of use
    implementation: str = "megatron-core"  # how the framework runs it (strategies/_implementations.py)

    def validate(self) -> None:
        _implementations.get(self.implementation)
        dims(self)  # the degrees and the schedule check their own fields
        schedule(self)

    @property
    def expert_tp(self) -> int:
        """``etp`` as simulated: the implementation's default when unset (Megatron-Core's is the
        tensor-parallel size, ``Implementation.expert_tp_is_tp``; the others' 1)."""
        if self.etp is not None:
            return self.etp
        return _implementations.get(self.implementation).expert_tp(self.tp)

    @property
    def sharding_stage(self) -> int:
        """``zero_stage`` as simulated: the implementation's default when unset."""
        if self.zero_stage is not None:
            return self.zero_stage
        return 1 if _implementations.get(self.implementation).distributed_optimizer else 0


def check(config: Config, model: Model, training: Training, topology: Topology) -> None:
    layout(config, model, training, topology)


def resolve(config: Config, topology: Topology) -> Config:
    """The config as simulated: the data-parallel degree filled in (devices / (tp · pp · cp)
    when unset), so ``strategy_resolved`` names every degree."""
    if config.dp is not None or topology.num_devices % (config.tp * config.pp * config.cp):
        return config
    return replace(config, dp=topology.num_devices // (config.tp * config.pp * config.cp))


# ---------------------------------------------------------------------------- hzpsim search

SEARCH_RANK = 10
"""Where the search reports ND among the strategies (lowest first)."""


def layouts(model: Model, training: Training, topology: Topology, space: Any) -> list[dict[str, Any]]:
    """The search's ND layouts: every tp x pp x vpp x cp x ep x ZeRO stage x sequence
    parallelism of ``space`` (interleaving only with pp > 1, sequence parallelism only with tp > 1),
    and for an MoE model every experts' tensor-parallel size ``etp`` of ``space`` (written out:
    the implementation's own default may differ)."""
    out = []
    etps = tuple(getattr(space, "etp", (1,))) if model.moe is not None else (None,)
    for tp in space.tp:
        for pp in space.pp:
            for vpp in space.vpp:
                if vpp > 1 and pp == 1:
                    continue
                for cp in space.cp:
                    for ep in space.ep:
                        for stage in space.zero_stage:
                            if stage > 3:
                                continue
                            for sp in space.sequence_parallel:
                                if sp and tp == 1:
                                    continue
                                for etp in etps:
                                    fields = {"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "ep": ep,
                                              "zero_stage": stage, "sequence_parallel": sp}
                                    if etp is not None:
                                        fields["etp"] = etp
                                    out.append(fields)
    return out


def search_check(config: Config, model: Model, training: Training, topology: Topology) -> None:
    """What the search skips although ``check`` lets it through: a model chunk without a layer
    (an edge chunk holding only the embedding or the head)."""
    layers = stage_layers(model.num_layers, config.pp, config.vpp, config.first_stage_layers,
                          config.last_stage_layers)
    if min(layers) == 0:
        raise ValueError(f"vpp: {len(layers)} virtual stages for {model.num_layers} layers leave a stage empty")


def quick_bound(config: Config, model: Model, training: Training, topology: Topology, cache: BoundCache) -> Bound:
    """:func:`bound`'s memory, and a looser step time that needs no data-parallel collective:
    each stage's work, optimizer and gradient norm (``_nd_bound``, ``quick``). The search
    bounds every candidate with it and computes :func:`bound` only for those that come up."""
    from hzpsim.strategies import _nd_bound

    return _nd_bound.nd_bound(cache, config, training, quick=True)


def bound(config: Config, model: Model, training: Training, topology: Topology, cache: BoundCache) -> Bound:
    """Lower bounds on this layout's step time and peak memory (``_nd_bound``): the pipeline's
    fill, each stage's work and the drain, at least durations."""
    from hzpsim.strategies import _nd_bound  # it reads this module's layout and schedule

    return _nd_bound.nd_bound(cache, config, training)


def refine_bound(config: Config, model: Model, training: Training, topology: Topology,
                 cache: BoundCache) -> Bound:
    """:func:`bound` with the whole pipeline replayed, every stage's schedule against the
    others' (for the few candidates the search is about to simulate)."""
    from hzpsim.strategies import _nd_bound

    return _nd_bound.nd_bound(cache, config, training, refine=True)


def _simulated_lanes(lay: Layout, topology: Topology, expand: bool,
                     ) -> tuple[list[list[int]], dict[int, int], dict[int, float]]:
    """Simulated ranks of each pipeline stage, the devices each stands for, and the compute
    slowdown of the slow ones. Every device under ``expand``; else one pipeline (data-parallel
    index 0) for everyone, plus the whole pipeline of each explicit straggler's class
    (:meth:`~hzpsim.hardware.topology.Topology.straggler_lanes`: a slow stage slows its own
    pipeline through the point-to-point sends, and the others at the data-parallel reduction)."""
    d, placement, n = lay.dims, lay.placement, topology.num_devices
    if expand:
        slow = {r: f for r in topology.stragglers if (f := topology.compute_slowdown(r)) != 1.0}
        stage_lanes = [sorted(r for r in range(n) if placement.coord(r)["pp"] == s) for s in range(d.pp)]
        return stage_lanes, {r: 1 for lanes in stage_lanes for r in lanes}, slow
    slow = topology.straggler_lanes(placement)
    pipelines = sorted({placement.coord(r)["dp"] for r in slow})
    rep = next((k for k in range(lay.dp) if k not in pipelines), None)
    stride = d.tp * d.cp
    weights: dict[int, int] = {}
    stage_lanes = []
    for s in range(d.pp):
        lanes = [placement.rank(tp=0, cp=0, dp=k, pp=s) for k in sorted({*pipelines, *([] if rep is None else [rep])})]
        weights.update((r, stride) for r in lanes)
        if rep is not None:
            weights[placement.rank(tp=0, cp=0, dp=rep, pp=s)] = n // d.pp - stride * len(pipelines)
        stage_lanes.append(lanes)
    return stage_lanes, weights, slow


def build(config: Config, model: Model, training: Training, topology: Topology, expand: bool = False) -> OpGraph:
    training = training_as_simulated(config, training, topology.device)
    lay = layout(config, model, training, topology)
    d, n, m = lay.dims, topology.num_devices, lay.num_micro_batches
    stage_lanes, weights, slow = _simulated_lanes(lay, topology, expand)
    factors = [[r, f] for r, f in sorted(slow.items()) if f != 1.0]
    graph = OpGraph(n, weights, training.precision,
                    meta={"pp": d.pp, "vpp": d.vpp, "tp": d.tp, "dp": lay.dp, "cp": d.cp, "ep": d.ep,
                          "num_micro_batches": m, "layers_per_virtual_stage": list(lay.layers_per_virtual_stage),
                          **({"compute_slowdown": factors} if factors else {})})
    plan = schedule(config)
    units = mp_units(model, training, d.placed(topology), plan.implementation)
    # units of each virtual stage: embedding on the first, head on the last
    bounds: list[list[int]] = []
    start = 1
    for count in lay.layers_per_virtual_stage:
        bounds.append(list(range(start, start + count)))
        start += count
    bounds[0].insert(0, 0)
    bounds[-1].append(len(units) - 1)
    plan = replace(plan, implementation=plan.implementation.on_device(topology.device))  # measured host costs
    stages = [_Stage(graph=graph, lanes=lanes, rank=s, lay=lay, bounds=bounds, units=units, training=training,
                     schedule=plan, zero_stage=config.sharding_stage, seq_len=model.seq_len)
              for s, lanes in enumerate(stage_lanes)]
    sends: dict[tuple[str, int, int], Ids] = {}  # (direction, virtual stage, micro-batch) -> send op ids
    for step in range(training.num_steps):
        for stage in stages:
            stage.start_step(step)
        pending = True
        while pending:
            progressed = False
            pending = False
            for stage in stages:
                progressed |= stage.emit_ready(step, sends)
                pending |= not stage.done()
            assert progressed or not pending, "pipeline schedule deadlocked while emitting"
        reduced: list[Ids | None] = []
        for stage in stages:
            reduced += stage.unit_pass.reduce(step, stage.last)
        everyone = Emitter(graph, [r for lanes in stage_lanes for r in lanes], stages[0].emit.implementation)
        norm = grad_norm(everyone, range(n), reduced, step)
        for stage in stages:
            stage.unit_pass.optimize(step, norm)
    return graph


class _Stage:
    """One pipeline rank's program (for its simulated lanes): Megatron's schedule of forward
    and backward passes over its model chunks, the point-to-point sends between chunks."""

    def __init__(self, *, graph: OpGraph, lanes: list[int], rank: int, lay: Layout, bounds: list[list[int]],
                 units: list[MPUnit], training: Training, schedule: Schedule, zero_stage: int, seq_len: int) -> None:
        d = lay.dims
        self.graph, self.lanes, self.rank, self.lay = graph, lanes, rank, lay
        self.p, self.v, self.m = d.pp, d.vpp, lay.num_micro_batches
        self.units = units
        self.chunks = [bounds[c * self.p + rank] for c in range(self.v)]  # unit indices per model chunk
        self.local = [u for chunk in self.chunks for u in chunk]
        self.index = {u: i for i, u in enumerate(self.local)}
        self.emit = Emitter(graph, lanes, schedule.implementation)
        attach_lengths(self.emit, training, seq_len, {lane: lay.placement.coord(lane)["dp"] for lane in lanes}, lay.dp,
                       d.tp * d.cp, self.m)
        overlap = d.moe_ep_overlap
        self.actions = pipeline_actions(self.p, self.v, self.m, rank, overlap)
        self.paired = paired(self.p, self.v, self.m, rank, overlap)
        uses: list[Use] = []
        for step in range(training.num_steps):
            for kind, c, mb in self.actions:
                chunk = self.chunks[c]
                ordered = chunk if kind == "F" else list(reversed(chunk))
                uses += [(step, mb, "fwd" if kind == "F" else "bwd", self.index[u]) for u in ordered]
        placement = lay.placement
        self.unit_pass = UnitPass(self.emit, d, [units[u] for u in self.local], training, placement, lay.experts,
                                  schedule, uses, lambda size: sharding_sizes(zero_stage, size), self.m)

        def peers(pp: int) -> dict[int, int]:
            return {r: placement.rank(**{**placement.coord(r), "pp": pp}) for r in lanes}

        # where each lane sends: "F" to the next pipeline rank, "B" to the previous; interleaved,
        # the next model chunk starts again on the first rank (and the previous one ends on the last)
        self.peers = {"F": peers(rank + 1 if rank < self.p - 1 else 0), "B": peers(rank - 1 if rank > 0 else self.p - 1)}
        self.links: dict[str, list[tuple[int, int, str]]] = {}  # direction -> (lane, peer, p2p group) once used
        self.position = 0
        self.last: Ids = {}
        # Where no per-unit event matters (no gathers, no per-micro-batch reductions, no CP/EP
        # exchange), a chunk's units are emitted as one merged unit: same work and bytes, fewer
        # events. The first forward and the last backward of a step stay per unit, since the
        # parameter all-gather and the gradient reduction overlap them unit by unit.
        self.mergeable = [
            zero_stage <= 1 and len(chunk) > 1
            and not any(units[u].cp_bytes or units[u].ep_bytes or units[u].is_moe for u in chunk)
            # a unit whose backward holds temporaries of its own (the replicated embedding
            # gradient) stays one: merged, they would meet every unit's activations
            and not any(units[u].backward_temps and not units[u].loss_split for u in chunk)
            for chunk in self.chunks
        ]
        self.merged = [merge_units([units[u] for u in chunk]) if ok else None
                       for chunk, ok in zip(self.chunks, self.mergeable)]

    def start_step(self, step: int) -> None:
        self.position = 0

    def done(self) -> bool:
        return self.position >= len(self.actions)

    def emit_ready(self, step: int, sends: dict[tuple[str, int, int], Ids]) -> bool:
        progressed = False
        while not self.done():
            kind, c, mb = self.actions[self.position]
            self.unit_pass.unit_emit.ep_overlap = self.paired[self.position]
            vs = c * self.p + self.rank
            last_vs = self.p * self.v - 1
            if kind == "F":
                key = ("F", vs - 1, mb)
                if vs > 0 and key not in sends:
                    return progressed
                incoming = sends.pop(key, None) if vs > 0 else None
                self._forward(step, c, mb, vs, incoming, sends)
            else:
                key = ("B", vs + 1, mb)
                if vs < last_vs and key not in sends:
                    return progressed
                incoming = sends.pop(key, None) if vs < last_vs else None
                self._backward(step, c, mb, vs, incoming, sends)
            self.position += 1
            progressed = True
        return progressed

    def _send(self, direction: str, vs: int, mb: int, step: int, size: float, deps: Ids,
              sends: dict[tuple[str, int, int], Ids]) -> None:
        """Point-to-point send of an activation (or its gradient) to the neighbouring stage."""
        forward = direction == "F"
        links = self.links.get(direction)
        if links is None:  # the first send this way: its groups join the graph
            links = self.links[direction] = [(lane, peer, self.graph.add_group(f"p2p.{lane}.{peer}", (lane, peer)))
                                             for lane, peer in self.peers[direction].items()]
        # Megatron 2021 (implementation sync_after_p2p): the send is one host call, after which
        # the host synchronises with the device (p2p_communication.py::_communicate)
        synced = self.emit.implementation.sync_after_p2p
        launch = self.emit.host(f"call.send.{direction}", self.emit.implementation.call_host_s(1, 2), step) \
            if synced else None
        ids: Ids = {}
        sent: Ids = {}
        name, stream = f"send.{direction}.vs{vs}.mb{mb}", f"pp_{'fwd' if forward else 'bwd'}"
        for lane, peer, group in links:
            op = self.graph.collective("send_recv", group, [lane], size, name, "pp", stream,
                                       [deps[lane], launch[lane] if launch else None], step=step)
            ids[peer] = sent[lane] = op
        sends[(direction, vs, mb)] = ids
        if synced:
            self.emit.host(f"sync.send.{direction}", 0.0, step, sync=[sent, self.emit.last_compute])

    def _received(self, incoming: Ids | None, step: int) -> None:
        """Megatron 2021 synchronises after each receive too: the host launches the pass that
        uses it only once it arrived (p2p_communication.py::_communicate)."""
        if incoming and self.emit.implementation.sync_after_p2p:
            self.emit.host("sync.recv", 0.0, step, sync=[incoming])

    def _forward(self, step: int, c: int, mb: int, vs: int, incoming: Ids | None, sends) -> None:
        self._received(incoming, step)
        last: Ids | None = incoming
        merged = self.merged[c]
        if merged is not None and mb > 0:
            last = self.unit_pass.forward_merged(merged, step, mb, last)
        else:
            for u in self.chunks[c]:
                last = self.unit_pass.forward(self.units[u], self.index[u], step, mb, last)
        assert last is not None
        self._forwarded(c, mb, vs, step, last, sends)

    def _forwarded(self, c: int, mb: int, vs: int, step: int, last: Ids, sends) -> None:
        self.last = last
        if vs < self.p * self.v - 1:
            self._send("F", vs, mb, step, self.units[self.chunks[c][-1]].p2p_bytes, last, sends)

    def _backward(self, step: int, c: int, mb: int, vs: int, incoming: Ids | None, sends) -> None:
        self._received(incoming, step)
        last: Ids | None = incoming
        merged = self.merged[c]
        if merged is not None and mb < self.m - 1:
            last = self.unit_pass.backward_merged(merged, step, mb, last)
        else:
            for u in reversed(self.chunks[c]):
                last = self.unit_pass.backward(self.units[u], self.index[u], step, mb, last)
        assert last is not None
        self._backwarded(c, mb, vs, step, last, sends)

    def _backwarded(self, c: int, mb: int, vs: int, step: int, last: Ids, sends) -> None:
        self.last = last
        if vs > 0:
            self._send("B", vs, mb, step, self.units[self.chunks[c][0]].p2p_bytes, last, sends)


_DEFAULT_IMPLEMENTATION = Config().implementation


def label(resolved: dict) -> str:
    """A short name for tables."""
    short = {"zero_stage": "zero", "tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep", "etp": "etp", "vpp": "vpp"}
    etp, implementation = resolved.get("etp"), resolved.get("implementation") or _DEFAULT_IMPLEMENTATION
    if etp is not None and isinstance(implementation, str) and implementation in _implementations.IMPLEMENTATIONS:
        default = _implementations.get(implementation).expert_tp(resolved.get("tp", 1))
        if etp == default or (resolved.get("ep") or 1) == 1:  # named only where it is not what the profile gives
            short.pop("etp")
    return compose_label(resolved, short)


# ------------------------------------------------------------------ what the rest of hzpsim asks (strategies/__init__.py)

ORDER = 30
COLOR = "#4c72b0"
DEFAULT_RUNS = ({"tp": 8, "pp": 4, "sequence_parallel": True, "zero_stage": 1},)
STAND_INS = tuple({"pp": p} for p in (2, 4, 8, 16, 32, 64))
PUBLISHED_FAMILIES = {"nd": ("tp", "pp")}
FRAMEWORK_IMPLEMENTATIONS = {"megatron": "megatron-2021"}  # Megatron-LM before Megatron-Core
VALIDATION_REGIMES = {"": "Megatron ND"}


def from_published(run: PublishedRun) -> tuple[dict, list[str]]:
    """A published ND run (or FSDP composed with model parallelism, from zero)."""
    notes: list[str] = []
    zs = run.zero_stage
    if zs is None:  # the implementation profile's default (Implementation.distributed_optimizer)
        notes.append("zero_stage blank -> the implementation's default")
    vpp = run.column("vpp") or 1
    return {
        "name": "nd",
        "tp": run.tp,
        "pp": run.pp,
        "dp": run.dp,
        "cp": run.cp,
        "ep": run.ep,
        "vpp": vpp,
        "zero_stage": zs,
        "sequence_parallel": run.sequence_parallel,
    }, notes
