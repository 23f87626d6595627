"""ZeRO stages 1, 2 and 3 (Rajbhandari et al. 2020) as DeepSpeed runs them, over all devices.

- stage 1: optimizer states sharded; gradients accumulate in a full buffer and are
  reduce-scattered once per step (bucketed per unit, overlapped with the last micro-batch's
  backward); the updated parameters are all-gathered once per step.
- stage 2: gradients also sharded, so each micro-batch reduce-scatters them (a 1/N gradient
  shard cannot accumulate full gradients: DeepSpeed's ``no_sync`` is refused for stage 2/3);
  parameters all-gathered once per step.
- stage 3: parameters sharded too: all-gathered before each unit's forward and (with
  ``reshard_after_forward``) again before its backward, every micro-batch, with
  ``prefetch_depth`` gathers in flight; gradients reduce-scattered per unit.

Model states use the DeepSpeed/Megatron layout (bf16 working copy, ``grad_dtype`` gradients,
12 bytes/parameter of fp32 master + Adam moments). Run with::

    hzpsim run --set strategy.name=zero --set strategy.stage=3
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from hzpsim.hardware.topology import Topology
from hzpsim.model import Model
from hzpsim.model.training import Training
from hzpsim.strategies import (
    PublishedRun,
    _compression,
    _family,
    _family_bound,
    _implementations,
    compose_label,
)
from hzpsim.strategies._compression import GradCompression
from hzpsim.strategies._sharded import Schedule


@dataclass(frozen=True)
class Config:
    stage: Literal[1, 2, 3] = 3  # what is sharded: 1 optimizer, 2 + gradients, 3 + parameters
    prefetch_depth: int = 1  # stage 3: all-gathers issued ahead of the unit that needs them
    reshard_after_forward: bool = True  # stage 3: free gathered parameters after the forward
    overlap_grad_reduce: bool = True  # stages 1/2: step-end reduction overlaps the backward
    overlap_param_gather: bool = False  # stages 1/2: next forward waits per unit (Megatron) or for all (DeepSpeed)
    implementation: str = "deepspeed"  # how the framework runs it (strategies/_implementations.py)
    # stages 1/2: compression of the gradient reduction (strategies/_compression.py, docs/compression.md); None = off
    grad_compression: GradCompression | None = field(default=None, metadata={"omit_if_none": True})

    def validate(self) -> None:
        _implementations.get(self.implementation)
        schedule(self)  # the schedule checks its own fields
        if self.grad_compression is not None and self.stage == 3:
            raise ValueError("grad_compression: not supported with stage 3 (parameters sharded: the gradient is "
                             "reduce-scattered unit by unit into 1/N shards); use stage 1 or 2")


def schedule(config: Config) -> Schedule:
    return Schedule(
        prefetch_depth=config.prefetch_depth,
        reshard_after_forward=config.reshard_after_forward,
        overlap_grad_reduce=config.overlap_grad_reduce,
        overlap_param_gather=config.overlap_param_gather,
        implementation=_implementations.get(config.implementation),
    )


def plan(config: Config, topology: Topology) -> _family.FamilyPlan:
    n = topology.num_devices
    p, g, o = {1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[config.stage]
    return _family.FamilyPlan(param_size=p, grad_size=g, optim_size=o, schedule=schedule(config),
                              grad_compression=config.grad_compression)


check, build = _family.delegates(plan)


def resolve(config: Config, topology: Topology) -> Config:
    """The config as simulated: ``grad_compression`` with ratio 1 is none."""
    return dataclasses.replace(config, grad_compression=_compression.resolved(config.grad_compression))


# ---------------------------------------------------------------------------- hzpsim search

SEARCH_RANK = 20
"""Where the search reports ZeRO among the strategies (lowest first)."""


def layouts(model: Model, training: Training, topology: Topology, space: Any) -> list[dict[str, Any]]:
    """Stages 1, 2 and 3, those of ``space.zero_stage`` (all of them when it is empty); stages 1
    and 2 also with each ``space.grad_compression`` option (none by default)."""
    stages = [s for s in (1, 2, 3) if s in space.zero_stage or not space.zero_stage]
    out: list[dict[str, Any]] = [{"stage": s} for s in stages]
    out += [{"stage": s, "grad_compression": option} for s in stages if s < 3
            for option in _compression.search_options(space)]
    return out


bound = _family_bound.bound_of(plan)


def label(resolved: dict) -> str:
    """A short name for tables."""
    return _compression.label(compose_label(resolved, {"stage": "stage"}), resolved)


# ------------------------------------------------------------------ what the rest of hzpsim asks (strategies/__init__.py)

ORDER = 10
COLOR = "#dd8452"
DEFAULT_RUNS = ({"stage": 1}, {"stage": 2}, {"stage": 3})
STAND_INS = ({"stage": 3},)
PUBLISHED_FAMILIES: dict[str, tuple[str, ...]] = {"fsdp": (), "zero2": (), "zero3": ()}
FRAMEWORK_IMPLEMENTATIONS = {"deepspeed": "deepspeed", "torchtitan": "fsdp2", "llm-foundry": "llm-foundry", "fsdp": "fsdp1",
                             "fairscale": "fsdp1"}
VALIDATION_REGIMES = {"deepspeed": "DeepSpeed ZeRO", "": "FSDP/ZeRO-3"}


def from_published(run: PublishedRun) -> tuple[dict, list[str]]:
    """A published FSDP / ZeRO-3 / ZeRO-2 run: ZeRO at its stage (FSDP: 3 unless the row says 2);
    composed with TP/PP/CP/EP it is ND with that ZeRO stage, and with a sharding group smaller
    than the data-parallel group it is HSDP."""
    stage = 2 if run.family == "zero2" else (run.zero_stage if run.zero_stage in (2, 3) else 3)
    if run.tp > 1 or run.pp > 1 or run.cp > 1 or run.ep > 1:
        # FSDP composed with TP/PP/CP (metaseq, Megatron-FSDP + TP, ...)
        mapping, notes = run.mapped_by("nd", zero_stage=stage)
        return mapping, [f"FSDP with tp/pp/cp > 1 -> nd with zero_stage {stage}", *notes]
    if run.sharding_group is not None and run.sharding_group < run.dp:
        return run.mapped_by("hsdp")
    s: dict = {"name": "zero", "stage": stage}
    if "fsdp" in run.system and stage == 2:
        # FSDP SHARD_GRAD_OP gathers each unit just before its forward (with
        # prefetch), not all at once after the optimizer as DeepSpeed stage 2
        s["overlap_param_gather"] = True
    return s, []
