"""``shard_placement_fn``: which dim of each parameter FSDP shards, and on which mesh.

The function may return ``None`` (``Shard(0)``), a ``Shard(dim)``, or, as torch 2.13's FSDP2
allows, a ``ShardPlacementResult``: a placement and a mesh (``mesh_info.mesh``, torch's
``FSDPMeshInfo`` for it) per parameter. Parameters are grouped by their mesh's (shard,
replicate) process groups, the key torch groups them by: one parameter group per mesh, in
the order each mesh's first parameter comes (torchtitan's MoE blocks: the dense parameters on
the data-parallel mesh, the experts on the ``efsdp`` one). A result on the call's own mesh is
that mesh's group.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from .._errors import FSDPTypeError, FSDPValueError

__all__ = ["Placements", "placement_dims"]


class Placements(NamedTuple):
    """Where each parameter of a ``fully_shard`` call is sharded."""

    dims: list[int]  # the tensor dim, per parameter
    groups: list[int]  # the index of its mesh in ``meshes``, per parameter
    meshes: list[DeviceMesh | None]  # one per parameter group, in torch's order; None: the call's mesh


def placement_dims(found: list, placement_fn: Callable | None, mesh: DeviceMesh) -> Placements:
    """Each of ``found``'s parameters' dim and mesh; ``mesh`` is the call's data-parallel mesh."""
    dims, groups = [], []
    keys: dict[tuple, int] = {}
    meshes: list[DeviceMesh | None] = []
    own_key = _groups(mesh, None)
    for param, _locations, fqn in found:
        placement = placement_fn(param) if placement_fn is not None else None
        key, own = own_key, None
        if _is_placement_result(placement):
            own = _result_mesh(placement, fqn)
            key = _groups(own, placement.mesh_info)
            if key != own_key:
                _check_axes(own, placement.mesh_info, fqn)
            placement = placement.placement
        if key not in keys:
            keys[key] = len(meshes)
            meshes.append(None if key == own_key else own)
        groups.append(keys[key])
        dims.append(_dim(param, placement, fqn))
    for param, _locations, fqn in found:
        if param.ndim == 0:
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is a scalar (0-dim) and cannot be sharded; "
                "reshape it to (1,) or pass it in ignored_params"
            )
    return Placements(dims, groups, meshes)


def _dim(param: Any, placement: Any, fqn: str) -> int:
    if placement is None:
        return 0
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
    return dim


def _is_placement_result(value: Any) -> bool:
    """torch's ``ShardPlacementResult`` (or an object shaped as it: fsdp2 imports nothing of torch's FSDP)."""
    return hasattr(value, "placement") and hasattr(value, "mesh_info") and not isinstance(value, Shard)


def _result_mesh(result: Any, fqn: str) -> DeviceMesh:
    info = result.mesh_info
    own = getattr(info, "mesh", None)
    if not isinstance(own, DeviceMesh):
        raise FSDPTypeError(
            f"fully_shard: shard_placement_fn returned a ShardPlacementResult for {fqn!r} whose mesh_info has no "
            f"DeviceMesh (got {type(info).__name__}); build it with torch's "
            "_get_mesh_info(mesh) or FSDPMeshInfo(mesh, shard_mesh_dim=0)"
        )
    return own


def _check_axes(own: DeviceMesh, info: Any, fqn: str) -> None:
    """Another mesh than the call's: its axes as fsdp2 reads a mesh, the last shards and a 2-D
    mesh's first replicates (what torch's ``_get_mesh_info(mesh)`` makes)."""
    shard_axis = getattr(info, "shard_mesh_dim", None)
    replicate_axis = getattr(info, "replicate_mesh_dim", None)
    expected = (own.ndim - 1, 0 if own.ndim == 2 else None)
    if own.ndim > 2 or (shard_axis is not None and (shard_axis, replicate_axis) != expected):
        raise FSDPValueError(
            f"fully_shard: shard_placement_fn puts {fqn!r} on {own} with shard axis {shard_axis} and replicate "
            f"axis {replicate_axis}; fsdp2 shards over a 1-D mesh or a 2-D (replicate, shard) one: pass "
            "_get_mesh_info(mesh) of such a mesh (e.g. mesh['efsdp'] or mesh['dp_replicate', 'efsdp'])"
        )
    if own.ndim == 2 and own.mesh_dim_names is None:
        raise FSDPValueError(
            f"fully_shard: shard_placement_fn puts {fqn!r} on a 2-D mesh without axis names; HSDP needs them "
            "(init_device_mesh(..., mesh_dim_names=('dp_replicate', 'efsdp')))"
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

