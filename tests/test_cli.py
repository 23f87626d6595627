"""The ``hzpsim`` command against DESIGN §5: ``list``, ``run --json``, tables, ``compare``, exit codes."""

from __future__ import annotations

import argparse
import ast
import json
import math
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hzpsim.cli import main
from hzpsim.hardware.devices import DEVICES
from hzpsim.scenario import load_scenario

# DESIGN §5: `hzpsim run SCENARIO.yaml --json` prints one object with at least these keys.
DESIGN_KEYS = (
    "step_time_s",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "tflops_per_device",
    "mfu",
    "hfu",
    "peak_memory_bytes",
    "peak_memory_allocated_bytes",
    "peak_memory_reserved_bytes",
    "device_overhead_bytes",
    "memory_headroom_bytes",
    "memory_capacity_bytes",
    "memory_breakdown_bytes",
    "fits_in_memory",
    "exposed_comm_s",
    "overlap_fraction",
    "bubble_fraction",
    "comm_bytes_per_device",
    "strategy_resolved",
    "num_devices",
    "sim_wall_s",
    "num_events",
)
BREAKDOWN_KEYS = {"params", "grads", "optimizer", "activations", "temporaries", "buffers", "other"}
COMM_KEYS = {"intra_node", "inter_node"}
FRACTIONS = ("mfu", "hfu", "overlap_fraction", "bubble_fraction")

TINY = {
    "model": "tiny-dense",
    "training": {"global_batch_size": 8},
    "cluster": {"preset": "dgx-h100", "num_nodes": 1},
    "strategy": {"name": "zero", "stage": 3},
}
TINY_LIST = {
    **{k: v for k, v in TINY.items() if k != "strategy"},
    "strategies": [{"name": "zero", "stage": s} for s in (1, 2, 3)],
}


def write(tmp_path: Path, data: Any, name: str = "scenario.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def strict_json(text: str) -> Any:
    """json.loads that refuses NaN/Infinity (not JSON; other tools would choke)."""

    def refuse(constant: str) -> Any:
        raise AssertionError(f"non-JSON constant {constant} in output")

    return json.loads(text, parse_constant=refuse)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_input_error(rc: int, out: str, err: str, *needles: str) -> None:
    assert rc == 2, (rc, err)
    assert err.startswith("hzpsim: error: "), err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


# --------------------------------------------------------------------------- list


def test_list_everything(capsys):
    rc, out, err = cli(capsys, "list")
    assert rc == 0 and err == ""
    for device in (
        "a100-40gb",
        "a100-80gb",
        "h100-sxm",
        "h200",
        "mi250x",
        "v100",
        "npu-910b",
        "cpu-local",
    ):
        assert device in out
    for preset in ("dgx-a100", "dgx-h100", "dgx-h200", "hzp-npu", "frontier", "local-cpu"):
        assert preset in out
    for workload in ("llama2-70b", "tiny-dense", "tiny-moe", "mixtral-8x7b"):
        assert workload in out
    strategies_line = next(line for line in out.splitlines() if line.startswith("strategies:"))
    assert "zero" in strategies_line


@pytest.mark.parametrize(
    "what, present, absent",
    [
        ("devices", "h100-sxm", "workloads:"),
        ("presets", "dgx-h100", "devices:"),
        ("workloads", "llama2-70b", "cluster presets:"),
        ("strategies", "zero", "workloads:"),
    ],
)
def test_list_one_kind(capsys, what: str, present: str, absent: str):
    rc, out, _ = cli(capsys, "list", what)
    assert rc == 0
    assert present in out
    assert absent not in out


def test_list_devices_covers_the_catalog(capsys):
    _, out, _ = cli(capsys, "list", "devices")
    for name in DEVICES:
        assert name in out


# --------------------------------------------------------------------------- run --json


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory) -> dict[str, Any]:
    path = write(tmp_path_factory.mktemp("run"), TINY)
    out = subprocess.run(
        [sys.executable, "-m", "hzpsim.cli", "run", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    return strict_json(out.stdout)


def test_run_json_is_one_object_with_every_design_key(tiny_report):
    assert isinstance(tiny_report, dict)
    missing = [k for k in DESIGN_KEYS if k not in tiny_report]
    assert not missing, f"absent keys (must be present, null if they do not apply): {missing}"
    assert BREAKDOWN_KEYS <= set(tiny_report["memory_breakdown_bytes"])
    assert COMM_KEYS <= set(tiny_report["comm_bytes_per_device"])


def test_run_json_values_follow_the_definitions(tiny_report):
    r = tiny_report
    sc = load_scenario(
        None,
        [
            "model=tiny-dense",
            "cluster.num_nodes=1",
            "training.global_batch_size=8",
            "training.activation_recompute=none",
            "strategy.name=zero",
        ],
    )
    model = sc.model
    psi = model.num_params()
    assert psi == 4 * 725_504 + 1024 * 256 + (1024 * 256 + 256)  # tiny-dense: 4 layers, embedding, head
    assert r["num_devices"] == 8
    # ZeRO-3 over 8 ranks, one micro-batch: forward and backward gathers of 2 B/param and one
    # reduce-scatter of 4 B/param, each (N-1)/N of the model per rank (strategies.md §2.8),
    # plus the gradient norm: a ring all-reduce of one fp32 over 8 ranks, 2 x 7/8 x 4 B = 7 B
    comm = 7 / 8 * psi * (2 + 2 + 4) + 7
    # the step cannot beat the NVLink that carries those bytes (450 GB/s per GPU, dgx-h100)
    assert r["step_time_s"] >= comm / 450e9
    assert r["tokens_per_s"] == pytest.approx(8 * model.seq_len / r["step_time_s"], rel=1e-9)
    assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 8, rel=1e-9)
    peak = DEVICES["h100-sxm"].peak_flops_per_s("bf16")
    mfu = model.model_flops_per_token() * 8 * model.seq_len / (r["step_time_s"] * 8 * peak)
    assert r["mfu"] == pytest.approx(mfu, rel=1e-6)
    assert r["tflops_per_device"] == pytest.approx(r["mfu"] * peak / 1e12, rel=1e-6)
    assert r["hfu"] == pytest.approx(r["mfu"], rel=1e-9)  # no recompute
    for key in FRACTIONS:
        if r[key] is not None:
            assert 0 <= r[key] <= 1, key
    assert r["bubble_fraction"] is None  # pp = 1: does not apply -> null, present
    assert r["memory_capacity_bytes"] == pytest.approx(DEVICES["h100-sxm"].memory_bytes)
    assert r["fits_in_memory"] is True
    assert sum(r["memory_breakdown_bytes"][k] for k in BREAKDOWN_KEYS) == pytest.approx(
        r["peak_memory_allocated_bytes"]
    )
    # the caching allocator reserves at least what it hands out; peak_memory_bytes is the reserved
    assert r["peak_memory_allocated_bytes"] <= r["peak_memory_reserved_bytes"] == r["peak_memory_bytes"]
    assert r["memory_headroom_bytes"] >= (
        r["memory_capacity_bytes"] - r["device_overhead_bytes"] - r["peak_memory_reserved_bytes"]) - 1.0
    assert all(v >= 0 for v in r["memory_breakdown_bytes"].values())
    assert r["comm_bytes_per_device"]["inter_node"] == 0  # one node
    assert r["comm_bytes_per_device"]["intra_node"] == pytest.approx(comm, rel=1e-12)
    assert r["exposed_comm_s"] >= 0
    assert r["strategy_resolved"]["name"] == "zero" and r["strategy_resolved"]["stage"] == 3
    # 2 steps x (6 units x (forward gather, forward, backward gather, backward, reduce-scatter)
    # + norm + optimizer) = 64 ops, each ending on at least one SimPy event
    assert isinstance(r["num_events"], int) and r["num_events"] >= 2 * (6 * 5 + 2)
    assert isinstance(r["sim_wall_s"], float) and r["sim_wall_s"] >= 0
    for key, value in r.items():
        if isinstance(value, float):
            assert math.isfinite(value), key


def test_run_json_in_process_matches_contract(tmp_path, capsys):
    rc, out, err = cli(
        capsys, "run", str(write(tmp_path, TINY)), "--json", "--set", "strategy.stage=1"
    )
    assert rc == 0, err
    report = strict_json(out)
    assert isinstance(report, dict)
    assert all(k in report for k in DESIGN_KEYS)
    assert report["strategy_resolved"]["stage"] == 1


def test_run_table_for_a_strategies_list(tmp_path, capsys):
    rc, out, err = cli(capsys, "run", str(write(tmp_path, TINY_LIST)))
    assert rc == 0, err
    assert "tiny-dense" in out  # the summary
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("strategy"))
    assert "step s" in lines[header] and "MFU" in lines[header]
    end = lines.index("", header)
    rows = lines[header + 2 : end]
    assert [row.split()[0] for row in rows] == ["zero(stage=1)", "zero(stage=2)", "zero(stage=3)"]
    # then one line per strategy: its step time with the 80 % interval and what it stands on
    intervals = lines[end + 1 : end + 4]
    assert [line.split()[0] for line in intervals] == ["zero(stage=1)", "zero(stage=2)", "zero(stage=3)"]
    assert all("80% interval from the held-out errors of" in line for line in intervals)


def test_run_default_scenario_with_sets(capsys):
    rc, out, err = cli(
        capsys,
        "run",
        "--set",
        "model=llama3-8b",
        "--set",
        "model.num_layers=2",
        "--set",
        "cluster.num_nodes=4",
        "--set",
        "training.global_batch_size=32",
        "--json",
    )
    assert rc == 0, err
    reports = strict_json(out)
    reports = reports if isinstance(reports, list) else [reports]
    for report in reports:
        assert all(k in report for k in DESIGN_KEYS)


def test_compare_json_prints_a_list(tmp_path, capsys):
    rc, out, err = cli(capsys, "compare", str(write(tmp_path, TINY_LIST)), "--json")
    assert rc == 0, err
    reports = strict_json(out)
    assert isinstance(reports, list) and len(reports) == 3
    assert [r["strategy_resolved"]["stage"] for r in reports] == [1, 2, 3]
    for r in reports:
        assert all(k in r for k in DESIGN_KEYS)


def test_compare_json_with_one_strategy_is_still_a_list(tmp_path, capsys):
    rc, out, _ = cli(capsys, "compare", str(write(tmp_path, TINY)), "--json")
    assert rc == 0
    reports = strict_json(out)
    assert isinstance(reports, list) and len(reports) == 1


def test_compare_table_with_one_strategy_notes_it(tmp_path, capsys):
    rc, out, err = cli(capsys, "compare", str(write(tmp_path, TINY)))
    assert rc == 0
    assert "strategies" in err
    assert "zero(stage=3)" in out


# --------------------------------------------------------------------------- exit codes


def test_missing_scenario_file_exits_2(tmp_path, capsys):
    rc, out, err = cli(capsys, "run", str(tmp_path / "absent.yaml"), "--json")
    assert_input_error(rc, out, err, "absent.yaml")
    assert out == ""


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"model": {"preset": "tiny-dense", "foo": 1}}, "model.foo"),
        ({"cluster": {"preset": "dgx-h100", "nodes": 1}}, "cluster.nodes"),
        ({"strategy": {"name": "zero", "stagee": 3}}, "strategy.stagee"),
        ({"training": {"global_batch_size": 12}}, "training.global_batch_size"),
        ({"model": "no-such-model"}, "no-such-model"),
        ({"strategy": {"name": "no-such-strategy"}}, "strategy.name"),
    ],
)
def test_bad_scenarios_exit_2_naming_the_path(tmp_path, capsys, change, needle):
    rc, out, err = cli(capsys, "run", str(write(tmp_path, {**TINY, **change})), "--json")
    assert_input_error(rc, out, err, needle)


def test_bad_set_exits_2(tmp_path, capsys):
    rc, out, err = cli(capsys, "run", str(write(tmp_path, TINY_LIST)), "--set", "strategy.stage=2")
    assert_input_error(rc, out, err, "strategies")
    rc, out, err = cli(capsys, "run", str(write(tmp_path, TINY)), "--set", "nonsense")
    assert_input_error(rc, out, err, "--set")


def test_invalid_yaml_exits_2(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("model: [unclosed\n")
    rc, out, err = cli(capsys, "run", str(path))
    assert_input_error(rc, out, err, "broken.yaml")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["list", "gadgets"],
        ["run", "--no-such-flag"],
        ["run", "a.yaml", "b.yaml"],
        ["run", "--set"],
    ],
)
def test_argparse_errors_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err


def test_exit_codes_of_the_real_process(tmp_path):
    """As a process: 2 for bad input and for argparse errors, 0 for `list`."""
    run = [sys.executable, "-m", "hzpsim.cli"]
    ok = subprocess.run([*run, "list"], capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0
    bad = subprocess.run(
        [*run, "run", str(tmp_path / "absent.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("hzpsim: error:")
    usage = subprocess.run([*run, "bogus"], capture_output=True, text=True, timeout=60, check=False)
    assert usage.returncode == 2 and "Traceback" not in usage.stderr


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("hzpsim ")


# --------------------------------------------------------------------------- one module per command


def _runnable_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) of every parser that runs: those without subcommands of their own."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield path, parser
        return
    for name, child in groups[0].choices.items():
        yield from _runnable_parsers(child, (*path, name))


def test_every_command_is_one_module_registered_one_way():
    """hzpsim/cli/: a module per command, each with ``register(subparsers)``, all of them in
    ``COMMANDS`` (``options`` is shared arguments, not a command), and every parser that runs
    carries its ``handler``: no command is dispatched any other way."""
    import hzpsim.cli as cli

    modules = {m.name for m in pkgutil.iter_modules(cli.__path__)} - {"__main__", "options"}
    assert modules == {c.__name__.rsplit(".", 1)[1] for c in cli.COMMANDS}
    assert all(callable(c.register) for c in cli.COMMANDS)
    found = dict(_runnable_parsers(cli.make_parser()))
    assert {" ".join(words) for words in found} == {
        "run", "compare", "search", "regress", "validate published", "validate executor", "validate memory", "execute",
        "calibrate machine", "calibrate published", "calibrate measured", "list",
        "import megatron", "import torchtitan", "import deepspeed"}
    for words, parser in found.items():
        assert callable(parser.get_default("handler")), words


def test_only_the_cli_parses_command_lines():
    """argparse lives in hzpsim/cli/ (and in the executor's own process entry points, which
    torchrun and the calibration start): the packages below hold no command handling."""
    package = Path(__file__).resolve().parents[1] / "hzpsim"
    allowed = {"executor/worker.py", "executor/calibrate.py"}
    offenders = []
    for path in package.rglob("*.py"):
        rel = path.relative_to(package).as_posix()
        if rel.startswith("cli/") or rel in allowed:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if "argparse" in names:
                offenders.append(f"hzpsim/{rel}:{node.lineno}")
    assert not offenders, offenders
