"""pandas views of hzpsim results, for notebooks and scripts.

    from hzpsim import frames
    report, trace = frames.simulate(scenario)          # one strategy, with its Trace
    frames.ops_frame(trace)                            # one row per op of the reported step
    frames.reports_frame(reports)                      # compare: one row per strategy
    frames.search_frame(result)                        # search: one row per candidate
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

from hzpsim import strategies
from hzpsim.report import step_boundaries
from hzpsim.scenario import Scenario, StrategyChoice
from hzpsim.sim.engine import Trace


def simulate(scenario: Scenario, choice: StrategyChoice | None = None) -> tuple[dict[str, Any], Trace]:
    """The report and the Trace of one strategy of ``scenario`` (its first by default;
    adaptive choices resolved)."""
    from hzpsim.run import choose

    traces: list[Trace] = []
    report, _ = choose(scenario, choice or scenario.strategies[0], traces=traces)
    return report, traces[0]


def step_window(trace: Trace) -> tuple[float, float]:
    """(start, end) seconds of the reported (last) step."""
    ends = step_boundaries(trace)
    return ends[-2], ends[-1]


def ops_frame(trace: Trace, whole_run: bool = False) -> pd.DataFrame:
    """One row per (op, simulated rank) overlapping the reported step (or the whole run):
    name, category, kind, stream, rank, start_s / end_s / duration_s (from the step start),
    flops, bytes (collective size), collective, group size."""
    lo, hi = (0.0, float("inf")) if whole_run else step_window(trace)
    rows = []
    graph = trace.graph
    for op in graph.ops:
        start, end = trace.start_s[op.id], trace.end_s[op.id]
        if end < lo or start > hi:
            continue
        for rank in op.ranks[:1] if op.collective == "send_recv" else op.ranks:
            rows.append({
                "name": op.name, "category": op.category, "kind": op.kind, "stream": op.stream, "rank": rank,
                "step": op.step, "start_s": start - (0.0 if whole_run else lo),
                "end_s": end - (0.0 if whole_run else lo), "duration_s": end - start,
                "flops": sum(f for _, f in op.flops), "bytes": op.size_bytes if op.collective else op.bytes_accessed,
                "collective": op.collective or "",
                "group_size": len(graph.groups[op.group]) if op.group else 1,
            })
    return pd.DataFrame(rows, columns=["name", "category", "kind", "stream", "rank", "step", "start_s", "end_s",
                                       "duration_s", "flops", "bytes", "collective", "group_size"])


def memory_frame(trace: Trace, rank: int | None = None) -> pd.DataFrame:
    """Memory of one simulated rank (default: the one with the highest peak) over the reported
    step: one row per instant it changes, one column per category (bytes), plus ``total``."""
    from hzpsim.model.ops import MEMORY_CATEGORIES
    from hzpsim.report import memory_peak, resident_memory

    if rank is None:
        rank = max(trace.graph.weights, key=lambda r: (memory_peak(trace, r)[0], -r))
    lo, hi = step_window(trace)
    current = resident_memory(trace, rank)
    rows: list[dict[str, float]] = []
    for time, category, delta, _ in sorted(trace.memory_events[rank], key=lambda e: e[0]):
        if time > hi:
            break
        current[category] += delta
        if time >= lo:
            rows.append({"time_s": time - lo, **current})
        elif rows == [] and time < lo:
            continue
    first = {"time_s": 0.0, **_state_at(trace, rank, lo)}
    frame = pd.DataFrame([first, *rows, {**(rows[-1] if rows else first), "time_s": hi - lo}])
    frame["total"] = frame[list(MEMORY_CATEGORIES)].sum(axis=1)
    frame.attrs["rank"] = rank
    return frame


def _state_at(trace: Trace, rank: int, when: float) -> dict[str, float]:
    from hzpsim.report import resident_memory

    current = resident_memory(trace, rank)
    for time, category, delta, _ in trace.memory_events[rank]:
        if time <= when:
            current[category] += delta
    return current


def reports_frame(reports: Sequence[dict[str, Any]], label_key: str = "label") -> pd.DataFrame:
    """One row per report (``compare``, ``run``, a search's entries) with the headline numbers."""
    rows = []
    for r in reports:
        training = r.get("training_resolved") or {}
        rows.append({
            label_key: r.get(label_key) or strategies.label(r["strategy_resolved"]),
            "strategy": r["strategy_resolved"]["name"],
            "micro_batch_size": training.get("micro_batch_size"),
            "activation_recompute": training.get("activation_recompute"),
            "step_time_s": r["step_time_s"],
            # the 80 % prediction interval (calibration/intervals.py); NaN without one
            "step_time_low_s": (r.get("step_time_interval_s") or [math.nan, math.nan])[0],
            "step_time_high_s": (r.get("step_time_interval_s") or [math.nan, math.nan])[1],
            "tokens_per_s": r["tokens_per_s"],
            "tokens_per_s_per_device": r["tokens_per_s_per_device"],
            "mfu": r["mfu"],
            "peak_memory_gib": r["peak_memory_bytes"] / 2**30,
            "fits_in_memory": r["fits_in_memory"],
            "exposed_comm_s": r["exposed_comm_s"],
            "bubble_fraction": r["bubble_fraction"],
            "inter_node_gb": r["comm_bytes_per_device"]["inter_node"] / 1e9,
        })
    return pd.DataFrame(rows)


def search_frame(result: Any) -> pd.DataFrame:
    """One row per candidate of a :class:`hzpsim.search.SearchResult`: what became of it
    (status, reason), its bounds and, when simulated, its numbers."""
    rows = []
    for row in result.rows:
        c, b, r = row.candidate, row.bound, row.report
        rows.append({
            "family": c.name, "label": c.label(), "micro_batch_size": c.micro_batch_size,
            "activation_recompute": c.activation_recompute, **{f"strategy.{k}": v for k, v in c.fields},
            "status": row.status, "reason": row.reason,
            "bound_step_time_s": b.step_time_s if b else None, "bound_memory_gib": b.memory_bytes / 2**30 if b else None,
            "bound_overhead_gib": b.overhead_bytes / 2**30 if b else None,
            "device_overhead_gib": r["device_overhead_bytes"] / 2**30 if r else None,
            "step_time_s": r["step_time_s"] if r else None, "tokens_per_s": r["tokens_per_s"] if r else None,
            "mfu": r["mfu"] if r else None, "peak_memory_gib": r["peak_memory_bytes"] / 2**30 if r else None,
            "fits_in_memory": bool(r["fits_in_memory"]) if r else (False if row.status in ("pruned_memory", "rejected") else None),
        })
    return pd.DataFrame(rows)
