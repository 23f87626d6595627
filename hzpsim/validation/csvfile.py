"""Reading a published-runs CSV into rows and Cases, and selecting among them.

Part of :mod:`hzpsim.validation`. A file that is missing, a directory, empty, binary, not
parseable as CSV, without data rows or without a column the mapping reads is refused with a
:class:`hzpsim.config.ScenarioError` naming the file and the problem.

    from hzpsim.validation.csvfile import rows_to_scenarios, select_cases
    cases = select_cases(rows_to_scenarios(), sources=["S09"], max_devices=8)
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from hzpsim.config import ScenarioError
from hzpsim.validation.cells import blank
from hzpsim.validation.mapping import Case, case_from_row

DEFAULT_CSV = Path(__file__).resolve().parent.parent / "data" / "published_calibration.csv"

REQUIRED_COLUMNS = (
    "source_id", "system", "strategy_family", "gpu", "n_gpus", "gpus_per_node", "inter_node",
    "model_name", "n_params_b", "n_layers", "hidden", "n_heads", "n_kv_heads", "ffn_hidden",
    "vocab", "seq_len", "moe_experts", "moe_topk", "global_batch_seqs", "micro_batch",
    "tp", "pp", "dp", "cp", "ep", "vpp", "zero_stage", "sharding_group", "act_recompute",
    "precision", "measured_tflops_per_gpu", "measured_mfu", "measured_tokens_per_sec_per_gpu",
    "measured_step_time_s", "notes",
)
"""Every column the mapping reads (cells may be blank; the column must exist)."""
OPTIONAL_COLUMNS = ("intra_node_link", "moe_dispatcher", "moe_ep_overlap", "moe_grouped_gemm", "moe_permute_fusion",
                    "etp", "tp_comm_overlap")
"""Columns the mapping reads when present (the NVLink domain, the MoE dispatcher, EP overlap,
grouped expert GEMMs, fused permutation, expert tensor parallelism and TP communication
overlap a row states); a CSV without them maps as if they were blank."""


def _csv_text(file: Path) -> str:
    """The file's text; ScenarioError when it is not a readable, non-empty UTF-8 text file."""
    if not file.exists():
        raise ScenarioError(f"{file}: no such file")
    if file.is_dir():
        raise ScenarioError(f"{file}: is a directory, not a CSV file")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ScenarioError(f"{file}: cannot read ({exc.strerror or exc})") from None
    if not data.strip():
        raise ScenarioError(f"{file}: empty file, expected a CSV with a header row")
    if b"\0" in data:
        raise ScenarioError(f"{file}: binary file (NUL bytes), not a CSV")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{file}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def read_rows(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Every row of the CSV as {column: value}, blank cells None (default: the packaged CSV)."""
    file = Path(path) if path is not None else DEFAULT_CSV
    try:
        df = pd.read_csv(io.StringIO(_csv_text(file)), dtype={"sharding_group": str})
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        problem = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ScenarioError(f"{file}: not a valid CSV ({problem})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise ScenarioError(f"{file}: missing required columns: {', '.join(missing)}")
    if df.empty:
        raise ScenarioError(f"{file}: no data rows below the header")
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
