"""ND parallelism against closed forms: pipeline bubble, TP/CP/EP bytes, per-stage activations."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import assert_symmetry_matches_expansion

from hzpsim.cli import run_choice
from hzpsim.config import ScenarioError
from hzpsim.hardware import collectives
from hzpsim.scenario import scenario_from_mapping
from hzpsim.sim.engine import simulate
from hzpsim.strategies import _sharded, nd
from hzpsim.strategies._layers import Work

GPT = {  # GPT-style (MHA, GELU, ffn = 4h, dropout): Korthikanti's 34 sbh per layer holds exactly
    "name": "gpt-test", "num_layers": 16, "hidden_size": 1024, "num_heads": 16, "ffn_hidden_size": 4096,
    "vocab_size": 128, "seq_len": 2048, "mlp": "gelu", "norm": "layernorm", "linear_bias": True,
    "position_embedding": "learned",
}
FREE_LINKS = {
    "intra_node_bytes_per_s": 1e18, "inter_node_bytes_per_s_per_device": 1e18, "inter_island_bytes_per_s": 1e18,
    "intra_node_latency_s": 0.0, "inter_node_latency_s": 0.0, "inter_island_latency_s": 0.0,
    "variability": 0.0, "variability_persistent": 0.0,  # no waiting for stragglers either: the closed forms assume none
}


def scenario(strategy: dict, nodes: int = 1, model=None, cluster=None, **training):
    return scenario_from_mapping({
        "model": model or GPT,
        "training": {"global_batch_size": 16, **training},
        "cluster": {"preset": "dgx-h100", "num_nodes": nodes, **(cluster or {})},
        "strategy": {"name": "nd", **strategy},
    })


def trace_of(sc):
    topo = sc.topology
    graph = nd.build(sc.strategies[0].config, sc.model, sc.training, topo)
    return graph, simulate(graph, topo)


@pytest.fixture
def uniform_free(monkeypatch):
    """The closed form's conditions: communication free (no NCCL base latency here, free links
    in the scenario) and uniform stages (embedding, head and optimizer made free of work)."""
    monkeypatch.setattr(collectives, "_BASE_LATENCY_S", {"ring": (0.0,) * 3, "tree": (0.0,) * 3})
    real_units = nd.mp_units

    def layers_only(*args, **kwargs):
        units = real_units(*args, **kwargs)
        empty = Work()
        for i in (0, -1):
            units[i] = dataclasses.replace(units[i], pre=empty, post=empty, backward=empty)
        return units

    monkeypatch.setattr(nd, "mp_units", layers_only)
    monkeypatch.setattr(_sharded, "optimizer_bytes_per_param", lambda training: 0.0)


@pytest.mark.parametrize("pp,vpp,m", [(4, 1, 16), (8, 1, 8), (4, 2, 8), (2, 4, 4)])
def test_bubble_matches_closed_form_when_communication_is_free(uniform_free, pp, vpp, m):
    dp = 8 // pp
    sc = scenario({"pp": pp, "vpp": vpp}, cluster=FREE_LINKS, micro_batch_size=8,
                  global_batch_size=8 * m * dp)
    report = run_choice(sc, sc.strategies[0])
    expected = (pp - 1) / (vpp * m + pp - 1)  # SC'21 §2.2; DESIGN §5 bubble_fraction
    assert report["bubble_fraction"] == pytest.approx(expected, rel=0.01)


def test_pipeline_stage_zero_holds_p_micro_batches_of_activations():
    # TP2 + SP + selective recompute: Korthikanti Table 2, 34 sbh / t per layer; stage 0 of a
    # 1F1B pipeline keeps p micro-batches of its L/p layers = L layers' worth.
    sc = scenario({"tp": 2, "pp": 4, "sequence_parallel": True}, activation_recompute="selective")
    report = run_choice(sc, sc.strategies[0])
    s, b, h, t, L, heads = 2048, 1, 1024, 2, 16, 16
    per_layer = (34 * s * b * h + 4 * heads * s * b) / t  # + flash's fp32 log-sum-exp
    assert report["memory_breakdown_bytes"]["activations"] == pytest.approx(L * per_layer, rel=1e-9)


def test_tp_bytes_per_layer_per_micro_batch():
    sc = scenario({"tp": 4})
    graph, trace = trace_of(sc)
    s, b, h, t, L = 2048, 1, 1024, 4, 16
    m = 16 // 2  # dp = 2
    last = sc.training.num_steps - 1
    ops = [op for op in graph.ops if op.category == "tp" and op.step == last and 0 in op.ranks]
    # Megatron: 2 all-reduces per layer forward (attention, MLP) and 2 backward, plus the
    # embedding's forward and the head's backward; an op with count k stands for k back to back
    assert sum(op.count for op in ops) == m * (4 * L + 2)
    tp = sum(sum(trace.plans[op.id].bytes_by_level.values()) for op in ops)  # plans include the count
    per_all_reduce = 2 * (t - 1) / t * b * s * h * 2  # ring all-reduce of b·s·h bf16
    # layers: 8·b·s·h·(t−1)/t elements each (4 all-reduces); embedding fwd + head bwd: 1 each
    expected = m * (L * 8 * b * s * h * (t - 1) / t * 2 + 2 * per_all_reduce)
    assert tp == pytest.approx(expected, rel=1e-12)


def test_sequence_parallel_moves_the_same_tp_bytes_and_less_activation():
    """Each TP all-reduce becomes an all-gather + reduce-scatter pair of the same volume; SP adds
    one all-reduce per step of the norm gradients over the TP group (Megatron's
    _allreduce_layernorm_grads): per layer the 2 LayerNorms and the 2 row-parallel biases
    (h each), plus the final norm, fp32 gradients, ring all-reduce 2(t-1)/t per rank."""
    plain = run_choice(*(lambda sc: (sc, sc.strategies[0]))(scenario({"tp": 4})))
    sc = scenario({"tp": 4, "sequence_parallel": True})
    sp = run_choice(sc, sc.strategies[0])
    model, t = sc.model, 4
    params = model.num_layers * (model.norm_params_per_layer() + 2 * model.hidden_size) + model.final_norm_params()
    norm_grads = params * 4 * 2 * (t - 1) / t
    assert sp["comm_bytes_per_device"]["intra_node"] == pytest.approx(plain["comm_bytes_per_device"]["intra_node"]
                                                                      + norm_grads, rel=1e-12)
    assert sp["memory_breakdown_bytes"]["activations"] < plain["memory_breakdown_bytes"]["activations"]


def test_cp_ring_bytes_per_layer():
    model = {**GPT, "num_kv_heads": 4}  # GQA shrinks the K/V chunks
    sc = scenario({"cp": 4}, model=model)
    graph, trace = trace_of(sc)
    last = sc.training.num_steps - 1
    c, s, b, kv, d, L = 4, 2048, 1, 4, 64, 16
    m = 16 // 2
    fwd = (c - 1) * 2 * (s / c) * b * kv * d * 2  # strategies.md §2.7.4, t = 1
    got = sum(sum(trace.plans[op.id].bytes_by_level.values())
              for op in graph.ops if op.category == "cp" and op.step == last and 0 in op.ranks)
    assert got == pytest.approx(m * L * 3 * fwd, rel=1e-12)  # backward moves twice the forward


def test_ep_all_to_all_bytes_per_moe_layer():
    sc = scenario({"ep": 4, "moe_dispatcher": "alltoall"}, model="tiny-moe", global_batch_size=32)
    graph, trace = trace_of(sc)
    model = sc.model
    last = sc.training.num_steps - 1
    e, k, h, T = 4, model.moe.top_k, model.hidden_size, model.seq_len
    m = 32 // 8
    per_a2a = T * k * h * 2 * (e - 1) / e  # strategies.md §2.8 EP row
    got = sum(sum(trace.plans[op.id].bytes_by_level.values())
              for op in graph.ops if op.category.startswith("ep_") and op.step == last and 0 in op.ranks)
    assert got == pytest.approx(m * model.num_moe_layers * 4 * per_a2a, rel=1e-12)


def test_uneven_stages_and_interleaving_layouts():
    assert nd.stage_layers(30, 4, 1, None, None) == (7, 8, 8, 7)
    assert nd.stage_layers(30, 4, 1, 6, 6) == (6, 9, 9, 6)
    assert nd.stage_layers(16, 4, 2, None, None) == (2,) * 8
    with pytest.raises(ValueError):
        nd.stage_layers(30, 4, 1, 5, 6)
    sc = scenario({"pp": 4, "first_stage_layers": 2, "last_stage_layers": 2})
    graph, _ = trace_of(sc)
    # stages of 2, 6, 6, 2 of the 16 layers: the first also runs the embedding, the last the head
    held = {rank: [op.name.split(".")[1] for op in graph.ops
                   if op.kind == "compute" and op.category == "forward" and op.step == 0
                   and op.ranks == (rank,) and op.name.endswith(".mb0")]
            for rank in (0, 2, 4, 6)}  # one representative per stage (tp = 1, dp = 2: ranks 0,2,4,6)
    layers = [f"layer{i}" for i in range(16)]
    assert held == {0: ["embed", *layers[0:2]], 2: layers[2:8], 4: layers[8:14], 6: [*layers[14:16], "head"]}


def test_1f1b_schedule_counts_and_warmup():
    for rank in range(4):
        actions = nd.pipeline_actions(4, 1, 8, rank)
        assert [a[0] for a in actions].count("F") == 8 and [a[0] for a in actions].count("B") == 8
        assert [a[0] for a in actions[: 4 - rank]] == ["F"] * (4 - rank)
    inter = nd.pipeline_actions(4, 2, 8, 0)
    assert sorted((c, mb) for kind, c, mb in inter if kind == "F") == [(c, mb) for c in range(2) for mb in range(8)]


def test_symmetry_matches_expansion_for_a_3d_layout():
    sc = scenario({"tp": 2, "pp": 2, "zero_stage": 1}, nodes=1, global_batch_size=8)
    assert_symmetry_matches_expansion(sc)


@pytest.mark.parametrize("strategy,match", [
    ({"tp": 3}, "tp: tp x pp x cp"),
    ({"tp": 2, "pp": 2, "dp": 3}, "dp: tp x pp x dp x cp"),
    ({"tp": 8, "pp": 1}, "strategy.tp: 8 does not divide model.num_kv_heads 4"),
    ({"pp": 4, "vpp": 2}, "vpp: interleaving needs"),
    ({"ep": 2}, "ep: expert parallelism needs an MoE model"),
    ({"vpp": 2}, "vpp: interleaving needs pp > 1"),
])
def test_invalid_layouts_name_the_field(strategy, match):
    model = {**GPT, "num_kv_heads": 4} if strategy.get("tp") == 8 else GPT
    with pytest.raises(ScenarioError, match=match):
        scenario(strategy, model=model, global_batch_size=20 if strategy.get("vpp") == 2 and strategy.get("pp") else 16)


def test_fsdp_with_tp_shards_each_tensor_parallel_shard_over_dp():
    # zero_stage 3 = FSDP + TP as torchtitan composes them: each TP shard's parameters are
    # sharded again over the dp group and gathered per unit per micro-batch
    sc = scenario({"tp": 2, "zero_stage": 3})
    graph, trace = trace_of(sc)
    psi_tp = sum(u for u in [sc.model.num_params()]) / 2
    static = graph.static_memory[0]
    dp = 4
    assert static["optimizer"] == pytest.approx(12 * psi_tp / dp, rel=0.01)  # norms are replicated over TP
    last = sc.training.num_steps - 1
    gathers = [op for op in graph.ops if op.category == "param_gather" and op.step == last]
    assert gathers and all(len(graph.groups[op.group]) == dp for op in gathers)


def test_time_breakdown_accounts_for_the_whole_step_and_names_the_exposed_tp():
    # idle = the bubble: no stragglers, and no host thread (this small model is launch-bound in eager mode)
    sc = scenario({"tp": 4, "pp": 2, "implementation": "ideal"}, cluster={"variability": 0.0, "variability_persistent": 0.0})
    report = run_choice(sc, sc.strategies[0])
    parts = report["time_breakdown_s"]
    assert sum(parts.values()) == pytest.approx(report["step_time_s"])
    assert parts["compute.backward"] > parts["compute.forward"]
    # TP all-reduces run on the compute stream, so all of them are exposed: at least a stage's
    # 8 layers x 16 micro-batches x 4 ring all-reduces of s·b·h bf16 (2 (t-1)/t of it sent)
    # through the 450 GB/s NVLink of each H100
    s, b, h, t, layers, m = 2048, 1, 1024, 4, 8, 16
    assert parts["exposed.tp"] >= layers * m * 4 * 2 * (t - 1) / t * s * b * h * 2 / 450e9
    # the 1F1B bubble (Narayanan et al. SC'21): (p - 1) / (m + p - 1) of the step with p = 2
    # stages and m = 16 micro-batches; not exact, as the stages' extra units differ
    assert parts["idle"] / report["step_time_s"] == pytest.approx(1 / 17, rel=0.05)


def test_chrome_trace_has_every_stage_and_stream(tmp_path):
    from hzpsim.cli import main

    path = tmp_path / "trace.json"
    assert main(["run", "--set", "model=tiny-dense", "--set", "cluster.num_nodes=1", "--set",
                 "training.global_batch_size=8", "--set", "strategy.name=nd", "--set", "strategy.pp=2",
                 "--trace", str(path)]) == 0
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 4}  # the two stage representatives
    assert {"compute", "pp_fwd"} <= {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_megatron_2021_synchronises_after_every_pipeline_send_and_receive():
    """NVIDIA/Megatron-LM@v2.5 megatron/p2p_communication.py::_communicate issues each
    pipeline exchange as one batch_isend_irecv call, waits on its requests, then calls
    torch.cuda.synchronize() ("To protect against race condition when using
    batch_isend_irecv()"). So on every stage of a 1F1B pipeline without interleaving, each send
    (m forward ones except on the last stage, m backward ones except on the first) is launched
    by a host call and followed by a host op that waits for it and for the device, and each
    pass that receives (m forwards except on the first stage, m backwards except on the last)
    is launched only after a host op that waits for the receive. megatron-core has none."""
    p, m = 4, 8
    strategy = {"tp": 2, "pp": p, "implementation": "megatron-2021"}
    sc = scenario(strategy, nodes=1, global_batch_size=m, micro_batch_size=1)  # dp = 8 / (2 x 4) = 1
    graph, trace = trace_of(sc)
    steps = sc.training.num_steps
    by_rank = {r: [op for op in graph.ops if op.ranks[0] == r] for r in graph.ranks}
    for s, rank in enumerate(graph.ranks):
        ops = by_rank[rank]
        sends = [op for op in ops if op.collective == "send_recv"]
        syncs = [op for op in ops if op.name.startswith("host.sync.send")]
        calls = [op for op in ops if op.name.startswith("host.call.send")]
        receives = [op for op in ops if op.name == "host.sync.recv"]
        expected = steps * ((m if s < p - 1 else 0) + (m if s > 0 else 0))
        assert len(sends) == len(syncs) == len(calls) == len(receives) == expected
        for send, sync, call in zip(sends, syncs, calls):
            assert call.id in send.deps and send.id in sync.deps
            assert trace.end_s[sync.id] >= trace.end_s[send.id]
        for sync in receives:
            (received,) = sync.deps
            assert trace.start_s[sync.id] >= trace.end_s[received]
    core, _ = trace_of(scenario({**strategy, "implementation": "megatron-core"}, nodes=1,
                                global_batch_size=m, micro_batch_size=1))
    assert not [op for op in core.ops if "sync" in op.name or op.name.startswith("host.call.send")]


def test_tp_comm_overlap_hides_behind_its_own_pass_and_waits_for_it():
    """Async TP / TE's overlap: the hidden share of a pass's TP transfers starts with the pass
    (its inputs) and the exposed share waits for it, so a pass takes max(compute, hidden) +
    exposed; the hidden share never outruns the links."""
    from hzpsim import frames

    def ops(overlap: float, backward: bool = True):
        s = scenario_from_mapping({
            "model": {"preset": "llama3-8b", "num_layers": 2}, "cluster": {"preset": "dgx-h100", "num_nodes": 1},
            "training": {"global_batch_size": 2, "micro_batch_size": 1},
            "strategy": {"name": "nd", "tp": 8, "sequence_parallel": True, "tp_comm_overlap": overlap,
                         "tp_comm_overlap_backward": backward}})
        report, trace = frames.simulate(s)
        df = frames.ops_frame(trace)
        return report, df[df["rank"] == 0].set_index("name")

    report, rank0 = ops(0.875)
    hidden = [n for n in rank0.index if n.endswith(".overlapped")]
    assert hidden
    for name in hidden:
        exposed = rank0.loc[name.removesuffix(".overlapped")]
        assert exposed["start_s"] >= rank0.loc[name, "end_s"] - 1e-12
        assert rank0.loc[name, "stream"] == "tp" and exposed["stream"] == "compute"
    first = rank0.loc["tp.fwd.layer0.mb0.ag.overlapped"]
    assert first["start_s"] <= rank0.loc["fwd.layer0.mb0", "start_s"]  # with the pass, not after it
    plain, _ = ops(0.0)
    assert report["step_time_s"] < plain["step_time_s"]
    # PyTorch's async TP: the forward's transfers only
    forward_only, rank0 = ops(0.875, backward=False)
    hidden = [n for n in rank0.index if n.endswith(".overlapped")]
    assert hidden and all(n.startswith("tp.fwd.") for n in hidden)
    assert report["step_time_s"] < forward_only["step_time_s"] < plain["step_time_s"]


def test_torchtitan_pipeline_keeps_fsdp_units_unsharded_across_micro_batches():
    """torchtitan with PP (reshard_after_forward = not pp_enabled; torch.distributed.pipelining
    disables gradient sync until perform_reduce_grad): each unit is gathered once per step, its
    gradient accumulates unsharded in fp32 and is reduce-scattered once, after the stage's last
    backward; the gathered parameters and the accumulators are held meanwhile."""
    strategy = {"pp": 2, "zero_stage": 3, "implementation": "torchtitan"}
    sc = scenario(strategy)
    graph, trace = trace_of(sc)
    last = sc.training.num_steps - 1

    def of_rank0(g, category):
        return [op for op in g.ops if op.step == last and op.category == category and 0 in op.ranks]

    gathers = of_rank0(graph, "param_gather")
    units = {op.name.split(".")[2] for op in gathers}
    scatters = [op for op in of_rank0(graph, "grad_reduce") if op.collective == "reduce_scatter"]
    assert gathers and len(gathers) == len(units)  # once per unit, no backward gathers
    assert all(op.name.startswith("ag.fwd.") and op.name.endswith(".mb0") for op in gathers)
    assert len(scatters) == len(units)
    end_of_backward = max(trace.end_s[op.id] for op in of_rank0(graph, "backward"))
    assert min(trace.start_s[op.id] for op in scatters) >= end_of_backward - 1e-12
    # the same layout under FSDP2's default gathers twice and reduces once per micro-batch
    g2, _ = trace_of(scenario({**strategy, "implementation": "fsdp2"}))
    m = sc.training.global_batch_size // 4  # dp 4, micro-batch 1
    assert len(of_rank0(g2, "param_gather")) == 2 * m * len(units)
    # held through the step: the stage's gathered bf16 parameters (copied out of the flat
    # all-gather output into per-parameter tensors: params beyond the sharded states,
    # Implementation.gather_copy_out) and fp32 accumulators (buffers): 6 B per parameter of
    # the stage; FSDP2 keeps 16 B per sharded parameter, over dp 4
    report = run_choice(sc, sc.strategies[0])
    stage_params = sum(graph.static_memory[0].values()) / 16 * 4
    breakdown = report["memory_breakdown_bytes"]
    unsharded = breakdown["params"] - graph.static_memory[0]["params"]
    assert unsharded >= 0.9 * 2 * stage_params
    assert breakdown["buffers"] + unsharded >= 0.9 * 6 * stage_params
