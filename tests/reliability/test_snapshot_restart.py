"""The recipe's in-memory snapshots under ``torchrun --max-restarts`` (recipes/snapshot.py).

Two nodes simulated on one machine (docs/multi-node.md: two ``torchrun --nnodes 2`` launches at
one c10d rendezvous, each with its own ``FSDP2_NODE`` and so its own snapshot area), one CPU
rank each, snapshots after every step (each also copied to the other node), 10 steps:
``faults.kill_after_step=7`` SIGKILLs rank 1 once step 7 is done (each slot of the
double-buffered area written three times or more by then), torchrun restarts both, and the
run must resume from the snapshot of step 7 (6 at worst), say so in one line with the steps
lost, and log the uninterrupted run's losses, gradient norms and learning rates bit for bit
from there on (the uninterrupted run: ``train()`` on two ranks of the test world). A second
launch (one node) snapshots every 3 steps and checkpoints every 6: killed after step 8, its
newest snapshot (6) is no newer than its newest checkpoint (6), and it resumes from the
checkpoint, saying so and that 2 steps were lost. Bad snapshot areas are refused before
anything starts, in one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.snapshot import snapshot_bytes
from recipes.checks import check_command
from recipes.config import ConfigError, parse_args
from tests._dist import _free_port, run_on_ranks
from tests._together import launched_together
from tests.reliability.test_checkpoint_faults import _train_logged
from tests.reliability.test_fault import BASE
from tests.tools.test_recipe import _train_on_ranks

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes" / "train.py"
STEPS = 10  # a kill after step 7 or 8: steps to resume from, and steps after
ARGS = [*BASE, f"--training.steps={STEPS}"]
KEYS = ("loss", "grad_norm", "lr")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("uninterrupted")
    run_on_ranks(_train_on_ranks, 2, [*ARGS, "--metrics-file", str(root / "metrics.jsonl")], timeout=240.0)
    return _records(root / "metrics.jsonl")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **extra}


def _numpy_free(root: Path) -> dict[str, str]:
    """Processes that cannot import numpy (torch does not need it; a fresh virtualenv lacks it)."""
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['numpy'] = None\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])}


def _launch(args: list[str], *, nodes: int, timeout: float = 400.0, env: dict[str, str] | None = None) -> str:
    """``recipes/train.py args`` under ``torchrun --max-restarts 3``: one launch of 2 ranks, or two
    launches of 1 rank (``FSDP2_NODE`` 0 and 1) at one rendezvous; their output together.
    ``env``: the processes' environment (default: this one's)."""
    port = _free_port()
    common = ["--max-restarts", "3", "--monitor-interval", "0.1"]
    if nodes == 1:
        cmds = [[*common, "--standalone", "--nproc-per-node", "2"]]
    else:
        cmds = [[*common, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"snapshots-{port}"]] * 2
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *cmd, str(TRAIN), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                              env=_env(**(env or {}), FSDP2_NODE=str(node))) for node, cmd in enumerate(cmds)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    output = "\n".join(outputs)
    assert all(proc.returncode == 0 for proc in procs), output
    return output


def _assert_same_from(root: Path, uninterrupted: list[dict], step: int) -> None:
    got = _records(root / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for mine, want in zip(got[step:], uninterrupted[step:]):
        assert {k: mine[k] for k in KEYS} == {k: want[k] for k in KEYS}, mine["step"]


def _killed_after_step_7_on_two_nodes(root: Path) -> str:
    # Without numpy, as in the Quickstart's virtualenv: the restore reads the bytes without it.
    return _launch([*ARGS, "--checkpoint.snapshot_every=1", f"--checkpoint.snapshot_dir={root / 'snapshots'}",
                    "--faults.kill_after_step=7", "--faults.kill_rank=1", "--metrics-file",
                    str(root / "metrics.jsonl")], nodes=2, env=_numpy_free(root))


def _killed_after_step_8_with_a_checkpoint_at_6(root: Path) -> str:
    return _launch([*ARGS, "--checkpoint.snapshot_every=3", f"--checkpoint.snapshot_dir={root / 'snap'}",
                    "--checkpoint-dir", str(root / "ckpt"), "--checkpoint-every", "6", "--faults.kill_after_step=8",
                    "--metrics-file", str(root / "metrics.jsonl")], nodes=1)


# The launch of each test below that this session runs, started together (tests/_together.py):
# test -> the future of (its directory, the launches' output).
launched = launched_together({
    "test_a_rank_killed_after_step_7_resumes_from_its_snapshot_on_two_nodes": _killed_after_step_7_on_two_nodes,
    "test_a_checkpoint_as_new_as_the_newest_snapshot_is_resumed_from": _killed_after_step_8_with_a_checkpoint_at_6,
})


@pytest.mark.slow  # two torchrun launches, a kill and a restart
def test_a_rank_killed_after_step_7_resumes_from_its_snapshot_on_two_nodes(launched, request, uninterrupted):
    tmp_path, output = launched[request.node.originalname].result()
    area = tmp_path / "snapshots"
    # (snapshot_background=auto: with peer copies, the step waits for each whole snapshot)
    assert "a copy to rank r + 1 on the next node (2 nodes); the step waits for each whole snapshot" in output, output
    resumed = re.findall(rf"resumed from snapshot {re.escape(str(area))}/node-[01] step (\d+) \(lost (\d+) steps\)",
                         output)
    assert len(resumed) == 1, output
    step, lost = map(int, resumed[0])
    assert step in (6, 7) and step + lost == 7, output
    _assert_same_from(tmp_path, uninterrupted, step)
    assert not any(area.rglob("*.snap")), "a finished run removes its snapshots"


@pytest.mark.slow  # a torchrun launch, a kill and a restart
def test_a_checkpoint_as_new_as_the_newest_snapshot_is_resumed_from(launched, request, uninterrupted):
    tmp_path, output = launched[request.node.originalname].result()
    ckpt = tmp_path / "ckpt"
    assert "one node: no peer copy" in output, output
    assert re.findall(r"resumed from \w+ .* step \d+ \(.*\)", output) == [
        f"resumed from checkpoint {ckpt} step 6 (lost 2 steps)"], output
    _assert_same_from(tmp_path, uninterrupted, 6)


def test_an_area_under_a_file_is_refused_before_anything_starts(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=rf"^checkpoint.snapshot_dir={re.escape(str(tmp_path / 'file' / 'x'))}: "
                                         rf"{re.escape(str(tmp_path / 'file'))} is missing \(no RAM file system"):
        check_command([*ARGS, "--checkpoint.snapshot_every=1", f"--checkpoint.snapshot_dir={tmp_path}/file/x"], 2)


def test_snapshot_background_takes_auto_or_a_bool():
    assert parse_args([]).checkpoint.snapshot_background == "auto"
    assert parse_args(["--checkpoint.snapshot_background=true"]).checkpoint.snapshot_background is True
    assert parse_args(["--checkpoint.snapshot_background=off"]).checkpoint.snapshot_background is False
    with pytest.raises(ConfigError, match=r"^checkpoint.snapshot_background must be one of 'auto' or a bool "
                                          r"\(true/false\), got 'sometimes'"):
        parse_args(["--checkpoint.snapshot_background=sometimes"])


def test_an_area_too_small_is_refused_naming_the_bytes_needed(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    # Llama-3-8B's shapes with enough layers that two ranks' snapshots exceed the free space.
    layers = 2 + free // snapshot_bytes(220_000_000, 2, 2, 1)
    argv = ["--config", str(REPO / "recipes" / "configs" / "llama3_8b.toml"), f"--model.n_layers={layers}",
            "--checkpoint.snapshot_every=auto", f"--checkpoint.snapshot_dir={tmp_path / 'snap'}"]
    with pytest.raises(ValueError, match=rf"^checkpoint.snapshot_dir={re.escape(str(tmp_path / 'snap'))} is too "
                                         r"small: snapshots need about (\d+) bytes on this node, (\d+) are free; "):
        check_command(argv, 2)


def test_auto_measures_the_second_snapshot_and_picks_the_smallest_interval_within_2_percent(tmp_path):
    area = tmp_path / "snap"
    results = run_on_ranks(_train_logged, 2, [*BASE, "--training.steps=8", "--checkpoint.snapshot_every=auto",
                                              f"--checkpoint.snapshot_dir={area}"], timeout=240.0)
    lines = results[0][2]
    assert results[1][2] == [], "only rank 0 logs"
    assert re.fullmatch(rf"INFO: snapshot: every step until measured \(auto\) in {re.escape(str(area))}/node-\S+; "
                        "one node: no peer copy, the snapshots do not survive the node; the checksum in the "
                        "background", lines[0]), lines
    measured = [line for line in lines if "measured at" in line]
    assert len(measured) == 1, lines
    match = re.fullmatch(r"INFO: snapshot: every (\d+) steps; measured at step 2: one snapshot costs ([\d.]+) ms "
                         r"\(copy [\d.]+, holding the step; in the background: checksum [\d.]+, peer copy 0\.0\), "
                         r"a step ([\d.]+) ms: ([\d.]+)% of the step time per step \(auto: the smallest interval "
                         r"within 2%\)", measured[0])
    assert match, measured
    every, cost, step, share = int(match[1]), float(match[2]), float(match[3]), float(match[4])
    assert share <= 2.0
    # The smallest such interval (the printed figures are rounded: a little slack).
    assert every == 1 or cost / (every - 1) / step > 0.0199, "a smaller interval would have been within 2%"
    assert not any(area.rglob("*.snap")), "a finished run removes its snapshots"
