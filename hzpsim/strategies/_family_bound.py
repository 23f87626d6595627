"""The ZeRO family's lower bounds (each member's ``bound``): one rank's step replayed at least
durations.

The chain: every micro-batch's forward and backward behind its parameter gathers (prefetch
depth and the gather-buffer ring), its gradient reduce-scatters (the scatter-buffer ring),
then the step-end reductions, the gradient norm and the optimizer. The talking: the busiest
stream's serial sum and the busiest link's bytes, less what may overlap the kernels (which it
slows). Why each holds: :class:`~hzpsim.strategies._bounds.BoundCache`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from hzpsim.hardware.placement import expert_placement
from hzpsim.hardware.topology import Topology
from hzpsim.model import Model
from hzpsim.model.training import Training
from hzpsim.strategies import _compression
from hzpsim.strategies._bounds import (
    Bound,
    BoundCache,
    Costs,
    DPUnit,
    communicators_at_least,
    norm_s,
    slowed,
    static_bytes,
    stream_sums,
    whole_buffer_s,
)
from hzpsim.strategies._family import FamilyPlan, compression_plan
from hzpsim.strategies._layers import Work, optimizer_bytes_per_param
from hzpsim.strategies._sharded import NestedSharding


def bound_of(plan_of: Callable[[Any, Topology], FamilyPlan]):
    """The ``bound`` hook of a family member whose layout is ``plan_of(config, topology)``."""

    def bound(config: Any, model: Model, training: Training, topology: Topology, cache: BoundCache) -> Bound:
        """Lower bounds on this layout's step time and peak memory (``hzpsim search``)."""
        return family_bound(cache, plan_of(config, topology), training)

    return bound


def family_bound(bounder: BoundCache, plan: FamilyPlan, training: Training) -> Bound:
    """The bounds of the family member whose layout is ``plan``."""
    topology = bounder.topology
    training = plan.schedule.implementation.training_for(training, topology.device)  # as build runs it
    n = topology.num_devices
    schedule = plan.schedule
    deg = plan.dims
    dp = deg.data_parallel(n)
    m = training.global_batch_size // (training.micro_batch_size * dp)
    credit = n > 1  # one simulated rank stands for all n
    costs = bounder.costs(training.precision, credit)
    sd = costs.slowdown
    opt_rate = optimizer_bytes_per_param(training)
    unit_costs = bounder.units(training, deg, 1, credit)
    dense = sum(u.dense_params for u in unit_costs)
    expert = sum(u.expert_params for u in unit_costs)
    sizes = (plan.param_size, plan.grad_size, plan.optim_size)
    p, g, o = sizes
    expert_world = n // (deg.ep * deg.etp)
    expert_sizes = (min(p, expert_world), min(g, expert_world), min(o, expert_world))
    opt_dense = costs.work_s(Work(bytes_accessed=dense / o * opt_rate))
    opt_expert = costs.work_s(Work(bytes_accessed=expert / expert_sizes[2] * opt_rate)) if expert else 0.0
    optimizer = opt_dense + opt_expert
    # the dense optimizer (and what waits for it) may end before the step boundary, the experts'
    early = (1 + sd) * opt_expert
    impl = plan.schedule.implementation
    static = (static_bytes(dense, sizes, training, impl)
              + static_bytes(expert, expert_sizes, training, impl))  # type: ignore[arg-type]
    memory = static + sum(u.activation_bytes for u in unit_costs)
    # the (dp, cp) group of rank 0; ranks are placed tp, cp, dp (tp fastest)
    dp_group = range(0, n, deg.tp)
    num = len(unit_costs)
    dpu = bounder.dp_units(costs, unit_costs, 0, num, sizes, dp_group, training, schedule)
    expert_group: tuple[int, ...] = ()
    expert_units: list = []
    if expert and expert_sizes != (1, 1, 1):  # the experts' own collectives (DPUnit.with_experts)
        expert_group = tuple(expert_placement(n, deg.ep, deg.etp).group("edp", 0))
        expert_units = bounder.expert_units(unit_costs)
        experts = bounder.dp_units(costs, expert_units, 0, num, expert_sizes, expert_group, training, schedule)
        dpu = [d.with_experts(e) for d, e in zip(dpu, experts)]
    compressed_demand = None
    if _compression.resolved(plan.grad_compression) is not None:
        dpu, compressed_demand = _compressed(bounder, plan, training, unit_costs, dpu, costs, dp_group, m)
    impl = schedule.implementation
    copy = [costs.work_s(Work(bytes_accessed=2.0 * impl.copy_bytes_per_gathered_byte * u.dense_params
                                                  * training.param_element_bytes))
            if impl.copy_bytes_per_gathered_byte and p > 1 and u.dense_params else 0.0 for u in unit_costs]
    reshard = schedule.reshard_after_forward
    depth = schedule.effective_prefetch_depth
    slots = schedule.reduce_buffers

    # the chain: every micro-batch's forward and backward behind its gathers (prefetch depth),
    # gradient buffers and reduce-scatters, then the step-end reductions, the norm, the optimizer
    ready = [-early] * num
    t_dp = -early
    if o > p:
        for u in range(num):
            if dpu[u].step_ag:
                t_dp += dpu[u].step_ag
                ready[u] = t_dp
        if not schedule.overlap_param_gather:
            ready = [t_dp] * num
    t = 0.0
    t_ag = t_rs = -math.inf
    consumed: list[float] = []  # end of the compute that used each gather
    scatters: list[float] = []
    final = [0.0] * num
    first_start = None
    for mb in range(m):
        for phase, order in (("fwd", range(num)), ("bwd", range(num - 1, -1, -1))):
            for u in order:
                d = dpu[u]
                start = t
                gathered = p > 1 and unit_costs[u].dense_params > 0 and (phase == "fwd" or reshard)
                if gathered:
                    slot = len(consumed) - depth - 1
                    t_ag = max(t_ag, ready[u], consumed[slot] if slot >= 0 else -math.inf) + (
                        d.gather_fwd if phase == "fwd" else d.gather_bwd)
                    start = max(start, t_ag)
                elif p == 1 and mb == 0 and phase == "fwd":
                    start = max(start, ready[u])
                if phase == "bwd" and d.reduce and len(scatters) >= slots:
                    start = max(start, scatters[-slots])
                if first_start is None:
                    first_start = start
                copied = copy[u] if (phase == "fwd" or reshard) else 0.0
                t = start + copied + (unit_costs[u].forward_s if phase == "fwd" else unit_costs[u].backward_s)
                if gathered:
                    consumed.append(t)
                if phase == "bwd":
                    done = t
                    if d.reduce:
                        t_rs = max(t_rs, t) + d.reduce
                        scatters.append(t_rs)
                        done = t_rs
                    t_rs += d.expert_reduce  # after the dense one, on the same stream
                    final[u] = done
    end_backward = t
    wait = end_backward if not schedule.effective_overlap_grad_reduce else -math.inf
    norm_ready = max([end_backward] + final)
    whole = whole_buffer_s(costs, dense, sizes, dp_group, training, schedule)
    d0 = dpu[0]
    if whole is not None:
        t_dp = max(t_dp, norm_ready) + whole
        norm_ready = t_dp
        tail = d0.reduce + whole
    else:
        for u in range(num - 1, -1, -1):
            done = final[u]
            for seconds in (dpu[u].step_rs, dpu[u].replica_ar):
                if seconds:
                    t_dp = max(t_dp, done, wait) + seconds
                    done = t_dp
            norm_ready = max(norm_ready, done)
        tail = d0.reduce + d0.step_rs + d0.replica_ar
    # the norm's straggler, when no other rendezvous of the world resets its stretch
    world = deg.data_parallel(n) * deg.cp
    groups = [p, g, o, world // o, deg.tp, deg.cp, deg.ep] + ([expert_world] if expert else [])
    squares = 0.0
    if max(groups) < n:
        squares = m * sum(u.kernels_sq for u in unit_costs) + opt_dense ** 2 + opt_expert ** 2
    norm = norm_s(costs, n, squares)
    chain = norm_ready + norm + optimizer

    # the talking: streams' serial sums and the links' bytes in the step (with experts, less
    # what may have run before the boundary)
    units_talk = m * sum(u.comm_s for u in unit_costs)
    demand = dict(bounder.sharded_demand(costs, [u.dense_params for u in unit_costs], m, sizes, dp_group,
                                         training, schedule))
    for level, b in (compressed_demand or {}).items():  # the compressed reductions' bytes, not the plain ones'
        demand[level] = max(demand.get(level, 0.0) + b, 0.0)
    for uc in unit_costs:
        for level, b in uc.link_bytes:
            demand[level] = demand.get(level, 0.0) + m * b
    if expert_group:  # the experts' (their step-end gather left out: it may precede the boundary)
        for level, b in bounder.sharded_demand(costs, [u.dense_params for u in expert_units], m, expert_sizes,
                                               expert_group, training, schedule).items():
            demand[level] = demand.get(level, 0.0) + b
    streams = {
        "ag": m * sum(d.gather_fwd + (d.gather_bwd if reshard else 0.0) for d in dpu),
        "rs": m * sum(d.reduce + d.expert_reduce for d in dpu),
        "dp": sum(d.step_ag + d.expert_step for d in dpu)
        + (whole if whole is not None else sum(d.step_rs + d.replica_ar for d in dpu)),
    }
    talking = max(costs.link_s(demand), stream_sums(schedule, streams)) - early
    head = max(0.0, min(first_start if first_start is not None else 0.0,
                        (d0.step_ag if o > p else 0.0) + (d0.gather_fwd if p > 1 else 0.0)) - early)
    non_overlapping = units_talk + norm + head + tail
    kernels = m * sum(u.forward_s + u.backward_s for u in unit_costs) - units_talk + m * sum(copy) * (2 if reshard else 1) + optimizer
    slow = slowed(kernels, talking, sd, non_overlapping)
    step = max(chain, slow)
    work = m * sum(u.forward_s + u.backward_s for u in unit_costs)
    # the communicators every rank holds: the world's (the gradient norm), TP, CP, EP, the
    # parameter gathers' and gradient reductions' groups, and the experts'
    expert_groups = (expert_sizes[0], expert_sizes[1]) if expert else ()
    overhead = topology.device.communicator_bytes * communicators_at_least(
        (n, deg.tp, deg.cp, deg.ep if expert else 1, p, g, *expert_groups))
    return Bound(step, work + optimizer, units_talk, 0.0, memory, talking, slow > chain, head + tail + norm, overhead)


def _compressed(bounder: BoundCache, plan: FamilyPlan, training: Training, unit_costs: list, dpu: list[DPUnit],
                costs: Costs, dp_group: range, m: int) -> tuple[list[DPUnit], dict[str, float]]:
    """The units' data-parallel collectives with gradient compression (``_sharded``'s
    ``_compressed_reduce``): each compressed unit's reduction costs its method's collectives at
    least (their isolated times), and the link demand changes by their bytes less the plain
    reduction's. The compress and decompress kernels and the error-feedback memory are left
    out: they only add, so the bound stays below the simulation."""
    model = bounder.model
    names = ["embed", *(f"layer{i}" for i in range(model.num_layers)), "head"]
    assert len(names) == len(unit_costs), (len(names), len(unit_costs))
    comp = compression_plan(plan, model, training, names, [u.dense_params for u in unit_costs])
    assert comp is not None
    p, g, o = plan.param_size, plan.grad_size, plan.optim_size
    sharding = NestedSharding(p, g, o, (tuple(dp_group),))
    replicas = len(dp_group) // o
    role = "grad" if g > 1 else "step_rs" if o > g else "replica" if replicas > 1 else ""
    if not role:
        return dpu, {}
    members = sharding.group_of(role, dp_group[0])[1]
    n = len(members)
    bg = training.grad_element_bytes
    impl = plan.schedule.implementation
    reduce_bytes = plan.schedule.grad_reduce_bytes_per_element or bg
    per_step = m if role == "grad" else 1
    demand: dict[str, float] = {}
    out = []
    for u, (uc, d) in enumerate(zip(unit_costs, dpu)):
        unit = comp.units[u]
        if unit is None or uc.dense_params <= 0:
            out.append(d)
            continue
        calls = max(impl.reduce_calls(uc.tensors), 1)
        if unit.method == "quantize":
            chain = [("all_reduce" if role == "replica" else "reduce_scatter", unit.payload_bytes)]
        elif unit.method == "topk":
            chain = [("all_gather", n * unit.payload_bytes)]
        else:
            chain = [("all_reduce", unit.p_bytes), ("all_reduce", unit.q_bytes)]
        seconds = sum(costs.collective_s(kind, size / calls, members, calls) for kind, size in chain)
        for kind, size in chain:
            costs.add_demand(demand, kind, size, members, per_step)
        plain_kind, plain_size = {"grad": ("reduce_scatter", uc.dense_params * reduce_bytes),
                                  "step_rs": ("reduce_scatter", uc.dense_params / g * bg),
                                  "replica": ("all_reduce", uc.dense_params / o * bg)}[role]
        plain: dict[str, float] = {}
        costs.add_demand(plain, plain_kind, plain_size, members, per_step)
        for level, b in plain.items():
            demand[level] = demand.get(level, 0.0) - b
        field = {"grad": "reduce", "step_rs": "step_rs", "replica": "replica_ar"}[role]
        out.append(dataclasses.replace(d, **{field: seconds}))
    return out, demand
