"""benchmarks/plan_accuracy.py runs end to end (``--quick``: 2 layouts of 3 steps on 2 CPU ranks)
and ends with its JSON line. Its figures are timings: none is asserted, only their presence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.plan_accuracy import spearman

ROOT = Path(__file__).resolve().parents[2]


def test_spearman_by_hand():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)  # 1 - 6 x 2 / (3 x 8)


@pytest.mark.slow
def test_quick_run_ends_with_the_json_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plan_accuracy.py"), "--quick"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    for key in ("spearman", "median_abs_error", "best_gap", "transport", "torch", "worlds", "rows"):
        assert key in result, key
    assert len(result["rows"]) == 2 and result["worlds"] == [2]
    for row in result["rows"]:
        assert {"layout", "predicted_s", "measured_s", "error"} <= set(row)
        assert row["layout"] in done.stdout.split(lines[-1])[0]  # the table lists every row
