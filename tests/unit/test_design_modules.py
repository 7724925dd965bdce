"""docs/design.md's module table names every ``.py`` file under ``fsdp2/``, and only those."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
ROW = re.compile(r"^\|\s*`(fsdp2/[^`]+\.py)`\s*\|")



def _module_table() -> list[str]:
    """The first column of the table under "## Modules", in order."""
    text = DESIGN.read_text()
    section = text.split("\n## Modules", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for line in section.splitlines() if (m := ROW.match(line))]


def _tree() -> set[str]:
    return {p.relative_to(REPO).as_posix() for p in (REPO / "fsdp2").rglob("*.py") if "__pycache__" not in p.parts}


def test_the_table_has_rows() -> None:
    assert len(_module_table()) >= 20  # guards the parser: a format slip would compare nothing


def test_every_module_is_in_the_table_once() -> None:
    rows = _module_table()
    assert sorted(_tree() - set(rows)) == [], "add these files to the module table in docs/design.md"
    assert sorted({r for r in rows if rows.count(r) > 1}) == []


def test_the_table_names_no_missing_file() -> None:
    missing = set(_module_table()) - _tree()
    assert sorted(missing) == [], "docs/design.md's module table names files that do not exist"
