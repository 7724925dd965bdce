"""Train a tiny causal transformer with FSDP2 on a synthetic copy task.

    torchrun --nproc-per-node 2 examples/train_tiny.py [--steps 100] [--impl fsdp2|torch]

Each sequence is ``k`` random tokens followed by the same ``k`` tokens again; the loss on
the second half can only fall if attention learns to look back and copy, so a falling
loss shows gradients flow through the sharded model. Runs on gloo/CPU (NCCL if CUDA).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=-1)
        # (batch, heads, seq, head_dim)
        q, k, v = (t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, max_seq: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(max_seq, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: (batch, seq) -> logits: (batch, seq, vocab)
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def copy_batch(gen: torch.Generator, batch: int, half: int, vocab: int, device: torch.device):
    """(inputs, targets) where targets are -100 except over the copied second half."""
    first = torch.randint(0, vocab, (batch, half), generator=gen)
    seq = torch.cat([first, first], dim=1).to(device)  # (batch, 2 * half)
    inputs, targets = seq[:, :-1], seq[:, 1:].clone()
    targets[:, : half - 1] = -100  # the first half is random: nothing to learn there
    return inputs, targets


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--impl", choices=["fsdp2", "torch"], default="fsdp2",
                   help="fsdp2: this library; torch: torch.distributed.fsdp.fully_shard")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--half", type=int, default=12, help="length of the random prefix")
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.impl == "fsdp2":
        from fsdp2 import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))

    torch.manual_seed(0)  # same initial weights on every rank
    model = TinyTransformer(args.vocab, args.dim, args.layers, args.heads, 2 * args.half).to(device)
    mp_policy = MixedPrecisionPolicy()  # fp32 throughout; set param_dtype=torch.bfloat16 on GPU
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)  # the root: embeddings, norm, head
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1234 + rank)  # different data on every rank

    tokens_per_step = args.batch * (2 * args.half - 1) * world
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"impl={args.impl} world={world} device={device.type} params={n_params:,} "
              f"tokens/step={tokens_per_step} (chance loss {math.log(args.vocab):.3f})")
    start = window_start = time.perf_counter()
    first_loss = last_loss = float("nan")
    last_logged = 0
    for step in range(1, args.steps + 1):
        inputs, targets = copy_batch(gen, args.batch, args.half, args.vocab, device)
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == 1 or step == args.steps:
            avg = loss.detach().clone()
            dist.all_reduce(avg, op=dist.ReduceOp.AVG)
            last_loss = avg.item()
            first_loss = last_loss if step == 1 else first_loss
            now = time.perf_counter()
            if rank == 0:
                rate = tokens_per_step * (step - last_logged) / (now - window_start)
                print(f"step {step:4d}  loss {last_loss:.4f}  tokens/s {rate:,.0f}")
            window_start, last_logged = now, step
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"done: {args.steps} steps in {elapsed:.1f} s, loss {first_loss:.4f} -> "
              f"{last_loss:.4f}, {tokens_per_step * args.steps / elapsed:,.0f} tokens/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
