"""``reference``: the single-process baseline every strategy's losses are compared with.

One process, the whole model, the same data, Adam and global-norm clipping, fp32. Run through
:mod:`hzpsim.executor.worker`, or in process by :func:`hzpsim.executor.runner.reference_losses`.
"""

from __future__ import annotations

import torch

from hzpsim.executor import model as tmodel
from hzpsim.executor.common import (
    TorchOptimizerStates,
    clip_coefficient,
    cross_entropy,
    micro_batches,
)
from hzpsim.executor.spec import RunSpec


class ReferenceTrainer(TorchOptimizerStates):
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
