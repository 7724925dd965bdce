"""Llama-3-style shapes for the planner, and a block with the recipe's ops.

The package does not import the recipes; this mirrors ``recipes/llama/model.py`` op for op
(RMSNorm, grouped-query attention with rotary embeddings in complex64, SwiGLU) so the
activations the planner measures are the recipe's. Built under fake tensors, nothing is
allocated; the planner builds one block and extrapolates to ``n_layers``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["LlamaShape", "CONFIGS", "LlamaModel", "llama_tp_plan"]


@dataclass(frozen=True)
class LlamaShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    max_seq_len: int = 8192

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads


# Meta's published Llama 3 / 3.1 dimensions.
CONFIGS = {
    "llama3_8b": LlamaShape(4096, 32, 32, 8, 14336, 128256),
    "llama3_70b": LlamaShape(8192, 80, 64, 8, 28672, 128256),
    "llama3_405b": LlamaShape(16384, 126, 128, 8, 53248, 128256),
}


def _rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # (batch, seq, heads, head_dim/2)
    return torch.view_as_real(pairs * rope[: x.shape[1], None, :]).flatten(-2).type_as(x)


class _Attention(nn.Module):
    def __init__(self, a: LlamaShape) -> None:
        super().__init__()
        self.head_dim, self.grouped = a.head_dim, a.n_kv_heads != a.n_heads
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (batch, seq, dim)
        q = _rope(self.wq(x).view(b, s, -1, self.head_dim), rope)  # (batch, seq, heads, head_dim)
        k = _rope(self.wk(x).view(b, s, -1, self.head_dim), rope)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.grouped)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class _FeedForward(nn.Module):
    def __init__(self, a: LlamaShape) -> None:
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_hidden, bias=False)
        self.w2 = nn.Linear(a.ffn_hidden, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self, a: LlamaShape) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(a.dim), nn.RMSNorm(a.dim)
        self.attention, self.feed_forward = _Attention(a), _FeedForward(a)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class LlamaModel(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab), with ``n_blocks`` of the blocks built."""

    def __init__(self, args: LlamaShape, n_blocks: int | None = None) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(_Block(args) for _ in range(n_blocks or args.n_layers))
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        angles = torch.zeros(args.max_seq_len, args.head_dim // 2)
        self.register_buffer("rope", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (batch, seq, dim)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def llama_tp_plan(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The recipe's tensor parallelism (``recipes/llama/parallelize.py::tp_plan``), for the planner.

    Megatron-style with sequence parallelism: wq/wk/wv and w1/w3 column-wise, wo/w2
    row-wise (their outputs reduce-scattered along the sequence), norms on sequence
    shards, the embedding row-wise and the output column-wise with replicated logits.
    ``tests/test_memory.py`` checks that it places every parameter as the recipe does.
    """
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
