"""One executor rank: set up torch.distributed, train K steps, measure, write ``rank<r>.json``.

Launched by :func:`hzpsim.executor.runner.run` (local spawn) or by ``torchrun`` on a cluster::

    torchrun --nproc-per-node 4 -m hzpsim.executor.worker --spec run.json --out results/
    # (write run.json with: hzpsim execute SCENARIO --world 4 --write-spec run.json)

Per rank it records: the loss of every step, every step's wall time and CPU time (this
process, each of its threads, and the whole machine's busy CPU: on a shared CPU box these say
how many cores the step had and who else used them; with ``RunSpec.measure_sharing`` the
calibration's sharing factor right before and after the steps), the collective calls of
the counted step (see :mod:`hzpsim.executor.counting`), model-state bytes and peak memory
(CUDA: the caching allocator's ``max_memory_allocated``; CPU: bytes live at the start of one
extra step plus the peak of PyTorch's profiler "Total Allocated" during it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hzpsim.executor import counting
from hzpsim.executor.spec import RunSpec, from_mapping
from hzpsim.executor.trainers import make_trainer


def _cpu_peak_during(fn) -> int:
    """Peak of the profiler's CPU "Total Allocated" while ``fn`` runs (bytes allocated after the
    profiler started and still live)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as handle:
            events = json.load(handle)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return int(max(totals, default=0))


def _machine_busy_s() -> float:
    """CPU seconds all cores of the machine spent busy so far (/proc/stat: every state but
    idle and iowait), -1 where there is no /proc/stat: with the step's wall time it says how
    saturated the cores were (this process, the other ranks and anything else running)."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            fields = [int(x) for x in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return -1.0
    ticks = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:8]) - fields[3] - fields[4]) / ticks


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds so far of each thread of this process (/proc/self/task/*/stat), by tid:name."""
    out = {}
    ticks = os.sysconf("SC_CLK_TCK")
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as handle:
                text = handle.read()
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text[text.rindex(")") + 2:].split()
            out[f"{tid}:{name}"] = (int(fields[11]) + int(fields[12])) / ticks
    except (OSError, ValueError):
        pass
    return out


def run_rank(rank: int, world: int, spec_data: dict[str, Any], out_dir: str, port: int | None = None,
             index: int = 0) -> None:
    """Train and measure on this rank, write ``rank<r>.json`` (``rank<r>-<index>.json`` for the
    index-th of several specs run by the same processes); ``port`` None means torchrun's
    environment (MASTER_*). The process group is created once and kept for later specs."""
    spec = from_mapping(spec_data)
    if os.environ.get("HZPSIM_EXEC_TRACEBACK_S"):  # debugging a stuck rank: dump all threads' stacks
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["HZPSIM_EXEC_TRACEBACK_S"]), exit=True)
    torch.set_num_threads(spec.threads_per_rank)
    torch.manual_seed(spec.seed)
    counting.enable_flight_recorder()
    device = torch.device("cpu")
    if spec.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    hook = counting.install(spec.comm_delay_s)
    with hook._lock:
        hook.calls.clear()  # a previous spec of the same processes
    if spec.strategy != "reference" and not dist.is_initialized():
        if port is not None:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if spec.device == "cuda" else "gloo", rank=rank, world_size=world,
                                device_id=device if spec.device == "cuda" else None)
    trainer = make_trainer(spec, device)
    sharing: list[float] = []
    if spec.measure_sharing and dist.is_initialized():
        from hzpsim.executor.calibrate import sharing_factor

        sharing.append(sharing_factor())
    losses: list[float] = []
    times: list[float] = []
    cpu_times: list[float] = []
    machine_busy: list[float] = []
    thread_cpu: list[dict[str, float]] = [_thread_cpu_s()]
    marks: list[int] = []
    for step in range(spec.num_steps):
        counting.set_step(step)
        marks.append(time.time_ns())
        busy = _machine_busy_s()
        cpu = time.process_time()
        start = time.perf_counter()
        losses.append(trainer.step(step))
        if spec.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
        machine_busy.append(_machine_busy_s() - busy)
        thread_cpu.append(_thread_cpu_s())
    finish = getattr(trainer, "finish", None)
    if finish is not None:
        finish()
    marks.append(time.time_ns())
    if sharing:
        from hzpsim.executor.calibrate import sharing_factor

        sharing.append(sharing_factor())
    states = dict(trainer.states)
    buffers = trainer.buffer_bytes()
    records = counting.collected() if spec.strategy != "reference" else []
    backend = counting.backend_call_times() if spec.strategy != "reference" else []
    counted_step = spec.num_steps - 2 if spec.num_steps >= 3 else spec.num_steps - 1
    window = counting.summarize(records, counted_step, marks[0], marks[-1], backend)
    per_step = [counting.summarize(records, k)["counts"] for k in range(spec.num_steps)]

    peak, method = -1, "none"
    counting.set_step(spec.num_steps)
    if spec.measure_memory:
        trainer.zero_grad()
        live = trainer.model_state_bytes()
        resident = live["params"] + live["optimizer"] + live["grads"] + buffers
        if spec.device == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            trainer.step(spec.num_steps)
            torch.cuda.synchronize()
            peak, method = int(torch.cuda.max_memory_allocated(device)), "cuda max_memory_allocated"
        else:
            peak = resident + _cpu_peak_during(lambda: trainer.step(spec.num_steps))
            method = "cpu: resident states + profiler peak Total Allocated"
        if finish is not None:
            finish()
    result = {
        "rank": rank, "world_size": world, "strategy": spec.strategy, "losses": losses, "step_times_s": times,
        "step_time_s": statistics.median(times[spec.warmup_steps:]),
        "cpu_times_s": cpu_times, "thread_cpu_s": thread_cpu, "machine_busy_cpu_s": machine_busy,
        "sharing_factors": sharing,
        "counted_step": counted_step, "collectives": window, "counts_per_step": per_step,
        "model_state_bytes": states, "buffer_bytes": buffers,
        "peak_memory_bytes": peak, "peak_memory_method": method,
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    name = f"rank{rank}.json" if index == 0 else f"rank{rank}-{index}.json"
    with open(Path(out_dir) / name, "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    close = getattr(trainer, "close", None)
    if close is not None:
        close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hzpsim.executor.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, help="RunSpec JSON (hzpsim execute ... --write-spec FILE)")
    parser.add_argument("--out", required=True, help="folder for rank<r>.json")
    args = parser.parse_args(argv)
    with open(args.spec, encoding="utf-8") as handle:
        data = json.load(handle)
    several = data if isinstance(data, list) else [data]  # several specs: run one after the other
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    for index, item in enumerate(several):
        spec: RunSpec = from_mapping(item)
        expected = 1 if spec.strategy == "reference" else spec.world_size
        if world != expected:
            print(f"hzpsim: error: the spec is for {expected} ranks, torchrun started {world}", file=sys.stderr)
            return 2
        run_rank(rank, world, item, args.out, index=index)
    sys.stdout.flush()
    sys.stderr.flush()
    # The results are written. Tearing down gloo process groups (dozens with AsyncHZP's
    # per-thread groups) can block at interpreter exit; nothing is left to do, so leave now.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
