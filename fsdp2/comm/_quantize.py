"""Block quantization of an all-gather's entries (``QuantizedComm(weights="int8")``).

Symmetric, per block of ``block`` consecutive elements of a padded chunk (flattened): the
scale is the block's largest magnitude over 127 (fp32), each value is rounded to the nearest
multiple of it (ties to even) and stored as int8 in [-127, 127]. Dequantized, a value is off
by at most half a scale, ``absmax / 254``; an all-zero block has scale 0 and comes back as
zeros. The slice's layout is ``_format.GatherFormat``'s (quantized form); the flat transport
fills it at issue time and reads it back into the unsharded buffer after the wait.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from .._format import GatherFormat, blocks

__all__ = ["quantize_entries", "dequantize_entries"]

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
