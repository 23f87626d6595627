"""Measure, on one GPU, what the CPU box cannot: the rates hzpsim's compute model assumes and the
caching allocator's peaks on a real model. Writes one JSON file; ``docs/gpu-measurements.md``
compares it with the simulator.

    python benchmarks/gpu_probe.py --out probe.json                 # a CUDA machine, ~5 min on an H100
    python benchmarks/gpu_probe.py --out probe.json --smoke         # tiny shapes, any machine (a test of this script)

Sections (each timed with CUDA events: warm-up, then the median of repeated runs over two
alternating input sets, so a repeat does not find its inputs in L2):

- ``gemm``: bf16 ``torch.matmul`` at the linear layers' shapes of Llama-3-8B, Llama-3-70B and
  GPT-3 175B (tokens = micro-batch x sequence) for TP 1/2/4/8, each as forward (M,N,K), input
  gradient (M,K,N) and weight gradient (K,N,M);
- ``attention``: ``scaled_dot_product_attention`` forward and forward+backward, causal and not,
  with the flash and cuDNN backends, head dim 128, 32 heads, at 2k/4k/8k/16k sequences;
- ``grouped_gemm``: ``torch._grouped_mm`` (the grouped kernel torchtitan's MoE calls) and a loop of
  one ``torch.mm`` per expert (Megatron-Core's ``SequentialMLP``), forward and forward+backward, at
  the expert shapes of Mixtral-8x7B, Qwen3-30B-A3B, Qwen3-235B-A22B, DeepSeek-V3 and gpt-oss-120b
  with several expert-parallel sizes (tokens per expert = tokens x top-k / local experts, balanced;
  one imbalanced case);
- ``memory_bound``: device copy, RMSNorm, SwiGLU, softmax, residual add and a fused AdamW step,
  each as achieved bytes/s of the fewest bytes it must move;
- ``memtrack``: ``hzpsim.validation.memory.rows(("cuda",), ...)``: the executor's strategies at the
  Llama-3-8B shape on real CUDA tensors (rank 0 of 8 on a fake process group): PyTorch's tracker,
  the allocator's allocated and reserved peaks, and the simulator's prediction.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BF16 = torch.bfloat16


def _timer(device: torch.device) -> Callable[[Callable[[], Any], int, int], float]:
    """Median seconds of ``fn`` over ``reps`` runs after ``warmup`` runs."""
    if device.type == "cuda":
        def timed(fn: Callable[[], Any], warmup: int, reps: int) -> float:
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)
    else:
        def timed(fn: Callable[[], Any], warmup: int, reps: int) -> float:
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times)
    return timed


# --------------------------------------------------------------------------- shapes

MODELS = {  # hidden, heads, kv heads, head dim, ffn (SwiGLU: fc1 is 2 x ffn), vocab
    "llama3-8b": (4096, 32, 8, 128, 14336, 128256),
    "llama3-70b": (8192, 64, 8, 128, 28672, 128256),
    "gpt3-175b": (12288, 96, 96, 128, 49152, 51200),  # GELU MLP: fc1 is 1 x ffn
}

MOE = {  # hidden, expert ffn, experts, top-k, expert-parallel sizes
    "mixtral-8x7b": (4096, 14336, 8, 2, (1, 8)),
    "qwen3-30b-a3b": (2048, 768, 128, 8, (1, 8, 16)),
    "qwen3-235b-a22b": (4096, 1536, 128, 8, (8, 16, 32)),
    "deepseek-v3": (7168, 2048, 256, 8, (8, 32, 64)),
    "gpt-oss-120b": (2880, 2880, 128, 4, (8, 32)),
}


def linear_shapes(tokens: int, smoke: bool) -> list[dict[str, Any]]:
    """(M, N, K) of each linear layer's forward GEMM per model and TP size."""
    out = []
    for name, (h, heads, kv, d, ffn, vocab) in MODELS.items():
        swiglu = name != "gpt3-175b"
        for tp in (1, 2, 4, 8):
            if name == "gpt3-175b" and tp < 4:
                continue
            layers = {
                "qkv": (tokens, (heads + 2 * kv) * d // tp, h),
                "proj": (tokens, h, heads * d // tp),
                "fc1": (tokens, (2 if swiglu else 1) * ffn // tp, h),
                "fc2": (tokens, h, ffn // tp),
                "logits": (tokens, vocab // tp, h),
            }
            for layer, (m, n, k) in layers.items():
                if smoke:
                    m, n, k = 64, max(16, n // 256), max(16, k // 256)
                out.append({"model": name, "tp": tp, "layer": layer, "m": m, "n": n, "k": k})
        if smoke:
            break
    return out


def bench_gemm(device: torch.device, timed, tokens: int, smoke: bool, dtype: torch.dtype) -> list[dict[str, Any]]:
    rows = []
    for shape in linear_shapes(tokens, smoke):
        m, n, k = shape["m"], shape["n"], shape["k"]
        for phase, (a_rows, inner, b_cols) in (("fwd", (m, k, n)), ("dgrad", (m, n, k)), ("wgrad", (k, m, n))):
            sets = [(torch.randn(a_rows, inner, device=device, dtype=dtype),
                     torch.randn(inner, b_cols, device=device, dtype=dtype)) for _ in range(2)]
            state = {"i": 0}

            def run(sets=sets, state=state) -> None:
                a, b = sets[state["i"] % 2]
                state["i"] += 1
                torch.matmul(a, b)

            seconds = timed(run, 3, 10 if smoke else 20)
            flops = 2.0 * a_rows * inner * b_cols
            rows.append({**shape, "phase": phase, "gemm_mnk": [a_rows, b_cols, inner], "seconds": seconds,
                         "tflops": flops / seconds / 1e12})
            del sets
    return rows


def bench_attention(device: torch.device, timed, smoke: bool) -> list[dict[str, Any]]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION} if device.type == "cuda" \
        else {"math": SDPBackend.MATH}
    heads, d = (32, 128) if not smoke else (2, 16)
    rows = []
    for seq in ((2048, 4096, 8192, 16384) if not smoke else (64, 128)):
        batch = max(1, 16384 // seq) if not smoke else 1
        for causal in (True, False):
            for name, backend in backends.items():
                q, k, v = (torch.randn(batch, heads, seq, d, device=device, dtype=BF16, requires_grad=True)
                           for _ in range(3))
                grad = torch.randn(batch, heads, seq, d, device=device, dtype=BF16)
                try:
                    with sdpa_kernel([backend]):
                        def fwd(q=q, k=k, v=v, causal=causal) -> None:
                            with torch.no_grad():
                                F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                        def fwd_bwd(q=q, k=k, v=v, causal=causal, grad=grad) -> None:
                            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            torch.autograd.grad(out, (q, k, v), grad)

                        t_fwd = timed(fwd, 3, 10)
                        t_all = timed(fwd_bwd, 3, 10)
                except Exception as exc:  # a backend that does not take this shape
                    rows.append({"backend": name, "seq": seq, "batch": batch, "causal": causal,
                                 "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                dense_fwd_flops = 4.0 * batch * heads * seq * seq * d  # QK^T and PV, no mask
                rows.append({"backend": name, "seq": seq, "batch": batch, "heads": heads, "head_dim": d,
                             "causal": causal, "fwd_s": t_fwd, "fwd_bwd_s": t_all, "bwd_s": t_all - t_fwd,
                             "bwd_over_fwd": (t_all - t_fwd) / t_fwd,
                             "fwd_tflops_dense_count": dense_fwd_flops / t_fwd / 1e12,
                             "fwd_tflops_effective": dense_fwd_flops * (0.5 if causal else 1.0) / t_fwd / 1e12,
                             "bwd_tflops_effective_2p5x": 2.5 * dense_fwd_flops * (0.5 if causal else 1.0)
                             / (t_all - t_fwd) / 1e12})
    return rows


def _offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([sum(counts[: i + 1]) for i in range(len(counts))], device=device, dtype=torch.int32)


def bench_grouped(device: torch.device, timed, tokens: int, smoke: bool) -> list[dict[str, Any]]:
    rows = []
    for name, (h, ffn, experts, topk, eps) in MOE.items():
        for ep in eps:
            local = experts // ep
            received = tokens * topk  # tokens a rank computes when routing is balanced
            cases = [("balanced", [received // local] * local)]
            if local >= 4:  # the busiest expert with 2x its share, the rest share what is left
                busy = 2 * received // local
                rest = (received - busy) // (local - 1)
                cases.append(("one_expert_2x", [busy] + [rest] * (local - 1)))
            for label, counts in cases:
                counts = [max(16, (c // 16) * 16) for c in counts]
                hh, ff = (h, ffn) if not smoke else (64, 32)
                if smoke:
                    counts = [32] * min(local, 4)
                total = sum(counts)
                e = len(counts)
                x = torch.randn(total, hh, device=device, dtype=BF16, requires_grad=True)
                w1 = torch.randn(e, 2 * ff, hh, device=device, dtype=BF16, requires_grad=True)  # gate+up
                w2 = torch.randn(e, hh, ff, device=device, dtype=BF16, requires_grad=True)
                offs = _offsets(counts, device)
                mid_grad = torch.randn(total, hh, device=device, dtype=BF16)

                def grouped(train: bool, x=x, w1=w1, w2=w2, offs=offs, mid_grad=mid_grad) -> Callable[[], None]:
                    def run() -> None:
                        with torch.set_grad_enabled(train):
                            a = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
                            g, u = a.chunk(2, dim=-1)
                            y = torch._grouped_mm((torch.nn.functional.silu(g) * u).contiguous(),
                                                  w2.transpose(-2, -1), offs=offs)
                            if train:
                                torch.autograd.grad(y, (x, w1, w2), mid_grad)
                    return run

                # one parameter pair per expert, as SequentialMLP's separate modules hold them (indexing
                # one stacked tensor would make autograd write a whole-tensor zero gradient per expert)
                w1s = [torch.randn(2 * ff, hh, device=device, dtype=BF16, requires_grad=True) for _ in range(e)]
                w2s = [torch.randn(hh, ff, device=device, dtype=BF16, requires_grad=True) for _ in range(e)]

                def sequential(train: bool, x=x, w1s=w1s, w2s=w2s, counts=counts,
                               mid_grad=mid_grad) -> Callable[[], None]:
                    def run() -> None:
                        with torch.set_grad_enabled(train):
                            outs = []
                            for i, chunk in enumerate(torch.split(x, counts)):
                                a = chunk @ w1s[i].t()
                                g, u = a.chunk(2, dim=-1)
                                outs.append((torch.nn.functional.silu(g) * u) @ w2s[i].t())
                            y = torch.cat(outs)
                            if train:
                                torch.autograd.grad(y, (x, *w1s, *w2s), mid_grad)
                    return run

                gemm_flops = 2.0 * total * hh * 3 * ff  # fc1 (2 ffn) + fc2 (ffn), forward
                row: dict[str, Any] = {"model": name, "ep": ep, "local_experts": e, "case": label,
                                       "tokens_per_expert": counts, "hidden": hh, "ffn": ff,
                                       "forward_gemm_flops": gemm_flops}
                for kind, make in (("grouped", grouped), ("sequential", sequential)):
                    for train in (False, True):
                        key = f"{kind}_{'fwd_bwd' if train else 'fwd'}"
                        try:
                            seconds = timed(make(train), 2, 5 if smoke else 10)
                        except Exception as exc:
                            row[key + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
                            continue
                        row[key + "_s"] = seconds
                        row[key + "_tflops"] = gemm_flops * (3 if train else 1) / seconds / 1e12
                if device.type == "cuda" and FP8 is not None and label == "balanced":
                    _grouped_fp8(row, timed, x.detach(), w1.detach(), w2.detach(), offs, smoke)
                rows.append(row)
            if smoke:
                break
        if smoke:
            break
    return rows


def _grouped_fp8(row: dict[str, Any], timed, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 offs: torch.Tensor, smoke: bool) -> None:
    """fc1 and fc2 of the experts as ``torch._scaled_grouped_mm`` (e4m3, row-wise scales: the
    fp8 grouped kernel torchao's MoE training calls), forward; into ``row``."""
    try:
        xq = x.to(FP8)
        w1q, w2q = w1.to(FP8), w2.to(FP8)
        sx = torch.ones(x.shape[0], device=x.device, dtype=torch.float32)
        s1 = torch.ones(w1.shape[0], w1.shape[1], device=x.device, dtype=torch.float32)
        s2 = torch.ones(w2.shape[0], w2.shape[1], device=x.device, dtype=torch.float32)
        mid = torch.randn(x.shape[0], w2.shape[2], device=x.device, dtype=BF16).to(FP8)

        def run() -> None:
            torch._scaled_grouped_mm(xq, w1q.transpose(-2, -1), sx, s1, offs=offs, out_dtype=BF16)
            torch._scaled_grouped_mm(mid, w2q.transpose(-2, -1), sx, s2, offs=offs, out_dtype=BF16)

        seconds = timed(run, 2, 5 if smoke else 10)
        row["grouped_fp8_fwd_s"] = seconds
        row["grouped_fp8_fwd_tflops"] = row["forward_gemm_flops"] / seconds / 1e12
    except Exception as exc:
        row["grouped_fp8_fwd_error"] = f"{type(exc).__name__}: {exc}"[:300]


def bench_memory_bound(device: torch.device, timed, smoke: bool) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    rows = []
    n = (1 << 28) if not smoke else (1 << 16)  # 256 Mi elements
    tokens, h = (8192, 8192) if not smoke else (64, 64)

    def add(name: str, fn: Callable[[], Any], nbytes: float) -> None:
        seconds = timed(fn, 3, 10)
        rows.append({"op": name, "seconds": seconds, "bytes": nbytes, "gb_per_s": nbytes / seconds / 1e9})

    a, b = torch.empty(n, device=device, dtype=BF16).normal_(), torch.empty(n, device=device, dtype=BF16)
    add("copy_bf16", lambda: b.copy_(a), 2 * 2 * n)
    x = torch.randn(tokens, h, device=device, dtype=BF16)
    w = torch.ones(h, device=device, dtype=BF16)
    res = torch.randn(tokens, h, device=device, dtype=BF16)
    add("rms_norm_fwd", lambda: F.rms_norm(x, (h,), w), 2 * 2 * tokens * h)
    add("layer_norm_fwd", lambda: F.layer_norm(x, (h,), w), 2 * 2 * tokens * h)
    add("residual_add", lambda: x + res, 3 * 2 * tokens * h)
    add("softmax_fwd", lambda: torch.softmax(x, dim=-1), 2 * 2 * tokens * h)
    gate = torch.randn(tokens, 2 * h, device=device, dtype=BF16)
    add("swiglu_fwd", lambda: F.silu(gate[:, :h]) * gate[:, h:], 3 * 2 * tokens * h)
    params = (1 << 27) if not smoke else (1 << 12)  # 134M fp32 parameters
    p = torch.nn.Parameter(torch.randn(params, device=device))
    p.grad = torch.randn(params, device=device)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW([p], lr=1e-4, fused=fused) if fused else torch.optim.AdamW([p], lr=1e-4)
    opt.step()
    # fused AdamW reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 7 x 4 bytes
    add("adamw_fused_step_fp32" if fused else "adamw_step_fp32", opt.step, 7 * 4 * params)
    return rows


FP8 = getattr(torch, "float8_e4m3fn", None)


def _to_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaled e4m3 copy of ``t`` and its inverse scale (Transformer Engine's delayed
    scaling keeps one such scale per tensor)."""
    amax = t.abs().max().float().clamp(min=1e-12)
    scale = 448.0 / amax
    return (t.float() * scale).to(FP8), (1.0 / scale).reshape(())


def bench_gemm_fp8(device: torch.device, timed, tokens: int, smoke: bool) -> list[dict[str, Any]]:
    """``torch._scaled_mm`` (the e4m3 GEMM Transformer Engine and torchao call; per-tensor scales,
    bf16 output) at the same linear shapes as ``gemm``, forward only, and the cast that precedes
    it (amax + scale + cast of the activation, as one eager sequence)."""
    if FP8 is None or device.type != "cuda":
        return [{"error": "no float8 dtype or no CUDA device"}]
    rows = []
    for shape in linear_shapes(tokens, smoke):
        if shape["tp"] not in (1, 8):  # the two ends of the TP range keep the section short
            continue
        m, n, k = shape["m"], shape["n"], shape["k"]
        n16, k16 = max(16, n // 16 * 16), max(16, k // 16 * 16)
        sets = []
        for _ in range(2):
            a, sa = _to_fp8(torch.randn(m, k16, device=device, dtype=BF16))
            w, sw = _to_fp8(torch.randn(n16, k16, device=device, dtype=BF16))
            sets.append((a, w.t(), sa, sw))  # b column-major, as _scaled_mm requires
        state = {"i": 0}

        def run(sets=sets, state=state) -> None:
            a, b, sa, sb = sets[state["i"] % 2]
            state["i"] += 1
            torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=BF16)

        row: dict[str, Any] = {**shape, "phase": "fwd", "gemm_mnk": [m, n16, k16]}
        try:
            seconds = timed(run, 3, 10 if smoke else 20)
            row.update(seconds=seconds, tflops=2.0 * m * n16 * k16 / seconds / 1e12)
            a, b, sa, sb = sets[0]
            fast = timed(lambda a=a, b=b, sa=sa, sb=sb: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=BF16,
                                                                        use_fast_accum=True), 3, 10 if smoke else 20)
            row.update(fast_accum_seconds=fast, fast_accum_tflops=2.0 * m * n16 * k16 / fast / 1e12)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        if shape["layer"] == "fc1":  # the activation's cast: amax, scale, cast (what TE fuses into one kernel)
            x = torch.randn(m, k16, device=device, dtype=BF16)
            row["cast_s"] = timed(lambda x=x: _to_fp8(x), 3, 10)
            row["cast_bytes_min"] = m * k16 * 3  # read bf16, write e4m3
        rows.append(row)
        del sets
    return rows


def _moe_kernel_row(device: torch.device, timed, name: str, h: int, experts: int, topk: int, tokens: int,
                    smoke: bool) -> dict[str, Any]:
    """One model's row of :func:`bench_moe_kernels`."""
    t, hh = (tokens, h) if not smoke else (64, 64)
    x = torch.randn(t, hh, device=device, dtype=BF16, requires_grad=True)
    wg = torch.randn(experts, hh, device=device, dtype=BF16, requires_grad=True)
    sigmoid = name == "deepseek-v3"

    def router(x=x, wg=wg, sigmoid=sigmoid, topk=topk) -> tuple[torch.Tensor, torch.Tensor]:
        logits = (x @ wg.t()).float()
        scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
        probs, idx = torch.topk(scores, topk, dim=-1)
        return probs, idx

    with torch.no_grad():
        probs0, idx0 = router()
    flat = idx0.reshape(-1)
    token_of = torch.arange(t, device=device).repeat_interleave(topk)

    def permute(x=x, flat=flat, token_of=token_of) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort(flat, stable=True)
        return x.index_select(0, token_of[order]), order

    def unpermute(y: torch.Tensor, order: torch.Tensor, probs: torch.Tensor, token_of=token_of,
                  t=t, hh=hh) -> torch.Tensor:
        weighted = y * probs.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros(t, hh, device=y.device, dtype=y.dtype).index_add_(0, token_of[order], weighted)

    row: dict[str, Any] = {"model": name, "tokens": t, "hidden": hh, "experts": experts, "top_k": topk}
    try:
        with torch.no_grad():
            row["router_fwd_s"] = timed(router, 3, 10)
            permuted, order = permute()
            row["permute_fwd_s"] = timed(permute, 3, 10)
            row["unpermute_fwd_s"] = timed(lambda: unpermute(permuted, order, probs0), 3, 10)
        y = permuted.detach().requires_grad_(True)
        probs = probs0.detach().requires_grad_(True)
        grad = torch.randn(t, hh, device=device, dtype=BF16)

        def all_fwd_bwd() -> None:
            p, _ = router()
            perm, o = permute()
            out = unpermute(perm, o, p)
            torch.autograd.grad(out, (x, wg), grad)

        def unpermute_fwd_bwd() -> None:
            out = unpermute(y, order, probs)
            torch.autograd.grad(out, (y, probs), grad)

        row["router_permute_unpermute_fwd_bwd_s"] = timed(all_fwd_bwd, 3, 10)
        row["unpermute_fwd_bwd_s"] = timed(unpermute_fwd_bwd, 3, 10)
        row["permute_min_bytes"] = t * (1 + topk) * hh * 2  # read each token, write its k copies
        row["router_logit_bytes"] = t * experts * (2 + 4 + 4) + t * topk * 12
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def bench_moe_kernels(device: torch.device, timed, tokens: int, smoke: bool) -> list[dict[str, Any]]:
    """The memory-bound parts of an MoE layer as Megatron-Core's ``moe_utils.py`` runs them
    unfused: the router (gating GEMM to E logits, softmax or sigmoid in fp32, top-k), the
    permutation (argsort of the expert ids, gather of each token's k copies in expert order)
    and the un-permutation (scale by the routing probability, index_add back to token order),
    forward and forward+backward, at the models of ``MOE``."""
    rows = []
    for name, (h, _ffn, experts, topk, _eps) in MOE.items():
        rows.append(_moe_kernel_row(device, timed, name, h, experts, topk, tokens, smoke))
        if smoke:
            break
    return rows



def bench_unpermute(device: torch.device, timed, tokens: int, smoke: bool) -> list[dict[str, Any]]:
    """The un-permutation of an MoE layer four ways, forward, at the models of ``MOE``: the
    atomics Megatron-Core's unfused ``moe_utils.unpermute`` runs (``scatter_add_`` into a zeroed
    bf16 output), the same into fp32, ``index_add_``, and a gather of each token's k rows in
    token order summed with its probabilities (no atomics: what a fused un-permute kernel does)."""
    rows = []
    for name, (h, _ffn, experts, topk, _eps) in MOE.items():
        t, hh = (tokens, h) if not smoke else (64, 64)
        idx = torch.randint(0, experts, (t, topk), device=device)
        probs = torch.rand(t, topk, device=device, dtype=torch.float32)
        order = torch.argsort(idx.reshape(-1), stable=True)
        token_of = torch.arange(t, device=device).repeat_interleave(topk)[order]
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=device)
        y = torch.randn(t * topk, hh, device=device, dtype=BF16)
        p_sorted = probs.reshape(-1)[order].unsqueeze(-1).to(BF16)

        def scatter(dtype: torch.dtype, y=y, p_sorted=p_sorted, token_of=token_of, t=t, hh=hh):
            def run() -> None:
                out = torch.zeros(t, hh, device=y.device, dtype=dtype)
                out.scatter_add_(0, token_of.unsqueeze(1).expand(-1, hh), (y * p_sorted).to(dtype))
            return run

        def index_add(y=y, p_sorted=p_sorted, token_of=token_of, t=t, hh=hh) -> None:
            torch.zeros(t, hh, device=y.device, dtype=y.dtype).index_add_(0, token_of, y * p_sorted)

        def gather_sum(y=y, inverse=inverse, probs=probs, t=t, hh=hh, k=topk) -> None:
            rows_in_token_order = y.index_select(0, inverse).view(t, k, hh)
            (rows_in_token_order * probs.unsqueeze(-1).to(y.dtype)).sum(dim=1)

        row: dict[str, Any] = {"model": name, "tokens": t, "hidden": hh, "top_k": topk,
                               "min_bytes": t * (topk + 1) * hh * 2}
        for label, fn in (("scatter_add_bf16", scatter(BF16)), ("scatter_add_fp32", scatter(torch.float32)),
                          ("index_add_bf16", index_add), ("gather_sum_bf16", gather_sum)):
            try:
                row[label + "_s"] = timed(fn, 3, 10)
            except Exception as exc:
                row[label + "_error"] = f"{type(exc).__name__}: {exc}"[:200]
        rows.append(row)
        if smoke:
            break
    return rows


def bench_launch(device: torch.device, smoke: bool) -> dict[str, Any]:
    """Host cost per eager op and per collective call, measured as the host's wall time to issue
    many of them back to back (tiny tensors, so the GPU is never the bottleneck), and the same
    kernels replayed from a CUDA graph."""
    n = 20000 if not smoke else 200
    out: dict[str, Any] = {"ops": n}
    x = torch.zeros(16, device=device)
    a = torch.randn(64, 64, device=device)

    def issue(fn: Callable[[], Any], count: int) -> float:
        for _ in range(200):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(count):
            fn()
        host = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.synchronize()
        return host / count

    out["add_inplace_s"] = issue(lambda: x.add_(1.0), n)
    out["mm_64_s"] = issue(lambda: torch.mm(a, a), n)
    out["silu_mul_s"] = issue(lambda: torch.nn.functional.silu(a) * a, n // 2)
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                x.add_(1.0)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for _ in range(1000):
                x.add_(1.0)
        graph.replay()
        torch.cuda.synchronize()
        start = time.perf_counter()
        reps = 10
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
        out["graph_add_per_kernel_s"] = (time.perf_counter() - start) / (reps * 1000)
    try:  # one collective call through c10d (NCCL on CUDA, gloo on CPU), world 1
        import os

        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
        y = torch.zeros(1024, device=device)
        out["collective_backend"] = backend
        out["all_reduce_call_s"] = issue(lambda: dist.all_reduce(y), n // 10)
        parts = [torch.zeros(1024, device=device)]
        out["all_gather_list_call_s"] = issue(lambda: dist.all_gather(parts, y), n // 10)
        big = torch.zeros(1024, device=device)
        out["all_gather_into_tensor_call_s"] = issue(lambda: dist.all_gather_into_tensor(big, y), n // 10)
        dist.destroy_process_group()
    except Exception as exc:
        out["collective_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def bench_sustained(device: torch.device, seconds: float, smoke: bool) -> dict[str, Any]:
    """A training step's GEMM mix run back to back for ``seconds``: Llama-3-70B at TP 8, 8,192
    tokens, each linear layer's forward, input-gradient and weight-gradient GEMM. Per window of
    ``seconds / 12``: the achieved TFLOP/s and (NVML) the SM clock, power and temperature, so the
    first window (a burst, as the other sections time) can be set against the last (the clock
    the power cap allows after a minute)."""
    h, heads, kv, d, ffn, _ = MODELS["llama3-70b"]
    tp, t = 8, 8192
    if smoke:
        h, heads, kv, ffn, t = 256, 8, 2, 512, 256
    shapes = [(t, (heads + 2 * kv) * d // tp, h), (t, h, heads * d // tp), (t, 2 * ffn // tp, h), (t, h, ffn // tp)]
    mats = []
    flops = 0.0
    for m, n, k in shapes:
        for a_rows, inner, b_cols in ((m, k, n), (m, n, k), (k, m, n)):
            mats.append((torch.randn(a_rows, inner, device=device, dtype=BF16),
                         torch.randn(inner, b_cols, device=device, dtype=BF16)))
            flops += 2.0 * a_rows * inner * b_cols
    nvml = None
    try:
        import pynvml

        pynvml.nvmlInit()
        nvml = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device() if device.type == "cuda" else 0)
    except Exception:
        nvml = None

    def sample() -> dict[str, Any]:
        if nvml is None:
            return {}
        import pynvml

        return {"sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(nvml, pynvml.NVML_CLOCK_SM),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(nvml) / 1e3,
                "temperature_c": pynvml.nvmlDeviceGetTemperature(nvml, pynvml.NVML_TEMPERATURE_GPU)}

    windows = []
    window_s = seconds / 12
    end_all = time.perf_counter() + seconds
    while time.perf_counter() < end_all:
        start = time.perf_counter()
        count = 0
        while time.perf_counter() - start < window_s:
            for _ in range(5):
                for a, b in mats:
                    torch.matmul(a, b)
            count += 5
            if device.type == "cuda":
                torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        windows.append({"seconds": elapsed, "passes": count, "tflops": flops * count / elapsed / 1e12, **sample()})
    return {"model": "llama3-70b", "tp": tp, "tokens": t, "flops_per_pass": flops, "windows": windows}


def _memtrack_one(name: str, seq_len: int, layers: int, smoke: bool) -> dict[str, Any]:
    """One strategy's memtrack run (a fresh process per strategy: a clean caching allocator).
    The weights' values do not matter to memory: the executor's deterministic CPU init is
    replaced by PyTorch's default init (its 40 s per 8 layers of Llama-3-8B were most of a run)."""
    import dataclasses

    from hzpsim.executor import memtrack
    from hzpsim.executor import model as tmodel

    tmodel.init_weights = lambda module, seed: None
    if smoke:
        model = memtrack.small(seq_len=64, layers=2, hidden=64, vocab=256)
        method = "cpu"
    else:
        model = dataclasses.replace(memtrack.llama3_8b(seq_len), num_layers=layers, name=f"llama3-8b-{layers}layers")
        method = "cuda"
    spec = memtrack.spec_for(name, model)
    start = time.perf_counter()
    measured = memtrack.measure(spec, method)
    return {"strategy": name, "model": model.name, "seq_len": seq_len, "layers": model.num_layers,
            "tracker": measured["peak_allocated_bytes"], "alloc": measured["cuda_allocator"],
            "by_category": measured["by_category"], "phase_peaks": measured["phase_peaks"],
            "seconds": measured["seconds"], "s": time.perf_counter() - start, "notes": measured["notes"],
            "segments": _segments() if method == "cuda" else None}


def _segments() -> dict[str, Any]:
    """Where the caching allocator's reserved memory sits after the run (it frees no segment
    back unless asked): per stream and segment pool, the segments' bytes, the bytes still
    allocated in them, and how many segments (``torch.cuda.memory_snapshot``)."""
    out: dict[str, Any] = {}
    for seg in torch.cuda.memory_snapshot():
        key = f"stream {seg.get('stream')} {seg.get('segment_type')}"
        entry = out.setdefault(key, {"reserved": 0, "allocated": 0, "segments": 0, "largest": 0})
        entry["reserved"] += int(seg["total_size"])
        entry["allocated"] += int(seg["allocated_size"])
        entry["segments"] += 1
        entry["largest"] = max(entry["largest"], int(seg["total_size"]))
    return out


def bench_memtrack_isolated(smoke: bool, seq_len: int, layers: int, work: Path,
                            strategies: tuple[str, ...] = ("zero", "hsdp", "nd", "asynchzp")) -> list[dict[str, Any]]:
    """:func:`_memtrack_one` for each of ``strategies``, each in its own process."""
    import subprocess

    rows: list[dict[str, Any]] = []
    for name in strategies:
        out = work / f"memtrack-{name}.json"
        cmd = [sys.executable, __file__, "--out", str(out), "--memtrack-one", name, "--seq-len", str(seq_len),
               "--layers", str(layers)] + (["--smoke"] if smoke else [])
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
            if done.returncode != 0 or not out.exists():
                rows.append({"strategy": name, "error": f"exit {done.returncode}", "stderr": done.stderr[-2500:]})
            else:
                rows.append(json.loads(out.read_text()))
        except subprocess.TimeoutExpired as exc:
            rows.append({"strategy": name, "error": "timeout 100 s", "stderr": str(exc.stderr)[-1500:]})
    return rows



def bench_memtrack(smoke: bool, seq_len: int) -> list[dict[str, Any]]:
    from hzpsim.validation import memory

    rows: list[dict[str, Any]] = []
    # asynchzp (2, 2, 4) at seq 2048 needs ~88 GiB by the simulator's count: a quarter of the
    # sequence keeps it inside an 80 GB H100
    plan = (("zero", seq_len), ("hsdp", seq_len), ("nd", seq_len), ("asynchzp", max(1, seq_len // 4)))
    for name, seq in plan:
        try:
            if smoke:
                from hzpsim.executor import memtrack

                spec = memtrack.spec_for(name, memtrack.small(), micro_batches=2)
                measured = memtrack.measure(spec, "cpu")
                rows.append({"strategy": name, "smoke": True, "peak": measured["peak_allocated_bytes"]})
            else:
                found = memory.rows(("cuda",), (name,), seq)
                for r in found:
                    r["seq_len"] = seq
                rows.extend(found)
        except Exception as exc:
            rows.append({"strategy": name, "seq_len": seq, "error": f"{type(exc).__name__}: {exc}"[:500],
                         "traceback": traceback.format_exc()[-2000:]})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


EXECUTOR_SCENARIO = {
    "name": "executor-cuda", "model": {"name": "exec-small", "num_layers": 4, "hidden_size": 128, "num_heads": 4,
                                       "num_kv_heads": 2, "ffn_hidden_size": 352, "vocab_size": 512, "seq_len": 64,
                                       "dropout": False},
    "training": {"global_batch_size": 4, "micro_batch_size": 1, "precision": "fp32", "grad_dtype": "fp32",
                 "activation_recompute": "none"},
    "cluster": {"preset": "local-cpu", "gpus_per_node": 1},
    "strategies": [{"name": "zero", "stage": 3}, {"name": "zero", "stage": 2},
                   {"name": "asynchzp", "param_group_size": 1, "grad_group_size": 1, "optim_group_size": 1}],
}
"""The executor's small model, one process: the strategies' code paths on CUDA through NCCL (one
GPU holds one rank; NCCL refuses two ranks on one device)."""


EXECUTOR_LLAMA_SCENARIO = {
    "name": "executor-cuda-llama3-8b-shape",
    "model": {"name": "llama3-8b-4layers-v32k", "num_layers": 4, "hidden_size": 4096, "num_heads": 32,
              "num_kv_heads": 8, "ffn_hidden_size": 14336, "vocab_size": 32000, "seq_len": 2048, "dropout": False,
              "norm": "rmsnorm", "mlp": "swiglu", "position_embedding": "rope", "linear_bias": False},
    "training": {"global_batch_size": 4, "micro_batch_size": 1, "precision": "fp32", "grad_dtype": "fp32",
                 "activation_recompute": "none"},
    "cluster": {"preset": "dgx-h200", "num_nodes": 1, "gpus_per_node": 1},
    "strategies": [{"name": "zero", "stage": 3}, {"name": "zero", "stage": 2}],
}
"""Llama-3-8B's layer shape (4 layers, a 32k vocabulary), one GPU, fp32 as the executor trains:
a measured step time at a real shape to set beside ``hzpsim run`` of the same scenario."""


def bench_executor(smoke: bool, work: Path, scenario_of: dict[str, Any] | None = None) -> Any:
    import subprocess

    import yaml

    scenario = work / "executor-cuda.yaml"
    scenario.write_text(yaml.safe_dump(scenario_of or EXECUTOR_SCENARIO))
    cmd = [sys.executable, "-m", "hzpsim.cli", "execute", str(scenario), "--world", "1", "--steps", "4",
           "--device", "cpu" if smoke else "cuda", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}", "stderr": done.stderr[-3000:]}
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write (rewritten after every section)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (checks this script on any machine)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per GEMM (micro-batch x sequence)")
    parser.add_argument("--sections", default="gemm,gemm_fp8,attention,grouped_gemm,moe_kernels,memory_bound,launch,"
                        "sustained,memtrack_isolated,executor")
    parser.add_argument("--seq-len", type=int, default=2048, help="memtrack's sequence length")
    parser.add_argument("--layers", type=int, default=8, help="memtrack_isolated: Llama-3-8B layers kept")
    parser.add_argument("--sustained-seconds", type=float, default=45.0, help="sustained: how long the GEMM mix runs")
    parser.add_argument("--memtrack-one", help=argparse.SUPPRESS)  # memtrack_isolated's child process
    parser.add_argument("--memtrack-strategies", default="zero,hsdp,nd,asynchzp", help="memtrack_isolated's strategies")
    args = parser.parse_args(argv)
    if args.memtrack_one:
        Path(args.out).write_text(json.dumps(_memtrack_one(args.memtrack_one, args.seq_len, args.layers, args.smoke),
                                             indent=1, sort_keys=True, default=str))
        return 0
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda" and not args.smoke:
        print("gpu_probe: no CUDA device (use --smoke to test the script)", file=sys.stderr)
        return 2
    timed = _timer(device)
    result: dict[str, Any] = {"env": {
        "torch": torch.__version__, "python": platform.python_version(), "device": str(device),
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "name": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "tokens": args.tokens, "smoke": args.smoke,
    }}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        result["env"].update(sm_count=props.multi_processor_count, memory_bytes=props.total_memory)
    out = Path(args.out)
    runs = {
        "gemm": lambda: bench_gemm(device, timed, args.tokens, args.smoke, BF16),
        "attention": lambda: bench_attention(device, timed, args.smoke),
        "grouped_gemm": lambda: bench_grouped(device, timed, args.tokens, args.smoke),
        "memory_bound": lambda: bench_memory_bound(device, timed, args.smoke),
        "memtrack": lambda: bench_memtrack(args.smoke, args.seq_len),
        "memtrack_isolated": lambda: bench_memtrack_isolated(args.smoke, args.seq_len, args.layers, out.parent,
                                                             tuple(args.memtrack_strategies.split(","))),
        "gemm_fp8": lambda: bench_gemm_fp8(device, timed, args.tokens, args.smoke),
        "moe_kernels": lambda: bench_moe_kernels(device, timed, args.tokens, args.smoke),
        "launch": lambda: bench_launch(device, args.smoke),
        "unpermute": lambda: bench_unpermute(device, timed, args.tokens, args.smoke),
        "sustained": lambda: bench_sustained(device, args.sustained_seconds if not args.smoke else 1.0, args.smoke),
        "executor": lambda: bench_executor(args.smoke, out.parent),
        "executor_llama": lambda: bench_executor(args.smoke, out.parent, EXECUTOR_LLAMA_SCENARIO if not args.smoke
                                                 else EXECUTOR_SCENARIO),
    }
    for section in [s.strip() for s in args.sections.split(",") if s.strip()]:
        if section not in runs:
            print(f"gpu_probe: unknown section {section!r} (known: {', '.join(runs)})", file=sys.stderr)
            return 2
        start = time.perf_counter()
        try:
            result[section] = runs[section]()
        except Exception as exc:
            result[section] = {"error": f"{type(exc).__name__}: {exc}"[:500], "traceback": traceback.format_exc()[-3000:]}
        result.setdefault("seconds", {})[section] = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out.write_text(json.dumps(result, indent=1, sort_keys=True, default=str))
        print(f"{section}: {result['seconds'][section]:.1f} s", flush=True)
    summary(result)
    return 0


def _rows(result: dict[str, Any], section: str) -> list[dict[str, Any]]:
    """A section's rows, or none when it failed (a dict with its error) or did not run."""
    rows = result.get(section)
    return rows if isinstance(rows, list) else []


def _rates(name: str, rows: list[dict[str, Any]]) -> None:
    if rows:
        rates = [r["tflops"] for r in rows]
        print(f"{name}: {len(rows)} shapes, TFLOP/s median {statistics.median(rates):.0f}, min {min(rates):.0f}, "
              f"max {max(rates):.0f}")


def summary(result: dict[str, Any]) -> None:
    """A short table of each section (the device reply shows only the end of the output)."""
    _rates("gemm", _rows(result, "gemm"))
    for r in _rows(result, "attention"):
        if "error" in r:
            print(f"attn {r['backend']} s={r['seq']} causal={r['causal']}: {r['error'][:80]}")
        else:
            print(f"attn {r['backend']:<5} s={r['seq']:>5} causal={r['causal']!s:<5} fwd {r['fwd_tflops_effective']:.0f} "
                  f"TF (dense count {r['fwd_tflops_dense_count']:.0f}) bwd/fwd {r['bwd_over_fwd']:.2f}")
    for r in _rows(result, "grouped_gemm"):
        g, s = r.get("grouped_fwd_tflops"), r.get("sequential_fwd_tflops")
        gb = r.get("grouped_fwd_bwd_tflops")
        print(f"moe {r['model']:<16} ep={r['ep']:<3} E={r['local_experts']:<3} {r['case']:<13} grouped "
              f"{'-' if g is None else f'{g:.0f}'} (+bwd {'-' if gb is None else f'{gb:.0f}'}) seq "
              f"{'-' if s is None else f'{s:.0f}'} TF")
    for r in _rows(result, "memory_bound"):
        print(f"mem {r['op']:<22} {r['gb_per_s']:.0f} GB/s")
    _rates("gemm_fp8", [r for r in _rows(result, "gemm_fp8") if "tflops" in r])
    for r in _rows(result, "gemm_fp8"):
        if "error" in r:
            print(f"gemm_fp8 {r.get('model')} {r.get('layer')}: {r['error'][:120]}")
    for r in _rows(result, "moe_kernels"):
        if "error" in r:
            print(f"moe_kernels {r['model']}: {r['error'][:120]}")
        else:
            print(f"moe_kernels {r['model']:<16} router {r['router_fwd_s'] * 1e3:.3f} ms permute "
                  f"{r['permute_fwd_s'] * 1e3:.3f} unpermute {r['unpermute_fwd_s'] * 1e3:.3f} all fwd+bwd "
                  f"{r['router_permute_unpermute_fwd_bwd_s'] * 1e3:.3f}")
    for r in _rows(result, "unpermute"):
        print(f"unpermute {r['model']:<16} " + " ".join(f"{k[:-2]} {v * 1e3:.3f} ms" for k, v in sorted(r.items())
                                                         if k.endswith("_s")))
    launch = result.get("launch")
    if isinstance(launch, dict):
        print("launch: " + ", ".join(f"{k} {v * 1e6:.2f} us" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in sorted(launch.items())))
    sustained = result.get("sustained")
    if isinstance(sustained, dict) and sustained.get("windows"):
        w = sustained["windows"]
        print("sustained TFLOP/s per window: " + " ".join(f"{x['tflops']:.0f}" for x in w)
              + f" | clock {w[0].get('sm_clock_mhz')}->{w[-1].get('sm_clock_mhz')} MHz, power "
              f"{w[0].get('power_w')}->{w[-1].get('power_w')} W")
    for r in _rows(result, "memtrack_isolated"):
        if "error" in r:
            print(f"memtrack {r['strategy']}: {r['error']} {r.get('stderr', '')[-400:]}")
        else:
            a = r.get("alloc") or {}
            print(f"memtrack {r['strategy']:<9} tracker {r['tracker'] / 2**30:.3f} GiB allocated "
                  f"{a.get('max_allocated_bytes', math.nan) / 2**30:.3f} reserved "
                  f"{a.get('max_reserved_bytes', math.nan) / 2**30:.3f} ({r['s']:.0f} s)")
            for key, seg in sorted((r.get("segments") or {}).items()):
                print(f"   {key}: reserved {seg['reserved'] / 2**30:.3f} GiB, allocated {seg['allocated'] / 2**30:.3f}, "
                      f"{seg['segments']} segments, largest {seg['largest'] / 2**20:.0f} MiB")
    runs = result.get("executor")
    if isinstance(runs, list):
        for r in runs:
            print(f"executor {r.get('label')}: loss diff vs reference {r.get('loss_max_abs_diff_vs_reference')}, "
                  f"peak {r.get('peak_memory_bytes')} ({r.get('peak_memory_method')}), step {r.get('step_time_s')}")
    elif isinstance(runs, dict):
        print(f"executor: {runs.get('error')} {str(runs.get('stderr', ''))[-300:]}")
    for r in _rows(result, "memtrack"):
        if "error" in r:
            print(f"memtrack {r['strategy']}: {r['error'][:200]}")
        elif "measured_peak_allocated_bytes" in r:
            alloc = r.get("cuda_allocator") or {}
            print(f"memtrack {r['strategy']:<9} seq {r.get('seq_len')}: tracker "
                  f"{r['measured_peak_allocated_bytes'] / 2**30:.2f} GiB, allocator "
                  f"{alloc.get('max_allocated_bytes', math.nan) / 2**30:.2f} / reserved "
                  f"{alloc.get('max_reserved_bytes', math.nan) / 2**30:.2f} GiB, predicted "
                  f"{r['predicted_peak_allocated_bytes'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    raise SystemExit(main())
