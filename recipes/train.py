"""Train a Llama-style byte-level language model with fsdp2.

    torchrun --nproc-per-node 2 recipes/train.py [--config FILE] [--section.key=value ...]

With no arguments it trains the tiny config (recipes/configs/tiny.toml) on the Python
standard library's own source files, on 2 CPU ranks (gloo) or on GPUs (NCCL) when CUDA
is available. Short flags: --dp-shard N, --dp-replicate N, --tp N (-1 = infer from the
world size), --steps N, --data PATH (text, .jsonl, .parquet, a datasets folder), --tokenizer
PATH (a Hugging Face tokenizer.json or model folder), --checkpoint-dir DIR, --checkpoint-every N,
--metrics-file PATH, --dry-run, --skip-memory-check, --layout-from FILE[:K] (the layout
`python -m fsdp2.plan --search --search-json FILE` chose: docs/planning.md). A run given a
checkpoint directory that holds a complete checkpoint resumes from it (the newest one that
passes verification). Every key (--help lists them) can be overridden as --section.key=value.

Before any rank allocates the model: every path is checked, settings that would have no
effect on this run are warned about, and the memory planner (python -m fsdp2.plan) predicts a
rank's peak for this model and layout; a run that cannot fit the device is refused with the
planner's figures and the nearest layouts that fit (--skip-memory-check starts it anyway).
--dry-run does all of that, builds the mesh, finds the data and the checkpoint to resume from,
prints the plan and stops.

Faults: under `torchrun --max-restarts K` a crashed or killed rank makes torchrun restart
every rank, and the run resumes from the newest checkpoint, exactly: the losses and the
final weights equal an uninterrupted run's. A step whose gradient norm is not finite is
skipped (no optimizer step; the learning-rate schedule advances), warned about and recorded
as "skipped" in the metrics; training.max_skipped_steps of them in a row stop the run.
The [faults] keys inject bad batches to test that guard, and kill a rank.
--checkpoint.snapshot_every=K|auto also keeps each rank's state in host memory every K steps
(recipes/snapshot.py), which a restart resumes from when it is newer than the newest checkpoint.

Watching a run: --validation.enable reports the loss on held-out data every validation.freq
steps; --metrics.enable_tensorboard writes TensorBoard events to job.dump_folder/tb;
--profiling.trace_steps=N,M writes torch.profiler traces of those steps and
--profiling.memory_snapshot_steps=N a memory snapshot; --checkpoint.initial_load_path
starts a fresh run from saved weights (safetensors or a DCP checkpoint).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script (torchrun recipes/train.py): make `recipes` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

with warnings.catch_warnings():
    # torch warns at import when numpy is missing; training does not need numpy (checkpoints
    # do, and check_checkpoint_dir says so before the first step).
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
import torch.distributed as dist

from recipes.build import build_model, build_optimizer, lr_schedule
from recipes.checkpoint import Checkpointer, UnusableCheckpointError, export_model, load_initial
from recipes.checks import check_command, preflight_memory
from recipes.config import ConfigError, JobConfig, command_line_keys, describe, parse_args
from recipes.data import corpus_length, corpus_unit, load_data, load_tokenizer, split_corpus
from recipes.exit import run_and_exit
from recipes.generate import generate
from recipes.hf import export_hf_model
from recipes.launch import Interrupted, ctrl_c_after, fail, log, restart_store_problem, show_recipe_logs
from recipes.llama.model import Transformer
from recipes.llama.moe import register_load_balancing
from recipes.llama.parallelize import ParallelDims
from recipes.metrics import plot_loss
from recipes.pipeline import build_pipeline, full_parameter_count
from recipes.preflight import MemoryCheck, no_op_warnings
from recipes.profiling import Profiler
from recipes.progress import Progress, log_setup, model_flops_per_token
from recipes.snapshot import SnapshotAreaError, Snapshots, kill_if_asked
from recipes.step import SkipGuard, train_step, validate


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        if "-h" in argv or "--help" in argv:
            if rank0:  # the values this command line runs with: the config file's, then the overrides
                config = parse_args([a for a in argv if a not in ("-h", "--help")])
                print(__doc__ + "\nEvery key, as --section.key=value (the value this command line would use), "
                      "its type and what it does:\n" + describe(config))
            return
        config, dims = check_command(argv, int(os.environ.get("WORLD_SIZE", "1")))
    except (ConfigError, ValueError) as e:  # before any process starts a collective
        fail(f"error: {e}", rank0)
    if rank0:
        for warning in no_op_warnings(config, command_line_keys(argv)):
            print(f"warning: {warning}", file=sys.stderr)
        if problem := restart_store_problem():
            print(f"warning: {problem}", file=sys.stderr)
    show_recipe_logs(rank0)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    memory = preflight_memory(config, dims, device, rank0)
    try:
        dist.init_process_group("nccl" if use_cuda else "gloo")
        try:
            if dist.get_world_size() != dims.world_size:
                raise RuntimeError(f"WORLD_SIZE={dims.world_size} but the process group has "
                                   f"{dist.get_world_size()} ranks")
            if config.job.dry_run:
                dry_run(config, dims, device, memory)
            else:
                train(config, dims, device)
        finally:
            dist.destroy_process_group()
    except (UnusableCheckpointError, SnapshotAreaError) as e:  # every rank raises it, after rank 0's decision
        fail(f"error: {e}", rank0)
    except (KeyboardInterrupt, Interrupted) as e:  # Ctrl-C: one line instead of every rank's traceback
        if rank0:
            print(e if isinstance(e, Interrupted) else "interrupted before training started", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    if config.job.dry_run and memory is not None and not memory.fits:
        sys.exit(2)  # the dry run printed why; a script can tell a run that would be refused


def dry_run(config: JobConfig, dims: ParallelDims, device: torch.device, memory: MemoryCheck | None) -> None:
    """Collective: everything a run does before its first step except allocating the model; prints the plan."""
    dims.build_mesh(device.type)
    log_setup(config, dims, full_parameter_count(config)[0], corpus_length(config.data))
    if config.validation.enable:
        log(f"validation: {config.validation.split:.0%} of the data held out, {config.validation.steps} batches "
            f"every {config.validation.freq} steps")
    ckpt = config.checkpoint
    if ckpt.dir:
        found = sorted(p.name for p in Path(ckpt.dir).glob("step-*") if p.is_dir()) if Path(ckpt.dir).is_dir() else []
        log(f"checkpoints: {ckpt.dir} holds {', '.join(found)}; the run resumes from the newest sound one" if found
            else f"checkpoints: none in {ckpt.dir} yet; the run starts at step 1")
    if ckpt.initial_load_path:
        log(f"initial weights: {ckpt.initial_load_path} (unless the run resumes)")
    if memory is None:
        log("memory: not checked (the available memory cannot be read)")
    else:
        log(f"memory planner (python -m fsdp2.plan {' '.join(memory.argv)}):\n{memory.table}")
        log(memory.summary if memory.fits else f"refused: {memory.summary}")
    log("dry run: nothing allocated; " + ("without --dry-run it trains" if memory is None or memory.fits
                                         else "without --dry-run the run is refused (or --skip-memory-check)"))


def train(config: JobConfig, dims: ParallelDims, device: torch.device) -> int:
    """Collective: build, (resume,) train, export, sample; returns the step it resumed from (0: a fresh run)."""
    t, ckpt = config.training, config.checkpoint
    checkpointer = (Checkpointer(ckpt.dir, keep=ckpt.keep, start_fresh_if_unusable=ckpt.start_fresh_if_unusable,
                                 flat_optimizer=dims.pp > 1, async_mode=ckpt.async_mode) if ckpt.dir else None)
    if restarts := int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        log(f"torchrun restart {restarts}: resuming from the newest sound "
            f"{'snapshot or ' if ckpt.snapshot_every != 'off' else ''}checkpoint")
    if checkpointer is not None:
        checkpointer.choose()  # before anything is allocated: stops here when no sound checkpoint is left
    snapshots = Snapshots(config) if ckpt.snapshot_every != "off" else None  # claims the area, before allocating
    torch.manual_seed(t.seed)
    dims.build_mesh(device.type)
    pipeline = build_pipeline(config, dims, device) if dims.pp > 1 else None
    model = build_model(config, dims, device) if pipeline is None else pipeline.model  # (pipelined: its stages')
    optimizer = build_optimizer(model, t)
    register_load_balancing(optimizer, model)  # MoE: the routing biases move before each step
    scheduler = lr_schedule(optimizer, t)
    corpus = load_data(config.data)  # (tokenized by the pre-flight check already: kept)
    tokens_per_step = log_setup(config, dims, full_parameter_count(config)[0], corpus.numel())
    held_out = None
    if config.validation.enable:  # training never sees the held-out bytes
        corpus, held_out = split_corpus(corpus, config.validation.split)
        log(f"validation: the last {held_out.numel():,} {corpus_unit(config.data)} of the data "
            f"({config.validation.split:.0%}) held out, {config.validation.steps} batches every "
            f"{config.validation.freq} steps")

    guard = SkipGuard(t.max_skipped_steps)
    start = (resume(checkpointer, model, optimizer, scheduler, guard) if snapshots is None
             else snapshots.resume(model, optimizer, scheduler, checkpointer, guard))
    if start == 0 and ckpt.initial_load_path:
        load_initial(ckpt.initial_load_path, model)
    flops = model_flops_per_token(None if pipeline else model, config)
    progress = Progress(config, tokens_per_step, start, device, flops)
    profiler = Profiler(config, dist.get_rank(), device)
    dp_rank = dims.dp_rank(dist.get_rank())
    faults = config.faults
    step = start
    try:
        for step in range(start + 1, t.steps + 1):
            poison = step in faults.nan_loss_at_steps and faults.nan_loss_rank in (-1, dist.get_rank())
            with profiler.step(step, model, optimizer):
                result = train_step(model, optimizer, scheduler, corpus, step, dp_rank, t, device, poison=poison,
                                    pipeline=pipeline)
            guard.update(step, result.skipped)
            progress.step_done()
            val_loss = None
            if held_out is not None and (step % config.validation.freq == 0 or step == t.steps):
                started = time.perf_counter()
                val_loss = validate(model, held_out, dp_rank, config, device)
                progress.exclude(time.perf_counter() - started)
            # Recorded: the steps an uninterrupted run records (so a resumed run's file reads as one
            # run), every skipped step and every validation. Printed also: the first step after a resume.
            recorded = (step % config.metrics.log_every == 0 or step in (1, t.steps) or result.skipped
                        or val_loss is not None)
            if recorded or step == start + 1:
                progress.log(step, result, guard.total, record=recorded, val_loss=val_loss)
            guard.check(step)
            if checkpointer is not None and (step == t.steps or (ckpt.every and step % ckpt.every == 0)):
                with ctrl_c_after():  # a save Ctrl-C lands in finishes first (DCP would wrap it in its error)
                    checkpointer.save(step, model, optimizer, scheduler, extra={"skips": guard.state_dict()})
            if snapshots is not None:
                snapshots.after_step(step, model, optimizer, scheduler, guard)
            kill_if_asked(faults, step)
        if checkpointer is not None:
            checkpointer.close()  # the end of the run waits for the last (async) save
    except KeyboardInterrupt:
        raise Interrupted(step, checkpointer, ckpt.every) from None
    finally:
        if progress.tensorboard is not None:
            progress.tensorboard.close()
        if pipeline is not None:
            pipeline.close()
        if snapshots is not None:  # a finished run removes its snapshots; a crashed one keeps them to resume
            snapshots.close(finished=step == t.steps)
    log(progress.summary())

    if ckpt.export:
        export_model(model, ckpt.export)
        log(f"exported the full model to {ckpt.export}")
    if ckpt.export_hf:
        export_hf_model(model, config)
        log(f"exported the model as a Hugging Face folder ({ckpt.export_hf_dtype}) to {ckpt.export_hf}")
    if config.metrics.sample_tokens and pipeline is None:  # (pipelined: no_op_warnings says so)
        tokenizer = load_tokenizer(config.data.tokenizer, eos_token=config.data.eos_token)
        sample = generate(model, "def ", config.metrics.sample_tokens, device, seed=t.seed, multiple_of=dims.tp,
                          tokenizer=tokenizer)
        log('sample (temperature 0.8, after the prompt "def "):\n' + sample)
    if progress.writer is not None and config.metrics.plot:
        png = plot_loss(progress.writer.path)
        log(f"metrics: {progress.writer.path}" + (f", loss curve: {png}" if png else
                                                  " (matplotlib not installed: no loss curve; pip install matplotlib)"))
    return start


def resume(checkpointer: Checkpointer | None, model: Transformer, optimizer: torch.optim.Optimizer,
           scheduler: torch.optim.lr_scheduler.LRScheduler, guard: SkipGuard) -> int:
    """Collective: load the newest sound checkpoint, if any; returns its step (0: start afresh)."""
    # Logs one line: "resumed from ... at step N", or why the run starts from step 0.
    if checkpointer is None or (extra := checkpointer.resume(model, optimizer, scheduler)) is None:
        return 0
    guard.load_state_dict(extra.get("skips", {"total": 0, "in_a_row": 0}))  # older checkpoints have none
    return extra["step"]


if __name__ == "__main__":
    # A rank killed by a fatal signal (SIGSEGV, SIGABRT: a C++ std::terminate) prints every
    # thread's Python stack on its way out: the only trace such a death leaves under torchrun.
    faulthandler.enable(all_threads=True)
    # Finished (or stopped with an exit code): atexit handlers, then os._exit, no finalization
    # (recipes/exit.py's Note: a torch thread racing it can abort a finished run).
    run_and_exit(main)
