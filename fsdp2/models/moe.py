"""Mixture-of-experts feed-forward for the recipe's Llama, with expert parallelism (torchtitan's design).

``MoE`` replaces a block's SwiGLU when ``ModelArgs.moe_experts > 0``:

- a token-choice top-k router (``router``: a linear gate computed in fp32, sigmoid or softmax
  scores; the top ``moe_top_k`` experts per token; the chosen experts' scores weight their outputs),
- routed experts as one ``(experts, dim, hidden)`` parameter per SwiGLU matrix (``GroupedExperts``),
- an optional shared expert every token goes through (a plain SwiGLU),
- torchtitan's default load balancing: no auxiliary loss, a per-expert bias added to the scores
  for the choice only (``expert_bias``, a persistent buffer), moved after each optimizer step
  toward the experts that got fewer tokens (``update_expert_bias``, arXiv 2408.15664).

Expert parallelism (``enable_expert_parallel``): the expert parameters become ``Shard(0)``
DTensors on the ``ep`` mesh axis, each ep rank keeping ``experts / ep`` of them; each rank
sends its routed rows to the ranks holding their experts with ``all_to_all_single`` and gets
the outputs back the same way. Every rank routes its own tokens with the same weights, so
the routing, and the math, do not depend on the ep degree.

On the meta device (the memory planner) the routing has no data: every expert is assumed to
get ``tokens x top_k / experts`` rows and every ep rank to receive as many rows as it sends
(balanced routing, which the load balancing aims at).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

__all__ = ["MoE", "GroupedExperts", "ExpertParallelMeshes", "expert_parallel_meshes", "enable_expert_parallel",
           "shard_experts", "update_expert_bias", "moe_layers"]


class GroupedExperts(nn.Module):
    """``experts`` SwiGLUs stacked: w1, w3 ``(experts, dim, hidden)``, w2 ``(experts, hidden, dim)``."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` (n, dim) sorted by expert, ``counts[e]`` of them for this rank's e-th expert -> (n, dim)."""
        # Under EP the parameters are DTensors on the ep axis; the rows are this rank's, plain.
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        outs = [(F.silu(x @ w1[e]) * (x @ w3[e])) @ w2[e] for e, x in enumerate(rows.split(counts))]
        return torch.cat(outs) if outs else rows.new_empty(0, rows.shape[1])


class SwiGLU(nn.Module):
    """The shared expert: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """(batch, seq, dim) -> (batch, seq, dim): routed experts plus the shared one."""

    def __init__(self, *, dim: int, hidden: int, num_experts: int, top_k: int, shared_hidden: int,
                 score_func: str, load_balance_coeff: float) -> None:
        super().__init__()
        self.top_k, self.score_func, self.load_balance_coeff = top_k, score_func, load_balance_coeff
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, hidden)
        self.shared_expert = SwiGLU(dim, shared_hidden) if shared_hidden else None
        self.ep_group: dist.ProcessGroup | None = None  # set by enable_expert_parallel
        self.ep = 1
        # The bias steers the choice only (not the weights); persistent: a resumed run routes alike.
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)
        # Tokens each expert got since the last optimizer step (this rank's); not checkpointed.
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)  # (n, dim)
        top_scores, top_ids = self.route(tokens)  # (n, top_k) each
        counts = self._counts(top_ids)  # (experts,)
        if self.training and torch.is_grad_enabled() and not tokens.is_meta:
            with torch.no_grad():  # (validation and sampling run without grad: not counted)
                self.tokens_per_expert.add_(counts)
        order = top_ids.reshape(-1).argsort(stable=True)  # the (token, choice) pairs by expert
        token_of = order // self.top_k
        out = self._experts(tokens[token_of], counts)  # (n * top_k, dim)
        weighted = out * top_scores.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        combined = torch.zeros_like(tokens).index_add(0, token_of, weighted)
        if self.shared_expert is not None:
            combined = combined + self.shared_expert(tokens)
        return combined.view(batch, seq, dim)

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, expert ids) of each token's top-k experts; the gate in fp32 (stable routing)."""
        logits = F.linear(tokens.float(), self.router.weight.float())  # (n, experts)
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.expert_bias if self.load_balance_coeff > 0 else scores
        top_ids = choice.topk(self.top_k, dim=-1).indices
        return scores.gather(-1, top_ids), top_ids

    def _counts(self, top_ids: torch.Tensor) -> torch.Tensor:
        if top_ids.is_meta:  # the planner: no data, balanced routing
            return torch.empty(self.num_experts, dtype=torch.long, device="meta")
        return torch.bincount(top_ids.reshape(-1), minlength=self.num_experts)

    def _balanced(self, rows: int) -> list[int]:
        base, extra = divmod(rows, self.num_experts)
        return [base + (e < extra) for e in range(self.num_experts)]

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        sizes = self._balanced(rows.shape[0]) if rows.is_meta else counts.tolist()
        if self.ep_group is None:
            return self.experts(rows, sizes)
        ep, local = self.ep, self.num_experts // self.ep
        if rows.is_meta:  # balanced: each ep rank receives as many rows of each expert as it sends
            received_counts = sizes[:local] * ep
        else:
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.ep_group)  # (sources x local experts,)
            received_counts = received.tolist()
        send = [sum(sizes[r * local:(r + 1) * local]) for r in range(ep)]
        recv = [sum(received_counts[r * local:(r + 1) * local]) for r in range(ep)]
        # Rows arrive by source rank, then by expert: sort them by expert for the matmuls.
        inbound = _AllToAll.apply(rows, recv, send, self.ep_group)
        expert_of = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
            torch.tensor(received_counts, device=rows.device), output_size=sum(recv))
        by_expert = expert_of.argsort(stable=True)
        per_expert = [sum(received_counts[r * local + e] for r in range(ep)) for e in range(local)]
        out = self.experts(inbound[by_expert], per_expert)
        out = torch.empty_like(out).index_copy(0, by_expert, out)  # back in the order the rows came
        return _AllToAll.apply(out, send, recv, self.ep_group)

    @torch.no_grad()
    def init_weights(self, normal_: Callable[[torch.Tensor, float], None], std: float, out_std: float) -> None:
        """Normal(0, std) for the router and the input matrices, ``out_std`` for those writing to the residual."""
        for param in (self.router.weight, self.experts.w1, self.experts.w3):
            normal_(param, std)
        normal_(self.experts.w2, out_std)
        if self.shared_expert is not None:
            normal_(self.shared_expert.w1.weight, std)
            normal_(self.shared_expert.w3.weight, std)
            normal_(self.shared_expert.w2.weight, out_std)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows, differentiable: the gradient goes back by the reverse exchange."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty(sum(out_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        grad_rows = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(grad_rows, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_rows, None, None, None


class ExpertParallelMeshes(NamedTuple):
    """The meshes of expert parallelism, all of one world mesh (so fsdp2 can join them)."""

    world: DeviceMesh  # (dp_replicate,) efsdp, ep (, tp): axes of size 1 left out but efsdp and ep
    dp: DeviceMesh  # the dense parts' data-parallel mesh: (dp_replicate,) dp_shard = efsdp x ep, flattened
    experts: DeviceMesh  # the experts' FSDP mesh: (dp_replicate,) efsdp
    ep: DeviceMesh  # the ranks the experts are divided among


def expert_parallel_meshes(device_type: str, *, dp_replicate: int, dp_shard: int, ep: int,
                           tp: int = 1) -> ExpertParallelMeshes:
    """torchtitan's layout: the shard axis split into efsdp x ep, ep innermost (the ranks that trade
    tokens are the closest), flattened back into ``dp_shard`` for the dense parts."""
    from .. import _compat

    sizes = {"dp_replicate": dp_replicate, "efsdp": dp_shard // ep, "ep": ep, "tp": tp}
    names = [n for n, size in sizes.items() if n in ("efsdp", "ep") or size > 1]
    world = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=tuple(names))
    shard = world["efsdp", "ep"]._flatten("dp_shard")
    if dp_replicate == 1:
        return ExpertParallelMeshes(world, shard, world["efsdp"], world["ep"])
    # Joined, not sliced from the world mesh by the flattened name (torch warns that goes away).
    dp = _compat.concat_meshes([world["dp_replicate"], shard])
    return ExpertParallelMeshes(world, dp, world["dp_replicate", "efsdp"], world["ep"])


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every MoE layer of ``model``, in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def enable_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Expert parallelism over the 1-D ``ep_mesh``: each rank keeps ``experts / ep`` experts (``Shard(0)``).

    Call it before ``fully_shard``, on the meta device or on materialized parameters.
    """
    ep = ep_mesh.size()
    for moe in moe_layers(model):
        if moe.num_experts % ep:
            raise ValueError(f"model.moe_experts ({moe.num_experts}) must be divisible by parallelism.ep ({ep})")
        moe.ep, moe.ep_group = ep, ep_mesh.get_group()
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            setattr(experts, name, nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)],
                                                                  src_data_rank=None)))


def shard_experts(model: nn.Module, mesh: DeviceMesh, *, ep: int, dp_size: int, **options: Any) -> None:
    """``fully_shard`` every MoE layer's experts on ``mesh`` (the efsdp mesh, with HSDP's replicas),
    in a call of their own, before their block's (the recipe's and the planner's layout).

    Along the expert dim (0) when there are at least as many experts as ``efsdp x ep`` shards,
    else along the hidden dim (1), as torchtitan (no padded, empty expert shards). Their gradients
    are divided by ``dp_size``, all the data-parallel ranks: each expert's gradient on a rank
    already sums what the ep ranks' tokens contributed (the all-to-all's backward), so the sum
    over the experts' own group covers every rank's tokens once (torchtitan's
    ``gradient_divide_factor``). ``options``: ``fully_shard``'s other keywords.
    """
    from .. import fully_shard  # (fsdp2's API imports nothing of the models: no cycle at import)

    shards = mesh.size(mesh.ndim - 1) * ep
    for moe in moe_layers(model):
        placement = Shard(1) if shards > moe.num_experts else Shard(0)
        fully_shard(moe.experts, mesh=mesh, shard_placement_fn=lambda _p, s=placement: s, **options)
        moe.experts.set_gradient_divide_factor(float(dp_size))


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Move each MoE layer's ``expert_bias`` by ``load_balance_coeff`` toward its less-used experts.

    Collective over ``group`` (the ranks that see different tokens): the counts since the
    last call are summed over it first, so every rank moves its bias alike. Call it before each
    optimizer step (``optimizer.register_step_pre_hook``), as torchtitan does.
    """
    layers = [m for m in moe_layers(model) if m.load_balance_coeff > 0]
    if not layers:
        return
    counts = torch.stack([m.tokens_per_expert for m in layers])  # (layers, experts)
    if dist.is_initialized():
        dist.all_reduce(counts, group=group)
    for moe, used in zip(layers, counts):
        delta = moe.load_balance_coeff * torch.sign(used.mean() - used)
        moe.expert_bias.add_(delta - delta.mean())
        moe.tokens_per_expert.zero_()


def moe_hidden(dim: int, hidden: int, top_k: int, multiple_of: int) -> int:
    """An expert's SwiGLU width: ``hidden`` when given, else the dense width over ``top_k`` (the same
    active parameters per token as the dense model), rounded up to ``multiple_of``."""
    if hidden:
        return hidden
    dense = int(2 * 4 * dim / 3)
    return multiple_of * math.ceil(dense / top_k / multiple_of)
