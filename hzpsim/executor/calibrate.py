"""``hzpsim calibrate machine``: measure this machine into a device + fabric profile.

All ``--world`` processes run every benchmark at the same time (as training would), so the
numbers are what one rank gets while the others work too; compute benchmarks run for a fixed
window of wall time on every rank at once (:func:`_window`), so no rank runs alone:

- compute: fp32 GEMM rate for a sweep of shapes (FLOP/s), memory-bound kernels (an add of two
  vectors, bytes read + written per second) for a sweep of sizes, the cost of one tiny kernel
  (launch / dispatch overhead, seconds) and the host cost per ATen op of an eager training step
  (a tiny decoder's forward + backward over the ops it dispatches: the device's kernel_launch_s);
  the *sharing factor*, wall / CPU time of that step while every rank runs it (how much
  longer a rank's CPU work takes because the processes share the cores);
- the frameworks' host cost (:func:`_framework_host`): FSDP2's Python per parameter gather /
  gradient reduce call and DTensor's per dispatched op, main-thread CPU of a probe on pairs of
  ranks times the sharing factor;
- the backend's collectives (gloo on CPU, NCCL on CUDA): all-gather, reduce-scatter, all-reduce,
  all-to-all and send/recv for a sweep of sizes (NCCL-tests convention: the full buffer) and
  group sizes (2 and --world), back to back and inside a step-like loop (a burst of compute
  before each call), plus the host cost of issuing one call.

This module measures (``measure_machine``: every rank's raw numbers); the fits that turn them
into a device file (the ``cpu-local`` device with the measured GEMM sweep, memory-bound rate,
host costs keyed by framework, collective tables, CPU pool) and the ``local-cpu`` fabric live
above the simulator, in ``hzpsim.fitting.machine``, which also writes the device file and the
profile naming it (docs/executor.md). Run::

    hzpsim calibrate machine --world 4 --out profile-world4.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

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


def _timed(fn, min_time_s: float, min_reps: int = 3, reps: int | None = None) -> tuple[float, float]:
    """(mean wall seconds, mean CPU seconds of the whole process: every thread, the backend's
    included) per call of ``fn`` (two warm-up calls excluded): ``reps`` calls exactly
    (collectives: every rank must make the same number), else until ``min_time_s`` has passed.
    The mean, not the median: with more processes than cores a process is descheduled now and
    then, and the median of short calls would hide that (training pays it)."""
    fn()
    fn()
    count = 0
    cpu = time.process_time()
    start = time.perf_counter()
    while (count < reps) if reps is not None else (count < min_reps or time.perf_counter() - start < min_time_s):
        fn()
        count += 1
        if count >= 20000:
            break
    return (time.perf_counter() - start) / count, (time.process_time() - cpu) / count


def _window(fn, window_s: float) -> tuple[float, float]:
    """(mean wall seconds, mean CPU seconds of the calling thread) per call of ``fn`` called
    back to back over one window of wall time that every rank runs at the same moment (a start
    time broadcast from rank 0 on the machine's shared clock, after two warm-up calls), so all
    ``--world`` processes compete for the cores for the whole measurement, as in a training
    step. With a fixed number of calls after a barrier the fast ranks finish early and the
    slow ones run the rest alone (here that measured eager ops up to 2x cheaper than a step
    pays, and a wall / CPU sharing factor below the 2 that 4 processes on 2 idle cores get)."""
    import torch.distributed as dist

    fn()
    fn()
    start = [time.time() + 0.05]
    dist.broadcast_object_list(start, src=0)
    begin, end = start[0], start[0] + window_s
    delay = begin - time.time()
    if delay > 0:
        time.sleep(delay)
    count = 0
    cpu = time.thread_time()
    wall = time.perf_counter()
    while count < 3 or time.time() < end:
        fn()
        count += 1
    wall = time.perf_counter() - wall
    return wall / count, (time.thread_time() - cpu) / count


#: Wall time of one sharing-factor measurement (the eager probe on every rank at once), s.
SHARING_WINDOW_S = 0.45


def sharing_factor(window_s: float = SHARING_WINDOW_S) -> float:
    """Wall / CPU time of the eager probe (:data:`EAGER_PROBE_MODEL`, forward + backward) run
    back to back by every rank of the default process group over the same window: how much
    longer a rank's CPU work takes than its CPU time because the processes share the cores
    (4 ranks on 2 idle cores: 2; more while other jobs run). ``calibrate machine`` records it
    with its rates; the executor measures it again right before and after a strategy's steps
    (``RunSpec.measure_sharing``), so a validation can compare at the load it ran under."""
    probe = _EagerProbe(EAGER_PROBE_MODEL)
    wall, cpu = _window(probe.step, window_s)
    return wall / cpu if cpu > 0 else 1.0


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
    total = len(shapes) + len(elements) + 4 + len(group_sizes) * (2 * len(KINDS) * len(sizes) + 1)
    done = [0]

    def progress(label: str) -> None:
        done[0] += 1
        if rank == 0:
            print(f"PROGRESS {done[0]} {total} {label}", flush=True)

    out: dict[str, Any] = {"gemm": [], "memory": [], "collectives": []}
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        dist.barrier()
        t, cpu = _window(lambda a=a, b=b: torch.mm(a, b), min_time / 3 if len(shapes) > 20 else min_time)
        out["gemm"].append({"m": m, "k": k, "n": n, "flops_per_s": 2.0 * m * k * n / t,
                            "cpu_flops_per_s": 2.0 * m * k * n / cpu})
        progress(f"gemm {m}x{k}x{n}")
    for count in elements:
        x, y, z = torch.randn(count), torch.randn(count), torch.empty(count)
        dist.barrier()
        t, cpu = _window(lambda x=x, y=y, z=z: torch.add(x, y, out=z), min_time)
        out["memory"].append({"elements": count, "bytes_per_s": 3 * 4 * count / t, "cpu_bytes_per_s": 3 * 4 * count / cpu})
        progress(f"memory {count}")
    one = torch.ones(1)
    dist.barrier()
    out["kernel_launch_s"], _ = _window(lambda: torch.add(one, one), min_time)
    progress("kernel launch")
    leaf = torch.ones(1, requires_grad=True)
    dist.barrier()
    # an op recorded by autograd (what a training forward dispatches)
    out["autograd_op_s"], _ = _window(lambda: torch.mul(leaf, leaf), min_time)
    progress("autograd op")
    dist.barrier()
    probe = _EagerProbe(EAGER_PROBE_MODEL)
    wall, cpu = _window(probe.step, SHARING_WINDOW_S if not quick else min_time)
    out["eager_op_s"], out["eager_ops_per_step"] = wall / probe.ops, probe.ops
    out["eager_op_cpu_s"] = cpu / probe.ops  # the same op alone on a core (the CPU pool's unit)
    # how much longer a rank's CPU work takes in wall time while every rank works: the
    # processes share the cores (4 on 2 here, plus whatever else runs on the machine)
    out["sharing_factor"] = wall / cpu if cpu > 0 else 1.0
    progress("eager op")
    from hzpsim.executor import counting

    counting.install()  # what the executor runs with: counts the probes' calls (and pays its own cost, as there)
    out["framework"] = _framework_host(world, rank, out["sharing_factor"], 10 if quick else 30)
    progress("framework host")

    for g in group_sizes:
        groups = [dist.new_group(list(range(b, b + g))) for b in range(0, world - world % g, g)]
        mine = groups[rank // g] if rank < len(groups) * g else None
        for kind in KINDS:
            for size in sizes:
                elements_full = max(size // 4, g)
                elements_full -= elements_full % g
                dist.barrier()
                t, cpu = -1.0, -1.0
                if mine is not None:
                    t, cpu = _time_collective(kind, elements_full, g, rank % g, mine, min_time)
                out["collectives"].append({"kind": kind, "group_size": g, "size_bytes": elements_full * 4, "time_s": t,
                                           "cpu_s": cpu})
                progress(f"{kind} {g} ranks {size} B")
                dist.barrier()
                marks: list[tuple[int, int]] = []
                if mine is not None:
                    marks = _time_collective_in_step(kind, elements_full, g, rank % g, mine, probe.step,
                                                     2 if quick else (24 if size <= (1 << 20) else 6))
                out.setdefault("in_step_marks", []).append({"kind": kind, "group_size": g,
                                                            "size_bytes": elements_full * 4, "marks": marks})
                progress(f"{kind} {g} ranks {size} B, in step")
        dist.barrier()
        wall, cpu = _issue_time(mine, 20 if min_time < 0.1 else 100) if mine is not None else (-1.0, -1.0)
        out.setdefault("call_issue_s", {})[g] = wall
        out.setdefault("call_issue_cpu_s", {})[g] = cpu
        progress(f"call issue {g} ranks")
    dist.barrier()
    tiny = torch.ones(1)
    out["host_cost_per_call_s"], _ = _timed(lambda: dist.all_reduce(tiny), min_time, reps=50)
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


#: The probe of the frameworks' host cost: the same layer at sizes tensor parallelism over 2
#: ranks can split (heads, KV heads, sequence for sequence parallelism).
FRAMEWORK_PROBE_MODEL = "num_layers=2 hidden_size=16 num_heads=4 num_kv_heads=2 ffn_hidden_size=32 vocab_size=16 seq_len=4"


def _probe_spec(text: str):
    from hzpsim.model import Model

    sizes = {k: int(v) for k, v in (item.split("=") for item in text.split())}
    return Model(sizes["num_layers"], sizes["hidden_size"], sizes["num_heads"], sizes["ffn_hidden_size"],
                 sizes["vocab_size"], sizes["seq_len"], num_kv_heads=sizes["num_kv_heads"], dropout=False,
                 name="host-probe")


class _EagerProbe:
    """A tiny decoder's eager training step (forward, loss, backward; ``optimizer``: Adam's step
    and zero_grad too) and the ATen ops its forward and backward dispatch (counted with
    :func:`hzpsim.executor.model.dispatched_ops`, views and ``detach`` included): the unit the
    simulator charges host time in (``Model.layer_kernels_forward`` counts the same ops). Its
    time per op includes what a single-op benchmark misses: nn.Module calls, the autograd
    engine's per-node work, gradient accumulation. ``wrap(net)`` applies a framework
    (FSDP2, DTensor TP) to the built model."""

    def __init__(self, text: str, wrap=None, optimizer: bool = False) -> None:
        import torch

        from hzpsim.executor.model import batch, build, dispatched_ops

        spec = _probe_spec(text)
        self.tokens, self.targets = batch(spec, 0, 1, 0)
        counted = dispatched_ops(build(spec, 0), self.tokens, self.targets)
        self.ops = sum(counted["forward"].values()) + sum(counted["backward"].values())
        self.net = build(spec, 0)
        if wrap is not None:
            wrap(self.net)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-6, foreach=True) if optimizer else None

    def step(self) -> None:
        import torch.nn.functional as F

        logits = self.net(self.tokens)
        logits = logits.to_local() if hasattr(logits, "to_local") else logits
        loss = F.cross_entropy(logits.flatten(0, 1), self.targets.flatten())
        loss.backward()
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)


def _thread_cpu_per_call(fn, calls: int) -> float:
    """Mean CPU seconds of the calling thread per call of ``fn`` (``calls`` calls after two
    warm-up calls: a fixed count, as the calls hold collectives every rank of a group must
    match). Waiting for a collective costs the thread no CPU, so this is its host work."""
    fn()
    fn()
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - start) / calls


def _framework_host(world: int, rank: int, sharing: float, calls: int) -> dict[str, float]:
    """Host cost of FSDP2's and DTensor's Python, measured on pairs of ranks (all pairs at once).

    - ``fsdp2_call_s``: FSDP2 ``fully_shard`` on every unit and the root of
      :data:`FRAMEWORK_PROBE_MODEL` (as the executor's ZeRO-3) against the plain model, one
      training step each (forward, backward, Adam): the extra CPU of the main thread per
      parameter all-gather / gradient reduce-scatter it issues (the hooks
      ``_fsdp_state.py::FSDPState._pre_forward`` / ``_post_forward``,
      ``_fsdp_param_group.py::FSDPParamGroup.pre_backward`` / ``post_backward``, the copy-in of
      ``_fsdp_collectives.py::foreach_all_gather``, the copy-out of
      ``foreach_all_gather_copy_out``, ``foreach_reduce``'s chunk-cat and its sharded gradient,
      DTensor's dispatch of Adam's foreach ops on the sharded parameters), less the c10d issue
      itself (charged per call already). The simulator charges it per such call.
    - ``dtensor_op_s``: the same layer tensor-parallel with the executor's plan
      (``executor/nd.py::_tensor_parallel``: ``ColwiseParallel``, ``RowwiseParallel``,
      ``SequenceParallel``, ``PrepareModuleInput``), forward and backward: main-thread CPU per
      ATen op of the plain model (every op on a DTensor goes through
      ``torch/distributed/tensor/_dispatch.py::OpDispatcher.dispatch``: sharding propagation,
      redistribution and the local op; ``parallel/style.py`` adds the input/output hooks and
      the layout conversions), less the issue of its collectives. The simulator charges it
      per dispatched op of a tensor-parallel implementation.

    Each as CPU seconds of a rank alone on a core (``*_cpu_s``: what the simulator's CPU pool
    charges) and, times ``sharing`` (wall / CPU of the plain probe while every rank runs it),
    as the wall seconds a rank's host work takes while all ranks work (the device fields of a
    profile without a CPU pool). Waiting for the pair's collectives costs no CPU, so the tiny
    messages' latency is left out."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from hzpsim.executor import counting

    pairs = [dist.new_group([b, b + 1]) for b in range(0, world - 1, 2)]
    result = {"fsdp2_call_s": -1.0, "dtensor_op_s": -1.0}
    if rank >= 2 * len(pairs):
        return result  # an odd last rank has no partner (the others' groups do not include it)
    group = pairs[rank // 2]
    mesh = DeviceMesh.from_group(group, "cpu")

    def calls_per_step(probe: _EagerProbe) -> float:
        probe.step()
        before = len(counting.collected())
        probe.step()
        return float(len(counting.collected()) - before)

    def shard(net) -> None:
        from torch.distributed.fsdp import fully_shard

        for unit in net.units():
            fully_shard(unit, mesh=mesh)
        fully_shard(net, mesh=mesh)

    def tensor_parallel(net) -> None:
        from hzpsim.executor.nd import _tensor_parallel

        _tensor_parallel(net.units(), mesh)

    asynchzp = _asynchzp_host(world, calls)  # every rank, before the pair-only probes
    issue, issue_cpu = _issue_time(group, 20)
    torch.manual_seed(0)
    plain_opt = _EagerProbe(FRAMEWORK_PROBE_MODEL, optimizer=True)
    plain = _EagerProbe(FRAMEWORK_PROBE_MODEL)
    fsdp = _EagerProbe(FRAMEWORK_PROBE_MODEL, wrap=shard, optimizer=True)
    tp = _EagerProbe(FRAMEWORK_PROBE_MODEL, wrap=tensor_parallel)
    fsdp_calls, tp_calls = calls_per_step(fsdp), calls_per_step(tp)
    cpu = {"plain_opt": _thread_cpu_per_call(plain_opt.step, calls), "plain": _thread_cpu_per_call(plain.step, calls),
           "fsdp2": _thread_cpu_per_call(fsdp.step, calls), "tp": _thread_cpu_per_call(tp.step, calls)}
    result.update({f"{k}_step_cpu_s": v for k, v in cpu.items()})
    result.update(fsdp2_calls_per_step=fsdp_calls, tp_calls_per_step=tp_calls, ops_per_step=float(plain.ops),
                  pair_issue_s=issue)
    for suffix, scale, per_call in (("_s", sharing, issue), ("_cpu_s", 1.0, issue_cpu)):
        result["fsdp2_call" + suffix] = max((cpu["fsdp2"] - cpu["plain_opt"]) * scale / max(fsdp_calls, 1.0) - per_call, 0.0)
        result["dtensor_op" + suffix] = max((cpu["tp"] * scale - tp_calls * per_call) / plain.ops, 0.0)
    # AsyncHZP: its step's Python (main thread and the ag / rs / dp threads, which share the GIL
    # and the core) without the optimizer's share, per dispatched op of the plain model
    if asynchzp["python_cpu_s"] > 0:
        result.update(asynchzp_step_python_cpu_s=asynchzp["python_cpu_s"], asynchzp_calls_per_step=asynchzp["calls"])
        optimizer = max(cpu["plain_opt"] - cpu["plain"], 0.0)
        for suffix, scale, per_call in (("_s", sharing, issue), ("_cpu_s", 1.0, issue_cpu)):
            result["asynchzp_op" + suffix] = max(((asynchzp["python_cpu_s"] - optimizer) * scale
                                                  - asynchzp["calls"] * per_call) / plain.ops, 0.0)
    return result


def _python_threads_cpu_s() -> float:
    """CPU seconds so far of this process's threads except the backend's own (gloo's
    ``gloo_tcp_loop`` and ``pt_gloo_runloop``, NCCL's ``pt_nccl*``): the Python threads, from
    ``/proc/self/task/*/schedstat`` (nanoseconds); the calling thread's time without /proc."""
    total = 0.0
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as handle:
                name = handle.read().strip()
            if name.startswith(("gloo", "pt_")):
                continue
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as handle:
                total += int(handle.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return time.thread_time()
    return total


def _asynchzp_host(world: int, steps: int) -> dict[str, float]:
    """Python CPU per step of hzpsim's AsyncHZP executor (``executor/asynchzp.py``: the
    saved-tensor hooks that re-read gathered weights, the copies into its buffer ring, the
    futures handed to its ag / rs / dp threads) on :data:`FRAMEWORK_PROBE_MODEL`, one
    micro-batch per rank, groups 2 | 2 | ``world``; and its collective calls per step."""
    import torch

    from hzpsim.executor import counting
    from hzpsim.executor.asynchzp import AsyncHZPTrainer
    from hzpsim.executor.spec import Layout, RunSpec

    if world < 2 or world % 2:
        return {"python_cpu_s": -1.0, "calls": 0.0}
    spec = RunSpec(model=_probe_spec(FRAMEWORK_PROBE_MODEL), strategy="asynchzp", world_size=world,
                   global_batch_size=world, micro_batch_size=1, num_steps=steps + 3, warmup_steps=2,
                   layout=Layout(param_group_size=2, grad_group_size=2, optim_group_size=world))
    trainer = AsyncHZPTrainer(spec, torch.device("cpu"))
    try:
        trainer.step(0)
        trainer.finish()
        before = len(counting.collected())
        trainer.step(1)
        trainer.finish()
        calls = float(len(counting.collected()) - before)
        start = _python_threads_cpu_s()
        for k in range(steps):
            trainer.step(2 + k)
        trainer.finish()
        return {"python_cpu_s": (_python_threads_cpu_s() - start) / steps, "calls": calls}
    finally:
        trainer.close()


def _time_collective_in_step(kind: str, elements: int, g: int, index: int, group, compute, reps: int) -> list[tuple[int, int]]:
    """(issue, completion) times (``time.time_ns``: one clock for all processes) of ``reps``
    calls of a collective with a burst of compute before each, as in a training step: one
    forward and backward of the eager probe (``compute``), so every rank arrives at its own
    time, gloo's copies share the cores with ranks that still (or already) compute, and the
    others' compute is what the call's threads compete with. The collective's own duration is
    read off all ranks' marks (:func:`in_step_times`: from the last arrival to the
    completions), which is what the simulator times after its rendezvous."""
    import torch
    import torch.distributed as dist

    full = torch.randn(elements)
    part = torch.randn(elements // g)
    other = torch.empty_like(full)
    peer = dist.get_global_rank(group, 1 - index) if index < 2 else None

    def call():
        if kind == "all_gather":
            dist.all_gather_into_tensor(full, part, group=group)
        elif kind == "reduce_scatter":
            dist.reduce_scatter_tensor(part, full, group=group)
        elif kind == "all_reduce":
            dist.all_reduce(full, group=group)
        elif kind == "all_to_all":
            dist.all_to_all_single(other, full, group=group)
        elif index == 0:
            dist.send(full, peer)
        elif index == 1:
            dist.recv(full, peer)

    marks = []
    for i in range(reps + 1):
        compute()
        start = time.time_ns()
        call()
        if i:  # the first call is a warm-up
            marks.append((start, time.time_ns()))
    return marks


def _issue_time(group, reps: int) -> tuple[float, float]:
    """Mean host time to ISSUE one collective (a 4-byte all_reduce with ``async_op=True``,
    the wait not included): what the calling thread pays per call before it goes on, as (wall
    seconds, CPU seconds of the calling thread)."""
    import torch
    import torch.distributed as dist

    tiny = torch.ones(1)
    for _ in range(3):
        dist.all_reduce(tiny, group=group, async_op=True).wait()
    spent, spent_cpu = 0.0, 0.0
    for _ in range(reps):
        cpu = time.thread_time()
        start = time.perf_counter()
        work = dist.all_reduce(tiny, group=group, async_op=True)
        spent += time.perf_counter() - start
        spent_cpu += time.thread_time() - cpu
        work.wait()
    return spent / reps, spent_cpu / reps


def _time_collective(kind: str, elements: int, g: int, index: int, group, min_time: float) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, every thread) per call, back to back."""
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


def measure_machine(world: int, quick: bool = False, progress: TextIO | None = None) -> list[dict[str, Any]]:
    """Run the benchmarks on ``world`` processes; every rank's raw measurements (the fits that
    turn them into a device file and a fabric live in ``hzpsim.fitting.machine``)."""
    from hzpsim.executor.runner import launch

    state: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="hzpsim-calibrate-") as tmp:
        args = ["hzpsim.executor.calibrate", "--worker", "--out", tmp] + (["--quick"] if quick else [])
        launch(world, args, tmp, 3600.0, "calibrate", 1,
               on_poll=(lambda log: _bar(log, progress, state)) if progress is not None else None)
        if progress is not None:
            _bar(Path(tmp) / "rank0.log", progress, state)
            progress.write("\n")
        return json.loads((Path(tmp) / "bench.json").read_text(encoding="utf-8"))


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
