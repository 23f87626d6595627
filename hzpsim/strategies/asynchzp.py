"""AsyncHZP (arXiv 2510.20111): hierarchical ZeRO with asynchronous multi-stream scheduling.

Parameters, gradients and optimizer states are sharded over three nested groups
``param_group_size | grad_group_size | optim_group_size | N`` instead of ZeRO-3's one group of
all N ranks (docs/strategies.md §1.4, the inferred model: the paper's body was not readable).
Per micro-batch: parameters are all-gathered inside the param group (forward and, with
``reshard_after_forward``, backward) and gradients reduce-scattered inside the grad group. At
the step end: reduce-scatter across optim/grad, all-reduce across the N/optim replicas, the
optimizer on the 1/optim shard, and an all-gather back to the param group.

``async: true`` issues the gathers and reductions from dedicated background streams (own
communicators) into a fixed ring of prefetch_depth + 1 pre-allocated gather buffers and
``reduce_buffers`` scatter buffers; ``async: false`` issues the same collectives in program
order on one communicator with buffers allocated per use, as FSDP1 does (and pays the caching
allocator's cross-stream fragmentation, see ``_sharded``). ``adaptive: true`` lets the planner
choose the group sizes among the divisor chains aligned with the topology (``candidates``).
Composes with ``tp``, ``cp`` and ``ep``. Run with::

    hzpsim run --set cluster=hzp-npu --set cluster.num_nodes=64 --set strategy.name=asynchzp
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from hzpsim.hardware.topology import Topology
from hzpsim.model import Model
from hzpsim.model.training import Training
from hzpsim.strategies import _family, _family_bound, _implementations, compose_label
from hzpsim.strategies._dims import ParallelDims, moe_fields
from hzpsim.strategies._sharded import Schedule


@dataclass(frozen=True)
class Config:
    param_group_size: int | None = None  # ranks sharing the bf16 parameters; None = the island's data-parallel ranks
    grad_group_size: int | None = None  # ranks sharing the gradient accumulator; None = param_group_size
    optim_group_size: int | None = None  # ranks sharing fp32 master + Adam; None = the whole data-parallel group
    async_: bool = field(default=True, metadata={"key": "async"})  # background AG/RS streams, fixed buffers
    prefetch_depth: int = 1  # all-gathers in flight ahead of use (D; D + 1 gather buffers)
    reduce_buffers: int = 2  # gradient scatter buffers
    reshard_after_forward: bool = True  # gather again for the backward
    adaptive: bool = False  # let the planner choose the group sizes
    memory_reserve_fraction: float = 0.08  # adaptive: keep this share of device memory free
    tp: int = 1  # tensor-parallel size composed with the sharding
    cp: int = 1  # context-parallel size
    ep: int = 1  # expert-parallel size (MoE)
    sequence_parallel: bool = False  # with tp
    moe_imbalance: float = 1.0  # busiest expert rank's load over the mean
    moe_capacity_factor: float | None = None  # tokens an expert accepts over the mean; None = dropless
    moe_pad_to_capacity: bool = False  # pad every expert's input to its capacity
    moe_dispatcher: Literal["", "alltoall", "allgather", "deepep"] = ""  # "" = the implementation's
    moe_ep_overlap: bool = False  # dispatch / combine overlap another micro-batch's compute
    moe_grouped_gemm: bool | None = None  # local experts as one grouped GEMM per linear; None = the implementation's
    moe_permute_fusion: bool | None = None  # fused token permutation (--moe-permute-fusion); None = the implementation's
    implementation: str = "reference"  # how the framework runs it (strategies/_implementations.py)

    def validate(self) -> None:
        _implementations.get(self.implementation)
        for name in ("param_group_size", "grad_group_size", "optim_group_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1")
        if not 0 <= self.memory_reserve_fraction < 1:
            raise ValueError("memory_reserve_fraction: must be in [0, 1)")
        dims(self)  # the degrees and the schedule check their own fields
        schedule(self)


def dims(config: Config) -> ParallelDims:
    """The model parallelism the sharding composes with."""
    return ParallelDims(tp=config.tp, cp=config.cp, ep=config.ep, sequence_parallel=config.sequence_parallel,
                   **moe_fields(config))


def sizes(config: Config, topology: Topology) -> tuple[int, int, int]:
    levels = _family.level_group_sizes(topology, dims(config))
    p = config.param_group_size or levels["island"]
    g = config.grad_group_size or p
    o = config.optim_group_size or levels["all"]
    return p, g, o


def resolve(config: Config, topology: Topology) -> Config:
    """The config as simulated: every group size filled in."""
    p, g, o = sizes(config, topology)
    return dataclasses.replace(config, param_group_size=p, grad_group_size=g, optim_group_size=o)


def schedule(config: Config) -> Schedule:
    """Async: dedicated streams and a fixed ring of buffers; sync: one communicator, buffers per use."""
    return Schedule(
        prefetch_depth=config.prefetch_depth,
        reshard_after_forward=config.reshard_after_forward,
        reduce_buffers=config.reduce_buffers,
        fixed_buffers=config.async_,
        streams=_family.async_streams(config.async_),
        implementation=_implementations.get(config.implementation),
    )


def plan(config: Config, topology: Topology) -> _family.FamilyPlan:
    p, g, o = sizes(config, topology)
    keys = ("param_group_size", "grad_group_size" if config.grad_group_size else "param_group_size",
            "optim_group_size")  # a defaulted size is the one it copies
    return _family.FamilyPlan(param_size=p, grad_size=g, optim_size=o, schedule=schedule(config), dims=dims(config),
                              keys=keys)


def candidates(config: Config, model: Model, training: Training, topology: Topology) -> list[Config]:
    """Divisor chains param | grad | optim | N whose sizes are topology-level sizes (one rank,
    the island, the node, the leaf, everything), for the planner to simulate."""
    levels = _family.level_group_sizes(topology, dims(config))
    world = levels["all"]
    options = sorted(d for d in {1, *levels.values()} if world % d == 0)
    out = []
    for p in options:
        for g in options:
            for o in options:
                if g % p or o % g:
                    continue
                out.append(dataclasses.replace(config, param_group_size=p, grad_group_size=g,
                                               optim_group_size=o, adaptive=False))
    return out


check, build = _family.delegates(plan)


def label(resolved: dict) -> str:
    """A short name for tables."""
    return compose_label(resolved, {"tp": "tp", "cp": "cp", "ep": "ep"})


# ---------------------------------------------------------------------------- hzpsim search

SEARCH_RANK = 70
"""Where the search reports AsyncHZP among the strategies (lowest first)."""


def layouts(model: Model, training: Training, topology: Topology, space: Any) -> list[dict[str, Any]]:
    """The group chains the planner would try for an adaptive config (:func:`candidates`)."""
    return [{"param_group_size": c.param_group_size, "grad_group_size": c.grad_group_size,
             "optim_group_size": c.optim_group_size}
            for c in candidates(Config(), model, training, topology)]


bound = _family_bound.bound_of(plan)


# ------------------------------------------------------------------ what the rest of hzpsim asks (strategies/__init__.py)

ORDER = 40
COLOR = "#da8bc3"
DEFAULT_RUNS: tuple[dict, ...] = ({}, {"adaptive": True})
