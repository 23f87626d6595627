"""``hzpsim calibrate``: measure this machine, or fit the calibration constants to measured runs.

    hzpsim calibrate machine [--world N] [--out FILE] [--no-cpu-pool]   # hzpsim.executor.calibrate (torch)
    hzpsim calibrate published --out hzpsim/data/calibration.json      # hzpsim.fitting.published
    hzpsim calibrate measured my_runs.yaml --out my_cluster.json

``published`` and ``measured`` fit by leave-one-source-out cross-validation (the method is in
:mod:`hzpsim.fitting.published`); ``hzpsim run scenario.yaml --profile my_cluster.json`` then
uses the fit.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from hzpsim.calibration import profile as calibration
from hzpsim.calibration.constants import CONSTANTS
from hzpsim.config import ScenarioError
from hzpsim.validation.measured import Measurement


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``calibrate`` with its targets ``machine``, ``published`` and ``measured``."""
    p = sub.add_parser("calibrate", help="measure this machine into a device + fabric profile")
    what = p.add_subparsers(dest="calibrate_target", required=True)
    machine = what.add_parser("machine", help="micro-benchmarks of compute and of the backend's collectives")
    machine.add_argument("--world", type=int, default=2, help="processes benchmarked together (default 2)")
    machine.add_argument("--out", help="profile YAML to write (default: the user config folder, used by local-cpu)")
    machine.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (tests)")
    machine.add_argument("--cpu-pool", action=argparse.BooleanOptionalAction, default=True,
                         help="write the profile for the simulator's CPU pool (default: costs alone on a core, the "
                              "cores the ranks share, each call's in-step wall time); --no-cpu-pool: every cost as "
                              "the wall time it took at the calibration's load (docs/executor.md)")
    machine.set_defaults(handler=_cmd_machine)
    published = what.add_parser("published", help="fit the calibration constants to the published runs")
    published.add_argument("--csv", dest="csv_path", help="CSV to fit (default: the packaged published_calibration.csv)")
    _fit_arguments(published)
    published.set_defaults(handler=_cmd_published)
    measured = what.add_parser("measured", help="fit the calibration constants to your own measured runs")
    measured.add_argument("file", help="YAML or CSV list of {scenario, tokens_per_s_per_device, source}")
    _fit_arguments(measured)
    measured.set_defaults(handler=_cmd_measured)


# -- calibrate machine -------------------------------------------------------------------------


def _cmd_machine(args: argparse.Namespace) -> int:
    from hzpsim.executor import require_torch

    require_torch()
    if not 1 <= args.world <= 16:
        raise ScenarioError(f"--world: {args.world} is not between 1 and 16")
    from hzpsim.executor.calibrate import measure_machine
    from hzpsim.fitting.machine import calibrate

    per_rank = measure_machine(args.world, quick=args.quick, progress=sys.stderr)
    path = calibrate(per_rank, args.world, args.out, cpu_pool=args.cpu_pool)
    print(f"wrote {path}")
    return 0


# -- calibrate published / measured ------------------------------------------------------------


def _fit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="profile JSON to write (default: print it)")
    p.add_argument("--iterations", default="2", metavar="N", help="re-anchoring simulations (default 2)")
    p.add_argument("--jobs", default=None, metavar="N", help="worker processes (default: one per core)")
    p.add_argument("--json", action="store_true", help="print the profile JSON (also the default without --out)")


def _cmd_published(args: argparse.Namespace) -> int:
    from hzpsim.validation.csvfile import rows_to_scenarios
    from hzpsim.validation.regimes import measurements

    try:
        cases = rows_to_scenarios(args.csv_path)
    except ScenarioError as exc:
        raise ScenarioError(f"--csv: {exc}") from None
    return _fit(measurements(cases), args)


def _cmd_measured(args: argparse.Namespace) -> int:
    from hzpsim.fitting.published import read_measured

    return _fit(read_measured(args.file), args)


def _whole(option: str, text: str | None, default: int, low: int, high: int) -> int:
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ScenarioError(f"{option}: {text!r} is not a whole number") from None
    if not low <= value <= high:
        raise ScenarioError(f"{option}: {value} is not between {low} and {high}")
    return value


def _progress() -> Any:
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm  # dev extra; a bar only on a terminal

    bars: dict[str, Any] = {}

    def update(what: str, done: int, total: int) -> None:
        bar = bars.get(what)
        if bar is None:
            bar = bars[what] = tqdm(total=total, desc=what, file=sys.stderr, leave=False)
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    return update


def _fit(measurements: list[Measurement], args: argparse.Namespace) -> int:
    from hzpsim.fitting.published import calibrate

    if not measurements:
        raise ScenarioError("no runnable measurement to fit")
    if args.out is not None and Path(args.out).is_dir():
        raise ScenarioError(f"--out: {args.out!r} is a directory")
    if args.out is not None and not Path(args.out).resolve().parent.is_dir():
        raise ScenarioError(f"--out: folder of {args.out!r} does not exist")
    iterations = _whole("--iterations", args.iterations, 2, 1, 10)
    jobs = _whole("--jobs", args.jobs, os.cpu_count() or 1, 1, 256)
    profile, terms = calibrate(measurements, calibration.PRIORS, iterations, jobs, _progress())
    text = profile.to_json()
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        print(format_fit(profile), file=sys.stderr if args.json else sys.stdout)
    if args.json or not args.out:
        sys.stdout.write(text)
    return 0


def format_fit(profile: calibration.Profile) -> str:
    """The fitted constants beside their priors and ranges, and the surrogate's errors."""
    lines = [f"{'constant':<28} {'fitted':>10} {'prior':>10} {'range':>20}  inside"]
    for c in CONSTANTS:
        v = profile[c.name]
        lines.append(f"{c.name:<28} {v:>10.4g} {c.prior:>10.4g} {f'{c.low:.3g}-{c.high:.3g}':>20}  "
                     f"{'yes' if c.low <= v <= c.high else 'NO'}")
    r = profile.report
    if r.get("num_rows"):
        lines.append(f"{r['num_rows']} rows from {len(r.get('sources', []))} sources; surrogate median |error| "
                     f"in-sample {r['surrogate_in_sample_median_abs_error']:.1%}, leave-one-source-out "
                     f"{r['surrogate_cv_median_abs_error']:.1%} (p90 {r['surrogate_cv_p90_abs_error']:.1%}); "
                     "`hzpsim validate published --profile FILE` simulates the cross-validation")
    return "\n".join(lines)
