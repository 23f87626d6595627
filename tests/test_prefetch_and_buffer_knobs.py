"""The ZeRO-3 / AsyncHZP knobs of ``hzpsim/strategies/_sharded.py`` against closed forms.

Each test names one knob and fails when that knob is ignored or hard-coded:

- prefetch depth D (``Schedule.prefetch_depth``): when each all-gather is issued;
- the gather ring (D + 1 buffers of the largest unit, ``fixed_buffers``) and the gradient
  scatter buffers (``Schedule.reduce_buffers`` = R): their exact bytes;
- R again: the backward stalls while all R scatter buffers wait for their reduce-scatter.

The model is ``tiny-dense`` (workloads/tiny-dense.yaml: h = 256, 4 heads, 2 kv heads of 64,
SwiGLU ffn 688, vocab 1,024, 4 layers), whose units are counted here by hand:

    layer  = q, o: 2 x 256 x 256 + k, v: 2 x 256 x 128 + 3 x 256 x 688 + 2 norms x 256 = 725,504
    embed  = 1,024 x 256                                                          = 262,144
    head   = 1,024 x 256 + final norm 256                                         = 262,400

so the largest unit is a layer, L = 725,504 parameters (bf16 working copy: 2 bytes; fp32
gradients: 4 bytes).
"""

from __future__ import annotations

import pytest

from hzpsim import strategies
from hzpsim.run import run_choice
from hzpsim.scenario import scenario_from_mapping
from hzpsim.sim.engine import simulate

LAYER = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 688 + 2 * 256  # parameters of one tiny-dense layer
EMBED = 1024 * 256
HEAD = 1024 * 256 + 256
BW, BG = 2, 4  # bytes per working parameter (bf16) and per gradient element (fp32)


def scenario(strategy: dict, nodes: int = 1, micro_batch: int = 256, micro_batches: int = 2, cluster=None):
    """tiny-dense on DGX H100 nodes; ``micro_batches`` micro-batches per step, 2 steps. The
    knobs' own mechanics: the ``ideal`` implementation (no host thread, no framework cap on the
    prefetch depth) and no stragglers (``variability: 0``), unless a test says otherwise."""
    return scenario_from_mapping({
        "model": "tiny-dense",
        "training": {"global_batch_size": micro_batch * 8 * nodes * micro_batches, "micro_batch_size": micro_batch},
        "cluster": {"preset": "dgx-h100", "num_nodes": nodes, "variability": 0.0, "variability_persistent": 0.0, **(cluster or {})},
        "strategy": {"implementation": "ideal", **strategy},
    })


def build(sc):
    choice = sc.strategies[0]
    return strategies.get(choice.name).build(choice.config, sc.model, sc.training, sc.topology)


def traced(sc):
    graph = build(sc)
    return graph, simulate(graph, sc.topology)


def on_rank0(graph):
    return [op for op in graph.ops if 0 in op.ranks]


def consumers_of(ops):
    """op id -> the compute ops that depend on it directly, in program order."""
    out: dict[int, list] = {}
    for op in ops:
        if op.kind == "compute":
            for d in op.deps:
                out.setdefault(d, []).append(op)
    return out


def previous_on_stream(graph):
    """op id -> id of the op before it on rank 0's same stream (streams run their ops in order)."""
    last: dict[str, int] = {}
    before: dict[int, int] = {}
    for op in on_rank0(graph):
        if op.stream in last:
            before[op.id] = last[op.stream]
        last[op.stream] = op.id
    return before


# ---------------------------------------------------------------------------- prefetch depth

PREFETCH_CASES = [
    pytest.param({"name": "zero", "stage": 3}, id="zero3"),
    pytest.param({"name": "asynchzp"}, id="asynchzp"),  # one node: 8 | 8 | 8, async streams
]


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("strategy", PREFETCH_CASES)
def test_prefetch_depth_issues_gather_i_when_the_compute_of_gather_i_minus_D_minus_1_ends(strategy, depth):
    """Number the all-gathers g_0, g_1, ... in order of use over the whole run (per micro-batch:
    the forward's units in order, then, resharded after the forward, the backward's in reverse;
    then the next micro-batch, the next step). With prefetch depth D the ring has D + 1 gather
    buffers, and g_i reuses the buffer of g_{i-D-1}, so, for micro-batch/step s:

        start(g_i) = max( end(g_{i-1}),                     one gather stream, in order
                          end(compute consuming g_{i-D-1}),  i > D: its buffer is free again
                          end(optimizer of step s - 1) )     s > 0: the updated shard exists

    Here compute is ~10x a gather (micro-batch 256 over 8 NVLink ranks), so for every gather
    whose gating compute is a layer's or the head's in the same step, the middle term is the
    one that binds: g_i starts exactly when that compute ends, strictly after g_{i-1} ended.
    In the forward that reads: unit u's gather is issued when unit u - D - 1's forward ends.
    """
    sc = scenario({**strategy, "prefetch_depth": depth})
    graph, trace = traced(sc)
    ops = on_rank0(graph)
    consumers = consumers_of(ops)
    gathers = [op for op in ops if op.category == "param_gather" and op.id in consumers]
    optimizer = {op.step: op for op in ops if op.category == "optimizer"}
    before = previous_on_stream(graph)
    units, micro_batches, steps = 6, 2, 2  # embed, 4 layers, head
    uses = [(phase, u) for phase in ("forward", "backward") for u in (range(units) if phase == "forward"
                                                                      else reversed(range(units)))]
    assert len(gathers) == steps * micro_batches * len(uses)  # forward and backward, every micro-batch
    for i, g in enumerate(gathers):  # in order of use, each consumed by one compute op
        assert [c.category for c in consumers[g.id]] == [uses[i % len(uses)][0]], g.name

    def consumer(g):
        return consumers[g.id][0]

    gating = 0
    for i, g in enumerate(gathers):
        terms = {"previous gather": trace.end_s[before[g.id]] if g.id in before else 0.0}
        assert g.id not in before or graph.ops[before[g.id]] is gathers[i - 1]
        if i > depth:
            terms["ring"] = trace.end_s[consumer(gathers[i - depth - 1]).id]
        if g.step > 0:
            terms["optimizer"] = trace.end_s[optimizer[g.step - 1].id]
        assert trace.start_s[g.id] == pytest.approx(max(terms.values()), rel=1e-12, abs=1e-15), (
            f"{g.name} (g_{i}, step {g.step}) started at {trace.start_s[g.id]:.9g} s, expected {terms}")
        if i > depth:
            gate = consumer(gathers[i - depth - 1])
            if gate.step == g.step and uses[(i - depth - 1) % len(uses)][1] != 0:  # not the embedding
                gating += 1
                assert terms["ring"] > terms["previous gather"], f"{g.name}: the ring does not bind here"
                assert trace.start_s[g.id] == pytest.approx(terms["ring"], rel=1e-12)
    assert gating >= len(gathers) - 2 * (depth + 4)  # nearly every gather is gated by the ring


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_per_use_gather_buffers_peak_at_D_plus_1_layers_in_the_forward(depth):
    """ZeRO-3 allocates each gathered unit when its gather starts and frees it when its compute
    ends; the ring lets D + 1 be live at once. While the first forward runs (compute-bound, so
    the ring is always full) the live gather buffers therefore peak at D + 1 consecutive units,
    the largest window of which is D + 1 layers (D + 1 <= 4): (D + 1) x L x 2 bytes."""
    sc = scenario({"name": "zero", "stage": 3, "prefetch_depth": depth})
    graph, trace = traced(sc)
    first_backward = next(op for op in on_rank0(graph) if op.category == "backward")
    until = trace.start_s[first_backward.id]  # where the first gradient buffer is taken
    deltas: dict[float, float] = {}
    for time, category, delta, _ in trace.memory_events[0]:
        if category == "buffers" and time < until:
            deltas[time] = deltas.get(time, 0.0) + delta
    live, peak = 0.0, 0.0
    for time in sorted(deltas):
        live += deltas[time]
        peak = max(peak, live)
    assert peak == pytest.approx((depth + 1) * LAYER * BW, rel=1e-12)


# ---------------------------------------------------------------------------- buffer bytes

@pytest.mark.parametrize("depth,reduce_buffers", [(0, 1), (1, 2), (2, 1), (3, 3), (1, 4)])
def test_fixed_ring_is_D_plus_1_gather_buffers_and_R_scatter_buffers_of_the_largest_unit(depth, reduce_buffers):
    """AsyncHZP (async: fixed buffers) pre-allocates, once, a ring of D + 1 gather buffers and R
    gradient scatter buffers, each the size of the largest unit (a layer):

        buffers = (D + 1) x L x 2 B  +  R x L x 4 B

    resident for the whole run (static memory, no per-use allocation events), and so exactly
    the ``buffers`` share of the reported peak."""
    sc = scenario({"name": "asynchzp", "prefetch_depth": depth, "reduce_buffers": reduce_buffers},
                  micro_batch=1, micro_batches=1)
    expected = (depth + 1) * LAYER * BW + reduce_buffers * LAYER * BG
    graph = build(sc)
    assert graph.static_memory[0]["buffers"] == pytest.approx(expected, rel=1e-12)
    assert "other" not in graph.static_memory[0]  # no allocator fragmentation with a fixed ring
    assert not any(category == "buffers" for op in graph.ops for category, _ in (*op.alloc, *op.free))
    report = run_choice(sc, sc.strategies[0])
    assert report["memory_breakdown_bytes"]["buffers"] == pytest.approx(expected, rel=1e-12)


def test_sync_asynchzp_allocates_each_buffer_on_the_stream_that_fills_it():
    """``async: false`` allocates per use instead of a pre-allocated ring: each gather buffer
    (a layer: L x 2 B) when its all-gather starts, on that op's communication stream, and its release
    by the compute that used it names that stream, whose caching-allocator pool the block goes
    back to (sim/allocator.py); the gradient buffer (L x 4 B) is the backward's, on the compute
    stream."""
    sc = scenario({"name": "asynchzp", "async": False, "prefetch_depth": 3, "reduce_buffers": 3},
                  micro_batch=1, micro_batches=1)
    graph, trace = traced(sc)
    assert "buffers" not in graph.static_memory[0] and "other" not in graph.static_memory[0]
    gathers = {op.stream for op in on_rank0(graph) if op.category == "param_gather" and op.alloc}
    assert len(gathers) == 1 and "compute" not in gathers
    (comm,) = gathers
    events = [e for e in trace.memory_events[0] if e[1] == "buffers"]
    taken = {stream: sorted(e[2] for e in events if e[3] == stream and e[2] > 0) for stream in (comm, "compute")}
    given = {stream: sorted(-e[2] for e in events if e[3] == stream and e[2] < 0) for stream in (comm, "compute")}
    assert taken == given  # every block back to the pool of the stream that allocated it
    assert max(taken[comm]) == pytest.approx(LAYER * BW, rel=1e-12)  # the largest unit: a layer
    assert max(taken["compute"]) == pytest.approx(LAYER * BG, rel=1e-12)


# ---------------------------------------------------------------------------- scatter slots

@pytest.mark.parametrize("reduce_buffers", [1, 2, 3])
def test_backward_stalls_while_all_R_scatter_buffers_await_their_reduce_scatter(reduce_buffers):
    """AsyncHZP 8 | 16 | 16 on two nodes: gathers stay in the node, every gradient
    reduce-scatter crosses a NIC slowed to 0.1 GB/s, so reduce-scatters take ~100x a
    backward. Number the backwards b_0, b_1, ... in program order (every unit has parameters,
    so each writes a gradient buffer and issues reduce-scatter rs_k on one stream). With R
    scatter buffers, b_k (k >= R) needs the buffer rs_{k-R} frees, so here exactly:

        start(b_k) = end(rs_{k-R})           for k >= R, rs_{k-R} of the same step
        start(b_k) >= end(rs_{k-R})          for k >= R (across a step end: the optimizer
                                             waited for every reduce-scatter already)
        start(b_k) < end(rs_0)               for 0 < k < R (a free buffer: no stall)

    and when b_k starts the R - 1 reduce-scatters rs_{k-R+1} .. rs_{k-1} are still running:
    with b_k's own gradient, all R buffers are in flight."""
    sc = scenario({"name": "asynchzp", "param_group_size": 8, "grad_group_size": 16, "optim_group_size": 16,
                   "reduce_buffers": reduce_buffers},
                  nodes=2, micro_batch=8, micro_batches=2, cluster={"inter_node_bytes_per_s_per_device": 1e8})
    graph, trace = traced(sc)
    ops = on_rank0(graph)
    # the units' backwards (not the loss's own backward op, which has no parameters)
    backwards = [op for op in ops if op.category == "backward" and not op.name.startswith("bwd.loss")]
    after = {b.id: [op for op in ops if op.category == "grad_reduce" and b.id in op.deps] for b in backwards}
    assert all(len(rs) == 1 for rs in after.values())  # each backward's gradient: one reduce-scatter
    scatters = [after[b.id][0] for b in backwards]
    assert len(backwards) == 2 * 2 * 6  # steps x micro-batches x units
    assert all(rs.collective == "reduce_scatter" and rs.step == b.step for b, rs in zip(backwards, scatters))
    start, end = trace.start_s, trace.end_s
    stalled = 0
    for k, b in enumerate(backwards):
        if k >= reduce_buffers:
            freed = scatters[k - reduce_buffers]
            assert start[b.id] >= end[freed.id], b.name
            if freed.step == b.step:
                stalled += 1
                assert start[b.id] == pytest.approx(end[freed.id], rel=1e-12), b.name
                running = [rs for rs in scatters[:k] if end[rs.id] > start[b.id]]
                assert running == scatters[k - reduce_buffers + 1 : k], b.name
        elif k > 0:
            assert start[b.id] < end[scatters[0].id], b.name
    assert stalled == 2 * (12 - reduce_buffers)  # every backward but the first R of each step
