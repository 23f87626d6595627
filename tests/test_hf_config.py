"""``model: path/to/config.json``: Hugging Face configs read into the Model (hzpsim.model.hf_config).

The shipped configs (examples/hf/*/config.json, the published config.json values typed in, see
examples/hf/README.md) load with the right fields and reproduce the published parameter
counts; an imported config simulates exactly as the built-in preset of the same architecture;
unknown model types and wrong-typed fields exit 2 from the CLI naming the key.

    python -m pytest tests/test_hf_config.py -q
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from scenario_helpers import BASE, base, error_of

from hzpsim.cli import main
from hzpsim.config import ScenarioError, from_mapping
from hzpsim.model import Model
from hzpsim.model.hf_config import ARCHITECTURES, model_fields
from hzpsim.scenario import load_scenario, scenario_from_mapping

REPO = Path(__file__).resolve().parents[1]
HF = REPO / "examples" / "hf"
SHIPPED = sorted(p.name for p in HF.iterdir() if (p / "config.json").is_file())


def imported(name: str, **changes) -> Model:
    return from_mapping(Model, {**model_fields(HF / name), **changes}, "model")


def preset(name: str) -> Model:
    return scenario_from_mapping(base(model=name)).model


def test_the_shipped_configs():
    assert SHIPPED == ["deepseek-v3", "gpt2", "llama-3-8b", "mixtral-8x7b", "qwen3-30b-a3b"]


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("llama-3-8b", dict(num_layers=32, hidden_size=4096, num_heads=32, kv_heads=8, head_dim_resolved=128,
                            ffn_hidden_size=14336, vocab_size=128256, seq_len=8192, mlp="swiglu", norm="rmsnorm",
                            position_embedding="rope", tied_embeddings=False, dropout=False, moe=None, mla=None)),
        ("mixtral-8x7b", dict(num_layers=32, kv_heads=8, vocab_size=32000, seq_len=32768, num_moe_layers=32)),
        ("deepseek-v3", dict(num_layers=61, hidden_size=7168, num_heads=128, ffn_hidden_size=18432,
                             vocab_size=129280, seq_len=4096, num_moe_layers=58, head_dim_resolved=192,
                             v_head_dim_resolved=128)),
        ("qwen3-30b-a3b", dict(num_layers=48, hidden_size=2048, num_heads=32, kv_heads=4, head_dim=128,
                               vocab_size=151936, seq_len=40960, qk_norm=True, qkv_bias=False, num_moe_layers=48)),
        ("gpt2", dict(num_layers=12, hidden_size=768, num_heads=12, ffn_hidden_size=3072, vocab_size=50257,
                      seq_len=1024, max_position_embeddings=1024, mlp="gelu", norm="layernorm", norm_bias=True,
                      linear_bias=True, position_embedding="learned", tied_embeddings=True, dropout=True)),
    ],
)
def test_each_shipped_config_loads_with_the_right_fields(name, fields):
    model = imported(name)
    assert model.name == name
    for key, value in fields.items():
        assert getattr(model, key) == value, key


def test_moe_and_mla_fields():
    mixtral = imported("mixtral-8x7b").moe
    assert (mixtral.num_experts, mixtral.top_k, mixtral.expert_ffn_hidden_size) == (8, 2, 14336)
    assert (mixtral.num_shared_experts, mixtral.first_dense_layers, mixtral.moe_layer_interval) == (0, 0, 1)
    v3 = imported("deepseek-v3")
    assert v3.moe is not None and v3.mla is not None
    assert (v3.moe.num_experts, v3.moe.top_k, v3.moe.expert_ffn_hidden_size) == (256, 8, 2048)
    assert (v3.moe.num_shared_experts, v3.moe.shared_ffn_resolved, v3.moe.first_dense_layers) == (1, 2048, 3)
    assert dataclasses.astuple(v3.mla) == (512, 128, 64, 128, 1536)
    qwen = imported("qwen3-30b-a3b").moe
    assert (qwen.num_experts, qwen.top_k, qwen.expert_ffn_hidden_size, qwen.num_shared_experts) == (128, 8, 768, 0)


# Published totals (0.5 % unless stated; the sources are in examples/hf/README.md).
PUBLISHED = [
    # Llama 3 8B: 8.03B (HF model card; vocab 128,256, untied head)
    ("llama-3-8b", 8.03e9, 8.03e9, 0.005),
    # Mixtral 8x7B: 46.7B total, 12.9B active (arXiv 2401.04088 §2; HF card)
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.005),
    # DeepSeek-V3: 671B total, 37B activated, MTP module excluded (arXiv 2412.19437 abstract)
    ("deepseek-v3", 671e9, None, 0.005),
    # Qwen3-30B-A3B: 30.5B total, 3.3B activated (Qwen3 model card)
    ("qwen3-30b-a3b", 30.5e9, None, 0.005),
    # GPT-2 (small): 124M with the tied head (HF parameter count 124,439,808)
    ("gpt2", 124.44e6, 124.44e6, 0.005),
]


@pytest.mark.parametrize(("name", "total", "active", "rel"), PUBLISHED)
def test_parameter_totals_match_published(name, total, active, rel):
    model = imported(name)
    assert model.num_params() == pytest.approx(total, rel=rel)
    if active is not None:
        assert model.num_active_params() == pytest.approx(active, rel=rel)


@pytest.mark.parametrize(
    ("name", "published"),
    [
        # "37B activated" and "3.3B activated" are rounded to two digits; we count 37.55B (the
        # 0.93B embedding table included, 36.6B without) and 3.35B (3.04B without the input
        # embedding): 2 % tolerance, as tests/test_model.py does for the DeepSeek-V3 preset
        ("deepseek-v3", 37e9),
        ("qwen3-30b-a3b", 3.3e9),
    ],
)
def test_active_parameters_of_rounded_publications(name, published):
    assert imported(name).num_active_params() == pytest.approx(published, rel=0.02)


def test_exact_counts_by_hand():
    # GPT-2: per layer 12h^2 + 13h, tied embedding V h, positions 1024 h, final LayerNorm 2h
    h = 768
    assert imported("gpt2").num_params() == 12 * (12 * h * h + 13 * h) + 50257 * h + 1024 * h + 2 * h == 124_439_808
    # Qwen3-30B-A3B: attention (q, o 2048 x 4096; k, v 2048 x 512; q_norm, k_norm 128 each),
    # two norms, router 2048 x 128, 128 experts of 3 x 2048 x 768; embedding and head; final norm
    layer = 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 128 + 2 * 2048 + 2048 * 128 + 128 * 3 * 2048 * 768
    assert imported("qwen3-30b-a3b").num_params() == 48 * layer + 2 * 151936 * 2048 + 2048


@pytest.mark.parametrize(
    ("name", "preset_name", "changes"),
    [
        ("llama-3-8b", "llama3-8b", {}),
        # the preset trains Mixtral at 4,096 tokens; the config's context is 32,768
        ("mixtral-8x7b", "mixtral-8x7b", {"seq_len": 4096}),
        ("deepseek-v3", "deepseek-v3", {}),
    ],
)
def test_imported_config_is_the_preset(name, preset_name, changes):
    """Apart from its name, the imported model is the built-in preset (so the same counts)."""
    model = imported(name, **changes)
    assert dataclasses.replace(model, name=preset_name) == preset(preset_name)


def run_json(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_a_run_on_the_imported_config_matches_the_preset(capsys, tmp_path):
    """llama-3-8b/config.json and the llama3-8b preset: the same architecture, the same
    prediction, key for key (the scenario file names the folder relative to itself)."""
    scenario = tmp_path / "s.yaml"
    rel = os.path.relpath(HF / "llama-3-8b", tmp_path)
    scenario.write_text(f"model: {rel}\ntraining: {{global_batch_size: 16}}\n"
                        "cluster: {preset: dgx-h100, num_nodes: 1}\nstrategy: {name: zero, stage: 3}\n")
    got = run_json(capsys, "run", str(scenario), "--json")
    want = run_json(capsys, "run", str(scenario), "--set", "model=llama3-8b", "--json")
    got.pop("sim_wall_s"), want.pop("sim_wall_s")
    assert got == want
    assert got["num_parameters"] == got["num_active_parameters"] == 8_030_261_248


def test_run_json_reports_total_and_active_parameters(capsys):
    report = run_json(capsys, "run", "--set", f"model={HF / 'qwen3-30b-a3b'}", "--set", "model.seq_len=1024",
                      "--set", "cluster.num_nodes=1", "--set", "training.global_batch_size=8",
                      "--set", "strategy.name=zero", "--json")
    model = imported("qwen3-30b-a3b")
    assert report["num_parameters"] == model.num_params()
    assert report["num_active_parameters"] == model.num_active_params()
    assert report["num_active_parameters"] < report["num_parameters"]


def test_paths_resolve_against_the_scenario_file(tmp_path):
    folder = tmp_path / "models" / "tiny"
    folder.mkdir(parents=True)
    config = json.loads((HF / "llama-3-8b" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    (tmp_path / "s.yaml").write_text("model: models/tiny\ntraining: {global_batch_size: 8}\n"
                                     "cluster: {preset: dgx-h100, num_nodes: 1}\nstrategy: zero\n")
    assert load_scenario(tmp_path / "s.yaml").model.num_layers == 2
    # the mapping form: the config's fields with overrides next to it; a file named outright
    (tmp_path / "m.yaml").write_text("model: {preset: models/tiny/config.json, seq_len: 1024, name: mine}\n"
                                     "training: {global_batch_size: 8}\n"
                                     "cluster: {preset: dgx-h100, num_nodes: 1}\nstrategy: zero\n")
    model = load_scenario(tmp_path / "m.yaml").model
    assert (model.num_layers, model.seq_len, model.name) == (2, 1024, "mine")


def write(tmp_path: Path, **changes) -> Path:
    config = json.loads((HF / "llama-3-8b" / "config.json").read_text())
    config.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("changes", "key", "problem"),
    [
        ({"model_type": "bert"}, "model_type", "'bert' is not supported"),
        ({"model_type": None}, "model_type", "required key is missing"),
        ({"hidden_size": "4096"}, "hidden_size", "expected an integer, got '4096'"),
        ({"num_key_value_heads": 8.0}, "num_key_value_heads", "expected an integer"),
        ({"num_hidden_layers": True}, "num_hidden_layers", "expected an integer"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings", "expected true or false"),
        ({"attention_dropout": "0.1"}, "attention_dropout", "expected a number"),
        ({"rope_scaling": {"original_max_position_embeddings": "8k"}},
         "rope_scaling.original_max_position_embeddings", "expected an integer"),
        ({"vocab_size": None}, "vocab_size", "required key is missing"),
        ({"attention_bias": True}, "attention_bias", "not modelled"),
    ],
)
def test_bad_configs_exit_2_naming_the_key(capsys, tmp_path, changes, key, problem):
    path = write(tmp_path, **changes)
    capsys.readouterr()
    assert main(["run", "--set", f"model={path}", "--set", "cluster.num_nodes=1", "--set", "strategy.name=zero"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hzpsim: error: model: {path}: {key}: "), err
    assert problem in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("write_file", "problem"),
    [
        (None, "no such file"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
    ],
)
def test_missing_or_malformed_files_are_scenario_errors(tmp_path, write_file, problem):
    path = tmp_path / "config.json"
    if write_file is not None:
        path.write_text(write_file)
    msg = error_of(base(model=str(path)))
    assert msg.startswith(f"model: {path}:") and problem in msg, msg


def test_a_field_the_model_rejects_names_its_model_key(tmp_path):
    path = write(tmp_path, num_key_value_heads=5)
    assert error_of(base(model=str(path))).startswith("model.num_kv_heads:")


def test_moe_layer_placement(tmp_path):
    def moe_layers(**changes):
        config = json.loads((HF / "qwen3-30b-a3b" / "config.json").read_text())
        config.update(num_hidden_layers=8, **changes)
        (tmp_path / "config.json").write_text(json.dumps(config))
        model = from_mapping(Model, model_fields(tmp_path), "model")
        return [i for i in range(model.num_layers) if model.is_moe_layer(i)]

    # Qwen: MoE when (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
    assert moe_layers() == list(range(8))
    assert moe_layers(decoder_sparse_step=2) == [1, 3, 5, 7]
    assert moe_layers(mlp_only_layers=[0, 1]) == [2, 3, 4, 5, 6, 7]
    with pytest.raises(ScenarioError, match="mlp_only_layers: MoE layers"):
        moe_layers(mlp_only_layers=[3])
    # DeepSeek: MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0
    config = json.loads((HF / "deepseek-v3" / "config.json").read_text())
    config.update(num_hidden_layers=8, first_k_dense_replace=3, moe_layer_freq=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = from_mapping(Model, model_fields(tmp_path), "model")
    assert [i for i in range(8) if model.is_moe_layer(i)] == [4, 6]


def minimal(model_type: str, **fields) -> dict:
    common = dict(model_type=model_type, hidden_size=256, num_attention_heads=4, num_hidden_layers=2,
                  intermediate_size=512, vocab_size=1000, max_position_embeddings=128)
    return {**common, **fields}


def test_qwen2_biases_and_qwen2_moe_shared_expert_gate(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(minimal("qwen2", num_key_value_heads=2)))
    dense = from_mapping(Model, model_fields(tmp_path), "model")
    plain = dataclasses.replace(dense, qkv_bias=False)
    assert dense.num_params() - plain.num_params() == 2 * (256 + 2 * 64 * 2)  # q, k, v biases per layer
    (tmp_path / "config.json").write_text(json.dumps(minimal(
        "qwen2_moe", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=128)))
    moe = from_mapping(Model, model_fields(tmp_path), "model")
    assert moe.moe is not None and moe.moe.shared_expert_gate and moe.moe.shared_ffn_resolved == 128
    assert moe.router_params() == 256 * 5  # gate h x 4 experts + shared_expert_gate h x 1
    assert sum(k * n for k, n, _ in moe.layer_linears(0)["router"]) == moe.router_params()
    for i in range(moe.num_layers):
        dense_t, expert_t = moe.layer_tensors(i)
        assert sum(dense_t) + sum(expert_t) == moe.layer_params(i)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_every_architecture_reads_a_minimal_config_and_simulates(model_type, tmp_path):
    extra: dict = {}
    if model_type in ("mixtral",):
        extra = dict(num_local_experts=4, num_experts_per_tok=2)
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                     shared_expert_intermediate_size=128)
    elif model_type.startswith("deepseek"):
        extra = dict(kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                     n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=2,
                     first_k_dense_replace=1)
    elif model_type == "gpt2":
        extra = dict(n_embd=256, n_head=4, n_layer=2, n_positions=128)
    (tmp_path / "config.json").write_text(json.dumps(minimal(model_type, **extra)))
    scenario = scenario_from_mapping({**BASE, "model": str(tmp_path)})
    model = scenario.model
    assert model.num_layers == 2 and model.hidden_size == 256 and model.seq_len == 128
    for i in range(model.num_layers):
        dense_t, expert_t = model.layer_tensors(i)
        assert sum(dense_t) + sum(expert_t) == model.layer_params(i)
    if model_type.startswith("deepseek"):
        assert model.moe is not None and model.moe.shared_ffn_resolved == 128 and model.mla.q_lora_rank is None
        assert [model.is_moe_layer(i) for i in range(2)] == [False, True]
    # same input, same output
    assert scenario_from_mapping({**BASE, "model": str(tmp_path)}).model == model


def test_a_learned_position_table_keeps_its_rows_when_seq_len_changes():
    """GPT-2's wpe has n_positions rows whatever sequence length a run trains at."""
    full = imported("gpt2")
    assert imported("gpt2", seq_len=512).num_params() == full.num_params()
    msg = error_of(base(model={"preset": str(HF / "gpt2"), "seq_len": 2048}))
    assert msg.startswith("model.max_position_embeddings: 1024 is shorter than seq_len (2048)"), msg
