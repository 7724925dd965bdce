"""Bytes sent by fsdp2's collectives, counted where the transports issue them.

``with count_comm_bytes() as sent:`` adds up, on this rank, the bytes each all-gather,
reduce-scatter and all-reduce of the parameter groups sends to the other ranks, by the
size of what it was handed (not by timing or by the backend), so the count is exact for a
given model, mesh and policy:

* all-gather of a ``S``-byte slice over ``W`` ranks: ``(W - 1) * S`` (the slice, to each peer);
* reduce-scatter of ``W`` chunks of ``C`` bytes: ``(W - 1) * C`` (each peer's chunk); int8
  gradients' all-to-all of ``W`` packed chunks of ``C`` bytes counts the same, as a reduce-scatter;
* all-reduce (HSDP's, over ``R`` replicas) of ``N`` bytes: ``2 * (R - 1) * ceil(N / R)``
  (a reduce-scatter then an all-gather of the tensor padded to ``R`` parts, the
  bandwidth-optimal schedule).

The exchange transport (CPU) counts the flat collective it stands for. Collectives outside
the groups' (lazy init's rank checks, ``clip_grad_norm_``, the user's own) are not counted.
Nothing is counted, and nothing costs more than one list check, when no counter is active.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

__all__ = ["CommBytes", "count_comm_bytes", "count"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(eq=False)  # counters are told apart by identity (two may count the same)
class CommBytes:
    """What one :func:`count_comm_bytes` block counted on this rank."""

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    """How many collectives of each kind were counted (those with one rank send nothing and are not)."""

    @property
    def total(self) -> int:
        return self.all_gather + self.reduce_scatter + self.all_reduce


# Active counters. A list, as _trace's recorders: backward hooks may run on autograd's threads.
_ACTIVE: list[CommBytes] = []


def count(kind: str, nbytes: int) -> None:
    """Add ``nbytes`` sent by one collective of ``kind`` to every active counter."""
    for counter in _ACTIVE:
        setattr(counter, kind, getattr(counter, kind) + nbytes)
        counter.calls[kind] += 1


@contextlib.contextmanager
def count_comm_bytes() -> Iterator[CommBytes]:
    """Count the bytes this rank's fsdp2 collectives send inside the block (see the module)."""
    counter = CommBytes()
    _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE.remove(counter)
