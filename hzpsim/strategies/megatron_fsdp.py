"""Megatron-FSDP (Megatron-LM ``custom_fsdp``) and its hybrid "HFSDP" mode.

``data_parallel_sharding_strategy: optim_grads_params`` inside a shard group (the NVLink
domain) plus ``outer_dp_sharding_strategy: optim`` shards the optimizer states across the
groups too: (g, g, N) in nested-group terms, ZeRO-1 across domains; without the outer optim
sharding it is HSDP, (g, g, g). ``fsdp_double_buffer`` pre-allocates persistent buffers.
Run with::

    hzpsim run --set strategy.name=megatron_fsdp --set strategy.shard_group_size=8
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hzpsim.hardware.topology import Topology
from hzpsim.model import Model
from hzpsim.model.training import Training
from hzpsim.strategies import _family, _family_bound, _implementations
from hzpsim.strategies._sharded import Schedule


@dataclass(frozen=True)
class Config:
    shard_group_size: int | None = None  # the inner FSDP group; None = one node (the NVLink domain)
    outer_optim_sharding: bool = True  # outer_dp_sharding_strategy=optim (HFSDP); false = HSDP
    double_buffer: bool = False  # fsdp_double_buffer: persistent pre-allocated gather buffers
    prefetch_depth: int = 1  # all-gathers in flight ahead of use
    implementation: str = "megatron-core"  # how the framework runs it (strategies/_implementations.py)

    def validate(self) -> None:
        _implementations.get(self.implementation)
        if self.shard_group_size is not None and self.shard_group_size < 1:
            raise ValueError("shard_group_size: must be >= 1")


def plan(config: Config, topology: Topology) -> _family.FamilyPlan:
    levels = _family.level_group_sizes(topology)
    g = config.shard_group_size or levels["node"]
    o = levels["all"] if config.outer_optim_sharding else g
    schedule = Schedule(prefetch_depth=config.prefetch_depth, fixed_buffers=config.double_buffer,
                        implementation=_implementations.get(config.implementation))
    return _family.FamilyPlan(param_size=g, grad_size=g, optim_size=o, schedule=schedule,
                              keys=("shard_group_size",) * 3)


check, build, resolve, label = _family.one_group_member(plan, "shard_group_size", "g")


# ---------------------------------------------------------------------------- hzpsim search

SEARCH_RANK = 60
"""Where the search reports Megatron-FSDP among the strategies (lowest first)."""


def layouts(model: Model, training: Training, topology: Topology, space: Any) -> list[dict[str, Any]]:
    """One per shard group size the search tries (``_family.search_group_sizes``), with and
    without the outer optimizer sharding."""
    return [{"shard_group_size": g, "outer_optim_sharding": o}
            for g in _family.search_group_sizes(topology, space) for o in (True, False)]


bound = _family_bound.bound_of(plan)


# ------------------------------------------------------------------ what the rest of hzpsim asks (strategies/__init__.py)

ORDER = 70
COLOR = "#937860"
