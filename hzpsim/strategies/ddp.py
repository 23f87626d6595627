"""DDP: every rank holds all model states and all-reduces the gradients.

The all-reduce runs per unit, overlapping the last micro-batch's backward (PyTorch DDP
buckets, Megatron's non-distributed optimizer).

The (1, 1, 1) case of the nested sharding groups. Run with::

    hzpsim run --set strategy.name=ddp --set model=llama3-8b
"""

from __future__ import annotations

from dataclasses import dataclass

from hzpsim.hardware.topology import Topology
from hzpsim.strategies import _family, _family_bound, _implementations
from hzpsim.strategies._sharded import Schedule


@dataclass(frozen=True)
class Config:
    overlap_grad_reduce: bool = True  # all-reduce buckets as the last backward produces them
    implementation: str = "ddp"  # how the framework runs it (strategies/_implementations.py)

    def validate(self) -> None:
        _implementations.get(self.implementation)


def plan(config: Config, topology: Topology) -> _family.FamilyPlan:
    return _family.FamilyPlan(param_size=1, grad_size=1, optim_size=1,
                              schedule=Schedule(overlap_grad_reduce=config.overlap_grad_reduce,
                                                implementation=_implementations.get(config.implementation)))


check, build = _family.delegates(plan)


# ---------------------------------------------------------------------------- hzpsim search

SEARCH_RANK = 80
"""Where the search reports DDP among the strategies (lowest first)."""

# no ``layouts``: the search's default, one layout (the Config's defaults)
bound = _family_bound.bound_of(plan)


# ------------------------------------------------------------------ what the rest of hzpsim asks (strategies/__init__.py)

ORDER = 80
COLOR = "#8c8c8c"
STAND_INS: tuple[dict, ...] = ({},)
