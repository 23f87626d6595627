"""``hzpsim validate memory``: the simulator's allocated peak against PyTorch's own memory
tracker (``torch.distributed._tools.mem_tracker``) on the executor's strategies, at a small
Llama-style shape on fake tensors (exact sizes, no data: seconds)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from hzpsim.executor import memtrack  # noqa: E402
from hzpsim.validation import memory  # noqa: E402

SHAPE = {"seq_len": 512, "layers": 4, "hidden": 512, "vocab": 32768}


@pytest.mark.parametrize("name", list(memory.ENTRIES))
def test_predicted_peak_allocated_matches_the_tracker(name):
    """Within 3 % of MemTracker's peak for rank 0 (the issue's bar at the Llama-3-8B shape;
    measured here at a shape small enough for a test): states, activations per eager op,
    the loss's fp32 temporaries, FSDP2's unsharded units, DTensor's replicated embedding
    gradient and the AsyncHZP rings all have to be right for this to hold."""
    spec = memtrack.spec_for(name, memtrack.small(**SHAPE))
    measured = memtrack.measure(spec, "fake")["peak_allocated_bytes"]
    predicted = memory.predicted_rank0(spec, name)["peak_allocated_bytes"]
    assert predicted == pytest.approx(measured, rel=0.03), (name, measured, predicted)


def test_predicted_scenario_is_the_executors():
    spec = memtrack.spec_for("nd", memtrack.small(**SHAPE))
    sc = memory.scenario_of(spec, "nd")
    assert sc.training.precision == "fp32" and sc.training.activation_recompute == "none"
    assert sc.strategies[0].config.implementation == "dtensor"
    assert sc.topology.num_devices == spec.world_size


@pytest.mark.parametrize("argv, key", [
    (["--strategies", "bogus"], "--strategies"),
    (["--seq-len", "0"], "--seq-len"),
    pytest.param(["--method", "cuda"], "no CUDA device", marks=pytest.mark.skipif(
        __import__("torch").cuda.is_available(), reason="a GPU is there: cuda runs")),
])
def test_bad_options_exit_2_naming_them(capsys, argv, key):
    from hzpsim.cli import main

    assert main(["validate", "memory", *argv]) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_prints_one_row_per_strategy_and_method(capsys):
    from hzpsim.cli import main

    assert main(["validate", "memory", "--strategies", "zero", "--method", "fake", "--seq-len", "256", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["strategy"], r["method"]) for r in rows] == [("zero", "fake")]
    row = rows[0]
    assert {"strategy", "method", "model", "world", "measured_peak_allocated_bytes",
            "predicted_peak_allocated_bytes", "crosscheck_rel_diff"} <= set(row)
    assert row["crosscheck_rel_diff"] < 0.01
    assert abs(row["rel_error"]) < 0.03
