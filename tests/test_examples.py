"""Every example scenario in examples/ runs as its header comment says."""

from __future__ import annotations

from pathlib import Path

import pytest

from hzpsim.cli import main

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path, capsys):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# hzpsim "), "an example opens with the command that runs it"
    assert main(["compare", str(path)]) == 0
    out = capsys.readouterr().out
    assert "strategy" in out and "step s" in out
