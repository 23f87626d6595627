"""ND parallelism with PyTorch's own pieces: DTensor tensor parallelism with sequence
parallelism, ``torch.distributed.pipelining`` (1F1B; interleaved 1F1B when vpp > 1) and plain
data parallelism (one gradient all-reduce per unit and step over the data-parallel group).

Ranks are placed as hzpsim places them (tp fastest, then dp, then pp): a (pp, dp, tp) device
mesh. The TP plan is Megatron's with sequence parallelism (torchtitan's plan): vocab-parallel
embedding whose output is sequence-sharded, norms sequence-parallel, attention and MLP
column-parallel in, row-parallel out (reduce-scatter back to sequence shards), head
column-parallel with its logits gathered. Pipeline stages exchange the sequence-sharded
activations (each TP rank sends 1/tp). Run it::

    hzpsim execute examples/executor-world4.yaml --world 4 --set strategy.name=nd \\
        --set strategy.tp=2 --set strategy.pp=2 --set strategy.sequence_parallel=true
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hzpsim.config import ScenarioError
from hzpsim.executor import model as tmodel
from hzpsim.executor.common import (
    adam_state_bytes,
    clip_coefficient,
    cross_entropy,
    micro_batches,
    on_device,
    scalar,
    tensor_bytes,
)
from hzpsim.executor.spec import RunSpec


class _Stage(nn.Module):
    """The units of one virtual pipeline stage."""

    def __init__(self, units: list[nn.Module], first: bool, last: bool) -> None:
        super().__init__()
        self.body = nn.ModuleList(units)
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.body:
            x = unit(x)
        return x


def _tensor_parallel(units: list[nn.Module], mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    for unit in units:
        if isinstance(unit, tmodel.Embed):
            parallelize_module(unit, mesh, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                                                                output_layouts=Shard(1))})
        elif isinstance(unit, tmodel.Head):
            parallelize_module(unit, mesh, {"norm": SequenceParallel(),
                                            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
        else:
            plan = {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            }
            if getattr(unit.feed_forward, "w3", None) is not None:
                plan["feed_forward.w3"] = ColwiseParallel()
            parallelize_module(unit, mesh, plan)


class NDTrainer:
    """TP (+SP) x PP x DP."""

    def __init__(self, spec: RunSpec, device: torch.device, static_pipeline_shapes: bool = False) -> None:
        """``static_pipeline_shapes``: give every pipeline stage its input and output shapes up
        front (``PipelineStage``'s static mode) instead of the first step's shape-inference
        handshake between stages, which a fake process group cannot answer
        (:mod:`hzpsim.executor.memtrack`; the normal runs infer them)."""
        from torch.distributed.device_mesh import init_device_mesh

        self.spec, self.device = spec, device
        lay = spec.layout
        tp, pp, vpp, dp = lay.tp, lay.pp, lay.vpp, spec.dp_size
        if spec.model.moe is not None:
            raise ScenarioError("nd: the executor's ND runs dense models")
        if tp > 1 and spec.model.position_embedding == "learned":
            raise ScenarioError("nd: learned position tables are not tensor-parallel in the executor")
        self.rank = dist.get_rank()
        self.mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        coord = self.mesh.get_coordinate()
        assert coord is not None
        self.pp_rank, self.dp_rank, self.tp_rank = coord
        self.tp, self.pp, self.vpp, self.dp = tp, pp, vpp, dp
        net = on_device(tmodel.build(spec.model, spec.seed), device)
        layers = list(net.layers)
        virtual = pp * vpp
        per = len(layers) // virtual
        self.stage_modules: list[_Stage] = []
        self.stage_ids: list[int] = []
        for c in range(vpp):
            v = c * pp + self.pp_rank
            units: list[nn.Module] = list(layers[v * per:(v + 1) * per])
            if v == 0:
                units.insert(0, net.embed)
            if v == virtual - 1:
                units.append(net.head)
            if tp > 1:
                _tensor_parallel(units, self.mesh["tp"])
            self.stage_modules.append(_Stage(units, v == 0, v == virtual - 1))
            self.stage_ids.append(v)
        self.units = [u for stage in self.stage_modules for u in stage.body]
        params = [p for u in self.units for p in u.parameters()]
        self.opt = torch.optim.Adam(params, lr=spec.lr, foreach=True)
        self.dp_group = self.mesh["dp"].get_group() if dp > 1 else None
        self.schedule: Any = None
        self.is_last = any(stage.last for stage in self.stage_modules)
        self.is_first = any(stage.first for stage in self.stage_modules)
        if pp > 1:
            from torch.distributed.pipelining import (
                PipelineStage,
                Schedule1F1B,
                ScheduleInterleaved1F1B,
            )

            group = self.mesh["pp"].get_group()
            shapes: list[dict[str, Any]] = [self._stage_shapes(v, virtual) if static_pipeline_shapes else {}
                                            for v in self.stage_ids]
            stages: list[Any] = [PipelineStage(module, v, virtual, device, group=group, **shape)
                                 for module, v, shape in zip(self.stage_modules, self.stage_ids, shapes)]
            m = spec.num_micro_batches
            if vpp > 1:
                self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=cross_entropy)
            else:
                self.schedule = Schedule1F1B(stages[0], n_microbatches=m, loss_fn=cross_entropy)
        self.states: dict[str, int] = {}

    def _stage_shapes(self, v: int, virtual: int) -> dict[str, torch.Tensor]:
        """Example (meta) input and output of virtual stage ``v`` for one micro-batch: tokens
        into the first, sequence-sharded hidden states between stages, full logits out of the last."""
        m, b = self.spec.model, self.spec.micro_batch_size
        hidden = torch.empty(b, m.seq_len // self.tp, m.hidden_size, device="meta", requires_grad=True)
        first = torch.empty(b, m.seq_len, dtype=torch.long, device="meta")
        last = torch.empty(b, m.seq_len, m.vocab_size, device="meta", requires_grad=True)
        return {"input_args": first if v == 0 else hidden, "output_args": last if v == virtual - 1 else hidden}

    def _replicas(self, p: torch.Tensor) -> int:
        """Ranks holding an identical copy of this rank's piece of ``p``."""
        shards = 1
        placements = getattr(p, "placements", ())
        for placement in placements:
            if placement.is_shard():
                shards *= self.tp
        return self.dp * (self.tp // shards if placements else self.tp)

    def step(self, step: int) -> float:
        spec = self.spec
        x, y = tmodel.batch(spec.model, step, spec.global_batch_size, spec.seed)
        per = spec.global_batch_size // self.dp
        x, y = x[self.dp_rank * per:(self.dp_rank + 1) * per].to(self.device), y[self.dp_rank * per:(self.dp_rank + 1) * per].to(self.device)
        loss_value = float("nan")
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            kwargs: dict[str, Any] = {"target": y, "losses": losses} if self.is_last else {}
            if self.is_first:
                self.schedule.step(x, **kwargs)
            else:
                self.schedule.step(**kwargs)
            if self.is_last:
                loss_value = scalar(torch.stack([t.detach() for t in losses]).mean())
        else:
            chunks = micro_batches(x, y, spec.micro_batch_size)
            loss_value = 0.0
            for xb, yb in chunks:
                loss = cross_entropy(self.stage_modules[0](xb), yb) / len(chunks)
                loss.backward()
                loss_value += scalar(loss)
        self._reduce_partial_tensor_parallel()
        self._reduce_data_parallel()
        params = [p for u in self.units for p in u.parameters() if p.grad is not None]
        local = [_local(p.grad) for p in params]
        sq = torch.stack([g.pow(2).sum() / self._replicas(p) for g, p in zip(local, params)]).sum()
        dist.all_reduce(sq)
        torch._foreach_mul_(local, clip_coefficient(sq, spec.max_grad_norm))
        self.opt.step()
        self.states = self.model_state_bytes()
        self.zero_grad()
        return loss_value

    def _reduce_partial_tensor_parallel(self) -> None:
        """Sequence-parallel norm weights get partial gradients on each TP rank: sum them with
        ONE all-reduce over the TP group per step (Megatron's coalesced layer-norm gradient
        all-reduce), explicitly, instead of letting DTensor reduce them lazily op by op."""
        if self.tp == 1:
            return
        from torch.distributed.tensor import DTensor

        params = [p for u in self.units for p in u.parameters()
                  if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)]
        partial_ids = {id(p) for p in params}
        for p in self._all_params():
            # DTensor's embedding backward returns a replicated gradient for a vocab-sharded
            # table: keep this rank's rows (a local slice, no communication)
            if isinstance(p.grad, DTensor) and id(p) not in partial_ids and tuple(p.grad.placements) != tuple(p.placements):  # type: ignore[attr-defined]
                p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)  # type: ignore[attr-defined]
        if not params:
            return
        local = [p.grad.to_local() for p in params]  # type: ignore[union-attr]
        flat = torch.cat([g.reshape(-1) for g in local])
        dist.all_reduce(flat, group=self.mesh["tp"].get_group())
        at = 0
        for p, g in zip(params, local):
            value = flat[at:at + g.numel()].view_as(g).clone()
            at += g.numel()
            p.grad = DTensor.from_local(value, self.mesh["tp"], p.placements, run_check=False)  # type: ignore[attr-defined]

    def _all_params(self) -> list[torch.Tensor]:
        return [p for u in self.units for p in u.parameters()]

    def _reduce_data_parallel(self) -> None:
        """One all-reduce per unit over the data-parallel group (hzpsim's zero_stage 0)."""
        if self.dp_group is None:
            return
        for unit in self.units:
            grads = [_local(p.grad) for p in unit.parameters() if p.grad is not None]
            if not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            flat /= self.dp
            at = 0
            for g in grads:
                g.copy_(flat[at:at + g.numel()].view_as(g))
                at += g.numel()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def model_state_bytes(self) -> dict[str, int]:
        params = [p for u in self.units for p in u.parameters()]
        return {"params": sum(tensor_bytes(p) for p in params), "grads": sum(tensor_bytes(p.grad) for p in params),
                "optimizer": adam_state_bytes(self.opt)}

    def buffer_bytes(self) -> int:
        return 0


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t
