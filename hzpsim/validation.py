"""Predicted vs measured throughput of published large training runs (DESIGN §6).

``hzpsim/data/published_calibration.csv`` lists 192 measured runs (Megatron-LM, NeMo,
LLM-Foundry, torchtitan, DeepSpeed, ...) with their model, cluster and parallel layout. This
module turns every row into a scenario mapping (or says why it cannot), simulates the ones that
run today and tabulates the signed error. It never tunes anything: a disagreement is a finding,
written up in ``docs/validation.md``.

    from hzpsim.validation import rows_to_scenarios, validate_published, format_validation
    cases = rows_to_scenarios()                       # the packaged CSV
    df = validate_published(select_cases(cases, families=["fsdp", "zero2", "zero3"]))
    print(format_validation(df))

    python -m hzpsim.validation --family fsdp --max-devices 64

Comparison basis. Tokens/s per GPU (equivalently the step time) is convention-free and is the
headline metric. The CSV's MFU / TFLOP/s columns use each source's own FLOP convention (SC'21
and the DeepSpeed-Azure post count full-recompute "hardware" FLOPs, LLM-Foundry counts
6·N_all-params + 12·l·h·s, NVIDIA "model flops" ...), so they are never compared directly
with hzpsim's PaLM MFU. Instead the measured tokens/s is converted to an MFU on DESIGN's PaLM
basis (``meas_mfu_palm``); where a source gives only TFLOP/s *and* its notes give the formula
(SC'21's 96·B·s·l·h²(1 + s/6h + V/16lh) per iteration), the step time is recovered exactly from
it. Rows with nothing but an MFU/TFLOP/s of another or unstated convention are compared on that
number only as a flagged, approximate side column and are left out of the headline statistics.

Every mapping rule is documented next to the code that applies it and in docs/validation.md.
"""

from __future__ import annotations

import argparse
import json as _json
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from hzpsim import strategies
from hzpsim.cluster.devices import get_device
from hzpsim.cluster.topology import preset_spec
from hzpsim.config import ScenarioError, from_mapping
from hzpsim.model import Model

DEFAULT_CSV = Path(__file__).resolve().parent / "data" / "published_calibration.csv"

# ------------------------------------------------------------------------------------- Case


@dataclass(frozen=True)
class Case:
    """One CSV row: the scenario it maps to, or why it cannot be simulated yet.

    ``measured`` holds ``tokens_per_s_per_gpu``, ``step_time_s``, ``tflops_per_gpu``, ``mfu``
    (as the source reports them; None when absent), ``hfu_reported`` (parsed from the notes),
    ``tflops_convention`` (how the source counts FLOPs), ``basis`` ("throughput": a
    convention-free number exists, "reported_only": only an MFU/TFLOP/s of another convention,
    "none") and ``derived`` ({metric: how it was derived} for every value not given directly).
    """

    source_id: str
    row_index: int
    label: str
    scenario_mapping: dict[str, Any] | None
    skip_reason: str | None
    measured: dict[str, Any]
    family: str = ""  # the CSV's strategy_family
    system: str = ""
    n_gpus: int | None = None
    assumptions: tuple[str, ...] = ()  # defaults / imputations applied to blank columns
    caveats: tuple[str, ...] = ()  # what the simulator does not model about this run

    @property
    def strategy_name(self) -> str | None:
        if self.scenario_mapping is None:
            return None
        return self.scenario_mapping["strategy"]["name"]

    @property
    def runnable(self) -> bool:
        return self.scenario_mapping is not None and self.skip_reason is None


class _Skip(Exception):
    """A row cannot be mapped; the message names the column."""


# --------------------------------------------------------------------------- cell helpers


def _blank(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and not v.strip())


def _num(row: dict[str, Any], col: str) -> float | None:
    v = row.get(col)
    if _blank(v):
        return None
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _int(row: dict[str, Any], col: str, default: int | None = None) -> int | None:
    v = _num(row, col)
    if v is None:
        return default
    if v != int(v):
        raise _Skip(f"{col}: {v} is not a whole number")
    return int(v)


def _need_int(row: dict[str, Any], col: str, why: str = "not given") -> int:
    v = _int(row, col)
    if v is None:
        raise _Skip(f"{col}: {why}")
    return v


def _text(row: dict[str, Any], col: str) -> str:
    v = row.get(col)
    return "" if _blank(v) else str(v).strip()


# ------------------------------------------------------------------------- mapping rules

# Device from the `gpu` column (first match wins). Rule: the catalog entry of the same chip;
# memory variants the catalog lacks map to the nearest entry and are recorded as a caveat.
_GPU_RULES: tuple[tuple[str, str], ...] = (
    ("mi250x", "mi250x"),  # "MI250X (per GCD)": one device = one GCD, as the catalog
    ("v100", "v100"),  # V100 / V100-32GB (DGX-2)
    ("h200", "h200"),
    ("h100", "h100-sxm"),  # H100-SXM-80GB, H100-80GB (LLM-Foundry, assumed SXM), H100-96GB Grand Teton
    ("40gb", "a100-40gb"),
    ("p4d", "a100-40gb"),  # AWS p4d.24xlarge = 8x A100 40GB (p4de is the 80GB one)
    ("a100", "a100-80gb"),  # A100-80GB, A100-SXM4-80GB, NDm A100 v4
)


def map_device(gpu: str) -> tuple[str, list[str]]:
    g = gpu.lower()
    caveats: list[str] = []
    for key, name in _GPU_RULES:
        if key in g:
            if "96gb" in g:
                caveats.append(
                    "H100 96GB HBM2e @500W (Grand Teton) simulated as h100-sxm with 96 GB "
                    "(cluster.device_memory_bytes) but the 700 W SXM peak and HBM3 bandwidth "
                    "(throughput optimistic): the 500 W figures are not published"
                )
            return name, caveats
    raise _Skip(f"gpu: unknown device {gpu!r}")


def map_precision(text: str, device: str) -> tuple[str, list[str]]:
    """fp8* -> fp8, fp16* -> fp16, bf16* -> bf16. 'mixed (fp16/bf16 not stated)' and blank ->
    bf16 (fp16 on V100, which has no bf16 tensor cores): fp16 and bf16 have the same dense peak
    on every other catalog device, so the choice does not change a prediction."""
    t = text.lower()
    for p in ("fp8", "fp16", "bf16"):
        if t.startswith(p):
            return p, []
    fallback = "fp16" if device == "v100" else "bf16"
    what = f"precision {text!r}" if t else "precision blank"
    return fallback, [f"{what} -> {fallback} (same peak as the alternative on this device)"]


def map_recompute(text: str) -> tuple[str, list[str]]:
    """full* -> full, selective* -> selective, none -> none; blank -> none, the default of
    Megatron-LM, NeMo, torchtitan and DeepSpeed when no checkpointing flag is given. MFU on the
    PaLM basis does not depend on it; predicted time does."""
    t = text.lower()
    for mode in ("full", "selective", "none"):
        if t.startswith(mode):
            notes = []
            if "per-op sac" in t or "toml" in t:
                notes.append(
                    f"act_recompute {text!r}: torchtitan selective AC (saves matmul outputs, "
                    "recomputes the rest) simulated as Korthikanti-selective (attention core)"
                )
            return mode, notes
    return "none", ["act_recompute blank -> none (framework default without a checkpointing flag)"]


# Architecture conventions per model family (documented in docs/validation.md §2).
_FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    # Megatron-LM / Megatron-DeepSpeed / NeMo GPT (GPT-2/3 style): LayerNorm with bias, biased
    # linears, learned positions, GELU 4h, LM head tied to the embedding, dropout 0.1.
    "gpt": dict(mlp="gelu", tied_embeddings=True, linear_bias=True, norm="layernorm", norm_bias=True,
                position_embedding="learned", dropout=True),
    # MPT (llm-foundry yamls): no biases anywhere, ALiBi, GELU 4h, tied head, pdrop 0.
    "mpt": dict(mlp="gelu", tied_embeddings=True, linear_bias=False, norm="layernorm", norm_bias=False,
                position_embedding="alibi", dropout=False),
    # OPT (metaseq): ReLU 4h (2 matrices -> gelu), learned positions, biases, tied head, dropout 0.1.
    "opt": dict(mlp="gelu", tied_embeddings=True, linear_bias=True, norm="layernorm", norm_bias=True,
                position_embedding="learned", dropout=True),
    # BLOOM: GELU 4h, ALiBi, biases, tied head, no dropout (the extra embedding LayerNorm, 2h
    # parameters, is not modelled).
    "bloom": dict(mlp="gelu", tied_embeddings=True, linear_bias=True, norm="layernorm", norm_bias=True,
                  position_embedding="alibi", dropout=False),
    # Llama 2/3/3.1: SwiGLU, RoPE, RMSNorm, no biases, untied head, no dropout, GQA.
    "llama": dict(mlp="swiglu", tied_embeddings=False, linear_bias=False, norm="rmsnorm",
                  position_embedding="rope", dropout=False),
    # Nemotron-4: squared-ReLU MLP with 2 matrices (-> gelu: same GEMMs; the activation
    # function itself is not a cost we model), RoPE, LayerNorm without bias, untied, GQA.
    "nemotron": dict(mlp="gelu", tied_embeddings=False, linear_bias=False, norm="layernorm",
                     norm_bias=False, position_embedding="rope", dropout=False),
    # Grok-1: gated MLP (3 matrices -> swiglu), RoPE, RMSNorm, no biases.
    "grok": dict(mlp="swiglu", tied_embeddings=False, linear_bias=False, norm="rmsnorm",
                 position_embedding="rope", dropout=False),
    # Qwen3 MoE: SwiGLU experts, RoPE, RMSNorm, untied; head_dim 128 != hidden/heads (HF config).
    "qwen3": dict(mlp="swiglu", tied_embeddings=False, linear_bias=False, norm="rmsnorm",
                  position_embedding="rope", dropout=False, head_dim=128),
}

_GPT2_BPE_VOCAB = {"gpt": 51200, "opt": 50272}

# Model names whose dimensions a shipped workload preset already describes exactly.
_PRESET_MODELS = {"deepseek-v3": "deepseek-v3"}


def model_family(name: str) -> str:
    n = name.lower()
    for prefix, fam in (
        ("mpt", "mpt"), ("llama", "llama"), ("nemotron", "nemotron"), ("opt", "opt"),
        ("bloom", "bloom"), ("grok", "grok"), ("qwen3", "qwen3"), ("deepseek-v3", "deepseek-v3"),
        ("gpt", "gpt"), ("mt-nlg", "gpt"),
    ):
        if n.startswith(prefix):
            return fam
    raise _Skip(f"model_name: no architecture rule for {name!r}")


def fam_of(row: dict[str, Any]) -> str:
    return model_family(_text(row, "model_name"))


def map_model(row: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    name = _text(row, "model_name")
    fam = model_family(name)
    seq = _need_int(row, "seq_len")
    notes: list[str] = []
    if fam in _PRESET_MODELS:
        return {"preset": _PRESET_MODELS[fam], "name": name, "seq_len": seq}, [
            f"architecture from workload preset {_PRESET_MODELS[fam]!r} (CSV dims blank)"
        ]
    layers = _need_int(row, "n_layers")
    hidden = _need_int(row, "hidden")
    heads = _need_int(row, "n_heads")
    ffn = _int(row, "ffn_hidden")
    if ffn is None:
        if fam != "gpt":
            raise _Skip("ffn_hidden: not given")
        ffn = 4 * hidden  # Megatron GPT default --ffn-hidden-size = 4h
        notes.append("ffn_hidden blank -> 4*hidden (Megatron GPT default)")
    vocab = _int(row, "vocab")
    if vocab is None:
        if fam not in _GPT2_BPE_VOCAB:
            raise _Skip("vocab: not given")
        # GPT-2 BPE (50257 tokens) as the framework pads it: Megatron 51200 (as in the SC'21
        # and Korthikanti rows), metaseq/OPT 50272. Under 1 % of the FLOPs of these >=18B models.
        vocab = _GPT2_BPE_VOCAB[fam]
        notes.append(f"vocab blank -> {vocab} (GPT-2 BPE as {fam.upper()} pads it)")
    m: dict[str, Any] = {
        "name": name,
        "num_layers": layers,
        "hidden_size": hidden,
        "num_heads": heads,
        "ffn_hidden_size": ffn,
        "vocab_size": vocab,
        "seq_len": seq,
    }
    kv = _int(row, "n_kv_heads")
    if kv is not None and kv != heads:
        m["num_kv_heads"] = kv
    m.update(_FAMILY_FIELDS[fam])
    experts, topk = _int(row, "moe_experts"), _int(row, "moe_topk")
    if experts:
        if not topk:
            raise _Skip("moe_topk: not given for an MoE row")
        # the CSV's ffn_hidden is the per-expert size for MoE rows (notes of S11/S12)
        m["moe"] = {"num_experts": experts, "top_k": topk, "expert_ffn_hidden_size": ffn}
    return m, notes


# Inter-node bandwidth per device from the `inter_node` text (bytes/s, one direction).
def parse_inter_node(text: str, gpus_per_node: int) -> float | None:
    t = text.lower().replace("gbps", "gb/s")
    if not t:
        return None
    if "omni-path" in t or "opa" in t:
        m = re.search(r"(\d+)\s*links", t)
        links = int(m.group(1)) if m else 1
        return links * 100e9 / 8 / gpus_per_node  # Omni-Path 100 Gb/s per link
    m = re.search(r"(\d+)\s*x\s*(?:slingshot[-\w]*\s*)?(\d+)\s*gb/s", t)
    if m:
        count, rate = int(m.group(1)), float(m.group(2))
        if "per gpu" in t or "1 per gpu" in t:
            return rate * 1e9 / 8
        return count * rate * 1e9 / 8 / gpus_per_node  # per node (or per VM = node)
    m = re.search(r"(\d+)\s*gb/s", t)
    if m:
        rate = float(m.group(1))
        if "per gpu" in t:
            return rate * 1e9 / 8
        if "node-to-node" in t or "per node" in t:
            return rate * 1e9 / 8 / gpus_per_node
        return rate * 1e9 / 8
    return None


def map_cluster(row: dict[str, Any], device: str, n_gpus: int) -> tuple[dict[str, Any], list[str]]:
    """Device's usual fabric (its default preset); gpus_per_node and NIC bandwidth overridden
    only where the row states a different value; num_nodes = n_gpus / gpus_per_node."""
    preset = get_device(device).default_cluster_preset
    base = preset_spec(preset)
    gpn = _int(row, "gpus_per_node") or int(base.gpus_per_node)  # type: ignore[arg-type]
    if n_gpus % gpn:
        raise _Skip(f"n_gpus: {n_gpus} is not a multiple of gpus_per_node {gpn}")
    cluster: dict[str, Any] = {"device": device, "num_nodes": n_gpus // gpn}
    notes: list[str] = []
    memory_gb = re.search(r"(\d+)\s*gb", _text(row, "gpu").lower())
    if memory_gb and abs(float(memory_gb.group(1)) * 1e9 - get_device(device).memory_bytes) > 1e9:
        cluster["device_memory_bytes"] = float(memory_gb.group(1)) * 1e9
    if gpn != base.gpus_per_node:
        cluster["gpus_per_node"] = gpn
    text = _text(row, "inter_node")
    nic = parse_inter_node(text, gpn)
    base_nic = float(base.inter_node_bytes_per_s_per_device)  # type: ignore[arg-type]
    if nic is not None and abs(nic - base_nic) > 1e-6 * base_nic:
        cluster["inter_node_bytes_per_s_per_device"] = nic
    if not text and n_gpus > gpn:
        notes.append(f"inter_node blank -> {preset} preset NIC ({base_nic / 1e9:g} GB/s per device)")
    return cluster, notes


def _sequence_parallel(row: dict[str, Any], tp: int) -> bool:
    """True when the notes say SP is on ('selective+SP', 'sequence parallel on'), false when
    they say it is off; otherwise true for TP > 1 under Megatron-Core / NeMo / Megatron-Bridge
    (their recipes and --tp-comm-overlap require it) and torchtitan (its TP plan shards norms
    over the sequence), false for older Megatron-LM / DeepSpeed / metaseq."""
    notes = _text(row, "notes").lower()
    if "no sequence parallel" in notes:
        return False
    if "+sp" in notes or "sequence parallel on" in notes:
        return True
    system = _text(row, "system").lower()
    modern = any(k in system for k in ("megatron-core", "nemo", "megatron-bridge", "torchtitan"))
    return tp > 1 and modern


def _pre_flash_attention(row: dict[str, Any]) -> bool:
    """Runs that predate FlashAttention in their framework materialise the s x s scores (fused
    softmax + dropout): Megatron-LM 2021-22 (SC'21, Korthikanti), Megatron-DeepSpeed (BLOOM,
    DeepSpeed-Azure), metaseq (OPT), DeepSpeed ZeRO-3(-Offload)/ZeRO++ blog runs and the
    PyTorch 1.11 FSDP prototype. Everything later (Megatron-Core, NeMo, torchtitan,
    LLM-Foundry 'flash attn') uses flash attention, the schema default."""
    system = _text(row, "system").lower()
    return system == "megatron-lm" or any(
        k in system for k in ("megatron-deepspeed", "deepspeed zero", "metaseq", "1.11 prototype"))


def _grad_dtype(row: dict[str, Any]) -> str | None:
    """Dtype gradients are reduced in: LLM-Foundry 'PURE' mixed precision reduces in bf16;
    DeepSpeed fp16 reduces in fp16 (its communication_data_type defaults to the working dtype;
    the bf16 optimizer accumulates in fp32); everyone else here keeps fp32 (FSDP
    'DEFAULT' reduce_dtype fp32, Megatron fp32 main grads, torchtitan reduce_dtype fp32)."""
    prec, system = _text(row, "precision").lower(), _text(row, "system").lower()
    if "pure" in prec or ("deepspeed" in system and prec.startswith("fp16")):
        return "bf16"
    return None  # schema default fp32


def map_strategy(row: dict[str, Any], n_gpus: int, gpus_per_node: int) -> tuple[dict[str, Any], list[str]]:
    family = _text(row, "strategy_family")
    notes: list[str] = []
    system = _text(row, "system").lower()
    tp, pp, cp, ep = (_int(row, c, 1) or 1 for c in ("tp", "pp", "cp", "ep"))
    if family == "nd" and (_blank(row.get("tp")) or _blank(row.get("pp"))):
        raise _Skip(f"{'tp' if _blank(row.get('tp')) else 'pp'}: not given (parallel layout unknown)")
    dp = _int(row, "dp")
    if dp is None:
        if n_gpus % (tp * pp * cp):
            raise _Skip(f"dp: not given and n_gpus {n_gpus} not divisible by tp*pp*cp")
        dp = n_gpus // (tp * pp * cp)
        notes.append("dp blank -> n_gpus/(tp*pp*cp)")
    if tp * pp * cp * dp != n_gpus:
        raise _Skip(f"dp: tp*pp*cp*dp = {tp * pp * cp * dp} != n_gpus {n_gpus}")
    zs = _int(row, "zero_stage")
    if family in ("fsdp", "zero3", "zero2"):
        stage = 2 if family == "zero2" else (zs if zs in (2, 3) else 3)
        if tp > 1 or pp > 1 or cp > 1 or ep > 1:
            family = "nd"  # FSDP composed with TP/PP/CP (metaseq, Megatron-FSDP + TP, ...)
            zs = stage
            notes.append(f"FSDP with tp/pp/cp > 1 -> nd with zero_stage {stage}")
        else:
            sg_text = _text(row, "sharding_group")
            sg = int(sg_text) if sg_text.isdigit() else None
            if sg is not None and sg < dp:
                if dp % sg:
                    raise _Skip(f"sharding_group: {sg} does not divide dp {dp}")
                return {"name": "hsdp", "shard_group_size": sg}, notes
            s: dict[str, Any] = {"name": "zero", "stage": stage}
            if "fsdp" in system and stage == 2:
                # FSDP SHARD_GRAD_OP gathers each unit just before its forward (with
                # prefetch), not all at once after the optimizer as DeepSpeed stage 2
                s["overlap_param_gather"] = True
            return s, notes
    if family == "zeropp":
        # ZeRO++ = ZeRO-3 + qwZ (int8 weight all-gather) + hpZ (secondary bf16 copy of the
        # weights sharded inside one node) + qgZ (int4 hierarchical gradient reduce-scatter).
        # Field names are hzpsim.strategies.zeropp.Config's; hpZ secondary group = one node (paper).
        return {
            "name": "zeropp",
            "hpz_partition_size": gpus_per_node,
            "quantized_weights": True,
            "quantized_gradients": True,
        }, notes
    if family != "nd":
        raise _Skip(f"strategy_family: unknown family {family!r}")
    if zs is None:
        # Megatron-Core / NeMo / Megatron-Bridge recipes use the distributed optimizer
        zs = 1 if any(k in system for k in ("megatron-core", "nemo", "megatron-bridge")) else 0
        notes.append(f"zero_stage blank -> {zs} ({'distributed optimizer, NeMo/MCore default' if zs else 'plain DP'})")
    vpp = _int(row, "vpp", 1) or 1
    return {
        "name": "nd",
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "cp": cp,
        "ep": ep,
        "vpp": vpp,
        "zero_stage": zs,
        "sequence_parallel": _sequence_parallel(row, tp),
    }, notes


# --------------------------------------------------------------------------- measurements

_SC21_RE = re.compile(r"96\s*\*\s*B\s*\*\s*s\s*\*\s*l\s*\*\s*h\^2")


def sc21_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. SC'21 eq. (3): 96·B·s·l·h²·(1 + s/6h + V/16lh), full recompute included."""
    return 96.0 * batch * seq * layers * hidden**2 * (
        1 + seq / (6 * hidden) + vocab / (16 * layers * hidden)
    )


def _tflops_convention(row: dict[str, Any]) -> str:
    notes, src = _text(row, "notes"), _text(row, "source_id")
    if _SC21_RE.search(notes):
        return "sc21_recompute_inclusive"  # HFU-style: 4 forward passes with full recompute
    if "4*2 (recompute-inclusive)" in notes:
        return "megatron_deepspeed_recompute_inclusive"
    if "MFU counts attention FLOPs" in notes:
        return "llm_foundry_6N_plus_attention"
    if "model flops" in notes.lower() or "model-flops" in notes.lower():
        return "nvidia_model_flops"
    if src == "S04":
        return "megatron_readme_unstated"
    return "unstated"


def measured_values(row: dict[str, Any], model: dict[str, Any] | None = None) -> dict[str, Any]:
    """The row's measurements plus the exactly derivable ones. ``model`` (the mapped model,
    imputed fields included) supplies l, h, V to the SC'21 formula when the CSV leaves one blank."""
    gbs, seq, n = _num(row, "global_batch_seqs"), _num(row, "seq_len"), _num(row, "n_gpus")
    out: dict[str, Any] = {
        "tokens_per_s_per_gpu": _num(row, "measured_tokens_per_sec_per_gpu"),
        "step_time_s": _num(row, "measured_step_time_s"),
        "tflops_per_gpu": _num(row, "measured_tflops_per_gpu"),
        "mfu": _num(row, "measured_mfu"),
        "hfu_reported": None,
        "tflops_convention": _tflops_convention(row),
        "derived": {},
    }
    m = re.search(r"hfu=([0-9.]+)", _text(row, "notes"))
    if m:
        out["hfu_reported"] = float(m.group(1).rstrip("."))
    tokens_per_step = gbs * seq if gbs and seq else None
    tok, step = out["tokens_per_s_per_gpu"], out["step_time_s"]
    if tok is None and step is None and out["tflops_per_gpu"] and out["tflops_convention"] == "sc21_recompute_inclusive":
        dims = [_num(row, c) for c in ("n_layers", "hidden", "vocab")]
        if model is not None and "num_layers" in model:
            dims = [model["num_layers"], model["hidden_size"], model["vocab_size"]]
        if tokens_per_step and n and all(dims):
            flops = sc21_flops_per_iteration(int(gbs), int(seq), *(int(d) for d in dims))  # type: ignore[arg-type]
            step = flops / (out["tflops_per_gpu"] * 1e12 * n)
            out["step_time_s"] = step
            out["derived"]["step_time_s"] = "96*B*s*l*h^2*(1+s/6h+V/16lh) / (TFLOP/s x n_gpus) (SC'21 eq. 3, as the notes state)"
    if tokens_per_step and n:
        if out["tokens_per_s_per_gpu"] is None and step:
            out["tokens_per_s_per_gpu"] = tokens_per_step / step / n
            out["derived"]["tokens_per_s_per_gpu"] = "GBS*seq/step_time/n_gpus"
        elif out["step_time_s"] is None and out["tokens_per_s_per_gpu"]:
            out["step_time_s"] = tokens_per_step / (out["tokens_per_s_per_gpu"] * n)
            out["derived"]["step_time_s"] = "GBS*seq/(tokens/s/GPU x n_gpus)"
    if out["tokens_per_s_per_gpu"] is not None:
        out["basis"] = "throughput"
    elif out["mfu"] is not None or out["tflops_per_gpu"] is not None:
        out["basis"] = "reported_only"
    else:
        out["basis"] = "none"
    return out


# --------------------------------------------------------------------------- rows -> cases


def _label(row: dict[str, Any], i: int) -> str:
    n = _int(row, "n_gpus")
    gpu = _text(row, "gpu").split(" ")[0]
    return f"{_text(row, 'source_id')}#{i} {_text(row, 'model_name')} {n if n else '?'}x{gpu}"


def _param_check(model_map: dict[str, Any], row: dict[str, Any]) -> str | None:
    """Compare the mapped model's parameter count with the CSV's n_params_b (>10 % off -> caveat)."""
    published = _num(row, "n_params_b")
    if not published:
        return None
    if "preset" in model_map:
        return None  # shipped presets carry their own checked parameter counts
    try:
        model = from_mapping(Model, model_map, "model")
    except (ScenarioError, ValueError) as exc:
        raise _Skip(f"model: {exc}") from None
    ours = model.num_params() / 1e9
    if abs(ours - published) > 0.10 * published:
        return f"mapped model has {ours:.1f}B parameters, CSV n_params_b says {published:g}B"
    return None


def case_from_row(row: dict[str, Any], index: int) -> Case:
    """Map one CSV row (a dict of column -> value) to a Case."""
    source = _text(row, "source_id")
    family = _text(row, "strategy_family")
    measured = measured_values(row)
    n_gpus = _int(row, "n_gpus") if not _blank(row.get("n_gpus")) else None
    common = dict(family=family, system=_text(row, "system"), n_gpus=n_gpus)
    assumptions: list[str] = []
    caveats: list[str] = []
    try:
        if n_gpus is None:
            raise _Skip("n_gpus: not given")
        if measured["basis"] == "none":
            raise _Skip("measured_*: no measurement in the row")
        device, c = map_device(_text(row, "gpu"))
        caveats += c
        model, a = map_model(row)
        assumptions += a
        gbs = _need_int(row, "global_batch_seqs")
        cluster, a = map_cluster(row, device, n_gpus)
        assumptions += a
        gpn = int(cluster.get("gpus_per_node") or preset_spec(get_device(device).default_cluster_preset).gpus_per_node)  # type: ignore[arg-type]
        strategy, a = map_strategy(row, n_gpus, gpn)
        assumptions += a
        precision, a = map_precision(_text(row, "precision"), device)
        assumptions += a
        recompute, a = map_recompute(_text(row, "act_recompute"))
        assumptions += a
        mbs = _int(row, "micro_batch")
        if mbs is None:
            dp = strategy.get("dp", n_gpus)
            if strategy.get("pp", 1) > 1 or gbs % dp:
                mbs = 1
                assumptions.append("micro_batch blank -> 1")
            else:
                mbs = gbs // dp
                assumptions.append("micro_batch blank -> GBS/dp (no gradient accumulation)")
        training: dict[str, Any] = {
            "global_batch_size": gbs,
            "micro_batch_size": mbs,
            "precision": precision,
            "activation_recompute": recompute,
        }
        grad = _grad_dtype(row)
        if grad:
            training["grad_dtype"] = grad
        if _pre_flash_attention(row):
            training["flash_attention"] = False
        if "amp" in _text(row, "precision").lower():
            training["autocast"] = True
            assumptions.append("precision 'amp': torch.autocast (fp32 residual stream, casts before GEMMs)")
        mapping = {"model": model, "training": training, "cluster": cluster, "strategy": strategy}
        measured = measured_values(row, model)
        note = _param_check(model, row)
        if note and model.get("tied_embeddings") and fam_of(row) == "gpt":
            # Megatron-Core GPT runs use --untie-embeddings-and-output-weights: keep the
            # untied variant when it matches the published size and the tied one does not
            untied = {**model, "tied_embeddings": False}
            if _param_check(untied, row) is None:
                model = mapping["model"] = untied
                note = None
                assumptions.append("untied LM head: the tied GPT variant misses CSV n_params_b by >10 %, the untied one matches")
        if note:
            caveats.append(note)
        text = (_text(row, "notes") + " " + _text(row, "system")).lower()
        if "offload" in text:
            caveats.append("CPU offload of optimizer states / activations is not modelled")
        if strategy.get("tp", 1) > 1 and ("async tp" in text or "asynctp" in text or "tp-comm-overlap" in text):
            caveats.append("TP communication/compute overlap (async TP / tp-comm-overlap) is not modelled")
        if "peak" in _text(row, "notes").lower() and "not average" in _text(row, "notes").lower():
            caveats.append("measured value is a peak, not an average")
    except _Skip as exc:
        return Case(source, index, _label(row, index), None, str(exc), measured, **common,  # type: ignore[arg-type]
                    assumptions=tuple(assumptions), caveats=tuple(caveats))
    skip = None
    if strategy["name"] not in strategies.available():
        skip = f"strategy {strategy['name']} not implemented yet"
    return Case(source, index, _label(row, index), mapping, skip, measured, **common,  # type: ignore[arg-type]
                assumptions=tuple(assumptions), caveats=tuple(caveats))


def read_rows(path: str | Path | None = None) -> list[dict[str, Any]]:
    file = Path(path) if path is not None else DEFAULT_CSV
    if not file.is_file():
        raise ScenarioError(f"{file}: no such CSV file")
    df = pd.read_csv(file, dtype={"sharding_group": str})
    return [{k: (None if _blank(v) else v) for k, v in r.items()} for r in df.to_dict("records")]


def rows_to_scenarios(path: str | Path | None = None) -> list[Case]:
    """Every CSV row as a Case (default: the packaged copy of published_calibration.csv)."""
    return [case_from_row(row, i) for i, row in enumerate(read_rows(path))]


def select_cases(
    cases: Iterable[Case],
    families: Sequence[str] | None = None,
    sources: Sequence[str] | None = None,
    max_devices: int | None = None,
    max_rows: int | None = None,
    rows: Sequence[int] | None = None,
) -> list[Case]:
    """Filter by the CSV's strategy_family, source_id, n_gpus <= max_devices, row indices;
    then keep the first ``max_rows``."""
    fams = {f.lower() for f in families} if families else None
    srcs = {s.upper() for s in sources} if sources else None
    out = []
    for c in cases:
        if fams and c.family.lower() not in fams:
            continue
        if srcs and c.source_id.upper() not in srcs:
            continue
        if max_devices is not None and (c.n_gpus is None or c.n_gpus > max_devices):
            continue
        if rows is not None and c.row_index not in rows:
            continue
        out.append(c)
    return out[:max_rows] if max_rows is not None else out


# ------------------------------------------------------------------------------ validation

COLUMNS = (
    "source_id", "row", "label", "family", "strategy", "n_gpus", "status", "reason", "basis",
    "meas_tokens_per_s_per_gpu", "pred_tokens_per_s_per_gpu", "err_tokens_pct",
    "meas_step_time_s", "pred_step_time_s",
    "meas_mfu_palm", "pred_mfu", "pred_hfu",
    "reported_metric", "meas_reported", "pred_reported", "err_reported_pct",
    "fits_in_memory", "pred_peak_mem_gib", "pred_exposed_comm_s", "pred_overlap",
    "sim_wall_s", "derived", "assumptions", "caveats",
)


def _pct(pred: float | None, meas: float | None) -> float | None:
    if pred is None or meas is None or meas == 0:
        return None
    return (pred - meas) / meas * 100.0


def validate_published(
    cases: Iterable[Case],
    progress: Callable[[str], None] | None = None,
    expand: bool = False,
) -> pd.DataFrame:
    """Simulate every runnable case; one DataFrame row per case (skipped ones included).

    ``status``: ok | skip (mapping or missing strategy: ``reason``) | invalid (the scenario
    was rejected: ScenarioError message) | error (simulation failed). Errors are signed
    (pred - meas) / meas in percent.
    """
    from hzpsim.planner import run_choice  # imported late to keep the CSV side light
    from hzpsim.scenario import scenario_from_mapping

    records = []
    for case in cases:
        rec: dict[str, Any] = {k: None for k in COLUMNS}
        meas = case.measured
        rec.update(
            source_id=case.source_id, row=case.row_index, label=case.label, family=case.family,
            strategy=_strategy_label(case.scenario_mapping), n_gpus=case.n_gpus, basis=meas["basis"],
            meas_tokens_per_s_per_gpu=meas["tokens_per_s_per_gpu"], meas_step_time_s=meas["step_time_s"],
            derived="; ".join(f"{k}: {v}" for k, v in meas["derived"].items()),
            assumptions="; ".join(case.assumptions), caveats="; ".join(case.caveats),
        )
        if not case.runnable:
            rec.update(status="skip", reason=case.skip_reason)
            records.append(rec)
            continue
        if progress:
            progress(case.label)
        try:
            scenario = scenario_from_mapping(case.scenario_mapping, source=case.label)
        except ScenarioError as exc:
            rec.update(status="invalid", reason=str(exc))
            records.append(rec)
            continue
        except Exception as exc:  # a strategy plugin's bug in check(): record, keep going
            rec.update(status="error", reason=f"{type(exc).__name__}: {exc}")
            records.append(rec)
            continue
        t0 = time.perf_counter()
        try:
            report = run_choice(scenario, scenario.strategies[0], expand=expand)
        except Exception as exc:  # a simulator bug on a valid scenario: record, keep going
            rec.update(status="error", reason=f"{type(exc).__name__}: {exc}")
            records.append(rec)
            continue
        wall = time.perf_counter() - t0
        model, training = scenario.model, scenario.training
        peak = scenario.topology.device.peak_flops_per_s(training.precision)
        meas_mfu_palm = None
        if meas["tokens_per_s_per_gpu"] is not None:
            meas_mfu_palm = meas["tokens_per_s_per_gpu"] * model.model_flops_per_token() / peak
        rec.update(
            status="ok",
            pred_tokens_per_s_per_gpu=report["tokens_per_s_per_device"],
            err_tokens_pct=_pct(report["tokens_per_s_per_device"], meas["tokens_per_s_per_gpu"]),
            pred_step_time_s=report["step_time_s"],
            meas_mfu_palm=meas_mfu_palm,
            pred_mfu=report["mfu"],
            pred_hfu=report["hfu"],
            fits_in_memory=bool(report["fits_in_memory"]),
            pred_peak_mem_gib=report["peak_memory_bytes"] / 2**30,
            pred_exposed_comm_s=report["exposed_comm_s"],
            pred_overlap=report["overlap_fraction"],
            sim_wall_s=wall,
        )
        if meas["basis"] == "reported_only":
            # approximate: the source's own FLOP convention vs hzpsim's PaLM basis
            if meas["mfu"] is not None:
                rec.update(reported_metric=f"mfu ({meas['tflops_convention']})", meas_reported=meas["mfu"],
                           pred_reported=report["mfu"])
            else:
                rec.update(reported_metric=f"tflops ({meas['tflops_convention']})",
                           meas_reported=meas["tflops_per_gpu"], pred_reported=report["tflops_per_device"])
            rec["err_reported_pct"] = _pct(rec["pred_reported"], rec["meas_reported"])
        records.append(rec)
    return pd.DataFrame.from_records(records, columns=list(COLUMNS))


def _strategy_label(mapping: dict[str, Any] | None) -> str | None:
    if mapping is None:
        return None
    s = mapping["strategy"]
    fields_ = ",".join(f"{k}={v}" for k, v in s.items() if k != "name" and k in (
        "stage", "tp", "pp", "dp", "cp", "ep", "vpp", "zero_stage", "shard_group_size"))
    return f"{s['name']}({fields_})" if fields_ else s["name"]


def skip_category(reason: str | None) -> str:
    """Group skip reasons: the column (or 'strategy X not implemented yet')."""
    if not reason:
        return ""
    if reason.startswith("strategy ") and reason.endswith("not implemented yet"):
        return reason
    return reason.split(":", 1)[0] + ": " + ("not given" if "not given" in reason else reason.split(":", 1)[1].strip()[:60])


def summarize(df: pd.DataFrame, worst: int = 5) -> dict[str, Any]:
    """Headline statistics on the convention-free tokens/s/GPU error of the ok rows."""
    ok = df[df["status"] == "ok"]
    err = ok["err_tokens_pct"].dropna().astype(float)
    out: dict[str, Any] = {
        "cases": int(len(df)),
        "ok": int(len(ok)),
        "compared_on_tokens": int(len(err)),
        "status_counts": {k: int(v) for k, v in Counter(df["status"]).items()},
        "skip_reasons": {k: int(v) for k, v in Counter(
            skip_category(r) for r in df.loc[df["status"] != "ok", "reason"]).most_common()},
        "median_abs_err_pct": float(err.abs().median()) if len(err) else None,
        "mean_abs_err_pct": float(err.abs().mean()) if len(err) else None,
        "mean_err_pct": float(err.mean()) if len(err) else None,
        "median_err_pct": float(err.median()) if len(err) else None,
        "within_10_pct": int((err.abs() <= 10).sum()),
        "within_25_pct": int((err.abs() <= 25).sum()),
        "worst": [],
        "by_source": {},
    }
    if len(err):
        idx = err.abs().sort_values(ascending=False).index[:worst]
        out["worst"] = [
            {"label": ok.at[i, "label"], "err_tokens_pct": float(ok.at[i, "err_tokens_pct"])} for i in idx
        ]
        for src, grp in ok.dropna(subset=["err_tokens_pct"]).groupby("source_id"):
            e = grp["err_tokens_pct"].astype(float)
            out["by_source"][src] = {"n": int(len(e)), "median_err_pct": float(e.median()),
                                     "median_abs_err_pct": float(e.abs().median())}
    rep = ok["err_reported_pct"].dropna().astype(float)
    out["reported_only_compared"] = int(len(rep))
    out["reported_only_median_err_pct"] = float(rep.median()) if len(rep) else None
    return out


# ------------------------------------------------------------------------------- printing


def _f(v: Any, fmt: str, empty: str = "-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return empty
    return format(v, fmt)


def format_validation(df: pd.DataFrame) -> str:
    """Human-readable table of the ok rows, then summary statistics and skip reasons."""
    lines: list[str] = []
    ok = df[df["status"] == "ok"]
    if len(ok):
        header = (f"{'case':<36} {'strategy':<18} {'meas tok/s/GPU':>14} {'pred':>10} {'err %':>7} "
                  f"{'MFU meas':>8} {'pred':>6} {'fits':>4}  flags")
        lines += [header, "-" * len(header)]
        for _, r in ok.iterrows():
            flags = []
            if r["derived"]:
                flags.append("derived")
            if r["assumptions"]:
                flags.append("assumed")
            if r["caveats"]:
                flags.append("caveat")
            if r["basis"] == "reported_only":
                flags.append(f"reported-only {r['reported_metric']} err {_f(r['err_reported_pct'], '+.1f')}%")
            lines.append(
                f"{r['label'][:36]:<36} {str(r['strategy'])[:18]:<18} "
                f"{_f(r['meas_tokens_per_s_per_gpu'], ',.0f'):>14} {_f(r['pred_tokens_per_s_per_gpu'], ',.0f'):>10} "
                f"{_f(r['err_tokens_pct'], '+.1f'):>7} {_f(r['meas_mfu_palm'], '.1%'):>8} {_f(r['pred_mfu'], '.1%'):>6} "
                f"{'yes' if r['fits_in_memory'] else 'NO':>4}  {','.join(flags)}"
            )
        lines.append("")
    s = summarize(df)
    lines.append(
        f"cases {s['cases']}: " + ", ".join(f"{k} {v}" for k, v in sorted(s["status_counts"].items()))
    )
    if s["compared_on_tokens"]:
        lines.append(
            f"tokens/s/GPU error over {s['compared_on_tokens']} rows: median |err| {s['median_abs_err_pct']:.1f}%, "
            f"mean |err| {s['mean_abs_err_pct']:.1f}%, mean (signed) {s['mean_err_pct']:+.1f}%, "
            f"median (signed) {s['median_err_pct']:+.1f}%, within 10% {s['within_10_pct']}, within 25% {s['within_25_pct']}"
        )
        lines.append("by source: " + "; ".join(
            f"{k} n={v['n']} median {v['median_err_pct']:+.1f}%" for k, v in s["by_source"].items()))
        lines.append("worst: " + "; ".join(f"{w['label']} {w['err_tokens_pct']:+.1f}%" for w in s["worst"]))
    if s["reported_only_compared"]:
        lines.append(
            f"reported-only rows (approximate, other FLOP conventions): {s['reported_only_compared']}, "
            f"median err {s['reported_only_median_err_pct']:+.1f}%"
        )
    if s["skip_reasons"]:
        lines.append("not run:")
        lines += [f"  {n:4d}  {reason}" for reason, n in s["skip_reasons"].items()]
    return "\n".join(lines)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "item"):  # numpy scalars
        return v.item()
    return v


def main_published(
    csv_path: str | Path | None = None,
    families: Sequence[str] | None = None,
    sources: Sequence[str] | None = None,
    max_rows: int | None = None,
    json: bool = False,
    max_devices: int | None = None,
    rows: Sequence[int] | None = None,
    out: Any = None,
) -> int:
    """``hzpsim validate published``: print the table (or JSON {rows, summary}); exit code 0,
    2 when the CSV cannot be read."""
    out = out or sys.stdout
    try:
        cases = rows_to_scenarios(csv_path)
    except (ScenarioError, OSError, pd.errors.ParserError) as exc:
        print(f"hzpsim: error: {exc}", file=sys.stderr)
        return 2
    selected = select_cases(cases, families, sources, max_devices, max_rows, rows)
    df = validate_published(selected)
    if json:
        records = [{k: _jsonable(v) for k, v in r.items()} for r in df.to_dict("records")]
        print(_json.dumps({"rows": records, "summary": summarize(df)}, indent=2), file=out)
    else:
        print(format_validation(df), file=out)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``hzpsim validate published`` (for the CLI to reuse)."""
    parser.add_argument("--csv", dest="csv_path", help="CSV to read (default: the packaged published_calibration.csv)")
    parser.add_argument("--family", action="append", dest="families",
                        help="CSV strategy_family to keep (nd, fsdp, zero2, zero3, zeropp); repeatable")
    parser.add_argument("--source", action="append", dest="sources", help="source_id to keep (e.g. S09); repeatable")
    parser.add_argument("--max-devices", type=int, help="skip rows with more GPUs than this")
    parser.add_argument("--max-rows", type=int, help="keep only the first N selected rows")
    parser.add_argument("--row", type=int, action="append", dest="rows", help="CSV row index (0-based); repeatable")
    parser.add_argument("--json", action="store_true", help="print {rows, summary} as JSON")


def run_from_args(args: argparse.Namespace) -> int:
    return main_published(args.csv_path, args.families, args.sources, args.max_rows, args.json,
                          args.max_devices, args.rows)


if __name__ == "__main__":  # python -m hzpsim.validation [options]
    _parser = argparse.ArgumentParser(prog="python -m hzpsim.validation", description=__doc__.split("\n")[0])
    add_arguments(_parser)
    sys.exit(run_from_args(_parser.parse_args()))
