"""The CPU exchange's stand-in for the memory planner (``_standin.py`` says why one is needed).

Imported only where a planned group takes the exchange (gloo, groups of ``EXCHANGE_MIN_BYTES``
or more, or ``FSDP2_CPU_COLLECTIVES``), as the real CPU transport is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from .._format import HEADER, GatherFormat, packed_offsets
from ..comm._collectives import (AllGatherInFlight, QuantizedReduction, ReduceScatterInFlight, ReduceTarget,
                                 copy_rank_major, reduce_op)
from ..comm._quantize import dequantize_entries, quantize_entries
from ..comm._streams import Completion
from ..comm._transport import GatherSource, GroupBytes, Transport
from ..comm.cpu._transport import ExchangeTransport

if TYPE_CHECKING:
    from .._format import Chunking
    from ..comm._collectives import GatherTargets

__all__ = ["PlannedExchange"]


class _PlannedGather(AllGatherInFlight):
    """The exchange all-gather's record: its headers and descriptors (or packed small chunks)
    in one buffer, until the wait, or until the reshard where peers read (``release``); with
    quantized weights, every rank's quantized slice (``quantized``, rank-major), dequantized at
    the finish."""

    __slots__ = ("held", "quantized", "_release")

    def __init__(self, fmt: GatherFormat, transport: Transport, held: torch.Tensor, until_reshard: bool,
                 quantized: torch.Tensor | None = None) -> None:
        super().__init__(Completion(), fmt, held[:fmt.world * HEADER].view(fmt.world, HEADER), transport)
        self.held, self.quantized = held, quantized
        self._release = Completion() if until_reshard else None

    def release(self) -> Any:
        return self._release

    def buffers(self) -> list[torch.Tensor]:
        return [self.held] + ([self.quantized] if self.quantized is not None else [])


class _PlannedReduce(ReduceScatterInFlight):
    """The exchange reduce-scatter's record: what it sends, the rows it receives and the output;
    the gradients it sends from (``grads``) live as long as it does."""

    __slots__ = ("output", "held", "grads")

    def __init__(self, layouts: tuple[Chunking, ...], offsets: tuple[int, ...], op: dist.ReduceOp,
                 post_divide: float | None, target: ReduceTarget, output: torch.Tensor,
                 held: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...]) -> None:
        super().__init__(Completion(), layouts, offsets, op, post_divide, target)
        self.output, self.held, self.grads = output, held, grads

    def wait(self, sizes: str) -> torch.Tensor:
        return self.output

    def buffers(self) -> list[torch.Tensor]:
        return [*self.held, self.output]


class _PlannedQuantizedReduce(ReduceScatterInFlight):
    """The exchange's quantized reduce-scatter: the packed rows it sends and receives (its own
    small buffers beside), summed at the wait as the real one's."""

    __slots__ = ("plan", "recv", "dtype", "held")

    def __init__(self, layouts: tuple[Chunking, ...], target: ReduceTarget, plan: QuantizedReduction,
                 recv: torch.Tensor, dtype: torch.dtype, held: tuple[torch.Tensor, ...]) -> None:
        super().__init__(Completion(), layouts, plan.offsets, plan.op, plan.post_divide, target)
        self.plan, self.recv, self.dtype, self.held = plan, recv, dtype, held

    def wait(self, sizes: str) -> torch.Tensor:
        return self.plan.summed(self.recv, self.dtype)

    def buffers(self) -> list[torch.Tensor]:
        return [*self.held, self.recv]


class PlannedExchange(ExchangeTransport):
    """The CPU exchange's buffers, sized by its ``buffer_needs``, without peers to exchange with.

    ``reads``: the ranks read each other's memory (one host) rather than send messages.
    """

    def __init__(self, may_read: bool, must_read: bool, grad_block: int = 0, grad_bits: int = 8, *,
                 reads: bool) -> None:
        super().__init__(may_read, must_read, grad_block, grad_bits)
        self._plan_reads = reads and may_read

    def probe(self, pg: dist.ProcessGroup) -> None:
        """Nothing to find out: the layout says whether the ranks read each other's memory."""

    def reads(self, pg: dist.ProcessGroup) -> bool:
        return self._plan_reads

    def quantizing_gradients(self, block: int, bits: int) -> Transport:
        return PlannedExchange(self.may_read, self.must_read, block, bits, reads=self._plan_reads)

    def start_all_gather(self, source: GatherSource, fmt: GatherFormat, pg: dist.ProcessGroup,
                         header: torch.Tensor | None, explicit: bool) -> AllGatherInFlight:
        """The unsharded buffer now (received into in place), and the headers and descriptors
        or packed small chunks, kept until the peers have read (reads) or the wait. Quantized
        weights (``fmt.block``): this rank's quantized slice in its row of a rank-major buffer
        (``quantize_entries``), the peers' rows received there, dequantized at the finish."""
        if fmt.block:
            quantized = torch.empty(fmt.world, fmt.slice_bytes, dtype=torch.uint8, device=source.device)
            with torch.no_grad():
                quantize_entries(fmt, source.entries(fmt), quantized[pg.rank()])
            needs = self.quantized_buffer_needs(fmt.slice_bytes, 0, fmt.world, "gloo", self._plan_reads)
            held = torch.empty(needs.gather, dtype=torch.uint8, device=source.device)
            return _PlannedGather(fmt, self, held, needs.gather_until_reshard, quantized)
        source.targets(fmt)  # allocates the unsharded buffer
        sizes = GroupBytes(entries=[(lay.local_numel * dt.itemsize, 0, False)
                                    for lay, dt in zip(fmt.layouts, fmt.dtypes)])
        needs = self.buffer_needs(sizes, fmt.world, "gloo", self._plan_reads)
        held = torch.empty(needs.gather, dtype=torch.uint8, device=source.device)
        return _PlannedGather(fmt, self, held, needs.gather_until_reshard)

    def finish_all_gather(self, inflight: _PlannedGather, targets: GatherTargets) -> None:
        """The chunks arrived in place: nothing to copy out (quantized: dequantized into them)."""
        if inflight.quantized is not None:
            with torch.no_grad():
                dequantize_entries(inflight.fmt, inflight.quantized, targets.chunks)

    def start_reduce_scatter(self, layouts: Sequence[Chunking], grads: list[torch.Tensor], dtype: torch.dtype,
                             target: ReduceTarget, device: torch.device, header: torch.Tensor | None,
                             residuals: Sequence[torch.Tensor] | None = None) -> ReduceScatterInFlight:
        """The copies it sends (to cast or pad), one row per peer received into, and the output;
        the gradients sent from where they are stay alive until it finishes."""
        world = target.world
        if world == 1:
            return self._local.start_reduce_scatter(layouts, grads, dtype, target, device, header)
        if self.grad_block:
            return self._start_quantized(layouts, grads, dtype, target, device, header, residuals)
        op, _pre, post = reduce_op(dtype, world * target.replicate_world, target.divide_factor, target.force_sum)
        if op == dist.ReduceOp.AVG:  # the exchange sums; the average is a division after
            post = float(world) * (post or 1.0)
        needs = self.buffer_needs(_layout_bytes(layouts, grads, dtype, world), world, "gloo", self._plan_reads)
        offsets, numel = packed_offsets([lay.local_numel for lay in layouts], align=False)
        output = torch.empty(numel, dtype=dtype, device=device)
        held_header = () if header is None else (header,)
        rest = needs.reduce_received - output.nbytes - HEADER * len(held_header)
        sent = torch.empty(needs.reduce_sent, dtype=torch.uint8, device=device)
        received = torch.empty(max(rest, 0), dtype=torch.uint8, device=device)
        kept = tuple(grads) if needs.reduce_holds_gradients else ()
        grads.clear()
        return _PlannedReduce(tuple(layouts), tuple(offsets), op, post, target, output,
                              (sent, received, *held_header), kept)


    def _start_quantized(self, layouts: Sequence[Chunking], grads: list[torch.Tensor], dtype: torch.dtype,
                         target: ReduceTarget, device: torch.device, header: torch.Tensor | None,
                         residuals: Sequence[torch.Tensor] | None) -> ReduceScatterInFlight:
        """As the exchange's: the gradients staged rank-major and freed, quantized into one packed
        row per rank (``QuantizedReduction``), the rows received, the exchange's own buffers."""
        world = target.world
        plan = QuantizedReduction.plan(layouts, dtype, target, self.grad_block, self.grad_bits)
        staged = torch.empty((world, plan.chunks.numel), dtype=dtype, device=device)
        copy_rank_major(staged, layouts, grads, plan.offsets)
        grads.clear()
        send = torch.empty(world, plan.chunks.chunk_bytes, dtype=torch.uint8, device=device)
        plan.quantize(staged, send, residuals)
        del staged
        recv = torch.empty_like(send)
        needs = self.quantized_buffer_needs(0, plan.chunks.chunk_bytes, world, "gloo", self._plan_reads)
        own = (torch.empty(needs.reduce_sent, dtype=torch.uint8, device=device),
               torch.empty(needs.reduce_received, dtype=torch.uint8, device=device))
        held_header = () if header is None else (header,)
        return _PlannedQuantizedReduce(tuple(layouts), target, plan, recv, dtype, (send, *own, *held_header))


def _layout_bytes(layouts: Sequence[Chunking], grads: Sequence[torch.Tensor], dtype: torch.dtype,
                  world: int) -> GroupBytes:
    """The reduce-scatter's side of ``GroupBytes`` for gradients ``grads`` cut as ``layouts``."""
    out = GroupBytes()
    predivide = dtype not in (torch.float32, torch.bfloat16)
    for lay, grad in zip(layouts, grads):
        rows = lay.shape[lay.dim] if lay.shape else 1
        reduced = lay.local_numel * world * dtype.itemsize
        out.reduce += reduced
        floating = dtype.is_floating_point
        copied = floating and (grad.dtype != dtype or predivide) or lay.chunk * world != rows
        out.entries.append((0, reduced, copied))
    return out
