"""The sharded data-parallel emitter shared by the whole ZeRO family.

Every published "ZeRO-like" scheme is a case of three nested sharding groups inside a
data-parallel group of N ranks (``data/strategies.md`` §1.4):

    param_size | grad_size | optim_size | N

- parameters (working dtype) are sharded over ``param_size`` ranks and all-gathered there before
  each use, every micro-batch (nothing to gather when ``param_size`` = 1);
- gradients are reduce-scattered over ``grad_size`` ranks every micro-batch (or accumulated in
  a full buffer when ``grad_size`` = 1);
- fp32 master weights and Adam moments are sharded over ``optim_size`` ranks. At the step end,
  per unit: reduce-scatter over the optim_size/grad_size ranks that hold the same gradient
  slice, all-reduce over the N/optim_size replicas, the optimizer on the 1/optim_size shard,
  and an all-gather of the updated working copy over the optim_size/param_size ranks.

ZeRO-1 is (1, 1, N), ZeRO-2 (1, N, N), ZeRO-3 (N, N, N), HSDP/MiCS (g, g, g) and AsyncHZP's
likely setting (g, g, N). The emitter writes the same program for each simulated rank (a
"lane"); a collective is one op shared by the lanes of its group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hzpsim.ops import OpGraph
from hzpsim.strategies._layers import Unit, optimizer_bytes_per_param
from hzpsim.training import Training

Ids = dict[int, int]  # lane (simulated rank) -> op id


@dataclass(frozen=True)
class NestedSharding:
    """Group sizes and the data-parallel groups they nest in."""

    param_size: int
    grad_size: int
    optim_size: int
    dp_groups: tuple[tuple[int, ...], ...]  # every data-parallel group of the cluster, rank order

    @property
    def dp_size(self) -> int:
        return len(self.dp_groups[0])

    def check(self) -> None:
        n = self.dp_size
        sizes = (self.param_size, self.grad_size, self.optim_size, n)
        names = ("param_group_size", "grad_group_size", "optim_group_size", "data-parallel size")
        for size, name in zip(sizes, names):
            if size < 1:
                raise ValueError(f"{name}: must be >= 1, got {size}")
        for (a, an), (b, bn) in zip(zip(sizes, names), zip(sizes[1:], names[1:])):
            if b % a:
                raise ValueError(f"{an}: {a} does not divide {bn} {b} (groups must nest)")

    def size(self, role: str) -> int:
        return {
            "param": self.param_size,
            "grad": self.grad_size,
            "step_rs": self.optim_size // self.grad_size,
            "step_ag": self.optim_size // self.param_size,
            "replica": self.dp_size // self.optim_size,
        }[role]

    def group_of(self, role: str, rank: int) -> tuple[str, tuple[int, ...]]:
        """(name, members) of the ``role`` group holding ``rank``; arithmetic, no enumeration.

        param / grad: consecutive blocks of the data-parallel group; step_rs: the ranks of one
        optim group holding the same Psi/grad_size slice (same position in their grad groups);
        step_ag: likewise for the Psi/param_size slice; replica: same position in every optim
        group.
        """
        dp_index, position = self._position[rank]
        dp = self.dp_groups[dp_index]
        p, g, o = self.param_size, self.grad_size, self.optim_size
        if role in ("param", "grad"):
            size = p if role == "param" else g
            start = position - position % size
            members = dp[start : start + size]
        elif role in ("step_rs", "step_ag"):
            stride = g if role == "step_rs" else p
            base = position - position % o
            members = dp[base + position % stride : base + o : stride]
        elif role == "replica":
            members = dp[position % o :: o]
        else:
            raise AssertionError(role)
        return f"dp{dp_index}.{role}.{dp.index(members[0])}", tuple(members)

    @property
    def _position(self) -> dict[int, tuple[int, int]]:
        cached = self.__dict__.get("_position_cache")
        if cached is None:
            cached = {r: (i, j) for i, dp in enumerate(self.dp_groups) for j, r in enumerate(dp)}
            object.__setattr__(self, "_position_cache", cached)
        return cached


@dataclass(frozen=True)
class Schedule:
    """How collectives are issued."""

    prefetch_depth: int = 1  # all-gathers issued ahead of use; D+1 gather buffers in a ring
    reshard_after_forward: bool = True  # gather again for the backward
    overlap_grad_reduce: bool = True  # step-end gradient collectives start as units finish
    overlap_param_gather: bool = True  # next step's forward waits per unit, not for all
    reduce_buffers: int = 2  # gradient buffers awaiting their reduce-scatter; a full ring stalls the backward
    streams: tuple[tuple[str, str], ...] = (("ag", "ag"), ("rs", "rs"), ("dp", "dp"))

    def stream(self, role: str) -> str:
        return dict(self.streams)[role]


class _Groups:
    """Collective group instances for the simulated lanes, registered in the graph."""

    def __init__(self, graph: OpGraph, sharding: NestedSharding, lanes: Sequence[int]) -> None:
        self.graph = graph
        self.instances: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        lane_set = set(lanes)
        for role in ("param", "grad", "step_rs", "replica", "step_ag"):
            found: dict[str, tuple[int, ...]] = {}
            if sharding.size(role) > 1:
                for lane in lanes:
                    name, members = sharding.group_of(role, lane)
                    if name not in found:
                        graph.add_group(name, members)
                        found[name] = tuple(r for r in members if r in lane_set)
            self.instances[role] = list(found.items())
        world = sorted(r for dp in sharding.dp_groups for r in dp)
        self.instances["world"] = [(graph.add_group("world", world), tuple(lanes))]


def emit_sharded_training(
    graph: OpGraph,
    lanes: Sequence[int],
    units: Sequence[Unit],
    training: Training,
    sharding: NestedSharding,
    schedule: Schedule,
    num_micro_batches: int,
    param_divisor: int = 1,
) -> None:
    """Emit ``training.num_steps`` optimizer steps of ``num_micro_batches`` each, for ``lanes``.

    ``param_divisor`` divides each unit's parameters (tensor/pipeline model parallelism has
    already split them; the sharding groups then shard what is left).
    """
    groups = _Groups(graph, sharding, lanes)
    bw, bg = training.param_bytes, training.grad_bytes
    p, g, o = sharding.param_size, sharding.grad_size, sharding.optim_size
    replicas = sharding.dp_size // o
    params = [u.num_params / param_divisor for u in units]
    total_params = sum(params)

    for lane in lanes:
        graph.add_static(
            lane,
            {"params": total_params * bw / p, "grads": total_params * bg / g, "optimizer": 12.0 * total_params / o},
        )

    def collective(kind: str, role: str, size: float, name: str, category: str, stream: str,
                   deps: Sequence[Ids | None], step: int, alloc: float = 0.0, free: float = 0.0) -> Ids:
        ids: Ids = {}
        for group, participants in groups.instances[role]:
            dep_ids = [d[lane] for d in deps if d for lane in participants if lane in d]
            op = graph.collective(
                kind, group, participants, size, name, category, stream, dep_ids,
                alloc={"buffers": alloc} if alloc else None,
                free={"buffers": free} if free else None,
                step=step,
            )
            ids.update({lane: op for lane in participants})
        return ids

    def compute(name: str, category: str, work, deps: Sequence[Ids | None], step: int,
                alloc: dict[str, float] | None = None, free: dict[str, float] | None = None) -> Ids:
        return {
            lane: graph.compute(
                lane, name, category, work.flops(), [d.get(lane) for d in deps if d],
                bytes_accessed=work.bytes_accessed, alloc=alloc, free=free, step=step,
            )
            for lane in lanes
        }

    # The sequence of parameter gathers of the whole run, in order of use.
    gathers: list[tuple[int, int, str, int]] = []  # (step, micro-batch, phase, unit)
    if p > 1:
        for step in range(training.num_steps):
            for mb in range(num_micro_batches):
                gathers += [(step, mb, "fwd", u) for u in range(len(units))]
                if schedule.reshard_after_forward:
                    gathers += [(step, mb, "bwd", u) for u in reversed(range(len(units)))]
    gather_ids: list[Ids | None] = [None] * len(gathers)
    consumer_ids: list[Ids | None] = [None] * len(gathers)
    next_gather = [0]
    scatters: list[Ids] = []  # per-micro-batch reduce-scatters in issue order (buffer ring)
    params_ready: dict[int, Ids] = {}  # unit -> op after which this step's parameters are current
    depth = schedule.prefetch_depth

    def issue_gathers(current_step: int) -> None:
        """Issue every gather whose buffer slot is free (or will be freed by an emitted op)."""
        while next_gather[0] < len(gathers):
            index = next_gather[0]
            step, mb, phase, u = gathers[index]
            if step > current_step:
                return  # the next step's gathers wait for this step's optimizer
            slot = index - depth - 1
            if slot >= 0 and consumer_ids[slot] is None:
                return
            deps = [consumer_ids[slot] if slot >= 0 else None, params_ready.get(u)]
            size = params[u] * bw
            gather_ids[index] = collective(
                "all_gather", "param", size, f"ag.{phase}.{units[u].name}.mb{mb}", "param_gather",
                schedule.stream("ag"), deps, step, alloc=size,
            )
            next_gather[0] += 1

    gather_index = {key: i for i, key in enumerate(gathers)}

    for step in range(training.num_steps):
        issue_gathers(step)
        final_grads: dict[int, Ids] = {}
        last_compute: Ids | None = None
        for mb in range(num_micro_batches):
            last_mb = mb == num_micro_batches - 1
            # ---------------------------------------------------------- forward
            for u, unit in enumerate(units):
                deps: list[Ids | None] = []
                free_after = 0.0
                key = (step, mb, "fwd", u)
                if p > 1:
                    deps.append(gather_ids[gather_index[key]])
                    free_after = params[u] * bw if schedule.reshard_after_forward else 0.0
                elif u in params_ready and mb == 0:
                    deps.append(params_ready[u])
                fwd = compute(
                    f"fwd.{unit.name}.mb{mb}", "forward", unit.forward, deps, step,
                    alloc={"activations": unit.activation_bytes},
                    free={"buffers": free_after} if free_after else None,
                )
                last_compute = fwd
                if p > 1:
                    consumer_ids[gather_index[key]] = fwd
                    issue_gathers(step)
            # ---------------------------------------------------------- backward
            for u in reversed(range(len(units))):
                unit = units[u]
                deps = []
                if p > 1:
                    phase = "bwd" if schedule.reshard_after_forward else "fwd"
                    deps.append(gather_ids[gather_index[(step, mb, phase, u)]])
                if unit.recompute.gemm or unit.recompute.attention_forward or unit.recompute.bytes_accessed:
                    recompute_op = compute(
                        f"recompute.{unit.name}.mb{mb}", "recompute", unit.recompute, deps, step,
                        alloc={"activations": unit.recompute_bytes} if unit.recompute_bytes else None,
                    )
                    deps = [recompute_op]
                grad_buffer = params[u] * bg if g > 1 else 0.0
                if grad_buffer and len(scatters) >= schedule.reduce_buffers:
                    deps.append(scatters[-schedule.reduce_buffers])  # wait for a free buffer
                alloc = {"buffers": grad_buffer} if grad_buffer else None
                free = {"activations": unit.activation_bytes + unit.recompute_bytes}
                if p > 1:
                    free["buffers"] = params[u] * bw
                bwd = compute(f"bwd.{unit.name}.mb{mb}", "backward", unit.backward, deps, step,
                              alloc=alloc, free=free)
                last_compute = bwd
                if p > 1 and schedule.reshard_after_forward:
                    consumer_ids[gather_index[(step, mb, "bwd", u)]] = bwd
                    issue_gathers(step)
                elif p > 1:
                    issue_gathers(step)
                grad_done = bwd
                if g > 1:
                    grad_done = collective(
                        "reduce_scatter", "grad", params[u] * bg, f"rs.{unit.name}.mb{mb}",
                        "grad_reduce", schedule.stream("rs"), [bwd], step, free=grad_buffer,
                    )
                    scatters.append(grad_done)
                if last_mb:
                    final_grads[u] = grad_done
        # -------------------------------------------------------------- step end
        assert last_compute is not None
        end_of_backward = None if schedule.overlap_grad_reduce else last_compute
        reduced: list[Ids] = []
        for u in reversed(range(len(units))):
            done = final_grads[u]
            if o > g:
                done = collective(
                    "reduce_scatter", "step_rs", params[u] / g * bg, f"rs_step.{units[u].name}",
                    "grad_reduce", schedule.stream("dp"), [done, end_of_backward], step,
                )
            if replicas > 1:
                done = collective(
                    "all_reduce", "replica", params[u] / o * bg, f"ar.{units[u].name}",
                    "grad_reduce", schedule.stream("dp"), [done, end_of_backward], step,
                )
            reduced.append(done)
        norm = collective("all_reduce", "world", 4.0, "grad_norm", "grad_norm", "compute",
                          reduced + [last_compute], step)
        optimizer = compute(
            "optimizer", "optimizer", _optimizer_work(total_params / o, training), [norm], step,
        )
        params_ready.clear()
        gathered: list[Ids] = []
        for u, unit in enumerate(units):
            if o > p:
                ready = collective(
                    "all_gather", "step_ag", params[u] / p * bw, f"ag_step.{unit.name}",
                    "param_gather", schedule.stream("dp"), [optimizer], step,
                )
                gathered.append(ready)
                params_ready[u] = ready
            else:
                params_ready[u] = optimizer
        if gathered and not schedule.overlap_param_gather:
            for u in params_ready:
                params_ready[u] = gathered[-1]


def _optimizer_work(shard_params: float, training: Training):
    from hzpsim.strategies._layers import Work

    return Work(bytes_accessed=shard_params * optimizer_bytes_per_param(training))
