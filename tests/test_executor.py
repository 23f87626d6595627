"""The real-torch executor against the single-process reference and against the simulator.

Run: ``python -m pytest tests/test_executor.py`` (needs the torch extra: pip install -e '.[dev,torch]';
skipped without torch). The world-4 comparisons spawn 4 gloo processes per strategy (about a
minute on 2 cores, marked slow; CI runs them).
"""

from __future__ import annotations

import ast
import copy
import math
import sys
from pathlib import Path

import pytest

from hzpsim.cli import main
from hzpsim.validation.executor import DEFAULT_SCENARIO

ROOT = Path(__file__).resolve().parents[1]

TINY_MODEL = {"name": "exec-tiny", "num_layers": 2, "hidden_size": 64, "num_heads": 4, "ffn_hidden_size": 128,
              "vocab_size": 256, "seq_len": 32, "dropout": False}
TINY = {
    "model": TINY_MODEL,
    "training": {"global_batch_size": 8, "micro_batch_size": 1, "precision": "fp32", "grad_dtype": "fp32",
                 "activation_recompute": "none"},
    "cluster": {"preset": "local-cpu"},
    "strategies": DEFAULT_SCENARIO["strategies"],  # the validation's five world-4 strategies
}


def test_executor_never_imports_the_simulator():
    """hzpsim/executor/ must not import hzpsim.sim (so executor and simulator can disagree)."""
    offenders = []
    for path in sorted((ROOT / "hzpsim" / "executor").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            offenders += [f"{path.name}: {n}" for n in names if n == "hzpsim.sim" or n.startswith("hzpsim.sim.")]
    assert not offenders, offenders


def test_loading_the_executor_loads_no_simulator_module():
    """Transitively too: importing every executor module (a fresh interpreter) loads nothing
    of hzpsim.sim, the planner or the report."""
    pytest.importorskip("torch")
    import subprocess

    modules = [f"hzpsim.executor.{p.stem}" for p in sorted((ROOT / "hzpsim" / "executor").glob("*.py"))
               if p.stem != "__init__"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print(sorted(m for m in sys.modules if m.startswith(('hzpsim.sim', 'hzpsim.run', 'hzpsim.report'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def _executor_imports(sources: dict[str, str]) -> dict[str, set[str]]:
    """Executor module -> the executor modules it imports (at any depth, ``from hzpsim.executor
    import model`` included)."""
    graph: dict[str, set[str]] = {}
    for name, source in sources.items():
        found = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module == "hzpsim.executor":
                found |= {a.name for a in node.names if a.name in sources}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hzpsim.executor."):
                found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("hzpsim.executor.")}
        graph[name] = found - {name}
    return graph


def _import_circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` as [a, b, ..., a], or [] when the arrows point one way."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for other in sorted(graph.get(node, ())):
            if state.get(other) == 1:
                return path[path.index(other):] + [other]
            if other not in state and (found := visit(other, path + [other])):
                return found
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return []


def test_executor_modules_import_one_way():
    """No import circle inside hzpsim/executor/ (trainers.py is the table that imports the
    trainers; the trainers share executor/common.py and never import the table)."""
    sources = {p.stem: p.read_text(encoding="utf-8") for p in (ROOT / "hzpsim" / "executor").glob("*.py")
               if p.stem != "__init__"}
    graph = _executor_imports(sources)
    assert graph["trainers"] >= {"nd", "asynchzp", "fsdp", "reference"}
    assert _import_circle(graph) == [], _import_circle(graph)
    # the check sees a circle when there is one
    sources["nd"] += "\nfrom hzpsim.executor.trainers import make_trainer\n"
    assert _import_circle(_executor_imports(sources)) == ["nd", "trainers", "nd"]


def test_the_executor_names_strategies_as_the_simulator_does():
    """RunSpec.strategy is a simulator plugin name (or ``reference``); ZeRO's stage is a layout
    field."""
    from hzpsim import strategies
    from hzpsim.config import ScenarioError
    from hzpsim.executor.spec import (
        EXECUTOR_STRATEGIES,
        SIMULATOR_STRATEGIES,
        Layout,
        RunSpec,
        run_specs,
    )
    from hzpsim.scenario import scenario_from_mapping

    assert set(SIMULATOR_STRATEGIES) <= set(strategies.available())
    assert set(EXECUTOR_STRATEGIES) == {"reference", *SIMULATOR_STRATEGIES}
    raw = copy.deepcopy(TINY)
    raw["strategies"] = [{"name": "zero", "stage": 2}, {"name": "zero"}, {"name": "hsdp", "shard_group_size": 2}]
    specs = run_specs(scenario_from_mapping(raw), 4)
    assert [(s.strategy, s.layout.stage) for s in specs] == [("zero", 2), ("zero", 3), ("hsdp", 3)]
    assert [s.label for s in specs][:2] == ["zero(stage=2)", "zero(stage=3)"]
    with pytest.raises(ScenarioError, match="stage 2 or 3"):
        RunSpec(specs[0].model, "zero", 2, 8, 1, layout=Layout(stage=1)).validate()
    with pytest.raises(ScenarioError, match="'zero3'"):
        RunSpec(specs[0].model, "zero3", 2, 8, 1).validate()


def test_the_trainer_table_has_the_executor_strategies():
    pytest.importorskip("torch")
    from hzpsim.executor.spec import EXECUTOR_STRATEGIES, TRAINER_KINDS
    from hzpsim.executor.trainers import TRAINERS

    assert tuple(TRAINER_KINDS) == EXECUTOR_STRATEGIES  # every strategy has a trainer kind
    assert set(TRAINER_KINDS.values()) == set(TRAINERS)  # every kind is a trainer, none unused


@pytest.mark.parametrize("filters, expected", [
    (["zero"], [("zero", {"stage": 2}), ("zero", {"stage": 3})]),
    (["zero(stage=2)"], [("zero", {"stage": 2})]),
    (["zero(stage=3)", "nd"], [("zero", {"stage": 3}), ("nd", {"tp": 2})]),
    (["nd(tp=2,sequence_parallel=true)"], []),
    (["asynchzp(async=false)"], [("asynchzp", {"async": False})]),
])
def test_validate_executor_filters_by_simulator_name_and_fields(filters, expected):
    """``--strategies NAME`` or ``NAME(FIELD=VALUE,...)``: a field the entry leaves out has the
    strategy's default (``zero`` is stage 3 unless it says otherwise)."""
    from hzpsim.config import ScenarioError
    from hzpsim.validation.executor import scenario_for_world

    raw = copy.deepcopy(TINY)
    raw["strategies"] = [{"name": "zero", "stage": 2}, {"name": "zero"}, {"name": "nd", "tp": 2},
                         {"name": "asynchzp", "async": False}]
    if not expected:
        with pytest.raises(ScenarioError, match="no strategy of the scenario matches"):
            scenario_for_world(raw, 4, {}, filters=filters)
        return
    chosen = scenario_for_world(raw, 4, {}, filters=filters).strategies
    assert [c.name for c in chosen] == [name for name, _ in expected]
    for choice, (_, fields) in zip(chosen, expected):
        assert {k: choice.resolved()[k] for k in fields} == fields


def test_import_checker_catches_a_sim_import(tmp_path):
    """The AST scan above can fail: it flags ``from hzpsim.sim import engine``."""
    tree = ast.parse("from hzpsim.sim import engine\nimport hzpsim.hardware.compute\n")
    found = [n for node in ast.walk(tree) if isinstance(node, ast.ImportFrom | ast.Import)
             for n in ([node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])]
    assert any(n and n.startswith("hzpsim.sim") for n in found)


# ------------------------------------------------------------------------------- CLI, no torch needed


def test_execute_without_torch_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    assert main(["execute", str(ROOT / "examples" / "executor-world4.yaml"), "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hzpsim: error: ") and "torch" in err and err.count("\n") == 1
    assert main(["validate", "executor", "--world", "2"]) == 2
    assert main(["calibrate", "machine", "--world", "2"]) == 2


@pytest.mark.parametrize("argv, words", [
    (["execute", "no-such-file.yaml"], "no such scenario file"),
    (["execute", "examples/executor-world4.yaml", "--world", "0"], "--world"),
    (["execute", "examples/executor-world4.yaml", "--set", "training.precision=bf16"], "fp32"),
    (["execute", "examples/executor-world4.yaml", "--set", "strategy.name=zero", "--set", "strategy.stage=1"], "stage"),
    (["execute", "examples/executor-world4.yaml", "--world", "3"], "divisible"),
    (["validate", "executor", "--strategies", "bogus"], "--strategies"),
    (["validate", "executor", "--strategies", "zero3"], "unknown 'zero3' (known: zero, hsdp, nd, asynchzp"),
    (["validate", "executor", "--strategies", "zero(stag=2),hsdp"], "zero has no field 'stag'"),
    (["validate", "executor", "--strategies", "zero(stage=4)"], "--strategies zero.stage: 4"),
    (["validate", "executor", "--profile", "no-such-profile.yaml"], "--profile"),
    (["validate", "executor", "--steps", "1"], "--steps"),
    (["calibrate", "machine", "--world", "0"], "--world"),
])
def test_executor_cli_bad_input_exits_2(argv, words, capsys, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hzpsim: error: ") and words in err and err.count("\n") == 1, err


# ------------------------------------------------------------------------------- model


def test_units_have_the_simulators_parameter_counts():
    pytest.importorskip("torch")
    from hzpsim.executor.model import build, unit_param_counts
    from hzpsim.model import Model, MoE

    for model in (Model(2, 64, 4, 128, 256, 32, num_kv_heads=2, dropout=False),
                  Model(3, 64, 4, 128, 256, 32, dropout=False, mlp="gelu", linear_bias=True, norm="layernorm",
                        norm_bias=True, position_embedding="learned"),
                  Model(2, 64, 4, 128, 256, 32, dropout=False,
                        moe=MoE(num_experts=4, top_k=2, expert_ffn_hidden_size=64, num_shared_experts=1))):
        expected = ([model.embedding_params()] + [model.layer_params(i) for i in range(model.num_layers)]
                    + [model.head_params() + model.final_norm_params()])
        assert unit_param_counts(build(model, 0)) == expected


# ------------------------------------------------------------------------------- world 4 vs simulator


EAGER_VARIANTS = [{}, {"num_kv_heads": 4}, {"norm": "layernorm"}, {"linear_bias": True}, {"norm_bias": True},
                  {"position_embedding": "learned"},
                  {"norm": "layernorm", "norm_bias": True, "linear_bias": True, "position_embedding": "learned",
                   "num_kv_heads": 4},
                  {"moe": "4x2+1"}, {"moe": "4x1+0", "linear_bias": True, "norm": "layernorm"}]


def _moe(text: str):
    """"EXk+S": E routed experts, top-k, S shared experts."""
    from hzpsim.model import MoE

    experts, rest = text.split("x")
    top_k, shared = rest.split("+")
    return MoE(num_experts=int(experts), top_k=int(top_k), expert_ffn_hidden_size=32, num_shared_experts=int(shared))


@pytest.mark.parametrize("variant", EAGER_VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "llama")
def test_simulator_eager_op_count_equals_what_pytorch_dispatches(variant):
    """The simulator's host work per micro-batch (the eager ATen ops of every unit,
    ``MPUnit.kernels_forward`` / ``kernels_backward``, from ``Model.layer_kernels_forward``) equals
    a TorchDispatchMode count of the executor's model, forward + loss and backward, for
    SwiGLU layers with every norm / bias / position / GQA variant and MoE layers; per layer and
    in total."""
    pytest.importorskip("torch")
    from hzpsim.executor.model import batch, build, dispatched_ops
    from hzpsim.model import Model
    from hzpsim.scenario import Training
    from hzpsim.strategies._dims import ParallelDims
    from hzpsim.strategies._mp_units import mp_units

    def counts(layers: int) -> tuple[tuple[int, int], tuple[float, float]]:
        model = Model(**{"num_layers": layers, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
                         "ffn_hidden_size": 64, "vocab_size": 64, "seq_len": 8, "dropout": False,
                         **{k: _moe(v) if k == "moe" else v for k, v in variant.items()}})
        tokens, targets = batch(model, 0, 1, 0)
        ops = dispatched_ops(build(model, 0), tokens, targets)
        units = mp_units(model, Training(global_batch_size=1, micro_batch_size=1, precision="fp32",
                                         grad_dtype="fp32"), ParallelDims())
        return ((sum(ops["forward"].values()), sum(ops["backward"].values())),
                (sum(u.kernels_forward for u in units), sum(u.kernels_backward for u in units)))

    (one, one_predicted), (two, two_predicted) = counts(1), counts(2)
    assert two_predicted == two and one_predicted == one
    assert two[0] > 3 * len(variant) + 60  # a real count (a layer dispatches dozens of ops), not a tautology


def test_compile_still_launches_fewer_kernels_than_eager():
    from hzpsim.model import Model
    from hzpsim.scenario import Training
    from hzpsim.strategies._dims import ParallelDims
    from hzpsim.strategies._mp_units import mp_units

    model = Model(2, 64, 4, 128, 256, 32, num_kv_heads=2, dropout=False)
    eager, compiled = (mp_units(model, Training(global_batch_size=1, micro_batch_size=1, compile=c), ParallelDims())[1]
                       for c in (False, True))
    assert compiled.kernels_forward < eager.kernels_forward / 3
    assert compiled.kernels_backward < eager.kernels_backward / 3


@pytest.mark.parametrize("shared", [True, False])
def test_collectives_on_compute_cores_pause_compute(shared):
    """cpu-local (gloo on the CPUs that compute): a rank's compute, host work included, makes no
    progress while its collective moves bytes, so a 1 s op overlapped with a collective of T
    seconds ends at 1 + T; a GPU-like device overlaps it for free (ends at 1 s)."""
    import dataclasses

    from hzpsim.hardware.collectives import CollectiveModel
    from hzpsim.hardware.compute import Efficiency
    from hzpsim.hardware.topology import ClusterSpec, build_topology
    from hzpsim.model.ops import OpGraph
    from hzpsim.sim.engine import simulate

    topology = build_topology(ClusterSpec(preset="local-cpu", gpus_per_node=2))
    assert topology.device.communication_uses_compute_cores  # the cpu-local preset
    topology.device = dataclasses.replace(topology.device, communication_uses_compute_cores=shared)
    unit = Efficiency(gemm=1.0, attention_forward=1.0, attention_backward=1.0, hbm=1.0, source="test: peak rates")
    graph = OpGraph(2, {0: 1, 1: 1}, "fp32")
    group = graph.add_group("pair", [0, 1])
    size = 4e9
    graph.collective("all_gather", group, [0, 1], size, "ag", "gather", "comm")
    host = [graph.compute(r, "host", "host", {}, stream="host", duration_s=1.0) for r in (0, 1)]
    device = [graph.compute(r, "gemm", "forward", {"gemm": topology.device.peak_fp32_flops_per_s}) for r in (0, 1)]
    trace = simulate(graph, topology, unit)
    comm_s = trace.end_s[0] - trace.start_s[0]
    plan = CollectiveModel(topology).plan("all_gather", size, topology.span([0, 1]))
    assert trace.start_s[0] == 0.0 and comm_s == pytest.approx(plan.isolated_time_s, rel=0.05) and comm_s > 0.1
    expected = 1.0 + comm_s if shared else 1.0
    for op in host + device:
        assert trace.end_s[op] == pytest.approx(expected, rel=1e-6)


@pytest.fixture(scope="module")
def world4_rows():
    pytest.importorskip("torch")
    from hzpsim.validation.executor import compare, scenario_for_world

    scenario = scenario_for_world(TINY, 4, {})
    rows = compare(scenario, 4, num_steps=3, timeout_s=300, measure_memory=False)
    return {r["label"]: r for r in rows}


def _row(rows, prefix):
    [row] = [r for label, r in rows.items() if label.startswith(prefix)]
    return row


STRATEGY_PREFIXES = ["zero(", "hsdp(", "nd(implementation=dtensor,pp=2", "nd(dp=2", "asynchzp("]  # labels: non-default fields, sorted


@pytest.mark.slow
@pytest.mark.parametrize("prefix", STRATEGY_PREFIXES)
def test_world4_losses_match_the_reference(world4_rows, prefix):
    row = _row(world4_rows, prefix)
    assert row["world_size"] == 4
    assert row["loss_max_abs_diff_vs_reference"] < 1e-3, row["losses"]
    assert all(math.isfinite(x) for x in row["losses"])
    assert row["counting_complete"], "some collective bypassed the counting kernels"


@pytest.mark.slow
@pytest.mark.parametrize("prefix", STRATEGY_PREFIXES)
def test_world4_collectives_equal_the_simulator(world4_rows, prefix):
    """Every kind's calls and bytes, summed over the ranks, equal the simulator's: for ND the
    sequence-parallel gathers and reduce-scatters, the head's logits gather (the ``dtensor``
    profile) and the per-step norm-gradient all-reduce included."""
    row = _row(world4_rows, prefix)
    assert row["measured_collective_counts"] == row["predicted_collective_counts"]
    assert row["measured_comm_bytes"] == row["predicted_comm_bytes"]
    assert set(row["measured_comm_bytes"]) == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv"}


@pytest.mark.slow
@pytest.mark.parametrize("prefix", STRATEGY_PREFIXES)
def test_world4_model_states_equal_the_simulator(world4_rows, prefix):
    """FSDP2 and DTensor keep the fp32 parameter as the optimizer's master (16 B/parameter,
    the ``fsdp2``/``dtensor`` layout); our AsyncHZP keeps a separate master shard."""
    row = _row(world4_rows, prefix)
    assert row["measured_model_state_bytes"] == row["predicted_model_state_bytes"]
    if not prefix.startswith("asynchzp"):
        breakdown = row["measured_model_state_breakdown_bytes"]
        assert breakdown["optimizer"] == 2 * breakdown["params"]


# ------------------------------------------------------------------------------- smaller runs


def _run(strategy: str, world: int, model=None, steps: int = 3, **layout):
    from hzpsim.executor.runner import max_loss_diff, reference_losses, run
    from hzpsim.executor.spec import Layout, RunSpec
    from hzpsim.model import Model

    model = model or Model(2, 64, 4, 128, 256, 32, dropout=False)
    spec = RunSpec(model, strategy, world, global_batch_size=8, micro_batch_size=1, num_steps=steps,
                   layout=Layout(**layout), measure_memory=False)
    result = run(spec, timeout_s=300)
    return result, max_loss_diff(result, reference_losses(spec))


@pytest.mark.slow
@pytest.mark.parametrize("prefix", STRATEGY_PREFIXES)
def test_world4_rows_account_the_cpu(world4_rows, prefix):
    """Each row carries the ranks' CPU per step and the machine's busy CPU: positive, the ranks'
    CPU within what the machine's cores can give in the step, and counted in the machine's."""
    import os

    row = _row(world4_rows, prefix)
    cpu, busy, wall = row["measured_cpu_s_per_step"], row["measured_machine_busy_s_per_step"], row["measured_step_time_s"]
    assert cpu > 0 and busy > 0
    assert cpu <= (os.cpu_count() or 1) * wall * 1.2 + 0.05  # /proc tick and timer slack
    assert busy >= 0.5 * cpu


@pytest.mark.slow
def test_validation_predicts_at_the_load_the_run_measured():
    """With the calibration's sharing factor, the ranks measure it again around their steps and
    the step is predicted at the run's load: every CPU cost x run / calibration factor."""
    pytest.importorskip("torch")
    from hzpsim.validation.executor import compare, scenario_for_world

    raw = copy.deepcopy(TINY)
    raw["training"]["global_batch_size"] = 4
    raw["strategies"] = [{"name": "asynchzp", "param_group_size": 2}]
    scenario = scenario_for_world(raw, 2, {})
    # a calibration at half the CPU time per wall second any run can have: the run's load is >= 1.8x
    [row] = compare(scenario, 2, num_steps=3, timeout_s=300, measure_memory=False, calibration_sharing=0.5)
    assert row["sharing_factor_calibration"] == 0.5 and row["sharing_factor_run"] >= 0.9  # wall >= CPU, up to slack
    factor = row["sharing_factor_run"] / 0.5
    assert row["predicted_step_time_s"] == pytest.approx(factor * row["predicted_step_time_at_calibration_load_s"], rel=0.1)


@pytest.mark.slow
def test_moe_under_zero3_matches_the_reference():
    pytest.importorskip("torch")
    from hzpsim.model import Model, MoE

    model = Model(2, 64, 4, 128, 256, 32, dropout=False,
                  moe=MoE(num_experts=4, top_k=2, expert_ffn_hidden_size=64))
    result, diff = _run("zero", 2, model)
    assert diff < 1e-3
    # the routed experts are their own FSDP unit, as hzpsim shards expert parameters on their own
    from hzpsim.validation.executor import predicted_collectives, scenario_for_world

    raw = copy.deepcopy(TINY)
    raw["model"] = {**TINY_MODEL, "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 64}}
    raw["strategies"] = [{"name": "zero", "stage": 3}]
    scenario = scenario_for_world(raw, 2, {})
    predicted = predicted_collectives(scenario, scenario.strategies[0])
    assert result.collective_counts == predicted["counts"]
    assert result.comm_bytes == predicted["bytes"]


@pytest.mark.slow
def test_interleaved_pipeline_sends_equal_the_simulator():
    pytest.importorskip("torch")
    from hzpsim.model import Model
    from hzpsim.validation.executor import predicted_collectives, scenario_for_world

    result, diff = _run("nd", 2, model=Model(4, 64, 4, 128, 256, 32, dropout=False), pp=2, vpp=2)
    assert diff < 1e-3
    raw = copy.deepcopy(TINY)
    raw["model"] = {**TINY_MODEL, "num_layers": 4}
    raw["strategies"] = [{"name": "nd", "pp": 2, "vpp": 2}]
    scenario = scenario_for_world(raw, 2, {})
    predicted = predicted_collectives(scenario, scenario.strategies[0])
    assert result.collective_counts == predicted["counts"]
    assert result.comm_bytes == predicted["bytes"]


@pytest.mark.slow
def test_asynchzp_background_threads_overlap_a_slow_network():
    """With an artificial 20 ms host delay per collective call, AsyncHZP with one background
    thread per stream (ag, rs, dp) finishes its step sooner than the same collectives issued in
    program order from ONE thread (hzpsim's ``async: false``); the simulator, given the delay
    as latency, predicts the same direction and a saving within 30 % of the measured one.
    Two ranks: every collective then has a 2-rank group, where a per-call delay is exactly one
    ring-step latency for the simulator (see docs/executor.md)."""
    pytest.importorskip("torch")
    from hzpsim.executor.runner import run
    from hzpsim.executor.spec import run_specs
    from hzpsim.run import run_choice
    from hzpsim.validation.executor import scenario_for_world

    delay = 0.02
    raw = copy.deepcopy(TINY)
    raw["training"]["global_batch_size"] = 4
    measured, predicted = {}, {}
    for asynchronous in (True, False):
        raw["strategies"] = [{"name": "asynchzp", "param_group_size": 2, "async": asynchronous}]
        scenario = scenario_for_world(raw, 2, {}, comm_delay_s=delay)
        spec = run_specs(scenario, 2, num_steps=5, comm_delay_s=delay, measure_memory=False)[0]
        measured[asynchronous] = run(spec, timeout_s=300).step_time_s
        predicted[asynchronous] = run_choice(scenario, scenario.strategies[0])["step_time_s"]
    assert measured[True] < measured[False], measured
    assert predicted[True] < predicted[False], predicted
    saving_measured = measured[False] - measured[True]
    saving_predicted = predicted[False] - predicted[True]
    assert abs(saving_predicted / saving_measured - 1) <= 0.30, (measured, predicted)


@pytest.mark.slow
def test_calibrate_machine_writes_a_profile_the_simulator_reads(tmp_path, monkeypatch, capsys):
    """``hzpsim calibrate machine`` without --out writes the local-cpu preset, the cpu-local
    device file and a profile naming it into the user config folder; the simulator then uses
    them (``cluster.device: cpu-local`` reads the user's file before the built-in one)."""
    pytest.importorskip("torch")
    import yaml

    from hzpsim.calibration.profile import load
    from hzpsim.hardware.devices import BUILTIN_DIR, load_device
    from hzpsim.scenario import load_scenario

    monkeypatch.setenv("HZPSIM_CONFIG_DIR", str(tmp_path))
    assert main(["calibrate", "machine", "--world", "2", "--quick"]) == 0
    captured = capsys.readouterr()
    assert "calibrating [" in captured.err  # the progress bar
    written = load_device(tmp_path / "devices" / "cpu-local.yaml")
    preset = yaml.safe_load((tmp_path / "topologies" / "local-cpu.yaml").read_text())
    profile = load(tmp_path / "machine-profile.yaml")
    assert profile.device == str((tmp_path / "devices" / "cpu-local.yaml").resolve())
    scenario = load_scenario(ROOT / "examples" / "executor-world4.yaml")
    # the device read at scenario load is the written file, its GEMM rate the sweep's for this model
    assert scenario.topology.device.path == str((tmp_path / "devices" / "cpu-local.yaml").resolve())
    assert written.gemm_sweep and scenario.topology.device.peak_fp32_flops_per_s != written.peak_fp32_flops_per_s
    assert load_device(BUILTIN_DIR / "cpu-local.yaml").gemm_sweep == ()  # the built-in file is untouched
    assert scenario.topology.link("island").latency_s == pytest.approx(preset["intra_node_latency_s"])
    # the step-time mechanisms it measured (tests/test_calibrated_cpu_device.py): FSDP2's and DTensor's
    # host cost, gloo's cost per kind and group size, the in-step wait per message
    assert written.framework_cost_s("fsdp2", "call_s") > 0 and written.framework_cost_s("dtensor", "op_s") > 0
    assert {row[0] for row in written.collective_costs} == {"all_gather", "reduce_scatter", "all_reduce",
                                                           "all_to_all", "send_recv"}
    assert written.collective_hop_delay_s is None or written.collective_hop_delay_s >= 0
    assert scenario.topology.device.collective_costs == written.collective_costs
    assert main(["run", str(ROOT / "examples" / "executor-world4.yaml"), "--set", "strategy.name=zero"]) == 0


@pytest.mark.slow
def test_validate_executor_cli_json_contract(capsys, monkeypatch, tmp_path):
    """`hzpsim validate executor --json`: a list of objects with the contract's keys, every
    collective kind present in the count and byte mappings, and a scenario `hzpsim run` accepts."""
    pytest.importorskip("torch")
    import json

    import yaml

    monkeypatch.chdir(ROOT)
    assert main(["validate", "executor", "--world", "2", "--strategies", "asynchzp", "--steps", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    keys = {"strategy", "world_size", "measured_step_time_s", "predicted_step_time_s", "measured_comm_bytes",
            "predicted_comm_bytes", "measured_collective_counts", "predicted_collective_counts",
            "measured_model_state_bytes", "predicted_model_state_bytes", "measured_peak_memory_bytes",
            "predicted_peak_memory_bytes", "loss_max_abs_diff_vs_reference", "scenario"}
    kinds = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv"}
    [row] = rows
    assert keys <= set(row)
    assert row["strategy"] == "asynchzp" and row["world_size"] == 2
    for key in ("measured_comm_bytes", "predicted_comm_bytes", "measured_collective_counts", "predicted_collective_counts"):
        assert set(row[key]) == kinds and all(isinstance(v, int) for v in row[key].values())
    assert row["measured_collective_counts"] == row["predicted_collective_counts"]
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(row["scenario"]))
    assert main(["run", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["strategy_resolved"]["name"] == "asynchzp"
