"""Checkpoints never lose work: faults injected into real checkpoint files, the real recipe on 2 ranks.

One 2-rank run of ``train()`` (6 steps, a checkpoint every 2) makes sound checkpoints; each
test copies them into a fresh directory under the names it needs and damages them the way
real faults do: a shard cut short (a copy onto a full disk), ``.metadata`` deleted, the
completion marker deleted, a half-written ``.tmp-<id>`` directory (a save killed midway).
Then the recipe runs on them and the test checks what it chose, what is left on disk and
the one log line each save, prune, resume, fresh start and moved-aside checkpoint prints.

- Only unusable checkpoints: the run stops on every rank with an error naming each one and
  the flag that starts fresh; nothing on disk changes. With the flag it starts from step 0,
  the unusable ones are moved aside (not deleted) and never counted by pruning, so the new
  checkpoints survive (the issue-27 data loss: pruning deleted the new sound checkpoints
  and kept the corrupt ones).
- A corrupt newest checkpoint over a sound older one (cut short, 64 KiB overwritten in place
  and caught by its checksum, a shard or the marker deleted): the run resumes from the sound
  one, exactly (losses equal the uninterrupted run's), and moves the corrupt one aside in one
  line.
- Checkpoints that pass the checks but fail to load (missing keys; a pre-checksum one
  overwritten, which DCP meets): each is moved aside in one line and the next is loaded. When
  none is left the run stops in one line; a restart stops before building the model and never
  retries what was moved aside; the flag starts from step 0 over them.
- Under ``torchrun --max-restarts`` (``_faulty_train.py`` injects the fault into the first
  attempt): a rank SIGKILLed mid-save (a torn write), and a newest checkpoint overwritten in
  place before a rank dies; the restart resumes from the checkpoint before, with the
  uninterrupted run's losses, and needs no second restart.
- Async checkpoints (``--checkpoint.async_mode=async``): the same bytes as the synchronous
  run's, one line per save with how long training was blocked; a rank SIGKILLed in the
  background write (under torchrun) leaves the checkpoint before as the newest sound one,
  and the restart resumes from it with the uninterrupted run's losses. Ctrl-C: the one line
  names the last checkpoint in either mode.
- A checkpoint damaged while the run goes on is moved aside by pruning, which keeps the
  newest *sound* ones.
- Only leftovers of an interrupted save: a fresh start, saying so. A mistyped directory: a
  fresh start that names the directory and the close match holding checkpoints.
- No numpy (which DCP needs): the run stops before the first step with a clear message.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

import recipes.train as train_module
from fsdp2.checkpoint.__main__ import main as checkpoint_command
from fsdp2.checkpoint._checksum import crc32_of_file
from recipes.checkpoint import Checkpointer, UnusableCheckpointError
from recipes.launch import Interrupted, ctrl_c_after
from tests._dist import run_on_ranks
from tests._together import launched_together
from tests.reliability._faulty_train import overwrite_in_place
from tests.reliability.test_fault import BASE, _plain_setup
from tests.tools.test_recipe import _train_on_ranks, _without_numpy

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes" / "train.py"
ARGS = [*BASE, "--training.steps=6", "--checkpoint-every", "2", "--checkpoint.keep=2"]
FRESH = "--checkpoint.start_fresh_if_unusable"
MARKER = "fsdp2_complete.json"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


def _train_logged(argv: list[str]) -> tuple[int | None, str | None, list[str]]:
    """On every rank: (step resumed from, or None on error; the error; the recipe's log lines)."""
    handler, recipes_logger = _Records(), logging.getLogger("recipes")
    level = recipes_logger.level
    recipes_logger.addHandler(handler)
    recipes_logger.setLevel(logging.INFO)
    try:
        return _train_on_ranks(argv), None, handler.lines
    except UnusableCheckpointError as e:
        return None, str(e), handler.lines
    finally:
        recipes_logger.removeHandler(handler)
        recipes_logger.setLevel(level)


def _run(root: Path, *extra: str) -> tuple[list[int | None], list[str | None], list[str]]:
    """The recipe on 2 ranks over ``root/ckpt``: resumed steps, errors, and rank 0's log lines."""
    results = run_on_ranks(_train_logged, 2, [*ARGS, *extra, "--checkpoint-dir", str(root / "ckpt"),
                                              "--metrics-file", str(root / "metrics.jsonl")], timeout=240.0)
    assert results[1][2] == [], "only rank 0 logs"
    return [r[0] for r in results], [r[1] for r in results], results[0][2]


def _records(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def _listing(ckpt: Path) -> list[str]:
    """The directory's entries, ``.unusable-<id>`` suffixes shortened to ``.unusable``."""
    return sorted(re.sub(r"\.unusable-\w+$", ".unusable", p.name) for p in ckpt.iterdir())


@pytest.fixture(scope="module")
def sound(tmp_path_factory) -> Path:
    """A 2-rank run of ARGS with every checkpoint kept: step-2, step-4, step-6 and the metrics."""
    root = tmp_path_factory.mktemp("sound")
    run_on_ranks(_train_on_ranks, 2, [*ARGS, "--checkpoint.keep=0", "--checkpoint-dir", str(root / "ckpt"),
                                      "--metrics-file", str(root / "metrics.jsonl")], timeout=240.0)
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == ["step-00000002", "step-00000004", "step-00000006"]
    return root


def _copy(sound: Path, step: int, dest: Path, as_step: int | None = None) -> Path:
    target = dest / "ckpt" / f"step-{as_step or step:08d}"
    shutil.copytree(sound / "ckpt" / f"step-{step:08d}", target)
    return target


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _snapshot(root: Path) -> dict[str, int]:
    return {str(f.relative_to(root)): f.stat().st_size for f in sorted(root.rglob("*")) if f.is_file()}


# ---- damage found by the checks, before anything is loaded ------------------------------------
def _same_size_overwrite(checkpoint: Path) -> None:
    overwrite_in_place(checkpoint / "__1_0.distcp")  # up to 64 KiB, other bytes: a bad sector


DAMAGE = {  # what is done to the newest checkpoint, what the line moving it aside says
    "truncated": (lambda c: _truncate(c / "__0_0.distcp"), "(__0_0.distcp is "),
    "same-size overwrite": (_same_size_overwrite, "(__1_0.distcp does not match its checksum (CRC-32 "),
    "shard deleted": (lambda c: (c / "__1_0.distcp").unlink(), "(__1_0.distcp is missing)"),
    "marker deleted": (lambda c: (c / MARKER).unlink(), "has no completion marker fsdp2_complete.json"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_run_resumes_exactly(sound, tmp_path, damage):
    _copy(sound, 2, tmp_path)
    _copy(sound, 4, tmp_path)
    harm, said = DAMAGE[damage]
    harm(_copy(sound, 6, tmp_path))
    starts, errors, lines = _run(tmp_path)
    assert starts == [4, 4] and errors == [None, None]
    ckpt = tmp_path / "ckpt"
    assert lines[0].startswith(f"WARNING: checkpoint: {ckpt / 'step-00000006'} is unusable (") and said in lines[0]
    assert "; moved it to step-00000006.unusable-" in lines[0]
    assert lines[1] == f"INFO: checkpoint: resumed from {ckpt / 'step-00000004'} at step 4"
    assert _listing(ckpt) == ["step-00000004", "step-00000006", "step-00000006.unusable"]
    got, want = _records(tmp_path / "metrics.jsonl"), _records(sound / "metrics.jsonl")
    assert sorted(got) == [5, 6]
    for step in (5, 6):
        for key in ("loss", "grad_norm", "lr"):
            assert got[step][key] == want[step][key], (step, key)


# ---- damage the checks cannot see: the load fails, the next checkpoint is tried ------------------
def _without_a_key(checkpoint: Path, key: str) -> None:
    """A checkpoint consistent in itself (sizes, sums) that lacks ``key``: another model's, say."""
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    del metadata.state_dict_metadata[key]
    with open(checkpoint / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    _reseal(checkpoint)


def _reseal(checkpoint: Path, *, sums: bool = True) -> None:
    """Rewrite the marker to match the files as they are now (with no sums: a version 2 marker)."""
    marker = json.loads((checkpoint / MARKER).read_text())
    marker["files"] = {p.name: p.stat().st_size for p in sorted(checkpoint.iterdir()) if p.name != MARKER}
    marker["bytes"] = sum(marker["files"].values())
    marker["crc32"] = {name: crc32_of_file(checkpoint / name) for name in marker["files"]}
    if not sums:
        del marker["crc32"]
        marker["version"] = 2
    (checkpoint / MARKER).write_text(json.dumps(marker))


def test_checkpoints_that_fail_to_load_are_moved_aside_until_one_loads(sound, tmp_path):
    _copy(sound, 2, tmp_path)
    # Saved before markers kept sums, then overwritten in place: only DCP's read finds it.
    older = _copy(sound, 4, tmp_path)
    _reseal(older, sums=False)
    overwrite_in_place(older / "__0_0.distcp")
    _without_a_key(_copy(sound, 6, tmp_path), "model.norm.weight")

    starts, errors, lines = _run(tmp_path)
    assert starts == [2, 2] and errors == [None, None]
    ckpt = tmp_path / "ckpt"
    assert lines[0].startswith(f"WARNING: checkpoint: {ckpt / 'step-00000006'} could not be loaded (RuntimeError: "
                               "Missing key in checkpoint state_dict: model.norm.weight")
    assert lines[1].startswith(f"WARNING: checkpoint: {ckpt / 'step-00000004'} could not be loaded (")
    for line in lines[:2]:
        assert "; moved it to step-0000000" in line and line.endswith("(kept for inspection, never loaded again)")
    assert lines[2] == f"INFO: checkpoint: resumed from {ckpt / 'step-00000002'} at step 2"
    got, want = _records(tmp_path / "metrics.jsonl"), _records(sound / "metrics.jsonl")
    for step in (3, 4, 5, 6):
        for key in ("loss", "grad_norm", "lr"):
            assert got[step][key] == want[step][key], (step, key)
    assert _listing(ckpt) == ["step-00000004", "step-00000004.unusable", "step-00000006", "step-00000006.unusable"]


def _train_counting_builds(argv: list[str]) -> tuple[int | None, str | None, list[str], int]:
    """``_train_logged``, and how many times this rank built the model."""
    built = []
    build = train_module.build_model

    def counting(*args, **kwargs):
        built.append(True)
        return build(*args, **kwargs)

    train_module.build_model = counting
    try:
        return (*_train_logged(argv), len(built))
    finally:
        train_module.build_model = build


def test_no_sound_checkpoint_left_stops_before_the_model_is_built(sound, tmp_path):
    _without_a_key(_copy(sound, 6, tmp_path), "model.norm.weight")
    ckpt = tmp_path / "ckpt"
    argv = [*ARGS, "--checkpoint-dir", str(ckpt), "--metrics-file", str(tmp_path / "metrics.jsonl")]
    first = run_on_ranks(_train_counting_builds, 2, argv, timeout=240.0)
    # The checks pass, the load fails: it is moved aside, nothing else is left, the run stops.
    assert [r[0] for r in first] == [None, None] and first[0][1] == first[1][1]
    assert first[0][1].startswith(f"checkpoint.dir {ckpt} holds no usable checkpoint: step-00000006.unusable-")
    assert f"(moved aside earlier). Starting from step 0 would ignore them: run again with {FRESH} to start from " \
        "step 0 (if the model's configuration changed since they were saved, rename them back" in first[0][1]
    assert len(first[0][2]) == 1 and "could not be loaded (RuntimeError: Missing key" in first[0][2][0]
    # A restart does not try it again, and stops before building anything.
    again = run_on_ranks(_train_counting_builds, 2, argv, timeout=240.0)
    assert [r[0] for r in again] == [None, None] and [r[3] for r in again] == [0, 0]
    aside = first[0][1].split(" (moved aside earlier)")[0]
    assert again[0][1] == (f"{aside} (moved aside earlier). Starting from step 0 would ignore them: rename one back "
                           f"to its step-N name once repaired, or pass {FRESH} to start from step 0")
    assert again[0][2] == [], "nothing moved, loaded or started"
    assert not (tmp_path / "metrics.jsonl").exists()
    # Told to, it starts from step 0 over them, as an uninterrupted run.
    fresh = run_on_ranks(_train_counting_builds, 2, [*argv, FRESH], timeout=240.0)
    assert [r[0] for r in fresh] == [0, 0]
    assert fresh[0][2][0] == f"INFO: checkpoint: starting from step 0: no usable checkpoint in {ckpt} ({FRESH})"
    got, want = _records(tmp_path / "metrics.jsonl"), _records(sound / "metrics.jsonl")
    assert [got[s]["loss"] for s in got] == [want[s]["loss"] for s in want]


# ---- faults in a real run under torchrun --max-restarts --------------------------------------------
FAULTY = REPO / "tests" / "reliability" / "_faulty_train.py"


def _torchrun_with_fault(root: Path, fault: str, restarts: int, extra: tuple[str, ...] = ()) -> str:
    """``_faulty_train.py`` (train.py, ``fault`` injected into the first attempt) under torchrun; its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           str(restarts), "--monitor-interval", "0.1", str(FAULTY), *ARGS, *extra, "--checkpoint-dir",
           str(root / "ckpt"), "--metrics-file", str(root / "metrics.jsonl")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FSDP2_TEST_FAULT": fault}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout
    assert "torchrun restart 1" in proc.stdout and "torchrun restart 2" not in proc.stdout, proc.stdout
    return proc.stdout


# test -> the fault injected into its launch, torchrun's --max-restarts, more arguments
FAULTS = {
    "test_a_save_torn_by_a_kill_resumes_from_the_checkpoint_before": ("torn:6", 1, ()),
    "test_a_same_size_corrupted_checkpoint_under_max_restarts_resumes_from_the_one_before": ("corrupt:4", 3, ()),
    "test_a_kill_during_an_async_write_resumes_from_the_checkpoint_before":
        ("async-torn:4", 1, ("--checkpoint.async_mode=async",)),
}


# ``_torchrun_with_fault`` of each test of ``FAULTS`` this session runs, started together
# (tests/_together.py): test -> the future of (its directory, the launch's output).
faulty_runs = launched_together({name: lambda root, fault=fault: _torchrun_with_fault(root, *fault)
                                 for name, fault in FAULTS.items()})


def _assert_uninterrupted(root: Path, sound: Path) -> None:
    """Every step recorded once, with the uninterrupted run's loss, gradient norm and learning rate."""
    steps = [json.loads(line)["step"] for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))
    got, want = _records(root / "metrics.jsonl"), _records(sound / "metrics.jsonl")
    for step in range(1, 7):
        for key in ("loss", "grad_norm", "lr"):
            assert got[step][key] == want[step][key], (step, key)


def _assert_resumed_over_a_torn_save(root: Path, sound: Path, output: str, *, torn: int, resumed: int) -> None:
    """The restart removed the torn save of step ``torn``, resumed from step ``resumed`` and ran
    as the uninterrupted run; the newest 2 checkpoints are left."""
    ckpt = root / "ckpt"
    assert re.search(rf"checkpoint: removed {re.escape(str(ckpt / f'step-{torn:08d}'))}\.tmp-\w+, left by an "
                     "interrupted save or prune", output), output
    assert f"checkpoint: resumed from {ckpt / f'step-{resumed:08d}'} at step {resumed}" in output, output
    _assert_uninterrupted(root, sound)
    assert _listing(ckpt) == ["step-00000004", "step-00000006"]


@pytest.mark.slow  # torchrun, a kill and a restart
def test_a_save_torn_by_a_kill_resumes_from_the_checkpoint_before(sound, faulty_runs, request):
    root, output = faulty_runs[request.node.originalname].result()
    _assert_resumed_over_a_torn_save(root, sound, output, torn=6, resumed=4)


@pytest.mark.slow  # torchrun, a kill and a restart
def test_a_same_size_corrupted_checkpoint_under_max_restarts_resumes_from_the_one_before(sound, faulty_runs,
                                                                                          request):
    # The first attempt saves step 4, a bad sector overwrites 64 KiB of it, the rank dies; the
    # restart must not load it (before: ~90 lines of traceback on every restart, for good).
    root, output = faulty_runs[request.node.originalname].result()
    ckpt = root / "ckpt"
    moved = [line for line in output.splitlines() if "is unusable" in line]
    assert len(moved) == 1 and f"checkpoint: {ckpt / 'step-00000004'} is unusable (__0_0.distcp does not match " \
        "its checksum (CRC-32 " in moved[0], output
    assert f"checkpoint: resumed from {ckpt / 'step-00000002'} at step 2" in output, output
    assert "; moved it to step-00000004.unusable-" in moved[0]
    _assert_uninterrupted(root, sound)
    assert _listing(ckpt) == ["step-00000004", "step-00000004.unusable", "step-00000006"]


@pytest.mark.slow  # torchrun, a kill and a restart
def test_a_kill_during_an_async_write_resumes_from_the_checkpoint_before(sound, faulty_runs, request):
    # Rank 1 dies in the background write of step 4 while its training goes on: no marker is
    # written, step 2 stays the newest sound checkpoint and the restart resumes from it exactly.
    root, output = faulty_runs[request.node.originalname].result()
    _assert_resumed_over_a_torn_save(root, sound, output, torn=4, resumed=2)


def test_async_checkpoints_equal_the_synchronous_ones_and_say_how_long_training_was_blocked(sound, tmp_path):
    resumed, errors, lines = _run(tmp_path, "--checkpoint.keep=0", "--checkpoint.async_mode=async")
    assert resumed == [0, 0] and errors == [None, None]
    _assert_uninterrupted(tmp_path, sound)
    ckpt = tmp_path / "ckpt"
    for step in (2, 4, 6):  # the same bytes: each holds the state at its step, not a later one
        name = f"step-{step:08d}"
        got, want = (json.loads((root / name / MARKER).read_text())["crc32"] for root in (ckpt, sound / "ckpt"))
        assert {k: v for k, v in got.items() if k.endswith(".distcp")} == \
            {k: v for k, v in want.items() if k.endswith(".distcp")}, step
    saving = [line for line in lines if "in the background (training blocked" in line]
    assert [line.split(" to ")[0] for line in saving] == [f"INFO: checkpoint: saving step {s}" for s in (2, 4, 6)]
    assert "of which" not in saving[0] and all(", of which " in line for line in saving[1:]), saving
    saved = [line for line in lines if line.startswith("INFO: checkpoint: saved step")]
    assert len(saved) == 3 and all(line.endswith("in the background)") for line in saved), saved


# ---- only unusable checkpoints ------------------------------------------------------------------
def test_only_unusable_checkpoints_stop_the_run_unless_told_to_start_fresh(sound, tmp_path):
    _truncate(_copy(sound, 6, tmp_path, as_step=200) / "__0_0.distcp")  # a copy cut short
    (_copy(sound, 6, tmp_path, as_step=300) / ".metadata").unlink()  # DCP's index lost
    before = _snapshot(tmp_path / "ckpt")

    starts, errors, lines = _run(tmp_path)
    assert starts == [None, None], "every rank stops, none trains"
    assert errors[0] == errors[1] and errors[0].startswith(f"checkpoint.dir {tmp_path / 'ckpt'} holds no usable "
                                                           "checkpoint: step-00000300 (.metadata is missing); "
                                                           "step-00000200 (__0_0.distcp is ")
    assert FRESH in errors[0]
    assert lines == [], "nothing was resumed, started, saved or moved"
    assert _snapshot(tmp_path / "ckpt") == before, "nothing on disk changed"
    assert not (tmp_path / "metrics.jsonl").exists()

    starts, errors, lines = _run(tmp_path, FRESH)
    assert starts == [0, 0] and errors == [None, None]
    ckpt = tmp_path / "ckpt"
    assert lines[0].startswith(f"WARNING: checkpoint: {ckpt / 'step-00000300'} is unusable (.metadata is missing); "
                               "moved it to step-00000300.unusable-")
    assert lines[1].startswith(f"WARNING: checkpoint: {ckpt / 'step-00000200'} is unusable (__0_0.distcp is ")
    assert lines[2] == f"INFO: checkpoint: starting from step 0: no usable checkpoint in {ckpt} ({FRESH})"
    assert [line.split(" to ")[0] for line in lines[3:]] == [f"INFO: checkpoint: saved step {s}" for s in (2, 4, 6)]
    assert lines[-1].endswith(" s); pruned step 2") and "pruned" not in "".join(lines[:-1])
    # The new sound checkpoints are kept; the unusable ones were set aside, whole, and never counted.
    assert _listing(ckpt) == ["step-00000004", "step-00000006", "step-00000200.unusable", "step-00000300.unusable"]
    aside = {p.name.split(".")[0]: p for p in ckpt.iterdir() if ".unusable-" in p.name}
    assert _snapshot(aside["step-00000200"]) == {k.split("/", 1)[1]: v for k, v in before.items()
                                                 if k.startswith("step-00000200/")}
    # The fresh run is the uninterrupted run.
    got, want = _records(tmp_path / "metrics.jsonl"), _records(sound / "metrics.jsonl")
    assert [got[s]["loss"] for s in got] == [want[s]["loss"] for s in want]

    starts, _, lines = _run(tmp_path)  # run again: resumes from the newest, nothing to do
    assert starts == [6, 6]
    assert lines == [f"INFO: checkpoint: resumed from {ckpt / 'step-00000006'} at step 6"]


def test_a_checkpoint_without_its_marker_is_unusable_not_ignored(sound, tmp_path):
    # A marker deleted (or a checkpoint copied without it): before, the run started over silently.
    (_copy(sound, 4, tmp_path) / "fsdp2_complete.json").unlink()
    starts, errors, _ = _run(tmp_path)
    assert starts == [None, None]
    assert "step-00000004 (" in errors[0] and "has no completion marker" in errors[0]


# ---- a sound checkpoint under corrupt newer ones --------------------------------------------------
def test_corrupt_newest_checkpoint_resumes_exactly_from_the_newest_sound_one(sound, tmp_path):
    _copy(sound, 2, tmp_path)
    _truncate(_copy(sound, 4, tmp_path) / "__1_0.distcp")
    (_copy(sound, 6, tmp_path) / ".metadata").write_bytes(b"\x80")  # not a pickle any more

    starts, errors, lines = _run(tmp_path)
    assert starts == [2, 2] and errors == [None, None]
    ckpt = tmp_path / "ckpt"
    assert lines[0].startswith(f"WARNING: checkpoint: {ckpt / 'step-00000006'} is unusable "
                               "(.metadata is 1 bytes but was saved with ")
    assert lines[1].startswith(f"WARNING: checkpoint: {ckpt / 'step-00000004'} is unusable (__1_0.distcp is ")
    assert lines[2] == f"INFO: checkpoint: resumed from {ckpt / 'step-00000002'} at step 2"
    assert lines[-1].endswith(" s); pruned step 2")
    assert _listing(ckpt) == ["step-00000004", "step-00000004.unusable", "step-00000006", "step-00000006.unusable"]
    got, want = _records(tmp_path / "metrics.jsonl"), _records(sound / "metrics.jsonl")
    for step in (3, 4, 5, 6):
        for key in ("loss", "grad_norm", "lr"):
            assert got[step][key] == want[step][key], (step, key)


def _recipe_messages(caplog) -> list[str]:
    """What the recipe's checkpointer logged (torch 2.11's DCP logs a record of its own per save)."""
    return [r.getMessage() for r in caplog.records if r.name == "recipes.checkpoint"]


def test_pruning_keeps_the_newest_sound_checkpoints_and_sets_corrupt_ones_aside(tmp_path, caplog):
    # Single process, the recipe's Checkpointer on real files: a checkpoint damaged after its save.
    root = tmp_path / "ckpt"
    checkpointer = Checkpointer(root, keep=2)
    model, optimizer, scheduler = _plain_setup(seed=0)
    for step in (1, 2):
        checkpointer.save(step, model, optimizer, scheduler)
    _truncate(root / "step-00000002" / "__0_0.distcp")
    with caplog.at_level(logging.INFO, logger="recipes.checkpoint"):
        checkpointer.save(3, model, optimizer, scheduler)
    # Before: keep the two highest step numbers, i.e. delete step 1, the only other sound one.
    assert _listing(root) == ["step-00000001", "step-00000002.unusable", "step-00000003"]
    messages = _recipe_messages(caplog)
    assert messages[0].startswith(f"checkpoint: {root / 'step-00000002'} is unusable (__0_0.distcp is ")
    assert messages[0].endswith("instead of counting it among the 2 kept")
    assert messages[1].startswith(f"checkpoint: saved step 3 to {root / 'step-00000003'} (")
    assert messages[1].endswith(" s)"), "nothing pruned: steps 1 and 3 are the newest two sound checkpoints"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="recipes.checkpoint"):
        checkpointer.save(4, model, optimizer, scheduler)
    assert _recipe_messages(caplog)[-1].endswith(" s); pruned step 1")
    assert _listing(root) == ["step-00000002.unusable", "step-00000003", "step-00000004"]


# ---- fresh starts that say why ------------------------------------------------------------------
def test_half_written_save_only_starts_fresh_and_says_so(sound, tmp_path):
    leftover = _copy(sound, 2, tmp_path, as_step=2)
    (leftover / "fsdp2_complete.json").unlink()
    leftover.rename(leftover.with_name("step-00000002.tmp-0123456789ab"))  # a save killed midway
    starts, errors, lines = _run(tmp_path, "--training.steps=2")
    assert starts == [0, 0] and errors == [None, None]
    ckpt = tmp_path / "ckpt"
    assert lines[:2] == [
        f"INFO: checkpoint: removed {ckpt / 'step-00000002.tmp-0123456789ab'}, left by an interrupted save or prune",
        f"INFO: checkpoint: starting from step 0: no checkpoint in {ckpt} (removed 1 interrupted save)",
    ]
    assert lines[2].startswith(f"INFO: checkpoint: saved step 2 to {ckpt / 'step-00000002'} (") and len(lines) == 3


def test_mistyped_checkpoint_dir_names_the_close_match(tmp_path, caplog):
    checkpointer = Checkpointer(tmp_path / "ckpt")
    model, optimizer, scheduler = _plain_setup(seed=0)
    checkpointer.save(7, model, optimizer, scheduler)
    with caplog.at_level(logging.INFO, logger="recipes.checkpoint"):
        assert Checkpointer(tmp_path / "ckpts").resume(model, optimizer, scheduler) is None
        assert Checkpointer(tmp_path / "other").resume(model, optimizer, scheduler) is None
    assert _recipe_messages(caplog) == [
        f"checkpoint: starting from step 0: {tmp_path / 'ckpts'} does not exist yet (did you mean "
        f"{tmp_path / 'ckpt'}? it holds checkpoints up to step 7); the first save creates it",
        f"checkpoint: starting from step 0: {tmp_path / 'other'} does not exist yet; the first save creates it",
    ]


# ---- a missing dependency, before the first step ------------------------------------------------
@pytest.mark.slow
def test_checkpointing_without_numpy_stops_before_the_first_step(tmp_path):
    env = _without_numpy(tmp_path)
    proc = subprocess.run([sys.executable, str(TRAIN), *ARGS, "--checkpoint-dir", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == (f"error: checkpoint.dir={tmp_path / 'ckpt'}: checkpoints need numpy "
                           "(torch.distributed.checkpoint's object collectives use it): "
                           "pip install -e '.[checkpoint]' (or pip install numpy)\n")
    assert not (tmp_path / "ckpt").exists()


# ---- the offline export takes the run's directory -----------------------------------------------
def _export(source: Path, out: Path) -> subprocess.Popen:
    """``python -m fsdp2.checkpoint export source out``, started; ``communicate()`` gives its stdout, stderr."""
    return subprocess.Popen([sys.executable, "-m", "fsdp2.checkpoint", "export", str(source), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


@pytest.mark.slow
def test_export_of_a_run_directory_takes_the_newest_sound_checkpoint(sound, tmp_path):
    from safetensors.torch import load_file

    _copy(sound, 2, tmp_path)
    _copy(sound, 4, tmp_path)
    _truncate(_copy(sound, 6, tmp_path) / "__0_0.distcp")
    shutil.copytree(sound / "ckpt" / "step-00000006", tmp_path / "ckpt" / "step-00000008.tmp-0123456789")
    ckpt = tmp_path / "ckpt"
    unsound = shutil.copytree(ckpt, tmp_path / "unsound")  # the same, with no sound checkpoint left
    (unsound / "step-00000002" / ".metadata").unlink()
    (unsound / "step-00000004" / "fsdp2_complete.json").write_text("{")
    # Two commands, each a process of its own, started together (each start is seconds of one core).
    run_proc, none_proc = _export(ckpt, tmp_path / "run.safetensors"), _export(unsound, tmp_path / "none.safetensors")
    try:
        # The reference: step 4 exported by name, in this process (the command's main(), a start saved).
        assert checkpoint_command(["export", str(ckpt / "step-00000004"), str(tmp_path / "step.safetensors")]) == 0
        (stdout, stderr), (_, none_stderr) = run_proc.communicate(timeout=120), none_proc.communicate(timeout=120)
    finally:
        for proc in (run_proc, none_proc):
            proc.kill()
            proc.wait()
    assert run_proc.returncode == 0, stderr
    assert stderr.startswith("skipped step-00000006: __0_0.distcp is ")
    assert stdout.startswith(f"wrote 21 tensors from {ckpt / 'step-00000004'} to {tmp_path / 'run.safetensors'}")
    run, step = load_file(tmp_path / "run.safetensors"), load_file(tmp_path / "step.safetensors")
    assert run.keys() == step.keys() and all(run[k].equal(step[k]) for k in run)

    assert none_proc.returncode == 2 and not (tmp_path / "none.safetensors").exists()
    assert f"error: {unsound} is not a DCP checkpoint and holds no sound one: skipped step-00000006: " in none_stderr
    assert "skipped step-00000004: fsdp2_complete.json is unreadable" in none_stderr
    assert "skipped step-00000002: .metadata is missing" in none_stderr


# ---- Ctrl-C: one line, with the step to resume from ----------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["off", "async"])  # async: the save in flight is finished first
def test_ctrl_c_prints_one_line_with_the_last_checkpoint(tmp_path, mode):
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    cmd = [sys.executable, str(TRAIN), *BASE, "--training.steps=100000", "--checkpoint-every", "2",
           "--checkpoint-dir", str(ckpt), f"--checkpoint.async_mode={mode}"]
    # As from a terminal: Ctrl-C's default disposition (a shell's background job, CI's included,
    # would hand the run SIGINT ignored, which the recipe respects).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / "step-00000004" / "fsdp2_complete.json").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint at step 4"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    match = re.fullmatch(r"interrupted during step (\d+); the last checkpoint is step (\d+) in "
                         rf"{re.escape(str(ckpt))}: run the same command to resume from it\n", stderr)
    assert match, stderr
    interrupted, last = map(int, match.groups())
    assert 4 <= last <= interrupted and last % 2 == 0  # equal: Ctrl-C came during that step's save
    assert f"checkpoint: saved step {last} to {ckpt / f'step-{last:08d}'}" in stdout
    assert (ckpt / f"step-{last:08d}" / "fsdp2_complete.json").is_file()
    assert "Traceback" not in stdout + stderr


def test_ctrl_c_during_a_save_lets_the_save_finish_then_stops():
    # Inside a DCP save the interrupt became DCP's CheckpointException (a traceback, the save
    # half-written: seen in CI); held, the save completes and the interrupt comes after it.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        finished = []
        with pytest.raises(KeyboardInterrupt):
            with ctrl_c_after():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler has run by now
                finished.append(True)
        assert finished == [True]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
        with ctrl_c_after():  # nothing held: nothing raised
            pass
        # A process that ignores SIGINT (started in the background by a shell) still ignores it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with ctrl_c_after():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_ctrl_c_between_a_save_and_its_record_names_the_checkpoint_on_disk(tmp_path):
    # The save renamed step 4 into place (complete) and the interrupt came before save() returned
    # to record it: the hint names step 4, which a rerun resumes from, not the step 2 recorded.
    for step in (2, 4):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / "fsdp2_complete.json").write_text("{}")
    (tmp_path / "step-00000006.tmp-abc").mkdir()  # a save still being written: not a checkpoint
    checkpointer = Checkpointer(tmp_path)
    checkpointer.last_step = 2
    assert str(Interrupted(5, checkpointer, 2)) == (
        f"interrupted during step 5; the last checkpoint is step 4 in {tmp_path}: run the same command to "
        "resume from it")
