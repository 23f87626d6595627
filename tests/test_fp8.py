"""fp8 recipes: the quantisation kernels Transformer Engine runs around each fp8 GEMM
(``_layers.fp8_quantize_bytes``), the implementation profiles' defaults and the mapping of a
published row's stated recipe."""

from __future__ import annotations

import dataclasses

import pytest

from hzpsim.cli import main
from hzpsim.model.training import Training
from hzpsim.run import run_choice
from hzpsim.scenario import load_scenario
from hzpsim.strategies._dims import ParallelDims
from hzpsim.strategies._implementations import get as implementation
from hzpsim.strategies._layers import FP8_QUANTIZE_BYTES, fp8_quantize_bytes
from hzpsim.strategies._mp_units import mp_units
from hzpsim.validation.mapping import map_fp8_recipe

# a Llama block as Model.layer_linears lists it: q, k, v and gate, up read the same input
H, KV, FFN = 4096, 1024, 14336
ATTENTION = [(H, H, "column"), (H, KV, "column"), (H, KV, "column"), (H, H, "row")]
MLP = [(H, FFN, "column"), (H, FFN, "column"), (FFN, H, "row")]


def test_each_distinct_input_and_each_output_gradient_is_quantised_once() -> None:
    """Per token, TP 1: the attention block quantises two inputs (the normed hidden state once
    for q, k and v; the attention output) and four output gradients; current scaling pays the
    amax pass on every standalone quantisation, not on the norm's."""
    fwd, bwd = fp8_quantize_bytes(ATTENTION, 1.0, 1, False, "tensorwise", normed_input=True)
    assert fwd == 4 * H + 6 * H
    assert bwd == 6 * (H + KV + KV + H)
    fwd, bwd = fp8_quantize_bytes(MLP, 1.0, 1, False, "delayed", normed_input=True)
    assert fwd == 0 * H + 4 * FFN  # the norm quantises its own output; the down projection's input
    assert bwd == 4 * (FFN + FFN + H)
    assert fp8_quantize_bytes(MLP, 1.0, 1, False, "fused", True) == (0.0, 0.0)


def test_tensor_parallel_ranks_quantise_their_share() -> None:
    """TP 4 with sequence parallelism: every operand is quantised on the rank's quarter (the
    column-parallel inputs and row-parallel gradients before their all-gather); without it the
    column-parallel input and the row-parallel gradient are whole on every rank."""
    one = fp8_quantize_bytes(MLP, 8.0, 1, False, "mxfp8", False)
    sp = fp8_quantize_bytes(MLP, 8.0, 4, True, "mxfp8", False)
    assert sp == pytest.approx((one[0] / 4, one[1] / 4))
    plain = fp8_quantize_bytes(MLP, 8.0, 4, False, "mxfp8", False)
    per = FP8_QUANTIZE_BYTES["mxfp8"][1] * 8
    assert plain == pytest.approx((per * (H + FFN / 4), per * (2 * FFN / 4 + H)))


def _step_s(recipe: str, preset: str = "llama3-8b", extra: tuple[str, ...] = ()) -> tuple[float, str]:
    scenario = load_scenario(None, [f"model.preset={preset}", "model.num_layers=4", "cluster.num_nodes=1",
                                    "training.global_batch_size=16", "training.precision=fp8",
                                    f"training.fp8_recipe={recipe}", "strategy.name=nd", "strategy.tp=2",
                                    "strategy.implementation=megatron-core", *extra])
    report = run_choice(scenario, scenario.strategies[0])
    return report["step_time_s"], report["training_resolved"]["fp8_recipe"]


def test_the_recipe_orders_the_step_and_auto_is_the_profile_default() -> None:
    """Fused casts cost nothing, delayed scaling one pass per standalone operand, current
    scaling an amax pass more; ``auto`` under megatron-core is delayed (TransformerConfig's
    default) and training_resolved says so."""
    fused, delayed, tensorwise = (_step_s(r)[0] for r in ("fused", "delayed", "tensorwise"))
    assert fused < delayed < tensorwise
    auto, resolved = _step_s("auto")
    assert resolved == "delayed" and auto == delayed


def test_profiles_carry_their_framework_default() -> None:
    training = Training(precision="fp8")
    from hzpsim.hardware.devices import get_device

    h100 = get_device("h100-sxm")
    for name, recipe in (("megatron-core", "delayed"), ("megatron-bridge", "tensorwise"), ("torchtitan", "fused")):
        assert implementation(name).training_for(training, h100).fp8_recipe == recipe, name
    bf16 = Training(precision="bf16")
    assert implementation("megatron-core").training_for(bf16, h100).fp8_recipe == "auto"  # no fp8: nothing to resolve


def test_the_routed_experts_pay_their_quantisation() -> None:
    """An MoE layer's grouped GEMMs quantise the permuted tokens, the activation's output and
    both output gradients: the experts' memory-bound bytes grow by exactly that."""
    scenario = load_scenario(None, ["model.preset=qwen3-30b-a3b", "model.num_layers=2", "cluster.num_nodes=1",
                                    "training.global_batch_size=64", "training.precision=fp8", "training.activation_recompute=none",
                                    "strategy.name=nd", "strategy.ep=8"])
    dims = ParallelDims(dp=8, ep=8)
    bridge = implementation("megatron-bridge")

    def experts(recipe: str) -> tuple[float, float]:
        training = dataclasses.replace(scenario.training, fp8_recipe=recipe)
        moe = next(u for u in mp_units(scenario.model, training, dims, bridge) if u.is_moe).moe
        return moe.experts.bytes_accessed, moe.experts_backward.bytes_accessed

    base, cs = experts("fused"), experts("tensorwise")
    model = scenario.model
    routed = scenario.training.micro_batch_size * model.seq_len * model.moe.top_k * dims.moe_load  # the busiest rank
    want = fp8_quantize_bytes(model.layer_linears(1)["expert"], routed, 1, False, "tensorwise", False)
    assert cs[0] - base[0] == pytest.approx(want[0])
    assert cs[1] - base[1] == pytest.approx(want[1])


def test_a_stated_recipe_maps_and_an_unstated_one_is_the_profiles() -> None:
    assert map_fp8_recipe("fp8 (current scaling)")[0] == "tensorwise"
    assert map_fp8_recipe("mxfp8")[0] == "mxfp8"
    assert map_fp8_recipe("fp8 (blockwise 128x128 w / 1x128 act)")[0] == "blockwise"
    assert map_fp8_recipe("fp8", "NeMo 24.07 (Megatron-Core)")[0] == "delayed"  # TE 1.x
    assert map_fp8_recipe("fp8 linears")[0] is None
    assert map_fp8_recipe("fp8", "Megatron-Bridge / NeMo 25.11")[0] is None


@pytest.mark.parametrize(("overrides", "needle"), [
    (["training.precision=bf16", "training.fp8_recipe=mxfp8"], "fp8_recipe"),
    (["training.precision=fp8", "training.fp8_recipe=bogus"], "fp8_recipe"),
])
def test_bad_fp8_recipe_exits_2_naming_the_key(overrides: list[str], needle: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", "--set", "model.preset=llama3-8b", "--set", "cluster.num_nodes=1"]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 2
    assert needle in capsys.readouterr().err


def test_a_dense_layer_pays_exactly_its_blocks_quantisation() -> None:
    """A dense layer's forward grows by its two blocks' input quantisation and its backward by
    their output gradients' (no recompute), over the same layer with fused casts."""
    scenario = load_scenario(None, ["model.preset=llama3-8b", "model.num_layers=2", "cluster.num_nodes=1",
                                    "training.global_batch_size=16", "training.precision=fp8",
                                    "training.activation_recompute=none", "strategy.name=nd"])
    dims, core = ParallelDims(dp=8), implementation("megatron-core")

    def layer(recipe: str) -> tuple[float, float]:
        training = dataclasses.replace(scenario.training, fp8_recipe=recipe)
        unit = next(u for u in mp_units(scenario.model, training, dims, core) if u.name == "layer1")
        return unit.pre.bytes_accessed + unit.post.bytes_accessed, unit.backward.bytes_accessed

    tokens = scenario.training.micro_batch_size * scenario.model.seq_len
    linears = scenario.model.layer_linears(1)
    attn = fp8_quantize_bytes(linears["attention"], tokens, 1, False, "delayed", True)
    mlp = fp8_quantize_bytes(linears["mlp"], tokens, 1, False, "delayed", True)
    (f0, b0), (f1, b1) = layer("fused"), layer("delayed")
    assert f1 - f0 == pytest.approx(attn[0] + mlp[0]) and attn[0] > 0
    assert b1 - b0 == pytest.approx(attn[1] + mlp[1])


def test_mxfp8_needs_a_device_that_runs_mx_formats(capsys: pytest.CaptureFixture[str]) -> None:
    """Transformer Engine refuses MXFP8 below compute capability 10.0; so does hzpsim (exit 2
    naming the key), and runs it on a B200."""
    base = ["run", "--set", "model.preset=llama3-8b", "--set", "cluster.num_nodes=1", "--set", "training.precision=fp8",
            "--set", "training.fp8_recipe=mxfp8", "--set", "strategy.name=nd"]
    assert main([*base, "--set", "cluster.preset=dgx-h100"]) == 2
    assert "training.fp8_recipe: mxfp8" in capsys.readouterr().err
    assert main([*base, "--set", "cluster.preset=dgx-b200"]) == 0
