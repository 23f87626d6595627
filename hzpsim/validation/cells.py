"""Reading one cell of a published-run CSV row (a dict of column -> value).

Part of :mod:`hzpsim.validation`; nothing here runs on its own. Blank cells (None, NaN, empty
text) read as "not given"; a cell that cannot be used raises :class:`RowSkipped`, whose message
names the column and becomes the row's skip reason.
"""

from __future__ import annotations

import math
from typing import Any


class RowSkipped(Exception):
    """A row cannot be mapped; the message names the column (``"seq_len: not given"``)."""


def blank(v: Any) -> bool:
    """True for a cell with nothing in it: None, NaN or whitespace-only text."""
    return v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and not v.strip())


def number(row: dict[str, Any], col: str) -> float | None:
    """The cell as a float; None when blank or not a number."""
    v = row.get(col)
    if blank(v):
        return None
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def whole(row: dict[str, Any], col: str, default: int | None = None) -> int | None:
    """The cell as an int (``default`` when blank); a fractional value skips the row."""
    v = number(row, col)
    if v is None:
        return default
    if v != int(v):
        raise RowSkipped(f"{col}: {v} is not a whole number")
    return int(v)


def need_whole(row: dict[str, Any], col: str, why: str = "not given") -> int:
    """The cell as an int; a blank cell skips the row with ``"<col>: <why>"``."""
    v = whole(row, col)
    if v is None:
        raise RowSkipped(f"{col}: {why}")
    return v


def cell_text(row: dict[str, Any], col: str) -> str:
    """The cell as stripped text; "" when blank."""
    v = row.get(col)
    return "" if blank(v) else str(v).strip()
