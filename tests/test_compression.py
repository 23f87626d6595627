"""strategy.grad_compression on ddp and zero stages 1/2 (hzpsim/strategies/_compression.py,
docs/compression.md): off at ratio 1, bytes on the wire against closed forms, the kernels and
the held memory, the adaptive plan's budget, bad input, the search's bound."""

from __future__ import annotations

import json

import pytest

from hzpsim import search as S
from hzpsim import strategies
from hzpsim.cli import main
from hzpsim.run import run_choice
from hzpsim.scenario import scenario_from_mapping
from hzpsim.sim.engine import simulate
from hzpsim.strategies import _compression as C

NODES = 2
N = 8 * NODES
# a Llama-style 1.3B model (hand-picked dimensions, as in docs/compression.md): DDP fits an A100
LLAMA_1B3 = {"name": "llama-1.3b", "num_layers": 24, "hidden_size": 2048, "num_heads": 16, "ffn_hidden_size": 5504,
             "vocab_size": 32000, "seq_len": 2048, "dropout": False}


#: 100 Gb/s per node (one NIC of 12.5 GB/s shared by 8 GPUs), line rate: a slow network
SLOW_NIC_BYTES_PER_S_PER_DEVICE = 100e9 / 8 / 8


def scenario(strategy: dict, model: str | dict = "llama2-7b", cluster: dict | None = None, **training):
    return scenario_from_mapping({
        "model": model,
        "training": {"global_batch_size": 2 * N, "activation_recompute": "full", "num_steps": 2, **training},
        "cluster": {"preset": "dgx-a100", "num_nodes": NODES, **(cluster or {})},
        "strategy": strategy,
    })


def graph_of(sc):
    choice = sc.strategies[0]
    return strategies.get(choice.name).build(choice.config, sc.model, sc.training, sc.topology)


def grad_sizes(graph) -> dict[str, float]:
    """Summed payload (op size x count) of rank 0's gradient collectives in the last step, by kind."""
    last = max(op.step for op in graph.ops)
    out: dict[str, float] = {}
    for op in graph.ops:
        if op.kind != "compute" and op.step == last and op.category == "grad_reduce":
            out[op.collective] = out.get(op.collective, 0.0) + op.size_bytes * op.count
    return out


def wire_bytes(graph, trace) -> float:
    """Bytes rank 0 sends in the last step for its gradient reduction (every level)."""
    last = max(op.step for op in graph.ops)
    return sum(sum(trace.plans[op.id].bytes_by_level.values()) for op in graph.ops
               if op.kind != "compute" and op.step == last and op.category == "grad_reduce" and 0 in op.ranks)


def plan_of(sc):
    choice = sc.strategies[0]
    from hzpsim.strategies import _family
    p = strategies.get(choice.name).plan(choice.config, sc.topology)
    from hzpsim.strategies._mp_units import mp_units
    units = mp_units(sc.model, sc.training, p.dims.placed(sc.topology))
    return _family.compression_plan(p, sc.model, sc.training, [u.name for u in units], [u.dense_params for u in units])


@pytest.mark.parametrize("strategy", [{"name": "ddp"}, {"name": "zero", "stage": 1}, {"name": "zero", "stage": 2}])
@pytest.mark.parametrize("method", ["powersgd", "topk", "quantize"])
def test_ratio_one_is_exactly_no_compression(strategy, method, capsys):
    base = [f"--set=strategy.{k}={v}" for k, v in strategy.items()]
    args = ["run", "--json", "--set=model=tiny-gpt", "--set=cluster.num_nodes=2", *base]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, f"--set=strategy.grad_compression.method={method}", "--set=strategy.grad_compression.ratio=1"]) == 0
    off = json.loads(capsys.readouterr().out)
    for report in (plain, off):
        report.pop("sim_wall_s")  # wall time of the simulation itself
    assert json.dumps(plain, sort_keys=True) == json.dumps(off, sort_keys=True)
    # and the graph itself: the same ops
    sc = scenario(strategy)
    sc1 = scenario({**strategy, "grad_compression": {"method": method, "ratio": 1}})
    g0, g1 = graph_of(sc), graph_of(sc1)
    assert [(o.name, o.kind, o.size_bytes) for o in g0.ops] == [(o.name, o.kind, o.size_bytes) for o in g1.ops]
    assert g0.static_memory == g1.static_memory


def test_ddp_bytes_scale_with_the_ratio():
    sc = scenario({"name": "ddp"})
    psi, b = sc.model.num_params(), 4  # fp32 gradients
    graph = graph_of(sc)
    trace = simulate(graph, sc.topology)
    ring = 2 * (N - 1) / N  # a ring all-reduce sends 2(N-1)/N of its buffer
    plain = wire_bytes(graph, trace)
    assert plain == pytest.approx(ring * psi * b, rel=1e-9)
    for ratio in (0.5, 0.25, 0.125):
        q = scenario({"name": "ddp", "grad_compression": {"method": "quantize", "ratio": ratio}})
        g = graph_of(q)
        assert grad_sizes(g) == pytest.approx({"all_reduce": ratio * psi * b}, rel=1e-12)
        assert wire_bytes(g, simulate(g, q.topology)) == pytest.approx(ratio * plain, rel=1e-9)
    # top-k: every rank's pairs to every rank, an all-gather of N x payload: (N - 1) r psi b sent
    t = scenario({"name": "ddp", "grad_compression": {"method": "topk", "ratio": 0.01}})
    g = graph_of(t)
    assert grad_sizes(g) == pytest.approx({"all_gather": N * 0.01 * psi * b}, rel=1e-12)
    assert wire_bytes(g, simulate(g, t.topology)) == pytest.approx((N - 1) * 0.01 * psi * b, rel=1e-9)


def test_powersgd_moves_its_factors():
    sc = scenario({"name": "ddp", "grad_compression": {"method": "powersgd", "ratio": 0.02}})
    plan = plan_of(sc)
    model, b = sc.model, 4
    h, ffn, layers, vocab = model.hidden_size, model.ffn_hidden_size, model.num_layers, model.vocab_size
    # llama2-7b: per layer q, k, v, o (h x h), gate, up (ffn x h), down (h x ffn); embed and head vocab x h
    per_layer = [(h, h)] * 4 + [(ffn, h)] * 2 + [(h, ffn)]
    expected = 0.0
    for u, unit in enumerate(plan.units):
        mats = per_layer if 0 < u <= layers else [(vocab, h)]
        r = unit.rank
        assert all((n + m) * r * 2 <= n * m for n, m in mats)  # every matrix compressed
        vectors = unit.elements - sum(n * m for n, m in mats)
        p, q = r * sum(n for n, _ in mats) + vectors, r * sum(m for _, m in mats)
        assert unit.p_bytes == pytest.approx(p * b) and unit.q_bytes == pytest.approx(q * b)
        # the largest rank within the ratio
        assert (p + q) <= 0.02 * unit.elements < p + q + sum(n + m for n, m in mats)
        expected += (p + q) * b
    g = graph_of(sc)
    assert grad_sizes(g) == pytest.approx({"all_reduce": expected}, rel=1e-12)
    assert expected == pytest.approx(0.02 * model.num_params() * b, rel=0.05)


def test_zero_stages_compress_their_reductions():
    psi, b = scenario({"name": "ddp"}).model.num_params(), 4
    # stage 1: the step-end reduce-scatter, once per step; stage 2: every micro-batch's
    for stage, per_step in ((1, 1), (2, 2)):
        sc = scenario({"name": "zero", "stage": stage, "grad_compression": {"method": "quantize", "ratio": 0.5}})
        assert grad_sizes(graph_of(sc)) == pytest.approx({"reduce_scatter": per_step * 0.5 * psi * b}, rel=1e-12)
        sc = scenario({"name": "zero", "stage": stage, "grad_compression": {"method": "topk", "ratio": 0.01}})
        assert grad_sizes(graph_of(sc)) == pytest.approx({"all_gather": per_step * N * 0.01 * psi * b}, rel=1e-12)


@pytest.mark.parametrize("method", ["powersgd", "topk", "quantize"])
def test_kernels_and_held_memory_appear(method):
    ratio = 0.25 if method == "quantize" else 0.01
    plain = scenario({"name": "ddp"})
    sc = scenario({"name": "ddp", "grad_compression": {"method": method, "ratio": ratio}})
    g0, g = graph_of(plain), graph_of(sc)
    plan = plan_of(sc)
    units = [u for u in plan.units if u is not None]
    last = max(op.step for op in g.ops)
    ops = [op for op in g.ops if op.kind == "compute" and op.step == last and 0 in op.ranks]
    compress = [op for op in ops if op.name.startswith("compress.")]
    decompress = [op for op in ops if op.name.startswith("decompress.")]
    assert len(compress) == len(decompress) == len(units)
    x, b = sum(u.elements for u in units), 4.0
    got = sum(op.bytes_accessed for op in compress)
    if method == "quantize":  # the cast reads b and writes ratio x b per element
        assert got == pytest.approx(x * b * (1 + ratio), rel=1e-12)
    elif method == "topk":  # residual add 3, selection passes, residual kept 2, pairs written
        assert got == pytest.approx(x * b * (5 + C.TOPK_SELECT_PASSES + ratio), rel=1e-12)
    else:  # error added 3, clone 2; and P = M Q: 2 n m r FLOPs per matrix
        assert got == pytest.approx(5 * x * b, rel=1e-12)
        flops = sum(op.total_flops for op in compress)
        assert flops == pytest.approx(sum(u.gemm_flops for u in units), rel=1e-12)
        assert sum(1 for op in ops if op.name.startswith("powersgd.q.")) == len(units)
    extra = g.static_memory[0].get("buffers", 0.0) - g0.static_memory[0].get("buffers", 0.0)
    if method == "quantize":  # the fp16/bf16 hooks keep no error feedback
        assert extra == 0.0
    else:  # the error feedback of the whole gradient (and PowerSGD's P and Q)
        factors = sum(u.p_factor_bytes + u.q_bytes for u in units) if method == "powersgd" else 0.0
        assert extra == pytest.approx(x * b + factors, rel=1e-12)
        assert factors >= 0


def test_adaptive_respects_its_budget():
    # a model whose units differ in shape: embed/head (vocab x h) against square-ish layers
    shapes = (C.UnitShape(((4096.0, 4096.0),) * 4, 0.0),) * 4 + (C.UnitShape(((32000.0, 512.0),), 0.0),) * 4
    fixed = C.plan(C.GradCompression("powersgd", 0.01, "fixed"), shapes, 4.0)
    adaptive = C.plan(C.GradCompression("powersgd", 0.01, "adaptive"), shapes, 4.0)
    assert adaptive.budget_error == pytest.approx(fixed.error)
    assert adaptive.error <= adaptive.budget_error
    assert adaptive.payload_bytes < fixed.payload_bytes  # found a cheaper plan within the error
    assert len({u.rank for u in adaptive.units}) > 1  # per-layer ranks differ
    # on a real model: never more bytes nor more error than the uniform ratio
    for method, ratio in (("powersgd", 0.01), ("topk", 0.01), ("quantize", 0.25)):
        sc = scenario({"name": "ddp", "grad_compression": {"method": method, "ratio": ratio, "per_layer": "adaptive"}})
        plan = plan_of(sc)
        assert plan.error <= plan.budget_error * (1 + 1e-12)
        assert plan.payload_bytes <= plan.uniform_bytes * (1 + 1e-12)


@pytest.mark.parametrize("sets, key", [
    (["strategy.grad_compression.method=gzip"], "strategy.grad_compression.method"),
    (["strategy.grad_compression.method=topk", "strategy.grad_compression.ratio=0"], "strategy.grad_compression.ratio"),
    (["strategy.grad_compression.method=topk", "strategy.grad_compression.ratio=1.5"], "strategy.grad_compression.ratio"),
    (["strategy.grad_compression.method=powersgd", "strategy.grad_compression.ratio=0.7"], "strategy.grad_compression.ratio"),
    (["strategy.grad_compression.per_layer=sometimes"], "strategy.grad_compression.per_layer"),
    (["strategy.name=zero", "strategy.stage=3", "strategy.grad_compression.method=topk"], "strategy.grad_compression"),
    (["strategy.name=hsdp", "strategy.grad_compression.method=topk"], "strategy.grad_compression"),
])
def test_bad_input_exits_2_naming_the_key(sets, key, capsys):
    args = ["run", "--set=model=tiny-gpt", *(f"--set={s}" for s in sets)]
    if not any(s.startswith("strategy.name") for s in sets):
        args.append("--set=strategy.name=ddp")
    assert main(args) == 2
    assert key + ":" in capsys.readouterr().err


def test_search_option_and_bounds_below_the_simulation():
    # on a slow network, where the compressed collectives set the step (a bound that kept the
    # uncompressed reductions would exceed the simulation)
    sc = scenario({"name": "ddp"}, model=LLAMA_1B3, cluster={"inter_node_bytes_per_s_per_device": SLOW_NIC_BYTES_PER_S_PER_DEVICE})
    space = S.Space(micro_batch_size=(1,), activation_recompute=("full",),
                    grad_compression=("powersgd:0.01", "topk:0.001", "quantize:0.25", "powersgd:0.02:adaptive"))
    candidates = [c for c in S.enumerate_candidates(sc, ["ddp", "zero"], space) if S.check(sc, c) is None]
    compressed = [c for c in candidates if "grad_compression" in dict(c.fields)]
    assert len(compressed) == 12  # ddp, zero 1 and 2, four options each; none with stage 3
    bounder = S.Bounder(sc)
    for candidate in compressed:
        report = S.evaluate(sc, candidate)["report"]
        bound = bounder(candidate)
        assert bound.step_time_s <= report["step_time_s"] * (1 + 1e-9), candidate.label()
        assert bound.memory_bytes <= report["peak_memory_allocated_bytes"] * (1 + 1e-9), candidate.label()
    # without the key, the search space is what it was
    assert not any("grad_compression" in dict(c.fields)
                   for c in S.enumerate_candidates(sc, ["ddp", "zero"], S.Space(micro_batch_size=(1,))))


def test_compressed_run_reports():
    sc = scenario({"name": "zero", "stage": 2, "grad_compression": {"method": "powersgd", "ratio": 0.05}})
    report = run_choice(sc, sc.strategies[0])
    assert report["strategy_resolved"]["grad_compression"] == {"method": "powersgd", "ratio": 0.05, "per_layer": "fixed"}
    assert strategies.label(report["strategy_resolved"]) == "zero(stage=2)+powersgd0.05"
