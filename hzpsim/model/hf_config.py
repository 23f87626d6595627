"""Read a Hugging Face ``config.json`` into the fields of :class:`~hzpsim.model.Model`.

``model: path/to/config.json`` (or the folder holding it) in a scenario lands here
(:func:`model_fields`); the result is a plain mapping of ``Model`` fields that the scenario
loader treats like a preset's (``seq_len``, ``dropout``, ... may be overridden next to it).
Local files only: nothing is downloaded.

One function per architecture family, each following the family's configuration class and
modeling code in ``huggingface/transformers`` (``src/transformers/models/<type>/``):

- ``llama``, ``mistral`` (``LlamaConfig`` / ``LlamaAttention``, ``LlamaMLP``; ``MistralConfig``):
  gated MLP (gate_proj, up_proj, down_proj), RMSNorm, RoPE, GQA through
  ``num_key_value_heads``, optional ``head_dim``; Llama's ``attention_bias`` puts a bias on
  q/k/v/o and ``mlp_bias`` on the MLP (hzpsim models both or neither: ``linear_bias``).
- ``mixtral`` (``MixtralConfig``, ``MixtralSparseMoeBlock``): every layer MoE,
  ``num_local_experts`` experts of ``intermediate_size``, top ``num_experts_per_tok``, router
  ``gate`` h × experts without bias.
- ``qwen2`` (``Qwen2Attention``: q_proj, k_proj, v_proj with ``bias=True``, o_proj without):
  ``qkv_bias``. ``qwen3`` (``Qwen3Attention``: ``q_norm`` / ``k_norm``, RMSNorm of head_dim;
  ``Qwen3Config.head_dim`` defaults to 128): ``qk_norm``.
- ``qwen2_moe`` / ``qwen3_moe`` (``Qwen2MoeSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``;
  decoder layer: MoE when ``layer_idx not in mlp_only_layers and num_experts > 0 and
  (layer_idx + 1) % decoder_sparse_step == 0``): ``num_experts`` experts of
  ``moe_intermediate_size``; Qwen2-MoE adds one ``shared_expert`` of
  ``shared_expert_intermediate_size`` and its ``shared_expert_gate`` (Linear h → 1, no bias)
  and biases on q/k/v (``Qwen2MoeConfig.qkv_bias``, default true).
- ``deepseek_v2`` / ``deepseek_v3`` (``DeepseekV3Config``, ``DeepseekV3Attention``,
  ``DeepseekV3MoE``; DeepSeek's own ``modeling_deepseek.py``: MoE when ``layer_idx >=
  first_k_dense_replace and layer_idx % moe_layer_freq == 0``): multi-head latent attention
  (``q_lora_rank`` may be null: V2-Lite), ``n_routed_experts`` of ``moe_intermediate_size``,
  the ``n_shared_experts`` as one MLP of ``moe_intermediate_size × n_shared_experts`` (as the
  modeling code builds them). The multi-token-prediction module
  (``num_nextn_predict_layers``) is not part of the model; V3's router
  ``e_score_correction_bias`` is a buffer in transformers (no gradient) and is not counted.
- ``gpt2`` (``GPT2Config``, ``GPT2Attention`` / ``GPT2MLP`` with ``Conv1D`` biases): fused
  QKV, GELU MLP of ``n_inner`` (default 4·n_embd), LayerNorm with bias, learned positions of
  ``n_positions`` rows, LM head tied (``PretrainedConfig``'s ``tie_word_embeddings=True``).
- ``gpt_neox`` (``GPTNeoXConfig``, ``GPTNeoXAttention``: query_key_value and dense with
  ``bias=attention_bias``; ``GPTNeoXMLP``: dense_h_to_4h / dense_4h_to_h always with bias):
  GELU MLP, LayerNorm with bias, rotary (partial: ``rotary_pct`` has no parameters), untied
  ``embed_out`` by default.

Sliding-window attention (``sliding_window``, ``layer_types``; Qwen's ``use_sliding_window``)
maps to ``sliding_window`` / ``full_attention_interval`` (:func:`_windows`).
Not modelled (documented in the scenario docs): partial rotary, parallel residuals, the
router's extra buffers.
Fields hzpsim does not read are ignored. The architecture's size fields are required (where
transformers would fall back to its class default); flags take the class default.

``seq_len`` defaults to the pre-training context: ``rope_scaling`` /
``rope_parameters``' ``original_max_position_embeddings`` when present (YaRN / Llama-3.1
extensions), else ``max_position_embeddings`` (``n_positions`` for GPT-2).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hzpsim.config import ScenarioError

_REQUIRED = object()


class _Fields:
    """Typed access to a config.json's keys; errors name the file and the key."""

    def __init__(self, data: Mapping[str, Any], where: str) -> None:
        self.data, self.where = data, where

    def error(self, key: str, problem: str) -> ScenarioError:
        return ScenarioError(f"{self.where}: {key}: {problem}")

    def _get(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is _REQUIRED:
                raise self.error(key, "required key is missing")
            return default
        return value

    def integer(self, key: str, default: Any = _REQUIRED) -> Any:
        if self.data.get(key) is None:
            return self._get(key, default)  # the default (or: required key is missing)
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected an integer, got {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"expected a number, got {value!r}")
        return float(value)

    def text(self, key: str, default: str) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise self.error(key, f"expected a string, got {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self._get(key, [])
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise self.error(key, f"expected a list of integers, got {value!r}")
        return list(value)

    def context(self, key: str = "max_position_embeddings", default: Any = _REQUIRED) -> int:
        """Pre-training context: the rope scaling's original length, else ``key``."""
        longest = self.integer(key, default)
        for scaling_key in ("rope_scaling", "rope_parameters"):
            scaling = self.data.get(scaling_key)
            if scaling is None:
                continue
            if not isinstance(scaling, Mapping):
                raise self.error(scaling_key, f"expected a mapping or null, got {scaling!r}")
            original = scaling.get("original_max_position_embeddings")
            if original is not None:
                if isinstance(original, bool) or not isinstance(original, int):
                    raise self.error(f"{scaling_key}.original_max_position_embeddings",
                                     f"expected an integer, got {original!r}")
                return min(original, longest)
        return int(longest)


def _head_dim(f: _Fields, hidden: int, heads: int, default: Any = None) -> dict[str, Any]:
    """``head_dim`` only where it differs from hidden_size // num_heads (Model's default)."""
    head_dim = f.integer("head_dim", default)
    if head_dim is None or (hidden % heads == 0 and head_dim == hidden // heads):
        return {}
    return {"head_dim": head_dim}


def _decoder(f: _Fields) -> dict[str, Any]:
    """The fields every Llama-style decoder shares (RMSNorm, RoPE, gated MLP, no biases)."""
    hidden, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    f.text("hidden_act", "silu")  # checked only: the gated MLP has three matrices whatever it is
    return {
        "num_layers": f.integer("num_hidden_layers"),
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": f.integer("num_key_value_heads", heads),
        "ffn_hidden_size": f.integer("intermediate_size"),
        "vocab_size": f.integer("vocab_size"),
        "seq_len": f.context(),
        # a gated MLP (gate_proj, up_proj, down_proj; silu: SwiGLU, gelu: GeGLU, same sizes and FLOPs)
        "mlp": "swiglu",
        "norm": "rmsnorm",
        "position_embedding": "rope",
        "tied_embeddings": f.flag("tie_word_embeddings", False),
        "dropout": f.number("attention_dropout", 0.0) > 0,
        **_windows(f, f.integer("num_hidden_layers")),
    }


def _windows(f: _Fields, num_layers: int) -> dict[str, Any]:
    """``sliding_window`` and ``full_attention_interval`` from the config's window keys
    (``MistralAttention`` / ``Qwen2Attention``: ``sliding_window`` on the layers whose
    ``layer_types`` entry is ``sliding_attention``): a null ``sliding_window`` (Llama, Mixtral)
    or Qwen's ``use_sliding_window: false`` leaves every layer full; a window without
    ``layer_types`` is on every layer (Mistral-7B v0.1); ``layer_types`` must be every layer
    windowed, or full on every k-th (i % k == k - 1). Qwen's block of windowed layers from
    ``max_window_layers`` on, without ``layer_types``, exits naming it."""
    if not f.flag("use_sliding_window", True) or f.data.get("sliding_window") is None:
        return {}
    window = f.integer("sliding_window")
    types = f.data.get("layer_types")
    if types is None:
        if "use_sliding_window" in f.data and f.data.get("max_window_layers") is not None:
            raise f.error("max_window_layers", "windowed layers from max_window_layers on are not modelled "
                                               "(hzpsim windows every layer or all but every k-th)")
        return {"sliding_window": window}
    if not isinstance(types, list) or len(types) != num_layers or any(
            t not in ("sliding_attention", "full_attention") for t in types):
        raise f.error("layer_types", f"expected {num_layers} entries of sliding_attention / full_attention, got {types!r}")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if len(full) == num_layers:
        return {}
    interval = full[0] + 1 if full else 0
    if full and full != list(range(interval - 1, num_layers, interval)):
        raise f.error("layer_types", "full-attention layers that are not every k-th layer are not modelled")
    return {"sliding_window": window, "full_attention_interval": interval}


def _llama(f: _Fields) -> dict[str, Any]:
    out = _decoder(f)
    out.update(_head_dim(f, out["hidden_size"], out["num_heads"]))
    attention_bias, mlp_bias = f.flag("attention_bias", False), f.flag("mlp_bias", False)
    if attention_bias != mlp_bias:
        key = "attention_bias" if attention_bias else "mlp_bias"
        raise f.error(key, "a bias on only the attention or only the MLP is not modelled "
                           "(hzpsim's linear_bias puts one on every linear)")
    out["linear_bias"] = attention_bias
    return out


def _mistral(f: _Fields) -> dict[str, Any]:
    out = _decoder(f)
    out.update(_head_dim(f, out["hidden_size"], out["num_heads"]))
    return out


def _moe_placement(f: _Fields, num_layers: int, moe_layers: list[int], key: str) -> dict[str, int] | None:
    """``first_dense_layers`` / ``moe_layer_interval`` giving exactly ``moe_layers``; None when
    no layer is MoE; ScenarioError naming ``key`` when no such pair exists."""
    if not moe_layers:
        return None
    first = moe_layers[0]
    interval = moe_layers[1] - first if len(moe_layers) > 1 else num_layers
    if moe_layers != list(range(first, num_layers, interval)):
        raise f.error(key, f"MoE layers {moe_layers} are not every k-th layer after the first dense ones; "
                           "hzpsim cannot place them")
    return {"first_dense_layers": first, "moe_layer_interval": interval}


def _mixtral(f: _Fields) -> dict[str, Any]:
    out = _mistral(f)
    out["moe"] = {
        "num_experts": f.integer("num_local_experts"),
        "top_k": f.integer("num_experts_per_tok"),
        "expert_ffn_hidden_size": out["ffn_hidden_size"],
    }
    return out


def _qwen2(f: _Fields) -> dict[str, Any]:
    out = _mistral(f)
    out["qkv_bias"] = True  # Qwen2Attention: q_proj, k_proj, v_proj bias=True; o_proj bias=False
    return out


def _qwen3(f: _Fields) -> dict[str, Any]:
    out = _decoder(f)
    out.update(_head_dim(f, out["hidden_size"], out["num_heads"], 128))  # Qwen3Config.head_dim = 128
    if f.flag("attention_bias", False):
        raise f.error("attention_bias", "a bias on q/k/v/o without one on the MLP is not modelled")
    out["qk_norm"] = True
    return out


def _qwen_moe_block(f: _Fields, out: dict[str, Any]) -> None:
    num_layers = out["num_layers"]
    step = f.integer("decoder_sparse_step", 1)
    if step < 1:
        raise f.error("decoder_sparse_step", f"must be >= 1, got {step}")
    dense_only = set(f.int_list("mlp_only_layers"))
    experts = f.integer("num_experts")
    moe_layers = [i for i in range(num_layers)
                  if i not in dense_only and experts > 0 and (i + 1) % step == 0]
    key = "mlp_only_layers" if dense_only else "decoder_sparse_step"
    placement = _moe_placement(f, num_layers, moe_layers, key)
    if placement is not None:
        out["moe"] = {"num_experts": experts, "top_k": f.integer("num_experts_per_tok"),
                      "expert_ffn_hidden_size": f.integer("moe_intermediate_size"), **placement}


def _qwen2_moe(f: _Fields) -> dict[str, Any]:
    out = _mistral(f)
    out["qkv_bias"] = f.flag("qkv_bias", True)
    _qwen_moe_block(f, out)
    shared = f.integer("shared_expert_intermediate_size")
    if "moe" in out and shared > 0:
        out["moe"].update(num_shared_experts=1, shared_expert_ffn_hidden_size=shared, shared_expert_gate=True)
    return out


def _qwen3_moe(f: _Fields) -> dict[str, Any]:
    out = _qwen3(f)
    _qwen_moe_block(f, out)
    return out


def _deepseek(f: _Fields) -> dict[str, Any]:
    out = _decoder(f)
    out.pop("num_kv_heads")  # MLA decompresses K and V for every head
    if f.flag("attention_bias", False):
        raise f.error("attention_bias", "biases are not modelled together with MLA")
    out["mla"] = {
        "q_lora_rank": f.integer("q_lora_rank", None),
        "kv_lora_rank": f.integer("kv_lora_rank"),
        "qk_nope_head_dim": f.integer("qk_nope_head_dim"),
        "qk_rope_head_dim": f.integer("qk_rope_head_dim"),
        "v_head_dim": f.integer("v_head_dim"),
    }
    experts = f.integer("n_routed_experts", None)
    if experts is None:
        return out
    num_layers = out["num_layers"]
    first_k, freq = f.integer("first_k_dense_replace", 0), f.integer("moe_layer_freq", 1)
    if freq < 1:
        raise f.error("moe_layer_freq", f"must be >= 1, got {freq}")
    moe_layers = [i for i in range(num_layers) if i >= first_k and i % freq == 0]
    placement = _moe_placement(f, num_layers, moe_layers, "first_k_dense_replace")
    if placement is None:
        return out
    expert_ffn = f.integer("moe_intermediate_size")
    shared = f.integer("n_shared_experts", 0) or 0
    out["moe"] = {"num_experts": experts, "top_k": f.integer("num_experts_per_tok"),
                  "expert_ffn_hidden_size": expert_ffn, **placement}
    if shared > 0:  # DeepseekV3MoE.shared_experts: one MLP of moe_intermediate_size * n_shared_experts
        out["moe"]["num_shared_experts"] = 1
        if shared > 1:
            out["moe"]["shared_expert_ffn_hidden_size"] = expert_ffn * shared
    return out


def _gpt2(f: _Fields) -> dict[str, Any]:
    hidden = f.integer("n_embd")
    positions = f.integer("n_positions")
    dropout = max(f.number(k, 0.1) for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop"))
    return {
        "num_layers": f.integer("n_layer"),
        "hidden_size": hidden,
        "num_heads": f.integer("n_head"),
        "ffn_hidden_size": f.integer("n_inner", 4 * hidden),
        "vocab_size": f.integer("vocab_size"),
        "seq_len": positions,
        "max_position_embeddings": positions,
        "mlp": "gelu",
        "linear_bias": True,
        "norm": "layernorm",
        "norm_bias": True,
        "position_embedding": "learned",
        "tied_embeddings": f.flag("tie_word_embeddings", True),
        "dropout": dropout > 0,
    }


def _gpt_neox(f: _Fields) -> dict[str, Any]:
    if not f.flag("attention_bias", True):
        raise f.error("attention_bias", "false is not modelled: GPT-NeoX's MLP keeps its biases and hzpsim's "
                                        "linear_bias covers every linear")
    dropout = max(f.number(k, 0.0) for k in ("attention_dropout", "hidden_dropout"))
    return {
        "num_layers": f.integer("num_hidden_layers"),
        "hidden_size": f.integer("hidden_size"),
        "num_heads": f.integer("num_attention_heads"),
        "ffn_hidden_size": f.integer("intermediate_size"),
        "vocab_size": f.integer("vocab_size"),
        "seq_len": f.context(default=2048),
        "mlp": "gelu",
        "linear_bias": True,
        "norm": "layernorm",
        "norm_bias": True,
        "position_embedding": "rope",
        "tied_embeddings": f.flag("tie_word_embeddings", False),
        "dropout": dropout > 0,
    }


#: ``model_type`` -> the function reading that family's config.
ARCHITECTURES: dict[str, Callable[[_Fields], dict[str, Any]]] = {
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2": _qwen2,
    "qwen2_moe": _qwen2_moe,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
}


def is_config_path(text: str) -> bool:
    """``model: text`` names a Hugging Face config (a path: ends in .json or holds a /), not a preset."""
    return text.endswith(".json") or "/" in text or "\\" in text


def config_file(path: str | Path) -> Path:
    """The config.json that ``path`` names (the file itself or ``<folder>/config.json``)."""
    p = Path(path).expanduser()
    return p / "config.json" if p.is_dir() else p


def read_config(path: str | Path, where: str = "model") -> dict[str, Any]:
    """The JSON object of a config file; ScenarioError for a missing or malformed file."""
    file = config_file(path)
    label = f"{where}: {path}"
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError(f"{label}: no such file (a Hugging Face config.json or its folder)") from None
    except OSError as exc:
        raise ScenarioError(f"{label}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{label}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ScenarioError(f"{label}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{label}: a config.json must hold a JSON object")
    return data


def model_fields(path: str | Path, where: str = "model", name: str | None = None) -> dict[str, Any]:
    """The :class:`~hzpsim.model.Model` fields (a plain mapping, ``moe`` / ``mla`` nested) that
    the Hugging Face config at ``path`` describes. ``where`` prefixes error messages; ``name``
    is the model's display name (default: the config's folder name)."""
    data = read_config(path, where)
    f = _Fields(data, f"{where}: {path}")
    model_type = data.get("model_type")
    if model_type is None:
        raise f.error("model_type", f"required key is missing (supported: {', '.join(ARCHITECTURES)})")
    if not isinstance(model_type, str):
        raise f.error("model_type", f"expected a string, got {model_type!r}")
    reader = ARCHITECTURES.get(model_type)
    if reader is None:
        raise f.error("model_type", f"{model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    out = reader(f)
    out["name"] = name or config_file(path).resolve().parent.name or model_type
    return out
