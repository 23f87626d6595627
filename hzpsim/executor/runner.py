"""Run a :class:`RunSpec` on N local processes (spawned) and aggregate the ranks' measurements.

    python -c "from hzpsim.executor.runner import run; from hzpsim.executor.spec import demo; print(run(demo()))"

Aggregation (what ``hzpsim validate executor`` compares): losses are the mean over the ranks
that computed one (data-parallel replicas; the last pipeline stage); step time is the slowest
rank's median after warm-up; collective counts and bytes and model-state bytes are summed over
all ranks; peak memory is the largest rank's.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hzpsim.config import ScenarioError
from hzpsim.executor.counting import KINDS
from hzpsim.executor.spec import RunSpec


@dataclass
class RunResult:
    """One executor run, aggregated over ranks."""

    spec: RunSpec
    losses: list[float]
    step_time_s: float
    collective_counts: dict[str, int]
    comm_bytes: dict[str, int]
    other_collective_counts: dict[str, int]
    model_state_bytes: int
    model_state_breakdown_bytes: dict[str, int]
    peak_memory_bytes: int
    peak_memory_method: str
    buffer_bytes: int
    wall_s: float
    counting_complete: bool = True  # hooked calls == the backend flight recorder's entries, every rank
    sharing_factor: float | None = None  # mean of the ranks' sharing factors before and after the steps
    ranks: list[dict[str, Any]] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def aggregate(spec: RunSpec, ranks: list[dict[str, Any]], wall_s: float) -> RunResult:
    """Combine the ranks' ``rank<r>.json`` records (see module docstring)."""
    losses = []
    for k in range(spec.num_steps):
        values = [r["losses"][k] for r in ranks if not math.isnan(r["losses"][k])]
        losses.append(sum(values) / len(values) if values else math.nan)
    counts = {kind: sum(r["collectives"]["counts"][kind] for r in ranks) for kind in KINDS}
    sizes = {kind: sum(r["collectives"]["bytes"][kind] for r in ranks) for kind in KINDS}
    other: dict[str, int] = {}
    for r in ranks:
        for kind, n in r["collectives"]["other_counts"].items():
            other[kind] = other.get(kind, 0) + n
    complete = all(r["collectives"]["check"].get("backend_calls", 0) == r["collectives"]["check"]["hooked_calls"]
                   for r in ranks)
    breakdown = {key: sum(r["model_state_bytes"][key] for r in ranks) for key in ("params", "grads", "optimizer")}
    return RunResult(
        spec=spec, losses=losses, step_time_s=max(r["step_time_s"] for r in ranks),
        collective_counts=counts, comm_bytes=sizes, other_collective_counts=other,
        model_state_bytes=sum(breakdown.values()), model_state_breakdown_bytes=breakdown,
        peak_memory_bytes=max(r["peak_memory_bytes"] for r in ranks),
        peak_memory_method=ranks[0]["peak_memory_method"], buffer_bytes=max(r["buffer_bytes"] for r in ranks),
        wall_s=wall_s, counting_complete=complete, ranks=ranks,
        sharing_factor=(sum(x for r in ranks for x in r.get("sharing_factors", []))
                        / max(sum(len(r.get("sharing_factors", [])) for r in ranks), 1)
                        if any(r.get("sharing_factors") for r in ranks) else None),
    )


def launch(world: int, module_args: list[str], out_dir: str, timeout_s: float, what: str,
           threads_per_rank: int = 1, on_poll=None) -> None:
    """Start ``world`` processes of ``python -m <module_args>`` with torchrun's environment
    variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), wait for all of them.
    Raises ScenarioError naming the failing rank, or on timeout (every rank is killed: no hang).
    ``on_poll(rank0_log_path)`` is called about 20 times a second while they run."""
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": str(threads_per_rank), "PYTHONUNBUFFERED": "1"}
            log = open(Path(out_dir) / f"rank{rank}.log", "w+", encoding="utf-8")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", *module_args], env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                raise ScenarioError(f"{what} failed on rank {failed[0]}: {_last_error(logs[failed[0]])}")
            if time.monotonic() > deadline:
                raise ScenarioError(f"{what} on {world} ranks exceeded {timeout_s:.0f} s"
                                    f" (rank 0 last said: {_last_error(logs[0])})")
            if on_poll is not None:
                on_poll(Path(out_dir) / "rank0.log")
            time.sleep(0.05)
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise ScenarioError(f"{what} failed on rank {failed[0]}: {_last_error(logs[failed[0]])}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def run(spec: RunSpec, timeout_s: float = 900.0) -> RunResult:
    """Run ``spec`` on ``spec.world_size`` local processes (``python -m hzpsim.executor.worker``,
    the torchrun entry point) and aggregate their measurements."""
    return run_many([spec], timeout_s)[0]


def run_many(specs: list[RunSpec], timeout_s: float = 900.0) -> list[RunResult]:
    """Run several specs of the same world size one after the other in ONE set of processes
    (torch is imported and the process group created once: much faster on a small machine)."""
    for spec in specs:
        spec.validate()
    worlds = {1 if s.strategy == "reference" else s.world_size for s in specs}
    if len(worlds) != 1:
        raise ScenarioError("executor: run_many needs specs of one world size")
    world = worlds.pop()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hzpsim-exec-") as out_dir:
        spec_file = Path(out_dir) / "spec.json"
        spec_file.write_text(json.dumps([s.to_mapping() for s in specs]))
        launch(world, ["hzpsim.executor.worker", "--spec", str(spec_file), "--out", out_dir], out_dir,
               timeout_s * len(specs), f"executor: {','.join(s.strategy for s in specs)}", specs[0].threads_per_rank)
        wall = (time.perf_counter() - start) / len(specs)
        results = []
        for i, spec in enumerate(specs):
            suffix = "" if i == 0 else f"-{i}"
            ranks = [json.loads((Path(out_dir) / f"rank{r}{suffix}.json").read_text()) for r in range(world)]
            results.append(aggregate(spec, ranks, wall))
    return results


def _last_error(log) -> str:
    log.flush()
    log.seek(0)
    lines = [line.strip() for line in log.read().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1][:300]


_REFERENCE_CACHE: dict[str, list[float]] = {}


def reference_losses(spec: RunSpec) -> list[float]:
    """Losses of the single-process reference on the same model, data and steps (cached)."""
    import dataclasses

    from hzpsim.executor.spec import Layout

    ref = dataclasses.replace(spec, strategy="reference", world_size=1, layout=Layout(), comm_delay_s=0.0,
                              measure_memory=False, micro_batch_size=spec.micro_batch_size, label="reference")
    key = json.dumps(ref.to_mapping(), sort_keys=True, default=str)
    if key not in _REFERENCE_CACHE:  # in this process: one rank, no process group
        import torch

        from hzpsim.executor.trainers import ReferenceTrainer

        threads = torch.get_num_threads()
        torch.set_num_threads(ref.threads_per_rank)
        try:
            trainer = ReferenceTrainer(ref)
            _REFERENCE_CACHE[key] = [trainer.step(k) for k in range(ref.num_steps)]
        finally:
            torch.set_num_threads(threads)
    return _REFERENCE_CACHE[key]


def max_loss_diff(result: RunResult, reference: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(result.losses, reference))
