"""Gradient clipping across parameters that live on different meshes.

With FSDP x TP, parameters TP left alone are DTensors on the data-parallel
mesh while TP weights live on the (dp, tp) mesh. ``torch.nn.utils.clip_grad_norm_``
stacks per-tensor norms and fails on mixed meshes; here each mesh's norm is
computed separately, made a plain tensor, and combined. Under pipeline
parallelism each rank holds only its stages' parameters: ``pp_mesh`` adds
the other stages' norms, so every rank clips by the whole model's norm.
"""

from __future__ import annotations

from typing import Iterable

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import _compat

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clip gradients by their total norm, like ``torch.nn.utils.clip_grad_norm_``.

    Gradients are grouped by (mesh, placements); each group's norm is taken
    with ``torch.nn.utils.get_total_norm`` (DTensor reduces it over its mesh),
    the group norms are combined into the total, and every gradient is scaled
    by ``max_norm / total`` when that is below 1. The norm of gradients sharded
    over several mesh axes (FSDP x TP) is reduced by one all-reduce over them
    together, not one per axis: the first call gives those axes a flattened
    process group (``_compat.flatten_axes``), as DTensor's warning asks.

    Args:
        pp_mesh: the pipeline-parallel axis (a 1-D mesh) when each rank holds only some
            pipeline stages' parameters: the stages' norms are combined over it (one
            all-reduce), as torchtitan's ``clip_grad_norm_(..., pp_mesh=...)`` does. Every
            rank of it must call this, also one without gradients.

    Returns:
        The total norm as a plain tensor, the same on every rank.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        if grad is not None:
            key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else grad.device
            groups.setdefault(key, []).append(p)
    if not groups and pp_mesh is None:
        return torch.tensor(0.0)
    norms = []
    for key, members in groups.items():
        if isinstance(key, tuple):  # a DTensor's norm is partial over the axes its gradient is sharded on
            sharded = [i for i, p in enumerate(key[1]) if not p.is_replicate()]  # Shard, _StridedShard
            # Equal meshes can be distinct objects; a flattened mesh is recorded on each one's root.
            roots = {id(_compat.root_mesh(p.grad.device_mesh)): p.grad.device_mesh for p in members}
            for mesh in roots.values():
                _compat.flatten_axes(mesh, sharded)
        norm = torch.nn.utils.get_total_norm([p.grad for p in members], norm_type, error_if_nonfinite, foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device if norms else torch.device(pp_mesh.device_type)
    total = (torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type, error_if_nonfinite, foreach)
             if norms else torch.zeros((), device=device))
    if pp_mesh is not None:
        total = _across_stages(total, float(norm_type), pp_mesh)
    for members in groups.values():  # one mesh at a time: foreach ops cannot mix meshes
        torch.nn.utils.clip_grads_with_norm_(members, max_norm, total, foreach)
    return total


def _across_stages(norm: torch.Tensor, norm_type: float, pp_mesh: DeviceMesh) -> torch.Tensor:
    """The norm of the stages' norms: the max for the inf-norm, else (sum of norm^p)^(1/p)."""
    group = pp_mesh.get_group()
    if math.isinf(norm_type):
        norm = norm.clone()
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.double() ** norm_type  # (in fp64: the p-th powers of small norms underflow less)
    dist.all_reduce(powered, group=group)
    return (powered ** (1.0 / norm_type)).to(norm.dtype)
