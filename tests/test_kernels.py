"""Kernel shapes on ops and the shape-aware compute model (hzpsim.model.kernels, hardware/compute.py).

The shapes must keep the FLOP totals the model's formulas give (so MFU and HFU do not move),
and the cost model must show what the device's structure implies: wave quantisation over the
SMs, slower small tiles, a power cap lowering the clock, attention by kernel family and head
dimension, and torch.compile fusing pointwise kernels.
"""

from __future__ import annotations

import math

import pytest

from hzpsim.calibration import profile as calibration
from hzpsim.hardware.compute import ComputeModel, efficiency_for
from hzpsim.hardware.devices import DEVICES, get_device
from hzpsim.model import Model
from hzpsim.model.activations import input_gradient_adds
from hzpsim.model.kernels import Attention, Gemm, merged, scaled, total_flops
from hzpsim.model.training import Training
from hzpsim.run import run_choice
from hzpsim.scenario import load_scenario, scenario_from_mapping
from hzpsim.strategies._dims import ParallelDims
from hzpsim.strategies._layers import Work
from hzpsim.strategies._mp_units import mp_units


def test_merging_and_scaling_keep_exact_totals() -> None:
    a, b = Gemm(4096, 1024, 4096), Gemm(4096, 4096, 1024, 2.0)
    att = Attention(32, 4096, 4096, 128, 128, True)
    shapes = (a, b, att, a)
    assert total_flops(merged(shapes)) == pytest.approx(total_flops(shapes), rel=1e-15)
    assert len(merged(shapes)) == 3  # the two equal GEMMs became one with calls=2
    assert total_flops(scaled(shapes, 0.25)) == pytest.approx(total_flops(shapes) / 4, rel=1e-15)
    dgrad, wgrad = a.backward()
    assert dgrad.flops + wgrad.flops == 2 * a.flops
    w = Work.of(shapes, 10.0) + Work.of([att], 5.0)
    assert w.attention_forward == pytest.approx(2 * att.flops) and w.bytes_accessed == 15.0


def _model(**overrides: object) -> Model:
    base: dict[str, object] = dict(name="t", num_layers=2, hidden_size=4096, num_heads=32, ffn_hidden_size=11008,
                                   vocab_size=32000, seq_len=4096, mlp="swiglu", num_kv_heads=8)
    base.update(overrides)
    return Model(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("tp,cp,fused,recompute", [(1, 1, True, "none"), (4, 2, True, "full"), (8, 1, False, "selective"),
                                                    (4, 2, True, "op"), (1, 1, False, "op")])
def test_unit_shapes_give_the_model_formula_flops(tp: int, cp: int, fused: bool, recompute: str) -> None:
    """Per layer: GEMM FLOPs = 2 × active matmul params × local tokens / t, attention FLOPs =
    layer_forward_flops / (t·c); the backward is twice the forward plus the recompute."""
    model = _model()
    training = Training(global_batch_size=64, micro_batch_size=2, flash_attention=fused,
                        activation_recompute=recompute)  # type: ignore[arg-type]
    dims = ParallelDims(tp=tp, cp=cp, dp=1, sequence_parallel=tp > 1)
    unit = mp_units(model, training, dims)[1]
    tokens = 2 * model.seq_len
    ref = model.layer_forward_flops(0, tokens, causal=fused)
    gemm = ref["gemm"] / (tp * cp) + (0.0 if fused else ref["attention"] / (tp * cp))
    attention = ref["attention"] / (tp * cp) if fused else 0.0
    forward = unit.pre + unit.remote + unit.post
    assert forward.gemm == pytest.approx(gemm, rel=1e-12)
    assert forward.attention_forward == pytest.approx(attention, rel=1e-12)
    assert total_flops(forward.shapes) == pytest.approx(gemm + attention, rel=1e-12)
    backward = unit.backward + unit.backward_remote
    extra = {"none": 0.0, "selective": ref["attention"] / (tp * cp), "full": gemm + attention,
             # per-op SAC: the linears it does not save, and unfused attention's score products
             "op": (model.recompute_forward_flops(0, tokens, "op")
                    + (0.0 if fused else ref["attention"])) / (tp * cp)}[recompute]
    assert backward.gemm + backward.attention_forward + backward.attention_backward == pytest.approx(
        2 * (gemm + attention) + extra, rel=1e-12)


@pytest.mark.parametrize("recompute", ["none", "selective", "full", "op"])
@pytest.mark.parametrize("fused_kernels,dropout", [(True, True), (False, False)])
def test_unfused_attention_moves_its_score_kernels_bytes(recompute: str, fused_kernels: bool, dropout: bool) -> None:
    """Unfused attention adds, per head and query-key pair, the bytes of the kernels between
    the score and value GEMMs: Megatron's causal fused softmax reads the lower half of the
    scores and writes the square (1.5·B), its backward reads two lower halves and writes
    the square (2·B); eager mask + softmax 4·B / 5·B; dropout 2·B + 1 each way. The forward
    is charged again wherever the attention core is recomputed (selective's ``core_attn``
    included), and the GEMMs' own operand bytes are not charged twice."""
    tp, b = 2, 2
    model = _model(dropout=dropout)
    base = dict(global_batch_size=64, micro_batch_size=b, activation_recompute=recompute, fused_kernels=fused_kernels)
    dims = ParallelDims(tp=tp, dp=1, sequence_parallel=True)
    flash = mp_units(model, Training(flash_attention=True, **base), dims)[1]  # type: ignore[arg-type]
    plain = mp_units(model, Training(flash_attention=False, **base), dims)[1]  # type: ignore[arg-type]
    pairs = model.num_heads / tp * b * model.seq_len * model.seq_len
    forward, backward = (1.5 * 2, 2.0 * 2) if fused_kernels else (4.0 * 2, 5.0 * 2)
    if dropout:
        forward, backward = forward + 5, backward + 5
    again = {"none": 0.0, "selective": forward, "full": forward, "op": forward}[recompute]
    assert (plain.pre.bytes_accessed - flash.pre.bytes_accessed) == pytest.approx(forward * pairs, rel=1e-12)
    assert plain.post.bytes_accessed == pytest.approx(flash.post.bytes_accessed, rel=1e-12)
    assert (plain.backward.bytes_accessed - flash.backward.bytes_accessed) == pytest.approx(
        (backward + again) * pairs, rel=1e-12)


#: ATen ops that move no data (views, metadata) or only O(1) scalars
_NO_DATA = {"view", "_unsafe_view", "t", "transpose", "expand", "unsqueeze", "squeeze", "slice", "detach",
            "alias", "as_strided", "permute", "select", "split", "chunk", "unbind", "empty", "empty_like",
            "zeros_like", "ones_like", "new_empty_strided", "view_as_complex", "view_as_real", "_conj"}


def _aten_bytes(forward, inputs):
    """HBM bytes the ATen ops of ``forward(*inputs)`` and of its autograd backward read and write,
    each op's tensor operands plus its outputs (an in-place op's output is its written operand),
    views and metadata ops apart: what the same ops move on a GPU, kernel for kernel."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Bytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.total, self.ops = 0, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name not in _NO_DATA:
                tensors = [x for x in tree_leaves((args, kwargs or {}, out)) if isinstance(x, torch.Tensor)]
                self.total += sum(x.numel() * x.element_size() for x in tensors)
                self.ops.append(name)
            return out

    with Bytes() as fwd:
        out = forward(*inputs)
    grad = torch.randn_like(out)
    with Bytes() as bwd:
        out.backward(grad)
    return fwd, bwd


@pytest.mark.parametrize("kernel", ["layernorm", "dropout", "gelu", "swiglu", "residual", "input_grads",
                                    "rope_rotate_half", "rope_complex"])
def test_memory_bound_backward_bytes_are_what_the_aten_ops_move(kernel: str) -> None:
    """Each memory-bound kernel's backward-over-forward bytes (``elementwise_backward_over_forward``,
    ``activation_fn_backward_bytes_per_ffn``, ``input_gradient_adds``) against what the ATen ops
    an eager GPU forward and backward dispatch read and write, measured on CPU with a
    ``TorchDispatchMode`` over many tokens (the O(h) and O(tokens) statistics vanish)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from hzpsim.model.activations import (
        activation_fn_backward_bytes_per_ffn,
        activation_fn_bytes_per_ffn,
        elementwise_backward_over_forward,
        elementwise_bytes_per_token,
        input_gradient_adds,
    )

    torch.manual_seed(0)
    n, h = 4096, 256
    gpt, llama = Model(1, h, 4, 4 * h, 64, 16, mlp="gelu", dropout=True), Model(1, h, 4, 4 * h, 64, 16)
    x = torch.randn(n, h, requires_grad=True)
    B = x.element_size()

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    if kernel == "input_grads":  # separate q, k, v and gate, up linears: their input gradients summed
        w = [torch.randn(h, h) for _ in range(3)]
        adds = []
        for weights, expected in ((w, 2), (w[:1], 0)):
            inner = leaf(n, h)
            fwd, bwd = _aten_bytes(lambda t, ms=weights: sum(((t * 1.0) @ m).sum(-1) for m in ms), (inner,))
            adds.append((bwd.ops.count("add"), expected))
        assert adds[0][0] == adds[0][1] and adds[1][0] == adds[1][1]
        assert input_gradient_adds(llama, 0) == 3 and input_gradient_adds(gpt, 0) == 0
        return
    if kernel.startswith("rope"):  # Q as (batch, seq, heads, head_dim) in bf16; tables 1/128 of it
        from hzpsim.model.activations import rope_bytes_per_element

        bsz, seq, heads, d = 4, 512, 32, 64
        q = torch.randn(bsz, seq, heads, d, dtype=torch.bfloat16, requires_grad=True)
        angle = torch.arange(seq).float()[:, None] * torch.rand(d // 2)[None]
        if kernel == "rope_complex":  # torchtitan's apply_rotary_emb
            freqs = torch.polar(torch.ones_like(angle), angle).view(1, seq, 1, d // 2)

            def rope(x):
                rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs
                return torch.view_as_real(rotated).flatten(3).type_as(x)
        else:  # Hugging Face's apply_rotary_pos_emb
            cos = torch.cat([angle, angle], -1).cos()[None, :, None].bfloat16()
            sin = torch.cat([angle, angle], -1).sin()[None, :, None].bfloat16()

            def rope(x):
                return x * cos + torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1) * sin
        fwd, bwd = _aten_bytes(rope, (q,))
        measured = (fwd.total / q.numel(), bwd.total / q.numel())
        assert measured == pytest.approx(rope_bytes_per_element(kernel[5:], 2, False), rel=0.01)
        assert rope_bytes_per_element(kernel[5:], 2, True) == (4, 4)
        return
    if kernel == "layernorm":
        w, b = leaf(h), leaf(h)
        fwd, bwd = _aten_bytes(lambda t: F.layer_norm(t, (h,), w, b), (x,))
        expected = elementwise_backward_over_forward(gpt, "norms", B)
        assert fwd.ops == ["native_layer_norm"] and "native_layer_norm_backward" in bwd.ops
    elif kernel == "dropout":  # the op GPU's F.dropout dispatches (CPU's own path differs)
        fwd, bwd = _aten_bytes(lambda t: torch.native_dropout(t, 0.1, True)[0], (x,))
        expected = elementwise_backward_over_forward(gpt, "dropouts", B)
        assert bwd.ops == ["native_dropout_backward"]
        # the model's count: 2·B·h + h per dropout (a bool mask), as measured
        per_token = elementwise_bytes_per_token(gpt, 0, B)["dropouts"][0] / 2
        assert fwd.total == pytest.approx(per_token * n, rel=1e-9)
    elif kernel == "gelu":
        fwd, bwd = _aten_bytes(F.gelu, (x,))
        expected = elementwise_backward_over_forward(gpt, "activation_fn", B)
        assert (fwd.total / (n * h * B), bwd.total / (n * h * B)) == (
            activation_fn_bytes_per_ffn(gpt, False), activation_fn_backward_bytes_per_ffn(gpt, False))
    elif kernel == "swiglu":
        gate, up = leaf(n, h), leaf(n, h)
        fwd, bwd = _aten_bytes(lambda g, u: F.silu(g) * u, (gate, up))
        expected = elementwise_backward_over_forward(llama, "activation_fn", B)
        assert (fwd.total / (n * h * B), bwd.total / (n * h * B)) == (
            activation_fn_bytes_per_ffn(llama, False), activation_fn_backward_bytes_per_ffn(llama, False))
    else:  # the residual stream feeds the block and the skip: autograd sums the two gradients
        skip = leaf(n, h)
        fwd, bwd = _aten_bytes(lambda t: t + torch.tanh(t), (skip,))
        tanh = 2 * n * h * B, 3 * n * h * B  # tanh / tanh_backward: the block standing in
        fwd.total, bwd.total = fwd.total - tanh[0], bwd.total - tanh[1]
        assert sorted(bwd.ops) == ["add", "tanh_backward"]
        expected = elementwise_backward_over_forward(gpt, "residual_adds", B)
    assert bwd.total / fwd.total == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("fusion", ["eager", "hand", "compile"])
def test_a_gpt_layers_backward_moves_its_kernels_bytes(fusion: str) -> None:
    """A GPT layer (MHA with fused QKV, GELU 4h, dropout, bf16) with flash attention: eager, its
    memory-bound kernels move 46·h bytes per token forward and 58·h backward (norms 12,
    residual adds 12, dropouts 10, GELU 24), not twice the forward; Megatron's hand-fused
    forward kernels (34·h) leave the backward's as they are; torch.compile fuses the backward's
    too (the residual sum and the dropout into the norm's kernel: 2·h + 2·(2 + 1)·h less)."""
    h, b, s = 256, 2, 64
    model = Model(2, h, 4, 4 * h, 64, s, mlp="gelu", dropout=True, position_embedding="learned", norm="layernorm")
    training = Training(global_batch_size=8, micro_batch_size=b, fused_kernels=fusion == "hand",
                        compile=fusion == "compile")
    layer = mp_units(model, training, ParallelDims())[1]
    per_token = {"eager": (46, 58), "hand": (34, 58), "compile": (34, 58 - 8 - 2 * 2)}[fusion]
    tokens = b * s
    assert (layer.pre.bytes_accessed + layer.post.bytes_accessed) == pytest.approx(per_token[0] * h * tokens)
    assert layer.backward.bytes_accessed == pytest.approx(per_token[1] * h * tokens)


def test_input_gradient_adds_run_on_the_whole_sequence_under_sequence_parallelism(monkeypatch) -> None:
    """An eager Llama layer (separate q, k, v and gate, up projections: 3 adds) under TP 4 with
    sequence parallelism: the other memory-bound kernels of its backward run on the rank's
    quarter of the sequence, but the projections read the all-gathered input (torchtitan's
    PrepareModuleInput: Shard(1) -> Replicate()), so autograd sums their input gradients on
    every token: 3 adds x 3·B·h per token of the micro-batch, not of the shard."""
    import hzpsim.strategies._mp_units as units
    from hzpsim.strategies._implementations import get as get_implementation

    torchtitan = get_implementation("torchtitan")
    model = _model()
    h, b, act = model.hidden_size, 1, 2
    training = Training(global_batch_size=8, micro_batch_size=b)
    assert input_gradient_adds(model, 0) == 3
    for dims in (ParallelDims(tp=1, dp=1), ParallelDims(tp=4, dp=1, sequence_parallel=True)):
        with_adds = mp_units(model, training, dims, torchtitan)[1].backward.bytes_accessed
        with monkeypatch.context() as patch:
            patch.setattr(units, "input_gradient_adds", lambda model, i: 0)
            without = mp_units(model, training, dims, torchtitan)[1].backward.bytes_accessed
        assert with_adds - without == pytest.approx(3 * 3 * act * h * b * model.seq_len)


def test_eager_rope_is_charged_as_the_profiles_model_code_writes_it() -> None:
    """torchtitan's complex-product RoPE and Hugging Face's rotate_half move the same forward
    bytes in bf16 (10·B per rotated element) and 10·B against 14·B backward; a fused kernel
    (compile, Megatron's fused RoPE) moves 2·B each way: the layer's bytes differ by exactly
    that, over Q's and K's elements."""
    import dataclasses

    from hzpsim.strategies._implementations import get as get_implementation

    model = _model()
    d, b = model.head_dim_resolved, 1
    elements = b * model.seq_len * (model.num_heads + model.kv_heads) * d
    complex_ = get_implementation("torchtitan")
    assert complex_.rope_form == "complex" and get_implementation("reference").rope_form == "rotate_half"
    rotate_half = dataclasses.replace(complex_, rope_form="rotate_half")
    dims = ParallelDims(tp=1, dp=1)
    layers = {}
    for name, impl in (("complex", complex_), ("rotate_half", rotate_half)):
        for compiled in (False, True):
            training = Training(global_batch_size=8, micro_batch_size=b, compile=compiled)
            layer = mp_units(model, training, dims, impl)[1]
            layers[name, compiled] = (layer.pre.bytes_accessed + layer.post.bytes_accessed, layer.backward.bytes_accessed)
    assert layers["complex", True] == layers["rotate_half", True]
    assert layers["rotate_half", False][0] == pytest.approx(layers["complex", False][0])
    assert layers["rotate_half", False][1] - layers["complex", False][1] == pytest.approx(4 * 2 * elements)


def test_per_op_checkpointing_follows_torchtitans_policy() -> None:
    """torchtitan's per-op SAC saves every mm output but every second one (Llama: wk, wo and w3
    run again), saves nothing of float8's _scaled_mm, keeps the reduce-scatters' outputs and
    re-issues the sequence-parallel all-gathers; it keeps less than no recompute and more
    than full recompute."""
    model = _model()
    h, kv, f = 4096, 8 * 128, 11008
    redo = model.op_sac_recomputed_linears(0)
    assert redo["attention"] == [(h, kv, "column"), (h, h, "row")] and redo["mlp"] == [(h, f, "column")]
    float8 = model.op_sac_recomputed_linears(0, float8=True)
    assert float8["attention"] == model.layer_linears(0)["attention"] and float8["mlp"] == model.layer_linears(0)["mlp"]
    tokens = 8192
    assert model.recompute_forward_flops(0, tokens, "op") == 2 * tokens * (h * kv + h * h + h * f)
    kept = {mode: model.activation_bytes_per_layer(0, 2, tp=8, sequence_parallel=True, recompute=mode)
            for mode in ("none", "op", "full")}
    assert kept["full"] < kept["op"] < kept["none"]
    assert model.activation_bytes_per_layer(0, 2, recompute="op", float8=True) < model.activation_bytes_per_layer(
        0, 2, recompute="op")
    dims = ParallelDims(tp=8, dp=1, sequence_parallel=True)
    layer = {mode: mp_units(model, Training(activation_recompute=mode), dims)[1] for mode in ("none", "op", "full")}  # type: ignore[arg-type]
    assert (layer["op"].tp_gathers_backward, layer["op"].tp_scatters_backward) == (4, 2)
    assert (layer["full"].tp_gathers_backward, layer["full"].tp_scatters_backward) == (4, 4)
    assert (layer["none"].tp_gathers_backward, layer["none"].tp_scatters_backward) == (2, 2)
    # every memory-bound kernel runs again: its forward's bytes before its backward's
    forward = layer["none"].pre.bytes_accessed + layer["none"].post.bytes_accessed
    assert layer["op"].backward.bytes_accessed == pytest.approx(layer["none"].backward.bytes_accessed + forward)


def test_moe_and_mla_layers_keep_their_flops() -> None:
    scenario = load_scenario(None, ["model.preset=deepseek-v3", "model.num_layers=4", "model.seq_len=4096",
                                    "cluster.num_nodes=8", "training.global_batch_size=64",
                                    "strategy.name=nd", "strategy.tp=2", "strategy.pp=1", "strategy.ep=8",
                                    "strategy.sequence_parallel=true"])
    model = scenario.model
    training = scenario.training
    dims = ParallelDims(tp=2, dp=32, ep=8, sequence_parallel=True)
    for i, unit in enumerate(mp_units(model, training, dims)[1:-1]):
        tokens = training.micro_batch_size * model.seq_len
        ref = model.layer_forward_flops(i, tokens)
        forward = unit.pre + unit.post
        assert forward.attention_forward == pytest.approx(ref["attention"] / 2, rel=1e-12)
        if not model.is_moe_layer(i):
            assert forward.gemm == pytest.approx(ref["gemm"] / 2, rel=1e-12)


def _a100() -> ComputeModel:
    return ComputeModel(get_device("a100-80gb"), "bf16")


def test_large_square_gemm_runs_at_the_sm_efficiency() -> None:
    """A GEMM of many waves sustains the fitted per-SM rate: the MAMF measurement it comes from."""
    cm = _a100()
    m = n = k = 8192
    achieved = 2.0 * m * n * k / cm.gemm_s(m, n, k) / get_device("a100-80gb").peak_bf16_flops_per_s
    assert achieved == pytest.approx(efficiency_for(get_device("a100-80gb")).gemm, rel=0.03)


def test_wave_quantisation_one_tile_too_many_costs_a_wave() -> None:
    """108 SMs: 108 tiles of 256×128 fill one wave; 109 need a second wave (or smaller,
    slower tiles), so the time per FLOP jumps (NVIDIA matmul guide, wave quantisation)."""
    cm = _a100()
    k = 8192
    full = cm.gemm_s(256 * 108, 128, k) / (256 * 108)
    over = cm.gemm_s(256 * 109, 128, k) / (256 * 109)
    assert over > 1.15 * full


def test_short_k_gemms_pay_the_tile_prologue_and_epilogue() -> None:
    """On Hopper a tile's fixed cost is worth 384 of K (measured, compute.py): a K = 512 GEMM
    takes (512 + 384) / 512 of its main loop, a K = 8,192 one (8,192 + 384) / 8,192; a device
    file without the measurement (A100) charges none."""
    h100 = ComputeModel(get_device("h100-sxm"), "bf16")
    assert h100.tile_overhead_k == 384.0
    m, n = 8192, 4096  # 128 tiles of 256x128 on 132 SMs: one wave whatever K
    per_k = {k: h100.gemm_s(m, n, k) / k for k in (512, 8192)}
    assert per_k[512] / per_k[8192] == pytest.approx((512 + 384) / 512 / ((8192 + 384) / 8192), rel=1e-6)
    bare = ComputeModel(get_device("h100-sxm"), "bf16", tile_overhead_k=0.0)
    assert h100.gemm_s(m, n, 512) / bare.gemm_s(m, n, 512) == pytest.approx(896 / 512, rel=1e-6)
    assert _a100().tile_overhead_k == 0.0


def test_skinny_gemm_runs_far_below_peak_and_never_beats_memory() -> None:
    """A router-like GEMM (N = 8 experts) reads the whole activation for few FLOPs: at best
    its HBM traffic, and far below the tensor peak (the 64-wide tiles are mostly padding)."""
    cm = _a100()
    m, n, k = 16384, 8, 4096
    memory_s = (m * k + k * n + m * n) * 2 / (get_device("a100-80gb").memory_bytes_per_s * cm.efficiency.hbm)
    seconds = cm.gemm_s(m, n, k)
    assert memory_s <= seconds < 2 * memory_s
    assert 2.0 * m * n * k / seconds < 0.05 * get_device("a100-80gb").peak_bf16_flops_per_s


def test_power_cap_slows_compute_by_the_cube_root() -> None:
    device = get_device("h100-sxm")
    from dataclasses import replace
    capped = replace(device, power_limit_w=500.0)
    full, slow = ComputeModel(device, "bf16"), ComputeModel(capped, "bf16")
    ratio = slow.gemm_s(8192, 8192, 8192) / full.gemm_s(8192, 8192, 8192)
    assert ratio == pytest.approx((700 / 500) ** (1 / 3), rel=1e-6)


def test_attention_by_family_and_head_dim() -> None:
    cm = ComputeModel(get_device("h100-sxm"), "bf16")

    def tflops(kernel: str, d: int) -> float:
        a = Attention(64, 8192, 8192, d, d, True, kernel)
        return a.flops / cm.attention_s(a) / 1e12

    fraction = calibration.active()["attention_kernel_fraction"]
    for family in ("flash2", "flash3", "cudnn"):
        assert tflops(family, 64) < tflops(family, 128)
    assert tflops("flash3", 128) > tflops("cudnn", 128) > tflops("flash2", 128)
    # the FA3 paper's FA2 figure at 8k keys, head dim 128: 370 TFLOP/s (times the fitted
    # fraction), less the causal mask's diagonal tiles (measured, CAUSAL_EXTRA_KEYS)
    assert tflops("flash2", 128) == pytest.approx(370 * fraction * 8192 / 8292 * 8192 / (8192 + 616), rel=1e-6)
    assert tflops("auto", 128) == tflops("flash2", 128)
    for device in DEVICES.values():  # every kernel a device offers has a measured speed there
        rates = {k for k, _, _ in device.efficiency.attention_rates}
        assert not rates or set(device.attention_kernels) == rates, device.name


def test_attention_backward_runs_the_kernels_own_work_and_the_mask_costs_its_diagonal() -> None:
    """The backward kernel executes 2.5x the forward's FLOPs (the recomputed scores) at 0.863 of
    its speed: 2.90x the forward's time, as measured on an H100 (2.47-3.37); the model's FLOP
    count stays 2x (MFU does not move). A causal kernel is slower per useful FLOP than a full
    one, the more so the shorter the sequence."""
    cm = ComputeModel(get_device("h100-sxm"), "bf16")
    fwd = Attention(32, 4096, 4096, 128, 128, True, "flash2")
    bwd = fwd._replace(backward=True)
    assert bwd.flops == 2 * fwd.flops and bwd.kernel_flops == 2.5 * fwd.flops
    assert cm.attention_s(bwd) / cm.attention_s(fwd) == pytest.approx(2.5 / (0.63 / 0.73), rel=1e-9)

    def causal_over_full(s: int) -> float:  # time of the causal kernel over half the full one's
        a = Attention(32, s, s, 128, 128, True, "flash2")
        return cm.attention_s(a) / (cm.attention_s(a._replace(causal=False)) / 2)

    assert causal_over_full(2048) == pytest.approx((2048 + 616) / 2048, rel=1e-9)
    assert causal_over_full(2048) > causal_over_full(16384) > 1


def _run(overrides: list[str]) -> dict:
    scenario = load_scenario(None, ["model.preset=llama3-8b", "cluster.num_nodes=1", "training.global_batch_size=16",
                                    "training.micro_batch_size=2", "strategy.name=zero", "strategy.stage=3",
                                    "model.seq_len=4096", *overrides])
    return run_choice(scenario, scenario.strategies[0])


@pytest.mark.slow
def test_compile_fuses_pointwise_kernels_and_is_faster() -> None:
    eager, compiled = _run([]), _run(["training.compile=true"])
    assert compiled["step_time_s"] < eager["step_time_s"]
    assert compiled["mfu"] > eager["mfu"]
    # Megatron / Transformer Engine model code fuses the same forward kernels by hand, but its
    # backward kernels stay apart where Inductor fuses them too (elementwise_backward_over_forward)
    hand = _run(["training.fused_kernels=true"])
    assert compiled["step_time_s"] < hand["step_time_s"] < eager["step_time_s"]


def test_power_limit_is_a_cluster_field_and_checked() -> None:
    base = {"model": {"preset": "llama3-8b"}, "training": {"global_batch_size": 16},
            "strategy": {"name": "zero", "stage": 3}}
    capped = scenario_from_mapping({**base, "cluster": {"device": "h100-sxm", "device_power_limit_w": 500}})
    assert capped.topology.device.sustained_clock_fraction == pytest.approx((500 / 700) ** (1 / 3))
    from hzpsim.config import ScenarioError
    with pytest.raises(ScenarioError, match="device_power_limit_w"):
        scenario_from_mapping({**base, "cluster": {"device": "h100-sxm", "device_power_limit_w": -5}})
    with pytest.raises(ScenarioError, match="device_power_limit_w"):
        scenario_from_mapping({**base, "cluster": {"device": "cpu-local", "device_power_limit_w": 100}})
    with pytest.raises(ScenarioError, match="training.attention_kernel"):
        scenario_from_mapping({**base, "cluster": {"device": "a100-80gb"},
                               "training": {"global_batch_size": 16, "attention_kernel": "flash3"}})
    with pytest.raises(ScenarioError, match="attention_kernel"):
        scenario_from_mapping({**base, "cluster": {"device": "h100-sxm"},
                               "training": {"global_batch_size": 16, "flash_attention": False,
                                            "attention_kernel": "cudnn"}})
    assert not math.isnan(capped.topology.device.peak_bf16_flops_per_s)


def test_batched_gemm_tiles_share_the_waves() -> None:
    """cuBLAS's strided-batched and grouped kernels (unfused attention's products, an MoE
    layer's experts) spread all the batch's tiles over the SMs: 64 expert GEMMs of
    2048×2048×4096 in one kernel waste far less to wave quantisation than 64 kernels of 128
    tiles each on 108 SMs."""
    cm = _a100()
    one_kernel = cm.gemm_s(2048, 2048, 4096, batch=64)
    separate = 64 * cm.gemm_s(2048, 2048, 4096)
    assert one_kernel < 0.8 * separate
    ideal = 64 * 2.0 * 2048 * 2048 * 4096 / (get_device("a100-80gb").peak_bf16_flops_per_s * cm.efficiency.gemm)
    assert ideal <= one_kernel < 1.05 * ideal  # 8,192 tiles: 76 waves, nearly full
    assert Gemm(2048, 2048, 96, 1.0, 384).flops == 384 * Gemm(2048, 2048, 96).flops


def test_a_weight_gradient_accumulated_into_fp32_pays_its_traffic() -> None:
    """Megatron's gradient-accumulation fusion adds each weight gradient into the fp32
    main_grad inside the GEMM (C read and written at 4 bytes): a short-K weight gradient (an
    expert of a fine-grained MoE, 256 tokens) then runs at that traffic, not at its tiles'
    pace; a long-K one (a dense layer's 8,192 tokens) stays compute-bound and as fast."""
    cm = ComputeModel(get_device("h100-sxm"), "bf16")
    hbm = get_device("h100-sxm").memory_bytes_per_s * cm.efficiency.hbm
    data, weight = Gemm(256, 4096, 1536).backward(accumulate=True)
    assert not data.accumulate and weight.accumulate and weight.k == 256
    assert Gemm(256, 4096, 1536).backward()[1].accumulate is False
    m, n, k = weight.m, weight.n, weight.k
    fp32 = ((m * k + k * n) * 2 + m * n * 8) / hbm
    assert cm.gemm_s(m, n, k, accumulate=True) == pytest.approx(fp32, rel=1e-12)
    assert cm.gemm_s(m, n, k) < 0.8 * fp32
    long_k = Gemm(8192, 4096, 1536).backward(accumulate=True)[1]
    assert cm.gemm_s(long_k.m, long_k.n, long_k.k, accumulate=True) == cm.gemm_s(long_k.m, long_k.n, long_k.k)


def test_megatron_profiles_accumulate_weight_gradients_in_the_gemm() -> None:
    """The implementation profile decides (``wgrad_accumulation_fusion``): Megatron-Core and
    Megatron-Bridge accumulate every linear's and expert's weight gradient into fp32 in the
    GEMM, the unfused attention's score products (activations, not weights) never; FSDP2 not."""
    from hzpsim.strategies._implementations import get as implementation

    scenario = load_scenario(None, ["model.preset=qwen3-30b-a3b", "model.num_layers=2", "cluster.num_nodes=1",
                                    "training.global_batch_size=64", "training.flash_attention=false",
                                    "strategy.name=nd", "strategy.ep=8"])
    dims = ParallelDims(dp=8, ep=8)
    for name, fused in (("megatron-core", True), ("megatron-bridge", True), ("fsdp2", False)):
        units = mp_units(scenario.model, scenario.training, dims, implementation(name))
        moe = next(u for u in units if u.is_moe)
        # each expert GEMM's backward: its data gradient, then its weight gradient
        assert {g.accumulate for g in moe.moe.experts_backward.shapes[1::2]} == {fused}, name
        assert not any(g.accumulate for g in moe.moe.experts_backward.shapes[0::2]), name
        linears = [g for g in moe.backward.shapes if isinstance(g, Gemm) and g.batch == 1]
        scores = [g for g in moe.backward.shapes if isinstance(g, Gemm) and g.batch > 1]
        assert scores and not any(g.accumulate for g in scores), name
        assert any(g.accumulate for g in linears) == fused, name
        assert units[-1].backward.shapes[1].accumulate == fused, name  # the head's weight gradient
