"""A real AsyncHZP (arXiv 2510.20111 as hzpsim models it): hierarchical ZeRO with background
communication threads. There is no public implementation; this one follows hzpsim's model.

Layout, per unit (embed, each block, head), over nested groups p | g | o | N of consecutive ranks:

- the working copy of the parameters is sharded over the **param group** (p ranks): before
  each use (every micro-batch's forward, and again for its backward) the unit is all-gathered
  into one slot of a fixed ring of ``prefetch_depth + 1`` pre-allocated buffers, up to
  ``prefetch_depth`` uses ahead;
- gradients are reduce-scattered over the **grad group** (g ranks) after each unit's backward,
  from a fixed ring of ``reduce_buffers`` pre-allocated buffers (autograd accumulates straight
  into a ring slot), into a 1/g gradient shard;
- fp32 master weights and Adam moments (``torch.optim.Adam`` on flat shards) are sharded over
  the **optim group** (o ranks): at the step end each unit's gradient shard is reduce-scattered
  over the o/g ranks holding the same slice, all-reduced over the N/o replicas, the global
  gradient norm is all-reduced (one fp32 scalar), Adam updates the 1/o shard and an all-gather
  over o/p ranks rebuilds the 1/p working shard.

``asynchronous=True`` issues all-gathers, reduce-scatters and the step-end collectives from three
dedicated background threads (streams ``ag``, ``rs``, ``dp``), each with its own process groups;
``False`` issues the same collectives in the same order from ONE background thread (one
communicator), as hzpsim's ``async: false`` models it. The backward needs the weights its
forward saved: a saved-tensor hook stores where in the gather buffer a saved weight lived and
re-reads it from the backward's gather (reshard after forward). Run it::

    hzpsim execute examples/executor-world4.yaml --world 4 --set strategy.name=asynchzp \\
        --set strategy.param_group_size=2 --set strategy.grad_group_size=2 --set strategy.optim_group_size=4
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from hzpsim.config import ScenarioError
from hzpsim.executor import counting
from hzpsim.executor import model as tmodel
from hzpsim.executor.common import (
    clip_coefficient,
    cross_entropy,
    local_batch,
    micro_batches,
    scalar,
)
from hzpsim.executor.spec import RunSpec


@dataclass
class _Unit:
    module: nn.Module
    names: list[str]
    shapes: list[torch.Size]
    offsets: list[int]
    numel: int  # padded to a multiple of o
    working: torch.Tensor  # this rank's 1/p working shard
    grad: torch.Tensor  # this rank's 1/g gradient shard
    master: nn.Parameter  # this rank's 1/o fp32 master shard


def _group_members(role: str, rank: int, n: int, p: int, g: int, o: int) -> list[list[int]]:
    """Every group of ``role`` (hzpsim's _sharded.NestedSharding.group_of, enumerated)."""
    if role in ("param", "grad"):
        size = p if role == "param" else g
        return [list(range(b, b + size)) for b in range(0, n, size)]
    if role in ("step_rs", "step_ag"):
        stride = g if role == "step_rs" else p
        return [[b + j + k * stride for k in range(o // stride)] for b in range(0, n, o) for j in range(stride)]
    if role == "replica":
        return [list(range(j, n, o)) for j in range(o)]
    raise AssertionError(role)


def _storage_key(t: torch.Tensor) -> int:
    """Which storage ``t`` lives in: its data pointer; for a fake tensor (memory measurement,
    :mod:`hzpsim.executor.memtrack`), whose data pointer is 0, its storage object's address."""
    st = t.untyped_storage()
    return st._cdata if isinstance(t, FakeTensor) else st.data_ptr()


def _to_meta(module: nn.Module) -> None:
    """``module.to("meta")`` (its parameters live in the flat shards now). ``Module.to`` cannot
    swap fake-tensor parameters (memory measurement, :mod:`hzpsim.executor.memtrack`): those are
    replaced by meta parameters of the same shapes."""
    if not any(isinstance(p, FakeTensor) for p in module.parameters()):
        module.to("meta")
        return
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None:
                    sub._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                         requires_grad=p.requires_grad)


class _Stream:
    """One background communication thread with its own process groups; ``inline`` runs each
    submitted task at once on the caller's thread instead (memory measurement only,
    :mod:`hzpsim.executor.memtrack`: its trackers see the calling thread alone)."""

    def __init__(self, name: str, roles: dict[str, list[list[int]]], rank: int, inline: bool = False) -> None:
        self.name = name
        self.inline = inline
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hzp-{name}")
        self.groups: dict[str, dist.ProcessGroup | None] = {}
        for role, groups in roles.items():
            mine = None
            for members in groups:  # every rank creates every group, in the same order
                pg = dist.new_group(members) if len(members) > 1 else None
                if rank in members:
                    mine = pg
            self.groups[role] = mine

    def submit(self, fn) -> Future:
        if not self.inline:
            return self.pool.submit(fn)
        future: Future = Future()
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(exc)
        return future


class AsyncHZPTrainer:
    """Hierarchical sharding with background all-gather / reduce-scatter threads."""

    def __init__(self, spec: RunSpec, device: torch.device, inline: bool = False) -> None:
        """``inline``: run the communication threads' work synchronously on the training thread
        (for :mod:`hzpsim.executor.memtrack`; the normal runs use the background threads)."""
        self.spec, self.device = spec, device
        self.n, self.rank = spec.world_size, dist.get_rank()
        p, g, o = spec.group_sizes()
        self.p, self.g, self.o = p, g, o
        self.replicas = self.n // o
        if spec.model.moe is not None:
            raise ScenarioError("asynchzp: the executor's AsyncHZP runs dense models")
        net = tmodel.build(spec.model, spec.seed)
        self.units: list[_Unit] = []
        r = self.rank
        self.opt_index = (r % g) * (o // g) + (r % o) // g  # which 1/o slice this rank optimizes
        for module in net.units():
            named = list(module.named_parameters())
            flat = torch.cat([t.detach().reshape(-1) for _, t in named])
            numel = -(-flat.numel() // o) * o
            full = torch.zeros(numel, dtype=torch.float32)
            full[: flat.numel()] = flat
            offsets, at = [], 0
            for _, t in named:
                offsets.append(at)
                at += t.numel()
            w = full.view(p, -1)[r % p].clone().to(device)
            gr = torch.zeros(numel // g, dtype=torch.float32, device=device)
            master = nn.Parameter(full.view(o, -1)[self.opt_index].clone().to(device))
            _to_meta(module)
            self.units.append(_Unit(module, [k for k, _ in named], [t.shape for _, t in named], offsets, numel,
                                    w, gr, master))
        self._check_layout()
        self.opt = torch.optim.Adam([u.master for u in self.units], lr=spec.lr, foreach=True)
        largest = max(u.numel for u in self.units)
        depth = spec.layout.prefetch_depth
        self.gather_slots = [torch.zeros(largest, device=device) for _ in range(depth + 1)] if p > 1 else []
        self.reduce_slots = [torch.zeros(largest, device=device) for _ in range(spec.layout.reduce_buffers)]
        self._slot_of_ptr = {_storage_key(s): i for i, s in enumerate(self.gather_slots)}
        roles = {role: _group_members(role, r, self.n, p, g, o) for role in ("param", "grad", "step_rs", "step_ag", "replica")}
        if spec.layout.asynchronous:
            self.ag = _Stream("ag", {"param": roles["param"], "step_ag": roles["step_ag"]}, r, inline)
            self.rs = _Stream("rs", {"grad": roles["grad"]}, r, inline)
            self.dp = _Stream("dp", {"step_rs": roles["step_rs"], "replica": roles["replica"]}, r, inline)
        else:
            self.ag = self.rs = self.dp = _Stream("comm", roles, r, inline)
        self.params_ready = [threading.Event() for _ in self.units]
        for event in self.params_ready:
            event.set()
        self.pending: list[Future] = []
        self.states: dict[str, int] = {}

    # ------------------------------------------------------------------ layout

    def _check_layout(self) -> None:
        """The step-end all-gather over o/p ranks must rebuild exactly this rank's 1/p slice."""
        p, g, o, r = self.p, self.g, self.o, self.rank
        base = r - r % o
        members = [base + r % p + k * p for k in range(o // p)]
        slices = sorted((m % g) * (o // g) + (m % o) // g for m in members)
        wanted = list(range((r % p) * (o // p), (r % p + 1) * (o // p)))
        if slices != wanted:
            raise ScenarioError(f"asynchzp: groups {p}|{g}|{o} leave the step-end all-gather without this rank's slice")
        self.ag_order = [(m % g) * (o // g) + (m % o) // g - wanted[0] for m in members]

    # ------------------------------------------------------------------ collectives (worker threads)

    def _gather(self, u: int, slot: int, step: int) -> None:
        counting.tag_thread(step)
        self.params_ready[u].wait()
        unit = self.units[u]
        out = self.gather_slots[slot][: unit.numel]
        dist.all_gather_into_tensor(out, unit.working, group=self.ag.groups["param"])

    def _reduce(self, u: int, slot: int, step: int) -> None:
        counting.tag_thread(step)
        unit = self.units[u]
        buf = self.reduce_slots[slot][: unit.numel]
        if self.g > 1:
            out = torch.empty(unit.numel // self.g, device=self.device)
            dist.reduce_scatter_tensor(out, buf, group=self.rs.groups["grad"])
            unit.grad += out
        else:
            unit.grad += buf

    def _step_reduce(self, u: int, step: int) -> None:
        counting.tag_thread(step)
        unit = self.units[u]
        shard = unit.grad
        if self.o > self.g:
            out = torch.empty(unit.numel // self.o, device=self.device)
            dist.reduce_scatter_tensor(out, shard, group=self.dp.groups["step_rs"])
            shard = out
        if self.replicas > 1:
            dist.all_reduce(shard, group=self.dp.groups["replica"])
        unit.master.grad = shard if shard is not unit.grad else shard.clone()

    def _step_gather(self, u: int, step: int) -> None:
        counting.tag_thread(step)
        unit = self.units[u]
        chunk = unit.numel // self.o
        if self.o > self.p:
            tmp = torch.empty(unit.numel // self.p, device=self.device)
            dist.all_gather_into_tensor(tmp, unit.master.detach(), group=self.ag.groups["step_ag"])
            for k, at in enumerate(self.ag_order):
                unit.working[at * chunk:(at + 1) * chunk] = tmp[k * chunk:(k + 1) * chunk]
        else:
            unit.working.copy_(unit.master.detach())
        self.params_ready[u].set()

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> float:
        spec = self.spec
        x, y = local_batch(spec, step, self.rank)
        chunks = micro_batches(x.to(self.device), y.to(self.device), spec.micro_batch_size)
        m, count = len(chunks), len(self.units)
        uses: list[tuple[int, str, int]] = []
        for mb in range(m):
            uses += [(mb, "fwd", u) for u in range(count)] + [(mb, "bwd", u) for u in reversed(range(count))]
        run = _StepRun(self, uses, step)
        total = 0.0
        for mb, (xb, yb) in enumerate(chunks):
            total += run.micro_batch(mb, xb, yb, m)
        for future in run.reduces:
            future.result()
        self._drain()
        reduced = [u.master.grad for u in self.units]
        assert all(t is not None for t in reduced)
        sq = torch.stack([t.pow(2).sum() for t in reduced]).sum() / self.replicas  # type: ignore[union-attr]
        dist.all_reduce(sq)
        torch._foreach_mul_(reduced, clip_coefficient(sq, spec.max_grad_norm))  # type: ignore[arg-type]
        self.opt.step()
        self.states = self.model_state_bytes()
        for u, unit in enumerate(self.units):
            unit.grad.zero_()
            unit.master.grad = None
            self.params_ready[u].clear()
            self.pending.append(self.dp.submit(lambda u=u: self._step_gather(u, step)))
        return total

    def _drain(self) -> None:
        while self.pending:
            self.pending.pop(0).result()

    def finish(self) -> None:
        """Wait for the background threads' outstanding work (step-end all-gathers)."""
        self._drain()

    def close(self) -> None:
        """Stop the background threads."""
        self._drain()
        for stream in {id(s): s for s in (self.ag, self.rs, self.dp)}.values():
            stream.pool.shutdown(wait=True)

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.master.grad = None

    def model_state_bytes(self) -> dict[str, int]:
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        optimizer = sum(size(u.master) for u in self.units)
        for state in self.opt.state.values():
            optimizer += sum(size(state[k]) for k in ("exp_avg", "exp_avg_sq") if k in state)
        return {"params": sum(size(u.working) for u in self.units), "grads": sum(size(u.grad) for u in self.units),
                "optimizer": optimizer}

    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.gather_slots + self.reduce_slots)


class _Enter(torch.autograd.Function):
    """Identity at a unit's input; its backward runs after the unit's backward."""

    @staticmethod
    def forward(ctx, x, run, index):  # type: ignore[override]
        ctx.run, ctx.index = run, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None, None


class _Exit(torch.autograd.Function):
    """Identity at a unit's output; its backward runs before the unit's backward: it waits for
    the unit's backward gather, prefetches the next ones and hands out a gradient buffer."""

    @staticmethod
    def forward(ctx, y, run, mb, u):  # type: ignore[override]
        ctx.run, ctx.mb, ctx.u = run, mb, u
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.run.before_backward(ctx.mb, ctx.u)
        return grad, None, None, None


class _StepRun:
    """The gathers, buffers and hooks of one optimizer step."""

    def __init__(self, trainer: AsyncHZPTrainer, uses: list[tuple[int, str, int]], step: int) -> None:
        self.t, self.uses, self.step = trainer, uses, step
        self.index = {use: i for i, use in enumerate(uses)}
        self.gathers: dict[int, Future] = {}
        self.depth = trainer.spec.layout.prefetch_depth
        self.reduces: list[Future] = []
        self.reduce_done: list[threading.Event] = []  # per reduce, in backward order
        self.leaves: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.remaining: dict[tuple[int, int], int] = {}
        self.reduce_of: dict[tuple[int, int], int] = {}
        self.unit_of_slot: dict[int, int] = {}
        self.bwd_slot: dict[int, int] = {}
        self.complete: list[tuple[int, int]] = []
        self.submitted: set[tuple[int, int]] = set()
        self.last_mb = 0

    def _issue(self, upto: int) -> None:
        for i in range(min(upto, len(self.uses) - 1) + 1):
            if i not in self.gathers:
                _, _, u = self.uses[i]
                self.gathers[i] = self.t.ag.submit(
                    lambda u=u, slot=i % (self.depth + 1): self.t._gather(u, slot, self.step))

    def _full(self, i: int) -> torch.Tensor:
        """Unit ``uses[i]``'s full flat parameters (waits for its gather)."""
        unit = self.t.units[self.uses[i][2]]
        if self.t.p == 1:
            self.t.params_ready[self.uses[i][2]].wait()  # the step-end all-gather rebuilds it
            return unit.working
        self._issue(i + self.depth)
        self.gathers[i].result()
        return self.t.gather_slots[i % (self.depth + 1)][: unit.numel]

    def micro_batch(self, mb: int, xb: torch.Tensor, yb: torch.Tensor, m: int) -> float:
        self.last_mb = m - 1
        h: torch.Tensor = xb
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            for u, unit in enumerate(self.t.units):
                i = self.index[(mb, "fwd", u)]
                flat = self._full(i)
                if self.t.p > 1:
                    self.unit_of_slot[i % (self.depth + 1)] = u
                leaves = [flat[a:a + s.numel()].view(s).detach().requires_grad_()
                          for a, s in zip(unit.offsets, unit.shapes)]
                for leaf in leaves:
                    leaf.register_post_accumulate_grad_hook(self._accumulated(mb, u))
                self.leaves[(mb, u)] = leaves
                if h.is_floating_point():
                    h = _Enter.apply(h, self, i)
                h = torch.func.functional_call(unit.module, dict(zip(unit.names, leaves)), (h,))
                h = _Exit.apply(h, self, mb, u)
            loss = cross_entropy(h, yb) / m
            (loss / self.t.n).backward()
        self.flush(mb, -1)
        return scalar(loss)

    # saved tensors that live in a gather slot are re-read from the backward's gather
    def _pack(self, t: torch.Tensor):
        if self.t.p > 1:
            slot = self.t._slot_of_ptr.get(_storage_key(t))
            if slot is not None:
                return ("slot", self.unit_of_slot[slot], t.storage_offset(), tuple(t.shape), t.stride())
        return t

    def _unpack(self, packed):
        if isinstance(packed, tuple) and packed and packed[0] == "slot":
            _, u, offset, shape, stride = packed
            return self.t.gather_slots[self.bwd_slot[u]].as_strided(shape, stride, offset)
        return packed

    def before_backward(self, mb: int, u: int) -> None:
        self.flush(mb, u)
        i = self.index[(mb, "bwd", u)]
        if self.t.p > 1:
            self._full(i)
            self.bwd_slot[u] = i % (self.depth + 1)
        k = len(self.reduce_done)
        slots = len(self.t.reduce_slots)
        if k >= slots and not self.reduce_done[k - slots].wait(timeout=600):  # a free gradient buffer
            raise RuntimeError("asynchzp: a gradient buffer was never released")
        self.reduce_done.append(threading.Event())
        unit = self.t.units[u]
        buf = self.t.reduce_slots[k % slots]
        buf[: unit.numel].zero_()
        for leaf, a in zip(self.leaves[(mb, u)], unit.offsets):
            leaf.grad = buf[a:a + leaf.numel()].view(leaf.shape)
        self.remaining[(mb, u)] = len(self.leaves[(mb, u)])
        self.reduce_of[(mb, u)] = k

    def _accumulated(self, mb: int, u: int):
        def hook(_leaf: torch.Tensor) -> None:
            self.remaining[(mb, u)] -= 1
            if self.remaining[(mb, u)] == 0:
                for leaf in self.leaves.pop((mb, u)):
                    leaf.grad = None
                self.complete.append((mb, u))

        return hook

    def flush(self, mb: int, below: int) -> None:
        """Submit the reduce-scatters of the units of ``mb`` whose backward is done, in unit
        order, at a point of the program that is the same on every rank (collectives of one
        thread must be issued in the same order everywhere). Units above ``below`` must be done."""
        for u in reversed(range(below + 1, len(self.t.units))):
            if (mb, u) in self.submitted:
                continue
            if (mb, u) not in self.complete:
                raise RuntimeError(f"asynchzp: unit {u} gradients incomplete when unit {below} starts its backward")
            self.submitted.add((mb, u))
            k = self.reduce_of[(mb, u)]
            slot, done, last = k % len(self.t.reduce_slots), self.reduce_done[k], mb == self.last_mb

            def task(u=u, slot=slot, done=done) -> None:
                self.t._reduce(u, slot, self.step)
                done.set()

            future = self.t.rs.submit(task)
            self.reduces.append(future)
            if last:
                def step_end(u: int = u, f: Future = future) -> None:
                    f.result()
                    self.t._step_reduce(u, self.step)

                self.t.pending.append(self.t.dp.submit(step_end))
