"""Scenario loading against DESIGN §5: model and cluster presets (by name, as a mapping, with
overrides, from the device alone), presets read once per load, the ``strategy`` /
``strategies`` forms, a scenario file and the built-in default."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from scenario_helpers import BASE, base, error_of, load

from hzpsim import presets
from hzpsim.hardware.topology import ClusterSpec, ResolvedCluster
from hzpsim.scenario import load_scenario


def spy(monkeypatch, owner: Any, name: str) -> list[Any]:
    """Calls of ``owner.name`` from now on, each by its first argument (``self`` for a method)."""
    calls: list[Any] = []
    real = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def test_model_preset_by_name():
    sc = load(base(model="llama2-70b"))
    m = sc.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads) == (80, 8192, 64, 8)
    assert (m.ffn_hidden_size, m.vocab_size, m.seq_len) == (28672, 32000, 4096)
    assert m.name == "llama2-70b"


def test_model_mapping_starts_from_preset_and_overrides():
    sc = load(base(model={"preset": "llama2-70b", "num_layers": 2, "seq_len": 1024}))
    assert sc.model.num_layers == 2
    assert sc.model.seq_len == 1024
    assert sc.model.hidden_size == 8192  # untouched fields come from the preset


def test_model_as_full_mapping_without_preset():
    sc = load(
        base(
            model={
                "num_layers": 2,
                "hidden_size": 64,
                "num_heads": 4,
                "ffn_hidden_size": 128,
                "vocab_size": 100,
                "seq_len": 32,
            }
        )
    )
    assert sc.model.num_layers == 2
    assert sc.model.num_kv_heads is None and sc.model.kv_heads == 4  # MHA default
    assert sc.model.head_dim_resolved == 16  # hidden_size / num_heads


def test_cluster_preset_by_name_and_as_mapping():
    by_name = load(base(cluster="dgx-h100"))
    assert by_name.cluster.device == "h100-sxm"
    assert by_name.cluster.num_nodes == 1
    assert by_name.cluster.gpus_per_node == 8
    sc = load(
        base(cluster={"preset": "dgx-a100", "num_nodes": 2}, training={"global_batch_size": 16})
    )
    assert sc.cluster.device == "a100-80gb"
    assert sc.topology.num_devices == 16
    assert sc.cluster.inter_node_bytes_per_s_per_device == pytest.approx(25e9)


def test_cluster_from_device_only_gets_device_fabric():
    """DESIGN §5: only device/num_nodes/gpus_per_node -> the device's usual node fabric."""
    sc = load(
        base(
            cluster={"device": "npu-910b", "num_nodes": 2, "gpus_per_node": 16},
            training={"global_batch_size": 32},
        )
    )
    assert sc.cluster.preset == "hzp-npu"
    assert sc.cluster.islands_per_node == 2
    assert sc.cluster.intra_node_bytes_per_s == pytest.approx(400e9)
    assert sc.cluster.inter_node_bytes_per_s_per_device == pytest.approx(25e9)
    # the inter-island path is unpublished: conservatively the NIC path
    assert sc.cluster.inter_island_bytes_per_s == pytest.approx(25e9)
    assert sc.topology.num_devices == 32

    a100 = load(base(cluster={"device": "a100-80gb", "num_nodes": 1, "gpus_per_node": 8}))
    assert a100.cluster.preset == "dgx-a100"
    assert a100.cluster.intra_node_bytes_per_s == pytest.approx(300e9)  # NVLink3
    assert a100.cluster.inter_node_bytes_per_s_per_device == pytest.approx(25e9)  # HDR 200 Gb/s
    h100 = load(base(cluster={"device": "h100-sxm", "num_nodes": 1, "gpus_per_node": 8}))
    assert h100.cluster.intra_node_bytes_per_s == pytest.approx(450e9)  # NVLink4
    assert h100.cluster.inter_node_bytes_per_s_per_device == pytest.approx(50e9)  # NDR 400 Gb/s


def test_cluster_overrides_win_over_preset():
    sc = load(
        base(
            cluster={
                "preset": "dgx-h100",
                "num_nodes": 1,
                "intra_node_bytes_per_s": "123e9",
                "inter_node_bytes_per_s_per_device": 7e9,
            }
        )
    )
    assert sc.cluster.intra_node_bytes_per_s == pytest.approx(123e9)
    assert sc.cluster.inter_node_bytes_per_s_per_device == pytest.approx(7e9)
    assert sc.cluster.intra_node_latency_s == pytest.approx(3.4e-6)  # still from the preset


def test_cluster_is_resolved_at_load():
    """The scenario holds the cluster with every field concrete (the preset applied once)."""
    sc = load(base(cluster={"device": "npu-910b", "num_nodes": 2}, training={"global_batch_size": 32}))
    assert isinstance(sc.cluster, ResolvedCluster)
    assert all(getattr(sc.cluster, f.name) is not None for f in dataclasses.fields(ResolvedCluster)
               if f.name != "price_per_device_hour")  # only a user can say what a device-hour costs
    assert sc.cluster.device_memory_bytes == 64e9  # the catalog's when not overridden
    assert sc.topology.spec is sc.cluster


def test_one_load_reads_presets_and_validates_a_fixed_number_of_times(monkeypatch, tmp_path):
    """Per load of the default scenario: every preset folder is globbed once, every preset
    file read once (the model's and the cluster's), ``ClusterSpec.validate`` runs twice (the
    scenario's ``cluster`` mapping and the preset file it starts from)."""
    (tmp_path / "topologies").mkdir()  # a user preset folder too: globbed once as well
    monkeypatch.setenv("HZPSIM_CONFIG_DIR", str(tmp_path))
    globbed = spy(monkeypatch, Path, "glob")  # the folders
    read = spy(monkeypatch, presets, "read_yaml")  # the files
    validated = spy(monkeypatch, ClusterSpec, "validate")  # the specs
    for _ in range(2):  # each load looks at the folders afresh, and only once
        for seen in (globbed, read, validated):
            seen.clear()
        assert load_scenario(None).topology.num_devices == 64
        assert sorted(globbed) == sorted(presets.preset_dirs("topologies"))
        assert [p.parent.name for p in read] == ["workloads", "topologies"]
        assert [v.preset for v in validated] == ["dgx-h100", "dgx-h100"]


def test_a_preset_added_between_loads_is_found(monkeypatch, tmp_path):
    monkeypatch.setenv("HZPSIM_CONFIG_DIR", str(tmp_path))
    scenario = base(cluster={"preset": "my-box"})
    assert error_of(scenario).startswith("cluster.preset: unknown preset 'my-box'")
    (tmp_path / "topologies").mkdir()
    preset = yaml.safe_load((Path(__file__).parents[1] / "topologies" / "dgx-h100.yaml").read_text())
    (tmp_path / "topologies" / "my-box.yaml").write_text(yaml.safe_dump(preset | {"preset": "my-box"}))
    assert load(scenario).cluster.preset == "my-box"


def test_strategy_list_and_single():
    sc = load(
        {k: v for k, v in base().items() if k != "strategy"}
        | {"strategies": [{"name": "zero", "stage": 1}, "zero", {"name": "zero", "stage": 2}]}
    )
    assert [c.config.stage for c in sc.strategies] == [1, 3, 2]
    assert sc.strategies[1].resolved()["name"] == "zero"
    single = load(base(strategy="zero"))
    assert len(single.strategies) == 1 and single.strategies[0].config.stage == 3


def test_scenario_file_loads(tmp_path: Path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(BASE))
    sc = load_scenario(path, ["training.global_batch_size=16"])
    assert sc.training.global_batch_size == 16
    assert sc.source == str(path)


def test_default_scenario_loads_with_overrides():
    sc = load_scenario(
        None, ["model=llama3-8b", "cluster.num_nodes=4", "training.global_batch_size=32"]
    )
    assert sc.model.name == "llama3-8b"
    assert len(sc.strategies) >= 2
