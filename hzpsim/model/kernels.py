"""Kernel shapes a compute op carries, so that the cost model sees what runs, not FLOP totals.

A compute op's GEMMs are kept as :class:`Gemm` shapes (M, N, K and how many times the same
GEMM runs) and its attention as :class:`Attention` shapes (heads, query and key lengths, head
dimension, causal or not, forward or backward). Strategies build them in
``strategies/_model_parallel.py`` from the model's linears (``Model.layer_linears``); the
simulator times them in ``hardware/compute.py``. Sums, scalings and merges keep exact FLOP totals:
``calls`` is a float, so splitting an op into fractions (context-parallel halves) or merging
layers only changes counts.

Shapes are plain frozen tuples: an op graph of hundreds of thousands of ops shares them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple


class Gemm(NamedTuple):
    """``calls`` kernels, each a batch of ``batch`` (M×K)·(K×N) products run as one batched or
    grouped GEMM (cuBLAS strided-batched: the unfused attention's score and value products,
    an MoE layer's experts), whose tiles share the SMs: ``2·M·N·K·batch·calls`` FLOPs."""

    m: float
    n: float
    k: float
    calls: float = 1.0
    batch: float = 1.0
    accumulate: bool = False
    """The epilogue adds the product into an fp32 buffer (C read and written in fp32, 8 bytes
    per output element, whatever the operands): a weight gradient accumulated into the fp32
    ``main_grad`` inside the GEMM (Megatron's gradient-accumulation fusion)."""

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch * self.calls

    def backward(self, accumulate: bool = False) -> tuple[Gemm, Gemm]:
        """The data-gradient (M×N)·(N×K) and weight-gradient (K×M)·(M×N) GEMMs of this one;
        with ``accumulate`` the weight gradient accumulates into fp32 in the GEMM itself
        (:attr:`accumulate`: this GEMM's K×N operand is a weight)."""
        return (Gemm(self.m, self.k, self.n, self.calls, self.batch),
                Gemm(self.k, self.n, self.m, self.calls, self.batch, accumulate))


def band_pairs_per_query(seq_kv: float, window: float, causal: bool = True) -> float:
    """Query-key pairs per query of attention over ``seq_kv`` keys: s/2 causal, s not; with a
    sliding window w < s, causal, the band w - w²/2s (each of the first w queries sees its
    prefix, every later one w keys), and w not (``window`` 0: none)."""
    if window and window < seq_kv:
        return window - window * window / (2 * seq_kv) if causal else float(window)
    return seq_kv / 2 if causal else float(seq_kv)


class Attention(NamedTuple):
    """``calls`` attention kernel calls, each over ``heads`` (batch × heads of this rank) queries
    of length ``seq_q`` over ``seq_kv`` keys, head dimensions ``head_dim`` (Q·K) and
    ``v_head_dim`` (P·V); ``causal`` halves the work; ``kernel`` is the kernel family
    (``training.attention_kernel``: flash2, flash3, cudnn, triton, or auto = the device's usual
    one); ``backward`` marks the gradient kernel. ``flops`` is the model's count (the backward
    twice the forward); ``kernel_flops`` what a flash kernel executes (the backward recomputes
    the scores: 5 matrix products to the forward's 2, 2.5x), the convention its published
    speeds are on (FlashAttention-2 paper, Dao 2023, §4.1: "the backward pass ... 2.5x the
    forward FLOPs")."""

    heads: float
    seq_q: float
    seq_kv: float
    head_dim: int
    v_head_dim: int
    causal: bool
    kernel: str = "auto"
    backward: bool = False
    calls: float = 1.0
    window: float = 0.0
    """Keys each query attends over in a sliding-window layer (0: all of ``seq_kv``): the
    kernel visits only the band's tiles (FlashAttention-2/3 ``window_size``, cuDNN's
    sliding-window mask), causal: the first ``window`` queries see their prefix, each later one
    ``window`` keys."""

    @property
    def keys(self) -> float:
        """Keys a query's row of tiles spans: the window, or the whole key sequence."""
        return min(self.window, self.seq_kv) if self.window else self.seq_kv

    @property
    def flops(self) -> float:
        per_pair = 2.0 * (self.head_dim + self.v_head_dim)
        pairs = self.seq_q * band_pairs_per_query(self.seq_kv, self.window, self.causal)
        flops = self.heads * pairs * per_pair * self.calls
        return 2 * flops if self.backward else flops

    @property
    def kernel_flops(self) -> float:
        """FLOPs the fused kernel executes: the backward's recomputed scores included."""
        return self.flops * (BACKWARD_KERNEL_WORK / 2 if self.backward else 1.0)


BACKWARD_KERNEL_WORK = 2.5
"""A flash-attention backward's matrix products over its forward's (dQ, dK, dV, dP and the
recomputed S = QK^T against the forward's S and O: 5 to 2; FlashAttention-2 paper §4.1). Its
measured time ratio on an H100 (torch 2.11 SDPA, flash and cuDNN backends, head dim 128, 2k-16k
tokens, causal or not) is 2.47-3.37, median 2.97 (docs/gpu-measurements.md); 2.5 over the
kernel's backward-to-forward speed 0.863 gives 2.90."""


Shape = Gemm | Attention


def scaled(shapes: tuple[Shape, ...], factor: float) -> tuple[Shape, ...]:
    """Every shape run ``factor`` times as often."""
    if factor == 1:
        return shapes
    return tuple(s._replace(calls=s.calls * factor) for s in shapes)


def merged(*groups: Iterable[Shape]) -> tuple[Shape, ...]:
    """The shapes of several ops run back to back: equal shapes add their counts (order of
    first appearance kept), so merged layers stay a short tuple."""
    counts: dict[Shape, float] = {}
    for group in groups:
        for s in group:
            key = s._replace(calls=1.0)
            counts[key] = counts.get(key, 0.0) + s.calls
    return tuple(k._replace(calls=c) for k, c in counts.items())


def packed(shapes: tuple[Shape, ...], seq_len: float, tokens: float) -> tuple[Shape, ...]:
    """``shapes`` with their attention run over documents of token-weighted mean length
    ``tokens`` instead of whole ``seq_len`` rows (variable-length flash attention,
    ``model/sequences.py``): each kernel's query and key lengths scale by tokens / seq_len and
    it runs seq_len / tokens times as often, so its FLOPs scale by tokens / seq_len."""
    if tokens == seq_len or not any(isinstance(s, Attention) for s in shapes):
        return shapes
    f = tokens / seq_len
    return tuple(s._replace(seq_q=s.seq_q * f, seq_kv=s.seq_kv * f, calls=s.calls / f) if isinstance(s, Attention) else s
                 for s in shapes)


def total_flops(shapes: Iterable[Shape], kind: type | None = None) -> float:
    return sum(s.flops for s in shapes if kind is None or isinstance(s, kind))


def to_plain(shapes: Iterable[Shape]) -> list[list[object]]:
    """Shapes as JSON-able lists, each tagged with its kind (``from_plain`` reads them back)."""
    return [["gemm" if isinstance(s, Gemm) else "attention", *s] for s in shapes]


def from_plain(items: Iterable[Sequence[object]]) -> tuple[Shape, ...]:
    out: list[Shape] = []
    for kind, *fields in items:
        out.append(Gemm(*fields) if kind == "gemm" else Attention(*fields))  # type: ignore[arg-type]
    return tuple(out)
