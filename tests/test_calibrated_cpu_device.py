"""The executor's step-time mechanisms on a calibrated CPU device (issue 11).

`hzpsim calibrate machine` measures, and the simulator applies only when a device carries the
measurement (so no uncalibrated prediction moves):

- per collective kind and group size, gloo's own latency and seconds per byte
  (``Device.collective_costs``, used by ``hardware/collectives.py`` instead of NCCL's model);
- FSDP2's Python per parameter gather / gradient reduce call (``Device.framework_host_s``, ``fsdp2`` ``call_s``,
  charged by the ``fsdp2`` implementation profile per call);
- DTensor's dispatch per ATen op (``dtensor`` ``op_s``, charged by the ``dtensor``
  profile per op instead of ``kernel_launch_s``).

Fast tests (no torch); the calibration itself runs in the slow
``test_calibrate_machine_writes_a_profile_the_simulator_reads`` of tests/test_executor.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from hzpsim.fitting.machine import (
    build_profile,
    fit_collectives,
    fit_kind,
    hop_delay,
    in_step_costs,
    in_step_times,
)
from hzpsim.hardware.collectives import CollectiveModel, gloo_hops
from hzpsim.hardware.devices import get_device
from hzpsim.hardware.topology import ClusterSpec, build_topology
from hzpsim.strategies import _implementations as impl
from hzpsim.validation.executor import DEFAULT_SCENARIO, predicted_report, scenario_for_world

COSTS = (("all_gather", 4, 2e-3, 1e-9), ("reduce_scatter", 4, 5e-3, 4e-9), ("all_reduce", 4, 3e-3, 2e-9),
         ("all_to_all", 4, 1e-3, 5e-10), ("send_recv", 2, 4e-4, 3e-10), ("all_gather", 2, 1e-3, 8e-10))


def _topology(costs=COSTS, world=4):
    topology = build_topology(ClusterSpec(preset="local-cpu", gpus_per_node=world))
    topology.device = dataclasses.replace(topology.device, collective_costs=costs)
    return topology


@pytest.mark.parametrize("kind, latency, per_byte", [(k, lat, b) for k, g, lat, b in COSTS if g == 4])
def test_measured_collective_costs_replace_nccls_model(kind, latency, per_byte):
    """Each kind takes its own measured latency + size x seconds-per-byte (gloo's algorithms
    differ by kind), not the one fabric fit through NCCL's formulas."""
    size = 3 << 20
    topology = _topology()
    plan = CollectiveModel(topology).plan(kind, size, topology.span([0, 1, 2, 3]))
    assert plan.isolated_time_s == pytest.approx(latency + per_byte * size)
    assert plan.latency_s == pytest.approx(latency)
    # what the engine moves: the demand at the level's bandwidth takes the per-byte time
    [(level, demand)] = plan.demand_by_level.items()
    assert demand / topology.link(level).achieved_bytes_per_s == pytest.approx(per_byte * size)
    nccl = CollectiveModel(_topology(costs=())).plan(kind, size, topology.span([0, 1, 2, 3]))
    assert plan.bytes_by_level == nccl.bytes_by_level  # the reported bytes stay the algorithm's
    assert nccl.isolated_time_s != pytest.approx(plan.isolated_time_s)


def test_measured_costs_pick_the_nearest_group_size_and_send_pairs():
    topology = _topology()
    model = CollectiveModel(topology)
    pair = model.plan("all_gather", 1e6, topology.span([0, 1]))
    assert pair.isolated_time_s == pytest.approx(1e-3 + 8e-10 * 1e6)  # the 2-rank fit, not the 4-rank one
    send = model.plan("send_recv", 1e6, topology.span([0, 2]), "island")
    assert send.isolated_time_s == pytest.approx(4e-4 + 3e-10 * 1e6)


def test_uncalibrated_devices_keep_the_nccl_model():
    """No table, no change: the GPU presets and an uncalibrated cpu-local plan as before."""
    assert get_device("cpu-local").collective_costs == ()
    assert get_device("h100-sxm").collective_costs == ()
    assert get_device("cpu-local").framework_host_s == ()
    assert get_device("cpu-local").collective_hop_delay_s is None


def test_fsdp2_and_dtensor_profiles_charge_the_measured_framework_host_cost():
    device = dataclasses.replace(get_device("cpu-local"), kernel_launch_s=1e-5, collective_call_s=1e-4,
                                 framework_host_s=(("dtensor", "op_s", 2e-4), ("fsdp2", "call_s", 2e-3)))
    fsdp2 = impl.get("fsdp2").on_device(device)
    assert fsdp2.call_host_s(3, 4) == pytest.approx(3 * (1e-4 + 2e-3))
    assert fsdp2.launch_s(100) == pytest.approx(100 * 1e-5)  # FSDP2's ops are plain tensors' ops
    dtensor = impl.get("dtensor").on_device(device)
    assert dtensor.launch_s(100) == pytest.approx(100 * 2e-4)
    assert dtensor.call_host_s(1, 2) == pytest.approx(1e-4)
    for name in ("deepspeed", "fsdp1", "torchtitan", "megatron-core", "reference", "ddp", "ideal"):
        other = impl.get(name).on_device(device)
        plain = impl.get(name).on_device(dataclasses.replace(device, framework_host_s=()))
        assert other == plain, name
    # uncalibrated: the framework cost is absent
    bare = impl.get("fsdp2").on_device(get_device("cpu-local"))
    assert bare.framework_call_s == 0.0 and bare.kernel_launch_s == get_device("cpu-local").kernel_launch_s


def _profile(**device):
    return {"device": {"kernel_launch_s": 1e-5, "collective_call_s": 1e-4, **device}, "cluster": {}}


@pytest.mark.parametrize("strategy, field, value", [("zero(stage=3)", "fsdp2_call_host_s", 2e-3),
                                                    ("nd", "dtensor_op_host_s", 2e-4)])
def test_the_framework_host_cost_lengthens_the_predicted_step(strategy, field, value):
    """ZeRO-3 on FSDP2 issues 36 gather / reduce calls per rank and step, ND's DTensor layers
    dispatch thousands of ops: the measured framework cost shows up in the predicted step."""
    scenario = scenario_for_world(DEFAULT_SCENARIO, 4, _profile(), filters=[strategy])
    with_cost = scenario_for_world(DEFAULT_SCENARIO, 4, _profile(**{field: value}), filters=[strategy])
    base = predicted_report(scenario, scenario.strategies[0])["step_time_s"]
    more = predicted_report(with_cost, with_cost.strategies[0])["step_time_s"]
    minimum = 36 * (value - 0.0) if field == "fsdp2_call_host_s" else 1000 * (value - 1e-5)
    assert more - base >= 0.9 * minimum, (base, more)


def test_fsdp2_holds_the_training_thread_in_every_call_on_a_cpu(monkeypatch):
    """FSDP2 issues its gathers and reduce-scatters with ``async_op=False``; on gloo the thread
    waits in each: a ZeRO-3 rank's 24 gathers, 12 reduce-scatters and the norm's all-reduce
    (10 ms each here, everything else cheap) follow one another and the compute, so the step
    is at least their sum. Without the wait the backward's gathers and reduce-scatters overlap."""
    rows = [[kind, 4, 1e-2, 0.0] for kind in ("all_gather", "reduce_scatter", "all_reduce")]
    scenario = scenario_for_world(DEFAULT_SCENARIO, 4, _profile(collective_costs=rows), filters=["zero(stage=3)"])
    blocking = predicted_report(scenario, scenario.strategies[0])["step_time_s"]
    assert blocking >= 37 * 1e-2, blocking
    monkeypatch.setitem(impl.IMPLEMENTATIONS, "fsdp2", dataclasses.replace(impl.get("fsdp2"), blocking_calls=False))
    overlapping = predicted_report(scenario, scenario.strategies[0])["step_time_s"]
    assert overlapping < blocking - 0.05, (blocking, overlapping)  # at least five 10 ms calls overlapped


def test_validate_reads_the_collective_table_from_the_profile():
    rows = [["all_gather", 4, 2e-3, 1e-9], ["reduce_scatter", 4, 5e-3, 4e-9]]
    scenario = scenario_for_world(DEFAULT_SCENARIO, 4, _profile(collective_costs=rows), filters=["zero(stage=3)"])
    assert scenario.topology.device.collective_costs == tuple(tuple(r) for r in rows)


def test_fit_kind_recovers_latency_and_per_byte_time():
    sizes = [4096, 65536, 1 << 20, 4 << 20, 16 << 20]
    rows = [{"size_bytes": s, "time_s": 3e-3 + 2e-9 * s} for s in sizes]
    latency, per_byte = fit_kind(rows)
    assert latency == pytest.approx(3e-3, rel=1e-6) and per_byte == pytest.approx(2e-9, rel=1e-6)
    # a negative intercept is not a latency: the best non-negative fit instead
    latency, per_byte = fit_kind([{"size_bytes": s, "time_s": 2e-9 * s - 1e-5 + 1e-3 * (s == 4096)} for s in sizes])
    assert latency >= 0 and per_byte >= 0


def test_fit_collectives_one_row_per_kind_and_group():
    rows = [{"kind": k, "group_size": g, "size_bytes": s, "time_s": 1e-3 * g + 1e-9 * s}
            for k in ("all_gather", "send_recv") for g in (2, 4) for s in (4096, 1 << 20, 16 << 20)]
    fits = fit_collectives(rows)
    assert [(k, g) for k, g, _, _ in fits] == [("all_gather", 2), ("all_gather", 4), ("send_recv", 2), ("send_recv", 4)]
    assert fits[1][2] == pytest.approx(4e-3) and fits[1][3] == pytest.approx(1e-9)


def test_in_step_time_runs_from_the_last_arrival_to_each_completion():
    """Four ranks, one group of 4: a call issued at 0, 1, 2, 5 ms and done at 9, 9, 9, 10 ms
    lasts 4.25 ms: from the last arrival (the early ranks' wait is the others' work, which the
    simulator's rendezvous charges) to each rank's own completion, averaged (each rank goes on
    when its own call returns); the last completion comes 5 ms after."""
    ms = 1_000_000
    marks = [[(0, 9 * ms)], [(1 * ms, 9 * ms)], [(2 * ms, 9 * ms)], [(5 * ms, 10 * ms)]]
    rows = [[{"kind": "all_gather", "group_size": 4, "size_bytes": 64, "marks": m}] for m in marks]
    [row] = in_step_times(rows, 4)
    assert row["time_s"] == pytest.approx(4.25e-3) and row["last_completion_s"] == pytest.approx(5e-3)


def test_a_pooled_profile_holds_each_call_as_long_as_the_in_step_loop_did():
    """With a CPU pool a call's wall time is what the in-step loop measured from the last
    arrival to the LAST member's release (no member goes on before the ring passed it): fitted
    per kind and group size where measured, the back-to-back fit elsewhere."""
    sizes = (4096, 1 << 20, 16 << 20)
    in_step = [{"kind": "all_gather", "group_size": 4, "size_bytes": s, "time_s": 1e-3 + 1e-9 * s,
                "last_completion_s": 5e-3 + 2e-9 * s} for s in sizes]
    back_to_back = [["all_gather", 4, 3e-3, 1e-9], ["reduce_scatter", 4, 4e-3, 1e-9]]
    fits = in_step_costs(in_step, back_to_back)
    assert [f[:2] for f in fits] == [["all_gather", 4], ["reduce_scatter", 4]]
    assert fits[0][2:] == pytest.approx([5e-3, 2e-9]) and fits[1] == back_to_back[1]
    assert in_step_costs([], back_to_back) == back_to_back


def test_hop_delay_is_the_in_step_excess_per_message():
    """In-step minus back-to-back time = hops x delay (ring all-gather n-1 hops, all-reduce and
    gloo's reduce-scatter 2(n-1), send 1); bandwidth-bound sizes are left out."""
    delay = 1.2e-3
    sweep, in_step = [], []
    for kind, g in (("all_gather", 4), ("reduce_scatter", 4), ("all_reduce", 2), ("send_recv", 4)):
        for size in (4096, 1 << 20, 16 << 20):
            base = 1e-3 + 1e-9 * size
            hops = {"all_gather": g - 1, "reduce_scatter": 2 * (g - 1), "all_reduce": 2 * (g - 1), "send_recv": 1}[kind]
            sweep.append({"kind": kind, "group_size": g, "size_bytes": size, "time_s": base})
            noise = 0.05 if size > (1 << 20) else 0.0  # a big call's noise must not leak in
            in_step.append({"kind": kind, "group_size": g, "size_bytes": size, "time_s": base + hops * delay + noise})
    assert hop_delay(sweep, in_step) == pytest.approx(delay)
    assert hop_delay(sweep, sweep) == 0.0


def test_gloo_hops_per_kind():
    assert [gloo_hops(k, 4) for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")] == \
        [3, 6, 6, 3, 1]
    assert gloo_hops("all_gather", 1) == 0


def test_the_hop_delay_adds_to_every_measured_collective():
    topology = _topology()
    topology.device = dataclasses.replace(topology.device, collective_hop_delay_s=1e-3)
    plan = CollectiveModel(topology).plan("reduce_scatter", 1e6, topology.span([0, 1, 2, 3]))
    assert plan.isolated_time_s == pytest.approx(5e-3 + 6 * 1e-3 + 4e-9 * 1e6)
    assert plan.latency_s == pytest.approx(5e-3 + 6e-3)


def test_build_profile_carries_the_measured_mechanisms():
    """Two ranks at sharing factor 2 (1 core between them). With the CPU pool the device gets
    the CPU costs alone on a core (thread CPU, not wall), a pool of 1/2 + 1/2 = 1 core, each
    collective's time (back to back here: no in-step marks) and its CPU per member less the
    issue's; that is the default. Without the pool: the wall costs at the calibration's load."""
    sizes = (4096, 1 << 20)
    collectives = [{"kind": k, "group_size": 2, "size_bytes": s, "time_s": 3e-3 + 3e-9 * s,
                    "cpu_s": 1e-4 + 5e-4 + 1e-9 * s} for k in ("all_gather", "reduce_scatter") for s in sizes]
    rank = {"gemm": [{"m": 64, "k": 64, "n": 64, "flops_per_s": 1e10, "cpu_flops_per_s": 2e10}],
            "memory": [{"elements": 1, "bytes_per_s": 1e9, "cpu_bytes_per_s": 2e9}],
            "collectives": collectives, "call_issue_s": {2: 2e-4}, "call_issue_cpu_s": {2: 1e-4},
            "autograd_op_s": 1e-6, "eager_op_s": 2e-5, "eager_op_cpu_s": 1e-5,
            "eager_ops_per_step": 491, "kernel_launch_s": 1e-6, "host_cost_per_call_s": 1e-3, "sharing_factor": 2.0,
            "framework": {"fsdp2_call_s": 2e-3, "dtensor_op_s": 2e-4, "fsdp2_call_cpu_s": 1e-3, "dtensor_op_cpu_s": 1e-4},
            "in_step_marks": [{"kind": c["kind"], "group_size": 2, "size_bytes": c["size_bytes"], "marks": []}
                              for c in collectives]}
    profile = build_profile([rank, rank], 2, cpu_pool=True)
    device = profile["device"]
    assert device["node_cpu_cores"] == pytest.approx(1.0)
    assert device["peak_fp32_flops_per_s"] == pytest.approx(2e10) and device["memory_bytes_per_s"] == pytest.approx(2e9)
    assert device["kernel_launch_s"] == pytest.approx(1e-5) and device["collective_call_s"] == pytest.approx(1e-4)
    assert device["fsdp2_call_host_s"] == pytest.approx(1e-3) and device["dtensor_op_host_s"] == pytest.approx(1e-4)
    assert [r[:2] for r in device["collective_costs"]] == [["all_gather", 2], ["reduce_scatter", 2]]
    assert device["collective_cpu_costs"][0][2:] == pytest.approx([5e-4, 1e-9])
    assert device["collective_costs"][0][2:] == pytest.approx([3e-3, 3e-9])
    assert build_profile([rank, rank], 2)["device"] == device  # the pool is the default
    # without the pool: wall time at the calibration's load
    plain = build_profile([rank, rank], 2, cpu_pool=False)["device"]
    assert "node_cpu_cores" not in plain and "collective_cpu_costs" not in plain
    assert plain["peak_fp32_flops_per_s"] == pytest.approx(1e10) and plain["kernel_launch_s"] == pytest.approx(2e-5)
    assert plain["collective_call_s"] == pytest.approx(2e-4) and plain["fsdp2_call_host_s"] == pytest.approx(2e-3)
    assert plain["collective_costs"] == device["collective_costs"]


def test_at_load_scales_every_cpu_cost_and_the_prediction():
    """At a sharing factor 1.5x the calibration's (other jobs took cores) every CPU cost takes
    1.5x as long; the predicted step of this CPU-bound model follows (within the fixed parts)."""
    from hzpsim.validation.executor import at_load

    device = dataclasses.replace(get_device("cpu-local"), kernel_launch_s=1e-5, collective_call_s=1e-4,
                                 framework_host_s=(("fsdp2", "call_s", 2e-3),), collective_hop_delay_s=1e-3,
                                 collective_costs=COSTS)
    slow = at_load(device, 1.5)
    assert slow.peak_fp32_flops_per_s == pytest.approx(device.peak_fp32_flops_per_s / 1.5)
    assert slow.memory_bytes_per_s == pytest.approx(device.memory_bytes_per_s / 1.5)
    for field in ("kernel_launch_s", "collective_call_s", "collective_hop_delay_s"):
        assert getattr(slow, field) == pytest.approx(1.5 * getattr(device, field)), field
    assert slow.framework_cost_s("fsdp2", "call_s") == pytest.approx(1.5 * 2e-3)
    assert slow.framework_cost_s("dtensor", "op_s") is None  # not measured stays not measured
    assert [c[2:] for c in slow.collective_costs] == [pytest.approx((1.5 * c[2], 1.5 * c[3])) for c in COSTS]
    scenario = scenario_for_world(DEFAULT_SCENARIO, 4, _profile(fsdp2_call_host_s=2e-3, collective_costs=[list(c) for c in COSTS]),
                                  filters=["zero(stage=3)"])
    base = predicted_report(scenario, scenario.strategies[0])["step_time_s"]
    scenario.topology.device = at_load(scenario.topology.device, 1.5)
    assert predicted_report(scenario, scenario.strategies[0])["step_time_s"] == pytest.approx(1.5 * base, rel=0.02)


# ---------------------------------------------------------------------------- the CPU pool


def _pool_topology(cores, world=4, cpu_costs=()):
    """A local-cpu node of ``world`` ranks sharing ``cores`` (Device.node_cpu_cores), at unit
    rates so that a GEMM of ``peak`` FLOPs is one CPU second alone on a core."""
    topology = build_topology(ClusterSpec(preset="local-cpu", gpus_per_node=world, variability=0.0,
                                          variability_persistent=0.0))
    topology.device = dataclasses.replace(topology.device, node_cpu_cores=cores, collective_costs=COSTS,
                                          collective_cpu_costs=cpu_costs)
    return topology


def _unit():
    from hzpsim.hardware.compute import Efficiency

    return Efficiency(gemm=1.0, attention_forward=1.0, attention_backward=1.0, hbm=1.0, source="test: peak rates")


def _second(topology) -> dict[str, float]:
    return {"gemm": topology.device.peak_fp32_flops_per_s}


def test_the_pool_shares_a_nodes_cores_among_the_ranks_that_work():
    """Processor sharing, by hand: 4 ranks on 2 cores each start 1 CPU-second of work; ranks 0
    and 1 then have 1 s more. All four run at 2/4 until the first seconds end at 2 s; then two
    ranks have the 2 cores to themselves and end 1 s later, at 3 s (not at 4 s, as a fixed
    share of 1/2 a core would have it: a rank that waits leaves its share to the others)."""
    from hzpsim.model.ops import OpGraph
    from hzpsim.sim.engine import simulate

    topology = _pool_topology(2.0)
    graph = OpGraph(4, {0: 1, 1: 1, 2: 1, 3: 1}, "fp32")
    first = [graph.compute(r, f"a{r}", "forward", _second(topology)) for r in range(4)]
    second = [graph.compute(r, f"b{r}", "forward", _second(topology), deps=[first[r]]) for r in (0, 1)]
    trace = simulate(graph, topology, _unit())
    assert [trace.end_s[op] for op in first] == pytest.approx([2.0] * 4)
    assert [trace.end_s[op] for op in second] == pytest.approx([3.0, 3.0])


def test_the_pool_counts_a_simulated_rank_for_the_ranks_it_stands_for():
    """One simulated rank standing for 4 (a symmetric graph) demands 4 cores: on 2 cores its
    1 CPU-second takes 2 s, as when the 4 ranks are simulated one by one."""
    from hzpsim.model.ops import OpGraph
    from hzpsim.sim.engine import simulate

    topology = _pool_topology(2.0)
    graph = OpGraph(4, {0: 4}, "fp32")
    op = graph.compute(0, "a", "forward", _second(topology))
    assert simulate(graph, topology, _unit()).end_s[op] == pytest.approx(2.0)
    # more cores than work: alone speed (rate capped at 1)
    assert simulate(graph, _pool_topology(8.0), _unit()).end_s[op] == pytest.approx(1.0)


def test_a_collective_on_the_pool_runs_its_measured_time_and_slows_with_compute():
    """Two ranks on 1 core; each starts 1 CPU-second of compute and a 2-rank all-gather measured
    at 1 ms + 0.8 ns/B back to back, its backend threads using 1/2 of a core meanwhile (CPU
    0.5 x that time). Demand 1 + 1 (compute) + 1/2 + 1/2 (the call) = 3 on 1 core: everything
    at 1/3 until the call's work is done, then the compute at 1/2. A call alone on the node runs
    at its measured time: it is its floor."""
    from hzpsim.model.ops import OpGraph
    from hzpsim.sim.engine import simulate

    size = 1e6
    measured = 1e-3 + 8e-10 * size  # COSTS: the 2-rank all-gather row
    topology = _pool_topology(1.0, world=2, cpu_costs=(("all_gather", 2, 0.5 * measured, 0.0),))
    graph = OpGraph(2, {0: 1, 1: 1}, "fp32")
    group = graph.add_group("pair", [0, 1])
    ag = graph.collective("all_gather", group, [0, 1], size, "ag", "gather", "comm")
    work = [graph.compute(r, f"w{r}", "forward", _second(topology)) for r in (0, 1)]
    trace = simulate(graph, topology, _unit())
    call_end = measured * 3
    assert trace.end_s[ag] == pytest.approx(call_end)
    assert trace.end_s[work[0]] == pytest.approx(call_end + (1.0 - call_end / 3) * 2)
    assert trace.end_s[work[1]] == pytest.approx(trace.end_s[work[0]])
    alone = OpGraph(2, {0: 1, 1: 1}, "fp32")
    op = alone.collective("all_gather", alone.add_group("pair", [0, 1]), [0, 1], size, "ag", "gather", "comm")
    assert simulate(alone, topology, _unit()).end_s[op] == pytest.approx(measured)


def test_a_pooled_device_charges_the_cpu_work_instead_of_the_hop_delay():
    topology = _pool_topology(2.0, cpu_costs=(("reduce_scatter", 4, 1e-3, 2e-9),))
    topology.device = dataclasses.replace(topology.device, collective_hop_delay_s=1e-3)
    plan = CollectiveModel(topology).plan("reduce_scatter", 1e6, topology.span([0, 1, 2, 3]))
    assert plan.latency_s == pytest.approx(5e-3)  # the measured time, no hops
    assert plan.cpu_s == pytest.approx(1e-3 + 2e-9 * 1e6)
    assert plan.isolated_time_s == pytest.approx(5e-3 + 4e-9 * 1e6)
    assert plan.repeated(3).cpu_s == pytest.approx(3 * plan.cpu_s)
    assert plan.stretched(2.0).cpu_s == pytest.approx(plan.cpu_s)


def test_at_load_shrinks_the_pool_and_keeps_the_cpu_costs():
    """With a CPU pool the costs are CPU seconds alone on a core: a run at 1.5x the
    calibration's sharing factor has 1/1.5 of the cores, and nothing else changes."""
    from hzpsim.validation.executor import at_load

    device = dataclasses.replace(get_device("cpu-local"), kernel_launch_s=1e-5, node_cpu_cores=1.9,
                                 collective_costs=COSTS, collective_cpu_costs=COSTS)
    slow = at_load(device, 1.5)
    assert slow.node_cpu_cores == pytest.approx(1.9 / 1.5)
    assert dataclasses.replace(slow, node_cpu_cores=1.9) == device


def test_the_artificial_delay_is_a_wait_on_a_pooled_device_and_host_time_otherwise():
    """``--comm-delay``: the executor sleeps before each call. A sleep uses no core, so with a
    CPU pool it joins each call's wait; without one it stays a per-call host cost."""
    rows = [list(c) for c in COSTS]
    pooled = scenario_for_world(DEFAULT_SCENARIO, 4, _profile(node_cpu_cores=1.9, collective_costs=rows),
                                comm_delay_s=0.02, filters=["zero(stage=3)"]).topology.device
    assert pooled.collective_call_s == pytest.approx(1e-4)
    assert [c[2] for c in pooled.collective_costs] == pytest.approx([c[2] + 0.02 for c in COSTS])
    plain = scenario_for_world(DEFAULT_SCENARIO, 4, _profile(collective_costs=rows), comm_delay_s=0.02,
                               filters=["zero(stage=3)"]).topology.device
    assert plain.collective_call_s == pytest.approx(1e-4 + 0.02)
    assert plain.collective_costs == COSTS
