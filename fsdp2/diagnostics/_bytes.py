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

``across_nodes`` is the part of those bytes whose receiver is on another node: each of the
formulas above is a number of bytes per peer times the number of peers, and the peers on
other nodes are counted instead. Nodes are as torchrun numbers ranks (node ``r //
ranks_per_node`` for global rank ``r``; ``ranks_per_node`` defaults to ``LOCAL_WORLD_SIZE``,
the whole world where that is unset), so the count needs no collective.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Iterator

import torch.distributed as dist

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
    across_nodes: int = 0
    """The part of ``total`` sent to ranks of other nodes (nodes of ``ranks_per_node`` consecutive ranks)."""
    ranks_per_node: int = 0

    @property
    def total(self) -> int:
        return self.all_gather + self.reduce_scatter + self.all_reduce


# Active counters. A list, as _trace's recorders: backward hooks may run on autograd's threads.
_ACTIVE: list[CommBytes] = []


# (group's ranks, ranks per node) -> (peers, peers on other nodes) of this rank
_PEERS: dict[tuple[tuple[int, ...], int], tuple[int, int]] = {}


def _peers(pg: dist.ProcessGroup, ranks_per_node: int) -> tuple[int, int]:
    ranks = tuple(dist.get_process_group_ranks(pg))
    key = (ranks, ranks_per_node)
    if key not in _PEERS:
        node = dist.get_rank() // ranks_per_node
        _PEERS[key] = (len(ranks) - 1, sum(r // ranks_per_node != node for r in ranks))
    return _PEERS[key]


def count(kind: str, per_peer: int, pg: dist.ProcessGroup) -> None:
    """Add one collective of ``kind`` over ``pg`` that sends ``per_peer`` bytes to each peer to
    every active counter."""
    for counter in _ACTIVE:
        peers, remote = _peers(pg, counter.ranks_per_node)
        setattr(counter, kind, getattr(counter, kind) + peers * per_peer)
        counter.across_nodes += remote * per_peer
        counter.calls[kind] += 1


@contextlib.contextmanager
def count_comm_bytes(ranks_per_node: int | None = None) -> Iterator[CommBytes]:
    """Count the bytes this rank's fsdp2 collectives send inside the block (see the module);
    ``ranks_per_node`` (default ``LOCAL_WORLD_SIZE``, else the world) places the node boundary."""
    if ranks_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        ranks_per_node = int(env) if env else dist.get_world_size() if dist.is_initialized() else 1
    elif isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int):
        raise TypeError(f"ranks_per_node must be an int, got {type(ranks_per_node).__name__}")
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be at least 1 (the ranks on each node)")
    counter = CommBytes(ranks_per_node=ranks_per_node)
    _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE.remove(counter)
