"""Activation recomputation (checkpointing) policies: what a layer runs again in its backward.

``activation_recompute`` (``hzpsim.model.training.Training``) is one of :data:`RECOMPUTE_MODES`:
none; selective = the submodules ``training.recompute_modules`` names, Megatron-Core's
``--recompute-modules`` (:data:`RECOMPUTE_MODULES`; by default the attention core, Korthikanti
et al. 2022 §5); op = per-op selective activation checkpointing with torchtitan's policy
(:func:`torchtitan_op_sac_recomputed_linears`); full = the whole layer. Pure functions of a
:class:`~hzpsim.model.Model`, also reachable as its methods. Try it::

    python -c "from hzpsim.model import Model, checkpointing; print(checkpointing.torchtitan_op_sac_recomputed_linears(Model(2, 64, 4, 128, 256, 32), 0))"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from hzpsim.model.architecture import Model

RecomputeMode = Literal["none", "selective", "op", "full"]
RECOMPUTE_MODES = ("none", "selective", "op", "full")

RecomputeModule = Literal["core_attn", "layernorm", "mla_up_proj", "mlp", "moe", "moe_act", "shared_experts"]
RECOMPUTE_MODULES: tuple[str, ...] = get_args(RecomputeModule)
"""What selective recompute can run again, as Megatron-Core names it
(``megatron/core/transformer/transformer_config.py``, ``TransformerConfig.recompute_modules``,
``--recompute-modules``; its default ``["core_attn"]`` is :data:`DEFAULT_SELECTIVE_MODULES`):

- ``core_attn``: the attention core (``attention.py::_checkpointed_attention_forward``): its
  scores are not kept, the kernel runs again in the backward;
- ``layernorm``: the norms that are modules of their own, output discarded and recomputed
  (``tensor_parallel.CheckpointWithoutOutput``, ``transformer_layer.py``
  ``recompute_input_layernorm`` / ``recompute_pre_mlp_layernorm``). In the Transformer Engine
  layer spec (``gpt_layer_specs.py``) the input norm is fused into the QKV linear
  (``TELayerNormColumnParallelLinear``, which keeps its output) except with MLA, and the pre-MLP
  norm is a module of its own only in an MoE layer (:func:`recomputed_norms`);
- ``mla_up_proj``: MLA's query and key-value up-projections and RoPE (output discarded,
  ``multi_latent_attention.py::qkv_up_proj_and_rope_apply``): Q, K, V are not kept;
- ``mlp``: a dense layer's MLP (normal checkpoint: its input kept; not in MoE layers);
- ``moe``: the whole MoE layer (``moe_layer.py``, ``tensor_parallel.checkpoint`` of the router,
  dispatch, experts, combine and shared experts): only its input kept, the exchanges run again;
- ``moe_act``: the routed experts' activation function (``experts.py``, output discarded): the
  fc2 input is not kept, the activation runs again;
- ``shared_experts``: the shared experts (normal checkpoint of their MLP)."""

DEFAULT_SELECTIVE_MODULES: tuple[str, ...] = ("core_attn",)
"""Megatron-Core's default ``recompute_modules`` (``TransformerConfig.__post_init__``) and what
hzpsim's ``selective`` always meant."""


def selective_modules(mode: str, modules: tuple[str, ...] | None = None) -> frozenset[str]:
    """The submodules a layer runs again under ``mode`` (only ``selective`` names any)."""
    if mode != "selective":
        return frozenset()
    return frozenset(DEFAULT_SELECTIVE_MODULES if modules is None else modules)


def check_modules(model: Model, modules: tuple[str, ...] | None) -> None:
    """ValueError naming a module ``model`` does not have (Megatron-Core refuses ``mla_up_proj``
    without MLA in ``TransformerConfig.__post_init__``; hzpsim refuses the MoE modules on a dense
    model and ``shared_experts`` without shared experts, which would recompute nothing)."""
    for name in modules or ():
        if name in ("moe", "moe_act", "shared_experts") and model.moe is None:
            raise ValueError(f"recompute_modules: {name!r} recomputes part of an MoE layer, but the model has no experts")
        if name == "shared_experts" and model.moe is not None and not model.moe.num_shared_experts:
            raise ValueError("recompute_modules: 'shared_experts', but the model's MoE layers have no shared experts")
        if name == "mla_up_proj" and model.mla is None:
            raise ValueError("recompute_modules: 'mla_up_proj' recomputes MLA's up-projections, but the model "
                             "has no multi-latent attention")
        if name == "mlp" and model.moe is not None and all(model.is_moe_layer(i) for i in range(model.num_layers)):
            raise ValueError("recompute_modules: 'mlp' recomputes a dense layer's MLP, but every layer is an "
                             "MoE layer (use 'moe' or 'moe_act')")


def recomputed_norms(model: Model, i: int, modules: frozenset[str]) -> tuple[str, ...]:
    """The norm outputs of layer ``i`` that ``layernorm`` recompute discards and runs again, as
    ``activations.activation_terms_per_token`` names them: the pre-MLP norm's (``mlp_input``) in
    an MoE layer and, with MLA, the input norm's (``attn_qkv_input``); the Transformer Engine
    spec fuses the others into the linear after them (``gpt_layer_specs.py``)."""
    if "layernorm" not in modules:
        return ()
    return (("mlp_input",) if model.is_moe_layer(i) else ()) + (("attn_qkv_input",) if model.mla is not None else ())


def mla_up_projections(model: Model) -> list[tuple[int, int, str]]:
    """MLA's up-projections, as ``Model.layer_linears`` lists them: the query's (its only
    projection without a query LoRA rank) and the key-value one (``mla_up_proj`` runs them
    again)."""
    if model.mla is None:
        return []
    attention = model.layer_linears(0)["attention"]
    return [attention[1], attention[3]] if model.mla.q_lora_rank is not None else [attention[0], attention[2]]


def torchtitan_op_sac_recomputed_linears(model: Model, i: int, float8: bool = False) -> dict[str, list[tuple[int, int, str]]]:
    """The linears of layer ``i`` that per-op selective activation checkpointing
    (``activation_recompute: op``) runs again in the backward under torchtitan's policy, keyed
    as ``Model.layer_linears``.

    torchtitan's policy (``torchtitan/distributed/activation_checkpoint.py``,
    ``_get_custom_policy`` / ``_custom_policy`` with its ``_save_list``; before 2025-09 in
    ``models/llama3/infra/parallelize.py``): the outputs of ``aten.mm``, of the flash /
    efficient SDPA kernels, of the functional ``reduce_scatter_tensor`` and of ``aten.max``
    are saved, except every second ``aten.mm`` of the block in forward order; every other op
    is recomputed. The forward order is the attention block's linears, the router's gate,
    then the (shared-expert) MLP's (Llama: wq, wk, wv, wo, w1, w3, w2, so wk, wo and w3 run
    again). Routed experts run ``_grouped_mm`` and float8 linears (``float8``: torchao's
    ``_scaled_mm``) are not in the save list: they run again, and do not advance the mm
    count."""
    linears = model.layer_linears(i)
    redo: dict[str, list[tuple[int, int, str]]] = {key: [] for key in linears}
    count = 0
    for block in ("attention", "router", "mlp"):
        for linear in linears[block]:
            if float8 and block != "router":  # _scaled_mm: not saved, not counted
                redo[block].append(linear)
                continue
            count += 1
            if count % 2 == 0:
                redo[block].append(linear)
    redo["expert"] = list(linears["expert"])
    return redo


def recompute_forward_flops(
    model: Model, i: int, num_tokens: int, mode: RecomputeMode, causal: bool = True, float8: bool = False,
    modules: tuple[str, ...] | None = None,
) -> float:
    """Extra forward FLOPs of layer ``i`` spent on activation recomputation in backward:
    full = the whole layer forward again; selective = the GEMMs and attention of the
    submodules ``modules`` names (:data:`RECOMPUTE_MODULES`; by default the attention core,
    Korthikanti §5); op = the linears ``torchtitan_op_sac_recomputed_linears`` names (the
    attention kernel's output is saved); none = 0."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute: {mode!r} is not one of: {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return 0.0
    flops = model.layer_forward_flops(i, num_tokens, causal)
    if mode == "op":
        redo = torchtitan_op_sac_recomputed_linears(model, i, float8)
        top_k = model.moe.top_k if model.moe and model.is_moe_layer(i) else 0
        per_token = sum(k * n for block in ("attention", "router", "mlp") for k, n, _ in redo[block])
        per_token += top_k * sum(k * n for k, n, _ in redo["expert"])
        return 2.0 * per_token * num_tokens
    if mode == "full":
        return flops["gemm"] + flops["attention"]
    chosen = selective_modules(mode, modules)
    linears = model.layer_linears(i)
    moe = model.moe is not None and model.is_moe_layer(i)
    redone = 0.0  # matmul parameters run again per token
    if "mla_up_proj" in chosen:
        redone += sum(k * n for k, n, _ in mla_up_projections(model))
    if ("mlp" in chosen and not moe) or (moe and ("moe" in chosen or "shared_experts" in chosen)):
        redone += sum(k * n for k, n, _ in linears["mlp"])  # the dense MLP or the shared experts
    if moe and "moe" in chosen:
        assert model.moe is not None
        redone += sum(k * n for k, n, _ in linears["router"])
        redone += model.moe.top_k * sum(k * n for k, n, _ in linears["expert"])
    return (flops["attention"] if "core_attn" in chosen else 0.0) + 2.0 * redone * num_tokens
