"""The trainers the executor runs, by kind (``spec.TRAINER_KINDS`` maps each strategy to its kind).

- ``reference``: one process, the whole model (:mod:`hzpsim.executor.reference`);
- ``zero`` (``Layout.stage`` 3 or 2) and ``hsdp``: PyTorch FSDP2 (:mod:`hzpsim.executor.fsdp`);
- ``nd``: DTensor TP + SP, ``torch.distributed.pipelining`` and DP (:mod:`hzpsim.executor.nd`);
- ``asynchzp``: hzpsim's own AsyncHZP (:mod:`hzpsim.executor.asynchzp`).

Every trainer clips gradients by their global norm with ONE fp32 all-reduce over all ranks (the
``grad_norm`` collective hzpsim emits). Imports point one way: this table imports the trainers,
the trainers import :mod:`hzpsim.executor.common`, never this module. Run through
:mod:`hzpsim.executor.worker`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hzpsim.executor.asynchzp import AsyncHZPTrainer
from hzpsim.executor.common import Trainer
from hzpsim.executor.fsdp import FSDPTrainer
from hzpsim.executor.nd import NDTrainer
from hzpsim.executor.reference import ReferenceTrainer
from hzpsim.executor.spec import TRAINER_KINDS, RunSpec

TRAINERS: dict[str, Callable[[RunSpec, torch.device], Trainer]] = {
    "reference": lambda spec, device: ReferenceTrainer(spec),
    "fsdp": FSDPTrainer,
    "fsdp-replicated": lambda spec, device: FSDPTrainer(spec, device, replicated=True),
    "nd": NDTrainer,
    "asynchzp": AsyncHZPTrainer,
}
"""Trainer factories by kind; ``spec.TRAINER_KINDS`` says which kind runs each strategy."""


def make_trainer(spec: RunSpec, device: torch.device) -> Trainer:
    """The trainer of ``spec.strategy`` (inside an initialised process group, except reference)."""
    kind = TRAINER_KINDS.get(spec.strategy)
    if kind not in TRAINERS:
        raise ValueError(f"strategy: the executor has no trainer for {spec.strategy!r} "
                         f"(known: {', '.join(TRAINER_KINDS)})")
    return TRAINERS[kind](spec, device)
