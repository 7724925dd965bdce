"""A small mixture-of-experts language model with expert parallelism, for the MoE tests.

Each block: a dense mixing layer, then a MoE layer: a router picks ``top_k`` experts per
token; the tokens are sorted by expert and, with expert parallelism, sent to the ranks of the
``ep`` axis that hold those experts by ``all_to_all_single`` (and their outputs sent back the
same way); the experts are one ``(experts, dim, hidden)`` parameter and one ``(experts,
hidden, dim)`` parameter, computed as a loop of per-expert matmuls; a shared expert (a plain
feed-forward) sees every token. ``expert_parallel`` makes the two expert parameters DTensors
``Shard(0)`` on the ``ep`` mesh, as torchtitan's expert-parallel plan does.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

VOCAB, DIM, HIDDEN, SEQ, BATCH = 16, 8, 16, 6, 2


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, dim, hidden) * 0.3)  # (experts, dim, hidden)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, dim) * 0.3)  # (experts, hidden, dim)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``tokens`` (rows, dim) sorted by expert, ``counts[e]`` rows for this rank's expert e."""
        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))  # this rank's experts
        outs = [F.silu(rows @ w1[e]) @ w2[e] for e, rows in enumerate(tokens.split(counts))]
        return torch.cat(outs)


class MoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(DIM, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, DIM, HIDDEN)
        self.shared = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, DIM))
        self.ep_mesh: DeviceMesh | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        tokens = x.reshape(-1, d)  # (tokens, dim)
        scores = self.router(tokens).softmax(dim=-1)  # (tokens, experts)
        top_scores, top_ids = scores.topk(self.top_k, dim=-1)  # (tokens, top_k)
        order = top_ids.reshape(-1).argsort(stable=True)  # assignments sorted by expert
        token_of = order // self.top_k
        counts = torch.bincount(top_ids.reshape(-1), minlength=self.experts.num_experts)  # (experts,)
        routed = self._experts(tokens[token_of], counts)  # (tokens * top_k, dim)
        weighted = routed * top_scores.reshape(-1)[order].unsqueeze(-1)
        combined = torch.zeros_like(tokens).index_add(0, token_of, weighted)
        return (combined + self.shared(tokens)).view(b, s, d)

    def _experts(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep_mesh is None:
            return self.experts(routed, counts.tolist())
        ep, group = self.ep_mesh.size(), self.ep_mesh.get_group()
        local = self.experts.num_experts // ep
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)  # (sources * local experts,)
        send = counts.view(ep, local).sum(1).tolist()
        recv = received_counts.view(ep, local).sum(1).tolist()
        received = dist_fn.all_to_all_single(routed.new_empty(sum(recv), routed.shape[1]), routed, recv, send,
                                             group=group)  # rows by source rank, then by expert
        expert_of = torch.arange(local).repeat(ep).repeat_interleave(received_counts)
        by_expert = expert_of.argsort(stable=True)
        out = self.experts(received[by_expert], received_counts.view(ep, local).sum(0).tolist())
        out = out[by_expert.argsort()]  # back in the order the rows came
        return dist_fn.all_to_all_single(routed.new_empty(routed.shape), out, send, recv, group=group)


class Block(nn.Module):
    def __init__(self, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.mix_norm, self.mix = nn.RMSNorm(DIM), nn.Linear(DIM, DIM)
        self.moe_norm, self.moe = nn.RMSNorm(DIM), MoE(num_experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.mix_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoEModel(nn.Module):
    def __init__(self, num_experts: int, *, top_k: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(num_experts, top_k) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def expert_parallel(model: MoEModel, ep_mesh: DeviceMesh) -> None:
    """The experts' parameters become ``Shard(0)`` on ``ep_mesh``: each ep rank keeps its experts."""
    for block in model.layers:
        block.moe.ep_mesh = ep_mesh
        experts = block.moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            setattr(experts, name, nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)])))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def loss_of(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).reshape(-1, VOCAB), targets.reshape(-1))


class _TitanNamed(MoEModel):
    """``MoEModel`` under torchtitan's ``Decoder`` names, for its ``apply_fsdp_to_decoder``."""

    enable_weight_tying = False

    @property
    def tok_embeddings(self) -> nn.Module:
        return self.embed

    @property
    def lm_head(self) -> nn.Module:
        return self.head


class _TitanLayers(nn.ModuleList):
    """torchtitan's decoder keeps its layers in a ``ModuleDict``: ``items()`` and ``values()``."""

    def items(self) -> list[tuple[str, nn.Module]]:
        return [(str(i), m) for i, m in enumerate(self)]

    def values(self) -> list[nn.Module]:
        return list(self)


def torchtitan_names(model: MoEModel) -> None:
    """Let torchtitan's ``apply_fsdp_to_decoder`` find what it looks for, the parameters and their
    names unchanged: ``tok_embeddings``, ``layers.items()``, ``norm``, ``lm_head``, and in each
    block ``moe_enabled`` and ``moe.routed_experts.inner_experts``."""
    model.__class__ = _TitanNamed
    model.layers.__class__ = _TitanLayers
    for block in model.layers:
        block.moe_enabled = True
        block.moe.routed_experts = types.SimpleNamespace(inner_experts=block.moe.experts)  # not a submodule
