"""The ND strategy's lower bounds (``nd.bound`` / ``nd.refine_bound``): a pipeline replayed at
least durations.

The chain: the pipeline fill (chunk 0 of micro-batch 0 through the stages, each behind its
step-end parameter gathers, with the sends), each stage's own work, the drain and the
reductions after the last backward, then the gradient norm and the optimizer; a stage's body
is longer by what its reduce-scatters and step-end reductions must slow of its kernels
(:func:`_slowed_bodies`). The talking: per stage, its busiest stream and busiest link. Refined
(:func:`_nd_pipeline`), every stage's schedule is replayed against the others', pass by pass
and unit by unit. Why each holds: :class:`~hzpsim.strategies._bounds.BoundCache`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from hzpsim.hardware.placement import expert_placement
from hzpsim.hardware.topology import Topology
from hzpsim.strategies import _nd_layout as nd
from hzpsim.strategies import training_as_simulated
from hzpsim.strategies._bounds import (
    Bound,
    BoundCache,
    Costs,
    DPUnit,
    UnitCost,
    communicators_at_least,
    norm_s,
    persistent_norm_s,
    slowed,
    static_bytes,
    stream_sums,
    whole_buffer_s,
)
from hzpsim.strategies._layers import Work, optimizer_bytes_per_param
from hzpsim.strategies._sharded import Schedule


def _layout(bounder: BoundCache, cfg: Any, training) -> nd.Layout:
    table = bounder.table("nd.layout")
    key = (cfg, training.micro_batch_size, training.global_batch_size)
    if key not in table:
        table[key] = nd.layout(cfg, bounder.model, training, bounder.topology)
    return table[key]


def _last_action(bounder: BoundCache, p: int, v: int, m: int) -> tuple[str, int, int]:
    """The last action of every stage's pipeline schedule (the same on every stage, and with
    or without the combined 1F1B's extra warm-up forward)."""
    table = bounder.table("nd.last_action")
    key = (p, v, m)
    if key not in table:
        table[key] = nd.pipeline_actions(p, v, m, 0)[-1]
    return table[key]


def rendezvous_sizes(cfg: Any, n: int, dp: int, moe: bool, schedule: Schedule) -> tuple[int, ...]:
    """Every size of group whose collectives a rank of the layout waits at (a superset; the
    pipeline's sends are not rendezvous): TP, CP, EP and expert TP, the dense and expert
    data-parallel groups with the ZeRO sharding's parameter, gradient and optimizer groups and
    their replicas, a hierarchical gather's two hops and ZeRO++'s secondary group, and the
    world (the gradient norm). ``tests/test_search.py`` checks it against built graphs."""
    sizes = {n, cfg.tp, cfg.cp}
    groups = [dp * cfg.cp]
    if moe:
        sizes |= {cfg.ep, cfg.expert_tp}
        groups.append(n // (cfg.ep * cfg.expert_tp * cfg.pp))
    inner = schedule.hierarchical_gather
    for group in groups:
        sizes |= {group, schedule.backward_gather_size}
        for part in nd.sharding_sizes(cfg.sharding_stage, group):
            sizes |= {part, group // part}
            if inner > 1:
                sizes |= {inner, max(part // inner, 1)}
    return tuple(sorted(x for x in sizes if x > 1))


def nd_bound(bounder: BoundCache, cfg: Any, training, refine: bool = False, quick: bool = False) -> Bound:
    """The bounds of the ND layout ``cfg`` (``nd.bound``, and with ``refine`` ``nd.refine_bound``:
    the whole pipeline replayed too, what is too slow to compute for every candidate; with
    ``quick`` ``nd.quick_bound``: the same memory, and the talking window's step time without
    any data-parallel unit costed)."""
    topology = bounder.topology
    training = training_as_simulated(cfg, training, topology.device)  # as build runs it
    n = topology.num_devices
    deg = nd.dims(cfg)
    lay = _layout(bounder, cfg, training)
    p, v, m = cfg.pp, cfg.vpp, lay.num_micro_batches
    # the symmetric run charges stragglers' expectations when each simulated stage stands for
    # several devices (with one device per stage it draws them: no credit then)
    credit = n // p > 1
    costs = bounder.costs(training.precision, credit)
    sd = costs.slowdown
    opt_rate = optimizer_bytes_per_param(training)
    schedule = nd.schedule(cfg)
    unit_costs = bounder.units(training, deg, p, credit, rendezvous_sizes(cfg, n, lay.dp, bounder.model.moe is not None,
                                                                          schedule))
    pre = bounder.prefix(unit_costs)
    # units of each virtual stage, [lo, hi): the embedding on the first, the head on the last
    edges = [0]
    for count in lay.layers_per_virtual_stage:
        edges.append(edges[-1] + count)
    spans = [(0 if j == 0 else edges[j] + 1, len(unit_costs) if j == len(edges) - 2 else edges[j + 1] + 1)
             for j in range(len(edges) - 1)]

    def run_sum(attr: str, j: int) -> float:
        lo, hi = spans[j]
        column = pre[attr]
        return column[hi] - column[lo]

    fwd = [run_sum("forward_s", j) for j in range(len(spans))]
    bwd = [run_sum("backward_s", j) for j in range(len(spans))]
    comm = [run_sum("comm_s", j) for j in range(len(spans))]
    acts = [run_sum("activation_bytes", j) for j in range(len(spans))]
    dense_dp = lay.dp * cfg.cp
    sizes = nd.sharding_sizes(cfg.sharding_stage, dense_dp)
    ps, gs, os_ = sizes
    # expert parameters shard the same way over their expert-data-parallel group
    # (hardware.placement.expert_placement: n / (etp · ep · pp) ranks)
    moe = bounder.model.moe is not None
    expert_dp = n // (cfg.ep * cfg.expert_tp * p) if moe else 1
    expert_sizes = nd.sharding_sizes(cfg.sharding_stage, expert_dp)
    block = cfg.tp * cfg.cp * lay.dp
    if moe and expert_sizes != (1, 1, 1):
        # each stage's expert-data-parallel group (of its first rank: the group the simulated
        # rank's expert ShardedParams uses) and the units with their experts as their parameters
        placement = expert_placement(n, cfg.ep, cfg.expert_tp, p)
        expert_groups = [tuple(placement.group("edp", s * block)) for s in range(p)]
        expert_units = bounder.expert_units(unit_costs)
    last = _last_action(bounder, p, v, m)
    drains = last[1] == 0 and last[2] == m - 1  # every stage ends on chunk 0's last micro-batch
    wait_all = not schedule.effective_overlap_grad_reduce

    opt_lo, opt_up, early, work, talk, memory = [], [], [], [], [], 0.0
    heads, tails, exposed, windows = [], [], [], []
    for s in range(p):
        vstages = [c * p + s for c in range(v)]
        work.append(m * sum(fwd[j] + bwd[j] for j in vstages))
        talk.append(m * sum(comm[j] for j in vstages))
        dense = sum(run_sum("dense_params", j) for j in vstages)
        expert = sum(run_sum("expert_params", j) for j in vstages)
        # the stage's optimizers: at least the dense one's, at most (slowed, experts unsharded)
        opt_lo.append(costs.work_s(Work(bytes_accessed=dense / os_ * opt_rate)))
        opt_up.append((1 + sd) * costs.work_s(Work(bytes_accessed=(dense / os_ + expert) * opt_rate)))
        # the dense step-end gathers follow the dense optimizer, which ends before the experts'
        early.append((1 + sd) * costs.work_s(Work(bytes_accessed=expert * opt_rate)) if expert else 0.0)
        # forwards before the first backward (Megatron's warm-up, then one steady forward)
        warmup = min(p - s - 1, m) if v == 1 else min((p - s - 1) * 2 + (v - 1) * p, m * v)
        held = sum(acts[((k // p) % v) * p + s] for k in range(warmup + (1 if m * v > warmup else 0)))
        states = static_bytes(dense, sizes, training, schedule.implementation)
        if expert:
            states += static_bytes(expert, expert_sizes, training, schedule.implementation)
        memory = max(memory, states + held)
    max_up = max(opt_up)
    # the norm's straggler: the stages' compute ops since the previous norm (every other group
    # is smaller than the world, so no other rendezvous resets the stretch)
    groups = (cfg.tp, cfg.cp, dense_dp, cfg.ep, expert_dp)
    squares = 0.0
    if max(groups) < n:
        squares = max(m * sum(run_sum("kernels_sq", c * p + s) for c in range(v)) + opt_lo[s] ** 2 for s in range(p))
    norm = norm_s(costs, n, squares)
    # and the persistent slowness it waits for (each stage's kernels and least optimizer; the
    # pipeline's sends are not rendezvous, every other group lies within one stage)
    least = [m * sum(run_sum("kernels_s", c * p + s) for c in range(v)) + opt_lo[s] for s in range(p)]
    norm += persistent_norm_s(costs, n, max(*groups, 2), least)
    # the communicators every rank holds: the world's (the gradient norm), TP, CP, EP, the dense
    # and expert data-parallel groups, and at least one pipeline neighbour
    sizes_held = (n, cfg.tp, cfg.cp, cfg.ep if moe else 1, dense_dp, expert_dp if moe else 1)
    overhead = topology.device.communicator_bytes * communicators_at_least(sizes_held, 1 if p > 1 and n > 2 else 0)
    if quick:
        # the talking window below without its data-parallel terms: slowed(K, T, sd, E) >= K + E,
        # and heads, exposed >= 0
        critical = max(range(p), key=lambda s: (work[s] + 2 * opt_lo[s] - early[s], -s))
        q = work[critical] + 2 * opt_lo[critical] - early[critical] - max_up + norm
        return Bound(max(q, 0.0), work[critical], talk[critical], 0.0, memory, overhead_bytes=overhead, quick=True)

    # the chain: fill (chunk 0 of micro-batch 0 through the stages, each behind its own step-end
    # gathers), each stage's own work, drain (chunk 0 of the last micro-batch back), reductions
    ends: list[float] = []
    readies: list[list[float]] = []
    arrival = -math.inf
    stage_dp: list[list[DPUnit]] = []
    for s in range(p):
        lo, hi = spans[s]
        # the (dp, cp) group of stage s's first rank; ranks are placed tp, cp, dp, pp (tp fastest)
        dp_group = range(s * block, (s + 1) * block, cfg.tp)
        local = [(spans[c * p + s]) for c in range(v)]
        dpu = [d for a, b in local for d in bounder.dp_units(costs, unit_costs, a, b, sizes, dp_group, training, schedule)]
        if moe and expert_sizes != (1, 1, 1):  # the experts' own collectives (DPUnit.with_experts)
            edp = expert_groups[s]
            experts = [e for a, b in local for e in bounder.dp_units(costs, expert_units, a, b, expert_sizes, edp,
                                                                      training, schedule)]
            dpu = [d.with_experts(e) for d, e in zip(dpu, experts)]
        stage_dp.append(dpu)
        release = opt_lo[s]
        ready0 = release - early[s]
        all_gathered = ready0 + sum(d.step_ag for d in dpu)
        t = max(release, arrival)
        t_dp = t_ag = ready0
        stage_ready = [ready0] * len(dpu)  # when each local unit's parameters are ready
        for i, d in enumerate(dpu):
            if d.step_ag:
                t_dp += d.step_ag
                stage_ready[i] = t_dp
        if not schedule.overlap_param_gather:
            stage_ready = [all_gathered] * len(dpu)
        readies.append(stage_ready)
        t_dp = ready0
        for k in range(lo, hi):
            d = dpu[k - lo]
            ready = ready0
            if d.step_ag:
                t_dp = max(t_dp, ready) + d.step_ag
                ready = t_dp if schedule.overlap_param_gather else all_gathered
            if d.gather_fwd:
                t_ag = max(t_ag, ready) + d.gather_fwd
                ready = t_ag
            if k == lo:  # talking before the stage's first kernel (less what may precede the boundary)
                heads.append(max(0.0, d.step_ag + d.gather_fwd - early[s]))
            t = max(t, ready) + unit_costs[k].forward_s
        first_forward_end = t
        ends.append(first_forward_end + work[s] - fwd[s])  # the rest of the stage's work
        if s + 1 < p:
            arrival = first_forward_end + costs.send_s(unit_costs[hi - 1].p2p_bytes, s * block, (s + 1) * block)
    last_pass = [bwd[s] for s in range(p)]
    bodies = [e - last_pass[s] for s, e in enumerate(ends)]  # the last pass (chunk 0's) begins after the rest
    backs = [costs.send_s(unit_costs[spans[s + 1][0]].p2p_bytes, (s + 1) * block, s * block) for s in range(p - 1)]
    starts = _drain(bodies, last_pass, backs, drains)
    ends = [starts[s] + last_pass[s] for s in range(p)]
    readies_s: list[float] = []
    for s in range(p):
        lo, hi = spans[s]
        dpu = stage_dp[s]
        dp_group = range(s * block, (s + 1) * block, cfg.tp)
        z = ends[s]
        # chunk 0's units in the last backward (the stage's last action when ``drains``), in
        # reverse order from the pass's earliest start; their reductions, then the step-end ones
        # (which the dp stream runs last, after the other chunks' units)
        finals = []
        last_chain = 0.0
        if drains:
            at = starts[s]
            t_rs = -math.inf
            for k in range(hi - 1, lo - 1, -1):  # k = lo is the last backward
                d = dpu[k - lo]
                at += unit_costs[k].backward_s
                done = at
                if d.reduce:
                    t_rs = max(t_rs, done) + d.reduce
                    done = t_rs
                t_rs += d.expert_reduce  # after the dense one, on the same stream
                finals.append((k, done, d))
            d = dpu[0]
            last_chain = d.reduce + d.step_rs + d.replica_ar
        t_dp = -math.inf
        ready = z
        whole = whole_buffer_s(costs, sum(unit_costs[k].dense_params for a, b in
                                           [spans[c * p + s] for c in range(v)] for k in range(a, b)),
                                sizes, dp_group, training, schedule)
        if whole is not None:
            after = [f for _, f, _ in finals] + ([z] if drains or wait_all else [])
            if after:
                ready = max(ready, max(after) + whole)
            last_chain = dpu[0].reduce + whole if drains else 0.0
        else:
            for _, done, d in finals:  # descending unit index: the order the dp stream reduces them
                if d.step_rs:
                    t_dp = max(t_dp, done, z if wait_all else -math.inf) + d.step_rs
                    done = t_dp
                if d.replica_ar:
                    t_dp = max(t_dp, done, z if wait_all else -math.inf) + d.replica_ar
                    done = t_dp
                ready = max(ready, done)
        tails.append(ready - z)
        readies_s.append(ready)
        exposed.append(last_chain)
    norm_ready = max(readies_s)
    if sd > 0:
        # talking slows the kernels it overlaps (see _slowed_bodies): the bodies end later
        after = [readies_s[s] - starts[s] for s in range(p)]  # from the last pass's start to the norm
        later = _slowed_bodies(bounder, costs, unit_costs, spans, p, v, m, stage_dp, work, after, last_pass, backs,
                               drains, sizes, block, cfg.tp, training, schedule)
        if any(later):
            moved = _drain([b + x for b, x in zip(bodies, later)], last_pass, backs, drains)
            norm_ready = max(norm_ready, max(moved[s] + after[s] for s in range(p)))
    if refine:
        wholes = [whole_buffer_s(costs, sum(unit_costs[k].dense_params for c in range(v) for k in range(*spans[c * p + s])),
                                  sizes, range(s * block, (s + 1) * block, cfg.tp), training, schedule) for s in range(p)]
        # the first step-end reduction's straggler (_nd_pipeline), when its group is the
        # largest the stage meets after the previous optimizer's step-end gathers
        group = os_ // gs if os_ > gs else dense_dp // os_
        others = (cfg.tp, cfg.cp, cfg.ep if moe else 1, gs, ps)
        first_late = costs.late(group) if group > 1 and max(others) < group and not moe else 0.0
        piped = _nd_pipeline(costs, unit_costs, spans, p, v, m, block,
                             lambda s: nd.pipeline_actions(p, v, m, s, deg.moe_ep_overlap), stage_dp,
                             readies, opt_lo, wholes, schedule, first_late, os_ > ps,
                             _host_ahead(unit_costs, spans, p, v, m, training, topology, schedule, sizes, moe or cfg.cp > 1))
        norm_ready = max(norm_ready, piped)
    chain = norm_ready + norm + max(opt_lo) - max_up
    critical = max(range(p), key=lambda s: (ends[s] + tails[s], -s))

    # the talking: per stage, within its own window (from its step-end gathers to its optimizer);
    # kept unsharded across micro-batches, a unit gathers and reduces once per step
    per_step = schedule.per_step(m)
    for s in range(p):
        dpu = stage_dp[s]
        vstages = [c * p + s for c in range(v)]
        dp_group = range(s * block, (s + 1) * block, cfg.tp)
        params = tuple(unit_costs[u].dense_params for j in vstages for u in range(*spans[j]))
        plain = Schedule(reshard_after_forward=schedule.reshard_after_forward,
                         accumulate_unsharded=schedule.accumulate_unsharded)
        demand = dict(bounder.sharded_demand(costs, params, m, sizes, dp_group, training, plain))
        for level in pre["levels"]:
            lb = sum(run_sum("link." + level, j) for j in vstages)
            if lb:
                demand[level] = demand.get(level, 0.0) + m * lb
        whole = whole_buffer_s(costs, sum(params), sizes, dp_group, training, schedule)
        if moe and expert_sizes != (1, 1, 1):  # the experts' (their step-end gather left out, as the dense one's)
            expert_params = tuple(unit_costs[u].expert_params for j in vstages for u in range(*spans[j]))
            for level, b in bounder.sharded_demand(costs, expert_params, m, expert_sizes, expert_groups[s],
                                                   training, plain).items():
                demand[level] = demand.get(level, 0.0) + b
        streams = {
            "ag": per_step * sum(d.gather_fwd + d.gather_bwd for d in dpu),
            "rs": per_step * sum(d.reduce + d.expert_reduce for d in dpu),
            "dp": sum(d.step_ag + d.expert_step for d in dpu)
            + (whole if whole is not None else sum(d.step_rs + d.replica_ar for d in dpu)),
        }
        talking = max(costs.link_s(demand), stream_sums(schedule, streams))
        non_overlapping = talk[s] + norm + heads[s] + exposed[s]
        kernels = work[s] - talk[s] + opt_lo[s]
        windows.append(slowed(kernels, talking, sd, non_overlapping) - (max_up - opt_lo[s] + early[s]))
    window = max(windows)
    step = max(chain, window, 0.0)
    w, tk = work[critical], talk[critical]
    exp = tails[critical] + norm + heads[critical]
    return Bound(step, w, tk, max(0.0, chain - w - exp), memory, window, window > chain, exp, overhead)


def _drain(bodies: list[float], last_pass: list[float], backs: list[float], drains: bool) -> list[float]:
    """When each stage's last pass can start: after the rest of its work (``bodies``) and, when
    every stage ends on chunk 0's last micro-batch (``drains``), after the next stage's last
    pass and the send of its gradient (``backs[s]``: stage s + 1 to s)."""
    starts = list(bodies)
    if drains:
        for s in range(len(starts) - 2, -1, -1):
            starts[s] = max(starts[s], starts[s + 1] + last_pass[s + 1] + backs[s])
    return starts


def _slowed_bodies(bounder: BoundCache, costs: Costs, unit_costs: list[UnitCost], spans: list[tuple[int, int]],
                   p: int, v: int, m: int, stage_dp: list[list[DPUnit]], work: list[float], after: list[float],
                   last_pass: list[float], backs: list[float], drains: bool, sizes: tuple[int, int, int],
                   block: int, tp: int, training, schedule: Schedule) -> list[float]:
    """How much later each stage's body (its passes after the first forward and before the last
    one) ends than the chain says, because kernels run 1/(1 + slowdown) as fast while the rank
    talks (``Engine._talk``: any collective it sends in is in flight).

    Stage j's body of length L holds kernels K (at full rate: K_fast + K_slow/(1 + sd) = K),
    non-kernel time Y >= N (compute-stream collectives, straggler waits, idle; N the chain's)
    and the rank talks for T of it: the slowed kernel time K_slow >= T - Y, so
    L = K + Y + K_slow·sd/(1 + sd) >= K + N + sd/(1 + sd)·max(0, T - N) (increasing in Y).
    A communication stream whose ops all start after the body starts (a backward's gradient
    reduce-scatters; the step-end reductions) and all end before the gradient norm starts
    (which waits for them) is busy at least R in the step; of that, x falls after the body's
    end, and the norm cannot start before the body's end + x, nor before the body's end + D
    (D: the chain's longest path from there to the norm: this stage's last pass, the drain
    through the stages before it, their reductions). So T >= R - x, and the norm starts at
    least at body end + sd'·max(0, R - x - N) + max(D, x), whose least value over x is
    D + sd'·max(0, R - N - D) (sd' = sd/(1 + sd)): the body ends sd'·max(0, R - N - D) later,
    whatever x is. The bound takes the busiest such stream."""
    sdp = costs.slowdown / (1 + costs.slowdown)
    pre = bounder.prefix(unit_costs)
    # D: the longest path from a body's end to the norm (the last passes drain down the stages)
    longest: list[float] = []
    for j in range(p):
        d = after[j]
        if drains and j > 0:
            d = max(d, last_pass[j] + backs[j - 1] + longest[j - 1])
        longest.append(d)
    out = []
    for j in range(p):
        dpu = stage_dp[j]
        dp_group = range(j * block, (j + 1) * block, tp)
        kernels = sum(pre["kernels_s"][b] - pre["kernels_s"][a] for a, b in (spans[c * p + j] for c in range(v)))
        # the body's non-kernel time, at most all passes' (a larger N only lowers the bound)
        non_kernel = work[j] - m * kernels
        whole = whole_buffer_s(costs, sum(unit_costs[k].dense_params for c in range(v)
                                           for k in range(*spans[c * p + j])), sizes, dp_group, training, schedule)
        busy: dict[str, float] = {}
        # kept unsharded, the one reduction per step starts after the body
        for role, seconds in (("rs", schedule.per_step(m) * sum(d.reduce + d.expert_reduce for d in dpu)),
                              ("dp", sum(d.expert_step for d in dpu)
                               + (whole if whole is not None else sum(d.step_rs + d.replica_ar for d in dpu)))):
            name = schedule.stream(role)
            busy[name] = busy.get(name, 0.0) + seconds
        talking = max(busy.values(), default=0.0)
        out.append(sdp * max(0.0, talking - non_kernel - longest[j]))
    return out


def _host_ahead(unit_costs: list[UnitCost], spans: list[tuple[int, int]], p: int, v: int, m: int, training,
                topology: Topology, schedule: Schedule, sizes: tuple[int, int, int], other_calls: bool) -> bool:
    """Whether every host op of the reported step has ended before the step begins, so that no
    device op of it waits for its launch or call (the step-end reductions are called after the
    step's last launch).

    Without synchronisations (no ``sync_*`` of the implementation, asynchronous kernels, calls
    paid by the training thread) a rank's host ops depend on nothing but each other: the host
    thread runs them back to back from time 0, and the ops of steps 0 .. k end by (k + 1) x its
    time per step. Step k begins after every stage ran step k - 1's kernels, at least k x the
    largest stage's kernel time. A step's host ops are the launches of its compute ops
    (``Implementation.launch_s`` of their kernels, with the TP calls that follow them) and the
    calls of its data-parallel collectives and gradient norm; each call costs at most
    ``call_host_s(1, n)``. Left undecided (False) with parameter gathers, CP or EP calls."""
    impl = schedule.implementation.on_device(topology.device)
    if not impl.host:
        return True
    if (impl.synchronous or impl.sync_before_gather or impl.sync_after_reduce or impl.sync_after_p2p
            or impl.calls_from_comm_threads or sizes[0] > 1 or other_calls):
        return False
    per_call = impl.call_host_s(1, topology.num_devices)
    host = kernels = 0.0
    for s in range(p):
        local = [unit_costs[k] for c in range(v) for k in range(*spans[c * p + s])]
        reduce_calls = sum(max(impl.reduce_calls(u.tensors), 1) for u in local if u.dense_params > 0)
        calls = m * sum(u.tp_calls for u in local) + (m if sizes[1] > 1 else 0) * reduce_calls + 3 * reduce_calls + 3
        host = max(host, impl.launch_s(m * sum(u.launches for u in local)) + per_call * calls)
        kernels = max(kernels, m * sum(u.kernels_s for u in local))
    steps = training.num_steps
    return steps * host <= (steps - 1) * kernels


def _nd_pipeline(costs: Costs, unit_costs: list[UnitCost], spans: list[tuple[int, int]], p: int, v: int, m: int,
                 block: int, actions: Callable[[int], list[tuple[str, int, int]]], stage_dp: list[list[DPUnit]],
                 readies: list[list[float]], release: list[float], wholes: list[float | None], schedule: Schedule,
                 first_late: float = 0.0, step_gathers: bool = False, host_ahead: bool = False) -> float:
    """When the norm can start at the earliest, by the whole pipeline replayed: every stage's
    schedule (``nd.pipeline_actions``), pass by pass and unit by unit, each op at its least
    duration after its dependencies (the previous op of its stream, the activation or gradient
    sent point to point by the neighbouring virtual stage, the parameters' gathers and prefetch
    ring, the gradient-buffer ring of the reduce-scatters, the step-end reductions as each
    unit's last backward ends). Every real time is at least the replayed one: the engine's ops
    wait for the same dependencies (and more), take at least these durations, and each op's end
    only grows with the times it depends on.

    Talking slows kernels (``Engine._talk``). A communication stream whose op was started by an
    earlier op of the compute stream (a reduce-scatter after a backward, a step-end reduction,
    a point-to-point send, the step-end gathers after the previous optimizer) stays busy from
    that op's end until the stream's last issued op ends: every queued op's dependencies are
    done by then, and so is its host call, issued before the launch of the kernel that follows
    (the step-end reductions are called after the step's last launch: they count only when the
    host thread is provably ahead). Not counted: a stream shared with another role, or one
    whose calls are paid on the stream itself (both leave gaps without talking).
    A pass that is one compute op then collectives, starting at s before that busy end
    b, runs its kernels 1/(1 + slowdown) as fast until b: it ends at least
    s + d + sd/(1 + sd)·min(b - s, (1 + sd)·d), which only grows with s and b. (A merged op of
    several units is slowed at least as much: the replay's collectives between the units only
    take window time away from its kernels.)

    ``host_ahead``: see :func:`_host_ahead`.

    ``first_late``: the stage's first step-end reduction rendezvouses a group larger than any
    other of the step since the previous optimizer's step-end gathers, so it starts late by
    ``first_late`` · W, W² at least the sum of the squared least durations of the compute ops
    that ended since the last of those gathers (when ``step_gathers``, from the first forward
    of the unit gathered last, which waits for it; see :func:`norm_s`)."""
    depth, slots = schedule.effective_prefetch_depth, schedule.reduce_buffers
    reshard = schedule.reshard_after_forward
    # kept unsharded across micro-batches: the step's first forward gathers, and no reduction
    # runs before the step-end one (not counted here: a lower bound)
    accumulate = schedule.accumulate_unsharded
    wait_all = not schedule.effective_overlap_grad_reduce
    sd = costs.slowdown
    sdp = sd / (1 + sd)
    # which streams' busy spells are talking from a kernel's start to their end (see above)
    impl = schedule.implementation
    exclusive = {role: sum(schedule.stream(r) == schedule.stream(role) for r in ("ag", "rs", "dp")) == 1
                 for role in ("rs", "dp")}
    paid_on_stream = impl.host and impl.calls_from_comm_threads  # call ops, not talking, on the stream
    rs_talks = exclusive["rs"] and not paid_on_stream
    dp_talks = exclusive["dp"] and not paid_on_stream
    # the step-end reductions are issued after the step's last launch: only without a host
    # thread, or with one provably ahead of the device (_host_ahead), are they started when
    # their units' last backward ends
    reductions_talk = dp_talks and (not impl.host or host_ahead)
    last_vs = p * v - 1
    # per stage: compute stream (free at t), its streams
    t = list(release)
    t_ag = [-math.inf] * p
    t_rs = [-math.inf] * p
    t_fwd = [-math.inf] * p  # pp_fwd send stream
    t_bwd = [-math.inf] * p
    # the dp stream: the previous optimizer's step-end gathers, then the reductions
    t_dp = [max(r, default=-math.inf) for r in readies]
    gathers_end = list(t_dp)
    consumed: list[list[float]] = [[] for _ in range(p)]
    scatters: list[list[float]] = [[] for _ in range(p)]
    final: list[list[float]] = [[-math.inf] * len(stage_dp[s]) for s in range(p)]
    reduced = [-math.inf] * p  # when the stage's step-end reductions issued so far end
    next_reduce = [len(stage_dp[s]) - 1 for s in range(p)]  # reduce_step's order: descending unit index
    squares = [0.0] * p
    counting = [not step_gathers or not any(d.step_ag for d in stage_dp[s]) for s in range(p)]
    late_paid = [not first_late] * p
    inline = not wait_all and all(w is None for w in wholes)
    offsets = []
    for s in range(p):
        offset = [0]
        for c in range(v):
            lo, hi = spans[c * p + s]
            offset.append(offset[-1] + hi - lo)
        offsets.append(offset)
    plans = [actions(s) for s in range(p)]
    position = [0] * p
    sent: dict[tuple[str, int, int], float] = {}  # (direction, virtual stage, micro-batch) -> arrival
    sends: dict[tuple[int, int, float], float] = {}

    def send_s(src: int, dst: int, size: float) -> float:
        key = (src, dst, size)
        if key not in sends:
            sends[key] = costs.send_s(size, src * block, dst * block)
        return sends[key]

    def reduce(s: int) -> None:
        """Issue the stage's step-end reductions whose turn has come (their units' last
        backward done), in the dp stream's order."""
        dpu = stage_dp[s]
        while next_reduce[s] >= 0 and final[s][next_reduce[s]] > -math.inf:
            i = next_reduce[s]
            done = final[s][i]
            for seconds in (dpu[i].step_rs, dpu[i].replica_ar):
                if seconds:
                    if not late_paid[s]:
                        seconds += first_late * math.sqrt(squares[s])
                        late_paid[s] = True
                    t_dp[s] = max(t_dp[s], done) + seconds
                    done = t_dp[s]
            reduced[s] = max(reduced[s], done)
            next_reduce[s] -= 1

    pending = True
    while pending:
        pending = progressed = False
        for s in range(p):
            plan, dpu, params_ready, offset = plans[s], stage_dp[s], readies[s], offsets[s]
            # the unit whose step-end gather the dp stream runs last
            top = max((i for i, d in enumerate(dpu) if d.step_ag), default=-1)
            while position[s] < len(plan):
                kind, c, mb = plan[position[s]]
                vs = c * p + s
                forward = kind == "F"
                if forward:
                    key = ("F", vs - 1, mb)
                    if vs > 0 and key not in sent:
                        break
                else:
                    key = ("B", vs + 1, mb)
                    if vs < last_vs and key not in sent:
                        break
                incoming = sent.pop(key, -math.inf)
                lo, hi = spans[vs]
                now = max(t[s], incoming)  # the pass's first unit waits for its input
                order = range(lo, hi) if forward else range(hi - 1, lo - 1, -1)
                for k in order:
                    i = offset[c] + k - lo
                    d, uc = dpu[i], unit_costs[k]
                    start = now
                    gathered = bool(d.gather_fwd and (mb == 0 or not accumulate)) if forward \
                        else bool(d.gather_bwd and reshard)
                    if gathered:
                        slot = len(consumed[s]) - depth - 1
                        t_ag[s] = max(t_ag[s], params_ready[i], consumed[s][slot] if slot >= 0 else -math.inf) + (
                            d.gather_fwd if forward else d.gather_bwd)
                        start = max(start, t_ag[s])
                    elif forward and mb == 0:
                        start = max(start, params_ready[i])
                    reduces = d.reduce and not accumulate
                    if not forward and reduces and len(scatters[s]) >= slots:
                        start = max(start, scatters[s][-slots])
                    if forward:
                        seconds, kernel = uc.forward_s, uc.forward_kernel_s
                    else:
                        seconds, kernel = uc.backward_s, uc.backward_kernel_s
                    if sd and kernel:
                        busy = max(t_rs[s] if rs_talks else -math.inf, gathers_end[s] if dp_talks else -math.inf,
                                   t_dp[s] if reductions_talk else -math.inf, t_fwd[s], t_bwd[s])
                        if busy > start:
                            seconds += sdp * min(busy - start, (1 + sd) * kernel)
                    now = start + seconds
                    if counting[s]:
                        squares[s] += uc.forward_sq if forward else uc.kernels_sq - uc.forward_sq
                    elif forward and mb == 0 and i == top:
                        counting[s] = True
                        squares[s] += uc.forward_sq
                    if gathered:
                        consumed[s].append(now)
                    if not forward:
                        done = now
                        if reduces:
                            t_rs[s] = max(t_rs[s], now) + d.reduce
                            scatters[s].append(t_rs[s])
                            done = t_rs[s]
                            t_rs[s] += d.expert_reduce  # after the dense one, on the same stream
                        if mb == m - 1:
                            final[s][i] = done
                            if inline:
                                reduce(s)
                t[s] = now
                if forward and vs < last_vs:
                    dst = (s + 1) % p
                    t_fwd[s] = max(t_fwd[s], now) + send_s(s, dst, unit_costs[hi - 1].p2p_bytes)
                    sent[("F", vs, mb)] = t_fwd[s]
                elif not forward and vs > 0:
                    dst = (s - 1) % p
                    t_bwd[s] = max(t_bwd[s], now) + send_s(s, dst, unit_costs[lo].p2p_bytes)
                    sent[("B", vs, mb)] = t_bwd[s]
                position[s] += 1
                progressed = True
            pending |= position[s] < len(plan)
        assert progressed or not pending, "pipeline replay deadlocked"
    out = -math.inf
    for s in range(p):
        dpu = stage_dp[s]
        end = t[s]
        ready = max(end, *final[s], reduced[s])
        whole = wholes[s]
        if whole is not None:
            ready = max(ready, max(t_dp[s], end if wait_all else -math.inf, *final[s]) + whole)
        elif not inline:
            for i in range(next_reduce[s], -1, -1):  # descending unit index, as reduce_step issues them
                done = final[s][i]
                for seconds in (dpu[i].step_rs, dpu[i].replica_ar):
                    if seconds:
                        t_dp[s] = max(t_dp[s], done, end if wait_all else -math.inf) + seconds
                        done = t_dp[s]
                ready = max(ready, done)
        out = max(out, ready)
    return out
