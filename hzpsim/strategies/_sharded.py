"""The sharded data-parallel emitter shared by the whole ZeRO family.

Every published "ZeRO-like" scheme is a case of three nested sharding groups inside a
data-parallel group of N ranks (``docs/strategies.md`` §1.4):

    param_size | grad_size | optim_size | N

- parameters (working dtype) are sharded over ``param_size`` ranks and all-gathered there before
  each use, every micro-batch (nothing to gather when ``param_size`` = 1);
- gradients are reduce-scattered over ``grad_size`` ranks every micro-batch (or accumulated in
  a full buffer when ``grad_size`` = 1);
- fp32 master weights and Adam moments are sharded over ``optim_size`` ranks. At the step end,
  per unit: reduce-scatter over the optim_size/grad_size ranks that hold the same gradient
  slice, all-reduce over the N/optim_size replicas, the optimizer on the 1/optim_size shard,
  and an all-gather of the updated working copy over the optim_size/param_size ranks.

DDP is (1, 1, 1), ZeRO-1 (1, 1, N), ZeRO-2 (1, N, N), ZeRO-3 (N, N, N), HSDP/MiCS (g, g, g)
and AsyncHZP's likely setting (g, g, N).

:class:`ShardedParams` is a set of hooks that any compute schedule calls (a flat loop of
micro-batches for ZeRO, a pipeline schedule per stage for ND): it adds the gathers a unit's
forward/backward must wait for, the reductions its gradients need and the step-end optimizer.
It writes the same program for each simulated rank (a "lane"); a collective is one op shared
by the lanes of its group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from hzpsim.model.kernels import packed
from hzpsim.model.ops import HOST_STREAM, MemoryDelta, OpGraph, Ranks, memory_delta
from hzpsim.model.training import Training
from hzpsim.strategies._compression import CompressionPlan
from hzpsim.strategies._implementations import IDEAL, Implementation
from hzpsim.strategies._layers import Work, optimizer_bytes_per_param
from hzpsim.strategies._lengths import Lengths

Ids = dict[int, int]  # lane (simulated rank) -> op id


@dataclass(frozen=True)
class NestedSharding:
    """Group sizes and the data-parallel groups they nest in."""

    param_size: int
    grad_size: int
    optim_size: int
    dp_groups: tuple[Ranks, ...]  # every data-parallel group holding a simulated rank, rank order

    @property
    def dp_size(self) -> int:
        return len(self.dp_groups[0])

    def check(self, keys: Sequence[str] = ("param_group_size", "grad_group_size", "optim_group_size")) -> None:
        """ValueError naming the config key (``keys`` for param, grad, optim) of the first size
        that is not positive or does not nest: each size divides the next and the dp size."""
        sizes = (self.param_size, self.grad_size, self.optim_size, self.dp_size)
        roles = ("parameter", "gradient", "optimizer", "data-parallel")
        for size, key in zip(sizes, keys):
            if size < 1:
                raise ValueError(f"{key}: must be >= 1, got {size}")
        for i in range(3):
            outer = next(j for j in range(i + 1, 4) if j == 3 or keys[j] != keys[i])
            if sizes[outer] % sizes[i]:
                raise ValueError(f"{keys[i]}: {sizes[i]} does not divide the {roles[outer]} group size "
                                 f"{sizes[outer]} (groups must nest)")

    def size(self, role: str, inner: int = 1) -> int:
        """Ranks in a ``role`` group; ``inner`` is the size used by the split/secondary roles."""
        return {
            "param_inner": inner,
            "param_outer": self.param_size // inner,
            "secondary": inner,
            "param": self.param_size,
            "grad": self.grad_size,
            "step_rs": self.optim_size // self.grad_size,
            "step_ag": self.optim_size // self.param_size,
            "replica": self.dp_size // self.optim_size,
        }[role]

    def group_of(self, role: str, rank: int, inner: int = 1) -> tuple[str, Ranks]:
        """(name, members) of the ``role`` group holding ``rank``; arithmetic, no enumeration.

        param / grad: consecutive blocks of the data-parallel group; step_rs: the ranks of one
        optim group holding the same Psi/grad_size slice (same position in their grad groups);
        step_ag: likewise for the Psi/param_size slice; replica: same position in every optim
        group.
        """
        dp_index, position = self._position(rank)
        dp = self.dp_groups[dp_index]
        p, g, o = self.param_size, self.grad_size, self.optim_size
        if role in ("param", "grad", "param_inner", "secondary"):
            size = {"param": p, "grad": g}.get(role, inner)
            start = position - position % size
            members = dp[start : start + size]
        elif role == "param_outer":  # same position in each inner block of one param group
            base = position - position % p
            members = dp[base + position % inner : base + p : inner]
        elif role in ("step_rs", "step_ag"):
            stride = g if role == "step_rs" else p
            base = position - position % o
            members = dp[base + position % stride : base + o : stride]
        elif role == "replica":
            members = dp[position % o :: o]
        else:
            raise AssertionError(role)
        stride = members[1] - members[0] if len(members) > 1 else 0
        return f"{role}.{members[0]}+{stride}x{len(members)}", members if isinstance(members, range) else tuple(members)

    def _position(self, rank: int) -> tuple[int, int]:
        """(index of the data-parallel group holding ``rank``, position of ``rank`` in it)."""
        for i, dp in enumerate(self.dp_groups):
            if isinstance(dp, range) and rank in dp:
                return i, dp.index(rank)
        cached = self.__dict__.get("_position_cache")
        if cached is None:
            cached = {r: (i, j) for i, dp in enumerate(self.dp_groups) if not isinstance(dp, range)
                      for j, r in enumerate(dp)}
            object.__setattr__(self, "_position_cache", cached)
        return cached[rank]


MAX_PREFETCH_DEPTH = 8


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """How collectives are issued. Checks its own fields (``ValueError("<field>: ...")``), so
    every strategy that configures one rejects a bad knob with the knob's name."""

    prefetch_depth: int = 1  # all-gathers issued ahead of use; D+1 gather buffers in a ring
    reshard_after_forward: bool = True  # gather again for the backward
    accumulate_unsharded: bool = False  # gathered once per step, gradients accumulated unsharded, reduced at its end
    overlap_grad_reduce: bool = True  # step-end gradient collectives start as units finish
    overlap_param_gather: bool = True  # next step's forward waits per unit, not for all
    reduce_buffers: int = 2  # gradient buffers awaiting their reduce-scatter; a full ring stalls the backward
    fixed_buffers: bool = False  # gather/scatter buffers pre-allocated once (AsyncHZP) instead of per use
    hierarchical_gather: int = 1  # MiCS: inner (intra-node) size of a two-hop all-gather; 1 = one flat ring
    backward_gather_size: int = 0  # ZeRO++ hpZ: backward gathers from a secondary shard of this size; 0 = off
    forward_gather_bytes_per_element: float = 0.0  # ZeRO++ qwZ: bytes per parameter in forward gathers; 0 = working dtype
    grad_reduce_bytes_per_element: float = 0.0  # ZeRO++ qgZ: bytes per gradient element reduced; 0 = grad dtype
    streams: tuple[tuple[str, str], ...] = (("ag", "ag"), ("rs", "rs"), ("dp", "dp"))
    implementation: Implementation = IDEAL  # how the framework issues the collectives (_implementations)

    @property
    def effective_prefetch_depth(self) -> int:
        """Gathers in flight ahead of use: the knob, capped by what the framework allows."""
        return min(self.prefetch_depth, self.implementation.max_prefetch_depth)

    @property
    def effective_overlap_grad_reduce(self) -> bool:
        forced = self.implementation.grad_reduce_overlap
        return self.overlap_grad_reduce if forced is None else forced

    def __post_init__(self) -> None:
        if not 0 <= self.prefetch_depth <= MAX_PREFETCH_DEPTH:
            raise ValueError(f"prefetch_depth: must be between 0 and {MAX_PREFETCH_DEPTH}, got {self.prefetch_depth}")
        if self.reduce_buffers < 1:
            raise ValueError(f"reduce_buffers: must be >= 1, got {self.reduce_buffers}")
        if self.hierarchical_gather < 1:
            raise ValueError(f"hierarchical_gather: must be >= 1, got {self.hierarchical_gather}")
        if self.accumulate_unsharded and self.reshard_after_forward:
            raise ValueError("reshard_after_forward: parameters kept unsharded across micro-batches are not "
                             "resharded after the forward")
        if self.backward_gather_size < 0:
            raise ValueError(f"hpz_partition_size: must be >= 1, got {self.backward_gather_size}")
        for name in ("forward_gather_bytes_per_element", "grad_reduce_bytes_per_element"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0 bytes per element")

    def per_step(self, micro_batches: int) -> int:
        """How many times a unit gathers its parameters forward and reduce-scatters its gradient
        in a step of ``micro_batches``: once with ``accumulate_unsharded``, else every micro-batch."""
        return 1 if self.accumulate_unsharded else micro_batches

    def stream(self, role: str) -> str:
        return self._stream_of[role]

    @cached_property
    def _stream_of(self) -> dict[str, str]:
        return dict(self.streams)


class Emitter:
    """Creates ops for a set of lanes: one compute op per lane, one collective per group.

    With an implementation that models the host thread, every device op is preceded by a host
    op on the lane's ``host`` stream that launches it (kernel launches, the collective call, the
    list-form views and copies), and a ``sync`` makes that host op wait for device ops first
    (``torch.cuda.synchronize()``, ``stream.synchronize()``)."""

    def __init__(self, graph: OpGraph, lanes: Sequence[int], implementation: Implementation = IDEAL) -> None:
        self.graph = graph
        self.lanes = list(lanes)
        self._lane_set = set(lanes)
        self.implementation = implementation
        self.last_compute: Ids = {}  # the latest device compute op of each lane, in program order
        self.lengths: Lengths | None = None  # variable-length sequences (attach_lengths)
        self.batch: tuple[int, int] | None = None  # (step, micro-batch) whose compute is being emitted
        self._packed: dict[tuple[int, float, float], tuple[tuple, Work]] = {}
        self._launch_s: dict[tuple[float, tuple[tuple[int, int], ...]], float] = {}  # host time of a launch

    def host(self, name: str, seconds: float, step: int, sync: Sequence[Ids | None] = ()) -> Ids | None:
        """A host op per lane taking ``seconds`` after the device ops in ``sync`` ended (None
        when the implementation has no host thread, or there is nothing to wait or pay for)."""
        if not self.implementation.host or (seconds <= 0 and not any(sync)):
            return None
        graph, label, waits = self.graph, f"host.{name}", [d for d in sync if d]
        return {lane: graph.compute(lane, label, "host", (), [d.get(lane) for d in waits], stream=HOST_STREAM,
                                    step=step, duration_s=seconds)
                for lane in self.lanes}

    def groups_for(self, group_of, size: int) -> list[tuple[str, tuple[int, ...]]]:
        """Register the groups (``group_of(lane) -> (name, members)``) holding the lanes."""
        found: dict[str, tuple[int, ...]] = {}
        if size > 1:
            for lane in self.lanes:
                name, members = group_of(lane)
                if name not in found:
                    self.graph.add_group(name, members)
                    found[name] = self.lanes_in(members)
        return list(found.items())

    def lanes_in(self, members: Sequence[int]) -> tuple[int, ...]:
        """The simulated lanes among ``members``, in rank order."""
        if isinstance(members, range) or len(members) > len(self.lanes):
            return tuple(sorted(lane for lane in self.lanes if lane in members))
        return tuple(r for r in members if r in self._lane_set)

    def collective(self, kind: str, instances: list[tuple[str, tuple[int, ...]]], size: float, name: str,
                   category: str, stream: str, deps: Sequence[Ids | None], step: int,
                   alloc: float | MemoryDelta = 0.0, free: float | MemoryDelta = 0.0, count: int = 1,
                   sync: Sequence[Ids | None] = (), launch: bool = True) -> Ids:
        """``count`` calls of ``size`` bytes each, back to back, launched by one host op
        (``launch=False``: the caller charged the call to the host op of the compute it follows).
        ``alloc`` / ``free``: bytes of ``buffers``, or (category, bytes) pairs."""
        if instances and launch:
            group_size = len(self.graph.groups[instances[0][0]])
            seconds = self.implementation.call_host_s(count, group_size)
            if self.implementation.calls_from_comm_threads and self.implementation.host:
                # the stream's own thread pays the call (and waits for ``sync`` first)
                if seconds > 0 or any(sync):
                    deps = [*deps, {lane: self.graph.compute(lane, f"call.{name}", "host", {},
                                                             [*(d[lane] for d in deps if d and lane in d),
                                                              *(d.get(lane) for d in sync if d)],
                                                             stream=stream, step=step, duration_s=seconds)
                                    for lane in self.lanes}]
            else:
                host = self.host(f"call.{name}", seconds, step, sync)
                deps = [*deps, host]
        ids: Ids = {}
        sources = [d for d in deps if d]
        taken = alloc if isinstance(alloc, tuple) else memory_delta({"buffers": alloc}) if alloc else ()
        released = free if isinstance(free, tuple) else memory_delta({"buffers": free}) if free else ()
        for group, participants in instances:
            dep_ids = [d[lane] for d in sources for lane in participants if lane in d]
            op = self.graph.collective(kind, group, participants, size, name, category, stream, dep_ids,
                                       alloc=taken, free=released, step=step, count=count)
            ids.update(dict.fromkeys(participants, op))
        if launch and self.implementation.waits_in_calls:
            # the issuing thread waits in the call until it completed: nothing it launches later,
            # compute or the next call, starts before (the framework's own parameter and gradient
            # calls; a layer's model-parallel calls, launch=False, belong to its compute)
            self.host(f"wait.{name}", 0.0, step, [ids])
        return ids

    def compute(self, name: str, category: str, work: Work, deps: Sequence[Ids | None], step: int,
                alloc: dict[str, float] | MemoryDelta | None = None, free: dict[str, float] | MemoryDelta | None = None,
                kernels: float = 0.0, calls: tuple[tuple[int, int], ...] = ()) -> Ids:
        """One device op per lane, launched by a host op that dispatches ``kernels`` kernels and
        issues the collective ``calls`` ((count, group size) each) that follow it in the unit."""
        impl = self.implementation
        seconds = self._launch_s.get((kernels, calls))
        if seconds is None:
            seconds = impl.launch_s(kernels) + sum(impl.call_host_s(count, size) for count, size in calls)
            self._launch_s[(kernels, calls)] = seconds
        # on a synchronous device the launching thread runs the previous kernel first
        launch = self.host(f"launch.{name}", seconds, step, [self.last_compute] if impl.synchronous else ())
        sources = [d for d in deps if d]
        if launch:
            sources.append(launch)
        graph, flops, shapes, bytes_accessed = self.graph, work.op_flops, work.shapes, work.bytes_accessed
        taken, released = memory_delta(alloc), memory_delta(free)
        if self.lengths is not None and self.batch is not None and (work.attention_forward or work.attention_backward):
            ids = self._varying(name, category, work, sources, step, taken, released)
        else:
            ids = {lane: graph.compute(lane, name, category, flops, [d.get(lane) for d in sources], bytes_accessed,
                                       alloc=taken, free=released, step=step, shapes=shapes)
                   for lane in self.lanes}
        self.last_compute = ids
        return ids


    def _varying(self, name: str, category: str, work: Work, sources: list[Ids], step: int,
                 taken: MemoryDelta, released: MemoryDelta) -> Ids:
        """``compute`` of work with attention under variable-length sequences: each lane's
        attention over its own rank's documents, the op tagged with its micro-batch."""
        assert self.lengths is not None and self.batch is not None
        lengths, (at_step, mb) = self.lengths, self.batch
        batch = at_step * lengths.num_micro_batches + mb
        ids: Ids = {}
        for lane in self.lanes:
            tokens = float(lengths.tokens[at_step, mb, lengths.data_rank[lane]])  # type: ignore[index]
            key = (id(work.shapes), work.bytes_accessed, tokens)
            cached = self._packed.get(key)
            if cached is None or cached[0] is not work.shapes:
                cached = self._packed[key] = (work.shapes, Work.of(packed(work.shapes, lengths.seq_len, tokens),
                                                                   work.bytes_accessed))
            lane_work = cached[1]
            ids[lane] = self.graph.compute(lane, name, category, lane_work.op_flops, [d.get(lane) for d in sources],
                                           lane_work.bytes_accessed, alloc=taken, free=released, step=step,
                                           shapes=lane_work.shapes, batch=batch)
        return ids


Use = tuple[int, int, str, int]  # (step, micro-batch, "fwd" | "bwd", unit) in order of use


class ShardedParams:
    """Parameter gathers, gradient reductions and the optimizer of one set of lanes.

    ``unit_params`` are the parameters of each unit held by one model-parallel rank (already
    divided by tensor/pipeline/expert parallelism); ``uses`` lists, in program order, every
    forward and backward use of a unit by the lanes' compute stream.
    """

    def __init__(self, emit: Emitter, unit_params: Sequence[float], unit_names: Sequence[str],
                 training: Training, sharding: NestedSharding, schedule: Schedule,
                 uses: Sequence[Use], tag: str = "", unit_tensors: Sequence[Sequence[float]] | None = None,
                 compression: CompressionPlan | None = None) -> None:
        self.emit, self.training, self.sharding, self.schedule = emit, training, sharding, schedule
        self.params = list(unit_params)
        # the tensors of each unit (elements): the implementation's collective calls per pass
        impl = schedule.implementation
        tensors = [tuple(t) for t in unit_tensors] if unit_tensors is not None else [(x,) for x in self.params]
        full_recompute = training.activation_recompute == "full"
        self.gather_calls = [impl.gather_calls(t) for t in tensors]
        again = [impl.backward_gathered(t, full_recompute) for t in tensors]
        recompute_gathers = full_recompute and impl.regather_for_recompute
        # the backward's gather(s): the recompute forward's, then what the backward gathers again
        self.backward_gather_calls = [
            (self.gather_calls[u] if recompute_gathers else 0) + impl.gather_calls(again[u])
            for u in range(len(tensors))
        ]
        self.backward_gather_share = [
            ((1.0 if recompute_gathers else 0.0) + sum(again[u]) / max(sum(impl.gathered(tensors[u])), 1e-30))
            if impl.gathered(tensors[u]) else 1.0
            for u in range(len(tensors))
        ]
        self.reduce_calls = [max(impl.reduce_calls(t), 1) for t in tensors]
        self.names = [f"{tag}{n}" for n in unit_names]
        self.tag = tag
        self.param_element_bytes, self.grad_element_bytes = training.param_element_bytes, training.grad_element_bytes
        p, g, o = sharding.param_size, sharding.grad_size, sharding.optim_size
        self.p, self.g, self.o = p, g, o
        self.replicas = sharding.dp_size // o
        self.total = sum(self.params)
        inner = {"param_inner": schedule.hierarchical_gather, "param_outer": schedule.hierarchical_gather,
                 "secondary": schedule.backward_gather_size}
        self.instances = {
            role: emit.groups_for(
                lambda lane, role=role: sharding.group_of(role, lane, inner.get(role, 1)),
                sharding.size(role, inner.get(role, 1)),
            )
            for role in ("param", "grad", "step_rs", "replica", "step_ag", "param_inner", "param_outer", "secondary")
            if role in ("param", "grad", "step_rs", "replica", "step_ag") or inner[role] > 1
        }
        self.gather_element_bytes = {"fwd": schedule.forward_gather_bytes_per_element or self.param_element_bytes, "bwd": self.param_element_bytes}
        self.reduce_element_bytes = schedule.grad_reduce_bytes_per_element or self.grad_element_bytes
        largest = max(self.params, default=0.0)
        # the implementation's layout: DeepSpeed/Megatron keep an fp32 master copy in the
        # optimizer, FSDP2/DTensor keep the fp32 parameter itself (Implementation.master_weights)
        per_param = schedule.implementation.state_bytes_per_param(self.param_element_bytes, self.grad_element_bytes)
        static = {"params": self.total * per_param["params"] / p, "grads": self.total * per_param["grads"] / g,
                  "optimizer": per_param["optimizer"] * self.total / o}
        if schedule.backward_gather_size and p > 1:  # hpZ keeps a secondary (intra-node) shard
            static["params"] += self.total * self.param_element_bytes / schedule.backward_gather_size
        # Gather and gradient buffers: a fixed ring allocated once, or allocated per use. Per
        # use, a gathered unit is allocated by its all-gather on the gather stream and freed by
        # its compute: the caching allocator gives the block back to the gather stream's pool,
        # which the compute stream cannot use (FSDP2's "inter-stream fragmentation"). The
        # allocator replay models those pools from the stream each allocation is made on
        # (sim/allocator.py); nothing is estimated here.
        gather_slots = (schedule.effective_prefetch_depth + 1) * largest * self.param_element_bytes if p > 1 else 0.0
        scatter_slots = schedule.reduce_buffers * largest * self.grad_element_bytes if g > 1 else 0.0
        if schedule.fixed_buffers:
            static["buffers"] = gather_slots + scatter_slots
        self.dynamic_buffers = not schedule.fixed_buffers
        # FSDP2 (Implementation.gather_copy_out): the all-gather's flat output lives on the gather
        # stream until the copy-out before the unit's compute, which allocates the unsharded
        # parameters on the compute stream; those are what the reshard frees
        self.copy_out = impl.gather_copy_out and p > 1 and self.dynamic_buffers
        self.unsharded_category = "params" if self.copy_out else "buffers"
        # FSDP2 (Implementation.reduce_output_on_reduce_stream): each micro-batch's reduce-scatter
        # output, on the reduce-scatter stream while it runs
        self.reduce_output = impl.reduce_output_on_reduce_stream and g > 1 and self.dynamic_buffers
        # gradient compression (_compression.py): the reduction it replaces, its held state
        self.compression = compression
        self.compressed_role = ("grad" if g > 1 else "step_rs" if o > g else "replica" if self.replicas > 1 else "")
        if compression is not None and self.compressed_role:
            static["buffers"] = static.get("buffers", 0.0) + compression.static_bytes()
        else:
            self.compression = None
        self.compress_ids: dict[int, Ids] = {}  # unit -> its compress kernel, awaiting the collective
        self.tails: list[tuple[int, int, Ids]] = []  # (unit, step, first collective) awaiting their tail
        self.tail_ids: list[Ids] = []  # the decompress kernels the step's gradient norm waits for
        for lane in emit.lanes:
            emit.graph.add_static(lane, static)
        # every use needs a gather when parameters are sharded (the backward reuses the
        # forward's gather when they are not resharded after the forward; kept unsharded across
        # micro-batches, the step's first forward gathers for all)
        self.accumulate = schedule.accumulate_unsharded
        self.pending: dict[int, Ids] = {}  # accumulating: each unit's last backward, awaiting its reduction
        self.gathers: list[Use] = []
        if p > 1:
            self.gathers = [
                use for use in uses
                if self.params[use[3]] > 0 and self._gathers(use)
            ]
        self.gather_index = {use: i for i, use in enumerate(self.gathers)}
        self.gather_ids: list[Ids | None] = [None] * len(self.gathers)
        self.consumer_ids: list[Ids | None] = [None] * len(self.gathers)
        self.next_gather = 0
        self.scatters: list[Ids] = []
        self.params_ready: dict[int, Ids] = {}
        self.final_grads: dict[int, Ids] = {}
        self.optimized_steps = 0
        self.losses: dict[tuple[int, int], Ids] = {}  # (step, micro-batch) -> the loss's backward

    # ------------------------------------------------------------------ gathers

    def _gathers(self, use: Use) -> bool:
        """Whether ``use`` (of a unit with sharded parameters) gathers them."""
        _, mb, phase, _ = use
        if self.accumulate:
            return phase == "fwd" and mb == 0
        return phase == "fwd" or self.schedule.reshard_after_forward

    def _issue_gathers(self) -> None:
        depth = self.schedule.effective_prefetch_depth
        while self.next_gather < len(self.gathers):
            index = self.next_gather
            step, mb, phase, u = self.gathers[index]
            if step > self.optimized_steps:
                return  # next step's gathers wait for this step's optimizer
            slot = index - depth - 1
            if slot >= 0 and self.consumer_ids[slot] is None:
                return
            deps = [self.consumer_ids[slot] if slot >= 0 else None, self.params_ready.get(u)]
            if (phase == "bwd" and self.schedule.implementation.gather_after_loss and index
                    and self.gathers[index - 1][2] == "fwd"):
                # the backward's first gather: its unit's pre-backward hook runs only once autograd
                # has gone through the loss, or received the next pipeline stage's gradient
                # (FSDP: hooks on the unit's outputs)
                loss = self.losses.get((step, mb))
                if loss is None:
                    return
                deps.append(loss)
            self.gather_ids[index] = self._gather(u, phase, f"{self.names[u]}.mb{mb}", deps, step)
            self.next_gather += 1

    def _gather(self, u: int, phase: str, label: str, deps: list[Ids | None], step: int) -> Ids:
        """All-gather one unit: flat, two-hop (MiCS) or from the secondary shard (hpZ bwd), in
        as many calls as the implementation issues (``count``; each call 1/count of the bytes).
        The backward's gather also carries the recompute forward's re-gathers (DeepSpeed)."""
        schedule, stream = self.schedule, self.schedule.stream("ag")
        calls = self.gather_calls[u] if phase == "fwd" else self.backward_gather_calls[u]
        share = 1.0 if phase == "fwd" else self.backward_gather_share[u]
        size = self.params[u] * self.gather_element_bytes[phase] * share / max(calls, 1)
        count = max(calls, 1)
        buffer = self.params[u] * self.param_element_bytes if self.dynamic_buffers else 0.0
        sync = [self.emit.last_compute] if schedule.implementation.sync_before_gather else []
        if phase == "bwd" and schedule.backward_gather_size:
            return self.emit.collective("all_gather", self.instances["secondary"], size, f"ag.bwd.{label}",
                                        "param_gather", stream, deps, step, alloc=buffer, count=count, sync=sync)
        if schedule.hierarchical_gather > 1:
            inner = schedule.hierarchical_gather
            outer = self.emit.collective("all_gather", self.instances["param_outer"], size / inner,
                                         f"ag.{phase}.outer.{label}", "param_gather", stream, deps, step,
                                         alloc=buffer, count=count, sync=sync)
            return self.emit.collective("all_gather", self.instances["param_inner"], size,
                                        f"ag.{phase}.inner.{label}", "param_gather", stream, [outer], step,
                                        count=count)
        return self.emit.collective("all_gather", self.instances["param"], size, f"ag.{phase}.{label}",
                                    "param_gather", stream, deps, step, alloc=buffer, count=count, sync=sync)

    def copy_bytes(self, u: int, phase: str, mb: int) -> float:
        """HBM bytes of the device copies around unit ``u``'s gather (read + write), 0 when the
        implementation makes none or nothing is gathered."""
        factor = self.schedule.implementation.copy_bytes_per_gathered_byte
        if not factor or self.p == 1 or not self.params[u] or not self._gathers((0, mb, phase, u)):
            return 0.0
        return 2.0 * factor * self.params[u] * self.param_element_bytes

    def copy_out_bytes(self, u: int, phase: str, mb: int) -> float:
        """Bytes of unit ``u``'s unsharded parameters that the copy-out before its ``phase`` of
        micro-batch ``mb`` allocates on the compute stream, freeing the all-gather's flat output
        of the same size (:attr:`Implementation.gather_copy_out`); 0 when there is none."""
        if not self.copy_out or not self.params[u] or not self._gathers((0, mb, phase, u)):
            return 0.0
        return self.params[u] * self.param_element_bytes

    def _gather_for(self, use: Use) -> Ids | None:
        step, mb, phase, u = use
        if self.p == 1 or self.params[u] == 0:
            return self.params_ready.get(u) if mb == 0 and phase == "fwd" else None
        if self.accumulate:
            use = (step, 0, "fwd", u)
        elif phase == "bwd" and not self.schedule.reshard_after_forward:
            use = (step, mb, "fwd", u)
        self._issue_gathers()
        return self.gather_ids[self.gather_index[use]]

    def forward_deps(self, step: int, mb: int, u: int) -> list[Ids | None]:
        return [self._gather_for((step, mb, "fwd", u))]

    def forward_free(self, u: int) -> dict[str, float]:
        """Gathered bytes the forward of ``u`` frees when it ends, by category (the gather
        buffer, or with a copy-out the unsharded parameters)."""
        if self.dynamic_buffers and self.p > 1 and self.params[u] and self.schedule.reshard_after_forward:
            return {self.unsharded_category: self.params[u] * self.param_element_bytes}
        return {}

    def forward_done(self, step: int, mb: int, u: int, ids: Ids) -> None:
        if self.p > 1 and self.params[u]:
            index = self.gather_index.get((step, mb, "fwd", u))
            if index is not None:
                self.consumer_ids[index] = ids
            self._issue_gathers()

    # ------------------------------------------------------------------ gradients

    def loss_done(self, step: int, mb: int, ids: Ids) -> None:
        """The backward pass of micro-batch ``mb`` starts after ``ids``: the loss's backward, or
        the gradient a pipeline stage receives (the first call counts; the gathers that wait
        for it go)."""
        if (step, mb) not in self.losses:
            self.losses[(step, mb)] = ids
            self._issue_gathers()

    def backward_deps(self, step: int, mb: int, u: int) -> list[Ids | None]:
        deps = [self._gather_for((step, mb, "bwd", u))]
        slots = self.schedule.reduce_buffers
        if self.g > 1 and self.params[u] and len(self.scatters) >= slots and not self.accumulate:
            deps.append(self.scatters[-slots])  # wait for a free gradient buffer
        return deps

    def backward_alloc(self, u: int) -> float:
        """Full-unit gradient buffer bytes taken by the backward of ``u``: until its reduce, or,
        accumulating, the micro-batch's gradient in the parameter dtype that is added into the
        accumulator (:meth:`accumulator_bytes`) as the backward ends."""
        if self.g == 1 or not self.dynamic_buffers:
            return 0.0
        return self.params[u] * (self.param_element_bytes if self.accumulate else self.grad_element_bytes)

    def accumulator_bytes(self, u: int) -> float:
        """Accumulating: the unsharded gradient in the reduce dtype that the step's first backward
        of ``u`` takes and its step-end reduce-scatter frees (0 otherwise)."""
        return self.params[u] * self.grad_element_bytes if self.accumulate and self.g > 1 else 0.0

    def backward_free(self, u: int) -> dict[str, float]:
        """Bytes the backward of ``u`` frees when it ends, by category: the gathered unit (the
        gather buffer, or with a copy-out the unsharded parameters); accumulating, the
        micro-batch's gradient (the gathered parameters stay until the step-end reduction)."""
        if self.accumulate:
            return {"buffers": self.backward_alloc(u)}
        if self.p > 1 and self.dynamic_buffers and self.params[u]:
            return {self.unsharded_category: self.params[u] * self.param_element_bytes}
        return {}

    def backward_done(self, step: int, mb: int, u: int, ids: Ids, last_mb: bool) -> None:
        if self.p > 1 and self.params[u] and self.schedule.reshard_after_forward:
            self.consumer_ids[self.gather_index[(step, mb, "bwd", u)]] = ids
        if self.p > 1 and self.params[u]:
            self._issue_gathers()
        if self.accumulate:
            if last_mb and self.params[u]:
                self.pending[u] = ids
            return
        done = ids
        compressing = self.compression is not None and self.compression.units[u] is not None and bool(self.params[u])
        if compressing and (self.g > 1 or last_mb):
            done = self._compress(u, step, ids)
        if compressing and self.g > 1:
            done = self._compressed_reduce(u, "grad", self.schedule.stream("rs"), [done], step,
                                           f"{self.names[u]}.mb{mb}", free=self.backward_alloc(u))
            self.scatters.append(done)
        elif self.g > 1 and self.params[u]:
            calls = self.reduce_calls[u]
            sync = self.scatters[-1:] if self.schedule.implementation.sync_after_reduce else []
            taken: float | MemoryDelta = 0.0
            freed: float | MemoryDelta = self.backward_alloc(u)
            if self.reduce_output:  # its output, on the reduce-scatter stream while it runs
                output = ("grads", self.params[u] / self.g * self.reduce_element_bytes)
                taken, freed = (output,), (*memory_delta({"buffers": self.backward_alloc(u)}), output)
            done = self.emit.collective(
                "reduce_scatter", self.instances["grad"], self.params[u] * self.reduce_element_bytes / calls,
                f"rs.{self.names[u]}.mb{mb}", "grad_reduce", self.schedule.stream("rs"), [ids], step,
                alloc=taken, free=freed, count=calls, sync=sync,
            )
            self.scatters.append(done)
        if last_mb:
            self.final_grads[u] = done
        if self.compression is not None and self.g > 1 and u == 0:
            self.tail_ids += self._flush(step)  # the micro-batch's backward ended: its decompressions

    def reduce_step(self, step: int, end_of_backward: Ids) -> list[Ids]:
        """Step-end reductions per unit (overlapping the backward unless told otherwise)."""
        wait = None if self.schedule.effective_overlap_grad_reduce else end_of_backward
        reduced: list[Ids] = []
        stream = self.schedule.stream("dp")
        # accumulated unsharded: every unit's reduce-scatter after the stage's last backward
        # (torch.distributed.pipelining's perform_reduce_grad), freeing the accumulator and the
        # gathered parameters
        for u in sorted(self.pending, reverse=True):
            gathered = self.params[u] * self.param_element_bytes if self.p > 1 and self.dynamic_buffers else 0.0
            freed: float | MemoryDelta = self.accumulator_bytes(u) + gathered
            if self.copy_out:  # the unsharded parameters the copy-out allocated
                freed = memory_delta({"buffers": self.accumulator_bytes(u)}) + memory_delta({"params": gathered})
            calls = self.reduce_calls[u]
            self.final_grads[u] = self.emit.collective(
                "reduce_scatter", self.instances["grad"], self.params[u] * self.reduce_element_bytes / calls,
                f"rs.{self.names[u]}", "grad_reduce", self.schedule.stream("rs"), [self.pending[u], end_of_backward],
                step, free=freed, count=calls,
            ) if self.g > 1 else self.pending[u]
        self.pending = {}
        if self.schedule.implementation.whole_buffer_step_reduce and self.o == self.g and self.replicas > 1:
            # one all-reduce of the whole contiguous gradient buffer after the backward
            units = [u for u in sorted(self.final_grads, reverse=True) if self.params[u]]
            total = sum(self.params[u] for u in units)
            done = self.emit.collective(
                "all_reduce", self.instances["replica"], total / self.o * self.grad_element_bytes,
                f"ar.{self.tag}buffer", "grad_reduce", stream, [*(self.final_grads[u] for u in units), wait], step,
            )
            self.final_grads = {}
            return [done]
        for u in sorted(self.final_grads, reverse=True):
            done = self.final_grads[u]
            calls = self.reduce_calls[u]
            compressing = self.compression is not None and self.compression.units[u] is not None
            if self.params[u] and compressing and self.compressed_role in ("step_rs", "replica"):
                done = self._compressed_reduce(u, self.compressed_role, stream, [done, wait], step, self.names[u])
            elif self.params[u] and self.o > self.g:
                done = self.emit.collective(
                    "reduce_scatter", self.instances["step_rs"],
                    self.params[u] / self.g * self.grad_element_bytes / calls,
                    f"rs_step.{self.names[u]}", "grad_reduce", stream, [done, wait], step, count=calls,
                )
            if self.params[u] and self.replicas > 1 and not (compressing and self.compressed_role == "replica"):
                done = self.emit.collective(
                    "all_reduce", self.instances["replica"], self.params[u] / self.o * self.grad_element_bytes / calls,
                    f"ar.{self.names[u]}", "grad_reduce", stream, [done, wait], step, count=calls,
                )
            reduced.append(done)
        self.final_grads = {}
        if self.compression is not None:
            reduced += self._flush(step) + self.tail_ids
            self.tail_ids = []
        return reduced

    # ------------------------------------------------------------------ gradient compression

    def _compress(self, u: int, step: int, after: Ids) -> Ids:
        """The compress kernel of unit ``u`` right after its backward (compute stream), taking
        the buffers that live until its decompression."""
        assert self.compression is not None
        unit = self.compression.units[u]
        assert unit is not None
        group = self.sharding.size(self.compressed_role)
        held = unit.transient_bytes(group)
        return self.emit.compute(f"compress.{self.names[u]}", "backward", unit.compress_work(), [after], step,
                                 alloc={"buffers": held}, kernels=unit.kernels("compress"))

    def _compressed_reduce(self, u: int, role: str, stream: str, deps: Sequence[Ids | None], step: int,
                           label: str, free: float = 0.0) -> Ids:
        """The method's first collective in place of the unit's reduction over ``role``; the
        rest (PowerSGD's second all-reduce, the decompress kernels) waits in :attr:`tails`."""
        assert self.compression is not None
        unit = self.compression.units[u]
        assert unit is not None
        calls, group = self.reduce_calls[u], self.sharding.size(role)
        instances = self.instances[role]
        if unit.method == "quantize":
            kind = "all_reduce" if role == "replica" else "reduce_scatter"
            size = unit.payload_bytes
        elif unit.method == "topk":  # every rank's (value, index) pairs to every rank
            kind, size = "all_gather", group * unit.payload_bytes
        else:
            kind, size = "all_reduce", unit.p_bytes
        # quantize and topk: the cast copy and the pairs are let go as the collective ends (the
        # hooks decompress in the collective's callback; here the decompress kernel runs after
        # the backward, and holding them until then would overstate the peak)
        if unit.method != "powersgd":
            free += unit.transient_bytes(group)
        first = self.emit.collective(kind, instances, size / calls, f"{unit.method}.{kind}.{label}", "grad_reduce",
                                     stream, deps, step, free=free, count=calls)
        self.tails.append((u, step, first))
        return first

    def _flush(self, step: int) -> list[Ids]:
        """The waiting units' tails, after the backward on the compute stream: PowerSGD's
        orthogonalisation and Q = Mᵀ P, then its Q all-reduces, then every decompress kernel."""
        assert self.compression is not None
        pending, self.tails = self.tails, []
        last: dict[int, Ids] = {}
        for u, s, first in pending:
            last[u] = first
            unit = self.compression.units[u]
            assert unit is not None
            if unit.method == "powersgd":
                last[u] = self.emit.compute(f"powersgd.q.{self.names[u]}", "backward", unit.middle_work(), [first], s,
                                            kernels=unit.kernels("middle"))
        role = self.compressed_role
        stream = self.schedule.stream("rs" if role == "grad" else "dp")
        for u, s, _ in pending:
            unit = self.compression.units[u]
            assert unit is not None
            if unit.method == "powersgd":
                calls = self.reduce_calls[u]
                last[u] = self.emit.collective("all_reduce", self.instances[role], unit.q_bytes / calls,
                                               f"powersgd.all_reduce_q.{self.names[u]}", "grad_reduce", stream,
                                               [last[u]], s, count=calls)
        out = []
        group = self.sharding.size(role)
        # a reduce-scatter's (ZeRO) result is the rank's 1/N shard: quantize and topk decompress only
        # that; PowerSGD rebuilds the whole matrix (its error feedback needs it)
        fraction = 1.0 / group if role != "replica" else 1.0
        for u, s, _ in pending:
            unit = self.compression.units[u]
            assert unit is not None
            out.append(self.emit.compute(f"decompress.{self.names[u]}", "backward",
                                         unit.decompress_work(group, fraction),
                                         [last[u]], s,
                                         free={"buffers": unit.transient_bytes(group)} if unit.method == "powersgd" else None,
                                         kernels=unit.kernels("decompress")))
        return out

    def optimize(self, step: int, deps: Sequence[Ids | None]) -> Ids:
        """The optimizer on this lane set's shard, then the step-end parameter all-gathers."""
        work = Work(bytes_accessed=self.total / self.o * optimizer_bytes_per_param(self.training))
        # the step's own temporaries (foreach Adam's denominators: Implementation.optimizer_temp_bytes_per_param)
        # one tensor per parameter in PyTorch: here one per unit, each its own allocator block
        per = self.schedule.implementation.optimizer_temp_bytes_per_param / self.o
        held = tuple(("temporaries", n * per) for n in self.params if n * per) if per else ()
        optimizer = self.emit.compute(f"optimizer{self.tag}", "optimizer", work, deps, step, alloc=held, free=held)
        self.params_ready = {}
        gathered: list[Ids] = []
        for u, name in enumerate(self.names):
            if self.params[u] and self.o > self.p:
                calls = self.reduce_calls[u]  # the parameter buffer has the gradient buffer's buckets
                gathered.append(self.emit.collective(
                    "all_gather", self.instances["step_ag"], self.params[u] / self.p * self.param_element_bytes / calls,
                    f"ag_step.{name}", "param_gather", self.schedule.stream("dp"), [optimizer], step, count=calls,
                ))
                self.params_ready[u] = gathered[-1]
            else:
                self.params_ready[u] = optimizer
        if gathered and not self.schedule.overlap_param_gather:
            self.params_ready = {u: gathered[-1] for u in self.params_ready}
        self.optimized_steps = step + 1
        self._issue_gathers()
        return optimizer


def world_instances(emit: Emitter, world: Sequence[int]) -> list[tuple[str, tuple[int, ...]]]:
    return [(emit.graph.add_group("world", world), tuple(emit.lanes))]


def grad_norm(emit: Emitter, world: Sequence[int], deps: Sequence[Ids | None], step: int) -> Ids:
    """Global gradient-norm all-reduce (one fp32 scalar over every rank) before clipping."""
    return emit.collective("all_reduce", world_instances(emit, world), 4.0, "grad_norm", "grad_norm",
                           "compute", deps, step)


def flat_uses(num_steps: int, num_micro_batches: int, num_units: int) -> list[Use]:
    """Unit uses of a plain data-parallel loop: forward in order, backward in reverse."""
    uses: list[Use] = []
    for step in range(num_steps):
        for mb in range(num_micro_batches):
            uses += [(step, mb, "fwd", u) for u in range(num_units)]
            uses += [(step, mb, "bwd", u) for u in reversed(range(num_units))]
    return uses
