"""``hzpsim calibrate machine``: measure this machine into a device + fabric profile.

All ``--world`` processes run every benchmark at the same time (as training would), so the
numbers are what one rank gets while the others work too:

- compute: fp32 GEMM rate for a sweep of shapes (FLOP/s), memory-bound kernels (an add of two
  vectors, bytes read + written per second) for a sweep of sizes, the cost of one tiny kernel
  (launch / dispatch overhead, seconds) and the host cost per ATen op of an eager training step
  (a tiny decoder's forward + backward over the ops it dispatches: the device's kernel_launch_s);
- the backend's collectives (gloo on CPU, NCCL on CUDA): all-gather, reduce-scatter, all-reduce,
  all-to-all and send/recv for a sweep of sizes (NCCL-tests convention: the full buffer) and
  group sizes (2 and --world), plus the host cost of one call (the smallest all-reduce).

The profile (YAML) holds ``device`` (the simulator's ``cpu-local`` device fields: the median
GEMM rate of the sweep and the median memory-bound rate), ``cluster`` (the fabric fields of the
``local-cpu`` preset: per-step latency and bandwidth; the CLI fits them to the simulator's own
collective model, ``hzpsim.validate_executor.fit_fabric_to_simulator``; :func:`fit_fabric` is the
textbook ring fit, kept under ``measurements.ring_formula_fit``) and the raw ``measurements``. Without ``--out`` it is
written to the user config folder (``$HZPSIM_CONFIG_DIR`` or ``~/.config/hzpsim``) as
``topologies/local-cpu.yaml`` + ``devices/cpu-local.yaml``, which ``local-cpu`` then uses. Run::

    hzpsim calibrate machine --world 4 --out profile-world4.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

#: GEMM shapes (m, k, n) of the sweep: the grid covers the small GEMMs of a training step on a
#: CPU (m = tokens of a micro-batch, or k = tokens for a weight gradient), where the rate is far
#: below a large GEMM's; :func:`effective_gemm_rate` reads a model's rate off it.
GEMM_DIMS_M = (64, 256, 1024)
GEMM_DIMS_KN = (64, 128, 384, 512, 1024)
GEMM_SHAPES = [(m, k, n) for m in GEMM_DIMS_M for k in GEMM_DIMS_KN for n in GEMM_DIMS_KN]
QUICK_GEMM_SHAPES = [(64, 128, 128), (256, 384, 128), (1024, 512, 512)]
MEMORY_ELEMENTS = [2**14, 2**16, 2**18, 2**20, 2**22]
COLLECTIVE_BYTES = [4096, 65536, 1 << 20, 4 << 20, 16 << 20]
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
NCCL_SIMPLE_BASE_S = 8.4e-6  # the simulator adds NCCL's ring/Simple base latency to every collective


def _timed(fn, min_time_s: float, min_reps: int = 3, reps: int | None = None) -> float:
    """Mean seconds per call of ``fn`` (two warm-up calls excluded): ``reps`` calls exactly
    (collectives: every rank must make the same number), else until ``min_time_s`` has passed.
    The mean, not the median: with more processes than cores a process is descheduled now and
    then, and the median of short calls would hide that (training pays it)."""
    fn()
    fn()
    count = 0
    start = time.perf_counter()
    while (count < reps) if reps is not None else (count < min_reps or time.perf_counter() - start < min_time_s):
        fn()
        count += 1
        if count >= 20000:
            break
    return (time.perf_counter() - start) / count


def bench(out_dir: str, quick: bool) -> None:
    """One benchmarking rank (started by :func:`calibrate_machine` with torchrun's variables)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    min_time = 0.02 if quick else 0.15
    shapes = QUICK_GEMM_SHAPES if quick else GEMM_SHAPES
    elements = MEMORY_ELEMENTS[1:3] if quick else MEMORY_ELEMENTS
    sizes = COLLECTIVE_BYTES[:2] if quick else COLLECTIVE_BYTES
    group_sizes = sorted({g for g in (2, world) if 2 <= g <= world})
    total = len(shapes) + len(elements) + 3 + len(group_sizes) * (len(KINDS) * len(sizes) + 1)
    done = [0]

    def progress(label: str) -> None:
        done[0] += 1
        if rank == 0:
            print(f"PROGRESS {done[0]} {total} {label}", flush=True)

    out: dict[str, Any] = {"gemm": [], "memory": [], "collectives": []}
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        dist.barrier()
        t = _timed(lambda a=a, b=b: torch.mm(a, b), min_time / 3 if len(shapes) > 20 else min_time)
        out["gemm"].append({"m": m, "k": k, "n": n, "flops_per_s": 2.0 * m * k * n / t})
        progress(f"gemm {m}x{k}x{n}")
    for count in elements:
        x, y, z = torch.randn(count), torch.randn(count), torch.empty(count)
        dist.barrier()
        t = _timed(lambda x=x, y=y, z=z: torch.add(x, y, out=z), min_time)
        out["memory"].append({"elements": count, "bytes_per_s": 3 * 4 * count / t})
        progress(f"memory {count}")
    one = torch.ones(1)
    dist.barrier()
    out["kernel_launch_s"] = _timed(lambda: torch.add(one, one), min_time, 50)
    progress("kernel launch")
    leaf = torch.ones(1, requires_grad=True)
    dist.barrier()
    # an op recorded by autograd (what a training forward dispatches)
    out["autograd_op_s"] = _timed(lambda: torch.mul(leaf, leaf), min_time, 50)
    progress("autograd op")
    dist.barrier()
    out["eager_op_s"], out["eager_ops_per_step"] = _eager_op_s(min_time)
    progress("eager op")

    for g in group_sizes:
        groups = [dist.new_group(list(range(b, b + g))) for b in range(0, world - world % g, g)]
        mine = groups[rank // g] if rank < len(groups) * g else None
        for kind in KINDS:
            for size in sizes:
                elements_full = max(size // 4, g)
                elements_full -= elements_full % g
                dist.barrier()
                t = -1.0
                if mine is not None:
                    t = _time_collective(kind, elements_full, g, rank % g, mine, min_time)
                out["collectives"].append({"kind": kind, "group_size": g, "size_bytes": elements_full * 4, "time_s": t})
                progress(f"{kind} {g} ranks {size} B")
        dist.barrier()
        out.setdefault("call_issue_s", {})[g] = _issue_time(mine, 20 if min_time < 0.1 else 100) if mine is not None else -1.0
        progress(f"call issue {g} ranks")
    dist.barrier()
    tiny = torch.ones(1)
    out["host_cost_per_call_s"] = _timed(lambda: dist.all_reduce(tiny), min_time, reps=50)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        with open(Path(out_dir) / "bench.json", "w", encoding="utf-8") as handle:
            json.dump(gathered, handle)
    dist.destroy_process_group()


#: The decoder whose eager training step measures the host cost per dispatched ATen op: the
#: executor's Llama-style layer (RMSNorm, RoPE, GQA, SwiGLU) at sizes where the kernels' own
#: work is negligible next to their dispatch, so time / ops is the host cost per op.
EAGER_PROBE_MODEL = "num_layers=2 hidden_size=8 num_heads=2 num_kv_heads=1 ffn_hidden_size=16 vocab_size=16 seq_len=4"


def _eager_op_s(min_time: float) -> tuple[float, int]:
    """Host seconds per ATen op of an eager training step: the mean time of a forward, loss
    and backward of :data:`EAGER_PROBE_MODEL` divided by the ops it dispatches (counted with
    :func:`hzpsim.executor.model.dispatched_ops`, views and ``detach`` included). This is
    the unit the simulator charges (``Model.layer_kernels_forward`` counts the same ops), and
    it includes what a single-op benchmark misses: nn.Module calls, the autograd engine's
    per-node work, gradient accumulation."""
    import torch.nn.functional as F

    from hzpsim.executor.model import batch, build, dispatched_ops
    from hzpsim.model import Model

    sizes = {k: int(v) for k, v in (item.split("=") for item in EAGER_PROBE_MODEL.split())}
    spec = Model(sizes["num_layers"], sizes["hidden_size"], sizes["num_heads"], sizes["ffn_hidden_size"],
                 sizes["vocab_size"], sizes["seq_len"], num_kv_heads=sizes["num_kv_heads"], dropout=False,
                 name="eager-op-probe")
    net = build(spec, 0)
    tokens, targets = batch(spec, 0, 1, 0)
    counted = dispatched_ops(net, tokens, targets)
    ops = sum(counted["forward"].values()) + sum(counted["backward"].values())

    def step() -> None:
        loss = F.cross_entropy(net(tokens).flatten(0, 1), targets.flatten())
        loss.backward()

    return _timed(step, min_time, 20) / ops, ops


def _issue_time(group, reps: int) -> float:
    """Mean host time to ISSUE one collective (a 4-byte all_reduce with ``async_op=True``,
    the wait not included): what the calling thread pays per call before it goes on."""
    import torch
    import torch.distributed as dist

    tiny = torch.ones(1)
    for _ in range(3):
        dist.all_reduce(tiny, group=group, async_op=True).wait()
    spent = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        work = dist.all_reduce(tiny, group=group, async_op=True)
        spent += time.perf_counter() - start
        work.wait()
    return spent / reps


def effective_gemm_rate(gemm: list[dict[str, Any]], shapes: Sequence[tuple[float, float, float]]) -> float:
    """FLOP/s of a set of GEMMs ``(m, k, n)`` (each counted once) at the measured rates: each
    shape takes the rate of the nearest measured shape (log distance over m, k, n), and the
    rate of the set is total FLOPs over total time (a FLOP-weighted harmonic mean)."""
    import math

    def rate(m: float, k: float, n: float) -> float:
        best = min(gemm, key=lambda r: sum(abs(math.log(x / r[d])) for x, d in ((m, "m"), (k, "k"), (n, "n"))))
        return float(best["flops_per_s"])

    flops = sum(2.0 * m * k * n for m, k, n in shapes)
    seconds = sum(2.0 * m * k * n / rate(m, k, n) for m, k, n in shapes)
    return flops / seconds


def _time_collective(kind: str, elements: int, g: int, index: int, group, min_time: float) -> float:
    import torch
    import torch.distributed as dist

    full = torch.randn(elements)
    part = torch.randn(elements // g)
    if kind == "all_gather":
        def fn():
            dist.all_gather_into_tensor(full, part, group=group)
    elif kind == "reduce_scatter":
        def fn():
            dist.reduce_scatter_tensor(part, full, group=group)
    elif kind == "all_reduce":
        def fn():
            dist.all_reduce(full, group=group)
    elif kind == "all_to_all":
        other = torch.empty_like(full)

        def fn():
            dist.all_to_all_single(other, full, group=group)
    else:  # send_recv between the first two ranks of the group, one direction
        peer = dist.get_global_rank(group, 1 - index) if index < 2 else None

        def fn():
            if index == 0:
                dist.send(full, peer)
            elif index == 1:
                dist.recv(full, peer)
    reps = 5 if min_time < 0.1 else (20 if elements * 4 <= (1 << 20) else 8)
    return _timed(fn, min_time, reps=reps)


def fit_fabric(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Per-step latency (s) and bandwidth (bytes/s) that best reproduce the measured times with
    hzpsim's ring model: t = base + steps x latency + volume / bandwidth, where an all-gather or
    reduce-scatter of S bytes over n ranks takes n-1 steps and moves (n-1)/n S per rank, an
    all-reduce twice that, an all-to-all one step and (n-1)/n S, a send one step and S.
    Least squares on times relative to each point (small messages count as much as large)."""
    import numpy as np

    a, b = [], []
    for r in rows:
        if r["time_s"] <= 0:
            continue
        n, size, kind = r["group_size"], r["size_bytes"], r["kind"]
        passes = 2 if kind == "all_reduce" else 1
        if kind in ("all_gather", "reduce_scatter", "all_reduce"):
            steps, volume = passes * (n - 1), passes * (n - 1) / n * size
        elif kind == "all_to_all":
            steps, volume = 1, (n - 1) / n * size
        else:
            steps, volume = 1, size
        t = r["time_s"] - NCCL_SIMPLE_BASE_S
        a.append([steps / r["time_s"], volume / r["time_s"]])
        b.append(t / r["time_s"])
    solution, *_ = np.linalg.lstsq(np.array(a), np.array(b), rcond=None)
    latency = max(float(solution[0]), 1e-7)
    inverse_bandwidth = max(float(solution[1]), 1e-13)
    return latency, 1.0 / inverse_bandwidth


def build_profile(per_rank: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """The profile from every rank's measurements (compute: mean over ranks; collectives: the
    slowest rank of each group, i.e. when the call completes everywhere)."""
    gemm = [{**row, "flops_per_s": statistics.mean(r["gemm"][i]["flops_per_s"] for r in per_rank)}
            for i, row in enumerate(per_rank[0]["gemm"])]
    memory = [{**row, "bytes_per_s": statistics.mean(r["memory"][i]["bytes_per_s"] for r in per_rank)}
              for i, row in enumerate(per_rank[0]["memory"])]
    collectives = [{**row, "time_s": max(r["collectives"][i]["time_s"] for r in per_rank)}
                   for i, row in enumerate(per_rank[0]["collectives"])]
    latency, bandwidth = fit_fabric(collectives)
    flops = statistics.median(g["flops_per_s"] for g in gemm)
    mem = statistics.median(m["bytes_per_s"] for m in memory)
    issue = {int(g): max(r["call_issue_s"][g] for r in per_rank) for g in per_rank[0]["call_issue_s"]}
    autograd_op = statistics.mean(r["autograd_op_s"] for r in per_rank)
    eager_op = statistics.mean(r["eager_op_s"] for r in per_rank)
    return {
        "device": {"name": "cpu-local", "peak_fp32_flops_per_s": flops, "peak_bf16_flops_per_s": flops,
                   "peak_fp16_flops_per_s": flops, "memory_bytes_per_s": mem,
                   # host costs: one ATen op of an eager training step, one collective issued
                   "kernel_launch_s": eager_op, "collective_call_s": max(issue.values())},
        "cluster": {"intra_node_bytes_per_s": bandwidth, "inter_node_bytes_per_s_per_device": bandwidth,
                    "intra_node_latency_s": latency, "inter_node_latency_s": latency,
                    "intra_node_efficiency": 1.0, "inter_node_efficiency": 1.0},
        "measurements": {"world_size": world, "threads_per_rank": 1, "gemm": gemm, "memory": memory,
                         "kernel_launch_s": statistics.mean(r["kernel_launch_s"] for r in per_rank),
                         "host_cost_per_call_s": max(r["host_cost_per_call_s"] for r in per_rank),
                         "autograd_op_s": autograd_op, "eager_op_s": eager_op,
                         "eager_ops_per_probe_step": per_rank[0]["eager_ops_per_step"], "call_issue_s": issue,
                         "collectives": collectives},
        "source": f"hzpsim calibrate machine --world {world} on {platform.node()} "
                  f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores), "
                  f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
    }


def _bar(log: Path, stream: TextIO, state: dict[str, str]) -> None:
    try:
        lines = [line for line in log.read_text(encoding="utf-8").splitlines() if line.startswith("PROGRESS ")]
    except OSError:
        return
    if not lines or lines[-1] == state.get("last"):
        return
    state["last"] = lines[-1]
    _, done, total, label = lines[-1].split(" ", 3)
    filled = int(30 * int(done) / int(total))
    stream.write(f"\rcalibrating [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {label[:40]:<40}")
    stream.flush()


def calibrate_machine(world: int, out: str | None, quick: bool = False, progress: TextIO | None = None,
                      refit=None) -> Path:
    """Run the benchmarks on ``world`` processes and write the profile; returns its path.

    ``refit(collectives, world) -> cluster fields`` replaces the ring-formula fit of the fabric
    (the CLI passes hzpsim.validate_executor.fit_fabric_to_simulator, which fits the simulator's
    own collective model; this package does not import the simulator)."""
    from hzpsim.executor.runner import launch

    state: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="hzpsim-calibrate-") as tmp:
        args = ["hzpsim.executor.calibrate", "--worker", "--out", tmp] + (["--quick"] if quick else [])
        launch(world, args, tmp, 3600.0, "calibrate", 1,
               on_poll=(lambda log: _bar(log, progress, state)) if progress is not None else None)
        if progress is not None:
            _bar(Path(tmp) / "rank0.log", progress, state)
            progress.write("\n")
        per_rank = json.loads((Path(tmp) / "bench.json").read_text(encoding="utf-8"))
    profile = build_profile(per_rank, world)
    if refit is not None:
        profile["measurements"]["ring_formula_fit"] = dict(profile["cluster"])
        profile["cluster"].update(refit(profile["measurements"]["collectives"], world))
    return write_profile(profile, out)


def write_profile(profile: dict[str, Any], out: str | None) -> Path:
    """``out`` gets the whole profile; without it, the user config folder gets the local-cpu
    preset and the cpu-local device override the simulator reads."""
    header = f"# {profile['source']}\n# written by `hzpsim calibrate machine`; read by hzpsim validate executor --profile\n"
    if out is not None:
        path = Path(out)
        path.write_text(header + yaml.safe_dump(profile, sort_keys=False), encoding="utf-8")
        return path
    from hzpsim.presets import user_config_dir

    base = user_config_dir()
    (base / "topologies").mkdir(parents=True, exist_ok=True)
    (base / "devices").mkdir(parents=True, exist_ok=True)
    preset = {"preset": "local-cpu", "device": "cpu-local", "gpus_per_node": profile["measurements"]["world_size"],
              "islands_per_node": 1, "nodes_per_leaf": 64, "spine_oversubscription": 1.0, **profile["cluster"]}
    topo = base / "topologies" / "local-cpu.yaml"
    topo.write_text(header + yaml.safe_dump(preset, sort_keys=False), encoding="utf-8")
    device = {k: v for k, v in profile["device"].items() if k != "name"}
    (base / "devices" / "cpu-local.yaml").write_text(header + yaml.safe_dump(device, sort_keys=False), encoding="utf-8")
    return topo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hzpsim.executor.calibrate")
    parser.add_argument("--worker", action="store_true", help="run as one benchmarking rank")
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        bench(args.out, args.quick)
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
