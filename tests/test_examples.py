"""Every example scenario in examples/ runs as its header comment says and prints what it printed
when its expected output was stored (tests/golden/examples/<example>.txt), as SimPy's
documentation examples do.

The first line of an example is the command that runs it (``# hzpsim run examples/x.yaml ...``);
the test runs that command from the repository root and compares its standard output with the
stored text, character for character. The table output has no wall-clock fields; should an
example print JSON (``--json``), ``sim_wall_s`` is dropped before comparing.

Regenerate the stored outputs (only for an intended, explained change of the predictions or of
the output format) with

    HZPSIM_UPDATE_GOLDENS=1 python -m pytest tests/test_examples.py -m slow

and review the diff of tests/golden/examples/ before committing it.
"""

from __future__ import annotations

import difflib
import json
import os
import shlex
from pathlib import Path

import pytest

from hzpsim.cli import main

REPO = Path(__file__).resolve().parents[1]
ALL_EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
# the simulator's examples (``hzpsim run`` / ``compare``); an executor example runs real torch
# processes whose timings vary from run to run (tests/test_executor.py covers it)
EXAMPLES = [p for p in ALL_EXAMPLES if p.read_text().startswith(("# hzpsim run ", "# hzpsim compare "))]
EXPECTED = Path(__file__).resolve().parent / "golden" / "examples"


def command(path: Path) -> list[str]:
    """The arguments of the ``# hzpsim ...`` command on an example's first line."""
    first = path.read_text().splitlines()[0]
    assert first.startswith("# hzpsim "), f"{path.name}: an example opens with the command that runs it"
    argv = shlex.split(first.removeprefix("# hzpsim "))
    assert f"examples/{path.name}" in argv, f"{path.name}: its command runs another file: {first}"
    return argv


def without_wall_clock(text: str) -> str:
    """The output with wall-clock fields removed (JSON reports: ``sim_wall_s``)."""
    try:
        document = json.loads(text)
    except ValueError:
        return text  # tables: no wall-clock fields
    reports = document if isinstance(document, list) else [document]
    for report in reports:
        if isinstance(report, dict):
            report.pop("sim_wall_s", None)
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def test_every_example_has_its_expected_output_and_no_other():
    stored = {p.stem for p in EXPECTED.glob("*.txt")}
    assert stored == {p.stem for p in EXAMPLES}, (
        "tests/golden/examples/ must hold one <example>.txt per examples/<example>.yaml: "
        "run HZPSIM_UPDATE_GOLDENS=1 python -m pytest tests/test_examples.py -m slow")


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_prints_its_stored_output(path, capsys, monkeypatch):
    argv = command(path)
    monkeypatch.chdir(REPO)
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    got = without_wall_clock(capsys.readouterr().out)
    expected_file = EXPECTED / f"{path.stem}.txt"
    if os.environ.get("HZPSIM_UPDATE_GOLDENS"):
        EXPECTED.mkdir(parents=True, exist_ok=True)
        expected_file.write_text(got)
        return
    assert expected_file.exists(), f"no stored output for {path.name}: run with HZPSIM_UPDATE_GOLDENS=1"
    expected = expected_file.read_text()
    if got != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), got.splitlines(True),
                                            f"stored {expected_file.name}", f"hzpsim {' '.join(argv)}"))
        pytest.fail(f"{path.name} no longer prints its stored output:\n{diff}")
