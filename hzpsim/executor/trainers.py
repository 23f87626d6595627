"""Training loops per strategy: the single-process reference and PyTorch's own implementations.

- ``reference``: one process, the whole model, the same data, Adam and clipping (fp32).
- ``zero3``: FSDP2 ``fully_shard`` on every unit (embed, each block, the routed experts of an
  MoE block, head) and the root: one all-gather per unit and use, one reduce-scatter per unit
  and micro-batch, the granularity of hzpsim's units.
- ``zero2``: the same with ``reshard_after_forward=False`` (no backward re-gather).
- ``hsdp``: FSDP2 on a 2-D (replicate, shard) device mesh; the replica all-reduce runs only on
  the last micro-batch (``set_requires_all_reduce``), as hzpsim models it.
- ``nd`` and ``asynchzp``: :mod:`hzpsim.executor.nd` and :mod:`hzpsim.executor.asynchzp`.

Every trainer clips gradients by their global norm with ONE fp32 all-reduce over all ranks (the
``grad_norm`` collective hzpsim emits). Run through :mod:`hzpsim.executor.worker`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = _local(t)
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


class _TorchOptimizerStates:
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


class ReferenceTrainer(_TorchOptimizerStates):
    """The single-process baseline every strategy's losses are compared with."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.net = tmodel.build(spec.model, spec.seed)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=spec.lr, foreach=True)

    def step(self, step: int) -> float:
        spec = self.spec
        x, y = tmodel.batch(spec.model, step, spec.global_batch_size, spec.seed)
        chunks = micro_batches(x, y, spec.micro_batch_size)
        total = 0.0
        for xb, yb in chunks:
            loss = cross_entropy(self.net(xb), yb) / len(chunks)
            loss.backward()
            total += loss.item()
        grads = [p.grad for p in self.net.parameters() if p.grad is not None]
        sq = torch.stack([g.pow(2).sum() for g in grads]).sum()
        torch._foreach_mul_(grads, clip_coefficient(sq, spec.max_grad_norm))
        self.opt.step()
        self.states = self.model_state_bytes()
        self.zero_grad()
        return total



class FSDPTrainer(_TorchOptimizerStates):
    """ZeRO-3 / ZeRO-2 / HSDP with FSDP2 ``fully_shard``."""

    def __init__(self, spec: RunSpec, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.spec, self.device = spec, device
        n = spec.world_size
        self.hsdp = spec.strategy == "hsdp"
        g = spec.layout.shard_group_size or n
        self.hsdp = self.hsdp and g < n  # one replica: HSDP is ZeRO-3 (FSDP2 would all-reduce over 1 rank)
        if self.hsdp:
            self.replicas = n // g
            mesh = init_device_mesh(device.type, (self.replicas, g), mesh_dim_names=("replicate", "shard"))
        else:
            self.replicas = 1
            mesh = init_device_mesh(device.type, (n,), mesh_dim_names=("shard",))
        reshard = spec.strategy != "zero2"
        net = tmodel.build(spec.model, spec.seed).to(device)
        for unit in net.units():
            for module in unit.modules():
                if isinstance(module, tmodel.Experts):
                    fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(net, mesh=mesh, reshard_after_forward=reshard)
        self.net = net
        self.opt = torch.optim.Adam(net.parameters(), lr=spec.lr, foreach=True)
        self.rank = dist.get_rank()

    def step(self, step: int) -> float:
        spec = self.spec
        x, y = local_batch(spec, step, self.rank)
        chunks = micro_batches(x.to(self.device), y.to(self.device), spec.micro_batch_size)
        total = 0.0
        for i, (xb, yb) in enumerate(chunks):
            if self.hsdp:
                self.net.set_requires_all_reduce(i == len(chunks) - 1)  # type: ignore[operator]
            loss = cross_entropy(self.net(xb), yb) / len(chunks)
            loss.backward()
            total += loss.item()
        grads = [p.grad for p in self.net.parameters() if p.grad is not None]
        local = [_local(g) for g in grads]
        sq = torch.stack([g.pow(2).sum() for g in local]).sum() / self.replicas
        dist.all_reduce(sq)
        torch._foreach_mul_(local, clip_coefficient(sq, spec.max_grad_norm))
        self.opt.step()
        self.states = self.model_state_bytes()
        self.zero_grad()
        return total



def make_trainer(spec: RunSpec, device: torch.device) -> Trainer:
    """The trainer of ``spec.strategy`` (inside an initialised process group, except reference)."""
    if spec.strategy == "reference":
        return ReferenceTrainer(spec)
    if spec.strategy in ("zero3", "zero2", "hsdp"):
        return FSDPTrainer(spec, device)
    if spec.strategy == "asynchzp":
        from hzpsim.executor.asynchzp import AsyncHZPTrainer

        return AsyncHZPTrainer(spec, device)
    if spec.strategy == "nd":
        from hzpsim.executor.nd import NDTrainer

        return NDTrainer(spec, device)
    raise ValueError(spec.strategy)


def module_param_bytes(module: nn.Module) -> int:
    return sum(tensor_bytes(p) for p in module.parameters())

