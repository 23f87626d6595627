"""The executor's decoder transformer, built from :class:`hzpsim.model.Model` (dense and MoE).

Its units are the simulator's units: ``embed`` (token table, learned positions if any), one
``Block`` per layer (pre-norm attention with RoPE / GQA, pre-norm SwiGLU or GELU MLP, or an MoE
block: router, routed experts in a separate ``experts`` module, shared experts), and ``head``
(final norm + LM head). Parameter counts equal ``Model.embedding_params()``,
``Model.layer_params(i)`` and ``Model.head_params() + final_norm_params()`` exactly (checked by
tests). No dropout, so runs are deterministic. Try it::

    python -c "from hzpsim.executor.model import demo; demo()"
"""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from hzpsim.model import Model

_ROPE_CACHE: dict[tuple[int, int, str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def _rope_tables(seq: int, dim: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    key = (seq, dim, str(device), dtype)
    if key not in _ROPE_CACHE:
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
        emb = torch.cat([angles, angles], dim=-1)
        _ROPE_CACHE[key] = (emb.cos().to(device, dtype), emb.sin().to(device, dtype))
    return _ROPE_CACHE[key]


def _rotate(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (batch, heads, seq, head_dim)."""
    cos, sin = _rope_tables(x.shape[-2], x.shape[-1], x.device, x.dtype)
    return x * cos + _rotate(x) * sin


class Norm(nn.Module):
    """RMSNorm or LayerNorm with the Model's bias convention."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        h = model.hidden_size
        self.kind = model.norm
        self.weight = nn.Parameter(torch.ones(h))
        self.bias = nn.Parameter(torch.zeros(h)) if model.norm_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rmsnorm":
            out = F.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-5)
            return out + self.bias if self.bias is not None else out
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, eps=1e-5)


class Attention(nn.Module):
    """Multi-head / grouped-query attention; head counts are inferred from the (possibly
    tensor-parallel, local) projection sizes."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        h, d = model.hidden_size, model.head_dim_resolved
        bias = model.linear_bias
        self.head_dim = d
        self.rope = model.position_embedding == "rope"
        self.wq = nn.Linear(h, model.num_heads * d, bias=bias)
        self.wk = nn.Linear(h, model.kv_heads * d, bias=bias)
        self.wv = nn.Linear(h, model.kv_heads * d, bias=bias)
        self.wo = nn.Linear(model.num_heads * d, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = apply_rope(q), apply_rope(k)
        if k.shape[1] != q.shape[1]:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU (w1 gate, w3 up, w2 down) or GELU (w1, w2) MLP of width ``ffn``."""

    def __init__(self, model: Model, ffn: int) -> None:
        super().__init__()
        h, bias = model.hidden_size, model.linear_bias
        self.swiglu = model.mlp == "swiglu"
        self.w1 = nn.Linear(h, ffn, bias=bias)
        self.w3 = nn.Linear(h, ffn, bias=bias) if self.swiglu else None
        self.w2 = nn.Linear(ffn, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class Experts(nn.Module):
    """The routed experts of one MoE layer (sharded as their own unit, like the simulator's
    expert parameters)."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        assert model.moe is not None
        self.experts = nn.ModuleList(MLP(model, model.moe.expert_ffn_hidden_size) for _ in range(model.moe.num_experts))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x`` (tokens, h); ``index``/``weight`` (tokens, top_k): weighted sum of the chosen experts."""
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero(index == e, as_tuple=True)
            # every expert runs (possibly on zero tokens) so that every rank uses every parameter
            y = expert(x.index_select(0, token)) * weight[token, slot].unsqueeze(-1)
            out = out.index_add(0, token, y)
        return out


class MoE(nn.Module):
    """Router (softmax, top-k, renormalised), routed experts and shared experts."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        assert model.moe is not None
        self.top_k = model.moe.top_k
        self.router = nn.Linear(model.hidden_size, model.moe.num_experts, bias=False)
        self.experts = Experts(model)
        self.shared = nn.ModuleList(MLP(model, model.moe.shared_ffn_resolved) for _ in range(model.moe.num_shared_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(flat), dim=-1)
        weight, index = torch.topk(probs, self.top_k, dim=-1)
        weight = weight / weight.sum(dim=-1, keepdim=True)
        out = self.experts(flat, index, weight)
        for shared in self.shared:
            out = out + shared(flat)
        return out.view(shape)


class Block(nn.Module):
    """One transformer layer (one simulator unit ``layer<i>``)."""

    def __init__(self, model: Model, index: int) -> None:
        super().__init__()
        self.attention_norm = Norm(model)
        self.attention = Attention(model)
        self.ffn_norm = Norm(model)
        self.feed_forward: nn.Module = MoE(model) if model.is_moe_layer(index) else MLP(model, model.ffn_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Embed(nn.Module):
    """Token table (+ learned positions): the simulator's ``embed`` unit."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(model.vocab_size, model.hidden_size)
        self.pos_embeddings = nn.Embedding(model.position_table_rows, model.hidden_size) if model.position_embedding == "learned" else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        return x


class Head(nn.Module):
    """Final norm + LM head: the simulator's ``head`` unit."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        self.norm = Norm(model)
        self.output = nn.Linear(model.hidden_size, model.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


class Decoder(nn.Module):
    """embed -> layers -> head; ``units()`` lists them in the simulator's unit order."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        self.spec = model
        self.embed = Embed(model)
        self.layers = nn.ModuleList(Block(model, i) for i in range(model.num_layers))
        self.head = Head(model)

    def units(self) -> list[nn.Module]:
        return [self.embed, *self.layers, self.head]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def init_weights(module: nn.Module, seed: int) -> None:
    """Deterministic init, the same on every rank: N(0, 0.02) matrices and tables (output
    projections scaled by 1/sqrt(2 L)), ones for norm scales, zeros for biases."""
    gen = torch.Generator().manual_seed(seed)
    layers = getattr(getattr(module, "spec", None), "num_layers", 1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def build(model: Model, seed: int) -> Decoder:
    """The full model in fp32 on CPU, initialised from ``seed``."""
    net = Decoder(model)
    init_weights(net, seed)
    return net


def batch(model: Model, step: int, global_batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: (inputs, targets), each (global_batch_size, seq_len) int64.

    Tokens follow a fixed random bigram table plus noise, so the loss can fall below ln V."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    table = torch.randint(0, model.vocab_size, (model.vocab_size,), generator=torch.Generator().manual_seed(seed))
    start = torch.randint(0, model.vocab_size, (global_batch_size, 1), generator=gen)
    noise = torch.randint(0, model.vocab_size, (global_batch_size, model.seq_len + 1), generator=gen)
    keep = torch.rand((global_batch_size, model.seq_len + 1), generator=gen) < 0.75
    seq = [start[:, 0]]
    for t in range(1, model.seq_len + 1):
        seq.append(torch.where(keep[:, t], table[seq[-1]], noise[:, t]))
    tokens = torch.stack(seq, dim=1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def unit_param_counts(net: Decoder) -> list[int]:
    """Parameters per unit (elements), simulator unit order."""
    return [sum(p.numel() for p in u.parameters()) for u in net.units()]


def dispatched_ops(net: Decoder, tokens: torch.Tensor, targets: torch.Tensor) -> dict[str, Counter[str]]:
    """ATen ops eager PyTorch dispatches for one micro-batch: ``forward`` (the model and the
    cross-entropy loss) and ``backward`` (autograd's, gradient accumulation included), by op
    name, views and ``detach`` included (each is one dispatch). Counted with a
    ``TorchDispatchMode`` on a second pass (the first fills the RoPE table cache)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    out: dict[str, Counter[str]] = {}
    for _ in range(2):
        net.zero_grad(set_to_none=True)
        with Count() as forward:
            loss = F.cross_entropy(net(tokens).flatten(0, 1), targets.flatten())
        with Count() as backward:
            loss.backward()
        out = {"forward": forward.ops, "backward": backward.ops}
    return out


def demo() -> None:
    spec = Model(2, 64, 4, 128, 256, 32, name="demo", dropout=False)
    net = build(spec, 0)
    x, y = batch(spec, 0, 2, 0)
    loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
    print(f"units {unit_param_counts(net)}, loss {loss.item():.4f} (ln V = {math.log(spec.vocab_size):.4f})")
