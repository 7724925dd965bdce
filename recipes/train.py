"""Train a Llama-style byte-level language model with fsdp2.

    torchrun --nproc-per-node 2 recipes/train.py [--config FILE] [--section.key=value ...]

With no arguments it trains the tiny config (recipes/configs/tiny.toml) on the Python
standard library's own source files, on 2 CPU ranks (gloo) or on GPUs (NCCL) when CUDA
is available. Short flags: --dp-shard N, --dp-replicate N, --tp N (-1 = infer from the
world size), --steps N, --data PATH, --checkpoint-dir DIR, --checkpoint-every N,
--metrics-file PATH. A run given a checkpoint directory that holds a complete checkpoint
resumes from it. Every key (--help lists them) can be overridden as --section.key=value.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script (torchrun recipes/train.py): make `recipes` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp2
from recipes.checkpoint import Checkpointer, check_export, export_model
from recipes.config import ConfigError, JobConfig, TrainingConfig, describe, parse_args
from recipes.data import ByteTokenizer, corpus_files, get_batch, load_corpus
from recipes.llama.model import Transformer
from recipes.llama.parallelize import ParallelDims, check_layout, parallelize
from recipes.metrics import MetricsWriter, format_duration, gather_memory_mb, plot_loss


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    rank0 = os.environ.get("RANK", "0") == "0"
    if "-h" in argv or "--help" in argv:
        if rank0:
            print(__doc__ + "\nKeys, with the values of the default config:\n" + describe(parse_args([])))
        return
    try:
        config = parse_args(argv)
        p = config.parallelism
        dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, int(os.environ.get("WORLD_SIZE", "1")))
        check_layout(dims, config)
        if config.checkpoint.export:
            check_export(config.checkpoint.export)
    except (ConfigError, ValueError) as e:  # before any process starts a collective
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        if dist.get_world_size() != dims.world_size:
            raise RuntimeError(f"WORLD_SIZE={dims.world_size} but the process group has {dist.get_world_size()} ranks")
        train(config, dims, device)
    finally:
        dist.destroy_process_group()


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


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
               corpus: torch.Tensor, step: int, dp_rank: int, t: TrainingConfig,
               device: torch.device) -> tuple[torch.Tensor, float, float]:
    """One optimizer step over ``t.grad_accum`` micro-batches; returns (this rank's loss, grad norm, lr)."""
    loss_sum = torch.zeros((), device=device)
    # Every micro-batch's backward reduce-scatters its gradients, which accumulate on the
    # sharded .grad; dividing each loss by grad_accum makes the sum the mean.
    for micro in range(t.grad_accum):
        inputs, targets = get_batch(corpus, seed=t.seed, step=step, rank=dp_rank, micro=micro,
                                    batch_size=t.batch_size, seq_len=t.seq_len)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        logits = model(inputs)  # (batch, seq, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / t.grad_accum
        loss.backward()
        loss_sum += loss.detach()
    # The norm of the full gradient, identical on every rank. fsdp2's clip_grad_norm_, not
    # torch's: under FSDP x TP some gradients live on the dp mesh and some on the (dp, tp)
    # mesh, and torch's cannot combine norms across meshes.
    grad_norm = fsdp2.clip_grad_norm_(model.parameters(), t.max_grad_norm or float("inf"))
    lr = scheduler.get_last_lr()[0]  # the rate this step uses
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm.item(), lr


class Progress:
    """Turns logged steps into a printed line and a metrics record (tokens/s over the last window)."""

    def __init__(self, config: JobConfig, tokens_per_step: int, start: int, device: torch.device) -> None:
        self.total, self.start, self.device = config.training.steps, start, device
        self.tokens_per_step = tokens_per_step
        self.writer = None
        if config.metrics.file and dist.get_rank() == 0:
            self.writer = MetricsWriter(config.metrics.file, resume_step=start)
        self.loop_start = self.window_start = time.perf_counter()
        self.window_steps = 0
        self.losses: list[float] = []

    def step_done(self) -> None:
        self.window_steps += 1

    def log(self, step: int, loss: torch.Tensor, grad_norm: float, lr: float) -> None:
        """Collective: average the loss over ranks, gather memory, print and record."""
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        self.losses.append(loss.item())
        memory = gather_memory_mb(self.device)
        now = time.perf_counter()
        tokens_per_s = self.tokens_per_step * self.window_steps / (now - self.window_start)
        eta = (now - self.loop_start) / (step - self.start) * (self.total - step)
        record = {"step": step, "loss": self.losses[-1], "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": tokens_per_s, "tokens": self.tokens_per_step * step,
                  "elapsed_s": now - self.loop_start, "eta_s": eta, "memory_mb": memory}
        if self.writer is not None:
            self.writer.write(record)
        log(f"step {step:>{len(str(self.total))}}/{self.total}  loss {self.losses[-1]:.4f}  lr {lr:.2e}  "
            f"gnorm {grad_norm:.2f}  {tokens_per_s:,.0f} tok/s  "
            f"mem {'/'.join(f'{m:.0f}' for m in memory)} MiB  eta {format_duration(eta)}")
        self.window_start, self.window_steps = now, 0

    def summary(self) -> str:
        if not self.losses:
            return f"nothing to train: the checkpoint is at step {self.start} of {self.total}"
        elapsed = time.perf_counter() - self.loop_start
        rate = self.tokens_per_step * (self.total - self.start) / elapsed
        return (f"done: steps {self.start + 1}-{self.total} in {format_duration(elapsed)}, loss "
                f"{self.losses[0]:.4f} -> {self.losses[-1]:.4f}, {rate:,.0f} tok/s")


def log_setup(config: JobConfig, dims: ParallelDims, model: Transformer, corpus: torch.Tensor) -> int:
    """Print what is about to run; returns the tokens per optimizer step."""
    t, args, mesh = config.training, config.model, dims.mesh
    tokens_per_step = t.batch_size * t.seq_len * t.grad_accum * dims.dp_size
    log(f"world {dims.world_size} ({mesh.device_type}, {dist.get_backend()}), "
        f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}, {t.mixed_precision}, "
        f"activation checkpointing {'on' if t.activation_checkpoint else 'off'}")
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {args.n_layers} layers, "
        f"dim {args.dim}, {args.n_heads} heads ({args.kv_heads} kv), vocab {args.vocab_size}")
    n_files = len(corpus_files(config.data.path))
    log(f"data: {n_files} file{'s' * (n_files != 1)}, {corpus.numel():,} bytes from "
        f"{config.data.path or 'the Python standard library'}")
    log(f"tokens/step = {t.batch_size} batch x {t.seq_len} seq x {t.grad_accum} accum x {dims.dp_size} dp ranks "
        f"= {tokens_per_step:,}; chance loss ln(256) = {math.log(args.vocab_size):.3f}")
    return tokens_per_step


def train(config: JobConfig, dims: ParallelDims, device: torch.device) -> int:
    """Collective: build, (resume,) train, export, sample; returns the step it resumed from (0: a fresh run)."""
    t, ckpt = config.training, config.checkpoint
    torch.manual_seed(t.seed)
    dims.build_mesh(device.type)
    model = build_model(config, dims, device)
    optimizer = build_optimizer(model, t)
    scheduler = lr_schedule(optimizer, t)
    corpus = load_corpus(config.data.path)
    tokens_per_step = log_setup(config, dims, model, corpus)

    checkpointer = Checkpointer(ckpt.dir, keep=ckpt.keep) if ckpt.dir else None
    start = 0
    if checkpointer is not None and (found := checkpointer.latest()) is not None:
        start = checkpointer.load(found[1], model, optimizer, scheduler)
        log(f"resumed from {found[1]} at step {start}")

    progress = Progress(config, tokens_per_step, start, device)
    dp_rank = dims.dp_rank(dist.get_rank())
    for step in range(start + 1, t.steps + 1):
        loss, grad_norm, lr = train_step(model, optimizer, scheduler, corpus, step, dp_rank, t, device)
        progress.step_done()
        if step % config.metrics.log_every == 0 or step == start + 1 or step == t.steps:
            progress.log(step, loss, grad_norm, lr)
        if checkpointer is not None and (step == t.steps or (ckpt.every and step % ckpt.every == 0)):
            checkpointer.save(step, model, optimizer, scheduler)
    log(progress.summary())

    if ckpt.export:
        export_model(model, ckpt.export)
        log(f"exported the full model to {ckpt.export}")
    if config.metrics.sample_tokens:
        sample = generate(model, "def ", config.metrics.sample_tokens, device, seed=t.seed, multiple_of=dims.tp)
        log("sample (temperature 0.8):\n" + sample)
    if progress.writer is not None:
        png = plot_loss(progress.writer.path)
        log(f"metrics: {progress.writer.path}" + (f", loss curve: {png}" if png else
                                                  " (matplotlib not installed: no loss curve; pip install matplotlib)"))
    return start


@torch.no_grad()
def generate(model: Transformer, prompt: str, n_tokens: int, device: torch.device, *,
             temperature: float = 0.8, seed: int = 0, multiple_of: int = 1) -> str:
    """Sample a continuation of ``prompt``; collective (every rank runs the same forwards).

    ``multiple_of``: inputs are right-padded to a multiple of it (the TP degree: sequence
    parallelism needs even sequence shards). Attention is causal, so padding after the
    last real token never changes its logits.
    """
    tokenizer = ByteTokenizer()
    gen = torch.Generator().manual_seed(seed)  # the same draws on every rank
    tokens = torch.tensor([tokenizer.encode(prompt)], device=device)  # (1, seq)
    window = model.args.max_seq_len // multiple_of * multiple_of
    for _ in range(n_tokens):
        context = tokens[:, -window:]
        padded = F.pad(context, (0, -context.shape[1] % multiple_of))  # (1, seq rounded up)
        logits = model(padded)[0, context.shape[1] - 1].float().cpu()  # (vocab,)
        probs = torch.softmax(logits / temperature, dim=-1)
        next_token = torch.multinomial(probs, 1, generator=gen).to(device)
        tokens = torch.cat([tokens, next_token[None]], dim=1)
    return tokenizer.decode(tokens[0].tolist())


if __name__ == "__main__":
    main()
