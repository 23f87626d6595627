"""``hzpsim validate published``: its options, their checks, the table and the JSON.

Part of :mod:`hzpsim.validation`; the CLI calls :func:`add_arguments` and
:func:`run_from_args`. Run it as

    hzpsim validate published --source S09 --max-devices 8
    python -m hzpsim.validation --row 0 --row 52 --json

Nonsense options (``--max-rows 0``, ``--row`` past the CSV's end, an unknown ``--family`` or
``--source``, an unreadable ``--csv``) exit 2 with one line ``hzpsim: error: <option>: <problem>``.
"""

from __future__ import annotations

import argparse
import json as _json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from hzpsim.calibration import profile as calibration
from hzpsim.config import ScenarioError
from hzpsim.validation.csvfile import rows_to_scenarios, select_cases
from hzpsim.validation.mapping import STRATEGY_FAMILIES, Case
from hzpsim.validation.run import summarize, validate_published


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
    lines = [f"{'regime':<16} {'rows':>5} {'in-sample median':>17} {'p90':>7} {'CV median':>10} {'CV p90':>7}"]
    for name, f in [("all", s), *s["by_regime"].items()]:
        if f is None:
            lines.append(f"{name:<16} {'<3':>5} {'n/a':>17} {'n/a':>7} {'n/a':>10} {'n/a':>7}")
            continue
        lines.append(f"{name:<16} {f['num_rows']:>5} {_pct_or_na(f['in_sample_median_abs_error']):>17} "
                     f"{_pct_or_na(f['in_sample_p90_abs_error']):>7} {_pct_or_na(f['cv_median_abs_error']):>10} "
                     f"{_pct_or_na(f['cv_p90_abs_error']):>7}")
    return "\n".join(lines)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "item"):  # numpy scalars
        return v.item()
    return v



def _check_positive(option: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ScenarioError(f"{option}: {value} must be a positive whole number")


def _check_names(option: str, given: Sequence[str] | None, known: Sequence[str], what: str) -> None:
    """Every name of a repeatable name option must be known (case-insensitive)."""
    folded = {k.lower() for k in known}
    for name in given or ():
        if name.lower() not in folded:
            raise ScenarioError(f"{option}: unknown {what} {name!r} (known: {', '.join(known)})")


def check_options(
    cases: Sequence[Case],
    families: Sequence[str] | None = None,
    sources: Sequence[str] | None = None,
    max_rows: int | None = None,
    max_devices: int | None = None,
    rows: Sequence[int] | None = None,
) -> None:
    """ScenarioError ``"<option>: <problem>"`` for a selection option that cannot mean anything
    for these cases (the rows of one CSV)."""
    _check_positive("--max-rows", max_rows)
    _check_positive("--max-devices", max_devices)
    _check_names("--family", families, STRATEGY_FAMILIES, "strategy family")
    _check_names("--source", sources, sorted({c.source_id for c in cases}), "source")
    for r in rows or ():
        if not 0 <= r < len(cases):
            raise ScenarioError(f"--row: {r} is not a row of the CSV (0..{len(cases) - 1})")


def main_published(
    csv_path: str | Path | None = None,
    families: Sequence[str] | None = None,
    sources: Sequence[str] | None = None,
    max_rows: int | None = None,
    json: bool = False,
    max_devices: int | None = None,
    rows: Sequence[int] | None = None,
    out: Any = None,
    profile: str | Path | None = None,
) -> int:
    """``hzpsim validate published``: print the table (or JSON {rows, summary}); exit code 0,
    2 (one line on stderr) when the CSV cannot be read or an option is nonsense."""
    out = out or sys.stdout
    try:
        try:
            cases = rows_to_scenarios(csv_path)
        except ScenarioError as exc:
            raise ScenarioError(f"--csv: {exc}") from None
        check_options(cases, families, sources, max_rows, max_devices, rows)
        fit = None
        if profile is not None:
            try:
                fit = calibration.load(profile)
            except ValueError as exc:
                raise ScenarioError(f"--profile: {exc}") from None
    except ScenarioError as exc:
        print(f"hzpsim: error: {exc}", file=sys.stderr)
        return 2
    selected = select_cases(cases, families, sources, max_devices, max_rows, rows)
    df = validate_published(selected, profile=fit)
    if json:
        records = [{k: _jsonable(v) for k, v in r.items()} for r in df.to_dict("records")]
        print(_json.dumps({"rows": records, "summary": summarize(df)}, indent=2), file=out)
    else:
        print(format_validation(df), file=out)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``hzpsim validate published`` (for the CLI to reuse)."""
    parser.add_argument("--csv", dest="csv_path", help="CSV to read (default: the packaged published_calibration.csv)")
    parser.add_argument("--family", action="append", dest="families",
                        help=f"CSV strategy_family to keep ({', '.join(STRATEGY_FAMILIES)}); repeatable")
    parser.add_argument("--source", action="append", dest="sources", help="source_id to keep (e.g. S09); repeatable")
    parser.add_argument("--max-devices", type=int, help="skip rows with more GPUs than this")
    parser.add_argument("--max-rows", type=int, help="keep only the first N selected rows")
    parser.add_argument("--row", type=int, action="append", dest="rows", help="CSV row index (0-based); repeatable")
    parser.add_argument("--json", action="store_true", help="print {rows, summary} as JSON")
    parser.add_argument("--profile", dest="calibration_profile", metavar="FILE",
                        help="calibration profile JSON whose constants and folds to score (default: the shipped fit)")


def run_from_args(args: argparse.Namespace) -> int:
    """Run ``hzpsim validate published`` with parsed :func:`add_arguments` options."""
    return main_published(args.csv_path, args.families, args.sources, args.max_rows, args.json,
                          args.max_devices, args.rows, profile=args.calibration_profile)
