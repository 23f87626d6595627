"""Every numeric knob of every strategy rejects a bad value with exit 2 naming its key path.

Knobs are validated where they live (``Schedule`` for prefetch depth and scatter buffers,
``ParallelDims`` for degrees, each ``Config.validate`` for the rest), so a strategy that
forgets a check still cannot crash on one (exit 1) or accept nonsense.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from hzpsim import strategies
from hzpsim.cli import main
from hzpsim.config import key_of

# an MoE model on 16 devices, so every strategy's every knob is reachable
BASE = ["--set", "model=tiny-moe", "--set", "cluster.num_nodes=2", "--set", "training.global_batch_size=64"]


def numeric_knobs() -> list[tuple[str, str]]:
    out = []
    for name in strategies.available():
        hints = typing.get_type_hints(strategies.get(name).Config)
        for f in dataclasses.fields(strategies.get(name).Config):
            kinds = typing.get_args(hints[f.name]) or (hints[f.name],)
            if {int, float} & set(kinds) or typing.get_origin(hints[f.name]) is typing.Literal:
                out.append((name, key_of(f)))
    return out


KNOBS = numeric_knobs()


def test_the_knobs_include_the_ones_that_once_crashed():
    for strategy in ("hsdp", "mics", "megatron_fsdp", "zeropp", "nd", "zero", "asynchzp"):
        assert (strategy, "prefetch_depth") in KNOBS
    assert ("asynchzp", "reduce_buffers") in KNOBS


@pytest.mark.parametrize(("strategy", "key"), KNOBS)
@pytest.mark.parametrize("value", ["-1", "1e9"])
def test_a_bad_value_exits_2_naming_the_key(capsys, strategy, key, value):
    code = main(["run", *BASE, "--set", f"strategy.name={strategy}", "--set", f"strategy.{key}={value}"])
    _, err = capsys.readouterr()
    if value == "1e9" and code == 0:
        return  # a huge value may be legal (e.g. a group size the checks later cap); never a crash
    assert code == 2, err
    assert err.startswith(f"hzpsim: error: strategy.{key}:"), err
