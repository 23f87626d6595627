"""Variable-length sequences: ``training.sequence_lengths``.

Pre-training data are documents of very different lengths. The usual pipeline concatenates
them and cuts the stream into rows of ``seq_len`` tokens ("concat-and-chunk": Megatron-LM's
``GPTDataset``, torchtitan's ``HuggingFaceDataset``), so every row has the same token count and
every GEMM the same shape. What varies is attention:

- ``packing: per_document`` (the default here): each row's documents attend only within
  themselves, as variable-length flash attention runs them (FlashAttention-2
  ``flash_attn_varlen_func`` with ``cu_seqlens``; Megatron-Core's ``PackedSeqParams`` with
  ``qkv_format='thd'``; torchtitan's document-causal ``flex_attention`` mask). A row holding
  pieces of lengths l_1..l_k costs sum(l_i^2) query-key pairs where a plain causal row costs
  seq_len^2 (Pouransari et al. 2024, arXiv 2405.13226, §2: "the attention cost ... is
  proportional to the actual document lengths"). A document longer than what is left of a
  row continues in the next one, and each piece attends only inside its row.
- ``packing: concatenated``: one causal mask over the whole row (Megatron-LM's default,
  ``reset_attention_mask=False``): documents attend across their boundaries, every row costs
  seq_len^2 and the lengths change nothing (today's ``fixed``).

With per-document packing each data-parallel rank's micro-batch costs what its own rows
hold, so ranks that synchronise wait for the slowest one (Zeppelin, Chen et al. 2025, arXiv
2509.21841, §2: load imbalance in data-parallel training with variable lengths). Lengths are
drawn deterministically from ``seed``: for every optimizer step, every data-parallel rank and
every micro-batch, ``micro_batch_size`` rows are filled from one document stream.

``balancing: length_aware`` assigns each step's rows to (rank, micro-batch) slots so that the
ranks' micro-batches cost the same, as far as whole rows allow: rows sorted by cost, then each
micro-batch slot's rows dealt to the ranks longest-processing-time first (the greedy
balancing WLB-LLM, Wang et al. OSDI 2025, and Zeppelin's sequence assignment start from);
``none`` keeps the order the sampler gives.

A row's attention is priced as one kernel over its token-weighted mean piece length
``L = sum(l_i^2) / seq_len`` (``effective_tokens``): ``seq_len / L`` calls of an
``L x L`` attention carry exactly the row's sum(l_i^2) pairs, and the kernel's speed is that
of ``L``-token sequences (short sequences run slower, ``hardware/compute.py``).
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

Packing = Literal["per_document", "concatenated"]
Balancing = Literal["none", "length_aware"]
DISTRIBUTIONS = ("lognormal",)


@dataclass(frozen=True)
class SequenceLengths:
    """``training.sequence_lengths`` as a mapping: document lengths as a histogram
    (``lengths``: [tokens, share] pairs) or a named distribution (``distribution: lognormal``
    with ``mean_tokens`` and ``sigma``, the standard deviation of ln(length)), how rows are
    packed and how micro-batches are balanced across ranks."""

    lengths: tuple[tuple[float, ...], ...] = ()  # [[tokens, share], ...]: shares need not sum to 1
    distribution: Literal["lognormal"] | None = None
    mean_tokens: float | None = None  # lognormal: mean document length (tokens)
    sigma: float = 1.0  # lognormal: standard deviation of ln(length)
    packing: Packing = "per_document"
    balancing: Balancing = "none"
    seed: int = 0  # the draws: the same seed gives the same lengths, byte for byte

    def validate(self) -> None:
        if bool(self.lengths) == (self.distribution is not None):
            raise ValueError("lengths: give either lengths ([[tokens, share], ...]) or distribution, not both or neither")
        for i, pair in enumerate(self.lengths):
            if len(pair) != 2:
                raise ValueError(f"lengths.{i}: expected [tokens, share], got {list(pair)}")
            tokens, share = pair
            if tokens < 1 or tokens != int(tokens):
                raise ValueError(f"lengths.{i}: document length must be a whole number of tokens >= 1, got {tokens}")
            if not share > 0:
                raise ValueError(f"lengths.{i}: share must be > 0, got {share}")
        if self.distribution is not None:
            if self.mean_tokens is None or not self.mean_tokens >= 1:
                raise ValueError(f"mean_tokens: the lognormal distribution needs a mean length >= 1 token, "
                                 f"got {self.mean_tokens}")
            if not 0 <= self.sigma <= 4:
                raise ValueError(f"sigma: must be between 0 and 4 (standard deviation of ln length), got {self.sigma}")
        if self.seed < 0:
            raise ValueError(f"seed: must be >= 0, got {self.seed}")

    @property
    def varies(self) -> bool:
        """Whether the lengths change any cost (per-document attention masks)."""
        return self.packing == "per_document"

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` document lengths (whole tokens, >= 1)."""
        if self.lengths:
            tokens = np.array([p[0] for p in self.lengths], dtype=float)
            shares = np.array([p[1] for p in self.lengths], dtype=float)
            return rng.choice(tokens, size=count, p=shares / shares.sum())
        assert self.mean_tokens is not None
        # lognormal with E[X] = mean: mu = ln(mean) - sigma^2 / 2
        mu = math.log(self.mean_tokens) - self.sigma ** 2 / 2
        return np.maximum(np.rint(rng.lognormal(mu, self.sigma, size=count)), 1.0)


def row_pairs(spec: SequenceLengths, seq_len: int, num_rows: int, rng: np.random.Generator) -> np.ndarray:
    """sum(l_i^2) of each of ``num_rows`` rows of ``seq_len`` tokens filled from one document
    stream (a document continues into the next row where the row ends)."""
    total = num_rows * seq_len
    drawn: list[np.ndarray] = []
    filled = 0.0
    mean = float(np.mean([p[0] for p in spec.lengths])) if spec.lengths else float(spec.mean_tokens or 1.0)
    while filled < total:
        chunk = spec.draw(rng, int(min(max(64, 1.2 * (total - filled) / mean), 1 << 22)))
        drawn.append(chunk)
        filled += float(chunk.sum())
    ends = np.cumsum(np.concatenate(drawn))
    cuts = np.union1d(ends[ends < total], np.arange(0, total + 1, seq_len, dtype=float))
    pieces = np.diff(cuts)
    rows = (cuts[:-1] // seq_len).astype(np.int64)
    return np.bincount(rows, weights=pieces * pieces, minlength=num_rows)


@functools.lru_cache(maxsize=8)
def effective_tokens(spec: SequenceLengths, seq_len: int, dp: int, num_micro_batches: int, micro_batch_size: int,
                     num_steps: int) -> np.ndarray:
    """(Cached: every pipeline stage of one build draws the same; read-only.) ``L[step, micro-batch, rank]``: the token-weighted mean piece length of the rows one
    data-parallel rank runs in one micro-batch (``sum(l_i^2) / tokens``; ``seq_len`` for a
    plain causal row), for every step, micro-batch and data-parallel rank."""
    rng = np.random.default_rng(spec.seed)
    rows = dp * num_micro_batches * micro_batch_size
    out = np.empty((num_steps, num_micro_batches, dp))
    for step in range(num_steps):
        pairs = row_pairs(spec, seq_len, rows, rng)
        if spec.balancing == "length_aware":
            per_slot = _balanced(pairs, dp, num_micro_batches, micro_batch_size)
        else:  # rank-major: rank r's micro-batch j holds rows (r, j, 0..b-1)
            per_slot = pairs.reshape(dp, num_micro_batches, micro_batch_size).sum(axis=2).T
        out[step] = per_slot / (micro_batch_size * seq_len)
    out.flags.writeable = False
    return out


def _balanced(pairs: np.ndarray, dp: int, num_micro_batches: int, micro_batch_size: int) -> np.ndarray:
    """Pairs per [micro-batch, rank] after length-aware assignment: rows by decreasing cost,
    each micro-batch slot takes the next dp x b rows, dealt longest first onto the rank with
    the least so far that still has room (each rank takes b rows per slot)."""
    order = np.sort(pairs)[::-1]
    per_slot = np.zeros((num_micro_batches, dp))
    take = dp * micro_batch_size
    for j in range(num_micro_batches):
        rows = order[j * take:(j + 1) * take]
        if micro_batch_size == 1:  # one row each: the slot's rows, one per rank
            per_slot[j] = rows
            continue
        heap = [(0.0, r) for r in range(dp)]
        count = [0] * dp
        for cost in rows:
            load, r = heapq.heappop(heap)
            per_slot[j, r] = load + cost
            count[r] += 1
            if count[r] < micro_batch_size:
                heapq.heappush(heap, (load + cost, r))
    return per_slot
