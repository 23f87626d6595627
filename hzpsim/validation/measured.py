"""Measured values of a published row, and the ones exactly derivable from them.

Part of :mod:`hzpsim.validation`. Tokens/s per GPU and step time convert into each other via
GBS·seq/(step·n_gpus); where a source gives only TFLOP/s and its notes state SC'21's formula
96·B·s·l·h²(1 + s/6h + V/16lh) per iteration, the step time is recovered exactly from it.

    from hzpsim.validation.measured import measured_values
    measured_values(row)["tokens_per_s_per_gpu"]
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from hzpsim.validation.cells import cell_text, number


@dataclass(frozen=True)
class Measurement:
    """One measured run to fit: a scenario mapping and its tokens/s per device."""

    label: str
    source: str
    scenario: dict[str, Any]
    measured_tokens_per_s_per_device: float
    regimes: tuple[str, ...] = ()


_SC21_RE = re.compile(r"96\s*\*\s*B\s*\*\s*s\s*\*\s*l\s*\*\s*h\^2")


def sc21_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. SC'21 eq. (3): 96·B·s·l·h²·(1 + s/6h + V/16lh), full recompute included."""
    return 96.0 * batch * seq * layers * hidden**2 * (
        1 + seq / (6 * hidden) + vocab / (16 * layers * hidden)
    )


def tflops_convention(row: dict[str, Any]) -> str:
    """How the source counts the FLOPs behind its TFLOP/s and MFU columns (from its notes)."""
    notes, src = cell_text(row, "notes"), cell_text(row, "source_id")
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
    gbs, seq, n = number(row, "global_batch_seqs"), number(row, "seq_len"), number(row, "n_gpus")
    out: dict[str, Any] = {
        "tokens_per_s_per_gpu": number(row, "measured_tokens_per_sec_per_gpu"),
        "step_time_s": number(row, "measured_step_time_s"),
        "tflops_per_gpu": number(row, "measured_tflops_per_gpu"),
        "mfu": number(row, "measured_mfu"),
        "hfu_reported": None,
        "tflops_convention": tflops_convention(row),
        "derived": {},
    }
    m = re.search(r"hfu=([0-9.]+)", cell_text(row, "notes"))
    if m:
        out["hfu_reported"] = float(m.group(1).rstrip("."))
    tokens_per_step = gbs * seq if gbs and seq else None
    tok, step = out["tokens_per_s_per_gpu"], out["step_time_s"]
    if tok is None and step is None and out["tflops_per_gpu"] and out["tflops_convention"] == "sc21_recompute_inclusive":
        dims = [number(row, c) for c in ("n_layers", "hidden", "vocab")]
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
