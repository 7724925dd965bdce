"""``shard_placement_fn``: which dim of each parameter FSDP shards, and on which mesh.

The function may return ``None`` (``Shard(0)``), a ``Shard(dim)``, or, as torch 2.13's FSDP2
allows, a ``ShardPlacementResult``: a placement and a mesh (``mesh_info.mesh``, torch's
``FSDPMeshInfo`` for it) per parameter. fsdp2 shards one data-parallel mesh per
``fully_shard`` call: a result on the call's own mesh is taken as its placement; one on
another mesh is refused (before any change) with the layout that runs it, the parameters of
that mesh sharded by a ``fully_shard`` call of their own.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from .._errors import FSDPTypeError, FSDPValueError

__all__ = ["placement_dims"]


def placement_dims(found: list, placement_fn: Callable | None, mesh: DeviceMesh) -> list[int]:
    """The dim each of ``found``'s parameters is sharded on; ``mesh`` is the call's data-parallel mesh."""
    dims = []
    for param, _locations, fqn in found:
        placement = placement_fn(param) if placement_fn is not None else None
        if _is_placement_result(placement):
            _check_result_mesh(placement, fqn, mesh)
            placement = placement.placement
        if placement is None:
            dims.append(0)
            continue
        if not isinstance(placement, Shard):
            raise FSDPTypeError(
                f"fully_shard: shard_placement_fn returned {placement!r} for {fqn!r}; return Shard(dim), None or "
                "a ShardPlacementResult(placement=Shard(dim) or None, mesh_info=...)"
            )
        dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
        if param.ndim == 0 or not 0 <= dim < param.ndim:
            raise FSDPValueError(
                f"fully_shard: shard_placement_fn chose Shard({placement.dim}) for {fqn!r} of shape "
                f"{tuple(param.shape)}; pick a dim in [0, {param.ndim})"
            )
        dims.append(dim)
    for (param, _locations, fqn), _dim in zip(found, dims):
        if param.ndim == 0:
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is a scalar (0-dim) and cannot be sharded; "
                "reshape it to (1,) or pass it in ignored_params"
            )
    return dims


def _is_placement_result(value: Any) -> bool:
    """torch's ``ShardPlacementResult`` (or an object shaped as it: fsdp2 imports nothing of torch's FSDP)."""
    return hasattr(value, "placement") and hasattr(value, "mesh_info") and not isinstance(value, Shard)


def _check_result_mesh(result: Any, fqn: str, mesh: DeviceMesh) -> None:
    """The result's mesh must be the call's: the same shard (and replicate) process groups, the
    key torch's FSDP2 groups parameters by."""
    own = getattr(result.mesh_info, "mesh", None)
    if not isinstance(own, DeviceMesh):
        raise FSDPTypeError(
            f"fully_shard: shard_placement_fn returned a ShardPlacementResult for {fqn!r} whose mesh_info has no "
            f"DeviceMesh (got {type(result.mesh_info).__name__}); build it with torch's "
            "_get_mesh_info(mesh) or FSDPMeshInfo(mesh, shard_mesh_dim=0)"
        )
    if _groups(own, result.mesh_info) == _groups(mesh, None):
        return
    raise FSDPValueError(
        f"fully_shard: shard_placement_fn puts {fqn!r} on {own}, another data-parallel mesh than this call's "
        f"({mesh}); fsdp2 shards one mesh per fully_shard call (torch's FSDP2 makes one parameter group per "
        "mesh). Shard the module that holds those parameters in a fully_shard call of its own first, e.g. "
        "fully_shard(block.moe.experts, mesh=edp_mesh, shard_placement_fn=lambda p: Shard(1)) and then "
        "fully_shard(block, mesh=dp_mesh): the same shards, collectives and numerics per parameter"
    )


def _groups(mesh: DeviceMesh, info: Any) -> tuple:
    """(shard process group, replicate process group or None) of a data-parallel mesh; ``info``'s
    axes where it names them (torch's ``FSDPMeshInfo``), else fsdp2's: the last axis shards, a
    2-D mesh's first replicates."""
    shard_axis = getattr(info, "shard_mesh_dim", None)
    replicate_axis = getattr(info, "replicate_mesh_dim", None)
    if shard_axis is None:
        shard_axis = mesh.ndim - 1
    if info is None and mesh.ndim == 2:
        replicate_axis = 0
    replicate = mesh.get_group(replicate_axis) if replicate_axis is not None else None
    return mesh.get_group(shard_axis), replicate


def check_placement_fn(placement_fn: Any) -> None:
    if placement_fn is not None and not callable(placement_fn):
        raise TypeError("fully_shard: shard_placement_fn must be callable (param -> Shard(dim), None or a "
                        "ShardPlacementResult)")

