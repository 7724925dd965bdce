"""What a command line is checked for before any process group starts, and the memory check.

``check_command`` (the keys, the layout on the world size, then ``check_run``: paths, packages,
data, checkpoints) raises ConfigError or ValueError; ``preflight_memory`` asks the memory planner
on every rank and stops a run that would not fit (``recipes/preflight.py`` holds the checks).
"""

from __future__ import annotations

import sys

import torch

from .checkpoint import check_checkpoint_dir, check_export, check_initial_load
from .config import JobConfig, check_layout_world, command_line_keys, parse_args
from .data import corpus_length, corpus_unit
from .hf import check_hf_run
from .launch import fail
from .llama.parallelize import ParallelDims, check_layout
from .metrics import check_tensorboard
from .preflight import MemoryCheck, apply_tokenizer, check_memory, check_paths, check_settings
from .snapshot import check_snapshots


def check_command(argv: list[str], world_size: int) -> tuple[JobConfig, ParallelDims]:
    """Everything a command line is checked for before any process group starts: its keys and
    values, the layout on ``world_size`` ranks, and what training will need (``check_run``).
    Raises ConfigError or ValueError (tests/tools/test_doc_commands.py runs the docs' commands through it)."""
    config = parse_args(argv)
    apply_tokenizer(config, command_line_keys(argv))  # model.vocab_size from --tokenizer
    check_layout_world(argv, world_size)
    p = config.parallelism
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, world_size, ep=p.ep, pp=p.pp)
    check_layout(dims, config)
    check_run(config, world_size)
    return config, dims


def check_run(config: JobConfig, world_size: int = 1) -> None:
    """Raise ValueError for what would fail only after training started: missing packages, bad paths, data,
    settings the user cannot have meant."""
    check_paths(config)
    check_settings(config, world_size)
    if config.checkpoint.dir:
        check_checkpoint_dir(config.checkpoint.dir)
    if config.checkpoint.export:
        check_export(config.checkpoint.export)
    if config.checkpoint.initial_load_path:
        check_initial_load(config.checkpoint.initial_load_path)
    check_hf_run(config)  # a Hugging Face model in (its tensors, the tokenizer's vocabulary) or out
    check_snapshots(config, world_size)
    if config.metrics.enable_tensorboard:
        check_tensorboard()
    v, t = config.validation, config.training
    if v.enable and (held_out := int(corpus_length(config.data) * v.split)) < t.seq_len + 2:
        raise ValueError(f"validation.split={v.split} holds out {held_out} {corpus_unit(config.data)} of "
                         f"the data, fewer than training.seq_len + 2 = {t.seq_len + 2}; raise validation.split or use "
                         "more data")


def preflight_memory(config: JobConfig, dims: ParallelDims, device: torch.device, rank0: bool) -> MemoryCheck | None:
    """Every rank asks the memory planner, before ``init_process_group`` (it runs fsdp2 over a fake
    process group) and before allocating; a run that does not fit stops here with rank 0's line.

    Every rank decides for itself (the same deterministic simulation), so none waits for a peer
    that has already stopped, and every rank's error file names the layouts that would fit.
    """
    if config.job.skip_memory_check and not config.job.dry_run:
        return None
    check = check_memory(config, dims, device.type, local_rank=device.index or 0)
    if check is None:
        if rank0:
            print("warning: cannot read this machine's available memory: the memory check is skipped",
                  file=sys.stderr)
        return None
    if check.fits and rank0 and not config.job.dry_run:
        print(check.summary, flush=True)
    if not check.fits and not config.job.dry_run:
        fail(f"error: {check.summary}", rank0)
    return check
