"""The planner's side of ``QuantizedComm``: fsdp2's own quantization run on fake tensors.

A group whose weights or gradients are quantized holds different buffers from an
unquantized one, and its quantize and dequantize steps make temporaries several times the
size of a chunk. Rather than keep their sizes by hand, the schedule (``_schedule.py``)
allocates the collectives' buffers as fake tensors in the planner's timeline and calls the
functions the transports call (``comm/_quantize.py``), so the timeline counts every
temporary op by op as ``MemoryTracker`` counts it on a real run. Buffers made while a
collective is issued are communication, as the tracker labels them; the dequantization at
the wait makes activations there, and here. The order of the allocations follows the
group's transport: the flat one's ``_quantized_slice`` and ``_start_quantized_reduce_scatter``
(``comm/_flat.py``), or the CPU exchange's ``start_all_gather`` and ``_start_quantized``
(``comm/cpu/_transport.py``), whose small buffers of its own (headers, packed chunks,
descriptors) are counted by its ``quantized_buffer_needs``. The quantization and the sum
are ``comm/_collectives.QuantizedReduction``'s on both, called here too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from .._api import QuantizedComm
from .._format import HEADER, GatherFormat, packed_offsets
from ..comm._collectives import QuantizedReduction, quantized_all_reduce
from ..comm._quantize import GradChunks, dequantize_entries, quantize_entries
from ..comm._transport import Transport, flat_transport

if TYPE_CHECKING:
    from ._planner import _Timeline
    from ._schedule import _Group

__all__ = ["QuantizedGroup", "residual_bytes"]


def residual_bytes(group: _Group, policy: QuantizedComm | None, world: int) -> int:
    """Error feedback's residuals of a group: one fp32 ``(world, local_numel)`` tensor per
    trainable floating-point parameter, kept from the first reduction on."""
    if policy is None or not policy.error_feedback or world == 1:
        return 0
    return sum(world * lay.local_numel * 4 for lay, trained in zip(group.layouts, group.trained) if trained)


def wire_bytes(group: _Group, policy: QuantizedComm | None, world: int, replicas: int) -> tuple[int, int, int]:
    """What one all-gather and one reduce-scatter of ``group`` over ``world`` ranks move, all
    ranks' parts together, and what HSDP's all-reduce over ``replicas`` moves (its two passes):
    as ``policy`` sends them (None: unquantized, in the gathered and the reduce dtype)."""
    block = policy.weight_block if policy is not None and world > 1 else 0
    gathered = GatherFormat.build(group.layouts, group.gather_dtypes, block, policy.weight_bits).slice_bytes \
        * world - HEADER * world if block else group.unsharded
    reduced, shard_out = group.reduce, group.reduce // world
    if policy is not None and policy.grad_block and world > 1:
        reduced = world * GradChunks(world, sum(lay.local_numel for lay in group.layouts), policy.grad_block,
                                     policy.grad_bits).chunk_bytes
    all_reduce = 2 * shard_out
    if policy is not None and policy.replicate_grad_block and replicas > 1:
        chunk = -(-sum(lay.local_numel for lay in group.layouts) // replicas)  # elements of each replica's part
        all_reduce = replicas * (GradChunks(replicas, chunk, policy.replicate_grad_block, policy.grad_bits).chunk_bytes
                                 + GradChunks(1, chunk, policy.replicate_grad_block, policy.grad_bits).chunk_bytes)
    return gathered, reduced, all_reduce


class QuantizedGroup:
    """One group's quantized collectives on the planner's timeline (world > 1), on ``transport``
    (the group's, as ``runtime/_group.refresh_transports`` picks it; default the flat one)
    over ``backend``; ``reads``: the exchanges read the peers' memory."""

    def __init__(self, line: _Timeline, group: _Group, policy: QuantizedComm, world: int,
                 reduce_dtype: torch.dtype, replicas: int = 1, transport: Transport | None = None,
                 backend: str = "nccl", reads: bool = False) -> None:
        self.line, self.group, self.world, self.replicas = line, group, world, replicas
        self.replicate_block = policy.replicate_grad_block if replicas > 1 else 0
        self.replicate_bits = policy.grad_bits or 8
        self.error_feedback = policy.error_feedback
        self.fmt = GatherFormat.build(group.layouts, group.gather_dtypes, policy.weight_block, policy.weight_bits) \
            if policy.weight_block and world > 1 else None  # (one rank: nothing sent, nothing quantized)
        self.dtype = reduce_dtype
        self.reduction = None
        if policy.grad_block and world > 1:
            offsets, total = packed_offsets([lay.local_numel for lay in group.layouts], align=False)
            acc = reduce_dtype if reduce_dtype.itemsize > 4 else torch.float32
            self.reduction = QuantizedReduction(GradChunks(world, total, policy.grad_block, policy.grad_bits),
                                                tuple(offsets), dist.ReduceOp.SUM, None, float(world), acc)
        transport = transport if transport is not None else flat_transport()
        # The exchange receives the slices in place, into a rank-major buffer that this rank's own
        # is quantized into; the flat transport quantizes into a send slice, then allocates its output.
        self.in_place = transport.gathers_in_place
        self.header = transport.reduce_headers  # a reduce header, made before the gradients are staged
        self.needs = transport.quantized_buffer_needs(self.fmt.slice_bytes if self.fmt is not None else 0,
                                                      self.reduction.chunks.chunk_bytes if self.reduction else 0,
                                                      world, backend, reads)

    @property
    def gathers(self) -> bool:
        return self.fmt is not None

    @property
    def reduces(self) -> bool:
        return self.reduction is not None

    @property
    def reduce_bytes(self) -> int:
        """The transport's own buffers of a reduce-scatter in flight, made after the packed rows."""
        return self.needs.reduce_sent + self.needs.reduce_received

    def start_all_gather(self) -> tuple[torch.Tensor, ...]:
        """This rank's quantized slice, written from its shards, and the output (communication):
        the flat transport's send slice and output, or the exchange's rank-major slices."""
        fmt = self.fmt
        entries = [self.line.uncounted(lay.local_shape, dt)
                   for lay, dt in zip(fmt.layouts, self.group.shard_dtypes)]
        with self.line.born_as("communication"):
            if self.in_place:
                output = torch.empty((self.world, fmt.slice_bytes), dtype=torch.uint8)
                quantize_entries(fmt, entries, output[0])
                return (output,)
            send = torch.empty(fmt.slice_bytes, dtype=torch.uint8)
            quantize_entries(fmt, entries, send)
            output = torch.empty(self.world * fmt.slice_bytes, dtype=torch.uint8)
        return send, output

    def finish_all_gather(self, held: tuple[torch.Tensor, ...]) -> None:
        """Dequantize the output into the unsharded buffer (simulated apart: its bytes are
        the schedule's); the temporaries are counted as they are made."""
        fmt = self.fmt
        targets = [self.line.uncounted((self.world, *lay.local_shape), dt)
                   for lay, dt in zip(fmt.layouts, fmt.dtypes)]
        dequantize_entries(fmt, held[-1], targets)

    def start_reduce_scatter(self, drop_grads: Callable[[], None]) -> tuple[torch.Tensor | None, ...]:
        """The gradients copied rank-major, freed, quantized per destination rank (with the
        residuals, uncounted here: they are the step's constants), and the receive buffer:
        what stays in flight (communication), with the reduce header where the transport
        sends one, and after them the transport's own buffers (``reduce_bytes``)."""
        chunks = self.reduction.chunks
        # One per tensor, aligned with the reduction's offsets (their bytes: ``residual_bytes``).
        residuals = [self.line.uncounted((self.world, lay.local_numel), torch.float32)
                     for lay in self.group.layouts] if self.error_feedback else None
        with self.line.born_as("communication"):
            header = torch.empty(HEADER, dtype=torch.uint8) if self.header else None
            staged = torch.empty((self.world, chunks.numel), dtype=self.dtype)
            drop_grads()
            send = torch.empty(self.world * chunks.chunk_bytes, dtype=torch.uint8)
            self.reduction.quantize(staged, send, residuals)
            del staged
            recv = torch.empty(self.world * chunks.chunk_bytes, dtype=torch.uint8)
        self.line.add_bytes("communication", self.reduce_bytes)
        return send, recv, header

    def finish_reduce_scatter(self, held: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """This rank's reduced row, summed from the received rows (the reduce-scatter's output)."""
        return self.reduction.summed(held[1], self.dtype)

    def all_reduce(self, out: torch.Tensor | None) -> None:
        """HSDP's quantized all-reduce of the reduce-scatter's output ``out`` (None: one the
        schedule counts apart, stood for by an uncounted tensor), if the replicas' is quantized."""
        if not self.replicate_block:
            return
        if out is None:
            total = sum(lay.local_numel for lay in self.group.layouts)
            out = self.line.uncounted((total,), self.dtype)
        quantized_all_reduce(out, self.replicas, self.replicate_block, self.replicate_bits, True, _nothing, _nothing)


def _nothing(_output: torch.Tensor, _input: torch.Tensor) -> None:
    """A collective that moves nothing: the planner counts the buffers, not the bytes sent."""
