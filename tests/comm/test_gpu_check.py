"""``benchmarks/gpu_check.sh``: the GPU check, run here in its CPU mode (``--dry-run``).

The script must work the day a GPU machine is lent (one H100, torch 2.11, no network, minutes
of device time): every step it takes runs here on CPU with small sizes, and the report it
writes is checked, so a broken step is found before the GPU time is spent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEPS = ("environment", "pytest -m cuda", "step time against torch FSDP2, DDP, no communication",
         "overhead at world 8, fake process group", "where the host time goes, CPU against cpu",
         "pytest -m cuda under TORCH_CUDA_SANITIZER=1")


def _run(*args: str, python: str = sys.executable, timeout: float = 600) -> subprocess.CompletedProcess:
    # As on the lent GPU machine, where torch and pytest are all there is: no third-party pytest
    # plugins (hypothesis, typeguard, ...) loaded by the script's two pytest steps; its test
    # files use none, and loading them costs each step seconds of CPU here.
    env = {**os.environ, "PYTHON": python, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("PYTHONPATH", None)  # the script must find the checkout by itself
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd="/")


def _summary(report: str) -> dict[str, str]:
    """The report's first table: step -> result."""
    rows = [line.split("|")[1:3] for line in report.splitlines() if line.startswith("| ") and "---" not in line]
    return {step.strip(): result.strip() for step, result in rows[1:]}


@pytest.mark.slow
def test_dry_run_takes_every_step_on_cpu_and_reports_them(tmp_path):
    report_path = tmp_path / "report.md"
    out = _run("--dry-run", "--report", str(report_path))
    assert out.returncode == 0, out.stdout + out.stderr
    report = report_path.read_text()
    summary = _summary(report)
    assert [s.split(" (")[0] for s in summary] == list(STEPS), summary
    assert set(summary.values()) == {"passed"}, summary
    results = [json.loads(line) for line in report.splitlines() if line.startswith('{"config"')]
    step = next(r for r in results if "median_s" in r)
    assert set(step["median_s"]) == {"fsdp2", "torch_fsdp2", "ddp", "nocomm"}
    assert step["config"]["device"] == "cpu" and step["config"]["world"] == 2
    assert step["last_loss_rank0"]["fsdp2"] == step["last_loss_rank0"]["torch_fsdp2"]
    overhead = next(r for r in results if "overhead_ms" in r)
    assert overhead["config"]["world"] == 8 and set(overhead["overhead_ms"]) == {"fsdp2", "torch_fsdp2"}
    # The dry run's 2 steps time noise: an overhead (a step less the plain model's) can come out
    # negative on a loaded machine, so the ratio's sign says nothing; it is reported, a number or
    # None (torch's overhead not positive).
    ratio = overhead["ratio"]["fsdp2/torch_fsdp2"]
    assert ratio is None or isinstance(ratio, float), overhead["ratio"]
    assert "fsdp2/torch_fsdp2" in report and "copy_" in report  # host_profile.py's summary lines
    # The CUDA tests were collected (and skipped here): the marker selects them.
    assert "tests/comm/test_cuda.py::test_cuda_parity_and_prefetch_schedule SKIPPED" in report
    assert f"torch {torch.__version__}" in report


def test_a_failing_step_fails_the_check_and_says_which(tmp_path):
    report_path = tmp_path / "report.md"
    out = _run("--dry-run", "--report", str(report_path), python="false", timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    summary = _summary(report_path.read_text())
    assert len(summary) == len(STEPS) and all(r == "FAILED (exit 1)" for r in summary.values()), summary
    assert "some steps failed" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
def test_without_a_gpu_it_asks_for_the_dry_run(tmp_path):
    out = _run("--report", str(tmp_path / "report.md"), timeout=120)
    assert out.returncode == 2
    assert "no CUDA device here" in out.stderr and "--dry-run" in out.stderr


def test_unknown_arguments_are_refused():
    out = _run("--dryrun", timeout=60)
    assert out.returncode == 2 and "unknown argument --dryrun" in out.stderr
