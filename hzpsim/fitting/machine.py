"""Fits of a machine's measurements (``hzpsim calibrate machine``): the executor's benchmarks
(``hzpsim.executor.calibrate.measure_machine``) in, a device file and a machine profile out.

- collectives: latency and seconds per byte per kind and group size (:func:`fit_collectives`),
  each call's wall time inside a step (:func:`in_step_costs`), the per-hop wait for a core
  (:func:`hop_delay`);
- the fabric of the ``local-cpu`` node: per-step latency and bandwidth that make the
  simulator's own collective model reproduce the measured times (:func:`fit_fabric_to_simulator`;
  the textbook ring fit :func:`fit_fabric` is kept under ``measurements.ring_formula_fit``);
- the device: :func:`build_profile` gathers the measured fields, :func:`machine_device` turns
  them into a :class:`~hzpsim.hardware.devices.Device` (``cpu-local`` with the measured rates,
  host costs keyed by framework, collective tables and the GEMM sweep), and
  :func:`write_profile` writes the device file and a profile naming it (the one profile format,
  ``hzpsim.calibration.profile``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

from hzpsim.calibration.profile import machine_document
from hzpsim.config import ScenarioError
from hzpsim.executor.calibrate import KINDS
from hzpsim.hardware.collectives import gloo_hops
from hzpsim.hardware.devices import (
    BUILTIN_DIR,
    Device,
    gemm_sweep,
    load_device,
    with_measurements,
    write_device,
)

NCCL_SIMPLE_BASE_S = 8.4e-6  # the simulator adds NCCL's ring/Simple base latency to every collective


def in_step_times(rows: list[list[dict[str, Any]]], world: int) -> list[dict[str, Any]]:
    """Per kind, group size and size: the mean own duration of the in-step calls (all ranks'
    marks, :func:`_time_collective_in_step`): from the last member's issue to each member's
    completion (every rank goes on when its own call returns), averaged over members, calls
    and groups; ``last_completion_s`` to the last member's completion. Send/recv: the pair of
    ranks 0 and 1 of each group."""
    out = []
    for i, row in enumerate(rows[0]):
        g = row["group_size"]
        durations, last = [], []
        for base in range(0, world - world % g, g):
            members = list(range(base, base + 2)) if row["kind"] == "send_recv" else list(range(base, base + g))
            marks = [rows[r][i]["marks"] for r in members]
            if not all(marks):
                continue
            for call in zip(*marks):
                arrived = max(m[0] for m in call)
                durations.append(statistics.mean(m[1] - arrived for m in call) / 1e9)
                last.append((max(m[1] for m in call) - arrived) / 1e9)
        if durations:
            out.append({"kind": row["kind"], "group_size": g, "size_bytes": row["size_bytes"],
                        "time_s": statistics.mean(durations), "last_completion_s": statistics.mean(last)})
    return out


def fit_kind(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Latency (s) and seconds per byte of one kind and group size: t = latency + size x
    per_byte, least squares relative to each point (small and large sizes count alike), both
    >= 0."""
    import numpy as np

    a = np.array([[1.0 / r["time_s"], r["size_bytes"] / r["time_s"]] for r in rows])
    b = np.ones(len(rows))
    best = None
    for columns in ((0, 1), (0,), (1,)):  # the unconstrained fit, else the best one-term fit
        x, *_ = np.linalg.lstsq(a[:, columns], b, rcond=None)
        if (x < 0).any():
            continue
        full = np.zeros(2)
        full[list(columns)] = x
        error = float(np.sum((a @ full - b) ** 2))
        if best is None or error < best[0]:
            best = (error, full)
    assert best is not None
    return float(best[1][0]), float(best[1][1])


def _hops(kind: str, n: int) -> int:
    """Messages a gloo collective's rank waits for in turn (as ``hzpsim.sim.collectives.gloo_hops``,
    which this package may not import): ring all-gather n-1, ring all-reduce and the
    reduce-scatter gloo runs as one 2(n-1), all-to-all n-1, send/recv 1."""
    if kind == "send_recv":
        return 1
    return 2 * (n - 1) if kind in ("all_reduce", "reduce_scatter") else n - 1


#: Sizes the hop delay is read from: above this the calls are bandwidth-bound and the
#: difference between two noisy bandwidth measurements swamps a few ms of waiting.
HOP_DELAY_MAX_BYTES = 1 << 20


def hop_delay(sweep: list[dict[str, Any]], in_step: list[dict[str, Any]]) -> float:
    """Seconds each message of a collective waits inside a step beyond the back-to-back sweep:
    least squares of (in-step time - sweep time) = hops x delay over the kinds, group sizes and
    sizes up to :data:`HOP_DELAY_MAX_BYTES`; >= 0. In the sweep every member sits in the call
    and a woken thread finds an idle core; in a step the other ranks compute, so the thread a
    message wakes waits for a core (the scheduler's slice)."""
    back_to_back = {(r["kind"], r["group_size"], r["size_bytes"]): r["time_s"] for r in sweep if r["time_s"] > 0}
    num, den = 0.0, 0.0
    for r in in_step:
        key = (r["kind"], r["group_size"], r["size_bytes"])
        if key not in back_to_back or r["size_bytes"] > HOP_DELAY_MAX_BYTES:
            continue
        h = gloo_hops(r["kind"], 2 if r["kind"] == "send_recv" else r["group_size"])
        num += h * (r["time_s"] - back_to_back[key])
        den += h * h
    return max(num / den, 0.0) if den else 0.0


def in_step_costs(in_step: list[dict[str, Any]], back_to_back: list[list[Any]]) -> list[list[Any]]:
    """[kind, group size, latency s, seconds per byte] of each call's wall time inside a step:
    fitted to the in-step loop's time from the last member's arrival to the last member's
    completion (:func:`in_step_times` ``last_completion_s``) where it was measured, else the
    back-to-back fit of the same kind and group size."""
    fits = {(k, g): [k, g, lat, b] for k, g, lat, b in back_to_back}
    rows = [{**r, "time_s": r["last_completion_s"]} for r in in_step if r.get("last_completion_s", 0) > 0]
    for kind, g, latency, per_byte in fit_collectives(rows):
        fits[(kind, g)] = [kind, g, latency, per_byte]
    return [fits[key] for key in sorted(fits, key=lambda key: (KINDS.index(key[0]), key[1]))]


def fit_collectives(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """[kind, group size, latency s, seconds per byte] for every measured kind and group size."""
    fits = []
    for kind in KINDS:
        for g in sorted({r["group_size"] for r in rows if r["kind"] == kind}):
            points = [r for r in rows if r["kind"] == kind and r["group_size"] == g and r["time_s"] > 0]
            if len(points) >= 2:
                latency, per_byte = fit_kind(points)
                fits.append([kind, int(g), latency, per_byte])
    return fits


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


def build_profile(per_rank: list[dict[str, Any]], world: int, cpu_pool: bool = True) -> dict[str, Any]:
    """The profile from every rank's measurements (compute: mean over ranks; collectives: the
    slowest rank of each group, i.e. when the call completes everywhere; CPU per call: the mean).

    With ``cpu_pool`` (the default, docs/executor.md) the device is written for the simulator's
    CPU pool (``Device.node_cpu_cores``): compute and host costs are CPU seconds of a rank alone
    on a core (the benchmarks' thread CPU time, not their wall time, which includes waiting for
    a core), the pool's size is the CPU seconds all ranks spent per second of wall while every
    rank worked (Σ 1 / sharing factor), ``collective_cpu_costs`` the CPU each call's members'
    backend threads spent during it, and ``collective_costs`` each call's wall time inside a
    step (:func:`in_step_costs`). Without it every cost is the wall time it took while every
    rank worked (a rank's share of the cores at the calibration's load) and each collective's
    back-to-back time, plus the in-step hop delay."""
    def mean_rows(key: str, fields: tuple[str, ...]) -> list[dict[str, Any]]:
        return [{**row, **{f: statistics.mean(r[key][i][f] for r in per_rank) for f in fields}}
                for i, row in enumerate(per_rank[0][key])]

    gemm = mean_rows("gemm", ("flops_per_s", "cpu_flops_per_s"))
    memory = mean_rows("memory", ("bytes_per_s", "cpu_bytes_per_s"))
    collectives = [{**row, "time_s": max(r["collectives"][i]["time_s"] for r in per_rank),
                    "cpu_s": statistics.mean(r["collectives"][i]["cpu_s"] for r in per_rank)}
                   for i, row in enumerate(per_rank[0]["collectives"])]
    latency, bandwidth = fit_fabric(collectives)
    issue = {int(g): max(r["call_issue_s"][g] for r in per_rank) for g in per_rank[0]["call_issue_s"]}
    issue_cpu = {int(g): statistics.mean(r["call_issue_cpu_s"][g] for r in per_rank) for g in per_rank[0]["call_issue_cpu_s"]}
    autograd_op = statistics.mean(r["autograd_op_s"] for r in per_rank)
    eager_op = statistics.mean(r["eager_op_s"] for r in per_rank)
    sharing = statistics.mean(r["sharing_factor"] for r in per_rank)
    cores = sum(1.0 / r["sharing_factor"] for r in per_rank)
    in_step = in_step_times([r["in_step_marks"] for r in per_rank], world)
    framework = [r["framework"] for r in per_rank if r["framework"]["fsdp2_call_s"] >= 0]
    call_cpu = max(issue_cpu.values())
    basis = "cpu_" if cpu_pool else ""  # the rates' and host costs' keys: alone on a core, or wall at load
    flops = statistics.median(g[basis + "flops_per_s"] for g in gemm)
    device: dict[str, Any] = {
        "name": "cpu-local", "peak_fp32_flops_per_s": flops, "peak_bf16_flops_per_s": flops,
        "peak_fp16_flops_per_s": flops, "memory_bytes_per_s": statistics.median(m[basis + "bytes_per_s"] for m in memory),
        # host costs: one ATen op of an eager training step, one collective issued
        "kernel_launch_s": statistics.mean(r["eager_op_cpu_s"] for r in per_rank) if cpu_pool else eager_op,
        "collective_call_s": call_cpu if cpu_pool else max(issue.values())}
    suffix = "_cpu_s" if cpu_pool else "_s"
    if framework:
        device["fsdp2_call_host_s"] = statistics.mean(f["fsdp2_call" + suffix] for f in framework)
        device["dtensor_op_host_s"] = statistics.mean(f["dtensor_op" + suffix] for f in framework)
        if all("asynchzp_op" + suffix in f for f in framework):
            device["asynchzp_op_host_s"] = statistics.mean(f["asynchzp_op" + suffix] for f in framework)
    # per kind and group size, from the back-to-back sweep (every member in the call): its time
    # and the CPU its backend threads spend per member meanwhile (less the issue, which the
    # simulator charges the caller); with the pool the time is replaced below by the in-step
    # loop's, where the others compute around the call (docs/executor.md)
    back_to_back = fit_collectives(collectives)
    device["collective_costs"] = back_to_back
    cpu_fits = fit_collectives([{**row, "time_s": row["cpu_s"] - call_cpu} for row in collectives
                                if row["cpu_s"] - call_cpu > 0])
    if cpu_pool:
        # the pool shares the cores; what it cannot know is how long a call holds its members
        # when the others compute around it: from the last arrival to the last member's release,
        # measured in the step-like loop (a woken ring thread waits for a core a computing rank
        # holds, and no member goes on before the ring has passed it)
        device.update(node_cpu_cores=cores, collective_cpu_costs=cpu_fits,
                      collective_costs=in_step_costs(in_step, back_to_back))
    if in_step:
        device["collective_hop_delay_s"] = hop_delay(collectives, in_step)  # not charged with the pool
    return {
        "device": device,
        "cluster": {"intra_node_bytes_per_s": bandwidth, "inter_node_bytes_per_s_per_device": bandwidth,
                    "intra_node_latency_s": latency, "inter_node_latency_s": latency,
                    "intra_node_efficiency": 1.0, "inter_node_efficiency": 1.0},
        "measurements": {"world_size": world, "threads_per_rank": 1, "gemm": gemm, "memory": memory,
                         "kernel_launch_s": statistics.mean(r["kernel_launch_s"] for r in per_rank),
                         "host_cost_per_call_s": max(r["host_cost_per_call_s"] for r in per_rank),
                         "autograd_op_s": autograd_op, "eager_op_s": eager_op,
                         "eager_ops_per_probe_step": per_rank[0]["eager_ops_per_step"], "call_issue_s": issue,
                         "call_issue_cpu_s": issue_cpu, "sharing_factor": sharing,
                         "node_cpu_cores": cores, "collective_cpu_costs": cpu_fits,
                         "framework_host": framework,
                         "collectives": collectives, "collectives_in_step": in_step,
                         "collective_costs_back_to_back": back_to_back},
        "source": f"hzpsim calibrate machine --world {world} on {platform.node()} "
                  f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores), "
                  f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
    }


def fit_fabric_to_simulator(collectives: list[dict[str, Any]], world: int) -> dict[str, float]:
    """Per-step latency and bandwidth of the ``local-cpu`` island that make hzpsim's OWN
    collective model (hardware/collectives.py: NCCL's algorithms and protocols, the protocol chosen per
    size) reproduce the measured all-gather, reduce-scatter and all-reduce times best (least
    squares on log time: every size counts alike). A fit of the textbook ring formula would be
    wrong here, because the simulator runs latency-bound calls with NCCL's LL protocol, which
    pays only a fraction of the step latency (gloo has no such protocol)."""
    import numpy as np

    from hzpsim.hardware.collectives import CollectiveModel  # noqa: F811
    from hzpsim.hardware.topology import ClusterSpec, build_topology

    rows = [r for r in collectives if r["kind"] in ("all_gather", "reduce_scatter", "all_reduce") and r["time_s"] > 0]
    if not rows:
        raise ScenarioError("calibrate: no collective measurements to fit")

    def error(latency: float, bandwidth: float) -> float:
        spec = ClusterSpec(preset="local-cpu", gpus_per_node=world, intra_node_bytes_per_s=bandwidth,
                           inter_node_bytes_per_s_per_device=bandwidth, intra_node_latency_s=latency,
                           inter_node_latency_s=latency, intra_node_efficiency=1.0, inter_node_efficiency=1.0)
        topology = build_topology(spec)
        model = CollectiveModel(topology)
        total = 0.0
        for r in rows:
            span = topology.span(list(range(r["group_size"])))
            predicted = model.plan(r["kind"], r["size_bytes"], span).isolated_time_s
            total += (math.log(predicted) - math.log(r["time_s"])) ** 2
        return total

    latencies = np.logspace(-6, -1.5, 28)
    bandwidths = np.logspace(7, 11, 28)
    best = min((error(a, b), a, b) for a in latencies for b in bandwidths)
    _, a, b = best
    for _ in range(2):  # refine around the best grid point
        latencies = a * np.logspace(-0.2, 0.2, 9)
        bandwidths = b * np.logspace(-0.2, 0.2, 9)
        _, a, b = min((error(x, y), x, y) for x in latencies for y in bandwidths)
    return {"intra_node_latency_s": float(a), "inter_node_latency_s": float(a),
            "intra_node_bytes_per_s": float(b), "inter_node_bytes_per_s_per_device": float(b)}


def machine_device(profile: dict[str, Any], name: str = "cpu-local") -> Device:
    """The device of a :func:`build_profile` result: the built-in ``cpu-local`` (one worker
    process of a CPU box) with the measured rates, host costs, collective tables and GEMM
    sweep, named ``name``."""
    base = load_device(BUILTIN_DIR / "cpu-local.yaml")  # never a previous calibration's file
    device = with_measurements(base, {k: v for k, v in profile["device"].items() if k != "name"})
    sweep = gemm_sweep(profile["measurements"].get("gemm") or [])
    return dataclasses.replace(device, name=name, gemm_sweep=sweep, path=None,
                               source=f"measured: {profile['source']}")


def write_profile(profile: dict[str, Any], out: str | None, name: str = "cpu-local") -> Path:
    """Write the machine's device file and a profile naming it; returns the profile's path.

    ``out``: the profile's path, the device file beside it (``<stem>.device.yaml``). Without
    it, the user config folder (``$HZPSIM_CONFIG_DIR`` or ``~/.config/hzpsim``) gets the device
    file ``devices/<name>.yaml`` (which ``cluster.device: <name>`` then reads), the
    ``local-cpu`` preset with the fitted fabric (``topologies/local-cpu.yaml``) and the profile
    ``machine-profile.yaml``."""
    from hzpsim.presets import user_config_dir

    header = (f"{profile['source']}\nwritten by `hzpsim calibrate machine`; "
              "read by --profile (the profile) and cluster.device (the device file)")
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    device = machine_device(profile, name)
    if out is not None:
        path = Path(out)
        device_path = path.with_name(f"{path.stem}.device.yaml")
    else:
        base = user_config_dir()
        (base / "topologies").mkdir(parents=True, exist_ok=True)
        device_path = base / "devices" / f"{name}.yaml"
        preset = {"preset": "local-cpu", "device": name, "gpus_per_node": profile["measurements"]["world_size"],
                  "islands_per_node": 1, "nodes_per_leaf": 64, "spine_oversubscription": 1.0, **profile["cluster"]}
        (base / "topologies" / "local-cpu.yaml").write_text(comment + yaml.safe_dump(preset, sort_keys=False),
                                                           encoding="utf-8")
        path = base / "machine-profile.yaml"
    write_device(device, device_path, header)
    doc = machine_document(os.path.relpath(device_path, path.parent), profile["cluster"],
                           profile["measurements"], profile["source"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(comment + yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def calibrate(per_rank: list[dict[str, Any]], world: int, out: str | None, cpu_pool: bool = True) -> Path:
    """The whole fit of ``hzpsim calibrate machine``: the profile of every rank's measurements,
    its fabric fitted to the simulator's collective model, written (:func:`write_profile`)."""
    profile = build_profile(per_rank, world, cpu_pool)
    profile["measurements"]["ring_formula_fit"] = dict(profile["cluster"])
    profile["cluster"].update(fit_fabric_to_simulator(profile["measurements"]["collectives"], world))
    return write_profile(profile, out)
