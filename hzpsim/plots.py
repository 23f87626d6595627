"""Figures for notebooks and reports (matplotlib lives only here).

    from hzpsim.plots import reports_frame, bar_chart
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from hzpsim import strategies


def reports_frame(reports: Sequence[dict[str, Any]], label_key: str = "label") -> pd.DataFrame:
    """One row per report with the headline numbers (``label`` from ``strategy_resolved``)."""
    rows = []
    for r in reports:
        rows.append({
            label_key: r.get(label_key) or strategies.label(r["strategy_resolved"]),
            "tokens_per_s_per_device": r["tokens_per_s_per_device"],
            "mfu": r["mfu"],
            "peak_memory_gib": r["peak_memory_bytes"] / 2**30,
            "fits_in_memory": r["fits_in_memory"],
            "exposed_comm_s": r["exposed_comm_s"],
            "step_time_s": r["step_time_s"],
            "inter_node_gb": r["comm_bytes_per_device"]["inter_node"] / 1e9,
        })
    return pd.DataFrame(rows)


def bar_chart(frame: pd.DataFrame, metric: str, label_key: str = "label", ax=None):
    """A horizontal bar per row of ``frame`` for ``metric``; returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.45 * len(frame) + 1))
    ax.barh(frame[label_key], frame[metric])
    ax.invert_yaxis()
    ax.set_xlabel(metric.replace("_", " "))
    return ax
