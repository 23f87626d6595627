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
- Per-stream pools: every block belongs to the stream whose request created it.
  ``BlockComparatorSize`` orders the cached blocks by stream first, and ``get_free_block``
  searches only the requesting stream's blocks, so a block cached by one stream never serves
  another; a segment belongs to the stream of the ``malloc`` that reserved it (``alloc_block``
  stores ``p.stream()``), and ``free_block`` returns a freed block to its own stream's pool,
  whichever stream frees it. The engine records each allocation with the stream of the op that
  makes it, and each release with the stream that allocated the block
  (``Trace.memory_events``); model states are allocated on the compute stream. This is what
  FSDP2 calls inter-stream fragmentation: a flat all-gather output allocated by its
  all-gather's stream and freed by the compute stream's copy-out stays cached on the gather
  stream. Before an
  out-of-memory error ``release_cached_blocks`` gives back the wholly free segments of every
  stream.
- ``expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): each stream
  has its own expandable segment (``get_free_block`` / ``try_allocate_expandable_segment`` look
  for the segment of the requesting stream), which grows by mapping 2 MiB pages (20 MiB for
  large blocks is the granularity of the *virtual* reservation only), so a request never needs
  a hole of its own size. Here a stream's segment maps the pages its live blocks need at their
  most (each block rounded to whole pages; ``ExpandableSegment::map``); freed pages stay
  mapped for that stream until a mapping would exceed the capacity, when every stream's free
  pages are unmapped (``release_expandable_segment`` from ``release_cached_blocks``).

Checked against an H200 (``docs/memory.md``, PyTorch 2.11 memory snapshot of FSDP2 on
Llama-3-8B's shape cut to 8 layers, fp32): the replay's gather-stream pool is 4.73 GiB, as
measured (4.73 GiB on the all-gather copy-in stream); with FSDP2's copy-out and reduce-scatter
outputs (``Implementation.gather_copy_out``, ``reduce_output_on_reduce_stream``) the reserved
peak is 23.41 GiB against 23.81 measured.

What the replay cannot see (``docs/memory.md``): the engine's events are a unit's tensors
added up (a layer's saved activations are one block here, about fifteen tensors in PyTorch);
the large and small pools are not kept apart; and a pool is only as right as the stream the
strategy allocates on (FSDP2's sharded gradients are resident states on the compute stream
here, where PyTorch's first reduce-scatter of a step allocates them on its own stream).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hzpsim.model.ops import COMPUTE_STREAM

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
    __slots__ = ("size", "stream", "blocks")

    def __init__(self, size: int, stream: str) -> None:
        self.size = size
        self.stream = stream  # the stream whose malloc reserved it: its blocks serve that stream only
        self.blocks: list[list] = [[0, size, None]]  # [offset, size, owner id or None (free)], by offset


class OutOfMemory(Exception):
    """The replay needed more than the capacity even after releasing every cached segment."""


class CachingAllocator:
    """The allocator's bookkeeping, enough to know its reserved bytes (no addresses kept).

    ``capacity_bytes``: what ``cudaMalloc`` may reserve in all (None: no limit). Every call
    names the stream it runs on (``stream``, default the compute stream); a freed block goes
    back to the pool of the stream that allocated it, whichever stream frees it."""

    def __init__(self, capacity_bytes: float | None = None, expandable_segments: bool = False) -> None:
        self.capacity_bytes = capacity_bytes
        self.expandable = expandable_segments
        self.segments: list[_Segment] = []
        # stream -> (size, segment index, offset) of its free blocks, sorted (BlockComparatorSize
        # orders by stream first, so a lookup never leaves its stream)
        self.free: dict[str, list[tuple[int, int, int]]] = {}
        self.live: dict[int, tuple[int, int]] = {}  # owner -> (segment index, offset)
        self.sizes: dict[int, tuple[int, str]] = {}  # expandable segments: owner -> (bytes handed out, stream)
        self.live_pages: dict[str, int] = {}  # expandable segments: whole pages each stream's live blocks need
        self.mapped_pages: dict[str, int] = {}  # expandable segments: pages each stream's segment has mapped
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0

    # -- the allocator's calls ------------------------------------------------------------------

    def malloc(self, owner: int, size: float, stream: str = COMPUTE_STREAM) -> None:
        request = round_size(size)
        self.allocated += request
        if self.expandable:
            self._map(owner, request, stream)
            return
        free = self.free.setdefault(stream, [])
        i = bisect.bisect_left(free, (request, -1, -1))
        if i == len(free):
            self._new_segment(segment_size(request), stream)
            i = bisect.bisect_left(free, (request, -1, -1))
        size_free, seg, offset = free.pop(i)
        blocks = self.segments[seg].blocks
        j = next(k for k, b in enumerate(blocks) if b[0] == offset)
        if size_free - request > SMALL_SIZE_BYTES:  # should_split
            blocks[j:j + 1] = [[offset, request, owner], [offset + request, size_free - request, None]]
            bisect.insort(free, (size_free - request, seg, offset + request))
        else:
            blocks[j][2] = owner
        self.live[owner] = (seg, offset)

    def release(self, owner: int) -> None:
        if self.expandable:
            size, stream = self.sizes.pop(owner)
            self.allocated -= size
            self.live_pages[stream] -= -(-size // PAGE_BYTES)  # the pages stay mapped, for this stream
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
        bisect.insort(self.free[self.segments[seg].stream], (blocks[j][1], seg, blocks[j][0]))

    def reserved_by_stream(self) -> dict[str, int]:
        """Bytes reserved now by each stream's segments, streams sorted."""
        if self.expandable:
            return {s: self.mapped_pages[s] * PAGE_BYTES for s in sorted(self.mapped_pages)}
        out: dict[str, int] = {}
        for segment in self.segments:
            if segment.size:
                out[segment.stream] = out.get(segment.stream, 0) + segment.size
        return dict(sorted(out.items()))

    # -- internals ------------------------------------------------------------------------------

    def _map(self, owner: int, request: int, stream: str) -> None:
        """Expandable segments: the stream's own segment maps more pages only when its live
        blocks need more than it has mapped (its freed pages stay mapped for it)."""
        self.sizes[owner] = (request, stream)
        live = self.live_pages[stream] = self.live_pages.get(stream, 0) + -(-request // PAGE_BYTES)
        mapped = self.mapped_pages.get(stream, 0)
        if live > mapped:
            if self.capacity_bytes is not None and self.reserved + (live - mapped) * PAGE_BYTES > self.capacity_bytes:
                # release_cached_blocks: unmap every stream's free pages
                self.mapped_pages = {s: self.live_pages[s] for s in sorted(self.mapped_pages)}
            self.mapped_pages[stream] = live
            self.reserved = sum(self.mapped_pages.values()) * PAGE_BYTES
            self._check(self.reserved)
            self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _unlist(self, seg: int, block: list) -> None:
        free = self.free[self.segments[seg].stream]
        key = (block[1], seg, block[0])
        i = bisect.bisect_left(free, key)
        if i < len(free) and free[i] == key:
            free.pop(i)

    def _check(self, reserved: float) -> None:
        if self.capacity_bytes is not None and reserved > self.capacity_bytes:
            raise OutOfMemory

    def _new_segment(self, size: int, stream: str) -> None:
        if self.capacity_bytes is not None and self.reserved + size > self.capacity_bytes:
            self._release_cached()
            self._check(self.reserved + size)
        self.segments.append(_Segment(size, stream))
        bisect.insort(self.free.setdefault(stream, []), (size, len(self.segments) - 1, 0))
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _release_cached(self) -> None:
        """``release_cached_blocks``: give back every segment that holds no live block, of every
        stream (``release_blocks`` walks the whole large and small pools, all streams)."""
        for seg, segment in enumerate(self.segments):
            if segment.size and len(segment.blocks) == 1 and segment.blocks[0][2] is None:
                self._unlist(seg, segment.blocks[0])
                self.reserved -= segment.size
                segment.size, segment.blocks = 0, []


@dataclass(frozen=True)
class Replay:
    """One rank's allocator replay: the peak ``torch.cuda.max_memory_reserved`` would report,
    and whether it ran out of memory under the capacity it was given (the allocated peak is
    the engine's memory timeline, ``report.memory_peak``). ``reserved_by_stream_bytes``: what
    each stream's segments held at the reserved peak (the first instant it was reached)."""

    peak_reserved_bytes: float
    out_of_memory: bool
    reserved_by_stream_bytes: Mapping[str, float] = field(default_factory=dict)


MemoryEvent = tuple[float, str, float, str] | tuple[float, str, float]
"""(time, category, +bytes allocated / -bytes freed, stream): for an allocation the stream of
the op that allocates, for a release the stream whose pool the block goes back to (the stream
that allocated it, ``Trace.memory_events``). Without a stream: the compute stream."""


def replay(static: Mapping[str, float], events: Sequence[MemoryEvent],
           capacity_bytes: float | None = None, expandable_segments: bool = False) -> Replay:
    """Replay ``events`` (by time) after the ``static`` allocations (bytes by category, resident
    throughout, allocated on the compute stream).

    A release is matched to the live block of its category and stream allocated with the same
    size, the latest first (a unit's passes free what they took, in reverse order), else to
    the latest blocks of its category and stream, then of its category on other streams, until
    the bytes are covered (a block partly released stays live with what is left, on its
    stream)."""
    allocator = CachingAllocator(capacity_bytes, expandable_segments)
    live: dict[tuple[str, str], list[tuple[int, float]]] = {}
    owner = 0
    at_peak: dict[str, int] = {}
    try:
        for category, size in static.items():
            if size > 0:
                allocator.malloc(owner, size, COMPUTE_STREAM)
                live.setdefault((category, COMPUTE_STREAM), []).append((owner, size))
                owner += 1
        peak = allocator.peak_reserved
        at_peak = allocator.reserved_by_stream()
        # within one instant, releases first (the memory_peak convention: an op that ends and
        # one that starts at the same time do not hold their memory together)
        for event in sorted(events, key=lambda e: (e[0], e[2] > 0)):
            category, size = event[1], event[2]
            stream = event[3] if len(event) > 3 else COMPUTE_STREAM  # type: ignore[misc]
            if size > 0:
                allocator.malloc(owner, size, stream)
                live.setdefault((category, stream), []).append((owner, size))
                owner += 1
                if allocator.peak_reserved > peak:
                    peak, at_peak = allocator.peak_reserved, allocator.reserved_by_stream()
            elif size < 0:
                owner = _release(allocator, live, category, stream, -size, owner)
    except OutOfMemory:
        return Replay(allocator.peak_reserved, True, allocator.reserved_by_stream())
    return Replay(allocator.peak_reserved, False, at_peak)


def _release(allocator: CachingAllocator, live: dict[tuple[str, str], list[tuple[int, float]]],
             category: str, stream: str, size: float, owner: int) -> int:
    blocks = live.setdefault((category, stream), [])
    for k in range(len(blocks) - 1, -1, -1):
        if math.isclose(blocks[k][1], size, rel_tol=1e-9, abs_tol=1.0):
            allocator.release(blocks.pop(k)[0])
            return owner
    others = sorted(s for c, s in live if c == category and s != stream)
    for on in (stream, *others):
        blocks = live[(category, on)]
        while size > 1.0 and blocks:
            block, held = blocks.pop()
            allocator.release(block)
            if held > size + 1.0:  # partly released: what is left stays live (a new block)
                allocator.malloc(owner, held - size, on)
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
