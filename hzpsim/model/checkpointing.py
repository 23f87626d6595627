"""Activation recomputation (checkpointing) policies: what a layer runs again in its backward.

``activation_recompute`` (``hzpsim.model.training.Training``) is one of :data:`RECOMPUTE_MODES`:
none; selective = the attention core (Megatron, Korthikanti et al. 2022 §5); op = per-op
selective activation checkpointing with torchtitan's policy
(:func:`torchtitan_op_sac_recomputed_linears`); full = the whole layer. Pure functions of a
:class:`~hzpsim.model.Model`, also reachable as its methods. Try it::

    python -c "from hzpsim.model import Model, checkpointing; print(checkpointing.torchtitan_op_sac_recomputed_linears(Model(2, 64, 4, 128, 256, 32), 0))"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from hzpsim.model.architecture import Model

RecomputeMode = Literal["none", "selective", "op", "full"]
RECOMPUTE_MODES = ("none", "selective", "op", "full")


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
    model: Model, i: int, num_tokens: int, mode: RecomputeMode, causal: bool = True, float8: bool = False
) -> float:
    """Extra forward FLOPs of layer ``i`` spent on activation recomputation in backward:
    full = the whole layer forward again; selective = the attention core only
    (Korthikanti §5); op = the linears ``torchtitan_op_sac_recomputed_linears`` names (the attention
    kernel's output is saved); none = 0."""
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
    return flops["attention"] if mode == "selective" else flops["gemm"] + flops["attention"]
