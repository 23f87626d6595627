"""MoE layers as the frameworks run them: dispatchers, overlap, load imbalance, the named parts of
the step (strategies/_moe.py, docs/moe.md)."""

from __future__ import annotations

import math

import pytest

from hzpsim import strategies
from hzpsim.cli import main
from hzpsim.run import run_choice
from hzpsim.scenario import scenario_from_mapping
from hzpsim.sim.engine import simulate
from hzpsim.strategies import _moe, nd
from hzpsim.strategies._dims import ParallelDims
from hzpsim.strategies._sharded import Emitter


def mixtral(gpus_per_node: int = 8, **strategy):
    """Mixtral-8x7B on 64 H100 with EP 8: inside a node on 8-GPU nodes, across two on 4-GPU nodes."""
    cluster = {"preset": "dgx-h100", "num_nodes": 64 // gpus_per_node}
    if gpus_per_node != 8:
        cluster["gpus_per_node"] = gpus_per_node
    return scenario_from_mapping({
        "model": "mixtral-8x7b", "training": {"global_batch_size": 256},
        "cluster": cluster,
        "strategy": {"name": "nd", "pp": 4, "ep": 8, "zero_stage": 1, "moe_dispatcher": "alltoall", **strategy},
    })


def report(sc):
    return run_choice(sc, sc.strategies[0])


def exposed_ep_s(r) -> float:
    return sum(v for k, v in r["time_breakdown_s"].items() if k.startswith("exposed.ep"))


@pytest.fixture(scope="module")
def runs():
    out = {}
    for gpn in (8, 4):
        for dispatcher in ("alltoall", "deepep"):
            out[gpn, dispatcher] = report(mixtral(gpn, moe_dispatcher=dispatcher))
    return out


def test_deepep_beats_alltoall_across_nodes_and_gains_less_inside_one(runs):
    across = exposed_ep_s(runs[4, "deepep"]), exposed_ep_s(runs[4, "alltoall"])
    assert across[0] < across[1]
    gain = {gpn: 1 - runs[gpn, "deepep"]["step_time_s"] / runs[gpn, "alltoall"]["step_time_s"] for gpn in (8, 4)}
    assert gain[4] > 0
    assert gain[8] < gain[4]


def test_breakdown_and_explain_name_the_moe_parts(runs, capsys, tmp_path):
    keys = runs[4, "alltoall"]["time_breakdown_s"]
    assert any("dispatch" in k for k in keys) and any("combine" in k for k in keys)
    for part in ("moe_router", "moe_permute", "moe_grouped_gemm"):
        assert f"compute.{part}" in keys, part
    path = tmp_path / "mix.yaml"
    path.write_text("model: mixtral-8x7b\ntraining: {global_batch_size: 64}\n"
                    "cluster: {preset: dgx-h100, num_nodes: 2}\n"
                    "strategy: {name: nd, ep: 8, moe_dispatcher: alltoall}\n")
    assert main(["run", str(path), "--explain"]) == 0
    out = capsys.readouterr().out
    for word in ("ep_dispatch", "ep_combine", "moe_grouped_gemm", "moe_router", "moe_permute"):
        assert word in out, word


def test_imbalance_one_is_the_balanced_case_exactly():
    base = mixtral()
    graph = nd.build(base.strategies[0].config, base.model, base.training, base.topology)
    explicit = mixtral(moe_imbalance=1.0)
    again = nd.build(explicit.strategies[0].config, explicit.model, explicit.training, explicit.topology)
    assert [(o.name, o.flops, o.bytes_accessed) for o in graph.ops] == [(o.name, o.flops, o.bytes_accessed) for o in again.ops]
    # the balanced closed form: each rank's one expert (E/ep = 1) runs T·k/ep·ep = T·k/... copies
    m = base.model
    tokens = m.seq_len  # micro-batch 1, no TP / CP
    per_rank_copies = tokens * m.moe.top_k  # every rank sends T·k copies and, balanced, receives as many
    flops = 2 * per_rank_copies * 3 * m.hidden_size * m.moe.expert_ffn_hidden_size
    experts = next(o for o in graph.ops if o.name.startswith("fwd.experts.") and o.step == 0)
    assert sum(f for _, f in experts.flops) == pytest.approx(flops, rel=1e-12)


def test_higher_imbalance_never_makes_a_step_faster():
    steps = [report(mixtral(4, moe_imbalance=x))["step_time_s"] for x in (1.0, 1.1, 1.3, 2.0)]
    assert steps == sorted(steps)
    assert steps[-1] > steps[0]


def test_imbalance_scales_the_busiest_ranks_exchange_and_a_capacity_factor_caps_it():
    base = ParallelDims(ep=8, moe_imbalance=1.5)
    assert base.moe_load == 1.5
    assert ParallelDims(ep=8, moe_imbalance=1.5, moe_capacity_factor=1.25).moe_load == 1.25
    assert ParallelDims(ep=8, moe_imbalance=1.1, moe_capacity_factor=1.25, moe_pad_to_capacity=True).moe_load == 1.25
    assert ParallelDims(ep=1, moe_imbalance=1.5).moe_load == 1.0  # one rank runs every expert on its own tokens
    sc = mixtral()
    balanced, _ = _moe.dispatch(sc.model, 4096, 2, ParallelDims(ep=8))
    skewed, _ = _moe.dispatch(sc.model, 4096, 2, base)
    assert skewed == pytest.approx(1.5 * balanced)


def test_dispatchers_move_what_the_frameworks_move():
    model = mixtral().model
    h, k, t = model.hidden_size, model.moe.top_k, 4096
    copies, kinds = _moe.dispatch(model, t, 2, ParallelDims(ep=8, moe_dispatcher="alltoall"))
    assert copies == t * k * h * 2 and kinds == ("all_to_all", "all_to_all")
    gathered, kinds = _moe.dispatch(model, t, 2, ParallelDims(ep=8, moe_dispatcher="allgather"))
    assert gathered == 8 * t * h * 2 and kinds == ("all_gather", "reduce_scatter")
    deep, _ = _moe.dispatch(model, t, 2, ParallelDims(ep=8, moe_dispatcher="deepep", ep_nodes=2))
    # E = 8, top-2, 2 nodes of 4 experts: a token reaches the other node with probability
    # 1 - C(4,2)/C(8,2) = 22/28 and sends it k/2 = 1 copy on average with all-to-all
    assert deep == pytest.approx(copies * (22 / 28) / 1.0)
    assert _moe.node_dedup(8, 2, 1) == 1.0
    assert _moe.node_dedup(256, 8, 8) == pytest.approx(7 * (1 - math.comb(224, 8) / math.comb(256, 8)) / 7)


def test_overlap_hides_the_exchanges():
    plain, hidden = report(mixtral(4, vpp=2)), report(mixtral(4, vpp=2, moe_ep_overlap=True))
    assert exposed_ep_s(hidden) < exposed_ep_s(plain)
    assert hidden["step_time_s"] < plain["step_time_s"]


def test_the_combined_schedule_runs_its_first_forward_and_last_backward_alone():
    """Megatron-Core's combined 1F1B pairs each forward with another micro-batch's backward;
    the first forward and the last backward (without pipelining), the warm-up forwards and the
    cool-down backwards (interleaved, one warm-up forward more) run alone, their exchanges
    exposed (combined_1f1b.py, schedules.py::get_pp_rank_microbatches)."""
    from hzpsim.strategies._nd_layout import paired, pipeline_actions, pipeline_warmup

    assert pipeline_warmup(8, 4, 128, 0, True) == (8 - 0 - 1) * 2 + (4 - 1) * 8 + 1
    assert pipeline_warmup(8, 4, 128, 7, False) == (4 - 1) * 8
    assert pipeline_actions(1, 1, 3, 0, True) == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1),
                                                  ("B", 0, 2)]
    assert paired(1, 1, 3, 0, True) == [False, True, True, True, True, False]
    assert not any(paired(1, 1, 3, 0, False))

    sc = mixtral(8, pp=1, moe_ep_overlap=True)  # 4 micro-batches per replica
    graph = nd.build(sc.strategies[0].config, sc.model, sc.training, sc.topology)
    lane = graph.ops[0].ranks[0]
    exchanges = [o for o in graph.ops if o.category in ("ep_dispatch", "ep_combine") and o.step == 0
                 and lane in o.ranks]
    alone = [o for o in exchanges if o.stream == "compute"]
    layers = sc.model.num_layers
    # the first forward's and the last backward's dispatch and combine, in every layer
    assert len(alone) == 2 * 2 * layers and len(exchanges) == 4 * 2 * 2 * layers
    assert sum(".bwd." in o.name for o in alone) == 2 * layers


def test_megatron_core_defaults_to_its_allgather_dispatcher_and_nemo_recipes_to_alltoall():
    sc = scenario_from_mapping({
        "model": "tiny-moe", "training": {"global_batch_size": 32},
        "cluster": {"preset": "dgx-h100", "num_nodes": 1}, "strategy": {"name": "nd", "ep": 4}})
    graph = nd.build(sc.strategies[0].config, sc.model, sc.training, sc.topology)
    assert {o.collective for o in graph.ops if o.category == "ep_dispatch"} == {"all_gather", "reduce_scatter"}
    bridge = scenario_from_mapping({
        "model": "tiny-moe", "training": {"global_batch_size": 32},
        "cluster": {"preset": "dgx-h100", "num_nodes": 1},
        "strategy": {"name": "nd", "ep": 4, "implementation": "megatron-bridge"}})
    graph = nd.build(bridge.strategies[0].config, bridge.model, bridge.training, bridge.topology)
    assert {o.collective for o in graph.ops if o.category == "ep_dispatch"} == {"all_to_all"}
    r = report(bridge)
    assert r["strategy_resolved"]["moe_dispatcher"] == "alltoall"


def test_megatron_core_shards_experts_over_tp_unless_told_and_the_recipes_do_not():
    """Megatron-Core's ModelParallelConfig sets an unset expert_tensor_parallel_size to the TP
    size; the Megatron-Bridge MoE recipes set 1. ``strategy_resolved`` and the label say which,
    and an explicit ``etp`` wins."""
    def run(**strategy):
        sc = scenario_from_mapping({
            "model": "tiny-moe", "training": {"global_batch_size": 32},
            "cluster": {"preset": "dgx-h100", "num_nodes": 1},
            "strategy": {"name": "nd", "tp": 2, "ep": 2, "sequence_parallel": True, **strategy}})
        graph = nd.build(sc.strategies[0].config, sc.model, sc.training, sc.topology)
        return report(sc), {o.category for o in graph.ops}

    core, core_ops = run()
    bridge, bridge_ops = run(implementation="megatron-bridge")
    told, told_ops = run(etp=1)
    assert core["strategy_resolved"]["etp"] == 2 and "etp" in core_ops
    assert bridge["strategy_resolved"]["etp"] == 1 and "etp" not in bridge_ops
    assert told["strategy_resolved"]["etp"] == 1 and "etp" not in told_ops
    # the experts' weights split over the expert-TP group: fewer parameter bytes per rank
    assert core["memory_breakdown_bytes"]["params"] < told["memory_breakdown_bytes"]["params"]
    labels = [strategies.label(r["strategy_resolved"]) for r in (core, told, bridge)]
    assert "etp" not in labels[0] and "etp=1" in labels[1] and "etp" not in labels[2], labels


def test_the_search_writes_the_experts_tp_out_for_moe_models_only():
    from hzpsim.search.space import Space

    moe = scenario_from_mapping({"model": "tiny-moe", "training": {"global_batch_size": 32},
                                 "cluster": {"preset": "dgx-h100", "num_nodes": 1}, "strategy": {"name": "nd"}})
    dense = scenario_from_mapping({"model": "tiny-dense", "training": {"global_batch_size": 32},
                                   "cluster": {"preset": "dgx-h100", "num_nodes": 1}, "strategy": {"name": "nd"}})
    space = Space(tp=(1, 2), pp=(1,), vpp=(1,), ep=(1, 2), zero_stage=(1,), sequence_parallel=(False, True))
    layouts = nd.layouts(moe.model, moe.training, moe.topology, space)
    assert {f["etp"] for f in layouts} == {1}
    # a search row's label (its fields, without the implementation) names etp only where the
    # default profile (megatron-core: etp = tp) would not give it
    assert {("etp=1" in nd.label({"name": "nd", **f})) for f in layouts if f["tp"] == 1} == {False}
    assert {("etp=1" in nd.label({"name": "nd", **f})) for f in layouts if f["tp"] == 2 and f["ep"] == 2} == {True}
    wider = Space(**{**space.__dict__, "etp": (1, 2)})
    assert {f["etp"] for f in nd.layouts(moe.model, moe.training, moe.topology, wider)} == {1, 2}
    assert all("etp" not in f for f in nd.layouts(dense.model, dense.training, dense.topology, space))


@pytest.mark.parametrize("strategy, model, key", [
    ({"ep": 4, "moe_dispatcher": "nccl"}, "tiny-moe", "moe_dispatcher"),
    ({"ep": 4, "moe_imbalance": 0.9}, "tiny-moe", "moe_imbalance"),
    ({"ep": 3}, "tiny-moe", "ep"),
    ({"ep": 4, "moe_capacity_factor": 0}, "tiny-moe", "moe_capacity_factor"),
    ({"ep": 4, "moe_pad_to_capacity": True}, "tiny-moe", "moe_pad_to_capacity"),
    # what Megatron-Core asserts before its combined 1F1B (transformer_config.py)
    ({"ep": 1, "moe_ep_overlap": True}, "tiny-moe", "moe_ep_overlap: needs expert parallelism"),
    ({"ep": 4, "moe_ep_overlap": True, "moe_dispatcher": "allgather"}, "tiny-moe", "moe_ep_overlap: needs the alltoall"),
    ({"ep": 4, "pp": 2, "moe_ep_overlap": True, "moe_dispatcher": "alltoall"}, "tiny-moe",
     "moe_ep_overlap: needs an interleaved pipeline"),
    # megatron-core's etp defaults to tp: ep 4 x etp 2 does not fit a stage of 4 ranks; the message says why
    ({"tp": 2, "ep": 4, "pp": 2, "sequence_parallel": True}, "tiny-moe", "etp unset: megatron-core's default"),
    ({}, {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "ffn_hidden_size": 128, "vocab_size": 64,
          "seq_len": 64, "moe": {"num_experts": 4, "top_k": 8, "expert_ffn_hidden_size": 64}}, "top_k"),
])
def test_bad_moe_input_exits_2_naming_the_key(tmp_path, capsys, strategy, model, key):
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"model": model, "training": {"global_batch_size": 32},
                                    "cluster": {"preset": "dgx-h100", "num_nodes": 1},
                                    "strategy": {"name": "nd", **strategy}}))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err, err


@pytest.mark.parametrize("training", [{"activation_recompute": "full"},
                                      {"activation_recompute": "selective", "recompute_modules": ["moe"]}])
def test_the_ep_overlap_refuses_full_or_moe_recompute(tmp_path, capsys, training):
    """Megatron-Core asserts no full and no ``moe`` recomputation under its combined 1F1B
    (transformer_config.py); hzpsim exits 2 naming moe_ep_overlap, and runs the same layout
    without that recompute."""
    import yaml

    scenario = {"model": "tiny-moe", "training": {"global_batch_size": 32, **training},
                "cluster": {"preset": "dgx-h100", "num_nodes": 1},
                "strategy": {"name": "nd", "ep": 4, "moe_ep_overlap": True, "moe_dispatcher": "alltoall"}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(scenario))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "moe_ep_overlap: Megatron-Core refuses it with full or moe recomputation" in err, err
    path.write_text(yaml.safe_dump({**scenario, "training": {"global_batch_size": 32}}))
    assert main(["run", str(path)]) == 0


def test_a_trace_of_an_moe_step_simulates(runs):
    sc = mixtral(4, vpp=2, moe_dispatcher="deepep", moe_ep_overlap=True)
    graph = nd.build(sc.strategies[0].config, sc.model, sc.training, sc.topology)
    trace = simulate(graph, sc.topology)
    assert max(trace.end_s) > 0


@pytest.mark.parametrize("gpus_per_node", [8, 4])
def test_search_bounds_stay_below_the_simulated_moe_step(gpus_per_node):
    """The search's step-time and memory bounds follow the MoE mechanisms: never above what the
    simulator reports, for every dispatcher, with and without overlap and recompute."""
    from hzpsim import search as S

    sc = mixtral(gpus_per_node)
    bounder = S.Bounder(sc)
    ratios = []
    for dispatcher in ("alltoall", "allgather", "deepep"):
        for overlap in (False, True) if dispatcher != "allgather" else (False,):
            # Megatron-Core's combined 1F1B needs interleaving and refuses full recomputation
            for pp, vpp, rc in ((4, 2, "none"), (2, 2, "selective")) if overlap else ((4, 1, "none"), (2, 1, "full")):
                fields = {"tp": 1, "pp": pp, "vpp": vpp, "cp": 1, "ep": 8, "zero_stage": 1, "sequence_parallel": False,
                          "moe_dispatcher": dispatcher, "moe_ep_overlap": overlap}
                candidate = S.Candidate("nd", tuple(sorted(fields.items())), 1, rc)
                result = S.evaluate(sc, candidate)
                report = result["report"]
                b = bounder(candidate, refine=True)
                assert b.step_time_s <= report["step_time_s"] * (1 + 1e-9), (candidate.label(), b, report["step_time_s"])
                assert b.memory_bytes <= report["peak_memory_allocated_bytes"] * (1 + 1e-9), candidate.label()
                ratios.append(b.step_time_s / report["step_time_s"])
    assert sum(ratios) / len(ratios) > 0.8, ratios  # and close enough to prune


def test_search_bounds_count_the_sharded_experts_collectives():
    """Under ZeRO-2/3 the expert parameters gather and reduce-scatter over their own
    expert-data-parallel group every micro-batch (most of Mixtral's bytes): the ND and ZeRO
    family bounds count them (DPUnit.with_experts) and stay below the simulated step, within
    20 % (without them the ND bound was 34-47 % of the step at ZeRO-3, AsyncHZP's 69 %)."""
    from hzpsim import search as S

    sc = mixtral(8)
    bounder = S.Bounder(sc)
    for zero, tp, pp, ep in ((3, 2, 4, 4), (3, 1, 2, 8), (2, 2, 2, 2), (2, 1, 4, 2)):
        fields = {"tp": tp, "pp": pp, "vpp": 1, "cp": 1, "ep": ep, "zero_stage": zero, "sequence_parallel": tp > 1}
        candidate = S.Candidate("nd", tuple(sorted(fields.items())), 1, "none")
        simulated = S.evaluate(sc, candidate)["report"]["step_time_s"]
        b = bounder(candidate, refine=True).step_time_s
        assert 0.8 * simulated < b <= simulated * (1 + 1e-9), (candidate.label(), b, simulated)
    # the ZeRO family shards the experts over the expert world likewise (_family_bound)
    checked: list[str] = []
    for candidate in S.enumerate_candidates(sc, ["zero", "asynchzp"], S.default_space(sc)):
        if (S.check(sc, candidate) is not None or candidate.micro_batch_size != 1
                or candidate.activation_recompute != "none" or "stage=1" in candidate.label()):
            continue
        report = S.evaluate(sc, candidate).get("report")  # None: its resident states do not fit
        if report is None:
            continue
        checked.append(candidate.label())
        simulated, b = report["step_time_s"], bounder(candidate).step_time_s
        assert 0.8 * simulated < b <= simulated * (1 + 1e-9), (candidate.label(), b, simulated)
    assert len(checked) >= 3, checked


def test_sequential_experts_are_never_faster_than_one_grouped_gemm():
    grouped = report(mixtral(4, moe_grouped_gemm=True, ep=2))
    sequential = report(mixtral(4, moe_grouped_gemm=False, ep=2))
    gg = grouped["time_breakdown_s"]["compute.moe_grouped_gemm"]
    seq = sequential["time_breakdown_s"]["compute.moe_grouped_gemm"]
    assert seq >= gg
    assert grouped["strategy_resolved"]["moe_grouped_gemm"] is True


def test_expert_tensor_parallelism_gathers_the_tokens_and_keeps_each_ranks_flops():
    # etp ranks share an expert's weights: each runs etp x the copies on 1/etp of the weights
    # (Megatron-Core's gather over the expert-TP group after the all-to-all), so per-rank expert
    # FLOPs equal the etp = 1 case, and the gather / reduce-scatter appear around the experts
    def build(etp):
        sc = mixtral(8, ep=4, etp=etp, pp=2)
        return nd.build(sc.strategies[0].config, sc.model, sc.training, sc.topology)

    plain, split = build(1), build(2)

    def expert_flops(graph):
        op = next(o for o in graph.ops if o.name.startswith("fwd.experts.") and o.step == 0)
        return sum(f for _, f in op.flops)

    assert expert_flops(split) == pytest.approx(expert_flops(plain), rel=1e-12)
    kinds = sorted({o.collective for o in split.ops if o.category == "etp" and o.step == 0})
    assert kinds == ["all_gather", "reduce_scatter"]
    assert not any(o.category == "etp" for o in plain.ops)


def test_unfused_permutation_costs_the_measured_multiples_and_profiles_choose_it():
    """Megatron-Core's and torchtitan's eager permutation (``moe_permute_fusion`` False) charges
    the H200-measured multiples of the fused kernels' bytes; the NeMo recipes run it fused."""
    fused = report(mixtral(4, moe_permute_fusion=True, ep=2))
    eager = report(mixtral(4, moe_permute_fusion=False, ep=2))
    f = fused["time_breakdown_s"]["compute.moe_permute"]
    e = eager["time_breakdown_s"]["compute.moe_permute"]
    multiple = sum(_moe.UNFUSED_PERMUTE) / 4  # forward and backward of permute and un-permute, equal bytes each
    assert e / f == pytest.approx(multiple, rel=0.05)
    assert eager["step_time_s"] > fused["step_time_s"]
    # unset, the profile decides what is simulated (mixtral() runs megatron-core: eager)
    assert report(mixtral(4, ep=2))["step_time_s"] == eager["step_time_s"]
    resolved = {}
    for impl in ("megatron-core", "megatron-bridge", "torchtitan"):
        sc = scenario_from_mapping({
            "model": "tiny-moe", "training": {"global_batch_size": 32}, "cluster": {"preset": "dgx-h100", "num_nodes": 1},
            "strategy": {"name": "nd", "ep": 4, "implementation": impl}})
        resolved[impl] = report(sc)["strategy_resolved"]["moe_permute_fusion"]
    assert resolved == {"megatron-core": False, "megatron-bridge": True, "torchtitan": False}


def test_the_host_waits_for_the_routers_counts_before_each_dispatch(monkeypatch):
    """Megatron-Core's alltoall dispatcher and torchtitan's both copy the token counts to the
    host before calling the exchange (``cuda_sync_point``; ``.tolist()``): one host op per MoE
    layer forward that waits for the router, after the permutation's launch. On a host-bound
    eager profile (torchtitan, Qwen3-30B-A3B with EP 8 on one node) it makes the step slower:
    the host can no longer run ahead of the device."""
    sc = mixtral(pp=1, ep=8)
    graph = nd.build(sc.strategies[0].config, sc.model, sc.training, sc.topology)
    ops = {op.id: op for op in graph.ops}
    syncs = [op for op in graph.ops if op.name.startswith("host.sync.moe_splits")]
    lane = next(iter(graph.weights))
    micro_batches = sc.training.global_batch_size // (sc.training.micro_batch_size * 64)  # data-parallel 64
    steps = sc.training.num_steps
    assert len([op for op in syncs if op.ranks == (lane,)]) == sc.model.num_layers * micro_batches * steps
    assert all(any(ops[d].name.startswith("fwd.router") for d in op.deps) for op in syncs)

    qwen = scenario_from_mapping({"model": "qwen3-30b-a3b", "training": {"global_batch_size": 64},
                                  "cluster": {"preset": "dgx-h100", "num_nodes": 1},
                                  "strategy": {"name": "nd", "ep": 8, "implementation": "torchtitan"}})
    synced = report(qwen)["step_time_s"]
    host = Emitter.host

    def without_the_sync(self, name, seconds, step, sync=()):
        return None if name.startswith("sync.moe_splits") else host(self, name, seconds, step, sync)

    monkeypatch.setattr(Emitter, "host", without_the_sync)
    assert synced > 1.02 * report(qwen)["step_time_s"]
