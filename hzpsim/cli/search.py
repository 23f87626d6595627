"""``hzpsim search``: the best layout of every strategy family (:mod:`hzpsim.search`).

    hzpsim search scenario.yaml                      # the best layouts, a table
    hzpsim search --family nd --space tp=1,2,4,8 --json
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hzpsim import search, strategies
from hzpsim.cli.options import (
    add_profile,
    add_scenario,
    check_plot_path,
    positive_int,
    scenario_overrides,
)
from hzpsim.config import ScenarioError
from hzpsim.report import to_json
from hzpsim.scenario import Scenario


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``search``."""
    p = sub.add_parser("search", help="search the whole strategy space for the best layout of each family")
    add_scenario(p)
    p.add_argument("--family", action="append", metavar="NAME[,NAME]",
                   help="search only these strategies (repeatable; default: all of " + ", ".join(search.FAMILIES) + ")")
    p.add_argument("--top", default="5", metavar="N", help="how many of the best to list (default 5)")
    p.add_argument("--max-evals", metavar="N", help="simulate at most N candidates (the answer may then not be exact)")
    p.add_argument("--space", action="append", metavar="KEY=V1,V2",
                   help="restrict or widen a knob, e.g. tp=1,2,4,8 pp=1-16 micro_batch_size=1,2 "
                        "activation_recompute=full zero_stage=1")
    p.add_argument("--dask", metavar="ADDRESS", help="run the simulations on this Dask scheduler (tcp://host:8786)")
    p.add_argument("--workers", metavar="N", help="local worker processes (default: one per core; 1 = this process)")
    p.add_argument("--exhaustive", action="store_true", help="simulate every valid candidate (no pruning; slow)")
    add_profile(p)
    p.add_argument("--json", action="store_true", help="print one JSON document (docs/contract.md)")
    p.add_argument("--plot", metavar="FILE", help="write the search landscape (throughput vs memory) to FILE")
    p.set_defaults(handler=_cmd_search)


def load_search_scenario(path: str | None, overrides: Sequence[str]) -> Scenario:
    """The scenario a search starts from: its model, training and cluster. Its strategies are
    ignored (the search supplies them), so a file need not have any, and one whose strategies do
    not fit this cluster still loads: a placeholder strategy stands in while it is validated."""
    from hzpsim.presets import read_yaml
    from hzpsim.scenario import DEFAULT_SCENARIO, scenario_from_mapping

    if path is None:
        document: Any = DEFAULT_SCENARIO
    else:
        if not os.path.isfile(path):
            raise ScenarioError(f"{path}: no such scenario file")
        document = read_yaml(Path(path)) or {}
    if not isinstance(document, dict):
        raise ScenarioError(f"{path}: a scenario must be a mapping")
    base = {k: v for k, v in document.items() if k not in ("strategy", "strategies")}
    kept = [o for o in overrides if not o.split("=", 1)[0].strip().startswith(("strategy.", "strategies."))]
    placeholders: list[Any] = strategies.stand_ins()
    first: ScenarioError | None = None
    for placeholder in placeholders:
        try:
            return scenario_from_mapping({**base, "strategy": placeholder}, kept, source=path or "<default>")
        except ScenarioError as exc:
            first = first or exc
            if str(exc).startswith(("model", "cluster", "--set", "name", "training.precision")):
                break
    assert first is not None
    raise first


def _cmd_search(args: argparse.Namespace) -> int:
    top = positive_int(args.top, "--top", 5)
    max_evals = positive_int(args.max_evals, "--max-evals")
    workers = positive_int(args.workers, "--workers")
    families = search.parse_families(args.family)
    scenario = load_search_scenario(args.scenario, scenario_overrides(args))
    space = search.default_space(scenario)
    for text in args.space or ():
        space = space.replace(text)
    if args.plot:
        check_plot_path(args.plot)
    runner = search.make_runner(args.dask, workers)
    try:
        result = search.search(scenario, families, top=top or 5, max_evals=max_evals, space=space, runner=runner,
                               progress=sys.stderr.isatty(), exhaustive=args.exhaustive)
    finally:
        runner.close()
    if args.plot:
        from hzpsim import plots

        plots.save(plots.search_landscape(result), args.plot)
    if args.json:
        print(to_json(result.to_json()))
    else:
        print(search.format_search(result, args.scenario))
    return 0
