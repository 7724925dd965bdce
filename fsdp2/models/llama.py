"""A Llama-style decoder, its tensor-parallel plan, and Meta's Llama 3 shapes.

RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention. This one model serves
the Llama recipe (``recipes/llama`` imports it) and the memory planner (``estimate_memory``'s
default model, ``python -m fsdp2.plan``), so the activations the planner measures are the
recipe's. The module names follow Meta's Llama and torchtitan (``tok_embeddings``,
``layers``, ``attention.wq``, ``feed_forward.w1``, ...), so ``tp_plan`` reads like theirs.

Built for meta-device construction: ``Transformer(args)`` under ``torch.device("meta")``
allocates nothing; after sharding and ``to_empty()``, :meth:`Transformer.init_weights`
fills every parameter. The initial values depend only on the seed and each parameter's
name, never on how the model is sharded, so 1 rank and 8 ranks start from the same model.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from .moe import MoE, moe_hidden

__all__ = ["ModelArgs", "Transformer", "Block", "Attention", "FeedForward", "precompute_rope", "apply_rope",
           "tp_plan", "check_tp", "LLAMA3"]


@dataclass
class ModelArgs:
    """Shape of the model. Defaults are a small byte-level model; configs override them."""

    dim: int = 128  # width of the residual stream (heads x head_dim)
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # query heads per attention layer
    n_kv_heads: int | None = None  # None: as many as n_heads (multi-head); fewer: grouped-query
    vocab_size: int = 256  # rows of the embedding table and the output layer (256: bytes)
    multiple_of: int = 32  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None  # scales the SwiGLU hidden size (8/3 x dim) before rounding
    ffn_hidden_size: int | None = None  # the SwiGLU hidden size exactly (Hugging Face's intermediate_size);
    # None: derived from dim, ffn_dim_multiplier and multiple_of
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    rope_theta: float = 10000.0  # base of the rotary embeddings' frequencies
    rope_scaling_factor: float = 1.0  # Llama 3.1's rotary scaling (Hugging Face rope_type "llama3"): frequencies
    # whose wavelength exceeds rope_original_max_seq_len / rope_low_freq_factor are divided by this, those
    # shorter than rope_original_max_seq_len / rope_high_freq_factor kept, those between blended; 1: no scaling
    rope_low_freq_factor: float = 1.0  # (with rope_scaling_factor) see above
    rope_high_freq_factor: float = 4.0  # (with rope_scaling_factor) see above
    rope_original_max_seq_len: int = 8192  # (with rope_scaling_factor) the context the model was first trained at
    max_seq_len: int = 256  # length of the rotary table; sequences may be shorter
    tie_embeddings: bool = False  # the output projection reuses tok_embeddings.weight
    init_std: float = 0.02  # standard deviation of the initial weights
    moe_experts: int = 0  # routed experts per block (mixture of experts, fsdp2/models/moe.py); 0: dense SwiGLU
    moe_top_k: int = 2  # experts each token is routed to
    moe_hidden: int = 0  # an expert's SwiGLU width; 0: the dense width / moe_top_k, rounded up to multiple_of
    moe_shared_experts: int = 0  # shared experts every token also goes through (one SwiGLU of this many
    # times moe_hidden); 0: none
    moe_score_func: Literal["sigmoid", "softmax"] = "sigmoid"  # the router's scores (torchtitan's default: sigmoid)
    moe_load_balance_coeff: float = 1e-3  # each optimizer step moves a per-expert routing bias by this
    # much toward the less-used experts (auxiliary-loss-free balancing, as torchtitan); 0: no balancing

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"model.dim / model.n_heads = {self.head_dim} must be even: rotary embeddings "
                "rotate pairs of channels"
            )
        self._check_rope_scaling()
        self._check_moe()
        kv = self.kv_heads
        if not isinstance(kv, int) or kv < 1 or self.n_heads % kv:
            raise ValueError(
                f"model.n_kv_heads ({self.n_kv_heads}) must be a positive divisor of "
                f"model.n_heads ({self.n_heads})"
            )

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling_factor < 1.0:
            raise ValueError(f"model.rope_scaling_factor must be >= 1 (1: no scaling), "
                             f"got {self.rope_scaling_factor!r}")
        if self.rope_scaling_factor > 1.0 and not (0 < self.rope_low_freq_factor < self.rope_high_freq_factor
                                                   and self.rope_original_max_seq_len > 0):
            raise ValueError(f"model.rope_low_freq_factor ({self.rope_low_freq_factor}) must be > 0 and below "
                             f"model.rope_high_freq_factor ({self.rope_high_freq_factor}), and "
                             f"model.rope_original_max_seq_len > 0 ({self.rope_original_max_seq_len})")

    def _check_moe(self) -> None:
        if self.ffn_hidden_size is not None and (not isinstance(self.ffn_hidden_size, int)
                                                 or isinstance(self.ffn_hidden_size, bool) or self.ffn_hidden_size < 1):
            raise ValueError(f"model.ffn_hidden_size must be a positive int or None, got {self.ffn_hidden_size!r}")
        for name in ("moe_experts", "moe_hidden", "moe_shared_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"model.{name} must be an int >= 0, got {value!r}")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"model.moe_top_k ({self.moe_top_k}) must be between 1 and model.moe_experts "
                             f"({self.moe_experts})")
        if self.moe_load_balance_coeff < 0:
            raise ValueError(f"model.moe_load_balance_coeff must be >= 0 (0: no balancing), "
                             f"got {self.moe_load_balance_coeff!r}")
        if self.moe_score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"model.moe_score_func must be sigmoid or softmax, got {self.moe_score_func!r}")

    @property
    def expert_hidden(self) -> int:
        """An expert's SwiGLU width (``moe_hidden``, or the dense width / ``moe_top_k`` rounded up)."""
        return moe_hidden(self.dim, self.moe_hidden, self.moe_top_k, self.multiple_of)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden(self) -> int:
        """Llama's SwiGLU width: ``ffn_hidden_size`` when set, else 2/3 of 4 * dim (same parameter
        count as a 4x GELU MLP), scaled by ``ffn_dim_multiplier`` and rounded up to ``multiple_of``."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


# Meta's published Llama 3 / 3.1 shapes (their params.json); the SwiGLU widths this gives are
# 14336, 28672 and 53248. The rotary table covers Llama 3's 8,192 positions.
LLAMA3 = {
    "llama3_8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                           ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192),
    "llama3_70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
                            ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192),
    "llama3_405b": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                             multiple_of=4096, ffn_dim_multiplier=1.2, rope_theta=500000.0, max_seq_len=8192),
}


# ---- rotary position embeddings -----------------------------------------------------------
def precompute_rope(head_dim: int, max_seq_len: int, theta: float, *, scaling: ModelArgs | None = None
                    ) -> torch.Tensor:
    """Rotations e^(i * pos * theta^(-2k / head_dim)) as complex64, shape (max_seq_len, head_dim // 2).

    Complex (not float) on purpose: mixed precision casts floating-point inputs of
    sharded modules to bf16, which would round these angles; complex tensors are left alone.
    ``scaling``: the model's shape, whose ``rope_scaling_factor`` (when above 1) stretches the
    long wavelengths as Llama 3.1 does (:func:`scale_frequencies`).
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is not None and scaling.rope_scaling_factor > 1.0:
        freqs = scale_frequencies(freqs, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def scale_frequencies(freqs: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Llama 3.1's frequency scaling: a rotation slower than the original context (wavelength
    2 pi / freq above ``rope_original_max_seq_len / rope_low_freq_factor``) is slowed by
    ``rope_scaling_factor``; one faster than ``rope_original_max_seq_len / rope_high_freq_factor``
    is kept; in between, the two are mixed in proportion to how many times the wavelength fits
    in the original context."""
    factor, low, high = args.rope_scaling_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    context = args.rope_original_max_seq_len
    wavelength = 2 * math.pi / freqs
    fits = context / wavelength  # how many wavelengths the original context holds
    keep = ((fits - low) / (high - low)).clamp(0.0, 1.0)  # 1: short wavelengths, 0: long ones
    return keep * freqs + (1.0 - keep) * freqs / factor


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2k, 2k+1) of ``x`` (batch, seq, heads, head_dim) by position."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # (batch, seq, heads, head_dim/2)
    rotated = pairs * rope[: x.shape[1], None, :]  # rope: (seq, 1, head_dim/2) broadcasts over heads
    return torch.view_as_real(rotated).flatten(-2).type_as(x)  # (batch, seq, heads, head_dim)


# ---- blocks -------------------------------------------------------------------------------
class Attention(nn.Module):
    """Causal grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.grouped = args.kv_heads != args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape  # (batch, seq, dim)
        # -1 heads, not n_heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)  # (batch, seq, heads, head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)  # (batch, seq, kv_heads, head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)  # (batch, seq, kv_heads, head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.grouped)
        out = out.transpose(1, 2).reshape(batch, seq, -1)  # (batch, seq, heads * head_dim)
        return self.wo(out)  # (batch, seq, dim)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, seq, dim) -> (batch, seq, ffn_hidden) -> (batch, seq, dim)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + feed_forward(norm(x))."""

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # A mixture of experts in place of the SwiGLU when the model has experts (same name: same hooks).
        self.feed_forward = MoE(dim=args.dim, hidden=args.expert_hidden, num_experts=args.moe_experts,
                                top_k=args.moe_top_k, shared_hidden=args.moe_shared_experts * args.expert_hidden,
                                score_func=args.moe_score_func, load_balance_coeff=args.moe_load_balance_coeff,
                                ) if args.moe_experts else FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)  # (batch, seq, dim)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """tokens (batch, seq) int64 -> logits (batch, seq, vocab_size)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(i, args) for i in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: derived from args, recomputed by init_weights, never checkpointed.
        self.register_buffer(
            "rope", precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta, scaling=args), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds model.max_seq_len={self.args.max_seq_len}"
            )
        h = self.tok_embeddings(tokens)  # (batch, seq, dim)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))  # (batch, seq, vocab)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Fill every parameter and buffer; call after ``to_empty()`` when built on ``meta``.

        Normal(0, init_std) for embeddings and input projections; the projections that write
        into the residual stream (``wo``, ``w2``) are scaled down by sqrt(2 * (layer + 1)) so
        deep stacks start near the identity; norms start at one. Each parameter is drawn
        from its own generator seeded by (seed, name), so the result is the same for any
        sharding, parameter order, or wrapper (activation checkpointing, compile).
        """
        init = _SeededInit(self, seed)
        std = self.args.init_std
        # A pipeline stage's model has some of the parts (None) and its blocks in a ModuleDict
        # named by their index in the whole model (recipes/pipeline.py).
        if self.tok_embeddings is not None:
            init.normal_(self.tok_embeddings.weight, std)
        for layer in self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers:
            block = _unwrap(layer)
            out_std = std / math.sqrt(2 * (block.layer_id + 1))
            for linear in (block.attention.wq, block.attention.wk, block.attention.wv):
                init.normal_(linear.weight, std)
            init.normal_(block.attention.wo.weight, out_std)
            if isinstance(block.feed_forward, MoE):
                block.feed_forward.init_weights(init.normal_, std, out_std)
            else:
                init.normal_(block.feed_forward.w1.weight, std)
                init.normal_(block.feed_forward.w3.weight, std)
                init.normal_(block.feed_forward.w2.weight, out_std)
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()
        if not self.args.tie_embeddings and self.output is not None:
            init.normal_(self.output.weight, std / math.sqrt(self.args.dim))  # logits start near 0
        self.rope.copy_(precompute_rope(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta,
                                        scaling=self.args))


# ---- tensor parallelism -------------------------------------------------------------------
def check_tp(args: ModelArgs, tp: int) -> None:
    """Raise ValueError if a model of shape ``args`` cannot be split ``tp`` ways by :func:`tp_plan`."""
    if args.moe_experts and tp > 1:
        raise ValueError(
            "tensor parallelism is not supported with model.moe_experts > 0 yet (its plan covers dense blocks; "
            "the router and shared expert would need their gradients summed over tp): use parallelism.tp=1 "
            "with FSDP, HSDP (parallelism.dp_replicate) and expert parallelism (parallelism.ep)"
        )
    if args.n_heads % tp or args.kv_heads % tp:
        raise ValueError(
            f"tensor parallelism splits heads: model.n_heads ({args.n_heads}) and model.n_kv_heads "
            f"({args.kv_heads}) must both be divisible by tp ({tp})"
        )
    if args.tie_embeddings:
        raise ValueError(
            "model.tie_embeddings is not supported with tensor parallelism: the embedding is split "
            "row-wise and the output projection column-wise, so one weight cannot serve both"
        )


def tp_plan(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism with sequence parallelism, as in torchtitan.

    Inside a block, wq/wk/wv and w1/w3 are split by output features (column-wise: each
    rank computes n_heads / tp heads and ffn_hidden / tp channels) and wo/w2 by input
    features (row-wise: partial sums, reduce-scattered along the sequence). Between
    blocks, activations stay sharded along the sequence (dim 1), so the norms and the
    residual adds run on seq / tp tokens per rank; each attention and feed-forward
    all-gathers its input sequence first.
    """
    check_tp(model.args, tp_mesh.size())
    parallelize_module(model, tp_mesh, {
        # tokens are replicated; the embedding's output leaves sequence-sharded.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # gather the sequence, compute a vocab slice per rank, gather the logits.
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            # (x, rope): gather x's sequence; rope is a plain replicated tensor.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
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


# ---- deterministic, sharding-independent init ----------------------------------------------
# Wrappers that parallelize() may put around a block add these names to parameter paths.
_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")


def _unwrap(module: nn.Module) -> nn.Module:
    for name in _WRAPPER_NAMES:
        module = getattr(module, name, module)
    return module


class _SeededInit:
    """Draws each parameter's full value from a generator seeded by (seed, parameter name).

    DTensor's own random ops are sharding-independent only on GPU meshes (on CPU every
    shard would draw the same numbers), so the full tensor is drawn here and each rank
    keeps its own slice. That materialises one full parameter at a time, never the model.
    """

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.seed = seed
        self.names = {
            id(p): ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)
            for name, p in model.named_parameters()
        }

    def normal_(self, param: torch.Tensor, std: float) -> None:
        digest = hashlib.blake2b(f"{self.seed}/{self.names[id(param)]}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        full = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank slices its own shard locally, no communication.
            full = distribute_tensor(full.to(param.device), param.device_mesh, param.placements,
                                     src_data_rank=None)
        param.copy_(full)
