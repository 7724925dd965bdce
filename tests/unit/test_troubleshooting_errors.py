"""Each message in docs/troubleshooting.md's error tables is one fsdp2 can raise.

The tables under "## Errors fsdp2 raises" quote the start of each message, with its
exception type, as a user sees it. Each quote is checked against the string literals of
``fsdp2/``, so a reworded message cannot leave its row behind. A quote and a literal are
aligned character by character: an f-string field (or a ``%s``) of the source stands for any
text of the quote (``X``, ``'w'``, ``3``), a ``...`` of the quote for any text of the source,
and at least a quarter of the quote (8 characters or more) must be the source's own text, in
order, within one literal. The exception type must appear in the same file. A quote that
elides a message's tail ends with ``...``; plain words after it in the cell are not checked.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "troubleshooting.md"
HOLE = None  # a field of a source literal, or a "..." of a quote: any text of the other side
PERCENT = re.compile(r"%[-+ #0-9.]*[sdrfxi]")
ELISION = re.compile(r"\.\.\.|…")
EXCEPTION = re.compile(r"^(?P<type>[A-Z]\w*(?:Error|Exception|Warning)):\s*")
WORD = re.compile(r"[A-Za-z_]{4,}")
# Quoted in a row, but not a message: the command the next quote's message comes from.
NOT_MESSAGES = {"python -m fsdp2.checkpoint export"}


def _render(node: ast.AST) -> list | None:
    """A string expression as characters and HOLEs (its fields); None if it is no string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _with_holes(node.value, PERCENT)
    if isinstance(node, ast.JoinedStr):
        out: list = []
        for value in node.values:
            out += list(value.value) if isinstance(value, ast.Constant) else [HOLE]
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _render(node.left), _render(node.right)
        if left is not None or right is not None:
            return (left if left is not None else [HOLE]) + (right if right is not None else [HOLE])
    return None


def _with_holes(text: str, hole: re.Pattern[str]) -> list:
    out: list = []
    last = 0
    for m in hole.finditer(text):
        out += [*text[last:m.start()], HOLE]
        last = m.end()
    return out + list(text[last:])


@cache
def _source_strings() -> list[tuple[Path, str, list]]:
    """(file, file text, rendered literal) for every string expression in fsdp2/."""
    out = []
    for path in sorted((REPO / "fsdp2").rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if (rendered := _render(node)) is not None:
                out.append((path, text, rendered))
    return out


def _literal_matched(quote: list, source: list) -> int:
    """The most characters of ``quote`` matched literally in one alignment of all of ``quote``
    with a stretch of ``source``; -1 if there is none.

    A source field may take several words of the quote in its middle (``fully_shard(X) as
    'w'``), but the quote may neither start nor end inside such a stretch: ``mesh has 3 axes``
    must not pass for ``mesh has {n} dims``. A quote that paraphrases a field's tail ends with
    ``...``.
    """
    n, m = len(quote), len(source)
    none = -1
    # clean[i][j]: quote[:i] aligned, source[:j] used; words[i][j]: the same, but a source
    # field has taken words since the last literal match of a non-space character (only such
    # a match ends that, and no "..." may follow it).
    clean = [[none] * (m + 1) for _ in range(n + 1)]
    words = [[none] * (m + 1) for _ in range(n + 1)]
    clean[0] = [0] * (m + 1)  # the quote may start anywhere in the source
    for i in range(n + 1):
        q = quote[i] if i < n else "end"
        for j in range(m + 1):
            s = source[j] if j < m else "end"
            for table in (clean, words):
                v = table[i][j]
                if v == none:
                    continue
                if s is HOLE:  # a source field: ends here, or takes the quote's next character
                    table[i][j + 1] = max(table[i][j + 1], v)
                    if i < n and q is not HOLE and not (v == 0 and q.isspace()):  # not at the start
                        into = words if (table is words or q.isspace()) else clean
                        into[i + 1][j] = max(into[i + 1][j], v)
                if q is HOLE:  # a quote's "...": ends here, or takes the source's next character
                    if table is clean:  # not right after a field took words
                        clean[i + 1][j] = max(clean[i + 1][j], v)
                        if j < m:
                            clean[i][j + 1] = max(clean[i][j + 1], v)
                elif i < n and j < m and s is not HOLE and q == s:
                    into = words if (table is words and q.isspace()) else clean
                    into[i + 1][j + 1] = max(into[i + 1][j + 1], v + 1)
    return max(clean[n])


def _rows() -> list[tuple[int, str]]:
    """(line, first cell) of every row of the tables in the error section."""
    lines = PAGE.read_text().splitlines()
    start = lines.index("## Errors fsdp2 raises")
    rows = []
    for number, line in enumerate(lines[start + 1:], start + 2):
        if line.startswith("## "):
            break
        cells = line.split(" | ")
        if line.startswith("| ") and not re.match(r"\|\s*(message|---)", line):
            rows.append((number, cells[0].removeprefix("| ")))
    return rows


def _quotes(cell: str) -> list[str]:
    return [q for q in re.findall(r"`([^`]+)`", cell) if q not in NOT_MESSAGES]


def _found(quote: str) -> str | None:
    """The file of fsdp2/ that has the quoted message with its exception type; None if none."""
    typed = EXCEPTION.match(quote)
    exc, message = (typed.group("type"), quote[typed.end():]) if typed else (None, quote)
    pieces = _with_holes(message, ELISION)
    needed = max(8, sum(c is not HOLE for c in pieces) // 4)
    words = set(WORD.findall(message))
    candidates = []
    for path, text, rendered in _source_strings():
        if exc is not None and exc not in text:
            continue
        literal = "".join(c for c in rendered if c is not HOLE)
        shared = sum(w in literal for w in words)
        if shared or not words:
            candidates.append((-shared, path, rendered))
    candidates.sort(key=lambda c: c[0])  # the likeliest first: a match ends the search
    for _, path, rendered in candidates:
        if _literal_matched(pieces, rendered) >= needed:
            return str(path.relative_to(REPO))
    return None


ROWS = _rows()


def test_the_tables_have_rows() -> None:
    assert len(ROWS) >= 40  # guards the parser: a layout slip would check nothing


@pytest.mark.parametrize("line,cell", ROWS, ids=[f"line{n}" for n, _ in ROWS])
def test_each_quoted_message_is_in_the_source(line: int, cell: str) -> None:
    quotes = _quotes(cell)
    assert quotes, f"troubleshooting.md:{line}: no quoted message in {cell!r}"
    missing = [q for q in quotes if _found(q) is None]
    assert missing == [], f"troubleshooting.md:{line}: fsdp2/ has no such message: {missing}"


@pytest.mark.parametrize("quote", [
    "ValueError: fully_shard was applied twice to this X",  # reworded
    "KeyError: fully_shard was already applied to this X",  # another exception type
    "ValueError: fully_shard: mesh has 3 axes",  # a field's neighbour changed
    "CorruptCheckpointError: checkpoint P is broken: F is missing",
])
def test_a_changed_message_is_caught(quote: str) -> None:
    assert _found(quote) is None


def test_fields_and_elisions_match_anything() -> None:
    assert _found("ValueError: fully_shard was already applied to this X") is not None
    assert _found("ValueError: fully_shard: reshard_after_forward=3 must divide the mesh size 8")
    assert _found("ValueError: fsdp2: ranks disagree on the sharded model: ...")
