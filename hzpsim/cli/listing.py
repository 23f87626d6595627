"""``hzpsim list``: devices, cluster presets, workloads and strategies (``listing``: ``list``
is a Python builtin).

    hzpsim list                # one line per kind
    hzpsim list strategies     # each strategy with its fields and their defaults
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from hzpsim import strategies
from hzpsim.config import key_of
from hzpsim.hardware.devices import DEVICES
from hzpsim.presets import list_presets


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``list``."""
    p = sub.add_parser("list", help="list devices, cluster presets, workloads and strategies")
    p.add_argument("what", nargs="?", choices=("devices", "presets", "topologies", "workloads", "models", "strategies"))
    p.set_defaults(handler=_cmd_list)


def _cmd_list(args: argparse.Namespace) -> int:
    what = args.what
    if what in (None, "devices"):
        print("devices:")
        for d in DEVICES.values():
            print(
                f"  {d.name:<11} {d.peak_bf16_flops_per_s / 1e12:7.1f} TFLOP/s bf16  "
                f"{d.memory_bytes / 1e9:6.1f} GB  {d.memory_bytes_per_s / 1e12:5.2f} TB/s  "
                f"(fabric: {d.default_cluster_preset})"
            )
    if what in (None, "presets", "topologies"):
        print("cluster presets: " + ", ".join(list_presets("topologies")))
    if what in (None, "workloads", "models"):
        print("workloads: " + ", ".join(list_presets("workloads")))
    if what is None:
        print("strategies: " + ", ".join(strategies.available()) + "  (hzpsim list strategies: their fields)")
    if what == "strategies":
        for name in strategies.available():
            plugin = strategies.get(name)
            summary = ((plugin.__doc__ or "").strip().splitlines() or ["(no module docstring)"])[0]
            print(f"{name}: {summary}")
            for f in dataclasses.fields(plugin.Config):
                default = f.default if f.default is not dataclasses.MISSING else "required"
                print(f"    {key_of(f)} = {json.dumps(default)}")
    return 0
