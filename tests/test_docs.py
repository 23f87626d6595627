"""The docs the code cites exist: every ``strategies.md §n`` in the package, the docs and the
tests names a section of docs/strategies.md (the project's own copy of the formulas and sources)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "strategies.md"
CITATION = re.compile(r"strategies\.md`*\s*((?:§[\d.]*\d(?:\s*(?:,|and)\s*)?)+)")


def citations() -> list[tuple[str, str]]:
    """(file:line, section number) of every 'strategies.md §n' in hzpsim/, docs/ and tests/."""
    found = []
    for folder in ("hzpsim", "docs", "tests"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix not in (".py", ".md") or path == REFERENCE:
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                for match in CITATION.finditer(line):
                    for section in re.findall(r"§([\d.]*\d)", match.group(1)):
                        found.append((f"{path.relative_to(REPO)}:{number}", section))
    return found


def sections() -> set[str]:
    return set(re.findall(r"^#+ (\d+(?:\.\d+)*)\.? ", REFERENCE.read_text(encoding="utf-8"), re.M))


def test_the_reference_is_in_the_repository_and_stands_alone():
    text = REFERENCE.read_text(encoding="utf-8")
    assert "../shared" not in text
    assert {"1.4", "2.7", "2.7.4", "2.8", "3", "4"} <= sections()
    assert len(re.findall(r"^### 1\.4 ", text, re.M)) == 1, "one §1.4: the inferred AsyncHZP design"


def test_every_strategies_md_citation_names_a_section_of_docs_strategies_md():
    cited = citations()
    assert len(cited) >= 20  # the package and the tests cite it throughout
    missing = [f"{where}: §{section}" for where, section in cited if section not in sections()]
    assert not missing, "citations of strategies.md with no such section in docs/strategies.md:\n" + "\n".join(missing)
