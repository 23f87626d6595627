"""``hzpsim import megatron|torchtitan|deepspeed FILE``: a framework's launch or config as a
complete scenario YAML on stdout (local files only).

    hzpsim import megatron run.sh --preset dgx-a100 > scenario.yaml
    hzpsim import torchtitan llama3_8b.toml --nodes 8
    hzpsim import deepspeed ds_config.json --model examples/hf/llama-3-8b --nodes 2

Every field the source does not state takes the framework's default, listed in the header
comment block with where the framework defines it (docs/import.md). What cannot be modelled
or resolved is refused with exit 2 naming it.
"""

from __future__ import annotations

import argparse

from hzpsim.cli.imports import deepspeed, megatron, torchtitan
from hzpsim.cli.imports.common import add_cluster_options

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``import`` and its three sources."""
    p = sub.add_parser("import", help="a Megatron launch, torchtitan TOML or DeepSpeed JSON as a scenario YAML")
    targets = p.add_subparsers(dest="source", required=True)
    for module in (megatron, torchtitan, deepspeed):
        module.register(targets, add_cluster_options)
