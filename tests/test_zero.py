"""ZeRO end to end: closed forms of data/strategies.md §2.8, symmetry, consistency, determinism."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import assert_symmetry_matches_expansion

from hzpsim.cli import run_choice
from hzpsim.report import JSON_KEYS
from hzpsim.scenario import scenario_from_mapping
from hzpsim.sim.engine import simulate
from hzpsim.strategies import zero


def scenario(stage: int, nodes: int = 2, gbs: int = 32, **training):
    """The ZeRO stages' own mechanics: the ``ideal`` implementation (one flat collective per
    unit, no host thread) and no stragglers; tests/test_implementations.py covers the rest."""
    return scenario_from_mapping(
        {
            "model": "tiny-dense",
            "training": {"global_batch_size": gbs, **training},
            "cluster": {"preset": "dgx-h100", "num_nodes": nodes, "variability": 0.0, "variability_persistent": 0.0},
            "strategy": {"name": "zero", "stage": stage, "implementation": "ideal"},
        }
    )


def run(stage: int, **kw):
    sc = scenario(stage, **kw)
    return sc, run_choice(sc, sc.strategies[0])


def grad_norm_bytes(sc) -> float:
    topo = sc.topology
    graph = zero.build(sc.strategies[0].config, sc.model, sc.training, topo)
    trace = simulate(graph, topo)
    return sum(
        sum(trace.plans[op.id].bytes_by_level.values())
        for op in graph.ops
        if op.category == "grad_norm" and op.step == sc.training.num_steps - 1
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("grad_dtype,bg", [("fp32", 4), ("bf16", 2)])
def test_comm_bytes_per_step_equal_closed_forms(stage, grad_dtype, bg):
    sc, report = run(stage, grad_dtype=grad_dtype)
    n, psi, bw = 16, sc.model.num_params(), 2
    a = 32 // n  # micro-batches per step
    frac = (n - 1) / n
    expected = {  # strategies.md §2.8, per rank per step
        1: frac * psi * (bg + bw),
        2: a * frac * psi * bg + frac * psi * bw,
        3: a * frac * psi * (2 * bw + bg),
    }[stage]
    got = report["comm_bytes_per_device"]
    norm = grad_norm_bytes(sc)
    assert got["intra_node"] + got["inter_node"] == pytest.approx(expected + norm, rel=1e-12)
    # a ring over 2 nodes x 8: 1/8 of every rank's bytes leave the node through its NIC
    assert got["inter_node"] == pytest.approx(expected / 8, rel=1e-3)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_state_bytes_equal_closed_forms(stage):
    sc = scenario(stage)
    n, psi = 16, sc.model.num_params()
    graph = zero.build(sc.strategies[0].config, sc.model, sc.training, sc.topology)
    static = graph.static_memory[0]
    expected = {  # ZeRO paper §5 with bf16 params, fp32 grads, K = 12 (strategies.md §2.8)
        1: {"params": 2 * psi, "grads": 4 * psi, "optimizer": 12 * psi / n},
        2: {"params": 2 * psi, "grads": 4 * psi / n, "optimizer": 12 * psi / n},
        3: {"params": 2 * psi / n, "grads": 4 * psi / n, "optimizer": 12 * psi / n},
    }[stage]
    states = {k: static[k] for k in ("params", "grads", "optimizer")}
    assert states == pytest.approx(expected, rel=1e-12)


def test_zero3_peak_holds_states_activations_and_gather_buffers():
    sc, report = run(3)
    breakdown = report["memory_breakdown_bytes"]
    psi = sc.model.num_params()
    assert breakdown["params"] == pytest.approx(2 * psi / 16)
    # at the peak (the backward) the gather ring is full, D + 1 = 2 gathered layers of 2 B/param,
    # and so are the R = 2 gradient buffers awaiting their reduce-scatter, 4 B/param; a
    # tiny-dense layer (the largest unit) has 725,504 parameters
    layer = 725_504
    assert breakdown["buffers"] == pytest.approx((1 + 1) * layer * 2 + 2 * layer * 4, rel=1e-12)
    assert report["peak_memory_allocated_bytes"] == pytest.approx(sum(breakdown.values()))


def test_consistency_tokens_step_and_mfu():
    sc, r = run(3)
    tokens = sc.training.global_batch_size * sc.model.seq_len
    assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(tokens)
    assert r["tokens_per_s_per_device"] * r["num_devices"] == pytest.approx(r["tokens_per_s"])
    peak = sc.topology.device.peak_flops_per_s("bf16")
    mfu = sc.model.model_flops_per_token() * tokens / (r["step_time_s"] * r["num_devices"] * peak)
    assert r["mfu"] == pytest.approx(mfu)
    assert r["tflops_per_device"] * 1e12 == pytest.approx(mfu * peak)
    assert r["hfu"] == pytest.approx(r["mfu"])  # no recompute
    assert 0 < r["mfu"] < 1
    assert set(JSON_KEYS) <= set(r)
    assert r["bubble_fraction"] is None


def test_full_recompute_hfu_is_four_thirds_of_layer_flops():
    sc, r = run(3, activation_recompute="full")
    m = sc.model
    per_token_layers = sum(
        sum(m.layer_forward_flops(i, 1, causal=False).values()) for i in range(m.num_layers)
    )
    ratio = (m.model_flops_per_token() + per_token_layers) / m.model_flops_per_token()
    assert r["hfu"] / r["mfu"] == pytest.approx(ratio)


def test_deterministic_json():
    _, a = run(3)
    _, b = run(3)
    a.pop("sim_wall_s")
    b.pop("sim_wall_s")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_symmetry_matches_full_expansion_on_two_nodes(stage):
    sc = scenario(stage)
    assert_symmetry_matches_expansion(sc)


def test_zero3_hides_gathers_behind_compute():
    sc = scenario(3, micro_batch_size=1)
    # a 10 GB/s NIC keeps it communication-bound at any GEMM speed
    sc = dataclasses.replace(sc, cluster=dataclasses.replace(sc.cluster, inter_node_bytes_per_s_per_device=10e9))
    r = run_choice(sc, sc.strategies[0])
    # tiny-dense over 2 nodes is communication-bound: with prefetch depth 1 a gather (or a
    # reduce-scatter) is in flight during every forward and backward, so all of that compute
    # is hidden; only the optimizer runs alone. Hence, with F, B, O the compute times:
    #   overlap_fraction = (F + B) / (step - O),  exposed_comm_s = step - F - B - O
    parts, step = r["time_breakdown_s"], r["step_time_s"]
    f, b, o = parts["compute.forward"], parts["compute.backward"], parts["compute.optimizer"]
    assert r["overlap_fraction"] == pytest.approx((f + b) / (step - o), rel=1e-9)
    assert r["exposed_comm_s"] == pytest.approx(step - f - b - o, rel=1e-9)


def test_more_stages_less_memory():
    peaks = [run(s)[1]["peak_memory_allocated_bytes"] for s in (1, 2, 3)]
    assert peaks[0] > peaks[1] > peaks[2]


def test_batch_that_does_not_split_is_rejected():
    from hzpsim.config import ScenarioError

    with pytest.raises(ScenarioError, match="training.global_batch_size: 24 is not divisible"):
        scenario(3, gbs=24)
