"""HSDP / FSDP HYBRID_SHARD: shard everything inside a group, replicate across groups.

The (g, g, g) case of the nested sharding groups: gathers and reduce-scatters inside the shard
group each micro-batch; the gradient shards are all-reduced across the N/g replicas at the
step end (FSDP2 issues that all-reduce per unit on its own stream during the last backward).
Run with::

    hzpsim run --set strategy.name=hsdp --set strategy.shard_group_size=8
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hzpsim.hardware.topology import Topology
from hzpsim.model import Model
from hzpsim.model.training import Training
from hzpsim.strategies import PublishedRun, _family, _family_bound, _implementations
from hzpsim.strategies._sharded import Schedule


@dataclass(frozen=True)
class Config:
    shard_group_size: int | None = None  # ranks sharing one full copy of the model states; None = one node
    prefetch_depth: int = 1  # all-gathers in flight ahead of use
    reshard_after_forward: bool = True  # gather again for the backward
    implementation: str = "fsdp2"  # how the framework runs it (strategies/_implementations.py)

    def validate(self) -> None:
        _implementations.get(self.implementation)
        if self.shard_group_size is not None and self.shard_group_size < 1:
            raise ValueError("shard_group_size: must be >= 1")


def plan(config: Config, topology: Topology) -> _family.FamilyPlan:
    g = config.shard_group_size or _family.level_group_sizes(topology)["node"]
    schedule = Schedule(prefetch_depth=config.prefetch_depth, reshard_after_forward=config.reshard_after_forward,
                        implementation=_implementations.get(config.implementation))
    return _family.FamilyPlan(param_size=g, grad_size=g, optim_size=g, schedule=schedule,
                              keys=("shard_group_size",) * 3)


check, build, resolve, label = _family.one_group_member(plan, "shard_group_size", "g")


# ---------------------------------------------------------------------------- hzpsim search

SEARCH_RANK = 30
"""Where the search reports HSDP among the strategies (lowest first)."""


def layouts(model: Model, training: Training, topology: Topology, space: Any) -> list[dict[str, Any]]:
    """One per shard group size the search tries (``_family.search_group_sizes``)."""
    return [{"shard_group_size": g} for g in _family.search_group_sizes(topology, space)]


bound = _family_bound.bound_of(plan)


# ------------------------------------------------------------------ what the rest of hzpsim asks (strategies/__init__.py)

ORDER = 20
COLOR = "#55a868"
DEFAULT_RUNS: tuple[dict, ...] = ({},)
FRAMEWORK_IMPLEMENTATIONS = {"deepspeed": "deepspeed", "torchtitan": "fsdp2", "llm-foundry": "llm-foundry", "fsdp": "fsdp1",
                             "fairscale": "fsdp1"}
VALIDATION_REGIMES = {"": "HSDP"}
PUBLISHED_FAMILIES: dict[str, tuple[str, ...]] = {"hsdp": ("sharding_group",)}


def from_published(run: PublishedRun) -> tuple[dict, list[str]]:
    """A published HSDP run (``strategy_family: hsdp``), or an FSDP run whose sharding group is
    smaller than its data-parallel group (zero.from_published hands it over). A shard group
    of the whole data-parallel group is plain FSDP (ZeRO-3); HSDP composed with TP/PP/CP/EP
    has no hzpsim strategy (nd's sharding is over the whole data-parallel group)."""
    sg = run.sharding_group
    if run.tp > 1 or run.pp > 1 or run.cp > 1 or run.ep > 1:
        raise ValueError("strategy_family: HSDP composed with tp/pp/cp/ep is not modelled (nd shards over "
                         "the whole data-parallel group)")
    if sg is None or sg < 1 or run.dp % sg:
        raise ValueError(f"sharding_group: {sg} does not divide dp {run.dp}")
    if sg == run.dp:
        return {"name": "zero", "stage": 3}, [f"hsdp with sharding_group = dp = {sg} -> zero stage 3"]
    return {"name": "hsdp", "shard_group_size": sg}, []
