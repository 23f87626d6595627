"""Published per-GPU memory of real runs against the simulator's peaks.

``hzpsim/data/published_memory.csv`` holds measured per-GPU memory with full layouts from
public sources (the calibration CSV's columns plus ``memory_kind``: ``reserved`` /
``allocated`` / ``reserved (inferred)`` / ``unknown``, ``memory_unit``: ``GiB`` / ``GB``, and
``memory_quote``: the table row it was read from; how each source logs memory is in
``docs/validation.md`` "Memory"). Each row is mapped like a throughput row
(:func:`~hzpsim.validation.mapping.case_from_row`) and simulated; the measured figure is
compared with the predicted peak of the same kind: ``peak_memory_reserved_bytes`` for reserved
figures (``torch.cuda.max_memory_reserved``, what torchtitan logs), ``peak_memory_allocated_bytes``
for allocated ones (Megatron's ``mem-max-allocated-bytes``). Rows of unknown kind are listed,
not scored. Relative errors are (predicted - measured) / measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from hzpsim.config import ScenarioError
from hzpsim.validation.csvfile import read_rows
from hzpsim.validation.mapping import Case, case_from_row, case_scenario

MEMORY_CSV = Path(__file__).resolve().parent.parent / "data" / "published_memory.csv"
UNIT_BYTES = {"GiB": 2.0**30, "GB": 1e9}
SCORED_KINDS = {"reserved": "peak_memory_reserved_bytes", "reserved (inferred)": "peak_memory_reserved_bytes",
                "allocated": "peak_memory_allocated_bytes"}
STATED = ("act_recompute blank", "micro_batch blank")
"""Assumption prefixes that mean the row does not state what its memory depends on."""

COLUMNS = ("source_id", "row", "label", "status", "reason", "memory_kind", "meas_memory_bytes",
           "pred_memory_bytes", "err_memory", "fits_in_memory", "inputs_stated")


def memory_cases(path: str | Path | None = None) -> list[tuple[Case, dict[str, Any]]]:
    """Every row of the memory CSV as (Case, row)."""
    rows = read_rows(path or MEMORY_CSV)
    for column in ("memory_per_gpu_gb", "memory_kind", "memory_unit"):
        if column not in rows[0]:
            raise ScenarioError(f"{path or MEMORY_CSV}: missing required column {column}")
    return [(_not_on_blackwell(case_from_row(row, i, need_measurement=False)), row) for i, row in enumerate(rows)]


UNVALIDATED_DEVICES = ("b200", "gb200")
"""Devices whose memory rows are listed but not scored yet: the rows on them need mechanisms
hzpsim lacks (docs/validation.md §7: torchtitan's compiled loss, float8 with per-op SAC, MoE
dispatch buffers of DeepEP); with them the score would read 36 rows, median 8.9 %, 4 false OOM."""


def _not_on_blackwell(case: Case) -> Case:
    device = (case.scenario_mapping or {}).get("cluster", {}).get("device")
    if device in UNVALIDATED_DEVICES and case.skip_reason is None:
        return dataclasses.replace(case, skip_reason=f"gpu: memory on {device} not validated yet (docs/validation.md §7)")
    return case


def inputs_stated(case: Case) -> bool:
    """The row states its recompute policy and micro-batch (no default was assumed for them)."""
    return not any(a.startswith(STATED) for a in case.assumptions)


def validate_memory(pairs: Sequence[tuple[Case, dict[str, Any]]],
                    progress: Callable[[str], None] | None = None) -> pd.DataFrame:
    """Simulate every mappable row; one record per row (skipped ones with their reason)."""
    from hzpsim.run import run_choice

    records = []
    for case, row in pairs:
        kind, unit = str(row.get("memory_kind") or "unknown"), str(row.get("memory_unit") or "")
        rec: dict[str, Any] = {k: None for k in COLUMNS}
        rec.update(source_id=case.source_id, row=case.row_index, label=case.label, memory_kind=kind,
                   inputs_stated=inputs_stated(case))
        value = row.get("memory_per_gpu_gb")
        if value is None or unit not in UNIT_BYTES:
            rec.update(status="skip", reason=f"memory_per_gpu_gb / memory_unit: not a figure in GiB or GB ({value!r} {unit!r})")
            records.append(rec)
            continue
        rec["meas_memory_bytes"] = float(value) * UNIT_BYTES[unit]
        scenario, why_not = case_scenario(case, progress)
        if scenario is None:
            rec.update(why_not)
            records.append(rec)
            continue
        try:
            report = run_choice(scenario, scenario.strategies[0])
        except ValueError as exc:
            rec.update(status="invalid", reason=str(exc))
            records.append(rec)
            continue
        rec["fits_in_memory"] = bool(report["fits_in_memory"])
        if kind not in SCORED_KINDS:
            rec.update(status="unscored", reason=f"memory_kind {kind!r}: not known to be allocated or reserved",
                       pred_memory_bytes=report["peak_memory_reserved_bytes"])
            records.append(rec)
            continue
        predicted = report[SCORED_KINDS[kind]]
        rec.update(status="ok", pred_memory_bytes=predicted,
                   err_memory=(predicted - rec["meas_memory_bytes"]) / rec["meas_memory_bytes"])
        records.append(rec)
    return pd.DataFrame.from_records(records, columns=list(COLUMNS))


def memory_summary(frame: pd.DataFrame) -> dict[str, Any]:
    """``memory_rows`` scored, ``memory_num_sources``, median and 90th-percentile absolute
    relative error, and the same per source."""
    ok = frame[frame["status"] == "ok"]
    err = ok["err_memory"].astype(float).abs()
    by_source = {src: {"n": int(len(g)), "median_err": float(g["err_memory"].astype(float).median()),
                       "median_abs_err": float(g["err_memory"].astype(float).abs().median())}
                 for src, g in ok.groupby("source_id")}
    return {"memory_rows": int(len(ok)), "memory_num_sources": int(ok["source_id"].nunique()),
            "memory_median_abs_error": float(err.median()) if len(err) else None,
            "memory_p90_abs_error": float(err.quantile(0.9)) if len(err) else None,
            "memory_by_source": by_source}


def false_oom_rows(frames: Sequence[pd.DataFrame]) -> int:
    """Rows that ran (every published row did) but are predicted not to fit, among rows that
    state their recompute policy and micro-batch (``inputs_stated``) and keep their states on
    the device (a run that offloaded optimizer states or activations to the host, which the
    simulator does not model, is rightly predicted not to fit without it)."""
    count = 0
    for frame in frames:
        ran = frame[(frame["status"] == "ok") | (frame["status"] == "unscored")]
        if "caveats" in ran:
            ran = ran[~ran["caveats"].fillna("").str.contains("offload")]
        stated = ran[ran["inputs_stated"].astype(bool)]
        count += int((stated["fits_in_memory"] == False).sum())  # noqa: E712  (a pandas column)
    return count


def format_memory(frame: pd.DataFrame, summary: dict[str, Any]) -> str:
    """The memory rows as a table, with the headline figures under it."""
    gib = 2**30
    lines = [f"{'memory row':<52} {'kind':<10} {'meas GiB':>9} {'pred GiB':>9} {'error':>7}  fits"]
    for r in frame.itertuples():
        meas = "" if r.meas_memory_bytes is None or pd.isna(r.meas_memory_bytes) else f"{r.meas_memory_bytes / gib:.1f}"
        pred = "" if r.pred_memory_bytes is None or pd.isna(r.pred_memory_bytes) else f"{r.pred_memory_bytes / gib:.1f}"
        err = "" if r.err_memory is None or pd.isna(r.err_memory) else f"{r.err_memory:+.1%}"
        fits = "" if r.fits_in_memory is None or pd.isna(r.fits_in_memory) else ("yes" if r.fits_in_memory else "NO")
        note = "" if r.status == "ok" else f"  ({r.status}: {str(r.reason)[:60]})"
        lines.append(f"{str(r.label)[:52]:<52} {r.memory_kind[:10]:<10} {meas:>9} {pred:>9} {err:>7}  {fits}{note}")
    median, p90 = summary.get("memory_median_abs_error"), summary.get("memory_p90_abs_error")
    lines.append(f"memory: {summary['memory_rows']} rows from {summary['memory_num_sources']} sources scored; "
                 f"median |error| {'n/a' if median is None else f'{median:.1%}'}, "
                 f"p90 {'n/a' if p90 is None else f'{p90:.1%}'}; rows that ran but are predicted not to fit "
                 f"(recompute and micro-batch stated): {summary['false_oom_rows']}")
    return "\n".join(lines)
