"""MiCS (Zhang et al., VLDB 2023): partition groups with a two-hop parameter all-gather.

Model states are sharded inside a partition group of ``partition_size`` ranks and replicated
across groups, (p, p, p) in nested-group terms, with gradients all-reduced across the
replication group only at the accumulation boundary (DeepSpeed ``mics.py``). With
``hierarchical_params_gather`` a partition group spanning nodes gathers in two hops: an
inter-node all-gather among ranks with the same local index, then an intra-node all-gather
(DeepSpeed's ``mics_hierarchical_params_gather``). Run with::

    hzpsim run --set strategy.name=mics --set strategy.partition_size=16
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
    partition_size: int | None = None  # ranks of one partition group (DeepSpeed mics_shard_size); None = one node
    hierarchical_params_gather: bool = False  # two-hop all-gather when the group spans nodes
    prefetch_depth: int = 1  # all-gathers in flight ahead of use
    implementation: str = "deepspeed"  # how the framework runs it (strategies/_implementations.py)

    def validate(self) -> None:
        _implementations.get(self.implementation)
        if self.partition_size is not None and self.partition_size < 1:
            raise ValueError("partition_size: must be >= 1")


def plan(config: Config, topology: Topology) -> _family.FamilyPlan:
    levels = _family.level_group_sizes(topology)
    p = config.partition_size or levels["node"]
    inner = levels["node"] if config.hierarchical_params_gather and p > levels["node"] else 1
    schedule = Schedule(prefetch_depth=config.prefetch_depth, hierarchical_gather=inner,
                        implementation=_implementations.get(config.implementation))
    return _family.FamilyPlan(param_size=p, grad_size=p, optim_size=p, schedule=schedule,
                              keys=("partition_size",) * 3)


check, build, resolve, label = _family.one_group_member(plan, "partition_size", "g")


# ---------------------------------------------------------------------------- hzpsim search

SEARCH_RANK = 40
"""Where the search reports MiCS among the strategies (lowest first)."""


def layouts(model: Model, training: Training, topology: Topology, space: Any) -> list[dict[str, Any]]:
    """One per partition size the search tries (``_family.search_group_sizes``), with and,
    for groups larger than a node, without the two-hop gather."""
    node = _family.level_group_sizes(topology)["node"]
    return [{"partition_size": g, "hierarchical_params_gather": h}
            for g in _family.search_group_sizes(topology, space) for h in ((False, True) if g > node else (False,))]


bound = _family_bound.bound_of(plan)


# ------------------------------------------------------------------ what the rest of hzpsim asks (strategies/__init__.py)

ORDER = 50
COLOR = "#c44e52"
FRAMEWORK_IMPLEMENTATIONS = {"deepspeed": "deepspeed"}
VALIDATION_REGIMES = {"deepspeed": "DeepSpeed ZeRO", "": "FSDP/ZeRO-3"}
