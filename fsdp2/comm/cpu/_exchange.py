"""All-gather and reduce-scatter as point-to-point exchanges: the CPU (gloo) transport.

gloo's flat collectives are slow for what fsdp2 needs: ``reduce_scatter_tensor`` is an
all-reduce underneath, both take longer than the same bytes moved with
``isend``/``irecv``, and they slow the compute beside them more (measured:
docs/performance.md, "What bounds it here"). They also need a rank-major buffer that
fsdp2 must copy into (reduce-scatter) or out of (all-gather) on the critical path.

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

Quantized communication (``QuantizedComm``, ``_transport.py``) runs the same two exchanges on
bytes: the all-gather of each rank's quantized slice (its own chunk filled already), and the
reduce-scatter of the packed gradient rows, each peer's received into its row of one buffer
(``into``) that the caller dequantizes and sums.

Ranks on one host (probed once per group, ``_cma.py``) move the data by reading each
other's memory instead (``ReadExchange``): after the header, each rank sends every peer
a descriptor of where its chunks are, the peer reads them straight into place (no
packing needed: one call reads any number of chunks) and acknowledges. Those small
messages (headers, descriptors, acknowledgements) go over pipes between the ranks
(``_pipes.py``) where they connected, not through gloo.

Messages between two ranks are matched in the order they were posted, the same on
every rank because every rank runs the same schedule; they use a tag of their own
so that user point-to-point traffic on the same process group (tag 0) cannot
interleave with them.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple, Sequence, Union

import torch
import torch.distributed as dist

from . import _cma, _lease, _pipes
from ..._format import HEADER

# What messages go over: a process group, or the pipes connecting its ranks on one host.
Link = Union[dist.ProcessGroup, _pipes.Pipes]

__all__ = ["TAG", "Exchange", "ReadExchange", "ExchangeAllGather", "start_all_gather", "ExchangeReduceScatter",
           "start_reduce_scatter"]

TAG = 0x46534432  # "FSD2"
# Chunks smaller than this travel together, one message per peer (copied into and out of a
# packed buffer): a message costs tens of microseconds whatever its size, a copy of 64 KiB
# a few.
SMALL = 64 * 1024


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


class ReadExchange:
    """Reading peers' memory (``_cma.py``): ``wait()`` reads what every peer describes.

    Per peer, once its descriptor has arrived: read its chunks into their places, then
    acknowledge. ``release`` (a ``_lease.Lease``) finishes once every peer has acknowledged
    this rank's chunks too, so that the caller may free or overwrite them: ``wait()`` waits
    for it as well, unless ``defer`` (all-gathers: their caller waits for ``release`` before
    it frees the unsharded buffer, one block of compute later, so the ranks may drift apart
    by a block instead of meeting at every wait). Until then the lease holds the memory on
    offer, even if the caller drops it (a model deleted mid-iteration, the process exiting):
    see ``_lease.py``.
    """

    __slots__ = ("pg", "what", "pending", "release", "descriptors", "defer", "headers")

    def __init__(self, pg: Link, what: str, ack_tag: int, defer: bool = False, pids: Sequence[int] = ()) -> None:
        _lease.prune()  # a safe point: settle exchanges dropped earlier, before new messages
        self.pg, self.what, self.defer = pg, what, defer
        self.pending: list[tuple[int, dist.Work | None, torch.Tensor, list[torch.Tensor]]] = []
        self.release = _lease.Lease(pg, what, ack_tag, pids)
        self.descriptors: list[torch.Tensor] = []
        self.headers: tuple[list[dist.Work], dict[int, int]] = ([], {})  # header works not yet waited; their peers

    def with_headers(self, header: torch.Tensor, headers: torch.Tensor, works: list[dist.Work]) -> None:
        """The exchange's header messages (``_exchange_headers``), ``works`` the list their
        ``Exchange`` pops as it waits: those left are held too, should the exchange be dropped
        before they are done (their buffers must outlive them, gloo must not match them late)."""
        me = self.pg.rank()
        peers = [q for q in range(self.pg.size()) if q != me for _ in range(2)]  # a receive, then a send each
        self.headers = (works, {id(w): q for q, w in zip(peers, works)})
        self.release.hold([header, headers])

    def expect(self, peer: int, descriptor_size: int, descriptor_tag: int, places: list[torch.Tensor]) -> None:
        """Post the receives of ``peer``'s descriptor and acknowledgement; its chunks go to ``places``."""
        descriptor = torch.empty(descriptor_size, dtype=torch.int64)
        self.release.hold([descriptor])
        work = self.pg.recv([descriptor], peer, descriptor_tag)
        self.descriptors += [descriptor, self.release.expect_ack(peer)]
        self.pending.append((peer, work, descriptor, places))

    def offer(self, peer: int, descriptor: torch.Tensor, descriptor_tag: int, tensors: Sequence[torch.Tensor]) -> None:
        """Tell ``peer`` where to read ``tensors``; the lease holds them until ``peer`` acknowledges."""
        self.descriptors.append(descriptor)
        self.release.hold(tensors)
        self.release.send(peer, descriptor, descriptor_tag)

    def wait(self) -> bool:
        """Read every peer's chunks and acknowledge them; then, unless ``defer``, wait for ``release``."""
        while self.pending:
            peer, work, descriptor, places = self.pending[0]
            if work is not None:
                work.wait()
                self.pending[0] = (peer, None, descriptor, places)  # a gloo work must not be waited twice
            pids = self.release.pids  # recorded by the probe, in group rank order
            _cma.read(descriptor, places, self.what, pid=pids[peer] if peer < len(pids) else None)
            self.pending.pop(0)  # only once read: a failed wait leaves it to be waited on again
            self.release.acknowledge(peer)
        return True if self.defer else self.release.wait()

    def __del__(self) -> None:
        # Dropped before its lease was released: the peers this rank has not read are told it
        # never will; what they may still read of this rank's stays held (``_lease.py``).
        try:
            if not self.release.done:
                works, peers = self.headers
                self.release.orphan([(peer, work) for peer, work, _, _ in self.pending if work is not None]
                                    + [(peers[id(w)], w) for w in works])
        except Exception:  # noqa: BLE001 - interpreter teardown; the exit drain ran before it
            pass


def _tag(key: str, what: str, tensor: torch.Tensor) -> int:
    """The tag of one data message: names the exchange, the part and its size.

    A message only matches a receive with the same tag, so when ranks disagree (a rank
    gathers another group, reduces other gradients) their messages do not meet receives
    of another size, which gloo answers by aborting the process; the headers, sent with
    the common ``TAG``, meet and say what went wrong. In [2**30, 2**31): not a user's
    small tags, and a valid gloo tag.
    """
    return _tag_of_size(key, what, tensor.numel() * tensor.element_size())


def _tag_of_size(key: str, what: str, nbytes: int) -> int:
    """``_tag`` for a message of ``nbytes`` bytes (no tensor needed to name it)."""
    return (zlib.crc32(f"{key}|{what}|{nbytes}".encode()) & 0x3FFFFFFF) | 0x40000000


def _post(pg: Link, sends: Sequence[tuple[torch.Tensor, int]],
          recvs: Sequence[tuple[torch.Tensor, int]], peer: int, works: list[dist.Work]) -> None:
    """Post ``recvs`` from and ``sends`` to group rank ``peer`` (``(tensor, tag)`` pairs), without blocking.

    Receives first: data that arrives before its receive is posted is buffered by gloo
    and copied again when the receive comes.
    """
    for tensor, tag in recvs:
        works.append(pg.recv([tensor], peer, tag))
    for tensor, tag in sends:
        works.append(pg.send([tensor], peer, tag))


class ExchangeAllGather(NamedTuple):
    """An all-gather by exchange; the tensors here must outlive the exchange."""

    header_exchange: Exchange  # the headers' messages, first from every peer: check before the rest
    exchange: Exchange | ReadExchange  # the data: messages, or reads of the peers' memory
    headers: torch.Tensor  # (world, HEADER) bytes: every rank's schedule header, once done
    sent: tuple[torch.Tensor, ...]  # the header, the small chunks packed, the other own chunks as sent
    staged: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (place, received): copied at the end

    def finish(self) -> None:
        """After the wait: copy the chunks received into staging tensors into place."""
        if self.staged:
            with torch.no_grad():
                torch._foreach_copy_([place for place, _ in self.staged], [got for _, got in self.staged])

    def buffers(self) -> list[torch.Tensor]:
        """The communication memory it holds (the unsharded buffer it fills is not)."""
        extra = self.exchange.descriptors if isinstance(self.exchange, ReadExchange) else []
        return [self.headers, *self.sent, *(got for _, got in self.staged), *extra]


def start_all_gather(
    sources: Sequence[torch.Tensor] | None, chunks: Sequence[torch.Tensor], header: torch.Tensor,
    pg: dist.ProcessGroup, key: str, read: bool = False,
) -> ExchangeAllGather:
    """Fill this rank's chunks from ``sources`` and exchange chunks with every peer.

    Args:
        sources: this rank's shard of each parameter (``local_shape``; cast on the copy);
            None: this rank's chunks are filled already (a quantized all-gather's slice).
        chunks: each parameter's padded full tensor in the unsharded buffer, viewed as
            ``(world, *local_shape)`` (chunk ``q`` belongs to group rank ``q``).
        header: this rank's 16-byte schedule header.
        pg: the process group of the ``world`` ranks.
        key: names this exchange the same on every rank (e.g. the group): its messages' tags.
        read: the peers read the chunks out of this process (``_cma.py``) instead of
            receiving messages (the wait then also waits until they have read).
    """
    me, world = pg.rank(), pg.size()
    own = [c[me] for c in chunks]
    if sources is not None:
        with torch.no_grad():
            torch._foreach_copy_(own, list(sources))
    if read:
        return _read_all_gather(own, chunks, header, pg, key)
    small = [i for i, t in enumerate(own) if _is_small(t)]
    big = [i for i, t in enumerate(own) if not _is_small(t)]
    sent = [(t if t.is_contiguous() else t.contiguous(), _tag(key, str(i), t)) for i, t in ((i, own[i]) for i in big)]
    if small:  # one message for all of them: copied into and out of a packed buffer
        packed, slots = _packed_slots([own[i] for i in small])
        with torch.no_grad():
            torch._foreach_copy_(slots, [own[i] for i in small])
        packed_tag = _tag(key, ",".join(map(str, small)), packed)
        sent.insert(0, (packed, packed_tag))
    headers, header_works = _exchange_headers(header, pg)
    works: list[dist.Work] = []
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for peer in range(world):
        if peer == me:
            continue
        places = []
        if small:
            got, slots = _packed_slots([own[i] for i in small])
            staged += [(chunks[i][peer], slot) for i, slot in zip(small, slots)]
            places.append((got, packed_tag))
        for i in big:
            place = chunks[i][peer]
            if not place.is_contiguous():
                got = torch.empty(place.shape, dtype=place.dtype, device=place.device)
                staged.append((place, got))
                place = got
            places.append((place, _tag(key, str(i), place)))
        _post(pg, sent, places, peer, works)
    return ExchangeAllGather(Exchange(header_works), Exchange(works), headers, (header, *(t for t, _ in sent)),
                             tuple(staged))


def _read_all_gather(own: list[torch.Tensor], chunks: Sequence[torch.Tensor], header: torch.Tensor,
                     pg: dist.ProcessGroup, key: str) -> ExchangeAllGather:
    """The all-gather by reading: every peer reads this rank's chunks where they are.

    Its messages (header, descriptor, acknowledgement) go over the group's pipes where the
    ranks connected them (``_pipes.py``), else over ``pg``.
    """
    pids = _cma.pids(pg)
    pg = _pipes.link(pg)
    me, world = pg.rank(), pg.size()
    offered = [t if t.is_contiguous() else t.contiguous() for t in own]
    mine = _cma.describe(offered)
    where, ack = _tag(key, "where", mine), _tag(key, "ack", mine)
    headers, header_works = _exchange_headers(header, pg)
    reads = ReadExchange(pg, key, ack, defer=True, pids=pids)
    reads.with_headers(header, headers, header_works)
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
        reads.expect(peer, mine.numel(), where, places)
        reads.offer(peer, mine, where, offered)
    return ExchangeAllGather(Exchange(header_works), reads, headers, (header, *offered), tuple(staged))


def _is_small(chunk: torch.Tensor) -> bool:
    return chunk.numel() * chunk.element_size() < SMALL


def _packed_slots(like: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A byte buffer holding tensors shaped and typed as ``like``, each at a 16-byte aligned offset."""
    sizes = [(t.numel() * t.element_size() + HEADER - 1) // HEADER * HEADER for t in like]
    buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=like[0].device)
    slots, offset = [], 0
    for t, size in zip(like, sizes):
        slots.append(buffer[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
        offset += size
    return buffer, slots


def _exchange_headers(header: torch.Tensor, pg: Link) -> tuple[torch.Tensor, list[dist.Work]]:
    """Send this rank's 16-byte ``header`` to every peer and receive theirs, ahead of the data.

    Returns ``(world, HEADER)`` bytes (row ``q``: rank ``q``'s header, once done) and the works.
    Posted before any data, the headers are the first messages each peer gets from this
    exchange: they can be checked before waiting for data that may never match.
    """
    me, world = pg.rank(), pg.size()
    headers = torch.empty(world, HEADER, dtype=torch.uint8)
    own = headers[me]
    own.copy_(header)  # sent from here: the caller may rewrite ``header`` once this returns
    works: list[dist.Work] = []
    for peer in range(world):
        if peer != me:
            _post(pg, [(own, TAG)], [(headers[peer], TAG)], peer, works)
    return headers, works


class ExchangeReduceScatter(NamedTuple):
    """A reduce-scatter by exchange: what was sent, what arrives, and this rank's own chunks."""

    header_exchange: Exchange  # the headers' messages, first from every peer: check before the rest
    exchange: Exchange | ReadExchange  # the data: messages, or reads of the peers' memory
    headers: torch.Tensor  # (world, HEADER) bytes: what every rank says it reduces
    header: torch.Tensor
    rank: int
    offsets: tuple[int, ...]  # of each gradient's chunk in this rank's flat result
    received: tuple[torch.Tensor | None, ...]  # per group rank: its chunks (flat), None for this rank
    own: tuple[torch.Tensor, ...]  # this rank's chunk of each gradient (``local_shape``)
    sent: tuple[torch.Tensor, ...]  # the full gradients (or their cast/padded copies) being read
    copies: tuple[torch.Tensor, ...]  # copies fsdp2 made to send (cast, padded, contiguous chunks)

    def reduced(self) -> torch.Tensor:
        """Wait, then sum every rank's chunks in rank order; returns the flat sum (``offsets``)."""
        offsets = self.offsets
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
        extra = self.exchange.descriptors if isinstance(self.exchange, ReadExchange) else []
        return [self.headers, self.header, *(row for row in self.received if row is not None), *self.copies,
                *extra]


def start_reduce_scatter(
    chunks: Sequence[torch.Tensor], sent: Sequence[torch.Tensor], copies: Sequence[torch.Tensor],
    dtype: torch.dtype, header: torch.Tensor, pg: dist.ProcessGroup, key: str, read: bool = False,
    into: torch.Tensor | None = None,
) -> ExchangeReduceScatter:
    """Send chunk ``q`` of every gradient to rank ``q``; receive this rank's chunk from every peer.

    This rank's result is one flat row: the small chunks first, packed (they travel as one
    message per peer), then the others in order; ``offsets`` says where each one is.

    Args:
        chunks: each full gradient (in ``dtype``, padded) viewed as ``(world, *local_shape)``.
        sent: the tensors ``chunks`` view, held until the exchange is done.
        copies: the copies among them fsdp2 made (communication memory).
        header: 16 bytes saying what this rank reduces, sent ahead of the data.
        key: names this exchange the same on every rank (group and dtype): its messages' tags.
        read: each peer reads its chunks out of this process (``_cma.py``), no messages.
        into: ``(world, total)``, where each peer's row is received (row ``q`` from rank ``q``;
            a quantized reduction's packed rows, summed by the caller); None: rows of their own.
    """
    pids = _cma.pids(pg) if read else ()
    if read:  # its messages on the group's pipes, where the ranks connected them (``_pipes.py``)
        pg = _pipes.link(pg)
    me, world = pg.rank(), pg.size()
    device = chunks[0].device if chunks else torch.device("cpu")
    sizes = [c[me].numel() for c in chunks]
    small = [i for i, c in enumerate(chunks) if _is_small(c[me])]
    big = [i for i, c in enumerate(chunks) if not _is_small(c[me])]
    offsets, total = [0] * len(chunks), 0
    for i in small + big:
        offsets[i], total = total, total + sizes[i]
    packed_total = sum(sizes[i] for i in small)
    headers, header_works = _exchange_headers(header, pg)
    received: list[torch.Tensor | None] = [None] * world
    works: list[dist.Work] = []
    made = list(copies)
    if read:
        reads = _read_reduce_scatter(chunks, made, offsets, sizes, total, dtype, device, received, pg, key, pids,
                                     into)
        reads.with_headers(header, headers, header_works)
        return ExchangeReduceScatter(Exchange(header_works), reads, headers, header, me, tuple(offsets),
                                     tuple(received), tuple(c[me] for c in chunks), tuple(sent), tuple(made))
    for peer in range(world):
        if peer == me:
            continue
        row = into[peer] if into is not None else torch.empty(total, dtype=dtype, device=device)
        received[peer] = row
        outgoing, places = [], []
        if small:
            pack = torch.empty(packed_total, dtype=dtype, device=device)
            with torch.no_grad():
                slots = [pack[offsets[i]:offsets[i] + sizes[i]].view(chunks[i][peer].shape) for i in small]
                torch._foreach_copy_(slots, [chunks[i][peer] for i in small])
            made.append(pack)
            tag = _tag(key, ",".join(map(str, small)), pack)
            outgoing.append((pack, tag))
            places.append((row[:packed_total], tag))
        for i in big:
            chunk = chunks[i][peer]
            if not chunk.is_contiguous():
                chunk = chunk.contiguous()
                made.append(chunk)
            outgoing.append((chunk, _tag(key, str(i), chunk)))
            places.append((row[offsets[i]:offsets[i] + sizes[i]], _tag(key, str(i), chunk)))
        _post(pg, outgoing, places, peer, works)
    return ExchangeReduceScatter(Exchange(header_works), Exchange(works), headers, header, me, tuple(offsets),
                                 tuple(received), tuple(c[me] for c in chunks), tuple(sent), tuple(made))


def _read_reduce_scatter(chunks: Sequence[torch.Tensor], made: list[torch.Tensor], offsets: Sequence[int],
                         sizes: Sequence[int], total: int, dtype: torch.dtype, device: torch.device,
                         received: list[torch.Tensor | None], pg: Link, key: str,
                         pids: Sequence[int] = (), into: torch.Tensor | None = None) -> ReadExchange:
    """The reduce-scatter by reading: each peer reads its chunk of every gradient from here.

    Fills ``received`` with one row per peer (``into``'s where given; read into at ``wait()``) and ``made`` with
    the contiguous copies of chunks that are not contiguous where they are.
    """
    me, world = pg.rank(), pg.size()
    n = len(chunks)
    descriptor_bytes = 8 * (1 + 2 * n)  # int64: pid, then address and size per chunk
    where = _tag_of_size(key, "where", descriptor_bytes)
    reads = ReadExchange(pg, key, _tag_of_size(key, "ack", descriptor_bytes), pids=pids)
    for peer in range(world):
        if peer == me:
            continue
        row = into[peer] if into is not None else torch.empty(total, dtype=dtype, device=device)
        received[peer] = row
        offered = []
        for c in chunks:
            chunk = c[peer]
            if not chunk.is_contiguous():
                chunk = chunk.contiguous()
                made.append(chunk)
            offered.append(chunk)
        reads.expect(peer, 1 + 2 * n, where, [row[offsets[i]:offsets[i] + sizes[i]] for i in range(n)])
        reads.offer(peer, _cma.describe(offered), where, offered)
    return reads
