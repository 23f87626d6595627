"""The engine: replay an OpGraph in SimPy, strategy-blind.

Each simulated rank has one SimPy process per stream (``compute`` and whatever communication
streams the graph names). A stream runs its ops in the order they were added, one at a time,
each after its dependencies. A collective starts when every participant's stream has reached it
(rendezvous), waits its latency, then pushes each participant's bytes through the shared
links (:mod:`hzpsim.sim.network`). Memory is recorded as a timeline of allocations and frees.

If the run ends with ops left undone (a collective whose group never assembles, or streams
that wait on each other in opposite orders) the engine raises :class:`GraphError` naming them.
It never hangs: SimPy stops when no event is left, and a run that processes
``STALL_EVENTS`` events in a row without finishing any op (a loop that no longer moves the
clock) stops with :class:`SimulatorFault` naming the op in flight.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import Any

import simpy

from hzpsim.hardware.collectives import CollectiveModel, CollectivePlan
from hzpsim.hardware.compute import ComputeModel, Efficiency
from hzpsim.hardware.topology import GroupSpan, Topology
from hzpsim.hardware.variability import Stragglers
from hzpsim.model.ops import COMPUTE, GraphError, Op, OpGraph, SimulatorFault
from hzpsim.sim.lengths import LengthWaits
from hzpsim.sim.network import Network, Resource, call_after, flow_template

UNDONE = -1.0
# Events processed with no op finishing before the run counts as stuck. Between two op ends a
# healthy run processes a handful of events per op in flight (a timer, a flow's reschedules);
# two million is far above that even for fully expanded thousand-rank collectives.
STALL_EVENTS = 2_000_000


_NORMAL = 1  # simpy.events.NORMAL
_UNSET = object()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (back to its previous state after).

    Building and replaying a graph allocates hundreds of thousands of objects that live until
    the block ends, and every collection the allocations trigger walks all of them, and every
    other live object of the process (in a search, tens of thousands of candidates and their
    bounds), to find nothing: reference counting frees the rest (finished timers and events
    are not in cycles). The block's cyclic garbage (the engine and its processes) waits for the
    next collection after it. Determinism is unaffected: nothing simulated depends on when
    memory is reclaimed."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Waiter:
    """A SimPy-compatible event that the engine triggers (``env.event()`` and its
    ``succeed()``, without their bookkeeping): the same place in SimPy's queue."""

    __slots__ = ("callbacks", "_ok", "_value")

    def __init__(self) -> None:
        self.callbacks: list = []
        self._ok = True
        self._value = None


class _Running:
    """Work in progress whose speed may change: a compute op slowed or paused while its rank
    communicates (Engine._talk), or any work on a node's CPU pool (Engine._pool_start)."""

    __slots__ = ("op", "remaining_s", "rate", "since_s", "done", "generation", "node", "demand")

    def __init__(self, op: Op | None, remaining_s: float, rate: float, since_s: float, done: _Waiter) -> None:
        self.op, self.remaining_s, self.rate, self.since_s, self.done = op, remaining_s, rate, since_s, done
        self.generation = 0
        self.node = -1
        self.demand = 0.0


@dataclass
class Trace:
    """What happened: start and end of every op, plans of collectives, memory timelines."""

    graph: OpGraph
    topology: Topology
    start_s: list[float]
    end_s: list[float]
    plans: dict[int, CollectivePlan]
    memory_events: dict[int, list[tuple[float, str, float, str]]]
    """Per simulated rank, (time, category, +bytes allocated / -bytes freed, stream): an op's
    ``alloc`` when it starts, on the op's stream; its ``free`` when it ends, naming the stream
    that allocated the block it releases (whose caching-allocator pool the block goes back to,
    ``sim/allocator.py``), which is not the freeing op's stream when one stream frees what
    another allocated (a gathered unit, allocated by its all-gather, freed by its compute)."""
    num_events: int
    sim_wall_s: float
    spans: dict[str, GroupSpan] = field(default_factory=dict)
    waits: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    """Per simulated rank, the intervals it waited for ranks with longer documents
    (variable-length sequences, ``sim/lengths.py``)."""


class Engine:
    def __init__(self, graph: OpGraph, topology: Topology, efficiency: Efficiency | None = None) -> None:
        graph.validate()
        self.graph = graph
        self.topology = topology
        self.env = simpy.Environment()
        self.compute_model = ComputeModel(topology.device, graph.compute_dtype, efficiency)
        self.collective_model = CollectiveModel(topology)
        # A transfer only loads its own rank's links, so each rank gets its own (small) fluid
        # network: rates are recomputed among the few flows that can actually share.
        self.networks = {r: Network(self.env, self._capacity) for r in graph.weights}
        n = len(graph.ops)
        self.start_s = [UNDONE] * n
        self.end_s = [UNDONE] * n
        self._waiters: dict[int, _Waiter] = {}
        self._arrived = [0] * n
        self.plans: dict[int, CollectivePlan] = {}
        self.spans = {name: topology.span(ranks) for name, ranks in graph.groups.items()}
        self.memory_events: dict[int, list[tuple[float, str, float, str]]] = {r: [] for r in graph.weights}
        # rank -> category -> its live blocks (bytes, allocating stream, allocating op id), in
        # allocation order: which stream's block a release gives back (see _owner_stream)
        self._live_blocks: dict[int, dict[str, list[tuple[float, str, int]]]] = {r: {} for r in graph.weights}
        self._capacity_cache: dict[str, float] = {}
        # Compute slows down while the same rank communicates (collective kernels take SMs and
        # memory bandwidth): running compute ops progress at 1 / (1 + slowdown) then.
        self.slowdown = self.compute_model.efficiency.comm_overlap_slowdown
        # A device whose collectives run on its compute cores (a CPU with gloo) gets no overlap:
        # every compute op of a rank, host dispatch included, pauses while one of its
        # collectives moves bytes (the collective's time was measured with the cores to itself)
        # A device with a CPU pool (Device.node_cpu_cores: a CPU node calibrated by `hzpsim
        # calibrate machine`) shares its node's cores among the work that needs them: each
        # rank's compute and host ops (a core each) and its collectives (the measured call, at
        # the share of a core its backend threads use, CollectivePlan.cpu_s)
        # progress at min(1, cores / demand), demand summed over the work running on the node,
        # each simulated rank counting for the ranks it stands for (its weight, at most a node's
        # devices). This is processor sharing, as Linux's fair scheduler shares cores among
        # runnable threads (kernel/sched/fair.c); a rank that waits leaves its share to the others.
        self.pool_cores = topology.device.node_cpu_cores
        self.shared_cores = topology.device.communication_uses_compute_cores and not self.pool_cores
        self.contended = bool(self.slowdown) or self.shared_cores
        if self.pool_cores:
            per_node = topology.devices_per_node
            self._node_of = {r: r // per_node for r in graph.weights}
            self._pool_share = {r: float(min(w, per_node)) for r, w in graph.weights.items()}
            self._pool_jobs: dict[int, list[_Running]] = {node: [] for node in set(self._node_of.values())}
            self._pool_demand = dict.fromkeys(self._pool_jobs, 0.0)
        self._talking = dict.fromkeys(graph.weights, 0)  # collectives in flight per rank
        self._running: dict[int, list[_Running]] = {r: [] for r in graph.weights}
        self.num_finished = 0
        self.stragglers = Stragglers(topology.spec.variability, topology.spec.variability_seed,
                                     topology.spec.variability_persistent)
        # variable-length sequences: the data-parallel ranks no lane simulates run other documents
        self.lengths = LengthWaits(graph, self.compute_model) if "sequence_lengths" in graph.meta else None
        # explicit stragglers (cluster.stragglers): the strategy simulated each straggler's class
        # explicitly and says how much slower its device compute runs (graph meta
        # ``compute_slowdown``: [[rank, factor], ...]); a collective over a slow NIC moves its
        # inter-node bytes slower (topology.link_bandwidth_factor of its group)
        self._compute_slowdown = {int(r): float(f) for r, f in graph.meta.get("compute_slowdown", ())}
        self._plans: dict[tuple, tuple[CollectivePlan, int, bool]] = {}  # see _plan
        # rank -> (time of a rendezvous, how late its slowest member was): the rank's next device
        # compute waits for that member unless the stream already waited at least as long since
        # (for its inputs, or in that very collective when it ran on the same stream)
        self._straggler: dict[int, tuple[float, float]] = {}
        self._queue, self._eid = self.env._queue, self.env._eid
        self._flows: dict[tuple[int, int], Any] = {}  # (rank, id(plan)) -> flow template (None: nothing to move)
        self._durations: dict[tuple, float] = {}  # (id(shapes), bytes, fixed) -> seconds (see _duration_s)

    def _trigger(self, event: _Waiter) -> None:
        """``event.succeed()``: due now, after what is already due now."""
        heappush(self._queue, (self.env._now, _NORMAL, next(self._eid), event))  # type: ignore[misc]

    def _capacity(self, resource: Resource) -> float:
        level = resource[1]
        if level not in self._capacity_cache:
            self._capacity_cache[level] = self.topology.link(level).achieved_bytes_per_s
        return self._capacity_cache[level]

    # ------------------------------------------------------------------ processes

    def _wait(self, op_id: int) -> _Waiter:
        event = self._waiters.get(op_id)
        if event is None:
            event = self._waiters[op_id] = _Waiter()
        return event

    def _memory(self, op: Op, delta: tuple[tuple[str, float], ...], sign: float) -> None:
        now = self.env._now
        for rank in op.ranks:
            events = self.memory_events[rank]
            live = self._live_blocks[rank]
            for category, size in delta:
                if sign > 0:
                    events.append((now, category, size, op.stream))
                    live.setdefault(category, []).append((size, op.stream, op.id))
                else:
                    events.append((now, category, -size, _owner_stream(live.setdefault(category, []), size, op)))

    def _finish(self, op: Op) -> None:
        self.end_s[op.id] = self.env._now
        self.num_finished += 1
        if self.contended and op.kind != COMPUTE:
            self._talk(op, -1)
        if op.free:
            self._memory(op, op.free, -1.0)
        event = self._waiters.pop(op.id, None)
        if event is not None:
            self._trigger(event)

    def _stream(self, ops: list[Op]) -> Generator[Any, None, None]:  # yields Timer / _Waiter events
        env, end_s, start_s, arrived, waiters = self.env, self.end_s, self.start_s, self._arrived, self._waiters
        straggler, stragglers, lengths = self._straggler, self.stragglers, self.lengths
        slowable = bool(self.slowdown)
        shared = self.shared_cores
        pooled = bool(self.pool_cores)
        previous_end_s = 0.0
        for op in ops:
            for d in op.deps:
                if end_s[d] == UNDONE:
                    event = waiters.get(d)
                    if event is None:
                        event = waiters[d] = _Waiter()
                    yield event
            if op.kind == COMPUTE:
                device = bool(op.flops or op.bytes_accessed)
                if device and straggler:
                    late = straggler.pop(op.ranks[0], None)
                    if late is not None:
                        waited_s = env._now - max(previous_end_s, late[0])
                        if late[1] > waited_s:
                            yield call_after(env, late[1] - waited_s)
                start = start_s[op.id] = env._now
                if op.alloc:
                    self._memory(op, op.alloc, 1.0)
                if pooled:
                    yield self._pool_start(op.ranks[0], self._duration_s(op, device), _Waiter())
                elif (slowable and device) or shared:  # GPU: host time is not slowed
                    yield self._start_slowable(op, device)
                else:
                    yield call_after(env, self._duration_s(op, device))
                if device and stragglers.active:  # device work: what a straggler falls behind on
                    stragglers.worked(op.ranks[0], env._now - start)
                if op.batch >= 0 and lengths is not None:  # other ranks ran other documents
                    lengths.worked(op)
                self._finish(op)
                previous_end_s = env._now
            else:
                count = arrived[op.id] = arrived[op.id] + 1
                if count == len(op.ranks):
                    self._collective(op)
                if end_s[op.id] == UNDONE:
                    event = waiters.get(op.id)
                    if event is None:
                        event = waiters[op.id] = _Waiter()
                    yield event
                # previous_end_s stays the stream's last device work: the time it spent in this
                # collective after the rendezvous was waiting, so a straggler this collective
                # already waited for is not waited for again by the next kernel (the members
                # leave the collective together)

    # ------------------------------------------------------------------ compute slowdown

    def _rate(self, rank: int) -> float:
        if not self._talking[rank]:
            return 1.0
        return 0.0 if self.shared_cores else 1.0 / (1.0 + self.slowdown)

    def _duration_s(self, op: Op, device: bool) -> float:
        """Time of a compute op alone on its rank: an explicit straggler's device work is slower.
        Ops sharing their kernel shapes (one tuple in the graph) and bytes take the same time."""
        if op.shapes:
            key = (id(op.shapes), op.bytes_accessed, op.duration_s)
            seconds = self._durations.get(key)
            if seconds is None:
                seconds = self._durations[key] = self.compute_model.duration_s(op)
        else:
            seconds = self.compute_model.duration_s(op)
        if device and self._compute_slowdown:
            seconds *= self._compute_slowdown.get(op.ranks[0], 1.0)
        return seconds

    def _start_slowable(self, op: Op, device: bool = True) -> _Waiter:
        rank = op.ranks[0]
        job = _Running(op, self._duration_s(op, device), self._rate(rank), self.env._now, _Waiter())
        self._running[rank].append(job)
        self._schedule(job)
        return job.done

    def _schedule(self, job: _Running) -> None:
        job.generation += 1
        if job.rate == 0.0:  # paused until the rank's collectives end (_talk reschedules it)
            return
        generation = job.generation
        call_after(self.env, max(job.remaining_s / job.rate, 0.0), lambda _event: self._job_timer(job, generation))

    def _job_timer(self, job: _Running, generation: int) -> None:
        if generation != job.generation:
            return
        assert job.op is not None  # a rank's slowable compute op (pool jobs time out in _pool_timer)
        self._running[job.op.ranks[0]].remove(job)
        self._trigger(job.done)

    # ------------------------------------------------------------------ CPU pool

    def _pool_start(self, rank: int, seconds: float, done: _Waiter, cores: float = 1.0) -> _Waiter:
        """Run ``seconds`` of work (alone, at full speed) for ``rank`` on its node's pool,
        needing ``cores`` of a core at full speed (1 for a thread that computes); ``done`` is
        triggered when it is finished."""
        node = self._node_of[rank]
        job = _Running(None, seconds, 0.0, self.env._now, done)
        job.node, job.demand = node, self._pool_share[rank] * cores
        self._pool_jobs[node].append(job)
        self._pool_demand[node] += job.demand
        self._pool_rerate(node)
        return done

    def _pool_timer(self, job: _Running, generation: int) -> None:
        if generation != job.generation:
            return
        self._pool_jobs[job.node].remove(job)
        self._pool_demand[job.node] -= job.demand
        self._trigger(job.done)
        self._pool_rerate(job.node)

    def _pool_rerate(self, node: int) -> None:
        """The node's demand changed: every job on it that needs a core progresses at
        min(1, cores / demand) (one that needs none, a wait, at full speed)."""
        now = self.env._now
        demand = self._pool_demand[node]
        shared = min(1.0, self.pool_cores / demand) if demand > 0 else 1.0  # type: ignore[operator]
        for job in self._pool_jobs[node]:
            rate = shared if job.demand > 0 else 1.0
            if job.rate == rate:
                continue
            job.remaining_s -= (now - job.since_s) * job.rate
            job.rate, job.since_s = rate, now
            job.generation += 1
            generation = job.generation
            call_after(self.env, max(job.remaining_s / rate, 0.0),
                       lambda _event, job=job, generation=generation: self._pool_timer(job, generation))

    def _talk(self, op: Op, delta: int) -> None:
        """A collective starts (+1) or ends (-1) on its ranks: re-time their running compute."""
        now = self.env._now
        talking, rate = self._talking, self._rate
        # a gloo receive copies on the receiver's cores too
        for rank in op.ranks if self.shared_cores else op.senders:
            before = rate(rank)
            talking[rank] += delta
            after = rate(rank)
            if after == before:
                continue
            for job in self._running[rank]:
                job.remaining_s -= (now - job.since_s) * job.rate
                job.rate, job.since_s = after, now
                self._schedule(job)

    def _collective(self, op: Op) -> None:
        """All participants have arrived: pay the latency, then move the bytes (callbacks, not
        a process: collectives are the most frequent events)."""
        now = self.env._now
        self.start_s[op.id] = now
        if self.contended:
            self._talk(op, +1)
        if op.alloc:
            self._memory(op, op.alloc, 1.0)
        key = (op.group, op.collective, op.size_bytes, op.count, len(op.ranks))
        cached = self._plans.get(key)
        if cached is None:
            cached = self._plans[key] = self._plan(op)
        plan, size, sampled = cached
        late_s = 0.0
        if size:
            # the slowest member arrives late (hardware/variability.py): the collective starts
            # later, and the group's next device compute cannot start before it arrived. The
            # transfer itself is not stretched: no source shows per-transfer noise at this scale
            late_s = self.stragglers.delay_s(op.ranks, size, sampled)
        if self.lengths is not None:  # ranks with longer documents arrive later (sim/lengths.py)
            late_s += self.lengths.rendezvous(op, now)
        self.plans[op.id] = plan
        wait_s = plan.latency_s
        if late_s > 0:
            wait_s += late_s
            straggler = self._straggler
            for rank in op.ranks:
                if late_s > straggler.get(rank, (0.0, 0.0))[1]:
                    straggler[rank] = (now, late_s)
        if self.pool_cores:
            if late_s > 0:
                call_after(self.env, late_s, lambda _event: self._pooled(op, plan))
            else:
                self._pooled(op, plan)
        elif wait_s > 0:
            call_after(self.env, wait_s, lambda _event: self._transfer(op, plan))
        else:
            self._transfer(op, plan)

    def _plan(self, op: Op) -> tuple[CollectivePlan, int, bool]:
        """The plan of a collective like ``op`` (same group, kind, size, count and participants),
        the group size whose slowest member it waits for (0: no variability) and whether that
        wait is sampled (every member simulated on its own) rather than its expectation."""
        assert op.group is not None and op.collective is not None
        pair_level = None
        if op.collective == "send_recv":
            src, dst = self.graph.groups[op.group][:2]
            pair_level = self.topology.level_between(src, dst)
        plan = self.collective_model.plan(op.collective, op.size_bytes, self.spans[op.group], pair_level)
        link_factor = self.topology.link_bandwidth_factor(self.graph.groups[op.group])
        if link_factor != 1.0:
            plan = self.collective_model.on_slow_links(plan, link_factor)
        if op.count != 1:
            plan = plan.repeated(op.count)
        if op.collective == "send_recv" or not self.stragglers.active:
            return plan, 0, False
        size = self.spans[op.group].num_ranks
        sampled = len(op.ranks) == size and all(self.graph.weights[r] == 1 for r in op.ranks)
        return plan, size, sampled

    def _transfer(self, op: Op, plan: CollectivePlan) -> None:
        if not plan.demand_by_level:
            self._finish(op)
            return
        senders = op.senders
        if len(senders) == 1:
            def one_finished() -> None:
                self._finish(op)
        else:
            pending = [len(senders)]

            def one_finished() -> None:
                pending[0] -= 1
                if pending[0] == 0:
                    self._finish(op)

        flows = self._flows
        for rank in senders:
            # every flow of one plan from one rank has the same demands: computed once (the
            # plan stays alive in self.plans, so its id is not reused during the run)
            key = (rank, id(plan))
            template = flows.get(key, _UNSET)
            if template is _UNSET:
                demands = {(rank, level): b for level, b in plan.demand_by_level.items()}
                template = flows[key] = flow_template(demands) if demands and max(demands.values()) > 0 else None
            if template is None:
                one_finished()
            else:
                self.networks[rank].transfer({}, one_finished, template)

    def _pooled(self, op: Op, plan: CollectivePlan) -> None:
        """A collective on a CPU pool: each member runs the call's measured time (its wall time
        inside a step, ``calibrate machine``'s in-step loop) as pool work that needs the share
        of a core its backend threads use (CollectivePlan.cpu_s / isolated_time_s). The
        measured time is the call's floor (a ring's hops follow each other); ranks that compute
        meanwhile slow it down."""
        seconds = plan.isolated_time_s
        if seconds <= 0:
            self._finish(op)
            return
        share = min(plan.cpu_s / seconds, 1.0)
        pending = [len(op.ranks)]

        def one_done(_event: Any) -> None:
            pending[0] -= 1
            if pending[0] == 0:
                self._finish(op)

        for rank in op.ranks:
            done = _Waiter()
            done.callbacks.append(one_done)
            self._pool_start(rank, seconds, done, share)

    # ------------------------------------------------------------------ run

    def _run_guarded(self) -> None:
        """``env.run()``, checked every ``STALL_EVENTS`` events for progress (an op finished).
        The loop is ``env.step()``'s, inlined: the same events in the same order."""
        env, stall_events = self.env, STALL_EVENTS
        queue: list[Any] = env._queue
        finished = -1
        while True:
            if self.num_finished == finished:
                self._stalled(stall_events)
            finished = self.num_finished
            for _ in range(stall_events):
                if not queue:
                    return
                env._now, _, _, event = heappop(queue)
                callbacks, event.callbacks = event.callbacks, None
                for callback in callbacks:
                    callback(event)
                if not event._ok and not hasattr(event, "_defused"):  # a process failed: re-raise it
                    exc = type(event._value)(*event._value.args)
                    exc.__cause__ = event._value
                    raise exc

    def _stalled(self, stall_events: int) -> None:
        in_flight = [op for op in self.graph.ops if self.start_s[op.id] != UNDONE and self.end_s[op.id] == UNDONE]
        first = in_flight[0] if in_flight else None
        what = f"'{first.name}' (op {first.id}, started at {self.start_s[first.id]:.6g} s)" if first else "no op"
        raise SimulatorFault(
            f"simulator fault: no progress in the last {stall_events:,} events at simulated time "
            f"{self.env.now:.6g} s; stuck in {what}, {len(in_flight)} ops in flight"
        )

    def run(self) -> Trace:
        wall = time.perf_counter()
        streams: dict[tuple[int, str], list[Op]] = {}
        for op in self.graph.ops:
            for rank in op.ranks:
                streams.setdefault((rank, op.stream), []).append(op)
        for key in sorted(streams):
            self.env.process(self._stream(streams[key]))
        with gc_paused():
            self._run_guarded()
        undone = [op for op in self.graph.ops if self.end_s[op.id] == UNDONE]
        if undone:
            partial = [op for op in undone if op.kind != COMPUTE and 0 < self._arrived[op.id] < len(op.ranks)]
            first = (partial or undone)[0]
            if partial:
                missing = len(first.ranks) - self._arrived[first.id]
                raise GraphError(
                    f"collective '{first.name}' (op {first.id}) never assembled: {missing} of "
                    f"{len(first.ranks)} participants did not arrive ({len(undone)} ops left undone)"
                )
            raise GraphError(
                f"deadlock: {len(undone)} ops never ran, first '{first.name}' (op {first.id}) "
                "waits on ops that wait on it"
            )
        num_events = next(self.env._eid)  # SimPy's running count of scheduled events
        return Trace(
            self.graph,
            self.topology,
            self.start_s,
            self.end_s,
            self.plans,
            self.memory_events,
            num_events,
            time.perf_counter() - wall,
            self.spans,
            self.lengths.waits if self.lengths is not None else {},
        )


def _owner_stream(blocks: list[tuple[float, str, int]], size: float, op: Op) -> str:
    """The stream that allocated the block ``op`` releases (``size`` bytes of one category),
    taken off ``blocks`` (that category's live blocks, in allocation order). Ops free by
    (category, bytes), not by block, so: a block of that size allocated by one of the op's
    dependencies (a gathered unit by the all-gather its compute waits for, a gradient by the
    backward its reduce-scatter waits for), else the latest of that size, else the latest
    blocks until the bytes are covered (a block partly released keeps the rest); the
    allocator replay matches its blocks the same way within the stream named here."""
    latest = -1
    for k in range(len(blocks) - 1, -1, -1):
        held, _, origin = blocks[k]
        if abs(held - size) <= max(1.0, 1e-9 * size):
            if origin in op.deps:
                return blocks.pop(k)[1]
            if latest < 0:
                latest = k
    if latest >= 0:
        return blocks.pop(latest)[1]
    stream = blocks[-1][1] if blocks else op.stream
    while size > 1.0 and blocks:
        held, on, origin = blocks.pop()
        if held > size + 1.0:
            blocks.append((held - size, on, origin))
        size -= held
    return stream


def simulate(graph: OpGraph, topology: Topology, efficiency: Efficiency | None = None) -> Trace:
    """Replay ``graph`` on ``topology`` and return its Trace."""
    return Engine(graph, topology, efficiency).run()
