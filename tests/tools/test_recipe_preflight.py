"""What the recipe checks before a rank allocates: paths, settings that would do nothing, memory.

- ``python -m fsdp2.plan --config FILE.toml`` reads a recipe config as it is: the same
  estimate as the equivalent flags; flags override the file; the recipe's defaults fill what
  the file leaves out (checked equal to recipes/config.py's).
- Every path is checked in ``check_command`` (before any process group): data, checkpoint
  directory, metrics file, export, TensorBoard and trace folders; each error is one line.
- Settings that cannot take effect are warned about; the checked-in configs' own defaults
  are not; a fault on a rank that does not exist is an error.
- The memory check: the tiny run fits this machine; the 8B config on a 20 GiB, 2-rank machine
  is refused with the planner's figures; under torchrun the refusal is one line and comes
  before any rank allocates, and ``--dry-run`` prints the plan and stops.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fsdp2 import plan
from fsdp2.plan import _cli
from recipes import preflight
from recipes.config import ConfigError, JobConfig, command_line_keys, parse_args
from recipes.llama.parallelize import ParallelDims
from recipes.checks import check_command

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes" / "train.py"
CONFIG_8B = REPO / "recipes" / "configs" / "llama3_8b.toml"
TINY = REPO / "recipes" / "configs" / "tiny.toml"
PLAN_8B_FLAGS = ["--config", "llama3_8b", "--batch", "1", "--seq", "8192", "--param-dtype", "bf16",
                 "--reduce-dtype", "fp32", "--activation-checkpointing", "full"]


# ---- the planner reads the recipe's TOML -------------------------------------------------------
def test_plan_reads_a_recipe_toml_as_the_equivalent_flags(capsys):
    from_file = plan.check_fit(["--config", str(CONFIG_8B), "--world", "8", "--gpu-memory", "80GB"])
    from_flags = plan.check_fit([*PLAN_8B_FLAGS, "--world", "8", "--gpu-memory", "80GB"])
    assert from_file.estimate.needed_bytes == from_flags.estimate.needed_bytes
    assert from_file.estimate.layout == from_flags.estimate.layout and from_file.estimate.fits
    plan.main(["--config", str(CONFIG_8B), "--world", "8", "--gpu-memory", "80GB"])
    out = capsys.readouterr().out
    assert out.startswith("llama3_8b.toml: layout: world 8 = dp_replicate 1 x dp_shard 8 x tp 1; 32 blocks; "
                          "batch 1 x seq 8192; param bfloat16; reshard_after_forward=True; "
                          "activation_checkpointing=True"), out
    # A flag overrides the file.
    bigger = plan.check_fit(["--config", str(CONFIG_8B), "--world", "8", "--batch", "2", "--gpu-memory", "80GB"])
    assert "batch 2 x seq 8192" in bigger.estimate.layout
    assert bigger.estimate.peak_bytes > from_file.estimate.peak_bytes


def test_plan_fills_a_toml_with_the_recipes_defaults(tmp_path):
    config = JobConfig()
    for section, defaults in _cli.RECIPE_DEFAULTS.items():
        for key, value in defaults.items():
            assert getattr(getattr(config, section), key) == value, f"{section}.{key}"
    # tiny.toml as the recipe runs it: fp32, batch 8 x seq 128, its model (4 blocks).
    tiny = plan.check_fit(["--config", str(TINY), "--world", "2", "--backend", "gloo", "--gpu-memory", "1GiB"])
    assert "4 blocks; batch 8 x seq 128; param float32" in tiny.estimate.layout
    assert tiny.estimate.reserved == {}, "a CPU (gloo) run reserves nothing for CUDA or NCCL"
    # A file that fixes every axis fixes the world; a --world that disagrees is refused.
    fixed = tmp_path / "fixed.toml"
    fixed.write_text("[parallelism]\ndp_replicate = 2\ndp_shard = 2\n[model]\ndim = 64\nn_heads = 4\n")
    layout = plan.check_fit(["--config", str(fixed), "--backend", "gloo", "--gpu-memory", "1GiB"]).estimate.layout
    assert layout.startswith("world 4 = dp_replicate 2 x dp_shard 2 x tp 1")
    with pytest.raises(ValueError, match=r"--world 8, but .*fixed.toml fixes dp_replicate 2 x dp_shard 2 x tp 1 = 4"):
        plan.check_fit(["--config", str(fixed), "--world", "8", "--gpu-memory", "1GiB"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\ndimm = 64\n")
    with pytest.raises(ValueError, match=r"\[model\] has keys the recipe's Llama does not: dimm"):
        plan.check_fit(["--config", str(bad), "--world", "2", "--gpu-memory", "1GiB"])


def test_plan_without_world_says_so(capsys):
    with pytest.raises(SystemExit):
        plan.main(["--config", str(TINY)])
    assert "--world is required (the total ranks), unless a recipe TOML's parallelism.dp_shard" in \
        capsys.readouterr().err


# ---- paths -----------------------------------------------------------------------------------
def test_every_path_is_checked_before_the_ranks_start(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    (tmp_path / "small.txt").write_text("tiny")
    cases = [
        (["--data", "/nonexistent"], r"^--data /nonexistent: no such file or directory$"),
        (["--data", str(tmp_path / "small.txt")], r"small.txt: 4 bytes, fewer than training.seq_len \+ 2 = 130"),
        (["--checkpoint-dir", str(a_file)], rf"^checkpoint.dir={a_file}: {a_file} is a file, not a directory$"),
        (["--checkpoint-dir", str(a_file / "sub")], rf"^checkpoint.dir=.*: cannot create .*sub, {a_file} is a file$"),
        (["--metrics-file", str(a_file / "m.jsonl")], rf"^metrics.file=.*m.jsonl: {a_file} is a file, not"),
        (["--metrics-file", str(tmp_path)], r"^metrics.file=.* is a directory; give a file name$"),
        (["--job.dump_folder", str(a_file), "--profiling.trace_steps=1"],
         rf"^job.dump_folder={a_file} \(for profiling.trace_steps\): cannot create .*profile_traces, {a_file} is"),
        (["--job.dump_folder", str(a_file), "--profiling.memory_snapshot_steps=1"],
         r"\(for profiling.memory_snapshot_steps\)"),
        (["--job.dump_folder", str(a_file), "--metrics.enable_tensorboard"], r"\(for metrics.enable_tensorboard\)"),
    ]
    for argv, match in cases:
        with pytest.raises(ValueError, match=match):
            check_command(argv, 2)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="is not writable"):
            check_command(["--checkpoint-dir", str(locked / "ckpt")], 2)
    check_command(["--checkpoint-dir", str(tmp_path / "new" / "ckpt"), "--metrics-file",
                   str(tmp_path / "new" / "m.jsonl")], 2)  # to be created: fine


# ---- settings that would do nothing ------------------------------------------------------------
def _warnings(*argv: str) -> list[str]:
    return preflight.no_op_warnings(parse_args(list(argv)), command_line_keys(list(argv)))


def test_settings_that_cannot_take_effect_are_warned_about():
    assert _warnings() == [], "the Quickstart's own settings warn about nothing"
    assert _warnings("--config", str(CONFIG_8B)) == []
    assert _warnings("--steps", "3", "--profiling.trace_steps=2,100", "--profiling.memory_snapshot_steps=5") == [
        "profiling.trace_steps: step 100 never runs (training.steps=3)",
        "profiling.memory_snapshot_steps: step 5 never runs (training.steps=3)",
        "training.warmup_steps=20 is longer than the run (training.steps=3): the learning rate reaches only 15% "
        "of training.lr=0.003 and never decays",
    ]
    assert _warnings("--steps", "10", "--training.warmup_steps=500") == [
        "training.warmup_steps=500 is longer than the run (training.steps=10): the learning rate reaches only 2% "
        "of training.lr=0.003 and never decays"]
    assert _warnings("--steps", "30", "--validation.enable", "--validation.freq=50") == [
        "validation.freq=50 > training.steps=30: validation runs once, after the last step"]
    assert _warnings("--validation.freq=5") == ["validation.freq=5: no effect without validation.enable=true"]
    assert _warnings("--checkpoint-every", "5") == [
        "checkpoint.every=5: no effect without checkpoint.dir (--checkpoint-dir DIR)"]
    assert _warnings("--steps", "30", "--checkpoint-dir", "/tmp/x") == [
        "checkpoint.every=100 > training.steps=30: the only checkpoint is the last step's"]
    assert _warnings("--steps", "30", "--metrics.log_every=50") == [
        "metrics.log_every=50 > training.steps=30: only the first and last steps are printed and recorded"]
    assert _warnings("--metrics.plot=true") == ["metrics.plot=True: no effect without metrics.file (the curve is "
                                                "drawn from it)"]
    assert _warnings("--metrics.plot=false") == []  # turning off what would not run is no mistake
    assert _warnings("--parallelism.quantize_block_size=64") == [
        "parallelism.quantize_block_size=64: no effect without parallelism.quantize_weights or quantize_gradients"]
    assert _warnings("--faults.nan_loss_rank=1") == ["faults.nan_loss_rank=1: no effect without "
                                                     "faults.nan_loss_at_steps"]
    assert _warnings("--steps", "30", "--faults.nan_loss_at_steps=40") == [
        "faults.nan_loss_at_steps: step 40 never runs (training.steps=30)"]


def test_a_fault_on_a_rank_that_does_not_exist_is_an_error():
    with pytest.raises(ConfigError, match=r"faults.nan_loss_rank=2, but the run has ranks 0-1; give one of them"):
        check_command(["--faults.nan_loss_at_steps=3", "--faults.nan_loss_rank=2"], 2)
    check_command(["--faults.nan_loss_at_steps=3", "--faults.nan_loss_rank=1"], 2)


# ---- memory ----------------------------------------------------------------------------------
def test_the_tiny_run_fits_and_its_plan_is_the_planners(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    config = parse_args([])
    check = preflight.check_memory(config, ParallelDims(1, -1, 1, 2), "cpu")
    assert check is not None and check.fits, check
    assert check.summary.startswith("memory: the planner says ") and "local ranks)" in check.summary
    # The same command line, given to the planner, gives the same table.
    assert plan.check_fit(check.argv).estimate.table() == check.table


def test_the_8b_config_is_refused_on_a_20_gib_two_rank_machine(monkeypatch):
    monkeypatch.setattr(preflight, "_available_memory", lambda: 20 * 2**30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    config = parse_args(["--config", str(CONFIG_8B)])
    started = time.perf_counter()
    check = preflight.check_memory(config, ParallelDims(1, -1, 1, 2), "cpu")
    assert time.perf_counter() - started < 120
    expected = plan.check_fit([*PLAN_8B_FLAGS, "--world", "2", "--backend", "gloo", "--gpu-memory", "10GiB"])
    needed = expected.estimate.needed_bytes / 2**30
    assert not check.fits
    assert check.summary.startswith(f"needs {needed:.2f} GiB per rank by the memory planner (peak at "
                                    "optimizer step), the device has 10.00 GiB (20.0 GiB available on this "
                                    "machine / 2 local ranks); "), check.summary
    assert "--skip-memory-check runs it anyway" in check.summary
    # On 80 GiB GPUs the planner names layouts that fit, in the recipe's own flags.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(preflight, "_available_memory", lambda: 40 * 2**30)
    no_ac = parse_args(["--config", str(CONFIG_8B), "--training.activation_checkpoint=false"])
    check = preflight.check_memory(no_ac, ParallelDims(1, -1, 1, 8), "cpu")
    assert not check.fits and "these layouts fit: --training.activation_checkpoint=true (" in check.summary


def test_plan_argv_is_the_resolved_config():
    config = parse_args(["--config", str(CONFIG_8B), "--training.batch_size=2", "--tp", "2"])
    argv = preflight.plan_argv(config, ParallelDims(1, -1, 2, 8), "cuda", 80 * 2**30)
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--batch"] == "2" and flags["--tp"] == "2" and flags["--world"] == "8"
    assert flags["--ffn-hidden"] == "14336" and flags["--backend"] == "nccl"
    assert preflight.recipe_flags("--batch 1 --grad-accum 2") == "--training.batch_size=1 --training.grad_accum=2"
    simulated = _cli._model_args(_cli._parse(_cli._parser(), argv))[1]
    shape = ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "ffn_hidden", "max_seq_len", "tie_embeddings")
    assert [getattr(simulated, k) for k in shape] == [getattr(config.model, k) for k in shape], \
        "the planner simulates the recipe's model, at its shape"


# ---- under torchrun ----------------------------------------------------------------------------
def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(TRAIN), *args]


def _ours(stderr: str) -> list[str]:
    """stderr without torchrun's own lines (its OMP_NUM_THREADS banner and failure report)."""
    return [line for line in stderr.splitlines() if line.startswith(("error:", "warning:", "Traceback"))]


def _free_gib() -> float:
    return (preflight._available_memory() or 0) / 2**30


def _refuses_8b() -> bool:
    """Whether this machine lacks the memory to start the 8B config on 2 ranks (the refusal's premise)."""
    return _free_gib() <= 2 * 60


def _has_the_documented_corpus() -> bool:
    from recipes.data import load_corpus

    return load_corpus(None).numel() == 4_698_555


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory) -> tuple[Path, dict[str, tuple[subprocess.CompletedProcess, float]]]:
    """Every torchrun launch of this file's tests, all started together: their folder, and by name
    each one's result and its seconds from the start.

    The launches are independent, and each keeps one core of two idle while its agent starts and
    while its ranks wait for each other: side by side, one's agent starts while another's ranks
    work. A launch whose test would skip (see there) is not started; a test run alone still
    starts the others.
    """
    root = tmp_path_factory.mktemp("torchrun")
    (root / "ckpt" / "step-00000004").mkdir(parents=True)
    launches = {"missing_data": ("--data", "/nonexistent", "--steps", "1"),
                "dry_run": ("--dry-run", "--checkpoint-dir", str(root / "ckpt"))}
    if _refuses_8b():
        launches |= {"refused_8b": ("--config", str(CONFIG_8B)),
                     "dry_run_8b": ("--config", str(CONFIG_8B), "--dry-run")}
    if _has_the_documented_corpus():
        launches["one_step"] = ("--steps", "1", "--metrics.sample_tokens=0", "--training.warmup_steps=1",
                                "--metrics-file", str(root / "m.jsonl"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()

    def run(args: tuple[str, ...]) -> tuple[subprocess.CompletedProcess, float]:
        proc = subprocess.run(_torchrun(*args), capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
        return proc, time.perf_counter() - started

    with ThreadPoolExecutor(len(launches)) as pool:
        futures = {name: pool.submit(run, args) for name, args in launches.items()}
        done = {name: future.result() for name, future in futures.items()}
    return root, done


@pytest.mark.slow  # torchrun_runs: torchrun's start
def test_missing_data_under_torchrun_is_one_line(torchrun_runs):
    proc, _ = torchrun_runs[1]["missing_data"]
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.count("\nerror: --data /nonexistent: no such file or directory\n") == 1, proc.stderr
    assert [line for line in _ours(proc.stderr) if line.startswith("error")] == [
        "error: --data /nonexistent: no such file or directory"]
    assert f'File "{REPO / "recipes"}' not in proc.stderr, "no rank's traceback"


@pytest.mark.slow  # torchrun_runs: torchrun's start, and the planner's search for layouts that fit
def test_8b_config_is_refused_before_allocating_and_dry_run_prints_the_plan(torchrun_runs):
    if not _refuses_8b():
        pytest.skip("this machine has the memory to start the 8B config on 2 ranks")
    (refused, took), (dry, _) = torchrun_runs[1]["refused_8b"], torchrun_runs[1]["dry_run_8b"]
    assert refused.returncode != 0 and refused.stdout == ""
    errors = [line for line in _ours(refused.stderr) if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: needs ") and " GiB per rank by the memory planner" \
        in errors[0] and "the device has" in errors[0], refused.stderr
    assert "DefaultCPUAllocator" not in refused.stderr and f'File "{REPO / "recipes"}' not in refused.stderr
    assert took < 240
    assert dry.returncode != 0  # the run would be refused: a script can tell
    assert f"chance loss ln(128256) = {math.log(128256):.3f}" in dry.stdout
    assert "M parameters, 32 layers, dim 4096" in dry.stdout
    assert "optimizer_state" in dry.stdout and "refused: needs " in dry.stdout
    assert "dry run: nothing allocated" in dry.stdout and "step 1/" not in dry.stdout


@pytest.mark.slow  # torchrun_runs: torchrun's start
def test_dry_run_of_the_tiny_config_stops_before_the_first_step(torchrun_runs):
    root, runs = torchrun_runs
    proc, _ = runs["dry_run"]  # --checkpoint-dir root/ckpt, which holds step-00000004
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "world 2 (cpu, gloo), mesh {'dp_shard': 2}" in out
    assert "chance loss ln(256) = 5.545" in out
    assert f"checkpoints: {root / 'ckpt'} holds step-00000004; the run resumes from the newest sound one" in out
    assert "memory planner (python -m fsdp2.plan --dim 128 " in out and "memory: the planner says " in out
    assert out.rstrip().endswith("dry run: nothing allocated; without --dry-run it trains")
    assert "step 1/" not in out


@pytest.mark.slow  # torchrun_runs: torchrun's start, one step
def test_the_memory_check_leaves_training_as_it_was(torchrun_runs):
    # The planner runs fsdp2 on a fake process group; run in the ranks' own process, DTensor's
    # caches once gave rank 1 rank 0's initial weights (step 1's loss 5.5530 instead of 5.5492).
    # Step 1's loss is the initial model's: the same with the check as the documented run's.
    if not _has_the_documented_corpus():
        pytest.skip("the documented step-1 loss is for Python 3.11.7's sources")
    root, runs = torchrun_runs
    proc, _ = runs["one_step"]
    assert proc.returncode == 0, proc.stderr
    assert "memory: the planner says " in proc.stdout, "the check ran"
    assert round(json.loads((root / "m.jsonl").read_text().splitlines()[0])["loss"], 4) == 5.5492
