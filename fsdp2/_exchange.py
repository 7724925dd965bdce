"""All-gather and reduce-scatter as point-to-point exchanges: the CPU (gloo) transport.

gloo's flat collectives are slow for what fsdp2 needs. Measured on a 2-core machine
(2 ranks, 68 MB): ``all_gather_into_tensor`` 90 ms and ``reduce_scatter_tensor``
130 ms (it is an all-reduce underneath), against about 35 ms for the same bytes
moved with ``isend``/``irecv``; and while compute runs beside them, the flat
collectives slowed it by 130-160 ms where the exchanges cost 10-20 ms. The flat
collectives also need a rank-major buffer that fsdp2 must copy into (reduce-scatter)
or out of (all-gather) on the critical path.

So on CPU each rank exchanges chunks with every peer directly, one message per
parameter, each one from where it lives to where it is needed:

* **all-gather**: this rank's shards are copied (and cast) into its own chunk of
  the group's unsharded buffer, which is sent to every peer; each peer's chunk is
  received straight into its place in the unsharded buffer. No output buffer and
  no copy-out (a chunk that is not contiguous there, ``Shard(d)`` with ``d != 0``,
  is received into a small staging tensor and copied at the end). A 16-byte
  schedule header travels first (checked in ``_checks.py``), so it can be
  checked before waiting for data that may never come.
* **reduce-scatter**: chunk ``q`` of each full gradient is sent to rank ``q`` as it
  is (no copy-in, unless a cast to the reduce dtype or padding is needed); the
  chunks received from the peers are summed with this rank's own chunks in rank
  order (deterministic; with two ranks the same as any order), then averaged. A
  16-byte header saying which gradients the rank reduces travels first (ranks
  that disagree get a clear error instead of sums of mismatched chunks).

Messages between two ranks are matched in the order they were posted, the same on
every rank because every rank runs the same schedule; they use a tag of their own
so that user point-to-point traffic on the same process group (tag 0) cannot
interleave with them.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from ._checks import HEADER

__all__ = ["TAG", "Exchange", "ExchangeAllGather", "start_all_gather", "ExchangeReduceScatter", "start_reduce_scatter"]

TAG = 0x46534432  # "FSD2"


class Exchange:
    """The sends and receives of one exchange; ``wait()`` returns once all are done."""

    __slots__ = ("works",)

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> bool:
        while self.works:
            self.works[0].wait()
            self.works.pop(0)  # only once finished: a failed wait leaves it to be waited on again
        return True


def _post(pg: dist.ProcessGroup, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], peer: int,
          works: list[dist.Work]) -> None:
    """Post ``recvs`` from and ``sends`` to group rank ``peer``, in order, without blocking.

    Receives first: data that arrives before its receive is posted is buffered by gloo
    and copied again when the receive comes.
    """
    for tensor in recvs:
        works.append(pg.recv([tensor], peer, TAG))
    for tensor in sends:
        works.append(pg.send([tensor], peer, TAG))


class ExchangeAllGather(NamedTuple):
    """An all-gather by exchange; the tensors here must outlive the exchange."""

    header_exchange: Exchange  # the headers' messages, first from every peer: check before the rest
    exchange: Exchange
    headers: torch.Tensor  # (world, HEADER) bytes: every rank's schedule header, once done
    sent: tuple[torch.Tensor, ...]  # the header and the own chunks as sent (contiguous copies if needed)
    staged: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (place, received): copied at the end

    def finish(self) -> None:
        """After the wait: copy the chunks received into staging tensors into place."""
        if self.staged:
            with torch.no_grad():
                torch._foreach_copy_([place for place, _ in self.staged], [got for _, got in self.staged])

    def buffers(self) -> list[torch.Tensor]:
        """The communication memory it holds (the unsharded buffer it fills is not)."""
        return [self.headers, *self.sent, *(got for _, got in self.staged)]


def start_all_gather(
    sources: Sequence[torch.Tensor], chunks: Sequence[torch.Tensor], header: torch.Tensor,
    pg: dist.ProcessGroup,
) -> ExchangeAllGather:
    """Fill this rank's chunks from ``sources`` and exchange chunks with every peer.

    Args:
        sources: this rank's shard of each parameter (``local_shape``; cast on the copy).
        chunks: each parameter's padded full tensor in the unsharded buffer, viewed as
            ``(world, *local_shape)`` (chunk ``q`` belongs to group rank ``q``).
        header: this rank's 16-byte schedule header.
        pg: the process group of the ``world`` ranks.
    """
    me, world = pg.rank(), pg.size()
    own = [c[me] for c in chunks]
    with torch.no_grad():
        torch._foreach_copy_(own, list(sources))
    sent = [t if t.is_contiguous() else t.contiguous() for t in own]
    headers, header_works = _exchange_headers(header, pg)
    works: list[dist.Work] = []
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for peer in range(world):
        if peer == me:
            continue
        places = []
        for c in chunks:
            place = c[peer]
            if not place.is_contiguous():
                got = torch.empty(place.shape, dtype=place.dtype, device=place.device)
                staged.append((place, got))
                place = got
            places.append(place)
        _post(pg, sent, places, peer, works)
    return ExchangeAllGather(Exchange(header_works), Exchange(works), headers, (header, *sent), tuple(staged))


def _exchange_headers(header: torch.Tensor, pg: dist.ProcessGroup) -> tuple[torch.Tensor, list[dist.Work]]:
    """Send this rank's 16-byte ``header`` to every peer and receive theirs, ahead of the data.

    Returns ``(world, HEADER)`` bytes (row ``q``: rank ``q``'s header, once done) and the works.
    Posted before any data, the headers are the first messages each peer gets from this
    exchange: they can be checked before waiting for data that may never match.
    """
    me, world = pg.rank(), pg.size()
    headers = torch.empty(world, HEADER, dtype=torch.uint8)
    headers[me].copy_(header)
    works: list[dist.Work] = []
    for peer in range(world):
        if peer != me:
            _post(pg, [header], [headers[peer]], peer, works)
    return headers, works


class ExchangeReduceScatter(NamedTuple):
    """A reduce-scatter by exchange: what was sent, what arrives, and this rank's own chunks."""

    header_exchange: Exchange  # the headers' messages, first from every peer: check before the rest
    exchange: Exchange
    headers: torch.Tensor  # (world, HEADER) bytes: what every rank says it reduces
    header: torch.Tensor
    rank: int
    received: tuple[torch.Tensor | None, ...]  # per group rank: its chunks (flat), None for this rank
    own: tuple[torch.Tensor, ...]  # this rank's chunk of each gradient (``local_shape``)
    sent: tuple[torch.Tensor, ...]  # the full gradients (or their cast/padded copies) being read
    copies: tuple[torch.Tensor, ...]  # copies fsdp2 made to send (cast, padded, contiguous chunks)

    def reduced(self, offsets: Sequence[int]) -> torch.Tensor:
        """Wait, then sum every rank's chunks in rank order; returns the flat sum."""
        self.exchange.wait()
        peers = [q for q, row in enumerate(self.received) if row is not None]
        total = self.received[peers[0]]
        with torch.no_grad():
            for q in range(len(self.received)):
                if q == peers[0]:
                    continue  # the sum starts from it (a + b == b + a: still rank order)
                if q == self.rank:
                    places = [total[off:off + t.numel()].view(t.shape) for t, off in zip(self.own, offsets)]
                    torch._foreach_add_(places, list(self.own))
                else:
                    total.add_(self.received[q])
        return total

    def buffers(self) -> list[torch.Tensor]:
        return [self.headers, self.header, *(row for row in self.received if row is not None), *self.copies]


def start_reduce_scatter(
    chunks: Sequence[torch.Tensor], sent: Sequence[torch.Tensor], copies: Sequence[torch.Tensor],
    total: int, offsets: Sequence[int], dtype: torch.dtype, header: torch.Tensor, pg: dist.ProcessGroup,
) -> ExchangeReduceScatter:
    """Send chunk ``q`` of every gradient to rank ``q``; receive this rank's chunk from every peer.

    Args:
        chunks: each full gradient (in ``dtype``, padded) viewed as ``(world, *local_shape)``.
        sent: the tensors ``chunks`` view, held until the exchange is done.
        copies: the copies among them fsdp2 made (communication memory).
        total, offsets: elements of this rank's flat result and each gradient's offset in it.
        header: 16 bytes saying what this rank reduces, sent ahead of the data.
    """
    me, world = pg.rank(), pg.size()
    device = chunks[0].device if chunks else torch.device("cpu")
    headers, header_works = _exchange_headers(header, pg)
    received: list[torch.Tensor | None] = [None] * world
    works: list[dist.Work] = []
    made = list(copies)
    for peer in range(world):
        if peer == me:
            continue
        row = torch.empty(total, dtype=dtype, device=device)
        received[peer] = row
        outgoing = []
        for c in chunks:
            chunk = c[peer]
            if not chunk.is_contiguous():
                chunk = chunk.contiguous()
                made.append(chunk)
            outgoing.append(chunk)
        places = [row[off:off + c[peer].numel()] for c, off in zip(chunks, offsets)]
        _post(pg, outgoing, places, peer, works)
    return ExchangeReduceScatter(Exchange(header_works), Exchange(works), headers, header, me, tuple(received),
                                 tuple(c[me] for c in chunks), tuple(sent), tuple(made))
