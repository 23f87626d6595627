"""The table of ``hzpsim validate published``: the ok rows, then the error statistics per
regime, the same-cluster orderings and the reasons rows were not run.

Part of :mod:`hzpsim.validation`; the command itself (its options, their checks and the JSON)
is :mod:`hzpsim.cli.validate`.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from hzpsim.validation.run import summarize


def _f(v: Any, fmt: str, empty: str = "-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return empty
    return format(v, fmt)


def format_validation(df: pd.DataFrame) -> str:
    """Human-readable table of the ok rows, then summary statistics and skip reasons."""
    lines: list[str] = []
    ok = df[df["status"] == "ok"]
    if len(ok):
        header = (f"{'case':<36} {'strategy':<18} {'meas tok/s/GPU':>14} {'pred':>10} {'err %':>7} "
                  f"{'MFU meas':>8} {'pred':>6} {'fits':>4}  flags")
        lines += [header, "-" * len(header)]
        for _, r in ok.iterrows():
            flags = []
            if r["derived"]:
                flags.append("derived")
            if r["assumptions"]:
                flags.append("assumed")
            if r["caveats"]:
                flags.append("caveat")
            if r["basis"] == "reported_only":
                flags.append(f"reported-only {r['reported_metric']} err {_f(r['err_reported_pct'], '+.1f')}%")
            lines.append(
                f"{r['label'][:36]:<36} {str(r['strategy'])[:18]:<18} "
                f"{_f(r['meas_tokens_per_s_per_gpu'], ',.0f'):>14} {_f(r['pred_tokens_per_s_per_gpu'], ',.0f'):>10} "
                f"{_f(r['err_tokens_pct'], '+.1f'):>7} {_f(r['meas_mfu_palm'], '.1%'):>8} {_f(r['pred_mfu'], '.1%'):>6} "
                f"{'yes' if r['fits_in_memory'] else 'NO':>4}  {','.join(flags)}"
            )
        lines.append("")
    s = summarize(df)
    lines.append(
        f"cases {s['cases']}: " + ", ".join(f"{k} {v}" for k, v in sorted(s["status_counts"].items()))
    )
    if s["compared_on_tokens"]:
        lines.append(
            f"tokens/s/GPU error over {s['compared_on_tokens']} rows: median |err| {s['median_abs_err_pct']:.1f}%, "
            f"mean |err| {s['mean_abs_err_pct']:.1f}%, mean (signed) {s['mean_err_pct']:+.1f}%, "
            f"median (signed) {s['median_err_pct']:+.1f}%, within 10% {s['within_10_pct']}, within 25% {s['within_25_pct']}"
        )
        lines.append("by source: " + "; ".join(
            f"{k} n={v['n']} median {v['median_err_pct']:+.1f}%" for k, v in s["by_source"].items()))
        lines.append("worst: " + "; ".join(f"{w['label']} {w['err_tokens_pct']:+.1f}%" for w in s["worst"]))
        lines += ["", format_error_summary(s)]
        groups = [g for g in s["orderings"] if g["pairs"]]
        if groups:
            lines.append(f"same-cluster orderings: {sum(g['matches'] for g in groups)} of {len(groups)} groups "
                         f"predicted in the measured order ({sum(g['agree'] for g in groups)} of "
                         f"{sum(g['pairs'] for g in groups)} pairs)")
            lines += [f"  {'ok ' if g['matches'] else 'NO '} {g['group']}: {g['agree']}/{g['pairs']} pairs, rows "
                      + ",".join(map(str, g["rows"])) for g in groups]
    if s["reported_only_compared"]:
        lines.append(
            f"reported-only rows (approximate, other FLOP conventions): {s['reported_only_compared']}, "
            f"median err {s['reported_only_median_err_pct']:+.1f}%"
        )
    if s["skip_reasons"]:
        lines.append("not run:")
        lines += [f"  {n:4d}  {reason}" for reason, n in s["skip_reasons"].items()]
    return "\n".join(lines)


def _pct_or_na(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def format_error_summary(s: dict[str, Any]) -> str:
    """In-sample and leave-one-source-out |error| per regime (the figures that count)."""
    lines = [f"{'regime':<16} {'rows':>5} {'in-sample median':>17} {'p90':>7} {'CV median':>10} {'CV p90':>7} "
             f"{'in 80% interval':>16}"]
    for name, f in [("all", s), *s["by_regime"].items()]:
        if f is None:
            lines.append(f"{name:<16} {'<3':>5} {'n/a':>17} {'n/a':>7} {'n/a':>10} {'n/a':>7} {'n/a':>16}")
            continue
        lines.append(f"{name:<16} {f['num_rows']:>5} {_pct_or_na(f['in_sample_median_abs_error']):>17} "
                     f"{_pct_or_na(f['in_sample_p90_abs_error']):>7} {_pct_or_na(f['cv_median_abs_error']):>10} "
                     f"{_pct_or_na(f['cv_p90_abs_error']):>7} {_pct_or_na(f.get('band_coverage_80')):>16}")
    return "\n".join(lines)
