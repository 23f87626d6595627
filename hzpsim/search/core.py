"""The branch and bound (:func:`search`) and what it returns (:class:`SearchResult`)."""

from __future__ import annotations

import heapq
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hzpsim.run import effective_step_s
from hzpsim.scenario import Scenario
from hzpsim.search.bounding import Bounder
from hzpsim.search.runners import Runner
from hzpsim.search.space import Candidate, Space, check, default_space, enumerate_candidates
from hzpsim.search.space import families as all_families
from hzpsim.strategies import Bound

#: Candidates simulated per round of the branch and bound; fixed (not the worker count) so
#: that every executor simulates the same candidates and reports the same counts.
BATCH = 8


@dataclass
class Row:
    """What became of one candidate."""

    candidate: Candidate
    status: str  # invalid | pruned_memory | pruned_bound | rejected | simulated | error | skipped
    reason: str = ""
    bound: Bound | None = None
    report: dict[str, Any] | None = None
    level: int = 0  # which of its plugin's bound hooks gave ``bound`` (bounding.LEVELS)

    @property
    def feasible(self) -> bool:
        return self.report is not None and bool(self.report["fits_in_memory"])


@dataclass
class SearchResult:
    scenario: Scenario
    families: tuple[str, ...]
    rows: list[Row]
    top_n: int
    wall_s: float
    exact: bool  # False when --max-evals stopped the search before the bound did
    exhaustive: bool = False
    ranked: list[Row] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ranked = sorted((r for r in self.rows if r.feasible), key=_rank)

    @property
    def best(self) -> Row | None:
        return self.ranked[0] if self.ranked else None

    def best_of(self, family: str) -> Row | None:
        return next((r for r in self.ranked if r.candidate.name == family), None)

    def count(self, *statuses: str) -> int:
        return sum(r.status in statuses for r in self.rows)

    def why_infeasible(self, family: str) -> str:
        rows = [r for r in self.rows if r.candidate.name == family]
        if not rows:
            return "no candidates in the searched space"
        if all(r.status == "invalid" for r in rows):
            return f"every one of {len(rows)} candidates is invalid, e.g. {rows[0].reason}"
        memory = [(r.report["peak_memory_bytes"] if r.report else (r.bound.memory_bytes if r.bound else math.inf), r)
                  for r in rows if r.status in ("pruned_memory", "rejected", "simulated")]
        if memory and all(r.status in ("invalid", "pruned_memory", "rejected", "simulated") for r in rows):
            least, row = min(memory, key=lambda x: (x[0], x[1].candidate.key))
            capacity = self.scenario.topology.device.memory_bytes
            return (f"out of memory: the least hungry candidate ({row.candidate.label()}) needs at least "
                    f"{least / 2**30:.1f} GiB of {capacity / 2**30:.1f} GiB")
        skipped = sum(r.status == "skipped" for r in rows)
        return f"not found within --max-evals ({skipped} candidates not evaluated)"

    def to_json(self) -> dict[str, Any]:
        """``{best, best_per_family, infeasible, top, num_candidates, num_simulated, num_pruned,
        wall_s, ...}`` (docs/contract.md)."""
        best = self.best
        return {
            "best": best.report if best else None,
            "best_per_family": {f: (r.report if (r := self.best_of(f)) else None) for f in self.families},
            "infeasible": {f: self.why_infeasible(f) for f in self.families if self.best_of(f) is None},
            "top": [{**(r.report or {}), "distinguishable_from_best": distinguishable(r, best)}
                    for r in self.ranked[: self.top_n]],
            "num_candidates": len(self.rows),
            "num_simulated": self.count("simulated", "rejected", "error"),
            "num_pruned": self.count("pruned_memory", "pruned_bound"),
            "num_pruned_memory": self.count("pruned_memory"),
            "num_pruned_bound": self.count("pruned_bound"),
            "num_invalid": self.count("invalid"),
            "num_skipped": self.count("skipped"),
            "exact": self.exact,
            "wall_s": self.wall_s,
        }


def distinguishable(row: Row, best: Row | None) -> bool | None:
    """Whether ``row`` is slower than ``best`` beyond the prediction intervals: its step's
    interval lies wholly above the best's (``step_time_interval_s``, 80 %). False when they
    overlap (the model cannot tell them apart), None without intervals; the best itself is
    False."""
    if best is None or row.report is None or best.report is None:
        return None
    mine, theirs = row.report.get("step_time_interval_s"), best.report.get("step_time_interval_s")
    if not mine or not theirs:
        return None
    return bool(mine[0] > theirs[1])


def _rank(row: Row) -> tuple[float, str]:
    """Fastest first: by the step time, or with failures or checkpoints set by the step time
    on the wall (the step over its goodput, ``run.effective_step_s``)."""
    assert row.report is not None
    return (effective_step_s(row.report), row.candidate.key)


def search(scenario: Scenario, families: Sequence[str] | None = None, top: int = 10,
           max_evals: int | None = None, space: Space | None = None, runner: Runner | None = None,
           progress: bool = False, exhaustive: bool = False) -> SearchResult:
    """Branch and bound over the space (``hzpsim.search``'s docstring) of ``families`` (None:
    every strategy, :func:`~hzpsim.search.space.families`). ``exhaustive`` simulates every
    valid candidate (no pruning; for checking the search)."""
    start = time.perf_counter()
    families = tuple(families or all_families())
    space = space or default_space(scenario)
    runner = runner or Runner()
    device, cluster = scenario.topology.device, scenario.topology.spec
    # what PyTorch's allocator may hold at most: the capacity less what certainly lives outside
    # it (the driver's context; communicators vary by layout) and the headroom asked for
    room = device.memory_bytes - device.context_bytes - cluster.min_memory_headroom_bytes
    capacity = device.memory_bytes
    rows: list[Row] = []
    alive: list[Row] = []
    bounder = Bounder(scenario)
    checked: dict[tuple, str | None] = {}  # plugins' checks do not look at the recompute mode
    candidates = enumerate_candidates(scenario, families, space)
    first = _progress(len(candidates), progress, "hzpsim search: bounding")
    for index, candidate in enumerate(candidates):
        if first is not None and index % 256 == 0:
            first.update(min(256, len(candidates) - index))
        layout_key = (candidate.name, candidate.fields, candidate.micro_batch_size)
        if layout_key not in checked:
            checked[layout_key] = check(scenario, candidate)
        reason = checked[layout_key]
        if reason is not None:
            rows.append(Row(candidate, "invalid", reason))
            continue
        # every candidate gets its plugin's cheapest bound (exhaustive: the plugin's bound, as
        # reported); the tighter ones only when it comes up for simulation
        hooks = bounder.hooks(candidate)
        level = hooks.index("bound") if exhaustive and "bound" in hooks else 0
        b = bounder.at(candidate, level)
        row = Row(candidate, "alive", bound=b, level=level)
        rows.append(row)
        if b.memory_bytes + b.overhead_bytes > room and not exhaustive:
            row.status = "pruned_memory"
            row.reason = (f"needs at least {b.memory_bytes / 2**30:.1f} GiB"
                          + (f" + {b.overhead_bytes / 2**30:.1f} GiB of NCCL communicators" if b.overhead_bytes else "")
                          + f" of {capacity / 2**30:.1f} GiB")
            continue
        alive.append(row)
    # best first by the bound so far; a candidate whose turn comes with a looser bound than its
    # plugin's tightest gets the next one and goes back in its place, so the candidates are
    # simulated in the order of their tightest bounds, and those never reached keep a cheap one
    queue = [(r.bound.step_time_s, r.candidate.key, i) for i, r in enumerate(alive)]  # type: ignore[union-attr]
    heapq.heapify(queue)
    if first is not None:
        first.close()

    feasible_steps: list[float] = []  # sorted
    family_best: dict[str, float] = {}
    evals = 0
    exact = True
    bar = _progress(len(alive), progress, "hzpsim search: simulating")
    try:
        while queue:
            batch: list[Row] = []
            while queue and len(batch) < BATCH:
                lb, key, index = heapq.heappop(queue)
                row = alive[index]
                threshold = max(feasible_steps[top - 1] if len(feasible_steps) >= top else math.inf,
                                family_best.get(row.candidate.name, math.inf))
                if not exhaustive and lb <= threshold and row.level + 1 < len(bounder.hooks(row.candidate)):
                    row.level += 1  # worth it for the few that come up
                    row.bound = bounder.at(row.candidate, row.level)
                    heapq.heappush(queue, (max(lb, row.bound.step_time_s), key, index))
                    continue
                if exhaustive or lb <= threshold:
                    if max_evals is not None and evals >= max_evals:
                        row.status, row.reason = "skipped", "not evaluated (--max-evals)"
                        exact = False
                        continue
                    batch.append(row)
                    evals += 1
                else:
                    row.status = "pruned_bound"
                    row.reason = f"cannot beat {threshold:.3f} s: at least {lb:.3f} s" + _bound_parts(row.bound)
                if bar is not None:
                    bar.update(1)
            if not batch:
                continue
            for row, result in zip(batch, runner.map([(scenario, r.candidate) for r in batch])):
                if "report" in result:
                    row.status, row.report = "simulated", result["report"]
                    assert row.report is not None
                    if row.report["fits_in_memory"]:
                        # a bound on the step is one on the step over its goodput (<= 1) too
                        step = effective_step_s(row.report)
                        feasible_steps.append(step)
                        feasible_steps.sort()
                        family_best[row.candidate.name] = min(family_best.get(row.candidate.name, math.inf), step)
                    else:
                        row.reason = (f"out of memory: peak {row.report['peak_memory_bytes'] / 2**30:.1f} GiB of "
                                      f"{capacity / 2**30:.1f} GiB")
                elif "rejected" in result:
                    row.status, row.reason = "rejected", "out of memory: " + result["rejected"]
                else:
                    row.status, row.reason = "error", result["error"]
    finally:
        if bar is not None:
            bar.close()
    return SearchResult(scenario, families, rows, top, time.perf_counter() - start, exact, exhaustive)


def _bound_parts(b: Bound | None) -> str:
    if b is None:
        return ""
    parts = [f"compute {b.compute_s - b.comm_s:.2f} s"]
    if b.comm_s:
        parts.append(f"exposed TP/EP {b.comm_s:.2f} s")
    if b.bubble_s:
        parts.append(f"bubble {b.bubble_s:.2f} s")
    if b.link_s:
        parts.append(f"link traffic {b.link_s:.2f} s")
    return " (" + ", ".join(parts) + f"; limited by {b.limited_by})"


def _progress(total: int, enabled: bool, desc: str):
    if not enabled or total == 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="cand", file=sys.stderr, leave=False)
