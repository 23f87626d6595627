"""The CLI fuzzed with hypothesis: every malformed scenario must end in exit code 2 with one
``hzpsim: error:`` line (never a traceback, never exit 1); anything the loader accepts must
simulate and exit 0."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import string
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from scenario_helpers import BASE

from hzpsim.cli import main
from hzpsim.hardware.topology import ClusterSpec
from hzpsim.model import Model
from hzpsim.model.training import Training
from hzpsim.scenario import _TOP_KEYS
from hzpsim.strategies import zero

_FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Every mutable section of the base and the keys it knows (from the typed classes themselves)
_SECTIONS: dict[tuple[str, ...], tuple[str, ...]] = {
    (): _TOP_KEYS,
    ("model",): ("preset", *(f.name for f in dataclasses.fields(Model))),
    ("training",): tuple(f.name for f in dataclasses.fields(Training)),
    ("cluster",): tuple(f.name for f in dataclasses.fields(ClusterSpec)),
    ("strategy",): ("name", *(f.name for f in dataclasses.fields(zero.Config))),
}
_SIZE_FIELDS = {
    ("model", "num_layers"),
    ("model", "hidden_size"),
    ("model", "num_heads"),
    ("model", "num_kv_heads"),
    ("model", "ffn_hidden_size"),
    ("model", "vocab_size"),
    ("model", "seq_len"),
    ("model", "head_dim"),
    ("training", "global_batch_size"),
    ("training", "micro_batch_size"),
    ("cluster", "num_nodes"),
    ("cluster", "gpus_per_node"),
    ("cluster", "islands_per_node"),
    ("cluster", "intra_node_bytes_per_s"),
    ("cluster", "inter_node_bytes_per_s_per_device"),
    ("strategy", "stage"),
    ("strategy", "prefetch_depth"),
}


def _expanded() -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data["model"] = {"preset": "tiny-dense"}
    return data


_garbage_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=0, max_size=12
)
_keys = st.text(alphabet=string.ascii_letters + string.digits + "_-", min_size=1, max_size=10)
_wrong_values = st.one_of(
    st.none(),
    st.booleans(),
    _garbage_text,
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(_keys, st.integers(), max_size=2),
    st.floats(max_value=0.0),
    st.just(float("nan")),
    st.floats(min_value=0.01, max_value=64, allow_nan=False).filter(lambda x: x != int(x)),
    st.floats(min_value=1e300, allow_infinity=True),
    st.integers(min_value=-(10**30), max_value=0),
    st.sampled_from(["NaN", "-inf", "1e999", "0x10", "ten", "", " ", "3.5", "-1e3", "null"]),
)


def _too_big(value: Any) -> bool:
    """A size the loader rightly accepts but that would make the simulation slow (the fuzz
    tests want cheap runs; huge counts are the engine's concern, not the loader's)."""
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError, OverflowError):
        return False
    return 64 < number < 1e300


def _run_cli(tmp_path: Path, capsys, data: Any, *sets: str) -> tuple[int, str, str]:
    path = tmp_path / "scenario.yaml"
    text = data if isinstance(data, str) else yaml.safe_dump(data, allow_unicode=True)
    path.write_text(text, encoding="utf-8")
    capsys.readouterr()
    argv = ["run", str(path), "--json"]
    for s in sets:
        argv.append(f"--set={s}")
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_clean_outcome(rc: int, out: str, err: str) -> None:
    assert "Traceback" not in err and "Traceback" not in out
    if rc == 0:
        report = json.loads(out)
        for one in report if isinstance(report, list) else [report]:
            # a fuzzed scenario has no closed form: the property is a usable, self-consistent report
            assert 0 < one["step_time_s"] < math.inf
            assert one["tokens_per_s_per_device"] * one["num_devices"] == pytest.approx(one["tokens_per_s"])
        return
    assert rc == 2, (rc, err)
    assert err.startswith("hzpsim: error: "), err
    assert err.endswith("\n") and len(err.splitlines()) == 1, repr(err)
    assert out == ""


@_FUZZ
@given(
    section=st.sampled_from(sorted(_SECTIONS)),
    key=_keys,
    value=_wrong_values,
    depth=st.integers(0, 2),
)
def test_fuzz_unknown_keys_at_random_depth(tmp_path, capsys, section, key, value, depth):
    data = _expanded()
    node = data
    for part in section:
        node = node[part]
    assume(key not in _SECTIONS[section] and not (section == () and key == "name"))
    nested: Any = value
    for _ in range(depth):
        nested = {"x": nested}
    node[key] = nested
    rc, out, err = _run_cli(tmp_path, capsys, data)
    assert rc == 2
    _assert_clean_outcome(rc, out, err)
    dotted = ".".join((*section, key))
    assert err.startswith(f"hzpsim: error: {dotted}: unknown key"), err


@_FUZZ
@given(
    spot=st.sampled_from([(s, f) for s, fields in _SECTIONS.items() for f in fields if s]),
    value=_wrong_values,
)
def test_fuzz_wrong_values_for_known_fields(tmp_path, capsys, spot, value):
    (section,), field = spot
    assume(not _too_big(value))
    data = _expanded()
    data[section][field] = value
    rc, out, err = _run_cli(tmp_path, capsys, data)
    _assert_clean_outcome(rc, out, err)
    if rc == 2 and field != "preset":
        assert section in err


@_FUZZ
@given(
    spot=st.sampled_from(sorted(_SIZE_FIELDS)),
    value=st.one_of(st.integers(-(10**12), 0), st.sampled_from(["0", "-1", "-4e3", "0e0", -0.0])),
)
def test_fuzz_zero_or_negative_sizes(tmp_path, capsys, spot, value):
    section, field = spot
    data = _expanded()
    data[section][field] = value
    rc, out, err = _run_cli(tmp_path, capsys, data)
    _assert_clean_outcome(rc, out, err)
    if (section, field) == ("strategy", "prefetch_depth") and value in (0, "0", "0e0", -0.0):
        assert rc == 0  # prefetch depth 0 is a valid choice
    else:
        assert rc == 2
        assert f"{section}.{field}" in err or section in err


@_FUZZ
@given(top=st.one_of(_wrong_values, st.lists(_wrong_values, max_size=3)))
def test_fuzz_non_mapping_documents(tmp_path, capsys, top):
    assume(not isinstance(top, dict))
    rc, out, err = _run_cli(tmp_path, capsys, top)
    assert rc == 2
    _assert_clean_outcome(rc, out, err)


@_FUZZ
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60))
def test_fuzz_garbage_files(tmp_path, capsys, text):
    rc, out, err = _run_cli(tmp_path, capsys, text)
    assert rc == 2  # no garbage of this size makes a complete scenario
    _assert_clean_outcome(rc, out, err)


_set_paths = st.one_of(
    st.sampled_from(
        [
            "model",
            "model.num_layers",
            "model.preset",
            "model.moe",
            "model.moe.top_k",
            "training",
            "training.global_batch_size",
            "training.micro_batch_size",
            "training.precision",
            "cluster",
            "cluster.num_nodes",
            "cluster.device",
            "cluster.preset",
            "strategy",
            "strategy.name",
            "strategy.stage",
            "strategies.0.stage",
            "name",
            "model.num_layers.x",
            "",
        ]
    ),
    st.lists(_keys, min_size=1, max_size=4).map(".".join),
)
_set_values = st.one_of(
    _garbage_text,
    st.sampled_from(
        [
            "1",
            "0",
            "-1",
            "2",
            "1e3",
            "8e0",
            "[1, 2]",
            "{a: 1}",
            "true",
            "null",
            "~",
            "2020-13-45",
            "!!binary zz",
            "!!float x",
            "&a [*a]",
            "'unclosed",
            "{",
            "tiny-dense",
            "zero",
            "dgx-a100",
        ]
    ),
)


@_FUZZ
@given(
    sets=st.lists(
        st.tuples(_set_paths, st.sampled_from(["=", ""]), _set_values), min_size=1, max_size=3
    )
)
def test_fuzz_random_set_strings(tmp_path, capsys, sets):
    texts = [f"{path}{eq}{value}" for path, eq, value in sets]
    assume(all("\x00" not in t for t in texts))
    # keep accepted scenarios tiny: no override may make the simulation large
    for t in texts:
        key, _, raw = t.partition("=")
        assume(not _too_big(raw))
    rc, out, err = _run_cli(tmp_path, capsys, _expanded(), *texts)
    _assert_clean_outcome(rc, out, err)
