"""Cluster layer: devices, presets, topology, placement.

Expected numbers come from outside the code: vendor datasheets (via data/strategies.md §4),
NCCL-tests measurements (strategies.md §3), the AsyncHZP cluster shape (DESIGN §4) and
Megatron-LM's ``initialize_model_parallel`` docstring.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import yaml

from hzpsim import presets
from hzpsim.hardware.devices import DEVICES, get_device
from hzpsim.hardware.placement import (
    Placement,
    expert_placement,
    group_levels,
    nested_groups,
    strided_groups,
)
from hzpsim.hardware.topology import (
    LEVELS,
    ClusterSpec,
    ResolvedCluster,
    Topology,
    build_topology,
    preset_names,
    preset_spec,
)

TOPO_DIR = Path(__file__).resolve().parents[1] / "topologies"


def topo(preset: str, num_nodes: int = 1, **kw):
    return build_topology(ClusterSpec(preset=preset, num_nodes=num_nodes, **kw))


# --- devices ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, bf16_tf, mem_gb, bw_tbs",
    [
        ("a100-80gb", 312, 85.056798720, 2.039),  # A100 datasheet; memory as CUDA reports it
        ("a100-40gb", 312, 40, 1.555),
        ("h100-sxm", 989.4, 81559 * 2**20 / 1e9, 3.35),  # H100 SXM5 datasheet; nvidia-smi 81559 MiB
        ("h200", 989.4, 143771 * 2**20 / 1e9, 4.8),  # H200 SXM datasheet; nvidia-smi 143771 MiB (141 GB nominal)
        # per GCD: half of a 383 TF / 3.2 TB/s package; memory as HIP reports a GCD, 65,520 MiB
        ("mi250x", 383 / 2, 65520 * 2**20 / 1e9, 1.6),
        ("npu-910b", 300, 64, 1.6),  # AsyncHZP paper's ~300 TF, 64 GB
    ],
)
def test_device_datasheet_numbers(name, bf16_tf, mem_gb, bw_tbs):
    d = get_device(name)
    assert d.peak_flops_per_s("bf16") == pytest.approx(bf16_tf * 1e12)
    assert d.memory_bytes == pytest.approx(mem_gb * 1e9)
    assert d.memory_bytes_per_s == pytest.approx(bw_tbs * 1e12)
    assert d.source


def test_mi250x_gcd_memory_label_and_capacity():
    """One MI250X GCD: labelled 64 GB (OLCF Frontier User Guide), 65,520 MiB as HIP reports it."""
    d = get_device("mi250x")
    assert d.memory_label_gb == 64
    assert d.memory_bytes == 68_702_699_520
    assert d.memory_bytes > 64 * 1e9  # the old 64e9 under-counted the device by 6.8 %


def test_device_precisions():
    h100 = get_device("h100-sxm")
    # datasheet: 3,958 TF fp8 with sparsity (whitepaper 3,957.8) -> dense half
    assert h100.peak_flops_per_s("fp8") == pytest.approx(3958e12 / 2, rel=1e-4)
    assert h100.peak_flops_per_s("fp16") == h100.peak_flops_per_s("bf16")
    a100 = get_device("a100-80gb")
    assert a100.peak_fp8_flops_per_s is None
    assert a100.peak_flops_per_s("fp8") == a100.peak_flops_per_s("bf16")  # no fp8 cores
    assert a100.peak_flops_per_s("fp32") == pytest.approx(19.5e12)  # plain FP32, not TF32
    assert get_device("v100").peak_flops_per_s("fp16") == pytest.approx(125e12)
    with pytest.raises(ValueError, match="unknown precision"):
        h100.peak_flops_per_s("int8")


def test_device_catalog_complete_and_presets_exist():
    expected = {
        "a100-40gb",
        "a100-80gb",
        "h100-sxm",
        "h200",
        "mi250x",
        "v100",
        "npu-910b",
        "cpu-local",
    }
    assert expected <= set(DEVICES)
    for d in DEVICES.values():
        assert d.default_cluster_preset in preset_names(), d.name
        assert preset_spec(d.default_cluster_preset).device is not None
    assert get_device("cpu-local").default_cluster_preset == "local-cpu"


def test_unknown_device_message():
    with pytest.raises(ValueError, match=r"unknown device 'x' \(known: a100-40gb, .*h100-sxm"):
        get_device("x")


# --- presets and YAML files -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.stem for p in TOPO_DIR.glob("*.yaml")))
def test_yaml_presets_load_and_validate(name):
    data = yaml.safe_load((TOPO_DIR / f"{name}.yaml").read_text())
    known = {f.name for f in fields(ClusterSpec)}
    assert set(data) <= known, set(data) - known
    spec = preset_spec(name)
    assert spec.preset == name
    assert spec.resolved().device == data["device"]
    assert "num_nodes" not in data  # presets leave num_nodes to the scenario (default 1)


def test_preset_shapes():
    t = topo("hzp-npu", 2)
    assert t.devices_per_node == 16 and t.islands_per_node == 2 and t.devices_per_island == 8
    assert t.device.name == "npu-910b"
    # inter-island bandwidth unpublished: defaults to the NIC path (200 Gb/s RoCE = 25 GB/s)
    assert t.link("node").bytes_per_s == pytest.approx(25e9)
    assert t.link("node").efficiency == t.link("leaf").efficiency
    assert t.link("island").bytes_per_s == pytest.approx(400e9)
    f = topo("frontier")
    assert f.devices_per_node == 8 and f.islands_per_node == 4  # 4 MI250X = 8 GCDs
    assert f.link("leaf").bytes_per_s == pytest.approx(4 * 200e9 / 8 / 8)  # 4x200 Gb/s / 8 GCDs
    assert f.link("island").bytes_per_s == pytest.approx(4 * 50e9)  # 4 IF links in the package (OLCF: 200 GB/s)
    assert f.link("node").bytes_per_s == pytest.approx(50e9)  # one IF link across packages (OLCF: 50-100)
    assert f.nodes_per_leaf == 128  # one cabinet = one dragonfly group of 128 nodes
    # dragonfly taper: 512 x 200 Gb/s injection per group over 4 x 200 Gb/s to each of 73 other groups
    assert f.link("spine").bytes_per_s == pytest.approx(25e9 / 2 / round(512 / (4 * 73), 3))
    a = topo("dgx-a100")
    assert a.device.name == "a100-80gb" and a.devices_per_node == 8
    assert a.link("island").bytes_per_s == pytest.approx(600e9 / 2)  # NVLink3 600 bidir
    assert a.link("leaf").bytes_per_s == pytest.approx(200e9 / 8)  # HDR 200 Gb/s
    assert topo("dgx-h200").device.name == "h200"
    c = topo("local-cpu")
    assert c.num_devices == 2 and c.device.name == "cpu-local"


def test_achieved_bandwidths_match_nccl_tests():
    h = topo("dgx-h100", 2)
    assert h.link("island").achieved_bytes_per_s == pytest.approx(370e9)  # nccl-tests #212
    assert 46e9 <= h.link("leaf").achieved_bytes_per_s <= 48e9  # nccl-tests #290
    a = topo("dgx-a100", 2)
    # DGX-A100 multi-node AR busbw 192 GB/s with 8x HDR (NVIDIA/nccl #1576)
    assert 8 * a.link("leaf").achieved_bytes_per_s == pytest.approx(192e9)
    assert 230e9 <= a.link("island").achieved_bytes_per_s <= 250e9  # NVLink3 AR busbw


def test_device_only_spec_gets_usual_fabric():
    t = build_topology(ClusterSpec(device="h100-sxm", num_nodes=4))
    assert t.spec.preset == "dgx-h100"
    assert t.link("island").bytes_per_s == pytest.approx(450e9)
    assert t.link("leaf").bytes_per_s == pytest.approx(50e9)  # NDR 400 Gb/s
    t = build_topology(ClusterSpec(device="npu-910b", num_nodes=1))
    assert t.islands_per_node == 2
    # overrides win over the preset
    t = build_topology(
        ClusterSpec(
            preset="dgx-h100",
            inter_node_bytes_per_s_per_device=25e9,
            spine_oversubscription=2.0,
            num_nodes=64,
        )
    )
    assert t.link("leaf").bytes_per_s == 25e9 and t.link("spine").bytes_per_s == 12.5e9


def test_resolved_cluster_is_concrete_and_keeps_the_spec_field_names():
    # the spec's fields, plus the measured device rates read at load (hzpsim calibrate machine)
    assert [f.name for f in fields(ResolvedCluster)] == [f.name for f in fields(ClusterSpec)] + ["device_spec"]
    for name in preset_names():
        resolved = preset_spec(name).resolved()
        # nothing left unset but what only a user can say (the price of a device-hour)
        assert all(getattr(resolved, f.name) is not None for f in fields(resolved)
                   if f.name != "price_per_device_hour"), name
    # plain int / float whatever numbers the spec was built with (numpy, int for a rate)
    r = ClusterSpec(preset="dgx-h100", num_nodes=np.int64(2), spine_oversubscription=2).resolved()
    assert type(r.num_nodes) is int and type(r.spine_oversubscription) is float
    assert r.device_memory_bytes == get_device("h100-sxm").memory_bytes


def test_topology_constructor_reads_no_files(monkeypatch):
    import builtins

    import networkx  # noqa: F401  (imported before files are forbidden)

    resolved = ClusterSpec(preset="hzp-npu", num_nodes=64).resolved()

    def forbidden(*args, **kwargs):
        raise AssertionError("Topology(...) touched the filesystem")

    for name in ("list_presets", "load_preset", "read_yaml", "preset_dirs"):
        monkeypatch.setattr(presets, name, forbidden)
    for name in ("glob", "is_file", "is_dir", "exists", "open", "read_text", "stat"):
        monkeypatch.setattr(Path, name, forbidden)
    monkeypatch.setattr(builtins, "open", forbidden)
    t = Topology(resolved)
    assert t.num_devices == 1024 and t.spec.preset == "hzp-npu"
    assert t.span(range(0, 1024, 16)).outermost_level == "spine"
    assert t.link("node").bytes_per_s == 25e9
    assert t.graph.number_of_nodes() > 1024


def test_topology_needs_a_resolved_cluster():
    with pytest.raises(TypeError, match="ResolvedCluster"):
        Topology(ClusterSpec(preset="dgx-h100"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(preset="dgx-h100", gpus_per_node=12, islands_per_node=8), "gpus_per_node"),
        (dict(preset="dgx-h100", num_nodes=0), "num_nodes"),
        (dict(preset="dgx-h100", intra_node_efficiency=1.2), "intra_node_efficiency"),
        (dict(preset="dgx-h100", inter_node_efficiency=0.0), "inter_node_efficiency"),
        (dict(preset="dgx-h100", intra_node_bytes_per_s=-1.0), "intra_node_bytes_per_s"),
        (dict(preset="dgx-h100", spine_oversubscription=0.5), "spine_oversubscription"),
        (dict(preset="dgx-h100", inter_node_latency_s=-1e-6), "inter_node_latency_s"),
        (dict(preset="nope"), "preset"),
        (dict(device="tpu"), "device"),
        (dict(), "device"),
    ],
)
def test_validate_names_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        build_topology(ClusterSpec(**kw))


# --- coordinates, levels, spans ---------------------------------------------------------------


def test_coords_and_level_between():
    t = topo("hzp-npu", 64)  # 64 nodes x 16 cards, 32 nodes per leaf
    assert t.coords(0) == (0, 0, 0)
    assert t.coords(9) == (0, 0, 1)  # second island of node 0
    assert t.coords(16) == (0, 1, 2)
    assert t.coords(32 * 16) == (1, 32, 64)
    assert t.level_between(3, 3) == "device"
    assert t.level_between(0, 7) == "island"
    assert t.level_between(0, 8) == "node"
    assert t.level_between(0, 16) == "leaf"
    assert t.level_between(0, 32 * 16) == "spine"
    with pytest.raises(ValueError):
        t.coords(64 * 16)


def test_spans_of_megatron_groups_on_two_dgx_h100():
    t = topo("dgx-h100", 2)
    p = Placement.from_sizes(16, tp=8, dp=2)
    tp_group = p.group("tp", 0)
    dp_group = p.group("dp", 0)
    assert tuple(tp_group) == tuple(range(8)) and tuple(dp_group) == (0, 8)
    s = t.span(tp_group)
    assert s.outermost_level == "island" and s.num_nodes == 1 and s.max_ranks_per_island == 8
    s = t.span(dp_group)
    assert s.outermost_level == "leaf" and s.num_nodes == 2 and s.max_ranks_per_node == 1
    assert s.levels == ("leaf",)
    assert group_levels(t, dp_group) == ("leaf",)
    assert t.span([5]).outermost_level == "device" and t.span([5]).levels == ()


def test_span_levels_on_hzp_npu():
    t = topo("hzp-npu", 4)
    # a DP group of 32 consecutive ranks: 2 nodes, each with both islands
    s = t.span(range(32))
    assert s.levels == ("island", "node", "leaf")
    assert (s.num_islands, s.num_nodes, s.num_leaves) == (4, 2, 1)
    assert s.max_ranks_per_island == 8 and s.max_ranks_per_node == 16
    # one rank per island of one node: crosses only the inter-island path
    assert t.span([0, 8]).levels == ("node",)
    with pytest.raises(ValueError, match="duplicate"):
        t.span([0, 0])


def test_span_of_16384_ranks():
    """(Its speed is a benchmark's business: benchmarks/bench_engine.py.)"""
    t = topo("dgx-h100", 2048)  # 16,384 devices, 64 leaves
    s = t.span(list(range(16384)))
    assert (s.num_nodes, s.num_leaves, s.num_islands) == (2048, 64, 2048)
    assert s.outermost_level == "spine"
    s = t.span(tuple(range(3, 16384, 8)))  # a DP group of a TP8 layout
    assert s.max_ranks_per_node == 1 and s.levels == ("leaf", "spine")
    assert t.span(range(3, 16384, 8)) == s  # the same group as a range


# --- graph ------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset, nodes", [("dgx-h100", 2048), ("hzp-npu", 1024)])
def test_graph_16384_devices(preset, nodes):
    t = topo(preset, nodes)
    assert t.num_devices == 16384
    g = t.graph
    n_spine = 1 if t.num_leaves > 1 else 0
    assert g.number_of_nodes() == (
        t.num_devices + t.num_islands + t.num_nodes + t.num_leaves + n_spine
    )
    assert (
        g.number_of_edges() == t.num_devices + t.num_islands + t.num_nodes + t.num_leaves * n_spine
    )
    levels = [d["level"] for _, d in g.nodes(data=True)]
    assert levels.count("device") == 16384 and levels.count("island") == t.num_islands


def test_graph_edge_attributes_consistent_with_links():
    t = topo("hzp-npu", 40)  # 2 leaves (32 + 8 nodes)
    g = t.graph
    for _u, _v, d in g.edges(data=True):
        lk = t.link(d["level"])
        assert d["per_device_bytes_per_s"] == lk.bytes_per_s
        assert d["bytes_per_s"] == pytest.approx(lk.bytes_per_s * d["num_devices"])
        assert d["efficiency"] == lk.efficiency and d["latency_s"] == lk.latency_s
    assert g.edges[0, ("island", 0)]["num_devices"] == 1
    assert g.edges[("island", 1), ("node", 0)]["num_devices"] == 8
    assert g.edges[("leaf", 1), ("spine", 0)]["num_devices"] == 8 * 16
    assert set(LEVELS) == {d["level"] for _, _, d in g.edges(data=True)}
    # the graph's path between two ranks tops out at level_between
    import networkx as nx

    path = nx.shortest_path(g, 0, 32 * 16)
    assert ("spine", 0) in path and t.level_between(0, 32 * 16) == "spine"


# --- placement --------------------------------------------------------------------------------


def test_megatron_docstring_example():
    # megatron/core/parallel_state.py initialize_model_parallel docstring: 16 GPUs, tp=2, pp=4
    p = Placement.from_sizes(16, tp=2, pp=4, dp=-1)
    assert p.size("dp") == 2
    assert p.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    assert p.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)]
    assert p.groups("pp") == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]


def test_tp2_pp2_dp2_on_8_ranks():
    p = Placement.from_sizes(8, tp=2, pp=2, dp=2)
    assert p.dims == (("tp", 2), ("cp", 1), ("dp", 2), ("pp", 2))
    assert p.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert p.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert p.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert p.coord(7) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1}
    assert p.rank(tp=1, dp=1, pp=1) == 7
    for r in range(8):
        assert p.rank(**p.coord(r)) == r
        assert r in p.group(("dp", "cp"), r)


def test_megatron_cp_example():
    # Megatron docstring variant: 16 GPUs, tp=2, cp=2, pp=2 -> dp=2; cp groups [g0,g2],[g1,g3]..,
    # dp groups [g0,g4],[g1,g5],.., pp groups [g0,g8],[g1,g9],..
    p = Placement.from_sizes(16, tp=2, cp=2, pp=2, dp=-1)
    assert p.groups("cp")[:4] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert p.groups("dp")[:4] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert p.groups("pp")[:2] == [(0, 8), (1, 9)]
    assert tuple(p.group(("dp", "cp"), 0)) == (0, 2, 4, 6)


def test_groups_and_group_agree():
    p = Placement.from_sizes(64, tp=4, cp=2, dp=4, pp=2)
    for dims in ("tp", "cp", "dp", "pp", ("dp", "cp"), ("tp", "pp")):
        gs = p.groups(dims)
        assert sorted(r for g in gs for r in g) == list(range(64))
        for g in gs:
            for r in g:
                assert tuple(p.group(dims, r)) == g


def test_from_sizes_errors():
    with pytest.raises(ValueError, match="!= num_devices = 16"):
        Placement.from_sizes(16, tp=8, dp=4)
    with pytest.raises(ValueError, match="^ep: not a dimension"):
        Placement.from_sizes(16, tp=8, ep=2)
    with pytest.raises(ValueError, match="^dp: cannot infer"):
        Placement.from_sizes(12, tp=8, dp=-1)


def test_nested_groups():
    dp = tuple(range(0, 64, 2))  # 32 ranks
    blocks = nested_groups(dp, 8)
    assert blocks[0] == (0, 2, 4, 6, 8, 10, 12, 14) and len(blocks) == 4
    assert strided_groups(dp, 8)[0] == (0, 16, 32, 48)
    with pytest.raises(ValueError, match="does not divide"):
        nested_groups(dp, 5)


def test_asynchzp_param_group_is_the_island_on_hzp_npu():
    t = topo("hzp-npu", 4)  # 64 cards
    p = Placement.from_sizes(64, dp=64)
    dp = p.group("dp", 0)
    params = nested_groups(dp, 8)
    assert all(group_levels(t, g) == ("island",) for g in params)
    assert group_levels(t, dp) == ("island", "node", "leaf")


def test_expert_placement_parallel_folding():
    # 16 ranks, pp=2: expert layers with ep=4, etp=1 -> edp=2; pp groups coincide with dense ones
    e = expert_placement(16, ep=4, expert_tp=1, pp=2)
    d = Placement.from_sizes(16, tp=2, pp=2, dp=-1)
    assert e.size("edp") == 2
    assert e.groups("ep")[:2] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert e.groups("pp") == d.groups("pp")


def test_device_memory_override_for_a_variant():
    # Meta's Grand Teton H100s have 96 GB HBM2e (published); the catalog H100 SXM has 80 GB
    topo = build_topology(ClusterSpec(preset="dgx-h100", device_memory_bytes=96e9))
    assert topo.device.memory_bytes == 96e9
    assert topo.device.peak_bf16_flops_per_s == 989.4e12
    with pytest.raises(ValueError, match="device_memory_bytes"):
        ClusterSpec(preset="dgx-h100", device_memory_bytes=-1.0).validate()


def test_unpublished_rates_are_refused_not_invented():
    with pytest.raises(ValueError, match="no published fp32"):
        get_device("npu-910b").peak_flops_per_s("fp32")
