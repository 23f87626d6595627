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

from dataclasses import dataclass
from typing import Literal

from hzpsim.cluster.placement import Placement, expert_placement
from hzpsim.cluster.topology import Topology
from hzpsim.config import ScenarioError
from hzpsim.model import Model
from hzpsim.ops import OpGraph, Ranks
from hzpsim.strategies import compose_label
from hzpsim.strategies._model_parallel import Degrees, MPUnit, UnitEmitter, merge_units, mp_units
from hzpsim.strategies._sharded import (
    Emitter,
    Ids,
    NestedSharding,
    Schedule,
    ShardedParams,
    Use,
    grad_norm,
)
from hzpsim.training import Training, check_micro_batches


@dataclass(frozen=True)
class Config:
    tp: int = 1  # tensor-parallel size (inside a node)
    pp: int = 1  # pipeline stages
    dp: int | None = None  # data-parallel size; None = devices / (tp x pp x cp)
    cp: int = 1  # context-parallel size (sequence split, ring exchange of K/V)
    ep: int = 1  # expert-parallel size (MoE); may fold over tp x cp x dp ranks
    etp: int = 1  # expert tensor-parallel size
    vpp: int = 1  # interleaved model chunks per pipeline rank (virtual pipeline)
    sequence_parallel: bool = False  # Megatron's --sequence-parallel
    zero_stage: Literal[0, 1, 2, 3] = 0  # sharding over the data-parallel group (1 = distributed optimizer)
    tp_comm_overlap: float = 0.0  # fraction of TP communication hidden behind compute (0 = Megatron default)
    moe_imbalance: float = 1.0  # busiest expert rank's routed tokens over the mean (>= 1)
    first_stage_layers: int | None = None  # layers on the first pipeline stage (Megatron's uneven split)
    last_stage_layers: int | None = None  # layers on the last pipeline stage
    overlap_grad_reduce: bool = True  # bucketed gradient reduction overlaps the last backward
    overlap_param_gather: bool = True  # distributed optimizer's all-gather overlaps the next forward
    prefetch_depth: int = 1  # zero_stage 3: all-gathers in flight ahead of use

    def validate(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "etp", "vpp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.dp is not None and self.dp < 1:
            raise ValueError("dp: must be >= 1")
        if not 0 <= self.tp_comm_overlap <= 1:
            raise ValueError("tp_comm_overlap: must be between 0 and 1")
        if self.moe_imbalance < 1:
            raise ValueError("moe_imbalance: must be >= 1 (busiest over mean)")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("vpp: interleaving needs pp > 1")


@dataclass(frozen=True)
class Layout:
    dp: int
    num_micro_batches: int
    layers_per_virtual_stage: tuple[int, ...]
    placement: Placement
    experts: Placement


def stage_layers(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> tuple[int, ...]:
    """Layers of each virtual stage (pp x vpp of them, in model order).

    Explicit ``first``/``last`` give the first and last *pipeline ranks* that many layers (split
    over their vpp chunks), the rest are spread evenly. Otherwise layers are spread as evenly as
    possible, the remainder going to the middle so the edge stages (which also hold the
    embedding and the output head) carry fewer layers.
    """
    virtual = pp * vpp
    if first is None and last is None:
        base, extra = divmod(num_layers, virtual)
        even = [base] * virtual
        order = sorted(range(virtual), key=lambda v: (min(v, virtual - 1 - v) == 0, abs(v - (virtual - 1) / 2)))
        for v in order[:extra]:
            even[v] += 1
        if 0 in even[1:-1]:  # the edge chunks hold the embedding and the head; the others need a layer
            key = "vpp" if vpp > 1 else "pp"
            raise ValueError(f"{key}: pp x vpp = {pp} x {vpp} = {virtual} model chunks need at least {virtual - 2} "
                             f"layers for the chunks between the first and the last; model.num_layers is {num_layers}")
        return tuple(even)
    if pp < 2:
        raise ValueError("first_stage_layers: uneven stages need pp > 1")
    f = first if first is not None else None
    la = last if last is not None else None
    middle_ranks = pp - (f is not None) - (la is not None)
    rest = num_layers - (f or 0) - (la or 0)
    if rest < 0 or (middle_ranks and rest % (middle_ranks * vpp)) or (not middle_ranks and rest):
        raise ValueError(
            f"first_stage_layers: {num_layers} layers cannot be split as first={first}, last={last} "
            f"with the other {middle_ranks} stages x {vpp} chunks equal"
        )
    per_rank = [rest // middle_ranks if middle_ranks else 0] * pp
    if f is not None:
        per_rank[0] = f
    if la is not None:
        per_rank[-1] = la
    for r, n in enumerate(per_rank):
        if n % vpp:
            raise ValueError(f"first_stage_layers: stage {r} holds {n} layers, not divisible by vpp={vpp}")
    counts = tuple(per_rank[v % pp] // vpp for v in range(virtual))
    empty = [v for v in range(1, virtual - 1) if counts[v] == 0]  # the edge chunks keep embedding / head
    if empty:
        key = "first_stage_layers" if empty[0] % pp == 0 else "last_stage_layers"
        raise ValueError(f"{key}: model chunk {empty[0]} (pipeline rank {empty[0] % pp}) would hold no layer "
                         f"and no embedding or output head")
    return counts


def layout(config: Config, model: Model, training: Training, topology: Topology) -> Layout:
    n = topology.num_devices
    t, p, c = config.tp, config.pp, config.cp
    if n % (t * p * c):
        raise ValueError(f"tp: tp x pp x cp = {t} x {p} x {c} does not divide the {n} devices")
    dp = config.dp if config.dp is not None else n // (t * p * c)
    if t * p * dp * c != n:
        raise ValueError(f"dp: tp x pp x dp x cp = {t} x {p} x {dp} x {c} = {t * p * dp * c}, not the {n} devices")
    if model.num_heads % t:
        raise ValueError(f"tp: {t} does not divide model.num_heads {model.num_heads}")
    if model.kv_heads % t:
        raise ValueError(f"tp: {t} does not divide model.num_kv_heads {model.kv_heads}")
    if model.seq_len % (2 * c) and c > 1:
        raise ValueError(f"cp: model.seq_len {model.seq_len} is not divisible by 2 x cp (load-balanced causal split)")
    per_step = training.micro_batch_size * dp
    if training.global_batch_size % per_step:
        raise ScenarioError(
            f"training.global_batch_size: {training.global_batch_size} is not divisible by "
            f"micro_batch_size x data-parallel size = {training.micro_batch_size} x {dp}"
        )
    m = training.global_batch_size // per_step
    check_micro_batches(m)
    if config.vpp > 1 and m % p:
        raise ValueError(f"vpp: interleaving needs the {m} micro-batches per step to be a multiple of pp={p}")
    if config.ep > 1 or config.etp > 1:
        if model.moe is None:
            raise ValueError("ep: expert parallelism needs an MoE model (model.moe)")
        if model.moe.num_experts % config.ep:
            raise ValueError(f"ep: {config.ep} does not divide model.moe.num_experts {model.moe.num_experts}")
        if (n // p) % (config.ep * config.etp):
            raise ValueError(f"ep: ep x etp = {config.ep * config.etp} does not divide the {n // p} ranks of a stage")
        if t > 1 and not config.sequence_parallel:
            raise ValueError("sequence_parallel: Megatron requires it when ep > 1 and tp > 1")
    layers = stage_layers(model.num_layers, p, config.vpp, config.first_stage_layers, config.last_stage_layers)
    placement = Placement.from_sizes(n, order=("tp", "cp", "dp", "pp"), tp=t, cp=c, dp=dp, pp=p)
    experts = expert_placement(n, config.ep, config.etp, p)
    return Layout(dp, m, layers, placement, experts)


def check(config: Config, model: Model, training: Training, topology: Topology) -> None:
    layout(config, model, training, topology)


def pipeline_actions(p: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """Megatron's schedule for one pipeline rank: ("F" | "B", model chunk, micro-batch)."""
    total = m * v
    if v == 1:
        warmup = min(p - rank - 1, m)
    else:
        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)

    def chunk(k: int, forward: bool) -> int:
        c = (k // p) % v
        return c if forward else v - 1 - c

    def micro(k: int) -> int:
        return (k // (p * v)) * p + k % p

    actions = [("F", chunk(k, True), micro(k)) for k in range(warmup)]
    for i in range(total - warmup):
        actions.append(("F", chunk(warmup + i, True), micro(warmup + i)))
        actions.append(("B", chunk(i, False), micro(i)))
    actions += [("B", chunk(i, False), micro(i)) for i in range(total - warmup, total)]
    return actions


def _sharding(stage: int, n: int, groups: tuple[Ranks, ...]) -> NestedSharding:
    sizes = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[stage]
    return NestedSharding(*sizes, dp_groups=groups)


def build(config: Config, model: Model, training: Training, topology: Topology, expand: bool = False) -> OpGraph:
    lay = layout(config, model, training, topology)
    n, p, v, m = topology.num_devices, config.pp, config.vpp, lay.num_micro_batches
    placement = lay.placement
    stage_lanes = [
        sorted(r for r in range(n) if placement.coord(r)["pp"] == s) if expand
        else [placement.rank(tp=0, cp=0, dp=0, pp=s)]
        for s in range(p)
    ]
    weights = {r: (1 if expand else n // p) for lanes in stage_lanes for r in lanes}
    graph = OpGraph(n, weights, training.precision,
                    meta={"pp": p, "vpp": v, "tp": config.tp, "dp": lay.dp, "cp": config.cp, "ep": config.ep,
                          "num_micro_batches": m, "layers_per_virtual_stage": list(lay.layers_per_virtual_stage)})
    deg = Degrees(config.tp, config.cp, config.ep, config.etp, config.sequence_parallel,
                  config.tp_comm_overlap, config.moe_imbalance)
    units = mp_units(model, training, deg)
    # units of each virtual stage: embedding on the first, head on the last
    bounds, start = [], 1
    for count in lay.layers_per_virtual_stage:
        bounds.append(list(range(start, start + count)))
        start += count
    bounds[0].insert(0, 0)
    bounds[-1].append(len(units) - 1)
    schedule = Schedule(prefetch_depth=config.prefetch_depth, reshard_after_forward=True,
                        overlap_grad_reduce=config.overlap_grad_reduce, overlap_param_gather=config.overlap_param_gather)

    def group_of(dim: str, rank: int) -> tuple[str, Ranks]:
        source = lay.experts if dim == "ep" else placement
        members = source.group(dim, rank)
        return f"{dim}.{members[0]}", members

    stages = [_Stage(graph, lanes, s, p, v, m, bounds, units, training, deg, schedule, config, lay, group_of)
              for s, lanes in enumerate(stage_lanes)]
    world = range(n)
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
            reduced += stage.reduce(step)
        norm = grad_norm(Emitter(graph, [r for lanes in stage_lanes for r in lanes]), world, reduced, step)
        for stage in stages:
            stage.optimize(step, norm)
    return graph


class _Stage:
    """One pipeline rank's program (for its simulated lanes)."""

    def __init__(self, graph, lanes, rank, p, v, m, bounds, units: list[MPUnit], training, deg, schedule,
                 config: Config, lay: Layout, group_of) -> None:
        self.graph, self.lanes, self.rank, self.p, self.v, self.m = graph, lanes, rank, p, v, m
        self.units = units
        self.chunks = [bounds[c * p + rank] for c in range(v)]  # unit indices per model chunk
        self.local = [u for chunk in self.chunks for u in chunk]
        self.index = {u: i for i, u in enumerate(self.local)}
        self.emit = Emitter(graph, lanes)
        self.unit_emit = UnitEmitter(self.emit, deg, group_of)
        self.training, self.config, self.lay = training, config, lay
        self.actions = pipeline_actions(p, v, m, rank)
        uses: list[Use] = []
        for step in range(training.num_steps):
            for kind, c, mb in self.actions:
                chunk = self.chunks[c]
                ordered = chunk if kind == "F" else list(reversed(chunk))
                uses += [(step, mb, "fwd" if kind == "F" else "bwd", self.index[u]) for u in ordered]
        placement, experts = lay.placement, lay.experts
        dense_groups = tuple(sorted({placement.group(("dp", "cp"), r) for r in lanes}, key=lambda g: g[0]))
        names = [units[u].name for u in self.local]
        self.dense = ShardedParams(self.emit, [units[u].dense_params for u in self.local], names, training,
                                   _sharding(config.zero_stage, len(dense_groups[0]), dense_groups), schedule, uses)
        self.expert = None
        if any(units[u].expert_params for u in self.local):
            edp_groups = tuple(sorted({experts.group("edp", r) for r in lanes}, key=lambda g: g[0]))
            self.expert = ShardedParams(self.emit, [units[u].expert_params for u in self.local], names, training,
                                        _sharding(config.zero_stage, len(edp_groups[0]), edp_groups), schedule,
                                        uses, tag="experts.")
        self.next_stage = {r: placement.rank(**{**placement.coord(r), "pp": rank + 1}) for r in lanes} if rank < p - 1 else {}
        self.prev_stage = {r: placement.rank(**{**placement.coord(r), "pp": rank - 1}) for r in lanes} if rank > 0 else {}
        self.position = 0
        self.last: Ids = {}
        # Where no per-unit event matters (no gathers, no per-micro-batch reductions, no CP/EP
        # exchange), a chunk's units are emitted as one merged unit: same work and bytes, fewer
        # events. The first forward and the last backward of a step stay per unit, since the
        # parameter all-gather and the gradient reduction overlap them unit by unit.
        self.mergeable = [
            config.zero_stage <= 1 and len(chunk) > 1
            and not any(units[u].cp_bytes or units[u].ep_bytes or units[u].is_moe for u in chunk)
            for chunk in self.chunks
        ]
        self.merged = [merge_units([units[u] for u in chunk]) if ok else None
                       for chunk, ok in zip(self.chunks, self.mergeable)]

    def _sharded(self) -> list[ShardedParams]:
        return [s for s in (self.dense, self.expert) if s is not None]

    def start_step(self, step: int) -> None:
        self.position = 0

    def done(self) -> bool:
        return self.position >= len(self.actions)

    def emit_ready(self, step: int, sends: dict[tuple[str, int, int], Ids]) -> bool:
        progressed = False
        while not self.done():
            kind, c, mb = self.actions[self.position]
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
        target = self.next_stage if forward else self.prev_stage
        if not target:  # interleaved: the next model chunk starts again on the first rank (or the
            placement = self.lay.placement  # previous one ends on the last rank)
            wrap = 0 if forward else self.p - 1
            target = {r: placement.rank(**{**placement.coord(r), "pp": wrap}) for r in self.lanes}
        ids: Ids = {}
        for lane, peer in target.items():
            group = self.graph.add_group(f"p2p.{lane}.{peer}", (lane, peer))
            op = self.graph.collective("send_recv", group, [lane], size, f"send.{direction}.vs{vs}.mb{mb}", "pp",
                                       f"pp_{'fwd' if forward else 'bwd'}", [deps[lane]], step=step)
            ids[peer] = op
        sends[(direction, vs, mb)] = ids

    def _forward(self, step: int, c: int, mb: int, vs: int, incoming: Ids | None, sends) -> None:
        last: Ids | None = incoming
        merged = self.merged[c]
        if merged is not None and mb > 0:
            last = self.unit_emit.forward(merged, f"{merged.name}.mb{mb}", [last], step,
                                          {"activations": merged.activation_bytes}, None)
            self._forwarded(c, mb, vs, step, last, sends)
            return
        for u in self.chunks[c]:
            unit = self.units[u]
            i = self.index[u]
            deps = [last] + [d for s in self._sharded() for d in s.forward_deps(step, mb, i)]
            free = sum(s.forward_free(i) for s in self._sharded())
            last = self.unit_emit.forward(unit, f"{unit.name}.mb{mb}", deps, step,
                                          {"activations": unit.activation_bytes}, {"buffers": free} if free else None)
            for s in self._sharded():
                s.forward_done(step, mb, i, last)
        assert last is not None
        self._forwarded(c, mb, vs, step, last, sends)

    def _forwarded(self, c: int, mb: int, vs: int, step: int, last: Ids, sends) -> None:
        self.last = last
        if vs < self.p * self.v - 1:
            self._send("F", vs, mb, step, self.units[self.chunks[c][-1]].p2p_bytes, last, sends)

    def _backward(self, step: int, c: int, mb: int, vs: int, incoming: Ids | None, sends) -> None:
        last: Ids | None = incoming
        merged = self.merged[c]
        if merged is not None and mb < self.m - 1:
            free = {"activations": merged.activation_bytes + merged.recompute_bytes}
            last = self.unit_emit.backward(merged, f"{merged.name}.mb{mb}", [last], step,
                                           {"activations": merged.recompute_bytes}, free)
            self._backwarded(c, mb, vs, step, last, sends)
            return
        for u in reversed(self.chunks[c]):
            unit = self.units[u]
            i = self.index[u]
            deps = [last] + [d for s in self._sharded() for d in s.backward_deps(step, mb, i)]
            alloc = {"activations": unit.recompute_bytes, "buffers": sum(s.backward_alloc(i) for s in self._sharded())}
            free = {"activations": unit.activation_bytes + unit.recompute_bytes,
                    "buffers": sum(s.backward_free(i) for s in self._sharded())}
            last = self.unit_emit.backward(unit, f"{unit.name}.mb{mb}", deps, step, alloc, free)
            for s in self._sharded():
                s.backward_done(step, mb, i, last, last_mb=mb == self.m - 1)
        assert last is not None
        self._backwarded(c, mb, vs, step, last, sends)

    def _backwarded(self, c: int, mb: int, vs: int, step: int, last: Ids, sends) -> None:
        self.last = last
        if vs > 0:
            self._send("B", vs, mb, step, self.units[self.chunks[c][0]].p2p_bytes, last, sends)

    def reduce(self, step: int) -> list[Ids | None]:
        out: list[Ids | None] = [self.last]
        for s in self._sharded():
            out += s.reduce_step(step, self.last)
        return out

    def optimize(self, step: int, norm: Ids) -> None:
        for s in self._sharded():
            s.optimize(step, [norm])


def label(resolved: dict) -> str:
    """A short name for tables."""
    return compose_label(resolved, {"zero_stage": "zero", "tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep", "vpp": "vpp"})
