"""Where the candidates are simulated: in this process, in local worker processes, or on a
Dask cluster (each :class:`Runner` maps :func:`evaluate` over a batch, in order)."""

from __future__ import annotations

import os
from typing import Any

from hzpsim.config import ScenarioError
from hzpsim.model.ops import GraphError
from hzpsim.run import report_of, resolve
from hzpsim.scenario import Scenario
from hzpsim.search.space import Candidate, plugin_of, variant
from hzpsim.sim.engine import gc_paused


def evaluate(scenario: Scenario, candidate: Candidate) -> dict[str, Any]:
    """Build and simulate one candidate (runs in a worker process or on a Dask worker).

    Returns ``{"report": contract}`` or ``{"rejected": reason}`` when its resident model states
    (from the built graph) exceed the device memory, ``{"error": message}`` for a graph error."""
    with gc_paused():  # the graph and the replay: many objects, no cycles worth looking for
        return _evaluate(scenario, candidate)


def _evaluate(scenario: Scenario, candidate: Candidate) -> dict[str, Any]:
    try:
        sc = variant(scenario, candidate)
        choice = sc.strategies[0]
        graph = plugin_of(choice.name).build(choice.config, sc.model, sc.training, sc.topology)
        capacity = sc.topology.device.memory_bytes
        states = max(sum(memory.values()) for memory in graph.static_memory.values())
        if states > capacity:
            return {"rejected": f"resident states {states / 2**30:.1f} GiB exceed {capacity / 2**30:.1f} GiB",
                    "memory_bytes": states}
        report = report_of(sc, resolve(sc, choice.name, choice.config), graph, None)
    except (ValueError, GraphError) as exc:
        return {"error": str(exc)}
    report["training_resolved"] = {**report["training_resolved"], **candidate.training()}
    return {"report": report}


def _evaluate_task(task: tuple[Scenario, Candidate]) -> dict[str, Any]:
    return evaluate(*task)


class Runner:
    """Runs evaluations: in this process, in local worker processes, or on a Dask cluster."""

    def map(self, tasks: list[tuple[Scenario, Candidate]]) -> list[dict[str, Any]]:
        return [_evaluate_task(t) for t in tasks]

    def close(self) -> None:
        pass


class ProcessRunner(Runner):
    def __init__(self, workers: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))

    def map(self, tasks: list[tuple[Scenario, Candidate]]) -> list[dict[str, Any]]:
        return list(self.pool.map(_evaluate_task, tasks))

    def close(self) -> None:
        self.pool.shutdown()


class DaskRunner(Runner):
    """``address``: a scheduler address (``tcp://host:8786``) or a ``distributed`` Client /
    LocalCluster object."""

    def __init__(self, address: Any) -> None:
        try:
            from distributed import Client
        except ImportError:
            raise ScenarioError("--dask: needs the 'distributed' package (pip install 'hzpsim[dask]')") from None
        self.own = not hasattr(address, "submit")
        try:
            self.client = Client(address, timeout=5) if self.own else address
        except (OSError, TimeoutError, ValueError) as exc:
            raise ScenarioError(f"--dask {address}: cannot reach the scheduler ({exc})") from None

    def map(self, tasks: list[tuple[Scenario, Candidate]]) -> list[dict[str, Any]]:
        futures = self.client.map(_evaluate_task, tasks, pure=False)
        return list(self.client.gather(futures))

    def close(self) -> None:
        if self.own:
            self.client.close()


def make_runner(dask: Any = None, workers: int | None = None) -> Runner:
    """Dask when ``dask`` is given, else ``workers`` local processes (None: one per core, at
    most 8; 1: this process)."""
    if dask is not None:
        return DaskRunner(dask)
    workers = workers if workers is not None else min(os.cpu_count() or 1, 8)
    return ProcessRunner(workers) if workers > 1 else Runner()
