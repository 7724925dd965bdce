"""The flat transport: one ``all_gather_into_tensor`` and one ``reduce_scatter_tensor`` per collective.

The path NCCL takes (and gloo's, for small CPU groups or ``FSDP2_CPU_COLLECTIVES=flat``).
All-gather: every rank's slice (header, then each entry at its 16-byte aligned offset)
into a rank-major output, then one copy-out into the parameter-major unsharded buffer.
Reduce-scatter: the full gradients copied into a rank-major buffer (chunk ``r`` of every
parameter in rank ``r``'s row), reduced into this rank's row. The collectives are
replaceable objects (``_comm.py``, torch's interface) and run on side streams
(``_streams.py``).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist

from .. import _compat
from ..diagnostics import _bytes, _debug
from .._format import HEADER, GatherFormat, packed_offsets
from ._collectives import (AllGatherInFlight, GatherTargets, QuantizedReduction, ReduceScatterInFlight, ReduceTarget,
                           copy_rank_major, reduce_op)
from ._quantize import dequantize_entries, quantize_entries
from ._comm import DEFAULT_ALL_GATHER, DEFAULT_REDUCE_SCATTER, AllGather, ReduceScatter
from ._streams import Completion, streams_for
from ._interface import BufferNeeds, GatherSource, GroupBytes, Transport

if TYPE_CHECKING:
    from .._format import Chunking

__all__ = ["FlatAllGather", "FlatReduceScatter", "QuantizedReduceScatter", "FlatTransport", "send_aliases_shards"]


class FlatAllGather(AllGatherInFlight):
    """A flat all-gather in flight: ``output`` receives every rank's ``send`` slice (rank-major),
    copied out into the unsharded buffer at the end; ``kept``: the transport's ``KeptOutput``
    that ``output`` is, if it is one."""

    __slots__ = ("send", "output", "kept")

    def __init__(self, done: Completion, fmt: GatherFormat, headers: torch.Tensor | None, transport: Transport,
                 send: torch.Tensor, output: torch.Tensor, kept: KeptOutput | None = None) -> None:
        super().__init__(done, fmt, headers, transport)
        self.send = send
        self.output = output
        self.kept = kept

    def buffers(self) -> list[torch.Tensor]:
        return [self.send, self.output]


class FlatReduceScatter(ReduceScatterInFlight):
    """A flat reduce-scatter in flight: ``output`` is this rank's reduced row once ``done``;
    ``held`` keeps the send buffer and, on CUDA, the unsharded gradients copied into it (the
    copy runs on the reduce-scatter stream while the compute stream could otherwise reuse
    their memory)."""

    __slots__ = ("output", "held")

    def __init__(self, done: Completion, layouts: tuple[Chunking, ...], offsets: tuple[int, ...], op: dist.ReduceOp,
                 post_divide: float | None, target: ReduceTarget, output: torch.Tensor,
                 held: tuple[torch.Tensor, ...]) -> None:
        super().__init__(done, layouts, offsets, op, post_divide, target)
        self.output = output
        self.held = held

    def wait(self, sizes: str) -> torch.Tensor:
        target = self.target
        _debug.wait(self.done, "reduce_scatter", target.label, sizes, target.root)
        return self.output

    def buffers(self) -> list[torch.Tensor]:
        return [self.held[0], self.output]


class QuantizedReduceScatter(ReduceScatterInFlight):
    """A quantized reduce-scatter in flight (``QuantizedComm(gradients="int8")``): ``recv``
    receives every rank's packed chunk for this rank (``plan``, ``_collectives.QuantizedReduction``);
    dequantized and summed into ``output``, this rank's reduced row, at issue time on CUDA (on
    the side stream, after the all-to-all) or at the wait on CPU (after gloo's thread received it)."""

    __slots__ = ("plan", "recv", "output", "dtype", "held")

    def __init__(self, done: Completion, layouts: tuple[Chunking, ...], target: ReduceTarget,
                 plan: QuantizedReduction, recv: torch.Tensor, dtype: torch.dtype, output: torch.Tensor | None,
                 held: tuple[torch.Tensor, ...]) -> None:
        super().__init__(done, layouts, plan.offsets, plan.op, plan.post_divide, target)
        self.plan, self.recv, self.dtype = plan, recv, dtype
        self.output = output
        self.held = held

    def wait(self, sizes: str) -> torch.Tensor:
        target = self.target
        kind = f" (int{self.plan.chunks.bits} all-to-all)"
        _debug.wait(self.done, "reduce_scatter", target.label, sizes + kind, target.root)
        if self.output is None:  # CPU: the bytes are here now
            self.output = self.plan.summed(self.recv, self.dtype)
        return self.output

    def buffers(self) -> list[torch.Tensor]:
        return [*self.held, self.recv] + ([self.output] if self.output is not None else [])


class KeptOutput:
    """A flat all-gather's output in CPU memory, kept by its transport from one all-gather to the
    next: one tensor whose storage is allocated at each issue and freed after the copy-out (where
    a new tensor's would be), so that what every all-gather reads from it, the ranks' headers and
    the copy-out's pieces, is viewed once instead of at each call, and the copy-out copies the
    entries alone, not their alignment padding. Not used on accelerators, with a custom
    all-gather (its ``allocate`` is called every time), for quantized formats or under a dispatch
    mode (which sees each output made as before)."""

    __slots__ = ("tensor", "headers", "busy", "_slice_bytes", "_pieces")

    def __init__(self, fmt: GatherFormat, device: torch.device) -> None:
        self._slice_bytes = fmt.slice_bytes
        with torch.inference_mode(False):  # written by later all-gathers outside inference mode too
            self.tensor = torch.empty(fmt.world * fmt.slice_bytes, dtype=torch.uint8, device=device)
            self.headers = self.tensor.as_strided((fmt.world, HEADER), (fmt.slice_bytes, 1), 0)
        self.busy = True  # allocated and in use by an all-gather not yet copied out
        self._pieces: tuple[GatherTargets, list[torch.Tensor], list[torch.Tensor]] | None = None

    def take(self) -> torch.Tensor:
        storage = self.tensor.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.tensor.numel())
        self.busy = True
        return self.tensor

    def copy_out(self, targets: GatherTargets, split: tuple[list[int], list[torch.Tensor]]) -> None:
        """``targets.split``'s copy, less its padding columns: a foreach copy of views made once
        per targets (the first ``targets.ranks`` rows of each entry's bytes, to their places)."""
        pieces = self._pieces
        if pieces is None or pieces[0] is not targets:
            size = self._slice_bytes
            with torch.inference_mode(False):  # (as ``tensor``)
                rows = self.tensor.as_strided((targets.ranks, size - HEADER), (size, 1), HEADER)
                sources = [piece for piece, data in zip(rows.split(split[0], dim=1), targets.split_is_data) if data]
            places = [place for place, data in zip(split[1], targets.split_is_data) if data]
            pieces = self._pieces = (targets, places, sources)
        torch._foreach_copy_(pieces[1], pieces[2])

    def release(self) -> None:
        self.tensor.untyped_storage().resize_(0)
        self.busy = False


class FlatTransport(Transport):
    """The flat collectives, run by ``all_gather`` / ``reduce_scatter`` (``_comm.py``); with
    ``grad_block``, the gradients are reduced quantized (``grad_bits``-bit values, int8 or two
    int4 per byte, and an fp32 scale per ``grad_block`` elements, one all-to-all, summed on the
    receiving rank)."""

    name = "flat"

    def __init__(self, all_gather: AllGather | None = None, reduce_scatter: ReduceScatter | None = None,
                 grad_block: int = 0, grad_bits: int = 8) -> None:
        self.all_gather = all_gather or DEFAULT_ALL_GATHER
        self.reduce_scatter = reduce_scatter or DEFAULT_REDUCE_SCATTER
        self.grad_block = grad_block
        self.grad_bits = grad_bits
        self._kept: dict[tuple[int, int], KeptOutput] = {}  # (world, slice bytes) -> the CPU output kept

    def start_all_gather(self, source: GatherSource, fmt: GatherFormat, pg: dist.ProcessGroup,
                         header: torch.Tensor | None, explicit: bool) -> AllGatherInFlight:
        send, copied = _send_slice(source, fmt, explicit) if not fmt.block else _quantized_slice(source, fmt)
        if explicit and copied is not None:  # CUDA: later work on the compute stream waits for the copy
            copied.wait()
        room = source.header_room(send) if header is not None and _compat.dispatch_modes_active() else None
        return _start_all_gather(self, send, fmt, pg, source.device, copied, header, room)

    def finish_all_gather(self, inflight: AllGatherInFlight, targets: GatherTargets) -> None:
        _copy_out(inflight, targets)
        if inflight.kept is not None:
            inflight.kept.release()

    def _output(self, fmt: GatherFormat, device: torch.device) -> tuple[torch.Tensor, KeptOutput | None]:
        """An all-gather's output: the kept one where it may be used and is free (``KeptOutput``),
        else one allocated now by the all-gather's ``allocate``."""
        if device.type == "cpu" and self.all_gather is DEFAULT_ALL_GATHER and not fmt.block \
                and not _compat.dispatch_modes_active():
            key = (fmt.world, fmt.slice_bytes)
            kept = self._kept.get(key)
            if kept is None:
                kept = self._kept[key] = KeptOutput(fmt, device)
                return kept.tensor, kept
            if not kept.busy:
                return kept.take(), kept
        output = self.all_gather.allocate((fmt.world * fmt.slice_bytes,), dtype=torch.uint8, device=device)
        return output, None

    def start_reduce_scatter(self, layouts: Sequence[Chunking], grads: list[torch.Tensor], dtype: torch.dtype,
                             target: ReduceTarget, device: torch.device,
                             header: torch.Tensor | None,
                             residuals: Sequence[torch.Tensor] | None = None) -> ReduceScatterInFlight:
        if self.grad_block and target.world > 1:
            return _start_quantized_reduce_scatter(self.reduce_scatter, self.grad_block, layouts, grads, dtype,
                                                   target, device, residuals, self.grad_bits)
        return _start_reduce_scatter(self.reduce_scatter, layouts, grads, dtype, target, device)

    def buffer_needs(self, sizes: GroupBytes, world: int, backend: str, reads: bool) -> BufferNeeds:
        """A send slice (none where the shards are packed) and a rank-major output of ``world``
        slices, each led by its header; for the reduce-scatter a full-size send buffer and a
        1/world output (on gloo, which copies the input again, one more full size)."""
        slice_bytes = HEADER + sizes.slice
        if world == 1:  # no collective: the (copied-in) send buffer is the output
            gather = slice_bytes
        else:
            gather = (0 if sizes.packed else slice_bytes) + world * slice_bytes
        out = sizes.reduce // world if world > 1 else 0
        if self.grad_block and world > 1:
            # Quantized: the rank-major copy (fp32 here, about twice bf16's) and the packed
            # int8 rows sent (int4: half that); received, about a quarter (an eighth) of the
            # fp32 size plus the fp32 sum.
            packed = (sizes.reduce // 2 if self.grad_bits == 8 else sizes.reduce // 4) + 1
            return BufferNeeds(gather, False, 2 * sizes.reduce + packed, packed // world + 2 * out, False)
        gloo_copy = sizes.reduce if backend == "gloo" and world > 1 else 0
        return BufferNeeds(gather, False, sizes.reduce, out, False, reduce_input_copy=gloo_copy)

    def with_comms(self, all_gather: AllGather, reduce_scatter: ReduceScatter) -> Transport:
        return FlatTransport(all_gather, reduce_scatter, self.grad_block, self.grad_bits)

    def quantizing_gradients(self, block: int, bits: int) -> Transport:
        return FlatTransport(self.all_gather, self.reduce_scatter, block, bits)

    def __repr__(self) -> str:
        block = f", grad_block={self.grad_block}" if self.grad_block else ""
        block += f", grad_bits={self.grad_bits}" if self.grad_block and self.grad_bits != 8 else ""
        return f"FlatTransport({self.all_gather!r}, {self.reduce_scatter!r}{block})"


def send_aliases_shards(device: torch.device, explicit: bool) -> bool:
    """Whether a flat all-gather may send the packed shards themselves instead of a copy.

    The collective reads its input after ``unshard`` returned: on CPU on gloo's thread, on
    CUDA on the all-gather stream. Whatever writes the sharded parameters in that window
    (``optimizer.step()`` between ``unshard(async_op=True)`` and the wait) races with it.

    * CPU, unshards the schedule issues (forward, prefetch, backward): only module code runs
      before the wait, which reads parameters but does not write another group's shards, so
      the shards are sent as they are (no copy-in).
    * CPU, the user's ``FSDPModule.unshard(async_op=True)`` (``explicit``): any code may run
      before the wait: a copy, made synchronously at issue time.
    * Accelerators (NCCL): always a copy, on the copy-in stream, so the collective never
      reads memory the compute stream may write (an explicit unshard also makes the
      compute stream wait for that copy before anything later runs on it).

    The exchange transport (CPU) copies the shards into the unsharded buffer at issue time
    and sends from there: it never aliases them either way.
    """
    return device.type in ("cpu", "meta") and not explicit  # (meta: the memory planner's CPU run)


def _send_slice(source: GatherSource, fmt: GatherFormat, explicit: bool) -> tuple[torch.Tensor, Completion | None]:
    """This rank's slice of the flat all-gather and the copy that filled it (None: no copy).

    The source's laid-out slice itself where nothing can write it before the collective has
    read it (only the group writes it, or ``send_aliases_shards``), else a copy made at issue
    time: of the laid-out slice in one op, or of each entry.
    """
    laid_out, private = source.laid_out(fmt)
    if laid_out is not None and (private or send_aliases_shards(source.device, explicit)):
        return laid_out, None
    streams = streams_for(source.device)
    with streams.side("copy_in"):
        send = torch.empty(fmt.slice_bytes, dtype=torch.uint8, device=source.device)
        with torch.no_grad():
            # One copy (the header is stamped apart); under a dispatch mode one per entry, from
            # the shards' own storages: a memory tracker that registers each op's output then
            # never sees the packed buffer beside its aliases (each byte counted once).
            if laid_out is not None and not _compat.dispatch_modes_active():
                send[HEADER:].copy_(laid_out[HEADER:], non_blocking=True)
            else:
                torch._foreach_copy_(fmt.slots(send), source.entries(fmt), non_blocking=True)
        copied = streams.issued(None)
    return send, copied


def _quantized_slice(source: GatherSource, fmt: GatherFormat) -> tuple[torch.Tensor, Completion | None]:
    """This rank's slice of a quantized all-gather (``_quantize.py``), written at issue time:
    always a new buffer (the shards are full precision, the slice is not)."""
    streams = streams_for(source.device)
    with streams.side("copy_in"):
        send = torch.empty(fmt.slice_bytes, dtype=torch.uint8, device=source.device)
        with torch.no_grad():
            quantize_entries(fmt, source.entries(fmt), send)
        copied = streams.issued(None)
    return send, copied


def _start_all_gather(
    transport: FlatTransport, send: torch.Tensor, fmt: GatherFormat, group: dist.ProcessGroup, device: torch.device,
    copied: Completion | None, header: torch.Tensor | None, room: torch.Tensor | None = None,
) -> AllGatherInFlight:
    """Issue the flat all-gather of ``send`` (after ``copied``, the copy-in that filled it, if any).

    ``header``, if given, is stamped into the first 16 bytes of ``send`` first (``room``: those
    bytes as the source gave them, ``GatherSource.header_room``). ``transport.all_gather``
    allocates the output and runs the collective (``_comm.py``).
    """
    streams = streams_for(device)
    if header is not None:
        _stamp(send, header, room)
    if fmt.world == 1:  # nothing to gather: the send buffer is the result
        return FlatAllGather(copied or Completion(), fmt, send[None, :HEADER], transport, send, send)
    if _bytes._ACTIVE:
        _bytes.count("all_gather", fmt.slice_bytes, group)
    with streams.side("all_gather"):
        streams.after(copied)
        output, kept = transport._output(fmt, device)
        work = transport.all_gather(output, send, group, async_op=True)
        done = streams.issued(work)
    # Read only where a header was sent (CPU, debug): the GPU path makes no views for them.
    if header is None:
        headers = None
    elif kept is not None:
        headers = kept.headers
    else:
        headers = output.as_strided((fmt.world, HEADER), (fmt.slice_bytes, 1), output.storage_offset())
    return FlatAllGather(done, fmt, headers, transport, send, output, kept)


def _stamp(send: torch.Tensor, header: torch.Tensor, room: torch.Tensor | None = None) -> None:
    """Write the 16-byte ``header`` at the start of ``send``. In CPU memory outside dispatch
    modes, a plain copy of the bytes (no tensor op: it would cost more than the 16 bytes);
    elsewhere ``copy_`` into ``room`` (those 16 bytes as the source gave them: the packed
    shards' header has a storage of its own, so a memory tracker that registers the op's output
    does not count the packed buffer again), so that what a dispatch mode (a memory tracker,
    the planner's meta run) or a device stream sees is unchanged."""
    if send.is_cpu and header.is_cpu and not _compat.dispatch_modes_active():
        ctypes.memmove(send.data_ptr(), header.data_ptr(), HEADER)
    else:
        (send[:HEADER] if room is None else room).copy_(header, non_blocking=True)


def _copy_out(inflight: FlatAllGather, targets: GatherTargets) -> None:
    """Scatter the rank-major gathered bytes into the parameter-major unsharded buffer.

    One op for the whole group: a ``split_with_sizes_copy`` of the output's byte columns
    (no view per parameter per step), else one foreach copy of per-entry views. Only the
    first ``targets.ranks`` slices: with more ranks than a group's tensors have rows, the
    other ranks send padding only, which nothing reads.
    """
    fmt = inflight.fmt
    if fmt.block:  # quantized: dequantized into the chunks
        with torch.no_grad():
            dequantize_entries(fmt, inflight.output, targets.chunks)
        return
    split = targets.split
    if split is not None and inflight.kept is not None:
        inflight.kept.copy_out(targets, split)
        return
    if split is not None:
        # No grad mode to set aside: neither the output nor the buffer's chunks require grad.
        output = inflight.output
        if output.device.type in ("cpu", "meta"):  # the first ``ranks`` slices after their headers
            rows = output.as_strided((targets.ranks, fmt.slice_bytes - HEADER), (fmt.slice_bytes, 1),
                                     output.storage_offset() + HEADER)
            torch.split_with_sizes_copy(rows, split[0], dim=1, out=split[1])
        else:
            dense_copy_out(output, fmt.slice_bytes, targets.ranks, split)
        return
    with torch.no_grad():
        torch._foreach_copy_(targets.copied_chunks, fmt.rank_major(inflight.output, targets.ranks))


_HEADER_SCRATCH: dict[torch.device, torch.Tensor] = {}


def dense_copy_out(output: torch.Tensor, slice_bytes: int, ranks: int,
                   split: tuple[list[int], list[torch.Tensor]]) -> None:
    """The flat copy-out of the first ``ranks`` slices of ``output`` as one dense
    ``split_with_sizes_copy``: whole slices, their headers included, the headers to a scratch
    nothing reads. torch's CUDA kernel fuses the copy only where its input and every output
    are dense; the rows after the headers are not (one kernel per entry then, not one per
    group). The scratch is one per device for every
    group, grown to the most ranks seen (``ranks`` x 16 bytes)."""
    device = output.device
    scratch = _HEADER_SCRATCH.get(device)
    if scratch is None or scratch.shape[0] < ranks:
        with torch.inference_mode(False):  # written outside inference mode too
            scratch = _HEADER_SCRATCH[device] = torch.empty(ranks, HEADER, dtype=torch.uint8, device=device)
    rows = output.as_strided((ranks, slice_bytes), (slice_bytes, 1), output.storage_offset())
    torch.split_with_sizes_copy(rows, [HEADER, *split[0]], dim=1, out=[scratch[:ranks], *split[1]])


def _start_reduce_scatter(
    comm: ReduceScatter, layouts: Sequence[Chunking], grads: list[torch.Tensor], dtype: torch.dtype,
    target: ReduceTarget, device: torch.device,
) -> ReduceScatterInFlight:
    """Copy the full gradients ``grads`` into a rank-major buffer and reduce-scatter it with ``comm``.

    ``grads`` is emptied once the gradients are copied in, so that, the caller holding no other
    reference, they are freed before the output is allocated.
    """
    world, group = target.world, target.group
    offs, total = packed_offsets([lay.local_numel for lay in layouts], align=False)
    op, pre, post = reduce_op(dtype, world * target.replicate_world, target.divide_factor, target.force_sum)
    if world > 1:
        if _debug.enabled():
            _debug.log_collective("reduce_scatter", target.label, group, f"{world} x {total} elements", dtype,
                                  target.root)
        if _bytes._ACTIVE:
            _bytes.count("reduce_scatter", total * dtype.itemsize, group)
    streams = streams_for(device)
    with streams.side("reduce_scatter"):
        send = comm.allocate((world * total,), dtype=dtype, device=device)
        copy_rank_major(send.view(world, total), layouts, grads, offs)
        held_grads = tuple(grads) if streams.cuda else ()
        grads.clear()  # the caller's list: the gradients are freed before the output exists
        if pre is not None and pre != 1:
            send.div_(pre)
        if world == 1:  # nothing to scatter: the send buffer is the result
            output, work = send, None
        else:
            output = comm.allocate((total,), dtype=dtype, device=device)
            work = comm(output, send, group, op, async_op=True)
        done = streams.issued(work)
    # CUDA: the copy-in ran on the reduce-scatter stream; hold the full gradients until the
    # compute stream waited on it. CPU: copied already, freed (``grads`` emptied) above.
    held = (send, *held_grads)
    return FlatReduceScatter(done, tuple(layouts), tuple(offs), op, post, target, output, held)


def _start_quantized_reduce_scatter(
    comm: ReduceScatter, block: int, layouts: Sequence[Chunking], grads: list[torch.Tensor], dtype: torch.dtype,
    target: ReduceTarget, device: torch.device, residuals: Sequence[torch.Tensor] | None = None,
    bits: int = 8,
) -> ReduceScatterInFlight:
    """The reduce-scatter of ``grads`` as an int8 (``bits=4``: int4) all-to-all (``target.world > 1``).

    The gradients are laid out rank-major as for the flat reduce-scatter, in ``dtype``; each
    destination rank's row is quantized per ``block`` (with ``residuals``: error feedback) and
    the rows exchanged with one ``all_to_all_single`` of bytes; the receiver dequantizes the
    ``world`` rows it got and sums them (``_collectives.QuantizedReduction``).
    """
    world, group = target.world, target.group
    plan = QuantizedReduction.plan(layouts, dtype, target, block, bits)
    chunks = plan.chunks
    streams = streams_for(device)
    with streams.side("reduce_scatter"):
        staged = torch.empty((world, chunks.numel), dtype=dtype, device=device)
        copy_rank_major(staged, layouts, grads, plan.offsets)
        held_grads = tuple(grads) if streams.cuda else ()
        grads.clear()  # the caller's list: the gradients are freed before the output exists
        send = comm.allocate((world * chunks.chunk_bytes,), dtype=torch.uint8, device=device)
        plan.quantize(staged, send, residuals)
        held = (staged, send, *held_grads) if streams.cuda else (send,)
        del staged
        recv = comm.allocate((world * chunks.chunk_bytes,), dtype=torch.uint8, device=device)
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
        output = None
        if streams.cuda:  # the side stream waits for the bytes, then sums them
            work.wait()
            work = None
            output = plan.summed(recv, dtype)
        done = streams.issued(work)
    return QuantizedReduceScatter(done, tuple(layouts), target, plan, recv, dtype, output, held)
