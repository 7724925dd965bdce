"""The documentation's code examples run, and the API reference names every public name.

A ```python block in ``docs/*.md`` or ``README.md`` runs when the line right before its
fence (blank lines aside) is one of these HTML comments, invisible on GitHub:

- ``<!-- test: ranks=2 -->``: run on every rank of a 2-rank gloo world (``run_on_ranks``);
  ``torch.distributed`` is initialized, as under ``torchrun --nproc-per-node 2``.
- ``<!-- test: ranks=1 -->``: run once in the pytest process, with no process group.
- ``<!-- test: setup -->``: not run alone; prepended to every multi-rank example of its page
  (imports and a small model the page's examples share; it may use the process group).
  ``ranks=1`` blocks are self-contained.
- ``<!-- test: continue -->``: appended to the page's previous runnable block; they run as one
  example (e.g. save in one block, load in the next).

An example passes when it raises nothing; the ``assert`` statements in it are what it
checks. Each runs in a fresh temporary directory (the same one on every rank), so relative
paths like ``"ckpt"`` work. Code is compiled with the Markdown file as its filename and its
lines at their Markdown line numbers, so a failure's traceback points into the page.
"""

from __future__ import annotations

import inspect
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import fsdp2
import fsdp2.checkpoint
import fsdp2.memory
import fsdp2.plan
from tests._dist import run_on_ranks

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted(REPO.glob("docs/*.md")) + [REPO / "README.md"]
MARKER = re.compile(r"^\s*<!--\s*test(?::\s*(?P<options>.*?))?\s*-->\s*$")
FENCE = re.compile(r"^\s*```(?P<lang>[\w+-]*)\s*$")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line number of the block's first code line
    lines: list[str]
    marker: str | None  # the marker's options ("ranks=2", "setup", ...), None if unmarked


@dataclass
class Example:
    """One runnable unit: a marked block, with its page's setup and any continuations."""

    page: Path
    ranks: int
    blocks: list[Block] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.blocks[-1].line}"

    def source(self, setup: list[Block]) -> str:
        """The code with every line at its line number in the page (blank lines between)."""
        out: list[str] = []
        for block in [*setup, *self.blocks]:
            start = block.line - 1
            out.extend([""] * (start - len(out)))
            out[start:start + len(block.lines)] = block.lines
        return "\n".join(out) + "\n"


def _blocks(page: Path) -> tuple[list[Block], list[str]]:
    """Every ```python block of ``page`` with its marker, and marker errors found on the way."""
    blocks, errors = [], []
    lines = page.read_text().splitlines()
    rel = page.relative_to(REPO)
    i, pending = 0, None  # pending: (line number, options) of a marker awaiting its fence
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line)
        fence = FENCE.match(line)
        if marker:
            if pending is not None:
                errors.append(f"{rel}:{pending[0]}: test marker not followed by a ```python block")
            pending = (i + 1, (marker.group("options") or "").strip())
        elif fence:
            lang = fence.group("lang")
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            body = textwrap.dedent("\n".join(lines[i + 1:end])).splitlines()
            if lang == "python":
                blocks.append(Block(page, i + 2, body, pending[1] if pending else None))
            elif pending is not None:
                errors.append(f"{rel}:{pending[0]}: test marker before a ```{lang} block (only python runs)")
            pending = None
            i = end
        elif line.strip() and pending is not None:
            errors.append(f"{rel}:{pending[0]}: test marker not followed by a ```python block")
            pending = None
        i += 1
    if pending is not None:
        errors.append(f"{rel}:{pending[0]}: test marker at the end of the page")
    return blocks, errors


def _collect() -> tuple[list[Example], dict[Path, list[Block]], list[str]]:
    examples: list[Example] = []
    setups: dict[Path, list[Block]] = {}
    errors: list[str] = []
    for page in PAGES:
        blocks, page_errors = _blocks(page)
        errors += page_errors
        setups[page] = []
        last: Example | None = None
        for block in blocks:
            options = block.marker
            where = f"{page.relative_to(REPO)}:{block.line}"
            if options is None:
                continue
            if options == "setup":
                setups[page].append(block)
            elif options == "continue":
                if last is None:
                    errors.append(f"{where}: 'continue' with no runnable block before it on the page")
                else:
                    last.blocks.append(block)
            elif (m := re.fullmatch(r"ranks=(\d+)", options)) and int(m.group(1)) >= 1:
                last = Example(page, int(m.group(1)), [block])
                examples.append(last)
            else:
                errors.append(f"{where}: unknown test marker {options!r}; use ranks=N, setup or continue")
    return examples, setups, errors


EXAMPLES, SETUPS, MARKER_ERRORS = _collect()


def _exec_example(source: str, filename: str, workdir: str) -> None:
    """Run one example's code (on a rank, or in the pytest process) inside ``workdir``."""
    previous = os.getcwd()
    os.chdir(workdir)
    try:
        # Running the documentation's own code is the point of this test.
        exec(compile(source, filename, "exec"), {"__name__": "docs_example"})  # noqa: S102
    finally:
        os.chdir(previous)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_doc_example_runs(example: Example, tmp_path: Path) -> None:
    filename = str(example.page)
    if example.ranks == 1:
        _exec_example(example.source([]), filename, str(tmp_path))
    else:
        source = example.source(SETUPS[example.page])
        run_on_ranks(_exec_example, example.ranks, source, filename, str(tmp_path), timeout=60.0)


def test_doc_markers_are_well_formed() -> None:
    assert MARKER_ERRORS == []


def test_docs_have_runnable_examples() -> None:
    """Guards the collector: a marker-syntax slip would otherwise silently run nothing."""
    pages = {e.page.name for e in EXAMPLES}
    assert {"api.md", "recipes.md", "troubleshooting.md"} <= pages, pages
    assert sum(e.page.name == "api.md" for e in EXAMPLES) >= 20


# ---- links between pages resolve -------------------------------------------------------------
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, line) of ``page`` outside fenced code blocks."""
    out, in_code = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code:
            out.append((number, line))
    return out


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for _, line in _prose_lines(page) if line.startswith("#")}


def test_doc_links_resolve() -> None:
    broken = []
    for page in PAGES:
        for number, line in _prose_lines(page):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path) if path else page
                if not dest.exists():
                    broken.append(f"{page.relative_to(REPO)}:{number}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    broken.append(f"{page.relative_to(REPO)}:{number}: {target} (no such heading)")
    assert broken == []


# ---- the API reference is complete -----------------------------------------------------------
PUBLIC_PACKAGES = {"": fsdp2, "checkpoint": fsdp2.checkpoint, "plan": fsdp2.plan, "memory": fsdp2.memory}


def _public_names() -> list[str]:
    """``pkg.name`` for every name in each public package's ``__all__`` ("" for fsdp2 itself),
    and ``FSDPModule.method`` for every public method."""
    methods = [f"FSDPModule.{name}" for name, value in vars(fsdp2.FSDPModule).items()
               if not name.startswith("_") and inspect.isfunction(value)]
    names = [f"{pkg}.{name}".lstrip(".") for pkg, module in PUBLIC_PACKAGES.items() for name in module.__all__]
    return [*names, *methods]


def _api_sections() -> dict[str, list[str]]:
    """Heading text -> the lines of its section, for every heading of docs/api.md."""
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    in_code = False
    for line in (REPO / "docs" / "api.md").read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        if line.startswith("#") and not in_code:  # a "# comment" in a code block is no heading
            current = sections.setdefault(line.lstrip("#").strip(), [])
        else:
            current.append(line)
    return sections


def _section_of(name: str, sections: dict[str, list[str]]) -> str | None:
    """The heading documenting ``name``: it names it in backticks, as ``short``, ``pkg.short`` or
    ``fsdp2.pkg.short`` (e.g. "`fully_shard`", "`FSDPModule.unshard` and ...",
    "`fsdp2.checkpoint.save` and `fsdp2.checkpoint.load`"). A plan or memory name that fsdp2
    re-exports (``estimate_memory``, ``MemoryTracker``) may be documented under its fsdp2 name."""
    pkg, _, short = name.rpartition(".")
    module = PUBLIC_PACKAGES.get(pkg)
    reexported = module is not None and pkg and getattr(fsdp2, short, None) is getattr(module, short)
    for heading in sections:
        for ref in re.findall(r"`([\w.]+)(?:\(.*?\))?`", heading):
            prefix, _, ref_short = ref.rpartition(".")
            prefix = prefix.removeprefix("fsdp2").lstrip(".")
            if ref_short == short and (prefix == pkg or (reexported and prefix == "")):
                return heading
    return None


@pytest.mark.parametrize("name", _public_names())
def test_api_reference_has_an_entry_for_public_name(name: str) -> None:
    assert _section_of(name, _api_sections()) is not None, f"docs/api.md has no heading for {name}"


def _example_sources() -> str:
    return "\n".join("\n".join(line for block in e.blocks for line in block.lines) for e in EXAMPLES) + "\n" + \
        "\n".join("\n".join(b.lines) for blocks in SETUPS.values() for b in blocks)


# Names of the step-time model and the planner's command line: documented, exercised by
# tests/tools/test_plan_*.py and test_steptime.py rather than by a page's example.
NOT_IN_EXAMPLES = {"plan.Hardware", "plan.calibrate", "plan.ModelCosts", "plan.OpCost", "plan.StepTime",
                   "plan.check_fit", "plan.FitCheck", "plan.NOTHING_FITS", "plan.RESERVE_DEFAULTS", "plan.main",
                   "plan.MemoryEstimate"}


@pytest.mark.parametrize("name", [n for n in _public_names() if n not in NOT_IN_EXAMPLES])
def test_public_name_is_used_by_a_runnable_example(name: str) -> None:
    """Every public name runs in some page's example: called as ``x.name``, or imported by name."""
    short = name.rpartition(".")[2]
    source = _example_sources()
    imported = rf"^\s*from fsdp2[\w.]* import [^\n]*\b{short}\b"
    used = re.search(rf"\.{short}\b", source) or re.search(imported, source, re.M)
    assert used, f"no runnable example in docs/*.md or README.md uses {name}"
