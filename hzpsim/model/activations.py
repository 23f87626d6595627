"""Activation bytes of one transformer layer: what it keeps for its backward under each
recompute mode (Korthikanti et al. 2022, arXiv 2205.05198, Table 2) and what its memory-bound
kernels move through HBM.

Pure functions of a :class:`~hzpsim.model.Model`, also reachable as its methods
(``Model.activation_bytes_per_layer`` ...). Try it::

    python -c "from hzpsim.model import Model; print(Model(2, 64, 4, 128, 256, 32).activation_bytes_per_layer(0, 1))"
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hzpsim.model.checkpointing import (
    RECOMPUTE_MODES,
    RecomputeMode,
    recomputed_norms,
    selective_modules,
    torchtitan_op_sac_recomputed_linears,
)

if TYPE_CHECKING:
    from hzpsim.model.architecture import Model


def activation_terms_per_token(
    model: Model, i: int, act_bytes: int = 2, eager: bool = False, moe_load: float = 1.0
) -> dict[str, tuple[float, str]]:
    """Korthikanti-style stored-activation terms of layer ``i`` for one token.

    Returns ``{term: (bytes per token, kind)}``; ``kind`` is how tensor parallelism
    treats it: "replicated" (full on every TP rank unless sequence parallel) or
    "split" (divided by t). ``act_bytes`` is the activation dtype size (2 for bf16/fp16);
    dropout masks are 1 byte per element. For an MHA/GELU/ffn=4h model with dropout this
    gives replicated 10h and split 24h, i.e. Korthikanti's 34h = attention 11h + MLP 19h +
    norms 4h. The s×s attention-score term is separate (see activation_bytes_per_layer).

    ``eager``: the layer as eager PyTorch model code runs it (torchtitan's and Hugging Face's
    Llama, hzpsim's executor) instead of Megatron's fused modules; autograd then also keeps, per
    token (measured with saved-tensor hooks on the executor's block, ``docs/memory.md``): each
    RMSNorm's normalised input before the weight (B·h, saved by ``mul(x_hat, weight)``) and its
    fp32 reciprocal RMS (4 bytes, ``RsqrtBackward0``); K and V after ``repeat_kv`` at every
    query head instead of the KV heads (what SDPA receives); and SwiGLU's SiLU output besides
    its input (``mul`` saves both operands: 4·B·f in all).

    ``moe_load``: the routed copies an MoE layer's experts hold on this rank over the mean (the
    busiest expert-parallel rank's, ``ParallelDims.moe_load``): their inputs, outputs and
    intermediates scale with it.
    """
    h, a, B = model.hidden_size, model.num_heads, act_bytes
    mask = 1 if model.dropout else 0
    d_qk, d_v, kv = model.head_dim_resolved, model.v_head_dim_resolved, model.kv_heads
    terms: dict[str, tuple[float, str]] = {
        # Both pre-norms keep their input for their backward: 2 × B·h (Korthikanti 4sbh).
        "norm_inputs": (2 * B * h, "replicated"),
        # Attention block (Korthikanti 11sbh for MHA): QKV GEMM input B·h; Q and K for
        # the score backward; V for the probs·V backward; output-projection input;
        # dropout mask after the output projection.
        "attn_qkv_input": (B * h, "replicated"),
        "attn_q": (B * a * d_qk, "split"),
        "attn_k": (B * kv * d_qk, "split"),
        "attn_v": (B * kv * d_v, "split"),
        "attn_proj_input": (B * a * d_v, "split"),
        "attn_dropout_mask": (mask * h, "replicated"),
    }
    if eager and model.norm == "rmsnorm":
        terms["norm_eager"] = (2 * (B * h + 4), "replicated")
    elif eager:  # native_layer_norm keeps its input's fp32 mean and rstd
        terms["norm_eager"] = (2 * 8, "replicated")
    if eager and model.mla is None and kv < a:  # repeat_kv: K and V at every query head
        terms["attn_k"] = (B * a * d_qk, "split")
        terms["attn_v"] = (B * a * d_v, "split")
    if model.mla is not None:
        # Latent tensors: norm input and up-projection input for each compressed path
        # (the down-projections are not tensor-parallel in Megatron).
        m = model.mla
        latent = m.kv_lora_rank + (m.q_lora_rank or 0)
        terms["mla_latents"] = (2 * B * latent, "replicated")
    # MLP block (Korthikanti 19sbh for GELU, ffn=4h): input B·h, dropout mask h, and the
    # intermediate tensors: GELU keeps fc1 output and GELU output (2·B·f); SwiGLU keeps
    # gate and up outputs and their product (3·B·f).
    per_ffn = (4 if eager else 3) if model.mlp == "swiglu" else 2
    terms["mlp_input"] = (B * h, "replicated")
    terms["mlp_dropout_mask"] = (mask * h, "replicated")
    if model.is_moe_layer(i):
        assert model.moe is not None
        k = model.moe.top_k
        # Router probabilities in fp32 (4 bytes × experts); each of the top_k token copies
        # is stored as expert input (B·h) and expert output (B·h, for the gate-weight
        # gradient of the weighted combine), plus its expert's intermediate tensors.
        terms["router_probs"] = (4 * model.moe.num_experts, "replicated")
        terms["expert_inputs_outputs"] = (2 * k * B * h * moe_load, "replicated")
        terms["expert_intermediate"] = (
            k * per_ffn * B * model.moe.expert_ffn_hidden_size * moe_load,
            "split",
        )
        terms["shared_expert_intermediate"] = (
            model.moe.num_shared_experts * per_ffn * B * model.moe.shared_ffn_resolved,
            "split",
        )
    else:
        terms["mlp_intermediate"] = (per_ffn * B * model.ffn_hidden_size, "split")
    return terms


def discarded_terms(model: Model, i: int, modules: frozenset[str], terms: dict[str, tuple[float, str]],
                    act_bytes: int = 2, moe_load: float = 1.0) -> dict[str, float]:
    """Bytes per token of layer ``i``'s ``terms`` (:func:`activation_terms_per_token` with these
    ``act_bytes`` and ``moe_load``) that selective recompute of ``modules``
    (``checkpointing.RECOMPUTE_MODULES``) does not keep:

    - ``layernorm``: the outputs of the recomputed norms (``checkpointing.recomputed_norms``):
      an MoE layer's pre-MLP norm output (its router's and dispatcher's input) and MLA's input
      norm output;
    - ``mla_up_proj``: the up-projected Q, K and V;
    - ``mlp``: a dense layer's MLP intermediates (its input stays, the checkpoint's);
    - ``moe``: everything inside the MoE layer (router probabilities, the routed copies and
      their intermediates, the shared experts'); its input stays;
    - ``moe_act``: the routed experts' activation output (the fc2 input), one of their
      ``per_ffn`` intermediates;
    - ``shared_experts``: the shared experts' intermediates."""
    out: dict[str, float] = {}
    moe = model.moe is not None and model.is_moe_layer(i)

    def drop(name: str, amount: float | None = None) -> None:
        if name in terms:
            out[name] = max(out.get(name, 0.0), terms[name][0] if amount is None else amount)

    for name in recomputed_norms(model, i, modules):
        drop(name)
    if "mla_up_proj" in modules and model.mla is not None:
        for name in ("attn_q", "attn_k", "attn_v"):
            drop(name)
    if "mlp" in modules and not moe:
        drop("mlp_intermediate")
    if moe and "moe" in modules:
        for name in ("router_probs", "expert_inputs_outputs", "expert_intermediate", "shared_expert_intermediate"):
            drop(name)
    if moe and "shared_experts" in modules:
        drop("shared_expert_intermediate")
    if moe and "moe_act" in modules:
        assert model.moe is not None
        drop("expert_intermediate", model.moe.top_k * act_bytes * model.moe.expert_ffn_hidden_size * moe_load)
    return out


def activation_fn_bytes_per_ffn(model: Model, fused: bool) -> int:
    """HBM bytes the MLP's activation function moves per element of one B-byte intermediate
    (per token and per unit of the FFN width), in units of B.

    - GELU: one kernel, reads and writes the intermediate: 2.
    - SwiGLU, eager (torchtitan's ``F.silu(w1(x)) * w3(x)``, Hugging Face's
      ``act_fn(gate_proj(x)) * up_proj(x)``): ``silu`` reads the gate and writes its output,
      then ``mul`` reads that and ``up`` and writes the product: 5.
    - SwiGLU, fused (Megatron-Core's ``fused_bias_swiglu.py::bias_swiglu_impl``, on by default
      through ``--bias-swiglu-fusion``; torch.compile's one Inductor kernel): reads gate and up,
      writes the product: 3.

    [MEA] The eager pair measured on an H100 and an H200 (``benchmarks/gpu_probe.py``,
    ``swiglu_fwd``) reaches 0.30 / 0.22 of the HBM datasheet on the fused count, 0.49 / 0.37
    on these 5: the rate of the other eager kernels (RMSNorm 0.53 / 0.50), so the eager pair
    does move 5·B·f (docs/gpu-measurements.md)."""
    if model.mlp != "swiglu":
        return 2
    return 3 if fused else 5


def activation_fn_backward_bytes_per_ffn(model: Model, fused: bool) -> int:
    """HBM bytes the MLP's activation function's backward moves per element of one B-byte
    intermediate, in units of B (:func:`activation_fn_bytes_per_ffn` is the forward's), kernel
    by kernel:

    - GELU: ``gelu_backward`` reads the output gradient and the saved input and writes the
      input gradient: 3.
    - SwiGLU, eager: ``mul``'s backward is two products, the gate branch's gradient
      (reads the output gradient and ``up``, writes) and ``up``'s (reads it and ``silu``'s
      saved output, writes): 6; ``silu_backward`` reads the gradient and the saved gate and
      writes: 3. Together 9.
    - SwiGLU, fused (Megatron-Core's ``fused_bias_swiglu.py::SwiGLUFunction.backward``, one
      jitted ``swiglu_back``; Inductor's one kernel): reads the output gradient, the gate and
      ``up``, writes both input gradients: 5."""
    if model.mlp != "swiglu":
        return 3
    return 5 if fused else 9


def input_gradient_adds(model: Model, i: int) -> int:
    """The eager adds in layer ``i``'s backward that sum the input gradients of the linears
    reading one tensor (autograd's ``InputBuffer::accumulate``; each moves 3·B·h per token):
    separate q, k and v projections (a fused QKV weight, GPT's, needs none), MLA's query and
    compressed-KV projections, SwiGLU's gate and up; in an MoE layer the block's input feeds
    the router, the token permutation and each shared expert. ``Model.layer_kernels_forward``
    counts the same adds among the ops it dispatches."""
    attention = 1 if model.mla is not None else (len(model.layer_linears(i)["attention"]) - 2)
    per_mlp = 2 if model.mlp == "swiglu" else 1
    if model.is_moe_layer(i):
        assert model.moe is not None
        return attention + 1 + model.moe.num_shared_experts * per_mlp
    return attention + per_mlp - 1


def elementwise_backward_over_forward(model: Model, name: str, act_bytes: int = 2,
                                      fusion: str = "eager") -> float:
    """HBM bytes the backward of the memory-bound term ``name`` of
    :func:`elementwise_bytes_per_token` moves, over what that term's eager forward moves,
    counted kernel by kernel from each op's autograd formula (``tools/autograd/derivatives.yaml``)
    [INF]. ``fusion``: ``"eager"``; ``"compile"`` (torch.compile: Inductor fuses the backward's
    pointwise ops as it fuses the forward's); ``"hand"`` (Megatron-LM / Transformer Engine's
    hand-fused forward kernels, whose backwards stay apart). B = ``act_bytes``, per token:

    - ``norms``: ``native_layer_norm_backward`` (and Apex / Transformer Engine's LayerNorm and
      RMSNorm backward kernels) reads the output gradient and the saved input (the per-token
      statistics are O(1)) and writes the input gradient: 3·B·h against 2·B·h, in every mode.
      The weight's gradient is a per-block reduction, O(h).
    - ``residual_adds``: an add has no backward kernel (its gradient passes to both summands),
      but the residual stream feeds two consumers, the block and the skip, and autograd sums
      their gradients (``InputBuffer::accumulate``): reads two, writes one, the add's own 3·B·h
      (eager; ``hand``: Megatron's ``bias_dropout_add`` backward leaves that sum to autograd).
      ``compile``: Inductor folds the sum into the norm's backward kernel, one more read, B·h.
    - ``dropouts``: ``native_dropout_backward`` reads the gradient and the 1-byte mask and
      writes the branch's gradient: 2·B·h + h, as the forward (``hand`` too: the jitted
      ``bias_dropout_add``'s backward is that product). ``compile``: the gradient is already
      in the norm's backward kernel, which reads the mask and writes the branch's gradient
      besides the skip's: B·h + h.
    - ``permute``: a permutation's backward is the inverse permutation: as the forward.
    - ``rope``: not here; its forward and backward depend on how the model code writes it
      (:func:`rope_bytes_per_element`).
    - ``activation_fn``: :func:`activation_fn_backward_bytes_per_ffn` (fused unless eager)
      over :func:`activation_fn_bytes_per_ffn` (eager).

    A GPT layer (MHA, GELU, 4h, dropout, B = 2), eager, moves 58·h bytes per token in its
    backward (norms 12, residual adds 12, dropouts 10, GELU 24) against its forward's 46·h; it
    was charged 2× the forward, 92·h."""
    if fusion not in ("eager", "compile", "hand"):
        raise ValueError(f"fusion: {fusion!r} is not one of: eager, compile, hand")
    if name == "activation_fn":
        return activation_fn_backward_bytes_per_ffn(model, fusion != "eager") / activation_fn_bytes_per_ffn(model, False)
    if name == "norms":
        return 1.5
    if name == "residual_adds":
        return 1 / 3 if fusion == "compile" else 1.0
    if name == "dropouts":
        return (act_bytes + 1) / (2 * act_bytes + 1) if fusion == "compile" else 1.0
    if name == "permute":
        return 1.0
    raise ValueError(f"unknown memory-bound term {name!r}")


ROPE_FORMS = ("rotate_half", "complex")


def rope_bytes_per_element(form: str, act_bytes: int, fused: bool) -> tuple[float, float]:
    """HBM bytes RoPE moves per rotated element of Q and K, forward and backward, B =
    ``act_bytes``. ``fused`` (Megatron-Core's / Transformer Engine's fused RoPE kernel,
    Inductor's fused pointwise kernel): one read and one write each way, 2·B. Eager, as the
    model code writes it (each ATen op's operands and outputs, views apart; measured on CPU
    with a ``TorchDispatchMode`` in ``tests/test_kernels.py``, the cos / sin / frequency tables,
    broadcast over batch and heads, left out):

    - ``rotate_half`` (Hugging Face's ``apply_rotary_pos_emb``, Megatron-LM's unfused
      ``_apply_rotary_pos_emb_bshd``, hzpsim's executor): ``q * cos + rotate_half(q) * sin``,
      forward ``mul`` 2·B, ``neg`` of one half B, ``cat`` 2·B, ``mul`` 2·B, ``add`` 3·B = 10·B;
      backward the two products' gradients 2·B each, ``neg`` B, two ``slice_backward`` (a
      zero-filled whole written, a half read) 3·B, two gradient sums 6·B = 14·B;
    - ``complex`` (torchtitan's ``apply_rotary_emb``: ``view_as_complex(xq.float())`` times the
      complex frequencies, ``view_as_real``, ``type_as``): the cast to fp32 B + 4, the complex
      product 4 + 4, the cast back 4 + B; the backward the same three kernels on the gradient:
      2·B + 16 each way, 20 bytes in bf16 (5× the fused kernel's); in fp32 the casts are no-ops.
    """
    if form not in ROPE_FORMS:
        raise ValueError(f"rope form: {form!r} is not one of: {', '.join(ROPE_FORMS)}")
    B = act_bytes
    if fused:
        return 2.0 * B, 2.0 * B
    if form == "rotate_half":
        return 10.0 * B, 14.0 * B
    casts = 0.0 if B == 4 else 2.0 * (B + 4)
    return casts + 8.0, casts + 8.0


def elementwise_bytes_per_token(model: Model, i: int, act_bytes: int = 2) -> dict[str, tuple[float, str]]:
    """HBM bytes the memory-bound kernels of layer ``i``'s forward move per token, eager and
    unfused (bias adds are fused into GEMM epilogues and not counted) [INF, counted kernel
    by kernel]: each norm reads its input and writes its output (2·B·h); each residual add
    reads two tensors and writes one (3·B·h); each dropout reads and writes B·h and writes a
    1-byte mask; RoPE reads and writes Q and K (what a fused kernel moves; the eager forms
    move more: :func:`rope_bytes_per_element`); GELU reads and writes the B·f intermediate;
    SwiGLU is two eager kernels, ``silu(gate)`` (reads and writes B·f) and its product with
    ``up`` (reads two, writes one): 5·B·f (:func:`activation_fn_bytes_per_ffn`); an MoE layer also permutes
    and un-permutes its top_k token copies (read + write each way). Same kinds as
    activation_terms_per_token ("replicated" / "split" under tensor parallelism). A GPT
    layer (MHA, GELU, 4h, dropout, B = 2) moves 46·h bytes per token.
    """
    h, B = model.hidden_size, act_bytes
    mask = 1 if model.dropout else 0
    terms: dict[str, tuple[float, str]] = {
        "norms": (2 * 2 * B * h, "replicated"),
        "residual_adds": (2 * 3 * B * h, "replicated"),
        "dropouts": (2 * mask * (2 * B * h + h), "replicated"),
    }
    if model.position_embedding == "rope" and model.mla is None:
        d = model.head_dim_resolved
        terms["rope"] = (2 * B * (model.num_heads + model.kv_heads) * d, "split")
    per_ffn = activation_fn_bytes_per_ffn(model, fused=False)
    if model.is_moe_layer(i):
        assert model.moe is not None
        k = model.moe.top_k
        terms["activation_fn"] = (
            per_ffn * B * (k * model.moe.expert_ffn_hidden_size
                           + model.moe.num_shared_experts * model.moe.shared_ffn_resolved), "split")
        terms["permute"] = (2 * 2 * k * B * h, "replicated")
    else:
        terms["activation_fn"] = (per_ffn * B * model.ffn_hidden_size, "split")
    return terms


def activation_bytes_per_layer(
    model: Model,
    i: int,
    micro_batch_size: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: RecomputeMode = "none",
    flash_attention: bool = True,
    cp: int = 1,
    act_bytes: int = 2,
    float8: bool = False,
    eager: bool = False,
    gathered_inputs: bool = False,
    moe_load: float = 1.0,
    modules: tuple[str, ...] | None = None,
) -> float:
    """Activation bytes layer ``i`` keeps for its backward, per device (Korthikanti Table 2).

    With s = seq_len/cp (local sequence), b = micro_batch_size, t = tp:
    - none: s·b·(R + S/t) + score, where R, S are the replicated and split per-token
      terms of activation_terms_per_token() (R is also /t with sequence parallel);
      score = 5·a·s_q·s_kv·b/t bytes (softmax output 2, dropout mask 1, dropout output 2;
      2·a·s_q·s_kv·b/t without dropout), s_q = s, s_kv = seq_len (each local query's
      scores against all keys). Not stored with flash_attention (the O(a·s·b) softmax
      statistics are ignored). GPT MHA/GELU/4h, cp=1: sbh(34 + 5as/h) with t=1;
      sbh(10 + 24/t + 5as/(ht)) with TP; sbh/t·(34 + 5as/h) with TP+SP.
    - selective: as none less what the recomputed submodules ``modules`` (Megatron-Core's
      ``recompute_modules``, default the attention core) would have kept
      (:func:`discarded_terms`); with the attention core, no score term (34·sbh/t with TP+SP).
    - op (per-op selective checkpointing, ``checkpointing.torchtitan_op_sac_recomputed_linears``): the layer input,
      the outputs of the linears it does not run again (column-parallel: N/t per token;
      row-parallel: the whole h-wide partial sum, plus the reduce-scatter's h/t under
      sequence parallelism), the router's logits, and with flash attention the kernel's
      output and its fp32 log-sum-exp (4·a/t bytes).
    - full: only the layer input, act_bytes·s·b·h (/t with sequence parallel) = 2sbh.

    With flash attention (none, selective) the kernel's fp32 log-sum-exp is kept too (4·a/t
    bytes per token). ``eager``: see :func:`activation_terms_per_token`. ``gathered_inputs``:
    under sequence parallelism the column-parallel linears keep the all-gathered input (the QKV
    and MLP inputs whole on every TP rank), as DTensor's ``PrepareModuleInput`` +
    ``ColwiseParallel`` do, instead of Megatron's sequence shard gathered again in the backward.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute: {recompute!r} is not one of: {', '.join(RECOMPUTE_MODES)}")
    for name, value in (("micro_batch_size", micro_batch_size), ("tp", tp), ("cp", cp)):
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")
    s_local = model.seq_len / cp
    sb = s_local * micro_batch_size
    rep_div = tp if sequence_parallel else 1
    if recompute == "full":
        return act_bytes * sb * model.hidden_size / rep_div
    if recompute == "op":
        h = model.hidden_size
        linears, redo = model.layer_linears(i), torchtitan_op_sac_recomputed_linears(model, i, float8)
        per_token = act_bytes * h / rep_div  # the checkpointed block's input
        for block in ("attention", "router", "mlp"):
            kept = list(linears[block])
            for linear in redo[block]:
                kept.remove(linear)
            for _, n, split_kind in kept:
                if split_kind == "column":
                    per_token += act_bytes * n / tp
                else:  # row-parallel (or the unsplit router): the mm's whole output
                    per_token += act_bytes * n
                    if split_kind == "row" and tp > 1 and sequence_parallel:
                        per_token += act_bytes * n / tp  # the saved reduce-scatter output
        if flash_attention:
            per_token += (act_bytes * model.num_heads * model.v_head_dim_resolved + 4 * model.num_heads) / tp
        return sb * per_token
    replicated = split = 0.0
    whole = 0.0
    chosen = selective_modules(recompute, modules)
    terms = activation_terms_per_token(model, i, act_bytes, eager, moe_load)
    for name, discarded in discarded_terms(model, i, chosen, terms, act_bytes, moe_load).items():
        per_token, kind = terms[name]
        terms[name] = (per_token - discarded, kind)
    for name, (per_token, kind) in terms.items():
        if gathered_inputs and sequence_parallel and name in ("attn_qkv_input", "mlp_input"):
            whole += per_token
        elif kind == "replicated":
            replicated += per_token
        else:
            split += per_token
    total = sb * (whole + replicated / rep_div + split / tp)
    if flash_attention:  # the kernel's softmax statistics (FlashAttention's logsumexp, fp32)
        total += sb * 4 * model.num_heads / tp
    if "core_attn" not in chosen and not flash_attention:  # none, or selective without the attention core
        per_score = (2 * act_bytes + 1) if model.dropout else act_bytes
        total += per_score * model.num_heads * sb * model.seq_len / tp
    return total
