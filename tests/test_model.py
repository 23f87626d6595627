"""Architecture math checked against numbers from outside the code.

Run: /work/venv/bin/python -m pytest tests/test_model.py -q

Sources: published parameter counts (papers / model cards), Korthikanti et al. 2022
(arXiv 2205.05198) Table 2, Narayanan et al. SC'21 (arXiv 2104.04473) §5.1, hand calculations.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from hzpsim.model import MLA, Model, MoE

WORKLOADS = Path(__file__).resolve().parent.parent / "workloads"
PRESETS = sorted(p.stem for p in WORKLOADS.glob("*.yaml"))


def load(name: str) -> Model:
    """Minimal preset reader (the real loader lives elsewhere)."""
    data = yaml.safe_load((WORKLOADS / f"{name}.yaml").read_text())
    if data.get("moe") is not None:
        data["moe"] = MoE(**data["moe"])
    if data.get("mla") is not None:
        data["mla"] = MLA(**data["mla"])
    return Model(**data)


def test_every_preset_loads_validates_and_is_named_like_its_file():
    assert len(PRESETS) >= 15
    for name in PRESETS:
        model = load(name)
        model.validate()
        assert model.name == name
        pinned = {n for n, *_ in PUBLISHED_TOTAL} | set(HAND_COUNTED)
        assert name in pinned, f"{name}: add its published or hand-counted total to PUBLISHED_TOTAL / HAND_COUNTED"


# --------------------------------------------------------------------------- parameters
# Tolerance 0.5 % unless stated: every figure below is published to 3-4 significant digits.
PUBLISHED_TOTAL = [
    # GPT-3 175B: "175B" (Brown et al. 2020, Table 2.1); exact sum of the architecture = 174.6B
    ("gpt3-175b", 174.6e9, 0.005),
    # Llama 2 7B: 6.74B, Llama 2 70B: 68.98B (Llama-2 model cards / HF parameter counts)
    ("llama2-7b", 6.74e9, 0.005),
    ("llama2-13b", 13.0e9, 0.005),  # Llama 2 paper Table 1 "13B"; HF 13.0B
    ("llama2-70b", 68.98e9, 0.005),
    # Llama 3 8B: 8.03B, 70B: 70.6B, 405B: 405.85B (HF model cards for Meta-Llama-3 / 3.1)
    ("llama3-8b", 8.03e9, 0.005),
    ("llama3-70b", 70.6e9, 0.005),
    ("llama3-405b", 405.85e9, 0.005),
    # Mixtral 8x7B: 46.7B total (Jiang et al. 2024, arXiv 2401.04088, §2)
    ("mixtral-8x7b", 46.7e9, 0.005),
    # DeepSeek-V3: 671B total, MTP module excluded (arXiv 2412.19437, abstract)
    ("deepseek-v3", 671e9, 0.005),
    # MPT-30B model card: n_parameters 29.95B
    ("mpt-30b", 29.95e9, 0.005),
    # MPT-7B model card: n_parameters 6.7B, rounded to 2 digits: 1 % tolerance
    ("mpt-7b", 6.7e9, 0.01),
    # Qwen3 model cards: 235B total (22B active), 30.5B total (3.3B active)
    ("qwen3-235b-a22b", 235e9, 0.005),
    ("qwen3-30b-a3b", 30.5e9, 0.005),
    # gpt-oss model card (OpenAI, 2025): 116.83B and 20.91B total parameters
    ("gpt-oss-120b", 116.83e9, 0.005),
    ("gpt-oss-20b", 20.91e9, 0.005),
    # Kimi K2 model card: "1 trillion total parameters", stated to one digit: 3 % tolerance
    ("kimi-k2", 1.0e12, 0.03),
    # Grok-1 release (xai-org/grok-1 README): 314B parameters
    ("grok-1", 314e9, 0.01),
]


@pytest.mark.parametrize(("name", "published", "rel"), PUBLISHED_TOTAL)
def test_total_params_match_published(name, published, rel):
    assert load(name).num_params() == pytest.approx(published, rel=rel)


# Presets with no published total, counted by hand from their YAML (h hidden, f ffn, V vocab):
HAND_COUNTED = {
    # 4 SwiGLU layers: q, o 2h^2 + k, v 2 x h x 128 (2 kv heads of 64) + 3 h f + 2 norms h;
    # embedding V h; untied head V h + final norm h  (h 256, f 688, V 1,024)
    "tiny-dense": 4 * (2 * 256**2 + 2 * 256 * 128 + 3 * 256 * 688 + 2 * 256) + 1024 * 256 + 1024 * 256 + 256,
    # 4 GELU layers with biases: 4h^2 + 4h + 2 h f + f + h + 2 layernorms 2h; tied embedding
    # V h; learned positions s h; final layernorm 2h  (h 256, f 1,024, s 128)
    "tiny-gpt": 4 * (4 * 256**2 + 4 * 256 + 2 * 256 * 1024 + 1024 + 256 + 4 * 256) + 1024 * 256 + 128 * 256 + 2 * 256,
    # layer 0 dense as tiny-dense; layers 1-3: attention + 2 norms + router h x 4 + 4 experts
    # of 3 h x 344; embedding, untied head, final norm
    "tiny-moe": (2 * 256**2 + 2 * 256 * 128 + 3 * 256 * 688 + 2 * 256)
    + 3 * (2 * 256**2 + 2 * 256 * 128 + 2 * 256 + 256 * 4 + 4 * 3 * 256 * 344) + 2 * 1024 * 256 + 256,
    # 80 GELU layers without biases: 4h^2 + 2 h f + 2 norms h; tied embedding; final norm
    # (h 8,192, f 32,768, V 50,368; MPT's configuration, no published 70B release)
    "mpt-70b": 80 * (4 * 8192**2 + 2 * 8192 * 32768 + 2 * 8192) + 50368 * 8192 + 8192,
}


@pytest.mark.parametrize(("name", "total"), sorted(HAND_COUNTED.items()))
def test_total_params_match_hand_count(name, total):
    assert load(name).num_params() == total


@pytest.mark.parametrize(
    ("name", "published", "rel"),
    [
        # Mixtral: 12.9B active per token (arXiv 2401.04088, §2 "13B active"; HF card 12.9B)
        ("mixtral-8x7b", 12.9e9, 0.005),
        # DeepSeek-V3: "37B activated" (abstract), a rounded figure; we get 37.55B with the
        # 0.93B embedding table counted (36.6B without): 2 % tolerance.
        ("deepseek-v3", 37e9, 0.02),
    ],
)
def test_active_params_match_published(name, published, rel):
    assert load(name).num_active_params() == pytest.approx(published, rel=rel)


def test_gpt3_param_count_by_hand():
    # Per layer 12h² + 13h (QKV/O and MLP weights, their biases 4h + 5h, two LayerNorms 4h);
    # token table V·h, position table 2048·h, final LayerNorm 2h, tied head.
    h, layers, V = 12288, 96, 50257
    expected = layers * (12 * h * h + 13 * h) + V * h + 2048 * h + 2 * h
    assert expected == 174_604_259_328
    assert load("gpt3-175b").num_params() == expected


def test_llama2_70b_gqa_param_count_by_hand():
    # q,o: h² each; k,v: h·(8·128) each; SwiGLU 3·h·f; two RMSNorms 2h; embedding + head 2·V·h.
    h, f, V = 8192, 28672, 32000
    per_layer = 2 * h * h + 2 * h * 1024 + 3 * h * f + 2 * h
    assert load("llama2-70b").num_params() == 80 * per_layer + 2 * V * h + h


def test_moe_layer_placement_and_counts():
    m = Model(6, 64, 4, 256, 100, 32, moe=MoE(8, 2, 32, moe_layer_interval=2, first_dense_layers=1))
    assert [m.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    assert m.num_moe_layers == 3
    assert load("deepseek-v3").num_moe_layers == 58  # 61 layers, first 3 dense
    assert load("mixtral-8x7b").num_moe_layers == 32
    # An MoE layer holds all experts; a token uses top_k of them (SwiGLU expert = 3·h·f_e).
    expert = 3 * 64 * 32
    assert m.expert_params() == expert
    assert m.layer_params(1) - m.layer_params(0) == 8 * expert + 64 * 8 - m.dense_mlp_params()
    assert m.layer_params(1) - m.layer_active_params(1) == 6 * expert
    assert m.layer_params(0) == m.layer_active_params(0)


def test_deepseek_v3_mla_params_by_hand():
    # DeepSeek-V3 config.json: q_a 7168×1536, q_a_norm 1536, q_b 1536×128·192, kv_a 7168×576,
    # kv_a_norm 512, kv_b 512×128·256, o 128·128×7168.
    expected = (
        7168 * 1536
        + 1536
        + 1536 * 128 * 192
        + 7168 * 576
        + 512
        + 512 * 128 * 256
        + 128 * 128 * 7168
    )
    assert load("deepseek-v3").attention_params() == expected == 187_107_328


def test_tied_head_has_no_params_but_still_counts_as_matmul():
    m = load("gpt3-175b")
    h, V = m.hidden_size, m.vocab_size
    assert m.head_params() == 0
    assert m.matmul_params_active_per_token() == 96 * 12 * h * h + h * V


# --------------------------------------------------------------------------- FLOPs
def test_sc21_flops_formula_exact_for_gpt():
    # SC'21 §5.1: F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per iteration, with full recompute
    # (4 forward-equivalents per layer), attention over the full s×s matrix (no causal halving)
    # and the LM head without recompute (3 passes). Biases/norms/softmax are not counted on
    # either side, so the match is exact (up to float rounding).
    m = load("gpt3-175b")
    B, s, L, h, V = 1536, m.seq_len, m.num_layers, m.hidden_size, m.vocab_size
    sc21 = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    ours = B * s * m.training_flops_per_token(recompute="full", causal=False)
    assert ours == pytest.approx(sc21, rel=1e-12)
    # Without recompute the factor is 72 and the head term V/(12lh): PaLM's model FLOPs.
    no_recompute = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert B * s * m.model_flops_per_token() == pytest.approx(no_recompute, rel=1e-12)
    assert m.training_flops_per_token("none", causal=False) == pytest.approx(
        m.model_flops_per_token()
    )


def test_model_flops_per_token_hand_example():
    # tiny-dense: l=4, h=256, a=4 heads of d=64, 2 KV heads, SwiGLU f=688, V=1024, s=128.
    # Matmul params per layer: q 256·256 + k,v 2·256·128 + o 256·256 = 196,608;
    # MLP 3·256·688 = 528,384 → 724,992; × 4 layers + head 256·1024 = 3,162,112.
    # 6 × 3,162,112 = 18,972,672; attention 12·4·4·64·128 = 1,572,864; total 20,545,536.
    m = load("tiny-dense")
    assert m.matmul_params_active_per_token() == 3_162_112
    assert m.model_flops_per_token() == 20_545_536


def test_layer_forward_flops_and_recompute():
    m = load("tiny-dense")
    f = m.layer_forward_flops(0, num_tokens=10, causal=False)
    assert f["gemm"] == 2 * 724_992 * 10
    assert f["attention"] == 4 * 10 * 128 * 4 * 64  # QK^T and PV: 4·tokens·s·a·d
    assert m.layer_forward_flops(0, 10)["attention"] == f["attention"] / 2  # causal halves
    assert m.head_forward_flops(10) == 2 * 256 * 1024 * 10
    assert m.recompute_forward_flops(0, 10, "none") == 0
    assert m.recompute_forward_flops(0, 10, "selective", causal=False) == f["attention"]
    assert m.recompute_forward_flops(0, 10, "full", causal=False) == f["gemm"] + f["attention"]
    with pytest.raises(ValueError, match="recompute"):
        m.recompute_forward_flops(0, 10, "sometimes")


def test_moe_flops_count_top_k_experts_and_router():
    m = load("mixtral-8x7b")
    h, e = 4096, 3 * 4096 * 14336
    attn = 2 * h * h + 2 * h * 1024
    assert m.layer_forward_flops(0, 1)["gemm"] == 2 * (attn + 2 * e + h * 8)


# --------------------------------------------------------------------------- activations
GPT = Model(
    num_layers=4,
    hidden_size=1024,
    num_heads=16,
    ffn_hidden_size=4096,
    vocab_size=1000,
    seq_len=2048,
    mlp="gelu",
    linear_bias=True,
    norm="layernorm",
    norm_bias=True,
    position_embedding="learned",
)  # MHA, GELU, ffn = 4h: the model Korthikanti's Table 2 assumes
S, B, H, A = 2048, 4, 1024, 16
SBH = S * B * H
LSE = 4 * A * S * B  # flash attention's softmax statistics: one fp32 per head and token


def test_korthikanti_table2_no_parallelism():
    # Table 2, row "no parallelism": sbh(34 + 5as/h)
    expected = SBH * (34 + 5 * A * S / H)
    assert GPT.activation_bytes_per_layer(0, B, flash_attention=False) == expected
    # hand value: 2048·4·1024 · (34 + 160) = 1,627,389,952 bytes
    assert expected == 1_627_389_952


@pytest.mark.parametrize("t", [2, 4, 8])
def test_korthikanti_table2_tensor_parallel(t):
    # Table 2, "tensor parallel (baseline)": sbh(10 + 24/t + 5as/(ht))
    got = GPT.activation_bytes_per_layer(0, B, tp=t, flash_attention=False)
    assert got == pytest.approx(SBH * (10 + 24 / t + 5 * A * S / (H * t)), rel=1e-12)
    # Table 2, "tensor + sequence parallel": sbh/t·(34 + 5as/h)
    got = GPT.activation_bytes_per_layer(0, B, tp=t, sequence_parallel=True, flash_attention=False)
    assert got == pytest.approx(SBH / t * (34 + 5 * A * S / H), rel=1e-12)
    # Table 2, "tensor + sequence parallel + selective recompute": 34·sbh/t
    got = GPT.activation_bytes_per_layer(
        0, B, tp=t, sequence_parallel=True, recompute="selective", flash_attention=False
    )
    assert got == pytest.approx(34 * SBH / t, rel=1e-12)
    # Table 2, "tensor parallel + selective recompute": sbh(10 + 24/t)
    got = GPT.activation_bytes_per_layer(0, B, tp=t, recompute="selective", flash_attention=False)
    assert got == pytest.approx(SBH * (10 + 24 / t), rel=1e-12)


def test_korthikanti_full_recompute_and_flash():
    # §4.3 / Table 2 "full recompute": 2sbh, the layer input (divided by t with SP)
    assert GPT.activation_bytes_per_layer(0, B, tp=8, recompute="full") == 2 * SBH
    assert (
        GPT.activation_bytes_per_layer(0, B, tp=8, sequence_parallel=True, recompute="full")
        == 2 * SBH / 8
    )
    # A flash-attention kernel stores no s×s matrix: the 5as²b term goes, 34sbh remains, plus
    # the kernel's fp32 log-sum-exp (4 bytes per head and token), which Korthikanti leaves out.
    assert GPT.activation_bytes_per_layer(0, B) == 34 * SBH + LSE
    # Breakdown (Korthikanti §4.1): attention 11sbh, MLP 19sbh, two LayerNorms 4sbh
    terms = GPT.activation_terms_per_token(0)
    attn = sum(v for k, (v, _) in terms.items() if k.startswith("attn_"))
    mlp = sum(v for k, (v, _) in terms.items() if k.startswith("mlp_"))
    assert (attn, mlp, terms["norm_inputs"][0]) == (11 * H, 19 * H, 4 * H)


def test_context_parallel_divides_sequence():
    # With flash attention everything is linear in the local sequence s/cp.
    assert GPT.activation_bytes_per_layer(0, B, cp=4) == (34 * SBH + LSE) / 4
    # The score term: local queries (s/cp) against all s keys, 5·a·(s/cp)·s·b bytes.
    got = GPT.activation_bytes_per_layer(0, B, cp=4, flash_attention=False)
    assert got == 34 * SBH / 4 + 5 * A * (S / 4) * S * B


def test_activation_generalisation_gqa_swiglu_by_hand():
    # llama2-70b (no dropout), b=1, s=4096: replicated 8h (norm inputs 4h, QKV input 2h, MLP
    # input 2h); split: Q 2h, K and V 2·(8·128) each, projection input 2h, SwiGLU
    # gate/up/product 3·2·f. t=8 with SP divides everything by 8.
    m = load("llama2-70b")
    assert m.dropout is False
    h, f, s = 8192, 28672, 4096
    per_token = 8 * h + (2 * h + 2 * 1024 * 2 + 2 * h) + 6 * f + 4 * 64  # + flash's fp32 log-sum-exp, 64 heads
    assert m.activation_bytes_per_layer(0, 1) == s * per_token
    assert m.activation_bytes_per_layer(0, 1, tp=8, sequence_parallel=True) == s * per_token / 8


def test_activation_moe_layer_by_hand():
    # tiny-moe layer 1 (MoE, 4 experts top-2, SwiGLU f_e=344, h=256, 4 heads of 64, 2 KV heads):
    # replicated 10h + fp32 router probs 4·4 + 2 copies × (expert input + output) 2·2·2h;
    # split: Q 2h + K,V 2·2·128 + proj 2h + 2 copies × 3·2·344.
    m = load("tiny-moe")
    h = 256
    rep = 10 * h + 16 + 2 * 2 * 2 * h
    split = 2 * h + 2 * 2 * 128 + 2 * h + 2 * 6 * 344 + 4 * 4  # + flash's fp32 log-sum-exp, 4 heads
    assert m.activation_bytes_per_layer(1, 2) == 128 * 2 * (rep + split)
    assert m.activation_bytes_per_layer(1, 2, tp=2) == 128 * 2 * (rep + split / 2)


def test_no_dropout_removes_masks():
    no_drop = dataclasses.replace(GPT, dropout=False)
    assert no_drop.activation_bytes_per_layer(0, B) == 32 * SBH + LSE
    # without dropout only the softmax output (2 bytes) of the s×s matrix is kept
    assert (
        no_drop.activation_bytes_per_layer(0, B, flash_attention=False)
        == 32 * SBH + 2 * A * S * S * B
    )


# --------------------------------------------------------------------------- validation
def _tiny(**overrides) -> Model:
    return dataclasses.replace(load("tiny-dense"), **overrides)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_kv_heads": 3}, "num_kv_heads"),  # 4 heads not divisible by 3
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_layers": -1}, "num_layers"),
        # 256 not divisible by 3 heads and no head_dim given
        ({"num_heads": 3, "num_kv_heads": None}, "head_dim"),
        ({"num_heads": 3, "num_kv_heads": None, "head_dim": 0}, "head_dim"),
        ({"mlp": "relu"}, "mlp"),
        ({"moe": MoE(num_experts=4, top_k=5, expert_ffn_hidden_size=64)}, "moe.top_k"),
        (
            {"moe": MoE(num_experts=4, top_k=1, expert_ffn_hidden_size=0)},
            "moe.expert_ffn_hidden_size",
        ),
        ({"moe": MoE(4, 1, 64, first_dense_layers=4)}, "moe.first_dense_layers"),
        (
            {"mla": MLA(kv_lora_rank=16, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)},
            "num_kv_heads",
        ),
        ({"mla": MLA(0, 32, 16, 32), "num_kv_heads": None}, "mla.kv_lora_rank"),
    ],
)
def test_validate_rejects_impossible_architectures(overrides, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        _tiny(**overrides).validate()


def test_head_dim_override_allows_uneven_split():
    m = _tiny(num_heads=3, num_kv_heads=None, head_dim=64)
    m.validate()
    assert m.head_dim_resolved == 64
    assert m.attention_params() == 4 * 256 * 3 * 64


def test_summary_is_plain_data():
    s = load("mixtral-8x7b").summary()
    assert s["name"] == "mixtral-8x7b"
    assert s["num_params"] == load("mixtral-8x7b").num_params()
    assert s["num_experts"] == 8 and s["attention"] == "gqa"


def test_elementwise_traffic_of_a_gpt_layer_is_46h_bytes_per_token():
    # counted kernel by kernel: 2 norms (read + write), 2 residual adds (2 reads + write),
    # 2 dropouts (read + write + 1-byte mask), GELU on the 4h intermediate (read + write)
    m = Model(num_layers=1, hidden_size=1024, num_heads=16, ffn_hidden_size=4096, vocab_size=128,
              seq_len=2048, mlp="gelu", norm="layernorm", position_embedding="learned")
    total = sum(v for v, _ in m.elementwise_bytes_per_token(0).values())
    assert total == 46 * 1024


def test_swiglu_moves_5_bytes_per_element_eager_and_3_fused():
    """Eager SwiGLU is two kernels, silu (read, write) and the product (2 reads, write): 5·B·f;
    fused (Megatron's bias_swiglu_impl, torch.compile) one kernel: 3·B·f; GELU 2·B·f either way.
    The layer's traffic follows ``training.fused_pointwise``, for routed experts too."""
    from hzpsim.model import activations
    from hzpsim.model.training import Training
    from hzpsim.strategies._dims import ParallelDims
    from hzpsim.strategies._mp_units import mp_units

    m = _tiny()
    assert m.mlp == "swiglu"
    assert activations.activation_fn_bytes_per_ffn(m, fused=False) == 5
    assert activations.activation_fn_bytes_per_ffn(m, fused=True) == 3
    assert activations.activation_fn_bytes_per_ffn(dataclasses.replace(m, mlp="gelu"), fused=False) == 2
    assert m.elementwise_bytes_per_token(0)["activation_fn"][0] == 5 * 2 * m.ffn_hidden_size

    def traffic(model, fused: bool, moe: bool = False) -> float:
        training = Training(global_batch_size=8, micro_batch_size=1, fused_kernels=fused)
        unit = mp_units(model, training, ParallelDims(dp=1, tp=1, pp=1))[1]
        if moe:
            assert unit.moe is not None
            return unit.moe.experts.bytes_accessed
        return unit.pre.bytes_accessed + unit.post.bytes_accessed

    # the fused kernels also fold the residual adds and dropouts: compare with those alone
    eager_minus_fused = traffic(m, False) - traffic(m, True)
    gelu = dataclasses.replace(m, mlp="gelu")
    assert eager_minus_fused - (traffic(gelu, False) - traffic(gelu, True)) == pytest.approx(
        2 * 2 * m.ffn_hidden_size * m.seq_len, rel=1e-9)
    mixtral = load("mixtral-8x7b")
    assert traffic(mixtral, False, moe=True) == pytest.approx(traffic(mixtral, True, moe=True) * 5 / 3, rel=1e-9)


def test_torchtitan_op_sac_policy_recomputes_every_second_mm():
    """The per-op policy lives in hzpsim.model.checkpointing under torchtitan's name; a Llama
    layer (wq, wk, wv, wo, w1, w3, w2) runs wk, wo and w3 again; Model's method is that function."""
    from hzpsim.model import checkpointing

    m = _tiny(num_layers=2)
    h, kv, f = m.hidden_size, m.kv_heads * m.head_dim_resolved, m.ffn_hidden_size
    redo = checkpointing.torchtitan_op_sac_recomputed_linears(m, 0)
    assert redo["attention"] == [(h, kv, "column"), (h, h, "row")]
    assert redo["mlp"] == [(h, f, "column")] and redo["router"] == redo["expert"] == []
    assert m.op_sac_recomputed_linears(0) == redo


@pytest.mark.parametrize("name", ["llama2-7b", "mixtral-8x7b", "deepseek-v3"])
def test_model_methods_are_the_split_modules_functions(name):
    """``Model`` keeps thin methods for its callers; the counts come from activations.py,
    checkpointing.py and dispatch.py."""
    from hzpsim.model import activations, checkpointing, dispatch

    m = load(name)
    last = m.num_layers - 1
    for mode in ("none", "selective", "op", "full"):
        assert m.recompute_forward_flops(last, 7, mode) == checkpointing.recompute_forward_flops(m, last, 7, mode)
        assert m.activation_bytes_per_layer(last, 2, tp=2, recompute=mode) == activations.activation_bytes_per_layer(
            m, last, 2, tp=2, recompute=mode)
    assert m.elementwise_bytes_per_token(last) == activations.elementwise_bytes_per_token(m, last)
    assert m.layer_kernels_forward(last, backward=True) == dispatch.layer_kernels_forward(m, last, backward=True)
    assert m.layer_kernels_fused(last) == dispatch.layer_kernels_fused(m, last) > 0
    assert m.norm_ops() == dispatch.norm_ops(m)


# --------------------------------------------------------------------------- layer kinds
@pytest.mark.parametrize("name", PRESETS)
def test_layers_of_one_kind_are_alike_in_every_per_layer_quantity(name):
    """``Model.layer_kind`` names what sets a layer's per-layer quantities, and the unit
    builders compute one layer of each kind (``_mp_units.mp_units``): two layers of one kind
    must agree in every per-layer method, or a model that varies layers another way (per-layer
    attention windows, say) gets the first layer's costs for all of them."""
    from hzpsim.model import activations, checkpointing, dispatch

    model = load(name)
    per_layer = [
        model.layer_linears, model.layer_tensors, model.layer_params, model.layer_active_params,
        model.layer_matmul_params_active, lambda i: model.layer_forward_flops(i, 4096),
        lambda i: activations.elementwise_bytes_per_token(model, i),
        lambda i: model.activation_bytes_per_layer(i, 1, tp=2, sequence_parallel=True, recompute="selective"),
        lambda i: dispatch.layer_kernels_forward(model, i), lambda i: dispatch.layer_kernels_fused(model, i),
        lambda i: checkpointing.recompute_forward_flops(model, i, 4096, "full"),
    ]
    first: dict = {}
    for i in range(model.num_layers):
        values = [f(i) for f in per_layer]
        first.setdefault(model.layer_kind(i), (i, values))
        j, expected = first[model.layer_kind(i)]
        assert values == expected, f"{name}: layers {j} and {i} are of one kind but differ"
    windows = len({model.attention_window(i) for i in range(model.num_layers)})  # gpt-oss: 128 and full
    assert len(first) == (1 if model.moe is None or model.num_moe_layers in (0, model.num_layers) else 2) * windows
