"""What every trainer shares: the Trainer protocol, the data slices, the loss, global-norm
clipping and the byte counts of model states (torch, no strategy).

The trainers (:mod:`~hzpsim.executor.reference`, :mod:`~hzpsim.executor.fsdp`,
:mod:`~hzpsim.executor.nd`, :mod:`~hzpsim.executor.asynchzp`) import from here;
:mod:`~hzpsim.executor.trainers` picks one by strategy name. Nothing here imports a trainer.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F

from hzpsim.executor import model as tmodel
from hzpsim.executor.spec import RunSpec


class Trainer(Protocol):
    def step(self, step: int) -> float:
        """Run optimizer step ``step``; return this rank's loss (mean over its tokens), or NaN
        when this rank computes no loss (a non-last pipeline stage)."""
        ...

    states: dict[str, int]
    """model_state_bytes() as it was after the last optimizer step, gradients still present."""

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of params / grads / optimizer state (sharded parts only)."""
        ...

    def buffer_bytes(self) -> int:
        """Bytes of persistent communication buffers (AsyncHZP's ring), 0 otherwise."""
        ...

    def zero_grad(self) -> None:
        ...


def local_batch(spec: RunSpec, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel replica's slice of step ``step``'s global batch."""
    x, y = tmodel.batch(spec.model, step, spec.global_batch_size, spec.seed)
    per = spec.global_batch_size // spec.dp_size
    return x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]


def micro_batches(x: torch.Tensor, y: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[i:i + size], y[i:i + size]) for i in range(0, x.shape[0], size)]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def on_device(module: ModuleT, device: torch.device) -> ModuleT:
    """``module.to(device)``, skipped when every parameter is already there (a no-op for real
    tensors; :mod:`hzpsim.executor.memtrack` builds fake-tensor models, which ``Module.to``
    cannot swap in place)."""
    if all(p.device == device for p in module.parameters()):
        return module
    return module.to(device)


def scalar(t: torch.Tensor) -> float:
    """``t.item()``; NaN for a fake tensor (:mod:`hzpsim.executor.memtrack` runs steps under
    ``FakeTensorMode``, where a tensor has no value)."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(t):
        return float("nan")
    return t.item()


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = local(t)
    return t.numel() * t.element_size()


def adam_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Adam moments (exp_avg, exp_avg_sq); the scalar ``step`` counters are not model state."""
    total = 0
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            total += tensor_bytes(state.get(key))
    return total


def clip_coefficient(sum_squares: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)) for a global sum of squares (torch's clip_grad_norm_)."""
    norm = sum_squares.sqrt()
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


class TorchOptimizerStates:
    """Model states of a trainer whose parameters, gradients and Adam state live in torch's own
    objects (the reference and FSDP2: sharded DTensors count their local shards)."""

    net: torch.nn.Module
    opt: torch.optim.Optimizer

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def model_state_bytes(self) -> dict[str, int]:
        params = list(self.net.parameters())
        return {"params": sum(tensor_bytes(p) for p in params), "grads": sum(tensor_bytes(p.grad) for p in params),
                "optimizer": adam_state_bytes(self.opt)}

    def buffer_bytes(self) -> int:
        return 0
