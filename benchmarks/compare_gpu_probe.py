"""hzpsim's H100 compute and memory model against what ``benchmarks/gpu_probe.py`` measured on an
H100 (``docs/gpu-results/``); the tables of ``docs/gpu-measurements.md``.

    python benchmarks/compare_gpu_probe.py                       # the committed 2026-11-26 files
    python benchmarks/compare_gpu_probe.py --probe F.json --memtrack A.json --memtrack B.json

Every predicted number is computed here from the device file (``h100-sxm``) and the active
calibration profile; nothing predicted is read from the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from hzpsim.hardware.compute import ComputeModel, efficiency_for
from hzpsim.hardware.devices import device_file, load_device
from hzpsim.model.kernels import Attention

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "gpu-results"


def _model(prior_attention: bool = False) -> ComputeModel:
    device = load_device(device_file("h100-sxm"))
    eff = efficiency_for(device)
    if prior_attention:
        eff = dataclasses.replace(eff, attention_fraction=1.0)
    return ComputeModel(device, "bf16", eff)


def gemm_rows(probe: dict[str, Any]) -> list[dict[str, Any]]:
    model = _model()
    out = []
    for r in probe["gemm"]:
        m, n, k = r["gemm_mnk"]
        predicted = model.gemm_s(m, n, k)
        out.append({**r, "predicted_s": predicted, "ratio": predicted / r["seconds"]})
    return out


def attention_rows(probe: dict[str, Any]) -> list[dict[str, Any]]:
    fitted, prior = _model(), _model(prior_attention=True)
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


def grouped_rows(probe: dict[str, Any]) -> list[dict[str, Any]]:
    """The forward of one MoE layer's expert MLP: fc1 (gate+up, 2 x ffn) and fc2, as hzpsim times
    them (``strategies._moe.expert_gemms``: the grouped kernel as one batched GEMM over the
    rank's tokens spread evenly over its experts, SequentialMLP as one GEMM per expert).
    hzpsim's imbalance is across EP ranks (the busiest rank's token count); within a rank the
    grouped kernel's tile scheduler spreads unequal experts over the SMs, which the
    ``one_expert_2x`` rows measure."""
    model = _model()
    out = []
    for r in probe["grouped_gemm"]:
        counts, h, f, e = r["tokens_per_expert"], r["hidden"], r["ffn"], r["local_experts"]
        mean = sum(counts) / e  # the rank's tokens spread over its experts: what hzpsim charges
        grouped = model.gemm_s(mean, 2 * f, h, batch=e) + model.gemm_s(mean, h, f, batch=e)
        sequential = sum(model.gemm_s(c, 2 * f, h) + model.gemm_s(c, h, f) for c in counts)
        out.append({**r, "predicted_grouped_fwd_s": grouped, "predicted_sequential_fwd_s": sequential})
    return out


def memory_bound_rows(probe: dict[str, Any]) -> list[dict[str, Any]]:
    device = load_device(device_file("h100-sxm"))
    rate = device.memory_bytes_per_s * efficiency_for(device).hbm
    return [{**r, "predicted_gb_per_s": rate / 1e9, "fraction_of_datasheet": r["gb_per_s"] * 1e9 / device.memory_bytes_per_s}
            for r in probe["memory_bound"]]


def memory_rows(files: list[Path]) -> list[dict[str, Any]]:
    """Each measured memtrack run against the simulator's allocated and reserved peaks of rank 0
    of the same scenario on an H100 (the caching allocator replayed, its GEMM workspace in)."""
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
            layers = 8 if "8layers" in path.name else None
            model = dataclasses.replace(memtrack.llama3_8b(2048), num_layers=8, name="llama3-8b-8layers") if layers \
                else memtrack.small(seq_len=512, layers=4, hidden=512, vocab=32768)
            spec = memtrack.spec_for(r["strategy"], model)
            scenario = memory.scenario_of(spec, r["strategy"], {"preset": "dgx-h100", "num_nodes": 1,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--probe", default=str(RESULTS / "h100-probe-2026-11-26.json"))
    parser.add_argument("--memtrack", action="append", help="memtrack result files (default: the committed two)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    probe = json.loads(Path(args.probe).read_text())
    memtracks = [Path(p) for p in (args.memtrack or [RESULTS / "h100-memtrack-small-2026-11-26.json",
                                                      RESULTS / "h100-memtrack-8layers-2026-11-26.json"])]
    tables = {"gemm": gemm_rows(probe), "attention": attention_rows(probe), "grouped_gemm": grouped_rows(probe),
              "memory_bound": memory_bound_rows(probe), "memory": memory_rows(memtracks)}
    if args.json:
        print(json.dumps(tables, indent=1, sort_keys=True))
        return 0
    ratios = [r["ratio"] for r in tables["gemm"]]
    print(f"GEMM ({len(ratios)} shapes, bf16): predicted / measured time median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}")
    for tp in (1, 2, 4, 8):
        sel = [r for r in tables["gemm"] if r["tp"] == tp]
        print(f"  tp {tp}: measured {statistics.median(r['tflops'] for r in sel):.0f} TF median, predicted/measured "
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
        print(f"{r['model']:<16} ep {r['ep']:<3} experts {r['local_experts']:<4} {r['case']:<13} grouped "
              f"{g * 1e3:7.3f} vs {r['predicted_grouped_fwd_s'] * 1e3:7.3f} | sequential {s * 1e3:7.3f} vs "
              f"{r['predicted_sequential_fwd_s'] * 1e3:7.3f}   (fwd+bwd measured: grouped {r.get('grouped_fwd_bwd_s', 0) * 1e3:.3f}, "
              f"sequential {r.get('sequential_fwd_bwd_s', 0) * 1e3:.3f})")
    print("\nmemory-bound kernels: measured GB/s, fraction of the 3.35 TB/s datasheet | hzpsim's rate")
    for r in tables["memory_bound"]:
        print(f"{r['op']:<24} {r['gb_per_s']:7.0f} {r['fraction_of_datasheet']:6.2f} | {r['predicted_gb_per_s']:7.0f}")
    print("\npeak memory, rank 0 of 8 (GiB): tracker | allocator allocated | reserved | predicted allocated | reserved")
    for r in tables["memory"]:
        if "error" in r:
            print(f"{r['file']:<40} {r['strategy']:<9} error: {r['error'][:80]}")
            continue
        g = 2**30
        print(f"{r['model']:<18} {r['strategy']:<9} {r['tracker_bytes'] / g:7.3f} {r['allocated_bytes'] / g:7.3f} "
              f"{r['reserved_bytes'] / g:7.3f} | {r['predicted_allocated_bytes'] / g:7.3f} {r['predicted_reserved_bytes'] / g:7.3f}"
              f"   (allocated at step start {r['resident_bytes'] / g:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
