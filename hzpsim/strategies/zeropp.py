"""ZeRO++ (Wang et al., ICLR 2024): ZeRO-3 with hpZ, qwZ and qgZ.

- hpZ: after the forward all-gather each rank keeps a secondary shard of the parameters
  partitioned over ``hpz_partition_size`` ranks (a node), so the backward all-gather stays
  inside the node, for Psi x b_w / hpz_partition_size extra bytes per rank.
- qwZ: the forward all-gather moves int8 weights (1 byte per parameter instead of 2).
- qgZ: gradients are reduced as int4 (0.5 byte per element). ZeRO++ does this with a
  hierarchical all-to-all; here it is a reduce-scatter of the quantized bytes (the all-to-all
  form and the quantize/dequantize kernels are not modelled).
Run with::

    hzpsim run --set strategy.name=zeropp
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hzpsim.hardware.topology import Topology
from hzpsim.model import Model
from hzpsim.model.training import Training
from hzpsim.strategies import PublishedRun, _family, _family_bound, _implementations, compose_label
from hzpsim.strategies._sharded import Schedule


@dataclass(frozen=True)
class Config:
    hpz_partition_size: int | None = None  # secondary shard group for backward gathers; None = one node; 1 = off
    quantized_weights: bool = True  # qwZ: int8 forward all-gather
    quantized_gradients: bool = True  # qgZ: int4 gradient reduction
    prefetch_depth: int = 1  # all-gathers in flight ahead of use
    implementation: str = "deepspeed"  # how the framework runs it (strategies/_implementations.py)

    def validate(self) -> None:
        _implementations.get(self.implementation)
        if self.hpz_partition_size is not None and self.hpz_partition_size < 1:
            raise ValueError("hpz_partition_size: must be >= 1")


def plan(config: Config, topology: Topology) -> _family.FamilyPlan:
    n = topology.num_devices
    hpz = config.hpz_partition_size or _family.level_group_sizes(topology)["node"]
    schedule = Schedule(
        prefetch_depth=config.prefetch_depth,
        backward_gather_size=hpz if hpz > 1 else 0,
        forward_gather_bytes_per_element=1.0 if config.quantized_weights else 0.0,
        grad_reduce_bytes_per_element=0.5 if config.quantized_gradients else 0.0,
        implementation=_implementations.get(config.implementation),
    )
    return _family.FamilyPlan(param_size=n, grad_size=n, optim_size=n, schedule=schedule)


check, build = _family.delegates(plan)


def resolve(config: Config, topology: Topology) -> Config:
    """The config as simulated: the default secondary partition size filled in."""
    size = plan(config, topology).schedule.backward_gather_size or 1
    return dataclasses.replace(config, hpz_partition_size=size)


def label(resolved: dict) -> str:
    """A short name for tables."""
    return compose_label(resolved, {"hpz_partition_size": "hpz"})


# ---------------------------------------------------------------------------- hzpsim search

SEARCH_RANK = 50
"""Where the search reports ZeRO++ among the strategies (lowest first)."""


def layouts(model: Model, training: Training, topology: Topology, space: Any) -> list[dict[str, Any]]:
    """hpZ off (1) and over a node."""
    node = _family.level_group_sizes(topology)["node"]
    return [{"hpz_partition_size": h} for h in sorted({1, node})]


bound = _family_bound.bound_of(plan)


# ------------------------------------------------------------------ what the rest of hzpsim asks (strategies/__init__.py)

ORDER = 60
COLOR = "#8172b2"
PUBLISHED_FAMILIES: dict[str, tuple[str, ...]] = {"zeropp": ()}
FRAMEWORK_IMPLEMENTATIONS = {"deepspeed": "deepspeed"}
VALIDATION_REGIMES = {"deepspeed": "DeepSpeed ZeRO", "": "FSDP/ZeRO-3"}


def from_published(run: PublishedRun) -> tuple[dict, list[str]]:
    """ZeRO++ = ZeRO-3 + qwZ (int8 weight all-gather) + hpZ (secondary bf16 copy of the weights
    sharded inside one node: the paper's secondary group) + qgZ (int4 hierarchical gradient
    reduce-scatter)."""
    return {
        "name": "zeropp",
        "hpz_partition_size": run.gpus_per_node,
        "quantized_weights": True,
        "quantized_gradients": True,
    }, []
