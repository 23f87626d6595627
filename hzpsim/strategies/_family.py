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

from dataclasses import dataclass

from hzpsim.cluster.placement import Placement, expert_placement
from hzpsim.cluster.topology import Topology
from hzpsim.config import ScenarioError
from hzpsim.model import Model
from hzpsim.ops import OpGraph, Ranks
from hzpsim.strategies._model_parallel import Degrees, UnitEmitter, mp_units
from hzpsim.strategies._sharded import (
    Emitter,
    Ids,
    NestedSharding,
    Schedule,
    ShardedParams,
    flat_uses,
    grad_norm,
)
from hzpsim.training import Training, check_micro_batches


@dataclass(frozen=True)
class FamilyPlan:
    """Sizes are counted in ranks of the dense data-parallel (dp x cp) group."""

    param_size: int
    grad_size: int
    optim_size: int
    schedule: Schedule
    degrees: Degrees = Degrees()
    #: the strategy's config keys that set param / grad / optim sizes, for error messages
    keys: tuple[str, str, str] = ("param_group_size", "grad_group_size", "optim_group_size")


def sharding_world(topology: Topology, degrees: Degrees) -> int:
    """Ranks of the dense data-parallel group (dp x cp): parameters are replicated over it."""
    return topology.num_devices // degrees.tp


def data_parallel_size(topology: Topology, degrees: Degrees) -> int:
    """Model replicas that split the batch (context parallelism splits sequences instead)."""
    return topology.num_devices // (degrees.tp * degrees.cp)


def _expert_sizes(plan: FamilyPlan, expert_world: int) -> tuple[int, int, int]:
    return tuple(min(s, expert_world) for s in (plan.param_size, plan.grad_size, plan.optim_size))  # type: ignore[return-value]


def check(plan: FamilyPlan, model: Model, training: Training, topology: Topology) -> None:
    """Raise ValueError("<field>: ...") for layouts that cannot run."""
    n, deg = topology.num_devices, plan.degrees
    if n % (deg.tp * deg.cp):
        raise ValueError(f"tp: tp x cp = {deg.tp} x {deg.cp} does not divide the {n} devices")
    if model.num_heads % deg.tp or model.kv_heads % deg.tp:
        raise ValueError(f"tp: {deg.tp} does not divide model.num_heads {model.num_heads} and "
                         f"model.num_kv_heads {model.kv_heads}")
    if deg.cp > 1 and model.seq_len % (2 * deg.cp):
        raise ValueError(f"cp: model.seq_len {model.seq_len} is not divisible by 2 x cp")
    world = sharding_world(topology, deg)
    NestedSharding(plan.param_size, plan.grad_size, plan.optim_size, (range(world),)).check(plan.keys)
    if plan.schedule.hierarchical_gather > 1 and plan.param_size % plan.schedule.hierarchical_gather:
        raise ValueError("hierarchical_gather: must divide the param group size")
    secondary = plan.schedule.backward_gather_size
    if secondary and (secondary > plan.param_size or plan.param_size % secondary):
        raise ValueError(f"hpz_partition_size: {secondary} must divide the param group size {plan.param_size}")
    dp = data_parallel_size(topology, deg)
    if training.global_batch_size % (training.micro_batch_size * dp):
        raise ScenarioError(
            f"training.global_batch_size: {training.global_batch_size} is not divisible by "
            f"micro_batch_size x data-parallel size = {training.micro_batch_size} x {dp}"
        )
    check_micro_batches(training.global_batch_size // (training.micro_batch_size * dp))
    if deg.ep > 1 or deg.etp > 1:
        if model.moe is None:
            raise ValueError("ep: expert parallelism needs an MoE model (model.moe)")
        if model.moe.num_experts % deg.ep:
            raise ValueError(f"ep: {deg.ep} does not divide model.moe.num_experts {model.moe.num_experts}")
        if n % (deg.ep * deg.etp):
            raise ValueError(f"ep: ep x etp = {deg.ep * deg.etp} does not divide the {n} devices")
        if deg.tp > 1 and not deg.sequence_parallel:
            raise ValueError("sequence_parallel: required when ep > 1 and tp > 1")
        expert_world = n // (deg.ep * deg.etp)
        sizes = _expert_sizes(plan, expert_world)
        NestedSharding(*sizes, dp_groups=(range(expert_world),)).check(plan.keys)


def build(plan: FamilyPlan, model: Model, training: Training, topology: Topology, expand: bool,
          meta: dict | None = None) -> OpGraph:
    n, deg = topology.num_devices, plan.degrees
    dp = data_parallel_size(topology, deg)
    placement = Placement.from_sizes(n, order=("tp", "cp", "dp"), tp=deg.tp, cp=deg.cp, dp=dp)
    experts = expert_placement(n, deg.ep, deg.etp)
    lanes = list(range(n)) if expand else [0]
    weights = {r: 1 for r in lanes} if expand else {0: n}
    graph = OpGraph(n, weights, training.precision, meta={"pp": 1, "dp": dp, "tp": deg.tp, "cp": deg.cp,
                                                            "ep": deg.ep, **(meta or {})})
    m = training.global_batch_size // (training.micro_batch_size * dp)
    units = mp_units(model, training, deg)
    emit = Emitter(graph, lanes)
    uses = flat_uses(training.num_steps, m, len(units))
    names = [u.name for u in units]

    dense_groups = tuple(sorted({placement.group(("dp", "cp"), r) for r in lanes}, key=lambda g: g[0]))
    sharded = [ShardedParams(emit, [u.dense_params for u in units], names, training,
                             NestedSharding(plan.param_size, plan.grad_size, plan.optim_size, dense_groups),
                             plan.schedule, uses)]
    if any(u.expert_params for u in units):
        edp_groups = tuple(sorted({experts.group("edp", r) for r in lanes}, key=lambda g: g[0]))
        sizes = _expert_sizes(plan, len(edp_groups[0]))
        sharded.append(ShardedParams(emit, [u.expert_params for u in units], names, training,
                                     NestedSharding(*sizes, dp_groups=edp_groups), plan.schedule, uses,
                                     tag="experts."))

    def group_of(dim: str, rank: int) -> tuple[str, Ranks]:
        members = (experts if dim == "ep" else placement).group(dim, rank)
        return f"{dim}.{members[0]}", members

    unit_emit = UnitEmitter(emit, deg, group_of)
    for step in range(training.num_steps):
        last: Ids = {}
        for mb in range(m):
            for u, unit in enumerate(units):
                deps: list[Ids | None] = [d for s in sharded for d in s.forward_deps(step, mb, u)]
                released = sum(s.forward_free(u) for s in sharded)
                last = unit_emit.forward(unit, f"{unit.name}.mb{mb}", deps, step, {"activations": unit.activation_bytes},
                                         {"buffers": released} if released else None)
                for s in sharded:
                    s.forward_done(step, mb, u, last)
            for u in reversed(range(len(units))):
                unit = units[u]
                deps = [last, *(d for s in sharded for d in s.backward_deps(step, mb, u))]
                alloc = {"activations": unit.recompute_bytes, "buffers": sum(s.backward_alloc(u) for s in sharded)}
                free = {"activations": unit.activation_bytes + unit.recompute_bytes,
                        "buffers": sum(s.backward_free(u) for s in sharded)}
                last = unit_emit.backward(unit, f"{unit.name}.mb{mb}", deps, step, alloc, free)
                for s in sharded:
                    s.backward_done(step, mb, u, last, last_mb=mb == m - 1)
        reduced: list[Ids | None] = [last]
        for s in sharded:
            reduced += s.reduce_step(step, last)
        norm = grad_norm(emit, range(n), reduced, step)
        for s in sharded:
            s.optimize(step, [norm])
    return graph


def level_group_sizes(topology: Topology, degrees: Degrees) -> dict[str, int]:
    """How many ranks of one dense data-parallel group sit in an island, a node, a leaf and the
    whole cluster: the group sizes that align with topology levels."""
    stride = degrees.tp * degrees.cp
    world = sharding_world(topology, degrees)
    sizes = {
        "island": max(topology.devices_per_island // stride, 1),
        "node": max(topology.devices_per_node // stride, 1),
        "leaf": max(topology.devices_per_node * topology.nodes_per_leaf // stride, 1),
        "all": world,
    }
    return {k: min(v, world) for k, v in sizes.items()}


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
