"""Block quantization of an all-gather's entries (``QuantizedComm(weights="int8")``).

Symmetric, per block of ``block`` consecutive elements of a padded chunk (flattened): the
scale is the block's largest magnitude over 127 (fp32), each value is rounded to the nearest
multiple of it (ties to even) and stored as int8 in [-127, 127]. Dequantized, a value is off
by at most half a scale, ``absmax / 254``; an all-zero block has scale 0 and comes back as
zeros. The slice's layout is ``_format.GatherFormat``'s (quantized form); the flat transport
fills it at issue time and reads it back into the unsharded buffer after the wait.

Gradients (``QuantizedComm(gradients="int8")``) use the same rounding on each destination
rank's chunk of a reduce-scatter's rank-major buffer (:class:`GradChunks`): the blocks
start at each chunk's first element, so a chunk's blocks travel together in one all-to-all.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from .._format import GatherFormat, aligned, blocks

__all__ = ["quantize_entries", "dequantize_entries", "GradChunks"]

QMAX = 127


def quantize_entries(fmt: GatherFormat, entries: Sequence[torch.Tensor], send: torch.Tensor) -> None:
    """Write ``entries`` (this rank's padded chunks, any float dtype or device) into the slice
    ``send`` as ``fmt`` lays them out: quantized where ``fmt`` says, else cast and copied."""
    for entry, (values, scales) in zip(entries, fmt.quantized_views(send, 1)):
        if scales is None:
            values[0].copy_(entry, non_blocking=True)
            continue
        x = _blocked(entry.to(device=send.device, dtype=torch.float32).reshape(-1), fmt.block)
        scale = x.abs().amax(dim=1) / QMAX  # (blocks,)
        q = torch.round(x / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None]).clamp_(-QMAX, QMAX)
        values[0].copy_(q.view(-1)[:values.shape[1]])
        scales[0].copy_(scale)


def dequantize_entries(fmt: GatherFormat, output: torch.Tensor, chunks: Sequence[torch.Tensor]) -> None:
    """Rebuild each entry's ``(world, *local_shape)`` chunks from the rank-major gathered
    ``output`` of ``fmt`` (a quantized format), in the chunks' dtype."""
    world = fmt.world
    for chunk, (values, scales) in zip(chunks, fmt.quantized_views(output, world)):
        if scales is None:
            chunk.copy_(values)
            continue
        n = values.shape[1]
        full = values.to(torch.float32)
        full = F.pad(full, (0, blocks(n, fmt.block) * fmt.block - n)).view(world, -1, fmt.block)
        full = (full * scales[:, :, None]).view(world, -1)[:, :n]
        chunk.copy_(full.view(chunk.shape))


def _blocked(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, viewed ``(blocks, block)``."""
    n = flat.numel()
    return F.pad(flat, (0, blocks(n, block) * block - n)).view(-1, block)


class GradChunks:
    """The packed layout of a quantized reduce-scatter: ``world`` rows of ``chunk_bytes``, row
    ``r`` the ``numel`` elements bound for rank ``r``: their int8 values (padded to 16 bytes),
    then one fp32 scale per ``block`` of them. The all-to-all sends row ``r`` to rank ``r``."""

    __slots__ = ("world", "numel", "block", "blocks", "values_bytes", "chunk_bytes")

    def __init__(self, world: int, numel: int, block: int) -> None:
        self.world, self.numel, self.block = world, numel, block
        self.blocks = blocks(numel, block)
        self.values_bytes = aligned(numel)
        self.chunk_bytes = self.values_bytes + 4 * self.blocks

    def views(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 values ``(world, numel)`` and fp32 scales ``(world, blocks)`` of ``packed``."""
        rows = packed.view(self.world, self.chunk_bytes)
        return rows[:, :self.numel].view(torch.int8), rows[:, self.values_bytes:].view(torch.float32)

    def quantize(self, rows: torch.Tensor, packed: torch.Tensor, error: torch.Tensor | None = None) -> None:
        """Quantize ``rows`` (``(world, numel)``, fp32 or wider) into ``packed``; with ``error``
        (same shape, fp32), write there what the rounding lost (``rows`` minus what arrives)."""
        values, scales = self.views(packed)
        pad = self.blocks * self.block - self.numel
        x = F.pad(rows, (0, pad)).view(self.world, self.blocks, self.block)
        scale = (x.abs().amax(dim=2) / QMAX).to(torch.float32)  # (world, blocks)
        q = torch.round(x / scale.clamp(min=torch.finfo(torch.float32).tiny)[..., None].to(x.dtype))
        q.clamp_(-QMAX, QMAX)
        values.copy_(q.view(self.world, -1)[:, :self.numel])
        scales.copy_(scale)
        if error is not None:
            error.copy_((x - q * scale[..., None].to(x.dtype)).view(self.world, -1)[:, :self.numel])

    def dequantize_sum(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The received ``packed`` rows (one per source rank) dequantized and summed in
        ``dtype``: this rank's ``(numel,)`` reduced chunk, not divided."""
        values, scales = self.views(packed)
        pad = self.blocks * self.block - self.numel
        x = F.pad(values.to(dtype), (0, pad)).view(self.world, self.blocks, self.block)
        x = x * scales.to(dtype)[..., None]
        return x.sum(dim=0).view(-1)[:self.numel]
