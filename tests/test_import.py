"""``hzpsim import megatron|torchtitan|deepspeed``: the printed YAML loads and runs, SC'21's
GPT-3 175B launch reproduces the hand-written example exactly, and bad inputs exit 2 naming the
field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hzpsim.cli import main
from hzpsim.run import choose
from hzpsim.scenario import load_scenario, scenario_from_mapping

REPO = Path(__file__).resolve().parents[1]
SC21 = REPO / "examples" / "import" / "sc21-gpt3-175b.sh"
DATA = REPO / "tests" / "data" / "import"

def imported(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["import", *argv]) == 0
    return capsys.readouterr().out


def report(scenario, index: int = 0) -> dict:
    out, _ = choose(scenario, scenario.strategies[index])
    out = json.loads(json.dumps(out))
    for key in ("sim_wall_s", "num_events"):
        out.pop(key, None)
    return out


def error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["import", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hzpsim: error:") and "Traceback" not in err
    return err


@pytest.mark.parametrize("interleaved", [False, True])
def test_sc21_gpt3_175b_matches_the_hand_written_example(capsys, tmp_path, interleaved):
    script = SC21
    if interleaved:  # run_figure_12.sh's INTERLEAVED=YES: 2 layers per virtual stage = 3 chunks
        script = tmp_path / "sc21-interleaved.sh"
        script.write_text(SC21.read_text().replace(
            'MEGATRON_EXTRA_PARAMS="--activations-checkpoint-method uniform "',
            'MEGATRON_EXTRA_PARAMS="--activations-checkpoint-method uniform --num-layers-per-virtual-pipeline-stage 2 "'))
    out = imported(capsys, "megatron", str(script), "--preset", "dgx-a100")
    assert out.startswith("# hzpsim import megatron") and "megatron-2021" in out.splitlines()[2]
    data = yaml.safe_load(out)
    assert data["strategy"] == {"name": "nd", "implementation": "megatron-2021", "tp": 8, "pp": 16,
                                **({"vpp": 3} if interleaved else {}),
                                "overlap_grad_reduce": False, "overlap_param_gather": False}
    assert data["cluster"] == {"preset": "dgx-a100", "num_nodes": 128}
    assert data["training"] == {"global_batch_size": 1536, "micro_batch_size": 1, "precision": "fp16", "grad_dtype": "bf16",
                                "activation_recompute": "full", "flash_attention": False, "fused_kernels": True}
    assert (data["model"]["vocab_size"], data["model"]["ffn_hidden_size"], data["model"]["num_layers"]) == (51200, 49152, 96)
    imported_run = report(scenario_from_mapping(data))
    example = report(load_scenario(REPO / "examples" / "gpt3-175b-megatron.yaml"), 1 if interleaved else 0)
    assert imported_run == example  # every key of the report but the wall-clock ones


def test_import_is_deterministic(capsys):
    a = imported(capsys, "megatron", str(SC21), "--preset", "dgx-a100")
    b = imported(capsys, "megatron", str(SC21), "--preset", "dgx-a100")
    assert a == b


def test_torchtitan_llama3_8b_imports_and_runs(capsys):
    out = imported(capsys, "torchtitan", str(DATA / "llama3_8b.toml"), "--nodes", "8", "--preset", "dgx-a100")
    data = yaml.safe_load(out)
    assert data["strategy"] == {"name": "zero", "stage": 3, "implementation": "torchtitan"}
    assert data["model"]["ffn_hidden_size"] == 14336 and data["model"]["vocab_size"] == 128256
    assert data["training"] == {"global_batch_size": 64, "micro_batch_size": 1, "precision": "bf16",
                                "activation_recompute": "op"}
    assert "[training] mixed_precision_param: 'bfloat16'" in out
    assert report(scenario_from_mapping(data))["step_time_s"] > 0


def test_torchtitan_nd_layout(capsys, tmp_path):
    toml = tmp_path / "nd.toml"
    toml.write_text((DATA / "llama3_8b.toml").read_text().replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 4")
                    .replace("pipeline_parallel_degree = 1", "pipeline_parallel_degree = 2"))
    data = yaml.safe_load(imported(capsys, "torchtitan", str(toml), "--nodes", "2"))
    assert data["strategy"]["name"] == "nd" and data["strategy"]["implementation"] == "torchtitan"
    assert (data["strategy"]["tp"], data["strategy"]["pp"], data["strategy"]["zero_stage"]) == (4, 2, 3)
    scenario_from_mapping(data)


def test_deepspeed_zero3_with_hf_model_imports_and_runs(capsys):
    out = imported(capsys, "deepspeed", str(DATA / "ds_zero3.json"), "--model", str(REPO / "examples/hf/llama-3-8b"),
                   "--nodes", "2", "--recompute", "full")
    data = yaml.safe_load(out)
    assert data["strategy"] == {"name": "zero", "stage": 3, "implementation": "deepspeed"}
    assert data["training"]["global_batch_size"] == 256 and data["training"]["micro_batch_size"] == 2
    assert "gradient_accumulation_steps: 8" in out
    assert report(scenario_from_mapping(data))["fits_in_memory"]


def test_deepspeed_zeropp_and_mics(capsys, tmp_path):
    cfg = json.loads((DATA / "ds_zero3.json").read_text())
    cfg["zero_optimization"]["zero_hpz_partition_size"] = 8
    (tmp_path / "pp.json").write_text(json.dumps(cfg))
    data = yaml.safe_load(imported(capsys, "deepspeed", str(tmp_path / "pp.json"), "--model", "llama3-8b", "--nodes", "2"))
    assert data["strategy"]["name"] == "zeropp" and data["strategy"]["hpz_partition_size"] == 8
    del cfg["zero_optimization"]["zero_hpz_partition_size"]
    cfg["zero_optimization"]["mics_shard_size"] = 8
    (tmp_path / "mics.json").write_text(json.dumps(cfg))
    data = yaml.safe_load(imported(capsys, "deepspeed", str(tmp_path / "mics.json"), "--model", "llama3-8b", "--nodes", "2"))
    assert data["strategy"] == {"name": "mics", "partition_size": 8, "implementation": "deepspeed"}


def test_bad_megatron_value_type(capsys, tmp_path):
    f = tmp_path / "args.txt"
    f.write_text(SC21.read_text().replace("--micro-batch-size ${MBS}", "--micro-batch-size one"))
    assert "--micro-batch-size: expected int, got 'one'" in error(capsys, "megatron", str(f), "--preset", "dgx-a100")


def test_unresolvable_shell_variable(capsys, tmp_path):
    f = tmp_path / "run.sh"
    f.write_text("if [ $X ]; then\n  TP=8\nfi\ntorchrun --nnodes 1 --nproc_per_node 8 pretrain_gpt.py "
                 "--tensor-model-parallel-size $TP --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                 "--seq-length 128 --micro-batch-size 1\n")
    err = error(capsys, "megatron", str(f))
    assert "$" in err and "TP" in err and "if/case/loop" in err
    f.write_text("torchrun --nnodes $NNODES --nproc_per_node 8 pretrain_gpt.py --num-layers 2\n")
    assert "NNODES" in error(capsys, "megatron", str(f))


def test_unknown_megatron_argument(capsys, tmp_path):
    f = tmp_path / "args.txt"
    f.write_text("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 1 "
                 "--frobnicate 3\n")
    assert "--frobnicate" in error(capsys, "megatron", str(f), "--nodes", "1")
    data = yaml.safe_load(imported(capsys, "megatron", str(f), "--nodes", "1", "--lenient"))
    assert data["strategy"]["implementation"] == "megatron-core"


def test_tp_not_dividing_the_gpus(capsys, tmp_path):
    f = tmp_path / "run.sh"
    f.write_text("TP=8\nPP=3\ntorchrun --nnodes=2 --nproc_per_node=8 pretrain_gpt.py --tensor-model-parallel-size ${TP} "
                 "--pipeline-model-parallel-size $PP --num-layers 6 --hidden-size 64 --num-attention-heads 4 "
                 "--seq-length 128 --micro-batch-size 1\n")
    assert "--tensor-model-parallel-size 8 x --pipeline-model-parallel-size 3" in error(capsys, "megatron", str(f))


def test_bare_argument_list_needs_nodes(capsys, tmp_path):
    f = tmp_path / "args.txt"
    f.write_text("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 1\n")
    assert "--nodes" in error(capsys, "megatron", str(f))


def test_deepspeed_offload_refused(capsys, tmp_path):
    cfg = json.loads((DATA / "ds_zero3.json").read_text())
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    (tmp_path / "off.json").write_text(json.dumps(cfg))
    err = error(capsys, "deepspeed", str(tmp_path / "off.json"), "--model", "llama3-8b", "--nodes", "2")
    assert "zero_optimization.offload_optimizer" in err


def test_deepspeed_unmodelled_bucket_and_auto(capsys, tmp_path):
    cfg = json.loads((DATA / "ds_zero3.json").read_text())
    cfg["zero_optimization"]["reduce_bucket_size"] = 2e8
    (tmp_path / "b.json").write_text(json.dumps(cfg))
    assert "reduce_bucket_size" in error(capsys, "deepspeed", str(tmp_path / "b.json"), "--model", "llama3-8b", "--nodes", "2")
    cfg = json.loads((DATA / "ds_zero3.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = "auto"
    (tmp_path / "a.json").write_text(json.dumps(cfg))
    assert "train_micro_batch_size_per_gpu" in error(capsys, "deepspeed", str(tmp_path / "a.json"), "--model",
                                                     "llama3-8b", "--nodes", "2")


def test_torchtitan_layout_not_dividing(capsys, tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text((DATA / "llama3_8b.toml").read_text().replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 3"))
    assert "tensor 3" in error(capsys, "torchtitan", str(toml), "--nodes", "1")
    toml.write_text((DATA / "llama3_8b.toml").read_text().replace("local_batch_size = 1", 'local_batch_size = "one"'))
    assert "local_batch_size: expected int" in error(capsys, "torchtitan", str(toml), "--nodes", "1")


MIXTRAL_ARGS = """--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention
--num-query-groups 8 --ffn-hidden-size 14336 --seq-length 4096 --max-position-embeddings 32768 --vocab-size 32000
--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
--disable-bias-linear --num-experts 8 --moe-router-topk 2 --micro-batch-size 1 --global-batch-size 256 --bf16
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
--use-distributed-optimizer {moe}"""


@pytest.mark.parametrize("flags, expected", [
    ("", {}),
    # Megatron-Core's combined 1F1B needs an interleaved pipeline when pipelined
    ("--moe-token-dispatcher-type alltoall --moe-grouped-gemm --overlap-moe-expert-parallel-comm --moe-permute-fusion "
     "--virtual-pipeline-model-parallel-size 2",
     {"moe_dispatcher": "alltoall", "moe_grouped_gemm": True, "moe_ep_overlap": True, "moe_permute_fusion": True}),
    ("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep --moe-expert-capacity-factor 1.25",
     {"moe_dispatcher": "deepep", "moe_capacity_factor": 1.25}),
])
def test_megatron_moe_flags_import_as_the_moe_settings(capsys, tmp_path, flags, expected):
    path = tmp_path / "args.txt"
    path.write_text(MIXTRAL_ARGS.format(moe=flags))
    text = imported(capsys, "megatron", str(path), "--nodes", "8")
    strategy = yaml.safe_load(text)["strategy"]
    assert {k: strategy[k] for k in expected} == expected
    assert not any(k.startswith("moe_") for k in strategy if k not in expected)
    resolved = report(load_scenario_text(text, tmp_path))["strategy_resolved"]
    # unset, Megatron-Core's own defaults (docs/moe.md): the allgather dispatcher, SequentialMLP,
    # the eager permutation
    assert resolved["moe_dispatcher"] == expected.get("moe_dispatcher", "allgather")
    assert resolved["moe_grouped_gemm"] == expected.get("moe_grouped_gemm", False)
    assert resolved["moe_permute_fusion"] == expected.get("moe_permute_fusion", False)


def load_scenario_text(text: str, tmp_path: Path):
    path = tmp_path / "imported.yaml"
    path.write_text(text)
    return load_scenario(str(path))


@pytest.mark.parametrize("flags, expected", [
    ("--recompute-granularity selective", {"activation_recompute": "selective"}),
    ("--recompute-granularity selective --recompute-modules layernorm moe_act --moe-grouped-gemm",
     {"activation_recompute": "selective", "recompute_modules": ["layernorm", "moe_act"]}),
    ("--recompute-modules moe --recompute-granularity selective",
     {"activation_recompute": "selective", "recompute_modules": ["moe"]}),
])
def test_megatron_recompute_modules_import_as_the_module_list(capsys, tmp_path, flags, expected):
    """``--recompute-modules`` takes several words (nargs='*'); the list lands in
    training.recompute_modules and the run resolves an unset list to the default core_attn."""
    path = tmp_path / "args.txt"
    path.write_text(MIXTRAL_ARGS.format(moe=flags))
    text = imported(capsys, "megatron", str(path), "--nodes", "8")
    training = yaml.safe_load(text)["training"]
    assert {k: training.get(k) for k in expected} == expected
    assert ("recompute_modules" in training) == ("recompute_modules" in expected)
    resolved = report(load_scenario_text(text, tmp_path))["training_resolved"]
    assert resolved["recompute_modules"] == expected.get("recompute_modules", ["core_attn"])


@pytest.mark.parametrize("flags, recipe, preset", [
    ("--fp8-format hybrid", "delayed", "dgx-h100"),  # unset: Megatron-Core's TransformerConfig default
    ("--fp8-format hybrid --fp8-recipe tensorwise", "tensorwise", "dgx-h100"),
    ("--fp8-format e4m3 --fp8-recipe mxfp8", "mxfp8", "dgx-b200"),  # MXFP8 needs Blackwell
])
def test_megatron_fp8_recipe_imports(capsys, tmp_path, flags, recipe, preset):
    path = tmp_path / "args.txt"
    path.write_text(MIXTRAL_ARGS.format(moe="").replace("--bf16", flags))
    text = imported(capsys, "megatron", str(path), "--nodes", "8", "--preset", preset)
    training = yaml.safe_load(text)["training"]
    assert training["precision"] == "fp8"
    assert training.get("fp8_recipe", "delayed") == recipe
    assert report(load_scenario_text(text, tmp_path))["training_resolved"]["fp8_recipe"] == recipe


@pytest.mark.parametrize("flags, needle", [
    ("--fp8-format hybrid --fp8-recipe custom", "--fp8-recipe"),
    ("--bf16 --fp8-recipe tensorwise", "--fp8-recipe"),
    ("--fp8-format e4m3 --fp8-recipe mxfp8", "fp8_recipe: mxfp8 needs"),  # on the default H100
])
def test_megatron_fp8_recipe_refused(capsys, tmp_path, flags, needle):
    path = tmp_path / "args.txt"
    path.write_text(MIXTRAL_ARGS.format(moe="").replace("--bf16", flags))
    assert needle in error(capsys, "megatron", str(path), "--nodes", "8")
