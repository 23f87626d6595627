"""The layout of an ND run, shared by the ND plugin (``nd.py``: its graph) and its bounds
(``_nd_bound.py``): the dimensions and schedule a config asks for, the layers of each virtual
stage, the placement, Megatron's per-rank pipeline schedule and ZeRO's sharding sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hzpsim.hardware.placement import Placement, expert_placement
from hzpsim.hardware.topology import Topology
from hzpsim.model import Model
from hzpsim.model.training import Training
from hzpsim.strategies import _implementations
from hzpsim.strategies._dims import ParallelDims, moe_fields
from hzpsim.strategies._sharded import Schedule


def dims(config: Any) -> ParallelDims:
    return ParallelDims(tp=config.tp, pp=config.pp, cp=config.cp, dp=config.dp, ep=config.ep, etp=config.expert_tp,
                        vpp=config.vpp, sequence_parallel=config.sequence_parallel,
                        tp_comm_overlap=config.tp_comm_overlap, tp_comm_overlap_backward=config.tp_comm_overlap_backward,
                        **moe_fields(config))


def schedule(config: Any) -> Schedule:
    """Megatron's distributed-optimizer overlap flags; with zero_stage 3, FSDP's prefetch. With
    pipeline stages and sharded gradients, an implementation that keeps FSDP units unsharded
    across micro-batches (``Implementation.pp_keeps_unsharded``: torchtitan) gathers once and
    reduces once per step."""
    implementation = _implementations.get(config.implementation)
    keep = config.pp > 1 and config.sharding_stage >= 2 and implementation.pp_keeps_unsharded
    return Schedule(prefetch_depth=config.prefetch_depth, reshard_after_forward=not keep, accumulate_unsharded=keep,
                    overlap_grad_reduce=config.overlap_grad_reduce, overlap_param_gather=config.overlap_param_gather,
                    implementation=implementation)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A validated ND layout: degrees, micro-batches, the layers of each model chunk, ranks."""

    dims: ParallelDims
    num_micro_batches: int
    """Micro-batches per pipeline per step."""
    layers_per_virtual_stage: tuple[int, ...]
    """Transformer layers of each of the pp × vpp model chunks, in model order."""
    placement: Placement
    """Dense ranks in Megatron's order (tp fastest, then cp, dp, pp)."""
    experts: Placement
    """Expert ranks (etp, ep, edp, pp): MoE parallel folding."""

    @property
    def dp(self) -> int:
        return self.dims.data_parallel(self.placement.num_devices)


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
    named = "first_stage_layers" if first is not None else "last_stage_layers"
    for key, value in (("first_stage_layers", first), ("last_stage_layers", last)):
        if value is not None and value < 0:
            raise ValueError(f"{key}: must be >= 0, got {value}")
    if pp < 2:
        raise ValueError(f"{named}: uneven stages need pp > 1")
    f = first if first is not None else None
    la = last if last is not None else None
    middle_ranks = pp - (f is not None) - (la is not None)
    rest = num_layers - (f or 0) - (la or 0)
    if rest < 0 or (middle_ranks and rest % (middle_ranks * vpp)) or (not middle_ranks and rest):
        raise ValueError(
            f"{named}: {num_layers} layers cannot be split as first={first}, last={last} "
            f"with the other {middle_ranks} stages x {vpp} chunks equal"
        )
    per_rank = [rest // middle_ranks if middle_ranks else 0] * pp
    if f is not None:
        per_rank[0] = f
    if la is not None:
        per_rank[-1] = la
    for r, n in enumerate(per_rank):
        if n % vpp:
            raise ValueError(f"{named}: stage {r} holds {n} layers, not divisible by vpp={vpp}")
    counts = tuple(per_rank[v % pp] // vpp for v in range(virtual))
    empty = [v for v in range(1, virtual - 1) if counts[v] == 0]  # the edge chunks keep embedding / head
    if empty:
        key = "first_stage_layers" if empty[0] % pp == 0 else "last_stage_layers"
        raise ValueError(f"{key}: model chunk {empty[0]} (pipeline rank {empty[0] % pp}) would hold no layer "
                         f"and no embedding or output head")
    return counts


def ep_overlap_rules(d: ParallelDims, training: Training) -> None:
    """What Megatron-Core asserts before it runs the combined 1F1B of
    ``--overlap-moe-expert-parallel-comm`` (``transformer_config.py``, ``__post_init__``):
    expert parallelism, the alltoall or flex (DeepEP) dispatcher, interleaving when pipelined,
    and no full or MoE recomputation."""
    if d.ep == 1:
        raise ValueError("moe_ep_overlap: needs expert parallelism (ep > 1)")
    if d.moe_dispatcher == "allgather":
        raise ValueError("moe_ep_overlap: needs the alltoall or deepep dispatcher, not allgather")
    if d.pp > 1 and d.vpp == 1:
        raise ValueError("moe_ep_overlap: needs an interleaved pipeline (vpp > 1) when pp > 1")
    if training.activation_recompute == "full" or "moe" in (training.recompute_modules or ()):
        raise ValueError("moe_ep_overlap: Megatron-Core refuses it with full or moe recomputation")


def layout(config: Any, model: Model, training: Training, topology: Topology) -> Layout:
    n, d = topology.num_devices, dims(config)
    try:
        d.check(model, training, n)
    except ValueError as exc:
        if config.etp is None and d.etp > 1 and str(exc).startswith(("ep:", "etp:")):  # the profile chose etp
            raise ValueError(f"{exc} (etp unset: {config.implementation}'s default, the TP size {d.etp}; "
                             f"set strategy.etp)") from None
        raise
    if d.moe_ep_overlap:
        ep_overlap_rules(d, training)
    layers = stage_layers(model.num_layers, d.pp, d.vpp, config.first_stage_layers, config.last_stage_layers)
    dp = d.data_parallel(n)
    placement = Placement.from_sizes(n, order=("tp", "cp", "dp", "pp"), tp=d.tp, cp=d.cp, dp=dp, pp=d.pp)
    return Layout(dims=d, num_micro_batches=d.num_micro_batches(training, n), layers_per_virtual_stage=layers,
                  placement=placement, experts=expert_placement(n, d.ep, d.etp, d.pp))


def pipeline_warmup(p: int, v: int, m: int, rank: int, ep_overlap: bool = False) -> int:
    """Forwards pipeline rank ``rank`` runs before its first backward (Megatron-Core
    ``schedules.py::get_pp_rank_microbatches``). With ``ep_overlap`` (the combined 1F1B of
    ``--overlap-moe-expert-parallel-comm``) one more, so that every forward of the steady phase
    pairs with a backward it does not depend on; without pipelining that is the first forward
    alone (``combined_1f1b.py::combined_1f1b_schedule_for_no_pipelining``)."""
    total = m * v
    warmup = p - rank - 1 if v == 1 else (p - rank - 1) * 2 + (v - 1) * p
    return min(warmup + (1 if ep_overlap else 0), total)


def paired(p: int, v: int, m: int, rank: int, ep_overlap: bool) -> list[bool]:
    """For each action of :func:`pipeline_actions`: whether it runs combined with a partner
    pass of another micro-batch (the steady one-forward-one-backward phase under
    ``ep_overlap``); the warm-up forwards and cool-down backwards run alone
    (``combined_1f1b.py``: "executed alone, no a2a overlapping")."""
    total = m * v
    warmup = pipeline_warmup(p, v, m, rank, ep_overlap)
    steady = range(warmup, warmup + 2 * (total - warmup)) if ep_overlap else range(0)
    return [k in steady for k in range(2 * total)]


def pipeline_actions(p: int, v: int, m: int, rank: int, ep_overlap: bool = False) -> list[tuple[str, int, int]]:
    """Megatron's schedule for one pipeline rank: ("F" | "B", model chunk, micro-batch)."""
    total = m * v
    warmup = pipeline_warmup(p, v, m, rank, ep_overlap)

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


def sharding_sizes(zero_stage: int, n: int) -> tuple[int, int, int]:
    """param | grad | optim sizes of ZeRO stage ``zero_stage`` over a data-parallel group of n."""
    return {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[zero_stage]
