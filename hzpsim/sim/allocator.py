"""PyTorch's CUDA caching allocator, replayed on a rank's memory events: what
``torch.cuda.max_memory_reserved`` would say, beside ``max_memory_allocated``.

The engine records every allocation and release as it happens (``Trace.memory_events``: the
``alloc`` of an op when it starts, its ``free`` when it ends; model states are resident from
the start). This module replays them through the allocator's policy as
``c10/cuda/CUDACachingAllocator.cpp`` implements it (``DeviceCachingAllocator::malloc`` /
``free``):

- ``round_size``: every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``).
- ``get_free_block``: a request takes the smallest cached free block that holds it (best fit);
  ``should_split`` splits it when more than 1 MiB (``kSmallSize``) would be left over.
- ``alloc_block``: otherwise a new segment is reserved with ``cudaMalloc`` of
  ``get_allocation_size``: 2 MiB for requests up to 1 MiB (``kSmallBuffer``), 20 MiB up to
  10 MiB (``kLargeBuffer``, ``kMinLargeAlloc``), else the request rounded up to 2 MiB
  (``kRoundLarge``).
- ``free_block``: a freed block goes back to the cache and merges with free neighbours of its
  segment; segments are never returned to the device, except that a ``cudaMalloc`` that would
  not fit first releases the wholly free cached segments (``release_available_cached_blocks``
  / ``release_cached_blocks``) and tries again; only then is it an out-of-memory error.
- ``expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): one segment per
  stream grows by mapping 2 MiB pages (20 MiB for large blocks is the granularity of the
  *virtual* reservation only), so a request never needs a hole of its own size; reserved is
  then the live bytes rounded to whole pages (``ExpandableSegment::map``).

What the replay cannot see (``docs/memory.md``): the engine's events are a unit's tensors
added up (a layer's saved activations are one block here, about fifteen tensors in PyTorch),
and the caching allocator's per-stream pools are modelled where the strategies model them (a
communication stream's stranded buffer, ``other``), not here.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_SIZE_BYTES = 1 << 20  # kSmallSize: the largest request served from the small pool
SMALL_BUFFER_BYTES = 2 << 20  # kSmallBuffer: segment size for small requests
LARGE_BUFFER_BYTES = 20 << 20  # kLargeBuffer: segment size for requests below kMinLargeAlloc
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge: larger segments are rounded up to this
PAGE_BYTES = 2 << 20  # expandable segments map physical memory in 2 MiB pages


def round_size(size: float) -> int:
    """``round_size``: bytes the allocator hands out for a request of ``size`` bytes."""
    n = max(int(math.ceil(size)), 1)
    return max(MIN_BLOCK_BYTES, -(-n // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def segment_size(size: int) -> int:
    """``get_allocation_size``: bytes of the segment ``cudaMalloc`` reserves for a request."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


class _Segment:
    __slots__ = ("size", "blocks")

    def __init__(self, size: int) -> None:
        self.size = size
        self.blocks: list[list] = [[0, size, None]]  # [offset, size, owner id or None (free)], by offset


class OutOfMemory(Exception):
    """The replay needed more than the capacity even after releasing every cached segment."""


class CachingAllocator:
    """The allocator's bookkeeping, enough to know its reserved bytes (no addresses kept).

    ``capacity_bytes``: what ``cudaMalloc`` may reserve in all (None: no limit)."""

    def __init__(self, capacity_bytes: float | None = None, expandable_segments: bool = False) -> None:
        self.capacity_bytes = capacity_bytes
        self.expandable = expandable_segments
        self.segments: list[_Segment] = []
        self.free: list[tuple[int, int, int]] = []  # (size, segment index, offset) of free blocks, sorted
        self.live: dict[int, tuple[int, int]] = {}  # owner -> (segment index, offset)
        self.sizes: dict[int, int] = {}  # expandable segments: owner -> bytes handed out
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0
        self.live_pages = 0  # expandable segments: whole pages the live blocks need

    # -- the allocator's calls ------------------------------------------------------------------

    def malloc(self, owner: int, size: float) -> None:
        request = round_size(size)
        self.allocated += request
        if self.expandable:
            self.sizes[owner] = request
            self.live_pages += -(-request // PAGE_BYTES)
            self.reserved = self.live_pages * PAGE_BYTES
            self._check(self.reserved)
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            return
        i = bisect.bisect_left(self.free, (request, -1, -1))
        if i == len(self.free):
            self._new_segment(segment_size(request))
            i = bisect.bisect_left(self.free, (request, -1, -1))
        size_free, seg, offset = self.free.pop(i)
        blocks = self.segments[seg].blocks
        j = next(k for k, b in enumerate(blocks) if b[0] == offset)
        if size_free - request > SMALL_SIZE_BYTES:  # should_split
            blocks[j:j + 1] = [[offset, request, owner], [offset + request, size_free - request, None]]
            bisect.insort(self.free, (size_free - request, seg, offset + request))
        else:
            blocks[j][2] = owner
        self.live[owner] = (seg, offset)

    def release(self, owner: int) -> None:
        if self.expandable:
            size = self.sizes.pop(owner)
            self.allocated -= size
            self.live_pages -= -(-size // PAGE_BYTES)
            self.reserved = self.live_pages * PAGE_BYTES
            return
        seg, offset = self.live.pop(owner)
        blocks = self.segments[seg].blocks
        j = next(k for k, b in enumerate(blocks) if b[0] == offset)
        self.allocated -= blocks[j][1]
        blocks[j][2] = None
        # merge with free neighbours (free_block -> try_merge_blocks)
        for k in (j + 1, j - 1):
            if 0 <= k < len(blocks) and blocks[k][2] is None:
                lo, hi = min(j, k), max(j, k)
                self._unlist(seg, blocks[lo])
                self._unlist(seg, blocks[hi])
                blocks[lo:hi + 1] = [[blocks[lo][0], blocks[lo][1] + blocks[hi][1], None]]
                j = lo
        bisect.insort(self.free, (blocks[j][1], seg, blocks[j][0]))

    # -- internals ------------------------------------------------------------------------------

    def _unlist(self, seg: int, block: list) -> None:
        key = (block[1], seg, block[0])
        i = bisect.bisect_left(self.free, key)
        if i < len(self.free) and self.free[i] == key:
            self.free.pop(i)

    def _check(self, reserved: float) -> None:
        if self.capacity_bytes is not None and reserved > self.capacity_bytes:
            raise OutOfMemory

    def _new_segment(self, size: int) -> None:
        if self.capacity_bytes is not None and self.reserved + size > self.capacity_bytes:
            self._release_cached()
            self._check(self.reserved + size)
        self.segments.append(_Segment(size))
        bisect.insort(self.free, (size, len(self.segments) - 1, 0))
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _release_cached(self) -> None:
        """``release_cached_blocks``: give back every segment that holds no live block."""
        for seg, segment in enumerate(self.segments):
            if segment.size and len(segment.blocks) == 1 and segment.blocks[0][2] is None:
                self._unlist(seg, segment.blocks[0])
                self.reserved -= segment.size
                segment.size, segment.blocks = 0, []


@dataclass(frozen=True)
class Replay:
    """One rank's allocator replay: the peak ``torch.cuda.max_memory_reserved`` would report,
    and whether it ran out of memory under the capacity it was given (the allocated peak is
    the engine's memory timeline, ``report.memory_peak``)."""

    peak_reserved_bytes: float
    out_of_memory: bool


def replay(static: Mapping[str, float], events: Sequence[tuple[float, str, float]],
           capacity_bytes: float | None = None, expandable_segments: bool = False) -> Replay:
    """Replay ``events`` ((time, category, +bytes allocated / -bytes freed), by time) after the
    ``static`` allocations (bytes by category, resident throughout).

    A release is matched to the live block of its category allocated with the same size, the
    latest first (a unit's passes free what they took, in reverse order), else to the latest
    blocks of its category until the bytes are covered (a block partly released stays live
    with what is left)."""
    allocator = CachingAllocator(capacity_bytes, expandable_segments)
    live: dict[str, list[tuple[int, float]]] = {}
    owner = 0
    try:
        for category, size in static.items():
            if size > 0:
                allocator.malloc(owner, size)
                live.setdefault(category, []).append((owner, size))
                owner += 1
        # within one instant, releases first (the memory_peak convention: an op that ends and
        # one that starts at the same time do not hold their memory together)
        for _, category, size in sorted(events, key=lambda e: (e[0], e[2] > 0)):
            if size > 0:
                allocator.malloc(owner, size)
                live.setdefault(category, []).append((owner, size))
                owner += 1
            elif size < 0:
                owner = _release(allocator, live.setdefault(category, []), -size, owner)
    except OutOfMemory:
        return Replay(allocator.peak_reserved, True)
    return Replay(allocator.peak_reserved, False)


def _release(allocator: CachingAllocator, blocks: list[tuple[int, float]], size: float, owner: int) -> int:
    for k in range(len(blocks) - 1, -1, -1):
        if math.isclose(blocks[k][1], size, rel_tol=1e-9, abs_tol=1.0):
            allocator.release(blocks.pop(k)[0])
            return owner
    while size > 1.0 and blocks:
        block, held = blocks.pop()
        allocator.release(block)
        if held > size + 1.0:  # partly released: what is left stays live (a new block)
            allocator.malloc(owner, held - size)
            blocks.append((owner, held - size))
            owner += 1
        size -= held
    return owner


def communicators(groups: Iterable[Sequence[int]], rank: int) -> int:
    """NCCL communicators ``rank`` holds: one per distinct set of two or more ranks it talks
    with (``ProcessGroupNCCL`` creates one per process group, and one per pair for point-to-point
    sends between pipeline stages)."""
    return len({(m.start, m.stop, m.step) if isinstance(m, range) else tuple(m)
                for m in groups if len(m) > 1 and rank in m})
