"""Rank placement and named parallel groups (Megatron order by default).

Megatron-LM (``megatron/core/parallel_state.py``, ``initialize_model_parallel(order=
"tp-cp-ep-dp-pp")`` and ``RankGenerator``) lays ranks out innermost first::

    global_rank = tp + TP·(cp + CP·(ep + EP·(dp + DP·pp)))

For the dense ("decoder") groups Megatron builds that generator with ep = 1, i.e. the order
reduces to tp-cp-dp-pp, which is our default. Expert layers (MoE parallel folding) use a second
generator over the *same* ranks with order etp-ep-edp-pp (cp = 1, tp = expert-TP, dp =
expert-DP = world / (ETP·EP·PP)); :func:`expert_placement` builds that one. Because pp is the
outermost dimension of both, the pipeline stages coincide.

Megatron's docstring example (16 GPUs, tp = 2, pp = 4 → dp = 2)::

    dp groups: [g0, g2], [g1, g3], [g4, g6], [g5, g7], ...
    tp groups: [g0, g1], [g2, g3], ...
    pp groups: [g0, g4, g8, g12], [g1, g5, g9, g13], ...

``tests/test_cluster.py`` reproduces it. Groups are returned as sorted tuples and ``groups()``
lists them ordered by their smallest rank, which matches Megatron's enumeration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .topology import Topology

MEGATRON_ORDER: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER: tuple[str, ...] = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class Placement:
    """Named parallel dimensions, innermost (fastest-varying rank) first."""

    dims: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [n for n, _ in self.dims]
        if len(set(names)) != len(names):
            raise ValueError(f"dims: duplicate dimension names in {names}")
        for n, s in self.dims:
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1:
                raise ValueError(f"dims: size of {n!r} must be a positive integer, got {s!r}")

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_sizes(
        cls, num_devices: int, order: Sequence[str] = DEFAULT_ORDER, **sizes: int
    ) -> Placement:
        """Placement with ``order`` (innermost first); unnamed dims have size 1.

        One size may be ``-1`` (inferred from ``num_devices``). ValueError if a size names a
        dimension not in ``order``, or if the product of sizes is not ``num_devices``.
        """
        order = tuple(order)
        unknown = [k for k in sizes if k not in order]
        if unknown:
            raise ValueError(f"{unknown[0]}: not a dimension of order {'-'.join(order)}")
        vals = {n: sizes.get(n, 1) for n in order}
        infer = [n for n, v in vals.items() if v == -1]
        if len(infer) > 1:
            raise ValueError(f"{infer[1]}: only one size may be -1 (inferred)")
        for n, v in vals.items():
            if v != -1 and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
                raise ValueError(f"{n}: size must be a positive integer, got {v!r}")
        known = prod(v for v in vals.values() if v != -1)
        if infer:
            if num_devices % known:
                raise ValueError(
                    f"{infer[0]}: cannot infer, num_devices={num_devices} is not divisible by "
                    f"the product of the other sizes ({known})"
                )
            vals[infer[0]] = num_devices // known
        total = prod(vals.values())
        if total != num_devices:
            desc = "×".join(f"{n}={v}" for n, v in vals.items())
            raise ValueError(
                f"product of parallel sizes {desc} = {total} != num_devices = {num_devices}"
            )
        return cls(tuple((n, int(v)) for n, v in vals.items()))

    # -- basic arithmetic -----------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        return prod(s for _, s in self.dims)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.dims)

    def size(self, dim: str) -> int:
        for n, s in self.dims:
            if n == dim:
                return s
        raise ValueError(f"unknown dimension {dim!r} (known: {', '.join(self.names)})")

    def _strides(self) -> dict[str, int]:
        out, stride = {}, 1
        for n, s in self.dims:
            out[n] = stride
            stride *= s
        return out

    def coord(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.num_devices:
            raise ValueError(f"rank {rank} out of range [0, {self.num_devices})")
        out, r = {}, int(rank)
        for n, s in self.dims:
            out[n] = r % s
            r //= s
        return out

    def rank(self, **coord: int) -> int:
        """Rank of a coordinate; omitted dimensions are 0."""
        strides = self._strides()
        r = 0
        for n, c in coord.items():
            if n not in strides:
                raise ValueError(f"unknown dimension {n!r} (known: {', '.join(self.names)})")
            s = self.size(n)
            if not 0 <= c < s:
                raise ValueError(f"{n}: coordinate {c} out of range [0, {s})")
            r += c * strides[n]
        return r

    # -- groups ---------------------------------------------------------------------------------

    def _norm_dims(self, dims: str | Sequence[str]) -> tuple[str, ...]:
        ds = (dims,) if isinstance(dims, str) else tuple(dims)
        for d in ds:
            if d not in self.names:
                raise ValueError(f"unknown dimension {d!r} (known: {', '.join(self.names)})")
        return ds

    def group(self, dims: str | Sequence[str], rank: int) -> tuple[int, ...] | range:
        """Ranks that differ from ``rank`` only in ``dims``, sorted (a ``range`` when evenly
        spaced, so that a group of millions of ranks takes no memory)."""
        ds = self._norm_dims(dims)
        c = self.coord(rank)
        base = self.rank(**{n: v for n, v in c.items() if n not in ds})
        strides = self._strides()
        spaced = [d for d in ds if self.size(d) > 1]
        if len(spaced) <= 1:  # one dimension: evenly spaced by its stride
            d = spaced[0] if spaced else ds[0]
            return range(base, base + self.size(d) * strides[d], strides[d])
        offs = np.zeros(1, dtype=np.int64)
        for d in ds:
            offs = (offs[:, None] + np.arange(self.size(d)) * strides[d]).ravel()
        members = np.sort(base + offs)
        gaps = np.diff(members)
        if gaps.size and np.all(gaps == gaps[0]):  # e.g. adjacent dimensions (dp x cp, tp first)
            return range(int(members[0]), int(members[-1]) + 1, int(gaps[0]))
        return tuple(int(x) for x in members)

    def groups(self, dims: str | Sequence[str]) -> list[tuple[int, ...]]:
        """All groups along ``dims`` (each sorted), ordered by their smallest rank."""
        ds = self._norm_dims(dims)
        # numpy C-order: last axis fastest, so reverse (outermost first).
        shape = tuple(s for _, s in reversed(self.dims))
        axes_names = [n for n, _ in reversed(self.dims)]
        arr = np.arange(self.num_devices, dtype=np.int64).reshape(shape)
        keep = [i for i, n in enumerate(axes_names) if n not in ds]
        grp = [i for i, n in enumerate(axes_names) if n in ds]
        gsize = prod(self.size(d) for d in ds)
        mat = np.sort(arr.transpose(keep + grp).reshape(-1, gsize), axis=1)
        mat = mat[np.argsort(mat[:, 0], kind="stable")]
        return [tuple(int(x) for x in row) for row in mat]


def nested_groups(group: Sequence[int], size: int) -> list[tuple[int, ...]]:
    """Consecutive blocks of ``size`` inside ``group`` (e.g. AsyncHZP param groups in a DP group).

    ValueError if ``size`` does not divide ``len(group)``.
    """
    n = len(group)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"size: must be a positive integer, got {size!r}")
    if n % size:
        raise ValueError(f"size: {size} does not divide the group size {n}")
    g = tuple(int(r) for r in group)
    return [g[i : i + size] for i in range(0, n, size)]


def strided_groups(group: Sequence[int], size: int) -> list[tuple[int, ...]]:
    """The complement of :func:`nested_groups`: ranks at the same position in each block.

    With ``blocks = nested_groups(group, size)``, ``strided_groups(group, size)[j]`` holds the
    j-th rank of every block (the cross-block replica group, e.g. HSDP's replicate group).
    """
    blocks = nested_groups(group, size)
    return [tuple(b[j] for b in blocks) for j in range(size)]


def group_levels(topology: Topology, ranks: Sequence[int]) -> tuple[str, ...]:
    """Topology levels a group's traffic crosses, innermost first (see ``GroupSpan.levels``)."""
    return topology.span(ranks).levels


def expert_placement(num_devices: int, ep: int, expert_tp: int = 1, pp: int = 1) -> Placement:
    """MoE parallel folding: the expert-layer placement over the same ranks.

    Megatron's expert RankGenerator uses order etp-ep-edp-pp with expert-DP
    edp = num_devices / (expert_tp · ep · pp). Groups: ``"ep"`` (all-to-all), ``"etp"``,
    ``"edp"`` (expert gradient reduction).
    """
    return Placement.from_sizes(
        num_devices, order=("etp", "ep", "edp", "pp"), etp=expert_tp, ep=ep, edp=-1, pp=pp
    )
