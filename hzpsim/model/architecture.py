"""Transformer architecture math: the :class:`Model` spec, its parameter counts and FLOPs.

Pure functions of a frozen :class:`Model` (no I/O, no simulation, no strategy knowledge).
Activation bytes (:mod:`hzpsim.model.activations`), recomputation policies
(:mod:`hzpsim.model.checkpointing`) and eager dispatch counts (:mod:`hzpsim.model.dispatch`)
live in their own modules; ``Model`` keeps thin methods that call them.
Counts are plain numbers in SI units: parameters in elements, FLOPs (one multiply-add = 2
FLOPs), activations in bytes. Try it::

    python -c "from hzpsim.model import Model; print(Model(4, 256, 4, 1024, 1000, 128).summary())"

Sources:
- PaLM (Chowdhery et al. 2022, arXiv 2204.02311) Appendix B: model FLOPs per token.
- Narayanan et al. SC'21 (arXiv 2104.04473) §5.1: 96·B·s·l·h²(1 + s/6h + V/16lh) per iteration.
- Korthikanti et al. 2022 (arXiv 2205.05198) §4, Table 2: activation bytes per layer.
- DeepSeek-V2/V3 (arXiv 2405.04434, 2412.19437): multi-head latent attention (MLA).

Conventions (one transformer layer = pre-norm attention block + pre-norm MLP/MoE block):
- A "matmul parameter" is a weight used in a GEMM; biases, norm scales and embedding tables
  (a lookup, not a GEMM) are not matmul parameters.
- Backward FLOPs = 2 × forward FLOPs (one GEMM for the input gradient, one for the weight
  gradient, each as large as the forward GEMM; the same holds for the attention core).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

from hzpsim.model import activations, checkpointing, dispatch, kernels
from hzpsim.model.checkpointing import RecomputeMode


@dataclass(frozen=True)
class MoE:
    """Mixture-of-experts MLP replacing the dense MLP in some layers."""

    num_experts: int
    """Routed experts per MoE layer (count, required)."""
    top_k: int
    """Routed experts each token is sent to (count, required)."""
    expert_ffn_hidden_size: int
    """Intermediate size of one routed expert's MLP (elements, required)."""
    moe_layer_interval: int = 1
    """Every k-th layer after ``first_dense_layers`` is MoE (layers, default 1 = all)."""
    num_shared_experts: int = 0
    """Always-active shared experts per MoE layer (count, default 0)."""
    first_dense_layers: int = 0
    """Leading layers that keep the dense MLP (layers, default 0)."""
    shared_expert_ffn_hidden_size: int | None = None
    """Intermediate size of one shared expert (elements, default ``expert_ffn_hidden_size``)."""
    shared_expert_gate: bool = False
    """A sigmoid gate h × 1 scales the shared experts' output (Qwen2-MoE's ``shared_expert_gate``);
    counted with the router, as one more router output (default false)."""

    @property
    def shared_ffn_resolved(self) -> int:
        """Intermediate size of one shared expert (elements)."""
        if self.shared_expert_ffn_hidden_size is None:
            return self.expert_ffn_hidden_size
        return self.shared_expert_ffn_hidden_size

    def validate(self) -> None:
        """Raise ``ValueError("<field>: <problem>")`` for an impossible MoE block."""
        for name in ("num_experts", "top_k", "expert_ffn_hidden_size", "moe_layer_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("num_shared_experts", "first_dense_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: {self.top_k} exceeds num_experts ({self.num_experts})")
        if (
            self.shared_expert_ffn_hidden_size is not None
            and self.shared_expert_ffn_hidden_size < 1
        ):
            raise ValueError(
                f"shared_expert_ffn_hidden_size: must be >= 1, got {self.shared_expert_ffn_hidden_size}"
            )


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank compressed Q and KV.

    Weights (DeepSeek-V3 names): q_a h×q_lora, q_a_norm, q_b q_lora×a(d_nope+d_rope),
    kv_a h×(kv_lora+d_rope), kv_a_norm, kv_b kv_lora×a(d_nope+d_v), o a·d_v×h. K and V are
    decompressed per head for training, so the attention core is an MHA with query/key head
    size d_nope+d_rope and value head size d_v.
    """

    kv_lora_rank: int
    """Rank of the joint KV compression (elements, required; DeepSeek-V3: 512)."""
    qk_nope_head_dim: int
    """Per-head query/key size without rotary part (elements, required; V3: 128)."""
    qk_rope_head_dim: int
    """Per-head decoupled rotary query/key size, key part shared by heads (elements, required; V3: 64)."""
    v_head_dim: int
    """Per-head value size (elements, required; V3: 128)."""
    q_lora_rank: int | None = None
    """Rank of the query compression (elements, default None = uncompressed q projection; V3: 1536)."""

    def validate(self) -> None:
        """Raise ``ValueError("<field>: <problem>")`` for impossible MLA sizes."""
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim < 0:
            raise ValueError(f"qk_rope_head_dim: must be >= 0, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank: must be >= 1, got {self.q_lora_rank}")


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer (dense or MoE). Defaults describe a Llama-style model."""

    num_layers: int
    """Transformer layers (count, required)."""
    hidden_size: int
    """Model width h (elements, required)."""
    num_heads: int
    """Query attention heads a (count, required)."""
    ffn_hidden_size: int
    """Intermediate size of the dense MLP (elements, required; unused in all-MoE models)."""
    vocab_size: int
    """Vocabulary size V (tokens, required)."""
    seq_len: int
    """Training sequence length s (tokens, required)."""
    name: str = "custom"
    """Display name (default "custom")."""
    num_kv_heads: int | None = None
    """Key/value heads for GQA/MQA (count, default ``num_heads`` = MHA)."""
    head_dim: int | None = None
    """Per-head size (elements, default ``hidden_size // num_heads``; ignored with ``mla``)."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """MLP type: swiglu (3 matrices: gate, up, down) or gelu (2 matrices) (default swiglu)."""
    tied_embeddings: bool = False
    """LM head shares the token-embedding matrix (default false)."""
    moe: MoE | None = None
    """Mixture-of-experts settings (default None = dense model)."""
    linear_bias: bool = False
    """Every linear layer except the router and LM head has a bias (default false; GPT-2/3: true)."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """Normalisation type (default rmsnorm). Only documents the model; sizes depend on norm_bias."""
    norm_bias: bool = False
    """Norms carry a bias (shift) besides the scale (default false; GPT-3 LayerNorm: true)."""
    position_embedding: Literal["rope", "learned", "alibi", "none"] = "rope"
    """Position encoding; only "learned" adds parameters (seq_len × h) (default rope)."""
    dropout: bool = True
    """Dropout on attention probabilities and block outputs; its 1-byte masks are activation
    memory (default true, Korthikanti's Table 2 convention; Llama/Mixtral train without)."""
    mla: MLA | None = None
    """Multi-head latent attention (default None = standard MHA/GQA attention)."""
    qkv_bias: bool = False
    """Only the Q, K and V projections carry a bias (Qwen2; default false; ``linear_bias``
    already includes them). Parameters only: bias adds are not counted as kernels."""
    qk_norm: bool = False
    """A norm of head_dim over each query and key head (Qwen3's q_norm / k_norm; default false).
    Parameters only (2 × head_dim per layer, in ``attention_params``), like MLA's latent norms:
    their activations and kernels are not modelled."""
    sliding_window: int | None = None
    """Keys a query of a windowed layer attends over, itself included (tokens; Hugging Face's
    ``sliding_window``, Megatron-Core's ``window_size`` = (sliding_window - 1, 0); default None:
    every layer attends over its whole causal context). A flash kernel (FlashAttention-2/3's
    ``window_size``, cuDNN's sliding-window mask) skips the tiles outside the band; the unfused
    (math) path computes every score and masks them, so its work is the full layer's."""
    full_attention_interval: int = 0
    """With ``sliding_window``: every k-th layer (layer i with i % k == k - 1) attends over the
    whole context and the others are windowed (gpt-oss: 2, windowed and full alternating from a
    windowed first layer; Gemma 3: 6); 0: every layer is windowed (Mistral-7B v0.1) (default 0)."""
    max_position_embeddings: int | None = None
    """Rows of a learned position table (tokens, default ``seq_len``; only with
    position_embedding "learned", e.g. GPT-2's n_positions)."""

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``ValueError("<field>: <problem>")`` if the architecture is impossible.

        Not called by the constructor; the scenario loader calls it.
        """
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "ffn_hidden_size",
            "vocab_size",
            "seq_len",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if self.num_kv_heads is not None:
            if self.num_kv_heads < 1:
                raise ValueError(f"num_kv_heads: must be >= 1, got {self.num_kv_heads}")
            if self.num_heads % self.num_kv_heads != 0:
                raise ValueError(
                    f"num_kv_heads: num_heads ({self.num_heads}) is not divisible by "
                    f"num_kv_heads ({self.num_kv_heads})"
                )
        if self.max_position_embeddings is not None:
            if self.max_position_embeddings < self.seq_len:
                raise ValueError(
                    f"max_position_embeddings: {self.max_position_embeddings} is shorter than "
                    f"seq_len ({self.seq_len})"
                )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window: must be >= 1 tokens, got {self.sliding_window}")
        if self.full_attention_interval < 0:
            raise ValueError(f"full_attention_interval: must be >= 0 (0: every layer windowed), got "
                             f"{self.full_attention_interval}")
        if self.full_attention_interval and self.sliding_window is None:
            raise ValueError("full_attention_interval: needs sliding_window (which layers of a windowed model attend "
                             "over the whole context)")
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"head_dim: must be >= 1, got {self.head_dim}")
        if self.head_dim is None and self.mla is None and self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"head_dim: hidden_size ({self.hidden_size}) is not divisible by num_heads "
                f"({self.num_heads}); set head_dim explicitly"
            )
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"mlp: {self.mlp!r} is not one of: swiglu, gelu")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"norm: {self.norm!r} is not one of: rmsnorm, layernorm")
        if self.position_embedding not in ("rope", "learned", "alibi", "none"):
            raise ValueError(
                f"position_embedding: {self.position_embedding!r} is not one of: rope, learned, alibi, none"
            )
        if self.moe is not None:
            try:
                self.moe.validate()
            except ValueError as exc:
                raise ValueError(f"moe.{exc}") from None
            if self.moe.first_dense_layers >= self.num_layers:
                raise ValueError(
                    f"moe.first_dense_layers: {self.moe.first_dense_layers} leaves no MoE layer "
                    f"in a {self.num_layers}-layer model"
                )
        if self.mla is not None:
            try:
                self.mla.validate()
            except ValueError as exc:
                raise ValueError(f"mla.{exc}") from None
            if self.linear_bias or self.qkv_bias:
                name = "linear_bias" if self.linear_bias else "qkv_bias"
                raise ValueError(f"{name}: biases are not modelled together with mla")
            if self.qk_norm:
                raise ValueError("qk_norm: not modelled together with mla")
            if self.num_kv_heads is not None and self.num_kv_heads != self.num_heads:
                raise ValueError(
                    "num_kv_heads: MLA decompresses K/V for every head; leave it unset "
                    f"or equal to num_heads ({self.num_heads})"
                )

    # ------------------------------------------------------------------ shapes
    @property
    def kv_heads(self) -> int:
        """Key/value heads (count)."""
        if self.mla is not None or self.num_kv_heads is None:
            return self.num_heads
        return self.num_kv_heads

    @property
    def head_dim_resolved(self) -> int:
        """Query/key size per head (elements); with MLA, qk_nope_head_dim + qk_rope_head_dim."""
        if self.mla is not None:
            return self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
        if self.head_dim is not None:
            return self.head_dim
        return self.hidden_size // self.num_heads

    @property
    def v_head_dim_resolved(self) -> int:
        """Value size per head (elements); equals head_dim_resolved except with MLA."""
        if self.mla is not None:
            return self.mla.v_head_dim
        return self.head_dim_resolved

    def _check_layer(self, i: int) -> None:
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range 0..{self.num_layers - 1}")

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` (0-based) has an MoE block instead of the dense MLP."""
        self._check_layer(i)
        if self.moe is None or i < self.moe.first_dense_layers:
            return False
        return (i - self.moe.first_dense_layers) % self.moe.moe_layer_interval == 0

    def layer_kind(self, i: int) -> Hashable:
        """What sets every per-layer quantity of layer ``i`` (its parameters, linears, stored
        activations, memory-bound bytes and kernels): two layers of one kind differ only in
        their index, so a per-layer cost computed for one serves the other: dense MLP versus
        MoE block, and the attention window."""
        return self.is_moe_layer(i), self.attention_window(i)

    def attention_window(self, i: int) -> int | None:
        """The keys each query of layer ``i`` attends over when the layer is windowed and its
        window is shorter than the sequence (``sliding_window``, ``full_attention_interval``);
        None: the whole causal context."""
        self._check_layer(i)
        w, k = self.sliding_window, self.full_attention_interval
        if w is None or w >= self.seq_len or (k and i % k == k - 1):
            return None
        return w

    @property
    def windowed(self) -> bool:
        """Whether any layer's attention is windowed (:meth:`attention_window`)."""
        return any(self.attention_window(i) is not None for i in range(self.num_layers))

    def attention_pairs_per_token(self, i: int, causal: bool = True, keys: float | None = None) -> float:
        """Query-key pairs per token of layer ``i``'s attention over a sequence of ``keys``
        tokens (default seq_len): s/2 causal, s not; windowed (w < s) causal: the band, w - w²/2s
        (each of the first w queries sees its prefix, every later one w keys), and w not."""
        s = self.seq_len if keys is None else keys
        return kernels.band_pairs_per_query(s, self.attention_window(i) or 0, causal)

    @property
    def num_moe_layers(self) -> int:
        """Layers with an MoE block (count)."""
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    # ------------------------------------------------------------------ parameters
    def _attention_matmul_params(self) -> int:
        h, a = self.hidden_size, self.num_heads
        if self.mla is not None:
            m = self.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            if m.q_lora_rank is None:
                q = h * a * qk
            else:
                q = h * m.q_lora_rank + m.q_lora_rank * a * qk
            kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * a * (
                m.qk_nope_head_dim + m.v_head_dim
            )
            return q + kv + a * m.v_head_dim * h
        d, kv_h = self.head_dim_resolved, self.kv_heads
        return h * a * d + 2 * h * kv_h * d + a * d * h  # Q, K, V, output projection

    def attention_matmul_params(self) -> int:
        """Attention GEMM weights (Q, K, V, output projection; MLA's projections), no biases."""
        return self._attention_matmul_params()

    def expert_matmul_params(self) -> int:
        """One routed expert's GEMM weights, no biases; 0 for a dense model."""
        return 0 if self.moe is None else self._mlp_matmul_params(self.moe.expert_ffn_hidden_size)

    def attention_params(self) -> int:
        """Attention block weights incl. biases and MLA's internal latent norms (elements);
        the pre-attention norm is in norm_params_per_layer()."""
        total = self._attention_matmul_params()
        if self.mla is not None:
            m = self.mla
            latent = m.kv_lora_rank + (m.q_lora_rank or 0)
            total += latent * (2 if self.norm_bias else 1)
        else:
            d = self.head_dim_resolved
            if self.linear_bias or self.qkv_bias:
                total += self.num_heads * d + 2 * self.kv_heads * d
            if self.linear_bias:
                total += self.hidden_size
            if self.qk_norm:
                total += 2 * d * (2 if self.norm_bias else 1)
        return total

    def _mlp_matmul_params(self, ffn: int) -> int:
        return (3 if self.mlp == "swiglu" else 2) * self.hidden_size * ffn

    def _mlp_params(self, ffn: int) -> int:
        total = self._mlp_matmul_params(ffn)
        if self.linear_bias:
            total += (2 if self.mlp == "swiglu" else 1) * ffn + self.hidden_size
        return total

    def dense_mlp_params(self) -> int:
        """Dense MLP weights incl. biases, ffn_hidden_size wide (elements)."""
        return self._mlp_params(self.ffn_hidden_size)

    def expert_params(self) -> int:
        """One routed expert's MLP (elements); 0 for a dense model."""
        return 0 if self.moe is None else self._mlp_params(self.moe.expert_ffn_hidden_size)

    def shared_expert_params(self) -> int:
        """One shared expert's MLP (elements; multiply by num_shared_experts); 0 for a dense model."""
        return 0 if self.moe is None else self._mlp_params(self.moe.shared_ffn_resolved)

    def _router_outputs(self) -> int:
        assert self.moe is not None
        return self.moe.num_experts + (1 if self.moe.shared_expert_gate else 0)

    def router_params(self) -> int:
        """Router (gate) weight h × num_experts, no bias, plus the shared-expert gate's h × 1
        when ``moe.shared_expert_gate`` (elements); 0 for a dense model."""
        return 0 if self.moe is None else self.hidden_size * self._router_outputs()

    def _norm_params(self) -> int:
        return self.hidden_size * (2 if self.norm_bias else 1)

    def norm_params_per_layer(self) -> int:
        """The two pre-norms of a layer (elements)."""
        return 2 * self._norm_params()

    def _ffn_params(self, i: int, active: bool) -> int:
        if not self.is_moe_layer(i):
            return self.dense_mlp_params()
        assert self.moe is not None
        routed = self.moe.top_k if active else self.moe.num_experts
        return (
            self.router_params()
            + routed * self.expert_params()
            + self.moe.num_shared_experts * self.shared_expert_params()
        )

    def layer_tensors(self, i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Parameter tensors of layer ``i`` in forward order, as (dense, expert) element counts;
        they add up to ``layer_params(i)``. Naming follows the usual model code: GPT-style
        (GELU) layers fuse Q, K and V into one weight as Megatron does; Llama-style (SwiGLU)
        layers keep q, k, v, gate and up separate as Hugging Face does. MLA counts its
        projections as one tensor. Frameworks that gather or reduce per tensor (DeepSpeed)
        issue one collective per entry."""
        h, ffn_bias = self.hidden_size, self.linear_bias
        norm = [h] * (2 if self.norm_bias else 1)
        dense: list[int] = list(norm)
        if self.mla is not None:
            dense.append(self.attention_params())
        else:
            d, a, kv = self.head_dim_resolved, self.num_heads, self.kv_heads
            qkv_bias = ffn_bias or self.qkv_bias
            if self.mlp == "gelu":
                dense.append(h * (a * d + 2 * kv * d))
                dense += [a * d + 2 * kv * d] if qkv_bias else []
            else:
                dense += [h * a * d, h * kv * d, h * kv * d]
                dense += [a * d, kv * d, kv * d] if qkv_bias else []
            dense += [d * len(norm)] * 2 if self.qk_norm else []  # q_norm, k_norm (scale, bias)
            dense.append(a * d * h)
            dense += [h] if ffn_bias else []
        dense += norm
        expert: list[int] = []

        def mlp(ffn: int) -> list[int]:
            ups = 2 if self.mlp == "swiglu" else 1
            out = [h * ffn] * ups + ([ffn] * ups if ffn_bias else []) + [ffn * h]
            return out + ([h] if ffn_bias else [])

        if not self.is_moe_layer(i):
            dense += mlp(self.ffn_hidden_size)
        else:
            assert self.moe is not None
            dense.append(self.router_params())
            for _ in range(self.moe.num_shared_experts):
                dense += mlp(self.moe.shared_ffn_resolved)
            for _ in range(self.moe.num_experts):
                expert += mlp(self.moe.expert_ffn_hidden_size)
        return tuple(dense), tuple(expert)

    def _mlp_linears(self, ffn: int) -> list[tuple[int, int, str]]:
        h = self.hidden_size
        ups = [(h, ffn, "column")] * (2 if self.mlp == "swiglu" else 1)
        return [*ups, (ffn, h, "row")]

    def layer_linears(self, i: int) -> dict[str, list[tuple[int, int, str]]]:
        """The GEMM weights one token of layer ``i`` goes through, as (in features K, out
        features N, tensor-parallel split) per block: ``attention``, ``mlp`` (the dense MLP, or
        the shared experts of an MoE layer), ``router`` and ``expert`` (one routed expert).
        Split follows Megatron's ColumnParallelLinear ("column": N is divided by t) and
        RowParallelLinear ("row": K is divided by t); the router is not split ("none"). The
        weights follow ``layer_tensors`` (GPT fuses Q, K, V; Llama keeps them apart). MLA's
        projections are all counted column-parallel except the output projection, as
        ``attention_matmul_params`` divides all of them by t. Per block, K·N summed over the
        entries equals the matmul parameter counts (``attention_matmul_params``,
        ``_mlp_matmul_params``, ``router_params``)."""
        h, a = self.hidden_size, self.num_heads
        attention: list[tuple[int, int, str]]
        if self.mla is not None:
            m = self.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            attention = [(h, a * qk, "column")] if m.q_lora_rank is None else [
                (h, m.q_lora_rank, "column"), (m.q_lora_rank, a * qk, "column")]
            attention += [(h, m.kv_lora_rank + m.qk_rope_head_dim, "column"),
                          (m.kv_lora_rank, a * (m.qk_nope_head_dim + m.v_head_dim), "column"),
                          (a * m.v_head_dim, h, "row")]
        else:
            d, kv = self.head_dim_resolved, self.kv_heads
            qkv = [(h, (a + 2 * kv) * d, "column")] if self.mlp == "gelu" else [
                (h, a * d, "column"), (h, kv * d, "column"), (h, kv * d, "column")]
            attention = [*qkv, (a * d, h, "row")]
        out: dict[str, list[tuple[int, int, str]]] = {"attention": attention, "mlp": [], "router": [], "expert": []}
        if not self.is_moe_layer(i):
            out["mlp"] = self._mlp_linears(self.ffn_hidden_size)
        else:
            assert self.moe is not None
            out["mlp"] = self._mlp_linears(self.moe.shared_ffn_resolved) * self.moe.num_shared_experts
            out["router"] = [(h, self._router_outputs(), "none")]
            out["expert"] = self._mlp_linears(self.moe.expert_ffn_hidden_size)
        return out

    def layer_params(self, i: int) -> int:
        """All parameters of layer ``i``: attention, norms, MLP or router + all experts (elements)."""
        return self.attention_params() + self.norm_params_per_layer() + self._ffn_params(i, False)

    def layer_active_params(self, i: int) -> int:
        """Parameters of layer ``i`` one token uses: attention, norms, router, top_k routed and
        all shared experts (elements)."""
        return self.attention_params() + self.norm_params_per_layer() + self._ffn_params(i, True)

    def embedding_params(self) -> int:
        """Token embedding table plus learned position table, if any (elements)."""
        total = self.vocab_size * self.hidden_size
        if self.position_embedding == "learned":
            total += self.position_table_rows * self.hidden_size
        return total

    @property
    def position_table_rows(self) -> int:
        """Rows of the learned position table: ``max_position_embeddings`` or seq_len (tokens)."""
        if self.max_position_embeddings is None:
            return self.seq_len
        return self.max_position_embeddings

    def head_params(self) -> int:
        """LM head (output projection) weight, no bias; 0 when tied (elements)."""
        return 0 if self.tied_embeddings else self.hidden_size * self.vocab_size

    def final_norm_params(self) -> int:
        """Norm after the last layer (elements)."""
        return self._norm_params()

    def _outside_layers_params(self) -> int:
        return self.embedding_params() + self.head_params() + self.final_norm_params()

    def num_params(self) -> int:
        """Total parameters (elements)."""
        return self._outside_layers_params() + sum(
            self.layer_params(i) for i in range(self.num_layers)
        )

    def num_active_params(self) -> int:
        """Parameters touched per token, embedding table included (the convention of the
        Mixtral and DeepSeek-V3 papers) (elements)."""
        return self._outside_layers_params() + sum(
            self.layer_active_params(i) for i in range(self.num_layers)
        )

    # ------------------------------------------------------------------ FLOPs
    def layer_matmul_params_active(self, i: int) -> int:
        """GEMM weights of layer ``i`` one token multiplies with: Q/K/V/O (or MLA
        projections), dense MLP or router + top_k routed + shared experts (elements)."""
        ffn: int
        if self.is_moe_layer(i):
            assert self.moe is not None
            ffn = (
                self.router_params()
                + self.moe.top_k * self._mlp_matmul_params(self.moe.expert_ffn_hidden_size)
                + self.moe.num_shared_experts
                * self._mlp_matmul_params(self.moe.shared_ffn_resolved)
            )
        else:
            ffn = self._mlp_matmul_params(self.ffn_hidden_size)
        return self._attention_matmul_params() + ffn

    def matmul_params_active_per_token(self) -> int:
        """PaLM Appendix B parameter basis: GEMM weights active per token, LM head included
        (even when tied), embedding lookup, norms and biases excluded (elements)."""
        return self.hidden_size * self.vocab_size + sum(
            self.layer_matmul_params_active(i) for i in range(self.num_layers)
        )

    def _attention_core_flops_per_token_per_key(self) -> int:
        # Q·K^T: 2·a·d_qk, probabilities·V: 2·a·d_v multiply-add FLOPs per (query, key) pair.
        return 2 * self.num_heads * (self.head_dim_resolved + self.v_head_dim_resolved)

    def model_flops_per_token(self, attention_keys: float | None = None) -> float:
        """PaLM model FLOPs per token (DESIGN §5 ``mfu``): 6·N_matmul + 12·l·a·d·s, i.e. three
        passes, full (non-causal) attention, no recompute. With MLA 12·a·d becomes
        6·a·(d_qk + d_v). ``attention_keys``: the keys a token attends over when documents
        of varying length are packed with per-document masks (default s = seq_len)."""
        keys = self.seq_len if attention_keys is None else attention_keys
        if not self.windowed:
            pairs = self.num_layers * keys
        else:  # a windowed layer's queries see their window (non-causal: w keys each)
            pairs = sum(self.attention_pairs_per_token(i, causal=False, keys=keys) for i in range(self.num_layers))
        return 6.0 * self.matmul_params_active_per_token() + 3.0 * (
            self._attention_core_flops_per_token_per_key() * pairs
        )

    def layer_forward_flops(self, i: int, num_tokens: int, causal: bool = True) -> dict[str, float]:
        """Forward FLOPs of layer ``i`` for ``num_tokens`` tokens, each attending over seq_len keys.

        ``gemm``: 2 × active matmul params × tokens (router included).
        ``attention``: score and value matmuls, 4·tokens·s·a·d (MLA: 2·tokens·s·a·(d_qk+d_v)),
        halved when ``causal`` (what a flash-attention kernel executes), over the window's band
        in a windowed layer (:meth:`attention_pairs_per_token`). Softmax, norms and
        element-wise ops are not counted. Backward = 2 × these.
        """
        attention = (
            float(num_tokens) * self.attention_pairs_per_token(i, causal) * self._attention_core_flops_per_token_per_key()
        )
        return {
            "gemm": 2.0 * self.layer_matmul_params_active(i) * num_tokens,
            "attention": attention,
        }

    def head_forward_flops(self, num_tokens: int) -> float:
        """LM head forward FLOPs, 2·h·V·tokens (backward = 2 × this)."""
        return 2.0 * self.hidden_size * self.vocab_size * num_tokens


    # ------------------------------------------------------------------ the model's other modules
    # their functions as methods (each takes the model first): recompute (checkpointing.py),
    # stored activations and memory-bound bytes (activations.py), eager dispatches (dispatch.py)
    op_sac_recomputed_linears = checkpointing.torchtitan_op_sac_recomputed_linears
    recompute_forward_flops = checkpointing.recompute_forward_flops
    activation_terms_per_token = activations.activation_terms_per_token
    elementwise_bytes_per_token = activations.elementwise_bytes_per_token
    activation_bytes_per_layer = activations.activation_bytes_per_layer
    layer_kernels_forward = dispatch.layer_kernels_forward
    norm_ops = dispatch.norm_ops
    layer_kernels_fused = dispatch.layer_kernels_fused

    def training_flops_per_token(
        self, recompute: RecomputeMode = "none", causal: bool = True
    ) -> float:
        """Hardware FLOPs per token of one training step: 3 × forward (forward + 2× backward)
        of every layer and the LM head, plus recompute. Causal=False, recompute="full" is the
        SC'21 basis; causal=False, recompute="none" is model_flops_per_token()."""
        total = 3.0 * self.head_forward_flops(1)
        for i in range(self.num_layers):
            fwd = self.layer_forward_flops(i, 1, causal)
            total += 3.0 * (fwd["gemm"] + fwd["attention"])
            total += self.recompute_forward_flops(i, 1, recompute, causal)
        return total

    # ------------------------------------------------------------------ report
    def summary(self) -> dict[str, object]:
        """Plain-data description for the CLI (counts in elements, FLOPs per token)."""
        if self.mla is not None:
            attention = "mla"
        else:
            attention = "mha" if self.kv_heads == self.num_heads else "gqa"
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.kv_heads,
            "head_dim": self.head_dim_resolved,
            "ffn_hidden_size": self.ffn_hidden_size,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "mlp": self.mlp,
            "attention": attention,
            "num_moe_layers": self.num_moe_layers,
            "num_experts": self.moe.num_experts if self.moe else 0,
            "top_k": self.moe.top_k if self.moe else 0,
            "num_params": self.num_params(),
            "num_active_params": self.num_active_params(),
            "num_embedding_params": self.embedding_params(),
            "matmul_params_active_per_token": self.matmul_params_active_per_token(),
            "model_flops_per_token": self.model_flops_per_token(),
        }
