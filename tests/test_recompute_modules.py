"""Selective recompute of named submodules, Megatron-Core's ``--recompute-modules``
(``training.recompute_modules``, model/checkpointing.py): what each keeps, what it runs again,
how the validation reads a row's list, and the inputs it refuses."""

from __future__ import annotations

import pytest

from hzpsim.cli import main
from hzpsim.model.training import Training
from hzpsim.run import run_choice
from hzpsim.scenario import scenario_from_mapping
from hzpsim.strategies._dims import ParallelDims
from hzpsim.strategies._mp_units import mp_units
from hzpsim.validation.mapping import map_recompute_modules


def mixtral(recompute: str = "selective", modules: list[str] | None = None):
    training: dict = {"global_batch_size": 256, "activation_recompute": recompute}
    if modules is not None:
        training["recompute_modules"] = modules
    return scenario_from_mapping({
        "model": "mixtral-8x7b", "training": training,
        "cluster": {"preset": "dgx-h100", "num_nodes": 8},
        "strategy": {"name": "nd", "pp": 4, "ep": 8, "zero_stage": 1, "implementation": "megatron-core"},
    })


@pytest.fixture(scope="module")
def model():
    return mixtral().model


def test_the_default_module_is_the_attention_core(model):
    """Unset, selective recompute is Megatron-Core's default ``["core_attn"]``: the same bytes and
    FLOPs, and training_resolved spells the list out."""
    for i in (0, 1):
        assert model.activation_bytes_per_layer(i, 1, recompute="selective") == \
            model.activation_bytes_per_layer(i, 1, recompute="selective", modules=("core_attn",))
        assert model.recompute_forward_flops(i, 8, "selective") == \
            model.recompute_forward_flops(i, 8, "selective", modules=("core_attn",)) == \
            model.layer_forward_flops(i, 8)["attention"]
    sc = mixtral()
    assert run_choice(sc, sc.strategies[0])["training_resolved"]["recompute_modules"] == ["core_attn"]


def test_each_module_drops_what_megatron_core_discards(model):
    """Per token of an MoE layer (bf16, no TP): ``layernorm`` drops the pre-MLP norm's output
    (2·h bytes), ``moe_act`` one of the three SwiGLU intermediates of each routed copy
    (2·k·f), ``moe`` everything inside the MoE layer; the attention core alone drops nothing
    under flash attention."""
    h, f, k = model.hidden_size, model.moe.expert_ffn_hidden_size, model.moe.top_k
    tokens = model.seq_len

    def kept(*modules: str) -> float:
        return model.activation_bytes_per_layer(0, 1, recompute="selective", modules=modules)

    none = model.activation_bytes_per_layer(0, 1, recompute="none")
    assert kept("core_attn") == none
    assert none - kept("layernorm") == pytest.approx(2 * h * tokens)
    assert none - kept("moe_act") == pytest.approx(2 * k * f * tokens)
    assert none - kept("layernorm", "moe_act") == pytest.approx((2 * h + 2 * k * f) * tokens)
    inside = (4 * model.moe.num_experts + 2 * k * 2 * h + k * 3 * 2 * f) * tokens
    assert none - kept("moe") == pytest.approx(inside)
    assert kept("moe", "moe_act") == kept("moe")  # moe already discards the activation output
    assert kept("layernorm", "moe") < kept("moe") < kept("layernorm", "moe_act") < none
    assert kept("moe") > model.activation_bytes_per_layer(0, 1, recompute="full")


def test_the_moe_module_runs_the_layer_and_its_exchanges_again(model):
    """``moe`` re-runs the router and the routed experts (their FLOPs) and the dispatch and
    combine exchanges in the backward, as the full recompute does; ``moe_act`` only the
    activation function's bytes; ``layernorm`` one norm of an MoE layer."""
    deg = ParallelDims(tp=1, ep=8, dp=8)

    def layer(*modules: str, mode: str = "selective"):
        training = Training(global_batch_size=256, activation_recompute=mode,  # type: ignore[arg-type]
                            recompute_modules=modules or None, fused_kernels=True)  # type: ignore[arg-type]
        return mp_units(model, training, deg)[1]

    base, moe, act, norm = layer("core_attn"), layer("moe"), layer("moe_act"), layer("layernorm")
    assert not base.ep_recomputed and moe.ep_recomputed and layer(mode="full").ep_recomputed
    assert moe.moe.experts_backward.gemm == pytest.approx(base.moe.experts_backward.gemm + base.moe.experts.gemm)
    assert moe.moe.router_backward.gemm == pytest.approx(base.moe.router_backward.gemm + base.moe.router.gemm)
    # moe_act: the grouped GEMMs once, the activation function's bytes once more
    assert act.moe.experts_backward.gemm == pytest.approx(base.moe.experts_backward.gemm)
    assert act.moe.experts_backward.bytes_accessed == pytest.approx(
        base.moe.experts_backward.bytes_accessed + base.moe.experts.bytes_accessed)
    # layernorm: the pre-MLP norm (read and write h bf16 values per token) once more; no attention again
    assert norm.backward.bytes_accessed - layer("none", mode="none").backward.bytes_accessed == pytest.approx(
        2 * 2 * model.hidden_size * model.seq_len)
    assert norm.backward.attention_forward == layer("none", mode="none").backward.attention_forward


def test_a_step_trades_memory_for_time_as_the_modules_say():
    """Simulated: each list keeps less than no recompute, the MoE layer's recompute costs a
    longer step than the norms and activations, and the full recompute keeps the least."""
    out = {}
    for key, rc, mods in (("none", "none", None), ("ln_act", "selective", ["layernorm", "moe_act"]),
                          ("moe", "selective", ["layernorm", "moe"]), ("full", "full", None)):
        sc = mixtral(rc, mods)
        out[key] = run_choice(sc, sc.strategies[0])
    peak = {k: r["peak_memory_bytes"] for k, r in out.items()}
    step = {k: r["step_time_s"] for k, r in out.items()}
    assert peak["full"] < peak["moe"] < peak["ln_act"] < peak["none"]
    assert step["none"] < step["ln_act"] < step["moe"] < step["full"]
    assert out["moe"]["hfu"] > out["moe"]["mfu"]


def test_the_validation_reads_a_rows_module_list():
    assert map_recompute_modules("selective (layernorm, moe_act)")[0] == ["layernorm", "moe_act"]
    assert map_recompute_modules("selective (RMSNorm, MLA up-projection recompute)")[0] == ["layernorm", "mla_up_proj"]
    modules, notes = map_recompute_modules("selective (moe_act, layernorm) + activation offload (expert_fc1, moe_act)")
    assert modules == ["moe_act", "layernorm"] and any("not modelled" in n for n in notes)
    assert map_recompute_modules("selective (per-op SAC)") == (None, [])
    assert map_recompute_modules("selective") == (None, [])


@pytest.mark.parametrize("sets,key", [
    (["training.activation_recompute=full", "training.recompute_modules=[moe]"], "training.recompute_modules"),
    (["training.activation_recompute=selective", "training.recompute_modules=[attention]"], "training.recompute_modules[0]"),
    (["training.activation_recompute=selective", "training.recompute_modules=[]"], "training.recompute_modules"),
    (["training.activation_recompute=selective", "training.recompute_modules=[moe, moe]"], "training.recompute_modules"),
    (["model=llama2-7b", "training.activation_recompute=selective", "training.recompute_modules=[moe_act]"],
     "training.recompute_modules"),
    (["training.activation_recompute=selective", "training.recompute_modules=[mla_up_proj]"], "training.recompute_modules"),
    (["training.activation_recompute=selective", "training.recompute_modules=[shared_experts]"], "training.recompute_modules"),
])
def test_bad_module_lists_exit_2_naming_the_key(sets, key, capsys):
    args = ["run", "--set", "model=mixtral-8x7b", "--set", "strategy.name=nd", "--set", "strategy.ep=8"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


def test_mla_up_projections_and_a_dense_mlp_run_again():
    """DeepSeek-V3: ``mla_up_proj`` drops the up-projected Q, K and V and runs the two
    up-projection GEMMs again; ``mlp`` applies to its dense first layers only; ``layernorm``
    recomputes MLA's input norm in every layer (not fused into a linear there)."""
    sc = scenario_from_mapping({"model": "deepseek-v3", "training": {"activation_recompute": "selective"},
                                "cluster": {"preset": "dgx-h100", "num_nodes": 8},
                                "strategy": {"name": "nd", "pp": 8, "ep": 8}})
    m = sc.model
    dense, moe = 0, m.num_layers - 1
    assert not m.is_moe_layer(dense) and m.is_moe_layer(moe)
    h, a, tokens = m.hidden_size, m.num_heads, m.seq_len
    terms = m.activation_terms_per_token(dense)
    qkv = sum(terms[n][0] for n in ("attn_q", "attn_k", "attn_v"))
    none = m.activation_bytes_per_layer(dense, 1, recompute="none")
    assert none - m.activation_bytes_per_layer(dense, 1, recompute="selective", modules=("mla_up_proj",)) == \
        pytest.approx(qkv * tokens)
    mla = m.mla
    up = mla.q_lora_rank * a * (mla.qk_nope_head_dim + mla.qk_rope_head_dim) + \
        mla.kv_lora_rank * a * (mla.qk_nope_head_dim + mla.v_head_dim)
    assert m.recompute_forward_flops(dense, 1, "selective", modules=("mla_up_proj",)) == pytest.approx(2 * up)
    mlp = sum(k * n for k, n, _ in m.layer_linears(dense)["mlp"])
    assert m.recompute_forward_flops(dense, 1, "selective", modules=("mlp",)) == pytest.approx(2 * mlp)
    assert m.recompute_forward_flops(moe, 1, "selective", modules=("mlp",)) == 0
    # layernorm: the input norm's output in a dense MLA layer, both norms' in an MoE layer
    assert none - m.activation_bytes_per_layer(dense, 1, recompute="selective", modules=("layernorm",)) == \
        pytest.approx(2 * h * tokens)
    assert m.activation_bytes_per_layer(moe, 1, recompute="none") - m.activation_bytes_per_layer(
        moe, 1, recompute="selective", modules=("layernorm",)) == pytest.approx(2 * 2 * h * tokens)
