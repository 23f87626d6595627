"""``hzpsim validate memory``: the simulator's allocated peak against PyTorch's own memory
tracker on the executor's strategies (:mod:`hzpsim.executor.memtrack`).

For each strategy the executor runs (``zero`` stage 3, ``hsdp``, ``nd`` TP x PP, ``asynchzp``),
one row: rank 0's peak allocated bytes measured by ``MemTracker`` / ``FSDPMemTracker`` during
one training step (method ``fake``: fake tensors at the Llama-3-8B shape; ``cpu``: real tensors
at a reduced shape; ``cuda``: real tensors on a GPU at the Llama-3-8B shape, with the caching
allocator's allocated and reserved peaks beside the tracker's), and the simulator's prediction for the same rank of the same scenario
(fp32 parameters, gradients and compute, no recompute, the executor's implementation
profiles). ``crosscheck_rel_diff`` (fake rows only) is the fake-tensor path against real tensors
at the reduced shape: a fake row is only worth scoring when that is small.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hzpsim.executor.spec import IMPLEMENTATIONS, MEMORY_ENTRIES, RunSpec
from hzpsim.model import Model
from hzpsim.report import memory_peak
from hzpsim.run import resolve, simulate_choice
from hzpsim.scenario import Scenario, scenario_from_mapping
from hzpsim.sim.engine import Trace

ENTRIES = MEMORY_ENTRIES
"""The strategies compared, as scenario entries (``executor.spec.MEMORY_ENTRIES``)."""


def scenario_of(spec: RunSpec, name: str, cluster: dict[str, Any] | None = None) -> Scenario:
    """The simulator's scenario of a memtrack run spec: its model, batch and layout, trained as
    the executor trains (fp32, no recompute), on ``spec.world_size`` CPU devices (or on
    ``cluster``, a scenario's cluster section)."""
    model = {k: v for k, v in dataclasses.asdict(spec.model).items() if v is not None}
    return scenario_from_mapping({
        "model": model,
        "training": {"global_batch_size": spec.global_batch_size, "micro_batch_size": spec.micro_batch_size,
                     "precision": "fp32", "grad_dtype": "fp32", "activation_recompute": "none", "num_steps": 2},
        "cluster": cluster or {"preset": "local-cpu", "gpus_per_node": spec.world_size},
        "strategy": {**ENTRIES[name], "implementation": IMPLEMENTATIONS[name]},
    }, source=f"validate-memory:{name}")


def predicted_rank0(spec: RunSpec, name: str) -> dict[str, Any]:
    """The simulator's allocated peak of rank 0 (the rank the tracker measures) and its breakdown."""
    scenario = scenario_of(spec, name)
    choice = scenario.strategies[0]
    traces: list[Trace] = []
    simulate_choice(scenario, resolve(scenario, choice.name, choice.config), traces=traces)
    peak, breakdown = memory_peak(traces[0], 0)
    return {"peak_allocated_bytes": peak, "by_category": breakdown}


def rows(methods: tuple[str, ...] = ("fake", "cpu"), strategies: tuple[str, ...] = tuple(ENTRIES),
         seq_len: int = 2048) -> list[dict[str, Any]]:
    """One comparison per strategy and method (``fake``: the Llama-3-8B shape at ``seq_len``;
    ``cpu``: the largest reduced shape this box runs quickly)."""
    from hzpsim.executor import memtrack

    out = []
    for name in strategies:
        for method in methods:
            model: Model = memtrack.llama3_8b(seq_len) if method in ("fake", "cuda") else memtrack.small(
                seq_len=512, layers=4, hidden=512, vocab=32768)
            spec = memtrack.spec_for(name, model)
            measured = memtrack.measure(spec, method)
            predicted = predicted_rank0(spec, name)
            cross = memtrack.crosscheck(memtrack.spec_for(name, memtrack.small())) if method == "fake" else None
            m, p = measured["peak_allocated_bytes"], predicted["peak_allocated_bytes"]
            out.append({"strategy": name, "method": method, "model": model.name, "world": spec.world_size,
                        "measured_peak_allocated_bytes": m, "predicted_peak_allocated_bytes": p,
                        "rel_error": (p - m) / m, "crosscheck_rel_diff": cross,
                        "measured_by_category": measured.get("by_category"),
                        "predicted_by_category": predicted["by_category"], "notes": measured.get("notes", ""),
                        "cuda_allocator": measured.get("cuda_allocator") or None})
    return out


def format_table(table: list[dict[str, Any]]) -> str:
    lines = [f"{'strategy':<9} {'method':<6} {'model':<12} {'measured MiB':>13} {'predicted MiB':>14} "
             f"{'error':>8} {'crosscheck':>10}"]
    for r in table:
        cross = "" if r["crosscheck_rel_diff"] is None else f"{r['crosscheck_rel_diff']:.2%}"
        lines.append(f"{r['strategy']:<9} {r['method']:<6} {r['model']:<12} "
                     f"{r['measured_peak_allocated_bytes'] / 2**20:>13.1f} "
                     f"{r['predicted_peak_allocated_bytes'] / 2**20:>14.1f} {r['rel_error']:>+8.1%} {cross:>10}")
    return "\n".join(lines)
