"""OpGraph: what every simulated device does in one training run, as a DAG of Ops.

Strategies build OpGraphs; the engine replays them without knowing which strategy made them.

- A **compute** op runs on one rank's stream and carries FLOPs by efficiency class
  (``gemm``, ``attention``, ...) plus the bytes it moves through device memory (roofline),
  plus an optional fixed ``duration_s``. Host work (the CPU thread that launches kernels and
  collectives, and waits in synchronisations) is ordinary compute ops with a fixed duration on
  a ``host`` stream; a device op that depends on its launch cannot start before it.
- A **collective** op is ONE node spanning its group: ``group`` names the full set of real ranks
  whose placement sets the cost; ``ranks`` are the simulated participants that must all reach
  it (the rendezvous). Under symmetry a 1,024-rank all-gather may have a single participant.
- ``deps`` are data dependencies; ops on the same (rank, stream) also run in the order they were
  added (one op in flight per stream, as in ASTRA-sim).
- ``alloc`` is memory taken on each participating rank when the op starts and ``free`` memory
  returned when it ends, by category (params, grads, optimizer, activations, buffers, other).

- ``step`` numbers the optimizer step an op belongs to. **Step boundary contract:** every step
  holds at least one compute op of category ``"optimizer"`` (``STEP_END_CATEGORY``); a step ends
  when its last such op ends, and the report measures step time between those ends.
  The engine needs no steps; the report (``report.step_boundaries``) enforces it.
- A ``send_recv`` op is issued on its sender only (``ranks`` = the sender, ``group`` = sender
  and receiver); every other collective's participants all send (``Op.senders``).

Sizes follow the NCCL-tests convention: ``size_bytes`` is the full buffer of an all-gather /
reduce-scatter (count x ranks x dtype), the per-rank buffer of an all-reduce or all-to-all, and
the message of a send/recv.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hzpsim.model.kernels import Shape, from_plain, to_plain

COMPUTE = "compute"
COLLECTIVE = "collective"

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries", "buffers", "other")
"""Memory by category. ``temporaries``: eager tensors that live only while one op runs (the
loss's fp32 logits and their gradients, a pass's intermediates that are not saved for the
backward), allocated when the op starts and freed when it ends."""
STEP_END_CATEGORY = "optimizer"  # the op category that closes an optimizer step (see above)
HOST_STREAM = "host"  # the stream of host-thread work (launches, list-form views, synchronisations)
COMPUTE_STREAM = "compute"  # a lane's default stream: its device compute, and the model states' allocations

MemoryDelta = tuple[tuple[str, float], ...]  # an Op's alloc / free: (category, bytes) pairs
FlopsByClass = tuple[tuple[str, float], ...]  # an Op's flops: (efficiency class, FLOPs) pairs


Ranks = tuple[int, ...] | range  # sorted rank numbers of a group


def as_ranks(ranks: Sequence[int]) -> Ranks:
    """``ranks`` sorted, as a ``range`` when they are evenly spaced (no per-rank storage: a
    group of millions of ranks stays three numbers), else as a tuple."""
    if isinstance(ranks, range):
        return ranks if ranks.step > 0 else range(ranks[-1], ranks[0] + 1, -ranks.step) if ranks else range(0)
    members = tuple(sorted(int(r) for r in ranks))
    if len(members) > 2:
        step = members[1] - members[0]
        if step > 0 and all(b - a == step for a, b in zip(members, members[1:])):
            return range(members[0], members[-1] + 1, step)
    return members


class GraphError(ValueError):
    """A malformed OpGraph: a cycle, an unknown dependency, a collective that cannot assemble."""


class SimulatorFault(RuntimeError):
    """The engine stopped making progress on a valid graph: a bug in hzpsim, not bad input
    (the CLI exits 3). The message names the op that was stuck."""


class Op:
    """One unit of work. Plain slots object: a large graph holds hundreds of thousands."""

    __slots__ = (
        "id",
        "kind",
        "name",
        "category",
        "stream",
        "ranks",
        "deps",
        "flops",
        "bytes_accessed",
        "collective",
        "group",
        "size_bytes",
        "alloc",
        "free",
        "step",
        "count",
        "duration_s",
        "shapes",
        "batch",
    )

    def __init__(
        self,
        id: int,
        kind: str,
        name: str,
        category: str,
        stream: str,
        ranks: tuple[int, ...],
        deps: tuple[int, ...],
        flops: FlopsByClass = (),
        bytes_accessed: float = 0.0,
        collective: str | None = None,
        group: str | None = None,
        size_bytes: float = 0.0,
        alloc: MemoryDelta = (),
        free: MemoryDelta = (),
        step: int = 0,
        count: int = 1,
        duration_s: float = 0.0,
        shapes: tuple[Shape, ...] = (),
        batch: int = -1,
    ) -> None:
        self.id = id
        self.kind = kind
        self.name = name
        self.category = category
        self.stream = stream
        self.ranks = ranks
        self.deps = deps
        self.flops = flops
        self.bytes_accessed = bytes_accessed
        self.collective = collective
        self.group = group
        self.size_bytes = size_bytes
        self.alloc = alloc
        self.free = free
        self.step = step
        self.count = count  # a collective repeated back to back (e.g. a layer's two TP all-reduces)
        self.duration_s = duration_s  # fixed time added to a compute op's rate-based time (host work)
        self.shapes = shapes  # the kernels behind ``flops`` (hzpsim.model.kernels), shared between ops
        self.batch = batch  # the micro-batch whose lengths set its attention (graph meta sequence_lengths; -1: none)

    @property
    def senders(self) -> tuple[int, ...]:
        """Simulated ranks that push bytes: the sender of a send/recv, else every participant."""
        return self.ranks[:1] if self.collective == "send_recv" else self.ranks

    @property
    def total_flops(self) -> float:
        return sum(f for _, f in self.flops)

    def to_dict(self) -> dict[str, Any]:
        out = {s: getattr(self, s) for s in self.__slots__}
        out["shapes"] = to_plain(self.shapes)
        if self.batch < 0:  # fixed-length sequences: the graph reads as before the field existed
            del out["batch"]
        return out


def memory_delta(memory: Mapping[str, float] | MemoryDelta | None) -> MemoryDelta:
    """``memory`` (bytes by category) as an Op's ``alloc`` / ``free``: (category, bytes) pairs
    without the zero ones. A tuple is taken to be one already (a builder that emits the same
    delta many times converts it once)."""
    if not memory:
        return ()
    if isinstance(memory, tuple):
        return memory
    for category in memory:
        assert category in MEMORY_CATEGORIES, category
    return tuple((k, float(v)) for k, v in memory.items() if v)


def flops_by_class(flops: Mapping[str, float] | FlopsByClass) -> FlopsByClass:
    """``flops`` (by efficiency class) as an Op's ``flops``: (class, FLOPs) pairs without the
    zero ones. A tuple is taken to be one already, as in :func:`memory_delta`."""
    if isinstance(flops, tuple):
        return flops
    return tuple((k, float(v)) for k, v in flops.items() if v)


def _dep_ids(deps: Iterable[int | None]) -> tuple[int, ...]:
    """``deps`` as an Op's: without None, each once, sorted."""
    return tuple(sorted({d for d in deps if d is not None}))


class OpGraph:
    """A DAG of Ops for a set of simulated ranks, each standing for ``weight`` real devices."""

    def __init__(
        self,
        num_devices: int,
        weights: Mapping[int, int],
        compute_dtype: str,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        assert sum(weights.values()) == num_devices, "simulated ranks must cover every device"
        self.num_devices = num_devices
        self.weights = dict(sorted(weights.items()))
        self.compute_dtype = compute_dtype
        self.meta: dict[str, Any] = dict(meta or {})
        self.ops: list[Op] = []
        # members of each group, sorted: a ``range`` when they are evenly spaced (a data-parallel
        # group of millions of ranks then costs nothing), else a tuple
        self.groups: dict[str, Ranks] = {}
        self.static_memory: dict[int, dict[str, float]] = {r: {} for r in self.weights}

    @property
    def ranks(self) -> list[int]:
        return list(self.weights)

    def add_group(self, name: str, ranks: Sequence[int]) -> str:
        members = as_ranks(ranks)
        if name in self.groups:
            assert self.groups[name] == members, f"group {name} redefined"
        else:
            self.groups[name] = members
        return name

    def add_static(self, rank: int, memory: Mapping[str, float]) -> None:
        """Memory resident for the whole run (model states), by category."""
        for category, size in memory_delta(memory):
            self.static_memory[rank][category] = self.static_memory[rank].get(category, 0.0) + size

    def compute(
        self,
        rank: int,
        name: str,
        category: str,
        flops: Mapping[str, float] | FlopsByClass,
        deps: Iterable[int | None] = (),
        bytes_accessed: float = 0.0,
        stream: str = COMPUTE_STREAM,
        alloc: Mapping[str, float] | MemoryDelta | None = None,
        free: Mapping[str, float] | MemoryDelta | None = None,
        step: int = 0,
        duration_s: float = 0.0,
        shapes: tuple[Shape, ...] = (),
        batch: int = -1,
    ) -> int:
        """A compute op on ``rank``'s ``stream``: FLOPs by class and HBM bytes, timed by the
        device's rates, plus a fixed ``duration_s`` (host work: launches, Python, syncs).
        ``shapes`` are the GEMM and attention kernels the FLOPs come from (``hzpsim.model.kernels``);
        when given, the cost model times them instead of the class totals. ``flops``, ``alloc``
        and ``free`` may be given in the Op's own form (:func:`flops_by_class`,
        :func:`memory_delta`)."""
        op_id = len(self.ops)
        self.ops.append(Op(op_id, COMPUTE, name, category, stream, (rank,), _dep_ids(deps), flops_by_class(flops),
                           float(bytes_accessed), None, None, 0.0, memory_delta(alloc) if alloc else (),
                           memory_delta(free) if free else (), step, 1, float(duration_s), shapes, batch))
        return op_id

    def collective(
        self,
        kind: str,
        group: str,
        participants: Sequence[int],
        size_bytes: float,
        name: str,
        category: str,
        stream: str,
        deps: Iterable[int | None] = (),
        alloc: Mapping[str, float] | MemoryDelta | None = None,
        free: Mapping[str, float] | MemoryDelta | None = None,
        step: int = 0,
        count: int = 1,
    ) -> int:
        assert kind in COLLECTIVE_KINDS, kind
        assert group in self.groups, group
        op_id = len(self.ops)
        self.ops.append(Op(op_id, COLLECTIVE, name, category, stream, tuple(sorted(participants)), _dep_ids(deps), (),
                           0.0, kind, group, float(size_bytes), memory_delta(alloc) if alloc else (),
                           memory_delta(free) if free else (), step, count))
        return op_id

    # ----------------------------------------------------------------- checks and export

    def validate(self) -> None:
        """Raise GraphError for unknown dependencies, cycles or inconsistent groups.

        An op that depends only on ops added before it cannot close a cycle, and a builder that
        passes the ids ``compute`` / ``collective`` returned only makes such ops: the cycle search
        runs only when some op's deps point forward (deps edited afterwards, a graph read from
        elsewhere)."""
        n = len(self.ops)
        simulated = frozenset(self.weights)
        member_sets: dict[str, range | frozenset[int]] = {}
        points_forward = False
        for op in self.ops:
            deps = op.deps
            if deps:
                if min(deps) < 0 or max(deps) >= n:
                    unknown = next(d for d in deps if not 0 <= d < n)
                    raise GraphError(f"op {op.id} ({op.name}) depends on unknown op {unknown}")
                points_forward = points_forward or max(deps) >= op.id
            if not simulated.issuperset(op.ranks):
                r = next(r for r in op.ranks if r not in simulated)
                raise GraphError(f"op {op.id} ({op.name}) runs on rank {r}, which is not simulated")
            if op.kind == COLLECTIVE:
                member_set = member_sets.get(op.group or "")
                if member_set is None:
                    members = self.groups.get(op.group or "")
                    if members is None:
                        raise GraphError(f"op {op.id} ({op.name}) uses unknown group {op.group!r}")
                    member_set = member_sets[op.group or ""] = members if isinstance(members, range) else frozenset(members)
                inside = member_set.issuperset(op.ranks) if isinstance(member_set, frozenset) else \
                    all(r in member_set for r in op.ranks)
                if not inside or not op.ranks:
                    raise GraphError(
                        f"op {op.id} ({op.name}): participants {list(op.ranks)[:4]} are not all in group {op.group}"
                    )
        if points_forward:
            self._check_acyclic()

    def _check_acyclic(self) -> None:
        """GraphError naming a few ops of a dependency cycle, if there is one (Kahn's algorithm)."""
        n = len(self.ops)
        indegree = [0] * n
        children: list[list[int]] = [[] for _ in range(n)]
        for op in self.ops:
            for d in op.deps:
                indegree[op.id] += 1
                children[d].append(op.id)
        ready = [i for i in range(n) if indegree[i] == 0]
        seen = 0
        while ready:
            i = ready.pop()
            seen += 1
            for c in children[i]:
                indegree[c] -= 1
                if indegree[c] == 0:
                    ready.append(c)
        if seen != n:
            stuck = [self.ops[i].name for i in range(n) if indegree[i] > 0][:3]
            raise GraphError(f"dependency cycle among ops, e.g. {', '.join(stuck)}")

    def to_json(self) -> str:
        return json.dumps(
            {
                "num_devices": self.num_devices,
                "weights": {str(k): v for k, v in self.weights.items()},
                "compute_dtype": self.compute_dtype,
                "meta": self.meta,
                "groups": {k: {"range": [v.start, v.stop, v.step]} if isinstance(v, range) else list(v)
                           for k, v in self.groups.items()},
                "static_memory": {str(k): v for k, v in self.static_memory.items()},
                "ops": [op.to_dict() for op in self.ops],
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> OpGraph:
        data = json.loads(text)
        graph = cls(
            data["num_devices"],
            {int(k): v for k, v in data["weights"].items()},
            data["compute_dtype"],
            data["meta"],
        )
        graph.groups = {k: range(*v["range"]) if isinstance(v, dict) else tuple(v) for k, v in data["groups"].items()}
        graph.static_memory = {int(k): v for k, v in data["static_memory"].items()}
        for raw in data["ops"]:
            raw = dict(raw)
            for key in ("ranks", "deps"):
                raw[key] = tuple(raw[key])
            for key in ("flops", "alloc", "free"):
                raw[key] = tuple((a, b) for a, b in raw[key])
            raw["shapes"] = from_plain(raw.get("shapes", ()))
            graph.ops.append(Op(**raw))
        return graph
