"""The tree is clean under ruff, configured in pyproject.toml ([tool.ruff]).

ruff is in the ``test`` extra (CI installs it), so a missing ruff fails here rather than
skipping: a skip would let findings through unnoticed.
"""
from __future__ import annotations

import subprocess
import sys

from tests._dist import REPO_ROOT


def test_ruff_check_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert "No module named ruff" not in out.stderr, "ruff is missing: pip install -e '.[test]' (or pip install ruff)"
    assert out.returncode == 0, f"ruff check . found problems (fix them, or see [tool.ruff] in pyproject.toml):\n" \
                                f"{out.stdout}{out.stderr}"
