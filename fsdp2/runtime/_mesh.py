"""The data-parallel mesh: which axis shards, which replicates, and their groups.

A 1-D mesh shards over all its ranks (FSDP). A 2-D mesh is (replicate, shard)
(HSDP): parameters are sharded within each row of the mesh and replicated
across rows; gradients are reduce-scattered within a row, then all-reduced
across rows.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import Placement

from .. import _compat
from .._errors import FSDPValueError

__all__ = ["DataParallelMesh", "SpmdAxes", "SubGroup", "check_mesh_device", "resolve_mesh", "resolve_spmd_mesh",
           "tp_mesh_of"]


@dataclass(frozen=True)
class SpmdAxes:
    """``fully_shard(dp_mesh_dims=...)``: parameters live on this whole mesh; which axes are data-parallel.

    The sharded DTensor stays on ``mesh``: the shard axis's ``Replicate()`` becomes the FSDP
    shard, every other axis keeps its placement. Several shard axes are one flattened shard
    axis (as several replicate axes are one replicate axis): the sharded DTensor is then on
    ``sharded_mesh``, ``mesh`` with the data-parallel axes replaced, where the first shard
    axis was, by the data-parallel mesh's (replicate, shard) axes, as torch's FSDP2 lays it.
    """

    mesh: DeviceMesh
    shard_axes: tuple[int, ...]
    replicate_axes: tuple[int, ...] = ()
    sharded_mesh: DeviceMesh | None = None  # None: one shard axis, the shards stay on ``mesh``

    @property
    def shard_axis(self) -> int:
        """Where FSDP's shard placement goes in ``mesh``'s placements (the first shard axis)."""
        return self.shard_axes[0]

    @property
    def dp_axes(self) -> frozenset[int]:
        return frozenset(self.shard_axes + self.replicate_axes)

    def sharded_layout(self, mesh: DeviceMesh,
                       placements: tuple[Placement, ...]) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """The sharded DTensor's mesh and placements, from its placements on ``mesh`` (the
        parameter's, equal to ``self.mesh``; FSDP's shard on ``shard_axis``, ``Replicate()`` on
        the other data-parallel axes)."""
        if self.sharded_mesh is None:
            return mesh, placements
        out: list[Placement] = []
        for axis, placement in enumerate(placements):
            if axis == self.shard_axis:
                out.extend((Replicate(), placement) if self.replicate_axes else (placement,))
            elif axis not in self.dp_axes:
                out.append(placement)
        return self.sharded_mesh, tuple(out)


@dataclass(frozen=True)
class DataParallelMesh:
    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    spmd: SpmdAxes | None = None  # dp_mesh_dims: the full mesh the parameters live on
    # tp_mesh's answers by the parameter mesh's id (the mesh kept with it, so the id stays its)
    _tp: dict[int, tuple[DeviceMesh, DeviceMesh | None]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, mesh: DeviceMesh, spmd: SpmdAxes | None = None) -> DataParallelMesh:
        shard_axis = mesh.ndim - 1
        hsdp = mesh.ndim == 2
        return cls(
            mesh=mesh,
            shard_group=mesh.get_group(shard_axis),
            shard_size=mesh.size(shard_axis),
            shard_rank=mesh.get_local_rank(shard_axis),
            replicate_group=mesh.get_group(0) if hsdp else None,
            replicate_size=mesh.size(0) if hsdp else 1,
            spmd=spmd,
        )

    @property
    def world(self) -> int:
        """Ranks that gradients are averaged over."""
        return self.shard_size * self.replicate_size

    def tp_mesh(self, param_mesh: DeviceMesh) -> DeviceMesh | None:
        """``tp_mesh_of(param_mesh, self.mesh)``, worked out once per parameter mesh (a model's
        parameters share a few)."""
        known = self._tp.get(id(param_mesh))
        if known is None:
            known = self._tp[id(param_mesh)] = (param_mesh, tp_mesh_of(param_mesh, self.mesh))
        return known[1]

    def placements(self, shard: Placement) -> tuple[Placement, ...]:
        return (Replicate(), shard) if self.replicate_group is not None else (shard,)

    def shard_blocks(self, size: int) -> list[list[int]]:
        """Global ranks in blocks of ``size`` consecutive ranks along the shard axis."""
        return self.mesh.mesh.reshape(-1, size).tolist()


class SubGroup:
    """The smaller process group an int ``reshard_after_forward`` reshards to.

    One per (shard process group, size): every ``fully_shard(..., reshard_after_forward=k)``
    on the same mesh shares it, so a model of many blocks makes one process group (one NCCL
    communicator) for ``k``, not one per block.
    """

    # The shard group -> {(size, blocks): the subgroup}; dropped with the group (a new
    # world after destroy_process_group gets new subgroups).
    _cache: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, dist.ProcessGroup]] = \
        weakref.WeakKeyDictionary()

    def __init__(self, dp: DataParallelMesh, size: int) -> None:
        blocks = dp.shard_blocks(size)
        cached = SubGroup._cache.setdefault(dp.shard_group, {})
        key = (size, tuple(map(tuple, blocks)))
        if key not in cached:
            # Every rank creates every group, in the same order: every rank misses the cache
            # at the same fully_shard call, since the key is the same on every rank.
            cached[key], _ = dist.new_subgroups_by_enumeration(blocks)
        self.group = cached[key]
        self.size = size
        self.rank = dp.shard_rank % size


def tp_mesh_of(param_mesh: DeviceMesh, dp_mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh a tensor- or expert-parallel parameter's axes join ``dp_mesh``'s on; None if
    they cannot be joined.

    First by value among the axes of ``dp_mesh``'s root mesh: DTensor's sharding caches may
    hand back a DTensor on an equal mesh of another root (an earlier ``init_device_mesh`` with
    the same ranks and names), which cannot be joined with the data-parallel axes; the root's
    own axes can. Else the parameter's mesh itself, where it is derived from the same world
    mesh as ``dp_mesh`` and orthogonal to it (its own named axes): meshes that ``DeviceMesh._unflatten``,
    slicing and ``_flatten`` derive from one world mesh (torchtitan's ``ParallelDims`` builds
    its ``ep`` and ``efsdp`` meshes so), whose root is that 1-D world mesh and names none of
    their axes. The join is what torch's FSDP2 builds for them too (``_compat.concat_meshes``).
    """
    names = param_mesh.mesh_dim_names or ()
    dp_names = set(dp_mesh.mesh_dim_names or ())
    if not names or set(names) & dp_names:
        return None
    root = _compat.root_mesh(dp_mesh)
    if set(names) <= set(root.mesh_dim_names or ()):
        axes = root[names[0]] if len(names) == 1 else root[tuple(names)]
        if axes == param_mesh:
            return axes
    return param_mesh if _compat.joinable_meshes(dp_mesh, param_mesh) else None


# ---- fully_shard's mesh argument -------------------------------------------------------
def resolve_mesh(mesh: Any) -> DeviceMesh:
    if mesh is None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "fully_shard(mesh=None) needs torch.distributed to be initialized: call "
                "dist.init_process_group(...) first (torchrun sets up the environment), or pass a mesh"
            )
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() != "gloo" else "cpu"
        return init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard: mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; "
            "build one with init_device_mesh('cpu' or 'cuda', (world_size,))"
        )
    check_mesh_device(mesh)
    if mesh.ndim > 2:
        raise ValueError(
            f"fully_shard: mesh has {mesh.ndim} dims; use a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh "
            "(HSDP), e.g. mesh['dp'] to take the data-parallel axes of a larger mesh"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise FSDPValueError(
            "fully_shard: a 2-D mesh means HSDP (replicate, shard) and needs axis names; build it with "
            "init_device_mesh(device, (replicas, shards), mesh_dim_names=('dp_replicate', 'dp_shard'))"
        )
    return mesh


def check_mesh_device(mesh: DeviceMesh) -> None:
    if mesh.device_type == "meta":
        raise ValueError(
            "fully_shard: the mesh is on the meta device, where no collective can run (the parameters' shards "
            "live on the mesh's device); build the mesh on the device that runs the model (init_device_mesh('cuda', "
            "...) or 'cpu') and the model on meta instead: with torch.device('meta'): model = Model(), then "
            "fully_shard, then model.to_empty(device=...) and initialise the weights"
        )


def resolve_spmd_mesh(mesh: Any, dims: Any) -> tuple[DeviceMesh, SpmdAxes]:
    """``dp_mesh_dims``: check it against the full ``mesh``; the data-parallel mesh (1-D, or
    (replicate, shard) for HSDP; several axes of a kind flattened into one) and where its axes
    sit in the full mesh."""
    if not hasattr(dims, "shard_names") or not hasattr(dims, "replicate_names"):
        raise TypeError(f"fully_shard: dp_mesh_dims must be a DataParallelMeshDims, got {type(dims).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError("fully_shard: dp_mesh_dims needs mesh= the whole SPMD DeviceMesh the parameters live on, "
                        f"got {type(mesh).__name__}")
    check_mesh_device(mesh)
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("fully_shard: dp_mesh_dims names mesh axes, but the mesh has no axis names; build it "
                         "with init_device_mesh(..., mesh_dim_names=('dp', 'tp'))")
    shard, replicate = tuple(dims.shard_names), tuple(dims.replicate_names)
    for name in shard + replicate:
        if name not in names:
            raise ValueError(f"fully_shard: dp_mesh_dims names axis {name!r}, which the mesh {names} does not have")
    if not shard:
        raise ValueError("fully_shard: dp_mesh_dims without a shard axis (replication only) is plain data "
                         "parallelism; use DistributedDataParallel, or name a shard axis")
    both = set(shard) & set(replicate)
    if both or len(set(shard)) < len(shard) or len(set(replicate)) < len(replicate):
        twice = sorted(both) or sorted({n for n in shard + replicate if (shard + replicate).count(n) > 1})
        raise ValueError(f"fully_shard: dp_mesh_dims uses axis {twice[0]!r} twice (to both shard and replicate, "
                         "or twice in one); name each data-parallel axis once")
    shard_axes = tuple(names.index(n) for n in shard)
    replicate_axes = tuple(names.index(n) for n in replicate)
    for kind, axes in (("shard", shard_axes), ("replicate", replicate_axes)):
        if list(axes) != sorted(axes) or (kind == "shard" and axes[-1] - axes[0] != len(axes) - 1):
            raise ValueError(
                f"fully_shard: dp_mesh_dims' {kind} axes {tuple(names[i] for i in axes)} must be named in the "
                f"mesh's order{' and be adjacent in it' if kind == 'shard' else ''} (the mesh is {names}): "
                "they are flattened into one axis, as torch's fully_shard does"
            )
    # Several axes of a kind are one flattened axis (one process group); HSDP is (replicate, shard).
    dp_mesh = _compat.flattened(mesh, shard)
    if replicate:
        dp_mesh = _compat.concat_meshes([_compat.flattened(mesh, replicate), dp_mesh])
    sharded_mesh = None
    if len(shard) > 1:  # the shards' own mesh: the data-parallel axes where the first shard axis was
        parts = [dp_mesh if axis == shard_axes[0] else mesh[name] for axis, name in enumerate(names)
                 if axis == shard_axes[0] or axis not in shard_axes + replicate_axes]
        sharded_mesh = _compat.concat_meshes(parts)
    return dp_mesh, SpmdAxes(mesh, shard_axes, replicate_axes, sharded_mesh)
