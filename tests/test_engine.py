"""Engine hand cases: every expected number is computed by hand from the cost model's stated
rules (NCCL's tuning.cc latencies, ring byte split, processor-sharing links)."""

from __future__ import annotations

import pytest

from hzpsim.hardware.collectives import CollectiveModel
from hzpsim.hardware.compute import Efficiency
from hzpsim.hardware.topology import ClusterSpec, build_topology
from hzpsim.model.ops import GraphError, OpGraph
from hzpsim.sim.engine import simulate

UNIT = Efficiency(gemm=1.0, attention_forward=1.0, attention_backward=1.0, hbm=1.0, source="test: peak rates")
H100_PEAK = 989.4e12
NVLINK4_ACHIEVED = 450e9 * 370 / 450  # 370 GB/s busbw (nccl-tests #212)
NDR_ACHIEVED = 50e9 * 0.94


def dgx_h100(nodes: int = 1, variability: float = 0.0):
    """Closed forms assume no stragglers: variability off unless asked for."""
    return build_topology(ClusterSpec(preset="dgx-h100", num_nodes=nodes, variability=variability,
                                      variability_persistent=0.0))


def one_second_gemm() -> dict[str, float]:
    return {"gemm": H100_PEAK}


def test_serial_ops_add_up():
    topo = dgx_h100()
    g = OpGraph(8, {0: 8}, "bf16")
    a = g.compute(0, "a", "forward", one_second_gemm())
    b = g.compute(0, "b", "forward", {"gemm": 2 * H100_PEAK}, deps=[a])
    g.compute(0, "c", "forward", {}, bytes_accessed=3.35e12, deps=[b])  # HBM 3.35 TB/s -> 1 s
    trace = simulate(g, topo, UNIT)
    assert trace.end_s == pytest.approx([1.0, 3.0, 4.0])


def test_ring_all_gather_inside_one_node_matches_nccl_formula():
    topo = dgx_h100()
    size = 1e9
    plan = CollectiveModel(topo).plan("all_gather", size, topo.span(range(8)))
    # NCCL tuning.cc ring/Simple: baseLat 8.4 us + 7 steps x 3.4 us NVLink hwLat
    latency = (8.4 + 7 * 3.4) * 1e-6
    assert plan.protocol == "Simple" and plan.algorithm == "ring"
    assert plan.latency_s == pytest.approx(latency)
    assert plan.bytes_by_level == pytest.approx({"island": 7 / 8 * size})
    assert plan.isolated_time_s == pytest.approx(latency + 7 / 8 * size / NVLINK4_ACHIEVED)


def test_ring_across_nodes_splits_bytes_by_level():
    topo = dgx_h100(2)
    size = 1.6e9
    plan = CollectiveModel(topo).plan("reduce_scatter", size, topo.span(range(16)))
    volume = 15 / 16 * size
    assert plan.bytes_by_level == pytest.approx({"island": volume * 7 / 8, "leaf": volume / 8})
    # 14 intra-node steps at 3.4 us + 1 node crossing at 14 us (NCCL: nInterSteps = nNodes-1)
    assert plan.latency_s == pytest.approx((8.4 + 14 * 3.4 + 14.0) * 1e-6)
    bw_time = max(volume * 7 / 8 / NVLINK4_ACHIEVED, volume / 8 / NDR_ACHIEVED)
    assert plan.isolated_time_s == pytest.approx(plan.latency_s + bw_time)


def test_data_parallel_group_of_tp8_layout_goes_over_the_nic_only():
    topo = dgx_h100(4)
    size = 1e9
    plan = CollectiveModel(topo).plan("all_gather", size, topo.span([0, 8, 16, 24]))
    assert plan.bytes_by_level == pytest.approx({"leaf": 3 / 4 * size})


def _ag_graph(streams: tuple[str, str], with_compute: bool = False) -> OpGraph:
    g = OpGraph(8, {0: 8}, "bf16")
    g.add_group("node", range(8))
    if with_compute:
        g.compute(0, "gemm", "forward", one_second_gemm())
    for i, stream in enumerate(streams):
        g.collective("all_gather", "node", [0], 8e9, f"ag{i}", "param_gather", stream)
    return g


def test_compute_overlaps_communication_on_another_stream():
    topo = dgx_h100()
    alone = simulate(_ag_graph(("ag",)), topo, UNIT).end_s[0]
    assert alone < 1.0
    trace = simulate(_ag_graph(("ag",), with_compute=True), topo, UNIT)
    assert trace.end_s[0] == pytest.approx(1.0)  # compute unaffected
    assert trace.end_s[1] == pytest.approx(alone)  # the gather ran beside it


def test_two_transfers_on_one_link_share_it():
    topo = dgx_h100()
    plan = CollectiveModel(topo).plan("all_gather", 8e9, topo.span(range(8)))
    bw_time = plan.isolated_time_s - plan.latency_s
    shared = simulate(_ag_graph(("ag", "rs")), topo, UNIT)
    # both start together, each gets half the NVLink bandwidth, both end together
    assert shared.end_s[0] == pytest.approx(plan.latency_s + 2 * bw_time)
    assert shared.end_s[1] == pytest.approx(plan.latency_s + 2 * bw_time)
    serial = simulate(_ag_graph(("ag", "ag")), topo, UNIT)  # same stream: one after the other
    assert serial.end_s[1] == pytest.approx(2 * plan.isolated_time_s)


def test_unequal_transfers_share_then_the_survivor_speeds_up():
    topo = dgx_h100()
    g = OpGraph(8, {0: 8}, "bf16")
    g.add_group("node", range(8))
    g.collective("all_gather", "node", [0], 8e9, "big", "param_gather", "ag")
    g.collective("all_gather", "node", [0], 4e9, "small", "param_gather", "rs")
    trace = simulate(g, topo, UNIT)
    model = CollectiveModel(topo)
    lat = model.plan("all_gather", 4e9, topo.span(range(8))).latency_s
    bw = NVLINK4_ACHIEVED
    small_bytes, big_bytes = 7 / 8 * 4e9, 7 / 8 * 8e9
    t_small = lat + small_bytes / (bw / 2)
    assert trace.end_s[1] == pytest.approx(t_small)
    assert trace.end_s[0] == pytest.approx(t_small + (big_bytes - small_bytes) / bw)


def test_collective_waits_for_its_last_participant():
    topo = dgx_h100()
    g = OpGraph(8, {0: 4, 1: 4}, "bf16")
    g.add_group("pair", [0, 1])
    a = g.compute(0, "short", "forward", one_second_gemm())
    b = g.compute(1, "long", "forward", {"gemm": 3 * H100_PEAK})
    ar = g.collective("all_reduce", "pair", [0, 1], 1e6, "ar", "grad_reduce", "compute", deps=[a, b])
    trace = simulate(g, topo, UNIT)
    assert trace.start_s[ar] == pytest.approx(3.0)


def _straggler_graph(stream: str) -> tuple[OpGraph, int, int, int]:
    g = OpGraph(8, {0: 8}, "bf16")
    g.add_group("node", range(8))
    a = g.compute(0, "a", "forward", one_second_gemm())
    ar = g.collective("all_reduce", "node", [0], 1e6, "ar", "grad_reduce", stream, deps=[a])
    b = g.compute(0, "b", "forward", one_second_gemm(), deps=[a])
    c = g.compute(0, "c", "forward", one_second_gemm(), deps=[b])
    return g, ar, b, c


def test_a_straggler_is_waited_for_once():
    """Noise of cv 0.1 over a 1 s stretch: the all-reduce over 8 ranks starts 0.1 · E[max of 8]
    late. On the compute stream the ranks leave the collective together, so the next kernel
    starts when it ends (it waited for the straggler there); beside it, on another stream, the
    compute stream's next kernel waits for the straggler after the kernel it was running."""
    from hzpsim.hardware.variability import expected_max_excess

    topo = dgx_h100(variability=0.1)
    late = 0.1 * expected_max_excess(8)
    g, ar, b, _ = _straggler_graph("compute")
    trace = simulate(g, topo, UNIT)
    latency = trace.plans[ar].latency_s
    assert trace.start_s[ar] == pytest.approx(1.0)  # the rendezvous
    assert trace.end_s[ar] > 1.0 + latency + late
    assert trace.start_s[b] == pytest.approx(trace.end_s[ar])
    g, ar, b, c = _straggler_graph("dp")
    trace = simulate(g, topo, UNIT)
    assert trace.start_s[b] == pytest.approx(1.0)  # started with the rendezvous
    assert trace.start_s[c] == pytest.approx(2.0 + late)


def test_memory_timeline_peak_and_breakdown():
    topo = dgx_h100()
    g = OpGraph(8, {0: 8}, "bf16")
    g.add_static(0, {"params": 10.0, "optimizer": 5.0})
    a = g.compute(0, "f", "forward", one_second_gemm(), alloc={"activations": 100.0})
    b = g.compute(0, "g", "forward", one_second_gemm(), deps=[a], alloc={"buffers": 7.0}, free={"buffers": 7.0})
    g.compute(0, "h", "backward", one_second_gemm(), deps=[b], free={"activations": 100.0})
    from hzpsim.report import memory_peak

    trace = simulate(g, topo, UNIT)
    peak, breakdown = memory_peak(trace, 0)
    workspace = topo.device.gemm_workspace_bytes  # cuBLAS's, resident under ``other``
    assert peak == 122.0 + workspace
    assert breakdown == {"params": 10.0, "grads": 0.0, "optimizer": 5.0, "activations": 100.0, "temporaries": 0.0,
                         "buffers": 7.0, "other": workspace}


def test_cycle_is_reported():
    g = OpGraph(8, {0: 8}, "bf16")
    a = g.compute(0, "a", "forward", one_second_gemm())
    b = g.compute(0, "b", "forward", one_second_gemm(), deps=[a])
    g.ops[a].deps = (b,)
    with pytest.raises(GraphError, match="cycle"):
        simulate(g, dgx_h100(), UNIT)


def _stuck_graph() -> OpGraph:
    """x (stream a) waits for c1; c1 is behind y on rank 1's stream b; y waits for x."""
    g = OpGraph(8, {0: 4, 1: 4}, "bf16")
    g.add_group("pair", [0, 1])
    x = g.collective("all_reduce", "pair", [0, 1], 1e6, "x", "grad_reduce", "a")
    y = g.collective("all_reduce", "pair", [0, 1], 1e6, "y", "grad_reduce", "b", deps=[x])
    c1 = g.compute(1, "c1", "forward", one_second_gemm(), stream="b")
    g.ops[x].deps = (c1,)
    assert y < c1  # y is ahead of c1 in rank 1's stream b
    return g


def test_streams_waiting_on_each_other_are_reported_not_hung():
    with pytest.raises(GraphError, match="deadlock: 3 ops never ran"):
        simulate(_stuck_graph(), dgx_h100(), UNIT)


def test_collective_whose_group_never_assembles_is_reported():
    g = OpGraph(8, {0: 4, 1: 4}, "bf16")
    g.add_group("pair", [0, 1])
    w = g.compute(1, "w", "forward", one_second_gemm(), stream="b")  # ahead of z on rank 1
    z = g.collective("all_reduce", "pair", [0, 1], 1e6, "z", "grad_reduce", "b")
    gate = g.compute(0, "gate", "forward", one_second_gemm(), stream="a", deps=[z])
    g.ops[w].deps = (gate,)  # rank 1 never reaches z: w waits for gate, which waits for z
    with pytest.raises(GraphError, match="collective 'z' .* never assembled: 1 of 2"):
        simulate(g, dgx_h100(), UNIT)


def test_compute_slows_while_its_rank_communicates():
    topo = dgx_h100()
    slow = Efficiency(gemm=1.0, attention_forward=1.0, attention_backward=1.0, hbm=1.0, source="test",
                      comm_overlap_slowdown=0.25)
    comm_alone = simulate(_ag_graph(("ag",)), topo, slow).end_s[0]
    trace = simulate(_ag_graph(("ag",), with_compute=True), topo, slow)
    # the gemm runs at 1/1.25 while the gather is in flight, then at full speed
    assert trace.end_s[1] == pytest.approx(comm_alone)
    assert trace.end_s[0] == pytest.approx(comm_alone + 1.0 - comm_alone / 1.25)


def test_opgraph_json_round_trip_replays_identically():
    from hzpsim.scenario import scenario_from_mapping
    from hzpsim.strategies import zero

    sc = scenario_from_mapping({"model": "tiny-dense", "training": {"global_batch_size": 16},
                                "cluster": {"preset": "dgx-h100", "num_nodes": 2},
                                "strategy": {"name": "zero", "stage": 3}})
    graph = zero.build(sc.strategies[0].config, sc.model, sc.training, sc.topology)
    again = OpGraph.from_json(graph.to_json())
    assert again.to_json() == graph.to_json()
    assert simulate(again, sc.topology).end_s == simulate(graph, sc.topology).end_s


def test_the_garbage_collector_pauses_for_a_replay_and_comes_back_as_it_was():
    """``gc_paused`` (the engine's replay and the search's evaluations run under it): off inside,
    back to its previous state after, an exception included; a caller's disabled collector
    stays disabled."""
    import gc

    from hzpsim.sim.engine import gc_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
