"""hzpsim's compute and memory model against what ``benchmarks/gpu_probe.py`` measured on one GPU
(``docs/gpu-results/``); the tables of ``docs/gpu-measurements.md``.

    python benchmarks/compare_gpu_probe.py                       # the committed H100 files (2026-11-26)
    python benchmarks/compare_gpu_probe.py --h200                # the committed H200 files (2026-11-27)
    python benchmarks/compare_gpu_probe.py --probe F.json --memtrack A.json --memtrack B.json [--extra C.json]

Every predicted number is computed here from the device file the probe's GPU names (``h100-sxm``,
``h200``) and the active calibration profile; nothing predicted is read from the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

from hzpsim.hardware.compute import ComputeModel, efficiency_for
from hzpsim.hardware.devices import Device, device_file, load_device
from hzpsim.model.kernels import Attention

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "gpu-results"
H200 = {"probe": RESULTS / "h200-probe-2026-11-27.json", "memtrack": [RESULTS / "h200-memtrack-8layers-2026-11-27.json"],
        "extra": RESULTS / "h200-probe-unpermute-executor-2026-11-27.json"}
DEVICES = {"H200": ("h200", "dgx-h200"), "H100": ("h100-sxm", "dgx-h100")}
"""The device file and cluster preset of each GPU a probe names (the first key its name contains)."""
def device_of(probe: dict[str, Any]) -> tuple[str, str]:
    """(device file, cluster preset) of the GPU ``probe`` ran on."""
    name = str(probe.get("env", {}).get("name", ""))
    for key, found in DEVICES.items():
        if key in name:
            return found
    raise SystemExit(f"compare_gpu_probe: no device file for the probe's GPU {name!r} (known: {', '.join(DEVICES)})")


def _model(device: Device, prior_attention: bool = False, dtype: str = "bf16") -> ComputeModel:
    eff = efficiency_for(device)
    if prior_attention:
        eff = dataclasses.replace(eff, attention_fraction=1.0)
    return ComputeModel(device, dtype, eff)


def gemm_rows(probe: dict[str, Any], device: Device) -> list[dict[str, Any]]:
    model = _model(device)
    out = []
    for r in probe["gemm"]:
        m, n, k = r["gemm_mnk"]
        predicted = model.gemm_s(m, n, k)
        out.append({**r, "predicted_s": predicted, "ratio": predicted / r["seconds"]})
    return out


def fit_tile_overhead_k(probes: list[tuple[dict[str, Any], Device]]) -> dict[str, Any]:
    """The tile overhead (``compute.GEMM_TILE_OVERHEAD_K``) that makes the bf16 GEMM sweeps'
    predicted / measured times most alike, whatever their common scale (which the fitted
    ``gemm_sm_efficiency`` sets): the least spread of log(predicted / measured) over every
    shape of every probe, on a grid of 0-1,024 in steps of 32; and, for the K <= 1,536 shapes
    alone, the overhead each solves for against the K >= 4,096 shapes' median."""
    points = [(r["gemm_mnk"], r["seconds"], device) for probe, device in probes for r in probe["gemm"]]

    def logs(k0: float) -> list[float]:
        models: dict[str, ComputeModel] = {}
        out = []
        for (m, n, k), seconds, device in points:
            model = models.get(device.name)
            if model is None:
                model = models[device.name] = ComputeModel(device, "bf16", efficiency_for(device), tile_overhead_k=k0)
            out.append(math.log(model.gemm_s(m, n, k) / seconds))
        return out

    grid = {k0: statistics.pstdev(logs(k0)) for k0 in range(0, 1025, 32)}
    best = min(grid, key=lambda k0: (grid[k0], k0))
    base = logs(0.0)
    deep = statistics.median(math.exp(v) for v, ((_, _, k), _, _) in zip(base, points) if k >= 4096)
    # ratio(K) = deep · K / (K + k0) at the shallow shapes, solved for k0
    solved = sorted((k, round(k * (deep / math.exp(v) - 1))) for v, ((_, _, k), _, _) in zip(base, points) if k <= 1536)
    return {"best_k": best, "spread_at_best": grid[best], "spread_at_0": grid[0], "shallow_solved": solved,
            "deep_ratio_at_0": deep, "shapes": len(points)}


def attention_rows(probe: dict[str, Any], device: Device) -> list[dict[str, Any]]:
    fitted, prior = _model(device), _model(device, prior_attention=True)
    out = []
    for r in probe["attention"]:
        if "error" in r:
            continue
        kernel = {"flash": "flash2", "cudnn": "cudnn"}[r["backend"]]
        shape = Attention(heads=r["batch"] * r["heads"], seq_q=r["seq"], seq_kv=r["seq"], head_dim=r["head_dim"],
                          v_head_dim=r["head_dim"], causal=r["causal"], kernel=kernel)
        back = shape._replace(backward=True)
        out.append({**r, "kernel": kernel,
                    "predicted_fwd_s": fitted.attention_s(shape), "predicted_bwd_s": fitted.attention_s(back),
                    "prior_fwd_s": prior.attention_s(shape), "prior_bwd_s": prior.attention_s(back)})
    return out


def grouped_rows(probe: dict[str, Any], device: Device) -> list[dict[str, Any]]:
    """The forward of one MoE layer's expert MLP: fc1 (gate+up, 2 x ffn) and fc2, as hzpsim times
    them (``strategies._moe.expert_gemms``: the grouped kernel as one batched GEMM over the
    rank's tokens spread evenly over its experts, SequentialMLP as one GEMM per expert).
    hzpsim's imbalance is across EP ranks (the busiest rank's token count); within a rank the
    grouped kernel's tile scheduler spreads unequal experts over the SMs, which the
    ``one_expert_2x`` rows measure.

    The probe's forward also runs the eager SwiGLU between the two GEMMs (``silu`` of the gate,
    its product with ``up``), which hzpsim charges as 5 bytes per intermediate element
    (``activations.activation_fn_bytes_per_ffn``) at the memory-bound rate; the prediction
    includes it (``predicted_activation_fwd_s``), as the measurement does."""
    model = _model(device)
    hbm = device.memory_bytes_per_s * efficiency_for(device).hbm
    eager_swiglu = 5  # activations.activation_fn_bytes_per_ffn of an eager SwiGLU
    out = []
    for r in probe["grouped_gemm"]:
        counts, h, f, e = r["tokens_per_expert"], r["hidden"], r["ffn"], r["local_experts"]
        mean = sum(counts) / e  # the rank's tokens spread over its experts: what hzpsim charges
        activation = eager_swiglu * 2 * sum(counts) * f / hbm  # bf16 intermediate
        grouped = model.gemm_s(mean, 2 * f, h, batch=e) + model.gemm_s(mean, h, f, batch=e) + activation
        sequential = sum(model.gemm_s(c, 2 * f, h) + model.gemm_s(c, h, f) for c in counts) + activation
        out.append({**r, "predicted_grouped_fwd_s": grouped, "predicted_sequential_fwd_s": sequential,
                    "predicted_activation_fwd_s": activation})
    return out


def gemm_fp8_rows(probe: dict[str, Any], device: Device) -> list[dict[str, Any]]:
    """``torch._scaled_mm`` (e4m3) against the fp8 GEMM time hzpsim charges the same shape."""
    model, peak = _model(device, dtype="fp8"), device.peak_fp8_flops_per_s or math.nan
    out = []
    for r in probe.get("gemm_fp8", []):
        if "seconds" not in r:
            continue
        m, n, k = r["gemm_mnk"]
        predicted = model.gemm_s(m, n, k)
        out.append({**r, "fraction_of_fp8_peak": r["tflops"] * 1e12 / peak, "predicted_s": predicted,
                    "ratio": predicted / r["seconds"]})
    return out


def moe_kernel_rows(probe: dict[str, Any], extra: dict[str, Any], device: Device) -> list[dict[str, Any]]:
    """The router, permutation and un-permutation measured against what hzpsim charges them
    (``strategies._moe.moe_work``'s bytes and router GEMM, fused and eager), per 8,192 tokens."""
    from hzpsim.strategies import _moe

    model = _model(device)
    unpermute = {r["model"]: r for r in extra.get("unpermute", [])}
    out = []
    for r in probe.get("moe_kernels", []):
        if "error" in r:
            continue
        t, h, e, k = r["tokens"], r["hidden"], r["experts"], r["top_k"]
        router = model.gemm_s(t, e, h) + _moe.router_bytes(t, 2, e, k) / model._hbm_bytes_per_s
        fused = _moe.permute_bytes(t, 2, h, k) / model._hbm_bytes_per_s
        eager = _moe.UNFUSED_PERMUTE
        u = unpermute.get(r["model"], {})
        out.append({"model": r["model"], "router_s": r["router_fwd_s"], "router_charged_s": router,
                    "permute_s": r["permute_fwd_s"], "permute_fused_s": fused, "permute_eager_s": fused * eager.permute,
                    "unpermute_s": u.get("scatter_add_bf16_s", r["unpermute_fwd_s"]),
                    "unpermute_eager_s": fused * eager.unpermute, "gather_sum_s": u.get("gather_sum_bf16_s")})
    return out


def memory_bound_rows(probe: dict[str, Any], device: Device) -> list[dict[str, Any]]:
    rate = device.memory_bytes_per_s * efficiency_for(device).hbm
    return [{**r, "predicted_gb_per_s": rate / 1e9, "fraction_of_datasheet": r["gb_per_s"] * 1e9 / device.memory_bytes_per_s}
            for r in probe["memory_bound"]]


def memory_rows(files: list[Path], preset: str = "dgx-h100") -> list[dict[str, Any]]:
    """Each measured memtrack run against the simulator's allocated and reserved peaks of rank 0
    of the same scenario on a node of ``preset`` (the caching allocator replayed, its GEMM
    workspace in)."""
    from hzpsim.executor import memtrack
    from hzpsim.report import device_memory
    from hzpsim.run import resolve, simulate_choice
    from hzpsim.sim.engine import Trace
    from hzpsim.validation import memory

    out = []
    for path in files:
        for r in json.loads(path.read_text()):
            if "error" in r:
                out.append({"file": path.name, "strategy": r["strategy"], "error": r["error"]})
                continue
            layers = r.get("layers") or (8 if "8layers" in path.name else None)
            model = dataclasses.replace(memtrack.llama3_8b(r.get("seq_len", 2048)), num_layers=layers,
                                        name=f"llama3-8b-{layers}layers") if layers \
                else memtrack.small(seq_len=512, layers=4, hidden=512, vocab=32768)
            spec = memtrack.spec_for(r["strategy"], model)
            scenario = memory.scenario_of(spec, r["strategy"], {"preset": preset, "num_nodes": 1,
                                                                "gpus_per_node": spec.world_size})
            choice = scenario.strategies[0]
            traces: list[Trace] = []
            simulate_choice(scenario, resolve(scenario, choice.name, choice.config), traces=traces)
            sim = device_memory(traces[0])
            alloc = r["alloc"]
            out.append({"file": path.name, "strategy": r["strategy"], "model": model.name,
                        "tracker_bytes": r["tracker"], "allocated_bytes": alloc["max_allocated_bytes"],
                        "reserved_bytes": alloc["max_reserved_bytes"], "resident_bytes": alloc["resident_allocated_bytes"],
                        "predicted_allocated_bytes": sim["peak_memory_allocated_bytes"],
                        "predicted_reserved_bytes": sim["peak_memory_reserved_bytes"]})
    return out


def executor_rows(extra: dict[str, Any], preset: str) -> list[dict[str, Any]]:
    """``hzpsim execute`` of gpu_probe's Llama-shape scenario on the GPU against ``hzpsim run`` of
    the same scenario on one GPU of ``preset``, each strategy under the implementation profile
    of what the executor runs (``executor.spec.IMPLEMENTATIONS``: FSDP2 for ``zero``)."""
    import sys

    from hzpsim.executor.spec import IMPLEMENTATIONS
    from hzpsim.run import run_choice
    from hzpsim.scenario import scenario_from_mapping

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_probe import EXECUTOR_LLAMA_SCENARIO

    mapping = {**EXECUTOR_LLAMA_SCENARIO, "cluster": {"preset": preset, "num_nodes": 1, "gpus_per_node": 1},
               "strategies": [{**s, "implementation": IMPLEMENTATIONS[s["name"]]}
                              for s in EXECUTOR_LLAMA_SCENARIO["strategies"]]}
    scenario = scenario_from_mapping(mapping)
    predicted = [run_choice(scenario, c) for c in scenario.strategies]
    out = []
    runs = extra.get("executor_llama") if isinstance(extra.get("executor_llama"), list) else []
    for r, p in zip(runs, predicted, strict=False):  # the executor runs the strategies in the scenario's order
        out.append({"label": r["label"], "step_s": r["step_time_s"], "predicted_step_s": p["step_time_s"],
                    "peak_bytes": r["peak_memory_bytes"], "predicted_peak_allocated_bytes": p["peak_memory_allocated_bytes"],
                    "losses": r["losses"]})
    return out


def _sections(args: argparse.Namespace) -> tuple[dict[str, Any], list[Path], dict[str, Any]]:
    if args.h200:
        return (json.loads(H200["probe"].read_text()), list(H200["memtrack"]),  # type: ignore[arg-type]
                json.loads(H200["extra"].read_text()))  # type: ignore[union-attr]
    probe = json.loads(Path(args.probe).read_text())
    memtracks = [Path(p) for p in (args.memtrack or [RESULTS / "h100-memtrack-small-2026-11-26.json",
                                                      RESULTS / "h100-memtrack-8layers-2026-11-26.json"])]
    return probe, memtracks, json.loads(Path(args.extra).read_text()) if args.extra else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--probe", default=str(RESULTS / "h100-probe-2026-11-26.json"))
    parser.add_argument("--memtrack", action="append", help="memtrack result files (default: the committed two)")
    parser.add_argument("--extra", help="a second probe file (sections unpermute, executor_llama)")
    parser.add_argument("--h200", action="store_true", help="the committed H200 files of 2026-11-27")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--fit-k-overhead", action="store_true",
                        help="fit the GEMM tile overhead to the committed H100 and H200 sweeps and print it")
    args = parser.parse_args(argv)
    if args.fit_k_overhead:
        probes = []
        for path in (RESULTS / "h100-probe-2026-11-26.json", H200["probe"]):
            data = json.loads(Path(path).read_text())  # type: ignore[arg-type]
            probes.append((data, load_device(device_file(device_of(data)[0]))))
        print(json.dumps(fit_tile_overhead_k(probes), indent=1))
        return 0
    probe, memtracks, extra = _sections(args)
    name, preset = device_of(probe)
    device = load_device(device_file(name))
    tables = {"device": name, "gemm": gemm_rows(probe, device), "attention": attention_rows(probe, device),
              "grouped_gemm": grouped_rows(probe, device), "memory_bound": memory_bound_rows(probe, device),
              "memory": memory_rows(memtracks, preset), "gemm_fp8": gemm_fp8_rows(probe, device),
              "moe_kernels": moe_kernel_rows(probe, extra, device), "launch": probe.get("launch"),
              "sustained": probe.get("sustained"), "executor": executor_rows(extra, preset)}
    if args.json:
        print(json.dumps(tables, indent=1, sort_keys=True, default=str))
        return 0
    print_tables(tables)
    return 0


def print_tables(tables: dict[str, Any]) -> None:
    ratios = [r["ratio"] for r in tables["gemm"]]
    print(f"device file {tables['device']}")
    print(f"GEMM ({len(ratios)} shapes, bf16): predicted / measured time median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}")
    for tp in (1, 2, 4, 8):
        sel = [r for r in tables["gemm"] if r["tp"] == tp]
        print(f"  tp {tp}: measured {statistics.median(r['tflops'] for r in sel):.0f} TF median, predicted/measured "
              f"{statistics.median(r['ratio'] for r in sel):.3f}")
    if tables["gemm_fp8"]:
        f8 = tables["gemm_fp8"]
        print(f"\nfp8 GEMM ({len(f8)} shapes, torch._scaled_mm): measured {statistics.median(r['tflops'] for r in f8):.0f} TF "
              f"median ({min(r['tflops'] for r in f8):.0f}-{max(r['tflops'] for r in f8):.0f}), "
              f"{statistics.median(r['fraction_of_fp8_peak'] for r in f8):.3f} of the fp8 peak; predicted / measured "
              f"median {statistics.median(r['ratio'] for r in f8):.3f} ({min(r['ratio'] for r in f8):.3f}-"
              f"{max(r['ratio'] for r in f8):.3f})")
        for tp in (1, 8):
            sel = [r for r in f8 if r["tp"] == tp]
            if sel:
                print(f"  tp {tp}: measured {statistics.median(r['tflops'] for r in sel):.0f} TF, predicted/measured "
                      f"{statistics.median(r['ratio'] for r in sel):.3f}")
    print("\nattention (head dim 128): measured ms | predicted ms with the fitted fraction | with the kernel rates alone")
    print(f"{'kernel':<7}{'seq':>6} {'causal':<6} {'fwd':>7} {'bwd':>7} {'bwd/fwd':>7} | {'fwd':>7} {'bwd':>7} | "
          f"{'fwd':>7} {'bwd':>7} {'bwd/fwd':>7}")
    for r in tables["attention"]:
        print(f"{r['kernel']:<7}{r['seq']:>6} {r['causal']!s:<6} {r['fwd_s'] * 1e3:7.2f} {r['bwd_s'] * 1e3:7.2f} "
              f"{r['bwd_over_fwd']:7.2f} | {r['predicted_fwd_s'] * 1e3:7.2f} {r['predicted_bwd_s'] * 1e3:7.2f} | "
              f"{r['prior_fwd_s'] * 1e3:7.2f} {r['prior_bwd_s'] * 1e3:7.2f} {r['prior_bwd_s'] / r['prior_fwd_s']:7.2f}")
    print("\nMoE expert MLP forward (fc1 gate+up and fc2): measured ms | predicted ms")
    for r in tables["grouped_gemm"]:
        g, s = r.get("grouped_fwd_s"), r.get("sequential_fwd_s")
        fp8 = r.get("grouped_fp8_fwd_s")
        print(f"{r['model']:<16} ep {r['ep']:<3} experts {r['local_experts']:<4} {r['case']:<13} grouped "
              f"{g * 1e3:7.3f} vs {r['predicted_grouped_fwd_s'] * 1e3:7.3f} | sequential {s * 1e3:7.3f} vs "
              f"{r['predicted_sequential_fwd_s'] * 1e3:7.3f}   (fwd+bwd measured: grouped {r.get('grouped_fwd_bwd_s', 0) * 1e3:.3f}, "
              f"sequential {r.get('sequential_fwd_bwd_s', 0) * 1e3:.3f})"
              + (f"  fp8 grouped fwd {fp8 * 1e3:.3f}" if fp8 else ""))
    grouped = [r["grouped_fwd_s"] / r["predicted_grouped_fwd_s"] for r in tables["grouped_gemm"] if r.get("grouped_fwd_s")]
    if grouped:
        print(f"  grouped, measured / predicted (the eager SwiGLU included): median {statistics.median(grouped):.3f} "
              f"({min(grouped):.3f}-{max(grouped):.3f})")
    if tables["moe_kernels"]:
        print("\nMoE router / permutation, 8,192 tokens, forward ms: measured | hzpsim's charge")
        for r in tables["moe_kernels"]:
            print(f"{r['model']:<16} router {r['router_s'] * 1e3:6.3f} | {r['router_charged_s'] * 1e3:6.3f}   permute "
                  f"{r['permute_s'] * 1e3:6.3f} | fused {r['permute_fused_s'] * 1e3:6.3f} eager {r['permute_eager_s'] * 1e3:6.3f}"
                  f"   un-permute (scatter_add_) {r['unpermute_s'] * 1e3:6.3f} | eager {r['unpermute_eager_s'] * 1e3:6.3f}")
    print("\nmemory-bound kernels: measured GB/s, fraction of the datasheet | hzpsim's rate")
    for r in tables["memory_bound"]:
        print(f"{r['op']:<24} {r['gb_per_s']:7.0f} {r['fraction_of_datasheet']:6.2f} | {r['predicted_gb_per_s']:7.0f}"
              + ("   (the probe counts the fused 3 bytes per element; the eager silu and product move 5: "
                 f"{r['fraction_of_datasheet'] * 5 / 3:.2f} of the datasheet)" if r["op"] == "swiglu_fwd" else ""))
    if isinstance(tables["launch"], dict):
        from hzpsim.strategies._implementations import COLLECTIVE_CALL_S, KERNEL_LAUNCH_S

        print(f"\nhost cost: eager op {tables['launch']['add_inplace_s'] * 1e6:.2f} us (KERNEL_LAUNCH_S "
              f"{KERNEL_LAUNCH_S * 1e6:.1f}); c10d all_reduce {tables['launch'].get('all_reduce_call_s', math.nan) * 1e6:.2f} us "
              f"(COLLECTIVE_CALL_S {COLLECTIVE_CALL_S * 1e6:.0f})")
    if isinstance(tables["sustained"], dict):
        w = tables["sustained"]["windows"]
        rates = " ".join(f"{x['tflops']:.0f}" for x in w)
        print(f"sustained GEMM mix: {rates} TF per window; SM clock "
              f"{w[0].get('sm_clock_mhz')} -> {w[-1].get('sm_clock_mhz')} MHz, {w[-1].get('power_w')} W")
    print("\npeak memory, rank 0 of 8 (GiB): tracker | allocator allocated | reserved | predicted allocated | reserved")
    for r in tables["memory"]:
        if "error" in r:
            print(f"{r['file']:<40} {r['strategy']:<9} error: {r['error'][:80]}")
            continue
        g = 2**30
        print(f"{r['model']:<18} {r['strategy']:<9} {r['tracker_bytes'] / g:7.3f} {r['allocated_bytes'] / g:7.3f} "
              f"{r['reserved_bytes'] / g:7.3f} | {r['predicted_allocated_bytes'] / g:7.3f} {r['predicted_reserved_bytes'] / g:7.3f}"
              f"   (allocated at step start {r['resident_bytes'] / g:.3f})")
    for r in tables["executor"]:
        print(f"executor on the GPU, {r['label']}: step {r['step_s']:.3f} s measured, {r['predicted_step_s']:.3f} s "
              f"predicted; peak {r['peak_bytes'] / 2**30:.2f} GiB allocated, {r['predicted_peak_allocated_bytes'] / 2**30:.2f} predicted")


if __name__ == "__main__":
    raise SystemExit(main())
