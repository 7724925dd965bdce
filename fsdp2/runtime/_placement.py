"""``shard_placement_fn``: which dim of each parameter FSDP shards, and on which mesh.

The function may return ``None`` (``Shard(0)``), a ``Shard(dim)``, or, as torch 2.13's FSDP2
allows, a ``ShardPlacementResult``: a placement and a mesh (``mesh_info.mesh``, torch's
``FSDPMeshInfo`` for it) per parameter. Parameters are grouped by their mesh's (shard,
replicate) process groups, the key torch groups them by: one parameter group per mesh, in
the order each mesh's first parameter comes (torchtitan's MoE blocks: the dense parameters on
the data-parallel mesh, the experts on the ``efsdp`` one). A result on the call's own mesh is
that mesh's group.

A result's ``mesh_info`` that names ``dp_mesh_dims`` (torch's ``_get_mesh_info(spmd_mesh,
dims)``) puts its parameters on that SPMD mesh, sharded over its own data-parallel axes (their
names need not be the call's); one that does not is a plain data-parallel mesh, whose parameters
are plain tensors or TP/EP DTensors, as in a call without ``dp_mesh_dims``. Each group is one or
the other, whatever the call is, as torch's fully_shard decides per ``mesh_info``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from .._errors import FSDPTypeError, FSDPValueError
from ._mesh import SpmdAxes, resolve_spmd_mesh

__all__ = ["Placements", "placement_dims"]


class Placements(NamedTuple):
    """Where each parameter of a ``fully_shard`` call is sharded."""

    dims: list[int]  # the tensor dim, per parameter
    groups: list[int]  # the index of its mesh in ``meshes``, per parameter
    meshes: list[DeviceMesh | None]  # one per parameter group, in torch's order; None: the call's mesh
    # Per group: the SPMD mesh and axes it shards over (dp_mesh_dims), None for a data-parallel mesh.
    spmds: list[SpmdAxes | None]


def placement_dims(found: list, placement_fn: Callable | None, mesh: DeviceMesh,
                   spmd: SpmdAxes | None = None) -> Placements:
    """Each of ``found``'s parameters' dim and mesh; ``mesh`` is the call's data-parallel mesh,
    ``spmd`` its SPMD axes (``dp_mesh_dims``) if it has them."""
    dims, groups = [], []
    keys: dict[tuple, int] = {}
    meshes: list[DeviceMesh | None] = []
    spmds: list[SpmdAxes | None] = []
    resolved: dict[int, tuple] = {}  # by mesh_info: its meshes, worked out once (a model shares a few)
    own_key = _groups(mesh, None)
    for param, _locations, fqn in found:
        placement = placement_fn(param) if placement_fn is not None else None
        key, own, axes = own_key, None, spmd
        if _is_placement_result(placement):
            if id(placement.mesh_info) not in resolved:
                resolved[id(placement.mesh_info)] = (placement.mesh_info, *_result_mesh(placement, param, fqn))
            _info, own, axes = resolved[id(placement.mesh_info)]
            # An SPMD mesh_info's data-parallel mesh is resolved as dp_mesh_dims are: fsdp2's layout.
            key = _groups(own, placement.mesh_info if axes is None else None)
            if key != own_key and axes is None:
                _check_axes(own, placement.mesh_info, fqn)
            placement = placement.placement
        if key not in keys:
            keys[key] = len(meshes)
            meshes.append(None if key == own_key else own)
            spmds.append(axes)
        elif spmds[keys[key]] != axes:
            _refuse_mixed(fqn, spmds[keys[key]], axes)
        groups.append(keys[key])
        dims.append(_dim(param, placement, fqn))
    for param, _locations, fqn in found:
        if param.ndim == 0:
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is a scalar (0-dim) and cannot be sharded; "
                "reshape it to (1,) or pass it in ignored_params"
            )
    return Placements(dims, groups, meshes, spmds)


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


def _result_mesh(result: Any, param: Any, fqn: str) -> tuple[DeviceMesh, SpmdAxes | None]:
    """A result's data-parallel mesh, and its SPMD axes where its ``mesh_info`` names ``dp_mesh_dims``
    (on its ``spmd_mesh``; where that is None, as torch, on the mesh of the parameter that brings it)."""
    info = result.mesh_info
    dims = getattr(info, "dp_mesh_dims", None)
    if dims is not None:
        full = getattr(info, "spmd_mesh", None)
        if full is None and isinstance(getattr(param, "device_mesh", None), DeviceMesh):
            full = param.device_mesh
        if not isinstance(full, DeviceMesh):
            raise FSDPValueError(
                f"fully_shard: shard_placement_fn returned a ShardPlacementResult for {fqn!r} whose mesh_info names "
                "dp_mesh_dims, so the parameter must be a DTensor on that whole SPMD mesh, and it is a plain tensor; "
                "distribute it on that mesh first, or return a mesh_info without dp_mesh_dims for it"
            )
        return resolve_spmd_mesh(full, dims)
    own = getattr(info, "mesh", None)
    if not isinstance(own, DeviceMesh):
        raise FSDPTypeError(
            f"fully_shard: shard_placement_fn returned a ShardPlacementResult for {fqn!r} whose mesh_info has no "
            f"DeviceMesh (got {type(info).__name__}); build it with torch's "
            "_get_mesh_info(mesh) or FSDPMeshInfo(mesh, shard_mesh_dim=0)"
        )
    return own, None


def _refuse_mixed(fqn: str, first: SpmdAxes | None, then: SpmdAxes | None) -> None:
    """Parameters on the same process groups, one part on an SPMD mesh and one not (or on two
    SPMD meshes): torch refuses two mesh_infos on the same process groups, fsdp2 the ambiguity."""
    def kind(axes: SpmdAxes | None) -> str:
        return f"the SPMD mesh {axes.mesh}" if axes is not None else "a plain data-parallel mesh (no dp_mesh_dims)"
    raise FSDPValueError(
        f"fully_shard: shard_placement_fn puts {fqn!r} on {kind(then)}, and earlier parameters on {kind(first)}, "
        "over the same process groups; one parameter group cannot be both: return the same mesh_info for "
        "all of them (for the call's own mesh, return Shard(dim) or None rather than a ShardPlacementResult)"
    )


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

