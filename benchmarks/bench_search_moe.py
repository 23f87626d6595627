"""Search speed on a mixture of experts: Mixtral-8x7B on 64 H100 (8 DGX H100 nodes), global batch 512.

    python benchmarks/bench_search_moe.py                 # the branch-and-bound search (target <= 60 s)
    python benchmarks/bench_search_moe.py --plot out.png  # and the time --plot adds (target <= 10 s)
    python benchmarks/bench_search_moe.py --exhaustive    # also simulate every valid candidate (long)
    python benchmarks/bench_search_moe.py --near-frontier # also simulate what was pruned near the answer
    python benchmarks/bench_search_moe.py --workers 1

The default space of ``hzpsim search`` for this scenario: the ND layouts (TP x PP x VPP x EP x
ZeRO stage x sequence parallelism) and every ZeRO-family member, each with micro-batch {1, 2,
4} and recompute {none, selective, full}; ``hzpsim search`` on the same scenario is::

    model: mixtral-8x7b
    training: {global_batch_size: 512}
    cluster: {preset: dgx-h100, num_nodes: 8}
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench_search import cpu_s, same_answer  # the GPT-3 benchmark's (same folder)

from hzpsim import search as S
from hzpsim.scenario import scenario_from_mapping

SCENARIO = {
    "model": "mixtral-8x7b",
    "training": {"global_batch_size": 512},
    "cluster": {"preset": "dgx-h100", "num_nodes": 8},
    "strategy": {"name": "zero", "stage": 3},  # a stand-in: the search supplies the strategies
}


def line(name: str, result: S.SearchResult, cpu: float) -> str:
    data = result.to_json()
    best = result.best
    assert best is not None and best.report is not None
    return (f"{name:<12} wall {result.wall_s:7.1f} s  CPU {cpu:7.1f} s  candidates {data['num_candidates']:,}  "
            f"invalid {data['num_invalid']:,}  pruned by memory {data['num_pruned_memory']:,}, "
            f"by bound {data['num_pruned_bound']:,}  simulated {data['num_simulated']:,} "
            f"(of which rejected for their resident states {result.count('rejected'):,})\n"
            f"{'':<12} best {best.candidate.label()}: {best.report['step_time_s']:.3f} s/step, "
            f"{best.report['peak_memory_bytes'] / 2**30:.1f} GiB")


def run(scenario, space, workers: int | None, exhaustive: bool = False) -> tuple[S.SearchResult, float]:
    start = cpu_s()
    runner = S.make_runner(None, workers)
    try:
        result = S.search(scenario, top=5, space=space, runner=runner, progress=sys.stderr.isatty(),
                          exhaustive=exhaustive)
    finally:
        runner.close()  # the workers' CPU time is counted once they have exited
    return result, cpu_s() - start


def near_frontier(scenario, result: S.SearchResult, workers: int | None, margin: float = 0.1) -> str:
    """Simulate every candidate the search pruned near its answer: by the step-time bound within
    ``margin`` of the top N's worst, by memory within ``margin`` of the room. Counts the bounds
    above their simulation, the candidates that would have entered the top N or their family's
    best, and the memory-pruned ones that fit (all 0 when the pruning was right there)."""
    worst = max(r.report["step_time_s"] for r in result.ranked[:result.top_n])
    device, spec = scenario.topology.device, scenario.topology.spec
    room = device.memory_bytes - device.context_bytes - spec.min_memory_headroom_bytes
    near = [r for r in result.rows if r.status == "pruned_bound" and r.bound.step_time_s < (1 + margin) * worst]
    tight = [r for r in result.rows if r.status == "pruned_memory"
             and r.bound.memory_bytes + r.bound.overhead_bytes < (1 + margin) * room]
    runner = S.make_runner(None, workers)
    try:
        out = runner.map([(scenario, r.candidate) for r in near + tight])
    finally:
        runner.close()
    above = entered = fits = 0
    for row, res in zip(near + tight, out):
        report = res.get("report")
        if report is None:
            continue
        family = result.best_of(row.candidate.name)
        if row.status == "pruned_bound":
            above += row.bound.step_time_s > report["step_time_s"] * (1 + 1e-9)
            entered += bool(report["fits_in_memory"]) and (
                report["step_time_s"] < worst or family is None or report["step_time_s"] < family.report["step_time_s"])
        else:
            fits += bool(report["fits_in_memory"])
    return (f"near the frontier: {len(near):,} pruned by the step-time bound within {margin:.0%} of the top "
            f"{result.top_n}'s worst, {len(tight):,} by memory within {margin:.0%} of the room: bounds above the "
            f"simulation {above}, would have entered {entered}, pruned by memory but fit {fits}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--exhaustive", action="store_true")
    parser.add_argument("--near-frontier", action="store_true",
                        help="also simulate the candidates pruned within 10 %% of the answer")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--plot", metavar="FILE", help="also draw the search landscape and time it")
    parser.add_argument("--save", metavar="FILE", help="write the answers (JSON) here")
    parser.add_argument("--space", action="append", default=[], metavar="KEY=V1,V2", help="restrict the space")
    args = parser.parse_args()
    scenario = scenario_from_mapping(SCENARIO)
    space = S.default_space(scenario)
    for text in args.space:
        space = space.replace(text)
    fast, cpu = run(scenario, space, args.workers)
    print(line("search", fast, cpu), flush=True)
    out = {"search": fast.to_json()}
    if args.plot:
        from hzpsim import plots

        start = time.perf_counter()
        plots.save(plots.search_landscape(fast), args.plot)
        print(f"{'':<12} --plot {time.perf_counter() - start:.1f} s", flush=True)
    if args.near_frontier:
        start = time.perf_counter()
        print(f"{near_frontier(scenario, fast, args.workers)} ({time.perf_counter() - start:.0f} s)", flush=True)
    if args.exhaustive:
        slow, cpu = run(scenario, space, args.workers, exhaustive=True)
        print(line("exhaustive", slow, cpu), flush=True)
        out["exhaustive"] = slow.to_json()
        print(f"same best, best per family and top 5: {same_answer(fast, slow, 5)}")
    if args.save:
        with open(args.save, "w", encoding="utf-8") as handle:
            json.dump(out, handle, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
