"""``hzpsim regress GOLDENS``: predictions against expected values (:mod:`hzpsim.regress`).

    hzpsim regress tests/goldens.yaml              # diff table; exit 1 if a prediction moved
    hzpsim regress my-goldens.yaml --update        # fill / rewrite every entry's expected values
    hzpsim regress my-goldens.yaml --only gpt3-nd  # one entry

Exit codes: 0 every prediction within its tolerance; 1 one moved (or an entry has no expected
values yet); 2 invalid goldens file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hzpsim.regress import check, format_diff, load_goldens, write_goldens


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``regress``."""
    p = sub.add_parser("regress", help="check predictions against a goldens file (exit 1 if one moved)")
    p.add_argument("goldens", help="goldens YAML: a list of {name, scenario, expected, tolerance}")
    p.add_argument("--update", action="store_true", help="fill or rewrite every entry's expected values")
    p.add_argument("--only", action="append", metavar="NAME", help="check only these entries (repeatable)")
    p.add_argument("--verbose", action="store_true", help="one line per key, not per entry")
    p.set_defaults(handler=_cmd_regress)


def _cmd_regress(args: argparse.Namespace) -> int:
    path = Path(args.goldens)
    goldens = load_goldens(path)
    checks, empty, updated = check(goldens, path.parent, update=args.update, only=args.only)
    if args.update:
        write_goldens(path, updated)
        count = len(args.only) if args.only else len(updated)
        print(f"updated the expected values of {count} entries in {path}")
        return 0
    print(format_diff(checks, empty, verbose=args.verbose))
    return 1 if empty or any(not c.ok for c in checks) else 0
