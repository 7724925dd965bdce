"""The byte layout every layer agrees on, each rule written once.

The runtime lays parameters out in these shapes, the transports move them, the memory
planner counts them and the diagnostics read them back: they all import the rules from here.

* ``ALIGN``: each region of a packed buffer (the unsharded buffer, an all-gather slice, a
  reduce-scatter buffer) starts on a 16-byte boundary, a multiple of every dtype's itemsize;
  ``aligned(n)`` is ``n`` rounded up to it.
* ``HEADER``: the bytes at the start of each rank's all-gather slice (the rank checks' header,
  ``runtime/_checks.py``); a multiple of ``ALIGN``, so the slots after it stay aligned. A
  header is four native-endian int32s, the first a magic number: ``ALL_GATHER_MAGIC``
  (``[magic, iteration, group index, phase]``) or, for the exchange's reduce-scatters,
  ``REDUCE_MAGIC`` (``[magic, group index, number of parameters, their fingerprint]``).
* ``chunk_rows(n, world)``: cutting ``n`` rows over ``world`` ranks gives each rank
  ``ceil(n / world)`` rows, the last ranks fewer or none (``torch.chunk``'s rule, DTensor's
  ``Shard``); shards are padded to that many rows.
* ``Chunking``: how one tensor is cut into those padded chunks, one per rank (the data layout
  of docs/design.md).
* ``GatherFormat``: the byte layout of one group's all-gather slice (header, then each entry
  at its aligned offset) and its views; ``packed_offsets``: where entries start when packed.
  Quantized (``QuantizedComm(weights="int8")``, ``block > 0``): each floating-point entry is
  its int8 values (one byte per element of the padded chunk, flattened) then, at the next
  aligned offset, one fp32 scale per ``block`` elements (the last block may be short); other
  entries as unquantized. ``quantized_views`` reads them. ``bits=4`` (``weights="int4"``):
  the values are packed two per byte (``value_bytes``; low nibble first, ``comm/_quantize.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

__all__ = ["ALIGN", "ALL_GATHER_MAGIC", "HEADER", "REDUCE_MAGIC", "SCALE_DTYPE", "Chunking", "GatherFormat", "aligned",
           "blocks", "chunk_rows", "contiguous_stride", "packed_offsets", "segment_layout"]

ALIGN = 16
HEADER = 16
ALL_GATHER_MAGIC = 0x46534432  # "FSD2": a header written this iteration, not stale bytes
REDUCE_MAGIC = 0x46534452  # "FSDR": a reduce-scatter's header


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def chunk_rows(n: int, world: int) -> int:
    """Rows per rank when ``n`` rows are cut over ``world`` ranks: ``ceil(n / world)``."""
    return -(-n // world)


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True)
class Chunking:
    """How a tensor of ``shape`` is cut into ``world`` padded chunks along ``dim``."""

    shape: torch.Size
    dim: int
    world: int
    chunk: int

    @classmethod
    def even(cls, shape: torch.Size, dim: int, world: int) -> Chunking:
        return cls(shape, dim, world, chunk_rows(shape[dim], world))

    def with_world(self, world: int) -> Chunking:
        """The same padded tensor cut into ``world`` chunks (``world`` divides ours)."""
        return Chunking(self.shape, self.dim, world, self.chunk * self.world // world)

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

    @cached_property
    def data_ranks(self) -> int:
        """How many ranks, from rank 0, own true rows (``rows(r) > 0`` exactly for ``r`` below it):
        the others' chunks are padding only (a tensor of fewer rows than ranks)."""
        return -(-self.shape[self.dim] // self.chunk) if self.chunk else 0

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


SCALE_DTYPE = torch.float32  # of a quantized all-gather's per-block scales


def blocks(numel: int, block: int) -> int:
    """How many blocks of ``block`` elements cover ``numel`` (the last one may be short)."""
    return -(-numel // block)


def _typed_rows(buffer: torch.Tensor, dtype: torch.dtype, slice_bytes: int, ranks: int, shape: Sequence[int],
                stride: Sequence[int], offset: int) -> torch.Tensor:
    """``(ranks, *shape)`` of ``dtype`` starting ``offset`` bytes into each of ``ranks`` slices of ``buffer``."""
    base = buffer.view(dtype)
    return base.as_strided((ranks, *shape), (slice_bytes // dtype.itemsize, *stride),
                           base.storage_offset() + offset // dtype.itemsize)


def value_bytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` quantized values of ``bits`` each (8: one a byte; 4: two a byte), unaligned."""
    return numel if bits == 8 else -(-numel // 2)


def packed_offsets(sizes: Sequence[int], align: bool) -> tuple[list[int], int]:
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += aligned(size) if align else size
    return offsets, total


def segment_layout(sizes: Sequence[int], bounds: Sequence[int]) -> tuple[list[int], list[int]]:
    """Tensors of ``sizes`` bytes laid out in segments (tensors ``bounds[k]:bounds[k + 1]`` in
    segment ``k``), each 16-byte aligned: each tensor's offset in its segment, and each
    segment's size (at least ``ALIGN``)."""
    starts, totals = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        total = 0
        for size in sizes[lo:hi]:
            starts.append(total)
            total += aligned(size)
        totals.append(max(total, ALIGN))
    return starts, totals


@dataclass(frozen=True)
class GatherFormat:
    """Byte layout of one all-gather of a group over ``world`` ranks."""

    layouts: tuple[Chunking, ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]  # of each parameter inside a rank's slice, after the header
    slice_bytes: int
    block: int = 0
    """Quantized: elements per fp32 scale of the floating-point entries; 0: every entry in its dtype."""
    scale_offsets: tuple[int, ...] = ()
    """Quantized: where each entry's scales start in a rank's slice (-1: an entry sent unquantized)."""
    bits: int = 8
    """Quantized: bits per value, 8 (int8) or 4 (two int4 a byte, ``value_bytes``)."""

    @classmethod
    def build(cls, layouts: Sequence[Chunking], dtypes: Sequence[torch.dtype], block: int = 0,
              bits: int = 8) -> GatherFormat:
        """The slice of ``layouts`` gathered as ``dtypes``; ``block > 0``: quantized (see the module)."""
        if not block:
            sizes = [lay.local_numel * dt.itemsize for lay, dt in zip(layouts, dtypes)]
            offsets, total = packed_offsets(sizes, align=True)
            return cls(tuple(layouts), tuple(dtypes), tuple(HEADER + o for o in offsets), HEADER + total)
        sizes = []  # per entry: its values, then its scales (none when unquantized)
        for lay, dt in zip(layouts, dtypes):
            quantized = dt.is_floating_point
            sizes += [value_bytes(lay.local_numel, bits) if quantized else lay.local_numel * dt.itemsize,
                      SCALE_DTYPE.itemsize * blocks(lay.local_numel, block) if quantized else 0]
        offsets, total = packed_offsets(sizes, align=True)
        scales = tuple(HEADER + o if dt.is_floating_point else -1 for o, dt in zip(offsets[1::2], dtypes))
        return cls(tuple(layouts), tuple(dtypes), tuple(HEADER + o for o in offsets[0::2]), HEADER + total,
                   block, scales, bits)

    def quantized_views(self, buffer: torch.Tensor, ranks: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each entry's place in ``ranks`` slices of ``buffer`` (rank-major bytes) of a quantized
        format: ``(int8 values (ranks, numel), fp32 scales (ranks, blocks))`` (4 bits: the values
        as uint8 ``(ranks, value_bytes(numel, 4))``, packed), or for an entry
        sent unquantized ``(its values (ranks, *local_shape) in its dtype, None)``."""
        views: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for lay, dtype, off, scale_off in zip(self.layouts, self.dtypes, self.offsets, self.scale_offsets):
            if scale_off < 0:
                views.append((_typed_rows(buffer, dtype, self.slice_bytes, ranks, lay.local_shape, lay.local_stride,
                                          off), None))
                continue
            n = lay.local_numel
            vtype = torch.int8 if self.bits == 8 else torch.uint8
            values = _typed_rows(buffer, vtype, self.slice_bytes, ranks, (value_bytes(n, self.bits),), (1,), off)
            scales = _typed_rows(buffer, SCALE_DTYPE, self.slice_bytes, ranks, (blocks(n, self.block),), (1,),
                                 scale_off)
            views.append((values, scales))
        return views

    @cached_property
    def world(self) -> int:
        return self.layouts[0].world

    @cached_property
    def data_ranks(self) -> int:
        """How many ranks, from rank 0, hold true rows of some entry: the slices of the ranks
        after them hold padding only (``Chunking.data_ranks``); at least one."""
        return max(1, max(lay.data_ranks for lay in self.layouts))

    def slot(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s place in a rank's slice ``buffer``, typed and shaped ``local_shape``."""
        return self.slots(buffer)[i]

    def slots(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter's place in a rank's slice ``buffer`` (``slice_bytes`` bytes)."""
        return self._views(buffer, None)

    def rank_major(self, output: torch.Tensor, ranks: int | None = None) -> list[torch.Tensor]:
        """Every parameter's chunks in a flat all-gather ``output``, each ``(world, *local_shape)``
        (``ranks``: the first ``ranks`` slices only, ``(ranks, *local_shape)``)."""
        return self._views(output, self.world if ranks is None else ranks)

    def _views(self, buffer: torch.Tensor, ranks: int | None) -> list[torch.Tensor]:
        # One typed view of the bytes per dtype, then one as_strided per parameter: the views
        # are made for every parameter at every collective, so they take as few ops as can be.
        typed = {dtype: buffer.view(dtype) for dtype in self._dtype_set}
        views = []
        for dtype, shape, stride, offset in self._specs:
            base = typed[dtype]
            size, strides = ((ranks, *shape), (self.slice_bytes // dtype.itemsize, *stride)) if ranks is not None \
                else (shape, stride)
            views.append(base.as_strided(size, strides, base.storage_offset() + offset))
        return views

    @cached_property
    def _specs(self) -> tuple[tuple[torch.dtype, torch.Size, tuple[int, ...], int], ...]:
        """(dtype, local shape, its contiguous stride, offset in elements of dtype) per parameter."""
        return tuple((dtype, lay.local_shape, lay.local_stride, off // dtype.itemsize)
                     for lay, dtype, off in zip(self.layouts, self.dtypes, self.offsets))

    @cached_property
    def _dtype_set(self) -> frozenset[torch.dtype]:
        return frozenset(self.dtypes)
