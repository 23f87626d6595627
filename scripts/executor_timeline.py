"""Where an executor step's wall time goes: every blocking collective call timed on every rank.

    python scripts/executor_timeline.py zero              # ZeRO-3 (FSDP2), the executor scenario, 4 ranks
    python scripts/executor_timeline.py zero --stage 2 --world 4 --steps 8

Runs ZeRO (``zero``, stage 3 or 2) on ``hzpsim.validation.executor.DEFAULT_SCENARIO``'s model on the executor (gloo, CPU)
with the ``torch.distributed`` collective functions FSDP2 calls wrapped to record, per call and
rank, when the training thread entered and left it and the thread's CPU time at both. FSDP2
calls them with ``async_op=False`` (``_fsdp_collectives.py::foreach_all_gather`` from
``FSDPParamGroup.unshard``, ``foreach_reduce``'s reduce-scatter), so on gloo the thread waits
inside every call. The calls of all ranks are matched in order and the step is split into

- from the last member's arrival to the last member's release (the call holds the step), and
- from that release to the next call's last arrival (compute and Python between calls),

with each rank's main-thread CPU inside and between the calls. ``docs/executor.md`` ("Inside a
ZeRO-3 step") has the figures. DTensor's functional collectives (ND) do not pass through these
functions, so the script times FSDP2 over the whole world (zero, stage 3 or 2) only: HSDP's pairs would be
matched across groups. A measurement tool;
nothing here models anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

WRAPPED = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
           "all_reduce")


def _worker(argv: list[str]) -> int:
    """One rank: hzpsim.executor.worker with the collective functions and steps timed."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from hzpsim.executor import trainers, worker

    calls: list[tuple[str, str, int, int, int, int]] = []
    steps: list[tuple[int, int, int, int, int]] = []

    def timed(name: str):
        real = getattr(c10d, name)

        def call(*args, **kwargs):
            cpu0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            out = real(*args, **kwargs)
            calls.append((name, threading.current_thread().name, t0, time.perf_counter_ns(), cpu0,
                          time.thread_time_ns()))
            return out
        return call

    for name in WRAPPED:
        if hasattr(c10d, name):
            wrapped = timed(name)
            setattr(dist, name, wrapped)
            setattr(c10d, name, wrapped)
    make = trainers.make_trainer

    def make_timed(spec, device):
        trainer = make(spec, device)
        step = trainer.step

        def timed_step(k):
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            loss = step(k)
            steps.append((k, t0, time.perf_counter_ns(), c0, time.thread_time_ns()))
            return loss
        trainer.step = timed_step
        return trainer

    worker.make_trainer = make_timed
    leave = os._exit

    def dump_and_leave(code: int) -> None:  # the worker leaves with os._exit once its results are written
        out = Path(os.environ["HZPSIM_TIMELINE_OUT"]) / f"timeline{os.environ['RANK']}.json"
        out.write_text(json.dumps({"calls": calls, "steps": steps}))
        leave(code)

    os._exit = dump_and_leave  # type: ignore[assignment]
    return worker.main(argv)


def _split(ranks: list[dict], step: int) -> dict[str, float]:
    """One step of every rank: the decomposition described in the module docstring."""
    spans, calls = [], []
    for r in ranks:
        k, t0, t1, c0, c1 = next(s for s in r["steps"] if s[0] == step)
        spans.append((t0, t1, c0, c1))
        calls.append([c for c in r["calls"] if t0 <= c[2] < t1 and c[1] == "MainThread"])
    n = min(len(c) for c in calls)
    held = between = 0.0
    for j in range(n):
        arrival = max(c[j][2] for c in calls)
        held += (max(c[j][3] for c in calls) - arrival) / 1e9
        if j:
            between += (arrival - max(c[j - 1][3] for c in calls)) / 1e9
    main_cpu = [(s[3] - s[2]) / 1e9 for s in spans]
    in_calls = [sum(c[5] - c[4] for c in rank_calls[:n]) / 1e9 for rank_calls in calls]
    return {"step_s": max((s[1] - s[0]) / 1e9 for s in spans), "calls": n, "held_s": held, "between_s": between,
            "main_cpu_s": statistics.mean(main_cpu), "main_cpu_in_calls_s": statistics.mean(in_calls)}


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        return _worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("strategy", nargs="?", default="zero", choices=("zero",),
                        help="FSDP2 over the whole world (hzpsim's zero); HSDP and ND are not timed here")
    parser.add_argument("--stage", type=int, default=3, choices=(2, 3), help="ZeRO stage (default 3)")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (the first two are warm-up)")
    args = parser.parse_args(argv)
    from hzpsim.executor.runner import launch
    from hzpsim.executor.spec import run_specs
    from hzpsim.validation.executor import DEFAULT_SCENARIO, scenario_for_world

    raw = {**DEFAULT_SCENARIO, "strategies": [{"name": args.strategy, "stage": args.stage}]}
    scenario = scenario_for_world(raw, args.world, {})
    specs = run_specs(scenario, args.world, num_steps=args.steps, measure_memory=False)
    with tempfile.TemporaryDirectory(prefix="hzpsim-timeline-") as out:
        Path(out, "spec.json").write_text(json.dumps([s.to_mapping() for s in specs]))
        here = str(Path(__file__).resolve().parent)
        os.environ.update(HZPSIM_TIMELINE_OUT=out,
                          PYTHONPATH=os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
        launch(args.world, ["executor_timeline", "--worker", "--spec", str(Path(out, "spec.json")), "--out", out],
               out, 600.0, f"timeline: {specs[0].label}")
        ranks = [json.loads(Path(out, f"timeline{r}.json").read_text()) for r in range(args.world)]
    print(f"{specs[0].label}, {args.world} ranks (s per step; held = last arrival to last release of each call, "
          "between = last release to the next call's last arrival; main CPU per rank, mean)")
    print(f"{'step':>4} {'wall':>7} {'calls':>5} {'held':>7} {'between':>8} {'main CPU':>9} {'in calls':>9}")
    for step in range(2, args.steps):
        row = _split(ranks, step)
        print(f"{step:>4} {row['step_s']:>7.3f} {row['calls']:>5} {row['held_s']:>7.3f} {row['between_s']:>8.3f} "
              f"{row['main_cpu_s']:>9.3f} {row['main_cpu_in_calls_s']:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
