"""Shared links as a fluid network: concurrent transfers split each link's bandwidth.

Every simulated rank has one resource per topology level it can send over (``island``,
``node``, ``leaf`` = its NIC, ``spine``), with the achieved bandwidth of that level. A flow is
one rank's share of a collective phase: bytes to push over one or more of those resources.
Rates are max-min fair (progressive filling): a flow's rate is measured in bytes/s on its
most-loaded resource and it consumes each resource in proportion to its bytes there. Two equal
transfers on one link therefore each get half of it, and a flow bottlenecked on the NIC leaves
NVLink bandwidth to others. Rates are recomputed whenever a flow starts or ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from heapq import heappush

import simpy

Resource = tuple[int, str]  # (simulated rank, level)

_EPS_S = 1e-12
_CLOCK_ULPS = 16  # a flow this many clock ulps from done is done: the clock cannot resolve less


def done_within_s(now_s: float) -> float:
    """Time below which a flow counts as finished at clock ``now_s``: 1 ps, or a few units of
    the clock's floating-point resolution once that is coarser (after ~4,000 simulated seconds a
    picosecond is below it, and a timer that short would fire at the same instant forever)."""
    return max(_EPS_S, _CLOCK_ULPS * math.ulp(now_s))


_NORMAL = 1  # simpy.events.NORMAL: the priority of every timer and triggered event here


class Timer:
    """A triggered event due at a time: what ``env.timeout(delay)`` schedules, without its
    bookkeeping (the engine's and the network's most frequent object). It takes the same place
    in SimPy's queue as a Timeout would, so runs are event for event the same."""

    __slots__ = ("callbacks", "_ok", "_value")

    def __init__(self, callbacks: list) -> None:
        self.callbacks = callbacks
        self._ok = True
        self._value = None


def call_after(env: simpy.Environment, delay: float, callback: Callable | None = None) -> Timer:
    """A timer ``delay`` seconds from now (``env.timeout(delay)``) that calls ``callback(timer)``."""
    if delay < 0:
        raise ValueError(f"Negative delay {delay}")
    timer = Timer([callback] if callback is not None else [])
    heappush(env._queue, (env._now + delay, _NORMAL, next(env._eid), timer))  # type: ignore[misc]
    return timer


class Flow:
    __slots__ = ("load", "remaining", "rate", "on_done", "alone")

    def __init__(self, demands: Mapping[Resource, float] | None, on_done: Callable[[], None],
                 template: tuple[dict[Resource, float], float, list[float]] | None = None) -> None:
        if template is None:
            template = flow_template(demands or {})
        load, total, alone = template
        # bytes on each resource per unit of progress; progress is counted in bytes on the
        # flow's most-loaded resource
        self.load = load
        self.remaining = total
        self.rate = 0.0
        self.on_done = on_done
        self.alone = alone  # [rate alone on its links], filled on first use (shared by a template)


def flow_template(demands: Mapping[Resource, float]) -> tuple[dict[Resource, float], float, list[float]]:
    """What every flow of ``demands`` shares: its load per resource, its bytes and (once
    known) its rate alone on its links."""
    total = max(demands.values())
    return {r: b / total for r, b in demands.items() if b > 0}, total, []


class Network:
    """Processor-sharing links; ``transfer`` starts a flow and calls back when it ends."""

    def __init__(self, env: simpy.Environment, capacity: Callable[[Resource], float]) -> None:
        self.env = env
        self.capacity = capacity
        self.flows: list[Flow] = []
        self._last_s = 0.0
        self._generation = 0

    def transfer(self, demands: Mapping[Resource, float], on_done: Callable[[], None],
                 template: tuple[dict[Resource, float], float, list[float]] | None = None) -> None:
        """Start a flow of ``demands`` (or of a ``template`` from :func:`flow_template`)."""
        if template is None:
            if not demands or max(demands.values()) <= 0:
                on_done()
                return
            template = flow_template(demands)
        self._advance()
        self.flows.append(Flow(None, on_done, template))
        self._reschedule()

    def _advance(self) -> None:
        now = self.env._now
        elapsed = now - self._last_s
        if elapsed > 0:
            for flow in self.flows:
                flow.remaining -= flow.rate * elapsed
        self._last_s = now

    def _allocate(self) -> None:
        """Max-min fair rates by progressive filling over the shared resources."""
        flows = self.flows
        if len(flows) == 1:  # the common case: one transfer alone on its links
            flow = flows[0]
            alone = flow.alone
            if not alone:
                alone.append(min(self.capacity(r) / w for r, w in flow.load.items()))
            flow.rate = alone[0]
            return
        if not flows:
            return
        spare: dict[Resource, float] = {}
        for flow in flows:
            flow.rate = 0.0
            for r in flow.load:
                if r not in spare:
                    spare[r] = self.capacity(r)
        active = list(flows)
        while active:
            weight: dict[Resource, float] = {}
            for flow in active:
                for r, w in flow.load.items():
                    weight[r] = weight.get(r, 0.0) + w
            step, tight = min((spare[r] / w, r) for r, w in weight.items())
            for flow in active:
                flow.rate += step
                for r, w in flow.load.items():
                    spare[r] -= step * w
            saturated = {r for r, w in weight.items() if spare[r] <= 1e-9 * self.capacity(r)}
            saturated.add(tight)
            active = [f for f in active if not saturated.intersection(f.load)]

    def _reschedule(self) -> None:
        self._allocate()
        self._generation += 1
        flows = self.flows
        if flows:
            if len(flows) == 1:
                delay = flows[0].remaining / flows[0].rate
            else:
                delay = min(f.remaining / f.rate for f in flows)
            generation = self._generation
            call_after(self.env, max(delay, 0.0), lambda _ev: self._on_timer(generation))

    def _on_timer(self, generation: int) -> None:
        if generation != self._generation:
            return  # superseded by a later start or finish
        self._advance()
        tolerance_s = done_within_s(self.env._now)
        flows = self.flows
        if len(flows) == 1:
            flow = flows[0]
            done = [flow] if flow.remaining <= flow.rate * tolerance_s + 1e-6 else []
            if done:
                self.flows = []
        else:
            done = [f for f in flows if f.remaining <= f.rate * tolerance_s + 1e-6]
            self.flows = [f for f in flows if f not in done]
        self._reschedule()
        for flow in done:
            flow.on_done()
