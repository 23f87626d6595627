"""``hzpsim execute``: run a scenario's strategies for real with torch.distributed (:mod:`hzpsim.executor`).

    hzpsim execute SCENARIO --world 4 [--json] [--write-spec FILE]

Without torch it exits 2 with one line saying how to install it. Nothing here imports torch at
import time (``hzpsim --help`` stays fast and works without torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from hzpsim.cli.options import check_run_options


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``execute``."""
    p = sub.add_parser("execute", help="run a scenario's strategies for real with torch.distributed (executor)")
    p.add_argument("scenario", help="scenario YAML (fp32, no dropout, no recompute)")
    p.add_argument("--world", type=int, default=2, help="processes (default 2)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (default 6)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu = gloo, cuda = NCCL")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a scenario field")
    p.add_argument("--comm-delay", type=float, default=0.0, help="artificial host delay per collective call, s")
    p.add_argument("--write-spec", metavar="FILE", help="write the first strategy's run spec (for torchrun) and exit")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.set_defaults(handler=_cmd_execute)


def _cmd_execute(args: argparse.Namespace) -> int:
    from hzpsim.executor import require_torch
    from hzpsim.scenario import load_scenario

    require_torch()
    check_run_options(args)
    scenario = load_scenario(args.scenario, args.set or ())
    from hzpsim.executor.spec import run_specs

    specs = run_specs(scenario, args.world, num_steps=args.steps, device=args.device, comm_delay_s=args.comm_delay)
    if args.write_spec:
        with open(args.write_spec, "w", encoding="utf-8") as handle:
            json.dump(specs[0].to_mapping(), handle, indent=2)
        print(f"wrote {args.write_spec}: torchrun --nproc-per-node {args.world} -m hzpsim.executor.worker "
              f"--spec {args.write_spec} --out results/")
        return 0
    from hzpsim.executor.runner import max_loss_diff, reference_losses, run

    out: list[dict[str, Any]] = []
    for spec in specs:
        result = run(spec)
        data = {k: v for k, v in dataclasses.asdict(result).items() if k not in ("ranks", "spec")}
        data.update(strategy=spec.strategy, label=spec.label, world_size=spec.world_size)
        if spec.device == "cpu":
            data["loss_max_abs_diff_vs_reference"] = max_loss_diff(result, reference_losses(spec))
        out.append(data)
        if not args.json:
            print(f"{spec.label}: step {result.step_time_s:.4f} s, losses "
                  + " ".join(f"{x:.4f}" for x in result.losses)
                  + f", collectives {result.collective_counts}, model states {result.model_state_bytes} B"
                  + (f", loss diff vs reference {data['loss_max_abs_diff_vs_reference']:.1e}" if "loss_max_abs_diff_vs_reference" in data else ""))
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    return 0
