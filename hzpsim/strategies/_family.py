"""The ZeRO family's one builder: nested sharding groups composed with tp, cp and ep.

``zero``, ``hsdp``, ``mics``, ``zeropp`` and ``asynchzp`` are thin configurations that each
produce a :class:`FamilyPlan`; this module checks the layout and emits the program: a plain
loop of micro-batches (forward in unit order, backward in reverse) with

- the model-parallel work and collectives of every unit (:mod:`._model_parallel`),
- the sharding hooks around them (:class:`._sharded.ShardedParams`): dense parameters shard
  over the dp x cp group, expert parameters over their expert-data-parallel group,
- a global gradient-norm all-reduce and the optimizer at each step end.

Ranks are placed tp fastest, then cp, then dp, so a param group of g consecutive data-parallel
ranks with tp = 1 is g neighbouring devices (an island, a node).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hzpsim.hardware.placement import Placement, expert_placement
from hzpsim.hardware.topology import Topology
from hzpsim.model import Model
from hzpsim.model.ops import OpGraph
from hzpsim.model.training import Training
from hzpsim.strategies import _compression, compose_label
from hzpsim.strategies._compression import CompressionPlan, GradCompression
from hzpsim.strategies._dims import NO_MODEL_PARALLELISM, ParallelDims
from hzpsim.strategies._lengths import attach_lengths
from hzpsim.strategies._model_parallel import UnitPass
from hzpsim.strategies._mp_units import mp_units
from hzpsim.strategies._sharded import (
    Emitter,
    Ids,
    NestedSharding,
    Schedule,
    flat_uses,
    grad_norm,
)


@dataclass(frozen=True, kw_only=True)
class FamilyPlan:
    """A family member's layout: three nested sharding sizes, how collectives are issued and
    the model parallelism it composes with. Sizes are counted in ranks of the dense
    data-parallel (dp × cp) group."""

    param_size: int
    """Ranks sharing the working parameters (all-gathered before each use)."""
    grad_size: int
    """Ranks sharing the gradient accumulator (reduce-scattered each micro-batch)."""
    optim_size: int
    """Ranks sharing fp32 master weights and Adam moments."""
    schedule: Schedule
    dims: ParallelDims = NO_MODEL_PARALLELISM
    """The tp / cp / ep composed with the sharding (no pp: the family has no pipeline)."""
    keys: tuple[str, str, str] = ("param_group_size", "grad_group_size", "optim_group_size")
    """The member's config keys that set the param / grad / optim sizes (named in errors)."""
    grad_compression: GradCompression | None = None
    """Compression of the gradient reduction (``_compression``; ddp and zero stages 1/2). None
    or ratio 1: none, and nothing of it is emitted."""


def check(plan: FamilyPlan, model: Model, training: Training, topology: Topology) -> None:
    """Raise ValueError("<field>: ...") for layouts that cannot run."""
    n, dims = topology.num_devices, plan.dims
    dims.check(model, training, n)
    sizes = (plan.param_size, plan.grad_size, plan.optim_size)
    NestedSharding(*sizes, dp_groups=(range(dims.sharding_world(n)),)).check(plan.keys)
    if plan.schedule.hierarchical_gather > 1 and plan.param_size % plan.schedule.hierarchical_gather:
        raise ValueError("hierarchical_gather: must divide the param group size")
    secondary = plan.schedule.backward_gather_size
    if secondary and (secondary > plan.param_size or plan.param_size % secondary):
        raise ValueError(f"hpz_partition_size: {secondary} must divide the param group size {plan.param_size}")
    compression = _compression.resolved(plan.grad_compression)
    if compression is not None:
        if plan.param_size > 1:
            raise ValueError("grad_compression: not supported with sharded parameters (ZeRO stage 3): "
                             "the gradient is reduce-scattered unit by unit into 1/N shards")
        if model.moe is not None:
            raise ValueError("grad_compression: MoE models are not supported (expert gradients are not compressed)")
        if dims.tp > 1 or dims.cp > 1 or dims.ep > 1:
            raise ValueError("grad_compression: only without model parallelism")
        if plan.schedule.implementation.whole_buffer_step_reduce:
            raise ValueError(f"grad_compression: not supported with implementation "
                             f"{plan.schedule.implementation.name}'s one all-reduce of the whole gradient buffer")
    if dims.ep > 1 or dims.etp > 1:
        expert_world = dims.expert_world(n)
        NestedSharding(*_capped(sizes, expert_world), dp_groups=(range(expert_world),)).check(plan.keys)


def _capped(sizes: tuple[int, int, int], group_size: int) -> tuple[int, int, int]:
    """Sharding sizes inside a data-parallel group of ``group_size`` ranks (an expert group
    may be smaller than the dense one: its sizes stop at the group)."""
    p, g, o = (min(s, group_size) for s in sizes)
    return p, g, o


def build(plan: FamilyPlan, model: Model, training: Training, topology: Topology, expand: bool,
          meta: dict | None = None) -> OpGraph:
    training = plan.schedule.implementation.training_for(training, topology.device)
    n, dims = topology.num_devices, plan.dims
    dp = dims.data_parallel(n)
    placement = Placement.from_sizes(n, order=("tp", "cp", "dp"), tp=dims.tp, cp=dims.cp, dp=dp)
    experts = expert_placement(n, dims.ep, dims.etp)
    lanes, weights, slow = simulated_lanes(topology, placement, expand)
    graph = OpGraph(n, weights, training.precision, meta={"pp": 1, "dp": dp, "tp": dims.tp, "cp": dims.cp,
                                                            "ep": dims.ep, **(meta or {}), **slow})
    m = dims.num_micro_batches(training, n)
    units = mp_units(model, training, dims.placed(topology), plan.schedule.implementation)
    emit = Emitter(graph, lanes, plan.schedule.implementation.on_device(topology.device))
    attach_lengths(emit, training, model.seq_len, {lane: placement.coord(lane)["dp"] for lane in lanes}, dp,
                   dims.tp * dims.cp, m)
    sizes = (plan.param_size, plan.grad_size, plan.optim_size)
    unit_pass = UnitPass(emit, dims, units, training, placement, experts, plan.schedule,
                         flat_uses(training.num_steps, m, len(units)), lambda size: _capped(sizes, size), m,
                         compression_plan(plan, model, training, [u.name for u in units], [u.dense_params for u in units]))
    for step in range(training.num_steps):
        last = micro_batches(unit_pass, units, step, m, None)
        norm = grad_norm(emit, range(n), unit_pass.reduce(step, last), step)
        unit_pass.optimize(step, norm)
    return graph


def micro_batches(unit_pass: UnitPass, units: list, step: int, m: int, incoming: Ids | None) -> Ids:
    """A plain loop's ``m`` micro-batches of ``step`` (forward in unit order, backward in
    reverse) after ``incoming``; the last backward's ops."""
    last = incoming
    for mb in range(m):
        for u, unit in enumerate(units):
            last = unit_pass.forward(unit, u, step, mb, last)
        for u in reversed(range(len(units))):
            last = unit_pass.backward(units[u], u, step, mb, last)
    assert last is not None
    return last


def compression_plan(plan: FamilyPlan, model: Model, training: Training, names: list[str],
                     params: list[float]) -> CompressionPlan | None:
    """The units' gradient compression (None when off: ratio 1 emits nothing)."""
    compression = _compression.resolved(plan.grad_compression)
    if compression is None:
        return None
    shapes = _compression.unit_shapes(model, names, params)
    return _compression.plan(compression, shapes, float(training.grad_element_bytes))


def simulated_lanes(topology: Topology, placement: Placement, expand: bool,
                    ) -> tuple[list[int], dict[int, int], dict[str, list[list[float]]]]:
    """Simulated ranks, the devices each stands for, and the graph's ``compute_slowdown`` meta
    (``[[rank, factor], ...]``, read by the engine): every device under ``expand``; else rank 0
    for everyone, plus each explicit straggler's data-parallel class
    (:meth:`~hzpsim.hardware.topology.Topology.straggler_lanes`)."""
    n = topology.num_devices
    if expand:
        slow = {d: f for d in topology.stragglers if (f := topology.compute_slowdown(d)) != 1.0}
        lanes, weights = list(range(n)), dict.fromkeys(range(n), 1)
    else:
        slow = topology.straggler_lanes(placement)
        stride = placement.size("tp") * placement.size("cp")
        rep = next((r for r in range(0, n, stride) if r not in slow), None)
        weights = dict.fromkeys(slow, stride)
        if rep is not None:
            weights[rep] = n - stride * len(slow)
        lanes = sorted(weights)
    factors = [[r, f] for r, f in sorted(slow.items()) if f != 1.0]
    return lanes, weights, {"compute_slowdown": factors} if factors else {}


def level_group_sizes(topology: Topology, dims: ParallelDims = NO_MODEL_PARALLELISM) -> dict[str, int]:
    """How many ranks of one dense data-parallel group sit in an island, a node, a leaf and the
    whole cluster: the group sizes that align with topology levels."""
    stride = dims.tp * dims.cp
    world = dims.sharding_world(topology.num_devices)
    sizes = {
        "island": max(topology.devices_per_island // stride, 1),
        "node": max(topology.devices_per_node // stride, 1),
        "leaf": max(topology.devices_per_node * topology.nodes_per_leaf // stride, 1),
        "all": world,
    }
    return {k: min(v, world) for k, v in sizes.items()}


def search_group_sizes(topology: Topology, space: Any) -> list[int]:
    """The group sizes ``hzpsim search`` tries for HSDP, MiCS and Megatron-FSDP: ``space.group_sizes``
    (None: the powers of two from 2 to half the devices) that divide the devices, above one
    rank and below all of them."""
    n = topology.num_devices
    groups = list(space.group_sizes) if space.group_sizes is not None else _powers_of_two(2, n // 2)
    return sorted({g for g in groups if 1 < g < n and n % g == 0})


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, v = [], 1
    while v <= hi:
        if v >= lo:
            out.append(v)
        v *= 2
    return out


def async_streams(asynchronous: bool) -> tuple[tuple[str, str], ...]:
    """Dedicated gather / reduce / cross-group streams, or FSDP1's single communicator."""
    if asynchronous:
        return (("ag", "ag"), ("rs", "rs"), ("dp", "dp"))
    return (("ag", "comm"), ("rs", "comm"), ("dp", "comm"))


def delegates(plan_of):
    """``check`` and ``build`` of a family member whose layout is ``plan_of(config, topology)``:
    each member module only says how its Config maps to a FamilyPlan."""

    def check_member(config, model: Model, training: Training, topology: Topology) -> None:
        check(plan_of(config, topology), model, training, topology)

    def build_member(config, model: Model, training: Training, topology: Topology, expand: bool = False) -> OpGraph:
        return build(plan_of(config, topology), model, training, topology, expand)

    return check_member, build_member


def one_group_member(plan_of, key: str, short: str):
    """``check``, ``build``, ``resolve`` and ``label`` of a member whose one group-size field
    ``key`` (``None`` = its default) sets the param group: resolve fills the default in, the
    label shows it as ``short=``."""
    check_member, build_member = delegates(plan_of)

    def resolve(config, topology: Topology):
        """The config as simulated: the default group size filled in."""
        return dataclasses.replace(config, **{key: plan_of(config, topology).param_size})

    def label(resolved: dict) -> str:
        """A short name for tables."""
        return compose_label(resolved, {key: short})

    return check_member, build_member, resolve, label
