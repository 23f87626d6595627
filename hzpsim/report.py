"""From a Trace to the numbers people plan with (DESIGN §5 JSON contract).

Every definition here is DESIGN §5's:

- ``step_time_s``: time between the ends of the last two optimizer steps (the optimizer op
  closes a step on every rank), i.e. one steady-state step.
- ``mfu``: model FLOPs per step (PaLM: 6 x active matmul params + 12 L a d s per token) over
  step_time x devices x the dense peak of the GEMM dtype; ``hfu`` adds recompute FLOPs on the
  same basis.
- ``overlap_fraction`` / ``exposed_comm_s``: on each simulated rank, within the reported step,
  the union of time its communication ops are in flight, split into the part covered by its
  compute stream being busy (hidden) and the rest (exposed). The worst rank is reported.
- ``peak_memory_allocated_bytes``: what ``torch.cuda.max_memory_allocated`` would say on the
  worst rank: the live tensors at their peak, plus the GEMM library's workspace; ``memory_breakdown_bytes``: its categories at that instant.
- ``peak_memory_reserved_bytes``: what ``torch.cuda.max_memory_reserved`` would say: the rank's
  allocations replayed through the caching allocator (:mod:`hzpsim.sim.allocator`); equal to
  the allocated peak on a device without one. ``peak_memory_bytes`` is the same number.
- ``device_overhead_bytes``: device memory outside PyTorch's allocator (the driver's context and
  one buffer set per collective communicator the rank holds: the device file's ``memory``).
- ``fits_in_memory``: the replay never ran out of the capacity less the overhead, and at least
  ``cluster.min_memory_headroom_bytes`` is left; ``memory_headroom_bytes`` = capacity -
  overhead - reserved (negative: short by that much).
- ``comm_bytes_per_device``: bytes one device sends in the reported step, by the level crossed
  (intra_node = island + between-island; inter_node = leaf + spine), worst rank.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from hzpsim.hardware.compute import calibrated_device
from hzpsim.hardware.topology import INTRA_NODE_LEVELS
from hzpsim.model import Model
from hzpsim.model.ops import (
    COMPUTE,
    HOST_STREAM,
    MEMORY_CATEGORIES,
    STEP_END_CATEGORY,
    GraphError,
    Op,
)
from hzpsim.model.training import Training
from hzpsim.scenario import Scenario
from hzpsim.sim.allocator import communicators, replay
from hzpsim.sim.engine import Trace
from hzpsim.sim.lengths import WAIT_KEY

JSON_KEYS = (
    "step_time_s",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "tflops_per_device",
    "mfu",
    "hfu",
    "peak_memory_bytes",
    "peak_memory_allocated_bytes",
    "peak_memory_reserved_bytes",
    "device_overhead_bytes",
    "memory_headroom_bytes",
    "memory_capacity_bytes",
    "memory_breakdown_bytes",
    "fits_in_memory",
    "exposed_comm_s",
    "overlap_fraction",
    "bubble_fraction",
    "comm_bytes_per_device",
    "strategy_resolved",
    "num_devices",
    "num_parameters",
    "num_active_parameters",
    "sim_wall_s",
    "num_events",
)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def step_boundaries(trace: Trace) -> list[float]:
    """End time of each optimizer step (latest op of category ``STEP_END_CATEGORY`` across
    ranks: the step boundary contract of ``hzpsim.model.ops``). GraphError if a step has none, or if
    fewer than two steps were simulated."""
    ends: dict[int, float] = {}
    steps = set()
    for op in trace.graph.ops:
        steps.add(op.step)
        if op.category == STEP_END_CATEGORY and op.kind == COMPUTE:
            ends[op.step] = max(ends.get(op.step, 0.0), trace.end_s[op.id])
    if steps - ends.keys() or len(ends) < 2:
        missing = sorted(steps - ends.keys())
        raise GraphError(f"step {missing[0] if missing else 'count'}: a step needs a compute op of category "
                         f"'{STEP_END_CATEGORY}' (the step boundary, see hzpsim.model.ops), and two steps are needed")
    return [ends[k] for k in sorted(ends)]


def resident_memory(trace: Trace, rank: int) -> dict[str, float]:
    """What ``rank`` holds for the whole run, by category (every category present): its model
    states and pre-allocated buffers (the graph's static memory) and, under ``other``, the
    device's GEMM workspace (cuBLAS keeps one per stream that runs GEMMs, from the first one on)."""
    current = {c: 0.0 for c in MEMORY_CATEGORIES}
    for category, size in trace.graph.static_memory[rank].items():
        current[category] += size
    current["other"] += trace.topology.device.gemm_workspace_bytes
    return current


def memory_peak(trace: Trace, rank: int) -> tuple[float, dict[str, float]]:
    """Peak bytes on ``rank`` and the breakdown by category at that instant (after all the
    events of one instant)."""
    current = resident_memory(trace, rank)
    peak, at_peak = sum(current.values()), dict(current)
    previous = None
    for now, category, size, _ in trace.memory_events[rank]:
        if now != previous and previous is not None:  # the previous instant's events are all in
            total = sum(current.values())
            if total > peak:
                peak, at_peak = total, dict(current)
        current[category] += size
        previous = now
    total = sum(current.values())
    if total > peak:
        peak, at_peak = total, dict(current)
    return peak, at_peak


def device_memory(trace: Trace) -> dict[str, Any]:
    """Allocated and reserved peaks (the highest of any simulated rank; the breakdown is the
    highest-allocating rank's), the overhead and headroom of the rank with the least room, and
    whether every rank fits. See the module docstring for the definitions."""
    graph, device, spec = trace.graph, trace.topology.device, trace.topology.spec
    groups = list(graph.groups.values())
    rows: dict[int, dict[str, Any]] = {}
    for r in graph.weights:
        allocated, breakdown = memory_peak(trace, r)
        static = resident_memory(trace, r)
        overhead = device.context_bytes + device.communicator_bytes * communicators(groups, r)
        room = device.memory_bytes - overhead
        events = trace.memory_events[r]
        if device.caching_allocator:
            free_run = replay(static, events, None, spec.expandable_segments)
            reserved, out = free_run.peak_reserved_bytes, False
            if reserved > room:  # the allocator gives cached segments back before it gives up
                capped = replay(static, events, room, spec.expandable_segments)
                out = capped.out_of_memory
                reserved = reserved if out else capped.peak_reserved_bytes
        else:
            reserved = allocated
            out = reserved > room
        headroom = room - reserved
        rows[r] = {"peak_memory_allocated_bytes": allocated, "breakdown": breakdown,
                   "peak_memory_reserved_bytes": reserved, "device_overhead_bytes": overhead,
                   "memory_headroom_bytes": headroom,
                   "fits_in_memory": not out and headroom >= spec.min_memory_headroom_bytes}
    most = max(rows, key=lambda r: (rows[r]["peak_memory_allocated_bytes"], -r))
    tightest = min(rows, key=lambda r: (rows[r]["memory_headroom_bytes"], r))
    return {"peak_memory_allocated_bytes": rows[most]["peak_memory_allocated_bytes"],
            "breakdown": rows[most]["breakdown"],
            "peak_memory_reserved_bytes": max(row["peak_memory_reserved_bytes"] for row in rows.values()),
            "device_overhead_bytes": rows[tightest]["device_overhead_bytes"],
            "memory_headroom_bytes": rows[tightest]["memory_headroom_bytes"],
            "fits_in_memory": all(row["fits_in_memory"] for row in rows.values())}


def ops_by_rank(trace: Trace) -> dict[int, list[Op]]:
    out: dict[int, list[Op]] = {r: [] for r in trace.graph.weights}
    for op in trace.graph.ops:
        for r in op.ranks:
            out[r].append(op)
    return out


StepSpans = dict[str, list[tuple[float, float, str, str]]]
"""One rank's ops in the reported step by stream: (start, end, kind, category), times clipped
to the step (plain values: the collector never needs to look at them)."""


def step_spans(trace: Trace, ops: list[Op], window: tuple[float, float]) -> StepSpans:
    """One rank's ``ops`` (in order) by stream, with their times clipped to ``window``. Ops
    that do not overlap it are left out; every stream the ops use has an entry. A stream's
    ops run one after the other, so its list is in time order (which makes sorting them with
    other streams' cheap)."""
    lo, hi = window
    start_s, end_s = trace.start_s, trace.end_s
    out: StepSpans = {}
    for op in ops:
        spans = out.get(op.stream)
        if spans is None:
            spans = out[op.stream] = []
        start, end = start_s[op.id], end_s[op.id]
        if start < lo:
            start = lo
        if end > hi:
            end = hi
        if end > start:
            spans.append((start, end, op.kind, op.category))
    return out


def overlap(spans: StepSpans) -> tuple[float, float]:
    """(exposed, hidden) communication seconds of one rank in the reported step."""
    compute: list[tuple[float, float]] = []
    comm: list[tuple[float, float]] = []
    for stream, items in spans.items():
        if stream == HOST_STREAM:  # only device compute hides communication
            continue
        for start, end, kind, _ in items:
            (compute if kind == COMPUTE else comm).append((start, end))
    busy, talking = _union(compute), _union(comm)
    hidden = _intersection(busy, talking)
    return _length(talking) - hidden, hidden


def comm_bytes(trace: Trace, step: int, period: int = 1) -> dict[int, dict[str, float]]:
    """Bytes each simulated rank sends in ``step``, by intra_node / inter_node (with ``period``
    > 1: per step, over the ``period`` steps ending at ``step``)."""
    out = {r: {"intra_node": 0.0, "inter_node": 0.0} for r in trace.graph.weights}
    ops = trace.graph.ops
    levels: dict[int, tuple[float, float]] = {}  # id(plan) -> (intra, inter): the engine shares plans
    for op_id, plan in trace.plans.items():
        op = ops[op_id]
        if not step - period < op.step <= step:
            continue
        known = levels.get(id(plan))
        if known is None:
            known = levels[id(plan)] = (
                sum(v for k, v in plan.bytes_by_level.items() if k in INTRA_NODE_LEVELS),
                plan.bytes_by_level.get("leaf", 0.0),  # spine bytes are a subset of the NIC's
            )
        intra, inter = known
        for rank in op.senders:
            sent = out[rank]
            sent["intra_node"] += intra
            sent["inter_node"] += inter
    if period > 1:
        out = {r: {k: v / period for k, v in sent.items()} for r, sent in out.items()}
    return out


def attention_keys(meta: dict[str, Any], num_steps: int) -> float | None:
    """Keys each token attends over in the reported step: with variable-length sequences the
    mean over its micro-batches and ranks of the token-weighted mean document piece length
    (``model/sequences.py``: what per-document masks leave of seq_len); None for whole rows."""
    lengths = meta.get("sequence_lengths")
    if not lengths:
        return None
    m = lengths["num_micro_batches"]
    rows = lengths["effective_tokens"][(num_steps - 1) * m:num_steps * m]
    return math.fsum(math.fsum(row) for row in rows) / (len(rows) * lengths["dp"])


def build_report(trace: Trace, model: Model, training: Training, strategy_resolved: dict[str, Any]) -> dict[str, Any]:
    graph = trace.graph
    device = trace.topology.device
    n = graph.num_devices
    ends = step_boundaries(trace)
    # a strategy whose steps differ in a cycle (co2: an outer exchange every few steps) reports
    # the mean over its last cycle (graph meta ``report_period``, steps); else the last step
    period = int(graph.meta.get("report_period", 1))
    step_time = (ends[-1] - ends[-1 - period]) / period
    last_step = len(ends) - 1
    window = (ends[-1 - period], ends[-1])
    tokens = training.global_batch_size * model.seq_len
    peak_flops = device.peak_flops_per_s(graph.compute_dtype)
    model_flops = model.model_flops_per_token(attention_keys(graph.meta, len(ends))) * tokens
    # recompute on the model-FLOPs basis (full attention, no causal halving)
    recompute_flops = tokens * sum(model.recompute_forward_flops(i, 1, training.activation_recompute, causal=False,
                                                                 float8=training.precision == "fp8",
                                                                 modules=training.recompute_modules)
                                   for i in range(model.num_layers))
    mfu = model_flops / (step_time * n * peak_flops)
    hfu = (model_flops + recompute_flops) / (step_time * n * peak_flops)

    memory = device_memory(trace)
    peak, breakdown = memory["peak_memory_allocated_bytes"], memory["breakdown"]

    # Sums over devices: a simulated rank counts once per device it stands for. fsum keeps
    # the symmetric and the expanded runs bit-identical (n copies of x sum to round(n*x)).
    comm_parts, hidden_parts = [], []
    exposed_by_rank: dict[int, float] = {}
    by_rank = ops_by_rank(trace)
    spans = {r: step_spans(trace, by_rank[r], window) for r in graph.weights}
    for r in graph.weights:
        exposed, hidden = overlap(spans[r])
        exposed, hidden = exposed / period, hidden / period
        exposed_by_rank[r] = exposed
        comm_parts.append((exposed + hidden) * graph.weights[r])
        hidden_parts.append(hidden * graph.weights[r])
    comm_total, hidden_total = math.fsum(comm_parts), math.fsum(hidden_parts)
    bytes_by_rank = comm_bytes(trace, last_step, period)
    busiest = max(bytes_by_rank, key=lambda r: (sum(bytes_by_rank[r].values()), -r))

    report: dict[str, Any] = {
        "step_time_s": step_time,
        "tokens_per_s": tokens / step_time,
        "tokens_per_s_per_device": tokens / step_time / n,
        "tflops_per_device": model_flops / step_time / n / 1e12,
        "mfu": mfu,
        "hfu": hfu,
        "peak_memory_bytes": memory["peak_memory_reserved_bytes"],
        "peak_memory_allocated_bytes": peak,
        "peak_memory_reserved_bytes": memory["peak_memory_reserved_bytes"],
        "device_overhead_bytes": memory["device_overhead_bytes"],
        "memory_headroom_bytes": memory["memory_headroom_bytes"],
        "memory_capacity_bytes": device.memory_bytes,
        "memory_breakdown_bytes": {c: breakdown[c] for c in MEMORY_CATEGORIES},
        "fits_in_memory": memory["fits_in_memory"],
        "exposed_comm_s": max(exposed_by_rank.values()),
        "overlap_fraction": hidden_total / comm_total if comm_total > 0 else None,
        "bubble_fraction": None,
        "comm_bytes_per_device": bytes_by_rank[busiest],
        "strategy_resolved": strategy_resolved,
        "num_devices": n,
        "calibrated_device": calibrated_device(device),
        "num_parameters": model.num_params(),
        "num_active_parameters": model.num_active_params(),
        "sim_wall_s": trace.sim_wall_s,
        "num_events": trace.num_events,
    }
    if graph.meta.get("pp", 1) > 1:
        report["bubble_fraction"] = max(idle_fraction(spans[r], window) for r in graph.weights)
    report["memory_over_capacity_bytes"] = max(-memory["memory_headroom_bytes"], 0.0)
    report["stream_utilization"] = stream_utilization(spans[graph.ranks[0]], window)
    critical = max(graph.weights, key=lambda r: (exposed_by_rank[r], -r))
    report["time_breakdown_s"] = {key: seconds / period for key, seconds in time_breakdown(
        trace, by_rank[critical], spans[critical], window, trace.waits.get(critical, ())).items()}
    return report


def time_breakdown(trace: Trace, ops: list[Op], spans: StepSpans, window: tuple[float, float],
                   waits: Sequence[tuple[float, float]] = ()) -> dict[str, float]:
    """Where one rank's step goes, instant by instant: ``compute.<category>`` while it computes
    (forward, backward, optimizer ...), ``exposed.<category>`` while it only communicates
    (param_gather, grad_reduce, tp, pp, cp, ep ...; shared equally among the categories in
    flight), ``host`` while device work waits for the host thread to launch it (kernel
    launches, list-form views and copies, a synchronisation), ``idle`` while it waits on other
    ranks (the pipeline bubble), ``wait.sequence_lengths`` while a collective waits for ranks
    whose documents took longer (``waits``, variable-length sequences: ``sim/lengths.py``).
    Sums to the step. ``ops`` are the rank's ops, ``spans`` those in the step
    (:func:`step_spans`)."""
    lo, hi = window
    edges: list[tuple[float, int, str]] = []  # (time, +1/-1, key)
    for stream, items in spans.items():
        if stream == HOST_STREAM:
            continue
        for start, end, kind, category in items:
            key = ("compute." if kind == COMPUTE else "exposed.") + category
            edges += [(start, 1, key), (end, -1, key)]
    for start, end in waits:
        start, end = max(start, lo), min(end, hi)
        if end > start:
            edges += [(start, 1, WAIT_KEY), (end, -1, WAIT_KEY)]
    for start, end in _host_waits(trace, ops, lo):
        start, end = max(start, lo), min(end, hi)
        if end > start:
            edges += [(start, 1, "host"), (end, -1, "host")]
    edges.sort()
    active: dict[str, int] = {}
    out: dict[str, float] = {}
    last = lo
    for time, delta, key in edges + [(hi, 0, "")]:
        if time > last:
            busy = [k for k, v in active.items() if v > 0]
            computing = [k for k in busy if k.startswith("compute.")]
            talking = [k for k in busy if k.startswith("exposed.")]
            waiting = [k for k in busy if k == WAIT_KEY]  # before its transfer, a collective waits for late ranks
            share = computing or waiting or talking or busy or ["idle"]
            for k in share:
                out[k] = out.get(k, 0.0) + (time - last) / len(share)
            last = time
        if key:
            active[key] = active.get(key, 0) + delta
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _host_waits(trace: Trace, ops: list[Op], since: float) -> list[tuple[float, float]]:
    """Intervals in which a device op was ready but for the host op that launches it (or the
    host synchronisation before it): from when everything else it waits for was done to the
    end of that host op. Only those ending after ``since``: an op that ended by then was
    launched by then."""
    graph_ops, end_s = trace.graph.ops, trace.end_s
    previous: dict[str, float] = {}
    out = []
    for op in ops:
        if op.stream == HOST_STREAM:
            continue
        if end_s[op.id] <= since:
            previous[op.stream] = end_s[op.id]
            continue
        host_end = max((end_s[d] for d in op.deps if graph_ops[d].stream == HOST_STREAM), default=None)
        others = max((end_s[d] for d in op.deps if graph_ops[d].stream != HOST_STREAM), default=0.0)
        ready = max(others, previous.get(op.stream, 0.0))
        if host_end is not None and host_end > ready:
            out.append((ready, host_end))
        previous[op.stream] = end_s[op.id]
    return out


def chrome_trace(trace: Trace, window: tuple[float, float] | None = None) -> dict[str, Any]:
    """The simulated ranks' ops as a Chrome / Perfetto trace (``chrome://tracing``): one process
    per simulated rank, one thread per stream, microseconds; only ops overlapping ``window``
    (default: the reported step)."""
    if window is None:
        ends = step_boundaries(trace)
        window = (ends[-2], ends[-1])
    lo, hi = window
    events: list[dict[str, Any]] = []
    streams: dict[tuple[int, str], int] = {}
    for op in trace.graph.ops:
        start, end = trace.start_s[op.id], trace.end_s[op.id]
        if end < lo or start > hi:
            continue
        for rank in op.senders:
            tid = streams.setdefault((rank, op.stream), len(streams))
            events.append({"name": op.name, "cat": op.category, "ph": "X", "pid": rank, "tid": tid,
                           "ts": start * 1e6, "dur": (end - start) * 1e6})
    for (rank, stream), tid in streams.items():
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": stream}})
    for rank, weight in trace.graph.weights.items():
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank} (x{weight} devices)"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def idle_fraction(spans: StepSpans, window: tuple[float, float]) -> float:
    """Share of ``window`` (the reported step) in which a rank has nothing in flight: it waits
    on another rank (the pipeline schedule's bubble, when this is the worst stage)."""
    lo, hi = window
    active = _union((start, end) for items in spans.values() for start, end, _, _ in items)
    return 1.0 - _length(active) / (hi - lo)


def stream_utilization(spans: StepSpans, window: tuple[float, float]) -> dict[str, float]:
    """Busy fraction of each stream of one simulated rank in the reported step."""
    lo, hi = window
    return {s: _length(_union((start, end) for start, end, _, _ in items)) / (hi - lo)
            for s, items in sorted(spans.items())}


def _windows_text(model: Model) -> str:
    """``, window W on N of L layers`` for a model with sliding-window attention, else ''."""
    windowed = [w for i in range(model.num_layers) if (w := model.attention_window(i)) is not None]
    return f", window {windowed[0]} on {len(windowed)} of {model.num_layers} layers" if windowed else ""


def format_summary(scenario: Scenario) -> str:
    """The three header lines of a table: model, training, cluster."""
    model, training, topology = scenario.model, scenario.training, scenario.topology
    device = topology.device
    tokens = training.global_batch_size * model.seq_len
    return "\n".join(
        [
            f"model    {model.name}: {model.num_params() / 1e9:.2f}B parameters "
            f"({model.num_active_params() / 1e9:.2f}B active), "
            f"{model.model_flops_per_token() / 1e9:.1f} GFLOP/token (PaLM), seq {model.seq_len}"
            + _windows_text(model),
            f"training {training.global_batch_size} x {model.seq_len} = {tokens / 1e6:.2f}M tokens/step, "
            f"micro-batch {training.micro_batch_size}, {training.precision}, grads {training.grad_dtype}, "
            f"recompute {training.activation_recompute}"
            + (f" ({', '.join(training.recompute_modules)})" if training.recompute_modules else ""),
            f"cluster  {topology.num_devices} x {device.name} ({topology.num_nodes} nodes x "
            f"{topology.devices_per_node}, preset {topology.spec.preset}), "
            f"{device.peak_flops_per_s(training.precision) / 1e12:.0f} TFLOP/s peak, "
            f"{device.memory_bytes / 2**30:.0f} GiB",
        ]
    )


def to_json(report: dict[str, Any] | list[dict[str, Any]]) -> str:
    return json.dumps(report, indent=2, sort_keys=True)
