"""What the recipe checks before a rank allocates anything: paths, settings that would do nothing, memory.

- ``check_paths``: every path the run reads or writes (data, checkpoints, the metrics file,
  TensorBoard, traces, snapshots), with one line naming the path and the fix.
- ``no_op_warnings``: settings that cannot take effect on the run as configured (a trace step
  past the last step, a warmup longer than the run, ...); ``check_settings`` raises for those
  the user cannot have meant (a fault injected on a rank that does not exist).
- ``check_memory``: the memory planner (``fsdp2.plan.check_fit``: fsdp2 itself runs the step
  on the meta device) predicts one rank's peak for this model and layout; a run that cannot
  fit is refused before it allocates, naming the nearest layouts that do.

The device's memory: a GPU's total memory (the planner adds what a CUDA process holds besides
the step: context, NCCL, fragmentation). On CPU, the memory the kernel reports available
(``MemAvailable`` in /proc/meminfo, read as the ranks start, so their Python and torch are
already counted) divided by the ranks on this machine (``LOCAL_WORLD_SIZE``): the ranks share
it, and the planner's peak is per rank.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import re
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist

from fsdp2.checkpoint import is_hf_folder
from fsdp2.plan import NOTHING_FITS, check_fit

from .config import ConfigError, JobConfig
from .data import corpus_files, corpus_length, corpus_unit, data_format, load_tokenizer
from .llama.parallelize import ParallelDims

__all__ = ["apply_tokenizer", "check_paths", "no_op_warnings", "check_settings", "device_memory", "plan_argv",
           "check_memory", "MemoryCheck"]

_GiB = 2**30


# ---- paths ------------------------------------------------------------------------------------
def _creatable_dir(path: str | Path, what: str) -> None:
    """Raise ValueError unless ``path`` is a directory or could be made one (mkdir -p); ``what``
    names the setting ("checkpoint.dir=runs/ckpt")."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{what}: {path} is a file, not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{what}: {path} is not writable by this user")
        return
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{what}: cannot create {path}, {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: cannot create {path}, {parent} is not writable by this user")


def check_paths(config: JobConfig) -> None:
    """Raise ValueError naming the first path the run could not read or write."""
    t, m, c = config.training, config.metrics, config.checkpoint
    flag = f"--data {config.data.path}"
    try:
        files = corpus_files(config.data.path)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    unreadable = [f for f in files if not os.access(f, os.R_OK)]
    if unreadable:
        raise ValueError(f"{flag}: cannot read {unreadable[0]}" + (f" and {len(unreadable) - 1} more files"
                                                                     if len(unreadable) > 1 else ""))
    size = corpus_length(config.data)  # with a tokenizer or rows: tokenized here, kept for training
    if size < t.seq_len + 2:
        raise ValueError(f"{flag}: {size} {corpus_unit(config.data)}, fewer than training.seq_len + 2 = "
                         f"{t.seq_len + 2}; give more data or shorten training.seq_len")
    if c.dir:
        _creatable_dir(c.dir, f"checkpoint.dir={c.dir}")
    for key, path in (("checkpoint.export", c.export), ("metrics.file", m.file)):
        if path:
            if Path(path).is_dir():
                raise ValueError(f"{key}={path} is a directory; give a file name")
            _creatable_dir(Path(path).parent, f"{key}={path}")
    dump = Path(config.job.dump_folder)
    p = config.profiling
    for enabled, sub, why in ((m.enable_tensorboard, "tb", "metrics.enable_tensorboard"),
                              (p.trace_steps, "profile_traces", "profiling.trace_steps"),
                              (p.memory_snapshot_steps, "memory_snapshot", "profiling.memory_snapshot_steps")):
        if enabled:
            _creatable_dir(dump / sub, f"job.dump_folder={dump} (for {why})")


# ---- the tokenizer's vocabulary ----------------------------------------------------------------
def apply_tokenizer(config: JobConfig, given: set[str] = frozenset()) -> None:
    """Set ``model.vocab_size`` to ``--tokenizer``'s vocabulary, unless the command line (``given``) set
    it; raise ConfigError when the model's vocabulary is smaller than the tokenizer's (or ValueError for
    a tokenizer that cannot be read)."""
    d = config.data
    if config.checkpoint.initial_load_path and is_hf_folder(config.checkpoint.initial_load_path):
        return  # the vocabulary is the model folder's config.json (recipes.hf.check_hf_run checks the tokenizer's)
    needed = load_tokenizer(d.tokenizer, eos_token=d.eos_token).vocab_size
    have = config.model.vocab_size
    if d.tokenizer is not None and "model.vocab_size" not in given:
        config.model = dataclasses.replace(config.model, vocab_size=needed)
    elif have < needed:
        tokenizer = f"--tokenizer {d.tokenizer}" if d.tokenizer else "the byte tokenizer"
        raise ConfigError(f"model.vocab_size={have} is smaller than the {needed:,} token ids of {tokenizer}; "
                          f"leave model.vocab_size out (it follows --tokenizer) or give {needed} or more")


# ---- settings that would do nothing -----------------------------------------------------------
def _default(section: str, name: str) -> object:
    owner = type(getattr(JobConfig(), section))
    return getattr(owner(), name)


def _given(config: JobConfig, given: set[str], section: str, *names: str) -> list[str]:
    """``section.name=value`` for each of ``names`` the command line set (``given``) to other than its default."""
    obj = getattr(config, section)
    return [f"{section}.{n}={getattr(obj, n)}" for n in names
            if f"{section}.{n}" in given and getattr(obj, n) != _default(section, n)]


def no_op_warnings(config: JobConfig, given: set[str] = frozenset()) -> list[str]:
    """One line per setting that cannot take effect on this run as configured.

    Steps past the run's end and a warmup longer than the run are always named. A setting that
    needs another one (``validation.freq`` without ``validation.enable``) only when the command
    line (``given``: its ``section.key`` names) set it: a config file may hold such defaults for
    the runs that turn the feature on (tiny.toml's ``checkpoint.every`` for ``--checkpoint-dir``).
    """
    t, v, c, m, p, f = (config.training, config.validation, config.checkpoint, config.metrics, config.profiling,
                        config.faults)
    steps, out = t.steps, []
    for key, listed in (("profiling.trace_steps", p.trace_steps),
                        ("profiling.memory_snapshot_steps", p.memory_snapshot_steps),
                        ("faults.nan_loss_at_steps", f.nan_loss_at_steps)):
        if late := [s for s in listed if s > steps]:
            out.append(f"{key}: step{'s' * (len(late) > 1)} {','.join(map(str, late))} never run"
                       f"{'s' * (len(late) == 1)} (training.steps={steps})")
    if t.warmup_steps > steps:
        out.append(f"training.warmup_steps={t.warmup_steps} is longer than the run (training.steps={steps}): the "
                   f"learning rate reaches only {steps / t.warmup_steps:.0%} of training.lr={t.lr:g} and never decays")
    if v.enable and v.freq > steps:
        out.append(f"validation.freq={v.freq} > training.steps={steps}: validation runs once, after the last step")
    if c.dir and c.every > steps:
        out.append(f"checkpoint.every={c.every} > training.steps={steps}: the only checkpoint is the last step's")
    if not v.enable and (changed := _given(config, given, "validation", "split", "freq", "steps")):
        out.append(f"{', '.join(changed)}: no effect without validation.enable=true")
    if not c.dir and (changed := _given(config, given, "checkpoint", "every", "keep", "start_fresh_if_unusable")):
        out.append(f"{', '.join(changed)}: no effect without checkpoint.dir (--checkpoint-dir DIR)")
    if m.log_every > steps and "metrics.log_every" in given:
        out.append(f"metrics.log_every={m.log_every} > training.steps={steps}: only the first and last steps are "
                   "printed and recorded")
    if not m.file and m.plot and "metrics.plot" in given:  # (turning it off is no mistake)
        out.append("metrics.plot=True: no effect without metrics.file (the curve is drawn from it)")
    q = config.parallelism
    if not (q.quantize_weights or q.quantize_gradients) and (
            changed := _given(config, given, "parallelism", "quantize_block_size")):
        out.append(f"{changed[0]}: no effect without parallelism.quantize_weights or quantize_gradients")
    if not config.model.moe_experts and (changed := _given(config, given, "model", "moe_top_k", "moe_hidden",
                                                           "moe_shared_experts", "moe_score_func",
                                                           "moe_load_balance_coeff")):
        out.append(f"{', '.join(changed)}: no effect without model.moe_experts > 0 (a mixture of experts)")
    if q.pp > 1 and m.sample_tokens:
        out.append(f"metrics.sample_tokens={m.sample_tokens}: no sample with parallelism.pp={q.pp} (each rank holds "
                   "only its pipeline stages)")
    if q.pp == 1 and (changed := _given(config, given, "parallelism", "pp_schedule", "pp_microbatches",
                                        "pp_layers_per_stage")):
        out.append(f"{', '.join(changed)}: no effect without parallelism.pp > 1 (--pp N)")
    d = config.data
    if d.tokenizer is None and (changed := _given(config, given, "data", "eos_token")):
        out.append(f"{changed[0]}: no effect without data.tokenizer (--tokenizer; bytes separate documents by a "
                   "newline)")
    if "data.text_field" in given and data_format(d.path) == "text":
        out.append(f"data.text_field={d.text_field}: no effect on text files (only .jsonl, .parquet or a datasets "
                   "folder have fields)")
    if not f.nan_loss_at_steps and "faults.nan_loss_rank" in given and f.nan_loss_rank != -1:
        out.append(f"faults.nan_loss_rank={f.nan_loss_rank}: no effect without faults.nan_loss_at_steps")
    return out


def check_settings(config: JobConfig, world_size: int) -> None:
    """Raise ConfigError for a setting the user cannot have meant on ``world_size`` ranks."""
    f = config.faults
    if f.nan_loss_rank >= world_size:
        raise ConfigError(f"faults.nan_loss_rank={f.nan_loss_rank}, but the run has ranks 0-{world_size - 1}; "
                          "give one of them or -1 (every rank)")


# ---- memory -----------------------------------------------------------------------------------
def device_memory(device_type: str, local_rank: int = 0) -> tuple[int, str] | None:
    """(bytes one rank may use, how that was found), or None where it cannot be read."""
    if device_type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(local_rank).total_memory
        return total, f"cuda:{local_rank}'s total memory"
    available = _available_memory()
    if available is None:
        return None
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return available // ranks, f"{available / _GiB:.1f} GiB available on this machine / {ranks} local rank" + \
        "s" * (ranks != 1)


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def plan_argv(config: JobConfig, dims: ParallelDims, device_type: str, memory: int) -> list[str]:
    """``python -m fsdp2.plan`` flags for this run's model and layout (the resolved config, overrides included)."""
    a, t, p = config.model, config.training, config.parallelism
    argv = ["--dim", a.dim, "--n-layers", a.n_layers, "--n-heads", a.n_heads, "--n-kv-heads", a.kv_heads,
            "--vocab-size", a.vocab_size, "--ffn-hidden", a.ffn_hidden, "--max-seq-len", a.max_seq_len,
            "--tie-embeddings", str(a.tie_embeddings).lower(),
            "--world", dims.world_size, "--dp-replicate", dims.dp_replicate, "--tp", dims.tp,
            "--batch", t.batch_size, "--seq", t.seq_len, "--grad-accum", t.grad_accum,
            "--param-dtype", t.mixed_precision, "--reduce-dtype", "fp32",
            "--reshard-after-forward", _plan_reshard(p.reshard_after_forward, p.pp, dims.dp_shard),
            "--activation-checkpointing", "full" if t.activation_checkpoint else "none",
            "--backend", "nccl" if device_type == "cuda" else "gloo", "--gpu-memory", f"{memory}B"]
    if a.moe_experts:  # a mixture of experts (the planner's routing: balanced)
        argv += ["--moe-experts", a.moe_experts, "--moe-top-k", a.moe_top_k, "--moe-hidden", a.expert_hidden,
                 "--moe-shared-experts", a.moe_shared_experts, "--ep", dims.ep]
    if p.pp > 1:
        argv += ["--pp", p.pp, "--pp-schedule", p.pp_schedule, "--pp-microbatches", p.pp_microbatches,
                 "--pp-layers-per-stage", p.pp_layers_per_stage]
    if p.quantize_weights:
        argv += ["--quantize-weights", p.quantize_weights]
    if p.quantize_gradients:
        argv += ["--quantize-gradients", p.quantize_gradients, "--quantize-gradient-axes", p.quantize_gradient_axes]
    if p.quantize_error_feedback:
        argv.append("--error-feedback")
    return [str(x) for x in argv]


def _plan_reshard(choice: str | int, pp: int, dp_shard: int) -> str:
    """The planner's --reshard-after-forward for the recipe's parallelism.reshard_after_forward (the
    blocks'): true, false, or an int N that is neither (1 keeps the parameters; dp_shard reshards them)."""
    if isinstance(choice, int) and 1 < choice < dp_shard:
        return str(choice)
    if isinstance(choice, int):
        return str(choice == dp_shard).lower()
    return str(choice == "always" or (choice == "default" and pp == 1)).lower()


# The planner's suggestions, in the recipe's flags.
_RECIPE_FLAGS = [
    (r"--activation-checkpointing full", "--training.activation_checkpoint=true"),
    (r"--reshard-after-forward true", "--parallelism.reshard_after_forward=default"),
    (r"--reshard-after-forward (\d+)", r"--parallelism.reshard_after_forward=\1"),
    (r"--batch (\d+) --grad-accum (\d+)", r"--training.batch_size=\1 --training.grad_accum=\2"),
    (r"--world (\d+)", r"\1 ranks (torchrun --nnodes/--nproc-per-node)"),
]


def recipe_flags(plan_flags: str, *, pipelined: bool = False) -> str:
    """The planner's flags in the recipe's. ``pipelined``: the run has pp > 1, where the recipe's
    "default" keeps the blocks' parameters, so the planner's resharding is "always" there."""
    if pipelined:
        plan_flags = plan_flags.replace("--reshard-after-forward true", "--parallelism.reshard_after_forward=always")
    for pattern, replacement in _RECIPE_FLAGS:
        plan_flags = re.sub(pattern, replacement, plan_flags)
    return plan_flags


def _size(nbytes: int) -> str:
    return f"{nbytes / _GiB:.2f} GiB" if nbytes >= _GiB else f"{nbytes / 2**20:.1f} MiB"


class MemoryCheck(NamedTuple):
    fits: bool
    summary: str  # one line: the planner's figures and the device's
    table: str  # the planner's full table (what --dry-run prints)
    argv: list[str]  # the python -m fsdp2.plan flags that reproduce it


def check_memory(config: JobConfig, dims: ParallelDims, device_type: str, *, local_rank: int = 0) -> MemoryCheck | None:
    """The planner's verdict for this run (None where the device's memory cannot be read).

    The planner runs fsdp2 over a fake process group, which must be this process's only one:
    before ``init_process_group`` (as ``train.py`` calls it) it runs here; in a process that has a
    default process group already, it runs in a child process.
    """
    found = device_memory(device_type, local_rank)
    if found is None:
        return None
    memory, source = found
    argv = plan_argv(config, dims, device_type, memory)
    if not dist.is_initialized():
        return _verdict(argv, memory, source)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as child:
        return child.submit(_verdict, argv, memory, source).result()


def _verdict(argv: list[str], memory: int, source: str) -> MemoryCheck:
    fit = check_fit(argv)
    est = fit.estimate
    needs = f"{_size(est.needed_bytes)} per rank"
    device = f"{_size(memory)} ({source})"
    if est.fits:
        summary = (f"memory: the planner says {needs} (peak at {est.peak_point}), "
                   f"{100 * est.needed_bytes / memory:.1f}% of the device's {device}")
        return MemoryCheck(True, summary, est.table(), argv)
    if fit.fitting:
        pipelined = "--pp" in argv
        layouts = "; ".join(f"{recipe_flags(flags, pipelined=pipelined)} ({_size(e.needed_bytes)})"
                            for flags, e in fit.fitting)
        layouts = f"these layouts fit: {layouts}"
    else:
        layouts = NOTHING_FITS.replace("--tp", "tp").replace("the GPUs", "the ranks")
    summary = (f"needs {needs} by the memory planner (peak at {est.peak_point}), the device has {device}; "
               f"{layouts}. --skip-memory-check runs it anyway; python -m fsdp2.plan {' '.join(argv)} shows why")
    return MemoryCheck(False, summary, est.table(), argv)
