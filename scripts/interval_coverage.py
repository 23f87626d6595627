"""How many published rows lie inside their cross-validated 80 % interval, drawn three ways.

    python scripts/interval_coverage.py PROFILE.json VALIDATE.json

``PROFILE.json`` is a calibration profile (``hzpsim/data/calibration.json`` or what ``hzpsim
calibrate published --out`` wrote) and ``VALIDATE.json`` what ``hzpsim validate published
--profile PROFILE.json --json`` wrote with it. For every row with a held-out prediction the
interval is rebuilt from the profile's held-out errors of the other sources, in the row's regime
(``hzpsim.calibration.intervals.basis_records``), three ways:

- ``shipped``: ``intervals.conformal_bounds``, what ``hzpsim run`` and ``validate`` use (split
  conformal over the rows, each row one draw); it reproduces ``summary.band_coverage_80``;
- ``pooled``: the average of the sources' empirical error distributions, each source weighted
  once (the "pooling CDFs" interval for a new group of Dunn, Wasserman & Ramdas, "Distribution-
  free prediction sets for two-layer hierarchical models", JASA 2022), which is what a user's
  cluster is: a source none of the rows came from;
- ``random-effects``: a normal random-effects model of the errors (a source's offset plus the
  row's own), and the prediction interval for a new source of a random-effects meta-analysis
  (Higgins, Thompson & Spiegelhalter, JRSS A 2009): the mean of the source means plus or minus
  t(k - 2) times sqrt(between-source variance + within-source variance + the mean's variance),
  the between-source variance by moments on the source means.

The uncalibrated-device widening is taken from the validate output as it was applied. Prints the
share of rows inside, row-weighted and source-weighted, and per source.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence

from hzpsim.calibration import intervals

Bounds = Callable[[Sequence[float], Sequence[str]], tuple[float, float]]


def by_source(errors: Sequence[float], sources: Sequence[str]) -> list[list[float]]:
    """The errors grouped by their source."""
    groups: dict[str, list[float]] = {}
    for error, source in zip(errors, sources):
        groups.setdefault(source, []).append(error)
    return list(groups.values())


def pooled_quantile(errors: Sequence[float], sources: Sequence[str], level: float) -> float:
    """The smallest error t at which the sources' averaged empirical CDF reaches ``level``."""
    groups = by_source(errors, sources)
    for t in sorted(set(errors)):
        if sum(sum(x <= t for x in g) / len(g) for g in groups) / len(groups) >= level - 1e-12:
            return t
    return max(errors)


def pooled(errors: Sequence[float], sources: Sequence[str]) -> tuple[float, float]:
    alpha = 1.0 - intervals.COVERAGE
    return pooled_quantile(errors, sources, alpha / 2), pooled_quantile(errors, sources, 1 - alpha / 2)


T_90 = {1: 3.078, 2: 1.886, 3: 1.638, 4: 1.533, 5: 1.476, 6: 1.440, 7: 1.415, 8: 1.397, 9: 1.383, 10: 1.372}
"""Student's t 0.9 quantile by degrees of freedom (standard tables); above 10: 1.372, slightly wide."""


def random_effects(errors: Sequence[float], sources: Sequence[str]) -> tuple[float, float]:
    groups = by_source(errors, sources)
    k = len(groups)
    means = [statistics.fmean(g) for g in groups]
    within_df = sum(len(g) - 1 for g in groups)
    within = sum((len(g) - 1) * statistics.variance(g) for g in groups if len(g) > 1) / within_df if within_df else 0.0
    spread = statistics.variance(means) if k > 1 else 0.0
    between = max(0.0, spread - statistics.fmean([within / len(g) for g in groups]))
    sd = math.sqrt(between + within + spread / k)
    t = T_90.get(max(k - 2, 1), T_90[10])
    centre = statistics.fmean(means)
    return centre - t * sd, centre + t * sd


def shipped(errors: Sequence[float], sources: Sequence[str]) -> tuple[float, float]:
    return intervals.conformal_bounds(list(errors))


def coverage(report: dict, rows: list[dict], bounds: Bounds) -> tuple[float, dict[str, list[int]]]:
    inside_all, by_source = 0, dict[str, list[int]]()
    for row in rows:
        regimes = tuple(r for r in row["regimes"].split(", ") if r)
        source = row["source_id"]
        _, chosen = intervals.basis_records(regimes, report, exclude_source=source)
        errors, names = [float(e["log_error"]) for e in chosen], [e["source"] for e in chosen]
        predicted, measured = row["cv_pred_tokens_per_s_per_gpu"], row["meas_tokens_per_s_per_gpu"]
        shipped_low = shipped(errors, names)[1]
        widening = (row["cv_interval_low_tokens_per_s_per_gpu"] / predicted) / math.exp(-shipped_low)
        low_err, high_err = bounds(errors, names)
        low, high = predicted * math.exp(-high_err) * widening, predicted * math.exp(-low_err)
        inside = low <= measured <= high
        inside_all += inside
        counts = by_source.setdefault(source, [0, 0])
        counts[0] += inside
        counts[1] += 1
    return inside_all / len(rows), by_source


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as handle:
        report = json.load(handle)["report"]
    with open(argv[1], encoding="utf-8") as handle:
        validated = json.load(handle)
    rows = [r for r in validated["rows"] if r.get("cv_in_interval") is not None]
    print(f"validate's band_coverage_80: {validated['summary'].get('band_coverage_80'):.3f} ({len(rows)} rows)")
    for name, bounds in (("shipped", shipped), ("pooled", pooled), ("random-effects", random_effects)):
        share, by_source = coverage(report, rows, bounds)
        weighted = sum(i / n for i, n in by_source.values()) / len(by_source)
        per = ", ".join(f"{s} {i}/{n}" for s, (i, n) in sorted(by_source.items()))
        print(f"{name:<14} rows {share:.3f}  source-weighted {weighted:.3f}  ({per})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
