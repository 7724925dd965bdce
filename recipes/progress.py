"""What a run prints and records: the setup lines, a line and a metrics row per logged step, the summary.

``log_setup`` prints the mesh, the model, the data and the tokens per step; ``Progress`` averages
the loss over the ranks and writes the line, the JSON-lines row and the TensorBoard events
(tokens/s over the last window, TFLOPS per rank from ``model_flops_per_token``).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .config import JobConfig
from .data import describe_data
from .launch import log
from .llama.model import Transformer
from .llama.moe import active_params
from .llama.parallelize import ParallelDims
from .metrics import MetricsWriter, TensorBoardWriter, flops_per_token, format_duration, gather_memory_mb
from .pipeline import full_parameter_count, pipeline_layout
from .pipeline import describe as describe_pipeline
from .step import StepResult


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
        row = {"step": step, "loss": self.losses[-1], "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": tokens_per_s, "tokens": self.tokens_per_step * step,
                  "elapsed_s": now - self.loop_start, "eta_s": eta, "memory_mb": memory,
                  "skipped": result.skipped, "skipped_steps": skipped_total, **self.throughput(tokens_per_s),
                  **({"val_loss": val_loss} if val_loss is not None else {})}
        if record:
            for writer in (self.writer, self.tensorboard):
                if writer is not None:
                    writer.write(row)
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
