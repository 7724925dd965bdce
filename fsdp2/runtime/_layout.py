"""How one tensor is cut into padded chunks, one per rank (the data layout of docs/design.md)."""

from __future__ import annotations

import math

from .._format import chunk_rows
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["ShardLayout", "contiguous_stride"]


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True)
class ShardLayout:
    """How a tensor of ``shape`` is cut into ``world`` padded chunks along ``dim``."""

    shape: torch.Size
    dim: int
    world: int
    chunk: int

    @classmethod
    def even(cls, shape: torch.Size, dim: int, world: int) -> ShardLayout:
        return cls(shape, dim, world, chunk_rows(shape[dim], world))

    def with_world(self, world: int) -> ShardLayout:
        """The same padded tensor cut into ``world`` chunks (``world`` divides ours)."""
        return ShardLayout(self.shape, self.dim, world, self.chunk * self.world // world)

    # Read for every parameter at every all-gather and reduce-scatter: computed once.
    @cached_property
    def padded_shape(self) -> torch.Size:
        return self._resize_dim(self.chunk * self.world)

    @cached_property
    def local_shape(self) -> torch.Size:
        return self._resize_dim(self.chunk)

    @cached_property
    def local_stride(self) -> tuple[int, ...]:
        """The contiguous stride of ``local_shape``."""
        return contiguous_stride(self.local_shape)

    @cached_property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    def rows(self, rank: int) -> int:
        """How many true (unpadded) rows along ``dim`` rank ``rank`` owns."""
        return max(0, min(self.chunk, self.shape[self.dim] - rank * self.chunk))

    def chunks_view(self, padded_full: torch.Tensor) -> torch.Tensor:
        """View a padded full tensor as ``(world, *local_shape)``, chunk ``r`` at index ``r``."""
        if padded_full.is_contiguous():  # the usual case, in one op (this runs per parameter per step)
            size, stride = self._chunks_spec
            return padded_full.as_strided(size, stride, padded_full.storage_offset())
        return padded_full.unflatten(self.dim, (self.world, self.chunk)).movedim(self.dim, 0)

    @cached_property
    def _chunks_spec(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Size and stride of ``chunks_view`` of a contiguous padded full tensor."""
        stride = contiguous_stride(self.padded_shape)
        return (self.world, *self.local_shape), (self.chunk * stride[self.dim], *stride)

    def _resize_dim(self, size: int) -> torch.Size:
        shape = list(self.shape)
        shape[self.dim] = size
        return torch.Size(shape)
