"""Watching a recipe run: validation loss, profiler traces, memory snapshots, TensorBoard, initial weights.

- Validation (``--validation.*``) holds out the data's tail: its loss is recorded at every
  ``freq`` steps and the last; validating changes nothing about training (the same losses
  whatever ``freq``), and a resumed run reports the uninterrupted run's validation losses.
- ``--checkpoint.initial_load_path``: a fresh run starts from the weights of an exported
  safetensors file or of a DCP checkpoint (a run's directory or a step directory, and into
  another layout): with a learning rate of 1e-12 its validation loss after one step is the
  source run's final one. A run that resumes from its own checkpoint ignores it.
- Under torchrun (2 ranks): the profiler writes a Chrome trace per traced step and rank, with
  fsdp2's collectives named; the memory snapshot on CPU is fsdp2.MemoryTracker's table, and the
  run says why; TensorBoard gets every record (where tensorboard is installed: the test extra).
- Bad requests stop before the first step with one line: tensorboard missing, an initial load
  path that is missing, not loadable or holds no checkpoint, a held-out split smaller than a
  sequence.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.data import split_corpus
from recipes.train import main as train_main
from tests._dist import run_on_ranks
from tests.tools.test_recipe import REPO, SMALL_MODEL, TRAIN, _records, _train_on_ranks

BASE = [*SMALL_MODEL, "--training.batch_size=4", "--training.warmup_steps=2", "--training.lr=1e-2",
        "--metrics.log_every=1", "--metrics.sample_tokens=0", "--metrics.plot=false"]
VALIDATION = ["--validation.enable", "--validation.steps=2"]
# One step at a negligible learning rate: the weights after it are the loaded ones (to ~1e-12).
STILL = ["--training.steps=1", "--training.warmup_steps=1", "--training.lr=1e-12", "--validation.freq=1"]


def _val_losses(path: Path) -> dict[int, float]:
    return {step: r["val_loss"] for step, r in _records(path).items() if "val_loss" in r}


# ---- validation ------------------------------------------------------------------------------
def test_split_holds_out_the_tail():
    corpus = torch.arange(1000) % 256
    train, held_out = split_corpus(corpus, 0.05)
    assert (train.numel(), held_out.numel()) == (950, 50)
    assert torch.equal(torch.cat([train, held_out]), corpus)


def test_validation_loss_is_recorded_changes_nothing_and_resumes(tmp_path):
    every2 = [*BASE, *VALIDATION, "--training.steps=6", "--validation.freq=2"]
    run_on_ranks(_train_on_ranks, 2, [*every2, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3",
                                      "--metrics-file", str(tmp_path / "a.jsonl")], timeout=240.0)
    run_on_ranks(_train_on_ranks, 2, [*BASE, *VALIDATION, "--training.steps=6", "--validation.freq=100",
                                      "--metrics-file", str(tmp_path / "b.jsonl")], timeout=240.0)
    a, b = _records(tmp_path / "a.jsonl"), _records(tmp_path / "b.jsonl")
    validated = _val_losses(tmp_path / "a.jsonl")
    assert sorted(validated) == [2, 4, 6]
    assert all(math.isfinite(v) for v in validated.values())
    assert validated[6] < validated[2] < math.log(256), validated
    assert sorted(_val_losses(tmp_path / "b.jsonl")) == [6]  # not a multiple of 100: the last step only
    # Validating every 2 steps or only at the end: the same training, bit for bit.
    assert [a[s]["loss"] for s in range(1, 7)] == [b[s]["loss"] for s in range(1, 7)]
    assert b[6]["val_loss"] == a[6]["val_loss"]
    # Resumed from step 3 (as after a crash): steps 4-6 report the same losses, validation included.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ckpt" / "step-00000003", resumed / "step-00000003")
    shutil.copy(tmp_path / "a.jsonl", tmp_path / "c.jsonl")
    starts = run_on_ranks(_train_on_ranks, 2, [*every2, "--checkpoint-dir", str(resumed),
                                               "--metrics-file", str(tmp_path / "c.jsonl")], timeout=240.0)
    assert starts == [3, 3]
    c = _records(tmp_path / "c.jsonl")
    assert [(c[s]["loss"], c[s].get("val_loss")) for s in range(4, 7)] == \
        [(a[s]["loss"], a[s].get("val_loss")) for s in range(4, 7)]


# ---- initial weights -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    """4 steps on 2 ranks (FSDP): a checkpoint at step 4, its export, its final validation loss."""
    root = tmp_path_factory.mktemp("source")
    run_on_ranks(_train_on_ranks, 2, [*BASE, *VALIDATION, "--training.steps=4", "--validation.freq=4",
                                      "--checkpoint-dir", str(root / "ckpt"), "--metrics-file", str(root / "m.jsonl"),
                                      f"--checkpoint.export={root / 'model.safetensors'}"], timeout=240.0)
    return root, _val_losses(root / "m.jsonl")[4]


def _still_run(root: Path, name: str, *args: str) -> tuple[list[int], float]:
    metrics = root / f"{name}.jsonl"
    starts = run_on_ranks(_train_on_ranks, 2, [*BASE, *VALIDATION, *STILL, "--metrics-file", str(metrics), *args],
                          timeout=240.0)
    return starts, _val_losses(metrics)[1]


def test_initial_load_from_safetensors_and_from_a_dcp_run_directory(source_run, tmp_path):
    root, final = source_run
    _, fresh = _still_run(tmp_path, "fresh")
    assert fresh == pytest.approx(math.log(256), abs=0.05)  # the initial model, for contrast
    starts, loaded = _still_run(tmp_path, "st", f"--checkpoint.initial_load_path={root / 'model.safetensors'}")
    assert starts == [0, 0] and loaded == pytest.approx(final, abs=1e-4)
    # A run's checkpoint directory (its newest sound checkpoint), into another layout: HSDP.
    _, loaded = _still_run(tmp_path, "dcp", f"--checkpoint.initial_load_path={root / 'ckpt'}",
                           "--dp-replicate", "2", "--dp-shard", "1")
    assert loaded == pytest.approx(final, abs=1e-4)


def test_a_run_that_resumes_ignores_the_initial_load_path(source_run, tmp_path):
    root, _ = source_run
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    starts = run_on_ranks(_train_on_ranks, 2, [*BASE, "--training.steps=5", "--checkpoint-dir", str(tmp_path / "ckpt"),
                                               f"--checkpoint.initial_load_path={root / 'nothing-here'}"],
                          timeout=240.0)
    assert starts == [4, 4]


# ---- under torchrun: profiler trace, memory snapshot, TensorBoard, initial load ---------------
def _has_tensorboard() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def watched_run(source_run, tmp_path_factory):
    """torchrun, 2 ranks, 2 steps from the source run's step-4 directory: trace step 1, snapshot step 2."""
    root, final = source_run
    out = tmp_path_factory.mktemp("watched")
    args = [*BASE, *VALIDATION, *STILL, "--training.steps=2", f"--job.dump_folder={out}",
            "--metrics-file", str(out / "m.jsonl"), "--profiling.trace_steps=1", "--profiling.memory_snapshot_steps=2",
            f"--checkpoint.initial_load_path={root / 'ckpt' / 'step-00000004'}"]
    if _has_tensorboard():
        args.append("--metrics.enable_tensorboard")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(TRAIN), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return out, proc.stdout, final, root


@pytest.mark.slow  # torchrun's start: tens of seconds on 2 cores
def test_torchrun_run_loads_initial_weights_and_validates(watched_run):
    out, stdout, final, source = watched_run
    assert (f"checkpoint: starting from the weights in {source / 'ckpt' / 'step-00000004'} (DCP checkpoint): the "
            "model only, the optimizer and the schedule start fresh") in stdout
    validated = _val_losses(out / "m.jsonl")
    assert sorted(validated) == [1, 2] and validated[1] == pytest.approx(final, abs=1e-4)
    assert "step 1/2  validation loss" in stdout


@pytest.mark.slow  # watched_run
def test_torchrun_run_writes_a_profiler_trace_per_rank(watched_run):
    out, stdout, _, _ = watched_run
    folder = out / "profile_traces" / "step-1"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_trace.json", "rank1_trace.json"]
    for rank in (0, 1):
        names = {e.get("name", "") for e in json.loads((folder / f"rank{rank}_trace.json").read_text())["traceEvents"]}
        assert {"fsdp2::all_gather root", "fsdp2::reduce_scatter layers.0"} <= names
    assert f"profiling: step 1 traced to {folder}" in stdout
    assert not (out / "profile_traces" / "step-2").exists()


@pytest.mark.slow  # watched_run
def test_torchrun_run_writes_a_memory_snapshot_per_rank_and_says_what_it_is_on_cpu(watched_run):
    out, stdout, _, _ = watched_run
    folder = out / "memory_snapshot" / "step-2"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_memory.json", "rank0_memory.txt", "rank1_memory.json",
                                                        "rank1_memory.txt"]
    report = json.loads((folder / "rank1_memory.json").read_text())
    assert report["peak_bytes"] > 0 and report["peak_by_category"]["sharded_params"] > 0
    assert (folder / "rank0_memory.txt").read_text().startswith("category")
    assert "torch records allocation history on CUDA only" in stdout
    assert f"profiling: step 2 memory snapshot in {folder}" in stdout


@pytest.mark.slow  # watched_run
def test_torchrun_run_logs_to_tensorboard(watched_run):
    if not _has_tensorboard():
        pytest.skip("tensorboard is not installed (pip install -e '.[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, stdout, _, _ = watched_run
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    records = _records(out / "m.jsonl")
    for tag, key in (("loss/train", "loss"), ("loss/validation", "val_loss"), ("lr", "lr")):
        assert [(e.step, e.value) for e in events.Scalars(tag)] == \
            [(s, pytest.approx(records[s][key], rel=1e-6)) for s in (1, 2)], tag
    assert f"TensorBoard events in {out / 'tb'}" in stdout


# ---- requests that cannot work stop before the first step -------------------------------------
def _config_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        train_main(list(args))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_tensorboard_missing_is_a_config_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as where it is not installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    err = _config_error(capsys, "--metrics.enable_tensorboard")
    assert err.startswith("error: metrics.enable_tensorboard needs the tensorboard package")
    assert "pip install -e '.[tensorboard]'" in err


@pytest.mark.parametrize("kind", ["missing", "torch_save", "no_checkpoint"])
def test_unloadable_initial_load_path_is_a_config_error(capsys, tmp_path, kind):
    path = tmp_path / {"missing": "nope", "torch_save": "model.pt", "no_checkpoint": "empty"}[kind]
    if kind == "torch_save":
        torch.save({}, path)
    elif kind == "no_checkpoint":
        path.mkdir()
    err = _config_error(capsys, f"--checkpoint.initial_load_path={path}")
    expected = {"missing": "does not exist",
                "torch_save": "is a file but not .safetensors; pass a .safetensors file",
                "no_checkpoint": "is not a DCP checkpoint and holds no sound one"}[kind]
    assert err.startswith(f"error: checkpoint.initial_load_path={path}") and expected in err, err


def test_a_held_out_split_smaller_than_a_sequence_is_a_config_error(capsys, tmp_path):
    data = tmp_path / "small.txt"
    data.write_text("x" * 1000)
    err = _config_error(capsys, "--data", str(data), "--validation.enable", "--validation.split=0.1")
    assert err == ("error: validation.split=0.1 holds out 100 bytes of the data, fewer than training.seq_len + 2 = "
                   "130; raise validation.split or use more data\n")
