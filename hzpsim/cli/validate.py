"""``hzpsim validate``: predictions against measured runs.

    hzpsim validate published --source S09 --max-devices 8     # hzpsim.validation
    hzpsim validate published --row 0 --row 52 --json
    hzpsim validate executor --world 4 --json                  # hzpsim.validation.executor (torch)
    hzpsim validate memory --method cpu --json                 # hzpsim.validation.memory (torch)

Nonsense options (``--max-rows 0``, ``--row`` past the CSV's end, an unknown ``--family`` or
``--source``, an unreadable ``--csv``, ``--strategies bogus``) exit 2 with one line
``hzpsim: error: <option>: <problem>``. ``validate executor`` without torch exits 2 saying how
to install it.
"""

from __future__ import annotations

import argparse
import json as _json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hzpsim.calibration import profile as calibration
from hzpsim.cli.options import add_profile, check_run_options
from hzpsim.config import ScenarioError
from hzpsim.executor.spec import SIMULATOR_STRATEGIES
from hzpsim.validation import published_memory
from hzpsim.validation.csvfile import rows_to_scenarios, select_cases
from hzpsim.validation.mapping import STRATEGY_FAMILIES, Case
from hzpsim.validation.run import summarize, validate_published
from hzpsim.validation.table import format_validation


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``validate`` with its targets ``published`` and ``executor``."""
    p = sub.add_parser("validate", help="compare predictions with measured runs")
    what = p.add_subparsers(dest="target", required=True)
    published = what.add_parser("published", help="the published large runs in hzpsim/data/published_calibration.csv")
    _published_arguments(published)
    published.set_defaults(handler=_cmd_published)
    executor = what.add_parser("executor", help="executor vs simulator on the same scenario")
    _executor_arguments(executor)
    executor.set_defaults(handler=_cmd_executor)
    memory = what.add_parser("memory", help="simulated vs PyTorch-tracked peak allocated memory of the executor's strategies")
    memory.add_argument("--strategies", default="zero,hsdp,nd,asynchzp",
                        help="comma-separated: zero, hsdp, nd, asynchzp (default: all)")
    memory.add_argument("--method", action="append", choices=("fake", "cpu", "cuda"), dest="methods",
                        help="fake (fake tensors, Llama-3-8B shape), cpu (real tensors, reduced shape) and/or "
                             "cuda (real tensors on the GPU, Llama-3-8B shape, with the caching allocator's "
                             "allocated and reserved peaks); repeatable (default: fake and cpu)")
    memory.add_argument("--seq-len", type=int, default=2048, help="sequence length of the fake-tensor and cuda runs (default 2048)")
    memory.add_argument("--json", action="store_true", help="print the list of rows as JSON")
    memory.set_defaults(handler=_cmd_memory)


# -- validate published ------------------------------------------------------------------------


def _published_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--csv", dest="csv_path", help="CSV to read (default: the packaged published_calibration.csv)")
    parser.add_argument("--family", action="append", dest="families",
                        help=f"CSV strategy_family to keep ({', '.join(STRATEGY_FAMILIES)}); repeatable")
    parser.add_argument("--source", action="append", dest="sources", help="source_id to keep (e.g. S09); repeatable")
    parser.add_argument("--max-devices", type=int, help="skip rows with more GPUs than this")
    parser.add_argument("--max-rows", type=int, help="keep only the first N selected rows")
    parser.add_argument("--row", type=int, action="append", dest="rows", help="CSV row index (0-based); repeatable")
    parser.add_argument("--json", action="store_true", help="print {rows, summary} as JSON")
    add_profile(parser, "calibration profile JSON whose constants and folds to score (default: the shipped fit)")


def _cmd_published(args: argparse.Namespace) -> int:
    return main_published(args.csv_path, args.families, args.sources, args.max_rows, args.json,
                          args.max_devices, args.rows, profile=args.calibration_profile)


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


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "item"):  # numpy scalars
        return v.item()
    return v


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
    # the published memory rows are scored with the packaged CSV unless rows are picked by index
    with_memory = csv_path is None and rows is None and max_rows is None
    try:
        try:
            cases = rows_to_scenarios(csv_path)
        except ScenarioError as exc:
            raise ScenarioError(f"--csv: {exc}") from None
        memory = published_memory.memory_cases() if with_memory else []
        check_options([*cases, *(c for c, _ in memory)], families, sources, max_rows, max_devices, rows)
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
    kept = {id(c) for c in select_cases([c for c, _ in memory], families, sources, max_devices)}
    memory_df = published_memory.validate_memory([(c, r) for c, r in memory if id(c) in kept])
    summary = summarize(df)
    summary["constants_in_range"] = (fit or calibration.active()).in_range()
    summary.update(published_memory.memory_summary(memory_df))
    summary["false_oom_rows"] = published_memory.false_oom_rows([df, memory_df])
    if json:
        records = [{k: _jsonable(v) for k, v in r.items()} for r in df.to_dict("records")]
        memory_records = [{k: _jsonable(v) for k, v in r.items()} for r in memory_df.to_dict("records")]
        print(_json.dumps({"rows": records, "memory_rows": memory_records, "summary": summary}, indent=2), file=out)
    else:
        print(format_validation(df), file=out)
        if len(memory_df):
            print(file=out)
            print(published_memory.format_memory(memory_df, summary), file=out)
    return 0


# -- validate executor -------------------------------------------------------------------------


def _executor_arguments(parser: argparse.ArgumentParser) -> None:
    # --profile is the one profile option: its constants are active (hzpsim.cli.main), its
    # machine (device file and fabric) is the simulated side's
    parser.add_argument("scenario", nargs="?", help="scenario YAML (default: the built-in executor-validation one)")
    add_profile(parser)
    parser.add_argument("--strategies", default=",".join(SIMULATOR_STRATEGIES),
                        help="comma-separated strategies of the scenario to run, NAME or 'NAME(FIELD=VALUE,...)' "
                             f"(e.g. 'zero(stage=2),nd'); NAME one of {', '.join(SIMULATOR_STRATEGIES)} (default: all)")
    parser.add_argument("--world", type=int, default=4, help="processes (default 4)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    parser.add_argument("--comm-delay", type=float, default=0.0, help="artificial host delay per collective call, s")
    parser.add_argument("--json", action="store_true", help="print the list of comparison objects as JSON")


def _cmd_executor(args: argparse.Namespace) -> int:
    from hzpsim.executor import require_torch
    from hzpsim.validation import executor

    require_torch()
    filters = executor.parse_strategy_filters(args.strategies)
    check_run_options(args)
    raw = executor.DEFAULT_SCENARIO
    if args.scenario:
        from hzpsim.presets import read_yaml

        if not Path(args.scenario).is_file():
            raise ScenarioError(f"{args.scenario}: no such scenario file")
        raw = read_yaml(Path(args.scenario))
        if not isinstance(raw, dict):
            raise ScenarioError(f"{args.scenario}: a scenario must be a mapping")
    profile = executor.load_profile(args.calibration_profile)
    scenario = executor.scenario_for_world(raw, args.world, profile, args.comm_delay, filters)
    sharing = profile.get("measurements", {}).get("sharing_factor")
    rows = executor.compare(scenario, args.world, num_steps=args.steps, comm_delay_s=args.comm_delay,
                            calibration_sharing=float(sharing) if sharing else None)
    if args.json:
        print(_json.dumps(rows, indent=2, sort_keys=True))
    else:
        print(executor.format_table(rows))
    return 0


# -- validate memory ---------------------------------------------------------------------------


def _cmd_memory(args: argparse.Namespace) -> int:
    from hzpsim.executor import require_torch
    from hzpsim.validation import memory

    require_torch()
    names = tuple(n.strip() for n in args.strategies.split(",") if n.strip())
    unknown = [n for n in names if n not in memory.ENTRIES]
    if not names or unknown:
        raise ScenarioError(f"--strategies: unknown strategy {(unknown or [args.strategies])[0]!r} "
                            f"(known: {', '.join(memory.ENTRIES)})")
    if args.seq_len < 1:
        raise ScenarioError(f"--seq-len: must be >= 1, got {args.seq_len}")
    if "cuda" in (args.methods or ()):
        from hzpsim.executor import cuda_available

        if not cuda_available():
            raise ScenarioError("--method cuda: this PyTorch sees no CUDA device")
    rows = memory.rows(tuple(args.methods or ("fake", "cpu")), names, args.seq_len)
    print(_json.dumps(rows, indent=2, sort_keys=True) if args.json else memory.format_table(rows))
    return 0
