"""The caching-allocator replay (hzpsim/sim/allocator.py), the loss's eager temporaries and the
memory keys of the report: allocated vs reserved vs what the device has."""

from __future__ import annotations

import pytest

from hzpsim.sim.allocator import (
    LARGE_BUFFER_BYTES,
    SMALL_BUFFER_BYTES,
    CachingAllocator,
    communicators,
    replay,
    round_size,
    segment_size,
)
from hzpsim.strategies._implementations import loss_bytes_per_logit

MiB = 1 << 20
GiB = 1 << 30


def test_rounding_and_segment_sizes_follow_the_caching_allocator():
    assert round_size(1) == 512 and round_size(513) == 1024
    assert segment_size(round_size(100)) == SMALL_BUFFER_BYTES  # <= 1 MiB: a 2 MiB small segment
    assert segment_size(5 * MiB) == LARGE_BUFFER_BYTES  # < 10 MiB: a 20 MiB segment
    assert segment_size(11 * MiB + 1) == 12 * MiB  # larger: rounded up to 2 MiB


def test_a_freed_block_is_reused_and_a_larger_request_leaves_a_hole():
    """The loss's pattern: the forward frees a 2-unit and a 4-unit block; the backward asks for
    two 4-unit blocks: one takes the freed 4, the other needs a new segment, the 2 stays a hole."""
    a = CachingAllocator()
    a.malloc(0, 2 * GiB)
    a.malloc(1, 4 * GiB)
    a.release(0)
    a.release(1)
    assert a.reserved == 6 * GiB and a.allocated == 0
    a.malloc(2, 4 * GiB)
    assert a.reserved == 6 * GiB  # reused
    a.malloc(3, 4 * GiB)
    assert a.reserved == 10 * GiB and a.allocated == 8 * GiB  # the 2 GiB hole could not serve it


def test_blocks_split_and_merge_back():
    a = CachingAllocator()
    a.malloc(0, 100 * MiB)
    a.release(0)
    a.malloc(1, 30 * MiB)
    a.malloc(2, 30 * MiB)  # split from the same segment: no new one
    assert a.reserved == 100 * MiB
    a.release(1)
    a.release(2)
    a.malloc(3, 100 * MiB)  # the halves merged back into the whole segment
    assert a.reserved == 100 * MiB


def test_at_capacity_cached_segments_are_given_back_before_running_out():
    events = [(0.0, "temporaries", 6 * GiB), (1.0, "temporaries", -6 * GiB), (2.0, "activations", 8 * GiB)]
    free = replay({}, events)
    assert free.peak_reserved_bytes == 14 * GiB and not free.out_of_memory
    capped = replay({}, events, capacity_bytes=10 * GiB)
    assert not capped.out_of_memory and capped.peak_reserved_bytes == 8 * GiB
    assert replay({}, events, capacity_bytes=7 * GiB).out_of_memory


def test_expandable_segments_leave_no_holes():
    events = [(0.0, "temporaries", 2 * GiB), (0.0, "temporaries", 4 * GiB), (1.0, "temporaries", -2 * GiB),
              (1.0, "temporaries", -4 * GiB), (2.0, "temporaries", 4 * GiB), (2.0, "temporaries", 4 * GiB)]
    assert replay({}, events).peak_reserved_bytes == 10 * GiB
    assert replay({}, events, expandable_segments=True).peak_reserved_bytes == 8 * GiB


def test_a_block_freed_on_one_stream_serves_only_that_stream():
    """get_free_block looks only among the requesting stream's cached blocks
    (BlockComparatorSize orders by stream first): a block allocated on "ag" and freed goes
    back to "ag"'s pool; "compute" asking for the same size needs a segment of its own, "ag"
    asking again reuses its block."""
    a = CachingAllocator()
    a.malloc(0, 4 * GiB, "ag")
    a.release(0)
    a.malloc(1, 4 * GiB, "compute")
    assert a.reserved == 8 * GiB and a.reserved_by_stream() == {"ag": 4 * GiB, "compute": 4 * GiB}
    a.malloc(2, 4 * GiB, "ag")
    assert a.reserved == 8 * GiB and a.allocated == 8 * GiB


def test_release_before_out_of_memory_frees_every_streams_empty_segments():
    """A cudaMalloc over the capacity first releases the wholly free segments of every stream
    (release_cached_blocks), so the compute stream gets memory the "ag" pool cached."""
    a = CachingAllocator(capacity_bytes=10 * GiB)
    a.malloc(0, 6 * GiB, "ag")
    a.release(0)
    a.malloc(1, 8 * GiB, "compute")
    assert a.reserved_by_stream() == {"compute": 8 * GiB} and a.peak_reserved == 8 * GiB


def test_replay_gives_a_block_back_to_the_stream_that_allocated_it():
    """A release names the allocating stream (Trace.memory_events): the gathered unit freed by
    the compute stream goes back to "ag", so the compute stream's next request of that size
    cannot take it; without streams (one pool) it can."""
    events = [(0.0, "buffers", 4 * GiB, "ag"), (1.0, "buffers", -4 * GiB, "ag"), (2.0, "activations", 4 * GiB, "compute")]
    split = replay({}, events)
    assert split.peak_reserved_bytes == 8 * GiB and split.reserved_by_stream_bytes == {"ag": 4 * GiB, "compute": 4 * GiB}
    assert replay({}, [e[:3] for e in events]).peak_reserved_bytes == 4 * GiB


def test_expandable_segments_keep_one_segment_per_stream():
    """Each stream grows its own expandable segment; its freed pages stay mapped for it, and
    are unmapped for another stream only when a mapping would exceed the capacity."""
    events = [(0.0, "buffers", 4 * GiB, "ag"), (1.0, "buffers", -4 * GiB, "ag"), (2.0, "activations", 4 * GiB, "compute")]
    assert replay({}, events, expandable_segments=True).peak_reserved_bytes == 8 * GiB
    capped = replay({}, events, capacity_bytes=6 * GiB, expandable_segments=True)
    assert not capped.out_of_memory and capped.peak_reserved_bytes == 4 * GiB
    a = CachingAllocator(capacity_bytes=6 * GiB, expandable_segments=True)
    a.malloc(0, 4 * GiB, "ag")
    a.release(0)
    assert a.reserved_by_stream() == {"ag": 4 * GiB}  # still mapped, for "ag"
    a.malloc(1, 4 * GiB, "compute")
    assert a.reserved_by_stream() == {"ag": 0, "compute": 4 * GiB}


def test_a_release_names_the_stream_of_the_block_its_op_depends_on():
    """Ops free by (category, bytes): when two live blocks have the size, the engine gives back
    the one allocated by an op the releasing op depends on (a gathered unit by its all-gather,
    a gradient by the backward its reduce-scatter waits for), else the latest."""
    from types import SimpleNamespace

    from hzpsim.sim.engine import _owner_stream

    blocks = [(4.0e9, "ag", 7), (4.0e9, "compute", 9)]
    assert _owner_stream(list(blocks), 4.0e9, SimpleNamespace(deps=(3, 7), stream="compute")) == "ag"
    assert _owner_stream(list(blocks), 4.0e9, SimpleNamespace(deps=(3,), stream="rs")) == "compute"
    assert _owner_stream(list(blocks), 4.0e9, SimpleNamespace(deps=(9,), stream="rs")) == "compute"


def test_communicators_count_distinct_groups_with_the_rank():
    groups = [range(0, 8), (0, 1), (0, 1), (2, 3), (0,)]
    assert communicators(groups, 0) == 2 and communicators(groups, 5) == 1


def test_loss_temporaries_by_implementation():
    # eager fp32 cross-entropy over bf16 logits: logits + fp32 copy in the forward, two fp32
    # gradients beside the saved log-softmax in the backward
    assert loss_bytes_per_logit("eager-fp32", 2) == (4.0, (2, 4.0), (4.0, 4.0))
    assert loss_bytes_per_logit("eager-fp32", 4) == (4.0, (4,), (4.0, 4.0))  # .float() is a no-op
    # Megatron's vocab-parallel loss works in place: only the bf16 logits and their bf16 gradient
    assert loss_bytes_per_logit("vocab-parallel", 2) == (4.0, (2,), (2,))


def _report(**cluster):
    from hzpsim.run import run_choice
    from hzpsim.scenario import scenario_from_mapping

    sc = scenario_from_mapping({
        "model": {"preset": "llama3-8b", "seq_len": 4096}, "training": {"global_batch_size": 8, "micro_batch_size": 1},
        "cluster": {"preset": "dgx-h100", **cluster}, "strategy": {"name": "zero", "stage": 3, "implementation": "fsdp2"}})
    return run_choice(sc, sc.strategies[0])


def test_report_memory_keys_tell_allocated_reserved_overhead_and_headroom():
    r = _report()
    logits = 4096 * 128256  # one sequence's logits
    # the peak holds the loss's eager temporaries: in the forward the bf16 logits and their fp32
    # copy (6 B per logit), or in the loss's backward its two fp32 gradients (8 B)
    assert r["memory_breakdown_bytes"]["temporaries"] in (pytest.approx(6 * logits), pytest.approx(8 * logits))
    assert r["peak_memory_allocated_bytes"] < r["peak_memory_reserved_bytes"] == r["peak_memory_bytes"]
    assert r["device_overhead_bytes"] == pytest.approx(300e6 + 1.3e9)  # context + one communicator
    assert r["memory_headroom_bytes"] == pytest.approx(
        r["memory_capacity_bytes"] - r["device_overhead_bytes"] - r["peak_memory_reserved_bytes"])
    assert r["fits_in_memory"]
    # asking for more headroom than is left makes it not fit; expandable segments reserve less
    assert not _report(min_memory_headroom_bytes=r["memory_headroom_bytes"] + 1)["fits_in_memory"]
    assert _report(expandable_segments=True)["peak_memory_reserved_bytes"] < r["peak_memory_reserved_bytes"]


def test_fsdp2_reserves_its_gather_streams_pool_beside_allocated():
    """FSDP2 allocates each gathered unit on its all-gather stream and the compute stream frees
    it: the block goes back to the gather stream's pool (FSDP2's inter-stream fragmentation,
    measured on an H200 as 4.73 GiB cached on that stream, docs/gpu-measurements.md). The
    replay's reserved peak holds that pool beside the compute stream's; one shared pool would
    reserve less, and reserved exceeds allocated by at least the side pool."""
    from hzpsim.report import resident_memory
    from hzpsim.run import resolve, simulate_choice
    from hzpsim.scenario import scenario_from_mapping
    from hzpsim.sim.engine import Trace

    sc = scenario_from_mapping({
        "model": {"preset": "llama3-8b", "seq_len": 4096}, "training": {"global_batch_size": 8, "micro_batch_size": 1},
        "cluster": {"preset": "dgx-h100"}, "strategy": {"name": "zero", "stage": 3, "implementation": "fsdp2"}})
    choice = sc.strategies[0]
    traces: list[Trace] = []
    r = simulate_choice(sc, resolve(sc, choice.name, choice.config), traces=traces)
    events = traces[0].memory_events[0]
    gathered = [e for e in events if e[1] == "buffers" and e[2] > 0 and e[3] == "ag"]
    # every gathered block is released to the gather stream's pool, whichever op frees it
    assert gathered and sum(e[2] for e in events if e[3] == "ag") == pytest.approx(0.0, abs=1.0)
    pools = replay(resident_memory(traces[0], 0), events)
    side = sum(v for s, v in pools.reserved_by_stream_bytes.items() if s != "compute")
    assert side >= max(e[2] for e in gathered)  # at least the largest gathered unit, cached on "ag"
    assert r["peak_memory_reserved_bytes"] >= pools.peak_reserved_bytes  # the worst rank's
    assert r["peak_memory_reserved_bytes"] - r["peak_memory_allocated_bytes"] >= side
    one_pool = replay(resident_memory(traces[0], 0), [e[:3] for e in events])
    assert one_pool.peak_reserved_bytes < pools.peak_reserved_bytes


def _zero3_trace(implementation: str):
    """The report and the trace of ZeRO-3 on Llama-3-8B (dgx-h100) under ``implementation``."""
    from hzpsim.run import resolve, simulate_choice
    from hzpsim.scenario import scenario_from_mapping
    from hzpsim.sim.engine import Trace

    sc = scenario_from_mapping({
        "model": {"preset": "llama3-8b", "seq_len": 4096}, "training": {"global_batch_size": 8, "micro_batch_size": 1},
        "cluster": {"preset": "dgx-h100"}, "strategy": {"name": "zero", "stage": 3, "implementation": implementation}})
    choice = sc.strategies[0]
    traces: list[Trace] = []
    report = simulate_choice(sc, resolve(sc, choice.name, choice.config), traces=traces)
    return report, traces[0]


def test_fsdp2_copies_each_gathered_unit_out_into_the_compute_streams_pool():
    """FSDP2 gathers into a flat buffer on its all-gather stream (foreach_all_gather) and copies
    it out into per-parameter tensors on the compute stream (wait_for_unshard ->
    foreach_all_gather_copy_out), freeing the flat buffer: the unsharded parameters live in the
    compute stream's pool until the reshard, the gather stream's pool holds only flat buffers,
    and during the copy both are allocated. Each micro-batch's reduce-scatter output (the
    sharded gradient, foreach_reduce) is allocated on the reduce-scatter stream."""
    from hzpsim.report import resident_memory

    _, trace = _zero3_trace("fsdp2")
    events = trace.memory_events[0]
    unsharded = [e for e in events if e[1] == "params"]
    assert unsharded and {e[3] for e in unsharded} == {"compute"}  # allocated and released there
    assert sum(e[2] for e in unsharded) == pytest.approx(0.0, abs=1.0)
    flat = [e for e in events if e[3] == "ag"]
    assert flat and {e[1] for e in flat} == {"buffers"}  # the gather stream: flat outputs only
    assert sorted(e[2] for e in flat if e[2] > 0) == sorted(e[2] for e in unsharded if e[2] > 0)
    # the copy-out allocates the parameters when it starts and frees the flat buffer when it
    # ends: the flat buffer is released after (not before) its copy's allocation
    copies = [op for op in trace.graph.ops if op.name.startswith("copy.") and 0 in op.ranks]
    assert copies and all(op.alloc == (("params", op.free[0][1]),) and [c for c, _ in op.free] == ["buffers"]
                          for op in copies)
    first = next(e for e in events if e[1] == "params" and e[2] > 0)
    released = next(e for e in events if e[3] == "ag" and e[2] < 0)
    assert released[0] > first[0] and -released[2] == pytest.approx(first[2])
    # the reduce-scatter's outputs: on its stream, as long as it runs
    outputs = [e for e in events if e[1] == "grads"]
    assert outputs and {e[3] for e in outputs} == {"rs"} and sum(e[2] for e in outputs) == pytest.approx(0.0, abs=1.0)
    pools = replay(resident_memory(trace, 0), events).reserved_by_stream_bytes
    assert pools["ag"] >= max(e[2] for e in flat) and pools["rs"] >= max(e[2] for e in outputs)


def test_deepspeed_zero3_gathers_straight_into_the_parameters_on_the_gather_stream():
    """DeepSpeed ZeRO-3 all-gathers into the parameters' own storage (_allgather_params_coalesced):
    no copy-out, each gathered block on the gather stream until the compute that used it
    ends; its reduce-scatter allocates nothing on its stream."""
    _, trace = _zero3_trace("deepspeed")
    events = trace.memory_events[0]
    assert not [e for e in events if e[1] == "params"]
    gathered = [e for e in events if e[3] == "ag"]
    assert gathered and {e[1] for e in gathered} == {"buffers"}
    assert sum(e[2] for e in gathered) == pytest.approx(0.0, abs=1.0)
    assert not [e for e in events if e[3] == "rs"]
    assert not any(op.alloc for op in trace.graph.ops if op.name.startswith("copy."))


@pytest.mark.parametrize("setting, key", [
    ("cluster.device_memory_bytes=1e9", "device_memory_bytes"),
    ("cluster.min_memory_headroom_bytes=-1", "min_memory_headroom_bytes"),
    ("cluster.expandable_segments=3", "expandable_segments"),
])
def test_bad_memory_settings_exit_2_naming_the_key(capsys, setting, key):
    from hzpsim.cli import main

    assert main(["run", "--set", "cluster.device=h100-sxm", "--set", setting]) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


def test_explain_prints_the_memory_at_the_peak(capsys):
    from hzpsim.cli import main

    assert main(["run", "--set", "cluster.device=h100-sxm", "--explain"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("memory at the peak"))
    assert "allocated" in line and "reserved" in line and "outside PyTorch" in line and "headroom" in line
    assert "activations" in line and "temporaries" in line


@pytest.mark.parametrize("implementation, per_param", [("fsdp2", 4.0), ("deepspeed", 0.0)])
def test_the_optimizer_step_holds_foreach_adams_denominators(implementation, per_param):
    """torch.optim.Adam's foreach path makes one fp32 denominator per parameter of the shard
    while it steps (``_multi_tensor_adam``: ``_foreach_sqrt``); a fused Adam makes none."""
    from hzpsim import strategies
    from hzpsim.scenario import scenario_from_mapping

    sc = scenario_from_mapping({
        "model": {"preset": "tiny-dense"}, "training": {"global_batch_size": 8, "micro_batch_size": 1},
        "cluster": {"preset": "dgx-h100"}, "strategy": {"name": "zero", "stage": 3, "implementation": implementation}})
    choice = sc.strategies[0]
    graph = strategies.get(choice.name).build(choice.config, sc.model, sc.training, sc.topology)
    step = next(op for op in graph.ops if op.category == "optimizer" and op.ranks == (0,))
    held = sum(size for category, size in step.alloc if category == "temporaries")
    assert held == pytest.approx(per_param * sc.model.num_params() / 8, rel=1e-9)
    assert step.free == step.alloc
