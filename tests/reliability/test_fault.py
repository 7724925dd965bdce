"""Surviving faults: crash-restart with exact resume, atomic and verified checkpoints, bad batches.

- ``torchrun --max-restarts 1`` runs the recipe on 2 ranks; after its first checkpoint one
  worker (rank and step drawn from a seeded ``random.Random``, printed) is SIGKILLed. torchrun
  restarts both, they resume from the newest checkpoint, and the run ends with the losses,
  gradient norms, learning rates (each step recorded once) and final weights of an
  uninterrupted run (``train()`` in the test's own 2-rank world), compared exactly.
- A process killed while ``Checkpointer.save`` is writing (paused inside DCP's write, so the
  kill lands there every time) leaves the previous checkpoint chosen and loadable; its
  leftovers are removed and keep-last-K still holds.
- A checkpoint whose shard was truncated or deleted after the save fails
  ``fsdp2.checkpoint.verify``: ``Checkpointer.latest()`` skips it with a warning naming it and
  ``fsdp2.checkpoint.load`` refuses it, naming the file.
- A NaN loss on one rank makes every rank skip that optimizer step: the weights and optimizer
  state stay as they were, the step is recorded as skipped, the run goes on exactly as when
  every rank saw the NaN, and too many skips in a row stop the run with a clear error.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import fsdp2.checkpoint as fsdp2_ckpt
from recipes.checkpoint import Checkpointer
from recipes.config import parse_args
from recipes.llama.model import Transformer
from recipes.metrics import MetricsWriter
from recipes.build import build_optimizer, lr_schedule
from tests._dist import run_on_ranks
from tests.tools.test_recipe import _train_on_ranks

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes" / "train.py"
SMALL_MODEL = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
               "--model.max_seq_len=32", "--training.seq_len=32"]
BASE = [*SMALL_MODEL, "--training.batch_size=4", "--training.warmup_steps=2", "--training.lr=1e-2",
        "--metrics.log_every=1", "--metrics.sample_tokens=0", "--metrics.plot=false"]
SEED = int(os.environ.get("FSDP2_FAULT_SEED", "0"))  # which rank and step the crash test kills


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model weights of a recipe checkpoint, loaded into a plain model in this process."""
    model = Transformer(parse_args(SMALL_MODEL).model)
    fsdp2_ckpt.load(checkpoint, model)
    return model.state_dict()


def _assert_equal_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


# ---- crash and restart under torchrun ----------------------------------------------------------
STEPS, EVERY = 16, 4
CRASH_ARGS = [*BASE, f"--training.steps={STEPS}", "--checkpoint-every", str(EVERY), "--checkpoint.keep=2"]


def _last_step(metrics: Path) -> int:
    """The newest step in the metrics file (0 before the first; a half-written line is skipped)."""
    steps = [0]
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                steps.append(json.loads(line)["step"])
            except ValueError:
                pass
    return max(steps)


def _worker_of_rank(torchrun_pid: int, rank: int) -> int:
    """The pid of torchrun's worker process with RANK=``rank``."""
    children = subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True).stdout.split()
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"torchrun (pid {torchrun_pid}) has no worker with RANK={rank}: children {children}")


def _kill_once_recorded(proc: subprocess.Popen, metrics: Path, step: int, rank: int) -> None:
    """SIGKILL the worker of ``rank`` (torchrun ``proc``'s) once ``metrics`` records ``step``."""
    deadline = time.monotonic() + 180
    while _last_step(metrics) < step:
        assert proc.poll() is None, f"the run ended before step {step}"
        assert time.monotonic() < deadline, "the run did not reach the step to kill"
        time.sleep(0.005)
    os.kill(_worker_of_rank(proc.pid, rank), signal.SIGKILL)
    print(f"killed rank {rank} with step {_last_step(metrics)} recorded")


@pytest.mark.slow  # torchrun, a kill and a restart: minutes on 2 cores
def test_sigkilled_rank_restarts_and_resumes_exactly(tmp_path):
    rng = random.Random(SEED)
    kill_rank = rng.randrange(2)
    kill_step = rng.randint(EVERY + 1, STEPS - 2 * EVERY)  # after the first checkpoint, well before the end
    print(f"FSDP2_FAULT_SEED={SEED}: SIGKILL rank {kill_rank} once step {kill_step} is recorded")

    crashed = tmp_path / "crashed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.1", str(TRAIN), *CRASH_ARGS,
           "--checkpoint-dir", str(crashed / "ckpt"), "--metrics-file", str(crashed / "metrics.jsonl")]
    # A restarted worker must not read the dead attempt's addresses (pytorch/pytorch#135712).
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    log = (tmp_path / "torchrun.log").open("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    reference = tmp_path / "reference"  # the same run, uninterrupted, in the test's 2-rank world
    try:
        with ThreadPoolExecutor(1) as pool:
            killed = pool.submit(_kill_once_recorded, proc, crashed / "metrics.jsonl", kill_step, kill_rank)
            # Meanwhile (the launch keeps one core busy at most while torchrun starts and restarts):
            run_on_ranks(_train_on_ranks, 2, [*CRASH_ARGS, "--checkpoint-dir", str(reference / "ckpt"),
                                              "--metrics-file", str(reference / "metrics.jsonl")], timeout=240.0)
            killed.result()
        returncode = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    output = log.read()
    assert returncode == 0, output
    assert "torchrun restart 1" in output, output
    resumed = re.search(r"resumed from \S+ at step (\d+)", output)
    assert resumed and EVERY <= int(resumed.group(1)) <= STEPS - EVERY, output

    got, want = _records(crashed / "metrics.jsonl"), _records(reference / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), "each step recorded exactly once"
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm", "lr", "skipped"):
            assert g[key] == w[key], (g["step"], key, g[key], w[key])
    final = f"step-{STEPS:08d}"
    _assert_equal_weights(_weights(crashed / "ckpt" / final), _weights(reference / "ckpt" / final))
    # Only complete checkpoints remain (a save the kill interrupted was cleaned up), the newest 2.
    assert sorted(p.name for p in (crashed / "ckpt").iterdir()) == [f"step-{STEPS - EVERY:08d}", final]


def test_metrics_file_after_a_crash_keeps_each_step_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 7)]
    path.write_text("\n".join(lines) + "\n" + lines[-1][:9])  # the crash cut the last write short
    writer = MetricsWriter(path, resume_step=4)  # the newest checkpoint is at step 4
    assert path.read_text() == "".join(line + "\n" for line in lines[:4])
    writer.write({"step": 5, "loss": 0.2})
    assert [r["step"] for r in _records(path)] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary file left
    MetricsWriter(path, resume_step=0)  # no checkpoint: the run starts over
    assert path.read_text() == ""


# ---- atomic checkpoints: interrupted saves, corruption, keep-last-K ---------------------------
def _plain_setup(seed: int) -> tuple[Transformer, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    config = parse_args(SMALL_MODEL)
    model = Transformer(config.model)
    model.init_weights(seed=seed)
    optimizer = build_optimizer(model, config.training)
    return model, optimizer, lr_schedule(optimizer, config.training)


def _save_then_hang_in_the_next_save(root: str) -> None:
    """Child process: save step 1, then start saving step 2 and stop inside DCP's write."""
    model, optimizer, scheduler = _plain_setup(seed=0)
    checkpointer = Checkpointer(root)
    checkpointer.save(1, model, optimizer, scheduler)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def stall(fd: int) -> None:  # DCP fsyncs each data file before writing .metadata
        print("writing", flush=True)
        time.sleep(600)

    os.fsync = stall
    checkpointer.save(2, model, optimizer, scheduler)


@pytest.mark.slow
def test_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path, caplog):
    root = tmp_path / "ckpt"
    code = f"from tests.reliability.test_fault import _save_then_hang_in_the_next_save as f; f({str(root)!r})"
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "writing\n", "the child must reach the write of step 2"
        leftover = [p.name for p in root.iterdir() if ".tmp-" in p.name]
        assert len(leftover) == 1 and leftover[0].startswith("step-00000002"), leftover
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL

    checkpointer = Checkpointer(root, keep=2)
    assert checkpointer.latest() == (1, root / "step-00000001")
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"], "the interrupted save is cleaned up"
    model, optimizer, scheduler = _plain_setup(seed=1)
    assert checkpointer.load(root / "step-00000001", model, optimizer, scheduler)["step"] == 1
    _assert_equal_weights(model.state_dict(), _plain_setup(seed=0)[0].state_dict())
    # Saving goes on; keep=2 keeps the newest two.
    for step in (2, 3):
        checkpointer.save(step, model, optimizer, scheduler)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000003"]
    assert checkpointer.latest() == (3, root / "step-00000003")


def test_corrupted_checkpoint_is_skipped_with_a_warning_and_refused_by_load(tmp_path, caplog):
    root = tmp_path / "ckpt"
    checkpointer = Checkpointer(root, keep=0)
    model, optimizer, scheduler = _plain_setup(seed=0)
    for step in (1, 2, 3):
        checkpointer.save(step, model, optimizer, scheduler)
    marker = json.loads((root / "step-00000003" / fsdp2_ckpt._dcp.MARKER).read_text())
    assert marker["files"] == {p.name: p.stat().st_size for p in (root / "step-00000003").iterdir()
                               if p.name != fsdp2_ckpt._dcp.MARKER}
    assert fsdp2_ckpt.verify(root / "step-00000003") == []

    shard = root / "step-00000003" / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])  # e.g. a copy cut short by a full disk
    (root / "step-00000002" / "__0_0.distcp").unlink()
    problems = fsdp2_ckpt.verify(root / "step-00000003")
    assert problems == [f"__0_0.distcp is {size // 2} bytes but was saved with {size} (truncated or overwritten)"]
    assert fsdp2_ckpt.verify(root / "step-00000002") == ["__0_0.distcp is missing"]

    with caplog.at_level(logging.WARNING, logger="recipes.checkpoint"):
        assert checkpointer.latest() == (1, root / "step-00000001")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "checkpoint: skipping" in warnings[0] and "step-00000003, unusable: " in warnings[0] \
        and "__0_0.distcp is" in warnings[0]
    assert "step-00000002" in warnings[1] and "__0_0.distcp is missing" in warnings[1]

    with pytest.raises(fsdp2_ckpt.CorruptCheckpointError,
                       match=r"checkpoint .*step-00000003 is corrupted: __0_0.distcp is \d+ bytes but was saved"):
        fsdp2_ckpt.load(root / "step-00000003", model)
    with pytest.raises(fsdp2_ckpt.CorruptCheckpointError, match=r"step-00000002 is corrupted: __0_0.distcp is missing"):
        fsdp2_ckpt.load(root / "step-00000002", model)
    (root / "step-00000001" / ".metadata").write_bytes(b"\x80")  # not a pickle any more
    assert fsdp2_ckpt.verify(root / "step-00000001")[0].startswith(".metadata is ")
    assert Checkpointer(root).latest() is None


# ---- bad batches ---------------------------------------------------------------------------------
BAD_BATCH_ARGS = [*BASE, "--training.steps=6", "--metrics.log_every=2", "--checkpoint-every", "1",
                  "--checkpoint.keep=0", "--faults.nan_loss_at_steps=3"]


@pytest.mark.slow
def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    runs = {}
    for name, rank in (("rank1", "1"), ("every_rank", "-1")):
        root = tmp_path / name
        run_on_ranks(_train_on_ranks, 2, [*BAD_BATCH_ARGS, f"--faults.nan_loss_rank={rank}", "--checkpoint-dir",
                                          str(root / "ckpt"), "--metrics-file", str(root / "metrics.jsonl")])
        runs[name] = {r["step"]: r for r in _records(root / "metrics.jsonl")}
    records = runs["rank1"]
    # Every 2nd step, the first and the last, and the skipped one (3) although it is not a logging step.
    assert sorted(records) == [1, 2, 3, 4, 6]
    assert records[3]["skipped"] is True and records[3]["skipped_steps"] == 1
    assert math.isnan(records[3]["grad_norm"])  # the global norm saw rank 1's NaN
    assert not any(records[s]["skipped"] for s in (1, 2, 4, 6)) and records[6]["skipped_steps"] == 1
    assert math.isnan(records[3]["loss"])  # the mean over ranks of rank 0's loss and rank 1's NaN
    assert all(math.isfinite(records[s][k]) for s in (4, 6) for k in ("loss", "grad_norm")), "no NaN leaked"
    # The learning-rate schedule advances on a skipped step: step 4 uses the 4th step's rate.
    config = parse_args(BAD_BATCH_ARGS)
    factor = lr_schedule(build_optimizer(torch.nn.Linear(2, 2), config.training), config.training).lr_lambdas[0]
    rates = [config.training.lr * factor(i) for i in range(6)]  # factor(i): the rate after i scheduler steps
    assert [records[s]["lr"] for s in (1, 2, 3, 4, 6)] == [rates[s - 1] for s in (1, 2, 3, 4, 6)]
    # Whether one rank or all saw the NaN, the same step was skipped and the run went on identically.
    for step in (1, 2, 4, 6):
        for key in ("loss", "grad_norm", "lr"):
            assert records[step][key] == runs["every_rank"][step][key], (step, key)
    # The skipped step changed no weight and no optimizer state; its counters are checkpointed.
    ckpt = tmp_path / "rank1" / "ckpt"
    states = []
    for step in (2, 3):
        model, optimizer, scheduler = _plain_setup(seed=7)
        extra = Checkpointer(ckpt).load(ckpt / f"step-{step:08d}", model, optimizer, scheduler)
        states.append((model.state_dict(), optimizer.state_dict()["state"], extra["skips"]))
    _assert_equal_weights(states[1][0], states[0][0])
    assert len(states[0][1]) == len(list(model.parameters()))  # AdamW's moments and step count, restored
    for param_id, state in states[0][1].items():
        for key, value in state.items():
            assert torch.equal(states[1][1][param_id][key], value), (param_id, key)
    assert states[0][2] == {"total": 0, "in_a_row": 0} and states[1][2] == {"total": 1, "in_a_row": 1}
    assert not torch.equal(_weights(ckpt / "step-00000004")["output.weight"], states[1][0]["output.weight"])


def test_too_many_skipped_steps_in_a_row_stop_the_run(tmp_path):
    args = [*BASE, "--training.steps=5", "--faults.nan_loss_at_steps=2,3", "--training.max_skipped_steps=2",
            "--metrics-file", str(tmp_path / "metrics.jsonl")]
    with pytest.raises(AssertionError, match=r"(?s)steps 2-3: 2 steps in a row had a non-finite gradient norm.*"
                                             r"training.max_skipped_steps=2"):
        run_on_ranks(_train_on_ranks, 2, args)
    assert [(r["step"], r["skipped"]) for r in _records(tmp_path / "metrics.jsonl")] == \
        [(1, False), (2, True), (3, True)]
