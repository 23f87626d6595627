"""DDP: every rank holds all model states and all-reduces the gradients.

The all-reduce runs per unit, overlapping the last micro-batch's backward (PyTorch DDP
buckets, Megatron's non-distributed optimizer).

The (1, 1, 1) case of the nested sharding groups. Run with::

    hzpsim run --set strategy.name=ddp --set model=llama3-8b
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hzpsim.hardware.topology import Topology
from hzpsim.strategies import _compression, _family, _family_bound, _implementations
from hzpsim.strategies._compression import GradCompression
from hzpsim.strategies._sharded import Schedule


@dataclass(frozen=True)
class Config:
    overlap_grad_reduce: bool = True  # all-reduce buckets as the last backward produces them
    implementation: str = "ddp"  # how the framework runs it (strategies/_implementations.py)
    # compression of the gradient all-reduce (strategies/_compression.py, docs/compression.md); None = off
    grad_compression: GradCompression | None = field(default=None, metadata={"omit_if_none": True})

    def validate(self) -> None:
        _implementations.get(self.implementation)


def plan(config: Config, topology: Topology) -> _family.FamilyPlan:
    return _family.FamilyPlan(param_size=1, grad_size=1, optim_size=1,
                              schedule=Schedule(overlap_grad_reduce=config.overlap_grad_reduce,
                                                implementation=_implementations.get(config.implementation)),
                              grad_compression=config.grad_compression)


check, build = _family.delegates(plan)


def resolve(config: Config, topology: Topology) -> Config:
    """The config as simulated: ``grad_compression`` with ratio 1 is none."""
    return dataclasses.replace(config, grad_compression=_compression.resolved(config.grad_compression))


def label(resolved: dict) -> str:
    """A short name for tables (the compression, when on)."""
    return _compression.label("ddp", resolved)


# ---------------------------------------------------------------------------- hzpsim search

SEARCH_RANK = 80
"""Where the search reports DDP among the strategies (lowest first)."""



def layouts(model, training, topology, space) -> list[dict]:
    """One layout of the defaults, and one per ``space.grad_compression`` option (none by default)."""
    return [{}, *({"grad_compression": option} for option in _compression.search_options(space))]


bound = _family_bound.bound_of(plan)


# ------------------------------------------------------------------ what the rest of hzpsim asks (strategies/__init__.py)

ORDER = 80
COLOR = "#8c8c8c"
STAND_INS: tuple[dict, ...] = ({},)
