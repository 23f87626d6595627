"""Implementation profiles against hand counts from each framework's code, and the classic
ZeRO-3 vs Megatron head-to-head (Narayanan et al., SC'21 §5.2) from mechanism alone.

The counts are per transformer layer and micro-batch (data-parallel reductions: per step) for
a GPT-3-175B layer (h = 12288: twelve tensors, layer norms and biases below DeepSpeed's 1e5
persistence threshold except none of the four weights), full activation recompute.
"""

from __future__ import annotations

from collections import Counter

import pytest

from hzpsim import strategies
from hzpsim.run import run_choice
from hzpsim.scenario import scenario_from_mapping
from hzpsim.strategies import _implementations

GPT3_LAYERS = {"preset": "gpt3-175b", "num_layers": 2}
TRAINING = {"global_batch_size": 16, "micro_batch_size": 1, "precision": "fp16",
            "activation_recompute": "full", "flash_attention": False}


def counts(strategy: dict, prefix: str = "layer0") -> Counter:
    """Collective calls (an op with ``count`` k is k calls) of ``prefix``'s unit in the last
    step, micro-batch 0, by (name stem, kind). One micro-batch per replica, so that ``nd``
    emits every unit on its own (it merges the units of middle micro-batches)."""
    replicas = 16 // strategy.get("tp", 1)
    training = {**TRAINING, "global_batch_size": replicas}
    scenario = scenario_from_mapping({"model": GPT3_LAYERS, "training": training,
                                      "cluster": {"preset": "dgx-a100", "num_nodes": 2}, "strategy": strategy})
    choice = scenario.strategies[0]
    graph = strategies.get(choice.name).build(choice.config, scenario.model, scenario.training, scenario.topology)
    last = max(op.step for op in graph.ops)
    out: Counter = Counter()
    for op in graph.ops:
        if op.kind != "collective" or op.step != last:
            continue
        parts = op.name.split(".")
        if f"{prefix}" not in parts or ("mb0" not in parts and not op.name.startswith(("rs_step", "ag_step", "ar."))):
            continue
        out[(".".join(p for p in parts if p not in (prefix, "mb0")), op.collective)] += op.count
    return out


def test_deepspeed_2021_one_list_form_call_per_tensor():
    """DeepSpeed v0.5.0 ``PartitionedParameterCoordinator.fetch_sub_module`` -> ``Init._allgather_param``:
    one all_gather per non-persistent tensor (the four weights: biases and norms are < 1e5
    elements); the recompute forward fires the hooks again (4 more), and the backward
    re-gathers what was visited more than ``stage3_max_reuse_distance`` = 1e9 elements before:
    QKV (2·(h²+8h²) = 2.7e9), proj (2·8h² = 2.4e9), fc1 (2·4h² = 1.2e9), not fc2 (0) -> 3.
    ``Init._reduce_scatter_gradients``: one reduce_scatter per tensor, all twelve."""
    c = counts({"name": "zero", "stage": 3, "implementation": "deepspeed-2021"})
    assert c == {("ag.fwd", "all_gather"): 4, ("ag.bwd", "all_gather"): 4 + 3, ("rs", "reduce_scatter"): 12}
    impl = _implementations.get("deepspeed-2021")
    assert impl.list_form and impl.sync_before_gather and impl.max_prefetch_depth == 0


def test_deepspeed_current_coalesces_into_buckets():
    """DeepSpeed @38327e07 ``fetch_sub_module``: one coalesced all_gather_into_tensor per
    prefetch batch of >= 5e7 elements: each 175B weight fills a batch alone -> 4 per pass, the
    same re-gather rule -> 4 + 3 in the backward. ``__reduce_and_partition_ipg_grads``: one
    reduce_scatter per 5e8-element bucket, gradients in reverse order: [fc2], [fc1],
    [proj + qkv] (the last norm joins the next layer's bucket) -> 3."""
    c = counts({"name": "zero", "stage": 3, "implementation": "deepspeed"})
    assert c == {("ag.fwd", "all_gather"): 4, ("ag.bwd", "all_gather"): 7, ("rs", "reduce_scatter"): 3}


@pytest.mark.parametrize("impl", ["fsdp1", "fsdp2", "ideal"])
def test_fsdp_one_flat_call_per_unit(impl):
    """FSDP1 ``_runtime_utils._unshard`` / FSDP2 ``foreach_all_gather``: one all-gather per
    unit (FlatParameter / param group) in the forward and one in the backward; the recompute
    runs inside the pre-backward unshard (FSDP2 ``FSDPState._pre_forward`` returns early in
    PRE_BACKWARD); one reduce-scatter per unit (``_post_backward_hook`` / ``foreach_reduce``)."""
    c = counts({"name": "zero", "stage": 3, "implementation": impl})
    assert c == {("ag.fwd", "all_gather"): 1, ("ag.bwd", "all_gather"): 1, ("rs", "reduce_scatter"): 1}


def test_megatron_2021_tp_all_reduces_and_one_buffer_all_reduce():
    """Megatron-LM v2.5 ``mpu/mappings.py``: RowParallelLinear all-reduces the attention and MLP
    outputs (2 forward), ColumnParallelLinear the input gradients (2 backward), and
    ``mpu.checkpoint`` reruns the forward with its 2 all-reduces in the backward -> 4.
    ``model/distributed.py::allreduce_gradients``: one all-reduce of the whole gradient buffer
    per step, after the backward (no per-layer reduction)."""
    c = counts({"name": "nd", "tp": 8, "implementation": "megatron-2021"})
    assert c == {("tp.fwd", "all_reduce"): 2, ("tp.bwd", "all_reduce"): 4}
    whole = counts({"name": "nd", "tp": 8, "implementation": "megatron-2021"}, prefix="buffer")
    assert whole == {("ar", "all_reduce"): 1}


def test_megatron_core_buckets_the_distributed_optimizer():
    """megatron/core ``_ParamAndGradBuffer``: buckets of max(4e7, 1e6·dp) elements closed at the
    first parameter boundary past the size, walking the parameters in reverse: with TP 8 the
    175B layer's weights per rank are fc2 7.5e7, fc1 7.5e7, proj 1.9e7 + qkv 5.7e7 -> 3
    buckets; ``start_grad_sync`` reduce-scatters and ``start_param_sync`` all-gathers each
    once per step."""
    c = counts({"name": "nd", "tp": 8, "zero_stage": 1, "implementation": "megatron-core"})
    assert c[("tp.fwd", "all_reduce")] == 2 and c[("tp.bwd", "all_reduce")] == 4
    assert c[("rs_step", "reduce_scatter")] == 3 and c[("ag_step", "all_gather")] == 3


def test_unknown_implementation_is_a_named_error():
    with pytest.raises(Exception, match="strategy.implementation: unknown 'nosuch'"):
        scenario_from_mapping({"model": "tiny-dense", "cluster": {"preset": "dgx-h100"},
                               "strategy": {"name": "zero", "implementation": "nosuch"}})


SC21 = {"model": "gpt3-175b", "cluster": {"preset": "dgx-a100"},
        "training": {"global_batch_size": 1536, "precision": "fp16", "flash_attention": False,
                     "activation_recompute": "full"}}


def sc21(num_gpus: int, strategy: dict, micro_batch: int) -> dict:
    data = {**SC21, "cluster": {**SC21["cluster"], "num_nodes": num_gpus // 8},
            "training": {**SC21["training"], "micro_batch_size": micro_batch}, "strategy": strategy}
    scenario = scenario_from_mapping(data)
    return run_choice(scenario, scenario.strategies[0])


@pytest.mark.slow
def test_sc21_zero3_falls_while_ptdp_holds():
    """SC'21 Table 2: ZeRO-3 (DeepSpeed 2021) 144 -> 44 TFLOP/s per GPU from 384 to 1,536 GPUs at
    a fixed batch of 1,536 (micro-batch 4 -> 1); PTD-P (TP 8, PP 12) 153 -> 141. From mechanism
    (per-tensor list-form gathers behind host synchronisations), not from fitted factors."""
    zero_small = sc21(384, {"name": "zero", "stage": 3, "implementation": "deepspeed-2021"}, 4)
    zero_large = sc21(1536, {"name": "zero", "stage": 3, "implementation": "deepspeed-2021"}, 1)
    ptdp_small = sc21(384, {"name": "nd", "tp": 8, "pp": 12, "implementation": "megatron-2021"}, 1)
    ptdp_large = sc21(1536, {"name": "nd", "tp": 8, "pp": 12, "implementation": "megatron-2021"}, 1)
    assert zero_large["tflops_per_device"] < 0.5 * zero_small["tflops_per_device"]
    assert ptdp_large["tflops_per_device"] > 0.85 * ptdp_small["tflops_per_device"]
    assert ptdp_large["tflops_per_device"] > 1.5 * zero_large["tflops_per_device"]
    # where ZeRO-3's time went: the host thread and exposed gathers, not compute
    breakdown = zero_large["time_breakdown_s"]
    assert breakdown["host"] + breakdown["exposed.param_gather"] > 0.5 * zero_large["step_time_s"]
    # a modern stack on the same cluster stays near the compute bound
    fsdp2 = sc21(1536, {"name": "zero", "stage": 3, "implementation": "fsdp2"}, 1)
    assert fsdp2["tflops_per_device"] > 2 * zero_large["tflops_per_device"]


def test_megatron_core_sequence_parallel_gathers_and_scatters():
    """Megatron-LM ``tensor_parallel/mappings.py`` with ``--sequence-parallel``: each TP
    all-reduce becomes ``_gather_along_first_dim`` before the column-parallel layer and
    ``_reduce_scatter_along_first_dim`` after the row-parallel one; their backwards are each
    other, and the full recompute repeats the forward's pair. Per layer: 2 + 2 in the forward,
    4 + 4 in the backward. ``finalize_model_grads._allreduce_layernorm_grads``: one
    all-reduce per step of the norm gradients over the TP group."""
    c = counts({"name": "nd", "tp": 8, "sequence_parallel": True, "implementation": "megatron-core"})
    assert c == {("tp.fwd.ag", "all_gather"): 2, ("tp.fwd.rs", "reduce_scatter"): 2,
                 ("tp.bwd.ag", "all_gather"): 4, ("tp.bwd.rs", "reduce_scatter"): 4,
                 ("ar", "all_reduce"): 3}  # the data-parallel buckets, as without SP
    scenario = scenario_from_mapping({"model": GPT3_LAYERS, "training": {**TRAINING, "global_batch_size": 2},
                                      "cluster": {"preset": "dgx-a100", "num_nodes": 2},
                                      "strategy": {"name": "nd", "tp": 8, "sequence_parallel": True}})
    choice = scenario.strategies[0]
    graph = strategies.get(choice.name).build(choice.config, scenario.model, scenario.training, scenario.topology)
    [norm] = [op for op in graph.ops if op.name == "tp.sp_norm_grads" and op.step == 0]
    model = scenario.model
    assert (norm.collective, norm.count) == ("all_reduce", 1)
    # both layers' norms and row-parallel biases (attention projection, fc2) and the final norm,
    # fp32 gradients
    h = model.hidden_size
    assert norm.size_bytes == (2 * (model.norm_params_per_layer() + 2 * h) + model.final_norm_params()) * 4
    # the embedding's forward reduce-scatter comes back as a backward gather; the head's
    # forward gather as a backward reduce-scatter; Megatron keeps the logits vocabulary-parallel
    assert counts({"name": "nd", "tp": 8, "sequence_parallel": True}, prefix="embed") == {
        ("tp.fwd.rs", "reduce_scatter"): 1, ("tp.bwd.ag", "all_gather"): 1, ("ar", "all_reduce"): 1}
    assert counts({"name": "nd", "tp": 8, "sequence_parallel": True}, prefix="head") == {
        ("tp.fwd.ag", "all_gather"): 1, ("tp.bwd.rs", "reduce_scatter"): 1, ("ar", "all_reduce"): 1}


def test_dtensor_gathers_the_logits():
    """DTensor's head ``ColwiseParallel(output_layouts=Replicate())`` (torchtitan's plan
    without loss parallelism, what hzpsim's executor runs) all-gathers the vocabulary-sharded
    logits: one more forward gather of b·s·V elements."""
    c = counts({"name": "nd", "tp": 8, "sequence_parallel": True, "implementation": "dtensor"}, prefix="head")
    assert c == {("tp.fwd.ag", "all_gather"): 1, ("tp.fwd.logits", "all_gather"): 1,
                 ("tp.bwd.rs", "reduce_scatter"): 1, ("ar", "all_reduce"): 1}  # + its data-parallel reduction


@pytest.mark.parametrize(("impl", "per_param"), [("deepspeed", 2 + 4 + 12), ("fsdp2", 4 + 4 + 8),
                                                 ("torchtitan", 4 + 4 + 8), ("megatron-core", 2 + 4 + 12)])
def test_model_state_layout(impl, per_param):
    """Resident model states per parameter under fp16 with fp32 gradients: DeepSpeed and
    Megatron keep the fp16 working copy and an fp32 master in the optimizer (2 + 4 + 12 B);
    FSDP2 (``FSDPParam.init_dtype_attrs``: the sharded parameter keeps its fp32 dtype, only the
    all-gather is cast; ``foreach_reduce`` casts the reduced gradient back to it) keeps 4 + 4 B
    and Adam's two fp32 moments (8 B)."""
    strategy = {"name": "zero", "stage": 3} if impl in ("deepspeed", "fsdp2") else {"name": "nd", "tp": 2}
    if impl == "torchtitan":
        strategy = {"name": "hsdp", "shard_group_size": 16}
    scenario = scenario_from_mapping({"model": GPT3_LAYERS, "training": {**TRAINING, "grad_dtype": "fp32"},
                                      "cluster": {"preset": "dgx-a100", "num_nodes": 2},
                                      "strategy": {**strategy, "implementation": impl}})
    choice = scenario.strategies[0]
    graph = strategies.get(choice.name).build(choice.config, scenario.model, scenario.training, scenario.topology)
    states = sum(graph.static_memory[0].get(k, 0.0) for k in ("params", "grads", "optimizer"))
    model = scenario.model
    params = model.embedding_params() + sum(model.layer_params(i) for i in range(model.num_layers)) + \
        model.head_params() + model.final_norm_params()
    shards = 16 if strategy["name"] != "nd" else 2  # nd(tp=2): dp 8 without ZeRO, params split over tp
    if strategy["name"] == "nd":
        norms = model.num_layers * model.norm_params_per_layer() + model.final_norm_params()
        params = (params - norms) / 2 + norms  # the norms are replicated over the TP group
        shards = 1
    assert states == pytest.approx(per_param * params / shards, rel=1e-12)


@pytest.mark.parametrize("strategy, key, shown", [
    ({"name": "nd", "tp": 8, "pp": 4, "implementation": "megatron-2021"}, "overlap_grad_reduce", False),
    ({"name": "zero", "stage": 3, "prefetch_depth": 4, "implementation": "fsdp2"}, "prefetch_depth", 1),
])
def test_strategy_resolved_shows_what_the_profile_decides(strategy, key, shown):
    """Megatron 2021 reduces gradients after the backward whatever overlap_grad_reduce says, and
    FSDP2 keeps one gather in flight whatever prefetch_depth says: the report's strategy_resolved
    shows the value simulated, and the step is the one simulated with that value written."""
    def report(s):
        sc = scenario_from_mapping({"model": "llama2-7b", "training": {"global_batch_size": 64},
                                    "cluster": {"preset": "dgx-h100", "num_nodes": 4}, "strategy": s})
        return run_choice(sc, sc.strategies[0])

    r = report(strategy)
    assert r["strategy_resolved"][key] == shown
    assert r["step_time_s"] == report({**strategy, key: shown})["step_time_s"]


def test_megatron_profiles_run_their_frameworks_kernels_without_being_told():
    """``implementation: megatron-core`` on Hopper is what the validation mapping writes out for
    a NeMo row: hand-fused pointwise kernels and Transformer Engine's cuDNN attention; on an
    A100 the attention stays the default; an explicit kernel is kept; eager stacks unchanged."""
    def step(training: dict, strategy: dict, preset: str = "dgx-h100") -> float:
        sc = scenario_from_mapping({"model": "llama3-8b", "cluster": {"preset": preset, "num_nodes": 1},
                                    "training": {"global_batch_size": 16, "micro_batch_size": 2, **training},
                                    "strategy": {"name": "nd", "tp": 2, "pp": 2, **strategy}})
        return run_choice(sc, sc.strategies[0])["step_time_s"]

    core = {"implementation": "megatron-core"}
    stated = step({"fused_kernels": True, "attention_kernel": "cudnn"}, core)
    assert step({}, core) == stated
    assert step({}, {"implementation": "megatron-bridge"}) == step({"fused_kernels": True, "attention_kernel": "cudnn"},
                                                                   {"implementation": "megatron-bridge"})
    assert step({"attention_kernel": "flash2"}, core) > stated  # the user's kernel wins
    assert step({}, core, "dgx-a100") == step({"fused_kernels": True}, core, "dgx-a100")
    eager = {"implementation": "torchtitan"}
    assert step({}, eager) != step({"fused_kernels": True}, eager)  # not fused unless asked
    # and the report says what ran
    sc = scenario_from_mapping({"model": "llama3-8b", "cluster": {"preset": "dgx-h100", "num_nodes": 1},
                                "training": {"global_batch_size": 16, "micro_batch_size": 2},
                                "strategy": {"name": "nd", "tp": 2, "pp": 2, **core}})
    resolved = run_choice(sc, sc.strategies[0])["training_resolved"]
    assert resolved["attention_kernel"] == "cudnn" and resolved["fused_kernels"] is True
    assert resolved["micro_batch_size"] == 2 and resolved["global_batch_size"] == 16


def test_nemo_runs_the_distributed_optimizer_unless_told():
    """``zero_stage`` unset is the framework's default: NeMo's Megatron-Bridge recipes turn the
    distributed optimizer on (zero_stage 1), Megatron-LM needs the flag (0). The report says
    which, and simulates exactly what the stated stage would."""
    def report(strategy: dict) -> dict:
        sc = scenario_from_mapping({"model": "llama3-8b", "cluster": {"preset": "dgx-h100", "num_nodes": 2},
                                    "training": {"global_batch_size": 32},
                                    "strategy": {"name": "nd", "tp": 2, "pp": 2, **strategy}})
        return run_choice(sc, sc.strategies[0])

    for implementation, stage in (("megatron-bridge", 1), ("megatron-core", 0), ("megatron-2021", 0)):
        r = report({"implementation": implementation})
        assert r["strategy_resolved"]["zero_stage"] == stage, implementation
        stated = report({"implementation": implementation, "zero_stage": stage})
        assert r["step_time_s"] == stated["step_time_s"]
        assert r["peak_memory_allocated_bytes"] == stated["peak_memory_allocated_bytes"]
    # a stated stage wins, and the distributed optimizer's shards hold less
    plain = report({"implementation": "megatron-bridge", "zero_stage": 0})
    assert plain["strategy_resolved"]["zero_stage"] == 0
    assert report({"implementation": "megatron-bridge"})["peak_memory_allocated_bytes"] < plain["peak_memory_allocated_bytes"]


def test_transformer_engine_runs_cudnn_attention_on_blackwell_too():
    """TE prefers FusedAttention on compute capability >= 9.0: Hopper and Blackwell (sm100)."""
    for preset, kernel in (("dgx-h100", "cudnn"), ("dgx-b200", "cudnn"), ("dgx-a100", "auto")):
        sc = scenario_from_mapping({"model": "llama3-8b", "cluster": {"preset": preset, "num_nodes": 1},
                                    "training": {"global_batch_size": 16},
                                    "strategy": {"name": "nd", "tp": 2, "implementation": "megatron-core"}})
        assert run_choice(sc, sc.strategies[0])["training_resolved"]["attention_kernel"] == kernel, preset


def test_megatron_2021_with_torch_ddp_overlaps_the_gradient_all_reduce():
    """--DDP-impl torch: PyTorch DDP's buckets all-reduced during the last backward, where
    Megatron's local DDP reduces the whole buffer after it: less of it exposed, same bytes."""
    def report(implementation: str) -> dict:
        sc = scenario_from_mapping({"model": "llama2-7b", "cluster": {"preset": "dgx-a100", "num_nodes": 4},
                                    "training": {"global_batch_size": 64},
                                    "strategy": {"name": "nd", "tp": 2, "implementation": implementation}})
        return run_choice(sc, sc.strategies[0])

    local, torch_ddp = report("megatron-2021"), report("megatron-2021-torch-ddp")
    assert torch_ddp["exposed_comm_s"] < 0.7 * local["exposed_comm_s"]
    assert torch_ddp["step_time_s"] < local["step_time_s"]
    assert torch_ddp["comm_bytes_per_device"] == pytest.approx(local["comm_bytes_per_device"], rel=1e-6)
