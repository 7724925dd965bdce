"""Tiny models and data shared by the tests; independent of fsdp2."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int | None = None) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden or 4 * dim)
        self.out_proj = nn.Linear(hidden or 4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.relu(self.in_proj(x)))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=-1)
        # (batch, heads, seq, head_dim)
        q, k, v = (t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Token embedding + learned positions, ``n_layers`` blocks, final norm, output head."""

    def __init__(self, vocab: int = 64, dim: int = 32, n_layers: int = 3, n_heads: int = 4,
                 seq: int = 16, seed: int | None = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            self.tok_emb = nn.Embedding(vocab, dim)
            self.pos_emb = nn.Embedding(seq, dim)
            self.layers = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
            self.norm = nn.LayerNorm(dim)
            self.output = nn.Linear(dim, vocab, bias=False)
        self.vocab, self.seq = vocab, seq

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: (batch, seq) -> logits: (batch, seq, vocab)
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def make_batch(rank: int, step: int, *, batch: int = 2, seq: int = 16, vocab: int = 64,
               device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (inputs, targets) token batch, different for each (rank, step)."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train(model: nn.Module, steps: int, *, lr: float = 1e-2) -> list[torch.Tensor]:
    """``steps`` AdamW steps of ``model`` on this rank's ``make_batch`` batches; the losses."""
    return _steps(model, torch.optim.AdamW(model.parameters(), lr=lr), range(steps))


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, *, vocab: int = 64,
                seq: int = 16, data_rank: int | None = None) -> list[float]:
    """One step of ``opt`` per step in ``steps``, on the ``make_batch`` batch of that step for
    ``data_rank`` (default: this rank; the ranks of one tensor-parallel group share one); the losses."""
    return [loss.item() for loss in _steps(model, opt, steps, vocab=vocab, seq=seq, data_rank=data_rank)]


def _steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, *, vocab: int = 64, seq: int = 16,
           data_rank: int | None = None) -> list[torch.Tensor]:
    rank = dist.get_rank() if data_rank is None else data_rank
    losses = []
    for step in steps:
        tokens, targets = make_batch(rank, step, vocab=vocab, seq=seq)
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses
