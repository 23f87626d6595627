"""Goodput and the whole run (hzpsim/model/goodput.py, run.plan_of): Young's interval, failures
that grow with the cluster, asynchronous saves, time to train and cost, and the search's ranking
on the wall."""

from __future__ import annotations

import math

import pytest

from hzpsim.cli import main
from hzpsim.model.goodput import (
    IDLE_POWER_FRACTION,
    cluster_power,
    goodput,
    whole_run,
    young_interval_s,
)
from hzpsim.model.training import LLAMA3_MTBF_DEVICE_HOURS, Checkpoint, Failures
from hzpsim.run import effective_step_s, run_choice
from hzpsim.scenario import scenario_from_mapping

STATES = 20e9  # bytes one device saves


def test_llama3_default_mtbf_is_its_derivation():
    # 419 unexpected interruptions in 54 days on 16,384 H100 (Llama 3, section 3.3.4)
    assert LLAMA3_MTBF_DEVICE_HOURS == pytest.approx(16384 * 54 * 24 / 419)
    assert Failures(restart_s=0).mtbf_device_hours == LLAMA3_MTBF_DEVICE_HOURS


def test_auto_interval_is_youngs_optimum():
    failures = Failures(restart_s=600, mtbf_device_hours=50_000)
    g = goodput(5.0, 4096, STATES, failures, Checkpoint())
    stall = STATES / Checkpoint().write_bytes_per_s_per_device
    mtbf = 50_000 * 3600 / 4096
    assert g["checkpoint_stall_s"] == pytest.approx(stall)
    assert g["checkpoint_interval_s"] == pytest.approx(math.sqrt(2 * stall * mtbf), rel=0.01)
    assert young_interval_s(stall, mtbf) == pytest.approx(math.sqrt(2 * stall * mtbf))
    # and it is the best interval of the first-order model: a little shorter or longer loses
    best = g["fraction"]
    for factor in (0.5, 0.8, 1.25, 2.0):
        steps = round(g["checkpoint_interval_s"] * factor / 5.0)
        assert goodput(5.0, 4096, STATES, failures, Checkpoint(interval=steps))["fraction"] < best


def test_goodput_falls_as_the_cluster_grows():
    failures = Failures(restart_s=600)
    fractions = [goodput(5.0, n, STATES, failures, None)["fraction"] for n in (512, 2048, 8192, 32768)]
    assert all(a > b for a, b in zip(fractions, fractions[1:])), fractions
    per_day = [goodput(5.0, n, STATES, failures, None)["expected_interruptions_per_day"] for n in (1024, 2048)]
    assert per_day[1] == pytest.approx(2 * per_day[0])


@pytest.mark.parametrize("interval", ["auto", 200, 1000, 2500])
@pytest.mark.parametrize("devices", [256, 4096, 16384])
def test_asynchronous_saves_never_lower_goodput(interval, devices):
    """At Young's interval and at any interval up to the cluster's MTBF (the first-order model's
    range; at 16,384 devices M is 11,135 s, 2,784 steps of 4 s)."""
    failures = Failures(restart_s=300)
    sync = goodput(4.0, devices, STATES, failures, Checkpoint(interval=interval))
    asynchronous = goodput(4.0, devices, STATES, failures, Checkpoint(interval=interval, async_=True))
    assert asynchronous["fraction"] >= sync["fraction"]
    assert asynchronous["checkpoint_stall_s"] < sync["checkpoint_stall_s"]


def test_lost_time_adds_up_to_the_day():
    g = goodput(4.0, 8192, STATES, Failures(restart_s=900), Checkpoint(interval=500))
    lost = sum(g["lost_s_per_day"].values())
    assert g["fraction"] == pytest.approx(1 - lost / 86400)
    assert g["lost_s_per_day"]["restart"] == pytest.approx(g["expected_interruptions_per_day"] * 900)


def test_nothing_set_means_no_goodput_and_plain_time_to_train():
    out = whole_run(1e6, 64, 1e12, 1.0, 2.0)
    assert out["time_to_train_s"] == pytest.approx(1e6)
    assert out["device_hours"] == pytest.approx(1e6 / 3600 * 64)
    assert out["cost"] == pytest.approx(out["device_hours"] * 2.0)
    assert whole_run(1e6, 64, None, 1.0, 2.0) == {"time_to_train_s": None, "device_hours": None, "cost": None,
                                                  "energy_kwh": None, "average_power_w": None}


def _scenario(training=None, cluster=None, strategy=None):
    return scenario_from_mapping({
        "model": "llama3-8b",
        "training": {"global_batch_size": 64, **(training or {})},
        "cluster": {"preset": "dgx-h100", "num_nodes": 2, **(cluster or {})},
        "strategy": strategy or {"name": "zero", "stage": 3},
    })


def test_report_carries_goodput_time_to_train_and_cost():
    plain = _scenario()
    r0 = run_choice(plain, plain.strategies[0])
    assert r0["goodput"] is None and r0["time_to_train_s"] is None and r0["cost"] is None
    sc = _scenario({"total_tokens": 1e12, "failures": {"restart_s": 600}}, {"price_per_device_hour": 3.0})
    r = run_choice(sc, sc.strategies[0])
    assert r["step_time_s"] == r0["step_time_s"]  # the step itself does not change
    g = r["goodput"]
    assert 0 < g["fraction"] < 1
    # each device saves what it holds: ZeRO-3 over 16 devices, DeepSpeed's bf16 working copy and
    # its fp32 master and two moments (14 B per parameter; the gradient is not saved)
    assert g["checkpoint_bytes_per_device"] == pytest.approx(sc.model.num_params() * 14 / 16, rel=0.01)
    assert r["time_to_train_s"] == pytest.approx(1e12 / r["tokens_per_s"] / g["fraction"])
    assert r["cost"] == pytest.approx(r["time_to_train_s"] / 3600 * 16 * 3.0)
    assert effective_step_s(r) == pytest.approx(r["step_time_s"] / g["fraction"])


@pytest.mark.parametrize("argv, key", [
    (["--set", "training.failures.mtbf_device_hours=1000"], "training.failures.restart_s"),
    (["--set", "training.failures.restart_s=-5"], "training.failures.restart_s"),
    (["--set", "training.checkpoint.interval=0"], "training.checkpoint.interval"),
    (["--set", "training.checkpoint.write_bytes_per_s_per_device=0"], "training.checkpoint.write_bytes_per_s_per_device"),
    (["--set", "training.total_tokens=-1"], "training.total_tokens"),
    (["--set", "cluster.price_per_device_hour=-1"], "cluster.price_per_device_hour"),
    (["--set", "cluster.pue=0.9"], "cluster.pue"),
    (["--set", "cluster.node_overhead_w=-1"], "cluster.node_overhead_w"),
])
def test_bad_settings_exit_2_naming_the_key(capsys, argv, key):
    assert main(["run", *argv]) == 2
    assert key in capsys.readouterr().err


def test_text_output_adds_the_whole_run_line(capsys, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: llama3-8b\ntraining: {global_batch_size: 64, total_tokens: 1.0e+12, "
                    "failures: {restart_s: 600}}\ncluster: {preset: dgx-h100, num_nodes: 2, price_per_device_hour: 2}\n"
                    "strategy: {name: zero, stage: 3}\n")
    assert main(["run", str(path)]) == 0
    out = capsys.readouterr().out
    assert "days to train" in out and "goodput" in out and "cost" in out and "MWh" in out


def test_power_is_idle_plus_the_busy_share_of_the_cap_plus_the_nodes_times_pue():
    p = cluster_power(16, 2, 700.0, 700.0, 0.5, 4600.0, 1.2)
    idle = IDLE_POWER_FRACTION * 700
    assert p.device_w == pytest.approx(idle + (700 - idle) * 0.5)
    assert p.cluster_w == pytest.approx((16 * p.device_w + 2 * 4600) * 1.2)
    assert cluster_power(16, 2, 700.0, 500.0, 1.0, 0.0, None).device_w == pytest.approx(500.0)  # the cap
    assert cluster_power(16, 2, 700.0, 700.0, 0.0, 0.0, None).device_w == pytest.approx(idle)
    assert cluster_power(16, 2, None, None, 1.0, 0.0, None) is None  # no TDP in the device file


def test_energy_of_the_whole_run():
    """energy = the cluster's draw x the wall time to train; a power cap lowers the draw (and
    slows the clock); the PUE and the nodes' overhead scale it."""
    base = {"total_tokens": 1e12}
    r = run_choice(s := _scenario(base), s.strategies[0])
    busy = r["stream_utilization"]["compute"]
    idle = IDLE_POWER_FRACTION * 700
    device = idle + (700 - idle) * busy
    assert r["average_power_w"] == pytest.approx(16 * device + 2 * 4600)  # dgx-h100: 4.6 kW per node
    assert r["energy_kwh"] == pytest.approx(r["average_power_w"] * r["time_to_train_s"] / 3.6e6)
    pue = run_choice(s := _scenario(base, {"pue": 1.3}), s.strategies[0])
    assert pue["energy_kwh"] == pytest.approx(1.3 * r["energy_kwh"])
    capped = run_choice(s := _scenario(base, {"device_power_limit_w": 500}), s.strategies[0])
    assert capped["average_power_w"] < r["average_power_w"] and capped["time_to_train_s"] > r["time_to_train_s"]
    bare = run_choice(s := _scenario(base, {"node_overhead_w": 0}), s.strategies[0])
    assert bare["average_power_w"] == pytest.approx(16 * device)


def test_search_ranks_by_throughput_on_the_wall_when_failures_are_set():
    """With failures set the search ranks by the step over its goodput: on a cluster that fails
    every few hours and writes checkpoints slowly, ZeRO++'s secondary shard (hpZ, more states
    per device, longer saves) loses the first place it holds on the step time, and the answer
    is still the exhaustive one (a bound on the step bounds the step over goodput <= 1)."""
    from hzpsim import search as S

    data = {
        "model": "llama2-7b",
        "training": {"global_batch_size": 64},
        "cluster": {"preset": "dgx-a100", "num_nodes": 4, "device": "a100-40gb"},
        "strategy": {"name": "zero", "stage": 3},
    }
    space_text = ["tp=1,2", "pp=1,2", "vpp=1", "micro_batch_size=1", "activation_recompute=full"]

    def run(d, exhaustive=False):
        sc = scenario_from_mapping(d)
        space = S.default_space(sc)
        for text in space_text:
            space = space.replace(text)
        return S.search(sc, top=3, space=space, exhaustive=exhaustive)

    plain = run(data)
    failing = {**data, "training": {"global_batch_size": 64, "failures": {"restart_s": 600, "mtbf_device_hours": 100},
                                    "checkpoint": {"write_bytes_per_s_per_device": 2e6}}}
    fast = run(failing)
    best = fast.best.report
    assert best["goodput"] is not None
    assert effective_step_s(best) == min(effective_step_s(r.report) for r in fast.ranked)
    assert fast.best.candidate != plain.best.candidate
    assert plain.best.report["step_time_s"] < best["step_time_s"]  # slower per step, faster on the wall
    slow = run(failing, exhaustive=True)
    assert slow.best.candidate == fast.best.candidate


def test_an_asynchronous_save_waits_for_the_previous_write():
    """torchtitan's CheckpointManager.save first waits for the previous background write: saving
    every interval shorter than a write stalls for the difference, and auto never saves more
    often than a write takes."""
    failures = Failures(restart_s=300)
    write = STATES / Checkpoint().write_bytes_per_s_per_device
    snapshot = STATES / Checkpoint().snapshot_bytes_per_s
    g = goodput(1.0, 65536, STATES, failures, Checkpoint(async_=True))
    assert g["checkpoint_interval_s"] >= write
    often = goodput(1.0, 4096, STATES, failures, Checkpoint(interval=10, async_=True))
    assert often["checkpoint_stall_s"] == pytest.approx(snapshot + write - 10.0)
