"""Search speed: GPT-3 175B on 1,024 A100 (128 DGX A100 nodes), global batch 2,048.

    python benchmarks/bench_search.py                 # the branch-and-bound search (target <= 60 s)
    python benchmarks/bench_search.py --exhaustive    # also simulate every valid candidate (long)
    python benchmarks/bench_search.py --workers 1
    python benchmarks/bench_search.py --exhaustive --space tp=4,8 --space pp=4,8,16   # a smaller space
    python benchmarks/bench_search.py --sample 40     # estimate the exhaustive cost from 40 random candidates

Space: TP {1,2,4,8} x PP {1..16} x VPP {1,2,3,4} x micro-batch {1,2,4} x recompute {none,
selective, full} x ZeRO stage {0..3} x sequence parallelism for ND, plus every ZeRO-family
member (stages, HSDP / MiCS / Megatron-FSDP group sizes, ZeRO++ hpZ, AsyncHZP group chains) and
DDP. For comparison: Calculon's full search of GPT-3 175B on 1,024 GPUs did not finish in 25
minutes on the same 2-core box.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time

from hzpsim import search as S
from hzpsim.scenario import scenario_from_mapping

SCENARIO = {
    "model": "gpt3-175b",
    "training": {"global_batch_size": 2048},
    "cluster": {"preset": "dgx-a100", "num_nodes": 128},
    "strategy": {"name": "zero", "stage": 3},
}


def cpu_s() -> float:
    """CPU seconds of this process and its finished worker processes (a figure that a busy
    machine does not inflate the way it inflates wall time)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def same_answer(fast: S.SearchResult, slow: S.SearchResult, top: int) -> bool:
    """The search and the exhaustive run agree: the same best, best per family and top ``top``."""
    return (fast.best is not None and slow.best is not None and fast.best.candidate == slow.best.candidate
            and all((fast.best_of(f) and fast.best_of(f).candidate) == (slow.best_of(f) and slow.best_of(f).candidate)  # type: ignore[union-attr]
                    for f in S.FAMILIES)
            and [r.candidate for r in fast.ranked[:top]] == [r.candidate for r in slow.ranked[:top]])


def line(name: str, result: S.SearchResult) -> str:
    data = result.to_json()
    best = result.best
    assert best is not None and best.report is not None
    return (f"{name:<12} wall {result.wall_s:7.1f} s  candidates {data['num_candidates']:,} "
            f"({data['num_candidates'] / result.wall_s:,.0f}/s)  invalid {data['num_invalid']:,}  "
            f"pruned {data['num_pruned']:,} ({data['num_pruned'] / result.wall_s:,.0f}/s; memory "
            f"{data['num_pruned_memory']:,}, bound {data['num_pruned_bound']:,})  "
            f"simulated {data['num_simulated']:,} ({data['num_simulated'] / result.wall_s:.2f}/s)\n"
            f"{'':<12} best {best.candidate.label()}: {best.report['step_time_s']:.3f} s/step, "
            f"{best.report['mfu']:.1%} MFU, {best.report['peak_memory_bytes'] / 2**30:.1f} GiB")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--exhaustive", action="store_true")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--save", metavar="FILE", help="write both answers (JSON) here")
    parser.add_argument("--space", action="append", default=[], metavar="KEY=V1,V2", help="restrict the space")
    parser.add_argument("--sample", type=int, metavar="N",
                        help="simulate N random valid candidates in this process and extrapolate the exhaustive cost")
    args = parser.parse_args()
    scenario = scenario_from_mapping(SCENARIO)
    space = S.default_space(scenario)
    for text in args.space:
        space = space.replace(text)
    if args.sample:
        valid = [c for c in S.enumerate_candidates(scenario, S.FAMILIES, space) if S.check(scenario, c) is None]
        picked = random.Random(0).sample(valid, min(args.sample, len(valid)))
        start = cpu_s()
        for candidate in picked:
            S.evaluate(scenario, candidate)
        per = (cpu_s() - start) / len(picked)
        print(f"{len(valid):,} valid candidates; {per:.2f} CPU s per simulation over {len(picked)} random ones: "
              f"an exhaustive simulation needs about {per * len(valid) / 3600:.1f} CPU hours "
              f"({per * len(valid) / 3600 / 2:.1f} h on 2 cores)")
        return 0
    out = {}
    start_cpu = cpu_s()
    runner = S.make_runner(None, args.workers)
    try:
        fast = S.search(scenario, top=args.top, space=space, runner=runner, progress=sys.stderr.isatty())
    finally:
        runner.close()  # the workers' CPU time is counted once they have exited
    print(line("search", fast) + f"\n{'':<12} CPU {cpu_s() - start_cpu:.1f} s (this process and its workers)",
          flush=True)
    out["search"] = fast.to_json()
    if args.exhaustive:
        start = time.perf_counter()
        start_cpu = cpu_s()
        runner = S.make_runner(None, args.workers)
        try:
            slow = S.search(scenario, top=args.top, space=space, runner=runner, progress=sys.stderr.isatty(),
                            exhaustive=True)
        finally:
            runner.close()
        print(line("exhaustive", slow) + f"\n{'':<12} CPU {cpu_s() - start_cpu:.1f} s", flush=True)
        out["exhaustive"] = slow.to_json()
        print(f"same best, best per family and top {args.top}: {same_answer(fast, slow, args.top)}  "
              f"(exhaustive {time.perf_counter() - start:.0f} s vs search {fast.wall_s:.0f} s)")
    if args.save:
        with open(args.save, "w", encoding="utf-8") as handle:
            json.dump(out, handle, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
