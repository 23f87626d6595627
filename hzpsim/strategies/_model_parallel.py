"""Model parallelism inside one unit: tensor (+ sequence), context and expert parallelism.

:func:`~hzpsim.strategies._mp_units.mp_units` describes each unit as one model-parallel rank
holds and computes it (``_mp_units``); :class:`UnitEmitter` writes a unit's forward or backward for one micro-batch as compute ops
interleaved with the unit's TP / CP / EP collectives. Shared by ``nd`` (with pipelining) and by
the sharded family when it composes with ``tp``/``cp``/``ep``.

Communication per layer and micro-batch (docs/strategies.md §2.7, §2.8):

- TP: two all-reduces of b·s·h activations in the forward and two in the backward, i.e.
  8·b·s·h·(t−1)/t elements per rank. With sequence parallelism each all-reduce becomes an
  all-gather + reduce-scatter pair of the same volume (Megatron-LM
  megatron/core/tensor_parallel/mappings.py: ``_gather_along_first_dim`` before a
  column-parallel layer, ``_reduce_scatter_along_first_dim`` after a row-parallel one, each the
  other's backward): a layer's forward gathers and scatters twice, and so does its backward;
  the embedding's forward all-reduce becomes a forward reduce-scatter and a backward gather, the
  head's backward all-reduce a forward gather and a backward reduce-scatter. The norm weights
  then see only 1/t of the tokens, so their gradients are all-reduced over the TP group once
  per step (megatron/core/distributed/finalize_model_grads.py::_allreduce_layernorm_grads, one
  coalesced buffer). On the critical path unless ``tp_comm_overlap`` hides a fraction of it
  (the hidden part still loads the links). An MoE layer keeps the attention block's
  all-reduce (pair); its MLP block talks through the dispatcher.
- CP: each rank's K/V chunk goes round the CP ring (an all-gather of c chunks) while the local
  part of attention runs; the remote part waits for it. Backward moves twice the bytes
  (K/V again and dK/dV). GQA shrinks the chunk (kv heads), and kv heads are not split below one
  per TP rank. Causal load balancing: every rank does 1/c of the attention FLOPs.
- EP: an MoE layer runs its router, permutation, grouped GEMMs and un-permutation as ops of
  their own around the dispatcher's dispatch and combine, forward and backward (``_moe``); the
  exchanges wait for the compute, or with ``moe_ep_overlap`` run beside it.
- ETP (expert tensor parallelism): the expert-TP group gathers the received tokens before the
  experts and reduce-scatters after them; each rank runs etp× the copies on 1/etp of the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import NamedTuple

from hzpsim.hardware.placement import Placement
from hzpsim.model.ops import MemoryDelta, Ranks, memory_delta
from hzpsim.model.training import Training
from hzpsim.strategies import _moe
from hzpsim.strategies._compression import CompressionPlan
from hzpsim.strategies._dims import ParallelDims
from hzpsim.strategies._layers import Work
from hzpsim.strategies._mp_units import LOSS_KERNELS_BACKWARD, MPUnit, _pass_memory
from hzpsim.strategies._sharded import Emitter, Ids, NestedSharding, Schedule, ShardedParams, Use

Instances = list[tuple[str, tuple[int, ...]]]


_TP_TAGS = {"all_reduce": "", "all_gather": ".ag", "reduce_scatter": ".rs"}  # TP op names: tp.<pass label><tag>


class _PassCalls(NamedTuple):
    """The collective calls of one unit's forward or backward: the same every micro-batch."""

    unit: MPUnit
    """The unit (held, so that its id, the cache key, stays its own)."""
    tp_overlap: float
    """Share of each TP transfer hidden behind the pass's compute (``tp_comm_overlap``)."""
    tp: tuple[tuple[str, int, str, float, float], ...]
    """TP collectives (:meth:`MPUnit.tp_calls`): kind, calls, name tag, hidden and exposed bytes per call."""
    host: tuple[tuple[int, int], ...]
    """(calls, group size) of the TP / CP / EP collectives, whose host cost the launch pays."""


class UnitEmitter:
    """Writes one unit's forward or backward (one micro-batch) with its TP/CP/EP collectives."""

    def __init__(self, emit: Emitter, deg: ParallelDims, group_of: Callable[[str, int], tuple[str, Ranks]]) -> None:
        self.emit, self.deg = emit, deg
        # whether the pass being written hides its dispatch and combine behind a partner
        # micro-batch's compute: moe_ep_overlap, except for a pass the schedule runs alone
        # (_nd_layout.paired), which the pipeline sets before each pass
        self.ep_overlap = deg.moe_ep_overlap
        sizes = {"tp": deg.tp, "cp": deg.cp, "ep": deg.ep, "etp": deg.etp}
        self.instances: dict[str, Instances] = {
            dim: emit.groups_for(lambda lane, dim=dim: group_of(dim, lane), sizes[dim]) for dim in sizes
        }
        self._pass_calls: dict[tuple[int, bool], _PassCalls] = {}  # (id(unit), forward) -> its calls

    def _calls_of(self, unit: MPUnit, forward: bool) -> _PassCalls:
        """The pass's collective calls, worked out on its first micro-batch."""
        known = self._pass_calls.get((id(unit), forward))
        if known is not None:
            return known
        deg = self.deg
        hidden = deg.tp_comm_overlap if forward or deg.tp_comm_overlap_backward else 0.0
        tp_calls = unit.tp_calls(forward, self.emit.implementation.tp_gathers_logits)
        tp = tuple((kind, count, ".logits" if size != unit.tp_bytes else _TP_TAGS[kind], size * hidden,
                    size * (1 - hidden))
                   for kind, count, size in tp_calls)
        host = ((sum(count for _, count, _ in tp_calls), deg.tp),
                (1 if forward else 2, deg.cp) if unit.cp_bytes else (0, 1),
                (2, deg.ep) if unit.is_moe and unit.ep_bytes else (0, 1))
        known = self._pass_calls[(id(unit), forward)] = _PassCalls(unit, hidden, tp, host)
        return known

    def _tp(self, unit: MPUnit, forward: bool, label: str, deps: Sequence[Ids | None], step: int,
            overlap_from: Sequence[Ids | None] | None = None) -> Ids | None:
        """The pass's TP collectives (:meth:`MPUnit.tp_calls`) one after the other after ``deps``
        (the pass's last compute). With ``tp_comm_overlap`` the hidden share is the transfer
        that a decomposed collective matmul (async TP: torch/distributed/_symmetric_memory
        ``_fused_all_gather_matmul_impl`` / ``_fused_matmul_reduce_scatter_impl``; TE's
        userbuffer overlap) moves while the pass's own matmuls run: it starts with the pass's
        compute (``overlap_from``, the compute's inputs), and the exposed share waits for it, so
        the pass takes max(compute, hidden transfer) + exposed transfer. PyTorch's async TP hides
        the forward's only (``tp_comm_overlap_backward: false``): its announcement measured the
        forward 29 % faster and the whole step 8 %, which the forward alone accounts for
        (discuss.pytorch.org "Introducing Async Tensor Parallelism in PyTorch", Llama 3 8B)."""
        calls = self._calls_of(unit, forward)
        hidden = calls.tp_overlap
        last = deps[-1] if deps else None
        for kind, count, tag, hidden_bytes, exposed_bytes in calls.tp:
            name = f"tp.{label}{tag}"
            overlapped = None
            if hidden > 0:
                overlapped = self.emit.collective(kind, self.instances["tp"], hidden_bytes, f"{name}.overlapped",
                                                  "tp", "tp", overlap_from if overlap_from is not None else deps,
                                                  step, count=count, launch=False)
            if hidden < 1:
                last = self.emit.collective(kind, self.instances["tp"], exposed_bytes, name,
                                            "tp", "compute", [last, overlapped], step, count=count, launch=False)
            elif overlapped is not None:
                last = overlapped
        return last if calls.tp else None

    def sp_norm_reduce(self, size_bytes: float, deps: Sequence[Ids | None], step: int) -> Ids | None:
        """The step's all-reduce of the sequence-parallel norm gradients over the TP group (one
        coalesced buffer of ``size_bytes``; Megatron's ``_allreduce_layernorm_grads``)."""
        if not size_bytes or not self.instances["tp"]:
            return None
        return self.emit.collective("all_reduce", self.instances["tp"], size_bytes, "tp.sp_norm_grads", "tp",
                                    "compute", deps, step)

    def forward(self, unit: MPUnit, label: str, deps: Sequence[Ids | None], step: int,
                alloc: MemoryDelta, free: MemoryDelta) -> Ids:
        """``free`` is released when the unit's last forward compute op ends."""
        emit = self.emit
        if not unit.cp_bytes and unit.moe is None:  # one op, TP after it
            last: Ids = emit.compute(f"fwd.{label}", "forward", unit.forward_work, deps, step,
                                     alloc=alloc, free=free, kernels=unit.kernels_forward,
                                     calls=self._calls_of(unit, True).host)
            return self._tp(unit, True, f"fwd.{label}", [last], step, overlap_from=deps) or last
        has_post = bool(unit.post) or unit.moe is not None
        last = emit.compute(f"fwd.{label}", "forward", unit.pre, deps, step, alloc=alloc,
                            free=None if (has_post or unit.cp_bytes) else free, kernels=unit.kernels_forward,
                            calls=self._calls_of(unit, True).host)
        if unit.cp_bytes:
            ring = emit.collective("all_gather", self.instances["cp"], unit.cp_bytes, f"cp.fwd.{label}", "cp", "cp",
                                   deps, step, launch=False)
            last = emit.compute(f"fwd.remote.{label}", "forward", unit.remote, [last, ring], step,
                                free=None if has_post else free)
        if unit.moe is not None:
            last = self._tp(unit, True, f"fwd.{label}", [last], step, overlap_from=deps) or last
            return _moe.emit_forward(self, unit, label, last, deps, step, free)
        if has_post:
            last = emit.compute(f"fwd.mlp.{label}", "forward", unit.post, [last], step, free=free)
        return self._tp(unit, True, f"fwd.{label}", [last], step, overlap_from=deps) or last

    def loss_backward(self, unit: MPUnit, label: str, deps: Sequence[Ids | None], step: int) -> Ids | None:
        """The loss's backward as an op of its own before ``unit``'s backward (MPUnit.backward_temps):
        its fp32 gradients live only while it runs, and it frees what the loss kept. None for a
        unit without one."""
        if not unit.loss_split:
            return None
        temps = tuple(("temporaries", b) for b in unit.backward_temps if b)
        return self.emit.compute(f"bwd.loss.{label}", "backward", Work(bytes_accessed=unit.loss_backward_bytes),
                                 deps, step, alloc=temps, free=temps + (("activations", unit.loss_saved_bytes),),
                                 kernels=LOSS_KERNELS_BACKWARD)

    def backward(self, unit: MPUnit, label: str, deps: Sequence[Ids | None], step: int,
                 alloc: MemoryDelta, free: MemoryDelta) -> Ids:
        emit = self.emit
        start = deps
        first_alloc: MemoryDelta | None = alloc
        if unit.moe is not None:
            start, first_alloc = [_moe.emit_backward(self, unit, label, deps, step, alloc)], None
        if unit.cp_bytes:
            ring = emit.collective("all_gather", self.instances["cp"], unit.cp_bytes, f"cp.bwd.{label}", "cp", "cp",
                                   deps, step, count=2, launch=False)
        work, kernels = unit.backward, unit.kernels_backward
        if unit.loss_split:  # the loss's backward ran before (loss_backward)
            work = replace(work, bytes_accessed=work.bytes_accessed - unit.loss_backward_bytes)
            kernels -= LOSS_KERNELS_BACKWARD
        main = emit.compute(f"bwd.{label}", "backward", work, start, step, alloc=first_alloc,
                            free=None if unit.cp_bytes else free, kernels=kernels,
                            calls=self._calls_of(unit, False).host)
        last: Ids = main
        if unit.cp_bytes:
            last = emit.compute(f"bwd.remote.{label}", "backward", unit.backward_remote, [main, ring], step, free=free)
        return self._tp(unit, False, f"bwd.{label}", [last], step, overlap_from=start) or last

def _summed(*parts: Mapping[str, float]) -> dict[str, float]:
    """Bytes by category, added up over ``parts``."""
    out: dict[str, float] = {}
    for part in parts:
        for category, size in part.items():
            out[category] = out.get(category, 0.0) + size
    return out


class UnitPass:
    """A unit's forward or backward for one micro-batch with all that surrounds it: the
    parameter gathers it waits for, the gather buffers it frees, the gradient reductions it
    starts; and at each step end the reductions and the optimizer.

    Any compute schedule (the ZeRO family's flat loop, one pipeline stage of ``nd``) calls
    :meth:`forward` and :meth:`backward` for each unit in program order (``uses``), then
    :meth:`reduce` and :meth:`optimize`. Dense parameters shard over their data-parallel
    (dp × cp) group, expert parameters over their expert-data-parallel group, with the
    param | grad | optim sizes that ``sizes(dp_size)`` gives for a group of that size.
    """

    def __init__(self, emit: Emitter, dims: ParallelDims, units: Sequence[MPUnit], training: Training,
                 placement: Placement, experts: Placement, schedule: Schedule, uses: Sequence[Use],
                 sizes: Callable[[int], tuple[int, int, int]], num_micro_batches: int,
                 compression: CompressionPlan | None = None) -> None:
        def group_of(dim: str, rank: int) -> tuple[str, Ranks]:
            members = (experts if dim in ("ep", "etp") else placement).group(dim, rank)
            return f"{dim}.{members[0]}", members

        self.unit_emit = UnitEmitter(emit, dims, group_of)
        self.num_micro_batches = num_micro_batches
        self.sp_norm_bytes = sum(u.tp_sp_params for u in units) * training.grad_element_bytes
        names = [u.name for u in units]
        first = lambda group: group[0]  # noqa: E731  (groups are sorted)
        dense_groups = tuple(sorted({placement.group(("dp", "cp"), r) for r in emit.lanes}, key=first))
        self.sharded = [ShardedParams(emit, [u.dense_params for u in units], names, training,
                                      NestedSharding(*sizes(len(dense_groups[0])), dense_groups), schedule, uses,
                                      unit_tensors=[u.tensors or (u.dense_params,) for u in units],
                                      compression=compression)]
        if any(u.expert_params for u in units):
            expert_groups = tuple(sorted({experts.group("edp", r) for r in emit.lanes}, key=first))
            self.sharded.append(ShardedParams(
                emit, [u.expert_params for u in units], names, training,
                NestedSharding(*sizes(len(expert_groups[0])), expert_groups), schedule, uses, tag="experts.",
                unit_tensors=[u.expert_tensors or (u.expert_params,) for u in units],
            ))
        extra = sum(u.extra_grad_bytes for u in units)
        if extra:  # held whole through the step, sharded again at its end: a buffer, not a model state
            for lane in emit.lanes:
                emit.graph.add_static(lane, {"buffers": extra})
        self.memory = [_pass_memory(u, _summed(*(s.forward_free(i) for s in self.sharded)),
                                    sum(s.backward_alloc(i) for s in self.sharded),
                                    _summed(*(s.backward_free(i) for s in self.sharded)))
                       for i, u in enumerate(units)]

    def _copies(self, unit: MPUnit, index: int, phase: str, step: int, mb: int,
                deps: list[Ids | None]) -> list[Ids | None]:
        """The implementation's device copies around the gathers (FSDP2 copy-out), as one
        memory-bound op before the unit's compute. With a copy-out into per-parameter tensors
        (``Implementation.gather_copy_out``) it allocates the unsharded parameters (compute
        stream) and frees each all-gather's flat output (its gather stream) as it ends."""
        copied = sum(s.copy_bytes(index, phase, mb) for s in self.sharded)
        flat = tuple(("buffers", b) for s in self.sharded if (b := s.copy_out_bytes(index, phase, mb)))
        if not copied and not flat:
            return deps
        unsharded = (("params", sum(b for _, b in flat)),) if flat else None
        return [self.unit_emit.emit.compute(f"copy.{phase}.{unit.name}", "forward" if phase == "fwd" else "backward",
                                            Work(bytes_accessed=copied), deps, step, alloc=unsharded,
                                            free=flat or None, kernels=1)]

    def forward(self, unit: MPUnit, index: int, step: int, mb: int, incoming: Ids | None) -> Ids:
        """Forward of ``unit`` (the ``index``-th of the schedule's units) after ``incoming``."""
        with self._micro_batch(step, mb):
            return self._forward(unit, index, step, mb, incoming)

    @contextmanager
    def _micro_batch(self, step: int, mb: int) -> Iterator[None]:
        """The compute emitted inside runs micro-batch ``mb`` of ``step`` (its lengths:
        ``_sharded.attach_lengths``)."""
        emit = self.unit_emit.emit
        emit.batch = (step, mb)
        try:
            yield
        finally:
            emit.batch = None

    def _forward(self, unit: MPUnit, index: int, step: int, mb: int, incoming: Ids | None) -> Ids:
        deps = [incoming, *(d for s in self.sharded for d in s.forward_deps(step, mb, index))]
        deps = self._copies(unit, index, "fwd", step, mb, deps)
        memory = self.memory[index]
        last = self.unit_emit.forward(unit, f"{unit.name}.mb{mb}", deps, step, memory.forward_alloc, memory.forward_free)
        for s in self.sharded:
            s.forward_done(step, mb, index, last)
        return last

    def backward(self, unit: MPUnit, index: int, step: int, mb: int, incoming: Ids | None) -> Ids:
        with self._micro_batch(step, mb):
            return self._backward(unit, index, step, mb, incoming)

    def _backward(self, unit: MPUnit, index: int, step: int, mb: int, incoming: Ids | None) -> Ids:
        loss = self.unit_emit.loss_backward(unit, f"{unit.name}.mb{mb}", [incoming], step)
        if loss is not None:
            incoming = loss
        # what starts this micro-batch's backward pass: the loss's backward, or on a pipeline
        # stage without the loss the gradient received from the next stage (the first call)
        if incoming is not None:
            for s in self.sharded:
                s.loss_done(step, mb, incoming)
        deps = [incoming, *(d for s in self.sharded for d in s.backward_deps(step, mb, index))]
        deps = self._copies(unit, index, "bwd", step, mb, deps)
        memory = self.memory[index]
        taken = memory.backward_alloc
        if mb == 0:  # the gradient accumulators its first backward takes (kept unsharded across micro-batches)
            taken += memory_delta({"buffers": sum(s.accumulator_bytes(index) for s in self.sharded)})
        last = self.unit_emit.backward(unit, f"{unit.name}.mb{mb}", deps, step, taken, memory.backward_free)
        for s in self.sharded:
            s.backward_done(step, mb, index, last, last_mb=mb == self.num_micro_batches - 1)
        return last

    def forward_merged(self, unit: MPUnit, step: int, mb: int, incoming: Ids | None) -> Ids:
        """Forward of a merged unit (:func:`merge_units`: no parameters, so no sharding hooks)."""
        memory = unit.activation_memory
        with self._micro_batch(step, mb):
            return self.unit_emit.forward(unit, f"{unit.name}.mb{mb}", [incoming], step, memory.forward_alloc,
                                          memory.forward_free)

    def backward_merged(self, unit: MPUnit, step: int, mb: int, incoming: Ids | None) -> Ids:
        memory = unit.activation_memory
        with self._micro_batch(step, mb):
            loss = self.unit_emit.loss_backward(unit, f"{unit.name}.mb{mb}", [incoming], step)
            return self.unit_emit.backward(unit, f"{unit.name}.mb{mb}", [loss or incoming], step,
                                           memory.backward_alloc, memory.backward_free)

    def reduce(self, step: int, end_of_backward: Ids) -> list[Ids | None]:
        """The step-end gradient reductions (with the end of the backward: what the gradient-norm
        all-reduce waits for)."""
        out: list[Ids | None] = [end_of_backward]
        out.append(self.unit_emit.sp_norm_reduce(self.sp_norm_bytes, [end_of_backward], step))
        for s in self.sharded:
            out += s.reduce_step(step, end_of_backward)
        return out

    def optimize(self, step: int, norm: Ids) -> None:
        for s in self.sharded:
            s.optimize(step, [norm])
