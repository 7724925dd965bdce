"""Block quantization of an all-gather's entries (``QuantizedComm(weights="int8")``).

Symmetric, per block of ``block`` consecutive elements of a padded chunk (flattened): the
scale is the block's largest magnitude over 127 (fp32), each value is rounded to the nearest
multiple of it (ties to even) and stored as int8 in [-127, 127]. Dequantized, a value is off
by at most half a scale, ``absmax / 254``; an all-zero block has scale 0 and comes back as
zeros. The slice's layout is ``_format.GatherFormat``'s (quantized form); the transport (flat,
or the CPU exchange) fills it at issue time and reads every rank's back into the unsharded
buffer after the wait.

Gradients (``QuantizedComm(gradients="int8")``) use the same rounding on each destination
rank's chunk of a reduce-scatter's rank-major buffer (:class:`GradChunks`): the blocks
start at each chunk's first element, so a chunk's blocks travel together in one all-to-all.
With ``bits=4`` (``gradients="int4"``; ``weights="int4"``, ``GatherFormat.bits``) the
scale is the block's largest magnitude over 7 and the values are rounded into [-7, 7] (the
two's-complement nibble 0b1000, -8, is never written, so the grid stays symmetric), each off
by at most ``absmax / 14``; two values share a byte, the even element in the low nibble,
the odd one in the high nibble (a row of odd length has a zero high nibble in its last byte).
The same per-block fp32 scales follow.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from .._format import GatherFormat, aligned, blocks, value_bytes

__all__ = ["quantize_entries", "dequantize_entries", "GradChunks", "pack_values", "unpack_values", "value_bytes",
           "block_slices", "simulated_ranges", "SLICE_ELEMENTS"]

QMAX = 127
SLICE_ELEMENTS = 1 << 24
"""The most elements (of all rows together) quantized or dequantized at once (``block_slices``)."""
_COLUMNS = 64  # a range's columns: a multiple of any vector width a reduction's kernel uses
QMAX_BY_BITS = {8: 127, 4: 7}
"""The largest magnitude a quantized value takes, by its width in bits (symmetric grids)."""


def pack_values(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``q`` (``(rows, n)``, integral values within ``QMAX_BY_BITS[bits]``, any dtype) as bytes:
    int8 for 8 bits; for 4 bits uint8 ``(rows, ceil(n / 2))``, element ``2i`` in byte ``i``'s
    low nibble and ``2i + 1`` in its high nibble, each as a two's-complement nibble."""
    q = q.to(torch.int8)
    if bits == 8:
        return q
    nibbles = F.pad(q, (0, q.shape[1] % 2)).view(torch.uint8) & 0x0F
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def unpack_values(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The ``(rows, n)`` int8 values of ``pack_values``'s bytes ``packed`` (``(rows, >= value_bytes)``)."""
    if bits == 8:
        return packed[:, :n].view(torch.int8)
    b = packed[:, :value_bytes(n, bits)].view(torch.uint8)
    nibbles = torch.stack((b & 0x0F, b >> 4), dim=2).view(b.shape[0], -1)[:, :n]
    return ((nibbles ^ 8).to(torch.int8) - 8)  # sign-extend the nibble


def quantize_entries(fmt: GatherFormat, entries: Sequence[torch.Tensor], send: torch.Tensor) -> None:
    """Write ``entries`` (this rank's padded chunks, any float dtype or device) into the slice
    ``send`` as ``fmt`` lays them out: quantized where ``fmt`` says, else cast and copied."""
    qmax = QMAX_BY_BITS[fmt.bits]
    for entry, (values, scales) in zip(entries, fmt.quantized_views(send, 1)):
        if scales is None:
            values[0].copy_(entry, non_blocking=True)
            continue
        flat = entry.reshape(-1)
        for c0, c1 in simulated_ranges(block_slices(1, flat.numel(), fmt.block, fmt.bits), send.device):
            x = _blocked(flat[c0:c1].to(device=send.device, dtype=torch.float32), fmt.block)
            scale = x.abs().amax(dim=1) / qmax  # (blocks,)
            q = torch.round(x / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None]).clamp_(-qmax, qmax)
            if fmt.bits == 8:
                values[0, c0:c1].copy_(q.view(-1)[:c1 - c0])
            else:
                values[0, c0 // 2:c0 // 2 + value_bytes(c1 - c0, 4)].copy_(
                    pack_values(q.view(1, -1)[:, :c1 - c0], fmt.bits)[0])
            scales[0, c0 // fmt.block:c0 // fmt.block + x.shape[0]].copy_(scale)


def dequantize_entries(fmt: GatherFormat, output: torch.Tensor, chunks: Sequence[torch.Tensor]) -> None:
    """Rebuild each entry's ``(world, *local_shape)`` chunks from the rank-major gathered
    ``output`` of ``fmt`` (a quantized format), in the chunks' dtype."""
    world = fmt.world
    for chunk, (values, scales) in zip(chunks, fmt.quantized_views(output, world)):
        if scales is None:
            chunk.copy_(values)
            continue
        n = chunk[0].numel()
        if not chunk.is_contiguous():  # chunks cut along another dim than 0: in one pass
            chunk.copy_(_dequantized(values, scales, 0, n, fmt.block, fmt.bits, torch.float32)[:, :n].view(chunk.shape))
            continue
        rows = chunk.view(world, n)  # a range of whole blocks at a time
        for c0, c1 in simulated_ranges(block_slices(world, n, fmt.block, fmt.bits), output.device):
            rows[:, c0:c1].copy_(_dequantized(values, scales, c0, c1, fmt.block, fmt.bits, torch.float32)[:, :c1 - c0])


def _dequantized(values: torch.Tensor, scales: torch.Tensor, c0: int, c1: int, block: int, bits: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[c0, c1)`` of each row (``c0`` on a block; with 4 bits on a byte) of the
    quantized ``values`` and per-block ``scales`` (``(rows, blocks)``), in ``dtype``:
    ``(rows, whole blocks)``, zeros after the ``c1 - c0`` values."""
    n = c1 - c0
    part = values[:, c0:c1] if bits == 8 else unpack_values(values[:, c0 // 2:], n, bits)
    nb = blocks(n, block)
    x = F.pad(part.to(dtype), (0, nb * block - n)).view(part.shape[0], nb, block)
    return (x * scales[:, c0 // block:c0 // block + nb, None].to(dtype)).view(part.shape[0], -1)


def block_slices(rows: int, numel: int, block: int, bits: int) -> list[tuple[int, int]]:
    """The element ranges ``[c0, c1)`` in which ``rows`` rows of ``numel`` elements are
    quantized or dequantized: whole blocks, a multiple of ``_COLUMNS`` elements each (the last
    range ends at ``numel``; with 4 bits every range starts on a byte), at most
    ``SLICE_ELEMENTS`` elements across the rows where one such unit a row allows it. The
    quantization and the dequantization are per element or per block, so each element comes
    out as in one pass over everything; the sum over ranks (``GradChunks.dequantize_sum``) is
    over whole ranges of columns, which on CPU adds every column in the same order as one pass
    (tested); the temporaries, a few times a range's fp32 size, stay bounded however large a
    group is."""
    unit = math.lcm(block, _COLUMNS)
    per = max(1, SLICE_ELEMENTS // max(1, rows * unit)) * unit
    return [(c0, min(numel, c0 + per)) for c0 in range(0, numel, per)] or [(0, 0)]


def simulated_ranges(ranges: list[tuple[int, int]], device: torch.device,
                     first_reads: Sequence[int] = ()) -> list[tuple[int, int]]:
    """The ranges of ``block_slices`` a loop over them runs on ``device``: all of them, except on
    the meta device (the memory planner's simulation, ``fsdp2/plan``), where ops move no data and
    a range as wide as the one before it allocates and frees exactly what that one did (the
    loops keep at most the previous range's temporaries into the next): there the first two
    ranges, the last one, and any starting a column range in which a tensor the loop reads is
    first touched (``first_reads``: its first column; a memory tracker counts a storage from the
    first op that reads it) are run, the same live bytes op by op as all of them. Large groups
    have hundreds of ranges; the planner simulates each a few times."""
    if device.type != "meta" or len(ranges) <= 3:
        return ranges
    starts = set(first_reads)
    kept = [r for i, r in enumerate(ranges[:-1]) if i < 2 or any(r[0] <= s < r[1] for s in starts)]
    return kept + [ranges[-1]]


def _blocked(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, viewed ``(blocks, block)``."""
    n = flat.numel()
    return F.pad(flat, (0, blocks(n, block) * block - n)).view(-1, block)


class GradChunks:
    """The packed layout of a quantized reduce-scatter: ``world`` rows of ``chunk_bytes``, row
    ``r`` the ``numel`` elements bound for rank ``r``: their ``bits``-bit values (int8, or two
    int4 per byte, low nibble first; padded to 16 bytes), then one fp32 scale per ``block`` of
    them. The all-to-all sends row ``r`` to rank ``r``."""

    __slots__ = ("world", "numel", "block", "bits", "qmax", "blocks", "values_bytes", "chunk_bytes")

    def __init__(self, world: int, numel: int, block: int, bits: int = 8) -> None:
        if bits not in QMAX_BY_BITS:
            raise ValueError(f"GradChunks: bits={bits} is not supported; use 8 or 4")
        self.world, self.numel, self.block, self.bits, self.qmax = world, numel, block, bits, QMAX_BY_BITS[bits]
        self.blocks = blocks(numel, block)
        self.values_bytes = aligned(value_bytes(numel, bits))
        self.chunk_bytes = self.values_bytes + 4 * self.blocks

    def views(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The values ``(world, value_bytes)`` (int8; 4 bits: packed uint8, ``unpack_values``) and
        fp32 scales ``(world, blocks)`` of ``packed``."""
        rows = packed.view(self.world, self.chunk_bytes)
        values = rows[:, :value_bytes(self.numel, self.bits)]
        return values.view(torch.int8) if self.bits == 8 else values, rows[:, self.values_bytes:].view(torch.float32)

    def quantize(self, rows: torch.Tensor, packed: torch.Tensor, error: torch.Tensor | None = None) -> None:
        """Quantize ``rows`` (``(world, numel)``, fp32 or wider) into ``packed``; with ``error``
        (same shape, fp32), write there what the rounding lost (``rows`` minus what arrives).
        A range of whole blocks at a time (``block_slices``)."""
        values, scales = self.views(packed)
        for c0, c1 in simulated_ranges(block_slices(self.world, self.numel, self.block, self.bits), packed.device):
            self.quantize_range(rows[:, c0:c1], values, scales, c0, None if error is None else error[:, c0:c1])

    def quantize_range(self, part: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, c0: int,
                       error: torch.Tensor | None) -> None:
        """Quantize columns ``[c0, c0 + n)`` of the rows, ``part`` (``(world, n)``; ``c0`` from
        ``block_slices``), into ``values`` and ``scales`` (``views``); ``error``: as ``quantize``."""
        n = part.shape[1]
        nb = blocks(n, self.block)
        x = F.pad(part, (0, nb * self.block - n)).view(self.world, nb, self.block)
        scale = (x.abs().amax(dim=2) / self.qmax).to(torch.float32)  # (world, blocks)
        q = torch.round(x / scale.clamp(min=torch.finfo(torch.float32).tiny)[..., None].to(x.dtype))
        q.clamp_(-self.qmax, self.qmax)
        if self.bits == 8:
            values[:, c0:c0 + n].copy_(q.view(self.world, -1)[:, :n])
        else:
            values[:, c0 // 2:c0 // 2 + value_bytes(n, self.bits)].copy_(
                pack_values(q.view(self.world, -1)[:, :n], self.bits))
        scales[:, c0 // self.block:c0 // self.block + nb].copy_(scale)
        if error is not None:
            error.copy_((x - q * scale[..., None].to(x.dtype)).view(self.world, -1)[:, :n])

    def dequantize(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The ``packed`` rows dequantized in ``dtype``: ``(world, blocks * block)``, each row's
        first ``numel`` elements its values (the rest zeros)."""
        values, scales = self.views(packed)
        return _dequantized(values, scales, 0, self.numel, self.block, self.bits, dtype)

    def dequantize_range(self, values: torch.Tensor, scales: torch.Tensor, c0: int, c1: int,
                         dtype: torch.dtype) -> torch.Tensor:
        """Columns ``[c0, c1)`` of every row (a range from ``block_slices``) of the ``views`` of
        a packed buffer, dequantized in ``dtype``: ``(world, whole blocks)``, zeros after
        ``c1 - c0``."""
        return _dequantized(values, scales, c0, c1, self.block, self.bits, dtype)

    def dequantize_sum(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The received ``packed`` rows (one per source rank) dequantized and summed in
        ``dtype``: this rank's ``(numel,)`` reduced chunk, not divided. A range of whole blocks
        at a time (``block_slices``)."""
        values, scales = self.views(packed)
        out = torch.empty(self.numel, dtype=dtype, device=packed.device)
        for c0, c1 in simulated_ranges(block_slices(self.world, self.numel, self.block, self.bits), packed.device):
            # Summed over whole blocks (contiguous): the order of the sum is the one-pass one.
            out[c0:c1].copy_(_dequantized(values, scales, c0, c1, self.block, self.bits, dtype).sum(dim=0)[:c1 - c0])
        return out
