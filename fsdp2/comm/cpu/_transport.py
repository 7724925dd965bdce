"""The CPU transport behind the interface: exchanges by messages or by same-host reads.

A group's all-gather lands straight in its unsharded buffer and its reduce-scatter sends
from the gradients themselves (``_exchange.py``); ranks on one host read each other's
memory instead of messaging (``_cma.py``, probed once per process group) and move the
small messages over pipes (``_pipes.py``). At world size 1 there is nothing to exchange:
the flat transport's path does the (local) work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from ...diagnostics import _bytes, _debug
from ... import _compat
from ..._format import HEADER, GatherFormat, aligned
from .._collectives import (AllGatherInFlight, GatherTargets, QuantizedReduction, ReduceScatterInFlight, ReduceTarget,
                           check_reduce_headers, copy_rank_major, reduce_op, show_flat_all_gather,
                           show_flat_all_to_all, show_flat_reduce_scatter)
from .._quantize import dequantize_entries, quantize_entries
from .._streams import Completion
from .._flat import FlatTransport
from .._interface import CPU_COLLECTIVES_ENV, BufferNeeds, GatherSource, GroupBytes, Transport, cpu_transport
from . import _cma, _exchange, _pipes

if TYPE_CHECKING:
    from ..._format import Chunking

__all__ = ["ExchangeAllGatherInFlight", "ExchangeReduceScatterInFlight", "ExchangeTransport", "OwnBuffers",
           "exchange_transport", "own_buffers", "probe_reads"]


class ExchangeAllGatherInFlight(AllGatherInFlight):
    """An exchange all-gather in flight: the chunks land in the unsharded buffer itself, or
    (quantized weights) every rank's quantized slice in ``quantized``, rank-major as the flat
    all-gather's output, dequantized into the buffer at the finish; ``exchange``
    (``_exchange.ExchangeAllGather``) holds the rest. The headers arrive first; a read
    exchange's peers may read this rank's chunks after its own wait returned (``release``: its
    lease)."""

    __slots__ = ("exchange", "quantized", "_headers_done", "_release")

    def __init__(self, fmt: GatherFormat, transport: Transport, gather: _exchange.ExchangeAllGather,
                 quantized: torch.Tensor | None = None) -> None:
        super().__init__(Completion(work=gather.exchange), fmt, gather.headers, transport)
        self.exchange = gather
        self.quantized = quantized
        self._headers_done = Completion(work=gather.header_exchange)
        reads = gather.exchange
        self._release = reads.release if isinstance(reads, _exchange.ReadExchange) and reads.defer else None

    def headers_done(self) -> Completion | None:
        return self._headers_done

    def release(self) -> Any:
        return self._release

    def buffers(self) -> list[torch.Tensor]:
        return self.exchange.buffers() + ([self.quantized] if self.quantized is not None else [])


class ExchangeReduceScatterInFlight(ReduceScatterInFlight):
    """An exchange reduce-scatter in flight: ``exchange`` (``_exchange.ExchangeReduceScatter``)
    sums the chunks received at the end and holds the gradients it sends from. The ranks'
    headers arrive first and are compared before the data is waited for (data that does not
    match may never come)."""

    __slots__ = ("exchange",)

    def __init__(self, layouts: tuple[Chunking, ...], op: dist.ReduceOp, post_divide: float | None,
                 target: ReduceTarget, rs: _exchange.ExchangeReduceScatter,
                 offsets: tuple[int, ...] | None = None) -> None:
        offsets = rs.offsets if offsets is None else offsets
        super().__init__(Completion(work=rs.exchange), layouts, offsets, op, post_divide, target)
        self.exchange = rs

    def wait(self, sizes: str) -> torch.Tensor:
        target, sizes = self.target, sizes + self._kind()
        _debug.wait(self.exchange.header_exchange, "reduce_scatter", target.label, sizes, target.root)
        check_reduce_headers(target, self.exchange.headers)
        _debug.wait(self.done, "reduce_scatter", target.label, sizes, target.root)
        return self._result()

    def _kind(self) -> str:
        """What errors add to the sizes to name the collective (nothing: a plain reduce-scatter)."""
        return ""

    def _result(self) -> torch.Tensor:
        return self.exchange.reduced()

    def buffers(self) -> list[torch.Tensor]:
        return self.exchange.buffers()


class ExchangeQuantizedReduceScatterInFlight(ExchangeReduceScatterInFlight):
    """A quantized reduce-scatter by exchange (``QuantizedComm(gradients=...)``): each peer's
    packed row for this rank arrives in its row of ``recv`` (this rank's own copied in), which
    ``plan`` dequantizes and sums as the flat transport's all-to-all does."""

    __slots__ = ("plan", "recv", "dtype")

    def __init__(self, layouts: tuple[Chunking, ...], target: ReduceTarget, rs: _exchange.ExchangeReduceScatter,
                 plan: QuantizedReduction, recv: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__(layouts, plan.op, plan.post_divide, target, rs, offsets=plan.offsets)
        self.plan, self.recv, self.dtype = plan, recv, dtype

    def _kind(self) -> str:
        return f" (int{self.plan.chunks.bits} all-to-all)"  # as the flat transport's names it

    def _result(self) -> torch.Tensor:
        return self.plan.summed(self.recv, self.dtype)

    def buffers(self) -> list[torch.Tensor]:
        return [*self.exchange.buffers(), self.recv]


class ExchangeTransport(Transport):
    """Point-to-point exchanges between a group's ranks (CPU, gloo).

    ``may_read``: read the peers' memory where the ranks of a process group allow it (found
    out by :meth:`probe`); ``must_read``: a "no" is an error (``FSDP2_CPU_COLLECTIVES=read``).
    ``grad_block``: the gradients reduced quantized (``grad_bits``-bit values and an fp32 scale
    per ``grad_block`` elements; ``_collectives.QuantizedReduction``). A quantized all-gather
    format (``fmt.block``) sends the weights quantized.
    """

    gathers_in_place = True
    reduce_headers = True

    def __init__(self, may_read: bool, must_read: bool, grad_block: int = 0, grad_bits: int = 8) -> None:
        self.may_read, self.must_read = may_read, must_read
        self.grad_block, self.grad_bits = grad_block, grad_bits
        self.name = "read" if may_read else "exchange"
        self._local = FlatTransport()  # world size 1: no peers, the local copy the flat path makes

    def probe(self, pg: dist.ProcessGroup) -> None:
        """Find out (once per process group, collectively) whether its ranks can read each other."""
        if self.may_read and pg.size() > 1:
            with _compat.outside_dispatch_modes():  # bookkeeping, not FSDP's collectives (CommDebugMode)
                probe_reads(pg, self.must_read)

    def reads(self, pg: dist.ProcessGroup) -> bool:
        """Whether the exchanges over ``pg`` read the peers' memory (once probed)."""
        return self.may_read and _cma.usable(pg)

    def start_all_gather(self, source: GatherSource, fmt: GatherFormat, pg: dist.ProcessGroup,
                         header: torch.Tensor | None, explicit: bool) -> AllGatherInFlight:
        """Straight into the unsharded buffer: this rank's entries are copied into their own
        chunks and sent from there (never aliasing the shards), the peers' received in place.
        Quantized (``fmt.block``): this rank's entries quantized into its row of a rank-major
        buffer of slices (``_quantize.quantize_entries``, the flat transport's slice), which is
        sent, the peers' rows received, all dequantized at the finish.
        A dispatch mode sees the flat all-gather this stands for (``show_flat_all_gather``)."""
        show_flat_all_gather(fmt, pg)
        if _bytes._ACTIVE and fmt.world > 1:  # counted as the flat all-gather it stands for
            _bytes.count("all_gather", fmt.slice_bytes, pg)
        if header is None:
            header = torch.zeros(HEADER, dtype=torch.uint8)
        key, read = f"all_gather {source.label} {fmt.world}", self.reads(pg)
        if fmt.block:  # the header travels on its own: the slices' bytes after it
            quantized = torch.empty(fmt.world, fmt.slice_bytes, dtype=torch.uint8, device=source.device)
            with torch.no_grad():
                quantize_entries(fmt, source.entries(fmt), quantized[pg.rank()])
            gather = _exchange.start_all_gather(None, [quantized[:, HEADER:]], header.view(torch.uint8), pg,
                                                key=key, read=read)
            return ExchangeAllGatherInFlight(fmt, self, gather, quantized)
        chunks = source.targets(fmt).chunks  # the unsharded buffer, allocated now
        gather = _exchange.start_all_gather(source.entries(fmt), chunks, header.view(torch.uint8), pg, key=key,
                                            read=read)
        return ExchangeAllGatherInFlight(fmt, self, gather)

    def finish_all_gather(self, inflight: ExchangeAllGatherInFlight, targets: GatherTargets) -> None:
        inflight.exchange.finish()
        if inflight.quantized is not None:
            with torch.no_grad():
                dequantize_entries(inflight.fmt, inflight.quantized, targets.chunks)

    def start_reduce_scatter(self, layouts: Sequence[Chunking], grads: list[torch.Tensor], dtype: torch.dtype,
                             target: ReduceTarget, device: torch.device,
                             header: torch.Tensor | None,
                             residuals: Sequence[torch.Tensor] | None = None) -> ReduceScatterInFlight:
        """Send each gradient's chunks from where they are: copies only to cast, pad or pre-divide.
        Quantized (``grad_block``): the packed rows instead (:meth:`_start_quantized`)."""
        world = target.world
        if world == 1:
            return self._local.start_reduce_scatter(layouts, grads, dtype, target, device, header)
        if header is None:
            header = torch.zeros(HEADER, dtype=torch.uint8)
        if self.grad_block:
            return self._start_quantized(layouts, grads, dtype, target, device, header, residuals)
        op, pre, post = reduce_op(dtype, world * target.replicate_world, target.divide_factor, target.force_sum)
        numel = sum(lay.local_numel for lay in layouts)
        if _debug.enabled():  # no string built per step otherwise
            _debug.log_collective("reduce_scatter", target.label, target.group, f"{world} x {numel} elements", dtype,
                                  target.root)
        show_flat_reduce_scatter(numel, world, dtype, op, target.group)  # what a dispatch mode sees
        if _bytes._ACTIVE:
            _bytes.count("reduce_scatter", numel * dtype.itemsize, target.group)
        full, copies = _sendable(layouts, grads, dtype, world, pre)
        if op == dist.ReduceOp.AVG:  # the exchange sums; the average over this axis is a division
            post = float(world) * (post or 1.0)
        chunks = [lay.chunks_view(t) for lay, t in zip(layouts, full)]
        rs = _exchange.start_reduce_scatter(chunks, full, copies, dtype, header, target.group,
                                            key=f"reduce_scatter {target.label} {dtype}", read=self.reads(target.group))
        return ExchangeReduceScatterInFlight(tuple(layouts), op, post, target, rs)

    def _start_quantized(self, layouts: Sequence[Chunking], grads: list[torch.Tensor], dtype: torch.dtype,
                         target: ReduceTarget, device: torch.device, header: torch.Tensor,
                         residuals: Sequence[torch.Tensor] | None) -> ReduceScatterInFlight:
        """The flat transport's quantized reduction (the same rows, quantized the same way), its
        all-to-all an exchange: packed row ``q`` to rank ``q`` as one chunk of bytes, each peer's
        row for this rank received into its row of ``recv``."""
        world, group = target.world, target.group
        plan = QuantizedReduction.plan(layouts, dtype, target, self.grad_block, self.grad_bits)
        show_flat_all_to_all(world * plan.chunks.chunk_bytes, group)  # what a dispatch mode sees
        staged = torch.empty((world, plan.chunks.numel), dtype=dtype, device=device)
        copy_rank_major(staged, layouts, grads, plan.offsets)
        grads.clear()  # the caller's list: the gradients are freed before the rows are sent
        send = torch.empty(world, plan.chunks.chunk_bytes, dtype=torch.uint8, device=device)
        plan.quantize(staged, send, residuals)
        del staged
        recv = torch.empty_like(send)
        me = group.rank()
        recv[me].copy_(send[me])
        rs = _exchange.start_reduce_scatter([send], [send], [send], torch.uint8, header, group,
                                            key=f"reduce_scatter {target.label} {dtype} int{self.grad_bits}",
                                            read=self.reads(group), into=recv)
        return ExchangeQuantizedReduceScatterInFlight(tuple(layouts), target, rs, plan, recv, dtype)

    def quantizing_gradients(self, block: int, bits: int) -> Transport:
        return ExchangeTransport(self.may_read, self.must_read, block, bits)

    def reduce_scatters_in_flight(self, world: int) -> int:
        """Two: each exchange waits for the peers to reach the same group's reduction; one more
        in flight absorbs their skew (faster steps, docs/performance.md "What bounds it here")
        for one more group's gradients alive. One at world size 1."""
        return 2 if world > 1 else 1

    def buffer_needs(self, sizes: GroupBytes, world: int, backend: str, reads: bool) -> BufferNeeds:
        """The all-gather lands in the unsharded buffer: only the headers and (messages) the
        small chunks packed per peer, or (reads) a descriptor and an acknowledgement per peer,
        kept until the peers have read. The reduce-scatter sends from the gradients (copies
        only to cast or pad) and receives one 1/world row per peer."""
        reads = reads and self.may_read and world > 1
        own = own_buffers([g for g, _, _ in sizes.entries], [full // world for _, full, _ in sizes.entries], world,
                          reads)
        gather = own.header + own.gather
        if world == 1:
            local = self._local.buffer_needs(sizes, world, backend, reads)
            return BufferNeeds(gather, False, local.reduce_sent, local.reduce_received, False)
        out = sizes.reduce // world
        copies = sum(full for _, full, copied in sizes.entries if copied)
        holds = copies < sizes.reduce
        return BufferNeeds(gather, reads, copies + own.reduce_packed, (world - 1) * out + own.header + own.reduce,
                           holds, reduce_copies_in=False)

    def quantized_buffer_needs(self, slice_bytes: int, row_bytes: int, world: int, backend: str,
                               reads: bool) -> BufferNeeds:
        """The exchanges' own buffers for the quantized collectives: one chunk of
        ``slice_bytes - HEADER`` per rank gathered (the slices' bytes after their header room),
        one packed row of ``row_bytes`` to each peer reduced; this rank's reduce header not
        included (``reduce_headers``: made before the gradients are staged)."""
        reads = reads and self.may_read and world > 1
        own = own_buffers([slice_bytes - HEADER] if slice_bytes else [], [row_bytes] if row_bytes else [], world,
                          reads)
        return BufferNeeds(own.header + own.gather, reads, own.reduce_packed, own.reduce, False,
                           reduce_copies_in=False)

    def __repr__(self) -> str:
        block = f", grad_block={self.grad_block}" if self.grad_block else ""
        block += f", grad_bits={self.grad_bits}" if self.grad_block and self.grad_bits != 8 else ""
        return f"ExchangeTransport(may_read={self.may_read}, must_read={self.must_read}{block})"


class OwnBuffers(NamedTuple):
    """The exchanges' small buffers on a rank, besides the data they move (``own_buffers``)."""

    header: int
    """This rank's schedule header, sent to every peer."""
    gather: int
    """The all-gather's: every rank's header, and the small chunks packed (sent, and one
    received per peer) or (reads) a descriptor per rank and an acknowledgement per rank."""
    reduce_packed: int
    """The reduce-scatter's small chunks packed, one message per peer (messages only)."""
    reduce: int
    """The reduce-scatter's: every rank's header and (reads) per peer a descriptor sent, one
    received and an acknowledgement, and one acknowledgement to send."""


def own_buffers(gathered: Sequence[int], rows: Sequence[int], world: int, reads: bool) -> OwnBuffers:
    """What ``_exchange.py`` allocates for itself to all-gather chunks of ``gathered`` bytes
    (this rank's of each tensor) and to reduce-scatter rows of ``rows`` bytes (each tensor's
    chunk for one peer) over ``world`` ranks; ``reads``: the peers' memory read (``_cma.py``).
    The memory planner's count (``buffer_needs``, ``quantized_buffer_needs``): change it with
    ``_exchange.py``."""
    headers = world * HEADER
    if reads:
        def descriptor(n: int) -> int:
            return 8 * (1 + 2 * n)  # _cma.describe: pid, then address and size per tensor

        return OwnBuffers(HEADER, headers + world * descriptor(len(gathered)) + world, 0,
                          headers + (world - 1) * (2 * descriptor(len(rows)) + 1) + 1)
    small_gathered = sum(aligned(g) for g in gathered if g < _exchange.SMALL)
    small_rows = sum(r for r in rows if r < _exchange.SMALL)
    return OwnBuffers(HEADER, headers + (world * small_gathered if world > 1 else 0), (world - 1) * small_rows,
                      headers)


def probe_reads(pg: dist.ProcessGroup, must_read: bool | None = None) -> bool:
    """Whether the ranks of ``pg`` can read each other's memory: found out once, collectively
    (``_cma.probe``); where they can, their small messages go over pipes (``_pipes.py``) too.
    ``must_read`` (default: ``FSDP2_CPU_COLLECTIVES=read``) makes a "no" an error, not messages."""
    if _cma.probe(pg):
        _pipes.connect(pg)
        return True
    if must_read if must_read is not None else cpu_transport() == "read":
        raise RuntimeError(
            f"{CPU_COLLECTIVES_ENV}=read: the ranks {dist.get_process_group_ranks(pg)} cannot read each "
            "other's memory with process_vm_readv (different hosts or PID namespaces, ptrace "
            "restrictions, or a seccomp filter); use 'auto' to fall back to messages"
        )
    return False


def _sendable(layouts: Sequence[Chunking], grads: Sequence[torch.Tensor], dtype: torch.dtype, world: int,
              pre: float | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients as the exchange sends them (contiguous, ``dtype``, padded, pre-divided),
    and which of them are copies made here."""
    predivide = pre is not None and pre != 1
    full, copies = [], []
    with torch.no_grad():
        for lay, grad in zip(layouts, grads):
            even = lay.shape[lay.dim] == lay.chunk * world
            if grad.dtype == dtype and grad.is_contiguous() and even and not predivide:
                full.append(grad)
                continue
            if even:
                copy = grad.to(dtype, memory_format=torch.contiguous_format, copy=True)
            else:
                copy = torch.zeros(lay.padded_shape, dtype=dtype, device=grad.device)
                copy.narrow(lay.dim, 0, lay.shape[lay.dim]).copy_(grad)
            full.append(copy)
            copies.append(copy)
        if predivide:
            torch._foreach_div_(full, pre)
    return full, copies


def exchange_transport(may_read: bool, must_read: bool) -> ExchangeTransport:
    """The CPU exchange (messages; and same-host reads where ``may_read``)."""
    return ExchangeTransport(may_read, must_read)
