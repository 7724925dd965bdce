"""The byte layout every layer agrees on, each rule written once.

The runtime lays parameters out in these shapes, the transports move them, the memory
planner counts them and the diagnostics read them back: they all import the rules from here.

* ``ALIGN``: each region of a packed buffer (the unsharded buffer, an all-gather slice, a
  reduce-scatter buffer) starts on a 16-byte boundary, a multiple of every dtype's itemsize;
  ``aligned(n)`` is ``n`` rounded up to it.
* ``HEADER``: the bytes at the start of each rank's all-gather slice (the rank checks' header,
  ``diagnostics/_checks.py``); a multiple of ``ALIGN``, so the slots after it stay aligned.
* ``chunk_rows(n, world)``: cutting ``n`` rows over ``world`` ranks gives each rank
  ``ceil(n / world)`` rows, the last ranks fewer or none (``torch.chunk``'s rule, DTensor's
  ``Shard``); shards are padded to that many rows.
"""

from __future__ import annotations

__all__ = ["ALIGN", "HEADER", "aligned", "chunk_rows"]

ALIGN = 16
HEADER = 16


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def chunk_rows(n: int, world: int) -> int:
    """Rows per rank when ``n`` rows are cut over ``world`` ranks: ``ceil(n / world)``."""
    return -(-n // world)
