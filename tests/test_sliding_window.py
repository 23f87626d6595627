"""Sliding-window attention (``model.sliding_window``, ``model.full_attention_interval``):
which layers are windowed, the band's FLOPs and kernel time, the flash kernel's work in the
simulated step (the unfused path scores every pair), the PaLM model FLOPs, Hugging Face's
window keys, and what is refused (context parallelism, packed documents, the executor).

    python -m pytest tests/test_sliding_window.py -q
"""

from __future__ import annotations

import json

import pytest
from scenario_helpers import base, error_of

from hzpsim.config import ScenarioError
from hzpsim.hardware.compute import ComputeModel
from hzpsim.hardware.devices import get_device
from hzpsim.model import Model
from hzpsim.model.hf_config import _Fields, _windows
from hzpsim.model.kernels import Attention
from hzpsim.model.training import Training
from hzpsim.run import run_choice
from hzpsim.scenario import scenario_from_mapping
from hzpsim.strategies._dims import ParallelDims
from hzpsim.strategies._mp_units import mp_units


def _model(**changes: object) -> Model:
    fields: dict[str, object] = dict(name="w", num_layers=4, hidden_size=1024, num_heads=16, ffn_hidden_size=4096,
                                     vocab_size=1000, seq_len=4096, dropout=False)
    fields.update(changes)
    return Model(**fields)  # type: ignore[arg-type]


def test_which_layers_are_windowed() -> None:
    alternating = _model(sliding_window=128, full_attention_interval=2)
    assert [alternating.attention_window(i) for i in range(4)] == [128, None, 128, None]
    assert [_model(sliding_window=128).attention_window(i) for i in range(4)] == [128] * 4
    # a window as long as the sequence masks nothing
    assert not _model(sliding_window=4096).windowed and _model(sliding_window=4095).windowed
    assert alternating.layer_kind(0) != alternating.layer_kind(1) == _model().layer_kind(1)


def test_the_band_holds_the_pairs_each_query_sees() -> None:
    s, w = 4096, 128
    model = _model(sliding_window=w)
    # each query i (1-based) attends over min(i, w) keys: w(w+1)/2 + (s - w)·w pairs, against s²/2
    # causal in hzpsim's count (the diagonal's half-pairs dropped alike)
    exact = (w * (w + 1) / 2 + (s - w) * w) / s
    assert model.attention_pairs_per_token(0) == pytest.approx(exact, rel=1e-3)
    assert _model().attention_pairs_per_token(0) == s / 2
    assert model.attention_pairs_per_token(0, causal=False) == w
    band = Attention(16, s, s, 64, 64, True, window=float(w))
    full = Attention(16, s, s, 64, 64, True)
    assert band.flops / full.flops == pytest.approx(model.attention_pairs_per_token(0) / (s / 2))
    assert model.layer_forward_flops(0, s)["attention"] == pytest.approx(band.flops)
    # PaLM's model FLOPs (non-causal): a windowed layer's queries see w keys each
    palm = _model(sliding_window=w, full_attention_interval=2).model_flops_per_token() - _model().model_flops_per_token()
    assert palm == pytest.approx(-3 * 2 * 16 * (64 + 64) * 2 * (s - w))


def test_a_band_runs_slower_per_flop_than_full_causal_attention_and_takes_less_time() -> None:
    compute = ComputeModel(get_device("h100-sxm"), "bf16")
    full = Attention(32, 4096, 4096, 128, 128, True)
    for w in (128, 1024):
        band = full._replace(window=float(w))
        rate_band, rate_full = band.kernel_flops / compute.attention_s(band), full.kernel_flops / compute.attention_s(full)
        assert rate_band < rate_full
        assert compute.attention_s(band) < compute.attention_s(full)
    # the band crosses ceil(w / 128) + 1 key blocks and masks the parts of both edge blocks
    # outside it: against an unmasked kernel over w keys, half the speed at w = 128, 97 % at 4,096
    for w, kept in ((128, 0.5), (1000, 1000 / (128 * 9)), (4000, 4000 / (128 * 33))):
        band = Attention(32, 8192, 8192, 128, 128, True, window=float(w))
        open_rows = Attention(32, 8192, w, 128, 128, False)
        rate = band.kernel_flops / compute.attention_s(band)
        assert rate / (open_rows.kernel_flops / compute.attention_s(open_rows)) == pytest.approx(kept)


def test_only_a_flash_kernel_skips_what_the_window_masks() -> None:
    dims = ParallelDims(tp=1, dp=1)
    for flash, changes in ((True, 1), (False, 0)):
        training = Training(global_batch_size=8, micro_batch_size=1, flash_attention=flash)
        full = mp_units(_model(), training, dims)[1:-1]
        windowed = mp_units(_model(sliding_window=128, full_attention_interval=2), training, dims)[1:-1]
        moved = [w.pre.attention_forward != f.pre.attention_forward or w.backward.attention_backward != f.backward.attention_backward
                 for w, f in zip(windowed, full)]
        assert moved == [bool(changes), False, bool(changes), False]
        if flash:
            assert windowed[0].pre.attention_forward < full[0].pre.attention_forward


def test_a_windowed_model_steps_faster_and_reports_its_windowed_flops() -> None:
    runs = {}
    for window in (None, 128):
        model = {"preset": "llama3-8b", "seq_len": 8192, **({"sliding_window": window} if window else {})}
        scenario = scenario_from_mapping(base(model=model))
        runs[window] = run_choice(scenario, scenario.strategies[0])
    assert runs[128]["step_time_s"] < runs[None]["step_time_s"]
    # MFU on the model FLOPs the windowed layers need: fewer of them per token
    assert runs[128]["tflops_per_device"] < runs[None]["tflops_per_device"] * runs[None]["step_time_s"] / runs[128]["step_time_s"]


def test_hugging_faces_window_keys() -> None:
    def windows(data: dict, layers: int = 6) -> dict:
        return _windows(_Fields(data, "config.json"), layers)

    assert windows({"sliding_window": 4096}) == {"sliding_window": 4096}  # Mistral-7B v0.1: every layer
    assert windows({"sliding_window": None}) == {}  # Mixtral, Llama
    assert windows({"sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28}) == {}
    assert windows({"sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 3}) == {
        "sliding_window": 128, "full_attention_interval": 2}  # gpt-oss
    assert windows({"sliding_window": 512, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}) == {
        "sliding_window": 512, "full_attention_interval": 6}  # Gemma 3's 5:1
    for data, key in (({"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 3}, "max_window_layers"),
                      ({"sliding_window": 128, "layer_types": ["full_attention"] + ["sliding_attention"] * 5}, "layer_types"),
                      ({"sliding_window": 128, "layer_types": ["sliding_attention"] * 5}, "layer_types"),
                      ({"sliding_window": "wide"}, "sliding_window")):
        with pytest.raises(ScenarioError, match=key):
            windows(data)


def test_the_gpt_oss_presets_window_every_other_layer() -> None:
    from hzpsim.report import format_summary

    scenario = scenario_from_mapping(base(model="gpt-oss-120b"))
    assert [scenario.model.attention_window(i) for i in range(4)] == [128, None, 128, None]
    assert "seq 4096, window 128 on 18 of 36 layers" in format_summary(scenario)
    assert "window" not in format_summary(scenario_from_mapping(base(model="mixtral-8x7b")))


@pytest.mark.parametrize("overrides,key", [
    (["model.sliding_window=0"], "model.sliding_window"),
    (["model.full_attention_interval=-1", "model.sliding_window=128"], "model.full_attention_interval"),
    (["model.full_attention_interval=2"], "model.full_attention_interval"),
    (["model.sliding_window=64", "strategy={name: nd, tp: 1, pp: 1, cp: 2}"], "strategy.cp: context parallelism with sliding-window"),
    (["model.sliding_window=64", "training.sequence_lengths.distribution=lognormal",
      "training.sequence_lengths.mean_tokens=64"], "training.sequence_lengths: packed"),
])
def test_what_is_not_modelled_exits_naming_the_key(overrides, key) -> None:
    message = error_of(base(), *overrides)
    assert key in message, message


def test_the_executor_refuses_a_windowed_model() -> None:
    from hzpsim.executor.spec import run_specs

    mapping = base(model={"preset": "tiny-dense", "sliding_window": 8, "dropout": False},
                   training={"global_batch_size": 8, "precision": "fp32", "grad_dtype": "fp32"})
    scenario = scenario_from_mapping(mapping)
    assert scenario.model.windowed
    with pytest.raises(ScenarioError, match="model.sliding_window"):
        run_specs(scenario, 2)
    mapping["model"] = {"preset": "tiny-dense", "dropout": False}
    assert run_specs(scenario_from_mapping(mapping), 2)  # the same run without the window is accepted
    assert json.dumps(scenario.model.summary())
