"""Mixture of experts in the recipe: checks, expert parallelism's meshes, the experts' FSDP, load balancing.

The model's MoE layer is ``fsdp2/models/moe.py`` (torchtitan's design). Expert parallelism
(``parallelism.ep``) borrows its ranks from ``dp_shard``, as torchtitan's ``ParallelDims``:
the shard axis is split into ``efsdp x ep`` (``efsdp = dp_shard / ep``), each ep rank keeps
``moe_experts / ep`` experts, and FSDP shards those over ``efsdp`` (x ``dp_replicate`` for
HSDP), in a ``fully_shard`` call of the experts' own. Everything else (attention, router,
shared expert, embeddings) is sharded over the whole ``dp_shard`` axis as in a dense model.

Gradients: an expert's gradient on one rank already sums the contributions of the tokens the
ep ranks sent it (the all-to-all's backward), so FSDP's sum over ``efsdp`` (and the replicas)
covers every data-parallel rank's tokens once; the experts divide it by the data-parallel size
(``set_gradient_divide_factor``, torchtitan's ``gradient_divide_factor``), not by their own
group's size, so they get the same mean gradient as the dense parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp2.models.moe import ExpertParallelMeshes, enable_expert_parallel, moe_layers, update_expert_bias
from fsdp2.models.moe import shard_experts as fsdp_experts

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import JobConfig

__all__ = ["check_moe", "expert_meshes", "apply_expert_parallel", "shard_experts", "register_load_balancing",
           "active_params"]


class ExpertDims(Protocol):
    """What this file reads of the job's degrees and meshes (``parallelize.ParallelDims``, which
    sits above this file: it calls these functions)."""

    dp_shard: int
    ep: int
    pp: int
    ep_meshes: ExpertParallelMeshes | None  # with ep > 1

    @property
    def dp_size(self) -> int: ...
    def dp_mesh(self) -> DeviceMesh: ...


def check_moe(dims: ExpertDims, config: JobConfig) -> None:
    """Raise ConfigError for an MoE or expert-parallel setting that cannot run; before any process group."""
    m, ep = config.model, dims.ep
    if ep > 1 and not m.moe_experts:
        raise ConfigError(f"parallelism.ep={ep} shards experts, and this model has none (model.moe_experts=0): "
                          "set model.moe_experts (e.g. --config recipes/configs/tiny_moe.toml) or parallelism.ep=1")
    if not m.moe_experts:
        return
    if m.moe_experts % ep:
        raise ConfigError(f"model.moe_experts ({m.moe_experts}) must be divisible by parallelism.ep ({ep}): each ep "
                          "rank holds moe_experts / ep experts; change one of them")
    if dims.dp_shard % ep:
        raise ConfigError(f"parallelism.ep ({ep}) must divide parallelism.dp_shard ({dims.dp_shard}): expert "
                          "parallelism splits the shard axis into dp_shard / ep x ep ranks; change ep or dp_shard")
    if dims.pp > 1:
        raise ConfigError(f"parallelism.pp={dims.pp} with model.moe_experts > 0 is not supported by the recipe yet "
                          "(its pipeline stages are split from the dense Llama): use parallelism.pp=1 with FSDP, "
                          "HSDP and expert parallelism, or pipeline a dense model")
    if config.training.compile:
        raise ConfigError("training.compile is not supported with model.moe_experts > 0: the routing's token "
                          "counts are data-dependent (a graph break in every block); set training.compile=false")


def expert_meshes(dims: ExpertDims) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(the experts' FSDP mesh, the ep mesh or None): (dp_replicate,) efsdp with EP, else the dense one."""
    if dims.ep == 1:
        return dims.dp_mesh(), None
    return dims.ep_meshes.experts, dims.ep_meshes.ep


def apply_expert_parallel(model: nn.Module, dims: ExpertDims) -> None:
    """Each ep rank keeps its ``experts / ep`` experts (``Shard(0)`` on the ep axis); a no-op at ep 1."""
    if dims.ep > 1:
        enable_expert_parallel(model, expert_meshes(dims)[1])


def shard_experts(model: nn.Module, dims: ExpertDims, options: dict[str, Any]) -> None:
    """``fully_shard`` each MoE layer's experts on their own mesh, before their block's call
    (``fsdp2.models.moe.shard_experts``: the planner shards them alike)."""
    mesh, _ = expert_meshes(dims)
    fsdp_experts(model, mesh, ep=dims.ep, dp_size=dims.dp_size, **options)


def register_load_balancing(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Before each optimizer step, move the routing biases toward the less-used experts (summed over all ranks).

    A skipped step (non-finite gradients) takes no optimizer step: its counts join the next one's.
    """
    if any(m.load_balance_coeff > 0 for m in moe_layers(model)):
        optimizer.register_step_pre_hook(lambda *_args: update_expert_bias(model, dist.group.WORLD))


def active_params(model: nn.Module, n_params: int) -> int:
    """Parameters one token goes through: ``n_params`` less the experts it is not routed to."""
    inactive = 0
    for moe in moe_layers(model):
        per_expert = sum(p.numel() for p in moe.experts.parameters()) // moe.num_experts
        inactive += per_expert * (moe.num_experts - moe.top_k)
    return n_params - inactive
