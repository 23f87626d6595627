"""Ranks that run different documents wait for each other where they synchronise.

With variable-length sequences (``training.sequence_lengths``, ``model/sequences.py``) every
data-parallel rank's micro-batch costs what its own rows' attention costs. The strategy
gives each simulated lane its own rank's lengths; the ranks that are not simulated (a
symmetric run simulates one data-parallel rank for all) are tracked here, as a lag: how much
later than the simulated lane each data-parallel rank reaches the same point of the program.

- A finished compute op of micro-batch ``b`` adds to every rank's lag the difference between
  that rank's attention time at its own lengths and the lane's (the rest of the op, GEMMs and
  memory-bound kernels, costs the same on every rank: every row holds ``seq_len`` tokens).
- A collective whose group spans data-parallel ranks starts when its slowest member arrives:
  the lane waits the largest lag among the group's ranks (never less than zero), after which
  the group's ranks are level with the lane and the others are that much less behind.

That is the wait Zeppelin (Chen et al. 2025, arXiv 2509.21841, §2) describes for data
parallelism: ZeRO-3's per-layer gathers and reductions over every rank re-synchronise each
layer, so the slowest rank's attention sets every layer's pace; DDP meets only at the gradient
buckets, and a pipeline's stages of one replica share its documents (no wait between them).
A rank's attention time is priced by the same kernel model as the lane's
(``ComputeModel.attention_s``), at its own token-weighted mean document length.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hzpsim.hardware.compute import ComputeModel
from hzpsim.model.kernels import Attention, Shape, packed
from hzpsim.model.ops import Op, OpGraph

WAIT_KEY = "wait.sequence_lengths"
"""The ``time_breakdown_s`` key of the time a rank waits for ranks with longer documents."""


class LengthWaits:
    """Lags of the data-parallel ranks behind each simulated lane, and the waits they cause."""

    def __init__(self, graph: OpGraph, compute_model: ComputeModel) -> None:
        meta: dict[str, Any] = graph.meta["sequence_lengths"]
        self.graph = graph
        self.compute_model = compute_model
        self.tokens = np.asarray(meta["effective_tokens"], dtype=float)  # [step * micro-batches + mb, dp]
        self.dp, self.stride = int(meta["dp"]), int(meta["data_stride"])
        self.others = np.ones(self.dp, dtype=bool)  # the data-parallel ranks no lane simulates
        for lane in graph.weights:
            self.others[self.data_rank(lane)] = False
        self.lag = {lane: np.zeros(self.dp) for lane in graph.weights}
        self._extra: dict[tuple[int, int, int], np.ndarray] = {}
        self._members: dict[str, np.ndarray] = {}
        self.waits: dict[int, list[tuple[float, float]]] = {lane: [] for lane in graph.weights}

    def data_rank(self, device: int) -> int:
        return (device // self.stride) % self.dp

    def worked(self, op: Op) -> None:
        """``op`` (a compute op of micro-batch ``op.batch`` on one lane) finished."""
        if not self.others.any():
            return
        lane = op.ranks[0]
        own = self.data_rank(lane)
        key = (id(op.shapes), op.batch, own)
        extra = self._extra.get(key)
        if extra is None:
            extra = self._extra[key] = self._extra_s(op, own)
        self.lag[lane] += extra

    def _extra_s(self, op: Op, own: int) -> np.ndarray:
        """Each rank's attention time in ``op`` minus the lane's (zero for simulated ranks)."""
        attention: tuple[Shape, ...] = tuple(s for s in op.shapes if isinstance(s, Attention))
        row = self.tokens[op.batch]
        mine = float(row[own])
        base = sum(self.compute_model.attention_s(a) for a in attention if isinstance(a, Attention))
        out = np.zeros(self.dp)
        seconds: dict[float, float] = {}
        for r in np.flatnonzero(self.others):
            tokens = float(row[r])
            s = seconds.get(tokens)
            if s is None:
                s = seconds[tokens] = sum(self.compute_model.attention_s(a) for a in packed(attention, mine, tokens)
                                          if isinstance(a, Attention)) - base
            out[r] = s
        return out

    def _group_members(self, group: str) -> np.ndarray:
        """The data-parallel ranks no lane simulates among ``group``'s members."""
        members = self._members.get(group)
        if members is None:
            ranks = self.graph.groups[group]
            if isinstance(ranks, range):
                devices = np.arange(ranks.start, ranks.stop, ranks.step)
            else:
                devices = np.asarray(ranks)
            data = np.unique((devices // self.stride) % self.dp)
            members = self._members[group] = data[self.others[data]]
        return members

    def rendezvous(self, op: Op, now_s: float) -> float:
        """The wait of collective ``op`` for its group's slowest rank (seconds), the lags
        levelled after it."""
        if op.collective == "send_recv" or op.group is None:
            return 0.0
        members = self._group_members(op.group)
        if not members.size:
            return 0.0
        wait = max(0.0, max(float(self.lag[lane][members].max()) for lane in op.ranks))
        for lane in op.ranks:
            lag = self.lag[lane]
            lag -= wait
            lag[members] = 0.0
            if wait > 0:
                self.waits[lane].append((now_s, now_s + wait))
        return wait
