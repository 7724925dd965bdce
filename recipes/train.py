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

import contextlib
import faulthandler
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Iterator, NamedTuple, NoReturn

if __package__ in (None, ""):  # run as a script (torchrun recipes/train.py): make `recipes` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

with warnings.catch_warnings():
    # torch warns at import when numpy is missing; training does not need numpy (checkpoints
    # do, and check_checkpoint_dir says so before the first step).
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp2
from recipes.checkpoint import (
    Checkpointer, UnusableCheckpointError, check_checkpoint_dir, check_export, check_initial_load, export_model,
    load_initial,
)
from recipes.config import (
    ConfigError, JobConfig, TrainingConfig, check_layout_world, command_line_keys, describe, parse_args,
)
from recipes.data import (
    ByteTokenizer, HFTokenizer, corpus_length, corpus_unit, describe_data, get_batch, load_data, load_tokenizer,
    split_corpus,
)
from recipes.exit import run_and_exit
from recipes.hf import check_hf_run, export_hf_model
from recipes.llama.model import Transformer
from recipes.llama.moe import active_params, register_load_balancing
from recipes.llama.parallelize import ParallelDims, check_layout, parallelize
from recipes.pipeline import Pipeline, build_pipeline, full_parameter_count, pipeline_layout
from recipes.pipeline import describe as describe_pipeline
from recipes.metrics import (
    MetricsWriter, TensorBoardWriter, check_tensorboard, flops_per_token, format_duration, gather_memory_mb,
    plot_loss,
)
from recipes.preflight import (
    MemoryCheck, apply_tokenizer, check_memory, check_paths, check_settings, no_op_warnings,
)
from recipes.profiling import Profiler
from recipes.snapshot import SnapshotAreaError, Snapshots, check_snapshots, kill_if_asked


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


def fail(message: str, rank0: bool) -> NoReturn:
    """Stop this rank with exit code 2 after a clean error: one line on rank 0's stderr.

    Under torchrun, every rank also writes the line to its error file (``TORCHELASTIC_ERROR_FILE``,
    see torch.distributed.elastic's errors docs), so the failure report torchrun prints after
    it names the error instead of "To enable traceback see ...". That report itself (about 30
    lines) comes from torchrun's own process, which a worker cannot silence.
    """
    if rank0:
        print(message, file=sys.stderr)
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with open(error_file, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
    if not rank0 and "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun stops every rank once the first exits: the others wait a moment so that rank 0's
        # line gets printed (every rank fails alike, and a loaded machine may run rank 0 last).
        time.sleep(2)
    sys.exit(2)


def show_recipe_logs(rank0: bool) -> None:
    """Print the recipe's own log records (checkpoint saves, prunes, resumes...) on rank 0, one line each."""
    if not rank0:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_RecipeFormatter())
    recipe_logger = logging.getLogger("recipes")
    recipe_logger.addHandler(handler)
    recipe_logger.setLevel(logging.INFO)


class _RecipeFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = "warning: " if record.levelno >= logging.WARNING else ""
        return prefix + record.getMessage()


@contextlib.contextmanager
def ctrl_c_after() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) until the block is done, then deliver it as the process would have
    (``KeyboardInterrupt`` under Python's default handler; nothing where SIGINT is ignored).

    Around a checkpoint save: interrupted inside, DCP's collectives turn the interrupt into a
    ``CheckpointException`` traceback and leave the save half-written; held, the save completes
    (every rank gets the signal from torchrun, so every rank finishes it) and the run stops with
    its one line, naming that checkpoint.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        signal.raise_signal(signal.SIGINT)  # to the handler (or disposition) the block held it from


class Interrupted(Exception):
    """Ctrl-C during training; the message says at which step, the last checkpoint and how to resume."""

    def __init__(self, step: int, checkpointer: Checkpointer | None, every: int) -> None:
        last = checkpointer.newest_saved() if checkpointer is not None else None
        if checkpointer is None:
            hint = "no checkpoints (no --checkpoint-dir): a rerun starts from step 0"
        elif last is None:
            when = f"the first is due at step {every}" if every else "the only one is due at the last step"
            hint = f"no checkpoint in {checkpointer.root} yet ({when}): a rerun starts from step 0"
        else:
            hint = f"the last checkpoint is step {last} in {checkpointer.root}: run the same command to resume from it"
        super().__init__(f"interrupted during step {step}; {hint}")


def restart_store_problem() -> str | None:
    """Why torchrun's restarts would fail to reconnect the ranks, or None.

    torch >= 2.5 lets the workers share torchrun's rendezvous store by default, and that store
    outlives a restart: the restarted workers read the previous attempt's addresses from it and
    their process group fails to connect (pytorch/pytorch#135712), using up the restarts.
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (f"torchrun --max-restarts {restarts} with the shared rendezvous store: restarted ranks may fail "
                "to connect (pytorch/pytorch#135712); launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    return None


def log(*args: object) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def build_model(config: JobConfig, dims: ParallelDims, device: torch.device) -> Transformer:
    """Build on meta (no memory), shard, then allocate each rank's shards and initialise them."""
    with torch.device("meta"):
        model = Transformer(config.model)
    parallelize(model, dims, config)
    model.to_empty(device=device)
    model.init_weights(seed=config.training.seed)
    return model


def build_optimizer(model: torch.nn.Module, t: TrainingConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (decaying norm gains toward 0 only hurts)."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))


def lr_schedule(optimizer: torch.optim.Optimizer, t: TrainingConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio``."""

    def factor(i: int) -> float:  # i = optimizer steps taken so far; step i + 1 uses this
        if i < t.warmup_steps:
            return (i + 1) / t.warmup_steps
        progress = min(1.0, (i - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class StepResult(NamedTuple):
    loss: torch.Tensor  # this rank's loss (mean over its micro-batches), not yet averaged over ranks
    grad_norm: float  # the global gradient norm before clipping, identical on every rank
    lr: float  # the learning rate this step used (or would have used, if skipped)
    skipped: bool  # the gradient norm was not finite: no optimizer step was taken


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
               corpus: torch.Tensor, step: int, dp_rank: int, t: TrainingConfig,
               device: torch.device, *, poison: bool = False, pipeline: Pipeline | None = None) -> StepResult:
    """One optimizer step over ``t.grad_accum`` micro-batches, or none if the gradients are not finite.

    ``poison`` multiplies the loss by NaN (``faults.nan_loss_at_steps``: a bad batch on demand,
    to test the skip). ``pipeline``: the batches run through this rank's pipeline stages instead.
    """
    loss_sum = torch.zeros((), device=device)
    if pipeline is not None:
        loss_sum = pipeline.forward_backward(corpus, step, dp_rank, t, device, poison=poison)
    # Every micro-batch's backward reduce-scatters its gradients, which accumulate on the
    # sharded .grad; dividing each loss by grad_accum makes the sum the mean.
    for micro in range(t.grad_accum if pipeline is None else 0):
        inputs, targets = get_batch(corpus, seed=t.seed, step=step, rank=dp_rank, micro=micro,
                                    batch_size=t.batch_size, seq_len=t.seq_len)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        logits = model(inputs)  # (batch, seq, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / t.grad_accum
        if poison:
            loss = loss * float("nan")
        loss.backward()
        loss_sum += loss.detach()
    # The norm of the full gradient, identical on every rank. fsdp2's clip_grad_norm_, not
    # torch's: under FSDP x TP some gradients live on the dp mesh and some on the (dp, tp)
    # mesh, and torch's cannot combine norms across meshes. Pipelined, over every stage's gradients.
    grad_norm = fsdp2.clip_grad_norm_(model.parameters(), t.max_grad_norm or float("inf"),
                                      pp_mesh=pipeline.pp_mesh if pipeline is not None else None).item()
    lr = scheduler.get_last_lr()[0]  # the rate this step uses
    # A bad batch: a non-finite loss on any rank makes its gradients, and so the global norm,
    # non-finite. The norm is the same on every rank, so all of them skip together with no
    # extra collective. The gradients are dropped below; the weights and AdamW's moments and
    # step count stay as they were.
    skipped = not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
    with warnings.catch_warnings():
        # When the first steps are skipped, torch warns that the scheduler steps before the
        # optimizer ever did; here that is on purpose.
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()` before")
        scheduler.step()  # also when skipped: the learning rate stays a function of the step number
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, grad_norm, lr, skipped)


class SkipGuard:
    """Counts skipped steps and stops the run after ``limit`` in a row (0: never).

    Its counters go into every checkpoint, so a resumed run stops where the uninterrupted
    one would have.
    """

    def __init__(self, limit: int) -> None:
        self.limit, self.total, self.in_a_row = limit, 0, 0

    def update(self, step: int, skipped: bool) -> None:
        self.total += skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if skipped:
            limit = f"the run stops at {self.limit}" if self.limit else "no limit"
            log(f"warning: step {step}: the gradient norm is not finite; skipped the optimizer step "
                f"({self.in_a_row} in a row, {limit}: training.max_skipped_steps)")

    def check(self, step: int) -> None:
        """Raise once ``limit`` steps in a row were skipped (every rank: the decision is global)."""
        if self.limit and self.in_a_row >= self.limit:
            raise RuntimeError(
                f"steps {step - self.in_a_row + 1}-{step}: {self.in_a_row} steps in a row had a non-finite "
                f"gradient norm and were skipped (training.max_skipped_steps={self.limit}). The run is diverging "
                "or the data is bad: resume from an earlier checkpoint with a lower training.lr, or check the "
                "data of these steps; raise training.max_skipped_steps (0: no limit) to skip more")

    def state_dict(self) -> dict[str, int]:
        return {"total": self.total, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total, self.in_a_row = state["total"], state["in_a_row"]


class Progress:
    """Turns logged steps into a printed line and a metrics record (tokens/s over the last window)."""

    def __init__(self, config: JobConfig, tokens_per_step: int, start: int, device: torch.device,
                 flops_per_token: int) -> None:
        self.total, self.start, self.device = config.training.steps, start, device
        self.tokens_per_step = tokens_per_step
        self.flops_per_token, self.peak_tflops = flops_per_token, config.metrics.peak_tflops
        self.writer = self.tensorboard = None
        if config.metrics.file and dist.get_rank() == 0:
            self.writer = MetricsWriter(config.metrics.file, resume_step=start)
        if config.metrics.enable_tensorboard and dist.get_rank() == 0:
            self.tensorboard = TensorBoardWriter(Path(config.job.dump_folder) / "tb", resume_step=start)
            log(f"metrics: TensorBoard events in {self.tensorboard.folder} (tensorboard --logdir "
                f"{self.tensorboard.folder})")
        self.loop_start = self.window_start = time.perf_counter()
        self.window_steps = 0
        self.losses: list[float] = []

    def step_done(self) -> None:
        self.window_steps += 1

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (validation) out of the training throughput."""
        self.window_start += seconds

    def log(self, step: int, result: StepResult, skipped_total: int, *, record: bool = True,
            val_loss: float | None = None) -> None:
        """Collective: average the loss over ranks, gather memory, print and (if ``record``) record."""
        loss, grad_norm, lr = result.loss, result.grad_norm, result.lr
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        self.losses.append(loss.item())
        memory = gather_memory_mb(self.device)
        now = time.perf_counter()
        tokens_per_s = self.tokens_per_step * self.window_steps / (now - self.window_start)
        eta = (now - self.loop_start) / (step - self.start) * (self.total - step)
        record = {"step": step, "loss": self.losses[-1], "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": tokens_per_s, "tokens": self.tokens_per_step * step,
                  "elapsed_s": now - self.loop_start, "eta_s": eta, "memory_mb": memory,
                  "skipped": result.skipped, "skipped_steps": skipped_total, **self.throughput(tokens_per_s),
                  **({"val_loss": val_loss} if val_loss is not None else {})}
        if record:
            for writer in (self.writer, self.tensorboard):
                if writer is not None:
                    writer.write(record)
        log(f"step {step:>{len(str(self.total))}}/{self.total}  loss {self.losses[-1]:.4f}  lr {lr:.2e}  "
            f"gnorm {grad_norm:.2f}  {tokens_per_s:,.0f} tok/s  "
            f"mem {'/'.join(f'{m:.0f}' for m in memory)} MiB  eta {format_duration(eta)}"
            + ("  (skipped)" if result.skipped else ""))
        if val_loss is not None:
            log(f"step {step:>{len(str(self.total))}}/{self.total}  validation loss {val_loss:.4f} (held-out data)")
        self.window_start, self.window_steps = now, 0

    def throughput(self, tokens_per_s: float) -> dict[str, float]:
        """Model TFLOPS per rank at ``tokens_per_s`` (all ranks), and the MFU when the peak is known."""
        tflops = tokens_per_s * self.flops_per_token / dist.get_world_size() / 1e12
        return {"tflops_per_rank": tflops, **({"mfu": tflops / self.peak_tflops} if self.peak_tflops else {})}

    def summary(self) -> str:
        if not self.losses:
            return f"nothing to train: the checkpoint is at step {self.start} of {self.total}"
        elapsed = time.perf_counter() - self.loop_start
        rate = self.tokens_per_step * (self.total - self.start) / elapsed
        speed = self.throughput(rate)
        mfu = f", MFU {100 * speed['mfu']:.1f}%" if "mfu" in speed else ""
        return (f"done: steps {self.start + 1}-{self.total} in {format_duration(elapsed)}, loss "
                f"{self.losses[0]:.4f} -> {self.losses[-1]:.4f}, {rate:,.0f} tok/s, "
                f"{speed['tflops_per_rank']:.3g} TFLOPS per rank{mfu}")


def log_setup(config: JobConfig, dims: ParallelDims, n_params: int, corpus_tokens: int) -> int:
    """Print what is about to run; returns the tokens per optimizer step."""
    t, args, mesh = config.training, config.model, dims.mesh
    tokens_per_step = t.batch_size * t.seq_len * t.grad_accum * dims.dp_size
    log(f"world {dims.world_size} ({mesh.device_type}, {dist.get_backend()}), "
        f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}, {t.mixed_precision}, "
        f"activation checkpointing {'on' if t.activation_checkpoint else 'off'}")
    log(f"model: {n_params / 1e6:.2f}M parameters, {args.n_layers} layers, "
        f"dim {args.dim}, {args.n_heads} heads ({args.kv_heads} kv), vocab {args.vocab_size}"
        + (f", {args.moe_experts} experts (top {args.moe_top_k}) per block" if args.moe_experts else ""))
    log(describe_data(config.data, corpus_tokens))
    log(f"tokens/step = {t.batch_size} batch x {t.seq_len} seq x {t.grad_accum} accum x {dims.dp_size} dp ranks "
        f"= {tokens_per_step:,}; chance loss ln({args.vocab_size}) = {math.log(args.vocab_size):.3f}")
    if dims.pp > 1:
        log(describe_pipeline(pipeline_layout(config)))
    return tokens_per_step


def model_flops_per_token(model: Transformer | None, config: JobConfig) -> int:
    """Training FLOPs per token of the unsharded model (``recipes.metrics.flops_per_token``);
    ``model`` None: counted on a meta build (a pipeline rank holds only its stages)."""
    args = config.model
    if model is None:  # a pipeline rank holds only its stages (MoE models are not pipelined)
        n_params, embedding = full_parameter_count(config)
    else:  # DTensors: the global count; MoE: the parameters a token uses
        n_params, embedding = (active_params(model, sum(p.numel() for p in model.parameters())),
                               model.tok_embeddings.weight.numel())
    # A tied table is also the output projection, whose matmul costs what its weights say.
    embedding = 0 if args.tie_embeddings else embedding
    return flops_per_token(n_params, embedding, args.n_layers, args.dim, config.training.seq_len)


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


@torch.no_grad()
def validate(model: Transformer, held_out: torch.Tensor, dp_rank: int, config: JobConfig,
             device: torch.device) -> float:
    """Collective: the mean loss on ``validation.steps`` held-out batches per data-parallel rank, over all ranks.

    The same batches every time (the batch function at step 0, on the held-out bytes), so the
    numbers of one run are comparable; no gradients, no state changed.
    """
    t, steps = config.training, config.validation.steps
    total = torch.zeros((), device=device)
    for i in range(steps):
        inputs, targets = get_batch(held_out, seed=t.seed, step=0, rank=dp_rank, micro=i,
                                    batch_size=t.batch_size, seq_len=t.seq_len)
        logits = model(inputs.to(device))  # (batch, seq, vocab)
        total += F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten())
    total /= steps
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total.item()


def resume(checkpointer: Checkpointer | None, model: Transformer, optimizer: torch.optim.Optimizer,
           scheduler: torch.optim.lr_scheduler.LRScheduler, guard: SkipGuard) -> int:
    """Collective: load the newest sound checkpoint, if any; returns its step (0: start afresh)."""
    # Logs one line: "resumed from ... at step N", or why the run starts from step 0.
    if checkpointer is None or (extra := checkpointer.resume(model, optimizer, scheduler)) is None:
        return 0
    guard.load_state_dict(extra.get("skips", {"total": 0, "in_a_row": 0}))  # older checkpoints have none
    return extra["step"]


@torch.no_grad()
def generate(model: Transformer, prompt: str, n_tokens: int, device: torch.device, *,
             temperature: float = 0.8, seed: int = 0, multiple_of: int = 1,
             tokenizer: ByteTokenizer | HFTokenizer | None = None) -> str:
    """Sample a continuation of ``prompt``; collective (every rank runs the same forwards).

    ``multiple_of``: inputs are right-padded to a multiple of it (the TP degree: sequence
    parallelism needs even sequence shards). Attention is causal, so padding after the
    last real token never changes its logits.
    """
    tokenizer = tokenizer or load_tokenizer()  # (None: bytes)
    gen = torch.Generator().manual_seed(seed)  # the same draws on every rank
    tokens = torch.tensor([tokenizer.encode(prompt)], device=device)  # (1, seq)
    window = model.args.max_seq_len // multiple_of * multiple_of
    for _ in range(n_tokens):
        context = tokens[:, -window:]
        padded = F.pad(context, (0, -context.shape[1] % multiple_of))  # (1, seq rounded up)
        # (the tokenizer's ids only: a Hugging Face model's vocabulary may be larger)
        logits = model(padded)[0, context.shape[1] - 1, :tokenizer.vocab_size].float().cpu()  # (tokenizer vocab,)
        probs = torch.softmax(logits / temperature, dim=-1)
        next_token = torch.multinomial(probs, 1, generator=gen).to(device)
        tokens = torch.cat([tokens, next_token[None]], dim=1)
    return tokenizer.decode(tokens[0].tolist())


if __name__ == "__main__":
    # A rank killed by a fatal signal (SIGSEGV, SIGABRT: a C++ std::terminate) prints every
    # thread's Python stack on its way out: the only trace such a death leaves under torchrun.
    faulthandler.enable(all_threads=True)
    # Finished (or stopped with an exit code): atexit handlers, then os._exit, no finalization
    # (recipes/exit.py's Note: a torch thread racing it can abort a finished run).
    run_and_exit(main)
