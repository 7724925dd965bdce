"""What a run trains: the model (built on meta, sharded, then allocated), AdamW and its schedule.

Each takes what it reads (the job's config, the degrees, a ``TrainingConfig``), not more.
"""

from __future__ import annotations

import math

import torch

from .config import JobConfig, TrainingConfig
from .llama.model import Transformer
from .llama.parallelize import ParallelDims, parallelize


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
