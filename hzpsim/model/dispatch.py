"""Eager ATen dispatches and fused kernel launches of one transformer layer (host-time modelling).

A synchronous host (a CPU) pays a host cost per dispatched op in full, a GPU hides it while it
runs ahead; the simulator multiplies these counts by the device's per-op host cost
(``strategies/_model_parallel.py``). Pure functions of a :class:`~hzpsim.model.Model`, also
reachable as its methods (``Model.layer_kernels_forward`` ...). Try it::

    python -c "from hzpsim.model import Model; from hzpsim.model import dispatch; print(dispatch.layer_kernels_forward(Model(2, 64, 4, 128, 256, 32), 0))"
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hzpsim.model.architecture import Model


def layer_kernels_forward(model: Model, i: int, flash_attention: bool = True, backward: bool = False) -> int:
    """ATen ops an eager PyTorch forward (or, with ``backward``, its autograd backward) of
    layer ``i`` dispatches: the host work per op that a synchronous host (a CPU) pays in full
    and a GPU hides while it runs ahead. Views, ``detach`` of saved tensors and of
    accumulated gradients count: each is one dispatch. Counted from the layer's structure,
    op by op, as eager PyTorch 2.13 issues them for the usual model code (the executor's,
    ``hzpsim/executor/model.py``); ``tests/test_executor.py`` checks the sum against a
    ``TorchDispatchMode`` count of the executor's model for dense variants (RMSNorm /
    LayerNorm, RoPE / learned positions, GQA / MHA, with and without biases;
    SwiGLU layers: the GPT-style GELU layer's fused QKV is not what the executor builds).
    Per component, forward / backward:

    - linear on a (batch, seq, in) input: ``t, view, mm, _unsafe_view`` (``addmm`` with a
      bias) / ``view, t, mm`` (input gradient), ``t, t, mm, view, t`` (weight gradient),
      ``detach`` (AccumulateGrad): 4 / 9, a bias adds ``sum, view, detach``: 12;
    - RMSNorm (``F.rms_norm``, composite on CPU): ``pow, mean, add_, rsqrt, detach`` (saved
      output), ``mul, mul`` / 18 (their derivatives, the weight's reduction and
      AccumulateGrad); a norm bias adds ``add`` / ``sum, view, detach``; LayerNorm:
      ``native_layer_norm`` / ``native_layer_norm_backward``, one ``detach`` per parameter;
    - attention: view + transpose of q, k, v, the fused kernel and the ``detach`` of its
      saved output, transpose + view of its output (10 / 10), and in the backward one
      ``add`` per extra projection reading the normed input (q, k, v: 2; a fused QKV weight
      instead splits / concatenates: 1 / 1 [INF]); RoPE per rotated tensor ``mul, slice,
      slice, neg, cat, mul, add`` / ``mul, slice, slice, slice_backward, neg,
      slice_backward, add, mul, add`` (7 / 9); GQA's ``repeat_interleave`` per repeated
      tensor ``unsqueeze, expand, clone, view`` / ``view, sum, squeeze`` (4 / 3); a q, k or
      v gradient that RoPE or GQA produced is reshaped with a copy (``clone,
      _unsafe_view`` for ``view``: +1 each); unfused (``flash_attention=False``): the math
      path's scores, scale, mask, softmax and value product [INF, not measured here:
      10 / 15 in place of the fused kernel's 2 / 2];
    - SwiGLU ``silu, mul`` / ``silu_backward, mul, mul`` and the ``add`` of the gate's and
      up's input gradients; GELU ``gelu`` / ``gelu_backward``;
    - the two residual adds / the two ``add``s that sum the residual stream's gradients;
    - dropout: ``native_dropout`` / ``native_dropout_backward`` each [INF, one op each way].

    An MoE layer (the executor's: a loop over the experts, each on the tokens routed to it)
    runs its router, shared experts and, per routed expert, the expert's MLP on the
    flattened (tokens, h) input (a linear there is ``t, mm`` / 7 ops) inside a token select
    and weighted scatter (8 / 12 ops), all counted and checked like the dense layer."""
    linears = model.layer_linears(i)
    moe = model.is_moe_layer(i)
    bias = model.linear_bias
    linear = (4, 12 if bias else 9)
    norm = norm_ops(model)
    attention_linears = len(linears["attention"])
    inputs = attention_linears - 1  # projections that read the normed input (q, k, v or fused qkv)
    fwd = 2 * norm[0] + attention_linears * linear[0] + 10
    bwd = 2 * norm[1] + attention_linears * linear[1] + 10 + (inputs - 1 if inputs > 1 else 0)
    if model.mla is None and inputs == 1:  # fused QKV: split / cat of the three gradients [INF]
        fwd, bwd = fwd + 1, bwd + 1
    if not flash_attention:
        fwd, bwd = fwd - 2 + 10, bwd - 2 + 15
    rope = model.position_embedding == "rope" and model.mla is None
    gqa = model.mla is None and model.kv_heads != model.num_heads
    if rope:  # q and k
        fwd, bwd = fwd + 2 * 7, bwd + 2 * 9
    if gqa:  # k and v
        fwd, bwd = fwd + 2 * 4, bwd + 2 * 3
    # a q, k or v gradient that does not come straight from the attention kernel (RoPE's or
    # repeat_interleave's backward made it) is contiguous in (batch, heads, seq, dim), so the
    # reshape back to (batch, seq, features) copies: clone + _unsafe_view instead of view
    if model.mla is None:
        bwd += len(({"q", "k"} if rope else set()) | ({"k", "v"} if gqa else set()))
    if model.dropout:
        fwd, bwd = fwd + 3, bwd + 3

    swiglu = model.mlp == "swiglu"
    mlp_linears = 3 if swiglu else 2
    # SwiGLU: silu, mul / silu_backward, mul, mul and the add of gate's and up's input gradients
    f = mlp_linears * linear[0] + (2 if swiglu else 1)
    b = mlp_linears * linear[1] + (4 if swiglu else 1)
    dense_mlps = len(linears["mlp"]) // mlp_linears  # the dense MLP, or the shared experts
    if not moe:
        fwd, bwd = fwd + f, bwd + b
    if moe:
        assert model.moe is not None
        # on the flattened (tokens, h) input a linear is ``t, mm`` / ``t, mm, t, t, mm, t, detach``
        flat = (2, 7 + (3 if bias else 0))
        expert = (mlp_linears * flat[0] + (2 if swiglu else 1), mlp_linears * flat[1] + (4 if swiglu else 1))
        # per routed expert, its token select and weighted scatter: ``eq, nonzero, unbind,
        # index_select, index, unsqueeze, mul, index_add`` / their 12 backward ops
        # (``mul``s, ``sum``, ``index_put`` into ``new_zeros``, ``index_select``, ...)
        fwd += model.moe.num_experts * (expert[0] + 8)
        bwd += model.moe.num_experts * (expert[1] + 12)
        # shared experts on the flattened input, each added to the output (+ its gradient's add)
        fwd, bwd = fwd + dense_mlps * (expert[0] + 1), bwd + dense_mlps * (expert[1] + 1)
        # flatten, router ``t, mm``, softmax, top-k, sum, div, zeros_like, view back / their
        # backward (top-k > 1 adds the sum of the chosen weights' gradients) [counted]
        fwd, bwd = fwd + 10, bwd + 19 + (1 if model.moe.top_k > 1 else 0)
    fwd, bwd = fwd + 2, bwd + 2  # the residual adds / the residual stream's gradient sums
    return bwd if backward else fwd


def norm_ops(model: Model) -> tuple[int, int]:
    """ATen ops of one eager norm, forward and backward (see ``layer_kernels_forward``)."""
    if model.norm == "layernorm":
        return 1, 2 + (1 if model.norm_bias else 0)
    return 7 + (1 if model.norm_bias else 0), 18 + (3 if model.norm_bias else 0)


def layer_kernels_fused(model: Model, i: int, flash_attention: bool = True) -> int:
    """Kernels a fused (``torch.compile``d) forward of layer ``i`` launches [INF, from
    Inductor's pointwise fusion]: one per GEMM weight, the attention kernel (unfused: two
    batched GEMMs, scale+mask, softmax, dropout), and one fused pointwise kernel per norm
    (the residual add folded in), RoPE, activation function and dropout group; an MoE layer
    adds the router's softmax/top-k and the token permute and un-permute. Its backward
    launches about twice as many."""
    dense, expert = model.layer_tensors(i)
    gemms = sum(1 for t in dense + expert if t >= model.hidden_size * 2)
    kernels = gemms + 2 + (3 if model.dropout else 0) + (1 if model.position_embedding == "rope" else 0) + 1
    kernels += 1 if flash_attention else 5
    if model.is_moe_layer(i):
        kernels += 4
    return kernels
