"""``hzpsim calibrate published`` / ``measured``: fitting the declared constants to measured
runs, judged by leave-one-source-out cross-validation.

    hzpsim calibrate published --out hzpsim/data/calibration.json   # regenerate the shipped fit
    hzpsim calibrate measured my_runs.yaml --out my_cluster.json     # fit to your own runs
    hzpsim run scenario.yaml --profile my_cluster.json

``measured`` reads a YAML list (or a CSV with the same columns) of
``{scenario: <path or mapping>, tokens_per_s_per_device: <measured>, source: <optional group>}``;
``source`` groups rows for the leave-one-source-out folds (default: each row its own group).

How the fit works.

The simulator is too slow to sit inside an optimiser (a pass over the published rows takes
minutes), so the fit works on **cached per-row cost terms**, re-anchored by simulation:

1. For each row, at the anchor constants θa, build the op graph once and simulate it three
   times: as is (step time T0), with every compute rate 10 % slower (T_c) and with every host
   op 10 % longer (T_h). That gives the row's elasticities w_c = ln(T_c/T0)/ln 1.1 and
   w_h = ln(T_h/T0)/ln 1.1 (how much of the step moves with compute and with the host thread:
   1 when it is on the critical path, less when hidden), and from the op graph the shares s_k
   of the compute time that GEMMs, attention and memory-bound kernels take. w_h is reported,
   not fitted: the host constants stay at their cited priors unless rows depend on them.
2. The surrogate step time at constants θ is
       ln T(θ)/T0 = w_c · ln Σ_k s_k · θa_k/θ_k,
   exact to first order at θa. The constants minimise Σ_rows (ln pred/meas)² (Gauss-Newton
   with Levenberg damping on ln θ) **inside their declared physical ranges**
   (``calibration.constants``: each step is projected onto [ln low, ln high]); a constant the
   data push against a bound stays there and the report says so (``ranges[...].at_bound``):
   the rows want something the mechanism cannot give, which is a modelling question, not a
   number to fit.
3. Re-anchor at the fit and repeat (``iterations``), so the linearisation error shrinks.

Leave-one-source-out: for each source S, the same fit on the rows of every other source gives
S's constants; a constant that no remaining row is sensitive to keeps its prior. The
simulated cross-validated error is what ``hzpsim validate published`` recomputes from the
profile (each row simulated with its fold's constants); the surrogate's CV figures recorded
here are informational.
"""

from __future__ import annotations

import csv
import functools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from hzpsim.calibration import profile as calibration
from hzpsim.calibration.constants import CONSTANTS
from hzpsim.calibration.profile import Profile
from hzpsim.config import ScenarioError
from hzpsim.validation.measured import Measurement

STEP = 1.1
"""The perturbation of the elasticities (10 %)."""

COMPUTE_CONSTANTS = {"gemm": ("gemm_sm_efficiency.a100", "gemm_sm_efficiency.h100"),
                     "attention": ("attention_kernel_fraction",), "memory": ("elementwise_hbm_efficiency",)}


@dataclass(frozen=True)
class Terms:
    """A row's cost terms at one anchor (see the module docstring)."""

    measurement: Measurement
    anchor: dict[str, float]
    tokens_per_s_per_device: float
    shares: dict[str, float]
    device_group: str | None
    w_compute: float
    w_host: float

    def log_time_ratio(self, theta: dict[str, float]) -> float:
        """ln T(θ)/T(θa) by the surrogate."""
        ratio = 0.0
        for kind, share in self.shares.items():
            if not share:
                continue
            name = self._constant(kind)
            ratio += share * (self.anchor[name] / theta[name] if name else 1.0)
        return self.w_compute * math.log(ratio) if ratio > 0 else 0.0

    def _constant(self, kind: str) -> str | None:
        if kind == "gemm":
            return f"gemm_sm_efficiency.{self.device_group}" if self.device_group else None
        return COMPUTE_CONSTANTS[kind][0]

    def log_error(self, theta: dict[str, float]) -> float:
        """ln predicted/measured throughput at θ."""
        return (math.log(self.tokens_per_s_per_device / self.measurement.measured_tokens_per_s_per_device)
                - self.log_time_ratio(theta))

    def sensitive_to(self) -> set[str]:
        if abs(self.w_compute) <= 1e-6:
            return set()
        return {n for k, s in self.shares.items() if s > 1e-6 and (n := self._constant(k))}


# -- simulating one row -----------------------------------------------------------------------

def _simulate(scenario_mapping: dict[str, Any], prof: Profile) -> tuple[float, float, float, dict[str, float], str | None]:
    """One build, three simulations of a scenario under ``prof``: tokens/s per device as is,
    with every compute rate ``STEP`` times slower, and with every host op ``STEP`` times
    longer; the compute-time shares of its first rank; its device group."""
    from hzpsim import strategies
    from hzpsim.hardware.compute import ComputeModel, efficiency_for
    from hzpsim.model.ops import HOST_STREAM
    from hzpsim.report import build_report
    from hzpsim.run import resolve
    from hzpsim.scenario import scenario_from_mapping
    from hzpsim.sim.engine import simulate

    with calibration.using(prof):
        scenario = scenario_from_mapping(scenario_mapping)
        choice = resolve(scenario, scenario.strategies[0].name, scenario.strategies[0].config)
        graph = strategies.get(choice.name).build(choice.config, scenario.model, scenario.training, scenario.topology)
        topology = scenario.topology
        efficiency = efficiency_for(topology.device)

        def tokens(eff: Any = None) -> float:
            report = build_report(simulate(graph, topology, eff), scenario.model, scenario.training, choice.resolved())
            return float(report["tokens_per_s_per_device"])

        base = tokens()
        slow = replace(efficiency, gemm=efficiency.gemm / STEP,
                       gemm_fp8=efficiency.gemm_fp8 / STEP if efficiency.gemm_fp8 else None,
                       attention_forward=efficiency.attention_forward / STEP,
                       attention_backward=efficiency.attention_backward / STEP,
                       attention_fraction=efficiency.attention_fraction / STEP, hbm=efficiency.hbm / STEP)
        compute = tokens(slow)
        host_ops = [op for op in graph.ops if op.stream == HOST_STREAM and op.duration_s]
        for op in host_ops:
            op.duration_s *= STEP
        host = tokens() if host_ops else base
        for op in host_ops:
            op.duration_s /= STEP
        model = ComputeModel(topology.device, graph.compute_dtype, efficiency)
        parts = {"gemm": 0.0, "attention": 0.0, "memory": 0.0}
        rank = graph.ranks[0]
        for op in graph.ops:
            if op.kind == "compute" and op.ranks[0] == rank and op.stream != HOST_STREAM:
                for k, v in model.components_s(op).items():
                    if k in parts:
                        parts[k] += v
        total = sum(parts.values()) or 1.0
    return base, compute, host, {k: v / total for k, v in parts.items()}, topology.device.efficiency.gemm_constant


def row_terms(measurement: Measurement, anchor: Profile) -> Terms:
    """A row's terms at ``anchor`` (module docstring, step 1)."""
    tps, tps_c, tps_h, shares, group = _simulate(measurement.scenario, anchor)
    return Terms(measurement, dict(anchor.constants), tps, shares, group,
                 w_compute=math.log(tps / tps_c) / math.log(STEP), w_host=math.log(tps / tps_h) / math.log(STEP))


def _row_terms_star(args: tuple[Measurement, Profile]) -> Terms:
    return row_terms(*args)


def collect_terms(measurements: Sequence[Measurement], anchor: Profile, jobs: int = 1,
                  progress: Callable[[int, int], None] | None = None) -> list[Terms]:
    """Terms of every row (in order), on ``jobs`` processes."""
    work = [(m, anchor) for m in measurements]
    if jobs <= 1:
        out = []
        for i, w in enumerate(work):
            out.append(_row_terms_star(w))
            if progress:
                progress(i + 1, len(work))
        return out
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        out = []
        for i, t in enumerate(pool.map(_row_terms_star, work)):
            out.append(t)
            if progress:
                progress(i + 1, len(work))
        return out


# -- the least-squares fit --------------------------------------------------------------------

@dataclass
class Fit:
    constants: dict[str, float]
    free: list[str]
    residuals: list[float] = field(default_factory=list)


def fit_constants(terms: Sequence[Terms], start: dict[str, float], iterations: int = 60) -> Fit:
    """Least squares on ln error over ``terms`` (Gauss-Newton with Levenberg damping in ln θ),
    each constant kept inside its declared range (projected steps). Constants no row is
    sensitive to keep their ``start`` value."""
    sensitive: set[str] = set().union(*(t.sensitive_to() for t in terms)) if terms else set()
    free = [c.name for c in CONSTANTS if c.name in sensitive]
    theta = dict(start)
    if not free or not terms:
        return Fit(theta, free, [t.log_error(theta) for t in terms])

    def residuals(x: np.ndarray) -> np.ndarray:
        th = {**theta, **{n: float(math.exp(v)) for n, v in zip(free, x, strict=True)}}
        return np.array([t.log_error(th) for t in terms])

    bounds = {c.name: (c.low, c.high) for c in CONSTANTS}
    low = np.array([math.log(bounds[n][0]) for n in free])
    high = np.array([math.log(bounds[n][1]) for n in free])
    x = np.clip(np.array([math.log(theta[n]) for n in free]), low, high)
    r = residuals(x)
    damping = 1e-3
    for _ in range(iterations):
        jac = np.empty((len(r), len(free)))
        for j in range(len(free)):
            dx = np.zeros_like(x)
            dx[j] = 1e-6
            jac[:, j] = (residuals(x + dx) - r) / 1e-6
        jtj, jtr = jac.T @ jac, jac.T @ r
        improved = False
        for _ in range(20):
            step = np.linalg.solve(jtj + damping * np.diag(np.diag(jtj) + 1e-12), -jtr)
            step = np.clip(x + step, low, high) - x  # projected onto the declared ranges
            r_new = residuals(x + step)
            if r_new @ r_new < r @ r:
                x, r, damping, improved = x + step, r_new, damping / 3, True
                break
            damping *= 4
        if not improved or np.max(np.abs(step)) < 1e-7:
            break
    theta.update({n: float(math.exp(v)) for n, v in zip(free, x, strict=True)})
    return Fit(theta, free, [float(v) for v in r])


def fit_profile(terms: Sequence[Terms], priors: dict[str, float]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The fit on every row and, per source, the fit without it (folds start from the priors;
    a constant with no data in a fold keeps its prior)."""
    full = fit_constants(terms, priors).constants
    folds: dict[str, dict[str, float]] = {}
    for source in sorted({t.measurement.source for t in terms}):
        rest = [t for t in terms if t.measurement.source != source]
        fold = fit_constants(rest, priors)
        folds[source] = {n: fold.constants[n] for n in fold.free} | {
            n: priors[n] for n in priors if n not in fold.free}
    return full, folds


def in_range_report(constants: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Each constant's value beside its declared plausible range."""
    return {c.name: {"value": constants[c.name], "prior": c.prior, "low": c.low, "high": c.high,
                     "unit": c.unit, "inside": c.low * (1 - 1e-9) <= constants[c.name] <= c.high * (1 + 1e-9),
                     "at_bound": min(abs(constants[c.name] / c.low - 1), abs(constants[c.name] / c.high - 1)) < 1e-6}
            for c in CONSTANTS}


def calibrate(measurements: Sequence[Measurement], start: Profile, iterations: int = 2, jobs: int = 1,
              progress: Callable[[str, int, int], None] | None = None) -> tuple[Profile, list[Terms]]:
    """Fit the declared constants to ``measurements`` (module docstring); returns the profile
    (fit, folds, report) and the last anchor's terms."""
    priors = {c.name: c.prior for c in CONSTANTS}
    anchor = start
    terms: list[Terms] = []
    full: dict[str, float] = dict(anchor.constants)
    folds: dict[str, dict[str, float]] = {}
    for it in range(iterations):
        step = functools.partial(progress, f"anchor {it + 1}/{iterations}") if progress else None
        terms = collect_terms(measurements, anchor, jobs, step)
        full, folds = fit_profile(terms, priors)
        anchor = Profile(full)
    surrogate_cv = []
    for t in terms:
        theta = {**full, **folds.get(t.measurement.source, {})}
        surrogate_cv.append(abs(math.expm1(t.log_error(theta))))
    in_sample = [abs(math.expm1(t.log_error(full))) for t in terms]
    # each row's held-out error, ln(predicted / measured) with its fold's constants: what the
    # prediction intervals of ``hzpsim run`` are drawn from (``calibration.intervals``)
    cv_log_errors = [{"label": t.measurement.label, "source": t.measurement.source,
                      "regimes": list(t.measurement.regimes),
                      "log_error": round(t.log_error({**full, **folds.get(t.measurement.source, {})}), 5)}
                     for t in terms]
    gemm_fit_over_prior = {c.name: full[c.name] / c.prior for c in CONSTANTS
                           if c.name.startswith("gemm_sm_efficiency.") and c.name in full}
    report = {
        "num_rows": len(terms),
        "sources": sorted({t.measurement.source for t in terms}),
        "iterations": iterations,
        "surrogate_in_sample_median_abs_error": float(np.median(in_sample)) if in_sample else None,
        "surrogate_cv_median_abs_error": float(np.median(surrogate_cv)) if surrogate_cv else None,
        "surrogate_cv_p90_abs_error": float(np.percentile(surrogate_cv, 90)) if surrogate_cv else None,
        "ranges": in_range_report(full),
        "host_bound_rows": {t.measurement.label: round(t.w_host, 3) for t in terms if t.w_host > 0.05},
        "cv_log_errors": cv_log_errors,
        "gemm_fit_over_prior": gemm_fit_over_prior,
        "method": "least squares on ln(predicted/measured tokens/s per device) over cached per-row "
                  "cost terms (hzpsim.fitting.published), re-anchored by simulation",
    }
    return Profile(full, folds, "fit", report, fitted=frozenset(full)), terms


# -- reading measured runs --------------------------------------------------------------------

def read_measured(path: str) -> list[Measurement]:
    """Rows of a ``calibrate measured`` file; ScenarioError naming the row and key otherwise."""
    from hzpsim.presets import read_yaml
    from hzpsim.scenario import scenario_from_mapping

    p = Path(path)
    if not p.is_file():
        raise ScenarioError(f"file: {path!r} is not a file")
    if p.suffix.lower() == ".csv":
        try:
            with p.open(encoding="utf-8", newline="") as f:
                rows: Any = list(csv.DictReader(f))
        except UnicodeDecodeError:
            raise ScenarioError(f"file: {path!r} is not UTF-8 text") from None
    else:
        rows = read_yaml(p)
    if not isinstance(rows, list) or not rows:
        raise ScenarioError(f"file: {path!r} must hold a non-empty list of {{scenario, tokens_per_s_per_device}}")
    out = []
    for i, row in enumerate(rows):
        where = f"file: row {i}"
        if not isinstance(row, dict):
            raise ScenarioError(f"{where}: must be a mapping with scenario and tokens_per_s_per_device")
        unknown = set(row) - {"scenario", "tokens_per_s_per_device", "source", "label"}
        if unknown:
            raise ScenarioError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: scenario, tokens_per_s_per_device, source, label)")
        scenario = row.get("scenario")
        if isinstance(scenario, str):
            sp = (p.parent / scenario) if not Path(scenario).is_absolute() else Path(scenario)
            if not sp.is_file():
                raise ScenarioError(f"{where}.scenario: {scenario!r} is not a file")
            scenario = read_yaml(sp)
        if not isinstance(scenario, dict):
            raise ScenarioError(f"{where}.scenario: must be a scenario mapping or a path to one")
        try:
            tps = float(row.get("tokens_per_s_per_device"))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ScenarioError(f"{where}.tokens_per_s_per_device: must be a number") from None
        if not (math.isfinite(tps) and tps > 0):
            raise ScenarioError(f"{where}.tokens_per_s_per_device: must be a positive number, got {tps!r}")
        try:
            loaded = scenario_from_mapping(scenario, source=f"row {i}")
        except ScenarioError as exc:
            raise ScenarioError(f"{where}.scenario: {exc}") from None
        if len(loaded.strategies) != 1:
            raise ScenarioError(f"{where}.scenario: must name exactly one strategy, got {len(loaded.strategies)}")
        label = str(row.get("label") or f"row {i}")
        out.append(Measurement(label, str(row.get("source") or label), scenario, tps))
    return out


def constants_table(profile: Profile) -> str:
    """The declared constants with ``profile``'s fitted values and fold ranges, as the markdown
    table docs/hardware-constants.md holds (tests/test_docs.py keeps the two equal)."""
    lines = ["| constant | fitted | prior | plausible range | inside | leave-one-source-out folds | meaning | source |",
             "|---|---|---|---|---|---|---|---|"]
    for c in CONSTANTS:
        v = profile[c.name]
        folds = [f[c.name] for f in profile.folds.values() if c.name in f]
        spread = f"{min(folds):.3g}–{max(folds):.3g}" if folds else "-"
        lines.append(f"| `{c.name}` | {v:.3g} | {c.prior:g} | {c.low:g}–{c.high:g} | "
                     f"{'yes' if c.low <= v <= c.high else '**no**'} | {spread} | {c.meaning} | {c.source} |")
    return "\n".join(lines)
