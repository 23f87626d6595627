"""Gradient compression of the data-parallel gradient reduction (``strategy.grad_compression``
on ``ddp`` and ``zero`` stages 1 and 2; ``docs/compression.md`` has the whole account).

A unit's gradient reduction (DDP's all-reduce, ZeRO-1's step-end reduce-scatter, ZeRO-2's
per-micro-batch reduce-scatter) is replaced by what the compression method really runs:

- ``quantize``: the gradient is cast to a narrower type before the same collective and cast
  back after it (PyTorch ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``:
  ``fp16_compress_hook`` / ``bf16_compress_hook``: ``buffer.to(dtype)``, the all-reduce, then
  ``decompressed_tensor.copy_(...)``). No error feedback (those hooks keep none).
- ``topk``: each rank keeps its k largest-magnitude entries (values and int64 indices from
  ``torch.topk``) and, since the sum of sparse vectors with different supports is not sparse,
  the ranks all-gather the (value, index) pairs and each rank scatter-adds them into a dense
  gradient (GRACE, Xu et al. 2021, ``grace_dl/dist/compressor/topk.py``: ``sparsify`` /
  ``desparsify``, with its ``allgather`` communicator; Shi et al. 2019, "Understanding Top-k
  Sparsification in Distributed Deep Learning", arXiv 1911.08772: top-k sparse gradients
  are aggregated with all-gather). Error feedback: the residual ``g - C(g)`` is kept and added
  to the next gradient (GRACE ``grace_dl/dist/memory/residual.py``; Stich et al. 2018).
- ``powersgd``: per weight matrix M (n x m, ``tensor.view(n, -1)``) one power-iteration step
  of rank r: P = M Q, all-reduce P, orthogonalise P, Q = Mᵀ P, all-reduce Q, M ≈ P Qᵀ; 1-D
  tensors (norms, biases) are all-reduced uncompressed; error feedback of the whole gradient
  (PyTorch ``ddp_comm_hooks/powerSGD_hook.py``: ``powerSGD_hook``, ``PowerSGDState``:
  ``error_dict`` of the bucket's size, ``p_memory_dict`` / ``q_memory_dict`` kept for the warm
  start, ``_should_compress`` with ``min_compression_rate = 2``; Vogels et al. 2019).

``ratio`` is compressed payload bytes / uncompressed bytes of the gradient a rank contributes
(so a top-k ratio counts the indices). ``ratio: 1`` is no compression at all: nothing here runs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hzpsim.config import from_mapping, to_mapping
from hzpsim.strategies._layers import Work

if TYPE_CHECKING:
    from hzpsim.model import Model

#: torch.topk returns int64 indices; GRACE sends them as they come (``topk.py::sparsify``).
TOPK_INDEX_BYTES = 8.0
#: HBM passes over the gradient of one top-k selection. HAND-SET: a radix select over 8-bit
#: digits of a 32-bit key needs 4 histogram passes (the kernel torch.topk picks for a given
#: size was not read or measured here); plausible range 1-8.
TOPK_SELECT_PASSES = 4.0
#: PowerSGD compresses a matrix only if that shrinks it at least this many times
#: (``powerSGD_hook.py::PowerSGDState.min_compression_rate``, default 2); above 1/this ratio
#: nothing is compressed, so ``powersgd`` accepts ratios up to 0.5 (and 1, no compression).
POWERSGD_MIN_COMPRESSION_RATE = 2.0
#: Adaptive mode: the candidate ratios of a unit are ratio x 2^j for these j, steps of sqrt(2) over
#: 8x either way (clipped to the
#: method's range), L-GreCo's per-layer "compression levels" (hand-set grid).
ADAPTIVE_LEVELS = tuple(j / 2 for j in range(-6, 7))
#: Adaptive mode: the error axis of the dynamic program is cut in this many bins (L-GreCo
#: discretises the error the same way; hand-set resolution).
ADAPTIVE_ERROR_BINS = 1000


@dataclass(frozen=True)
class GradCompression:
    """``strategy.grad_compression``: how the data-parallel gradient reduction is compressed."""

    method: Literal["powersgd", "topk", "quantize"] = "powersgd"  # what runs (module docstring)
    ratio: float = 1.0  # compressed / uncompressed payload bytes, in (0, 1]; 1 = off
    per_layer: Literal["fixed", "adaptive"] = "fixed"  # one ratio for all, or L-GreCo's per-layer choice

    def validate(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"ratio: must be in (0, 1], got {self.ratio}")
        limit = 1.0 / POWERSGD_MIN_COMPRESSION_RATE
        if self.method == "powersgd" and limit < self.ratio < 1.0:
            raise ValueError(f"ratio: powersgd compresses a matrix only when that at least halves it "
                             f"(PowerSGDState.min_compression_rate = 2): give at most {limit} (or 1 for off), "
                             f"got {self.ratio}")

    @property
    def active(self) -> bool:
        return self.ratio < 1.0


def resolved(compression: GradCompression | None) -> GradCompression | None:
    """The setting as simulated: ``ratio: 1`` is no compression (None)."""
    return compression if compression is not None and compression.active else None


# ------------------------------------------------------------------ the units' matrices


@dataclass(frozen=True)
class UnitShape:
    """A unit's parameters as PowerSGD sees them: its weight matrices (rows, columns) and the
    elements of its 1-D tensors (norms, biases)."""

    matrices: tuple[tuple[float, float], ...]
    vector_elements: float

    @property
    def elements(self) -> float:
        return sum(n * m for n, m in self.matrices) + self.vector_elements


def unit_shapes(model: Model, names: list[str], params: list[float]) -> tuple[UnitShape, ...]:
    """Each unit's matrices (no model parallelism: ddp and zero have none), from the model's
    GEMM weights (``Model.layer_linears``, stored as nn.Linear's (out, in)); what is left of the
    unit's parameters are 1-D tensors."""
    h = model.hidden_size
    out = []
    for name, total in zip(names, params):
        if name == "embed":
            matrices = [(float(model.vocab_size), float(h))]
            if model.embedding_params() > model.vocab_size * h:
                matrices.append((float(model.position_table_rows), float(h)))
        elif name == "head":
            matrices = [(float(model.vocab_size), float(h))] if model.head_params() else []
        else:
            i = int(name.removeprefix("layer"))
            linears = model.layer_linears(i)
            matrices = [(float(n), float(k)) for block in ("attention", "mlp", "router")
                        for k, n, _ in linears[block]]
        dense = sum(n * m for n, m in matrices)
        out.append(UnitShape(tuple(matrices), max(total - dense, 0.0)))
    return tuple(out)


# ------------------------------------------------------------------ one unit's compression


@dataclass(frozen=True)
class UnitCompression:
    """What compressing one unit's gradient costs. Bytes are per reduction (one unit, one call
    of the method); ``elements`` the unit's gradient elements, ``b`` their bytes."""

    method: str
    ratio: float  # achieved: payload bytes / uncompressed bytes
    elements: float
    b: float
    rank: int = 0  # powersgd
    p_bytes: float = 0.0  # powersgd: first all-reduce (P of the compressed matrices + the uncompressed rest)
    q_bytes: float = 0.0  # powersgd: second all-reduce (Q)
    gemm_flops: float = 0.0  # powersgd: one of M Q, Mᵀ P, P Qᵀ (2 n m r summed over the compressed matrices)
    orthogonalize_bytes: float = 0.0  # powersgd: Gram-Schmidt over the columns of P
    compressed_matrices: int = 0
    p_factor_bytes: float = 0.0  # powersgd: the P factors alone (p_bytes less the uncompressed tensors)

    @property
    def payload_bytes(self) -> float:
        return self.ratio * self.elements * self.b

    @property
    def error_feedback_bytes(self) -> float:
        """The residual kept between steps: the whole gradient (powersgd, topk), none (quantize)."""
        return 0.0 if self.method == "quantize" else self.elements * self.b

    @property
    def factor_bytes(self) -> float:
        """PowerSGD's P and Q kept between steps (``p_memory_dict``, ``q_memory_dict``)."""
        return self.p_factor_bytes + self.q_bytes if self.method == "powersgd" else 0.0

    def transient_bytes(self, group: int) -> float:
        """Bytes live from the compress kernel to the decompress kernel: the cast copy
        (quantize), the pairs sent and the N pairs gathered (topk), the clone of the gradient the
        error update needs (powersgd: ``input_tensor_cp``)."""
        if self.method == "quantize":
            return self.payload_bytes
        if self.method == "topk":
            return (1 + group) * self.payload_bytes
        return self.elements * self.b

    def topk_elements(self) -> float:
        return self.payload_bytes / (self.b + TOPK_INDEX_BYTES)

    # -- the kernels (compute stream), each with the bytes or FLOPs it costs -------------------

    def compress_work(self) -> Work:
        """After the unit's backward, before the (first) collective."""
        x, b = self.elements, self.b
        if self.method == "quantize":  # .to(dtype): read b, write ratio*b per element
            return Work(bytes_accessed=x * b + self.payload_bytes)
        if self.method == "topk":
            # residual add (read 2, write 1), selection passes, the pairs written, the residual
            # kept (g copied, the sent entries zeroed: read 1, write 1)
            return Work(bytes_accessed=(3 + TOPK_SELECT_PASSES + 2) * x * b + self.payload_bytes)
        # powersgd: error added (read 2, write 1), the clone (read 1, write 1), P = M Q
        return Work(gemm=self.gemm_flops, bytes_accessed=5 * x * b)

    def middle_work(self) -> Work:
        """PowerSGD between its all-reduces: orthogonalise P, Q = Mᵀ P."""
        return Work(gemm=self.gemm_flops, bytes_accessed=self.orthogonalize_bytes)

    def decompress_work(self, group: int, output_fraction: float) -> Work:
        """After the (last) collective: ``output_fraction`` of the unit is this rank's result
        (1 after an all-reduce or all-gather, 1/N after a reduce-scatter)."""
        x, b = self.elements, self.b
        if self.method == "quantize":  # copy_ back: read ratio*b, write b per output element
            return Work(bytes_accessed=output_fraction * (x * b + self.payload_bytes))
        if self.method == "topk":
            # zeros of the output, read every rank's pairs, scatter-add their values
            k = self.topk_elements()
            return Work(bytes_accessed=output_fraction * x * b + group * (self.payload_bytes + k * b))
        # powersgd: M = P Qᵀ, error = clone - M (read 2, write 1); the whole matrix whatever
        # ``output_fraction``, since the error feedback needs it on every rank
        return Work(gemm=self.gemm_flops, bytes_accessed=3 * x * b)

    def kernels(self, stage: str) -> float:
        """Eager kernels each stage launches (hand-counted from the hooks named above)."""
        if self.method == "quantize":
            return 1.0
        if self.method == "topk":
            return {"compress": 5.0, "decompress": 2.0}[stage]
        extra = {"compress": 2.0, "middle": 0.0, "decompress": 1.0}[stage]
        per_matrix = 2.0 if stage == "middle" else 1.0
        return extra + per_matrix * self.compressed_matrices


def _powersgd_bytes(shape: UnitShape, rank: int) -> tuple[float, float, float, int]:
    """(P elements with the uncompressed tensors, Q elements, P elements alone, compressed
    matrices) at ``rank``: a matrix is compressed when (n + m) r <= n m / min_compression_rate."""
    q = p_only = 0.0
    plain = shape.vector_elements
    count = 0
    for n, m in shape.matrices:
        if (n + m) * rank * POWERSGD_MIN_COMPRESSION_RATE <= n * m:
            p_only += n * rank
            q += m * rank
            count += 1
        else:
            plain += n * m
    return p_only + plain, q, p_only, count


def _powersgd_rank(shape: UnitShape, ratio: float) -> int:
    """The largest rank whose payload stays within ``ratio`` of the unit's bytes (at least 1)."""
    target = ratio * shape.elements
    payload = lambda r: sum(_powersgd_bytes(shape, r)[:2])  # noqa: E731
    hi = max(int(max((min(n, m) for n, m in shape.matrices), default=1)), 1)
    lo = 1
    if payload(1) > target:
        return 1
    while lo < hi:  # payload is non-decreasing in the rank
        mid = (lo + hi + 1) // 2
        if payload(mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


def unit_compression(method: str, ratio: float, shape: UnitShape, b: float) -> UnitCompression | None:
    """One unit compressed at ``ratio`` (None: nothing of it can be compressed)."""
    x = shape.elements
    if x <= 0:
        return None
    if method != "powersgd":
        return UnitCompression(method, ratio, x, b)
    if not shape.matrices:
        return None
    rank = _powersgd_rank(shape, ratio)
    p, q, p_only, count = _powersgd_bytes(shape, rank)
    if count == 0:
        return None
    flops = sum(2.0 * n * m * rank for n, m in shape.matrices if (n + m) * rank * POWERSGD_MIN_COMPRESSION_RATE <= n * m)
    # Gram-Schmidt (powerSGD_hook.py::_orthogonalize_gram_schmidt): column i reads and writes the
    # r - i columns after it once, about r^2/2 columns of n elements read and written
    ortho = rank * p_only * b  # p_only = r x (rows of the compressed matrices): r^2 n elements
    return UnitCompression(method, (p + q) / x, x, b, rank=rank, p_bytes=p * b, q_bytes=q * b, gemm_flops=flops,
                           orthogonalize_bytes=ortho, compressed_matrices=count, p_factor_bytes=p_only * b)


# ------------------------------------------------------------------ the plan: a ratio per unit


def proxy_error(unit: UnitCompression | None, shape: UnitShape) -> float:
    """L-GreCo's per-layer error ||g - C(g)||², with no gradient to measure: every element's
    gradient has the same variance (the unit's energy is its element count) and each method's
    error is its worst case for that energy:

    - topk keeping k of x entries keeps at least k/x of the energy (the k largest squares are at
      least their average): error <= x - k;
    - powersgd's best rank-r approximation of an n x m matrix keeps at least r/min(n, m) of its
      energy (Eckart-Young-Mirsky: the r largest squared singular values are at least their
      average): error <= n m (1 - r/min(n, m)) per compressed matrix (one power iteration
      with warm start approaches that best approximation; Vogels et al. 2019);
    - quantize to q bits: the uniform quantiser's mean squared error falls 4x per bit (6 dB per
      bit; Gersho & Gray 1992): error = x 4^-q, with q = ratio x 8 b.
    """
    if unit is None:
        return 0.0
    x = unit.elements
    if unit.method == "topk":
        return x - unit.topk_elements()
    if unit.method == "quantize":
        return x * 4.0 ** (-unit.ratio * 8 * unit.b)
    r = unit.rank
    return sum(n * m * (1 - min(r, min(n, m)) / min(n, m)) for n, m in shape.matrices
               if (n + m) * r * POWERSGD_MIN_COMPRESSION_RATE <= n * m)


@dataclass(frozen=True)
class CompressionPlan:
    """Each unit's compression (None: that unit is reduced uncompressed) and what adaptive mode
    chose it against: the uniform setting's proxy error (the budget) and payload."""

    units: tuple[UnitCompression | None, ...]
    error: float  # the plan's proxy error (sum over units)
    budget_error: float  # the uniform ratio's proxy error
    uniform_bytes: float  # the uniform ratio's payload bytes (sum over units)

    @property
    def payload_bytes(self) -> float:
        return math.fsum(self.payload_of(u) for u in range(len(self.units)))

    def payload_of(self, u: int) -> float:
        unit = self.units[u]
        return unit.payload_bytes if unit is not None else 0.0

    def static_bytes(self) -> float:
        """Error feedback and PowerSGD's factors, held for the whole run."""
        return math.fsum(u.error_feedback_bytes + u.factor_bytes for u in self.units if u is not None)


def _levels(method: str, ratio: float) -> list[float]:
    top = 1.0 / POWERSGD_MIN_COMPRESSION_RATE if method == "powersgd" else 1.0
    return sorted({min(ratio * 2.0 ** j, top) for j in ADAPTIVE_LEVELS})


@functools.lru_cache(maxsize=256)
def plan(compression: GradCompression, shapes: tuple[UnitShape, ...], b: float) -> CompressionPlan:
    """The units' compression: ``fixed``, every unit at ``ratio``; ``adaptive``, L-GreCo's
    dynamic program (Markov et al. 2022, arXiv 2210.17357): over the units' candidate
    levels (:data:`ADAPTIVE_LEVELS`), the least total payload whose total proxy error
    (:func:`proxy_error`) stays within the uniform ``ratio``'s. So in adaptive mode ``ratio`` is
    the uniform reference: the plan moves at most its bytes with at most its error."""
    method = compression.method
    uniform = tuple(unit_compression(method, compression.ratio, s, b) for s in shapes)
    budget = math.fsum(proxy_error(u, s) for u, s in zip(uniform, shapes))
    uniform_bytes = math.fsum(u.payload_bytes for u in uniform if u is not None)
    if compression.per_layer == "fixed":
        return CompressionPlan(uniform, budget, budget, uniform_bytes)
    options: list[list[tuple[float, float, UnitCompression | None]]] = []
    for shape in shapes:
        choices = {}
        for level in _levels(method, compression.ratio):
            unit = unit_compression(method, level, shape, b)
            payload = unit.payload_bytes if unit is not None else shape.elements * b
            choices[(payload, proxy_error(unit, shape))] = unit
        options.append([(p, e, u) for (p, e), u in sorted(choices.items(), key=lambda kv: kv[0])])
    chosen = _knapsack(options, budget)
    if chosen is None:
        return CompressionPlan(uniform, budget, budget, uniform_bytes)
    units = tuple(options[i][j][2] for i, j in enumerate(chosen))
    error = math.fsum(options[i][j][1] for i, j in enumerate(chosen))
    payload = math.fsum(options[i][j][0] for i, j in enumerate(chosen))
    uniform_payload = math.fsum(u.payload_bytes if u is not None else s.elements * b for u, s in zip(uniform, shapes))
    if error > budget * (1 + 1e-12) or payload >= uniform_payload * (1 - 1e-12):
        return CompressionPlan(uniform, budget, budget, uniform_bytes)  # nothing better than uniform
    return CompressionPlan(units, error, budget, uniform_bytes)


def _knapsack(options: list[list[tuple[float, float, UnitCompression | None]]], budget: float) -> list[int] | None:
    """Per unit one option (payload, error, _) with the least total payload and the sum of the
    errors, each rounded up to a bin of budget / :data:`ADAPTIVE_ERROR_BINS`, within the budget
    (rounding up keeps the true error within it): a dynamic program over (unit, bins used)."""
    if budget <= 0:
        return None
    step = budget / ADAPTIVE_ERROR_BINS
    bins = [[math.ceil(e / step - 1e-9) for _, e, _ in unit] for unit in options]
    limit = ADAPTIVE_ERROR_BINS
    inf = math.inf
    best = [0.0] + [inf] * limit  # least payload with exactly this many bins used
    picks: list[list[int]] = []
    for unit, unit_bins in zip(options, bins):
        nxt = [inf] * (limit + 1)
        pick = [-1] * (limit + 1)
        for used, payload in enumerate(best):
            if payload == inf:
                continue
            for j, ((p, _, _), w) in enumerate(zip(unit, unit_bins)):
                total = used + w
                if total <= limit and payload + p < nxt[total]:
                    nxt[total], pick[total] = payload + p, j
        best = nxt
        picks.append(pick)
    end = min(range(limit + 1), key=lambda k: (best[k], k))
    if best[end] == inf:
        return None
    chosen = []
    for unit_bins, pick in zip(reversed(bins), reversed(picks)):
        j = pick[end]
        chosen.append(j)
        end -= unit_bins[j]
    return chosen[::-1]


# ------------------------------------------------------------------ labels and the search


def label(base: str, resolved: dict) -> str:
    """``base`` with the compression added, e.g. ``ddp+powersgd0.01``; ``base`` alone when off."""
    setting = resolved.get("grad_compression")
    if isinstance(setting, GradCompression):  # a search candidate's fields hold the setting itself
        setting = to_mapping(setting)
    if not setting:
        return base
    adaptive = "~" if setting.get("per_layer") == "adaptive" else ""
    return f"{base}+{setting['method']}{adaptive}{setting['ratio']:g}"


def parse_option(text: str) -> GradCompression:
    """``METHOD:RATIO`` or ``METHOD:RATIO:adaptive`` (a ``--space grad_compression=`` value) as a
    setting; ValueError naming the problem."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"{text!r} is not METHOD:RATIO or METHOD:RATIO:PER_LAYER")
    try:
        ratio = float(parts[1])
    except ValueError:
        raise ValueError(f"{text!r}: ratio {parts[1]!r} is not a number") from None
    option: dict[str, object] = {"method": parts[0], "ratio": ratio}
    if len(parts) == 3:
        option["per_layer"] = parts[2]
    return from_mapping(GradCompression, option, "grad_compression")


def search_options(space: object) -> list[GradCompression]:
    """The ``grad_compression`` settings ``hzpsim search`` tries (``Space.grad_compression``,
    empty by default: nothing compressed is searched unless asked)."""
    return [parse_option(text) for text in getattr(space, "grad_compression", ())]
