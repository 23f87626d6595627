"""Inputs that once hung or crashed: each finishes with a result or exits 2 naming its key.

The hangs all had one cause: past ~4,000 simulated seconds a flow with a fraction of a byte
left asked for a timer shorter than the clock's resolution, fired at the same instant and
rescheduled forever (``sim/network.py``). The engine now also stops any run that makes no
progress with exit 3 (``SimulatorFault``), so "never hangs" holds by construction.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import simpy

from hzpsim.cli import main
from hzpsim.sim import engine, network

ZERO3 = ["--set", "strategy.name=zero", "--set", "strategy.stage=3"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_flow_below_the_clock_resolution_finishes():
    """At t = 16,384 s one clock ulp is 3.6 ps; 0.07 byte at 50 GB/s needs 1.4 ps, so its timer
    fires at the same instant. The old rule (done within 1 ps = 0.05 byte) left the flow
    unfinished and rescheduled it at that instant forever."""
    env = simpy.Environment(initial_time=16384.0)
    net = network.Network(env, lambda resource: 50e9)
    done = []
    net.transfer({(0, "leaf"): 0.07}, lambda: done.append(env.now))
    for _ in range(100):
        if done or not env._queue:
            break
        env.step()
    assert done == [16384.0]
    assert network.done_within_s(16384.0) >= math.ulp(16384.0)
    assert network.done_within_s(0.0) == pytest.approx(1e-12)


def test_no_progress_is_a_simulator_fault_naming_the_op(capsys, monkeypatch):
    """Put the old completion rule back: the guard turns the endless loop into exit 3."""
    monkeypatch.setattr(network, "done_within_s", lambda now_s: 1e-12)
    monkeypatch.setattr(engine, "STALL_EVENTS", 20_000)
    code, _, err = run_cli(capsys, "run", *ZERO3, "--set", "cluster.inter_node_latency_s=1000")
    assert code == 3
    assert "simulator fault: no progress" in err and "stuck in '" in err and "(op " in err


def test_huge_latency_finishes(capsys):
    code, out, _ = run_cli(capsys, "run", *ZERO3, "--set", "cluster.inter_node_latency_s=1000")
    assert code == 0 and "zero(stage=3)" in out


def test_sequence_of_ten_million_tokens_finishes(capsys):
    code, out, _ = run_cli(capsys, "run", *ZERO3, "--set", "model.seq_len=10000000")
    assert code == 0 and "zero(stage=3)" in out


@pytest.mark.slow
def test_405b_on_one_node_gives_a_result(capsys):
    """A what-if people ask: does 405B train on one node? (No: it does not fit, but it runs.)"""
    code, out, _ = run_cli(capsys, "run", *ZERO3, "--set", "model=llama3-405b", "--set", "cluster.num_nodes=1",
                           "--set", "training.global_batch_size=4096", "--json")
    assert code == 0
    assert '"fits_in_memory": false' in out


@pytest.mark.slow
def test_one_hundred_steps_give_a_result(capsys):
    # one micro-batch per step (16 sequences on 16 devices): the steps, not the micro-batches, are what this checks
    code, out, _ = run_cli(capsys, "run", *ZERO3, "--set", "cluster.num_nodes=2", "--set", "training.num_steps=100",
                           "--set", "training.global_batch_size=16", "--json")
    assert code == 0 and '"step_time_s"' in out


_PEAK_RSS = """
import sys
from hzpsim.cli import main
code = main(sys.argv[1:])
status = open("/proc/self/status").read()
print("VmHWM_kB", [line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")][0])
sys.exit(code)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="peak RSS read from /proc")
def test_eight_million_devices_run_in_little_memory():
    """The symmetric path stores no per-device list: groups of millions of ranks are ranges.
    (The child reads its own high-water RSS: rusage of children would count the parent's pages
    copied at fork.)"""
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, "run", *ZERO3, "--set", "cluster.num_nodes=1000000",
         "--set", "training.global_batch_size=8000000", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert '"num_devices": 8000000' in proc.stdout
    peak_kib = int(proc.stdout.rsplit("VmHWM_kB", 1)[1].strip().split()[0])
    assert peak_kib < 1024 * 1024, f"peak RSS {peak_kib / 1024:.0f} MiB"


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--set", "cluster.num_nodes=1e9", *ZERO3], "training.global_batch_size"),
        (["--set", "model=tiny-dense", "--set", "cluster.num_nodes=2", "--set", "strategy.name=nd",
          "--set", "strategy.pp=4", "--set", "strategy.vpp=4"], "strategy.vpp"),
        (["--set", "strategy.name=nd", "--set", "strategy.pp=16", "--set", "model.num_layers=1"], "strategy.pp"),
        (["--set", "strategy.name=nd", "--set", "strategy.pp=4", "--set", "strategy.vpp=2",
          "--set", "strategy.first_stage_layers=0", "--set", "strategy.last_stage_layers=0",
          "--set", "model.num_layers=4"], "strategy.last_stage_layers"),
        (["--set", "strategy.name=hsdp", "--set", "strategy.shard_group_size=1000"], "strategy.shard_group_size"),
        (["--set", "strategy.name=mics", "--set", "strategy.partition_size=1000"], "strategy.partition_size"),
        (["--set", "strategy.name=megatron_fsdp", "--set", "strategy.shard_group_size=48"],
         "strategy.shard_group_size"),
    ],
)
def test_bad_layouts_exit_2_naming_their_key(capsys, argv, key):
    code, _, err = run_cli(capsys, "run", *argv)
    assert code == 2
    assert err.startswith(f"hzpsim: error: {key}:"), err


@pytest.mark.parametrize("target", ["/nonexistent-folder/trace.json", "{tmp}"])
def test_unwritable_trace_exits_2_before_simulating(capsys, tmp_path, target):
    path = target.format(tmp=tmp_path)
    code, out, err = run_cli(capsys, "run", *ZERO3, "--trace", path)
    assert code == 2 and err.startswith(f"hzpsim: error: --trace {path}:")
    assert out == ""  # refused before any simulation
