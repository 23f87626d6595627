"""Scenario field values (DESIGN §5): numbers written with exponents, booleans and literals
coerced by the field's type; the documented defaults; typed, frozen objects and an input the
loader leaves untouched."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import yaml
from scenario_helpers import base, load

from hzpsim.scenario import load_scenario


def test_exponent_numbers_accepted_and_coerced_by_type():
    sc = load(
        base(
            model={"preset": "tiny-dense", "vocab_size": "1e3", "num_layers": 2.0},
            training={"global_batch_size": "8e0", "micro_batch_size": "1"},
            cluster={"preset": "dgx-h100", "num_nodes": "1", "intra_node_bytes_per_s": "450e9"},
            strategy={"name": "zero", "stage": "3", "prefetch_depth": "2e0"},
        )
    )
    assert sc.model.vocab_size == 1000 and type(sc.model.vocab_size) is int
    assert sc.model.num_layers == 2 and type(sc.model.num_layers) is int
    assert sc.training.global_batch_size == 8 and type(sc.training.global_batch_size) is int
    assert sc.cluster.intra_node_bytes_per_s == 450e9
    assert type(sc.cluster.intra_node_bytes_per_s) is float
    assert sc.strategies[0].config.stage == 3 and type(sc.strategies[0].config.stage) is int
    assert sc.strategies[0].config.prefetch_depth == 2


def test_exponent_numbers_from_yaml_file(tmp_path: Path):
    """PyYAML reads ``450e9`` (no dot) as a string: the loader must coerce it."""
    path = tmp_path / "s.yaml"
    path.write_text(
        "model: {preset: tiny-dense, vocab_size: 2e3}\n"
        "training: {global_batch_size: 8}\n"
        "cluster: {preset: dgx-h100, num_nodes: 1, intra_node_bytes_per_s: 450e9,"
        " inter_node_bytes_per_s_per_device: 50e9}\n"
        "strategy: {name: zero, stage: 3}\n"
    )
    assert yaml.safe_load(path.read_text())["cluster"]["intra_node_bytes_per_s"] == "450e9"
    sc = load_scenario(path)
    assert sc.model.vocab_size == 2000
    assert sc.cluster.intra_node_bytes_per_s == 450e9
    assert sc.cluster.inter_node_bytes_per_s_per_device == 50e9


def test_bool_and_literal_coercion():
    sc = load(
        base(strategy={"name": "zero", "reshard_after_forward": "false"}), "training.precision=FP16"
    )
    assert sc.strategies[0].config.reshard_after_forward is False
    assert sc.training.precision == "fp16"


# --------------------------------------------------------------------------- defaults, typed


def test_training_defaults_per_design():
    data = base()
    del data["training"]
    data["cluster"] = {"preset": "dgx-h100", "num_nodes": 16}  # 128 devices divide 1024
    t = load(data).training
    assert t.global_batch_size == 1024
    assert t.micro_batch_size == 1
    assert t.precision == "bf16"
    assert t.grad_dtype == "fp32"
    assert t.activation_recompute == "none"
    # a null section also means the defaults
    assert load({**data, "training": None}).training == t


def test_model_defaults_per_design():
    m = load(base()).model
    assert m.mlp == "swiglu"
    assert m.tied_embeddings is False
    assert m.moe is None
    assert m.head_dim is None and m.head_dim_resolved == m.hidden_size // m.num_heads


def test_objects_are_typed_and_frozen():
    sc = load(base())
    for obj, field in (
        (sc, "model"),
        (sc.model, "num_layers"),
        (sc.training, "global_batch_size"),
        (sc.cluster, "num_nodes"),
        (sc.strategies[0].config, "stage"),
        (sc.strategies[0], "name"),
    ):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, 1)


def test_loader_does_not_mutate_its_input():
    data = base(model="llama2-70b")
    snapshot = copy.deepcopy(data)
    load(data, "model.num_layers=2", "cluster.num_nodes=1")
    assert data == snapshot
