"""``hzpsim search``: the bounds are bounds, pruning never changes the answer, Dask = local.

    python -m pytest tests/test_search.py            # (-m "not slow" skips the Dask cluster)
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import yaml

from hzpsim import search as S
from hzpsim import strategies
from hzpsim.cli import main
from hzpsim.scenario import scenario_from_mapping

# Small enough that every simulation takes milliseconds, big enough for pipelines (4 nodes),
# inter-node data parallelism and memory pressure (a100-40gb).
SMALL = {
    "model": "llama2-7b",
    "training": {"global_batch_size": 64},
    "cluster": {"preset": "dgx-a100", "num_nodes": 4, "device": "a100-40gb"},
    "strategy": {"name": "zero", "stage": 3},
}
MOE = {
    "model": "tiny-moe",
    "training": {"global_batch_size": 32},
    "cluster": {"preset": "dgx-h100", "num_nodes": 2},
    "strategy": {"name": "zero", "stage": 3},
}
SPACE = ["tp=1,2,8", "pp=1,2,4", "vpp=1,2", "micro_batch_size=1,2", "activation_recompute=none,full"]


def small_scenario(data=SMALL):
    return scenario_from_mapping(data)


def space_of(scenario, texts=SPACE):
    space = S.default_space(scenario)
    for text in texts:
        space = space.replace(text)
    return space


def comparable(result: S.SearchResult) -> str:
    """The search's answer without wall times."""
    data = result.to_json()
    data.pop("wall_s")

    def strip(obj):
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if k not in ("sim_wall_s", "num_events")}
        if isinstance(obj, list):
            return [strip(v) for v in obj]
        return obj

    return json.dumps(strip(data), sort_keys=True)


def _sample(scenario, space, every: int):
    candidates = [c for c in S.enumerate_candidates(scenario, S.FAMILIES, space) if S.check(scenario, c) is None]
    return candidates[::every]


def _check_bounds(scenario, candidates):
    """Step-time and memory bounds <= what the simulator reports; the bound/simulated ratios."""
    bounder = S.Bounder(scenario)
    tight: list[float] = []
    overheads: list[float] = []
    for candidate in candidates:
        result = S.evaluate(scenario, candidate)
        if "report" not in result:
            continue
        b, report = bounder(candidate), result["report"]
        assert b.step_time_s <= report["step_time_s"] * (1 + 1e-9), (candidate.label(), b, report["step_time_s"])
        quick = bounder.at(candidate, 0)  # what the search computes for every candidate
        assert quick.step_time_s <= b.step_time_s * (1 + 1e-12), (candidate.label(), quick, b)
        assert quick.memory_bytes <= report["peak_memory_allocated_bytes"] * (1 + 1e-9), (candidate.label(), quick)
        refined = bounder(candidate, refine=True)  # what the search computes before simulating
        assert b.step_time_s <= refined.step_time_s <= report["step_time_s"] * (1 + 1e-9), (candidate.label(), refined)
        b = refined
        # a lower bound of what PyTorch allocates, so also of what its allocator reserves
        assert b.memory_bytes <= report["peak_memory_allocated_bytes"] * (1 + 1e-9), (candidate.label(), b)
        # and the NCCL communicators it certainly holds, of what the simulated ranks hold
        communicators = report["device_overhead_bytes"] - scenario.topology.device.context_bytes
        assert b.overhead_bytes <= communicators * (1 + 1e-9), (candidate.label(), b.overhead_bytes, communicators)
        overheads.append(b.overhead_bytes)
        tight.append(b.step_time_s / report["step_time_s"])
    assert not candidates or max(overheads, default=0.0) > 0 or not scenario.topology.device.communicator_bytes
    return tight


def _with_variability(data, cv):
    return {**data, "cluster": {**data["cluster"], "variability": cv, "variability_persistent": cv}}


@pytest.mark.parametrize("data,every,tightness", [
    (SMALL, 7, 0.85), (_with_variability(SMALL, 0.0), 13, 0.85), (_with_variability(SMALL, 0.05), 13, 0.80),
    (MOE, 3, 0.0),
], ids=["dense", "dense-no-variability", "dense-high-variability", "moe"])
def test_bounds_never_exceed_the_simulation(data, every, tightness):
    """Step-time and memory bounds <= what the simulator reports, on every sampled candidate
    (every family, pipelines with and without interleaving, ZeRO stages, recompute, TP, EP),
    with stragglers at the default, off and high."""
    scenario = small_scenario(data)
    space = space_of(scenario, SPACE + (["ep=1,2,4"] if data is MOE else []))
    tight = _check_bounds(scenario, _sample(scenario, space, every))
    assert len(tight) >= 25
    # and they are worth having: on average within 15 % of the simulated step (the tiny MoE
    # model's steps are collective latencies and host work, which the bound leaves out: valid,
    # not tight; within 20 % at a persistent cv of 0.05, whose waits the bound leaves out too:
    # a late rendezvous may hide behind compute, so no part of them is sure to lengthen the step)
    assert sum(tight) / len(tight) > tightness


GPT3 = {
    "model": "gpt3-175b",
    "training": {"global_batch_size": 2048},
    "cluster": {"preset": "dgx-a100", "num_nodes": 128},
    "strategy": {"name": "zero", "stage": 3},
}  # benchmarks/bench_search.py's scenario


def _nd(tp, pp, vpp, zero, sp, mb, rc="none"):
    fields = {"tp": tp, "pp": pp, "vpp": vpp, "cp": 1, "ep": 1, "zero_stage": zero, "sequence_parallel": sp}
    return S.Candidate("nd", tuple(sorted(fields.items())), mb, rc)


# GPT-3 175B layouts around the search's answer: ZeRO-2 pipelines whose reduce-scatters slow
# their kernels and fill their gradient-buffer ring, interleaved pipelines whose merged passes
# and step-end reductions set the drain, the best layout itself
GPT3_LAYOUTS = [
    _nd(2, 16, 4, 2, True, 1), _nd(4, 8, 4, 2, True, 2), _nd(4, 16, 2, 2, True, 2),
    _nd(8, 16, 4, 1, True, 2), _nd(8, 16, 4, 0, True, 4, "selective"), _nd(4, 8, 4, 1, True, 1),
]
GPT3_MORE = [
    _nd(2, 16, 4, 2, False, 1, "selective"), _nd(8, 4, 4, 1, True, 4), _nd(4, 16, 4, 0, True, 1),
    _nd(2, 8, 3, 2, True, 1), _nd(8, 16, 1, 2, True, 2, "full"), _nd(4, 4, 1, 2, True, 4),
    _nd(4, 16, 4, 3, False, 1, "selective"), _nd(8, 4, 1, 3, True, 2, "full"), _nd(8, 8, 4, 0, True, 4, "selective"),
    _nd(8, 16, 2, 1, True, 4, "full"), _nd(2, 16, 4, 1, False, 2, "selective"),
    S.Candidate("megatron_fsdp", (("outer_optim_sharding", True), ("shard_group_size", 32)), 2, "full"),
    S.Candidate("mics", (("hierarchical_params_gather", False), ("partition_size", 128)), 2, "full"),
]


def test_bounds_hold_at_gpt3_scale():
    """The bounds stay below the simulation, and close to it, on the search benchmark's own
    scale (GPT-3 175B, 1,024 A100s): the layouts whose pruning decides its answer."""
    scenario = small_scenario(GPT3)
    assert all(S.check(scenario, c) is None for c in GPT3_LAYOUTS)
    tight = _check_bounds(scenario, GPT3_LAYOUTS)
    assert len(tight) == len(GPT3_LAYOUTS)
    # the refined bound within 12 % (10 % before the persistent stragglers' waits, which it leaves out)
    assert min(tight) > 0.88, tight


@pytest.mark.slow
def test_bounds_hold_at_gpt3_scale_more():
    scenario = small_scenario(GPT3)
    candidates = [c for c in GPT3_MORE if S.check(scenario, c) is None]
    assert len(candidates) == len(GPT3_MORE)
    tight = _check_bounds(scenario, candidates)
    assert len(tight) == len(candidates)


IMPLEMENTATIONS = {
    "zero": ["deepspeed-2021", "fsdp1", "fsdp2", "ideal"],
    "hsdp": ["fsdp1", "deepspeed", "ideal"],
    "mics": ["deepspeed-2021", "fsdp2"],
    "asynchzp": ["deepspeed", "fsdp1"],
    "megatron_fsdp": ["megatron-2021", "ideal"],
    "ddp": ["megatron-2021", "ideal"],
    "nd": ["megatron-2021", "torchtitan", "ideal"],
}


def test_bounds_hold_for_every_implementation():
    """The bounds read the implementation's collective calls, re-gathers, copies and buffer
    rings: they stay below the simulation whatever framework runs the layout."""
    scenario = small_scenario()
    space = space_of(scenario, SPACE + ["tp=1,2", "zero_stage=1,3"])
    candidates = []
    for i, c in enumerate(_sample(scenario, space, 2)):
        names = IMPLEMENTATIONS.get(c.name, [])
        if names and i % 3 == 0:
            fields = tuple(sorted({**dict(c.fields), "implementation": names[(i // 3) % len(names)]}.items()))
            candidates.append(S.Candidate(c.name, fields, c.micro_batch_size, c.activation_recompute))
    assert {c.name for c in candidates} >= {"zero", "hsdp", "nd", "asynchzp"}
    tight = _check_bounds(scenario, candidates)
    assert len(tight) >= 20 and sum(tight) / len(tight) > 0.8


def test_search_equals_exhaustive_simulation():
    """Branch and bound returns exactly what simulating every valid candidate returns: the
    best, the best of each family and the top N (and simulates far fewer)."""
    scenario = small_scenario({**SMALL, "training": {"global_batch_size": 32}})
    space = space_of(scenario, SPACE + ["tp=1,2", "activation_recompute=none,selective"])
    fast = S.search(scenario, top=5, space=space)
    slow = S.search(scenario, top=5, space=space, exhaustive=True)
    assert fast.exact and fast.best is not None
    a, b = fast.to_json(), slow.to_json()
    assert a["best"]["strategy_resolved"] == b["best"]["strategy_resolved"]
    assert a["best"]["training_resolved"] == b["best"]["training_resolved"]
    assert [r.candidate for r in fast.ranked[:5]] == [r.candidate for r in slow.ranked[:5]]
    for family in S.FAMILIES:
        x, y = fast.best_of(family), slow.best_of(family)
        assert (x is None) == (y is None), family
        if x is not None and y is not None:
            assert x.candidate == y.candidate, family
    assert set(a["infeasible"]) == set(b["infeasible"])
    assert a["num_simulated"] < b["num_simulated"] / 2
    assert a["num_candidates"] == b["num_candidates"]
    assert a["num_pruned"] > 0
    # bound levels: every simulated ND candidate came up with its tightest (refine_bound), some
    # were pruned on the quick one, and the text says which bound pruned them
    nd = [r for r in fast.rows if r.candidate.name == "nd"]
    assert all(r.level == 2 for r in nd if r.status in ("simulated", "rejected"))
    quick = [r for r in nd if r.status == "pruned_bound" and r.level == 0]
    assert quick and all(r.bound is not None and r.bound.quick for r in quick)
    assert "quick bound" in S.format_search(fast)
    assert all(r.level == 1 for r in slow.rows if r.candidate.name == "nd" and r.bound is not None)


def test_search_is_deterministic_and_workers_do_not_change_it():
    scenario = small_scenario()
    space = space_of(scenario, SPACE + ["tp=1,2"])
    one = S.search(scenario, top=3, space=space)
    runner = S.make_runner(None, 2)
    try:
        two = S.search(scenario, top=3, space=space, runner=runner)
    finally:
        runner.close()
    assert comparable(one) == comparable(two)


@pytest.mark.slow
def test_dask_run_equals_local_run():
    distributed = pytest.importorskip("distributed")
    scenario = small_scenario()
    space = space_of(scenario, SPACE + ["tp=1,2"])
    local = S.search(scenario, top=3, space=space)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        runner = S.DaskRunner(client)
        remote = S.search(scenario, top=3, space=space, runner=runner)
        runner.close()
    assert comparable(local) == comparable(remote)
    assert remote.to_json()["num_simulated"] > 0


def test_max_evals_makes_the_answer_inexact():
    scenario = small_scenario()
    result = S.search(scenario, top=3, space=space_of(scenario), max_evals=2)
    data = result.to_json()
    assert data["num_simulated"] <= 2 and not data["exact"] and data["num_skipped"] > 0


def test_infeasible_families_say_why():
    scenario = small_scenario()
    data = S.search(scenario, families=["ddp", "zero"], top=3, space=space_of(scenario)).to_json()
    assert data["best_per_family"]["ddp"] is None
    assert "out of memory" in data["infeasible"]["ddp"]
    assert data["best_per_family"]["zero"] is not None and "zero" not in data["infeasible"]


def _cli(capsys, *argv):
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _scenario_file(tmp_path, data=SMALL):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in data.items() if k != "strategy"}))
    return str(path)


def test_cli_json_is_one_document_with_every_family(tmp_path, capsys):
    path = _scenario_file(tmp_path)
    rc, out, err = _cli(capsys, "search", path, "--json", "--workers", "1", "--top", "3",
                        *[a for s in SPACE for a in ("--space", s)])
    assert rc == 0, err
    data = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    for key in ("best", "best_per_family", "infeasible", "top", "num_candidates", "num_simulated", "num_pruned",
                "wall_s"):
        assert key in data
    assert set(data["best_per_family"]) == set(S.FAMILIES)
    assert len(data["top"]) == 3
    assert data["best"] == {k: v for k, v in data["top"][0].items() if k != "distinguishable_from_best"}
    assert all(isinstance(v, str) for v in data["infeasible"].values())
    assert data["best"]["step_time_s"] == min(r["step_time_s"] for r in data["best_per_family"].values() if r)
    assert err == ""  # no progress bar off a terminal


def test_cli_text_names_the_winner_and_how_to_run_it(tmp_path, capsys):
    path = _scenario_file(tmp_path)
    rc, out, _ = _cli(capsys, "search", path, "--workers", "1", "--family", "nd,zero", "--top", "2",
                      *[a for s in SPACE for a in ("--space", s)])
    assert rc == 0
    assert "best of each family" in out and "top 2 overall" in out and "run the best: hzpsim run" in out
    command = out.split("run the best: hzpsim run ", 1)[1].split()
    overrides = [command[i + 1] for i, a in enumerate(command) if a == "--set"]
    rc, run_out, _ = _cli(capsys, "run", path, "--json", *[a for o in overrides for a in ("--set", o)])
    assert rc == 0
    best_line = out.split("top 2 overall:")[1].splitlines()[3]
    assert f"{json.loads(run_out)['step_time_s']:.3f}" in best_line


@pytest.mark.parametrize("argv,needle", [
    (["--top", "0"], "--top"),
    (["--top", "x"], "--top"),
    (["--max-evals", "-1"], "--max-evals"),
    (["--family", "nope"], "--family"),
    (["--workers", "0"], "--workers"),
    (["--space", "tp"], "--space"),
    (["--space", "bogus=1"], "--space bogus"),
    (["--space", "tp=a"], "--space tp"),
    (["--space", "activation_recompute=some"], "--space activation_recompute"),
    (["--space", "zero_stage=5"], "--space zero_stage"),
    (["--plot", "out.txt"], "--plot"),
    (["--dask", "tcp://127.0.0.1:1"], "--dask"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, needle):
    path = _scenario_file(tmp_path)
    rc, out, err = _cli(capsys, "search", path, *argv)
    assert rc == 2, err
    assert err.startswith("hzpsim: error: ") and needle in err and err.count("\n") == 1
    assert out == ""


def test_space_syntax():
    space = S.Space().replace("pp=1-4,8")
    assert space.pp == (1, 2, 3, 4, 8)
    assert S.Space().replace("sequence_parallel=true").sequence_parallel == (True,)
    assert math.isfinite(len(S.Space().tp))


def test_the_search_names_no_strategy():
    """``hzpsim/search/`` knows the strategies only through ``strategies.available()`` and their
    plugins' hooks: no strategy name as a string, no private module or name of another package."""
    names = set(strategies.available())
    problems = []
    for path in sorted((Path(S.__file__).parent).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                problems.append(f"{path.name}:{node.lineno}: names the strategy {node.value!r}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hzpsim"):
                private = [p for p in node.module.split(".") if p.startswith("_")]
                private += [a.name for a in node.names if a.name.startswith("_")]
                if private:
                    problems.append(f"{path.name}:{node.lineno}: imports the private {', '.join(private)}")
    assert not problems, "\n".join(problems)


def test_bounds_hold_when_pipeline_stages_keep_fsdp_units_unsharded():
    """torchtitan's pipelines gather each FSDP unit once per step and reduce it once after the
    stage's last backward (Implementation.pp_keeps_unsharded): the bounds count those, not a
    gather and a reduction per micro-batch, and stay below the simulation."""
    scenario = small_scenario()
    candidates = [
        S.Candidate("nd", tuple(sorted({"tp": tp, "pp": pp, "vpp": vpp, "cp": 1, "ep": 1, "zero_stage": 3,
                                        "sequence_parallel": tp > 1, "implementation": "torchtitan"}.items())), mb, rc)
        for tp, pp, vpp, mb, rc in ((1, 2, 1, 1, "none"), (2, 2, 2, 1, "full"), (1, 4, 1, 2, "selective"),
                                    (8, 2, 1, 1, "none"), (2, 4, 1, 1, "full"))  # the last two: a bound
    ]  # counting a gather and a reduction per micro-batch exceeds their simulated step
    assert all(S.check(scenario, c) is None for c in candidates)
    tight = _check_bounds(scenario, candidates)
    assert len(tight) == len(candidates)


MIXTRAL = {
    "model": "mixtral-8x7b",
    "training": {"global_batch_size": 512},
    "cluster": {"preset": "dgx-h100", "num_nodes": 8},
    "strategy": {"name": "zero", "stage": 3},
}  # benchmarks/bench_search_moe.py's scenario


def _nd_moe(tp, pp, vpp, ep, zero, sp, mb, rc="none"):
    fields = {"tp": tp, "pp": pp, "vpp": vpp, "cp": 1, "ep": ep, "zero_stage": zero, "sequence_parallel": sp}
    return S.Candidate("nd", tuple(sorted(fields.items())), mb, rc)


def test_moe_memory_bound_holds_the_expert_states():
    """On Mixtral-8x7B layouts the memory bound holds every resident model state the built
    graph holds, the experts' included (sharded over their expert-data-parallel group), and stays
    below the simulated peak; the step-time bound stays below the simulated step."""
    from hzpsim.search.space import choice_of, plugin_of, training_of

    scenario = small_scenario(MIXTRAL)
    layouts = [_nd_moe(2, 4, 3, 2, 1, True, 1), _nd_moe(1, 4, 1, 8, 1, False, 1, "full"),
               _nd_moe(8, 2, 1, 1, 0, True, 1, "selective"), _nd_moe(1, 2, 1, 8, 0, False, 2, "full")]
    bounder = S.Bounder(scenario)
    for candidate in layouts:
        assert S.check(scenario, candidate) is None, candidate.label()
        b = bounder(candidate)
        config = choice_of(candidate).config
        graph = plugin_of("nd").build(config, scenario.model, training_of(scenario, candidate), scenario.topology)
        states = max(sum(v for k, v in memory.items() if k in ("params", "grads", "optimizer"))
                     for memory in graph.static_memory.values())
        assert b.memory_bytes >= states * (1 - 1e-9), (candidate.label(), b.memory_bytes / 2**30, states / 2**30)
        result = S.evaluate(scenario, candidate)
        if "report" in result:
            report = result["report"]
            assert b.memory_bytes <= report["peak_memory_allocated_bytes"] * (1 + 1e-9), candidate.label()
            refined = bounder(candidate, refine=True)
            assert b.step_time_s <= refined.step_time_s <= report["step_time_s"] * (1 + 1e-9), candidate.label()


def test_the_nd_bound_counts_the_norms_persistent_straggler():
    """A pipelined layout's gradient norm, its only rendezvous of the world, waits for the
    persistently slowest device (persistent_norm_s): the bound rises with
    variability_persistent, by at least c·(E[max of n] - E[max of the largest group]) of the
    busiest stage's step, and stays below the simulated step."""
    from hzpsim.hardware.variability import expected_max_excess

    candidate = _nd(2, 4, 1, 1, True, 1)
    out = {}
    for cv in (0.0, 0.03):
        sc = scenario_from_mapping({**SMALL, "cluster": {**SMALL["cluster"], "variability_persistent": cv}})
        simulated = S.evaluate(sc, candidate)["report"]["step_time_s"]
        out[cv] = (S.Bounder(sc)(candidate, refine=True).step_time_s, simulated)
        assert out[cv][0] <= simulated * (1 + 1e-9)
    # 32 ranks, the largest other group the 4-rank data-parallel one: at least 1.3 % of a
    # step's kernels more (c·(E(32) - E(4)) = 0.03·1.07, of kernels >= 40 % of it)
    gain = 0.03 * (expected_max_excess(32) - expected_max_excess(4))
    assert out[0.03][0] - out[0.0][0] > 0.4 * gain * out[0.0][0], (out, gain)


@pytest.mark.parametrize("data,texts", [
    (SMALL, SPACE + ["zero_stage=0,1,2,3", "cp=1,2"]),
    (MOE, SPACE + ["ep=1,2,4,8", "zero_stage=0,1,3"]),
    (GPT3, ["tp=4,8", "pp=4,8", "vpp=1,2", "zero_stage=1,2", "micro_batch_size=1"]),
], ids=["dense", "moe", "gpt3"])
def test_the_nd_bound_knows_every_group_a_rank_waits_at(data, texts):
    """The ND bound prices the persistent slowness at each TP and EP exchange against the
    largest smaller group a rank meets (``_nd_bound.rendezvous_sizes``): a superset of the
    sizes of every group whose collectives the built graph holds (sends are not rendezvous).
    A size it missed could make the bound exceed the simulation."""
    from hzpsim.search.space import choice_of, training_of
    from hzpsim.strategies import _nd_bound, _nd_layout

    scenario = small_scenario(data)
    space = space_of(scenario, texts)
    candidates = [c for c in S.enumerate_candidates(scenario, ("nd",), space) if S.check(scenario, c) is None]
    assert len(candidates) >= 8
    plugin = strategies.get("nd")
    checked = 0
    for candidate in candidates[:: max(1, len(candidates) // 12)]:
        config, training = choice_of(candidate).config, training_of(scenario, candidate)
        graph = plugin.build(config, scenario.model, training, scenario.topology)
        used = {len(graph.groups[op.group]) for op in graph.ops if op.group and op.collective != "send_recv"}
        lay = _nd_layout.layout(config, scenario.model, strategies.training_as_simulated(config, training, scenario.topology.device),
                                scenario.topology)
        known = set(_nd_bound.rendezvous_sizes(config, scenario.topology.num_devices, lay.dp,
                                               scenario.model.moe is not None, _nd_layout.schedule(config)))
        assert {x for x in used if x > 1} <= known, (candidate.label(), used, known)
        checked += 1
    assert checked >= 8
