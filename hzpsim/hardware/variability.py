"""What grows with scale: every collective waits for its slowest participant.

A rank's time between two synchronisations varies from rank to rank, in two ways the sources
tell apart (docs/hardware-constants.md §7):

- **per-step noise** (``cluster.variability``): GC pauses, OS and Python jitter, drawn anew
  for every stretch of work (Lin et al., OSDI'25, §5.4: GC pauses of hundreds of milliseconds
  hit different workers at different steps);
- **persistent slowness** (``cluster.variability_persistent``): some devices are slower than
  their peers for the whole run (Sinha et al., SC'22; MegaScale, NSDI'24 §6.3: the same hosts
  about 10 % slower in every experiment).

**Noise.** With a coefficient of variation ``cv`` of
each stretch of device work between two synchronisations, drawn independently, a collective
over N ranks starts ``cv · W · E[max(0, max of N standard normal draws)]`` late: the expected
lateness of the slowest of N, where ``W`` is the standard deviation unit of the work since
the group last met (below). The symmetric simulation charges that expectation (the
group's *real* size N, whatever number of ranks is simulated); an expanded simulation (every
simulated participant stands for one device and the whole group is simulated) draws one
normal per participant per collective from a seeded generator and waits for the largest
``z_i · W_i``: the same on average, deterministic for a seed.

``W`` comes from the stretches of device compute a rank ran between its rendezvous since its
last rendezvous in a group of at least N ranks: ``W = sqrt(sum of stretch²)``. The stretches
are independent, so their noise adds in variance: a group as large re-aligns the ranks (after
ZeRO-3's per-layer all-gathers over all N ranks, W at the next is one layer), while smaller
groups in between (an island's all-gathers, TP all-reduces) leave many short stretches whose
noise mostly averages out by the next large synchronisation — which is why hierarchical
groups (AsyncHZP, HSDP) wait for fewer stragglers than one flat group. Send/recv pairs are not charged: a
pipeline stage already waits for its neighbour's data. The collective's own transfer is not
stretched (no source shows per-transfer noise; MegaScale's spread is of per-rank compute).

**Persistent slowness.** A device of speed z standard deviations below the mean runs its
work ``cv_p · z`` slower, at every rendezvous its group waits for it, and what it falls behind
starts again from every rendezvous that re-aligned it: after the group waited, its members
leave together, and the slow device then falls behind from there (its waits do not absorb its
later slowness). For a group of N ranks, with ``w`` the device work since its members last met
in a group at least as large, the slowest is ``cv_p · E[max(0, max of N)] · w`` behind (sampled
under ``--expand``: one draw per device, for the whole run, seeded by the device), less what
its members already waited for at smaller rendezvous over that same work. Unlike the noise
this does not average out over many short stretches: between two rendezvous of the whole
world the waits add up to ``cv_p · E[max]`` of the compute in between, whatever smaller groups
met in the meantime — the slowest device sets the pace, as it does in a synchronous job — and
the same every step (until 2026-11-27 the work counted from the run's start and the waits
were compared across re-alignments, so a group smaller than the world waited for nothing
after the first steps and the reported step depended on how many steps were simulated). Both
parts add at a rendezvous. ``cv = cv_p = 0`` gives exactly the deterministic model.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np


@cache
def expected_max_excess(n: int) -> float:
    """E[max(0, max of ``n`` i.i.d. standard normal draws)] (0 for n <= 1): integral of
    1 - Phi(x)^n over x >= 0, by the trapezoid rule on a fine grid."""
    if n <= 1:
        return 0.0
    xs = np.linspace(0.0, 12.0, 6001)
    phi = np.array([0.5 * (1.0 + math.erf(x / math.sqrt(2.0))) for x in xs])
    # 1 - phi**n, computed stably for huge n as -expm1(n * log(phi))
    tail = -np.expm1(n * np.log(np.maximum(phi, 1e-300)))
    return float(np.sum((tail[1:] + tail[:-1]) * 0.5) * (xs[1] - xs[0]))


class _RankState:
    __slots__ = ("work_s", "last_work_s", "total_sq", "since", "waited_s", "aligned")

    def __init__(self) -> None:
        self.work_s = 0.0  # device work done so far
        self.last_work_s = 0.0  # ... at the rank's previous rendezvous
        self.total_sq = 0.0  # sum of squared stretches since the start
        self.since: dict[int, float] = {}  # group size -> sum of squared stretches since the last
        #                                    rendezvous in a group at least that large
        self.waited_s = 0.0  # persistent lateness this rank has waited for in all
        self.aligned: dict[int, tuple[float, float]] = {}  # group size -> (work_s, waited_s) at the
        #                                    last rendezvous in a group at least that large

    def mark(self, size: int) -> tuple[float, float]:
        """(work_s, waited_s) when the rank last met a group of at least ``size`` ranks (the run's
        start if never): every such rendezvous updates the marks of the sizes up to its own, so
        the smallest recorded size >= ``size`` holds the latest."""
        mark = self.aligned.get(size)
        if mark is None:
            larger = [s for s in self.aligned if s >= size]
            mark = self.aligned[min(larger)] if larger else (0.0, 0.0)
        return mark


class Stragglers:
    """Tracks each rank's device work and prices the wait for the slowest participant."""

    def __init__(self, cv: float, seed: int, persistent_cv: float = 0.0) -> None:
        self.cv = cv
        self.persistent_cv = persistent_cv
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.ranks: dict[int, _RankState] = {}
        self._speed: dict[int, float] = {}  # rank -> its persistent draw (standard normal)

    @property
    def active(self) -> bool:
        """Whether any rendezvous can start late."""
        return self.cv > 0 or self.persistent_cv > 0

    def _state(self, rank: int) -> _RankState:
        state = self.ranks.get(rank)
        if state is None:
            state = self.ranks[rank] = _RankState()
        return state

    def worked(self, rank: int, seconds: float) -> None:
        self._state(rank).work_s += seconds

    def _since(self, rank: int, size: int) -> float:
        """W of ``rank`` at a rendezvous of ``size`` ranks (and the rendezvous recorded)."""
        state = self._state(rank)
        stretch = state.work_s - state.last_work_s
        state.last_work_s = state.work_s
        square = stretch * stretch
        state.total_sq += square
        for s in state.since:
            state.since[s] += square
        if size not in state.since:  # since the last rendezvous at least this large, if any
            state.since[size] = min([state.total_sq, *(v for s, v in state.since.items() if s >= size)])
        w = math.sqrt(state.since[size])
        for s in state.since:
            if s <= size:
                state.since[s] = 0.0
        return w

    def delay_s(self, ranks: tuple[int, ...], group_size: int, sampled: bool) -> float:
        """Extra wait of a rendezvous of ``ranks`` (simulated) in a group of ``group_size``:
        the slowest member's noise plus its persistent lateness not yet waited for."""
        if group_size <= 1:
            return 0.0
        return self._noise_s(ranks, group_size, sampled) + self._persistent_s(ranks, group_size, sampled)

    def _noise_s(self, ranks: tuple[int, ...], group_size: int, sampled: bool) -> float:
        if self.cv <= 0:
            return 0.0
        work = [self._since(r, group_size) for r in ranks]
        if sampled:
            draws = self.rng.standard_normal(len(ranks))
            return self.cv * max(0.0, max(float(z) * w for z, w in zip(draws, work)))
        return self.cv * max(work) * expected_max_excess(group_size)

    def _persistent_s(self, ranks: tuple[int, ...], group_size: int, sampled: bool) -> float:
        if self.persistent_cv <= 0:
            return 0.0
        states = [self._state(r) for r in ranks]
        marks = [s.mark(group_size) for s in states]
        work = [s.work_s - m[0] for s, m in zip(states, marks)]  # since the group last met
        if sampled:  # every member is one device: its own speed, drawn once for the run
            behind = max(max(0.0, self.speed(r)) * w for r, w in zip(ranks, work))
        else:
            behind = expected_max_excess(group_size) * max(work)
        behind *= self.persistent_cv
        waited = max(s.waited_s - m[1] for s, m in zip(states, marks))  # at smaller groups since
        late = max(0.0, behind - waited)
        for s in states:  # the members leave together: re-aligned for every size up to this one
            s.waited_s += late
            for size in [size for size in s.aligned if size <= group_size] + [group_size]:
                s.aligned[size] = (s.work_s, s.waited_s)
        return late

    def speed(self, rank: int) -> float:
        """The persistent standard-normal draw of device ``rank`` (slower when positive): one
        per device and seed, whatever order the ranks first meet in."""
        z = self._speed.get(rank)
        if z is None:
            z = self._speed[rank] = float(np.random.default_rng((self.seed, rank)).standard_normal())
        return z

