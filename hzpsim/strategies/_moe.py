"""An MoE layer as the frameworks run it, on one rank, per micro-batch: the router, the token
permutation, the experts' grouped GEMMs, the un-permutation, and the dispatcher's exchanges
between them (``_model_parallel.UnitEmitter`` emits them as ops of their own; docs/moe.md).

The busiest expert-parallel rank sets the pace: its routed copies (``ParallelDims.moe_load``:
the imbalance, capped by a capacity factor) size its grouped GEMMs, its activations and the
receiving side of the all-to-all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from hzpsim.model import Model
from hzpsim.model.activations import (
    activation_fn_backward_bytes_per_ffn,
    activation_fn_bytes_per_ffn,
)
from hzpsim.model.kernels import Gemm
from hzpsim.strategies._dims import ParallelDims
from hzpsim.strategies._layers import Work, fp8_quantize_bytes, linear_gemms


class MoEWork(NamedTuple):
    """The expert half of an MoE layer on one rank, per micro-batch, forward and backward
    (recompute included), each part run as an op of its own between the dispatcher's exchanges:
    the router (gating GEMM, softmax / top-k, load-balancing loss), the permutation of the
    token copies into expert order, the experts' grouped GEMMs (with their activation
    function) and the un-permutation (weighted sum of each token's copies)."""

    router: Work
    permute: Work
    experts: Work
    unpermute: Work
    router_backward: Work
    permute_backward: Work
    experts_backward: Work
    unpermute_backward: Work


def expert_gemms(model: Model, linears: Sequence[tuple[int, int, str]], tokens: float, deg: ParallelDims) -> list[Gemm]:
    """The forward GEMMs of this rank's E/ep experts over the ``tokens``·top_k routed copies of
    its ``tokens``, as many arriving at the busiest rank as its load says
    (:attr:`ParallelDims.moe_load`), shared equally by its experts, gathered over the expert-TP
    group and run on weights split by etp. One
    grouped GEMM per linear whose tiles share the waves (Megatron-Core ``TEGroupedMLP`` /
    ``GroupedMLP``, torchtitan ``torch._grouped_mm``), or one GEMM per local expert
    (``SequentialMLP``): small per-expert token counts leave tiles part-empty either way
    (``hardware/compute.py``'s tile and wave quantisation)."""
    assert model.moe is not None
    local_experts = model.moe.num_experts / deg.ep
    # with expert tensor parallelism the etp ranks sharing an expert's weights all-gather the
    # tokens they received (Megatron-Core ``MoEAlltoAllTokenDispatcher``: the gather over the
    # expert-TP group after the all-to-all), so each runs etp× the copies on 1/etp of the weights
    per_expert = tokens * model.moe.top_k * deg.moe_load * deg.etp / local_experts
    gemms = linear_gemms(linears, per_expert, deg.etp)
    if deg.moe_grouped_gemm:
        return [g._replace(batch=local_experts) for g in gemms]
    return [g._replace(calls=local_experts) for g in gemms]


def dispatch(model: Model, tokens: float, act: int, deg: ParallelDims) -> tuple[float, tuple[str, str]]:
    """One dispatch (or combine) exchange of an MoE layer on one rank routing ``tokens``: its
    bytes and the collective kinds of the forward's dispatch and combine. 0 bytes without EP.

    - ``alltoall`` (Megatron-Core ``MoEAlltoAllTokenDispatcher``, torchtitan's
      ``all_to_all_single`` with splits, DeepSpeed-MoE ``_AllToAll``): each rank sends its
      tokens·top_k copies to the experts' ranks; the busiest rank receives its load
      (:attr:`ParallelDims.moe_load`) times the mean, and the exchange ends when it has.
    - ``allgather`` (``MoEAllGatherTokenDispatcher``): every rank gathers the whole group's
      tokens (ep·tokens·h, no top_k copies, whatever the routing) and the combine
      reduce-scatters the same buffer; the routing map and probabilities it gathers too are
      not counted (E + top_k numbers per token against h).
    - ``deepep`` (DeepEP's normal kernels behind Megatron-Core's flex dispatcher): a token goes
      once over the network to each node holding one of its experts and is forwarded over
      NVLink there (``deep_ep/buffer.py::Buffer.internode_dispatch``); inside a node it is the
      all-to-all. The node deduplication is applied to the whole exchange (NVLink included,
      which it understates; the network part dominates once EP crosses nodes)."""
    if deg.ep == 1:
        return 0.0, ("all_to_all", "all_to_all")
    assert model.moe is not None
    h, k = model.hidden_size, model.moe.top_k
    if deg.moe_dispatcher == "allgather":
        return deg.ep * tokens * h * act, ("all_gather", "reduce_scatter")
    copies = tokens * k * h * act * deg.moe_load
    if deg.moe_dispatcher == "deepep":
        copies *= node_dedup(model.moe.num_experts, k, deg.ep_nodes)
    return copies, ("all_to_all", "all_to_all")


def etp_bytes(model: Model, tokens: float, act: int, deg: ParallelDims) -> float:
    """The expert-TP group's all-gather (and, before the combine, reduce-scatter) buffer: the
    routed copies the etp ranks received, gathered whole on each (Megatron-Core
    ``token_dispatcher.py``: ``gather_from_sequence_parallel_region`` over the expert-TP group
    after the all-to-all, ``reduce_scatter_to_sequence_parallel_region`` before the combine);
    0 without expert tensor parallelism or expert parallelism."""
    if deg.etp == 1 or deg.ep == 1:
        return 0.0
    assert model.moe is not None
    return deg.etp * tokens * model.moe.top_k * model.hidden_size * act * deg.moe_load


def send_buffer_bytes(model: Model, tokens: float, act: int, deg: ParallelDims) -> float:
    """What the dispatcher stages before its exchange: the ``tokens``·top_k permuted copies
    (all-to-all, DeepEP; every rank sends its own routing, balanced) or the gathered buffer of
    the whole EP group's tokens (all-gather)."""
    assert model.moe is not None
    if deg.moe_dispatcher == "allgather":
        return deg.ep * tokens * model.hidden_size * act
    return tokens * model.moe.top_k * model.hidden_size * act


def node_dedup(num_experts: int, top_k: int, nodes: int) -> float:
    """Network copies DeepEP sends per token over those an all-to-all sends, with experts spread
    evenly over ``nodes`` nodes and each token's top_k experts drawn uniformly without
    replacement: a remote node holding j ≥ 1 of them receives one copy instead of j. Expected
    remote nodes reached, (nodes − 1)·(1 − C(E − E/nodes, k) / C(E, k)), over the expected
    remote copies, k·(nodes − 1)/nodes. 1 on one node. Node-limited routing (DeepSeek-V3's
    at most 4 nodes per token) would lower it further; not modelled."""
    if nodes <= 1:
        return 1.0
    per_node = num_experts // nodes
    miss = math.comb(num_experts - per_node, top_k) / math.comb(num_experts, top_k)
    return (nodes - 1) * (1 - miss) / (top_k * (nodes - 1) / nodes)


class Unfused(NamedTuple):
    """What the eager (unfused) permutation kernels cost, as a multiple of the fused charge, the
    (1 + k)·B·h bytes per token moved once."""

    permute: float
    unpermute: float
    permute_backward: float
    unpermute_backward: float


UNFUSED_PERMUTE = Unfused(permute=2.85, unpermute=10.15, permute_backward=17.05, unpermute_backward=7.13)
"""[MEA] Median over five MoE shapes (Mixtral-8x7B, Qwen3-30B-A3B, Qwen3-235B-A22B,
DeepSeek-V3, gpt-oss-120b; 8,192 tokens) of each eager sequence's time over a device copy of
its (1 + k)·B·h bytes, on one H200 (2026-11-27, ``benchmarks/gpu_probe.py`` sections
``moe_kernels`` and ``unpermute``; ``docs/gpu-measurements.md``): permute = argsort +
``index_select`` (Megatron-Core ``moe_utils.py::permute``; 2.05-3.91); un-permute = probability
product + ``torch.zeros`` + ``scatter_add_`` in bf16 (``unpermute``; 8.70-10.77: the atomics of
the k rows per token); the permute's backward is an ``index_add_`` into zeros (16.12-17.69);
the un-permute's backward a gather and the product's gradient (7.0-7.4, the forward and
backward of all three measured together agree within 1 %). Charged as bytes at the
memory-bound rate like every other kernel, so they scale with the device's bandwidth."""


def router_bytes(tokens: float, act: int, experts: int, top_k: int) -> float:
    """HBM bytes of the router's memory-bound kernels (:func:`moe_work`)."""
    return tokens * ((act + 12) * experts + 12 * top_k)


def permute_bytes(tokens: float, act: int, hidden: int, top_k: int) -> float:
    """HBM bytes a fused permute (or un-permute) moves once (:func:`moe_work`)."""
    return tokens * (1 + top_k) * act * hidden


def moe_work(model: Model, i: int, router_gemms: list[Gemm], experts: list[Gemm], tokens: float, act: int,
              deg: ParallelDims, mode: str, router_redo: Sequence[tuple[int, int, str]],
              fused_pointwise: bool = False, modules: frozenset[str] = frozenset(),
              fuse_wgrad: bool = False, fp8_recipe: str = "fused") -> MoEWork:
    """The router, permutation, experts and un-permutation of MoE layer ``i`` for one rank's
    ``tokens`` (:class:`MoEWork`), per micro-batch, their HBM bytes counted kernel by kernel
    [INF, after Megatron-Core ``moe/router.py::TopKRouter`` and ``moe/moe_utils.py::permute`` /
    ``unpermute``]:

    - router: the gating GEMM writes E logits per token; softmax (or sigmoid) reads them and
      writes fp32 scores, top-k reads those and writes k fp32 probabilities and k int64
      indices, the load-balancing loss reads the scores once more: (B + 12)·E + 12·k bytes
      per token; its backward about twice that (not counted kernel by kernel);
    - permute: reads each token once and writes its k copies in expert order, (1 + k)·B·h;
      un-permute reads the k copies back, scales them by their probabilities and writes the
      sum, the same bytes; the backward of each moves as much again. Unfused
      (``deg.moe_permute_fusion`` False) each is the eager sequence's measured multiple of
      that (:data:`UNFUSED_PERMUTE`);
    - experts: the grouped GEMMs (:func:`expert_gemms`) and the activation function over the
      busiest rank's copies (SwiGLU 5·B·f eager, 3·B·f fused by ``fused_pointwise``; GELU
      2·B·f: ``activations.activation_fn_bytes_per_ffn``; its backward SwiGLU 9·B·f eager,
      5·B·f fused, GELU 3·B·f: ``activation_fn_backward_bytes_per_ffn``), weights and
      intermediate split by etp.

    The full recompute repeats the whole forward, and so does selective recompute of the MoE
    layer (``modules`` holds ``moe``: Megatron-Core's ``moe_layer.py`` checkpoints the router,
    dispatch, experts and combine together); ``moe_act`` repeats the routed experts' activation
    function (``experts.py``, ``CheckpointWithoutOutput``); per-op SAC (``op``) repeats the
    routed GEMMs and the router's recomputed linears (``router_redo``). ``fuse_wgrad``: the
    experts' and the router's weight gradients accumulate into fp32 inside their GEMMs
    (``Implementation.wgrad_accumulation_fusion``). ``fp8_recipe``: the fp8 quantisation kernels
    around the grouped GEMMs (``_layers.fp8_quantize_bytes``: the permuted tokens and the
    activation function's output before them, each output gradient after them; Transformer
    Engine's ``GroupedLinear`` quantises its inputs split by expert, ``module/grouped_linear.py``),
    forward again where the experts' forward is recomputed."""
    assert model.moe is not None
    h, k, e = model.hidden_size, model.moe.top_k, model.moe.num_experts
    per_ffn = activation_fn_bytes_per_ffn(model, fused_pointwise)
    routed = tokens * k * deg.moe_load
    router = router_bytes(tokens, act, e, k)
    moved = permute_bytes(tokens, act, h, k)
    activation_bytes = routed * per_ffn * act * model.moe.expert_ffn_hidden_size / deg.etp
    cost = Unfused(1.0, 1.0, 1.0, 1.0) if deg.moe_permute_fusion else UNFUSED_PERMUTE
    fwd_router = Work.of(router_gemms, router)
    fwd_permute, fwd_unpermute = (Work(bytes_accessed=moved * cost.permute),
                                  Work(bytes_accessed=moved * cost.unpermute))
    quantize_fwd, quantize_bwd = fp8_quantize_bytes(model.layer_linears(i)["expert"], routed, deg.etp, False,
                                                    fp8_recipe, normed_input=False)
    fwd_experts = Work.of(experts, activation_bytes + quantize_fwd)
    bwd_router = Work.of([g for shape in router_gemms for g in shape.backward(fuse_wgrad)], 2 * router)
    bwd_permute = Work(bytes_accessed=moved * cost.permute_backward)
    bwd_unpermute = Work(bytes_accessed=moved * cost.unpermute_backward)
    # the activation function's backward, kernel by kernel (activation_fn_backward_bytes_per_ffn)
    activation_bwd = activation_bytes * activation_fn_backward_bytes_per_ffn(model, fused_pointwise) / per_ffn
    bwd_experts = Work.of([g for shape in experts for g in shape.backward(fuse_wgrad)],
                          activation_bwd + quantize_bwd)
    if mode == "full" or "moe" in modules:  # the whole forward again, each kernel before its own backward
        bwd_router, bwd_permute = bwd_router + fwd_router, bwd_permute + fwd_permute
        bwd_unpermute = bwd_unpermute + fwd_unpermute
        bwd_experts = bwd_experts + fwd_experts
    elif "moe_act" in modules:  # the activation function again, before the experts' backward
        bwd_experts = bwd_experts + Work(bytes_accessed=activation_bytes)
    elif mode == "op":
        bwd_experts = bwd_experts + fwd_experts  # (its quantisation with it)
        bwd_router = bwd_router + Work.of(linear_gemms(router_redo, tokens, 1))
    return MoEWork(fwd_router, fwd_permute, fwd_experts, fwd_unpermute, bwd_router, bwd_permute, bwd_experts,
                   bwd_unpermute)


# ------------------------------------------------------------------ emitting an MoE layer's ops
# ``ue`` is the unit's ``_model_parallel.UnitEmitter`` (its ``emit``, ``deg`` and group
# ``instances``), ``unit`` its ``MPUnit``: the layer's ops as ``UnitEmitter.forward`` and
# ``backward`` place them.

BACKWARD_KIND = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_to_all": "all_to_all"}
"""A collective's backward: an all-to-all's is an all-to-all, a gather's a reduce-scatter."""


def exchange(ue: Any, kind: str, unit: Any, name: str, category: str, deps: Sequence[Any],
             hidden_deps: Sequence[Any], step: int) -> Any:
    """One dispatch or combine exchange of an MoE layer (None without EP), on the compute
    stream after ``deps``. With ``moe_ep_overlap`` (Megatron-Core's ``combined_1f1b``: one
    micro-batch's exchanges while another computes) on the ``ep`` stream from ``hidden_deps``,
    beside the compute: the pass takes max(compute, exchanges) and the compute slows as under
    any overlapped collective (``comm_overlap_slowdown``). A pass the schedule runs alone (the
    warm-up forwards, the cool-down backwards: ``ue.ep_overlap`` false) has no partner to hide
    behind, and its exchanges wait on the compute stream."""
    if not unit.ep_bytes:
        return None
    overlap = ue.ep_overlap
    return ue.emit.collective(kind, ue.instances["ep"], unit.ep_bytes, name, category,
                              "ep" if overlap else "compute", hidden_deps if overlap else deps, step, launch=False)


def expert_tp(ue: Any, kind: str, unit: Any, name: str, deps: Sequence[Any], step: int) -> Any:
    """The expert-TP group's gather before the experts or reduce-scatter after them
    (:func:`etp_bytes`; None without expert tensor parallelism), on the compute stream."""
    if not unit.etp_bytes:
        return None
    return ue.emit.collective(kind, ue.instances["etp"], unit.etp_bytes, name, "etp", "compute", deps, step,
                              launch=False)


def emit_forward(ue: Any, unit: Any, label: str, last: Any, deps: Sequence[Any], step: int, free: Any) -> Any:
    """After the attention block (``last``) and its TP collective: router, permute, dispatch,
    (expert-TP gather,) grouped GEMM, (reduce-scatter,) combine, un-permute, which frees what
    the forward frees."""
    emit, moe, overlap = ue.emit, unit.moe, ue.ep_overlap
    router = emit.compute(f"fwd.router.{label}", "moe_router", moe.router, [last], step)
    permute = emit.compute(f"fwd.permute.{label}", "moe_permute", moe.permute, [router], step)
    if unit.ep_bytes:
        # the exchange's split sizes are the router's token counts, copied to the host, which
        # waits for them before it calls the exchange (Megatron-Core ``moe/token_dispatcher.py::
        # MoEAlltoAllTokenDispatcher.preprocess``: cuda_sync_point "before_ep_alltoall", then
        # ``_maybe_dtoh_and_synchronize``; torchtitan ``models/common/token_dispatcher.py::
        # AllToAllTokenDispatcher._sync_token_count_exchange``: ``splits.tolist()``; the
        # permutation was launched before it): from here the host is no longer ahead of the
        # device. The wait itself costs no host time; the launches after it are what the
        # device may then wait for
        emit.host(f"sync.moe_splits.{label}", 0.0, step, sync=[router])
    dispatch_kind, combine_kind = unit.ep_kinds
    dispatch = exchange(ue, dispatch_kind, unit, f"ep.dispatch.{label}", "ep_dispatch", [permute], deps, step)
    arrived = permute if overlap else dispatch
    gathered = expert_tp(ue, "all_gather", unit, f"etp.fwd.{label}", [arrived], step)
    experts = emit.compute(f"fwd.experts.{label}", "moe_grouped_gemm", moe.experts, [gathered or arrived], step)
    scattered = expert_tp(ue, "reduce_scatter", unit, f"etp.fwd.rs.{label}", [experts], step)
    combine = exchange(ue, combine_kind, unit, f"ep.combine.{label}", "ep_combine", [scattered or experts],
                       [dispatch], step)
    return emit.compute(f"fwd.unpermute.{label}", "moe_permute", moe.unpermute, [experts, combine], step, free=free)


def emit_backward(ue: Any, unit: Any, label: str, deps: Sequence[Any], step: int, alloc: Any) -> Any:
    """The expert half of an MoE layer's backward, in autograd's order: (the full recompute's
    dispatch and combine again,) the combine's backward exchange, the un-permutation's backward,
    (the expert-TP reduce-scatter's backward gather,) the experts' data and weight gradients,
    (the gather's backward reduce-scatter,) the dispatch's backward exchange, the permutation's
    and the router's backward. ``alloc`` is taken by its first compute op."""
    emit, moe, overlap = ue.emit, unit.moe, ue.ep_overlap
    dispatch_kind, combine_kind = unit.ep_kinds
    last: Sequence[Any] = deps
    if unit.ep_recomputed and unit.ep_bytes:
        redo = exchange(ue, dispatch_kind, unit, f"ep.dispatch.redo.{label}", "ep_dispatch", last, deps, step)
        last = [exchange(ue, combine_kind, unit, f"ep.combine.redo.{label}", "ep_combine", [redo], [redo], step)]
    combine = exchange(ue, BACKWARD_KIND[combine_kind], unit, f"ep.combine.bwd.{label}", "ep_combine", last, last, step)
    unpermute = emit.compute(f"bwd.unpermute.{label}", "moe_permute", moe.unpermute_backward,
                             [*deps, *([] if overlap else [combine])], step, alloc=alloc)
    gathered = expert_tp(ue, "all_gather", unit, f"etp.bwd.{label}", [unpermute], step)
    experts = emit.compute(f"bwd.experts.{label}", "moe_grouped_gemm", moe.experts_backward, [gathered or unpermute],
                           step)
    experts = expert_tp(ue, "reduce_scatter", unit, f"etp.bwd.rs.{label}", [experts], step) or experts
    dispatch = exchange(ue, BACKWARD_KIND[dispatch_kind], unit, f"ep.dispatch.bwd.{label}", "ep_dispatch", [experts],
                        [combine] if combine else deps, step)
    permute = emit.compute(f"bwd.permute.{label}", "moe_permute", moe.permute_backward, [experts, dispatch], step)
    return emit.compute(f"bwd.router.{label}", "moe_router", moe.router_backward, [permute], step)
