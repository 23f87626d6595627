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

                def sequential(train: bool, x=x, w1=w1, w2=w2, counts=counts,
                               mid_grad=mid_grad) -> Callable[[], None]:
                    def run() -> None:
                        with torch.set_grad_enabled(train):
                            outs = []
                            for i, chunk in enumerate(torch.split(x, counts)):
                                a = chunk @ w1[i].t()
                                g, u = a.chunk(2, dim=-1)
                                outs.append((torch.nn.functional.silu(g) * u) @ w2[i].t())
                            y = torch.cat(outs)
                            if train:
                                torch.autograd.grad(y, (x, w1, w2), mid_grad)
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
                rows.append(row)
            if smoke:
                break
        if smoke:
            break
    return rows


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


def bench_executor(smoke: bool, work: Path) -> Any:
    import subprocess

    import yaml

    scenario = work / "executor-cuda.yaml"
    scenario.write_text(yaml.safe_dump(EXECUTOR_SCENARIO))
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
    parser.add_argument("--sections", default="gemm,attention,grouped_gemm,memory_bound,executor,memtrack")
    parser.add_argument("--seq-len", type=int, default=2048, help="memtrack's sequence length")
    args = parser.parse_args(argv)
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
        "executor": lambda: bench_executor(args.smoke, out.parent),
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


def summary(result: dict[str, Any]) -> None:
    """A short table of each section (the device reply shows only the end of the output)."""
    gemm = result.get("gemm")
    if isinstance(gemm, list) and gemm:
        rates = [r["tflops"] for r in gemm]
        print(f"gemm: {len(gemm)} shapes, TFLOP/s median {statistics.median(rates):.0f}, min {min(rates):.0f}, "
              f"max {max(rates):.0f}")
    for r in result.get("attention", []) if isinstance(result.get("attention"), list) else []:
        if "error" in r:
            print(f"attn {r['backend']} s={r['seq']} causal={r['causal']}: {r['error'][:80]}")
        else:
            print(f"attn {r['backend']:<5} s={r['seq']:>5} causal={r['causal']!s:<5} fwd {r['fwd_tflops_effective']:.0f} "
                  f"TF (dense count {r['fwd_tflops_dense_count']:.0f}) bwd/fwd {r['bwd_over_fwd']:.2f}")
    for r in result.get("grouped_gemm", []) if isinstance(result.get("grouped_gemm"), list) else []:
        g, s = r.get("grouped_fwd_tflops"), r.get("sequential_fwd_tflops")
        gb = r.get("grouped_fwd_bwd_tflops")
        print(f"moe {r['model']:<16} ep={r['ep']:<3} E={r['local_experts']:<3} {r['case']:<13} grouped "
              f"{'-' if g is None else f'{g:.0f}'} (+bwd {'-' if gb is None else f'{gb:.0f}'}) seq "
              f"{'-' if s is None else f'{s:.0f}'} TF")
    for r in result.get("memory_bound", []) if isinstance(result.get("memory_bound"), list) else []:
        print(f"mem {r['op']:<22} {r['gb_per_s']:.0f} GB/s")
    runs = result.get("executor")
    if isinstance(runs, list):
        for r in runs:
            print(f"executor {r.get('label')}: loss diff vs reference {r.get('loss_max_abs_diff_vs_reference')}, "
                  f"peak {r.get('peak_memory_bytes')} ({r.get('peak_memory_method')}), step {r.get('step_time_s')}")
    elif isinstance(runs, dict):
        print(f"executor: {runs.get('error')} {str(runs.get('stderr', ''))[-300:]}")
    for r in result.get("memtrack", []) if isinstance(result.get("memtrack"), list) else []:
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
