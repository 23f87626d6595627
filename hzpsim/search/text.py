"""The ``hzpsim search`` text (:func:`format_search`) and the ``--family`` argument."""

from __future__ import annotations

import math
from collections.abc import Iterable

from hzpsim import strategies
from hzpsim.config import ScenarioError
from hzpsim.report import format_summary
from hzpsim.search.core import Row, SearchResult, distinguishable
from hzpsim.search.space import families


def loss_reason(row: Row, best: Row) -> str:
    """Why a simulated candidate is slower than the best: the part of its step that grew most."""
    assert row.report is not None and best.report is not None
    mine, theirs = row.report["time_breakdown_s"], best.report["time_breakdown_s"]

    def group(breakdown: dict[str, float]) -> dict[str, float]:
        out = {"compute": 0.0, "bubble": 0.0, "exposed communication": 0.0}
        for key, seconds in breakdown.items():
            out["compute" if key.startswith("compute.") else "bubble" if key == "idle" else "exposed communication"] += seconds
        return out

    a, b = group(mine), group(theirs)
    worst = max(a, key=lambda k: (a[k] - b[k], k))
    delta = a[worst] - b[worst]
    if delta <= 0:
        return "-"
    return f"+{_seconds(delta)} s {worst}"


def _seconds(x: float) -> str:
    """3 decimals for human-scale steps, 3 significant digits for tiny test models."""
    return f"{x:.3f}" if abs(x) >= 0.1 else f"{x:.3g}"


def format_search(result: SearchResult, source: str | None = None) -> str:
    """The ``hzpsim search`` text: counts, best per family, top N with why they lost."""
    sc = result.scenario
    data = result.to_json()
    rate = len(result.rows) / result.wall_s if result.wall_s > 0 else math.inf
    lines = [format_summary(sc), ""]
    lines.append(
        f"searched {data['num_candidates']:,} candidates in {result.wall_s:.1f} s ({rate:,.0f}/s): "
        f"{data['num_invalid']:,} invalid, {data['num_pruned_memory']:,} pruned by the memory bound, "
        f"{data['num_pruned_bound']:,} by the step-time bound, {data['num_simulated']:,} simulated"
        + ("" if result.exact else f", {data['num_skipped']:,} not evaluated (--max-evals: answer not exact)")
    )
    best = result.best
    lines += ["", "best of each family:"]
    header = f"  {'family':<14} {'layout':<46} {'step s':>8} {'tokens/s':>11} {'MFU':>6} {'peak GiB':>9}  vs best"
    lines += [header, "  " + "-" * (len(header) - 2)]
    for family in result.families:
        row = result.best_of(family)
        if row is None:
            lines.append(f"  {family:<14} infeasible: {result.why_infeasible(family)}")
            continue
        lines.append(_row_line(family, row, best))
    lines += ["", f"top {min(result.top_n, len(result.ranked))} overall:", header.replace("family        ", "rank          "),
              "  " + "-" * (len(header) - 2)]
    for i, row in enumerate(result.ranked[: result.top_n], 1):
        lines.append(_row_line(str(i), row, best))
    losers = [r for r in result.rows if r.status in ("pruned_memory", "pruned_bound", "rejected", "simulated")
              and not r.feasible]
    if losers:
        lines += ["", "the others lost because:"]
        counts: dict[str, int] = {}
        for r in result.rows:
            if r.status in ("pruned_memory", "rejected") or (r.status == "simulated" and not r.feasible):
                counts["out of memory"] = counts.get("out of memory", 0) + 1
            elif r.status == "pruned_bound":
                b = r.bound
                assert b is not None
                key = b.limited_by
                counts[f"slower by bound: {key}"] = counts.get(f"slower by bound: {key}", 0) + 1
            elif r.status == "simulated" and r is not best:
                counts["simulated, slower"] = counts.get("simulated, slower", 0) + 1
            elif r.status == "invalid":
                counts["invalid layout"] = counts.get("invalid layout", 0) + 1
        for key, count in sorted(counts.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {count:>7,}  {key}")
    if best is not None:
        where = f" {source}" if source else ""
        lines += ["", "run the best: hzpsim run" + where + " " + " ".join(f"--set {o}" for o in best.candidate.overrides())]
    return "\n".join(lines)


def _row_line(tag: str, row: Row, best: Row | None) -> str:
    r = row.report
    assert r is not None
    layout = f"{strategies.label(r['strategy_resolved'])} mb{row.candidate.micro_batch_size} {row.candidate.activation_recompute}"
    why = "best" if row is best else (loss_reason(row, best) if best else "")
    if row is not best and distinguishable(row, best) is False:
        why += " (within the best's 80 % interval: not distinguishable)"
    return (f"  {tag:<14} {layout:<46} {_seconds(r['step_time_s']):>8} {r['tokens_per_s']:>11,.0f} {r['mfu']:>6.1%} "
            f"{r['peak_memory_bytes'] / 2**30:>9.1f}  {why}")


def parse_families(values: Iterable[str] | None) -> tuple[str, ...]:
    """``--family`` values (repeatable, comma-separated) -> strategy names; ScenarioError otherwise."""
    if not values:
        return families()
    out: list[str] = []
    known = strategies.available()
    for value in values:
        for name in (v.strip() for v in value.split(",")):
            if name not in known:
                raise ScenarioError(f"--family {name!r}: unknown strategy (known: {', '.join(known)})")
            if name not in out:
                out.append(name)
    return tuple(out)
