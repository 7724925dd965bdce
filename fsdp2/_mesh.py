"""The data-parallel mesh: which axis shards, which replicates, and their groups.

A 1-D mesh shards over all its ranks (FSDP). A 2-D mesh is (replicate, shard)
(HSDP): parameters are sharded within each row of the mesh and replicated
across rows; gradients are reduce-scattered within a row, then all-reduced
across rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import Placement

__all__ = ["DataParallelMesh"]


@dataclass(frozen=True)
class DataParallelMesh:
    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int

    @classmethod
    def of(cls, mesh: DeviceMesh) -> DataParallelMesh:
        shard_axis = mesh.ndim - 1
        hsdp = mesh.ndim == 2
        return cls(
            mesh=mesh,
            shard_group=mesh.get_group(shard_axis),
            shard_size=mesh.size(shard_axis),
            shard_rank=mesh.get_local_rank(shard_axis),
            replicate_group=mesh.get_group(0) if hsdp else None,
            replicate_size=mesh.size(0) if hsdp else 1,
        )

    @property
    def world(self) -> int:
        """Ranks that gradients are averaged over."""
        return self.shard_size * self.replicate_size

    def placements(self, shard: Placement) -> tuple[Placement, ...]:
        return (Replicate(), shard) if self.replicate_group is not None else (shard,)

    def shard_blocks(self, size: int) -> list[list[int]]:
        """Global ranks in blocks of ``size`` consecutive ranks along the shard axis."""
        return self.mesh.mesh.reshape(-1, size).tolist()
