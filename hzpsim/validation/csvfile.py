"""Reading a published-runs CSV into rows and Cases, and selecting among them.

Part of :mod:`hzpsim.validation`.

    from hzpsim.validation.csvfile import rows_to_scenarios, select_cases
    cases = select_cases(rows_to_scenarios(), sources=["S09"], max_devices=8)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from hzpsim.config import ScenarioError
from hzpsim.validation.cells import blank
from hzpsim.validation.mapping import Case, case_from_row

DEFAULT_CSV = Path(__file__).resolve().parent.parent / "data" / "published_calibration.csv"

def read_rows(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Every row of the CSV as {column: value}, blank cells None (default: the packaged CSV)."""
    file = Path(path) if path is not None else DEFAULT_CSV
    if not file.is_file():
        raise ScenarioError(f"{file}: no such CSV file")
    df = pd.read_csv(file, dtype={"sharding_group": str})
    return [{k: (None if blank(v) else v) for k, v in r.items()} for r in df.to_dict("records")]


def rows_to_scenarios(path: str | Path | None = None) -> list[Case]:
    """Every CSV row as a Case (default: the packaged copy of published_calibration.csv)."""
    return [case_from_row(row, i) for i, row in enumerate(read_rows(path))]


def select_cases(
    cases: Iterable[Case],
    families: Sequence[str] | None = None,
    sources: Sequence[str] | None = None,
    max_devices: int | None = None,
    max_rows: int | None = None,
    rows: Sequence[int] | None = None,
) -> list[Case]:
    """Filter by the CSV's strategy_family, source_id, n_gpus <= max_devices, row indices;
    then keep the first ``max_rows``."""
    fams = {f.lower() for f in families} if families else None
    srcs = {s.upper() for s in sources} if sources else None
    out = []
    for c in cases:
        if fams and c.family.lower() not in fams:
            continue
        if srcs and c.source_id.upper() not in srcs:
            continue
        if max_devices is not None and (c.n_gpus is None or c.n_gpus > max_devices):
            continue
        if rows is not None and c.row_index not in rows:
            continue
        out.append(c)
    return out[:max_rows] if max_rows is not None else out
