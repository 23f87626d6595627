"""``--set KEY.PATH=VALUE`` overrides (DESIGN §5): nested fields, sections and keys created,
presets promoted or replaced, ``strategies`` entries, malformed paths and YAML scalar values."""

from __future__ import annotations

import pytest
from scenario_helpers import base, error_of, load

from hzpsim.config import ScenarioError
from hzpsim.scenario import parse_override


def test_set_nested_field():
    sc = load(base(), "cluster.num_nodes=2", "training.global_batch_size=32")
    assert sc.cluster.num_nodes == 2
    assert sc.training.global_batch_size == 32


def test_set_creates_missing_sections_and_keys():
    data = base()
    del data["training"]
    sc = load(data, "training.micro_batch_size=2", "training.global_batch_size=16")
    assert sc.training.micro_batch_size == 2
    assert sc.training.global_batch_size == 16
    data = base(model={"preset": "tiny-dense"})
    sc = load(
        data, "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_hidden_size=64"
    )
    assert sc.model.moe is not None and sc.model.moe.num_experts == 4


def test_set_promotes_a_preset_string():
    sc = load(base(model="llama2-70b"), "model.num_layers=2")
    assert sc.model.num_layers == 2
    assert sc.model.hidden_size == 8192  # rest of llama2-70b kept
    sc = load(base(cluster="dgx-h100"), "cluster.num_nodes=2", "training.global_batch_size=16")
    assert sc.cluster.num_nodes == 2 and sc.cluster.device == "h100-sxm"
    sc = load(base(strategy="zero"), "strategy.stage=1")
    assert sc.strategies[0].config.stage == 1


def test_set_replaces_a_whole_section_with_a_preset():
    sc = load(base(model={"preset": "llama2-70b", "num_layers": 2}), "model=tiny-dense")
    assert sc.model.name == "tiny-dense" and sc.model.num_layers == 4


def test_set_on_strategies_list_entry():
    data = {k: v for k, v in base().items() if k != "strategy"}
    data["strategies"] = [{"name": "zero", "stage": 1}, "zero"]
    sc = load(data, "strategies.0.stage=2", "strategies.1.stage=1")
    assert [c.config.stage for c in sc.strategies] == [2, 1]


def test_set_strategy_on_strategies_list_is_an_error():
    data = {k: v for k, v in base().items() if k != "strategy"}
    data["strategies"] = [{"name": "zero", "stage": 1}]
    msg = error_of(data, "strategy.stage=2")
    assert "strategies" in msg and "strategy.stage" in msg


@pytest.mark.parametrize(
    "text, where",
    [
        ("strategies.7.stage=2", "strategies.7"),
        ("strategies.x.stage=2", "strategies.x"),
        ("training.global_batch_size.x=2", "training.global_batch_size"),
    ],
)
def test_set_bad_paths_name_the_path(text: str, where: str):
    data = {k: v for k, v in base().items() if k != "strategy"}
    data["strategies"] = [{"name": "zero", "stage": 1}]
    msg = error_of(data, text)
    assert where in msg


@pytest.mark.parametrize("text", ["nokey", "=3", "a..b=1", ".a=1"])
def test_set_malformed(text: str):
    with pytest.raises(ScenarioError) as info:
        parse_override(text)
    assert "--set" in str(info.value)


def test_set_values_are_yaml_scalars():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
    assert parse_override("a=x=y") == (["a"], "x=y")
    # a date-like value PyYAML cannot construct stays a string (then fails as a number)
    assert parse_override("a=2020-13-45") == (["a"], "2020-13-45")
    msg = error_of(base(), "model.num_layers=2020-13-45")
    assert msg.startswith("model.num_layers:")
