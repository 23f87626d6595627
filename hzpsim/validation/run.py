"""Simulating the mapped published runs and the statistics of their errors.

Part of :mod:`hzpsim.validation`. One DataFrame row per case (skipped ones included); errors
are signed (pred - meas) / meas in percent, headline statistics on tokens/s per GPU.

    from hzpsim.validation.run import summarize, validate_published
    df = validate_published(cases)
    summarize(df)["median_abs_err_pct"]
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd

from hzpsim.calibration.profile import Profile
from hzpsim.validation.mapping import Case, case_scenario
from hzpsim.validation.published_memory import inputs_stated

COLUMNS = (
    "source_id", "row", "label", "family", "strategy", "n_gpus", "status", "reason", "basis",
    "meas_tokens_per_s_per_gpu", "pred_tokens_per_s_per_gpu", "err_tokens_pct",
    "meas_step_time_s", "pred_step_time_s",
    "meas_mfu_palm", "pred_mfu", "pred_hfu",
    "reported_metric", "meas_reported", "pred_reported", "err_reported_pct",
    "fits_in_memory", "inputs_stated", "pred_peak_mem_gib", "pred_exposed_comm_s", "pred_overlap",
    "sim_wall_s", "derived", "assumptions", "caveats",
    "regimes", "cv_pred_tokens_per_s_per_gpu", "cv_err_tokens_pct",
    "cv_interval_low_tokens_per_s_per_gpu", "cv_interval_high_tokens_per_s_per_gpu", "cv_in_interval",
)
"""Columns of :func:`validate_published`'s DataFrame (and of the ``--json`` rows), in order."""


def _pct(pred: float | None, meas: float | None) -> float | None:
    if pred is None or meas is None or meas == 0:
        return None
    return (pred - meas) / meas * 100.0


def validate_published(
    cases: Iterable[Case],
    progress: Callable[[str], None] | None = None,
    expand: bool = False,
    profile: Profile | None = None,
    cross_validate: bool = True,
) -> pd.DataFrame:
    """Simulate every runnable case; one DataFrame row per case (skipped ones included).

    ``status``: ok | skip (mapping or missing strategy: ``reason``) | invalid (the scenario
    was rejected: ScenarioError message) | error (simulation failed). Errors are signed
    (pred - meas) / meas in percent. Predictions use ``profile``'s constants (default: the
    active calibration); with ``cross_validate``, each row of a source the profile has a fold
    for is simulated again with the constants fitted without that source (``cv_*`` columns:
    the leave-one-source-out prediction).
    """
    from hzpsim.calibration import intervals
    from hzpsim.calibration import profile as calibration
    from hzpsim.run import run_choice  # imported late to keep the CSV side light
    from hzpsim.validation.regimes import regimes_of

    profile = profile or calibration.active()

    records = []
    for case in cases:
        rec: dict[str, Any] = {k: None for k in COLUMNS}
        meas = case.measured
        rec.update(
            source_id=case.source_id, row=case.row_index, label=case.label, family=case.family,
            strategy=_strategy_label(case.scenario_mapping), n_gpus=case.n_gpus, basis=meas["basis"],
            meas_tokens_per_s_per_gpu=meas["tokens_per_s_per_gpu"], meas_step_time_s=meas["step_time_s"],
            derived="; ".join(f"{k}: {v}" for k, v in meas["derived"].items()),
            assumptions="; ".join(case.assumptions), caveats="; ".join(case.caveats),
            inputs_stated=inputs_stated(case),
        )
        scenario, why_not = case_scenario(case, progress)
        if scenario is None:
            rec.update(why_not)
            records.append(rec)
            continue
        t0 = time.perf_counter()
        try:
            # the scenario does not depend on the calibration; its simulation does
            with calibration.using(profile):
                report = run_choice(scenario, scenario.strategies[0], expand=expand)
            fold = profile.for_fold(case.source_id)
            cv_report = None
            if cross_validate and profile.folds:
                # a source the fit did not see (no fold of its own: added after the fit) is
                # predicted out of sample by the fitted constants themselves
                cv_report = report
                if case.source_id in profile.folds and dict(fold.constants) != dict(profile.constants):
                    with calibration.using(fold):
                        cv_report = run_choice(scenario, scenario.strategies[0], expand=expand)
        except Exception as exc:  # a simulator bug on a valid scenario: record, keep going
            rec.update(status="error", reason=f"{type(exc).__name__}: {exc}")
            records.append(rec)
            continue
        wall = time.perf_counter() - t0
        regimes = regimes_of(case.scenario_mapping or {}, scenario.model)
        rec["regimes"] = ", ".join(regimes)
        if cv_report is not None:
            rec["cv_pred_tokens_per_s_per_gpu"] = cv_report["tokens_per_s_per_device"]
            rec["cv_err_tokens_pct"] = _pct(cv_report["tokens_per_s_per_device"], meas["tokens_per_s_per_gpu"])
            # the interval a user would have been given: drawn from the other sources' held-out
            # errors only, around the held-out prediction (calibration.intervals)
            iv = intervals.interval(regimes, cv_report["calibrated_device"], cv_report["tokens_per_s_per_device"],
                                    cv_report["step_time_s"], profile, exclude_source=case.source_id)
            if iv is not None and meas["tokens_per_s_per_gpu"] is not None:
                low, high = iv["tokens_per_s_interval"]
                rec.update(cv_interval_low_tokens_per_s_per_gpu=low, cv_interval_high_tokens_per_s_per_gpu=high,
                           cv_in_interval=bool(low <= meas["tokens_per_s_per_gpu"] <= high))
        model, training = scenario.model, scenario.training
        peak = scenario.topology.device.peak_flops_per_s(training.precision)
        meas_mfu_palm = None
        if meas["tokens_per_s_per_gpu"] is not None:
            meas_mfu_palm = meas["tokens_per_s_per_gpu"] * model.model_flops_per_token() / peak
        rec.update(
            status="ok",
            pred_tokens_per_s_per_gpu=report["tokens_per_s_per_device"],
            err_tokens_pct=_pct(report["tokens_per_s_per_device"], meas["tokens_per_s_per_gpu"]),
            pred_step_time_s=report["step_time_s"],
            meas_mfu_palm=meas_mfu_palm,
            pred_mfu=report["mfu"],
            pred_hfu=report["hfu"],
            fits_in_memory=bool(report["fits_in_memory"]),
            pred_peak_mem_gib=report["peak_memory_bytes"] / 2**30,
            pred_exposed_comm_s=report["exposed_comm_s"],
            pred_overlap=report["overlap_fraction"],
            sim_wall_s=wall,
        )
        if meas["basis"] == "reported_only":
            # approximate: the source's own FLOP convention vs hzpsim's PaLM basis
            if meas["mfu"] is not None:
                rec.update(reported_metric=f"mfu ({meas['tflops_convention']})", meas_reported=meas["mfu"],
                           pred_reported=report["mfu"])
            else:
                rec.update(reported_metric=f"tflops ({meas['tflops_convention']})",
                           meas_reported=meas["tflops_per_gpu"], pred_reported=report["tflops_per_device"])
            rec["err_reported_pct"] = _pct(rec["pred_reported"], rec["meas_reported"])
        records.append(rec)
    return pd.DataFrame.from_records(records, columns=list(COLUMNS))


def _strategy_label(mapping: dict[str, Any] | None) -> str | None:
    if mapping is None:
        return None
    s = mapping["strategy"]
    fields_ = ",".join(f"{k}={v}" for k, v in s.items() if k != "name" and k in (
        "stage", "tp", "pp", "dp", "cp", "ep", "vpp", "zero_stage", "shard_group_size"))
    return f"{s['name']}({fields_})" if fields_ else s["name"]


def skip_category(reason: str | None) -> str:
    """Group skip reasons: the column (or 'strategy X not implemented yet')."""
    if not reason:
        return ""
    if reason.startswith("strategy ") and reason.endswith("not implemented yet"):
        return reason
    return reason.split(":", 1)[0] + ": " + ("not given" if "not given" in reason else reason.split(":", 1)[1].strip()[:60])


def summarize(df: pd.DataFrame, worst: int = 5) -> dict[str, Any]:
    """Headline statistics on the convention-free tokens/s/GPU error of the ok rows."""
    ok = df[df["status"] == "ok"]
    err = ok["err_tokens_pct"].dropna().astype(float)
    out: dict[str, Any] = {
        "cases": int(len(df)),
        "ok": int(len(ok)),
        "compared_on_tokens": int(len(err)),
        "status_counts": {k: int(v) for k, v in Counter(df["status"]).items()},
        "skip_reasons": {k: int(v) for k, v in Counter(
            skip_category(r) for r in df.loc[df["status"] != "ok", "reason"]).most_common()},
        "median_abs_err_pct": float(err.abs().median()) if len(err) else None,
        "mean_abs_err_pct": float(err.abs().mean()) if len(err) else None,
        "mean_err_pct": float(err.mean()) if len(err) else None,
        "median_err_pct": float(err.median()) if len(err) else None,
        "within_10_pct": int((err.abs() <= 10).sum()),
        "within_25_pct": int((err.abs() <= 25).sum()),
        "worst": [],
        "by_source": {},
    }
    if len(err):
        idx = err.abs().sort_values(ascending=False).index[:worst]
        out["worst"] = [
            {"label": ok.at[i, "label"], "err_tokens_pct": float(ok.at[i, "err_tokens_pct"])} for i in idx
        ]
        for src, grp in ok.dropna(subset=["err_tokens_pct"]).groupby("source_id"):
            e = grp["err_tokens_pct"].astype(float)
            out["by_source"][src] = {"n": int(len(e)), "median_err_pct": float(e.median()),
                                     "median_abs_err_pct": float(e.abs().median())}
    out.update(error_summary(ok))
    out["orderings"] = orderings(ok)
    rep = ok["err_reported_pct"].dropna().astype(float)
    out["reported_only_compared"] = int(len(rep))
    out["reported_only_median_err_pct"] = float(rep.median()) if len(rep) else None
    return out



MIN_REGIME_ROWS = 3
"""A regime with fewer scored rows is reported as n/a (None)."""


def _abs_errors(frame: pd.DataFrame, column: str) -> pd.Series:
    return (frame[column].dropna().astype(float) / 100.0).abs()


def _figures(frame: pd.DataFrame) -> dict[str, Any]:
    inside, cv = _abs_errors(frame, "err_tokens_pct"), _abs_errors(frame, "cv_err_tokens_pct")
    covered = frame["cv_in_interval"].dropna().astype(bool) if "cv_in_interval" in frame else pd.Series([], dtype=bool)
    sources = frame.loc[frame["err_tokens_pct"].notna(), "source_id"] if len(frame) else []
    return {
        "num_rows": int(len(inside)),
        "num_sources": int(pd.Series(sources).nunique()),
        "in_sample_median_abs_error": float(inside.median()) if len(inside) else None,
        "in_sample_p90_abs_error": float(inside.quantile(0.9)) if len(inside) else None,
        "cv_median_abs_error": float(cv.median()) if len(cv) else None,
        "cv_p90_abs_error": float(cv.quantile(0.9)) if len(cv) else None,
        "cv_num_rows": int(len(cv)),
        "cv_median_abs_error_source_weighted": _source_weighted_median(frame),
        # the share of rows whose measured throughput lies in the 80 % interval a user would
        # have been given, drawn from the other sources' held-out errors (calibration.intervals)
        "band_coverage_80": float(covered.mean()) if len(covered) else None,
        "band_num_rows": int(len(covered)),
    }


def _source_weighted_median(frame: pd.DataFrame) -> float | None:
    """The median leave-one-source-out |error| with each source counting once: a weighted
    median, every row of a source with n rows weighing 1/n."""
    rows = frame.dropna(subset=["cv_err_tokens_pct"])
    if not len(rows):
        return None
    errors = (rows["cv_err_tokens_pct"].astype(float) / 100.0).abs().to_numpy()
    counts = rows["source_id"].map(rows["source_id"].value_counts()).to_numpy()
    order = errors.argsort()
    weights = (1.0 / counts)[order]
    cumulative = weights.cumsum()
    half = cumulative[-1] / 2
    i = int((cumulative >= half - 1e-12).argmax())
    # exactly half the weight below: the midpoint of the two middle values, as a plain median
    if abs(cumulative[i] - half) < 1e-12 and i + 1 < len(order):
        return float((errors[order][i] + errors[order][i + 1]) / 2)
    return float(errors[order][i])


def error_summary(ok: pd.DataFrame) -> dict[str, Any]:
    """Headline errors as fractions, in-sample (the profile's constants) and leave-one-source-
    out (each row with its fold's constants), overall and per regime
    (:data:`hzpsim.validation.regimes.REGIMES`; n/a with fewer than 3 rows)."""
    from hzpsim.validation.regimes import REGIMES

    scored = ok.dropna(subset=["err_tokens_pct"])
    out = _figures(scored)
    by_regime: dict[str, Any] = {}
    for regime in REGIMES:
        rows = scored[scored["regimes"].fillna("").str.split(", ").apply(lambda rs, r=regime: r in rs)]
        by_regime[regime] = _figures(rows) if len(rows) >= MIN_REGIME_ROWS else None
    out["by_regime"] = by_regime
    test = scored[scored["source_id"].isin(TEST_SPLIT)]
    out["test_split"] = {"sources": list(TEST_SPLIT), **_figures(test)} if len(test) else None
    return out


TEST_SPLIT = ("S03", "S08", "S22")
"""Sources kept out of mechanism and mapping work from 2026-11-26 on (docs/validation.md §9),
scored apart under ``summary.test_split``: Korthikanti et al.'s Megatron-LM runs (A100), BLOOM
(Megatron-DeepSpeed) and one MoE source. They were looked at before that date; the split
guards what comes after."""


def orderings(ok: pd.DataFrame) -> list[dict[str, Any]]:
    """Groups of scored rows that ran the same model on the same cluster (source, model, GPU
    count and type) with different configurations, and whether the predicted order of their
    tokens/s per GPU matches the measured one: every pair whose measured throughputs differ
    by more than 2 % must be predicted in the same order (closer pairs are ties)."""
    scored = ok.dropna(subset=["err_tokens_pct"])
    key = scored["label"].str.replace(r"^(S\d+)#\d+ ", r"\1 ", regex=True)
    out = []
    for name, grp in scored.groupby(key, sort=True):
        if len(grp) < 2:
            continue
        rows = list(grp.itertuples())
        pairs = agree = 0
        for i, a in enumerate(rows):
            for b in rows[i + 1:]:
                meas = a.meas_tokens_per_s_per_gpu - b.meas_tokens_per_s_per_gpu
                if abs(meas) <= 0.02 * max(a.meas_tokens_per_s_per_gpu, b.meas_tokens_per_s_per_gpu):
                    continue
                pairs += 1
                agree += (meas > 0) == (a.pred_tokens_per_s_per_gpu - b.pred_tokens_per_s_per_gpu > 0)
        out.append({"group": str(name), "rows": [int(r.row) for r in rows], "pairs": pairs, "agree": int(agree),
                    "matches": agree == pairs})
    return out
