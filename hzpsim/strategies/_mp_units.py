"""What one model-parallel rank holds and runs of each unit (embedding, layers, head):
:func:`mp_units` builds the :class:`MPUnit` list from the model, the training and the parallel
degrees (tensor + sequence, context and expert parallelism), :func:`merge_units` runs
consecutive dense units as one. ``_model_parallel.UnitEmitter`` writes them as ops and
collectives; the search's bounds (``_bounds``) price them without a graph. Communication per
layer is described in ``_model_parallel``'s docstring."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

from hzpsim.model import Model
from hzpsim.model.activations import (
    ROPE_FORMS,
    activation_fn_bytes_per_ffn,
    elementwise_backward_over_forward,
    input_gradient_adds,
    rope_bytes_per_element,
)
from hzpsim.model.checkpointing import mla_up_projections, recomputed_norms
from hzpsim.model.kernels import Attention, Gemm, Shape
from hzpsim.model.ops import MemoryDelta, memory_delta
from hzpsim.model.training import Training
from hzpsim.strategies import _moe
from hzpsim.strategies._dims import ParallelDims
from hzpsim.strategies._implementations import Implementation, loss_bytes_per_logit
from hzpsim.strategies._layers import Work, fp8_quantize_bytes, linear_gemms
from hzpsim.strategies._moe import MoEWork


@dataclass(frozen=True, kw_only=True)
class MPUnit:
    """One unit (embedding, layer or head) as one model-parallel rank holds and runs it, per
    micro-batch."""

    name: str
    dense_params: float
    """Parameters on this rank reduced over the dense data-parallel (dp × cp) group (count)."""
    expert_params: float = 0.0
    """Expert parameters on this rank, reduced over the expert-data-parallel group (count)."""
    pre: Work
    """Forward before the CP exchange lands (or the whole forward without CP)."""
    remote: Work = Work()
    """Forward attention over the other ranks' K/V (CP only)."""
    post: Work = Work()
    """Forward after attention (the MLP; the experts of an MoE layer)."""
    backward: Work
    """Backward, recompute included, before the CP exchange is needed."""
    backward_remote: Work = Work()
    """Backward attention of the remote chunks (CP only)."""
    activation_bytes: float
    """Activations kept from the forward to the backward."""
    recompute_bytes: float = 0.0
    """Activations rebuilt by the recompute, held during the backward."""
    forward_temps: tuple[float, ...] = ()
    """Eager temporaries alive only while the forward runs, bytes per tensor (the loss's logits
    and their fp32 copy): taken when it starts, returned when it ends."""
    backward_temps: tuple[float, ...] = ()
    """Eager temporaries of the loss's backward (its fp32 gradients). The loss's backward runs
    as an op of its own before the rest of the unit's backward: autograd reaches the head's
    pre-backward hooks (FSDP2's re-gather, its gradient buffer) only after the loss's nodes ran."""
    loss_backward_bytes: float = 0.0
    """HBM bytes of the loss's backward (part of ``backward``), run first when ``backward_temps``."""
    loss_saved_bytes: float = 0.0
    """Part of ``activation_bytes`` the loss keeps (its fp32 log-softmax / softmax), freed by
    the loss's backward."""
    extra_grad_bytes: float = 0.0
    """Gradient bytes this rank keeps beyond its share of ``dense_params`` for the whole step
    (a replicated embedding gradient, Implementation.tp_replicated_embedding_grad)."""
    loss_grad_bytes: float = 0.0
    """The logits' gradient the loss's backward hands the head's GEMM backward (in the logits'
    dtype), held until that backward ends."""
    tp_bytes: float = 0.0
    """One TP collective's buffer (b·s/c·h elements in the activation dtype; the full buffer of
    a sequence-parallel all-gather or reduce-scatter); 0 without TP."""
    tp_count_forward: int = 0
    """TP all-reduces in the forward (0 with sequence parallelism)."""
    tp_count_backward: int = 0
    """TP all-reduces in the backward."""
    tp_gathers_forward: int = 0
    """Sequence-parallel all-gathers in the forward."""
    tp_scatters_forward: int = 0
    """Sequence-parallel reduce-scatters in the forward."""
    tp_gathers_backward: int = 0
    """Sequence-parallel all-gathers in the backward (the recompute's included)."""
    tp_scatters_backward: int = 0
    """Sequence-parallel reduce-scatters in the backward (the recompute's included)."""
    tp_logits_bytes: float = 0.0
    """The head's vocabulary-sharded logits as one all-gather buffer (b·s/c·V elements), for an
    implementation that gathers them (``Implementation.tp_gathers_logits``); 0 elsewhere."""
    tp_sp_params: float = 0.0
    """Parameters replicated over the TP group whose gradients are partial sums under sequence
    parallelism (the norms): all-reduced over the TP group once per step."""
    cp_bytes: float = 0.0
    """CP ring all-gather buffer (c chunks of K and V); 0 without CP."""
    ep_bytes: float = 0.0
    """Bytes of one dispatch or combine exchange as the dispatcher moves them on the busiest
    rank (:func:`_moe.dispatch`); 0 for dense layers or without EP."""
    etp_bytes: float = 0.0
    """The expert-TP group's all-gather / reduce-scatter buffer around the experts (``_moe.etp_bytes``)."""
    ep_kinds: tuple[str, str] = ("all_to_all", "all_to_all")
    """Collective kinds of the forward's dispatch and combine (their backwards swap them)."""
    ep_recomputed: bool = False
    """The full recompute repeats the forward's dispatch and combine in the backward."""
    moe: MoEWork | None = None
    """An MoE layer's router, permutation, grouped GEMM and un-permutation, as their own ops."""
    p2p_bytes: float = 0.0
    """Activation this unit hands to the next pipeline stage."""
    is_moe: bool = False
    """An MoE layer (its MLP talks through the expert dispatcher)."""
    tensors: tuple[float, ...] = ()
    """Dense parameter tensors on this rank (elements each, forward order): what a framework
    that gathers or reduces per tensor issues one collective for."""
    expert_tensors: tuple[float, ...] = ()
    """Expert parameter tensors on this rank."""
    kernels_forward: float = 0.0
    """Eager kernels the forward launches (host launch cost)."""
    kernels_backward: float = 0.0
    """Eager kernels the backward launches, the recompute included."""

    @property
    def loss_split(self) -> bool:
        """The loss's backward runs as an op of its own (UnitEmitter.loss_backward)."""
        return bool(self.backward_temps and self.loss_backward_bytes)

    @cached_property
    def forward_work(self) -> Work:
        """The forward's work as one op (``pre`` + ``post``), added up once per unit."""
        return self.pre + self.post

    @cached_property
    def activation_memory(self) -> _PassMemory:
        """What the unit's passes take and return when it has no sharded parameters (a merged
        unit): its activations only."""
        return _pass_memory(self)

    def tp_calls(self, forward: bool, gathers_logits: bool = False) -> list[tuple[str, int, float]]:
        """The pass's TP collectives as (kind, calls, bytes per call), in the order emitted:
        all-reduces, or the sequence-parallel all-gathers and reduce-scatters, and the head's
        logits gather when the implementation gathers them (forward, last)."""
        if not self.tp_bytes:
            return []
        if forward:
            counts = (self.tp_count_forward, self.tp_gathers_forward, self.tp_scatters_forward)
        else:
            counts = (self.tp_count_backward, self.tp_gathers_backward, self.tp_scatters_backward)
        calls = [(kind, n, self.tp_bytes) for kind, n in zip(("all_reduce", "all_gather", "reduce_scatter"), counts) if n]
        if forward and gathers_logits and self.tp_logits_bytes:
            calls.append(("all_gather", 1, self.tp_logits_bytes))
        return calls


def _tp_calls(role: str, per_pass: int, deg: ParallelDims, recompute: str, mlp_again: bool = False) -> dict[str, Any]:
    """MPUnit's TP call counts for a unit whose non-sequence-parallel forward all-reduces
    ``per_pass`` times: ``role`` "embed" (forward only: VocabParallelEmbedding's
    reduce_from_tensor_model_parallel_region), "head" (backward only: the output layer's
    copy_to_tensor_model_parallel_region) or "layer" (both; the full recompute repeats the
    forward's). With sequence parallelism every all-reduce becomes the pair of
    mappings.py's gather and reduce-scatter, whose backwards are each other. Per-op selective
    checkpointing (``op``) saves the functional ``reduce_scatter_tensor``'s output but not the
    all-gather's or the all-reduce's: the recompute issues those again (torchtitan's
    ``_save_list``; under torch.compile the partitioner recomputes collectives that a user's
    checkpoint policy marks, ``torch/_functorch/partitioners.py::force_save_collectives``).
    ``mlp_again``: selective recompute of a dense layer's MLP (``recompute_modules: [mlp]``)
    re-enters its row-parallel output's collective (and, with sequence parallelism, its
    input's gather): one forward call more in the backward."""
    if deg.tp == 1 or not per_pass:
        return {}
    again = 2 if recompute in ("full", "op") else 1
    scatters_again = 2 if recompute == "full" else 1
    extra = 1 if mlp_again and recompute == "selective" and role == "layer" else 0
    if not deg.sequence_parallel:
        forward = per_pass if role != "head" else 0
        backward = {"embed": 0, "head": per_pass, "layer": per_pass * again + extra}[role]
        return {"tp_count_forward": forward, "tp_count_backward": backward}
    if role == "embed":  # reduce_scatter_to_sequence_parallel_region; its backward gathers
        return {"tp_scatters_forward": per_pass, "tp_gathers_backward": per_pass}
    if role == "head":  # gather_from_sequence_parallel_region; its backward reduce-scatters
        return {"tp_gathers_forward": per_pass, "tp_scatters_backward": per_pass}
    return {"tp_gathers_forward": per_pass, "tp_scatters_forward": per_pass,
            "tp_gathers_backward": per_pass * again + extra, "tp_scatters_backward": per_pass * scatters_again + extra}


#: torch.compile fuses the pointwise kernels between two GEMMs into one Inductor kernel
#: [INF, from Inductor's pointwise fusion], and Megatron-LM / Transformer Engine model code does
#: the same by hand (``training.fused_kernels``: megatron/model/fused_bias_dropout.py
#: ``bias_dropout_add_fused_train``, TE's fused norm and residual paths): a residual add and the norm after it become one
#: kernel that reads the two summands and writes the sum and the normalised output (4·B·h
#: per token where eager moves 3·B·h + 2·B·h), and the dropout's read and write fold into
#: the same kernel (its 1-byte mask remains); RoPE and GELU are single kernels already, and
#: SwiGLU's ``silu`` and product become one (``activations.activation_fn_bytes_per_ffn``).
#: Factor on each ``Model.elementwise_bytes_per_token`` term.
_FUSED_BY_COMPILE = {"norms": 1.0, "residual_adds": 2.0 / 3.0, "dropouts": 1.0 / 5.0}


def score_bytes_per_pair(act: int, dropout: bool, fused: bool) -> tuple[float, float]:
    """HBM bytes of unfused causal attention's memory-bound kernels per head and query-key
    pair, forward and backward, with B = ``act`` bytes per element. The kernels between the
    score GEMM (``baddbmm``) and the value GEMM (``bmm``), Megatron-LM v2.5
    ``megatron/model/transformer.py::ParallelAttention.forward`` (``CoreAttention`` from 23.04):

    - ``fused`` (Megatron's ``FusedScaleMaskSoftmax`` with the causal mask,
      ``fused_kernels/scaled_upper_triang_masked_softmax.h``): the forward kernel loads only
      the elements at or below the diagonal (``element_index < local_seq``, half the square)
      and stores every element, the masked ones as zeros: B/2 + B. Its backward loads the
      output gradient and the saved probabilities below the diagonal and stores the whole
      input gradient: B/2 + B/2 + B.
    - eager (PyTorch's ``masked_fill_`` then ``softmax``, the same module's unfused branch):
      the mask pass reads and writes the square (2B), the softmax reads and writes it (2B);
      backward ``_softmax_backward_data`` reads the gradient and the output and writes (3B)
      and ``masked_fill``'s backward reads and writes the gradient (2B).
    - dropout on the probabilities (``native_dropout``: read B, write B and a 1-byte mask;
      ``native_dropout_backward``: read the gradient and the mask, write B), where the model
      has dropout.

    The score GEMM's write and the value GEMM's read of the probabilities are the GEMMs' own
    operands (``ComputeModel.gemm_s``), not counted here. Megatron-LM v2.5 takes the fused
    kernel only for keys up to 2048 (``FusedScaleMaskSoftmax.forward``'s
    ``custom_kernel_constraint``; later versions raised it); longer sequences with
    ``fused_kernels`` are still charged the fused kernel's bytes, and so is ``compile``
    (``Training.fused_pointwise``), whose fused softmax is not counted on its own."""
    forward, backward = (1.5 * act, 2.0 * act) if fused else (4.0 * act, 5.0 * act)
    if dropout:
        forward += 2 * act + 1
        backward += 2 * act + 1
    return forward, backward


LOSS_KERNELS_BACKWARD = 5
"""Eager kernels of the loss's backward (ones_like, nll_loss_backward,
_log_softmax_backward_data, view, the cast back: counted in the head's ``kernels_backward``)."""


def mp_units(model: Model, training: Training, deg: ParallelDims,
             implementation: Implementation | None = None) -> list[MPUnit]:
    """Units (embedding, layers, head) as one model-parallel rank holds and runs them.

    ``implementation`` sets what the loss keeps and its eager temporaries
    (:func:`~hzpsim.strategies._implementations.loss_bytes_per_logit`); None: the fp32
    log-softmax only and no temporaries, the least any implementation holds (the search's
    memory bound)."""
    t, c = deg.tp, deg.cp
    fuse_wgrad = implementation is not None and implementation.wgrad_accumulation_fusion
    b = training.micro_batch_size
    tokens = b * model.seq_len
    act = 4 if training.precision == "fp32" else 2
    elementwise_bytes = 4 if training.autocast else act  # autocast keeps the residual stream in fp32
    h, vocab = model.hidden_size, model.vocab_size
    local = tokens / c  # tokens of this rank's sequence chunk
    sp_tokens = local / t if deg.sequence_parallel else local  # tokens an MoE layer routes per rank
    tp_bytes = local * h * act if t > 1 else 0.0
    p2p_bytes = local * h * act / t  # Megatron's scatter/gather: each TP rank sends 1/t
    mode = training.activation_recompute
    chosen = training.recomputed_modules  # selective recompute's submodules (Megatron-Core's)
    # what autograd keeps: eager PyTorch model code unless fused (None: the least, for bounds)
    eager = implementation is not None and implementation.eager_model_code and not training.fused_pointwise
    gathered_inputs = implementation is not None and implementation.sp_saves_gathered_inputs
    # RoPE's bytes per rotated element of Q and K (the linears' outputs, in the compute dtype also
    # under autocast), forward and backward, as the profile's model code writes it (None: the
    # least of the forms, for bounds)
    forms = (implementation.rope_form,) if implementation is not None else ROPE_FORMS
    rope_b = tuple(min(rope_bytes_per_element(f, act, training.fused_pointwise)[j] for f in forms)
                   for j in (0, 1))
    float8 = training.precision == "fp8"
    # the fp8 recipe's quantisation kernels (_layers.fp8_quantize_bytes); none for the bounds
    # (implementation None: the least) and where torch.compile fuses the casts
    fp8_recipe = implementation.fp8_recipe_for(training) if implementation is not None else "fused"
    units: list[MPUnit] = []

    lookup = Work(bytes_accessed=2.0 * local * h * act / (t if deg.sequence_parallel else 1))
    # DTensor's vocab-sharded embedding gets a replicated gradient of the whole table on every
    # TP rank (Implementation.tp_replicated_embedding_grad): one more whole table while each
    # micro-batch's backward runs, and the accumulated .grad whole rather than sharded
    whole_table = model.vocab_size * h * training.grad_element_bytes
    replicated = t > 1 and implementation is not None and implementation.tp_replicated_embedding_grad
    units.append(MPUnit(
        name="embed", dense_params=model.embedding_params() / t, pre=lookup, backward=lookup.scaled(2),
        backward_temps=(whole_table,) if replicated else (),
        extra_grad_bytes=whole_table * (1 - 1 / t) if replicated else 0.0,
        activation_bytes=0.0, tp_bytes=tp_bytes, **_tp_calls("embed", 1, deg, mode), p2p_bytes=p2p_bytes,
        # eager ATen ops: embedding / embedding_dense_backward + detach (AccumulateGrad); learned
        # positions add arange, embedding, add / sum, view (their broadcast), the same two
        tensors=(model.embedding_params() / t,),
        kernels_forward=1 + (3 if model.position_embedding == "learned" else 0),
        kernels_backward=2 + (4 if model.position_embedding == "learned" else 0),
    ))
    kv_per_rank = max(model.kv_heads / t, 1.0)
    fused = training.fused_attention
    d_qk, d_v = model.head_dim_resolved, model.v_head_dim_resolved
    heads = b * model.num_heads / t  # (batch × heads) this rank attends for
    if fused:  # one flash-style kernel; causal: the kernel skips the masked half
        full_core: list[Attention] = [Attention(heads, model.seq_len / c, model.seq_len, d_qk, d_v, True,
                                                training.attention_kernel)]
        attn_core, attn_scores = full_core, []
    else:  # the score and value products as batched GEMMs over every (query, key) pair
        full_core = attn_core = []
        attn_scores = [Gemm(model.seq_len / c, model.seq_len, d_qk, 1.0, heads),
                       Gemm(model.seq_len / c, d_v, model.seq_len, 1.0, heads)]  # one batched kernel each
    alike: dict[Hashable, MPUnit] = {}  # a layer of each kind (Model.layer_kind): the others are alike
    for i in range(model.num_layers):
        layer_kind = model.layer_kind(i)
        if layer_kind in alike:
            units.append(dataclasses.replace(alike[layer_kind], name=f"layer{i}"))
            continue
        linears = model.layer_linears(i)
        attn_gemms = linear_gemms(linears["attention"], local, t)
        window = model.attention_window(i)
        if fused:  # a windowed layer's kernel visits only the band (the unfused path scores every pair)
            attn_core = [full_core[0]._replace(window=float(window))] if window is not None else full_core
        stored = model.activation_bytes_per_layer(
            i, b, tp=t, sequence_parallel=deg.sequence_parallel, recompute="none",
            flash_attention=fused, cp=c, act_bytes=act, eager=eager, gathered_inputs=gathered_inputs,
            moe_load=deg.moe_load,
        )
        kept = model.activation_bytes_per_layer(
            i, b, tp=t, sequence_parallel=deg.sequence_parallel, recompute=mode,
            flash_attention=fused, cp=c, act_bytes=act, float8=float8, eager=eager, gathered_inputs=gathered_inputs,
            moe_load=deg.moe_load, modules=training.recompute_modules,
        )
        traffic = traffic_bwd = 0.0  # the memory-bound kernels' bytes, forward and backward
        by_term: dict[str, float] = {}  # each term's share of the traffic (selective recompute's)
        moe = model.is_moe_layer(i)
        for name, (per_token, kind) in model.elementwise_bytes_per_token(i, elementwise_bytes).items():
            if moe and name == "permute":  # the MoE ops' own (_moe.moe_work)
                continue
            if moe and name == "activation_fn":  # the shared experts'; the routed ones' in _moe.moe_work
                assert model.moe is not None
                per_token *= (model.moe.num_shared_experts * model.moe.shared_ffn_resolved) / (
                    model.moe.top_k * model.moe.expert_ffn_hidden_size
                    + model.moe.num_shared_experts * model.moe.shared_ffn_resolved)
            per_token /= t if kind == "split" or deg.sequence_parallel else 1
            if name == "rope":  # per_token: one read and write of Q and K; the fused kernel's or the eager form's bytes
                traffic_bwd += per_token * rope_b[1] / (2 * elementwise_bytes)
                by_term[name] = per_token * rope_b[0] / (2 * elementwise_bytes)
                traffic += by_term[name]
                continue
            # each kernel's backward, counted from its autograd formula (the eager forward's multiple)
            traffic_bwd += per_token * elementwise_backward_over_forward(model, name, elementwise_bytes,
                                                                        training.pointwise_fusion)
            if training.fused_pointwise and name in _FUSED_BY_COMPILE:
                per_token *= _FUSED_BY_COMPILE[name]
            elif training.fused_pointwise and name == "activation_fn":
                per_token *= activation_fn_bytes_per_ffn(model, True) / activation_fn_bytes_per_ffn(model, False)
            by_term[name] = per_token
            traffic += by_term[name]
        if eager:  # separate projections reading one input (q, k, v; gate and up): autograd sums
            # their input gradients, one eager add each (3·B·h per token; Model.layer_kernels_forward).
            # On every token of the micro-batch, also under sequence parallelism: the projections
            # read the input after its all-gather (torchtitan's PrepareModuleInput redistributes
            # Shard(1) -> Replicate() once per block), so the adds sum Partial gradients of the
            # whole sequence, and the reduce-scatter back to Shard(1) comes after them
            traffic_bwd += 3 * elementwise_bytes * h * input_gradient_adds(model, i)
        if training.autocast:  # each GEMM input is cast fp32 -> bf16: read 4, write 2 bytes; its
            # backward casts the gradient back (read 2, write 4)
            d = model.head_dim_resolved
            ffn = (model.moe.top_k * model.moe.expert_ffn_hidden_size) if model.is_moe_layer(i) and model.moe else model.ffn_hidden_size
            casts = 6 * (2 * h + model.num_heads * d / t + ffn / t)
            traffic, traffic_bwd = traffic + casts, traffic_bwd + casts
        traffic, traffic_bwd = traffic * local, traffic_bwd * local
        # unfused attention: the memory-bound kernels between the score and value GEMMs, over
        # this rank's heads and every query-key pair (score_bytes_per_pair); the GEMMs' own
        # reads and writes of the scores are in their shapes (ComputeModel.gemm_s)
        score_fwd = score_bwd = 0.0
        if not fused:
            pairs = model.num_heads / t * local * model.seq_len
            per_pair = score_bytes_per_pair(act, model.dropout, training.fused_pointwise)
            score_fwd, score_bwd = per_pair[0] * pairs, per_pair[1] * pairs
        norms = model.norm_params_per_layer()
        experts: list[Gemm] = []
        router: list[Gemm] = []
        if moe:
            assert model.moe is not None
            experts = _moe.expert_gemms(model, linears["expert"], sp_tokens, deg)
            router = linear_gemms(linears["router"], sp_tokens, 1)
            mlp_gemms = linear_gemms(linears["mlp"], local, t)  # the shared experts
            dense_params = model.attention_params() / t + norms + model.router_params() + (
                model.moe.num_shared_experts * model.shared_expert_params() / t
            )
            expert_params = model.moe.num_experts * model.expert_params() / (deg.ep * deg.etp)
            ep_bytes, ep_kinds = _moe.dispatch(model, sp_tokens, act, deg)
        else:
            mlp_gemms = linear_gemms(linears["mlp"], local, t)
            dense_params = model.layer_params(i) / t + norms * (1 - 1 / t)
            expert_params = 0.0
            ep_bytes, ep_kinds = 0.0, ("all_to_all", "all_to_all")
        pre_shapes = [*attn_gemms, *attn_scores]
        # fp8: no extra traffic is charged for the casts to fp8. Transformer Engine fuses them
        # into the producing kernel (LayerNormLinear; delayed scaling needs no amax pass) and
        # torch.compile fuses torchao's float8 casts likewise; the GEMM then reads a 1-byte
        # operand instead of a 2-byte one. Eager torchao float8 (unfused casts) is not modelled.
        forward_shapes: list[Gemm] = [*pre_shapes, *mlp_gemms]  # the MoE ops apart (_moe.moe_work)
        # backward: each GEMM's data- and weight-gradient GEMMs; the attention kernel's backward;
        # the memory-bound kernels' backwards, each counted (traffic_bwd)
        # (a weight's gradient accumulated into fp32 in the GEMM where the framework fuses it)
        backward_shapes: list[Shape] = [g for shape in (*attn_gemms, *mlp_gemms) for g in shape.backward(fuse_wgrad)]
        backward_shapes += [g for shape in attn_scores for g in shape.backward()]
        backward_shapes += [a._replace(backward=True) for a in attn_core]
        backward_traffic = traffic_bwd + score_bwd
        if mode == "full":  # the whole forward again
            backward_shapes += [*forward_shapes, *attn_core]
            backward_traffic += traffic + score_fwd
        elif mode == "selective":  # the modules recompute_modules names (checkpointing.RECOMPUTE_MODULES)
            if "core_attn" in chosen:  # the attention core again: its softmax and dropout too
                backward_shapes += [*attn_core, *attn_scores]
                backward_traffic += score_fwd
            if "mla_up_proj" in chosen:  # the up-projections again (RoPE: not counted for MLA)
                backward_shapes += linear_gemms(mla_up_projections(model), local, t)
            if ("mlp" in chosen and not moe) or (moe and ("shared_experts" in chosen or "moe" in chosen)):
                # the dense MLP (or the shared experts, inside the MoE layer) again: GEMMs and
                # activation function
                backward_shapes += mlp_gemms
                backward_traffic += by_term.get("activation_fn", 0.0) * local
            # the recomputed norms: each half the layer's norm traffic (two norms)
            backward_traffic += len(recomputed_norms(model, i, chosen)) * by_term["norms"] / 2 * local
        elif mode == "op":  # per-op SAC: the linears not saved and every memory-bound kernel
            redo = model.op_sac_recomputed_linears(i, float8=float8)
            backward_shapes += [*linear_gemms(redo["attention"], local, t), *linear_gemms(redo["mlp"], local, t), *attn_scores]
            backward_traffic += traffic + score_fwd
        # fp8: each block's operands quantised (the attention's input out of its norm; the MLP's
        # too in a dense layer, where TE's LayerNormMLP-style linear fuses the norm, but not in
        # an MoE layer, whose pre-MLP norm stands alone), again where the forward is recomputed
        q_attn = fp8_quantize_bytes(linears["attention"], local, t, deg.sequence_parallel, fp8_recipe, True)
        q_mlp = fp8_quantize_bytes(linears["mlp"], local, t, deg.sequence_parallel, fp8_recipe, not moe)
        backward_traffic += q_attn[1] + q_mlp[1]
        if mode in ("full", "op"):
            backward_traffic += q_attn[0] + q_mlp[0]
        elif mode == "selective" and (("mlp" in chosen and not moe) or (moe and ("shared_experts" in chosen or "moe" in chosen))):
            backward_traffic += q_mlp[0]
        attn_local = Work.of(attn_core).scaled(1 / c) if c > 1 else Work.of(attn_core)
        attn_remote = Work.of(attn_core).scaled(1 - 1 / c) if c > 1 else Work()
        pre = Work.of(pre_shapes, traffic * 0.5 + score_fwd + q_attn[0]) + attn_local
        post = Work.of(mlp_gemms, traffic * 0.5 + q_mlp[0])
        moe_work = None
        if moe:  # the MLP block runs around the dispatcher: its shared experts with the attention
            pre, post = pre + post, Work()
            moe_work = _moe.moe_work(model, i, router, experts, sp_tokens, elementwise_bytes, deg, mode,
                                     redo["router"] if mode == "op" else [], training.fused_pointwise, chosen,
                                     fuse_wgrad, fp8_recipe)
        local_bwd: list[Shape] = [s for s in backward_shapes if not isinstance(s, Attention)]
        local_bwd += [a._replace(calls=a.calls / c) for a in backward_shapes if isinstance(a, Attention)]
        backward = Work.of(local_bwd, backward_traffic)
        remote_bwd = [a._replace(calls=a.calls * (1 - 1 / c)) for a in backward_shapes if isinstance(a, Attention)]
        backward_remote = Work.of(remote_bwd) if c > 1 else Work()
        cp_bytes = c * 2 * (model.seq_len / c) * b * kv_per_rank * model.head_dim_resolved * act if c > 1 else 0.0
        tp_count = (1 if moe else 2) if t > 1 else 0
        dense_tensors, expert_tensors = model.layer_tensors(i)
        # eager: every ATen op the layer dispatches (Model.layer_kernels_forward); fused (torch.compile,
        # or Megatron / Transformer Engine's hand-fused model code): the fused program's kernels,
        # its backward about twice as many
        if training.fused_pointwise:
            kernels = model.layer_kernels_fused(i, fused)
            if moe:  # one launch per expert linear counted there: one grouped GEMM each, or the local experts'
                assert model.moe is not None
                per_linear = 1 if deg.moe_grouped_gemm else model.moe.num_experts // deg.ep
                kernels += (per_linear - model.moe.num_experts) * len(linears["expert"])
            kernels_backward = 2 * kernels
        else:
            kernels = model.layer_kernels_forward(i, fused)
            kernels_backward = model.layer_kernels_forward(i, fused, backward=True)
        local_experts_t = expert_tensors[: len(expert_tensors) // deg.ep] if expert_tensors else ()
        units.append(MPUnit(
            name=f"layer{i}", dense_params=dense_params, expert_params=expert_params, pre=pre, remote=attn_remote,
            post=post, backward=backward, backward_remote=backward_remote, activation_bytes=kept,
            recompute_bytes=max(stored - kept, 0.0) if mode != "none" else 0.0, tp_bytes=tp_bytes,
            # the full recompute reruns the forward, its TP collectives included (Megatron
            # mpu.checkpoint / CheckpointFunction re-enters RowParallelLinear's all-reduce)
            **_tp_calls("layer", tp_count, deg, mode, mlp_again=not moe and "mlp" in chosen),
            # norms and row-parallel biases (Megatron marks both ``sequence_parallel``)
            tp_sp_params=(norms + (tp_count * h if model.linear_bias else 0.0)) if t > 1 and deg.sequence_parallel else 0.0,
            cp_bytes=cp_bytes, ep_bytes=ep_bytes, ep_kinds=ep_kinds,
            etp_bytes=_moe.etp_bytes(model, sp_tokens, act, deg) if moe else 0.0,
            ep_recomputed=mode == "full" or (moe and "moe" in chosen), moe=moe_work,
            p2p_bytes=p2p_bytes, is_moe=moe,
            tensors=tuple(x if x == h else x / t for x in dense_tensors),
            expert_tensors=tuple(x / deg.etp for x in local_experts_t),
            kernels_forward=kernels, kernels_backward=kernels_backward + (kernels if mode in ("full", "op") else 0),
            # the dispatcher's send buffer lives while the forward runs: the permuted copies
            # (all-to-all, DeepEP) or the gathered tokens (all-gather), before the exchange
            forward_temps=(_moe.send_buffer_bytes(model, sp_tokens, act, deg),) if moe and ep_bytes else (),
        ))
        alike[layer_kind] = units[-1]
    head_gemm = Gemm(local, vocab / t, h)
    # The loss, kernel by kernel per logit [INF]: the GEMM writes bf16 logits (2 bytes), the
    # cast to fp32 reads 2 and writes 4, log-softmax reads 4 and writes 4 (kept for the
    # backward); backward: its gradient reads 4 and writes 4, the cast to bf16 reads 4, writes 2.
    elements = local * vocab / t
    # the loss runs on the gathered logits where the implementation gathers them
    loss_elements = local * vocab if t > 1 and implementation is not None and implementation.tp_gathers_logits else elements
    forward_temps: tuple[float, ...]
    backward_temps: tuple[float, ...]
    held = 0.0  # the logits, when the training loop keeps them through the backward
    if implementation is None:
        kept, forward_temps, backward_temps = 4.0, (), ()
    else:
        loss = implementation.tp_loss if t > 1 and implementation.tp_loss else implementation.loss
        kept, forward_temps, backward_temps = loss_bytes_per_logit(loss, act)
        if implementation.logits_held_through_backward and loss != "fused":
            held, forward_temps = act * loss_elements, forward_temps[1:]
    # the final norm keeps its input, the head's GEMM its input (the norm's output), per token;
    # eager RMSNorm also its normalised input and fp32 reciprocal RMS (activations.py, eager)
    head_tokens = local / t if deg.sequence_parallel else local
    norm_kept = (2 * act * h + ((act * h + 4) if eager and model.norm == "rmsnorm" else 0.0)) * head_tokens
    units.append(MPUnit(
        name="head", dense_params=(model.head_params() / t) + model.final_norm_params(),
        pre=Work.of([head_gemm], 16 * elements),
        backward=Work.of(list(head_gemm.backward(fuse_wgrad)), 14 * elements), activation_bytes=kept * loss_elements + norm_kept + held,
        loss_backward_bytes=14 * elements if backward_temps else 0.0, loss_saved_bytes=kept * loss_elements,
        loss_grad_bytes=act * loss_elements if backward_temps else 0.0,
        forward_temps=tuple(b * loss_elements for b in forward_temps),
        backward_temps=tuple(b * loss_elements for b in backward_temps),
        tp_bytes=tp_bytes, **_tp_calls("head", 1, deg, mode), p2p_bytes=p2p_bytes,
        tp_logits_bytes=local * vocab * act if t > 1 else 0.0,
        tp_sp_params=model.final_norm_params() if t > 1 and deg.sequence_parallel else 0.0,
        tensors=((model.head_params() / t) + model.final_norm_params(),),
        # eager ATen ops: the final norm, the LM head's linear (4 / 9, Model.layer_kernels_forward)
        # and the cross-entropy loss (view, view, _log_softmax, nll_loss_forward, detach /
        # ones_like, nll_loss_backward, _log_softmax_backward_data, view, ...: 5 / 5, counted)
        kernels_forward=model.norm_ops()[0] + 4 + 5, kernels_backward=model.norm_ops()[1] + 9 + 5,
    ))
    return units


TP_COUNT_FIELDS = ("tp_count_forward", "tp_count_backward", "tp_gathers_forward", "tp_scatters_forward",
                   "tp_gathers_backward", "tp_scatters_backward")


def merge_units(units: Sequence[MPUnit]) -> MPUnit:
    """Consecutive dense units run back to back as one (their TP collectives added up).

    Used where nothing else needs to see the units one by one (no per-unit gathers, reductions
    or CP/EP exchanges): the compute stream does the same work and sends the same bytes, with
    far fewer events. Parameters are not merged (the merged unit carries none); recompute
    memory is one layer's, as the layers are recomputed one at a time."""
    assert all(not u.cp_bytes and not u.ep_bytes for u in units)
    tp_bytes = max(u.tp_bytes for u in units)
    assert all(u.tp_bytes in (0.0, tp_bytes) for u in units)

    def total(attr: str) -> Work:
        return sum((getattr(u, attr) for u in units), Work())

    pre = total("pre")
    post = total("post")
    tp_counts: dict[str, Any] = {f: sum(getattr(u, f) for u in units) for f in TP_COUNT_FIELDS}
    return MPUnit(
        name=f"{units[0].name}-{units[-1].name}", dense_params=0.0, pre=pre + post, backward=total("backward"),
        activation_bytes=sum(u.activation_bytes for u in units),
        recompute_bytes=max(u.recompute_bytes for u in units), tp_bytes=tp_bytes,
        # the units' temporaries live one unit at a time
        forward_temps=max((u.forward_temps for u in units), key=sum),
        backward_temps=max((u.backward_temps for u in units), key=sum),
        loss_backward_bytes=sum(u.loss_backward_bytes for u in units),
        loss_saved_bytes=sum(u.loss_saved_bytes for u in units),
        loss_grad_bytes=sum(u.loss_grad_bytes for u in units),
        **tp_counts, p2p_bytes=units[-1].p2p_bytes,
        tp_logits_bytes=sum(u.tp_logits_bytes for u in units),
        kernels_forward=sum(u.kernels_forward for u in units), kernels_backward=sum(u.kernels_backward for u in units),
    )


class _PassMemory(NamedTuple):
    """What a unit's forward and backward take and return (as Op alloc / free), the same every
    micro-batch: its activations, and the gather and gradient buffers of its sharded parameters."""

    forward_alloc: MemoryDelta
    forward_free: MemoryDelta
    backward_alloc: MemoryDelta
    backward_free: MemoryDelta


def _pass_memory(unit: MPUnit, forward_freed: Mapping[str, float] | None = None, backward_buffers_taken: float = 0.0,
                 backward_freed: Mapping[str, float] | None = None) -> _PassMemory:
    """``unit``'s activations, plus what its sharded parameters free after the forward (the
    gathered parameters, by category), take for the backward (full gradient buffers) and free
    after it."""
    forward_temps = tuple(("temporaries", b) for b in unit.forward_temps if b)
    # the loss's backward, an op of its own (UnitEmitter.backward), frees its temporaries and
    # what the loss kept
    split = unit.loss_split
    loss_saved = unit.loss_saved_bytes if split else 0.0
    handed: MemoryDelta = (("temporaries", unit.loss_grad_bytes),) if split and unit.loss_grad_bytes else ()
    if not split:  # temporaries of the backward itself
        handed += tuple(("temporaries", b) for b in unit.backward_temps if b)
    return _PassMemory(
        memory_delta({"activations": unit.activation_bytes}) + forward_temps,
        forward_temps + memory_delta(forward_freed),
        memory_delta({"activations": unit.recompute_bytes, "buffers": backward_buffers_taken}) + handed,
        memory_delta({"activations": unit.activation_bytes + unit.recompute_bytes - loss_saved,
                      **(backward_freed or {})}) + handed,
    )
