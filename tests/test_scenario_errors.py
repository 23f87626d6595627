"""Bad scenarios are ScenarioErrors of one line naming the key path: unknown keys, wrong types,
impossible values, unknown names, missing or conflicting sections, non-mapping documents and
unreadable files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from scenario_helpers import BASE, base, error_of, load

from hzpsim.config import ScenarioError
from hzpsim.scenario import load_scenario


@pytest.mark.parametrize(
    "data, path",
    [
        (base(model={"preset": "tiny-dense", "foo": 1}), "model.foo"),
        (base(cluster={"preset": "dgx-h100", "nodes": 2}), "cluster.nodes"),
        (base(strategy={"name": "zero", "stagee": 2}), "strategy.stagee"),
        (base(training={"global_batch_size": 8, "x": 1}), "training.x"),
        (base(bogus=1), "bogus"),
        (
            base(
                model={
                    "preset": "tiny-dense",
                    "moe": {"num_experts": 4, "top_k": 1, "expert_ffn_hidden_size": 8, "k": 1},
                }
            ),
            "model.moe.k",
        ),
    ],
)
def test_unknown_keys_name_the_path(data: dict[str, Any], path: str):
    msg = error_of(data)
    assert msg.startswith(path + ":"), msg
    assert "unknown key" in msg


def test_unknown_key_in_strategies_list_names_the_entry():
    data = {k: v for k, v in base().items() if k != "strategy"}
    data["strategies"] = [{"name": "zero"}, {"name": "zero", "stagee": 1}]
    assert error_of(data).startswith("strategies[1].stagee:")


@pytest.mark.parametrize(
    "data, path",
    [
        (base(model={"preset": "tiny-dense", "num_layers": "four"}), "model.num_layers"),
        (base(model={"preset": "tiny-dense", "num_layers": 2.5}), "model.num_layers"),
        (base(model={"preset": "tiny-dense", "num_layers": True}), "model.num_layers"),
        (base(model={"preset": "tiny-dense", "num_layers": [4]}), "model.num_layers"),
        (base(model={"preset": "tiny-dense", "tied_embeddings": "maybe"}), "model.tied_embeddings"),
        (base(model={"preset": "tiny-dense", "mlp": "relu"}), "model.mlp"),
        (base(model={"preset": "tiny-dense", "moe": 3}), "model.moe"),
        (base(training={"global_batch_size": 8, "precision": "fp4"}), "training.precision"),
        (base(training={"global_batch_size": 8, "grad_dtype": "fp16"}), "training.grad_dtype"),
        (
            base(training={"global_batch_size": 8, "activation_recompute": "some"}),
            "training.activation_recompute",
        ),
        (base(training=[8]), "training"),
        (base(training=0), "training"),
        (base(cluster={"preset": "dgx-h100", "num_nodes": "many"}), "cluster.num_nodes"),
        (
            base(cluster={"preset": "dgx-h100", "intra_node_bytes_per_s": "fast"}),
            "cluster.intra_node_bytes_per_s",
        ),
        (
            base(cluster={"preset": "dgx-h100", "intra_node_bytes_per_s": "inf"}),
            "cluster.intra_node_bytes_per_s",
        ),
        (base(cluster=5), "cluster"),
        (base(model=[1, 2]), "model"),
        (base(strategy={"name": "zero", "stage": 4}), "strategy.stage"),
        (base(strategy={"name": "zero", "stage": "three"}), "strategy.stage"),
        (base(strategy=7), "strategy"),
        (base(name=["x"]), "name"),
        (base(model={"preset": "tiny-dense", "num_layers": 10**400}), "model.num_layers"),
        (base(training={"global_batch_size": "1e400"}), "training.global_batch_size"),
    ],
)
def test_wrong_types_name_the_path(data: dict[str, Any], path: str):
    msg = error_of(data)
    assert msg.startswith(path + ":") or msg.startswith(path + "."), msg


@pytest.mark.parametrize(
    "data, path",
    [
        (base(model={"preset": "tiny-dense", "num_layers": 0}), "model.num_layers"),
        (base(model={"preset": "tiny-dense", "hidden_size": -256}), "model.hidden_size"),
        (base(model={"preset": "tiny-dense", "num_kv_heads": 3}), "model.num_kv_heads"),  # 4 % 3
        (base(training={"global_batch_size": 0}), "training.global_batch_size"),
        (
            base(training={"global_batch_size": 8, "micro_batch_size": -1}),
            "training.micro_batch_size",
        ),
        (
            base(training={"global_batch_size": 9, "micro_batch_size": 2}),
            "training.global_batch_size",
        ),
        # divisible by micro batch but not by micro batch x data-parallel size (8 devices)
        (
            base(training={"global_batch_size": 12, "micro_batch_size": 2}),
            "training.global_batch_size",
        ),
        (base(training={"global_batch_size": 4}), "training.global_batch_size"),
        (base(cluster={"preset": "dgx-h100", "num_nodes": 0}), "cluster.num_nodes"),
        (base(cluster={"preset": "dgx-h100", "gpus_per_node": -8}), "cluster.gpus_per_node"),
        (
            base(cluster={"preset": "dgx-h100", "intra_node_bytes_per_s": -1}),
            "cluster.intra_node_bytes_per_s",
        ),
        (
            base(cluster={"preset": "dgx-h100", "gpus_per_node": 6, "islands_per_node": 4}),
            "cluster.gpus_per_node",
        ),
        (base(strategy={"name": "zero", "prefetch_depth": -1}), "strategy.prefetch_depth"),
    ],
)
def test_impossible_values_name_the_path(data: dict[str, Any], path: str):
    msg = error_of(data)
    assert msg.startswith(path + ":"), msg


def test_global_batch_split_message_mentions_data_parallel():
    msg = error_of(base(training={"global_batch_size": 12, "micro_batch_size": 2}))
    assert "12" in msg and "8" in msg


@pytest.mark.parametrize(
    "data, path, name",
    [
        (base(model="gpt-17"), "model", "gpt-17"),
        (base(model={"preset": "nope"}), "model.preset", "nope"),
        (base(cluster="dgx-z9000"), "cluster.preset", "dgx-z9000"),
        (base(cluster={"device": "tpu-v9", "num_nodes": 1}), "cluster.device", "tpu-v9"),
        (base(strategy={"name": "warp-drive"}), "strategy.name", "warp-drive"),
        (base(strategy={"stage": 3}), "strategy.name", ""),
    ],
)
def test_unknown_names_are_scenario_errors(data: dict[str, Any], path: str, name: str):
    msg = error_of(data)
    assert msg.startswith(path), msg
    assert name in msg


def test_strategies_entry_with_unknown_name_names_the_entry():
    data = {k: v for k, v in base().items() if k != "strategy"}
    data["strategies"] = ["zero", {"name": "nd2"}]
    assert error_of(data).startswith("strategies[1].name")


@pytest.mark.parametrize(
    "data, start",
    [
        ({k: v for k, v in BASE.items() if k != "model"}, "model"),
        ({k: v for k, v in BASE.items() if k != "cluster"}, "cluster"),
        ({k: v for k, v in BASE.items() if k != "strategy"}, "strategy"),
        (base(strategies=["zero"]), "strategy"),  # both given
        ({**{k: v for k, v in BASE.items() if k != "strategy"}, "strategies": []}, "strategies"),
        (
            {**{k: v for k, v in BASE.items() if k != "strategy"}, "strategies": "zero"},
            "strategies",
        ),
        (base(model={"preset": "tiny-dense", "moe": {"num_experts": 4}}), "model.moe.top_k"),
        (base(cluster={"num_nodes": 1}), "cluster.device"),
    ],
)
def test_missing_or_conflicting_sections(data: dict[str, Any], start: str):
    assert error_of(data).startswith(start)


@pytest.mark.parametrize("doc", [[1, 2], "text", 5, 0, False, ""])
def test_non_mapping_document(doc: Any):
    with pytest.raises(ScenarioError, match="mapping"):
        load(doc)


@pytest.mark.parametrize(
    "content",
    [
        "[1, 2]\n",
        "0\n",
        "false\n",
        "model: [unclosed\n",
        "model: tiny-dense\ntraining: {global_batch_size: 2020-13-45}\n",  # PyYAML ValueError
        "a: 1\n---\nb: 2\n",
        "[" * 3000,
    ],
)
def test_bad_files_are_scenario_errors(tmp_path: Path, content: str):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert "\n" not in str(info.value)


def test_non_utf8_file_is_a_scenario_error(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"model: \xff\xfe\n")
    with pytest.raises(ScenarioError, match="bad.yaml"):
        load_scenario(path)


def test_missing_file_is_a_scenario_error(tmp_path: Path):
    with pytest.raises(ScenarioError, match="no such scenario file"):
        load_scenario(tmp_path / "absent.yaml")


def test_error_messages_are_one_line_even_for_odd_keys():
    msg = error_of(base(model={"preset": "tiny-dense", "a\nb": 1}))
    assert "\n" not in msg and msg.startswith("model.a")
    msg = error_of(base(model="x\ny"))
    assert len(msg.splitlines()) == 1
