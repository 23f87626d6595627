"""CO2 (Sun et al., ICLR 2024, arXiv 2401.16265): local SGD whose outer exchange overlaps the
next inner steps.

Each worker (``inner_group_size`` ranks that synchronise their gradients every step; one rank
by default) runs ``outer_period`` inner steps of its own optimizer without any data-parallel
gradient reduction. Then the workers exchange their parameters and an outer momentum step
updates them. ``async: true`` (CO2) starts that exchange behind the next ``outer_period`` inner
steps and applies its result one period late (staleness one); ``async: false`` waits for it
before the next step. Read in the authors' implementation, fairscale-CO2
(github.com/weigao266/fairscale-CO2@55aaca5,
``fairscale/experimental/nn/data_parallel/gossip/co2.py``, ``CO2DistributedDataParallel``):

- ``_CO2_AAR``: the parameter all-reduce runs on its own CUDA stream in a background thread,
  started when the optimizer step has written the parameters (``parameter_ready``) and waited
  for (``co2_end``) only at the next exchange (``_maybe_perform_co2``);
- ``_init_global_momentum_buffers`` / ``_perform_local_optimization``: the outer momentum
  buffer and the previous outer parameters (``old_params``), fp32, sharded over
  ``outer_momentum_num_shards`` = min(world, 32) ranks (``outer_momentum_memory_efficient``,
  the default); each shard owner updates its slice (momentum, gap penalty, optional clip) and
  the slices go back to every rank. The exchange is fp32 ("communication within the outer
  momentum step happens in fp32", ``_should_allreduce_params``);
- ``__make_backward_hook``: ranks of one node all-reduce their gradients after each backward
  (``local_node_group``), which is ``inner_group_size`` here.

Modelled per outer period: the exchange as one reduce-scatter and one all-gather of the fp32
parameters over every data-parallel rank (an all-reduce's bytes; fairscale-CO2 issues one
``dist.reduce`` and one ``dist.broadcast`` per shard), on the ``outer`` stream; between them
the outer momentum step on the rank's shard (memory-bound: reads and writes the momentum and
the old parameters, reads the averaged delta, writes the new parameters: 24 bytes per element
[INF, from the update rule]). The fp32 delta buffer and the outer states are held for the
whole run. The report is the mean step over the last outer period (two periods simulated,
``report_period``): throughput per token of data. **Convergence per step is not modelled**: how
many more steps local updates need to reach a loss is outside hzpsim (docs/co2.md). Run with::

    hzpsim run --set strategy.name=co2 --set strategy.outer_period=4
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from hzpsim.hardware.placement import Placement
from hzpsim.hardware.topology import Topology
from hzpsim.model import Model
from hzpsim.model.ops import OpGraph
from hzpsim.model.training import Training
from hzpsim.strategies import _family, _implementations, compose_label
from hzpsim.strategies._dims import NO_MODEL_PARALLELISM
from hzpsim.strategies._layers import Work
from hzpsim.strategies._lengths import attach_lengths
from hzpsim.strategies._model_parallel import UnitPass
from hzpsim.strategies._mp_units import mp_units
from hzpsim.strategies._nd_layout import sharding_sizes
from hzpsim.strategies._sharded import Emitter, Ids, Schedule, flat_uses

#: fairscale-CO2's ``outer_momentum_num_shards`` default (capped at the world size there too)
OUTER_MOMENTUM_SHARDS = 32
#: the longest outer period simulated: two periods fit the 100 steps a scenario may simulate
MAX_OUTER_PERIOD = 50
#: HBM bytes per element of the outer momentum step: momentum and old parameters read and
#: written (4 x 4 B), the averaged delta read (4 B), the new parameters written (4 B)
OUTER_STEP_BYTES_PER_ELEMENT = 24.0
#: HBM bytes per parameter of applying a landed exchange (async): the averaged change added to
#: the local fp32 parameters, both read and one written [INF]
APPLY_BYTES_PER_ELEMENT = 12.0


@dataclass(frozen=True)
class Config:
    outer_period: int = 3  # inner steps per outer exchange (fairscale-CO2's default localsgd_frequency)
    async_: bool = field(default=True, metadata={"key": "async"})  # exchange behind the next period (CO2)
    inner_group_size: int | None = None  # ranks of one worker, reducing their gradients every step;
    # None = a node (fairscale-CO2's nprocs_per_node, its local_node_group); one rank on one node
    zero_stage: Literal[0, 1, 2, 3] = 0  # ZeRO sharding inside a worker (as nd's zero_stage)
    outer_shards: int | None = None  # ranks the outer momentum and old parameters are sharded over;
    # None = min(devices, 32), fairscale-CO2's default (outer_momentum_num_shards capped at the world)
    implementation: str = "ddp"  # how the framework issues the inner all-reduce (strategies/_implementations.py)

    def validate(self) -> None:
        _implementations.get(self.implementation)
        if not 1 <= self.outer_period <= MAX_OUTER_PERIOD:
            raise ValueError(f"outer_period: must be between 1 and {MAX_OUTER_PERIOD} inner steps, got {self.outer_period}")
        if self.inner_group_size is not None and self.inner_group_size < 1:
            raise ValueError(f"inner_group_size: must be >= 1, got {self.inner_group_size}")
        if self.outer_shards is not None and self.outer_shards < 1:
            raise ValueError(f"outer_shards: must be >= 1, got {self.outer_shards}")


def group_of(config: Config, topology: Topology) -> int:
    """Ranks of one worker: ``inner_group_size``, else a node (one rank on a one-node cluster,
    where a node would be the only worker)."""
    if config.inner_group_size is not None:
        return config.inner_group_size
    node = topology.devices_per_node
    return node if topology.num_devices >= 2 * node else 1


def check(config: Config, model: Model, training: Training, topology: Topology) -> None:
    n, g = topology.num_devices, group_of(config, topology)
    if n % g:
        raise ValueError(f"inner_group_size: {g} does not divide the {n} devices")
    if n // g < 2:
        raise ValueError("inner_group_size: local SGD needs at least two workers")
    if config.outer_shards is not None and config.outer_shards > n:
        raise ValueError(f"outer_shards: {config.outer_shards} is more than the {n} devices holding them")
    if model.moe is not None:
        raise ValueError("name: co2 is modelled for dense models (no expert groups)")
    NO_MODEL_PARALLELISM.check(model, training, n)


def shards_of(config: Config, num_devices: int) -> int:
    """Ranks holding a slice of the outer states."""
    return config.outer_shards if config.outer_shards is not None else min(num_devices, OUTER_MOMENTUM_SHARDS)


def resolve(config: Config, topology: Topology) -> Config:
    """The config as simulated: the worker size and the outer shards filled in."""
    return dataclasses.replace(config, inner_group_size=group_of(config, topology),
                               outer_shards=shards_of(config, topology.num_devices))


def build(config: Config, model: Model, training: Training, topology: Topology, expand: bool = False) -> OpGraph:
    implementation = _implementations.get(config.implementation)
    training = implementation.training_for(training, topology.device)
    n, g, period = topology.num_devices, group_of(config, topology), config.outer_period
    steps = max(training.num_steps, 2 * period)  # a period to fill the pipeline of exchanges, one reported
    training = dataclasses.replace(training, num_steps=steps)
    # a worker's ranks are its data-parallel group (``dp``); the workers repeat over ``worker``
    placement = Placement.from_sizes(n, order=("tp", "cp", "dp", "worker"), dp=g, worker=n // g)
    everyone = Placement.from_sizes(n, order=("tp", "cp", "dp"), dp=n)
    lanes, weights, slow = _family.simulated_lanes(topology, everyone, expand)
    graph = OpGraph(n, weights, training.precision, meta={"pp": 1, "dp": n, "tp": 1, "cp": 1, "ep": 1,
                                                          "report_period": period, **slow})
    m = NO_MODEL_PARALLELISM.num_micro_batches(training, n)
    units = mp_units(model, training, NO_MODEL_PARALLELISM.placed(topology), implementation)
    emit = Emitter(graph, lanes, implementation.on_device(topology.device))
    attach_lengths(emit, training, model.seq_len, {lane: everyone.coord(lane)["dp"] for lane in lanes}, n, 1, m)
    schedule = Schedule(overlap_grad_reduce=False, implementation=implementation)  # after the backward
    unit_pass = UnitPass(emit, NO_MODEL_PARALLELISM, units, training, placement, placement, schedule,
                         flat_uses(steps, m, len(units)), lambda size: sharding_sizes(config.zero_stage, size), m)
    params = sum(u.dense_params for u in units)
    shards = shards_of(config, n)
    if config.zero_stage == 0:  # every rank holds the whole fp32 model: the exchange over every rank
        instances, exchanged_bytes = [(graph.add_group("co2.world", range(n)), tuple(lanes))], 4.0 * params
    else:  # a rank holds 1/g of the fp32 master weights: its slice with the same rank of every worker
        instances = emit.groups_for(lambda lane: (f"co2.across.{lane % g}", placement.group("worker", lane)), n // g)
        exchanged_bytes = 4.0 * params / g
    workers = emit.groups_for(lambda lane: (f"co2.worker.{lane // g}", placement.group("dp", lane)), g)
    for lane in lanes:  # the outer states on a shard owner, the fp32 delta in flight
        graph.add_static(lane, {"optimizer": 8.0 * params / shards, "buffers": exchanged_bytes})
    exchanged: Ids | None = None  # the outer exchange in flight (async) or just finished (sync)
    for step in range(steps):
        # sync: the step waits for the exchange
        last = _family.micro_batches(unit_pass, units, step, m, None if config.async_ else exchanged)
        reduced = unit_pass.reduce(step, last)
        # local clipping: the worker's own gradient norm
        ready: Ids = emit.collective("all_reduce", workers, 4.0, "grad_norm", "grad_norm", "compute", reduced,
                                     step) if g > 1 else last
        outer_end = (step + 1) % period == 0
        if config.async_ and outer_end and exchanged is not None:
            # staleness one: the exchange started a period ago lands with this step's update
            ready = emit.compute("co2.apply", "outer", Work(bytes_accessed=APPLY_BYTES_PER_ELEMENT * params),
                                 [ready, exchanged], step)
        unit_pass.optimize(step, ready)
        if outer_end:
            written = dict(emit.last_compute)  # the optimizer step wrote the parameters (parameter_ready)
            scattered = emit.collective("reduce_scatter", instances, exchanged_bytes, "co2.delta_reduce", "outer",
                                        "outer", [written], step)
            updated = emit.compute("co2.outer_step", "outer",
                                   Work(bytes_accessed=OUTER_STEP_BYTES_PER_ELEMENT * params / shards), [scattered], step)
            exchanged = emit.collective("all_gather", instances, exchanged_bytes, "co2.params_gather", "outer",
                                        "outer", [updated], step)
    return graph


# ---------------------------------------------------------------------------- hzpsim search

SEARCH_RANK = 85
"""Where the search reports CO2 among the strategies (lowest first)."""


def layouts(model: Model, training: Training, topology: Topology, space: Any) -> list[dict[str, Any]]:
    """One layout per ``space.outer_period`` (none by default: CO2 changes the optimisation
    itself, so the search weighs it only when asked)."""
    return [{"outer_period": p} for p in getattr(space, "outer_period", ())]


def label(resolved: dict) -> str:
    """A short name for tables."""
    return compose_label(resolved, {"outer_period": "period", "inner_group_size": "g", "zero_stage": "zero"})


# ------------------------------------------------------------------ what the rest of hzpsim asks (strategies/__init__.py)

ORDER = 85
COLOR = "#ccb974"
DEFAULT_RUNS: tuple[dict, ...] = ()  # not in the default comparison: local SGD is another optimiser
