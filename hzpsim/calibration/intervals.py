"""How far a prediction is likely to be off: an interval drawn from held-out errors.

``hzpsim calibrate`` records, for every measured run it fits, the error of that run's
prediction when its whole source was left out of the fit (``report.cv_log_errors``: ln of
predicted over measured tokens/s per device, with the run's leave-one-source-out constants).
Those are errors on runs the constants had not seen, which is the situation of a user's new
scenario. A prediction's interval is the spread of those errors in the scenario's regime
(``strategies.regimes``: ``MoE`` first, then ``long context``, then the strategy family; the
first with at least :data:`MIN_ROWS` errors, else every row; dense runs draw on dense rows and
MoE runs on MoE rows only), taken as a split-conformal
interval (Vovk et al. 2005; Lei et al. 2018, "Distribution-free predictive inference for
regression", §2.2): with n held-out errors sorted, the lower end is the error of rank
floor((n + 1)·α/2) and the upper end that of rank ceil((n + 1)·(1 − α/2)) (ranks from 1,
clipped to 1..n), which covers a new run's error with probability at least 1 − α when the
runs are exchangeable. They are not quite (rows cluster by source, and the user's cluster is
none of them), so ``validate published`` checks the coverage on the published runs
themselves, each row's interval drawn from the other sources' errors only
(``summary.cv_interval_coverage``).

A device whose GEMM efficiency no row calibrates (``calibrated_device: false``) keeps its
device file's prior, and on the calibrated families the fit moved that prior down (by the
report's ``gemm_fit_over_prior``, e.g. 0.82 for the H100): its interval's lower end is
widened by the smallest such ratio, the amount a prior was too fast on a family that could
be checked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hzpsim.calibration import profile as calibration

COVERAGE = 0.8
"""The nominal coverage of a prediction interval (10 % of new runs below it, 10 % above)."""

MIN_ROWS = 8
"""Held-out errors a regime needs before its own spread is used."""

REGIME_ORDER = ("MoE", "long context")
"""Regimes that say more about a run's error than its strategy family, most specific first."""


def _errors(report: Mapping[str, Any], exclude_source: str | None = None) -> list[dict[str, Any]]:
    return [e for e in report.get("cv_log_errors") or [] if e.get("source") != exclude_source]


def basis(regimes: tuple[str, ...], report: Mapping[str, Any], exclude_source: str | None = None) -> tuple[str, list[float], int]:
    """The regime whose held-out errors describe a run of ``regimes``, those errors, and how
    many sources they come from (:func:`basis_records`)."""
    name, chosen = basis_records(regimes, report, exclude_source)
    return name, [float(e["log_error"]) for e in chosen], len({e["source"] for e in chosen})


def basis_records(regimes: tuple[str, ...], report: Mapping[str, Any],
                  exclude_source: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The regime whose held-out errors describe a run of ``regimes`` and those errors' records
    (``log_error``, ``source``, ...). A dense run draws on dense rows only and an MoE run on MoE
    rows only (MoE rows err differently: ``docs/validation.md`` §8). Without a regime of
    :data:`MIN_ROWS` errors, every such row: ``"all (<regime>: n rows)"`` when the run's own
    regime has too few, :data:`EXTRAPOLATED` when it has none (a family no published run uses)."""
    moe = "MoE" in regimes
    rows = [e for e in _errors(report, exclude_source) if ("MoE" in e.get("regimes", ())) == moe]
    ordered = [r for r in REGIME_ORDER if r in regimes] + [r for r in regimes if r not in REGIME_ORDER]
    for regime in ordered:
        chosen = [e for e in rows if regime in e.get("regimes", ())]
        if len(chosen) >= MIN_ROWS:
            return regime, chosen
    sparse = [f"{r}: {sum(r in e.get('regimes', ()) for e in rows)} rows" for r in ordered if r != "MoE"]
    name = f"all {'MoE' if moe else 'dense'} runs ({'; '.join(sparse)})" if sparse else EXTRAPOLATED
    return name, rows


def conformal_bounds(errors: list[float], coverage: float = COVERAGE) -> tuple[float, float]:
    """The split-conformal lower and upper error of ``errors`` (module docstring)."""
    if not errors:
        raise ValueError("conformal_bounds: no errors")
    ordered = sorted(errors)
    n, alpha = len(ordered), 1.0 - coverage
    low_rank = min(max(math.floor((n + 1) * alpha / 2 + 1e-9), 1), n)  # 1e-9: 1 - 0.8 is 0.19999...
    high_rank = min(max(math.ceil((n + 1) * (1 - alpha / 2) - 1e-9), 1), n)
    return ordered[low_rank - 1], ordered[high_rank - 1]


def interval(regimes: tuple[str, ...], calibrated_device: bool, tokens_per_s: float, step_time_s: float,
             profile: calibration.Profile | None = None, exclude_source: str | None = None) -> dict[str, Any] | None:
    """The prediction interval of a run (module docstring) as the report's keys:
    ``step_time_interval_s``, ``tokens_per_s_interval`` (of ``tokens_per_s``, whatever it counts)
    and ``interval_basis``; None when the profile records no held-out errors (a profile fitted
    before they were recorded)."""
    report = (profile or calibration.active()).report or {}
    name, errors, sources = basis(regimes, report, exclude_source)
    if not errors:
        return None
    low_err, high_err = conformal_bounds(errors)
    # measured = predicted / exp(error): a run predicted too fast (error > 0) measures lower
    low, high = math.exp(-high_err), math.exp(-low_err)
    widening = None
    if not calibrated_device:
        ratios = [float(v) for v in (report.get("gemm_fit_over_prior") or {}).values()]
        if ratios and min(ratios) < 1:
            widening = min(ratios)
            low *= widening
    return {
        "step_time_interval_s": [step_time_s / high, step_time_s / low],
        "tokens_per_s_interval": [tokens_per_s * low, tokens_per_s * high],
        "interval_basis": {
            "coverage": COVERAGE,
            "regime": name,
            "num_rows": len(errors),
            "num_sources": sources,
            "uncalibrated_device_widening": widening,
        },
    }


EXTRAPOLATED = "extrapolated"
"""The basis of a run in no regime at all (a strategy family no published run uses, AsyncHZP for
one): its interval is every dense (or MoE) row's spread, which says how far the model errs on
the runs it was checked on, not on this one."""
