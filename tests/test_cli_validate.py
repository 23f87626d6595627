"""``hzpsim validate published`` as a command (hzpsim/cli/validate.py): the JSON it prints, and
options that cannot select anything sensible exit 2 with one line naming the option."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from hzpsim.cli.validate import check_options, main_published
from hzpsim.validation import REQUIRED_COLUMNS, rows_to_scenarios


@pytest.fixture(scope="module")
def cases():
    return rows_to_scenarios()


def test_main_published_json():
    buf = io.StringIO()
    assert main_published(rows=[52, 150], json=True, out=buf) == 0
    data = json.loads(buf.getvalue())
    assert {r["row"] for r in data["rows"]} == {52, 150}
    assert data["summary"]["ok"] == 1
    assert main_published(csv_path="/nonexistent.csv", out=io.StringIO()) == 2


# ------------------------------------------------------------ nonsense options: exit 2
# Each was accepted before (zero cases and exit 0, a silently dropped row, or exit 1 with a
# pandas traceback message). validate_published is replaced by a tripwire, so a check that
# stops working fails at once instead of simulating the whole CSV.

HEADER = ",".join(REQUIRED_COLUMNS)


def _bad_csvs(tmp: Path) -> dict[str, tuple[Path, str]]:
    """{name: (file, words the message must contain)}."""
    files = {
        "empty": (b"", "empty file"),
        "blank_lines": (b"\n\n  \n", "empty file"),
        "binary": (bytes(range(256)) * 4, "binary file"),
        "latin1": ("source_id,notes\nS01,caf\xe9\n".encode("latin-1"), "not UTF-8"),
        "missing_columns": (b"source_id,gpu\nS01,A100\n", "missing required columns: system,"),
        "header_only": ((HEADER + "\n").encode(), "no data rows"),
        "ragged": ("\n".join([HEADER, ",".join(["1"] * len(REQUIRED_COLUMNS)),
                               ",".join(["1"] * (len(REQUIRED_COLUMNS) + 3))]).encode(), "not a valid CSV"),
    }
    out = {}
    for name, (data, words) in files.items():
        f = tmp / f"{name}.csv"
        f.write_bytes(data)
        out[name] = (f, words)
    out["directory"] = (tmp, "is a directory")
    out["missing_file"] = (tmp / "nosuch.csv", "no such file")
    return out


BAD_OPTIONS = [
    (["--max-rows", "-1"], "--max-rows", "-1 must be a positive"),
    (["--max-rows", "0"], "--max-rows", "0 must be a positive"),
    (["--max-devices", "-5"], "--max-devices", "-5 must be a positive"),
    (["--max-devices", "0"], "--max-devices", "0 must be a positive"),
    (["--row", "99999"], "--row", "99999 is not a row of the CSV (0..234)"),
    (["--row", "235"], "--row", "235 is not a row"),
    (["--row", "-1"], "--row", "-1 is not a row"),
    (["--row", "3", "--row", "-1"], "--row", "-1 is not a row"),
    (["--family", "nosuch"], "--family", "unknown strategy family 'nosuch' (known: fsdp, zero2, zero3, hsdp, nd, zeropp)"),
    (["--family", "fsdp", "--family", "zero4"], "--family", "'zero4'"),
    (["--source", "nosuch"], "--source", "unknown source 'nosuch' (known: M00, M01,"),
    (["--source", "S09", "--source", "S99"], "--source", "'S99'"),
]


@pytest.fixture
def tripwire(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("validated despite a nonsense option")

    monkeypatch.setattr("hzpsim.cli.validate.validate_published", fail)


def _cli_error(argv, capsys):
    from hzpsim.cli import main

    code = main(["validate", "published", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(("argv", "option", "problem"), BAD_OPTIONS, ids=[" ".join(a[0]) for a in BAD_OPTIONS])
def test_nonsense_option_exits_2(argv, option, problem, tripwire, cases, monkeypatch, capsys):
    # the packaged CSV's cases, mapped once per module instead of once per case (~1 s each)
    monkeypatch.setattr("hzpsim.cli.validate.rows_to_scenarios", lambda path: cases)
    code, out, err = _cli_error(argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"hzpsim: error: {option}: ") and err.count("\n") == 1, err
    assert problem in err, err


@pytest.mark.parametrize("name", ["empty", "blank_lines", "binary", "latin1", "missing_columns", "header_only",
                                  "ragged", "directory", "missing_file"])
def test_bad_csv_exits_2(name, tmp_path, tripwire, capsys):
    file, words = _bad_csvs(tmp_path)[name]
    code, out, err = _cli_error(["--csv", str(file)], capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"hzpsim: error: --csv: {file}: ") and err.count("\n") == 1, err
    assert words in err, err


def test_non_integer_option_is_an_argparse_error(capsys):
    from hzpsim.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["validate", "published", "--max-rows", "many"])
    assert exc.value.code == 2 and "--max-rows" in capsys.readouterr().err


def test_sensible_options_pass_the_checks(cases):
    check_options(cases, families=["FSDP", "nd"], sources=["s09", "S01"], max_rows=1, max_devices=1,
                  rows=[0, 191])
    check_options(cases)
