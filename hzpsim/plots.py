"""Figures for notebooks, reports and ``--plot`` (matplotlib lives only here).

    from hzpsim import frames, plots
    report, trace = frames.simulate(scenario)
    plots.timeline(trace); plots.memory(trace)                # one step of one strategy
    plots.comparison(reports)                                 # strategies side by side
    plots.scaling(points)                                     # throughput vs devices / bandwidth
    plots.search_landscape(result)                            # throughput vs memory of a search
    plots.save(fig, "out.png")

Every function returns a matplotlib Figure (or draws on ``ax`` when given and returns it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from hzpsim import frames, strategies
from hzpsim.frames import reports_frame  # noqa: F401  (kept for notebooks written against it)

_CATEGORY_COLORS = {
    "forward": "#4c72b0", "backward": "#55a868", "optimizer": "#8172b2", "param_gather": "#dd8452",
    "grad_reduce": "#c44e52", "grad_norm": "#937860", "tp": "#da8bc3", "pp": "#8c8c8c", "cp": "#ccb974",
    "ep": "#64b5cd",
}
_MEMORY_COLORS = {"params": "#4c72b0", "grads": "#c44e52", "optimizer": "#8172b2", "activations": "#55a868",
                  "buffers": "#dd8452", "other": "#8c8c8c"}
# strategies take their plugin's COLOR (hzpsim.strategies.color); published-run families
# (hzpsim.strategies.published_families(), in that order) take these in turn
_PUBLISHED_COLORS = ("#55a868", "#c44e52", "#dd8452", "#4c72b0", "#8172b2", "#937860", "#da8bc3", "#8c8c8c",
                     "#ccb974", "#64b5cd")


def published_family_colors() -> dict[str, str]:
    """The colour of each published-run family (the CSV's ``strategy_family``) in figures."""
    families = strategies.published_families()
    return {f: _PUBLISHED_COLORS[i % len(_PUBLISHED_COLORS)] for i, f in enumerate(families)}


def _figure(ax, size: tuple[float, float]):
    import matplotlib

    if ax is not None:
        return ax.figure, ax
    matplotlib.use("Agg", force=False) if _headless() else None
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    return fig, ax


def _headless() -> bool:
    import os

    return not os.environ.get("DISPLAY") and "ipykernel" not in __import__("sys").modules


def save(fig, path: str) -> None:
    """Write ``fig`` (PNG, SVG or PDF by the file name) and release it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def timeline(trace, ranks: Sequence[int] | None = None, ax=None, max_ranks: int = 8):
    """Per-rank stream timeline of the reported step: one row per (simulated rank, stream),
    one bar per op, coloured by category."""
    ops = frames.ops_frame(trace)
    chosen = list(ranks) if ranks is not None else sorted(trace.graph.weights)[:max_ranks]
    ops = ops[ops["rank"].isin(chosen)]
    lanes = sorted({(r, s) for r, s in zip(ops["rank"], ops["stream"])}, key=lambda x: (x[0], x[1] != "compute", x[1]))
    fig, ax = _figure(ax, (11, 0.32 * len(lanes) + 1.4))
    row = {lane: i for i, lane in enumerate(lanes)}
    lo, hi = frames.step_window(trace)
    seen = set()
    for category, group in ops.groupby("category"):
        color = _CATEGORY_COLORS.get(str(category), "#333333")
        for lane, sub in group.groupby(["rank", "stream"]):
            spans = [(max(s, 0.0), min(e, hi - lo) - max(s, 0.0)) for s, e in zip(sub["start_s"], sub["end_s"])]
            ax.broken_barh(spans, (row[lane] - 0.4, 0.8), facecolors=color,
                           label=None if category in seen else category)
            seen.add(category)
    ax.set_yticks(range(len(lanes)))
    weights = trace.graph.weights
    ax.set_yticklabels([f"rank {r} (x{weights[r]}) {s}" for r, s in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, hi - lo)
    ax.set_xlabel("time in the reported step (s)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=6, fontsize=8, frameon=False)
    ax.set_title("streams of one step (simulated ranks; each stands for its equivalence class)", fontsize=10)
    return fig


def memory(trace, rank: int | None = None, capacity_bytes: float | None = None, ax=None):
    """Memory of one rank (default: the fullest) over the reported step, stacked by category."""
    frame = frames.memory_frame(trace, rank)
    fig, ax = _figure(ax, (9, 3.6))
    cats = [c for c in _MEMORY_COLORS if frame[c].max() > 0]
    gib = frame[cats] / 2**30
    ax.stackplot(frame["time_s"], *[gib[c] for c in cats], labels=cats, colors=[_MEMORY_COLORS[c] for c in cats],
                 step="post")
    capacity = capacity_bytes if capacity_bytes is not None else trace.topology.device.memory_bytes
    ax.axhline(capacity / 2**30, color="black", linestyle="--", linewidth=1, label="device memory")
    ax.set_xlabel("time in the reported step (s)")
    ax.set_ylabel("GiB")
    ax.set_title(f"memory of rank {frame.attrs['rank']} over the step", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return fig


def comparison(reports: Sequence[dict[str, Any]], metric: str = "tokens_per_s_per_device", ax=None):
    """A horizontal bar per report for ``metric`` (a ``frames.reports_frame`` column); bars of
    layouts that do not fit in memory are hatched and say so."""
    frame = frames.reports_frame(reports)
    fig, ax = _figure(ax, (8, 0.42 * len(frame) + 1.2))
    colors = [strategies.color(s) for s in frame["strategy"]]
    bars = ax.barh(range(len(frame)), frame[metric], color=colors)
    for bar, fits in zip(bars, frame["fits_in_memory"]):
        if not fits:
            bar.set_hatch("//")
            bar.set_alpha(0.45)
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " OOM", va="center", fontsize=8)
    labels = [f"{lab} mb{m} {rc}" if m else lab for lab, m, rc in
              zip(frame["label"], frame["micro_batch_size"], frame["activation_recompute"])]
    ax.set_yticks(range(len(frame)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(metric.replace("_", " "))
    return fig


def bar_chart(frame: pd.DataFrame, metric: str, label_key: str = "label", ax=None):
    """A horizontal bar per row of ``frame`` for ``metric``; returns the matplotlib Axes."""
    _, ax = _figure(ax, (7, 0.45 * len(frame) + 1))
    ax.barh(frame[label_key], frame[metric])
    ax.invert_yaxis()
    ax.set_xlabel(metric.replace("_", " "))
    return ax


def scaling(points: pd.DataFrame, x: str, y: str = "tokens_per_s_per_device", series: str = "label",
            ax=None, logx: bool = True):
    """Curves of ``y`` against ``x`` (e.g. devices, inter-node bandwidth), one per ``series``;
    points that do not fit in memory (``fits_in_memory`` False) are drawn hollow."""
    fig, ax = _figure(ax, (7.5, 4.2))
    for name, group in points.groupby(series, sort=False):
        group = group.sort_values(x)
        line = ax.plot(group[x], group[y], marker="o", label=str(name))[0]
        if "fits_in_memory" in group:
            oom = group[~group["fits_in_memory"].astype(bool)]
            ax.plot(oom[x], oom[y], "o", markerfacecolor="white", markeredgecolor=line.get_color())
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(x.replace("_", " "))
    ax.set_ylabel(y.replace("_", " "))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    return fig


def search_landscape(result, ax=None):
    """Every candidate a search simulated: throughput against the device memory it takes (what
    PyTorch's allocator reserves at its peak, plus the driver's context and the NCCL
    communicators outside it, so that the device's capacity is the line between fitting and
    not), by family; filled when it fits, hollow when it does not; the best ringed. Candidates
    pruned by a bound are drawn at their bounds (memory lower bound with the communicators it
    counts, throughput upper bound) as small crosses."""
    frame = frames.search_frame(result)
    fig, ax = _figure(ax, (8.5, 5))
    tokens = result.scenario.training.global_batch_size * result.scenario.model.seq_len
    context = result.scenario.topology.device.context_bytes / 2**30
    pruned = frame[frame["status"].isin(["pruned_bound", "pruned_memory"])]
    if len(pruned):
        ax.scatter(pruned["bound_memory_gib"] + pruned["bound_overhead_gib"] + context, tokens / pruned["bound_step_time_s"],
                   marker="x", s=8, color="#bbbbbb", linewidths=0.6, label=f"pruned by a bound ({len(pruned):,})")
    sim = frame[frame["status"] == "simulated"]
    for family, group in sim.groupby("family", sort=False):
        color = strategies.color(str(family), "#333333")
        fits = group[group["fits_in_memory"].astype(bool)]
        oom = group[~group["fits_in_memory"].astype(bool)]
        ax.scatter(fits["peak_memory_gib"] + fits["device_overhead_gib"], fits["tokens_per_s"], s=22, color=color,
                   label=f"{family}")
        ax.scatter(oom["peak_memory_gib"] + oom["device_overhead_gib"], oom["tokens_per_s"], s=22, facecolors="none",
                   edgecolors=color)
    best = result.best
    if best is not None and best.report is not None:
        taken = best.report["peak_memory_bytes"] + best.report["device_overhead_bytes"]
        ax.scatter([taken / 2**30], [best.report["tokens_per_s"]], s=160, facecolors="none",
                   edgecolors="black", linewidths=1.5, label="best: " + strategies.label(best.report["strategy_resolved"]))
    capacity = result.scenario.topology.device.memory_bytes / 2**30
    ax.axvline(capacity, color="black", linestyle="--", linewidth=1)
    ax.text(capacity, ax.get_ylim()[1], " device memory", va="top", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("device memory taken (GiB: reserved peak + context + NCCL communicators; pruned: lower bound)")
    ax.set_ylabel("tokens/s (pruned: upper bound)")
    # simulated as the search counts them (its text and JSON's num_simulated): a candidate built
    # and rejected for its resident model states, or one whose graph failed, was simulated too,
    # but has no step time to draw
    simulated = result.count("simulated", "rejected", "error")
    undrawn = simulated - len(sim)
    note = f"; {undrawn:,} of them out of memory or failed, not drawn" if undrawn else ""
    ax.set_title(f"search: {len(frame):,} candidates, {simulated:,} simulated{note} (hollow: does not fit)",
                 fontsize=10)
    ax.legend(fontsize=7, frameon=False, loc="lower left")
    ax.grid(alpha=0.3)
    return fig


def run_figure(reports: Sequence[dict[str, Any]], traces: Sequence[Any]):
    """What ``hzpsim run --plot`` draws: with one strategy, its stream timeline above its memory
    over the step; with several, the comparison bars."""
    import matplotlib.pyplot as plt

    if len(reports) != 1 or not traces:
        return comparison(reports)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), gridspec_kw={"height_ratios": [3, 2]})
    timeline(traces[0], ax=top)
    memory(traces[0], ax=bottom)
    top.set_title(strategies.label(reports[0]["strategy_resolved"]) + ": " + top.get_title(), fontsize=10)
    fig.tight_layout()
    return fig


def predicted_vs_measured(frame: pd.DataFrame, ax=None):
    """Predicted against measured tokens/s per GPU of ``hzpsim.validation.validate_published``
    rows (status ok), by CSV family, with the y = x line and ±25 % bands."""
    ok = frame[(frame["status"] == "ok") & frame["meas_tokens_per_s_per_gpu"].notna()]
    fig, ax = _figure(ax, (6.5, 5.5))
    colors = published_family_colors()
    for family, group in ok.groupby("family"):
        ax.scatter(group["meas_tokens_per_s_per_gpu"], group["pred_tokens_per_s_per_gpu"], s=18,
                   color=colors.get(str(family), "#333333"), label=f"{family} ({len(group)})")
    if len(ok):
        lo = float(min(ok["meas_tokens_per_s_per_gpu"].min(), ok["pred_tokens_per_s_per_gpu"].min())) * 0.8
        hi = float(max(ok["meas_tokens_per_s_per_gpu"].max(), ok["pred_tokens_per_s_per_gpu"].max())) * 1.25
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=1)
        for factor in (0.75, 1.25):
            ax.plot([lo, hi], [lo * factor, hi * factor], color="gray", linewidth=0.7, linestyle="--")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured tokens/s per GPU")
    ax.set_ylabel("predicted tokens/s per GPU")
    ax.set_title("published runs: predicted vs measured (dashed: ±25 %)", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(alpha=0.3, which="both")
    return fig
