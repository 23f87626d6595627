"""``zero`` (stage 3 or 2) and ``hsdp`` with PyTorch FSDP2 ``fully_shard``.

- ``zero``, stage 3: ``fully_shard`` on every unit (embed, each block, the routed experts of an
  MoE block, head) and the root: one all-gather per unit and use, one reduce-scatter per unit
  and micro-batch, the granularity of hzpsim's units.
- ``zero``, stage 2: the same with ``reshard_after_forward=False`` (no backward re-gather).
- ``hsdp``: FSDP2 on a 2-D (replicate, shard) device mesh; the replica all-reduce runs only on
  the last micro-batch (``set_requires_all_reduce``), as hzpsim models it.

Gradients are clipped by their global norm with ONE fp32 all-reduce over all ranks (the
``grad_norm`` collective hzpsim emits). Run through :mod:`hzpsim.executor.worker`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hzpsim.executor import model as tmodel
from hzpsim.executor.common import (
    TorchOptimizerStates,
    clip_coefficient,
    cross_entropy,
    local,
    local_batch,
    micro_batches,
    on_device,
    scalar,
)
from hzpsim.executor.spec import RunSpec


class FSDPTrainer(TorchOptimizerStates):
    """ZeRO-3 / ZeRO-2 / HSDP with FSDP2 ``fully_shard``."""

    def __init__(self, spec: RunSpec, device: torch.device, replicated: bool = False) -> None:
        """``replicated``: shard inside groups of ``spec.layout.shard_group_size`` ranks and
        replicate across them (HSDP); otherwise shard over the whole world."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.spec, self.device = spec, device
        n = spec.world_size
        g = spec.layout.shard_group_size or n
        self.hsdp = replicated and g < n  # one replica: HSDP is ZeRO-3 (FSDP2 would all-reduce over 1 rank)
        if self.hsdp:
            self.replicas = n // g
            mesh = init_device_mesh(device.type, (self.replicas, g), mesh_dim_names=("replicate", "shard"))
        else:
            self.replicas = 1
            mesh = init_device_mesh(device.type, (n,), mesh_dim_names=("shard",))
        reshard = spec.layout.stage != 2
        net = on_device(tmodel.build(spec.model, spec.seed), device)
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
            total += scalar(loss)
        grads = [p.grad for p in self.net.parameters() if p.grad is not None]
        local_grads = [local(g) for g in grads]
        sq = torch.stack([g.pow(2).sum() for g in local_grads]).sum() / self.replicas
        dist.all_reduce(sq)
        torch._foreach_mul_(local_grads, clip_coefficient(sq, spec.max_grad_norm))
        self.opt.step()
        self.states = self.model_state_bytes()
        self.zero_grad()
        return total
