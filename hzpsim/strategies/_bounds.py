"""Lower bounds on what the simulator reports, shared by the strategies' ``bound`` hooks.

The search (``hzpsim search``) prunes a candidate by two analytic bounds, computed without
building a graph: a lower bound on peak memory and one on step time (:class:`Bound`). A strategy
plugin computes them in its ``bound`` hook (``_family_bound`` for the ZeRO family, ``_nd_bound``
for ND) from the pieces here:

- :class:`Costs`: the least seconds of kernels and collectives, from the same public cost
  functions the engine uses (``hardware.compute.ComputeModel``, ``hardware.collectives.
  CollectiveModel``, ``hardware.variability.expected_max_excess``);
- :class:`UnitCost` / :func:`unit_costs_of`: each unit's forward and backward on the compute
  stream (kernels, TP/EP collectives and the straggler waits the engine charges);
- :class:`DPUnit` / :func:`dp_units_of`: each unit's data-parallel collectives
  (``_sharded.ShardedParams``) in the calls its implementation issues;
- :func:`add_sharded_demand`, :func:`whole_buffer_s`, :func:`stream_sums`, :func:`slowed`,
  :func:`norm_s`, :func:`static_bytes`: link bytes, the whole-buffer reduction, the busiest
  stream, what talking slows of the kernels, the gradient norm, resident model states;
- :class:`BoundCache`: all of the above cached across the candidates of one scenario.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from hzpsim.hardware.collectives import CollectiveModel
from hzpsim.hardware.compute import ComputeModel
from hzpsim.hardware.placement import expert_placement
from hzpsim.hardware.topology import Topology
from hzpsim.hardware.variability import expected_max_excess
from hzpsim.model import Model
from hzpsim.model.kernels import Gemm
from hzpsim.strategies._dims import ParallelDims
from hzpsim.strategies._implementations import Implementation
from hzpsim.strategies._layers import Work
from hzpsim.strategies._moe import BACKWARD_KIND
from hzpsim.strategies._mp_units import MPUnit, mp_units
from hzpsim.strategies._sharded import NestedSharding, Schedule


@dataclass(frozen=True)
class Bound:
    """Lower bounds of what the simulator would report for one candidate (all zero: no bound)."""

    step_time_s: float = 0.0  # <= simulated step_time_s
    compute_s: float = 0.0  # critical rank's compute-stream work: kernels at best-case rates, TP/EP collectives
    comm_s: float = 0.0  # of which: collectives on the compute stream (TP, EP) and the stragglers they wait for
    bubble_s: float = 0.0  # pipeline fill and drain the critical stage cannot avoid
    memory_bytes: float = 0.0  # <= simulated peak_memory_bytes
    link_s: float = 0.0  # least talking time: busiest link's bytes at full rate, or busiest communication stream
    link_limited: bool = False  # the talking term, not the compute-stream chain, set step_time_s
    exposed_s: float = 0.0  # data-parallel gathers before the first forward, reductions after the last backward
    # device memory outside PyTorch's allocator the layout certainly holds beyond the driver's
    # context: NCCL communicators (communicators_at_least), which fits_in_memory counts too
    overhead_bytes: float = 0.0
    # a plugin's quick_bound: the ranks' own work only (search.bounding.LEVELS), which cannot
    # tell a bubble or exposed data-parallel talking from the work
    quick: bool = False

    @property
    def limited_by(self) -> str:
        """What makes this candidate slow, by its bound."""
        if self.quick:
            return "its work alone (kernels, TP/EP exchanges, optimizer; quick bound)"
        if self.link_limited:
            return "communication (bytes on the links)"
        if self.bubble_s > max(self.comm_s, self.exposed_s) and self.bubble_s > 0.02 * self.step_time_s:
            return "pipeline bubble"
        if self.comm_s >= self.exposed_s and self.comm_s > 0.02 * self.step_time_s:
            return "exposed TP/EP communication"
        if self.exposed_s > 0.02 * self.step_time_s:
            return "exposed data-parallel communication"
        return "more compute (recompute, imbalance, optimizer)"


class Costs:
    """Least seconds of kernels and collectives on one topology and precision.

    Kernels: :meth:`ComputeModel.duration_s` of a stand-in op carrying the work's kernel shapes
    (GEMMs and attention) and HBM bytes: exactly the time the simulator charges an op of that
    work (it times an op by its shapes, and a shape's time is linear in its calls, so the
    units' parts add up to the simulator's merged ops). Without shapes, the FLOP totals at the
    large-GEMM rate, which no shape beats, and attention FLOPs at the device's dense peak,
    which no kernel exceeds. Collectives: NCCL's isolated time (``CollectiveModel.plan``);
    with ``variability`` credited, a rendezvous also starts late (``late``)."""

    def __init__(self, topology: Topology, precision: str, variability: bool) -> None:
        self.topology = topology
        self.compute = ComputeModel(topology.device, precision)
        self.collectives = CollectiveModel(topology)
        self.slowdown = self.compute.efficiency.comm_overlap_slowdown
        self.cv = float(topology.spec.variability) if variability else 0.0
        self.cv_persistent = float(topology.spec.variability_persistent) if variability else 0.0
        self._spans: dict[Any, Any] = {}
        self._work: dict[Any, float] = {}

    def work_s(self, work: Work) -> float:
        key = (work.gemm, work.attention_forward, work.attention_backward, work.bytes_accessed, work.shapes)
        seconds = self._work.get(key)
        if seconds is None:
            seconds = None
            if work.shapes:  # exactly the time the simulator gives an op of these shapes and bytes
                op = SimpleNamespace(duration_s=0.0, flops=(), bytes_accessed=work.bytes_accessed, shapes=work.shapes)
                try:
                    seconds = self.compute.duration_s(op)  # type: ignore[arg-type]
                except ValueError:  # an attention kernel the device cannot run: the GEMMs only, below
                    seconds = None
            if seconds is None:
                gemms = tuple(s for s in work.shapes if isinstance(s, Gemm))
                if gemms:  # the GEMMs at exactly the time the simulator gives their shapes
                    op = SimpleNamespace(duration_s=0.0, flops=(), bytes_accessed=work.bytes_accessed, shapes=gemms)
                else:  # FLOP totals only: the large-GEMM rate, which no shape beats
                    op = SimpleNamespace(duration_s=0.0, flops=(("gemm", work.gemm),) if work.gemm else (),
                                         bytes_accessed=work.bytes_accessed, shapes=())
                seconds = self.compute.duration_s(op)  # type: ignore[arg-type]
                # attention FLOPs at the dense peak, which no kernel exceeds
                seconds += (work.attention_forward + work.attention_backward) / self.compute.peak_flops_per_s
            self._work[key] = seconds
        return seconds

    def late(self, group_size: int, rendezvous: tuple[int, ...] | None = None) -> float:
        """A rendezvous of ``group_size`` ranks starts at least this many seconds late per second
        of device work its ranks did since their previous rendezvous (the symmetric run's
        expectation): the noise's cv·E[max], and, given ``rendezvous`` (every group size the
        ranks meet), the persistent slowness's cv_p·(E[max of the group] - E[max of the
        largest smaller group]) (``persistent_norm_s``: the waits at smaller groups since the
        group last met add up to at most cv_p·E of the largest of them, times the work since)."""
        if group_size <= 1:
            return 0.0
        seconds = self.cv * expected_max_excess(group_size) if self.cv else 0.0
        if rendezvous is not None:
            seconds += self.persistent(group_size, max((g for g in rendezvous if g < group_size), default=1))
        return seconds

    def persistent(self, group_size: int, smaller: int) -> float:
        """cv_p·(E[max of ``group_size``] - E[max of ``smaller``]): the least persistent wait of
        a rendezvous per second of work since its group last met, when no group between the two
        sizes is met (:func:`persistent_norm_s`)."""
        if not self.cv_persistent or smaller >= group_size:
            return 0.0
        return self.cv_persistent * (expected_max_excess(group_size) - expected_max_excess(smaller))

    def collective_s(self, kind: str, size: float, ranks: Sequence[int], count: int = 1) -> float:
        if not count or size <= 0 or len(ranks) < 2:
            return 0.0
        return self.collectives.plan(kind, size, self._span(ranks)).isolated_time_s * count

    def send_s(self, size: float, src: int, dst: int) -> float:
        """A point-to-point send (never stretched: a stage already waits for its neighbour)."""
        if size <= 0 or src == dst:
            return 0.0
        plan = self.collectives.plan("send_recv", size, self._span((src, dst)), self.topology.level_between(src, dst))
        return plan.isolated_time_s

    def _span(self, ranks: Sequence[int]):
        key = ranks if isinstance(ranks, range) else tuple(ranks)
        span = self._spans.get(key)
        if span is None:
            span = self._spans[key] = self.topology.span(key)
        return span

    def add_demand(self, demand: dict[str, float], kind: str, size: float, ranks: Sequence[int],
                   count: float = 1) -> None:
        """Add the bytes a collective puts on each of a rank's links (per level)."""
        if not count or size <= 0 or len(ranks) < 2:
            return
        for level, b in self.collectives.plan(kind, size, self._span(ranks)).demand_by_level.items():
            demand[level] = demand.get(level, 0.0) + b * count

    def link_s(self, demand: dict[str, float]) -> float:
        """Least time a rank's links need to carry ``demand`` (each level at its full rate)."""
        return max((b / self.topology.link(level).achieved_bytes_per_s for level, b in demand.items()), default=0.0)


@dataclass(frozen=True)
class UnitCost:
    forward_s: float  # compute-stream time of one micro-batch's forward: kernels, TP/EP collectives, waits
    backward_s: float
    comm_s: float  # forward + backward compute-stream collectives and the stragglers they wait for
    activation_bytes: float
    dense_params: float
    expert_params: float
    link_bytes: tuple[tuple[str, float], ...] = ()  # per micro-batch, by level: TP/EP bytes (fwd + bwd)
    p2p_bytes: float = 0.0  # activation handed to the next pipeline stage
    tensors: tuple[float, ...] = ()  # dense parameter tensors (the implementation's collective calls)
    kernels_s: float = 0.0  # of forward_s + backward_s: the kernels alone (what talking slows)
    kernels_sq: float = 0.0  # sum of the squares of the unit's compute ops' least durations (fwd + bwd)
    forward_sq: float = 0.0  # of which the forward's
    # a pass that is one compute op, then collectives only (no CP, no EP): its kernel time
    # (0: the pass is not one op and gets no slowdown in _nd_pipeline)
    forward_kernel_s: float = 0.0
    backward_kernel_s: float = 0.0
    launches: float = 0.0  # kernels its forward and backward launch (MPUnit.kernels_*)
    tp_calls: int = 0  # TP collective calls of its forward and backward (the logits' gather counted)
    expert_tensors: tuple[float, ...] = ()  # its local experts' parameter tensors (MPUnit.expert_tensors)

    def experts_as_dense(self) -> UnitCost:
        """This unit with its expert parameters in place of its dense ones (their data-parallel
        collectives priced by :func:`dp_units_of` over the expert-data-parallel group)."""
        return dataclasses.replace(self, dense_params=self.expert_params,
                                   tensors=self.expert_tensors or (self.expert_params,))


def unit_costs_of(costs: Costs, units: Sequence[MPUnit], deg: ParallelDims, n: int, pp: int,
                  attention_keys: tuple[float, float] | None = None,
                  rendezvous: tuple[int, ...] | None = None) -> list[UnitCost]:
    """Each unit's forward and backward on the compute stream. A TP or EP collective that
    directly follows a compute op rendezvouses with a stretch of device work at least that op
    long behind it, so it starts ``late(group)`` × that op's time late (``Stragglers.delay_s``:
    W >= the last stretch); one that follows another collective is charged no wait. The kernel
    after it does not wait for that straggler again: the stream waited for it in the collective
    (``Engine._stream``). ``attention_keys`` = (seq_len,
    tokens): the attention priced over documents of ``tokens`` mean length, the least any
    micro-batch of variable-length sequences attends over (:func:`least_attention_keys`).
    ``rendezvous``: every group size the ranks meet (a superset), which lets the persistent
    slowness count too (:meth:`Costs.late`); None leaves it out."""
    tp_ranks = range(deg.tp)
    ep_ranks = list(expert_placement(n, deg.ep, deg.etp, pp).group("ep", 0)) if deg.ep > 1 else []
    late_tp = costs.late(deg.tp, rendezvous)
    out = []
    for u in units:
        w = costs.work_s if attention_keys is None else (lambda work: costs.work_s(work.packed(*attention_keys)))
        exposed = 1 - deg.tp_comm_overlap
        tp_f = sum(costs.collective_s(k, b * exposed, tp_ranks, c) for k, c, b in u.tp_calls(True))
        tp_b = sum(costs.collective_s(k, b * exposed, tp_ranks, c) for k, c, b in u.tp_calls(False))
        pre, remote, post, back, back_remote = (w(u.pre), w(u.remote), w(u.post), w(u.backward),
                                                w(u.backward_remote))
        cp = bool(u.cp_bytes)
        wait_tp_f = late_tp if tp_f else 0.0
        wait_tp_b = late_tp if tp_b else 0.0
        moe_f = moe_b = moe_sq = 0.0
        x_f = x_b = 0.0  # the MoE layer's exchanges, forward and backward (_model_parallel.UnitEmitter._ep)
        demand: dict[str, float] = {}
        if u.moe is not None:
            parts_f = [w(x) for x in (u.moe.router, u.moe.permute, u.moe.experts, u.moe.unpermute)]
            parts_b = [w(x) for x in (u.moe.router_backward, u.moe.permute_backward, u.moe.experts_backward,
                                      u.moe.unpermute_backward)]
            moe_f, moe_b, moe_sq = sum(parts_f), sum(parts_b), sum(x * x for x in parts_f + parts_b)
            if u.ep_bytes:
                forward_kinds = list(u.ep_kinds)
                backward_kinds = [BACKWARD_KIND[k] for k in u.ep_kinds] + (forward_kinds if u.ep_recomputed else [])
                x_f = sum(costs.collective_s(k, u.ep_bytes, ep_ranks) for k in forward_kinds)
                x_b = sum(costs.collective_s(k, u.ep_bytes, ep_ranks) for k in backward_kinds)
                for k in forward_kinds + backward_kinds:
                    costs.add_demand(demand, k, u.ep_bytes, ep_ranks, 1)
        if u.moe is not None:  # attention (TP after it), then the MoE ops around the exchanges
            # the TP collective after the attention block starts late
            wait_f = wait_tp_f * (remote if cp else pre)
            wait_b = wait_tp_b * (back_remote if cp else back)
            if u.ep_bytes and not deg.moe_ep_overlap and deg.etp == 1:
                # on the compute stream the dispatch follows the permute and the combine the
                # grouped GEMM, the backward's dispatch exchange the GEMMs' backward: each starts
                # late by at least that op's stretch (the backward's combine exchange and the
                # full recompute's follow other ops or a collective: not counted)
                late_ep = costs.late(deg.ep, rendezvous)
                wait_f += late_ep * (parts_f[1] + parts_f[2])
                wait_b += late_ep * parts_b[2]
        elif not cp:  # one compute op, then the TP all-reduces
            wait_f = wait_tp_f * (pre + post)
            wait_b = wait_tp_b * back
        else:  # context parallel: the TP all-reduces follow the MLP (or the remote attention)
            wait_f = wait_tp_f * (post if u.post else remote)
            wait_b = wait_tp_b * back_remote
        simple = not cp and u.moe is None
        forward_sq = (pre + post) ** 2 if simple else pre ** 2 + remote ** 2 + post ** 2
        if deg.moe_ep_overlap:  # the exchanges run beside the pass's compute
            fwd = max(pre + remote + post + tp_f + moe_f, x_f) + wait_f
            bwd = max(back + back_remote + tp_b + moe_b, x_b) + wait_b
            exposed_x = 0.0
        else:
            fwd = pre + remote + post + tp_f + moe_f + x_f + wait_f
            bwd = back + back_remote + tp_b + moe_b + x_b + wait_b
            exposed_x = x_f + x_b
        for k, c, b in [*u.tp_calls(True), *u.tp_calls(False)]:
            costs.add_demand(demand, k, b * exposed, tp_ranks, c)
        out.append(UnitCost(fwd, bwd, tp_f + tp_b + exposed_x + wait_f + wait_b, u.activation_bytes, u.dense_params,
                             u.expert_params, tuple(sorted(demand.items())), u.p2p_bytes,
                             tuple(u.tensors) or (u.dense_params,),
                             kernels_s=pre + remote + post + back + back_remote + moe_f + moe_b,
                             # one op (pre + post) without CP or MoE; else pre, remote, post apart
                             kernels_sq=forward_sq + back ** 2 + back_remote ** 2 + moe_sq, forward_sq=forward_sq,
                             forward_kernel_s=pre + post if simple else 0.0, backward_kernel_s=back if simple else 0.0,
                             launches=u.kernels_forward + u.kernels_backward,
                             tp_calls=sum(c for _, c, _ in [*u.tp_calls(True, True), *u.tp_calls(False)]),
                             expert_tensors=tuple(u.expert_tensors)))
    return out


def static_bytes(params: float, sizes: tuple[int, int, int], training, implementation: Implementation) -> float:
    """Resident model states of ``params`` sharded over (param, grad, optim) groups, as
    ``_sharded.ShardedParams`` holds them in ``implementation``'s layout (buffers, which only
    add, left out)."""
    p, g, o = sizes
    per = implementation.state_bytes_per_param(training.param_element_bytes, training.grad_element_bytes)
    return params * per["params"] / p + params * per["grads"] / g + per["optimizer"] * params / o


def add_sharded_demand(costs: Costs, demand: dict[str, float], params: Sequence[float], m: int,
                    sizes: tuple[int, int, int], dp_group: Sequence[int], training, schedule: Schedule,
                    step_gather: bool = True) -> None:
    """Add the link bytes one rank moves in a step for the data-parallel collectives of
    ``_sharded.ShardedParams`` (gathers and reduce-scatters every micro-batch, the step-end
    reductions and the previous step's step-end gather), all of which fall inside the step."""
    p, g, o = sizes
    sharding = NestedSharding(p, g, o, (tuple(dp_group),))
    rank = dp_group[0]
    bw, bg = training.param_element_bytes, training.grad_element_bytes
    inner = schedule.hierarchical_gather
    m = schedule.per_step(m)  # gathered and reduced per micro-batch, or once per step

    def members(role: str, size: int = 1) -> tuple[int, ...]:
        return tuple(sharding.group_of(role, rank, size)[1])

    for unit_params, k in sorted(Counter(x for x in params if x > 0).items()):
        if p > 1:
            phases = [("fwd", schedule.forward_gather_bytes_per_element or bw)]
            if schedule.reshard_after_forward:
                phases.append(("bwd", bw))
            for phase, per in phases:
                size = unit_params * per
                if phase == "bwd" and schedule.backward_gather_size:
                    costs.add_demand(demand, "all_gather", size, members("secondary", schedule.backward_gather_size), m * k)
                elif inner > 1:
                    costs.add_demand(demand, "all_gather", size / inner, members("param_outer", inner), m * k)
                    costs.add_demand(demand, "all_gather", size, members("param_inner", inner), m * k)
                else:
                    costs.add_demand(demand, "all_gather", size, members("param"), m * k)
        if g > 1:
            costs.add_demand(demand, "reduce_scatter", unit_params * (schedule.grad_reduce_bytes_per_element or bg), members("grad"), m * k)
        if o > g:
            costs.add_demand(demand, "reduce_scatter", unit_params / g * bg, members("step_rs"), k)
        if len(dp_group) // o > 1:
            costs.add_demand(demand, "all_reduce", unit_params / o * bg, members("replica"), k)
        if o > p and step_gather:
            costs.add_demand(demand, "all_gather", unit_params / p * bw, members("step_ag"), k)


def group_spans(costs: Costs, sizes: tuple[int, int, int], dp_group: Sequence[int], schedule: Schedule) -> tuple:
    """Where the data-parallel groups of ``dp_group[0]`` sit (their :class:`GroupSpan`, which
    alone sets a collective's cost): groups placed alike cost alike, whatever their ranks."""
    p, g, o = sizes
    sharding = NestedSharding(p, g, o, (tuple(dp_group),))
    roles = [("param", 1), ("grad", 1), ("step_rs", 1), ("replica", 1), ("step_ag", 1)]
    if schedule.hierarchical_gather > 1:
        roles += [("param_outer", schedule.hierarchical_gather), ("param_inner", schedule.hierarchical_gather)]
    if schedule.backward_gather_size:
        roles.append(("secondary", schedule.backward_gather_size))
    return (len(dp_group), *(costs._span(sharding.group_of(role, dp_group[0], size)[1]) for role, size in roles))


@dataclass(frozen=True)
class DPUnit:
    """Least seconds of one unit's data-parallel collectives (``_sharded.ShardedParams``), in
    the calls its implementation issues."""

    gather_fwd: float = 0.0  # the forward's all-gather (ag stream), every micro-batch
    gather_bwd: float = 0.0  # the backward's (re-)gather
    reduce: float = 0.0  # the backward's reduce-scatter (rs stream), every micro-batch
    step_rs: float = 0.0  # step end (dp stream): reduce-scatter over the optimizer group
    replica_ar: float = 0.0  # step end: all-reduce over the replicas
    step_ag: float = 0.0  # after the optimizer (dp stream): all-gather of the updated shard
    # the unit's expert parameters (nd: their own ShardedParams over the expert-data-parallel
    # group, on the same streams): their gathers are in gather_fwd / gather_bwd (the pass waits
    # for both, one stream runs both); their reduce-scatter follows the dense one on the rs
    # stream (UnitPass._backward: dense first), and their step-end reductions run on the dp stream
    expert_reduce: float = 0.0
    expert_step: float = 0.0  # step_rs + replica_ar of the experts (their step-end gather left out)

    def with_experts(self, experts: DPUnit) -> DPUnit:
        """This dense unit with ``experts``, the same unit's expert collectives, folded in."""
        return dataclasses.replace(self, gather_fwd=self.gather_fwd + experts.gather_fwd,
                                   gather_bwd=self.gather_bwd + experts.gather_bwd, expert_reduce=experts.reduce,
                                   expert_step=experts.step_rs + experts.replica_ar)


def dp_units_of(costs: Costs, units: Sequence[UnitCost], sizes: tuple[int, int, int], dp_group: Sequence[int],
              training, schedule: Schedule, memo: dict[Any, DPUnit] | None = None) -> list[DPUnit]:
    """Each unit's :class:`DPUnit` (``memo``: by the unit's parameters and tensors, for one
    sharding, group placement, training and schedule)."""
    p, g, o = sizes
    sharding = NestedSharding(p, g, o, (tuple(dp_group),))
    rank = dp_group[0]
    impl = schedule.implementation
    full = training.activation_recompute == "full"
    regather = full and impl.regather_for_recompute
    bw, bg = training.param_element_bytes, training.grad_element_bytes
    forward_bytes = schedule.forward_gather_bytes_per_element or bw
    reduce_bytes = schedule.grad_reduce_bytes_per_element or bg
    replicas = len(dp_group) // o
    inner, secondary = schedule.hierarchical_gather, schedule.backward_gather_size
    cs = costs.collective_s

    def members(role: str, size: int = 1) -> Sequence[int]:
        return sharding.group_of(role, rank, size)[1]

    def gather(x: float, per_element: float, share: float, calls: int, backward: bool) -> float:
        count = max(calls, 1)
        size = x * per_element * share / count
        if backward and secondary:
            return cs("all_gather", size, members("secondary", secondary), count)
        if inner > 1:
            return (cs("all_gather", size / inner, members("param_outer", inner), count)
                    + cs("all_gather", size, members("param_inner", inner), count))
        return cs("all_gather", size, members("param"), count)

    out = []
    for u in units:
        x, tensors = u.dense_params, u.tensors
        key = (x, tensors)
        if memo is not None and key in memo:
            out.append(memo[key])
            continue
        if x <= 0:
            out.append(DPUnit())
            continue
        gf = gb = 0.0
        if p > 1:
            gathered = impl.gathered(tensors)
            gf = gather(x, forward_bytes, 1.0, impl.gather_calls(tensors), False)
            if schedule.reshard_after_forward:
                again = impl.backward_gathered(tensors, full)
                calls = (impl.gather_calls(tensors) if regather else 0) + impl.gather_calls(again)
                share = ((1.0 if regather else 0.0) + sum(again) / max(sum(gathered), 1e-30)) if gathered else 1.0
                gb = gather(x, bw, share, calls, True)
        calls = max(impl.reduce_calls(tensors), 1)
        out.append(DPUnit(
            gf, gb,
            cs("reduce_scatter", x * reduce_bytes / calls, members("grad"), calls) if g > 1 else 0.0,
            cs("reduce_scatter", x / g * bg / calls, members("step_rs"), calls) if o > g else 0.0,
            cs("all_reduce", x / o * bg / calls, members("replica"), calls) if replicas > 1 else 0.0,
            cs("all_gather", x / p * bw / calls, members("step_ag"), calls) if o > p else 0.0,
        ))
        if memo is not None:
            memo[key] = out[-1]
    return out


def whole_buffer_s(costs: Costs, params: float, sizes: tuple[int, int, int], dp_group: Sequence[int],
                    training, schedule: Schedule) -> float | None:
    """The step end's one all-reduce of the whole gradient buffer (Megatron 2021), or None when
    the implementation reduces unit by unit."""
    p, g, o = sizes
    if not (schedule.implementation.whole_buffer_step_reduce and o == g and len(dp_group) // o > 1):
        return None
    sharding = NestedSharding(p, g, o, (tuple(dp_group),))
    replica = sharding.group_of("replica", dp_group[0])[1]
    return costs.collective_s("all_reduce", params / o * training.grad_element_bytes, replica)


def stream_sums(schedule: Schedule, sums: dict[str, float]) -> float:
    """Busiest communication stream: the roles' serial sums added per stream they run on."""
    streams: dict[str, float] = {}
    for role, seconds in sums.items():
        name = schedule.stream(role)
        streams[name] = streams.get(name, 0.0) + seconds
    return max(streams.values(), default=0.0)


def slowed(kernel_s: float, talking_s: float, slowdown: float, exposed_s: float = 0.0) -> float:
    """Least time for ``kernel_s`` of kernels on a rank that also talks for ``talking_s``, of
    which ``exposed_s`` cannot overlap kernels: kernels run 1/(1 + slowdown) as fast while it
    talks, so at best all the rest of the talking overlaps kernels."""
    talking_s = max(talking_s, exposed_s)
    overlapped = min(talking_s - exposed_s, (1 + slowdown) * kernel_s)
    return kernel_s + talking_s - overlapped / (1 + slowdown)


class BoundCache:
    """What the lower bounds of one scenario's candidates share: the cost models and the unit,
    data-parallel and link costs, cached across candidates (a strategy plugin's ``bound`` gets
    one; the candidate it bounds must have passed the plugin's ``check``).

    Why they hold (the engine can only be slower or fuller than this):

    - Step time. Each rank's streams run one op at a time, in program order, each after its
      dependencies; the reported step lies between the optimizer ends of the last two steps,
      and everything a rank does for its last step (forwards, backwards, the collectives they
      wait for, the reductions the gradient norm waits for, the optimizer) falls after its
      previous optimizer. Kernels run at most at the compute model's best-case rates
      (communication only slows them: ``comm_overlap_slowdown``), a collective takes at least
      NCCL's isolated time (links are shared, never faster) and, on the compute stream, starts
      late by the expected slowest member.
      Two bounds follow, and the larger is taken:

      * the chain: a replay of the step's dependencies at those least durations — the
        data-parallel gathers the first forward waits for (prefetch depth and buffer rings
        included), the pipeline's fill and drain with its point-to-point sends, every
        compute-stream op, the reductions after the last backward, the gradient norm (and
        its straggler: :func:`norm_s`) and the optimizer (for the ZeRO family every
        micro-batch's gathers and reductions). A pipeline stage's body is longer by what its
        reduce-scatters and step-end reductions must slow of its kernels
        (``_nd_bound.slowed_bodies``); refined, the whole pipeline is replayed, every stage's
        schedule against the others' (``_nd_bound.pipeline``);
      * the talking: a rank's communication takes at least its busiest stream's serial sum
        and its busiest link's bytes at full rate; what of it overlaps kernels slows them.

      Pipeline stages restart after a common gradient-norm all-reduce (every stage waits the
      same norm straggler: no other rendezvous of the step is later or larger), so their
      optimizers end apart by at most the largest optimizer's time.
    - Memory. Resident model states (parameters, gradients and optimizer states in their
      shard groups) plus the activations of every forward a stage runs before its first
      backward frees any (one micro-batch through every unit without pipelining; the
      schedule's warm-up with it).
    - Host costs (kernel launches, collective calls) are left out: without synchronisations the
      simulated host thread runs a step ahead of the device, so they are not provably on the
      critical path of the reported step.
    """

    def __init__(self, model: Model, topology: Topology) -> None:
        self.model = model
        self.topology = topology
        self._costs: dict[tuple[str, bool], Costs] = {}
        self._units: dict[tuple, list[UnitCost]] = {}
        self._demand: dict[tuple, dict[str, float]] = {}
        self._dp: dict[tuple, list[DPUnit]] = {}
        self._dp_unit: dict[tuple, dict[Any, DPUnit]] = {}
        self._spans: dict[tuple, tuple] = {}
        self._prefix: dict[int, tuple[list[UnitCost], dict[str, Any]]] = {}
        self._tables: dict[str, dict[Any, Any]] = {}

    def table(self, name: str) -> dict[Any, Any]:
        """A dict of this scenario's that a plugin fills as it likes (its own caches)."""
        table = self._tables.get(name)
        if table is None:
            table = self._tables[name] = {}
        return table

    def expert_units(self, unit_costs: list[UnitCost]) -> list[UnitCost]:
        """``unit_costs`` with their experts as their parameters (:meth:`UnitCost.experts_as_dense`),
        for :meth:`dp_units` over the expert-data-parallel group."""
        table = self.table("expert_units")
        if id(unit_costs) not in table:  # keep the list alive: its id is the key
            table[id(unit_costs)] = (unit_costs, [u.experts_as_dense() for u in unit_costs])
        return table[id(unit_costs)][1]

    def sharded_demand(self, costs: Costs, params: Sequence[float], m: int, sizes: tuple[int, int, int],
                       dp_group: Sequence[int], training, schedule: Schedule) -> dict[str, float]:
        # with experts, the dense step-end gather may start before the experts' optimizer ends
        # (outside the window the bound looks at): left out
        step_gather = self.model.moe is None
        key = (id(costs), tuple(params), m, sizes, self.spans(costs, sizes, dp_group, schedule),
               training.param_element_bytes, training.grad_element_bytes, schedule)
        if key not in self._demand:
            demand: dict[str, float] = {}
            add_sharded_demand(costs, demand, params, m, sizes, dp_group, training, schedule, step_gather)
            self._demand[key] = demand
        return self._demand[key]

    def dp_units(self, costs: Costs, units: list[UnitCost], lo: int, hi: int, sizes: tuple[int, int, int],
                 dp_group: Sequence[int], training, schedule: Schedule) -> list[DPUnit]:
        spans = self.spans(costs, sizes, dp_group, schedule)
        key = (id(units), lo, hi, sizes, spans, training.param_element_bytes, training.grad_element_bytes,
               training.activation_recompute, schedule)
        if key not in self._dp:
            memo = self._dp_unit.setdefault(key[3:] + (id(costs),), {})
            self._dp[key] = dp_units_of(costs, units[lo:hi], sizes, dp_group, training, schedule, memo)
        return self._dp[key]

    def spans(self, costs: Costs, sizes: tuple[int, int, int], dp_group: Sequence[int], schedule: Schedule) -> tuple:
        key = (id(costs), sizes, range_key(dp_group), schedule.hierarchical_gather, schedule.backward_gather_size)
        if key not in self._spans:
            self._spans[key] = group_spans(costs, sizes, dp_group, schedule)
        return self._spans[key]

    def prefix(self, unit_costs: list[UnitCost]) -> dict[str, Any]:
        """Cumulative sums over the units of each cost (sums over any run of units in O(1))."""
        key = id(unit_costs)
        if key not in self._prefix:
            out: dict[str, Any] = {}
            levels = sorted({level for u in unit_costs for level, _ in u.link_bytes})
            columns = {attr: [getattr(u, attr) for u in unit_costs] for attr in
                       ("forward_s", "backward_s", "comm_s", "activation_bytes", "dense_params", "expert_params",
                        "kernels_s", "kernels_sq")}
            for level in levels:
                columns["link." + level] = [dict(u.link_bytes).get(level, 0.0) for u in unit_costs]
            for attr, values in columns.items():
                running, acc = [0.0], 0.0
                for value in values:
                    acc += value
                    running.append(acc)
                out[attr] = running
            out["levels"] = levels
            self._prefix[key] = (unit_costs, out)  # keep the list alive: its id is the key
        return self._prefix[key][1]

    def costs(self, precision: str, variability: bool = True) -> Costs:
        key = (precision, variability)
        if key not in self._costs:
            self._costs[key] = Costs(self.topology, precision, variability)
        return self._costs[key]

    def units(self, training, deg: ParallelDims, pp: int, variability: bool = True,
              rendezvous: tuple[int, ...] | None = None) -> list[UnitCost]:
        # a unit as one model-parallel rank runs it does not depend on the pipeline or the data
        # parallelism (mp_units reads tp, cp, ep, etp, sequence parallelism, the MoE imbalance;
        # unit_costs_of the TP overlap and, for the expert groups' placement, pp): shared by them
        deg = dataclasses.replace(deg, pp=1, vpp=1, dp=None)
        pp = pp if deg.ep > 1 else 1
        keys = least_attention_keys(training, self.model.seq_len, self.costs(training.precision, variability).compute)
        key = (training.micro_batch_size, training.activation_recompute, training.recompute_modules, training.fused_kernels,
               training.attention_kernel, deg, pp, variability, keys, rendezvous)
        if key not in self._units:
            self._units[key] = unit_costs_of(self.costs(training.precision, variability),
                                             mp_units(self.model, training, dataclasses.replace(deg, pp=pp).placed(self.topology)),
                                             deg, self.topology.num_devices, pp, keys, rendezvous)
        return self._units[key]


def least_attention_keys(training, seq_len: int, compute: ComputeModel) -> tuple[float, float] | None:
    """(seq_len, the mean document length at which any micro-batch's attention takes least time)
    under variable-length sequences (None: whole rows). A row of ``seq_len`` tokens cut into k
    pieces holds at least seq_len^2 / k query-key pairs; with no document shorter than l_min a
    row has at most seq_len / l_min + 2 pieces (a document cut at each row end), so its
    token-weighted mean piece length is at least seq_len / (seq_len / l_min + 2) (l_min = 1 for
    a distribution); within that range the kernel model's cheapest length
    (:meth:`~hzpsim.hardware.compute.ComputeModel.cheapest_row_keys`)."""
    spec = training.varying_lengths
    if spec is None:
        return None
    shortest = min(p[0] for p in spec.lengths) if spec.lengths else 1.0
    return float(seq_len), compute.cheapest_row_keys(seq_len / (seq_len / shortest + 2), seq_len)


def range_key(ranks: Sequence[int]) -> Any:
    return (ranks.start, ranks.stop, ranks.step) if isinstance(ranks, range) else tuple(ranks)


def persistent_norm_s(costs: Costs, n: int, largest_group: int, least_step_work: Sequence[float]) -> float:
    """The least persistent lateness of the last step's gradient norm, the step's only
    rendezvous of all ``n`` ranks (``Stragglers._persistent_s``), when every other group the
    ranks meet has at most ``largest_group`` members, all of them on one stage's schedule (the
    pipeline's sends are not rendezvous); ``least_step_work``: each simulated rank's least device
    work in a step (its kernels and optimizer at least durations).

    With c = cv_p and E(k) = E[max of k]: the norm starts c·E(n)·X late, X the most device work
    a simulated rank has done since the previous norm (every rank's last rendezvous of n), less
    the most any of them already waited for at smaller rendezvous since. A rank's waits since
    the previous norm add up to at most c·E(largest_group)·(its work since): each rendezvous of
    size g charges c·E(g)·x less what the rank waited for over the same x (its work since it
    last met a group at least that large), so the waits over any stretch between two
    rendezvous of size >= g total at most c·E(g) of its work there (by induction on the sizes),
    and E grows with the size. Between two norms every rank does a step of work, so X is at
    least the largest least step. Hence the wait is at least c·(E(n) - E(largest_group))·max(w)."""
    return costs.persistent(n, largest_group) * max(least_step_work, default=0.0)


def communicators_at_least(group_sizes: Sequence[int], pairs: int = 0) -> int:
    """NCCL communicators a rank certainly holds (``sim/allocator.communicators``: one per
    distinct set of two or more ranks it talks with): one per distinct size among the groups
    it belongs to (sets of different sizes differ; two groups of one size may be the same set,
    counted once), plus ``pairs`` point-to-point pipeline neighbours (their sets cross stages,
    unlike every other group but the world's, whose size is larger)."""
    return len({s for s in group_sizes if s > 1}) + pairs


def norm_s(costs: Costs, n: int, squares: float = 0.0) -> float:
    """The global gradient-norm all-reduce (one fp32 scalar over every rank, compute stream),
    and, given ``squares``, the wait for its straggler in the collective (``Engine._collective``;
    the optimizer after it does not wait again: ``Engine._stream``).

    The norm is the step's only rendezvous of all ``n`` ranks when ``squares`` is passed, so its
    slowest member is late by ``cv · E[max of n] · W`` with ``W² `` the sum of the squared
    stretches of device work since the previous norm (``Stragglers._since``). Each compute op
    adds its whole duration to the stretch it ends in, and (a + b)² >= a² + b², so W² is at
    least the sum of the squares of the ops' least durations on the slowest simulated rank:
    ``squares``."""
    seconds = costs.collective_s("all_reduce", 4.0, range(n))
    if squares > 0:
        seconds += costs.late(n) * math.sqrt(squares)
    return seconds
